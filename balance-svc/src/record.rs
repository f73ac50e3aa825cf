//! The documents balance-svc keeps in the ledger, and the state machine of one move.
//!
//! A plan document (`balance-plan/<plan_id>`) holds its moves; each move records the last step
//! it *completed*. Every step's action is idempotent (node calls carry an operation ID derived
//! from the move and the step; ledger writes compare what they guard), so an executor that
//! starts after a crash reads the step and simply does the next action again. The plan
//! document is written only by the lease holder, by compare-and-swap on that one document: a
//! conflict there means the lease was lost, and the loser stops.
//!
//! The order of steps keeps the invariant that a sandbox runs in exactly one place (a paused
//! copy may wait on the source until the target has resumed; never two running, never none):
//!
//! ```text
//! Planned -> Owned -> SourcePaused -> Restored -> TargetResumed -> Switched -> Done
//!    \________\___________\______________\____________/
//!                          RollingBack -> RolledBack          (any failure before Switched)
//! ```
//!
//! Until `Switched` the manifest points at the source, and the source copy is only paused, so
//! rolling back is "kill the target copy, resume the source". From `Switched` on the manifest
//! points at the running target, and the move can only go forward (delete the paused source).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Kind of plan documents.
pub const PLAN_KIND: &str = "balance-plan";
/// Kind of the executor lease document (one: `balance-lease/executor`).
pub const LEASE_KIND: &str = "balance-lease";
pub const LEASE_ID: &str = "executor";
/// Kind of the latest observation (one: `balance-observation/cluster`).
pub const OBSERVATION_KIND: &str = "balance-observation";
pub const OBSERVATION_ID: &str = "cluster";
/// Kind of operator settings (one: `balance-control/cluster`): paused, draining nodes.
pub const CONTROL_KIND: &str = "balance-control";
pub const CONTROL_ID: &str = "cluster";

/// The last completed step of a move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Step {
    /// Committed with its plan; nothing done yet.
    Planned,
    /// The manifest names this move as its lifecycle owner, under a new fencing epoch.
    Owned,
    /// Frozen on the source (memory kept there until the move ends).
    SourcePaused,
    /// The target holds a paused copy (files and runtime description, checksum verified).
    Restored,
    /// The target copy runs; the source copy is still paused.
    TargetResumed,
    /// The manifest points at the target; ownership released; cooldown started.
    Switched,
    /// The source copy is deleted.
    Done,
    /// A step failed before `Switched`; undoing.
    RollingBack,
    /// Undone: the sandbox runs on the source again, unowned.
    RolledBack,
    /// The sandbox was killed by its user while moving; both copies removed.
    Abandoned,
}

impl Step {
    pub fn name(self) -> &'static str {
        match self {
            Step::Planned => "Planned",
            Step::Owned => "Owned",
            Step::SourcePaused => "SourcePaused",
            Step::Restored => "Restored",
            Step::TargetResumed => "TargetResumed",
            Step::Switched => "Switched",
            Step::Done => "Done",
            Step::RollingBack => "RollingBack",
            Step::RolledBack => "RolledBack",
            Step::Abandoned => "Abandoned",
        }
    }

    /// No further action.
    pub fn is_final(self) -> bool {
        matches!(self, Step::Done | Step::RolledBack | Step::Abandoned)
    }

    /// A failure here is undone by rolling back (the manifest still points at the source).
    pub fn can_roll_back(self) -> bool {
        matches!(
            self,
            Step::Planned | Step::Owned | Step::SourcePaused | Step::Restored | Step::TargetResumed
        )
    }

    /// The step that completing the next action leads to.
    pub fn next(self) -> Option<Step> {
        Some(match self {
            Step::Planned => Step::Owned,
            Step::Owned => Step::SourcePaused,
            Step::SourcePaused => Step::Restored,
            Step::Restored => Step::TargetResumed,
            Step::TargetResumed => Step::Switched,
            Step::Switched => Step::Done,
            Step::RollingBack => Step::RolledBack,
            Step::Done | Step::RolledBack | Step::Abandoned => return None,
        })
    }

    /// Every step a move passes through when all goes well, in order.
    pub const FORWARD: [Step; 7] = [
        Step::Planned,
        Step::Owned,
        Step::SourcePaused,
        Step::Restored,
        Step::TargetResumed,
        Step::Switched,
        Step::Done,
    ];
}

