//! Differential test of the two placement stores: the in-memory store, which runs the Rust core
//! (`core::rank`, `core::account`), against the Redis store, whose Lua scripts (`place.lua`,
//! `heartbeat.lua`, `lifecycle.lua`) re-implement the same ranking and accounting by hand.
//! Nothing ties the two implementations together but tests: a scorer, a check or an accounting
//! rule changed on one side silently does nothing on the other. This test catches that drift.
//!
//! It drives both stores with the same seeded random sequence of every operation the
//! `PlacementStore` trait offers (heartbeats that list random subsets of reserved and unknown
//! sandbox IDs with random reported usage, stale and repeated sequence numbers, reboots, places
//! and explains with random resources, label selectors and exclusions, Places retried with an
//! ID placed before, created, release, removed (again, with other resources, or with none),
//! drain and undrain, a clock that lets nodes fall unhealthy) over 3 to 8 nodes with random
//! capacities and labels, and after EVERY step asserts that
//! - each operation returned the same answer (same chosen node, score and per-node
//!   evaluation with the same rejection reason, word for word; same refusal reason; same
//!   heartbeat outcome; same error);
//! - every node's whole view (`nodes()`), its gauges (`gauges()`) and the running totals the
//!   Lua scripts keep beside the view in the node hash (what `place.lua` decides on) agree;
//! - a probe `explain` scores every node the same in both stores.
//!
//! Best-of-K samples its candidates at random (a seeded `SmallRng` in the memory store, a
//! clock-seeded one in the Redis store), so K is set to at least the number of nodes: both
//! stores then evaluate every node and sampling can only change the order in which they are
//! looked at. Order still matters for ties (the first of equally good nodes wins), so a
//! tie is recognised from the memory store's evaluation (every node is in it) and accepted
//! only when both winners share the exact best score; the sandbox's reservations on both
//! tied nodes are then released in both stores, which leaves them alike again. Distinct
//! capacities and continuous CPU usage make ties rare (the test prints how many it saw).
//!
//! Every step also refreshes the Redis store's cached node list (`nodes()` reads it afresh),
//! so a node that just joined is a candidate in both stores, as it is in memory at once.
//!
//! The figures go up to where Lua's own number formatting breaks (1e14 and more: one node may
//! hold petabytes, and sandboxes hundreds of terabytes) and sequence numbers past 2^53, where
//! a double no longer tells neighbours apart. Corners the stores once disagreed on have
//! minimal regression tests at the end of this file.
//!
//! A failure names the seed, the accounting mode, the step, the operation and the difference,
//! followed by the operations that led to it. `DIFFERENTIAL_SEED=<n>` runs that one seed in all
//! three modes and `DIFFERENTIAL_STEPS=<n>` changes the length of each sequence. Needs Redis
//! (`SANDBOXSCHED_TEST_REDIS_URL`, default redis://127.0.0.1:6379); without it the test fails,
//! saying how to start it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Write as _;

use placement_svc::core::{
    Accounting, AdminState, Evaluation, Expiry, Heartbeat, HeartbeatOutcome, Listed, NodeView, Phase, RankConfig,
    Request, Resources,
};
use placement_svc::store::memory::MemoryStore;
use placement_svc::store::redis::RedisStore;
use placement_svc::store::{Explanation, NodeGauge, Placement, PlacementStore, StoreError};
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use stack::services::{redis_missing, redis_url};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Memory of a petabyte node, and of the sandboxes only it can take: from 1e14 bytes, where
/// Lua's own number formatting switches to exponent notation, to well below 2^53.
const HUGE_NODE: std::ops::Range<u64> = (1 << 49)..(1 << 50);
const HUGE_SANDBOX: std::ops::Range<u64> = 100_000_000_000_000..(1 << 47);
/// Sequence numbers a reboot sometimes starts just below: doubles (Lua numbers) cannot tell
/// 2^53 from 2^53 + 1.
const SEQ_NEAR_2_53: u64 = (1 << 53) - 4;

/// Seeds run per accounting mode (each mode is its own test, so they run side by side).
const SEEDS: u64 = 6;
/// Operations per seed.
const STEPS: usize = 300;
/// Operations printed before the failing one.
const LOG_TAIL: usize = 25;
/// Scores come back from Lua as integers in units of 1e-12.
const SCORE_TOLERANCE: f64 = 1e-9;

fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number")),
    )
}

/// Deletes every key under the prefix when dropped, also when the test panics.
struct Cleanup {
    prefix: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let Ok(client) = redis::Client::open(redis_url()) else {
            return;
        };
        let Ok(mut conn) = client.get_connection() else { return };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", self.prefix))
            .query(&mut conn)
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut conn);
        }
    }
}

/// One node as the generator knows it: what its heartbeats report.
struct NodeSpec {
    id: String,
    address: String,
    capacity: Resources,
    labels: BTreeMap<String, String>,
    boot: u32,
    /// The highest sequence number sent in the current boot (0: none yet).
    seq: u64,
}

