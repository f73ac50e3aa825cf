//! Warm pools, the sandboxes' side: starting a pooled sandbox, claiming one for a create, and
//! retiring one (see `common::pool` for the documents, and `crate::pools` for the keeper that
//! fills and empties pools).
//!
//! A claim rewrites the pooled sandbox's manifest in one compare-and-swap: the team, its
//! metadata, sealed env vars, fresh access tokens and its end replace the pool's, under a new
//! epoch, phase `running`; its slot's document is deleted in the same transaction. Two creates
//! racing for one pooled sandbox both read the same version and only one write lands; the
//! other tries the next candidate, and a create that finds none left is created cold. The
//! node is then told (`Claim`): the pool's token stops working, envd adds the env vars, and
//! the node refuses any second claim. Only then does the create answer, so nobody holds the
//! new tokens before the node does. A claim that fails on the node kills the sandbox rather
//! than hand it out half claimed, and the create goes on cold.
//!
//! The claim's write keeps the manifest's `pool` as a mark: the hand-over is not confirmed
//! yet ([`SandboxDoc::claim_unconfirmed`]). The create clears it after it answers, off the
//! create's path (one ledger commit on the path, not two). A gateway that stopped before it
//! leaves the mark to the reaper, which asks the node: a sandbox the node no longer holds as
//! pooled was handed over and is confirmed; one the node still holds as pooled never was, and
//! its create never answered, so it is killed.
//!
//! A pooled sandbox has never run a request's code: its start command ran, nothing else. What
//! the claim changes is everything a request gives a sandbox; its ID (and so its hostname)
//! was drawn at random when the pool started it, as a cold create draws one.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{PoisonError, RwLock};

use common::clock::now_ms;
use common::docs::{SandboxDoc, SandboxPhase};
use ledger_client::{LedgerError, Txn, Versioned};
use proto::node::v1 as node_pb;

use super::{Failure, Sandboxes, LEDGER_RESOLVE_ATTEMPTS};
use crate::intent::CreateIntent;

/// How many pooled sandboxes one create tries to claim before it is created cold.
const CLAIM_TRIES: usize = 3;
/// How long the node may take to hand a pooled sandbox over.
const CLAIM_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// A ready pooled sandbox and the slot document that holds it: a claim deletes that document
/// in the same transaction as it rewrites the manifest, so the slot is free to fill at once.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub sandbox_id: String,
    pub slot_id: String,
    pub slot_version: u64,
    /// Where it runs and what it holds there, as the keeper last read (a move may have taken
    /// it elsewhere since: eviction then frees less than it counted, and the create's start
    /// on the node is what finds out).
    pub node_id: String,
    pub resources: common::docs::Capacity,
    /// Its manifest as the keeper last read it: a claim writes against it without reading it
    /// again (pooled manifests rarely change), and reads it again only when that write finds
    /// it changed.
    pub manifest: Option<std::sync::Arc<Versioned<SandboxDoc>>>,
}

/// Which pooled sandboxes are ready, by template: candidates for claims, refreshed by the
/// keeper. Only a hint: the claim's compare-and-swap on the manifest is the truth.
#[derive(Default)]
pub struct PoolIndex {
    ready: RwLock<HashMap<String, Vec<Candidate>>>,
    /// Templates that have a pool (a create of one that finds none ready is counted a miss).
    pooled: RwLock<HashSet<String>>,
    /// Where the next claim starts in a template's list, so concurrent claims spread over
    /// the candidates rather than all racing for the first.
    turn: AtomicUsize,
    /// Creates that reclaimed pooled room lately, by team.
    reclaims: std::sync::Mutex<ReclaimBudget>,
}

/// Creates of one team that may reclaim pooled room (retire other pools' sandboxes) in one
/// window: a team whose creates keep failing after they reclaimed (a start command that never
/// gets ready, at a size that fits nowhere) would otherwise empty everyone's pools, unbilled.
pub const RECLAIMS_PER_WINDOW: u32 = 16;
/// The window [`RECLAIMS_PER_WINDOW`] counts in.
pub const RECLAIM_WINDOW_MS: u64 = 60_000;

/// Each team's reclaims in its current window: (window start, reclaims in it).
#[derive(Debug, Default)]
pub struct ReclaimBudget {
    teams: HashMap<String, (u64, u32)>,
}

