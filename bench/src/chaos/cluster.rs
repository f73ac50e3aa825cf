//! The multi-process cluster the fault suite runs: every service its own OS process on
//! loopback, started from the binaries built beside this one, each on a port it keeps across
//! restarts (manifests name node addresses, and a restarted node must be found where it was).
//!
//! - a Redis of the suite's own, started empty and killed without a trace (`--save ""`);
//! - ledger-svc on a fresh PostgreSQL schema;
//! - two placement-svc replicas sharing that Redis;
//! - three node-svcs with the container runtime, each reporting to a replica through a
//!   [`Link`] the suite can cut;
//! - balance-svc and two gateways (one per replica).

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::Connection;
use tokio::net::{TcpListener as AsyncListener, TcpStream};
use tokio::sync::watch;

/// The chaos cluster's one team's key (and its team's name): the gateway takes no key shorter
/// than 16 characters.
pub const API_KEY: &str = "chaos-team-key-0001";
pub const NODES: usize = 3;
pub const PLACEMENTS: usize = 2;
pub const GATEWAYS: usize = 2;
/// Memory of each node: room for every client sandbox (the base template asks 512 MiB) even
/// with one node drained and another cut off.
pub const NODE_MEMORY_MB: u64 = 8192;
/// Node heartbeats, and so how fast placement's view settles.
pub const HEARTBEAT_MS: u64 = 200;
/// What a create left unfinished by a killed gateway waits before it is resolved.
pub const ABANDONED_CREATE_AFTER: &str = "8s";
/// What a kill, pause or resume left unfinished by a killed gateway waits before another
/// operation, or the reaper, takes it over.
pub const CLAIM_TTL: &str = "5s";

/// A port for a child to listen on, free now, below the ephemeral range (where the
/// children's own outgoing connections would take it first), never handed out twice, and never
/// the nodes' DNS forwarder's (each node binds it as it starts: once it was handed out here
/// for a node's gRPC, and that node's forwarder took it first).
fn free_port() -> anyhow::Result<u16> {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if handed_out.is_empty() {
        handed_out.push(node_svc::runtime::container::network::default_dns_port());
    }
    let start = (std::process::id() % 12_000) as u16;
    let port = (0..12_000u16)
        .map(|i| 20_000 + (start + i) % 12_000)
        .find(|p| !handed_out.contains(p) && TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .context("no free port below the ephemeral range")?;
    handed_out.push(port);
    Ok(port)
}

/// A service binary built beside this executable.
fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.parent().context("executable directory")?.join(name);
    anyhow::ensure!(
        path.exists(),
        "{} is missing: build the services beside bench (`cargo build --workspace --bins`, with --release for a release bench)",
        path.display()
    );
    Ok(path)
}

/// One service: how to start it, and its process while it runs.
pub struct Service {
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
    /// Where it listens, to wait for it to come up.
    pub addr: SocketAddr,
    /// The cluster's certificates (`--tls-dir` of every service).
    tls_dir: PathBuf,
}

impl Service {
    fn start(&mut self) -> anyhow::Result<()> {
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .env("RUST_LOG", "info")
            .env("SANDBOXSCHED_TLS_DIR", &self.tls_dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("cannot start {}", self.name))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no clean-up, no goodbye.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then SIGKILL if it has not stopped within `grace`.
    fn stop(&mut self, grace: Duration) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }
}

