//! Spare disks: new disks made and mounted before a create asks for one.
//!
//! Making a disk on a create's path costs a sparse copy of the blank, a loop device and an
//! ext4 mount: about 1.9 ms of the 12 ms a cold create took on these hosts, the largest share
//! after the container's own start. So the node keeps a few disks of the default size ready in
//! its sandboxes folder, each in a folder of its own (`.spare-UUID/disk.img`, mounted at
//! `.spare-UUID/disk`), and a create takes one by renaming that folder to the sandbox's: one
//! `rename`, since a mount follows the folder it sits in. A worker thread makes the next.
//!
//! - **A spare is a new disk**, a copy of the blank, never one a sandbox had: nothing of one
//!   tenant's reaches another through it.
//! - **Spares are admitted as any disk** (see [`super::admit`]): they count in what the disks
//!   promise. A create takes one only while that promise still fits the host's free space (the
//!   host may have filled since the spare was made), and a disk refused for room (a restore,
//!   a build, a create of another size) is admitted in the room of spares, deleted one at a
//!   time, before it is refused: spares never cost a sandbox its disk.
//! - **Only a folder that does not exist yet** takes one (`RENAME_NOREPLACE`): a restore or a
//!   move brings files into its folder first and makes its disk there, as before.
//! - **Left by a node that stopped**, spares are scratch: a dot-folder of the sandboxes folder,
//!   which the next start deletes with the rest (unmounting first). Dropped with the node's
//!   last [`super::Disks`], the ready ones are deleted at once.
//! - **One that cannot be made** (no room, no loop device) is logged and tried again after a
//!   pause; creates make their own disks meanwhile, exactly as without spares.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The prefix of a spare's folder: a dot-folder, scratch to the node's state directory.
pub const PREFIX: &str = ".spare-";
/// How long the worker waits after a spare could not be made.
const RETRY: Duration = Duration::from_secs(5);

