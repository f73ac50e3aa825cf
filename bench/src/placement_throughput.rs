//! `bench placement-throughput`: placement-svc on Redis with 1,000 nodes, through gRPC.
//!
//! - `placements_per_sec`: 64 clients in a closed loop, each Place followed by Created, over
//!   two HTTP/2 connections (one a core: more only adds system calls on this machine);
//! - `redis_cpu_us_per_placement`, `process_cpu_us_per_placement`: CPU each placement cost
//!   Redis and this process (placer and clients) in that loop; steadier than the rate on a
//!   shared machine, and the figures to compare when changing a script or the service;
//! - `p50_us`, `p99_us`, `p999_us`: Place+Created latency at an offered 2,000 placements a
//!   second, open loop (each request is sent on its schedule, and its latency counts from that
//!   moment, so queueing in the client cannot hide); `pacer_late_p99_us` is how late the
//!   sending thread itself woke, the host's share of those figures;
//! - `nodes_ms`: one `Nodes` call (every node's whole view, what `sandboxsched-ctl nodes`
//!   shows) once the loops have left reservations on every node;
//! - `decisions_per_sec`: the pure Best-of-K decision in-process, no I/O.
//!
//! The placer runs as it ships: mutual TLS with a cluster's certificates (the clients are the
//! gateway, the heartbeats a node), the same allocator, its log subscriber recording the
//! per-call spans, and the Prometheus recorder (`--bare` leaves the last two out, and
//! `--plaintext` the first, to see their cost).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use placement_svc::core::{Accounting, Expiry, Heartbeat, NodeView, RankConfig, Ranker, Request, Resources};
use placement_svc::server::{PlacementConfig, StoreConfig};
use proto::placement::v1 as pb;
use proto::placement::v1::placement_client::PlacementClient;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use tonic::transport::Channel;

use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, env = "SANDBOXSCHED_TEST_REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Closed-loop clients.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// HTTP/2 connections the clients share.
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// Offered load of the open-loop phase, placements a second.
    #[arg(long, default_value_t = 2000)]
    rate: u64,
    /// Run without the shipped telemetry (log subscriber at `RUST_LOG`, Prometheus recorder),
    /// to see what it costs.
    #[arg(long)]
    bare: bool,
    /// Serve and call without TLS, to see what mutual TLS costs.
    #[arg(long)]
    plaintext: bool,
    /// Seconds each phase runs.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
}

const GIB: u64 = 1 << 30;

fn place_request(id: String) -> pb::PlaceRequest {
    pb::PlaceRequest {
        sandbox_id: id,
        resources: Some(pb::Resources {
            vcpus: 1,
            memory_bytes: GIB / 2,
        }),
        ..Default::default()
    }
}

