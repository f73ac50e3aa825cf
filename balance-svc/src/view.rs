//! From ledger documents to the planner's [`Snapshot`], and whether a finished move has been
//! seen by a heartbeat yet. Pure: the balancer reads the documents, this decides what they say.

use std::collections::{HashMap, HashSet};

use common::docs::{Capacity, NodeDoc, NodeState, SandboxDoc, SandboxPhase};
use common::fit::Allocation;

use common::pool::RetireAsk;

use crate::plan::{Candidate, Move, NodeMemory, Snapshot};
use crate::record::{ControlDoc, DropRecord, MoveRecord, Step};

/// Whether `node` reported within `stale_after_ms` of `now_ms`.
pub fn reported_lately(node: &NodeDoc, now_ms: u64, stale_after_ms: u64) -> bool {
    now_ms.saturating_sub(node.reported_at_unix_ms) < stale_after_ms
}

/// Builds the planner's input. A node is ready when its document says so, the operator has
/// not asked to drain it, and it reported within `stale_after_ms`; a sandbox's memory is what
/// its node measured in the latest heartbeat when that is known (> 0), else its manifest's
/// estimate, which every manifest carries (without one the planner could not tell what a move frees).
/// A pooled sandbox asked to go (and still within [`DROP_PATIENCE_MS`]) is its keeper's: not
/// planned, and its memory counted as already free on its node, so the plans made before the
/// keeper retires it do not move others off that node for the same room.
pub fn snapshot(
    nodes: &[NodeDoc],
    manifests: &[SandboxDoc],
    control: &ControlDoc,
    now_ms: u64,
    stale_after_ms: u64,
) -> Snapshot {
    let measured: HashMap<(&str, &str), u64> = nodes
        .iter()
        .flat_map(|n| {
            n.sandboxes
                .iter()
                .map(move |s| ((n.node_id.as_str(), s.sandbox_id.as_str()), s.memory_used_bytes))
        })
        .collect();
    let memory_of = |m: &SandboxDoc| {
        let measured = measured
            .get(&(m.node_id.as_str(), m.sandbox_id.as_str()))
            .copied()
            .unwrap_or(0);
        if measured > 0 {
            measured
        } else {
            m.memory_bytes
        }
    };
    let mut freeing: HashMap<&str, u64> = HashMap::new();
    for m in manifests.iter().filter(|m| !m.node_id.is_empty() && leaving(m, now_ms)) {
        *freeing.entry(m.node_id.as_str()).or_default() += memory_of(m);
    }
    let nodes_out = nodes
        .iter()
        .map(|n| {
            let draining = n.state == NodeState::Draining || control.draining.contains(&n.node_id);
            let fresh = reported_lately(n, now_ms, stale_after_ms);
            NodeMemory {
                node_id: n.node_id.clone(),
                ready: !draining && fresh && n.state == NodeState::Ready,
                draining,
                capacity_bytes: n.capacity.memory_bytes,
                available_bytes: n
                    .memory_available_bytes
                    .saturating_add(freeing.get(n.node_id.as_str()).copied().unwrap_or(0))
                    .min(n.capacity.memory_bytes.max(n.memory_available_bytes)),
                vcpus: n.capacity.vcpus,
                allocated: Allocation {
                    vcpus: i64::from(n.allocated.vcpus),
                    memory_bytes: i64::try_from(n.allocated.memory_bytes).unwrap_or(i64::MAX),
                },
            }
        })
        .collect();
    let sandboxes = manifests
        .iter()
        .filter(|m| !m.node_id.is_empty())
        .map(|m| {
            Candidate {
                sandbox_id: m.sandbox_id.clone(),
                node_id: m.node_id.clone(),
                memory_bytes: memory_of(m),
                // A pooled sandbox asked to go is its keeper's to retire, for a while.
                lifecycle_owned: m.lifecycle_owner.is_some() || leaving(m, now_ms),
                last_moved_ms: m.last_moved_unix_ms,
                movable: m.phase == SandboxPhase::Running,
                requested: Capacity {
                    vcpus: m.vcpus.max(1),
                    memory_bytes: m.memory_bytes,
                },
                failed: None,
                droppable: droppable(m),
            }
        })
        .collect();
    Snapshot {
        nodes: nodes_out,
        sandboxes,
        now_ms,
    }
}

