//! The `node-svc` binary: configuration from flags or environment, nothing else.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use node_svc::server::{NodeConfig, RuntimeKind};

/// Runs sandboxes on this host and reports them to placement-svc.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    security: common::config::SecurityArgs,
    /// A TOML file of settings (table `[node-svc]`, keys = these flags' long names); environment
    /// variables and flags override it.
    #[arg(long, env = "SANDBOXSCHED_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Address gRPC listens on.
    #[arg(long, env = "NODE_LISTEN", default_value = "127.0.0.1:7003")]
    listen: SocketAddr,
    /// Where Prometheus metrics are served (`GET /metrics`); port 0 picks a free one.
    #[arg(long, env = "NODE_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    metrics_listen: SocketAddr,
    /// Address the envd-compatible HTTP endpoint listens on.
    #[arg(long, env = "NODE_ENVD_LISTEN", default_value = "127.0.0.1:49983")]
    envd_listen: SocketAddr,
    /// The gRPC endpoint other services should use for this node (default: http://LISTEN).
    #[arg(long, env = "NODE_ADVERTISE")]
    advertise: Option<String>,
    /// The envd endpoint the gateway's proxy should use (default: http://ENVD_LISTEN).
    #[arg(long, env = "NODE_ADVERTISE_ENVD")]
    advertise_envd: Option<String>,
    /// This node's ID (unique in the cluster).
    #[arg(long, env = "NODE_ID", default_value = "node-1")]
    node_id: String,
    /// Where sandbox records and files live.
    #[arg(long, env = "NODE_STATE_DIR", default_value = "data/node-1")]
    state_dir: PathBuf,
    /// Folder of templates (NAME/template.json, NAME/files/).
    #[arg(long, env = "NODE_TEMPLATES_DIR")]
    templates_dir: Option<PathBuf>,
    /// placement-svc to send heartbeats to.
    #[arg(long, env = "NODE_PLACEMENT", default_value = "http://127.0.0.1:7002")]
    placement: String,
    /// Milliseconds between heartbeats.
    #[arg(long, env = "NODE_HEARTBEAT_MS", default_value_t = 2000, value_parser = clap::value_parser!(u64).range(10..))]
    heartbeat_ms: u64,
    /// vCPUs to offer (default: this host's).
    #[arg(long, env = "NODE_VCPUS")]
    vcpus: Option<u32>,
    /// Memory to offer, in MiB (default: this host's).
    #[arg(long, env = "NODE_MEMORY_MB")]
    memory_mb: Option<u64>,
    /// `container` (each sandbox an OCI container), `unisolated` (processes on the host as
    /// its root: development only) or `sim` (numbers only).
    #[arg(long, env = "NODE_RUNTIME", default_value = "container", value_parser = ["container", "unisolated", "sim"])]
    runtime: String,
    /// The runc-compatible OCI runtime for `container` (runc, runsc, crun...); default: the
    /// node's own.
    #[arg(long, env = "NODE_OCI_RUNTIME")]
    oci_runtime: Option<std::path::PathBuf>,
    /// The IPv4 block sandboxes' links come from (a /30 each); it must not overlap a network
    /// the host routes to.
    #[arg(long, env = "NODE_SANDBOX_NETWORK", default_value = node_svc::runtime::container::network::DEFAULT_POOL)]
    sandbox_network: common::egress::Cidr,
    /// Network slots kept ready beyond those in use (a namespace with its link, made ahead of
    /// the sandboxes that reach out, so their creates make no link and their kills delete none).
    #[arg(long, env = "NODE_NETWORK_SLOTS", default_value_t = 16, value_parser = clap::value_parser!(u64).range(0..=4096))]
    network_slots: u64,
    /// How long a killed sandbox's network slot waits (for packets in flight to die) before it
    /// is cleaned and used again, in milliseconds.
    #[arg(long, env = "NODE_SLOT_COOLDOWN_MS", default_value_t = 2000, value_parser = clap::value_parser!(u64).range(0..=600_000))]
    slot_cooldown_ms: u64,
    /// Blocks no sandbox may reach, whatever its allowOut (comma-separated; default: private,
    /// link-local, shared, loopback, multicast and reserved ranges). The host's own addresses
    /// and other sandboxes are always out of reach.
    #[arg(long, env = "NODE_EGRESS_DENY", value_delimiter = ',')]
    egress_deny: Option<Vec<common::egress::Cidr>>,
    /// The resolvers the node asks for its sandboxes' names (comma-separated `IP` or
    /// `IP:PORT`; default: the host's, from its /etc/resolv.conf). Sandboxes ask the node,
    /// which may reach resolvers they may not.
    #[arg(long, env = "NODE_SANDBOX_DNS", value_delimiter = ',', value_parser = resolver_address)]
    sandbox_dns: Vec<std::net::SocketAddr>,
    /// The envd to inject into sandboxes: a statically linked one (scripts/build-static-envd)
    /// runs in any template's root filesystem; default: this binary (needs glibc there).
    #[arg(long, env = "NODE_ENVD_BINARY")]
    envd_binary: Option<PathBuf>,
    /// Processes all this node's sandboxes may have together (each sandbox has its own limit
    /// of 8192 too); default: three quarters of the host's `kernel.pid_max` (or threads-max).
    /// Nodes sharing a host should split it.
    #[arg(long, env = "NODE_PIDS_MAX", value_parser = clap::value_parser!(u64).range(16..))]
    pids_max: Option<u64>,
    /// Megabytes of disk a sandbox gets when its create names no size (the gateway names
    /// one: its --sandbox-disk-mb). Each sandbox's disk is a filesystem of its own, sparse on
    /// the host: writes past it fail with ENOSPC inside that sandbox alone.
    #[arg(long, env = "NODE_SANDBOX_DISK_MB", default_value_t = node_svc::host::DEFAULT_DISK_BYTES >> 20, value_parser = clap::value_parser!(u64).range(16..))]
    sandbox_disk_mb: u64,
    /// Sandboxes' files in plain folders of the state directory, with no disk of their own
    /// (no size limit): for measuring what the disks cost.
    #[arg(long, env = "NODE_NO_SANDBOX_DISKS")]
    no_sandbox_disks: bool,
    /// How many times the host's free space sandboxes' disks may promise together. Disks are
    /// sparse: each costs only what is written, so a node could hand out more than it has and
    /// let the first tenant to fill the host break every other's writes. At 1 (the default) a
    /// create is refused for room (the gateway tries another node) unless every disk could
    /// still fill to its size; above 1 the operator takes that risk knowingly.
    #[arg(long, env = "NODE_DISK_OVERCOMMIT", default_value_t = 1.0, value_parser = overcommit)]
    disk_overcommit: f64,
    /// Disks of the default size kept made and mounted before creates ask for them: a create
    /// takes one instead of making its own (a copy of the blank, a loop device, a mount).
    /// 0 turns them off.
    #[arg(long, env = "NODE_SPARE_DISKS", default_value_t = node_svc::host::DEFAULT_SPARE_DISKS)]
    spare_disks: usize,
    /// Megabytes of disk each builder container of a template build gets.
    #[arg(long, env = "NODE_BUILD_DISK_MB", default_value_t = node_svc::host::DEFAULT_BUILD_DISK_BYTES >> 20, value_parser = clap::value_parser!(u64).range(16..))]
    build_disk_mb: u64,
    /// The cluster's blob store, shared with the gateways: where template layers and the files
    /// of build steps are. A directory (`file:///abs/dir` or a path) or S3
    /// (`s3://BUCKET?endpoint=http://HOST:PORT&region=...`, credentials from AWS_* variables).
    #[arg(long, env = "SANDBOXSCHED_BLOB_STORE", default_value = "data/blobs")]
    blob_store: String,
    /// Megabytes of template layers kept cached; past it the least recently used go (never
    /// one a sandbox here uses).
    #[arg(long, env = "NODE_LAYER_CACHE_MB", default_value_t = 20 * 1024)]
    layer_cache_mb: u64,
    /// Registries (`host:port`, comma-separated) template builds may pull from although they
    /// resolve to a private, loopback or link-local address (any other such registry is
    /// refused: a build must not make the node fetch from the control plane's own network).
    #[arg(long, env = "SANDBOXSCHED_PRIVATE_REGISTRIES", value_delimiter = ',')]
    private_registries: Vec<String>,
    /// Do not use cgroups even where the host allows.
    #[arg(long, env = "NODE_NO_CGROUPS")]
    no_cgroups: bool,
}

