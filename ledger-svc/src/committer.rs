//! Group commit: one task owns every write and commits compares in batches.
//!
//! Writes must commit in revision order (see `store`), so they are serialised on the revision
//! counter no matter what. Rather than pay one transaction and one fsync per compare, callers
//! queue their compares here; the committer takes everything queued (up to a bound), commits it
//! in one transaction, and answers each caller with its own outcome. Under load batches grow by
//! themselves; an idle ledger commits a lone compare at once.

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::model::{Action, Entry, Outcome};
use crate::store::{Store, StoreError};

/// Most compares in one transaction.
const MAX_BATCH: usize = 512;
/// Most payload bytes in one transaction (a single compare may exceed it alone).
const MAX_BATCH_BYTES: usize = 8 * 1024 * 1024;
/// Compares waiting for the committer before callers wait to queue.
const QUEUE_DEPTH: usize = 4096;

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
    /// Starts the committer. Every commit advances `head` to the new revision, which wakes
    /// the watchers of this process.
    pub fn spawn(store: Store, head: watch::Sender<u64>) -> (Self, JoinHandle<()>) {
        let (queue, rx) = mpsc::channel(QUEUE_DEPTH);
        let task = tokio::spawn(run(store, rx, head));
        (Self { queue }, task)
    }

    /// Commits one compare (already validated) and returns its outcome.
    pub async fn submit(&self, entries: Vec<Entry>) -> Result<Outcome, StoreError> {
        let (reply, answer) = oneshot::channel();
        let stopped = || StoreError::Unavailable("the ledger is shutting down".to_string());
        self.queue
            .send(Pending { entries, reply })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
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

async fn run(store: Store, mut rx: mpsc::Receiver<Pending>, head: watch::Sender<u64>) {
    while let Some(first) = rx.recv().await {
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
        match store.apply(&compares).await {
            Ok(outcomes) => {
                let newest = outcomes
                    .iter()
                    .filter_map(|o| match o {
                        Outcome::Committed { revision, .. } => Some(*revision),
                        Outcome::Conflicted { .. } => None,
                    })
                    .max();
                if let Some(newest) = newest {
                    head.send_if_modified(|h| {
                        let newer = newest > *h;
                        if newer {
                            *h = newest;
                        }
                        newer
                    });
                }
                tracing::trace!(compares = compares.len(), bytes, "batch committed");
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    let _ = reply.send(Ok(outcome));
                }
            }
            Err(err) => {
                tracing::warn!(%err, compares = compares.len(), "batch failed; nothing of it was applied");
                for reply in replies {
                    let _ = reply.send(Err(err.clone()));
                }
            }
        }
    }
}
