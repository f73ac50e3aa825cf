//! The state directory: where a node keeps its sandboxes so that they outlive the node-svc
//! process.
//!
//! Layout, under the configured state directory:
//!
//! ```text
//! sandboxes/
//!   ID/sandbox.json        the sandbox's SandboxRecord, replaced atomically on every change
//!   ID/disk.img            its disk (see `crate::disk`), mounted at:
//!   ID/disk/home/          its files, which survive pause, restart and migration
//!   ID/disk/work/          overlayfs's work folder (on the same filesystem, as it must be)
//!   ID/container.log       its log (the node's, outside its disk)
//!   .restore-ID-UUID/      a snapshot being unpacked (renamed to ID/ once verified)
//!   .trash-ID-UUID/        a killed sandbox being deleted
//! ```
//!
//! The record and the log stay off the sandbox's disk: a sandbox that fills its disk must not
//! stop the node from writing down what it does with it.
//!
//! Sandbox IDs never start with '.', so dot-folders are always the node's own scratch space;
//! any found at start-up were left by a node-svc that stopped mid-way, and are removed.
//!
//! A record is written to a temporary file, synced, then renamed over `sandbox.json`, so after
//! a crash the file holds either the old record or the new one, never a mix.
//! A kill first renames the sandbox's folder away, so a crash mid-deletion cannot bring the
//! sandbox back at the next start.
//!
//! Every method does blocking filesystem work: the host calls them from `spawn_blocking`.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::sandbox::SandboxRecord;

const RECORD: &str = "sandbox.json";
const RECORD_TMP: &str = "sandbox.json.tmp";
const RESTORE_PREFIX: &str = ".restore-";
const TRASH_PREFIX: &str = ".trash-";

/// The `sandboxes/` folder of a node's state directory.
#[derive(Clone, Debug)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    /// The sandboxes folder of `state_dir` (not created yet: see [`StateDir::create`]).
    pub fn new(state_dir: &Path) -> Self {
        Self {
            root: crate::runtime::layout::sandboxes_dir(state_dir),
        }
    }

    /// Makes the folder, the node's alone (0700): no other host user reaches a sandbox's
    /// files, record or log through it. Sandboxes reach their own files through their
    /// overlays, which act with the node's credentials, never through this path.
    pub fn create(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::create_dir_all(&self.root)?;
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o700))
    }

    /// The `sandboxes/` folder itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Sandbox `id`'s folder.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    /// Where sandbox `id`'s files live (its writable layer, on its disk).
    pub fn home(&self, id: &str) -> PathBuf {
        home_in(&self.sandbox_dir(id))
    }

    /// Writes `record` as its sandbox's `sandbox.json`, atomically.
    pub fn persist(&self, record: &SandboxRecord) -> std::io::Result<()> {
        let dir = self.sandbox_dir(&record.id);
        let tmp = dir.join(RECORD_TMP);
        let json = serde_json::to_vec_pretty(record).map_err(std::io::Error::other)?;
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&json)?;
        file.sync_all()?;
        std::fs::rename(&tmp, dir.join(RECORD))
    }

    /// Every sandbox record found, after removing the scratch folders a previous run left.
    /// A folder whose record is missing or unreadable is logged and left alone, so nothing is
    /// deleted that someone might still want to recover.
    pub fn load(&self) -> std::io::Result<Vec<SandboxRecord>> {
        let mut records = Vec::new();
        for entry in std::fs::read_dir(&self.root)? {
            let entry = entry?;
            let path = entry.path();
            if entry.file_name().to_string_lossy().starts_with('.') {
                tracing::info!(path = %path.display(), "removing scratch left by a previous run");
                let _ = crate::disk::remove_folder(&path);
                continue;
            }
            let Ok(bytes) = std::fs::read(path.join(RECORD)) else {
                continue;
            };
            match serde_json::from_slice(&bytes) {
                Ok(record) => records.push(record),
                Err(err) => {
                    tracing::error!(path = %path.display(), %err, "unreadable sandbox record; left alone");
                }
            }
        }
        Ok(records)
    }

    /// Sandbox folders with no record at all: creates cut short before the record was written
    /// (a create is acknowledged only after it is), which no one can be owed. A folder with an
    /// unreadable record is not one of them (see [`StateDir::load`]).
    pub fn orphans(&self) -> std::io::Result<Vec<String>> {
        let mut orphans = Vec::new();
        for entry in std::fs::read_dir(&self.root)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !entry.file_type()?.is_dir() {
                continue;
            }
            if !entry.path().join(RECORD).exists() {
                orphans.push(name);
            }
        }
        Ok(orphans)
    }

    /// Deletes sandbox `id`'s folder: renamed away first (one atomic step that frees the ID
    /// on disk), then deleted.
    pub fn remove(&self, id: &str) -> std::io::Result<()> {
        crate::disk::remove_folder(&self.discard(id)?)
    }

    /// Renames sandbox `id`'s folder away, to the returned trash folder, which is the caller's
    /// to delete (a node that stops first deletes it at its next start).
    pub fn discard(&self, id: &str) -> std::io::Result<PathBuf> {
        let trash = self.scratch_path(TRASH_PREFIX, id);
        std::fs::rename(self.sandbox_dir(id), &trash)?;
        Ok(trash)
    }

    /// A new empty folder to unpack a snapshot of sandbox `id` into.
    pub fn restore_scratch(&self, id: &str) -> std::io::Result<PathBuf> {
        let scratch = self.scratch_path(RESTORE_PREFIX, id);
        std::fs::create_dir_all(&scratch)?;
        Ok(scratch)
    }

    /// Makes a verified restore folder sandbox `id`'s folder, replacing any left-over one.
    pub fn install(&self, scratch: &Path, id: &str) -> std::io::Result<()> {
        let dir = self.sandbox_dir(id);
        let _ = crate::disk::remove_folder(&dir);
        std::fs::rename(scratch, dir)
    }

    /// Moves the files of a sandbox from before disks (`ID/home`, `ID/work`) to where they
    /// are now (`ID/disk/`), where it has any: a node upgraded under running sandboxes keeps
    /// them. Their overlays hold the folders, not the paths, so a running one goes on.
    pub fn upgrade_layout(&self, id: &str) -> std::io::Result<()> {
        let dir = self.sandbox_dir(id);
        let old = dir.join("home");
        if !old.is_dir() || dir.join(crate::disk::MOUNT).exists() {
            return Ok(());
        }
        let disk = dir.join(crate::disk::MOUNT);
        std::fs::create_dir(&disk)?;
        std::fs::rename(&old, disk.join("home"))?;
        if dir.join("work").is_dir() {
            std::fs::rename(dir.join("work"), disk.join("work"))?;
        }
        tracing::info!(sandbox_id = %id, "moved the sandbox's files into its disk folder (no size limit: it predates disks)");
        Ok(())
    }

    fn scratch_path(&self, prefix: &str, id: &str) -> PathBuf {
        self.root
            .join(format!("{prefix}{id}-{}", uuid::Uuid::new_v4().simple()))
    }
}

