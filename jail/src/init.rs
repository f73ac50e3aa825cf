//! The child side: what the container's init does between `clone` and `execve`.
//!
//! The parent builds an [`InitPlan`] *before* cloning: every path, argument and
//! environment string as a C string, the argv/envp pointer arrays, the compiled seccomp
//! filter, the capability masks, scratch buffers. After the clone the child only reads that
//! plan and makes system calls. It never allocates: if the runtime is ever embedded in a
//! multi-threaded program, a lock held by another thread at the moment of the clone would
//! stay locked forever in the child.
//!
//! The protocol with the parent uses two close-on-exec pipes:
//!
//! * **sync** (parent → child): the child blocks reading it until the parent has written the
//!   id maps, (on cgroup v2) moved the child into its cgroup, and set the rlimits that raise
//!   a hard limit and `oom_score_adj` (the child sets those that only lower). End of file
//!   without a byte means the parent gave up; the child exits quietly.
//! * **report** (child → parent): on failure the child writes one line (`mount proc on
//!   /proc: operation not permitted`) and exits. On success `execve` closes the pipe
//!   (close-on-exec) and the parent reads end of file with no data: that *is* the "exec
//!   succeeded" signal, with no extra round trip.
//!
//! The init's steps, in order:
//!
//! 1. (cgroup v1) join the cgroup by writing `0` to each `tasks` file — before anything
//!    else, while the parent writes the id maps;
//! 2. wait on the sync pipe;
//! 3. become uid/gid 0 of the user namespace, unshare the cgroup namespace, start a new
//!    session and session keyring;
//! 4. build the filesystem and pivot into it (`rootfs`), set hostname and domain name,
//!    bring up `lo`;
//! 5. `chdir` to `process.cwd`, fill in `HOME`, mark fds close-on-exec except the preserved
//!    ones, reset signal dispositions, set the rlimits that only lower what it inherited
//!    (the parent set any that raise), and set the node's nice value again when the helper
//!    that made this init runs above it (see `priority`);
//!
//! and then the privilege-dropping steps, each needing the privileges the next gives up:
//!
//! 6. drop the bounding set (needs CAP_SETPCAP), set KEEPCAPS;
//! 7. `setgroups`, `setresgid`, `setresuid` to the spec's user;
//! 8. set effective/permitted/inheritable, raise ambient capabilities;
//! 9. `PR_SET_NO_NEW_PRIVS`;
//! 10. install the seccomp filter — last, so it need not allow any of the calls above;
//! 11. `execve`.
//!
//! Installing a filter requires no_new_privs or CAP_SYS_ADMIN. If the spec asks for seccomp
//! without `noNewPrivileges`, we do what runc does: install the filter *before* step 7,
//! while we still hold CAP_SYS_ADMIN in the user namespace; the profile must then allow
//! `setgroups`, `setresgid`, `setresuid`, `capset`, `prctl` and `execve`.

use std::ffi::{CStr, CString};
use std::fmt::Write as _;
use std::os::fd::{AsRawFd as _, RawFd};

use crate::capabilities::{CapsError, CapsPlan};
use crate::namespaces::{self, NamespaceError};
use crate::rootfs::{RootfsPlan, SetupError};
use crate::seccomp::{self, Program, SeccompError};
use crate::spec::Config;
use crate::sys::{self, check, Errno, StackBuf};

/// Exit code of an init that failed before `execve` (what a shell uses for "cannot run").
const FAILED: i32 = 127;

/// The pipe ends the init deals with.
#[derive(Debug, Clone, Copy)]
pub struct InitFds {
    /// Child's end of the sync pipe (read).
    pub sync: RawFd,
    /// Child's end of the report pipe (write, close-on-exec).
    pub report: RawFd,
    /// The parent's ends, closed in the child so that end-of-file works both ways.
    pub parent: [RawFd; 2],
}

