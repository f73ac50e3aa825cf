//! `bench console`: the operator's console over a simulated cluster of 1,000 nodes and 10,000
//! sandboxes, written straight into a real ledger (nodes' and sandboxes' documents as
//! placement and the gateway write them; no node runs).
//!
//! The console runs as its own process (the `console-svc` binary built beside this one), so
//! its memory is its own: resident memory is sampled before and after it loaded the cluster.
//! Measured: how long it takes to load the view, the time to serve the cluster page (the
//! HTML with every node's row, what a browser's first paint needs) and the sandboxes page,
//! a filtered search over all sandboxes, and the delay from a ledger write to the server-sent
//! event a browser receives for it.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use common::docs::{Capacity, NodeDoc, NodeSandbox, SandboxDoc, SandboxPhase, NODE_KIND, SANDBOX_KIND};
use futures::StreamExt;
use ledger_client::{LedgerClient, Txn};

use crate::report::{ms, percentile, Report};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, default_value_t = 1_000)]
    nodes: usize,
    #[arg(long, default_value_t = 10_000)]
    sandboxes: usize,
    /// Page loads timed (each page).
    #[arg(long, default_value_t = 50)]
    renders: usize,
    /// Ledger writes whose event is timed.
    #[arg(long, default_value_t = 200)]
    updates: usize,
    /// Keep the console up this long after measuring, printing its address and token (to
    /// open it in a browser over the simulated cluster).
    #[arg(long, default_value_t = 0)]
    hold_secs: u64,
}

const MIB: u64 = 1 << 20;

/// The `console-svc` process, killed when dropped.
struct Console {
    child: Child,
    url: String,
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rss_mib(pid: u32) -> f64 {
    let kib = crate::fixture::rss_kib(pid).unwrap_or_default();
    (kib as f64 / 1024.0 * 10.0).round() / 10.0
}

fn console_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.parent().context("executable directory")?.join("console-svc");
    anyhow::ensure!(
        path.exists(),
        "{} is missing: build it beside bench (`cargo build --release -p bench -p console-svc`)",
        path.display()
    );
    Ok(path)
}

fn node_doc(i: usize, per_node: usize, now: u64) -> NodeDoc {
    let id = format!("sim-{i:04}");
    NodeDoc {
        node_id: id.clone(),
        address: format!("http://127.0.0.1:{}", 40_000 + i),
        capacity: Capacity {
            vcpus: 32,
            memory_bytes: 64 * 1024 * MIB,
        },
        allocated: Capacity {
            vcpus: per_node as u32,
            memory_bytes: per_node as u64 * 512 * MIB,
        },
        memory_used_bytes: per_node as u64 * 200 * MIB,
        memory_available_bytes: 64 * 1024 * MIB - per_node as u64 * 200 * MIB,
        available_ratio: 0.5 + (i % 10) as f64 / 50.0,
        sandboxes: (0..per_node)
            .map(|k| NodeSandbox {
                sandbox_id: sandbox_id(i * per_node + k),
                allocated_memory_bytes: 512 * MIB,
                memory_used_bytes: 200 * MIB,
            })
            .collect(),
        reported_at_unix_ms: now,
        ..NodeDoc::default()
    }
}

fn sandbox_id(i: usize) -> String {
    format!("isim{i:016x}")
}

fn sandbox_doc(i: usize, node: usize, now: u64) -> SandboxDoc {
    SandboxDoc {
        sandbox_id: sandbox_id(i),
        team_id: format!("team-{}", i % 37),
        template: ["base", "code-interpreter-v1", "node"][i % 3].into(),
        vcpus: 1,
        memory_bytes: 512 * MIB,
        phase: SandboxPhase::Running,
        node_id: format!("sim-{node:04}"),
        epoch: 1,
        started_at_unix_ms: now - i as u64,
        end_at_unix_ms: now + 3_600_000,
        ..SandboxDoc::default()
    }
}

