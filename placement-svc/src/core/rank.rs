//! Choosing a node, as a chain of small pieces (the shape of Nomad's scheduler stack):
//! a sampler proposes candidates, feasibility checks filter them, scorers rank the survivors,
//! and the lowest score wins. Each check and each score term is one small type; adding a term
//! means one more `impl Scorer` and one line in [`Ranker::new`].

use std::collections::{BTreeMap, HashSet};

use common::fit;
use rand::Rng;

use super::account::{AdminState, NodeView, Resources};
use super::sample::sample_distinct;

/// What a sandbox needs from a node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    pub sandbox_id: String,
    pub resources: Resources,
    /// Labels a node must carry.
    pub selector: BTreeMap<String, String>,
    /// Nodes not to use for this request (a create there failed).
    pub exclude: HashSet<String>,
    /// Only this node (a balancer move's target): the same checks, no sampling.
    pub only: Option<String>,
    /// The template build the sandbox starts from (empty: none with layers).
    pub template: String,
    /// The nodes' pooled sandboxes' room counts as free: the caller retires what
    /// [`reclaim`] says on the chosen node before it starts the sandbox.
    pub reclaim_pooled: bool,
}

/// Tunables of the decision.
#[derive(Clone, Debug, PartialEq)]
pub struct RankConfig {
    /// Candidates sampled per decision (Best-of-K).
    pub k: usize,
    /// CPU over-commit ratio R: a node may hold R × its vCPUs in allocations.
    pub overcommit: f64,
    /// Weight of measured CPU usage in the CPU term (E2B's alpha).
    pub alpha: f64,
    pub cpu_weight: f64,
    pub memory_weight: f64,
    /// Weight of [`TemplateAffinity`]: how much load a node holding the template's layers may
    /// carry over one that does not and still be preferred.
    pub template_weight: f64,
    /// Most creates in flight per node ("too many starting"): a burst spills over.
    pub max_starting: u32,
    /// A node whose last heartbeat is older than this is unhealthy.
    pub unhealthy_after_ms: u64,
}

impl Default for RankConfig {
    fn default() -> Self {
        Self {
            k: 3,
            overcommit: fit::DEFAULT_CPU_OVERCOMMIT,
            alpha: 0.5,
            cpu_weight: 1.0,
            memory_weight: 1.0,
            template_weight: DEFAULT_TEMPLATE_WEIGHT,
            max_starting: 64,
            unhealthy_after_ms: 6_000,
        }
    }
}

/// A check a node must pass to be considered at all.
pub trait Feasibility: Send + Sync {
    /// Why `node` cannot take `req` now, or `None`.
    fn reject(&self, node: &NodeView, req: &Request, now_ms: u64) -> Option<Rejection>;
}

/// Why a check filtered a node out: a sentence for people, and whether waiting could help.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: String,
    /// The node could not take the ask even empty: no release or heartbeat will change it.
    pub never: bool,
}

impl Rejection {
    /// A rejection that may lift (full, draining, unhealthy, busy now).
    pub fn now(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            never: false,
        }
    }
}

/// A term of the score: lower means a better fit.
pub trait Scorer: Send + Sync {
    fn name(&self) -> &'static str;
    fn score(&self, node: &NodeView, req: &Request) -> f64;
}

/// Not excluded by the request.
pub struct NotExcluded;

impl Feasibility for NotExcluded {
    fn reject(&self, node: &NodeView, req: &Request, _: u64) -> Option<Rejection> {
        req.exclude
            .contains(&node.node_id)
            .then(|| Rejection::now("excluded by the request"))
    }
}

/// Ready: heartbeating recently and not draining.
pub struct Ready {
    pub unhealthy_after_ms: u64,
}

impl Feasibility for Ready {
    fn reject(&self, node: &NodeView, _: &Request, now_ms: u64) -> Option<Rejection> {
        if node.admin == AdminState::Draining {
            return Some(Rejection::now("draining"));
        }
        let age = now_ms.saturating_sub(node.last_heartbeat_ms);
        (node.seq == 0 || age > self.unhealthy_after_ms)
            .then(|| Rejection::now(format!("unhealthy: last heartbeat {age} ms ago")))
    }
}

