//! The test cluster the migration tests share: a ledger on SQLite, placement in memory
//! publishing node documents, and node-svcs running real process sandboxes; helpers to put
//! sandboxes and plans on it and to check the one-running-copy invariant.

#![allow(dead_code)] // each test file uses its own part of the kit

use std::time::Duration;

use balance_svc::migrate::Halt;
use balance_svc::record::{PlanDoc, PLAN_KIND};
use balance_svc::server::{BalanceConfig, RunningBalance};
use common::docs::{EstimateSource, NodeDoc, SandboxDoc, SandboxPhase, NODE_KIND, SANDBOX_KIND};
use ledger_client::{LedgerClient, Txn};
use node_svc::server::RunningNode;
use proto::node::v1 as npb;
use proto::node::v1::node_client::NodeClient;

pub struct Cluster {
    pub stack: stack::Stack,
    pub client: LedgerClient,
}

pub async fn cluster(node_memory_mb: &[u64]) -> Cluster {
    common::telemetry::init("balance-test");
    let mut builder = stack::Stack::builder();
    for &mb in node_memory_mb {
        builder = builder.node(move |c| c.host.capacity.memory_bytes = mb << 20);
    }
    let stack = builder.start().await.expect("the test stack starts");
    let client = stack.ledger_client.clone();
    let cluster = Cluster { stack, client };
    // Every node has a document (placement wrote it from a heartbeat).
    cluster
        .until("every node has a document", || async {
            let (docs, _) = cluster.client.list::<NodeDoc>(NODE_KIND, "").await.ok()?;
            (docs.len() == cluster.stack.nodes.len()).then_some(())
        })
        .await;
    cluster
}

impl Cluster {
    pub fn node_id(&self, i: usize) -> String {
        self.stack.nodes[i].id.clone()
    }

    pub fn node(&self, i: usize) -> &RunningNode {
        &self.stack.nodes[i].running
    }

    /// Polls `check` until it answers (the state it waits for is in other processes' hands),
    /// failing loudly after 30 s.
    pub async fn until<T, F, Fut>(&self, what: &str, check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        stack::until(what, Duration::from_secs(30), check).await
    }

    /// Creates a process sandbox of 64 MiB on node `i` (no manifest).
    pub async fn create_on(&self, i: usize, id: &str, start_command: &str) {
        let mut grpc = NodeClient::new(self.stack.channel(&self.node(i).endpoint(), stack::Role::Node));
        grpc.create(npb::CreateRequest {
            operation_id: format!("create-{id}-{i}"),
            epoch: 1,
            sandbox_id: id.to_string(),
            template: "base".into(),
            // Room for envd and a hog's 60 MB: the container's memory limit counts both.
            resources: Some(npb::Resources {
                vcpus: 1,
                memory_bytes: 256 << 20,
                disk_bytes: 0,
            }),
            start_command: start_command.to_string(),
            ..Default::default()
        })
        .await
        .unwrap();
    }

    /// A running process sandbox on node `i` with a file in its home, and its manifest.
    pub async fn sandbox(&self, i: usize, id: &str, start_command: &str) {
        let node = self.node(i);
        self.create_on(i, id, start_command).await;
        std::fs::write(node.host().home(id).join("notes.txt"), format!("files of {id}")).unwrap();
        let manifest = SandboxDoc {
            sandbox_id: id.to_string(),
            team_id: "team".into(),
            template: "base".into(),
            vcpus: 1,
            memory_bytes: 64 << 20,
            memory_source: EstimateSource::Request,
            phase: SandboxPhase::Running,
            node_id: self.node_id(i),
            node_address: node.endpoint(),
            envd_address: node.envd_endpoint(),
            epoch: 1,
            end_at_unix_ms: u64::MAX / 2,
            ..SandboxDoc::default()
        };
        self.client
            .compare(Txn::new().create(SANDBOX_KIND, id, &manifest).unwrap())
            .await
            .unwrap();
    }

    /// Commits a plan of one move, as the balancer would.
    pub async fn plan_one(&self, plan_id: &str, sandbox: &str, from: usize, to: usize) {
        self.plan_one_via(plan_id, sandbox, from, to, &self.node(to).endpoint())
            .await;
    }

    /// Commits a plan of one move whose executor reaches the target at `to_address` (a fault
    /// proxy in front of node `to`).
    pub async fn plan_one_via(&self, plan_id: &str, sandbox: &str, from: usize, to: usize, to_address: &str) {
        self.plan_one_between(plan_id, sandbox, (from, &self.node(from).endpoint()), (to, to_address))
            .await;
    }

