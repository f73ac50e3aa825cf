//! The history checker: what clients were told (the history) held against what the cluster
//! holds once the faults have stopped (an observation). Pure: no I/O, so every rule is
//! unit-tested, a planted loss among them.
//!
//! The rules, each a figure of the verdict:
//! - **lost**: a create the client got a 201 for, never asked to end, that no node holds where
//!   its manifest says (or that has no manifest, or one that is not running or paused);
//! - **duplicated**: a sandbox running on more than one node;
//! - **files_lost**: a file write the client got a 2xx for whose content is not read back;
//! - **accounting_error**: a manifest naming a node that does not hold it, and every unit by
//!   which placement's belief about a node differs from the node's own listing (vCPUs,
//!   sandbox count, reservations never confirmed or removals never seen);
//! - **stuck_manifests**: a manifest still `creating`, or still owned by a move;
//! - **leaked**: a copy on a node that no manifest places there, a sandbox folder or cgroup
//!   on a node that the node does not list.
//!
//! A create whose reply was lost may or may not exist afterwards; either is fine, as long as
//! what exists is accounted. A kill whose reply was lost likewise.

use std::collections::{BTreeMap, BTreeSet};

use node_svc::runtime::container::spare_cgroups;
use serde::Serialize;

/// What a client was told, in the order it was told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A create answered 201 with this sandbox ID.
    Created { id: String },
    /// A kill was sent (answered or not): the sandbox may be gone, deliberately.
    Ended { id: String },
    /// A file write answered 2xx: `path` in sandbox `id` holds `content`.
    Wrote { id: String, path: String, content: String },
}

/// A manifest as the checker needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub id: String,
    /// `running`, `paused`, `creating`, `hibernated`.
    pub phase: String,
    pub node_id: String,
    /// The lifecycle owner (a move, a user operation), empty when none.
    pub owner: String,
}

/// One sandbox as a node lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Copy {
    pub id: String,
    pub running: bool,
    pub vcpus: u32,
}

/// Placement's belief about one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Belief {
    pub vcpus: u32,
    pub sandboxes: u32,
    pub pending: u32,
    pub unconfirmed: u32,
}

/// What one node holds: its listing, and the folders and cgroups found on its host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeHolding {
    pub copies: Vec<Copy>,
    pub folders: BTreeSet<String>,
    pub cgroups: BTreeSet<String>,
    /// `None` when placement does not know the node.
    pub belief: Option<Belief>,
}

/// The cluster once the faults have stopped.
#[derive(Clone, Debug, Default)]
pub struct Observation {
    pub manifests: Vec<Manifest>,
    pub nodes: BTreeMap<String, NodeHolding>,
    /// Files read back: (sandbox, path) → content, `None` when the read failed.
    pub files: BTreeMap<(String, String), Option<String>>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Verdict {
    pub lost: u64,
    pub duplicated: u64,
    pub files_lost: u64,
    pub accounting_error: u64,
    pub stuck_manifests: u64,
    pub leaked: u64,
    /// The first findings, in words, for whoever reads a failed run.
    #[serde(skip)]
    pub findings: Vec<String>,
}

impl Verdict {
    pub fn clean(&self) -> bool {
        self.lost + self.duplicated + self.files_lost + self.accounting_error + self.stuck_manifests + self.leaked == 0
    }

    fn note(&mut self, finding: String) {
        if self.findings.len() < 30 {
            self.findings.push(finding);
        }
    }
}

/// Sandboxes that must exist: created with an answer, never asked to end.
pub fn expected_alive(history: &[Event]) -> BTreeSet<String> {
    let mut alive = BTreeSet::new();
    for event in history {
        match event {
            Event::Created { id } => {
                alive.insert(id.clone());
            }
            Event::Ended { id } => {
                alive.remove(id);
            }
            Event::Wrote { .. } => {}
        }
    }
    alive
}

/// The last acknowledged content of every file of a sandbox that must exist.
pub fn expected_files(history: &[Event]) -> BTreeMap<(String, String), String> {
    let alive = expected_alive(history);
    let mut files = BTreeMap::new();
    for event in history {
        if let Event::Wrote { id, path, content } = event {
            if alive.contains(id) {
                files.insert((id.clone(), path.clone()), content.clone());
            }
        }
    }
    files
}

/// A node's spares (its names that begin with `prefix`), and the rest of its names.
fn spares_apart<'a>(names: &'a BTreeSet<String>, prefix: &str) -> (Vec<&'a String>, Vec<&'a String>) {
    names.iter().partition(|name| name.starts_with(prefix))
}

