//! Driving sandboxes through their lives across ledger, placement and nodes.
//!
//! Layout: `create` is the create saga (manifest, placement, node, running; every step undone
//! when a later one fails, so no manifest, reservation or process is left behind);
//! `claim` is how a user operation takes a sandbox before acting on it; `lifecycle` kills,
//! pauses, resumes and changes timeouts; `hibernation` keeps the files of
//! a sandbox paused without memory off its node and brings them back; `reaper` ends
//! sandboxes whose time is up; `idempotency` makes a create with an `Idempotency-Key` happen
//! once; `capture` takes a sandbox's files as an image (snapshots and forks); `nodes` pools the
//! gateway's node clients; `pool` starts, claims and retires the sandboxes of warm pools.

mod capture;
mod claim;
mod create;
mod hibernation;
pub mod idempotency;
mod lifecycle;
mod nodes;
mod pool;
mod quota;
mod reaper;
pub use claim::DEFAULT_CLAIM_TTL;
pub use create::new_sandbox_id;
pub use pool::{Candidate, PoolIndex};
pub use reaper::{Patience, DEFAULT_ABANDONED_CREATE_AFTER};

use crate::error::from_status;
pub use crate::error::Failure;

use std::sync::Arc;
use std::time::Duration;

use common::docs::{SandboxDoc, SANDBOX_KIND};
use common::trace::TracedChannel;
use ledger_client::{LedgerClient, LedgerError, Txn, Versioned};
use proto::node::v1 as node_pb;
use proto::placement::v1 as pl;
use proto::placement::v1::placement_client::PlacementClient;

/// How long a create waits for the routing table's first listing, which its team's count
/// comes from.
const WAIT_FOR_COUNTS: Duration = Duration::from_secs(5);

/// How long a lifecycle call waits for a balancer move of its sandbox to finish.
const WAIT_FOR_MOVE: Duration = Duration::from_secs(15);

/// Reads a ledger write of unknown outcome may take to resolve it.
pub(super) const LEDGER_RESOLVE_ATTEMPTS: usize = 5;

/// The gateway's view of sandboxes: the ledger is the truth, placement and nodes do the work.
pub struct Sandboxes {
    pub ledger: LedgerClient,
    /// Where hibernated sandboxes' snapshots pass through on their way to and from `store`.
    hibernate_dir: std::path::PathBuf,
    /// The cluster's blob store, where hibernated sandboxes' files wait (pause with
    /// `memory: false`).
    store: std::sync::Arc<dyn blobs::BlobStore>,
    /// How long the reaper lets paused sandboxes and unfinished creates be.
    patience: reaper::Patience,
    /// The proxy's routing table: this gateway's own changes apply to it at once.
    pub routes: crate::routes::Routes,
    placement: PlacementClient<TracedChannel>,
    nodes: nodes::Nodes,
    /// Derives sandboxes' tokens from the seals their manifests keep.
    pub tokens: crate::tokens::Tokens,
    /// Each new sandbox's disk.
    pub disk_bytes: u64,
    /// Ready pooled sandboxes by template, kept by the pool keeper (`crate::pools`).
    pub pools: Arc<PoolIndex>,
    /// How many sandboxes a team may hold at once, if limited (see `quota`).
    team_limit: Option<u32>,
    under_way: quota::UnderWay,
}

