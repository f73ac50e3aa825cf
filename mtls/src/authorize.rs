//! Who may call which RPC.
//!
//! Each server states, per gRPC service it serves, which roles may call each method
//! ([`Policy`]). [`Authorize`] is a tower layer in front of every route of a server: it reads
//! the caller's role from the client certificate the TLS handshake verified, looks the method
//! up, and either passes the call on or answers `PERMISSION_DENIED` itself, so a refused call
//! never reaches the service's code. What no policy names is refused: a new RPC is closed
//! until its policy opens it. The standard health service is open to every authenticated
//! caller (load balancers and probes hold a certificate too).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls_pki_types::{CertificateDer, DnsName, ServerName};
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::Role;

/// The gRPC service every caller may ask about health.
const HEALTH_SERVICE: &str = "grpc.health.v1.Health";

/// Who may call each method of one gRPC service.
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    /// The full service name, as in the request path (`sandboxsched.node.v1.Node`).
    pub service: &'static str,
    /// Methods (as named in the .proto) and the roles allowed to call them.
    pub rules: &'static [(&'static [&'static str], &'static [Role])],
}

impl Policy {
    /// The roles that may call `method` of this service.
    pub fn callers<'a>(&'a self, method: &'a str) -> impl Iterator<Item = Role> + 'a {
        self.rules
            .iter()
            .filter(move |(methods, _)| methods.contains(&method))
            .flat_map(|(_, roles)| roles.iter().copied())
    }

    /// Every method this policy names.
    pub fn methods(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.rules.iter().flat_map(|(methods, _)| methods.iter().copied())
    }

    /// Holds the policy to the service's `.proto` text: every RPC of the service is named
    /// (so none is closed by oversight) and every name is an RPC (so none is a typo that
    /// leaves the real method closed). For each service's unit tests.
    pub fn check_against_proto(&self, proto: &str) -> Result<(), String> {
        let short = self.service.rsplit('.').next().unwrap_or(self.service);
        let mut rpcs = Vec::new();
        let mut inside = false;
        for line in proto.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("service ") {
                inside = rest.trim_end_matches('{').trim() == short;
            } else if inside && line.starts_with('}') {
                inside = false;
            } else if let Some(rest) = line.strip_prefix("rpc ").filter(|_| inside) {
                rpcs.push(rest.split('(').next().unwrap_or(rest).trim().to_string());
            }
        }
        if rpcs.is_empty() {
            return Err(format!("no service {short} in the proto text"));
        }
        let named: Vec<&str> = self.methods().collect();
        let unnamed: Vec<&String> = rpcs.iter().filter(|rpc| !named.contains(&rpc.as_str())).collect();
        let unknown: Vec<&&str> = named
            .iter()
            .filter(|name| !rpcs.iter().any(|rpc| rpc == *name))
            .collect();
        if unnamed.is_empty() && unknown.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{}: RPCs no rule names: {unnamed:?}; names that are no RPC: {unknown:?}",
                self.service
            ))
        }
    }
}

/// The decision for one request.
#[derive(Debug)]
pub enum Decision {
    Allow,
    /// Refused; the message says who asked for what.
    Deny(tonic::Status),
}

/// The policies of one server, as a tower layer over its routes.
#[derive(Clone, Debug)]
pub struct Authorize {
    policies: Arc<[Policy]>,
}

impl Authorize {
    pub fn new(policies: impl Into<Arc<[Policy]>>) -> Self {
        Self {
            policies: policies.into(),
        }
    }