    /// Commits a plan of one move whose executor reaches source and target at the given
    /// addresses (fault proxies in front of them).
    pub async fn plan_one_between(&self, plan_id: &str, sandbox: &str, from: (usize, &str), to: (usize, &str)) {
        let doc = PlanDoc::one_move(
            plan_id,
            sandbox,
            (&self.node_id(from.0), from.1),
            (&self.node_id(to.0), to.1),
            64 << 20,
        );
        self.client
            .compare(Txn::new().create(PLAN_KIND, plan_id, &doc).unwrap())
            .await
            .unwrap();
    }

    pub fn balance_config(&self) -> BalanceConfig {
        let mut config = BalanceConfig::new("127.0.0.1:0".parse().unwrap(), self.stack.ledger_endpoint());
        config.placement_endpoint = Some(self.stack.placement_endpoint());
        config.security = self.stack.security(stack::Role::Balance);
        config.tuning.interval = Duration::from_millis(100);
        config.lease_ttl = Duration::from_millis(600);
        config.tuning.stale_after = Duration::from_secs(5);
        config
    }

    pub async fn balance(&self, halt: Option<Halt>) -> RunningBalance {
        let mut config = self.balance_config();
        config.halt = halt;
        balance_svc::server::start(config).await.unwrap()
    }

    /// A balance-svc that reaches the ledger at `ledger_endpoint` (a fault proxy).
    pub async fn balance_via(&self, ledger_endpoint: &str) -> RunningBalance {
        let mut config = self.balance_config();
        config.ledger_endpoint = ledger_endpoint.to_string();
        balance_svc::server::start(config).await.unwrap()
    }

    /// The state of sandbox `id` on node `i` (`None`: no copy there).
    pub async fn state_on(&self, i: usize, id: &str) -> Option<node_svc::sandbox::State> {
        self.node(i).host().get(id).await.map(|r| r.state)
    }

    /// Rewrites sandbox `id`'s manifest as `change` makes it (against the version read); the
    /// manifest as written.
    pub async fn edit_manifest(&self, id: &str, change: impl FnOnce(&mut SandboxDoc)) -> SandboxDoc {
        let doc = self.client.get::<SandboxDoc>(SANDBOX_KIND, id).await.unwrap().unwrap();
        let mut value = doc.value.clone();
        change(&mut value);
        self.client
            .compare(Txn::new().update_read(&doc, &value).unwrap())
            .await
            .unwrap();
        value
    }

    /// A sandbox on node `i` with no manifest (as if its manifest were gone), paused or not.
    pub async fn bare_copy(&self, i: usize, id: &str, paused: bool) {
        self.create_on(i, id, "sleep 600").await;
        if paused {
            self.pause(i, id).await;
        }
    }

    pub async fn pause(&self, i: usize, id: &str) {
        let mut grpc = NodeClient::new(self.stack.channel(&self.node(i).endpoint(), stack::Role::Node));
        grpc.pause(npb::LifecycleRequest {
            operation_id: format!("pause-{id}-{i}"),
            epoch: 1,
            sandbox_id: id.to_string(),
        })
        .await
        .unwrap();
    }

    pub async fn finished_plan(&self, plan_id: &str) -> PlanDoc {
        self.until(&format!("plan {plan_id} finished"), || async {
            let plan = self.client.get::<PlanDoc>(PLAN_KIND, plan_id).await.ok()??;
            plan.value.finished_at_unix_ms.is_some().then_some(plan.value)
        })
        .await
    }

    /// The invariant: running on exactly one node (the one the manifest names, with
    /// its start command's process alive), unowned, with its files.
    pub async fn assert_runs_once(&self, id: &str, on: usize) {
        let manifest = self
            .client
            .get::<SandboxDoc>(SANDBOX_KIND, id)
            .await
            .unwrap()
            .unwrap()
            .value;
        assert_eq!(manifest.node_id, self.node_id(on), "{manifest:?}");
        assert_eq!(manifest.node_address, self.node(on).endpoint());
        assert_eq!(manifest.envd_address, self.node(on).envd_endpoint());
        assert_eq!(manifest.lifecycle_owner, None);
        for (i, node) in self.stack.nodes.iter().map(|n| &n.running).enumerate() {
            let record = node.host().get(id).await;
            if i == on {
                let record = record.unwrap_or_else(|| panic!("{id} is not on node {i}"));
                assert_eq!(record.state, node_svc::sandbox::State::Running, "{record:?}");
                assert!(record.pgid > 0, "its start command runs: {record:?}");
                assert!(
                    alive(record.pgid),
                    "the start command's process {} is gone",
                    record.pgid
                );
                let notes = std::fs::read_to_string(node.host().home(id).join("notes.txt")).unwrap();
                assert_eq!(notes, format!("files of {id}"));
            } else {
                assert!(record.is_none(), "a second copy of {id} is on node {i}: {record:?}");
            }
        }
    }

    pub async fn stop(self) {
        for node in &self.stack.nodes {
            node.running.kill_all().await.expect("every test sandbox is killed");
        }
        self.stack.shut_down().await;
    }
}

/// The process exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}
