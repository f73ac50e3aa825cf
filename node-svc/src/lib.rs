//! node-svc: runs sandboxes on one host and reports them to placement in heartbeats that list
//! every sandbox by ID.
//!
//! Layout: [`sandbox`] is the pure core (records, legal moves, fencing, operation answers);
//! [`runtime`] runs sandboxes (real processes or simulated); [`host`] owns the registry and
//! every lifecycle operation, keeping each sandbox in the [`state_dir`], seeding new ones from
//! a [`template`] and moving them between nodes as [`snapshot`] streams; [`heartbeat`]
//! reports to placement; [`api`] is the gRPC service; [`envd`] the in-sandbox API; [`server`]
//! wires them.
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
pub mod snapshot;
pub mod state_dir;
pub mod template;
pub mod usage;
