//! Talking to an OCI runtime through runc's command line, the one interface runc, crun,
//! runsc (gVisor) and Kata's shim-less runtime all speak. The default is the node's own binary
//! run as `BINARY jail ...` (the `jail` crate); `--oci-runtime PATH` picks any of those.
//!
//! Only what a sandbox needs: `run --detach` (create and start, envd's listening socket and
//! its boot pipe passed as fds 3 and 4 with `--preserve-fds 2`), `state`, `pause`, `resume`,
//! `delete --force`.

use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// How to invoke the runtime.
#[derive(Clone, Debug)]
pub struct Cli {
    program: PathBuf,
    /// Arguments before runc's own (`jail` when the program is the node's binary).
    prefix: Vec<OsString>,
    /// The runtime's state directory (`--root`).
    root: PathBuf,
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
    pub fn new(program: PathBuf, prefix: Vec<OsString>, root: PathBuf) -> Self {
        Self { program, prefix, root }
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
        passed: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<(), String> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| format!("opening {}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        if passed.len() > 8 {
            return Err(format!("{} descriptors to pass; at most 8", passed.len()));
        }
        let fds: Vec<i32> = passed.iter().map(|fd| fd.as_raw_fd()).collect();
        let count = fds.len().to_string();
        let mut cmd = self.command();
        cmd.arg("run")
            .arg("--detach")
            .arg("--bundle")
            .arg(bundle)
            .arg("--pid-file")
            .arg(pid_file)
            .args(["--preserve-fds", &count])
            .arg(id)
            .stdout(out)
            .stderr(err);
        // SAFETY: fcntl and dup2 are async-signal-safe; the closure only reads integers
        // prepared before the fork and writes a fixed-size array on its stack.
        unsafe {
            cmd.pre_exec(move || {
                // First out of the way (above 3 + count, close-on-exec), so placing one
                // cannot overwrite another that happens to sit at its target.
                let mut moved = [0i32; 8];
                for (i, fd) in fds.iter().enumerate().take(moved.len()) {
                    moved[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 16);
                    if moved[i] < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                for (i, fd) in moved.iter().take(fds.len()).enumerate() {
                    // dup2 clears close-on-exec on the copy.
                    if libc::dup2(*fd, 3 + i as i32) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let status = cmd.status().map_err(|e| format!("running {}: {e}", self.describe()))?;
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

    /// The container's status; `None` when the runtime does not know it.
    pub fn state(&self, id: &str) -> Result<Option<Status>, String> {
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
            Err(message) if message.contains("does not exist") => Ok(None),
            Err(message) => Err(message),
        }
    }

    pub fn pause(&self, id: &str) -> Result<(), String> {
        self.simple("pause", &[], id).map(drop)
    }

    pub fn resume(&self, id: &str) -> Result<(), String> {
        self.simple("resume", &[], id).map(drop)
    }

    /// Kills everything of the container and forgets it; a container the runtime does not
    /// know is already gone.
    pub fn delete(&self, id: &str) -> Result<(), String> {
        match self.simple("delete", &["--force"], id) {
            Ok(_) => Ok(()),
            Err(message) if message.contains("does not exist") => Ok(()),
            Err(message) => Err(message),
        }
    }
}