/// A sandbox ID the generator may mention: placed by the placer, or started behind its back.
struct Sandbox {
    id: String,
    /// The node it runs on (or was placed on).
    node: String,
    resources: Resources,
    life: Life,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Life {
    Running,
    /// Its create was acknowledged but it never came up: its node never lists it, so an
    /// unconfirmed reservation for it expires.
    Ghost,
    /// Killed, and its node may still list it for a while.
    Killed,
    /// Killed, and its node has reported it gone.
    Gone,
}

/// Labels the nodes carry and the selectors draw from; the odd values go through JSON in Redis.
const LABELS: [(&str, &[&str]); 4] = [
    ("arch", &["x86", "arm"]),
    ("zone", &["a", "b", "c"]),
    ("gpu", &["yes", "no"]),
    ("team", &["red", "café", "q\"uote"]),
];

/// One seeded run: the generator's model, both stores, and what it did so far.
struct Run {
    seed: u64,
    mode: Accounting,
    rng: StdRng,
    memory: MemoryStore,
    redis: RedisStore,
    /// A plain connection, to read the running totals the Lua scripts keep in the node hash.
    raw: redis::aio::MultiplexedConnection,
    prefix: String,
    config: RankConfig,
    expiry: Expiry,
    nodes: Vec<NodeSpec>,
    sandboxes: Vec<Sandbox>,
    next_sandbox: u32,
    now_ms: u64,
    /// The step being run, the operation it does, and the log of everything done so far.
    step: usize,
    current_op: String,
    log: Vec<String>,
    ties: u32,
    /// How often each check filtered a node out of a Place, to show what the run covered.
    rejections: BTreeMap<String, u32>,
    placed: u32,
    refused: u32,
    /// What heartbeats did to reservations and removals, summed.
    confirmed: u32,
    completed_removals: u32,
    expired: u32,
    /// How often a step reached a corner the stores once disagreed on.
    corners: BTreeMap<&'static str, u32>,
    /// The node the last Place reserved on (`None` if it reserved nothing).
    last_placed_on: Option<String>,
}

impl Run {
    async fn new(seed: u64, mode: Accounting) -> (Self, Cleanup) {
        let mut rng = StdRng::seed_from_u64(seed ^ ((mode as u64) << 56));
        let n = rng.random_range(3..=8usize);
        let mut vcpus = vec![2u32, 4, 6, 8, 10, 12, 16, 24, 32, 48];
        vcpus.shuffle(&mut rng);
        let mut memories = BTreeSet::new();
        let mut nodes = Vec::with_capacity(n);
        // Sometimes one node holds petabytes, so sandboxes of hundreds of terabytes fit there.
        let huge_node = rng.random_bool(0.5).then(|| rng.random_range(0..n));
        for (i, &v) in vcpus.iter().take(n).enumerate() {
            // Distinct capacities in both dimensions make equal scores rare.
            let mut memory = u64::from(v) * rng.random_range(1..=8) * GIB + rng.random_range(0..1024) * MIB;
            if huge_node == Some(i) {
                memory = rng.random_range(HUGE_NODE);
            }
            while !memories.insert(memory) {
                memory += 64 * MIB;
            }
            let id = format!("node-{i}");
            nodes.push(NodeSpec {
                address: format!("http://{id}.local:7003"),
                id,
                capacity: Resources {
                    vcpus: v,
                    memory_bytes: memory,
                },
                labels: random_labels(&mut rng),
                boot: 1,
                seq: 0,
            });
        }
        let cpu_weight = *[1.0, 1.0, 0.5, 2.0, 0.0].choose(&mut rng).unwrap();
        // One weight may be zero (the term is skipped), not both (every score would tie).
        let memory_weight = match *[1.0, 1.0, 0.7, 3.0, 0.0].choose(&mut rng).unwrap() {
            w if w == 0.0 && cpu_weight == 0.0 => 1.0,
            w => w,
        };
        let config = RankConfig {
            // K at least the node count: every node is evaluated, sampling only orders them.
            k: n + rng.random_range(0..3),
            // Sometimes an arbitrary ratio: the CPU reason then writes figures of up to 17 digits.
            overcommit: if rng.random_bool(0.3) {
                rng.random_range(0.8..4.0)
            } else {
                *[1.0, 1.1, 1.5, 2.0, 4.0].choose(&mut rng).unwrap()
            },
            alpha: rng.random_range(0.0..1.0),
            cpu_weight,
            memory_weight,
            template_weight: *[0.0, 0.1, 0.1, 2.5].choose(&mut rng).unwrap(),
            max_starting: rng.random_range(2..=8),
            unhealthy_after_ms: rng.random_range(3_000..=10_000),
        };
        // Pending bounds short enough that quiet spells (up to 20 s) expire creates in flight.
        let expiry = Expiry {
            unconfirmed_heartbeats: rng.random_range(1..=4),
            pending_ms: rng.random_range(1_000..=15_000),
        };
        let prefix = format!("diff-{}", uuid::Uuid::new_v4().simple());
        let redis = RedisStore::connect(&redis_url(), &prefix, mode, &config, expiry)
            .await
            .unwrap_or_else(|err| redis_missing(err));
        let client = redis::Client::open(redis_url()).unwrap_or_else(|err| redis_missing(err));
        let raw = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|err| redis_missing(err));
        let memory = MemoryStore::new(mode, &config, expiry, seed);
        let cleanup = Cleanup { prefix: prefix.clone() };
        let run = Self {
            seed,
            mode,
            rng,
            memory,
            redis,
            raw,
            prefix,
            config,
            expiry,
            nodes,
            sandboxes: Vec::new(),
            next_sandbox: 0,
            now_ms: 100_000,
            step: 0,
            current_op: String::new(),
            log: Vec::new(),
            ties: 0,
            rejections: BTreeMap::new(),
            placed: 0,
            refused: 0,
            confirmed: 0,
            completed_removals: 0,
            expired: 0,
            corners: BTreeMap::new(),
            last_placed_on: None,
        };
        (run, cleanup)
    }

    /// Runs `steps` random operations, comparing the stores after each.
    async fn run(&mut self, steps: usize) {
        let header = format!(
            "seed {} ({} accounting), {} nodes, {:?}, {:?}",
            self.seed,
            self.mode.name(),
            self.nodes.len(),
            self.config,
            self.expiry
        );
        for step in 0..steps {
            self.step = step;
            self.now_ms += self.rng.random_range(0..200);
            let result = match self.random_step().await {
                Ok(()) => self.compare_state().await,
                Err(err) => Err(err),
            };
            if let Err(diff) = result {
                let from = self.log.len().saturating_sub(LOG_TAIL);
                let mut tail = String::new();
                for line in &self.log[from..] {
                    let _ = writeln!(tail, "  {line}");
                }
                panic!(
                    "stores diverged at step {step} of {header}\n  operation: {}\n  difference: {diff}\n\
                     operations up to it:\n{tail}rerun with DIFFERENTIAL_SEED={}",
                    self.current_op, self.seed
                );
            }
        }
        eprintln!(
            "{header}: {steps} steps agree ({} placed, {} refused, {} ties; heartbeats confirmed {} \
             reservations, expired {}, completed {} removals; nodes filtered out: {:?}; corners reached: {:?})",
            self.placed,
            self.refused,
            self.ties,
            self.confirmed,
            self.expired,
            self.completed_removals,
            self.rejections,
            self.corners
        );
    }

    /// One random operation, applied to both stores; `Err` describes how their answers differ.
    async fn random_step(&mut self) -> Result<(), String> {
        let roll = self.rng.random_range(0..100);
        match roll {
            0..=35 => self.heartbeat().await,
            36..=59 => {
                let id = self.new_sandbox_id("sbx");
                self.place(id).await
            }
            60..=64 => self.place_again().await,
            65..=71 => self.lifecycle(Lifecycle::Created).await,
            72..=75 => self.lifecycle(Lifecycle::Release).await,
            76..=85 => self.lifecycle(Lifecycle::Removed).await,
            86..=89 => self.set_admin().await,
            90..=96 => self.explain().await,
            _ => {
                // A quiet spell: some nodes fall unhealthy before they heartbeat again.
                let jump = self.rng.random_range(0..=self.config.unhealthy_after_ms * 2);
                self.now_ms += jump;
                self.op(format!("clock +{jump} ms (now {})", self.now_ms));
                Ok(())
            }
        }
    }

    /// Records the operation of the current step.
    fn op(&mut self, text: String) {
        self.log.push(format!("step {}: {text}", self.step));
        self.current_op = text;
    }

    /// Records what the operation did.
    fn note(&mut self, text: String) {
        self.log.push(format!("step {}:   -> {text}", self.step));
    }

    fn corner(&mut self, name: &'static str) {
        *self.corners.entry(name).or_default() += 1;
    }

    fn new_sandbox_id(&mut self, kind: &str) -> String {
        self.next_sandbox += 1;
        format!("{kind}-{}", self.next_sandbox)
    }

    fn random_resources(&mut self) -> Resources {
        if self.rng.random_bool(0.04) {
            // Too big for any node in one dimension or the other.
            return if self.rng.random_bool(0.5) {
                Resources {
                    vcpus: 400,
                    memory_bytes: GIB,
                }
            } else {
                Resources {
                    vcpus: 1,
                    memory_bytes: 1 << 51,
                }
            };
        }
        if self.rng.random_bool(0.04) {
            // Hundreds of terabytes: only a petabyte node takes it.
            return Resources {
                vcpus: self.rng.random_range(1..=4),
                memory_bytes: self.rng.random_range(HUGE_SANDBOX),
            };
        }
        Resources {
            vcpus: self.rng.random_range(1..=4),
            memory_bytes: self.rng.random_range(1..=16) * 256 * MIB,
        }
    }

