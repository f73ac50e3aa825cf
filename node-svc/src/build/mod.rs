//! Template builds on this node: a template's steps run one after another, each step's
//! changes captured as a layer of its own.
//!
//! - The base: a template's image (its layers on the host's userland, or an image's own root)
//!   or an image pulled from a registry into the blob store (`blobs::registry`), then given
//!   E2B's `user` account if it has none (a provisioning step run as root inside it).
//! - RUN: a builder container (a sandbox in all but name: the build's resources, the node's
//!   isolation, a link out) over the layers so far, with an empty writable layer; the command
//!   runs through the container's own envd as the step's user, its output streamed to the
//!   build's log. Whatever it wrote is the step's layer.
//! - COPY and WORKDIR write into a fresh layer directly ([`files`]), no container needed.
//! - ENV and USER change only the image's config.
//! - The build cache: every step that makes a layer records it under a key made of its parent's
//!   key and the step ([`steps::cache_key`]) in the blob store, so any node building the same
//!   prefix of steps reuses the layers instead of running them (unless forced; a forced step
//!   forces all after it).
//! - Finalize: with a start command, a container of the finished image starts it and waits for
//!   the ready command, so a template whose start never becomes ready fails its build rather
//!   than every create.
//!
//! A failure ends the build with the step that failed and its last output; nothing is
//! registered (the gateway records the outcome).

pub mod files;
pub mod steps;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use blobs::Key;
use common::clock::now_ms;
use common::template::{Image, Layer};
use proto::node::v1 as pb;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::envd_client;
use crate::host::Host;
use crate::layer_cache::LayerCache;
use crate::runtime::container::spec::{HOST_ID_BASE, ID_RANGE};
use crate::sandbox::{Resources, SandboxRecord, State};
use common::template::Step;

/// The longest one RUN step may take.
const STEP_DEADLINE: Duration = Duration::from_secs(1800);
/// How long a template's ready command may take at the end of its build.
const READY_DEADLINE: Duration = Duration::from_secs(120);
/// Lines of a failed step's output carried in the failure's message.
const TAIL_LINES: usize = 20;

/// How a step failed.
#[derive(Debug)]
pub struct Failed {
    pub step: String,
    pub message: String,
}

fn failed(step: &str, message: impl std::fmt::Display) -> Failed {
    Failed {
        step: step.to_string(),
        message: message.to_string(),
    }
}

/// A build cache entry: the layer a step made (`None`: it made no changes).
#[derive(Debug, Serialize, Deserialize)]
struct CacheEntry {
    layer: Option<Layer>,
}

/// One build in progress.
pub struct Build {
    host: Arc<Host>,
    cache: Arc<LayerCache>,
    events: mpsc::Sender<Result<pb::BuildEvent, tonic::Status>>,
    build_id: String,
    resources: Resources,
    /// Containers run so far (each gets its own ID).
    runs: std::sync::atomic::AtomicU32,
    /// The layers this build's containers stand on, each pinned once, which no eviction
    /// takes while it runs.
    pins: std::sync::Mutex<std::collections::HashMap<String, crate::layer_cache::Pins>>,
}

/// Runs the build `request` asks for, sending its log and outcome on `events`.
pub async fn run(
    host: Arc<Host>,
    request: pb::BuildRequest,
    events: mpsc::Sender<Result<pb::BuildEvent, tonic::Status>>,
) {
    let Some(cache) = host.layers().cloned() else {
        let _ = events
            .send(Ok(failure("base", "this node has no blob store to keep layers in")))
            .await;
        return;
    };
    if host.runtime_kind() != "container" {
        let message = format!("the {} runtime cannot build templates", host.runtime_kind());
        let _ = events.send(Ok(failure("base", message))).await;
        return;
    }
    let resources = request.resources.unwrap_or_default();
    let build_disk_bytes = host.config().build_disk_bytes;
    let build = Build {
        host,
        cache,
        events: events.clone(),
        build_id: request.build_id.clone(),
        resources: Resources {
            vcpus: resources.vcpus.max(1),
            memory_bytes: resources.memory_bytes.max(128 << 20),
            disk_bytes: build_disk_bytes,
        },
        runs: Default::default(),
        pins: Default::default(),
    };
    let event = match build.steps(request).await {
        Ok(image) => pb::BuildEvent {
            event: Some(pb::build_event::Event::Done((&image).into())),
        },
        Err(f) => {
            build.log("error", &f.step, &f.message);
            failure(&f.step, f.message)
        }
    };
    let _ = events.send(Ok(event)).await;
}

