//! Thin, allocation-free wrappers around the system calls the runtime needs.
//!
//! Two kinds of code call into this module:
//!
//! * the `jail` process itself, which is ordinary Rust and may allocate freely, and
//! * the container's init, i.e. the child between `clone` and `execve`.
//!
//! The child is a copy of a process that might (if someone embeds the library in a
//! multi-threaded program) have had other threads holding the allocator's locks at the
//! moment of the copy. Those threads do not exist in the child, so their locks would never be
//! released. The child therefore only touches memory prepared before the clone, and
//! everything here works on caller-provided buffers, borrowed C strings and raw file
//! descriptors. Errors are plain [`Errno`] values whose `Display` formats into a stack buffer.
//!
//! The parent's side of the runtime (state, signals, cgroups, limits) calls the kernel through
//! rustix where it offers the call; what runs after `clone` stays on these wrappers, which
//! the child's rules are written for.

use std::ffi::CStr;
use std::fmt;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Prints a C string (our C strings come from JSON strings, so they are UTF-8; anything
/// else is shown as `?`) without allocating.
pub struct CDisplay<'a>(pub &'a CStr);

impl fmt::Display for CDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.to_str().unwrap_or("?"))
    }
}

impl fmt::Debug for CDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// An `errno` value. `Display` renders it the way Go (and so runc) does: the C library's
/// message with a lower-case first letter, e.g. `no such file or directory`, because the
/// node matches on runc's wording and that wording comes from Go's `syscall.Errno`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    /// The calling thread's current `errno`.
    pub fn last() -> Self {
        // SAFETY: __errno_location always returns a valid pointer to this thread's errno.
        Errno(unsafe { *libc::__errno_location() })
    }
}

/// rustix's errors, for the parent's side of the runtime, which calls the kernel through it.
impl From<rustix::io::Errno> for Errno {
    fn from(errno: rustix::io::Errno) -> Self {
        Errno(errno.raw_os_error())
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = [0u8; 128];
        // SAFETY: the buffer is valid for its length; the XSI strerror_r NUL-terminates it.
        let rc = unsafe { libc::strerror_r(self.0, buf.as_mut_ptr().cast(), buf.len()) };
        if rc != 0 {
            return write!(f, "errno {}", self.0);
        }
        let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        let msg = std::str::from_utf8(&buf[..len]).unwrap_or("unknown error");
        let mut chars = msg.chars();
        if let Some(first) = chars.next() {
            for c in first.to_lowercase() {
                fmt::Write::write_char(f, c)?;
            }
            f.write_str(chars.as_str())?;
        }
        Ok(())
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Errno({}: {})", self.0, self)
    }
}

impl From<Errno> for std::io::Error {
    fn from(e: Errno) -> Self {
        std::io::Error::from_raw_os_error(e.0)
    }
}

/// An `io::Error` rendered the way Go (and runc) renders errors: the errno text alone,
/// without Rust's ` (os error N)` suffix.
pub struct IoDisplay<'a>(pub &'a std::io::Error);

impl fmt::Display for IoDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.raw_os_error() {
            Some(e) => Errno(e).fmt(f),
            None => self.0.fmt(f),
        }
    }
}

/// Turns a `-1`-on-error return value into a `Result`.
pub fn check(ret: libc::c_int) -> Result<libc::c_int, Errno> {
    if ret == -1 {
        Err(Errno::last())
    } else {
        Ok(ret)
    }
}

/// Same as [`check`] for the `long` returned by `syscall(2)`.
pub fn check_long(ret: libc::c_long) -> Result<libc::c_long, Errno> {
    if ret == -1 {
        Err(Errno::last())
    } else {
        Ok(ret)
    }
}

/// A fixed-capacity byte buffer that implements `fmt::Write`, so messages can be formatted
/// after `clone` without the heap. Output beyond the capacity is silently cut (a truncated
/// error message is better than none).
pub struct StackBuf<const N: usize> {
    data: [u8; N],
    len: usize,
}

impl<const N: usize> StackBuf<N> {
    pub const fn new() -> Self {
        StackBuf { data: [0; N], len: 0 }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        let room = N.saturating_sub(self.len);
        let n = bytes.len().min(room);
        self.data[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.data[..self.len]
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// The contents as a NUL-terminated C string; the last byte is overwritten if the buffer
    /// is full. Contents must not contain NUL bytes (ours are numbers and paths from C strings).
    pub fn as_cstr(&mut self) -> &CStr {
        if self.len == N {
            self.len -= 1;
        }
        self.data[self.len] = 0;
        // SAFETY: we just wrote the terminator at `len` and the contents have no inner NUL.
        unsafe { CStr::from_bytes_with_nul_unchecked(&self.data[..=self.len]) }
    }
}

/// The contents as text (a path or a message), for callers that may allocate.
impl<const N: usize> fmt::Display for StackBuf<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(self.as_bytes()))
    }
}

impl<const N: usize> Default for StackBuf<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> fmt::Write for StackBuf<N> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.push(s.as_bytes());
        Ok(())
    }
}

