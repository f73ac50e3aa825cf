//! The `balance-svc` binary: configuration from flags or environment, nothing else.

use std::net::SocketAddr;
use std::time::Duration;

use balance_svc::migrate::{Budget, Halt};
use balance_svc::record::Step;
use balance_svc::server::BalanceConfig;
use clap::Parser;

/// Observes memory spread, plans the fewest moves and migrates sandboxes safely.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    security: common::config::SecurityArgs,
    /// A TOML file of settings (table `[balance-svc]`, keys = these flags' long names); environment
    /// variables and flags override it.
    #[arg(long, env = "SANDBOXSCHED_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Address gRPC listens on.
    #[arg(long, env = "BALANCE_LISTEN", default_value = "127.0.0.1:7003")]
    listen: SocketAddr,
    /// Where Prometheus metrics are served (`GET /metrics`); port 0 picks a free one.
    #[arg(long, env = "BALANCE_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    metrics_listen: SocketAddr,
    #[arg(long, env = "BALANCE_LEDGER", default_value = "http://127.0.0.1:7001")]
    ledger: String,
    /// placement-svc: checks and reserves each move's target, hears of drains and moves.
    /// Empty: none (moves reserve nothing; placement learns of them from heartbeats only).
    #[arg(long, env = "BALANCE_PLACEMENT", default_value = "http://127.0.0.1:7002")]
    placement: String,
    /// Milliseconds between observations.
    #[arg(long, env = "BALANCE_INTERVAL_MS", default_value_t = 5_000)]
    interval_ms: u64,
    /// Act when the spread exceeds this.
    #[arg(long, env = "BALANCE_THRESHOLD", default_value_t = 0.1)]
    threshold: f64,
    /// Plan down to this (below the threshold: hysteresis).
    #[arg(long, env = "BALANCE_TARGET", default_value_t = 0.05)]
    target: f64,
    /// Placement's CPU over-commit R, for the allocation rule moves are planned with. The same
    /// environment variable as placement-svc's, so one setting serves both.
    #[arg(long, env = "PLACEMENT_CPU_OVERCOMMIT", default_value_t = common::fit::DEFAULT_CPU_OVERCOMMIT)]
    cpu_overcommit: f64,
    /// A moved sandbox is not moved again for this long.
    #[arg(long, env = "BALANCE_COOLDOWN_SECS", default_value_t = 300)]
    cooldown_secs: u64,
    /// Moves at once, in all.
    #[arg(long, env = "BALANCE_CONCURRENCY", default_value_t = Budget::DEFAULT.concurrency)]
    concurrency: usize,
    /// Moves a node takes part in at once, as source or target.
    #[arg(long, env = "BALANCE_MOVES_PER_NODE", default_value_t = Budget::DEFAULT.per_node)]
    moves_per_node: usize,
    /// The executor lease's time to live: a replica that dies holding it is replaced after
    /// this long; renewals go out every sixth of it.
    #[arg(long, env = "BALANCE_LEASE_TTL_SECS", default_value_t = 3)]
    lease_ttl_secs: u64,
    /// Seconds between sweeps for orphaned copies (paused copies no manifest points at).
    #[arg(long, env = "BALANCE_SWEEP_EVERY_SECS", default_value_t = 30)]
    sweep_every_secs: u64,
    /// Seconds a copy must stay orphaned before it is killed.
    #[arg(long, env = "BALANCE_ORPHAN_GRACE_SECS", default_value_t = 60)]
    orphan_grace_secs: u64,
    /// Fault injection for crash tests: abort the process (no clean-up, lease kept) right after
    /// a move completes this step's action, before its record (`STEP`) or after it
    /// (`STEP:recorded`). Steps: Owned, SourcePaused, Restored, TargetResumed, Switched, Done.
    #[arg(long, hide = true, value_parser = parse_halt)]
    fault_halt: Option<Halt>,
}

fn parse_halt(s: &str) -> Result<Halt, String> {
    let (name, recorded) = match s.split_once(':') {
        Some((name, "recorded")) => (name, true),
        Some((_, other)) => return Err(format!("{other:?} is not `recorded`")),
        None => (s, false),
    };
    let step = Step::FORWARD
        .into_iter()
        .find(|step| step.name() == name)
        .ok_or_else(|| format!("{name:?} is not a step"))?;
    Ok(Halt { step, recorded })
}

#[global_allocator]
static ALLOCATOR: common::Allocator = common::Allocator;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = common::telemetry::init("balance-svc");
    let args = common::config::parse::<Args>("balance-svc");
    let (metrics_addr, _metrics) = common::metrics::serve(args.metrics_listen).await?;
    tracing::info!(%metrics_addr, "Prometheus metrics at /metrics");
    let mut config = BalanceConfig::new(args.listen, args.ledger);
    config.placement_endpoint = (!args.placement.is_empty()).then_some(args.placement);
    config.tuning.interval = Duration::from_millis(args.interval_ms);
    config.tuning.plan.threshold = args.threshold;
    config.tuning.plan.target = args.target;
    config.tuning.plan.cooldown_ms = args.cooldown_secs * 1000;
    config.tuning.plan.cpu_overcommit = args.cpu_overcommit;
    config.budget = Budget {
        concurrency: args.concurrency,
        per_node: args.moves_per_node,
    };
    config.lease_ttl = Duration::from_secs(args.lease_ttl_secs);
    config.tuning.sweep_every = Duration::from_secs(args.sweep_every_secs);
    config.tuning.orphan_grace = Duration::from_secs(args.orphan_grace_secs);
    config.halt = args.fault_halt;
    config.security = args
        .security
        .security(mtls::Role::Balance)
        .map_err(anyhow::Error::msg)?;
    let mut running = balance_svc::server::start(config).await?;
    tokio::select! {
        _ = common::shutdown::signal() => {}
        _ = running.loop_done(), if args.fault_halt.is_some() => {
            eprintln!("fault injection: aborting the process mid-move");
            std::process::abort();
        }
    }
    running.stop().await;
    telemetry.shutdown().await;
    Ok(())
}