impl ReclaimBudget {
    /// Whether `team` may reclaim once more at `now` (unix ms); counts it when it may.
    pub fn take(&mut self, team: &str, now: u64) -> bool {
        // Old windows are dropped as they pass, so the map holds only teams of the last minute.
        self.teams
            .retain(|_, (start, _)| start.saturating_add(RECLAIM_WINDOW_MS) > now);
        let (_, used) = self.teams.entry(team.to_string()).or_insert((now, 0));
        if *used >= RECLAIMS_PER_WINDOW {
            return false;
        }
        *used += 1;
        true
    }
}

impl PoolIndex {
    /// Replaces the whole index: template → ready sandboxes, and the templates with a pool.
    pub fn replace(&self, ready: HashMap<String, Vec<Candidate>>, pooled: HashSet<String>) {
        *self.ready.write().unwrap_or_else(PoisonError::into_inner) = ready;
        *self.pooled.write().unwrap_or_else(PoisonError::into_inner) = pooled;
    }

    /// Takes `id` out (claimed or retired by this gateway) until the next refresh.
    pub fn remove(&self, template: &str, id: &str) {
        let mut ready = self.ready.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(ids) = ready.get_mut(template) {
            ids.retain(|c| c.sandbox_id != id);
        }
    }

    /// Takes `id` out of whichever template's list holds it.
    pub fn remove_anywhere(&self, id: &str) {
        let mut ready = self.ready.write().unwrap_or_else(PoisonError::into_inner);
        for ids in ready.values_mut() {
            ids.retain(|c| c.sandbox_id != id);
        }
    }

    /// The ready sandboxes of `template`, starting at a different one each call.
    pub fn candidates(&self, template: &str) -> Vec<Candidate> {
        let ready = self.ready.read().unwrap_or_else(PoisonError::into_inner);
        let Some(ids) = ready.get(template).filter(|ids| !ids.is_empty()) else {
            return Vec::new();
        };
        let start = self.turn.fetch_add(1, Ordering::Relaxed) % ids.len();
        ids[start..].iter().chain(&ids[..start]).cloned().collect()
    }

    /// Whether any pooled sandbox is ready anywhere (a create refused for room may then
    /// reclaim some).
    pub fn any_ready(&self) -> bool {
        let ready = self.ready.read().unwrap_or_else(PoisonError::into_inner);
        ready.values().any(|c| !c.is_empty())
    }

    /// Whether a create of `team` may reclaim pooled room now (see [`ReclaimBudget`]).
    pub fn may_reclaim(&self, team: &str) -> bool {
        let allowed = self
            .reclaims
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(team, now_ms());
        if !allowed {
            metrics::counter!("gateway_pool_reclaims_refused_total").increment(1);
            tracing::info!(
                team,
                "a team's creates reclaimed pooled room too often: refused for room"
            );
        }
        allowed
    }

    /// Ready sandboxes on `node_id` that together free at least `need` (vCPUs and bytes), the
    /// fullest pools' first and, within a pool, the largest first; `None` when all of them
    /// together would not.
    pub fn evictable_on(&self, node_id: &str, need: common::docs::Capacity) -> Option<Vec<Candidate>> {
        let ready = self.ready.read().unwrap_or_else(PoisonError::into_inner);
        let mut pools: Vec<&Vec<Candidate>> = ready.values().filter(|c| !c.is_empty()).collect();
        pools.sort_by_key(|c| std::cmp::Reverse(c.len()));
        let mut chosen = Vec::new();
        let mut freed = common::docs::Capacity::default();
        for pool in pools {
            let mut here: Vec<&Candidate> = pool.iter().filter(|c| c.node_id == node_id).collect();
            here.sort_by_key(|c| std::cmp::Reverse(c.resources.memory_bytes));
            for candidate in here {
                if covers(freed, need) {
                    return Some(chosen);
                }
                freed.vcpus += candidate.resources.vcpus;
                freed.memory_bytes += candidate.resources.memory_bytes;
                chosen.push(candidate.clone());
            }
        }
        covers(freed, need).then_some(chosen)
    }

    /// How many of `template`'s are ready, as last refreshed.
    pub fn ready(&self, template: &str) -> usize {
        let ready = self.ready.read().unwrap_or_else(PoisonError::into_inner);
        ready.get(template).map_or(0, Vec::len)
    }

    /// Whether `template` has a pool, as last refreshed.
    pub fn has_pool(&self, template: &str) -> bool {
        self.pooled
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(template)
    }
}