    /// The decision for a call of `path` (`/package.Service/Method`) by a caller that
    /// presented `certs` (leaf first), already verified against the cluster CA.
    ///
    /// Every call runs this, so the certificate is parsed once and checked only against the
    /// roles the method is open to; which role it names is worked out only to word a refusal.
    pub fn decide(&self, path: &str, certs: Option<&[CertificateDer<'static>]>) -> Decision {
        let cert = certs
            .and_then(|certs| certs.first())
            .and_then(|cert| webpki::EndEntityCert::try_from(cert).ok());
        let (service, method) = path.trim_start_matches('/').split_once('/').unwrap_or((path, ""));
        let permitted = cert.as_ref().is_some_and(|cert| {
            if service == HEALTH_SERVICE {
                return Role::ALL.into_iter().any(|role| names(cert, role));
            }
            self.policies
                .iter()
                .find(|policy| policy.service == service)
                .is_some_and(|policy| policy.callers(method).any(|role| names(cert, role)))
        });
        if permitted {
            return Decision::Allow;
        }
        match cert.and_then(|cert| Role::ALL.into_iter().find(|role| names(&cert, *role))) {
            None => Decision::Deny(tonic::Status::unauthenticated(
                "this server takes calls only from a certificate of the cluster naming a role",
            )),
            Some(caller) => Decision::Deny(tonic::Status::permission_denied(format!(
                "{caller} may not call {service}/{method}"
            ))),
        }
    }
}

/// The role a verified leaf certificate names, if any.
pub fn role_of(cert: &CertificateDer<'_>) -> Option<Role> {
    let cert = webpki::EndEntityCert::try_from(cert).ok()?;
    Role::ALL.into_iter().find(|role| names(&cert, *role))
}

/// Whether a verified leaf certificate (`certs`, leaf first) speaks for node `node_id`: it
/// names `<node_id>.node.sandboxsched.internal`. Placement asks this of every heartbeat, so a
/// node reports in its own name only.
pub fn speaks_for_node(certs: &[CertificateDer<'_>], node_id: &str) -> bool {
    let Some(cert) = certs
        .first()
        .and_then(|cert| webpki::EndEntityCert::try_from(cert).ok())
    else {
        return false;
    };
    crate::check_node_id(node_id).is_ok()
        && DnsName::try_from(crate::node_dns_name(node_id)).is_ok_and(|name| {
            cert.verify_is_valid_for_subject_name(&ServerName::DnsName(name))
                .is_ok()
        })
}

/// Whether `cert` is valid for `role`'s name.
fn names(cert: &webpki::EndEntityCert<'_>, role: Role) -> bool {
    DnsName::try_from(role.dns_name()).is_ok_and(|name| {
        cert.verify_is_valid_for_subject_name(&ServerName::DnsName(name))
            .is_ok()
    })
}

impl<S> tower::Layer<S> for Authorize {
    type Service = Authorized<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Authorized {
            inner,
            authorize: self.clone(),
        }
    }
}

/// A server's routes behind [`Authorize`].
#[derive(Clone, Debug)]
pub struct Authorized<S> {
    inner: S,
    authorize: Authorize,
}

type Answer<E> = Pin<Box<dyn Future<Output = Result<http::Response<tonic::body::Body>, E>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Authorized<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Answer<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let tls = request.extensions().get::<TlsConnectInfo<TcpConnectInfo>>();
        let certs = tls.and_then(|tls| tls.peer_certs());
        match self
            .authorize
            .decide(request.uri().path(), certs.as_deref().map(Vec::as_slice))
        {
            Decision::Allow => Box::pin(self.inner.call(request)),
            Decision::Deny(status) => {
                let peer = tls.and_then(|tls| tls.get_ref().remote_addr());
                tracing::warn!(
                    path = request.uri().path(),
                    ?peer,
                    reason = status.message(),
                    "call refused"
                );
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::issue::{issue_cluster, role_paths};

    const NODE: Policy = Policy {
        service: "sandboxsched.node.v1.Node",
        rules: &[
            (&["Create", "Kill"], &[Role::Gateway, Role::Balance]),
            (&["List"], &[Role::Gateway, Role::Balance, Role::Operator]),
        ],
    };

    fn cert_of(dir: &std::path::Path, role: Role) -> Vec<CertificateDer<'static>> {
        if role == Role::Node {
            return node_cert(dir, "node-1");
        }
        use rustls_pki_types::pem::PemObject;
        vec![CertificateDer::from_pem_file(role_paths(dir, role).0).unwrap()]
    }

    fn node_cert(dir: &std::path::Path, name: &str) -> Vec<CertificateDer<'static>> {
        use rustls_pki_types::pem::PemObject;
        crate::issue::issue_node(dir, name, &[name], false).unwrap();
        vec![CertificateDer::from_pem_file(crate::issue::node_paths(dir, name).0).unwrap()]
    }

