//! The create saga: the manifest first (phase `creating`), then a node from placement, then
//! the sandbox on that node, then the manifest `running`. A failure undoes every step before
//! it, so a create that fails leaves no manifest, no reservation and no process behind.

use common::clock::now_ms;
use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use common::trace::TracedChannel;
use ledger_client::{Txn, Versioned};
use proto::node::v1 as node_pb;
use proto::node::v1::node_client::NodeClient;
use proto::placement::v1 as pl;
use tracing::Instrument as _;

use super::{from_status, Failure, Sandboxes, LEDGER_RESOLVE_ATTEMPTS};
use crate::intent::CreateIntent;

/// Attempts on different nodes before a create gives up.
const CREATE_ATTEMPTS: usize = 3;

/// How long undoing a create attempt on its node may take before the create goes on.
const UNDO_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

impl Sandboxes {
    /// Creates a sandbox: manifest first, then place, then create on the node, then running.
    /// A template with a warm pool is claimed from it when a pooled sandbox fits the request
    /// (see `pool`); otherwise, or when every claim fails, it is created cold.
    ///
    /// Pooled sandboxes give way first: a create that fits no node as it is may be placed on
    /// a node where it fits once pooled sandboxes go, which it then retires (see
    /// [`Self::place_and_start`]).
    pub async fn create(&self, team: &str, intent: CreateIntent) -> Result<SandboxDoc, Failure> {
        let sandbox_id = new_sandbox_id();
        let _admitted = self.admit(team, &sandbox_id).await?;
        if let Some(doc) = self.claim_pooled(team, &intent, None).await? {
            return Ok(doc);
        }
        self.create_traced(team, intent, sandbox_id).await
    }

    /// Creates sandbox `sandbox_id`, in a span of its own.
    pub(super) async fn create_traced(
        &self,
        team: &str,
        intent: CreateIntent,
        sandbox_id: String,
    ) -> Result<SandboxDoc, Failure> {
        // Instrumented, not entered: an entered span held across an await would leak onto
        // whatever else the thread polls meanwhile.
        let span = tracing::info_span!("create", sandbox_id = %sandbox_id, template = %intent.template);
        self.create_as(team, intent, sandbox_id).instrument(span).await
    }

    /// The manifest of a new sandbox `sandbox_id` of `team` from `intent`, as it is written
    /// before anything is placed (phase `creating`, on no node, epoch 1).
    pub(super) fn new_manifest(&self, team: &str, intent: &CreateIntent, sandbox_id: &str, now: u64) -> SandboxDoc {
        SandboxDoc {
            sandbox_id: sandbox_id.to_string(),
            team_id: team.to_string(),
            template: intent.template.clone(),
            vcpus: intent.vcpus,
            memory_bytes: intent.memory_bytes,
            memory_source: intent.memory_source,
            // Tenants put their API keys here: the ledger keeps them sealed.
            env_vars: Default::default(),
            sealed_env: self.tokens.seal_env(sandbox_id, &intent.env_vars),
            metadata: intent.metadata.clone(),
            phase: SandboxPhase::Creating,
            node_id: String::new(),
            node_address: String::new(),
            envd_address: String::new(),
            epoch: 1,
            // Always: envd answers only requests that carry it (or a URL signed with it). The
            // manifest keeps a seal; the token is derived from it with the gateways' key.
            envd_access_token: Some(self.tokens.token_seal()),
            network: Some(intent.network.clone()),
            traffic_access_token: (!intent.public_traffic).then(|| self.tokens.token_seal()),
            started_at_unix_ms: now,
            end_at_unix_ms: now + intent.timeout_secs * 1000,
            auto_pause: intent.auto_pause,
            auto_pause_memory: intent.auto_pause_memory,
            auto_resume: intent.auto_resume,
            timeout_secs: intent.timeout_secs,
            paused_at_unix_ms: None,
            lifecycle_owner: None,
            lifecycle_claimed_at_unix_ms: None,
            last_moved_unix_ms: None,
            trace_context: common::trace::traceparent(),
            disk_bytes: self.disk_bytes,
            hibernation: None,
            pool: None,
        }
    }

