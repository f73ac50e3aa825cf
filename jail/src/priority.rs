//! The helper's priority: a create's work ahead of the node's other work, and every
//! container's own processes back at the node's priority before their first instruction.
//!
//! A create is a chain of steps a caller waits on; most of its CPU time is spent in the
//! helper's run child and in the container's init before `execve` (the clone, the mounts,
//! the pivot). When the node is busy with other work (a burst of kills: processes exiting,
//! file systems and namespaces torn down, cgroups reset), a create's steps queued for a core
//! behind all of it, and on two cores a create made during a 500-sandbox burst took five times
//! its usual time. Kills and teardowns are work nobody waits on the way a create's caller does,
//! so the helper runs [`CREATE_BOOST`] steps above the node's own priority, and its runs
//! with it; measured (`bench node --kill-burst 500`, alternated), creates during the burst went
//! from a median p50 of 55 ms to 40 ms, the burst itself as fast.
//!
//! The container's processes must not keep the boost: the init sets the node's own nice value
//! again before it drops its capabilities, installs its seccomp filter or execs (lowering one's
//! own priority needs no privilege). Raising needs `CAP_SYS_NICE`; a helper without it says so
//! and runs at the node's priority, as it did before, and then nothing is set back.

use std::sync::atomic::{AtomicI32, Ordering};

/// Nice steps the helper runs above the node that started it (lower is more favoured; -20 is
/// the highest). Five steps give a create about three times a nice-0 thread's share of a core.
pub const CREATE_BOOST: i32 = 5;

/// No boost: containers keep whatever priority they were started with.
const UNRAISED: i32 = i32::MIN;

/// The node's own nice value, once this process has raised itself above it.
static NODE_NICE: AtomicI32 = AtomicI32::new(UNRAISED);

/// Raises the calling process (the helper, single-threaded, so its thread is the process)
/// [`CREATE_BOOST`] steps above its current nice value, remembering that value for its
/// containers ([`for_containers`]).
pub fn raise_for_creates() -> rustix::io::Result<()> {
    let own = rustix::process::getpriority_process(None)?;
    let raised = (own - CREATE_BOOST).max(-20);
    if raised == own {
        return Ok(());
    }
    rustix::process::setpriority_process(None, raised)?;
    NODE_NICE.store(own, Ordering::Relaxed);
    Ok(())
}

/// The nice value a container's init sets before the container's own code runs: the node's,
/// when this process raised itself above it; `None` when it did not (nothing to set back).
pub fn for_containers() -> Option<i32> {
    let nice = NODE_NICE.load(Ordering::Relaxed);
    (nice != UNRAISED).then_some(nice)
}
