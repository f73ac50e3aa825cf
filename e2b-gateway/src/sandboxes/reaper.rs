//! The reaper: ends every sandbox whose time is up (paused where it asked for that, else
//! killed), every paused sandbox kept past the retention, and every create abandoned half-way.
//! The end time lives in the manifest, so this survives gateway restarts.
//!
//! A paused sandbox does not time out, as on E2B: it is kept until killed, or until it has
//! been paused for the gateway's `--paused-retention`; `connect` or a resume gives it a
//! timeout again.

use std::time::Duration;

use common::clock::now_ms;
use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND, USER_CLAIM_PREFIX};
use ledger_client::{Txn, Versioned};

use proto::node::v1 as node_pb;

use super::claim::{released, KILL};
use super::{Failure, Sandboxes, LEDGER_RESOLVE_ATTEMPTS};

/// Sandboxes ended at once: one that waits for a move (up to the claim's wait) does not hold
/// up the others.
const AT_ONCE: usize = 16;

/// A manifest still `creating` this long after its create began belongs to a create whose
/// gateway stopped mid-way (a create takes milliseconds to seconds), unless the gateway is
/// told otherwise (`--abandoned-create-after`).
pub const DEFAULT_ABANDONED_CREATE_AFTER: Duration = Duration::from_secs(5 * 60);

/// How long the reaper lets a sandbox wait in a phase that does not end by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Patience {
    /// A paused sandbox is kept this long (it does not time out while paused).
    pub paused_retention: Duration,
    /// A manifest still `creating` this long after its create began is resolved against the
    /// nodes: a create's gateway stopped mid-way.
    pub abandoned_create_after: Duration,
    /// A user operation's claim on a sandbox older than this may be taken over; the reaper
    /// resolves one that no user operation came for.
    pub claim_ttl: Duration,
}

impl Patience {
    fn ms(d: Duration) -> u64 {
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
    }
}

/// What the reaper does to a manifest now, if anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reap {
    Kill,
    /// Paused with its memory (true) or its files only.
    Pause {
        memory: bool,
    },
    /// A create abandoned half-way: its process may run on any node.
    EndCreate,
    /// A pause, resume or network change whose gateway stopped (or lost the ledger) before it
    /// ended: the manifest is made to say what the node holds, and released.
    ResolveClaim,
    /// A pooled sandbox claimed by a create whose mark outlived the create: confirmed if its
    /// node took the hand-over, else ended (that create never answered).
    ConfirmPoolClaim,
}

/// A claim of a pooled sandbox still marked this long after it was written is the reaper's:
/// longer than the node's hand-over may take (5 s) before its create kills it.
const UNCONFIRMED_POOL_CLAIM_AFTER_MS: u64 = 15_000;

/// A kill's claim this old is finished by the reaper, whatever the claims' time to live: a kill
/// that ended without the node's answer (the node died under it) told its caller "kill
/// again", and a caller that does not would leave a manifest naming a sandbox that may be gone.
/// Kills are idempotent, so finishing one early races nothing it could harm.
const UNCONFIRMED_KILL_AFTER_MS: u64 = 5_000;

/// What to do about a running or paused sandbox's user claim past its time to live: finish a
/// kill (the user asked for it; kills are idempotent) after [`UNCONFIRMED_KILL_AFTER_MS`],
/// resolve anything else against the node.
fn stale_claim(doc: &SandboxDoc, now: u64, ttl_ms: u64) -> Option<Reap> {
    let claim = doc.lifecycle_owner.as_deref()?.strip_prefix(USER_CLAIM_PREFIX)?;
    let age = now.saturating_sub(doc.lifecycle_claimed_at_unix_ms.unwrap_or(0));
    if claim.split(':').next() == Some(KILL) {
        return (age >= ttl_ms.min(UNCONFIRMED_KILL_AFTER_MS)).then_some(Reap::Kill);
    }
    (age >= ttl_ms).then_some(Reap::ResolveClaim)
}

