//! A cluster on a virtual clock, for comparing accounting modes under the same traffic.
//!
//! Seeded and deterministic: the same scenario and seed give the same numbers on any machine,
//! in well under a second. It models what made E2B's placer herd: heartbeats measured at one
//! time and applied at another, create RPCs that take time, sandboxes that end (through a kill
//! the placer hears about, as in this system), and several placer replicas that each keep
//! their own view (stale and optimistic) or share one store (reconciled).
//!
//! The truth it measures against: a node's true allocation is what it runs plus the creates
//! in flight to it. `accounting_error_max` is the largest gap between what a placer believed
//! and that truth, over every node, placer and event.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::core::{Accounting, Expiry, Heartbeat, Listed, NodeView, RankConfig, Ranker, Request, Resources};

/// How creates arrive.
#[derive(Clone, Debug, PartialEq)]
pub enum Arrivals {
    /// `per_sec` evenly spaced creates a second for `duration_ms`.
    Steady { per_sec: u32, duration_ms: u64 },
    /// `count` creates at the same instant.
    Burst { count: u32 },
}

/// One benchmark scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    pub name: &'static str,
    pub nodes: usize,
    pub node_capacity: Resources,
    /// Each node starts with a whole number of vCPUs in this range already allocated (with
    /// 1 GiB per vCPU), held by sandboxes that outlive the run.
    pub initial_vcpus: (u32, u32),
    pub arrivals: Arrivals,
    pub sandbox: Resources,
    /// Lifetimes are uniform in this range (ms).
    pub lifetime_ms: (u64, u64),
    pub heartbeat_interval_ms: u64,
    /// Every node's first periodic heartbeat comes one interval after the start (E2B's
    /// benchmark: each node's ticker starts with the run), or at a random offset within it.
    pub aligned_heartbeats: bool,
    /// Time from a heartbeat's measurement to its arrival at the placers.
    pub heartbeat_delay_ms: u64,
    pub create_rpc_ms: u64,
    /// Placer replicas; requests (and kills) are spread over them.
    pub placers: usize,
    /// Templates the sandboxes start from (0: none): template `i` is asked for with weight
    /// 1/(i+1) (a few popular, many rare); each node starts holding each one's layers with
    /// probability 0.3 and gets them when a sandbox of it is created there.
    pub templates: u32,
    pub seed: u64,
}

const GIB: u64 = 1 << 30;

impl Scenario {
    /// E2B's own placement benchmark: 10 nodes of 192 vCPU, 20 creates/s for 25 s.
    pub fn e2b() -> Self {
        Self {
            name: "e2b",
            nodes: 10,
            node_capacity: Resources {
                vcpus: 192,
                memory_bytes: 512 * GIB,
            },
            initial_vcpus: (0, 4),
            arrivals: Arrivals::Steady {
                per_sec: 20,
                duration_ms: 25_000,
            },
            sandbox: Resources {
                vcpus: 1,
                memory_bytes: GIB,
            },
            lifetime_ms: (60_000, 60_000),
            heartbeat_interval_ms: 20_000,
            aligned_heartbeats: true,
            heartbeat_delay_ms: 0,
            create_rpc_ms: 1,
            placers: 1,
            templates: 0,
            seed: 42,
        }
    }

    /// Every scenario the placement issue names.
    pub fn named(name: &str) -> Option<Self> {
        let e2b = Self::e2b();
        Some(match name {
            "e2b" => e2b,
            "delayed-heartbeat" => Self {
                name: "delayed-heartbeat",
                arrivals: Arrivals::Burst { count: 500 },
                heartbeat_interval_ms: 1_000,
                heartbeat_delay_ms: 300,
                create_rpc_ms: 150,
                ..e2b
            },
            "short-lived" => Self {
                name: "short-lived",
                arrivals: Arrivals::Steady {
                    per_sec: 20,
                    duration_ms: 60_000,
                },
                lifetime_ms: (2_000, 8_000),
                ..e2b
            },
            // Short-lived sandboxes of 30 templates: how often a create lands on a node that
            // must fetch its template's layers first (a cold start).
            "templates" => Self {
                name: "templates",
                arrivals: Arrivals::Steady {
                    per_sec: 20,
                    duration_ms: 60_000,
                },
                lifetime_ms: (2_000, 8_000),
                heartbeat_interval_ms: 2_000,
                aligned_heartbeats: false,
                templates: 30,
                ..e2b
            },
            "replicas3" => Self {
                name: "replicas3",
                placers: 3,
                ..e2b
            },
            // E2B's benchmark as first configured: no heartbeat lands during the run, so it
            // measures a world without heartbeats. Kept to show which world their
            // reported stale figures match.
            "e2b-no-heartbeat" => Self {
                name: "e2b-no-heartbeat",
                heartbeat_interval_ms: 60_000,
                ..e2b
            },
            _ => return None,
        })
    }

