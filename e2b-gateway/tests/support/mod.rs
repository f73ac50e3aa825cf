//! Shared by the gateway's tests: a whole stack (ledger on SQLite, placement in memory, one
//! process-runtime node, the gateway) on free ports, and an HTTP caller.

#![allow(dead_code)]

use std::time::Duration;

use e2b_gateway::server::{GatewayConfig, RunningGateway};
use serde_json::Value;

/// The domain the test gateways serve sandbox hosts under (`{port}-{id}.sandbox.test`).
pub const DOMAIN: &str = "sandbox.test";

pub struct Stack {
    pub ledger: ledger_svc::RunningLedger,
    pub placement: Option<placement_svc::server::RunningPlacement>,
    pub node: node_svc::server::RunningNode,
    pub gateway: Option<RunningGateway>,
    pub config: GatewayConfig,
    pub dir: std::path::PathBuf,
    pub node_id: String,
}

pub async fn stack(node_memory_mb: u64) -> Stack {
    let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_string();
    let dir = std::env::temp_dir().join(format!("gateway-test-{tag}"));
    let ledger = ledger_svc::start(ledger_svc::LedgerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        format!("sqlite://{}", dir.join("ledger.db").display()),
    ))
    .await
    .unwrap();
    let placement = placement_svc::server::start(placement_svc::server::PlacementConfig::new(
        "127.0.0.1:0".parse().unwrap(),
    ))
    .await
    .unwrap();
    let node_id = format!("g{tag}");
    let mut config = node_svc::server::NodeConfig::new("127.0.0.1:0".parse().unwrap(), &node_id, dir.join("node"));
    config.placement = Some(placement.endpoint());
    config.heartbeat_interval = Duration::from_millis(50);
    config.host.capacity.memory_bytes = node_memory_mb << 20;
    let node = node_svc::server::start(config).await.unwrap();
    let config = GatewayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        ledger: ledger.endpoint(),
        placement: placement.endpoint(),
        keys: [
            ("key-a".to_string(), "team-a".to_string()),
            ("key-b".to_string(), "team-b".to_string()),
        ]
        .into(),
        templates: e2b_gateway::intent::builtin_templates(),
        reap_interval: Duration::from_millis(100),
        hibernate_dir: dir.join("hibernated"),
        domain: DOMAIN.to_string(),
    };
    let gateway = e2b_gateway::server::start(config.clone()).await.unwrap();
    // Wait (bounded) until the node has registered with placement.
    let mut p = proto::placement::v1::placement_client::PlacementClient::connect(placement.endpoint())
        .await
        .unwrap();
    for _ in 0..200 {
        let nodes = p
            .nodes(proto::placement::v1::NodesRequest {})
            .await
            .unwrap()
            .into_inner()
            .nodes;
        if !nodes.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Stack {
        ledger,
        placement: Some(placement),
        node,
        gateway: Some(gateway),
        config,
        dir,
        node_id,
    }
}

impl Stack {
    pub fn url(&self) -> String {
        self.gateway.as_ref().expect("gateway running").url()
    }

    pub async fn call(&self, method: &str, path: &str, key: Option<&str>, body: Option<&str>) -> (u16, Value) {
        let client = reqwest::Client::new();
        let mut req = client.request(method.parse().unwrap(), format!("{}{path}", self.url()));
        if let Some(key) = key {
            req = req.header("X-API-Key", key);
        }
        if let Some(body) = body {
            req = req.header("Content-Type", "application/json").body(body.to_string());
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub async fn stop(mut self) {
        if let Some(g) = self.gateway.take() {
            g.stop().await;
        }
        self.node.stop().await;
        if let Some(p) = self.placement.take() {
            p.stop().await;
        }
        self.ledger.stop().await;
        let _ = std::fs::remove_dir_all(&self.dir);
        node_svc::runtime::cgroup::remove_parents(&self.node_id);
    }
}

pub fn assert_e2b_error(answer: &(u16, Value), status: u16) {
    assert_eq!(answer.0, status, "{answer:?}");
    assert_eq!(answer.1["code"], status, "{answer:?}");
    assert!(
        answer.1["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{answer:?}"
    );
}
