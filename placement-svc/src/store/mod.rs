//! Where the placer's view lives. Two stores behind one trait, passing one test suite:
//! [`memory::MemoryStore`] (the embedded default: one placer process) and
//! [`redis::RedisStore`] (production: any number of placer replicas share one truth, each
//! decision and each heartbeat applied atomically in one round trip by a Lua script).

pub mod memory;
pub mod redis;

use std::future::Future;

use crate::core::{AdminState, Evaluation, Heartbeat, HeartbeatOutcome, NodeView, Request, Resources};

/// Why a store operation failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The backing store (Redis) cannot be reached; retrying later may succeed.
    #[error("placement store unavailable: {0}")]
    Unavailable(String),
    #[error("unknown node {0}")]
    UnknownNode(String),
    #[error("placement store error: {0}")]
    Internal(String),
}

/// The answer to a Place.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// Reserved on this node.
    Placed {
        node_id: String,
        address: String,
        score: f64,
        /// Every node the decision looked at, for the decision's trace span.
        evaluated: Vec<Evaluation>,
        /// How much of the node's pooled sandboxes the caller must retire first (zero unless
        /// the request may reclaim them, and then only what it lacks).
        reclaim: Resources,
    },
    /// Nothing fits; the reason names what filtered the nodes out. `never`: no node could
    /// take it even empty (the ask is larger than any node), so retrying is pointless.
    NoFit { reason: String, never: bool },
}

/// What a Place would do now, without reserving.
#[derive(Clone, Debug, PartialEq)]
pub struct Explanation {
    pub evaluated: Vec<Evaluation>,
    pub chosen: Option<String>,
}

/// What the placer's gauges show of one node: a few counters, cheap to read for every node
/// every few seconds (unlike a whole [`NodeView`], which lists every sandbox).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeGauge {
    pub node_id: String,
    /// Reservations whose create is in flight.
    pub pending: u32,
    /// Reservations created but not yet listed by a heartbeat.
    pub unconfirmed: u32,
    pub last_heartbeat_ms: u64,
}

impl NodeGauge {
    pub fn of(view: &NodeView) -> Self {
        Self {
            node_id: view.node_id.clone(),
            pending: view.pending(),
            unconfirmed: view.unconfirmed(),
            last_heartbeat_ms: view.last_heartbeat_ms,
        }
    }
}

/// The operations placement needs from its state, each atomic.
pub trait PlacementStore: Send + Sync + 'static {
    /// Chooses a node (Best-of-K) and reserves `req` on it, atomically.
    fn place(&self, req: &Request, now_ms: u64) -> impl Future<Output = Result<Placement, StoreError>> + Send;
    /// The same decision as `place`, reserving nothing.
    fn explain(&self, req: &Request, now_ms: u64) -> impl Future<Output = Result<Explanation, StoreError>> + Send;
    /// The create RPC succeeded.
    fn created(&self, node_id: &str, sandbox_id: &str) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// The create RPC failed.
    fn release(&self, node_id: &str, sandbox_id: &str) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// The sandbox was killed or moved away; `resources` is what it held.
    fn removed(
        &self,
        node_id: &str,
        sandbox_id: &str,
        resources: Resources,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Applies a heartbeat received at `now_ms`.
    fn heartbeat(
        &self,
        hb: &Heartbeat,
        now_ms: u64,
    ) -> impl Future<Output = Result<HeartbeatOutcome, StoreError>> + Send;
    /// Every node's view.
    fn nodes(&self) -> impl Future<Output = Result<Vec<NodeView>, StoreError>> + Send;
    /// Every node's gauges.
    fn gauges(&self) -> impl Future<Output = Result<Vec<NodeGauge>, StoreError>> + Send;
    /// Marks a node ready or draining; the node's view after the change.
    fn set_admin(&self, node_id: &str, admin: AdminState) -> impl Future<Output = Result<NodeView, StoreError>> + Send;
}
