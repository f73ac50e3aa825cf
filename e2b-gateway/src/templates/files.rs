//! The archives of COPY steps: the SDK hashes a step's files, asks whether that hash is
//! stored (`GET /templates/{id}/files/{hash}`), and uploads a tar of them to the URL it gets
//! back. They are kept in the cluster's blob store under `files/<team>/<hash>`, where the
//! builder node fetches them.
//!
//! Per team, because the hash is the client's claim about the content, not something the
//! gateway can check against the tar: shared across teams, one team could upload anything
//! under a hash another team's build will use. The upload URL carries a token derived from
//! the caller's API key and the time it expires, so it needs no header (the SDK sends none),
//! no one without that key can write there, and a URL seen later (in a proxy's log, on a
//! cleartext hop) opens nothing. An archive once stored is never replaced: the SDK uploads
//! only what is not stored, so a second upload under the same hash is a race between two
//! builds of the same files, or a replay, and is read and dropped.

use std::sync::Arc;

use blobs::{BlobStore, Key};
use sha2::{Digest, Sha256};

use crate::sandboxes::Failure;

/// The largest archive accepted (the SDK's build contexts are gzip tars).
pub const MAX_UPLOAD_BYTES: u64 = 4 << 30;

/// How long an upload URL stays valid: the SDK uploads as soon as it has the URL.
pub const UPLOAD_URL_TTL_SECS: u64 = 3600;

/// COPY archives in the blob store.
#[derive(Clone)]
pub struct Files {
    pub store: Arc<dyn BlobStore>,
    /// Where uploads are spooled before they go to the store.
    pub spool: std::path::PathBuf,
}

/// Checks the SDK's files hash: hex, as its SHA-256 is written.
pub fn check_hash(hash: &str) -> Result<(), Failure> {
    if !hash.is_empty() && hash.len() <= 128 && hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(Failure::Invalid(format!(
            "files hash {hash:?} must be 1 to 128 hex digits"
        )))
    }
}

/// The blob store key of a team's archive. Team IDs are the operator's, any text: each
/// byte outside `[A-Za-z0-9-]` is written `_XX` (its hex), so no two teams share a folder
/// ("acme.io" and "acme_io" would otherwise both be `acme_io`, and one could place archives
/// under hashes the other's builds use). A folder that would outgrow a file name is `.h-`
/// and the ID's SHA-256 instead. The cluster's own built-ins (team "") keep theirs under
/// `.public`; no team's folder starts with `.` but those.
pub fn key(team: &str, hash: &str) -> Result<Key, Failure> {
    check_hash(hash)?;
    if team.is_empty() {
        return Key::new(format!("files/.public/{}", hash.to_ascii_lowercase()))
            .map_err(|e| Failure::Internal(e.to_string()));
    }
    let mut folder = String::with_capacity(team.len());
    for b in team.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' {
            folder.push(b as char);
        } else {
            folder.push_str(&format!("_{b:02x}"));
        }
    }
    if folder.len() > 128 {
        let digest = Sha256::digest(team.as_bytes());
        folder = format!(".h-{}", digest.iter().map(|b| format!("{b:02x}")).collect::<String>());
    }
    Key::new(format!("files/{folder}/{}", hash.to_ascii_lowercase())).map_err(|e| Failure::Internal(e.to_string()))
}