/// The spares of one sandboxes folder; the ready ones are deleted when it is dropped, after
/// its worker has stopped.
pub(super) struct Spares {
    shared: Arc<Shared>,
    worker: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    /// The sandboxes folder: spares are made in it, so a rename moves one into place.
    folder: PathBuf,
    /// The size of every spare (the node's default disk).
    bytes: u64,
    /// How many are kept ready.
    want: usize,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    ready: Vec<PathBuf>,
    closing: bool,
    /// The worker waits with all it wants ready (what a test waits for before it takes any).
    #[cfg_attr(not(test), allow(dead_code))]
    idle: bool,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Spares {
    /// Keeps `want` disks of `bytes` ready in `folder`, made by `maker` (disks without spares
    /// of their own) and readied by `prepare`, on a thread of their own.
    pub(super) fn keep(maker: super::Disks, prepare: super::Prepare, folder: PathBuf, bytes: u64, want: usize) -> Self {
        let shared = Arc::new(Shared {
            folder,
            bytes,
            want,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let worker = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("spare-disks".into())
            .spawn(move || keep_ready(&worker, &maker, &prepare));
        let worker = spawned
            .inspect_err(|err| tracing::warn!(%err, "no thread for spare disks: every create makes its own"))
            .ok();
        Self { shared, worker }
    }

    /// Whether [`Spares::place`] could move a spare to `dir` now.
    pub(super) fn may_place(&self, dir: &Path, bytes: u64) -> bool {
        bytes == self.shared.bytes && std::fs::symlink_metadata(dir).is_err() && !self.shared.state().ready.is_empty()
    }

    /// Deletes one ready spare, giving its room back: whether there was one. The worker is
    /// woken to make another, which its admission refuses (and it pauses) while the room is
    /// still wanted, so spares come back once the host has room again.
    pub(super) fn give_up_one(&self) -> bool {
        let Some(spare) = self.shared.state().ready.pop() else {
            return false;
        };
        tracing::info!(spare = %spare.display(), "a spare disk gives its room to a disk refused for room");
        metrics::counter!("node_spare_disks_given_up_total").increment(1);
        if let Err(err) = super::remove_folder(&spare) {
            tracing::warn!(spare = %spare.display(), %err, "a spare given up could not be deleted; its room is back at the node's next start");
        }
        metrics::gauge!("node_spare_disks_ready").set(self.ready() as f64);
        self.shared.changed.notify_all();
        true
    }

    /// How many spares are ready now.
    pub(super) fn ready(&self) -> usize {
        self.shared.state().ready.len()
    }

    /// Moves a ready spare to `dir` (asked of [`Spares::may_place`] first; a `dir` made since
    /// is never replaced): whether it did (then `dir` holds a mounted, empty disk).
    pub(super) fn place(&self, dir: &Path) -> bool {
        let Some(spare) = self.shared.state().ready.pop() else {
            return false;
        };
        let cwd = rustix::fs::CWD;
        let moved = rustix::fs::renameat_with(cwd, &spare, cwd, dir, rustix::fs::RenameFlags::NOREPLACE);
        // The worker makes the next one once this one has its new name.
        self.shared.changed.notify_all();
        match moved {
            Ok(()) => {
                metrics::counter!("node_spare_disks_taken_total").increment(1);
                metrics::gauge!("node_spare_disks_ready").set(self.ready() as f64);
                true
            }
            // Made meanwhile by someone else: the spare waits for the next create.
            Err(rustix::io::Errno::EXIST) => {
                self.shared.state().ready.push(spare);
                self.shared.changed.notify_all();
                false
            }
            Err(err) => {
                tracing::warn!(spare = %spare.display(), %err, "a spare disk could not be moved; it is deleted");
                let _ = super::remove_folder(&spare);
                false
            }
        }
    }
}

#[cfg(test)]
impl Spares {
    /// Waits until `count` spares are ready and the worker waits for a change, up to
    /// `timeout`: whether they are.
    pub(super) fn wait_ready(&self, count: usize, timeout: Duration) -> bool {
        let state = self.shared.state();
        let (state, _) = self
            .shared
            .changed
            .wait_timeout_while(state, timeout, |s| s.ready.len() != count || !s.idle)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.ready.len() == count && state.idle
    }
}

impl std::fmt::Debug for Spares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spares")
            .field("folder", &self.shared.folder)
            .field("bytes", &self.shared.bytes)
            .field("want", &self.shared.want)
            .finish_non_exhaustive()
    }
}

impl Drop for Spares {
    fn drop(&mut self) {
        self.shared.state().closing = true;
        self.shared.changed.notify_all();
        // The worker deletes a spare it was making; what it made before is in `ready`.
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
        let ready = std::mem::take(&mut self.shared.state().ready);
        for spare in ready {
            let _ = super::remove_folder(&spare);
        }
    }
}

/// The worker: makes a spare whenever fewer than wanted are ready, until the spares are dropped.
fn keep_ready(shared: &Shared, maker: &super::Disks, prepare: &super::Prepare) {
    let mut pause_until: Option<Instant> = None;
    loop {
        {
            let mut state = shared.state();
            loop {
                if state.closing {
                    return;
                }
                let paused = pause_until.filter(|until| Instant::now() < *until);
                match paused {
                    Some(until) => {
                        let wait = until.saturating_duration_since(Instant::now());
                        state = shared
                            .changed
                            .wait_timeout(state, wait)
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .0;
                    }
                    None if state.ready.len() < shared.want => break,
                    None => {
                        state.idle = true;
                        shared.changed.notify_all();
                        state = shared
                            .changed
                            .wait(state)
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        state.idle = false;
                    }
                }
            }
        }
        let spare = shared.folder.join(format!("{PREFIX}{}", uuid::Uuid::new_v4().simple()));
        match maker.attach(&spare, shared.bytes).and_then(|()| prepare(&spare)) {
            Ok(()) => {
                pause_until = None;
                let mut state = shared.state();
                if state.closing {
                    drop(state);
                    let _ = super::remove_folder(&spare);
                    return;
                }
                state.ready.push(spare);
                metrics::gauge!("node_spare_disks_ready").set(state.ready.len() as f64);
                drop(state);
                shared.changed.notify_all();
            }
            Err(err) => {
                // No room is the host's ordinary state at its edge; anything else is news.
                if err.kind() == std::io::ErrorKind::StorageFull {
                    tracing::debug!(%err, "no room for a spare disk; creates make their own meanwhile");
                } else {
                    tracing::warn!(%err, "a spare disk could not be made; creates make their own meanwhile");
                }
                let _ = super::remove_folder(&spare);
                pause_until = Some(Instant::now() + RETRY);
            }
        }
    }
}
