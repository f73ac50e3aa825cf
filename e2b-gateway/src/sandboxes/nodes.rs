//! gRPC clients of the nodes, one per node address, connected lazily and reused, and each
//! node's envd address once asked.

use std::collections::HashMap;
use std::time::Duration;

use common::trace::TracedChannel;
use proto::node::v1 as node_pb;
use proto::node::v1::node_client::NodeClient;
use tokio::sync::Mutex;

use super::{from_status, Failure};

/// A node's ID, its channel, and its envd address once asked.
type NodeEntry = (String, NodeClient<TracedChannel>, Option<String>);

/// Channels to nodes, and their envd addresses, by node gRPC address. Each channel accepts
/// only a server that proves it is the node the address was given for.
pub(super) struct Nodes {
    clients: Mutex<HashMap<String, NodeEntry>>,
    /// How the gateway proves itself to nodes (and checks that a node is one).
    security: mtls::Security,
}

impl Nodes {
    pub(super) fn new(security: mtls::Security) -> Self {
        Self {
            clients: Mutex::default(),
            security,
        }
    }

    /// The channel to node `node_id` at `address`.
    pub(super) async fn client(&self, node_id: &str, address: &str) -> Result<NodeClient<TracedChannel>, Failure> {
        let mut map = self.clients.lock().await;
        if let Some((_, c, _)) = map.get(address).filter(|(id, _, _)| id == node_id) {
            return Ok(c.clone());
        }
        let channel = self
            .security
            .node_endpoint(address, node_id)
            .map_err(|e| Failure::Internal(format!("bad node address {address:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            // Hibernation streams whole snapshots: HTTP/2's default 64 KiB window stalls them.
            .initial_stream_window_size(Some(8 << 20))
            .initial_connection_window_size(Some(16 << 20))
            .connect_lazy();
        let client = NodeClient::new(common::trace::traced(channel));
        map.insert(address.to_string(), (node_id.to_string(), client.clone(), None));
        Ok(client)
    }

    /// The envd address of node `node_id` at `address`, asked once.
    pub(super) async fn envd(&self, node_id: &str, address: &str) -> Result<String, Failure> {
        if let Some((_, _, Some(envd))) = self
            .clients
            .lock()
            .await
            .get(address)
            .filter(|(id, _, _)| id == node_id)
        {
            return Ok(envd.clone());
        }
        let mut client = self.client(node_id, address).await?;
        let info = client
            .info(node_pb::InfoRequest {})
            .await
            .map_err(|s| from_status("node info", s))?
            .into_inner();
        if let Some(entry) = self.clients.lock().await.get_mut(address) {
            entry.2 = Some(info.envd_address.clone());
        }
        Ok(info.envd_address)
    }
}