fn failure(step: &str, message: impl Into<String>) -> pb::BuildEvent {
    pb::BuildEvent {
        event: Some(pb::build_event::Event::Failed(pb::BuildFailure {
            step: step.to_string(),
            message: message.into(),
        })),
    }
}

impl Build {
    /// Makes `image`'s layers present on this node, pinned first for the rest of the build (a
    /// create's or another build's eviction would otherwise take them from under its
    /// containers).
    async fn present(&self, image: &Image) -> Result<(), crate::layer_cache::LayerError> {
        {
            let mut pins = self.pins.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for layer in &image.layers {
                if !pins.contains_key(&layer.digest) {
                    pins.insert(layer.digest.clone(), self.cache.pin(std::slice::from_ref(layer)));
                }
            }
        }
        self.cache.ensure_all(&image.layers).await.map(drop)
    }

    /// One line of the build's log (dropped if the gateway reads too slowly to keep up).
    fn log(&self, level: &str, step: &str, message: &str) {
        let event = pb::BuildEvent {
            event: Some(pb::build_event::Event::Log(pb::BuildLog {
                at_unix_ms: now_ms(),
                level: level.to_string(),
                message: message.to_string(),
                step: step.to_string(),
            })),
        };
        let _ = self.events.try_send(Ok(event));
    }

    async fn steps(&self, request: pb::BuildRequest) -> Result<Image, Failed> {
        let mut forced = request.force;
        let (mut image, mut key) = self.base(&request, forced).await?;
        for (i, raw) in request.steps.iter().enumerate() {
            let label = (i + 1).to_string();
            let step = Step::parse(&raw.kind, &raw.args, &raw.files_hash).map_err(|e| failed(&label, e))?;
            forced |= raw.force;
            key = steps::cache_key(&key, &raw.kind, &raw.args, &raw.files_hash);
            self.log(
                "info",
                &label,
                &format!("[{label}/{}] {}", request.steps.len(), step.describe()),
            );
            match step {
                Step::Env(pairs) => image.env.extend(pairs),
                Step::User(user) => image.user = user,
                Step::Workdir(dir) => {
                    let dir = format!("/{}", steps::in_sandbox(&dir, &image.workdir).display());
                    image.workdir = dir.clone();
                    let layer = self
                        .cached_or(&key, forced, &label, || self.workdir(&image, &dir))
                        .await?;
                    image.layers.extend(layer);
                }
                Step::Run { script, user } => {
                    let user = if user.is_empty() { image.user.clone() } else { user };
                    let layer = self
                        .cached_or(&key, forced, &label, || self.run_step(&image, &label, &script, &user))
                        .await?;
                    image.layers.extend(layer);
                }
                Step::Copy {
                    files,
                    src,
                    dest,
                    user,
                    mode,
                } => {
                    let user = if user.is_empty() { image.user.clone() } else { user };
                    let layer = self
                        .cached_or(&key, forced, &label, || {
                            self.copy(&image, &files, &src, &dest, &user, mode)
                        })
                        .await?;
                    image.layers.extend(layer);
                }
            }
        }
        image.start_cmd = Some(request.start_cmd).filter(|c| !c.trim().is_empty());
        image.ready_cmd = Some(request.ready_cmd).filter(|c| !c.trim().is_empty());
        if image.ready_cmd.is_some() && image.start_cmd.is_none() {
            return Err(failed("finalize", "a ready command needs a start command"));
        }
        self.finalize(&image).await?;
        image.build_id = self.build_id.clone();
        self.cache.remember(&image);
        self.host.make_room_for(&image);
        Ok(image)
    }

