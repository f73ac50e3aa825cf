//! The pure core of balancing: how uneven the cluster's memory is, whether to act, and the
//! fewest moves that make it even. No I/O: a plan is a function of one snapshot, so it is
//! unit-tested, benchmarked and compared to an honest lower bound.
//!
//! The vocabulary is the one operators of such balancers grep for: observation statuses
//! `Satisfied/SpreadWithinThreshold`, `PendingBalance/PlanningRequired`,
//! `PendingBalance/AwaitingOperationObservation`; skip reasons `UnknownMemoryEstimate`,
//! `LifecycleOwned`, `Cooldown`, `NoFit`, `NotMovable`; scan results `PlanFound`,
//! `NothingToDo`, `NoImprovingMove`.
//!
//! Spread = max - min, over ready nodes, of available physical memory / capacity.

use std::collections::{BTreeMap, HashMap};

/// One node as the last heartbeat (via its node document) describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeMemory {
    pub node_id: String,
    /// Ready for new sandboxes (not draining, not unhealthy).
    pub ready: bool,
    /// Being drained: everything on it moves to ready nodes, cooldown or not.
    pub draining: bool,
    pub capacity_bytes: u64,
    pub available_bytes: u64,
}

impl NodeMemory {
    pub fn ratio(&self) -> f64 {
        self.available_bytes as f64 / self.capacity_bytes.max(1) as f64
    }
}

/// One sandbox a plan may move.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub sandbox_id: String,
    pub node_id: String,
    /// Measured use from the latest heartbeat when there is one, else the manifest's
    /// estimate; 0 means none is known.
    pub memory_bytes: u64,
    /// Another operation owns its lifecycle right now.
    pub lifecycle_owned: bool,
    /// When it last moved (unix ms).
    pub last_moved_ms: Option<u64>,
    /// Paused, being created, or otherwise not to be moved.
    pub movable: bool,
}

/// What the balancer sees at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub nodes: Vec<NodeMemory>,
    pub sandboxes: Vec<Candidate>,
    pub now_ms: u64,
}

/// Thresholds and limits.
#[derive(Clone, Debug, PartialEq)]
pub struct Tuning {
    /// Act when the spread exceeds this (0.1 by default).
    pub threshold: f64,
    /// Plan down to this (below the threshold, so balancing does not flap).
    pub target: f64,
    /// A sandbox is not moved again within this long (5 minutes).
    pub cooldown_ms: u64,
    /// Most moves in one plan.
    pub max_moves: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            threshold: 0.1,
            target: 0.05,
            cooldown_ms: 5 * 60 * 1000,
            max_moves: 1000,
        }
    }
}

/// The max - min available-memory ratio over ready nodes (0 with fewer than two).
pub fn spread(nodes: &[NodeMemory]) -> f64 {
    let ratios: Vec<f64> = nodes.iter().filter(|n| n.ready).map(NodeMemory::ratio).collect();
    if ratios.len() < 2 {
        return 0.0;
    }
    let max = ratios.iter().copied().fold(f64::MIN, f64::max);
    let min = ratios.iter().copied().fold(f64::MAX, f64::min);
    max - min
}

/// An observation's status and reason, in the words operators grep for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// `Satisfied/SpreadWithinThreshold`.
    Satisfied,
    /// `PendingBalance/PlanningRequired`.
    PlanningRequired,
    /// `PendingBalance/AwaitingOperationObservation`: a move finished but no heartbeat has
    /// shown its effect yet; judging now would double-count it.
    AwaitingOperationObservation,
    /// `Blocked/<cause>`.
    Blocked(String),
}

impl Status {
    pub fn label(&self) -> String {
        match self {
            Status::Satisfied => "Satisfied/SpreadWithinThreshold".into(),
            Status::PlanningRequired => "PendingBalance/PlanningRequired".into(),
            Status::AwaitingOperationObservation => "PendingBalance/AwaitingOperationObservation".into(),
            Status::Blocked(cause) => format!("Blocked/{cause}"),
        }
    }
}

