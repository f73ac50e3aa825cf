//! A node's start: every sandbox its state directory says is running or paused taken back,
//! and what no record claims swept away.

use super::*;

/// Loads the state directory and takes charge of every sandbox in it (blocking): killed ones
/// are deleted, the others adopted by the runtime, and a running one whose start command
/// died with the old node-svc is started again.
///
/// One sandbox that cannot be taken back (its container will not start again on this host)
/// does not keep the node down, which would strand every other sandbox with it: it is kept,
/// listed with no process (so it stays accounted, and a kill removes it), and counted in
/// `node_readoption_failures_total`.
pub(super) fn readopt(
    dir: &StateDir,
    runtime: &dyn Runtime,
    disks: &crate::disk::Disks,
) -> Result<Vec<SandboxRecord>, NodeError> {
    dir.create().map_err(io)?;
    let mut adopted = Vec::new();
    for mut record in dir.load().map_err(io)? {
        if record.state == State::Killed {
            let _ = dir.remove(&record.id);
            continue;
        }
        if let Err(err) = readopt_one(dir, runtime, disks, &mut record) {
            tracing::error!(sandbox_id = %record.id, %err, "could not take the sandbox back; it is kept with no process");
            metrics::counter!("node_readoption_failures_total").increment(1);
            record.pgid = 0;
            let _ = dir.persist(&record);
        }
        adopted.push(record);
    }
    Ok(adopted)
}

pub(super) fn readopt_one(
    dir: &StateDir,
    runtime: &dyn Runtime,
    disks: &crate::disk::Disks,
    record: &mut SandboxRecord,
) -> Result<(), NodeError> {
    // Its files where they are now, on its disk (mounted again after a reboot).
    dir.upgrade_layout(&record.id).map_err(io)?;
    disks
        .attach(&dir.sandbox_dir(&record.id), record.resources.disk_bytes)
        .map_err(disk)?;
    runtime.adopt(&record.view())?;
    let alive = runtime.alive(&record.view());
    match readoption(record.state, alive, has_process(runtime, record)) {
        Readoption::AsFound => {}
        Readoption::Restart => {
            record.pgid = runtime.start(&record.view(), &dir.home(&record.id))?;
            tracing::warn!(sandbox_id = %record.id, "start command was not running; restarted");
            dir.persist(record).map_err(io)?;
        }
        Readoption::Stopped => {
            record.pgid = 0;
            dir.persist(record).map_err(io)?;
        }
    }
    tracing::info!(sandbox_id = %record.id, state = ?record.state, alive, "re-adopted sandbox");
    Ok(())
}

/// Removes, at start, what no record accounts for: sandbox folders without a record (creates
/// cut short), with their containers, mounts and groups, and containers the runtime still
/// holds with no folder at all. Such a sandbox was never acknowledged (a create answers only
/// once its record is written), so no manifest can be waiting for it (blocking).
pub(super) fn sweep(dir: &StateDir, runtime: &dyn Runtime, adopted: &[SandboxRecord]) {
    for id in dir.orphans().unwrap_or_default() {
        runtime.discard(&id, &dir.home(&id));
        match crate::disk::remove_folder(&dir.sandbox_dir(&id)) {
            Ok(()) => {
                tracing::warn!(sandbox_id = %id, "removed the folder of a create cut short (no record)");
                metrics::counter!("node_janitor_removed_total", "what" => "folder").increment(1);
            }
            Err(err) => tracing::warn!(sandbox_id = %id, %err, "the folder of a create cut short was not removed"),
        }
    }
    let keep: std::collections::HashSet<String> = adopted.iter().map(|r| r.id.clone()).collect();
    for id in runtime.discard_unknown(&keep) {
        tracing::warn!(sandbox_id = %id, "removed a container no record accounts for");
        metrics::counter!("node_janitor_removed_total", "what" => "container").increment(1);
    }
}

/// What re-adoption does with a sandbox found in the state directory.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Readoption {
    /// Take it as it is.
    AsFound,
    /// Its start command died with the host (or was killed): start it again, files intact.
    Restart,
    /// Its start command is gone and it is paused: forget its process group, so resume
    /// starts the command afresh.
    Stopped,
}

pub(super) fn readoption(state: State, alive: bool, has_command: bool) -> Readoption {
    if alive || !has_command {
        return Readoption::AsFound;
    }
    match state {
        State::Running => Readoption::Restart,
        State::Paused | State::Killed => Readoption::Stopped,
    }
}

/// Whether the sandbox has a process of its own to (re)start: envd, in a runtime that runs it
/// inside every sandbox, or else its start command.
pub(super) fn has_process(runtime: &dyn Runtime, record: &SandboxRecord) -> bool {
    runtime.runs_envd() || has_command(record)
}

pub(super) fn has_command(record: &SandboxRecord) -> bool {
    record.start_command.as_deref().is_some_and(|c| !c.trim().is_empty())
}