    /// The image the build starts from, and the cache key of that start.
    async fn base(&self, request: &pb::BuildRequest, forced: bool) -> Result<(Image, String), Failed> {
        if let Some(template) = request.from_template.clone() {
            let mut image = Image::from(template);
            image.start_cmd = None;
            image.ready_cmd = None;
            let what = serde_json::to_string(&(&image.layers, image.host_userland)).unwrap_or_default();
            self.log("info", "base", "FROM a template");
            return Ok((image, steps::base_key(&what)));
        }
        if request.from_image.is_empty() {
            return Err(failed("base", "the build names no image or template to start from"));
        }
        if let Some(why) = self.host.runtime().images_refused() {
            return Err(failed("base", format!("this node cannot build from an image: {why}")));
        }
        self.log("info", "base", &format!("FROM {}", request.from_image));
        self.registry_allowed(&request.from_image).await?;
        let auth = if request.registry_username.is_empty() {
            blobs::registry::RegistryAuth::Anonymous
        } else {
            blobs::registry::RegistryAuth::Basic {
                username: request.registry_username.clone(),
                password: request.registry_password.clone(),
            }
        };
        // Every connection the pull makes (the registry's redirects, its token realm) goes
        // through a proxy that holds it to the same floor as the registry's own name.
        let config = self.host.config();
        let (floor, private) = (config.registry_floor.clone(), config.private_registries.clone());
        let proxy = blobs::egress::EgressProxy::start(move |authority: &str, ip: std::net::IpAddr| {
            named_private(&private, authority) || !in_floor(&floor, ip)
        })
        .await
        .map_err(|e| failed("base", format!("cannot start the pull's egress proxy: {e}")))?;
        let pulled = blobs::registry::pull_image_via(
            &request.from_image,
            auth,
            self.cache.store().as_ref(),
            Some(&proxy.url()),
        )
        .await
        .map_err(|e| failed("base", format!("pulling {}: {e}", request.from_image)))?;
        drop(proxy);
        self.log(
            "info",
            "base",
            &format!(
                "Pulled {} ({} layers, {} already stored, {} bytes fetched)",
                pulled.digest,
                pulled.layers.len(),
                pulled.cached_layers,
                pulled.fetched_bytes
            ),
        );
        let config = pulled.config;
        let mut image = Image {
            layers: pulled
                .layers
                .iter()
                .map(|l| Layer {
                    digest: l.digest.clone(),
                    size: l.size,
                })
                .collect(),
            host_userland: false,
            env: config
                .env
                .iter()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            user: config.user.clone().unwrap_or_default(),
            workdir: config.working_dir.clone().unwrap_or_default(),
            ..Image::default()
        };
        let key = steps::base_key(&pulled.digest.to_string());
        // E2B's `user`: added unless the image has it.
        let provisioned = self
            .cached_or(&key, forced, "base", || {
                self.run_step(&image, "base", steps::PROVISION, "root")
            })
            .await?;
        image.layers.extend(provisioned);
        Ok((image, key))
    }