/// Judges a snapshot. `awaiting` is true while a finished move has not yet been reflected by
/// a heartbeat of both nodes involved.
pub fn observe(snapshot: &Snapshot, tuning: &Tuning, awaiting: bool) -> (Status, f64) {
    let s = spread(&snapshot.nodes);
    let ready = snapshot.nodes.iter().filter(|n| n.ready).count();
    let status = if ready < 2 {
        Status::Blocked("FewerThanTwoReadyNodes".into())
    } else if awaiting {
        Status::AwaitingOperationObservation
    } else if s <= tuning.threshold {
        Status::Satisfied
    } else {
        Status::PlanningRequired
    };
    (status, s)
}

/// Why a sandbox was not moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Skip {
    UnknownMemoryEstimate,
    LifecycleOwned,
    Cooldown,
    NotMovable,
    NoFit,
}

/// Why `c` may not move now, if it may not; `cooldown` is (now, cooldown) in ms when it applies.
fn skip_reason(c: &Candidate, cooldown: Option<(u64, u64)>) -> Option<Skip> {
    if c.memory_bytes == 0 {
        Some(Skip::UnknownMemoryEstimate)
    } else if c.lifecycle_owned {
        Some(Skip::LifecycleOwned)
    } else if !c.movable {
        Some(Skip::NotMovable)
    } else if cooldown.is_some_and(|(now, span)| c.last_moved_ms.is_some_and(|at| now.saturating_sub(at) < span)) {
        Some(Skip::Cooldown)
    } else {
        None
    }
}

/// One planned move.
#[derive(Clone, Debug, PartialEq)]
pub struct Move {
    pub sandbox_id: String,
    pub from: String,
    pub to: String,
    pub memory_bytes: u64,
}

/// How a scan ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanResult {
    PlanFound,
    /// The spread is already within the threshold.
    NothingToDo,
    /// Over the threshold, but no allowed move improves the spread.
    NoImprovingMove,
    /// A draining node holds sandboxes that fit nowhere.
    NoFitForDrain,
}

impl ScanResult {
    pub fn name(self) -> &'static str {
        match self {
            ScanResult::PlanFound => "PlanFound",
            ScanResult::NothingToDo => "NothingToDo",
            ScanResult::NoImprovingMove => "NoImprovingMove",
            ScanResult::NoFitForDrain => "NoFitForDrain",
        }
    }
}

impl Skip {
    pub fn name(self) -> &'static str {
        match self {
            Skip::UnknownMemoryEstimate => "UnknownMemoryEstimate",
            Skip::LifecycleOwned => "LifecycleOwned",
            Skip::Cooldown => "Cooldown",
            Skip::NotMovable => "NotMovable",
            Skip::NoFit => "NoFit",
        }
    }
}

/// A plan and the scan that found it.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub result: ScanResult,
    pub moves: Vec<Move>,
    pub skips: BTreeMap<Skip, usize>,
    pub spread_before: f64,
    pub spread_after: f64,
}

impl Plan {
    /// No moves yet, at the given spread.
    fn empty(spread: f64) -> Self {
        Plan {
            result: ScanResult::NothingToDo,
            moves: Vec::new(),
            skips: BTreeMap::new(),
            spread_before: spread,
            spread_after: spread,
        }
    }
}