pub use crate::runtime::layout::home_in;

/// The janitor thread's nice value (0 normal, 19 lowest).
const JANITOR_NICE: i32 = 10;

/// Deletes killed sandboxes' trash folders one at a time on a thread of its own, after their
/// kills answered: deleting a folder (unmounting its disk, unlinking the image and its files)
/// is the slowest part of a kill, and nobody waits for it. One thread, so a burst of kills
/// queues its deletions rather than occupy every blocking thread. A folder still queued when
/// the node stops is a `.trash-` folder, deleted at the next start ([`StateDir::load`]).
pub struct Janitor {
    queue: std::sync::mpsc::Sender<PathBuf>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Janitor {
    pub fn start() -> Self {
        let (queue, folders) = std::sync::mpsc::channel::<PathBuf>();
        let spawned = std::thread::Builder::new().name("node-janitor".into()).spawn(move || {
            // Below the node's other work: a burst's deletions must not take the CPU from the
            // creates beside them. (A thread's own ID names just that thread here.)
            let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), JANITOR_NICE);
            for folder in folders {
                if let Err(err) = crate::disk::remove_folder(&folder) {
                    tracing::warn!(path = %folder.display(), %err, "a killed sandbox's folder was not deleted");
                }
            }
        });
        let thread = match spawned {
            Ok(thread) => Some(thread),
            Err(err) => {
                // Every folder is then deleted by its kill (below).
                tracing::warn!(%err, "no janitor thread: kills delete their folders themselves");
                None
            }
        };
        Self { queue, thread }
    }

    /// Deletes what is queued, then stops.
    pub fn finish(self) {
        let Self { queue, thread } = self;
        drop(queue);
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }

    /// Deletes `folder` later, or now (on this thread) when the janitor is gone.
    pub fn delete_later(&self, folder: PathBuf) {
        if let Err(std::sync::mpsc::SendError(folder)) = self.queue.send(folder) {
            let _ = crate::disk::remove_folder(&folder);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::{Resources, State};

    fn record(id: &str) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            template: "base".into(),
            resources: Resources {
                vcpus: 1,
                memory_bytes: 1 << 20,
                disk_bytes: 0,
            },
            env: Default::default(),
            metadata: Default::default(),
            start_command: None,
            access_token: None,
            network: None,
            traffic_access_token: None,
            image: None,
            state: State::Running,
            epoch: 1,
            pgid: 0,
            created_at_unix_ms: 0,
            pooled: false,
        }
    }

    fn scratch() -> (PathBuf, StateDir) {
        let base = std::env::temp_dir().join(format!("state-dir-test-{}", uuid::Uuid::new_v4().simple()));
        let dir = StateDir::new(&base);
        dir.create().expect("create");
        (base, dir)
    }

    #[test]
    fn records_persist_load_and_go() {
        let (base, dir) = scratch();
        let mut a = record("a");
        std::fs::create_dir_all(dir.home("a")).expect("home");
        dir.persist(&a).expect("persist");
        a.state = State::Paused;
        dir.persist(&a).expect("persist again");
        assert!(!dir.sandbox_dir("a").join(RECORD_TMP).exists());
        // A folder with a broken record is skipped, not deleted.
        std::fs::create_dir_all(dir.sandbox_dir("broken")).expect("broken");
        std::fs::write(dir.sandbox_dir("broken").join(RECORD), "{").expect("broken record");
        assert_eq!(dir.load().expect("load"), vec![a]);
        assert!(dir.sandbox_dir("broken").exists());

        dir.remove("a").expect("remove");
        assert!(!dir.sandbox_dir("a").exists());
        assert!(dir.load().expect("load").is_empty());
        let _ = std::fs::remove_dir_all(base);
    }

    #[test]
    fn a_discarded_folder_frees_its_id_at_once_and_the_janitor_deletes_it_after() {
        let (base, dir) = scratch();
        std::fs::create_dir_all(dir.home("k").join("deep/er")).expect("home");
        dir.persist(&record("k")).expect("persist");
        let trash = dir.discard("k").expect("discard");
        assert!(!dir.sandbox_dir("k").exists(), "the ID is free on disk");
        assert!(trash.join(RECORD).exists(), "its files wait in the trash");
        let janitor = Janitor::start();
        janitor.delete_later(trash.clone());
        janitor.finish();
        assert!(!trash.exists(), "the janitor deleted it");
        // Left in the trash by a node that stopped first: deleted at the next start.
        std::fs::create_dir_all(dir.home("l")).expect("home");
        let left = dir.discard("l").expect("discard");
        assert!(dir.load().expect("load").is_empty(), "no record brings it back");
        assert!(!left.exists());
        let _ = std::fs::remove_dir_all(base);
    }

    #[test]
    fn a_sandbox_from_before_disks_keeps_its_files() {
        let (base, dir) = scratch();
        std::fs::create_dir_all(dir.sandbox_dir("old").join("home/sub")).expect("home");
        std::fs::create_dir_all(dir.sandbox_dir("old").join("work")).expect("work");
        dir.upgrade_layout("old").expect("upgrade");
        assert!(dir.home("old").join("sub").is_dir());
        assert!(dir.sandbox_dir("old").join("disk/work").is_dir());
        dir.upgrade_layout("old").expect("twice changes nothing");
        assert!(dir.home("old").join("sub").is_dir());
        let _ = std::fs::remove_dir_all(base);
    }

    #[test]
    fn scratch_is_installed_or_swept_at_start() {
        let (base, dir) = scratch();
        let scratch = dir.restore_scratch("r").expect("scratch");
        std::fs::create_dir_all(home_in(&scratch)).expect("home");
        dir.install(&scratch, "r").expect("install");
        assert!(dir.home("r").is_dir() && !scratch.exists());

        // A restore and a deletion interrupted by a crash, one holding a record.
        let left = dir.restore_scratch("s").expect("scratch");
        let trash = dir.scratch_path(TRASH_PREFIX, "t");
        std::fs::create_dir_all(&trash).expect("trash");
        let t = record("t");
        std::fs::write(trash.join(RECORD), serde_json::to_vec(&t).expect("json")).expect("record");
        assert!(dir.load().expect("load").is_empty(), "scratch is never a sandbox");
        assert!(!left.exists() && !trash.exists());
        let _ = std::fs::remove_dir_all(base);
    }
}
