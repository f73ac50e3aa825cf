//! A sandbox's secrets as the gateway keeps them: its access tokens, derived from the seal its
//! manifest keeps and the cluster's token key (see `envd_wire::sealed`), never read from the
//! ledger in clear; and what else a tenant gave it in confidence (the environment variables of
//! a create, a hibernated sandbox's description with its tokens and its archive's checksum),
//! sealed with AES-256-GCM under a key derived from the same token key before it is written
//! to the ledger or the blob store. A dump of either holds no tenant's secret, and a blob
//! store writer without the key cannot swap a hibernated sandbox's archive for one of its own
//! (the checksum the wake verifies is inside the seal).
//!
//! A sealed value is `aead-v1:` and the URL-safe base64 of nonce and ciphertext. It is bound
//! to what it is for and to its sandbox (both are the cipher's associated data), so a seal
//! copied into another sandbox's manifest opens nothing.

use std::collections::BTreeMap;
use std::sync::Arc;

use aws_lc_rs::aead::{Aad, RandomizedNonceKey, AES_256_GCM, NONCE_LEN};
use base64::Engine as _;
use common::docs::SandboxDoc;
use envd_wire::sealed::{self, Purpose, TokenKey};

/// The prefix of a value sealed at rest.
const AEAD_PREFIX: &str = "aead-v1:";
/// The label of the key sealing at rest is derived with.
const AT_REST_KEY: &str = "sandboxsched at rest v1";

const BASE64: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// What a sealed value holds: each opens only as what it was sealed as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Secret {
    /// The environment variables of a create (a manifest's `sealed_env`).
    EnvVars,
    /// A hibernated sandbox's description and its archive's checksum.
    Hibernation,
}

impl Secret {
    fn label(self) -> &'static str {
        match self {
            Secret::EnvVars => "env",
            Secret::Hibernation => "hibernation",
        }
    }
}

/// Why a sealed value did not open.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("not a sealed value")]
    NotSealed,
    #[error("the seal does not open with this cluster's token key, or was not made for this sandbox")]
    Refused,
}

/// The gateway's token key, shared by everything in it that needs a sandbox's token.
#[derive(Clone)]
pub struct Tokens {
    key: Arc<TokenKey>,
    at_rest: Arc<RandomizedNonceKey>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokens(…)")
    }
}

impl Tokens {
    pub fn new(key: TokenKey) -> Self {
        let at_rest =
            RandomizedNonceKey::new(&AES_256_GCM, &key.derive(AT_REST_KEY)).expect("AES-256-GCM takes a 32-byte key");
        Self {
            key: Arc::new(key),
            at_rest: Arc::new(at_rest),
        }
    }

    /// `plain` sealed as `what` for sandbox `sandbox_id` (a fresh random nonce each time).
    pub fn seal(&self, what: Secret, sandbox_id: &str, plain: &[u8]) -> String {
        let mut data = plain.to_vec();
        let nonce = self
            .at_rest
            .seal_in_place_append_tag(Aad::from(associated(what, sandbox_id)), &mut data)
            .expect("AES-GCM seals any message of this size");
        let mut out = nonce.as_ref().to_vec();
        out.extend_from_slice(&data);
        format!("{AEAD_PREFIX}{}", BASE64.encode(out))
    }

