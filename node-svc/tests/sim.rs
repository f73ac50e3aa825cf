//! The simulated runtime at the scale it exists for: 50 node-svcs and 10,000 sandboxes in one
//! process, heartbeating to a real placement-svc, whose view must list every sandbox with the
//! memory the simulation says it uses.

use std::time::{Duration, Instant};

use futures::StreamExt;
use node_svc::server::{NodeConfig, RuntimeKind};
use proto::node::v1 as pb;
use proto::node::v1::node_client::NodeClient;
use proto::placement::v1 as pl;
use proto::placement::v1::placement_client::PlacementClient;

const NODES: usize = 50;
const PER_NODE: usize = 200;
const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_simulated_nodes_host_ten_thousand_sandboxes() {
    let placement = placement_svc::server::start(placement_svc::server::PlacementConfig::new(
        "127.0.0.1:0".parse().unwrap(),
    ))
    .await
    .unwrap();
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let dir = std::env::temp_dir().join(format!("sim-test-{tag}"));
    let mut nodes = Vec::new();
    for i in 0..NODES {
        let mut config = NodeConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            format!("sim{tag}-{i}"),
            dir.join(i.to_string()),
        );
        config.runtime = RuntimeKind::Sim { used_share: 0.5 };
        config.placement = Some(placement.endpoint());
        config.heartbeat_interval = Duration::from_millis(500);
        config.host.capacity = node_svc::sandbox::Resources {
            vcpus: 64,
            memory_bytes: 256 * 1024 * MIB,
            disk_bytes: 0,
        };
        nodes.push(node_svc::server::start(config).await.unwrap());
    }
    let mut clients = Vec::new();
    for node in &nodes {
        clients.push((node.endpoint(), NodeClient::connect(node.endpoint()).await.unwrap()));
    }
    let started = Instant::now();
    let creates = clients
        .iter()
        .flat_map(|(endpoint, client)| (0..PER_NODE).map(move |j| (endpoint.clone(), client.clone(), j)));
    let failures: Vec<String> = futures::stream::iter(creates)
        .map(|(endpoint, mut client, j)| async move {
            client
                .create(pb::CreateRequest {
                    operation_id: format!("c{j}"),
                    epoch: 1,
                    sandbox_id: format!("s{j}"),
                    template: "base".into(),
                    resources: Some(pb::Resources {
                        vcpus: 1,
                        memory_bytes: 512 * MIB,
                        disk_bytes: 0,
                    }),
                    ..Default::default()
                })
                .await
                .map(|_| ())
                .map_err(|s| format!("{endpoint}: {s}"))
        })
        .buffer_unordered(64)
        .filter_map(|r| async move { r.err() })
        .collect()
        .await;
    assert!(
        failures.is_empty(),
        "{} creates failed, first: {:?}",
        failures.len(),
        failures.first()
    );
    let created_in = started.elapsed();

    // Placement hears of every sandbox, with the simulated memory use.
    let mut p = PlacementClient::connect(placement.endpoint()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let views = loop {
        let views = p.nodes(pl::NodesRequest {}).await.unwrap().into_inner().nodes;
        let listed: u32 = views.iter().map(|v| v.reported_sandboxes).sum();
        if views.len() == NODES && listed as usize == NODES * PER_NODE {
            break views;
        }
        assert!(
            Instant::now() < deadline,
            "placement lists {listed} of {} sandboxes",
            NODES * PER_NODE
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for v in &views {
        let used_by_sandboxes = PER_NODE as u64 * 256 * MIB;
        assert!(
            v.memory_used_bytes >= used_by_sandboxes,
            "{}: {} bytes used, the simulation says at least {used_by_sandboxes}",
            v.node_id,
            v.memory_used_bytes
        );
    }
    eprintln!(
        "{} sandboxes on {NODES} simulated nodes created in {created_in:?}",
        NODES * PER_NODE
    );
    for node in nodes {
        node.stop().await;
    }
    placement.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
