//! One test suite for both placement stores: every test runs against the in-memory store and
//! against Redis (`SANDBOXSCHED_TEST_REDIS_URL`, default redis://127.0.0.1:6379, under a key
//! prefix of its own). Without Redis the Redis half fails, saying how to start it.

use std::collections::BTreeMap;
use std::sync::Arc;

use placement_svc::core::{
    Accounting, AdminState, Expiry, Heartbeat, Listed, NodeView, RankConfig, Request, Resources,
};
use placement_svc::store::memory::MemoryStore;
use placement_svc::store::redis::RedisStore;
use placement_svc::store::{NodeGauge, Placement, PlacementStore, StoreError};
use stack::services::redis_url;

const GIB: u64 = 1 << 30;
const ONE: Resources = Resources {
    vcpus: 1,
    memory_bytes: GIB,
};

async fn redis_store(prefix: &str, mode: Accounting) -> RedisStore {
    RedisStore::connect(&redis_url(), prefix, mode, &RankConfig::default(), Expiry::DEFAULT)
        .await
        .unwrap_or_else(|err| stack::services::redis_missing(err))
}

async fn cleanup(prefix: &str) {
    let client = redis::Client::open(redis_url()).expect("redis url");
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .expect("keys");
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL").arg(keys).query_async(&mut conn).await.expect("del");
    }
}

/// Builds one store (or, for the replica test, several sharing one truth).
enum Kind {
    Memory,
    Redis,
}

struct Fixture {
    kind: Kind,
    prefix: String,
}

impl Fixture {
    fn new(kind: Kind) -> Self {
        Self {
            kind,
            prefix: format!("test-{}", uuid::Uuid::new_v4().simple()),
        }
    }

    async fn with<F, Fut>(&self, test: F)
    where
        F: Fn(Arc<dyn Fn() -> StoreBox + Send + Sync>) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        match self.kind {
            Kind::Memory => {
                let store = Arc::new(MemoryStore::new(
                    Accounting::Reconciled,
                    &RankConfig::default(),
                    Expiry::DEFAULT,
                    7,
                ));
                test(Arc::new(move || StoreBox::Memory(store.clone()))).await;
            }
            Kind::Redis => {
                let a = Arc::new(redis_store(&self.prefix, Accounting::Reconciled).await);
                let b = Arc::new(redis_store(&self.prefix, Accounting::Reconciled).await);
                let flip = Arc::new(std::sync::atomic::AtomicBool::new(false));
                // Each call hands out the other replica: two placers, one truth.
                test(Arc::new(move || {
                    let other = flip.fetch_xor(true, std::sync::atomic::Ordering::Relaxed);
                    StoreBox::Redis(if other { b.clone() } else { a.clone() })
                }))
                .await;
                cleanup(&self.prefix).await;
            }
        }
    }
}

#[derive(Clone)]
enum StoreBox {
    Memory(Arc<MemoryStore>),
    Redis(Arc<RedisStore>),
}

macro_rules! call {
    ($store:expr, $method:ident ( $($arg:expr),* )) => {
        match &$store {
            StoreBox::Memory(s) => s.$method($($arg),*).await,
            StoreBox::Redis(s) => s.$method($($arg),*).await,
        }
    };
}

fn heartbeat(node: &str, seq: u64, ids: &[&str]) -> Heartbeat {
    let n = ids.len() as u32;
    Heartbeat {
        node_id: node.to_string(),
        boot_id: "boot-1".to_string(),
        seq,
        address: format!("http://{node}"),
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
                allocated: ONE,
                memory_used_bytes: GIB / 2,
            })
            .collect(),
        ..Heartbeat::default()
    }
}

fn request(id: &str) -> Request {
    Request {
        sandbox_id: id.to_string(),
        resources: ONE,
        ..Request::default()
    }
}

async fn view(store: &StoreBox, node: &str) -> NodeView {
    let nodes = call!(store, nodes()).expect("nodes");
    nodes.into_iter().find(|n| n.node_id == node).expect("node registered")
}

async fn placed_on(store: &StoreBox, id: &str, now: u64) -> String {
    match call!(store, place(&request(id), now)).expect("place") {
        Placement::Placed { node_id, .. } => node_id,
        Placement::NoFit { reason, .. } => panic!("{id} did not fit: {reason}"),
    }
}

macro_rules! for_both_stores {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test]
            async fn $name() { super::Fixture::new(super::Kind::Memory).with(super::$name).await })*
        }
        mod redis_store {
            $(#[tokio::test]
            async fn $name() { super::Fixture::new(super::Kind::Redis).with(super::$name).await })*
        }
    };
}

