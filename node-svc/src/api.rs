//! The gRPC face of a node: converts between the wire and the host, and maps every failure to
//! a status in one place ([`status`]).

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use proto::node::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use proto::reason::Reason;

use crate::host::{CreateSpec, Host, NodeError};
use crate::sandbox::{Move, Refusal, Resources, SandboxRecord, State};
use crate::snapshot::{RestoreItem, SnapshotPart};

/// The one mapping from node errors to gRPC statuses.
pub fn status(err: NodeError) -> Status {
    let message = err.to_string();
    match err {
        NodeError::Invalid(_) | NodeError::OperationReused { .. } => Status::invalid_argument(message),
        NodeError::NotFound(_) | NodeError::UnknownTemplate(_) => Status::not_found(message),
        NodeError::AlreadyExists(_) => Status::already_exists(message),
        NodeError::Refused(Refusal::StaleEpoch { .. }) => Reason::StaleEpoch.mark(Status::failed_precondition(message)),
        NodeError::Refused(Refusal::IllegalMove { .. }) => {
            Reason::IllegalMove.mark(Status::failed_precondition(message))
        }
        NodeError::Corrupt(_) => Status::data_loss(message),
        NodeError::NoRoom(_) => Status::resource_exhausted(message),
        NodeError::Runtime(_) | NodeError::Io(_) => Status::internal(message),
    }
}

/// A create's network policy, checked again here: the node enforces only what it can read.
fn network_from_pb(network: pb::NetworkPolicy) -> Result<common::egress::NetworkPolicy, NodeError> {
    common::egress::NetworkPolicy::from_request(
        Some(network.internet),
        Some(&network.allow_out),
        Some(&network.deny_out),
    )
    .map_err(|e| NodeError::Invalid(e.to_string()))
}

fn state_to_pb(state: State) -> pb::SandboxState {
    match state {
        State::Running => pb::SandboxState::Running,
        State::Paused => pb::SandboxState::Paused,
        State::Killed => pb::SandboxState::Killed,
    }
}

pub fn info_to_pb(record: &SandboxRecord, memory_used_bytes: u64) -> pb::SandboxInfo {
    pb::SandboxInfo {
        sandbox_id: record.id.clone(),
        state: state_to_pb(record.state) as i32,
        template: record.template.clone(),
        resources: Some(pb::Resources {
            vcpus: record.resources.vcpus,
            memory_bytes: record.resources.memory_bytes,
            disk_bytes: record.resources.disk_bytes,
        }),
        epoch: record.epoch,
        memory_used_bytes,
        pgid: record.pgid,
        created_at_unix_ms: record.created_at_unix_ms,
        metadata: record.metadata.clone().into_iter().collect(),
        pooled: record.pooled,
    }
}

/// The `Node` gRPC service.
pub struct NodeApi {
    host: Arc<Host>,
    envd_address: String,
}

impl NodeApi {
    pub fn new(host: Arc<Host>, envd_address: String) -> Self {
        Self { host, envd_address }
    }

    async fn lifecycle(&self, req: pb::LifecycleRequest, action: Move) -> Result<Response<pb::SandboxInfo>, Status> {
        let span = tracing::info_span!("lifecycle", sandbox_id = %req.sandbox_id, ?action, epoch = req.epoch);
        let started = std::time::Instant::now();
        let result = self
            .host
            .lifecycle(&req.operation_id, req.epoch, &req.sandbox_id, action)
            .instrument(span)
            .await;
        let op = match action {
            Move::Pause => "pause",
            Move::Resume => "resume",
            Move::Kill => "kill",
        };
        metrics::histogram!("node_lifecycle_duration_seconds", "op" => op).record(started.elapsed().as_secs_f64());
        let record = result.map_err(status)?;
        Ok(Response::new(info_to_pb(&record, 0)))
    }
}