pub(super) fn reap(doc: &SandboxDoc, now: u64, patience: Patience) -> Option<Reap> {
    let retention_ms = Patience::ms(patience.paused_retention);
    if matches!(doc.phase, SandboxPhase::Running | SandboxPhase::Paused) {
        if let Some(what) = stale_claim(doc, now, Patience::ms(patience.claim_ttl)) {
            return Some(what);
        }
    }
    if doc.phase == SandboxPhase::Running
        && doc.claim_unconfirmed()
        && doc.started_at_unix_ms.saturating_add(UNCONFIRMED_POOL_CLAIM_AFTER_MS) <= now
    {
        return Some(Reap::ConfirmPoolClaim);
    }
    match doc.phase {
        SandboxPhase::Creating => {
            let after = Patience::ms(patience.abandoned_create_after);
            let abandoned = doc.started_at_unix_ms.saturating_add(after) <= now;
            abandoned.then_some(Reap::EndCreate)
        }
        SandboxPhase::Paused | SandboxPhase::Hibernated => {
            // A manifest paused before the time was recorded counts from its old end.
            let since = doc.paused_at_unix_ms.unwrap_or(doc.end_at_unix_ms);
            (since.saturating_add(retention_ms) <= now).then_some(Reap::Kill)
        }
        SandboxPhase::Running if doc.end_at_unix_ms > now => None,
        SandboxPhase::Running if doc.auto_pause => Some(Reap::Pause {
            memory: doc.auto_pause_memory,
        }),
        SandboxPhase::Running => Some(Reap::Kill),
    }
}

/// How long a pooled sandbox may run with no slot naming it before it is ended (longer than
/// any slot's grace, so a slot being filled is never taken for gone).
const ORPHAN_AFTER_MS: u64 = 120_000;

impl Sandboxes {
    /// Ends every sandbox whose time is up: paused where it asked for that, else killed. The
    /// end time lives in the manifest, so this survives gateway restarts.
    pub async fn reap(&self) -> Result<usize, Failure> {
        use futures::StreamExt;
        let now = now_ms();
        let all = self.all().await?;
        let orphans = self.pool_orphans(&all, now).await;
        let due: Vec<_> = all
            .into_iter()
            .filter_map(|doc| {
                let what = if orphans.contains(&doc.value.sandbox_id) {
                    Some(Reap::Kill)
                } else {
                    reap(&doc.value, now, self.patience)
                };
                what.map(|what| (what, doc.value))
            })
            .collect();
        let ended = futures::stream::iter(due)
            .map(|(what, d)| async move {
                let result = match what {
                    Reap::Pause { memory } => self.pause(&d.team_id, &d.sandbox_id, memory).await,
                    Reap::Kill => self.kill(&d.team_id, &d.sandbox_id).await,
                    Reap::EndCreate => self.end_abandoned_create(&d.team_id, &d.sandbox_id).await,
                    Reap::ResolveClaim => self.resolve_claim(&d.team_id, &d.sandbox_id).await,
                    Reap::ConfirmPoolClaim => self.confirm_pool_claim(&d.team_id, &d.sandbox_id).await,
                };
                match result {
                    Ok(()) => 1,
                    Err(err) => {
                        tracing::warn!(sandbox_id = %d.sandbox_id, %err, "reaper could not end sandbox");
                        0
                    }
                }
            })
            .buffer_unordered(AT_ONCE)
            .fold(0, |sum, n| async move { sum + n })
            .await;
        Ok(ended)
    }

    /// Pooled sandboxes that no pool slot names, running for longer than a slot's grace: a
    /// slot freed while its sandbox was still being written (another gateway's clock), or a
    /// pooled create the reaper completed. Nobody would ever claim or retire them.
    async fn pool_orphans(&self, all: &[Versioned<SandboxDoc>], now: u64) -> std::collections::HashSet<String> {
        let pooled: Vec<&SandboxDoc> = all
            .iter()
            .map(|d| &d.value)
            .filter(|d| d.pool.is_some() && d.team_id.is_empty() && d.phase == SandboxPhase::Running)
            .filter(|d| d.started_at_unix_ms.saturating_add(ORPHAN_AFTER_MS) <= now)
            .collect();
        if pooled.is_empty() {
            return Default::default();
        }
        let Ok((slots, _)) = self
            .ledger
            .list::<common::pool::PoolSlotDoc>(common::pool::POOL_SLOT_KIND, "")
            .await
        else {
            return Default::default();
        };
        let named: std::collections::HashSet<&str> = slots.iter().map(|s| s.value.sandbox_id.as_str()).collect();
        pooled
            .into_iter()
            .filter(|d| !named.contains(d.sandbox_id.as_str()))
            .map(|d| d.sandbox_id.clone())
            .collect()
    }

