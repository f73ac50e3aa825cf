//! The move protocol's decisions, pure: given what is recorded and what the ledger says now,
//! what the executor does next. No I/O, so every branch is unit-tested.
//!
//! - [`pick_up`]: an executor that starts (or restarts) a move under way must tell "still
//!   ours" from "the next action already landed before the crash" from "someone else owns it";
//! - [`on_failure`]: a step that failed leads to a rollback, an abandon, a stop, or a retry
//!   in the next cycle, depending on the step and the failure;
//! - [`NodeAction`]: each node call a move makes, the operation-ID name that keeps it
//!   idempotent, and what a "not found" answer means for it.

use common::docs::SandboxDoc;

use super::MoveError;
use crate::record::{MoveRecord, Step};

/// What to do with a move an executor picks up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PickUp {
    /// Nothing of it is under way (or it never owned the sandbox): go on from the recorded step.
    AsRecorded,
    /// Under way and still owned by this move: take the fencing epoch again, so any older
    /// executor still acting is refused by the nodes.
    Retake,
    /// The manifest is gone: the user killed the sandbox mid-move.
    Abandon,
    /// The switch landed (the manifest names the target, ownership released) but its record
    /// did not: continue from `Switched`.
    Switched,
    /// The rollback's last action (releasing ownership) landed but its record did not.
    RolledBack,
    /// Another owner, or none, where this move should own the sandbox: stop this move.
    LostOwnership { owner: Option<String> },
}

/// Whether picking `record` up depends on its manifest: only a move under way that owned the
/// sandbox (epoch > 0) does.
pub fn needs_manifest(record: &MoveRecord) -> bool {
    let under_way = matches!(
        record.step,
        Step::Owned | Step::SourcePaused | Step::Restored | Step::TargetResumed | Step::RollingBack
    );
    under_way && record.epoch > 0
}

/// Decides how to pick up `record`, given the sandbox's manifest as read now (`None`: gone).
pub fn pick_up(record: &MoveRecord, manifest: Option<&SandboxDoc>) -> PickUp {
    if !needs_manifest(record) {
        return PickUp::AsRecorded;
    }
    let Some(doc) = manifest else {
        return PickUp::Abandon;
    };
    if doc.lifecycle_owner.as_deref() == Some(record.move_id.as_str()) {
        PickUp::Retake
    } else if record.step == Step::TargetResumed && switched(record, doc) {
        PickUp::Switched
    } else if record.step == Step::RollingBack {
        PickUp::RolledBack
    } else {
        PickUp::LostOwnership {
            owner: doc.lifecycle_owner.clone(),
        }
    }
}

/// Whether the manifest shows this move's switch landed: unowned, on the target, at the
/// move's epoch (a later owner would have raised it).
pub fn switched(record: &MoveRecord, doc: &SandboxDoc) -> bool {
    doc.lifecycle_owner.is_none() && doc.node_id == record.to_node && doc.epoch == record.epoch
}

/// Whether the manifest shows this move's release (the end of a rollback) landed: unowned,
/// on the source, at the move's epoch.
pub fn released(record: &MoveRecord, doc: &SandboxDoc) -> bool {
    doc.lifecycle_owner.is_none() && doc.node_id == record.from_node && doc.epoch == record.epoch
}

/// Where a failed step leads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// Fenced or halted: this executor must stop acting at once.
    Stop,
    /// The sandbox was deleted: remove the copies this move made.
    Abandon,
    /// Before the switch: undo (target copy removed, source resumed, ownership released).
    RollBack,
    /// From the switch on (or while rolling back) the only way is forward: keep the step
    /// recorded and try again in the next cycle.
    RetryNextCycle,
}

/// Routes a failure of the action after `step`.
pub fn on_failure(step: Step, err: &MoveError) -> OnFailure {
    match err {
        MoveError::Fenced(_) | MoveError::Halted(_) => OnFailure::Stop,
        MoveError::Gone(_) => OnFailure::Abandon,
        // The write may have landed: acting as if it had not (rolling back after a switch
        // that landed) kills the live copy. Read again next cycle instead.
        MoveError::Unknown(_) => OnFailure::RetryNextCycle,
        _ if step.can_roll_back() => OnFailure::RollBack,
        _ => OnFailure::RetryNextCycle,
    }
}

