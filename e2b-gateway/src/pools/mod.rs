//! Warm pools: the keeper that keeps each template's pool full, and what an operator or a
//! team asks of a pool.
//!
//! Every gateway runs a keeper. Each round it reads the pools, their slots and each slot's
//! manifest, asks [`plan`] what to do, and does it: a slot is taken by creating its document
//! (so two keepers never fill one slot), then a pooled sandbox is started in it through the
//! ordinary create path (placement, the node, the template's ready command); a claim deletes
//! its slot's document with the manifest's rewrite, and the slot is filled again; a sandbox its pool no longer wants is retired. While pools
//! exist a round runs when a manifest changes (the routing table's watch), and at least every
//! [`ROUND_EVERY`]; it refreshes the index creates claim from (`Sandboxes::pools`).
//!
//! The sandboxes of a pool take the memory they ask for on their node, but the node reports
//! them apart (they were created `pooled`), so placement knows that room as reclaimable: a
//! create that fits nowhere else is placed on a node where it fits once some of them go, and
//! retires those first (`Sandboxes::place_and_start`). The keeper claims nothing from a node
//! gone quiet, frees the slots of one gone for long, retires the pooled sandboxes of a
//! draining node rather than let them be moved, and recycles those that waited longer than
//! [`MAX_AGE`].

pub mod plan;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use common::clock::now_ms;
use common::docs::{Capacity, NodeDoc, NodeState, SandboxDoc, SandboxPhase, NODE_KIND, SANDBOX_KIND};
use common::pool::{
    PoolDoc, PoolSlotDoc, Pooled, MAX_POOL_SIZE, MAX_TEAM_POOL_MEMORY_BYTES, MAX_TEAM_POOL_SLOTS, OPERATOR, POOL_KIND,
    POOL_SLOT_KIND,
};
use common::template::{TemplateDoc, DEFAULT_TAG, TEMPLATE_KIND};
use ledger_client::{LedgerClient, LedgerError, Txn};
use tracing::Instrument as _;

use crate::intent::{self, NewSandbox};
use crate::sandboxes::{Candidate, Failure, Sandboxes};
use crate::templates::Templates;
use plan::{Action, NodeNow, Observed, SlotSandbox, SlotView, TemplateNow, Waits};

/// The longest a keeper waits between rounds when no manifest changes.
pub const ROUND_EVERY: Duration = Duration::from_secs(2);
/// The shortest time between two rounds.
const ROUND_GAP: Duration = Duration::from_millis(50);
/// How long a taken slot may stay without a manifest before it is freed.
const SLOT_GRACE: Duration = Duration::from_secs(30);
/// How long a pooled sandbox waits for a claim before it is recycled.
pub const MAX_AGE: Duration = Duration::from_secs(3600);
/// A node whose document has not been refreshed for this long is quiet (nothing is claimed
/// there): placement writes it every few seconds from the node's heartbeats. Compared with
/// this gateway's clock, so it is far longer than the writes' interval.
const NODE_QUIET_AFTER: Duration = Duration::from_secs(20);
/// A node quiet this long is gone: its slots are freed. Long, because a quiet node may be
/// one that placement (or the ledger) cannot hear, and freeing a slot ends its sandbox.
const NODE_GONE_AFTER: Duration = Duration::from_secs(600);
/// Pooled sandboxes one keeper starts at once.
const FILLS_AT_ONCE: usize = 4;
/// Pooled sandboxes one keeper retires at once: a rebuilt template's whole pool is not
/// killed in one burst.
const RETIRES_AT_ONCE: usize = 4;
/// How long a template whose pooled create failed waits before the next try (doubling up to
/// [`MAX_BACKOFF`]).
const FIRST_BACKOFF: Duration = Duration::from_secs(2);
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Slot ID → its sandbox's manifest, as one round read it.
type Manifests = HashMap<String, Arc<ledger_client::Versioned<SandboxDoc>>>;

