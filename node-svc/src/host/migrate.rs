//! A sandbox leaving and arriving: its writable layer captured as an image, streamed as a
//! snapshot, and restored on the node it moves to.

use super::*;

impl Shared {
    pub(super) async fn capture(&self, epoch: u64, id: &str) -> Result<common::template::Image, NodeError> {
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
            blocking(move || runtime.pause(&r.view()).map_err(NodeError::from)).await?;
        }
        let packed = cache.pack(&self.dir.home(id)).await;
        if running {
            let (runtime, r) = (self.runtime.clone(), record.clone());
            blocking(move || runtime.resume(&r.view()).map_err(NodeError::from)).await?;
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

    /// Checks a snapshot may be taken (paused, epoch current) and returns the record.
    pub(super) async fn snapshot_source(
        &self,
        epoch: u64,
        sandbox_id: &str,
    ) -> Result<(SandboxRecord, Option<tokio::sync::OwnedMutexGuard<()>>), NodeError> {
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
        Ok((record, turn.keep()))
    }

    /// Recreates a sandbox from a snapshot: unpacks the archive chunks from `data` into a
    /// scratch folder, checks the SHA-256 against the trailer, then installs it, paused.
    pub(super) async fn restore(
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

    pub(super) async fn restore_now(
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
                .and_then(|()| runtime.adopt(&r.view()).map_err(NodeError::from))
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
