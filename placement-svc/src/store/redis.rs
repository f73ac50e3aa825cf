//! The Redis store: production. Every placer replica talks to one Redis, and every operation
//! that reads and writes a node's view is one Lua script, so it is atomic and takes one round
//! trip. Redis runs scripts one at a time, which is exactly the serialisation a node's
//! accounting needs; decisions on different nodes still interleave freely between scripts.
//!
//! Layout under the key prefix `P` (one Redis, not Redis Cluster: a decision touches K nodes'
//! keys in one script):
//! - `P:nodes`: set of node ids;
//! - `P:n:ID`: hash of the node's report, admin state and running totals;
//! - `P:n:ID:res`: reservations, sandbox id → `vcpus,memory,phase,unlisted`;
//! - `P:n:ID:rm`: removals, sandbox id → `vcpus,memory`;
//! - `P:n:ID:listed`: the sandbox ids the last heartbeat listed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::SeedableRng;
use redis::aio::ConnectionManager;
use redis::{AsyncCommands, Script, Value};

use super::{Explanation, NodeGauge, Placement, PlacementStore, StoreError};
use crate::core::sample::sample_distinct;
use crate::core::{
    Accounting, AdminState, Evaluation, Expiry, Heartbeat, HeartbeatOutcome, NodeView, Phase, RankConfig, Request,
    Reservation, Resources, Totals,
};

/// How long the cached list of node ids (what sampling draws from) may be old.
const NODE_LIST_TTL: Duration = Duration::from_secs(1);

/// Nodes whose gauges, or whole views, are read in one pipeline.
const NODE_BATCH: usize = 250;

impl From<redis::RedisError> for StoreError {
    fn from(err: redis::RedisError) -> Self {
        if err.is_io_error() || err.is_connection_dropped() || err.is_connection_refusal() || err.is_timeout() {
            StoreError::Unavailable(err.to_string())
        } else {
            StoreError::Internal(err.to_string())
        }
    }
}

struct NodeList {
    ids: Arc<Vec<String>>,
    fetched: Option<Instant>,
}

/// The placer's view of every node, in Redis.
pub struct RedisStore {
    conn: ConnectionManager,
    prefix: String,
    mode: Accounting,
    rank: RankConfig,
    expiry: Expiry,
    place: Script,
    heartbeat: Script,
    lifecycle: Script,
    node_list: std::sync::RwLock<NodeList>,
    /// Whether a decision is refreshing `node_list` now.
    refreshing: AtomicBool,
    rng: Mutex<SmallRng>,
}

/// A node's four keys as read back: report hash, reservations, removals, listed set.
type NodeKeys = (
    HashMap<String, String>,
    HashMap<String, String>,
    HashMap<String, String>,
    HashSet<String>,
);

/// The winner of a decision: node id, score, address, and the pooled room to reclaim there.
type Chosen = (String, f64, String, Resources);

/// One candidate as the place script reports it.
struct Scored {
    node_id: String,
    reason: String,
    /// Too small for the ask even empty (the script's own flag, not read from `reason`).
    never: bool,
    score: f64,
    cpu: f64,
    memory: f64,
    template: f64,
}

fn text(v: &Value) -> String {
    match v {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        Value::Double(d) => d.to_string(),
        _ => String::new(),
    }
}

fn int(v: &Value) -> i64 {
    match v {
        Value::Int(i) => *i,
        other => text(other).parse().unwrap_or(0),
    }
}

/// A score or term as the place script returns it: an integer in units of 1e-12.
fn scaled(v: &Value) -> f64 {
    int(v) as f64 / 1e12
}

fn num<T: std::str::FromStr + Default>(map: &HashMap<String, String>, key: &str) -> T {
    map.get(key).and_then(|s| s.parse().ok()).unwrap_or_default()
}

