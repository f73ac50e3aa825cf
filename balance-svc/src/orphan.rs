//! Orphaned copies: a paused sandbox a node still holds though no manifest sends anyone to it.
//!
//! A move that rolls back while its target cannot be reached leaves the restored (paused)
//! copy there; a user's kill that reached the manifest but not the node leaves the copy with
//! no manifest at all. Either way the copy holds memory the node reports as allocated, and
//! nobody will ever resume it. The sweep finds such copies and, after a grace period, kills
//! them on their node.
//!
//! What counts is deliberately narrow, because killing a copy that is wanted would lose a
//! sandbox: only a *paused* copy, and only when the sandbox's manifest is gone or names
//! another node while no move owns it. Running copies are never touched (a create may have
//! reached the node before its manifest was written). A candidate is killed only once it has
//! been seen for the whole grace period, and only after its manifest is read once more.

use std::collections::{BTreeMap, HashMap};

use common::docs::SandboxDoc;

/// One copy as its node lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Copy {
    pub node_id: String,
    pub sandbox_id: String,
    pub epoch: u64,
    pub paused: bool,
}

/// Why a copy is an orphan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The sandbox has no manifest (it was killed).
    NoManifest,
    /// The manifest names another node, and no move owns the sandbox.
    ElsewhereUnowned,
}

impl Why {
    pub fn name(self) -> &'static str {
        match self {
            Why::NoManifest => "no_manifest",
            Why::ElsewhereUnowned => "elsewhere",
        }
    }
}

/// Whether `copy` is an orphan given its sandbox's manifest (if any).
pub fn judge(copy: &Copy, manifest: Option<&SandboxDoc>) -> Option<Why> {
    if !copy.paused {
        return None;
    }
    match manifest {
        None => Some(Why::NoManifest),
        Some(m) if m.node_id != copy.node_id && m.lifecycle_owner.is_none() => Some(Why::ElsewhereUnowned),
        Some(_) => None,
    }
}

/// Every orphan among `copies`.
pub fn find<'a>(copies: &'a [Copy], manifests: &HashMap<&str, &SandboxDoc>) -> Vec<(&'a Copy, Why)> {
    copies
        .iter()
        .filter_map(|c| judge(c, manifests.get(c.sandbox_id.as_str()).copied()).map(|why| (c, why)))
        .collect()
}

/// When each orphan was first seen, so that only one seen for the whole grace period is
/// removed. A copy that stops being an orphan (resumed, its manifest points at it again)
/// is forgotten.
#[derive(Debug, Default)]
pub struct Sightings {
    first_seen_ms: BTreeMap<(String, String, u64), u64>,
}

impl Sightings {
    /// Records this sweep's orphans at `now_ms`; returns those seen for at least `grace_ms`.
    pub fn update<'a>(&mut self, orphans: &[(&'a Copy, Why)], now_ms: u64, grace_ms: u64) -> Vec<(&'a Copy, Why)> {
        let mut seen = BTreeMap::new();
        let mut due = Vec::new();
        for (copy, why) in orphans {
            let key = (copy.node_id.clone(), copy.sandbox_id.clone(), copy.epoch);
            let first = self.first_seen_ms.get(&key).copied().unwrap_or(now_ms);
            if now_ms.saturating_sub(first) >= grace_ms {
                due.push((*copy, *why));
            }
            seen.insert(key, first);
        }
        self.first_seen_ms = seen;
        due
    }

    /// Whether no orphan is being watched.
    pub fn is_empty(&self) -> bool {
        self.first_seen_ms.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(node: &str, id: &str, paused: bool) -> Copy {
        Copy {
            node_id: node.into(),
            sandbox_id: id.into(),
            epoch: 3,
            paused,
        }
    }

    fn manifest(node: &str, owner: Option<&str>) -> SandboxDoc {
        SandboxDoc {
            lifecycle_owner: owner.map(str::to_string),
            ..crate::view::tests::manifest("s", node, common::docs::SandboxPhase::Paused)
        }
    }

    #[test]
    fn only_a_paused_copy_nobody_points_at_is_an_orphan() {
        let here = manifest("a", None);
        let elsewhere = manifest("b", None);
        let moving = manifest("b", Some("plan.0"));
        // Its own node: wanted, paused or not.
        assert_eq!(judge(&copy("a", "s", true), Some(&here)), None);
        // Elsewhere and unowned: the leftover of a rollback.
        assert_eq!(
            judge(&copy("a", "s", true), Some(&elsewhere)),
            Some(Why::ElsewhereUnowned)
        );
        // Elsewhere while a move owns it: the move's own source or target.
        assert_eq!(judge(&copy("a", "s", true), Some(&moving)), None);
        // No manifest: killed by its user.
        assert_eq!(judge(&copy("a", "s", true), None), Some(Why::NoManifest));
        // Running copies are never orphans, whatever the manifest says.
        assert_eq!(judge(&copy("a", "s", false), None), None);
        assert_eq!(judge(&copy("a", "s", false), Some(&elsewhere)), None);
    }

    #[test]
    fn an_orphan_is_due_only_after_the_grace_period_and_forgotten_when_it_recovers() {
        let c = copy("a", "s", true);
        let mut s = Sightings::default();
        assert!(s.update(&[(&c, Why::NoManifest)], 1_000, 60_000).is_empty());
        assert!(s.update(&[(&c, Why::NoManifest)], 60_999, 60_000).is_empty());
        assert_eq!(s.update(&[(&c, Why::NoManifest)], 61_000, 60_000).len(), 1);
        // Not an orphan in one sweep: the clock starts again.
        assert!(s.update(&[], 62_000, 60_000).is_empty());
        assert!(s.is_empty());
        assert!(s.update(&[(&c, Why::NoManifest)], 63_000, 60_000).is_empty());
        // A new epoch is a new copy.
        let newer = Copy { epoch: 4, ..c.clone() };
        assert!(s.update(&[(&newer, Why::NoManifest)], 200_000, 60_000).is_empty());
    }
}