    /// Refuses a registry that resolves into the egress floor (private, loopback, link-local:
    /// the control plane's own network, a cloud's metadata service) unless the operator named
    /// it in `--private-registries`: a build names any host, and the node fetches from its own
    /// network, outside any sandbox's rules. (The pull resolves the name again; a name that
    /// changes its answer in between is not caught here.)
    async fn registry_allowed(&self, image: &str) -> Result<(), Failed> {
        let reference = blobs::registry::parse_reference(image).map_err(|e| failed("base", e))?;
        let registry = reference.resolve_registry().to_string();
        let config = self.host.config();
        if config.private_registries.contains(&registry) {
            return Ok(());
        }
        let with_port = if registry.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
            registry.clone()
        } else {
            format!("{registry}:443")
        };
        let addresses = tokio::net::lookup_host(&with_port)
            .await
            .map_err(|e| failed("base", format!("registry {registry}: {e}")))?;
        for address in addresses {
            if in_floor(&config.registry_floor, address.ip()) {
                return Err(failed(
                    "base",
                    format!(
                        "registry {registry} resolves to {}, an address sandboxes may not reach; an operator can allow it with --private-registries",
                        address.ip()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The layer a step made before (same parent, same step), or the one it makes now.
    async fn cached_or<F, Fut>(&self, key: &str, forced: bool, label: &str, make: F) -> Result<Option<Layer>, Failed>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Option<Layer>, Failed>>,
    {
        let entry_key = Key::new(format!("build-cache/{key}")).map_err(|e| failed(label, e))?;
        if !forced {
            if let Some(layer) = self.cache_hit(&entry_key).await {
                self.log("info", label, "CACHED");
                return Ok(layer);
            }
        }
        let layer = make().await?;
        let entry = serde_json::to_vec(&CacheEntry { layer: layer.clone() }).map_err(|e| failed(label, e))?;
        if let Err(err) = self.cache.store().put_bytes(&entry_key, entry.into()).await {
            tracing::warn!(%err, "build cache entry not written");
        }
        Ok(layer)
    }

    /// A usable cache entry: recorded, and its layer still in the store.
    async fn cache_hit(&self, entry_key: &Key) -> Option<Option<Layer>> {
        let bytes = self.cache.store().get_bytes(entry_key).await.ok()?;
        let entry: CacheEntry = serde_json::from_slice(&bytes).ok()?;
        match entry.layer {
            None => Some(None),
            Some(layer) => {
                let key = crate::layer_cache::blob_key(&layer.digest).ok()?;
                self.cache.store().exists(&key).await.ok()?.map(|_| Some(layer))
            }
        }
    }

    /// The layer directories of `image`, topmost first, with what lies under them (the base
    /// layer under templates on the host's userland, the shim over an image's own).
    async fn stack(&self, image: &Image, label: &str) -> Result<files::Stack, Failed> {
        self.present(image).await.map_err(|e| failed(label, e))?;
        let state = self.host.state_dir();
        let mut dirs = Vec::new();
        if !image.host_userland {
            dirs.push(crate::runtime::container::shim_dir(state));
        }
        for layer in image.layers.iter().rev() {
            dirs.push(crate::layer_cache::layer_path(self.cache.root(), &layer.digest).map_err(|e| failed(label, e))?);
        }
        if image.host_userland {
            dirs.push(crate::runtime::container::base_dir(state));
        }
        Ok(files::Stack(dirs))
    }

    /// Host ids of `user` in `image`: `root`, `user`, numeric ids, or a name in its
    /// `/etc/passwd`.
    fn ids_of(stack: &files::Stack, user: &str) -> Option<(u32, u32)> {
        let (uid, gid) = steps::known_ids(user).or_else(|| {
            let passwd = stack.read_file(Path::new("etc/passwd"))?;
            steps::ids_in_passwd(&passwd, user)
        })?;
        (uid < ID_RANGE && gid < ID_RANGE).then_some((HOST_ID_BASE + uid, HOST_ID_BASE + gid))
    }

    fn scratch_layer(&self) -> PathBuf {
        self.cache
            .root()
            .join("tmp")
            .join(format!("step-{}", uuid::Uuid::new_v4().simple()))
    }

    /// A layer made on the host: `write` fills a fresh directory; published unless empty.
    async fn host_layer<W>(&self, label: &str, write: W) -> Result<Option<Layer>, Failed>
    where
        W: FnOnce(&Path) -> std::io::Result<()> + Send + 'static,
    {
        let dir = self.scratch_layer();
        let d = dir.clone();
        let written = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            files::new_layer_dir(&d, HOST_ID_BASE)?;
            write(&d)
        })
        .await
        .map_err(|e| failed(label, e))
        .and_then(|r| r.map_err(|e| failed(label, e)));
        if let Err(err) = written {
            let _ = tokio::fs::remove_dir_all(&dir).await;
            return Err(err);
        }
        self.cache.publish(&dir).await.map_err(|e| failed(label, e))
    }

    async fn workdir(&self, image: &Image, dir: &str) -> Result<Option<Layer>, Failed> {
        let stack = self.stack(image, "workdir").await?;
        let owner = Self::ids_of(&stack, &image.user).unwrap_or((HOST_ID_BASE, HOST_ID_BASE));
        let rel = steps::in_sandbox(dir, "/");
        self.host_layer("workdir", move |layer| {
            files::make_dirs(layer, &stack, &rel, owner).map(drop)
        })
        .await
    }

    async fn copy(
        &self,
        image: &Image,
        archive: &str,
        src: &str,
        dest: &str,
        user: &str,
        mode: Option<u32>,
    ) -> Result<Option<Layer>, Failed> {
        let label = "copy";
        let stack = self.stack(image, label).await?;
        let owner = Self::ids_of(&stack, user)
            .ok_or_else(|| failed(label, format!("user {user:?} does not exist in the template")))?;
        let target = steps::in_sandbox(dest, &image.workdir);
        if image.host_userland && target.starts_with("usr") {
            return Err(failed(
                label,
                "a template built on base cannot change /usr (it is the host's, read-only); start from an image instead",
            ));
        }
        let key = Key::new(archive.to_string()).map_err(|e| failed(label, e))?;
        let tar = self
            .cache
            .root()
            .join("tmp")
            .join(format!("files-{}", uuid::Uuid::new_v4().simple()));
        self.cache
            .store()
            .get_to_file(&key, &tar)
            .await
            .map_err(|e| failed(label, format!("the step's files: {e}")))?;
        let (src, dest, workdir, tar_c) = (src.to_string(), dest.to_string(), image.workdir.clone(), tar.clone());
        // A step's files can be no larger than the layer cache that must hold them.
        let max_bytes = self.cache.max_bytes();
        let made = self
            .host_layer(label, move |layer| {
                let extracted = layer.with_extension("extract");
                std::fs::create_dir_all(&extracted)?;
                let result = (|| {
                    let file = std::fs::File::open(&tar_c)?;
                    let gzip = {
                        use std::io::Read as _;
                        let mut magic = [0u8; 2];
                        std::fs::File::open(&tar_c)?.read(&mut magic)? == 2 && magic == [0x1f, 0x8b]
                    };
                    layers::files::extract_files_within(
                        std::io::BufReader::new(file),
                        gzip,
                        &extracted,
                        owner,
                        mode,
                        max_bytes,
                    )
                    .map_err(std::io::Error::other)?;
                    let source = files::beneath(&extracted, &steps::in_sandbox(&src, "/")).map_err(|e| {
                        if e.kind() == std::io::ErrorKind::NotFound {
                            std::io::Error::other(format!("{src:?} is not in the uploaded files"))
                        } else {
                            std::io::Error::other(format!("{src:?}: {e}"))
                        }
                    })?;
                    let is_dir = std::fs::symlink_metadata(&source)?;
                    match steps::placement(is_dir.is_dir(), &src, &dest, &workdir) {
                        steps::Placement::File(to) => {
                            if let Some(parent) = to.parent() {
                                files::make_dirs(layer, &stack, parent, owner)?;
                            }
                            files::place(&source, &layer.join(&to))
                        }
                        steps::Placement::Into(to) => {
                            files::make_dirs(layer, &stack, &to, owner)?;
                            files::place(&source, &layer.join(&to))
                        }
                    }
                })();
                let _ = std::fs::remove_dir_all(&extracted);
                result
            })
            .await;
        let _ = tokio::fs::remove_file(&tar).await;
        made
    }

    /// A builder container over `image`: the build's resources, a link out, nothing started.
    fn builder_record(&self, image: &Image, start_command: Option<String>) -> SandboxRecord {
        let run = self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let short: String = self
            .build_id
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .take(12)
            .collect();
        SandboxRecord {
            id: format!("build-{short}-{run}"),
            template: "build".into(),
            resources: self.resources,
            env: image.env.clone(),
            metadata: Default::default(),
            start_command,
            access_token: None,
            network: Some(common::egress::NetworkPolicy::default()),
            traffic_access_token: None,
            image: Some(image.clone()),
            state: State::Running,
            epoch: 1,
            pgid: 0,
            created_at_unix_ms: now_ms(),
            pooled: false,
        }
    }

    /// Starts a builder container; its writable layer is the returned home.
    async fn start(&self, record: &SandboxRecord, label: &str) -> Result<(PathBuf, SandboxRecord), Failed> {
        let home = self.host.home(&record.id);
        let (runtime, mut r, h) = (self.host.runtime().clone(), record.clone(), home.clone());
        let (dir, disks) = (self.host.sandbox_dir(&record.id), self.host.disks().clone());
        let started = tokio::task::spawn_blocking(move || -> Result<SandboxRecord, String> {
            let _ = crate::disk::remove_folder(&dir);
            let made = disks
                .attach(&dir, r.resources.disk_bytes)
                .and_then(|()| std::fs::create_dir_all(&h))
                .map_err(|e| e.to_string())
                .and_then(|()| runtime.start(&r.view(), &h).map_err(|e| e.to_string()));
            match made {
                Ok(pgid) => r.pgid = pgid,
                Err(err) => {
                    // Nothing of a builder that did not start stays behind.
                    let _ = crate::disk::remove_folder(&dir);
                    return Err(err);
                }
            }
            Ok(r)
        })
        .await
        .map_err(|e| failed(label, e))?
        .map_err(|e| failed(label, format!("starting the builder: {e}")))?;
        Ok((home, started))
    }

    /// Kills a builder container; with `keep_home`, its writable layer is left for publishing.
    async fn stop(&self, record: &SandboxRecord, keep_home: bool) {
        let (runtime, r, dir) = (
            self.host.runtime().clone(),
            record.clone(),
            self.host.sandbox_dir(&record.id),
        );
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(err) = runtime.kill(&r.view()) {
                tracing::warn!(sandbox_id = %r.id, %err, "builder container not killed");
            }
            if !keep_home {
                let _ = crate::disk::remove_folder(&dir);
            }
        })
        .await;
    }

    /// A RUN step: its command in a builder container; its changes, the layer.
    async fn run_step(&self, image: &Image, label: &str, script: &str, user: &str) -> Result<Option<Layer>, Failed> {
        self.present(image).await.map_err(|e| failed(label, e))?;
        let record = self.builder_record(image, None);
        let (home, record) = self.start(&record, label).await?;
        let socket = self
            .host
            .runtime()
            .envd_socket(&home)
            .ok_or_else(|| failed(label, "the runtime has no envd to run the step through"))?;
        let command = envd_client::Command {
            script: script.to_string(),
            user: user.to_string(),
            env: image.env.clone(),
            cwd: image.workdir.clone(),
        };
        let mut tail: std::collections::VecDeque<String> = Default::default();
        let ran = envd_client::run(&socket, &command, STEP_DEADLINE, |stderr, line| {
            self.log(if stderr { "warn" } else { "info" }, label, line);
            if tail.len() == TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line.to_string());
        })
        .await;
        let ok = matches!(&ran, Ok(exit) if exit.code == 0);
        self.stop(&record, ok).await;
        match ran {
            Ok(exit) if exit.code == 0 => {}
            Ok(exit) => {
                let output = Vec::from(tail).join("\n");
                return Err(failed(
                    label,
                    format!("the command exited with code {}: {script}\n{output}", exit.code),
                ));
            }
            Err(err) => return Err(failed(label, err)),
        }
        let dir = self.host.sandbox_dir(&record.id);
        let published = self.cache.publish(&home).await.map_err(|e| failed(label, e));
        let _ = tokio::task::spawn_blocking(move || crate::disk::remove_folder(&dir)).await;
        published
    }

