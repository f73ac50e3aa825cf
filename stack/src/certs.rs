//! A stack's cluster certificates: issued into `<dir>/certs` when the stack starts (kept, and
//! reused, when the directory is kept, as `up`'s data directory is), one loaded
//! [`Security`](mtls::Security) per role for the services, the tests and the benchmarks.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mtls::{Role, Security, TlsError};

/// The certificates of one stack, loaded.
#[derive(Clone, Debug)]
pub struct Certs {
    dir: Option<PathBuf>,
    loaded: HashMap<Role, Security>,
    token_key: envd_wire::sealed::TokenKey,
}

impl Certs {
    /// Issues what is missing in `dir` (0700) and loads every role.
    pub fn issue(dir: &Path) -> Result<Self, TlsError> {
        mtls::issue_cluster(dir, false)?;
        let mut loaded = HashMap::new();
        for role in Role::SHARED {
            loaded.insert(role, Security::load(dir, role)?);
        }
        let token_key = envd_wire::sealed::TokenKey::from_hex(&mtls::read_token_key(dir)?)
            .map_err(|e| TlsError::Config(format!("tokens.key: {e}")))?;
        Ok(Self {
            dir: Some(dir.to_path_buf()),
            loaded,
            token_key,
        })
    }

    /// No certificates: every service of the stack serves and calls in plaintext (for a
    /// benchmark that measures what mutual TLS costs).
    pub fn plaintext() -> Self {
        Self {
            dir: None,
            loaded: HashMap::new(),
            token_key: envd_wire::sealed::TokenKey::random(),
        }
    }

    /// Where the certificates are (`sandboxsched-ctl --tls-dir`), if the stack has any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The gateways' token key.
    pub fn token_key(&self) -> &envd_wire::sealed::TokenKey {
        &self.token_key
    }

    /// How a service or client of `role` connects in this stack. Nodes have no shared
    /// identity: ask [`Certs::node`] for one node's.
    pub fn security(&self, role: Role) -> Security {
        assert!(
            role != Role::Node,
            "every node has its own certificate: Certs::node(ID)"
        );
        self.loaded.get(&role).cloned().unwrap_or(Security::Plaintext)
    }

    /// How node `node_id` serves and calls in this stack: its own pair, issued on first ask
    /// (plaintext when the stack is).
    pub fn node(&self, node_id: &str) -> Result<Security, TlsError> {
        match &self.dir {
            None => Ok(Security::Plaintext),
            Some(dir) => {
                mtls::issue_node(dir, node_id, &[node_id], false)?;
                Security::load_node(dir, node_id)
            }
        }
    }

    /// An endpoint of the service of role `peer` at `address`, as the caller that may call
    /// the most of it: the balancer towards nodes and placement (everything but heartbeats),
    /// the operator towards the ledger (reads, and writes of every kind) and the balancer.
    /// For tests and benchmarks that drive a service directly.
    pub fn endpoint(&self, address: &str, peer: Role) -> Result<tonic::transport::Endpoint, TlsError> {
        let caller = match peer {
            Role::Node | Role::Placement => Role::Balance,
            Role::Ledger => Role::Operator,
            Role::Balance | Role::Gateway | Role::Operator | Role::Console => Role::Operator,
        };
        self.security(caller).endpoint(address, peer)
    }
}