    pub(super) async fn create_as(
        &self,
        team: &str,
        intent: CreateIntent,
        sandbox_id: String,
    ) -> Result<SandboxDoc, Failure> {
        self.create_with(team, intent, sandbox_id, None).await
    }

    /// Creates sandbox `sandbox_id`; `pool` set, for a template's warm pool (no team, no end:
    /// it waits for a create to claim it).
    pub(super) async fn create_with(
        &self,
        team: &str,
        intent: CreateIntent,
        sandbox_id: String,
        pool: Option<common::pool::Pooled>,
    ) -> Result<SandboxDoc, Failure> {
        let now = now_ms();
        let mut doc = self.new_manifest(team, &intent, &sandbox_id, now);
        if pool.is_some() {
            // Not the reaper's until claimed: the claim gives it its end.
            doc.end_at_unix_ms = u64::MAX;
            doc.timeout_secs = 0;
            doc.pool = pool;
        }
        // A lost reply is resolved by reading back; only a ledger that stays unreadable
        // leaves this create's outcome unknown (a 503; nothing was started). Written before
        // placement is asked: a reservation still pending never expires, and the reaper finds
        // (and releases) one only through the manifest of its create.
        let version = self
            .ledger
            .compare_resolving(
                Txn::new().create(SANDBOX_KIND, &sandbox_id, &doc)?,
                LEDGER_RESOLVE_ATTEMPTS,
            )
            .await?
            .versions[0];
        let undo_manifest = || async {
            if let Err(err) = self
                .ledger
                .compare_resolving(
                    Txn::new().delete(SANDBOX_KIND, &sandbox_id, version),
                    LEDGER_RESOLVE_ATTEMPTS,
                )
                .await
            {
                tracing::error!(%err, "could not delete the manifest of a failed create");
            }
        };
        let image = node_pb::TemplateImage::from(&intent.image);
        let placed = match self.place_and_start(&doc, &image).await {
            Ok(placed) => placed,
            // A placement or node call that broke after it was sent may have reserved or
            // started something this gateway cannot name: the manifest stays `creating`, and
            // the reaper resolves it against every node (and releases every reservation).
            Err(err @ Failure::Unknown(_)) => return Err(err),
            Err(err) => {
                undo_manifest().await;
                return Err(err);
            }
        };
        doc.node_id = placed.node_id.clone();
        doc.node_address = placed.node_address.clone();
        doc.envd_address = placed.envd_address;
        doc.phase = SandboxPhase::Running;
        if let Some(pool) = doc.pool.as_mut() {
            pool.ready_at_unix_ms = now_ms();
        }
        let saved = self
            .save(&Versioned {
                key: ledger_client::DocKey::new(SANDBOX_KIND, &sandbox_id),
                version,
                create_revision: 0,
                mod_revision: 0,
                value: doc.clone(),
            })
            .await;
        // Heard before anything below may tell placement the sandbox is gone again.
        let _ = placed.confirmed.await;
        match saved {
            Ok(_) => {}
            // The Running write may have landed: stopping the process now could leave a
            // Running manifest that points at nothing. Leave both; the caller is told to look.
            Err(err @ Failure::Unknown(_)) => {
                tracing::error!(%err, "running write unconfirmed; the sandbox is kept");
                return Err(err);
            }
            // Someone else wrote the manifest meanwhile: only the reaper does, to a create
            // that outran its patience (it adopts the copy a node runs, or removes it).
            Err(Failure::Conflict(why)) => return self.taken_over(doc, why).await,
            Err(err) => {
                // Undo everything: the process, the reservation, the manifest.
                self.stop_on_node(&doc).await;
                undo_manifest().await;
                return Err(err);
            }
        }
        tracing::info!(node_id = %doc.node_id, "sandbox running");
        Ok(doc)
    }

