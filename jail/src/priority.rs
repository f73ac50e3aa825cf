//! The helper's priority: a create's work ahead of the node's other work, and every
//! container's own processes back at the node's priority before their first instruction.
//!
//! A create is a chain of steps a caller waits on, and a large part of it runs in the helper
//! and its run child (the spec read, the clone, the id maps, waiting for the init). When the
//! node is busy with other work (a burst of kills: processes exiting, file systems and
//! namespaces torn down, cgroups reset), those steps queued for a core behind all of it; on
//! two cores a create made during a 500-sandbox burst took five times its usual time. A kill's
//! caller waits too, but for nothing to run afterwards, while a create's caller is about to run
//! code; so the helper runs [`CREATE_BOOST`] steps above the node's own priority, and its run
//! children with it. (The init itself runs in its sandbox's cgroup from its first step, where
//! a nice value ranks it only among the sandbox's own tasks, so the boost does not reach it.)
//! Measured with `bench node --kill-burst 500`, ten alternated pairs on two cores: creates
//! during the burst had a lower p50 in eight (medians of two sets of five: 55 → 40 ms and
//! 50 → 46 ms), the burst itself no slower, and creates outside the burst p50 10.2 → 8.9 ms.
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
