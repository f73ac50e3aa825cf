//! Pause without memory: the sandbox's files are kept off its node, in the cluster's blob
//! store (`snapshots/<id>.tar` and `snapshots/<id>.json`, so any gateway can wake it), its
//! processes stopped and the node freed; resuming places it again wherever placement chooses
//! and restores the files there. The gateway's hibernation directory is only a spool: a
//! snapshot passes through it on its way to and from the store, never whole in memory.

use common::docs::{SandboxDoc, SandboxPhase};
use ledger_client::Versioned;
use proto::node::v1 as node_pb;
use proto::placement::v1 as pl;

use blobs::Key;

use super::{from_status, Failure, Sandboxes};

impl Sandboxes {
    /// The blob store keys of a hibernated sandbox's description and archive.
    fn snapshot_keys(id: &str) -> Result<(Key, Key), Failure> {
        let key = |ext: &str| {
            Key::new(format!("snapshots/{id}.{ext}")).map_err(|e| Failure::Internal(format!("snapshot key: {e}")))
        };
        Ok((key("json")?, key("tar")?))
    }

    /// A spool file of this gateway's, for one snapshot on its way.
    fn spool(&self, id: &str) -> std::path::PathBuf {
        self.hibernate_dir
            .join(format!("{id}-{}.tar", uuid::Uuid::new_v4().simple()))
    }

    /// Removes a woken (or killed) sandbox's snapshot from the store.
    pub(super) async fn forget_snapshot(&self, id: &str) {
        if let Ok((meta, tar)) = Self::snapshot_keys(id) {
            for key in [meta, tar] {
                if let Err(err) = self.store.delete(&key).await {
                    tracing::warn!(sandbox_id = %id, %err, "hibernation snapshot not removed from the blob store");
                }
            }
        }
    }

    /// The spool directory, made if missing and closed to every other user: a sandbox's
    /// files pass through it.
    async fn open_spool(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        tokio::fs::create_dir_all(&self.hibernate_dir).await?;
        tokio::fs::set_permissions(&self.hibernate_dir, std::fs::Permissions::from_mode(0o700)).await
    }

    /// Copies a paused sandbox's snapshot (header, archive, checksum) off its node.
    pub(super) async fn hibernate(&self, doc: &SandboxDoc) -> Result<(), Failure> {
        let io = |e: std::io::Error| Failure::Internal(format!("hibernation spool: {e}"));
        self.open_spool().await.map_err(io)?;
        let (meta_key, tar_key) = Self::snapshot_keys(&doc.sandbox_id)?;
        let tar_path = self.spool(&doc.sandbox_id);
        let stored = self.snapshot_to(doc, &tar_path, &meta_key, &tar_key).await;
        let _ = tokio::fs::remove_file(&tar_path).await;
        stored
    }

    async fn snapshot_to(
        &self,
        doc: &SandboxDoc,
        tar_path: &std::path::Path,
        meta_key: &Key,
        tar_key: &Key,
    ) -> Result<(), Failure> {
        use tokio::io::AsyncWriteExt;
        let io = |e: std::io::Error| Failure::Internal(format!("hibernation spool: {e}"));
        let store = |e: blobs::BlobError| Failure::Unavailable(format!("blob store: {e}"));
        let mut node = self.nodes.client(&doc.node_address).await?;
        let mut stream = node
            .snapshot(node_pb::LifecycleRequest {
                operation_id: String::new(),
                epoch: doc.epoch,
                sandbox_id: doc.sandbox_id.clone(),
            })
            .await
            .map_err(|s| from_status("snapshot", s))?
            .into_inner();
        let mut tar = tokio::fs::File::create(tar_path).await.map_err(io)?;
        let (mut header, mut trailer) = (None, None);
        while let Some(chunk) = stream.message().await.map_err(|s| from_status("snapshot", s))? {
            match chunk.part {
                Some(node_pb::snapshot_chunk::Part::Header(h)) => header = Some(h),
                Some(node_pb::snapshot_chunk::Part::Data(d)) => tar.write_all(&d).await.map_err(io)?,
                Some(node_pb::snapshot_chunk::Part::Trailer(t)) => trailer = Some(t),
                None => {}
            }
        }
        tar.sync_all().await.map_err(io)?;
        let (Some(header), Some(trailer)) = (header, trailer) else {
            return Err(Failure::Internal("the snapshot stream was incomplete".into()));
        };
        let meta = serde_json::json!({
            "description_json": header.description_json,
            "sha256": trailer.sha256,
            "bytes": trailer.bytes,
        });
        // The archive first: a description in the store always has its archive beside it.
        self.store.put_file(tar_key, tar_path).await.map_err(store)?;
        self.store
            .put_bytes(meta_key, meta.to_string().into_bytes().into())
            .await
            .map_err(store)?;
        Ok(())
    }

