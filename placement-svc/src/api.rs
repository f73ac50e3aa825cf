//! The gRPC face of placement: converts between the wire and the core, calls the store, and
//! maps every failure to a status in one place ([`ApiError`]).

use common::clock::now_ms;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use proto::placement::v1 as pb;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::core::{self, AdminState, NodeView, Resources};
use crate::node_docs::NodeDocs;
use crate::store::{NodeGauge, Placement, PlacementStore, StoreError};

/// Everything a placement call can fail with, and its status.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NoFit(String),
    /// Larger than any node, even empty: not "try again later".
    #[error("{0}")]
    NeverFits(String),
    /// The caller's certificate does not speak for the node it reports as.
    #[error("{0}")]
    NotThatNode(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<ApiError> for Status {
    fn from(err: ApiError) -> Self {
        let message = err.to_string();
        match err {
            ApiError::Invalid(_) => Status::invalid_argument(message),
            // E2B answers "no capacity" with RESOURCE_EXHAUSTED too.
            ApiError::NoFit(_) => Status::resource_exhausted(message),
            ApiError::NeverFits(_) => Status::out_of_range(message),
            ApiError::NotThatNode(_) => Status::permission_denied(message),
            ApiError::Store(StoreError::UnknownNode(_)) => Status::not_found(message),
            ApiError::Store(StoreError::Unavailable(_)) => Status::unavailable(message),
            ApiError::Store(StoreError::Internal(_)) => Status::internal(message),
        }
    }
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::Invalid(message.into())
}

fn resources_from_pb(r: Option<pb::Resources>) -> Resources {
    let r = r.unwrap_or_default();
    Resources {
        vcpus: r.vcpus,
        memory_bytes: r.memory_bytes,
    }
}

fn resources_to_pb(vcpus: i64, memory_bytes: i64) -> pb::Resources {
    pb::Resources {
        vcpus: u32::try_from(vcpus.max(0)).unwrap_or(u32::MAX),
        memory_bytes: u64::try_from(memory_bytes.max(0)).unwrap_or(0),
    }
}

fn request_from_pb(req: pb::PlaceRequest) -> Result<core::Request, ApiError> {
    if req.sandbox_id.is_empty() {
        // An empty ID would make every such reservation collide and flatter the accounting.
        return Err(invalid("sandbox_id must not be empty: reservations are keyed by it"));
    }
    let resources = resources_from_pb(req.resources);
    if resources.vcpus == 0 || resources.memory_bytes == 0 {
        return Err(invalid(format!(
            "resources must be positive (got {} vCPU, {} bytes): fill in the defaults before placing",
            resources.vcpus, resources.memory_bytes
        )));
    }
    Ok(core::Request {
        sandbox_id: req.sandbox_id,
        resources,
        selector: req.node_selector.into_iter().collect::<BTreeMap<_, _>>(),
        exclude: req.exclude_nodes.into_iter().collect::<HashSet<_>>(),
        only: (!req.only_node.is_empty()).then_some(req.only_node),
        template: req.template,
        reclaim_pooled: req.reclaim_pooled,
    })
}

/// The most template builds one heartbeat may say a node holds.
pub const MAX_TEMPLATES: usize = 1024;

fn heartbeat_from_pb(hb: pb::HeartbeatRequest) -> Result<core::Heartbeat, ApiError> {
    if hb.node_id.is_empty() || hb.boot_id.is_empty() {
        return Err(invalid("heartbeat needs node_id and boot_id"));
    }
    if hb.seq == 0 {
        return Err(invalid("heartbeat sequence numbers start at 1"));
    }
    let capacity = resources_from_pb(hb.capacity);
    if capacity.vcpus == 0 || capacity.memory_bytes == 0 {
        return Err(invalid(format!("node {} reports no capacity", hb.node_id)));
    }
    if hb.templates.len() > MAX_TEMPLATES || hb.templates.iter().any(|t| t.len() > 128 || t.contains(',')) {
        return Err(invalid(format!(
            "node {} reports more than {MAX_TEMPLATES} templates, or an ID longer than 128 bytes or with a comma",
            hb.node_id
        )));
    }
    let allocated = resources_from_pb(hb.allocated);
    let pooled = resources_from_pb(hb.pooled);
    // Part of what the node allocated, never more: room a create may reclaim is room it has.
    let pooled = core::Resources {
        vcpus: pooled.vcpus.min(allocated.vcpus),
        memory_bytes: pooled.memory_bytes.min(allocated.memory_bytes),
    };
    Ok(core::Heartbeat {
        node_id: hb.node_id,
        boot_id: hb.boot_id,
        seq: hb.seq,
        address: hb.address,
        labels: hb.labels.into_iter().collect(),
        capacity,
        allocated,
        pooled,
        memory_used_bytes: hb.memory_used_bytes,
        cpu_usage: hb.cpu_usage,
        sandboxes: hb
            .sandboxes
            .into_iter()
            .map(|s| core::Listed {
                sandbox_id: s.sandbox_id,
                allocated: resources_from_pb(s.allocated),
                memory_used_bytes: s.memory_used_bytes,
            })
            .collect(),
        templates: hb.templates,
    })
}

/// The state an operator sees: draining wins, then health.
pub fn node_state(view: &NodeView, now_ms: u64, unhealthy_after_ms: u64) -> pb::NodeState {
    if view.admin == AdminState::Draining {
        pb::NodeState::Draining
    } else if view.seq == 0 || now_ms.saturating_sub(view.last_heartbeat_ms) > unhealthy_after_ms {
        pb::NodeState::Unhealthy
    } else {
        pb::NodeState::Ready
    }
}

fn view_to_pb(view: &NodeView, now_ms: u64, unhealthy_after_ms: u64) -> pb::NodeView {
    let (reserved, removing, believed) = (view.reserved(), view.removing(), view.believed());
    pb::NodeView {
        node_id: view.node_id.clone(),
        address: view.address.clone(),
        state: node_state(view, now_ms, unhealthy_after_ms) as i32,
        labels: view.labels.clone().into_iter().collect(),
        capacity: Some(pb::Resources {
            vcpus: view.capacity.vcpus,
            memory_bytes: view.capacity.memory_bytes,
        }),
        boot_id: view.boot_id.clone(),
        seq: view.seq,
        heartbeat_age_ms: now_ms.saturating_sub(view.last_heartbeat_ms),
        reported: Some(resources_to_pb(view.reported.vcpus, view.reported.memory_bytes)),
        reported_sandboxes: view.reported_sandboxes,
        memory_used_bytes: view.memory_used_bytes,
        reserved: Some(resources_to_pb(reserved.vcpus, reserved.memory_bytes)),
        pending: view.pending(),
        unconfirmed: view.unconfirmed(),
        removing: Some(resources_to_pb(removing.vcpus, removing.memory_bytes)),
        believed: Some(resources_to_pb(believed.vcpus, believed.memory_bytes)),
        cpu_usage: view.cpu_usage,
        pooled: Some(pb::Resources {
            vcpus: view.pooled.vcpus,
            memory_bytes: view.pooled.memory_bytes,
        }),
    }
}

/// The decision's candidates as one attribute: `node=score` for each feasible node looked at,
/// `node!reason` for each filtered out, in the order looked at.
fn candidates(evaluated: &[core::Evaluation]) -> String {
    evaluated
        .iter()
        .map(|e| match &e.rejected {
            None => format!("{}={:.4}", e.node_id, e.score),
            Some(why) => format!("{}!{why}", e.node_id),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Reservation and heartbeat-age gauges of every node.
pub fn publish_gauges(nodes: &[NodeGauge], now: u64) {
    for v in nodes {
        let node = v.node_id.clone();
        metrics::gauge!("placement_reservations", "node" => node.clone(), "state" => "pending")
            .set(f64::from(v.pending));
        metrics::gauge!("placement_reservations", "node" => node.clone(), "state" => "unconfirmed")
            .set(f64::from(v.unconfirmed));
        metrics::gauge!("placement_heartbeat_age_seconds", "node" => node)
            .set(now.saturating_sub(v.last_heartbeat_ms) as f64 / 1000.0);
    }
}

/// The `Placement` gRPC service over any store.
pub struct PlacementApi<S> {
    store: Arc<S>,
    unhealthy_after_ms: u64,
    node_docs: Option<NodeDocs>,
    /// Take a heartbeat only from a certificate that speaks for its node ID (under mutual
    /// TLS: a node's heartbeat sets the address the gateway sends that node's sandboxes'
    /// tokens to, so one node reporting in another's name would draw them to itself).
    node_identity: bool,
}

impl<S: PlacementStore> PlacementApi<S> {
    pub fn new(store: Arc<S>, unhealthy_after_ms: u64, node_docs: Option<NodeDocs>) -> Self {
        Self {
            store,
            unhealthy_after_ms,
            node_docs,
            node_identity: false,
        }
    }

    /// Every heartbeat must come from its own node's certificate.
    pub fn with_node_identity(mut self, required: bool) -> Self {
        self.node_identity = required;
        self
    }
}

/// Refuses a heartbeat whose caller's certificate does not name its node ID.
fn check_reporter<T>(request: &Request<T>, node_id: &str) -> Result<(), ApiError> {
    let certs = request.peer_certs();
    if certs.is_some_and(|certs| mtls::speaks_for_node(&certs, node_id)) {
        return Ok(());
    }
    Err(ApiError::NotThatNode(format!(
        "this certificate does not speak for node {node_id:?}: a node reports only in its own name"
    )))
}

fn sandbox_ref(r: &pb::SandboxRef) -> Result<(), ApiError> {
    if r.sandbox_id.is_empty() || r.node_id.is_empty() {
        return Err(invalid("sandbox_id and node_id are required"));
    }
    Ok(())
}

#[tonic::async_trait]
impl<S: PlacementStore> pb::placement_server::Placement for PlacementApi<S> {
    async fn place(&self, request: Request<pb::PlaceRequest>) -> Result<Response<pb::PlaceResponse>, Status> {
        let req = request_from_pb(request.into_inner())?;
        let span = tracing::info_span!(
            "placement.decide",
            sandbox_id = %req.sandbox_id,
            vcpus = req.resources.vcpus,
            memory_bytes = req.resources.memory_bytes,
            excluded = req.exclude.len(),
            node_id = tracing::field::Empty,
            score = tracing::field::Empty,
            candidates = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let started = std::time::Instant::now();
        let placed = self.store.place(&req, now_ms()).instrument(span.clone()).await;
        metrics::histogram!("placement_place_duration_seconds").record(started.elapsed().as_secs_f64());
        let outcome = match &placed {
            Ok(Placement::Placed { .. }) => "placed",
            Ok(Placement::NoFit { .. }) => "no_fit",
            Err(_) => "error",
        };
        metrics::counter!("placement_places_total", "outcome" => outcome).increment(1);
        span.record("outcome", outcome);
        if let Ok(Placement::Placed {
            node_id,
            score,
            evaluated,
            ..
        }) = &placed
        {
            span.record("node_id", node_id.as_str());
            span.record("score", *score);
            span.record("candidates", candidates(evaluated).as_str());
        }
        match placed.map_err(ApiError::from)? {
            Placement::Placed {
                node_id,
                address,
                score,
                reclaim,
                ..
            } => {
                tracing::debug!(%node_id, score, reclaim_bytes = reclaim.memory_bytes, "placed");
                Ok(Response::new(pb::PlaceResponse {
                    node_id,
                    node_address: address,
                    score,
                    reclaim: Some(pb::Resources {
                        vcpus: reclaim.vcpus,
                        memory_bytes: reclaim.memory_bytes,
                    }),
                }))
            }
            Placement::NoFit { reason, never: true } => {
                tracing::info!(%reason, "nothing could ever fit");
                Err(ApiError::NeverFits(reason).into())
            }
            Placement::NoFit { reason, never: false } => {
                tracing::info!(%reason, "nothing fits");
                Err(ApiError::NoFit(reason).into())
            }
        }
    }

    async fn created(&self, request: Request<pb::SandboxRef>) -> Result<Response<pb::Ack>, Status> {
        let r = request.into_inner();
        sandbox_ref(&r)?;
        self.store
            .created(&r.node_id, &r.sandbox_id)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(pb::Ack {}))
    }

    async fn release(&self, request: Request<pb::SandboxRef>) -> Result<Response<pb::Ack>, Status> {
        let r = request.into_inner();
        sandbox_ref(&r)?;
        self.store
            .release(&r.node_id, &r.sandbox_id)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(pb::Ack {}))
    }

    async fn removed(&self, request: Request<pb::SandboxRef>) -> Result<Response<pb::Ack>, Status> {
        let r = request.into_inner();
        sandbox_ref(&r)?;
        let held = resources_from_pb(r.resources);
        self.store
            .removed(&r.node_id, &r.sandbox_id, held)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(pb::Ack {}))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        if self.node_identity {
            check_reporter(&request, &request.get_ref().node_id)?;
        }
        let mut raw = request.into_inner();
        let memory_available = raw.memory_available_bytes;
        // Kept bounded: a node's own words, published in its document as they are.
        let degraded: Vec<String> = std::mem::take(&mut raw.degraded)
            .into_iter()
            .take(common::docs::MAX_DEGRADED)
            .map(|reason| reason.chars().take(common::docs::MAX_DEGRADED_LEN).collect())
            .collect();
        let hb = heartbeat_from_pb(raw)?;
        let received = now_ms();
        let outcome = self.store.heartbeat(&hb, received).await.map_err(ApiError::from)?;
        metrics::counter!("placement_heartbeats_total", "applied" => if outcome.applied { "true" } else { "false" })
            .increment(1);
        metrics::gauge!("placement_node_last_heartbeat_timestamp_seconds", "node" => hb.node_id.clone())
            .set(received as f64 / 1000.0);
        if outcome.applied {
            // Each node's memory as its last heartbeat said: what dashboards draw per node.
            let memory = [
                ("capacity", hb.capacity.memory_bytes),
                ("allocated", hb.allocated.memory_bytes),
                ("pooled", hb.pooled.memory_bytes),
                ("used", hb.memory_used_bytes),
                ("available", memory_available),
            ];
            for (kind, bytes) in memory {
                metrics::gauge!("placement_node_memory_bytes", "node" => hb.node_id.clone(), "kind" => kind)
                    .set(bytes as f64);
            }
            metrics::gauge!("placement_node_sandboxes", "node" => hb.node_id.clone()).set(hb.sandboxes.len() as f64);
        }
        let corrections = [
            ("confirmed", u64::from(outcome.confirmed)),
            ("removed", u64::from(outcome.removed)),
            ("expired", outcome.expired.len() as u64),
        ];
        for (kind, n) in corrections {
            if n > 0 {
                metrics::counter!("placement_accounting_corrections_total", "kind" => kind).increment(n);
            }
        }
        if outcome.rebooted {
            tracing::info!(node_id = %hb.node_id, boot_id = %hb.boot_id, "node restarted; its view was reset");
        }
        for sandbox_id in &outcome.expired {
            tracing::warn!(node_id = %hb.node_id, %sandbox_id, "reservation dropped: no heartbeat listed its sandbox in time (unconfirmed), or nothing said how its work ended (pending)");
        }
        if outcome.applied {
            if let Some(docs) = &self.node_docs {
                docs.offer(&hb, outcome.draining, memory_available, degraded, received);
            }
        }
        Ok(Response::new(pb::HeartbeatResponse {
            applied: outcome.applied,
            reason: outcome.reason.unwrap_or_default(),
        }))
    }

    async fn nodes(&self, _: Request<pb::NodesRequest>) -> Result<Response<pb::NodesResponse>, Status> {
        let now = now_ms();
        let mut nodes = self.store.nodes().await.map_err(ApiError::from)?;
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        Ok(Response::new(pb::NodesResponse {
            nodes: nodes
                .iter()
                .map(|v| view_to_pb(v, now, self.unhealthy_after_ms))
                .collect(),
        }))
    }

    async fn explain(&self, request: Request<pb::PlaceRequest>) -> Result<Response<pb::ExplainResponse>, Status> {
        let req = request_from_pb(request.into_inner())?;
        let explanation = self.store.explain(&req, now_ms()).await.map_err(ApiError::from)?;
        let chosen = explanation.chosen.clone().unwrap_or_default();
        let candidates = explanation
            .evaluated
            .into_iter()
            .map(|e| {
                let feasible = e.rejected.is_none();
                let reason = match (&e.rejected, e.node_id == chosen) {
                    (Some(why), _) => why.clone(),
                    (None, true) => "chosen: lowest score".to_string(),
                    (None, false) => "feasible, higher score".to_string(),
                };
                pb::Candidate {
                    node_id: e.node_id,
                    feasible,
                    reason,
                    score: e.score,
                    terms: e.terms.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                }
            })
            .collect();
        Ok(Response::new(pb::ExplainResponse { candidates, chosen }))
    }

    async fn set_node_state(
        &self,
        request: Request<pb::SetNodeStateRequest>,
    ) -> Result<Response<pb::NodeView>, Status> {
        let req = request.into_inner();
        let admin = match pb::NodeState::try_from(req.state) {
            Ok(pb::NodeState::Ready) => AdminState::Ready,
            Ok(pb::NodeState::Draining) => AdminState::Draining,
            _ => return Err(invalid("state must be READY or DRAINING").into()),
        };
        let view = self
            .store
            .set_admin(&req.node_id, admin)
            .await
            .map_err(ApiError::from)?;
        if let Some(docs) = &self.node_docs {
            docs.refresh(&req.node_id);
        }
        tracing::info!(node_id = %req.node_id, ?admin, "node state set");
        Ok(Response::new(view_to_pb(&view, now_ms(), self.unhealthy_after_ms)))
    }
}