    fn random_request(&mut self, sandbox_id: String) -> Request {
        let resources = self.random_resources();
        let mut selector = BTreeMap::new();
        let labels = match self.rng.random_range(0..20) {
            0..=9 => 0,
            10..=16 => 1,
            _ => 2,
        };
        for _ in 0..labels {
            let (key, values) = *LABELS.choose(&mut self.rng).unwrap();
            selector.insert(key.to_string(), values.choose(&mut self.rng).unwrap().to_string());
        }
        let mut exclude = HashSet::new();
        if self.rng.random_bool(0.3) {
            for node in &self.nodes {
                if self.rng.random_bool(0.3) {
                    exclude.insert(node.id.clone());
                }
            }
            if self.rng.random_bool(0.2) {
                exclude.insert("node-that-never-was".to_string());
            }
        }
        // Some requests are a balancer move's target: pinned to one node (or one never seen).
        let only = match self.rng.random_range(0..20) {
            0..=1 => Some(self.nodes[self.rng.random_range(0..self.nodes.len())].id.clone()),
            2 => Some("node-that-never-was".to_string()),
            _ => None,
        };
        // Half the requests name a template; heartbeats say which nodes hold which.
        let template = match self.rng.random_range(0..4) {
            0 | 1 => String::new(),
            _ => TEMPLATES.choose(&mut self.rng).unwrap().to_string(),
        };
        // Some creates may count the nodes' pooled sandboxes' room as free; some of those ask
        // for most of a node, so that only its pooled room makes it fit.
        let reclaim_pooled = self.rng.random_bool(0.3);
        let mut resources = resources;
        if reclaim_pooled && self.rng.random_bool(0.5) {
            let node = &self.nodes[self.rng.random_range(0..self.nodes.len())];
            let memory = node.capacity.memory_bytes;
            resources.memory_bytes = memory.saturating_sub(self.rng.random_range(0..=memory / 2)).max(1);
        }
        Request {
            sandbox_id,
            resources,
            selector,
            exclude,
            only,
            template,
            reclaim_pooled,
        }
    }

