//! Starting and stopping node-svc: host, runtime, heartbeats and gRPC server wired together.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::serve::{BindError, Grpc, Listener, OnStop, Serving};
use mtls::Role;
use proto::node::v1::node_server::NodeServer;

use crate::api::NodeApi;
use crate::heartbeat::{self, HeartbeatConfig};
use crate::host::{Host, HostConfig, NodeError};
use crate::runtime::container::{ContainerConfig, ContainerRuntime};
use crate::runtime::process::ProcessRuntime;
use crate::runtime::sim::SimRuntime;
use crate::runtime::Runtime;
use crate::sandbox::Resources;

/// Which runtime runs the sandboxes.
#[derive(Clone, Debug, PartialEq)]
pub enum RuntimeKind {
    /// OCI containers (the default): `oci_runtime` is a runc-compatible binary, or `None`
    /// for the node's own `jail`.
    Container { oci_runtime: Option<std::path::PathBuf> },
    /// Unisolated: processes on the host, as its root; cgroups where the host allows (and
    /// `cgroups` is true). Only for development and the control plane's own tests.
    Unisolated { cgroups: bool },
    /// Numbers only; each sandbox uses this share of its memory.
    Sim { used_share: f64 },
}

/// How node-svc runs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub listen: SocketAddr,
    /// Where the envd-compatible HTTP endpoint listens; port 0 picks a free one.
    pub envd_listen: SocketAddr,
    pub host: HostConfig,
    pub runtime: RuntimeKind,
    /// The envd injected into container sandboxes (`None`: the node's own binary).
    pub envd_binary: Option<std::path::PathBuf>,
    /// How container sandboxes reach out (their pool and the host's floor).
    pub network: crate::runtime::container::network::NetworkConfig,
    /// placement-svc to send heartbeats to, if any.
    pub placement: Option<String>,
    pub heartbeat_interval: Duration,
    /// How often each sandbox's metrics are sampled (CPU, memory, disk).
    pub sample_interval: Duration,
    pub labels: std::collections::HashMap<String, String>,
    /// The gRPC endpoint others should use (default: `http://` + the bound address).
    pub advertise: Option<String>,
    /// The envd endpoint others should use (default: `http://` + its bound address).
    pub advertise_envd: Option<String>,
    /// Mutual TLS with the cluster's certificates (every binary), or plaintext for a test.
    pub security: mtls::Security,
    /// Processes all of this node's sandboxes may have together; `None`: three quarters of
    /// what the host can have (`runtime::cgroup::default_pids_max`).
    pub pids_max: Option<u64>,
}

/// Who may call a node: what changes a sandbox (create, restore, kill, build, …) comes only
/// from the gateway and the balancer; the operator may read. Another node may call nothing,
/// so a compromised node cannot reach into the sandboxes of the others.
pub const POLICY: mtls::Policy = mtls::Policy {
    service: "sandboxsched.node.v1.Node",
    rules: &[
        (
            &[
                "Create",
                "Kill",
                "Pause",
                "Resume",
                "UpdateNetwork",
                "Snapshot",
                "Restore",
                "Build",
                "Capture",
            ],
            &[Role::Gateway, Role::Balance],
        ),
        // Only a create hands a pooled sandbox over.
        (&["Claim"], &[Role::Gateway]),
        (
            &["List", "Info", "Metrics", "Logs"],
            &[Role::Gateway, Role::Balance, Role::Operator],
        ),
        // The console shows one sandbox's log and metrics.
        (&["Metrics", "Logs"], &[Role::Console]),
    ],
};

impl NodeConfig {
    pub fn new(listen: SocketAddr, node_id: impl Into<String>, state_dir: impl Into<std::path::PathBuf>) -> Self {
        Self {
            listen,
            envd_listen: SocketAddr::new(listen.ip(), 0),
            host: HostConfig {
                node_id: node_id.into(),
                state_dir: state_dir.into(),
                templates_dir: None,
                capacity: host_capacity(),
                blob_store: None,
                layer_cache_bytes: crate::host::DEFAULT_LAYER_CACHE_BYTES,
                private_registries: Vec::new(),
                registry_floor: Vec::new(),
                disk_bytes: crate::host::DEFAULT_DISK_BYTES,
                build_disk_bytes: crate::host::DEFAULT_BUILD_DISK_BYTES,
                own_disks: true,
                disk_overcommit: 1.0,
                spare_disks: crate::host::DEFAULT_SPARE_DISKS,
            },
            runtime: RuntimeKind::Container { oci_runtime: None },
            network: Default::default(),
            envd_binary: None,
            placement: None,
            heartbeat_interval: Duration::from_secs(2),
            sample_interval: Duration::from_secs(5),
            labels: Default::default(),
            advertise: None,
            advertise_envd: None,
            security: mtls::Security::Plaintext,
            pids_max: None,
        }
    }
}

/// HTTP/2 flow-control window for node gRPC streams, on servers and on clients that stream
/// snapshots (see [`start`]).
pub const STREAM_WINDOW: u32 = 8 << 20;

