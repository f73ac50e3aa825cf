//! One host's sandboxes: the registry of what runs on this node, and every lifecycle operation
//! (create, pause, resume, kill, snapshot, restore) with its fencing and idempotency rules.
//!
//! This module holds the `Host` every caller uses, its errors and settings; the work is in its
//! children, by what it does: `registry` (a sandbox ID's slot, the turn an operation holds, the
//! answers kept for retries), `create`, `lifecycle` (pause, resume, kill, network, revival),
//! `migrate` (capture, snapshot, restore), `readopt` (a node's start) and `picture` (what a
//! heartbeat reports).
//!
//! What lives elsewhere: the on-disk layout and its atomic writes in [`crate::state_dir`],
//! archiving and unpacking snapshots in [`crate::snapshot`], templates in [`crate::template`],
//! and the pure rules (legal moves, fencing, operation answers) in [`crate::sandbox`].
//!
//! # Locking
//!
//! The node answers many callers at once: envd requests look their sandbox up on every call,
//! heartbeats list every sandbox, and lifecycle calls change them. A kill can take seconds
//! (processes to reap, a home to delete), and must hold up only operations on the same
//! sandbox. So:
//!
//! - the registry map (`slots`) is a plain mutex held only to look up, insert or remove a
//!   sandbox's `Slot`: never across an await, I/O or a runtime call;
//! - each sandbox's slot has a *turn*, an async mutex held for the whole of one operation on
//!   that sandbox: operations on one sandbox run one at a time, in the order they queued,
//!   while operations on others run beside them;
//! - each slot also holds the sandbox's *committed record*, behind a plain mutex held only to
//!   copy or replace it. Operations replace it once their work is done and persisted; readers
//!   (`get`, `list`, heartbeats) copy it at any time without waiting for a turn, so they see
//!   a sandbox as it was before an operation in progress, then as it is after;
//! - blocking work (template copies, fsync, deleting a home, every runtime call) runs on
//!   `spawn_blocking` threads, never on the async executor;
//! - an operation that changes sandboxes runs in a task of its own, so a caller that goes
//!   away mid-way cannot end a turn while its blocking work still runs.
//!
//! A slot's record is `None` while its sandbox is being created and once it is gone; a slot
//! left empty at the end of a turn leaves the map. A caller that queued for the turn of a slot
//! that left meanwhile sees it is no longer the map's and queues again on the current one, so
//! two operations on one ID never run at once.
//!
//! Operation IDs: a call whose ID already has an answer gets that answer and does nothing.
//! The answers are checked again once the call has its turn, so a retry that queued behind
//! the first attempt gets the first attempt's answer rather than acting twice.
//!
//! The state directory holds each sandbox's record and home. On start the host re-adopts
//! every sandbox the directory says is running or paused, so a node restart loses none.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use common::clock::now_ms;
use tokio::sync::{mpsc, OwnedMutexGuard};
use tracing::Instrument;

use crate::runtime::{Features, Runtime, RuntimeError};
use crate::sandbox::{
    fence, next_state, on_existing, Answers, Move, OnExisting, Recall, Refusal, Resources, SandboxRecord, State,
};
use crate::snapshot::{self, RestoreItem, SnapshotError, SnapshotPart};
use crate::state_dir::StateDir;
use crate::template::{self, Template, TemplateError};
use crate::usage::CpuRate;

mod claim;
mod create;
mod lifecycle;
mod migrate;
mod picture;
mod readopt;
mod registry;

pub use claim::Claim;
use create::validate_id;
use picture::{measure, own_rss, picture_of, Measured};
use readopt::{has_process, readopt, sweep};
use registry::{Admission, Slot, Turn};

/// Answers kept for operation-ID retries: at most this many...
const ANSWERS_KEPT: usize = 10_000;
/// ...for at most this long (retries come within seconds; a move's next executor within a
/// lease's time to live).
const ANSWERS_MAX_AGE_MS: u64 = 5 * 60 * 1000;

/// Why a node operation failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0}")]
    Invalid(String),
    #[error("sandbox {0} does not exist on this node")]
    NotFound(String),
    #[error("sandbox {0} already exists on this node")]
    AlreadyExists(String),
    #[error("template {0:?} is not on this node")]
    UnknownTemplate(String),
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("operation id {operation_id} was already used for {first}")]
    OperationReused { operation_id: String, first: String },
    #[error("{0}")]
    Runtime(String),
    #[error("state directory: {0}")]
    Io(String),
    #[error("snapshot corrupted: {0}")]
    Corrupt(String),
    /// The node has no room for what was asked (another node may).
    #[error("{0}")]
    NoRoom(String),
}

impl From<SnapshotError> for NodeError {
    fn from(err: SnapshotError) -> Self {
        match err {
            SnapshotError::Archive(message) => NodeError::Io(message),
            SnapshotError::Corrupt(message) => NodeError::Corrupt(message),
        }
    }
}