    async fn heartbeat(&mut self) -> Result<(), String> {
        let i = self.rng.random_range(0..self.nodes.len());
        let roll = self.rng.random_range(0..100);
        let node = &mut self.nodes[i];
        let kind;
        if roll < 5 && node.seq > 0 {
            // Rebooted: a new boot ID restarts the sequence, perhaps relabelled.
            node.boot += 1;
            node.seq = self.rng.random_range(1..=3);
            if self.rng.random_bool(0.3) {
                node.seq += SEQ_NEAR_2_53;
            }
            if self.rng.random_bool(0.5) {
                node.labels = random_labels(&mut self.rng);
            }
            kind = "reboot";
        } else if roll < 13 && node.seq > 0 {
            // Late or repeated: not newer than what was applied.
            kind = "stale";
        } else {
            node.seq += self.rng.random_range(1..=3);
            kind = "fresh";
        }
        let seq = if kind == "stale" {
            // The one just sent, or one of the last few, or any earlier one.
            if self.rng.random_bool(0.5) {
                node.seq - self.rng.random_range(0..=(node.seq - 1).min(3))
            } else {
                self.rng.random_range(1..=node.seq)
            }
        } else {
            node.seq
        };
        let node_id = node.id.clone();
        let mut hb = Heartbeat {
            node_id: node_id.clone(),
            boot_id: format!("{node_id}-boot-{}", node.boot),
            seq,
            address: node.address.clone(),
            labels: node.labels.clone(),
            capacity: node.capacity,
            templates: TEMPLATES
                .iter()
                .filter(|_| self.rng.random_bool(0.4))
                .map(|t| t.to_string())
                .collect(),
            ..Heartbeat::default()
        };
        // What the node lists: some of what runs there (placed or started behind the
        // placer's back, killed ones included for a while), sometimes a sandbox the placer put
        // on another node, sometimes a sandbox it never heard of.
        let mut listed: Vec<(String, Resources)> = Vec::new();
        for s in &mut self.sandboxes {
            let here = s.node == node_id;
            let p = match (here, s.life) {
                (true, Life::Running) => 0.6,
                (true, Life::Killed) => 0.3,
                (_, Life::Ghost) => 0.0,
                _ => 0.02,
            };
            if self.rng.random_bool(p) {
                listed.push((s.id.clone(), s.resources));
            } else if here && s.life == Life::Killed {
                s.life = Life::Gone;
            }
        }
        for _ in 0..self.rng.random_range(0..=2) {
            if self.rng.random_bool(0.25) {
                let id = self.new_sandbox_id("ext");
                let resources = self.random_resources();
                self.sandboxes.push(Sandbox {
                    id: id.clone(),
                    node: node_id.clone(),
                    resources,
                    life: Life::Running,
                });
                listed.push((id, resources));
            }
        }
        if !listed.is_empty() && self.rng.random_bool(0.05) {
            // The same sandbox twice in one report.
            let dup = listed[0].clone();
            listed.push(dup);
        }
        listed.shuffle(&mut self.rng);
        let mut allocated = Resources::default();
        for (_, r) in &listed {
            allocated.vcpus += r.vcpus;
            allocated.memory_bytes += r.memory_bytes;
        }
        if self.rng.random_bool(0.2) {
            // The node's own totals need not add up to its list.
            allocated.vcpus = self.rng.random_range(0..=allocated.vcpus + 8);
            allocated.memory_bytes = self.rng.random_range(0..=allocated.memory_bytes + 8 * GIB);
        }
        hb.allocated = allocated;
        if self.rng.random_bool(0.5) {
            // Part of it held by pooled sandboxes.
            hb.pooled = Resources {
                vcpus: self.rng.random_range(0..=allocated.vcpus),
                memory_bytes: self.rng.random_range(0..=allocated.memory_bytes),
            };
        }
        hb.memory_used_bytes = self.rng.random_range(0..=allocated.memory_bytes);
        hb.cpu_usage = if self.rng.random_bool(0.1) {
            0.0
        } else {
            self.rng.random_range(0.0..f64::from(hb.capacity.vcpus))
        };
        hb.sandboxes = listed
            .into_iter()
            .map(|(sandbox_id, allocated)| Listed {
                sandbox_id,
                allocated,
                memory_used_bytes: allocated.memory_bytes / 2,
            })
            .collect();
        let ids: Vec<&str> = hb.sandboxes.iter().map(|s| s.sandbox_id.as_str()).collect();
        self.op(format!(
            "heartbeat ({kind}) {node_id} boot {} seq {seq} at {} lists {ids:?}, allocated {}/{} MiB, usage {:.3}",
            hb.boot_id,
            self.now_ms,
            hb.allocated.vcpus,
            hb.allocated.memory_bytes >> 20,
            hb.cpu_usage
        ));
        if seq > 1 << 53 {
            self.corner("heartbeat seq past 2^53");
        }
        let pending: HashSet<String> = self
            .memory
            .nodes()
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|v| v.node_id == hb.node_id)
            .flat_map(|v| v.reservations.into_iter())
            .filter(|(_, r)| matches!(r.phase, Phase::Pending { .. }))
            .map(|(id, _)| id)
            .collect();
        let m = self.memory.heartbeat(&hb, self.now_ms).await;
        let r = self.redis.heartbeat(&hb, self.now_ms).await;
        match (m, r) {
            (Ok(m), Ok(r)) => {
                if !m.applied && m.draining {
                    self.corner("ignored heartbeat of a draining node");
                }
                if m.expired.iter().any(|id| pending.contains(id)) {
                    self.corner("pending reservation expired");
                }
                self.confirmed += m.confirmed;
                self.completed_removals += m.removed;
                self.expired += m.expired.len() as u32;
                compare_outcomes(&m, &r)
            }
            (m, r) => compare_errors("heartbeat", m, r),
        }
    }

    async fn place(&mut self, id: String) -> Result<(), String> {
        let req = self.random_request(id);
        self.place_request(req).await
    }

    async fn place_request(&mut self, req: Request) -> Result<(), String> {
        let id = req.sandbox_id.clone();
        let at = self.decision_time();
        self.op(format!("place {} at {at}", describe(&req)));
        self.last_placed_on = None;
        if req.resources.memory_bytes >= 100_000_000_000_000 {
            self.corner("place of 1e14 bytes or more");
        }
        let m = self
            .memory
            .place(&req, at)
            .await
            .map_err(|e| format!("memory place failed: {e}"))?;
        let r = self
            .redis
            .place(&req, at)
            .await
            .map_err(|e| format!("redis place failed: {e}"))?;
        if let Placement::Placed { evaluated, .. } = &m {
            for e in evaluated {
                if let Some(reason) = &e.rejected {
                    *self.rejections.entry(reason_kind(reason).to_string()).or_default() += 1;
                    if req.selector.len() > 1 && reason.starts_with("label ") {
                        self.corner("label rejection with several labels selected");
                    }
                }
            }
        }
        match (&m, &r) {
            (
                Placement::Placed {
                    node_id: m_node,
                    address: m_address,
                    score: m_score,
                    evaluated: m_eval,
                    reclaim: m_reclaim,
                },
                Placement::Placed {
                    node_id: r_node,
                    address: r_address,
                    score: r_score,
                    evaluated: r_eval,
                    reclaim: r_reclaim,
                },
            ) => {
                compare_evaluations(m_eval, r_eval)?;
                if m_node != r_node {
                    let tied = tie_set(m_eval);
                    if tied.len() > 1 && tied.contains(m_node) && tied.contains(r_node) {
                        // Equally good: the sample order picked. Release the sandbox on both
                        // tied nodes in both stores (a retried ID may have held a reservation
                        // on either before, which the Place replaced on one side only), so the
                        // stores agree again, and go on.
                        self.ties += 1;
                        self.note(format!(
                            "tie among {tied:?}: {id} released on {m_node} and {r_node} in both stores"
                        ));
                        for node in [m_node, r_node] {
                            self.memory
                                .release(node, &id)
                                .await
                                .map_err(|e| format!("memory release after a tie: {e}"))?;
                            self.redis
                                .release(node, &id)
                                .await
                                .map_err(|e| format!("redis release after a tie: {e}"))?;
                        }
                        return Ok(());
                    }
                    return Err(format!(
                        "memory placed on {m_node} (score {m_score}), redis on {r_node} (score {r_score}); \
                         equally best per memory: {tied:?}"
                    ));
                }
                if m_address != r_address {
                    return Err(format!("address: memory {m_address:?}, redis {r_address:?}"));
                }
                if (m_score - r_score).abs() > SCORE_TOLERANCE {
                    return Err(format!("score of {m_node}: memory {m_score}, redis {r_score}"));
                }
                if m_reclaim != r_reclaim {
                    return Err(format!(
                        "reclaim on {m_node}: memory {m_reclaim:?}, redis {r_reclaim:?}"
                    ));
                }
                if m_reclaim.vcpus > 0 || m_reclaim.memory_bytes > 0 {
                    self.corner("placed counting pooled room, with some to reclaim");
                }
                self.placed += 1;
                self.last_placed_on = (self.mode != Accounting::Stale).then(|| m_node.clone());
                self.note(format!("placed on {m_node}"));
                let life = if self.rng.random_bool(0.15) {
                    Life::Ghost
                } else {
                    Life::Running
                };
                self.sandboxes.push(Sandbox {
                    id,
                    node: m_node.clone(),
                    resources: req.resources,
                    life,
                });
                Ok(())
            }
            (
                Placement::NoFit {
                    reason: m_reason,
                    never: m_never,
                },
                Placement::NoFit {
                    reason: r_reason,
                    never: r_never,
                },
            ) => {
                self.refused += 1;
                *self.rejections.entry("(nothing fit)".to_string()).or_default() += 1;
                self.note(format!("refused: {m_reason}"));
                if m_reason != r_reason || m_never != r_never {
                    return Err(format!(
                        "refusal: memory {m_reason:?} (never {m_never}), redis {r_reason:?} (never {r_never})"
                    ));
                }
                Ok(())
            }
            _ => Err(format!("memory: {}; redis: {}", placement_text(&m), placement_text(&r))),
        }
    }

    /// A Place retried with a sandbox ID placed before (its create failed elsewhere, or the
    /// caller did not hear the answer), perhaps still holding a reservation, perhaps on the node
    /// the retry chooses (which replaces it).
    async fn place_again(&mut self) -> Result<(), String> {
        let views = self.memory.nodes().await.map_err(|e| format!("memory nodes: {e}"))?;
        let reserved: Vec<String> = views
            .iter()
            .flat_map(|v| v.reservations.keys().filter(|id| id.starts_with("sbx-")).cloned())
            .collect();
        let placed: Vec<String> = self
            .sandboxes
            .iter()
            .filter(|s| s.id.starts_with("sbx-"))
            .map(|s| s.id.clone())
            .collect();
        // Half the time one that still holds a reservation, if any does.
        let from = if !reserved.is_empty() && self.rng.random_bool(0.5) {
            &reserved
        } else {
            &placed
        };
        let Some(id) = from.choose(&mut self.rng).cloned() else {
            return Ok(());
        };
        let held_on: Vec<String> = views
            .iter()
            .filter(|v| v.reservations.contains_key(&id))
            .map(|v| v.node_id.clone())
            .collect();
        let mut req = self.random_request(id);
        if !held_on.is_empty() && self.rng.random_bool(0.5) {
            // Creates failed everywhere else: the retry may only go where the ID is reserved.
            req.exclude = self
                .nodes
                .iter()
                .map(|n| n.id.clone())
                .filter(|n| *n != held_on[0])
                .collect();
        }
        self.place_request(req).await?;
        if self.last_placed_on.as_ref().is_some_and(|node| held_on.contains(node)) {
            self.corner("place replacing a reservation");
        }
        Ok(())
    }

    async fn explain(&mut self) -> Result<(), String> {
        let req = self.random_request("explained".to_string());
        let at = self.decision_time();
        self.op(format!("explain {} at {at}", describe(&req)));
        self.compare_explain(&req, at).await
    }

    /// Usually now; sometimes a little earlier, as from a placer replica whose clock lags the
    /// one that applied the last heartbeat.
    fn decision_time(&mut self) -> u64 {
        if self.rng.random_bool(0.05) {
            self.now_ms - self.rng.random_range(0..=1_500)
        } else {
            self.now_ms
        }
    }

    async fn compare_explain(&mut self, req: &Request, at: u64) -> Result<(), String> {
        let m = self
            .memory
            .explain(req, at)
            .await
            .map_err(|e| format!("memory explain failed: {e}"))?;
        let r = self
            .redis
            .explain(req, at)
            .await
            .map_err(|e| format!("redis explain failed: {e}"))?;
        compare_explanations(&m, &r)
    }

    async fn lifecycle(&mut self, op: Lifecycle) -> Result<(), String> {
        // Mostly a sandbox the placer placed, on the node it placed it on; sometimes one it
        // never placed, the wrong node, or a node that never sent a heartbeat.
        let likely: Vec<usize> = (0..self.sandboxes.len())
            .filter(|&i| {
                let s = &self.sandboxes[i];
                match op {
                    Lifecycle::Created | Lifecycle::Release => {
                        s.id.starts_with("sbx-") && matches!(s.life, Life::Running | Life::Ghost)
                    }
                    Lifecycle::Removed => s.life == Life::Running,
                }
            })
            .collect();
        // Removed also picks killed sandboxes sometimes: a kill reported twice.
        let again: Vec<usize> = (0..self.sandboxes.len())
            .filter(|&i| op == Lifecycle::Removed && self.sandboxes[i].life == Life::Killed)
            .collect();
        let known = match self.rng.random_range(0..100) {
            0..=9 if !again.is_empty() => again.choose(&mut self.rng).copied(),
            0..=84 => likely.choose(&mut self.rng).copied(),
            85..=94 if !self.sandboxes.is_empty() => Some(self.rng.random_range(0..self.sandboxes.len())),
            _ => None,
        };
        let (sandbox_id, mut node_id, held) = match known {
            Some(i) => {
                let s = &self.sandboxes[i];
                (s.id.clone(), s.node.clone(), s.resources)
            }
            None => {
                let id = self.new_sandbox_id("stray");
                let node = self.nodes.choose(&mut self.rng).unwrap().id.clone();
                (id, node, self.random_resources())
            }
        };
        if self.rng.random_bool(0.05) {
            node_id = self.nodes.choose(&mut self.rng).unwrap().id.clone();
        }
        if self.rng.random_bool(0.02) {
            node_id = "node-that-never-was".to_string();
        }
        let (m, r) = match op {
            Lifecycle::Created => {
                self.op(format!("created {sandbox_id} on {node_id}"));
                (
                    self.memory.created(&node_id, &sandbox_id).await,
                    self.redis.created(&node_id, &sandbox_id).await,
                )
            }
            Lifecycle::Release => {
                self.op(format!("release {sandbox_id} on {node_id}"));
                (
                    self.memory.release(&node_id, &sandbox_id).await,
                    self.redis.release(&node_id, &sandbox_id).await,
                )
            }
            Lifecycle::Removed => {
                // Usually what it held; sometimes other figures, or none (a caller that does
                // not know sends zeros).
                let resources = match self.rng.random_range(0..100) {
                    0..=84 => held,
                    85..=96 => self.random_resources(),
                    _ => Resources::default(),
                };
                let views = self.memory.nodes().await.map_err(|e| format!("memory nodes: {e}"))?;
                if views
                    .iter()
                    .any(|v| v.node_id == node_id && v.removals.contains_key(&sandbox_id))
                {
                    self.corner("removal replacing a marker");
                }
                if resources.memory_bytes >= 100_000_000_000_000 {
                    self.corner("removal of 1e14 bytes or more");
                }
                if resources == Resources::default() {
                    self.corner("removal without resources");
                }
                for s in self
                    .sandboxes
                    .iter_mut()
                    .filter(|s| s.id == sandbox_id && s.life == Life::Running)
                {
                    s.life = Life::Killed;
                }
                self.op(format!(
                    "removed {sandbox_id} on {node_id} holding {}/{} MiB",
                    resources.vcpus,
                    resources.memory_bytes >> 20
                ));
                (
                    self.memory.removed(&node_id, &sandbox_id, resources).await,
                    self.redis.removed(&node_id, &sandbox_id, resources).await,
                )
            }
        };
        compare_errors(op.name(), m, r)
    }

    async fn set_admin(&mut self) -> Result<(), String> {
        let node_id = if self.rng.random_bool(0.05) {
            "node-that-never-was".to_string()
        } else {
            self.nodes.choose(&mut self.rng).unwrap().id.clone()
        };
        let admin = if self.rng.random_bool(0.35) {
            AdminState::Draining
        } else {
            AdminState::Ready
        };
        self.op(format!("set_admin {node_id} {admin:?}"));
        let m = self.memory.set_admin(&node_id, admin).await;
        let r = self.redis.set_admin(&node_id, admin).await;
        match (m, r) {
            (Ok(m), Ok(r)) => {
                let diffs = view_diffs(&m, &r);
                if diffs.is_empty() {
                    Ok(())
                } else {
                    Err(format!("returned view of {node_id}: {}", diffs.join("; ")))
                }
            }
            (m, r) => compare_errors("set_admin", m, r),
        }
    }

    /// Every node's view, its gauges, the running totals in Redis and a probe decision.
    async fn compare_state(&mut self) -> Result<(), String> {
        let mut m = self.memory.nodes().await.map_err(|e| format!("memory nodes: {e}"))?;
        let mut r = self.redis.nodes().await.map_err(|e| format!("redis nodes: {e}"))?;
        m.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        r.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        let m_ids: Vec<&str> = m.iter().map(|v| v.node_id.as_str()).collect();
        let r_ids: Vec<&str> = r.iter().map(|v| v.node_id.as_str()).collect();
        if m_ids != r_ids {
            return Err(format!("known nodes: memory {m_ids:?}, redis {r_ids:?}"));
        }
        let mut diffs = Vec::new();
        for (mv, rv) in m.iter().zip(&r) {
            for d in view_diffs(mv, rv) {
                diffs.push(format!("{}: {d}", mv.node_id));
            }
        }
        if !diffs.is_empty() {
            return Err(format!("node views differ: {}", diffs.join("; ")));
        }

        let mut mg = self.memory.gauges().await.map_err(|e| format!("memory gauges: {e}"))?;
        let mut rg = self.redis.gauges().await.map_err(|e| format!("redis gauges: {e}"))?;
        mg.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        rg.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        if mg != rg {
            return Err(format!("gauges: memory {mg:?}, redis {rg:?}"));
        }
        let from_views: Vec<NodeGauge> = m.iter().map(NodeGauge::of).collect();
        if rg != from_views {
            return Err(format!(
                "redis gauges {rg:?} disagree with its own views {from_views:?}"
            ));
        }

        // The Lua place script decides on running totals kept in the node hash, not on the
        // reservation and removal hashes the views are read from; they must agree with the
        // totals the Rust core derives from the view.
        for view in &m {
            check_running_totals(&mut self.raw, &self.prefix, view).await?;
        }

        // A probe decision scores every healthy node on both sides.
        let probe = Request {
            sandbox_id: "probe".to_string(),
            resources: Resources {
                vcpus: 1,
                memory_bytes: 512 * MIB,
            },
            ..Request::default()
        };
        self.compare_explain(&probe, self.now_ms)
            .await
            .map_err(|e| format!("probe explain after the step: {e}"))
    }
}

