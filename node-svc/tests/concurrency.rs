//! One slow sandbox must not stall the node. A runtime wrapper holds the kill of one chosen
//! sandbox inside the runtime until the test releases it; meanwhile another sandbox's envd
//! calls, the node's list, info and heartbeat picture, and lifecycle calls on other sandboxes
//! must all answer promptly. Operations on the held sandbox itself must wait for the kill and
//! then see its outcome, and a retry of the held kill must get the kill's own answer. A kill
//! whose caller goes away still finishes before the next operation on its sandbox starts.
//!
//! The test synchronises on events: the wrapper reports when the held kill has reached the
//! runtime, and blocks until the test sends a release. The only time bounds are generous
//! limits on calls that should take milliseconds, so a regression fails instead of hanging.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::Duration;

use node_svc::api::NodeApi;
use node_svc::envd::Envd;
use node_svc::host::{CreateSpec, Host, HostConfig, NodeError};
use node_svc::runtime::process::ProcessRuntime;
use node_svc::runtime::{Features, Runtime, RuntimeError, Sandbox};
use node_svc::sandbox::{Move, Resources, State};
use proto::node::v1 as pb;
use proto::node::v1::node_client::NodeClient;
use tokio::sync::mpsc;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
/// How long a call that has no reason to wait may take (the machine is small and shared).
const PROMPT: Duration = Duration::from_secs(2);
/// How long a held kill waits for its release before giving up on its own, so a test that
/// failed never leaves a blocking-pool thread behind for long.
const HOLD_LIMIT: Duration = Duration::from_secs(60);

/// A runtime that delegates to `inner`, except that a kill of `held` blocks, after telling
/// `entered`, until a release arrives (or the sender is dropped: a failed test lets go).
struct HeldKill {
    inner: Arc<dyn Runtime>,
    held: String,
    entered: mpsc::UnboundedSender<()>,
    release: Mutex<std_mpsc::Receiver<()>>,
    /// True while a kill of `held` is inside the runtime.
    killing: AtomicBool,
    /// Set when another runtime call for `held` arrived while its kill was inside: the host
    /// let two operations on one sandbox overlap.
    overlapped: AtomicBool,
}

impl HeldKill {
    fn check_overlap(&self, record: &Sandbox<'_>) {
        if record.id == self.held && self.killing.load(Ordering::SeqCst) {
            self.overlapped.store(true, Ordering::SeqCst);
        }
    }
}

impl Runtime for HeldKill {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn features(&self) -> Features {
        self.inner.features()
    }

    fn start(&self, record: &Sandbox<'_>, home: &Path) -> Result<u32, RuntimeError> {
        self.check_overlap(record);
        self.inner.start(record, home)
    }

    fn pause(&self, record: &Sandbox<'_>) -> Result<(), RuntimeError> {
        self.check_overlap(record);
        self.inner.pause(record)
    }

    fn resume(&self, record: &Sandbox<'_>) -> Result<(), RuntimeError> {
        self.check_overlap(record);
        self.inner.resume(record)
    }

    fn kill(&self, record: &Sandbox<'_>) -> Result<(), RuntimeError> {
        if record.id == self.held {
            self.check_overlap(record);
            self.killing.store(true, Ordering::SeqCst);
            let _ = self.entered.send(());
            if let Ok(release) = self.release.lock() {
                let _ = release.recv_timeout(HOLD_LIMIT);
            }
            let killed = self.inner.kill(record);
            self.killing.store(false, Ordering::SeqCst);
            return killed;
        }
        self.inner.kill(record)
    }

    fn memory_used(&self, record: &Sandbox<'_>) -> u64 {
        self.inner.memory_used(record)
    }

    fn alive(&self, record: &Sandbox<'_>) -> bool {
        self.inner.alive(record)
    }

    fn adopt(&self, record: &Sandbox<'_>) -> Result<(), RuntimeError> {
        self.check_overlap(record);
        self.inner.adopt(record)
    }

    fn reap(&self) {
        self.inner.reap();
    }