    /// The answer to a create whose `running` write found its manifest changed: only the
    /// reaper writes it meanwhile, to a create that outran its patience, and resolves it
    /// against the nodes within moments; that resolution is awaited (as a kill awaits a
    /// move). A copy it adopted is this create's sandbox (IDs are never reused), done, on
    /// whichever node (this create's copy is ended if it is elsewhere); a manifest it removed
    /// leaves this create's copy to be undone and the create to be made again.
    async fn taken_over(&self, doc: SandboxDoc, why: String) -> Result<SandboxDoc, Failure> {
        let id = &doc.sandbox_id;
        match self.get_settled(&doc.team_id, id).await {
            Ok(current) if current.value.phase == SandboxPhase::Running => {
                if current.value.node_id != doc.node_id {
                    self.stop_on_node(&doc).await;
                }
                tracing::warn!(node_id = %current.value.node_id, "the reaper adopted this create's sandbox before it was written running");
                Ok(current.value)
            }
            Err(Failure::NotFound(_)) => {
                self.stop_on_node(&doc).await;
                Err(Failure::Unavailable(format!(
                    "sandbox {id} took so long to create that the reaper ended it; create again"
                )))
            }
            Ok(_) | Err(_) => Err(Failure::Unknown(format!(
                "sandbox {id} took so long to create that the reaper is resolving it ({why}); read it to see whether it runs"
            ))),
        }
    }

    /// Places `doc` and starts it, on up to [`CREATE_ATTEMPTS`] nodes. A sandbox that fits no
    /// node as it is (and is not itself pooled) is placed once more counting the room of the
    /// nodes' pooled sandboxes as free: placement answers with a node and how much of its
    /// pooled sandboxes must go, and those are retired there before the sandbox starts. A
    /// reclaim that cannot free enough (claimed meanwhile) gives the room back and refuses.
    /// Only the first attempt reclaims: a create whose start then fails elsewhere must not
    /// empty the pools of one node after another; and a team reclaims only so often
    /// ([`super::pool::RECLAIMS_PER_WINDOW`] a minute).
    pub(super) async fn place_and_start(
        &self,
        doc: &SandboxDoc,
        image: &node_pb::TemplateImage,
    ) -> Result<Placed, Failure> {
        // Opened once, before any node is asked: a seal this gateway cannot open is its own
        // fault (a token key unlike its peers'), not a node's to be retried elsewhere.
        let env_vars = self.sealed_env(doc)?;
        let mut exclude = Vec::new();
        let mut last = Failure::NoCapacity("no node could start the sandbox".to_string());
        for attempt in 0..CREATE_ATTEMPTS {
            let mut request = place_request(doc, image, exclude.clone());
            let mut placed = self.placement.clone().place(request.clone()).await;
            let may_reclaim = attempt == 0 && doc.pool.is_none() && self.pools.any_ready();
            if may_reclaim
                && matches!(&placed, Err(s) if s.code() == tonic::Code::ResourceExhausted)
                && self.pools.may_reclaim(&doc.team_id)
            {
                request.reclaim_pooled = true;
                placed = self.placement.clone().place(request).await;
            }
            let placed = match placed {
                Ok(placed) => placed.into_inner(),
                // No other node to try: what the node that failed said is the answer (a
                // placement refusal would hide it).
                Err(_) if attempt > 0 => return Err(last),
                Err(status) => return Err(from_status("placement", status)),
            };
            let sandbox_ref = pl::SandboxRef {
                sandbox_id: doc.sandbox_id.clone(),
                node_id: placed.node_id.clone(),
                resources: None,
            };
            if let Some(need) = placed.reclaim.filter(|r| r.vcpus > 0 || r.memory_bytes > 0) {
                let need = common::docs::Capacity {
                    vcpus: need.vcpus,
                    memory_bytes: need.memory_bytes,
                };
                if !self.evict_on(&placed.node_id, need).await {
                    let _ = self.placement.clone().release(sandbox_ref).await;
                    return Err(Failure::NoCapacity(format!(
                        "no node has room, and the pooled sandboxes on {} could not make enough",
                        placed.node_id
                    )));
                }
            }
            let started = self.start_on(doc, image, &env_vars, &placed, attempt).await;
            match started {
                Ok(envd_address) => {
                    let mut placement = self.placement.clone();
                    let confirmed = tokio::spawn(
                        async move {
                            if let Err(status) = placement.created(sandbox_ref).await {
                                tracing::warn!(%status, "placement did not hear of the create; its reservation will expire");
                            }
                        }
                        .in_current_span(),
                    );
                    return Ok(Placed {
                        node_id: placed.node_id,
                        node_address: placed.node_address,
                        envd_address,
                        confirmed,
                    });
                }
                Err(err) => {
                    tracing::warn!(node_id = %placed.node_id, %err, attempt, "create failed on node; trying another");
                    let _ = self.placement.clone().release(sandbox_ref).await;
                    exclude.push(placed.node_id);
                    last = err;
                }
            }
        }
        Err(last)
    }

