//! The real runtime: each sandbox's start command runs as `sh -c` in its own process group,
//! in the sandbox's memory and freezer cgroups when the host has them.
//!
//! - pause: the freezer stops every process of the cgroup, forks included; without a freezer,
//!   SIGSTOP to the process group (degraded: a process that left the group escapes it);
//! - kill: SIGKILL to the process group and every process in the cgroup, thaw (a frozen
//!   process cannot die), then wait until none is left and reap our own children;
//! - memory: the cgroup's usage, or the summed RSS of the process group without one.
//!
//! PID and mount namespaces are not used yet; `Features::degraded` says so.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::cgroup::Cgroups;
use super::{Features, Runtime, RuntimeError};
use crate::sandbox::SandboxRecord;

pub struct ProcessRuntime {
    cgroups: Cgroups,
    /// Commands get a private mount namespace with the sandbox's home at /home/user.
    mount_namespace: bool,
    degraded: Vec<String>,
    /// Start commands this process spawned, to reap when they end.
    children: Mutex<HashMap<String, Child>>,
}

fn control(record: &SandboxRecord, action: &'static str, reason: impl ToString) -> RuntimeError {
    RuntimeError::Control {
        sandbox: record.id.clone(),
        action,
        reason: reason.to_string(),
    }
}

/// Sends `signal` to a process group; `true` if any process received it.
fn signal_group(pgid: u32, signal: i32) -> bool {
    let Ok(pgid) = i32::try_from(pgid) else { return false };
    if pgid <= 1 {
        return false;
    }
    // SAFETY: killpg has no memory-safety preconditions; a stale group gives ESRCH.
    unsafe { libc::killpg(pgid, signal) == 0 }
}

fn signal_pid(pid: i32, signal: i32) -> bool {
    // SAFETY: as above.
    pid > 1 && unsafe { libc::kill(pid, signal) == 0 }
}

/// Processes whose process group is `pgid`, from /proc.
fn group_members(pgid: u32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // Fields after the command name (which may hold spaces) start after ')'.
                    let rest = stat.rsplit_once(')')?.1;
                    rest.split_whitespace().nth(2)?.parse::<u32>().ok()
                })
                == Some(pgid)
        })
        .collect()
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

fn rss_bytes(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kb| kb * 1024)
}

impl ProcessRuntime {
    /// A runtime for node `node_id`, using cgroups where the host allows.
    pub fn new(node_id: &str, use_cgroups: bool) -> Self {
        let (cgroups, mut degraded) = if use_cgroups {
            Cgroups::probe(node_id)
        } else {
            (Cgroups::none(), vec!["cgroups disabled by configuration".to_string()])
        };
        if !cgroups.has_freezer() {
            degraded.push("no freezer: pause sends SIGSTOP to the process group".to_string());
        }
        if !cgroups.has_memory() {
            degraded.push("no memory cgroup: memory is the process group's RSS, without limits".to_string());
        }
        let mount_namespace = use_cgroups && probe_mount_namespace();
        if !mount_namespace {
            degraded.push(format!(
                "no mount namespace: commands see the sandbox's files at their host path, not {SANDBOX_HOME}"
            ));
        }
        degraded.push(
            "no PID namespace: a sandbox's processes see the host's (std's spawn puts only children in a new one)"
                .to_string(),
        );
        for line in &degraded {
            tracing::warn!(node_id, "runtime degraded: {line}");
        }
        Self {
            cgroups,
            mount_namespace,
            degraded,
            children: Mutex::new(HashMap::new()),
        }
    }

    /// Every live process of the sandbox: its cgroup members and its process group.
    fn processes(&self, record: &SandboxRecord) -> Vec<i32> {
        let mut pids = self.cgroups.pids(&record.id);
        if record.pgid > 0 {
            for pid in group_members(record.pgid) {
                if !pids.contains(&pid) {
                    pids.push(pid);
                }
            }
        }
        pids.retain(|&pid| !is_zombie(pid));
        pids
    }

    fn reap_one(&self, sandbox: &str) {
        if let Ok(mut children) = self.children.lock() {
            if let Some(mut child) = children.remove(sandbox) {
                let _ = child.wait();
            }
        }
    }
}

