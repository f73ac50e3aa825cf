//! node-svc: runs sandboxes on one host and reports them to placement in heartbeats that list
//! every sandbox by ID.
//!
//! Layout: [`sandbox`] is the pure core (records, legal moves, fencing, operation answers);
//! [`runtime`] runs sandboxes (real processes or simulated); [`host`] owns the registry and
//! its state directory; [`heartbeat`] reports to placement; [`api`] is the gRPC service;
//! [`server`] wires them.
//!
//! Process memory is not preserved across snapshot and restore in the process runtime: the
//! sandbox's files are. A restored sandbox starts its start command afresh on resume.

pub mod api;
pub mod envd;
pub mod heartbeat;
pub mod host;
pub mod runtime;
pub mod sandbox;
pub mod server;
pub mod usage;