    /// Resolves a user operation's claim left past its time to live: takes it over (epoch + 1,
    /// fencing whatever the stopped operation might still do), asks the sandbox's node whether
    /// it runs or is paused, writes that phase and releases the claim. A node that does not
    /// answer, or does not hold the sandbox, leaves the new claim for a later round.
    async fn resolve_claim(&self, team: &str, id: &str) -> Result<(), Failure> {
        let mut doc = self.claim(team, id, "resolve").await?;
        let running = match self.held_on(&doc.value.node_id, &doc.value.node_address, id).await {
            Ok(Some(s)) if s.state == node_pb::SandboxState::Running as i32 => true,
            Ok(Some(s)) if s.state == node_pb::SandboxState::Paused as i32 => false,
            Ok(other) => {
                return Err(Failure::Unavailable(format!(
                    "a stale claim on {id}: its node {} holds it as {:?}",
                    doc.value.node_id,
                    other.map(|s| s.state)
                )))
            }
            Err(why) => {
                return Err(Failure::Unavailable(format!(
                    "a stale claim on {id}: its node {} did not answer ({why})",
                    doc.value.node_id
                )))
            }
        };
        if running {
            doc.value.phase = SandboxPhase::Running;
            doc.value.paused_at_unix_ms = None;
        } else {
            doc.value.phase = SandboxPhase::Paused;
            doc.value.paused_at_unix_ms.get_or_insert(now_ms());
        }
        released(&mut doc.value);
        self.save(&doc).await?;
        self.routes.set_running(id, running).await;
        metrics::counter!("gateway_stale_claims_resolved_total").increment(1);
        tracing::warn!(sandbox_id = %id, node_id = %doc.value.node_id, running, "resolved a claim its operation left behind");
        Ok(())
    }

    /// What the node at `address` holds of sandbox `id` (its listing entry), or why it did not
    /// answer.
    async fn held_on(&self, node_id: &str, address: &str, id: &str) -> Result<Option<node_pb::SandboxInfo>, String> {
        let mut node = self.nodes.client(node_id, address).await.map_err(|e| e.to_string())?;
        let listed = node.list(node_pb::ListRequest {}).await.map_err(|s| s.to_string())?;
        Ok(listed.into_inner().sandboxes.into_iter().find(|s| s.sandbox_id == id))
    }

    /// Confirms or ends claim `id` of a pooled sandbox whose create did not clear its mark (its
    /// gateway stopped, or lost the ledger): the node is the witness. A sandbox it no longer
    /// holds as pooled took a claim, and only the claim that won the ledger's compare-and-swap
    /// is ever sent, so the hand-over was this one and its create may have answered: the mark
    /// is cleared. One it still holds as pooled, or not at all, never took it, so its create
    /// never answered: it is killed.
    async fn confirm_pool_claim(&self, team: &str, id: &str) -> Result<(), Failure> {
        let Some(doc) = self.ledger.get::<SandboxDoc>(SANDBOX_KIND, id).await? else {
            return Ok(());
        };
        if !doc.value.claim_unconfirmed() {
            return Ok(());
        }
        match self.held_on(&doc.value.node_id, &doc.value.node_address, id).await {
            Ok(Some(held)) if !held.pooled => {
                super::pool::confirm_claim(&self.ledger, doc).await;
                metrics::counter!("gateway_pool_claims_resolved_total", "outcome" => "confirmed").increment(1);
                tracing::warn!(sandbox_id = %id, "confirmed a pooled sandbox's claim its create left marked");
                Ok(())
            }
            Ok(_) => {
                metrics::counter!("gateway_pool_claims_resolved_total", "outcome" => "ended").increment(1);
                tracing::warn!(sandbox_id = %id, "ended a pooled sandbox's claim its node never took");
                self.kill(team, id).await
            }
            Err(why) => Err(Failure::Unavailable(format!(
                "a pooled sandbox's unconfirmed claim on {id}: its node {} did not answer ({why})",
                doc.value.node_id
            ))),
        }
    }

