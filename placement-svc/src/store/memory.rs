//! The in-memory store: the embedded default. Every operation holds one lock for a few
//! microseconds; a decision samples K nodes, so it costs the same with 10 nodes or 1,000.

use std::collections::HashMap;
use std::sync::Mutex;

use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::{Explanation, NodeGauge, Placement, PlacementStore, StoreError};
use crate::core::{
    Accounting, AdminState, Expiry, Heartbeat, HeartbeatOutcome, NodeView, RankConfig, Ranker, Request, Resources,
};

struct State {
    nodes: Vec<NodeView>,
    index: HashMap<String, usize>,
    rng: SmallRng,
}

/// The placer's view of every node, in this process.
pub struct MemoryStore {
    mode: Accounting,
    ranker: Ranker,
    expiry: Expiry,
    state: Mutex<State>,
}

impl MemoryStore {
    pub fn new(mode: Accounting, rank: &RankConfig, expiry: Expiry, seed: u64) -> Self {
        Self {
            mode,
            ranker: Ranker::new(rank),
            expiry,
            state: Mutex::new(State {
                nodes: Vec::new(),
                index: HashMap::new(),
                rng: SmallRng::seed_from_u64(seed),
            }),
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>, StoreError> {
        self.state
            .lock()
            .map_err(|_| StoreError::Internal("placement state lock poisoned".to_string()))
    }

    fn with_node<T>(&self, node_id: &str, f: impl FnOnce(&mut NodeView) -> T) -> Result<T, StoreError> {
        let mut state = self.lock()?;
        let i = *state
            .index
            .get(node_id)
            .ok_or_else(|| StoreError::UnknownNode(node_id.to_string()))?;
        Ok(f(&mut state.nodes[i]))
    }
}

impl PlacementStore for MemoryStore {
    async fn place(&self, req: &Request, now_ms: u64) -> Result<Placement, StoreError> {
        let mut guard = self.lock()?;
        let state = &mut *guard;
        let decision = self.ranker.decide(&state.nodes, req, now_ms, &mut state.rng);
        Ok(match decision.chosen {
            Some((i, score)) => {
                let node = &mut state.nodes[i];
                let reclaim = crate::core::rank::reclaim(node, req, self.ranker.overcommit());
                node.reserve(self.mode, &req.sandbox_id, req.resources, now_ms);
                if self.mode != crate::core::Accounting::Stale {
                    // Stale accounting keeps nothing between heartbeats, this neither.
                    node.promise_pooled(reclaim);
                }
                Placement::Placed {
                    node_id: node.node_id.clone(),
                    address: node.address.clone(),
                    score,
                    evaluated: decision.evaluated,
                    reclaim,
                }
            }
            None => Placement::NoFit {
                never: req.only.is_none() && decision.never_fits(),
                reason: decision.why_nothing_fit(),
            },
        })
    }

    async fn explain(&self, req: &Request, now_ms: u64) -> Result<Explanation, StoreError> {
        let mut guard = self.lock()?;
        let state = &mut *guard;
        let decision = self.ranker.decide(&state.nodes, req, now_ms, &mut state.rng);
        let chosen = decision.chosen.map(|(i, _)| state.nodes[i].node_id.clone());
        Ok(Explanation {
            evaluated: decision.evaluated,
            chosen,
        })
    }

    async fn created(&self, node_id: &str, sandbox_id: &str) -> Result<(), StoreError> {
        self.with_node(node_id, |n| n.created(self.mode, sandbox_id))
    }

    async fn release(&self, node_id: &str, sandbox_id: &str) -> Result<(), StoreError> {
        self.with_node(node_id, |n| n.release(self.mode, sandbox_id))
    }

    async fn removed(&self, node_id: &str, sandbox_id: &str, resources: Resources) -> Result<(), StoreError> {
        self.with_node(node_id, |n| n.removed(self.mode, sandbox_id, resources))
    }

    async fn heartbeat(&self, hb: &Heartbeat, now_ms: u64) -> Result<HeartbeatOutcome, StoreError> {
        let mut guard = self.lock()?;
        let state = &mut *guard;
        let i = match state.index.get(&hb.node_id) {
            Some(&i) => i,
            None => {
                state.nodes.push(NodeView::new(hb.node_id.clone()));
                state.index.insert(hb.node_id.clone(), state.nodes.len() - 1);
                state.nodes.len() - 1
            }
        };
        Ok(state.nodes[i].apply_heartbeat(self.mode, hb, now_ms, self.expiry))
    }

    async fn nodes(&self) -> Result<Vec<NodeView>, StoreError> {
        Ok(self.lock()?.nodes.clone())
    }

    async fn gauges(&self) -> Result<Vec<NodeGauge>, StoreError> {
        Ok(self.lock()?.nodes.iter().map(NodeGauge::of).collect())
    }

    async fn set_admin(&self, node_id: &str, admin: AdminState) -> Result<NodeView, StoreError> {
        self.with_node(node_id, |n| {
            n.admin = admin;
            n.clone()
        })
    }
}
