//! Each step's I/O: reading and compare-and-swapping the manifest, node lifecycle calls,
//! streaming a snapshot from source to target, rolling back, abandoning, telling placement.

use common::clock::now_ms;
use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use futures::StreamExt;
use ledger_client::{LedgerError, Txn, Versioned};
use proto::node::v1 as node_pb;
use proto::placement::v1 as pl;
use tonic::Code;

use super::decide::{self, NodeAction, NodeCall, WhenMissing};
use super::error::{from_ledger, from_status};
use super::{MoveError, Mover};
use crate::record::{MoveRecord, Step};

/// Reads a write of unknown outcome may take to resolve it before the step gives up.
pub(super) const RESOLVE_ATTEMPTS: usize = 5;

impl Mover {
    pub(super) async fn manifest(&self, record: &MoveRecord) -> Result<Option<Versioned<SandboxDoc>>, MoveError> {
        self.ledger
            .get::<SandboxDoc>(SANDBOX_KIND, &record.sandbox_id)
            .await
            .map_err(from_ledger)
    }

    /// Takes the sandbox for this move under a new epoch, if it is running on the source and
    /// nobody else owns it.
    pub(super) async fn own(&self, record: &MoveRecord) -> Result<u64, MoveError> {
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
        self.reserve_target(record, &doc.value).await?;
        self.take_epoch(record, doc).await
    }

    /// Asks placement to hold the sandbox's resources on the target, under the same rules as
    /// any create there (ready, not draining, CPU with over-commit, memory, creates in
    /// flight): creates and moves then cannot overfill a node together. The reservation lasts
    /// until the target's heartbeat lists the sandbox, or the move releases it when it rolls
    /// back or is abandoned. Without placement (tests, benchmarks) nothing is reserved.
    ///
    /// It reserves what the sandbox asked for (its manifest), not what it measures: placement
    /// counts asks, and the target's heartbeat, once it lists the sandbox, counts its ask too.
    /// The planner chose the target under the same rule ([`common::fit`]), so a refusal here
    /// means something changed in between (a burst of creates, a drain, a missed heartbeat).
    async fn reserve_target(&self, record: &MoveRecord, doc: &SandboxDoc) -> Result<(), MoveError> {
        let Some(placement) = &self.placement else {
            return Ok(());
        };
        let request = pl::PlaceRequest {
            sandbox_id: record.sandbox_id.clone(),
            resources: Some(pl::Resources {
                vcpus: doc.vcpus.max(1),
                memory_bytes: doc.memory_bytes.max(1),
            }),
            only_node: record.to_node.clone(),
            ..Default::default()
        };
        match placement.clone().place(request).await {
            Ok(_) => Ok(()),
            Err(status) if status.code() == Code::ResourceExhausted => Err(MoveError::Failed(format!(
                "placement refused the target: {}",
                status.message()
            ))),
            Err(status) => Err(from_status("placement reserve", status)),
        }
    }

    /// Gives the target's reservation back (a rollback or an abandon); placement forgets it by
    /// itself later if this call is lost.
    pub(super) async fn release_target(&self, record: &MoveRecord) {
        let Some(placement) = &self.placement else { return };
        let released = placement
            .clone()
            .release(pl::SandboxRef {
                sandbox_id: record.sandbox_id.clone(),
                node_id: record.to_node.clone(),
                resources: None,
            })
            .await;
        if let Err(status) = released {
            tracing::debug!(sandbox_id = %record.sandbox_id, %status, "placement did not hear the reservation released; it expires");
        }
    }

    /// Owner := this move, epoch + 1, guarded by the manifest's version.
    pub(super) async fn take_epoch(
        &self,
        record: &MoveRecord,
        mut doc: Versioned<SandboxDoc>,
    ) -> Result<u64, MoveError> {
        doc.value.lifecycle_owner = Some(record.move_id.clone());
        doc.value.epoch += 1;
        let epoch = doc.value.epoch;
        self.save_manifest(&doc).await?;
        tracing::info!(sandbox_id = %record.sandbox_id, epoch, "lifecycle owned by the move");
        Ok(epoch)
    }