/// The fewest moves that bring the spread under `tuning.target`, greedily: always from the
/// most pressured node to the least, aiming at what would level the pair, and only moves that fit
/// the target node and strictly lower the spread.
///
/// Each step picks the largest sandbox that does not overshoot that level point (fewest moves),
/// else the one that overshoots least.
pub fn plan(snapshot: &Snapshot, tuning: &Tuning) -> Plan {
    let mut nodes: Vec<NodeMemory> = snapshot.nodes.iter().filter(|n| n.ready).cloned().collect();
    let mut plan = Plan::empty(spread(&nodes));
    if nodes.len() < 2 || plan.spread_before <= tuning.threshold {
        return plan;
    }
    let index: HashMap<String, usize> = nodes.iter().enumerate().map(|(i, n)| (n.node_id.clone(), i)).collect();
    // Movable candidates per node; everything else is counted once under its reason.
    let mut by_node: Vec<Vec<&Candidate>> = vec![Vec::new(); nodes.len()];
    for c in &snapshot.sandboxes {
        let Some(&i) = index.get(&c.node_id) else { continue };
        match skip_reason(c, Some((snapshot.now_ms, tuning.cooldown_ms))) {
            Some(reason) => *plan.skips.entry(reason).or_default() += 1,
            None => by_node[i].push(c),
        }
    }
    for list in &mut by_node {
        list.sort_by_key(|c| c.memory_bytes);
    }
    while plan.moves.len() < tuning.max_moves {
        let current = spread(&nodes);
        if current <= tuning.target {
            break;
        }
        let (src, dst) = extremes(&nodes);
        let (a_s, c_s) = (
            nodes[src].available_bytes as f64,
            nodes[src].capacity_bytes.max(1) as f64,
        );
        let (a_t, c_t) = (
            nodes[dst].available_bytes as f64,
            nodes[dst].capacity_bytes.max(1) as f64,
        );
        // Moving m levels the pair when (a_s + m)/c_s = (a_t - m)/c_t.
        let ideal = (a_t * c_s - a_s * c_t) / (c_s + c_t);
        // Only the pair changes: the rest of the cluster's extremes are computed once.
        let (others_max, others_min) = nodes
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != src && *i != dst)
            .fold((f64::MIN, f64::MAX), |(hi, lo), (_, n)| {
                (hi.max(n.ratio()), lo.min(n.ratio()))
            });
        let mut best: Option<(usize, f64)> = None;
        for (k, c) in by_node[src].iter().enumerate() {
            let m = c.memory_bytes as f64;
            if m > a_t {
                continue;
            }
            let (r_s, r_t) = ((a_s + m) / c_s, (a_t - m) / c_t);
            let after = others_max.max(r_s).max(r_t) - others_min.min(r_s).min(r_t);
            if after >= current - 1e-12 {
                continue;
            }
            // The largest piece that does not overshoot the level point does the most one
            // move can; past it, the smallest overshoot.
            let rank = if m <= ideal {
                ideal - m
            } else {
                ideal + (m - ideal) * 2.0
            };
            if best.is_none_or(|(_, r)| rank < r) {
                best = Some((k, rank));
            }
        }
        let Some((k, _)) = best else {
            if by_node[src].iter().all(|c| c.memory_bytes > nodes[dst].available_bytes) && !by_node[src].is_empty() {
                *plan.skips.entry(Skip::NoFit).or_default() += by_node[src].len();
            }
            break;
        };
        let chosen = by_node[src].remove(k);
        nodes[src].available_bytes += chosen.memory_bytes;
        nodes[dst].available_bytes -= chosen.memory_bytes;
        plan.moves.push(Move {
            sandbox_id: chosen.sandbox_id.clone(),
            from: nodes[src].node_id.clone(),
            to: nodes[dst].node_id.clone(),
            memory_bytes: chosen.memory_bytes,
        });
    }
    plan.spread_after = spread(&nodes);
    plan.result = if plan.moves.is_empty() {
        ScanResult::NoImprovingMove
    } else {
        ScanResult::PlanFound
    };
    plan
}

