//! The pure core of a node: what a sandbox record holds, which lifecycle moves are legal, and
//! how fencing epochs and operation IDs decide whether a call may act.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

/// vCPUs, memory and disk a sandbox is allocated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub vcpus: u32,
    pub memory_bytes: u64,
    /// The size of its disk (see `crate::disk`); 0 (and every record from before disks): the
    /// node's default. Part of the record, so it travels with every move.
    #[serde(default)]
    pub disk_bytes: u64,
}

/// Where a sandbox is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Running,
    Paused,
    Killed,
}

/// Everything a node persists about one sandbox (its runtime description): enough to
/// re-adopt it after a node restart, or to recreate it on another node from a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    pub template: String,
    pub resources: Resources,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// The long-running command the sandbox starts with, if any (run by `sh -c`).
    #[serde(default)]
    pub start_command: Option<String>,
    #[serde(default)]
    pub access_token: Option<String>,
    /// Where its traffic may go; `None` (and every record from before egress existed):
    /// loopback only.
    #[serde(default)]
    pub network: Option<common::egress::NetworkPolicy>,
    /// Required on requests for its ports when set (E2B's `allowPublicTraffic: false`).
    #[serde(default)]
    pub traffic_access_token: Option<String>,
    /// What its root filesystem is made of: the layers and config of its template's build.
    /// `None` (and every record from before templates had builds): the built-in base.
    #[serde(default)]
    pub image: Option<common::template::Image>,
    pub state: State,
    /// The newest fencing epoch seen for this sandbox.
    pub epoch: u64,
    /// Process group of the start command; 0 when none runs.
    #[serde(default)]
    pub pgid: u32,
    pub created_at_unix_ms: u64,
    /// Started by a template's warm pool and not yet claimed: heartbeats count it apart, and
    /// only one `Claim` makes it a create's. Part of the record, so it travels with a move.
    #[serde(default)]
    pub pooled: bool,
}

impl SandboxRecord {
    /// What the runtime is told of this sandbox: the parts of its record that decide how it
    /// runs.
    pub fn view(&self) -> crate::runtime::Sandbox<'_> {
        crate::runtime::Sandbox {
            id: &self.id,
            vcpus: self.resources.vcpus,
            memory_bytes: self.resources.memory_bytes,
            env: &self.env,
            start_command: self.start_command.as_deref(),
            network: self.network.as_ref(),
            image: self.image.as_ref(),
            pgid: self.pgid,
        }
    }
}

/// A lifecycle move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Move {
    Pause,
    Resume,
    Kill,
}

/// Why a call may not act.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("epoch {got} is older than epoch {seen} already seen for sandbox {sandbox}: a newer owner acts on it")]
    StaleEpoch { sandbox: String, got: u64, seen: u64 },
    #[error("sandbox {sandbox} is {state:?}; cannot {action:?}")]
    IllegalMove {
        sandbox: String,
        state: State,
        action: Move,
    },
}

/// Checks `epoch` against what the record has seen; returns the epoch to keep.
pub fn fence(record: &SandboxRecord, epoch: u64) -> Result<u64, Refusal> {
    if epoch < record.epoch {
        return Err(Refusal::StaleEpoch {
            sandbox: record.id.clone(),
            got: epoch,
            seen: record.epoch,
        });
    }
    Ok(epoch)
}

/// What a restore does about a copy of the sandbox this node already has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OnExisting {
    /// No copy (or a killed one): restore.
    Restore,
    /// A copy under the same epoch: the same owner restored it before (the answer was lost,
    /// or the node restarted and forgot the operation). One owner per epoch, and the source
    /// stays paused while it owns the sandbox, so that copy is this snapshot: keep it.
    Keep,
    /// A copy under an older epoch: left behind by an earlier move that did not finish here.
    /// It is not what this owner snapshotted, so it is replaced, never adopted.
    Replace,
    /// A copy under a newer epoch: this restore's owner was superseded.
    Refuse(Refusal),
}

/// Decides [`OnExisting`] for a restore under `epoch`.
pub fn on_existing(existing: Option<&SandboxRecord>, epoch: u64) -> OnExisting {
    let Some(existing) = existing.filter(|r| r.state != State::Killed) else {
        return OnExisting::Restore;
    };
    match fence(existing, epoch) {
        Err(refusal) => OnExisting::Refuse(refusal),
        Ok(_) if existing.epoch == epoch => OnExisting::Keep,
        Ok(_) => OnExisting::Replace,
    }
}

/// The state after `action`, or `None` when the sandbox is already there (a repeat is not an
/// error: pausing a paused sandbox succeeds and does nothing).
pub fn next_state(record: &SandboxRecord, action: Move) -> Result<Option<State>, Refusal> {
    let illegal = || Refusal::IllegalMove {
        sandbox: record.id.clone(),
        state: record.state,
        action,
    };
    match (record.state, action) {
        (State::Running, Move::Pause) => Ok(Some(State::Paused)),
        (State::Paused, Move::Resume) => Ok(Some(State::Running)),
        (State::Running | State::Paused, Move::Kill) => Ok(Some(State::Killed)),
        (State::Paused, Move::Pause) | (State::Running, Move::Resume) | (State::Killed, Move::Kill) => Ok(None),
        (State::Killed, Move::Pause | Move::Resume) => Err(illegal()),
    }
}

/// Remembers the answers to recent operations, so a retry with the same operation ID gets
/// the first answer and does nothing twice. Bounded twice: answers older than `max_age_ms`
/// are forgotten (a retry comes within seconds, or after a takeover within a lease's time),
/// and past `capacity` the oldest go first. The age bound is what keeps a busy node's memory
/// flat: by count alone the store grows for as long as it takes to fill (hours on a quiet
/// node, each answer a whole sandbox record).
pub struct Answers<T> {
    capacity: usize,
    max_age_ms: u64,
    /// Operation IDs in the order answered, with when (unix ms).
    order: VecDeque<(String, u64)>,
    answers: HashMap<String, (String, T)>,
}

