//! Starting and stopping a ledger: the one place that wires store, committer, head tracker
//! and gRPC server together. Used by the `ledger-svc` binary, the launcher and the tests.

use std::net::SocketAddr;
use std::time::Duration;

use common::serve::{BindError, Grpc, Listener, Serving};

use crate::api::LedgerApi;
use crate::committer::Committer;
use crate::head::HeadTracker;
use crate::store::{Store, StoreError};
use mtls::Role;
use proto::ledger::v1::ledger_server::LedgerServer;
use tonic::server::NamedService;

/// How a ledger runs.
#[derive(Clone, Debug)]
pub struct LedgerConfig {
    /// Where gRPC listens; port 0 picks a free one.
    pub listen: SocketAddr,
    /// `sqlite://PATH` (embedded default) or `postgres://…`.
    pub database_url: String,
    /// Change-log revisions kept for watchers that reconnect; older ones are compacted.
    pub retain_revisions: u64,
    /// How often the head is polled (other replicas' commits, database health).
    pub poll_interval: Duration,
    /// How often the change log is compacted.
    pub compact_interval: Duration,
    /// Longest a write batch may take before its callers are answered "outcome unknown" (or
    /// "not applied", if COMMIT was never sent).
    pub commit_deadline: Duration,
    /// Mutual TLS with the cluster's certificates (every binary), or plaintext for a test.
    pub security: mtls::Security,
}

/// Who may call the ledger: the services that keep documents in it, and the operator to read
/// them (and the console, which writes nothing). Nodes and sandboxes never talk to the ledger.
pub const POLICY: mtls::Policy = mtls::Policy {
    service: <LedgerServer<LedgerApi> as NamedService>::NAME,
    rules: &[
        (
            &["Get", "List", "Watch"],
            &[
                Role::Gateway,
                Role::Placement,
                Role::Balance,
                Role::Operator,
                Role::Console,
            ],
        ),
        // Each of them writes only the kinds it owns, and the operator any (`writers`).
        (
            &["Compare"],
            &[Role::Gateway, Role::Placement, Role::Balance, Role::Operator],
        ),
    ],
};

impl LedgerConfig {
    pub fn new(listen: SocketAddr, database_url: impl Into<String>) -> Self {
        Self {
            listen,
            database_url: database_url.into(),
            retain_revisions: 100_000,
            poll_interval: Duration::from_millis(200),
            compact_interval: Duration::from_secs(60),
            commit_deadline: crate::committer::COMMIT_DEADLINE,
            security: mtls::Security::Plaintext,
        }
    }
}

/// Why a ledger could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Tls(#[from] mtls::TlsError),
}

/// A ledger that is serving.
pub struct RunningLedger {
    addr: SocketAddr,
    serving: Serving,
    store: Store,
    tracker: HeadTracker,
}

impl RunningLedger {
    /// The address gRPC listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, ready for a client.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Compacts the change log now, keeping the newest `retain` revisions; returns the
    /// compaction point. (A background task does this every `compact_interval` anyway.)
    pub async fn compact(&self, retain: u64) -> Result<u64, StoreError> {
        self.tracker.compact(&self.store, retain).await
    }

    /// Stops serving: ends watch streams, lets in-flight calls finish, closes the database.
    pub async fn stop(self) {
        self.serving.stop().await;
        self.store.close().await;
    }
}

/// Opens the database (waiting, with backoff, for it to become reachable), applies the
/// migrations, binds the port and serves until [`RunningLedger::stop`].
pub async fn start(config: LedgerConfig) -> Result<RunningLedger, StartError> {
    let store = Store::open(&config.database_url)?;
    let mut backoff = common::retry::backoff(Duration::from_millis(100), Duration::from_secs(5));
    let head = loop {
        match store.migrate().await.and(store.head().await) {
            Ok(head) => break head,
            Err(StoreError::Unavailable(reason)) => {
                let pause = backoff.next().unwrap_or(Duration::from_secs(5));
                tracing::warn!(%reason, retry_in = ?pause, "database not reachable yet");
                tokio::time::sleep(pause).await;
            }
            Err(err) => return Err(err.into()),
        }
    };
    let listener = Listener::bind(config.listen).await?;
    let addr = listener.addr();
    let mut serving = Serving::new();

    let tracker = HeadTracker::new(head);
    let (committer, committer_task) = Committer::spawn(store.clone(), tracker.clone(), config.commit_deadline);
    serving.background(committer_task);
    serving.background(tracker.spawn_poller(store.clone(), config.poll_interval));
    serving.background(tracker.spawn_compactor(store.clone(), config.retain_revisions, config.compact_interval));

    // Watch streams end when the ledger is told to stop, so stopping does not wait on them.
    let api = LedgerApi::new(store.clone(), committer, tracker.clone(), serving.stopping())
        .with_owners(matches!(config.security, mtls::Security::MutualTls(_)));
    let grpc = Grpc::new()
        .secure(&config.security, &[POLICY])?
        .service(LedgerServer::new(api))
        .await;
    let health_reporter = grpc.health();
    let mut health = tracker.health();
    serving.background(tokio::spawn(async move {
        while health.changed().await.is_ok() {
            let up = *health.borrow_and_update();
            if up {
                health_reporter.set_serving::<LedgerServer<LedgerApi>>().await;
            } else {
                health_reporter.set_not_serving::<LedgerServer<LedgerApi>>().await;
            }
        }
    }));
    serving.grpc("ledger-svc", listener, grpc);
    tracing::info!(%addr, backend = ?store.backend(), revision = head.revision, "ledger-svc serving");
    Ok(RunningLedger {
        addr,
        serving,
        store,
        tracker,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_policy_names_every_rpc_of_the_ledger() {
        let proto = include_str!("../../proto/proto/sandboxsched/ledger.proto");
        super::POLICY.check_against_proto(proto).unwrap();
    }
}
