//! The executor lease: only one balance-svc replica plans and moves at a time.
//!
//! One document, `balance-lease/executor`, names its holder and when the lease expires. A
//! replica takes it when it is absent or expired and renews it while it holds it, always by
//! compare-and-swap on that document alone; a replica that loses a race simply is not the
//! executor this round. A holder that dies stops renewing and another takes over after the
//! TTL. Holding the lease is not what makes a stale executor harmless, though: the plan
//! document's version and the sandboxes' fencing epochs are (see [`crate::migrate`]).

use std::time::Duration;

use common::clock::now_ms;
use ledger_client::{LedgerClient, LedgerError, Txn};

use crate::record::{may_take, LeaseDoc, LEASE_ID, LEASE_KIND};

#[derive(Clone)]
pub struct Lease {
    ledger: LedgerClient,
    holder: String,
    ttl: Duration,
}

impl Lease {
    pub fn new(ledger: LedgerClient, holder: String, ttl: Duration) -> Self {
        Self { ledger, holder, ttl }
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Takes or renews the lease; true when this replica holds it until `now + ttl`.
    pub async fn hold(&self) -> Result<bool, LedgerError> {
        let now = now_ms();
        let current = self.ledger.get::<LeaseDoc>(LEASE_KIND, LEASE_ID).await?;
        if !may_take(current.as_ref().map(|c| &c.value), &self.holder, now) {
            return Ok(false);
        }
        let term = current.as_ref().map_or(0, |c| c.value.term);
        let next = LeaseDoc {
            holder: self.holder.clone(),
            expires_at_unix_ms: now + self.ttl.as_millis() as u64,
            term: match &current {
                Some(c) if c.value.holder == self.holder => term,
                _ => term + 1,
            },
        };
        let txn = match &current {
            Some(c) => Txn::new().update(LEASE_KIND, LEASE_ID, c.version, &next)?,
            None => Txn::new().create(LEASE_KIND, LEASE_ID, &next)?,
        };
        match self.ledger.compare(txn).await {
            Ok(_) => {
                if current.as_ref().is_none_or(|c| c.value.holder != self.holder) {
                    tracing::info!(holder = %self.holder, term = next.term, "executor lease taken");
                }
                Ok(true)
            }
            Err(LedgerError::Conflict { .. }) => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// Gives the lease up (on a clean shutdown), so another replica need not wait the TTL.
    pub async fn release(&self) {
        if let Ok(Some(current)) = self.ledger.get::<LeaseDoc>(LEASE_KIND, LEASE_ID).await {
            if current.value.holder == self.holder {
                let _ = self
                    .ledger
                    .compare(Txn::new().delete(LEASE_KIND, LEASE_ID, current.version))
                    .await;
            }
        }
    }
}
