//! Faults on the wire, for tests: gRPC proxies that stand between a service and its caller
//! and lose replies the way networks do.
//!
//! A [`NodeProxy`] or [`LedgerProxy`] forwards every call to the real service. Told to, it
//! lets a call through and then answers the caller as if the connection had broken — the
//! request applied, its reply lost — or refuses every call without forwarding (a node that
//! cannot be reached), or holds a call's reply back. The errors carry no ledger marker, so a
//! ledger client sees exactly what a broken connection gives it: an unknown outcome.
//!
//! Every fault the proxy injects is counted, and [`Faults::await_count`] waits for a count
//! to be reached, so a test synchronises on the fault having happened rather than on time.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use common::serve::{Grpc, Listener, Serving};
use mtls::Role;

use crate::Certs;
use futures::{Stream, StreamExt};
use proto::ledger::v1 as lpb;
use proto::ledger::v1::ledger_client::LedgerClient;
use proto::ledger::v1::ledger_server::{Ledger, LedgerServer};
use proto::node::v1 as npb;
use proto::node::v1::node_client::NodeClient;
use proto::node::v1::node_server::{Node, NodeServer};
use tokio::sync::Notify;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

/// A predicate on a ledger compare, choosing which compares lose their reply.
pub type CompareMatch = Box<dyn Fn(&lpb::CompareRequest) -> bool + Send + Sync>;

#[derive(Default)]
struct Rules {
    /// Calls by method name whose reply is lost after they applied, and how many more times.
    drop_reply: HashMap<&'static str, u32>,
    /// Compares whose reply is lost after they applied, and how many more times.
    drop_compare: Vec<(CompareMatch, u32)>,
    /// Every call is refused without being forwarded.
    down: bool,
    /// The proxy goes down the moment it loses a reply (a node that becomes unreachable
    /// right after applying a call).
    down_after_drop: bool,
    /// Calls by method name refused (not forwarded), and how many more times.
    refuse: HashMap<&'static str, u32>,
    /// Methods whose next call is held back (not forwarded) until released, then delivered
    /// even though its caller has given up: a request stuck in the network, arriving late.
    hold: Vec<&'static str>,
    /// Compares that lose their reply before they apply, and apply only once the next read
    /// has been answered, and how many more.
    land_after_read: u32,
    /// Faults injected so far, by kind: "dropped" and "refused".
    counts: HashMap<&'static str, u64>,
}

/// The fault rules of one proxy, shared by its handlers and the test.
#[derive(Clone, Default)]
pub struct Faults {
    rules: Arc<Mutex<Rules>>,
    changed: Arc<Notify>,
    released: Arc<Notify>,
}

impl Faults {
    fn rules(&self) -> std::sync::MutexGuard<'_, Rules> {
        self.rules.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next `times` calls of `method` (as named in the proto, e.g. "Resume") apply and
    /// then lose their reply.
    pub fn drop_reply(&self, method: &'static str, times: u32) {
        self.rules().drop_reply.insert(method, times);
    }

    /// The next `times` compares that `matches` accepts apply and then lose their reply.
    pub fn drop_compare_reply(
        &self,
        matches: impl Fn(&lpb::CompareRequest) -> bool + Send + Sync + 'static,
        times: u32,
    ) {
        self.rules().drop_compare.push((Box::new(matches), times));
    }

    /// The next `times` calls of `method` apply, lose their reply, and leave the proxy down.
    pub fn drop_reply_then_down(&self, method: &'static str, times: u32) {
        let mut rules = self.rules();
        rules.drop_reply.insert(method, times);
        rules.down_after_drop = true;
    }

    /// The next `times` calls of `method` are refused without being forwarded.
    pub fn refuse(&self, method: &'static str, times: u32) {
        self.rules().refuse.insert(method, times);
    }

    /// The next call of `method` is held back until [`Faults::release_held`], then delivered
    /// whether or not its caller still waits.
    pub fn hold_next(&self, method: &'static str) {
        self.rules().hold.push(method);
    }

    /// The next `times` compares lose their reply before they apply, and apply right after
    /// the next Get has read the ledger: a commit still under way in the database when its
    /// caller, its deadline passed, reads back and finds nothing yet.
    pub fn land_compare_after_next_read(&self, times: u32) {
        self.rules().land_after_read = times;
    }