type Stores = Arc<dyn Fn() -> StoreBox + Send + Sync>;

for_both_stores!(
    accounting_follows_sandbox_ids,
    failed_create_is_released_at_once,
    stale_sequence_is_ignored_and_new_boot_resets,
    nothing_fits_says_why,
    draining_node_gets_nothing,
    unconfirmed_reservation_expires,
    burst_spreads_with_exact_accounting,
    explain_reserves_nothing,
    labels_and_exclusions_steer_the_choice,
    gauges_count_reservations_by_phase,
    unknown_node_is_an_error,
    a_pinned_place_checks_and_reserves_only_that_node,
    a_node_holding_the_template_wins_only_while_not_much_busier,
    a_create_may_count_pooled_room_as_free_and_is_told_what_to_reclaim,
);

async fn accounting_follows_sandbox_ids(stores: Stores) {
    let s = stores();
    call!(s, heartbeat(&heartbeat("n1", 1, &[]), 1_000)).unwrap();
    assert_eq!(placed_on(&stores(), "s1", 1_000).await, "n1");
    assert_eq!(view(&s, "n1").await.believed().vcpus, 1);
    call!(stores(), created("n1", "s1")).unwrap();
    // Measured before the create landed: the reservation stays.
    call!(s, heartbeat(&heartbeat("n1", 2, &[]), 1_100)).unwrap();
    assert_eq!(view(&s, "n1").await.believed().vcpus, 1);
    let out = call!(stores(), heartbeat(&heartbeat("n1", 3, &["s1"]), 1_200)).unwrap();
    assert_eq!(out.confirmed, 1);
    let v = view(&s, "n1").await;
    assert!(v.reservations.is_empty());
    assert_eq!(v.believed().vcpus, 1);
    call!(stores(), removed("n1", "s1", ONE)).unwrap();
    assert_eq!(view(&s, "n1").await.believed().vcpus, 0);
    // A heartbeat measured before the kill still lists it: subtracted exactly once.
    call!(s, heartbeat(&heartbeat("n1", 4, &["s1"]), 1_300)).unwrap();
    assert_eq!(view(&s, "n1").await.believed().vcpus, 0);
    let out = call!(s, heartbeat(&heartbeat("n1", 5, &[]), 1_400)).unwrap();
    assert_eq!(out.removed, 1);
    let v = view(&s, "n1").await;
    assert!(v.removals.is_empty());
    assert_eq!(v.believed().vcpus, 0);
}

async fn failed_create_is_released_at_once(stores: Stores) {
    let s = stores();
    call!(s, heartbeat(&heartbeat("n1", 1, &[]), 1_000)).unwrap();
    placed_on(&s, "s1", 1_000).await;
    call!(stores(), release("n1", "s1")).unwrap();
    let v = view(&s, "n1").await;
    assert_eq!((v.believed().vcpus, v.pending()), (0, 0));
}

async fn stale_sequence_is_ignored_and_new_boot_resets(stores: Stores) {
    let s = stores();
    call!(s, heartbeat(&heartbeat("n1", 5, &["a", "b"]), 1_000)).unwrap();
    let out = call!(stores(), heartbeat(&heartbeat("n1", 5, &[]), 1_001)).unwrap();
    assert!(!out.applied);
    assert!(out.reason.unwrap().contains("not newer"));
    assert_eq!(view(&s, "n1").await.believed().vcpus, 2);
    let mut reboot = heartbeat("n1", 1, &["a"]);
    reboot.boot_id = "boot-2".to_string();
    let out = call!(s, heartbeat(&reboot, 1_002)).unwrap();
    assert!(out.applied && out.rebooted);
    assert_eq!(view(&s, "n1").await.believed().vcpus, 1);
}

async fn nothing_fits_says_why(stores: Stores) {
    let s = stores();
    call!(s, heartbeat(&heartbeat("n1", 1, &[]), 1_000)).unwrap();
    let mut big = request("big");
    big.resources.memory_bytes = 65 * GIB;
    match call!(s, place(&big, 1_000)).unwrap() {
        Placement::NoFit { reason, never } => {
            assert!(reason.contains("memory"), "{reason}");
            assert!(never, "larger than the only node, even empty: {reason}");
        }
        other => panic!("expected no fit, got {other:?}"),
    }
    let mut labelled = request("l");
    labelled.selector = BTreeMap::from([("gpu".to_string(), "yes".to_string())]);
    match call!(s, place(&labelled, 1_000)).unwrap() {
        Placement::NoFit { reason, .. } => assert!(reason.contains("label"), "{reason}"),
        other => panic!("expected no fit, got {other:?}"),
    }
    // Long without a heartbeat: unhealthy.
    match call!(s, place(&request("late"), 60_000)).unwrap() {
        Placement::NoFit { reason, .. } => assert!(reason.contains("unhealthy"), "{reason}"),
        other => panic!("expected no fit, got {other:?}"),
    }
    assert_eq!(
        view(&s, "n1").await.believed().vcpus,
        0,
        "a refused place reserved something"
    );
}

