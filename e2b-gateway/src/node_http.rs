//! The gateway's HTTP hop to the nodes: envd calls and a sandbox's ports.
//!
//! Every request on this hop carries a sandbox's access token, so under mutual TLS it travels
//! in TLS and reaches only the node it is for: the gateway presents its certificate (a node's
//! envd endpoint takes connections from gateways alone) and accepts the far side only when
//! its certificate names the node ID the sandbox's manifest says it runs on. An address that
//! leads elsewhere, or to a thief of another node's key, is refused before a token is sent.
//!
//! Nodes advertise their envd endpoint as `http://HOST:PORT`; which node it is comes from the
//! manifest. For the pooled client the node's ID rides in the URI's user part
//! (`https://NODE@HOST:PORT/…`), which is what keys the pool and what the server-name check
//! reads; it is never sent (HTTP/1.1 requests go out in origin form, `Host: HOST:PORT`).
//! Without TLS (a test of one service alone), plain `http://HOST:PORT`.

use std::sync::Arc;

use axum::body::Body;
use http::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpStream;

type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// A connection to a node for the port relay: TLS, or plain TCP without it.
pub trait NodeStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static> NodeStream for T {}

/// Why the hop to a node failed.
#[derive(Debug, thiserror::Error)]
pub enum HopError {
    #[error("not a node address: {0}")]
    Address(String),
    #[error("{0}")]
    Connect(std::io::Error),
    #[error("{0}")]
    Request(#[from] hyper_util::client::legacy::Error),
}

/// How long a connection to a node (TCP, and TLS on the gateway's own connections) may take:
/// a node that vanished from the network must fail a request, not hold it until the kernel
/// gives up on the SYN minutes later.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// HTTP clients of the nodes, pooled per node and address.
#[derive(Clone)]
pub struct NodeHttp {
    client: Client<Connector, Body>,
    /// The gateway's TLS towards nodes (`None`: plaintext).
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl NodeHttp {
    pub fn new(security: &mtls::Security) -> Self {
        let tls = match security {
            mtls::Security::MutualTls(credentials) => Some(credentials.http_client()),
            mtls::Security::Plaintext => None,
        };
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        // https when TLS is configured, http otherwise: the URI's scheme says which.
        http.enforce_http(false);
        let config = tls.as_deref().cloned().unwrap_or_else(|| {
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("the default provider supports the default versions")
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        });
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_or_http()
            .with_server_name_resolver(node_server_name)
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(std::time::Duration::from_secs(60))
            .build(connector);
        Self { client, tls }
    }

    /// The URI of `path_and_query` on node `node_id`'s envd endpoint `envd` (`http://HOST:PORT`).
    pub fn uri(&self, node_id: &str, envd: &str, path_and_query: &str) -> Result<Uri, HopError> {
        let authority = host_port(envd)?;
        let text = match self.tls {
            Some(_) => format!("https://{node_id}@{authority}{path_and_query}"),
            None => format!("http://{authority}{path_and_query}"),
        };
        text.parse().map_err(|_| HopError::Address(envd.to_string()))
    }

    /// Sends one request (its URI from [`NodeHttp::uri`]) over a pooled connection.
    pub async fn send(&self, request: http::Request<Body>) -> Result<http::Response<hyper::body::Incoming>, HopError> {
        Ok(self.client.request(request).await?)
    }

    /// A connection of its own to node `node_id`'s envd endpoint, for a relay that may be
    /// upgraded (WebSocket): the same checks as the pooled client.
    pub async fn connect(&self, node_id: &str, envd: &str) -> Result<Box<dyn NodeStream>, HopError> {
        tokio::time::timeout(CONNECT_TIMEOUT, self.connect_now(node_id, envd))
            .await
            .map_err(|_| {
                HopError::Connect(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no connection to node {node_id} within {CONNECT_TIMEOUT:?}"),
                ))
            })?
    }

    async fn connect_now(&self, node_id: &str, envd: &str) -> Result<Box<dyn NodeStream>, HopError> {
        let authority = host_port(envd)?;
        let tcp = TcpStream::connect(authority).await.map_err(HopError::Connect)?;
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else {
            return Ok(Box::new(tcp));
        };
        let name = rustls::pki_types::ServerName::try_from(mtls::node_dns_name(node_id))
            .map_err(|_| HopError::Address(format!("node id {node_id:?}")))?;
        let stream = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await
            .map_err(HopError::Connect)?;
        Ok(Box::new(stream))
    }
}

/// `HOST:PORT` of an advertised envd endpoint.
fn host_port(envd: &str) -> Result<&str, HopError> {
    let bare = envd
        .strip_prefix("http://")
        .or_else(|| envd.strip_prefix("https://"))
        .unwrap_or(envd)
        .trim_end_matches('/');
    if bare.is_empty() || bare.contains(['/', '@']) {
        return Err(HopError::Address(envd.to_string()));
    }
    Ok(bare)
}

/// The name a node's certificate must hold: that of the node the URI's user part names.
fn node_server_name(uri: &Uri) -> Result<rustls::pki_types::ServerName<'static>, String> {
    let node_id = uri
        .authority()
        .and_then(|a| a.as_str().split_once('@'))
        .map(|(user, _)| user)
        .ok_or_else(|| format!("{uri}: no node named"))?;
    rustls::pki_types::ServerName::try_from(mtls::node_dns_name(node_id)).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uri_names_its_node_and_the_check_reads_it_back() {
        let plain = NodeHttp::new(&mtls::Security::Plaintext);
        let uri = plain.uri("node-1", "http://127.0.0.1:49983", "/health").unwrap();
        assert_eq!(uri.to_string(), "http://127.0.0.1:49983/health");
        let named: Uri = "https://node-1@127.0.0.1:49983/files?path=a".parse().unwrap();
        assert_eq!(named.host(), Some("127.0.0.1"));
        assert_eq!(
            node_server_name(&named).unwrap().to_str(),
            "node-1.node.sandboxsched.internal"
        );
        assert!(node_server_name(&uri).is_err(), "a URI without a node passes no check");
        for bad in ["", "http://", "http://a@b:1", "http://a:1/x"] {
            assert!(host_port(bad).is_err(), "{bad:?}");
        }
    }
}
