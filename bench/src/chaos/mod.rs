//! `bench chaos`: a seeded fault suite with a history checker. A multi-process cluster
//! ([`cluster`]) serves clients that use it as E2B's SDK does ([`workload`]) while a seeded
//! schedule ([`schedule`]) SIGKILLs services (Redis, the ledger, placement replicas,
//! gateways, nodes, balance-svc), restarts them, and cuts nodes off from placement. When the
//! faults stop the cluster is given time to settle, then [`check`] holds what clients were
//! told against what the cluster holds: lost = 0, duplicated = 0, files intact, accounting
//! exact, nothing stuck, nothing leaked.
//!
//! `--plant-loss` then kills one sandbox on its node behind the control plane's back and
//! checks again: the checker must report it lost (proof it can fail).

mod check;
pub(crate) mod cluster;
mod observe;
mod schedule;
pub(crate) mod workload;

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use proto::placement::v1 as pl;
use proto::placement::v1::placement_client::PlacementClient;

use crate::report::Report;
use check::Verdict;
use cluster::Cluster;
use schedule::Fault;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Seed of the fault schedule and of the clients' choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds of faults (the workload runs as long).
    #[arg(long, default_value_t = 120)]
    seconds: u64,
    /// Concurrent clients.
    #[arg(long, default_value_t = 4)]
    clients: u64,
    /// Seconds the cluster is given, after the faults stop, to settle before the verdict.
    #[arg(long, default_value_t = 60)]
    settle_secs: u64,
    /// After the verdict, kill a sandbox on its node behind the control plane's back and
    /// check that the checker reports it lost.
    #[arg(long)]
    plant_loss: bool,
    /// Keep the work folder (every service's log) after the run.
    #[arg(long)]
    keep: bool,
}

fn say(started: Instant, what: impl std::fmt::Display) {
    eprintln!("[chaos {:>7.2}s] {what}", started.elapsed().as_secs_f64());
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    let postgres = stack::services::postgres_url();
    let mut cluster = Cluster::start(&postgres).await?;
    let outcome = exercise(&args, &mut cluster).await;
    end_sandboxes(&cluster).await;
    let keep = args.keep || outcome.as_ref().map_or(true, |r| !r.1);
    if keep {
        eprintln!("chaos: logs kept in {}", cluster.work.display());
    }
    cluster.stop(&postgres, keep).await;
    outcome.map(|(report, _)| report)
}

/// Ends every sandbox on every node: nodes keep theirs across their own restarts, so the
/// run's end must.
pub(crate) async fn end_sandboxes(cluster: &Cluster) {
    for node in &cluster.nodes {
        if let Ok(listed) = observe::listing(&node.endpoint, &cluster.certs).await {
            for sandbox in &listed {
                let _ = observe::kill_on_node(&node.endpoint, sandbox, &cluster.certs).await;
            }
        }
    }
}

pub(crate) async fn ready_nodes(cluster: &Cluster) -> usize {
    let Ok(endpoint) = cluster.certs.endpoint(&cluster.placements[0], stack::Role::Placement) else {
        return 0;
    };
    let Ok(channel) = endpoint.connect().await else {
        return 0;
    };
    let mut placement = PlacementClient::new(channel);
    placement.nodes(pl::NodesRequest {}).await.map_or(0, |r| {
        r.into_inner()
            .nodes
            .iter()
            .filter(|n| n.state == pl::NodeState::Ready as i32)
            .count()
    })
}

