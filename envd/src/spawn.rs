//! Starting a command without copying envd.
//!
//! std starts a command that must change its uid by `fork`: the child is a copy of envd's
//! whole address space (page tables copied, every page shared copy-on-write and faulted
//! back in as either side writes), only to throw it all away at `exec` a moment later. That
//! copy was a large part of what running `true` cost. posix_spawn avoids it with
//! `clone(CLONE_VM | CLONE_VFORK)` (the child borrows envd's memory, on a stack of its own,
//! and the calling thread waits until the child has exec'd or failed), but it cannot change
//! uids. So envd does what posix_spawn does, with the steps a sandbox's command needs:
//! standard streams, its own process group or a session on a terminal, the user's groups,
//! gid and uid, the working directory, default signal handling, then `execve`.
//!
//! The child runs in envd's memory, so it may only make raw system calls on data prepared
//! before the clone: no allocation, no lock, and none of glibc's wrappers that act on the
//! whole process (`setuid` and friends signal every thread of what they believe is their
//! process, which here would be envd's). Each step's failure ends the child with the step's
//! errno left in memory envd reads once it runs again.
//!
//! The command's end is awaited on a pidfd, not through `SIGCHLD`: readable once the process
//! has exited, then reaped by its PID, which stays ours until then.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};

use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;

/// The child's stack: the few frames of [`child_main`] and the kernel's entry to it.
const STACK_BYTES: usize = 64 * 1024;

/// How the command relates to envd's sessions and process groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Session {
    /// A process group of its own, so a signal to the group reaches what it started too.
    Group,
    /// A session of its own whose controlling terminal is the one on its stdin (a PTY).
    Terminal,
}

/// Where one of the command's standard streams goes.
#[derive(Debug)]
pub enum Stdio {
    /// A pipe to envd ([`Child::stdin`], [`Child::stdout`], [`Child::stderr`]).
    Piped,
    /// `/dev/null`.
    Null,
    /// This descriptor (a terminal's slave side).
    Fd(OwnedFd),
}

/// A command to start: what `execve` gets, and what changes before it.
pub struct Command {
    program: OsString,
    args: Vec<OsString>,
    env: BTreeMap<OsString, OsString>,
    cwd: PathBuf,
    /// (uid, gid) to become, without supplementary groups; `None` keeps envd's.
    ids: Option<(u32, u32)>,
    session: Session,
}

/// A started command.
pub struct Child {
    pid: u32,
    pidfd: AsyncFd<OwnedFd>,
    status: Option<ExitStatus>,
    pub stdin: Option<pipe::Sender>,
    pub stdout: Option<pipe::Receiver>,
    pub stderr: Option<pipe::Receiver>,
}

impl Command {
    /// `program`, run with no arguments, no environment, in `/`, as envd's own user.
    pub fn new(program: impl AsRef<OsStr>) -> Self {
        Self {
            program: program.as_ref().to_owned(),
            args: Vec::new(),
            env: BTreeMap::new(),
            cwd: PathBuf::from("/"),
            ids: None,
            session: Session::Group,
        }
    }

