//! `bench gateway-create`: creates through the REST API until the sandbox runs (201), then a
//! kill, against the whole stack in this process on the embedded default (each sandbox a
//! container): latency with one client at a time, and throughput with 64 concurrent clients.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Sequential creates for the latency figures.
    #[arg(long, default_value_t = 200)]
    creates: usize,
    /// Concurrent clients for the throughput figure.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Seconds the throughput phase runs.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
}

/// E2B's default create: the sandbox may reach the internet, so it gets a link out.
const LINKED: &str = r#"{"templateID":"base"}"#;
/// A create whose sandbox keeps loopback only: no veth pair, no addresses, no routes.
const UNLINKED: &str = r#"{"templateID":"base","allow_internet_access":false}"#;

async fn create_and_kill(http: &reqwest::Client, url: &str, body: &'static str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let r = http
        .post(format!("{url}/sandboxes"))
        .header("X-API-Key", "bench")
        .header("Content-Type", "application/json")
        .body(body)
        .send()
        .await?;
    if r.status().as_u16() != 201 {
        let status = r.status();
        anyhow::bail!("create answered {status}: {}", r.text().await.unwrap_or_default());
    }
    let took = started.elapsed();
    let body: serde_json::Value = r.json().await?;
    let id = body["sandboxID"].as_str().context("sandboxID")?;
    let k = http
        .delete(format!("{url}/sandboxes/{id}"))
        .header("X-API-Key", "bench")
        .send()
        .await?;
    anyhow::ensure!(k.status().as_u16() == 204, "kill answered {}", k.status());
    Ok(took)
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    // Room for every client's sandbox twice over (a killed one's reservation is released a
    // moment after its kill answers): a create refused for room would end the run.
    let vcpus = u32::try_from(args.clients.saturating_mul(4))
        .unwrap_or(u32::MAX)
        .max(256);
    let stack = stack::Stack::builder()
        // Placement publishes no node documents here: the figure is the create path's alone.
        .placement(|c| c.ledger_endpoint = None)
        .heartbeat(Duration::from_millis(200))
        .node(move |c| {
            c.host.capacity = node_svc::sandbox::Resources {
                vcpus,
                memory_bytes: u64::from(vcpus) << 31,
            }
        })
        .gateway(|c| {
            c.keys = [("bench".to_string(), "bench".to_string())].into();
            c.reap_interval = Duration::from_secs(5);
        })
        .start()
        .await?;
    // Measured apart from the stack's start and shut-down, so a failed run still kills every
    // sandbox it made instead of leaving them running on the host.
    let measured = measure(&stack, &args).await;
    stack.shut_down().await;
    Ok(report(&args, measured?))
}

/// What one run measures.
struct Figures {
    p50_ms: f64,
    p99_ms: f64,
    per_sec: f64,
    unlinked_per_sec: f64,
}

async fn measure(stack: &stack::Stack, args: &Args) -> anyhow::Result<Figures> {
    anyhow::ensure!(args.creates > 0, "--creates must be at least 1");
    let gateway = stack.gateway.as_ref().context("the stack has a gateway")?;
    let url = gateway.url();
    let http = reqwest::Client::new();
    // Until the node's first heartbeat lands, nothing can be placed.
    let ready = Instant::now();
    while create_and_kill(&http, &url, LINKED).await.is_err() {
        anyhow::ensure!(
            ready.elapsed() < Duration::from_secs(10),
            "the stack never accepted a create"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut latencies = Vec::with_capacity(args.creates);
    for _ in 0..args.creates {
        latencies.push(create_and_kill(&http, &url, LINKED).await?);
    }
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1000.0;
    let (p50_ms, p99_ms) = (pct(0.5), pct(0.99));

    let per_sec = throughput(&http, &url, args, LINKED).await?;
    // The same load without the link out, in the same run: what the veth pair, its addresses
    // and routes (and their removal) cost, as a ratio this machine's noise does not swamp.
    let unlinked_per_sec = throughput(&http, &url, args, UNLINKED).await?;
    Ok(Figures {
        p50_ms,
        p99_ms,
        per_sec,
        unlinked_per_sec,
    })
}

fn report(args: &Args, figures: Figures) -> Report {
    let round = |x: f64| (x * 100.0).round() / 100.0;
    let mut report = Report::new(format!(
        "gateway-create: REST create until running, then kill; embedded default, containers ({} sequential, {} concurrent clients)",
        args.creates, args.clients
    ));
    report
        .figure("create_p50_ms", round(figures.p50_ms), "ms")
        .figure("create_p99_ms", round(figures.p99_ms), "ms")
        .figure(
            "creates_per_sec",
            figures.per_sec.round() as u64,
            "creates/s (each followed by its kill)",
        )
        .figure(
            "unlinked_creates_per_sec",
            figures.unlinked_per_sec.round() as u64,
            "creates/s of sandboxes without internet access (no link out)",
        );
    report
}

/// Create-and-kill cycles per second with `args.clients` clients for `args.seconds`.
async fn throughput(http: &reqwest::Client, url: &str, args: &Args, body: &'static str) -> anyhow::Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..args.clients {
        let (http, url, done, stop) = (http.clone(), url.to_string(), done.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                create_and_kill(&http, &url, body).await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    // Every client ends its cycle (its sandbox killed) before a failure is reported.
    let mut failed = None;
    for t in tasks {
        if let Err(e) = t.await.map_err(anyhow::Error::from).and_then(|r| r) {
            failed.get_or_insert(e);
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}
