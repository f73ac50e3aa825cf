//! The helper's protocol, from the node's side and from a careless or hostile one: every
//! request answered on its own socket with its own run's status, however many are in flight;
//! malformed requests answered and survived; the helper gone when the node is. Runs here fail
//! before they create anything (their bundles do not exist), so these need no root; the
//! containers a helper starts are checked in `containers.rs`.

use std::io::{IoSlice, Read as _, Seek as _};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::os::unix::fs::OpenOptionsExt as _;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use jail::helper::{self, Request};
use rustix::net::{AddressFamily, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType};

const JAIL: &str = env!("CARGO_BIN_EXE_sandboxsched-jail");

fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap()
}

struct Helper {
    control: Option<OwnedFd>,
    process: Option<std::process::Child>,
    _root: tempfile::TempDir,
}

impl Helper {
    fn start() -> Helper {
        Self::start_inheriting(None, &[])
    }

    /// A helper started as a careless parent would: `extra` left open (not close-on-exec) as
    /// its fd 7; `args` after `helper`.
    fn start_inheriting(extra: Option<&std::fs::File>, args: &[&str]) -> Helper {
        let root = tempfile::tempdir().unwrap();
        let (ours, theirs) = seqpacket_pair();
        let mut cmd = Command::new(JAIL);
        cmd.arg("--root")
            .arg(root.path())
            .arg("helper")
            .args(args)
            .stdin(Stdio::null());
        let raw = theirs.as_raw_fd();
        let extra = extra.map(|f| f.as_raw_fd());
        // SAFETY: dup2 is async-signal-safe; runs in the forked child before exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(raw, 3) < 0 || extra.is_some_and(|fd| libc::dup2(fd, 7) < 0) {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let process = cmd.spawn().unwrap();
        Helper {
            control: Some(ours),
            process: Some(process),
            _root: root,
        }
    }

    fn control(&self) -> std::os::fd::BorrowedFd<'_> {
        self.control.as_ref().unwrap().as_fd()
    }

    /// A run of a bundle that does not exist: its status and what it wrote.
    fn run_missing(&self, name: &str) -> (i32, String) {
        let mut output = tempfile::tempfile().unwrap();
        let request = Request {
            id: name.to_string(),
            bundle: PathBuf::from(format!("/nonexistent/{name}")),
            pid_file: PathBuf::from(format!("/nonexistent/{name}.pid")),
            root_mount: false,
        };
        let status = helper::send(self.control(), &request, output.as_fd(), None, &[]).unwrap();
        (status, read_all(&mut output))
    }

    /// Waits (bounded) for the helper to exit: its exit code.
    fn exits(mut self) -> Option<i32> {
        let (tx, rx) = mpsc::channel();
        let mut process = self.process.take().unwrap();
        std::thread::spawn(move || {
            let _ = tx.send(process.wait().map(|s| s.code()));
        });
        let code = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the helper did not exit within 10 s");
        code.unwrap()
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if let Some(mut process) = self.process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
    }
}

fn read_all(file: &mut std::fs::File) -> String {
    let mut said = String::new();
    file.rewind().unwrap();
    file.read_to_string(&mut said).unwrap();
    said
}

/// The wait status of `exit(1)`.
const EXIT_1: i32 = 1 << 8;

