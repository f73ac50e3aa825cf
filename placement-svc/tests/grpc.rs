//! placement-svc over gRPC, as node-svc and the gateway use it, with a real ledger behind it.

use std::time::Duration;

use futures::StreamExt;
use placement_svc::server::{PlacementConfig, StoreConfig};
use proto::placement::v1 as pb;
use proto::placement::v1::placement_client::PlacementClient;
use tonic::transport::Channel;
use tonic::Code;

const GIB: u64 = 1 << 30;

fn heartbeat(node: &str, seq: u64, ids: &[&str]) -> pb::HeartbeatRequest {
    let n = ids.len() as u32;
    pb::HeartbeatRequest {
        node_id: node.into(),
        boot_id: "boot".into(),
        seq,
        address: format!("http://{node}.local:7003"),
        capacity: Some(pb::Resources {
            vcpus: 4,
            memory_bytes: 8 * GIB,
        }),
        allocated: Some(pb::Resources {
            vcpus: n,
            memory_bytes: u64::from(n) * GIB,
        }),
        memory_used_bytes: u64::from(n) * GIB / 2,
        memory_available_bytes: 8 * GIB - u64::from(n) * GIB / 2,
        sandboxes: ids
            .iter()
            .map(|id| pb::SandboxReport {
                sandbox_id: id.to_string(),
                state: pb::SandboxState::Running as i32,
                allocated: Some(pb::Resources {
                    vcpus: 1,
                    memory_bytes: GIB,
                }),
                memory_used_bytes: GIB / 2,
            })
            .collect(),
        ..Default::default()
    }
}

fn place(id: &str, memory_bytes: u64) -> pb::PlaceRequest {
    pb::PlaceRequest {
        sandbox_id: id.into(),
        resources: Some(pb::Resources { vcpus: 1, memory_bytes }),
        ..Default::default()
    }
}