impl Sandboxes {
    pub fn new(
        ledger: LedgerClient,
        placement_endpoint: &str,
        security: &mtls::Security,
        tokens: crate::tokens::Tokens,
        hibernate_dir: std::path::PathBuf,
        store: Arc<dyn blobs::BlobStore>,
        patience: reaper::Patience,
    ) -> Result<Self, Failure> {
        let channel = security
            .endpoint(placement_endpoint, mtls::Role::Placement)
            .map_err(|e| Failure::Internal(format!("bad placement address: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();
        Ok(Self {
            ledger,
            hibernate_dir,
            store,
            patience,
            routes: crate::routes::Routes::new(tokens.clone()),
            tokens,
            placement: PlacementClient::new(common::trace::traced(channel)),
            nodes: nodes::Nodes::new(security.clone()),
            disk_bytes: common::resources::DEFAULT_DISK_BYTES,
            pools: Arc::default(),
            team_limit: None,
            under_way: quota::UnderWay::default(),
        })
    }

    /// Holds each team to `limit` sandboxes at once (0: no limit).
    pub fn with_team_limit(self, limit: u32) -> Self {
        Self {
            team_limit: (limit > 0).then_some(limit),
            ..self
        }
    }

    /// Admits new sandbox `sandbox_id` of `team` within its limit, counted as under way until
    /// the returned guard is dropped; 429 past it.
    pub(super) async fn admit(&self, team: &str, sandbox_id: &str) -> Result<Option<quota::Admitted>, Failure> {
        let Some(limit) = self.team_limit else {
            return Ok(None);
        };
        // A gateway just started has its counts a moment later.
        self.routes.listed(WAIT_FOR_COUNTS).await;
        match self
            .under_way
            .admit(team, sandbox_id, limit, |ours| self.routes.held_by(team, ours))
        {
            Ok(admitted) => Ok(Some(admitted)),
            Err(quota::Refused::AtLimit) => Err(Failure::TooMany(quota::refusal(limit))),
            Err(quota::Refused::Uncounted) => Err(Failure::Unavailable(
                "this gateway has not read the cluster's sandboxes yet (it just started, or the ledger is away); retry"
                    .to_string(),
            )),
        }
    }

    /// Gives every new sandbox a disk of `bytes`.
    pub fn with_disk(self, bytes: u64) -> Self {
        Self {
            disk_bytes: bytes,
            ..self
        }
    }

    /// A sandbox's manifest, if `team` owns it (another team's sandbox does not exist for it).
    pub async fn get(&self, team: &str, id: &str) -> Result<Versioned<SandboxDoc>, Failure> {
        match self.ledger.get::<SandboxDoc>(SANDBOX_KIND, id).await? {
            Some(doc) if doc.value.team_id == team => Ok(doc),
            _ => Err(Failure::NotFound(id.to_string())),
        }
    }

    /// The manifest once no move owns the sandbox's lifecycle: a balancer move holds it for
    /// the seconds a migration takes, and a kill, pause or resume waits for it rather than
    /// racing it (the move's fencing epoch would refuse the race anyway). It reads again on
    /// each change the routing table's ledger watch sees, not on a timer.
    pub async fn get_settled(&self, team: &str, id: &str) -> Result<Versioned<SandboxDoc>, Failure> {
        let deadline = tokio::time::Instant::now() + WAIT_FOR_MOVE;
        loop {
            let changed = self.routes.changed();
            let doc = self.get(team, id).await?;
            let Some(owner) = &doc.value.lifecycle_owner else {
                return Ok(doc);
            };
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(Failure::Conflict(format!(
                    "sandbox {id} is being moved ({owner}); retry in a few seconds"
                )));
            }
        }
    }

    /// Every manifest (all teams).
    pub async fn all(&self) -> Result<Vec<Versioned<SandboxDoc>>, Failure> {
        Ok(self.ledger.list::<SandboxDoc>(SANDBOX_KIND, "").await?.0)
    }

    async fn save(&self, doc: &Versioned<SandboxDoc>) -> Result<u64, Failure> {
        let txn = Txn::new().update_read(doc, &doc.value)?;
        match self.ledger.compare_resolving(txn, LEDGER_RESOLVE_ATTEMPTS).await {
            Ok(done) => Ok(done.versions.first().copied().unwrap_or(doc.version + 1)),
            Err(LedgerError::Conflict { .. }) => Err(Failure::Conflict(format!(
                "sandbox {} changed concurrently; retry",
                doc.value.sandbox_id
            ))),
            Err(err) => Err(err.into()),
        }
    }

    /// Memory the node measures for the sandbox now.
    /// The node's metrics samples of a sandbox within `[start, end]` (unix ms). A sandbox on
    /// no node (hibernated, being created) has none.
    pub async fn metrics(
        &self,
        doc: &SandboxDoc,
        start_ms: u64,
        end_ms: u64,
    ) -> Result<Vec<node_pb::MetricsSample>, Failure> {
        if doc.node_address.is_empty() {
            return Ok(Vec::new());
        }
        let mut node = self.nodes.client(&doc.node_id, &doc.node_address).await?;
        Ok(node
            .metrics(node_pb::MetricsRequest {
                sandbox_id: doc.sandbox_id.clone(),
                start_unix_ms: start_ms,
                end_unix_ms: end_ms,
            })
            .await
            .map_err(|s| from_status("node metrics", s))?
            .into_inner()
            .samples)
    }

    /// The node's log entries of a sandbox for `query`; none for a sandbox on no node.
    pub async fn logs(&self, doc: &SandboxDoc, query: node_pb::LogsRequest) -> Result<Vec<node_pb::LogEntry>, Failure> {
        if doc.node_address.is_empty() || query.limit == 0 {
            return Ok(Vec::new());
        }
        let mut node = self.nodes.client(&doc.node_id, &doc.node_address).await?;
        Ok(node
            .logs(query)
            .await
            .map_err(|s| from_status("node logs", s))?
            .into_inner()
            .entries)
    }

    /// Reserves a node for `id` (a template build's builder, not a sandbox) with these
    /// resources, as placement chooses for any create; returns the node and a client of it.
    /// [`Sandboxes::release`] gives the reservation back.
    pub async fn reserve(
        &self,
        id: &str,
        vcpus: u32,
        memory_bytes: u64,
    ) -> Result<
        (
            pl::PlaceResponse,
            proto::node::v1::node_client::NodeClient<TracedChannel>,
        ),
        Failure,
    > {
        let placed = self
            .placement
            .clone()
            .place(pl::PlaceRequest {
                sandbox_id: id.to_string(),
                resources: Some(pl::Resources { vcpus, memory_bytes }),
                ..Default::default()
            })
            .await
            .map_err(|s| from_status("placement", s))?
            .into_inner();
        let client = self.nodes.client(&placed.node_id, &placed.node_address).await?;
        Ok((placed, client))
    }

    /// Gives back what [`Sandboxes::reserve`] took (a failure is logged: the reservation
    /// expires by itself).
    pub async fn release(&self, id: &str, node_id: &str) {
        let released = self
            .placement
            .clone()
            .release(pl::SandboxRef {
                sandbox_id: id.to_string(),
                node_id: node_id.to_string(),
                resources: None,
            })
            .await;
        if let Err(status) = released {
            tracing::warn!(%id, %node_id, %status, "placement did not hear of the release");
        }
    }

    /// Releases sandbox `id`'s reservation on node `node_id`, if it holds one; an error is
    /// returned (for a caller that must not go on without it), not logged.
    pub(super) async fn release_on(&self, id: &str, node_id: &str) -> Result<(), Failure> {
        self.placement
            .clone()
            .release(pl::SandboxRef {
                sandbox_id: id.to_string(),
                node_id: node_id.to_string(),
                resources: None,
            })
            .await
            .map(drop)
            .map_err(|s| from_status("placement", s))
    }

    /// The placer's view of every node.
    /// A manifest's environment variables, opened from their seal.
    pub fn sealed_env(&self, doc: &SandboxDoc) -> Result<std::collections::BTreeMap<String, String>, Failure> {
        self.tokens.env(doc).map_err(|e| {
            Failure::Internal(format!(
                "sandbox {}'s environment variables: {e} (do all gateways share one token key?)",
                doc.sandbox_id
            ))
        })
    }

    pub async fn nodes(&self) -> Result<Vec<pl::NodeView>, Failure> {
        Ok(self
            .placement
            .clone()
            .nodes(pl::NodesRequest {})
            .await
            .map_err(|s| from_status("placement", s))?
            .into_inner()
            .nodes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call that broke after it was sent (tonic says `Unknown`: a peer killed under it) may
    /// have landed: its caller keeps its claim or its manifest for the reaper, never answers as
    /// though nothing happened.
    #[test]
    fn a_call_that_broke_after_it_was_sent_has_an_unknown_outcome() {
        let broken = from_status("kill", tonic::Status::unknown("transport error"));
        assert!(
            matches!(&broken, Failure::Unknown(m) if m.contains("may have landed")),
            "{broken:?}"
        );
        let refused = from_status("kill", tonic::Status::unavailable("tcp connect error"));
        assert!(matches!(refused, Failure::Unavailable(_)));
    }
}
