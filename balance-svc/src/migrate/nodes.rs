//! gRPC clients of node-svcs, one per address, connected lazily and reused by every move and
//! the orphan sweep.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::trace::TracedChannel;
use proto::node::v1::node_client::NodeClient;
use tokio::sync::Mutex;

use super::MoveError;

/// Snapshots arrive as a stream of hundreds of MB: a large HTTP/2 window keeps the sender
/// from stalling on window updates (node-svc's server uses the same).
const STREAM_WINDOW: u32 = 8 << 20;

/// A node's ID and address: a client is for one node at one address.
type NodeKey = (String, String);

/// gRPC clients per node, connected lazily and reused; each accepts only a server that
/// proves it is the node it was asked for.
#[derive(Clone, Default)]
pub struct NodeClients {
    clients: Arc<Mutex<HashMap<NodeKey, NodeClient<TracedChannel>>>>,
    security: Option<mtls::Security>,
}

impl NodeClients {
    /// Clients that prove `security`'s role to every node (plaintext when made by `default`).
    pub fn new(security: mtls::Security) -> Self {
        Self {
            clients: Default::default(),
            security: Some(security),
        }
    }

    /// The client of node `node_id` at `address`.
    pub async fn get(&self, node_id: &str, address: &str) -> Result<NodeClient<TracedChannel>, MoveError> {
        let key = (node_id.to_string(), address.to_string());
        let mut clients = self.clients.lock().await;
        if let Some(client) = clients.get(&key) {
            return Ok(client.clone());
        }
        let channel = self
            .security
            .as_ref()
            .unwrap_or(&mtls::Security::Plaintext)
            .node_endpoint(address, node_id)
            .map_err(|e| MoveError::Failed(format!("bad node address {address:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .initial_stream_window_size(Some(STREAM_WINDOW))
            .initial_connection_window_size(Some(STREAM_WINDOW * 2))
            .connect_lazy();
        let client = NodeClient::new(common::trace::traced(channel)).max_decoding_message_size(16 << 20);
        clients.insert(key, client.clone());
        Ok(client)
    }
}
