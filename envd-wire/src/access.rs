//! Who may talk to a sandbox's envd.
//!
//! Every sandbox is issued an access token at create. A request for its envd is allowed when
//! it carries that token in `X-Access-Token`, or — for `/files` only — when its URL is signed
//! with it: `signature=v1_{base64(sha256("{path}:{read|write}:{user}:{token}[:{expiration}]"))}`
//! (unpadded standard base64), with `signature_expiration` a Unix time after which the URL no
//! longer works. That is how the SDK's `download_url`/`upload_url` hand out links that work
//! without headers. `/health` alone needs nothing.
//!
//! Both the gateway and the node apply this, so a request that reaches a node directly is
//! held to the same rule. Comparisons run in constant time over the secret's bytes, so an
//! attacker timing refusals learns nothing about how much of a guess was right.

use base64::Engine;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The route that needs no credentials.
pub const HEALTH_PATH: &str = "/health";
/// The route whose URLs may be signed instead of carrying the token.
pub const FILES_PATH: &str = "/files";

/// A new access token: 256 bits from the operating system's random source, as hex.
pub fn new_token() -> String {
    let a = uuid::Uuid::new_v4();
    let b = uuid::Uuid::new_v4();
    // Two version-4 UUIDs: 244 random bits; the fixed version and variant nibbles are
    // dropped so every character of the token is random.
    let mut token = String::with_capacity(60);
    for u in [a, b] {
        let hex = u.simple().to_string();
        token.push_str(&hex[..12]);
        token.push_str(&hex[13..16]);
        token.push_str(&hex[17..]);
    }
    token
}

/// What a signed file URL lets its holder do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileOperation {
    Read,
    Write,
}

impl FileOperation {
    /// `GET`/`HEAD` read; every other method writes.
    pub fn of_method(method: &str) -> Self {
        if method.eq_ignore_ascii_case("GET") || method.eq_ignore_ascii_case("HEAD") {
            Self::Read
        } else {
            Self::Write
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
        }
    }
}

/// The signature of a file URL, as the SDK computes it.
pub fn file_signature(
    path: &str,
    operation: FileOperation,
    user: &str,
    token: &str,
    expiration: Option<u64>,
) -> String {
    let mut raw = format!("{path}:{}:{user}:{token}", operation.as_str());
    if let Some(expiration) = expiration {
        raw.push_str(&format!(":{expiration}"));
    }
    let digest = Sha256::digest(raw.as_bytes());
    format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest))
}

/// Why a request was refused. Every variant answers 401; the text says what to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Denied {
    /// The sandbox has no access token (made before tokens were issued): nobody gets in.
    NoTokenIssued,
    /// Neither a token nor (on `/files`) a signature.
    Missing,
    WrongToken,
    BadSignature,
    /// A signed URL past its `signature_expiration`.
    Expired,
}

impl Denied {
    pub fn message(self) -> &'static str {
        match self {
            Self::NoTokenIssued => "this sandbox has no envd access token; recreate it",
            Self::Missing => "the sandbox's access token is required in X-Access-Token",
            Self::WrongToken => "wrong X-Access-Token for this sandbox",
            Self::BadSignature => "invalid signature for this file URL",
            Self::Expired => "this signed file URL has expired",
        }
    }
}

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for Denied {}

/// The parts of an envd request that decide whether it may pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct Presented<'a> {
    /// The URL path (`/files`, `/process.Process/Start`, …).
    pub path: &'a str,
    pub method: &'a str,
    /// The raw query string, without `?`.
    pub query: Option<&'a str>,
    /// The `X-Access-Token` header's bytes.
    pub token: Option<&'a [u8]>,
}