async fn draining_node_gets_nothing(stores: Stores) {
    let s = stores();
    for node in ["n1", "n2"] {
        call!(s, heartbeat(&heartbeat(node, 1, &[]), 1_000)).unwrap();
    }
    let v = call!(s, set_admin("n1", AdminState::Draining)).unwrap();
    assert_eq!(v.admin, AdminState::Draining);
    for i in 0..10 {
        assert_eq!(placed_on(&stores(), &format!("s{i}"), 1_000).await, "n2");
    }
    call!(s, set_admin("n1", AdminState::Ready)).unwrap();
    assert_eq!(view(&s, "n1").await.admin, AdminState::Ready);
}

async fn unconfirmed_reservation_expires(stores: Stores) {
    let s = stores();
    call!(s, heartbeat(&heartbeat("n1", 1, &[]), 1_000)).unwrap();
    placed_on(&s, "ghost", 1_000).await;
    call!(s, created("n1", "ghost")).unwrap();
    for seq in 2..=4 {
        let out = call!(s, heartbeat(&heartbeat("n1", seq, &[]), 1_000 + seq)).unwrap();
        assert!(out.expired.is_empty());
    }
    let out = call!(s, heartbeat(&heartbeat("n1", 5, &[]), 1_005)).unwrap();
    assert_eq!(out.expired, vec!["ghost".to_string()]);
    assert_eq!(view(&s, "n1").await.believed().vcpus, 0);
}

async fn burst_spreads_with_exact_accounting(stores: Stores) {
    let s = stores();
    for node in ["n1", "n2", "n3", "n4"] {
        call!(s, heartbeat(&heartbeat(node, 1, &[]), 1_000)).unwrap();
    }
    let mut tasks = Vec::new();
    for i in 0..64 {
        let store = stores();
        tasks.push(tokio::spawn(
            async move { placed_on(&store, &format!("b{i}"), 1_000).await },
        ));
    }
    let mut per_node: BTreeMap<String, u32> = BTreeMap::new();
    for t in tasks {
        *per_node.entry(t.await.unwrap()).or_default() += 1;
    }
    let nodes = call!(s, nodes()).unwrap();
    let believed: i64 = nodes.iter().map(|n| n.believed().vcpus).sum();
    let reserved: usize = nodes.iter().map(|n| n.reservations.len()).sum();
    assert_eq!((believed, reserved), (64, 64), "every placement reserved exactly once");
    for n in &nodes {
        assert_eq!(n.believed().vcpus, i64::from(per_node[&n.node_id]));
    }
    // Best-of-3 over 4 nodes with exact accounting: nobody runs away.
    assert!(per_node.values().all(|&c| (12..=20).contains(&c)), "{per_node:?}");
}

async fn explain_reserves_nothing(stores: Stores) {
    let s = stores();
    call!(s, heartbeat(&heartbeat("n1", 1, &["x", "y"]), 1_000)).unwrap();
    call!(s, heartbeat(&heartbeat("n2", 1, &[]), 1_000)).unwrap();
    let e = call!(s, explain(&request("q"), 1_000)).unwrap();
    assert_eq!(e.chosen.as_deref(), Some("n2"));
    assert_eq!(e.evaluated.len(), 2);
    let n1 = e.evaluated.iter().find(|c| c.node_id == "n1").unwrap();
    let n2 = e.evaluated.iter().find(|c| c.node_id == "n2").unwrap();
    assert!(n1.score > n2.score);
    assert!(n1.terms.iter().any(|(name, _)| *name == "cpu"));
    let nodes = call!(s, nodes()).unwrap();
    assert!(nodes.iter().all(|n| n.reservations.is_empty()));
}

