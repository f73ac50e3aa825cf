//! e2b-gateway: E2B's REST API and envd proxy in front of the cluster, so unmodified E2B SDKs
//! work against it with only `E2B_API_URL`, `E2B_SANDBOX_URL` and `E2B_API_KEY` set.
//!
//! Layout: [`intent`] is the pure core (a create request normalised into a complete intent,
//! memory estimate and its source included); [`sandboxes`] drives ledger, placement and nodes
//! (and undoes failed creates); [`api`] is the REST layer with E2B's error shape; [`proxy`]
//! routes envd traffic by the ledger's watch; [`templates`] is the template registry and
//! build driver, [`template_api`] its REST layer; [`server`] wires them.

pub mod api;
pub mod intent;
pub mod node_http;
pub mod proxy;
pub mod sandboxes;
pub mod server;
pub mod template_api;
pub mod templates;
pub mod tokens;
