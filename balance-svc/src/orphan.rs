//! Orphaned copies: a sandbox a node still holds though no manifest sends anyone to it.
//!
//! A move that rolls back while its target cannot be reached leaves the restored (paused)
//! copy there; a user's kill that reached the manifest but not the node leaves the copy with
//! no manifest at all; a create whose node call broke after it was sent, and which was then
//! made on another node, leaves a running copy beside the one its manifest names. Each holds
//! memory the node reports as allocated, and nobody will ever reach it; a running one goes on
//! running its tenant's code (with the tenant's secrets) after the tenant was told it was
//! gone. The sweep finds such copies and, after a grace period, kills them on their node.
//!
//! What counts is deliberately narrow, because killing a copy that is wanted would lose a
//! sandbox: only a copy whose manifest is gone, or names another node while no move or user
//! operation owns it. A copy whose manifest is still `creating` is never one: that create is
//! in progress, or abandoned half-way and the gateway's reaper's to resolve (it adopts the
//! copy a node runs). The gateway writes a manifest before it asks any node for the sandbox,
//! so a running copy with none, seen for the whole grace period and then read once more, is
//! not a create under way. A candidate is killed only once it has been seen for the whole
//! grace period, and only after its manifest is read once more.

use std::collections::{BTreeMap, HashMap};

use common::docs::{SandboxDoc, SandboxPhase};

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
    match manifest {
        None => Some(Why::NoManifest),
        Some(m) if m.phase == SandboxPhase::Creating => None,
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
    fn only_a_copy_nobody_points_at_is_an_orphan() {
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
        // Running copies alike: a kill that never reached the node, a create made twice.
        assert_eq!(judge(&copy("a", "s", false), None), Some(Why::NoManifest));
        assert_eq!(
            judge(&copy("a", "s", false), Some(&elsewhere)),
            Some(Why::ElsewhereUnowned)
        );
        assert_eq!(judge(&copy("a", "s", false), Some(&here)), None);
        assert_eq!(judge(&copy("a", "s", false), Some(&moving)), None);
        // A create in progress, or the reaper's to resolve: never, running or paused.
        let creating = SandboxDoc {
            phase: common::docs::SandboxPhase::Creating,
            node_id: String::new(),
            ..manifest("a", None)
        };
        assert_eq!(judge(&copy("a", "s", false), Some(&creating)), None);
        assert_eq!(judge(&copy("a", "s", true), Some(&creating)), None);
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
