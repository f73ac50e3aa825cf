//! The commands: `run`, `state`, `pause`, `resume`, `kill`, `delete`.
//!
//! Each command is a short script over the other modules. The ones worth reading closely:
//!
//! * [`run`] validates everything it can *before* creating anything (spec, bind sources,
//!   host devices, seccomp profile), then creates the state directory, the cgroup and the
//!   init, in that order, and undoes all three on any failure. Success means the container's
//!   process has executed its program.
//! * [`delete`] with `--force` thaws the cgroup (frozen tasks cannot die), kills every
//!   process in it, waits until it is empty (bounded, 5 s) and removes the cgroup and the
//!   state directory.
//!
//! Status is derived, never stored: the init's PID and start time decide `running` vs
//! `stopped`, the freezer decides `paused`.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cgroup::{Cgroup, CgroupError, Hierarchy};
use crate::cli::RunArgs;
use crate::namespaces;
use crate::process::{self, ProcessError};
use crate::rootfs::{RootfsError, RootfsPlan};
use crate::spec::{self, SpecError};
use crate::state::{self, ContainerState, StateDir, StateError, StateOutput, Status};
use crate::sys::{Errno, IoDisplay};
use crate::{signal, Logger};

/// How long `delete --force` waits for the container's processes to die.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of the commands (the one line the user sees).
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error("only detached containers are supported: pass --detach")]
    NotDetached,
    #[error("--preserve-fds {0} is more than the open-file limit allows")]
    TooManyFds(u32),
    #[error("bundle {path}: {}", IoDisplay(source))]
    Bundle { path: PathBuf, source: io::Error },
    #[error("container \"{id}\" is not running (status: {status})")]
    NotRunning { id: String, status: Status },
    #[error("container \"{0}\" is not paused")]
    NotPaused(String),
    #[error("cannot delete container \"{id}\" that is not stopped: {status} (use --force)")]
    NotStopped { id: String, status: Status },
    #[error("send signal to container \"{id}\": {errno}")]
    Signal { id: String, errno: Errno },
    #[error("write pid file {path}: {}", IoDisplay(source))]
    PidFile { path: PathBuf, source: io::Error },
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Process(#[from] ProcessError),
    #[error(transparent)]
    SignalName(#[from] signal::SignalError),
    #[error(transparent)]
    View(#[from] crate::view::ViewError),
}

/// `run --detach`: create and start the container.
pub fn run(dir: &StateDir, log: &Logger, a: &RunArgs) -> Result<(), ContainerError> {
    run_with_root(dir, log, a, None)
}

/// `run --detach` with the container's root given as a detached mount (`root`), attached at
/// the spec's root path in a mount namespace of this process's own before the container is
/// cloned from it (see [`crate::view`]); as [`run`] without one.
pub fn run_with_root(dir: &StateDir, log: &Logger, a: &RunArgs, root: Option<OwnedFd>) -> Result<(), ContainerError> {
    state::validate_id(&a.id)?;
    if !a.detach {
        return Err(ContainerError::NotDetached);
    }
    // fds 3..3+N must be possible descriptor numbers; this also bounds the work the init does.
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    if u64::from(a.preserve_fds) + 3 > nofile.current.unwrap_or(u64::MAX).min(1 << 20) {
        return Err(ContainerError::TooManyFds(a.preserve_fds));
    }
    let bundle = std::fs::canonicalize(&a.bundle).map_err(|source| ContainerError::Bundle {
        path: a.bundle.clone(),
        source,
    })?;
    let mut config = spec::load(&bundle, &a.id)?;
    if let Some(p) = &config.seccomp {
        if !p.skipped.is_empty() {
            log.warn(&format!(
                "seccomp: skipping system calls unknown on x86_64 (they get the default action): {}",
                p.skipped.join(", ")
            ));
        }
    }
    let rootfs = RootfsPlan::new(&config, a.no_pivot)?;
    let mut cgroup = Cgroup::new(&Hierarchy::detect()?, &config.cgroups_path)?;

    // From here on we create things; each step is undone if a later one fails.
    let new_dir = dir.create(&a.id)?;
    let mut st = ContainerState {
        oci_version: config.oci_version.clone(),
        id: a.id.clone(),
        pid: 0,
        pid_start_time: 0,
        bundle: bundle.clone(),
        rootfs: config.rootfs.clone(),
        cgroup: Some(cgroup.record()),
        created: state::now_rfc3339(),
        annotations: std::mem::take(&mut config.annotations),
    };
    // Written before the cgroup exists, so that `delete` can clean up after a crash.
    dir.save(&st)?;
    let seccomp = config.seccomp.take();
    // Where /proc and /sys are masked around us (a node in a Docker container), the masks are
    // lifted in a mount namespace of this process's own, or the sandbox could not mount its
    // own /proc and /sys.
    if config.namespaces.mount {
        if let Err(e) = namespaces::unmask_proc_and_sys() {
            let _ = cgroup.remove(true);
            return Err(ContainerError::Process(e.into()));
        }
    }
    if let Some(tree) = root {
        if let Err(e) = crate::view::attach_root(tree, Path::new(&config.rootfs)) {
            let _ = cgroup.remove(true);
            return Err(e.into());
        }
    }
    let spawned = cgroup
        .create(&config.resources)
        .map_err(ContainerError::from)
        .and_then(|()| process::spawn(&config, rootfs, seccomp, a.preserve_fds, &cgroup).map_err(Into::into));
    let spawned = match spawned {
        Ok(s) => s,
        Err(e) => {
            let _ = cgroup.remove(true);
            return Err(e);
        }
    };
    st.pid = spawned.pid;
    st.pid_start_time = spawned.start_time;
    let finish = dir
        .save(&st)
        .map_err(ContainerError::from)
        .and_then(|()| match &a.pid_file {
            Some(path) => write_pid_file(path, spawned.pid),
            None => Ok(()),
        });
    if let Err(e) = finish {
        // The container runs but we could not record it: take it down again.
        let _ = cgroup.kill_all(KILL_TIMEOUT);
        let _ = cgroup.remove(true);
        return Err(e);
    }
    new_dir.commit();
    Ok(())
}

fn write_pid_file(path: &Path, pid: i32) -> Result<(), ContainerError> {
    // Atomic, like runc: a reader never sees an empty or partial file.
    state::write_atomic(path, pid.to_string().as_bytes()).map_err(|source| ContainerError::PidFile {
        path: path.to_path_buf(),
        source,
    })
}

/// The container's status, derived from the process and the freezer.
fn status(st: &ContainerState) -> Status {
    if st.pid == 0 {
        return Status::Creating;
    }
    if !state::init_alive(st.pid, st.pid_start_time) {
        return Status::Stopped;
    }
    let frozen = st
        .cgroup
        .as_ref()
        .and_then(|r| Cgroup::from_record(r).ok())
        .and_then(|cg| cg.is_frozen().ok());
    if frozen == Some(true) {
        Status::Paused
    } else {
        Status::Running
    }
}

/// The status of container `id`, as `state` reports it, for a program that links this
/// library rather than parsing the JSON.
pub fn status_of(dir: &StateDir, id: &str) -> Result<Status, ContainerError> {
    Ok(status(&dir.load(id)?))
}

/// `state ID`: runc's JSON.
pub fn state(dir: &StateDir, id: &str) -> Result<String, ContainerError> {
    let st = dir.load(id)?;
    let status = status(&st);
    let out = StateOutput {
        oci_version: &st.oci_version,
        id: &st.id,
        pid: if status == Status::Stopped { 0 } else { st.pid },
        status,
        bundle: &st.bundle,
        rootfs: &st.rootfs,
        created: &st.created,
        annotations: &st.annotations,
        owner: "",
    };
    let mut json = serde_json::to_string_pretty(&out).map_err(|e| StateError::Io {
        path: dir.container_path(id).unwrap_or_default(),
        source: io::Error::other(e),
    })?;
    json.push('\n');
    Ok(json)
}

fn cgroup_of(st: &ContainerState) -> Result<Option<Cgroup>, ContainerError> {
    Ok(match &st.cgroup {
        Some(r) => Some(Cgroup::from_record(r)?),
        None => None,
    })
}

/// `pause ID`.
pub fn pause(dir: &StateDir, id: &str) -> Result<(), ContainerError> {
    let st = dir.load(id)?;
    match status(&st) {
        Status::Running => {}
        status => {
            return Err(ContainerError::NotRunning {
                id: id.to_string(),
                status,
            })
        }
    }
    cgroup_of(&st)?.ok_or(CgroupError::NoFreezer)?.freeze()?;
    Ok(())
}

/// `resume ID`.
pub fn resume(dir: &StateDir, id: &str) -> Result<(), ContainerError> {
    let st = dir.load(id)?;
    if status(&st) != Status::Paused {
        return Err(ContainerError::NotPaused(id.to_string()));
    }
    cgroup_of(&st)?.ok_or(CgroupError::NoFreezer)?.thaw()?;
    Ok(())
}

/// A pidfd for the recorded init, if that exact process (PID + start time) still runs.
/// Holding the pidfd pins the process, so the start-time check cannot race with reuse.
fn init_pidfd(st: &ContainerState) -> Option<OwnedFd> {
    if st.pid <= 0 {
        return None;
    }
    let pid = rustix::process::Pid::from_raw(st.pid)?;
    let fd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()?;
    state::init_alive(st.pid, st.pid_start_time).then_some(fd)
}

/// Signals the init through its pidfd. Raw: the signal is any number a caller names,
/// realtime ones included, which rustix's `Signal` takes only unchecked.
fn send(fd: &OwnedFd, sig: libc::c_int) -> Result<(), Errno> {
    // SAFETY: pidfd_send_signal with a valid pidfd, NULL siginfo and no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            sig,
            std::ptr::null::<u8>(),
            0,
        )
    };
    crate::sys::check_long(rc).map(drop)
}

