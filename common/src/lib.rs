//! What every sandboxsched service shares.
//!
//! Kept deliberately small: a constant that two services must agree on lives here, defined
//! once, so the gateway, the placer, the node and the balancer can never disagree about it
//! (if placement and the node assumed a default memory estimate that the balancer never saw,
//! the balancer would skip every sandbox and move nothing).

pub use contracts::{docs, egress, fit, ids, pool, resources, template};

pub mod clock;
pub mod config;
pub mod guesses;
pub mod metrics;
pub mod net;
pub mod relay;
pub mod retry;
pub mod serve;
pub mod shutdown;
pub mod telemetry;
pub mod trace;

/// The allocator the allocation-bound binaries install (`#[global_allocator]` in their
/// `main.rs`: placement-svc, ledger-svc, balance-svc, e2b-gateway and the bench). A placement
/// is a few hundred small, short-lived allocations spread over two gRPC calls and a Redis
/// script; with glibc's allocator `malloc`/`free` took a tenth of the placer's CPU. jemalloc
/// raised `bench placement-throughput` by about a quarter and kept its tail; mimalloc raised
/// it as much but tripled the open-loop p99 (multi-millisecond stalls).
///
/// node-svc and the launcher (which hosts node-svc) keep the system allocator: their hot path
/// is fork+exec, which was 0.3-0.9 ms slower a sandbox create under jemalloc.
pub use tikv_jemallocator::Jemalloc as Allocator;