    pub fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&mut self, args: I) -> &mut Self {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets one variable; a later value of the same name replaces an earlier one.
    pub fn env(&mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Self {
        self.env.insert(key.as_ref().to_owned(), value.as_ref().to_owned());
        self
    }

    pub fn envs<I, K, V>(&mut self, vars: I) -> &mut Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        for (k, v) in vars {
            self.env(k, v);
        }
        self
    }

    pub fn current_dir(&mut self, dir: impl AsRef<Path>) -> &mut Self {
        self.cwd = dir.as_ref().to_path_buf();
        self
    }

    /// Runs the command as `uid`:`gid` with no supplementary groups.
    pub fn ids(&mut self, uid: u32, gid: u32) -> &mut Self {
        self.ids = Some((uid, gid));
        self
    }

    pub fn session(&mut self, session: Session) -> &mut Self {
        self.session = session;
        self
    }

    /// The file `execve` gets: the program itself when it names a path, else the first
    /// executable of that name along the command's own `PATH`, as a shell looks it up (a
    /// relative entry is relative to the command's working directory).
    fn resolve(&self) -> io::Result<PathBuf> {
        let program = Path::new(&self.program);
        if self.program.as_bytes().contains(&b'/') {
            return Ok(program.to_path_buf());
        }
        let search = self
            .env
            .get(OsStr::new("PATH"))
            .map(OsString::as_os_str)
            .unwrap_or_default();
        std::env::split_paths(search)
            .map(|dir| self.cwd.join(dir).join(program))
            .find(|candidate| executable(candidate))
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))
    }

    /// Starts the command with its standard streams as given.
    pub fn spawn(&self, stdin: Stdio, stdout: Stdio, stderr: Stdio) -> io::Result<Child> {
        let path = cstring(self.resolve()?.as_os_str())?;
        let argv = std::iter::once(cstring(&self.program))
            .chain(self.args.iter().map(|a| cstring(a)))
            .collect::<io::Result<Vec<_>>>()?;
        let envp = self
            .env
            .iter()
            .map(|(k, v)| {
                let mut pair = k.clone();
                pair.push("=");
                pair.push(v);
                cstring(&pair)
            })
            .collect::<io::Result<Vec<_>>>()?;
        let cwd = cstring(self.cwd.as_os_str())?;
        let (stdin, our_stdin) = stream(stdin, Direction::In)?;
        let (stdout, our_stdout) = stream(stdout, Direction::Out)?;
        let (stderr, our_stderr) = stream(stderr, Direction::Out)?;
        let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
        argv_ptrs.push(std::ptr::null());
        let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
        envp_ptrs.push(std::ptr::null());
        let failure = AtomicI32::new(0);
        let plan = Plan {
            path: path.as_ptr(),
            argv: argv_ptrs.as_ptr(),
            envp: envp_ptrs.as_ptr(),
            cwd: cwd.as_ptr(),
            stdio: [stdin.as_raw_fd(), stdout.as_raw_fd(), stderr.as_raw_fd()],
            ids: self.ids,
            session: self.session,
            failure: &failure,
        };
        let pid = clone_vfork(&plan)?;
        // The child has exec'd or ended: its ends of the streams are its own now, or unused.
        drop((stdin, stdout, stderr));
        let errno = failure.load(Ordering::Acquire);
        if errno != 0 {
            reap(pid);
            return Err(io::Error::from_raw_os_error(errno));
        }
        let pidfd = match watch(pid) {
            Ok(fd) => fd,
            Err(err) => {
                // SAFETY: kill has no memory preconditions; the PID is our unreaped child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                reap(pid);
                return Err(err);
            }
        };
        Ok(Child {
            pid: pid.unsigned_abs(),
            pidfd,
            status: None,
            stdin: our_stdin.map(pipe::Sender::from_owned_fd).transpose()?,
            stdout: our_stdout.map(pipe::Receiver::from_owned_fd).transpose()?,
            stderr: our_stderr.map(pipe::Receiver::from_owned_fd).transpose()?,
        })
    }
}

impl Child {
    pub fn id(&self) -> u32 {
        self.pid
    }

