//! `bench soak`: the fault suite's cluster under its client workload (creates, commands, file
//! writes, pauses, resumes, kills, drains) with no faults, for a long time, sampling every
//! service's resident memory and open file descriptors. What grows after warm-up is a leak.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::chaos::cluster::{Cluster, NODES};
use crate::chaos::{end_sandboxes, ready_nodes, workload};
use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Minutes the workload runs.
    #[arg(long, default_value_t = 20)]
    minutes: u64,
    /// Minutes not judged: caches, pools and allocators fill first (a node's operation
    /// answers are kept 5 minutes).
    #[arg(long, default_value_t = 6)]
    warmup_minutes: u64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 60)]
    sample_secs: u64,
    #[arg(long, default_value_t = 4)]
    clients: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Resident memory (KiB) and open descriptors of a process.
fn sample(pid: u32) -> Option<(u64, u64)> {
    let rss = crate::fixture::rss_kib(pid)?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss, fds))
}

fn median(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or_default()
}

/// Growth in percent from the first three judged samples to the last three (medians of each,
/// so one noisy minute does not decide).
fn growth(series: &[u64]) -> f64 {
    if series.len() < 2 {
        return 0.0;
    }
    let take = series.len().min(3);
    let first = median(series[..take].to_vec()).max(1) as f64;
    let last = median(series[series.len() - take..].to_vec()) as f64;
    (last - first) / first * 100.0
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    let postgres = stack::services::postgres_url();
    let mut cluster = Cluster::start(&postgres).await?;
    let outcome = soak(&args, &mut cluster).await;
    end_sandboxes(&cluster).await;
    cluster.stop(&postgres, outcome.is_err()).await;
    outcome
}

async fn soak(args: &Args, cluster: &mut Cluster) -> anyhow::Result<Report> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready_nodes(cluster).await < NODES {
        anyhow::ensure!(Instant::now() < deadline, "the nodes never became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let shared = workload::Shared::new(cluster.gateways.clone())?;
    let mut tasks = Vec::new();
    for n in 0..args.clients {
        tasks.push(tokio::spawn(workload::client(n, args.seed, shared.clone())));
    }
    let nodes = cluster.nodes.iter().map(|n| n.id.clone()).collect();
    tasks.push(tokio::spawn(workload::operator(
        args.seed,
        cluster.balance.clone(),
        nodes,
        cluster.certs.clone(),
        shared.clone(),
    )));

    let started = Instant::now();
    let total = Duration::from_secs(args.minutes * 60);
    let warmup = Duration::from_secs(args.warmup_minutes * 60);
    let mut series: BTreeMap<String, (Vec<u64>, Vec<u64>)> = BTreeMap::new();
    while started.elapsed() < total {
        tokio::time::sleep(Duration::from_secs(args.sample_secs).min(total.saturating_sub(started.elapsed()))).await;
        for (name, service) in cluster.services.iter_mut() {
            anyhow::ensure!(service.running(), "{name} exited during the soak");
        }
        if started.elapsed() < warmup {
            continue;
        }
        for (name, service) in &cluster.services {
            if let Some((rss, fds)) = service.pid().and_then(sample) {
                let entry = series.entry(name.clone()).or_default();
                entry.0.push(rss);
                entry.1.push(fds);
            }
        }
        eprintln!("[soak {:>5}s] sampled", started.elapsed().as_secs());
    }
    shared.stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await?;
    }

    let mut report = Report::new(format!(
        "soak: {} min of mixed workload ({} clients and drains), samples every {} s after {} min of warm-up",
        args.minutes, args.clients, args.sample_secs, args.warmup_minutes
    ));
    let (mut rss_max, mut fd_max) = (f64::MIN, f64::MIN);
    let mut per_service = serde_json::Map::new();
    for (name, (rss, fds)) in &series {
        let (r, f) = (growth(rss), growth(fds));
        rss_max = rss_max.max(r);
        fd_max = fd_max.max(f);
        report.line(format!(
            "  {name:<12} rss {:>7} -> {:>7} KiB ({r:+.1} %), fds {:>4} -> {:>4} ({f:+.1} %)",
            rss.first().copied().unwrap_or_default(),
            rss.last().copied().unwrap_or_default(),
            fds.first().copied().unwrap_or_default(),
            fds.last().copied().unwrap_or_default(),
        ));
        per_service.insert(
            name.clone(),
            serde_json::json!({"rss_kib": rss, "fds": fds, "rss_growth_pct": r, "fd_growth_pct": f}),
        );
    }
    let tally = shared.tally.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (tried, answered) = tally.ops.values().fold((0, 0), |(t, a), (x, y)| (t + x, a + y));
    report
        .figure("minutes", args.minutes, "")
        .figure("requests", tried, "")
        .figure("answered", answered, "")
        .figure("acked_creates", tally.acked_creates, "")
        .figure("drains", tally.drains, "")
        .figure("rss_growth_max_pct", rss_max.max(0.0), "%")
        .figure("fd_growth_max_pct", fd_max.max(0.0), "%")
        .merge(serde_json::json!({ "services": per_service }));
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::growth;

    #[test]
    fn growth_compares_medians_of_the_first_and_last_samples() {
        assert_eq!(growth(&[100, 100, 100, 110, 110, 110]), 10.0);
        // One noisy sample at either end does not decide.
        assert_eq!(growth(&[100, 900, 100, 100, 100, 5]), 0.0);
        assert_eq!(growth(&[100]), 0.0);
    }
}
