//! The executor lease: only one balance-svc replica plans and moves at a time.
//!
//! One document, `balance-lease/executor`, names its holder. A keeper task in every replica
//! visits it every sixth of the TTL: the holder renews it (compare-and-swap on its version),
//! the others watch it, and take it only once it has not changed for a full TTL by their own
//! clock ([`may_take`]). The holder may act only while its renewal is confirmed: until a TTL
//! after it *sent* the last successful renewal, less a margin ([`Lease::confirmed`]); the
//! executor checks before every step, so an executor whose renewals fail stops acting before
//! anyone else may start. Holding the lease is still not what makes a stale executor
//! harmless: the plan document's version and the sandboxes' fencing epochs are (see
//! [`crate::migrate`]); the lease keeps two executors from being a normal event.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use common::clock::now_ms;
use ledger_client::{LedgerClient, LedgerError, Txn};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::record::{may_take, LeaseDoc, LEASE_ID, LEASE_KIND};

/// What this replica knows of the lease.
#[derive(Default)]
struct Knowledge {
    /// Until when this replica may act: a TTL after the last confirmed renewal was sent.
    held_until: Option<Instant>,
    /// Another holder's lease version, and when this replica first saw it.
    watching: Option<(u64, Instant)>,
}

#[derive(Clone)]
pub struct Lease {
    ledger: LedgerClient,
    holder: String,
    ttl: Duration,
    knowledge: Arc<Mutex<Knowledge>>,
    /// Woken when this replica becomes the holder, so it acts at once.
    taken: Arc<Notify>,
}

impl Lease {
    pub fn new(ledger: LedgerClient, holder: String, ttl: Duration) -> Self {
        Self {
            ledger,
            holder,
            ttl,
            knowledge: Arc::default(),
            taken: Arc::default(),
        }
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    fn knowledge(&self) -> std::sync::MutexGuard<'_, Knowledge> {
        self.knowledge.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether this replica holds the lease with at least a quarter of the TTL left.
    pub fn confirmed(&self) -> bool {
        let margin = self.ttl / 4;
        self.knowledge()
            .held_until
            .is_some_and(|until| Instant::now() + margin < until)
    }

    /// Resolves when this replica next becomes the holder (or has become it since the last
    /// call: the one waiter, the balance loop, never misses it).
    pub async fn taken(&self) {
        self.taken.notified().await;
    }

    /// Takes or renews the lease if this replica may; true when it holds it now.
    pub async fn hold(&self) -> Result<bool, LedgerError> {
        let sent = Instant::now();
        let current = self.ledger.get::<LeaseDoc>(LEASE_KIND, LEASE_ID).await?;
        let was_held = self.knowledge().held_until.is_some();
        let allowed = {
            let mut known = self.knowledge();
            let view = current.as_ref().map(|c| (&c.value, c.version));
            if let Some((lease, version)) = view {
                if lease.holder != self.holder {
                    known.held_until = None;
                    if known.watching.is_none_or(|(v, _)| v != version) {
                        known.watching = Some((version, Instant::now()));
                    }
                }
            }
            let seen = known.watching.map(|(v, at)| (v, at.elapsed()));
            may_take(view, &self.holder, seen, self.ttl)
        };
        if !allowed {
            return Ok(false);
        }
        let term = current.as_ref().map_or(0, |c| c.value.term);
        let ours = current.as_ref().is_some_and(|c| c.value.holder == self.holder);
        let next = LeaseDoc {
            holder: self.holder.clone(),
            expires_at_unix_ms: now_ms() + self.ttl.as_millis() as u64,
            term: if ours { term } else { term + 1 },
        };
        let txn = match &current {
            Some(c) => Txn::new().update_read(c, &next)?,
            None => Txn::new().create(LEASE_KIND, LEASE_ID, &next)?,
        };
        match self.ledger.compare_resolving(txn, 2).await {
            Ok(_) => {
                {
                    let mut known = self.knowledge();
                    known.held_until = Some(sent + self.ttl);
                    known.watching = None;
                }
                if !was_held {
                    tracing::info!(holder = %self.holder, term = next.term, "executor lease taken");
                    self.taken.notify_one();
                }
                Ok(true)
            }
            Err(LedgerError::Conflict { .. }) => {
                self.knowledge().held_until = None;
                Ok(false)
            }
            Err(err) => Err(err),
        }
    }

    /// Visits the lease every sixth of the TTL until aborted (so a lapsed lease is taken at
    /// most a sixth of a TTL late, and a holder renews several times within its margin):
    /// renews it while held, takes it
    /// once it lapses. A failed visit leaves the holder's confirmation to run out by itself.
    pub fn spawn_keeper(&self) -> JoinHandle<()> {
        let lease = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(lease.ttl / 6);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let held = lease.hold().await;
                metrics::gauge!("balance_leader").set(if matches!(held, Ok(true)) { 1.0 } else { 0.0 });
                if let Err(err) = held {
                    tracing::debug!(%err, "lease visit failed");
                }
            }
        })
    }

    /// Gives the lease up (on a clean shutdown), so another replica need not wait the TTL:
    /// the document stays, with no holder. (Deleting it would restart its version at 1 on
    /// the next create, and a stale writer's compare on an old version could match again.)
    pub async fn release(&self) {
        self.knowledge().held_until = None;
        if let Ok(Some(current)) = self.ledger.get::<LeaseDoc>(LEASE_KIND, LEASE_ID).await {
            if current.value.holder == self.holder {
                let released = LeaseDoc {
                    holder: String::new(),
                    expires_at_unix_ms: now_ms(),
                    term: current.value.term,
                };
                if let Ok(txn) = Txn::new().update_read(&current, &released) {
                    let _ = self.ledger.compare(txn).await;
                }
            }
        }
    }
}
