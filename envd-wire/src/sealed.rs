//! Sandbox access tokens that are never stored: the ledger keeps a seal, the gateway derives.
//!
//! A sandbox's manifest lives in the ledger, and anything that reads the ledger (a backup, a
//! replica, a dump taken by whoever got at the database) would otherwise read every tenant's
//! envd token. So the manifest holds only a *seal*: `sealed-v1:` and a random nonce, made at
//! create. The token itself is `HMAC-SHA256(key, "envd\0" sandbox ID "\0" nonce)` as hex,
//! where the key is the cluster's token key that only gateways hold (beside the cluster's
//! certificates, never in the ledger). A dump therefore holds nonces that open nothing,
//! while every gateway derives the same token for the same seal, so `connect` still hands
//! the team its token and the proxy still checks it.
//!
//! A value without the prefix is a token stored in clear by an older gateway: it is used as
//! it is, so sandboxes made before sealing keep working until they end.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The prefix of a seal (as opposed to a token in clear).
pub const SEAL_PREFIX: &str = "sealed-v1:";

/// What a token opens: the envd API, or the sandbox's ports (E2B's traffic token). A seal of
/// one never derives the token of the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    Envd,
    Traffic,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::Envd => b"envd",
            Purpose::Traffic => b"traffic",
        }
    }
}

/// Why a token key was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("a token key is 64 hexadecimal digits (256 bits); got {0} characters")]
    Length(usize),
    #[error("a token key is hexadecimal digits only")]
    NotHex,
}

/// The cluster's token key: 256 bits, held by gateways only.
#[derive(Clone)]
pub struct TokenKey([u8; 32]);

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(…)")
    }
}

impl TokenKey {
    /// A new random key (the operating system's random source, through v4 UUIDs).
    pub fn random() -> Self {
        let mut key = [0u8; 32];
        key[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        key[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        Self(key)
    }

    /// A key written as 64 hex digits (surrounding white space ignored).
    pub fn from_hex(text: &str) -> Result<Self, KeyError> {
        let text = text.trim();
        if text.len() != 64 {
            return Err(KeyError::Length(text.len()));
        }
        let mut key = [0u8; 32];
        for (i, byte) in key.iter_mut().enumerate() {
            *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2).ok_or(KeyError::NotHex)?, 16)
                .map_err(|_| KeyError::NotHex)?;
        }
        Ok(Self(key))
    }

    /// The key as 64 hex digits, for its file.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// A key for another use, derived from this one (`HMAC(key, "derive\0" label)`): the
    /// gateways' key for what they keep sealed at rest is never the key tokens come from.
    pub fn derive(&self, label: &str) -> [u8; 32] {
        let mut derived = [0u8; 32];
        if let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.0) {
            for part in [b"derive".as_slice(), b"\0", label.as_bytes()] {
                mac.update(part);
            }
            derived.copy_from_slice(&mac.finalize().into_bytes());
        }
        derived
    }

    /// The token `seal` stands for, for sandbox `sandbox_id`; a value that is no seal is a
    /// token kept in clear and comes back as it is.
    pub fn open(&self, purpose: Purpose, sandbox_id: &str, seal: &str) -> String {
        let Some(nonce) = seal.strip_prefix(SEAL_PREFIX) else {
            return seal.to_string();
        };
        // HMAC takes a key of any length, so this never fails; if it did, the empty token
        // that results opens nothing (an empty expected token refuses every request).
        Hmac::<Sha256>::new_from_slice(&self.0)
            .map(|mut mac| {
                for part in [purpose.label(), b"\0", sandbox_id.as_bytes(), b"\0", nonce.as_bytes()] {
                    mac.update(part);
                }
                hex(&mac.finalize().into_bytes())
            })
            .unwrap_or_default()
    }
}

/// A new seal: 244 random bits, as [`crate::access::new_token`] makes them.
pub fn new_seal() -> String {
    format!("{SEAL_PREFIX}{}", crate::access::new_token())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seal_opens_to_one_token_per_key_sandbox_and_purpose() {
        let key = TokenKey::random();
        let seal = new_seal();
        let token = key.open(Purpose::Envd, "sbx-a", &seal);
        assert_eq!(token.len(), 64);
        assert!(!token.contains(&seal[SEAL_PREFIX.len()..]), "the token shows its nonce");
        // Every gateway with the key derives the same token.
        let again = TokenKey::from_hex(&key.to_hex()).unwrap();
        assert_eq!(again.open(Purpose::Envd, "sbx-a", &seal), token);
        // Another key, sandbox, purpose or seal: another token.
        assert_ne!(TokenKey::random().open(Purpose::Envd, "sbx-a", &seal), token);
        assert_ne!(key.open(Purpose::Envd, "sbx-b", &seal), token);
        assert_ne!(key.open(Purpose::Traffic, "sbx-a", &seal), token);
        assert_ne!(key.open(Purpose::Envd, "sbx-a", &new_seal()), token);
    }

    #[test]
    fn a_derived_key_is_one_per_label_and_not_the_key() {
        let key = TokenKey::random();
        assert_eq!(key.derive("a"), TokenKey::from_hex(&key.to_hex()).unwrap().derive("a"));
        assert_ne!(key.derive("a"), key.derive("b"));
        assert_ne!(key.derive("a"), key.0);
        assert_ne!(key.derive("a"), TokenKey::random().derive("a"));
    }

    #[test]
    fn a_token_kept_in_clear_is_used_as_it_is() {
        let key = TokenKey::random();
        assert_eq!(key.open(Purpose::Envd, "old", "abc123"), "abc123");
    }

    #[test]
    fn a_bad_key_is_refused() {
        assert_eq!(TokenKey::from_hex("abc").unwrap_err(), KeyError::Length(3));
        assert_eq!(TokenKey::from_hex(&"zz".repeat(32)).unwrap_err(), KeyError::NotHex);
        let key = TokenKey::random();
        assert_eq!(TokenKey::from_hex(&format!(" {}\n", key.to_hex())).unwrap().0, key.0);
    }
}
