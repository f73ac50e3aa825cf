//! `bench balance-convergence`: the planner on a simulated cluster (100 nodes, 10,000
//! sandboxes, seeded) with an injected skew. Each cycle observes, plans and applies the plan,
//! until the observation says Satisfied.
//!
//! Time is simulated too: each plan's moves run as the executor's [`schedule::Schedule`] lets them (at
//! most `--concurrency` at once, each node in at most `--moves-per-node`), each taking
//! `--move-ms` (what `bench migration` measures for a whole move); the next observation comes
//! an interval after the plan finishes. `time_to_threshold_s` is when the spread first drops
//! under the threshold as moves land.
//!
//! `--scenario grid` runs that for every cluster size, hot-node count and seed given (by
//! default 100 × 10k and 1,000 × 100k; 5, 20, 50 and 200 hot nodes, skipping counts above half
//! the cluster; seeds 1, 2, 3), then plans random small clusters that exhaustive search can
//! solve and compares those plans to the optimum. It reports every row and the worst case.

use std::collections::HashMap;
use std::time::Instant;

use balance_svc::migrate::schedule::{self, Budget};
use balance_svc::optimum::{self, Optimum};
use balance_svc::plan::skewed;
use balance_svc::plan::{self, Candidate, NodeMemory, ScanResult, Snapshot, Status, Tuning};
use common::docs::Capacity;
use common::fit::Allocation;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

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
    /// `single`: the cluster the flags above describe; `grid`: every combination of `--sizes`,
    /// `--hots` and `--seeds`, and `--small` small clusters against the exact optimum.
    #[arg(long, value_enum, default_value_t = Mode::Single)]
    scenario: Mode,
    /// Grid cluster sizes, NODESxSANDBOXES.
    #[arg(long, value_delimiter = ',', default_value = "100x10000,1000x100000")]
    sizes: Vec<String>,
    /// Grid hot-node counts (those above half a cluster are skipped).
    #[arg(long, value_delimiter = ',', default_value = "5,20,50,200")]
    hots: Vec<usize>,
    /// Grid seeds.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    seeds: Vec<u64>,
    /// Grid: random small clusters planned and solved exactly.
    #[arg(long, default_value_t = 400)]
    small: usize,
    /// Milliseconds one move takes, start to source deleted (`bench migration`'s `move_ms`).
    #[arg(long, default_value_t = MOVE_MS)]
    move_ms: f64,
    /// Moves at once (balance-svc's `--concurrency`).
    #[arg(long, default_value_t = Budget::DEFAULT.concurrency)]
    concurrency: usize,
    /// Moves a node takes part in at once (balance-svc's `--moves-per-node`).
    #[arg(long, default_value_t = Budget::DEFAULT.per_node)]
    moves_per_node: usize,
}

impl Args {
    fn budget(&self) -> Budget {
        Budget {
            concurrency: self.concurrency,
            per_node: self.moves_per_node,
        }
    }
}

/// A whole move as `bench migration` measured it (`move_ms`: 394 ms with 100 MB of files,
/// release build, on the development machine), rounded up: the simulation's default.
const MOVE_MS: f64 = 400.0;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Single,
    Grid,
}

const GIB: u64 = 1 << 30;
/// Milliseconds between observations (the balancer's interval).
const CYCLE_MS: u64 = 5_000;
/// Cycles simulated before giving up.
const MAX_CYCLES: usize = 10;

/// Each sandbox's node, memory and when it last moved, by ID.
type Placement = HashMap<String, (usize, u64, Option<u64>)>;

/// vCPUs of every simulated node: with one vCPU asked per sandbox and placement's over-commit,
/// CPU never binds here, so the figures are about memory.
const NODE_VCPUS: u32 = 64;

/// A simulated sandbox asks for one vCPU and the memory it uses.
fn ask(memory: u64) -> Capacity {
    Capacity {
        vcpus: 1,
        memory_bytes: memory,
    }
}

