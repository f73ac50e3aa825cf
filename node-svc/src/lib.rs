//! node-svc: runs sandboxes on one host and reports them to placement in heartbeats that list
//! every sandbox by ID.
//!
//! Layout: [`sandbox`] is the pure core (records, legal moves, fencing, operation answers);
//! [`runtime`] (the `node-runtime` crate) runs sandboxes (containers, plain processes or
//! simulated) and gives each a [`disk`] of its own; [`host`] owns the registry and every
//! lifecycle operation, keeping each sandbox in the [`state_dir`], seeding new ones from
//! a [`template`] and moving them between nodes as [`snapshot`] streams; [`heartbeat`]
//! reports to placement; [`api`] is the gRPC service; [`envd`] the in-sandbox API; [`server`]
//! wires them. Templates with layers: [`layer_cache`] keeps their layers (fetched from the blob
//! store), [`build`] builds them step by step, talking to the builder containers' envd through
//! [`envd_client`].
//!
//! Process memory is not preserved across snapshot and restore in the process runtime: the
//! sandbox's files are. A restored sandbox starts its start command afresh on resume.

pub mod api;
pub mod build;
pub mod envd;
pub mod envd_client;
pub mod heartbeat;
pub mod host;
pub mod layer_cache;
pub mod logs;
pub mod metrics;
pub mod sandbox;
pub mod server;
pub mod snapshot;
pub mod state_dir;
pub mod template;
pub mod usage;

pub use node_runtime as runtime;
pub use node_runtime::disk;

/// When this process was started as envd (`BINARY envd ARGS`, how the container runtime runs
/// envd inside each sandbox) or as the OCI runtime (`BINARY jail ARGS`), runs that and returns
/// its exit code; `None` for any other command line. Binaries that host node-svc call it first
/// thing in `main`, before any runtime or thread starts.
pub fn multicall() -> Option<std::process::ExitCode> {
    runtime::container::MULTICALL_HERE.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut args = std::env::args_os().skip(1);
    match args.next()?.to_str()? {
        "envd" => Some(::envd::main(args)),
        "jail" => Some(jail::main(args)),
        _ => None,
    }
}
