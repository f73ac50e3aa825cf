//! Starting and stopping placement-svc: the one place that wires store, ledger publisher and
//! gRPC server together. Used by the binary, the launcher and the tests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::serve::{BindError, Grpc, Listener, Serving};
use mtls::Role;
use proto::placement::v1::placement_server::PlacementServer;

use crate::api::PlacementApi;
use crate::core::{Accounting, Expiry, RankConfig};
use crate::node_docs::NodeDocs;
use crate::store::memory::MemoryStore;
use crate::store::redis::RedisStore;
use crate::store::{PlacementStore, StoreError};

/// Where the placer's view lives. Its `Debug` form hides a password in the Redis URL (it is
/// logged at start).
#[derive(Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// In this process (embedded default; one replica).
    Memory,
    /// In Redis, shared by every replica.
    Redis { url: String, prefix: String },
}

impl std::fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreConfig::Memory => f.write_str("Memory"),
            StoreConfig::Redis { url, prefix } => f
                .debug_struct("Redis")
                .field("url", &common::config::redacted(url))
                .field("prefix", prefix)
                .finish(),
        }
    }
}

/// How placement-svc runs.
#[derive(Clone, Debug)]
pub struct PlacementConfig {
    pub listen: SocketAddr,
    pub store: StoreConfig,
    pub rank: RankConfig,
    pub accounting: Accounting,
    /// How long a reservation may stand unlisted by heartbeats before it is dropped.
    pub expiry: Expiry,
    /// ledger-svc to publish node documents to (`http://HOST:PORT`), if any.
    pub ledger_endpoint: Option<String>,
    /// At most one node document write per node per this interval.
    pub node_doc_interval: Duration,
    /// Mutual TLS with the cluster's certificates (every binary), or plaintext for a test.
    pub security: mtls::Security,
}

/// Who may call placement: the gateway and the balancer reserve and release, nodes report,
/// the operator reads and sets a node's state (the balancer does too, when it drains).
pub const POLICY: mtls::Policy = mtls::Policy {
    service: "sandboxsched.placement.v1.Placement",
    rules: &[
        (
            &["Place", "Created", "Release", "Removed"],
            &[Role::Gateway, Role::Balance],
        ),
        (&["Heartbeat"], &[Role::Node]),
        (
            &["Nodes", "Explain"],
            &[Role::Gateway, Role::Balance, Role::Operator, Role::Console],
        ),
        (&["SetNodeState"], &[Role::Balance, Role::Operator]),
    ],
};

impl PlacementConfig {
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            store: StoreConfig::Memory,
            rank: RankConfig::default(),
            accounting: Accounting::Reconciled,
            expiry: Expiry::DEFAULT,
            ledger_endpoint: None,
            node_doc_interval: Duration::from_secs(5),
            security: mtls::Security::Plaintext,
        }
    }

    /// Checks values that would make the placer misbehave, with a message naming the fix.
    pub fn validate(&self) -> Result<(), String> {
        let r = &self.rank;
        if r.k == 0 {
            return Err("k (candidates per decision) must be at least 1".into());
        }
        if !(r.overcommit >= 1.0 && r.overcommit.is_finite()) {
            return Err(format!("cpu over-commit must be a number >= 1 (got {})", r.overcommit));
        }
        if r.cpu_weight < 0.0 || r.memory_weight < 0.0 || r.cpu_weight + r.memory_weight <= 0.0 {
            return Err("score weights must be >= 0 and not both 0".into());
        }
        if r.max_starting == 0 {
            return Err("max creates in flight per node must be at least 1".into());
        }
        if r.unhealthy_after_ms == 0 {
            return Err("unhealthy-after must be positive".into());
        }
        if self.expiry.pending_ms < 1000 {
            return Err(format!(
                "pending-expires must be at least 1 s (got {} ms): a create in flight must keep its room",
                self.expiry.pending_ms
            ));
        }
        if let StoreConfig::Redis { url, .. } = &self.store {
            if !url.starts_with("redis://") && !url.starts_with("rediss://") {
                return Err(format!(
                    "redis url must start with redis:// (got {:?})",
                    common::config::redacted(url)
                ));
            }
        }
        Ok(())
    }
}

/// How often reservation and heartbeat-age gauges are recomputed.
const GAUGE_REFRESH: Duration = Duration::from_secs(5);

/// Why placement-svc could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Ledger(#[from] ledger_client::LedgerError),
    #[error(transparent)]
    Tls(#[from] mtls::TlsError),
}

/// A placement-svc that is serving.
pub struct RunningPlacement {
    addr: SocketAddr,
    serving: Serving,
}

impl RunningPlacement {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn stop(self) {
        self.serving.stop().await;
    }
}

/// Connects the store, binds the port and serves until [`RunningPlacement::stop`].
pub async fn start(config: PlacementConfig) -> Result<RunningPlacement, StartError> {
    config.validate().map_err(StartError::Config)?;
    let docs = match &config.ledger_endpoint {
        Some(endpoint) => Some(NodeDocs::new(
            ledger_client::LedgerClient::connect_lazy(endpoint, &config.security)?,
            config.node_doc_interval,
        )),
        None => None,
    };
    match &config.store {
        StoreConfig::Memory => {
            let seed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let store = MemoryStore::new(config.accounting, &config.rank, config.expiry, seed);
            serve(config, store, docs).await
        }
        StoreConfig::Redis { url, prefix } => {
            let store = RedisStore::connect(url, prefix, config.accounting, &config.rank, config.expiry).await?;
            serve(config, store, docs).await
        }
    }
}

async fn serve<S: PlacementStore>(
    config: PlacementConfig,
    store: S,
    docs: Option<NodeDocs>,
) -> Result<RunningPlacement, StartError> {
    let listener = Listener::bind(config.listen).await?;
    let addr = listener.addr();
    let mut serving = Serving::new();
    let store = Arc::new(store);
    // Gauges stay as fresh as a scrape needs, whether or not anyone calls Nodes.
    let gauges = store.clone();
    serving.background(tokio::spawn(async move {
        let mut tick = tokio::time::interval(GAUGE_REFRESH);
        loop {
            tick.tick().await;
            if let Ok(nodes) = gauges.gauges().await {
                crate::api::publish_gauges(&nodes, common::clock::now_ms());
            }
        }
    }));
    let api = PlacementApi::new(store, config.rank.unhealthy_after_ms, docs)
        .with_node_identity(matches!(config.security, mtls::Security::MutualTls(_)));
    serving.grpc(
        "placement-svc",
        listener,
        Grpc::new()
            .secure(&config.security, &[POLICY])?
            .service(PlacementServer::new(api))
            .await,
    );
    tracing::info!(%addr, store = ?config.store, accounting = config.accounting.name(), "placement-svc serving");
    Ok(RunningPlacement { addr, serving })
}

#[cfg(test)]
mod policy_tests {
    #[test]
    fn the_logged_store_hides_its_password() {
        let store = super::StoreConfig::Redis {
            url: "redis://:s3cret@redis:6379".into(),
            prefix: "p".into(),
        };
        let logged = format!("{store:?}");
        assert!(!logged.contains("s3cret") && logged.contains("redis:6379"), "{logged}");
    }

    #[test]
    fn the_policy_names_every_rpc_of_placement() {
        let proto = include_str!("../../proto/proto/sandboxsched/placement.proto");
        super::POLICY.check_against_proto(proto).unwrap();
    }
}
