//! balance-svc: keeps the cluster's memory balanced by migrating sandboxes.
//!
//! - [`plan`]: the pure core: spread, observation status, the fewest moves, drains, and the
//!   lower bound plans are compared to.
//! - [`optimum`] (in `plan`): the exact fewest moves on clusters small enough to search (pure).
//! - [`view`]: from ledger documents to the planner's snapshot (pure).
//! - [`record`]: the plan, lease, observation and control documents, and a move's steps.
//! - [`migrate`]: executes moves as persisted, fenced, idempotent state machines.
//! - [`orphan`]: which paused copies nobody points at may be removed, and when (pure).
//! - [`lease`]: one executor at a time.
//! - [`balancer`]: the cycle (lease, resume, observe, plan, commit, execute).
//! - [`api`], [`server`]: the gRPC face and the wiring.

pub mod api;
pub mod balancer;
pub mod lease;
pub mod migrate;
pub mod orphan;
pub mod plan;
pub use plan::optimum;
pub mod record;
pub mod server;
pub mod stuck;
pub mod view;