/// Whether `presented` may reach the envd of a sandbox whose token is `expected`, at Unix
/// time `now`. `/health` always may.
pub fn authorize(expected: Option<&str>, presented: &Presented<'_>, now: u64) -> Result<(), Denied> {
    if presented.path == HEALTH_PATH {
        return Ok(());
    }
    let expected = expected.filter(|t| !t.is_empty()).ok_or(Denied::NoTokenIssued)?;
    if let Some(given) = presented.token {
        return if bool::from(given.ct_eq(expected.as_bytes())) {
            Ok(())
        } else {
            Err(Denied::WrongToken)
        };
    }
    if presented.path != FILES_PATH {
        return Err(Denied::Missing);
    }
    let mut signature = None;
    let mut expiration = None;
    let mut file = String::new();
    let mut user = String::new();
    for (key, value) in form_urlencoded::parse(presented.query.unwrap_or("").as_bytes()) {
        match &*key {
            "signature" => signature = Some(value.into_owned()),
            "signature_expiration" => expiration = Some(value.into_owned()),
            "path" => file = value.into_owned(),
            "username" => user = value.into_owned(),
            _ => {}
        }
    }
    let signature = signature.ok_or(Denied::Missing)?;
    let expiration = match expiration {
        None => None,
        Some(text) => Some(text.parse::<u64>().map_err(|_| Denied::BadSignature)?),
    };
    let operation = FileOperation::of_method(presented.method);
    let want = file_signature(&file, operation, &user, expected, expiration);
    if !bool::from(want.as_bytes().ct_eq(signature.as_bytes())) {
        return Err(Denied::BadSignature);
    }
    match expiration {
        Some(at) if now > at => Err(Denied::Expired),
        _ => Ok(()),
    }
}

/// Whether `presented` is the sandbox's token `expected` (compared in constant time); never
/// for a sandbox without one.
pub fn shows_token(expected: Option<&str>, presented: Option<&[u8]>) -> bool {
    match (expected.filter(|t| !t.is_empty()), presented) {
        (Some(expected), Some(given)) => same_secret(given, expected.as_bytes()),
        _ => false,
    }
}

/// Whether two secrets are equal, compared in constant time (no early exit an attacker could
/// time).
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    bool::from(a.ct_eq(b))
}

