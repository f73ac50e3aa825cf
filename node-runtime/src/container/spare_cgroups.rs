//! Spare cgroups: a killed sandbox's emptied cgroup kept, reset, for the next sandbox.
//!
//! Removing a memory cgroup is not the `rmdir` it looks like. Taking it offline, the kernel
//! walks every memcg-aware list of every superblock on the host (`memcg_reparent_list_lrus`,
//! under one global mutex), and each sandbox brings about ten superblocks (its root, its
//! disk, `/proc`, `/dev`, `/sys`...). So each removal costs in proportion to the sandboxes on
//! the host, and a burst of kills in proportion to the square: with 500 sandboxes, a fifth of
//! the burst's CPU, and a superblock torn down meanwhile waits on the same mutex.
//!
//! So a kill keeps its sandbox's cgroup instead, where the host allows (cgroup v1, which can
//! rename a group beside itself): once every process in it is gone, the jail resets it to
//! what a new group is (no limits, zeroed peaks, failure counts and CPU time, thawed) and
//! renames it `.spare-N` under the node's parent group. A create renames a spare to its
//! sandbox's group before the container starts, and the runtime finds it there and applies
//! the sandbox's limits, as it does to any group that exists. Neither path then creates or
//! removes a cgroup.
//!
//! What a spare carries over: counters the kernel cannot zero (`memory.stat`'s running
//! totals, OOM kills, throttling; nothing reads them), and page cache still charged to it
//! (files its sandbox read that stay cached elsewhere, and its own disk's files until the
//! janitor unmounts that disk). That charge would show in the next sandbox's memory figures,
//! so a spare is taken only while it is below [`CHARGE_LEFT`] (measured: 8–12 KiB for most,
//! at most a few hundred KiB, a burst of 300 kills), the oldest first; one above waits its
//! turn again, and is removed after [`CHARGED_FOR`] (see [`SpareCgroups::take`]). Nothing of
//! the earlier sandbox's files, processes or limits is reachable from it, and nothing inside a
//! sandbox sees a cgroup file system.
//!
//! Bounded: at most [`LIMIT`] spares are kept; a kill past that removes its group. A node
//! takes back at its start the spares its previous run left (empty, or removed).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use jail::cgroup::{Cgroup, Hierarchy, Version};

/// The most spare cgroups a node keeps.
pub const LIMIT: usize = 1024;

/// The most memory still charged to a spare that a create takes it with, besides what the
/// kernel may hold charged ahead in each CPU's batch ([`charge_left`]).
pub const CHARGE_LEFT: u64 = 1 << 20;

/// How long a spare may stay charged with more before it is removed.
pub const CHARGED_FOR: Duration = Duration::from_secs(60);

/// How many spares a create looks at, the oldest first.
const LOOKS: usize = 4;

/// [`CHARGE_LEFT`] on this host: v1's `memory.usage_in_bytes` counts the pages each CPU
/// charged ahead (64 at the most) as used, so an empty group on a host of many cores may show
/// more than a megabyte.
pub fn charge_left() -> u64 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    CHARGE_LEFT + cpus * 64 * 4096
}

/// A kept group, and since when (the longer it has waited, the less is charged to it).
struct Spare {
    path: String,
    since: Instant,
}

impl Spare {
    fn new(path: String) -> Self {
        Self {
            path,
            since: Instant::now(),
        }
    }
}

/// The leaf name every spare's begins with: never a sandbox ID, which cannot start with a dot.
pub const PREFIX: &str = ".spare-";

/// A node's spare cgroups (see the module's doc).
pub struct SpareCgroups {
    /// `/sandboxsched-<node>`, the group every sandbox's group and every spare sits under;
    /// v1 only, `None` keeps no spares.
    parent: Option<Cgroup>,
    /// Oldest first: the longer a spare has waited, the less is charged to it.
    free: Mutex<VecDeque<Spare>>,
    next: AtomicU64,
    /// [`charge_left`], read once (the CPUs are counted through the cgroup file system).
    charge_left: u64,
}

impl SpareCgroups {
    /// The spares of the node whose groups sit under `parent` (`/sandboxsched-<node>`):
    /// those an earlier run of the node left, where they are still empty.
    pub fn new(parent: String) -> Self {
        let hierarchy = Hierarchy::detect().ok().filter(|h| h.version == Version::V1);
        let parent = hierarchy.and_then(|h| Cgroup::new(&h, &parent).ok());
        let (free, next) = match &parent {
            Some(parent) => left_by_earlier_run(parent),
            None => {
                tracing::info!("no spare cgroups: this host's cgroups are not v1 (a v2 group cannot be renamed)");
                (VecDeque::new(), 0)
            }
        };
        Self {
            parent,
            free: Mutex::new(free),
            next: AtomicU64::new(next),
            charge_left: charge_left(),
        }
    }

    /// Keeps no spares (a v2 host, or a runtime that removes its groups itself).
    pub fn none() -> Self {
        Self {
            parent: None,
            free: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(0),
            charge_left: CHARGE_LEFT,
        }
    }