type SnapshotStream = Pin<Box<dyn Stream<Item = Result<pb::SnapshotChunk, Status>> + Send>>;
type BuildStream = Pin<Box<dyn Stream<Item = Result<pb::BuildEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::node_server::Node for NodeApi {
    async fn create(&self, request: Request<pb::CreateRequest>) -> Result<Response<pb::SandboxInfo>, Status> {
        let req = request.into_inner();
        let span = tracing::info_span!("create", sandbox_id = %req.sandbox_id, template = %req.template);
        let resources = req.resources.unwrap_or_default();
        let network = req.network.map(network_from_pb).transpose().map_err(status)?;
        let spec = CreateSpec {
            operation_id: req.operation_id,
            epoch: req.epoch,
            sandbox_id: req.sandbox_id,
            template: req.template,
            resources: Resources {
                vcpus: resources.vcpus,
                memory_bytes: resources.memory_bytes,
                disk_bytes: resources.disk_bytes,
            },
            env: req.env_vars.into_iter().collect::<BTreeMap<_, _>>(),
            metadata: req.metadata.into_iter().collect::<BTreeMap<_, _>>(),
            start_command: Some(req.start_command).filter(|c| !c.is_empty()),
            access_token: Some(req.access_token).filter(|t| !t.is_empty()),
            network,
            traffic_access_token: Some(req.traffic_access_token).filter(|t| !t.is_empty()),
            image: req.image.map(common::template::Image::from),
            pooled: req.pooled,
        };
        let started = std::time::Instant::now();
        let result = self.host.create(spec).instrument(span).await;
        metrics::histogram!("node_lifecycle_duration_seconds", "op" => "create")
            .record(started.elapsed().as_secs_f64());
        let record = result.map_err(status)?;
        Ok(Response::new(info_to_pb(&record, 0)))
    }

    async fn update_network(
        &self,
        request: Request<pb::NetworkUpdateRequest>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let req = request.into_inner();
        let policy = network_from_pb(req.network.unwrap_or_default()).map_err(status)?;
        let span = tracing::info_span!("update_network", sandbox_id = %req.sandbox_id);
        let record = self
            .host
            .update_network(&req.operation_id, req.epoch, &req.sandbox_id, policy)
            .instrument(span)
            .await
            .map_err(status)?;
        Ok(Response::new(info_to_pb(&record, 0)))
    }

    async fn claim(&self, request: Request<pb::ClaimRequest>) -> Result<Response<pb::SandboxInfo>, Status> {
        let req = request.into_inner();
        let span = tracing::info_span!("claim", sandbox_id = %req.sandbox_id);
        let claim = crate::host::Claim {
            env: req.env_vars.into_iter().collect(),
            metadata: req.metadata.into_iter().collect(),
            access_token: Some(req.access_token),
            traffic_access_token: Some(req.traffic_access_token),
        };
        let record = self
            .host
            .claim(&req.operation_id, req.epoch, &req.sandbox_id, claim)
            .instrument(span)
            .await
            .map_err(status)?;
        Ok(Response::new(info_to_pb(&record, 0)))
    }

    async fn metrics(&self, request: Request<pb::MetricsRequest>) -> Result<Response<pb::MetricsResponse>, Status> {
        let req = request.into_inner();
        let end = if req.end_unix_ms == 0 {
            u64::MAX
        } else {
            req.end_unix_ms
        };
        let samples = self
            .host
            .metrics(&req.sandbox_id, req.start_unix_ms, end)
            .into_iter()
            .map(|s| pb::MetricsSample {
                at_unix_ms: s.at_unix_ms,
                cpu_used_pct: s.cpu_used_pct,
                vcpus: s.vcpus,
                memory_used_bytes: s.memory_used_bytes,
                memory_total_bytes: s.memory_total_bytes,
                disk_used_bytes: s.disk_used_bytes,
                disk_total_bytes: s.disk_total_bytes,
            })
            .collect();
        Ok(Response::new(pb::MetricsResponse { samples }))
    }

    async fn logs(&self, request: Request<pb::LogsRequest>) -> Result<Response<pb::LogsResponse>, Status> {
        let req = request.into_inner();
        let query = crate::logs::Query {
            cursor_ms: (req.cursor_unix_ms != 0).then_some(req.cursor_unix_ms),
            limit: req.limit.clamp(1, 1000) as usize,
            backward: req.backward,
            level: Some(req.level).filter(|l| !l.is_empty()),
            search: Some(req.search).filter(|s| !s.is_empty()),
        };
        let entries = self
            .host
            .logs(&req.sandbox_id, query)
            .await
            .into_iter()
            .map(|e| pb::LogEntry {
                at_unix_ms: e.at_unix_ms,
                level: e.level,
                message: e.message,
                fields: e.fields.into_iter().collect(),
            })
            .collect();
        Ok(Response::new(pb::LogsResponse { entries }))
    }

    async fn kill(&self, request: Request<pb::LifecycleRequest>) -> Result<Response<pb::SandboxInfo>, Status> {
        self.lifecycle(request.into_inner(), Move::Kill).await
    }

    async fn pause(&self, request: Request<pb::LifecycleRequest>) -> Result<Response<pb::SandboxInfo>, Status> {
        self.lifecycle(request.into_inner(), Move::Pause).await
    }

    async fn resume(&self, request: Request<pb::LifecycleRequest>) -> Result<Response<pb::SandboxInfo>, Status> {
        self.lifecycle(request.into_inner(), Move::Resume).await
    }

    type SnapshotStream = SnapshotStream;
    type BuildStream = BuildStream;

    async fn capture(&self, request: Request<pb::LifecycleRequest>) -> Result<Response<pb::TemplateImage>, Status> {
        let req = request.into_inner();
        let span = tracing::info_span!("capture", sandbox_id = %req.sandbox_id);
        let image = self
            .host
            .capture(req.epoch, &req.sandbox_id)
            .instrument(span)
            .await
            .map_err(status)?;
        Ok(Response::new((&image).into()))
    }

    async fn build(&self, request: Request<pb::BuildRequest>) -> Result<Response<BuildStream>, Status> {
        let req = request.into_inner();
        if req.build_id.is_empty() {
            return Err(Status::invalid_argument("build_id is required"));
        }
        let span = tracing::info_span!("build", build_id = %req.build_id);
        let (tx, rx) = mpsc::channel(4096);
        let host = self.host.clone();
        tokio::spawn(crate::build::run(host, req, tx).instrument(span));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn snapshot(&self, request: Request<pb::LifecycleRequest>) -> Result<Response<SnapshotStream>, Status> {
        let req = request.into_inner();
        let (record, hold) = self
            .host
            .snapshot_source(req.epoch, &req.sandbox_id)
            .await
            .map_err(status)?;
        let description = serde_json::to_string(&record).map_err(|e| Status::internal(e.to_string()))?;
        let header = pb::SnapshotChunk {
            part: Some(pb::snapshot_chunk::Part::Header(pb::SnapshotHeader {
                sandbox_id: record.id.clone(),
                description_json: description,
            })),
        };
        let parts = ReceiverStream::new(self.host.snapshot_stream(&record.id, hold)).map(|part| match part {
            Ok(SnapshotPart::Data(data)) => Ok(pb::SnapshotChunk {
                part: Some(pb::snapshot_chunk::Part::Data(data)),
            }),
            Ok(SnapshotPart::End { sha256, bytes }) => Ok(pb::SnapshotChunk {
                part: Some(pb::snapshot_chunk::Part::Trailer(pb::SnapshotTrailer { sha256, bytes })),
            }),
            Err(err) => Err(status(err.into())),
        });
        let stream = tokio_stream::once(Ok(header)).chain(parts);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn restore(
        &self,
        request: Request<Streaming<pb::RestoreChunk>>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let mut incoming = request.into_inner();
        let header = match incoming.message().await? {
            Some(pb::RestoreChunk {
                part: Some(pb::restore_chunk::Part::Header(header)),
            }) => header,
            _ => return Err(Status::invalid_argument("a restore stream starts with its header")),
        };
        let snapshot = header
            .snapshot
            .ok_or_else(|| Status::invalid_argument("the restore header carries no snapshot header"))?;
        let record: SandboxRecord = serde_json::from_str(&snapshot.description_json)
            .map_err(|e| Status::invalid_argument(format!("bad sandbox description: {e}")))?;
        if record.id != snapshot.sandbox_id {
            return Err(Status::invalid_argument(
                "description and header name different sandboxes",
            ));
        }
        let (tx, rx) = mpsc::channel(8);
        let forward = tokio::spawn(async move {
            while let Some(chunk) = incoming.message().await? {
                let item = match chunk.part {
                    Some(pb::restore_chunk::Part::Data(data)) => RestoreItem::Data(data),
                    Some(pb::restore_chunk::Part::Trailer(t)) => RestoreItem::Trailer {
                        sha256: t.sha256,
                        bytes: t.bytes,
                    },
                    _ => {
                        return Err(Status::invalid_argument(
                            "only data and a trailer may follow the header",
                        ))
                    }
                };
                if tx.send(item).await.is_err() {
                    break;
                }
            }
            Ok(())
        });
        let restored = self
            .host
            .restore(&header.operation_id, header.epoch, record, rx)
            .await
            .map_err(status);
        forward.abort();
        Ok(Response::new(info_to_pb(&restored?, 0)))
    }

    async fn list(&self, _: Request<pb::ListRequest>) -> Result<Response<pb::ListResponse>, Status> {
        let sandboxes = self
            .host
            .list()
            .await
            .iter()
            .map(|(record, used)| info_to_pb(record, *used))
            .collect();
        Ok(Response::new(pb::ListResponse { sandboxes }))
    }

    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::NodeInfo>, Status> {
        let picture = self.host.picture().await;
        let features = self.host.features();
        let capacity = self.host.capacity();
        Ok(Response::new(pb::NodeInfo {
            node_id: self.host.node_id().to_string(),
            boot_id: self.host.boot_id().to_string(),
            runtime: self.host.runtime_kind().to_string(),
            capacity: Some(pb::Resources {
                vcpus: capacity.vcpus,
                memory_bytes: capacity.memory_bytes,
                disk_bytes: 0,
            }),
            memory_used_bytes: picture.memory_used_bytes,
            memory_available_bytes: picture.memory_available_bytes,
            sandboxes: u32::try_from(picture.sandboxes.len()).unwrap_or(u32::MAX),
            cgroup_memory: features.cgroup_memory,
            freezer: features.freezer,
            namespaces: features.namespaces,
            degraded: features.degraded,
            envd_address: self.envd_address.clone(),
        }))
    }
}
