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

use std::os::fd::{AsFd as _, BorrowedFd};
use std::path::{Path, PathBuf};

use super::helper::Helper;
use super::{Engine, EngineError, Launcher, Root, Status};

pub struct Jail {
    launcher: Launcher,
    dir: StateDir,
    helper: Helper,
}

impl Jail {
    /// The jail behind `launcher`; its helper keeps a mount table of its own without the
    /// mounts below `private_below` (the node's sandboxes' disks and roots: see `jail::view`).
    pub fn new(launcher: Launcher, private_below: Vec<PathBuf>) -> Self {
        let dir = StateDir::new(&launcher.root);
        Self {
            launcher,
            dir,
            helper: Helper::new(private_below),
        }
    }

    /// `delete`, keeping the cgroup at `spare` if one is given; an unknown container is gone.
    fn delete_keeping_cgroup_if(&self, id: &str, spare: Option<&str>) -> Result<bool, EngineError> {
        let deleted = match spare {
            Some(spare) => container::delete_keeping_cgroup(&self.dir, id, true, spare),
            None => container::delete(&self.dir, id, true).map(|()| false),
        };
        match deleted {
            Err(e) if !unknown(&e) => Err(e.into()),
            Err(_) => Ok(false),
            Ok(kept) => Ok(kept),
        }
    }

    /// [`Engine::run`] through the helper, with the root as a mount or without.
    fn run_through_helper(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        root: Option<Root<'_>>,
        passed: &[BorrowedFd<'_>],
    ) -> Result<(), EngineError> {
        let out = super::open_log(log)?;
        let tree = root.as_ref().map(|r| r.tree.as_fd());
        let request = ::jail::helper::Request {
            id: id.to_string(),
            bundle: bundle.to_path_buf(),
            pid_file: pid_file.to_path_buf(),
            root_mount: tree.is_some(),
        };
        let status = match self.helper.run(&self.launcher, &request, &out, tree, passed) {
            Ok(status) => status,
            // No helper runs here (a runtime binary older than the helper, say): a runtime
            // process for this one, as before there was a helper, from the node's own mount
            // table (where the root is attached first).
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                tracing::warn!(sandbox_id = %id, err = %e, "no runtime helper: running the runtime once for this create");
                if let Some(root) = root {
                    root.attach_here()?;
                }
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
        self.run_through_helper(id, bundle, pid_file, log, None, passed)
    }

    fn takes_root_mount(&self) -> bool {
        true
    }

    fn run_rooted(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        root: Root<'_>,
        passed: &[BorrowedFd<'_>],
    ) -> Result<(), EngineError> {
        self.run_through_helper(id, bundle, pid_file, log, Some(root), passed)
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
        self.delete_keeping_cgroup_if(id, None).map(drop)
    }

    fn delete_keeping_cgroup(&self, id: &str, spare: &str) -> Result<bool, EngineError> {
        self.delete_keeping_cgroup_if(id, Some(spare))
    }
}