/// Keeps every template's pool full.
pub struct Keeper {
    ledger: LedgerClient,
    sandboxes: Arc<Sandboxes>,
    templates: Arc<Templates>,
    /// Slots this keeper is filling now.
    filling: Arc<Mutex<HashSet<String>>>,
    /// Slots whose sandbox this keeper is retiring now.
    retiring: Arc<Mutex<HashSet<String>>>,
    /// Templates whose last pooled create failed: not before this instant, and the next wait.
    backoff: Mutex<HashMap<String, (Instant, Duration)>>,
    /// Each slot node's standing as last read, and when: node documents are large (they list
    /// every sandbox) and change every few seconds, while rounds follow manifest changes.
    nodes_read: Mutex<HashMap<String, (Instant, Option<NodeNow>)>>,
    /// When a round last read every slot's manifest from the ledger.
    read_afresh: Mutex<Option<Instant>>,
}

/// A slot's place in one of the keeper's sets of work in flight (`filling`, `retiring`),
/// given back when dropped: when its task ends, however it ends (a panic too), so a slot is
/// never left marked busy for the life of the process.
struct Held {
    set: Arc<Mutex<HashSet<String>>>,
    id: String,
}

impl Held {
    /// Marks `id` in `set`, unless it is there already or `set` holds `at_most`.
    fn take(set: &Arc<Mutex<HashSet<String>>>, id: &str, at_most: usize) -> Option<Held> {
        let mut marked = set.lock().unwrap_or_else(PoisonError::into_inner);
        if marked.len() >= at_most || !marked.insert(id.to_string()) {
            return None;
        }
        Some(Held {
            set: set.clone(),
            id: id.to_string(),
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.set.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
    }
}

/// How long a node's standing, once read, stands for the keeper's rounds.
const NODE_READ_EVERY: Duration = Duration::from_secs(2);
/// How often a round reads every slot's manifest from the ledger rather than the watch.
const READ_AFRESH_EVERY: Duration = Duration::from_secs(30);

impl Keeper {
    pub fn new(ledger: LedgerClient, sandboxes: Arc<Sandboxes>, templates: Arc<Templates>) -> Arc<Self> {
        Arc::new(Self {
            ledger,
            sandboxes,
            templates,
            filling: Arc::default(),
            retiring: Arc::default(),
            backoff: Mutex::default(),
            nodes_read: Mutex::default(),
            read_afresh: Mutex::default(),
        })
    }

    /// Runs rounds for ever: at least every [`ROUND_EVERY`], and while any pool exists also
    /// on manifest changes (a claim frees a slot), at most one round per [`ROUND_GAP`]. With
    /// no pool, a busy cluster's manifest changes cost the ledger nothing here.
    pub async fn run(self: Arc<Self>) {
        loop {
            let changed = self.sandboxes.routes.changed();
            let pools = match self.round().await {
                Ok(pools) => pools,
                Err(err) => {
                    tracing::debug!(%err, "pool keeper round failed");
                    0
                }
            };
            if pools == 0 {
                tokio::time::sleep(ROUND_EVERY).await;
                continue;
            }
            let _ = tokio::time::timeout(ROUND_EVERY, changed).await;
            tokio::time::sleep(ROUND_GAP).await;
        }
    }

    /// One round: observe, plan, act. Returns how many pools there are.
    pub async fn round(self: &Arc<Self>) -> Result<usize, Failure> {
        let (observed, resolved, manifests) = self.observe().await?;
        self.publish(&observed, manifests);
        let waits = Waits {
            grace_ms: SLOT_GRACE.as_millis() as u64,
            max_age_ms: MAX_AGE.as_millis() as u64,
            budget: plan::TeamBudget {
                memory_bytes: MAX_TEAM_POOL_MEMORY_BYTES,
            },
        };
        for action in plan::plan(&observed, now_ms(), waits) {
            match action {
                Action::Fill {
                    template_id,
                    slot,
                    build_id,
                } => {
                    if let Some(resolved) = resolved.get(&template_id) {
                        self.fill(&template_id, slot, &build_id, resolved);
                    }
                }
                Action::Free {
                    id,
                    version,
                    create_revision,
                } => self.delete_slot(&id, version, create_revision).await,
                Action::Retire {
                    id,
                    version,
                    create_revision,
                    sandbox_id,
                } => self.retire(id, version, create_revision, sandbox_id),
                Action::Drop { template_id, version } => {
                    let txn = Txn::new().delete(POOL_KIND, &template_id, version);
                    if let Err(err) = self.ledger.compare(txn).await {
                        tracing::debug!(%template_id, %err, "a gone template's pool was not dropped");
                    }
                }
            }
        }
        Ok(observed.pools.len().max(usize::from(!observed.slots.is_empty())))
    }

    /// Retires slot `id`'s sandbox and then frees the slot, in a task of its own: a kill
    /// waits for whatever owns the sandbox (a move of a draining node's sandboxes, up to its
    /// deadline), and the round, with every other pool's refills, must not wait with it. A
    /// slot already being retired is left to that task; past [`RETIRES_AT_ONCE`], to a later
    /// round. The slot is freed only as the round saw it: one changed since (an eviction's
    /// hold, a refill after a claim) is not this retirement's to free.
    fn retire(self: &Arc<Self>, id: String, version: u64, create_revision: u64, sandbox_id: String) {
        let Some(held) = Held::take(&self.retiring, &id, RETIRES_AT_ONCE) else {
            return;
        };
        let keeper = self.clone();
        let span = tracing::info_span!("retire", %sandbox_id);
        tokio::spawn(
            async move {
                let _held = held;
                match keeper.sandboxes.retire_pooled(&sandbox_id).await {
                    // Gone already, or claimed between the read and the kill.
                    Ok(()) | Err(Failure::NotFound(_)) => keeper.delete_slot(&id, version, create_revision).await,
                    Err(err) => tracing::warn!(%err, "could not retire a pooled sandbox"),
                }
                metrics::counter!("gateway_pool_retired_total").increment(1);
            }
            .instrument(span),
        );
    }

    /// Deletes slot document `id` if it is still the one created at `create_revision`, at
    /// `version`: a slot freed meanwhile and taken by a new fill restarts at version 1, and
    /// that fill's sandbox must keep it.
    async fn delete_slot(&self, id: &str, version: u64, create_revision: u64) {
        let txn = Txn::new().delete_created(POOL_SLOT_KIND, id, version, create_revision);
        if let Err(err) = self.ledger.compare(txn).await {
            tracing::debug!(slot = %id, %err, "pool slot not freed (changed meanwhile, or another keeper was first)");
        }
    }

    /// Reads pools, slots, each slot's manifest (also returned by slot ID, for claims to write
    /// against), each pool's template, and the slots' nodes.
    async fn observe(&self) -> Result<(Observed, HashMap<String, crate::templates::Resolved>, Manifests), Failure> {
        let (pools, _) = self.ledger.list::<PoolDoc>(POOL_KIND, "").await?;
        let (slots, _) = self.ledger.list::<PoolSlotDoc>(POOL_SLOT_KIND, "").await?;
        let mut observed = Observed {
            pools: pools.into_iter().map(|p| (p.version, p.value)).collect(),
            ..Observed::default()
        };
        let mut resolved = HashMap::new();
        for (_, pool) in &observed.pools {
            let now = self.template_now(&pool.template_id, &mut resolved).await;
            observed.templates.insert(pool.template_id.clone(), now);
        }
        for (template_id, r) in &resolved {
            observed.memory.insert(template_id.clone(), pooled_memory(&r.template));
        }
        let mut manifests = Manifests::new();
        // Every so often from the ledger whatever the watch says: a watch that reconnects by
        // itself says nothing of how long it was away.
        let afresh = {
            let mut last = self.read_afresh.lock().unwrap_or_else(PoisonError::into_inner);
            let due = last.is_none_or(|at| at.elapsed() >= READ_AFRESH_EVERY);
            if due {
                *last = Some(Instant::now());
            }
            due
        };
        for slot in slots {
            // From the routing table's watch while the manifest carries its pool's mark;
            // otherwise (claimed, gone, or not delivered yet) from the ledger. What is acted
            // on is guarded again where it is acted on: a claim compares the manifest's
            // version, a retirement kills only a sandbox still nobody's.
            let known = (!afresh)
                .then(|| self.sandboxes.routes.pooled_manifest(&slot.value.sandbox_id))
                .flatten();
            let read = match known {
                Some(known) => Some(known),
                None => self
                    .ledger
                    .get::<SandboxDoc>(SANDBOX_KIND, &slot.value.sandbox_id)
                    .await?
                    .map(Arc::new),
            };
            let doc = read.as_ref().map(|d| &d.value);
            observed.slots.push(SlotView {
                id: slot.key.id.clone(),
                version: slot.version,
                create_revision: slot.create_revision,
                sandbox: slot_sandbox(doc, &slot.value),
                node_id: doc.map(|d| d.node_id.clone()).unwrap_or_default(),
                resources: doc.map_or(Capacity::default(), |d| Capacity {
                    vcpus: d.vcpus,
                    memory_bytes: d.memory_bytes,
                }),
                doc: slot.value,
            });
            if let Some(read) = read {
                manifests.insert(slot.key.id.clone(), read);
            }
        }
        let nodes: HashSet<String> = observed
            .slots
            .iter()
            .filter(|s| !s.node_id.is_empty())
            .map(|s| s.node_id.clone())
            .collect();
        for node_id in nodes {
            if let Some(now) = self.node_now(&node_id).await {
                observed.nodes.insert(node_id, now);
            }
        }
        Ok((observed, resolved, manifests))
    }

    /// Where node `node_id` stands, read again at most every [`NODE_READ_EVERY`]; `None`
    /// when its document is missing or unreadable (nothing is then done about its slots).
    async fn node_now(&self, node_id: &str) -> Option<NodeNow> {
        let fresh = |at: &Instant| at.elapsed() < NODE_READ_EVERY;
        if let Some((_, known)) = self
            .nodes_read
            .lock()
            .ok()
            .and_then(|read| read.get(node_id).copied())
            .filter(|(at, _)| fresh(at))
        {
            return known;
        }
        let now = match self.ledger.get::<NodeDoc>(NODE_KIND, node_id).await {
            Ok(Some(node)) => Some(node_now(&node.value, now_ms())),
            _ => None,
        };
        if let Ok(mut read) = self.nodes_read.lock() {
            read.retain(|_, (at, _)| fresh(at));
            read.insert(node_id.to_string(), (Instant::now(), now));
        }
        now
    }

    async fn template_now(
        &self,
        template_id: &str,
        resolved: &mut HashMap<String, crate::templates::Resolved>,
    ) -> TemplateNow {
        let doc = match self.ledger.get::<TemplateDoc>(TEMPLATE_KIND, template_id).await {
            Ok(Some(doc)) => doc.value,
            Ok(None) => return TemplateNow::Gone,
            Err(_) => return TemplateNow::Unknown,
        };
        let reference = format!("{template_id}:{DEFAULT_TAG}");
        match self.templates.resolve(&doc.team_id, &reference).await {
            Ok(Some(r)) => {
                let build = r.image.build_id.clone();
                resolved.insert(template_id.to_string(), r);
                TemplateNow::Build(build)
            }
            _ => TemplateNow::Unknown,
        }
    }

    /// Refreshes the index creates claim from, and the pools' gauges.
    fn publish(&self, observed: &Observed, mut manifests: Manifests) {
        let mut ready: HashMap<String, Vec<Candidate>> = HashMap::new();
        for slot in observed.slots.iter().filter(|s| s.claimable(&observed.nodes)) {
            ready.entry(slot.doc.template_id.clone()).or_default().push(Candidate {
                sandbox_id: slot.doc.sandbox_id.clone(),
                slot_id: slot.id.clone(),
                slot_version: slot.version,
                node_id: slot.node_id.clone(),
                resources: slot.resources,
                manifest: manifests.remove(&slot.id),
            });
        }
        for (_, pool) in &observed.pools {
            let n = ready.get(&pool.template_id).map_or(0, Vec::len);
            metrics::gauge!("gateway_pool_ready", "template" => pool.template_id.clone()).set(n as f64);
            metrics::gauge!("gateway_pool_size", "template" => pool.template_id.clone()).set(f64::from(pool.size));
        }
        let pooled = observed
            .pools
            .iter()
            .filter(|(_, p)| p.size > 0)
            .map(|(_, p)| p.template_id.clone())
            .collect();
        self.sandboxes.pools.replace(ready, pooled);
    }

    /// Takes slot `slot` and starts its sandbox in the background.
    fn fill(self: &Arc<Self>, template_id: &str, slot: u32, build_id: &str, resolved: &crate::templates::Resolved) {
        let slot_id = common::pool::slot_id(template_id, slot);
        let backing_off = self
            .backoff
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(template_id)
            .is_some_and(|(until, _)| Instant::now() < *until);
        if backing_off {
            return;
        }
        let Some(held) = Held::take(&self.filling, &slot_id, FILLS_AT_ONCE) else {
            return;
        };
        let keeper = self.clone();
        let (template_id, build_id, resolved) = (template_id.to_string(), build_id.to_string(), resolved.clone());
        tokio::spawn(async move {
            let _held = held;
            let outcome = keeper.fill_now(&slot_id, &template_id, slot, &build_id, resolved).await;
            {
                let mut backoff = keeper.backoff.lock().unwrap_or_else(PoisonError::into_inner);
                match outcome {
                    Ok(()) => {
                        backoff.remove(&template_id);
                    }
                    Err(_) => {
                        let wait = backoff
                            .get(&template_id)
                            .map_or(FIRST_BACKOFF, |(_, w)| (*w * 2).min(MAX_BACKOFF));
                        backoff.insert(template_id.clone(), (Instant::now() + wait, wait));
                    }
                }
            }
        });
    }

    async fn fill_now(
        &self,
        slot_id: &str,
        template_id: &str,
        slot: u32,
        build_id: &str,
        resolved: crate::templates::Resolved,
    ) -> Result<(), Failure> {
        let started = Instant::now();
        let sandbox_id = crate::sandboxes::new_sandbox_id();
        let doc = PoolSlotDoc {
            template_id: template_id.to_string(),
            slot,
            sandbox_id: sandbox_id.clone(),
            build_id: build_id.to_string(),
            since_unix_ms: now_ms(),
        };
        // The slot as this fill created it: the commit's revision is its create revision.
        let (version, create_revision) = match self
            .ledger
            .compare(Txn::new().create(POOL_SLOT_KIND, slot_id, &doc)?)
            .await
        {
            Ok(done) => (done.versions.first().copied().unwrap_or(1), done.revision),
            // Another keeper took it.
            Err(LedgerError::Conflict { .. }) => return Ok(()),
            Err(err) => return Err(err.into()),
        };
        let template = intent::Template {
            name: resolved.template.template_id.clone(),
            vcpus: Some(resolved.template.vcpus).filter(|v| *v > 0),
            memory_mb: Some(resolved.template.memory_mb).filter(|m| *m > 0),
            image: resolved.image,
        };
        let request = NewSandbox {
            template_id: template_id.to_string(),
            ..NewSandbox::default()
        };
        let pooled = Pooled {
            template_id: template_id.to_string(),
            build_id: build_id.to_string(),
            slot,
            ready_at_unix_ms: 0,
            retire_asked: None,
        };
        let created = match intent::normalise(request, Some(&template)) {
            Ok(intent) => self.sandboxes.create_pooled(intent, sandbox_id.clone(), pooled).await,
            Err(refusal) => Err(Failure::Invalid(refusal.to_string())),
        };
        match created {
            Ok(_) => {
                metrics::histogram!("gateway_pool_refill_seconds").record(started.elapsed().as_secs_f64());
                metrics::counter!("gateway_pool_fills_total", "result" => "ok").increment(1);
                tracing::info!(%sandbox_id, template_id, slot, "pooled sandbox ready");
                Ok(())
            }
            Err(err) => {
                metrics::counter!("gateway_pool_fills_total", "result" => "failed").increment(1);
                tracing::warn!(%sandbox_id, template_id, slot, %err, "pooled sandbox could not be started");
                // A create of unknown outcome keeps its manifest for the reaper; the slot is
                // freed after the grace either way.
                if !matches!(err, Failure::Unknown(_)) {
                    self.delete_slot(slot_id, version, create_revision).await;
                }
                Err(err)
            }
        }
    }
}

/// Where node `node` stands at `now` (unix ms), by its document.
fn node_now(node: &NodeDoc, now: u64) -> NodeNow {
    let silent = now.saturating_sub(node.reported_at_unix_ms);
    if silent > NODE_GONE_AFTER.as_millis() as u64 {
        NodeNow::Gone
    } else if silent > NODE_QUIET_AFTER.as_millis() as u64 {
        NodeNow::Quiet
    } else if node.state == NodeState::Draining {
        NodeNow::Draining
    } else {
        NodeNow::Ready
    }
}

/// What a slot's sandbox is, from its manifest (`None`: there is none).
fn slot_sandbox(doc: Option<&SandboxDoc>, slot: &PoolSlotDoc) -> SlotSandbox {
    let Some(doc) = doc else {
        return SlotSandbox::Absent;
    };
    let Some(pool) = doc.pool.as_ref().filter(|_| doc.is_pooled()) else {
        return SlotSandbox::Claimed;
    };
    if pool.template_id != slot.template_id || pool.slot != slot.slot {
        // Not this slot's sandbox (an ID cannot be drawn twice; a document edited by hand).
        return SlotSandbox::Claimed;
    }
    match doc.phase {
        SandboxPhase::Running if doc.lifecycle_owner.is_none() && pool.retire_asked.is_some() => SlotSandbox::Unwanted,
        SandboxPhase::Running if doc.lifecycle_owner.is_none() => SlotSandbox::Ready,
        _ => SlotSandbox::Busy,
    }
}

/// A pool as the API shows it.
#[derive(Clone, Debug)]
pub struct PoolView {
    pub template_id: String,
    pub size: u32,
    /// Pooled sandboxes ready to be claimed, as this gateway's keeper last saw them.
    pub ready: usize,
    /// `operator`, or the team that set it; empty when none was ever set.
    pub set_by: String,
    /// 0 when none was ever set.
    pub updated_at_unix_ms: u64,
}

/// Who asks for a pool change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Asker {
    Operator,
    Team(String),
}

/// Reads and sets pool sizes.
pub struct Pools {
    ledger: LedgerClient,
    sandboxes: Arc<Sandboxes>,
}

impl Pools {
    pub fn new(ledger: LedgerClient, sandboxes: Arc<Sandboxes>) -> Self {
        Self { ledger, sandboxes }
    }