/// Carries every label the request selects on.
pub struct LabelsMatch;

impl Feasibility for LabelsMatch {
    fn reject(&self, node: &NodeView, req: &Request, _: u64) -> Option<Rejection> {
        req.selector
            .iter()
            .find(|(k, v)| node.labels.get(*k) != Some(*v))
            .map(|(k, v)| Rejection::now(format!("label {k}={v} missing")))
    }
}

/// CPU fits with over-commit R; memory fits without over-commit: [`common::fit`], the rule the
/// balancer also plans its moves with.
pub struct Fits {
    pub overcommit: f64,
}

/// How a reason begins when the ask exceeds the node's whole capacity (a [`Rejection`] that
/// is `never`): for people reading it, and the text placement's Redis script writes too.
pub const TOO_LARGE: &str = "too large for this node";

impl Feasibility for Fits {
    fn reject(&self, node: &NodeView, req: &Request, _: u64) -> Option<Rejection> {
        let empty = fit::Allocation {
            vcpus: 0,
            memory_bytes: 0,
        };
        if let Err(misfit) = fit::check(&node.capacity.into(), empty, &req.resources.into(), self.overcommit) {
            return Some(Rejection {
                reason: format!("{TOO_LARGE}: {misfit}"),
                never: true,
            });
        }
        let allocated = node.allocation(req.reclaim_pooled);
        fit::check(&node.capacity.into(), allocated, &req.resources.into(), self.overcommit)
            .err()
            .map(|misfit| Rejection::now(misfit.to_string()))
    }
}

/// How much of `node`'s pooled sandboxes must go before it can take `req` (nothing unless the
/// request may reclaim them): what placement answers with the node it chose.
pub fn reclaim(node: &NodeView, req: &Request, overcommit: f64) -> Resources {
    if !req.reclaim_pooled {
        return Resources::default();
    }
    let short = fit::shortfall(
        &node.capacity.into(),
        node.allocation(false),
        &req.resources.into(),
        overcommit,
    );
    Resources {
        vcpus: short.vcpus,
        memory_bytes: short.memory_bytes,
    }
}

/// Fewer than `max` creates in flight.
pub struct StartingCap {
    pub max: u32,
}

impl Feasibility for StartingCap {
    fn reject(&self, node: &NodeView, _: &Request, _: u64) -> Option<Rejection> {
        let pending = node.pending();
        (pending >= self.max).then(|| Rejection::now(format!("too many starting: {pending} creates in flight")))
    }
}

/// E2B's CPU score: `(requested + allocated + alpha * usage) / (R * cpus)`.
pub struct CpuLoad {
    pub overcommit: f64,
    pub alpha: f64,
}

impl Scorer for CpuLoad {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn score(&self, node: &NodeView, req: &Request) -> f64 {
        let capacity = f64::from(node.capacity.vcpus.max(1)) * self.overcommit;
        (f64::from(req.resources.vcpus) + node.believed().vcpus as f64 + self.alpha * node.cpu_usage) / capacity
    }
}

/// Memory share after placing: `(requested + allocated) / capacity`. The balancer balances
/// memory; a placer blind to it would keep undoing the balancer's work.
pub struct MemoryLoad;

impl Scorer for MemoryLoad {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn score(&self, node: &NodeView, req: &Request) -> f64 {
        let capacity = node.capacity.memory_bytes.max(1) as f64;
        (req.resources.memory_bytes as f64 + node.believed().memory_bytes as f64) / capacity
    }
}

/// The default weight of [`TemplateAffinity`]: a node with the layers wins among the sampled
/// ones unless it is busier by more than a hundredth of its capacity (CPU and memory shares,
/// summed). Larger weights cut cold starts little more and spread sandboxes worse
/// (`bench placement-distribution --scenario templates`).
pub const DEFAULT_TEMPLATE_WEIGHT: f64 = 0.01;

