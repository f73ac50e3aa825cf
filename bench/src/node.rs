//! `bench node`: sandboxes as containers (the default runtime, the node's own `jail`) through
//! gRPC: create, pause, resume and kill latency; what an idle sandbox costs the host; a command
//! (`true`) through envd from the node's endpoint; every sandbox answering at once (density);
//! Debian's runc creating the same sandboxes in the same run, for comparison; and moving a
//! sandbox holding 100 MB of files from one node-svc to another (snapshot streamed into
//! restore); and a burst of linked sandboxes killed at once, beside the rate at which this
//! host deletes veth pairs one by one (the kernel serialises both on one lock, RTNL), with
//! the creates made during the burst and, during a burst of its own, the kernel's floor cycle
//! (the isolation's system calls with nothing of ours between): whether a create keeps its
//! tail through a burst reads against whether the kernel's own work does.

use std::time::{Duration, Instant};

use anyhow::Context;
use node_svc::server::{NodeConfig, RunningNode, RuntimeKind};
use proto::node::v1 as pb;
use proto::node::v1::node_client::NodeClient;
use tokio_stream::StreamExt;

use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Sandboxes created (and paused, resumed, killed) for the latency figures.
    #[arg(long, default_value_t = 100)]
    sandboxes: usize,
    /// Megabytes of files in the sandbox that is moved.
    #[arg(long, default_value_t = 100)]
    snapshot_mb: usize,
    /// Sandboxes created with runc (`--runc`) for comparison.
    #[arg(long, default_value_t = 50)]
    runc_sandboxes: usize,
    /// The runc binary compared against.
    #[arg(long, default_value = "/usr/sbin/runc")]
    runc: std::path::PathBuf,
    /// Sandboxes with a link out killed at once (0: no burst).
    #[arg(long, default_value_t = 500)]
    kill_burst: usize,
    /// Bursts of each kind: one timing creates, one timing the kernel's floor cycle.
    #[arg(long, default_value_t = 1)]
    kill_burst_rounds: usize,
    /// veth pairs made, then deleted one by one, for the host's own deletion rate.
    #[arg(long, default_value_t = 200)]
    veth_pairs: usize,
    /// The sandboxes kept alive (those of the latency and density figures) each with E2B's
    /// default network, a link out, rather than loopback only.
    #[arg(long)]
    linked: bool,
}

/// Floor cycles timed on the quiet host, for the floor's own tail outside a burst.
const QUIET_FLOOR_CYCLES: usize = 50;

/// What is timed, one after another, while a burst's kills run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum During {
    /// Loopback-only creates through the node.
    Creates,
    /// The kernel's floor cycle ([`crate::kernel_floor`]): the same isolation made and undone
    /// with nothing of ours in between, so a create's slowdown can be told from the kernel's.
    KernelFloor,
}

/// What one kill burst measured.
struct Burst {
    kills_per_sec: f64,
    /// What ran one after another while the burst's kills did, each one's wall time.
    during: Vec<Duration>,
}