    #[test]
    fn a_node_speaks_only_for_itself() {
        let temp = tempfile::tempdir().unwrap();
        issue_cluster(temp.path(), false).unwrap();
        let one = node_cert(temp.path(), "node-1");
        assert!(speaks_for_node(&one, "node-1"));
        for other in ["node-2", "node-1.node", "", "NODE-1", "*"] {
            assert!(!speaks_for_node(&one, other), "{other:?}");
        }
        // A role's certificate speaks for no node; a pair for several speaks for each.
        assert!(!speaks_for_node(&cert_of(temp.path(), Role::Gateway), "node-1"));
        crate::issue::issue_node(temp.path(), "fleet", &["a", "b"], false).unwrap();
        use rustls_pki_types::pem::PemObject;
        let fleet = vec![CertificateDer::from_pem_file(crate::issue::node_paths(temp.path(), "fleet").0).unwrap()];
        assert!(speaks_for_node(&fleet, "a") && speaks_for_node(&fleet, "b"));
        assert!(!speaks_for_node(&fleet, "c") && !speaks_for_node(&fleet, "fleet"));
        assert_eq!(role_of(&fleet[0]), Some(Role::Node));
    }

    #[test]
    fn each_role_may_call_only_what_its_policy_opens() {
        let temp = tempfile::tempdir().unwrap();
        issue_cluster(temp.path(), false).unwrap();
        let authorize = Authorize::new(vec![NODE]);
        let decide = |path: &str, role: Role| authorize.decide(path, Some(&cert_of(temp.path(), role)));

        for role in Role::ALL {
            assert_eq!(role_of(&cert_of(temp.path(), role)[0]), Some(role));
        }
        assert!(matches!(
            decide("/sandboxsched.node.v1.Node/Create", Role::Gateway),
            Decision::Allow
        ));
        assert!(matches!(
            decide("/sandboxsched.node.v1.Node/Create", Role::Balance),
            Decision::Allow
        ));
        assert!(matches!(
            decide("/sandboxsched.node.v1.Node/List", Role::Operator),
            Decision::Allow
        ));
        for (path, role) in [
            ("/sandboxsched.node.v1.Node/Create", Role::Operator),
            ("/sandboxsched.node.v1.Node/Create", Role::Node),
            ("/sandboxsched.node.v1.Node/Kill", Role::Ledger),
            // Unnamed methods and services are closed.
            ("/sandboxsched.node.v1.Node/Restore", Role::Balance),
            ("/sandboxsched.ledger.v1.Ledger/List", Role::Gateway),
            ("garbage", Role::Gateway),
        ] {
            let Decision::Deny(status) = decide(path, role) else {
                panic!("{role} was let through to {path}");
            };
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{path}");
            assert!(status.message().starts_with(role.name()), "{}", status.message());
        }
        // Health is for every member of the cluster.
        assert!(matches!(
            decide("/grpc.health.v1.Health/Check", Role::Node),
            Decision::Allow
        ));
    }

    #[test]
    fn a_caller_without_a_role_is_unauthenticated() {
        let authorize = Authorize::new(vec![NODE]);
        let Decision::Deny(status) = authorize.decide("/grpc.health.v1.Health/Check", None) else {
            panic!("no certificate was let through");
        };
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        let junk = vec![CertificateDer::from(vec![1, 2, 3])];
        assert!(matches!(
            authorize.decide("/sandboxsched.node.v1.Node/List", Some(&junk)),
            Decision::Deny(_)
        ));
    }
}
