//! One host's sandboxes: the registry, its state directory, and every lifecycle operation
//! with its fencing and idempotency rules.
//!
//! The state directory holds one folder per sandbox: `sandbox.json` (its [`SandboxRecord`],
//! rewritten atomically on every change) and `home/` (its files, which survive pause, restart
//! and migration). On start the host re-adopts every sandbox the directory says is running or
//! paused, so a node restart loses none (E2B's users report theirs vanish).

use common::clock::now_ms;
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, Mutex};

use crate::runtime::{Features, Runtime, RuntimeError};
use crate::sandbox::{fence, next_state, Answers, Move, Recall, Refusal, Resources, SandboxRecord, State};
use crate::usage::CpuRate;

/// Answers kept for operation-ID retries.
const ANSWERS_KEPT: usize = 10_000;
/// Size of snapshot data chunks.
const CHUNK: usize = 256 * 1024;

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
}

impl From<RuntimeError> for NodeError {
    fn from(err: RuntimeError) -> Self {
        NodeError::Runtime(err.to_string())
    }
}

fn io(err: impl std::fmt::Display) -> NodeError {
    NodeError::Io(err.to_string())
}

/// A template: files that seed a sandbox's home, default env vars, an optional start command.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Template {
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub start_command: Option<String>,
    #[serde(skip)]
    pub files: Option<PathBuf>,
}

/// How a host runs.
#[derive(Clone, Debug)]
pub struct HostConfig {
    pub node_id: String,
    pub state_dir: PathBuf,
    /// Folder of templates: `NAME/template.json` and `NAME/files/`. `base` always exists.
    pub templates_dir: Option<PathBuf>,
    pub capacity: Resources,
}

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
}

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

struct Registry {
    sandboxes: HashMap<String, SandboxRecord>,
    answers: Answers<Result<SandboxRecord, NodeError>>,
}

/// The sandboxes of one node.
pub struct Host {
    config: HostConfig,
    runtime: Arc<dyn Runtime>,
    boot_id: String,
    registry: Mutex<Registry>,
    cpu: std::sync::Mutex<CpuRate>,
}

fn sandboxes_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("sandboxes")
}

fn validate_id(id: &str) -> Result<(), NodeError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !id.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(NodeError::Invalid(format!(
            "sandbox id {id:?} must be 1-128 characters of letters, digits, '-', '_' or '.', not starting with '.'"
        )))
    }
}

/// Copies a directory tree (template files into a new home).
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

impl Host {
    /// Opens the state directory and re-adopts every sandbox it records as running or paused.
    pub async fn open(config: HostConfig, runtime: Arc<dyn Runtime>) -> Result<Self, NodeError> {
        let dir = sandboxes_dir(&config.state_dir);
        std::fs::create_dir_all(&dir).map_err(io)?;
        let host = Self {
            config,
            runtime,
            boot_id: uuid::Uuid::new_v4().to_string(),
            registry: Mutex::new(Registry {
                sandboxes: HashMap::new(),
                answers: Answers::new(ANSWERS_KEPT),
            }),
            cpu: std::sync::Mutex::new(CpuRate::default()),
        };
        host.readopt().await?;
        Ok(host)
    }

    pub fn node_id(&self) -> &str {
        &self.config.node_id
    }

    pub fn boot_id(&self) -> &str {
        &self.boot_id
    }

    pub fn capacity(&self) -> Resources {
        self.config.capacity
    }

    pub fn runtime(&self) -> &Arc<dyn Runtime> {
        &self.runtime
    }