/// Everything the init needs, prepared before the clone.
pub struct InitPlan {
    fds: InitFds,
    /// v1 `tasks` files to write `0` into, first thing (see `Cgroup::self_join_files`),
    /// opened by the parent as the host's root before the clone: the kernel checks a write
    /// there against the credentials the file was opened with (since Linux 5.16, and in
    /// stable kernels with the fix for CVE-2021-4197; before, against the writer's), and the
    /// init's effective uid is its user namespace's owner, not root (see `namespaces`).
    cgroup_tasks: Vec<(CString, std::os::fd::OwnedFd)>,
    userns: bool,
    cgroupns: bool,
    netns: bool,
    hostname: Option<CString>,
    domainname: Option<CString>,
    rootfs: RootfsPlan,
    cwd: CString,
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
    umask: libc::mode_t,
    caps: Option<CapsPlan>,
    no_new_privs: bool,
    seccomp: Option<Program>,
    preserve_fds: u32,
    /// The nice value to set before the container's code runs: the node's, when the helper
    /// that made this init runs above it (see [`crate::priority`]).
    nice: Option<i32>,
    /// The spec's rlimits that only lower what the init inherits: set by the init on itself
    /// (see [`crate::rlimits`]).
    rlimits: Vec<crate::rlimits::Limit>,
    exec: ExecPlan,
}

/// The program to run and how to find it.
struct ExecPlan {
    /// `args[0]` as written, for messages.
    arg0: String,
    /// Paths to try: `args[0]` itself if it contains a `/`, else `$PATH` entries joined with it.
    candidates: Vec<CString>,
    path_lookup: bool,
    /// Owns the strings `argv`/`envp` point into.
    _strings: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    /// Null-terminated; has one spare null slot before the terminator for HOME.
    envp: Vec<*const libc::c_char>,
    /// Index of the spare slot, if HOME must be looked up in the container's /etc/passwd.
    home_slot: Option<usize>,
    /// Scratch space for that lookup: the file contents, then `HOME=...\0`.
    passwd: Vec<u8>,
    home: Vec<u8>,
}

/// Errors from building the plan (parent side).
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("config.json: {0} contains a NUL byte")]
    Nul(&'static str),
    #[error("open the cgroup's {path}: {errno}")]
    CgroupTasks { path: std::path::PathBuf, errno: Errno },
}

