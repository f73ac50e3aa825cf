//! Pseudo-terminals for `process.Process/Start` with `pty` (the SDK's `sandbox.pty`): the
//! command gets the terminal's slave side as stdin, stdout and stderr and, as its session's
//! controlling terminal, job control and line editing; envd reads and writes the master side.
//!
//! The master is non-blocking and driven by Tokio's reactor. Both ends are opened close-on-
//! exec, so a command started at the same moment by another request cannot inherit them; the
//! command gets its own copies as stdio. Once the command (and everything it started on the
//! terminal) has exited, reading the master fails with EIO: that is the end of the output.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{Mode, OFlags};
use rustix::pty::OpenptFlags;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Size used when the request gives none.
pub const DEFAULT_SIZE: (u16, u16) = (80, 24);

/// envd's side of one terminal.
pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
}

/// Opens a terminal of `cols` x `rows`; returns envd's side and the command's side.
pub fn open(cols: u16, rows: u16) -> io::Result<(PtyMaster, OwnedFd)> {
    let master = rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    rustix::io::ioctl_fionbio(&master, true)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let name = rustix::pty::ptsname(&master, Vec::new())?;
    let slave = rustix::fs::open(
        name.as_c_str(),
        OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    // SAFETY: the OwnedFd stays open, and the same, for as long as the AsyncFd owns it.
    let fd = unsafe { AsyncFd::register_with_interest(master, Interest::READABLE | Interest::WRITABLE) }
        .map_err(|e| io::Error::other(e.to_string()))?;
    let master = PtyMaster { fd };
    master.resize(cols, rows)?;
    Ok((master, slave))
}

/// In the command's process, between fork and exec: a new session whose controlling terminal
/// is the one on stdin. Without a PID namespace the command leads its own process group and
/// cannot start a session; it then runs on the terminal without job control.
///
/// # Safety
/// Only async-signal-safe system calls (rustix's are the bare system calls: no allocation, no
/// lock); meant for `pre_exec`.
pub unsafe fn take_terminal() -> io::Result<()> {
    if rustix::process::setsid().is_ok() {
        // SAFETY: descriptor 0 is open for the whole call (stdio is set up before pre_exec
        // runs); a stdin that is no terminal fails TIOCSCTTY, harmlessly.
        let stdin = unsafe { BorrowedFd::borrow_raw(0) };
        let _ = rustix::process::ioctl_tiocsctty(stdin);
    }
    Ok(())
}

impl PtyMaster {
    /// Runs one non-blocking system call on the master once it is ready for `interest`,
    /// retrying while it would block.
    async fn ready_call(
        &self,
        interest: Interest,
        mut call: impl FnMut(BorrowedFd<'_>) -> rustix::io::Result<usize>,
    ) -> io::Result<usize> {
        loop {
            let mut ready = self.fd.ready(interest).await?;
            let done = ready.try_io(|fd| call(fd.get_ref().as_fd()).map_err(io::Error::from));
            if let Ok(result) = done {
                return result;
            }
        }
    }

    /// Reads output; `Ok(0)` once the terminal's last user has gone.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let read = self
            .ready_call(Interest::READABLE, |fd| rustix::io::read(fd, &mut *buf))
            .await;
        match read {
            Err(err) if err.raw_os_error() == Some(rustix::io::Errno::IO.raw_os_error()) => Ok(0),
            other => other,
        }
    }

    /// Writes all of `data` as typed input.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let n = self
                .ready_call(Interest::WRITABLE, |fd| rustix::io::write(fd, data))
                .await?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Sets the terminal's size (the command gets SIGWINCH).
    pub fn resize(&self, cols: u16, rows: u16) -> io::Result<()> {
        let size = rustix::termios::Winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        Ok(rustix::termios::tcsetwinsize(self.fd.get_ref(), size)?)
    }
}