impl RedisStore {
    /// Connects to `url` (`redis://127.0.0.1:6379`) and keeps reconnecting by itself; all
    /// keys live under `prefix`.
    pub async fn connect(
        url: &str,
        prefix: &str,
        mode: Accounting,
        rank: &RankConfig,
        expiry: Expiry,
    ) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::Internal(format!("bad redis url {:?}: {e}", common::config::redacted(url))))?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(2);
        let conn = ConnectionManager::new_with_config(client, config).await?;
        Ok(Self {
            conn,
            prefix: prefix.to_string(),
            mode,
            rank: rank.clone(),
            expiry,
            place: Script::new(include_str!("place.lua")),
            heartbeat: Script::new(include_str!("heartbeat.lua")),
            lifecycle: Script::new(include_str!("lifecycle.lua")),
            node_list: std::sync::RwLock::new(NodeList {
                ids: Arc::new(Vec::new()),
                fetched: None,
            }),
            refreshing: AtomicBool::new(false),
            rng: Mutex::new(SmallRng::seed_from_u64(seed_from_clock())),
        })
    }

    fn nodes_key(&self) -> String {
        format!("{}:nodes", self.prefix)
    }

    fn node_keys(&self, node_id: &str) -> [String; 4] {
        let base = format!("{}:n:{node_id}", self.prefix);
        [
            base.clone(),
            format!("{base}:res"),
            format!("{base}:rm"),
            format!("{base}:listed"),
        ]
    }

    async fn node_ids(&self, fresh: bool) -> Result<Arc<Vec<String>>, StoreError> {
        // Read-mostly: every decision reads the list, one in a second refreshes it. While one
        // refreshes, the others go on with the list they have (nodes join rarely; a burst of
        // decisions must not turn into a burst of SMEMBERS).
        if !fresh {
            if let Ok(list) = self.node_list.read() {
                let stale = list.fetched.is_none_or(|at| at.elapsed() > NODE_LIST_TTL);
                if !list.ids.is_empty() && (!stale || self.refreshing.swap(true, Ordering::AcqRel)) {
                    return Ok(list.ids.clone());
                }
            }
        }
        let fetched = self.conn.clone().smembers::<_, Vec<String>>(self.nodes_key()).await;
        self.refreshing.store(false, Ordering::Release);
        let mut ids = fetched?;
        ids.sort();
        let ids = Arc::new(ids);
        if let Ok(mut list) = self.node_list.write() {
            list.ids = ids.clone();
            list.fetched = Some(Instant::now());
        }
        Ok(ids)
    }

    fn sample(&self, n: usize, k: usize) -> Vec<usize> {
        match self.rng.lock() {
            Ok(mut rng) => sample_distinct(n, k, &mut *rng),
            Err(_) => (0..k.min(n)).collect(),
        }
    }

    /// Runs the place script over `candidates` in order; `Some(index, score)` of the winner.
    async fn run_place(
        &self,
        req: &Request,
        now_ms: u64,
        candidates: &[String],
        k: usize,
        commit: bool,
    ) -> Result<(Option<(usize, f64, String, Resources)>, Vec<Scored>), StoreError> {
        let mut invocation = self.place.prepare_invoke();
        for id in candidates {
            let [node, res, _, _] = self.node_keys(id);
            invocation.key(node).key(res);
        }
        invocation
            .arg(&req.sandbox_id)
            .arg(req.resources.vcpus)
            .arg(req.resources.memory_bytes)
            .arg(now_ms)
            .arg(self.rank.overcommit)
            .arg(self.rank.alpha)
            .arg(self.rank.cpu_weight)
            .arg(self.rank.memory_weight)
            .arg(self.rank.max_starting)
            .arg(self.rank.unhealthy_after_ms)
            .arg(self.mode.name())
            .arg(k)
            .arg(if commit { 1 } else { 0 })
            .arg(&req.template)
            .arg(self.rank.template_weight)
            .arg(if req.reclaim_pooled { 1 } else { 0 })
            .arg(req.selector.len());
        for (key, value) in &req.selector {
            invocation.arg(key).arg(value);
        }
        for id in &req.exclude {
            invocation.arg(id);
        }
        let reply: Vec<Value> = invocation.invoke_async(&mut self.conn.clone()).await?;
        let chosen = reply.first().map(int).unwrap_or(0);
        let score = reply.get(1).map(scaled).unwrap_or(0.0);
        let address = reply.get(2).map(text).unwrap_or_default();
        let reclaim = Resources {
            vcpus: u32::try_from(reply.get(3).map(int).unwrap_or(0)).unwrap_or(0),
            memory_bytes: u64::try_from(reply.get(4).map(int).unwrap_or(0)).unwrap_or(0),
        };
        let scored = reply
            .get(5..)
            .unwrap_or_default()
            .chunks(7)
            .filter(|c| c.len() == 7)
            .map(|c| Scored {
                node_id: text(&c[0]),
                reason: text(&c[1]),
                score: scaled(&c[2]),
                cpu: scaled(&c[3]),
                memory: scaled(&c[4]),
                template: int(&c[5]) as f64,
                never: int(&c[6]) == 1,
            })
            .collect();
        let chosen = usize::try_from(chosen)
            .ok()
            .filter(|&c| c > 0)
            .map(|c| (c - 1, score, address, reclaim));
        Ok((chosen, scored))
    }

    /// Best-of-K as `Ranker::decide` does it: a sample of up to 4K nodes evaluated in one
    /// script that stops at K feasible; only if none is feasible, every node is evaluated and
    /// the winner is Best-of-K among the feasible ones.
    async fn decide(
        &self,
        req: &Request,
        now_ms: u64,
        commit: bool,
    ) -> Result<(Option<Chosen>, Vec<Scored>), StoreError> {
        if let Some(only) = &req.only {
            // Pinned (a move's target): that node alone, through the same script.
            if !self.node_ids(true).await?.contains(only) {
                let unknown = crate::core::rank::unknown_node(only);
                let scored = Scored {
                    node_id: unknown.node_id,
                    reason: unknown.rejected.unwrap_or_default(),
                    never: unknown.never,
                    score: 0.0,
                    cpu: 0.0,
                    memory: 0.0,
                    template: 0.0,
                };
                return Ok((None, vec![scored]));
            }
            let candidate = [only.clone()];
            let (chosen, scored) = self.run_place(req, now_ms, &candidate, 1, commit).await?;
            return Ok((
                chosen.map(|(_, score, address, reclaim)| (only.clone(), score, address, reclaim)),
                scored,
            ));
        }
        let ids = self.node_ids(false).await?;
        let k = self.rank.k.max(1);
        let sample: Vec<String> = self
            .sample(ids.len(), (4 * k).min(ids.len()))
            .into_iter()
            .map(|i| ids[i].clone())
            .collect();
        let (chosen, scored) = self.run_place(req, now_ms, &sample, k, commit).await?;
        if let Some((i, score, address, reclaim)) = chosen {
            return Ok((Some((sample[i].clone(), score, address, reclaim)), scored));
        }
        let ids = self.node_ids(true).await?;
        if sample.len() == ids.len() {
            return Ok((None, scored));
        }
        let (_, all) = self.run_place(req, now_ms, &ids, usize::MAX, false).await?;
        let fit: Vec<usize> = (0..all.len()).filter(|&i| all[i].reason.is_empty()).collect();
        if fit.is_empty() {
            return Ok((None, all));
        }
        let best: Vec<String> = self
            .sample(fit.len(), k.min(fit.len()))
            .into_iter()
            .map(|j| ids[fit[j]].clone())
            .collect();
        let (chosen, _) = self.run_place(req, now_ms, &best, k, commit).await?;
        Ok((
            chosen.map(|(i, score, address, reclaim)| (best[i].clone(), score, address, reclaim)),
            all,
        ))
    }

    async fn lifecycle(
        &self,
        op: &str,
        node_id: &str,
        sandbox_id: &str,
        resources: Resources,
    ) -> Result<(), StoreError> {
        let [node, res, rm, listed] = self.node_keys(node_id);
        let found: i64 = self
            .lifecycle
            .key(node)
            .key(res)
            .key(rm)
            .key(listed)
            .arg(op)
            .arg(sandbox_id)
            .arg(self.mode.name())
            .arg(resources.vcpus)
            .arg(resources.memory_bytes)
            .invoke_async(&mut self.conn.clone())
            .await?;
        if found == 0 {
            return Err(StoreError::UnknownNode(node_id.to_string()));
        }
        Ok(())
    }

    async fn read_node(&self, node_id: &str) -> Result<Option<NodeView>, StoreError> {
        Ok(self.read_nodes(&[node_id.to_string()]).await?.pop())
    }

    /// The views of `ids` (those that exist), read in pipelined batches: one round trip per
    /// [`NODE_BATCH`] nodes rather than one per node.
    async fn read_nodes(&self, ids: &[String]) -> Result<Vec<NodeView>, StoreError> {
        let mut views = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(NODE_BATCH) {
            let mut pipe = redis::pipe();
            for id in chunk {
                let [node, res, rm, listed] = self.node_keys(id);
                pipe.hgetall(node).hgetall(res).hgetall(rm).smembers(listed);
            }
            let read: Vec<NodeKeys> = {
                // The reply is flat: four values a node.
                let values: Vec<Value> = pipe.query_async(&mut self.conn.clone()).await?;
                values
                    .chunks(4)
                    .map(|four| redis::from_redis_value(Value::Array(four.to_vec())))
                    .collect::<Result<_, _>>()
                    .map_err(|e| StoreError::Internal(format!("unexpected node keys in Redis: {e}")))?
            };
            views.extend(chunk.iter().zip(read).filter_map(|(id, keys)| view_from(id, keys)));
        }
        Ok(views)
    }
}

