//! Talking to an OCI runtime through runc's command line, the one interface runc, crun,
//! runsc (gVisor) and Kata's shim-less runtime all speak. The default is the node's own binary
//! run as `BINARY jail ...` (the `jail` crate); `--oci-runtime PATH` picks any of those.
//!
//! Only what a sandbox needs: `run --detach` (create and start, envd's listening socket and
//! its boot pipe passed as fds 3 and 4 with `--preserve-fds 2`), `state`, `pause`, `resume`,
//! `delete --force`. On the node's own runtime only `run` is a process; the rest are calls
//! into the `jail` library ([`Cli::own`]).

use std::ffi::OsString;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

/// How to invoke the runtime.
#[derive(Clone, Debug)]
pub struct Cli {
    program: PathBuf,
    /// Arguments before runc's own (`jail` when the program is the node's binary).
    prefix: Vec<OsString>,
    /// The runtime's state directory (`--root`).
    root: PathBuf,
    /// Whether the program is the node's own runtime (the `jail` crate, which this binary
    /// links): then `state`, `pause`, `resume` and `delete` are library calls
    /// ([`Cli::library`]).
    own: bool,
}

/// What `state` says of a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Running,
    Paused,
    /// Created but not started, or stopped: nothing of it runs.
    Stopped,
}

impl Cli {
    /// A runc-compatible `program`, every call a process.
    pub fn new(program: PathBuf, prefix: Vec<OsString>, root: PathBuf) -> Self {
        Self {
            program,
            prefix,
            root,
            own: false,
        }
    }

    /// The node's own runtime at `program`: only `run` is a process.
    pub fn own(program: PathBuf, prefix: Vec<OsString>, root: PathBuf) -> Self {
        Self {
            own: true,
            ..Self::new(program, prefix, root)
        }
    }

    /// The program and what it is called with, for logs and `NodeInfo`.
    pub fn describe(&self) -> String {
        let mut parts = vec![self.program.display().to_string()];
        parts.extend(self.prefix.iter().map(|p| p.to_string_lossy().into_owned()));
        parts.join(" ")
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.prefix)
            .arg("--root")
            .arg(&self.root)
            .stdin(Stdio::null());
        cmd
    }

    /// Creates and starts container `id` from `bundle`; the container's output (and the
    /// runtime's own errors) go to `log`; `passed` become the container's fds 3, 4, ...
    pub fn run(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        passed: &[BorrowedFd<'_>],
    ) -> Result<(), String> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| format!("opening {}: {e}", log.display()))?;
        let mut args: Vec<OsString> = self.prefix.clone();
        args.extend(
            [
                "--root".as_ref(),
                self.root.as_os_str(),
                "run".as_ref(),
                "--detach".as_ref(),
                "--bundle".as_ref(),
                bundle.as_os_str(),
                "--pid-file".as_ref(),
                pid_file.as_os_str(),
                "--preserve-fds".as_ref(),
                passed.len().to_string().as_ref(),
                id.as_ref(),
            ]
            .map(OsString::from),
        );
        let status = spawn_and_wait(&self.program, &args, &out, passed)
            .map_err(|e| format!("running {}: {e}", self.describe()))?;
        if status.success() {
            return Ok(());
        }
        let said = std::fs::read_to_string(log).unwrap_or_default();
        let last: Vec<&str> = said.lines().rev().take(3).collect();
        let reason: Vec<&str> = last.into_iter().rev().collect();
        Err(format!(
            "{} run exited {status}: {}",
            self.describe(),
            reason.join(" / ")
        ))
    }

    fn simple(&self, verb: &str, args: &[&str], id: &str) -> Result<String, String> {
        let output = self
            .command()
            .arg(verb)
            .args(args)
            .arg(id)
            .output()
            .map_err(|e| format!("running {}: {e}", self.describe()))?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).trim().to_string())
        }
    }

    /// The folder where the runtime keeps its containers' state.
    pub fn root(&self) -> &std::path::Path {
        &self.root
    }

    /// Whether the runtime may know container `id`: runc-compatible runtimes keep a folder per
    /// container under their root (a stale one is cleaned by `delete`).
    pub fn knows(&self, id: &str) -> bool {
        self.root.join(id).exists()
    }

    /// The node's own runtime's state directory, when the program is that runtime.
    ///
    /// Then `state`, `pause`, `resume` and `delete` are calls into the `jail` library, in
    /// this process: none of them forks or changes anything of the caller (they read the
    /// container's state, write its freezer, signal it through a pidfd, empty and remove its
    /// cgroups and state), and starting a runtime process for them cost more than the work (a
    /// spawn, an `exec` and the loader, about 2 ms, once per kill and twice per resume). Only
    /// `run` must be a process of its own: it clones the container from a small,
    /// single-threaded one.
    fn library(&self) -> Option<jail::state::StateDir> {
        self.own.then(|| jail::state::StateDir::new(&self.root))
    }

    /// The container's status; `None` when the runtime does not know it.
    pub fn state(&self, id: &str) -> Result<Option<Status>, String> {
        if let Some(dir) = self.library() {
            return match jail::container::status_of(&dir, id) {
                Ok(jail::state::Status::Running) => Ok(Some(Status::Running)),
                Ok(jail::state::Status::Paused) => Ok(Some(Status::Paused)),
                Ok(_) => Ok(Some(Status::Stopped)),
                Err(e) if unknown(&e) => Ok(None),
                Err(e) => Err(e.to_string()),
            };
        }
        match self.simple("state", &[], id) {
            Ok(json) => {
                let value: serde_json::Value =
                    serde_json::from_str(&json).map_err(|e| format!("state of {id}: {e}: {json}"))?;
                Ok(Some(match value["status"].as_str() {
                    Some("running") => Status::Running,
                    Some("paused") => Status::Paused,
                    _ => Status::Stopped,
                }))
            }
            // A runc-compatible runtime keeps a folder per container it knows: without one,
            // the failure was that it does not know this container (its message is a
            // sentence of another program, never matched).
            Err(_) if !self.knows(id) => Ok(None),
            Err(message) => Err(message),
        }
    }

    pub fn pause(&self, id: &str) -> Result<(), String> {
        if let Some(dir) = self.library() {
            return jail::container::pause(&dir, id).map_err(|e| e.to_string());
        }
        self.simple("pause", &[], id).map(drop)
    }

    pub fn resume(&self, id: &str) -> Result<(), String> {
        if let Some(dir) = self.library() {
            return jail::container::resume(&dir, id).map_err(|e| e.to_string());
        }
        self.simple("resume", &[], id).map(drop)
    }

    /// Kills everything of the container and forgets it; a container the runtime does not
    /// know is already gone.
    pub fn delete(&self, id: &str) -> Result<(), String> {
        if let Some(dir) = self.library() {
            return match jail::container::delete(&dir, id, true) {
                Err(e) if !unknown(&e) => Err(e.to_string()),
                _ => Ok(()),
            };
        }
        match self.simple("delete", &["--force"], id) {
            Ok(_) => Ok(()),
            Err(_) if !self.knows(id) => Ok(()),
            Err(message) => Err(message),
        }
    }
}

