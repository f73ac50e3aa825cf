//! Reading the cluster for the checker: manifests from the ledger, listings from every node,
//! placement's belief about each node, sandbox folders and cgroups on the host, and the files
//! clients were told they wrote.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use proto::node::v1 as node_pb;
use proto::node::v1::node_client::NodeClient;
use proto::placement::v1 as pl;
use proto::placement::v1::placement_client::PlacementClient;
use tonic::transport::Channel;

use super::check::{Belief, Copy, Manifest, NodeHolding, Observation};
use super::cluster::{Cluster, API_KEY};

async fn channel(endpoint: &str, peer: stack::Role, certs: &stack::Certs) -> anyhow::Result<Channel> {
    Ok(certs
        .endpoint(endpoint, peer)?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect()
        .await?)
}

/// What `node` lists, every sandbox with its state and epoch.
pub async fn listing(endpoint: &str, certs: &stack::Certs) -> anyhow::Result<Vec<node_pb::SandboxInfo>> {
    let mut node = NodeClient::new(channel(endpoint, stack::Role::Node, certs).await?);
    Ok(node.list(node_pb::ListRequest {}).await?.into_inner().sandboxes)
}

/// Kills `sandbox` on the node at `endpoint` under the epoch the node holds for it: behind
/// the control plane's back (the teardown, and the planted loss).
pub async fn kill_on_node(endpoint: &str, sandbox: &node_pb::SandboxInfo, certs: &stack::Certs) -> anyhow::Result<()> {
    let mut node = NodeClient::new(channel(endpoint, stack::Role::Node, certs).await?);
    node.kill(node_pb::LifecycleRequest {
        operation_id: format!("chaos-kill-{}-{}", sandbox.sandbox_id, uuid::Uuid::new_v4().simple()),
        epoch: sandbox.epoch,
        sandbox_id: sandbox.sandbox_id.clone(),
    })
    .await?;
    Ok(())
}

fn names_in(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

fn phase(p: SandboxPhase) -> &'static str {
    match p {
        SandboxPhase::Creating => "creating",
        SandboxPhase::Running => "running",
        SandboxPhase::Paused => "paused",
        SandboxPhase::Hibernated => "hibernated",
    }
}

/// The cluster as it stands: fails when any part cannot be read (the caller tries again).
pub async fn observe(cluster: &Cluster) -> anyhow::Result<Observation> {
    let ledger =
        ledger_client::LedgerClient::connect_lazy(&cluster.ledger, &cluster.certs.security(stack::Role::Operator))?;
    let (docs, _) = ledger
        .list::<SandboxDoc>(SANDBOX_KIND, "")
        .await
        .context("ledger list")?;
    let manifests = docs
        .into_iter()
        .map(|d| Manifest {
            id: d.value.sandbox_id,
            phase: phase(d.value.phase).to_string(),
            node_id: d.value.node_id,
            owner: d.value.lifecycle_owner.unwrap_or_default(),
        })
        .collect();
    let mut placement =
        PlacementClient::new(channel(&cluster.placements[0], stack::Role::Placement, &cluster.certs).await?);
    let views: BTreeMap<String, pl::NodeView> = placement
        .nodes(pl::NodesRequest {})
        .await
        .context("placement nodes")?
        .into_inner()
        .nodes
        .into_iter()
        .map(|v| (v.node_id.clone(), v))
        .collect();
    let mut nodes = BTreeMap::new();
    for node in &cluster.nodes {
        let listed = listing(&node.endpoint, &cluster.certs)
            .await
            .with_context(|| format!("list {}", node.id))?;
        let memory_parent = Path::new("/sys/fs/cgroup/memory").join(node_svc::runtime::cgroup::parent_name(&node.id));
        nodes.insert(
            node.id.clone(),
            NodeHolding {
                copies: listed
                    .iter()
                    .map(|s| Copy {
                        id: s.sandbox_id.clone(),
                        running: s.state == node_pb::SandboxState::Running as i32,
                        vcpus: s.resources.unwrap_or_default().vcpus,
                    })
                    .collect(),
                folders: names_in(&node.state_dir.join("sandboxes")),
                cgroups: names_in(&memory_parent),
                belief: views.get(&node.id).map(|v| Belief {
                    vcpus: v.believed.unwrap_or_default().vcpus,
                    sandboxes: v.reported_sandboxes,
                    pending: v.pending,
                    unconfirmed: v.unconfirmed,
                }),
            },
        );
    }
    Ok(Observation {
        manifests,
        nodes,
        files: BTreeMap::new(),
    })
}

/// Reads back every file in `expected` through the first gateway (resuming a paused sandbox
/// first): (sandbox, path) → content, `None` when it could not be read.
pub async fn read_files(
    cluster: &Cluster,
    http: &reqwest::Client,
    tokens: &BTreeMap<String, String>,
    expected: impl Iterator<Item = (String, String)>,
    paused: &BTreeSet<String>,
) -> BTreeMap<(String, String), Option<String>> {
    let gateway = &cluster.gateways[0];
    let mut resumed = BTreeSet::new();
    let mut files = BTreeMap::new();
    for (id, path) in expected {
        if paused.contains(&id) && resumed.insert(id.clone()) {
            let _ = http
                .post(format!("{gateway}/sandboxes/{id}/connect"))
                .header("X-API-Key", API_KEY)
                .header("Content-Type", "application/json")
                .body(r#"{"timeout": 3600}"#)
                .send()
                .await;
        }
        let token = tokens.get(&id).cloned().unwrap_or_default();
        let read = async {
            let r = http
                .get(format!("{gateway}/files?path={path}&username=user"))
                .header("E2b-Sandbox-Id", &id)
                .header("X-Access-Token", token)
                .send()
                .await
                .ok()?;
            if !r.status().is_success() {
                return None;
            }
            r.text().await.ok()
        };
        let content = read.await;
        files.insert((id, path), content);
    }
    files
}
