//! `helper`: the node's pre-forked launcher. Not a runc command; only the node starts it.
//!
//! Every container's `run` used to be a process of its own: the node spawned the runtime's
//! binary, and the kernel executed, relocated and faulted it in, once per create. The helper
//! is that process, started once. The node starts `jail --root ROOT helper` with one end of a
//! socket pair as fd 3 and sends it one message per container. For each, the helper forks (it
//! is small and single-threaded, so the fork copies little) and the child runs `run --detach`
//! as the command line would, in a process that is what `run` relies on an exec'd one being:
//! single-threaded, with 0–2 and the passed descriptors where the command line puts them,
//! nothing else of the helper's left open, and the helper's mount namespace (the host's, or
//! with `--private-below` one of the helper's own: `run` may leave it for one of its own, and
//! only the child does).
//!
//! The protocol (`SOCK_SEQPACKET`, so a request is one message with its descriptors):
//! - the request, on the control socket: `ID \0 BUNDLE \0 PID-FILE \0`, with `SCM_RIGHTS`
//!   carrying the request's reply socket, the output (the child's stdout and stderr: the
//!   container's log) and then the descriptors the container gets as 3, 4, ...; a fourth
//!   field `root-mount \0` says the first descriptor after the output is the container's
//!   root, a detached mount the run attaches (a helper started with `--private-below` keeps a
//!   mount table of its own without the node's sandboxes: see `jail::view`);
//! - the answer, on that reply socket, once the child has exited: its wait status (4 bytes,
//!   little-endian), which the caller reads as the exit status of a runtime process.
//!
//! The helper answers after reaping the child, not the child before exiting, for what a
//! caller of a runtime process relies on: when it hears, the container's init has already
//! been handed to the nearest subreaper (the node), which can wait for it. The child holds
//! the reply socket until it exits, so if the helper dies first, the caller's end of file
//! still comes only once the run is over: never while it may yet create a container.
//!
//! A run that is still going after the helper's deadline (`helper --run-deadline-ms`, 60 s
//! unless the node says otherwise) is stuck: its bundle on a file system that hangs, a kernel
//! lock held elsewhere. The helper kills it, says so in its output, and answers once it has
//! ended, as any other run: its caller (holding a sandbox's turn and a thread) is not kept
//! for ever, and still never hears before the run can no longer create a container. A run
//! stuck in an uninterruptible wait dies when that wait returns.
//!
//! Only the holder of the socket pair's other end can send (it has no path and no name). The
//! helper ends when that end closes (the node has gone); runs in flight finish and answer.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};

use crate::cli::RunArgs;
use crate::state::StateDir;
use crate::sys::{self, Errno};
use crate::Logger;

/// The helper's end of the control socket.
pub const CONTROL_FD: RawFd = 3;

/// The most descriptors a request passes on to its container.
pub const MAX_PASSED: usize = 8;

/// Descriptors in a request besides the passed ones: the reply socket and the output.
const OWN_FDS: usize = 2;

/// Room for a request's fields (paths under the node's run directory: short).
const MAX_REQUEST: usize = 3 * 4096;

