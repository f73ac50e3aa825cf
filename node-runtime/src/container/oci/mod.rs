//! Driving an OCI runtime: the verbs a sandbox needs, behind [`Engine`].
//!
//! Two engines speak them:
//! - [`Jail`], the node's own runtime (the `jail` crate). Its `run` is done by the jail's
//!   helper ([`helper`]), a small, single-threaded process the node starts once and that
//!   forks for each container; `state`, `pause`, `resume` and `delete` are calls into the
//!   `jail` library in this process;
//! - [`CommandLine`], any binary with runc's command line (runc, crun, runsc, Kata's
//!   shim-less runtime): every verb a process.
//!
//! Both start `run --detach` with the same descriptors: envd's listening socket and its boot
//! pipe passed as fds 3 and 4 (`--preserve-fds 2`), the container's output to its log.

mod command_line;
mod helper;
mod jail;
mod spawn;

pub use command_line::CommandLine;
pub use jail::Jail;

use std::ffi::OsString;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};

/// What `state` says of a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Running,
    Paused,
    /// Created but not started, or stopped: nothing of it runs.
    Stopped,
}

/// Why a verb failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("opening the container's log {path}: {source}")]
    Log { path: PathBuf, source: std::io::Error },
    #[error("running {runtime}: {source}")]
    Spawn { runtime: String, source: std::io::Error },
    /// The runtime ran and refused; `said` is the end of what it wrote (a sentence of another
    /// program: shown, never matched).
    #[error("{runtime} {verb} exited {status}: {said}")]
    Refused {
        runtime: String,
        verb: &'static str,
        status: String,
        said: String,
    },
    #[error("{runtime} state {id} said {said:?}: {reason}")]
    BadState {
        runtime: String,
        id: String,
        said: String,
        reason: String,
    },
    #[error(transparent)]
    Jail(#[from] ::jail::container::ContainerError),
    #[error("attaching the container's root at {at}: {source}")]
    Root { at: PathBuf, source: std::io::Error },
}

/// The verbs of an OCI runtime the node uses, on containers named by sandbox ID.
pub trait Engine: Send + Sync {
    /// How the runtime's binary is invoked (every engine starts containers as a process).
    fn launcher(&self) -> &Launcher;

    /// The program and what it is called with, for logs and `NodeInfo`.
    fn describe(&self) -> String {
        self.launcher().describe()
    }

    /// The folder where the runtime keeps its containers' state (`--root`): runc-compatible
    /// runtimes keep a folder per container there.
    fn root(&self) -> &Path {
        &self.launcher().root
    }

    /// Whether the runtime may know container `id` (a stale folder is cleaned by `delete`), so
    /// a new ID costs no call.
    fn knows(&self, id: &str) -> bool {
        self.root().join(id).exists()
    }

    /// Creates and starts container `id` from `bundle`; the container's output (and the
    /// runtime's own errors) go to `log`; `passed` become the container's fds 3, 4, ...
    fn run(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        passed: &[BorrowedFd<'_>],
    ) -> Result<(), EngineError> {
        self.launcher().run(id, bundle, pid_file, log, passed)
    }

    /// Whether [`Engine::run_rooted`] takes the container's root as a detached mount into
    /// the container's own mount namespace (the node's table then never holds it); otherwise
    /// it is attached in the node's, at the bundle's root path, as a mounted root would be.
    fn takes_root_mount(&self) -> bool {
        false
    }

    /// As [`Engine::run`], with the container's root a detached mount (`root.tree`) that the
    /// spec's root path (`root.at`) names.
    fn run_rooted(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        root: Root<'_>,
        passed: &[BorrowedFd<'_>],
    ) -> Result<(), EngineError> {
        root.attach_here()?;
        self.run(id, bundle, pid_file, log, passed)
    }

    /// The container's status; `None` when the runtime does not know it.
    fn state(&self, id: &str) -> Result<Option<Status>, EngineError>;

    fn pause(&self, id: &str) -> Result<(), EngineError>;

    fn resume(&self, id: &str) -> Result<(), EngineError>;

    /// Kills everything of the container and forgets it; a container the runtime does not
    /// know is already gone.
    fn delete(&self, id: &str) -> Result<(), EngineError>;

    /// As [`Engine::delete`], with the container's cgroup, once empty, reset and renamed to
    /// `spare` rather than removed, where the runtime can (see `spare_cgroups`): whether it
    /// was. A runtime that cannot removes it as `delete` does.
    fn delete_keeping_cgroup(&self, id: &str, spare: &str) -> Result<bool, EngineError> {
        let _ = spare;
        self.delete(id).map(|()| false)
    }
}

/// A container's root made as a detached mount, and the path its spec names for it.
pub struct Root<'a> {
    pub tree: std::os::fd::OwnedFd,
    pub at: &'a Path,
}

impl Root<'_> {
    /// Attaches the root at its path in this process's mount namespace (the node's).
    fn attach_here(self) -> Result<(), EngineError> {
        rustix::mount::move_mount(
            &self.tree,
            "",
            rustix::fs::CWD,
            self.at,
            rustix::mount::MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(|e| EngineError::Root {
            at: self.at.to_path_buf(),
            source: e.into(),
        })
    }
}

/// How a runtime binary is invoked: `PROGRAM PREFIX... --root ROOT VERB ...`.
#[derive(Clone, Debug)]
pub struct Launcher {
    program: PathBuf,
    /// Arguments before runc's own (`jail` when the program is the node's multicall binary).
    prefix: Vec<OsString>,
    root: PathBuf,
}

impl Launcher {
    pub fn new(program: PathBuf, prefix: Vec<OsString>, root: PathBuf) -> Self {
        Self { program, prefix, root }
    }

    fn describe(&self) -> String {
        let mut parts = vec![self.program.display().to_string()];
        parts.extend(self.prefix.iter().map(|p| p.to_string_lossy().into_owned()));
        parts.join(" ")
    }

    /// `run --detach`, which every engine but the jail's starts as a process.
    fn run(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        passed: &[BorrowedFd<'_>],
    ) -> Result<(), EngineError> {
        let out = open_log(log)?;
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
        let status =
            spawn::spawn_and_wait(&self.program, &args, &out, passed).map_err(|source| EngineError::Spawn {
                runtime: self.describe(),
                source,
            })?;
        self.ran(status, log)
    }

    /// What a `run` that exited with `status` means: the end of its log when it failed.
    fn ran(&self, status: std::process::ExitStatus, log: &Path) -> Result<(), EngineError> {
        if status.success() {
            return Ok(());
        }
        let said = std::fs::read_to_string(log).unwrap_or_default();
        let last: Vec<&str> = said.lines().rev().take(3).collect();
        let said: Vec<&str> = last.into_iter().rev().collect();
        Err(EngineError::Refused {
            runtime: self.describe(),
            verb: "run",
            status: status.to_string(),
            said: said.join(" / "),
        })
    }
}

/// The container's log, opened for appending: the run's stdout and stderr.
fn open_log(log: &Path) -> Result<std::fs::File, EngineError> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|source| EngineError::Log {
            path: log.to_path_buf(),
            source,
        })
}
