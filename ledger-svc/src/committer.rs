//! Group commit: one task owns every write and commits compares in batches.
//!
//! Writes must commit in revision order (see `store`), so they are serialised on the revision
//! counter no matter what. Rather than pay one transaction and one fsync per compare, callers
//! queue their compares here; the committer takes everything queued (up to a bound), commits it
//! in one transaction, and answers each caller with its own outcome. Under load batches grow by
//! themselves; an idle ledger commits a lone compare at once.
//!
//! One committer means one stuck transaction stops every write, so each batch runs under a
//! deadline. When it passes, the batch's callers learn whether COMMIT had been sent: if not,
//! nothing was applied; if so, the outcome is unknown and they must read to find out. Either
//! way the database is reported down until a later batch or poll succeeds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::head::HeadTracker;
use crate::model::{Action, Entry, Outcome};
use crate::store::{Store, StoreError};

/// Most compares in one transaction.
const MAX_BATCH: usize = 512;
/// Most payload bytes in one transaction (a single compare may exceed it alone).
const MAX_BATCH_BYTES: usize = 8 * 1024 * 1024;
/// Compares waiting for the committer before callers wait to queue.
const QUEUE_DEPTH: usize = 4096;
/// Longest a batch may take from BEGIN to COMMIT's answer. Longer than PostgreSQL's statement
/// timeout, so a statement the server ends reports its own error first.
pub const COMMIT_DEADLINE: Duration = Duration::from_secs(8);

struct Pending {
    entries: Vec<Entry>,
    reply: oneshot::Sender<Result<Outcome, StoreError>>,
}

/// The queue in front of the committer task. Cheap to clone.
#[derive(Clone)]
pub struct Committer {
    queue: mpsc::Sender<Pending>,
}

impl Committer {
    /// Starts the committer. Every commit advances the tracker's head to the new revision,
    /// which wakes the watchers of this process; every failure marks the database down.
    pub fn spawn(store: Store, tracker: HeadTracker, deadline: Duration) -> (Self, JoinHandle<()>) {
        let (queue, rx) = mpsc::channel(QUEUE_DEPTH);
        let task = tokio::spawn(run(store, rx, tracker, deadline));
        (Self { queue }, task)
    }

    /// Commits one compare (already validated) and returns its outcome.
    pub async fn submit(&self, entries: Vec<Entry>) -> Result<Outcome, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Pending { entries, reply })
            .await
            .map_err(|_| StoreError::Unavailable("the ledger is shutting down".to_string()))?;
        // Queued, then the committer went away: it may have been mid-COMMIT.
        answer
            .await
            .map_err(|_| StoreError::OutcomeUnknown("the ledger stopped while committing".to_string()))?
    }
}

fn payload_bytes(entries: &[Entry]) -> usize {
    entries
        .iter()
        .map(|e| match &e.action {
            Action::Put(json) => json.len(),
            Action::Delete | Action::Check => 0,
        })
        .sum()
}

/// Applies one batch under `deadline`, telling apart "never committed" and "unknown".
async fn apply(store: &Store, compares: &[Vec<Entry>], deadline: Duration) -> Result<Vec<Outcome>, StoreError> {
    let commit_sent = AtomicBool::new(false);
    match tokio::time::timeout(deadline, store.apply(compares, &commit_sent)).await {
        Ok(result) => result,
        Err(_) if commit_sent.load(Ordering::Acquire) => Err(StoreError::OutcomeUnknown(format!(
            "COMMIT sent, no answer within {deadline:?}"
        ))),
        Err(_) => Err(StoreError::Unavailable(format!(
            "the database did not answer within {deadline:?}; nothing was committed"
        ))),
    }
}

/// How often a committer whose last write failed probes the database with an empty write,
/// so health recovers even when no compare arrives.
const PROBE_EVERY: Duration = Duration::from_secs(1);

async fn run(store: Store, mut rx: mpsc::Receiver<Pending>, tracker: HeadTracker, deadline: Duration) {
    loop {
        let first = if tracker.writes_up() {
            rx.recv().await
        } else {
            tokio::select! {
                first = rx.recv() => first,
                () = tokio::time::sleep(PROBE_EVERY) => {
                    let probe = apply(&store, &[], deadline).await;
                    if probe.is_ok() {
                        tracker.set_writes_up(true);
                    }
                    continue;
                }
            }
        };
        let Some(first) = first else { return };
        let mut bytes = payload_bytes(&first.entries);
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH && bytes < MAX_BATCH_BYTES {
            match rx.try_recv() {
                Ok(next) => {
                    bytes += payload_bytes(&next.entries);
                    batch.push(next);
                }
                Err(_) => break,
            }
        }
        let (compares, replies): (Vec<_>, Vec<_>) = batch.into_iter().map(|p| (p.entries, p.reply)).unzip();
        metrics::histogram!("ledger_commit_batch_compares").record(compares.len() as f64);
        match apply(&store, &compares, deadline).await {
            Ok(outcomes) => {
                let newest = outcomes
                    .iter()
                    .filter_map(|o| match o {
                        Outcome::Committed { revision, .. } => Some(*revision),
                        Outcome::Conflicted { .. } => None,
                    })
                    .max();
                if let Some(newest) = newest {
                    tracker.advance(newest);
                }
                tracker.set_writes_up(true);
                tracing::trace!(compares = compares.len(), bytes, "batch committed");
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    let _ = reply.send(Ok(outcome));
                }
            }
            Err(err) => {
                match &err {
                    StoreError::OutcomeUnknown(_) => {
                        metrics::counter!("ledger_commits_unknown_total").increment(1);
                        tracing::error!(%err, compares = compares.len(), "batch outcome unknown; callers must read to learn it");
                    }
                    _ => tracing::warn!(%err, compares = compares.len(), "batch failed; nothing of it was applied"),
                }
                if matches!(err, StoreError::OutcomeUnknown(_) | StoreError::Unavailable(_)) {
                    tracker.set_writes_up(false);
                }
                for reply in replies {
                    let _ = reply.send(Err(err.clone()));
                }
            }
        }
    }
}
