//! The node's own runtime, the `jail` crate this binary links.
//!
//! `run` is done by the jail's helper ([`Helper`]), a small, single-threaded process started
//! once, which forks the process each container is cloned from.
//! `state`, `pause`, `resume` and `delete` are library calls in this process: none of them
//! forks or changes anything of the caller (they read the container's state, write its
//! freezer, signal it through a pidfd, empty and remove its cgroups and state), and a runtime
//! process for them cost more than the work (a spawn, an `exec` and the loader, about 2 ms,
//! once per kill and twice per resume).

use ::jail::container::{self, ContainerError};
use ::jail::state::{self, StateDir, StateError};

use std::os::fd::BorrowedFd;
use std::path::Path;

use super::helper::Helper;
use super::{Engine, EngineError, Launcher, Status};

pub struct Jail {
    launcher: Launcher,
    dir: StateDir,
    helper: Helper,
}

impl Jail {
    pub fn new(launcher: Launcher) -> Self {
        let dir = StateDir::new(&launcher.root);
        Self {
            launcher,
            dir,
            helper: Helper::default(),
        }
    }
}

/// Whether the library failed because it does not know the container.
fn unknown(e: &ContainerError) -> bool {
    matches!(e, ContainerError::State(StateError::NotFound(_)))
}

impl Engine for Jail {
    fn launcher(&self) -> &Launcher {
        &self.launcher
    }

    fn run(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        passed: &[BorrowedFd<'_>],
    ) -> Result<(), EngineError> {
        let out = super::open_log(log)?;
        let status = match self.helper.run(&self.launcher, id, bundle, pid_file, &out, passed) {
            Ok(status) => status,
            // No helper runs here (a runtime binary older than the helper, say): a runtime
            // process for this one, as before there was a helper.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                tracing::warn!(sandbox_id = %id, err = %e, "no runtime helper: running the runtime once for this create");
                return self.launcher.run(id, bundle, pid_file, log, passed);
            }
            Err(source) => {
                return Err(EngineError::Spawn {
                    runtime: self.describe(),
                    source,
                })
            }
        };
        self.launcher.ran(status, log)
    }

    fn state(&self, id: &str) -> Result<Option<Status>, EngineError> {
        match container::status_of(&self.dir, id) {
            Ok(state::Status::Running) => Ok(Some(Status::Running)),
            Ok(state::Status::Paused) => Ok(Some(Status::Paused)),
            Ok(_) => Ok(Some(Status::Stopped)),
            Err(e) if unknown(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn pause(&self, id: &str) -> Result<(), EngineError> {
        Ok(container::pause(&self.dir, id)?)
    }

    fn resume(&self, id: &str) -> Result<(), EngineError> {
        Ok(container::resume(&self.dir, id)?)
    }

    fn delete(&self, id: &str) -> Result<(), EngineError> {
        match container::delete(&self.dir, id, true) {
            Err(e) if !unknown(&e) => Err(e.into()),
            _ => Ok(()),
        }
    }
}