/// Moves everything movable off draining nodes: largest first, each onto the ready node with
/// the most available memory after the moves already chosen, never overfilling it. Cooldown
/// does not apply (a drain must empty the node); lifecycle-owned, paused and unknown-size
/// sandboxes are skipped and counted, and tried again on the next scan.
pub fn plan_drain(snapshot: &Snapshot, tuning: &Tuning) -> Plan {
    let mut ready: Vec<NodeMemory> = snapshot.nodes.iter().filter(|n| n.ready).cloned().collect();
    let mut plan = Plan::empty(spread(&ready));
    let draining: Vec<&str> = snapshot
        .nodes
        .iter()
        .filter(|n| n.draining)
        .map(|n| n.node_id.as_str())
        .collect();
    let mut leaving: Vec<&Candidate> = Vec::new();
    for c in snapshot
        .sandboxes
        .iter()
        .filter(|c| draining.contains(&c.node_id.as_str()))
    {
        // Cooldown does not hold a sandbox on a node that must empty.
        match skip_reason(c, None) {
            Some(reason) => *plan.skips.entry(reason).or_default() += 1,
            None => leaving.push(c),
        }
    }
    leaving.sort_by(|a, b| {
        b.memory_bytes
            .cmp(&a.memory_bytes)
            .then(a.sandbox_id.cmp(&b.sandbox_id))
    });
    for c in leaving {
        if plan.moves.len() >= tuning.max_moves {
            break;
        }
        let best = ready
            .iter_mut()
            .filter(|n| n.available_bytes >= c.memory_bytes)
            .max_by(|a, b| a.ratio().total_cmp(&b.ratio()));
        let Some(to) = best else {
            *plan.skips.entry(Skip::NoFit).or_default() += 1;
            continue;
        };
        to.available_bytes -= c.memory_bytes;
        plan.moves.push(Move {
            sandbox_id: c.sandbox_id.clone(),
            from: c.node_id.clone(),
            to: to.node_id.clone(),
            memory_bytes: c.memory_bytes,
        });
    }
    plan.spread_after = spread(&ready);
    plan.result = if !plan.moves.is_empty() {
        ScanResult::PlanFound
    } else if plan.skips.contains_key(&Skip::NoFit) {
        ScanResult::NoFitForDrain
    } else {
        ScanResult::NothingToDo
    };
    plan
}

/// Indices of the most pressured (lowest available ratio) and least pressured nodes.
fn extremes(nodes: &[NodeMemory]) -> (usize, usize) {
    let mut lo = 0;
    let mut hi = 0;
    for (i, n) in nodes.iter().enumerate() {
        if n.ratio() < nodes[lo].ratio() {
            lo = i;
        }
        if n.ratio() > nodes[hi].ratio() {
            hi = i;
        }
    }
    (lo, hi)
}

