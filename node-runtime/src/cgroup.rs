//! cgroup v1 memory, freezer and cpuacct groups for sandboxes (this host has v1 controllers writable
//! by root). Each node gets its own parent group, `sandboxsched-<node>`, so several node-svcs on
//! one host never touch each other's sandboxes.
//!
//! Processes join the groups from inside the child between fork and exec (writing `0` to
//! `cgroup.procs` moves the writer), so every descendant is accounted and frozen with it.

use std::ffi::CString;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const ROOT: &str = "/sys/fs/cgroup";

/// The cgroup parents of one node, for the controllers that are available.
#[derive(Clone, Debug)]
pub struct Cgroups {
    memory: Option<PathBuf>,
    freezer: Option<PathBuf>,
    /// CPU time, for the heartbeat's `cpu_usage` (the node's parent group counts every
    /// sandbox in it).
    cpuacct: Option<PathBuf>,
}

/// The name of node `node_id`'s parent group under each controller. The container runtime's
/// spec names the same group, so what the node measures is what the runtime created.
pub fn parent_name(node_id: &str) -> String {
    format!("sandboxsched-{node_id}")
}

/// The default cap on the processes of all of a node's sandboxes together: three quarters of
/// what the host can have (the smaller of `kernel.pid_max` and `kernel.threads-max`), so
/// sandboxes that fork all they may still leave the host and the node room to work.
pub fn default_pids_max() -> u64 {
    let read = |path: &str| fs::read_to_string(path).ok()?.trim().parse::<u64>().ok();
    let host = match (read("/proc/sys/kernel/pid_max"), read("/proc/sys/kernel/threads-max")) {
        (Some(a), Some(b)) => a.min(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => 32_768,
    };
    host / 4 * 3
}

/// The v1 controllers a sandbox's processes join.
const CONTROLLERS: [&str; 3] = ["memory", "freezer", "cpuacct"];

impl Cgroups {
    /// Probes the host: creates `sandboxsched-<node>` under each v1 controller it can write,
    /// and caps the processes of all the node's sandboxes together at `pids_max` (the pids
    /// controller's parent group, which every sandbox's group sits under). Returns what worked
    /// and, for what did not, why.
    pub fn probe(node_id: &str, pids_max: u64) -> (Self, Vec<String>) {
        let mut degraded = Vec::new();
        let mut make = |controller: &str| -> Option<PathBuf> {
            let base = Path::new(ROOT).join(controller);
            if !base.join("cgroup.procs").exists() {
                degraded.push(format!("{controller} cgroup (v1) not mounted at {}", base.display()));
                return None;
            }
            let parent = base.join(parent_name(node_id));
            match fs::create_dir_all(&parent) {
                Ok(()) => Some(parent),
                Err(err) => {
                    degraded.push(format!("cannot create {}: {err}", parent.display()));
                    None
                }
            }
        };
        let memory = make("memory");
        let freezer = make("freezer");
        let cpuacct = make("cpuacct");
        if let Some(pids) = make("pids") {
            if let Err(err) = fs::write(pids.join("pids.max"), pids_max.to_string()) {
                degraded.push(format!("no node-wide process limit: {}: {err}", pids.display()));
            }
        }
        (
            Self {
                memory,
                freezer,
                cpuacct,
            },
            degraded,
        )
    }

    /// No cgroups at all (used by tests and where the host has none).
    pub fn none() -> Self {
        Self {
            memory: None,
            freezer: None,
            cpuacct: None,
        }
    }

    pub fn has_memory(&self) -> bool {
        self.memory.is_some()
    }

    pub fn has_freezer(&self) -> bool {
        self.freezer.is_some()
    }

    fn memory_dir(&self, sandbox: &str) -> Option<PathBuf> {
        self.memory.as_ref().map(|p| p.join(sandbox))
    }

    fn freezer_dir(&self, sandbox: &str) -> Option<PathBuf> {
        self.freezer.as_ref().map(|p| p.join(sandbox))
    }

    /// The sandbox's group under every controller there is.
    fn dirs(&self, sandbox: &str) -> impl Iterator<Item = PathBuf> + '_ {
        let sandbox = sandbox.to_string();
        [&self.memory, &self.freezer, &self.cpuacct]
            .into_iter()
            .flatten()
            .map(move |parent| parent.join(&sandbox))
    }

    /// CPU time (ns) every sandbox of this node has used, dead ones included: the parent
    /// group's `cpuacct.usage`, which only grows.
    pub fn cpu_time_ns(&self) -> Option<u64> {
        let parent = self.cpuacct.as_ref()?;
        fs::read_to_string(parent.join("cpuacct.usage"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// CPU time (ns) one sandbox has used: its group's `cpuacct.usage`.
    pub fn cpu_usage_ns(&self, sandbox: &str) -> Option<u64> {
        let dir = self.cpuacct.as_ref()?.join(sandbox);
        fs::read_to_string(dir.join("cpuacct.usage")).ok()?.trim().parse().ok()
    }

    /// Creates the sandbox's groups (idempotent) and sets its memory limit.
    pub fn create(&self, sandbox: &str, memory_limit: u64) -> std::io::Result<()> {
        if let Some(dir) = self.memory_dir(sandbox) {
            fs::create_dir_all(&dir)?;
            if memory_limit > 0 {
                fs::write(dir.join("memory.limit_in_bytes"), memory_limit.to_string())?;
            }
        }
        for dir in [
            self.freezer_dir(sandbox),
            self.cpuacct.as_ref().map(|p| p.join(sandbox)),
        ]
        .into_iter()
        .flatten()
        {
            fs::create_dir_all(&dir)?;
        }
        Ok(())
    }

    /// The `cgroup.procs` files a new process must join, as C strings ready for `pre_exec`.
    pub fn join_paths(&self, sandbox: &str) -> Vec<CString> {
        self.dirs(sandbox)
            .filter_map(|d| CString::new(d.join("cgroup.procs").into_os_string().into_encoded_bytes()).ok())
            .collect()
    }

    /// Every process in the sandbox's groups.
    pub fn pids(&self, sandbox: &str) -> Vec<i32> {
        let dir = self.memory_dir(sandbox).or_else(|| self.freezer_dir(sandbox));
        dir.and_then(|d| fs::read_to_string(d.join("cgroup.procs")).ok())
            .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Memory charged to the sandbox (bytes), if accounted.
    pub fn memory_usage(&self, sandbox: &str) -> Option<u64> {
        let dir = self.memory_dir(sandbox)?;
        fs::read_to_string(dir.join("memory.usage_in_bytes"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Freezes (`true`) or thaws the sandbox and waits until the kernel says it is done.
    /// Returns `false` when there is no freezer.
    pub fn freeze(&self, sandbox: &str, frozen: bool) -> std::io::Result<bool> {
        let Some(dir) = self.freezer_dir(sandbox) else {
            return Ok(false);
        };
        let want = if frozen { "FROZEN" } else { "THAWED" };
        let state = dir.join("freezer.state");
        fs::write(&state, want)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let now = fs::read_to_string(&state)?;
            if now.trim() == want {
                return Ok(true);
            }
            if Instant::now() > deadline {
                return Err(std::io::Error::other(format!("freezer stuck in {}", now.trim())));
            }
            // FREEZING settles within microseconds for a handful of processes; re-asking the
            // kernel is how the v1 freezer is meant to be driven.
            fs::write(&state, want)?;
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Removes the sandbox's groups (they must be empty).
    pub fn remove(&self, sandbox: &str) {
        for dir in self.dirs(sandbox) {
            let _ = fs::remove_dir(dir);
        }
    }
}

/// Removes a node's parent groups, `sandboxsched-<node>`, and any empty groups left below
/// them, in every hierarchy mounted under `/sys/fs/cgroup`: what tests and benchmarks call once
/// a node and all its sandboxes are gone. Every hierarchy, not only the node's own controllers:
/// an OCI runtime creates each sandbox's group in all of them (blkio, cpuset, devices, pids...),
/// and only empty groups can be removed, so a busy one stays.
pub fn remove_parents(node_id: &str) {
    let parent = parent_name(node_id);
    let hierarchies = fs::read_dir(ROOT).into_iter().flatten().flatten().map(|e| e.path());
    for dir in hierarchies.map(|h| h.join(&parent)).filter(|d| d.is_dir()) {
        remove_empty_tree(&dir);
    }
    for controller in CONTROLLERS {
        let _ = fs::remove_dir(Path::new(ROOT).join(controller).join(&parent));
    }
}

/// Removes the groups under `dir`, deepest first, then `dir`; a group with processes stays.
fn remove_empty_tree(dir: &Path) {
    for child in fs::read_dir(dir).into_iter().flatten().flatten() {
        if child.file_type().is_ok_and(|t| t.is_dir()) {
            remove_empty_tree(&child.path());
        }
    }
    let _ = fs::remove_dir(dir);
}