    /// With a start command: a container of the finished image starts it, and the ready
    /// command must pass.
    async fn finalize(&self, image: &Image) -> Result<(), Failed> {
        let Some(start) = image.start_cmd.clone() else {
            return Ok(());
        };
        self.log(
            "info",
            "finalize",
            &format!("Starting {start:?} and waiting until it is ready"),
        );
        self.present(image).await.map_err(|e| failed("finalize", e))?;
        let record = self.builder_record(image, Some(start));
        let (home, record) = self.start(&record, "finalize").await?;
        let ready = match (&image.ready_cmd, self.host.runtime().envd_socket(&home)) {
            (Some(check), Some(socket)) => {
                let command = envd_client::Command {
                    script: check.clone(),
                    env: image.env.clone(),
                    ..Default::default()
                };
                envd_client::until_ok(&socket, &command, READY_DEADLINE).await
            }
            _ => Ok(()),
        };
        self.stop(&record, false).await;
        ready.map_err(|e| failed("finalize", format!("the ready command: {e}")))?;
        self.log("info", "finalize", "Ready");
        Ok(())
    }
}

/// Whether the operator allowed the destination `authority` (`host:port`, as a pull's
/// client asks for it) by name in `--private-registries` (a registry named without a port is
/// reached on HTTPS's, 443).
fn named_private(private: &[String], authority: &str) -> bool {
    let without_https_port = authority.strip_suffix(":443").unwrap_or(authority);
    private.iter().any(|r| r == authority || r == without_https_port)
}