/// Why the helper, or one request to it, failed.
#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    #[error("helper: fd {CONTROL_FD} is not a socket; the node starts this command, with its control socket there")]
    NoControlSocket,
    #[error("helper: {what}: {errno}")]
    Sys { what: &'static str, errno: Errno },
    #[error("helper: {0}")]
    Request(&'static str),
    #[error("helper: the request's {0} holds a NUL byte")]
    Nul(&'static str),
}

fn sys_err(what: &'static str) -> impl Fn(rustix::io::Errno) -> HelperError {
    move |errno| HelperError::Sys {
        what,
        errno: errno.into(),
    }
}

/// One `run --detach` to do: what the command line would name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub id: String,
    pub bundle: PathBuf,
    pub pid_file: PathBuf,
    /// The container's root comes as a detached mount, the first descriptor after the output,
    /// to attach at the bundle's root path (see `jail::view`): encoded as a fourth field.
    pub root_mount: bool,
}

/// The fourth field of a request whose root comes as a mount.
const ROOT_MOUNT: &[u8] = b"root-mount";

impl Request {
    fn encode(&self) -> Result<Vec<u8>, HelperError> {
        let mut bytes = Vec::new();
        for (name, field) in [
            ("ID", self.id.as_bytes()),
            ("bundle", self.bundle.as_os_str().as_bytes()),
            ("pid file", self.pid_file.as_os_str().as_bytes()),
        ] {
            if field.contains(&0) {
                return Err(HelperError::Nul(name));
            }
            bytes.extend_from_slice(field);
            bytes.push(0);
        }
        if self.root_mount {
            bytes.extend_from_slice(ROOT_MOUNT);
            bytes.push(0);
        }
        if bytes.len() > MAX_REQUEST {
            return Err(HelperError::Request("request too long"));
        }
        Ok(bytes)
    }

    fn decode(bytes: &[u8]) -> Result<Self, HelperError> {
        let fields: Vec<&[u8]> = bytes
            .strip_suffix(&[0])
            .ok_or(HelperError::Request("request not NUL-terminated"))?
            .split(|b| *b == 0)
            .collect();
        let (id, bundle, pid_file, root_mount) = match fields[..] {
            [id, bundle, pid_file] => (id, bundle, pid_file, false),
            [id, bundle, pid_file, ROOT_MOUNT] => (id, bundle, pid_file, true),
            _ => {
                return Err(HelperError::Request(
                    "request without its three fields (and root-mount)",
                ))
            }
        };
        let id = std::str::from_utf8(id).map_err(|_| HelperError::Request("ID not UTF-8"))?;
        let path = |b: &[u8]| PathBuf::from(std::ffi::OsStr::from_bytes(b));
        Ok(Self {
            id: id.to_string(),
            bundle: path(bundle),
            pid_file: path(pid_file),
            root_mount,
        })
    }
}

/// Sends `request` to the helper behind `control` and waits for its answer: the wait status
/// of the process that ran it (`ExitStatus::from_raw` reads it). `output` becomes the run's
/// stdout and stderr, `passed` its descriptors 3, 4, ...; `root`, a detached mount, the
/// container's root (set [`Request::root_mount`] with it).
///
/// An error of kind `BrokenPipe` means the helper was gone before it got the request (start
/// another and send again); `UnexpectedEof`, that it went while the run was in flight. That
/// run has ended by then (its process holds the reply socket until it exits), but whether it
/// left a container is unknown: ask the runtime's state, as after any failed run.
pub fn send(
    control: BorrowedFd<'_>,
    request: &Request,
    output: BorrowedFd<'_>,
    root: Option<BorrowedFd<'_>>,
    passed: &[BorrowedFd<'_>],
) -> std::io::Result<i32> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    if request.root_mount != root.is_some() {
        return Err(std::io::Error::other(
            "a root mount without its flag, or the flag without one",
        ));
    }
    if passed.len() > MAX_PASSED {
        return Err(std::io::Error::other(format!(
            "{} descriptors to pass; at most {MAX_PASSED}",
            passed.len()
        )));
    }
    let bytes = request.encode().map_err(std::io::Error::other)?;
    let (ours, theirs) =
        rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
    let mut fds = vec![theirs.as_fd(), output];
    fds.extend(root);
    fds.extend_from_slice(passed);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(OWN_FDS + 1 + MAX_PASSED))];
    let mut ancillary = SendAncillaryBuffer::new(&mut space);
    if !ancillary.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("descriptors do not fit the message"));
    }
    loop {
        match rustix::net::sendmsg(control, &[IoSlice::new(&bytes)], &mut ancillary, SendFlags::NOSIGNAL) {
            Ok(_) => break,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::PIPE | rustix::io::Errno::CONNRESET | rustix::io::Errno::NOTCONN) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    "the runtime's helper is gone",
                ))
            }
            Err(e) => return Err(e.into()),
        }
    }
    // Only the helper holds the other end now: its end of file is an answer too.
    drop(theirs);
    let mut status = [0u8; 4];
    loop {
        match rustix::io::read(&ours, &mut status) {
            Ok(4) => return Ok(i32::from_le_bytes(status)),
            Ok(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the runtime's helper ended before it answered",
                ))
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// A run in flight: the child doing it, and where its answer goes.
struct Child {
    id: String,
    pid: rustix::process::Pid,
    /// Readable once the child has exited; `None` where the kernel has no pidfds (the
    /// helper then waits for each child before it reads the next request, and cannot keep a
    /// deadline).
    pidfd: Option<OwnedFd>,
    reply: OwnedFd,
    /// The run's output, where a kill for its deadline is told.
    output: OwnedFd,
    /// Killed at this instant unless it has ended; `None` once killed.
    deadline: Option<Instant>,
}

impl Child {
    /// Kills the run if it is past its deadline (once), and says why in its output.
    fn enforce(&mut self, now: Instant, limit: Duration) {
        if self.deadline.is_none_or(|at| now < at) {
            return;
        }
        self.deadline = None;
        let _ = rustix::process::kill_process(self.pid, rustix::process::Signal::KILL);
        let line = format!("run {}: still going after {limit:?}; killed\n", self.id);
        let _ = sys::write_all(self.output.as_raw_fd(), line.as_bytes());
        Logger::stderr().error(line.trim_end());
    }
}

/// A request as it arrived: what to run and its descriptors (reply, output, passed...).
struct Received {
    request: Result<Request, HelperError>,
    fds: Vec<OwnedFd>,
}

/// Reads one request; `None` at end of file (the node has gone).
fn receive(control: BorrowedFd<'_>) -> Result<Option<Received>, HelperError> {
    let mut bytes = vec![0u8; MAX_REQUEST];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(OWN_FDS + 1 + MAX_PASSED))];
    let mut ancillary = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match rustix::net::recvmsg(
            control,
            &mut [IoSliceMut::new(&mut bytes)],
            &mut ancillary,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(rustix::io::Errno::INTR) => {}
            other => break other.map_err(sys_err("receive a request"))?,
        }
    };
    let mut fds = Vec::new();
    for message in ancillary.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    if msg.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    let request = if msg.flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC) {
        Err(HelperError::Request("request or its descriptors cut short"))
    } else if fds.len() < OWN_FDS {
        Err(HelperError::Request("request without its reply socket and output"))
    } else {
        Request::decode(&bytes[..msg.bytes]).and_then(|r| {
            if r.root_mount && fds.len() < OWN_FDS + 1 {
                return Err(HelperError::Request("request for a root mount without one"));
            }
            Ok(r)
        })
    };
    Ok(Some(Received { request, fds }))
}