    fn take_land_after_read(&self) -> bool {
        let mut rules = self.rules();
        let take = rules.land_after_read > 0;
        if take {
            rules.land_after_read -= 1;
        }
        take
    }

    /// Delivers every held call now.
    pub fn release_held(&self) {
        self.released.notify_waiters();
    }

    /// While down, every call is refused with UNAVAILABLE and not forwarded.
    pub fn set_down(&self, down: bool) {
        self.rules().down = down;
    }

    /// Faults of `kind` ("dropped", "refused") injected so far.
    pub fn count(&self, kind: &str) -> u64 {
        self.rules().counts.get(kind).copied().unwrap_or(0)
    }

    /// Waits until `count(kind) >= at_least`, failing the test after `limit`.
    pub async fn await_count(&self, kind: &str, at_least: u64, limit: Duration) {
        let reached = tokio::time::timeout(limit, async {
            loop {
                let notified = self.changed.notified();
                if self.count(kind) >= at_least {
                    return;
                }
                notified.await;
            }
        })
        .await;
        if reached.is_err() {
            panic!(
                "only {} {kind} faults within {limit:?}, expected {at_least}",
                self.count(kind)
            );
        }
    }

    fn bump(&self, kind: &'static str) {
        *self.rules().counts.entry(kind).or_default() += 1;
        self.changed.notify_waiters();
    }

    /// Refuses the call if the proxy is down, or told to refuse this method.
    fn gate(&self, method: &'static str) -> Result<(), Status> {
        let refused = {
            let mut rules = self.rules();
            let by_rule = match rules.refuse.get_mut(method) {
                Some(left) if *left > 0 => {
                    *left -= 1;
                    true
                }
                _ => false,
            };
            rules.down || by_rule
        };
        if refused {
            self.bump("refused");
            return Err(Status::unavailable(format!(
                "{method}: connection refused (fault proxy)"
            )));
        }
        Ok(())
    }

    /// Runs `forward`, or — if `method`'s next call is to be held — runs it on a task of its
    /// own once released, so it lands even after its caller gave up.
    async fn deliver<T: Send + 'static>(
        &self,
        method: &'static str,
        forward: impl std::future::Future<Output = Result<T, Status>> + Send + 'static,
    ) -> Result<T, Status> {
        let held = {
            let mut rules = self.rules();
            let at = rules.hold.iter().position(|m| *m == method);
            at.map(|i| rules.hold.remove(i)).is_some()
        };
        if !held {
            return forward.await;
        }
        let faults = self.clone();
        // Registered before the task is counted as holding, so a release right after the
        // count is seen is not missed.
        let task = tokio::spawn(async move {
            let wake = faults.released.notified();
            tokio::pin!(wake);
            wake.as_mut().enable();
            faults.bump("held");
            wake.await;
            let result = forward.await;
            faults.bump("delivered late");
            result
        });
        task.await
            .unwrap_or_else(|e| Err(Status::internal(format!("held call failed: {e}"))))
    }

    /// Whether this call of `method` loses its reply (and uses up one of the rule's times).
    fn take_drop(&self, method: &'static str) -> bool {
        let mut rules = self.rules();
        match rules.drop_reply.get_mut(method) {
            Some(left) if *left > 0 => {
                *left -= 1;
                true
            }
            _ => false,
        }
    }

    fn take_compare_drop(&self, request: &lpb::CompareRequest) -> bool {
        let mut rules = self.rules();
        for (matches, left) in rules.drop_compare.iter_mut() {
            if *left > 0 && matches(request) {
                *left -= 1;
                return true;
            }
        }
        false
    }

    /// The reply a lost one is replaced with: what a broken connection looks like.
    fn lost(&self, method: &str) -> Status {
        {
            let mut rules = self.rules();
            if rules.down_after_drop {
                rules.down = true;
            }
        }
        self.bump("dropped");
        Status::unavailable(format!("{method}: connection reset (fault proxy lost the reply)"))
    }

    /// Passes `result` on, unless `method`'s reply is to be lost.
    fn reply<T>(&self, method: &'static str, result: Result<Response<T>, Status>) -> Result<Response<T>, Status> {
        if self.take_drop(method) {
            return Err(self.lost(method));
        }
        result
    }
}

