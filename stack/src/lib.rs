//! The whole system in one process, built one way for everyone who needs it: the launcher's
//! `up`, the benchmarks and the integration tests.
//!
//! [`Stack::builder`] starts a ledger (SQLite in the stack's directory unless told otherwise),
//! placement (in memory unless told to use Redis), any number of nodes heartbeating to it, and
//! optionally balance-svc and the gateway, each on its own port (port 0 by default: the bound
//! address is read back from the listener, so stacks never race each other for ports). Every
//! service's configuration can be adjusted before it starts, with the endpoints of the
//! services it talks to already filled in.
//!
//! A stack in a temporary directory removes it when dropped, also when a test fails; node IDs
//! carry a random tag so stacks running side by side keep their cgroups apart.
//! [`services`] finds the PostgreSQL and Redis the tests use, failing with what to start.

pub mod certs;
pub mod fault;
pub mod services;

pub use certs::Certs;
pub use mtls::Role;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use balance_svc::server::{BalanceConfig, RunningBalance};
use console_svc::server::{ConsoleConfig, RunningConsole};
use e2b_gateway::server::{GatewayConfig, RunningGateway};
use ledger_client::LedgerClient;
use ledger_svc::{LedgerConfig, RunningLedger};
use node_svc::server::{NodeConfig, RunningNode};
use placement_svc::server::{PlacementConfig, RunningPlacement};

