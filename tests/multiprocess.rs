//! Multi-process mode, for real: ledger-svc on PostgreSQL, two placement-svc replicas sharing
//! Redis, three node-svcs with distinct capacities running real processes, each service its
//! own OS process. Creates go through both placement replicas (this test plays the gateway's
//! part: Place, create on the node, Created); the accounting must stay exact at every step.
//!
//! Needs PostgreSQL and Redis (scripts/services starts them) and the service binaries, which
//! `cargo test --workspace` builds.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use proto::node::v1 as node_pb;
use proto::node::v1::node_client::NodeClient;
use proto::placement::v1 as pl;
use proto::placement::v1::placement_client::PlacementClient;
use sqlx::Connection;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;

use stack::services::{postgres_url, redis_url};

/// A service binary next to this test's executable's build directory.
fn binary(name: &str) -> PathBuf {
    let mut dir = std::env::current_exe().expect("test executable path");
    dir.pop(); // deps/
    dir.pop(); // debug/ (or release/)
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the services first (`cargo build --workspace --bins`; `cargo test --workspace` does)",
        path.display()
    );
    path
}

/// A port for a child process to listen on, free now. Taken below the kernel's ephemeral
/// range (32768-60999 here), where `bind(0)` would pick: the children's own outgoing
/// connections (to Redis, PostgreSQL, each other) draw from that range and once took a port
/// handed out here before its service could bind it. Never the same port twice per run.
/// Nor the nodes' DNS forwarder's port, which each node binds as it starts.
fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if handed_out.is_empty() {
        handed_out.push(node_svc::runtime::container::network::default_dns_port());
    }
    let start = 20_000 + (std::process::id() % 10_000) as u16;
    let port = (0..10_000u16)
        .map(|i| 20_000 + (start - 20_000 + i) % 12_000)
        .find(|p| !handed_out.contains(p) && TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .expect("a free port below the ephemeral range");
    handed_out.push(port);
    port
}

/// Child processes that are killed when the test ends, however it ends.
struct Processes {
    children: Vec<(String, Child)>,
    /// Each child's log, by name.
    logs: BTreeMap<String, PathBuf>,
    /// The cluster's certificates: every child proves its role with them (`--tls-dir`), and
    /// the test's own clients too.
    certs: stack::Certs,
}

impl Processes {
    fn spawn(&mut self, name: &str, binary: &str, args: &[String], log: &std::path::Path) {
        let path = log.join(format!("{name}.log"));
        let out = std::fs::File::create(&path).expect("log file");
        self.logs.insert(name.to_string(), path);
        let child = Command::new(self::binary(binary))
            .args(args)
            // A TLS handshake the server refuses is logged at debug by tonic's accept loop.
            .env("RUST_LOG", "info,tonic::transport::server=debug")
            .env(
                "SANDBOXSCHED_TLS_DIR",
                self.certs.dir().expect("the test's cluster has certificates"),
            )
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {binary}: {e}"));
        self.children.push((name.to_string(), child));
    }