async fn place_and_confirm(c: &mut PlacementClient<Channel>, id: String) -> anyhow::Result<()> {
    let placed = c.place(place_request(id.clone())).await?.into_inner();
    c.created(pb::SandboxRef {
        sandbox_id: id,
        node_id: placed.node_id,
        resources: None,
    })
    .await?;
    Ok(())
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    // The service as it ships: spans are recorded for its log subscriber and every metric
    // lands in the recorder.
    let _telemetry = (!args.bare).then(|| {
        common::metrics::recorder();
        common::telemetry::init("bench")
    });
    let prefix = format!("bench-{}", uuid::Uuid::new_v4().simple());
    let mut config = PlacementConfig::new("127.0.0.1:0".parse()?);
    config.store = StoreConfig::Redis {
        url: args.redis_url.clone(),
        prefix: prefix.clone(),
    };
    config.rank.unhealthy_after_ms = 3_600_000;
    let certs_dir = tempfile::tempdir()?;
    let certs = if args.plaintext {
        stack::Certs::plaintext()
    } else {
        stack::Certs::issue(certs_dir.path())?
    };
    config.security = certs.security(mtls::Role::Placement);
    let placement = placement_svc::server::start(config)
        .await
        .with_context(|| format!("placement-svc on Redis at {}", args.redis_url))?;
    let mut channels = Vec::new();
    for _ in 0..args.connections.max(1) {
        channels.push(PlacementClient::new(
            certs
                .security(mtls::Role::Gateway)
                .endpoint(&placement.endpoint(), mtls::Role::Placement)?
                .connect()
                .await?,
        ));
    }
    // The simulated nodes report through one connection, as one certificate that speaks for
    // every one of them (placement takes a heartbeat only in a name its sender holds).
    let node_ids: Vec<String> = (0..args.nodes).map(node_id).collect();
    let fleet = match certs.dir() {
        Some(dir) => {
            let ids: Vec<&str> = node_ids.iter().map(String::as_str).collect();
            mtls::issue_node(dir, "fleet", &ids, false)?;
            mtls::Security::load_node(dir, "fleet")?
        }
        None => mtls::Security::Plaintext,
    };
    let mut nodes = PlacementClient::new(
        fleet
            .endpoint(&placement.endpoint(), mtls::Role::Placement)?
            .connect()
            .await?,
    );
    for (n, id) in node_ids.into_iter().enumerate() {
        nodes
            .heartbeat(pb::HeartbeatRequest {
                node_id: id,
                boot_id: "bench".into(),
                seq: 1,
                address: format!("http://10.0.{}.{}:7003", n / 250, n % 250),
                capacity: Some(pb::Resources {
                    vcpus: 10_000,
                    memory_bytes: 100_000 * GIB,
                }),
                allocated: Some(pb::Resources::default()),
                ..Default::default()
            })
            .await?;
    }

    // Closed loop.
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..args.clients {
        let mut c = channels[w % channels.len()].clone();
        let (done, stop) = (done.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                place_and_confirm(&mut c, format!("c{w}-{i}")).await?;
                i += 1;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    let mut info = redis::Client::open(args.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let (redis_before, own_before) = (redis_cpu_seconds(&mut info).await?, own_cpu_seconds()?);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    let placed = done.load(Ordering::Relaxed);
    let placements_per_sec = placed as f64 / started.elapsed().as_secs_f64();
    // CPU per placement is steadier than the rate on a shared machine: it does not move when
    // another tenant takes a core for a while.
    let per_placement_us = |seconds: f64| (seconds * 1e6 / placed.max(1) as f64).round() as u64;
    let redis_us = per_placement_us(redis_cpu_seconds(&mut info).await? - redis_before);
    let own_us = per_placement_us(own_cpu_seconds()? - own_before);

    // Open loop at a fixed offered rate. A thread paces the sends (tokio's timer ticks in
    // whole milliseconds, too coarse for a send every 500 µs): it sleeps until the next
    // request is due and sends every request due by then. It never spins: on two cores a
    // spinning pacer takes the CPU the placer needs. Latency counts from each request's due
    // time, so a late wake-up and any queueing show in the figure.
    let total = (args.rate as f64 * args.seconds) as u64;
    let interval = Duration::from_secs_f64(1.0 / args.rate as f64);
    let (due_tx, mut due_rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Instant)>();
    let pacer = std::thread::spawn(move || {
        // How late the pacer itself woke: the host's scheduling jitter, which every request's
        // latency includes too. Printed beside the percentiles so a reader can tell the two
        // apart on a shared machine.
        let mut late = Vec::with_capacity(total as usize);
        let origin = Instant::now();
        for i in 0..total {
            let due = origin + interval * i as u32;
            if let Some(left) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(left);
            }
            late.push(due.elapsed());
            if due_tx.send((i, due)).is_err() {
                break;
            }
        }
        late
    });
    let mut tasks = Vec::with_capacity(total as usize);
    while let Some((i, due)) = due_rx.recv().await {
        let mut c = channels[i as usize % channels.len()].clone();
        tasks.push(tokio::spawn(async move {
            place_and_confirm(&mut c, format!("o{i}")).await?;
            Ok::<_, anyhow::Error>(due.elapsed())
        }));
    }
    let mut latencies = Vec::with_capacity(tasks.len());
    for t in tasks {
        latencies.push(t.await??);
    }
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p) as usize].as_micros() as u64;
    let (p50, p99, p999) = (pct(0.50), pct(0.99), pct(0.999));
    let mut late = pacer.join().map_err(|_| anyhow::anyhow!("the pacer thread panicked"))?;
    late.sort();
    let pacer_late_p99 = late
        .get(((late.len() as f64 - 1.0) * 0.99) as usize)
        .map_or(0, |d| d.as_micros() as u64);
    // What an operator's `sandboxsched-ctl nodes` costs: every node's whole view.
    let listed = Instant::now();
    let nodes = channels[0].nodes(pb::NodesRequest {}).await?.into_inner().nodes.len();
    let nodes_ms = listed.elapsed().as_secs_f64() * 1e3;
    anyhow::ensure!(nodes == args.nodes, "Nodes listed {nodes} of {} nodes", args.nodes);
    placement.stop().await;
    cleanup(&args.redis_url, &prefix).await;

    let decisions_per_sec = pure_decisions(args.nodes);

    let mut report = Report::new(format!(
        "placement-throughput: {} nodes on Redis, Place+Created over gRPC ({})",
        args.nodes,
        if args.plaintext { "plaintext" } else { "mutual TLS" }
    ));
    report
        .figure(
            "placements_per_sec",
            placements_per_sec.round() as u64,
            "placements/s (closed loop)",
        )
        .figure("clients", args.clients as u64, "")
        .figure(
            "mutual_tls",
            u64::from(!args.plaintext),
            "1: mutual TLS, 0: --plaintext",
        )
        .figure("redis_cpu_us_per_placement", redis_us, "µs of Redis CPU (INFO cpu)")
        .figure(
            "process_cpu_us_per_placement",
            own_us,
            "µs of this process's CPU (placer and clients)",
        )
        .figure("offered_per_sec", args.rate, "placements/s (open loop)")
        .figure("p50_us", p50, "µs")
        .figure("p99_us", p99, "µs")
        .figure("p999_us", p999, "µs")
        .figure(
            "pacer_late_p99_us",
            pacer_late_p99,
            "µs (host jitter: how late the sender woke)",
        )
        .figure(
            "nodes_ms",
            (nodes_ms * 10.0).round() / 10.0,
            "ms for Nodes (every node's view)",
        )
        .figure(
            "decisions_per_sec",
            decisions_per_sec.round() as u64,
            "decisions/s (pure, one core)",
        );
    Ok(report)
}

