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

/// A node as of its latest heartbeat: `node/<node_id>`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeDoc {
    pub node_id: String,
    pub address: String,
    pub boot_id: String,
    pub seq: u64,
    /// `ready` or `draining`.
    pub state: String,
    pub capacity: Capacity,
    pub allocated: Capacity,
    pub memory_used_bytes: u64,
    pub memory_available_bytes: u64,
    /// Available physical memory over capacity: the balancer's spread is max minus min of it.
    pub available_ratio: f64,
    pub sandboxes: Vec<NodeSandbox>,
    /// When placement-svc received the heartbeat (unix ms).
    pub reported_at_unix_ms: u64,
}