    fn assert_running(&mut self) {
        for (name, child) in &mut self.children {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("{name} exited early with {status}; see its log");
            }
        }
    }

    /// The last lines of child `name`'s log, for a failure message.
    fn log_tail(&self, name: &str) -> String {
        let Some(path) = self.logs.get(name) else {
            return format!("(no log of {name})");
        };
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A channel to child `name` at `endpoint`, proving it is `peer`. Each attempt has a few
/// seconds (a handshake that hangs does not use up the whole wait); a child that never
/// answers fails the test with every cause of the last error and the end of its log.
async fn connect(name: &str, endpoint: &str, peer: stack::Role, procs: &mut Processes) -> Channel {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut attempts = 0u32;
    loop {
        procs.assert_running();
        attempts += 1;
        let attempt = procs.certs.endpoint(endpoint, peer).expect("endpoint");
        let why = match tokio::time::timeout(Duration::from_secs(5), attempt.connect()).await {
            Ok(Ok(channel)) => return channel,
            Ok(Err(err)) => error_chain(&err),
            Err(_) => "no channel within 5 s".to_string(),
        };
        if Instant::now() >= deadline {
            panic!(
                "{name} at {endpoint} never came up ({attempts} attempts): {why}\n--- the end of its log ---\n{}",
                procs.log_tail(name)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `err` and every error that caused it, outermost first.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        out += &format!(": {c}");
        cause = c.source();
    }
    out
}

/// Polls `check` (every 50 ms, at most 30 s) until it returns `Some`.
async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A node Create of one vCPU and `memory_bytes` at epoch 1.
fn create_request(id: &str, memory_bytes: u64, start_command: &str) -> node_pb::CreateRequest {
    node_pb::CreateRequest {
        operation_id: format!("create-{id}"),
        epoch: 1,
        sandbox_id: id.to_string(),
        template: "base".into(),
        resources: Some(node_pb::Resources {
            vcpus: 1,
            memory_bytes,
            disk_bytes: 0,
        }),
        start_command: start_command.into(),
        ..Default::default()
    }
}

async fn views(p: &mut PlacementClient<Channel>) -> Vec<pl::NodeView> {
    p.nodes(pl::NodesRequest {}).await.expect("nodes").into_inner().nodes
}

/// The accounting is exact: for every node, what placement believes equals what the node
/// really runs, with no reservation or removal left over.
async fn assert_exact(p: &mut PlacementClient<Channel>, nodes: &mut BTreeMap<String, NodeClient<Channel>>) {
    for view in views(p).await {
        let real = nodes
            .get_mut(&view.node_id)
            .expect("known node")
            .list(node_pb::ListRequest {})
            .await
            .expect("list")
            .into_inner()
            .sandboxes;
        let real_vcpus: u32 = real.iter().map(|s| s.resources.unwrap_or_default().vcpus).sum();
        let believed = view.believed.unwrap_or_default();
        assert_eq!(
            (believed.vcpus, view.pending, view.unconfirmed, view.reported_sandboxes),
            (real_vcpus, 0, 0, real.len() as u32),
            "placement's view of {} disagrees with the node",
            view.node_id
        );
    }
}

/// What every multi-process test starts from: a work folder, a fresh PostgreSQL schema, and a
/// ledger-svc process on it.
struct Base {
    tag: String,
    work: PathBuf,
    schema: String,
    pg: sqlx::PgConnection,
    procs: Processes,
    ledger_endpoint: String,
}

async fn base(prefix: &str) -> Base {
    let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_string();
    let work = std::env::temp_dir().join(format!("multiprocess-{prefix}-{tag}"));
    std::fs::create_dir_all(&work).unwrap();
    let schema = format!("{prefix}_{tag}");
    let mut pg = sqlx::PgConnection::connect(&postgres_url())
        .await
        .unwrap_or_else(|e| stack::services::postgres_missing(e));
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&mut pg)
        .await
        .unwrap();
    let mut procs = Processes {
        children: Vec::new(),
        logs: BTreeMap::new(),
        certs: stack::Certs::issue(&work.join("certs")).expect("the test cluster's certificates"),
    };
    let ledger = format!("127.0.0.1:{}", free_port());
    procs.spawn(
        "ledger",
        "ledger-svc",
        &[
            "--listen".into(),
            ledger.clone(),
            "--database-url".into(),
            format!("{}?options[search_path]={schema}", postgres_url()),
        ],
        &work,
    );
    let ledger_endpoint = format!("http://{ledger}");
    connect("ledger", &ledger_endpoint, stack::Role::Ledger, &mut procs).await;
    Base {
        tag,
        work,
        schema,
        pg,
        procs,
        ledger_endpoint,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_as_processes_keep_accounting_exact_across_two_placers() {
    let Base {
        tag,
        work,
        schema,
        mut pg,
        mut procs,
        ledger_endpoint,
    } = base("mp").await;

    let mut placers = Vec::new();
    for i in 0..2 {
        let addr = format!("127.0.0.1:{}", free_port());
        procs.spawn(
            &format!("placement-{i}"),
            "placement-svc",
            &[
                "--listen".into(),
                addr.clone(),
                "--redis-url".into(),
                redis_url(),
                "--redis-prefix".into(),
                format!("mp-{tag}"),
                "--ledger".into(),
                ledger_endpoint.clone(),
                "--node-doc-interval-secs".into(),
                "1".into(),
            ],
            &work,
        );
        placers.push(format!("http://{addr}"));
    }
    let mut p = Vec::new();
    for (i, endpoint) in placers.iter().enumerate() {
        p.push(PlacementClient::new(
            connect(&format!("placement-{i}"), endpoint, stack::Role::Placement, &mut procs).await,
        ));
    }

    let mut nodes = BTreeMap::new();
    for (i, (vcpus, memory_mb)) in [(2u32, 2048u64), (4, 4096), (8, 8192)].into_iter().enumerate() {
        let addr = format!("127.0.0.1:{}", free_port());
        let id = format!("mp-{tag}-n{i}");
        procs.certs.node(&id).expect("the node's certificate");
        procs.spawn(
            &id,
            "node-svc",
            &[
                "--listen".into(),
                addr.clone(),
                "--envd-listen".into(),
                "127.0.0.1:0".into(),
                "--node-id".into(),
                id.clone(),
                "--state-dir".into(),
                work.join(&id).display().to_string(),
                // Each node reports to one replica; Redis makes it every replica's truth.
                "--placement".into(),
                placers[i % 2].clone(),
                "--heartbeat-ms".into(),
                "100".into(),
                "--vcpus".into(),
                vcpus.to_string(),
                "--memory-mb".into(),
                memory_mb.to_string(),
            ],
            &work,
        );
        let endpoint = format!("http://{addr}");
        nodes.insert(
            id.clone(),
            NodeClient::new(connect(&id, &endpoint, stack::Role::Node, &mut procs).await),
        );
    }

    // Both replicas see all three nodes.
    for replica in &p {
        eventually("three ready nodes", || {
            let mut r = replica.clone();
            async move {
                let v = views(&mut r).await;
                (v.len() == 3 && v.iter().all(|n| n.state == pl::NodeState::Ready as i32)).then_some(())
            }
        })
        .await;
    }

    // 24 creates through both replicas, concurrently, as two gateway replicas would.
    let mut tasks = Vec::new();
    for i in 0..24 {
        let mut placer = p[i % 2].clone();
        let mut node_clients = nodes.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("mp{i:02}");
            let placed = placer
                .place(pl::PlaceRequest {
                    sandbox_id: id.clone(),
                    resources: Some(pl::Resources {
                        vcpus: 1,
                        memory_bytes: 128 * MIB,
                    }),
                    ..Default::default()
                })
                .await
                .expect("place")
                .into_inner();
            let node = node_clients.get_mut(&placed.node_id).expect("placed on a known node");
            node.create(create_request(&id, 128 * MIB, "sleep 120"))
                .await
                .expect("create on the node");
            placer
                .created(pl::SandboxRef {
                    sandbox_id: id.clone(),
                    node_id: placed.node_id.clone(),
                    resources: None,
                })
                .await
                .expect("created");
            (id, placed.node_id)
        }));
    }
    let mut placed = Vec::new();
    for t in tasks {
        placed.push(t.await.unwrap());
    }
    procs.assert_running();

    // Until heartbeats list them, reservations carry them; afterwards the reports do. Either
    // way the total is exact at once, on both replicas.
    for replica in &mut p {
        let total: u32 = views(replica).await.iter().map(|n| n.believed.unwrap().vcpus).sum();
        assert_eq!(total, 24);
    }
    let first = p[0].clone();
    eventually("heartbeats listing every sandbox", || {
        let mut r = first.clone();
        async move {
            let v = views(&mut r).await;
            let listed: u32 = v.iter().map(|n| n.reported_sandboxes).sum();
            let open: u32 = v.iter().map(|n| n.pending + n.unconfirmed).sum();
            (listed == 24 && open == 0).then_some(())
        }
    })
    .await;
    for replica in &mut p {
        assert_exact(replica, &mut nodes).await;
    }

    // Kill a third of them, telling the *other* replica than the one that placed them.
    for (i, (id, node_id)) in placed.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
        let node = nodes.get_mut(node_id).unwrap();
        node.kill(node_pb::LifecycleRequest {
            operation_id: format!("kill-{id}"),
            epoch: 1,
            sandbox_id: id.clone(),
        })
        .await
        .expect("kill");
        p[(i + 1) % 2]
            .removed(pl::SandboxRef {
                sandbox_id: id.clone(),
                node_id: node_id.clone(),
                resources: Some(pl::Resources {
                    vcpus: 1,
                    memory_bytes: 128 * MIB,
                }),
            })
            .await
            .expect("removed");
    }
    for replica in &mut p {
        let total: u32 = views(replica).await.iter().map(|n| n.believed.unwrap().vcpus).sum();
        assert_eq!(total, 16, "kills are subtracted at once");
    }
    eventually("heartbeats no longer listing the killed", || {
        let mut r = first.clone();
        async move {
            let listed: u32 = views(&mut r).await.iter().map(|n| n.reported_sandboxes).sum();
            (listed == 16).then_some(())
        }
    })
    .await;
    for replica in &mut p {
        assert_exact(replica, &mut nodes).await;
    }

    // The placers published the node documents to the ledger on PostgreSQL.
    let ledger_client =
        ledger_client::LedgerClient::connect_lazy(&ledger_endpoint, &procs.certs.security(stack::Role::Operator))
            .unwrap();
    let docs = eventually("three node documents", || {
        let (l, tag) = (ledger_client.clone(), tag.clone());
        async move {
            let (docs, _) = l
                .list::<common::docs::NodeDoc>(common::docs::NODE_KIND, "")
                .await
                .ok()?;
            let mine: Vec<_> = docs.into_iter().filter(|d| d.key.id.contains(&tag)).collect();
            (mine.len() == 3).then_some(mine)
        }
    })
    .await;
    assert!(docs.iter().all(|d| d.value.capacity.memory_bytes >= 2048 * MIB));

    // Clean up: sandboxes, processes, schema, Redis keys, cgroups.
    for (id, node_id) in placed.iter().enumerate().filter(|(i, _)| i % 3 != 0).map(|(_, x)| x) {
        let _ = nodes
            .get_mut(node_id)
            .unwrap()
            .kill(node_pb::LifecycleRequest {
                operation_id: format!("cleanup-{id}"),
                epoch: 1,
                sandbox_id: id.clone(),
            })
            .await;
    }
    drop(procs);
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&mut pg)
        .await
        .unwrap();
    if let Ok(client) = redis::Client::open(redis_url()) {
        if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("mp-{tag}:*"))
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: Result<(), _> = redis::cmd("DEL").arg(keys).query_async(&mut conn).await;
            }
        }
    }
    for i in 0..3 {
        node_svc::runtime::cgroup::remove_parents(&format!("mp-{tag}-n{i}"));
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// Crash safety with real processes: a balance-svc process aborts itself (no clean-up, its
/// lease kept, as a SIGKILL would leave it) right after each step of a move in turn, before and
/// after the plan records that step; a fresh balance-svc process takes over once the lease
/// expires. Every time, the sandbox ends up running in exactly one place, with its files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_survives_balance_svc_dying_after_every_step() {
    use balance_svc::record::{PlanDoc, Step, PLAN_KIND};
    use common::docs::{EstimateSource, SandboxDoc, SandboxPhase, SANDBOX_KIND};
    use ledger_client::{LedgerClient, Txn};

    let Base {
        tag,
        work,
        schema,
        mut pg,
        mut procs,
        ledger_endpoint,
    } = base("mpb").await;
    let mut nodes = Vec::new();
    for i in 0..2 {
        let (grpc, envd) = (free_port(), free_port());
        let id = format!("mpb{tag}-{i}");
        procs.certs.node(&id).expect("the node's certificate");
        procs.spawn(
            &id,
            "node-svc",
            &[
                "--listen".into(),
                format!("127.0.0.1:{grpc}"),
                "--envd-listen".into(),
                format!("127.0.0.1:{envd}"),
                "--node-id".into(),
                id.clone(),
                "--state-dir".into(),
                work.join(&id).display().to_string(),
            ],
            &work,
        );
        let endpoint = format!("http://127.0.0.1:{grpc}");
        let client = NodeClient::new(connect(&id, &endpoint, stack::Role::Node, &mut procs).await);
        nodes.push((id, endpoint, format!("http://127.0.0.1:{envd}"), client));
    }
    let ledger_client =
        LedgerClient::connect_lazy(&ledger_endpoint, &procs.certs.security(stack::Role::Operator)).unwrap();
    let certs_dir = procs
        .certs
        .dir()
        .expect("the test's cluster has certificates")
        .to_path_buf();
    let balance = |halt: Option<String>| {
        let mut args = vec![
            "--listen".to_string(),
            format!("127.0.0.1:{}", free_port()),
            "--ledger".into(),
            ledger_endpoint.clone(),
            // No placement in this test: the nodes report to none.
            "--placement".into(),
            String::new(),
            "--interval-ms".into(),
            "100".into(),
            "--lease-ttl-secs".into(),
            "1".into(),
        ];
        if let Some(h) = halt {
            args.extend(["--fault-halt".into(), h]);
        }
        let log = std::fs::File::create(work.join(format!("balance-{}.log", uuid::Uuid::new_v4().simple()))).unwrap();
        Command::new(binary("balance-svc"))
            .args(&args)
            .env("RUST_LOG", "info")
            .env("SANDBOXSCHED_TLS_DIR", &certs_dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("balance-svc starts")
    };

    let mut cases = Vec::new();
    for step in ["Owned", "SourcePaused", "Restored", "TargetResumed", "Switched"] {
        cases.push(step.to_string());
        cases.push(format!("{step}:recorded"));
    }
    cases.push("Done".into());
    for (n, halt) in cases.iter().enumerate() {
        let (from, to) = if n % 2 == 0 { (0, 1) } else { (1, 0) };
        let id = format!("mpb{n}");
        nodes[from]
            .3
            .create(create_request(&id, 64 * MIB, "sleep 600"))
            .await
            .unwrap();
        let node_ids: Vec<String> = nodes.iter().map(|n| n.0.clone()).collect();
        let home = |node: usize| {
            work.join(&node_ids[node])
                .join("sandboxes")
                .join(&id)
                .join("disk")
                .join("home")
        };
        std::fs::write(home(from).join("notes.txt"), &id).unwrap();
        let manifest = SandboxDoc {
            sandbox_id: id.clone(),
            team_id: "team".into(),
            template: "base".into(),
            vcpus: 1,
            memory_bytes: 64 * MIB,
            memory_source: EstimateSource::Request,
            phase: SandboxPhase::Running,
            node_id: nodes[from].0.clone(),
            node_address: nodes[from].1.clone(),
            envd_address: nodes[from].2.clone(),
            epoch: 1,
            end_at_unix_ms: u64::MAX / 2,
            ..SandboxDoc::default()
        };
        let plan_id = format!("0000000000000-mp{n}");
        let plan = PlanDoc::one_move(
            &plan_id,
            &id,
            (&nodes[from].0, &nodes[from].1),
            (&nodes[to].0, &nodes[to].1),
            64 * MIB,
        );
        ledger_client
            .compare(
                Txn::new()
                    .create(SANDBOX_KIND, &id, &manifest)
                    .unwrap()
                    .create(PLAN_KIND, &plan_id, &plan)
                    .unwrap(),
            )
            .await
            .unwrap();

        let mut dying = balance(Some(halt.clone()));
        let status = eventually(&format!("balance-svc to die after {halt}"), || {
            let exited = dying.try_wait().unwrap();
            async move { exited }
        })
        .await;
        assert!(
            !status.success(),
            "after {halt} it should have aborted, not exited cleanly"
        );
        let mut recovering = balance(None);
        let done = eventually(&format!("plan {plan_id} finished after a crash at {halt}"), || async {
            let plan = ledger_client.get::<PlanDoc>(PLAN_KIND, &plan_id).await.ok()??;
            plan.value.finished_at_unix_ms.is_some().then_some(plan.value)
        })
        .await;
        let _ = recovering.kill();
        let _ = recovering.wait();
        assert_eq!(done.moves[0].step, Step::Done, "after {halt}: {done:?}");

        // Exactly one copy, running, on the target, with its files and its process.
        let mut copies = Vec::new();
        for (i, node) in nodes.iter_mut().enumerate() {
            let listed = node
                .3
                .list(node_pb::ListRequest {})
                .await
                .unwrap()
                .into_inner()
                .sandboxes;
            copies.extend(listed.into_iter().filter(|s| s.sandbox_id == id).map(|s| (i, s)));
        }
        assert_eq!(copies.len(), 1, "after {halt}: copies {copies:?}");
        let (at, info) = &copies[0];
        assert_eq!(*at, to, "after {halt}");
        assert_eq!(
            info.state,
            node_pb::SandboxState::Running as i32,
            "after {halt}: {info:?}"
        );
        assert!(
            std::path::Path::new(&format!("/proc/{}", info.pgid)).exists(),
            "after {halt}: its process group leader {} is gone",
            info.pgid
        );
        assert_eq!(std::fs::read_to_string(home(to).join("notes.txt")).unwrap(), id);
        let manifest = ledger_client
            .get::<SandboxDoc>(SANDBOX_KIND, &id)
            .await
            .unwrap()
            .unwrap()
            .value;
        assert_eq!(
            (manifest.node_id.as_str(), manifest.lifecycle_owner),
            (nodes[to].0.as_str(), None)
        );
        nodes[to]
            .3
            .kill(node_pb::LifecycleRequest {
                operation_id: format!("done-{id}"),
                epoch: manifest.epoch,
                sandbox_id: id.clone(),
            })
            .await
            .unwrap();
    }
    drop(procs);
    for (id, ..) in &nodes {
        node_svc::runtime::cgroup::remove_parents(id);
    }
    let _ = std::fs::remove_dir_all(&work);
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&mut pg)
        .await
        .unwrap();
}
