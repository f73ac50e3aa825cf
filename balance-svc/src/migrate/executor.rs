//! Drives a plan's moves: each move's steps in order, each recorded in the plan document
//! before the next, several moves at once within the [`Budget`] (in all and per node); transient failures
//! retried with a growing pause, other failures routed by [`super::decide::on_failure`].

use std::sync::Arc;
use std::time::Duration;

use common::clock::now_ms;
use common::docs::SandboxDoc;
use common::trace::TracedChannel;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use ledger_client::{LedgerClient, LedgerError, Txn, Versioned};
use proto::placement::v1::placement_client::PlacementClient;
use tokio::sync::Mutex;
use tracing::Instrument;

use super::decide::{self, NodeAction, OnFailure, PickUp};
use super::error::from_ledger;
use super::schedule::{Budget, Schedule};
use super::{MoveError, NodeClients};
use crate::lease::Lease;
use crate::record::{MoveRecord, PlanDoc, Step, PLAN_KIND};

/// Where a crash test stops the executor: after the action of `step` completed, before or
/// after the plan document records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Halt {
    pub step: Step,
    pub recorded: bool,
}

/// The plan being executed, shared by its moves (several run at once within the budget).
struct Shared {
    plan: Versioned<PlanDoc>,
}

/// Runs plans' moves.
#[derive(Clone)]
pub struct Mover {
    pub(super) ledger: LedgerClient,
    pub(super) nodes: NodeClients,
    pub(super) placement: Option<PlacementClient<TracedChannel>>,
    /// Moves at once, in all and per node.
    budget: Budget,
    halt: Option<Halt>,
    /// Attempts of a step that fails transiently before it counts as failed.
    attempts: u32,
    /// The executor lease, checked before every action: none in tests that drive a mover
    /// directly.
    lease: Option<Lease>,
    /// Longest a pause, resume, kill or info call may take.
    pub(super) call_deadline: Duration,
}

impl Mover {
    pub fn new(ledger: LedgerClient, placement: Option<PlacementClient<TracedChannel>>, budget: Budget) -> Self {
        Self {
            ledger,
            nodes: NodeClients::default(),
            placement,
            budget,
            halt: None,
            attempts: 10,
            lease: None,
            call_deadline: Duration::from_secs(2),
        }
    }

    /// Acts only while `lease` is confirmed: a step about to start on a lease that is not
    /// stops the move as fenced (another executor may take over soon). Every node call and
    /// ledger call then runs under a deadline of two thirds of the lease's TTL (at least
    /// 500 ms), so no call outlives the lease it was made under by much.
    pub fn with_lease(mut self, lease: Lease) -> Self {
        let deadline = (lease.ttl() * 2 / 3).max(Duration::from_millis(500));
        self.ledger = self.ledger.with_deadline(deadline);
        self.call_deadline = deadline;
        self.lease = Some(lease);
        self
    }

    fn check_lease(&self) -> Result<(), MoveError> {
        match &self.lease {
            Some(lease) if !lease.confirmed() => Err(MoveError::Fenced(
                "the executor lease is not confirmed; stopping before the next action".into(),
            )),
            _ => Ok(()),
        }
    }

    /// Calls nodes proving `security`'s role (the balancer's, in a cluster).
    pub fn with_security(mut self, security: mtls::Security) -> Self {
        self.nodes = NodeClients::new(security);
        self
    }

    /// The node clients moves use (the orphan sweep shares them).
    pub fn node_clients(&self) -> &NodeClients {
        &self.nodes
    }

    /// Crash-test hook: stop (as if the process died) at `halt`.
    pub fn with_halt(mut self, halt: Option<Halt>) -> Self {
        self.halt = halt;
        self
    }