    pub(super) async fn start_on(
        &self,
        doc: &SandboxDoc,
        image: &node_pb::TemplateImage,
        env_vars: &std::collections::BTreeMap<String, String>,
        placed: &pl::PlaceResponse,
        attempt: usize,
    ) -> Result<String, Failure> {
        let mut node = self.nodes.client(&placed.node_id, &placed.node_address).await?;
        let created = node
            .create(node_pb::CreateRequest {
                operation_id: format!("create-{}-{attempt}", doc.sandbox_id),
                epoch: doc.epoch,
                sandbox_id: doc.sandbox_id.clone(),
                template: doc.template.clone(),
                resources: Some(node_pb::Resources {
                    vcpus: doc.vcpus,
                    memory_bytes: doc.memory_bytes,
                    disk_bytes: doc.disk_bytes,
                }),
                env_vars: env_vars.clone().into_iter().collect(),
                metadata: doc.metadata.clone().into_iter().collect(),
                start_command: String::new(),
                access_token: self.tokens.envd(doc).unwrap_or_default(),
                network: doc.network.as_ref().map(|n| node_pb::NetworkPolicy {
                    internet: n.internet,
                    allow_out: n.allow_out.iter().map(ToString::to_string).collect(),
                    deny_out: n.deny_out.iter().map(ToString::to_string).collect(),
                }),
                traffic_access_token: self.tokens.traffic(doc).unwrap_or_default(),
                image: Some(image.clone()),
                pooled: doc.is_pooled(),
            })
            .await;
        if let Err(status) = &created {
            // A call that broke or ran out of time after it was sent may have started the
            // sandbox there: it is undone before another node is tried, or two copies would
            // run (the orphan sweep is the backstop when the node cannot be reached now).
            if may_have_landed(status) {
                undo_attempt(&mut node, doc, attempt).await;
            }
        }
        created.map_err(|s| match s.code() {
            // Not "no such sandbox": something the create needs is not on that node.
            tonic::Code::NotFound => Failure::Unavailable(format!("node create: {}", s.message())),
            // The node could not start it (its host lacks something, its sandbox network is
            // full): not the request's fault, and another node or a later try may manage.
            // "Not now" (503 with Retry-After), never a server error the client cannot act on.
            tonic::Code::Internal => Failure::Unavailable(format!(
                "node {} could not start the sandbox: {}",
                placed.node_id,
                s.message()
            )),
            _ => from_status("node create", s),
        })?;
        match self.nodes.envd(&placed.node_id, &placed.node_address).await {
            Ok(envd) => Ok(envd),
            Err(err) => {
                undo_attempt(&mut node, doc, attempt).await;
                Err(err)
            }
        }
    }

