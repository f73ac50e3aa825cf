//! The parent side of starting the container's init.
//!
//! [`spawn`] clones the init into its namespaces and then, while the init waits on the sync
//! pipe, does the things that need host privileges or must precede anything the init does:
//!
//! 1. write the uid/gid maps (only a process outside the new user namespace may);
//! 2. move the init into the container's cgroup, before it can fork (on cgroup v1 the init
//!    joins by itself, first thing, which avoids a slow global lock; see `cgroup`);
//! 3. set the rlimits that raise a hard limit with `prlimit`: that needs CAP_SYS_RESOURCE
//!    in the *initial* user namespace, which the init no longer has, so runc's approach of
//!    doing it from inside fails in a user namespace while it works from here. The rest only
//!    lower what the init inherits, which any process may do to itself, so the init does
//!    (see [`crate::rlimits`]);
//! 4. set `oom_score_adj` (lowering it has the same requirement);
//! 5. record the init's start time (for PID-reuse detection).
//!
//! Then it releases the init and waits for the report pipe to close: empty means the init
//! reached `execve`, anything else is the init's error message. On any failure the init is
//! killed and reaped before returning, so nothing is left running.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};

use crate::cgroup::{Cgroup, CgroupError};
use crate::init::{self, InitError, InitFds, InitPlan};
use crate::namespaces::{self, NamespaceError};
use crate::rlimits::{Limit, Rlimits};
use crate::rootfs::RootfsPlan;
use crate::seccomp::Program;
use crate::spec::Config;
use crate::sys::{self, Errno};

/// Errors from starting the init.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("create pipe: {0}")]
    Pipe(Errno),
    #[error(transparent)]
    Plan(#[from] InitError),
    #[error(transparent)]
    Namespace(#[from] NamespaceError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error("set rlimit {name}: {errno}")]
    Rlimit { name: String, errno: Errno },
    #[error("set oom_score_adj: {0}")]
    OomScore(std::io::Error),
    #[error("container init exited before it could be inspected")]
    Vanished,
    #[error("release container init: {0}")]
    Sync(Errno),
    #[error("read container init's report: {0}")]
    Report(std::io::Error),
    /// The init's own message, e.g. `exec: "/nope": no such file or directory`.
    #[error("{0}")]
    Init(String),
}

/// The started init.
#[derive(Debug, Clone, Copy)]
pub struct Spawned {
    pub pid: libc::pid_t,
    pub start_time: u64,
}

/// Kills and reaps the init unless disarmed (used on every failure path).
struct ChildGuard {
    pid: libc::pid_t,
    armed: bool,
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.armed {
            // Our own child, not reaped yet: the PID names nothing else.
            if let Some(pid) = rustix::process::Pid::from_raw(self.pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
            sys::reap(self.pid);
        }
    }
}

/// Everything the parent does between the clone and releasing the init; returns the
/// init's start time.
fn prepare(
    config: &Config,
    raise: &[Limit],
    pid: libc::pid_t,
    cgroup: &Cgroup,
    add_to_cgroup: bool,
    sync_w: &OwnedFd,
) -> Result<u64, ProcessError> {
    // A joined user namespace has its maps already (they are written once, by its maker):
    // they must be the spec's, which the rest of the set-up trusts (a wrong or reused path
    // would otherwise run the container as whoever that namespace maps).
    if config.namespaces.join_user.is_some() {
        namespaces::check_id_maps(pid, &config.uid_mappings, &config.gid_mappings)?;
    } else if config.namespaces.user {
        namespaces::write_id_maps(pid, &config.uid_mappings, &config.gid_mappings)?;
    }
    if add_to_cgroup {
        cgroup.add_process(pid)?;
    }
    for r in raise {
        let child = rustix::process::Pid::from_raw(pid).ok_or_else(|| ProcessError::Rlimit {
            name: r.name.clone(),
            errno: Errno(libc::ESRCH),
        })?;
        if let Err(errno) = rustix::process::prlimit(Some(child), r.resource, r.limit) {
            return Err(ProcessError::Rlimit {
                name: r.name.clone(),
                errno: errno.into(),
            });
        }
    }
    if let Some(adj) = config.process.oom_score_adj() {
        std::fs::write(format!("/proc/{pid}/oom_score_adj"), adj.to_string()).map_err(ProcessError::OomScore)?;
    }
    let start_time = crate::state::proc_stat(pid).ok_or(ProcessError::Vanished)?.start_time;
    sys::write_all(sync_w.as_raw_fd(), &[1]).map_err(ProcessError::Sync)?;
    Ok(start_time)
}

/// Reads the init's report until end of file (its exec, or its exit).
fn read_report(r: OwnedFd) -> std::io::Result<String> {
    let mut report = Vec::new();
    std::fs::File::from(r).read_to_end(&mut report)?;
    Ok(String::from_utf8_lossy(&report).replace('\n', " "))
}

/// Clones the init, prepares it from the outside, releases it and waits for its exec.
pub fn spawn(
    config: &Config,
    rootfs: RootfsPlan,
    seccomp: Option<Program>,
    preserve_fds: u32,
    cgroup: &Cgroup,
) -> Result<Spawned, ProcessError> {
    // Our descriptors must sit above the range the caller asked us to pass through.
    let min_fd = 3 + preserve_fds as i32;
    let (sync_r, sync_w) = sys::pipe_above(min_fd).map_err(ProcessError::Pipe)?;
    let (report_r, report_w) = sys::pipe_above(min_fd).map_err(ProcessError::Pipe)?;
    // v1: the init joins its cgroup itself (fast path, see `Cgroup::self_join_files`);
    // v2: we move it below.
    let self_join = cgroup.self_join_files();
    let Rlimits { raise, lower } = Rlimits::of(config);
    let mut plan = InitPlan::new(
        config,
        rootfs,
        seccomp,
        self_join.as_deref().unwrap_or(&[]),
        preserve_fds,
        InitFds {
            sync: sync_r.as_raw_fd(),
            report: report_w.as_raw_fd(),
            parent: [sync_w.as_raw_fd(), report_r.as_raw_fd()],
        },
    )?;
    plan.set_rlimits(lower);

    let joins = namespaces::Joins::open(&config.namespaces, min_fd)?;
    let pid = if joins.is_empty() {
        let owner = namespaces::owner_of(&config.uid_mappings);
        namespaces::clone_owned(config.namespaces.clone_flags(), owner)?
    } else {
        namespaces::clone_joined(&joins, config.namespaces.clone_flags(), min_fd)?
    };
    if pid == 0 {
        init::run(&mut plan);
    }
    drop(plan);
    drop(sync_r);
    drop(report_w);
    let mut child = ChildGuard { pid, armed: true };

    let prepared = prepare(config, &raise, pid, cgroup, self_join.is_none(), &sync_w);
    drop(sync_w);
    let start_time = match prepared {
        Ok(t) => t,
        Err(e) => {
            // The init may have failed first (it joins its cgroup on its own) and the error
            // here is only a consequence, such as EPIPE on the sync pipe. Once it is dead its
            // report is complete; prefer that message, it names the cause.
            drop(child);
            let msg = read_report(report_r).unwrap_or_default();
            return Err(if msg.is_empty() { e } else { ProcessError::Init(msg) });
        }
    };
    let msg = read_report(report_r).map_err(ProcessError::Report)?;
    if !msg.is_empty() {
        return Err(ProcessError::Init(msg));
    }
    child.armed = false;
    Ok(Spawned { pid, start_time })
}