/// One move of a plan, as persisted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoveRecord {
    /// `<plan_id>.<index>`; node operation IDs are `<move_id>/<action>/<epoch>`.
    pub move_id: String,
    pub sandbox_id: String,
    pub from_node: String,
    pub from_address: String,
    pub to_node: String,
    pub to_address: String,
    pub memory_bytes: u64,
    pub step: Step,
    /// The fencing epoch this move holds the sandbox under (0 until owned).
    #[serde(default)]
    pub epoch: u64,
    #[serde(default)]
    pub error: Option<String>,
    /// The last step completed before a failure started the rollback.
    #[serde(default)]
    pub failed_at: Option<Step>,
    /// An operator confirmed the target node is gone for good: a rollback no longer waits
    /// for it to confirm its copy stopped.
    #[serde(default)]
    pub target_released: bool,
    #[serde(default)]
    pub paused_at_unix_ms: Option<u64>,
    #[serde(default)]
    pub resumed_at_unix_ms: Option<u64>,
    #[serde(default)]
    pub finished_at_unix_ms: Option<u64>,
}

impl MoveRecord {
    /// The source node: its ID and address.
    pub fn source(&self) -> (&str, &str) {
        (&self.from_node, &self.from_address)
    }

    /// The target node: its ID and address.
    pub fn target(&self) -> (&str, &str) {
        (&self.to_node, &self.to_address)
    }

    /// A move as committed with its plan: nothing done yet.
    pub fn planned(move_id: String, sandbox_id: &str, from: (&str, &str), to: (&str, &str), memory_bytes: u64) -> Self {
        Self {
            move_id,
            sandbox_id: sandbox_id.to_string(),
            from_node: from.0.to_string(),
            from_address: from.1.to_string(),
            to_node: to.0.to_string(),
            to_address: to.1.to_string(),
            memory_bytes,
            step: Step::Planned,
            epoch: 0,
            error: None,
            failed_at: None,
            target_released: false,
            paused_at_unix_ms: None,
            resumed_at_unix_ms: None,
            finished_at_unix_ms: None,
        }
    }

    /// Whether a rollback must hear from the target that its copy stopped before resuming
    /// the source: the target's resume was sent (whatever its answer), and no operator has
    /// confirmed the target gone.
    pub fn target_may_run(&self) -> bool {
        let resume_sent = matches!(self.failed_at, Some(Step::Restored | Step::TargetResumed));
        resume_sent && !self.target_released
    }

    /// Paused on the source until running on the target.
    pub fn downtime_ms(&self) -> Option<u64> {
        Some(self.resumed_at_unix_ms?.saturating_sub(self.paused_at_unix_ms?))
    }

    /// The operation ID of `action` under the current epoch: a retry of the same action by
    /// any executor holding the same epoch is answered once by the node.
    pub fn operation_id(&self, action: &str) -> String {
        format!("{}/{action}/{}", self.move_id, self.epoch)
    }
}

/// Why a plan was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PlanReason {
    /// The spread exceeded the threshold.
    Balance,
    /// A node is draining.
    Drain,
}

/// A plan and the progress of its moves: `balance-plan/<plan_id>`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanDoc {
    pub plan_id: String,
    pub reason: PlanReason,
    pub spread_before: f64,
    pub spread_expected: f64,
    #[serde(default)]
    pub skips: BTreeMap<String, u64>,
    pub created_at_unix_ms: u64,
    #[serde(default)]
    pub finished_at_unix_ms: Option<u64>,
    pub moves: Vec<MoveRecord>,
    /// Pooled sandboxes the plan drops instead of moving (see [`DropRecord`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drops: Vec<DropRecord>,
}

/// A pooled sandbox a plan lets go of instead of moving it. It waits unclaimed in a warm pool
/// and never ran anyone's code, so a copy of it is worth nothing a new one is not: the plan
/// asks its pool's keeper (in its manifest) to retire it, and the keeper kills it and fills
/// the slot again wherever placement puts the refill. Its source sheds the room without a
/// pause, a snapshot or a restore. The plan counted the room as arriving on the node it chose
/// for a move; placement chooses the refill's node by its own ranking (the roomiest of a few
/// it samples), so the next plan corrects what differs. Once the ask is written the rest is
/// the keeper's; one whose keeper has not acted within [`crate::view::DROP_PATIENCE_MS`] is
/// planned, and moved, like any other sandbox.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DropRecord {
    pub sandbox_id: String,
    pub from_node: String,
    pub memory_bytes: u64,
    pub asked_at_unix_ms: u64,
}

impl PlanDoc {
    /// A plan of one move of `sandbox_id` (`(node_id, address)` from and to), as operators'
    /// drains of one sandbox, tests and benchmarks make them; its move is `{plan_id}.0`.
    pub fn one_move(plan_id: &str, sandbox_id: &str, from: (&str, &str), to: (&str, &str), memory_bytes: u64) -> Self {
        Self {
            plan_id: plan_id.to_string(),
            reason: PlanReason::Balance,
            spread_before: 0.0,
            spread_expected: 0.0,
            skips: BTreeMap::new(),
            created_at_unix_ms: 0,
            finished_at_unix_ms: None,
            moves: vec![MoveRecord::planned(
                format!("{plan_id}.0"),
                sandbox_id,
                from,
                to,
                memory_bytes,
            )],
            drops: Vec::new(),
        }
    }