/// Why the init failed; formatted into the report pipe.
#[derive(Debug, thiserror::Error)]
enum Failure<'a> {
    // Not `#[from]`: thiserror would make these `source()`s, which must be 'static.
    #[error("{0}")]
    Rootfs(SetupError<'a>),
    #[error("{0}")]
    Namespace(NamespaceError),
    #[error("{0}")]
    Caps(CapsError),
    #[error("{0}")]
    Seccomp(SeccompError),
    #[error("{what}: {errno}")]
    Sys { what: &'static str, errno: Errno },
    #[error("join cgroup {path}: {errno}")]
    Cgroup { path: sys::CDisplay<'a>, errno: Errno },
    #[error("chdir to {cwd}: {errno}")]
    Cwd { cwd: sys::CDisplay<'a>, errno: Errno },
    #[error("exec: {arg0:?}: {errno}")]
    Exec { arg0: &'a str, errno: Errno },
    #[error("exec: {arg0:?}: executable file not found in $PATH")]
    NotFound { arg0: &'a str },
}

impl<'a> From<SetupError<'a>> for Failure<'a> {
    fn from(e: SetupError<'a>) -> Self {
        Failure::Rootfs(e)
    }
}

impl From<NamespaceError> for Failure<'_> {
    fn from(e: NamespaceError) -> Self {
        Failure::Namespace(e)
    }
}

impl From<CapsError> for Failure<'_> {
    fn from(e: CapsError) -> Self {
        Failure::Caps(e)
    }
}

impl From<SeccompError> for Failure<'_> {
    fn from(e: SeccompError) -> Self {
        Failure::Seccomp(e)
    }
}

fn sys_err(what: &'static str) -> impl Fn(Errno) -> Failure<'static> {
    move |errno| Failure::Sys { what, errno }
}

fn cstr(s: &str, what: &'static str) -> Result<CString, InitError> {
    crate::sys::cstring(s).map_err(|_| InitError::Nul(what))
}

impl InitPlan {
    /// Prepares the plan.
    pub fn new(
        config: &Config,
        rootfs: RootfsPlan,
        seccomp: Option<Program>,
        cgroup_tasks: &[std::path::PathBuf],
        preserve_fds: u32,
        fds: InitFds,
    ) -> Result<Self, InitError> {
        let p = &config.process;
        let user = p.user();
        Ok(InitPlan {
            fds,
            cgroup_tasks: cgroup_tasks
                .iter()
                .map(|p| {
                    let c = CString::new(p.as_os_str().as_encoded_bytes())
                        .map_err(|_| InitError::Nul("linux.cgroupsPath"))?;
                    let opened = |errno| InitError::CgroupTasks { path: p.clone(), errno };
                    use rustix::fs::{Mode, OFlags};
                    let fd = rustix::fs::open(c.as_c_str(), OFlags::WRONLY | OFlags::CLOEXEC, Mode::empty())
                        .map_err(|e| opened(Errno(e.raw_os_error())))?;
                    // Clear of the descriptors the init passes on.
                    let fd = sys::move_above(fd, 3 + preserve_fds as i32).map_err(opened)?;
                    Ok((c, fd))
                })
                .collect::<Result<_, InitError>>()?,
            userns: config.namespaces.user,
            cgroupns: config.namespaces.cgroup,
            // A joined network namespace is its maker's to set up, loopback included.
            netns: config.namespaces.net && config.namespaces.join_net.is_none(),
            hostname: config.hostname.as_deref().map(|h| cstr(h, "hostname")).transpose()?,
            domainname: config
                .domainname
                .as_deref()
                .map(|h| cstr(h, "domainname"))
                .transpose()?,
            rootfs,
            cwd: cstr(&p.cwd().to_string_lossy(), "process.cwd")?,
            uid: user.uid(),
            gid: user.gid(),
            groups: user.additional_gids().clone().unwrap_or_default(),
            umask: user.umask().unwrap_or(0o022) as libc::mode_t,
            caps: p.capabilities().as_ref().map(CapsPlan::new),
            no_new_privs: p.no_new_privileges().unwrap_or(false),
            seccomp,
            preserve_fds,
            nice: crate::priority::for_containers(),
            rlimits: Vec::new(),
            exec: ExecPlan::new(p.args().as_deref().unwrap_or(&[]), p.env().as_deref().unwrap_or(&[]))?,
        })
    }

    /// The rlimits the init sets on itself.
    pub fn set_rlimits(&mut self, rlimits: Vec<crate::rlimits::Limit>) {
        self.rlimits = rlimits;
    }
}

impl ExecPlan {
    fn new(args: &[String], env: &[String]) -> Result<Self, InitError> {
        let arg0 = args.first().cloned().unwrap_or_default();
        let mut strings = Vec::with_capacity(args.len() + env.len());
        let mut argv = Vec::with_capacity(args.len() + 1);
        for a in args {
            let c = cstr(a, "process.args")?;
            argv.push(c.as_ptr());
            strings.push(c);
        }
        argv.push(std::ptr::null());
        let mut envp = Vec::with_capacity(env.len() + 2);
        for e in env {
            let c = cstr(e, "process.env")?;
            envp.push(c.as_ptr());
            strings.push(c);
        }
        // runc sets HOME from the user's /etc/passwd entry when the spec does not.
        let home_slot = (!env.iter().any(|e| e.starts_with("HOME="))).then_some(envp.len());
        envp.push(std::ptr::null());
        envp.push(std::ptr::null());

        let path_lookup = !arg0.contains('/');
        let candidates = if path_lookup {
            // Go's exec.LookPath (which runc uses) reads PATH from the container's
            // environment; an empty entry means the current directory.
            let path = env.iter().rev().find_map(|e| e.strip_prefix("PATH=")).unwrap_or("");
            path.split(':')
                .filter(|_| !path.is_empty())
                .map(|dir| cstr(&format!("{}/{arg0}", if dir.is_empty() { "." } else { dir }), "PATH"))
                .collect::<Result<_, _>>()?
        } else {
            vec![cstr(&arg0, "process.args")?]
        };
        let (passwd, home) = if home_slot.is_some() {
            (vec![0; 64 * 1024], vec![0; 4096 + 6])
        } else {
            (vec![], vec![])
        };
        Ok(ExecPlan {
            arg0,
            candidates,
            path_lookup,
            _strings: strings,
            argv,
            envp,
            home_slot,
            passwd,
            home,
        })
    }

    /// Picks the executable the way Go's LookPath does: the first candidate that is a
    /// non-directory with an execute bit.
    fn find(&self) -> Result<&CStr, Failure<'_>> {
        let mut last = Errno(libc::ENOENT);
        for c in &self.candidates {
            // SAFETY: stat into a zeroed struct.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: a valid C string and the live struct above to write into.
            if unsafe { libc::stat(c.as_ptr(), &mut st) } != 0 {
                last = Errno::last();
                continue;
            }
            if st.st_mode & libc::S_IFMT != libc::S_IFDIR && st.st_mode & 0o111 != 0 {
                return Ok(c);
            }
            last = Errno(libc::EACCES);
        }
        if self.path_lookup {
            Err(Failure::NotFound { arg0: &self.arg0 })
        } else {
            Err(Failure::Exec {
                arg0: &self.arg0,
                errno: last,
            })
        }
    }

    /// Looks up the uid's home directory in the container's /etc/passwd (after pivot) and
    /// fills the spare envp slot with `HOME=...` (or `HOME=/` if there is none).
    fn set_home(&mut self, uid: libc::uid_t) {
        let Some(slot) = self.home_slot else { return };
        let mut len = 0;
        // SAFETY: open/read/close into our preallocated buffer.
        unsafe {
            // The rootfs is untrusted: O_NONBLOCK and the regular-file check keep a FIFO
            // planted at /etc/passwd from blocking the start forever.
            let fd = libc::open(
                c"/etc/passwd".as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK,
            );
            if fd >= 0 {
                let mut st: libc::stat = std::mem::zeroed();
                if libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFREG {
                    len = sys::read_full(fd, &mut self.passwd).unwrap_or(0);
                }
                libc::close(fd);
            }
        }
        let mut dir: &[u8] = b"/";
        for line in self.passwd[..len].split(|&b| b == b'\n') {
            // name:password:uid:gid:gecos:home:shell
            let mut f = line.split(|&b| b == b':');
            let uid_field = f.nth(2);
            if uid_field
                .and_then(|u| std::str::from_utf8(u).ok())
                .and_then(|u| u.parse::<u32>().ok())
                == Some(uid)
            {
                if let Some(h) = f.nth(2).filter(|h| !h.is_empty() && h.len() < 4096) {
                    dir = h;
                }
                break;
            }
        }
        let n = 5 + dir.len();
        self.home[..5].copy_from_slice(b"HOME=");
        self.home[5..n].copy_from_slice(dir);
        self.home[n] = 0;
        self.envp[slot] = self.home.as_ptr().cast();
    }
}

/// The child's entry point: sets everything up and execs, or reports and exits.
pub fn run(plan: &mut InitPlan) -> ! {
    let report = plan.fds.report;
    let err = match setup_and_exec(plan) {
        Ok(never) => match never {},
        Err(e) => e,
    };
    let mut buf = StackBuf::<1024>::new();
    let _ = write!(buf, "{err}");
    let _ = sys::write_all(report, buf.as_bytes());
    sys::exit_now(FAILED)
}

fn setup_and_exec(plan: &mut InitPlan) -> Result<std::convert::Infallible, Failure<'_>> {
    // SAFETY: closing the parent's pipe ends, which this copy of the process does not use.
    unsafe {
        libc::close(plan.fds.parent[0]);
        libc::close(plan.fds.parent[1]);
    }
    // Join the cgroup before anything else, so everything the container does is accounted.
    // This runs while the parent writes our id maps, through files the parent opened.
    for (path, tasks) in &plan.cgroup_tasks {
        sys::write_all(tasks.as_raw_fd(), b"0").map_err(|errno| Failure::Cgroup {
            path: sys::CDisplay(path),
            errno,
        })?;
    }
    let mut go = [0u8; 1];
    if sys::read_full(plan.fds.sync, &mut go) != Ok(1) {
        // The parent failed or died before releasing us: nothing to report to.
        sys::exit_now(FAILED);
    }
    // SAFETY: closing our own descriptor.
    unsafe { libc::close(plan.fds.sync) };

    if plan.userns {
        namespaces::become_root()?;
    }
    if plan.cgroupns {
        namespaces::unshare_cgroup()?;
    }
    // SAFETY: setsid/keyctl/umask take no pointers we own.
    unsafe {
        // A new session: detached from the caller's terminal and process group, as runc.
        libc::setsid();
        // A fresh session keyring, so the container cannot reach keys "possessed" through
        // the caller's session keyring (runc does the same). ENOSYS: no keyring support.
        // EPERM: a seccomp filter around the node (Docker's default profile, when the node
        // itself runs in a container) denies keyctl; filters are inherited, so the sandbox
        // cannot call keyctl either and there is no keyring for it to reach.
        const KEYCTL_JOIN_SESSION_KEYRING: libc::c_long = 1;
        let rc = libc::syscall(
            libc::SYS_keyctl,
            KEYCTL_JOIN_SESSION_KEYRING,
            std::ptr::null::<libc::c_char>(),
        );
        if rc < 0 && !matches!(Errno::last().0, libc::ENOSYS | libc::EPERM) {
            return Err(Failure::Sys {
                what: "join a new session keyring",
                errno: Errno::last(),
            });
        }
        // Directories and files we create in the rootfs get exactly the modes we ask for.
        libc::umask(0);
    }

    crate::rootfs::setup(&plan.rootfs)?;
    if let Some(h) = &plan.hostname {
        namespaces::set_hostname(h)?;
    }
    if let Some(d) = &plan.domainname {
        namespaces::set_domainname(d)?;
    }
    if plan.netns {
        namespaces::loopback_up()?;
    }
    // SAFETY: chdir with a valid C string (resolved in the new root).
    if unsafe { libc::chdir(plan.cwd.as_ptr()) } != 0 {
        return Err(Failure::Cwd {
            cwd: sys::CDisplay(&plan.cwd),
            errno: Errno::last(),
        });
    }
    plan.exec.set_home(plan.uid);

    pass_fds(plan.preserve_fds)?;
    reset_signals();
    let sys = |what| {
        move |e: rustix::io::Errno| Failure::Sys {
            what,
            errno: Errno(e.raw_os_error()),
        }
    };
    for r in &plan.rlimits {
        // Only ever lowers what the init has (the parent set any raise): no privilege needed.
        rustix::process::setrlimit(r.resource, r.limit).map_err(sys("set an rlimit"))?;
    }
    if let Some(nice) = plan.nice {
        // Before the capabilities go and the filter comes: the container's processes run at
        // the node's priority, never the helper's. Only ever lowered: a helper reniced below
        // the node since it started (`renice` of the node's process group) leaves its
        // containers there, since raising a priority again would need CAP_SYS_NICE on the
        // host, which this init does not have, and would fail every create.
        // `None` names the calling thread, the init's only one.
        if rustix::process::getpriority_process(None).map_err(sys("read the priority"))? < nice {
            rustix::process::setpriority_process(None, nice).map_err(sys("set the node's priority"))?;
        }
    }

    if let Some(caps) = &plan.caps {
        caps.drop_bounding()?;
        CapsPlan::keep_across_setuid()?;
    }
    if let (Some(filter), false) = (&plan.seccomp, plan.no_new_privs) {
        // See the module comment: without no_new_privs the filter goes in while we still
        // hold CAP_SYS_ADMIN.
        seccomp::install(filter)?;
    }
    // SAFETY: id-changing calls with a valid groups array.
    unsafe {
        check(libc::setgroups(plan.groups.len(), plan.groups.as_ptr())).map_err(sys_err("setgroups"))?;
        check(libc::setresgid(plan.gid, plan.gid, plan.gid)).map_err(sys_err("setresgid"))?;
        check(libc::setresuid(plan.uid, plan.uid, plan.uid)).map_err(sys_err("setresuid"))?;
    }
    if let Some(caps) = &plan.caps {
        caps.apply()?;
    }
    // SAFETY: umask takes a mode.
    unsafe { libc::umask(plan.umask) };
    let path = plan.exec.find()?;
    if plan.no_new_privs {
        // SAFETY: prctl with integer arguments.
        check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }).map_err(sys_err("set no_new_privs"))?;
        if let Some(filter) = &plan.seccomp {
            seccomp::install(filter)?;
        }
    }
    // SAFETY: argv and envp are null-terminated arrays of valid C strings owned by the plan.
    unsafe { libc::execve(path.as_ptr(), plan.exec.argv.as_ptr(), plan.exec.envp.as_ptr()) };
    Err(Failure::Exec {
        arg0: &plan.exec.arg0,
        errno: Errno::last(),
    })
}

