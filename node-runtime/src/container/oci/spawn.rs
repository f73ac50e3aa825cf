//! Starting the runtime's `run` without forking the node: `posix_spawn` with the passed
//! descriptors placed by file actions.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::Path;
use std::process::ExitStatus;

/// The most descriptors `run` passes through.
const MAX_PASSED: usize = 8;

/// Runs `program args` with stdin from `/dev/null`, stdout and stderr to `output`, and
/// `passed` as its fds 3, 4, ..., and waits for it to exit.
pub(super) fn spawn_and_wait(
    program: &Path,
    args: &[OsString],
    output: &std::fs::File,
    passed: &[BorrowedFd<'_>],
) -> std::io::Result<ExitStatus> {
    wait(spawn(program, args, output, passed)?)
}

/// Starts `program args` as [`spawn_and_wait`] does, without waiting: its PID, for [`wait`].
///
/// `posix_spawn` rather than `Command` with a `pre_exec` that moves the descriptors: a
/// `pre_exec` makes the standard library fork, and forking the node (a large, many-threaded
/// address space) copies its page tables only for `exec` to throw them away. That copy and
/// its teardown were a fifth of the CPU a create-and-kill cycle cost. The C library's
/// `posix_spawn` shares the address space until `exec` and places descriptors with file
/// actions instead.
pub(super) fn spawn(
    program: &Path,
    args: &[OsString],
    output: &std::fs::File,
    passed: &[BorrowedFd<'_>],
) -> std::io::Result<rustix::process::Pid> {
    use nix::spawn::{posix_spawn, posix_spawnp, PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags};
    use nix::sys::signal::{SigSet, Signal};

    if passed.len() > MAX_PASSED {
        return Err(std::io::Error::other(format!(
            "{} descriptors to pass; at most {MAX_PASSED}",
            passed.len()
        )));
    }
    // Copies above every target first (close-on-exec, so no other child inherits them): a
    // file action placing one cannot then overwrite another that sits at its target.
    let lowest = libc::c_int::try_from(3 + MAX_PASSED).unwrap_or(16);
    let moved = passed
        .iter()
        .map(|fd| rustix::io::fcntl_dupfd_cloexec(fd, lowest).map_err(std::io::Error::from))
        .collect::<std::io::Result<Vec<OwnedFd>>>()?;

    let null = std::fs::File::open("/dev/null")?;
    let mut actions = PosixSpawnFileActions::init()?;
    actions.add_dup2(null.as_raw_fd(), 0)?;
    actions.add_dup2(output.as_raw_fd(), 1)?;
    actions.add_dup2(output.as_raw_fd(), 2)?;
    for (i, fd) in moved.iter().enumerate() {
        // dup2 leaves the copy without close-on-exec: the runtime inherits it.
        actions.add_dup2(fd.as_raw_fd(), 3 + i as libc::c_int)?;
    }
    // As `Command` does: no signal blocked (the caller's thread may block some) and SIGPIPE
    // back to its default (the node ignores it).
    let mut attr = PosixSpawnAttr::init()?;
    attr.set_sigmask(&SigSet::empty())?;
    let mut default = SigSet::empty();
    default.add(Signal::SIGPIPE);
    attr.set_sigdefault(&default)?;
    attr.set_flags(PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK | PosixSpawnFlags::POSIX_SPAWN_SETSIGDEF)?;

    let path = super::super::cstring(program)?;
    let argv = std::iter::once(program.as_os_str())
        .chain(args.iter().map(OsString::as_os_str))
        .map(super::super::cstring)
        .collect::<std::io::Result<Vec<_>>>()?;
    let envp = std::env::vars_os()
        .map(|(k, v)| {
            let mut kv = k;
            kv.push("=");
            kv.push(v);
            super::super::cstring(&kv)
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    // A bare name (`--oci-runtime runc`) is looked up on PATH, as `Command` does.
    let child = if program.as_os_str().as_bytes().contains(&b'/') {
        posix_spawn(path.as_c_str(), &actions, &attr, &argv, &envp)?
    } else {
        posix_spawnp(path.as_c_str(), &actions, &attr, &argv, &envp)?
    };
    drop(moved);
    rustix::process::Pid::from_raw(child.as_raw()).ok_or_else(|| std::io::Error::other("no child has PID 0"))
}

/// Waits for child `child` to exit: its status.
pub(super) fn wait(child: rustix::process::Pid) -> std::io::Result<ExitStatus> {
    loop {
        match rustix::process::waitpid(Some(child), rustix::process::WaitOptions::empty()) {
            Ok(Some((_, status))) => return Ok(ExitStatus::from_raw(status.as_raw())),
            Ok(None) | Err(rustix::io::Errno::INTR) => {}
            Err(err) => return Err(err.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Seek as _, Write as _};
    use std::os::fd::AsFd as _;

    use super::*;

    /// What `run` relies on: the passed descriptors arrive as 3, 4, ... in the order given
    /// (two pipes, told apart by what they carry), stdout and stderr land in the output file,
    /// a bare program name is found on PATH, and the exit status comes back.
    #[test]
    fn spawned_programs_get_their_descriptors_in_order_and_their_status_back() {
        let (first_r, mut first_w) = std::io::pipe().unwrap();
        let (second_r, mut second_w) = std::io::pipe().unwrap();
        first_w.write_all(b"first\n").unwrap();
        second_w.write_all(b"second\n").unwrap();
        drop((first_w, second_w));
        let mut output = tempfile_in_tmp();
        let args = ["-c", "cat <&3; cat <&4; echo to-stderr >&2; exit 7"].map(OsString::from);
        let status = spawn_and_wait(Path::new("sh"), &args, &output, &[first_r.as_fd(), second_r.as_fd()]).unwrap();
        assert_eq!(status.code(), Some(7));
        let mut said = String::new();
        output.rewind().unwrap();
        output.read_to_string(&mut said).unwrap();
        assert_eq!(said, "first\nsecond\nto-stderr\n");
    }

    fn tempfile_in_tmp() -> std::fs::File {
        let path = std::env::temp_dir().join(format!("oci-spawn-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let _ = std::fs::remove_file(&path);
        file
    }
}
