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

/// Shared view of the head revision, the compaction point and whether the database answers.
#[derive(Clone)]
pub struct HeadTracker {
    revision: watch::Sender<u64>,
    compacted: Arc<AtomicU64>,
    db_up: Arc<AtomicBool>,
    health: watch::Sender<bool>,
}

impl HeadTracker {
    pub fn new(head: Head) -> Self {
        Self {
            revision: watch::Sender::new(head.revision),
            compacted: Arc::new(AtomicU64::new(head.compacted)),
            db_up: Arc::new(AtomicBool::new(true)),
            health: watch::Sender::new(true),
        }
    }

    /// The sender the committer advances.
    pub fn sender(&self) -> watch::Sender<u64> {
        self.revision.clone()
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
        self.revision.send_if_modified(|h| {
            let newer = head.revision > *h;
            if newer {
                *h = head.revision;
            }
            newer
        });
        self.compacted.fetch_max(head.compacted, Ordering::AcqRel);
    }

    fn set_db_up(&self, up: bool) {
        metrics::gauge!("ledger_database_up").set(if up { 1.0 } else { 0.0 });
        if self.db_up.swap(up, Ordering::AcqRel) != up {
            if up {
                tracing::info!("database reachable again");
            } else {
                tracing::error!("database unreachable: writes and reads answer UNAVAILABLE until it returns");
            }
            self.health.send_replace(up);
        }
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
                match store.head().await {
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
