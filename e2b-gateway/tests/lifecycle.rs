//! Sandbox lifecycles across the gateway: hibernation (pause with `memory: false`), a backend
//! going away, the reaper after a gateway restart, and envd requests held while a sandbox is
//! being moved.

mod support;

use std::time::Duration;

use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use ledger_client::{LedgerClient, Txn};
use support::{assert_e2b_error, stack};

/// Pauses without memory (hibernates) and expects it done.
async fn hibernate(s: &support::Stack, id: &str) {
    let path = format!("/sandboxes/{id}/pause");
    let (status, answer) = s.call("POST", &path, Some("key-a"), Some(r#"{"memory":false}"#)).await;
    assert_eq!(status, 204, "{answer}");
}

/// `connect` with a minute's timeout: resumes (or wakes) the sandbox.
async fn connect(s: &support::Stack, id: &str) -> (u16, serde_json::Value) {
    let path = format!("/sandboxes/{id}/connect");
    s.call("POST", &path, Some("key-a"), Some(r#"{"timeout":60}"#)).await
}

async fn create(s: &support::Stack, body: &str) -> String {
    let (status, created) = s.call("POST", "/sandboxes", Some("key-a"), Some(body)).await;
    assert_eq!(status, 201, "{created:?}");
    created["sandboxID"].as_str().unwrap().to_string()
}

/// The attacker holds a dump of the ledger and of the blob store (a backup, a replica, a
/// bucket left readable) and may write to the store: neither dump reads a tenant's
/// environment variables or tokens, and an archive put in a hibernated sandbox's place, with
/// a description of the attacker's beside it, is refused at wake (the sandbox's description
/// and checksum are sealed in its manifest), while the genuine archive wakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dumps_of_the_ledger_and_the_blob_store_hold_no_tenant_secret() {
    const SECRET: &str = "sk-tenant-secret-8d1f02c9";
    let s = stack(4096).await;
    let id = create(
        &s,
        &format!(r#"{{"templateID":"base","envVars":{{"OPENAI_API_KEY":"{SECRET}"}}}}"#),
    )
    .await;
    let record = s.node().host().get(&id).await.expect("the node runs it");
    assert_eq!(record.env["OPENAI_API_KEY"], SECRET, "the sandbox gets its environment");
    let (_, detail) = s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    let token = detail["envdAccessToken"].as_str().unwrap().to_string();
    std::fs::write(s.node().host().home(&id).join("keep.txt"), "genuine").unwrap();

    let ledger_dump = |s: &support::Stack| {
        let ledger = s.ledger_client.clone();
        async move {
            let (docs, _) = ledger.list::<serde_json::Value>(SANDBOX_KIND, "").await.unwrap();
            docs.iter().map(|d| d.value.to_string()).collect::<String>()
        }
    };
    let dump = ledger_dump(&s).await;
    assert!(dump.contains(&id));
    assert!(
        !dump.contains(SECRET),
        "the ledger holds the tenant's environment in clear"
    );

    // Hibernated: the store holds its archive, the manifest the seal of the rest.
    hibernate(&s, &id).await;
    let store = blobs::from_url(&s.config().blob_store).unwrap();
    let meta_key = blobs::Key::new(format!("snapshots/{id}.json")).unwrap();
    let tar_key = blobs::Key::new(format!("snapshots/{id}.tar")).unwrap();
    let genuine = store.get_bytes(&tar_key).await.unwrap();
    let archive = String::from_utf8_lossy(&genuine).to_string();
    let manifests = ledger_dump(&s).await;
    assert!(manifests.contains("\"hibernation\":\"aead-v1:"), "{manifests}");
    for (what, secret) in [("environment", SECRET), ("envd token", token.as_str())] {
        assert!(!archive.contains(secret), "the blob store holds the {what} in clear");
        assert!(!manifests.contains(secret), "the ledger holds the {what} in clear");
    }
    assert!(
        store.exists(&meta_key).await.unwrap().is_none(),
        "a description in the store"
    );

    // A writer of the store swaps the archive and writes a description of its own beside it,
    // as gateways from before sealing kept them: the checksum of its archive, and the token
    // it wants the sandbox to take.
    let crafted = {
        let mut tar = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(7);
        header.set_mode(0o644);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        header.set_cksum();
        tar.append_data(&mut header, "keep.txt", &b"crafted"[..]).unwrap();
        tar.into_inner().unwrap()
    };
    let digest = <sha2::Sha256 as sha2::Digest>::digest(&crafted);
    let forged = serde_json::json!({
        "description_json": serde_json::to_string(&record).unwrap().replace(&token, "attackers-token"),
        "sha256": digest.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        "bytes": crafted.len(),
    });
    store
        .put_bytes(&meta_key, forged.to_string().into_bytes().into())
        .await
        .unwrap();
    store.put_bytes(&tar_key, crafted.into()).await.unwrap();
    let (status, answer) = connect(&s, &id).await;
    assert_ne!(status, 201, "a swapped archive was restored: {answer}");
    assert!(
        answer["message"]
            .as_str()
            .is_some_and(|m| m.contains("checksum") && m.contains("the source said")),
        "refused for its checksum, not for something else: {answer}"
    );
    let (_, detail) = s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(detail["state"], "paused", "{detail}");

    // The genuine archive wakes, with the tenant's files, environment and token.
    store.put_bytes(&tar_key, genuine).await.unwrap();
    let (status, answer) = connect(&s, &id).await;
    assert_eq!(status, 201, "{answer}");
    assert_eq!(
        std::fs::read_to_string(s.node().host().home(&id).join("keep.txt")).unwrap(),
        "genuine"
    );
    let record = s.node().host().get(&id).await.expect("the node runs it again");
    assert_eq!(record.env["OPENAI_API_KEY"], SECRET);
    assert_eq!(record.access_token.as_deref(), Some(token.as_str()));
    s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_without_memory_frees_the_node_and_keeps_the_files() {
    let s = stack(4096).await;
    let id = create(&s, r#"{"templateID":"base"}"#).await;
    std::fs::write(s.node().host().home(&id).join("keep.txt"), "still here").unwrap();

    hibernate(&s, &id).await;
    let (_, detail) = s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(detail["state"], "paused");
    assert!(
        s.node().host().get(&id).await.is_none(),
        "the node still holds a hibernated sandbox"
    );
    // Its files wait off the node; its envd traffic gets the SDK's "not running" answer.
    let envd = reqwest::Client::new()
        .get(format!("{}/health", s.url()))
        .header("E2b-Sandbox-Id", &id)
        .send()
        .await
        .unwrap();
    assert_eq!(envd.status().as_u16(), 502);

    // The files wait in the cluster's blob store, so another gateway (its own spool) wakes it.
    let store = blobs::from_url(&s.config().blob_store).unwrap();
    let archive = blobs::Key::new(format!("snapshots/{id}.tar")).unwrap();
    assert!(store.exists(&archive).await.unwrap().is_some());
    let mut config = s.config();
    config.listen = "127.0.0.1:0".parse().unwrap();
    config.hibernate_dir = s.dir.join("another-gateways-spool");
    let other = e2b_gateway::server::start(config).await.unwrap();
    let status = reqwest::Client::new()
        .post(format!("{}/sandboxes/{id}/connect", other.url()))
        .header("X-API-Key", "key-a")
        .header("Content-Type", "application/json")
        .body(r#"{"timeout":60}"#)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status.as_u16(), 201);
    other.stop().await;
    assert_eq!(
        std::fs::read_to_string(s.node().host().home(&id).join("keep.txt")).unwrap(),
        "still here"
    );
    assert!(
        store.exists(&archive).await.unwrap().is_none(),
        "a woken sandbox's snapshot is removed"
    );
    let (_, detail) = s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(detail["state"], "running");
    s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_down_is_503_and_leaves_nothing() {
    let mut s = stack(4096).await;
    if let Some(p) = s.placement.take() {
        p.stop().await;
    }
    let answer = s
        .call("POST", "/sandboxes", Some("key-a"), Some(r#"{"templateID":"base"}"#))
        .await;
    assert_e2b_error(&answer, 503);
    let ledger = LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    let (docs, _) = ledger.list::<SandboxDoc>(SANDBOX_KIND, "").await.unwrap();
    assert!(docs.is_empty(), "a failed create left its manifest");
    s.stop().await;
}

/// A node that cannot start a sandbox (here: its sandbox network has one address, taken)
/// makes the create a 503 saying why, with nothing left behind, and the same create succeeds
/// once the address is free again: "not now", never a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_start_a_sandbox_is_503_not_500() {
    // One /30 of its own (one sandbox link), unlikely to be another test's.
    let pid = std::process::id();
    let pool = format!("10.201.{}.{}/30", (pid >> 6) % 256, (pid % 64) * 4);
    let node = stack::Stack::builder().node(move |c| c.network.pool = pool.parse().expect("a /30"));
    let s = support::started(node, |_| {}).await;
    let linked = r#"{"templateID":"base","allow_internet_access":true}"#;
    let first = create(&s, linked).await;

    let answer = s.call("POST", "/sandboxes", Some("key-a"), Some(linked)).await;
    assert_e2b_error(&answer, 503);
    let message = answer.1["message"].as_str().unwrap_or_default();
    assert!(message.contains("no free address"), "the cause is named: {message}");
    let ledger = LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    let (docs, _) = ledger.list::<SandboxDoc>(SANDBOX_KIND, "").await.unwrap();
    assert_eq!(docs.len(), 1, "the failed create left its manifest");

    let (status, _) = s
        .call("DELETE", &format!("/sandboxes/{first}"), Some("key-a"), None)
        .await;
    assert_eq!(status, 204);
    create(&s, linked).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_survives_a_gateway_restart() {
    let mut s = stack(4096).await;
    let id = create(&s, r#"{"templateID":"base","timeout":2}"#).await;
    // The gateway goes away before the sandbox's end; a new one must still end it.
    if let Some(g) = s.gateway.take() {
        g.stop().await;
    }
    let restarted = e2b_gateway::server::start(s.config()).await.unwrap();
    s.gateway = Some(restarted);
    let mut gone = false;
    for _ in 0..100 {
        if s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await.0 == 404 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the sandbox outlived its timeout across a gateway restart");
    assert!(s.node().host().get(&id).await.is_none(), "its process survived");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_requests_are_held_while_a_sandbox_moves() {
    let s = stack(4096).await;
    let id = create(&s, r#"{"templateID":"base"}"#).await;
    let ledger = LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    // A mover takes ownership and pauses it (what balance-svc does first).
    let doc = ledger.get::<SandboxDoc>(SANDBOX_KIND, &id).await.unwrap().unwrap();
    let mut moving = doc.value.clone();
    moving.lifecycle_owner = Some("test-move".into());
    moving.phase = SandboxPhase::Paused;
    let v = ledger
        .compare(Txn::new().update(SANDBOX_KIND, &id, doc.version, &moving).unwrap())
        .await
        .unwrap()
        .versions[0];
    // Let the gateway's watch see the ownership before the request arrives.
    for _ in 0..100 {
        let r = reqwest::Client::new()
            .get(format!("{}/health", s.url()))
            .header("E2b-Sandbox-Id", &id)
            .timeout(Duration::from_millis(50))
            .send()
            .await;
        if r.is_err() {
            break; // held: the request did not come back within 50 ms
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let url = s.url();
    let held_id = id.clone();
    let held = tokio::spawn(async move {
        reqwest::Client::new()
            .get(format!("{url}/health"))
            .header("E2b-Sandbox-Id", &held_id)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !held.is_finished(),
        "the request was answered while the sandbox was moving"
    );
    // The move ends: running again (here, where it was), ownership released.
    let mut done = moving.clone();
    done.lifecycle_owner = None;
    done.phase = SandboxPhase::Running;
    ledger
        .compare(Txn::new().update(SANDBOX_KIND, &id, v, &done).unwrap())
        .await
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(5), held)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, 204, "the held request went through once the move ended");
    s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    s.stop().await;
}

/// A create whose call to a node breaks after the node started the sandbox (the reply lost)
/// is undone on that node before the sandbox is made on another: it runs once, where its
/// manifest says. Before, the first node kept a second copy running for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_node_reply_is_lost_runs_once() {
    // Node 0 is reached only through a fault proxy: it tells placement the proxy's address.
    let port = stack::fault::reserve().await;
    let advertised = format!("http://{}", port.addr());
    let nodes = stack::Stack::builder()
        .node(move |c| c.advertise = Some(advertised))
        .node(|_| {});
    let s = support::started(nodes, |_| {}).await;
    let proxy = stack::fault::NodeProxy::start_on(port, &s.nodes[0].id, &s.nodes[0].running.endpoint(), &s.certs).await;
    proxy.faults.drop_reply("Create", 1);

    // Placement chooses: create until one lands on node 0 and loses its reply there.
    let mut ids = Vec::new();
    while proxy.faults.count("dropped") == 0 {
        assert!(ids.len() < 20, "placement never chose node 0 in {} creates", ids.len());
        ids.push(create(&s, r#"{"templateID":"base"}"#).await);
    }
    let ledger = LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    for id in &ids {
        let manifest = ledger.get::<SandboxDoc>(SANDBOX_KIND, id).await.unwrap().unwrap().value;
        let mut runs_on = Vec::new();
        for node in &s.nodes {
            if node.running.host().get(id).await.is_some() {
                runs_on.push(node.id.clone());
            }
        }
        assert_eq!(
            runs_on,
            vec![manifest.node_id.clone()],
            "{id} runs once, where its manifest says"
        );
    }
    proxy.stop().await;
    s.stop().await;
}

/// The reaper takes over every create at once (its patience for a `creating` manifest is
/// zero), racing each create's own steps: whatever the interleaving, a create answers 201 or
/// 503, never 409 or 500, and once the reaper is done every sandbox runs exactly where its
/// manifest says, or nowhere if it has none. Before, a create whose copy the reaper adopted
/// answered 409 (seen in CI, where a create outran the reaper's five minutes) and killed the
/// adopted copy its manifest then named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_the_reaper_takes_over_ends_consistent() {
    let nodes = stack::Stack::builder().node(|_| {}).node(|_| {});
    let s = support::started(nodes, |c| {
        c.abandoned_create_after = Duration::ZERO;
        c.reap_interval = Duration::from_millis(10);
    })
    .await;
    let ledger = LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    let (mut ids, mut ended) = (Vec::new(), Vec::new());
    for _ in 0..12 {
        let (status, answer) = s
            .call("POST", "/sandboxes", Some("key-a"), Some(r#"{"templateID":"base"}"#))
            .await;
        assert!(status == 201 || status == 503, "{status}: {answer}");
        if let Some(id) = answer["sandboxID"].as_str() {
            ids.push(id.to_string());
        }
        // "sandbox ID took so long to create that the reaper ended it": gone for good.
        let message = answer["message"].as_str().unwrap_or_default();
        if message.contains("the reaper ended it") {
            ended.push(message.split_whitespace().nth(1).unwrap_or_default().to_string());
        }
    }
    // Every manifest settles (no claim, not creating), then says where its sandbox runs.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let (docs, _) = loop {
        let listed = ledger.list::<SandboxDoc>(SANDBOX_KIND, "").await.unwrap();
        let settled = listed
            .0
            .iter()
            .all(|d| d.value.lifecycle_owner.is_none() && d.value.phase == SandboxPhase::Running);
        if settled {
            break listed;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "manifests never settled: {:?}",
            listed.0
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for doc in &docs {
        let mut runs_on = Vec::new();
        for node in &s.nodes {
            if node.running.host().get(&doc.value.sandbox_id).await.is_some() {
                runs_on.push(node.id.clone());
            }
        }
        assert_eq!(runs_on, vec![doc.value.node_id.clone()], "{:?}", doc.value);
    }
    for id in &ids {
        assert!(
            docs.iter().any(|d| &d.value.sandbox_id == id),
            "the created {id} has its manifest"
        );
    }
    for id in &ended {
        assert!(
            !docs.iter().any(|d| &d.value.sandbox_id == id),
            "the ended {id} has no manifest"
        );
    }
    let named: Vec<&str> = docs.iter().map(|d| d.value.sandbox_id.as_str()).collect();
    for node in &s.nodes {
        for (record, _) in node.running.host().list().await {
            assert!(
                named.contains(&record.id.as_str()),
                "{} runs with no manifest",
                record.id
            );
        }
    }
    s.stop().await;
}

/// Points the manifest of `id` somewhere else (a fault proxy in front of its node).
async fn route_node_via(ledger: &LedgerClient, id: &str, address: &str) {
    let doc = ledger.get::<SandboxDoc>(SANDBOX_KIND, id).await.unwrap().unwrap();
    let mut value = doc.value;
    value.node_address = address.to_string();
    ledger
        .compare(Txn::new().update(SANDBOX_KIND, id, doc.version, &value).unwrap())
        .await
        .unwrap();
}

/// A kill the node does not confirm is not reported as done: the user hears an error, the
/// sandbox keeps its manifest, claimed by the unconfirmed kill (it may have landed), and the
/// next kill takes that claim over at once and finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_the_node_does_not_confirm_is_not_reported_done() {
    let s = stack(4096).await;
    let id = create(&s, r#"{"templateID":"base"}"#).await;
    let ledger = LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    let node = stack::fault::NodeProxy::start(&s.nodes[0].id, &s.node().endpoint(), &s.certs).await;
    route_node_via(&ledger, &id, &node.endpoint()).await;
    node.faults.set_down(true);

    let refused = s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_e2b_error(&refused, 503);
    assert!(node.faults.count("refused") >= 1);
    let doc = ledger
        .get::<SandboxDoc>(SANDBOX_KIND, &id)
        .await
        .unwrap()
        .unwrap()
        .value;
    assert!(
        doc.lifecycle_owner
            .as_deref()
            .is_some_and(|o| o.starts_with("user:kill:")),
        "the unconfirmed kill keeps its claim: {doc:?}"
    );
    assert!(s.node().host().get(&id).await.is_some(), "the sandbox is still there");

    node.faults.set_down(false);
    let killed = s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(killed.0, 204, "{killed:?}");
    assert!(s.node().host().get(&id).await.is_none());
    assert!(ledger.get::<SandboxDoc>(SANDBOX_KIND, &id).await.unwrap().is_none());
    node.stop().await;
    s.stop().await;
}

/// Leaves `id` claimed by a user operation `op` of a gateway that died ten minutes ago (owner,
/// claim time and epoch + 1, as the dead operation wrote them); returns the manifest so.
async fn abandon_claim(ledger: &LedgerClient, id: &str, op: &str) -> SandboxDoc {
    let doc = ledger.get::<SandboxDoc>(SANDBOX_KIND, id).await.unwrap().unwrap();
    let mut claimed = doc.value.clone();
    claimed.lifecycle_owner = Some(format!("user:{op}:dead-gateway"));
    claimed.lifecycle_claimed_at_unix_ms = Some(common::clock::now_ms() - 10 * 60 * 1000);
    claimed.epoch += 1;
    ledger
        .compare(Txn::new().update(SANDBOX_KIND, id, doc.version, &claimed).unwrap())
        .await
        .unwrap();
    claimed
}

/// A claim left by a gateway that died mid-operation is taken over once its time to live has
/// passed (its epoch raised again, so the dead operation's calls are refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_user_claim_is_taken_over() {
    let s = stack(4096).await;
    let id = create(&s, r#"{"templateID":"base"}"#).await;
    let ledger = LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    abandon_claim(&ledger, &id, "pause").await;
    let killed = s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(killed.0, 204, "{killed:?}");
    assert!(s.node().host().get(&id).await.is_none());
    s.stop().await;
}

/// A claim no user operation comes for is resolved by the reaper once its time to live has
/// passed (the fault suite found manifests left owned for good by gateways killed mid-pause):
/// a pause that reached the node but not the manifest leaves it saying paused and unowned; a
/// kill left unconfirmed is finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_no_operation_comes_for_is_resolved_by_the_reaper() {
    use proto::node::v1 as node_pb;
    let s = stack(4096).await;
    let ledger = LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    let settled = |id: String| {
        let ledger = ledger.clone();
        async move {
            for _ in 0..100 {
                match ledger.get::<SandboxDoc>(SANDBOX_KIND, &id).await.unwrap() {
                    Some(doc) if doc.value.lifecycle_owner.is_some() => {}
                    other => return other.map(|d| d.value),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("the claim on {id} was never resolved");
        }
    };

    // The dead gateway's pause reached the node, not the manifest.
    let paused = create(&s, r#"{"templateID":"base"}"#).await;
    let claimed = abandon_claim(&ledger, &paused, "pause").await;
    let mut node = proto::node::v1::node_client::NodeClient::new(s.channel(&s.node().endpoint(), stack::Role::Node));
    node.pause(node_pb::LifecycleRequest {
        operation_id: "pause-by-the-dead-gateway".into(),
        epoch: claimed.epoch,
        sandbox_id: paused.clone(),
    })
    .await
    .unwrap();
    let doc = settled(paused.clone()).await.expect("the paused sandbox's manifest");
    assert_eq!(doc.phase, SandboxPhase::Paused);
    assert!(doc.epoch > claimed.epoch, "the resolution fences the dead operation");
    let (status, detail) = s
        .call("GET", &format!("/sandboxes/{paused}"), Some("key-a"), None)
        .await;
    assert_eq!((status, detail["state"].as_str()), (200, Some("paused")));

    // A kill the node never confirmed: finished.
    let killed = create(&s, r#"{"templateID":"base"}"#).await;
    abandon_claim(&ledger, &killed, "kill").await;
    assert!(
        settled(killed.clone()).await.is_none(),
        "the manifest of the kill is gone"
    );
    assert!(
        s.node().host().get(&killed).await.is_none(),
        "the sandbox is gone from its node"
    );
    s.stop().await;
}

/// A create whose gateway stopped after starting the sandbox but before writing where it
/// runs leaves a `creating` manifest naming no node. The reaper ends it once abandoned: the
/// process goes from the node that started it, and the manifest goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_resolves_a_create_abandoned_half_way_against_the_nodes() {
    let s = stack(4096).await;
    let ledger = LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    // A manifest left `creating` ten minutes ago, as by a gateway killed mid-create.
    let abandon = |id: String| {
        let ledger = ledger.clone();
        async move {
            let doc = ledger.get::<SandboxDoc>(SANDBOX_KIND, &id).await.unwrap().unwrap();
            let mut half = doc.value.clone();
            half.phase = SandboxPhase::Creating;
            half.node_id.clear();
            half.node_address.clear();
            half.envd_address.clear();
            half.started_at_unix_ms = common::clock::now_ms() - 10 * 60 * 1000;
            ledger
                .compare(Txn::new().update(SANDBOX_KIND, &id, doc.version, &half).unwrap())
                .await
                .unwrap();
        }
    };
    // Its node runs it: adopted, running where it is.
    let kept = create(&s, r#"{"templateID":"base"}"#).await;
    abandon(kept.clone()).await;
    let mut adopted = None;
    for _ in 0..100 {
        let doc = ledger
            .get::<SandboxDoc>(SANDBOX_KIND, &kept)
            .await
            .unwrap()
            .unwrap()
            .value;
        if doc.phase == SandboxPhase::Running {
            adopted = Some(doc);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let adopted = adopted.expect("the half-made create whose node runs it was not adopted");
    assert_eq!(adopted.node_address, s.node().endpoint());
    assert!(!adopted.envd_address.is_empty() && adopted.lifecycle_owner.is_none());
    assert!(
        s.node().host().get(&kept).await.is_some(),
        "the adopted sandbox still runs"
    );
    let (status, detail) = s.call("GET", &format!("/sandboxes/{kept}"), Some("key-a"), None).await;
    assert_eq!((status, detail["state"].as_str()), (200, Some("running")));

    // No node runs it: removed.
    let lost = create(&s, r#"{"templateID":"base"}"#).await;
    let (status, _) = s
        .call("DELETE", &format!("/sandboxes/{lost}"), Some("key-a"), None)
        .await;
    assert_eq!(status, 204);
    let half = SandboxDoc {
        phase: SandboxPhase::Creating,
        node_id: String::new(),
        node_address: String::new(),
        envd_address: String::new(),
        started_at_unix_ms: common::clock::now_ms() - 10 * 60 * 1000,
        ..adopted.clone()
    };
    let mut half = half;
    half.sandbox_id = lost.clone();
    ledger
        .compare(Txn::new().create(SANDBOX_KIND, &lost, &half).unwrap())
        .await
        .unwrap();
    let mut gone = false;
    for _ in 0..100 {
        if ledger.get::<SandboxDoc>(SANDBOX_KIND, &lost).await.unwrap().is_none() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the half-made create no node runs is still there");
    s.stop().await;
}

/// As on E2B: a paused sandbox outlives its timeout (kept until killed, or the retention);
/// one made with `autoResume` is resumed by its own traffic, which then proceeds; `connect`
/// gives a timeout again; get_info says how its life is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_outlives_its_timeout_and_traffic_resumes_it_when_asked() {
    let s = stack(4096).await;
    let manual = create(&s, r#"{"templateID":"base","timeout":1}"#).await;
    let auto = create(
        &s,
        r#"{"templateID":"base","timeout":1,"autoPause":true,"autoResume":{"enabled":true}}"#,
    )
    .await;
    let (status, _) = s
        .call("POST", &format!("/sandboxes/{manual}/pause"), Some("key-a"), None)
        .await;
    assert_eq!(status, 204);
    let (_, detail) = s.call("GET", &format!("/sandboxes/{auto}"), Some("key-a"), None).await;
    assert_eq!(detail["lifecycle"]["onTimeout"], "pause", "{detail}");
    assert_eq!(detail["lifecycle"]["autoResume"], true, "{detail}");
    assert_eq!(detail["allowInternetAccess"], true, "{detail}");
    // The auto-pausing one is paused by the reaper at its timeout (1 s; reaped every 100 ms).
    let mut paused = false;
    for _ in 0..100 {
        let (_, d) = s.call("GET", &format!("/sandboxes/{auto}"), Some("key-a"), None).await;
        if d["state"] == "paused" {
            paused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(paused, "autoPause did not pause at the timeout");
    // Both are now past their timeout, paused: neither is killed.
    let (_, d) = s
        .call("GET", &format!("/sandboxes/{manual}"), Some("key-a"), None)
        .await;
    assert_eq!(d["state"], "paused", "the manually paused sandbox was ended: {d}");
    // Traffic to the manual one is told to resume; to the auto one, it resumes it.
    let (_, manual_doc) = s
        .call("GET", &format!("/sandboxes/{manual}"), Some("key-a"), None)
        .await;
    let (_, auto_doc) = s.call("GET", &format!("/sandboxes/{auto}"), Some("key-a"), None).await;
    let envs = |id: &str, token: &str| {
        reqwest::Client::new()
            .get(format!("{}/envs", s.url()))
            .header("E2b-Sandbox-Id", id)
            .header("X-Access-Token", token)
            .send()
    };
    let told = envs(&manual, manual_doc["envdAccessToken"].as_str().unwrap())
        .await
        .unwrap();
    assert_eq!(told.status().as_u16(), 502);
    // envd's `/health` is open to anyone who knows the ID (a public port's URL holds it):
    // without the sandbox's token it wakes nothing, and says no more than for a sandbox
    // that does not exist.
    for token in [None, Some("not-the-token")] {
        let mut health = reqwest::Client::new()
            .get(format!("{}/health", s.url()))
            .header("E2b-Sandbox-Id", &auto);
        if let Some(token) = token {
            health = health.header("X-Access-Token", token);
        }
        let health = health.send().await.unwrap();
        assert_eq!(health.status().as_u16(), 502);
        let body: serde_json::Value = health.json().await.unwrap();
        assert_eq!(body["message"], "The sandbox was not found", "{body}");
        let (_, d) = s.call("GET", &format!("/sandboxes/{auto}"), Some("key-a"), None).await;
        assert_eq!(d["state"], "paused", "an unauthenticated /health woke the sandbox: {d}");
    }
    let woken = envs(&auto, auto_doc["envdAccessToken"].as_str().unwrap())
        .await
        .unwrap();
    assert_eq!(woken.status().as_u16(), 200, "{:?}", woken.text().await);
    let (_, d) = s.call("GET", &format!("/sandboxes/{auto}"), Some("key-a"), None).await;
    assert_eq!(d["state"], "running");
    // Connect resumes the manual one with a timeout of its own again.
    let (status, _) = s
        .call(
            "POST",
            &format!("/sandboxes/{manual}/connect"),
            Some("key-a"),
            Some(r#"{"timeout":60}"#),
        )
        .await;
    assert_eq!(status, 201);
    let (_, d) = s
        .call("GET", &format!("/sandboxes/{manual}"), Some("key-a"), None)
        .await;
    assert_eq!(d["state"], "running");
    // autoResume with a files-only automatic pause is refused: it could not be honoured.
    let (status, refused) = s
        .call(
            "POST",
            "/sandboxes",
            Some("key-a"),
            Some(r#"{"templateID":"base","autoPause":true,"autoPauseMemory":false,"autoResume":{"enabled":true}}"#),
        )
        .await;
    assert_e2b_error(&(status, refused), 400);
    s.stop().await;
}

/// `PUT /sandboxes/{id}/network` replaces a running sandbox's egress rules: checked like a
/// create's, applied by the node, shown by get_info; another team's sandbox is not found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_sandboxs_network_is_replaced() {
    let s = stack(4096).await;
    let id = create(&s, r#"{"templateID":"base"}"#).await;
    let path = format!("/sandboxes/{id}/network");
    let put = |body: &'static str, key: &'static str| {
        let path = path.clone();
        let s = &s;
        async move { s.call("PUT", &path, Some(key), Some(body)).await }
    };
    let (status, body) = put(r#"{"denyOut":["8.8.8.8"],"allowOut":["1.1.1.1/32"]}"#, "key-a").await;
    assert_eq!(status, 204, "{body:?}");
    let (_, detail) = s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(
        detail["network"]["denyOut"],
        serde_json::json!(["8.8.8.8/32"]),
        "{detail}"
    );
    assert_eq!(
        detail["network"]["allowOut"],
        serde_json::json!(["1.1.1.1/32"]),
        "{detail}"
    );
    let record = s.node().host().get(&id).await.unwrap();
    assert_eq!(record.network.unwrap().deny_out.len(), 1, "the node applied it");
    // What cannot be given is refused and changes nothing.
    assert_e2b_error(&put(r#"{"allowOut":["example.com"]}"#, "key-a").await, 400);
    assert_e2b_error(&put(r#"{"dnsServers":["9.9.9.9"]}"#, "key-a").await, 400);
    assert_e2b_error(&put(r#"{"denyOut":[]}"#, "key-b").await, 404);
    let (_, detail) = s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(
        detail["network"]["denyOut"],
        serde_json::json!(["8.8.8.8/32"]),
        "{detail}"
    );
    // Omitted fields are cleared, as E2B defines the update.
    let (status, _) = put(r#"{"allow_internet_access":false}"#, "key-a").await;
    assert_eq!(status, 204);
    let (_, detail) = s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(detail["allowInternetAccess"], false, "{detail}");
    assert_eq!(detail["network"]["denyOut"], serde_json::json!([]), "{detail}");
    s.stop().await;
}

/// Metrics are a series the node samples (here as often as it heartbeats, every 50 ms): CPU a
/// busy sandbox uses, memory it holds, files it wrote; `start`/`end` pick a window; a
/// hibernated sandbox answers an empty series, never an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_a_series_of_what_the_sandbox_uses() {
    let s = stack(4096).await;
    let id = create(&s, r#"{"templateID":"base"}"#).await;
    std::fs::write(s.node().host().home(&id).join("ballast.bin"), vec![7u8; 4 << 20]).unwrap();
    let path = format!("/sandboxes/{id}/metrics");
    let mut series = serde_json::Value::Null;
    for _ in 0..100 {
        let (status, answer) = s.call("GET", &path, Some("key-a"), None).await;
        assert_eq!(status, 200, "{answer}");
        if answer.as_array().is_some_and(|a| a.len() >= 3) {
            series = answer;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let samples = series.as_array().expect("three samples within five seconds");
    let last = samples.last().unwrap();
    assert_eq!(last["cpuCount"], 1, "{last}");
    assert!(last["memUsed"].as_u64().unwrap() > 0, "{last}");
    assert_eq!(last["memTotal"].as_u64().unwrap(), 512 << 20, "{last}");
    assert!(
        last["diskUsed"].as_u64().unwrap() >= 4 << 20,
        "the 4 MiB it holds: {last}"
    );
    assert!(last["diskTotal"].as_u64().unwrap() > last["diskUsed"].as_u64().unwrap());
    let times: Vec<u64> = samples.iter().map(|m| m["timestampUnix"].as_u64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "oldest first: {times:?}");
    // A window in the future is empty; a malformed one is a 400.
    let (_, future) = s
        .call(
            "GET",
            &format!("{path}?start=4102444800&end=4102444801"),
            Some("key-a"),
            None,
        )
        .await;
    assert_eq!(future, serde_json::json!([]));
    assert_e2b_error(
        &s.call("GET", &format!("{path}?start=soon"), Some("key-a"), None).await,
        400,
    );
    // The latest sample of each, by ID.
    let (_, latest) = s
        .call(
            "GET",
            &format!("/sandboxes/metrics?sandbox_ids={id}"),
            Some("key-a"),
            None,
        )
        .await;
    assert!(latest["sandboxes"][&id]["memUsed"].as_u64().unwrap() > 0, "{latest}");
    // Hibernated (files only, off every node): an empty series.
    hibernate(&s, &id).await;
    let (status, empty) = s.call("GET", &path, Some("key-a"), None).await;
    assert_eq!((status, empty), (200, serde_json::json!([])));
    s.stop().await;
}

/// Logs: envd's events and the node's lifecycle events, filtered and paged as the v2 route
/// asks; the v1 route gives lines and structured entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxs_logs_carry_its_lifecycle() {
    let s = stack(4096).await;
    let id = create(&s, r#"{"templateID":"base"}"#).await;
    for op in ["pause", "resume"] {
        let (status, _) = s
            .call("POST", &format!("/sandboxes/{id}/{op}"), Some("key-a"), None)
            .await;
        assert!(status == 204 || status == 201, "{op}: {status}");
    }
    let v2 = format!("/v2/sandboxes/{id}/logs");
    let (status, logs) = s.call("GET", &v2, Some("key-a"), None).await;
    assert_eq!(status, 200, "{logs}");
    let messages: Vec<&str> = logs["logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["message"].as_str().unwrap())
        .collect();
    for wanted in ["envd serving", "sandbox created", "sandbox paused", "sandbox resumed"] {
        assert!(messages.contains(&wanted), "{wanted} missing from {messages:?}");
    }
    let first = &logs["logs"][0];
    assert!(first["timestamp"].as_str().unwrap().starts_with("20"), "{first}");
    assert!(first["fields"].is_object() && first["level"] == "info", "{first}");
    // Newest first, two of them; only what matches; a level above all of them: none.
    let (_, back) = s
        .call("GET", &format!("{v2}?direction=backward&limit=2"), Some("key-a"), None)
        .await;
    assert_eq!(back["logs"].as_array().unwrap().len(), 2);
    assert_eq!(back["logs"][0]["message"], "sandbox resumed", "{back}");
    let (_, found) = s.call("GET", &format!("{v2}?search=paused"), Some("key-a"), None).await;
    assert_eq!(found["logs"].as_array().unwrap().len(), 1, "{found}");
    let (_, errors) = s.call("GET", &format!("{v2}?level=error"), Some("key-a"), None).await;
    assert_eq!(errors["logs"], serde_json::json!([]));
    assert_e2b_error(
        &s.call("GET", &format!("{v2}?direction=up"), Some("key-a"), None).await,
        400,
    );
    assert_e2b_error(
        &s.call("GET", &format!("{v2}?limit=5000"), Some("key-a"), None).await,
        400,
    );
    assert_e2b_error(&s.call("GET", &v2, Some("key-b"), None).await, 404);
    let (_, v1) = s
        .call("GET", &format!("/sandboxes/{id}/logs"), Some("key-a"), None)
        .await;
    assert_eq!(
        v1["logs"].as_array().unwrap().len(),
        v1["logEntries"].as_array().unwrap().len()
    );
    // Each line is one JSON object, as E2B's CLI (`e2b sandbox logs`) parses it: a level and
    // a logger named for E2B's services.
    for line in v1["logs"].as_array().unwrap() {
        let parsed: serde_json::Value = serde_json::from_str(line["line"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("a v1 line that is not JSON ({e}): {line}"));
        assert!(parsed["level"].is_string() && parsed["message"].is_string(), "{parsed}");
        assert_eq!(parsed["logger"], "system", "envd's and the node's events: {parsed}");
    }
    s.stop().await;
}
