//! The `console-svc` binary: configuration from flags or environment, nothing else.

use std::net::SocketAddr;

use clap::Parser;
use console_svc::server::ConsoleConfig;

/// The operator's web console (`/console`).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    security: common::config::SecurityArgs,
    /// A TOML file of settings (table `[console-svc]`, keys = these flags' long names);
    /// environment variables and flags override it.
    #[arg(long, env = "SANDBOXSCHED_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Address the console listens on: keep it on the operators' network.
    #[arg(long, env = "CONSOLE_LISTEN", default_value = "127.0.0.1:3001")]
    listen: SocketAddr,
    /// Where Prometheus metrics are served (`GET /metrics`); port 0 picks a free one.
    #[arg(long, env = "CONSOLE_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    metrics_listen: SocketAddr,
    #[arg(long, env = "CONSOLE_LEDGER", default_value = "http://127.0.0.1:7001")]
    ledger: String,
    #[arg(long, env = "CONSOLE_PLACEMENT", default_value = "http://127.0.0.1:7002")]
    placement: String,
    #[arg(long, env = "CONSOLE_BALANCE", default_value = "http://127.0.0.1:7003")]
    balance: String,
    /// A file holding the operators' admin token, which signs in (the gateway's
    /// `--admin-token-file`); without it the console refuses everyone.
    #[arg(long, env = "CONSOLE_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<std::path::PathBuf>,
    /// A name browsers reach the console by besides loopback (`console.example.com:443`,
    /// repeat for more): requests naming any other host are refused.
    #[arg(long = "public-host", env = "CONSOLE_PUBLIC_HOSTS", value_delimiter = ',')]
    public_hosts: Vec<String>,
    /// Browsers reach the console over TLS, through a proxy in front of it: its cookies are
    /// marked `Secure`.
    #[arg(long, env = "CONSOLE_BEHIND_TLS")]
    behind_tls: bool,
}

#[global_allocator]
static ALLOCATOR: common::Allocator = common::Allocator;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = common::telemetry::init("console-svc");
    let args = common::config::parse::<Args>("console-svc");
    let (metrics_addr, _metrics) = common::metrics::serve(args.metrics_listen).await?;
    tracing::info!(%metrics_addr, "Prometheus metrics at /metrics");
    let admin_token = args
        .admin_token_file
        .as_deref()
        .map(common::config::secret_file)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    if let Some(token) = &admin_token {
        anyhow::ensure!(
            token.len() >= console_svc::session::MIN_TOKEN_LEN,
            "the admin token is shorter than {} characters: make a random one",
            console_svc::session::MIN_TOKEN_LEN
        );
    }
    if !args.listen.ip().is_loopback() && !args.behind_tls {
        tracing::warn!(
            listen = %args.listen,
            "console-svc serves plain HTTP beyond loopback: the admin token and sessions cross the network in clear \
             unless a TLS proxy is in front (then say --behind-tls)"
        );
    }
    let running = console_svc::server::start(ConsoleConfig {
        listen: args.listen,
        ledger: args.ledger,
        placement: args.placement,
        balance: args.balance,
        admin_token,
        security: args
            .security
            .security(mtls::Role::Console)
            .map_err(anyhow::Error::msg)?,
        public_hosts: args.public_hosts,
        secure_cookie: args.behind_tls,
    })
    .await?;
    common::shutdown::signal().await;
    running.stop().await;
    telemetry.shutdown().await;
    Ok(())
}