fn snapshot(capacity: &[u64], placement: &Placement, now_ms: u64) -> Snapshot {
    let mut used = vec![0u64; capacity.len()];
    let mut allocated = vec![Allocation::default(); capacity.len()];
    for (node, memory, _) in placement.values() {
        used[*node] += memory;
        allocated[*node].add(&ask(*memory));
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
                vcpus: NODE_VCPUS,
                allocated: allocated[i],
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
                requested: ask(*memory),
                failed: None,
                droppable: false,
            })
            .collect(),
        now_ms,
    }
}

/// The skewed cluster the planner's tests also use (`balance_svc::plan::skewed`), as the
/// simulation holds it.
fn cluster(nodes: usize, sandboxes: usize, hot: usize, seed: u64) -> (Vec<u64>, Placement) {
    let placement = skewed::cluster(nodes, sandboxes, hot, seed)
        .into_iter()
        .enumerate()
        .map(|(i, (node, bytes))| (format!("sbx-{i:05}"), (node, bytes, None)))
        .collect();
    (vec![skewed::NODE_BYTES; nodes], placement)
}

/// One simulated run.
struct Outcome {
    nodes: usize,
    sandboxes: usize,
    hot: usize,
    seed: u64,
    spread_before: f64,
    spread_after: f64,
    moves: usize,
    lower_bound: usize,
    /// The fewest moves that bring the spread within the threshold (where Satisfied starts).
    threshold_bound: usize,
    /// Plans made before the observation said Satisfied; `None` if it never did.
    cycles: Option<usize>,
    plans: usize,
    first_plan_ms: f64,
    max_plan_ms: f64,
    lost: usize,
    /// Nodes some plan filled beyond their capacity (must be 0).
    overfilled: usize,
    results: Vec<String>,
    /// Simulated seconds from the first observation until the spread was first under the
    /// threshold; `None` if it never was.
    time_to_threshold_s: Option<f64>,
    /// Simulated seconds until the last plan's last move finished.
    execution_s: f64,
}

impl Outcome {
    fn over_bound(&self) -> f64 {
        self.moves as f64 / self.lower_bound.max(1) as f64
    }

    /// The fewest plans any planner needs: `max_moves` moves each, and at least the threshold
    /// bound in all.
    fn cycles_bound(&self) -> usize {
        self.threshold_bound.div_ceil(Tuning::default().max_moves.max(1))
    }
}

/// Max - min available ratio of nodes with `capacity` and `used` bytes.
fn spread_of(capacity: &[u64], used: &[u64]) -> f64 {
    let ratios = capacity
        .iter()
        .zip(used)
        .map(|(c, u)| c.saturating_sub(*u) as f64 / (*c).max(1) as f64);
    let (lo, hi) = ratios.fold((f64::MAX, f64::MIN), |(lo, hi), r| (lo.min(r), hi.max(r)));
    hi - lo
}

/// How long the timed part of a run takes.
#[derive(Clone, Copy)]
struct Timing {
    budget: Budget,
    move_ms: f64,
}