/// Whether a request may reach a sandbox's port (any but envd's): always, unless the sandbox
/// was created with `network.allowPublicTraffic: false`, which gave it a traffic token that
/// must then come in `e2b-traffic-access-token` (compared in constant time).
pub fn authorize_traffic(expected: Option<&str>, presented: Option<&[u8]>) -> Result<(), &'static str> {
    let Some(expected) = expected.filter(|t| !t.is_empty()) else {
        return Ok(());
    };
    match presented {
        None => Err("this sandbox's ports are private: send its traffic access token in e2b-traffic-access-token"),
        Some(given) if same_secret(given, expected.as_bytes()) => Ok(()),
        Some(_) => Err("wrong e2b-traffic-access-token for this sandbox"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_sandboxs_own_token_shows_it() {
        assert!(shows_token(Some("t0k"), Some(b"t0k")));
        assert!(!shows_token(Some("t0k"), Some(b"t0K")));
        assert!(!shows_token(Some("t0k"), None));
        assert!(!shows_token(None, Some(b"")));
        assert!(!shows_token(Some(""), Some(b"")));
    }

    #[test]
    fn ports_are_public_unless_the_sandbox_has_a_traffic_token() {
        assert_eq!(authorize_traffic(None, None), Ok(()));
        assert_eq!(authorize_traffic(Some(""), None), Ok(()));
        assert!(authorize_traffic(Some("t0k"), None).is_err());
        assert!(authorize_traffic(Some("t0k"), Some(b"t0K")).is_err());
        assert_eq!(authorize_traffic(Some("t0k"), Some(b"t0k")), Ok(()));
    }

    const TOKEN: &str = "0123456789abcdef";

    fn call<'a>(path: &'a str, method: &'a str, query: Option<&'a str>, token: Option<&'a str>) -> Presented<'a> {
        Presented {
            path,
            method,
            query,
            token: token.map(str::as_bytes),
        }
    }

    #[test]
    fn tokens_are_long_random_and_distinct() {
        let a = new_token();
        assert_eq!(a.len(), 60);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, new_token());
    }

    #[test]
    fn the_token_opens_every_route_and_nothing_else_does() {
        for path in [
            "/process.Process/Start",
            "/filesystem.Filesystem/ListDir",
            "/files",
            "/envs",
        ] {
            assert_eq!(
                authorize(Some(TOKEN), &call(path, "POST", None, Some(TOKEN)), 0),
                Ok(())
            );
            assert_eq!(
                authorize(Some(TOKEN), &call(path, "POST", None, None), 0),
                Err(Denied::Missing)
            );
            assert_eq!(
                authorize(Some(TOKEN), &call(path, "POST", None, Some("0123456789abcdeF")), 0),
                Err(Denied::WrongToken)
            );
            assert_eq!(
                authorize(Some(TOKEN), &call(path, "POST", None, Some("")), 0),
                Err(Denied::WrongToken)
            );
            assert_eq!(
                authorize(Some(TOKEN), &call(path, "POST", None, Some("0123456789abcdef0")), 0),
                Err(Denied::WrongToken)
            );
            assert_eq!(
                authorize(None, &call(path, "POST", None, Some(TOKEN)), 0),
                Err(Denied::NoTokenIssued)
            );
            assert_eq!(
                authorize(Some(""), &call(path, "POST", None, Some("")), 0),
                Err(Denied::NoTokenIssued)
            );
        }
        assert_eq!(authorize(None, &call("/health", "GET", None, None), 0), Ok(()));
    }

    /// The value the E2B Python SDK 2.63 computes for
    /// `get_signature("/home/user/a b.txt", "read", "user", "0123456789abcdef")`
    /// (its `hashlib.sha256` + `base64.b64encode(...).rstrip(b"=")`), and for a write by the
    /// default user that expires at 1700000000.
    #[test]
    fn signatures_match_the_sdks() {
        assert_eq!(
            file_signature("/home/user/a b.txt", FileOperation::Read, "user", TOKEN, None),
            "v1_cfssELnRyM6D07jPEtLJXK5Qn1mF3cidZRj5a7OymgA"
        );
        assert_eq!(
            file_signature(
                "/home/user/a b.txt",
                FileOperation::Write,
                "",
                TOKEN,
                Some(1_700_000_000)
            ),
            "v1_GonPQaeA0O/fTG2DQAwvHk/J4EDln4SOiTCuljbovBk"
        );
    }

    fn signed_query(path: &str, op: FileOperation, user: &str, expiration: Option<u64>) -> String {
        let sig = file_signature(path, op, user, TOKEN, expiration);
        let mut q = form_urlencoded::Serializer::new(String::new());
        q.append_pair("path", path);
        if !user.is_empty() {
            q.append_pair("username", user);
        }
        q.append_pair("signature", &sig);
        if let Some(e) = expiration {
            q.append_pair("signature_expiration", &e.to_string());
        }
        q.finish()
    }

    #[test]
    fn a_signed_file_url_opens_its_file_for_its_operation_until_it_expires() {
        let read = signed_query("/tmp/x", FileOperation::Read, "root", Some(100));
        assert_eq!(
            authorize(Some(TOKEN), &call("/files", "GET", Some(&read), None), 100),
            Ok(())
        );
        assert_eq!(
            authorize(Some(TOKEN), &call("/files", "GET", Some(&read), None), 101),
            Err(Denied::Expired)
        );
        // Not for writing, not for another route, not for another file or user.
        assert_eq!(
            authorize(Some(TOKEN), &call("/files", "POST", Some(&read), None), 0),
            Err(Denied::BadSignature)
        );
        assert_eq!(
            authorize(Some(TOKEN), &call("/envs", "GET", Some(&read), None), 0),
            Err(Denied::Missing)
        );
        let other_file = read.replace("%2Ftmp%2Fx", "%2Ftmp%2Fy");
        assert_eq!(
            authorize(Some(TOKEN), &call("/files", "GET", Some(&other_file), None), 0),
            Err(Denied::BadSignature)
        );
        let other_user = read.replace("username=root", "username=user");
        assert_eq!(
            authorize(Some(TOKEN), &call("/files", "GET", Some(&other_user), None), 0),
            Err(Denied::BadSignature)
        );
        // A later expiration than the one signed is a different signature.
        let extended = read.replace("signature_expiration=100", "signature_expiration=999");
        assert_eq!(
            authorize(Some(TOKEN), &call("/files", "GET", Some(&extended), None), 0),
            Err(Denied::BadSignature)
        );
        let write = signed_query("/tmp/x", FileOperation::Write, "", None);
        assert_eq!(
            authorize(Some(TOKEN), &call("/files", "POST", Some(&write), None), u64::MAX),
            Ok(())
        );
        // A wrong header is not rescued by a good signature.
        assert_eq!(
            authorize(Some(TOKEN), &call("/files", "POST", Some(&write), Some("nope")), 0),
            Err(Denied::WrongToken)
        );
        assert_eq!(
            authorize(
                Some(TOKEN),
                &call(
                    "/files",
                    "GET",
                    Some("path=/tmp/x&signature=v1_x&signature_expiration=soon"),
                    None
                ),
                0
            ),
            Err(Denied::BadSignature)
        );
    }
}
