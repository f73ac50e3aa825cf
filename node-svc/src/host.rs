//! One host's sandboxes: the registry of what runs on this node, and every lifecycle operation
//! (create, pause, resume, kill, snapshot, restore) with its fencing and idempotency rules.
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
}

/// Template layers a node keeps cached unless told otherwise: 20 GiB.
pub const DEFAULT_LAYER_CACHE_BYTES: u64 = 20 << 30;

/// A sandbox's disk unless it asks for another size: 2 GiB.
pub const DEFAULT_DISK_BYTES: u64 = 2 << 30;

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
    pub memory_used_bytes: u64,
    pub memory_available_bytes: u64,
    /// vCPUs the sandboxes used lately (0 where the runtime does not measure CPU time).
    pub cpu_usage: f64,
}

type Answer = Result<SandboxRecord, NodeError>;

/// One sandbox ID's place in the registry (see the module's notes on locking).
#[derive(Default)]
struct Slot {
    /// Held for the whole of one operation on this sandbox.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// The sandbox as last committed; `None` while it is being created or once it is gone.
    record: Mutex<Option<SandboxRecord>>,
    /// Held shared by envd requests that touch the sandbox's files, exclusively by a pause,
    /// so a pause (and the snapshot a move takes after it) never races a write accepted
    /// before it. See [`Host::file_access`].
    files: Arc<tokio::sync::RwLock<()>>,
}

/// One operation's exclusive turn on a sandbox ID. Dropping it ends the turn; a slot left
/// without a sandbox leaves the registry then, while the turn is still held.
struct Turn<'h> {
    slots: &'h Mutex<HashMap<String, Arc<Slot>>>,
    id: String,
    slot: Arc<Slot>,
    _held: OwnedMutexGuard<()>,
}

impl Turn<'_> {
    /// The sandbox as committed, if it exists.
    fn record(&self) -> Option<SandboxRecord> {
        lock(&self.slot.record).clone()
    }

    /// Makes `record` what everyone sees (`None`: the sandbox is gone).
    fn commit(&self, record: Option<SandboxRecord>) {
        *lock(&self.slot.record) = record;
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let empty = lock(&self.slot.record).is_none();
        if empty {
            let mut slots = lock(self.slots);
            let ours = slots.get(&self.id).is_some_and(|s| Arc::ptr_eq(s, &self.slot));
            if ours {
                slots.remove(&self.id);
            }
        }
    }
}

/// Whether a call may act, or already has its answer.
enum Admission<'h> {
    /// Boxed: an answer carries a whole record, a turn only a few pointers.
    Answered(Box<Answer>),
    Turn(Turn<'h>),
}

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
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return 0;
    };
    // SAFETY: statvfs writes only into `stat`, which outlives the call.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and the live struct above to write into.
    if unsafe { libc::statvfs(c.as_ptr(), &mut stat) } != 0 {
        return 0;
    }
    stat.f_blocks.saturating_mul(stat.f_frsize)
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