/// The running totals `place.lua` decides on, kept in the node hash beside the reservation and
/// removal hashes the views are read from, against the totals the Rust core derives from `view`
/// (the memory store's view of the same node).
async fn check_running_totals(
    conn: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
    view: &NodeView,
) -> Result<(), String> {
    let key = format!("{prefix}:n:{}", view.node_id);
    let fields: Vec<Option<i64>> = redis::cmd("HMGET")
        .arg(&key)
        .arg(&["res_vcpus", "res_mem", "rm_vcpus", "rm_mem", "pending", "unconfirmed"])
        .query_async(conn)
        .await
        .map_err(|e| format!("reading {key}: {e}"))?;
    let got: Vec<i64> = fields.into_iter().map(|f| f.unwrap_or(0)).collect();
    let (reserved, removing) = (view.reserved(), view.removing());
    let want = vec![
        reserved.vcpus,
        reserved.memory_bytes,
        removing.vcpus,
        removing.memory_bytes,
        i64::from(view.pending()),
        i64::from(view.unconfirmed()),
    ];
    if got != want {
        return Err(format!(
            "running totals of {} in Redis [res_vcpus, res_mem, rm_vcpus, rm_mem, pending, unconfirmed]: \
             {got:?}, the memory store's view derives {want:?}",
            view.node_id
        ));
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Lifecycle {
    Created,
    Release,
    Removed,
}

impl Lifecycle {
    fn name(self) -> &'static str {
        match self {
            Lifecycle::Created => "created",
            Lifecycle::Release => "release",
            Lifecycle::Removed => "removed",
        }
    }
}

fn random_labels(rng: &mut StdRng) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    for (key, values) in LABELS {
        if rng.random_bool(0.7) {
            labels.insert(key.to_string(), values.choose(rng).unwrap().to_string());
        }
    }
    labels
}

