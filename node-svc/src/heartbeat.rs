//! Heartbeats to placement-svc: every interval, one consistent picture of the host, with
//! every sandbox listed by ID (what lets placement release a reservation exactly when the node
//! reports the sandbox, so creates and heartbeats can interleave in any order).

use common::clock::now_ms;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use proto::placement::v1 as pb;
use proto::placement::v1::placement_client::PlacementClient;
use tokio::task::JoinHandle;

use crate::host::{Host, Picture};
use crate::sandbox::State;

/// Where and how often to report.
#[derive(Clone, Debug)]
pub struct HeartbeatConfig {
    /// placement-svc (`http://HOST:PORT`).
    pub placement: String,
    pub interval: Duration,
    /// This node's gRPC endpoint, as placement should hand it out.
    pub address: String,
    pub labels: HashMap<String, String>,
    /// How the node proves it is a node to placement.
    pub security: mtls::Security,
}

/// The heartbeat message for one picture.
pub fn message(host: &Host, config: &HeartbeatConfig, seq: u64, picture: &Picture) -> pb::HeartbeatRequest {
    let capacity = host.capacity();
    pb::HeartbeatRequest {
        node_id: host.node_id().to_string(),
        boot_id: host.boot_id().to_string(),
        seq,
        measured_at_unix_ms: now_ms(),
        address: config.address.clone(),
        labels: config.labels.clone(),
        capacity: Some(pb::Resources {
            vcpus: capacity.vcpus,
            memory_bytes: capacity.memory_bytes,
        }),
        allocated: Some(pb::Resources {
            vcpus: picture.allocated.vcpus,
            memory_bytes: picture.allocated.memory_bytes,
        }),
        pooled: Some(pb::Resources {
            vcpus: picture.pooled.vcpus,
            memory_bytes: picture.pooled.memory_bytes,
        }),
        memory_used_bytes: picture.memory_used_bytes,
        memory_available_bytes: picture.memory_available_bytes,
        cpu_usage: picture.cpu_usage,
        templates: host.templates_held(),
        degraded: host.features().degraded,
        sandboxes: picture
            .sandboxes
            .iter()
            .map(|s| pb::SandboxReport {
                sandbox_id: s.sandbox_id.clone(),
                state: match s.state {
                    State::Running => pb::SandboxState::Running,
                    State::Paused | State::Killed => pb::SandboxState::Paused,
                } as i32,
                allocated: Some(pb::Resources {
                    vcpus: s.resources.vcpus,
                    memory_bytes: s.resources.memory_bytes,
                }),
                memory_used_bytes: s.memory_used_bytes,
            })
            .collect(),
    }
}

/// Sends a heartbeat every interval until the task is aborted. An unreachable placer is
/// logged once when it goes and once when it comes back; the node keeps running either way.
pub fn spawn(host: Arc<Host>, config: HeartbeatConfig) -> Result<JoinHandle<()>, mtls::TlsError> {
    let channel = config
        .security
        .endpoint(&config.placement, mtls::Role::Placement)?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect_lazy();
    let mut client = PlacementClient::new(channel);
    Ok(tokio::spawn(async move {
        let mut seq = 0u64;
        let mut reachable = true;
        let mut tick = tokio::time::interval(config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let picture = host.picture().await;
            seq += 1;
            let request = message(&host, &config, seq, &picture);
            match client.heartbeat(request).await {
                Ok(reply) => {
                    if !reachable {
                        tracing::info!(placement = %config.placement, "placement reachable again");
                        reachable = true;
                    }
                    let reply = reply.into_inner();
                    if !reply.applied {
                        tracing::debug!(reason = %reply.reason, seq, "heartbeat not applied");
                    }
                }
                Err(status) => {
                    if reachable {
                        tracing::warn!(placement = %config.placement, %status, "heartbeat failed; will keep trying");
                        reachable = false;
                    }
                }
            }
        }
    }))
}
