//! Control groups: where the container's processes are accounted and limited.
//!
//! Linux has two cgroup interfaces and we support both:
//!
//! * **v1**: one hierarchy per controller, each mounted at `/sys/fs/cgroup/<controller>`.
//!   A container gets the same path (e.g. `/sandboxsched/ID`) created in every hierarchy we
//!   use: `memory`, `cpu`, `cpuacct`, `pids` and `freezer`. Several controllers may share
//!   one hierarchy (`cpu,cpuacct` with `cpu` and `cpuacct` as symlinks to it), so the
//!   hierarchies are de-duplicated by their canonical path.
//! * **v2**: a single unified hierarchy at `/sys/fs/cgroup`, where a controller is usable in
//!   a cgroup only if every ancestor lists it in `cgroup.subtree_control`. We enable
//!   `memory`, `cpu` and `pids` top-down before creating the leaf.
//!
//! The process joins the cgroup (its PID written to `cgroup.procs`) *before* it does
//! anything else, so everything it later forks is accounted from the start.
//!
//! Pausing uses the freezer: v1 writes `FROZEN` to `freezer.state` and waits until the
//! kernel reports `FROZEN` (it passes through `FREEZING`, and v1 has no notification, so
//! this is a bounded poll); v2 writes `1` to `cgroup.freeze` and waits for `frozen 1` in
//! `cgroup.events`, which the kernel signals with `POLLPRI`.
//!
//! The root and version are parameters ([`Hierarchy`]), so the unit tests below run the same
//! code against fake trees in a temporary directory. **What ran where**: the v1 code ran on
//! a real cgroup v1 machine (Linux 6.18, hybrid layout) in the integration tests — limits,
//! `cgroup.procs`, freezing, OOM kills, removal. The v2 code runs on that machine's real
//! cgroup2 mount (`unified/`, no controllers) in `tests/cgroup_v2.rs`: creation, joining,
//! forks following, freezing and thawing as `cgroup.events` reports them, `cgroup.kill`,
//! removal. Its limits (`memory.max`, `cpu.max`, `pids.max`, controller delegation) ran only
//! against the fake tree in this module's tests (files created the way the kernel presents
//! them): v1 holds those controllers there. On a pure v2 host the same test writes and reads
//! them back.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, Read, Seek, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use rustix::event::{PollFd, PollFlags};

use crate::sys::IoDisplay;

/// `CGROUP2_SUPER_MAGIC` of `<linux/magic.h>`: what `statfs` says of a cgroup2 mount.
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// Where cgroup hierarchies are mounted on a normal system.
pub const DEFAULT_MOUNT: &str = "/sys/fs/cgroup";

/// The v1 controllers we create the container's cgroup in (those that exist).
const V1_CONTROLLERS: [&str; 5] = ["memory", "cpu", "cpuacct", "pids", "freezer"];

/// The v2 controllers we enable for the container.
const V2_CONTROLLERS: [&str; 3] = ["memory", "cpu", "pids"];

/// How long `pause`/`resume` wait for the freezer to settle.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors from cgroup operations.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no cgroup hierarchy found under {0}")]
    NoHierarchy(PathBuf),
    #[error("invalid cgroup path {0:?}: must be absolute, without '.' or '..' components")]
    InvalidPath(String),
    #[error("cgroup {path}: {}", IoDisplay(source))]
    Io { path: PathBuf, source: io::Error },
    #[error("write {value:?} to {path}: {}", IoDisplay(source))]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("the freezer controller is not available")]
    NoFreezer,
    #[error("timed out waiting for {path} to become {want}")]
    FreezeTimeout { path: PathBuf, want: &'static str },
    #[error("processes still in cgroup {path} after {secs} s: {pids:?}")]
    KillTimeout { path: PathBuf, secs: u64, pids: Vec<i32> },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// cgroup interface version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Version {
    V1,
    V2,
}

/// Where the cgroup filesystem(s) live and which interface they speak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    pub version: Version,
    pub mount: PathBuf,
}

impl Hierarchy {
    /// Detects the layout under `/sys/fs/cgroup`: v2 if it is itself a cgroup2 mount
    /// (`statfs` magic `CGROUP2_SUPER_MAGIC`), v1 if controller directories exist under it
    /// (the "hybrid" layout with an empty cgroup2 at `unified/` counts as v1).
    pub fn detect() -> Result<Self, CgroupError> {
        Self::detect_at(Path::new(DEFAULT_MOUNT))
    }

    pub fn detect_at(mount: &Path) -> Result<Self, CgroupError> {
        if rustix::fs::statfs(mount).is_ok_and(|st| st.f_type == CGROUP2_SUPER_MAGIC) {
            return Ok(Hierarchy {
                version: Version::V2,
                mount: mount.to_path_buf(),
            });
        }
        if V1_CONTROLLERS.iter().any(|c| mount.join(c).is_dir()) {
            return Ok(Hierarchy {
                version: Version::V1,
                mount: mount.to_path_buf(),
            });
        }
        Err(CgroupError::NoHierarchy(mount.to_path_buf()))
    }
}

/// What `state.json` records about the container's cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupRecord {
    pub version: Version,
    pub mount: PathBuf,
    pub path: String,
}

/// The limits we apply, taken from `linux.resources` (OCI units: bytes, microseconds,
/// shares). `None` leaves the kernel default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources {
    pub memory_limit: Option<i64>,
    pub memory_reservation: Option<i64>,
    /// Memory + swap (the OCI meaning, which is v1's `memsw`).
    pub memory_swap: Option<i64>,
    pub cpu_shares: Option<u64>,
    pub cpu_quota: Option<i64>,
    pub cpu_period: Option<u64>,
    pub pids_limit: Option<i64>,
}

/// One directory of the container's cgroup (v1: one per distinct hierarchy).
#[derive(Debug, Clone)]
struct Dir {
    path: PathBuf,
    /// v1 controllers served by this hierarchy (empty for v2).
    controllers: Vec<&'static str>,
    /// Whether we created the directory (only those are removed if `run` fails).
    created: bool,
}

/// A container's cgroup.
#[derive(Debug, Clone)]
pub struct Cgroup {
    hierarchy: Hierarchy,
    path: String,
    dirs: Vec<Dir>,
}