/// A finished move is reflected once the target's latest document lists the sandbox and the
/// source's no longer does (a rolled-back move: the source lists it and the target does not).
/// Judging the spread before that would count the move twice or not at all.
pub fn reflected(m: &MoveRecord, nodes: &[NodeDoc]) -> bool {
    let lists = |node: &str| {
        nodes
            .iter()
            .find(|n| n.node_id == node)
            .map(|n| n.sandboxes.iter().any(|s| s.sandbox_id == m.sandbox_id))
    };
    let (on_source, on_target) = (lists(&m.from_node), lists(&m.to_node));
    match m.step {
        // A node without a document cannot show anything; do not wait for it forever.
        Step::Done => on_source != Some(true) && on_target != Some(false),
        Step::RolledBack => on_source != Some(false) && on_target != Some(true),
        _ => true,
    }
}

/// How long a pooled sandbox asked to go is left to its keeper: not planned again meanwhile
/// (its room is counted as leaving). A keeper retires it within seconds; one that has not after
/// this long is not coming (a gateway from before drops, none running), and the sandbox is
/// planned, and moved, like any other.
pub const DROP_PATIENCE_MS: u64 = 120_000;

/// Whether pooled sandbox `doc` was asked to go less than [`DROP_PATIENCE_MS`] before `now_ms`.
fn leaving(doc: &SandboxDoc, now_ms: u64) -> bool {
    doc.pool
        .as_ref()
        .and_then(|p| p.retire_asked.as_ref())
        .is_some_and(|ask| now_ms.saturating_sub(ask.at_unix_ms) < DROP_PATIENCE_MS)
}

/// Whether a planned move of `doc` may be a drop instead: ready in its pool, never asked to go
/// (one asked before whose keeper did not act is moved).
pub fn droppable(doc: &SandboxDoc) -> bool {
    doc.ready_in_pool()
}

/// Droppable `doc` (see [`droppable`]) as a plan's drop leaves it: asked to go by `by` at
/// `at_unix_ms`. `None` when it is not droppable.
pub fn asked_to_go(doc: &SandboxDoc, by: &str, at_unix_ms: u64) -> Option<SandboxDoc> {
    if !droppable(doc) {
        return None;
    }
    let mut asked = doc.clone();
    if let Some(pool) = asked.pool.as_mut() {
        pool.retire_asked = Some(RetireAsk {
            by: by.to_string(),
            at_unix_ms,
        });
    }
    Some(asked)
}

/// Splits a plan's moves into those to make and those to drop (`template_of`: a droppable
/// sandbox's template, `None` for any other). A plan that levels drops at most one sandbox of a template, so a pool
/// is never emptied at once (the rest of its planned moves are made: the plan counts on
/// them); a drain drops every one, as the keeper retires a draining node's pooled sandboxes
/// itself.
pub fn split_drops<'a, 't>(
    moves: &'a [Move],
    template_of: impl Fn(&str) -> Option<&'t str>,
    drain: bool,
) -> (Vec<&'a Move>, Vec<&'a Move>) {
    let mut dropped: HashSet<&str> = HashSet::new();
    moves
        .iter()
        .partition(|m| !template_of(&m.sandbox_id).is_some_and(|template| drain || dropped.insert(template)))
}

