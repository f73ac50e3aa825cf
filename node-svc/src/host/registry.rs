//! The registry's parts: a sandbox ID's slot, the turn an operation holds on it, and the
//! operation answers kept for retries (the module above explains the locking).

use super::*;

/// One sandbox ID's place in the registry (see the module's notes on locking).
#[derive(Default)]
pub(super) struct Slot {
    /// Held for the whole of one operation on this sandbox.
    pub(super) turn: Arc<tokio::sync::Mutex<()>>,
    /// The sandbox as last committed; `None` while it is being created or once it is gone.
    pub(super) record: Mutex<Option<SandboxRecord>>,
    /// Held shared by envd requests that touch the sandbox's files, exclusively by a pause,
    /// so a pause (and the snapshot a move takes after it) never races a write accepted
    /// before it. See [`Host::file_access`].
    pub(super) files: Arc<tokio::sync::RwLock<()>>,
}

/// One operation's exclusive turn on a sandbox ID. Dropping it ends the turn; a slot left
/// without a sandbox leaves the registry then, while the turn is still held.
pub(super) struct Turn<'h> {
    pub(super) slots: &'h Mutex<HashMap<String, Arc<Slot>>>,
    pub(super) id: String,
    pub(super) slot: Arc<Slot>,
    /// The sandbox's turn itself (taken out only by [`Turn::keep`]).
    pub(super) held: Option<OwnedMutexGuard<()>>,
}

impl Turn<'_> {
    /// The sandbox as committed, if it exists.
    pub(super) fn record(&self) -> Option<SandboxRecord> {
        lock(&self.slot.record).clone()
    }

    /// Makes `record` what everyone sees (`None`: the sandbox is gone).
    pub(super) fn commit(&self, record: Option<SandboxRecord>) {
        *lock(&self.slot.record) = record;
    }

    /// The turn itself, held on by its taker past this call (a snapshot's stream, so that
    /// nothing resumes the sandbox while its files are read).
    pub(super) fn keep(mut self) -> Option<OwnedMutexGuard<()>> {
        self.held.take()
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let empty = lock(&self.slot.record).is_none();
        if empty {
            let mut slots = lock(self.slots);
            let ours = slots.get(&self.id).is_some_and(|s| Arc::ptr_eq(s, &self.slot));
            if ours {
                slots.remove(&self.id);
            }
        }
    }
}

/// Whether a call may act, or already has its answer.
pub(super) enum Admission<'h> {
    /// Boxed: an answer carries a whole record, a turn only a few pointers.
    Answered(Box<Answer>),
    Turn(Turn<'h>),
}

/// Whether an answer is final, and so given again to retries: refusals are; transient
/// trouble (the state directory, the runtime) is not, so a retry tries again.
/// Whether an answer is kept for retries of its operation ID. Failures of this host (I/O, the
/// runtime) and a corrupt snapshot stream are not: the retry brings a fresh stream or finds
/// the host healthy again, and deserves a fresh attempt.
pub(super) fn is_final(answer: &Answer) -> bool {
    !matches!(
        answer,
        Err(NodeError::Io(_) | NodeError::Runtime(_) | NodeError::Corrupt(_))
    )
}

impl Shared {
    pub(super) async fn persist(&self, record: &SandboxRecord) -> Result<(), NodeError> {
        let (dir, record) = (self.dir.clone(), record.clone());
        blocking(move || dir.persist(&record).map_err(io)).await
    }

    /// The answer already given to `operation_id` for `call`, if any.
    pub(super) fn recall(&self, operation_id: &str, call: &str) -> Option<Answer> {
        if operation_id.is_empty() {
            return None;
        }
        match lock(&self.answers).recall(operation_id, call, common::clock::now_ms()) {
            Recall::New => None,
            Recall::Answered(answer) => Some(answer),
            Recall::Reused { first } => Some(Err(NodeError::OperationReused {
                operation_id: operation_id.to_string(),
                first,
            })),
        }
    }

    /// Keeps `answer` for retries of `operation_id`, when it is final.
    pub(super) fn remember(&self, operation_id: &str, call: &str, answer: &Answer) {
        if is_final(answer) {
            lock(&self.answers).remember(operation_id, call, answer.clone(), common::clock::now_ms());
        }
    }

    /// Waits for sandbox `id`'s turn (see the module's notes on locking).
    pub(super) async fn enter(&self, id: &str) -> Turn<'_> {
        loop {
            let slot = lock(&self.slots).entry(id.to_string()).or_default().clone();
            let held = slot.turn.clone().lock_owned().await;
            let current = lock(&self.slots).get(id).is_some_and(|s| Arc::ptr_eq(s, &slot));
            if current {
                return Turn {
                    slots: &self.slots,
                    id: id.to_string(),
                    slot,
                    held: Some(held),
                };
            }
            // The slot left the registry while this call queued for it: queue on the new one.
        }
    }

    /// The turn on sandbox `id` for `call`, unless `operation_id` already has an answer
    /// (checked before queueing, and again once the turn comes).
    pub(super) async fn admit(&self, id: &str, operation_id: &str, call: &str) -> Admission<'_> {
        if let Some(answer) = self.recall(operation_id, call) {
            return Admission::Answered(Box::new(answer));
        }
        let turn = self.enter(id).await;
        match self.recall(operation_id, call) {
            Some(answer) => Admission::Answered(Box::new(answer)),
            None => Admission::Turn(turn),
        }
    }

    /// Appends a lifecycle event to the sandbox's log (where its runtime keeps one).
    pub(super) fn note(&self, id: &str, message: &str) {
        if let Some(log) = self.runtime.log_file(&self.dir.home(id)) {
            crate::logs::note(&log, "info", message);
        }
    }

    pub(super) fn committed(&self, sandbox_id: &str) -> Option<SandboxRecord> {
        let slot = lock(&self.slots).get(sandbox_id).cloned()?;
        let record = lock(&slot.record).clone();
        record
    }

    /// Every sandbox as last committed, by ID.
    pub(super) fn records(&self) -> Vec<SandboxRecord> {
        let slots: Vec<Arc<Slot>> = lock(&self.slots).values().cloned().collect();
        let mut records: Vec<SandboxRecord> = slots.iter().filter_map(|slot| lock(&slot.record).clone()).collect();
        records.sort_by(|a, b| a.id.cmp(&b.id));
        records
    }
}