/// Checks and normalises an absolute cgroup path (`/a/b/c`).
pub fn normalize_path(path: &str) -> Result<String, CgroupError> {
    let invalid = || CgroupError::InvalidPath(path.to_string());
    if !path.starts_with('/') {
        return Err(invalid());
    }
    let mut out = String::new();
    for comp in path.split('/').filter(|c| !c.is_empty()) {
        if comp == "." || comp == ".." {
            return Err(invalid());
        }
        out.push('/');
        out.push_str(comp);
    }
    if out.is_empty() {
        // The root cgroup cannot be a container's cgroup: we would delete it on `delete`.
        return Err(invalid());
    }
    Ok(out)
}

impl Cgroup {
    /// Describes the cgroup `path` in `hierarchy` without touching it.
    pub fn new(hierarchy: &Hierarchy, path: &str) -> Result<Self, CgroupError> {
        let path = normalize_path(path)?;
        let rel = path.trim_start_matches('/');
        let mut dirs: Vec<Dir> = Vec::new();
        match hierarchy.version {
            Version::V2 => dirs.push(Dir {
                path: hierarchy.mount.join(rel),
                controllers: vec![],
                created: false,
            }),
            Version::V1 => {
                let mut roots: Vec<PathBuf> = Vec::new();
                for c in V1_CONTROLLERS {
                    let Ok(root) = fs::canonicalize(hierarchy.mount.join(c)) else {
                        continue;
                    };
                    // `cpu` and `cpuacct` may be symlinks to one `cpu,cpuacct` hierarchy.
                    match roots.iter().position(|r| *r == root) {
                        Some(i) => dirs[i].controllers.push(c),
                        None => {
                            dirs.push(Dir {
                                path: root.join(rel),
                                controllers: vec![c],
                                created: false,
                            });
                            roots.push(root);
                        }
                    }
                }
                if dirs.is_empty() {
                    return Err(CgroupError::NoHierarchy(hierarchy.mount.clone()));
                }
            }
        }
        Ok(Cgroup {
            hierarchy: hierarchy.clone(),
            path,
            dirs,
        })
    }

    /// Re-opens the cgroup recorded in `state.json`.
    pub fn from_record(r: &CgroupRecord) -> Result<Self, CgroupError> {
        Self::new(
            &Hierarchy {
                version: r.version,
                mount: r.mount.clone(),
            },
            &r.path,
        )
    }

    pub fn record(&self) -> CgroupRecord {
        CgroupRecord {
            version: self.hierarchy.version,
            mount: self.hierarchy.mount.clone(),
            path: self.path.clone(),
        }
    }

    /// The cgroup's path in its hierarchy (`/a/b`).
    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn version(&self) -> Version {
        self.hierarchy.version
    }