/// A bound no planner can beat. Moves preserve the total available memory, so the weighted
/// mean ratio r̄ is fixed, and a final spread ≤ `target` puts every node within `target` of r̄.
/// A node below r̄ - target gains memory only when its own sandboxes leave, and every move has
/// exactly one source: so it is the source of at least as many moves as the fewest of its
/// movable sandboxes that cover its deficit (largest first), and the sum over such nodes
/// bounds the plan. Likewise every move has one destination, and a node above r̄ + target must
/// take in its excess, one sandbox (at most the largest movable one) per move. The bound is the
/// larger of the two sums.
pub fn moves_lower_bound(snapshot: &Snapshot, tuning: &Tuning) -> usize {
    let ready: Vec<&NodeMemory> = snapshot.nodes.iter().filter(|n| n.ready).collect();
    if ready.len() < 2 || spread(&snapshot.nodes) <= tuning.threshold {
        return 0;
    }
    let total_available: f64 = ready.iter().map(|n| n.available_bytes as f64).sum();
    let total_capacity: f64 = ready.iter().map(|n| n.capacity_bytes as f64).sum();
    let mean = total_available / total_capacity.max(1.0);
    let movable = |c: &&Candidate| c.movable && !c.lifecycle_owned && c.memory_bytes > 0;
    let largest = snapshot
        .sandboxes
        .iter()
        .filter(movable)
        .map(|c| c.memory_bytes)
        .max()
        .unwrap_or(0);
    let (mut as_source, mut as_destination) = (0usize, 0usize);
    for n in &ready {
        let deficit = (mean - tuning.target - n.ratio()) * n.capacity_bytes as f64;
        if deficit > 0.0 {
            let mut own: Vec<u64> = snapshot
                .sandboxes
                .iter()
                .filter(movable)
                .filter(|c| c.node_id == n.node_id)
                .map(|c| c.memory_bytes)
                .collect();
            own.sort_unstable_by(|a, b| b.cmp(a));
            let mut covered = 0.0;
            let mut k = 0;
            for m in own {
                if covered >= deficit {
                    break;
                }
                covered += m as f64;
                k += 1;
            }
            as_source += k.max(1);
        }
        let excess = (n.ratio() - mean - tuning.target) * n.capacity_bytes as f64;
        if excess > 0.0 && largest > 0 {
            as_destination += ((excess / largest as f64).ceil() as usize).max(1);
        }
    }
    as_source.max(as_destination)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn node(id: &str, capacity_gib: u64, available_gib: u64) -> NodeMemory {
        NodeMemory {
            node_id: id.into(),
            ready: true,
            draining: false,
            capacity_bytes: capacity_gib * GIB,
            available_bytes: available_gib * GIB,
        }
    }

    fn sandbox(id: &str, node: &str, gib: u64) -> Candidate {
        Candidate {
            sandbox_id: id.into(),
            node_id: node.into(),
            memory_bytes: gib * GIB,
            lifecycle_owned: false,
            last_moved_ms: None,
            movable: true,
        }
    }

    #[test]
    fn the_seeds_cluster_is_observed_and_planned() {
        // 34% used vs 13% used: spread 0.21.
        let snap = Snapshot {
            nodes: vec![node("master", 100, 66), node("peer", 100, 87)],
            sandboxes: (0..12).map(|i| sandbox(&format!("s{i}"), "master", 2)).collect(),
            now_ms: 0,
        };
        let (status, s) = observe(&snap, &Tuning::default(), false);
        assert_eq!(status.label(), "PendingBalance/PlanningRequired");
        assert!((s - 0.21).abs() < 1e-9);
        let plan = plan(&snap, &Tuning::default());
        assert_eq!(plan.result, ScanResult::PlanFound);
        assert!(plan.spread_after <= 0.05, "{plan:?}");
        // Levelling needs 10.5 GiB moved in 2 GiB pieces: 5 moves (spread 0.01).
        assert_eq!(plan.moves.len(), 5);
        assert!(plan.moves.iter().all(|m| m.from == "master" && m.to == "peer"));
        assert!(plan.moves.len() >= moves_lower_bound(&snap, &Tuning::default()));
    }

    #[test]
    fn skip_reasons_are_counted_and_respected() {
        let mut owned = sandbox("owned", "hot", 4);
        owned.lifecycle_owned = true;
        let mut cooling = sandbox("cooling", "hot", 4);
        cooling.last_moved_ms = Some(9_000);
        let mut unknown = sandbox("unknown", "hot", 0);
        unknown.memory_bytes = 0;
        let mut paused = sandbox("paused", "hot", 4);
        paused.movable = false;
        let snap = Snapshot {
            nodes: vec![node("hot", 100, 50), node("cold", 100, 90)],
            sandboxes: vec![owned, cooling, unknown, paused],
            now_ms: 10_000,
        };
        let plan = plan(&snap, &Tuning::default());
        assert_eq!(plan.result, ScanResult::NoImprovingMove);
        assert!(plan.moves.is_empty());
        let skips: Vec<Skip> = plan.skips.keys().copied().collect();
        assert_eq!(
            skips,
            vec![
                Skip::UnknownMemoryEstimate,
                Skip::LifecycleOwned,
                Skip::Cooldown,
                Skip::NotMovable
            ]
        );
    }

    #[test]
    fn never_overfills_and_every_move_improves() {
        let snap = Snapshot {
            nodes: vec![node("a", 16, 2), node("b", 16, 3), node("c", 64, 40)],
            sandboxes: vec![
                sandbox("big", "a", 12),
                sandbox("mid", "a", 2),
                sandbox("small", "b", 1),
            ],
            now_ms: 0,
        };
        let plan = plan(&snap, &Tuning::default());
        let mut nodes = snap.nodes.clone();
        let mut last = spread(&nodes);
        for m in &plan.moves {
            let from = nodes.iter().position(|n| n.node_id == m.from).unwrap();
            let to = nodes.iter().position(|n| n.node_id == m.to).unwrap();
            assert!(nodes[to].available_bytes >= m.memory_bytes, "overfilled {}", m.to);
            nodes[from].available_bytes += m.memory_bytes;
            nodes[to].available_bytes -= m.memory_bytes;
            let now = spread(&nodes);
            assert!(now < last, "a move did not improve the spread");
            last = now;
        }
    }

    #[test]
    fn no_plan_beats_the_lower_bound() {
        // If a plan ever needed fewer moves than the bound, the bound would be wrong.
        let mut seed = 12345u64;
        let mut next = move |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..200 {
            let count = 2 + next(8) as usize;
            let nodes: Vec<NodeMemory> = (0..count).map(|i| node(&format!("n{i}"), 64, 0)).collect();
            let mut sandboxes = Vec::new();
            let mut used = vec![0u64; count];
            for j in 0..(20 + next(200)) {
                let n = if next(3) == 0 { 0 } else { next(count as u64) as usize };
                let m = (1 + next(8)) * GIB / 4;
                if used[n] + m > 64 * GIB {
                    continue;
                }
                used[n] += m;
                let mut c = sandbox(&format!("s{j}"), &format!("n{n}"), 0);
                c.memory_bytes = m;
                sandboxes.push(c);
            }
            let nodes = nodes
                .into_iter()
                .enumerate()
                .map(|(i, mut n)| {
                    n.available_bytes = 64 * GIB - used[i];
                    n
                })
                .collect();
            let snap = Snapshot {
                nodes,
                sandboxes,
                now_ms: 0,
            };
            let p = plan(&snap, &Tuning::default());
            if p.spread_after <= Tuning::default().target {
                assert!(p.moves.len() >= moves_lower_bound(&snap, &Tuning::default()), "{p:?}");
            }
        }
    }

    #[test]
    fn a_drain_empties_the_node_largest_first_without_overfilling() {
        let mut gone = node("gone", 16, 4);
        gone.ready = false;
        gone.draining = true;
        let mut cooling = sandbox("cooling", "gone", 4);
        cooling.last_moved_ms = Some(9_000);
        let mut paused = sandbox("paused", "gone", 1);
        paused.movable = false;
        let snap = Snapshot {
            nodes: vec![gone, node("a", 16, 6), node("b", 16, 5)],
            sandboxes: vec![
                sandbox("small", "gone", 2),
                cooling,
                paused,
                sandbox("huge", "gone", 7),
                sandbox("stay", "a", 1),
            ],
            now_ms: 10_000,
        };
        let plan = plan_drain(&snap, &Tuning::default());
        let moved: Vec<(&str, &str)> = plan
            .moves
            .iter()
            .map(|m| (m.sandbox_id.as_str(), m.to.as_str()))
            .collect();
        // 7 GiB fits nowhere; 4 GiB goes to the emptier node a, then 2 GiB to b (5 > 2).
        assert_eq!(moved, vec![("cooling", "a"), ("small", "b")]);
        assert_eq!(plan.skips.get(&Skip::NoFit), Some(&1));
        assert_eq!(plan.skips.get(&Skip::NotMovable), Some(&1));
        assert_eq!(plan.result, ScanResult::PlanFound);
    }

    #[test]
    fn within_threshold_is_satisfied_and_planned_as_nothing() {
        let snap = Snapshot {
            nodes: vec![node("a", 100, 50), node("b", 100, 58)],
            sandboxes: vec![sandbox("s", "a", 1)],
            now_ms: 0,
        };
        assert_eq!(observe(&snap, &Tuning::default(), false).0, Status::Satisfied);
        assert_eq!(
            observe(&snap, &Tuning::default(), true).0,
            Status::AwaitingOperationObservation
        );
        assert_eq!(plan(&snap, &Tuning::default()).result, ScanResult::NothingToDo);
        let lonely = Snapshot {
            nodes: vec![node("a", 100, 50)],
            ..Snapshot::default()
        };
        assert_eq!(
            observe(&lonely, &Tuning::default(), false).0.label(),
            "Blocked/FewerThanTwoReadyNodes"
        );
    }
}