/// This machine's vCPUs and memory.
pub fn host_capacity() -> Resources {
    let vcpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let memory_bytes = node_runtime::host_tables::host_memory_bytes().unwrap_or(1 << 30);
    Resources {
        vcpus,
        memory_bytes,
        disk_bytes: 0,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Host(#[from] NodeError),
    #[error(transparent)]
    Tls(#[from] mtls::TlsError),
}

/// A node-svc that is serving.
pub struct RunningNode {
    addr: SocketAddr,
    envd_addr: SocketAddr,
    host: Arc<Host>,
    serving: Serving,
}

impl RunningNode {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The envd-compatible endpoint (`http://ADDR`).
    pub fn envd_endpoint(&self) -> String {
        format!("http://{}", self.envd_addr)
    }

    pub fn host(&self) -> &Arc<Host> {
        &self.host
    }

    /// Stops serving and heartbeating. Sandboxes keep running: the next start re-adopts them.
    /// Kills every sandbox of the node (tests and benchmarks clean up with it); the first
    /// failure is returned.
    pub async fn kill_all(&self) -> Result<(), crate::host::NodeError> {
        for (record, _) in self.host.list().await {
            let operation = format!("kill-all-{}", record.id);
            self.host
                .lifecycle(&operation, u64::MAX, &record.id, crate::sandbox::Move::Kill)
                .await?;
        }
        Ok(())
    }

    pub async fn stop(self) {
        self.serving.stop().await;
    }
}

pub async fn start(config: NodeConfig) -> Result<RunningNode, StartError> {
    mtls::check_node_id(&config.host.node_id).map_err(StartError::Config)?;
    if config.host.capacity.vcpus == 0 || config.host.capacity.memory_bytes == 0 {
        return Err(StartError::Config("capacity must be positive".into()));
    }
    let runtime: Arc<dyn Runtime> = match config.runtime {
        RuntimeKind::Container { oci_runtime } => Arc::new(ContainerRuntime::new(
            &config.host.node_id,
            ContainerConfig {
                state_dir: config.host.state_dir.clone(),
                oci_runtime,
                envd_binary: config.envd_binary.clone(),
                network: config.network.clone(),
                pids_max: config.pids_max,
                memory_bytes: config.host.capacity.memory_bytes,
            },
        )),
        RuntimeKind::Unisolated { cgroups } => Arc::new(ProcessRuntime::new(&config.host.node_id, cgroups)),
        RuntimeKind::Sim { used_share } => Arc::new(SimRuntime { used_share }),
    };
    let mut host_config = config.host.clone();
    host_config.registry_floor = config.network.floor.clone();
    let host = Arc::new(Host::open(host_config, runtime).await?);
    let listener = Listener::bind(config.listen).await?;
    let addr = listener.addr();
    let envd_listener = Listener::bind(config.envd_listen).await?;
    let envd_addr = envd_listener.addr();
    let mut serving = Serving::new();
    // envd requests are commands and watches that may stream for as long as the client
    // likes: stopping the node drops them rather than waiting.
    let envd_router = crate::envd::Envd::new(host.clone()).router();
    // Under mutual TLS only gateways reach it (with a sandbox's token on top): the tokens
    // travel in TLS, and a local user or network peer holding a stolen token gets no further
    // than the handshake.
    match &config.security {
        mtls::Security::MutualTls(credentials) => serving.https(
            "envd",
            envd_listener,
            envd_router,
            credentials.http_server(),
            &[mtls::Role::Gateway],
            OnStop::Abort,
        ),
        mtls::Security::Plaintext => serving.http("envd", envd_listener, envd_router, OnStop::Abort),
    }
    let sampled = host.clone();
    let every = config.sample_interval;
    serving.background(tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            sampled.sample().await;
            sampled.revive().await;
        }
    }));
    if let Some(placement) = &config.placement {
        serving.background(
            heartbeat::spawn(
                host.clone(),
                HeartbeatConfig {
                    placement: placement.clone(),
                    interval: config.heartbeat_interval,
                    address: config.advertise.clone().unwrap_or_else(|| format!("http://{addr}")),
                    labels: config.labels.clone(),
                    security: config.security.clone(),
                },
            )
            .map_err(|e| StartError::Config(format!("placement endpoint {placement:?}: {e}")))?,
        );
    }
    let api = NodeApi::new(
        host.clone(),
        config
            .advertise_envd
            .clone()
            .unwrap_or_else(|| format!("http://{envd_addr}")),
    );
    // Restores stream archives of hundreds of MB: HTTP/2's default 64 KiB windows would
    // stall the sender on every window update (about 55 MB/s here).
    let grpc = Grpc::new()
        .stream_window(STREAM_WINDOW)
        .secure(&config.security, &[POLICY])?
        .service(NodeServer::new(api))
        .await;
    serving.grpc("node-svc", listener, grpc);
    tracing::info!(%addr, %envd_addr, node_id = %config.host.node_id, runtime = host.runtime_kind(), "node-svc serving");
    Ok(RunningNode {
        addr,
        envd_addr,
        host,
        serving,
    })
}

#[cfg(test)]
mod policy_tests {
    #[test]
    fn the_policy_names_every_rpc_of_a_node() {
        let proto = include_str!("../../proto/proto/sandboxsched/node.proto");
        super::POLICY.check_against_proto(proto).unwrap();
    }
}