/// Runs the workload under the schedule, settles, judges. Returns the report and whether the
/// verdict was clean.
async fn exercise(args: &Args, cluster: &mut Cluster) -> anyhow::Result<(Report, bool)> {
    let started = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready_nodes(cluster).await < cluster::NODES {
        anyhow::ensure!(Instant::now() < deadline, "the nodes never became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    say(started, format!("cluster up in {}", cluster.work.display()));

    let shared = workload::Shared::new(cluster.gateways.clone())?;
    let mut clients = Vec::new();
    for n in 0..args.clients {
        clients.push(tokio::spawn(workload::client(n, args.seed, shared.clone())));
    }
    let node_ids: Vec<String> = cluster.nodes.iter().map(|n| n.id.clone()).collect();
    let operator = tokio::spawn(workload::operator(
        args.seed,
        cluster.balance.clone(),
        node_ids.clone(),
        cluster.certs.clone(),
        shared.clone(),
    ));

    let names = schedule::services(cluster::NODES, cluster::PLACEMENTS, cluster::GATEWAYS);
    let plan = schedule::plan(args.seed, Duration::from_secs(args.seconds), &names, cluster::NODES);
    let faults_started = Instant::now();
    for planned in &plan {
        tokio::time::sleep(planned.at.saturating_sub(faults_started.elapsed())).await;
        match &planned.fault {
            Fault::Kill { service, down } => {
                say(started, format!("kill {service} for {down:?}"));
                cluster.kill(service);
                tokio::time::sleep(*down).await;
                cluster.ensure_running(service)?;
            }
            Fault::Cut { node, down } => {
                say(started, format!("cut node-{node} off placement for {down:?}"));
                cluster.links[*node].set_cut(true);
                tokio::time::sleep(*down).await;
                cluster.links[*node].set_cut(false);
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(args.seconds).saturating_sub(faults_started.elapsed())).await;
    shared.stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await?;
    }
    operator.await?;
    say(
        started,
        format!("faults over: {} injected; workload stopped", plan.len()),
    );

    // Everything up again, no node left draining.
    for link in &cluster.links {
        link.set_cut(false);
    }
    let names: Vec<String> = cluster.services.keys().cloned().collect();
    for name in &names {
        cluster.ensure_running(name)?;
    }
    cluster.wait_listening(Duration::from_secs(60)).await?;
    let undo_by = Instant::now() + Duration::from_secs(30);
    for node in &node_ids {
        while !workload::drain(&cluster.balance, node, true, &cluster.certs).await {
            anyhow::ensure!(
                Instant::now() < undo_by,
                "balance-svc never answered to undo the drains"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    let history = shared
        .history
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let settle_started = Instant::now();
    let settle_by = settle_started + Duration::from_secs(args.settle_secs);
    let (mut verdict, mut observation) = (None::<Verdict>, None);
    loop {
        match observe::observe(cluster).await {
            Ok(obs) => {
                let v = check::check(&history, &obs);
                let clean = v.clean();
                verdict = Some(v);
                observation = Some(obs);
                if clean {
                    break;
                }
            }
            Err(err) => say(started, format!("cannot observe yet: {err:#}")),
        }
        if Instant::now() >= settle_by {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let settle_ms = settle_started.elapsed().as_millis() as u64;
    let mut observation = observation.ok_or_else(|| anyhow::anyhow!("the cluster could never be observed"))?;
    let mut verdict = verdict.unwrap_or_default();
    let expected_files = check::expected_files(&history);
    let alive = check::expected_alive(&history);
    if verdict.clean() {
        let paused: BTreeSet<String> = observation
            .manifests
            .iter()
            .filter(|m| m.phase == "paused")
            .map(|m| m.id.clone())
            .collect();
        let tokens = shared
            .tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        observation.files =
            observe::read_files(cluster, &shared.http, &tokens, expected_files.keys().cloned(), &paused).await;
        verdict = check::check(&history, &observation);
    }
    say(
        started,
        format!("verdict after {settle_ms} ms of settling: {verdict:?}"),
    );

    let mut report = Report::new(format!(
        "chaos: seed {}, {} s of faults, {} clients, 3 nodes, 2 placers on Redis, 2 gateways, ledger on PostgreSQL, balance",
        args.seed, args.seconds, args.clients
    ));
    let tally = shared
        .tally
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    for finding in &verdict.findings {
        report.line(format!("  finding: {finding}"));
    }
    for (kind, (tried, ok)) in &tally.ops {
        report.line(format!("  {kind}: {ok} of {tried} answered"));
    }
    report
        .figure("seed", args.seed, "")
        .figure("faults_injected", plan.len() as u64, "")
        .figure("drains", tally.drains, "")
        .figure("acked_creates", tally.acked_creates, "")
        .figure("alive_at_end", alive.len() as u64, "sandboxes")
        .figure("files_checked", expected_files.len() as u64, "")
        .figure("lost", verdict.lost, "")
        .figure("duplicated", verdict.duplicated, "")
        .figure("files_lost", verdict.files_lost, "")
        .figure("accounting_error", verdict.accounting_error, "")
        .figure("stuck_manifests", verdict.stuck_manifests, "")
        .figure("leaked", verdict.leaked, "")
        .figure("settle_ms", settle_ms, "ms")
        .figure(
            "longest_unavailable_ms",
            tally.longest_unavailable.as_millis() as u64,
            "ms",
        );
    let ops: serde_json::Map<String, serde_json::Value> = tally
        .ops
        .iter()
        .map(|(kind, (tried, ok))| (kind.to_string(), serde_json::json!({"tried": tried, "answered": ok})))
        .collect();
    report.merge(serde_json::json!({ "ops": ops }));
    let clean = verdict.clean();

    if args.plant_loss {
        let victim = observation
            .manifests
            .iter()
            .find(|m| alive.contains(&m.id) && m.phase == "running")
            .cloned();
        let caught = match victim {
            Some(m) => {
                let node = cluster.nodes.iter().find(|n| n.id == m.node_id);
                let endpoint = node.map(|n| n.endpoint.clone()).unwrap_or_default();
                let listed = observe::listing(&endpoint, &cluster.certs).await?;
                let copy = listed.iter().find(|s| s.sandbox_id == m.id);
                anyhow::ensure!(copy.is_some(), "the planted victim {} is not on {}", m.id, m.node_id);
                if let Some(copy) = copy {
                    observe::kill_on_node(&endpoint, copy, &cluster.certs).await?;
                }
                say(
                    started,
                    format!(
                        "planted: killed {} on {} behind the control plane's back",
                        m.id, m.node_id
                    ),
                );
                let v = check::check(&history, &observe::observe(cluster).await?);
                say(started, format!("verdict with the planted loss: {v:?}"));
                v.lost >= 1
            }
            None => false,
        };
        report.figure("planted_loss_caught", caught, "");
    }
    Ok((report, clean))
}
