//! Starting and stopping balance-svc: the balance loop and its gRPC server. Used by the
//! binary, the launcher and the tests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::serve::{BindError, Grpc, Listener, Serving};
use ledger_client::LedgerClient;
use proto::balance::v1::balance_server::BalanceServer;
use proto::placement::v1::placement_client::PlacementClient;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::api::BalanceApi;
use crate::balancer::{BalanceTuning, Balancer};
use crate::lease::Lease;
use crate::migrate::{Budget, Halt, MoveError, Mover};

/// The executor lease's default time to live. A replica that dies holding it is replaced
/// after this long (then its moves resume or roll back); renewals go out every sixth of it.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(3);

/// How balance-svc runs.
#[derive(Clone, Debug)]
pub struct BalanceConfig {
    pub listen: SocketAddr,
    pub ledger_endpoint: String,
    /// placement-svc, told about drains and moved sandboxes (optional).
    pub placement_endpoint: Option<String>,
    pub tuning: BalanceTuning,
    /// Moves at once, in all and per node.
    pub budget: Budget,
    pub lease_ttl: Duration,
    /// This replica's name in the lease (default: a fresh UUID).
    pub holder: Option<String>,
    /// Crash tests only: stop the loop as if the process died at this point of a move.
    pub halt: Option<Halt>,
    /// Mutual TLS with the cluster's certificates (every binary), or plaintext for a test.
    pub security: mtls::Security,
}

/// Who may call the balancer: the operator only (status, history, drain, pause and the
/// dead-target override all belong to whoever runs the cluster). The console shows and
/// drains and pauses, but cannot declare a target dead: that override can make two copies
/// of a sandbox if it is wrong, and stays with the operator's own key.
pub const POLICY: mtls::Policy = mtls::Policy {
    service: "sandboxsched.balance.v1.Balance",
    rules: &[
        (
            &["Status", "History", "GetPlan", "Drain", "SetPaused"],
            &[mtls::Role::Operator, mtls::Role::Console],
        ),
        (&["ReleaseTarget"], &[mtls::Role::Operator]),
    ],
};