impl From<RuntimeError> for NodeError {
    fn from(err: RuntimeError) -> Self {
        NodeError::Runtime(err.to_string())
    }
}

impl From<TemplateError> for NodeError {
    fn from(err: TemplateError) -> Self {
        match err {
            TemplateError::Unknown(name) => NodeError::UnknownTemplate(name),
            invalid @ TemplateError::Invalid { .. } => NodeError::Invalid(invalid.to_string()),
        }
    }
}

fn io(err: impl std::fmt::Display) -> NodeError {
    NodeError::Io(err.to_string())
}

/// A sandbox's disk could not be made or mounted.
fn disk(err: std::io::Error) -> NodeError {
    if err.kind() == std::io::ErrorKind::StorageFull {
        return NodeError::NoRoom(format!("the sandbox's disk: {err}"));
    }
    NodeError::Runtime(format!("the sandbox's disk: {err}"))
}

/// How a host runs.
#[derive(Clone, Debug)]
pub struct HostConfig {
    pub node_id: String,
    pub state_dir: PathBuf,
    /// Folder of templates: `NAME/template.json` and `NAME/files/`. `base` always exists.
    pub templates_dir: Option<PathBuf>,
    pub capacity: Resources,
    /// The cluster's blob store (`blobs::from_url`), where template layers come from; `None`:
    /// only templates without layers (the built-in base) can run here.
    pub blob_store: Option<String>,
    /// How many bytes of template layers the node keeps cached.
    pub layer_cache_bytes: u64,
    /// Registries (`host:port`) a build may pull from although they resolve to an address of
    /// the egress floor (a registry on the operator's private network or on loopback).
    pub private_registries: Vec<String>,
    /// The egress floor (set by the server from the network's): a registry resolving into it
    /// is refused, or a build could make the node fetch from the control plane's own network.
    pub registry_floor: Vec<common::egress::Cidr>,
    /// The disk of a sandbox that asks for no size (see `crate::disk`).
    pub disk_bytes: u64,
    /// The disk of a template build's builder containers.
    pub build_disk_bytes: u64,
    /// Whether sandboxes get disks of their own where the runtime isolates them (off: their
    /// files in plain folders of the state directory, unbounded; for measuring what disks
    /// cost, or a host whose state filesystem is bounded per tenant some other way).
    pub own_disks: bool,
    /// How many times the host's free space sandboxes' disks may promise together (1: never
    /// more than it has; see `crate::disk::admit`).
    pub disk_overcommit: f64,
    /// How many disks of the default size the node keeps made and mounted before creates ask
    /// for them (0: each create makes its own; see `node_runtime::disk`'s spares).
    pub spare_disks: usize,
}

/// Spare disks a node keeps unless told otherwise: two, enough for the creates of one moment
/// while the next is made (each takes about 2 ms of a core to make).
pub const DEFAULT_SPARE_DISKS: usize = 2;

/// Template layers a node keeps cached unless told otherwise: 20 GiB.
pub const DEFAULT_LAYER_CACHE_BYTES: u64 = 20 << 30;

/// A sandbox's disk unless it asks for another size: the size the gateway writes into a
/// manifest that states none, so a node's spare disks (made at this size) fit the creates
/// that come by default.
pub const DEFAULT_DISK_BYTES: u64 = common::resources::DEFAULT_DISK_BYTES;

/// A builder container's disk unless told otherwise: 8 GiB (package installs need room).
pub const DEFAULT_BUILD_DISK_BYTES: u64 = 8 << 30;

/// What a create asks for.
#[derive(Clone, Debug, Default)]
pub struct CreateSpec {
    pub operation_id: String,
    pub epoch: u64,
    pub sandbox_id: String,
    pub template: String,
    pub resources: Resources,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub start_command: Option<String>,
    pub access_token: Option<String>,
    pub network: Option<common::egress::NetworkPolicy>,
    pub traffic_access_token: Option<String>,
    /// Its template's build (`None`: the built-in base).
    pub image: Option<common::template::Image>,
    /// Started for a template's warm pool, to wait unclaimed.
    pub pooled: bool,
}

/// How long a template's ready check may take to pass at create.
pub const READY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(120);

/// One sandbox in a heartbeat.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reported {
    pub sandbox_id: String,
    pub state: State,
    pub resources: Resources,
    pub memory_used_bytes: u64,
}

/// A consistent picture of the host for one heartbeat.
#[derive(Clone, Debug, PartialEq)]
pub struct Picture {
    pub sandboxes: Vec<Reported>,
    pub allocated: Resources,
    /// What its pooled sandboxes (a warm pool's, unclaimed) hold of `allocated`.
    pub pooled: Resources,
    pub memory_used_bytes: u64,
    pub memory_available_bytes: u64,
    /// vCPUs the sandboxes used lately (0 where the runtime does not measure CPU time).
    pub cpu_usage: f64,
}

type Answer = Result<SandboxRecord, NodeError>;

