//! Sandboxes that cannot move: remembered from the moves that failed, so plans leave them
//! out while their backoff runs ([`crate::plan::FailedMoves`]) and the other sandboxes move
//! meanwhile; named in the balancer's status, so an operator sees what holds a drain.
//!
//! Kept in the executor's memory, not the ledger: a new executor (after a failover) tries
//! each such sandbox once more before it backs off again, which costs one failed move.

use std::collections::{BTreeMap, HashSet};

use crate::plan::{FailedMoves, Snapshot};
use crate::record::{MoveRecord, Step};

/// A sandbox whose moves failed in a row.
#[derive(Clone, Debug, PartialEq)]
pub struct Stuck {
    /// The node it stays on.
    pub node_id: String,
    pub failed: FailedMoves,
    /// Why the last move failed.
    pub error: String,
}

/// Updates `stuck` with a finished plan's `moves` at `now_ms`: a rolled-back move counts one
/// more failure for its sandbox, a completed one (or its user's kill) forgets it.
pub fn record(stuck: &mut BTreeMap<String, Stuck>, moves: &[MoveRecord], now_ms: u64) {
    for m in moves {
        match m.step {
            Step::RolledBack => {
                let entry = stuck.entry(m.sandbox_id.clone()).or_insert_with(|| Stuck {
                    node_id: m.from_node.clone(),
                    failed: FailedMoves {
                        count: 0,
                        last_at_ms: now_ms,
                    },
                    error: String::new(),
                });
                entry.failed.count += 1;
                entry.failed.last_at_ms = now_ms;
                entry.node_id = m.from_node.clone();
                entry.error = m.error.clone().unwrap_or_else(|| "the move was rolled back".into());
                tracing::warn!(sandbox_id = %m.sandbox_id, node_id = %m.from_node, failures = entry.failed.count,
                    retry_at_unix_ms = entry.failed.retry_at_ms(), error = %entry.error,
                    "the sandbox could not move; the others go on without it");
                metrics::counter!("balance_moves_failed_total").increment(1);
            }
            Step::Switched | Step::Done | Step::Abandoned => {
                stuck.remove(&m.sandbox_id);
            }
            _ => {}
        }
    }
}

/// Gives the snapshot's sandboxes their failures, and forgets sandboxes that are gone.
pub fn mark(stuck: &mut BTreeMap<String, Stuck>, snapshot: &mut Snapshot) {
    let present: HashSet<&str> = snapshot.sandboxes.iter().map(|c| c.sandbox_id.as_str()).collect();
    stuck.retain(|id, _| present.contains(id.as_str()));
    for c in &mut snapshot.sandboxes {
        c.failed = stuck.get(&c.sandbox_id).map(|s| s.failed.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Candidate;
    use common::docs::Capacity;

    fn moved(sandbox: &str, step: Step) -> MoveRecord {
        let mut m = MoveRecord::planned(
            format!("p.{sandbox}"),
            sandbox,
            ("a", "http://a"),
            ("b", "http://b"),
            1 << 20,
        );
        m.step = step;
        if step == Step::RolledBack {
            m.error = Some("restore on b: refused".into());
        }
        m
    }

    fn candidate(id: &str) -> Candidate {
        Candidate {
            sandbox_id: id.into(),
            node_id: "a".into(),
            memory_bytes: 1 << 20,
            lifecycle_owned: false,
            last_moved_ms: None,
            movable: true,
            requested: Capacity {
                vcpus: 1,
                memory_bytes: 1 << 20,
            },
            failed: None,
            droppable: false,
        }
    }

    #[test]
    fn failures_count_in_a_row_and_a_move_forgets_them() {
        let mut stuck = BTreeMap::new();
        record(
            &mut stuck,
            &[moved("s", Step::RolledBack), moved("t", Step::Done)],
            1_000,
        );
        record(&mut stuck, &[moved("s", Step::RolledBack)], 2_000);
        let s = stuck["s"].clone();
        assert_eq!((s.failed.count, s.failed.last_at_ms), (2, 2_000));
        assert_eq!((s.node_id.as_str(), s.error.as_str()), ("a", "restore on b: refused"));
        assert!(!stuck.contains_key("t"));

        let mut snapshot = Snapshot {
            nodes: Vec::new(),
            sandboxes: vec![candidate("s"), candidate("u")],
            now_ms: 2_500,
        };
        mark(&mut stuck, &mut snapshot);
        assert_eq!(snapshot.sandboxes[0].failed, Some(s.failed));
        assert_eq!(snapshot.sandboxes[1].failed, None);

        record(&mut stuck, &[moved("s", Step::Done)], 3_000);
        assert!(stuck.is_empty(), "moved at last");
        record(&mut stuck, &[moved("gone", Step::RolledBack)], 3_000);
        mark(&mut stuck, &mut snapshot);
        assert!(stuck.is_empty(), "a sandbox no longer there is forgotten");
    }
}
