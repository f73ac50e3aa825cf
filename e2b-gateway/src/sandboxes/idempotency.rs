//! Idempotent creates: `POST /sandboxes` with an `Idempotency-Key` header makes at most one
//! sandbox per key and team, however often it is retried (a client whose connection broke
//! after the gateway answered retries, and must not pay for two sandboxes).
//!
//! The key is claimed first, with a create-only ledger write of `idempotency/<team>/<key>`
//! naming the sandbox ID the create will use. Whoever wins the write creates the sandbox;
//! a retry that loses it reads the claim and answers with that sandbox once it is no longer
//! being created. A create that fails gives the key back (the claim is deleted), so the next
//! retry tries again. The same key with a different request body is refused (409). Claims are
//! kept for [`KEEP_CLAIMS`], then removed by the reaper.
//!
//! A template with a warm pool is claimed from it as any create is: the pooled sandbox's
//! claim renames the key to its ID in the same ledger write (see `pool::HeldKey`).

use std::time::Duration;

use common::clock::now_ms;
use common::docs::{IdempotencyDoc, SandboxDoc, SandboxPhase, IDEMPOTENCY_KIND, SANDBOX_KIND};
use ledger_client::{LedgerError, Txn};
use sha2::{Digest, Sha256};

use super::{Failure, Sandboxes, LEDGER_RESOLVE_ATTEMPTS};
use crate::intent::CreateIntent;

/// How long a key keeps naming its sandbox.
pub const KEEP_CLAIMS: Duration = Duration::from_secs(24 * 3600);

/// How long a retry waits for the create it repeats to finish.
const WAIT_FOR_FIRST: Duration = Duration::from_secs(60);

/// The SDK's rule for keys: 1 to 255 lowercase letters, digits and hyphens.
pub fn check_key(key: &str) -> Result<(), String> {
    let ok = !key.is_empty()
        && key.len() <= 255
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err("Idempotency-Key must be 1 to 255 lowercase letters, digits or hyphens".to_string())
    }
}

fn claim_id(team: &str, key: &str) -> String {
    format!("{team}/{key}")
}

/// Hex SHA-256 of a request body.
pub fn request_sha256(body: &[u8]) -> String {
    Sha256::digest(body).iter().map(|b| format!("{b:02x}")).collect()
}

impl Sandboxes {
    /// Creates a sandbox once per `key`: the first call creates it, a repeat gets the same
    /// sandbox (waiting while it is still being created).
    pub async fn create_once(
        &self,
        team: &str,
        key: &str,
        request_sha256: String,
        intent: CreateIntent,
    ) -> Result<SandboxDoc, Failure> {
        let sandbox_id = super::create::new_sandbox_id();
        let claim = IdempotencyDoc {
            team_id: team.to_string(),
            key: key.to_string(),
            sandbox_id: sandbox_id.clone(),
            request_sha256,
            created_at_unix_ms: now_ms(),
        };
        let id = claim_id(team, key);
        let written = self
            .ledger
            .compare_resolving(
                Txn::new().create(IDEMPOTENCY_KIND, &id, &claim)?,
                LEDGER_RESOLVE_ATTEMPTS,
            )
            .await;
        match written {
            Ok(committed) => {
                let mut held = super::pool::HeldKey {
                    id: id.clone(),
                    version: committed.versions[0],
                    doc: claim,
                };
                let created = match self.admit(team, &sandbox_id).await {
                    Err(err) => Err(err),
                    Ok(_admitted) => match self.claim_pooled(team, &intent, Some(&mut held)).await {
                        Ok(Some(doc)) => return Ok(doc),
                        Ok(None) => self.create_traced(team, intent, sandbox_id).await,
                        Err(err) => Err(err),
                    },
                };
                let version = held.version;
                // Give the key back: the next retry creates again. Not after an unknown
                // outcome: that create may still become a sandbox (the reaper adopts one a
                // node runs), and a retry must find it rather than make a second.
                if matches!(&created, Err(err) if !matches!(err, Failure::Unknown(_))) {
                    let undo = Txn::new().delete(IDEMPOTENCY_KIND, &id, version);
                    if let Err(err) = self.ledger.compare_resolving(undo, LEDGER_RESOLVE_ATTEMPTS).await {
                        tracing::warn!(%err, key, "a failed create's idempotency key was not released");
                    }
                }
                created
            }
            Err(LedgerError::Conflict { .. }) => self.repeat(team, &id, &claim.request_sha256).await,
            Err(err) => Err(err.into()),
        }
    }

    /// A repeat of a create whose key is claimed: that create's sandbox, once created.
    async fn repeat(&self, team: &str, id: &str, request_sha256: &str) -> Result<SandboxDoc, Failure> {
        let deadline = tokio::time::Instant::now() + WAIT_FOR_FIRST;
        loop {
            let changed = self.routes.changed();
            let Some(first) = self.ledger.get::<IdempotencyDoc>(IDEMPOTENCY_KIND, id).await? else {
                return Err(Failure::Conflict(
                    "the first create with this Idempotency-Key failed; retry to create again".to_string(),
                ));
            };
            if first.value.request_sha256 != request_sha256 {
                return Err(Failure::Conflict(
                    "this Idempotency-Key was used for a different request".to_string(),
                ));
            }
            match self
                .ledger
                .get::<SandboxDoc>(SANDBOX_KIND, &first.value.sandbox_id)
                .await?
            {
                // A claim from a warm pool its node has not confirmed yet is not answered: the
                // node may not hold the tokens yet, or may refuse the hand-over.
                Some(doc)
                    if doc.value.team_id == team
                        && doc.value.phase != SandboxPhase::Creating
                        && !doc.value.claim_unconfirmed() =>
                {
                    return Ok(doc.value)
                }
                Some(_) => {}
                // Created and already killed, or not written yet: the claim tells which.
                None if first.value.created_at_unix_ms + 5_000 < now_ms() => {
                    return Err(Failure::NotFound(first.value.sandbox_id));
                }
                None => {}
            }
            // The routing table's watch sees every manifest change: wake on the next one.
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(Failure::Unavailable(
                    "the first create with this Idempotency-Key is still in progress; retry".to_string(),
                ));
            }
        }
    }

    /// Removes claims older than [`KEEP_CLAIMS`]; returns how many.
    pub async fn forget_old_claims(&self) -> Result<usize, Failure> {
        let cutoff = now_ms().saturating_sub(u64::try_from(KEEP_CLAIMS.as_millis()).unwrap_or(u64::MAX));
        let (claims, _) = self.ledger.list::<IdempotencyDoc>(IDEMPOTENCY_KIND, "").await?;
        let mut removed = 0;
        for claim in claims.into_iter().filter(|c| c.value.created_at_unix_ms < cutoff) {
            let txn = Txn::new().delete(IDEMPOTENCY_KIND, &claim.key.id, claim.version);
            if self.ledger.compare(txn).await.is_ok() {
                removed += 1;
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_sdks_rule() {
        assert!(check_key("0b6c1f4e-1c2d-4c1e-9a53-1f0d2a3b4c5d").is_ok());
        for bad in ["", "Upper", "under_score", "spa ce", &"k".repeat(256)] {
            assert!(check_key(bad).is_err(), "{bad}");
        }
        assert_eq!(request_sha256(b"").len(), 64);
        assert_ne!(request_sha256(b"a"), request_sha256(b"b"));
    }
}
