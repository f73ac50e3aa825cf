//! The jail's `run` without a runtime process per container.
//!
//! A runtime process per `run` costs a spawn, an `exec` of the runtime's binary, the dynamic
//! loader and the faults of a fresh address space, on every create. The node instead starts
//! the jail once as its helper (`jail --root ROOT helper`, see `jail::helper`), keeps one end
//! of a socket pair to it, and sends it each `run`; the helper forks a child of its own small
//! self for each. What the container gets is what the command line gave it: the same
//! descriptors, the same checks, the same process to clone it from.
//!
//! The helper is started on the first `run` and again on the first `run` after it is found
//! gone (killed, or crashed): a request it never received is sent once more to the new one.
//! It ends by itself when the node closes its end (the node exited or dropped the runtime).

use std::os::fd::{AsFd as _, BorrowedFd, OwnedFd};
use std::os::unix::process::ExitStatusExt as _;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};

use super::{spawn, Launcher};

/// The node's side of the jail's helper: the control socket of the helper running now, if one
/// is. Started from the runtime binary the `Launcher` each call is given names.
pub struct Helper {
    control: Mutex<Option<Arc<OwnedFd>>>,
    /// Folders whose mounts the helper leaves out of its own mount table (`--private-below`).
    private_below: Vec<PathBuf>,
}

impl Helper {
    pub fn new(private_below: Vec<PathBuf>) -> Self {
        Self {
            control: Mutex::new(None),
            private_below,
        }
    }

    /// Runs `request` through the helper (with `root`, its root mount, when it says so): the
    /// run's exit status, as a runtime process would have exited. `BrokenPipe`: no helper
    /// would take the request (one started again was gone at once too: a runtime binary
    /// without the `helper` command), so nothing of it ran; `UnexpectedEof`: the helper died
    /// during the run, which has ended but may have left a container.
    pub fn run(
        &self,
        launcher: &Launcher,
        request: &jail::helper::Request,
        output: &std::fs::File,
        root: Option<BorrowedFd<'_>>,
        passed: &[BorrowedFd<'_>],
    ) -> std::io::Result<ExitStatus> {
        let id = &request.id;
        let mut restarted = false;
        loop {
            let control = self.control(launcher)?;
            match jail::helper::send(control.as_fd(), request, output.as_fd(), root, passed) {
                Ok(status) => return Ok(ExitStatus::from_raw(status)),
                // Gone before it read the request: nothing of it ran, so a new helper may.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe && !restarted => {
                    tracing::warn!(sandbox_id = %id, "the runtime's helper was gone; starting another");
                    self.forget(&control);
                    restarted = true;
                }
                Err(e) => {
                    if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        self.forget(&control);
                    }
                    return Err(e);
                }
            }
        }
    }

    /// The running helper's control socket, starting the helper if none runs.
    fn control(&self, launcher: &Launcher) -> std::io::Result<Arc<OwnedFd>> {
        let mut current = self.control.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(control) = current.as_ref() {
            return Ok(control.clone());
        }
        let control = Arc::new(self.start(launcher)?);
        *current = Some(control.clone());
        Ok(control)
    }

    /// Forgets the helper behind `dead`, unless another has replaced it already.
    fn forget(&self, dead: &Arc<OwnedFd>) {
        let mut current = self.control.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, dead)) {
            *current = None;
        }
    }

    /// Starts a helper: its control socket. Its own errors go to the node's stderr; a thread
    /// waits for it to exit, so it never lingers as a zombie.
    fn start(&self, launcher: &Launcher) -> std::io::Result<OwnedFd> {
        use rustix::net::{AddressFamily, SocketFlags, SocketType};
        let (ours, theirs) =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        // Close-on-exec here, as everything the node opens: another thread's child started at
        // this moment must not inherit it. The helper gets it by a spawn file action.
        let stderr = std::fs::File::from(rustix::io::fcntl_dupfd_cloexec(std::io::stderr().as_fd(), 0)?);
        let mut args = launcher.prefix.clone();
        args.extend(["--root".into(), launcher.root.clone().into_os_string(), "helper".into()]);
        for folder in &self.private_below {
            args.extend(["--private-below".into(), folder.clone().into_os_string()]);
        }
        // The helper's end becomes its fd 3 (`jail::helper::CONTROL_FD`).
        let pid = spawn::spawn(&launcher.program, &args, &stderr, &[theirs.as_fd()])?;
        let _ = std::thread::Builder::new()
            .name("jail-helper".into())
            .spawn(move || match spawn::wait(pid) {
                Ok(status) if status.success() => tracing::debug!("the runtime's helper ended"),
                Ok(status) => tracing::warn!(%status, "the runtime's helper ended"),
                Err(err) => tracing::warn!(%err, "waiting for the runtime's helper"),
            });
        Ok(ours)
    }
}
