//! The fewest moves that bring the spread within `target`, by exhaustive search, for clusters
//! small enough to search (at most [`MAX_NODES`] ready nodes and [`MAX_MOVABLE`] movable
//! sandboxes). The planner falls back to it on such clusters when levelling misses a
//! combination; tests and the benchmark use it to measure how far plans are from the optimum.
//!
//! The moves follow the planner's rules: only sandboxes on ready nodes that may move now
//! (see [`Skip`](super::model::Skip)), each at most once, onto ready nodes that are not draining,
//! in an order where every move fits its target when it runs: its measured memory, and its ask
//! under placement's allocation rule ([`common::fit`]). `max_moves` is not applied.
//!
//! The search deepens the number of moves k = 1, 2, …: it assigns each sandbox, largest
//! first, to its node or another, with at most k moved, and prunes a branch when the bytes the
//! remaining moves could still carry in or out cannot bring every node into one band
//! `target` wide. A complete assignment counts only if some order of its moves fits
//! (a search over subsets of moves already made).

use std::collections::HashMap;

use common::docs::Capacity;
use common::fit::{self, Allocation};

use super::model::{skip_reason, Move, Snapshot, Tuning};

/// Most ready nodes searched.
pub const MAX_NODES: usize = 6;
/// Most movable sandboxes searched.
pub const MAX_MOVABLE: usize = 12;
/// Search steps [`optimum`] allows.
pub const BUDGET: u64 = 50_000_000;
/// Search steps the planner allows itself.
pub const PLAN_BUDGET: u64 = 1_000_000;

/// The outcome of a search.
#[derive(Clone, Debug, PartialEq)]
pub enum Optimum {
    /// The fewest moves, in an order where each fits (empty when the spread is already within
    /// `target`).
    Reachable(Vec<Move>),
    /// No allowed moves bring the spread within `target`.
    Unreachable,
    /// Too large to search, or the search ran out of steps.
    Unknown,
}

/// [`search`] with [`BUDGET`] steps.
pub fn optimum(snapshot: &Snapshot, tuning: &Tuning) -> Optimum {
    search(snapshot, tuning, BUDGET)
}

/// The fewest moves, searching at most `budget` steps.
pub fn search(snapshot: &Snapshot, tuning: &Tuning, budget: u64) -> Optimum {
    let ready: Vec<_> = snapshot.nodes.iter().filter(|n| n.ready).collect();
    if ready.len() > MAX_NODES {
        return Optimum::Unknown;
    }
    let index: HashMap<&str, usize> = ready.iter().enumerate().map(|(i, n)| (n.node_id.as_str(), i)).collect();
    let mut pieces: Vec<(i64, usize, &str, Capacity)> = snapshot
        .sandboxes
        .iter()
        .filter(|c| skip_reason(c, snapshot.now_ms, Some(tuning.cooldown_ms)).is_none())
        .filter_map(|c| {
            let home = *index.get(c.node_id.as_str())?;
            Some((c.memory_bytes as i64, home, c.sandbox_id.as_str(), c.requested))
        })
        .collect();
    if pieces.len() > MAX_MOVABLE {
        return Optimum::Unknown;
    }
    pieces.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.2.cmp(b.2)));
    let mut search = Search {
        capacity: ready.iter().map(|n| n.capacity_bytes.max(1) as f64).collect(),
        target_ok: ready.iter().map(|n| !n.draining).collect(),
        initial: ready.iter().map(|n| n.available_bytes as i64).collect(),
        available: ready.iter().map(|n| n.available_bytes as i64).collect(),
        resources: ready.iter().map(|n| n.resources()).collect(),
        allocated: ready.iter().map(|n| n.allocated).collect(),
        cpu_overcommit: tuning.cpu_overcommit,
        dest: pieces.iter().map(|p| p.1).collect(),
        asks: pieces.iter().map(|p| p.3).collect(),
        pieces: pieces.iter().map(|p| (p.0, p.1)).collect(),
        target: tuning.target,
        spent: 0,
        budget,
    };
    if search.within_target() {
        return Optimum::Reachable(Vec::new());
    }
    for k in 1..=pieces.len() {
        match search.assign(0, 0, k) {
            Err(OutOfSteps) => return Optimum::Unknown,
            Ok(Some(order)) => {
                return Optimum::Reachable(
                    order
                        .into_iter()
                        .map(|(p, to)| Move {
                            sandbox_id: pieces[p].2.to_string(),
                            from: ready[pieces[p].1].node_id.clone(),
                            to: ready[to].node_id.clone(),
                            memory_bytes: pieces[p].0 as u64,
                        })
                        .collect(),
                );
            }
            Ok(None) => {}
        }
    }
    Optimum::Unreachable
}

struct OutOfSteps;

struct Search {
    capacity: Vec<f64>,
    target_ok: Vec<bool>,
    initial: Vec<i64>,
    /// Available bytes with the sandboxes assigned so far at their destinations.
    available: Vec<i64>,
    /// (bytes, home node), largest first.
    pieces: Vec<(i64, usize)>,
    /// Each sandbox's destination (its home while unassigned or staying).
    dest: Vec<usize>,
    /// Each sandbox's ask, and each node's resources and initial allocation (placement's rule).
    asks: Vec<Capacity>,
    resources: Vec<Capacity>,
    allocated: Vec<Allocation>,
    cpu_overcommit: f64,
    target: f64,
    spent: u64,
    budget: u64,
}

