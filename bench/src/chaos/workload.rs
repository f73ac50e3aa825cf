//! The workload: clients that use the cluster as E2B's SDK does (creates, commands, file
//! writes, pauses, resumes, kills through the gateways' REST and envd routes) and an operator
//! that drains nodes, all while faults land. Every answer a client gets goes into the
//! history the checker later holds the cluster to.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::balance::v1 as balance_pb;
use proto::balance::v1::balance_client::BalanceClient;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use super::check::Event;
use super::cluster::API_KEY;

/// Sandboxes one client keeps at most.
const PER_CLIENT: usize = 5;
/// A request's bound: a frozen or dead service costs a client at most this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Known {
    Running,
    Paused,
    /// A pause or resume whose answer was lost.
    Unknown,
}

struct Owned {
    id: String,
    token: String,
    state: Known,
    writes: u32,
}

/// What every client shares: where the gateways are, the history, the figures.
pub struct Shared {
    pub gateways: Vec<String>,
    pub http: reqwest::Client,
    pub stop: AtomicBool,
    pub history: Mutex<Vec<Event>>,
    /// Every acknowledged sandbox's envd access token, to read its files back at the end.
    pub tokens: Mutex<std::collections::BTreeMap<String, String>>,
    pub tally: Mutex<Tally>,
}

/// Requests made and answered, per kind, and the longest time a client saw only failures.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    pub ops: std::collections::BTreeMap<&'static str, (u64, u64)>,
    pub acked_creates: u64,
    pub longest_unavailable: Duration,
    pub drains: u64,
}

impl Shared {
    pub fn new(gateways: Vec<String>) -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            gateways,
            http: reqwest::Client::builder().timeout(REQUEST_TIMEOUT).build()?,
            stop: AtomicBool::new(false),
            history: Mutex::new(Vec::new()),
            tokens: Mutex::new(std::collections::BTreeMap::new()),
            tally: Mutex::new(Tally::default()),
        }))
    }

    fn record(&self, event: Event) {
        self.history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(event);
    }

    fn count(&self, kind: &'static str, ok: bool) {
        let mut tally = self.tally.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = tally.ops.entry(kind).or_default();
        entry.0 += 1;
        entry.1 += u64::from(ok);
    }
}

/// One client: its own sandboxes, its own seeded choices, until told to stop.
pub async fn client(n: u64, seed: u64, shared: Arc<Shared>) {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(n));
    let mut owned: Vec<Owned> = Vec::new();
    let mut failing_since: Option<Instant> = None;
    let mut longest = Duration::ZERO;
    while !shared.stop.load(Ordering::Relaxed) {
        let gateway = shared.gateways[rng.random_range(0..shared.gateways.len())].clone();
        let ok = if owned.is_empty() || (owned.len() < PER_CLIENT && rng.random_bool(0.3)) {
            create(&shared, &gateway, &mut rng)
                .await
                .map(|s| owned.push(s))
                .is_some()
        } else {
            let at = rng.random_range(0..owned.len());
            let roll = rng.random_range(0..100);
            if roll < 8 {
                let sandbox = owned.swap_remove(at);
                kill(&shared, &gateway, &sandbox).await
            } else {
                act(&shared, &gateway, &mut owned[at], roll, n).await
            }
        };
        match (ok, failing_since) {
            (true, Some(since)) => {
                longest = longest.max(since.elapsed());
                failing_since = None;
            }
            (false, None) => failing_since = Some(Instant::now()),
            _ => {}
        }
        // Pacing between requests, not synchronisation: a client thinks between calls.
        tokio::time::sleep(Duration::from_millis(rng.random_range(10..60))).await;
    }
    if let Some(since) = failing_since {
        longest = longest.max(since.elapsed());
    }
    let mut tally = shared.tally.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    tally.longest_unavailable = tally.longest_unavailable.max(longest);
}

/// A create, retried under its Idempotency-Key (on either gateway) when the answer is lost,
/// so a sandbox made by a first try is learned of rather than left unknown.
async fn create(shared: &Shared, first: &str, rng: &mut StdRng) -> Option<Owned> {
    let key = uuid::Uuid::new_v4().to_string();
    let body = json!({"templateID": "base", "timeout": 3600}).to_string();
    for attempt in 0..3 {
        let gateway = if attempt == 0 {
            first.to_string()
        } else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            shared.gateways[rng.random_range(0..shared.gateways.len())].clone()
        };
        let answer = shared
            .http
            .post(format!("{gateway}/sandboxes"))
            .header("X-API-Key", API_KEY)
            .header("Idempotency-Key", &key)
            .header("Content-Type", "application/json")
            .body(body.clone())
            .send()
            .await;
        let Ok(response) = answer else { continue };
        if !matches!(response.status().as_u16(), 200 | 201) {
            continue;
        }
        let Ok(sandbox) = response.json::<serde_json::Value>().await else {
            continue;
        };
        let (Some(id), Some(token)) = (sandbox["sandboxID"].as_str(), sandbox["envdAccessToken"].as_str()) else {
            continue;
        };
        shared.record(Event::Created { id: id.to_string() });
        shared
            .tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id.to_string(), token.to_string());
        shared.count("create", true);
        shared
            .tally
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .acked_creates += 1;
        return Some(Owned {
            id: id.to_string(),
            token: token.to_string(),
            state: Known::Running,
            writes: 0,
        });
    }
    shared.count("create", false);
    None
}