/// A node without the template's layers must fetch them first (a cold start): 1, else 0. A
/// bounded term, not a filter, so the nodes holding a popular template are preferred only
/// while they are not much busier than others, and cannot be herded onto.
pub struct TemplateAffinity;

impl Scorer for TemplateAffinity {
    fn name(&self) -> &'static str {
        "template"
    }

    fn score(&self, node: &NodeView, req: &Request) -> f64 {
        if req.template.is_empty() || node.templates.contains(&req.template) {
            0.0
        } else {
            1.0
        }
    }
}

/// How one candidate fared.
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluation {
    pub node_id: String,
    /// `Some(reason)` when a check filtered the node out.
    pub rejected: Option<String>,
    /// The node was filtered out for being too small for the ask even empty.
    pub never: bool,
    pub score: f64,
    pub terms: Vec<(&'static str, f64)>,
}

/// The outcome of one decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Index (into the node slice) and score of the winner.
    pub chosen: Option<(usize, f64)>,
    /// Every node looked at, in the order looked at.
    pub evaluated: Vec<Evaluation>,
    /// True when sampling found nothing and every node was scanned.
    pub scanned_all: bool,
}

impl Decision {
    /// Whether the ask can never fit: every node was looked at, and each is too small for it
    /// even empty (not merely full, draining or unhealthy now).
    pub fn never_fits(&self) -> bool {
        self.scanned_all && !self.evaluated.is_empty() && self.evaluated.iter().all(|e| e.rejected.is_some() && e.never)
    }

    /// A one-line account of why nothing fit, grouped by reason.
    pub fn why_nothing_fit(&self) -> String {
        if self.evaluated.is_empty() {
            return "no nodes have registered (no heartbeats yet)".to_string();
        }
        if let [only] = self.evaluated.as_slice() {
            let reason = only.rejected.as_deref().unwrap_or("feasible");
            return format!("node {} cannot take it: {reason}", only.node_id);
        }
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for e in &self.evaluated {
            let reason = e.rejected.as_deref().unwrap_or("feasible");
            // Group "cpu: 770 vCPU would exceed …" with others of its kind.
            let kind = reason.split(':').next().unwrap_or(reason).to_string();
            *counts.entry(kind).or_default() += 1;
        }
        let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
        format!("no node fits ({} nodes: {})", self.evaluated.len(), parts.join(", "))
    }
}

/// The chain: checks, then weighted score terms, then the minimum.
pub struct Ranker {
    checks: Vec<Box<dyn Feasibility>>,
    scorers: Vec<(f64, Box<dyn Scorer>)>,
    k: usize,
    overcommit: f64,
}

impl Ranker {
    pub fn new(config: &RankConfig) -> Self {
        Self {
            checks: vec![
                Box::new(NotExcluded),
                Box::new(Ready {
                    unhealthy_after_ms: config.unhealthy_after_ms,
                }),
                Box::new(LabelsMatch),
                Box::new(Fits {
                    overcommit: config.overcommit,
                }),
                Box::new(StartingCap {
                    max: config.max_starting,
                }),
            ],
            scorers: vec![
                (
                    config.cpu_weight,
                    Box::new(CpuLoad {
                        overcommit: config.overcommit,
                        alpha: config.alpha,
                    }),
                ),
                (config.memory_weight, Box::new(MemoryLoad)),
                (config.template_weight, Box::new(TemplateAffinity)),
            ],
            k: config.k.max(1),
            overcommit: config.overcommit,
        }
    }

    /// The CPU over-commit its fit check allows.
    pub fn overcommit(&self) -> f64 {
        self.overcommit
    }

    /// Checks and scores one node.
    pub fn evaluate(&self, node: &NodeView, req: &Request, now_ms: u64) -> Evaluation {
        let rejection = self.checks.iter().find_map(|c| c.reject(node, req, now_ms));
        let never = rejection.as_ref().is_some_and(|r| r.never);
        let rejected = rejection.map(|r| r.reason);
        let mut terms = Vec::with_capacity(self.scorers.len());
        let mut score = 0.0;
        if rejected.is_none() {
            for (weight, scorer) in &self.scorers {
                if *weight == 0.0 {
                    continue;
                }
                let term = scorer.score(node, req);
                terms.push((scorer.name(), term));
                score += weight * term;
            }
        }
        Evaluation {
            node_id: node.node_id.clone(),
            rejected,
            never,
            score,
            terms,
        }
    }