/// A node's view from its four keys as read; `None` if the node hash is gone.
fn view_from(node_id: &str, (fields, reservations, removals, listed): NodeKeys) -> Option<NodeView> {
    if fields.is_empty() {
        return None;
    }
    let parse = |value: &str| -> Option<(Resources, Vec<String>)> {
        let mut parts = value.split(',');
        let vcpus = parts.next()?.parse().ok()?;
        let memory_bytes = parts.next()?.parse().ok()?;
        Some((Resources { vcpus, memory_bytes }, parts.map(str::to_string).collect()))
    };
    let reservations = reservations
        .iter()
        .filter_map(|(id, v)| {
            let (resources, rest) = parse(v)?;
            let n = rest.get(1).and_then(|s| s.parse().ok()).unwrap_or(0);
            let phase = match rest.first().map(String::as_str) {
                Some("u") => Phase::Unconfirmed {
                    heartbeats_unlisted: u32::try_from(n).unwrap_or(u32::MAX),
                },
                _ => Phase::Pending { since_ms: n },
            };
            Some((id.clone(), Reservation { resources, phase }))
        })
        .collect();
    let removals = removals
        .iter()
        .filter_map(|(id, v)| Some((id.clone(), parse(v)?.0)))
        .collect();
    Some(NodeView {
        node_id: node_id.to_string(),
        address: fields.get("address").cloned().unwrap_or_default(),
        labels: fields
            .get("labels")
            .and_then(|l| serde_json::from_str::<BTreeMap<String, String>>(l).ok())
            .unwrap_or_default(),
        capacity: Resources {
            vcpus: num(&fields, "cap_vcpus"),
            memory_bytes: num(&fields, "cap_mem"),
        },
        admin: if fields.get("admin").map(String::as_str) == Some("draining") {
            AdminState::Draining
        } else {
            AdminState::Ready
        },
        boot_id: fields.get("boot").cloned().unwrap_or_default(),
        seq: num(&fields, "seq"),
        last_heartbeat_ms: num(&fields, "hb_ms"),
        reported: Totals {
            vcpus: num(&fields, "rep_vcpus"),
            memory_bytes: num(&fields, "rep_mem"),
        },
        reported_sandboxes: num(&fields, "rep_sbx"),
        pooled: Resources {
            vcpus: num(&fields, "pool_vcpus"),
            memory_bytes: num(&fields, "pool_mem"),
        },
        memory_used_bytes: num(&fields, "mem_used"),
        cpu_usage: num(&fields, "cpu_usage"),
        listed,
        reservations,
        removals,
        templates: fields
            .get("templates")
            .map(|t| t.split(',').filter(|id| !id.is_empty()).map(str::to_string).collect())
            .unwrap_or_default(),
    })
}

