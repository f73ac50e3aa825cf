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
//! What a spare carries over, and why that is acceptable: `memory.stat`'s running totals, and
//! page cache still charged to it (files its sandbox read that stay cached: its template's
//! libraries, most often). A removed group keeps the same charge as a lingering offline
//! group until reclaim takes that cache; a spare's next sandbox sees it in its usage and
//! reclaims it first under its limit. Nothing of the earlier sandbox's files, processes or
//! limits is reachable from it.
//!
//! Bounded: at most [`LIMIT`] spares are kept; a kill past that removes its group. A node
//! starts with none, removing those a previous run left (empty, so nothing is lost).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use jail::cgroup::{Cgroup, Hierarchy, Version};

/// The most spare cgroups a node keeps.
pub const LIMIT: usize = 1024;

/// The leaf name every spare's begins with: never a sandbox ID, which cannot start with a dot.
pub const PREFIX: &str = ".spare-";

/// A node's spare cgroups (see the module's doc).
pub struct SpareCgroups {
    /// `/sandboxsched-<node>`: the parent every sandbox's group and every spare sits under.
    parent: String,
    /// v1 only; `None` keeps no spares.
    hierarchy: Option<Hierarchy>,
    free: Mutex<Vec<String>>,
    next: AtomicU64,
}

impl SpareCgroups {
    /// The spares of the node whose groups sit under `parent` (`/sandboxsched-<node>`): none
    /// yet. What an earlier run of the node left under it is removed.
    pub fn new(parent: String) -> Self {
        let hierarchy = Hierarchy::detect().ok().filter(|h| h.version == Version::V1);
        if let Some(h) = &hierarchy {
            remove_left(h, &parent);
        }
        Self {
            parent,
            hierarchy,
            free: Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
        }
    }

    /// Keeps no spares (a v2 host, or a runtime that removes its groups itself).
    pub fn none() -> Self {
        Self {
            parent: String::new(),
            hierarchy: None,
            free: Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
        }
    }

    /// The path a killed sandbox's group is to be kept at, while there is room for one more.
    pub fn next_path(&self) -> Option<String> {
        self.hierarchy.as_ref()?;
        if self.lock().len() >= LIMIT {
            return None;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Some(format!("{}/{PREFIX}{n}", self.parent))
    }

    /// Records that a killed sandbox's group is kept at `path` (from [`SpareCgroups::next_path`]).
    pub fn kept(&self, path: String) {
        self.lock().push(path);
    }

    /// Renames a spare to `to` (a sandbox's group path), if there is one: whether there was.
    /// A spare that cannot be renamed (`to` exists: a group of that ID left from before,
    /// which the runtime reuses instead) goes back; one gone wrong otherwise is removed.
    pub fn take(&self, to: &str) -> bool {
        let Some(hierarchy) = &self.hierarchy else {
            return false;
        };
        let Some(spare) = self.lock().pop() else {
            return false;
        };
        let Ok(group) = Cgroup::new(hierarchy, &spare) else {
            return false;
        };
        match group.rename(to) {
            Ok(_) => true,
            Err(err) if exists(&err) => {
                self.kept(spare);
                false
            }
            Err(err) => {
                tracing::warn!(%err, spare, "a spare cgroup could not be taken: removed");
                let _ = group.remove(false);
                false
            }
        }
    }

    /// Gives back the group at `path` that a create took and then failed with before its
    /// container existed (the runtime removes only groups it made): kept again, or removed.
    pub fn give_back(&self, path: &str) {
        let Some(hierarchy) = &self.hierarchy else {
            return;
        };
        let Ok(group) = Cgroup::new(hierarchy, path) else {
            return;
        };
        let kept = self
            .next_path()
            .filter(|spare| group.reset().and_then(|()| group.rename(spare)).is_ok());
        match kept {
            Some(spare) => self.kept(spare),
            None => {
                let _ = group.remove(false);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.free.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Whether a rename failed because its target exists.
fn exists(err: &jail::cgroup::CgroupError) -> bool {
    matches!(err, jail::cgroup::CgroupError::Io { source, .. } if source.kind() == std::io::ErrorKind::AlreadyExists)
}

/// Removes the spares an earlier run of the node left under `parent`, in every hierarchy.
fn remove_left(hierarchy: &Hierarchy, parent: &str) {
    let Ok(parent_group) = Cgroup::new(hierarchy, parent) else {
        return;
    };
    let mut names = std::collections::BTreeSet::new();
    for dir in parent_group.dirs() {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(PREFIX) {
                names.insert(name);
            }
        }
    }
    for name in names {
        if let Ok(group) = Cgroup::new(hierarchy, &format!("{parent}/{name}")) {
            let _ = group.remove(false);
        }
    }
}
