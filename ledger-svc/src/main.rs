//! The `ledger-svc` binary: one ledger, configured from flags or environment.

use std::net::SocketAddr;

use clap::Parser;
use ledger_svc::LedgerConfig;

/// Versioned JSON documents with compare-and-swap and a change feed, on SQLite, PostgreSQL or
/// MariaDB.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    security: common::config::SecurityArgs,
    /// A TOML file of settings (table `[ledger-svc]`, keys = these flags' long names); environment
    /// variables and flags override it.
    #[arg(long, env = "SANDBOXSCHED_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Address gRPC listens on.
    #[arg(long, env = "LEDGER_LISTEN", default_value = "127.0.0.1:7001")]
    listen: SocketAddr,
    /// Where Prometheus metrics are served (`GET /metrics`); port 0 picks a free one.
    #[arg(long, env = "LEDGER_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    metrics_listen: SocketAddr,
    /// `sqlite://PATH` for the embedded default, `postgres://USER@HOST:PORT/DB`, or
    /// `mysql://USER@HOST:PORT/DB` (MariaDB or MySQL).
    #[arg(long, env = "LEDGER_DATABASE_URL", default_value = "sqlite://data/ledger.db")]
    database_url: String,
    /// Change-log revisions kept for watchers that reconnect.
    #[arg(long, env = "LEDGER_RETAIN_REVISIONS", default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    retain_revisions: u64,
}

#[global_allocator]
static ALLOCATOR: common::Allocator = common::Allocator;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = common::telemetry::init("ledger-svc");
    let args = common::config::parse::<Args>("ledger-svc");
    let (metrics_addr, _metrics) = common::metrics::serve(args.metrics_listen).await?;
    tracing::info!(%metrics_addr, "Prometheus metrics at /metrics");
    let mut config = LedgerConfig::new(args.listen, args.database_url);
    config.retain_revisions = args.retain_revisions;
    config.security = args.security.security(mtls::Role::Ledger).map_err(anyhow::Error::msg)?;
    let ledger = ledger_svc::start(config).await?;
    common::shutdown::signal().await;
    ledger.stop().await;
    telemetry.shutdown().await;
    Ok(())
}