/// Whether `ip` is behind the egress floor (`floor`'s IPv4 ranges; IPv6 loopback,
/// unspecified, unique-local and link-local): the control plane's own network, a cloud's
/// metadata service. An IPv6 address that carries an IPv4 one (mapped `::ffff:0:0/96`,
/// compatible `::/96`, NAT64 `64:ff9b::/96` and `64:ff9b:1::/48`, 6to4 `2002::/16`) is
/// judged by that IPv4 address, where a gateway would take it.
fn in_floor(floor: &[common::egress::Cidr], ip: std::net::IpAddr) -> bool {
    let v4_in_floor = |v4: std::net::Ipv4Addr| floor.iter().any(|c| c.contains(v4));
    match ip {
        std::net::IpAddr::V4(v4) => v4_in_floor(v4),
        std::net::IpAddr::V6(v6) => {
            if v6.is_loopback()
                || v6.is_unspecified()
                || (v6.segments()[0] & 0xfe00) == 0xfc00
                || (v6.segments()[0] & 0xffc0) == 0xfe80
            {
                return true;
            }
            let [a, b, ..] = v6.segments();
            let o = v6.octets();
            let low = std::net::Ipv4Addr::new(o[12], o[13], o[14], o[15]);
            let carried: Vec<std::net::Ipv4Addr> = if let Some(mapped) = v6.to_ipv4_mapped() {
                vec![mapped]
            } else if o[..12].iter().all(|&x| x == 0) {
                vec![low]
            } else if a == 0x64 && b == 0xff9b {
                // NAT64 (64:ff9b::/96, and the local-use 64:ff9b:1::/48 with the address
                // after its prefix, skipping the reserved octet 8).
                vec![low, std::net::Ipv4Addr::new(o[6], o[7], o[9], o[10])]
            } else if a == 0x2002 {
                vec![std::net::Ipv4Addr::new(o[2], o[3], o[4], o[5])]
            } else {
                Vec::new()
            };
            carried.into_iter().any(v4_in_floor)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::in_floor;
    use std::net::IpAddr;

    #[test]
    fn an_ipv6_address_carrying_a_private_ipv4_one_is_behind_the_floor() {
        let floor = [
            common::egress::Cidr::new("10.0.0.0".parse().unwrap(), 8).unwrap(),
            common::egress::Cidr::new("169.254.0.0".parse().unwrap(), 16).unwrap(),
        ];
        let judged = |ip: &str| in_floor(&floor, ip.parse::<IpAddr>().unwrap());
        for behind in [
            "10.0.0.5",
            "169.254.169.254",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:10.0.0.5",
            "::10.0.0.5",
            "64:ff9b::a00:5",
            "64:ff9b::169.254.169.254",
            "64:ff9b:1:a00:0:500::",
            "2002:a00:5::1",
        ] {
            assert!(judged(behind), "{behind} passed the floor");
        }
        for open in [
            "8.8.8.8",
            "2606:4700::1111",
            "64:ff9b::808:808",
            "2002:808:808::1",
            "::ffff:8.8.8.8",
        ] {
            assert!(!judged(open), "{open} was refused");
        }
    }
}
