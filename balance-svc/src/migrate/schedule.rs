//! Which moves of a plan run now. Pure: the executor asks it what may start and tells it what
//! finished; the convergence benchmark drives the same type with simulated durations, so the
//! time it reports is the time this schedule takes.
//!
//! Two limits. `concurrency` bounds the moves in flight in all: each holds a snapshot stream and
//! a paused sandbox, and the executor is one process. `per_node` bounds the moves a node takes
//! part in at once, as source or target: a move reads a snapshot off its source's disk and
//! writes it onto its target's, and a node that serves many at once slows every one of them
//! (and its own sandboxes). Within both limits moves start in plan order, which puts the
//! nodes furthest from the band first; a move whose nodes are busy waits while later moves
//! between idle nodes go ahead.

use std::collections::HashMap;

/// How many moves may run at once, in all and per node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    pub concurrency: usize,
    pub per_node: usize,
}

impl Budget {
    /// The defaults, sized with `bench balance-convergence` (its `concurrency` rows): a 5 %
    /// skew of 1,000 nodes (about 900 moves) gets under the threshold in about a minute at the
    /// measured per-move time, while no node is in more than one move at a time.
    pub const DEFAULT: Budget = Budget {
        concurrency: 16,
        per_node: 1,
    };

    /// One move at a time (tests and benchmarks that drive a single move).
    pub const SERIAL: Budget = Budget {
        concurrency: 1,
        per_node: 1,
    };
}

impl Default for Budget {
    fn default() -> Self {
        Budget::DEFAULT
    }
}

/// The moves of one plan, waiting or running.
#[derive(Debug)]
pub struct Schedule {
    budget: Budget,
    /// Each move's (source, target), by its index in the plan.
    ends: HashMap<usize, (String, String)>,
    /// Indices not started yet, in plan order.
    waiting: Vec<usize>,
    running: usize,
    busy: HashMap<String, usize>,
}

impl Schedule {
    /// `moves`: (index in the plan, source node, target node) of each move to run, in plan
    /// order. Limits below 1 count as 1, so every move can always run on its own.
    pub fn new(budget: Budget, moves: impl IntoIterator<Item = (usize, String, String)>) -> Self {
        let mut ends = HashMap::new();
        let mut waiting = Vec::new();
        for (index, from, to) in moves {
            waiting.push(index);
            ends.insert(index, (from, to));
        }
        Schedule {
            budget: Budget {
                concurrency: budget.concurrency.max(1),
                per_node: budget.per_node.max(1),
            },
            ends,
            waiting,
            running: 0,
            busy: HashMap::new(),
        }
    }

    fn free(&self, node: &str) -> bool {
        self.busy.get(node).copied().unwrap_or(0) < self.budget.per_node
    }

    /// The moves that may start now, marked as running, in plan order.
    pub fn start(&mut self) -> Vec<usize> {
        let mut started = Vec::new();
        let mut i = 0;
        while i < self.waiting.len() && self.running < self.budget.concurrency {
            let index = self.waiting[i];
            let (from, to) = &self.ends[&index];
            if self.free(from) && (from == to || self.free(to)) {
                let (from, to) = (from.clone(), to.clone());
                *self.busy.entry(from.clone()).or_default() += 1;
                if to != from {
                    *self.busy.entry(to).or_default() += 1;
                }
                self.running += 1;
                self.waiting.remove(i);
                started.push(index);
            } else {
                i += 1;
            }
        }
        started
    }

    /// Move `index` (started earlier) has finished, whatever its outcome.
    pub fn finish(&mut self, index: usize) {
        let Some((from, to)) = self.ends.get(&index) else {
            return;
        };
        let nodes = if from == to { vec![from] } else { vec![from, to] };
        for node in nodes {
            if let Some(n) = self.busy.get_mut(node) {
                *n = n.saturating_sub(1);
            }
        }
        self.running = self.running.saturating_sub(1);
    }

    /// Stops starting moves: those not started stay unstarted (a fenced executor must not act).
    pub fn stop(&mut self) {
        self.waiting.clear();
    }

    /// Nothing waits and nothing runs.
    pub fn is_done(&self) -> bool {
        self.waiting.is_empty() && self.running == 0
    }
}

/// When each move finishes if every move takes `duration_ms` and they run as [`Schedule`]
/// lets them, starting at 0: (index, finish time in ms), in finishing order.
pub fn simulate(budget: Budget, moves: &[(usize, String, String)], duration_ms: f64) -> Vec<(usize, f64)> {
    let mut schedule = Schedule::new(budget, moves.iter().cloned());
    let mut running: Vec<(f64, usize)> = Vec::new();
    let mut finished = Vec::with_capacity(moves.len());
    let mut now = 0.0;
    loop {
        for index in schedule.start() {
            running.push((now + duration_ms, index));
        }
        // The earliest to finish (ties in plan order); few run at once, so a scan is enough.
        let Some(next) = running
            .iter()
            .enumerate()
            .min_by(|a, b| a.1 .0.total_cmp(&b.1 .0).then(a.1 .1.cmp(&b.1 .1)))
            .map(|(k, _)| k)
        else {
            break;
        };
        let (at, index) = running.swap_remove(next);
        now = at;
        schedule.finish(index);
        finished.push((index, at));
    }
    finished
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moves(pairs: &[(&str, &str)]) -> Vec<(usize, String, String)> {
        pairs
            .iter()
            .enumerate()
            .map(|(i, (a, b))| (i, a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn a_busy_node_makes_its_moves_wait_while_others_go_ahead() {
        let plan = moves(&[("a", "x"), ("a", "y"), ("b", "x"), ("c", "z")]);
        let mut s = Schedule::new(
            Budget {
                concurrency: 8,
                per_node: 1,
            },
            plan,
        );
        assert_eq!(s.start(), vec![0, 3], "a and x are busy with move 0");
        assert_eq!(s.start(), Vec::<usize>::new());
        s.finish(0);
        assert_eq!(s.start(), vec![1, 2]);
        s.finish(1);
        s.finish(2);
        s.finish(3);
        assert!(s.is_done());
    }

    #[test]
    fn concurrency_caps_moves_in_flight_and_stop_starts_nothing_more() {
        let plan = moves(&[("a", "b"), ("c", "d"), ("e", "f"), ("g", "h")]);
        let mut s = Schedule::new(
            Budget {
                concurrency: 2,
                per_node: 4,
            },
            plan,
        );
        assert_eq!(s.start(), vec![0, 1]);
        s.finish(1);
        assert_eq!(s.start(), vec![2]);
        s.stop();
        s.finish(0);
        s.finish(2);
        assert_eq!(s.start(), Vec::<usize>::new());
        assert!(s.is_done());
    }

    #[test]
    fn simulated_time_is_the_schedules_makespan() {
        // Node "a" sheds four sandboxes, one at a time: 4 durations whatever the concurrency.
        let plan = moves(&[("a", "w"), ("a", "x"), ("a", "y"), ("a", "z")]);
        let done = simulate(Budget::DEFAULT, &plan, 500.0);
        assert_eq!(done.last().map(|d| d.1), Some(2000.0));
        // Four disjoint pairs with two at a time: 2 durations.
        let plan = moves(&[("a", "b"), ("c", "d"), ("e", "f"), ("g", "h")]);
        let two = Budget {
            concurrency: 2,
            per_node: 1,
        };
        let done = simulate(two, &plan, 500.0);
        assert_eq!(
            done.iter().map(|d| d.1).collect::<Vec<_>>(),
            vec![500.0, 500.0, 1000.0, 1000.0]
        );
    }
}
