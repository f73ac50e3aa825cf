//! Executes moves: one action per step, each persisted in the plan document before the next.
//!
//! The steps and why their order keeps a sandbox in exactly one running place are in
//! [`crate::record`]. Here is what each step *does*, and how it stays safe to repeat:
//!
//! - node calls carry `<move_id>/<action>/<epoch>` as operation ID, and repeats of an action
//!   that already happened are answered as done (pausing a paused sandbox, a restore that
//!   finds its copy, a kill that finds nothing);
//! - every time an executor picks up a move that is under way it takes the sandbox's fencing
//!   epoch again (manifest compare-and-swap, guarded by `lifecycle_owner` = this move), so a
//!   node refuses anything an older executor still tries with the old epoch;
//! - the plan document is written by compare-and-swap on its own version only; a conflict
//!   means another executor took the lease, and this one stops ([`MoveError::Fenced`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::clock::now_ms;
use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use common::trace::TracedChannel;
use futures::StreamExt;
use ledger_client::{LedgerClient, LedgerError, Txn, Versioned};
use proto::node::v1 as node_pb;
use proto::node::v1::node_client::NodeClient;
use proto::placement::v1 as pl;
use proto::placement::v1::placement_client::PlacementClient;
use tokio::sync::Mutex;
use tonic::transport::Endpoint;
use tonic::Code;
use tracing::Instrument;

use crate::record::{MoveRecord, PlanDoc, Step, PLAN_KIND};

/// Why a step did not complete.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    /// Worth trying again shortly (a node or the ledger is unreachable).
    #[error("transient: {0}")]
    Transient(String),
    /// The step cannot succeed; roll back if the step allows it.
    #[error("{0}")]
    Failed(String),
    /// The sandbox's manifest is gone: its user killed it mid-move.
    #[error("sandbox {0} was deleted while moving")]
    Gone(String),
    /// Another executor holds the lease or a newer epoch: stop acting at once.
    #[error("fenced: {0}")]
    Fenced(String),
    /// Fault injection for crash tests: the executor "dies" here.
    #[error("halted by fault injection after {0}")]
    Halted(&'static str),
}

fn from_status(what: &str, status: tonic::Status) -> MoveError {
    let message = format!("{what}: {}", status.message());
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => MoveError::Transient(message),
        Code::FailedPrecondition if status.message().contains("epoch") => MoveError::Fenced(message),
        _ => MoveError::Failed(message),
    }
}

fn from_ledger(err: LedgerError) -> MoveError {
    if err.is_transient() {
        MoveError::Transient(err.to_string())
    } else {
        MoveError::Failed(err.to_string())
    }
}

/// Where a crash test stops the executor: after the action of `step` completed, before or
/// after the plan document records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Halt {
    pub step: Step,
    pub recorded: bool,
}

/// Snapshots arrive as a stream of hundreds of MB: a large HTTP/2 window keeps the sender
/// from stalling on window updates (the node's server uses the same).
fn node_svc_window() -> Option<u32> {
    Some(8 << 20)
}

/// gRPC clients per node address, connected lazily and reused.
#[derive(Clone, Default)]
pub struct NodeClients {
    clients: Arc<Mutex<HashMap<String, NodeClient<TracedChannel>>>>,
}