/// `/proc/self/fd/N`: the path through which a file descriptor obtained safely (with
/// `openat2`) is handed to path-based calls such as `mount(2)`. The kernel follows this
/// "magic link" to exactly the object the descriptor refers to, so nothing planted in the
/// rootfs can redirect the call after we resolved the path.
pub fn fd_path(fd: RawFd) -> StackBuf<32> {
    let mut buf = StackBuf::new();
    let _ = fmt::Write::write_fmt(&mut buf, format_args!("/proc/self/fd/{fd}"));
    buf
}

/// `s` as a C string for a system call: the one conversion of a path, an argument or an
/// environment entry (anything with a NUL in it is refused), for the parent's side of the
/// runtime and for the node; after `clone` nothing converts, so it may allocate.
pub fn cstring(s: impl AsRef<std::ffi::OsStr>) -> Result<std::ffi::CString, std::ffi::NulError> {
    use std::os::unix::ffi::OsStrExt as _;
    std::ffi::CString::new(s.as_ref().as_bytes())
}

/// `openat2(2)` with the given `resolve` flags (`RESOLVE_IN_ROOT` and friends).
pub fn openat2(dirfd: RawFd, path: &CStr, flags: libc::c_int, resolve: u64) -> Result<OwnedFd, Errno> {
    // SAFETY: open_how is plain data; all-zero is its "no options" value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = resolve;
    // SAFETY: `path` is a valid C string and `how` a valid open_how of the size we pass.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dirfd,
            path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    let fd = check_long(fd)?;
    // SAFETY: the kernel just returned this descriptor to us; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `mount(2)` with optional source, filesystem type and data.
pub fn mount(
    source: Option<&CStr>,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> Result<(), Errno> {
    let p = |s: Option<&CStr>| s.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: all pointers are NULL or valid C strings for the duration of the call.
    let rc = unsafe { libc::mount(p(source), target.as_ptr(), p(fstype), flags, p(data).cast()) };
    check(rc).map(drop)
}

/// Writes the whole buffer, retrying on `EINTR` and short writes.
pub fn write_all(fd: RawFd, mut bytes: &[u8]) -> Result<(), Errno> {
    while !bytes.is_empty() {
        // SAFETY: the buffer is valid for `bytes.len()` bytes.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 {
            let e = Errno::last();
            if e.0 == libc::EINTR {
                continue;
            }
            return Err(e);
        }
        bytes = &bytes[n as usize..];
    }
    Ok(())
}

/// Reads until the buffer is full or end of file; returns the number of bytes read.
pub fn read_full(fd: RawFd, buf: &mut [u8]) -> Result<usize, Errno> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the destination range is inside `buf`.
        let n = unsafe { libc::read(fd, buf[done..].as_mut_ptr().cast(), buf.len() - done) };
        if n < 0 {
            let e = Errno::last();
            if e.0 == libc::EINTR {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        done += n as usize;
    }
    Ok(done)
}

/// A pipe whose two ends are close-on-exec and numbered at or above `min_fd`.
///
/// `--preserve-fds N` promises the container fds 3..3+N with their numbers unchanged, so the
/// runtime's own descriptors must never land in that range, whatever the caller left open.
pub fn pipe_above(min_fd: RawFd) -> Result<(OwnedFd, OwnedFd), Errno> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 succeeded, so both descriptors are fresh and owned by us.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((move_above(r, min_fd)?, move_above(w, min_fd)?))
}

/// Renumbers `fd` to the lowest free number >= `min_fd` (close-on-exec), if it is below.
pub fn move_above(fd: OwnedFd, min_fd: RawFd) -> Result<OwnedFd, Errno> {
    use std::os::fd::AsRawFd;
    if fd.as_raw_fd() >= min_fd {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC on a valid descriptor returns a new descriptor that we own.
    let new = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min_fd) })?;
    // SAFETY: see above; `fd` is dropped (closed) on return.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// Waits for child `pid` to end and reaps it, through interruptions; returns at once for a
/// PID that is no child of ours (or not a PID). Not for the child between clone and exec.
pub fn reap(pid: libc::pid_t) {
    let Some(pid) = rustix::process::Pid::from_raw(pid) else {
        return;
    };
    while let Err(rustix::io::Errno::INTR) = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty())
    {
    }
}

/// Terminates the calling process immediately, without running atexit handlers or flushing
/// Rust's stdout buffer (which belongs to the parent's copy of the process).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and is async-signal-safe.
    unsafe { libc::_exit(code) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write;

    #[test]
    fn errno_reads_like_go() {
        assert_eq!(Errno(libc::ENOENT).to_string(), "no such file or directory");
        assert_eq!(Errno(libc::EPERM).to_string(), "operation not permitted");
    }

    #[test]
    fn stack_buf_truncates_and_terminates() {
        let mut b = StackBuf::<8>::new();
        write!(b, "0123456789").unwrap();
        assert_eq!(b.as_bytes(), b"01234567");
        assert_eq!(b.as_cstr().to_bytes(), b"0123456");
        assert_eq!(fd_path(42).as_cstr().to_str().unwrap(), "/proc/self/fd/42");
    }
}