    pub const NAMES: [&'static str; 6] = [
        "e2b",
        "delayed-heartbeat",
        "short-lived",
        "templates",
        "replicas3",
        "e2b-no-heartbeat",
    ];
}

/// What one accounting mode achieved in a scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct ModeResult {
    /// Coefficient of variation of sandboxes per node (everything a node runs or is creating,
    /// pre-existing sandboxes included) the moment the last create has landed: E2B's figure.
    pub cv: f64,
    /// The same coefficient averaged over one sample a second while creates arrive. With
    /// short-lived sandboxes the instant figure mostly says which sandboxes happened to end
    /// last (across seeds it moves by a factor of two); the average is the steady state.
    pub cv_mean: f64,
    /// Sandboxes on the busiest and the idlest node at that moment.
    pub max: u32,
    pub min: u32,
    /// Coefficient of variation of the number of creates each node received over the run.
    pub placed_cv: f64,
    pub placed: u32,
    pub rejected: u32,
    /// Largest |believed - true| allocation, in vCPU.
    pub accounting_error_max: f64,
    /// Coefficient of variation of the true vCPU allocation per node (pre-existing load
    /// included), averaged over one sample a second while creates arrive: how even the load
    /// is, which with short-lived sandboxes and uneven starting load is not the same as how
    /// even the placement counts are.
    pub load_cv: f64,
    /// Creates placed on a node that did not hold their template's layers (scenarios with
    /// templates).
    pub cold_starts: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival {
        n: u32,
    },
    CreateDone {
        sandbox: u32,
        node: usize,
        placer: usize,
        template: Option<u32>,
    },
    Kill {
        sandbox: u32,
        node: usize,
    },
    Measure {
        node: usize,
    },
    Sample,
    Final,
    Arrive {
        node: usize,
        snapshot: usize,
    },
}

/// The real state of one node.
#[derive(Default)]
struct TrueNode {
    running: BTreeMap<String, Resources>,
    /// Measured CPU use of each running sandbox, in vCPU: what a heartbeat's usage term sums.
    usage: HashMap<String, f64>,
    in_flight: HashMap<u32, Resources>,
    seq: u64,
    /// Templates whose layers the node holds.
    templates: std::collections::BTreeSet<String>,
}

impl TrueNode {
    fn allocated_vcpus(&self) -> i64 {
        let running: u32 = self.running.values().map(|r| r.vcpus).sum();
        let flying: u32 = self.in_flight.values().map(|r| r.vcpus).sum();
        i64::from(running + flying)
    }
}

struct Sim<'a> {
    scenario: &'a Scenario,
    mode: Accounting,
    ranker: Ranker,
    expiry: Expiry,
    rng: SmallRng,
    now: u64,
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    tick: u64,
    truth: Vec<TrueNode>,
    /// One view per placer (stale, optimistic) or one shared view (reconciled).
    views: Vec<Vec<NodeView>>,
    snapshots: Vec<Heartbeat>,
    placed_on: Vec<u32>,
    rejected: u32,
    error_max: i64,
    stop_heartbeats_at: u64,
    cold_starts: u32,
    load_cvs: Vec<f64>,
    count_cvs: Vec<f64>,
    final_counts: Vec<u32>,
}