/// What a retry with an operation ID finds.
#[derive(Debug, PartialEq, Eq)]
pub enum Recall<T> {
    /// Never seen: go ahead.
    New,
    /// Seen, for the same call: here is its answer.
    Answered(T),
    /// Seen, but for another call: the ID was reused.
    Reused { first: String },
}

impl<T: Clone> Answers<T> {
    pub fn new(capacity: usize, max_age_ms: u64) -> Self {
        Self {
            capacity,
            max_age_ms,
            order: VecDeque::new(),
            answers: HashMap::new(),
        }
    }

    /// Looks `operation_id` up for the call described by `call` (method and sandbox).
    pub fn recall(&mut self, operation_id: &str, call: &str, now_ms: u64) -> Recall<T> {
        self.forget_old(now_ms);
        match self.answers.get(operation_id) {
            None => Recall::New,
            Some((first, answer)) if first == call => Recall::Answered(answer.clone()),
            Some((first, _)) => Recall::Reused { first: first.clone() },
        }
    }

    pub fn remember(&mut self, operation_id: &str, call: &str, answer: T, now_ms: u64) {
        if operation_id.is_empty() {
            return;
        }
        // The first answer stands: a concurrent retry that raced it must not replace it.
        if let std::collections::hash_map::Entry::Vacant(slot) = self.answers.entry(operation_id.to_string()) {
            slot.insert((call.to_string(), answer));
            self.order.push_back((operation_id.to_string(), now_ms));
        }
        self.forget_old(now_ms);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.answers.len()
    }

    fn forget_old(&mut self, now_ms: u64) {
        while let Some((id, at)) = self.order.front() {
            let expired = at.saturating_add(self.max_age_ms) <= now_ms;
            if !expired && self.order.len() <= self.capacity {
                break;
            }
            self.answers.remove(id);
            self.order.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(state: State, epoch: u64) -> SandboxRecord {
        SandboxRecord {
            id: "s".into(),
            template: "base".into(),
            resources: Resources::default(),
            env: BTreeMap::new(),
            metadata: BTreeMap::new(),
            start_command: None,
            access_token: None,
            network: None,
            traffic_access_token: None,
            image: None,
            state,
            epoch,
            pgid: 0,
            created_at_unix_ms: 0,
            pooled: false,
        }
    }

    #[test]
    fn moves() {
        assert_eq!(
            next_state(&record(State::Running, 0), Move::Pause),
            Ok(Some(State::Paused))
        );
        assert_eq!(next_state(&record(State::Paused, 0), Move::Pause), Ok(None));
        assert_eq!(
            next_state(&record(State::Paused, 0), Move::Kill),
            Ok(Some(State::Killed))
        );
        assert!(next_state(&record(State::Killed, 0), Move::Resume).is_err());
        assert_eq!(next_state(&record(State::Killed, 0), Move::Kill), Ok(None));
    }

    #[test]
    fn a_restore_keeps_only_a_same_epoch_copy_and_replaces_an_older_one() {
        assert_eq!(on_existing(None, 3), OnExisting::Restore);
        assert_eq!(on_existing(Some(&record(State::Killed, 9)), 3), OnExisting::Restore);
        assert_eq!(on_existing(Some(&record(State::Paused, 3)), 3), OnExisting::Keep);
        assert_eq!(on_existing(Some(&record(State::Paused, 2)), 3), OnExisting::Replace);
        assert_eq!(on_existing(Some(&record(State::Running, 1)), 3), OnExisting::Replace);
        assert!(matches!(
            on_existing(Some(&record(State::Paused, 4)), 3),
            OnExisting::Refuse(Refusal::StaleEpoch { got: 3, seen: 4, .. })
        ));
    }

    #[test]
    fn fencing() {
        assert_eq!(fence(&record(State::Running, 3), 3), Ok(3));
        assert_eq!(fence(&record(State::Running, 3), 4), Ok(4));
        assert!(matches!(
            fence(&record(State::Running, 3), 2),
            Err(Refusal::StaleEpoch { seen: 3, .. })
        ));
    }

    #[test]
    fn answers_are_recalled_bounded_and_guarded() {
        let mut a = Answers::new(2, 60_000);
        a.remember("op1", "pause s", 1, 0);
        assert_eq!(a.recall("op1", "pause s", 0), Recall::Answered(1));
        assert!(matches!(a.recall("op1", "kill s", 0), Recall::Reused { .. }));
        a.remember("op2", "x", 2, 0);
        a.remember("op3", "y", 3, 0);
        assert_eq!(a.recall("op1", "pause s", 0), Recall::New);
        assert_eq!(a.recall("op3", "y", 0), Recall::Answered(3));
        assert_eq!(a.len(), 2);
    }

    #[test]
    fn answers_are_forgotten_once_old() {
        let mut a = Answers::new(100, 1_000);
        a.remember("early", "x", 1, 0);
        a.remember("later", "y", 2, 600);
        assert_eq!(a.recall("early", "x", 999), Recall::Answered(1));
        assert_eq!(a.recall("early", "x", 1_000), Recall::New, "past its age");
        assert_eq!(a.recall("later", "y", 1_000), Recall::Answered(2));
        // Remembering prunes too: a node that only answers new calls stays bounded by age.
        a.remember("new", "z", 3, 5_000);
        assert_eq!(a.len(), 1);
    }
}