fn describe(req: &Request) -> String {
    let mut exclude: Vec<&String> = req.exclude.iter().collect();
    exclude.sort();
    format!(
        "{} needing {}/{} MiB, selector {:?}, exclude {exclude:?}",
        req.sandbox_id,
        req.resources.vcpus,
        req.resources.memory_bytes >> 20,
        req.selector
    )
}

fn placement_text(p: &Placement) -> String {
    match p {
        Placement::Placed { node_id, score, .. } => format!("placed on {node_id} (score {score})"),
        Placement::NoFit { reason, never } => format!("refused (never: {never}): {reason}"),
    }
}

/// The feasible nodes sharing the lowest score (exactly) in one decision.
fn tie_set(evaluated: &[Evaluation]) -> BTreeSet<String> {
    let best = evaluated
        .iter()
        .filter(|e| e.rejected.is_none())
        .map(|e| e.score)
        .min_by(f64::total_cmp);
    evaluated
        .iter()
        .filter(|e| e.rejected.is_none() && Some(e.score) == best)
        .map(|e| e.node_id.clone())
        .collect()
}

/// What filtered a node out, without the figures: the text before the first ':' (the same
/// grouping `Decision::why_nothing_fit` uses), to count what a run covered.
fn reason_kind(reason: &str) -> &str {
    reason.split(':').next().unwrap_or(reason)
}

/// Both stores evaluate every node (K is at least the node count); compares them by node.
fn compare_evaluations(m: &[Evaluation], r: &[Evaluation]) -> Result<(), String> {
    let by_node = |evals: &[Evaluation]| -> BTreeMap<String, Evaluation> {
        evals.iter().map(|e| (e.node_id.clone(), e.clone())).collect()
    };
    let (m, r) = (by_node(m), by_node(r));
    let m_ids: Vec<&String> = m.keys().collect();
    let r_ids: Vec<&String> = r.keys().collect();
    if m_ids != r_ids {
        return Err(format!("nodes evaluated: memory {m_ids:?}, redis {r_ids:?}"));
    }
    let mut diffs = Vec::new();
    for (id, me) in &m {
        let re = &r[id];
        match (&me.rejected, &re.rejected) {
            (None, None) => {
                if (me.score - re.score).abs() > SCORE_TOLERANCE {
                    diffs.push(format!("{id} score: memory {}, redis {}", me.score, re.score));
                }
                let names = |e: &Evaluation| e.terms.iter().map(|(n, _)| *n).collect::<Vec<_>>();
                for (name, mv) in &me.terms {
                    match re.terms.iter().find(|(n, _)| n == name) {
                        Some((_, rv)) if (mv - rv).abs() <= SCORE_TOLERANCE => {}
                        Some((_, rv)) => diffs.push(format!("{id} {name} term: memory {mv}, redis {rv}")),
                        None => diffs.push(format!("{id} terms: memory {:?}, redis {:?}", names(me), names(re))),
                    }
                }
            }
            (Some(mr), Some(rr)) => {
                if mr != rr {
                    diffs.push(format!("{id} rejected: memory {mr:?}, redis {rr:?}"));
                }
                if me.never != re.never {
                    diffs.push(format!("{id} never fits: memory {}, redis {}", me.never, re.never));
                }
            }
            (mr, rr) => diffs.push(format!(
                "{id}: memory {} (score {}), redis {} (score {})",
                mr.as_deref().unwrap_or("feasible"),
                me.score,
                rr.as_deref().unwrap_or("feasible"),
                re.score
            )),
        }
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(format!("evaluations differ: {}", diffs.join("; ")))
    }
}

fn compare_explanations(m: &Explanation, r: &Explanation) -> Result<(), String> {
    compare_evaluations(&m.evaluated, &r.evaluated)?;
    if m.chosen == r.chosen {
        return Ok(());
    }
    let tied = tie_set(&m.evaluated);
    match (&m.chosen, &r.chosen) {
        (Some(a), Some(b)) if tied.contains(a) && tied.contains(b) => Ok(()),
        _ => Err(format!(
            "chosen: memory {:?}, redis {:?}; equally best per memory: {tied:?}",
            m.chosen, r.chosen
        )),
    }
}

fn compare_outcomes(m: &HeartbeatOutcome, r: &HeartbeatOutcome) -> Result<(), String> {
    let sorted = |o: &HeartbeatOutcome| {
        let mut o = o.clone();
        o.expired.sort();
        o
    };
    let (m, r) = (sorted(m), sorted(r));
    if m == r {
        Ok(())
    } else {
        Err(format!("heartbeat outcome: memory {m:?}, redis {r:?}"))
    }
}

fn compare_errors<T: std::fmt::Debug>(
    op: &str,
    m: Result<T, StoreError>,
    r: Result<T, StoreError>,
) -> Result<(), String> {
    match (&m, &r) {
        (Ok(_), Ok(_)) => Ok(()),
        (Err(StoreError::UnknownNode(a)), Err(StoreError::UnknownNode(b))) if a == b => Ok(()),
        _ => Err(format!("{op}: memory {m:?}, redis {r:?}")),
    }
}

/// Field by field, with the unordered collections sorted, so a difference reads plainly.
fn view_diffs(m: &NodeView, r: &NodeView) -> Vec<String> {
    let mut out = Vec::new();
    macro_rules! field {
        ($($name:ident),*) => {$(
            if m.$name != r.$name {
                out.push(format!(concat!(stringify!($name), ": memory {:?}, redis {:?}"), m.$name, r.$name));
            }
        )*};
    }
    field!(
        node_id,
        address,
        labels,
        capacity,
        admin,
        boot_id,
        seq,
        last_heartbeat_ms,
        reported,
        reported_sandboxes,
        memory_used_bytes,
        cpu_usage
    );
    let listed = |v: &NodeView| v.listed.iter().cloned().collect::<BTreeSet<_>>();
    if m.listed != r.listed {
        out.push(format!("listed: memory {:?}, redis {:?}", listed(m), listed(r)));
    }
    let reservations = |v: &NodeView| {
        v.reservations
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect::<BTreeMap<_, _>>()
    };
    if m.reservations != r.reservations {
        out.push(format!(
            "reservations: memory {:?}, redis {:?}",
            reservations(m),
            reservations(r)
        ));
    }
    let removals = |v: &NodeView| {
        v.removals
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect::<BTreeMap<_, _>>()
    };
    if m.removals != r.removals {
        out.push(format!("removals: memory {:?}, redis {:?}", removals(m), removals(r)));
    }
    if out.is_empty() && m != r {
        out.push(format!("memory {m:?}, redis {r:?}"));
    }
    out
}

async fn run_mode(mode: Accounting) {
    let steps = env_number("DIFFERENTIAL_STEPS").unwrap_or(STEPS);
    let seeds: Vec<u64> = match env_number::<u64>("DIFFERENTIAL_SEED") {
        Some(seed) => vec![seed],
        None => (1..=SEEDS).collect(),
    };
    for seed in seeds {
        let (mut run, _cleanup) = Run::new(seed, mode).await;
        run.run(steps).await;
    }
}

#[tokio::test]
async fn stores_agree_with_reconciled_accounting() {
    run_mode(Accounting::Reconciled).await;
}

#[tokio::test]
async fn stores_agree_with_optimistic_accounting() {
    run_mode(Accounting::Optimistic).await;
}

#[tokio::test]
async fn stores_agree_with_stale_accounting() {
    run_mode(Accounting::Stale).await;
}

// Minimal regression tests for corners where the Redis store once disagreed with the Rust core.
// The random sequences above reach each of them too, but rarely.

