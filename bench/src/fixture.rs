//! What several benchmarks set up the same way: a running sandbox (a container) on a node with its
//! manifest in the ledger, as the gateway would leave it, for the balance executor to move.

use common::docs::{EstimateSource, SandboxDoc, SandboxPhase, SANDBOX_KIND};
use ledger_client::{LedgerClient, Txn};
use node_svc::server::RunningNode;
use proto::node::v1 as pb;
use proto::node::v1::node_client::NodeClient;

/// Creates sandbox `id` (`sleep 3600`, 1 vCPU, `memory_bytes`) on `node` and writes its
/// manifest naming `node_id`, reached at `address` (the node's own endpoint, or a proxy's).
pub async fn running_sandbox(
    ledger: &LedgerClient,
    certs: &stack::Certs,
    node: &RunningNode,
    (node_id, address): (&str, &str),
    id: &str,
    memory_bytes: u64,
) -> anyhow::Result<()> {
    let mut grpc = NodeClient::new(certs.endpoint(&node.endpoint(), stack::Role::Node)?.connect().await?);
    grpc.create(pb::CreateRequest {
        operation_id: format!("create-{id}"),
        epoch: 1,
        sandbox_id: id.into(),
        template: "base".into(),
        resources: Some(pb::Resources {
            vcpus: 1,
            memory_bytes,
            disk_bytes: 0,
        }),
        start_command: "sleep 3600".into(),
        ..Default::default()
    })
    .await?;
    let manifest = SandboxDoc {
        sandbox_id: id.into(),
        team_id: "bench".into(),
        template: "base".into(),
        vcpus: 1,
        memory_bytes,
        memory_source: EstimateSource::Request,
        phase: SandboxPhase::Running,
        node_id: node_id.into(),
        node_address: address.into(),
        envd_address: node.envd_endpoint(),
        epoch: 1,
        end_at_unix_ms: u64::MAX / 2,
        ..SandboxDoc::default()
    };
    ledger.compare(Txn::new().create(SANDBOX_KIND, id, &manifest)?).await?;
    Ok(())
}

/// Runs `process` (envd's `ProcessConfig` as JSON) in `sandbox` through the envd endpoint at
/// `url` (a node's, or the gateway's), as the SDK's `commands.run` sends it; `Ok` once it
/// ended with exit code 0.
pub async fn run_in(
    http: &reqwest::Client,
    url: &str,
    (sandbox, token): (&str, &str),
    process: serde_json::Value,
) -> anyhow::Result<()> {
    let payload = serde_json::json!({"process": process, "stdin": false}).to_string();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    framed.extend_from_slice(payload.as_bytes());
    let response = http
        .post(format!("{url}/process.Process/Start"))
        .header("E2b-Sandbox-Id", sandbox)
        .header("X-Access-Token", token)
        .header("Content-Type", "application/connect+json")
        .body(framed)
        .send()
        .await?;
    anyhow::ensure!(response.status().is_success(), "envd answered {}", response.status());
    let body = response.bytes().await?;
    let text = String::from_utf8_lossy(&body);
    anyhow::ensure!(text.contains("\"exitCode\":0"), "{process} did not exit 0: {text}");
    Ok(())
}

/// Resident memory of a process (`"self"` or a PID), in KiB, from `/proc/PROC/status`.
pub fn rss_kib(process: impl std::fmt::Display) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{process}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}
