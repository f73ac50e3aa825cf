//! placement-svc: chooses a node for each sandbox without herding.
//!
//! The decision is Best-of-K over the placer's view of each node; the view is the point. E2B's
//! placer saw only periodic heartbeats, so under a burst every request saw the same stale
//! numbers and piled onto the node that looked emptiest at the last heartbeat. Here every
//! placement is a reservation keyed by sandbox ID, released only when a heartbeat *lists that
//! ID*, so the view is exact at the ID level however heartbeats and creates interleave.
//!
//! Layout: [`core`] is the pure part (accounting, ranking, sampling); [`store`] keeps the view
//! (in memory or in Redis); [`api`] is the gRPC service; [`node_docs`] publishes node
//! documents to the ledger; [`server`] wires them; [`sim`] runs the core on a virtual clock for
//! the benchmark.

pub mod api;
pub mod core;
pub mod node_docs;
pub mod server;
pub mod sim;
pub mod store;