    /// Writes the manifest back at the version it was read. A lost reply is resolved by
    /// reading (a write that landed counts as done); one that stays unresolved is
    /// [`MoveError::Unknown`], which no caller rolls back on.
    pub(super) async fn save_manifest(&self, doc: &Versioned<SandboxDoc>) -> Result<(), MoveError> {
        let txn = Txn::new().update_read(doc, &doc.value).map_err(from_ledger)?;
        match self.ledger.compare_resolving(txn, RESOLVE_ATTEMPTS).await {
            Ok(_) => Ok(()),
            // Someone changed the manifest between read and write: read again next attempt
            // (each step's action starts by reading what is true).
            Err(LedgerError::Conflict { .. }) => Err(MoveError::Transient("manifest changed; retrying".into())),
            Err(err) => Err(from_ledger(err)),
        }
    }

    /// Pause, resume or kill on one node, under the move's epoch. Repeats are answered as
    /// done; a kill that finds nothing has nothing left to do.
    pub(super) async fn lifecycle(
        &self,
        (node_id, address): (&str, &str),
        record: &MoveRecord,
        action: NodeAction,
    ) -> Result<(), MoveError> {
        let mut node = self.nodes.get(node_id, address).await?;
        let request = node_pb::LifecycleRequest {
            operation_id: record.operation_id(action.name()),
            epoch: record.epoch,
            sandbox_id: record.sandbox_id.clone(),
        };
        let call = async {
            match action.call() {
                NodeCall::Pause => node.pause(request).await,
                NodeCall::Resume => node.resume(request).await,
                NodeCall::Kill => node.kill(request).await,
            }
        };
        // Under a deadline shorter than the lease: a node that never answers must not keep
        // this executor acting past it. Past the deadline the call may still land, which the
        // operation ID and the epoch make harmless.
        let deadline = self.call_deadline;
        let result = tokio::time::timeout(deadline, call).await.unwrap_or_else(|_| {
            Err(tonic::Status::deadline_exceeded(format!(
                "no answer within {deadline:?}"
            )))
        });
        match result {
            Ok(_) => Ok(()),
            Err(status) if status.code() == Code::NotFound => match action.when_missing() {
                WhenMissing::Done => Ok(()),
                WhenMissing::Gone => Err(MoveError::Gone(record.sandbox_id.clone())),
                WhenMissing::Failed => Err(from_status(&format!("{} on {address}", action.name()), status)),
            },
            Err(status) => Err(from_status(&format!("{} on {address}", action.name()), status)),
        }
    }

