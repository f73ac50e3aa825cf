//! The state directory: one subdirectory per container, holding `state.json`.
//!
//! Layout: `ROOT/ID/state.json`. Every command except `run` starts by loading this file, so
//! it records everything they need without re-reading the bundle: the init's host PID and
//! its start time, the bundle and rootfs paths, the cgroup, and the creation time.
//!
//! Three rules keep this safe without locks:
//!
//! * **IDs are validated** before they become a path component (`[A-Za-z0-9][A-Za-z0-9_.-]*`,
//!   at most 128 bytes), so no ID can name `..`, contain `/`, or otherwise escape `ROOT`.
//! * **`ROOT/ID` is created with a single `mkdir`**, never `create_dir_all` on the last
//!   component: of two concurrent `run`s with the same ID exactly one wins and the other
//!   fails cleanly with `container "ID" already exists`.
//! * **`state.json` is replaced atomically** (write a temporary file, then `rename`), so a
//!   concurrent `state` reads either the old or the new contents, never half a file.
//!
//! A PID alone does not identify a process for long: after the container exits the kernel
//! may hand the same number to an unrelated process. We therefore also record the start
//! time (field 22 of `/proc/PID/stat`, in clock ticks since boot), which together with the
//! PID is unique for the life of the machine. A PID that is gone, a zombie, or alive with a
//! different start time means the container is `stopped`.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::cgroup::CgroupRecord;
use crate::sys::IoDisplay;

/// Name of the state file inside `ROOT/ID`.
pub const STATE_FILE: &str = "state.json";

/// Errors from the state directory.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("invalid container id {0:?}: must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,127}}")]
    InvalidId(String),
    #[error("container \"{0}\" does not exist")]
    NotFound(String),
    #[error("container \"{0}\" already exists")]
    AlreadyExists(String),
    #[error("state directory {path}: {}", IoDisplay(source))]
    Io { path: PathBuf, source: io::Error },
    #[error("corrupt state file {path}: {source}")]
    Corrupt { path: PathBuf, source: serde_json::Error },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Checks a container ID against the cluster's sandbox-ID rule (`contracts::ids`).
pub fn validate_id(id: &str) -> Result<(), StateError> {
    if contracts::ids::is_sandbox_id(id) {
        Ok(())
    } else {
        Err(StateError::InvalidId(id.to_string()))
    }
}

/// What `state.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ContainerState {
    pub oci_version: String,
    pub id: String,
    /// Host PID of the container's init; 0 while `run` is still setting up.
    pub pid: i32,
    /// Field 22 of `/proc/PID/stat` when the init was started (guards against PID reuse).
    pub pid_start_time: u64,
    pub bundle: PathBuf,
    pub rootfs: PathBuf,
    pub cgroup: Option<CgroupRecord>,
    /// RFC 3339 UTC timestamp with nanoseconds, as Go's `time.Time` marshals it.
    pub created: String,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// The lifecycle states `state` reports (the OCI names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Creating,
    Running,
    Paused,
    Stopped,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Status::Creating => "creating",
            Status::Running => "running",
            Status::Paused => "paused",
            Status::Stopped => "stopped",
        })
    }
}

/// The JSON `state` prints: runc's field names and order, so callers can parse either.
#[derive(Debug, Serialize)]
pub struct StateOutput<'a> {
    #[serde(rename = "ociVersion")]
    pub oci_version: &'a str,
    pub id: &'a str,
    pub pid: i32,
    pub status: Status,
    pub bundle: &'a Path,
    pub rootfs: &'a Path,
    pub created: &'a str,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: &'a BTreeMap<String, String>,
    pub owner: &'a str,
}

/// The state root (`--root`).
#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        StateDir { root: root.into() }
    }

    /// `ROOT/ID`, after validating the ID.
    pub fn container_path(&self, id: &str) -> Result<PathBuf, StateError> {
        validate_id(id)?;
        Ok(self.root.join(id))
    }

    /// Creates `ROOT/ID` (and `ROOT` if needed). Fails with `AlreadyExists` if the ID is
    /// taken. The returned guard removes the directory again unless committed.
    pub fn create(&self, id: &str) -> Result<NewContainerDir, StateError> {
        let path = self.container_path(id)?;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.root)
            .map_err(io_err(&self.root))?;
        match fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => Ok(NewContainerDir { path, committed: false }),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(StateError::AlreadyExists(id.to_string())),
            Err(e) => Err(StateError::Io { path, source: e }),
        }
    }

    /// Loads `ROOT/ID/state.json`.
    pub fn load(&self, id: &str) -> Result<ContainerState, StateError> {
        let path = self.container_path(id)?.join(STATE_FILE);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(StateError::NotFound(id.to_string())),
            Err(e) => return Err(StateError::Io { path, source: e }),
        };
        serde_json::from_slice(&bytes).map_err(|source| StateError::Corrupt { path, source })
    }

    /// Whether `ROOT/ID` exists at all (it may lack `state.json` if a `run` crashed).
    pub fn exists(&self, id: &str) -> Result<bool, StateError> {
        Ok(self.container_path(id)?.is_dir())
    }

    /// Writes `ROOT/ID/state.json` atomically.
    pub fn save(&self, state: &ContainerState) -> Result<(), StateError> {
        let dir = self.container_path(&state.id)?;
        write_atomic(
            &dir.join(STATE_FILE),
            &serde_json::to_vec(state)
                .map_err(io::Error::other)
                .map_err(io_err(&dir))?,
        )
        .map_err(io_err(&dir))
    }

    /// Removes `ROOT/ID` and everything in it.
    pub fn remove(&self, id: &str) -> Result<(), StateError> {
        let path = self.container_path(id)?;
        match fs::remove_dir_all(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(StateError::Io { path, source: e }),
            _ => Ok(()),
        }
    }
}

