//! Shared by the gateway's tests: a whole stack (ledger on SQLite, placement in memory, one
//! container node, the gateway with two teams) from the project's stack builder, and an
//! HTTP caller.

#![allow(dead_code)]

use serde_json::Value;

/// The domain the test gateways serve sandbox hosts under (`{port}-{id}.sandbox.test`).
pub const DOMAIN: &str = "sandbox.test";

/// The operators' token of the test gateways (E2B's admin routes).
pub const ADMIN_TOKEN: &str = "admin-of-the-test-cluster";

/// A started stack with one node and a gateway.
pub struct Stack(pub stack::Stack);

impl std::ops::Deref for Stack {
    type Target = stack::Stack;
    fn deref(&self) -> &stack::Stack {
        &self.0
    }
}

impl std::ops::DerefMut for Stack {
    fn deref_mut(&mut self) -> &mut stack::Stack {
        &mut self.0
    }
}

pub async fn stack(node_memory_mb: u64) -> Stack {
    stack_of(&[node_memory_mb]).await
}

/// A stack with one node of each of these memory sizes (MiB).
pub async fn stack_of(nodes_memory_mb: &[u64]) -> Stack {
    stack_sized(nodes_memory_mb, None).await
}

/// A stack with one node of `node_memory_mb` and `vcpus`: for a test whose creates must not
/// run out of CPU before memory (the host's cores decide the default).
pub async fn stack_with_vcpus(node_memory_mb: u64, vcpus: u32) -> Stack {
    stack_sized(&[node_memory_mb], Some(vcpus)).await
}

/// `builder`'s stack, started, its gateway taking team-a's key alone (`key-a`) and whatever
/// `gateway` adds: for a test whose nodes are its own.
pub async fn started(
    builder: stack::StackBuilder,
    gateway: impl FnOnce(&mut e2b_gateway::server::GatewayConfig) + Send + 'static,
) -> Stack {
    let started = builder
        .heartbeat(std::time::Duration::from_millis(50))
        .gateway(|c| {
            c.keys = [("key-a".to_string(), "team-a".to_string())].into();
            gateway(c);
        })
        .start()
        .await
        .expect("the test stack starts");
    Stack(started)
}

async fn stack_sized(nodes_memory_mb: &[u64], vcpus: Option<u32>) -> Stack {
    let mut builder = stack::Stack::builder().heartbeat(std::time::Duration::from_millis(50));
    for &mb in nodes_memory_mb {
        builder = builder.node(move |c| {
            c.host.capacity.memory_bytes = mb << 20;
            if let Some(vcpus) = vcpus {
                c.host.capacity.vcpus = vcpus;
            }
        });
    }
    let started = builder
        .gateway(|c| {
            c.keys = [
                ("key-a".to_string(), "team-a".to_string()),
                ("key-b".to_string(), "team-b".to_string()),
            ]
            .into();
            c.reap_interval = std::time::Duration::from_millis(100);
            c.domain = DOMAIN.to_string();
            c.admin_token = Some(ADMIN_TOKEN.to_string());
        })
        .start()
        .await
        .expect("the test stack starts");
    Stack(started)
}

impl Stack {
    /// The stack's one node.
    pub fn node(&self) -> &node_svc::server::RunningNode {
        &self.0.nodes[0].running
    }

    pub fn url(&self) -> String {
        self.0.gateway_url()
    }

    /// What the gateway was started with, to start another like it.
    pub fn config(&self) -> e2b_gateway::server::GatewayConfig {
        self.0.gateway_config.clone().expect("the stack has a gateway")
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

    pub async fn stop(self) {
        self.0.shut_down().await;
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