/// Whether room `freed` is at least `need`, in vCPUs and in bytes.
fn covers(freed: common::docs::Capacity, need: common::docs::Capacity) -> bool {
    freed.vcpus >= need.vcpus && freed.memory_bytes >= need.memory_bytes
}

/// Whether pooled sandbox `doc` can become the sandbox `intent` asks for: unclaimed, running,
/// owned by no operation, of the same build, size and network. (Env vars, metadata, timeout,
/// tokens and whether its ports are public are the claim's to give.)
pub fn fits(doc: &SandboxDoc, intent: &CreateIntent) -> bool {
    let Some(pool) = doc.pool.as_ref().filter(|_| doc.ready_in_pool()) else {
        return false;
    };
    pool.build_id == intent.image.build_id
        && doc.template == intent.template
        && doc.vcpus == intent.vcpus
        && doc.memory_bytes == intent.memory_bytes
        && doc.network.as_ref() == Some(&intent.network)
}

/// `pooled` as the create of `team` for `intent` makes it: `fresh` is the manifest a cold
/// create would write (its tokens, seals, end); where it runs and its epoch (raised) are the
/// pooled sandbox's, and it runs. It keeps its `pool` as the mark of a hand-over its node has
/// not confirmed: a claim abandoned half-way (its gateway died before the node heard of it) is
/// then ended by the reaper, never kept as the team's with the pool's tokens on the node.
pub fn claimed_manifest(pooled: &SandboxDoc, fresh: SandboxDoc) -> SandboxDoc {
    SandboxDoc {
        phase: SandboxPhase::Running,
        node_id: pooled.node_id.clone(),
        node_address: pooled.node_address.clone(),
        envd_address: pooled.envd_address.clone(),
        epoch: pooled.epoch + 1,
        disk_bytes: pooled.disk_bytes,
        last_moved_unix_ms: pooled.last_moved_unix_ms,
        pool: pooled.pool.clone(),
        ..fresh
    }
}

/// The `Idempotency-Key` a create holds (`idempotency/<team>/<key>` at `version`, naming the
/// ID a cold create would use): a claim renames it to the pooled sandbox in the claim's own
/// write, so a retry with the key finds the claimed sandbox, and a claim that then fails on
/// its node names the cold ID again.
#[derive(Clone, Debug)]
pub(super) struct HeldKey {
    pub id: String,
    pub version: u64,
    pub doc: common::docs::IdempotencyDoc,
}

/// How one claim ended.
enum Claim {
    Done(Box<SandboxDoc>),
    /// Another create (or the keeper retiring it, or a move) changed it first.
    Lost,
    /// Its node would not hand it over; it was killed.
    Failed,
}

/// Tries a mark's clearing makes against concurrent writes (a kill, a move) before it leaves
/// the mark to the reaper.
const CONFIRM_ATTEMPTS: usize = 3;