/// A proxy listening on its own port; stopped by [`Proxy::stop`].
pub struct Proxy {
    addr: SocketAddr,
    serving: Serving,
    pub faults: Faults,
}

impl Proxy {
    /// `http://ADDR` of the proxy: give it to the caller instead of the real service's.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn stop(self) {
        self.serving.stop().await;
    }
}

/// A port on loopback for a proxy, bound now and served once the proxy starts
/// ([`NodeProxy::start_on`]): for a service that must be told the proxy's address before the
/// proxy can be made (a node that advertises it to placement).
pub async fn reserve() -> Listener {
    Listener::bind("127.0.0.1:0".parse().expect("a literal address"))
        .await
        .expect("the fault proxy binds a port")
}

async fn serve(grpc: Grpc, faults: Faults) -> Proxy {
    serve_on(reserve().await, grpc, faults)
}

fn serve_on(listener: Listener, grpc: Grpc, faults: Faults) -> Proxy {
    let addr = listener.addr();
    let mut serving = Serving::new();
    serving.grpc("fault-proxy", listener, grpc);
    Proxy { addr, serving, faults }
}

/// The proxy's channel to the real service of role `peer`, proving `caller`'s role.
fn channel(endpoint: &str, certs: &Certs, caller: Role, peer: Role) -> Channel {
    certs
        .security(caller)
        .endpoint(endpoint, peer)
        .expect("the proxied service's endpoint is a URL")
        .connect_lazy()
}

/// The proxy's own server: it stands where `role` stood, so it proves that role and holds
/// its callers to the same policy.
fn secured(grpc: Grpc, certs: &Certs, role: Role, policy: mtls::Policy) -> Grpc {
    grpc.secure(&certs.security(role), &[policy])
        .expect("the stack's certificates load")
}

/// Forwards the Node service to one node-svc.
#[derive(Clone)]
pub struct NodeProxy {
    upstream: NodeClient<Channel>,
    faults: Faults,
}

impl NodeProxy {
    /// Starts a proxy in front of node `node_id`, whose node-svc is at `endpoint`, calling it
    /// as the balancer. The proxy stands where that node stood, so it proves that node's
    /// identity (the gateway and the balancer accept a node only in its own name).
    pub async fn start(node_id: &str, endpoint: &str, certs: &Certs) -> Proxy {
        Self::start_on(reserve().await, node_id, endpoint, certs).await
    }

    /// [`NodeProxy::start`] on a port reserved before (see [`reserve`]).
    pub async fn start_on(listener: Listener, node_id: &str, endpoint: &str, certs: &Certs) -> Proxy {
        let faults = Faults::default();
        let upstream = certs
            .security(Role::Balance)
            .node_endpoint(endpoint, node_id)
            .expect("the proxied node's endpoint is a URL")
            .connect_lazy();
        let proxy = Self {
            upstream: NodeClient::new(upstream).max_decoding_message_size(64 << 20),
            faults: faults.clone(),
        };
        let identity = certs.node(node_id).expect("the node's certificate");
        let grpc = Grpc::new()
            .secure(&identity, &[node_svc::server::POLICY])
            .expect("the stack's certificates load")
            .service(NodeServer::new(proxy))
            .await
            .stream_window(8 << 20);
        serve_on(listener, grpc, faults)
    }
}

