//! `bench gateway-create`: creates through the REST API until the sandbox runs (201), then a
//! kill, against the whole stack in this process on the embedded default (each sandbox a
//! container): latency with one client at a time, and throughput with 64 concurrent clients,
//! with what each create-and-kill cycle costs the host in CPU ([`HostCpu`]): the figure that
//! bounds the throughput any concurrency can reach on this host's cores.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::host_cpu::HostCpu;
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
    /// The services talk without TLS (a stack is mutual TLS otherwise), to see what TLS costs.
    #[arg(long)]
    plaintext: bool,
    /// The node gives sandboxes no disk of their own, to see what making one costs a create.
    #[arg(long)]
    no_disks: bool,
    /// Creates claimed from a warm pool of `base`, one at a time (the pool refilled between
    /// them, out of the timing).
    #[arg(long, default_value_t = 50)]
    warm_creates: usize,
    /// Cycles of the kernel's floor (the same isolation with nothing of ours around it), in
    /// five batches, the cheapest reported.
    #[arg(long, default_value_t = 500)]
    floor_cycles: usize,
    /// The runc binary the same pipeline is measured with, in the same run (its own stack).
    #[arg(long, default_value = "/usr/sbin/runc")]
    runc: std::path::PathBuf,
    /// Skip the runc phase (no runc on this host).
    #[arg(long)]
    no_runc: bool,
}

/// E2B's default create: the sandbox may reach the internet, so it gets a link out.
const LINKED: &str = r#"{"templateID":"base"}"#;
/// A create whose sandbox keeps loopback only: no veth pair, no addresses, no routes.
const UNLINKED: &str = r#"{"templateID":"base","allow_internet_access":false}"#;

async fn create_and_kill(http: &reqwest::Client, url: &str, body: &'static str) -> anyhow::Result<Duration> {
    let (took, id) = create(http, url, body).await?;
    kill(http, url, &id).await?;
    Ok(took)
}

/// A create until its 201: how long it took, and the sandbox's ID.
async fn create(http: &reqwest::Client, url: &str, body: &'static str) -> anyhow::Result<(Duration, String)> {
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
    Ok((took, body["sandboxID"].as_str().context("sandboxID")?.to_string()))
}

async fn kill(http: &reqwest::Client, url: &str, id: &str) -> anyhow::Result<()> {
    let k = http
        .delete(format!("{url}/sandboxes/{id}"))
        .header("X-API-Key", "bench")
        .send()
        .await?;
    anyhow::ensure!(k.status().as_u16() == 204, "kill answered {}", k.status());
    Ok(())
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    // First, on a quiet host: after a stack's shut-down the kernel is still tearing down what
    // its sandboxes left for a while, and that CPU would count against the floor.
    let cycles = args.floor_cycles;
    let floor = tokio::task::spawn_blocking(move || crate::kernel_floor::measure(cycles)).await??;
    let stack = start(&args, None).await?;
    // Measured apart from the stack's start and shut-down, so a failed run still kills every
    // sandbox it made instead of leaving them running on the host.
    let measured = measure(&stack, &args).await;
    stack.shut_down().await;
    let measured = measured?;
    let runc = match args.no_runc {
        true => None,
        false => Some(with_runc(&args).await?),
    };
    Ok(report(&args, measured, &floor, runc.as_ref()))
}

/// The whole stack in this process, its node's sandboxes run by `oci_runtime` (the node's own
/// jail when `None`).
async fn start(args: &Args, oci_runtime: Option<std::path::PathBuf>) -> anyhow::Result<stack::Stack> {
    // Room for every client's sandbox twice over (a killed one's reservation is released a
    // moment after its kill answers): a create refused for room would end the run.
    let vcpus = u32::try_from(args.clients.saturating_mul(4))
        .unwrap_or(u32::MAX)
        .max(256);
    let mut stack = stack::Stack::builder();
    if args.plaintext {
        stack = stack.plaintext();
    }
    let own_disks = !args.no_disks;
    stack
        // Placement publishes no node documents here: the figure is the create path's alone.
        .placement(|c| c.ledger_endpoint = None)
        .heartbeat(Duration::from_millis(200))
        .node(move |c| {
            c.host.capacity = node_svc::sandbox::Resources {
                vcpus,
                memory_bytes: u64::from(vcpus) << 31,
                disk_bytes: 0,
            };
            c.host.own_disks = own_disks;
            // Each sandbox is killed as soon as it runs and writes nothing to its (sparse)
            // disk, but 64 clients hold 64 disks of 2 GiB at once: more than a small free
            // disk may promise. The benchmark promises knowingly, as `up --disk-overcommit`
            // lets an operator (without it, every create past free/2 GiB is refused for room).
            c.host.disk_overcommit = 1_000.0;
            c.runtime = node_svc::server::RuntimeKind::Container { oci_runtime };
        })
        .gateway(|c| {
            c.keys = [("bench".to_string(), "bench".to_string())].into();
            c.reap_interval = Duration::from_secs(5);
        })
        .start()
        .await
        .map_err(Into::into)
}