    /// The path a killed sandbox's group is to be kept at, while there is room for one more.
    /// (Kills at once may each see the last room: the bound is passed by as many.)
    pub fn next_path(&self) -> Option<String> {
        let parent = self.parent.as_ref()?;
        if self.lock().len() >= LIMIT {
            return None;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Some(format!("{}/{PREFIX}{n}", parent.path()))
    }

    /// Records that a killed sandbox's group is kept at `path` (from [`SpareCgroups::next_path`]).
    pub fn kept(&self, path: String) {
        self.lock().push_back(Spare::new(path));
    }

    /// Renames a spare to `to` (a sandbox's group path), if one of the oldest has little
    /// enough charged to it ([`charge_left`]): whether one had. A spare still charged with more
    /// waits its turn again (its disk's cache and its kernel objects are uncharged once the
    /// janitor has unmounted that disk), and is removed once it has been so for
    /// [`CHARGED_FOR`] (its sandbox was the first to read files that stay cached, and holds
    /// their charge for as long as they do). One that cannot be renamed because `to` exists (a
    /// group of that ID left from before, which the runtime reuses instead) goes back.
    pub fn take(&self, to: &str) -> bool {
        let Some(parent) = &self.parent else {
            return false;
        };
        for _ in 0..LOOKS {
            let Some(spare) = self.lock().pop_front() else {
                return false;
            };
            let Ok(group) = below(parent, &spare.path) else {
                self.lock().push_back(spare);
                return false;
            };
            if !group.memory_usage().is_ok_and(|bytes| bytes <= self.charge_left) {
                if spare.since.elapsed() < CHARGED_FOR {
                    self.lock().push_back(spare);
                } else {
                    let _ = group.remove(false);
                }
                continue;
            }
            return match group.rename(to) {
                // The sandbox's CPU time from zero: its spare's may hold the last microseconds
                // of the one before (see `Cgroup::zero_cpu_time`).
                Ok(taken) => {
                    if let Err(err) = taken.zero_cpu_time() {
                        tracing::warn!(%err, cgroup = to, "a spare's CPU time was not zeroed");
                    }
                    true
                }
                Err(err) if exists(&err) => {
                    self.lock().push_back(spare);
                    false
                }
                Err(err) => {
                    tracing::warn!(%err, spare = spare.path, "a spare cgroup could not be taken: removed");
                    let _ = group.remove(false);
                    false
                }
            };
        }
        false
    }

    /// Takes in the group at `path` that no container holds (a create that took a spare and
    /// failed before its container existed; a sandbox's group left by a node that died
    /// before its container's state was written): kept if it is empty and there is room,
    /// else removed. Nothing there, nothing done.
    pub fn give_back(&self, path: &str) {
        let Some(parent) = &self.parent else {
            return;
        };
        let Ok(group) = below(parent, path) else {
            return;
        };
        if !group.dirs().any(std::path::Path::exists) {
            return;
        }
        if !group.is_empty().unwrap_or(true) {
            tracing::warn!(cgroup = path, "a group no container holds has tasks in it: left alone");
            return;
        }
        let Some(spare) = self.next_path() else {
            let _ = group.remove(false);
            return;
        };
        match group.retire(&spare) {
            Ok(_) => self.kept(spare),
            Err(err) => {
                tracing::warn!(cgroup = path, %err, "a group no container holds was not kept: removed");
                let _ = group.remove(false);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Spare>> {
        self.free.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Whether a rename failed because its target exists.
fn exists(err: &jail::cgroup::CgroupError) -> bool {
    matches!(err, jail::cgroup::CgroupError::Io { source, .. } if source.kind() == std::io::ErrorKind::AlreadyExists)
}

/// The group at `path`, a child of `parent`'s.
fn below(parent: &Cgroup, path: &str) -> Result<Cgroup, jail::cgroup::CgroupError> {
    parent.child(path.rsplit('/').next().unwrap_or_default())
}

/// The spares an earlier run of the node left under `parent`, oldest first, and the number
/// after the highest: each kept if it is whole and empty (its limits and figures were reset
/// when it became a spare), removed otherwise or past [`LIMIT`].
fn left_by_earlier_run(parent: &Cgroup) -> (VecDeque<Spare>, u64) {
    let mut numbered = std::collections::BTreeMap::new();
    for dir in parent.dirs() {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(n) = name.strip_prefix(PREFIX) else { continue };
            let Ok(group) = parent.child(&name) else { continue };
            match n.parse::<u64>() {
                Ok(n) => {
                    numbered.insert(n, group);
                }
                // Not one this node named: removed (as every spare was before they were taken
                // back).
                Err(_) => {
                    let _ = group.remove(false);
                }
            }
        }
    }
    let next = numbered.keys().next_back().map_or(0, |n| n + 1);
    let mut free = VecDeque::new();
    for group in numbered.into_values() {
        if free.len() < LIMIT && group.is_empty().unwrap_or(false) {
            free.push_back(Spare::new(group.path().to_string()));
        } else {
            let _ = group.remove(false);
        }
    }
    (free, next)
}