impl Sandboxes {
    /// A pooled sandbox of `intent`'s template, claimed for `team`; `None` when the template
    /// has no pool, none fits or every claim failed (the create then goes cold).
    pub(super) async fn claim_pooled(
        &self,
        team: &str,
        intent: &CreateIntent,
        mut key: Option<&mut HeldKey>,
    ) -> Result<Option<SandboxDoc>, Failure> {
        let candidates = self.pools.candidates(&intent.template);
        if candidates.is_empty() {
            if self.pools.has_pool(&intent.template) {
                metrics::counter!("gateway_pool_claims_total", "result" => "miss").increment(1);
            }
            return Ok(None);
        }
        // A few tries at most: a create pays for each candidate that fails (a node that does
        // not answer, a claim lost to another create), and a cold create is always there.
        'candidates: for candidate in candidates.into_iter().take(CLAIM_TRIES) {
            let id = candidate.sandbox_id.clone();
            let mut known = candidate.manifest.clone();
            // Twice at most: against the manifest the keeper read, then once more against a
            // fresh read if that one had changed.
            loop {
                let cached = known.is_some();
                let pooled = match known.take() {
                    Some(manifest) => (*manifest).clone(),
                    None => match self.ledger.get::<SandboxDoc>(common::docs::SANDBOX_KIND, &id).await {
                        Ok(Some(pooled)) => pooled,
                        Ok(None) => {
                            self.pools.remove(&intent.template, &id);
                            continue 'candidates;
                        }
                        Err(err) => {
                            tracing::debug!(sandbox_id = %id, %err, "pooled manifest unreadable; created cold");
                            break 'candidates;
                        }
                    },
                };
                if !fits(&pooled.value, intent) {
                    continue 'candidates;
                }
                use tracing::Instrument;
                let span = tracing::info_span!("claim", sandbox_id = %id, template = %intent.template);
                match self
                    .claim_one(team, intent, pooled, &candidate, key.as_deref_mut())
                    .instrument(span)
                    .await?
                {
                    Claim::Done(doc) => {
                        metrics::counter!("gateway_pool_claims_total", "result" => "hit").increment(1);
                        return Ok(Some(*doc));
                    }
                    Claim::Lost if cached => continue,
                    Claim::Lost | Claim::Failed => continue 'candidates,
                }
            }
        }
        metrics::counter!("gateway_pool_claims_total", "result" => "miss").increment(1);
        Ok(None)
    }

    /// Claims `pooled` for `team`, answering once its node took the hand-over; the mark of
    /// an unconfirmed hand-over is cleared after, in the background.
    async fn claim_one(
        &self,
        team: &str,
        intent: &CreateIntent,
        pooled: Versioned<SandboxDoc>,
        candidate: &Candidate,
        mut key: Option<&mut HeldKey>,
    ) -> Result<Claim, Failure> {
        let id = pooled.value.sandbox_id.clone();
        let template = pooled.value.template.clone();
        let fresh = self.new_manifest(team, intent, &id, now_ms());
        let mut doc = claimed_manifest(&pooled.value, fresh);
        let mut txn = Txn::new().update_read(&pooled, &doc)?.delete(
            common::pool::POOL_SLOT_KIND,
            &candidate.slot_id,
            candidate.slot_version,
        );
        if let Some(key) = key.as_deref() {
            let renamed = common::docs::IdempotencyDoc {
                sandbox_id: id.clone(),
                ..key.doc.clone()
            };
            txn = txn.update(common::docs::IDEMPOTENCY_KIND, &key.id, key.version, &renamed)?;
        }
        let version = match self.ledger.compare_resolving(txn, LEDGER_RESOLVE_ATTEMPTS).await {
            Ok(done) => {
                if let Some(key) = key.as_deref_mut() {
                    key.version = done.versions.get(2).copied().unwrap_or(key.version + 1);
                }
                done.versions.first().copied().unwrap_or(pooled.version + 1)
            }
            // Another create (or the keeper retiring it, or a move) was first, or the slot
            // changed since the index was made.
            Err(LedgerError::Conflict { .. }) => {
                self.pools.remove(&template, &id);
                return Ok(Claim::Lost);
            }
            Err(err) => return Err(err.into()),
        };
        self.pools.remove(&template, &id);
        let claimed = Versioned {
            key: ledger_client::DocKey::new(common::docs::SANDBOX_KIND, &id),
            version,
            create_revision: 0,
            mod_revision: 0,
            value: doc.clone(),
        };
        if let Err(err) = self.tell_node_claimed(&doc, intent).await {
            tracing::warn!(sandbox_id = %id, %err, "the node did not hand the pooled sandbox over; killing it");
            self.end_claimed(&claimed).await;
            if let Some(key) = key {
                // The key names the cold create's ID again (it goes on cold, or to the next
                // candidate); a key that cannot be renamed back fails the create, whose retry
                // then finds the key pointing at nothing (404) rather than at a stranger.
                let txn = Txn::new().update(common::docs::IDEMPOTENCY_KIND, &key.id, key.version, &key.doc)?;
                let done = self.ledger.compare_resolving(txn, LEDGER_RESOLVE_ATTEMPTS).await?;
                key.version = done.versions.first().copied().unwrap_or(key.version + 1);
            }
            return Ok(Claim::Failed);
        }
        let ledger = self.ledger.clone();
        tokio::spawn(async move { confirm_claim(&ledger, claimed).await });
        doc.pool = None;
        tracing::info!(sandbox_id = %id, node_id = %doc.node_id, "pooled sandbox claimed");
        Ok(Claim::Done(Box::new(doc)))
    }

    async fn tell_node_claimed(&self, doc: &SandboxDoc, intent: &CreateIntent) -> Result<(), Failure> {
        let mut node = self.nodes.client(&doc.node_id, &doc.node_address).await?;
        let mut request = tonic::Request::new(node_pb::ClaimRequest {
            operation_id: format!("claim-{}-{}", doc.sandbox_id, doc.epoch),
            epoch: doc.epoch,
            sandbox_id: doc.sandbox_id.clone(),
            env_vars: intent.env_vars.clone().into_iter().collect(),
            metadata: doc.metadata.clone().into_iter().collect(),
            access_token: self.tokens.envd(doc).unwrap_or_default(),
            traffic_access_token: self.tokens.traffic(doc).unwrap_or_default(),
        });
        request.set_timeout(CLAIM_DEADLINE);
        node.claim(request)
            .await
            .map(drop)
            .map_err(|s| super::from_status("node claim", s))
    }

    /// Undoes a claim that could not finish: the sandbox off its node, out of placement, its
    /// manifest deleted (a failure is logged; the reaper ends what is left, as it ends any
    /// abandoned create).
    async fn end_claimed(&self, doc: &Versioned<SandboxDoc>) {
        self.stop_on_node(&doc.value).await;
        let txn = Txn::new().delete(common::docs::SANDBOX_KIND, &doc.value.sandbox_id, doc.version);
        if let Err(err) = self.ledger.compare_resolving(txn, LEDGER_RESOLVE_ATTEMPTS).await {
            tracing::warn!(sandbox_id = %doc.value.sandbox_id, %err, "a failed claim's manifest stays for the reaper");
        }
    }

    /// Starts pooled sandbox `sandbox_id` for slot `pool` from `intent` (no team: nobody's
    /// until claimed).
    pub async fn create_pooled(
        &self,
        intent: CreateIntent,
        sandbox_id: String,
        pool: common::pool::Pooled,
    ) -> Result<SandboxDoc, Failure> {
        use tracing::Instrument;
        let span =
            tracing::info_span!("pool_fill", sandbox_id = %sandbox_id, template = %pool.template_id, slot = pool.slot);
        self.create_with("", intent, sandbox_id, Some(pool))
            .instrument(span)
            .await
    }

    /// Retires ready pooled sandboxes on `node_id` until `need` is freed there, for a create
    /// placement put on that node counting their room; whether enough went. Nothing is retired
    /// when the ready ones there could not free enough together.
    pub(super) async fn evict_on(&self, node_id: &str, need: common::docs::Capacity) -> bool {
        let Some(chosen) = self.pools.evictable_on(node_id, need) else {
            return false;
        };
        let mut freed = common::docs::Capacity::default();
        for candidate in chosen {
            match self.retire_pooled_on(&candidate.sandbox_id, node_id).await {
                Ok(()) => {
                    self.pools.remove_anywhere(&candidate.sandbox_id);
                    self.hold_slot(&candidate.slot_id).await;
                    freed.vcpus += candidate.resources.vcpus;
                    freed.memory_bytes += candidate.resources.memory_bytes;
                    metrics::counter!("gateway_pool_evicted_total").increment(1);
                    tracing::info!(sandbox_id = %candidate.sandbox_id, node_id, "pooled sandbox evicted to make room");
                }
                // Claimed or retired meanwhile: its room is not this create's.
                Err(err) => tracing::debug!(sandbox_id = %candidate.sandbox_id, %err, "not evicted"),
            }
        }
        covers(freed, need)
    }

    /// Restarts the grace of slot `slot_id` (its sandbox was evicted): the keeper fills it
    /// again only once the grace has passed, rather than take back at once the room the
    /// eviction made.
    async fn hold_slot(&self, slot_id: &str) {
        use common::pool::{PoolSlotDoc, POOL_SLOT_KIND};
        let Ok(Some(mut slot)) = self.ledger.get::<PoolSlotDoc>(POOL_SLOT_KIND, slot_id).await else {
            return;
        };
        slot.value.since_unix_ms = now_ms();
        if let Ok(txn) = Txn::new().update_read(&slot, &slot.value) {
            if let Err(err) = self.ledger.compare(txn).await {
                tracing::debug!(slot = %slot_id, %err, "an evicted slot is filled again without waiting");
            }
        }
    }

    /// Ends pooled sandbox `id` (its pool shrank, or its template was rebuilt or deleted),
    /// unless a create claimed it first: the kill takes the manifest only while it has no team
    /// (a claim gives it one) and writes its claim under the version it read, so a claim and a
    /// retirement never both go through.
    pub async fn retire_pooled(&self, id: &str) -> Result<(), Failure> {
        self.kill("", id).await
    }

    /// Retires pooled sandbox `id` for a create's room, only if it still runs on `node_id` (a
    /// move may have taken it elsewhere since the index was read: its room there is not the
    /// room the create needs), under an eviction's claim, which no other eviction takes over:
    /// `Ok` means this create's eviction removed it.
    async fn retire_pooled_on(&self, id: &str, node_id: &str) -> Result<(), Failure> {
        match self.ledger.get::<SandboxDoc>(common::docs::SANDBOX_KIND, id).await? {
            Some(doc) if doc.value.is_pooled() && doc.value.node_id == node_id => {
                self.kill_as("", id, super::claim::EVICT).await
            }
            _ => Err(Failure::Conflict(format!("{id} is no longer pooled on {node_id}"))),
        }
    }
}