/// The lifecycle calls a move makes on nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeAction {
    /// Freeze the source.
    Pause,
    /// Start the target copy.
    Resume,
    /// Delete the source copy after the switch.
    Kill,
    /// Rolling back: remove the target's copy.
    UndoKill,
    /// Rolling back: run the source again.
    UndoResume,
    /// Abandoning: remove the target's copy.
    AbandonKillTarget,
    /// Abandoning: remove the source's copy.
    AbandonKill,
}

/// The node RPC an action is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeCall {
    Pause,
    Resume,
    Kill,
}

/// What a node's "no such sandbox" answer means for an action.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WhenMissing {
    /// Nothing left to remove: done.
    Done,
    /// The copy that should run again is gone: the sandbox is lost to this move.
    Gone,
    /// A failure like any other.
    Failed,
}

impl NodeAction {
    /// The action's part of the operation ID. These names are what makes a repeated call
    /// idempotent on the node, so they never change.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Kill => "kill",
            Self::UndoKill => "undo-kill",
            Self::UndoResume => "undo-resume",
            Self::AbandonKillTarget => "abandon-kill-target",
            Self::AbandonKill => "abandon-kill",
        }
    }

    pub fn call(self) -> NodeCall {
        match self {
            Self::Pause => NodeCall::Pause,
            Self::Resume | Self::UndoResume => NodeCall::Resume,
            Self::Kill | Self::UndoKill | Self::AbandonKillTarget | Self::AbandonKill => NodeCall::Kill,
        }
    }

    pub fn when_missing(self) -> WhenMissing {
        match self.call() {
            NodeCall::Kill => WhenMissing::Done,
            _ if self == Self::UndoResume => WhenMissing::Gone,
            _ => WhenMissing::Failed,
        }
    }
}