    pub fn runtime_kind(&self) -> &'static str {
        self.runtime.kind()
    }

    pub fn features(&self) -> Features {
        self.runtime.features()
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        sandboxes_dir(&self.config.state_dir).join(id)
    }

    /// Where a sandbox's files live.
    pub fn home(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("home")
    }

    fn persist(&self, record: &SandboxRecord) -> Result<(), NodeError> {
        let dir = self.sandbox_dir(&record.id);
        let tmp = dir.join("sandbox.json.tmp");
        let json = serde_json::to_vec_pretty(record).map_err(io)?;
        let mut file = std::fs::File::create(&tmp).map_err(io)?;
        file.write_all(&json).map_err(io)?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, dir.join("sandbox.json")).map_err(io)?;
        Ok(())
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(Arc<dyn Runtime>) -> Result<T, RuntimeError> + Send + 'static,
    ) -> Result<T, NodeError> {
        let runtime = self.runtime.clone();
        tokio::task::spawn_blocking(move || f(runtime))
            .await
            .map_err(|e| NodeError::Runtime(format!("runtime task failed: {e}")))?
            .map_err(NodeError::from)
    }

    async fn readopt(&self) -> Result<(), NodeError> {
        let dir = sandboxes_dir(&self.config.state_dir);
        let mut registry = self.registry.lock().await;
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            let Ok(bytes) = std::fs::read(path.join("sandbox.json")) else {
                continue;
            };
            let mut record: SandboxRecord = match serde_json::from_slice(&bytes) {
                Ok(record) => record,
                Err(err) => {
                    tracing::error!(path = %path.display(), %err, "unreadable sandbox record; left alone");
                    continue;
                }
            };
            if record.state == State::Killed {
                let _ = std::fs::remove_dir_all(&path);
                continue;
            }
            let r = record.clone();
            let alive = self
                .blocking(move |rt| {
                    rt.adopt(&r)?;
                    Ok(rt.alive(&r))
                })
                .await?;
            let has_command = record.start_command.as_deref().is_some_and(|c| !c.trim().is_empty());
            if !alive && has_command {
                match record.state {
                    State::Running => {
                        // Its processes died with the host (or were killed): start it again,
                        // files intact.
                        let (r, home) = (record.clone(), self.home(&record.id));
                        record.pgid = self.blocking(move |rt| rt.start(&r, &home)).await?;
                        tracing::warn!(sandbox_id = %record.id, "start command was not running; restarted");
                    }
                    State::Paused | State::Killed => record.pgid = 0,
                }
                self.persist(&record)?;
            }
            tracing::info!(sandbox_id = %record.id, state = ?record.state, alive, "re-adopted sandbox");
            registry.sandboxes.insert(record.id.clone(), record);
        }
        Ok(())
    }

    fn template(&self, name: &str) -> Result<Template, NodeError> {
        let dir = self.config.templates_dir.as_ref().map(|d| d.join(name));
        if let Some(dir) = dir.filter(|d| d.is_dir()) {
            let mut template: Template = match std::fs::read(dir.join("template.json")) {
                Ok(bytes) => serde_json::from_slice(&bytes)
                    .map_err(|e| NodeError::Invalid(format!("template {name}: bad template.json: {e}")))?,
                Err(_) => Template::default(),
            };
            let files = dir.join("files");
            template.files = files.is_dir().then_some(files);
            return Ok(template);
        }
        if name == "base" || name.is_empty() {
            return Ok(Template::default());
        }
        Err(NodeError::UnknownTemplate(name.to_string()))
    }

    /// Runs `op` unless `operation_id` already has an answer for this `call`.
    async fn once(
        &self,
        operation_id: &str,
        call: String,
        op: impl std::future::Future<Output = Result<SandboxRecord, NodeError>>,
    ) -> Result<SandboxRecord, NodeError> {
        if !operation_id.is_empty() {
            match self.registry.lock().await.answers.recall(operation_id, &call) {
                Recall::New => {}
                Recall::Answered(answer) => return answer,
                Recall::Reused { first } => {
                    return Err(NodeError::OperationReused {
                        operation_id: operation_id.to_string(),
                        first,
                    })
                }
            }
        }
        let answer = op.await;
        // Remember failures that are answers (refusals), not transient trouble.
        let remember = !matches!(answer, Err(NodeError::Io(_) | NodeError::Runtime(_)));
        if remember {
            self.registry
                .lock()
                .await
                .answers
                .remember(operation_id, &call, answer.clone());
        }
        answer
    }

    /// Creates and starts a sandbox.
    pub async fn create(&self, spec: CreateSpec) -> Result<SandboxRecord, NodeError> {
        validate_id(&spec.sandbox_id)?;
        if spec.resources.vcpus == 0 || spec.resources.memory_bytes == 0 {
            return Err(NodeError::Invalid("resources must be positive".to_string()));
        }
        let call = format!("create {}", spec.sandbox_id);
        let operation_id = spec.operation_id.clone();
        self.once(&operation_id, call, self.create_now(spec)).await
    }

    async fn create_now(&self, spec: CreateSpec) -> Result<SandboxRecord, NodeError> {
        let template = self.template(&spec.template)?;
        let mut registry = self.registry.lock().await;
        if let Some(existing) = registry.sandboxes.get(&spec.sandbox_id) {
            if existing.state != State::Killed {
                return Err(NodeError::AlreadyExists(spec.sandbox_id));
            }
        }
        let home = self.home(&spec.sandbox_id);
        std::fs::create_dir_all(&home).map_err(io)?;
        if let Some(files) = &template.files {
            copy_tree(files, &home).map_err(io)?;
        }
        let mut env = template.env.clone();
        env.extend(spec.env);
        let mut record = SandboxRecord {
            id: spec.sandbox_id.clone(),
            template: if spec.template.is_empty() {
                "base".into()
            } else {
                spec.template
            },
            resources: spec.resources,
            env,
            metadata: spec.metadata,
            start_command: spec.start_command.filter(|c| !c.is_empty()).or(template.start_command),
            access_token: spec.access_token.filter(|t| !t.is_empty()),
            state: State::Running,
            epoch: spec.epoch,
            pgid: 0,
            created_at_unix_ms: now_ms(),
        };
        let (r, h) = (record.clone(), home.clone());
        match self.blocking(move |rt| rt.start(&r, &h)).await {
            Ok(pgid) => record.pgid = pgid,
            Err(err) => {
                // A failed create leaves nothing behind.
                let _ = std::fs::remove_dir_all(self.sandbox_dir(&record.id));
                return Err(err);
            }
        }
        if let Err(err) = self.persist(&record) {
            let r = record.clone();
            let _ = self.blocking(move |rt| rt.kill(&r)).await;
            let _ = std::fs::remove_dir_all(self.sandbox_dir(&record.id));
            return Err(err);
        }
        registry.sandboxes.insert(record.id.clone(), record.clone());
        tracing::info!(sandbox_id = %record.id, pgid = record.pgid, "sandbox created");
        Ok(record)
    }

    /// Pause, resume or kill, fenced by `epoch`.
    pub async fn lifecycle(
        &self,
        operation_id: &str,
        epoch: u64,
        sandbox_id: &str,
        action: Move,
    ) -> Result<SandboxRecord, NodeError> {
        validate_id(sandbox_id)?;
        let call = format!("{action:?} {sandbox_id}");
        self.once(operation_id, call, self.lifecycle_now(epoch, sandbox_id, action))
            .await
    }

    async fn lifecycle_now(&self, epoch: u64, sandbox_id: &str, action: Move) -> Result<SandboxRecord, NodeError> {
        let mut registry = self.registry.lock().await;
        let record = registry
            .sandboxes
            .get(sandbox_id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(sandbox_id.to_string()))?;
        let epoch = fence(&record, epoch)?;
        let mut next = record.clone();
        next.epoch = epoch;
        match next_state(&record, action)? {
            None => {}
            Some(state) => {
                let r = record.clone();
                match action {
                    Move::Pause => self.blocking(move |rt| rt.pause(&r)).await?,
                    Move::Resume => {
                        // Thaw first: commands started through envd live in the sandbox's
                        // cgroups too, whether or not it has a start command.
                        let thawed = r.clone();
                        self.blocking(move |rt| rt.resume(&thawed)).await?;
                        let has_command = record.start_command.as_deref().is_some_and(|c| !c.trim().is_empty());
                        if record.pgid == 0 && has_command {
                            // Its start command was not preserved (restored from a snapshot,
                            // or the host restarted while it was paused): start it afresh,
                            // files intact.
                            let home = self.home(sandbox_id);
                            next.pgid = self.blocking(move |rt| rt.start(&r, &home)).await?;
                        }
                    }
                    Move::Kill => self.blocking(move |rt| rt.kill(&r)).await?,
                }
                next.state = state;
            }
        }
        if next.state == State::Killed {
            registry.sandboxes.remove(sandbox_id);
            std::fs::remove_dir_all(self.sandbox_dir(sandbox_id)).map_err(io)?;
            tracing::info!(%sandbox_id, "sandbox killed");
        } else {
            if next != record {
                self.persist(&next)?;
            }
            registry.sandboxes.insert(sandbox_id.to_string(), next.clone());
        }
        Ok(next)
    }

    /// One sandbox.
    pub async fn get(&self, sandbox_id: &str) -> Option<SandboxRecord> {
        self.registry.lock().await.sandboxes.get(sandbox_id).cloned()
    }

    /// Every sandbox with the memory it uses now.
    pub async fn list(&self) -> Vec<(SandboxRecord, u64)> {
        let records: Vec<SandboxRecord> = self.registry.lock().await.sandboxes.values().cloned().collect();
        let mut out: Vec<(SandboxRecord, u64)> = records
            .into_iter()
            .map(|r| {
                let used = self.runtime.memory_used(&r);
                (r, used)
            })
            .collect();
        out.sort_by(|a, b| a.0.id.cmp(&b.0.id));
        out
    }

    /// The picture a heartbeat reports: the list and the totals from one snapshot of the
    /// registry.
    pub async fn picture(&self) -> Picture {
        self.runtime.reap();
        let listed = self.list().await;
        let mut allocated = Resources::default();
        let mut used = own_rss();
        let (running, paused) = listed.iter().fold((0u32, 0u32), |(r, p), (rec, _)| match rec.state {
            State::Running => (r + 1, p),
            State::Paused => (r, p + 1),
            State::Killed => (r, p),
        });
        metrics::gauge!("node_sandboxes", "state" => "running").set(f64::from(running));
        metrics::gauge!("node_sandboxes", "state" => "paused").set(f64::from(paused));
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
        let cpu_usage = match (self.runtime.cpu_time_ns(), self.cpu.lock()) {
            (Some(ns), Ok(mut rate)) => rate.observe(std::time::Instant::now(), ns),
            _ => 0.0,
        };
        Picture {
            sandboxes,
            allocated,
            memory_used_bytes: used,
            memory_available_bytes: self.config.capacity.memory_bytes.saturating_sub(used),
            cpu_usage,
        }
    }

    /// Checks a snapshot may be taken (paused, epoch current) and returns the record.
    pub async fn snapshot_source(&self, epoch: u64, sandbox_id: &str) -> Result<SandboxRecord, NodeError> {
        validate_id(sandbox_id)?;
        let mut registry = self.registry.lock().await;
        let record = registry
            .sandboxes
            .get_mut(sandbox_id)
            .ok_or_else(|| NodeError::NotFound(sandbox_id.to_string()))?;
        record.epoch = fence(record, epoch)?;
        if record.state != State::Paused {
            return Err(NodeError::Invalid(format!(
                "sandbox {sandbox_id} is {:?}: pause it before taking a snapshot",
                record.state
            )));
        }
        let record = record.clone();
        self.persist(&record)?;
        Ok(record)
    }

    /// Streams the sandbox's home as a tar archive in chunks; the last item is the SHA-256
    /// of all the data and its length.
    pub fn snapshot_stream(&self, sandbox_id: &str) -> mpsc::Receiver<Result<SnapshotPart, NodeError>> {
        let (tx, rx) = mpsc::channel(8);
        let home = self.home(sandbox_id);
        tokio::task::spawn_blocking(move || {
            let mut writer = ChunkWriter {
                tx: tx.clone(),
                buf: Vec::with_capacity(CHUNK),
                hasher: Sha256::new(),
                bytes: 0,
            };
            let result = (|| -> std::io::Result<()> {
                let mut archive = tar::Builder::new(&mut writer);
                archive.follow_symlinks(false);
                archive.append_dir_all("home", &home)?;
                archive.finish()?;
                drop(archive);
                writer.flush()
            })();
            match result {
                Ok(()) => {
                    let sha256 = hex(&writer.hasher.finalize_reset());
                    let _ = tx.blocking_send(Ok(SnapshotPart::End {
                        sha256,
                        bytes: writer.bytes,
                    }));
                }
                Err(err) => {
                    let _ = tx.blocking_send(Err(NodeError::Io(format!("archiving {}: {err}", home.display()))));
                }
            }
        });
        rx
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
        validate_id(&record.id)?;
        let call = format!("restore {}", record.id);
        self.once(operation_id, call, self.restore_now(epoch, record, data))
            .await
    }

    async fn restore_now(
        &self,
        epoch: u64,
        mut record: SandboxRecord,
        data: mpsc::Receiver<RestoreItem>,
    ) -> Result<SandboxRecord, NodeError> {
        if let Some(existing) = self.get(&record.id).await {
            if existing.state != State::Killed {
                return Err(NodeError::AlreadyExists(record.id));
            }
        }
        let scratch = sandboxes_dir(&self.config.state_dir).join(format!(
            ".restore-{}-{}",
            record.id,
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&scratch).map_err(io)?;
        let unpack_into = scratch.clone();
        let unpacked = tokio::task::spawn_blocking(move || -> Result<(Checksum, Option<Checksum>), NodeError> {
            let mut reader = ChunkReader {
                rx: data,
                current: Vec::new(),
                offset: 0,
                hasher: Sha256::new(),
                bytes: 0,
                trailer: None,
            };
            tar::Archive::new(&mut reader)
                .unpack(&unpack_into)
                .map_err(|e| NodeError::Corrupt(format!("unpacking: {e}")))?;
            // Drain what follows the archive's end (tar padding) up to the trailer.
            std::io::copy(&mut reader, &mut std::io::sink()).map_err(|e| NodeError::Corrupt(e.to_string()))?;
            let got = Checksum {
                sha256: hex(&reader.hasher.finalize_reset()),
                bytes: reader.bytes,
            };
            Ok((got, reader.trailer))
        })
        .await
        .map_err(|e| NodeError::Runtime(format!("restore task failed: {e}")));
        let checked = match unpacked.and_then(|r| r) {
            Ok((got, Some(want))) if got == want => Ok(()),
            Ok((got, Some(want))) => Err(NodeError::Corrupt(format!(
                "checksum {} over {} bytes, the source said {} over {}",
                got.sha256, got.bytes, want.sha256, want.bytes
            ))),
            Ok((_, None)) => Err(NodeError::Corrupt("the stream ended without a trailer".to_string())),
            Err(err) => Err(err),
        };
        if let Err(err) = checked {
            let _ = std::fs::remove_dir_all(&scratch);
            return Err(err);
        }
        let mut registry = self.registry.lock().await;
        if registry.sandboxes.contains_key(&record.id) {
            let _ = std::fs::remove_dir_all(&scratch);
            return Err(NodeError::AlreadyExists(record.id));
        }
        let dir = self.sandbox_dir(&record.id);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&scratch, &dir).map_err(io)?;
        record.state = State::Paused;
        record.pgid = 0;
        record.epoch = record.epoch.max(epoch);
        let r = record.clone();
        self.blocking(move |rt| rt.adopt(&r)).await?;
        self.persist(&record)?;
        registry.sandboxes.insert(record.id.clone(), record.clone());
        tracing::info!(sandbox_id = %record.id, "sandbox restored (paused)");
        Ok(record)
    }
}

