//! The shapes of ledger documents that more than one service reads or writes.
//!
//! A document kind is a contract between its writer and its readers; defining it once here
//! keeps them from drifting apart.

use serde::{Deserialize, Serialize};

/// Kind of the documents describing nodes (written by placement-svc from heartbeats).
pub const NODE_KIND: &str = "node";

/// vCPUs and memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub vcpus: u32,
    pub memory_bytes: u64,
}

/// One sandbox as its node last reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSandbox {
    pub sandbox_id: String,
    pub allocated_memory_bytes: u64,
    pub memory_used_bytes: u64,
}

/// Whether placement may choose a node (stored as `"ready"` / `"draining"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    #[default]
    Ready,
    /// Placement chooses it for nothing new; the balancer moves its sandboxes away.
    Draining,
}

/// A node as of its latest heartbeat: `node/<node_id>`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeDoc {
    pub node_id: String,
    pub address: String,
    pub boot_id: String,
    pub seq: u64,
    pub state: NodeState,
    pub capacity: Capacity,
    pub allocated: Capacity,
    pub memory_used_bytes: u64,
    pub memory_available_bytes: u64,
    /// Available physical memory over capacity: the balancer's spread is max minus min of it.
    pub available_ratio: f64,
    pub sandboxes: Vec<NodeSandbox>,
    /// When placement-svc received the heartbeat (unix ms).
    pub reported_at_unix_ms: u64,
    /// Why the node runs degraded (a missing isolation feature, a DNS forwarder down), as
    /// its last heartbeat said; empty when it runs whole.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub degraded: Vec<String>,
}

/// The most degraded reasons a node document keeps, and the longest each may be (a node
/// reports them; placement publishes them for operators).
pub const MAX_DEGRADED: usize = 16;
pub const MAX_DEGRADED_LEN: usize = 300;

/// Kind of sandbox manifests (written by the gateway; read by the balancer and the proxy).
pub const SANDBOX_KIND: &str = "sandbox";

/// Kind of the documents that make creates idempotent: `idempotency/<team>/<key>`.
pub const IDEMPOTENCY_KIND: &str = "idempotency";

/// A create made with an `Idempotency-Key`: which sandbox the key made, for which request.
/// A retry with the same key (and team) gets that sandbox instead of a second one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyDoc {
    pub team_id: String,
    pub key: String,
    pub sandbox_id: String,
    /// Hex SHA-256 of the request body: the same key with another request is refused.
    pub request_sha256: String,
    pub created_at_unix_ms: u64,
}
/// Prefix of the lifecycle owner a user operation (kill, pause, resume) writes while it acts.
pub const USER_CLAIM_PREFIX: &str = "user:";

/// Where a sandbox's memory estimate came from. Every manifest has one, so the balancer never
/// meets an `UnknownMemoryEstimate` (a manifest without one could never be moved).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EstimateSource {
    Request,
    Template,
    #[default]
    Default,
    Measured,
}

/// Lifecycle of a sandbox as the gateway drives it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxPhase {
    /// Written before placement; not yet running anywhere.
    #[default]
    Creating,
    Running,
    /// Frozen in place, processes and memory kept (`memory: true`).
    Paused,
    /// Only files kept; the next resume starts it afresh wherever placement chooses.
    Hibernated,
}

fn keep_memory() -> bool {
    true
}

/// A sandbox's manifest: `sandbox/<sandbox_id>`. It describes itself: resources with their
/// source, where it runs, when it ends. (`Default` is for fixtures; the gateway names every
/// field, so a new one cannot be forgotten there.)
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SandboxDoc {
    pub sandbox_id: String,
    pub team_id: String,
    pub template: String,
    pub vcpus: u32,
    pub memory_bytes: u64,
    pub memory_source: EstimateSource,
    /// Environment variables kept in clear: only by gateways from before sealing (today's
    /// keep none here; see `sealed_env`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub env_vars: std::collections::BTreeMap<String, String>,
    /// The create's environment variables, sealed with a key only gateways hold (tenants put
    /// their API keys there): a dump of the ledger reads none of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed_env: Option<String>,
    #[serde(default)]
    pub metadata: std::collections::BTreeMap<String, String>,
    pub phase: SandboxPhase,
    /// The node it runs (or is paused) on; empty while creating or hibernated.
    #[serde(default)]
    pub node_id: String,
    /// The node's gRPC endpoint.
    #[serde(default)]
    pub node_address: String,
    /// The node's envd-compatible endpoint, where the proxy sends SDK traffic.
    #[serde(default)]
    pub envd_address: String,
    /// Fencing epoch for node calls about this sandbox.
    #[serde(default)]
    pub epoch: u64,
    #[serde(default)]
    pub envd_access_token: Option<String>,
    /// Where its traffic may go; `None` (a manifest from before egress existed): loopback
    /// only.
    #[serde(default)]
    pub network: Option<crate::egress::NetworkPolicy>,
    /// Required on requests for its ports when set (`network.allowPublicTraffic: false`).
    #[serde(default)]
    pub traffic_access_token: Option<String>,
    pub started_at_unix_ms: u64,
    /// When the reaper ends it (kill, or pause when `auto_pause`).
    pub end_at_unix_ms: u64,
    #[serde(default)]
    pub auto_pause: bool,
    /// What an automatic pause keeps: memory and files (true, E2B's default) or files only.
    #[serde(default = "keep_memory")]
    pub auto_pause_memory: bool,
    /// Traffic to it while paused (envd or a port) resumes it.
    #[serde(default)]
    pub auto_resume: bool,
    /// Its timeout in seconds, given again at every automatic resume (0: the default).
    #[serde(default)]
    pub timeout_secs: u64,
    /// When it was paused: a paused sandbox does not time out; it is kept until killed, or
    /// until the gateway's retention for paused sandboxes passes.
    #[serde(default)]
    pub paused_at_unix_ms: Option<u64>,
    /// Set while an operation owns the sandbox's lifecycle — a balancer move (its move ID) or
    /// a user's kill, pause or resume (`user:…`, see [`USER_CLAIM_PREFIX`]). Taking it raises
    /// the epoch, so nodes refuse whatever a former owner still tries; the proxy holds the
    /// sandbox's requests until it is released.
    #[serde(default)]
    pub lifecycle_owner: Option<String>,
    /// When the current owner took the lifecycle (unix ms): a user claim older than its time
    /// to live was left by a gateway that died mid-operation, and the next operation takes
    /// it over.
    #[serde(default)]
    pub lifecycle_claimed_at_unix_ms: Option<u64>,
    /// When the sandbox last moved (unix ms), for the balancer's cooldown.
    #[serde(default)]
    pub last_moved_unix_ms: Option<u64>,
    /// W3C `traceparent` of the request that created it: a move's trace links back to it.
    #[serde(default)]
    pub trace_context: Option<String>,
    /// The size of its disk (E2B's `diskSizeMB`); 0 (a manifest from before disks): its
    /// node's default.
    #[serde(default)]
    pub disk_bytes: u64,
    /// While hibernated: its node's description of it and its archive's checksum, sealed by
    /// the gateway (the archive waits in the blob store; this says which archive is its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hibernation: Option<String>,
    /// Set while it waits in a template's warm pool, unclaimed: it has no team yet, and no
    /// request reaches it (see `crate::pool`). A claim gives it a team and keeps this until
    /// its node confirmed the hand-over ([`SandboxDoc::claim_unconfirmed`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<crate::pool::Pooled>,
}