/// Until the node's first heartbeat lands, nothing can be placed: creates until one succeeds.
async fn first_create(http: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    let ready = Instant::now();
    while create_and_kill(http, url, LINKED).await.is_err() {
        anyhow::ensure!(
            ready.elapsed() < Duration::from_secs(10),
            "the stack never accepted a create"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The concurrent phase again on a stack whose node runs Debian's runc.
async fn with_runc(args: &Args) -> anyhow::Result<Throughput> {
    anyhow::ensure!(
        args.runc.is_file(),
        "{} is missing: install runc (scripts/services does), or pass --no-runc",
        args.runc.display()
    );
    let stack = start(args, Some(args.runc.clone())).await?;
    let measured = async {
        let url = stack.gateway.as_ref().context("the stack has a gateway")?.url();
        let http = reqwest::Client::new();
        first_create(&http, &url).await?;
        throughput(&http, &url, args, LINKED).await
    }
    .await;
    stack.shut_down().await;
    measured
}

/// What one run measures.
struct Figures {
    p50_ms: f64,
    p99_ms: f64,
    linked: Throughput,
    unlinked: Throughput,
    warm: Warm,
}

/// What the concurrent phase of one kind of create measures.
struct Throughput {
    /// Create-and-kill cycles completed per second.
    per_sec: f64,
    /// The host's busy CPU time per cycle, in milliseconds (every process and kernel thread).
    cpu_ms: f64,
    /// The CPUs that time was spent on.
    cores: usize,
}

impl Throughput {
    /// Cycles per second the host's cores could complete at this CPU cost, all busy.
    fn cpu_bound(&self) -> f64 {
        self.cores as f64 * 1000.0 / self.cpu_ms.max(f64::MIN_POSITIVE)
    }
}

async fn measure(stack: &stack::Stack, args: &Args) -> anyhow::Result<Figures> {
    anyhow::ensure!(args.creates > 0, "--creates must be at least 1");
    let gateway = stack.gateway.as_ref().context("the stack has a gateway")?;
    let url = gateway.url();
    let http = reqwest::Client::new();
    first_create(&http, &url).await?;

    let mut latencies = Vec::with_capacity(args.creates);
    for _ in 0..args.creates {
        latencies.push(create_and_kill(&http, &url, LINKED).await?);
    }
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1000.0;
    let (p50_ms, p99_ms) = (pct(0.5), pct(0.99));

    let linked = throughput(&http, &url, args, LINKED).await?;
    // The same load without the link out, in the same run: what the veth pair, its addresses
    // and routes (and their removal) cost, as a ratio this machine's noise does not swamp.
    let unlinked = throughput(&http, &url, args, UNLINKED).await?;
    let warm = warm(stack, &http, &url, args.warm_creates).await?;
    Ok(Figures {
        p50_ms,
        p99_ms,
        linked,
        unlinked,
        warm,
    })
}

/// Creates claimed from a warm pool of `base` (size 1: each create waits for the refill
/// before it starts, so each finds one ready): their latencies, and how many were claims.
async fn warm(stack: &stack::Stack, http: &reqwest::Client, url: &str, creates: usize) -> anyhow::Result<Warm> {
    anyhow::ensure!(creates > 0, "--warm-creates must be at least 1");
    let ledger = &stack.ledger_client;
    crate::warm_pool::size(ledger, "base", 1).await?;
    let mut latencies = Vec::with_capacity(creates);
    let mut hits = 0;
    for _ in 0..creates {
        let pooled = crate::warm_pool::ready(http, url, "bench", ledger, "base", 1).await?;
        let (took, id) = create(http, url, LINKED).await?;
        latencies.push(took);
        hits += usize::from(pooled.contains(&id));
        kill(http, url, &id).await?;
    }
    crate::warm_pool::empty(ledger, "base").await?;
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1000.0;
    Ok(Warm {
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        hits,
        creates,
    })
}

/// What the warm phase measures.
struct Warm {
    p50_ms: f64,
    p99_ms: f64,
    /// Creates that were claims (the sandbox was the pool's).
    hits: usize,
    creates: usize,
}

fn report(args: &Args, figures: Figures, floor: &crate::kernel_floor::Floor, runc: Option<&Throughput>) -> Report {
    let round = |x: f64| (x * 100.0).round() / 100.0;
    let mut report = Report::new(format!(
        "gateway-create: REST create until running, then kill; embedded default, containers ({} sequential, {} concurrent clients, {})",
        args.creates,
        args.clients,
        if args.plaintext { "plaintext gRPC" } else { "mutual TLS" }
    ));
    report
        .figure("create_p50_ms", round(figures.p50_ms), "ms")
        .figure("create_p99_ms", round(figures.p99_ms), "ms")
        .figure(
            "creates_per_sec",
            figures.linked.per_sec.round() as u64,
            "creates/s (each followed by its kill)",
        )
        .figure(
            "cpu_ms_per_create",
            round(figures.linked.cpu_ms),
            "ms of host CPU per create and kill (all processes and kernel threads)",
        )
        .figure(
            "cpu_bound_creates_per_sec",
            figures.linked.cpu_bound().round() as u64,
            &format!("creates/s at that cost with all {} cores busy", figures.linked.cores),
        )
        .figure(
            "unlinked_creates_per_sec",
            figures.unlinked.per_sec.round() as u64,
            "creates/s of sandboxes without internet access (no link out)",
        )
        .figure(
            "unlinked_cpu_ms_per_create",
            round(figures.unlinked.cpu_ms),
            "ms of host CPU per create and kill without the link out",
        )
        .figure(
            "warm_create_p50_ms",
            round(figures.warm.p50_ms),
            "ms (claimed from a warm pool)",
        )
        .figure(
            "warm_create_p99_ms",
            round(figures.warm.p99_ms),
            "ms (claimed from a warm pool)",
        )
        .figure(
            "warm_hits",
            format!("{}/{}", figures.warm.hits, figures.warm.creates),
            "warm creates that were claims",
        )
        .figure(
            "kernel_floor_cpu_ms",
            round(floor.cpu_ms),
            "ms of host CPU per cycle of the same isolation with nothing of ours (cgroups, overlay, unshare --fork true)",
        )
        .figure(
            "kernel_floor_wall_ms",
            round(floor.wall_ms),
            "ms per floor cycle, one at a time",
        )
        .figure(
            "cpu_vs_kernel_floor",
            round(figures.linked.cpu_ms / floor.cpu_ms.max(f64::MIN_POSITIVE)),
            "cpu_ms_per_create / kernel_floor_cpu_ms",
        );
    if let Some(runc) = runc {
        report
            .figure(
                "runc_creates_per_sec",
                runc.per_sec.round() as u64,
                "creates/s (each followed by its kill), the node running Debian's runc",
            )
            .figure(
                "runc_cpu_ms_per_create",
                round(runc.cpu_ms),
                "ms of host CPU per create and kill with runc",
            )
            .figure(
                "creates_vs_runc",
                round(figures.linked.per_sec / runc.per_sec.max(f64::MIN_POSITIVE)),
                "creates_per_sec / runc_creates_per_sec",
            );
    }
    report
}

/// Create-and-kill cycles per second with `args.clients` clients for `args.seconds`, and the
/// host CPU each cost.
async fn throughput(http: &reqwest::Client, url: &str, args: &Args, body: &'static str) -> anyhow::Result<Throughput> {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // Read before any client starts: an error here must not leave clients running.
    let cpu_before = HostCpu::read().context("reading /proc/stat")?;
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
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_after = HostCpu::read().context("reading /proc/stat")?;
    let cycles = done.load(Ordering::Relaxed);
    anyhow::ensure!(cycles > 0, "no create-and-kill cycle completed in {elapsed:.1} s");
    Ok(Throughput {
        per_sec: cycles as f64 / elapsed,
        cpu_ms: cpu_after.since(&cpu_before) / cycles as f64,
        cores: cpu_after.cores,
    })
}