impl Sim<'_> {
    fn at(&mut self, time: u64, event: Event) {
        self.tick += 1;
        self.queue.push(Reverse((time, self.tick, event)));
    }

    fn heartbeat(&mut self, node: usize) -> Heartbeat {
        let t = &mut self.truth[node];
        t.seq += 1;
        let cap = self.scenario.node_capacity;
        let vcpus: u32 = t.running.values().map(|r| r.vcpus).sum();
        let memory: u64 = t.running.values().map(|r| r.memory_bytes).sum();
        Heartbeat {
            node_id: format!("node-{node:02}"),
            boot_id: "boot-1".to_string(),
            seq: t.seq,
            capacity: cap,
            allocated: Resources {
                vcpus,
                memory_bytes: memory,
            },
            memory_used_bytes: memory / 2,
            cpu_usage: t.usage.values().sum(),
            templates: t.templates.iter().cloned().collect(),
            sandboxes: t
                .running
                .iter()
                .map(|(id, r)| Listed {
                    sandbox_id: id.clone(),
                    allocated: *r,
                    memory_used_bytes: r.memory_bytes / 2,
                })
                .collect(),
            ..Heartbeat::default()
        }
    }

    fn apply(&mut self, node: usize, hb: &Heartbeat) {
        for view in &mut self.views {
            view[node].apply_heartbeat(self.mode, hb, self.now, self.expiry);
        }
    }

    /// Sandboxes per node: running, and being created.
    fn counts(&self) -> Vec<u32> {
        self.truth
            .iter()
            .map(|t| (t.running.len() + t.in_flight.len()) as u32)
            .collect()
    }

    fn view_index(&self, placer: usize) -> usize {
        placer % self.views.len()
    }

    fn measure_error(&mut self) {
        for view in &self.views {
            for (node, v) in view.iter().enumerate() {
                let err = (v.believed().vcpus - self.truth[node].allocated_vcpus()).abs();
                self.error_max = self.error_max.max(err);
            }
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Arrival { n } => {
                let placer = n as usize % self.scenario.placers;
                let vi = self.view_index(placer);
                let template =
                    (self.scenario.templates > 0).then(|| pick_template(&mut self.rng, self.scenario.templates));
                let req = Request {
                    sandbox_id: format!("sbx-{n:06}"),
                    resources: self.scenario.sandbox,
                    template: template.map(template_id).unwrap_or_default(),
                    ..Request::default()
                };
                let decision = self.ranker.decide(&self.views[vi], &req, self.now, &mut self.rng);
                match decision.chosen {
                    None => self.rejected += 1,
                    Some((node, _)) => {
                        self.views[vi][node].reserve(self.mode, &req.sandbox_id, req.resources, self.now);
                        self.truth[node].in_flight.insert(n, req.resources);
                        self.placed_on[node] += 1;
                        if template.is_some() && !self.truth[node].templates.contains(&req.template) {
                            self.cold_starts += 1;
                        }
                        let done = self.now + self.scenario.create_rpc_ms;
                        self.at(
                            done,
                            Event::CreateDone {
                                sandbox: n,
                                node,
                                placer,
                                template,
                            },
                        );
                    }
                }
            }
            Event::CreateDone {
                sandbox,
                node,
                placer,
                template,
            } => {
                let id = format!("sbx-{sandbox:06}");
                if let Some(t) = template {
                    self.truth[node].templates.insert(template_id(t));
                }
                if let Some(r) = self.truth[node].in_flight.remove(&sandbox) {
                    let busy = f64::from(r.vcpus) * self.rng.random::<f64>();
                    self.truth[node].usage.insert(id.clone(), busy);
                    self.truth[node].running.insert(id.clone(), r);
                }
                let vi = self.view_index(placer);
                self.views[vi][node].created(self.mode, &id);
                let (lo, hi) = self.scenario.lifetime_ms;
                let life = self.rng.random_range(lo..=hi);
                self.at(self.now + life, Event::Kill { sandbox, node });
            }
            Event::Kill { sandbox, node } => {
                let id = format!("sbx-{sandbox:06}");
                let held = self.truth[node].running.remove(&id).unwrap_or_default();
                self.truth[node].usage.remove(&id);
                // The kill goes through whichever replica the user's request reached.
                let placer = self.rng.random_range(0..self.scenario.placers);
                let vi = self.view_index(placer);
                self.views[vi][node].removed(self.mode, &id, held);
            }
            Event::Measure { node } => {
                let hb = self.heartbeat(node);
                self.snapshots.push(hb);
                let snapshot = self.snapshots.len() - 1;
                self.at(
                    self.now + self.scenario.heartbeat_delay_ms,
                    Event::Arrive { node, snapshot },
                );
                let next = self.now + self.scenario.heartbeat_interval_ms;
                if next <= self.stop_heartbeats_at {
                    self.at(next, Event::Measure { node });
                }
            }
            Event::Sample => {
                let loads: Vec<f64> = self.truth.iter().map(|t| t.allocated_vcpus() as f64).collect();
                self.load_cvs.push(cv(&loads));
                let counts: Vec<f64> = self.counts().into_iter().map(f64::from).collect();
                self.count_cvs.push(cv(&counts));
            }
            Event::Final => self.final_counts = self.counts(),
            Event::Arrive { node, snapshot } => {
                let hb = self.snapshots[snapshot].clone();
                self.apply(node, &hb);
            }
        }
    }
}