    pub fn is_finished(&self) -> bool {
        self.moves.iter().all(|m| m.step.is_final())
    }
}

/// The executor lease: `balance-lease/executor`. Taken when absent or left unrenewed for a
/// full TTL, renewed by its holder, always by compare-and-swap on this document alone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseDoc {
    pub holder: String,
    /// For operators reading the document: when the holder's renewal runs out by its own
    /// clock. No replica compares it with its clock: see [`may_take`].
    pub expires_at_unix_ms: u64,
    /// Bumped on every change of holder, for logs.
    pub term: u64,
}

/// Whether `me` may write the lease, given its current value and version, and — when another
/// replica holds it — the version this replica last saw and how long ago (by this replica's
/// monotonic clock) it first saw that version.
///
/// No wall clocks are compared across machines: another holder's lease counts as lapsed only
/// once its document has not changed for a full `ttl` as this replica watched it. The holder
/// stops acting `ttl` after it *sent* its last renewal, which is no later than this replica
/// first saw it, so the two never act at once (clock rates, not clock readings, must agree).
pub fn may_take(
    current: Option<(&LeaseDoc, u64)>,
    me: &str,
    seen: Option<(u64, std::time::Duration)>,
    ttl: std::time::Duration,
) -> bool {
    match current {
        None => true,
        // Ours, or given up by its holder on a clean stop.
        Some((lease, _)) if lease.holder == me || lease.holder.is_empty() => true,
        Some((_, version)) => seen.is_some_and(|(v, unchanged_for)| v == version && unchanged_for >= ttl),
    }
}

/// The latest observation: `balance-observation/cluster`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ObservationDoc {
    pub status: String,
    pub spread: f64,
    pub ready_nodes: u32,
    pub observed_at_unix_ms: u64,
    #[serde(default)]
    pub plan_id: Option<String>,
    /// Observations so far, per status (by this lease's holders).
    #[serde(default)]
    pub counts: BTreeMap<String, u64>,
}

/// Operator settings: `balance-control/cluster`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlDoc {
    #[serde(default)]
    pub paused: bool,
    #[serde(default)]
    pub draining: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_steps_chain_and_end() {
        for pair in Step::FORWARD.windows(2) {
            assert_eq!(pair[0].next(), Some(pair[1]));
        }
        assert!(Step::Done.is_final() && Step::Done.next().is_none());
        assert_eq!(Step::RollingBack.next(), Some(Step::RolledBack));
        // Once the manifest points at the target there is no way back.
        assert!(!Step::Switched.can_roll_back());
        assert!(Step::TargetResumed.can_roll_back());
    }

    #[test]
    fn the_lease_is_taken_only_when_free_ours_or_unchanged_for_a_full_ttl() {
        use std::time::Duration;
        let ttl = Duration::from_secs(3);
        let lease = LeaseDoc {
            holder: "a".into(),
            expires_at_unix_ms: 0,
            term: 1,
        };
        assert!(may_take(None, "b", None, ttl));
        assert!(may_take(Some((&lease, 7)), "a", None, ttl));
        let released = LeaseDoc {
            holder: String::new(),
            ..lease.clone()
        };
        assert!(may_take(Some((&released, 9)), "b", None, ttl));
        // Never seen before: watch it for a TTL first, whatever its expiry time says.
        assert!(!may_take(Some((&lease, 7)), "b", None, ttl));
        assert!(!may_take(
            Some((&lease, 7)),
            "b",
            Some((7, ttl - Duration::from_millis(1))),
            ttl
        ));
        assert!(may_take(Some((&lease, 7)), "b", Some((7, ttl)), ttl));
        // Renewed since: the wait starts again.
        assert!(!may_take(Some((&lease, 8)), "b", Some((7, ttl * 10)), ttl));
    }

    #[test]
    fn documents_round_trip_and_tolerate_missing_optional_fields() {
        let json = r#"{"move_id":"p.0","sandbox_id":"s","from_node":"a","from_address":"x",
            "to_node":"b","to_address":"y","memory_bytes":1,"step":"Owned"}"#;
        let m: MoveRecord = serde_json::from_str(json).unwrap();
        assert_eq!(m.step, Step::Owned);
        assert_eq!(m.epoch, 0);
        assert_eq!(m.operation_id("pause"), "p.0/pause/0");
        let back: MoveRecord = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
    }
}