    /// The directories of this cgroup (one per v1 hierarchy, one for v2).
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.dirs.iter().map(|d| d.path.as_path())
    }

    /// Creates the cgroup and applies `resources`.
    pub fn create(&mut self, resources: &Resources) -> Result<(), CgroupError> {
        self.create_dirs()?;
        self.apply(resources)
    }

    /// Creates the directories (and, for v2, enables the controllers on the way down).
    /// An existing leaf is reused, as runc does; only directories we made are tracked as
    /// ours for cleanup.
    pub fn create_dirs(&mut self) -> Result<(), CgroupError> {
        match self.hierarchy.version {
            Version::V1 => {
                for d in &mut self.dirs {
                    if let Some(parent) = d.path.parent() {
                        fs::create_dir_all(parent).map_err(io_at(parent))?;
                    }
                    d.created = mkdir(&d.path)?;
                }
            }
            Version::V2 => {
                // Walk from the mount point to the leaf: each ancestor must delegate the
                // controllers to its children before the child can use them.
                let mut cur = self.hierarchy.mount.clone();
                let comps: Vec<&str> = self.path.split('/').filter(|c| !c.is_empty()).collect();
                for (i, comp) in comps.iter().enumerate() {
                    enable_v2_controllers(&cur)?;
                    cur.push(comp);
                    let created = mkdir(&cur)?;
                    if i + 1 == comps.len() {
                        self.dirs[0].created = created;
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes the limits into the (existing) cgroup.
    pub fn apply(&self, r: &Resources) -> Result<(), CgroupError> {
        match self.hierarchy.version {
            Version::V1 => self.apply_v1(r),
            Version::V2 => self.apply_v2(r),
        }
    }

    fn dir_for(&self, controller: &str) -> Option<&Path> {
        match self.hierarchy.version {
            Version::V2 => Some(&self.dirs[0].path),
            Version::V1 => self
                .dirs
                .iter()
                .find(|d| d.controllers.contains(&controller))
                .map(|d| d.path.as_path()),
        }
    }

    fn need(&self, controller: &'static str) -> Result<&Path, CgroupError> {
        self.dir_for(controller)
            .ok_or_else(|| CgroupError::Invalid(format!("the {controller} cgroup controller is not available")))
    }

    fn apply_v1(&self, r: &Resources) -> Result<(), CgroupError> {
        if r.memory_limit.is_some() || r.memory_swap.is_some() || r.memory_reservation.is_some() {
            let dir = self.need("memory")?;
            // A fresh cgroup starts unlimited, so the memory limit can go first; memsw must be
            // >= the memory limit at all times and is written second.
            if let Some(limit) = r.memory_limit {
                write_file(dir, "memory.limit_in_bytes", &limit.to_string())?;
            }
            if let Some(swap) = r.memory_swap {
                // Without swap accounting the kernel has no memsw file; then there is no swap
                // limit to set (the brief: write memsw only if it exists).
                if dir.join("memory.memsw.limit_in_bytes").exists() {
                    write_file(dir, "memory.memsw.limit_in_bytes", &swap.to_string())?;
                }
            }
            if let Some(res) = r.memory_reservation {
                write_file(dir, "memory.soft_limit_in_bytes", &res.to_string())?;
            }
        }
        if r.cpu_shares.is_some() || r.cpu_quota.is_some() || r.cpu_period.is_some() {
            let dir = self.need("cpu")?;
            if let Some(shares) = r.cpu_shares {
                write_file(dir, "cpu.shares", &shares.to_string())?;
            }
            // Period first: the kernel validates the quota against the period in force.
            if let Some(period) = r.cpu_period {
                write_file(dir, "cpu.cfs_period_us", &period.to_string())?;
            }
            if let Some(quota) = r.cpu_quota {
                let q = if quota <= 0 { -1 } else { quota };
                write_file(dir, "cpu.cfs_quota_us", &q.to_string())?;
            }
        }
        if let Some(limit) = r.pids_limit {
            write_file(self.need("pids")?, "pids.max", &pids_value(limit))?;
        }
        Ok(())
    }

    fn apply_v2(&self, r: &Resources) -> Result<(), CgroupError> {
        let dir = &self.dirs[0].path;
        if let Some(limit) = r.memory_limit {
            write_file(dir, "memory.max", &max_or(limit))?;
        }
        if let Some(swap) = r.memory_swap {
            if let Some(v) = v2_swap_max(swap, r.memory_limit).map_err(CgroupError::Invalid)? {
                write_file(dir, "memory.swap.max", &v)?;
            }
        }
        if let Some(res) = r.memory_reservation {
            write_file(dir, "memory.low", &max_or(res))?;
        }
        if let Some(shares) = r.cpu_shares {
            if shares != 0 {
                write_file(dir, "cpu.weight", &shares_to_weight(shares).to_string())?;
            }
        }
        if r.cpu_quota.is_some() || r.cpu_period.is_some() {
            let period = r.cpu_period.unwrap_or(100_000);
            let quota = match r.cpu_quota {
                Some(q) if q > 0 => q.to_string(),
                _ => "max".to_string(),
            };
            write_file(dir, "cpu.max", &format!("{quota} {period}"))?;
        }
        if let Some(limit) = r.pids_limit {
            write_file(dir, "pids.max", &pids_value(limit))?;
        }
        Ok(())
    }

    /// Moves process `pid` (and so everything it will fork) into the cgroup.
    pub fn add_process(&self, pid: i32) -> Result<(), CgroupError> {
        let pid = pid.to_string();
        for d in &self.dirs {
            write_file(&d.path, "cgroup.procs", &pid)?;
        }
        Ok(())
    }

    /// v1 only: the `tasks` file of each hierarchy, for a process to join by writing `0`.
    ///
    /// Why not `cgroup.procs`: moving a whole thread group takes the global
    /// `cgroup_threadgroup_rwsem` for writing, and acquiring that percpu semaphore waits for
    /// an RCU grace period — 5 to 20 ms, the single largest cost of starting a container on
    /// this machine. Writing `0` to `tasks` moves only the calling thread, which the kernel
    /// does without that lock. Our init is single-threaded, so moving its thread moves the
    /// whole process. v2 has no per-thread membership outside threaded subtrees, so there
    /// the parent writes the PID to `cgroup.procs` ([`Cgroup::add_process`]).
    pub fn self_join_files(&self) -> Option<Vec<PathBuf>> {
        match self.hierarchy.version {
            Version::V1 => Some(self.dirs.iter().map(|d| d.path.join("tasks")).collect()),
            Version::V2 => None,
        }
    }

    /// All PIDs in the cgroup (the union over the v1 hierarchies).
    pub fn procs(&self) -> Result<Vec<i32>, CgroupError> {
        let mut all = BTreeSet::new();
        for d in &self.dirs {
            let p = d.path.join("cgroup.procs");
            match fs::read_to_string(&p) {
                Ok(text) => all.extend(text.split_ascii_whitespace().filter_map(|s| s.parse::<i32>().ok())),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(CgroupError::Io { path: p, source: e }),
            }
        }
        Ok(all.into_iter().collect())
    }

    /// Whether the freezer says the cgroup is frozen.
    pub fn is_frozen(&self) -> Result<bool, CgroupError> {
        match self.hierarchy.version {
            Version::V1 => {
                let Some(dir) = self.dir_for("freezer") else {
                    return Ok(false);
                };
                Ok(read_trimmed(&dir.join("freezer.state"))? == "FROZEN")
            }
            Version::V2 => Ok(read_trimmed(&self.dirs[0].path.join("cgroup.freeze"))? == "1"),
        }
    }

    /// Freezes every process in the cgroup and waits (bounded) until the kernel says so.
    pub fn freeze(&self) -> Result<(), CgroupError> {
        let result = self.set_frozen(true);
        if result.is_err() {
            // Never leave a cgroup half-frozen after reporting failure.
            let _ = self.set_frozen(false);
        }
        result
    }

    /// Thaws the cgroup and waits (bounded) until it is thawed.
    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.set_frozen(false)
    }

    fn set_frozen(&self, frozen: bool) -> Result<(), CgroupError> {
        let deadline = Instant::now() + FREEZE_TIMEOUT;
        match self.hierarchy.version {
            Version::V1 => {
                let dir = self.dir_for("freezer").ok_or(CgroupError::NoFreezer)?;
                let want = if frozen { "FROZEN" } else { "THAWED" };
                let state = dir.join("freezer.state");
                // v1 has no notification for FREEZING -> FROZEN, so poll with a short,
                // growing pause; writing again nudges the kernel to retry stragglers.
                let mut pause = Duration::from_micros(50);
                loop {
                    write_file(dir, "freezer.state", want)?;
                    if read_trimmed(&state)? == want {
                        return Ok(());
                    }
                    if Instant::now() >= deadline {
                        return Err(CgroupError::FreezeTimeout { path: state, want });
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(10));
                }
            }
            Version::V2 => {
                let dir = &self.dirs[0].path;
                write_file(dir, "cgroup.freeze", if frozen { "1" } else { "0" })?;
                let want = if frozen { "frozen 1" } else { "frozen 0" };
                wait_events(&dir.join("cgroup.events"), want, deadline)
            }
        }
    }

    /// Kills every process in the cgroup with SIGKILL and waits (up to `timeout`) until the
    /// cgroup is empty. The caller thaws a frozen cgroup first (frozen v1 tasks cannot die).
    pub fn kill_all(&self, timeout: Duration) -> Result<(), CgroupError> {
        let deadline = Instant::now() + timeout;
        if self.hierarchy.version == Version::V2 && self.dirs[0].path.join("cgroup.kill").exists() {
            // cgroup.kill (Linux 5.14) kills the whole subtree atomically, forks included.
            write_file(&self.dirs[0].path, "cgroup.kill", "1")?;
            return wait_events(&self.dirs[0].path.join("cgroup.events"), "populated 0", deadline);
        }
        loop {
            let pids = self.procs()?;
            if pids.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(CgroupError::KillTimeout {
                    path: self.dirs[0].path.clone(),
                    secs: timeout.as_secs(),
                    pids,
                });
            }
            // A pidfd names one process for good, so the signal cannot hit a process that
            // reused the PID, and it becomes readable when the process exits: an event to
            // wait on instead of polling `cgroup.procs`.
            let fds: Vec<OwnedFd> = pids.iter().filter_map(|&p| pidfd_kill(p)).collect();
            if fds.is_empty() {
                // Listed but already exiting (no pidfd to wait on): give it a moment.
                std::thread::sleep(Duration::from_millis(1));
            }
            wait_pidfds(&fds, deadline);
        }
    }

    /// Renames the cgroup to `to`, a path beside it (the same parent), and returns it there.
    /// v1 only: the v2 interface has no rename.
    ///
    /// What it is for: keeping an emptied cgroup for the next container instead of removing
    /// it (see [`Cgroup::retire`]). Removing a memory cgroup costs the kernel work in
    /// proportion to every file system mounted on the host, since taking it offline walks
    /// every superblock's memcg-aware lists (`memcg_reparent_list_lrus`, under one global
    /// mutex); with a few hundred containers that was a fifth of the CPU of a burst of kills.
    /// A rename is a name changed under `cgroup_mutex`.
    ///
    /// Either every directory is renamed or, as far as the kernel lets us, none is.
    pub fn rename(&self, to: &str) -> Result<Cgroup, CgroupError> {
        if self.hierarchy.version != Version::V1 {
            return Err(CgroupError::Invalid("a v2 cgroup cannot be renamed".into()));
        }
        let to = normalize_path(to)?;
        let (to_parent, leaf) = to.rsplit_once('/').unwrap_or_default();
        if Some(to_parent) != self.path.rsplit_once('/').map(|(parent, _)| parent) {
            return Err(CgroupError::Invalid(format!(
                "cgroup {} may be renamed only beside itself, not to {to}",
                self.path
            )));
        }
        let target = self.named(to.clone(), |dir| dir.with_file_name(leaf));
        for (done, (from, to)) in self.dirs.iter().zip(&target.dirs).enumerate() {
            if let Err(source) = fs::rename(&from.path, &to.path) {
                for (back_from, back_to) in self.dirs.iter().zip(&target.dirs).take(done) {
                    let _ = fs::rename(&back_to.path, &back_from.path);
                }
                return Err(CgroupError::Io {
                    path: from.path.clone(),
                    source,
                });
            }
        }
        Ok(target)
    }

    /// The cgroup `name` directly below this one (`name` a single component), found where
    /// this one's directories are rather than by resolving the hierarchies again.
    pub fn child(&self, name: &str) -> Result<Cgroup, CgroupError> {
        if name.is_empty() || name.contains('/') {
            return Err(CgroupError::InvalidPath(format!("{}/{name}", self.path)));
        }
        let path = normalize_path(&format!("{}/{name}", self.path))?;
        Ok(self.named(path, |dir| dir.join(name)))
    }

    /// This cgroup's directories moved by `to_dir`, as the cgroup at `path`.
    fn named(&self, path: String, to_dir: impl Fn(&Path) -> PathBuf) -> Cgroup {
        Cgroup {
            hierarchy: self.hierarchy.clone(),
            path,
            dirs: self
                .dirs
                .iter()
                .map(|d| Dir {
                    path: to_dir(&d.path),
                    controllers: d.controllers.clone(),
                    created: false,
                })
                .collect(),
        }
    }

    /// Makes an emptied v1 cgroup what a new one is, for the next container: thawed, no
    /// limits (the memory and swap limits, the soft limit, the CPU quota and shares, the
    /// process limit), its peaks, failure counts and CPU time at zero. The caller made it
    /// empty ([`Cgroup::retire`] checks). What the kernel keeps regardless: counters it has no
    /// way to zero (`memory.stat`'s running totals, `memory.oom_control`'s kills,
    /// `pids.events`, `cpu.stat`), and page cache still charged to it (files a container read
    /// that stay cached), as it keeps them for a removed cgroup that lingers until reclaim.
    ///
    /// The limits go in the order the kernel accepts whatever they were: swap before memory
    /// (memsw may never be below the memory limit), the quota before the period. Every
    /// hierarchy has a file every kernel has, so a directory that is gone fails the reset.
    pub fn reset(&self) -> Result<(), CgroupError> {
        if self.hierarchy.version != Version::V1 {
            return Err(CgroupError::Invalid("only a v1 cgroup is reset for reuse".into()));
        }
        /// (controller, file, value, whether the kernel may lack the file: swap accounting,
        /// the kmem counters and CFS bandwidth are build and boot options).
        const WRITES: [(&str, &str, &str, bool); 14] = [
            ("freezer", "freezer.state", "THAWED", false),
            ("memory", "memory.memsw.limit_in_bytes", "-1", true),
            ("memory", "memory.limit_in_bytes", "-1", false),
            ("memory", "memory.soft_limit_in_bytes", "-1", false),
            ("memory", "memory.max_usage_in_bytes", "0", false),
            ("memory", "memory.failcnt", "0", false),
            ("memory", "memory.memsw.max_usage_in_bytes", "0", true),
            ("memory", "memory.memsw.failcnt", "0", true),
            ("memory", "memory.kmem.max_usage_in_bytes", "0", true),
            ("cpu", "cpu.cfs_quota_us", "-1", true),
            ("cpu", "cpu.cfs_period_us", "100000", true),
            ("cpu", "cpu.shares", "1024", false),
            ("cpuacct", "cpuacct.usage", "0", false),
            ("pids", "pids.max", "max", false),
        ];
        for (controller, file, value, optional) in WRITES {
            let Some(dir) = self.dir_for(controller) else { continue };
            match write_file(dir, file, value) {
                Err(CgroupError::Write { source, .. }) if optional && source.kind() == io::ErrorKind::NotFound => {}
                other => other?,
            }
        }
        Ok(())
    }

    /// Zeroes the CPU time the cgroup has counted (v1 `cpuacct.usage`). A task that has left
    /// `tasks` on its way out still runs the last of its exit, for some microseconds, and the
    /// scheduler charges them to the group it leaves: so a reset's zero may not stay zero, and
    /// whoever takes the group next zeroes it again.
    pub fn zero_cpu_time(&self) -> Result<(), CgroupError> {
        if self.hierarchy.version != Version::V1 {
            return Err(CgroupError::Invalid("only a v1 cgroup's CPU time can be zeroed".into()));
        }
        write_file(self.need("cpuacct")?, "cpuacct.usage", "0")
    }

    /// Whether no task is in the cgroup (in any hierarchy, by `tasks`, which lists every
    /// thread where `cgroup.procs` lists thread groups) and it has no cgroup below it: what
    /// `rmdir` checks before it removes one, and a rename does not. (A directory's link count
    /// is two and one per folder below it; the cgroup file system keeps it so too.)
    pub fn is_empty(&self) -> Result<bool, CgroupError> {
        use std::os::unix::fs::MetadataExt as _;
        for d in &self.dirs {
            let tasks = d.path.join(match self.hierarchy.version {
                Version::V1 => "tasks",
                Version::V2 => "cgroup.threads",
            });
            if !fs::read_to_string(&tasks).map_err(io_at(&tasks))?.trim().is_empty()
                || fs::metadata(&d.path).map_err(io_at(&d.path))?.nlink() > 2
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Memory charged to the cgroup now, in bytes (v1 `memory.usage_in_bytes`, v2
    /// `memory.current`).
    pub fn memory_usage(&self) -> Result<u64, CgroupError> {
        let (dir, file) = match self.hierarchy.version {
            Version::V1 => (self.need("memory")?, "memory.usage_in_bytes"),
            Version::V2 => (self.dirs[0].path.as_path(), "memory.current"),
        };
        let path = dir.join(file);
        read_trimmed(&path)?
            .parse()
            .map_err(|e| CgroupError::Invalid(format!("{}: {e}", path.display())))
    }

    /// Keeps an emptied cgroup for a later container: checked empty ([`Cgroup::is_empty`]),
    /// reset ([`Cgroup::reset`]) and renamed to `spare` ([`Cgroup::rename`]). An error leaves
    /// it for the caller to remove.
    pub fn retire(&self, spare: &str) -> Result<Cgroup, CgroupError> {
        if !self.is_empty()? {
            return Err(CgroupError::Invalid(format!(
                "cgroup {} is not empty: it is removed, not kept",
                self.path
            )));
        }
        self.reset()?;
        self.rename(spare)
    }

    /// Removes the cgroup directories. With `only_created`, only those this process created
    /// (used when `run` fails after reusing an existing cgroup).
    pub fn remove(&self, only_created: bool) -> Result<(), CgroupError> {
        let deadline = Instant::now() + Duration::from_secs(2);
        for d in self.dirs.iter().filter(|d| d.created || !only_created) {
            let mut pause = Duration::from_micros(100);
            loop {
                match fs::remove_dir(&d.path) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    // EBUSY: a task that was just killed may still be on its way out.
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                        std::thread::sleep(pause);
                        pause = (pause * 2).min(Duration::from_millis(20));
                    }
                    Err(e) => {
                        return Err(CgroupError::Io {
                            path: d.path.clone(),
                            source: e,
                        })
                    }
                }
            }
        }
        Ok(())
    }
}

/// `mkdir`, tolerating an existing directory; returns whether we created it.
fn mkdir(path: &Path) -> Result<bool, CgroupError> {
    match fs::create_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(CgroupError::Io {
            path: path.to_path_buf(),
            source: e,
        }),
    }
}

/// Writes `value` to an existing cgroup interface file. Never creates files: in a real
/// cgroup filesystem only the kernel creates them, and a missing file means the controller
/// is not there, which must be an error, not a stray regular file.
fn write_file(dir: &Path, name: &str, value: &str) -> Result<(), CgroupError> {
    let path = dir.join(name);
    let err = |source| CgroupError::Write {
        path: path.clone(),
        value: value.to_string(),
        source,
    };
    let mut f = fs::OpenOptions::new().write(true).open(&path).map_err(err)?;
    // One write(2): cgroup files take a whole value per write.
    f.write_all(value.as_bytes()).map_err(err)
}

fn read_trimmed(path: &Path) -> Result<String, CgroupError> {
    Ok(fs::read_to_string(path).map_err(io_at(path))?.trim().to_string())
}

/// v2: adds the controllers we use (those available here) to `dir/cgroup.subtree_control`.
fn enable_v2_controllers(dir: &Path) -> Result<(), CgroupError> {
    let available = read_trimmed(&dir.join("cgroup.controllers"))?;
    let enabled = read_trimmed(&dir.join("cgroup.subtree_control"))?;
    let enabled: BTreeSet<&str> = enabled
        .split_ascii_whitespace()
        .map(|c| c.trim_start_matches('+'))
        .collect();
    let missing: Vec<String> = V2_CONTROLLERS
        .iter()
        .filter(|c| available.split_ascii_whitespace().any(|a| a == **c) && !enabled.contains(**c))
        .map(|c| format!("+{c}"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    write_file(dir, "cgroup.subtree_control", &missing.join(" "))
}

/// Waits until the flat-keyed file `events` (v2 `cgroup.events`) contains the line `want`.
/// The kernel signals changes to this file with POLLPRI.
fn wait_events(events: &Path, want: &'static str, deadline: Instant) -> Result<(), CgroupError> {
    let mut f = fs::File::open(events).map_err(io_at(events))?;
    let mut text = String::new();
    loop {
        text.clear();
        f.seek(io::SeekFrom::Start(0)).map_err(io_at(events))?;
        f.read_to_string(&mut text).map_err(io_at(events))?;
        if text.lines().any(|l| l.trim() == want) {
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(CgroupError::FreezeTimeout {
                path: events.to_path_buf(),
                want,
            });
        }
        let mut pfd = [PollFd::new(&f, PollFlags::PRI)];
        // Cap each wait so a missed edge costs at most this long.
        let wait = (deadline - now).clamp(Duration::from_millis(1), Duration::from_millis(100));
        let _ = rustix::event::poll(&mut pfd, Some(&timespec(wait)));
    }
}

/// Opens a pidfd for `pid` and sends it SIGKILL; `None` if the process is already gone.
fn pidfd_kill(pid: i32) -> Option<OwnedFd> {
    use rustix::process::{Pid, Signal};
    let pid = Pid::from_raw(pid)?;
    match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => {
            let _ = rustix::process::pidfd_send_signal(&fd, Signal::KILL);
            Some(fd)
        }
        Err(_) => {
            // Pre-5.3 kernels lack pidfds: fall back to a plain kill.
            let _ = rustix::process::kill_process(pid, Signal::KILL);
            None
        }
    }
}

/// `wait` as poll(2)'s timeout.
fn timespec(wait: Duration) -> rustix::time::Timespec {
    rustix::time::Timespec {
        tv_sec: wait.as_secs().try_into().unwrap_or(i64::MAX),
        tv_nsec: wait.subsec_nanos().into(),
    }
}

/// Waits until every pidfd is readable (its process exited) or the deadline passes.
fn wait_pidfds(fds: &[OwnedFd], deadline: Instant) {
    let mut pending: Vec<PollFd<'_>> = fds.iter().map(|f| PollFd::new(f, PollFlags::IN)).collect();
    while !pending.is_empty() {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        let wait = (deadline - now).max(Duration::from_millis(1));
        match rustix::event::poll(&mut pending, Some(&timespec(wait))) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(_) => return,
        }
        pending.retain(|p| p.revents().is_empty());
        for p in &mut pending {
            p.clear_revents();
        }
    }
}

fn max_or(v: i64) -> String {
    if v < 0 {
        "max".to_string()
    } else {
        v.to_string()
    }
}

fn pids_value(limit: i64) -> String {
    // OCI: 0 or -1 means unlimited.
    if limit <= 0 {
        "max".to_string()
    } else {
        limit.to_string()
    }
}

/// OCI `memory.swap` is memory+swap (v1 semantics); v2's `memory.swap.max` is swap alone.
/// The conversion is runc's (`ConvertMemorySwapToCgroupV2Value`).
pub fn v2_swap_max(swap: i64, limit: Option<i64>) -> Result<Option<String>, String> {
    match (swap, limit) {
        (-1, _) => Ok(Some("max".to_string())),
        (0, _) => Ok(None),
        (_, None) | (_, Some(0)) => Err("memory.swap is set without memory.limit".to_string()),
        (_, Some(-1)) => Err("memory.swap is limited while memory.limit is unlimited".to_string()),
        (s, Some(l)) if s < l => Err(format!("memory.swap ({s}) is lower than memory.limit ({l})")),
        (s, Some(l)) => Ok(Some((s - l).to_string())),
    }
}

/// v1 `cpu.shares` (2..262144) to v2 `cpu.weight` (1..10000), as runc converts it.
pub fn shares_to_weight(shares: u64) -> u64 {
    let shares = shares.clamp(2, 262_144);
    1 + ((shares - 2) * 9999) / 262_142
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn touch(path: &Path, contents: &str) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, contents).unwrap();
    }

    fn read(path: &Path) -> String {
        fs::read_to_string(path).unwrap()
    }

    /// The interface files the kernel shows in a new v1 cgroup of each controller.
    fn fake_v1_leaf(root: &Path, rel: &str) {
        for f in [
            "memory.limit_in_bytes",
            "memory.memsw.limit_in_bytes",
            "memory.soft_limit_in_bytes",
            "cgroup.procs",
        ] {
            touch(&root.join("memory").join(rel).join(f), "");
        }
        for f in ["cpu.shares", "cpu.cfs_period_us", "cpu.cfs_quota_us", "cgroup.procs"] {
            touch(&root.join("cpu,cpuacct").join(rel).join(f), "");
        }
        touch(&root.join("pids").join(rel).join("pids.max"), "");
        touch(&root.join("pids").join(rel).join("cgroup.procs"), "");
        touch(&root.join("freezer").join(rel).join("cgroup.procs"), "");
        touch(&root.join("freezer").join(rel).join("freezer.state"), "THAWED\n");
    }

    fn fake_v1_root(root: &Path) {
        for d in ["memory", "cpu,cpuacct", "pids", "freezer"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        // The comounted layout: cpu and cpuacct are symlinks to one hierarchy.
        symlink("cpu,cpuacct", root.join("cpu")).unwrap();
        symlink("cpu,cpuacct", root.join("cpuacct")).unwrap();
    }

    #[test]
    fn paths_are_normalised_and_checked() {
        assert_eq!(normalize_path("/a//b/").unwrap(), "/a/b");
        for bad in ["a/b", "/a/../b", "/./a", "/", ""] {
            assert!(normalize_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn v1_creates_dirs_in_each_distinct_hierarchy() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fake_v1_root(root);
        let h = Hierarchy::detect_at(root).unwrap();
        assert_eq!(h.version, Version::V1);
        let mut cg = Cgroup::new(&h, "/sandboxsched/c1").unwrap();
        // memory, cpu+cpuacct (one hierarchy), pids, freezer.
        assert_eq!(cg.dirs().count(), 4);
        cg.create_dirs().unwrap();
        for d in ["memory", "cpu,cpuacct", "pids", "freezer"] {
            assert!(root.join(d).join("sandboxsched/c1").is_dir(), "{d}");
        }
        cg.remove(true).unwrap();
        assert!(!root.join("memory/sandboxsched/c1").exists());
        assert!(root.join("memory/sandboxsched").exists(), "parents are shared and stay");
    }

    #[test]
    fn an_emptied_v1_group_is_reset_and_renamed_beside_itself_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fake_v1_root(root);
        fake_v1_leaf(root, "sandboxsched/c1");
        for (hierarchy, file) in [
            ("cpu,cpuacct", "cpuacct.usage"),
            ("memory", "memory.max_usage_in_bytes"),
            ("memory", "memory.failcnt"),
            ("freezer", "freezer.state"),
        ] {
            touch(&root.join(hierarchy).join("sandboxsched/c1").join(file), "");
        }
        for hierarchy in ["memory", "cpu,cpuacct", "pids", "freezer"] {
            touch(&root.join(hierarchy).join("sandboxsched/c1/tasks"), "");
        }
        let h = Hierarchy {
            version: Version::V1,
            mount: root.to_path_buf(),
        };
        // What a container's run wrote is beside the point: the fake's files keep what a
        // shorter write leaves of a longer value (the kernel takes each write whole), so they
        // start empty here, to read what the reset writes.
        let cg = Cgroup::new(&h, "/sandboxsched/c1").unwrap();
        let parent = Cgroup::new(&h, "/sandboxsched").unwrap();
        let child = parent.child("c1").unwrap();
        assert_eq!(
            (child.path(), child.dirs().collect::<Vec<_>>()),
            (cg.path(), cg.dirs().collect())
        );
        for bad in ["", "a/b", ".."] {
            assert!(parent.child(bad).is_err(), "{bad:?}");
        }
        // A task in it, or a group below it: not kept (a rename, unlike rmdir, would take them).
        touch(&root.join("pids/sandboxsched/c1/tasks"), "4242\n");
        assert!(cg.retire("/sandboxsched/.spare-9").is_err());
        touch(&root.join("pids/sandboxsched/c1/tasks"), "");
        fs::create_dir(root.join("freezer/sandboxsched/c1/below")).unwrap();
        assert!(cg.retire("/sandboxsched/.spare-9").is_err());
        fs::remove_dir(root.join("freezer/sandboxsched/c1/below")).unwrap();
        assert!(root.join("memory/sandboxsched/c1").is_dir(), "left where it was");
        assert!(cg.is_empty().unwrap());

        cg.reset().unwrap();
        let leaf = |d: &str, f: &str| read(&root.join(d).join("sandboxsched/c1").join(f));
        assert_eq!(leaf("memory", "memory.memsw.limit_in_bytes"), "-1");
        assert_eq!(leaf("memory", "memory.limit_in_bytes"), "-1");
        assert_eq!(leaf("memory", "memory.max_usage_in_bytes"), "0");
        assert_eq!(leaf("cpu,cpuacct", "cpu.cfs_quota_us"), "-1");
        assert_eq!(leaf("cpu,cpuacct", "cpuacct.usage"), "0");
        assert_eq!(leaf("pids", "pids.max"), "max");
        assert_eq!(leaf("memory", "memory.failcnt"), "0");
        assert_eq!(leaf("freezer", "freezer.state"), "THAWED");
        // Files a kernel may lack (swap accounting) are skipped, never created; others not.
        assert!(!root.join("memory/sandboxsched/c1/memory.memsw.failcnt").exists());
        fs::remove_file(root.join("memory/sandboxsched/c1/memory.failcnt")).unwrap();
        assert!(cg.reset().is_err(), "a file every kernel has, missing");
        touch(&root.join("memory/sandboxsched/c1/memory.failcnt"), "");

        assert!(cg.rename("/elsewhere/c1").is_err(), "only beside itself");
        let spare = cg.rename("/sandboxsched/.spare-0").unwrap();
        for d in ["memory", "cpu,cpuacct", "pids", "freezer"] {
            assert!(!root.join(d).join("sandboxsched/c1").exists(), "{d}");
            assert!(root.join(d).join("sandboxsched/.spare-0/cgroup.procs").exists(), "{d}");
        }
        assert_eq!(spare.dirs().count(), 4);

        // A rename that fails part way puts back what it moved.
        fs::create_dir_all(root.join("pids/sandboxsched/c2/taken")).unwrap();
        assert!(spare.rename("/sandboxsched/c2").is_err());
        for d in ["memory", "cpu,cpuacct", "pids", "freezer"] {
            assert!(root.join(d).join("sandboxsched/.spare-0").is_dir(), "{d} back");
        }

        let v2 = Hierarchy {
            version: Version::V2,
            mount: root.to_path_buf(),
        };
        let cg2 = Cgroup::new(&v2, "/sandboxsched/c3").unwrap();
        assert!(
            cg2.rename("/sandboxsched/c4").is_err() && cg2.reset().is_err(),
            "v2 keeps no spares"
        );
    }

    #[test]
    fn v1_writes_limits_and_procs() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fake_v1_root(root);
        fake_v1_leaf(root, "sandboxsched/c1");
        let h = Hierarchy {
            version: Version::V1,
            mount: root.to_path_buf(),
        };
        let mut cg = Cgroup::new(&h, "/sandboxsched/c1").unwrap();
        let res = Resources {
            memory_limit: Some(64 << 20),
            memory_swap: Some(128 << 20),
            memory_reservation: None,
            cpu_shares: Some(512),
            cpu_quota: Some(50_000),
            cpu_period: Some(100_000),
            pids_limit: Some(100),
        };
        cg.create(&res).unwrap();
        let leaf = |d: &str, f: &str| read(&root.join(d).join("sandboxsched/c1").join(f));
        assert_eq!(leaf("memory", "memory.limit_in_bytes"), (64 << 20).to_string());
        assert_eq!(leaf("memory", "memory.memsw.limit_in_bytes"), (128 << 20).to_string());
        assert_eq!(leaf("memory", "memory.soft_limit_in_bytes"), "");
        assert_eq!(leaf("cpu,cpuacct", "cpu.shares"), "512");
        assert_eq!(leaf("cpu,cpuacct", "cpu.cfs_period_us"), "100000");
        assert_eq!(leaf("cpu,cpuacct", "cpu.cfs_quota_us"), "50000");
        assert_eq!(leaf("pids", "pids.max"), "100");

        cg.add_process(4242).unwrap();
        for d in ["memory", "cpu,cpuacct", "pids", "freezer"] {
            assert_eq!(leaf(d, "cgroup.procs"), "4242", "{d}");
        }
        assert_eq!(cg.procs().unwrap(), vec![4242]);

        // The fake freezer reports FROZEN as soon as it is written, like an idle cgroup.
        cg.freeze().unwrap();
        assert!(cg.is_frozen().unwrap());
        cg.thaw().unwrap();
        assert!(!cg.is_frozen().unwrap());

        let tasks = cg.self_join_files().unwrap();
        assert_eq!(tasks.len(), 4);
        assert!(tasks.iter().all(|t| t.ends_with("sandboxsched/c1/tasks")));

        let rec = cg.record();
        assert_eq!(rec.path, "/sandboxsched/c1");
        assert_eq!(Cgroup::from_record(&rec).unwrap().procs().unwrap(), vec![4242]);
    }

    #[test]
    fn v1_skips_memsw_without_swap_accounting_and_handles_unlimited() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fake_v1_root(root);
        fake_v1_leaf(root, "x");
        fs::remove_file(root.join("memory/x/memory.memsw.limit_in_bytes")).unwrap();
        let h = Hierarchy {
            version: Version::V1,
            mount: root.to_path_buf(),
        };
        let mut cg = Cgroup::new(&h, "/x").unwrap();
        let res = Resources {
            memory_limit: Some(-1),
            memory_swap: Some(-1),
            cpu_quota: Some(-1),
            pids_limit: Some(0),
            ..Default::default()
        };
        cg.create(&res).unwrap();
        assert_eq!(read(&root.join("memory/x/memory.limit_in_bytes")), "-1");
        assert!(
            !root.join("memory/x/memory.memsw.limit_in_bytes").exists(),
            "no stray file created"
        );
        assert_eq!(read(&root.join("cpu,cpuacct/x/cpu.cfs_quota_us")), "-1");
        assert_eq!(read(&root.join("pids/x/pids.max")), "max");
    }

    /// A fake cgroup2 tree: each directory has the files the kernel shows.
    fn fake_v2_dir(dir: &Path, controllers: &str) {
        touch(&dir.join("cgroup.controllers"), controllers);
        touch(&dir.join("cgroup.subtree_control"), "");
        for f in [
            "cgroup.procs",
            "cgroup.freeze",
            "memory.max",
            "memory.swap.max",
            "memory.low",
            "cpu.max",
            "cpu.weight",
            "pids.max",
        ] {
            touch(&dir.join(f), "");
        }
        touch(&dir.join("cgroup.events"), "populated 0\nfrozen 0\n");
    }

    #[test]
    fn v2_enables_controllers_and_writes_limits() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fake_v2_dir(root, "cpuset cpu io memory hugetlb pids rdma misc");
        fake_v2_dir(&root.join("sandboxsched"), "cpu memory pids");
        fake_v2_dir(&root.join("sandboxsched/c1"), "cpu memory pids");
        let h = Hierarchy {
            version: Version::V2,
            mount: root.to_path_buf(),
        };
        let mut cg = Cgroup::new(&h, "/sandboxsched/c1").unwrap();
        let res = Resources {
            memory_limit: Some(64 << 20),
            memory_swap: Some(96 << 20),
            memory_reservation: Some(32 << 20),
            cpu_shares: Some(1024),
            cpu_quota: Some(50_000),
            cpu_period: None,
            pids_limit: Some(64),
        };
        cg.create(&res).unwrap();
        assert_eq!(read(&root.join("cgroup.subtree_control")), "+memory +cpu +pids");
        assert_eq!(
            read(&root.join("sandboxsched/cgroup.subtree_control")),
            "+memory +cpu +pids"
        );
        assert_eq!(
            read(&root.join("sandboxsched/c1/cgroup.subtree_control")),
            "",
            "leaf delegates nothing"
        );
        let leaf = |f: &str| read(&root.join("sandboxsched/c1").join(f));
        assert_eq!(leaf("memory.max"), (64 << 20).to_string());
        assert_eq!(leaf("memory.swap.max"), (32 << 20).to_string());
        assert_eq!(leaf("memory.low"), (32 << 20).to_string());
        assert_eq!(leaf("cpu.weight"), "39");
        assert_eq!(leaf("cpu.max"), "50000 100000");
        assert_eq!(leaf("pids.max"), "64");
        cg.add_process(77).unwrap();
        assert_eq!(leaf("cgroup.procs"), "77");
        assert!(cg.self_join_files().is_none(), "v2 joins through cgroup.procs");
    }

    #[test]
    fn v2_partial_enable_and_unlimited_values() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fake_v2_dir(root, "cpu memory pids");
        fs::write(root.join("cgroup.subtree_control"), "memory").unwrap();
        let h = Hierarchy {
            version: Version::V2,
            mount: root.to_path_buf(),
        };
        let mut cg = Cgroup::new(&h, "/c2").unwrap();
        cg.create_dirs().unwrap();
        assert!(root.join("c2").is_dir());
        // "memory" was already enabled; only the missing ones are added. (A real kernel would
        // then read back "memory cpu pids"; the fake file just shows what we wrote.)
        assert_eq!(read(&root.join("cgroup.subtree_control")), "+cpu +pids");
        fake_v2_dir(&root.join("c2"), "cpu memory pids");
        let res = Resources {
            memory_limit: Some(-1),
            memory_swap: Some(-1),
            cpu_period: Some(20_000),
            ..Default::default()
        };
        cg.apply(&res).unwrap();
        assert_eq!(read(&root.join("c2/memory.max")), "max");
        assert_eq!(read(&root.join("c2/memory.swap.max")), "max");
        assert_eq!(read(&root.join("c2/cpu.max")), "max 20000");
    }

    #[test]
    fn v2_freeze_waits_for_events() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fake_v2_dir(&root.join("c"), "");
        let cg = Cgroup::new(
            &Hierarchy {
                version: Version::V2,
                mount: root.to_path_buf(),
            },
            "/c",
        )
        .unwrap();
        // Pretend the kernel already finished freezing.
        fs::write(root.join("c/cgroup.events"), "populated 1\nfrozen 1\n").unwrap();
        cg.freeze().unwrap();
        assert_eq!(read(&root.join("c/cgroup.freeze")), "1");
        assert!(cg.is_frozen().unwrap());
    }

    #[test]
    fn v2_conversions() {
        assert_eq!(v2_swap_max(-1, Some(100)).unwrap().as_deref(), Some("max"));
        assert_eq!(v2_swap_max(0, Some(100)).unwrap(), None);
        assert_eq!(v2_swap_max(150, Some(100)).unwrap().as_deref(), Some("50"));
        assert!(v2_swap_max(50, Some(100)).is_err());
        assert!(v2_swap_max(50, None).is_err());
        assert_eq!(shares_to_weight(2), 1);
        assert_eq!(shares_to_weight(262_144), 10_000);
    }

    #[test]
    fn missing_controller_file_is_an_error_not_a_new_file() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fake_v1_root(root);
        let h = Hierarchy {
            version: Version::V1,
            mount: root.to_path_buf(),
        };
        let mut cg = Cgroup::new(&h, "/y").unwrap();
        cg.create_dirs().unwrap();
        let err = cg
            .apply(&Resources {
                pids_limit: Some(5),
                ..Default::default()
            })
            .unwrap_err();
        assert!(err.to_string().contains("pids.max"), "{err}");
        assert!(!root.join("pids/y/pids.max").exists());
    }
}