    /// Drives every unfinished move of `plan` to a final step (or until fenced or halted);
    /// returns the plan as last recorded.
    pub async fn execute(&self, plan: Versioned<PlanDoc>) -> Result<PlanDoc, MoveError> {
        let plan_id = plan.value.plan_id.clone();
        let pending: Vec<usize> = (0..plan.value.moves.len())
            .filter(|&i| !plan.value.moves[i].step.is_final())
            .collect();
        let mut schedule = Schedule::new(
            self.budget,
            pending.iter().map(|&i| {
                let m = &plan.value.moves[i];
                (i, m.from_node.clone(), m.to_node.clone())
            }),
        );
        let shared = Arc::new(Mutex::new(Shared { plan }));
        let mut running = FuturesUnordered::new();
        let mut results: Vec<Result<(), MoveError>> = Vec::with_capacity(pending.len());
        loop {
            for i in schedule.start() {
                let shared = shared.clone();
                // Each move is its own trace (linked to its sandbox's creation in run_move).
                let span = tracing::info_span!(parent: None, "balance.move", plan_id = %plan_id, move_index = i);
                running.push(async move { (i, self.run_move(&shared, i).await) }.instrument(span));
            }
            let Some((i, result)) = running.next().await else { break };
            schedule.finish(i);
            if matches!(result, Err(MoveError::Fenced(_) | MoveError::Halted(_))) {
                // This executor must stop acting: start nothing more, let running moves end.
                schedule.stop();
            }
            results.push(result);
        }
        // A fence or halt outranks anything else: the caller must stop.
        for result in &results {
            if let Err(err @ (MoveError::Fenced(_) | MoveError::Halted(_))) = result {
                return Err(match err {
                    MoveError::Fenced(m) => MoveError::Fenced(m.clone()),
                    MoveError::Halted(s) => MoveError::Halted(s),
                    _ => unreachable!("matched above"),
                });
            }
        }
        let mut guard = shared.lock().await;
        if guard.plan.value.is_finished() && guard.plan.value.finished_at_unix_ms.is_none() {
            let mut done = guard.plan.value.clone();
            done.finished_at_unix_ms = Some(now_ms());
            let version = self.write_plan(&guard.plan, &done).await?;
            guard.plan.version = version;
            guard.plan.value = done;
        }
        Ok(guard.plan.value.clone())
    }

    async fn run_move(&self, shared: &Mutex<Shared>, index: usize) -> Result<(), MoveError> {
        let mut record = shared.lock().await.plan.value.moves[index].clone();
        tracing::info!(
            sandbox_id = %record.sandbox_id, move_id = %record.move_id, from = %record.from_node,
            to = %record.to_node, step = record.step.name(), "move picked up"
        );
        let manifest = self.manifest(&record).await;
        if let Ok(Some(doc)) = &manifest {
            if let Some(created) = &doc.value.trace_context {
                common::trace::link(&tracing::Span::current(), created);
            }
        }
        let picked = self.pick_up(record.clone(), manifest).await?;
        if picked != record {
            self.record(shared, index, &picked).await?;
            record = picked;
        }
        while !record.step.is_final() {
            let action = tracing::info_span!(
                "balance.step",
                otel.name = %format!("balance.{}", decide::action_name(record.step)),
                sandbox_id = %record.sandbox_id,
                epoch = record.epoch,
            );
            let next = match self.retrying(&record).instrument(action).await {
                Ok(next) => next,
                Err(err) => match decide::on_failure(record.step, &err) {
                    OnFailure::Stop | OnFailure::RetryNextCycle => return Err(err),
                    OnFailure::Abandon => self.abandon(record.clone()).await?,
                    OnFailure::RollBack => {
                        tracing::warn!(sandbox_id = %record.sandbox_id, step = record.step.name(), %err, "move failed; rolling back");
                        metrics::counter!("balance_move_failures_total", "step" => record.step.name()).increment(1);
                        let mut back = record.clone();
                        back.step = Step::RollingBack;
                        back.failed_at = Some(record.step);
                        back.error = Some(err.to_string());
                        back
                    }
                },
            };
            self.check_halt(&next, false)?;
            self.record(shared, index, &next).await?;
            self.check_halt(&next, true)?;
            if next.step.is_final() {
                let outcome = next.step.name();
                metrics::counter!("balance_moves_total", "outcome" => outcome).increment(1);
                if let Some(ms) = next.downtime_ms() {
                    metrics::histogram!("balance_move_downtime_seconds").record(ms as f64 / 1000.0);
                }
                tracing::info!(
                    sandbox_id = %next.sandbox_id, move_id = %next.move_id, outcome,
                    downtime_ms = next.downtime_ms().unwrap_or(0), error = next.error.as_deref().unwrap_or(""),
                    "move completed"
                );
            }
            record = next;
        }
        Ok(())
    }

    /// Retries after the first attempt of a step or a plan write.
    fn retries(&self) -> usize {
        self.attempts.saturating_sub(1) as usize
    }

    fn check_halt(&self, record: &MoveRecord, recorded: bool) -> Result<(), MoveError> {
        match self.halt {
            Some(h) if h.step == record.step && h.recorded == recorded => Err(MoveError::Halted(record.step.name())),
            _ => Ok(()),
        }
    }

    /// One step's action, tried again on transient failures with a growing pause.
    async fn retrying(&self, record: &MoveRecord) -> Result<MoveRecord, MoveError> {
        let mut pauses = common::retry::backoff(Duration::from_millis(50), Duration::from_secs(1)).take(self.retries());
        loop {
            self.check_lease()?;
            match self.advance(record).await {
                Err(MoveError::Transient(why)) => {
                    let Some(pause) = pauses.next() else {
                        return Err(MoveError::Transient(why));
                    };
                    tracing::debug!(sandbox_id = %record.sandbox_id, step = record.step.name(), %why, ?pause, "retrying");
                    tokio::time::sleep(pause).await;
                }
                other => return other,
            }
        }
    }