/// Answers a run with wait status `status` (the caller may have given up: nothing to do then).
fn answer(reply: &OwnedFd, status: i32) {
    let _ = rustix::net::send(reply, &status.to_le_bytes(), SendFlags::NOSIGNAL);
}

/// The wait status of a process that called `exit(code)`.
fn exited(code: i32) -> i32 {
    (code & 0xff) << 8
}

/// Serves the node on [`CONTROL_FD`] until it closes its end, running each request's
/// container under `dir` and killing a run still going after `deadline`; from a private mount
/// namespace without the mounts below `private_below` when any is given (see `jail::view`).
pub fn serve(dir: &StateDir, deadline: Duration, private_below: &[PathBuf]) -> Result<(), HelperError> {
    let stat = rustix::fs::fstat(
        // SAFETY: only probed; a descriptor that is not open fails fstat with EBADF.
        unsafe { BorrowedFd::borrow_raw(CONTROL_FD) },
    );
    if !stat.is_ok_and(|s| rustix::fs::FileType::from_raw_mode(s.st_mode) == rustix::fs::FileType::Socket) {
        return Err(HelperError::NoControlSocket);
    }
    // SAFETY: fd 3 is an open socket (checked above) that the node handed to this process alone.
    let control = unsafe { OwnedFd::from_raw_fd(CONTROL_FD) };
    // Whatever else the node's process left without close-on-exec (its test harness's pipes,
    // a library's descriptor): a process that lives as long as the node must not keep them
    // open (a listening socket held here would outlive a node that exits), nor fork them into
    // every run.
    // SAFETY: closes descriptors above the control socket, which nothing in this process owns.
    sys::check(unsafe { libc::close_range(CONTROL_FD as u32 + 1, u32::MAX, 0) }).map_err(|errno| HelperError::Sys {
        what: "close inherited descriptors",
        errno,
    })?;
    if !private_below.is_empty() {
        // Without it the helper still serves, each container copied from the node's whole
        // table as before; said once, here, rather than by a helper that dies at every start.
        if let Err(e) = crate::view::private_view(private_below) {
            Logger::stderr().warn(&format!("helper: serving from the node's mount table: {e}"));
        }
    }
    // Creates ahead of the node's other work; each container is set back (see `priority`).
    if let Err(e) = crate::priority::raise_for_creates() {
        Logger::stderr().warn(&format!("helper: creates run at the node's priority: {e}"));
    }
    let mut running: Vec<Child> = Vec::new();
    let mut open = true;
    while open || !running.is_empty() {
        let readable = match wait_for_work(&control, open, &running, Instant::now()) {
            Ok(readable) => readable,
            Err(e) => {
                // Not one more request; every run in flight still answered, the slow way.
                for child in running.drain(..) {
                    answer(&child.reply, reap(child.pid));
                }
                return Err(e);
            }
        };
        let now = Instant::now();
        for child in &mut running {
            child.enforce(now, deadline);
        }
        running.retain(|child| {
            let done = child
                .pidfd
                .as_ref()
                .is_some_and(|fd| readable.contains(&fd.as_raw_fd()));
            if done {
                answer(&child.reply, reap(child.pid));
            }
            !done
        });
        if !open || !readable.contains(&control.as_raw_fd()) {
            continue;
        }
        match receive(control.as_fd()) {
            Ok(None) => open = false,
            // No more requests; the runs in flight are still answered.
            Err(e) => {
                Logger::stderr().error(&e.to_string());
                open = false;
            }
            Ok(Some(received)) => {
                if let Some(child) = start(dir, &control, &running, received, Instant::now() + deadline) {
                    match child.pidfd {
                        Some(_) => running.push(child),
                        None => answer(&child.reply, reap(child.pid)),
                    }
                }
            }
        }
    }
    Ok(())
}

