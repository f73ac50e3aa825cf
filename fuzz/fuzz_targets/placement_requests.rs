//! placement-svc's gRPC requests on arbitrary bytes: the input, decoded as a heartbeat and as
//! a placement request (protobuf), goes through the real API on an in-memory store that a
//! first heartbeat has given a node. Every answer is a reply or a status, never a panic.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use placement_svc::api::PlacementApi;
use placement_svc::core::account::{Accounting, Expiry};
use placement_svc::core::rank::RankConfig;
use placement_svc::store::memory::MemoryStore;
use prost::Message;
use proto::placement::v1 as pb;
use proto::placement::v1::placement_server::Placement;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().build().expect("runtime"))
}

fuzz_target!(|data: &[u8]| {
    let store = Arc::new(MemoryStore::new(Accounting::Reconciled, &RankConfig::default(), Expiry::DEFAULT, 1));
    let api = PlacementApi::new(store, 6_000, None);
    runtime().block_on(async {
        let node = pb::HeartbeatRequest {
            node_id: "n1".into(),
            address: "http://127.0.0.1:1".into(),
            boot_id: "b".into(),
            seq: 1,
            capacity: Some(pb::Resources {
                vcpus: 8,
                memory_bytes: 8 << 30,
            }),
            ..Default::default()
        };
        let _ = api.heartbeat(tonic::Request::new(node)).await;
        if let Ok(heartbeat) = pb::HeartbeatRequest::decode(data) {
            let _ = api.heartbeat(tonic::Request::new(heartbeat)).await;
        }
        if let Ok(place) = pb::PlaceRequest::decode(data) {
            let _ = api.place(tonic::Request::new(place.clone())).await;
            let _ = api.explain(tonic::Request::new(place)).await;
        }
    });
});