impl PlacementStore for RedisStore {
    async fn place(&self, req: &Request, now_ms: u64) -> Result<Placement, StoreError> {
        let (chosen, scored) = self.decide(req, now_ms, true).await?;
        Ok(match chosen {
            Some((node_id, score, address, reclaim)) => Placement::Placed {
                node_id,
                address,
                score,
                evaluated: scored.into_iter().map(|s| self.evaluation(s)).collect(),
                reclaim,
            },
            None => {
                let decision = crate::core::Decision {
                    chosen: None,
                    evaluated: scored.into_iter().map(|s| self.evaluation(s)).collect(),
                    scanned_all: true,
                };
                Placement::NoFit {
                    never: req.only.is_none() && decision.never_fits(),
                    reason: decision.why_nothing_fit(),
                }
            }
        })
    }

    async fn explain(&self, req: &Request, now_ms: u64) -> Result<Explanation, StoreError> {
        let (chosen, scored) = self.decide(req, now_ms, false).await?;
        Ok(Explanation {
            evaluated: scored.into_iter().map(|s| self.evaluation(s)).collect(),
            chosen: chosen.map(|(id, _, _, _)| id),
        })
    }

    async fn created(&self, node_id: &str, sandbox_id: &str) -> Result<(), StoreError> {
        self.lifecycle("created", node_id, sandbox_id, Resources::default())
            .await
    }

