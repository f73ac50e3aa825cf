//! E2B's admin routes over the cluster's nodes (`X-Admin-Token`, not a team's key).

use super::*;

pub(super) fn node_json(n: &proto::placement::v1::NodeView) -> Value {
    let state = match proto::placement::v1::NodeState::try_from(n.state) {
        Ok(proto::placement::v1::NodeState::Ready) => "ready",
        Ok(proto::placement::v1::NodeState::Draining) => "draining",
        _ => "unhealthy",
    };
    let cap = n.capacity.unwrap_or_default();
    let believed = n.believed.unwrap_or_default();
    json!({
        "nodeID": n.node_id,
        "status": state,
        "sandboxCount": n.reported_sandboxes,
        "cpuCount": cap.vcpus,
        "memoryMB": cap.memory_bytes / (1024 * 1024),
        "allocatedCPU": believed.vcpus,
        "allocatedMemoryMiB": believed.memory_bytes / (1024 * 1024),
        "memoryUsedMiB": n.memory_used_bytes / (1024 * 1024),
        "pending": n.pending,
        "unconfirmed": n.unconfirmed,
        "heartbeatAgeMs": n.heartbeat_age_ms,
    })
}

pub async fn nodes(State(g): State<Gateway>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    g.admin(&headers).await?;
    let nodes = g.sandboxes.nodes().await?;
    Ok(Json(Value::Array(nodes.iter().map(node_json).collect())))
}

pub async fn node(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
) -> Result<Json<Value>, ApiError> {
    g.admin(&headers).await?;
    let nodes = g.sandboxes.nodes().await?;
    let node = nodes
        .iter()
        .find(|n| n.node_id == id)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("node {id} not found")))?;
    Ok(Json(node_json(node)))
}