/// Blocks until the control socket has a request (while `open`), a child has exited or a
/// child's deadline has come; the descriptors that are ready.
fn wait_for_work(control: &OwnedFd, open: bool, running: &[Child], now: Instant) -> Result<Vec<RawFd>, HelperError> {
    let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(running.len() + 1);
    if open {
        fds.push(PollFd::new(control, PollFlags::IN));
    }
    fds.extend(
        running
            .iter()
            .filter_map(|c| c.pidfd.as_ref())
            .map(|fd| PollFd::new(fd, PollFlags::IN)),
    );
    let next = running.iter().filter_map(|c| c.deadline).min();
    let timeout = next.map(|at| {
        let left = at.saturating_duration_since(now);
        rustix::time::Timespec {
            tv_sec: left.as_secs().try_into().unwrap_or(i64::MAX),
            tv_nsec: left.subsec_nanos().into(),
        }
    });
    loop {
        match rustix::event::poll(&mut fds, timeout.as_ref()) {
            Err(rustix::io::Errno::INTR) => {}
            other => {
                other.map_err(sys_err("poll"))?;
                break;
            }
        }
    }
    Ok(fds
        .iter()
        .filter(|fd| !fd.revents().is_empty())
        .map(|fd| fd.as_fd().as_raw_fd())
        .collect())
}

/// Reaps child `pid` (it has exited, or is about to); its wait status.
fn reap(pid: rustix::process::Pid) -> i32 {
    loop {
        match rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty()) {
            Ok(Some((_, status))) => return status.as_raw(),
            Err(rustix::io::Errno::INTR) => {}
            // Not our child any more (cannot happen: nobody else waits for it): a failure.
            _ => return exited(1),
        }
    }
}

/// Forks the child for one request; `None` when the request was answered at once (malformed,
/// or the fork failed).
fn start(dir: &StateDir, control: &OwnedFd, running: &[Child], received: Received, deadline: Instant) -> Option<Child> {
    let Received { request, mut fds } = received;
    let log = Logger::stderr();
    let request = match request {
        Ok(r) => r,
        Err(e) => {
            // Told to the node's log; and to the caller, if it sent a reply socket.
            log.error(&e.to_string());
            if let Some(reply) = fds.first() {
                answer(reply, exited(1));
            }
            return None;
        }
    };
    let mut passed = fds.split_off(OWN_FDS);
    let output = fds.pop()?;
    let reply = fds.pop()?;
    // Received close-on-exec, and the child's alone to use: the helper keeps no copy.
    let root = request.root_mount.then(|| passed.remove(0));
    if passed.len() > MAX_PASSED {
        let line = format!(
            "helper: a request with {} descriptors to pass; at most {MAX_PASSED}\n",
            passed.len()
        );
        let _ = sys::write_all(output.as_raw_fd(), line.as_bytes());
        log.error(line.trim_end());
        answer(&reply, exited(1));
        return None;
    }
    // The helper's own copy, to tell the run's log why it was killed (close-on-exec, and
    // closed in every later run's child with the rest of the helper's).
    let told = match rustix::io::fcntl_dupfd_cloexec(&output, 0) {
        Ok(fd) => fd,
        Err(errno) => {
            let line = format!("helper: keep the output: {errno}\n");
            let _ = sys::write_all(output.as_raw_fd(), line.as_bytes());
            answer(&reply, exited(1));
            return None;
        }
    };
    // SAFETY: the helper is single-threaded (it never starts a thread), so the child is a
    // whole copy of it and may allocate, as the runtime's own process does.
    match unsafe { libc::fork() } {
        -1 => {
            let errno = Errno::last();
            let line = format!("helper: fork: {errno}\n");
            let _ = sys::write_all(output.as_raw_fd(), line.as_bytes());
            answer(&reply, exited(1));
            None
        }
        0 => {
            // The child. It keeps its copy of the reply socket open until it exits, so the
            // caller's end of file (should the helper die first) also means this run has
            // ended: a caller never takes a run for failed while it may still create its
            // container. Nothing else of the helper's stays open in it (another run's reply
            // socket, or the control socket, would keep those from closing).
            let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                match place_descriptors(control, running, output, passed, reply, root) {
                    Ok((preserve_fds, _reply, root)) => run(dir, &log, request, preserve_fds, root),
                    Err(e) => {
                        log.error(&e.to_string());
                        1
                    }
                }
            }))
            .unwrap_or(101);
            sys::exit_now(code)
        }
        pid => {
            let pid = rustix::process::Pid::from_raw(pid)?;
            // The child is ours and not reaped: its PID names it until we wait.
            let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok();
            Some(Child {
                id: request.id,
                pid,
                pidfd,
                reply,
                output: told,
                deadline: Some(deadline),
            })
        }
    }
}

