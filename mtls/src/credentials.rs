//! One role's certificate, loaded, and how a service uses it to serve and to call.
//!
//! A service is configured with a [`Security`]: [`Security::MutualTls`] in every binary and in
//! the test stacks, [`Security::Plaintext`] only where a test of one service alone asks for it
//! by name. Clients are built through [`Security::endpoint`], which is the one place that
//! turns a service address into a connection: under mutual TLS it dials `https://` (tonic
//! only speaks TLS to an `https` URL; an `http` one would silently go out in clear) and checks
//! that the server is the role the caller meant to reach.

use std::path::Path;
use std::sync::Arc;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

use crate::issue::{ca_cert_path, node_paths, read_secret, role_paths};
use crate::{Role, TlsError};

/// One role's certificate and key, and the cluster CA it trusts.
pub struct Credentials {
    role: Role,
    ca: Certificate,
    identity: Identity,
    /// The same, for rustls itself (the HTTP hop from gateway to node, which tonic does not
    /// carry): made once, shared by every connection.
    http_server: Arc<rustls::ServerConfig>,
    http_client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// Loads `role`'s pair and the CA from a certificate directory (see [`crate::issue`]).
    pub fn load(dir: &Path, role: Role) -> Result<Self, TlsError> {
        let (cert_path, key_path) = role_paths(dir, role);
        Self::load_pair(dir, role, &cert_path, &key_path)
    }

    /// Loads the pair of node `name` (its node ID; see [`crate::issue::issue_node`]).
    pub fn load_node(dir: &Path, name: &str) -> Result<Self, TlsError> {
        crate::check_node_id(name).map_err(TlsError::NodeId)?;
        let (cert_path, key_path) = node_paths(dir, name);
        Self::load_pair(dir, Role::Node, &cert_path, &key_path)
    }

    fn load_pair(dir: &Path, role: Role, cert_path: &Path, key_path: &Path) -> Result<Self, TlsError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Io {
                path: path.to_path_buf(),
                source,
            })
        };
        let ca = read(&ca_cert_path(dir))?;
        let cert = read(cert_path)?;
        let key = read_secret(key_path)?;
        let (http_server, http_client) = rustls_configs(&ca, &cert, key.as_bytes())?;
        Ok(Self {
            role,
            ca: Certificate::from_pem(ca),
            identity: Identity::from_pem(cert, key),
            http_server,
            http_client,
        })
    }

    /// The TLS of an HTTP server of this role: its certificate, and a client certificate of
    /// the cluster demanded of every caller (which role it names is the server's to check:
    /// [`crate::authorize::role_of`] on the handshake's peer certificate).
    pub fn http_server(&self) -> Arc<rustls::ServerConfig> {
        self.http_server.clone()
    }

    /// The TLS of an HTTP client of this role: the cluster CA alone trusted, this role's
    /// certificate presented; the name to check is the connection's (a node's:
    /// [`crate::node_dns_name`]).
    pub fn http_client(&self) -> Arc<rustls::ClientConfig> {
        self.http_client.clone()
    }

    /// A server's TLS: present this role's certificate, demand a client certificate signed by
    /// the cluster CA (a client without one never completes the handshake).
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
    }

    /// A client's TLS towards a server of role `peer`: present this role's certificate, trust
    /// only the cluster CA, and accept only a server certificate that names `peer`.
    pub fn client(&self, peer: Role) -> ClientTlsConfig {
        self.client_for(peer.dns_name().to_string())
    }

    /// A client's TLS that accepts only a server certificate valid for `name`.
    fn client_for(&self, name: String) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .identity(self.identity.clone())
            .domain_name(name)
    }
}

/// How a service's gRPC traffic is protected.
#[derive(Clone, Debug)]
pub enum Security {
    /// Mutual TLS with the cluster's certificates, and every RPC held to its [`crate::Policy`].
    MutualTls(Arc<Credentials>),
    /// No TLS and no authorisation: for a test of one service alone, never for a cluster.
    Plaintext,
}

impl Security {
    /// Mutual TLS as `role`, from a certificate directory.
    pub fn load(dir: &Path, role: Role) -> Result<Self, TlsError> {
        Ok(Self::MutualTls(Arc::new(Credentials::load(dir, role)?)))
    }

    /// Mutual TLS as node `node_id`, from a certificate directory.
    pub fn load_node(dir: &Path, node_id: &str) -> Result<Self, TlsError> {
        Ok(Self::MutualTls(Arc::new(Credentials::load_node(dir, node_id)?)))
    }

    /// The server side of this security, if it has one.
    pub fn server(&self) -> Option<ServerTlsConfig> {
        match self {
            Security::MutualTls(credentials) => Some(credentials.server()),
            Security::Plaintext => None,
        }
    }

    /// An endpoint for a server of role `peer` at `address` (`http://HOST:PORT`, `https://…`
    /// or bare `HOST:PORT`), with this side's TLS. Connection settings (timeouts, windows) are
    /// the caller's to add.
    pub fn endpoint(&self, address: &str, peer: Role) -> Result<Endpoint, TlsError> {
        self.endpoint_for(address, peer.dns_name().to_string())
    }

    /// An endpoint for node `node_id` at `address`: as [`Security::endpoint`] towards a node,
    /// and the server must also prove it is that node (its certificate names the ID), so an
    /// address that leads to another node, or to a thief of another node's key, is refused.
    pub fn node_endpoint(&self, address: &str, node_id: &str) -> Result<Endpoint, TlsError> {
        self.endpoint_for(address, crate::node_dns_name(node_id))
    }

    fn endpoint_for(&self, address: &str, server_name: String) -> Result<Endpoint, TlsError> {
        let bare = address
            .strip_prefix("http://")
            .or_else(|| address.strip_prefix("https://"))
            .unwrap_or(address);
        let refuse = |reason: String| TlsError::Endpoint(address.to_string(), reason);
        match self {
            Security::MutualTls(credentials) => Endpoint::from_shared(format!("https://{bare}"))
                .map_err(|e| refuse(e.to_string()))?
                .tls_config(credentials.client_for(server_name))
                .map_err(|e| TlsError::Config(e.to_string())),
            Security::Plaintext => Endpoint::from_shared(format!("http://{bare}")).map_err(|e| refuse(e.to_string())),
        }
    }
}

/// The rustls server and client configurations of one pair, trusting the cluster CA alone.
fn rustls_configs(
    ca: &[u8],
    cert: &[u8],
    key: &[u8],
) -> Result<(Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>), TlsError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |what: &str, e: String| TlsError::Config(format!("{what}: {e}"));
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(ca) {
        roots
            .add(ca.map_err(|e| bad("the CA certificate", e.to_string()))?)
            .map_err(|e| bad("the CA certificate", e.to_string()))?;
    }
    let roots = Arc::new(roots);
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad("the certificate", e.to_string()))?;
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| bad("the key", e.to_string()))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| bad("the client verifier", e.to_string()))?;
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("TLS versions", e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| bad("the server's certificate", e.to_string()))?;
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("TLS versions", e.to_string()))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| bad("the client's certificate", e.to_string()))?;
    Ok((Arc::new(server), Arc::new(client)))
}