/// Locks one of the registry's plain mutexes. Their critical sections only copy or replace
/// values, so a panic elsewhere cannot leave the data half-changed: a poisoned lock is used
/// as it is rather than failing every later request.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Entries a disk-usage walk of one writable layer may visit per sample.
const DISK_WALK_BUDGET: usize = 200_000;

/// Bytes the filesystem holding `path` has in all.
fn disk_total(path: &std::path::Path) -> u64 {
    match rustix::fs::statvfs(path) {
        Ok(stat) => stat.f_blocks.saturating_mul(stat.f_frsize),
        Err(_) => 0,
    }
}

/// Runs blocking `work` on a `spawn_blocking` thread.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, NodeError> + Send + 'static,
) -> Result<T, NodeError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| NodeError::Runtime(format!("blocking task failed: {e}")))?
}

/// The sandboxes of one node.
pub struct Host {
    shared: Arc<Shared>,
    boot_id: String,
    cpu: Mutex<CpuRate>,
    /// Each sandbox's metrics series.
    book: Mutex<crate::metrics::Book>,
}

/// What every operation works on. Behind an `Arc` because operations that change sandboxes
/// run in tasks of their own (see [`to_completion`]).
struct Shared {
    config: HostConfig,
    runtime: Arc<dyn Runtime>,
    dir: StateDir,
    /// Sandbox ID → its slot. Held only to look up, insert or remove slots.
    slots: Mutex<HashMap<String, Arc<Slot>>>,
    /// Answers to recent operation IDs.
    answers: Mutex<Answers<Answer>>,
    /// Template layers, fetched from the blob store.
    layers: Option<Arc<crate::layer_cache::LayerCache>>,
    /// Each sandbox's disk.
    disks: crate::disk::Disks,
    /// Deletes killed sandboxes' folders after their kills answered.
    janitor: crate::state_dir::Janitor,
    /// Kills whose runtime work may run at once (see [`kills_at_once`]).
    kills: Arc<tokio::sync::Semaphore>,
}

/// How many kills (those of `lifecycle_now`: a user's, the reaper's, a move's source, a pool's
/// retirement) do their runtime work at once: four per core. A kill is mostly CPU (the
/// container's processes ended, its mounts and namespaces torn down, about 4–5 ms of it) with
/// some waiting (processes exiting), so a few per core keep the cores busy; every one more
/// only takes its share of the CPU from the creates beside it. Unbounded, 300 kills at once
/// (a reaper's sweep, a team's clean-up) had 300 threads in the runtime, and a create made
/// meanwhile waited 0.2–0.5 s; bounded, 40–55 ms, while the burst itself went 7–25 % slower
/// (`bench node --kill-burst 300`). The rest of a burst queues here, holding its sandbox's turn
/// (and a restore's replace, the copy it unpacked).
fn kills_at_once() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()) * 4
}

/// Access to a running sandbox's files for one envd request; a pause waits until it is
/// dropped.
pub struct FileAccess {
    pub record: SandboxRecord,
    _held: tokio::sync::OwnedRwLockReadGuard<()>,
}

/// Runs an operation that changes sandboxes in a task of its own and waits for it. A caller
/// that goes away (a client that disconnects, a gRPC deadline) drops only the waiting: the
/// operation still finishes, its turn held until its blocking work is done, so no half-made
/// or half-deleted sandbox is left for the next operation on that ID to trip over.
async fn to_completion<T: Send + 'static>(
    operation: impl std::future::Future<Output = Result<T, NodeError>> + Send + 'static,
) -> Result<T, NodeError> {
    tokio::spawn(operation.in_current_span())
        .await
        .map_err(|e| NodeError::Runtime(format!("operation task failed: {e}")))?
}

