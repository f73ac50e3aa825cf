//! `sandboxsched`: the launcher for the whole local stack.
//!
//! `sandboxsched up` starts every service in one process on fixed loopback ports, on the
//! embedded default (a SQLite file under the data directory; nothing else to install), prints
//! where each listens, and stops them cleanly on Ctrl-C. Each service is also its own binary
//! for multi-process deployments.

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

mod trace_sink;

#[derive(Parser, Debug)]
#[command(version, about = "sandboxsched: an E2B-compatible sandbox control plane")]
struct Cli {
    /// A TOML file of settings (table `[sandboxsched]`, keys = the long flag names of `up`);
    /// environment variables and flags override it.
    #[arg(long, global = true, env = "SANDBOXSCHED_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the whole local stack in this process until Ctrl-C.
    Up(Box<UpArgs>),
    /// Receive OTLP traces and print a line per span (a stand-in for a tracing backend).
    TraceSink(trace_sink::TraceSinkArgs),
}

#[derive(clap::Args, Debug)]
struct UpArgs {
    /// Where the stack keeps its state (the ledger's SQLite file, sandbox directories).
    #[arg(long, env = "SANDBOXSCHED_DATA_DIR", default_value = "data")]
    data_dir: PathBuf,
    /// Where Prometheus metrics of every service are served (`GET /metrics`).
    #[arg(long, env = "SANDBOXSCHED_METRICS_LISTEN", default_value = "127.0.0.1:9100")]
    metrics_listen: SocketAddr,
    /// Address of ledger-svc's gRPC endpoint.
    #[arg(long, env = "SANDBOXSCHED_LEDGER_LISTEN", default_value = "127.0.0.1:7001")]
    ledger_listen: SocketAddr,
    /// Address of placement-svc's gRPC endpoint.
    #[arg(long, env = "SANDBOXSCHED_PLACEMENT_LISTEN", default_value = "127.0.0.1:7002")]
    placement_listen: SocketAddr,
    /// Share placement state through this Redis instead of keeping it in memory.
    #[arg(long, env = "SANDBOXSCHED_PLACEMENT_REDIS_URL")]
    placement_redis_url: Option<String>,
    /// How many node-svcs to run (each gets an equal share of this host's vCPUs and memory).
    #[arg(long, env = "SANDBOXSCHED_NODES", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=50))]
    nodes: u16,
    /// Port of the first node-svc; the others follow, and their envd endpoints start 100
    /// higher. 0 picks free ports.
    #[arg(long, env = "SANDBOXSCHED_NODE_BASE_PORT", default_value_t = 7100)]
    node_base_port: u16,
    /// Address of the E2B REST API and envd proxy.
    #[arg(long, env = "SANDBOXSCHED_GATEWAY_LISTEN", default_value = "127.0.0.1:3000")]
    gateway_listen: SocketAddr,
    /// Address of the operator's web console (`/console`, signed in with the admin token):
    /// keep it on the operators' network.
    #[arg(long, env = "SANDBOXSCHED_CONSOLE_LISTEN", default_value = "127.0.0.1:3001")]
    console_listen: SocketAddr,
    /// How sandboxes run: `container` (each an OCI container: its own root filesystem, user,
    /// PID, mount and network namespaces) or `unisolated` (processes on this host as its root:
    /// for developing the control plane only).
    #[arg(long, env = "SANDBOXSCHED_RUNTIME", default_value = "container", value_parser = ["container", "unisolated"])]
    runtime: String,
    /// A runc-compatible OCI runtime for `container` (runc, runsc for gVisor, ...); default:
    /// the built-in one.
    #[arg(long, env = "SANDBOXSCHED_OCI_RUNTIME")]
    oci_runtime: Option<std::path::PathBuf>,
    /// A statically linked envd for the nodes to put in every sandbox (built by
    /// `scripts/build-static-envd`): needed for templates built from OCI images, which bring
    /// their own C library or none. Unset: this binary's own envd, for templates on the host's
    /// userland only.
    #[arg(long, env = "SANDBOXSCHED_ENVD_BINARY")]
    envd_binary: Option<std::path::PathBuf>,
    /// The blob store the nodes and the gateway share (template layers, build files): S3 as
    /// `s3://BUCKET?endpoint=http://HOST:PORT&region=...` (credentials from AWS_* variables),
    /// or a directory. Unset: `blobs/` in the data directory.
    #[arg(long, env = "SANDBOXSCHED_BLOB_STORE")]
    blob_store: Option<String>,
    /// Registries (`host:port`, comma-separated) template builds may pull from although they
    /// resolve to a private or loopback address (such as a registry on this machine).
    #[arg(long, env = "SANDBOXSCHED_PRIVATE_REGISTRIES", value_delimiter = ',')]
    private_registries: Vec<String>,
    /// Memory capacity of each node-svc in MiB (default: an equal share of this host's).
    #[arg(long, env = "SANDBOXSCHED_NODE_MEMORY_MB")]
    node_memory_mb: Option<u64>,
    /// How many times this host's free disk the sandboxes' disks may promise together (each
    /// is sparse, 2 GiB unless asked otherwise; 1: every disk could fill to its size, so a
    /// small free disk holds few sandboxes). Split among the nodes.
    #[arg(long, env = "SANDBOXSCHED_DISK_OVERCOMMIT", default_value_t = 1.0)]
    disk_overcommit: f64,
    /// Address of balance-svc's gRPC endpoint (status, plan history, drain, pause).
    #[arg(long, env = "SANDBOXSCHED_BALANCE_LISTEN", default_value = "127.0.0.1:7003")]
    balance_listen: SocketAddr,
    /// Milliseconds between balance observations.
    #[arg(long, env = "SANDBOXSCHED_BALANCE_INTERVAL_MS", default_value_t = 5_000)]
    balance_interval_ms: u64,
    /// Use this database for the ledger instead of the embedded SQLite file
    /// (for example postgres://postgres@127.0.0.1:5432/sandboxsched).
    #[arg(long, env = "SANDBOXSCHED_LEDGER_DATABASE_URL")]
    ledger_database_url: Option<String>,
    /// More API keys as KEY=TEAM, comma-separated (the generated key belongs to team
    /// `default`); teams never see each other's sandboxes.
    #[arg(long, env = "SANDBOXSCHED_API_KEYS", value_delimiter = ',')]
    api_keys: Vec<String>,
    /// Do not build E2B's `code-interpreter-v1` (by default it is built once a node is up,
    /// the first time in some seconds, and `up` says when it is ready).
    #[arg(long, env = "SANDBOXSCHED_NO_CODE_INTERPRETER")]
    no_code_interpreter: bool,
    /// How many sandboxes one team may hold at once (running, paused or being created); past
    /// it a create is answered 429. 0: no limit.
    #[arg(long, env = "SANDBOXSCHED_MAX_SANDBOXES_PER_TEAM", default_value_t = 100)]
    max_sandboxes_per_team: u32,
}