/// The action that follows a step, as its span is named.
pub fn action_name(step: Step) -> &'static str {
    match step {
        Step::Planned => "own",
        Step::Owned => "pause",
        Step::SourcePaused => "transfer",
        Step::Restored => "resume",
        Step::TargetResumed => "switch_route",
        Step::Switched => "delete_source",
        Step::RollingBack => "roll_back",
        Step::Done | Step::RolledBack | Step::Abandoned => "none",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(step: Step, epoch: u64) -> MoveRecord {
        let mut r = MoveRecord::planned("m1".into(), "sbx", ("a", "http://a"), ("b", "http://b"), 1 << 20);
        r.step = step;
        r.epoch = epoch;
        r
    }

    fn manifest(owner: Option<&str>, node: &str) -> SandboxDoc {
        SandboxDoc {
            sandbox_id: "sbx".into(),
            node_id: node.into(),
            lifecycle_owner: owner.map(str::to_string),
            epoch: 2,
            ..SandboxDoc::default()
        }
    }

    #[test]
    fn a_move_not_under_way_goes_on_as_recorded() {
        for step in [
            Step::Planned,
            Step::Switched,
            Step::Done,
            Step::RolledBack,
            Step::Abandoned,
        ] {
            assert_eq!(pick_up(&record(step, 3), None), PickUp::AsRecorded, "{step:?}");
        }
        // Never owned (epoch 0): nothing to re-take, whatever the manifest says.
        assert_eq!(pick_up(&record(Step::RollingBack, 0), None), PickUp::AsRecorded);
    }

    #[test]
    fn a_move_under_way_is_retaken_abandoned_or_recognised_as_landed() {
        let ours = manifest(Some("m1"), "a");
        for step in [
            Step::Owned,
            Step::SourcePaused,
            Step::Restored,
            Step::TargetResumed,
            Step::RollingBack,
        ] {
            assert_eq!(pick_up(&record(step, 2), Some(&ours)), PickUp::Retake, "{step:?}");
            assert_eq!(pick_up(&record(step, 2), None), PickUp::Abandon, "{step:?}");
        }
        assert_eq!(
            pick_up(&record(Step::TargetResumed, 2), Some(&manifest(None, "b"))),
            PickUp::Switched
        );
        assert_eq!(
            pick_up(&record(Step::RollingBack, 2), Some(&manifest(None, "a"))),
            PickUp::RolledBack
        );
        assert_eq!(
            pick_up(&record(Step::SourcePaused, 2), Some(&manifest(Some("m9"), "a"))),
            PickUp::LostOwnership {
                owner: Some("m9".into())
            }
        );
        assert_eq!(
            pick_up(&record(Step::TargetResumed, 2), Some(&manifest(None, "a"))),
            PickUp::LostOwnership { owner: None }
        );
        // On the target but under a later epoch: someone else took it and moved it there,
        // not this move's switch.
        let mut later = manifest(None, "b");
        later.epoch = 5;
        assert_eq!(
            pick_up(&record(Step::TargetResumed, 2), Some(&later)),
            PickUp::LostOwnership { owner: None }
        );
    }

    #[test]
    fn a_landed_switch_or_release_is_recognised_by_owner_node_and_epoch() {
        let r = record(Step::TargetResumed, 2);
        assert!(switched(&r, &manifest(None, "b")));
        assert!(!switched(&r, &manifest(Some("m1"), "b")));
        assert!(!switched(&r, &manifest(None, "a")));
        assert!(released(&r, &manifest(None, "a")));
        assert!(!released(&r, &manifest(None, "b")));
        let mut later = manifest(None, "a");
        later.epoch = 3;
        assert!(!released(&r, &later));
    }

    #[test]
    fn failures_route_by_step_and_kind() {
        let failed = || MoveError::Failed("x".into());
        assert_eq!(on_failure(Step::Owned, &MoveError::Fenced("x".into())), OnFailure::Stop);
        assert_eq!(on_failure(Step::Switched, &MoveError::Halted("x")), OnFailure::Stop);
        assert_eq!(
            on_failure(Step::Restored, &MoveError::Gone("x".into())),
            OnFailure::Abandon
        );
        for step in [
            Step::Planned,
            Step::Owned,
            Step::SourcePaused,
            Step::Restored,
            Step::TargetResumed,
        ] {
            assert_eq!(on_failure(step, &failed()), OnFailure::RollBack, "{step:?}");
            assert_eq!(on_failure(step, &MoveError::Transient("x".into())), OnFailure::RollBack);
        }
        for step in [Step::Switched, Step::RollingBack] {
            assert_eq!(on_failure(step, &failed()), OnFailure::RetryNextCycle, "{step:?}");
        }
        // An unknown outcome is never rolled back on, at any step.
        for step in Step::FORWARD.into_iter().chain([Step::RollingBack]) {
            assert_eq!(
                on_failure(step, &MoveError::Unknown("x".into())),
                OnFailure::RetryNextCycle,
                "{step:?}"
            );
        }
    }

    #[test]
    fn node_actions_keep_their_names_and_missing_meanings() {
        use NodeAction::*;
        let names: Vec<_> = [
            Pause,
            Resume,
            Kill,
            UndoKill,
            UndoResume,
            AbandonKillTarget,
            AbandonKill,
        ]
        .iter()
        .map(|a| a.name())
        .collect();
        assert_eq!(
            names,
            [
                "pause",
                "resume",
                "kill",
                "undo-kill",
                "undo-resume",
                "abandon-kill-target",
                "abandon-kill"
            ]
        );
        assert_eq!(Kill.when_missing(), WhenMissing::Done);
        assert_eq!(UndoKill.when_missing(), WhenMissing::Done);
        assert_eq!(AbandonKillTarget.when_missing(), WhenMissing::Done);
        assert_eq!(UndoResume.when_missing(), WhenMissing::Gone);
        assert_eq!(Resume.when_missing(), WhenMissing::Failed);
        assert_eq!(Pause.when_missing(), WhenMissing::Failed);
        assert_eq!(UndoResume.call(), NodeCall::Resume);
    }
}
