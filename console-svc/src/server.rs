//! Starting and stopping the console.

use std::net::SocketAddr;
use std::sync::Arc;

use common::serve::{BindError, Listener, OnStop, Serving};

use crate::control::{Control, ControlError};
use crate::feed::{self, Shared};
use crate::http::{self, Console};
use crate::session::Sessions;

/// What the console needs to run.
#[derive(Clone)]
pub struct ConsoleConfig {
    pub listen: SocketAddr,
    pub ledger: String,
    pub placement: String,
    pub balance: String,
    /// The operators' admin token; none: the console refuses everyone.
    pub admin_token: Option<String>,
    /// Mutual TLS as the console's role, or plaintext for a test.
    pub security: mtls::Security,
    /// Names browsers reach the console by besides loopback (`console.example.com:443`):
    /// any other `Host` is refused.
    pub public_hosts: Vec<String>,
    /// Browsers reach the console over TLS (a proxy in front of it): cookies carry `Secure`.
    pub secure_cookie: bool,
}

/// Why the console could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error("ledger: {0}")]
    Ledger(#[from] ledger_client::LedgerError),
    #[error(transparent)]
    Peer(#[from] ControlError),
}

/// A started console.
pub struct RunningConsole {
    addr: SocketAddr,
    serving: Serving,
}

impl RunningConsole {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The console's first page.
    pub fn url(&self) -> String {
        format!("http://{}/console", self.addr)
    }

    pub async fn stop(self) {
        self.serving.stop().await;
    }
}

pub async fn start(config: ConsoleConfig) -> Result<RunningConsole, StartError> {
    let listener = Listener::bind(config.listen).await?;
    let addr = listener.addr();
    let ledger = ledger_client::LedgerClient::connect_lazy(&config.ledger, &config.security)?
        .with_deadline(std::time::Duration::from_secs(10));
    let control = Control::new(&config.security, &config.placement, &config.balance)?;
    let shared = Shared::new();
    let port = addr.port();
    let mut hosts = vec![
        addr.to_string(),
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
    ];
    hosts.extend(config.public_hosts);
    let console = Console {
        hosts: Arc::new(hosts),
        secure_cookie: config.secure_cookie,
        streams: Arc::default(),
        shared: shared.clone(),
        ledger: ledger.clone(),
        control: control.clone(),
        sessions: Arc::new(Sessions::new(config.admin_token)),
    };
    let mut serving = Serving::new();
    serving.background(tokio::spawn(feed::relay_plans(shared.clone(), control)));
    serving.background(tokio::spawn(feed::probe(shared.clone(), ledger.clone())));
    serving.background(tokio::spawn(feed::follow(shared, ledger)));
    // Event streams never end by themselves: a stop ends them at once (browsers reconnect).
    serving.http("console-svc", listener, http::router(console), OnStop::Abort);
    tracing::info!(%addr, "console-svc serving");
    Ok(RunningConsole { addr, serving })
}
