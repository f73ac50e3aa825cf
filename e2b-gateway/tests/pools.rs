//! Warm pools through the REST API with a real ledger, placement and container node: who may
//! size a pool, a create that takes a ready sandbox as its own (env vars, metadata, token),
//! concurrent creates that never share one, refill, a pool emptied, and pooled sandboxes
//! evicted before a create is refused for room.

mod support;

use std::collections::HashSet;
use std::time::Duration;

use common::pool::{PoolSlotDoc, POOL_SLOT_KIND};
use serde_json::Value;
use support::{assert_e2b_error, stack, ADMIN_TOKEN};

async fn as_operator(s: &support::Stack, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .request(method.parse().unwrap(), format!("{}{path}", s.url()))
        .header("X-Admin-Token", ADMIN_TOKEN);
    if let Some(body) = body {
        req = req.header("Content-Type", "application/json").body(body.to_string());
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The sandboxes the pool's slots hold, once `n` are ready (as the gateway reports them).
async fn ready(s: &support::Stack, template: &str, n: u64) -> HashSet<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let (status, pool) = as_operator(s, "GET", &format!("/templates/{template}/pool"), None).await;
        assert_eq!(status, 200, "{pool}");
        if pool["ready"] == n {
            let (slots, _) = s.ledger_client.list::<PoolSlotDoc>(POOL_SLOT_KIND, "").await.unwrap();
            return slots.into_iter().map(|d| d.value.sandbox_id).collect();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pool of {template} never had {n} ready: {pool}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn envs(s: &support::Stack, id: &str, token: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .get(format!("{}/envs", s.url()))
        .header("E2b-Sandbox-Id", id)
        .header("X-Access-Token", token)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_takes_a_ready_pooled_sandbox_as_its_own_and_the_pool_refills() {
    let s = stack(8192).await;
    // A public built-in is the operators' to pool, never a team's.
    assert_e2b_error(
        &s.call("PUT", "/templates/base/pool", Some("key-a"), Some(r#"{"size": 2}"#))
            .await,
        403,
    );
    assert_e2b_error(&s.call("GET", "/pools", Some("key-a"), None).await, 401);
    for bad in [
        r#"{"size": 65}"#,
        r#"{"size": -1}"#,
        r#"{"size": "2"}"#,
        r#"{}"#,
        r#"{"size": 1, "x": 1}"#,
    ] {
        assert_e2b_error(&as_operator(&s, "PUT", "/templates/base/pool", Some(bad)).await, 400);
    }
    assert_e2b_error(
        &as_operator(&s, "PUT", "/templates/no-such/pool", Some(r#"{"size": 1}"#)).await,
        404,
    );
    let (status, set) = as_operator(&s, "PUT", "/templates/base/pool", Some(r#"{"size": 2}"#)).await;
    assert_eq!(status, 200, "{set}");
    assert_eq!(
        (set["size"].as_u64(), set["setBy"].as_str()),
        (Some(2), Some("operator"))
    );

    let pooled = ready(&s, "base", 2).await;
    assert_eq!(pooled.len(), 2);
    // Nobody's yet: no team lists, reads or reaches a pooled sandbox.
    let (_, listed) = s.call("GET", "/sandboxes", Some("key-a"), None).await;
    assert_eq!(listed, serde_json::json!([]), "{listed}");
    for id in &pooled {
        assert_eq!(
            s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await.0,
            404
        );
        let (status, _) = envs(&s, id, "0".repeat(32).as_str()).await;
        assert!(
            status == 401 || status == 404 || status == 502,
            "a pooled sandbox answered: {status}"
        );
    }

    let body = r#"{"templateID": "base", "envVars": {"POOL_TEST": "mine"}, "metadata": {"who": "a"}}"#;
    let (status, created) = s.call("POST", "/sandboxes", Some("key-a"), Some(body)).await;
    assert_eq!(status, 201, "{created}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    let token = created["envdAccessToken"].as_str().unwrap().to_string();
    assert!(pooled.contains(&id), "{id} was not taken from the pool {pooled:?}");
    let (status, env) = envs(&s, &id, &token).await;
    assert_eq!(status, 200, "{env}");
    assert_eq!(
        env["POOL_TEST"], "mine",
        "envd did not take the claim's env vars: {env}"
    );
    let (status, detail) = s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(status, 200, "{detail}");
    assert_eq!(detail["metadata"]["who"], "a");
    assert_eq!(
        s.call("GET", &format!("/sandboxes/{id}"), Some("key-b"), None).await.0,
        404
    );

    // The pool fills again with sandboxes of its own, and the claimed one is the team's.
    let refilled = ready(&s, "base", 2).await;
    assert!(!refilled.contains(&id), "{refilled:?}");
    let (status, pools) = as_operator(&s, "GET", "/pools", None).await;
    assert_eq!(status, 200);
    assert_eq!(pools[0]["templateID"], "base", "{pools}");

    // Emptied: its sandboxes go, the claimed one stays.
    let (status, _) = as_operator(&s, "PUT", "/templates/base/pool", Some(r#"{"size": 0}"#)).await;
    assert_eq!(status, 200);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (slots, _) = s.ledger_client.list::<PoolSlotDoc>(POOL_SLOT_KIND, "").await.unwrap();
        let live: Vec<String> = s.node().host().list_ids().await;
        if slots.is_empty() && live == vec![id.clone()] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pool not emptied: {slots:?} {live:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, env) = envs(&s, &id, &token).await;
    assert_eq!(status, 200, "{env}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_share_a_pooled_sandbox() {
    // Nine sandboxes at once (three claimed, three cold, three refills): more vCPUs than a
    // two-core host's default, so no create races a refill for the last one. (Placement's
    // view can trail the node's by a heartbeat, and the node then refuses the create.)
    let s = support::stack_with_vcpus(8192, 32).await;
    let (status, _) = as_operator(&s, "PUT", "/templates/base/pool", Some(r#"{"size": 3}"#)).await;
    assert_eq!(status, 200);
    let pooled = ready(&s, "base", 3).await;
    let creates = (0..6).map(|i| {
        let s = &s;
        async move {
            let body = format!(r#"{{"templateID": "base", "envVars": {{"N": "{i}"}}}}"#);
            let (status, created) = s.call("POST", "/sandboxes", Some("key-a"), Some(&body)).await;
            assert_eq!(status, 201, "{created}");
            (
                i,
                created["sandboxID"].as_str().unwrap().to_string(),
                created["envdAccessToken"].as_str().unwrap().to_string(),
            )
        }
    });
    let created = futures::future::join_all(creates).await;
    let ids: HashSet<&String> = created.iter().map(|(_, id, _)| id).collect();
    assert_eq!(ids.len(), 6, "two creates got one sandbox: {created:?}");
    assert_eq!(
        created.iter().filter(|(_, id, _)| pooled.contains(id)).count(),
        3,
        "every ready sandbox goes to exactly one create: {created:?} from {pooled:?}"
    );
    for (i, id, token) in &created {
        let (status, env) = envs(&s, id, token).await;
        assert_eq!(status, 200, "{env}");
        assert_eq!(env["N"], i.to_string(), "{id} has another create's env vars: {env}");
    }
    // One create's token opens no other's sandbox.
    let (status, _) = envs(&s, &created[0].1, &created[1].2).await;
    assert_eq!(status, 401);
    s.stop().await;
}

/// Until placement has heard from the nodes that `bytes` of their allocations are pooled
/// sandboxes (the room a create may reclaim).
async fn placement_knows_pooled(s: &support::Stack, bytes: u64) {
    use proto::placement::v1 as pl;
    let channel = s.channel(&s.placement_endpoint(), mtls::Role::Placement);
    let mut placement = pl::placement_client::PlacementClient::new(channel);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let nodes = placement.nodes(pl::NodesRequest {}).await.unwrap().into_inner().nodes;
        let pooled: u64 = nodes.iter().filter_map(|n| n.pooled).map(|p| p.memory_bytes).sum();
        if pooled == bytes {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "placement counts {pooled} bytes pooled, not {bytes}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_refused_for_room_evicts_pooled_sandboxes_on_the_node_it_then_runs_on() {
    // Two nodes of 2 GiB and four pooled sandboxes of 512 MiB between them.
    let s = support::stack_of(&[2048, 2048]).await;
    let (status, _) = as_operator(&s, "PUT", "/templates/base/pool", Some(r#"{"size": 4}"#)).await;
    assert_eq!(status, 200);
    let pooled = ready(&s, "base", 4).await;
    placement_knows_pooled(&s, 4 * (512 << 20)).await;
    let held = |i: usize| {
        let s = &s;
        async move { s.nodes[i].running.host().list_ids().await }
    };
    let before = [held(0).await, held(1).await];
    // A whole node: it fits neither as it is, and one once the pooled sandboxes there go.
    let body = r#"{"templateID": "base", "memoryMB": 2048}"#;
    let (status, created) = s.call("POST", "/sandboxes", Some("key-a"), Some(body)).await;
    assert_eq!(status, 201, "{created}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    assert!(!pooled.contains(&id));
    let after = [held(0).await, held(1).await];
    let on = after
        .iter()
        .position(|ids| ids.contains(&id))
        .expect("the create runs on a node");
    assert_eq!(
        after[on],
        vec![id.clone()],
        "only the pooled sandboxes of its own node made way: {before:?}"
    );
    assert_eq!(after[1 - on], before[1 - on], "the other node's pooled sandboxes stay");
    // With no pooled sandbox left to give way, a create is refused as before.
    let (status, _) = as_operator(&s, "PUT", "/templates/base/pool", Some(r#"{"size": 0}"#)).await;
    assert_eq!(status, 200);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !held(1 - on).await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "pool not emptied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, other) = s.call("POST", "/sandboxes", Some("key-a"), Some(body)).await;
    let (status, again) = s.call("POST", "/sandboxes", Some("key-a"), Some(body)).await;
    assert_e2b_error(&(status, again.clone()), 503);
    for sandbox in [id.as_str(), other["sandboxID"].as_str().unwrap_or("")] {
        s.call("DELETE", &format!("/sandboxes/{sandbox}"), Some("key-a"), None)
            .await;
    }
    s.stop().await;
}

/// Rewrites sandbox `id`'s manifest as `edit` makes it, as a gateway would have written it
/// (against the newest version: the gateway's own writes may land meanwhile).
async fn forge(s: &support::Stack, id: &str, edit: impl Fn(&mut common::docs::SandboxDoc)) {
    for _ in 0..10 {
        let doc = s
            .ledger_client
            .get::<common::docs::SandboxDoc>(common::docs::SANDBOX_KIND, id)
            .await
            .unwrap()
            .expect("the manifest exists");
        let mut value = doc.value.clone();
        edit(&mut value);
        let txn = ledger_client::Txn::new().update_read(&doc, &value).unwrap();
        match s.ledger_client.compare(txn).await {
            Ok(_) => return,
            Err(ledger_client::LedgerError::Conflict { .. }) => continue,
            Err(err) => panic!("{err}"),
        }
    }
    panic!("{id} kept changing");
}

/// The balancer drops a pooled sandbox (rather than move it) by asking, in its manifest, for
/// it to be retired: no create claims it from then on, the keeper retires it and fills its
/// slot with another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_sandbox_asked_to_go_is_never_claimed_and_is_replaced() {
    let s = stack(4096).await;
    let (status, _) = as_operator(&s, "PUT", "/templates/base/pool", Some(r#"{"size": 1}"#)).await;
    assert_eq!(status, 200);
    let dropped: String = ready(&s, "base", 1).await.into_iter().next().unwrap();
    forge(&s, &dropped, |doc| {
        if let Some(pool) = doc.pool.as_mut() {
            pool.retire_asked = Some(common::pool::RetireAsk {
                by: "balance plan test".into(),
                at_unix_ms: common::clock::now_ms(),
            });
        }
    })
    .await;
    let (status, created) = s
        .call("POST", "/sandboxes", Some("key-a"), Some(r#"{"templateID": "base"}"#))
        .await;
    assert_eq!(status, 201, "{created}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    assert_ne!(id, dropped, "a sandbox asked to go was claimed");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (slots, _) = s.ledger_client.list::<PoolSlotDoc>(POOL_SLOT_KIND, "").await.unwrap();
        let live = s.node().host().list_ids().await;
        let manifest = s
            .ledger_client
            .get::<common::docs::SandboxDoc>(common::docs::SANDBOX_KIND, &dropped)
            .await
            .unwrap();
        let replaced = slots.len() == 1 && slots[0].value.sandbox_id != dropped;
        if replaced && manifest.is_none() && !live.contains(&dropped) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{dropped} not retired and replaced: {slots:?} {live:?} {manifest:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ready(&s, "base", 1).await;
    s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    s.stop().await;
}

/// The routing table's watch keeps the pooled manifests whole (the keeper's rounds read them
/// there, not from the ledger one by one): each as the ledger holds it, gone once claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routing_watch_keeps_pooled_manifests_as_the_ledger_holds_them() {
    let s = stack(4096).await;
    let routes =
        e2b_gateway::routes::Routes::new(e2b_gateway::tokens::Tokens::new(envd_wire::sealed::TokenKey::random()));
    let follower = routes.follow(s.ledger_client.clone());
    let (status, _) = as_operator(&s, "PUT", "/templates/base/pool", Some(r#"{"size": 2}"#)).await;
    assert_eq!(status, 200);
    let pooled = ready(&s, "base", 2).await;
    let as_held = |id: &str| {
        let id = id.to_string();
        let routes = routes.clone();
        let ledger = s.ledger_client.clone();
        async move {
            let held = ledger
                .get::<common::docs::SandboxDoc>(common::docs::SANDBOX_KIND, &id)
                .await
                .unwrap();
            let known = routes.pooled_manifest(&id);
            match (held, known) {
                (Some(h), Some(k)) => h.version == k.version && h.value == k.value,
                (None, None) => true,
                (Some(h), None) => h.value.pool.is_none(),
                (None, Some(_)) => false,
            }
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for id in &pooled {
        while !as_held(id).await || routes.pooled_manifest(id).is_none() {
            assert!(tokio::time::Instant::now() < deadline, "{id} not kept");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let (status, created) = s
        .call("POST", "/sandboxes", Some("key-a"), Some(r#"{"templateID": "base"}"#))
        .await;
    assert_eq!(status, 201, "{created}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    assert!(pooled.contains(&id));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while routes.pooled_manifest(&id).is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a claimed sandbox is still kept as pooled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    follower.abort();
    s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_its_create_left_marked_is_confirmed_or_ended_by_what_its_node_holds() {
    let s = stack(4096).await;
    let (status, _) = as_operator(&s, "PUT", "/templates/base/pool", Some(r#"{"size": 2}"#)).await;
    assert_eq!(status, 200);
    let pooled: Vec<String> = ready(&s, "base", 2).await.into_iter().collect();
    let long_ago = common::clock::now_ms() - 60_000;
    // A claim whose gateway stopped after its write, before the node heard of it: the node
    // still holds the sandbox as pooled, so nobody was ever answered with it.
    let never = pooled[0].clone();
    // (A claim deletes the slot's document in its write.)
    let (slots, _) = s.ledger_client.list::<PoolSlotDoc>(POOL_SLOT_KIND, "").await.unwrap();
    let slot = slots.iter().find(|d| d.value.sandbox_id == never).expect("its slot");
    let freed = ledger_client::Txn::new().delete(POOL_SLOT_KIND, &slot.key.id, slot.version);
    s.ledger_client.compare(freed).await.unwrap();
    forge(&s, &never, |d| {
        d.team_id = "team-a".into();
        d.epoch += 1;
        d.started_at_unix_ms = long_ago;
    })
    .await;
    // The kill ends the container first and deletes the manifest after: wait for both,
    // since between them the sandbox is already gone from the node but still listed.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let held = s.node().host().list_ids().await.contains(&never);
        let manifest = s
            .ledger_client
            .get::<common::docs::SandboxDoc>(common::docs::SANDBOX_KIND, &never)
            .await
            .unwrap();
        if !held && manifest.is_none() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the unconfirmed claim was never ended (on its node: {held}, manifest: {manifest:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A claim its node took, whose create answered but never cleared the mark: kept, the
    // mark cleared.
    let pooled = ready(&s, "base", 2).await;
    let (status, created) = s
        .call("POST", "/sandboxes", Some("key-a"), Some(r#"{"templateID": "base"}"#))
        .await;
    assert_eq!(status, 201, "{created}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    assert!(pooled.contains(&id), "claimed from the pool");
    forge(&s, &id, |d| {
        d.pool = Some(common::pool::Pooled::default());
        d.started_at_unix_ms = long_ago;
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let doc = s
            .ledger_client
            .get::<common::docs::SandboxDoc>(common::docs::SANDBOX_KIND, &id)
            .await
            .unwrap()
            .expect("a confirmed claim is kept");
        if !doc.value.claim_unconfirmed() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the mark was never cleared");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(s.node().host().list_ids().await.contains(&id));
    let (status, info) = s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(status, 200, "{info}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_with_an_idempotency_key_is_claimed_and_its_retry_gets_that_sandbox() {
    let s = stack(4096).await;
    let (status, _) = as_operator(&s, "PUT", "/templates/base/pool", Some(r#"{"size": 1}"#)).await;
    assert_eq!(status, 200);
    let pooled = ready(&s, "base", 1).await;
    let create = |key: &'static str| {
        let url = s.url();
        async move {
            let r = reqwest::Client::new()
                .post(format!("{url}/sandboxes"))
                .header("X-API-Key", "key-a")
                .header("Idempotency-Key", key)
                .header("Content-Type", "application/json")
                .body(r#"{"templateID": "base", "envVars": {"MINE": "1"}}"#)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (status, first) = create("key-one").await;
    assert_eq!(status, 201, "{first}");
    let id = first["sandboxID"].as_str().unwrap().to_string();
    assert!(pooled.contains(&id), "claimed from the pool: {id} not in {pooled:?}");
    let (status, again) = create("key-one").await;
    assert_eq!(status, 201, "{again}");
    assert_eq!(
        again["sandboxID"], first["sandboxID"],
        "the retry gets the claimed sandbox"
    );
    let token = first["envdAccessToken"].as_str().unwrap_or_default().to_string();
    let (status, vars) = envs(&s, &id, &token).await;
    assert_eq!((status, vars["MINE"].as_str()), (200, Some("1")), "{vars}");
    let (status, other) = create("key-two").await;
    assert_eq!(status, 201, "{other}");
    assert_ne!(other["sandboxID"], first["sandboxID"], "another key, another sandbox");
    s.stop().await;
}

/// Builds `name` (tag `default`) from base with one ENV step; returns (template ID, build ID).
async fn build(s: &support::Stack, name: &str, version: &str) -> (String, String) {
    let (status, made) = s
        .call(
            "POST",
            "/v3/templates",
            Some("key-a"),
            Some(&format!(r#"{{"name": "{name}"}}"#)),
        )
        .await;
    assert_eq!(status, 202, "{made}");
    let (template, build) = (
        made["templateID"].as_str().unwrap().to_string(),
        made["buildID"].as_str().unwrap().to_string(),
    );
    let steps = serde_json::json!({
        "fromTemplate": "base",
        "steps": [{"type": "ENV", "args": ["VERSION", version], "force": false}],
    })
    .to_string();
    let start = format!("/v2/templates/{template}/builds/{build}");
    assert_eq!(s.call("POST", &start, Some("key-a"), Some(&steps)).await.0, 202);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let path = format!("/templates/{template}/builds/{build}/status");
        let (_, answer) = s.call("GET", &path, Some("key-a"), None).await;
        match answer["status"].as_str() {
            Some("ready") => return (template, build),
            Some("error") => panic!("the build failed: {answer}"),
            _ => {}
        }
        assert!(tokio::time::Instant::now() < deadline, "build never ended: {answer}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The pool's slots, once every one holds a sandbox of `build`.
async fn slots_of(s: &support::Stack, build: &str, n: usize) -> Vec<PoolSlotDoc> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let (slots, _) = s.ledger_client.list::<PoolSlotDoc>(POOL_SLOT_KIND, "").await.unwrap();
        let slots: Vec<PoolSlotDoc> = slots.into_iter().map(|d| d.value).collect();
        if slots.len() == n && slots.iter().all(|d| d.build_id == build) {
            return slots;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "slots never all of {build}: {slots:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_template_gets_a_new_pool_and_a_deleted_one_none() {
    let s = stack(8192).await;
    let (template, first) = build(&s, "pooled-app", "v1").await;
    // Another team may not size it (for it the template does not exist); its own team may.
    assert_e2b_error(
        &s.call(
            "PUT",
            &format!("/templates/{template}/pool"),
            Some("key-b"),
            Some(r#"{"size": 1}"#),
        )
        .await,
        404,
    );
    // A team's pooled sandboxes run before anyone is billed: its pools have a budget.
    let over = format!(r#"{{"size": {}}}"#, common::pool::MAX_TEAM_POOL_SLOTS + 1);
    assert_e2b_error(
        &s.call("PUT", "/templates/pooled-app/pool", Some("key-a"), Some(&over))
            .await,
        400,
    );
    let (status, set) = s
        .call(
            "PUT",
            "/templates/pooled-app/pool",
            Some("key-a"),
            Some(r#"{"size": 1}"#),
        )
        .await;
    assert_eq!((status, set["setBy"].as_str()), (200, Some("team-a")), "{set}");
    let old = slots_of(&s, &first, 1).await;

    // Rebuilt: the default tag moves, the pooled sandbox of the old build is replaced.
    let (_, second) = build(&s, "pooled-app", "v2").await;
    assert_ne!(first, second);
    let new = slots_of(&s, &second, 1).await;
    assert_ne!(old[0].sandbox_id, new[0].sandbox_id);
    ready(&s, &template, 1).await;
    let (status, created) = s
        .call(
            "POST",
            "/sandboxes",
            Some("key-a"),
            Some(r#"{"templateID": "pooled-app"}"#),
        )
        .await;
    assert_eq!(status, 201, "{created}");
    let id = created["sandboxID"].as_str().unwrap();
    assert_eq!(
        id, new[0].sandbox_id,
        "the create did not take the new build's pooled sandbox"
    );
    let (status, env) = envs(&s, id, created["envdAccessToken"].as_str().unwrap()).await;
    assert_eq!((status, env["VERSION"].as_str()), (200, Some("v2")), "{env}");
    s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;

    // A size an operator set is the operator's: the team may no longer change it.
    let path = format!("/templates/{template}/pool");
    assert_eq!(as_operator(&s, "PUT", &path, Some(r#"{"size": 1}"#)).await.0, 200);
    assert_e2b_error(&s.call("PUT", &path, Some("key-a"), Some(r#"{"size": 5}"#)).await, 403);

    // Deleted: its pool is emptied and dropped.
    ready(&s, &template, 1).await;
    let (status, _) = s
        .call("DELETE", &format!("/templates/{template}"), Some("key-a"), None)
        .await;
    assert_eq!(status, 204);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (slots, _) = s.ledger_client.list::<PoolSlotDoc>(POOL_SLOT_KIND, "").await.unwrap();
        let (pools, _) = s
            .ledger_client
            .list::<common::pool::PoolDoc>(common::pool::POOL_KIND, "")
            .await
            .unwrap();
        if slots.is_empty() && pools.is_empty() && s.node().host().list_ids().await.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pool of a deleted template left: {slots:?} {pools:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.stop().await;
}
