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
//! A gateway that dies mid-operation (or cannot reach the ledger to end it) leaves its claim
//! behind; the next user operation takes over a claim older than the claim's time to live (its
//! new epoch fences whatever the dead one might still do), and the reaper resolves one that no
//! user operation comes for.

use std::time::Duration;

use common::clock::now_ms;
use common::docs::{SandboxDoc, USER_CLAIM_PREFIX};
use ledger_client::{LedgerError, Txn, Versioned};

use super::{Failure, Sandboxes, LEDGER_RESOLVE_ATTEMPTS, WAIT_FOR_MOVE};

/// How long a user operation may hold a sandbox before another may take it over, unless the
/// gateway is told otherwise (`--claim-ttl`): far longer than any kill, pause or resume takes,
/// hibernation of a large sandbox included.
pub const DEFAULT_CLAIM_TTL: Duration = Duration::from_secs(120);

/// The operation name of a kill's claim.
pub(super) const KILL: &str = "kill";
/// A kill that makes room for a create (a pooled sandbox evicted). Unlike a kill's, its claim
/// is not taken over by another kill at once: two creates evicting one sandbox must not both
/// count its room as theirs, so the second waits, finds it gone, and does not.
pub(super) const EVICT: &str = "evict";

/// Whether user operation `op` may displace the manifest's owner at `now`: a user claim past
/// its time to live `ttl`, or — for a kill — another kill's claim at once (kills are idempotent,
/// and one whose node did not answer leaves its claim for the next to finish).
pub(super) fn may_take_over(doc: &SandboxDoc, op: &str, now: u64, ttl: Duration) -> bool {
    let Some(owner) = doc.lifecycle_owner.as_deref() else {
        return true;
    };
    let Some(claim) = owner.strip_prefix(USER_CLAIM_PREFIX) else {
        return false;
    };
    let kill_after_kill = op == KILL && claim.split(':').next() == Some(KILL);
    let since = doc.lifecycle_claimed_at_unix_ms.unwrap_or(0);
    kill_after_kill || now.saturating_sub(since) >= u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)
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
                if !may_take_over(&doc.value, op, now_ms(), self.patience.claim_ttl) {
                    if tokio::time::timeout_at(deadline, changed).await.is_err() {
                        return Err(Failure::Conflict(format!(
                            "sandbox {id} is busy ({current}); retry in a few seconds"
                        )));
                    }
                    continue;
                }
                tracing::warn!(sandbox_id = %id, previous = %current, "taking over a user claim (expired, or an unconfirmed kill)");
            }
            doc.value.lifecycle_owner = Some(owner.clone());
            doc.value.lifecycle_claimed_at_unix_ms = Some(now_ms());
            doc.value.epoch += 1;
            let txn = Txn::new().update_read(&doc, &doc.value)?;
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
        released(&mut doc.value);
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
    fn user_claims_are_taken_over_when_expired_or_by_a_kill_after_a_kill() {
        let ttl = DEFAULT_CLAIM_TTL.as_millis() as u64;
        let may_take_over = |doc: &SandboxDoc, op: &str, now: u64| may_take_over(doc, op, now, DEFAULT_CLAIM_TTL);
        let doc = |owner: Option<&str>, since: u64| SandboxDoc {
            lifecycle_owner: owner.map(str::to_string),
            lifecycle_claimed_at_unix_ms: Some(since),
            ..SandboxDoc::default()
        };
        assert!(may_take_over(&doc(None, 0), "pause", 0));
        assert!(!may_take_over(
            &doc(Some("user:pause:1"), 1_000),
            "kill",
            1_000 + ttl - 1
        ));
        assert!(may_take_over(&doc(Some("user:pause:1"), 1_000), "pause", 1_000 + ttl));
        // An unconfirmed kill is finished by the next kill at once; nothing else jumps in.
        assert!(may_take_over(&doc(Some("user:kill:1"), 1_000), "kill", 1_000));
        assert!(!may_take_over(&doc(Some("user:kill:1"), 1_000), "resume", 1_000));
        // A move's ownership is the balancer's to resolve, never taken over here.
        assert!(!may_take_over(&doc(Some("plan.0"), 0), "kill", ttl * 10));
        assert!(
            !may_take_over(&doc(Some("user:evict:1"), 1_000), EVICT, 1_000),
            "an eviction is not taken over by another: one create counts the room"
        );
        assert!(!may_take_over(&doc(Some("user:evict:1"), 1_000), "kill", 1_000));
    }
}