fn main() -> anyhow::Result<std::process::ExitCode> {
    // This binary hosts node-svc, so it is also envd inside each sandbox and the container
    // runtime (`sandboxsched envd ...`, `sandboxsched jail ...`): those run first, alone.
    if let Some(code) = node_svc::multicall() {
        return Ok(code);
    }
    tokio::runtime::Runtime::new()?.block_on(launch())?;
    Ok(std::process::ExitCode::SUCCESS)
}

async fn launch() -> anyhow::Result<()> {
    let telemetry = common::telemetry::init("sandboxsched");
    let result = match common::config::parse::<Cli>("sandboxsched").command {
        Command::Up(args) => up(*args).await,
        Command::TraceSink(args) => trace_sink::run(args).await,
    };
    telemetry.shutdown().await;
    result
}

/// A part of the local stack that comes from Debian's packages: `up` installs it when it can
/// (root, apt), as it would any other part, and otherwise says what is lost without it.
struct DebianPart {
    /// Any of these paths present: installed.
    present: &'static [&'static str],
    packages: &'static [&'static str],
    /// Printed before installing: what it is for.
    why: &'static str,
    /// Printed when it could not be installed.
    without: &'static str,
}

/// Sandboxes reach out through rules the node puts in the kernel with `nft`.
const NFT: DebianPart = DebianPart {
    present: &["/usr/sbin/nft", "/sbin/nft"],
    packages: &["nftables"],
    why: "nft is missing: installing Debian's nftables (sandboxes' egress rules live in the kernel)",
    without: "nft (Debian's nftables) is not installed and could not be: sandboxes that ask for a network \
              (E2B's default) will be refused; ones made with allow_internet_access=false run",
};