/// Clears the mark of claim `claimed` (its node took the hand-over): written against the
/// version the claim wrote, and against a fresh read while a concurrent write (a kill's or a
/// move's claim) keeps it the same team's. What stays unconfirmed the reaper confirms.
pub(super) async fn confirm_claim(ledger: &ledger_client::LedgerClient, claimed: Versioned<SandboxDoc>) {
    let team = claimed.value.team_id.clone();
    let mut current = claimed;
    for _ in 0..CONFIRM_ATTEMPTS {
        let mut confirmed = current.value.clone();
        confirmed.pool = None;
        let Ok(txn) = Txn::new().update_read(&current, &confirmed) else {
            return;
        };
        match ledger.compare(txn).await {
            Ok(_) => return,
            Err(LedgerError::Conflict { .. }) => {}
            Err(err) => {
                tracing::debug!(sandbox_id = %current.value.sandbox_id, %err, "a claim's mark stays for the reaper");
                return;
            }
        }
        match ledger
            .get::<SandboxDoc>(common::docs::SANDBOX_KIND, &current.value.sandbox_id)
            .await
        {
            Ok(Some(next)) if next.value.claim_unconfirmed() && next.value.team_id == team => current = next,
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::egress::NetworkPolicy;
    use common::pool::Pooled;

    fn intent() -> CreateIntent {
        CreateIntent {
            template: "t1".into(),
            image: common::template::Image {
                build_id: "b1".into(),
                ..Default::default()
            },
            vcpus: 2,
            memory_bytes: 512 << 20,
            memory_source: Default::default(),
            timeout_secs: 300,
            auto_pause: false,
            auto_pause_memory: true,
            auto_resume: false,
            env_vars: Default::default(),
            metadata: Default::default(),
            network: NetworkPolicy::default(),
            public_traffic: true,
        }
    }

    fn pooled() -> SandboxDoc {
        SandboxDoc {
            sandbox_id: "ipooled".into(),
            template: "t1".into(),
            vcpus: 2,
            memory_bytes: 512 << 20,
            phase: SandboxPhase::Running,
            network: Some(NetworkPolicy::default()),
            node_id: "n1".into(),
            node_address: "http://n1".into(),
            envd_address: "http://n1:1".into(),
            epoch: 3,
            pool: Some(Pooled {
                template_id: "t1".into(),
                build_id: "b1".into(),
                slot: 0,
                ready_at_unix_ms: 1,
                retire_asked: None,
            }),
            ..SandboxDoc::default()
        }
    }

    #[test]
    fn a_pooled_sandbox_fits_only_a_create_of_its_build_size_and_network() {
        assert!(fits(&pooled(), &intent()));
        let mut other = intent();
        other.image.build_id = "b2".into();
        assert!(!fits(&pooled(), &other), "a rebuilt template's create");
        let mut bigger = intent();
        bigger.memory_bytes *= 2;
        assert!(!fits(&pooled(), &bigger));
        let mut closed = intent();
        closed.network.internet = !closed.network.internet;
        assert!(!fits(&pooled(), &closed));
        let claimed = SandboxDoc {
            team_id: "team".into(),
            ..pooled()
        };
        assert!(!fits(&claimed, &intent()), "a claimed one (it has a team)");
        let moving = SandboxDoc {
            lifecycle_owner: Some("plan.1".into()),
            ..pooled()
        };
        assert!(!fits(&moving, &intent()), "one a move owns");
        let mut dropped = pooled();
        if let Some(pool) = dropped.pool.as_mut() {
            pool.retire_asked = Some(common::pool::RetireAsk::default());
        }
        assert!(!fits(&dropped, &intent()), "one the balancer asked to go");
        let unpooled = SandboxDoc { pool: None, ..pooled() };
        assert!(!fits(&unpooled, &intent()));
    }

    #[test]
    fn a_claimed_manifest_is_the_requests_on_the_pooled_sandboxs_node() {
        let fresh = SandboxDoc {
            sandbox_id: "ipooled".into(),
            team_id: "team".into(),
            metadata: [("k".to_string(), "v".to_string())].into(),
            envd_access_token: Some("fresh-seal".into()),
            end_at_unix_ms: 99,
            epoch: 1,
            ..SandboxDoc::default()
        };
        let doc = claimed_manifest(&pooled(), fresh);
        assert_eq!(doc.team_id, "team");
        assert_eq!(doc.envd_access_token.as_deref(), Some("fresh-seal"));
        assert_eq!(doc.end_at_unix_ms, 99);
        assert_eq!((doc.node_id.as_str(), doc.epoch), ("n1", 4), "its node, a raised epoch");
        assert_eq!(doc.phase, SandboxPhase::Running);
        assert!(doc.claim_unconfirmed(), "marked until its node confirmed the hand-over");
        assert!(!doc.is_pooled());
        assert!(!fits(&doc, &intent()), "a claimed one is no candidate");
    }

    #[test]
    fn a_team_reclaims_pooled_room_only_so_often() {
        let mut budget = ReclaimBudget::default();
        for _ in 0..RECLAIMS_PER_WINDOW {
            assert!(budget.take("a", 1_000));
        }
        assert!(
            !budget.take("a", 1_000 + RECLAIM_WINDOW_MS - 1),
            "spent for this window"
        );
        assert!(budget.take("b", 2_000), "another team's budget is its own");
        assert!(budget.take("a", 1_000 + RECLAIM_WINDOW_MS), "a new window");
        assert_eq!(budget.teams.len(), 2);
        assert!(budget.take("c", 2_000 + 2 * RECLAIM_WINDOW_MS));
        assert_eq!(budget.teams.len(), 1, "passed windows are forgotten");
    }

    #[test]
    fn the_index_hands_out_candidates_from_a_different_start_each_time() {
        let index = PoolIndex::default();
        let candidate = |id: &str| Candidate {
            sandbox_id: id.into(),
            slot_id: format!("t#{id}"),
            slot_version: 1,
            node_id: if id == "y" { "n2".into() } else { "n1".into() },
            resources: common::docs::Capacity {
                vcpus: 1,
                memory_bytes: 512 << 20,
            },
            manifest: None,
        };
        index.replace(
            [("t".to_string(), vec![candidate("a"), candidate("b"), candidate("c")])].into(),
            Default::default(),
        );
        let firsts: std::collections::HashSet<String> =
            (0..3).map(|_| index.candidates("t")[0].sandbox_id.clone()).collect();
        assert_eq!(firsts.len(), 3);
        assert_eq!(index.candidates("t").len(), 3);
        index.remove("t", "b");
        assert_eq!(index.ready("t"), 2);
        index.replace(
            [
                ("t".to_string(), vec![candidate("a")]),
                ("u".to_string(), vec![candidate("x"), candidate("y")]),
            ]
            .into(),
            Default::default(),
        );
        let need = |memory_bytes| common::docs::Capacity { vcpus: 0, memory_bytes };
        let ids = |c: Option<Vec<Candidate>>| c.map(|c| c.into_iter().map(|c| c.sandbox_id).collect::<Vec<_>>());
        assert_eq!(
            ids(index.evictable_on("n1", need(600 << 20))),
            Some(vec!["x".to_string(), "a".to_string()]),
            "on its node only, the fullest pool first, no more than needed"
        );
        assert_eq!(ids(index.evictable_on("n1", need(1))), Some(vec!["x".to_string()]));
        assert_eq!(
            ids(index.evictable_on("n1", need(2 << 30))),
            None,
            "not enough there: none"
        );
        assert_eq!(
            ids(index.evictable_on("n2", need(512 << 20))),
            Some(vec!["y".to_string()])
        );
        assert!(index.any_ready());
        index.remove_anywhere("y");
        assert_eq!(ids(index.evictable_on("n2", need(1))), None);
        assert!(index.candidates("other").is_empty());
    }
}
