//! Creating a sandbox: its record from the spec and the template, its layers fetched, its
//! container started, and its template's ready command awaited.

use super::*;

pub(super) fn validate_id(id: &str) -> Result<(), NodeError> {
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
pub(super) fn new_record(spec: CreateSpec, template: Template, now_ms: u64) -> SandboxRecord {
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
        pooled: spec.pooled,
    }
}

impl Shared {
    /// Creates and starts a sandbox.
    pub(super) async fn create(&self, spec: CreateSpec) -> Result<SandboxRecord, NodeError> {
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

    pub(super) async fn create_now(&self, turn: &Turn<'_>, spec: CreateSpec) -> Result<SandboxRecord, NodeError> {
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
                record.pgid = runtime.start(&record.view(), &home)?;
                if let Err(err) = dir.persist(&record) {
                    let _ = runtime.kill(&record.view());
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
                let _ = runtime.kill(&r.view());
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

    /// Makes an image's layers present on this node (fetched from the blob store).
    pub(super) async fn ensure_layers(&self, image: Option<&common::template::Image>) -> Result<(), NodeError> {
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
            self.make_room(cache, image);
        }
        Ok(())
    }

    /// Evicts layers past the cache's bound, in the background: the layers of every sandbox
    /// here, and `image`'s, stay.
    pub(super) fn make_room(&self, cache: &Arc<crate::layer_cache::LayerCache>, image: &common::template::Image) {
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

    /// Waits until the sandbox's template says it is ready: its ready command, run as the
    /// default user through the sandbox's own envd, exits 0 (E2B's `readyCmd`; without memory
    /// snapshots the start command runs at every create, so every create waits for it).
    pub(super) async fn ready(&self, record: &SandboxRecord) -> Result<(), NodeError> {
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
}