/// Resident memory of this process, counted as the node's own use.
fn own_rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A piece of a snapshot stream.
pub enum SnapshotPart {
    Data(Vec<u8>),
    End { sha256: String, bytes: u64 },
}

/// A piece of a restore stream.
pub enum RestoreItem {
    Data(Vec<u8>),
    Trailer { sha256: String, bytes: u64 },
}

struct ChunkWriter {
    tx: mpsc::Sender<Result<SnapshotPart, NodeError>>,
    buf: Vec<u8>,
    hasher: Sha256,
    bytes: u64,
}

impl Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.hasher.update(&chunk);
        self.bytes += chunk.len() as u64;
        self.tx
            .blocking_send(Ok(SnapshotPart::Data(chunk)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "snapshot receiver gone"))
    }
}

struct ChunkReader {
    rx: mpsc::Receiver<RestoreItem>,
    current: Vec<u8>,
    offset: usize,
    hasher: Sha256,
    bytes: u64,
    trailer: Option<Checksum>,
}

/// What a snapshot's trailer states about its data.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Checksum {
    sha256: String,
    bytes: u64,
}

impl Read for ChunkReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.offset >= self.current.len() {
            if self.trailer.is_some() {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(RestoreItem::Data(chunk)) => {
                    self.hasher.update(&chunk);
                    self.bytes += chunk.len() as u64;
                    self.current = chunk;
                    self.offset = 0;
                }
                Some(RestoreItem::Trailer { sha256, bytes }) => self.trailer = Some(Checksum { sha256, bytes }),
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.current.len() - self.offset);
        out[..n].copy_from_slice(&self.current[self.offset..self.offset + n]);
        self.offset += n;
        Ok(n)
    }
}