#[test]
fn every_request_is_answered_on_its_own_socket_with_its_own_run_s_status() {
    let helper = Helper::start();
    let answers: Vec<(String, i32, String)> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..24)
            .map(|i| {
                let helper = &helper;
                s.spawn(move || {
                    let name = format!("bundle-{i}");
                    let (status, said) = helper.run_missing(&name);
                    (name, status, said)
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for (name, status, said) in answers {
        assert_eq!(status, EXIT_1, "{name}: {said}");
        let line = said.trim();
        assert!(
            line.starts_with(&format!("bundle /nonexistent/{name}: ")) && line.lines().count() == 1,
            "{name}'s own error, alone, in its own output: {said:?}"
        );
    }
}

/// Sends `bytes` with `fds` as a request, bypassing `helper::send`'s checks.
fn send_raw(control: std::os::fd::BorrowedFd<'_>, bytes: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
    let mut ancillary = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(ancillary.push(SendAncillaryMessage::ScmRights(fds)));
    }
    rustix::net::sendmsg(control, &[IoSlice::new(bytes)], &mut ancillary, SendFlags::empty()).unwrap();
}

/// What comes back on a reply socket: the status, or `None` at end of file.
fn answer(reply: &OwnedFd) -> Option<i32> {
    let mut status = [0u8; 4];
    match rustix::io::read(reply, &mut status).unwrap() {
        4 => Some(i32::from_le_bytes(status)),
        _ => None,
    }
}

#[test]
fn malformed_requests_are_answered_and_the_helper_serves_on() {
    let helper = Helper::start();
    let output = tempfile::tempfile().unwrap();
    // Fields without their NULs; one field too few; bytes that are no ID: each answered with a
    // failure on its reply socket, nothing run.
    for bytes in [&b"no-terminator"[..], b"id\0/bundle\0", b"\xff\xfe\0/b\0/p\0"] {
        let (ours, theirs) = seqpacket_pair();
        send_raw(helper.control(), bytes, &[theirs.as_fd(), output.as_fd()]);
        drop(theirs);
        assert_eq!(answer(&ours), Some(EXIT_1), "{bytes:?}");
    }
    // A request without its output: answered too; one without any descriptor: nobody to
    // answer, and no harm.
    let (ours, theirs) = seqpacket_pair();
    send_raw(helper.control(), b"id\0/b\0/p\0", &[theirs.as_fd()]);
    drop(theirs);
    assert_eq!(answer(&ours), Some(EXIT_1));
    send_raw(helper.control(), b"id\0/b\0/p\0", &[]);
    // More descriptors than a request may carry: cut short by the kernel, refused.
    let (ours, theirs) = seqpacket_pair();
    let many: Vec<_> = std::iter::repeat_n(output.as_fd(), 14).collect();
    let mut fds = vec![theirs.as_fd()];
    fds.extend(many);
    send_raw(helper.control(), b"id\0/b\0/p\0", &fds);
    drop(theirs);
    assert_eq!(answer(&ours), Some(EXIT_1));

    let (status, said) = helper.run_missing("after");
    assert_eq!(status, EXIT_1);
    assert!(said.starts_with("bundle /nonexistent/after: "), "{said}");
    // What the caller's library refuses before sending.
    let nul = Request {
        id: "a\0b".into(),
        bundle: "/b".into(),
        pid_file: "/p".into(),
        root_mount: false,
    };
    assert!(helper::send(helper.control(), &nul, output.as_fd(), None, &[]).is_err());
}

#[test]
fn the_helper_ends_when_the_node_closes_its_end() {
    let mut helper = Helper::start();
    let (status, _) = helper.run_missing("one");
    assert_eq!(status, EXIT_1);
    drop(helper.control.take());
    assert_eq!(helper.exits(), Some(0));
}

#[test]
fn a_request_to_a_helper_that_is_gone_says_so() {
    let mut helper = Helper::start();
    let (ours, theirs) = seqpacket_pair();
    let control = helper.control.replace(ours).unwrap();
    drop(theirs);
    let output = tempfile::tempfile().unwrap();
    let request = Request {
        id: "x".into(),
        bundle: Path::new("/b").into(),
        pid_file: Path::new("/p").into(),
        root_mount: false,
    };
    let err = helper::send(helper.control(), &request, output.as_fd(), None, &[]).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe, "{err}");
    drop(control);
    assert_eq!(helper.exits(), Some(0));
}

/// A run still going at the helper's deadline (its bundle's `config.json` a FIFO nobody
/// writes, as a file system that hangs would leave it) is killed, told so in its output and
/// answered once it has ended; the helper serves other runs meanwhile and after.
#[test]
fn a_run_past_its_deadline_is_killed_and_answered() {
    let helper = Helper::start_inheriting(None, &["--run-deadline-ms", "300"]);
    let bundle = tempfile::tempdir().unwrap();
    let fifo = bundle.path().join("config.json");
    let path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let control = helper.control.as_ref().unwrap().try_clone().unwrap();
    let request = Request {
        id: "stuck".into(),
        bundle: bundle.path().to_path_buf(),
        pid_file: bundle.path().join("pid"),
        root_mount: false,
    };
    let (tx, rx) = mpsc::channel();
    let started = std::time::Instant::now();
    std::thread::spawn(move || {
        let mut output = tempfile::tempfile().unwrap();
        let status = helper::send(control.as_fd(), &request, output.as_fd(), None, &[]);
        let _ = tx.send((status, read_all(&mut output)));
    });
    assert_eq!(helper.run_missing("meanwhile").0, EXIT_1);
    let (status, said) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("a stuck run was never answered");
    let waited = started.elapsed();
    let status = std::process::ExitStatus::from_raw(status.unwrap());
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}: {said}");
    assert!(said.contains("run stuck: still going after 300ms; killed"), "{said:?}");
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert_eq!(helper.run_missing("after").0, EXIT_1);
}