impl Host {
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
                .filter(|r| r.state == State::Running && runtime.died(r))
                .map(|r| r.id)
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default();
        for id in dead {
            let shared = self.shared.clone();
            let sandbox = id.clone();
            if let Err(err) = to_completion(async move { shared.revive(&sandbox).await }).await {
                tracing::error!(sandbox_id = %id, %err, "a sandbox whose envd died could not be started again");
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
                        cpu_time_ns: runtime.cpu_time_ns_of(&record),
                        vcpus: record.resources.vcpus,
                        memory_used_bytes: runtime.memory_used(&record),
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

    /// Checks a snapshot may be taken (paused, epoch current) and returns the record.
    pub async fn snapshot_source(&self, epoch: u64, sandbox_id: &str) -> Result<SandboxRecord, NodeError> {
        let shared = self.shared.clone();
        let sandbox_id = sandbox_id.to_string();
        to_completion(async move { shared.snapshot_source(epoch, &sandbox_id).await }).await
    }

    /// Streams the sandbox's home as a tar archive in chunks; the last item is the SHA-256
    /// of all the data and its length.
    pub fn snapshot_stream(&self, sandbox_id: &str) -> mpsc::Receiver<Result<SnapshotPart, SnapshotError>> {
        snapshot::stream(self.shared.dir.home(sandbox_id))
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

impl Shared {
    async fn persist(&self, record: &SandboxRecord) -> Result<(), NodeError> {
        let (dir, record) = (self.dir.clone(), record.clone());
        blocking(move || dir.persist(&record).map_err(io)).await
    }

    /// The answer already given to `operation_id` for `call`, if any.
    fn recall(&self, operation_id: &str, call: &str) -> Option<Answer> {
        if operation_id.is_empty() {
            return None;
        }
        match lock(&self.answers).recall(operation_id, call, common::clock::now_ms()) {
            Recall::New => None,
            Recall::Answered(answer) => Some(answer),
            Recall::Reused { first } => Some(Err(NodeError::OperationReused {
                operation_id: operation_id.to_string(),
                first,
            })),
        }
    }

    /// Keeps `answer` for retries of `operation_id`, when it is final.
    fn remember(&self, operation_id: &str, call: &str, answer: &Answer) {
        if is_final(answer) {
            lock(&self.answers).remember(operation_id, call, answer.clone(), common::clock::now_ms());
        }
    }

    /// Waits for sandbox `id`'s turn (see the module's notes on locking).
    async fn enter(&self, id: &str) -> Turn<'_> {
        loop {
            let slot = lock(&self.slots).entry(id.to_string()).or_default().clone();
            let held = slot.turn.clone().lock_owned().await;
            let current = lock(&self.slots).get(id).is_some_and(|s| Arc::ptr_eq(s, &slot));
            if current {
                return Turn {
                    slots: &self.slots,
                    id: id.to_string(),
                    slot,
                    _held: held,
                };
            }
            // The slot left the registry while this call queued for it: queue on the new one.
        }
    }

    /// The turn on sandbox `id` for `call`, unless `operation_id` already has an answer
    /// (checked before queueing, and again once the turn comes).
    async fn admit(&self, id: &str, operation_id: &str, call: &str) -> Admission<'_> {
        if let Some(answer) = self.recall(operation_id, call) {
            return Admission::Answered(Box::new(answer));
        }
        let turn = self.enter(id).await;
        match self.recall(operation_id, call) {
            Some(answer) => Admission::Answered(Box::new(answer)),
            None => Admission::Turn(turn),
        }
    }

    /// Creates and starts a sandbox.
    async fn create(&self, spec: CreateSpec) -> Result<SandboxRecord, NodeError> {
        validate_id(&spec.sandbox_id)?;
        if spec.resources.vcpus == 0 || spec.resources.memory_bytes == 0 {
            return Err(NodeError::Invalid("resources must be positive".to_string()));
        }
        let call = format!("create {}", spec.sandbox_id);
        let operation_id = spec.operation_id.clone();
        let turn = match self.admit(&spec.sandbox_id, &operation_id, &call).await {
            Admission::Answered(answer) => return *answer,
            Admission::Turn(turn) => turn,
        };
        let answer = self.create_now(&turn, spec).await;
        self.remember(&operation_id, &call, &answer);
        answer
    }

    async fn create_now(&self, turn: &Turn<'_>, spec: CreateSpec) -> Result<SandboxRecord, NodeError> {
        if let Some(existing) = turn.record() {
            if existing.state != State::Killed {
                return Err(NodeError::AlreadyExists(spec.sandbox_id));
            }
        }
        self.ensure_layers(spec.image.as_ref()).await?;
        let templates = self.config.templates_dir.clone();
        let (runtime, dir, disks) = (self.runtime.clone(), self.dir.clone(), self.disks.clone());
        // One trip to a blocking thread for all of it: every hop is a thread wake-up, and on
        // a busy host each costs more than the work it carries.
        let record = blocking(move || {
            // A template from the registry comes whole in the request; a node's own templates
            // folder (the older way) only adds to one it has.
            let template = match template::load(templates.as_deref(), &spec.template) {
                Err(TemplateError::Unknown(_)) if spec.image.is_some() => Template::default(),
                other => other?,
            };
            let files = template.files.clone();
            let mut record = new_record(spec, template, now_ms());
            // The size it runs with, wherever it moves.
            record.resources.disk_bytes = disks.size(record.resources.disk_bytes);
            let home = dir.home(&record.id);
            let made = (|| -> Result<(), NodeError> {
                disks
                    .attach(&dir.sandbox_dir(&record.id), record.resources.disk_bytes)
                    .map_err(disk)?;
                std::fs::create_dir_all(&home).map_err(io)?;
                if let Some(files) = files {
                    runtime.seed(&home, &files).map_err(io)?;
                }
                record.pgid = runtime.start(&record, &home)?;
                if let Err(err) = dir.persist(&record) {
                    let _ = runtime.kill(&record);
                    return Err(io(err));
                }
                Ok(())
            })();
            if let Err(err) = made {
                // A failed create leaves nothing behind.
                let _ = crate::disk::remove_folder(&dir.sandbox_dir(&record.id));
                return Err(err);
            }
            Ok(record)
        })
        .await?;
        if let Err(err) = self.ready(&record).await {
            let (runtime, dir, r) = (self.runtime.clone(), self.dir.clone(), record.clone());
            let _ = blocking(move || {
                let _ = runtime.kill(&r);
                let _ = crate::disk::remove_folder(&dir.sandbox_dir(&r.id));
                Ok(())
            })
            .await;
            return Err(err);
        }
        turn.commit(Some(record.clone()));
        tracing::info!(sandbox_id = %record.id, pgid = record.pgid, "sandbox created");
        self.note(&record.id, "sandbox created");
        Ok(record)
    }

    async fn capture(&self, epoch: u64, id: &str) -> Result<common::template::Image, NodeError> {
        validate_id(id)?;
        let cache = self
            .layers
            .clone()
            .ok_or_else(|| NodeError::Runtime("this node has no blob store to keep a capture in".into()))?;
        let turn = self.enter(id).await;
        let record = turn
            .record()
            .filter(|r| r.state != State::Killed)
            .ok_or_else(|| NodeError::NotFound(id.to_string()))?;
        fence(&record, epoch)?;
        let running = record.state == State::Running;
        // Frozen while its writable layer is read, so the capture is one moment of it; the
        // files lock keeps envd's writes out meanwhile, as a pause does.
        let _quiet = turn.slot.files.clone().write_owned().await;
        if running {
            let (runtime, r) = (self.runtime.clone(), record.clone());
            blocking(move || runtime.pause(&r).map_err(NodeError::from)).await?;
        }
        let packed = cache.pack(&self.dir.home(id)).await;
        if running {
            let (runtime, r) = (self.runtime.clone(), record.clone());
            blocking(move || runtime.resume(&r).map_err(NodeError::from)).await?;
        }
        let layer = packed.map_err(|e| NodeError::Runtime(e.to_string()))?;
        let mut image = record.image.clone().unwrap_or_else(common::template::Image::base);
        image.layers.push(layer);
        image.env = record.env.clone();
        image.start_cmd = record.start_command.clone();
        image.build_id = String::new();
        tracing::info!(sandbox_id = %id, layers = image.layers.len(), "sandbox captured");
        Ok(image)
    }

    /// Makes an image's layers present on this node (fetched from the blob store).
    async fn ensure_layers(&self, image: Option<&common::template::Image>) -> Result<(), NodeError> {
        let Some(image) = image.filter(|i| !i.layers.is_empty()) else {
            return Ok(());
        };
        let cache = self
            .layers
            .as_ref()
            .ok_or_else(|| NodeError::Runtime("this node has no blob store to fetch template layers from".into()))?;
        let fetched = cache
            .ensure_all(&image.layers)
            .await
            .map_err(|e| NodeError::Runtime(e.to_string()))?;
        metrics::counter!("node_layer_fetches_total").increment(fetched as u64);
        cache.remember(image);
        if fetched > 0 {
            // Room for what came: the layers of every sandbox here (and this one) stay.
            let mut in_use: std::collections::HashSet<String> = self
                .records()
                .iter()
                .filter_map(|r| r.image.as_ref())
                .flat_map(|i| i.layers.iter().map(|l| l.digest.clone()))
                .collect();
            in_use.extend(image.layers.iter().map(|l| l.digest.clone()));
            let cache = cache.clone();
            tokio::task::spawn_blocking(move || cache.evict(&in_use));
        }
        Ok(())
    }

    /// Waits until the sandbox's template says it is ready: its ready command, run as the
    /// default user through the sandbox's own envd, exits 0 (E2B's `readyCmd`; without memory
    /// snapshots the start command runs at every create, so every create waits for it).
    async fn ready(&self, record: &SandboxRecord) -> Result<(), NodeError> {
        let Some(check) = record.image.as_ref().and_then(|i| i.ready_cmd.clone()) else {
            return Ok(());
        };
        let Some(socket) = self.runtime.envd_socket(&self.dir.home(&record.id)) else {
            return Ok(());
        };
        let command = crate::envd_client::Command {
            script: check.clone(),
            env: record.env.clone(),
            ..Default::default()
        };
        crate::envd_client::until_ok(&socket, &command, READY_DEADLINE)
            .await
            .map_err(|e| NodeError::Runtime(format!("the template's ready command: {e}")))
    }

    /// Pause, resume or kill, fenced by `epoch`.
    async fn lifecycle(
        &self,
        operation_id: &str,
        epoch: u64,
        sandbox_id: &str,
        action: Move,
    ) -> Result<SandboxRecord, NodeError> {
        validate_id(sandbox_id)?;
        let call = format!("{action:?} {sandbox_id}");
        let turn = match self.admit(sandbox_id, operation_id, &call).await {
            Admission::Answered(answer) => return *answer,
            Admission::Turn(turn) => turn,
        };
        let answer = self.lifecycle_now(&turn, epoch, action).await;
        self.remember(operation_id, &call, &answer);
        answer
    }

    async fn update_network(
        &self,
        operation_id: &str,
        epoch: u64,
        sandbox_id: &str,
        policy: common::egress::NetworkPolicy,
    ) -> Result<SandboxRecord, NodeError> {
        validate_id(sandbox_id)?;
        let call = format!("network {sandbox_id}");
        let turn = match self.admit(sandbox_id, operation_id, &call).await {
            Admission::Answered(answer) => return *answer,
            Admission::Turn(turn) => turn,
        };
        let answer = async {
            let record = turn
                .record()
                .ok_or_else(|| NodeError::NotFound(sandbox_id.to_string()))?;
            let mut next = record.clone();
            next.epoch = fence(&record, epoch)?;
            next.network = Some(policy.clone());
            let (runtime, dir) = (self.runtime.clone(), self.dir.clone());
            let next = blocking(move || {
                runtime.update_network(&record, &policy)?;
                dir.persist(&next).map_err(io)?;
                Ok(next)
            })
            .await?;
            turn.commit(Some(next.clone()));
            tracing::info!(sandbox_id, "network policy replaced");
            self.note(sandbox_id, "network policy replaced");
            Ok(next)
        }
        .await;
        self.remember(operation_id, &call, &answer);
        answer
    }

    async fn lifecycle_now(&self, turn: &Turn<'_>, epoch: u64, action: Move) -> Result<SandboxRecord, NodeError> {
        let id = turn.id.as_str();
        let record = turn.record().ok_or_else(|| NodeError::NotFound(id.to_string()))?;
        let epoch = fence(&record, epoch)?;
        let mut next = record.clone();
        next.epoch = epoch;
        let Some(state) = next_state(&record, action)? else {
            // Nothing to do but record a newer epoch.
            if next != record {
                self.persist(&next).await?;
            }
            turn.commit(Some(next.clone()));
            return Ok(next);
        };
        next.state = state;
        // A pause waits for envd requests already touching the files, and holds new ones
        // back until it is done (they then find the sandbox paused).
        let _quiet = match action {
            Move::Pause => Some(turn.slot.files.clone().write_owned().await),
            Move::Resume | Move::Kill => None,
        };
        let (runtime, dir, home) = (self.runtime.clone(), self.dir.clone(), self.dir.home(id));
        // The runtime call and the record's persistence in one trip to a blocking thread.
        let next = blocking(move || {
            match action {
                Move::Pause => runtime.pause(&record)?,
                Move::Resume => {
                    // Thaw first: commands started through envd live in the sandbox's cgroups
                    // too, whether or not it has a start command.
                    runtime.resume(&record)?;
                    if record.pgid == 0 && has_process(runtime.as_ref(), &record) {
                        // Its start command was not preserved (restored from a snapshot, or
                        // the host restarted while it was paused): start it afresh, files
                        // intact.
                        next.pgid = runtime.start(&record, &home)?;
                    }
                }
                Move::Kill => runtime.kill(&record)?,
            }
            if next.state != State::Killed {
                dir.persist(&next).map_err(io)?;
            }
            Ok(next)
        })
        .await?;
        if next.state == State::Killed {
            // Gone for everyone from here; the turn is held until its files are too, so a
            // create of the same ID waits for them.
            turn.commit(None);
            let (dir, gone) = (self.dir.clone(), id.to_string());
            blocking(move || dir.remove(&gone).map_err(io)).await?;
            tracing::info!(sandbox_id = %id, "sandbox killed");
        } else {
            turn.commit(Some(next.clone()));
            self.note(
                id,
                &format!(
                    "sandbox {}",
                    if next.state == State::Paused {
                        "paused"
                    } else {
                        "resumed"
                    }
                ),
            );
        }
        Ok(next)
    }

    /// Starts sandbox `id` again if it is running by its record and dead by its runtime (see
    /// [`Host::revive`]), within its turn; nothing when an operation got there first.
    async fn revive(&self, id: &str) -> Result<(), NodeError> {
        let turn = self.enter(id).await;
        let Some(record) = turn.record().filter(|r| r.state == State::Running) else {
            return Ok(());
        };
        let (runtime, dir, r) = (self.runtime.clone(), self.dir.clone(), record.clone());
        let started = blocking(move || {
            if runtime.alive(&r) {
                return Ok(None);
            }
            // What is left of it (the stopped container, its link, its root's mount), then
            // a fresh start over the same files.
            let _ = runtime.kill(&r);
            let mut next = r.clone();
            next.pgid = runtime.start(&r, &dir.home(&r.id))?;
            dir.persist(&next).map_err(io)?;
            Ok(Some(next))
        })
        .await?;
        let Some(next) = started else { return Ok(()) };
        turn.commit(Some(next.clone()));
        metrics::counter!("node_sandbox_revived_total").increment(1);
        tracing::warn!(sandbox_id = %id, pgid = next.pgid, "the sandbox's envd had died; started it again (files kept, processes afresh)");
        self.note(
            id,
            "envd died; the sandbox was started again: its files are kept, its processes are not",
        );
        Ok(())
    }

    /// Appends a lifecycle event to the sandbox's log (where its runtime keeps one).
    fn note(&self, id: &str, message: &str) {
        if let Some(log) = self.runtime.log_file(&self.dir.home(id)) {
            crate::logs::note(&log, "info", message);
        }
    }

    fn committed(&self, sandbox_id: &str) -> Option<SandboxRecord> {
        let slot = lock(&self.slots).get(sandbox_id).cloned()?;
        let record = lock(&slot.record).clone();
        record
    }

    /// Every sandbox as last committed, by ID.
    fn records(&self) -> Vec<SandboxRecord> {
        let slots: Vec<Arc<Slot>> = lock(&self.slots).values().cloned().collect();
        let mut records: Vec<SandboxRecord> = slots.iter().filter_map(|slot| lock(&slot.record).clone()).collect();
        records.sort_by(|a, b| a.id.cmp(&b.id));
        records
    }

    /// Checks a snapshot may be taken (paused, epoch current) and returns the record.
    async fn snapshot_source(&self, epoch: u64, sandbox_id: &str) -> Result<SandboxRecord, NodeError> {
        validate_id(sandbox_id)?;
        let turn = self.enter(sandbox_id).await;
        let mut record = turn
            .record()
            .ok_or_else(|| NodeError::NotFound(sandbox_id.to_string()))?;
        let epoch = fence(&record, epoch)?;
        if record.state != State::Paused {
            return Err(NodeError::Invalid(format!(
                "sandbox {sandbox_id} is {:?}: pause it before taking a snapshot",
                record.state
            )));
        }
        if epoch != record.epoch {
            record.epoch = epoch;
            self.persist(&record).await?;
            turn.commit(Some(record.clone()));
        }
        Ok(record)
    }

    /// Recreates a sandbox from a snapshot: unpacks the archive chunks from `data` into a
    /// scratch folder, checks the SHA-256 against the trailer, then installs it, paused.
    async fn restore(
        &self,
        operation_id: &str,
        epoch: u64,
        record: SandboxRecord,
        data: mpsc::Receiver<RestoreItem>,
    ) -> Result<SandboxRecord, NodeError> {
        validate_id(&record.id)?;
        let call = format!("restore {}", record.id);
        if let Some(answer) = self.recall(operation_id, &call) {
            return answer;
        }
        let answer = self.restore_now(operation_id, &call, epoch, record, data).await;
        self.remember(operation_id, &call, &answer);
        answer
    }

    async fn restore_now(
        &self,
        operation_id: &str,
        call: &str,
        epoch: u64,
        mut record: SandboxRecord,
        data: mpsc::Receiver<RestoreItem>,
    ) -> Result<SandboxRecord, NodeError> {
        match on_existing(self.committed(&record.id).as_ref(), epoch) {
            OnExisting::Keep => return Err(NodeError::AlreadyExists(record.id)),
            OnExisting::Refuse(refusal) => return Err(refusal.into()),
            OnExisting::Restore | OnExisting::Replace => {}
        }
        // Its template's layers, fetched before anything of it is installed.
        self.ensure_layers(record.image.as_ref()).await?;
        // The stream is unpacked without the sandbox's turn (it may take long); only the
        // install, which is quick, takes it.
        // Its disk as it had it (a record from before disks: this node's default), made first
        // so the unpacking is held to it: a snapshot larger than its disk fails here.
        record.resources.disk_bytes = self.disks.size(record.resources.disk_bytes);
        let scratch = {
            let (dir, id, disks, bytes) = (
                self.dir.clone(),
                record.id.clone(),
                self.disks.clone(),
                record.resources.disk_bytes,
            );
            blocking(move || {
                let scratch = dir.restore_scratch(&id).map_err(io)?;
                if let Err(e) = disks.attach(&scratch, bytes) {
                    let _ = crate::disk::remove_folder(&scratch);
                    return Err(disk(e));
                }
                Ok(scratch)
            })
            .await?
        };
        let unpack_into = scratch.join(crate::disk::MOUNT);
        let unpacked = tokio::task::spawn_blocking(move || snapshot::unpack(data, &unpack_into))
            .await
            .map_err(|e| NodeError::Runtime(format!("restore task failed: {e}")))
            .and_then(|unpacked| unpacked.map_err(NodeError::from));
        let drop_scratch = |scratch: PathBuf| {
            blocking(move || {
                let _ = crate::disk::remove_folder(&scratch);
                Ok(())
            })
        };
        if let Err(err) = unpacked {
            let _ = drop_scratch(scratch).await;
            return Err(err);
        }
        let turn = match self.admit(&record.id, operation_id, call).await {
            Admission::Answered(answer) => {
                let _ = drop_scratch(scratch).await;
                return *answer;
            }
            Admission::Turn(turn) => turn,
        };
        match on_existing(turn.record().as_ref(), epoch) {
            OnExisting::Restore => {}
            OnExisting::Keep => {
                let _ = drop_scratch(scratch).await;
                return Err(NodeError::AlreadyExists(record.id));
            }
            OnExisting::Refuse(refusal) => {
                let _ = drop_scratch(scratch).await;
                return Err(refusal.into());
            }
            OnExisting::Replace => {
                let stale = turn.record().map_or(0, |r| r.epoch);
                tracing::warn!(sandbox_id = %record.id, stale_epoch = stale, epoch,
                    "a copy from an older epoch is here; replacing it with the snapshot");
                if let Err(err) = self.lifecycle_now(&turn, epoch, Move::Kill).await {
                    let _ = drop_scratch(scratch).await;
                    return Err(err);
                }
            }
        }
        record.state = State::Paused;
        record.pgid = 0;
        record.epoch = record.epoch.max(epoch);
        let (dir, runtime, r) = (self.dir.clone(), self.runtime.clone(), record.clone());
        blocking(move || {
            let installed = dir
                .install(&scratch, &r.id)
                .map_err(io)
                .and_then(|()| runtime.adopt(&r).map_err(NodeError::from))
                .and_then(|()| dir.persist(&r).map_err(io));
            if installed.is_err() {
                // A failed restore leaves nothing behind.
                let _ = crate::disk::remove_folder(&scratch);
                let _ = crate::disk::remove_folder(&dir.sandbox_dir(&r.id));
            }
            installed
        })
        .await?;
        turn.commit(Some(record.clone()));
        // Remembered within the turn, so a retry queued behind this one finds the answer.
        self.remember(operation_id, call, &Ok(record.clone()));
        tracing::info!(sandbox_id = %record.id, "sandbox restored (paused)");
        self.note(&record.id, "sandbox restored here (paused), moved from another node");
        Ok(record)
    }
}

/// Loads the state directory and takes charge of every sandbox in it (blocking): killed ones
/// are deleted, the others adopted by the runtime, and a running one whose start command
/// died with the old node-svc is started again.
///
/// One sandbox that cannot be taken back (its container will not start again on this host)
/// does not keep the node down, which would strand every other sandbox with it: it is kept,
/// listed with no process (so it stays accounted, and a kill removes it), and counted in
/// `node_readoption_failures_total`.
fn readopt(dir: &StateDir, runtime: &dyn Runtime, disks: &crate::disk::Disks) -> Result<Vec<SandboxRecord>, NodeError> {
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

fn readopt_one(
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
    runtime.adopt(record)?;
    let alive = runtime.alive(record);
    match readoption(record.state, alive, has_process(runtime, record)) {
        Readoption::AsFound => {}
        Readoption::Restart => {
            record.pgid = runtime.start(record, &dir.home(&record.id))?;
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
fn sweep(dir: &StateDir, runtime: &dyn Runtime, adopted: &[SandboxRecord]) {
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
enum Readoption {
    /// Take it as it is.
    AsFound,
    /// Its start command died with the host (or was killed): start it again, files intact.
    Restart,
    /// Its start command is gone and it is paused: forget its process group, so resume
    /// starts the command afresh.
    Stopped,
}

fn readoption(state: State, alive: bool, has_command: bool) -> Readoption {
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
fn has_process(runtime: &dyn Runtime, record: &SandboxRecord) -> bool {
    runtime.runs_envd() || has_command(record)
}

fn has_command(record: &SandboxRecord) -> bool {
    record.start_command.as_deref().is_some_and(|c| !c.trim().is_empty())
}

/// Whether an answer is final, and so given again to retries: refusals are; transient
/// trouble (the state directory, the runtime) is not, so a retry tries again.
/// Whether an answer is kept for retries of its operation ID. Failures of this host (I/O, the
/// runtime) and a corrupt snapshot stream are not: the retry brings a fresh stream or finds
/// the host healthy again, and deserves a fresh attempt.
fn is_final(answer: &Answer) -> bool {
    !matches!(
        answer,
        Err(NodeError::Io(_) | NodeError::Runtime(_) | NodeError::Corrupt(_))
    )
}

fn validate_id(id: &str) -> Result<(), NodeError> {
    if common::ids::is_sandbox_id(id) {
        Ok(())
    } else {
        Err(NodeError::Invalid(format!(
            "sandbox id {id:?} must be {}",
            common::ids::ID_RULE
        )))
    }
}

/// The record of a new sandbox, running, before its start command runs: the spec's env vars
/// over the template's, the spec's start command or else the template's.
fn new_record(spec: CreateSpec, template: Template, now_ms: u64) -> SandboxRecord {
    let mut env = template.env;
    if let Some(image) = &spec.image {
        env.extend(image.env.clone());
    }
    env.extend(spec.env);
    let image_start = spec.image.as_ref().and_then(|i| i.start_cmd.clone());
    SandboxRecord {
        id: spec.sandbox_id,
        template: if spec.template.is_empty() {
            "base".into()
        } else {
            spec.template
        },
        resources: spec.resources,
        env,
        metadata: spec.metadata,
        start_command: spec
            .start_command
            .filter(|c| !c.is_empty())
            .or(image_start)
            .or(template.start_command),
        access_token: spec.access_token.filter(|t| !t.is_empty()),
        network: spec.network,
        traffic_access_token: spec.traffic_access_token.filter(|t| !t.is_empty()),
        image: spec.image,
        state: State::Running,
        epoch: spec.epoch,
        pgid: 0,
        created_at_unix_ms: now_ms,
    }
}

/// What a heartbeat measures on a blocking thread.
struct Measured {
    listed: Vec<(SandboxRecord, u64)>,
    cpu_time_ns: Option<u64>,
    own_rss: u64,
}

/// Each record with the memory the runtime says it uses (blocking).
fn measure(runtime: &dyn Runtime, records: Vec<SandboxRecord>) -> Vec<(SandboxRecord, u64)> {
    records
        .into_iter()
        .map(|r| {
            let used = runtime.memory_used(&r);
            (r, used)
        })
        .collect()
}

/// The heartbeat's picture of `listed` sandboxes on a node of `capacity`, whose own process
/// uses `own_rss` bytes.
fn picture_of(listed: Vec<(SandboxRecord, u64)>, capacity: Resources, own_rss: u64, cpu_usage: f64) -> Picture {
    let mut allocated = Resources::default();
    let mut used = own_rss;
    let sandboxes = listed
        .into_iter()
        .map(|(r, memory_used)| {
            allocated.vcpus += r.resources.vcpus;
            allocated.memory_bytes += r.resources.memory_bytes;
            used += memory_used;
            Reported {
                sandbox_id: r.id,
                state: r.state,
                resources: r.resources,
                memory_used_bytes: memory_used,
            }
        })
        .collect();
    Picture {
        sandboxes,
        allocated,
        memory_used_bytes: used,
        memory_available_bytes: capacity.memory_bytes.saturating_sub(used),
        cpu_usage,
    }
}

/// Resident memory of this process, counted as the node's own use.
fn own_rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

#[cfg(test)]
mod tests {
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
        let listed = vec![
            (record("a", State::Running, 100 * MIB), 10 * MIB),
            (record("b", State::Paused, 200 * MIB), 20 * MIB),
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
                vcpus: 2,
                memory_bytes: 300 * MIB,
                disk_bytes: 0,
            }
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
