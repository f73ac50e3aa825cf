//! Starting a command without copying envd.
//!
//! std starts a command that must change its uid by `fork`: the child is a copy of envd's
//! whole address space (page tables copied, every page shared copy-on-write and faulted
//! back in as either side writes), only to throw it all away at `exec` a moment later. That
//! copy was a large part of what running `true` cost. posix_spawn avoids it with
//! `clone(CLONE_VM | CLONE_VFORK)` (the child borrows envd's memory, on a stack of its own,
//! and the calling thread waits until the child has exec'd or failed), but it cannot change
//! uids. So envd does what posix_spawn does, with the steps a sandbox's command needs:
//! standard streams, its own process group or a session on a terminal, the OOM killer's
//! preference (above envd's own, see [`COMMAND_OOM_SCORE_ADJ`]), the user's groups, gid and
//! uid, the working directory, default signal handling, then `execve`.
//!
//! The child runs in envd's memory, so it may only make raw system calls on data prepared
//! before the clone: no allocation, no lock, and none of glibc's wrappers that act on the
//! whole process (`setuid` and friends signal every thread of what they believe is their
//! process, which here would be envd's). Each step's failure ends the child with the step's
//! errno left in memory envd reads once it runs again.
//!
//! The command's end is awaited on a pidfd, not through `SIGCHLD`: readable once the process
//! has exited, then reaped by its PID, which stays ours until then.
//!
//! System calls go through rustix, but for the clone itself, the signal masks around it and
//! everything the child does: rustix offers no `clone` with a stack of our choosing nor a
//! thread's signal mask, and the child may not allocate, so those stay raw `libc` calls, each
//! with its SAFETY note.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};

use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;

/// Where a program is looked for when the command's environment has no `PATH` (glibc's).
const DEFAULT_PATH: &str = "/bin:/usr/bin";

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
    /// Until the command is reaped.
    pidfd: Option<AsyncFd<OwnedFd>>,
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

    /// The files `execve` is tried on, in order, as `execvp` does: the program itself when
    /// it names a path, else the program in each directory of the command's own `PATH` (an
    /// empty or relative entry is relative to its working directory). The child tries them
    /// after it has become the user, so what the user may not run is passed over as it
    /// would be in a shell, and envd itself looks at no file.
    fn candidates(&self) -> io::Result<Vec<CString>> {
        if self.program.as_bytes().contains(&b'/') {
            return Ok(vec![cstring(&self.program)?]);
        }
        let search = self
            .env
            .get(OsStr::new("PATH"))
            .map_or(OsStr::new(DEFAULT_PATH), OsString::as_os_str);
        std::env::split_paths(search)
            .map(|dir| cstring(dir.join(&self.program).as_os_str()))
            .collect()
    }

    /// Starts the command with its standard streams as given.
    pub fn spawn(&self, stdin: Stdio, stdout: Stdio, stderr: Stdio) -> io::Result<Child> {
        let candidates = self.candidates()?;
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
        // envd's ends become the runtime's before the clone: nothing after it may fail but
        // the child itself.
        let (stdin, our_stdin) = stream(stdin, Direction::In)?;
        let (stdout, our_stdout) = stream(stdout, Direction::Out)?;
        let (stderr, our_stderr) = stream(stderr, Direction::Out)?;
        let our_stdin = our_stdin.map(pipe::Sender::from_owned_fd).transpose()?;
        let our_stdout = our_stdout.map(pipe::Receiver::from_owned_fd).transpose()?;
        let our_stderr = our_stderr.map(pipe::Receiver::from_owned_fd).transpose()?;
        let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
        argv_ptrs.push(std::ptr::null());
        // For a file that is not a program the kernel knows (a script without `#!`), execvp's
        // fallback: `/bin/sh FILE ARGS`, FILE put in place by the child.
        let mut script_argv: Vec<*const libc::c_char> = vec![SH.as_ptr(), std::ptr::null()];
        script_argv.extend(argv_ptrs.iter().skip(1));
        let mut candidate_ptrs: Vec<*const libc::c_char> = candidates.iter().map(|c| c.as_ptr()).collect();
        candidate_ptrs.push(std::ptr::null());
        let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
        envp_ptrs.push(std::ptr::null());
        let failure = AtomicI32::new(0);
        let plan = Plan {
            candidates: candidate_ptrs.as_ptr(),
            argv: argv_ptrs.as_ptr(),
            script_argv: script_argv.as_mut_ptr(),
            envp: envp_ptrs.as_ptr(),
            cwd: cwd.as_ptr(),
            stdio: [stdin.as_raw_fd(), stdout.as_raw_fd(), stderr.as_raw_fd()],
            ids: self.ids,
            session: self.session,
            failure: &failure,
        };
        // A child that changes its ids makes the memory it shares non-dumpable (the kernel
        // does that to the memory of whatever changes credentials), and that memory is envd's:
        // its dumpability is put back once the child has gone on its way.
        let dumpable = rustix::process::dumpable_behavior();
        let cloned = clone_vfork(&plan);
        if let Ok(dumpable) = dumpable {
            let _ = rustix::process::set_dumpable_behavior(dumpable);
        }
        let pid = cloned?;
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
                // The PID is our unreaped child, so it names nothing else.
                if let Some(child) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(child, rustix::process::Signal::KILL);
                }
                reap(pid);
                return Err(err);
            }
        };
        Ok(Child {
            pid: pid.unsigned_abs(),
            pidfd: Some(pidfd),
            status: None,
            stdin: our_stdin,
            stdout: our_stdout,
            stderr: our_stderr,
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
        let Some(pidfd) = &self.pidfd else {
            return Err(io::Error::from_raw_os_error(libc::ECHILD));
        };
        let status = reaped(pidfd, pid).await?;
        self.status = Some(status);
        self.pidfd = None;
        Ok(status)
    }
}

