//! A cluster's certificates: one CA, and one certificate per [`Role`] signed by it.
//!
//! Everything goes into one directory that only its owner may enter (0700), each file 0600:
//!
//! ```text
//! ca.pem    ca.key          the cluster CA (the key only signs; keep it off service hosts)
//! ledger.pem ledger.key     one pair per role: placement, balance, gateway, operator
//! node-ID.pem node-ID.key   one pair per node ([`issue_node`]): the node role and its ID
//! tokens.key                the gateways' key for sandboxes' access tokens (gateways only)
//! ```
//!
//! Nodes hold no shared pair: each node's certificate names its own ID beside the node role
//! ([`crate::node_dns_name`]), so a node's stolen key speaks for that node alone.
//!
//! A host of a multi-host cluster needs `ca.pem` and its own role's pair only. Issuing is
//! idempotent: an existing CA is kept and only missing roles are issued from it, so `up` can
//! call it on every start. Renewal reissues every role's pair from the same CA (clients and
//! servers trust the CA, not a pair, so services pick the new pairs up one restart at a time).

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

use crate::{Role, TlsError};

/// How long the CA is valid.
const CA_VALIDITY: Duration = Duration::days(10 * 365);
/// How long a role's certificate is valid; `sandboxsched-ctl certs --renew` reissues them.
const LEAF_VALIDITY: Duration = Duration::days(2 * 365);
/// Clocks of hosts differ: a certificate is valid from a little before it was made.
const CLOCK_SKEW: Duration = Duration::hours(1);

const CA_NAME: &str = "sandboxsched cluster CA";

/// The CA certificate's file in a certificate directory.
pub fn ca_cert_path(dir: &Path) -> PathBuf {
    dir.join("ca.pem")
}

/// A role's certificate and key files in a certificate directory.
pub fn role_paths(dir: &Path, role: Role) -> (PathBuf, PathBuf) {
    (dir.join(format!("{role}.pem")), dir.join(format!("{role}.key")))
}

/// A node's certificate and key files in a certificate directory (`name` is its node ID, or
/// the name of a pair that speaks for several simulated nodes).
pub fn node_paths(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("node-{name}.pem")),
        dir.join(format!("node-{name}.key")),
    )
}

/// The gateways' token key in a certificate directory: 64 hex digits from which every
/// sandbox's access tokens are derived (the ledger keeps only seals).
pub fn token_key_path(dir: &Path) -> PathBuf {
    dir.join("tokens.key")
}

/// Reads the token key's text, refusing a file other users could read.
pub fn read_token_key(dir: &Path) -> Result<String, TlsError> {
    read_secret(&token_key_path(dir))
}

/// What [`issue_cluster`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Issued {
    /// A new CA was made (every client and server must be given the new `ca.pem`).
    pub new_ca: bool,
    /// The roles whose certificates were written.
    pub roles: Vec<Role>,
}

/// Makes `dir` (0700) hold a cluster CA and a certificate for every role: keeps what exists,
/// issues what is missing, and with `renew` reissues every role's certificate.
pub fn issue_cluster(dir: &Path, renew: bool) -> Result<Issued, TlsError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TlsError::Io { path, source }
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io(dir))?;
    // An existing directory keeps the mode it had: close it, whoever made it.
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io(dir))?;

    let ca_key_path = dir.join("ca.key");
    let mut issued = Issued::default();
    let ca_key = if ca_key_path.exists() {
        KeyPair::from_pem(&read_secret(&ca_key_path)?)?
    } else {
        let key = KeyPair::generate()?;
        let cert = ca_params()?.self_signed(&key)?;
        write_secret(&ca_key_path, key.serialize_pem().as_bytes())?;
        write_secret(&ca_cert_path(dir), cert.pem().as_bytes())?;
        issued.new_ca = true;
        key
    };
    let token_key = token_key_path(dir);
    if !token_key.exists() {
        // 64 hex digits from the operating system's random source: two v4 UUIDs, 244 random
        // bits (each has six fixed ones).
        let key: String = [uuid::Uuid::new_v4(), uuid::Uuid::new_v4()]
            .iter()
            .map(|u| u.simple().to_string())
            .collect();
        write_secret(&token_key, key.as_bytes())?;
    }
    // The issuer is rebuilt from the same name and key each time: the certificates it signs
    // name the CA and its key identifier exactly as the saved CA certificate does.
    let issuer = Issuer::new(ca_params()?, ca_key);
    for role in Role::SHARED {
        let (cert_path, key_path) = role_paths(dir, role);
        if !renew && !issued.new_ca && cert_path.exists() && key_path.exists() {
            continue;
        }
        write_pair(
            &issuer,
            leaf_params(&[role.dns_name().to_string()])?,
            &cert_path,
            &key_path,
        )?;
        issued.roles.push(role);
    }
    Ok(issued)
}