/// Both stores, empty, with the default ranking and reconciled accounting.
async fn fresh_pair() -> (MemoryStore, RedisStore, Cleanup) {
    fresh_pair_with(Accounting::Reconciled, &RankConfig::default()).await
}

async fn fresh_pair_with(mode: Accounting, config: &RankConfig) -> (MemoryStore, RedisStore, Cleanup) {
    let prefix = format!("diff-{}", uuid::Uuid::new_v4().simple());
    let redis = RedisStore::connect(&redis_url(), &prefix, mode, config, Expiry::DEFAULT)
        .await
        .unwrap_or_else(|err| redis_missing(err));
    let memory = MemoryStore::new(mode, config, Expiry::DEFAULT, 1);
    (memory, redis, Cleanup { prefix })
}

async fn raw_connection() -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis_url())
        .unwrap_or_else(|err| redis_missing(err))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|err| redis_missing(err))
}

/// Runs the same call on both stores and unwraps both answers.
macro_rules! both {
    ($m:expr, $r:expr, $method:ident ( $($arg:expr),* )) => {
        (
            $m.$method($($arg),*).await.expect(concat!("memory ", stringify!($method))),
            $r.$method($($arg),*).await.expect(concat!("redis ", stringify!($method))),
        )
    };
}

/// Template build IDs of the random requests and heartbeats (one a prefix of another, so a
/// match must be whole).
const TEMPLATES: [&str; 3] = ["tpl-a", "tpl-ab", "b"];

fn simple_heartbeat(seq: u64, ids: &[&str]) -> Heartbeat {
    let n = ids.len() as u32;
    Heartbeat {
        node_id: "n1".to_string(),
        boot_id: "boot-1".to_string(),
        seq,
        address: "http://n1".to_string(),
        capacity: Resources {
            vcpus: 8,
            memory_bytes: 64 * GIB,
        },
        allocated: Resources {
            vcpus: n,
            memory_bytes: u64::from(n) * GIB,
        },
        sandboxes: ids
            .iter()
            .map(|id| Listed {
                sandbox_id: id.to_string(),
                allocated: Resources {
                    vcpus: 1,
                    memory_bytes: GIB,
                },
                memory_used_bytes: 0,
            })
            .collect(),
        ..Heartbeat::default()
    }
}

async fn only_views(m: &MemoryStore, r: &RedisStore) -> (NodeView, NodeView) {
    let (mut mv, mut rv) = both!(m, r, nodes());
    (mv.pop().expect("memory node"), rv.pop().expect("redis node"))
}

/// The only node's whole view, its gauges and the running totals in Redis agree.
async fn assert_same_node(m: &MemoryStore, r: &RedisStore, cleanup: &Cleanup) {
    let (mv, rv) = only_views(m, r).await;
    let diffs = view_diffs(&mv, &rv);
    assert!(diffs.is_empty(), "views differ: {}", diffs.join("; "));
    let (mg, rg) = both!(m, r, gauges());
    assert_eq!(mg, rg, "gauges");
    if let Err(diff) = check_running_totals(&mut raw_connection().await, &cleanup.prefix, &mv).await {
        panic!("{diff}");
    }
}

#[tokio::test]
async fn ignored_heartbeat_of_a_draining_node_says_it_is_draining() {
    let (m, r, _cleanup) = fresh_pair().await;
    let hb = simple_heartbeat(1, &[]);
    both!(m, r, heartbeat(&hb, 1_000));
    both!(m, r, set_admin("n1", AdminState::Draining));
    // The same sequence number again: ignored by both, and both say the node is draining
    // (NodeView::apply_heartbeat reports it whether or not it applies the heartbeat).
    let (mo, ro) = both!(m, r, heartbeat(&hb, 1_001));
    assert!(!mo.applied && !ro.applied);
    assert!(mo.draining, "{mo:?}");
    assert_eq!(mo, ro);
}

#[tokio::test]
async fn second_removal_of_a_sandbox_replaces_its_marker() {
    let (m, r, cleanup) = fresh_pair().await;
    both!(m, r, heartbeat(&simple_heartbeat(1, &["x"]), 1_000));
    let one = Resources {
        vcpus: 1,
        memory_bytes: GIB,
    };
    let two = Resources {
        vcpus: 2,
        memory_bytes: 2 * GIB,
    };
    both!(m, r, removed("n1", "x", one));
    both!(m, r, removed("n1", "x", two));
    // NodeView::removed inserts: the marker holds 2 vCPUs, and believed is 1 - 2 = -1.
    let (mv, rv) = only_views(&m, &r).await;
    assert_eq!(mv.removals.get("x"), Some(&two));
    assert_eq!(mv.removals, rv.removals);
    assert_eq!(mv.believed(), rv.believed());
    assert_same_node(&m, &r, &cleanup).await;
    // Removed again while the node no longer lists it: the marker alone changes.
    both!(m, r, heartbeat(&simple_heartbeat(2, &["x", "y"]), 1_001));
    both!(m, r, removed("n1", "y", one));
    both!(m, r, heartbeat(&simple_heartbeat(3, &["x"]), 1_002));
    both!(m, r, removed("n1", "y", two));
    assert_same_node(&m, &r, &cleanup).await;
}

/// A pending reservation written by a placer from before pending expiry (`p,0` in Redis; a
/// place at time 0 makes the same here) starts its clock at the next heartbeat, and expires
/// the pending bound after that, alike in both stores.
#[tokio::test]
async fn a_pending_reservation_without_its_time_starts_its_clock_at_a_heartbeat() {
    let (m, r, cleanup) = fresh_pair().await;
    both!(m, r, heartbeat(&simple_heartbeat(1, &[]), 0));
    let req = Request {
        sandbox_id: "s".to_string(),
        resources: Resources {
            vcpus: 1,
            memory_bytes: GIB,
        },
        ..Request::default()
    };
    let (mp, rp) = both!(m, r, place(&req, 0));
    assert!(matches!(mp, Placement::Placed { .. }), "{mp:?}");
    assert!(matches!(rp, Placement::Placed { .. }), "{rp:?}");
    let (mo, ro) = both!(m, r, heartbeat(&simple_heartbeat(2, &[]), 50_000));
    assert!(mo.expired.is_empty() && ro.expired.is_empty(), "{mo:?} {ro:?}");
    let (mv, _) = only_views(&m, &r).await;
    assert_eq!(mv.reservations["s"].phase, Phase::Pending { since_ms: 50_000 });
    assert_same_node(&m, &r, &cleanup).await;
    let after = 50_000 + Expiry::DEFAULT.pending_ms + 1;
    let (mo, ro) = both!(m, r, heartbeat(&simple_heartbeat(3, &[]), after));
    assert_eq!(mo.expired, vec!["s".to_string()]);
    assert_eq!(mo, ro);
    assert_same_node(&m, &r, &cleanup).await;
}

#[tokio::test]
async fn place_again_with_a_reserved_id_replaces_the_reservation() {
    let (m, r, cleanup) = fresh_pair().await;
    both!(m, r, heartbeat(&simple_heartbeat(1, &[]), 1_000));
    let mut req = Request {
        sandbox_id: "s".to_string(),
        resources: Resources {
            vcpus: 1,
            memory_bytes: GIB,
        },
        ..Request::default()
    };
    both!(m, r, place(&req, 1_000));
    both!(m, r, created("n1", "s"));
    req.resources.vcpus = 2;
    both!(m, r, place(&req, 1_000));
    // NodeView::reserve inserts: 2 vCPUs, pending again (the retried create is in flight).
    let (mv, rv) = only_views(&m, &r).await;
    assert_eq!(mv.reservations["s"].resources.vcpus, 2);
    assert_eq!(mv.reservations, rv.reservations);
    assert_same_node(&m, &r, &cleanup).await;
    // And once more while still pending.
    req.resources.memory_bytes = 3 * GIB;
    both!(m, r, place(&req, 1_000));
    assert_same_node(&m, &r, &cleanup).await;
}