/// `code-interpreter-v1` runs the nodes' Python kernels (its sandboxes share the host's `/usr`,
/// as `base` does).
const CODE_INTERPRETER: DebianPart = DebianPart {
    present: &["/usr/lib/python3/dist-packages/ipykernel/__init__.py"],
    packages: &[
        "python3-ipykernel",
        "python3-jupyter-client",
        "python3-matplotlib",
        "python3-pandas",
    ],
    why: "the code interpreter's kernels are missing: installing Debian's python3-ipykernel, \
          python3-jupyter-client, python3-matplotlib and python3-pandas",
    without: "Debian's python3-ipykernel, python3-jupyter-client, python3-matplotlib and python3-pandas \
              are not installed and could not be: code-interpreter-v1 will fail to build (up --no-code-interpreter \
              leaves it out)",
};

fn ensure_installed(part: &DebianPart) {
    if part.present.iter().any(|p| std::path::Path::new(p).is_file()) {
        return;
    }
    // /proc/self belongs to this process's effective user.
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0);
    if root && std::path::Path::new("/usr/bin/apt-get").is_file() {
        eprintln!("{}", part.why);
        let installed = std::process::Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(part.packages)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if installed {
            return;
        }
    }
    eprintln!("warning: {}", part.without);
}

async fn up(args: UpArgs) -> anyhow::Result<()> {
    if args.runtime == "container" {
        ensure_installed(&NFT);
    }
    if !args.no_code_interpreter {
        ensure_installed(&CODE_INTERPRETER);
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create data directory {}", args.data_dir.display()))?;
    let database_url = args
        .ledger_database_url
        .unwrap_or_else(|| format!("sqlite://{}", args.data_dir.join("ledger.db").display()));
    let (metrics_addr, _metrics) = common::metrics::serve(args.metrics_listen)
        .await
        .context("starting the metrics endpoint")?;
    let api_key = secret_file(&args.data_dir.join("api_key"), || {
        format!("e2b_{}", uuid::Uuid::new_v4().simple())
    })?;
    let admin_token = secret_file(&args.data_dir.join("admin_token"), || {
        format!("admin_{}", uuid::Uuid::new_v4().simple())
    })?;
    let mut keys: std::collections::HashMap<String, String> = [(api_key.clone(), "default".to_string())].into();
    for pair in &args.api_keys {
        let (key, team) = pair
            .split_once('=')
            .filter(|(k, t)| !k.is_empty() && !t.is_empty())
            .with_context(|| format!("API key {pair:?} must be KEY=TEAM"))?;
        keys.insert(key.to_string(), team.to_string());
    }
    let templates_file = args.data_dir.join("templates.json");
    let templates: Vec<e2b_gateway::intent::Template> = if templates_file.is_file() {
        serde_json::from_slice(&std::fs::read(&templates_file)?)
            .with_context(|| format!("reading {}", templates_file.display()))?
    } else {
        Vec::new()
    };

    let (ledger_listen, ledger_url) = (args.ledger_listen, database_url.clone());
    let (placement_listen, redis_url) = (args.placement_listen, args.placement_redis_url.clone());
    let mut builder = stack::Stack::builder()
        .dir(&args.data_dir)
        .no_wait()
        .heartbeat(std::time::Duration::from_secs(2))
        .ledger(move |c| {
            c.listen = ledger_listen;
            c.database_url = ledger_url;
        })
        .placement(move |c| {
            c.listen = placement_listen;
            c.node_doc_interval = std::time::Duration::from_secs(5);
            if let Some(url) = redis_url {
                c.store = placement_svc::server::StoreConfig::Redis {
                    url,
                    prefix: "sandboxsched".to_string(),
                };
            }
        });
    let host = node_svc::server::host_capacity();
    let share = u64::from(args.nodes);
    let templates_dir = args.data_dir.join("templates");
    for i in 1..=args.nodes {
        // Port 0 picks free ports (for tests that run beside anything else).
        let port = |offset: u16| {
            if args.node_base_port == 0 {
                0
            } else {
                args.node_base_port + offset + i - 1
            }
        };
        let listen = SocketAddr::new(args.placement_listen.ip(), port(0));
        let envd_listen = SocketAddr::new(listen.ip(), port(100));
        let capacity = node_svc::sandbox::Resources {
            vcpus: (host.vcpus / u32::from(args.nodes)).max(1),
            memory_bytes: args.node_memory_mb.map_or(host.memory_bytes / share, |mb| mb << 20),
            disk_bytes: 0,
        };
        let templates_dir = templates_dir.is_dir().then(|| templates_dir.clone());
        let runtime = match args.runtime.as_str() {
            "unisolated" => node_svc::server::RuntimeKind::Unisolated { cgroups: true },
            _ => node_svc::server::RuntimeKind::Container {
                oci_runtime: args.oci_runtime.clone(),
            },
        };
        let envd_binary = args.envd_binary.clone();
        let blob_store = args.blob_store.clone();
        let private_registries = args.private_registries.clone();
        // Nodes that share this host share its processes too.
        let pids_max = node_svc::runtime::cgroup::default_pids_max() / share;
        // And its disk: each node promises its share of the free space, so together they
        // promise no more than the host has.
        let disk_overcommit = args.disk_overcommit.max(0.01) / share as f64;
        builder = builder.named_node(format!("node-{i}"), move |c| {
            c.pids_max = Some(pids_max);
            c.host.disk_overcommit = disk_overcommit;
            c.host.private_registries = private_registries;
            c.runtime = runtime;
            c.envd_binary = envd_binary;
            if let Some(url) = blob_store {
                c.host.blob_store = Some(url);
            }
            c.listen = listen;
            c.envd_listen = envd_listen;
            c.host.capacity = capacity;
            c.host.templates_dir = templates_dir;
        });
    }
    let (balance_listen, balance_interval) = (
        args.balance_listen,
        std::time::Duration::from_millis(args.balance_interval_ms.max(1)),
    );
    let (gateway_listen, hibernate_dir) = (args.gateway_listen, args.data_dir.join("hibernated"));
    let upload_dir = args.data_dir.join("uploads");
    let max_sandboxes_per_team = args.max_sandboxes_per_team;
    let gateway_blobs = args.blob_store.clone();
    let code_interpreter = !args.no_code_interpreter;
    let console_listen = args.console_listen;
    let console_token = admin_token.clone();
    let stack = builder
        .balance(move |c| {
            c.listen = balance_listen;
            c.tuning.interval = balance_interval;
            c.lease_ttl = c.lease_ttl.max(balance_interval * 3);
        })
        .gateway(move |c| {
            c.listen = gateway_listen;
            c.keys = keys;
            c.admin_token = Some(admin_token.clone());
            c.templates = templates;
            c.hibernate_dir = hibernate_dir;
            c.upload_dir = upload_dir;
            c.max_sandboxes_per_team = max_sandboxes_per_team;
            c.domain = sandbox_domain(gateway_listen);
            c.code_interpreter = code_interpreter;
            if let Some(url) = gateway_blobs {
                c.blob_store = url;
            }
        })
        .console(move |c| {
            c.listen = console_listen;
            c.admin_token = Some(console_token);
        })
        .start()
        .await?;
    let (Some(placement), Some(balance), Some(gateway), Some(console)) =
        (&stack.placement, &stack.balance, &stack.gateway, &stack.console)
    else {
        anyhow::bail!("the stack started without placement, balance, the gateway or the console");
    };
    let ledger = &stack.ledger;
    let nodes: Vec<&node_svc::server::RunningNode> = stack.nodes.iter().map(|n| &n.running).collect();

    println!();
    println!("sandboxsched is up (data in {})", args.data_dir.display());
    println!(
        "  ledger-svc     grpc {}   ({})",
        ledger.endpoint(),
        redact(&database_url)
    );
    let placement_store = args
        .placement_redis_url
        .as_deref()
        .map_or("in memory".to_string(), redact);
    println!("  placement-svc  grpc {}   ({placement_store})", placement.endpoint());
    for node in &nodes {
        let host = node.host();
        let cap = host.capacity();
        println!(
            "  node-svc       grpc {}   envd {}   ({}, {} vCPU, {} MiB, {} runtime)",
            node.endpoint(),
            node.envd_endpoint(),
            host.node_id(),
            cap.vcpus,
            cap.memory_bytes >> 20,
            host.runtime_kind()
        );
    }
    println!(
        "  balance-svc    grpc {}   (observes every {} ms; its observations and plans are logged here)",
        balance.endpoint(),
        args.balance_interval_ms
    );
    println!(
        "  e2b-gateway    http {}   (E2B REST API and envd proxy)",
        gateway.url()
    );
    println!(
        "  console-svc    http {}   (the operator's console; sign in with the admin token)",
        console.url()
    );
    println!("  metrics        http://{metrics_addr}/metrics   (Prometheus, every service)");
    if let Some(certs) = stack.certs.dir() {
        println!(
            "  gRPC is mutual TLS; certificates in {} (sandboxsched-ctl --tls-dir {0})",
            certs.display()
        );
    }
    println!(
        "  admin token    {} (the console's sign-in; X-Admin-Token for GET /nodes, /pools)",
        args.data_dir.join("admin_token").display()
    );
    println!();
    println!("Point an unmodified E2B SDK at it:");
    println!("  export E2B_API_URL={}", gateway.url());
    println!("  export E2B_SANDBOX_URL={}", gateway.url());
    println!("  export E2B_API_KEY={api_key}");
    println!();
    println!("Press Ctrl-C to stop.");
    tokio::spawn(report_code_interpreter(gateway.code_interpreter()));

    common::shutdown::signal().await;
    // A move in flight finishes its current step (a restart resumes the rest); sandboxes keep
    // running and the next `up` re-adopts them.
    drop(nodes);
    stack.stop().await;
    Ok(())
}

/// Prints each change of `code-interpreter-v1`'s availability (its first build takes some
/// seconds after start; a create of it waits for that build).
async fn report_code_interpreter(
    mut watch: tokio::sync::watch::Receiver<e2b_gateway::templates::code_interpreter::Availability>,
) {
    use e2b_gateway::templates::code_interpreter::{Availability, NAME};
    let mut last = String::new();
    loop {
        let line = match &*watch.borrow_and_update() {
            Availability::Off => String::new(),
            Availability::Waiting(why) => format!("{NAME}: waiting ({why})"),
            Availability::Building { .. } => format!("{NAME}: building from base (first start only)..."),
            Availability::Ready { built_in: Some(took) } => {
                format!("{NAME}: ready (built in {:.1} s)", took.as_secs_f64())
            }
            Availability::Ready { built_in: None } => format!("{NAME}: ready (built before)"),
            Availability::Failed(why) => format!("{NAME}: build failed, retrying: {why}"),
        };
        if !line.is_empty() && line != last {
            println!("{line}");
            last = line;
        }
        if watch.changed().await.is_err() {
            return;
        }
    }
}

/// The local stack's API key: made once, kept in the data directory so it survives restarts.
/// The secret kept in `path`, made by `make` on first use.
fn secret_file(path: &std::path::Path, make: impl FnOnce() -> String) -> anyhow::Result<String> {
    if let Ok(key) = std::fs::read_to_string(path) {
        if !key.trim().is_empty() {
            return Ok(key.trim().to_string());
        }
    }
    let key = make();
    // Readable by its owner only: a credential of the local stack.
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut file| file.write_all(key.as_bytes()))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(key)
}

/// Where the local stack's sandbox hosts live: `{port}-{id}.localhost:PORT` reaches the
/// gateway wherever `*.localhost` resolves to loopback (browsers, curl). Port 0 stands for
/// the port the gateway ends up bound to.
fn sandbox_domain(gateway: SocketAddr) -> String {
    format!("localhost:{}", gateway.port())
}

/// Hides a password in a database URL before printing it.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{}:***{}", &url[..scheme + 3], user, &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}