/// A sandbox's turn, held while its snapshot streams (see [`Host::snapshot_stream`]).
pub struct SnapshotHold {
    _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Host {
    /// Evicts layers past the layer cache's bound (a build's pulls and steps fill it as
    /// creates do), keeping every sandbox's here and `image`'s.
    pub fn make_room_for(&self, image: &common::template::Image) {
        if let Some(cache) = &self.shared.layers {
            self.shared.make_room(cache, image);
        }
    }

    /// Opens the state directory and re-adopts every sandbox it records as running or paused.
    /// `runtime` runs the sandboxes: any [`Runtime`], so tests may wrap a real one.
    pub async fn open(config: HostConfig, runtime: Arc<dyn Runtime>) -> Result<Self, NodeError> {
        let dir = StateDir::new(&config.state_dir);
        let disks = crate::disk::Disks::probe(runtime.own_disks() && config.own_disks, config.disk_bytes)
            .with_blanks(config.state_dir.join("container").join("disks"))
            .with_overcommit(config.disk_overcommit);
        let adopted = {
            let (dir, runtime, disks) = (dir.clone(), runtime.clone(), disks.clone());
            blocking(move || {
                let adopted = readopt(&dir, runtime.as_ref(), &disks)?;
                sweep(&dir, runtime.as_ref(), &adopted);
                Ok(adopted)
            })
            .await?
        };
        // Made once the folder is swept: the sweep deletes every dot-folder a previous run left.
        // Weak: the spares' worker must not keep the runtime (and its network slots) alive
        // past the host that owns it.
        let prepare = {
            let runtime = Arc::downgrade(&runtime);
            Arc::new(move |dir: &std::path::Path| match runtime.upgrade() {
                Some(runtime) => runtime.prepare_disk(dir),
                None => Err(std::io::Error::other("the node's runtime is gone")),
            })
        };
        let disks = disks.with_spares(dir.root().to_path_buf(), config.spare_disks, prepare);
        let slots = adopted
            .into_iter()
            .map(|record| {
                let slot = Slot {
                    record: Mutex::new(Some(record.clone())),
                    ..Slot::default()
                };
                (record.id, Arc::new(slot))
            })
            .collect();
        let layers = match &config.blob_store {
            Some(url) => {
                let store = blobs::from_url(url).map_err(|e| NodeError::Invalid(format!("blob store {url:?}: {e}")))?;
                Some(Arc::new(crate::layer_cache::LayerCache::new(
                    crate::layer_cache::root(&config.state_dir),
                    store,
                    config.layer_cache_bytes,
                )))
            }
            None => None,
        };
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                runtime,
                dir,
                slots: Mutex::new(slots),
                answers: Mutex::new(Answers::new(ANSWERS_KEPT, ANSWERS_MAX_AGE_MS)),
                layers,
                disks,
                janitor: crate::state_dir::Janitor::start(),
                kills: Arc::new(tokio::sync::Semaphore::new(kills_at_once())),
            }),
            boot_id: uuid::Uuid::new_v4().to_string(),
            cpu: Mutex::new(CpuRate::default()),
            book: Mutex::new(crate::metrics::Book::default()),
        })
    }

    pub fn node_id(&self) -> &str {
        &self.shared.config.node_id
    }

    pub fn boot_id(&self) -> &str {
        &self.boot_id
    }

    pub fn capacity(&self) -> Resources {
        self.shared.config.capacity
    }

    /// Template builds whose layers this node holds (for placement).
    pub fn templates_held(&self) -> Vec<String> {
        self.shared.layers.as_ref().map_or_else(Vec::new, |cache| cache.held())
    }

    /// The node's template layers, when it has a blob store.
    pub fn layers(&self) -> Option<&Arc<crate::layer_cache::LayerCache>> {
        self.shared.layers.as_ref()
    }

    pub fn runtime(&self) -> &Arc<dyn Runtime> {
        &self.shared.runtime
    }

    pub fn runtime_kind(&self) -> &'static str {
        self.shared.runtime.kind()
    }

    pub fn features(&self) -> Features {
        let mut features = self.shared.runtime.features();
        if self.shared.runtime.own_disks() {
            features.degraded.extend(self.shared.disks.degraded());
        }
        features
    }

    /// Each sandbox's disk.
    pub fn disks(&self) -> &crate::disk::Disks {
        &self.shared.disks
    }

    /// Where a sandbox's files live.
    pub fn home(&self, id: &str) -> PathBuf {
        self.shared.dir.home(id)
    }

    /// A sandbox's whole folder (its home and the runtime's parts beside it).
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.shared.dir.sandbox_dir(id)
    }

    pub fn state_dir(&self) -> &std::path::Path {
        &self.shared.config.state_dir
    }

    /// The host's configuration.
    pub fn config(&self) -> &HostConfig {
        &self.shared.config
    }

    /// Captures a sandbox's files as a template image (its template's layers plus one of what
    /// it wrote), fenced by `epoch`; a running sandbox is frozen meanwhile and continues.
    pub async fn capture(&self, epoch: u64, sandbox_id: &str) -> Result<common::template::Image, NodeError> {
        let shared = self.shared.clone();
        let id = sandbox_id.to_string();
        to_completion(async move { shared.capture(epoch, &id).await }).await
    }

    /// Creates and starts a sandbox.
    pub async fn create(&self, spec: CreateSpec) -> Result<SandboxRecord, NodeError> {
        let shared = self.shared.clone();
        to_completion(async move { shared.create(spec).await }).await
    }

    /// Pause, resume or kill, fenced by `epoch`.
    pub async fn lifecycle(
        &self,
        operation_id: &str,
        epoch: u64,
        sandbox_id: &str,
        action: Move,
    ) -> Result<SandboxRecord, NodeError> {
        let shared = self.shared.clone();
        let (operation_id, sandbox_id) = (operation_id.to_string(), sandbox_id.to_string());
        to_completion(async move { shared.lifecycle(&operation_id, epoch, &sandbox_id, action).await }).await
    }

    /// Replaces the network policy of a running or paused sandbox, fenced like a lifecycle
    /// move; the record keeps it, so a snapshot (a move, a restore) carries it on.
    pub async fn update_network(
        &self,
        operation_id: &str,
        epoch: u64,
        sandbox_id: &str,
        policy: common::egress::NetworkPolicy,
    ) -> Result<SandboxRecord, NodeError> {
        let shared = self.shared.clone();
        let (operation_id, sandbox_id) = (operation_id.to_string(), sandbox_id.to_string());
        to_completion(async move { shared.update_network(&operation_id, epoch, &sandbox_id, policy).await }).await
    }

    /// Hands a running sandbox of a warm pool to the create that claimed it, fenced like a
    /// lifecycle move (see [`Claim`]).
    pub async fn claim(
        &self,
        operation_id: &str,
        epoch: u64,
        sandbox_id: &str,
        claim: Claim,
    ) -> Result<SandboxRecord, NodeError> {
        let shared = self.shared.clone();
        let (operation_id, sandbox_id) = (operation_id.to_string(), sandbox_id.to_string());
        to_completion(async move { shared.claim(&operation_id, epoch, &sandbox_id, claim).await }).await
    }

    /// Starts again every running sandbox whose envd died under it (the OOM killer took it, a
    /// bug ended it): with envd gone the container ends, every process in it with it, and a
    /// sandbox left so would be listed running while nothing answers. It comes back as after
    /// a node restart: files kept, processes started afresh (its start command too), the
    /// event in its log.
    pub async fn revive(&self) {
        if !self.shared.runtime.runs_envd() {
            return;
        }
        let records = self.shared.records();
        let runtime = self.shared.runtime.clone();
        let dead = tokio::task::spawn_blocking(move || {
            records
                .into_iter()
                .filter(|r| r.state == State::Running && runtime.died(&r.view()))
                .map(|r| r.id)
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default();
        for id in dead {
            let shared = self.shared.clone();
            let sandbox = id.clone();
            // Waited for a while only: its turn may be held (a snapshot streaming, if it was
            // paused meanwhile), and the other sandboxes' revival must not wait for that. The
            // revival goes on by itself, and checks again under its turn.
            let revived = to_completion(async move { shared.revive(&sandbox).await });
            match tokio::time::timeout(std::time::Duration::from_secs(5), revived).await {
                Ok(Err(err)) => {
                    tracing::error!(sandbox_id = %id, %err, "a sandbox whose envd died could not be started again")
                }
                Ok(Ok(())) => {}
                Err(_) => {
                    tracing::info!(sandbox_id = %id, "reviving a sandbox waits for its turn; the next sandboxes go on")
                }
            }
        }
    }

    /// Takes one metrics sample of every sandbox (on a blocking thread: it reads cgroup
    /// counters and walks writable layers).
    pub async fn sample(&self) {
        let records = self.shared.records();
        let runtime = self.shared.runtime.clone();
        let dir = self.shared.dir.clone();
        let readings = tokio::task::spawn_blocking(move || {
            let host_disk = disk_total(dir.root());
            // What the disks may still take from the host, beside the host's own free space
            // (`node_disk_free_bytes`): the room a create is admitted against.
            if let Ok(promised) = crate::disk::promised(dir.root()) {
                metrics::gauge!("node_disk_promised_bytes").set(promised.bytes as f64);
            }
            if let Ok(free) = crate::disk::free_bytes(dir.root()) {
                metrics::gauge!("node_disk_free_bytes").set(free as f64);
            }
            records
                .into_iter()
                .map(|record| {
                    // Its own disk where it has one (exact, and one call); else its files
                    // walked, out of the host's disk.
                    let (disk_used_bytes, disk_total_bytes) = crate::disk::usage(&dir.sandbox_dir(&record.id))
                        .unwrap_or_else(|| {
                            (
                                crate::metrics::disk_usage(&dir.home(&record.id), DISK_WALK_BUDGET),
                                host_disk,
                            )
                        });
                    if let Some(log) = runtime.log_file(&dir.home(&record.id)) {
                        crate::logs::cap(&log);
                    }
                    let reading = crate::metrics::Reading {
                        at_unix_ms: common::clock::now_ms(),
                        cpu_time_ns: runtime.cpu_time_ns_of(&record.view()),
                        vcpus: record.resources.vcpus,
                        memory_used_bytes: runtime.memory_used(&record.view()),
                        memory_total_bytes: record.resources.memory_bytes,
                        disk_used_bytes,
                        disk_total_bytes,
                    };
                    (record.id, reading)
                })
                .collect::<Vec<_>>()
        })
        .await;
        let Ok(readings) = readings else { return };
        let mut book = lock(&self.book);
        let live: Vec<String> = readings.iter().map(|(id, _)| id.clone()).collect();
        book.retain(&live);
        for (id, reading) in readings {
            book.record(&id, reading);
        }
    }

    /// The entries of a sandbox's log that `query` asks for (none where its runtime keeps
    /// no log).
    pub async fn logs(&self, sandbox_id: &str, query: crate::logs::Query) -> Vec<crate::logs::Entry> {
        if validate_id(sandbox_id).is_err() {
            return Vec::new();
        }
        let Some(log) = self.shared.runtime.log_file(&self.shared.dir.home(sandbox_id)) else {
            return Vec::new();
        };
        tokio::task::spawn_blocking(move || crate::logs::select(&crate::logs::tail(&log), &query))
            .await
            .unwrap_or_default()
    }

    /// Metrics samples of one sandbox within `[start, end]` (unix ms), oldest first.
    pub fn metrics(&self, sandbox_id: &str, start_ms: u64, end_ms: u64) -> Vec<crate::metrics::Sample> {
        lock(&self.book).window(sandbox_id, start_ms, end_ms)
    }

    /// The running sandbox `sandbox_id` with its files held for one request: waits while a
    /// pause is under way, and answers `None` unless the sandbox runs once it may go on. A
    /// write accepted here completes before any pause of the sandbox takes effect.
    pub async fn file_access(&self, sandbox_id: &str) -> Option<FileAccess> {
        let slot = lock(&self.shared.slots).get(sandbox_id).cloned()?;
        let held = slot.files.clone().read_owned().await;
        let record = lock(&slot.record).clone()?;
        (record.state == State::Running).then_some(FileAccess { record, _held: held })
    }

    /// One sandbox, as last committed (never waits for an operation on it).
    pub async fn get(&self, sandbox_id: &str) -> Option<SandboxRecord> {
        self.shared.committed(sandbox_id)
    }

    /// The IDs of every sandbox of this node.
    pub async fn list_ids(&self) -> Vec<String> {
        self.shared.records().into_iter().map(|r| r.id).collect()
    }

    /// Every sandbox with the memory it uses now.
    pub async fn list(&self) -> Vec<(SandboxRecord, u64)> {
        let records = self.shared.records();
        let runtime = self.shared.runtime.clone();
        match tokio::task::spawn_blocking(move || measure(runtime.as_ref(), records)).await {
            Ok(listed) => listed,
            Err(err) => {
                tracing::error!(%err, "measuring sandboxes failed; listing them without");
                self.shared.records().into_iter().map(|r| (r, 0)).collect()
            }
        }
    }

    /// The picture a heartbeat reports: the list and the totals from one snapshot of the
    /// registry, measured on a blocking thread.
    pub async fn picture(&self) -> Picture {
        let records = self.shared.records();
        let runtime = self.shared.runtime.clone();
        let measured = tokio::task::spawn_blocking(move || {
            runtime.reap();
            Measured {
                listed: measure(runtime.as_ref(), records),
                cpu_time_ns: runtime.cpu_time_ns(),
                own_rss: own_rss(),
            }
        })
        .await;
        let measured = measured.unwrap_or_else(|err| {
            tracing::error!(%err, "measuring sandboxes failed; reporting them without");
            Measured {
                listed: self.shared.records().into_iter().map(|r| (r, 0)).collect(),
                cpu_time_ns: None,
                own_rss: 0,
            }
        });
        let cpu_usage = measured
            .cpu_time_ns
            .map_or(0.0, |ns| lock(&self.cpu).observe(std::time::Instant::now(), ns));
        let picture = picture_of(
            measured.listed,
            self.shared.config.capacity,
            measured.own_rss,
            cpu_usage,
        );
        let (running, paused) = picture.sandboxes.iter().fold((0u32, 0u32), |(r, p), s| match s.state {
            State::Running => (r + 1, p),
            State::Paused => (r, p + 1),
            State::Killed => (r, p),
        });
        metrics::gauge!("node_sandboxes", "state" => "running").set(f64::from(running));
        metrics::gauge!("node_sandboxes", "state" => "paused").set(f64::from(paused));
        picture
    }

    /// Checks a snapshot may be taken (paused, epoch current) and returns the record, with
    /// the sandbox's turn for [`Host::snapshot_stream`].
    pub async fn snapshot_source(
        &self,
        epoch: u64,
        sandbox_id: &str,
    ) -> Result<(SandboxRecord, SnapshotHold), NodeError> {
        let shared = self.shared.clone();
        let sandbox_id = sandbox_id.to_string();
        to_completion(async move { shared.snapshot_source(epoch, &sandbox_id).await })
            .await
            .map(|(record, held)| (record, SnapshotHold { _turn: held }))
    }

    /// Streams the sandbox's home as a tar archive in chunks; the last item is the SHA-256
    /// of all the data and its length. The sandbox's turn is held until the archive ends:
    /// the walk reads the tenant's files by path, and a sandbox resumed meanwhile could swap a
    /// folder it has read for a link to the host's.
    pub fn snapshot_stream(
        &self,
        sandbox_id: &str,
        hold: SnapshotHold,
    ) -> mpsc::Receiver<Result<SnapshotPart, SnapshotError>> {
        snapshot::stream(self.shared.dir.home(sandbox_id), hold)
    }

    /// Recreates a sandbox from a snapshot: unpacks the archive chunks from `data` into a
    /// scratch folder, checks the SHA-256 against the trailer, then installs it, paused.
    pub async fn restore(
        &self,
        operation_id: &str,
        epoch: u64,
        record: SandboxRecord,
        data: mpsc::Receiver<RestoreItem>,
    ) -> Result<SandboxRecord, NodeError> {
        let shared = self.shared.clone();
        let operation_id = operation_id.to_string();
        to_completion(async move { shared.restore(&operation_id, epoch, record, data).await }).await
    }
}

#[cfg(test)]
mod tests {
    use super::create::new_record;
    use super::readopt::{readoption, Readoption};
    use super::registry::is_final;
    use super::*;
    use crate::runtime::sim::SimRuntime;

    const MIB: u64 = 1 << 20;

    fn record(id: &str, state: State, memory_bytes: u64) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            template: "base".into(),
            resources: Resources {
                vcpus: 1,
                memory_bytes,
                disk_bytes: 0,
            },
            env: BTreeMap::new(),
            metadata: BTreeMap::new(),
            start_command: None,
            access_token: None,
            network: None,
            traffic_access_token: None,
            image: None,
            state,
            epoch: 1,
            pgid: 0,
            created_at_unix_ms: 0,
            pooled: false,
        }
    }

    #[test]
    fn ids_are_plain_names() {
        for good in ["a", "sbx-1_2.3", &"x".repeat(128)] {
            assert!(validate_id(good).is_ok(), "{good}");
        }
        for bad in ["", ".hidden", "a/b", "..", "a b", &"x".repeat(129)] {
            assert!(validate_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_new_record_takes_the_spec_over_the_template() {
        let template = Template {
            env: [("A".into(), "template".into()), ("B".into(), "template".into())].into(),
            start_command: Some("from-template".into()),
            files: None,
        };
        let spec = CreateSpec {
            sandbox_id: "s".into(),
            env: [("A".into(), "spec".into())].into(),
            start_command: Some(String::new()),
            access_token: Some(String::new()),
            epoch: 4,
            ..Default::default()
        };
        let r = new_record(spec, template, 99);
        assert_eq!(r.env.get("A").map(String::as_str), Some("spec"));
        assert_eq!(r.env.get("B").map(String::as_str), Some("template"));
        assert_eq!(r.start_command.as_deref(), Some("from-template"));
        assert_eq!(r.access_token, None, "an empty token is no token");
        assert_eq!(
            (r.template.as_str(), r.state, r.epoch, r.created_at_unix_ms),
            ("base", State::Running, 4, 99)
        );
    }

    #[test]
    fn readoption_restarts_only_a_running_sandbox_whose_command_died() {
        assert_eq!(readoption(State::Running, true, true), Readoption::AsFound);
        assert_eq!(readoption(State::Running, false, false), Readoption::AsFound);
        assert_eq!(readoption(State::Running, false, true), Readoption::Restart);
        assert_eq!(readoption(State::Paused, false, true), Readoption::Stopped);
        assert_eq!(readoption(State::Paused, true, true), Readoption::AsFound);
    }

    #[test]
    fn only_final_answers_are_kept() {
        assert!(is_final(&Ok(record("s", State::Running, MIB))));
        assert!(is_final(&Err(NodeError::NotFound("s".into()))));
        // A corrupt stream deserves a fresh attempt with a fresh stream.
        assert!(!is_final(&Err(NodeError::Corrupt("x".into()))));
        assert!(!is_final(&Err(NodeError::Io("disk".into()))));
        assert!(!is_final(&Err(NodeError::Runtime("stuck".into()))));
    }

    #[test]
    fn a_picture_sums_allocations_and_use() {
        let pooled = SandboxRecord {
            pooled: true,
            ..record("c", State::Running, 400 * MIB)
        };
        let listed = vec![
            (record("a", State::Running, 100 * MIB), 10 * MIB),
            (record("b", State::Paused, 200 * MIB), 20 * MIB),
            (pooled, 0),
        ];
        let capacity = Resources {
            vcpus: 4,
            memory_bytes: 1024 * MIB,
            disk_bytes: 0,
        };
        let p = picture_of(listed, capacity, 5 * MIB, 0.5);
        assert_eq!(
            p.allocated,
            Resources {
                vcpus: 3,
                memory_bytes: 700 * MIB,
                disk_bytes: 0,
            }
        );
        assert_eq!(
            (p.pooled.vcpus, p.pooled.memory_bytes),
            (1, 400 * MIB),
            "the pooled sandbox counted apart, as part of the allocation"
        );
        assert_eq!(p.memory_used_bytes, 35 * MIB);
        assert_eq!(p.memory_available_bytes, 989 * MIB);
        assert_eq!(p.sandboxes[1].sandbox_id, "b");
        assert_eq!(p.sandboxes[1].memory_used_bytes, 20 * MIB);
        let tiny = Resources {
            vcpus: 1,
            memory_bytes: MIB,
            disk_bytes: 0,
        };
        assert_eq!(picture_of(Vec::new(), tiny, 2 * MIB, 0.0).memory_available_bytes, 0);
    }

    fn config(dir: &std::path::Path) -> HostConfig {
        HostConfig {
            node_id: "unit".into(),
            state_dir: dir.to_path_buf(),
            templates_dir: None,
            capacity: Resources {
                vcpus: 8,
                memory_bytes: 8192 * MIB,
                disk_bytes: 0,
            },
            blob_store: None,
            layer_cache_bytes: DEFAULT_LAYER_CACHE_BYTES,
            private_registries: Vec::new(),
            registry_floor: Vec::new(),
            disk_bytes: crate::host::DEFAULT_DISK_BYTES,
            build_disk_bytes: crate::host::DEFAULT_BUILD_DISK_BYTES,
            own_disks: true,
            disk_overcommit: 1.0,
            spare_disks: DEFAULT_SPARE_DISKS,
        }
    }

    fn spec(id: &str, operation_id: &str) -> CreateSpec {
        CreateSpec {
            operation_id: operation_id.into(),
            epoch: 1,
            sandbox_id: id.into(),
            template: "base".into(),
            resources: Resources {
                vcpus: 1,
                memory_bytes: 64 * MIB,
                disk_bytes: 0,
            },
            ..Default::default()
        }
    }

    fn sim() -> Arc<dyn Runtime> {
        Arc::new(SimRuntime { used_share: 0.5 })
    }

    /// A snapshot reads the tenant's files by path while it streams: nothing resumes the
    /// sandbox (whose processes could then swap a folder for a link to the host's) until the
    /// archive has been read whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nothing_resumes_a_sandbox_while_its_snapshot_streams() {
        let dir = std::env::temp_dir().join(format!("host-unit-{}", uuid::Uuid::new_v4().simple()));
        let host = Arc::new(Host::open(config(&dir), sim()).await.expect("open"));
        host.create(spec("a", "create-a")).await.expect("create a");
        host.lifecycle("pause-a", 2, "a", Move::Pause).await.expect("pause");
        // More than the stream holds in flight: its reading waits for its reader.
        let home = host.shared.dir.home("a");
        std::fs::create_dir_all(&home).unwrap();
        std::fs::write(home.join("big"), vec![7u8; 16 << 20]).unwrap();
        let (record, hold) = host.snapshot_source(2, "a").await.expect("snapshot");
        let mut parts = host.snapshot_stream(&record.id, hold);
        let resumer = host.clone();
        let mut resume = tokio::spawn(async move { resumer.lifecycle("resume-a", 2, "a", Move::Resume).await });
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(200), &mut resume)
                .await
                .is_err(),
            "resumed while the snapshot was being read"
        );
        let mut ended = false;
        while let Some(part) = parts.recv().await {
            ended |= matches!(part, Ok(SnapshotPart::End { .. }));
        }
        assert!(ended);
        let resumed = resume.await.unwrap().expect("resume after the stream");
        assert_eq!(resumed.state, State::Running);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn the_registry_holds_only_sandboxes_and_answers_retries() {
        let dir = std::env::temp_dir().join(format!("host-unit-{}", uuid::Uuid::new_v4().simple()));
        let host = Host::open(config(&dir), sim()).await.expect("open");

        // Operations on an unknown ID leave no slot behind.
        let ghost = host.lifecycle("", 1, "ghost", Move::Pause).await;
        assert!(matches!(ghost, Err(NodeError::NotFound(_))));
        assert!(host.snapshot_source(1, "ghost").await.is_err());
        assert!(lock(&host.shared.slots).is_empty());

        let a = host.create(spec("a", "create-a")).await.expect("create a");
        assert_eq!(host.create(spec("a", "create-a")).await.expect("retry"), a);
        assert!(matches!(
            host.create(spec("a", "create-a-again")).await,
            Err(NodeError::AlreadyExists(_))
        ));
        assert!(matches!(
            host.lifecycle("create-a", 1, "a", Move::Kill).await,
            Err(NodeError::OperationReused { .. })
        ));
        // Fencing: an older epoch is refused, a newer one is kept.
        assert!(matches!(
            host.lifecycle("", 0, "a", Move::Pause).await,
            Err(NodeError::Refused(Refusal::StaleEpoch { .. }))
        ));
        let paused = host.lifecycle("pause-a", 3, "a", Move::Pause).await.expect("pause");
        assert_eq!((paused.state, paused.epoch), (State::Paused, 3));
        assert_eq!(host.get("a").await, Some(paused.clone()));
        let listed = host.list().await;
        assert_eq!(listed, vec![(paused.clone(), 32 * MIB)]);

        // A new host on the same directory re-adopts it, as it was.
        let again = Host::open(config(&dir), sim()).await.expect("reopen");
        assert_eq!(again.get("a").await, Some(paused));

        let killed = host.lifecycle("kill-a", 3, "a", Move::Kill).await.expect("kill");
        assert_eq!(killed.state, State::Killed);
        assert_eq!(host.get("a").await, None);
        assert!(lock(&host.shared.slots).is_empty());
        assert!(!host.home("a").exists());
        assert!(host.picture().await.sandboxes.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