    /// What [`Tokens::seal`] sealed as `what` for `sandbox_id`.
    pub fn open(&self, what: Secret, sandbox_id: &str, sealed: &str) -> Result<Vec<u8>, SealError> {
        let bytes = sealed
            .strip_prefix(AEAD_PREFIX)
            .and_then(|text| BASE64.decode(text).ok())
            .filter(|bytes| bytes.len() >= NONCE_LEN)
            .ok_or(SealError::NotSealed)?;
        let (nonce, cipher) = bytes.split_at(NONCE_LEN);
        let nonce = aws_lc_rs::aead::Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError::NotSealed)?;
        let mut data = cipher.to_vec();
        let plain = self
            .at_rest
            .open_in_place(nonce, Aad::from(associated(what, sandbox_id)), &mut data)
            .map_err(|_| SealError::Refused)?;
        Ok(plain.to_vec())
    }

    /// What a new manifest keeps of a create's environment variables: none in clear, and a
    /// seal of them when there are any.
    pub fn seal_env(&self, sandbox_id: &str, env: &BTreeMap<String, String>) -> Option<String> {
        if env.is_empty() {
            return None;
        }
        let json = serde_json::to_vec(env).unwrap_or_default();
        Some(self.seal(Secret::EnvVars, sandbox_id, &json))
    }

    /// A manifest's environment variables: opened from its seal, or as kept in clear by a
    /// gateway from before sealing.
    pub fn env(&self, doc: &SandboxDoc) -> Result<BTreeMap<String, String>, SealError> {
        let Some(sealed) = doc.sealed_env.as_deref() else {
            return Ok(doc.env_vars.clone());
        };
        let json = self.open(Secret::EnvVars, &doc.sandbox_id, sealed)?;
        serde_json::from_slice(&json).map_err(|_| SealError::Refused)
    }

    /// What a new manifest keeps for a token: a fresh seal.
    pub fn token_seal(&self) -> String {
        sealed::new_seal()
    }

    /// The sandbox's envd access token (`X-Access-Token`), if it was issued one.
    pub fn envd(&self, doc: &SandboxDoc) -> Option<String> {
        let seal = doc.envd_access_token.as_deref()?;
        Some(self.key.open(Purpose::Envd, &doc.sandbox_id, seal))
    }

    /// The token its ports require (`allowPublicTraffic: false`), if any.
    pub fn traffic(&self, doc: &SandboxDoc) -> Option<String> {
        let seal = doc.traffic_access_token.as_deref()?;
        Some(self.key.open(Purpose::Traffic, &doc.sandbox_id, seal))
    }
}

/// The associated data of a seal: what it holds and whose it is.
fn associated(what: Secret, sandbox_id: &str) -> Vec<u8> {
    [what.label().as_bytes(), b"\0", sandbox_id.as_bytes()].concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seal_opens_only_with_its_key_as_what_it_holds_for_its_sandbox() {
        let tokens = Tokens::new(TokenKey::random());
        let sealed = tokens.seal(Secret::EnvVars, "sbx-a", b"OPENAI_API_KEY=sk-1");
        assert!(sealed.starts_with(AEAD_PREFIX));
        assert!(!sealed.contains("sk-1"));
        assert_eq!(
            tokens.open(Secret::EnvVars, "sbx-a", &sealed).unwrap(),
            b"OPENAI_API_KEY=sk-1"
        );
        // A fresh nonce each time.
        assert_ne!(
            tokens.seal(Secret::EnvVars, "sbx-a", b"x"),
            tokens.seal(Secret::EnvVars, "sbx-a", b"x")
        );
        for (what, id) in [(Secret::EnvVars, "sbx-b"), (Secret::Hibernation, "sbx-a")] {
            assert_eq!(tokens.open(what, id, &sealed), Err(SealError::Refused));
        }
        let other = Tokens::new(TokenKey::random());
        assert_eq!(other.open(Secret::EnvVars, "sbx-a", &sealed), Err(SealError::Refused));
        // One flipped bit anywhere: refused.
        let mut bytes = BASE64.decode(&sealed[AEAD_PREFIX.len()..]).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        let flipped = format!("{AEAD_PREFIX}{}", BASE64.encode(bytes));
        assert_eq!(tokens.open(Secret::EnvVars, "sbx-a", &flipped), Err(SealError::Refused));
        for junk in ["", "aead-v1:", "aead-v1:!!", "sk-1"] {
            assert_eq!(
                tokens.open(Secret::EnvVars, "sbx-a", junk),
                Err(SealError::NotSealed),
                "{junk}"
            );
        }
    }

    #[test]
    fn env_vars_are_sealed_and_old_manifests_keep_theirs() {
        let tokens = Tokens::new(TokenKey::random());
        let env: BTreeMap<String, String> = [("TOKEN".to_string(), "hunter2".to_string())].into();
        let doc = SandboxDoc {
            sandbox_id: "sbx-a".into(),
            sealed_env: tokens.seal_env("sbx-a", &env),
            ..Default::default()
        };
        assert!(!serde_json::to_string(&doc).unwrap().contains("hunter2"));
        assert_eq!(tokens.env(&doc).unwrap(), env);
        assert_eq!(tokens.seal_env("sbx-a", &BTreeMap::new()), None);
        let old = SandboxDoc {
            env_vars: env.clone(),
            ..Default::default()
        };
        assert_eq!(tokens.env(&old).unwrap(), env);
    }
}