    /// Resolves a create whose gateway stopped before writing where it runs, against the
    /// nodes: claims the manifest (epoch + 1) and asks every node placement knows whether it
    /// runs the sandbox. One that does keeps it: the manifest is completed as running there
    /// (a retry with the create's `Idempotency-Key` then finds it), and any other copy is
    /// killed. When none does, the manifest is deleted (every node told to kill it first, in
    /// case a start is still landing). Either way every other node's reservation for it is
    /// released: a Place whose answer was lost (a placer killed under it), or whose gateway
    /// stopped before the node was asked, left one that nothing else would ever end.
    async fn end_abandoned_create(&self, team: &str, id: &str) -> Result<(), Failure> {
        let mut doc = self.claim(team, id, KILL).await?;
        // Judged from a list read before the claim: a create that finished meanwhile is
        // not abandoned (its caller was told 201).
        if doc.value.phase != SandboxPhase::Creating {
            self.unclaim(&mut doc).await;
            return Ok(());
        }
        let mut running_on = Vec::new();
        for node in self.nodes().await? {
            let held = self.held_on(&node.node_id, &node.address, id).await;
            if matches!(held, Ok(Some(s)) if s.state == node_pb::SandboxState::Running as i32) {
                running_on.push(node);
            }
        }
        // A pooled sandbox's create, or a claim of one, is never adopted: nobody is waiting
        // for it, and a claim's node may still hold the pool's tokens.
        let adoptable = doc.value.pool.is_none();
        if let Some((keep, others)) = running_on.split_first().filter(|_| adoptable) {
            if let Ok(envd) = self.nodes.envd(&keep.node_id, &keep.address).await {
                // The kept copy learns the claim's epoch first (a resume of a running
                // sandbox only records it): anything still in flight under the create's (its
                // own undo of an attempt it took for failed) is then refused there, instead
                // of killing what the manifest is about to name.
                let mut kept = doc.value.clone();
                kept.node_id = keep.node_id.clone();
                kept.node_address = keep.address.clone();
                self.node_call(&kept, super::lifecycle::Freeze::Resume).await?;
                for other in others {
                    let mut on = doc.value.clone();
                    on.node_id = other.node_id.clone();
                    on.node_address = other.address.clone();
                    self.kill_on_node(&on).await?;
                }
                for node in self.nodes().await? {
                    if node.node_id != keep.node_id {
                        self.release_on(id, &node.node_id).await?;
                    }
                }
                doc.value.phase = SandboxPhase::Running;
                doc.value.node_id = keep.node_id.clone();
                doc.value.node_address = keep.address.clone();
                doc.value.envd_address = envd;
                released(&mut doc.value);
                self.save(&doc).await?;
                self.routes.set_running(id, true).await;
                metrics::counter!("gateway_half_made_creates_total", "outcome" => "adopted").increment(1);
                tracing::warn!(sandbox_id = %id, node_id = %keep.node_id, "adopted a create abandoned half-way: its node runs it");
                return Ok(());
            }
        }
        for node in self.nodes().await? {
            let mut on = doc.value.clone();
            on.node_id = node.node_id;
            on.node_address = node.address;
            self.kill_on_node(&on).await?;
            self.release_on(id, &on.node_id).await?;
        }
        self.ledger
            .compare_resolving(
                Txn::new().delete(SANDBOX_KIND, id, doc.version),
                LEDGER_RESOLVE_ATTEMPTS,
            )
            .await?;
        metrics::counter!("gateway_half_made_creates_total", "outcome" => "removed").increment(1);
        tracing::warn!(sandbox_id = %id, "removed a create abandoned half-way: no node runs it");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reaper_ends_what_is_due_keeps_what_is_paused_and_ends_abandoned_creates() {
        let doc = |phase, end: u64, auto_pause| SandboxDoc {
            phase,
            started_at_unix_ms: 1_000,
            end_at_unix_ms: end,
            auto_pause,
            auto_pause_memory: true,
            ..SandboxDoc::default()
        };
        let (now, keep) = (10_000, 50_000);
        let patience = Patience {
            paused_retention: Duration::from_millis(keep),
            abandoned_create_after: DEFAULT_ABANDONED_CREATE_AFTER,
            claim_ttl: super::super::claim::DEFAULT_CLAIM_TTL,
        };
        let reap = |d: &SandboxDoc, now| reap(d, now, patience);
        assert_eq!(reap(&doc(SandboxPhase::Running, now + 1, false), now), None);
        assert_eq!(reap(&doc(SandboxPhase::Running, now, false), now), Some(Reap::Kill));
        assert_eq!(
            reap(&doc(SandboxPhase::Running, now, true), now),
            Some(Reap::Pause { memory: true })
        );
        let mut files_only = doc(SandboxPhase::Running, now, true);
        files_only.auto_pause_memory = false;
        assert_eq!(reap(&files_only, now), Some(Reap::Pause { memory: false }));
        // Paused, by hand or by timeout: kept past its timeout, until the retention passes.
        for phase in [SandboxPhase::Paused, SandboxPhase::Hibernated] {
            let mut paused = doc(phase, now, false);
            paused.paused_at_unix_ms = Some(now);
            assert_eq!(reap(&paused, now + keep - 1), None, "{phase:?}");
            assert_eq!(reap(&paused, now + keep), Some(Reap::Kill), "{phase:?}");
        }
        // A create in progress is left alone however its timeout stands, until abandoned.
        assert_eq!(reap(&doc(SandboxPhase::Creating, 0, false), now), None);
        let late = 1_000 + 5 * 60 * 1000;
        assert_eq!(
            reap(&doc(SandboxPhase::Creating, 0, false), late),
            Some(Reap::EndCreate)
        );
        // A claim of a pooled sandbox whose mark its create did not clear: the node decides,
        // once the hand-over's own deadline has long passed.
        let mut claimed = doc(SandboxPhase::Running, u64::MAX, false);
        claimed.team_id = "team".into();
        claimed.pool = Some(common::pool::Pooled::default());
        assert_eq!(reap(&claimed, 1_000 + 14_999), None, "its create may still be at it");
        assert_eq!(reap(&claimed, 1_000 + 15_000), Some(Reap::ConfirmPoolClaim));
        claimed.team_id.clear();
        assert_eq!(reap(&claimed, late), None, "waiting in its pool, nobody's");
    }

    #[test]
    fn a_user_claim_left_past_its_time_is_finished_or_resolved() {
        let ttl = 10_000;
        let patience = Patience {
            paused_retention: Duration::from_secs(3600),
            abandoned_create_after: DEFAULT_ABANDONED_CREATE_AFTER,
            claim_ttl: Duration::from_millis(ttl),
        };
        let claimed = |phase, owner: &str| SandboxDoc {
            phase,
            end_at_unix_ms: u64::MAX,
            lifecycle_owner: Some(owner.into()),
            lifecycle_claimed_at_unix_ms: Some(1_000),
            ..SandboxDoc::default()
        };
        let pause = claimed(SandboxPhase::Running, "user:pause:1");
        assert_eq!(reap(&pause, 1_000 + ttl - 1, patience), None, "still within its time");
        assert_eq!(reap(&pause, 1_000 + ttl, patience), Some(Reap::ResolveClaim));
        let resume = claimed(SandboxPhase::Paused, "user:resume:1");
        assert_eq!(reap(&resume, 1_000 + ttl, patience), Some(Reap::ResolveClaim));
        // A kill the node never confirmed is finished well before the claims' time to live.
        let kill = claimed(SandboxPhase::Running, "user:kill:1");
        assert_eq!(reap(&kill, 1_000 + UNCONFIRMED_KILL_AFTER_MS - 1, patience), None);
        assert_eq!(
            reap(&kill, 1_000 + UNCONFIRMED_KILL_AFTER_MS, patience),
            Some(Reap::Kill)
        );
        // A move's ownership is the balancer's; a create's claim is the abandoned-create rule's.
        assert_eq!(
            reap(&claimed(SandboxPhase::Running, "plan.0"), u64::MAX / 2, patience),
            None
        );
        let creating = claimed(SandboxPhase::Creating, "user:kill:1");
        assert_eq!(reap(&creating, 1_000 + ttl, patience), None);
    }
}