impl Search {
    fn step(&mut self) -> Result<(), OutOfSteps> {
        self.spent += 1;
        if self.spent > self.budget {
            Err(OutOfSteps)
        } else {
            Ok(())
        }
    }

    /// The spread as [`super::model::spread`] computes it, within `target`, with no node overfull.
    fn within_target(&self) -> bool {
        if self.available.iter().any(|&a| a < 0) {
            return false;
        }
        let ratios = self.available.iter().zip(&self.capacity).map(|(&a, &c)| a as f64 / c);
        let (lo, hi) = ratios.fold((f64::MAX, f64::MIN), |(lo, hi), r| (lo.min(r), hi.max(r)));
        hi - lo <= self.target
    }

    /// Whether sandboxes `i..` (all at home), at most `moves` of them moving, could still bring
    /// every node into one band `target` wide.
    fn may_reach(&self, i: usize, moves: usize) -> bool {
        let (mut highest_low, mut lowest_high) = (f64::MIN, f64::MAX);
        for (j, &cap) in self.capacity.iter().enumerate() {
            let out: i64 = self.pieces[i..]
                .iter()
                .filter(|p| p.1 == j)
                .take(moves)
                .map(|p| p.0)
                .sum();
            let into: i64 = if self.target_ok[j] {
                self.pieces[i..]
                    .iter()
                    .filter(|p| p.1 != j)
                    .take(moves)
                    .map(|p| p.0)
                    .sum()
            } else {
                0
            };
            let high = self.available[j] + out;
            if high < 0 {
                return false;
            }
            let low = (self.available[j] - into).max(0);
            highest_low = highest_low.max(low as f64 / cap);
            lowest_high = lowest_high.min(high as f64 / cap);
        }
        highest_low - lowest_high <= self.target + 1e-12
    }

    /// Assigns sandboxes `i..` with `moved` moved so far and at most `k` in all; on success, the
    /// moved sandboxes and their destinations in an order that fits.
    fn assign(&mut self, i: usize, moved: usize, k: usize) -> Result<Option<Vec<(usize, usize)>>, OutOfSteps> {
        self.step()?;
        if moved == k || i == self.pieces.len() {
            if !self.within_target() {
                return Ok(None);
            }
            let moving: Vec<usize> = (0..self.pieces.len())
                .filter(|&p| self.dest[p] != self.pieces[p].1)
                .collect();
            return self.order(&moving);
        }
        if !self.may_reach(i, k - moved) {
            return Ok(None);
        }
        if let Some(order) = self.assign(i + 1, moved, k)? {
            return Ok(Some(order));
        }
        let (bytes, home) = self.pieces[i];
        for j in 0..self.capacity.len() {
            if j == home || !self.target_ok[j] {
                continue;
            }
            self.available[home] += bytes;
            self.available[j] -= bytes;
            self.dest[i] = j;
            let found = self.assign(i + 1, moved + 1, k);
            self.available[home] -= bytes;
            self.available[j] += bytes;
            self.dest[i] = home;
            if let Some(order) = found? {
                return Ok(Some(order));
            }
        }
        Ok(None)
    }

    /// An order of `moving` (sandbox indices, at their destinations) in which each move fits
    /// its target when it runs, if there is one, with each sandbox's destination.
    fn order(&mut self, moving: &[usize]) -> Result<Option<Vec<(usize, usize)>>, OutOfSteps> {
        let mut dead = vec![false; 1 << moving.len()];
        let mut available = self.initial.clone();
        let mut allocated = self.allocated.clone();
        let mut sequence = Vec::with_capacity(moving.len());
        if self.extend(moving, 0, &mut dead, (&mut available, &mut allocated), &mut sequence)? {
            Ok(Some(sequence.into_iter().map(|p| (p, self.dest[p])).collect()))
        } else {
            Ok(None)
        }
    }

    fn extend(
        &mut self,
        moving: &[usize],
        done: usize,
        dead: &mut [bool],
        (available, allocated): (&mut [i64], &mut [Allocation]),
        sequence: &mut Vec<usize>,
    ) -> Result<bool, OutOfSteps> {
        self.step()?;
        if done == (1 << moving.len()) - 1 {
            return Ok(true);
        }
        if dead[done] {
            return Ok(false);
        }
        for (t, &p) in moving.iter().enumerate() {
            let (bytes, home) = self.pieces[p];
            let to = self.dest[p];
            let ask = self.asks[p];
            if done & (1 << t) != 0
                || available[to] < bytes
                || fit::check(&self.resources[to], allocated[to], &ask, self.cpu_overcommit).is_err()
            {
                continue;
            }
            available[to] -= bytes;
            available[home] += bytes;
            allocated[to].add(&ask);
            allocated[home].sub(&ask);
            sequence.push(p);
            if self.extend(
                moving,
                done | (1 << t),
                dead,
                (&mut *available, &mut *allocated),
                sequence,
            )? {
                return Ok(true);
            }
            sequence.pop();
            available[to] += bytes;
            available[home] -= bytes;
            allocated[to].sub(&ask);
            allocated[home].add(&ask);
        }
        dead[done] = true;
        Ok(false)
    }
}