/// Runs `scenario` with one accounting mode.
pub fn run(scenario: &Scenario, mode: Accounting, rank: &RankConfig) -> ModeResult {
    let mut rng = SmallRng::seed_from_u64(scenario.seed);
    let shared = mode == Accounting::Reconciled;
    let views_count = if shared { 1 } else { scenario.placers.max(1) };
    let mut rank = rank.clone();
    // A node is unhealthy only after several heartbeats are missed.
    rank.unhealthy_after_ms = 3 * scenario.heartbeat_interval_ms + scenario.heartbeat_delay_ms;
    let arrivals_end = match scenario.arrivals {
        Arrivals::Steady { duration_ms, .. } => duration_ms,
        Arrivals::Burst { .. } => 0,
    };
    let mut sim = Sim {
        scenario,
        mode,
        ranker: Ranker::new(&rank),
        expiry: Expiry::DEFAULT,
        rng: SmallRng::seed_from_u64(scenario.seed ^ 0x5eed),
        now: 0,
        queue: BinaryHeap::new(),
        tick: 0,
        truth: (0..scenario.nodes).map(|_| TrueNode::default()).collect(),
        views: vec![
            (0..scenario.nodes)
                .map(|i| NodeView::new(format!("node-{i:02}")))
                .collect();
            views_count
        ],
        snapshots: Vec::new(),
        placed_on: vec![0; scenario.nodes],
        rejected: 0,
        error_max: 0,
        cold_starts: 0,
        load_cvs: Vec::new(),
        count_cvs: Vec::new(),
        final_counts: Vec::new(),
        stop_heartbeats_at: arrivals_end
            + scenario.create_rpc_ms
            + scenario.lifetime_ms.1
            + 2 * scenario.heartbeat_interval_ms,
    };
    // Pre-existing load, and a first heartbeat from every node at time 0 (registration).
    let (lo, hi) = scenario.initial_vcpus;
    for node in 0..scenario.nodes {
        let vcpus = rng.random_range(lo..=hi);
        for i in 0..vcpus {
            let r = Resources {
                vcpus: 1,
                memory_bytes: GIB,
            };
            let id = format!("bg-{node:02}-{i}");
            sim.truth[node].usage.insert(id.clone(), rng.random::<f64>());
            sim.truth[node].running.insert(id, r);
        }
        for t in 0..scenario.templates {
            if rng.random_bool(0.3) {
                sim.truth[node].templates.insert(template_id(t));
            }
        }
        let hb = sim.heartbeat(node);
        sim.apply(node, &hb);
        let phase = if scenario.aligned_heartbeats {
            scenario.heartbeat_interval_ms
        } else {
            rng.random_range(1..=scenario.heartbeat_interval_ms)
        };
        sim.at(phase, Event::Measure { node });
    }
    match scenario.arrivals {
        Arrivals::Steady { per_sec, duration_ms } => {
            let count = u64::from(per_sec) * duration_ms / 1_000;
            for n in 0..count {
                let t = 1 + n * 1_000 / u64::from(per_sec.max(1));
                sim.at(t, Event::Arrival { n: n as u32 });
            }
        }
        Arrivals::Burst { count } => {
            for n in 0..count {
                sim.at(1, Event::Arrival { n });
            }
        }
    }
    sim.at(arrivals_end + scenario.create_rpc_ms + 1, Event::Final);
    for second in 1..=(arrivals_end / 1_000).max(1) {
        sim.at(second * 1_000, Event::Sample);
    }
    while let Some(Reverse((time, _, event))) = sim.queue.pop() {
        sim.now = time;
        sim.handle(event);
        sim.measure_error();
    }
    let placed: Vec<f64> = sim.placed_on.iter().map(|&c| f64::from(c)).collect();
    let counts: Vec<f64> = sim.final_counts.iter().map(|&c| f64::from(c)).collect();
    ModeResult {
        cv: cv(&counts),
        cv_mean: mean(&sim.count_cvs),
        max: sim.final_counts.iter().copied().max().unwrap_or(0),
        min: sim.final_counts.iter().copied().min().unwrap_or(0),
        placed_cv: cv(&placed),
        placed: sim.placed_on.iter().sum(),
        rejected: sim.rejected,
        accounting_error_max: sim.error_max as f64,
        load_cv: mean(&sim.load_cvs),
        cold_starts: sim.cold_starts,
    }
}

fn template_id(t: u32) -> String {
    format!("tpl-{t:02}")
}