/// Whether the node's own runtime failed because it does not know the container.
fn unknown(e: &jail::container::ContainerError) -> bool {
    matches!(
        e,
        jail::container::ContainerError::State(jail::state::StateError::NotFound(_))
    )
}

/// The most descriptors `run` passes through.
const MAX_PASSED: usize = 8;

/// Runs `program args` with stdin from `/dev/null`, stdout and stderr to `output`, and
/// `passed` as its fds 3, 4, ..., and waits for it to exit.
///
/// `posix_spawn` rather than `Command` with a `pre_exec` that moves the descriptors: a
/// `pre_exec` makes the standard library fork, and forking the node (a large, many-threaded
/// address space) copies its page tables only for `exec` to throw them away. That copy and
/// its teardown were a fifth of the CPU a create-and-kill cycle cost. The C library's
/// `posix_spawn` shares the address space until `exec` and places descriptors with file
/// actions instead.
fn spawn_and_wait(
    program: &Path,
    args: &[OsString],
    output: &std::fs::File,
    passed: &[BorrowedFd<'_>],
) -> std::io::Result<ExitStatus> {
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
        .map(|fd| {
            // SAFETY: F_DUPFD_CLOEXEC on a descriptor the caller keeps open; the new one is
            // owned here.
            let copy = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, lowest) };
            if copy < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                // SAFETY: `copy` is a new descriptor nothing else owns.
                Ok(unsafe { OwnedFd::from_raw_fd(copy) })
            }
        })
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

    let path = super::cstring(program)?;
    let argv = std::iter::once(program.as_os_str())
        .chain(args.iter().map(OsString::as_os_str))
        .map(super::cstring)
        .collect::<std::io::Result<Vec<_>>>()?;
    let envp = std::env::vars_os()
        .map(|(k, v)| {
            let mut kv = k;
            kv.push("=");
            kv.push(v);
            super::cstring(&kv)
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    // A bare name (`--oci-runtime runc`) is looked up on PATH, as `Command` does.
    let child = if program.as_os_str().as_bytes().contains(&b'/') {
        posix_spawn(path.as_c_str(), &actions, &attr, &argv, &envp)?
    } else {
        posix_spawnp(path.as_c_str(), &actions, &attr, &argv, &envp)?
    };
    drop(moved);
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child and writes only `status`.
        if unsafe { libc::waitpid(child.as_raw(), &mut status, 0) } >= 0 {
            return Ok(ExitStatus::from_raw(status));
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
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