type Chunks = Pin<Box<dyn Stream<Item = Result<npb::SnapshotChunk, Status>> + Send>>;
type BuildEvents = Pin<Box<dyn Stream<Item = Result<npb::BuildEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Node for NodeProxy {
    async fn create(&self, request: Request<npb::CreateRequest>) -> Result<Response<npb::SandboxInfo>, Status> {
        self.faults.gate("Create")?;
        let (mut upstream, request) = (self.upstream.clone(), request.into_inner());
        let result = self
            .faults
            .deliver("Create", async move { upstream.create(request).await })
            .await;
        self.faults.reply("Create", result)
    }

    async fn kill(&self, request: Request<npb::LifecycleRequest>) -> Result<Response<npb::SandboxInfo>, Status> {
        self.faults.gate("Kill")?;
        let (mut upstream, request) = (self.upstream.clone(), request.into_inner());
        let result = self
            .faults
            .deliver("Kill", async move { upstream.kill(request).await })
            .await;
        self.faults.reply("Kill", result)
    }

    async fn pause(&self, request: Request<npb::LifecycleRequest>) -> Result<Response<npb::SandboxInfo>, Status> {
        self.faults.gate("Pause")?;
        let (mut upstream, request) = (self.upstream.clone(), request.into_inner());
        let result = self
            .faults
            .deliver("Pause", async move { upstream.pause(request).await })
            .await;
        self.faults.reply("Pause", result)
    }

    async fn resume(&self, request: Request<npb::LifecycleRequest>) -> Result<Response<npb::SandboxInfo>, Status> {
        self.faults.gate("Resume")?;
        let (mut upstream, request) = (self.upstream.clone(), request.into_inner());
        let result = self
            .faults
            .deliver("Resume", async move { upstream.resume(request).await })
            .await;
        self.faults.reply("Resume", result)
    }

    async fn metrics(&self, request: Request<npb::MetricsRequest>) -> Result<Response<npb::MetricsResponse>, Status> {
        self.faults.gate("Metrics")?;
        let result = self.upstream.clone().metrics(request.into_inner()).await;
        self.faults.reply("Metrics", result)
    }

    async fn logs(&self, request: Request<npb::LogsRequest>) -> Result<Response<npb::LogsResponse>, Status> {
        self.faults.gate("Logs")?;
        let result = self.upstream.clone().logs(request.into_inner()).await;
        self.faults.reply("Logs", result)
    }

    async fn update_network(
        &self,
        request: Request<npb::NetworkUpdateRequest>,
    ) -> Result<Response<npb::SandboxInfo>, Status> {
        self.faults.gate("UpdateNetwork")?;
        let (mut upstream, request) = (self.upstream.clone(), request.into_inner());
        let result = self
            .faults
            .deliver("UpdateNetwork", async move { upstream.update_network(request).await })
            .await;
        self.faults.reply("UpdateNetwork", result)
    }

    async fn claim(&self, request: Request<npb::ClaimRequest>) -> Result<Response<npb::SandboxInfo>, Status> {
        self.faults.gate("Claim")?;
        let (mut upstream, request) = (self.upstream.clone(), request.into_inner());
        let result = self
            .faults
            .deliver("Claim", async move { upstream.claim(request).await })
            .await;
        self.faults.reply("Claim", result)
    }

    type SnapshotStream = Chunks;
    type BuildStream = BuildEvents;

    async fn capture(&self, request: Request<npb::LifecycleRequest>) -> Result<Response<npb::TemplateImage>, Status> {
        self.faults.gate("Capture")?;
        let result = self.upstream.clone().capture(request.into_inner()).await;
        self.faults.reply("Capture", result)
    }

    async fn build(&self, request: Request<npb::BuildRequest>) -> Result<Response<BuildEvents>, Status> {
        self.faults.gate("Build")?;
        let stream = self.upstream.clone().build(request.into_inner()).await?.into_inner();
        let events: BuildEvents = Box::pin(stream);
        self.faults.reply("Build", Ok(Response::new(events)))
    }

    async fn snapshot(&self, request: Request<npb::LifecycleRequest>) -> Result<Response<Chunks>, Status> {
        self.faults.gate("Snapshot")?;
        let stream = self.upstream.clone().snapshot(request.into_inner()).await?.into_inner();
        let chunks: Chunks = Box::pin(stream);
        self.faults.reply("Snapshot", Ok(Response::new(chunks)))
    }

    async fn restore(
        &self,
        request: Request<Streaming<npb::RestoreChunk>>,
    ) -> Result<Response<npb::SandboxInfo>, Status> {
        self.faults.gate("Restore")?;
        // Forwarded as it arrives; a broken inbound stream ends the outbound one early, which
        // the node refuses as incomplete.
        let inbound = request.into_inner().take_while(|c| futures::future::ready(c.is_ok()));
        let outbound = inbound.filter_map(|c| futures::future::ready(c.ok()));
        let result = self.upstream.clone().restore(outbound).await;
        self.faults.reply("Restore", result)
    }

    async fn list(&self, request: Request<npb::ListRequest>) -> Result<Response<npb::ListResponse>, Status> {
        self.faults.gate("List")?;
        let result = self.upstream.clone().list(request.into_inner()).await;
        self.faults.reply("List", result)
    }

    async fn info(&self, request: Request<npb::InfoRequest>) -> Result<Response<npb::NodeInfo>, Status> {
        self.faults.gate("Info")?;
        let result = self.upstream.clone().info(request.into_inner()).await;
        self.faults.reply("Info", result)
    }
}

