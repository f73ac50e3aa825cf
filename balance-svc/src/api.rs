//! The gRPC face of balance-svc: status, plan history, drain, pause. Errors become statuses
//! in one place ([`status`]).

use std::sync::Arc;

use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use common::trace::TracedChannel;
use ledger_client::{LedgerClient, LedgerError, Txn};
use proto::balance::v1 as pb;
use proto::balance::v1::balance_server::Balance;
use proto::placement::v1 as pl;
use proto::placement::v1::placement_client::PlacementClient;
use tokio::sync::RwLock;
use tonic::{Request, Response, Status};

use crate::balancer::Known;
use crate::record::{ControlDoc, MoveRecord, PlanDoc, Step, CONTROL_ID, CONTROL_KIND, PLAN_KIND};

fn status(err: LedgerError) -> Status {
    match err {
        LedgerError::Unavailable(m) => Status::unavailable(format!("ledger unavailable: {m}")),
        LedgerError::OutcomeUnknown(m) => Status::unavailable(format!("ledger did not confirm the write: {m}")),
        LedgerError::Conflict { .. } => Status::aborted(format!("{err}; retry")),
        other => Status::internal(other.to_string()),
    }
}

pub struct BalanceApi {
    ledger: LedgerClient,
    placement: Option<PlacementClient<TracedChannel>>,
    known: Arc<RwLock<Known>>,
}

impl BalanceApi {
    pub fn new(
        ledger: LedgerClient,
        placement: Option<PlacementClient<TracedChannel>>,
        known: Arc<RwLock<Known>>,
    ) -> Self {
        Self {
            ledger,
            placement,
            known,
        }
    }

    /// Read-modify-write of the control document, retried on a concurrent change.
    async fn update_control(&self, change: impl Fn(&mut ControlDoc)) -> Result<ControlDoc, Status> {
        for _ in 0..5 {
            let current = self
                .ledger
                .get::<ControlDoc>(CONTROL_KIND, CONTROL_ID)
                .await
                .map_err(status)?;
            let mut doc = current.as_ref().map(|c| c.value.clone()).unwrap_or_default();
            change(&mut doc);
            let txn = match &current {
                Some(c) => Txn::new().update(CONTROL_KIND, CONTROL_ID, c.version, &doc),
                None => Txn::new().create(CONTROL_KIND, CONTROL_ID, &doc),
            }
            .map_err(status)?;
            match self.ledger.compare(txn).await {
                Ok(done) => {
                    let version = done
                        .versions
                        .first()
                        .copied()
                        .unwrap_or_else(|| current.as_ref().map_or(1, |c| c.version + 1));
                    self.known.write().await.note_control(version, &doc);
                    return Ok(doc);
                }
                Err(LedgerError::Conflict { .. }) => continue,
                Err(err) => return Err(status(err)),
            }
        }
        Err(Status::aborted("the control document kept changing; retry"))
    }

    async fn status_now(&self) -> pb::StatusResponse {
        let known = self.known.read().await.clone();
        let o = &known.observation;
        pb::StatusResponse {
            observation: Some(pb::Observation {
                status: o.status.clone(),
                spread: o.spread,
                ready_nodes: o.ready_nodes,
                observed_at_unix_ms: o.observed_at_unix_ms,
                counts: o.counts.clone().into_iter().collect(),
            }),
            paused: known.control.paused,
            active_plan_id: known.active_plan.unwrap_or_default(),
            draining_nodes: known.control.draining,
            leader: known.leader,
            stuck: known
                .stuck
                .iter()
                .map(|(id, s)| pb::StuckSandbox {
                    sandbox_id: id.clone(),
                    node_id: s.node_id.clone(),
                    failures: s.failed.count,
                    error: s.error.clone(),
                    retry_at_unix_ms: s.failed.retry_at_ms(),
                })
                .collect(),
        }
    }
}

fn move_view(m: &MoveRecord) -> pb::MoveView {
    pb::MoveView {
        move_id: m.move_id.clone(),
        sandbox_id: m.sandbox_id.clone(),
        from_node: m.from_node.clone(),
        to_node: m.to_node.clone(),
        memory_bytes: m.memory_bytes,
        step: m.step.name().to_string(),
        epoch: m.epoch,
        error: m.error.clone().unwrap_or_default(),
        downtime_ms: m.downtime_ms().unwrap_or(0),
    }
}