/// In the child: closes what belongs to the helper, and puts `/dev/null` at 0, `output` at 1
/// and 2 and `passed` at 3, 4, ... as the command line's caller would have; how many passed,
/// and `reply` and `root` renumbered above them (close-on-exec: the container's init, a clone
/// of this process, drops them at its `execve`; the run closes `root` before it clones).
fn place_descriptors(
    control: &OwnedFd,
    running: &[Child],
    output: OwnedFd,
    passed: Vec<OwnedFd>,
    reply: OwnedFd,
    root: Option<OwnedFd>,
) -> Result<(u32, OwnedFd, Option<OwnedFd>), HelperError> {
    let close = |fd: RawFd| {
        // SAFETY: the child's copy of a descriptor the helper owns; the helper's copy is its
        // own, and the child never uses this one again.
        unsafe { libc::close(fd) };
    };
    close(control.as_raw_fd());
    for child in running {
        close(child.reply.as_raw_fd());
        close(child.output.as_raw_fd());
        if let Some(fd) = &child.pidfd {
            close(fd.as_raw_fd());
        }
    }
    let renumber = |errno| HelperError::Sys {
        what: "renumber a descriptor",
        errno,
    };
    // Above every target first, so placing one never overwrites another still to be placed.
    let above = CONTROL_FD + MAX_PASSED as RawFd + 1;
    let reply = sys::move_above(reply, above).map_err(renumber)?;
    let root = root
        .map(|fd| sys::move_above(fd, above))
        .transpose()
        .map_err(renumber)?;
    let null = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(sys_err("open /dev/null"))?;
    let second = rustix::io::fcntl_dupfd_cloexec(&output, above).map_err(sys_err("duplicate the output"))?;
    let mut sources = vec![null, second, output];
    sources.extend(passed);
    let sources = sources
        .into_iter()
        .map(|fd| sys::move_above(fd, above).map_err(renumber))
        .collect::<Result<Vec<_>, _>>()?;
    for (target, fd) in sources.iter().enumerate() {
        // dup2 leaves the copy without close-on-exec: the run inherits it, as from a spawn.
        // SAFETY: both are valid descriptor numbers; the target is ours to replace.
        sys::check(unsafe { libc::dup2(fd.as_raw_fd(), target as RawFd) })
            .map_err(|errno| HelperError::Sys { what: "dup2", errno })?;
    }
    let preserve_fds = u32::try_from(sources.len() - 3).unwrap_or(0);
    // The copies above: the run must not hold a passed descriptor twice (a pipe's writer
    // kept open here would keep its reader waiting for end of file).
    drop(sources);
    Ok((preserve_fds, reply, root))
}

/// In the child: `run --detach` as the command line runs it; the exit code.
fn run(dir: &StateDir, log: &Logger, request: Request, preserve_fds: u32, root: Option<OwnedFd>) -> i32 {
    let args = RunArgs {
        detach: true,
        bundle: request.bundle,
        pid_file: Some(request.pid_file),
        preserve_fds,
        no_pivot: false,
        id: request.id,
    };
    match crate::container::run_with_root(dir, log, &args, root) {
        Ok(()) => 0,
        Err(e) => {
            log.error(&e.to_string());
            1
        }
    }
}