async fn client(endpoint: String) -> PlacementClient<Channel> {
    PlacementClient::connect(endpoint).await.expect("connect to placement")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn place_confirm_and_publish_node_documents() {
    let dir = std::env::temp_dir().join(format!("placement-grpc-{}", uuid::Uuid::new_v4().simple()));
    let ledger = ledger_svc::start(ledger_svc::LedgerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        format!("sqlite://{}", dir.join("ledger.db").display()),
    ))
    .await
    .unwrap();
    let ledger_client =
        ledger_client::LedgerClient::connect_lazy(&ledger.endpoint(), &mtls::Security::Plaintext).unwrap();
    let mut node_docs = ledger_client.watch(common::docs::NODE_KIND, "", 0);

    let mut config = PlacementConfig::new("127.0.0.1:0".parse().unwrap());
    config.ledger_endpoint = Some(ledger.endpoint());
    config.node_doc_interval = Duration::from_millis(0);
    let placement = placement_svc::server::start(config).await.unwrap();
    let mut c = client(placement.endpoint()).await;

    let reply = c.heartbeat(heartbeat("n1", 1, &[])).await.unwrap().into_inner();
    assert!(reply.applied);
    let placed = c.place(place("s1", GIB)).await.unwrap().into_inner();
    assert_eq!(placed.node_id, "n1");
    assert_eq!(placed.node_address, "http://n1.local:7003");
    c.created(pb::SandboxRef {
        sandbox_id: "s1".into(),
        node_id: "n1".into(),
        resources: None,
    })
    .await
    .unwrap();
    let node = c.nodes(pb::NodesRequest {}).await.unwrap().into_inner().nodes.remove(0);
    assert_eq!(node.state, pb::NodeState::Ready as i32);
    assert_eq!((node.unconfirmed, node.believed.unwrap().vcpus), (1, 1));

    // The node says why it runs degraded; its document carries that, bounded.
    let mut degraded = heartbeat("n1", 2, &["s1"]);
    degraded.degraded = (0..40).map(|i| format!("reason {i} {}", "x".repeat(1000))).collect();
    c.heartbeat(degraded).await.unwrap();
    let node = c.nodes(pb::NodesRequest {}).await.unwrap().into_inner().nodes.remove(0);
    assert_eq!(
        (
            node.unconfirmed,
            node.reported.unwrap().vcpus,
            node.believed.unwrap().vcpus
        ),
        (0, 1, 1)
    );

    // The node document reaches the ledger (awaited through a watch, not a sleep).
    let doc = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let update = node_docs.next().await.unwrap().unwrap();
            for event in update.events {
                if let ledger_client::WatchEvent::Put(doc) = event {
                    let parsed: common::docs::NodeDoc = serde_json::from_str(&doc.payload).unwrap();
                    if parsed.seq == 2 {
                        return parsed;
                    }
                }
            }
        }
    })
    .await
    .expect("node document written");
    assert_eq!(doc.sandboxes.len(), 1);
    assert!((doc.available_ratio - (7.5 / 8.0)).abs() < 1e-9);
    assert_eq!(doc.degraded.len(), common::docs::MAX_DEGRADED);
    assert!(
        doc.degraded[0].starts_with("reason 0 ") && doc.degraded[0].chars().count() == common::docs::MAX_DEGRADED_LEN
    );

    // Errors in gRPC's own shape, changing nothing.
    let bad = c.place(place("", GIB)).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("sandbox_id"));
    // Larger than any node even empty: out of range (never), not exhausted (not now).
    let never = c.place(place("huge", 64 * GIB)).await.unwrap_err();
    assert_eq!(never.code(), Code::OutOfRange);
    assert!(never.message().contains("memory"), "{}", never.message());
    let full = c.place(place("fills", 8 * GIB)).await.unwrap_err();
    assert_eq!(full.code(), Code::ResourceExhausted, "{}", full.message());
    let stale = c.heartbeat(heartbeat("n1", 2, &[])).await.unwrap().into_inner();
    assert!(!stale.applied && stale.reason.contains("not newer"));
    let unknown = c
        .created(pb::SandboxRef {
            sandbox_id: "s".into(),
            node_id: "ghost".into(),
            resources: None,
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    let bad_state = c
        .set_node_state(pb::SetNodeStateRequest {
            node_id: "n1".into(),
            state: pb::NodeState::Unhealthy as i32,
        })
        .await
        .unwrap_err();
    assert_eq!(bad_state.code(), Code::InvalidArgument);

    // Explain shows the candidates; draining empties the choice.
    let explained = c.explain(place("q", GIB)).await.unwrap().into_inner();
    assert_eq!(explained.chosen, "n1");
    assert!(explained.candidates[0].terms.contains_key("memory"));
    c.set_node_state(pb::SetNodeStateRequest {
        node_id: "n1".into(),
        state: pb::NodeState::Draining as i32,
    })
    .await
    .unwrap();
    let drained = c.place(place("s2", GIB)).await.unwrap_err();
    assert!(drained.message().contains("draining"), "{}", drained.message());

    placement.stop().await;
    ledger.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_redis_keep_one_exact_account() {
    let prefix = format!("grpc-{}", uuid::Uuid::new_v4().simple());
    let url = stack::services::redis_url();
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let mut config = PlacementConfig::new("127.0.0.1:0".parse().unwrap());
        config.store = StoreConfig::Redis {
            url: url.clone(),
            prefix: prefix.clone(),
        };
        replicas.push(
            placement_svc::server::start(config).await.unwrap_or_else(|err| {
                stack::services::redis_missing(format!("placement on Redis did not start: {err}"))
            }),
        );
    }
    let mut a = client(replicas[0].endpoint()).await;
    let b = client(replicas[1].endpoint()).await;
    for node in ["n1", "n2", "n3"] {
        a.heartbeat(heartbeat(node, 1, &[])).await.unwrap();
    }
    let mut tasks = Vec::new();
    // 18 GiB of 24: memory is never over-committed.
    for i in 0..18 {
        let mut c = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            let id = format!("s{i}");
            let placed = c.place(place(&id, GIB)).await.unwrap().into_inner();
            c.created(pb::SandboxRef {
                sandbox_id: id.clone(),
                node_id: placed.node_id.clone(),
                resources: None,
            })
            .await
            .unwrap();
            (placed.node_id, id)
        }));
    }
    let mut by_node: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for t in tasks {
        let (node, id) = t.await.unwrap();
        by_node.entry(node).or_default().push(id);
    }
    // Before any heartbeat lists them, both replicas see every reservation.
    for c in [&mut a, &mut b.clone()] {
        let nodes = c.nodes(pb::NodesRequest {}).await.unwrap().into_inner().nodes;
        let believed: u32 = nodes.iter().map(|n| n.believed.unwrap().vcpus).sum();
        assert_eq!(believed, 18);
    }
    // Heartbeats that list them: the reservations give way to the reports, still exact.
    for (node, ids) in &by_node {
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        a.heartbeat(heartbeat(node, 2, &ids)).await.unwrap();
    }
    let nodes = b.clone().nodes(pb::NodesRequest {}).await.unwrap().into_inner().nodes;
    for n in &nodes {
        let expected = by_node.get(&n.node_id).map_or(0, Vec::len) as u32;
        assert_eq!(
            (n.believed.unwrap().vcpus, n.unconfirmed, n.pending),
            (expected, 0, 0),
            "{n:?}"
        );
    }
    for r in replicas {
        r.stop().await;
    }
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL").arg(keys).query_async(&mut conn).await.unwrap();
    }
}