impl SandboxDoc {
    /// Waits unclaimed in a warm pool: started ahead of any create, nobody's yet.
    pub fn is_pooled(&self) -> bool {
        self.pool.is_some() && self.team_id.is_empty()
    }

    /// Pooled, running, owned by no operation and not asked to go: one a create may claim and
    /// a balance plan may drop.
    pub fn ready_in_pool(&self) -> bool {
        self.is_pooled()
            && self.phase == SandboxPhase::Running
            && self.lifecycle_owner.is_none()
            && self.pool.as_ref().is_some_and(|p| p.retire_asked.is_none())
    }

    /// A create claimed it from a warm pool and it is the create's team's, but nobody has yet
    /// recorded that its node took the hand-over (new tokens, the create's env vars). The
    /// claiming gateway clears it once the node answered; a gateway that stopped between the
    /// two leaves it to the reaper, which asks the node.
    pub fn claim_unconfirmed(&self) -> bool {
        self.pool.is_some() && !self.team_id.is_empty()
    }
}

/// What changed from one version of a manifest (`before`; none: it was created) to the next,
/// in words an operator reads: phase, node, epoch, lifecycle owner, end time.
pub fn describe_change(before: Option<&SandboxDoc>, after: &SandboxDoc) -> Vec<String> {
    let node = |d: &SandboxDoc| {
        if d.node_id.is_empty() {
            "no node".to_string()
        } else {
            d.node_id.clone()
        }
    };
    let Some(b) = before else {
        return vec![format!("created: {:?} on {}", after.phase, node(after))];
    };
    let mut what = Vec::new();
    if b.phase != after.phase {
        what.push(format!("{:?} -> {:?}", b.phase, after.phase));
    }
    if b.node_id != after.node_id {
        what.push(format!("moved {} -> {}", node(b), node(after)));
    }
    if b.epoch != after.epoch {
        what.push(format!("epoch {} -> {}", b.epoch, after.epoch));
    }
    match (&b.lifecycle_owner, &after.lifecycle_owner) {
        (None, Some(owner)) => what.push(format!("owned by {owner}")),
        (Some(owner), None) => what.push(format!("released by {owner}")),
        (Some(x), Some(y)) if x != y => what.push(format!("owner {x} -> {y}")),
        _ => {}
    }
    if b.end_at_unix_ms != after.end_at_unix_ms {
        what.push(format!("ends at {} ms", after.end_at_unix_ms));
    }
    if what.is_empty() {
        what.push("rewritten".to_string());
    }
    what
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(phase: SandboxPhase, node: &str, epoch: u64, owner: Option<&str>) -> SandboxDoc {
        SandboxDoc {
            sandbox_id: "s".into(),
            phase,
            node_id: node.into(),
            epoch,
            end_at_unix_ms: 10,
            lifecycle_owner: owner.map(str::to_string),
            ..SandboxDoc::default()
        }
    }

    #[test]
    fn a_move_reads_as_owned_then_moved_and_released() {
        let running = doc(SandboxPhase::Running, "a", 1, None);
        let owned = doc(SandboxPhase::Running, "a", 2, Some("plan.0"));
        let moved = doc(SandboxPhase::Running, "b", 2, None);
        assert_eq!(describe_change(None, &running), vec!["created: Running on a"]);
        assert_eq!(
            describe_change(Some(&running), &owned),
            vec!["epoch 1 -> 2", "owned by plan.0"]
        );
        assert_eq!(
            describe_change(Some(&owned), &moved),
            vec!["moved a -> b", "released by plan.0"]
        );
        let paused = doc(SandboxPhase::Paused, "b", 2, None);
        assert_eq!(describe_change(Some(&moved), &paused), vec!["Running -> Paused"]);
        assert_eq!(describe_change(Some(&paused), &paused), vec!["rewritten"]);
    }
}