fn simulate(nodes: usize, sandboxes: usize, hot: usize, seed: u64, timing: Timing) -> anyhow::Result<Outcome> {
    let (capacity, mut placement) = cluster(nodes, sandboxes, hot, seed);
    let tuning = Tuning::default();
    let first = snapshot(&capacity, &placement, 0);
    let spread_before = plan::spread(&first.nodes);
    let lower_bound = plan::moves_lower_bound(&first, &tuning);
    let to_threshold = Tuning {
        target: tuning.threshold,
        ..tuning.clone()
    };
    let threshold_bound = plan::moves_lower_bound(&first, &to_threshold);
    drop(first);

    let mut now = 0u64;
    let mut moves = 0usize;
    let mut plans = 0usize;
    let mut first_plan_ms = 0.0;
    let mut max_plan_ms: f64 = 0.0;
    let mut cycles = None;
    let mut overfilled = 0;
    let mut results = Vec::new();
    // Simulated time: when this cycle observes, and when the spread was under the threshold.
    let mut clock_ms = 0.0;
    let mut threshold_at: Option<f64> = None;
    let mut execution_ms = 0.0;
    let mut used = vec![0u64; capacity.len()];
    for (node, memory, _) in placement.values() {
        used[*node] += memory;
    }
    if spread_of(&capacity, &used) <= tuning.threshold {
        threshold_at = Some(0.0);
    }
    for cycle in 1..=MAX_CYCLES {
        let snap = snapshot(&capacity, &placement, now);
        let (status, _) = plan::observe(&snap, &tuning, false);

        if status == Status::Satisfied {
            cycles = Some(cycle - 1);
            break;
        }
        let started = Instant::now();
        let p = plan::plan(&snap, &tuning);
        let took = started.elapsed().as_secs_f64() * 1_000.0;
        if cycle == 1 {
            first_plan_ms = took;
        }
        max_plan_ms = max_plan_ms.max(took);
        plans = cycle;
        results.push(format!("{:?}", p.result));
        if p.result != ScanResult::PlanFound {
            break;
        }
        // The moves land as the executor's schedule would finish them.
        let ends: Vec<(usize, String, String)> = p
            .moves
            .iter()
            .enumerate()
            .map(|(i, m)| (i, m.from.clone(), m.to.clone()))
            .collect();
        let started_ms = clock_ms + took;
        let mut finished_ms = started_ms;
        for (i, at) in schedule::simulate(timing.budget, &ends, timing.move_ms) {
            let m = &p.moves[i];
            let from: usize = m.from.trim_start_matches("node-").parse()?;
            let to: usize = m.to.trim_start_matches("node-").parse()?;
            if let Some(entry) = placement.get_mut(&m.sandbox_id) {
                *entry = (to, entry.1, Some(now));
            }
            used[from] -= m.memory_bytes;
            used[to] += m.memory_bytes;
            overfilled += usize::from(used[to] > capacity[to]);
            finished_ms = started_ms + at;
            if threshold_at.is_none() && spread_of(&capacity, &used) <= tuning.threshold {
                threshold_at = Some(finished_ms);
            }
        }
        execution_ms = finished_ms;
        moves += p.moves.len();
        // The next observation: an interval after the plan finished.
        clock_ms = finished_ms + CYCLE_MS as f64;
        now += CYCLE_MS;
    }
    let last = snapshot(&capacity, &placement, now);
    Ok(Outcome {
        nodes,
        sandboxes,
        hot,
        seed,
        spread_before,
        spread_after: plan::spread(&last.nodes),
        moves,
        lower_bound,
        threshold_bound,
        cycles,
        plans,
        first_plan_ms,
        max_plan_ms,
        lost: sandboxes.saturating_sub(placement.len()),
        overfilled,
        results,
        time_to_threshold_s: threshold_at.map(|ms| ms / 1000.0),
        execution_s: execution_ms / 1000.0,
    })
}

fn round(x: f64, places: i32) -> f64 {
    let scale = 10f64.powi(places);
    (x * scale).round() / scale
}

pub fn run(args: Args) -> anyhow::Result<Report> {
    match args.scenario {
        Mode::Single => single(&args),
        Mode::Grid => grid(&args),
    }
}

fn single(args: &Args) -> anyhow::Result<Report> {
    let timing = Timing {
        budget: args.budget(),
        move_ms: args.move_ms,
    };
    let o = simulate(args.nodes, args.sandboxes, args.hot, args.seed, timing)?;
    let mut report = Report::new(format!(
        "balance-convergence: {} nodes, {} sandboxes, {} hot nodes, seed {}",
        args.nodes, args.sandboxes, args.hot, args.seed
    ));
    report
        .figure("spread_before", round(o.spread_before, 4), "")
        .figure("spread_after", round(o.spread_after, 4), "")
        .figure("moves", o.moves as u64, "")
        .figure("moves_lower_bound", o.lower_bound as u64, "")
        .figure("moves_over_bound", round(o.over_bound(), 3), "× the lower bound")
        .figure(
            "cycles_to_converge",
            o.cycles.unwrap_or(0) as u64,
            "(0: did not converge)",
        )
        .figure(
            "cycles_lower_bound",
            o.cycles_bound() as u64,
            "plans any planner needs (max_moves each)",
        )
        .figure("plan_ms", round(o.first_plan_ms, 2), "ms for the first plan")
        .figure("max_plan_ms", round(o.max_plan_ms, 2), "ms for the slowest plan")
        .figure("lost_sandboxes", o.lost as u64, "")
        .figure("overfilled_nodes", o.overfilled as u64, "")
        .figure("scan_results", o.results.join(","), "")
        .figure(
            "time_to_threshold_s",
            round(o.time_to_threshold_s.unwrap_or(-1.0), 1),
            "simulated s until under the threshold (-1: never)",
        )
        .figure(
            "execution_s",
            round(o.execution_s, 1),
            "simulated s until the last move ended",
        )
        .figure("concurrency", args.concurrency as u64, "moves at once")
        .figure(
            "moves_per_node",
            args.moves_per_node as u64,
            "moves a node is in at once",
        )
        .figure("move_ms", args.move_ms, "simulated ms per move");
    Ok(report)
}