#[test]
fn the_helper_refuses_to_start_without_its_control_socket() {
    let root = tempfile::tempdir().unwrap();
    let out = Command::new(JAIL)
        .arg("--root")
        .arg(root.path())
        .arg("helper")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("fd 3 is not a socket"), "{said}");
    // And `--help` does not offer it to people.
    let help = Command::new(JAIL).arg("--help").output().unwrap();
    assert!(!String::from_utf8_lossy(&help.stdout).contains("helper"));
}

#[test]
fn the_helper_keeps_no_descriptor_it_inherited() {
    let stray = tempfile::tempfile().unwrap();
    let helper = Helper::start_inheriting(Some(&stray), &[]);
    // Once it has served a request, it is past its start.
    let (status, _) = helper.run_missing("one");
    assert_eq!(status, EXIT_1);
    let pid = helper.process.as_ref().unwrap().id();
    let open_fds = || {
        let mut fds: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
            .collect();
        fds.sort();
        fds
    };
    // The inherited file, told by what it is rather than its number (the helper's own
    // descriptors for a run may take any free number, 7 too).
    let stray_id = {
        use std::os::unix::fs::MetadataExt as _;
        let m = stray.metadata().unwrap();
        (m.dev(), m.ino())
    };
    let is_stray = |fd: i32| {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(format!("/proc/{pid}/fd/{fd}")).is_ok_and(|m| (m.dev(), m.ino()) == stray_id)
    };
    // The helper answers a run before it closes that run's reply socket, pidfd and its copy of
    // the run's output (they are dropped with the run once answered), so those may still be
    // open when the answer arrives; they go by themselves. The inherited file must never be
    // seen at all.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let fds = open_fds();
        assert!(
            !fds.iter().any(|fd| is_stray(*fd)),
            "the file left open to it (as fd 7) is still open in it: {fds:?}"
        );
        if fds == [0, 1, 2, 3] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "stdio and the control socket only, once its run's descriptors are closed: {fds:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A request's caller hears of a helper that died during its run only once that run is over:
/// the run's process holds the reply socket until it exits, so "failed" never means "may
/// still create a container". The run here blocks reading its `config.json`, a FIFO.
#[test]
fn a_run_in_flight_when_the_helper_dies_is_over_before_its_caller_hears() {
    let mut helper = Helper::start();
    let bundle = tempfile::tempdir().unwrap();
    let fifo = bundle.path().join("config.json");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let control = helper.control.take().unwrap();
    let request = Request {
        id: "blocked".into(),
        bundle: bundle.path().to_path_buf(),
        pid_file: bundle.path().join("pid"),
        root_mount: false,
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let output = tempfile::tempfile().unwrap();
        let _ = tx.send(helper::send(control.as_fd(), &request, output.as_fd(), None, &[]));
    });
    // The run is reading the FIFO once a writer can open it without blocking.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let writer = loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
        {
            Ok(w) => break w,
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("the run never opened its config.json: {e}"),
        }
    };
    let mut process = helper.process.take().unwrap();
    process.kill().unwrap();
    process.wait().unwrap();
    assert!(
        rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "the caller heard while the run was still going"
    );
    // The run reads something that is no spec, fails and exits: now the caller hears.
    use std::io::Write as _;
    (&writer).write_all(b"not a spec").unwrap();
    drop(writer);
    let answer = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("no answer after the run ended");
    assert_eq!(answer.unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
}