/// `kill ID [SIGNAL]`: signal the container's init.
pub fn kill(dir: &StateDir, id: &str, signal: Option<&str>) -> Result<(), ContainerError> {
    let sig = signal.map(signal::parse).transpose()?.unwrap_or(signal::DEFAULT);
    let st = dir.load(id)?;
    let status = status(&st);
    let fd = match (status, init_pidfd(&st)) {
        (Status::Running | Status::Paused, Some(fd)) => fd,
        _ => {
            return Err(ContainerError::NotRunning {
                id: id.to_string(),
                status,
            })
        }
    };
    send(&fd, sig).map_err(|errno| ContainerError::Signal {
        id: id.to_string(),
        errno,
    })?;
    if status == Status::Paused && sig == libc::SIGKILL {
        // A frozen task cannot act on SIGKILL; thaw so that it dies (runc does the same).
        if let Some(cg) = cgroup_of(&st)? {
            cg.thaw()?;
        }
    }
    Ok(())
}

/// `delete [--force] ID`.
pub fn delete(dir: &StateDir, id: &str, force: bool) -> Result<(), ContainerError> {
    delete_ending(dir, id, force, None).map(drop)
}

/// As [`delete`], but the container's cgroup, once empty, is reset and renamed to `spare` (a
/// path beside it) for a later container to take, rather than removed; see
/// [`Cgroup::rename`] for why. Where that cannot be (a v2 host, a rename refused) the cgroup
/// is removed as by [`delete`]. Returns whether the cgroup is now at `spare`.
pub fn delete_keeping_cgroup(dir: &StateDir, id: &str, force: bool, spare: &str) -> Result<bool, ContainerError> {
    delete_ending(dir, id, force, Some(spare))
}

fn delete_ending(dir: &StateDir, id: &str, force: bool, spare: Option<&str>) -> Result<bool, ContainerError> {
    let st = match dir.load(id) {
        Ok(st) => st,
        // A `run` that crashed before writing state.json leaves an empty directory.
        Err(StateError::NotFound(_)) if dir.exists(id)? => return Ok(dir.remove(id).map(|()| false)?),
        Err(e) => return Err(e.into()),
    };
    let status = status(&st);
    if !force && matches!(status, Status::Running | Status::Paused) {
        return Err(ContainerError::NotStopped {
            id: id.to_string(),
            status,
        });
    }
    if let Some(fd) = init_pidfd(&st) {
        let _ = send(&fd, libc::SIGKILL);
    }
    let mut kept = false;
    if let Some(cg) = cgroup_of(&st)? {
        if cg.is_frozen().unwrap_or(false) {
            cg.thaw()?;
        }
        cg.kill_all(KILL_TIMEOUT)?;
        // Empty and thawed: as good as new once reset (or, where it cannot be kept, removed,
        // which then says why).
        kept = spare.is_some_and(|spare| cg.retire(spare).is_ok());
        if !kept {
            cg.remove(false)?;
        }
    }
    dir.remove(id)?;
    Ok(kept)
}
