//! What balancing reasons about: the cluster as one snapshot sees it (nodes' memory, the
//! sandboxes that might move, what failed to move lately), the knobs of a plan, the spread
//! and the observation it gives, why a sandbox may not move, and a move. The planner
//! ([`super`]) and the exact search ([`super::optimum`]) both work on these, and nothing here
//! depends on either.

use common::docs::Capacity;
use common::fit::{self, Allocation};

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
    /// vCPUs, for the allocation rule ([`common::fit`]).
    pub vcpus: u32,
    /// What the node's sandboxes asked for, as its heartbeat reported.
    pub allocated: Allocation,
}

impl NodeMemory {
    pub fn ratio(&self) -> f64 {
        self.available_bytes as f64 / self.capacity_bytes.max(1) as f64
    }

    /// Its vCPUs and memory, as the allocation rule sees them.
    pub fn resources(&self) -> Capacity {
        Capacity {
            vcpus: self.vcpus,
            memory_bytes: self.capacity_bytes,
        }
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
    /// What it asked for (vCPUs, memory): a target must have that much allocation left under
    /// placement's rule ([`common::fit`]), whatever the sandbox measures.
    pub requested: Capacity,
    /// Its moves that failed in a row, if the last did: it waits out a backoff
    /// ([`FailedMoves::retry_at_ms`]) before it is planned again, so one sandbox that cannot
    /// move (its node refuses the snapshot, its files do not fit elsewhere) never holds a
    /// drain or a balance back from the others.
    pub failed: Option<FailedMoves>,
    /// Unclaimed in a warm pool and never asked to go: its move may be a drop (its keeper
    /// retires it and the pool refills elsewhere), which disturbs no tenant's sandbox and
    /// copies nothing, so a plan prefers it where it levels as well (see `shed_from`).
    pub droppable: bool,
}

/// A sandbox's moves that failed in a row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedMoves {
    pub count: u32,
    pub last_at_ms: u64,
}

/// The first wait after a failed move; each further failure doubles it, up to [`RETRY_MAX_MS`].
pub const RETRY_FIRST_MS: u64 = 30_000;
/// The longest wait between tries of a sandbox whose moves keep failing.
pub const RETRY_MAX_MS: u64 = 30 * 60_000;

impl FailedMoves {
    /// When it may be planned again.
    pub fn retry_at_ms(&self) -> u64 {
        let doublings = self.count.saturating_sub(1).min(16);
        let wait = RETRY_FIRST_MS.saturating_mul(1 << doublings).min(RETRY_MAX_MS);
        self.last_at_ms.saturating_add(wait)
    }
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
    /// Placement's CPU over-commit R: a target's allocation is judged by the same rule, with
    /// the same R, as placement's (see [`common::fit`]).
    pub cpu_overcommit: f64,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            threshold: 0.1,
            target: 0.05,
            cooldown_ms: 5 * 60 * 1000,
            max_moves: 1000,
            cpu_overcommit: fit::DEFAULT_CPU_OVERCOMMIT,
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
    /// Its last move failed, and it waits out its backoff.
    RecentlyFailed,
}

/// Why `c` may not move at `now_ms`, if it may not; `cooldown_ms` when the cooldown after a
/// move applies (a drain ignores it: a node that must empty cannot wait).
pub(crate) fn skip_reason(c: &Candidate, now_ms: u64, cooldown_ms: Option<u64>) -> Option<Skip> {
    if c.failed.as_ref().is_some_and(|f| now_ms < f.retry_at_ms()) {
        Some(Skip::RecentlyFailed)
    } else if c.memory_bytes == 0 {
        Some(Skip::UnknownMemoryEstimate)
    } else if c.lifecycle_owned {
        Some(Skip::LifecycleOwned)
    } else if !c.movable {
        Some(Skip::NotMovable)
    } else if cooldown_ms.is_some_and(|span| c.last_moved_ms.is_some_and(|at| now_ms.saturating_sub(at) < span)) {
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
            Skip::RecentlyFailed => "RecentlyFailed",
        }
    }
}