async fn labels_and_exclusions_steer_the_choice(stores: Stores) {
    let s = stores();
    let labelled = |node: &str, labels: &[(&str, &str)]| {
        let mut hb = heartbeat(node, 1, &[]);
        hb.labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        hb
    };
    call!(s, heartbeat(&labelled("n1", &[("gpu", "yes"), ("zone", "a")]), 1_000)).unwrap();
    call!(s, heartbeat(&labelled("n2", &[("gpu", "yes"), ("zone", "b")]), 1_000)).unwrap();
    call!(s, heartbeat(&labelled("n3", &[]), 1_000)).unwrap();
    let mut req = request("q");
    req.selector = BTreeMap::from([
        ("gpu".to_string(), "yes".to_string()),
        ("zone".to_string(), "b".to_string()),
    ]);
    let e = call!(s, explain(&req, 1_000)).unwrap();
    assert_eq!(e.chosen.as_deref(), Some("n2"), "{:?}", e.evaluated);
    // The scores arrive exactly enough to show: an empty node's CPU term is 1 vCPU over
    // 8 vCPUs times the over-commit.
    let n2 = e.evaluated.iter().find(|c| c.node_id == "n2").unwrap();
    let cpu = n2
        .terms
        .iter()
        .find(|(name, _)| *name == "cpu")
        .map(|(_, v)| *v)
        .unwrap();
    let expected = 1.0 / (8.0 * RankConfig::default().overcommit);
    assert!((cpu - expected).abs() < 1e-9, "cpu term {cpu}, expected {expected}");
    let n3 = e.evaluated.iter().find(|c| c.node_id == "n3").unwrap();
    assert!(n3.rejected.as_deref().is_some_and(|r| r.contains("label")), "{n3:?}");

    req.selector = BTreeMap::from([("gpu".to_string(), "yes".to_string())]);
    req.exclude = ["n2".to_string()].into_iter().collect();
    for i in 0..5 {
        req.sandbox_id = format!("s{i}");
        match call!(stores(), place(&req, 1_000)).unwrap() {
            Placement::Placed { node_id, .. } => assert_eq!(node_id, "n1"),
            other => panic!("expected a placement, got {other:?}"),
        }
    }
    assert_eq!(view(&s, "n1").await.believed().vcpus, 5);
}

async fn gauges_count_reservations_by_phase(stores: Stores) {
    let s = stores();
    call!(s, heartbeat(&heartbeat("n1", 1, &[]), 1_000)).unwrap();
    for id in ["a", "b", "c"] {
        assert_eq!(placed_on(&stores(), id, 1_000).await, "n1");
    }
    call!(stores(), created("n1", "a")).unwrap();
    let gauges = call!(s, gauges()).unwrap();
    assert_eq!(
        gauges,
        vec![NodeGauge {
            node_id: "n1".to_string(),
            pending: 2,
            unconfirmed: 1,
            last_heartbeat_ms: 1_000,
        }]
    );
    // The gauges agree with the whole view.
    assert_eq!(gauges[0], NodeGauge::of(&view(&s, "n1").await));
}

async fn unknown_node_is_an_error(stores: Stores) {
    let s = stores();
    assert!(matches!(
        call!(s, created("nope", "s")),
        Err(StoreError::UnknownNode(_))
    ));
    assert!(matches!(
        call!(s, set_admin("nope", AdminState::Draining)),
        Err(StoreError::UnknownNode(_))
    ));
    match call!(s, place(&request("s"), 1_000)).unwrap() {
        Placement::NoFit { reason, .. } => assert!(reason.contains("no nodes"), "{reason}"),
        other => panic!("expected no fit, got {other:?}"),
    }
}

/// A balancer move's target: placed only there, under the same checks, reserved like a
/// create; refused with that node's own reason, and for a node placement does not know.
async fn a_pinned_place_checks_and_reserves_only_that_node(stores: Stores) {
    let s = stores();
    for node in ["n1", "n2"] {
        call!(s, heartbeat(&heartbeat(node, 1, &[]), 1_000)).unwrap();
    }
    let mut pinned = request("moving");
    pinned.only = Some("n2".into());
    for _ in 0..3 {
        match call!(s, place(&pinned, 1_000)).unwrap() {
            Placement::Placed { node_id, .. } => assert_eq!(node_id, "n2"),
            other => panic!("expected n2, got {other:?}"),
        }
    }
    assert_eq!(
        view(&s, "n2").await.believed().vcpus,
        1,
        "one reservation, however often asked"
    );
    assert_eq!(view(&s, "n1").await.believed().vcpus, 0);
    call!(s, set_admin("n2", AdminState::Draining)).unwrap();
    let mut refused = request("other");
    refused.only = Some("n2".into());
    match call!(s, place(&refused, 1_000)).unwrap() {
        Placement::NoFit { reason, .. } => assert!(reason.contains("n2") && reason.contains("draining"), "{reason}"),
        other => panic!("expected no fit, got {other:?}"),
    }
    refused.only = Some("nowhere".into());
    match call!(s, place(&refused, 1_000)).unwrap() {
        Placement::NoFit { reason, .. } => assert!(reason.contains("unknown node"), "{reason}"),
        other => panic!("expected no fit, got {other:?}"),
    }
}

