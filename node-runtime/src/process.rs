//! The unisolated runtime (for developing the control plane, never for untrusted code): each
//! sandbox's start command runs as `sh -c` in its own process group on the host, as its root,
//! in the sandbox's memory and freezer cgroups when the host has them.
//!
//! - pause: the freezer stops every process of the cgroup, forks included; without a freezer,
//!   SIGSTOP to the process group (degraded: a process that left the group escapes it);
//! - kill: SIGKILL to the process group and every process in the cgroup, thaw (a frozen
//!   process cannot die), then wait until none is left and reap our own children;
//! - memory: the cgroup's usage, or the summed RSS of the process group without one.
//!
//! Namespaces, where the host permits them:
//! - mount: every command gets a private mount namespace with the sandbox's folder bound at
//!   /home/user;
//! - PID: each sandbox has one PID namespace, shared by all its commands as in a VM. Its PID 1
//!   is a reaper: a shell whose only job is waiting, so a command's background processes
//!   survive the command and are reaped when they end (a shell's wait reaps any child, and
//!   orphans become PID 1's children). Each command joins the namespace with `setns` and one more `fork` in
//!   `pre_exec`, because a PID namespace only applies to children: the process std spawned
//!   stays outside, waits for the command, and exits with its status; the command dies with
//!   it (PR_SET_PDEATHSIG), and sees only its sandbox's processes in a /proc mounted in its
//!   own mount namespace.
//!
//! Where a feature is missing, `Features::degraded` and the log say so once.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::process::Signal;

use super::cgroup::Cgroups;
use super::{Features, Runtime, RuntimeError};
use crate::Sandbox;

pub struct ProcessRuntime {
    cgroups: Cgroups,
    /// Commands get a private mount namespace with the sandbox's home at /home/user.
    mount_namespace: bool,
    /// Each sandbox's commands share a PID namespace (needs the mount namespace, for /proc,
    /// and cgroups, to find the namespace's reaper again after a restart).
    pid_namespace: bool,
    degraded: Vec<String>,
    /// Start commands this process spawned, to reap when they end.
    children: Mutex<HashMap<String, Child>>,
}

fn control(sandbox: &Sandbox<'_>, action: &'static str, reason: impl ToString) -> RuntimeError {
    RuntimeError::Control {
        sandbox: sandbox.id.to_string(),
        action,
        reason: reason.to_string(),
    }
}

/// Sends `signal` to a process group; `true` if any process received it (a stale group
/// gives ESRCH).
fn signal_group(pgid: u32, signal: Signal) -> bool {
    let Ok(pgid) = i32::try_from(pgid) else { return false };
    match rustix::process::Pid::from_raw(pgid) {
        Some(group) if pgid > 1 => rustix::process::kill_process_group(group, signal).is_ok(),
        _ => false,
    }
}