pub fn plan_view(p: &PlanDoc) -> pb::PlanView {
    pb::PlanView {
        plan_id: p.plan_id.clone(),
        state: if p.finished_at_unix_ms.is_some() {
            "Finished"
        } else {
            "Running"
        }
        .to_string(),
        reason: format!("{:?}", p.reason),
        spread_before: p.spread_before,
        spread_expected: p.spread_expected,
        created_at_unix_ms: p.created_at_unix_ms,
        finished_at_unix_ms: p.finished_at_unix_ms.unwrap_or(0),
        moves: p.moves.iter().map(move_view).collect(),
        skips: p.skips.clone().into_iter().collect(),
        drops: p
            .drops
            .iter()
            .map(|d| pb::DropView {
                sandbox_id: d.sandbox_id.clone(),
                from_node: d.from_node.clone(),
                memory_bytes: d.memory_bytes,
                asked_at_unix_ms: d.asked_at_unix_ms,
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl Balance for BalanceApi {
    async fn status(&self, _: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        Ok(Response::new(self.status_now().await))
    }

    async fn history(&self, request: Request<pb::HistoryRequest>) -> Result<Response<pb::HistoryResponse>, Status> {
        let limit = match request.into_inner().limit {
            0 => 20,
            n => n as usize,
        };
        let (plans, _) = self.ledger.list::<PlanDoc>(PLAN_KIND, "").await.map_err(status)?;
        let plans = plans.iter().rev().take(limit).map(|p| plan_view(&p.value)).collect();
        Ok(Response::new(pb::HistoryResponse { plans }))
    }

    async fn get_plan(&self, request: Request<pb::GetPlanRequest>) -> Result<Response<pb::PlanView>, Status> {
        let id = request.into_inner().plan_id;
        if id.is_empty() {
            return Err(Status::invalid_argument("plan_id is required"));
        }
        match self.ledger.get::<PlanDoc>(PLAN_KIND, &id).await.map_err(status)? {
            Some(p) => Ok(Response::new(plan_view(&p.value))),
            None => Err(Status::not_found(format!("no plan {id}"))),
        }
    }

    async fn release_target(
        &self,
        request: Request<pb::ReleaseTargetRequest>,
    ) -> Result<Response<pb::PlanView>, Status> {
        let req = request.into_inner();
        if req.plan_id.is_empty() {
            return Err(Status::invalid_argument("plan_id is required"));
        }
        let Some(mut plan) = self
            .ledger
            .get::<PlanDoc>(PLAN_KIND, &req.plan_id)
            .await
            .map_err(status)?
        else {
            return Err(Status::not_found(format!("no plan {}", req.plan_id)));
        };
        let index = req.move_index as usize;
        let Some(record) = plan.value.moves.get_mut(index) else {
            return Err(Status::not_found(format!("plan {} has no move {index}", req.plan_id)));
        };
        if record.step != Step::RollingBack || !record.target_may_run() {
            return Err(Status::failed_precondition(format!(
                "move {} is {} (failed at {:?}): it does not wait for its target",
                record.move_id,
                record.step.name(),
                record.failed_at
            )));
        }
        record.target_released = true;
        tracing::warn!(plan_id = %req.plan_id, move_id = %record.move_id, to = %record.to_node,
            "operator confirmed the target is gone; the rollback resumes the source without it");
        // The executor writes this document too; if it is acting now it is fenced by this
        // write and picks the move up again, with the release, in its next cycle.
        let txn = Txn::new()
            .update(PLAN_KIND, &req.plan_id, plan.version, &plan.value)
            .map_err(status)?;
        self.ledger.compare(txn).await.map_err(status)?;
        Ok(Response::new(plan_view(&plan.value)))
    }

    async fn drain(&self, request: Request<pb::DrainRequest>) -> Result<Response<pb::DrainResponse>, Status> {
        let req = request.into_inner();
        if req.node_id.is_empty() {
            return Err(Status::invalid_argument("node_id is required"));
        }
        // Placement first: no new sandbox may land on the node while it empties.
        if let Some(placement) = &self.placement {
            let state = if req.undo {
                pl::NodeState::Ready
            } else {
                pl::NodeState::Draining
            };
            placement
                .clone()
                .set_node_state(pl::SetNodeStateRequest {
                    node_id: req.node_id.clone(),
                    state: state as i32,
                })
                .await
                .map_err(|s| Status::new(s.code(), format!("placement: {}", s.message())))?;
        }
        let node = req.node_id.clone();
        let control = self
            .update_control(|c| {
                c.draining.retain(|n| *n != node);
                if !req.undo {
                    c.draining.push(node.clone());
                }
            })
            .await?;
        let (manifests, _) = self.ledger.list::<SandboxDoc>(SANDBOX_KIND, "").await.map_err(status)?;
        let remaining = manifests
            .iter()
            .filter(|m| m.value.node_id == req.node_id && m.value.phase == SandboxPhase::Running)
            .count() as u32;
        tracing::info!(node_id = %req.node_id, undo = req.undo, remaining, "drain set");
        Ok(Response::new(pb::DrainResponse {
            draining_nodes: control.draining,
            remaining_sandboxes: remaining,
        }))
    }

    async fn set_paused(&self, request: Request<pb::SetPausedRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let paused = request.into_inner().paused;
        self.update_control(|c| c.paused = paused).await?;
        tracing::info!(paused, "balancing {}", if paused { "paused" } else { "resumed" });
        Ok(Response::new(self.status_now().await))
    }
}
