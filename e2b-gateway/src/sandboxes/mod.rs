//! Driving sandboxes through their lives across ledger, placement and nodes, undoing every
//! step of a create that fails (no manifest, reservation or process left behind).

use common::clock::now_ms;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use common::trace::TracedChannel;
use ledger_client::{LedgerClient, LedgerError, Txn, Versioned};
use proto::node::v1 as node_pb;
use proto::node::v1::node_client::NodeClient;
use proto::placement::v1 as pl;
use proto::placement::v1::placement_client::PlacementClient;
use tokio::sync::Mutex;
use tonic::transport::Endpoint;
use tonic::Code;

use crate::intent::CreateIntent;

/// Attempts on different nodes before a create gives up.
const CREATE_ATTEMPTS: usize = 3;
/// How long a lifecycle call waits for a balancer move of its sandbox to finish.
const WAIT_FOR_MOVE: Duration = Duration::from_secs(15);

/// Why a sandbox operation failed, in terms the REST layer maps to E2B's statuses.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NoCapacity(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl From<LedgerError> for Failure {
    fn from(err: LedgerError) -> Self {
        match err {
            LedgerError::Unavailable(m) => Failure::Unavailable(format!("ledger unavailable: {m}")),
            other => Failure::Internal(other.to_string()),
        }
    }
}

fn from_status(what: &str, status: tonic::Status) -> Failure {
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => {
            Failure::Unavailable(format!("{what}: {}", status.message()))
        }
        Code::ResourceExhausted => Failure::NoCapacity(status.message().to_string()),
        Code::NotFound => Failure::NotFound(status.message().to_string()),
        Code::FailedPrecondition | Code::AlreadyExists => Failure::Conflict(status.message().to_string()),
        _ => Failure::Internal(format!("{what}: {}", status.message())),
    }
}

fn random_id(len: usize) -> String {
    let raw = uuid::Uuid::new_v4().simple().to_string() + &uuid::Uuid::new_v4().simple().to_string();
    raw.chars().take(len).collect()
}

/// A node's channel, and its envd address once asked.
type NodeEntry = (NodeClient<TracedChannel>, Option<String>);

/// Channels to nodes, and their envd addresses, by node gRPC address.
#[derive(Default)]
struct Nodes {
    clients: Mutex<HashMap<String, NodeEntry>>,
}

