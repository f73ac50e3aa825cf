//! Pseudo-terminals for `process.Process/Start` with `pty` (the SDK's `sandbox.pty`): the
//! command gets the terminal's slave side as stdin, stdout and stderr and, as its session's
//! controlling terminal, job control and line editing; envd reads and writes the master side.
//!
//! The master is non-blocking and driven by Tokio's reactor. Both ends are opened close-on-
//! exec, so a command started at the same moment by another request cannot inherit them; the
//! command gets its own copies as stdio. Once the command (and everything it started on the
//! terminal) has exited, reading the master fails with EIO: that is the end of the output.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

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
    // SAFETY: plain system calls; every descriptor returned is owned at once.
    unsafe {
        let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC | libc::O_NONBLOCK);
        if master < 0 {
            return Err(io::Error::last_os_error());
        }
        let master = OwnedFd::from_raw_fd(master);
        if libc::grantpt(master.as_raw_fd()) != 0 || libc::unlockpt(master.as_raw_fd()) != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut name = [0 as libc::c_char; 128];
        if libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len()) != 0 {
            return Err(io::Error::last_os_error());
        }
        let slave = libc::open(
            CStr::from_ptr(name.as_ptr()).as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        );
        if slave < 0 {
            return Err(io::Error::last_os_error());
        }
        let slave = OwnedFd::from_raw_fd(slave);
        // The OwnedFd stays open, and the same, for as long as the AsyncFd owns it.
        let fd = AsyncFd::register_with_interest(master, Interest::READABLE | Interest::WRITABLE)
            .map_err(|e| io::Error::other(e.to_string()))?;
        let master = PtyMaster { fd };
        master.resize(cols, rows)?;
        Ok((master, slave))
    }
}

/// In the command's process, between fork and exec: a new session whose controlling terminal
/// is the one on stdin. Without a PID namespace the command leads its own process group and
/// cannot start a session; it then runs on the terminal without job control.
///
/// # Safety
/// Only async-signal-safe system calls; meant for `pre_exec`.
pub unsafe fn take_terminal() -> io::Result<()> {
    // SAFETY: setsid takes no arguments and is async-signal-safe.
    if unsafe { libc::setsid() } >= 0 {
        // SAFETY: TIOCSCTTY on stdin with an integer argument; a stdin that is no terminal
        // fails the call, harmlessly.
        unsafe { libc::ioctl(0, libc::TIOCSCTTY as _, 0) };
    }
    Ok(())
}

impl PtyMaster {
    /// Runs one non-blocking system call on the master (`call` returns what read or write
    /// returned) once the master is ready for `interest`, retrying while it would block.
    async fn ready_call(&self, interest: Interest, mut call: impl FnMut(i32) -> isize) -> io::Result<usize> {
        loop {
            let mut ready = self.fd.ready(interest).await?;
            let done = ready.try_io(|fd| match call(fd.as_raw_fd()) {
                n if n < 0 => Err(io::Error::last_os_error()),
                n => Ok(n as usize),
            });
            if let Ok(result) = done {
                return result;
            }
        }
    }

    /// Reads output; `Ok(0)` once the terminal's last user has gone.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: reads into a buffer we own, of its length.
        let read = self
            .ready_call(Interest::READABLE, |fd| unsafe {
                libc::read(fd, buf.as_mut_ptr().cast(), buf.len())
            })
            .await;
        match read {
            Err(err) if err.raw_os_error() == Some(libc::EIO) => Ok(0),
            other => other,
        }
    }

    /// Writes all of `data` as typed input.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            // SAFETY: writes from a buffer we own, of its length.
            let n = self
                .ready_call(Interest::WRITABLE, |fd| unsafe {
                    libc::write(fd, data.as_ptr().cast(), data.len())
                })
                .await?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Sets the terminal's size (the command gets SIGWINCH).
    pub fn resize(&self, cols: u16, rows: u16) -> io::Result<()> {
        let size = libc::winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads one winsize we own.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), libc::TIOCSWINSZ, &size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}