    async fn release(&self, node_id: &str, sandbox_id: &str) -> Result<(), StoreError> {
        self.lifecycle("release", node_id, sandbox_id, Resources::default())
            .await
    }

    async fn removed(&self, node_id: &str, sandbox_id: &str, resources: Resources) -> Result<(), StoreError> {
        self.lifecycle("removed", node_id, sandbox_id, resources).await
    }

    async fn heartbeat(&self, hb: &Heartbeat, now_ms: u64) -> Result<HeartbeatOutcome, StoreError> {
        let [node, res, rm, listed] = self.node_keys(&hb.node_id);
        let labels = serde_json::to_string(&hb.labels).unwrap_or_else(|_| "{}".to_string());
        let mut invocation = self.heartbeat.prepare_invoke();
        invocation
            .key(node)
            .key(res)
            .key(rm)
            .key(listed)
            .key(self.nodes_key())
            .arg(&hb.node_id)
            .arg(&hb.boot_id)
            .arg(hb.seq)
            .arg(now_ms)
            .arg(&hb.address)
            .arg(labels)
            .arg(hb.capacity.vcpus)
            .arg(hb.capacity.memory_bytes)
            .arg(hb.allocated.vcpus)
            .arg(hb.allocated.memory_bytes)
            .arg(hb.memory_used_bytes)
            .arg(hb.cpu_usage)
            .arg(self.mode.name())
            .arg(self.expiry.unconfirmed_heartbeats)
            .arg(templates_field(&hb.templates))
            .arg(hb.pooled.vcpus)
            .arg(hb.pooled.memory_bytes)
            .arg(self.expiry.pending_ms);
        for s in &hb.sandboxes {
            invocation.arg(&s.sandbox_id);
        }
        let reply: Vec<Value> = invocation.invoke_async(&mut self.conn.clone()).await?;
        let applied = reply.first().map(int).unwrap_or(0) == 1;
        let reason = reply.get(1).map(text).filter(|r| !r.is_empty());
        Ok(HeartbeatOutcome {
            applied,
            reason,
            confirmed: u32::try_from(reply.get(2).map(int).unwrap_or(0)).unwrap_or(0),
            removed: u32::try_from(reply.get(3).map(int).unwrap_or(0)).unwrap_or(0),
            rebooted: reply.get(4).map(int).unwrap_or(0) == 1,
            draining: reply.get(5).map(int).unwrap_or(0) == 1,
            expired: reply.get(6..).unwrap_or_default().iter().map(text).collect(),
        })
    }