impl Runtime for ProcessRuntime {
    fn kind(&self) -> &'static str {
        "process"
    }

    fn features(&self) -> Features {
        Features {
            cgroup_memory: self.cgroups.has_memory(),
            freezer: self.cgroups.has_freezer(),
            namespaces: self.mount_namespace,
            degraded: self.degraded.clone(),
        }
    }

    fn start(&self, record: &SandboxRecord, home: &Path) -> Result<u32, RuntimeError> {
        let fail = |reason: String| RuntimeError::Start {
            sandbox: record.id.clone(),
            reason,
        };
        self.cgroups
            .create(&record.id, record.resources.memory_bytes)
            .map_err(|e| fail(format!("cgroup: {e}")))?;
        let Some(command) = record.start_command.as_deref().filter(|c| !c.trim().is_empty()) else {
            return Ok(0);
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(home.join(".start.log"))
            .map_err(|e| fail(format!("log file: {e}")))?;
        let log_err = log.try_clone().map_err(|e| fail(e.to_string()))?;
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(command)
            .env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .env("E2B_SANDBOX", "true")
            .env("E2B_SANDBOX_ID", &record.id)
            .envs(&record.env)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err));
        self.enclose(record, home, home, &mut cmd)?;
        let child = cmd.spawn().map_err(|e| fail(format!("spawn: {e}")))?;
        let pgid = child.id();
        if let Ok(mut children) = self.children.lock() {
            children.insert(record.id.clone(), child);
        }
        Ok(pgid)
    }

    fn pause(&self, record: &SandboxRecord) -> Result<(), RuntimeError> {
        match self.cgroups.freeze(&record.id, true) {
            Ok(true) => Ok(()),
            Ok(false) => {
                signal_group(record.pgid, libc::SIGSTOP);
                Ok(())
            }
            Err(e) => Err(control(record, "pause", e)),
        }
    }

    fn resume(&self, record: &SandboxRecord) -> Result<(), RuntimeError> {
        match self.cgroups.freeze(&record.id, false) {
            Ok(true) => Ok(()),
            Ok(false) => {
                signal_group(record.pgid, libc::SIGCONT);
                Ok(())
            }
            Err(e) => Err(control(record, "resume", e)),
        }
    }

    fn kill(&self, record: &SandboxRecord) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            signal_group(record.pgid, libc::SIGKILL);
            for pid in self.cgroups.pids(&record.id) {
                signal_pid(pid, libc::SIGKILL);
            }
            // A frozen process keeps its SIGKILL pending until thawed.
            let _ = self.cgroups.freeze(&record.id, false);
            signal_group(record.pgid, libc::SIGCONT);
            self.reap_one(&record.id);
            if self.processes(record).is_empty() {
                break;
            }
            if Instant::now() > deadline {
                return Err(control(record, "kill", "processes survived SIGKILL for 10 s"));
            }
            // Processes that were not our children are reaped by init; give it a moment.
            std::thread::sleep(Duration::from_millis(1));
        }
        self.cgroups.remove(&record.id);
        Ok(())
    }

    fn memory_used(&self, record: &SandboxRecord) -> u64 {
        if let Some(bytes) = self.cgroups.memory_usage(&record.id) {
            return bytes;
        }
        if record.pgid == 0 {
            return 0;
        }
        group_members(record.pgid).into_iter().map(rss_bytes).sum()
    }

    fn alive(&self, record: &SandboxRecord) -> bool {
        !self.processes(record).is_empty()
    }

    fn adopt(&self, record: &SandboxRecord) -> Result<(), RuntimeError> {
        self.cgroups
            .create(&record.id, record.resources.memory_bytes)
            .map_err(|e| control(record, "adopt", e))
    }

    fn reap(&self) {
        if let Ok(mut children) = self.children.lock() {
            children.retain(|_, child| matches!(child.try_wait(), Ok(None)));
        }
    }

    fn enclose(&self, record: &SandboxRecord, home: &Path, cwd: &Path, cmd: &mut Command) -> Result<(), RuntimeError> {
        self.cgroups
            .create(&record.id, record.resources.memory_bytes)
            .map_err(|e| control(record, "enclose", e))?;
        let join = self.cgroups.join_paths(&record.id);
        cmd.process_group(0);
        let view = if self.mount_namespace {
            let inside = match cwd.strip_prefix(home) {
                Ok(rel) if !rel.as_os_str().is_empty() => Path::new(SANDBOX_HOME).join(rel),
                _ => Path::new(SANDBOX_HOME).to_path_buf(),
            };
            cmd.env("HOME", SANDBOX_HOME).env("PWD", &inside);
            let c =
                |p: &Path| CString::new(p.as_os_str().as_encoded_bytes()).map_err(|e| control(record, "enclose", e));
            Some((c(home)?, c(Path::new(SANDBOX_HOME))?, c(&inside)?))
        } else {
            cmd.env("HOME", home).current_dir(cwd);
            None
        };
        // SAFETY: between fork and exec the closure only makes system calls (open, write,
        // close, unshare, mount, chdir) on C strings prepared before the fork, all
        // async-signal-safe; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                for path in &join {
                    let fd = libc::open(path.as_ptr(), libc::O_WRONLY);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                    libc::close(fd);
                    if written != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some((home, target, inside)) = &view {
                    enter_mount_namespace(home, target)?;
                    if libc::chdir(inside.as_ptr()) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(())
    }
}

/// Where the SDK expects a sandbox's home.
const SANDBOX_HOME: &str = "/home/user";

/// In the calling (just forked) process: a private mount namespace with `home` bound at
/// `target`.
///
/// # Safety
/// Only async-signal-safe system calls; meant for `pre_exec`.
unsafe fn enter_mount_namespace(home: &CString, target: &CString) -> std::io::Result<()> {
    if libc::unshare(libc::CLONE_NEWNS) != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Nothing mounted from here on may leak back to the host.
    if libc::mount(
        std::ptr::null(),
        c"/".as_ptr(),
        std::ptr::null(),
        libc::MS_REC | libc::MS_PRIVATE,
        std::ptr::null(),
    ) != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    if libc::mount(
        home.as_ptr(),
        target.as_ptr(),
        std::ptr::null(),
        libc::MS_BIND | libc::MS_REC,
        std::ptr::null(),
    ) != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether commands can get a mount namespace here: makes the /home/user mount point and
/// runs `true` through the same steps once.
fn probe_mount_namespace() -> bool {
    if std::fs::create_dir_all(SANDBOX_HOME).is_err() {
        return false;
    }
    let Ok(target) = CString::new(SANDBOX_HOME) else {
        return false;
    };
    let home = target.clone();
    let mut probe = Command::new("/bin/true");
    // SAFETY: as in `enclose`.
    unsafe {
        probe.pre_exec(move || enter_mount_namespace(&home, &target));
    }
    probe.status().is_ok_and(|s| s.success())
}