impl BalanceConfig {
    pub fn new(listen: SocketAddr, ledger_endpoint: String) -> Self {
        Self {
            listen,
            ledger_endpoint,
            placement_endpoint: None,
            tuning: BalanceTuning::default(),
            budget: Budget::DEFAULT,
            lease_ttl: DEFAULT_LEASE_TTL,
            holder: None,
            halt: None,
            security: mtls::Security::Plaintext,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        let p = &self.tuning.plan;
        if !(p.threshold > 0.0 && p.threshold < 1.0) {
            return Err(format!("threshold must be in (0, 1) (got {})", p.threshold));
        }
        if !(p.target >= 0.0 && p.target < p.threshold) {
            return Err(format!(
                "target must be >= 0 and below the threshold {} (got {}), or balancing would flap",
                p.threshold, p.target
            ));
        }
        if self.budget.concurrency == 0 || self.budget.per_node == 0 {
            return Err("concurrency and moves per node must be at least 1".into());
        }
        if self.tuning.interval.is_zero() {
            return Err("interval must be positive".into());
        }
        if self.lease_ttl < Duration::from_millis(300) {
            return Err(format!(
                "the lease TTL ({:?}) must be at least 300ms: it is renewed every sixth of it",
                self.lease_ttl
            ));
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Ledger(#[from] ledger_client::LedgerError),
    #[error("bad placement endpoint: {0}")]
    Placement(String),
    #[error(transparent)]
    Tls(#[from] mtls::TlsError),
}

/// A balance-svc that is serving and balancing.
pub struct RunningBalance {
    addr: SocketAddr,
    serving: Serving,
    /// `None` once awaited by [`RunningBalance::loop_done`].
    looping: Option<JoinHandle<()>>,
}

impl RunningBalance {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Whether the balance loop ended by itself (only a crash-test halt or a fence does that).
    pub fn loop_ended(&self) -> bool {
        self.looping.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits for the loop to end (crash tests: until the injected halt).
    pub async fn loop_done(&mut self) {
        if let Some(looping) = self.looping.take() {
            let _ = looping.await;
        }
    }

    /// Stops serving and ends the balance loop after its current cycle (which releases the
    /// lease, so another executor can take over at once).
    pub async fn stop(mut self) {
        let looping = self.looping.take();
        self.serving.stop().await;
        if let Some(looping) = looping {
            let _ = looping.await;
        }
    }
}

/// Binds, serves gRPC and runs the balance loop until [`RunningBalance::stop`].
pub async fn start(config: BalanceConfig) -> Result<RunningBalance, StartError> {
    config.validate().map_err(StartError::Config)?;
    let ledger = LedgerClient::connect_lazy(&config.ledger_endpoint, &config.security)?;
    let placement = match &config.placement_endpoint {
        Some(endpoint) => Some(PlacementClient::new(common::trace::traced(
            config
                .security
                .endpoint(endpoint, mtls::Role::Placement)
                .map_err(|e| StartError::Placement(e.to_string()))?
                .connect_timeout(Duration::from_secs(2))
                .connect_lazy(),
        ))),
        None => None,
    };
    let holder = config
        .holder
        .clone()
        .unwrap_or_else(|| format!("balance-{}", uuid::Uuid::new_v4().simple()));
    let lease = Lease::new(ledger.clone(), holder, config.lease_ttl);
    let mover = Mover::new(ledger.clone(), placement.clone(), config.budget)
        .with_halt(config.halt)
        .with_lease(lease.clone())
        .with_security(config.security.clone());
    let balancer = Arc::new(Balancer::new(ledger.clone(), lease, mover, config.tuning.clone()));
    let api = BalanceApi::new(ledger, placement, balancer.known());

    let listener = Listener::bind(config.listen).await?;
    let addr = listener.addr();
    let mut serving = Serving::new();
    serving.grpc(
        "balance-svc",
        listener,
        Grpc::new()
            .secure(&config.security, &[POLICY])?
            .service(BalanceServer::new(api))
            .await,
    );
    let looping = tokio::spawn(balance_loop(balancer, config.tuning.interval, serving.stopping()));
    tracing::info!(%addr, "balance-svc serving");
    Ok(RunningBalance {
        addr,
        serving,
        looping: Some(looping),
    })
}

/// Cycles every `interval` until stopped. Errors are logged and the next cycle tries again;
/// only a halt (crash tests) or a fence ends the loop's current work.
async fn balance_loop(balancer: Arc<Balancer>, interval: Duration, mut stopped: watch::Receiver<bool>) {
    // The keeper lives exactly as long as this loop: a loop halted by fault injection stops
    // renewing, as a dead process would.
    struct Keeper(tokio::task::JoinHandle<()>);
    impl Drop for Keeper {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let _keeper = Keeper(balancer.lease().spawn_keeper());
    let mut ledger_down = false;
    loop {
        match balancer.cycle().await {
            Ok(_) => {
                if ledger_down {
                    tracing::info!("ledger reachable again; balancing resumed");
                    ledger_down = false;
                }
                metrics::gauge!("balance_ledger_up").set(1.0);
            }
            Err(crate::balancer::CycleError::Move(MoveError::Halted(step))) => {
                tracing::warn!(step, "balance loop halted by fault injection");
                return;
            }
            Err(crate::balancer::CycleError::Move(MoveError::Fenced(why))) => {
                tracing::warn!(%why, "another executor acts now; this one stands down until it holds the lease");
            }
            Err(crate::balancer::CycleError::Ledger(err)) if err.is_transient() => {
                metrics::gauge!("balance_ledger_up").set(0.0);
                if !ledger_down {
                    tracing::error!(%err, "ledger unreachable; balancing waits for it");
                    ledger_down = true;
                }
            }
            Err(err) => tracing::warn!(%err, "balance cycle failed; trying again next interval"),
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            // A replica that just became the executor finishes what the last one left at once.
            _ = balancer.lease().taken() => {}
            _ = stopped.wait_for(|s| *s) => break,
        }
    }
    balancer.lease().release().await;
}

#[cfg(test)]
mod policy_tests {
    #[test]
    fn the_policy_names_every_rpc_of_the_balancer() {
        let proto = include_str!("../../proto/proto/sandboxsched/balance.proto");
        super::POLICY.check_against_proto(proto).unwrap();
    }
}