/// A freshly created `ROOT/ID`: removed on drop unless [`NewContainerDir::commit`]ted, so a
/// failed `run` leaves nothing behind.
#[derive(Debug)]
pub struct NewContainerDir {
    path: PathBuf,
    committed: bool,
}

impl NewContainerDir {
    pub fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for NewContainerDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// Replaces `path` with `contents` atomically: a reader sees the old or the new file.
pub fn write_atomic(path: &Path, contents: &[u8]) -> io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("no file name"))?
        .to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(contents)?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// What `/proc/PID/stat` says about a process, for the fields we need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 3: R, S, D, Z, T, ...
    pub state: u8,
    /// Field 22: start time in clock ticks after boot.
    pub start_time: u64,
}

/// Reads fields 3 and 22 of `/proc/PID/stat`. `None` if the process does not exist.
pub fn proc_stat(pid: i32) -> Option<ProcStat> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_proc_stat(&text)
}

/// Parses a `/proc/PID/stat` line. The command name (field 2) is in parentheses and may
/// itself contain spaces and parentheses, so fields are counted after the *last* `)`.
pub fn parse_proc_stat(text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = *fields.next()?.as_bytes().first()?;
    // After the state (field 3) come fields 4..; field 22 is the 19th field after field 3.
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start_time })
}

/// Whether the recorded init process is still the same, live process.
pub fn init_alive(pid: i32, start_time: u64) -> bool {
    if pid <= 0 {
        return false;
    }
    match proc_stat(pid) {
        Some(st) => st.start_time == start_time && st.state != b'Z' && st.state != b'X',
        None => false,
    }
}

/// The current time as RFC 3339 in UTC with nanoseconds (`2024-05-01T12:34:56.123456789Z`),
/// as runc's `state` prints it.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_nanos(SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        for ok in ["a", "A0", "c1.2_3-4", &"x".repeat(128)] {
            validate_id(ok).unwrap();
        }
        for bad in [
            "",
            ".",
            "..",
            "-a",
            "_a",
            ".a",
            "a/b",
            "../x",
            "a b",
            "a\0",
            "é",
            &"x".repeat(129),
        ] {
            assert!(validate_id(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn create_is_exclusive_and_guarded() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = StateDir::new(tmp.path().join("root"));
        let guard = dir.create("c1").unwrap();
        assert!(matches!(dir.create("c1"), Err(StateError::AlreadyExists(_))));
        drop(guard);
        assert!(!dir.exists("c1").unwrap());
        assert!(matches!(dir.load("c1"), Err(StateError::NotFound(_))));
        assert!(matches!(dir.create("../evil"), Err(StateError::InvalidId(_))));

        let guard = dir.create("c1").unwrap();
        let st = ContainerState {
            oci_version: "1.0.2".into(),
            id: "c1".into(),
            pid: 42,
            pid_start_time: 7,
            bundle: "/b".into(),
            rootfs: "/b/rootfs".into(),
            cgroup: None,
            created: now_rfc3339(),
            annotations: BTreeMap::new(),
        };
        dir.save(&st).unwrap();
        guard.commit();
        assert_eq!(dir.load("c1").unwrap(), st);
        dir.remove("c1").unwrap();
        assert!(matches!(dir.load("c1"), Err(StateError::NotFound(_))));
    }

    #[test]
    fn proc_stat_parsing() {
        let line = "1234 (a) b (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 987654 1000 100";
        let st = parse_proc_stat(line).unwrap();
        assert_eq!(st.state, b'S');
        assert_eq!(st.start_time, 987654);
        let me = proc_stat(std::process::id() as i32).unwrap();
        assert!(init_alive(std::process::id() as i32, me.start_time));
        assert!(!init_alive(std::process::id() as i32, me.start_time + 1));
        assert!(!init_alive(0, 0));
    }

    #[test]
    fn the_time_is_rfc3339_with_nanoseconds() {
        let now = now_rfc3339();
        assert_eq!(now.len(), "2024-05-01T12:34:56.123456789Z".len(), "{now}");
        assert!(
            now.starts_with("20") && now.ends_with('Z') && now.as_bytes()[10] == b'T',
            "{now}"
        );
    }
}