fn grid(args: &Args) -> anyhow::Result<Report> {
    let timing = Timing {
        budget: args.budget(),
        move_ms: args.move_ms,
    };
    let mut outcomes = Vec::new();
    for size in &args.sizes {
        let (nodes, sandboxes) = size
            .split_once('x')
            .and_then(|(n, s)| Some((n.parse::<usize>().ok()?, s.parse::<usize>().ok()?)))
            .ok_or_else(|| anyhow::anyhow!("--sizes wants NODESxSANDBOXES, got {size}"))?;
        for &hot in args.hots.iter().filter(|&&h| h <= nodes / 2) {
            for &seed in &args.seeds {
                outcomes.push(simulate(nodes, sandboxes, hot, seed, timing)?);
            }
        }
    }
    let small = small_clusters(args.small, args.seed);
    // The execution case: 1,000 nodes, 50 hot (a 5 % skew), worst over the seeds, and
    // how the time to the threshold falls with the executor's concurrency (first seed only).
    let five_percent: Vec<&Outcome> = outcomes.iter().filter(|o| o.nodes == 1_000 && o.hot == 50).collect();
    let time_5pct = five_percent
        .iter()
        .map(|o| o.time_to_threshold_s.unwrap_or(f64::INFINITY))
        .fold(None, |worst: Option<f64>, t| Some(worst.map_or(t, |w| w.max(t))));
    let mut sweep = Vec::new();
    if let Some(o) = five_percent.first() {
        for concurrency in [1, 2, 4, 8, 16, 32, 64] {
            let budget = Budget {
                concurrency,
                per_node: args.moves_per_node,
            };
            let run = simulate(
                o.nodes,
                o.sandboxes,
                o.hot,
                o.seed,
                Timing {
                    budget,
                    move_ms: args.move_ms,
                },
            )?;
            sweep.push(json!({
                "concurrency": concurrency,
                "moves_per_node": args.moves_per_node,
                "time_to_threshold_s": run.time_to_threshold_s.map(|s| round(s, 1)),
                "execution_s": round(run.execution_s, 1),
            }));
        }
    }

    let mut report = Report::new(format!(
        "balance-convergence grid: {} runs, {} small clusters against the optimum",
        outcomes.len(),
        small.planned
    ));
    report.line(format!(
        "  {:>13} {:>4} {:>4}  {:>9} {:>6} {:>6} {:>6} {:>5} {:>6} {:>8}  {:>6} -> {:<6}",
        "nodes×sbx",
        "hot",
        "seed",
        "converged",
        "cycles",
        "(min)",
        "moves",
        "bound",
        "ratio",
        "plan_ms",
        "spread",
        "after"
    ));
    let mut rows = Vec::new();
    for o in &outcomes {
        report.line(format!(
            "  {:>13} {:>4} {:>4}  {:>9} {:>6} {:>6} {:>6} {:>5} {:>6.3} {:>8.2}  {:>6.3} -> {:<6.3}",
            format!("{}×{}", o.nodes, o.sandboxes),
            o.hot,
            o.seed,
            o.cycles.is_some(),
            o.plans,
            format!("({})", o.cycles_bound()),
            o.moves,
            o.lower_bound,
            o.over_bound(),
            o.max_plan_ms,
            o.spread_before,
            o.spread_after,
        ));
        rows.push(json!({
            "nodes": o.nodes,
            "sandboxes": o.sandboxes,
            "hot": o.hot,
            "seed": o.seed,
            "converged": o.cycles.is_some(),
            "cycles": o.plans,
            "cycles_lower_bound": o.cycles_bound(),
            "moves": o.moves,
            "moves_lower_bound": o.lower_bound,
            "moves_lower_bound_to_threshold": o.threshold_bound,
            "moves_over_bound": round(o.over_bound(), 3),
            "max_plan_ms": round(o.max_plan_ms, 2),
            "spread_before": round(o.spread_before, 4),
            "spread_after": round(o.spread_after, 4),
            "overfilled_nodes": o.overfilled,
            "lost_sandboxes": o.lost,
            "scan_results": o.results.join(","),
            "time_to_threshold_s": o.time_to_threshold_s.map(|s| round(s, 1)),
            "execution_s": round(o.execution_s, 1),
        }));
    }
    let worst = |f: &dyn Fn(&Outcome) -> f64| outcomes.iter().map(f).fold(0.0, f64::max);
    let big_plan_ms = outcomes
        .iter()
        .filter(|o| o.nodes >= 1_000)
        .map(|o| o.max_plan_ms)
        .fold(0.0, f64::max);
    report
        .figure("converged_all", outcomes.iter().all(|o| o.cycles.is_some()), "")
        .figure(
            "max_cycles",
            outcomes.iter().map(|o| o.plans).max().unwrap_or(0) as u64,
            "plans until Satisfied",
        )
        .figure(
            "max_cycles_over_lower_bound",
            outcomes
                .iter()
                .map(|o| o.plans.saturating_sub(o.cycles_bound()))
                .max()
                .unwrap_or(0) as u64,
            "plans more than the fewest possible",
        )
        .figure(
            "worst_moves_over_bound",
            round(worst(&|o| o.over_bound()), 3),
            "× the lower bound",
        )
        .figure("max_plan_ms", round(worst(&|o| o.max_plan_ms), 2), "ms, slowest plan")
        .figure(
            "max_plan_ms_1000_nodes",
            round(big_plan_ms, 2),
            "ms, slowest plan at ≥ 1,000 nodes",
        )
        .figure(
            "overfilled_nodes",
            outcomes.iter().map(|o| o.overfilled).sum::<usize>() as u64,
            "",
        )
        .figure(
            "lost_sandboxes",
            outcomes.iter().map(|o| o.lost).sum::<usize>() as u64,
            "",
        )
        .figure(
            "time_to_threshold_s",
            round(time_5pct.filter(|t| t.is_finite()).unwrap_or(-1.0), 1),
            "simulated s, 1,000 nodes 50 hot, worst seed (-1: never or not run)",
        )
        .figure("concurrency", args.concurrency as u64, "moves at once")
        .figure(
            "moves_per_node",
            args.moves_per_node as u64,
            "moves a node is in at once",
        )
        .figure("move_ms", args.move_ms, "simulated ms per move")
        .figure("small_clusters_solved", small.solved as u64, "optimum computed")
        .figure(
            "small_clusters_reachable",
            small.reachable as u64,
            "optimum reaches the target",
        )
        .figure(
            "small_clusters_missed",
            small.missed as u64,
            "reachable, plan fell short",
        )
        .figure(
            "small_clusters_searched",
            small.fallback as u64,
            "plans that fell back to exhaustive search",
        )
        .figure(
            "worst_gap_to_optimum",
            round(small.worst_gap, 3),
            "× the optimum's moves",
        )
        .figure("mean_gap_to_optimum", round(small.mean_gap, 3), "× the optimum's moves")
        .figure(
            "worst_gap_levelled",
            round(small.worst_levelled, 3),
            "× the optimum, plans not searched",
        )
        .figure(
            "mean_gap_levelled",
            round(small.mean_levelled, 3),
            "× the optimum, plans not searched",
        )
        .merge(json!({ "rows": rows, "concurrency_sweep": sweep }));
    Ok(report)
}