/// Issues the pair `node-NAME` from the CA in `dir` (made by [`issue_cluster`] first): a
/// node's certificate, naming the node role and each of `node_ids`. A node's own pair names
/// its one ID (`name` is that ID); a simulator that heartbeats for many nodes gets one pair
/// naming them all. Keeps an existing pair unless `renew`; says whether it wrote one.
pub fn issue_node(dir: &Path, name: &str, node_ids: &[&str], renew: bool) -> Result<bool, TlsError> {
    for id in std::iter::once(&name).chain(node_ids) {
        crate::check_node_id(id).map_err(TlsError::NodeId)?;
    }
    let (cert_path, key_path) = node_paths(dir, name);
    if !renew && cert_path.exists() && key_path.exists() {
        return Ok(false);
    }
    let ca_key = KeyPair::from_pem(&read_secret(&dir.join("ca.key"))?)?;
    let issuer = Issuer::new(ca_params()?, ca_key);
    let names = std::iter::once(Role::Node.dns_name().to_string())
        .chain(node_ids.iter().map(|id| crate::node_dns_name(id)))
        .collect::<Vec<_>>();
    write_pair(&issuer, leaf_params(&names)?, &cert_path, &key_path)?;
    Ok(true)
}

/// A fresh key, a certificate for it signed by `issuer`, both written 0600.
fn write_pair(
    issuer: &Issuer<'_, KeyPair>,
    params: CertificateParams,
    cert_path: &Path,
    key_path: &Path,
) -> Result<(), TlsError> {
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, issuer)?;
    write_secret(key_path, key.serialize_pem().as_bytes())?;
    write_secret(cert_path, cert.pem().as_bytes())
}

fn ca_params() -> Result<CertificateParams, TlsError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - CLOCK_SKEW;
    params.not_after = now + CA_VALIDITY;
    Ok(params)
}

/// A service's certificate, valid for `names` (the first is also its common name).
fn leaf_params(names: &[String]) -> Result<CertificateParams, TlsError> {
    let mut params = CertificateParams::new(names.to_vec())?;
    params
        .distinguished_name
        .push(DnType::CommonName, names.first().map_or("", String::as_str));
    // Every service is both: it serves its own RPCs and calls others'.
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    let now = OffsetDateTime::now_utc();
    params.not_before = now - CLOCK_SKEW;
    params.not_after = now + LEAF_VALIDITY;
    Ok(params)
}

/// Writes `bytes` to `path` as a 0600 file, replacing it whole (a reader never sees half a key).
fn write_secret(path: &Path, bytes: &[u8]) -> Result<(), TlsError> {
    let io = |source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let temp = path.with_extension("tmp");
    let _ = fs::remove_file(&temp);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temp)
        .map_err(io)?;
    file.write_all(bytes).map_err(io)?;
    file.sync_all().map_err(io)?;
    fs::rename(&temp, path).map_err(io)
}

/// Reads a secret (a private key, the token key), refusing a file other users could read too.
pub fn read_secret(path: &Path) -> Result<String, TlsError> {
    let io = |source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mode = fs::metadata(path).map_err(io)?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(TlsError::KeyExposed {
            path: path.to_path_buf(),
            mode,
        });
    }
    fs::read_to_string(path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_is_issued_closed_and_kept() {
        let temp = tempfile::tempdir().unwrap();
        let dir = temp.path().join("certs");
        let first = issue_cluster(&dir, false).unwrap();
        assert!(first.new_ca);
        assert_eq!(first.roles, Role::SHARED.to_vec());
        assert!(!role_paths(&dir, Role::Node).0.exists(), "nodes share no pair");
        assert!(issue_node(&dir, "node-1", &["node-1"], false).unwrap());
        assert_eq!(fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        for entry in fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let mode = entry.metadata().unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", entry.path().display());
        }

        // Again: nothing to do.
        assert_eq!(issue_cluster(&dir, false).unwrap(), Issued::default());

        // A lost role is issued again from the same CA; the CA stays.
        let ca = fs::read(ca_cert_path(&dir)).unwrap();
        assert!(!issue_node(&dir, "node-1", &["node-1"], false).unwrap());
        fs::remove_file(role_paths(&dir, Role::Balance).0).unwrap();
        let again = issue_cluster(&dir, false).unwrap();
        assert_eq!(again.roles, vec![Role::Balance]);
        assert!(!again.new_ca);
        assert_eq!(fs::read(ca_cert_path(&dir)).unwrap(), ca);

        // Renewal reissues every role.
        assert_eq!(issue_cluster(&dir, true).unwrap().roles, Role::SHARED.to_vec());
        assert!(issue_node(&dir, "node-1", &["node-1"], true).unwrap());
    }

    #[test]
    fn a_node_is_issued_only_from_an_existing_ca_and_only_for_node_ids() {
        let temp = tempfile::tempdir().unwrap();
        assert!(matches!(
            issue_node(temp.path(), "node-1", &["node-1"], false),
            Err(TlsError::Io { .. })
        ));
        issue_cluster(temp.path(), false).unwrap();
        let err = issue_node(temp.path(), "evil", &["x.gateway"], false).unwrap_err();
        assert!(matches!(err, TlsError::NodeId(_)), "{err}");
        assert!(!node_paths(temp.path(), "evil").0.exists());
    }

    #[test]
    fn a_key_others_can_read_is_refused() {
        let temp = tempfile::tempdir().unwrap();
        issue_cluster(temp.path(), false).unwrap();
        let (_, key) = role_paths(temp.path(), Role::Gateway);
        fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
        let err = read_secret(&key).unwrap_err();
        assert!(matches!(err, TlsError::KeyExposed { mode: 0o644, .. }), "{err}");
    }
}