    /// Does the action after `record.step` and returns the record at the next step.
    async fn advance(&self, record: &MoveRecord) -> Result<MoveRecord, MoveError> {
        let mut next = record.clone();
        next.step = record.step.next().ok_or(MoveError::Failed("nothing to do".into()))?;
        match record.step {
            Step::Planned => next.epoch = self.own(record).await?,
            Step::Owned => {
                self.lifecycle(record.source(), record, NodeAction::Pause).await?;
                next.paused_at_unix_ms = Some(now_ms());
            }
            Step::SourcePaused => self.copy(record).await?,
            Step::Restored => {
                self.lifecycle(record.target(), record, NodeAction::Resume).await?;
                next.resumed_at_unix_ms = Some(now_ms());
            }
            Step::TargetResumed => self.switch(record).await?,
            Step::Switched => {
                self.lifecycle(record.source(), record, NodeAction::Kill).await?;
                self.tell_placement(record).await;
                next.finished_at_unix_ms = Some(now_ms());
            }
            Step::RollingBack => {
                self.release_target(record).await;
                if record.epoch > 0 {
                    next.epoch = self.roll_back(record).await?;
                } else {
                    // Ownership was never recorded, but the write taking it may have landed
                    // with its reply lost: release it if it is ours. Nothing else was touched.
                    self.release(record).await?;
                }
                next.finished_at_unix_ms = Some(now_ms());
            }
            Step::Done | Step::RolledBack | Step::Abandoned => {}
        }
        Ok(next)
    }

    /// An executor picking up a move under way takes the sandbox's epoch again (an older
    /// executor may still be acting with the old one), or learns from the manifest that the
    /// action after the recorded step already landed before a crash.
    async fn pick_up(
        &self,
        mut record: MoveRecord,
        manifest: Result<Option<Versioned<SandboxDoc>>, MoveError>,
    ) -> Result<MoveRecord, MoveError> {
        let doc = match manifest {
            Ok(doc) => doc,
            // Only a move under way needs the manifest; one that does not, goes on.
            Err(_) if !decide::needs_manifest(&record) => return Ok(record),
            Err(err) => return Err(err),
        };
        match decide::pick_up(&record, doc.as_ref().map(|d| &d.value)) {
            PickUp::AsRecorded => {}
            PickUp::Abandon => return self.abandon(record).await,
            PickUp::Retake => {
                let doc = doc.ok_or_else(|| MoveError::Gone(record.sandbox_id.clone()))?;
                record.epoch = self.take_epoch(&record, doc).await?;
            }
            PickUp::Switched => record.step = Step::Switched,
            PickUp::RolledBack => {
                record.step = Step::RolledBack;
                record.finished_at_unix_ms = Some(now_ms());
            }
            PickUp::LostOwnership { owner } => {
                return Err(MoveError::Failed(format!(
                    "move {} lost ownership of {} (owner now {owner:?})",
                    record.move_id, record.sandbox_id
                )));
            }
        }
        Ok(record)
    }

    /// Writes the move's new record into the plan document (compare-and-swap on it alone).
    async fn record(&self, shared: &Mutex<Shared>, index: usize, next: &MoveRecord) -> Result<(), MoveError> {
        let mut guard = shared.lock().await;
        let mut plan = guard.plan.value.clone();
        plan.moves[index] = next.clone();
        let mut pauses =
            common::retry::backoff(Duration::from_millis(100), Duration::from_secs(1)).take(self.retries());
        loop {
            match self.write_plan(&guard.plan, &plan).await {
                Ok(version) => {
                    guard.plan.version = version;
                    guard.plan.value = plan;
                    return Ok(());
                }
                Err(MoveError::Transient(why)) => {
                    let Some(pause) = pauses.next() else {
                        return Err(MoveError::Transient(why));
                    };
                    tracing::warn!(%why, ?pause, "plan not recorded yet; retrying");
                    tokio::time::sleep(pause).await;
                }
                Err(err) => return Err(err),
            }
        }
    }

    async fn write_plan(&self, current: &Versioned<PlanDoc>, plan: &PlanDoc) -> Result<u64, MoveError> {
        let txn = Txn::new()
            .update(PLAN_KIND, &plan.plan_id, current.version, plan)
            .map_err(from_ledger)?;
        // One writer (the lease holder) per plan: a lost reply resolved by reading is ours.
        match self.ledger.compare_resolving(txn, super::steps::RESOLVE_ATTEMPTS).await {
            Ok(done) => Ok(done.versions.first().copied().unwrap_or(current.version + 1)),
            Err(LedgerError::Conflict { .. }) => Err(MoveError::Fenced(format!(
                "plan {} was written by another executor",
                plan.plan_id
            ))),
            Err(err) => Err(from_ledger(err)),
        }
    }
}
