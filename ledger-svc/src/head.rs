//! The ledger's head revision as this process knows it, and the background work that keeps it
//! true: polling the counter row (another replica may have committed), watching the
//! database's health, and compacting the change log.
//!
//! Watch streams sleep on the head's `watch` channel and wake when it moves, so a commit in
//! this process reaches its watchers at once and one in another replica within a poll interval.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::store::{Head, Store, StoreError};

/// Longest a head poll may take before the database counts as down.
const POLL_DEADLINE: Duration = Duration::from_secs(3);

/// Shared view of the head revision, the compaction point and whether the database answers.
#[derive(Clone)]
pub struct HeadTracker {
    revision: watch::Sender<u64>,
    compacted: Arc<AtomicU64>,
    /// Whether the head poll answers (reads).
    db_up: Arc<AtomicBool>,
    /// Whether the last write batch (or write probe) committed.
    writes_up: Arc<AtomicBool>,
    health: watch::Sender<bool>,
}

impl HeadTracker {
    pub fn new(head: Head) -> Self {
        Self {
            revision: watch::Sender::new(head.revision),
            compacted: Arc::new(AtomicU64::new(head.compacted)),
            db_up: Arc::new(AtomicBool::new(true)),
            writes_up: Arc::new(AtomicBool::new(true)),
            health: watch::Sender::new(true),
        }
    }

    /// Moves the head forward to `revision` (never back), waking this process's watchers.
    pub fn advance(&self, revision: u64) {
        self.revision.send_if_modified(|h| {
            let newer = revision > *h;
            if newer {
                *h = revision;
            }
            newer
        });
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.revision.subscribe()
    }

    pub fn revision(&self) -> u64 {
        *self.revision.borrow()
    }

    pub fn compacted(&self) -> u64 {
        self.compacted.load(Ordering::Acquire)
    }

    /// `true` while the database answers; changes are published for health reporting.
    pub fn health(&self) -> watch::Receiver<bool> {
        self.health.subscribe()
    }

    fn observe(&self, head: Head) {
        self.advance(head.revision);
        self.compacted.fetch_max(head.compacted, Ordering::AcqRel);
    }

    /// Records whether the database answers reads (the head poll).
    fn set_db_up(&self, up: bool) {
        self.db_up.store(up, Ordering::Release);
        self.publish();
    }

    /// Records whether writes commit. A database that answers reads while every COMMIT hangs
    /// is not serving either.
    pub(crate) fn set_writes_up(&self, up: bool) {
        self.writes_up.store(up, Ordering::Release);
        self.publish();
    }

    pub(crate) fn writes_up(&self) -> bool {
        self.writes_up.load(Ordering::Acquire)
    }

    /// Publishes the combined health when it changes, and logs the change once.
    fn publish(&self) {
        let reads = self.db_up.load(Ordering::Acquire);
        let writes = self.writes_up();
        let up = reads && writes;
        metrics::gauge!("ledger_database_up").set(if reads { 1.0 } else { 0.0 });
        metrics::gauge!("ledger_writes_up").set(if writes { 1.0 } else { 0.0 });
        self.health.send_if_modified(|current| {
            if *current == up {
                return false;
            }
            if up {
                tracing::info!("database reachable again; reads and writes answer");
            } else if !reads {
                tracing::error!("database unreachable: reads and writes answer UNAVAILABLE until it returns");
            } else {
                tracing::error!("database writes do not commit: compares fail until a write commits again");
            }
            *current = up;
            true
        });
    }

    /// Polls the counter row every `interval`: picks up other replicas' commits and notices
    /// when the database goes away or comes back.
    pub fn spawn_poller(&self, store: Store, interval: Duration) -> JoinHandle<()> {
        let tracker = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                // A database that accepts the connection but never answers is as down as
                // one that refuses it.
                let polled = tokio::time::timeout(POLL_DEADLINE, store.head())
                    .await
                    .unwrap_or_else(|_| Err(StoreError::Unavailable("head poll timed out".into())));
                match polled {
                    Ok(head) => {
                        tracker.observe(head);
                        tracker.set_db_up(true);
                    }
                    Err(err) => {
                        tracing::debug!(%err, "head poll failed");
                        tracker.set_db_up(false);
                    }
                }
            }
        })
    }

    /// Deletes change-log rows older than the newest `retain` revisions; returns the new
    /// compaction point (unchanged when there was nothing to delete).
    pub async fn compact(&self, store: &Store, retain: u64) -> Result<u64, StoreError> {
        let upto = self.revision().saturating_sub(retain);
        if upto <= self.compacted() {
            return Ok(self.compacted());
        }
        store.compact(upto).await?;
        self.compacted.fetch_max(upto, Ordering::AcqRel);
        tracing::info!(compacted = upto, "change log compacted");
        Ok(upto)
    }

    /// Every `interval`, compacts the change log down to the newest `retain` revisions.
    pub fn spawn_compactor(&self, store: Store, retain: u64, interval: Duration) -> JoinHandle<()> {
        let tracker = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(err) = tracker.compact(&store, retain).await {
                    tracing::warn!(%err, "compaction failed; will retry");
                }
            }
        })
    }
}