/// Holds the history against the observation. Files are judged only when `obs.files` has
/// been filled in (reading them needs the accounting to be settled first).
pub fn check(history: &[Event], obs: &Observation) -> Verdict {
    let mut v = Verdict::default();
    let manifests: BTreeMap<&str, &Manifest> = obs.manifests.iter().map(|m| (m.id.as_str(), m)).collect();
    let holds = |node: &str, id: &str| obs.nodes.get(node).is_some_and(|n| n.copies.iter().any(|c| c.id == id));

    for id in expected_alive(history) {
        let found = match manifests.get(id.as_str()) {
            None => Err("no manifest".to_string()),
            Some(m) if m.phase != "running" && m.phase != "paused" => Err(format!("manifest {}", m.phase)),
            Some(m) if !holds(&m.node_id, &id) => Err(format!("{} does not hold it", m.node_id)),
            Some(_) => Ok(()),
        };
        if let Err(why) = found {
            v.lost += 1;
            v.note(format!("lost {id}: {why}"));
        }
    }

    let mut running_on: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (node, holding) in &obs.nodes {
        for copy in holding.copies.iter().filter(|c| c.running) {
            running_on.entry(copy.id.as_str()).or_default().push(node.as_str());
        }
    }
    for (id, nodes) in running_on.iter().filter(|(_, nodes)| nodes.len() > 1) {
        v.duplicated += 1;
        v.note(format!("{id} runs on {nodes:?}"));
    }

    for m in &obs.manifests {
        if m.phase == "creating" || !m.owner.is_empty() {
            v.stuck_manifests += 1;
            v.note(format!("{} stuck: phase {}, owner {:?}", m.id, m.phase, m.owner));
        }
        if (m.phase == "running" || m.phase == "paused") && !holds(&m.node_id, &m.id) {
            v.accounting_error += 1;
            v.note(format!(
                "manifest of {} names {}, which does not hold it",
                m.id, m.node_id
            ));
        }
    }

    for (node, holding) in &obs.nodes {
        let listed: BTreeSet<&str> = holding.copies.iter().map(|c| c.id.as_str()).collect();
        for copy in &holding.copies {
            if manifests.get(copy.id.as_str()).is_none_or(|m| m.node_id != *node) {
                v.leaked += 1;
                v.note(format!("{node} holds {}, which no manifest places there", copy.id));
            }
        }
        // Spare disks and cgroups are the node's own, listed as no sandbox: a leak only past
        // as many as it keeps.
        let (spare_disks, folders) = spares_apart(&holding.folders, node_svc::disk::SPARE_PREFIX);
        let (spare_groups, cgroups) = spares_apart(&holding.cgroups, spare_cgroups::PREFIX);
        for (what, spares, kept) in [
            ("spare disks", spare_disks, node_svc::host::DEFAULT_SPARE_DISKS),
            ("spare cgroups", spare_groups, spare_cgroups::LIMIT),
        ] {
            if spares.len() > kept {
                v.leaked += (spares.len() - kept) as u64;
                v.note(format!("{node} keeps {} {what}: {spares:?}", spares.len()));
            }
        }
        for unlisted in folders
            .into_iter()
            .chain(cgroups)
            .filter(|f| !listed.contains(f.as_str()))
        {
            v.leaked += 1;
            v.note(format!(
                "{node} keeps a folder or cgroup of {unlisted}, which it does not list"
            ));
        }
        let real = Belief {
            vcpus: holding.copies.iter().map(|c| c.vcpus).sum(),
            sandboxes: holding.copies.len() as u32,
            pending: 0,
            unconfirmed: 0,
        };
        match &holding.belief {
            None => {
                v.accounting_error += 1;
                v.note(format!("placement does not know {node}"));
            }
            Some(b) if *b != real => {
                let off =
                    b.vcpus.abs_diff(real.vcpus) + b.sandboxes.abs_diff(real.sandboxes) + b.pending + b.unconfirmed;
                v.accounting_error += u64::from(off.max(1));
                v.note(format!("placement believes {b:?} of {node}, which holds {real:?}"));
            }
            Some(_) => {}
        }
    }

    for (key, content) in expected_files(history) {
        if let Some(read) = obs.files.get(&key) {
            if read.as_deref() != Some(content.as_str()) {
                v.files_lost += 1;
                v.note(format!(
                    "{} in {} reads {read:?}, {content:?} was acknowledged",
                    key.1, key.0
                ));
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn created(id: &str) -> Event {
        Event::Created { id: id.into() }
    }

    fn manifest(id: &str, node: &str) -> Manifest {
        Manifest {
            id: id.into(),
            phase: "running".into(),
            node_id: node.into(),
            owner: String::new(),
        }
    }

    fn copy(id: &str) -> Copy {
        Copy {
            id: id.into(),
            running: true,
            vcpus: 1,
        }
    }

    /// Two sandboxes on n1, one on n2, placement agreeing, folders and cgroups matching.
    fn healthy() -> (Vec<Event>, Observation) {
        let history = vec![created("a"), created("b"), created("c")];
        let mut obs = Observation {
            manifests: vec![manifest("a", "n1"), manifest("b", "n1"), manifest("c", "n2")],
            ..Observation::default()
        };
        for (node, ids) in [("n1", vec!["a", "b"]), ("n2", vec!["c"])] {
            obs.nodes.insert(
                node.into(),
                NodeHolding {
                    copies: ids.iter().map(|id| copy(id)).collect(),
                    folders: ids.iter().map(|id| id.to_string()).collect(),
                    cgroups: ids.iter().map(|id| id.to_string()).collect(),
                    belief: Some(Belief {
                        vcpus: ids.len() as u32,
                        sandboxes: ids.len() as u32,
                        ..Belief::default()
                    }),
                },
            );
        }
        (history, obs)
    }

    #[test]
    fn a_consistent_cluster_is_clean() {
        let (history, obs) = healthy();
        let v = check(&history, &obs);
        assert!(v.clean(), "{v:?}");
    }

    #[test]
    fn a_planted_loss_is_caught() {
        // A sandbox killed on its node behind the control plane's back: its manifest still
        // names the node, and placement still believes in it until the next heartbeat.
        let (history, mut obs) = healthy();
        let n1 = obs.nodes.get_mut("n1").unwrap();
        n1.copies.retain(|c| c.id != "b");
        n1.folders.remove("b");
        n1.cgroups.remove("b");
        let v = check(&history, &obs);
        assert_eq!((v.lost, v.accounting_error), (1, 3), "{v:?}");
        assert!(v.findings.iter().any(|f| f.starts_with("lost b")), "{v:?}");
    }

    #[test]
    fn a_deliberately_ended_sandbox_is_not_lost_and_an_unanswered_create_may_exist() {
        let (mut history, mut obs) = healthy();
        history.push(Event::Ended { id: "b".into() });
        obs.manifests.retain(|m| m.id != "b");
        let n1 = obs.nodes.get_mut("n1").unwrap();
        n1.copies.retain(|c| c.id != "b");
        n1.folders.remove("b");
        n1.cgroups.remove("b");
        n1.belief = Some(Belief {
            vcpus: 1,
            sandboxes: 1,
            ..Belief::default()
        });
        // "d" was created without the client hearing of it: accounted, so fine.
        obs.manifests.push(manifest("d", "n2"));
        let n2 = obs.nodes.get_mut("n2").unwrap();
        n2.copies.push(copy("d"));
        n2.belief = Some(Belief {
            vcpus: 2,
            sandboxes: 2,
            ..Belief::default()
        });
        let v = check(&history, &obs);
        assert!(v.clean(), "{v:?}");
    }

    #[test]
    fn two_running_copies_are_a_duplicate_and_the_extra_one_a_leak() {
        let (history, mut obs) = healthy();
        let n2 = obs.nodes.get_mut("n2").unwrap();
        n2.copies.push(copy("a"));
        n2.belief.as_mut().unwrap().vcpus += 1;
        n2.belief.as_mut().unwrap().sandboxes += 1;
        let v = check(&history, &obs);
        assert_eq!((v.duplicated, v.leaked, v.lost), (1, 1, 0), "{v:?}");
    }

    #[test]
    fn stuck_manifests_leftover_folders_and_placement_drift_are_counted() {
        let (history, mut obs) = healthy();
        obs.manifests[0].owner = "user:pause:1".into();
        obs.manifests.push(Manifest {
            phase: "creating".into(),
            ..manifest("z", "")
        });
        let n2 = obs.nodes.get_mut("n2").unwrap();
        n2.folders.insert("old".into());
        n2.cgroups.insert("old".into());
        n2.belief.as_mut().unwrap().pending = 2;
        let v = check(&history, &obs);
        assert_eq!((v.stuck_manifests, v.leaked, v.accounting_error), (2, 2, 2), "{v:?}");
    }

    #[test]
    fn a_nodes_spare_disks_are_no_leak_up_to_as_many_as_it_keeps() {
        let (history, mut obs) = healthy();
        let n2 = obs.nodes.get_mut("n2").unwrap();
        let spare = |n: usize| format!("{}{n}", node_svc::disk::SPARE_PREFIX);
        n2.folders.extend((0..node_svc::host::DEFAULT_SPARE_DISKS).map(spare));
        assert_eq!(check(&history, &obs).leaked, 0);
        let n2 = obs.nodes.get_mut("n2").unwrap();
        n2.folders.insert(spare(node_svc::host::DEFAULT_SPARE_DISKS));
        let v = check(&history, &obs);
        assert_eq!(v.leaked, 1, "{v:?}");
    }

    #[test]
    fn a_nodes_spare_cgroups_are_no_leak_up_to_as_many_as_it_keeps() {
        let (history, mut obs) = healthy();
        let spare = |n: usize| format!("{}{n}", spare_cgroups::PREFIX);
        let n2 = obs.nodes.get_mut("n2").unwrap();
        n2.cgroups.extend((0..spare_cgroups::LIMIT).map(spare));
        assert_eq!(check(&history, &obs).leaked, 0);
        let n2 = obs.nodes.get_mut("n2").unwrap();
        n2.cgroups.insert(spare(spare_cgroups::LIMIT));
        let v = check(&history, &obs);
        assert_eq!(v.leaked, 1, "{v:?}");
    }

    #[test]
    fn a_file_is_lost_when_its_acknowledged_content_does_not_read_back() {
        let (mut history, mut obs) = healthy();
        let wrote = |id: &str, path: &str, content: &str| Event::Wrote {
            id: id.into(),
            path: path.into(),
            content: content.into(),
        };
        history.push(wrote("a", "/tmp/1", "one"));
        history.push(wrote("a", "/tmp/1", "two"));
        history.push(wrote("c", "/tmp/2", "three"));
        // Only the last acknowledged content counts.
        obs.files.insert(("a".into(), "/tmp/1".into()), Some("two".into()));
        obs.files.insert(("c".into(), "/tmp/2".into()), None);
        let v = check(&history, &obs);
        assert_eq!(v.files_lost, 1, "{v:?}");
        assert_eq!(expected_files(&history).len(), 2);
    }
}
