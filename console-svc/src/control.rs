//! What the console asks placement and the balancer, as the console's role: node views
//! (pending reservations, heartbeat ages, CPU), placement's explanation of a create, the
//! balancer's status and plans, drains and the pause switch.
//!
//! Each answer is shaped here into the JSON the pages draw, so the HTTP layer only maps
//! errors. Every call has a deadline: a page waits seconds at most for a peer that hangs.

use std::collections::BTreeMap;
use std::time::Duration;

use proto::balance::v1 as bpb;
use proto::balance::v1::balance_client::BalanceClient;
use proto::node::v1 as npb;
use proto::node::v1::node_client::NodeClient;
use proto::placement::v1 as ppb;
use proto::placement::v1::placement_client::PlacementClient;
use serde_json::{json, Value};
use tonic::transport::Channel;

/// How long a page waits for placement or the balancer.
pub const CALL_DEADLINE: Duration = Duration::from_secs(3);

/// Why a peer could not answer.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{peer} at {endpoint}: {reason}")]
    Endpoint {
        peer: &'static str,
        endpoint: String,
        reason: String,
    },
    #[error("{peer}: {status}", status = .status.message())]
    Call { peer: &'static str, status: tonic::Status },
    #[error("this console was started without a balancer")]
    NoBalancer,
}

impl ControlError {
    /// The peer's own refusal of a request (a node it does not know, a bad state), as
    /// opposed to the peer being unreachable.
    pub fn refused(&self) -> bool {
        matches!(self, ControlError::Call { status, .. } if matches!(
            status.code(),
            tonic::Code::InvalidArgument | tonic::Code::NotFound | tonic::Code::FailedPrecondition
        ))
    }
}

/// Clients of placement, the balancer and the nodes; cheap to clone.
#[derive(Clone)]
pub struct Control {
    security: mtls::Security,
    placement: PlacementClient<Channel>,
    balance: Option<BalanceClient<Channel>>,
    /// Node ID → (its address, a client that proves the node is that node).
    nodes: NodeClients,
}

/// Node ID → (the address it was dialled at, its client).
type NodeClients = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, (String, NodeClient<Channel>)>>>;

fn channel(security: &mtls::Security, endpoint: &str, peer: mtls::Role) -> Result<Channel, ControlError> {
    lazy(security.endpoint(endpoint, peer), peer.name(), endpoint)
}

/// A channel that connects on first use, with the console's timeouts.
fn lazy(
    endpoint: Result<tonic::transport::Endpoint, mtls::TlsError>,
    peer: &'static str,
    address: &str,
) -> Result<Channel, ControlError> {
    Ok(endpoint
        .map_err(|e| ControlError::Endpoint {
            peer,
            endpoint: address.to_string(),
            reason: e.to_string(),
        })?
        .connect_timeout(Duration::from_secs(2))
        .timeout(CALL_DEADLINE)
        .connect_lazy())
}

fn call(peer: &'static str) -> impl Fn(tonic::Status) -> ControlError {
    move |status| ControlError::Call { peer, status }
}

impl Control {
    /// Clients that connect on first use (the console starts before its peers answer). An
    /// empty `balance`: none (the balance page says so).
    pub fn new(security: &mtls::Security, placement: &str, balance: &str) -> Result<Self, ControlError> {
        let balance = (!balance.is_empty())
            .then(|| channel(security, balance, mtls::Role::Balance).map(BalanceClient::new))
            .transpose()?;
        Ok(Self {
            security: security.clone(),
            placement: PlacementClient::new(channel(security, placement, mtls::Role::Placement)?),
            balance,
            nodes: std::sync::Arc::default(),
        })
    }

    /// A client of node `node_id` at `address`, kept while the node keeps that address. The
    /// node must prove it is `node_id`: an address a stale document points elsewhere reaches
    /// no other node's answers.
    fn node(&self, node_id: &str, address: &str) -> Result<NodeClient<Channel>, ControlError> {
        let mut nodes = self.nodes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((known, client)) = nodes.get(node_id) {
            if known == address {
                return Ok(client.clone());
            }
        }
        let client = NodeClient::new(lazy(self.security.node_endpoint(address, node_id), "node", address)?);
        nodes.insert(node_id.to_string(), (address.to_string(), client.clone()));
        Ok(client)
    }

    /// A sandbox's newest log entries (at most `limit`, oldest first) from its node.
    pub async fn sandbox_logs(
        &self,
        node_id: &str,
        address: &str,
        sandbox_id: &str,
        limit: u32,
    ) -> Result<Value, ControlError> {
        let entries = self
            .node(node_id, address)?
            .logs(npb::LogsRequest {
                sandbox_id: sandbox_id.to_string(),
                limit,
                backward: true,
                ..Default::default()
            })
            .await
            .map_err(call("node"))?
            .into_inner()
            .entries;
        let mut entries: Vec<Value> = entries
            .iter()
            .map(|e| json!({"atMs": e.at_unix_ms, "level": e.level, "message": e.message}))
            .collect();
        entries.reverse();
        Ok(Value::Array(entries))
    }

    /// A sandbox's metrics samples over the hour its node keeps.
    pub async fn sandbox_metrics(&self, node_id: &str, address: &str, sandbox_id: &str) -> Result<Value, ControlError> {
        let samples = self
            .node(node_id, address)?
            .metrics(npb::MetricsRequest {
                sandbox_id: sandbox_id.to_string(),
                ..Default::default()
            })
            .await
            .map_err(call("node"))?
            .into_inner()
            .samples;
        Ok(Value::Array(
            samples
                .iter()
                .map(|s| json!({"t": s.at_unix_ms, "cpuPct": s.cpu_used_pct, "memMib": s.memory_used_bytes >> 20, "memTotalMib": s.memory_total_bytes >> 20}))
                .collect(),
        ))
    }