/// Waits until `pid` (our child, not reaped before) has ended, then reaps it.
async fn reaped(pidfd: &AsyncFd<OwnedFd>, pid: libc::pid_t) -> io::Result<ExitStatus> {
    let pid = rustix::process::Pid::from_raw(pid).ok_or_else(|| io::Error::other("no child has PID 0"))?;
    loop {
        let mut ready = pidfd.readable().await?;
        match rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG) {
            Ok(None) => ready.clear_ready(),
            Ok(Some((_, status))) => return Ok(ExitStatus::from_raw(status.as_raw())),
            Err(rustix::io::Errno::INTR) => {}
            Err(err) => return Err(err.into()),
        }
    }
}

impl Drop for Child {
    /// A command dropped before it was reaped (its waiter cancelled) is reaped when it ends,
    /// by a task of its own, rather than left a zombie for the sandbox's life.
    fn drop(&mut self) {
        let (Some(pidfd), Ok(pid)) = (self.pidfd.take(), libc::pid_t::try_from(self.pid)) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let _ = reaped(&pidfd, pid).await;
        });
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
            let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
            match direction {
                Direction::In => (read, Some(write)),
                Direction::Out => (write, Some(read)),
            }
        }
    };
    if child.as_raw_fd() > 2 {
        return Ok((child, ours));
    }
    Ok((rustix::io::fcntl_dupfd_cloexec(&child, 3)?, ours))
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a NUL byte in a command's argument, environment or path",
        )
    })
}

/// A pidfd of `pid`, registered with the runtime: readable once the process has ended.
fn watch(pid: libc::pid_t) -> io::Result<AsyncFd<OwnedFd>> {
    let pid = rustix::process::Pid::from_raw(pid).ok_or_else(|| io::Error::other("no child has PID 0"))?;
    let fd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?;
    // SAFETY: the OwnedFd stays open, and the same, for as long as the AsyncFd owns it.
    unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(|e| io::Error::other(e.to_string()))
}

/// Reaps a child that has ended or will at once (it failed before exec, or was killed).
fn reap(pid: libc::pid_t) {
    let Some(pid) = rustix::process::Pid::from_raw(pid) else {
        return;
    };
    while let Err(rustix::io::Errno::INTR) = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty())
    {
    }
}

/// Everything the child needs, prepared by envd: pointers into memory that outlives the
/// child's use of it (the parent thread waits in `clone` until the child has exec'd or ended).
struct Plan<'a> {
    /// Null-terminated: the files to try, in order.
    candidates: *const *const libc::c_char,
    argv: *const *const libc::c_char,
    /// `/bin/sh`, a slot for the file, then the arguments: for a file that is not a program.
    script_argv: *mut *const libc::c_char,
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
    // SAFETY: as above: plain data, zero is a valid set.
    let mut before: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: both sets are live locals; these calls only write them and the thread's mask.
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

/// What every command's `oom_score_adj` is raised to. envd itself runs lower (the node starts
/// it at 300), so when a sandbox runs out of memory the kernel ends the user's processes
/// first and envd, which the node and the SDK reach the sandbox through, survives. Raising
/// needs no privilege. (Lowering does down to the floor the runtime could set: where the
/// node lacks CAP_SYS_RESOURCE that floor is 0, and a sandbox's root may put its own
/// processes below envd, at the risk of its own sandbox only.)
pub const COMMAND_OOM_SCORE_ADJ: &[u8] = b"900";
const OOM_SCORE_ADJ_PATH: &std::ffi::CStr = c"/proc/self/oom_score_adj";

/// `/bin/sh`, for files that are not programs.
const SH: &std::ffi::CStr = c"/bin/sh";