    /// The pool of `template` (size 0 when none was set).
    pub async fn get(&self, template: &TemplateDoc) -> Result<PoolView, Failure> {
        let doc = self.ledger.get::<PoolDoc>(POOL_KIND, &template.template_id).await?;
        Ok(self.view(&template.template_id, doc.map(|d| d.value)))
    }

    /// Every pool (for operators).
    pub async fn list(&self) -> Result<Vec<PoolView>, Failure> {
        let (pools, _) = self.ledger.list::<PoolDoc>(POOL_KIND, "").await?;
        Ok(pools
            .into_iter()
            .map(|p| self.view(&p.value.template_id.clone(), Some(p.value)))
            .collect())
    }

    fn view(&self, template_id: &str, doc: Option<PoolDoc>) -> PoolView {
        let doc = doc.unwrap_or_default();
        PoolView {
            template_id: template_id.to_string(),
            size: doc.size,
            ready: self.sandboxes.pools.ready(template_id),
            set_by: doc.set_by,
            updated_at_unix_ms: doc.updated_at_unix_ms,
        }
    }

    /// Sets `template`'s pool to `size`: an operator for any template, a team for its own.
    pub async fn set(&self, asker: &Asker, template: &TemplateDoc, size: u32) -> Result<PoolView, Failure> {
        if size > MAX_POOL_SIZE {
            return Err(Failure::Invalid(format!(
                "size {size} exceeds the largest pool, {MAX_POOL_SIZE}"
            )));
        }
        let set_by = match asker {
            Asker::Operator => OPERATOR.to_string(),
            Asker::Team(team) if *team == template.team_id && !template.team_id.is_empty() => team.clone(),
            Asker::Team(_) => {
                return Err(Failure::Forbidden(format!(
                    "template {} is not your team's: only its team or an operator sets its pool",
                    template.template_id
                )))
            }
        };
        let doc = PoolDoc {
            template_id: template.template_id.clone(),
            size,
            set_by,
            updated_at_unix_ms: now_ms(),
        };
        for _ in 0..SET_ATTEMPTS {
            let (pools, _) = self.ledger.list::<PoolDoc>(POOL_KIND, "").await?;
            let current = pools.iter().find(|p| p.value.template_id == template.template_id);
            if let Asker::Team(team) = asker {
                let others = self.team_pools(team, template, &pools).await?;
                team_may_set(template, current.map(|c| &c.value), &others, size)?;
            }
            let txn = match current {
                Some(current) => Txn::new().update_read(current, &doc)?,
                None => Txn::new().create(POOL_KIND, &template.template_id, &doc)?,
            };
            match self.ledger.compare(txn).await {
                Ok(_) => {
                    tracing::info!(template_id = %template.template_id, size, "pool size set");
                    return Ok(self.view(&template.template_id, Some(doc)));
                }
                Err(LedgerError::Conflict { .. }) => continue,
                Err(err) => return Err(err.into()),
            }
        }
        Err(Failure::Conflict(format!(
            "the pool of {} changed concurrently; retry",
            template.template_id
        )))
    }
}

impl Pools {
    /// The other pools `team` set (not `template`'s): each one's size and the memory each of
    /// its sandboxes asks for (its template's; a template gone since counts nothing).
    async fn team_pools(
        &self,
        team: &str,
        template: &TemplateDoc,
        pools: &[ledger_client::Versioned<PoolDoc>],
    ) -> Result<Vec<(u32, u64)>, Failure> {
        let mut others = Vec::new();
        for pool in pools
            .iter()
            .map(|p| &p.value)
            .filter(|p| p.set_by == team && p.template_id != template.template_id)
        {
            let memory = match self.ledger.get::<TemplateDoc>(TEMPLATE_KIND, &pool.template_id).await? {
                Some(doc) => pooled_memory(&doc.value),
                None => 0,
            };
            others.push((pool.size, memory));
        }
        Ok(others)
    }
}

/// Tries a size change makes against concurrent changes before it gives up.
const SET_ATTEMPTS: usize = 5;

/// The memory each pooled sandbox of `template` asks for: its template's, or the default.
fn pooled_memory(template: &TemplateDoc) -> u64 {
    if template.memory_mb > 0 {
        template.memory_mb << 20
    } else {
        common::resources::DEFAULT_MEMORY_BYTES
    }
}

/// Whether a team may size `template`'s pool (now `current`) to `size`, with its other pools
/// as `others` (size, memory a sandbox): not over a size an operator set, and within the
/// team's budget across its templates' pools, counted in sandboxes and in memory (an
/// operator's pools do not count).
fn team_may_set(
    template: &TemplateDoc,
    current: Option<&PoolDoc>,
    others: &[(u32, u64)],
    size: u32,
) -> Result<(), Failure> {
    if current.is_some_and(PoolDoc::by_operator) {
        return Err(Failure::Forbidden(format!(
            "an operator set the pool of {}; only an operator changes it",
            template.template_id
        )));
    }
    let slots: u32 = others.iter().map(|(n, _)| n).sum();
    if slots + size > MAX_TEAM_POOL_SLOTS {
        return Err(Failure::Invalid(format!(
            "a team keeps at most {MAX_TEAM_POOL_SLOTS} pooled sandboxes across its templates; \
             its other pools keep {slots}, so this one may keep at most {}",
            MAX_TEAM_POOL_SLOTS.saturating_sub(slots)
        )));
    }
    let memory: u64 = others.iter().map(|(n, m)| u64::from(*n) * m).sum();
    let each = pooled_memory(template);
    if memory + u64::from(size) * each > MAX_TEAM_POOL_MEMORY_BYTES {
        return Err(Failure::Invalid(format!(
            "a team's pooled sandboxes ask for at most {} MiB together; its other pools ask for {} MiB, \
             so this one may keep at most {} sandboxes of {} MiB",
            MAX_TEAM_POOL_MEMORY_BYTES >> 20,
            memory >> 20,
            MAX_TEAM_POOL_MEMORY_BYTES.saturating_sub(memory) / each.max(1),
            each >> 20
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_team_sizes_only_within_its_budget_and_never_over_an_operator() {
        let template = TemplateDoc {
            template_id: "t".into(),
            team_id: "a".into(),
            ..TemplateDoc::default()
        };
        const MIB: u64 = 1 << 20;
        // Team a's other pool: 10 of 512 MiB (5 GiB of its 8).
        let others = [(10, 512 * MIB)];
        assert!(team_may_set(&template, None, &others, 6).is_ok());
        assert!(matches!(
            team_may_set(&template, None, &others, 7),
            Err(Failure::Invalid(_))
        ));
        let large = TemplateDoc {
            memory_mb: 1024,
            ..template.clone()
        };
        assert!(team_may_set(&large, None, &others, 3).is_ok(), "5 + 3 GiB");
        match team_may_set(&large, None, &others, 4) {
            Err(Failure::Invalid(why)) => assert!(why.contains("at most 3 sandboxes of 1024 MiB"), "{why}"),
            other => panic!("9 GiB of pooled sandboxes: {other:?}"),
        }
        let operators = PoolDoc {
            template_id: "t".into(),
            set_by: OPERATOR.into(),
            ..PoolDoc::default()
        };
        assert!(matches!(
            team_may_set(&template, Some(&operators), &others, 1),
            Err(Failure::Forbidden(_))
        ));
    }

    #[test]
    fn a_slots_sandbox_is_read_from_its_manifest() {
        let slot = PoolSlotDoc {
            template_id: "t".into(),
            slot: 1,
            sandbox_id: "s".into(),
            ..PoolSlotDoc::default()
        };
        let pooled = SandboxDoc {
            phase: SandboxPhase::Running,
            pool: Some(Pooled {
                template_id: "t".into(),
                slot: 1,
                ..Pooled::default()
            }),
            ..SandboxDoc::default()
        };
        assert_eq!(slot_sandbox(None, &slot), SlotSandbox::Absent);
        assert_eq!(slot_sandbox(Some(&pooled), &slot), SlotSandbox::Ready);
        let creating = SandboxDoc {
            phase: SandboxPhase::Creating,
            ..pooled.clone()
        };
        assert_eq!(slot_sandbox(Some(&creating), &slot), SlotSandbox::Busy);
        let moving = SandboxDoc {
            lifecycle_owner: Some("plan.1".into()),
            ..pooled.clone()
        };
        assert_eq!(slot_sandbox(Some(&moving), &slot), SlotSandbox::Busy);
        let mut dropped = pooled.clone();
        if let Some(pool) = dropped.pool.as_mut() {
            pool.retire_asked = Some(common::pool::RetireAsk::default());
        }
        assert_eq!(slot_sandbox(Some(&dropped), &slot), SlotSandbox::Unwanted);
        let claimed = SandboxDoc { pool: None, ..pooled };
        assert_eq!(slot_sandbox(Some(&claimed), &slot), SlotSandbox::Claimed);
    }
}