    fn cpu_time_ns(&self) -> Option<u64> {
        self.inner.cpu_time_ns()
    }

    fn enclose(
        &self,
        record: &Sandbox<'_>,
        home: &Path,
        cwd: &Path,
        command: &mut Command,
    ) -> Result<(), RuntimeError> {
        self.inner.enclose(record, home, cwd, command)
    }
}

/// A host on the real process runtime with one sandbox's kill held, serving envd over HTTP
/// and the node API over gRPC, as `node_svc::server::start` wires them.
struct Node {
    node_id: String,
    dir: PathBuf,
    host: Arc<Host>,
    runtime: Arc<HeldKill>,
    entered: mpsc::UnboundedReceiver<()>,
    release: std_mpsc::Sender<()>,
    envd: String,
    grpc: NodeClient<Channel>,
    http: reqwest::Client,
    servers: Vec<tokio::task::JoinHandle<()>>,
}

impl Node {
    async fn start(held: &str) -> Self {
        let node_id = format!("k{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let dir = std::env::temp_dir().join(format!("concurrency-test-{node_id}"));
        let (entered_tx, entered) = mpsc::unbounded_channel();
        let (release, release_rx) = std_mpsc::channel();
        let runtime = Arc::new(HeldKill {
            inner: Arc::new(ProcessRuntime::new(&node_id, true)),
            held: held.to_string(),
            entered: entered_tx,
            release: Mutex::new(release_rx),
            killing: AtomicBool::new(false),
            overlapped: AtomicBool::new(false),
        });
        let config = HostConfig {
            node_id: node_id.clone(),
            state_dir: dir.clone(),
            templates_dir: None,
            capacity: Resources {
                vcpus: 8,
                memory_bytes: 16 * 1024 * MIB,
                disk_bytes: 0,
            },
            blob_store: None,
            layer_cache_bytes: node_svc::host::DEFAULT_LAYER_CACHE_BYTES,
            private_registries: Vec::new(),
            registry_floor: Vec::new(),
            disk_bytes: node_svc::host::DEFAULT_DISK_BYTES,
            build_disk_bytes: node_svc::host::DEFAULT_BUILD_DISK_BYTES,
            own_disks: true,
            disk_overcommit: 1.0,
            spare_disks: node_svc::host::DEFAULT_SPARE_DISKS,
        };
        let host = Arc::new(Host::open(config, runtime.clone()).await.expect("host opens"));

        let envd_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let envd_addr = envd_listener.local_addr().unwrap();
        let router = Envd::new(host.clone()).router();
        let envd_server = tokio::spawn(async move {
            let _ = axum::serve(envd_listener, router).await;
        });
        let grpc_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc_addr = grpc_listener.local_addr().unwrap();
        let api = NodeApi::new(host.clone(), format!("http://{envd_addr}"));
        let grpc_server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(pb::node_server::NodeServer::new(api))
                .serve_with_incoming(common::net::grpc_incoming(grpc_listener))
                .await;
        });
        let grpc = NodeClient::connect(format!("http://{grpc_addr}")).await.unwrap();
        Self {
            node_id,
            dir,
            host,
            runtime,
            entered,
            release,
            envd: format!("http://{envd_addr}"),
            grpc,
            http: reqwest::Client::new(),
            servers: vec![envd_server, grpc_server],
        }
    }

    async fn create(&self, id: &str, start_command: &str) -> pb::SandboxInfo {
        self.grpc
            .clone()
            .create(pb::CreateRequest {
                operation_id: format!("create-{id}-{}", uuid::Uuid::new_v4().simple()),
                epoch: 1,
                sandbox_id: id.into(),
                template: "base".into(),
                resources: Some(pb::Resources {
                    vcpus: 1,
                    memory_bytes: 128 * MIB,
                    disk_bytes: 0,
                }),
                start_command: start_command.into(),
                env_vars: [("GREETING".to_string(), format!("hello from {id}"))].into(),
                access_token: token_of(id),
                ..Default::default()
            })
            .await
            .expect("create")
            .into_inner()
    }

    /// Kills `id` through gRPC in a task of its own; returns once the kill is inside the
    /// runtime, held.
    async fn start_held_kill(&mut self, id: &str, operation_id: &str) -> tokio::task::JoinHandle<pb::SandboxInfo> {
        let mut grpc = self.grpc.clone();
        let request = lifecycle(id, operation_id);
        let kill = tokio::spawn(async move { grpc.kill(request).await.expect("held kill").into_inner() });
        tokio::time::timeout(Duration::from_secs(10), self.entered.recv())
            .await
            .expect("the kill reaches the runtime")
            .expect("the runtime is alive");
        kill
    }

    fn release_kill(&self) {
        self.release.send(()).expect("the held kill is waiting");
    }

    /// `GET /envs` for `sandbox`, with its token: (HTTP status, the env vars).
    async fn envs(&self, sandbox: &str) -> (u16, serde_json::Value) {
        let response = self
            .http
            .get(format!("{}/envs", self.envd))
            .header("E2b-Sandbox-Id", sandbox)
            .header("X-Access-Token", token_of(sandbox))
            .send()
            .await
            .expect("envs");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or_default())
    }

    /// `process.Process/List` over Connect for `sandbox`, with its token: the HTTP status.
    async fn process_list(&self, sandbox: &str) -> u16 {
        self.http
            .post(format!("{}/process.Process/List", self.envd))
            .header("E2b-Sandbox-Id", sandbox)
            .header("X-Access-Token", token_of(sandbox))
            .header("Content-Type", "application/json")
            .header("Connect-Protocol-Version", "1")
            .body("{}")
            .send()
            .await
            .expect("process list")
            .status()
            .as_u16()
    }

    async fn listed(&self) -> Vec<String> {
        let list = self.grpc.clone().list(pb::ListRequest {}).await.expect("list");
        list.into_inner().sandboxes.into_iter().map(|s| s.sandbox_id).collect()
    }

    async fn cleanup(self) {
        // Without its sender, a held kill lets go at once.
        drop(self.release);
        for (record, _) in self.host.list().await {
            let _ = self.host.lifecycle("", u64::MAX, &record.id, Move::Kill).await;
        }
        for server in &self.servers {
            server.abort();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        node_svc::runtime::cgroup::remove_parents(&self.node_id);
    }
}