/// Template `i` of `n` with weight 1/(i+1).
fn pick_template(rng: &mut SmallRng, n: u32) -> u32 {
    let total: f64 = (1..=n).map(|i| 1.0 / f64::from(i)).sum();
    let mut at = rng.random::<f64>() * total;
    for i in 0..n {
        at -= 1.0 / f64::from(i + 1);
        if at <= 0.0 {
            return i;
        }
    }
    n - 1
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// Coefficient of variation (population standard deviation over mean).
fn cv(values: &[f64]) -> f64 {
    let n = values.len().max(1) as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    if mean > 0.0 {
        var.sqrt() / mean
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciled_is_exact_and_spreads_in_every_scenario() {
        // `templates` is about cold starts, not accounting: its own test below.
        for name in Scenario::NAMES.into_iter().filter(|n| *n != "templates") {
            let scenario = Scenario::named(name).unwrap();
            let r = run(&scenario, Accounting::Reconciled, &RankConfig::default());
            let stale = run(&scenario, Accounting::Stale, &RankConfig::default());
            assert_eq!(r.accounting_error_max, 0.0, "{name}: {r:?}");
            assert_eq!(r.rejected, 0, "{name}: {r:?}");
            assert!(r.cv * 4.0 < stale.cv, "{name}: reconciled {r:?} vs stale {stale:?}");
            // Short-lived sandboxes leave ~12 per node at any moment, where Best-of-3's own
            // sampling noise is ~0.08 even with exact accounting (see the next test);
            // everywhere else the spread must be tight.
            if name != "short-lived" {
                assert!(r.cv <= 0.02, "{name}: {r:?}");
            }
        }
    }

    #[test]
    fn the_template_term_cuts_cold_starts_without_herding() {
        let scenario = Scenario::named("templates").unwrap();
        let with = run(&scenario, Accounting::Reconciled, &RankConfig::default());
        let without = run(
            &scenario,
            Accounting::Reconciled,
            &RankConfig {
                template_weight: 0.0,
                ..RankConfig::default()
            },
        );
        assert_eq!((with.rejected, with.accounting_error_max), (0, 0.0), "{with:?}");
        // A quarter fewer cold starts at least (measured: 38 %), the spread within 1.5× of
        // placing blind to templates (measured: 1.24×).
        assert!(
            with.cold_starts * 4 < without.cold_starts * 3,
            "{with:?} vs {without:?}"
        );
        assert!(with.cv_mean <= 1.5 * without.cv_mean, "{with:?} vs {without:?}");
    }

    #[test]
    fn with_short_lived_sandboxes_the_spread_is_set_by_k_not_by_accounting() {
        let scenario = Scenario::named("short-lived").unwrap();
        let with_k = |k: usize| {
            let rank = RankConfig {
                k,
                ..RankConfig::default()
            };
            run(&scenario, Accounting::Reconciled, &rank)
        };
        let (two, three, all) = (with_k(2), with_k(3), with_k(scenario.nodes));
        assert!(
            all.cv_mean < three.cv_mean && three.cv_mean < two.cv_mean,
            "{two:?} {three:?} {all:?}"
        );
        // Exact knowledge of every node is what reaches 0.05; Best-of-3 stays within 2x of it.
        assert!(all.cv_mean <= 0.05, "{all:?}");
        assert!(three.cv_mean <= 2.0 * all.cv_mean, "{three:?} vs {all:?}");
        // Optimistic accounting is exact here too (every sandbox ends through a kill the placer
        // hears about, no heartbeat lags a create): the two agree.
        assert_eq!(
            run(&scenario, Accounting::Optimistic, &RankConfig::default()).cv_mean,
            three.cv_mean
        );
    }

    #[test]
    fn stale_accounting_herds_on_e2b_traffic() {
        let r = run(&Scenario::e2b(), Accounting::Stale, &RankConfig::default());
        assert!(r.cv > 0.5, "{r:?}");
    }

    #[test]
    fn without_a_heartbeat_during_the_run_stale_herds_as_e2b_reported() {
        // E2B: CV about 1.1, busiest 120, idlest 2. A heartbeat at 20 s (the e2b scenario)
        // rebalances part of the run; none at all reproduces their figure.
        let scenario = Scenario::named("e2b-no-heartbeat").unwrap();
        let r = run(&scenario, Accounting::Stale, &RankConfig::default());
        assert!(r.cv > 0.9 && r.min <= 5, "{r:?}");
        let synced = run(&Scenario::e2b(), Accounting::Stale, &RankConfig::default());
        assert!(synced.cv < r.cv, "{synced:?} vs {r:?}");
    }

    #[test]
    fn the_same_seed_gives_the_same_result() {
        let a = run(&Scenario::e2b(), Accounting::Optimistic, &RankConfig::default());
        let b = run(&Scenario::e2b(), Accounting::Optimistic, &RankConfig::default());
        assert_eq!(a, b);
    }
}