/// The token an upload URL carries, valid until Unix time `expires`: only the holder of
/// `api_key` can make it.
pub fn upload_token(api_key: &str, template_id: &str, hash: &str, expires: u64) -> String {
    let mut h = Sha256::new();
    for part in ["sandboxsched-upload", api_key, template_id, hash, &expires.to_string()] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Compares two tokens in constant time.
pub fn same_token(a: &str, b: &str) -> bool {
    envd_wire::access::same_secret(a.as_bytes(), b.as_bytes())
}

impl Files {
    /// Whether the team's archive with this hash is stored.
    pub async fn present(&self, team: &str, hash: &str) -> Result<bool, Failure> {
        self.stored(&key(team, hash)?).await
    }

    async fn stored(&self, key: &Key) -> Result<bool, Failure> {
        self.store
            .exists(key)
            .await
            .map(|size| size.is_some())
            .map_err(|e| Failure::Unavailable(format!("blob store: {e}")))
    }

    /// Stores an upload: spooled to a local file as it streams (never whole in memory), then
    /// put into the store.
    pub async fn store_upload(&self, team: &str, hash: &str, body: axum::body::Body) -> Result<u64, Failure> {
        use futures::StreamExt as _;
        use tokio::io::AsyncWriteExt as _;
        let key = key(team, hash)?;
        if self.stored(&key).await? {
            let read = drain(body).await?;
            tracing::info!(
                team,
                hash,
                read,
                "an archive already stored was uploaded again: dropped"
            );
            return Ok(read);
        }
        crate::spool::private_dir(&self.spool)
            .await
            .map_err(|e| Failure::Internal(format!("upload spool: {e}")))?;
        let path = self.spool.join(format!("upload-{}", uuid::Uuid::new_v4().simple()));
        let written = async {
            let mut file = crate::spool::new_file(&path)
                .await
                .map_err(|e| Failure::Internal(format!("upload spool: {e}")))?;
            let mut stream = body.into_data_stream();
            let mut total = 0u64;
            while let Some(chunk) = stream.next().await {
                let chunk = counted(chunk, &mut total)?;
                file.write_all(&chunk)
                    .await
                    .map_err(|e| Failure::Internal(format!("upload spool: {e}")))?;
            }
            file.flush()
                .await
                .map_err(|e| Failure::Internal(format!("upload spool: {e}")))?;
            // Asked again once the body is in: another upload of the same hash may have been
            // stored while this one streamed (two racing: the first stays).
            if self.stored(&key).await? {
                tracing::info!(team, hash, "an archive stored while this upload streamed: dropped");
                return Ok(total);
            }
            self.store
                .put_file(&key, &path)
                .await
                .map_err(|e| Failure::Unavailable(format!("blob store: {e}")))?;
            Ok(total)
        }
        .await;
        let _ = tokio::fs::remove_file(&path).await;
        written
    }
}

/// A chunk of an upload, counted against [`MAX_UPLOAD_BYTES`].
fn counted(chunk: Result<axum::body::Bytes, axum::Error>, total: &mut u64) -> Result<axum::body::Bytes, Failure> {
    let chunk = chunk.map_err(|e| Failure::Invalid(format!("upload interrupted: {e}")))?;
    *total += chunk.len() as u64;
    if *total > MAX_UPLOAD_BYTES {
        return Err(Failure::Invalid(format!(
            "the archive exceeds {} GiB",
            MAX_UPLOAD_BYTES >> 30
        )));
    }
    Ok(chunk)
}

/// Reads an upload to its end and keeps nothing (the client then hears its answer rather
/// than a connection closed under its body); returns its size.
async fn drain(body: axum::body::Body) -> Result<u64, Failure> {
    use futures::StreamExt as _;
    let mut stream = body.into_data_stream();
    let mut total = 0u64;
    while let Some(chunk) = stream.next().await {
        counted(chunk, &mut total)?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_per_team_and_hashes_are_hex() {
        assert_eq!(key("team-a", "ABCDEF01").unwrap().to_string(), "files/team-a/abcdef01");
        assert_eq!(key("a/../b", "00").unwrap().to_string(), "files/a_2f_2e_2e_2fb/00");
        assert_eq!(key("", "00").unwrap().to_string(), "files/.public/00");
        assert_eq!(key(".public", "00").unwrap().to_string(), "files/_2epublic/00");
        // One folder per team, whatever the operator named them.
        assert_ne!(key("acme.io", "00").unwrap(), key("acme_io", "00").unwrap());
        assert_eq!(key("acme_io", "00").unwrap().to_string(), "files/acme_5fio/00");
        let long = key(&"é".repeat(100), "00").unwrap().to_string();
        assert!(long.starts_with("files/.h-") && long.len() < 100, "{long}");
        assert_ne!(long, key(&"é".repeat(101), "00").unwrap().to_string());
        assert!(key("t", "../x").is_err());
        assert!(key("t", "").is_err());
        let token = upload_token("key", "t1", "00", 100);
        assert!(same_token(&token, &upload_token("key", "t1", "00", 100)));
        assert!(!same_token(&token, &upload_token("other", "t1", "00", 100)));
        assert!(!same_token(&token, &upload_token("key", "t1", "01", 100)));
        assert!(
            !same_token(&token, &upload_token("key", "t1", "00", 101)),
            "a later expiry"
        );
    }
}