fn token_of(sandbox: &str) -> String {
    format!("token-of-{sandbox}")
}

fn lifecycle(id: &str, operation_id: &str) -> pb::LifecycleRequest {
    pb::LifecycleRequest {
        operation_id: operation_id.into(),
        epoch: 1,
        sandbox_id: id.into(),
    }
}

/// Awaits `call`, failing the test if it takes longer than [`PROMPT`].
async fn promptly<T>(what: &str, call: impl Future<Output = T>) -> T {
    match tokio::time::timeout(PROMPT, call).await {
        Ok(value) => value,
        Err(_) => panic!("{what} did not answer within {PROMPT:?} while another sandbox's kill was held"),
    }
}

/// Whether process `pid` is gone (or only a zombie).
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_kill_delays_no_other_sandbox_nor_the_node() {
    let mut node = Node::start("slow").await;
    let slow = node.create("slow", "sleep 600").await;
    assert!(slow.pgid > 0, "the slow sandbox runs its start command");
    node.create("other", "").await;

    let kill = node.start_held_kill("slow", "kill-slow").await;

    // Another sandbox's envd calls, each authorised by a registry lookup.
    let (status, envs) = promptly("GET /envs", node.envs("other")).await;
    assert_eq!(status, 200);
    assert_eq!(envs["GREETING"], "hello from other");
    assert_eq!(promptly("process.Process/List", node.process_list("other")).await, 200);
    // The node's own views: gRPC List and Info, and the picture a heartbeat reports. The held
    // sandbox is still listed: its kill has not happened yet.
    let listed = promptly("gRPC List", node.listed()).await;
    assert_eq!(listed, vec!["other".to_string(), "slow".to_string()]);
    let info = promptly("gRPC Info", node.grpc.clone().info(pb::InfoRequest {}))
        .await
        .expect("info")
        .into_inner();
    assert_eq!(info.sandboxes, 2);
    let picture = promptly("heartbeat picture", node.host.picture()).await;
    assert!(picture.sandboxes.iter().any(|s| s.sandbox_id == "other"));
    // Lifecycle of other sandboxes goes on: pause and resume one, create and kill another.
    let paused = promptly("pause other", node.grpc.clone().pause(lifecycle("other", "p-other")))
        .await
        .expect("pause other");
    assert_eq!(paused.into_inner().state, pb::SandboxState::Paused as i32);
    let resumed = promptly("resume other", node.grpc.clone().resume(lifecycle("other", "r-other")))
        .await
        .expect("resume other");
    assert_eq!(resumed.into_inner().state, pb::SandboxState::Running as i32);
    promptly("create third", node.create("third", "")).await;
    let killed = promptly("kill third", node.grpc.clone().kill(lifecycle("third", "k-third")))
        .await
        .expect("kill third");
    assert_eq!(killed.into_inner().state, pb::SandboxState::Killed as i32);
    assert!(!kill.is_finished(), "the held kill finished before its release");

    node.release_kill();
    let killed = tokio::time::timeout(Duration::from_secs(20), kill)
        .await
        .expect("the released kill ends")
        .expect("kill task");
    assert_eq!(killed.state, pb::SandboxState::Killed as i32);
    assert!(gone(slow.pgid), "the slow sandbox's start command was killed");
    assert_eq!(node.listed().await, vec!["other".to_string()]);
    let (status, _) = node.envs("slow").await;
    assert_eq!(status, 404, "a killed sandbox is not found");
    assert!(!node.runtime.overlapped.load(Ordering::SeqCst));
    node.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_on_the_held_sandbox_wait_for_its_kill() {
    let mut node = Node::start("x").await;
    node.create("x", "sleep 600").await;

    // Kill against pause, and a retry of the kill with its operation ID.
    let kill = node.start_held_kill("x", "kill-x").await;
    let host = node.host.clone();
    let pause = tokio::spawn(async move { host.lifecycle("pause-x", 1, "x", Move::Pause).await });
    let host = node.host.clone();
    let retry = tokio::spawn(async move { host.lifecycle("kill-x", 1, "x", Move::Kill).await });
    // Nothing can tell when the two have started waiting: give them time to overtake the
    // kill if the host let them.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pause.is_finished(), "a pause overtook the kill of its sandbox");
    assert!(!retry.is_finished(), "a retried kill answered before the kill itself");
    node.release_kill();
    let killed = tokio::time::timeout(Duration::from_secs(20), kill)
        .await
        .expect("the released kill ends")
        .expect("kill task");
    assert_eq!(killed.state, pb::SandboxState::Killed as i32);
    let paused = tokio::time::timeout(Duration::from_secs(10), pause)
        .await
        .expect("the pause ends")
        .expect("pause task");
    assert!(
        matches!(paused, Err(NodeError::NotFound(_))),
        "a pause after the kill finds nothing: {paused:?}"
    );
    let retried = tokio::time::timeout(Duration::from_secs(10), retry)
        .await
        .expect("the retry ends")
        .expect("retry task")
        .expect("the retry gets the kill's answer");
    assert_eq!(retried.state, State::Killed);
    assert_eq!(retried.epoch, killed.epoch);

    // Kill against create of the same ID: the create waits for the kill to remove the old
    // sandbox, then makes a new one with a fresh home.
    node.create("x", "sleep 600").await;
    let home = node.host.home("x");
    std::fs::write(home.join("old.txt"), "from the first x").unwrap();
    let kill = node.start_held_kill("x", "kill-x-again").await;
    let host = node.host.clone();
    let create = tokio::spawn(async move {
        host.create(CreateSpec {
            operation_id: "create-x-again".into(),
            epoch: 2,
            sandbox_id: "x".into(),
            template: "base".into(),
            resources: Resources {
                vcpus: 1,
                memory_bytes: 128 * MIB,
                disk_bytes: 0,
            },
            access_token: Some(token_of("x")),
            ..Default::default()
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!create.is_finished(), "a create overtook the kill of the same ID");
    node.release_kill();
    tokio::time::timeout(Duration::from_secs(20), kill)
        .await
        .expect("the released kill ends")
        .expect("kill task");
    let created = tokio::time::timeout(Duration::from_secs(10), create)
        .await
        .expect("the create ends")
        .expect("create task")
        .expect("the create after the kill succeeds");
    assert_eq!((created.state, created.epoch), (State::Running, 2));
    assert!(home.is_dir(), "the new sandbox has a home");
    assert!(
        !home.join("old.txt").exists(),
        "the new sandbox starts from a fresh home"
    );
    assert_eq!(node.listed().await, vec!["x".to_string()]);
    assert!(!node.runtime.overlapped.load(Ordering::SeqCst));
    node.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_whose_caller_went_away_still_finishes_first() {
    let mut node = Node::start("x").await;
    let first = node.create("x", "sleep 600").await;
    std::fs::write(node.host.home("x").join("old.txt"), "from the first x").unwrap();

    // The caller of the held kill goes away (as a client that disconnects or a gRPC deadline
    // drops the request's future).
    let host = node.host.clone();
    let kill = tokio::spawn(async move { host.lifecycle("kill-x", 1, "x", Move::Kill).await });
    tokio::time::timeout(Duration::from_secs(10), node.entered.recv())
        .await
        .expect("the kill reaches the runtime")
        .expect("the runtime is alive");
    kill.abort();
    assert!(kill.await.is_err_and(|e| e.is_cancelled()));

    let host = node.host.clone();
    let create = tokio::spawn(async move {
        host.create(CreateSpec {
            operation_id: "create-x-again".into(),
            epoch: 2,
            sandbox_id: "x".into(),
            template: "base".into(),
            resources: Resources {
                vcpus: 1,
                memory_bytes: 128 * MIB,
                disk_bytes: 0,
            },
            access_token: Some(token_of("x")),
            ..Default::default()
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!create.is_finished(), "a create overtook a kill whose caller went away");
    node.release_kill();
    let created = tokio::time::timeout(Duration::from_secs(20), create)
        .await
        .expect("the create ends")
        .expect("create task");
    let created = created.expect("the create after the kill succeeds");
    assert_eq!((created.state, created.epoch), (State::Running, 2));
    assert!(
        !node.host.home("x").join("old.txt").exists(),
        "the new sandbox starts from a fresh home"
    );
    assert!(gone(first.pgid), "the abandoned kill still killed");
    assert!(!node.runtime.overlapped.load(Ordering::SeqCst));
    node.cleanup().await;
}

/// A pause waits for a file change accepted before it, and a change that arrives while the
/// pause is under way is turned away: a move's snapshot (taken after the pause) never races a
/// write the user was told succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_waits_for_file_changes_accepted_before_it() {
    let node = Node::start("nobody").await;
    node.create("w", "sleep 600").await;
    let access = node.host.file_access("w").await.expect("a running sandbox's files");
    let host = node.host.clone();
    let mut pause = tokio::spawn(async move { host.lifecycle("pause-w", 1, "w", Move::Pause).await });
    // Nothing can tell when the pause has started waiting: give it time to go ahead if the
    // host let it (a pause takes about a millisecond).
    let early = tokio::time::timeout(Duration::from_millis(300), &mut pause).await;
    assert!(early.is_err(), "the pause went ahead of a write in flight: {early:?}");
    assert_eq!(
        node.host.get("w").await.unwrap().state,
        node_svc::sandbox::State::Running
    );
    drop(access);
    let paused = promptly("the pause, once the write is done", pause)
        .await
        .expect("pause task")
        .expect("paused");
    assert_eq!(paused.state, node_svc::sandbox::State::Paused);
    assert!(
        node.host.file_access("w").await.is_none(),
        "a paused sandbox's files are not open to writes"
    );
    node.cleanup().await;
}