/// Small clusters planned and solved exactly.
struct Small {
    planned: usize,
    solved: usize,
    reachable: usize,
    missed: usize,
    fallback: usize,
    worst_gap: f64,
    mean_gap: f64,
    /// The same over plans made by levelling alone (not by the planner's exhaustive search).
    worst_levelled: f64,
    mean_levelled: f64,
}

/// `count` random clusters of 2-6 nodes and at most 12 movable sandboxes (and a few that may
/// not move), skewed over the threshold: each plan against the exact optimum.
fn small_clusters(count: usize, seed: u64) -> Small {
    let mut rng = SmallRng::seed_from_u64(seed);
    let tuning = Tuning::default();
    let mut small = Small {
        planned: 0,
        solved: 0,
        reachable: 0,
        missed: 0,
        fallback: 0,
        worst_gap: 0.0,
        mean_gap: 0.0,
        worst_levelled: 0.0,
        mean_levelled: 0.0,
    };
    let mut gaps = Vec::new();
    let mut levelled = Vec::new();
    while small.planned < count {
        let nodes = rng.random_range(2..=optimum::MAX_NODES);
        let capacity: Vec<u64> = (0..nodes).map(|_| [8, 16, 32][rng.random_range(0..3)] * GIB).collect();
        let mut used: Vec<u64> = capacity.iter().map(|c| c / 20).collect();
        let mut allocated_cpus = vec![0u64; nodes];
        let mut sandboxes = Vec::new();
        let hot = rng.random_range(0..nodes);
        let movable = rng.random_range(2..=optimum::MAX_MOVABLE);
        for j in 0..movable + rng.random_range(0..3) {
            let node = if rng.random_bool(0.5) {
                hot
            } else {
                rng.random_range(0..nodes)
            };
            let bytes = rng.random_range(1..=12) * GIB / 2;
            if used[node] + bytes > capacity[node] {
                continue;
            }
            used[node] += bytes;
            allocated_cpus[node] += 1;
            sandboxes.push(Candidate {
                sandbox_id: format!("s{j}"),
                node_id: format!("n{node}"),
                memory_bytes: bytes,
                lifecycle_owned: false,
                last_moved_ms: None,
                movable: j < movable,
                requested: ask(bytes),
                failed: None,
                droppable: false,
            });
        }
        let snap = Snapshot {
            nodes: (0..nodes)
                .map(|i| NodeMemory {
                    node_id: format!("n{i}"),
                    ready: true,
                    draining: false,
                    capacity_bytes: capacity[i],
                    available_bytes: capacity[i] - used[i],
                    vcpus: NODE_VCPUS,
                    allocated: Allocation {
                        vcpus: i64::try_from(allocated_cpus[i]).unwrap_or(i64::MAX),
                        memory_bytes: i64::try_from(used[i]).unwrap_or(i64::MAX),
                    },
                })
                .collect(),
            sandboxes,
            now_ms: 0,
        };
        if plan::spread(&snap.nodes) <= tuning.threshold {
            continue;
        }
        small.planned += 1;
        let p = plan::plan(&snap, &tuning);
        let searched = p.band.is_none() && !p.moves.is_empty();
        if searched {
            small.fallback += 1;
        }
        match optimum::optimum(&snap, &tuning) {
            Optimum::Unknown => {}
            Optimum::Unreachable => small.solved += 1,
            Optimum::Reachable(best) => {
                small.solved += 1;
                small.reachable += 1;
                if p.spread_after > tuning.target {
                    small.missed += 1;
                } else if !best.is_empty() {
                    let gap = p.moves.len() as f64 / best.len() as f64;
                    gaps.push(gap);
                    if !searched {
                        levelled.push(gap);
                    }
                }
            }
        }
    }
    small.worst_gap = gaps.iter().copied().fold(0.0, f64::max);
    small.mean_gap = gaps.iter().sum::<f64>() / gaps.len().max(1) as f64;
    small.worst_levelled = levelled.iter().copied().fold(0.0, f64::max);
    small.mean_levelled = levelled.iter().sum::<f64>() / levelled.len().max(1) as f64;
    small
}