    /// Cold-boots a hibernated sandbox wherever placement chooses: restore its files there,
    /// start it, and point the manifest at it.
    pub(super) async fn wake(&self, doc: &mut Versioned<SandboxDoc>) -> Result<(), Failure> {
        let id = doc.value.sandbox_id.clone();
        let (meta_key, tar_key) = Self::snapshot_keys(&id)?;
        let store = |e: blobs::BlobError| Failure::Unavailable(format!("blob store: {e}"));
        let meta: serde_json::Value = serde_json::from_slice(&self.store.get_bytes(&meta_key).await.map_err(store)?)
            .map_err(|e| Failure::Internal(e.to_string()))?;
        let io = |e: std::io::Error| Failure::Internal(format!("hibernation spool: {e}"));
        self.open_spool().await.map_err(io)?;
        let tar_path = self.spool(&id);
        if let Err(err) = self.store.get_to_file(&tar_key, &tar_path).await {
            let _ = tokio::fs::remove_file(&tar_path).await;
            return Err(store(err));
        }
        let woken = self.wake_from(doc, &meta, &tar_path).await;
        let _ = tokio::fs::remove_file(&tar_path).await;
        if woken.is_ok() {
            self.forget_snapshot(&id).await;
        }
        woken
    }

    async fn wake_from(
        &self,
        doc: &mut Versioned<SandboxDoc>,
        meta: &serde_json::Value,
        tar_path: &std::path::Path,
    ) -> Result<(), Failure> {
        let id = doc.value.sandbox_id.clone();
        let io = |e: std::io::Error| Failure::Internal(format!("hibernation spool: {e}"));
        let placed = self
            .placement
            .clone()
            .place(pl::PlaceRequest {
                sandbox_id: id.clone(),
                resources: Some(pl::Resources {
                    vcpus: doc.value.vcpus,
                    memory_bytes: doc.value.memory_bytes,
                }),
                ..Default::default()
            })
            .await
            .map_err(|s| from_status("placement", s))?
            .into_inner();
        let sandbox_ref = pl::SandboxRef {
            sandbox_id: id.clone(),
            node_id: placed.node_id.clone(),
            resources: None,
        };
        let restored = async {
            let file = tokio::fs::File::open(tar_path).await.map_err(io)?;
            let header = node_pb::RestoreChunk {
                part: Some(node_pb::restore_chunk::Part::Header(node_pb::RestoreHeader {
                    operation_id: format!("wake-{id}-{}", doc.value.epoch),
                    epoch: doc.value.epoch,
                    snapshot: Some(node_pb::SnapshotHeader {
                        sandbox_id: id.clone(),
                        description_json: meta["description_json"].as_str().unwrap_or_default().to_string(),
                    }),
                })),
            };
            // The archive streams from the spool file in pieces, never whole in memory.
            let data = futures::stream::unfold(file, |mut file| async move {
                use tokio::io::AsyncReadExt as _;
                let mut piece = vec![0u8; 256 * 1024];
                match file.read(&mut piece).await {
                    Ok(0) | Err(_) => None,
                    Ok(n) => {
                        piece.truncate(n);
                        Some((
                            node_pb::RestoreChunk {
                                part: Some(node_pb::restore_chunk::Part::Data(piece)),
                            },
                            file,
                        ))
                    }
                }
            });
            let trailer = node_pb::RestoreChunk {
                part: Some(node_pb::restore_chunk::Part::Trailer(node_pb::SnapshotTrailer {
                    sha256: meta["sha256"].as_str().unwrap_or_default().to_string(),
                    bytes: meta["bytes"].as_u64().unwrap_or_default(),
                })),
            };
            let chunks = futures::StreamExt::chain(
                futures::StreamExt::chain(futures::stream::iter([header]), data),
                futures::stream::iter([trailer]),
            );
            let mut node = self.nodes.client(&placed.node_address).await?;
            node.restore(chunks).await.map_err(|s| from_status("restore", s))?;
            node.resume(node_pb::LifecycleRequest {
                operation_id: format!("wake-resume-{id}-{}", doc.value.epoch),
                epoch: doc.value.epoch,
                sandbox_id: id.clone(),
            })
            .await
            .map_err(|s| from_status("resume", s))?;
            self.nodes.envd(&placed.node_address).await
        }
        .await;
        let envd = match restored {
            Ok(envd) => envd,
            Err(err) => {
                let _ = self.placement.clone().release(sandbox_ref).await;
                return Err(err);
            }
        };
        let _ = self.placement.clone().created(sandbox_ref).await;
        doc.value.node_id = placed.node_id;
        doc.value.node_address = placed.node_address;
        doc.value.envd_address = envd;
        doc.value.phase = SandboxPhase::Running;
        Ok(())
    }
}