    /// Waits for the command to end and reaps it; its status every time after.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        let pid = libc::pid_t::try_from(self.pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
        loop {
            let mut ready = self.pidfd.readable().await?;
            let mut raw = 0;
            // SAFETY: waitpid writes only `raw`; the PID is our child, not reaped before.
            match unsafe { libc::waitpid(pid, &mut raw, libc::WNOHANG) } {
                0 => ready.clear_ready(),
                -1 => {
                    let err = io::Error::last_os_error();
                    if err.kind() != io::ErrorKind::Interrupted {
                        return Err(err);
                    }
                }
                _ => {
                    let status = ExitStatus::from_raw(raw);
                    self.status = Some(status);
                    return Ok(status);
                }
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Direction {
    /// The child reads (stdin).
    In,
    /// The child writes (stdout, stderr).
    Out,
}

/// The child's end of one stream (at 3 or above, so placing the three on 0, 1 and 2 never
/// overwrites one not yet placed) and envd's end, for a pipe.
fn stream(stdio: Stdio, direction: Direction) -> io::Result<(OwnedFd, Option<OwnedFd>)> {
    let (child, ours) = match stdio {
        Stdio::Fd(fd) => (fd, None),
        Stdio::Null => (
            std::fs::File::options()
                .read(true)
                .write(true)
                .open("/dev/null")?
                .into(),
            None,
        ),
        Stdio::Piped => {
            let mut fds = [0; 2];
            // SAFETY: pipe2 writes two descriptors into `fds`, which we then own.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: both were just opened and are owned by nothing else.
            let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            match direction {
                Direction::In => (read, Some(write)),
                Direction::Out => (write, Some(read)),
            }
        }
    };
    if child.as_raw_fd() > 2 {
        return Ok((child, ours));
    }
    // SAFETY: F_DUPFD_CLOEXEC returns a new descriptor we then own.
    let moved = unsafe { libc::fcntl(child.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if moved < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just returned by fcntl, owned by nothing else.
    Ok((unsafe { OwnedFd::from_raw_fd(moved) }, ours))
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a NUL byte in a command's argument, environment or path",
        )
    })
}

fn executable(path: &Path) -> bool {
    let Ok(c) = cstring(path.as_os_str()) else {
        return false;
    };
    // SAFETY: access reads a NUL-terminated path.
    let runnable = unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0;
    runnable && path.is_file()
}

/// A pidfd of `pid`, registered with the runtime: readable once the process has ended.
fn watch(pid: libc::pid_t) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: pidfd_open takes a PID and flags, and returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor, owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    // SAFETY: the OwnedFd stays open, and the same, for as long as the AsyncFd owns it.
    unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(|e| io::Error::other(e.to_string()))
}

/// Reaps a child that has ended or will at once (it failed before exec, or was killed).
fn reap(pid: libc::pid_t) {
    let mut status = 0;
    // SAFETY: waitpid writes only `status`.
    while unsafe { libc::waitpid(pid, &mut status, 0) } == -1
        && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
    {}
}

/// Everything the child needs, prepared by envd: pointers into memory that outlives the
/// child's use of it (the parent thread waits in `clone` until the child has exec'd or ended).
struct Plan<'a> {
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: *const libc::c_char,
    stdio: [RawFd; 3],
    ids: Option<(u32, u32)>,
    session: Session,
    failure: &'a AtomicI32,
}

/// Clones the child into [`child_main`] and returns its PID once it has exec'd or ended.
/// Every signal is blocked around the clone, so no handler of envd's runs on the child's
/// stack before the child has set its signals to their defaults.
fn clone_vfork(plan: &Plan<'_>) -> io::Result<libc::pid_t> {
    let mut stack = vec![0u8; STACK_BYTES];
    // SAFETY: the stack grows down from its end, which we align to 16 bytes.
    let top = unsafe { stack.as_mut_ptr().add(STACK_BYTES) };
    let top = (top as usize & !15) as *mut libc::c_void;
    // SAFETY: sigset_t is plain data; sigfillset and pthread_sigmask only write the sets.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    let mut before: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut before);
    }
    let arg = plan as *const Plan<'_> as *mut libc::c_void;
    // SAFETY: the child runs `child_main` on `stack` with `plan`, both alive until clone
    // returns: CLONE_VFORK holds this thread until the child has exec'd or ended.
    let pid = unsafe { libc::clone(child_main, top, libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD, arg) };
    let err = io::Error::last_os_error();
    // SAFETY: restores this thread's mask from the copy taken above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut()) };
    drop(stack);
    if pid == -1 {
        return Err(err);
    }
    Ok(pid)
}