fn signal_pid(pid: i32, signal: Signal) -> bool {
    match rustix::process::Pid::from_raw(pid) {
        Some(process) if pid > 1 => rustix::process::kill_process(process, signal).is_ok(),
        _ => false,
    }
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
        let (cgroups, mut found) = if use_cgroups {
            Cgroups::probe(node_id, crate::cgroup::default_pids_max())
        } else {
            (Cgroups::none(), vec!["cgroups disabled by configuration".to_string()])
        };
        // First in every list that shows this runtime, so no one mistakes it for isolation.
        let mut degraded = vec![
            "unisolated runtime: sandboxes run on the host as its root and can reach everything it can".to_string(),
        ];
        degraded.append(&mut found);
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
        let pid_namespace = mount_namespace && cgroups.has_memory() && probe_pid_namespace();
        if !pid_namespace {
            degraded.push("no PID namespace: a sandbox's processes see the host's".to_string());
        }
        for line in &degraded {
            tracing::warn!(node_id, "runtime degraded: {line}");
        }
        Self {
            cgroups,
            mount_namespace,
            pid_namespace,
            degraded,
            children: Mutex::new(HashMap::new()),
        }
    }

    /// Every live process of the sandbox: its cgroup members and its process group; with
    /// `with_reaper` false, without its PID namespace's reaper (which is not a command).
    fn processes(&self, sandbox: &Sandbox<'_>, with_reaper: bool) -> Vec<i32> {
        let mut pids = self.cgroups.pids(sandbox.id);
        if !with_reaper {
            pids.retain(|&pid| !is_reaper_part(pid));
        }
        if sandbox.pgid > 0 {
            for pid in group_members(sandbox.pgid) {
                if !pids.contains(&pid) {
                    pids.push(pid);
                }
            }
        }
        pids.retain(|&pid| !is_zombie(pid));
        pids
    }

    /// The host PID of the sandbox's PID-namespace reaper, started if it is not running.
    fn reaper(&self, sandbox: &Sandbox<'_>) -> Result<i32, RuntimeError> {
        let find = || self.cgroups.pids(sandbox.id).into_iter().find(|&pid| is_reaper(pid));
        if let Some(pid) = find() {
            return Ok(pid);
        }
        let join = self.cgroups.join_paths(sandbox.id);
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", REAPER_SCRIPT])
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only async-signal-safe system calls on data prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                for path in &join {
                    join_cgroup(path)?;
                }
                start_reaper()
            });
        }
        // The process std spawns forks the reaper into the new namespace and exits at once.
        let status = cmd.status().map_err(|e| control(sandbox, "pid namespace", e))?;
        if !status.success() {
            return Err(control(
                sandbox,
                "pid namespace",
                format!("reaper start failed: {status}"),
            ));
        }
        find().ok_or_else(|| control(sandbox, "pid namespace", "the reaper did not start"))
    }

    fn reap_one(&self, sandbox: &str) {
        // Taken out under the lock, waited for outside it: a child slow to die must not hold
        // up `reap` (every heartbeat) or other sandboxes' starts and kills.
        let child = self
            .children
            .lock()
            .ok()
            .and_then(|mut children| children.remove(sandbox));
        if let Some(mut child) = child {
            let _ = child.wait();
        }
    }
}