/// Creates `count` sandboxes with a link out on the node behind `client`, then kills them
/// all at once while `during` is timed one after another (creates are killed after it).
/// `round` keeps each burst's sandbox IDs apart.
async fn kill_burst(
    client: &NodeClient<tonic::transport::Channel>,
    count: usize,
    round: usize,
    during: During,
) -> anyhow::Result<Burst> {
    let mut c = client.clone();
    let burst_id = |i: usize| format!("kb{round}-{i}");
    for i in 0..count {
        let mut request = create_request(i, &burst_id(i));
        request.operation_id = burst_id(i);
        request.network = Some(pb::NetworkPolicy {
            internet: true,
            ..Default::default()
        });
        c.create(request).await.context("a linked sandbox for the burst")?;
    }
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let made = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let create_id = move |i: usize| format!("kbc{round}-{i}");
    let timing = match during {
        // Killed only after the burst: a kill of its own would queue behind the burst's and
        // leave one create to measure.
        During::Creates => {
            let (mut c, done, made) = (client.clone(), done.clone(), made.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let i = made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let mut request = create_request(i, &create_id(i));
                    request.operation_id = create_id(i);
                    let started = Instant::now();
                    c.create(request).await?;
                    samples.push(started.elapsed());
                }
                anyhow::Ok(samples)
            })
        }
        During::KernelFloor => {
            let done = done.clone();
            // The rig is made (and its first cycle run) before the kills start.
            let mut rig = tokio::task::spawn_blocking(|| crate::kernel_floor::Rig::new("burst")).await??;
            tokio::task::spawn_blocking(move || rig.timed_until(&done))
        }
    };
    let started = Instant::now();
    let kills: Vec<_> = (0..count)
        .map(|i| {
            let mut c = client.clone();
            let request = lifecycle(&burst_id(i), format!("kbk{round}-{i}"));
            tokio::spawn(async move { c.kill(request).await })
        })
        .collect();
    let mut burst = Ok(());
    for kill in kills {
        if let Err(err) = kill
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r.map_err(Into::into))
        {
            burst = burst.and(Err(err));
        }
    }
    let elapsed = started.elapsed();
    // Whatever the burst's outcome, the timing stops and every sandbox it made (or may have
    // made) goes, so nothing of this phase weighs on the figures after it.
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let timed = timing.await;
    let mut c = client.clone();
    for i in 0..made.load(std::sync::atomic::Ordering::Relaxed) {
        let _ = c.kill(lifecycle(&create_id(i), format!("kbck{round}-{i}"))).await;
    }
    burst.context("a kill of the burst")?;
    Ok(Burst {
        kills_per_sec: count as f64 / elapsed.as_secs_f64(),
        during: timed??,
    })
}

/// `rounds` bursts of each kind, alternated (creates first), so both meet the same host:
/// every burst's kill rate, the creates timed during them, and the floor's cycles.
async fn kill_bursts(
    client: &NodeClient<tonic::transport::Channel>,
    count: usize,
    rounds: usize,
) -> anyhow::Result<(Vec<f64>, Vec<Duration>, Vec<Duration>)> {
    let (mut rates, mut creates, mut floor) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        for (k, during) in [During::Creates, During::KernelFloor].into_iter().enumerate() {
            let burst = kill_burst(client, count, 2 * round + k, during).await?;
            rates.push(burst.kills_per_sec);
            match during {
                During::Creates => creates.extend(burst.during),
                During::KernelFloor => floor.extend(burst.during),
            }
        }
    }
    Ok((rates, creates, floor))
}