/// The kernel's size of a signal set (64 signals), which `rt_sig*` calls must be given.
const KERNEL_SIGSET_BYTES: libc::c_long = 8;

/// A raw system call of up to four arguments; its errno on failure.
///
/// # Safety
/// The arguments must be what the call expects (pointers to live, prepared memory).
unsafe fn sys(number: libc::c_long, args: [libc::c_long; 4]) -> Result<libc::c_long, i32> {
    // SAFETY: as the caller promises; errno is this thread's, read right after.
    unsafe {
        let r = libc::syscall(number, args[0], args[1], args[2], args[3]);
        if r == -1 {
            Err(*libc::__errno_location())
        } else {
            Ok(r)
        }
    }
}

/// The child, between clone and exec: raw system calls only (see the module's doc).
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the Plan clone_vfork passed, alive while the parent waits.
    let plan = unsafe { &*(arg as *const Plan<'_>) };
    // SAFETY: raw system calls on prepared data; see each step.
    let failed = unsafe { prepare_and_exec(plan) };
    plan.failure.store(failed.max(1), Ordering::Release);
    // SAFETY: ends this task only (not envd's threads, as exit_group would).
    unsafe { libc::syscall(libc::SYS_exit, 127) };
    127
}

/// Returns only on failure, with the errno of the step that failed.
///
/// # Safety
/// Only in the child of [`clone_vfork`], with its plan.
unsafe fn prepare_and_exec(plan: &Plan<'_>) -> i32 {
    // The kernel's own `struct sigaction` (handler, flags, restorer, mask), all zero: the
    // default disposition. glibc's struct has another layout; this one goes to the kernel.
    let default = [0 as libc::c_ulong; 4];
    let unblocked = 0u64;
    // SAFETY: every call gets plain numbers or pointers to the prepared plan and the two
    // locals above, all alive until execve replaces this process or it ends.
    let step = || -> Result<(), i32> {
        unsafe {
            // Default dispositions for every signal (a handler of envd's would run envd's
            // code in a process that is not envd; an ignored SIGPIPE would reach the command).
            for signal in 1..=64 {
                if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                    let _ = sys(
                        libc::SYS_rt_sigaction,
                        [signal.into(), default.as_ptr() as libc::c_long, 0, KERNEL_SIGSET_BYTES],
                    );
                }
            }
            for (target, fd) in plan.stdio.iter().enumerate() {
                sys(libc::SYS_dup3, [(*fd).into(), target as libc::c_long, 0, 0])?;
            }
            match plan.session {
                Session::Group => {
                    sys(libc::SYS_setpgid, [0; 4])?;
                }
                Session::Terminal => {
                    // Without a PID namespace the command may lead a group already; it then
                    // runs on the terminal without job control.
                    if sys(libc::SYS_setsid, [0; 4]).is_ok() {
                        let _ = sys(libc::SYS_ioctl, [0, libc::TIOCSCTTY as libc::c_long, 0, 0]);
                    }
                }
            }
            if let Some((uid, gid)) = plan.ids {
                sys(libc::SYS_setgroups, [0; 4])?;
                sys(libc::SYS_setgid, [gid.into(), 0, 0, 0])?;
                sys(libc::SYS_setuid, [uid.into(), 0, 0, 0])?;
            }
            sys(libc::SYS_chdir, [plan.cwd as libc::c_long, 0, 0, 0])?;
            // Nothing blocked: the mask the parent set for the clone is not the command's.
            sys(
                libc::SYS_rt_sigprocmask,
                [
                    libc::SIG_SETMASK.into(),
                    &unblocked as *const u64 as libc::c_long,
                    0,
                    KERNEL_SIGSET_BYTES,
                ],
            )?;
            let errno = sys(
                libc::SYS_execve,
                [
                    plan.path as libc::c_long,
                    plan.argv as libc::c_long,
                    plan.envp as libc::c_long,
                    0,
                ],
            )
            .err()
            .unwrap_or(libc::ENOEXEC);
            Err(errno)
        }
    };
    match step() {
        Ok(()) => libc::ENOEXEC,
        Err(errno) => errno,
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Runs `script` with `sh -c`; (stdout, exit code).
    async fn sh(cmd: &mut Command, stdin: Stdio, input: &[u8]) -> (String, Option<i32>) {
        let mut child = cmd.spawn(stdin, Stdio::Piped, Stdio::Null).expect("sh starts");
        if let Some(mut pipe) = child.stdin.take() {
            pipe.write_all(input).await.unwrap();
        }
        let mut out = String::new();
        child.stdout.take().unwrap().read_to_string(&mut out).await.unwrap();
        let status = child.wait().await.unwrap();
        assert_eq!(child.wait().await.unwrap(), status, "the status is kept");
        (out, status.code())
    }

    fn script(text: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", text]).env("PATH", "/usr/bin:/bin");
        cmd
    }

    #[tokio::test]
    async fn the_command_gets_its_ids_groups_directory_environment_and_streams() {
        let mut cmd = script("id -u; id -g; id -G; pwd; echo \"$GREETING\"; cat; exit 3");
        cmd.env("GREETING", "hello").ids(65534, 65534).current_dir("/tmp");
        let (out, code) = sh(&mut cmd, Stdio::Piped, b"from stdin").await;
        assert_eq!(out, "65534\n65534\n65534\n/tmp\nhello\nfrom stdin");
        assert_eq!(code, Some(3));
    }

    #[tokio::test]
    async fn the_command_leads_its_own_group_with_default_signals_and_nothing_blocked() {
        let mut cmd = script("ps -o pgid= -p $$ | tr -d ' '; echo $$; grep -E '^Sig(Blk|Ign)' /proc/self/status; cat");
        let (out, code) = sh(&mut cmd, Stdio::Null, b"").await;
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(code, Some(0), "{out}");
        assert_eq!(lines[0], lines[1], "its own process group: {out}");
        // `cat` reads /dev/null and ends; SIGPIPE (ignored by every Rust program) is default.
        assert_eq!(
            lines[2..],
            ["SigBlk:\t0000000000000000", "SigIgn:\t0000000000000000"],
            "{out}"
        );
    }

    #[tokio::test]
    async fn a_program_that_cannot_start_is_an_error_and_leaves_no_child() {
        let missing = Command::new("no-such-program-anywhere")
            .env("PATH", "/usr/bin:/bin")
            .spawn(Stdio::Null, Stdio::Null, Stdio::Null)
            .err()
            .expect("a missing program does not start");
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
        // Found, but not allowed: the failure comes from the child's execve.
        let plain = std::env::temp_dir().join(format!("envd-spawn-plain-{}", std::process::id()));
        std::fs::write(&plain, "#!/bin/sh\n").unwrap();
        let denied = Command::new(&plain).spawn(Stdio::Null, Stdio::Null, Stdio::Null).err();
        let _ = std::fs::remove_file(&plain);
        let denied = denied.expect("a file that is not executable does not start");
        assert_eq!(denied.raw_os_error(), Some(libc::EACCES));
        let bad_dir = Command::new("/bin/true")
            .current_dir("/no/such/directory")
            .spawn(Stdio::Null, Stdio::Null, Stdio::Null)
            .err()
            .expect("a missing working directory is an error");
        assert_eq!(bad_dir.kind(), io::ErrorKind::NotFound);
        // A child that failed before exec still bears this thread's name; none is left.
        let me = std::fs::read_to_string("/proc/thread-self/comm").unwrap();
        let left: Vec<String> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
            .flat_map(|pids| pids.split_whitespace().map(str::to_string).collect::<Vec<_>>())
            .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).ok().as_ref() == Some(&me))
            .collect();
        assert!(left.is_empty(), "children left unreaped: {left:?}");
    }
}