impl Runtime for ProcessRuntime {
    fn kind(&self) -> &'static str {
        "unisolated"
    }

    fn cpu_time_ns(&self) -> Option<u64> {
        self.cgroups.cpu_time_ns()
    }

    fn cpu_time_ns_of(&self, sandbox: &Sandbox<'_>) -> Option<u64> {
        self.cgroups.cpu_usage_ns(sandbox.id)
    }

    fn features(&self) -> Features {
        Features {
            cgroup_memory: self.cgroups.has_memory(),
            freezer: self.cgroups.has_freezer(),
            namespaces: self.mount_namespace,
            degraded: self.degraded.clone(),
        }
    }

    fn start(&self, sandbox: &Sandbox<'_>, home: &Path) -> Result<u32, RuntimeError> {
        let fail = |reason: String| RuntimeError::Start {
            sandbox: sandbox.id.to_string(),
            reason,
        };
        self.cgroups
            .create(sandbox.id, sandbox.memory_bytes)
            .map_err(|e| fail(format!("cgroup: {e}")))?;
        let Some(command) = sandbox.start_command.filter(|c| !c.trim().is_empty()) else {
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
            .env("E2B_SANDBOX_ID", sandbox.id)
            .envs(sandbox.env)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err));
        self.enclose(sandbox, home, home, &mut cmd)?;
        let child = cmd.spawn().map_err(|e| fail(format!("spawn: {e}")))?;
        let pgid = child.id();
        if let Ok(mut children) = self.children.lock() {
            children.insert(sandbox.id.to_string(), child);
        }
        Ok(pgid)
    }

    fn pause(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError> {
        match self.cgroups.freeze(sandbox.id, true) {
            Ok(true) => Ok(()),
            Ok(false) => {
                signal_group(sandbox.pgid, Signal::STOP);
                Ok(())
            }
            Err(e) => Err(control(sandbox, "pause", e)),
        }
    }

    fn resume(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError> {
        match self.cgroups.freeze(sandbox.id, false) {
            Ok(true) => Ok(()),
            Ok(false) => {
                signal_group(sandbox.pgid, Signal::CONT);
                Ok(())
            }
            Err(e) => Err(control(sandbox, "resume", e)),
        }
    }

    fn kill(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            signal_group(sandbox.pgid, Signal::KILL);
            for pid in self.cgroups.pids(sandbox.id) {
                signal_pid(pid, Signal::KILL);
            }
            // A frozen process keeps its SIGKILL pending until thawed.
            let _ = self.cgroups.freeze(sandbox.id, false);
            signal_group(sandbox.pgid, Signal::CONT);
            self.reap_one(sandbox.id);
            if self.processes(sandbox, true).is_empty() {
                break;
            }
            if Instant::now() > deadline {
                return Err(control(sandbox, "kill", "processes survived SIGKILL for 10 s"));
            }
            // Processes that were not our children are reaped by init; give it a moment.
            std::thread::sleep(Duration::from_millis(1));
        }
        self.cgroups.remove(sandbox.id);
        Ok(())
    }

    fn memory_used(&self, sandbox: &Sandbox<'_>) -> u64 {
        if let Some(bytes) = self.cgroups.memory_usage(sandbox.id) {
            return bytes;
        }
        if sandbox.pgid == 0 {
            return 0;
        }
        group_members(sandbox.pgid).into_iter().map(rss_bytes).sum()
    }

    fn alive(&self, sandbox: &Sandbox<'_>) -> bool {
        !self.processes(sandbox, false).is_empty()
    }

    fn adopt(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError> {
        self.cgroups
            .create(sandbox.id, sandbox.memory_bytes)
            .map_err(|e| control(sandbox, "adopt", e))
    }

    fn reap(&self) {
        if let Ok(mut children) = self.children.lock() {
            children.retain(|_, child| matches!(child.try_wait(), Ok(None)));
        }
    }

    /// Unisolated sandboxes share the host's network: their port is the host's.
    fn connect_port(&self, _record: &Sandbox<'_>, port: u16) -> std::io::Result<std::net::TcpStream> {
        let addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port));
        std::net::TcpStream::connect_timeout(&addr, super::CONNECT_TIMEOUT)
    }

    fn enclose(&self, sandbox: &Sandbox<'_>, home: &Path, cwd: &Path, cmd: &mut Command) -> Result<(), RuntimeError> {
        self.cgroups
            .create(sandbox.id, sandbox.memory_bytes)
            .map_err(|e| control(sandbox, "enclose", e))?;
        let join = self.cgroups.join_paths(sandbox.id);
        let pid_ns = if self.pid_namespace {
            let reaper = self.reaper(sandbox)?;
            Some(CString::new(format!("/proc/{reaper}/ns/pid")).map_err(|e| control(sandbox, "enclose", e))?)
        } else {
            None
        };
        cmd.process_group(0);
        let view = if self.mount_namespace {
            let inside = match cwd.strip_prefix(home) {
                Ok(rel) if !rel.as_os_str().is_empty() => Path::new(SANDBOX_HOME).join(rel),
                _ => Path::new(SANDBOX_HOME).to_path_buf(),
            };
            cmd.env("HOME", SANDBOX_HOME).env("PWD", &inside);
            let c =
                |p: &Path| CString::new(p.as_os_str().as_encoded_bytes()).map_err(|e| control(sandbox, "enclose", e));
            Some((c(home)?, c(Path::new(SANDBOX_HOME))?, c(&inside)?))
        } else {
            cmd.env("HOME", home).current_dir(cwd);
            None
        };
        // SAFETY: between fork and exec the closure only makes system calls (open, write,
        // close, unshare, mount, chdir, setns, fork, waitpid, _exit) on C strings prepared
        // before the fork, all async-signal-safe; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                for path in &join {
                    join_cgroup(path)?;
                }
                if let Some((home, target, inside)) = &view {
                    enter_mount_namespace(home, target)?;
                    rustix::process::chdir(inside.as_c_str())?;
                }
                if let Some(ns) = &pid_ns {
                    enter_pid_namespace(ns)?;
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
    use rustix::mount::MountPropagationFlags;
    // SAFETY: the flag unshares no descriptor table (only FILES could strand a descriptor).
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNS) }?;
    // Nothing mounted from here on may leak back to the host.
    rustix::mount::mount_change(c"/", MountPropagationFlags::REC | MountPropagationFlags::PRIVATE)?;
    rustix::mount::mount_bind_recursive(home.as_c_str(), target.as_c_str())?;
    Ok(())
}

/// Moves the calling process into a cgroup (`path` is its `cgroup.procs`).
///
/// # Safety
/// Only async-signal-safe system calls; meant for `pre_exec`.
unsafe fn join_cgroup(path: &CString) -> std::io::Result<()> {
    let procs = rustix::fs::open(path.as_c_str(), rustix::fs::OFlags::WRONLY, rustix::fs::Mode::empty())?;
    match rustix::io::write(&procs, b"0")? {
        1 => Ok(()),
        _ => Err(std::io::ErrorKind::WriteZero.into()),
    }
}

