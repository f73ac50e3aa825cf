//! One balance cycle, every interval: hold the lease, finish any plan left unfinished (by a
//! crash), observe, sweep for orphaned copies (every `sweep_every`), plan, commit, execute.
//!
//! Observation and planning read node documents and manifests; nothing they read is ever in
//! a compare-and-swap guard. The plan commit creates the plan document and guards nothing
//! else: node documents are rewritten every few seconds by placement, and a commit that
//! compared them would always fail and no plan would ever start. The manifests a plan
//! rewrites before its commit are those of the pooled sandboxes it drops instead of moving
//! (see [`DropRecord`]), each guarded by the version listed: that write is the drop.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::clock::now_ms;
use common::docs::{NodeDoc, SandboxDoc, NODE_KIND, SANDBOX_KIND};
use ledger_client::{LedgerClient, LedgerError, Txn, Versioned};
use proto::node::v1 as npb;
use tokio::sync::RwLock;

use crate::lease::Lease;
use crate::migrate::{MoveError, Mover};
use crate::orphan::{self, Copy, Sightings, Why};
use crate::plan::{self, ScanResult, Status, Tuning};
use crate::record::{
    ControlDoc, DropRecord, MoveRecord, ObservationDoc, PlanDoc, PlanReason, CONTROL_ID, CONTROL_KIND, OBSERVATION_ID,
    OBSERVATION_KIND, PLAN_KIND,
};
use crate::view;

/// How balancing behaves.
#[derive(Clone, Debug)]
pub struct BalanceTuning {
    pub plan: Tuning,
    /// Between cycles (5 s by default, the rate at which node documents change).
    pub interval: Duration,
    /// A node whose document is older than this is not ready.
    pub stale_after: Duration,
    /// Judge anyway if a finished move is still not reflected after this long.
    pub reflect_timeout: Duration,
    /// Plans kept in the ledger for history.
    pub history: usize,
    /// How often the executor looks for orphaned copies (see [`crate::orphan`]).
    pub sweep_every: Duration,
    /// How long a copy must stay an orphan before it is killed.
    pub orphan_grace: Duration,
}

impl Default for BalanceTuning {
    fn default() -> Self {
        Self {
            plan: Tuning::default(),
            interval: Duration::from_secs(5),
            stale_after: Duration::from_secs(30),
            reflect_timeout: Duration::from_secs(30),
            history: 100,
            sweep_every: Duration::from_secs(30),
            orphan_grace: Duration::from_secs(60),
        }
    }
}

/// What a cycle failed with.
#[derive(Debug, thiserror::Error)]
pub enum CycleError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Move(#[from] MoveError),
}

/// What this replica knows, for Status and metrics.
#[derive(Clone, Debug, Default)]
pub struct Known {
    pub leader: bool,
    pub observation: ObservationDoc,
    pub active_plan: Option<String>,
    pub control: ControlDoc,
    /// Sandboxes whose last move failed, by ID: what an operator asks a stalled drain about.
    pub stuck: BTreeMap<String, crate::stuck::Stuck>,
    /// The version of the control document `control` was read or written at.
    pub control_version: u64,
}

impl Known {
    /// Takes `control` as read or written at `version`, unless a newer one is known: a cycle's
    /// read from before an operator's write must not undo it here (Status would say paused
    /// just after the operator resumed).
    pub fn note_control(&mut self, version: u64, control: &ControlDoc) {
        if version >= self.control_version {
            self.control_version = version;
            self.control = control.clone();
        }
    }
}

/// A finished plan's moves and drops waiting for a heartbeat to show them.
#[derive(Default)]
struct Awaiting {
    moves: Vec<MoveRecord>,
    drops: Vec<DropRecord>,
    since_ms: u64,
}

pub struct Balancer {
    ledger: LedgerClient,
    lease: Lease,
    mover: Mover,
    tuning: BalanceTuning,
    known: Arc<RwLock<Known>>,
    awaiting: tokio::sync::Mutex<Awaiting>,
    /// Whether a plan may be left unfinished: at start and after losing the lease (a crash or
    /// another executor may have left one), or when one of ours did not finish. Only then are
    /// the plan documents listed.
    unfinished_may_exist: std::sync::atomic::AtomicBool,
    sweep: tokio::sync::Mutex<Sweep>,
}

