//! Who each service of the cluster is, and who may call it.
//!
//! Every gRPC connection inside a sandboxsched cluster is mutual TLS: the server proves which
//! service it is to the client, and the client proves which service it is to the server, both
//! with certificates issued by one cluster CA. The identity is a [`Role`] (ledger, placement,
//! node, balance, gateway or the operator's `sandboxsched-ctl`), carried as the certificate's
//! DNS name `<role>.sandboxsched.internal`. A client checks that name, not the address it
//! dialled, so a node reached at any address must still prove it is a node.
//!
//! Authentication alone would let any node call the ledger, so every server also states who
//! may call each of its RPCs ([`Policy`]); [`Authorize`] enforces it on every request before
//! the service sees it, and answers `PERMISSION_DENIED` naming the caller and the method.
//! A method missing from a policy is refused: new RPCs are closed until someone opens them.
//!
//! The pieces:
//! - [`issue`]: a cluster CA and one certificate per role, written into a 0700 directory
//!   (what `sandboxsched-ctl certs`, `up` and compose run once);
//! - [`credentials`]: one role's certificate loaded from that directory, and the
//!   [`Security`] a service is configured with (mutual TLS, or plaintext for a test that asks
//!   for it by name);
//! - [`authorize`]: the per-RPC allow lists and the tower layer that holds servers to them.

pub mod authorize;
pub mod credentials;
pub mod issue;

pub use authorize::speaks_for_node;
pub use authorize::{Authorize, Policy};
pub use credentials::{Credentials, Security};
pub use issue::{issue_cluster, issue_node, read_secret, read_token_key, Issued};
/// A peer's certificate as the TLS handshake hands it over (tonic's `peer_certs`).
pub use rustls_pki_types::CertificateDer;

use std::fmt;
use std::path::PathBuf;

/// A service's identity in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Ledger,
    Placement,
    Node,
    Balance,
    Gateway,
    /// The operator's command line (`sandboxsched-ctl`) and anything an operator scripts.
    Operator,
    /// The operator's web console (`console-svc`): it reads what the operator reads and may
    /// drain nodes and pause the balancer, but writes no ledger document, so a console taken
    /// over cannot rewrite the cluster's state the way the operator's own key can.
    Console,
}

impl Role {
    /// Every role, in the order certificates are issued.
    pub const ALL: [Role; 7] = [
        Role::Ledger,
        Role::Placement,
        Role::Node,
        Role::Balance,
        Role::Gateway,
        Role::Operator,
        Role::Console,
    ];

    /// The roles whose one pair every instance of the role shares ([`issue_cluster`]); each
    /// node has a pair of its own instead ([`issue_node`]).
    pub const SHARED: [Role; 6] = [
        Role::Ledger,
        Role::Placement,
        Role::Balance,
        Role::Gateway,
        Role::Operator,
        Role::Console,
    ];

    /// The short name: file names in the certificate directory, log fields, error messages.
    pub fn name(self) -> &'static str {
        match self {
            Role::Ledger => "ledger",
            Role::Placement => "placement",
            Role::Node => "node",
            Role::Balance => "balance",
            Role::Gateway => "gateway",
            Role::Operator => "operator",
            Role::Console => "console",
        }
    }

    /// The DNS name a certificate of this role is valid for, and the name a client checks
    /// when it connects to a server of this role: `<name>.`[`DOMAIN`]. Static, because every
    /// call a server takes checks the caller's certificate against it.
    pub fn dns_name(self) -> &'static str {
        match self {
            Role::Ledger => "ledger.sandboxsched.internal",
            Role::Placement => "placement.sandboxsched.internal",
            Role::Node => "node.sandboxsched.internal",
            Role::Balance => "balance.sandboxsched.internal",
            Role::Gateway => "gateway.sandboxsched.internal",
            Role::Operator => "operator.sandboxsched.internal",
            Role::Console => "console.sandboxsched.internal",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The DNS suffix of every identity. Never resolved: it only names roles inside certificates.
pub const DOMAIN: &str = "sandboxsched.internal";

/// The name that binds a node's certificate to one node ID: `<node_id>.node.`[`DOMAIN`].
///
/// Every node's certificate names the node role (so the per-RPC policies treat all nodes
/// alike) and, beside it, the node IDs it speaks for. Placement takes a heartbeat only from a
/// certificate that names the heartbeat's node ID, and the gateway and the balancer accept a
/// node's server only when it names the node they meant to reach: one node's stolen key lets
/// nobody report, or answer, in another node's name.
pub fn node_dns_name(node_id: &str) -> String {
    format!("{node_id}.node.{DOMAIN}")
}

/// Checks that `node_id` can stand in a certificate's name: one DNS label (1 to 63 of `a-z`,
/// `0-9` and `-`, neither first nor last a `-`).
pub fn check_node_id(node_id: &str) -> Result<(), String> {
    let label = node_id.len() <= 63
        && !node_id.is_empty()
        && !node_id.starts_with('-')
        && !node_id.ends_with('-')
        && node_id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if label {
        Ok(())
    } else {
        Err(format!(
            "node id {node_id:?} must be 1 to 63 of a-z, 0-9 and '-', not starting or ending with '-' \
             (it is named in the node's certificate)"
        ))
    }
}

/// Why certificates could not be made, read or used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is readable by other users (mode {mode:o}): a private key must be 0600 or 0400")]
    KeyExposed { path: PathBuf, mode: u32 },
    #[error("making certificates: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("{0} is not a URL: {1}")]
    Endpoint(String, String),
    #[error("TLS settings refused: {0}")]
    Config(String),
    #[error("{0}")]
    NodeId(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_roles_dns_name_is_its_name_in_the_domain() {
        for role in Role::ALL {
            assert_eq!(role.dns_name(), format!("{}.{DOMAIN}", role.name()));
        }
    }

    #[test]
    fn a_node_id_is_one_dns_label() {
        for good in ["node-1", "n1", "a", "0", &"x".repeat(63)] {
            assert!(check_node_id(good).is_ok(), "{good}");
        }
        for bad in ["", "-a", "a-", "Node-1", "a.b", "a_b", "a b", "*", &"x".repeat(64)] {
            assert!(check_node_id(bad).is_err(), "{bad:?}");
        }
        assert_eq!(node_dns_name("node-1"), "node-1.node.sandboxsched.internal");
    }
}