/// A drop is reflected once its source's latest document no longer lists the sandbox (or the
/// source has no document to wait for).
pub fn drop_reflected(d: &DropRecord, nodes: &[NodeDoc]) -> bool {
    nodes
        .iter()
        .find(|n| n.node_id == d.from_node)
        .is_none_or(|n| n.sandboxes.iter().all(|s| s.sandbox_id != d.sandbox_id))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use common::docs::{Capacity, NodeSandbox};

    fn node(id: &str, state: &str, available: u64, listed: &[(&str, u64)], at: u64) -> NodeDoc {
        NodeDoc {
            node_id: id.into(),
            state: if state == "draining" {
                NodeState::Draining
            } else {
                NodeState::Ready
            },
            capacity: Capacity {
                vcpus: 4,
                memory_bytes: 1000,
            },
            memory_available_bytes: available,
            sandboxes: listed
                .iter()
                .map(|(s, m)| NodeSandbox {
                    sandbox_id: (*s).into(),
                    allocated_memory_bytes: 100,
                    memory_used_bytes: *m,
                })
                .collect(),
            reported_at_unix_ms: at,
            ..NodeDoc::default()
        }
    }

    /// A manifest for tests (the orphan tests use it too).
    pub(crate) fn manifest(id: &str, node: &str, phase: SandboxPhase) -> SandboxDoc {
        SandboxDoc {
            sandbox_id: id.into(),
            team_id: "t".into(),
            template: "base".into(),
            vcpus: 1,
            memory_bytes: 512,
            phase,
            node_id: node.into(),
            epoch: 1,
            ..SandboxDoc::default()
        }
    }

    #[test]
    fn measured_memory_wins_over_the_estimate_and_states_are_read() {
        let nodes = vec![
            node("a", "ready", 400, &[("s1", 300), ("s2", 0)], 10_000),
            node("b", "draining", 900, &[], 10_000),
            node("c", "ready", 900, &[], 1_000),
            node("d", "ready", 900, &[], 10_000),
        ];
        let manifests = vec![
            manifest("s1", "a", SandboxPhase::Running),
            manifest("s2", "a", SandboxPhase::Paused),
            manifest("s3", "", SandboxPhase::Hibernated),
        ];
        let control = ControlDoc {
            paused: false,
            draining: vec!["d".into()],
        };
        let snap = snapshot(&nodes, &manifests, &control, 10_500, 5_000);
        let ready: Vec<(&str, bool, bool)> = snap
            .nodes
            .iter()
            .map(|n| (n.node_id.as_str(), n.ready, n.draining))
            .collect();
        assert_eq!(
            ready,
            vec![
                ("a", true, false),
                ("b", false, true),
                ("c", false, false),
                ("d", false, true)
            ]
        );
        assert_eq!(snap.sandboxes.len(), 2, "a hibernated sandbox is on no node");
        assert_eq!(snap.sandboxes[0].memory_bytes, 300);
        assert_eq!(
            snap.sandboxes[1].memory_bytes, 512,
            "unmeasured: the manifest's estimate"
        );
        assert!(!snap.sandboxes[1].movable);
    }

    #[test]
    fn a_move_is_reflected_only_when_both_nodes_show_it() {
        let record = MoveRecord {
            move_id: "p.0".into(),
            sandbox_id: "s".into(),
            from_node: "a".into(),
            from_address: String::new(),
            to_node: "b".into(),
            to_address: String::new(),
            memory_bytes: 1,
            step: Step::Done,
            epoch: 2,
            error: None,
            failed_at: None,
            target_released: false,
            paused_at_unix_ms: None,
            resumed_at_unix_ms: None,
            finished_at_unix_ms: None,
        };
        let before = vec![node("a", "ready", 0, &[("s", 1)], 0), node("b", "ready", 0, &[], 0)];
        let half = vec![
            node("a", "ready", 0, &[("s", 1)], 0),
            node("b", "ready", 0, &[("s", 1)], 0),
        ];
        let after = vec![node("a", "ready", 0, &[], 0), node("b", "ready", 0, &[("s", 1)], 0)];
        assert!(!reflected(&record, &before));
        assert!(!reflected(&record, &half));
        assert!(reflected(&record, &after));
        let mut undone = record.clone();
        undone.step = Step::RolledBack;
        assert!(reflected(&undone, &before));
        assert!(!reflected(&undone, &half));
    }

    fn pooled(id: &str, node: &str) -> SandboxDoc {
        let mut pooled = manifest(id, node, SandboxPhase::Running);
        pooled.team_id.clear();
        pooled.pool = Some(common::pool::Pooled::default());
        pooled
    }

    #[test]
    fn only_a_running_unowned_pooled_sandbox_is_asked_to_go_and_only_once() {
        let pooled = pooled("s", "a");
        let asked = asked_to_go(&pooled, "balance plan p", 7).expect("a pooled sandbox is asked");
        assert_eq!(
            asked.pool.as_ref().and_then(|p| p.retire_asked.clone()),
            Some(RetireAsk {
                by: "balance plan p".into(),
                at_unix_ms: 7
            })
        );
        assert_eq!(
            SandboxDoc {
                pool: None,
                ..asked.clone()
            },
            SandboxDoc {
                pool: None,
                ..pooled.clone()
            },
            "nothing else of the manifest changes"
        );
        assert!(asked_to_go(&asked, "balance plan q", 8).is_none(), "asked already");
        let claimed = SandboxDoc {
            team_id: "t".into(),
            ..pooled.clone()
        };
        assert!(asked_to_go(&claimed, "x", 0).is_none(), "claimed (a team's now)");
        let owned = SandboxDoc {
            lifecycle_owner: Some("user:evict:1".into()),
            ..pooled.clone()
        };
        assert!(asked_to_go(&owned, "x", 0).is_none(), "an operation owns it");
        let creating = SandboxDoc {
            phase: SandboxPhase::Creating,
            ..pooled
        };
        assert!(asked_to_go(&creating, "x", 0).is_none());
        assert!(asked_to_go(&manifest("u", "a", SandboxPhase::Running), "x", 0).is_none());
    }

    #[test]
    fn a_sandbox_asked_to_go_is_its_keepers_for_a_while_then_anyones_to_move() {
        let nodes = vec![node("a", "ready", 400, &[("s", 300)], 10_000)];
        let control = ControlDoc::default();
        let asked = asked_to_go(&pooled("s", "a"), "balance plan p", 10_000).unwrap();
        let owned = |now: u64| {
            snapshot(&nodes, std::slice::from_ref(&asked), &control, now, u64::MAX).sandboxes[0].lifecycle_owned
        };
        assert!(owned(10_000 + DROP_PATIENCE_MS - 1), "left to its keeper");
        let available =
            |now: u64| snapshot(&nodes, std::slice::from_ref(&asked), &control, now, u64::MAX).nodes[0].available_bytes;
        assert_eq!(available(10_000), 700, "its measured 300 counted as free already");
        assert_eq!(available(10_000 + DROP_PATIENCE_MS), 400);
        assert!(!owned(10_000 + DROP_PATIENCE_MS), "no keeper came: planned again");
        assert!(!droppable(&asked), "and then moved, not asked again");
        let candidate = |doc: &SandboxDoc| {
            snapshot(&nodes, std::slice::from_ref(doc), &control, 10_000, u64::MAX).sandboxes[0].droppable
        };
        assert!(!candidate(&asked), "the planner does not prefer it either");
        assert!(
            candidate(&pooled("s", "a")),
            "a ready pooled sandbox is the planner's to prefer"
        );
        assert!(
            !candidate(&manifest("s", "a", SandboxPhase::Running)),
            "a tenant's is not"
        );
    }

    #[test]
    fn a_plan_that_levels_drops_one_sandbox_of_a_template_and_a_drain_all() {
        let mv = |id: &str| Move {
            sandbox_id: id.into(),
            from: "a".into(),
            to: "b".into(),
            memory_bytes: 1,
        };
        let moves = vec![mv("t1"), mv("p1"), mv("p2"), mv("q1"), mv("t2")];
        let templates: HashMap<String, String> = [("p1", "P"), ("p2", "P"), ("q1", "Q")]
            .into_iter()
            .map(|(id, t)| (id.to_string(), t.to_string()))
            .collect();
        let ids = |v: Vec<&Move>| v.into_iter().map(|m| m.sandbox_id.clone()).collect::<Vec<_>>();
        let template_of = |id: &str| templates.get(id).map(String::as_str);
        let (moved, dropped) = split_drops(&moves, template_of, false);
        assert_eq!(ids(moved), ["t1", "p2", "t2"]);
        assert_eq!(ids(dropped), ["p1", "q1"]);
        let (moved, dropped) = split_drops(&moves, template_of, true);
        assert_eq!(ids(moved), ["t1", "t2"]);
        assert_eq!(ids(dropped), ["p1", "p2", "q1"]);
    }

    #[test]
    fn a_drop_is_reflected_once_its_source_lists_the_sandbox_no_more() {
        let dropped = DropRecord {
            sandbox_id: "s".into(),
            from_node: "a".into(),
            memory_bytes: 1,
            asked_at_unix_ms: 0,
        };
        assert!(!drop_reflected(&dropped, &[node("a", "ready", 0, &[("s", 1)], 0)]));
        assert!(drop_reflected(&dropped, &[node("a", "ready", 0, &[("t", 1)], 0)]));
        assert!(drop_reflected(&dropped, &[]), "no document to wait for");
    }
}