impl Nodes {
    async fn client(&self, address: &str) -> Result<NodeClient<TracedChannel>, Failure> {
        let mut map = self.clients.lock().await;
        if let Some((c, _)) = map.get(address) {
            return Ok(c.clone());
        }
        let channel = Endpoint::from_shared(address.to_string())
            .map_err(|e| Failure::Internal(format!("bad node address {address:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            // Hibernation streams whole snapshots: HTTP/2's default 64 KiB window stalls them.
            .initial_stream_window_size(Some(8 << 20))
            .initial_connection_window_size(Some(16 << 20))
            .connect_lazy();
        let client = NodeClient::new(common::trace::traced(channel));
        map.insert(address.to_string(), (client.clone(), None));
        Ok(client)
    }

    async fn envd(&self, address: &str) -> Result<String, Failure> {
        if let Some((_, Some(envd))) = self.clients.lock().await.get(address) {
            return Ok(envd.clone());
        }
        let mut client = self.client(address).await?;
        let info = client
            .info(node_pb::InfoRequest {})
            .await
            .map_err(|s| from_status("node info", s))?
            .into_inner();
        if let Some(entry) = self.clients.lock().await.get_mut(address) {
            entry.1 = Some(info.envd_address.clone());
        }
        Ok(info.envd_address)
    }
}

/// The gateway's view of sandboxes: the ledger is the truth, placement and nodes do the work.
pub struct Sandboxes {
    pub ledger: LedgerClient,
    /// Where hibernated sandboxes' files wait (pause with `memory: false`).
    hibernate_dir: std::path::PathBuf,
    /// The proxy's routing table: this gateway's own changes apply to it at once.
    pub routes: crate::proxy::Routes,
    placement: PlacementClient<TracedChannel>,
    nodes: Nodes,
}

impl Sandboxes {
    pub fn new(
        ledger: LedgerClient,
        placement_endpoint: &str,
        hibernate_dir: std::path::PathBuf,
    ) -> Result<Arc<Self>, Failure> {
        let channel = Endpoint::from_shared(placement_endpoint.to_string())
            .map_err(|e| Failure::Internal(format!("bad placement address: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();
        Ok(Arc::new(Self {
            ledger,
            hibernate_dir,
            routes: crate::proxy::Routes::default(),
            placement: PlacementClient::new(common::trace::traced(channel)),
            nodes: Nodes::default(),
        }))
    }

    /// A sandbox's manifest, if `team` owns it (another team's sandbox does not exist for it).
    pub async fn get(&self, team: &str, id: &str) -> Result<Versioned<SandboxDoc>, Failure> {
        match self.ledger.get::<SandboxDoc>(SANDBOX_KIND, id).await? {
            Some(doc) if doc.value.team_id == team => Ok(doc),
            _ => Err(Failure::NotFound(id.to_string())),
        }
    }

    /// The manifest once no move owns the sandbox's lifecycle: a balancer move holds it for
    /// the seconds a migration takes, and a kill, pause or resume waits for it rather than
    /// racing it (the move's fencing epoch would refuse the race anyway). It reads again on
    /// each change the routing table's ledger watch sees, not on a timer.
    pub async fn get_settled(&self, team: &str, id: &str) -> Result<Versioned<SandboxDoc>, Failure> {
        let deadline = tokio::time::Instant::now() + WAIT_FOR_MOVE;
        loop {
            let changed = self.routes.changed();
            let doc = self.get(team, id).await?;
            let Some(owner) = &doc.value.lifecycle_owner else {
                return Ok(doc);
            };
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(Failure::Conflict(format!(
                    "sandbox {id} is being moved ({owner}); retry in a few seconds"
                )));
            }
        }
    }

    /// Every manifest (all teams).
    pub async fn all(&self) -> Result<Vec<Versioned<SandboxDoc>>, Failure> {
        Ok(self.ledger.list::<SandboxDoc>(SANDBOX_KIND, "").await?.0)
    }

    async fn save(&self, doc: &Versioned<SandboxDoc>) -> Result<u64, Failure> {
        let txn = Txn::new().update(SANDBOX_KIND, &doc.value.sandbox_id, doc.version, &doc.value)?;
        match self.ledger.compare(txn).await {
            Ok(done) => Ok(done.versions.first().copied().unwrap_or(doc.version + 1)),
            Err(LedgerError::Conflict { .. }) => Err(Failure::Conflict(format!(
                "sandbox {} changed concurrently; retry",
                doc.value.sandbox_id
            ))),
            Err(err) => Err(err.into()),
        }
    }

    /// Creates a sandbox: manifest first, then place, then create on the node, then running.
    pub async fn create(&self, team: &str, intent: CreateIntent) -> Result<SandboxDoc, Failure> {
        use tracing::Instrument;
        let sandbox_id = format!("i{}", random_id(19));
        // Instrumented, not entered: an entered span held across an await would leak onto
        // whatever else the thread polls meanwhile.
        let span = tracing::info_span!("create", sandbox_id = %sandbox_id, template = %intent.template);
        self.create_as(team, intent, sandbox_id).instrument(span).await
    }

    async fn create_as(&self, team: &str, intent: CreateIntent, sandbox_id: String) -> Result<SandboxDoc, Failure> {
        let now = now_ms();
        let mut doc = SandboxDoc {
            sandbox_id: sandbox_id.clone(),
            team_id: team.to_string(),
            template: intent.template.clone(),
            vcpus: intent.vcpus,
            memory_bytes: intent.memory_bytes,
            memory_source: intent.memory_source,
            env_vars: intent.env_vars.clone(),
            metadata: intent.metadata.clone(),
            phase: SandboxPhase::Creating,
            node_id: String::new(),
            node_address: String::new(),
            envd_address: String::new(),
            epoch: 1,
            // Always: envd answers only requests that carry it (or a URL signed with it).
            envd_access_token: Some(envd_wire::access::new_token()),
            started_at_unix_ms: now,
            end_at_unix_ms: now + intent.timeout_secs * 1000,
            auto_pause: intent.auto_pause,
            lifecycle_owner: None,
            last_moved_unix_ms: None,
            trace_context: common::trace::traceparent(),
        };
        let version = self
            .ledger
            .compare(Txn::new().create(SANDBOX_KIND, &sandbox_id, &doc)?)
            .await?
            .versions[0];
        let undo_manifest = || async {
            if let Err(err) = self
                .ledger
                .compare(Txn::new().delete(SANDBOX_KIND, &sandbox_id, version))
                .await
            {
                tracing::error!(%err, "could not delete the manifest of a failed create");
            }
        };
        let placed = match self.place_and_start(&doc).await {
            Ok(placed) => placed,
            Err(err) => {
                undo_manifest().await;
                return Err(err);
            }
        };
        doc.node_id = placed.node_id.clone();
        doc.node_address = placed.node_address.clone();
        doc.envd_address = placed.envd_address;
        doc.phase = SandboxPhase::Running;
        let saved = self
            .save(&Versioned {
                key: ledger_client::DocKey::new(SANDBOX_KIND, &sandbox_id),
                version,
                create_revision: 0,
                mod_revision: 0,
                value: doc.clone(),
            })
            .await;
        if let Err(err) = saved {
            // Undo everything: the process, the reservation, the manifest.
            self.stop_on_node(&doc).await;
            undo_manifest().await;
            return Err(err);
        }
        tracing::info!(node_id = %doc.node_id, "sandbox running");
        Ok(doc)
    }

    async fn place_and_start(&self, doc: &SandboxDoc) -> Result<Placed, Failure> {
        let mut exclude = Vec::new();
        let mut last = Failure::NoCapacity("no node could start the sandbox".to_string());
        for attempt in 0..CREATE_ATTEMPTS {
            let placed = self
                .placement
                .clone()
                .place(pl::PlaceRequest {
                    sandbox_id: doc.sandbox_id.clone(),
                    resources: Some(pl::Resources {
                        vcpus: doc.vcpus,
                        memory_bytes: doc.memory_bytes,
                    }),
                    node_selector: Default::default(),
                    exclude_nodes: exclude.clone(),
                })
                .await
                .map_err(|s| from_status("placement", s))?
                .into_inner();
            let started = self.start_on(doc, &placed, attempt).await;
            let sandbox_ref = pl::SandboxRef {
                sandbox_id: doc.sandbox_id.clone(),
                node_id: placed.node_id.clone(),
                resources: None,
            };
            match started {
                Ok(envd_address) => {
                    if let Err(status) = self.placement.clone().created(sandbox_ref).await {
                        tracing::warn!(%status, "placement did not hear of the create; its reservation will expire");
                    }
                    return Ok(Placed {
                        node_id: placed.node_id,
                        node_address: placed.node_address,
                        envd_address,
                    });
                }
                Err(err) => {
                    tracing::warn!(node_id = %placed.node_id, %err, attempt, "create failed on node; trying another");
                    let _ = self.placement.clone().release(sandbox_ref).await;
                    exclude.push(placed.node_id);
                    last = err;
                }
            }
        }
        Err(last)
    }

    async fn start_on(&self, doc: &SandboxDoc, placed: &pl::PlaceResponse, attempt: usize) -> Result<String, Failure> {
        let mut node = self.nodes.client(&placed.node_address).await?;
        node.create(node_pb::CreateRequest {
            operation_id: format!("create-{}-{attempt}", doc.sandbox_id),
            epoch: doc.epoch,
            sandbox_id: doc.sandbox_id.clone(),
            template: doc.template.clone(),
            resources: Some(node_pb::Resources {
                vcpus: doc.vcpus,
                memory_bytes: doc.memory_bytes,
            }),
            env_vars: doc.env_vars.clone().into_iter().collect(),
            metadata: doc.metadata.clone().into_iter().collect(),
            start_command: String::new(),
            access_token: doc.envd_access_token.clone().unwrap_or_default(),
        })
        .await
        .map_err(|s| from_status("node create", s))?;
        match self.nodes.envd(&placed.node_address).await {
            Ok(envd) => Ok(envd),
            Err(err) => {
                let _ = node
                    .kill(node_pb::LifecycleRequest {
                        operation_id: format!("undo-{}-{attempt}", doc.sandbox_id),
                        epoch: doc.epoch,
                        sandbox_id: doc.sandbox_id.clone(),
                    })
                    .await;
                Err(err)
            }
        }
    }

    /// Kills the sandbox on its node and tells placement (errors logged: the manifest goes
    /// regardless, and a heartbeat will correct placement).
    async fn stop_on_node(&self, doc: &SandboxDoc) {
        if doc.node_address.is_empty() {
            return;
        }
        if let Ok(mut node) = self.nodes.client(&doc.node_address).await {
            let killed = node
                .kill(node_pb::LifecycleRequest {
                    operation_id: format!("kill-{}-{}", doc.sandbox_id, doc.epoch),
                    epoch: doc.epoch,
                    sandbox_id: doc.sandbox_id.clone(),
                })
                .await;
            if let Err(status) = killed {
                if status.code() != Code::NotFound {
                    tracing::warn!(sandbox_id = %doc.sandbox_id, %status, "kill on node failed");
                }
            }
        }
        let removed = self
            .placement
            .clone()
            .removed(pl::SandboxRef {
                sandbox_id: doc.sandbox_id.clone(),
                node_id: doc.node_id.clone(),
                resources: Some(pl::Resources {
                    vcpus: doc.vcpus,
                    memory_bytes: doc.memory_bytes,
                }),
            })
            .await;
        if let Err(status) = removed {
            tracing::warn!(sandbox_id = %doc.sandbox_id, %status, "placement did not hear of the kill");
        }
    }

    /// Kills a sandbox and deletes its manifest.
    pub async fn kill(&self, team: &str, id: &str) -> Result<(), Failure> {
        let doc = self.get_settled(team, id).await?;
        self.routes.forget(id).await;
        self.stop_on_node(&doc.value).await;
        let (meta, tar) = self.hibernation_files(id);
        let _ = tokio::fs::remove_file(meta).await;
        let _ = tokio::fs::remove_file(tar).await;
        match self
            .ledger
            .compare(Txn::new().delete(SANDBOX_KIND, id, doc.version))
            .await
        {
            Ok(_) | Err(LedgerError::Conflict { .. }) => {}
            Err(err) => return Err(err.into()),
        }
        tracing::info!(sandbox_id = %id, "sandbox killed");
        Ok(())
    }

    async fn node_call(&self, doc: &SandboxDoc, op: &str) -> Result<(), Failure> {
        let mut node = self.nodes.client(&doc.node_address).await?;
        let req = node_pb::LifecycleRequest {
            operation_id: format!("{op}-{}-{}", doc.sandbox_id, uuid::Uuid::new_v4().simple()),
            epoch: doc.epoch,
            sandbox_id: doc.sandbox_id.clone(),
        };
        let result = match op {
            "pause" => node.pause(req).await,
            _ => node.resume(req).await,
        };
        result.map(|_| ()).map_err(|s| from_status(op, s))
    }

    /// Pauses a running sandbox: frozen in place with its memory (`memory`), or hibernated:
    /// only its files kept (here, off the node), its processes stopped and the node freed.
    pub async fn pause(&self, team: &str, id: &str, memory: bool) -> Result<(), Failure> {
        let mut doc = self.get_settled(team, id).await?;
        if doc.value.phase != SandboxPhase::Running {
            return Err(Failure::Conflict(format!("sandbox {id} is already paused")));
        }
        self.routes.set_running(id, false).await;
        if let Err(err) = self.node_call(&doc.value, "pause").await {
            self.routes.set_running(id, true).await;
            return Err(err);
        }
        if !memory {
            if let Err(err) = self.hibernate(&doc.value).await {
                tracing::warn!(sandbox_id = %id, %err, "hibernation failed; kept paused in place");
            } else {
                self.stop_on_node(&doc.value).await;
                doc.value.node_id.clear();
                doc.value.node_address.clear();
                doc.value.envd_address.clear();
                doc.value.epoch += 1;
                doc.value.phase = SandboxPhase::Hibernated;
                self.save(&doc).await?;
                self.routes.forget(id).await;
                return Ok(());
            }
        }
        doc.value.phase = SandboxPhase::Paused;
        self.save(&doc).await?;
        Ok(())
    }

    fn hibernation_files(&self, id: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        (
            self.hibernate_dir.join(format!("{id}.json")),
            self.hibernate_dir.join(format!("{id}.tar")),
        )
    }

    /// Copies a paused sandbox's snapshot (header, archive, checksum) off its node.
    async fn hibernate(&self, doc: &SandboxDoc) -> Result<(), Failure> {
        use tokio::io::AsyncWriteExt;
        let io = |e: std::io::Error| Failure::Internal(format!("hibernation store: {e}"));
        tokio::fs::create_dir_all(&self.hibernate_dir).await.map_err(io)?;
        let (meta_path, tar_path) = self.hibernation_files(&doc.sandbox_id);
        let mut node = self.nodes.client(&doc.node_address).await?;
        let mut stream = node
            .snapshot(node_pb::LifecycleRequest {
                operation_id: String::new(),
                epoch: doc.epoch,
                sandbox_id: doc.sandbox_id.clone(),
            })
            .await
            .map_err(|s| from_status("snapshot", s))?
            .into_inner();
        let mut tar = tokio::fs::File::create(&tar_path).await.map_err(io)?;
        let (mut header, mut trailer) = (None, None);
        while let Some(chunk) = stream.message().await.map_err(|s| from_status("snapshot", s))? {
            match chunk.part {
                Some(node_pb::snapshot_chunk::Part::Header(h)) => header = Some(h),
                Some(node_pb::snapshot_chunk::Part::Data(d)) => tar.write_all(&d).await.map_err(io)?,
                Some(node_pb::snapshot_chunk::Part::Trailer(t)) => trailer = Some(t),
                None => {}
            }
        }
        tar.sync_all().await.map_err(io)?;
        let (Some(header), Some(trailer)) = (header, trailer) else {
            return Err(Failure::Internal("the snapshot stream was incomplete".into()));
        };
        let meta = serde_json::json!({
            "description_json": header.description_json,
            "sha256": trailer.sha256,
            "bytes": trailer.bytes,
        });
        tokio::fs::write(&meta_path, meta.to_string()).await.map_err(io)?;
        Ok(())
    }

    /// Cold-boots a hibernated sandbox wherever placement chooses: restore its files there,
    /// start it, and point the manifest at it.
    async fn wake(&self, doc: &mut Versioned<SandboxDoc>) -> Result<(), Failure> {
        let id = doc.value.sandbox_id.clone();
        let (meta_path, tar_path) = self.hibernation_files(&id);
        let io = |e: std::io::Error| Failure::Internal(format!("hibernation store: {e}"));
        let meta: serde_json::Value = serde_json::from_slice(&tokio::fs::read(&meta_path).await.map_err(io)?)
            .map_err(|e| Failure::Internal(e.to_string()))?;
        let placed = self
            .placement
            .clone()
            .place(pl::PlaceRequest {
                sandbox_id: id.clone(),
                resources: Some(pl::Resources {
                    vcpus: doc.value.vcpus,
                    memory_bytes: doc.value.memory_bytes,
                }),
                ..Default::default()
            })
            .await
            .map_err(|s| from_status("placement", s))?
            .into_inner();
        let sandbox_ref = pl::SandboxRef {
            sandbox_id: id.clone(),
            node_id: placed.node_id.clone(),
            resources: None,
        };
        let restored = async {
            let data = tokio::fs::read(&tar_path).await.map_err(io)?;
            let mut chunks = vec![node_pb::RestoreChunk {
                part: Some(node_pb::restore_chunk::Part::Header(node_pb::RestoreHeader {
                    operation_id: format!("wake-{id}-{}", doc.value.epoch),
                    epoch: doc.value.epoch,
                    snapshot: Some(node_pb::SnapshotHeader {
                        sandbox_id: id.clone(),
                        description_json: meta["description_json"].as_str().unwrap_or_default().to_string(),
                    }),
                })),
            }];
            for piece in data.chunks(256 * 1024) {
                chunks.push(node_pb::RestoreChunk {
                    part: Some(node_pb::restore_chunk::Part::Data(piece.to_vec())),
                });
            }
            chunks.push(node_pb::RestoreChunk {
                part: Some(node_pb::restore_chunk::Part::Trailer(node_pb::SnapshotTrailer {
                    sha256: meta["sha256"].as_str().unwrap_or_default().to_string(),
                    bytes: meta["bytes"].as_u64().unwrap_or_default(),
                })),
            });
            let mut node = self.nodes.client(&placed.node_address).await?;
            node.restore(tokio_stream::iter(chunks))
                .await
                .map_err(|s| from_status("restore", s))?;
            node.resume(node_pb::LifecycleRequest {
                operation_id: format!("wake-resume-{id}-{}", doc.value.epoch),
                epoch: doc.value.epoch,
                sandbox_id: id.clone(),
            })
            .await
            .map_err(|s| from_status("resume", s))?;
            self.nodes.envd(&placed.node_address).await
        }
        .await;
        let envd = match restored {
            Ok(envd) => envd,
            Err(err) => {
                let _ = self.placement.clone().release(sandbox_ref).await;
                return Err(err);
            }
        };
        let _ = self.placement.clone().created(sandbox_ref).await;
        doc.value.node_id = placed.node_id;
        doc.value.node_address = placed.node_address;
        doc.value.envd_address = envd;
        doc.value.phase = SandboxPhase::Running;
        let _ = tokio::fs::remove_file(&meta_path).await;
        let _ = tokio::fs::remove_file(&tar_path).await;
        Ok(())
    }

    /// Resumes a paused sandbox (true) or finds it running already (false), and sets its end.
    pub async fn resume(&self, team: &str, id: &str, timeout_secs: u64) -> Result<(SandboxDoc, bool), Failure> {
        let mut doc = self.get_settled(team, id).await?;
        let resumed = doc.value.phase != SandboxPhase::Running;
        match doc.value.phase {
            SandboxPhase::Running => {}
            SandboxPhase::Hibernated => self.wake(&mut doc).await?,
            SandboxPhase::Paused | SandboxPhase::Creating => {
                self.node_call(&doc.value, "resume").await?;
                doc.value.phase = SandboxPhase::Running;
            }
        }
        doc.value.end_at_unix_ms = doc.value.end_at_unix_ms.max(now_ms() + timeout_secs * 1000);
        self.save(&doc).await?;
        self.routes.set_running(id, true).await;
        Ok((doc.value, resumed))
    }

    /// Sets when the sandbox ends, `secs` from now.
    pub async fn set_timeout(&self, team: &str, id: &str, secs: u64) -> Result<(), Failure> {
        let mut doc = self.get_settled(team, id).await?;
        doc.value.end_at_unix_ms = now_ms() + secs * 1000;
        self.save(&doc).await?;
        Ok(())
    }

    /// Memory the node measures for the sandbox now.
    pub async fn measured(&self, doc: &SandboxDoc) -> Result<u64, Failure> {
        let mut node = self.nodes.client(&doc.node_address).await?;
        let list = node
            .list(node_pb::ListRequest {})
            .await
            .map_err(|s| from_status("node list", s))?
            .into_inner();
        Ok(list
            .sandboxes
            .iter()
            .find(|s| s.sandbox_id == doc.sandbox_id)
            .map_or(0, |s| s.memory_used_bytes))
    }

    /// The placer's view of every node.
    pub async fn nodes(&self) -> Result<Vec<pl::NodeView>, Failure> {
        Ok(self
            .placement
            .clone()
            .nodes(pl::NodesRequest {})
            .await
            .map_err(|s| from_status("placement", s))?
            .into_inner()
            .nodes)
    }

    /// Ends every sandbox whose time is up: paused where it asked for that, else killed. The
    /// end time lives in the manifest, so this survives gateway restarts.
    pub async fn reap(&self) -> Result<usize, Failure> {
        let now = now_ms();
        let mut ended = 0;
        for doc in self.all().await? {
            let d = &doc.value;
            if d.end_at_unix_ms > now || d.phase == SandboxPhase::Creating {
                continue;
            }
            let result = if d.auto_pause && d.phase == SandboxPhase::Running {
                self.pause(&d.team_id, &d.sandbox_id, true).await
            } else if d.auto_pause {
                continue;
            } else {
                self.kill(&d.team_id, &d.sandbox_id).await
            };
            match result {
                Ok(()) => ended += 1,
                Err(err) => tracing::warn!(sandbox_id = %d.sandbox_id, %err, "reaper could not end sandbox"),
            }
        }
        Ok(ended)
    }
}

struct Placed {
    node_id: String,
    node_address: String,
    envd_address: String,
}