    async fn nodes(&self) -> Result<Vec<NodeView>, StoreError> {
        let ids = self.node_ids(true).await?;
        self.read_nodes(&ids).await
    }

    async fn gauges(&self) -> Result<Vec<NodeGauge>, StoreError> {
        // Three counters a node, read in a few pipelined batches: this runs every few seconds
        // beside the decisions, so it must not queue a thousand round trips in front of them.
        let ids = self.node_ids(true).await?;
        let mut gauges = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(NODE_BATCH) {
            let mut pipe = redis::pipe();
            for id in chunk {
                pipe.cmd("HMGET")
                    .arg(&self.node_keys(id)[0])
                    .arg("pending")
                    .arg("unconfirmed")
                    .arg("hb_ms");
            }
            let rows: Vec<(Option<u32>, Option<u32>, Option<u64>)> = pipe.query_async(&mut self.conn.clone()).await?;
            gauges.extend(
                chunk
                    .iter()
                    .zip(rows)
                    .map(|(id, (pending, unconfirmed, hb))| NodeGauge {
                        node_id: id.clone(),
                        pending: pending.unwrap_or(0),
                        unconfirmed: unconfirmed.unwrap_or(0),
                        last_heartbeat_ms: hb.unwrap_or(0),
                    }),
            );
        }
        Ok(gauges)
    }

    async fn set_admin(&self, node_id: &str, admin: AdminState) -> Result<NodeView, StoreError> {
        let key = self.node_keys(node_id)[0].clone();
        let exists: bool = self.conn.clone().exists(&key).await?;
        if !exists {
            return Err(StoreError::UnknownNode(node_id.to_string()));
        }
        let value = match admin {
            AdminState::Ready => "ready",
            AdminState::Draining => "draining",
        };
        let _: () = self.conn.clone().hset(&key, "admin", value).await?;
        self.read_node(node_id)
            .await?
            .ok_or_else(|| StoreError::UnknownNode(node_id.to_string()))
    }
}

/// A seed that differs between replicas and restarts (sampling only needs to be fair, not
/// secret).
fn seed_from_clock() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32)
}

/// The node hash's `templates` field: `,id,id,` (IDs with a comma cannot be found, and are
/// left out).
fn templates_field(templates: &[String]) -> String {
    let mut field = String::from(",");
    for id in templates.iter().filter(|t| !t.is_empty() && !t.contains(',')) {
        field.push_str(id);
        field.push(',');
    }
    field
}

impl RedisStore {
    /// One candidate as [`crate::core::Ranker::evaluate`] reports it: the terms of non-zero weight.
    fn evaluation(&self, s: Scored) -> Evaluation {
        let feasible = s.reason.is_empty();
        let weighted = [
            (self.rank.cpu_weight, "cpu", s.cpu),
            (self.rank.memory_weight, "memory", s.memory),
            (self.rank.template_weight, "template", s.template),
        ];
        Evaluation {
            node_id: s.node_id,
            rejected: (!feasible).then_some(s.reason),
            never: !feasible && s.never,
            score: s.score,
            terms: if feasible {
                weighted
                    .into_iter()
                    .filter(|(w, _, _)| *w != 0.0)
                    .map(|(_, name, term)| (name, term))
                    .collect()
            } else {
                Vec::new()
            },
        }
    }
}