/// Forwards the Ledger service to one ledger-svc.
#[derive(Clone)]
pub struct LedgerProxy {
    upstream: LedgerClient<Channel>,
    faults: Faults,
    /// Compares waiting for the next read before they apply.
    late: Arc<Mutex<Vec<lpb::CompareRequest>>>,
}

impl LedgerProxy {
    /// Starts a proxy in front of the ledger-svc at `endpoint`, calling it as the operator:
    /// it forwards every caller's writes, and only the operator may write every kind.
    pub async fn start(endpoint: &str, certs: &Certs) -> Proxy {
        let faults = Faults::default();
        let proxy = Self {
            upstream: LedgerClient::new(channel(endpoint, certs, Role::Operator, Role::Ledger))
                .max_decoding_message_size(ledger_client::wire::MAX_REPLY_BYTES),
            faults: faults.clone(),
            late: Arc::default(),
        };
        let grpc = secured(Grpc::new(), certs, Role::Ledger, ledger_svc::POLICY)
            .service(LedgerServer::new(proxy))
            .await;
        serve(grpc, faults).await
    }
}

type Updates = Pin<Box<dyn Stream<Item = Result<lpb::WatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Ledger for LedgerProxy {
    async fn get(&self, request: Request<lpb::GetRequest>) -> Result<Response<lpb::GetResponse>, Status> {
        self.faults.gate("Get")?;
        let result = self.upstream.clone().get(request.into_inner()).await;
        let late = std::mem::take(&mut *self.late.lock().unwrap_or_else(PoisonError::into_inner));
        for compare in late {
            let landed = self.upstream.clone().compare(compare).await;
            self.faults.bump(if landed.is_ok() {
                "landed late"
            } else {
                "late and refused"
            });
        }
        self.faults.reply("Get", result)
    }

    async fn list(&self, request: Request<lpb::ListRequest>) -> Result<Response<lpb::ListResponse>, Status> {
        self.faults.gate("List")?;
        let result = self.upstream.clone().list(request.into_inner()).await;
        self.faults.reply("List", result)
    }

    async fn compare(&self, request: Request<lpb::CompareRequest>) -> Result<Response<lpb::CompareResponse>, Status> {
        self.faults.gate("Compare")?;
        let request = request.into_inner();
        if self.faults.take_land_after_read() {
            self.late.lock().unwrap_or_else(PoisonError::into_inner).push(request);
            return Err(self.faults.lost("Compare"));
        }
        let lose = self.faults.take_compare_drop(&request);
        let result = self.upstream.clone().compare(request).await;
        if lose {
            return Err(self.faults.lost("Compare"));
        }
        self.faults.reply("Compare", result)
    }

    type WatchStream = Updates;

    async fn watch(&self, request: Request<lpb::WatchRequest>) -> Result<Response<Updates>, Status> {
        self.faults.gate("Watch")?;
        let stream = self.upstream.clone().watch(request.into_inner()).await?.into_inner();
        let updates: Updates = Box::pin(stream);
        Ok(Response::new(updates))
    }
}

/// Whether a compare writes a document of `kind` whose JSON payload contains `needle`.
pub fn writes(request: &lpb::CompareRequest, kind: &str, needle: &str) -> bool {
    request.entries.iter().any(|e| {
        e.kind == kind && matches!(&e.action, Some(lpb::compare_entry::Action::PutJson(json)) if json.contains(needle))
    })
}
