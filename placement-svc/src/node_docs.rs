//! Node documents in the ledger, written from heartbeats at a bounded rate.
//!
//! The balancer reads `node/<id>` documents to judge memory spread. Placement keeps them
//! fresh, but at most once per interval per node (heartbeats come every 2 s; a ledger write
//! per heartbeat per node would be the ledger's largest load for no reader's benefit). Each
//! write compares-and-swaps that one document and nothing else: several placement replicas
//! may write it, and no other writer's document is ever in its guard (a guard on documents
//! that others rewrite on their own schedule would fail every time).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::docs::{Capacity, NodeDoc, NodeSandbox, NODE_KIND};
use ledger_client::{LedgerClient, LedgerError, Txn};

use crate::core::Heartbeat;

/// Publishes node documents; cheap to clone.
#[derive(Clone)]
pub struct NodeDocs {
    ledger: LedgerClient,
    every: Duration,
    /// Per node: when its document was last offered for writing, and its version then.
    last: Arc<Mutex<HashMap<String, (Instant, u64)>>>,
}

impl NodeDocs {
    pub fn new(ledger: LedgerClient, every: Duration) -> Self {
        Self {
            ledger,
            every,
            last: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Writes the node's document in the background if its interval has passed.
    pub fn offer(
        &self,
        hb: &Heartbeat,
        draining: bool,
        memory_available_bytes: u64,
        degraded: Vec<String>,
        received_ms: u64,
    ) {
        let known_version = {
            let Ok(mut last) = self.last.lock() else { return };
            match last.get(&hb.node_id) {
                Some((at, _)) if at.elapsed() < self.every => return,
                previous => {
                    let version = previous.map_or(0, |(_, v)| *v);
                    last.insert(hb.node_id.clone(), (Instant::now(), version));
                    version
                }
            }
        };
        let capacity = hb.capacity.memory_bytes.max(1) as f64;
        let doc = NodeDoc {
            node_id: hb.node_id.clone(),
            address: hb.address.clone(),
            boot_id: hb.boot_id.clone(),
            seq: hb.seq,
            state: if draining {
                common::docs::NodeState::Draining
            } else {
                common::docs::NodeState::Ready
            },
            capacity: Capacity {
                vcpus: hb.capacity.vcpus,
                memory_bytes: hb.capacity.memory_bytes,
            },
            allocated: Capacity {
                vcpus: hb.allocated.vcpus,
                memory_bytes: hb.allocated.memory_bytes,
            },
            memory_used_bytes: hb.memory_used_bytes,
            memory_available_bytes,
            available_ratio: memory_available_bytes as f64 / capacity,
            sandboxes: hb
                .sandboxes
                .iter()
                .map(|s| NodeSandbox {
                    sandbox_id: s.sandbox_id.clone(),
                    allocated_memory_bytes: s.allocated.memory_bytes,
                    memory_used_bytes: s.memory_used_bytes,
                })
                .collect(),
            reported_at_unix_ms: received_ms,
            degraded,
        };
        let this = self.clone();
        tokio::spawn(async move {
            match this.write(&doc, known_version).await {
                Ok(version) => {
                    if let Ok(mut last) = this.last.lock() {
                        if let Some(entry) = last.get_mut(&doc.node_id) {
                            entry.1 = version;
                        }
                    }
                }
                Err(err) => {
                    tracing::warn!(node_id = %doc.node_id, %err, "node document not written; next heartbeat retries")
                }
            }
        });
    }

    /// The next heartbeat of `node_id` writes its document whatever the interval (its state
    /// just changed).
    pub fn refresh(&self, node_id: &str) {
        if let Ok(mut last) = self.last.lock() {
            if let Some(entry) = last.get_mut(node_id) {
                if let Some(due) = Instant::now().checked_sub(self.every) {
                    entry.0 = due;
                }
            }
        }
    }

    /// Compare-and-swap on this one document; on a conflict (another replica wrote it), read
    /// its version and try once more.
    async fn write(&self, doc: &NodeDoc, known_version: u64) -> Result<u64, LedgerError> {
        let mut version = known_version;
        for _ in 0..2 {
            let txn = Txn::new().put_json(
                NODE_KIND,
                &doc.node_id,
                version,
                serde_json::to_string(doc).map_err(|e| LedgerError::Encode {
                    key: ledger_client::DocKey::new(NODE_KIND, &doc.node_id),
                    reason: e.to_string(),
                })?,
            );
            match self.ledger.compare(txn).await {
                Ok(done) => return Ok(done.versions.first().copied().unwrap_or(version + 1)),
                Err(LedgerError::Conflict { conflicts, .. }) => {
                    version = conflicts.first().map_or(0, |c| c.current_version);
                }
                Err(err) => return Err(err),
            }
        }
        Err(LedgerError::Unavailable(format!(
            "node/{} kept changing under concurrent writers",
            doc.node_id
        )))
    }
}