impl NodeClients {
    pub async fn get(&self, address: &str) -> Result<NodeClient<TracedChannel>, MoveError> {
        let mut clients = self.clients.lock().await;
        if let Some(client) = clients.get(address) {
            return Ok(client.clone());
        }
        let channel = Endpoint::from_shared(address.to_string())
            .map_err(|e| MoveError::Failed(format!("bad node address {address:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .initial_stream_window_size(node_svc_window())
            .initial_connection_window_size(node_svc_window().map(|w| w * 2))
            .connect_lazy();
        let client = NodeClient::new(common::trace::traced(channel)).max_decoding_message_size(16 << 20);
        clients.insert(address.to_string(), client.clone());
        Ok(client)
    }
}

/// The plan being executed, shared by its moves (several run at once within the budget).
struct Shared {
    plan: Versioned<PlanDoc>,
}

/// Runs plans' moves.
#[derive(Clone)]
pub struct Mover {
    ledger: LedgerClient,
    nodes: NodeClients,
    placement: Option<PlacementClient<TracedChannel>>,
    /// Moves at once.
    concurrency: usize,
    halt: Option<Halt>,
    /// Attempts of a step that fails transiently before it counts as failed.
    attempts: u32,
}

impl Mover {
    pub fn new(ledger: LedgerClient, placement: Option<PlacementClient<TracedChannel>>, concurrency: usize) -> Self {
        Self {
            ledger,
            nodes: NodeClients::default(),
            placement,
            concurrency: concurrency.max(1),
            halt: None,
            attempts: 10,
        }
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
        let shared = Arc::new(Mutex::new(Shared { plan }));
        let results: Vec<Result<(), MoveError>> = futures::stream::iter(pending)
            .map(|i| {
                let shared = shared.clone();
                // Each move is its own trace (linked to its sandbox's creation in run_move).
                let span = tracing::info_span!(parent: None, "balance.move", plan_id = %plan_id, move_index = i);
                async move { self.run_move(&shared, i).await }.instrument(span)
            })
            .buffer_unordered(self.concurrency)
            .collect()
            .await;
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
                otel.name = %format!("balance.{}", action_name(record.step)),
                sandbox_id = %record.sandbox_id,
                epoch = record.epoch,
            );
            let next = match self.retrying(&record).instrument(action).await {
                Ok(next) => next,
                Err(err @ (MoveError::Fenced(_) | MoveError::Halted(_))) => return Err(err),
                Err(MoveError::Gone(_)) => self.abandon(record.clone()).await?,
                Err(err) if record.step.can_roll_back() => {
                    tracing::warn!(sandbox_id = %record.sandbox_id, step = record.step.name(), %err, "move failed; rolling back");
                    metrics::counter!("balance_move_failures_total", "step" => record.step.name()).increment(1);
                    let mut back = record.clone();
                    back.step = Step::RollingBack;
                    back.failed_at = Some(record.step);
                    back.error = Some(err.to_string());
                    back
                }
                // Past the switch (or while rolling back) the only way is forward: leave the
                // step recorded; the next cycle tries again.
                Err(err) => return Err(err),
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

    fn check_halt(&self, record: &MoveRecord, recorded: bool) -> Result<(), MoveError> {
        match self.halt {
            Some(h) if h.step == record.step && h.recorded == recorded => Err(MoveError::Halted(record.step.name())),
            _ => Ok(()),
        }
    }

    /// One step's action, tried again on transient failures with a growing pause.
    async fn retrying(&self, record: &MoveRecord) -> Result<MoveRecord, MoveError> {
        let mut delay = Duration::from_millis(50);
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.advance(record).await {
                Err(MoveError::Transient(why)) if attempt < self.attempts => {
                    tracing::debug!(sandbox_id = %record.sandbox_id, step = record.step.name(), %why, attempt, "retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(1));
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
                self.lifecycle(&record.from_address, record, "pause").await?;
                next.paused_at_unix_ms = Some(now_ms());
            }
            Step::SourcePaused => self.copy(record).await?,
            Step::Restored => {
                self.lifecycle(&record.to_address, record, "resume").await?;
                next.resumed_at_unix_ms = Some(now_ms());
            }
            Step::TargetResumed => self.switch(record).await?,
            Step::Switched => {
                self.lifecycle(&record.from_address, record, "kill").await?;
                self.tell_placement(record).await;
                next.finished_at_unix_ms = Some(now_ms());
            }
            Step::RollingBack => {
                // Never owned: nothing was touched.
                if record.epoch > 0 {
                    self.roll_back(record).await?;
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
        let under_way = matches!(
            record.step,
            Step::Owned | Step::SourcePaused | Step::Restored | Step::TargetResumed | Step::RollingBack
        );
        if !under_way || record.epoch == 0 {
            return Ok(record);
        }
        let Some(doc) = manifest? else {
            return self.abandon(record).await;
        };
        if doc.value.lifecycle_owner.as_deref() == Some(record.move_id.as_str()) {
            record.epoch = self.take_epoch(&record, doc).await?;
        } else if record.step == Step::TargetResumed && doc.value.node_id == record.to_node {
            // The switch (which also releases ownership) landed; its record did not.
            record.step = Step::Switched;
        } else if record.step == Step::RollingBack {
            // Releasing is the rollback's last action: it landed.
            record.step = Step::RolledBack;
            record.finished_at_unix_ms = Some(now_ms());
        } else {
            return Err(MoveError::Failed(format!(
                "move {} lost ownership of {} (owner now {:?})",
                record.move_id, record.sandbox_id, doc.value.lifecycle_owner
            )));
        }
        Ok(record)
    }

    async fn manifest(&self, record: &MoveRecord) -> Result<Option<Versioned<SandboxDoc>>, MoveError> {
        self.ledger
            .get::<SandboxDoc>(SANDBOX_KIND, &record.sandbox_id)
            .await
            .map_err(from_ledger)
    }

    /// Takes the sandbox for this move under a new epoch, if it is running on the source and
    /// nobody else owns it.
    async fn own(&self, record: &MoveRecord) -> Result<u64, MoveError> {
        let Some(doc) = self.manifest(record).await? else {
            return Err(MoveError::Gone(record.sandbox_id.clone()));
        };
        match doc.value.lifecycle_owner.as_deref() {
            // Ours already: a crash came between the manifest write and the plan's record.
            Some(owner) if owner == record.move_id => {}
            Some(other) => return Err(MoveError::Failed(format!("LifecycleOwned by {other}"))),
            None if doc.value.phase != SandboxPhase::Running || doc.value.node_id != record.from_node => {
                return Err(MoveError::Failed(format!(
                    "the sandbox is {:?} on {:?}, not running on {}",
                    doc.value.phase, doc.value.node_id, record.from_node
                )));
            }
            None => {}
        }
        self.take_epoch(record, doc).await
    }

    /// Owner := this move, epoch + 1, guarded by the manifest's version.
    async fn take_epoch(&self, record: &MoveRecord, mut doc: Versioned<SandboxDoc>) -> Result<u64, MoveError> {
        doc.value.lifecycle_owner = Some(record.move_id.clone());
        doc.value.epoch += 1;
        let epoch = doc.value.epoch;
        self.save_manifest(&doc).await?;
        tracing::info!(sandbox_id = %record.sandbox_id, epoch, "lifecycle owned by the move");
        Ok(epoch)
    }

    async fn save_manifest(&self, doc: &Versioned<SandboxDoc>) -> Result<(), MoveError> {
        let txn = Txn::new()
            .update(SANDBOX_KIND, &doc.value.sandbox_id, doc.version, &doc.value)
            .map_err(from_ledger)?;
        match self.ledger.compare(txn).await {
            Ok(_) => Ok(()),
            // Someone changed the manifest between read and write: read again next attempt.
            Err(LedgerError::Conflict { .. }) => Err(MoveError::Transient("manifest changed; retrying".into())),
            Err(err) => Err(from_ledger(err)),
        }
    }

    /// Pause, resume or kill on one node, under the move's epoch. Repeats are answered as
    /// done; a kill that finds nothing has nothing left to do.
    async fn lifecycle(&self, address: &str, record: &MoveRecord, action: &str) -> Result<(), MoveError> {
        let mut node = self.nodes.get(address).await?;
        let request = node_pb::LifecycleRequest {
            operation_id: record.operation_id(action),
            epoch: record.epoch,
            sandbox_id: record.sandbox_id.clone(),
        };
        let result = match action {
            "pause" => node.pause(request).await,
            "resume" | "undo-resume" => node.resume(request).await,
            _ => node.kill(request).await,
        };
        match result {
            Ok(_) => Ok(()),
            Err(status) if status.code() == Code::NotFound && action.ends_with("kill") => Ok(()),
            Err(status) if status.code() == Code::NotFound && action == "undo-resume" => {
                Err(MoveError::Gone(record.sandbox_id.clone()))
            }
            Err(status) => Err(from_status(&format!("{action} on {address}"), status)),
        }
    }

    /// Streams the paused source's snapshot straight into the target's restore: chunks are
    /// forwarded as they arrive, so reading, sending and unpacking overlap.
    async fn copy(&self, record: &MoveRecord) -> Result<(), MoveError> {
        let mut source = self.nodes.get(&record.from_address).await?;
        let mut target = self.nodes.get(&record.to_address).await?;
        let mut snapshot = source
            .snapshot(node_pb::LifecycleRequest {
                operation_id: record.operation_id("snapshot"),
                epoch: record.epoch,
                sandbox_id: record.sandbox_id.clone(),
            })
            .await
            .map_err(|s| from_status("snapshot", s))?
            .into_inner();
        let header = match snapshot.message().await.map_err(|s| from_status("snapshot", s))? {
            Some(node_pb::SnapshotChunk {
                part: Some(node_pb::snapshot_chunk::Part::Header(header)),
            }) => header,
            _ => {
                return Err(MoveError::Failed(
                    "the snapshot stream did not start with its header".into(),
                ))
            }
        };
        let first = node_pb::RestoreChunk {
            part: Some(node_pb::restore_chunk::Part::Header(node_pb::RestoreHeader {
                operation_id: record.operation_id("restore"),
                epoch: record.epoch,
                snapshot: Some(header),
            })),
        };
        let rest = snapshot.filter_map(|chunk| async move {
            match chunk {
                Ok(node_pb::SnapshotChunk { part: Some(part) }) => Some(node_pb::RestoreChunk {
                    part: Some(match part {
                        node_pb::snapshot_chunk::Part::Header(h) => node_pb::restore_chunk::Part::Data(
                            // A second header is malformed; the target's checksum rejects it.
                            h.description_json.into_bytes(),
                        ),
                        node_pb::snapshot_chunk::Part::Data(d) => node_pb::restore_chunk::Part::Data(d),
                        node_pb::snapshot_chunk::Part::Trailer(t) => node_pb::restore_chunk::Part::Trailer(t),
                    }),
                }),
                // A broken source stream ends the request without a trailer: the target
                // refuses it as incomplete and keeps nothing.
                _ => None,
            }
        });
        let stream = futures::stream::iter([first]).chain(rest);
        match target.restore(stream).await {
            Ok(_) => Ok(()),
            Err(status) if status.code() == Code::AlreadyExists => Ok(()),
            Err(status) => Err(from_status("restore", status)),
        }
    }

    /// Points the manifest at the target, releases ownership and starts the cooldown, in one
    /// compare-and-swap guarded by "owned by this move".
    async fn switch(&self, record: &MoveRecord) -> Result<(), MoveError> {
        let mut target = self.nodes.get(&record.to_address).await?;
        let info = target
            .info(node_pb::InfoRequest {})
            .await
            .map_err(|s| from_status("target info", s))?
            .into_inner();
        let Some(mut doc) = self.manifest(record).await? else {
            return Err(MoveError::Gone(record.sandbox_id.clone()));
        };
        if doc.value.lifecycle_owner.as_deref() != Some(record.move_id.as_str()) {
            return Err(MoveError::Failed("the move no longer owns the sandbox".into()));
        }
        doc.value.node_id = record.to_node.clone();
        doc.value.node_address = record.to_address.clone();
        doc.value.envd_address = info.envd_address;
        doc.value.lifecycle_owner = None;
        doc.value.last_moved_unix_ms = Some(now_ms());
        self.save_manifest(&doc).await
    }

    /// Puts the sandbox back on the source. A target copy that was resumed must be gone
    /// before the source runs again (never two running copies); one that can only be paused
    /// (the move failed before resuming it) is removed if the target answers, and otherwise
    /// left paused there, named in the move's error, rather than keeping the sandbox down.
    async fn roll_back(&self, record: &MoveRecord) -> Result<(), MoveError> {
        let target_ran = record.failed_at.is_some_and(|s| s == Step::TargetResumed);
        match self.lifecycle(&record.to_address, record, "undo-kill").await {
            Ok(()) => {}
            Err(err @ MoveError::Transient(_)) if target_ran => return Err(err),
            Err(err) => {
                tracing::warn!(sandbox_id = %record.sandbox_id, to = %record.to_node, %err,
                    "target unreachable while rolling back; any copy there stays paused");
            }
        }
        self.lifecycle(&record.from_address, record, "undo-resume").await?;
        self.release(record).await
    }

    /// Rolling back: clears ownership (the epoch stays, so older calls remain fenced).
    async fn release(&self, record: &MoveRecord) -> Result<(), MoveError> {
        let Some(mut doc) = self.manifest(record).await? else {
            return Err(MoveError::Gone(record.sandbox_id.clone()));
        };
        if doc.value.lifecycle_owner.as_deref() != Some(record.move_id.as_str()) {
            return Ok(());
        }
        doc.value.lifecycle_owner = None;
        self.save_manifest(&doc).await
    }

    /// The user killed the sandbox mid-move: remove whatever copy this move made or paused.
    async fn abandon(&self, mut record: MoveRecord) -> Result<MoveRecord, MoveError> {
        tracing::warn!(sandbox_id = %record.sandbox_id, "sandbox deleted while moving; removing its copies");
        // Never owned: the move touched nothing.
        let copies = if record.epoch == 0 { 0 } else { 2 };
        for (address, action) in [
            (&record.to_address, "abandon-kill-target"),
            (&record.from_address, "abandon-kill"),
        ]
        .into_iter()
        .take(copies)
        {
            // Gone, fenced by the user's kill, or refused: nothing of ours is left there.
            if let Err(err @ (MoveError::Transient(_) | MoveError::Halted(_))) =
                self.lifecycle(address, &record, action).await
            {
                return Err(err);
            }
        }
        record.step = Step::Abandoned;
        record.finished_at_unix_ms = Some(now_ms());
        Ok(record)
    }

    /// Placement subtracts the source's share until a heartbeat stops listing it.
    async fn tell_placement(&self, record: &MoveRecord) {
        let Some(placement) = &self.placement else { return };
        let removed = placement
            .clone()
            .removed(pl::SandboxRef {
                sandbox_id: record.sandbox_id.clone(),
                node_id: record.from_node.clone(),
                resources: None,
            })
            .await;
        if let Err(status) = removed {
            tracing::debug!(sandbox_id = %record.sandbox_id, %status, "placement did not hear of the move; a heartbeat corrects it");
        }
    }

    /// Writes the move's new record into the plan document (compare-and-swap on it alone).
    async fn record(&self, shared: &Mutex<Shared>, index: usize, next: &MoveRecord) -> Result<(), MoveError> {
        let mut guard = shared.lock().await;
        let mut plan = guard.plan.value.clone();
        plan.moves[index] = next.clone();
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.write_plan(&guard.plan, &plan).await {
                Ok(version) => {
                    guard.plan.version = version;
                    guard.plan.value = plan;
                    return Ok(());
                }
                Err(MoveError::Transient(why)) if attempt < self.attempts => {
                    tracing::warn!(%why, "plan not recorded yet; retrying");
                    tokio::time::sleep(Duration::from_millis(100 * u64::from(attempt))).await;
                }
                Err(err) => return Err(err),
            }
        }
    }

    async fn write_plan(&self, current: &Versioned<PlanDoc>, plan: &PlanDoc) -> Result<u64, MoveError> {
        let txn = Txn::new()
            .update(PLAN_KIND, &plan.plan_id, current.version, plan)
            .map_err(from_ledger)?;
        match self.ledger.compare(txn).await {
            Ok(done) => Ok(done.versions.first().copied().unwrap_or(current.version + 1)),
            Err(LedgerError::Conflict { .. }) => Err(MoveError::Fenced(format!(
                "plan {} was written by another executor",
                plan.plan_id
            ))),
            Err(err) => Err(from_ledger(err)),
        }
    }
}

/// The action that follows a step, as its span is named.
fn action_name(step: Step) -> &'static str {
    match step {
        Step::Planned => "own",
        Step::Owned => "pause",
        Step::SourcePaused => "transfer",
        Step::Restored => "resume",
        Step::TargetResumed => "switch_route",
        Step::Switched => "delete_source",
        Step::RollingBack => "roll_back",
        Step::Done | Step::RolledBack | Step::Abandoned => "none",
    }
}