    /// Kills the sandbox on its node and tells placement (errors logged: the manifest goes
    /// regardless, and a heartbeat will correct placement).
    /// Kills the sandbox's copy on its node if it can (a failure is logged) and tells
    /// placement: for undoing a create and for the node a hibernated sandbox left.
    pub(super) async fn stop_on_node(&self, doc: &SandboxDoc) {
        if let Err(err) = self.kill_on_node(doc).await {
            tracing::warn!(sandbox_id = %doc.sandbox_id, %err, "kill on node failed");
        }
        self.tell_placement_removed(doc).await;
    }

    /// Placement stops counting the sandbox on its node.
    pub(super) async fn tell_placement_removed(&self, doc: &SandboxDoc) {
        if doc.node_id.is_empty() {
            return;
        }
        let removed = self
            .placement
            .clone()
            .removed(pl::SandboxRef {
                sandbox_id: doc.sandbox_id.clone(),
                node_id: doc.node_id.clone(),
                resources: Some(pl::Resources {
                    vcpus: doc.vcpus,
                    memory_bytes: doc.memory_bytes,
                }),
            })
            .await;
        if let Err(status) = removed {
            tracing::warn!(sandbox_id = %doc.sandbox_id, %status, "placement did not hear of the kill");
        }
    }
}

/// Kills what create attempt `attempt` may have started on `node` (kills are idempotent:
/// "not there" is done). A failure is logged: the orphan sweep ends a copy left so.
async fn undo_attempt(node: &mut NodeClient<TracedChannel>, doc: &SandboxDoc, attempt: usize) {
    let mut request = tonic::Request::new(node_pb::LifecycleRequest {
        operation_id: format!("undo-{}-{attempt}", doc.sandbox_id),
        epoch: doc.epoch,
        sandbox_id: doc.sandbox_id.clone(),
    });
    // The call before it just broke: a node that now takes the connection and never
    // answers must not hold the create (and every other node it could try) with it.
    request.set_timeout(UNDO_PATIENCE);
    let undone = node.kill(request).await;
    match undone {
        Ok(_) => tracing::info!(attempt, "undid a create attempt that may have started the sandbox"),
        Err(status) if status.code() == tonic::Code::NotFound => {}
        Err(status) => tracing::warn!(%status, attempt, "could not undo a create attempt; the orphan sweep will"),
    }
}

/// Whether a failed node call may still have done what it asked: it broke, was cancelled or
/// ran out of time after it may have been sent (as opposed to an answer from the node).
fn may_have_landed(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unknown | tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
    )
}

/// A new sandbox ID: `i` and 19 hex digits.
pub fn new_sandbox_id() -> String {
    format!("i{}", random_id(19))
}

fn random_id(len: usize) -> String {
    let raw = uuid::Uuid::new_v4().simple().to_string() + &uuid::Uuid::new_v4().simple().to_string();
    raw.chars().take(len).collect()
}

/// What placement is asked for `doc`, avoiding the nodes in `exclude`.
fn place_request(doc: &SandboxDoc, image: &node_pb::TemplateImage, exclude: Vec<String>) -> pl::PlaceRequest {
    pl::PlaceRequest {
        sandbox_id: doc.sandbox_id.clone(),
        resources: Some(pl::Resources {
            vcpus: doc.vcpus,
            memory_bytes: doc.memory_bytes,
        }),
        exclude_nodes: exclude,
        // Nodes holding its layers are preferred (a bounded term): no cold start.
        template: if image.layers.is_empty() {
            String::new()
        } else {
            image.build_id.clone()
        },
        ..Default::default()
    }
}

pub(super) struct Placed {
    node_id: String,
    node_address: String,
    envd_address: String,
    /// Placement being told the reservation became a sandbox, sent beside the manifest's
    /// write rather than before it (its answer changes nothing but a log line).
    confirmed: tokio::task::JoinHandle<()>,
}