async fn a_node_holding_the_template_wins_only_while_not_much_busier(stores: Stores) {
    let s = stores();
    let holding = |node: &str, seq: u64, ids: &[&str]| {
        let mut hb = heartbeat(node, seq, ids);
        hb.templates = vec!["tpl-build".to_string()];
        hb
    };
    call!(s, heartbeat(&holding("n1", 1, &[]), 1_000)).unwrap();
    call!(s, heartbeat(&heartbeat("n2", 1, &[]), 1_000)).unwrap();
    let mut req = request("q");
    req.template = "tpl-build".to_string();
    let e = call!(s, explain(&req, 1_000)).unwrap();
    assert_eq!(e.chosen.as_deref(), Some("n1"), "{:?}", e.evaluated);
    let term = |node: &str| {
        let c = e.evaluated.iter().find(|c| c.node_id == node).unwrap();
        c.terms.iter().find(|(name, _)| *name == "template").map(|(_, v)| *v)
    };
    assert_eq!((term("n1"), term("n2")), (Some(0.0), Some(1.0)));
    // A prefix of the ID is not the template.
    req.template = "tpl".to_string();
    let e = call!(s, explain(&req, 1_000)).unwrap();
    assert!(
        e.evaluated.iter().all(|c| c.terms.contains(&("template", 1.0))),
        "{:?}",
        e.evaluated
    );
    // Three sandboxes busier (CPU and memory shares past the term's weight): the other node.
    call!(s, heartbeat(&holding("n1", 2, &["a", "b", "c"]), 1_100)).unwrap();
    req.template = "tpl-build".to_string();
    let e = call!(s, explain(&req, 1_100)).unwrap();
    assert_eq!(e.chosen.as_deref(), Some("n2"), "{:?}", e.evaluated);
}

async fn a_create_may_count_pooled_room_as_free_and_is_told_what_to_reclaim(stores: Stores) {
    let s = stores();
    // n1: 60 GiB allocated, 8 GiB of it pooled sandboxes; n2: 62 GiB, none pooled.
    let mut n1 = heartbeat("n1", 1, &["a", "b"]);
    n1.allocated = Resources {
        vcpus: 4,
        memory_bytes: 60 * GIB,
    };
    n1.pooled = Resources {
        vcpus: 2,
        memory_bytes: 8 * GIB,
    };
    let mut n2 = heartbeat("n2", 1, &["c"]);
    n2.allocated = Resources {
        vcpus: 4,
        memory_bytes: 62 * GIB,
    };
    call!(s, heartbeat(&n1, 1_000)).unwrap();
    call!(s, heartbeat(&n2, 1_000)).unwrap();
    assert_eq!(
        view(&s, "n1").await.pooled.memory_bytes,
        8 * GIB,
        "the heartbeat's pooled room is kept"
    );
    let mut six = request("six");
    six.resources.memory_bytes = 6 * GIB;
    match call!(s, place(&six, 1_000)).unwrap() {
        Placement::NoFit { reason, never } => {
            assert!(reason.contains("memory"), "{reason}");
            assert!(!never, "it fits once pooled sandboxes go: {reason}");
        }
        other => panic!("pooled room is not free unless asked: {other:?}"),
    }
    six.reclaim_pooled = true;
    let explained = call!(s, explain(&six, 1_000)).unwrap();
    assert_eq!(explained.chosen.as_deref(), Some("n1"), "{explained:?}");
    match call!(s, place(&six, 1_000)).unwrap() {
        Placement::Placed { node_id, reclaim, .. } => {
            assert_eq!(node_id, "n1", "only n1 has pooled room");
            assert_eq!(
                reclaim,
                Resources {
                    vcpus: 0,
                    memory_bytes: 2 * GIB
                },
                "60 + 6 - 64 GiB must go"
            );
        }
        other => panic!("expected n1, got {other:?}"),
    }
    assert_eq!(
        view(&s, "n1").await.pooled.memory_bytes,
        6 * GIB,
        "the 2 GiB reclaimed are promised: no other create counts on them"
    );
    // n1 now believes 66 GiB; a 1 GiB create fits n2 as it is, which wins over reclaiming.
    let mut one = request("one");
    one.reclaim_pooled = true;
    match call!(s, place(&one, 1_000)).unwrap() {
        Placement::Placed { node_id, reclaim, .. } => {
            assert_eq!((node_id.as_str(), reclaim), ("n2", Resources::default()));
        }
        other => panic!("expected n2, got {other:?}"),
    }
}