    fn balancer(&self) -> Result<BalanceClient<Channel>, ControlError> {
        self.balance.clone().ok_or(ControlError::NoBalancer)
    }

    /// Placement's view of each node: what its documents do not say (reservations in
    /// flight, unconfirmed creates, the heartbeat's age, CPU used).
    pub async fn nodes(&self) -> Result<BTreeMap<String, Value>, ControlError> {
        let nodes = self
            .placement
            .clone()
            .nodes(ppb::NodesRequest {})
            .await
            .map_err(call("placement"))?
            .into_inner()
            .nodes;
        Ok(nodes
            .into_iter()
            .map(|n| {
                let reserved = n.reserved.unwrap_or_default();
                let state = match ppb::NodeState::try_from(n.state) {
                    Ok(ppb::NodeState::Ready) => "ready",
                    Ok(ppb::NodeState::Draining) => "draining",
                    Ok(ppb::NodeState::Unhealthy) => "unhealthy",
                    _ => "unknown",
                };
                let value = json!({
                    "state": state,
                    "reservedMib": reserved.memory_bytes >> 20,
                    "reservedVcpus": reserved.vcpus,
                    "pending": n.pending,
                    "unconfirmed": n.unconfirmed,
                    "heartbeatAgeMs": n.heartbeat_age_ms,
                    "cpuUsed": (n.cpu_usage * 100.0).round() / 100.0,
                });
                (n.node_id, value)
            })
            .collect())
    }

    /// Where a sandbox of this size would land now, and why each node would or would not.
    pub async fn explain(&self, vcpus: u32, memory_mib: u64) -> Result<Value, ControlError> {
        let answer = self
            .placement
            .clone()
            .explain(ppb::PlaceRequest {
                sandbox_id: "console-explain".into(),
                resources: Some(ppb::Resources {
                    vcpus,
                    memory_bytes: memory_mib << 20,
                }),
                ..Default::default()
            })
            .await
            .map_err(call("placement"))?
            .into_inner();
        let candidates: Vec<Value> = answer
            .candidates
            .iter()
            .map(|c| json!({"nodeId": c.node_id, "feasible": c.feasible, "score": c.score, "reason": c.reason, "terms": c.terms}))
            .collect();
        Ok(json!({"chosen": answer.chosen, "candidates": candidates}))
    }

    /// The balancer's status and its newest plans with their moves.
    pub async fn balance(&self, limit: u32) -> Result<Value, ControlError> {
        let mut balance = self.balancer()?;
        let status = balance
            .status(bpb::StatusRequest {})
            .await
            .map_err(call("balance"))?
            .into_inner();
        let plans = balance
            .history(bpb::HistoryRequest { limit })
            .await
            .map_err(call("balance"))?
            .into_inner()
            .plans;
        let o = status.observation.unwrap_or_default();
        Ok(json!({
            "observation": {
                "status": o.status, "spread": o.spread, "readyNodes": o.ready_nodes,
                "observedAtMs": o.observed_at_unix_ms, "counts": o.counts,
            },
            "paused": status.paused,
            "activePlan": status.active_plan_id,
            "draining": status.draining_nodes,
            "leader": status.leader,
            "stuck": status.stuck.iter().map(|t| json!({
                "sandboxId": t.sandbox_id, "nodeId": t.node_id, "failures": t.failures,
                "error": t.error, "retryAtMs": t.retry_at_unix_ms,
            })).collect::<Vec<_>>(),
            "plans": plans.iter().map(plan_json).collect::<Vec<_>>(),
        }))
    }

    /// One plan with its moves as they stand now.
    pub async fn plan(&self, plan_id: &str) -> Result<Value, ControlError> {
        let plan = self
            .balancer()?
            .get_plan(bpb::GetPlanRequest {
                plan_id: plan_id.to_string(),
            })
            .await
            .map_err(call("balance"))?
            .into_inner();
        Ok(plan_json(&plan))
    }

    pub async fn drain(&self, node_id: &str, undo: bool) -> Result<Value, ControlError> {
        let answer = self
            .balancer()?
            .drain(bpb::DrainRequest {
                node_id: node_id.to_string(),
                undo,
            })
            .await
            .map_err(call("balance"))?
            .into_inner();
        Ok(json!({"draining": answer.draining_nodes, "remaining": answer.remaining_sandboxes}))
    }

    pub async fn set_paused(&self, paused: bool) -> Result<Value, ControlError> {
        let status = self
            .balancer()?
            .set_paused(bpb::SetPausedRequest { paused })
            .await
            .map_err(call("balance"))?
            .into_inner();
        Ok(json!({"paused": status.paused}))
    }
}

fn plan_json(p: &bpb::PlanView) -> Value {
    json!({
        "planId": p.plan_id, "state": p.state, "reason": p.reason,
        "spreadBefore": p.spread_before, "spreadExpected": p.spread_expected,
        "createdAtMs": p.created_at_unix_ms, "finishedAtMs": p.finished_at_unix_ms,
        "skips": p.skips,
        "moves": p.moves.iter().map(|m| json!({
            "moveId": m.move_id, "sandboxId": m.sandbox_id, "from": m.from_node, "to": m.to_node,
            "memoryMib": m.memory_bytes >> 20, "step": m.step, "epoch": m.epoch,
            "error": m.error, "downtimeMs": m.downtime_ms,
        })).collect::<Vec<_>>(),
        "drops": p.drops.iter().map(|d| json!({
            "sandboxId": d.sandbox_id, "from": d.from_node, "memoryMib": d.memory_bytes >> 20,
            "askedAtMs": d.asked_at_unix_ms,
        })).collect::<Vec<_>>(),
    })
}