/// `IP` (port 53) or `IP:PORT`.
fn resolver_address(text: &str) -> Result<std::net::SocketAddr, String> {
    text.parse::<std::net::SocketAddr>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(|ip| (ip, 53).into()))
        .map_err(|_| format!("{text:?} is not an IP address or IP:PORT"))
}

fn main() -> anyhow::Result<std::process::ExitCode> {
    // The node's binary is also envd (inside sandboxes) and the container runtime: those run
    // before anything else, in a process of their own.
    if let Some(code) = node_svc::multicall() {
        return Ok(code);
    }
    tokio::runtime::Runtime::new()?.block_on(serve())?;
    Ok(std::process::ExitCode::SUCCESS)
}

async fn serve() -> anyhow::Result<()> {
    let telemetry = common::telemetry::init("node-svc");
    let args = common::config::parse::<Args>("node-svc");
    let (metrics_addr, _metrics) = common::metrics::serve(args.metrics_listen).await?;
    tracing::info!(%metrics_addr, "Prometheus metrics at /metrics");
    let mut config = NodeConfig::new(args.listen, args.node_id, args.state_dir);
    config.envd_listen = args.envd_listen;
    config.advertise = args.advertise;
    config.advertise_envd = args.advertise_envd;
    config.host.templates_dir = args.templates_dir;
    config.host.layer_cache_bytes = args.layer_cache_mb << 20;
    config.host.disk_bytes = args.sandbox_disk_mb << 20;
    config.host.build_disk_bytes = args.build_disk_mb << 20;
    config.host.own_disks = !args.no_sandbox_disks;
    config.host.disk_overcommit = args.disk_overcommit;
    config.host.spare_disks = args.spare_disks;
    config.host.private_registries = args.private_registries;
    config.host.blob_store = Some(if args.blob_store.contains("://") {
        args.blob_store
    } else {
        std::path::absolute(&args.blob_store)?.display().to_string()
    });
    if let Some(vcpus) = args.vcpus {
        config.host.capacity.vcpus = vcpus;
    }
    if let Some(mb) = args.memory_mb {
        config.host.capacity.memory_bytes = mb * 1024 * 1024;
    }
    config.runtime = match args.runtime.as_str() {
        "sim" => RuntimeKind::Sim { used_share: 0.5 },
        "unisolated" => RuntimeKind::Unisolated {
            cgroups: !args.no_cgroups,
        },
        _ => RuntimeKind::Container {
            oci_runtime: args.oci_runtime,
        },
    };
    config.network.pool = args.sandbox_network;
    config.network.slots.ready = args.network_slots as usize;
    config.network.slots.cooldown = Duration::from_millis(args.slot_cooldown_ms);
    config.envd_binary = args.envd_binary;
    config.pids_max = args.pids_max;
    config.network.resolvers = args.sandbox_dns;
    if let Some(floor) = args.egress_deny {
        config.network.floor = floor;
    }
    config.placement = Some(args.placement);
    config.heartbeat_interval = Duration::from_millis(args.heartbeat_ms);
    config.security = args
        .security
        .node_security(&config.host.node_id)
        .map_err(anyhow::Error::msg)?;
    let node = node_svc::server::start(config).await?;
    common::shutdown::signal().await;
    node.stop().await;
    telemetry.shutdown().await;
    Ok(())
}

/// A disk over-commit factor: a finite number of at least 0.1.
fn overcommit(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(factor) if factor.is_finite() && factor >= 0.1 => Ok(factor),
        _ => Err(format!("{text:?} is not a factor of at least 0.1")),
    }
}
