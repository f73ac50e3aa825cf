//! Pause without memory: the sandbox's files are kept off its node (in the gateway's
//! hibernation directory), its processes stopped and the node freed; resuming places it
//! again wherever placement chooses and restores the files there.

use common::docs::{SandboxDoc, SandboxPhase};
use ledger_client::Versioned;
use proto::node::v1 as node_pb;
use proto::placement::v1 as pl;

use super::{from_status, Failure, Sandboxes};

impl Sandboxes {
    pub(super) fn hibernation_files(&self, id: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        (
            self.hibernate_dir.join(format!("{id}.json")),
            self.hibernate_dir.join(format!("{id}.tar")),
        )
    }

    /// Copies a paused sandbox's snapshot (header, archive, checksum) off its node.
    pub(super) async fn hibernate(&self, doc: &SandboxDoc) -> Result<(), Failure> {
        use tokio::io::AsyncWriteExt;
        let io = |e: std::io::Error| Failure::Internal(format!("hibernation store: {e}"));
        tokio::fs::create_dir_all(&self.hibernate_dir).await.map_err(io)?;
        let (meta_path, tar_path) = self.hibernation_files(&doc.sandbox_id);
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
        let mut tar = tokio::fs::File::create(&tar_path).await.map_err(io)?;
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
        tokio::fs::write(&meta_path, meta.to_string()).await.map_err(io)?;
        Ok(())
    }

    /// Cold-boots a hibernated sandbox wherever placement chooses: restore its files there,
    /// start it, and point the manifest at it.
    pub(super) async fn wake(&self, doc: &mut Versioned<SandboxDoc>) -> Result<(), Failure> {
        let id = doc.value.sandbox_id.clone();
        let (meta_path, tar_path) = self.hibernation_files(&id);
        let io = |e: std::io::Error| Failure::Internal(format!("hibernation store: {e}"));
        let meta: serde_json::Value = serde_json::from_slice(&tokio::fs::read(&meta_path).await.map_err(io)?)
            .map_err(|e| Failure::Internal(e.to_string()))?;
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
            let data = tokio::fs::read(&tar_path).await.map_err(io)?;
            let mut chunks = vec![node_pb::RestoreChunk {
                part: Some(node_pb::restore_chunk::Part::Header(node_pb::RestoreHeader {
                    operation_id: format!("wake-{id}-{}", doc.value.epoch),
                    epoch: doc.value.epoch,
                    snapshot: Some(node_pb::SnapshotHeader {
                        sandbox_id: id.clone(),
                        description_json: meta["description_json"].as_str().unwrap_or_default().to_string(),
                    }),
                })),
            }];
            for piece in data.chunks(256 * 1024) {
                chunks.push(node_pb::RestoreChunk {
                    part: Some(node_pb::restore_chunk::Part::Data(piece.to_vec())),
                });
            }
            chunks.push(node_pb::RestoreChunk {
                part: Some(node_pb::restore_chunk::Part::Trailer(node_pb::SnapshotTrailer {
                    sha256: meta["sha256"].as_str().unwrap_or_default().to_string(),
                    bytes: meta["bytes"].as_u64().unwrap_or_default(),
                })),
            });
            let mut node = self.nodes.client(&placed.node_address).await?;
            node.restore(tokio_stream::iter(chunks))
                .await
                .map_err(|s| from_status("restore", s))?;
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
        let _ = tokio::fs::remove_file(&meta_path).await;
        let _ = tokio::fs::remove_file(&tar_path).await;
        Ok(())
    }
}