    /// Best-of-K: samples distinct nodes at random until K feasible ones are found (looking
    /// at no more than 4K, so a decision costs O(K), not O(N)), and takes the lowest score.
    /// Only when the sample holds no feasible node are all nodes scanned, so a full cluster
    /// is told apart from an unlucky sample and the error can say why nothing fit.
    pub fn decide(&self, nodes: &[NodeView], req: &Request, now_ms: u64, rng: &mut impl Rng) -> Decision {
        if let Some(only) = &req.only {
            return self.decide_on(nodes.iter().position(|n| n.node_id == *only), nodes, req, now_ms);
        }
        let mut evaluated = Vec::with_capacity(self.k);
        let mut best: Option<(usize, f64)> = None;
        let mut feasible = 0;
        for i in sample_distinct(nodes.len(), (self.k * 4).min(nodes.len()), rng) {
            let eval = self.evaluate(&nodes[i], req, now_ms);
            if eval.rejected.is_none() {
                feasible += 1;
                if best.is_none_or(|(_, s)| eval.score < s) {
                    best = Some((i, eval.score));
                }
            }
            evaluated.push(eval);
            if feasible == self.k {
                break;
            }
        }
        if best.is_some() || evaluated.len() == nodes.len() {
            // A sample that was every node and found nothing scanned them all.
            let scanned_all = best.is_none();
            return Decision {
                chosen: best,
                evaluated,
                scanned_all,
            };
        }
        // Nothing feasible in the sample: look at every node, then Best-of-K among the
        // feasible ones.
        let all: Vec<Evaluation> = nodes.iter().map(|n| self.evaluate(n, req, now_ms)).collect();
        let fit: Vec<usize> = (0..nodes.len()).filter(|&i| all[i].rejected.is_none()).collect();
        let chosen = sample_distinct(fit.len(), self.k.min(fit.len()), rng)
            .into_iter()
            .map(|j| (fit[j], all[fit[j]].score))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        Decision {
            chosen,
            evaluated: all,
            scanned_all: true,
        }
    }
}

impl Ranker {
    /// The decision for a request pinned to one node (`at`: its index, if placement knows it).
    fn decide_on(&self, at: Option<usize>, nodes: &[NodeView], req: &Request, now_ms: u64) -> Decision {
        let Some(i) = at else {
            return Decision {
                chosen: None,
                evaluated: vec![unknown_node(req.only.as_deref().unwrap_or_default())],
                scanned_all: true,
            };
        };
        let eval = self.evaluate(&nodes[i], req, now_ms);
        Decision {
            chosen: eval.rejected.is_none().then_some((i, eval.score)),
            evaluated: vec![eval],
            scanned_all: true,
        }
    }
}