/// Tries each candidate as execvp does: a file missing, in a missing directory or not the
/// user's to run is passed over; a file the kernel cannot run is handed to `/bin/sh`. Returns
/// (only on failure) EACCES if some file was found but not runnable, else the last error.
///
/// # Safety
/// Only in the child of [`clone_vfork`], with its plan.
unsafe fn exec_first(plan: &Plan<'_>) -> i32 {
    let execve = |path: *const libc::c_char, argv: *const *const libc::c_char| {
        // SAFETY: prepared, null-terminated arrays of prepared strings.
        unsafe {
            sys(
                libc::SYS_execve,
                [path as libc::c_long, argv as libc::c_long, plan.envp as libc::c_long, 0],
            )
        }
        .err()
        .unwrap_or(libc::ENOEXEC)
    };
    let (mut last, mut denied) = (libc::ENOENT, false);
    let mut next = plan.candidates;
    // SAFETY: `candidates` is null-terminated; `script_argv` has its slot at 1.
    unsafe {
        while !(*next).is_null() {
            let candidate = *next;
            next = next.add(1);
            last = match execve(candidate, plan.argv) {
                libc::ENOEXEC => {
                    *plan.script_argv.add(1) = candidate;
                    return execve(SH.as_ptr(), plan.script_argv);
                }
                libc::EACCES => {
                    denied = true;
                    libc::EACCES
                }
                errno @ (libc::ENOENT
                | libc::ENOTDIR
                | libc::ESTALE
                | libc::ENODEV
                | libc::ETIMEDOUT
                | libc::ELOOP
                | libc::ENAMETOOLONG) => errno,
                errno => return errno,
            };
        }
    }
    if denied {
        libc::EACCES
    } else {
        last
    }
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
        // SAFETY: as the comment above the closure says.
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
            let adj = sys(
                libc::SYS_openat,
                [
                    libc::AT_FDCWD.into(),
                    OOM_SCORE_ADJ_PATH.as_ptr() as libc::c_long,
                    (libc::O_WRONLY | libc::O_CLOEXEC).into(),
                    0,
                ],
            )?;
            let written = sys(
                libc::SYS_write,
                [
                    adj,
                    COMMAND_OOM_SCORE_ADJ.as_ptr() as libc::c_long,
                    COMMAND_OOM_SCORE_ADJ.len() as libc::c_long,
                    0,
                ],
            );
            let _ = sys(libc::SYS_close, [adj, 0, 0, 0]);
            written?;
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
            Err(exec_first(plan))
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

    /// One test at a time: a child that changes its ids makes this whole process (every test
    /// shares its memory) non-dumpable until its spawn puts that back, which another test's
    /// reading of it must not fall into.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
        let _one = ONE_AT_A_TIME.lock().await;
        let mut cmd = script("id -u; id -g; id -G; pwd; echo \"$GREETING\"; cat; exit 3");
        cmd.env("GREETING", "hello").ids(65534, 65534).current_dir("/tmp");
        let (out, code) = sh(&mut cmd, Stdio::Piped, b"from stdin").await;
        assert_eq!(out, "65534\n65534\n65534\n/tmp\nhello\nfrom stdin");
        assert_eq!(code, Some(3));
    }

    #[tokio::test]
    async fn the_command_leads_its_own_group_with_default_signals_and_nothing_blocked() {
        let _one = ONE_AT_A_TIME.lock().await;
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
    async fn programs_are_looked_up_as_a_shell_does_as_the_user_and_envd_stays_dumpable() {
        let _one = ONE_AT_A_TIME.lock().await;
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("envd-spawn-path-{}", std::process::id()));
        let (mine, theirs) = (dir.join("root-only"), dir.join("anyone"));
        for (folder, mode, text) in [
            (&mine, 0o700, "echo root only"),
            (&theirs, 0o755, "echo anyone: \"$1\""),
        ] {
            std::fs::create_dir_all(folder).unwrap();
            std::fs::set_permissions(folder, std::fs::Permissions::from_mode(0o755)).unwrap();
            // No `#!`: the kernel cannot run it, /bin/sh does.
            std::fs::write(folder.join("greet"), text).unwrap();
            std::fs::set_permissions(folder.join("greet"), std::fs::Permissions::from_mode(mode)).unwrap();
        }
        let path = format!("{}:{}", mine.display(), theirs.display());
        let mut cmd = Command::new("greet");
        cmd.args(["there"]).env("PATH", &path).ids(65534, 65534);
        let (out, code) = sh(&mut cmd, Stdio::Null, b"").await;
        let dumpable = rustix::process::dumpable_behavior().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            (out.as_str(), code),
            ("anyone: there\n", Some(0)),
            "the one nobody may run is passed over"
        );
        assert_eq!(
            dumpable,
            rustix::process::DumpableBehavior::Dumpable,
            "a child's change of ids made envd non-dumpable"
        );
    }

    #[tokio::test]
    async fn a_program_that_cannot_start_is_an_error_and_leaves_no_child() {
        let _one = ONE_AT_A_TIME.lock().await;
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