/// The orphan sweep's memory between cycles.
#[derive(Default)]
struct Sweep {
    sightings: Sightings,
    next_ms: u64,
    /// When the last sweep ran: after a longer gap than sweeps leave (balancing paused, the
    /// lease held elsewhere) nothing was watched meanwhile, and sightings start over.
    last_ms: u64,
}

/// The shortest gap between sweeps after which sightings start over (a sweep every
/// `sweep_every` leaves gaps of about that; twice it is a sweep missed).
const SWEEP_GAP_FLOOR_MS: u64 = 10_000;

impl Balancer {
    pub fn new(ledger: LedgerClient, lease: Lease, mover: Mover, tuning: BalanceTuning) -> Self {
        Self {
            ledger,
            lease,
            mover,
            tuning,
            known: Arc::new(RwLock::new(Known::default())),
            awaiting: tokio::sync::Mutex::new(Awaiting::default()),
            unfinished_may_exist: std::sync::atomic::AtomicBool::new(true),
            sweep: tokio::sync::Mutex::new(Sweep::default()),
        }
    }

    pub fn known(&self) -> Arc<RwLock<Known>> {
        self.known.clone()
    }

    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// One cycle. Returns the observation's status label when this replica is the executor.
    pub async fn cycle(&self) -> Result<Option<String>, CycleError> {
        // The lease's keeper takes and renews it; a cycle only asks whether it is held.
        let leader = self.lease.confirmed();
        self.known.write().await.leader = leader;
        if !leader {
            self.unfinished_may_exist.store(true, Ordering::SeqCst);
            return Ok(None);
        }
        let (version, control) = self
            .ledger
            .get::<ControlDoc>(CONTROL_KIND, CONTROL_ID)
            .await?
            .map(|c| (c.version, c.value))
            .unwrap_or_default();
        self.known.write().await.note_control(version, &control);
        self.finish_unfinished().await?;

        let (nodes, _) = self.ledger.list::<NodeDoc>(NODE_KIND, "").await?;
        let nodes: Vec<NodeDoc> = nodes.into_iter().map(|n| n.value).collect();
        let (listed, _) = self.ledger.list::<SandboxDoc>(SANDBOX_KIND, "").await?;
        // Pooled sandboxes are dropped rather than moved: their versions guard the asks.
        let mut pooled: HashMap<String, Versioned<SandboxDoc>> = HashMap::new();
        let manifests: Vec<SandboxDoc> = listed
            .into_iter()
            .map(|m| {
                if view::droppable(&m.value) {
                    pooled.insert(m.value.sandbox_id.clone(), m.clone());
                }
                m.value
            })
            .collect();
        let now = now_ms();
        let mut snapshot = view::snapshot(
            &nodes,
            &manifests,
            &control,
            now,
            self.tuning.stale_after.as_millis() as u64,
        );
        self.mark_stuck(&mut snapshot).await;
        let awaiting = self.still_awaiting(&nodes, now).await;
        let (mut status, spread) = plan::observe(&snapshot, &self.tuning.plan, awaiting);
        if control.paused && status == Status::PlanningRequired {
            status = Status::Blocked("BalancingPaused".into());
        }
        let draining = snapshot.nodes.iter().any(|n| n.draining);
        let ready = snapshot.nodes.iter().filter(|n| n.ready).count() as u32;
        self.observe(&status, spread, ready).await?;
        if !control.paused {
            self.sweep(&nodes, &manifests, now).await;
        }
        if control.paused || awaiting {
            return Ok(Some(status.label()));
        }

        let (reason, found) = if draining {
            (PlanReason::Drain, plan::plan_drain(&snapshot, &self.tuning.plan))
        } else if status == Status::PlanningRequired {
            (PlanReason::Balance, plan::plan(&snapshot, &self.tuning.plan))
        } else {
            return Ok(Some(status.label()));
        };
        let skips: BTreeMap<String, u64> = found
            .skips
            .iter()
            .map(|(k, v)| (k.name().to_string(), *v as u64))
            .collect();
        for (skip, n) in &skips {
            metrics::counter!("balance_scan_skips_total", "reason" => skip.clone()).increment(*n);
        }
        metrics::counter!("balance_scans_total", "result" => found.result.name()).increment(1);
        tracing::info!(
            result = found.result.name(),
            ?reason,
            moves = found.moves.len(),
            ?skips,
            spread_before = found.spread_before,
            spread_expected = found.spread_after,
            "plan scan"
        );
        if found.result != ScanResult::PlanFound {
            return Ok(Some(status.label()));
        }
        let addresses: BTreeMap<&str, &str> = nodes.iter().map(|n| (n.node_id.as_str(), n.address.as_str())).collect();
        let plan_id = format!("{now:013}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let template_of = |id: &str| pooled.get(id).map(|m| m.value.template.as_str());
        let (to_move, to_drop) = view::split_drops(&found.moves, template_of, reason == PlanReason::Drain);
        let drops = self.ask_to_go(&plan_id, &to_drop, &pooled).await?;
        if to_move.is_empty() && drops.is_empty() {
            return Ok(Some(status.label()));
        }
        let doc = PlanDoc {
            plan_id: plan_id.clone(),
            reason,
            spread_before: found.spread_before,
            spread_expected: found.spread_after,
            skips,
            created_at_unix_ms: now,
            finished_at_unix_ms: None,
            moves: to_move
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let address = |node: &str| addresses.get(node).copied().unwrap_or_default();
                    MoveRecord::planned(
                        format!("{plan_id}.{i}"),
                        &m.sandbox_id,
                        (&m.from, address(&m.from)),
                        (&m.to, address(&m.to)),
                        m.memory_bytes,
                    )
                })
                .collect(),
            drops,
        };
        let committed = self.commit(&doc).await?;
        tracing::info!(%plan_id, moves = doc.moves.len(), drops = doc.drops.len(), "plan started");
        self.run(committed).await?;
        self.prune().await?;
        Ok(Some(status.label()))
    }

    /// Asks the keepers of `planned`'s pooled sandboxes to retire them, each ask guarded by the
    /// manifest's version as listed: a claim, an eviction or a keeper's retirement since wins,
    /// and that sandbox is neither dropped nor recorded (the next plan sees what it became).
    /// Returns the drops asked. Acts only while the lease is held, as the executor does.
    async fn ask_to_go(
        &self,
        plan_id: &str,
        planned: &[&plan::Move],
        pooled: &HashMap<String, Versioned<SandboxDoc>>,
    ) -> Result<Vec<DropRecord>, CycleError> {
        let by = format!("balance plan {plan_id}");
        let mut drops = Vec::new();
        for m in planned {
            if !self.lease.confirmed() {
                if !drops.is_empty() {
                    // Their keepers act on them still; no plan waits for them.
                    tracing::warn!(%plan_id, asked = drops.len(), "lease lost between a plan's drops; those asked are in no plan");
                }
                return Err(
                    MoveError::Fenced("the executor lease is not confirmed; asking no more drops".into()).into(),
                );
            }
            let Some(listed) = pooled.get(&m.sandbox_id) else {
                continue;
            };
            let now = now_ms();
            let outcome =
                match view::asked_to_go(&listed.value, &by, now).map(|asked| Txn::new().update_read(listed, &asked)) {
                    None => "changed",
                    Some(Err(err)) => {
                        tracing::warn!(sandbox_id = %m.sandbox_id, %err, "a drop's ask could not be written");
                        "error"
                    }
                    Some(Ok(txn)) => match self.ledger.compare_resolving(txn, 3).await {
                        Ok(_) => "asked",
                        Err(LedgerError::Conflict { .. }) => "changed",
                        Err(err) => {
                            tracing::warn!(sandbox_id = %m.sandbox_id, %err, "a drop's ask did not land");
                            "error"
                        }
                    },
                };
            metrics::counter!("balance_pool_drops_total", "outcome" => outcome).increment(1);
            tracing::info!(
                %plan_id, sandbox_id = %m.sandbox_id, node_id = %m.from, outcome,
                "pooled sandbox to drop instead of move"
            );
            if outcome == "asked" {
                drops.push(DropRecord {
                    sandbox_id: m.sandbox_id.clone(),
                    from_node: m.from.clone(),
                    memory_bytes: m.memory_bytes,
                    asked_at_unix_ms: now,
                });
            }
        }
        Ok(drops)
    }

    /// Creates the plan document: the one document this write guards.
    pub async fn commit(&self, doc: &PlanDoc) -> Result<Versioned<PlanDoc>, CycleError> {
        let result = self
            .ledger
            .compare_resolving(Txn::new().create(PLAN_KIND, &doc.plan_id, doc)?, 5)
            .await;
        let outcome = match &result {
            Ok(_) => "committed",
            Err(LedgerError::Conflict { .. }) => "conflict",
            Err(_) => "error",
        };
        metrics::counter!("balance_plan_commits_total", "outcome" => outcome).increment(1);
        let committed = result?;
        Ok(Versioned {
            key: ledger_client::DocKey::new(PLAN_KIND, &doc.plan_id),
            version: committed.versions.first().copied().unwrap_or(1),
            create_revision: committed.revision,
            mod_revision: committed.revision,
            value: doc.clone(),
        })
    }

    /// Executes a committed plan and waits for heartbeats to show its moves.
    async fn run(&self, plan: Versioned<PlanDoc>) -> Result<(), CycleError> {
        let plan_id = plan.value.plan_id.clone();
        self.known.write().await.active_plan = Some(plan_id.clone());
        let result = self.mover.execute(plan).await;
        self.known.write().await.active_plan = None;
        if !result.as_ref().is_ok_and(PlanDoc::is_finished) {
            self.unfinished_may_exist.store(true, Ordering::SeqCst);
        }
        let done = result?;
        let outcomes: BTreeMap<&str, usize> = done.moves.iter().fold(BTreeMap::new(), |mut acc, m| {
            *acc.entry(m.step.name()).or_default() += 1;
            acc
        });
        tracing::info!(%plan_id, ?outcomes, finished = done.is_finished(), "plan executed");
        self.note_failures(&done.moves).await;
        let mut awaiting = self.awaiting.lock().await;
        awaiting.moves = done.moves.into_iter().filter(|m| m.step.is_final()).collect();
        awaiting.drops = done.drops;
        awaiting.since_ms = now_ms();
        Ok(())
    }

    /// Remembers which sandboxes' moves failed (and forgets those that moved).
    async fn note_failures(&self, moves: &[MoveRecord]) {
        let mut known = self.known.write().await;
        crate::stuck::record(&mut known.stuck, moves, now_ms());
        metrics::gauge!("balance_stuck_sandboxes").set(known.stuck.len() as f64);
    }

    /// Marks the snapshot's sandboxes whose moves failed lately, and forgets those gone.
    async fn mark_stuck(&self, snapshot: &mut plan::Snapshot) {
        crate::stuck::mark(&mut self.known.write().await.stuck, snapshot);
    }

    /// Plans a crash (or a lost lease) left unfinished are resumed before anything new.
    async fn finish_unfinished(&self) -> Result<(), CycleError> {
        if !self.unfinished_may_exist.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        let (plans, _) = match self.ledger.list::<PlanDoc>(PLAN_KIND, "").await {
            Ok(listed) => listed,
            Err(err) => {
                self.unfinished_may_exist.store(true, Ordering::SeqCst);
                return Err(err.into());
            }
        };
        for plan in plans {
            if plan.value.finished_at_unix_ms.is_none() {
                tracing::info!(plan_id = %plan.value.plan_id, "resuming an unfinished plan");
                self.run(plan).await?;
            }
        }
        Ok(())
    }

    /// True while a finished move is not yet visible in the node documents (bounded).
    async fn still_awaiting(&self, nodes: &[NodeDoc], now: u64) -> bool {
        let mut awaiting = self.awaiting.lock().await;
        if awaiting.moves.is_empty() && awaiting.drops.is_empty() {
            return false;
        }
        let seen = awaiting.moves.iter().all(|m| view::reflected(m, nodes))
            && awaiting.drops.iter().all(|d| view::drop_reflected(d, nodes));
        let expired = now.saturating_sub(awaiting.since_ms) > self.tuning.reflect_timeout.as_millis() as u64;
        if seen || expired {
            if expired && !seen {
                tracing::warn!("moves or drops not reflected by heartbeats in time; judging anyway");
            }
            awaiting.moves.clear();
            awaiting.drops.clear();
            return false;
        }
        true
    }

    /// Records the observation in the ledger (its own document) and in metrics.
    async fn observe(&self, status: &Status, spread: f64, ready: u32) -> Result<(), CycleError> {
        let label = status.label();
        metrics::gauge!("balance_spread").set(spread);
        metrics::counter!("balance_observations_total", "status" => label.clone()).increment(1);
        let current = self
            .ledger
            .get::<ObservationDoc>(OBSERVATION_KIND, OBSERVATION_ID)
            .await?;
        let mut doc = current.as_ref().map(|c| c.value.clone()).unwrap_or_default();
        if doc.status != label {
            tracing::info!(status = %label, spread, ready_nodes = ready, "observation");
        }
        *doc.counts.entry(label.clone()).or_default() += 1;
        doc.status = label;
        doc.spread = spread;
        doc.ready_nodes = ready;
        doc.observed_at_unix_ms = now_ms();
        doc.plan_id = self.known.read().await.active_plan.clone();
        let txn = match &current {
            Some(c) => Txn::new().update(OBSERVATION_KIND, OBSERVATION_ID, c.version, &doc)?,
            None => Txn::new().create(OBSERVATION_KIND, OBSERVATION_ID, &doc)?,
        };
        match self.ledger.compare(txn).await {
            Ok(_) | Err(LedgerError::Conflict { .. }) => {}
            Err(err) => return Err(err.into()),
        }
        self.known.write().await.observation = doc;
        Ok(())
    }

    /// Kills copies that have been orphans for the grace period (see [`crate::orphan`]). Runs
    /// every `sweep_every` on the executor; a node that does not answer is skipped until the
    /// next sweep. Nothing here fails the cycle.
    async fn sweep(&self, nodes: &[NodeDoc], manifests: &[SandboxDoc], now: u64) {
        let mut sweep = self.sweep.lock().await;
        if now < sweep.next_ms {
            return;
        }
        let every = self.tuning.sweep_every.as_millis() as u64;
        sweep.next_ms = now + every;
        if now.saturating_sub(sweep.last_ms) > (2 * every).max(SWEEP_GAP_FLOOR_MS) {
            // A copy is an orphan once watched for the whole grace period, not once seen
            // before a gap and again after it.
            sweep.sightings = Sightings::default();
        }
        sweep.last_ms = now;
        let stale_after = self.tuning.stale_after.as_millis() as u64;
        let addresses: BTreeMap<&str, &str> = nodes
            .iter()
            .filter(|n| view::reported_lately(n, now, stale_after))
            .map(|n| (n.node_id.as_str(), n.address.as_str()))
            .collect();
        let mut copies = Vec::new();
        for (node_id, address) in &addresses {
            let listed = match self.mover.node_clients().get(node_id, address).await {
                Ok(mut client) => client.list(npb::ListRequest {}).await,
                Err(err) => Err(tonic::Status::unavailable(err.to_string())),
            };
            match listed {
                Ok(reply) => copies.extend(reply.into_inner().sandboxes.into_iter().map(|s| Copy {
                    node_id: node_id.to_string(),
                    paused: s.state == npb::SandboxState::Paused as i32,
                    sandbox_id: s.sandbox_id,
                    epoch: s.epoch,
                })),
                Err(status) => tracing::debug!(%node_id, %status, "orphan sweep skips a node that does not answer"),
            }
        }
        let by_id: HashMap<&str, &SandboxDoc> = manifests.iter().map(|m| (m.sandbox_id.as_str(), m)).collect();
        let orphans = orphan::find(&copies, &by_id);
        metrics::gauge!("balance_orphans").set(orphans.len() as f64);
        let due = sweep
            .sightings
            .update(&orphans, now, self.tuning.orphan_grace.as_millis() as u64);
        for (copy, why) in due {
            self.remove_orphan(
                copy,
                why,
                addresses.get(copy.node_id.as_str()).copied().unwrap_or_default(),
            )
            .await;
        }
    }

    /// Kills one orphan, after reading its manifest once more (a user or a move may have
    /// claimed it since the sweep listed the manifests).
    async fn remove_orphan(&self, copy: &Copy, why: Why, address: &str) {
        let (node_id, sandbox_id) = (copy.node_id.as_str(), copy.sandbox_id.as_str());
        match self.ledger.get::<SandboxDoc>(SANDBOX_KIND, sandbox_id).await {
            Ok(current) if orphan::judge(copy, current.as_ref().map(|m| &m.value)).is_some() => {}
            Ok(_) => return,
            Err(err) => {
                tracing::debug!(%sandbox_id, %err, "orphan left for the next sweep: manifest unreadable");
                return;
            }
        }
        let request = npb::LifecycleRequest {
            // Unique per attempt: a copy left again later under the same epoch must be killed,
            // not answered from the node's memory of the last sweep.
            operation_id: format!("orphan/{sandbox_id}/{}/{}", copy.epoch, uuid::Uuid::new_v4().simple()),
            epoch: copy.epoch,
            sandbox_id: sandbox_id.to_string(),
        };
        let killed = match self.mover.node_clients().get(node_id, address).await {
            Ok(mut client) => client.kill(request).await.map(|_| ()),
            Err(err) => Err(tonic::Status::unavailable(err.to_string())),
        };
        let outcome = match &killed {
            Ok(()) => "removed",
            Err(status) if status.code() == tonic::Code::NotFound => "gone",
            Err(_) => "failed",
        };
        metrics::counter!("balance_orphans_total", "outcome" => outcome, "why" => why.name()).increment(1);
        match killed {
            Ok(()) => {
                tracing::warn!(%node_id, %sandbox_id, why = why.name(), epoch = copy.epoch, paused = copy.paused, "orphaned copy removed")
            }
            Err(status) => {
                tracing::warn!(%node_id, %sandbox_id, why = why.name(), %status, "orphaned copy not removed; will retry")
            }
        }
    }

    /// Keeps the newest finished plans, deleting older ones.
    async fn prune(&self) -> Result<(), CycleError> {
        let (plans, _) = self.ledger.list::<PlanDoc>(PLAN_KIND, "").await?;
        let finished: Vec<&Versioned<PlanDoc>> =
            plans.iter().filter(|p| p.value.finished_at_unix_ms.is_some()).collect();
        if finished.len() <= self.tuning.history {
            return Ok(());
        }
        let excess = finished.len() - self.tuning.history;
        // Plan IDs start with their creation time, so list order is age order.
        for old in finished.into_iter().take(excess) {
            let _ = self
                .ledger
                .compare(Txn::new().delete(PLAN_KIND, &old.value.plan_id, old.version))
                .await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_read_of_the_control_document_does_not_undo_a_newer_write() {
        let mut known = Known::default();
        let paused = ControlDoc {
            paused: true,
            ..ControlDoc::default()
        };
        known.note_control(3, &paused);
        // An operator resumed (version 4); a cycle that read version 3 before it reports late.
        known.note_control(4, &ControlDoc::default());
        known.note_control(3, &paused);
        assert!(!known.control.paused);
        assert_eq!(known.control_version, 4);
        known.note_control(5, &paused);
        assert!(known.control.paused);
    }
}