/// `--preserve-fds N`: fds 3..3+N stay open across exec with their numbers; every other fd
/// from 3 up is marked close-on-exec (our report pipe already is).
fn pass_fds(n: u32) -> Result<(), Failure<'static>> {
    let first_closed = 3 + n;
    for fd in 3..first_closed {
        // SAFETY: fcntl on a descriptor number; EBADF (not open) is fine.
        let rc = unsafe { libc::fcntl(fd as RawFd, libc::F_SETFD, 0) };
        if rc != 0 && Errno::last().0 != libc::EBADF {
            return Err(Failure::Sys {
                what: "clear close-on-exec of a preserved fd",
                errno: Errno::last(),
            });
        }
    }
    // SAFETY: close_range with the CLOEXEC flag only changes descriptor flags.
    let rc = unsafe { libc::close_range(first_closed, u32::MAX, libc::CLOSE_RANGE_CLOEXEC as libc::c_int) };
    if rc != 0 {
        return Err(Failure::Sys {
            what: "close_range",
            errno: Errno::last(),
        });
    }
    Ok(())
}

/// Gives the container a clean signal state: nothing blocked, nothing ignored. (Rust
/// programs ignore SIGPIPE, and ignored signals survive `execve`; handlers do not.)
fn reset_signals() {
    // SAFETY: sigprocmask/signal with valid arguments; SIGKILL/SIGSTOP are skipped.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        for sig in 1..32 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn path_candidates_and_home_slot() {
        let p = ExecPlan::new(&env(&["sh", "-c", "x"]), &env(&["PATH=/usr/bin::/bin", "A=b"])).unwrap();
        let c: Vec<_> = p.candidates.iter().map(|c| c.to_str().unwrap()).collect();
        assert_eq!(c, ["/usr/bin/sh", "./sh", "/bin/sh"]);
        assert_eq!(p.home_slot, Some(2));
        assert_eq!(p.argv.len(), 4);
        assert!(p.argv[3].is_null());
        assert!(p.envp[2].is_null() && p.envp[3].is_null());

        let p = ExecPlan::new(&env(&["/nope"]), &env(&["HOME=/root"])).unwrap();
        assert_eq!(p.candidates.len(), 1);
        assert!(!p.path_lookup);
        assert_eq!(p.home_slot, None);
        match p.find() {
            Err(e) => assert_eq!(e.to_string(), "exec: \"/nope\": no such file or directory"),
            Ok(_) => panic!("found /nope"),
        }

        let p = ExecPlan::new(&env(&["nope-not-here"]), &env(&["PATH=/usr/bin"])).unwrap();
        match p.find() {
            Err(e) => assert_eq!(
                e.to_string(),
                "exec: \"nope-not-here\": executable file not found in $PATH"
            ),
            Ok(_) => panic!("found it"),
        }
        let p = ExecPlan::new(&env(&["sh"]), &env(&["PATH=/nonexistent:/usr/bin:/bin"])).unwrap();
        assert!(p.find().unwrap().to_str().unwrap().ends_with("/sh"));
        // No PATH at all: nothing to search, as with Go.
        let p = ExecPlan::new(&env(&["sh"]), &[]).unwrap();
        assert!(p.candidates.is_empty());
    }
}