async fn write_all(ledger: &LedgerClient, docs: Vec<(&'static str, String, serde_json::Value)>) -> anyhow::Result<u64> {
    let mut revision = 0;
    for chunk in docs.chunks(100) {
        let mut txn = Txn::new();
        for (kind, id, value) in chunk {
            txn = txn.put_json(kind, id, 0, value.to_string());
        }
        revision = ledger.compare(txn).await?.revision;
    }
    Ok(revision)
}

/// Waits until the console's view has reached `revision`.
async fn loaded(http: &reqwest::Client, console: &Console, token: &str, revision: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let health: serde_json::Value = http
            .get(format!("{}/api/health", console.url))
            .header("x-admin-token", token)
            .send()
            .await?
            .json()
            .await?;
        if health["revision"].as_u64().unwrap_or_default() >= revision {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the console never loaded revision {revision}: {health}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `count` GETs of `path`; their times and the last body's size.
async fn timed_gets(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    count: usize,
) -> anyhow::Result<(Vec<Duration>, usize)> {
    let mut times = Vec::with_capacity(count);
    let mut size = 0;
    for _ in 0..count {
        let started = Instant::now();
        let response = http.get(url).header("x-admin-token", token).send().await?;
        anyhow::ensure!(response.status().is_success(), "{url}: {}", response.status());
        size = response.bytes().await?.len();
        times.push(started.elapsed());
    }
    Ok((times, size))
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    let program = console_binary()?;
    let s = stack::Stack::builder().start().await?;
    let certs = s.certs.dir().context("the stack has certificates")?.to_path_buf();
    let token = format!("admin_{}", uuid::Uuid::new_v4().simple());
    let token_file = s.dir.join("admin_token");
    std::fs::write(&token_file, &token)?;
    std::fs::set_permissions(&token_file, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = Command::new(program)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--ledger", &s.ledger_endpoint()])
        .args(["--placement", &s.placement_endpoint()])
        .args(["--balance", ""])
        .arg("--admin-token-file")
        .arg(&token_file)
        .arg("--tls-dir")
        .arg(&certs)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .context("starting console-svc")?;
    let console = Console {
        child,
        url: format!("http://127.0.0.1:{port}/console"),
    };
    let http = reqwest::Client::new();
    let pid = console.child.id();
    // Up, with an empty cluster.
    let deadline = Instant::now() + Duration::from_secs(30);
    while http.get(format!("{}/login", console.url)).send().await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "console-svc did not come up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_empty = rss_mib(pid);

    // The cluster, written as placement and the gateway would; the console follows it live.
    let now = common::clock::now_ms();
    let per_node = args.sandboxes.div_ceil(args.nodes.max(1));
    let mut docs = Vec::new();
    for i in 0..args.nodes {
        docs.push((
            NODE_KIND,
            format!("sim-{i:04}"),
            serde_json::to_value(node_doc(i, per_node, now))?,
        ));
    }
    for i in 0..args.sandboxes {
        docs.push((
            SANDBOX_KIND,
            sandbox_id(i),
            serde_json::to_value(sandbox_doc(i, i / per_node, now))?,
        ));
    }
    let started = Instant::now();
    let revision = write_all(&s.ledger_client, docs).await?;
    let written = started.elapsed();
    loaded(&http, &console, &token, revision).await?;
    let followed = started.elapsed();
    let rss_loaded = rss_mib(pid);

    // Pages and queries, each timed whole at the client (loopback).
    let (mut cluster, cluster_bytes) =
        timed_gets(&http, &format!("{}/cluster", console.url), &token, args.renders).await?;
    let (mut sandboxes, sandboxes_bytes) =
        timed_gets(&http, &format!("{}/sandboxes", console.url), &token, args.renders).await?;
    let (mut search, _) = timed_gets(
        &http,
        &format!(
            "{}/api/sandboxes?q=team-7&state=running&offset=200&limit=60",
            console.url
        ),
        &token,
        args.renders,
    )
    .await?;

    // A change in the ledger to its event at a browser's stream.
    let mut events = http
        .get(format!("{}/events?topics=sandbox", console.url))
        .header("x-admin-token", &token)
        .send()
        .await?
        .error_for_status()?
        .bytes_stream();
    let mut buffer = String::new();
    let mut lags = Vec::with_capacity(args.updates);
    for k in 0..args.updates {
        let id = sandbox_id(k * 7 % args.sandboxes.max(1));
        let current = s
            .ledger_client
            .get::<SandboxDoc>(SANDBOX_KIND, &id)
            .await?
            .context("a simulated sandbox")?;
        let mut next = current.value.clone();
        next.end_at_unix_ms += 1_000;
        let sent = Instant::now();
        s.ledger_client
            .compare(Txn::new().update(SANDBOX_KIND, &id, current.version, &next)?)
            .await?;
        let wanted = format!("\"sandboxId\":\"{id}\"");
        let deadline = sent + Duration::from_secs(10);
        loop {
            if let Some(at) = buffer.find(&wanted) {
                // Everything up to the end of this event is consumed.
                let end = buffer[at..].find("\n\n").map_or(buffer.len(), |e| at + e + 2);
                buffer.drain(..end);
                break;
            }
            let chunk = tokio::time::timeout_at(deadline.into(), events.next())
                .await
                .context("no event within 10 s of a ledger write")?
                .context("the event stream ended")??;
            buffer.push_str(&String::from_utf8_lossy(&chunk));
        }
        lags.push(sent.elapsed());
    }
    let rss_after = rss_mib(pid);
    if args.hold_secs > 0 {
        eprintln!(
            "console at {}/login, admin token {token}: held for {} s",
            console.url, args.hold_secs
        );
        tokio::time::sleep(Duration::from_secs(args.hold_secs)).await;
    }
    drop(console);
    s.stop().await;

    let mut report = Report::new(format!(
        "console: {} nodes × {} sandboxes (simulated, in a real ledger); console-svc as its own process",
        args.nodes, args.sandboxes
    ));
    report
        .figure("nodes", args.nodes as u64, "")
        .figure("sandboxes", args.sandboxes as u64, "")
        .figure("ledger_write_ms", ms(written), "ms (the cluster's documents written)")
        .figure(
            "view_loaded_ms",
            ms(followed),
            "ms (from the first write to the console's view holding the last)",
        )
        .figure("cluster_page_p50_ms", ms(percentile(&mut cluster, 0.5)), "ms")
        .figure("cluster_page_p99_ms", ms(percentile(&mut cluster, 0.99)), "ms")
        .figure("cluster_page_kib", (cluster_bytes / 1024) as u64, "KiB")
        .figure("sandboxes_page_p50_ms", ms(percentile(&mut sandboxes, 0.5)), "ms")
        .figure("sandboxes_page_kib", (sandboxes_bytes / 1024) as u64, "KiB")
        .figure(
            "search_p50_ms",
            ms(percentile(&mut search, 0.5)),
            "ms (a filtered page over every sandbox)",
        )
        .figure("search_p99_ms", ms(percentile(&mut search, 0.99)), "ms")
        .figure(
            "update_latency_p50_ms",
            ms(percentile(&mut lags, 0.5)),
            "ms (ledger write → event)",
        )
        .figure("update_latency_p99_ms", ms(percentile(&mut lags, 0.99)), "ms")
        .figure("console_rss_empty_mib", rss_empty, "MiB")
        .figure("console_rss_loaded_mib", rss_loaded, "MiB")
        .figure(
            "console_rss_after_mib",
            rss_after,
            "MiB (after the updates and their stream)",
        )
        .figure(
            "state_bytes_per_sandbox",
            ((rss_loaded - rss_empty).max(0.0) * 1024.0 * 1024.0 / (args.sandboxes + args.nodes).max(1) as f64).round(),
            "B (resident growth per document held)",
        );
    Ok(report)
}
