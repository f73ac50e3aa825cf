//! e2b-gateway: E2B's REST API and envd proxy in front of the cluster, so unmodified E2B SDKs
//! work against it with only `E2B_API_URL`, `E2B_SANDBOX_URL` and `E2B_API_KEY` set.
//!
//! Layout, bottom up (each module imports only from those before it; `scripts/check-cycles`
//! holds the crate to that): [`intent`] is the pure core (a create request normalised into a
//! complete intent, memory estimate and its source included); [`error`] is how the gateway
//! fails and the one place failures become E2B's error shape; [`ids`] checks IDs at the edge;
//! [`routes`] is where each sandbox runs, by the ledger's watch; [`sandboxes`] drives ledger,
//! placement and nodes (and undoes failed creates); [`templates`] is the template registry
//! and build driver; [`pools`] keeps templates' warm pools full; [`api`] is the REST layer (its `templates` the template routes); [`proxy`] routes envd
//! traffic; [`server`] wires them.

pub mod api;
pub mod edge_headers;
pub mod error;
pub mod ids;
pub mod intent;
pub mod node_http;
pub mod pools;
pub mod proxy;
pub mod routes;
pub mod sandboxes;
pub mod server;
pub mod spool;
pub mod templates;
pub mod tokens;