/// A kill: recorded as deliberate before it is sent, whatever the answer.
async fn kill(shared: &Shared, gateway: &str, sandbox: &Owned) -> bool {
    shared.record(Event::Ended { id: sandbox.id.clone() });
    let ok = shared
        .http
        .delete(format!("{gateway}/sandboxes/{}", sandbox.id))
        .header("X-API-Key", API_KEY)
        .send()
        .await
        .is_ok_and(|r| matches!(r.status().as_u16(), 204 | 404));
    shared.count("kill", ok);
    ok
}

/// Something done to a sandbox the client owns: a file written, a command run, a pause or a
/// resume. A paused sandbox (or one whose state is unknown) is resumed first where the act
/// needs it running.
async fn act(shared: &Shared, gateway: &str, sandbox: &mut Owned, roll: u32, client: u64) -> bool {
    if roll < 25 && sandbox.state == Known::Running {
        return pause(shared, gateway, sandbox).await;
    }
    if sandbox.state != Known::Running {
        return resume(shared, gateway, sandbox).await;
    }
    if roll < 60 {
        sandbox.writes += 1;
        let path = format!("/tmp/chaos-{client}-{}", sandbox.writes);
        let content = format!("{}:{}:{}", sandbox.id, sandbox.writes, uuid::Uuid::new_v4().simple());
        let ok = shared
            .http
            .post(format!("{gateway}/files?path={path}&username=user"))
            .header("E2b-Sandbox-Id", &sandbox.id)
            .header("X-Access-Token", &sandbox.token)
            .header("Content-Type", "application/octet-stream")
            .body(content.clone())
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            shared.record(Event::Wrote {
                id: sandbox.id.clone(),
                path,
                content,
            });
        }
        shared.count("write", ok);
        ok
    } else {
        let process = json!({"cmd": "/bin/sh", "args": ["-c", "true"]});
        let ok = crate::fixture::run_in(&shared.http, gateway, (&sandbox.id, &sandbox.token), process)
            .await
            .is_ok();
        shared.count("command", ok);
        ok
    }
}

async fn pause(shared: &Shared, gateway: &str, sandbox: &mut Owned) -> bool {
    let answer = shared
        .http
        .post(format!("{gateway}/sandboxes/{}/pause", sandbox.id))
        .header("X-API-Key", API_KEY)
        .send()
        .await;
    let ok = answer.is_ok_and(|r| matches!(r.status().as_u16(), 204 | 409));
    sandbox.state = if ok { Known::Paused } else { Known::Unknown };
    shared.count("pause", ok);
    ok
}

async fn resume(shared: &Shared, gateway: &str, sandbox: &mut Owned) -> bool {
    let answer = shared
        .http
        .post(format!("{gateway}/sandboxes/{}/connect", sandbox.id))
        .header("X-API-Key", API_KEY)
        .header("Content-Type", "application/json")
        .body(json!({"timeout": 3600}).to_string())
        .send()
        .await;
    let ok = answer.is_ok_and(|r| matches!(r.status().as_u16(), 200 | 201));
    sandbox.state = if ok { Known::Running } else { Known::Unknown };
    shared.count("resume", ok);
    ok
}

/// The operator: drains a node every few seconds and undoes it a few seconds later, so
/// sandboxes move while faults land.
pub async fn operator(seed: u64, balance: String, nodes: Vec<String>, certs: stack::Certs, shared: Arc<Shared>) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x000d_5a17);
    while !shared.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(3_000..6_000))).await;
        let node = nodes[rng.random_range(0..nodes.len())].clone();
        if drain(&balance, &node, false, &certs).await {
            shared
                .tally
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .drains += 1;
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(2_000..4_000))).await;
        drain(&balance, &node, true, &certs).await;
    }
}

/// Asks balance-svc to drain `node` (or to stop draining it); true when it answered.
pub async fn drain(balance: &str, node: &str, undo: bool, certs: &stack::Certs) -> bool {
    let Ok(channel) = certs.endpoint(balance, stack::Role::Balance) else {
        return false;
    };
    let connecting = channel.connect_timeout(Duration::from_secs(2)).timeout(REQUEST_TIMEOUT);
    let Ok(channel) = connecting.connect().await else {
        return false;
    };
    BalanceClient::new(channel)
        .drain(balance_pb::DrainRequest {
            node_id: node.to_string(),
            undo,
        })
        .await
        .is_ok()
}