/// Why a stack could not start; names the service.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("cannot create the stack's directory {path}: {source}")]
    Dir { path: PathBuf, source: std::io::Error },
    #[error("starting ledger-svc: {0}")]
    Ledger(#[from] ledger_svc::StartError),
    #[error("starting placement-svc: {0}")]
    Placement(#[from] placement_svc::server::StartError),
    #[error("starting node-svc {id}: {source}")]
    Node {
        id: String,
        source: node_svc::server::StartError,
    },
    #[error("starting balance-svc: {0}")]
    Balance(#[from] balance_svc::server::StartError),
    #[error("starting e2b-gateway: {0}")]
    Gateway(#[from] e2b_gateway::server::StartError),
    #[error("starting console-svc: {0}")]
    Console(#[from] console_svc::server::StartError),
    #[error(transparent)]
    LedgerClient(#[from] ledger_client::LedgerError),
    #[error("placement never heard from every node within {0:?}")]
    NodesNotReady(Duration),
    #[error("the stack's certificates: {0}")]
    Certs(#[from] mtls::TlsError),
}

type Adjust<T> = Box<dyn FnOnce(&mut T) + Send>;

/// Everything a stack is made of, before it starts.
pub struct StackBuilder {
    dir: Option<PathBuf>,
    ip: std::net::IpAddr,
    ledger: Option<Adjust<LedgerConfig>>,
    placement: Option<Adjust<PlacementConfig>>,
    nodes: Vec<(String, Option<Adjust<NodeConfig>>)>,
    node_tag: String,
    heartbeat: Duration,
    balance: Option<Adjust<BalanceConfig>>,
    gateway: Option<Adjust<GatewayConfig>>,
    console: Option<Adjust<ConsoleConfig>>,
    wait_for_nodes: bool,
    plaintext: bool,
}

/// One node of a stack.
pub struct Node {
    pub id: String,
    pub running: RunningNode,
}

/// A started stack. Fields are public so tests can stop or replace one service at a time;
/// [`Stack::stop`] stops whatever is still there.
pub struct Stack {
    pub dir: PathBuf,
    /// Held so the temporary directory is removed when the stack is dropped.
    _temp: Option<tempfile::TempDir>,
    pub ledger: RunningLedger,
    pub placement: Option<RunningPlacement>,
    pub nodes: Vec<Node>,
    pub balance: Option<RunningBalance>,
    pub gateway: Option<RunningGateway>,
    /// The operator's console, when asked for.
    pub console: Option<RunningConsole>,
    /// What the gateway was started with (to start another like it).
    pub gateway_config: Option<GatewayConfig>,
    /// A client of the stack's ledger (as the gateway: it may read and write).
    pub ledger_client: LedgerClient,
    /// The cluster certificates every service of the stack uses.
    pub certs: Certs,
}

impl Stack {
    /// A stack in a fresh temporary directory: SQLite ledger, placement in memory, no nodes,
    /// no balance, no gateway until asked for.
    pub fn builder() -> StackBuilder {
        StackBuilder {
            dir: None,
            ip: [127, 0, 0, 1].into(),
            ledger: None,
            placement: None,
            nodes: Vec::new(),
            node_tag: uuid::Uuid::new_v4().simple().to_string()[..8].to_string(),
            heartbeat: Duration::from_millis(100),
            balance: None,
            gateway: None,
            console: None,
            wait_for_nodes: true,
            plaintext: false,
        }
    }

    /// How a client of `role` connects to this stack's services.
    pub fn security(&self, role: Role) -> mtls::Security {
        self.certs.security(role)
    }

    /// A lazily connected channel to the service of role `peer` at `endpoint`, as
    /// [`Certs::endpoint`] chooses the caller. For tests and benchmarks.
    pub fn channel(&self, endpoint: &str, peer: Role) -> tonic::transport::Channel {
        self.certs
            .endpoint(endpoint, peer)
            .expect("a stack's endpoints are URLs")
            .connect_lazy()
    }

    /// The stack's ledger endpoint (`http://ADDR`).
    pub fn ledger_endpoint(&self) -> String {
        self.ledger.endpoint()
    }

    /// The placement endpoint; panics if a test stopped placement.
    pub fn placement_endpoint(&self) -> String {
        self.placement.as_ref().expect("placement is running").endpoint()
    }

    /// The gateway's URL; panics if the stack has no gateway.
    pub fn gateway_url(&self) -> String {
        self.gateway.as_ref().expect("the stack has a gateway").url()
    }

    /// Stops every service still running (gateway and balance first, the ledger last). The
    /// nodes' sandboxes keep running unless [`Stack::kill_sandboxes`] ended them.
    pub async fn stop(mut self) {
        if let Some(console) = self.console.take() {
            console.stop().await;
        }
        if let Some(gateway) = self.gateway.take() {
            gateway.stop().await;
        }
        if let Some(balance) = self.balance.take() {
            balance.stop().await;
        }
        for node in self.nodes.drain(..) {
            node.running.stop().await;
        }
        if let Some(placement) = self.placement.take() {
            placement.stop().await;
        }
        self.ledger.stop().await;
    }

    /// Kills every sandbox on every node and removes the nodes' cgroups: what tests and
    /// benchmarks do before they stop.
    pub async fn kill_sandboxes(&self) {
        for node in &self.nodes {
            if let Err(err) = node.running.kill_all().await {
                eprintln!("stack: killing the sandboxes of {}: {err}", node.id);
            }
        }
    }

    /// [`Stack::kill_sandboxes`], then [`Stack::stop`], then the nodes' cgroup parents go.
    pub async fn shut_down(self) {
        self.kill_sandboxes().await;
        let ids: Vec<String> = self.nodes.iter().map(|n| n.id.clone()).collect();
        self.stop().await;
        for id in ids {
            node_svc::runtime::cgroup::remove_parents(&id);
        }
    }
}

impl StackBuilder {
    /// Keep state in `dir` (created if missing) instead of a temporary directory.
    pub fn dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// Adjusts the ledger's configuration (listen address, database URL, …).
    pub fn ledger(mut self, adjust: impl FnOnce(&mut LedgerConfig) + Send + 'static) -> Self {
        self.ledger = Some(Box::new(adjust));
        self
    }

    /// Adjusts placement's configuration (its ledger endpoint is already set).
    pub fn placement(mut self, adjust: impl FnOnce(&mut PlacementConfig) + Send + 'static) -> Self {
        self.placement = Some(Box::new(adjust));
        self
    }

    /// Adds `count` nodes with default settings, named `n{tag}-{i}`.
    pub fn nodes(mut self, count: usize) -> Self {
        for _ in 0..count {
            self = self.node(|_| {});
        }
        self
    }

    /// Adds a node, adjusted before it starts (its placement endpoint, state directory and
    /// a heartbeat interval are already set).
    pub fn node(mut self, adjust: impl FnOnce(&mut NodeConfig) + Send + 'static) -> Self {
        let id = format!("n{}-{}", self.node_tag, self.nodes.len());
        self.nodes.push((id, Some(Box::new(adjust))));
        self
    }

    /// Adds a node with this exact ID (the launcher's `node-1`, …).
    pub fn named_node(mut self, id: impl Into<String>, adjust: impl FnOnce(&mut NodeConfig) + Send + 'static) -> Self {
        self.nodes.push((id.into(), Some(Box::new(adjust))));
        self
    }

    /// The heartbeat interval nodes start with (100 ms unless told).
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = interval;
        self
    }

    /// Starts balance-svc, adjusted (ledger and placement endpoints already set).
    pub fn balance(mut self, adjust: impl FnOnce(&mut BalanceConfig) + Send + 'static) -> Self {
        self.balance = Some(Box::new(adjust));
        self
    }

    /// Starts the gateway, adjusted (ledger and placement endpoints set; one key, `key` for
    /// team `team`; the built-in templates).
    pub fn gateway(mut self, adjust: impl FnOnce(&mut GatewayConfig) + Send + 'static) -> Self {
        self.gateway = Some(Box::new(adjust));
        self
    }

    /// Starts the operator's console, adjusted (ledger, placement and balance endpoints set;
    /// no admin token, so it refuses everyone until one is given).
    pub fn console(mut self, adjust: impl FnOnce(&mut ConsoleConfig) + Send + 'static) -> Self {
        self.console = Some(Box::new(adjust));
        self
    }

    /// Returns as soon as the services listen, without waiting for placement to hear from
    /// every node (the launcher prints its addresses at once).
    pub fn no_wait(mut self) -> Self {
        self.wait_for_nodes = false;
        self
    }

    /// Every service serves and calls without TLS or authorisation (a stack is mutual TLS
    /// otherwise, as a cluster is): for a benchmark that measures what TLS costs.
    pub fn plaintext(mut self) -> Self {
        self.plaintext = true;
        self
    }

    fn any_port(&self) -> SocketAddr {
        SocketAddr::new(self.ip, 0)
    }

    pub async fn start(self) -> Result<Stack, StackError> {
        let (dir, temp) = match &self.dir {
            Some(dir) => {
                std::fs::create_dir_all(dir).map_err(|source| StackError::Dir {
                    path: dir.clone(),
                    source,
                })?;
                (dir.clone(), None)
            }
            None => {
                let temp = tempfile::Builder::new()
                    .prefix("sandboxsched-stack-")
                    .tempdir()
                    .map_err(|source| StackError::Dir {
                        path: std::env::temp_dir(),
                        source,
                    })?;
                (temp.path().to_path_buf(), Some(temp))
            }
        };
        let certs = if self.plaintext {
            Certs::plaintext()
        } else {
            Certs::issue(&dir.join("certs"))?
        };
        let any_port = self.any_port();
        let mut ledger_config = LedgerConfig::new(any_port, sqlite_in(&dir));
        ledger_config.security = certs.security(Role::Ledger);
        if let Some(adjust) = self.ledger {
            adjust(&mut ledger_config);
        }
        let ledger = ledger_svc::start(ledger_config).await?;

        let mut placement_config = PlacementConfig::new(any_port);
        placement_config.ledger_endpoint = Some(ledger.endpoint());
        placement_config.security = certs.security(Role::Placement);
        // Tests read node documents right after heartbeats; publishing at most every 5 s
        // (the production setting) would make them wait for it.
        placement_config.node_doc_interval = Duration::ZERO;
        if let Some(adjust) = self.placement {
            adjust(&mut placement_config);
        }
        let placement = placement_svc::server::start(placement_config).await?;

        let mut nodes = Vec::new();
        // Only nodes told to heartbeat to this placement can be waited for.
        let mut reporting = 0;
        for (id, adjust) in self.nodes {
            let mut config = NodeConfig::new(any_port, &id, dir.join(&id));
            config.placement = Some(placement.endpoint());
            config.security = certs.node(&id)?;
            // One blob store for the whole stack, as a cluster shares one.
            config.host.blob_store = Some(blob_store_in(&dir));
            config.heartbeat_interval = self.heartbeat;
            // Metrics as often as heartbeats (tests and benchmarks run with short ones); never
            // more rarely than the node's own default.
            config.sample_interval = self.heartbeat.min(config.sample_interval);
            if let Some(adjust) = adjust {
                adjust(&mut config);
            }
            if config.placement.as_deref() == Some(placement.endpoint().as_str()) {
                reporting += 1;
            }
            let running = node_svc::server::start(config)
                .await
                .map_err(|source| StackError::Node { id: id.clone(), source })?;
            nodes.push(Node { id, running });
        }
        // The tests' own client: it writes documents of every kind, as only an operator may.
        let ledger_client = LedgerClient::connect_lazy(&ledger.endpoint(), &certs.security(Role::Operator))?;
        if self.wait_for_nodes && reporting > 0 {
            wait_for_nodes(&placement.endpoint(), &certs.security(Role::Operator), reporting).await?;
        }

        let balance = match self.balance {
            Some(adjust) => {
                let mut config = BalanceConfig::new(any_port, ledger.endpoint());
                config.placement_endpoint = Some(placement.endpoint());
                config.security = certs.security(Role::Balance);
                adjust(&mut config);
                Some(balance_svc::server::start(config).await?)
            }
            None => None,
        };
        let (gateway, gateway_config) = match self.gateway {
            Some(adjust) => {
                let mut config = GatewayConfig {
                    listen: any_port,
                    ledger: ledger.endpoint(),
                    placement: placement.endpoint(),
                    keys: [("key".to_string(), "team".to_string())].into(),
                    templates: Vec::new(),
                    blob_store: blob_store_in(&dir),
                    reap_interval: Duration::from_secs(1),
                    hibernate_dir: dir.join("hibernated"),
                    upload_dir: dir.join("uploads"),
                    max_sandboxes_per_team: 0,
                    domain: String::new(),
                    paused_retention: e2b_gateway::server::DEFAULT_PAUSED_RETENTION,
                    sandbox_disk_bytes: common::resources::DEFAULT_DISK_BYTES,
                    abandoned_create_after: e2b_gateway::sandboxes::DEFAULT_ABANDONED_CREATE_AFTER,
                    claim_ttl: e2b_gateway::sandboxes::DEFAULT_CLAIM_TTL,
                    security: certs.security(Role::Gateway),
                    token_key: certs.token_key().clone(),
                    admin_token: None,
                    code_interpreter: false,
                };
                adjust(&mut config);
                let gateway = e2b_gateway::server::start(config.clone()).await?;
                (Some(gateway), Some(config))
            }
            None => (None, None),
        };
        let console = match self.console {
            Some(adjust) => {
                let mut config = ConsoleConfig {
                    listen: any_port,
                    ledger: ledger.endpoint(),
                    placement: placement.endpoint(),
                    balance: balance.as_ref().map_or_else(String::new, RunningBalance::endpoint),
                    admin_token: None,
                    security: certs.security(Role::Console),
                    public_hosts: Vec::new(),
                    secure_cookie: false,
                };
                adjust(&mut config);
                Some(console_svc::server::start(config).await?)
            }
            None => None,
        };
        Ok(Stack {
            dir,
            _temp: temp,
            ledger,
            placement: Some(placement),
            nodes,
            balance,
            gateway,
            console,
            gateway_config,
            ledger_client,
            certs,
        })
    }
}

/// The blob store of a stack kept in `dir` (a directory: the embedded default).
pub fn blob_store_in(dir: &std::path::Path) -> String {
    dir.join("blobs").display().to_string()
}

/// The embedded default ledger database of a stack kept in `dir`.
pub fn sqlite_in(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("ledger.db").display())
}

/// How long a stack waits for placement to hear from its nodes.
const NODES_READY: Duration = Duration::from_secs(20);

/// Until placement has had a heartbeat from `count` nodes: before that, nothing can be placed.
async fn wait_for_nodes(placement: &str, security: &mtls::Security, count: usize) -> Result<(), StackError> {
    use proto::placement::v1 as pb;
    let deadline = tokio::time::Instant::now() + NODES_READY;
    let mut client = None;
    let endpoint = security.endpoint(placement, Role::Placement)?;
    loop {
        if client.is_none() {
            client = endpoint
                .connect()
                .await
                .ok()
                .map(pb::placement_client::PlacementClient::new);
        }
        if let Some(c) = client.as_mut() {
            if let Ok(reply) = c.nodes(pb::NodesRequest {}).await {
                if reply.into_inner().nodes.len() >= count {
                    return Ok(());
                }
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(StackError::NodesNotReady(NODES_READY));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `check` until it answers `Some`, for state in other tasks' or processes' hands that
/// no event announces; panics naming `what` after `limit`.
pub async fn until<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