/// CPU time Redis has used, user and system, as its `INFO cpu` reports it.
async fn redis_cpu_seconds(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    Ok(info
        .lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| *k == "used_cpu_sys" || *k == "used_cpu_user")
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .sum())
}

/// CPU time this process has used, user and system (`/proc/self/stat`, in clock ticks of
/// 10 ms: fine over a phase of seconds).
fn own_cpu_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the command name (which may hold spaces) start at the state, field 3.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    Ok((ticks(14) + ticks(15)) / 100.0)
}

/// Best-of-3 over `nodes` views, in-process.
fn pure_decisions(nodes: usize) -> f64 {
    let views: Vec<NodeView> = (0..nodes)
        .map(|n| {
            let mut v = NodeView::new(format!("node-{n:04}"));
            let hb = Heartbeat {
                node_id: v.node_id.clone(),
                boot_id: "b".into(),
                seq: 1,
                capacity: Resources {
                    vcpus: 192,
                    memory_bytes: 512 * GIB,
                },
                allocated: Resources {
                    vcpus: (n % 50) as u32,
                    memory_bytes: (n % 50) as u64 * GIB,
                },
                ..Heartbeat::default()
            };
            v.apply_heartbeat(Accounting::Reconciled, &hb, 1_000, Expiry::DEFAULT);
            v
        })
        .collect();
    let ranker = Ranker::new(&RankConfig::default());
    let req = Request {
        sandbox_id: "s".into(),
        resources: Resources {
            vcpus: 1,
            memory_bytes: GIB,
        },
        ..Request::default()
    };
    let mut rng = SmallRng::seed_from_u64(1);
    let n = 1_000_000;
    let started = Instant::now();
    let mut chosen = 0usize;
    for _ in 0..n {
        if let Some((i, _)) = ranker.decide(&views, &req, 1_000, &mut rng).chosen {
            chosen = chosen.wrapping_add(i);
        }
    }
    std::hint::black_box(chosen);
    n as f64 / started.elapsed().as_secs_f64()
}

async fn cleanup(url: &str, prefix: &str) {
    let Ok(client) = redis::Client::open(url) else { return };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return;
    };
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .unwrap_or_default();
    for chunk in keys.chunks(1000) {
        let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query_async(&mut conn).await;
    }
}

/// The ID of simulated node `n`.
fn node_id(n: usize) -> String {
    format!("node-{n:04}")
}
