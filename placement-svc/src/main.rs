//! The `placement-svc` binary: configuration from a file, the environment or flags, nothing else.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use placement_svc::core::{Accounting, Expiry, RankConfig};
use placement_svc::server::{PlacementConfig, StoreConfig};

/// Chooses a node for each sandbox (Best-of-K) with ID-reconciled accounting.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    security: common::config::SecurityArgs,
    /// A TOML file of settings (table `[placement-svc]`, keys = these flags' long names); environment
    /// variables and flags override it.
    #[arg(long, env = "SANDBOXSCHED_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Address gRPC listens on.
    #[arg(long, env = "PLACEMENT_LISTEN", default_value = "127.0.0.1:7002")]
    listen: SocketAddr,
    /// Where Prometheus metrics are served (`GET /metrics`); port 0 picks a free one.
    #[arg(long, env = "PLACEMENT_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    metrics_listen: SocketAddr,
    /// Share the view through Redis (`redis://HOST:PORT`); without it the view is in memory.
    #[arg(long, env = "PLACEMENT_REDIS_URL")]
    redis_url: Option<String>,
    /// Key prefix in Redis (several clusters may share one Redis).
    #[arg(long, env = "PLACEMENT_REDIS_PREFIX", default_value = "sandboxsched")]
    redis_prefix: String,
    /// ledger-svc to publish node documents to.
    #[arg(long, env = "PLACEMENT_LEDGER", default_value = "http://127.0.0.1:7001")]
    ledger: String,
    /// Accounting mode: reconciled (default), optimistic or stale (for comparison only).
    #[arg(long, env = "PLACEMENT_ACCOUNTING", default_value = "reconciled", value_parser = parse_accounting)]
    accounting: Accounting,
    /// Candidates sampled per decision.
    #[arg(long, env = "PLACEMENT_K", default_value_t = 3)]
    k: usize,
    /// CPU over-commit ratio R.
    #[arg(long, env = "PLACEMENT_CPU_OVERCOMMIT", default_value_t = common::fit::DEFAULT_CPU_OVERCOMMIT)]
    cpu_overcommit: f64,
    /// Weight of measured CPU usage in the CPU term.
    #[arg(long, env = "PLACEMENT_ALPHA", default_value_t = 0.5)]
    alpha: f64,
    /// Weight of the CPU term in the score.
    #[arg(long, env = "PLACEMENT_CPU_WEIGHT", default_value_t = 1.0)]
    cpu_weight: f64,
    /// Weight of the memory term in the score.
    #[arg(long, env = "PLACEMENT_MEMORY_WEIGHT", default_value_t = 1.0)]
    memory_weight: f64,
    /// Weight of the template term: a node holding the sandbox's template layers is preferred
    /// unless it is more than this much busier (CPU and memory shares, summed).
    #[arg(long, env = "PLACEMENT_TEMPLATE_WEIGHT", default_value_t = placement_svc::core::rank::DEFAULT_TEMPLATE_WEIGHT)]
    template_weight: f64,
    /// Most creates in flight per node.
    #[arg(long, env = "PLACEMENT_MAX_STARTING", default_value_t = 64)]
    max_starting: u32,
    /// A node without a heartbeat for this long (ms) gets nothing.
    #[arg(long, env = "PLACEMENT_UNHEALTHY_AFTER_MS", default_value_t = 6_000)]
    unhealthy_after_ms: u64,
    /// Heartbeats a created sandbox may go unlisted before its reservation is dropped.
    #[arg(long, env = "PLACEMENT_UNCONFIRMED_HEARTBEATS", default_value_t = Expiry::DEFAULT.unconfirmed_heartbeats)]
    unconfirmed_heartbeats: u32,
    /// Seconds a reservation may stay pending (no `Created` or `Release` heard) before it is
    /// dropped: a lost reply would otherwise hold the node's room for good. Longer than a
    /// template build may take (an hour), which holds its reservation pending throughout.
    #[arg(long, env = "PLACEMENT_PENDING_EXPIRES_SECS", default_value_t = Expiry::DEFAULT.pending_ms / 1000)]
    pending_expires_secs: u64,
    /// Seconds between node document writes per node.
    #[arg(long, env = "PLACEMENT_NODE_DOC_INTERVAL_SECS", default_value_t = 5)]
    node_doc_interval_secs: u64,
}

fn parse_accounting(s: &str) -> Result<Accounting, String> {
    Accounting::parse(s).ok_or_else(|| format!("{s:?} is not one of stale, optimistic, reconciled"))
}

#[global_allocator]
static ALLOCATOR: common::Allocator = common::Allocator;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = common::telemetry::init("placement-svc");
    let args = common::config::parse::<Args>("placement-svc");
    let (metrics_addr, _metrics) = common::metrics::serve(args.metrics_listen).await?;
    tracing::info!(%metrics_addr, "Prometheus metrics at /metrics");
    let mut config = PlacementConfig::new(args.listen);
    config.store = match args.redis_url {
        Some(url) => StoreConfig::Redis {
            url,
            prefix: args.redis_prefix,
        },
        None => StoreConfig::Memory,
    };
    config.accounting = args.accounting;
    config.rank = RankConfig {
        k: args.k,
        overcommit: args.cpu_overcommit,
        alpha: args.alpha,
        cpu_weight: args.cpu_weight,
        memory_weight: args.memory_weight,
        template_weight: args.template_weight,
        max_starting: args.max_starting,
        unhealthy_after_ms: args.unhealthy_after_ms,
    };
    config.expiry = Expiry {
        unconfirmed_heartbeats: args.unconfirmed_heartbeats,
        pending_ms: args.pending_expires_secs.saturating_mul(1000),
    };
    config.ledger_endpoint = Some(args.ledger);
    config.node_doc_interval = Duration::from_secs(args.node_doc_interval_secs);
    config.security = args
        .security
        .security(mtls::Role::Placement)
        .map_err(anyhow::Error::msg)?;
    let running = placement_svc::server::start(config).await?;
    common::shutdown::signal().await;
    running.stop().await;
    telemetry.shutdown().await;
    Ok(())
}
