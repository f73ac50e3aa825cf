//! `bench balance-convergence`: the planner on a simulated cluster (100 nodes, 10,000
//! sandboxes, seeded) with an injected skew. Each cycle observes, plans and applies the plan
//! (moves land at once in the simulation), until the observation says Satisfied.

use std::collections::HashMap;
use std::time::Instant;

use balance_svc::plan::{self, Candidate, NodeMemory, ScanResult, Snapshot, Status, Tuning};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, default_value_t = 100)]
    nodes: usize,
    #[arg(long, default_value_t = 10_000)]
    sandboxes: usize,
    /// Nodes made hot by the injected skew.
    #[arg(long, default_value_t = 5)]
    hot: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Seconds between observations (the balancer's interval).
const CYCLE_MS: u64 = 5_000;

fn snapshot(capacity: &[u64], placement: &HashMap<String, (usize, u64, Option<u64>)>, now_ms: u64) -> Snapshot {
    let mut used = vec![0u64; capacity.len()];
    for (node, memory, _) in placement.values() {
        used[*node] += memory;
    }
    Snapshot {
        nodes: capacity
            .iter()
            .enumerate()
            .map(|(i, cap)| NodeMemory {
                node_id: format!("node-{i:03}"),
                ready: true,
                draining: false,
                capacity_bytes: *cap,
                available_bytes: cap.saturating_sub(used[i]),
            })
            .collect(),
        sandboxes: placement
            .iter()
            .map(|(id, (node, memory, moved))| Candidate {
                sandbox_id: id.clone(),
                node_id: format!("node-{node:03}"),
                memory_bytes: *memory,
                lifecycle_owned: false,
                last_moved_ms: *moved,
                movable: true,
            })
            .collect(),
        now_ms,
    }
}

pub fn run(args: Args) -> anyhow::Result<Report> {
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let capacity = vec![64 * GIB; args.nodes];
    // Sandboxes of 128-768 MiB, dealt round-robin: an even cluster to start from.
    let mut placement: HashMap<String, (usize, u64, Option<u64>)> = (0..args.sandboxes)
        .map(|i| {
            (
                format!("sbx-{i:05}"),
                (i % args.nodes, rng.random_range(128..=768) * MIB, None),
            )
        })
        .collect();
    // The skew: the hot nodes take sandboxes from random others until 5 GiB are left free.
    let mut ids: Vec<String> = placement.keys().cloned().collect();
    ids.sort();
    for (hot, cap) in capacity.iter().enumerate().take(args.hot) {
        let mut used: u64 = placement
            .values()
            .filter(|(n, _, _)| *n == hot)
            .map(|(_, m, _)| m)
            .sum();
        for id in &ids {
            let (node, memory, _) = placement[id];
            if node < args.hot || used + memory > cap - 5 * GIB {
                continue;
            }
            if rng.random_bool(0.5) {
                placement.insert(id.clone(), (hot, memory, None));
                used += memory;
            }
        }
    }
    let tuning = Tuning::default();
    let first = snapshot(&capacity, &placement, 0);
    let spread_before = plan::spread(&first.nodes);
    let lower_bound = plan::moves_lower_bound(&first, &tuning);

    let mut now = 0u64;
    let mut moves = 0usize;
    let mut cycles = 0usize;
    let mut plan_ms = 0.0;
    let mut converged = false;
    let mut results = Vec::new();
    for cycle in 1..=10 {
        let snap = snapshot(&capacity, &placement, now);
        let (status, _) = plan::observe(&snap, &tuning, false);
        if status == Status::Satisfied {
            converged = true;
            break;
        }
        cycles = cycle;
        let started = Instant::now();
        let p = plan::plan(&snap, &tuning);
        let took = started.elapsed().as_secs_f64() * 1_000.0;
        if cycle == 1 {
            plan_ms = took;
        }
        results.push(format!("{:?}", p.result));
        if p.result != ScanResult::PlanFound {
            break;
        }
        for m in &p.moves {
            let to: usize = m.to.trim_start_matches("node-").parse()?;
            if let Some(entry) = placement.get_mut(&m.sandbox_id) {
                *entry = (to, entry.1, Some(now));
            }
        }
        moves += p.moves.len();
        now += CYCLE_MS;
    }
    let last = snapshot(&capacity, &placement, now);
    let lost = args.sandboxes.saturating_sub(placement.len());

    let mut report = Report::new(format!(
        "balance-convergence: {} nodes, {} sandboxes, {} hot nodes, seed {}",
        args.nodes, args.sandboxes, args.hot, args.seed
    ));
    report
        .figure("spread_before", (spread_before * 10_000.0).round() / 10_000.0, "")
        .figure(
            "spread_after",
            (plan::spread(&last.nodes) * 10_000.0).round() / 10_000.0,
            "",
        )
        .figure("moves", moves as u64, "")
        .figure("moves_lower_bound", lower_bound as u64, "")
        .figure(
            "moves_over_bound",
            (moves as f64 / lower_bound.max(1) as f64 * 1000.0).round() / 1000.0,
            "× the lower bound",
        )
        .figure(
            "cycles_to_converge",
            if converged { cycles as u64 } else { 0 },
            "(0: did not converge)",
        )
        .figure("plan_ms", (plan_ms * 100.0).round() / 100.0, "ms for the first plan")
        .figure("lost_sandboxes", lost as u64, "")
        .figure("scan_results", results.join(","), "");
    Ok(report)
}