/// A TCP relay that can be cut: while cut, every connection through it is dropped and new
/// ones are closed at once, as a partition would; healed, it relays again.
pub struct Link {
    pub addr: SocketAddr,
    cut: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Link {
    pub async fn open(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = AsyncListener::bind(("127.0.0.1", free_port()?)).await?;
        let addr = listener.local_addr()?;
        let (cut, _) = watch::channel(false);
        let watcher = cut.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                let mut cut = watcher.subscribe();
                tokio::spawn(async move {
                    if *cut.borrow() {
                        return;
                    }
                    let Ok(mut up) = TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                        _ = cut.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        Ok(Self { addr, cut, task })
    }

    pub fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A node as the checker and the teardown need it.
pub struct NodeSpec {
    pub id: String,
    pub endpoint: String,
    pub state_dir: PathBuf,
}

pub struct Cluster {
    pub work: PathBuf,
    schema: String,
    pub services: BTreeMap<String, Service>,
    pub links: Vec<Link>,
    pub nodes: Vec<NodeSpec>,
    pub gateways: Vec<String>,
    pub ledger: String,
    pub placements: Vec<String>,
    pub balance: String,
    /// The cluster's certificates: every service proves its role with them, and so does the
    /// suite (as the operator, the gateway or the balancer) when it looks or acts.
    pub certs: stack::Certs,
}

impl Cluster {
    pub async fn start(postgres_url: &str) -> anyhow::Result<Self> {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
        let work = std::env::temp_dir().join(format!("chaos-{tag}"));
        std::fs::create_dir_all(&work)?;
        let schema = format!("chaos_{tag}");
        let mut pg = sqlx::PgConnection::connect(postgres_url)
            .await
            .unwrap_or_else(|e| stack::services::postgres_missing(e));
        sqlx::query(&format!("CREATE SCHEMA {schema}")).execute(&mut pg).await?;

        let mut cluster = Self {
            work: work.clone(),
            schema: schema.clone(),
            services: BTreeMap::new(),
            links: Vec::new(),
            nodes: Vec::new(),
            gateways: Vec::new(),
            ledger: String::new(),
            placements: Vec::new(),
            balance: String::new(),
            certs: stack::Certs::issue(&work.join("certs"))?,
        };
        let redis = cluster.add("redis", Path::new("redis-server"), |port| {
            vec![
                "--port".into(),
                port.to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--save".into(),
                String::new(),
                "--appendonly".into(),
                "no".into(),
            ]
        })?;
        let ledger = cluster.add_service("ledger", "ledger-svc", |addr| {
            vec![
                "--listen".into(),
                addr.to_string(),
                "--database-url".into(),
                format!("{postgres_url}?options[search_path]={schema}"),
            ]
        })?;
        cluster.ledger = format!("http://{ledger}");
        for i in 0..PLACEMENTS {
            let ledger = cluster.ledger.clone();
            let addr = cluster.add_service(&format!("placement-{i}"), "placement-svc", |addr| {
                vec![
                    "--listen".into(),
                    addr.to_string(),
                    "--redis-url".into(),
                    format!("redis://{redis}"),
                    "--redis-prefix".into(),
                    format!("chaos-{tag}"),
                    "--ledger".into(),
                    ledger,
                    "--node-doc-interval-secs".into(),
                    "1".into(),
                    "--unhealthy-after-ms".into(),
                    "2000".into(),
                ]
            })?;
            cluster.placements.push(format!("http://{addr}"));
        }
        let blobs = work.join("blobs");
        for i in 0..NODES {
            let placement: SocketAddr = cluster.placements[i % PLACEMENTS]
                .trim_start_matches("http://")
                .parse()?;
            let link = Link::open(placement).await?;
            let id = format!("chaos-{tag}-n{i}");
            cluster.certs.node(&id)?;
            let state_dir = work.join(&id);
            let envd_port = free_port()?;
            let (link_addr, blobs) = (link.addr, blobs.display().to_string());
            let node_id = id.clone();
            let state = state_dir.display().to_string();
            let addr = cluster.add_service(&format!("node-{i}"), "node-svc", |addr| {
                vec![
                    "--listen".into(),
                    addr.to_string(),
                    "--envd-listen".into(),
                    format!("127.0.0.1:{envd_port}"),
                    "--node-id".into(),
                    node_id,
                    "--state-dir".into(),
                    state,
                    "--placement".into(),
                    format!("http://{link_addr}"),
                    "--heartbeat-ms".into(),
                    HEARTBEAT_MS.to_string(),
                    "--vcpus".into(),
                    "32".into(),
                    "--memory-mb".into(),
                    NODE_MEMORY_MB.to_string(),
                    "--blob-store".into(),
                    blobs,
                ]
            })?;
            cluster.links.push(link);
            cluster.nodes.push(NodeSpec {
                id,
                endpoint: format!("http://{addr}"),
                state_dir,
            });
        }
        let (ledger, placement) = (cluster.ledger.clone(), cluster.placements[0].clone());
        let balance = cluster.add_service("balance", "balance-svc", |addr| {
            let mut args: Vec<String> = vec!["--listen".into(), addr.to_string(), "--ledger".into(), ledger];
            args.extend(["--placement".into(), placement]);
            for (flag, value) in [
                ("--interval-ms", "500"),
                ("--lease-ttl-secs", "2"),
                ("--cooldown-secs", "5"),
                ("--sweep-every-secs", "2"),
                ("--orphan-grace-secs", "3"),
            ] {
                args.extend([flag.to_string(), value.to_string()]);
            }
            args
        })?;
        cluster.balance = format!("http://{balance}");
        for i in 0..GATEWAYS {
            let (ledger, placement) = (cluster.ledger.clone(), cluster.placements[i % PLACEMENTS].clone());
            let dir = work.join(format!("gateway-{i}"));
            let blobs = blobs.display().to_string();
            let addr = cluster.add_service(&format!("gateway-{i}"), "e2b-gateway", |addr| {
                vec![
                    "--listen".into(),
                    addr.to_string(),
                    "--ledger".into(),
                    ledger,
                    "--placement".into(),
                    placement,
                    "--api-keys".into(),
                    format!("{API_KEY}={API_KEY}"),
                    "--hibernate-dir".into(),
                    dir.display().to_string(),
                    "--upload-dir".into(),
                    dir.join("uploads").display().to_string(),
                    "--blob-store".into(),
                    blobs,
                    "--abandoned-create-after".into(),
                    ABANDONED_CREATE_AFTER.into(),
                    "--claim-ttl".into(),
                    CLAIM_TTL.into(),
                ]
            })?;
            cluster.gateways.push(format!("http://{addr}"));
        }
        let names: Vec<String> = cluster.services.keys().cloned().collect();
        for name in names {
            cluster.ensure_running(&name)?;
        }
        cluster.wait_listening(Duration::from_secs(60)).await?;
        Ok(cluster)
    }

    /// Registers a project binary as a service on a port of its own.
    fn add_service(
        &mut self,
        name: &str,
        program: &str,
        args: impl FnOnce(SocketAddr) -> Vec<String>,
    ) -> anyhow::Result<SocketAddr> {
        let program = binary(program)?;
        self.add(name, &program, |port| args(SocketAddr::from(([127, 0, 0, 1], port))))
    }

    fn add(&mut self, name: &str, program: &Path, args: impl FnOnce(u16) -> Vec<String>) -> anyhow::Result<SocketAddr> {
        let port = free_port()?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        self.services.insert(
            name.to_string(),
            Service {
                name: name.to_string(),
                program: program.to_path_buf(),
                args: args(port),
                log: self.work.join(format!("{name}.log")),
                child: None,
                addr,
                tls_dir: self.work.join("certs"),
            },
        );
        Ok(addr)
    }

    /// Starts `name` unless it runs.
    pub fn ensure_running(&mut self, name: &str) -> anyhow::Result<()> {
        let service = self
            .services
            .get_mut(name)
            .with_context(|| format!("no service {name}"))?;
        if !service.running() {
            service.start()?;
        }
        Ok(())
    }

    pub fn kill(&mut self, name: &str) {
        if let Some(service) = self.services.get_mut(name) {
            service.kill();
        }
    }

    /// Waits until every service accepts connections; fails naming one that exited.
    pub async fn wait_listening(&mut self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        for service in self.services.values_mut() {
            loop {
                if TcpStream::connect(service.addr).await.is_ok() {
                    break;
                }
                anyhow::ensure!(
                    service.running(),
                    "{} exited; see {}",
                    service.name,
                    service.log.display()
                );
                anyhow::ensure!(Instant::now() < deadline, "{} never listened", service.name);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// Stops every service (nodes last, once the caller has ended their sandboxes), drops the
    /// schema and the node's cgroup parents, and removes the work folder unless `keep`.
    pub async fn stop(mut self, postgres_url: &str, keep: bool) {
        let names: Vec<String> = self.services.keys().cloned().collect();
        for name in names.iter().filter(|n| !n.starts_with("node-")) {
            if let Some(s) = self.services.get_mut(name) {
                s.stop(Duration::from_secs(5));
            }
        }
        for name in names.iter().filter(|n| n.starts_with("node-")) {
            if let Some(s) = self.services.get_mut(name) {
                s.stop(Duration::from_secs(10));
            }
        }
        for node in &self.nodes {
            node_svc::runtime::cgroup::remove_parents(&node.id);
        }
        if let Ok(mut pg) = sqlx::PgConnection::connect(postgres_url).await {
            let _ = sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.schema))
                .execute(&mut pg)
                .await;
        }
        if !keep {
            let _ = std::fs::remove_dir_all(&self.work);
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for service in self.services.values_mut() {
            service.kill();
        }
    }
}