#[tokio::test]
async fn several_missing_labels_name_the_first_in_key_order() {
    let (m, r, _cleanup) = fresh_pair().await;
    both!(m, r, heartbeat(&simple_heartbeat(1, &[]), 1_000));
    let req = Request {
        sandbox_id: "s".to_string(),
        resources: Resources {
            vcpus: 1,
            memory_bytes: GIB,
        },
        selector: BTreeMap::from([
            ("arch".to_string(), "arm".to_string()),
            ("zone".to_string(), "c".to_string()),
        ]),
        ..Request::default()
    };
    let (mp, rp) = both!(m, r, place(&req, 1_000));
    assert_eq!(
        mp,
        Placement::NoFit {
            reason: "node n1 cannot take it: label arch=arm missing".to_string(),
            never: false,
        }
    );
    assert_eq!(mp, rp);
}

#[tokio::test]
async fn removal_of_at_least_1e14_bytes() {
    let (m, r, cleanup) = fresh_pair().await;
    both!(m, r, heartbeat(&simple_heartbeat(1, &["x"]), 1_000));
    let huge = Resources {
        vcpus: 1,
        memory_bytes: 1 << 47,
    };
    both!(m, r, removed("n1", "x", huge));
    // Lua's own formatting would have stored "1,1.4073748835533e+14", which the Redis store's
    // reader drops from the view and on which heartbeat.lua fails.
    let (mv, rv) = only_views(&m, &r).await;
    assert_eq!(mv.removals, rv.removals);
    assert_same_node(&m, &r, &cleanup).await;
    let (mo, ro) = both!(m, r, heartbeat(&simple_heartbeat(2, &["x"]), 1_001));
    assert_eq!(mo, ro);
    assert_same_node(&m, &r, &cleanup).await;
}

#[tokio::test]
async fn reservation_of_at_least_1e14_bytes() {
    let (m, r, cleanup) = fresh_pair().await;
    let mut hb = simple_heartbeat(1, &[]);
    hb.capacity.memory_bytes = 1 << 50;
    both!(m, r, heartbeat(&hb, 1_000));
    let req = Request {
        sandbox_id: "s".to_string(),
        resources: Resources {
            vcpus: 1,
            memory_bytes: (1 << 47) + 1,
        },
        ..Request::default()
    };
    let (mp, rp) = both!(m, r, place(&req, 1_000));
    assert!(matches!(mp, Placement::Placed { .. }), "{mp:?}");
    assert!(matches!(rp, Placement::Placed { .. }), "{rp:?}");
    assert_same_node(&m, &r, &cleanup).await;
    both!(m, r, created("n1", "s"));
    assert_same_node(&m, &r, &cleanup).await;
    // Not listed yet: heartbeat.lua rewrites the reservation with one more heartbeat unlisted.
    hb.seq = 2;
    let (mo, ro) = both!(m, r, heartbeat(&hb, 1_001));
    assert_eq!(mo, ro);
    assert_same_node(&m, &r, &cleanup).await;
    // A node without petabytes says so in the same words.
    hb.capacity.memory_bytes = 1 << 46;
    hb.seq = 3;
    both!(m, r, heartbeat(&hb, 1_002));
    let (mp, rp) = both!(
        m,
        r,
        place(
            &Request {
                sandbox_id: "t".to_string(),
                ..req.clone()
            },
            1_002
        )
    );
    assert!(
        matches!(&mp, Placement::NoFit { reason, .. } if reason.contains("memory")),
        "{mp:?}"
    );
    assert_eq!(mp, rp);
}

#[tokio::test]
async fn removal_without_resources_in_optimistic_accounting() {
    // A caller that does not know what the sandbox held sends zeros; subtracting them must work.
    let (m, r, _cleanup) = fresh_pair_with(Accounting::Optimistic, &RankConfig::default()).await;
    both!(m, r, heartbeat(&simple_heartbeat(1, &["x"]), 1_000));
    both!(m, r, removed("n1", "x", Resources::default()));
    let (mv, rv) = only_views(&m, &r).await;
    assert_eq!(mv.reported, rv.reported);
}

#[tokio::test]
async fn sequence_numbers_past_2_53() {
    // 2^53 + 1 is not a double: Lua numbers would take it for 2^53 and ignore the heartbeat.
    let (m, r, _cleanup) = fresh_pair().await;
    let base = 1u64 << 53;
    for (seq, now) in [
        (base, 1_000),
        (base + 1, 1_001),
        (base + 1, 1_002),
        (base, 1_003),
        (base + 3, 1_004),
    ] {
        let (mo, ro) = both!(m, r, heartbeat(&simple_heartbeat(seq, &[]), now));
        assert_eq!(mo, ro, "heartbeat seq {seq}");
    }
    let (mv, rv) = only_views(&m, &r).await;
    assert_eq!((mv.seq, rv.seq), (base + 3, base + 3));
}

#[tokio::test]
async fn cpu_rejection_reads_the_same_for_any_overcommit() {
    // Rust writes the figures of "cpu: … vCPU would exceed … (R=…)" with `{}` (shortest digits
    // that read back, never an exponent); place.lua must write the same.
    for overcommit in [1.0, 1.1, 1.5, 4.0, 0.1, 1e-7, 3.3, std::f64::consts::E, 123_456.789] {
        let config = RankConfig {
            overcommit,
            ..RankConfig::default()
        };
        let (m, r, _cleanup) = fresh_pair_with(Accounting::Reconciled, &config).await;
        let mut hb = simple_heartbeat(1, &[]);
        hb.capacity.vcpus = 3;
        both!(m, r, heartbeat(&hb, 1_000));
        let req = Request {
            sandbox_id: "s".to_string(),
            resources: Resources {
                vcpus: (3.0 * overcommit).floor() as u32 + 1,
                memory_bytes: GIB,
            },
            ..Request::default()
        };
        let (me, re) = both!(m, r, explain(&req, 1_000));
        let reason = |e: &Explanation| e.evaluated.first().and_then(|e| e.rejected.clone());
        let mr = reason(&me).expect("memory rejects");
        assert!(mr.contains("cpu: ") && mr.contains("(R="), "{mr}");
        assert_eq!(Some(mr), reason(&re), "R = {overcommit}");
    }
}

#[tokio::test]
async fn a_malformed_stored_value_fails_a_heartbeat_before_it_writes() {
    // Redis keeps what a script wrote before it failed; heartbeat.lua parses all it reads first,
    // so a value it cannot parse fails the heartbeat whole. (Only the Redis store stores text.)
    let (_m, r, cleanup) = fresh_pair().await;
    r.heartbeat(&simple_heartbeat(1, &["x"]), 1_000)
        .await
        .expect("heartbeat");
    let _: () = redis::cmd("HSET")
        .arg(format!("{}:n:n1:rm", cleanup.prefix))
        .arg("x")
        .arg("1,1.4073748835533e+14")
        .query_async(&mut raw_connection().await)
        .await
        .expect("hset");
    let err = r.heartbeat(&simple_heartbeat(2, &[]), 1_001).await.unwrap_err();
    assert!(err.to_string().contains("malformed removal x"), "{err}");
    let view = r.nodes().await.expect("nodes").pop().expect("node");
    assert_eq!((view.seq, view.last_heartbeat_ms), (1, 1_000));
    assert!(view.listed.contains("x"));
}
