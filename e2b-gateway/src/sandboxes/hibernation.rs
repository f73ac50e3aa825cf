//! Pause without memory: the sandbox's files are kept off its node, in the cluster's blob
//! store (`snapshots/<id>.tar`, so any gateway can wake it), its processes stopped and the
//! node freed; resuming places it again wherever placement chooses and restores the files
//! there. The gateway's hibernation directory is only a spool: a snapshot passes through it
//! on its way to and from the store, never whole in memory.
//!
//! What the archive needs beside it (the node's description of the sandbox, which holds its
//! environment and tokens, and the archive's checksum) is sealed (`crate::tokens`) and kept in
//! the manifest itself (`hibernation`), not in the store: a reader of the store learns no
//! secret, and a writer of the store can neither put an archive of its own in the sandbox's
//! place (the wake checks the sealed checksum) nor bring back an older one with its own
//! description (the manifest, compared and swapped in the ledger, holds the current one).

use common::docs::{SandboxDoc, SandboxPhase};
use ledger_client::Versioned;
use proto::node::v1 as node_pb;
use proto::placement::v1 as pl;

use blobs::Key;

use super::{from_status, Failure, Sandboxes};
use crate::tokens::Secret;

/// What the store keeps beside a hibernated sandbox's archive: the node's description of it
/// (template, resources, environment, tokens) and the archive's checksum and length.
#[derive(serde::Serialize, serde::Deserialize)]
struct Hibernated {
    description_json: String,
    sha256: String,
    #[serde(default)]
    bytes: u64,
}

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
        crate::spool::private_dir(&self.hibernate_dir).await
    }

    /// Copies a paused sandbox's snapshot (header, archive, checksum) off its node; answers
    /// the seal of its description and checksum, for the manifest's `hibernation`.
    pub(super) async fn hibernate(&self, doc: &SandboxDoc) -> Result<String, Failure> {
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
    ) -> Result<String, Failure> {
        use tokio::io::AsyncWriteExt;
        let io = |e: std::io::Error| Failure::Internal(format!("hibernation spool: {e}"));
        let store = |e: blobs::BlobError| Failure::Unavailable(format!("blob store: {e}"));
        let mut node = self.nodes.client(&doc.node_id, &doc.node_address).await?;
        let mut stream = node
            .snapshot(node_pb::LifecycleRequest {
                operation_id: String::new(),
                epoch: doc.epoch,
                sandbox_id: doc.sandbox_id.clone(),
            })
            .await
            .map_err(|s| from_status("snapshot", s))?
            .into_inner();
        let mut tar = crate::spool::new_file(tar_path).await.map_err(io)?;
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
        let hibernated = Hibernated {
            description_json: header.description_json,
            sha256: trailer.sha256,
            bytes: trailer.bytes,
        };
        // The description holds the sandbox's tokens and environment: sealed with the
        // archive's checksum, for the manifest (see the module's comment).
        let plain = serde_json::to_vec(&hibernated).map_err(|e| Failure::Internal(e.to_string()))?;
        self.store.put_file(tar_key, tar_path).await.map_err(store)?;
        // A description a gateway from before sealing left in the store is stale now.
        if let Err(err) = self.store.delete(meta_key).await {
            tracing::debug!(sandbox_id = %doc.sandbox_id, %err, "no old description to remove");
        }
        Ok(self.tokens.seal(Secret::Hibernation, &doc.sandbox_id, &plain))
    }

    /// A hibernated sandbox's description and checksum: opened from the seal its manifest
    /// keeps, or, for a sandbox a gateway from before sealing hibernated, read from the store.
    async fn hibernated(&self, doc: &SandboxDoc, meta_key: &Key) -> Result<Hibernated, Failure> {
        let id = &doc.sandbox_id;
        let bad = |e: String| Failure::Internal(format!("sandbox {id}'s hibernation description: {e}"));
        match doc.hibernation.as_deref() {
            Some(sealed) => {
                let plain = self
                    .tokens
                    .open(Secret::Hibernation, id, sealed)
                    .map_err(|e| bad(e.to_string()))?;
                serde_json::from_slice(&plain).map_err(|e| bad(e.to_string()))
            }
            None => {
                let meta = self
                    .store
                    .get_bytes(meta_key)
                    .await
                    .map_err(|e| Failure::Unavailable(format!("blob store: {e}")))?;
                serde_json::from_slice(&meta).map_err(|e| bad(e.to_string()))
            }
        }
    }

    /// Cold-boots a hibernated sandbox wherever placement chooses: restore its files there,
    /// start it, and point the manifest at it.
    pub(super) async fn wake(&self, doc: &mut Versioned<SandboxDoc>) -> Result<(), Failure> {
        let id = doc.value.sandbox_id.clone();
        let (meta_key, tar_key) = Self::snapshot_keys(&id)?;
        let store = |e: blobs::BlobError| Failure::Unavailable(format!("blob store: {e}"));
        let meta = self.hibernated(&doc.value, &meta_key).await?;
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
            doc.value.hibernation = None;
            self.forget_snapshot(&id).await;
        }
        woken
    }

    async fn wake_from(
        &self,
        doc: &mut Versioned<SandboxDoc>,
        meta: &Hibernated,
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
                        description_json: meta.description_json.clone(),
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
                    sha256: meta.sha256.clone(),
                    bytes: meta.bytes,
                })),
            };
            let chunks = futures::StreamExt::chain(
                futures::StreamExt::chain(futures::stream::iter([header]), data),
                futures::stream::iter([trailer]),
            );
            let mut node = self.nodes.client(&placed.node_id, &placed.node_address).await?;
            node.restore(chunks).await.map_err(|s| from_status("restore", s))?;
            node.resume(node_pb::LifecycleRequest {
                operation_id: format!("wake-resume-{id}-{}", doc.value.epoch),
                epoch: doc.value.epoch,
                sandbox_id: id.clone(),
            })
            .await
            .map_err(|s| from_status("resume", s))?;
            self.nodes.envd(&placed.node_id, &placed.node_address).await
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
