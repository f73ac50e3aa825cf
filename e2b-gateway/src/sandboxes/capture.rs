//! Capturing a sandbox's files as an image, for E2B's snapshots (a snapshot is a template
//! made from a sandbox) and forks (new sandboxes from such an image). The node freezes a
//! running sandbox for the moment it reads its writable layer, then lets it continue: its ID,
//! node and timeout do not change.

use common::docs::{SandboxDoc, SandboxPhase};
use common::template::Image;
use proto::node::v1 as node_pb;

use super::{from_status, Failure, Sandboxes};

impl Sandboxes {
    /// The sandbox's image now: its template's layers plus one of what it wrote.
    pub async fn capture(&self, team: &str, id: &str) -> Result<(SandboxDoc, Image), Failure> {
        let doc = self.get_settled(team, id).await?.value;
        let on_node = matches!(doc.phase, SandboxPhase::Running | SandboxPhase::Paused) && !doc.node_address.is_empty();
        if !on_node {
            return Err(Failure::Conflict(format!(
                "sandbox {id} is {:?}: only a running or paused sandbox can be snapshotted or forked",
                doc.phase
            )));
        }
        let mut node = self.nodes.client(&doc.node_id, &doc.node_address).await?;
        let image = node
            .capture(node_pb::LifecycleRequest {
                operation_id: format!("capture-{id}-{}", uuid::Uuid::new_v4().simple()),
                epoch: doc.epoch,
                sandbox_id: id.to_string(),
            })
            .await
            .map_err(|s| from_status("capture", s))?
            .into_inner();
        Ok((doc, image.into()))
    }
}