/// The evaluation of a node placement has never heard from.
pub fn unknown_node(node_id: &str) -> Evaluation {
    Evaluation {
        node_id: node_id.to_string(),
        rejected: Some("unknown node: no heartbeat received from it".to_string()),
        never: false,
        score: 0.0,
        terms: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::account::{Accounting, Expiry, Heartbeat};
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn node(id: &str, allocated_vcpus: u32) -> NodeView {
        let mut v = NodeView::new(id);
        let hb = Heartbeat {
            node_id: id.into(),
            boot_id: "b".into(),
            seq: 1,
            capacity: Resources {
                vcpus: 8,
                memory_bytes: 32 << 30,
            },
            allocated: Resources {
                vcpus: allocated_vcpus,
                memory_bytes: u64::from(allocated_vcpus) << 30,
            },
            ..Heartbeat::default()
        };
        v.apply_heartbeat(Accounting::Reconciled, &hb, 1_000, Expiry::DEFAULT);
        v
    }

    fn req() -> Request {
        Request {
            sandbox_id: "s".into(),
            resources: Resources {
                vcpus: 1,
                memory_bytes: 1 << 30,
            },
            ..Request::default()
        }
    }

    #[test]
    fn lowest_score_of_the_sample_wins() {
        let nodes = vec![node("a", 20), node("b", 2), node("c", 10)];
        let ranker = Ranker::new(&RankConfig::default());
        let d = ranker.decide(&nodes, &req(), 1_000, &mut SmallRng::seed_from_u64(1));
        assert_eq!(d.chosen.map(|(i, _)| i), Some(1));
        assert_eq!(d.evaluated.len(), 3);
    }

    #[test]
    fn filters_say_why() {
        let mut draining = node("d", 0);
        draining.admin = AdminState::Draining;
        let mut full = node("f", 32);
        full.labels.insert("zone".into(), "a".into());
        let mut labelled = node("l", 0);
        labelled.labels.insert("zone".into(), "b".into());
        let stale = node("s", 0);
        let nodes = vec![draining, full, labelled, stale];
        let ranker = Ranker::new(&RankConfig::default());
        let mut r = req();
        r.selector.insert("zone".into(), "a".into());
        let d = ranker.decide(&nodes, &r, 100_000, &mut SmallRng::seed_from_u64(2));
        assert_eq!(d.chosen, None);
        let why = d.why_nothing_fit();
        assert!(why.contains("draining") && why.contains("unhealthy"), "{why}");
        let d = ranker.decide(&nodes[..3], &r, 1_000, &mut SmallRng::seed_from_u64(2));
        let why = d.why_nothing_fit();
        assert!(why.contains("cpu") && why.contains("label"), "{why}");
    }

    #[test]
    fn memory_is_never_overcommitted() {
        let mut n = node("m", 0);
        n.capacity.memory_bytes = 1 << 30;
        let mut r = req();
        r.resources.memory_bytes = (1 << 30) + 1;
        let ranker = Ranker::new(&RankConfig::default());
        let why = ranker.evaluate(&n, &r, 1_000).rejected.unwrap();
        assert!(why.starts_with(TOO_LARGE) && why.contains("memory"), "{why}");
        // Larger than any node even empty: never, rather than "not now".
        let d = ranker.decide(std::slice::from_ref(&n), &r, 1_000, &mut SmallRng::seed_from_u64(1));
        assert!(d.never_fits(), "{}", d.why_nothing_fit());
        r.resources.memory_bytes = 1 << 29;
        n.reserve(
            super::super::account::Accounting::Optimistic,
            "other",
            Resources {
                vcpus: 1,
                memory_bytes: 1 << 30,
            },
            1_000,
        );
        let d = ranker.decide(std::slice::from_ref(&n), &r, 1_000, &mut SmallRng::seed_from_u64(1));
        assert!(!d.never_fits(), "full now is not never: {}", d.why_nothing_fit());
    }

    #[test]
    fn a_full_sample_falls_back_to_a_scan() {
        let mut nodes: Vec<NodeView> = (0..50).map(|i| node(&format!("n{i}"), 32)).collect();
        nodes.push(node("free", 0));
        let ranker = Ranker::new(&RankConfig::default());
        let d = ranker.decide(&nodes, &req(), 1_000, &mut SmallRng::seed_from_u64(3));
        assert!(d.scanned_all);
        assert_eq!(d.chosen.map(|(i, _)| i), Some(50));
    }

    #[test]
    fn starting_cap_spills_a_burst_over() {
        let mut n = node("a", 0);
        for i in 0..2 {
            n.reserve(Accounting::Reconciled, &format!("s{i}"), req().resources, 1_000);
        }
        let ranker = Ranker::new(&RankConfig {
            max_starting: 2,
            ..RankConfig::default()
        });
        assert!(ranker
            .evaluate(&n, &req(), 1_000)
            .rejected
            .unwrap()
            .contains("too many starting"));
    }
}