/// Deletions per second of `pairs` veth pairs made on the host and then deleted one by one,
/// each its own netlink request (one `ip -batch` process, so no process start is counted):
/// the rate a kill path that deletes each sandbox's link is held to.
fn veth_delete_rate(pairs: usize) -> anyhow::Result<f64> {
    use std::io::Write as _;
    let batch = |lines: String| -> anyhow::Result<Duration> {
        let mut ip = std::process::Command::new("ip")
            .args(["-batch", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .context("running ip (iproute2)")?;
        let started = Instant::now();
        ip.stdin.take().context("ip's stdin")?.write_all(lines.as_bytes())?;
        let status = ip.wait()?;
        anyhow::ensure!(status.success(), "ip -batch failed: {status}");
        Ok(started.elapsed())
    };
    let name = |i: usize| format!("vbench{}-{i}", std::process::id() % 10_000);
    batch(
        (0..pairs)
            .map(|i| {
                format!(
                    "link add {} numtxqueues 1 numrxqueues 1 type veth peer name {}p\n",
                    name(i),
                    name(i)
                )
            })
            .collect(),
    )?;
    let took = batch((0..pairs).map(|i| format!("link del {}\n", name(i))).collect())?;
    Ok(pairs as f64 / took.as_secs_f64())
}

/// A node of the benchmark's own and its state directory. Dropped, it leaves nothing behind:
/// a run that fails half-way (a create refused) would otherwise leave every container it
/// made, with its root and its disk mounted, and the next run would find the host's disk
/// promised to them.
struct Scratch {
    running: Option<RunningNode>,
    dir: std::path::PathBuf,
    id: String,
    oci_runtime: Option<std::path::PathBuf>,
}

async fn node(tag: &str, oci_runtime: Option<std::path::PathBuf>) -> anyhow::Result<Scratch> {
    let id = format!("bench-{tag}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let dir = std::env::temp_dir().join(&id);
    let mut config = NodeConfig::new("127.0.0.1:0".parse()?, &id, &dir);
    config.runtime = RuntimeKind::Container {
        oci_runtime: oci_runtime.clone(),
    };
    // 100 sandboxes hold 100 disks of 2 GiB at once, sparse and all but empty: more than a
    // small free disk may promise (every create past free / 2 GiB was refused for room). The
    // benchmark promises knowingly, as `up --disk-overcommit` lets an operator.
    config.host.disk_overcommit = 1_000.0;
    let node = node_svc::server::start(config).await?;
    let features = node.host().features();
    anyhow::ensure!(
        features.namespaces,
        "this host cannot isolate sandboxes: {:?}",
        features.degraded
    );
    Ok(Scratch {
        running: Some(node),
        dir,
        id,
        oci_runtime,
    })
}

fn create_request(i: usize, id: &str) -> pb::CreateRequest {
    pb::CreateRequest {
        operation_id: format!("c{i}"),
        epoch: 1,
        sandbox_id: id.to_string(),
        template: "base".into(),
        resources: Some(pb::Resources {
            vcpus: 1,
            memory_bytes: 128 << 20,
            disk_bytes: 0,
        }),
        access_token: format!("token-{id}"),
        ..Default::default()
    }
}

/// Runs `true` in `sandbox` through the node's envd endpoint, as the gateway forwards an SDK's
/// `commands.run`; `Ok` once the command ended with exit code 0.
async fn exec_true(http: &reqwest::Client, envd: &str, sandbox: &str) -> anyhow::Result<()> {
    let token = format!("token-{sandbox}");
    crate::fixture::run_in(http, envd, (sandbox, &token), serde_json::json!({"cmd": "true"})).await
}

/// Resident memory of this process, in bytes.
fn own_rss() -> u64 {
    crate::fixture::rss_kib("self").map_or(0, |kib| kib * 1024)
}

impl Scratch {
    fn node(&self) -> &RunningNode {
        self.running.as_ref().expect("a node until removed")
    }

    /// Stops the node; its containers and folder go when `self` is dropped, here.
    async fn remove(mut self) {
        if let Some(node) = self.running.take() {
            node.stop().await;
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        node_svc::runtime::container::destroy_all(&self.dir, self.oci_runtime.as_deref());
        let _ = std::fs::remove_dir_all(&self.dir);
        node_svc::runtime::cgroup::remove_parents(&self.id);
    }
}

fn lifecycle(id: &str, op: String) -> pb::LifecycleRequest {
    pb::LifecycleRequest {
        operation_id: op,
        epoch: 1,
        sandbox_id: id.to_string(),
    }
}

fn percentile(samples: &mut [Duration], p: f64) -> f64 {
    samples.sort();
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples.get(i).map_or(0.0, |d| d.as_secs_f64() * 1_000.0)
}

/// What idmapping a sandbox's layers (each sandbox's own host ids) adds to mounting its root:
/// the base layer under an empty writable layer, mounted `rounds` times each way, interleaved,
/// in the node's state directory; the p50s in microseconds, plain then idmapped.
fn overlay_mounts(state_dir: &std::path::Path, rounds: usize) -> anyhow::Result<(f64, f64)> {
    use node_svc::runtime::container::{base_dir, ids::IdRanges, rootfs};
    let scratch = state_dir.join("overlay-bench");
    std::fs::create_dir_all(&scratch)?;
    let ranges = IdRanges::new(rootfs::probe_idmapped_overlay(&scratch));
    if let Some(why) = ranges.shared() {
        anyhow::bail!("{why}");
    }
    let ids = ranges.claim("overlay-bench", &[], false)?;
    let lower = [base_dir(state_dir)];
    let (mut plain, mut idmapped) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        for (way, samples, userns) in [
            ("plain", &mut plain, None),
            ("idmapped", &mut idmapped, ids.userns.as_ref()),
        ] {
            let dir = scratch.join(format!("{i}-{way}"));
            let (home, work, root) = (dir.join("home"), dir.join("work"), dir.join("root"));
            rootfs::prepare_upper(&home, &work)?;
            let started = Instant::now();
            rootfs::mount_overlay(&lower, &home, &work, &root, userns.map(std::os::fd::AsFd::as_fd))?;
            samples.push(started.elapsed());
            rootfs::unmount(&root)?;
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok((
        percentile(&mut plain, 0.5) * 1_000.0,
        percentile(&mut idmapped, 0.5) * 1_000.0,
    ))
}

/// `a / b`, or 0 where there is no `b` to compare with.
fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    let a = node("a", None).await?;
    let b = node("b", None).await?;
    // The same HTTP/2 windows as the balance executor's clients: a snapshot is one long stream.
    let client = |endpoint: String| async move {
        let channel = tonic::transport::Endpoint::from_shared(endpoint)?
            .initial_stream_window_size(Some(node_svc::server::STREAM_WINDOW))
            .initial_connection_window_size(Some(node_svc::server::STREAM_WINDOW * 2))
            .connect()
            .await?;
        anyhow::Ok(NodeClient::new(channel))
    };
    let mut ca = client(a.node().endpoint()).await?;
    let mut cb = client(b.node().endpoint()).await?;

    let (mut create, mut pause, mut resume, mut kill) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let rss_before = own_rss();
    // Loopback-only sandboxes, and every other one a second with E2B's default network (a
    // link out, NAT, the floor), interleaved so both meet the same conditions.
    let mut linked = Vec::new();
    for i in 0..args.sandboxes {
        let id = format!("s{i}");
        let mut request = create_request(i, &id);
        if args.linked {
            request.network = Some(pb::NetworkPolicy {
                internet: true,
                ..Default::default()
            });
        }
        let started = Instant::now();
        ca.create(request).await?;
        create.push(started.elapsed());
        if i % 2 == 0 {
            let mut request = create_request(i, &format!("n{i}"));
            request.operation_id = format!("n{i}");
            request.network = Some(pb::NetworkPolicy {
                internet: true,
                ..Default::default()
            });
            let started = Instant::now();
            ca.create(request).await?;
            linked.push(started.elapsed());
        }
    }
    for i in (0..args.sandboxes).step_by(2) {
        ca.kill(lifecycle(&format!("n{i}"), format!("nk{i}"))).await?;
    }
    // Every sandbox idle at once: each answers a command, and costs what its memory cgroup
    // (envd and the kernel objects charged to it) and the node's own growth say.
    let http = reqwest::Client::new();
    let envd = a.node().envd_endpoint();
    let (mut exec, mut answering) = (Vec::new(), 0usize);
    for i in 0..args.sandboxes {
        let started = Instant::now();
        if exec_true(&http, &envd, &format!("s{i}")).await.is_ok() {
            answering += 1;
            exec.push(started.elapsed());
        }
    }
    // Each sandbox's second command: what the first one paid once (envd's first connection,
    // its first spawn, faults of a process that was idle) set apart from the steady path.
    let mut exec_warm = Vec::new();
    for i in 0..args.sandboxes {
        let started = Instant::now();
        if exec_true(&http, &envd, &format!("s{i}")).await.is_ok() {
            exec_warm.push(started.elapsed());
        }
    }
    // The floor under both: starting `true` from this process, with nothing between.
    let mut spawn_true = Vec::new();
    for _ in 0..args.sandboxes {
        let started = Instant::now();
        let status = std::process::Command::new("true").status().context("running true")?;
        anyhow::ensure!(status.success(), "true failed: {status}");
        spawn_true.push(started.elapsed());
    }
    let listed = a.node().host().list().await;
    let charged: u64 = listed.iter().map(|(_, used)| *used).sum();
    let node_growth = own_rss().saturating_sub(rss_before);
    let idle_mib = (charged + node_growth) as f64 / listed.len().max(1) as f64 / f64::from(1 << 20);

    // The same sandboxes with runc, in the same run.
    let runc_node = node("runc", Some(args.runc.clone())).await?;
    let mut cr = client(runc_node.node().endpoint()).await?;
    let mut runc_create = Vec::new();
    for i in 0..args.runc_sandboxes {
        let started = Instant::now();
        cr.create(create_request(i, &format!("r{i}"))).await?;
        runc_create.push(started.elapsed());
    }
    for i in 0..args.runc_sandboxes {
        cr.kill(lifecycle(&format!("r{i}"), format!("rk{i}"))).await?;
    }
    runc_node.remove().await;
    // The kernel's floor cycle on this quiet host (the idle sandboxes alive, as during the
    // creates), apart from the creates so that neither's teardown falls in the other's time.
    let mut floor_quiet = match args.kill_burst {
        0 => Vec::new(),
        _ => crate::kernel_floor::Rig::new("quiet")?.timed(QUIET_FLOOR_CYCLES)?,
    };
    let burst = if args.kill_burst > 0 {
        Some(kill_bursts(&ca, args.kill_burst, args.kill_burst_rounds.max(1)).await?)
    } else {
        None
    };
    let veth_delete_per_sec = if args.veth_pairs > 0 {
        veth_delete_rate(args.veth_pairs)?
    } else {
        0.0
    };
    for (label, samples, method) in [("p", &mut pause, 0), ("r", &mut resume, 1), ("k", &mut kill, 2)] {
        for i in 0..args.sandboxes {
            let req = lifecycle(&format!("s{i}"), format!("{label}{i}"));
            let started = Instant::now();
            match method {
                0 => ca.pause(req).await?,
                1 => ca.resume(req).await?,
                _ => ca.kill(req).await?,
            };
            samples.push(started.elapsed());
        }
    }

    // A sandbox with `snapshot_mb` MB of files, moved from node a to node b.
    ca.create(pb::CreateRequest {
        operation_id: "big".into(),
        epoch: 1,
        sandbox_id: "big".into(),
        template: "base".into(),
        resources: Some(pb::Resources {
            vcpus: 1,
            memory_bytes: 256 << 20,
            disk_bytes: 0,
        }),
        ..Default::default()
    })
    .await?;
    let home = a.node().host().home("big");
    let block: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for f in 0..args.snapshot_mb {
        std::fs::write(home.join(format!("data-{f:03}.bin")), &block).context("writing sandbox files")?;
    }
    ca.pause(lifecycle("big", "big-pause".into())).await?;
    let started = Instant::now();
    let source = ca.snapshot(lifecycle("big", String::new())).await?.into_inner();
    let restore = source.map(|chunk| {
        let chunk = chunk.expect("snapshot chunk");
        pb::RestoreChunk {
            part: match chunk.part {
                Some(pb::snapshot_chunk::Part::Header(h)) => Some(pb::restore_chunk::Part::Header(pb::RestoreHeader {
                    operation_id: "big-restore".into(),
                    epoch: 2,
                    snapshot: Some(h),
                })),
                Some(pb::snapshot_chunk::Part::Data(d)) => Some(pb::restore_chunk::Part::Data(d)),
                Some(pb::snapshot_chunk::Part::Trailer(t)) => Some(pb::restore_chunk::Part::Trailer(t)),
                None => None,
            },
        }
    });
    cb.restore(restore).await?;
    let moved = started.elapsed();
    let moved_home = b.node().host().home("big");
    anyhow::ensure!(
        std::fs::read(moved_home.join("data-000.bin"))? == block,
        "the restored files differ"
    );
    ca.kill(lifecycle("big", "big-kill".into())).await?;
    let (mount_plain_us, mount_idmapped_us) = overlay_mounts(&a.dir, 200)?;
    let mut kill_b = lifecycle("big", "big-kill-b".into());
    kill_b.epoch = 2;
    cb.kill(kill_b).await?;
    a.remove().await;
    b.remove().await;

    let mut report = Report::new(format!(
        "node: containers over gRPC (own runtime), {} sandboxes; runc for comparison; move of {} MB",
        args.sandboxes, args.snapshot_mb
    ));
    report
        .figure(
            "create_p50_ms",
            round2(percentile(&mut create, 0.5)),
            "ms, loopback only",
        )
        .figure("create_p99_ms", round2(percentile(&mut create, 0.99)), "ms")
        .figure(
            "overlay_mount_p50_us",
            mount_plain_us.round(),
            "µs, a sandbox's root (base layer, empty writable layer) mounted as is",
        )
        .figure(
            "overlay_mount_idmapped_p50_us",
            mount_idmapped_us.round(),
            "µs, the same root with its layers idmapped to the sandbox's own ids",
        )
        .figure(
            "create_linked_p50_ms",
            round2(percentile(&mut linked, 0.5)),
            "ms, with E2B's default network: a link out through the host's NAT",
        )
        .figure("create_linked_p99_ms", round2(percentile(&mut linked, 0.99)), "ms")
        .figure(
            "runc_run_p50_ms",
            round2(percentile(&mut runc_create, 0.5)),
            "ms, the same create with Debian's runc",
        )
        .figure(
            "exec_p50_ms",
            round2(percentile(&mut exec, 0.5)),
            "ms, `true` through envd, each sandbox's first command",
        )
        .figure("exec_p99_ms", round2(percentile(&mut exec, 0.99)), "ms")
        .figure(
            "exec_warm_p50_ms",
            round2(percentile(&mut exec_warm, 0.5)),
            "ms, each sandbox's second command",
        )
        .figure(
            "spawn_true_p50_ms",
            round2(percentile(&mut spawn_true, 0.5)),
            "ms, `true` started and awaited by the bench itself: the part of exec that is the host's",
        )
        .figure(
            "idle_overhead_mib",
            (idle_mib * 100.0).round() / 100.0,
            "MiB an idle sandbox costs",
        )
        .figure(
            "density",
            answering as u64,
            &format!(
                "of {} idle sandboxes answering{}",
                args.sandboxes,
                if args.linked { ", each with a link out" } else { "" }
            ),
        )
        .figure(
            "node_rss_per_sandbox_kib",
            (node_growth as f64 / listed.len().max(1) as f64 / 1024.0).round(),
            "KiB the node's own memory grew by per idle sandbox",
        )
        .figure("pause_p50_ms", round2(percentile(&mut pause, 0.5)), "ms")
        .figure("pause_p99_ms", round2(percentile(&mut pause, 0.99)), "ms")
        .figure("resume_p50_ms", round2(percentile(&mut resume, 0.5)), "ms")
        .figure("resume_p99_ms", round2(percentile(&mut resume, 0.99)), "ms")
        .figure("kill_p50_ms", round2(percentile(&mut kill, 0.5)), "ms")
        .figure("kill_p99_ms", round2(percentile(&mut kill, 0.99)), "ms")
        .figure(
            "snapshot_restore_100mb_ms",
            round2(moved.as_secs_f64() * 1_000.0),
            &format!("ms for {} MB", args.snapshot_mb),
        );
    if let Some((mut rates, mut creates_during, mut floor_during)) = burst {
        rates.sort_by(f64::total_cmp);
        let create_p99 = percentile(&mut create, 0.99);
        let (during_p99, floor_p99) = (
            percentile(&mut creates_during, 0.99),
            percentile(&mut floor_quiet, 0.99),
        );
        let floor_during_p99 = percentile(&mut floor_during, 0.99);
        report
            .figure(
                "kill_burst_per_sec",
                rates[rates.len() / 2].round(),
                &format!(
                    "kills/s, {} sandboxes with a link out killed at once (median of {} bursts, both kinds)",
                    args.kill_burst,
                    rates.len()
                ),
            )
            .figure(
                "create_during_kill_burst_p50_ms",
                round2(percentile(&mut creates_during, 0.5)),
                &format!(
                    "ms, {} loopback-only creates made during the bursts",
                    creates_during.len()
                ),
            )
            .figure("create_during_kill_burst_p99_ms", round2(during_p99), "ms")
            .figure(
                "kernel_floor_cycle_p50_ms",
                round2(percentile(&mut floor_quiet, 0.5)),
                &format!(
                    "ms, the kernel's floor cycle (cgroups, overlay, unshare into six namespaces and `true`), {} one after another on the quiet host",
                    floor_quiet.len()
                ),
            )
            .figure("kernel_floor_cycle_p99_ms", round2(floor_p99), "ms")
            .figure(
                "kernel_floor_during_kill_burst_p50_ms",
                round2(percentile(&mut floor_during, 0.5)),
                &format!(
                    "ms, {} floor cycles run one after another during bursts of their own",
                    floor_during.len()
                ),
            )
            .figure("kernel_floor_during_kill_burst_p99_ms", round2(floor_during_p99), "ms")
            .figure(
                "create_p99_burst_ratio",
                round2(ratio(during_p99, create_p99)),
                "create p99 during the burst / outside it (0: no create outside it)",
            )
            .figure(
                "kernel_floor_p99_burst_ratio",
                round2(ratio(floor_during_p99, floor_p99)),
                "the floor cycle's p99 during the burst / outside it",
            );
    }
    if args.veth_pairs > 0 {
        report.figure(
            "veth_delete_per_sec",
            veth_delete_per_sec.round(),
            &format!(
                "deletions/s, {} veth pairs deleted one by one on this host",
                args.veth_pairs
            ),
        );
    }
    Ok(report)
}