/// Closes every descriptor: a process that will never exec must not hold std's exec-status
/// pipe (spawn would wait for it) nor the command's pipes (readers would wait for EOF).
unsafe fn close_all() {
    // SAFETY: what the function promises its caller (above) holds for every call here.
    unsafe {
        libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32);
    }
}

/// What a sandbox's PID 1 runs: waiting is all it does (`wait` reaps every child, adopted
/// orphans included); it ignores the signals it has no handler for, as PID 1 does.
const REAPER_SCRIPT: &str = "while :; do sleep 3600 & wait $!; done";

/// In the process std spawned: creates a PID namespace, forks its PID 1 (which goes on to exec
/// the reaper, in a session of its own) and exits.
///
/// # Safety
/// Only async-signal-safe system calls; meant for `pre_exec`.
unsafe fn start_reaper() -> std::io::Result<()> {
    // SAFETY: the flag unshares no descriptor table (only FILES could strand a descriptor).
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWPID) }?;
    // SAFETY: what the function promises its caller (above) holds for every call here.
    unsafe {
        match libc::fork() {
            -1 => Err(std::io::Error::last_os_error()),
            0 => {
                // PID 1 keeps only its standard descriptors (all /dev/null).
                libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
                let _ = rustix::process::setsid();
                Ok(())
            }
            _ => {
                close_all();
                libc::_exit(0);
            }
        }
    }
}

/// Joins the PID namespace `ns` (a `/proc/PID/ns/pid` path): forks, lets the child go on to
/// exec the command inside the namespace (with its own /proc), and turns the caller into a
/// stand-in that waits for it and exits with its status.
///
/// # Safety
/// Only async-signal-safe system calls; meant for `pre_exec`, after the mount namespace.
unsafe fn enter_pid_namespace(ns: &CString) -> std::io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(ns.as_c_str(), OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    rustix::thread::move_into_link_name_space(
        std::os::fd::AsFd::as_fd(&fd),
        Some(rustix::thread::LinkNameSpaceType::ProcessID),
    )?;
    drop(fd);
    // SAFETY: what the function promises its caller (above) holds for every call here.
    unsafe {
        match libc::fork() {
            -1 => Err(std::io::Error::last_os_error()),
            0 => {
                // The command: dies with its stand-in (a signal to the PID the SDK knows ends it).
                // (Its parent is outside its namespace, so getppid() cannot check for a parent
                // that died before this line; the stand-in only dies by a signal sent to it.)
                rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
                use rustix::mount::MountFlags;
                let flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
                rustix::mount::mount(c"proc", c"/proc", c"proc", flags, None)?;
                Ok(())
            }
            child => {
                close_all();
                let mut status = 0;
                loop {
                    if libc::waitpid(child, &mut status, 0) == child {
                        break;
                    }
                    if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                        libc::_exit(127);
                    }
                }
                if libc::WIFEXITED(status) {
                    libc::_exit(libc::WEXITSTATUS(status));
                }
                libc::_exit(128 + libc::WTERMSIG(status));
            }
        }
    }
}

/// A field of /proc/PID/status (`NSpid`, `PPid`…), without its name.
fn status_field(pid: i32, field: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status
        .lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?;
    Some(line[field.len() + 1..].trim().to_string())
}

/// Whether `pid` is a PID namespace's reaper: PID 1 in the innermost namespace it is in.
fn is_reaper(pid: i32) -> bool {
    status_field(pid, "NSpid").is_some_and(|ids| {
        let ids: Vec<&str> = ids.split_whitespace().collect();
        ids.len() > 1 && ids.last() == Some(&"1")
    })
}

/// The reaper or the `sleep` it waits on: the namespace's own, not the sandbox's commands.
fn is_reaper_part(pid: i32) -> bool {
    is_reaper(pid)
        || (status_field(pid, "PPid")
            .and_then(|p| p.parse::<i32>().ok())
            .is_some_and(is_reaper)
            && std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == b"sleep\x003600\x00"))
}

/// Whether sandboxes can get a PID namespace here: `true` run in a new one.
fn probe_pid_namespace() -> bool {
    let mut probe = Command::new("/bin/true");
    // SAFETY: one async-signal-safe system call, which unshares no descriptor table (only
    // FILES could strand a descriptor).
    unsafe {
        probe.pre_exec(|| {
            rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWPID)?;
            Ok(())
        });
    }
    probe.status().is_ok_and(|s| s.success())
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