    /// Streams the paused source's snapshot straight into the target's restore: chunks are
    /// forwarded as they arrive, so reading, sending and unpacking overlap.
    pub(super) async fn copy(&self, record: &MoveRecord) -> Result<(), MoveError> {
        let mut source = self.nodes.get(&record.from_node, &record.from_address).await?;
        let mut target = self.nodes.get(&record.to_node, &record.to_address).await?;
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
    pub(super) async fn switch(&self, record: &MoveRecord) -> Result<(), MoveError> {
        let Some(mut doc) = self.manifest(record).await? else {
            return Err(MoveError::Gone(record.sandbox_id.clone()));
        };
        // A retry after a lost reply finds its own write: done, not failed.
        if decide::switched(record, &doc.value) {
            return Ok(());
        }
        if doc.value.lifecycle_owner.as_deref() != Some(record.move_id.as_str()) {
            return Err(MoveError::Failed("the move no longer owns the sandbox".into()));
        }
        let mut target = self.nodes.get(&record.to_node, &record.to_address).await?;
        let info = tokio::time::timeout(self.call_deadline, target.info(node_pb::InfoRequest {}))
            .await
            .map_err(|_| MoveError::Transient("target info: no answer".into()))?
            .map_err(|s| from_status("target info", s))?
            .into_inner();
        doc.value.node_id = record.to_node.clone();
        doc.value.node_address = record.to_address.clone();
        doc.value.envd_address = info.envd_address;
        doc.value.lifecycle_owner = None;
        doc.value.last_moved_unix_ms = Some(now_ms());
        self.save_manifest(&doc).await
    }

    /// Puts the sandbox back on the source. A target copy that may be running (its resume
    /// was sent, whatever the answer) must be confirmed gone before the source runs again:
    /// never two running copies, so while the target cannot confirm, the sandbox stays
    /// paused and owned by this move, and the rollback is tried again every cycle. A copy
    /// that can only be paused (the move failed before resuming it) is removed if the target
    /// answers, and otherwise left paused there for the orphan sweep, rather than keeping
    /// the sandbox down.
    ///
    /// Every attempt first takes a new epoch: calls of the failed attempt still in flight
    /// under the old one (a pause that was given up on, then delivered late) are refused once
    /// the nodes see the new one, and cannot freeze the source after it runs again. Returns
    /// the epoch the rollback acted under.
    pub(super) async fn roll_back(&self, record: &MoveRecord) -> Result<u64, MoveError> {
        let Some(doc) = self.manifest(record).await? else {
            return Err(MoveError::Gone(record.sandbox_id.clone()));
        };
        if doc.value.lifecycle_owner.as_deref() != Some(record.move_id.as_str()) {
            // Released already (its answer was lost), or taken over: nothing to undo here.
            return Ok(record.epoch);
        }
        let mut record = record.clone();
        record.epoch = self.take_epoch(&record, doc).await?;
        let record = &record;
        let target_may_run = record.target_may_run();
        match self.lifecycle(record.target(), record, NodeAction::UndoKill).await {
            Ok(()) => {}
            Err(err) if target_may_run => {
                tracing::warn!(sandbox_id = %record.sandbox_id, to = %record.to_node, %err,
                    "the target may run a copy and does not confirm it stopped; the source stays paused");
                return Err(match err {
                    MoveError::Fenced(_) | MoveError::Halted(_) => err,
                    other => MoveError::Transient(other.to_string()),
                });
            }
            Err(err) => {
                tracing::warn!(sandbox_id = %record.sandbox_id, to = %record.to_node, %err,
                    "target unreachable while rolling back; any copy there stays paused");
            }
        }
        self.lifecycle(record.source(), record, NodeAction::UndoResume).await?;
        self.release(record).await?;
        Ok(record.epoch)
    }

    /// Ends a rollback: clears ownership (the epoch stays, so older calls remain fenced) and
    /// starts the sandbox's cooldown, so the planner does not pick the same move at once.
    /// Also what rolling back a move that may have taken ownership without recording it does.
    pub(super) async fn release(&self, record: &MoveRecord) -> Result<(), MoveError> {
        let Some(mut doc) = self.manifest(record).await? else {
            return Err(MoveError::Gone(record.sandbox_id.clone()));
        };
        if doc.value.lifecycle_owner.as_deref() != Some(record.move_id.as_str()) {
            // Released already (a retry after a lost reply), or another owner took the sandbox
            // over under a newer epoch: either way nothing of this move holds it.
            if doc.value.lifecycle_owner.is_some() && !decide::released(record, &doc.value) {
                tracing::info!(sandbox_id = %record.sandbox_id, owner = ?doc.value.lifecycle_owner,
                    epoch = doc.value.epoch, "not this move's to release any more");
            }
            return Ok(());
        }
        doc.value.lifecycle_owner = None;
        doc.value.last_moved_unix_ms = Some(now_ms());
        self.save_manifest(&doc).await
    }

    /// The user killed the sandbox mid-move: remove whatever copy this move made or paused.
    pub(super) async fn abandon(&self, mut record: MoveRecord) -> Result<MoveRecord, MoveError> {
        tracing::warn!(sandbox_id = %record.sandbox_id, "sandbox deleted while moving; removing its copies");
        self.release_target(&record).await;
        // Never owned: the move touched nothing but the reservation.
        let copies = if record.epoch == 0 { 0 } else { 2 };
        for (node, action) in [
            (record.target(), NodeAction::AbandonKillTarget),
            (record.source(), NodeAction::AbandonKill),
        ]
        .into_iter()
        .take(copies)
        {
            // Gone, fenced by the user's kill, or refused: nothing of ours is left there.
            if let Err(err @ (MoveError::Transient(_) | MoveError::Halted(_))) =
                self.lifecycle(node, &record, action).await
            {
                return Err(err);
            }
        }
        record.step = Step::Abandoned;
        record.finished_at_unix_ms = Some(now_ms());
        Ok(record)
    }

    /// Placement confirms the target's reservation (the sandbox runs there; its heartbeat
    /// will list it) and subtracts the source's share until a heartbeat stops listing it.
    pub(super) async fn tell_placement(&self, record: &MoveRecord) {
        let Some(placement) = &self.placement else { return };
        let confirmed = placement
            .clone()
            .created(pl::SandboxRef {
                sandbox_id: record.sandbox_id.clone(),
                node_id: record.to_node.clone(),
                resources: None,
            })
            .await;
        if let Err(status) = confirmed {
            tracing::debug!(sandbox_id = %record.sandbox_id, %status, "placement did not hear of the arrival; a heartbeat corrects it");
        }
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
}
