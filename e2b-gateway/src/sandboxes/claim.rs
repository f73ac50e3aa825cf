//! User operations claim a sandbox before they act.
//!
//! A kill, pause or resume touches a node and then the manifest. Without a claim, a balancer
//! move could take the sandbox between the gateway's read and its node call: the kill lands
//! on the source while the move resumes the target, and the user hears 204 while the sandbox
//! runs on. So the operation first writes itself into the manifest as lifecycle owner under a
//! new epoch (compare-and-swap on the version it read): from then on a move cannot take the
//! sandbox (it needs no owner), nodes refuse any call under an older epoch, and the operation
//! ends by writing its result and clearing the owner in one more compare-and-swap.
//!
//! A gateway that dies mid-operation leaves its claim behind; the next user operation takes
//! over a claim older than [`CLAIM_TTL`] (its new epoch fences whatever the dead one might
//! still do).

use std::time::Duration;

use common::clock::now_ms;
use common::docs::{SandboxDoc, SANDBOX_KIND, USER_CLAIM_PREFIX};
use ledger_client::{LedgerError, Txn, Versioned};

use super::{Failure, Sandboxes, LEDGER_RESOLVE_ATTEMPTS, WAIT_FOR_MOVE};

/// How long a user operation may hold a sandbox before another may take it over: far longer
/// than any kill, pause or resume takes, hibernation of a large sandbox included.
pub(super) const CLAIM_TTL: Duration = Duration::from_secs(120);

/// Whether the manifest's owner may be displaced by a new user operation at `now`.
pub(super) fn claim_expired(doc: &SandboxDoc, now: u64) -> bool {
    let by_user = doc
        .lifecycle_owner
        .as_deref()
        .is_some_and(|o| o.starts_with(USER_CLAIM_PREFIX));
    let since = doc.lifecycle_claimed_at_unix_ms.unwrap_or(0);
    by_user && now.saturating_sub(since) >= CLAIM_TTL.as_millis() as u64
}

impl Sandboxes {
    /// Takes the sandbox for the user operation `op`: waits (up to [`WAIT_FOR_MOVE`]) for any
    /// other owner to finish, then writes itself as owner under epoch + 1. Returns the manifest
    /// as claimed; its version and epoch are what the operation acts under.
    pub(super) async fn claim(&self, team: &str, id: &str, op: &str) -> Result<Versioned<SandboxDoc>, Failure> {
        let owner = format!("{USER_CLAIM_PREFIX}{op}:{}", uuid::Uuid::new_v4().simple());
        let deadline = tokio::time::Instant::now() + WAIT_FOR_MOVE;
        loop {
            let changed = self.routes.changed();
            let mut doc = self.get(team, id).await?;
            if let Some(current) = &doc.value.lifecycle_owner {
                if !claim_expired(&doc.value, now_ms()) {
                    if tokio::time::timeout_at(deadline, changed).await.is_err() {
                        return Err(Failure::Conflict(format!(
                            "sandbox {id} is busy ({current}); retry in a few seconds"
                        )));
                    }
                    continue;
                }
                tracing::warn!(sandbox_id = %id, stale = %current, "taking over a user claim left by a gateway that stopped");
            }
            doc.value.lifecycle_owner = Some(owner.clone());
            doc.value.lifecycle_claimed_at_unix_ms = Some(now_ms());
            doc.value.epoch += 1;
            let txn = Txn::new().update(SANDBOX_KIND, id, doc.version, &doc.value)?;
            match self.ledger.compare_resolving(txn, LEDGER_RESOLVE_ATTEMPTS).await {
                Ok(done) => {
                    doc.version = done.versions.first().copied().unwrap_or(doc.version + 1);
                    tracing::debug!(sandbox_id = %id, epoch = doc.value.epoch, %owner, "claimed");
                    return Ok(doc);
                }
                // Changed between read and write (a move took it, a timeout changed): read again.
                Err(LedgerError::Conflict { .. }) => continue,
                Err(err) => return Err(err.into()),
            }
        }
    }

    /// Gives a claim up without any other change (the operation failed before changing
    /// anything). The epoch stays raised: calls made under the claim's epoch stay valid, older
    /// ones stay refused.
    pub(super) async fn unclaim(&self, doc: &mut Versioned<SandboxDoc>) {
        doc.value.lifecycle_owner = None;
        doc.value.lifecycle_claimed_at_unix_ms = None;
        if let Err(err) = self.save(doc).await {
            tracing::error!(sandbox_id = %doc.value.sandbox_id, %err,
                "could not release the claim; the next operation takes it over after its time to live");
        }
    }
}

/// Clears the claim in `doc` (the write that ends an operation carries it).
pub(super) fn released(doc: &mut SandboxDoc) {
    doc.lifecycle_owner = None;
    doc.lifecycle_claimed_at_unix_ms = None;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_user_claims_past_their_time_to_live_are_taken_over() {
        let ttl = CLAIM_TTL.as_millis() as u64;
        let doc = |owner: Option<&str>, since: u64| SandboxDoc {
            lifecycle_owner: owner.map(str::to_string),
            lifecycle_claimed_at_unix_ms: Some(since),
            ..SandboxDoc::default()
        };
        assert!(!claim_expired(&doc(None, 0), ttl * 10));
        assert!(!claim_expired(&doc(Some("user:kill:1"), 1_000), 1_000 + ttl - 1));
        assert!(claim_expired(&doc(Some("user:kill:1"), 1_000), 1_000 + ttl));
        // A move's ownership is the balancer's to resolve, never taken over here.
        assert!(!claim_expired(&doc(Some("plan.0"), 0), ttl * 10));
    }
}
