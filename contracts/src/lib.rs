//! The contracts of sandboxsched: what two services must agree on, defined once and free of
//! I/O (no runtime, no network, no database), so `proto` and every service can depend on it
//! without dragging in a service kit.
//!
//! - [`docs`]: the shapes of the ledger's documents (manifests, node documents, plans).
//! - [`fit`]: the one allocation rule placement places by and the balancer plans by.
//! - [`egress`]: a sandbox's network policy and the floor no policy opens.
//! - [`template`]: a template's image and the grammar of its names and steps.
//! - [`envd`]: the variables a sandbox's settings reach its envd by.
//! - [`ids`]: the sandbox-ID rule the gateway, the node and the jail each check.
//! - [`pool`]: warm pools, the documents that say how many ready sandboxes a template keeps.
//! - [`resources`]: the defaults a create assumes when it states nothing (512 MiB, ...).
//!
//! `common` re-exports each module under its old path (`common::docs`, ...).

pub mod docs;
pub mod egress;
pub mod envd;
pub mod fit;
pub mod ids;
pub mod pool;
pub mod resources;
pub mod template;
