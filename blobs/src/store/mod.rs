//! The [`BlobStore`] trait, blob [`Key`]s, and the choice of backend from a URL.
//!
//! A blob store is a flat map from a validated [`Key`] to an opaque byte string. It is
//! deliberately smaller than an object-store API: no listing, no ranges, no metadata. What the
//! control plane needs is "put this file", "get that blob onto my disk", "is it there, how
//! big", and "delete it"; everything else (naming by digest, deduplication, garbage
//! collection) is decided by the callers through the keys they choose.
//!
//! Two rules every backend keeps, and the shared conformance tests check:
//! - **Whole blobs only.** A reader sees either no blob or a complete one, never a torn write:
//!   [`LocalDir`] writes a temporary file and renames it, S3 publishes an object only when its
//!   upload completes. Concurrent writers of one key leave exactly one of their blobs.
//! - **Bounded memory.** [`BlobStore::put_file`] and [`BlobStore::get_to_file`] stream, so a
//!   1 GiB snapshot never sits in memory; [`BlobStore::get_bytes`]/[`BlobStore::put_bytes`]
//!   are for small blobs such as manifests and metadata.
//!
//! The trait returns boxed futures ([`BoxFuture`]) rather than using `async fn`, because the
//! store is passed around as `Arc<dyn BlobStore>` and `async fn` in traits is not object-safe.

pub mod local;
pub mod s3;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::future::BoxFuture;

pub use local::LocalDir;
pub use s3::{S3Config, S3};

/// What can go wrong with a blob store operation.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// No blob is stored under this key.
    #[error("blob {0} not found")]
    NotFound(Key),
    /// The request itself is wrong: a malformed key, URL or configuration.
    #[error("invalid: {0}")]
    Invalid(String),
    /// A local file operation failed; `context` says which one and on what path.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, e.g. `writing /var/lib/blobs/files/ab`.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The remote backend (S3 server) failed or refused the request.
    #[error("blob backend: {0}")]
    Backend(String),
}

impl BlobError {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        BlobError::Io {
            context: context.into(),
            source,
        }
    }
}

/// A validated blob key: 1–512 bytes of `/`-separated segments made of `[A-Za-z0-9._-]`,
/// with no empty, `.` or `..` segment and no segment over 255 bytes (a file-name limit).
///
/// The same key is a relative path under a [`LocalDir`] root and an object name in an S3
/// bucket, so the rules are the intersection of what both accept safely: no traversal, no
/// absolute paths, nothing that needs escaping.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(String);

impl Key {
    /// The longest key accepted, in bytes.
    pub const MAX_LEN: usize = 512;
    /// The longest segment accepted, in bytes (`NAME_MAX` on Linux file systems).
    pub const MAX_SEGMENT_LEN: usize = 255;

    /// Validates `key`.
    pub fn new(key: impl Into<String>) -> Result<Self, BlobError> {
        let key = key.into();
        if key.is_empty() || key.len() > Self::MAX_LEN {
            return Err(BlobError::Invalid(format!(
                "blob key {key:?} must be 1 to {} bytes long, not {}",
                Self::MAX_LEN,
                key.len()
            )));
        }
        for segment in key.split('/') {
            if segment.is_empty() || segment == "." || segment == ".." {
                return Err(BlobError::Invalid(format!(
                    "blob key {key:?} has an empty, `.` or `..` segment"
                )));
            }
            if segment.len() > Self::MAX_SEGMENT_LEN {
                return Err(BlobError::Invalid(format!(
                    "blob key {key:?} has a segment longer than {} bytes",
                    Self::MAX_SEGMENT_LEN
                )));
            }
            if let Some(c) = segment
                .chars()
                .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
            {
                return Err(BlobError::Invalid(format!(
                    "blob key {key:?} contains {c:?}; only A-Z a-z 0-9 . _ - and / separators are allowed"
                )));
            }
        }
        Ok(Key(key))
    }

    /// The key of an OCI layer blob: `sha256:<64 hex>` becomes `layers/sha256/<hex>`.
    pub fn for_layer(digest: &str) -> Result<Self, BlobError> {
        match digest.split_once(':') {
            Some(("sha256", hex))
                if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
            {
                Key::new(format!("layers/sha256/{hex}"))
            }
            _ => Err(BlobError::Invalid(format!(
                "layer digest {digest:?} is not of the form sha256:<64 lowercase hex digits>"
            ))),
        }
    }

    /// The key as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Key {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for Key {
    type Err = BlobError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Key::new(s)
    }
}

impl TryFrom<&str> for Key {
    type Error = BlobError;
    fn try_from(s: &str) -> Result<Self, Self::Error> {
        Key::new(s)
    }
}

impl TryFrom<String> for Key {
    type Error = BlobError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Key::new(s)
    }
}

/// A place to keep blobs that every machine of a cluster (or every process on one host) can
/// share. See the [module documentation](self) for the guarantees every backend gives.
pub trait BlobStore: Send + Sync {
    /// Uploads the local file at `path` as the blob `key`, replacing any blob already there.
    /// The file is streamed, not read into memory.
    fn put_file<'a>(&'a self, key: &'a Key, path: &'a Path) -> BoxFuture<'a, Result<(), BlobError>>;

    /// Stores `data` as the blob `key`, replacing any blob already there.
    fn put_bytes<'a>(&'a self, key: &'a Key, data: Bytes) -> BoxFuture<'a, Result<(), BlobError>>;

    /// Downloads the blob `key` to the local file `path` and returns its size. The download
    /// goes to a temporary file in the same directory that is renamed over `path` once
    /// complete, so `path` is never seen half-written. [`BlobError::NotFound`] when absent.
    fn get_to_file<'a>(&'a self, key: &'a Key, path: &'a Path) -> BoxFuture<'a, Result<u64, BlobError>>;

    /// Reads the whole blob `key` into memory: for small blobs only.
    /// [`BlobError::NotFound`] when absent.
    fn get_bytes<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Bytes, BlobError>>;

    /// The size of the blob `key` in bytes, or `None` when there is no such blob.
    fn exists<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<u64>, BlobError>>;

    /// Deletes the blob `key`; deleting an absent blob succeeds.
    fn delete<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<(), BlobError>>;

    /// A one-line description for logs, e.g. `local dir /var/lib/sandboxsched/blobs`.
    fn describe(&self) -> String;
}

/// Opens the blob store a URL names:
///
/// - `file:///abs/dir` or a bare absolute path `/abs/dir`: a [`LocalDir`] rooted there
///   (created if missing).
/// - `s3://bucket[/prefix]?endpoint=http://127.0.0.1:5055&region=us-east-1`: an [`S3`] store.
///   Credentials come from the query parameters `access_key_id`/`secret_access_key` (meant for
///   tests) or else from `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`);
///   with neither, object_store's default AWS credential chain (instance metadata, web
///   identity) is used. `region` defaults to `AWS_REGION`, then `us-east-1`. Plain-HTTP
///   endpoints are accepted on loopback only, unless `allow_http=true` is given.
pub fn from_url(url: &str) -> Result<Arc<dyn BlobStore>, BlobError> {
    if url.starts_with('/') {
        return Ok(Arc::new(LocalDir::new(url)?));
    }
    let parsed = url::Url::parse(url).map_err(|e| BlobError::Invalid(format!("blob store URL {url:?}: {e}")))?;
    match parsed.scheme() {
        "file" => {
            if !matches!(parsed.host_str(), None | Some("") | Some("localhost")) {
                return Err(BlobError::Invalid(format!(
                    "blob store URL {url:?}: file URLs must name a local path"
                )));
            }
            let path = parsed
                .to_file_path()
                .map_err(|()| BlobError::Invalid(format!("blob store URL {url:?} is not an absolute local path")))?;
            Ok(Arc::new(LocalDir::new(path)?))
        }
        "s3" => Ok(Arc::new(S3::new(S3Config::from_url(&parsed)?)?)),
        other => Err(BlobError::Invalid(format!(
            "blob store URL {url:?}: unknown scheme {other:?} (expected file://, s3:// or an absolute path)"
        ))),
    }
}

/// A temporary file beside its destination, removed on drop unless [`TempFile::commit`]ted.
///
/// Its name starts with `.tmp~`: `~` is not allowed in keys, so it can never be mistaken for
/// (or collide with) a blob, and the pid plus a process-wide counter plus the clock keep
/// processes sharing one directory apart.
pub(crate) struct TempFile {
    path: PathBuf,
    committed: bool,
}

impl TempFile {
    /// Creates the file (exclusively) in the directory of `dest`, creating that directory.
    pub(crate) fn beside(dest: &Path) -> Result<(std::fs::File, TempFile), BlobError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = dest
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| BlobError::io(format!("creating directory {}", dir.display()), e))?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!(
            ".tmp~{}-{}-{nanos}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        use std::os::unix::fs::OpenOptionsExt as _;
        // Readable by this user alone: a blob in the making may be a tenant's (a private
        // image's layer, spooled in the host's temporary folder).
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| BlobError::io(format!("creating {}", path.display()), e))?;
        Ok((file, TempFile { path, committed: false }))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the (already fsynced) file over `dest` and fsyncs the directory, so the new
    /// name survives a crash. Blocking: call from a blocking context.
    pub(crate) fn commit(mut self, dest: &Path) -> Result<(), BlobError> {
        std::fs::rename(&self.path, dest)
            .map_err(|e| BlobError::io(format!("renaming {} to {}", self.path.display(), dest.display()), e))?;
        self.committed = true;
        if let Some(dir) = dest.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| BlobError::io(format!("syncing directory {}", dir.display()), e))?;
        }
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Runs blocking file-system work off the async executor.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BlobError> + Send + 'static,
) -> Result<T, BlobError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| BlobError::Backend(format!("blocking file task failed: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A blob on its way (a private image's layer, in the host's temporary folder) is not for
    /// another local user to read.
    #[test]
    fn a_blob_in_the_making_is_its_owners_alone() {
        use std::os::unix::fs::PermissionsExt as _;
        let dest = std::env::temp_dir().join("sandboxsched-layer");
        let (file, tmp) = TempFile::beside(&dest).unwrap();
        drop(file);
        let mode = std::fs::metadata(tmp.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn keys_are_validated() {
        for good in [
            "a",
            "layers/sha256/abc",
            "files/x.tar.gz",
            "snapshots/sb-1_2",
            "..a/b..",
            ".hidden",
        ] {
            assert!(Key::new(good).is_ok(), "{good} should be accepted");
        }
        let long = "a".repeat(513);
        let long_segment = format!("x/{}", "b".repeat(256));
        for bad in [
            "",
            "/a",
            "a/",
            "a//b",
            "./a",
            "a/..",
            "a b",
            "a\\b",
            "é",
            "a~b",
            "a?b",
            &long,
            &long_segment,
        ] {
            let err = Key::new(bad).expect_err(bad);
            assert!(matches!(err, BlobError::Invalid(_)), "{bad}: {err}");
        }
        let longest = format!("{}/{}/c", "a".repeat(255), "b".repeat(254));
        assert_eq!(Key::new(longest).map(|k| k.as_str().len()).ok(), Some(512));
    }

    #[test]
    fn layer_keys_come_from_sha256_digests() {
        let hex = "0123456789abcdef".repeat(4);
        assert_eq!(
            Key::for_layer(&format!("sha256:{hex}")).unwrap().as_str(),
            format!("layers/sha256/{hex}")
        );
        assert!(Key::for_layer(&format!("sha512:{hex}")).is_err());
        assert!(Key::for_layer(&format!("sha256:{}", hex.to_uppercase())).is_err());
        assert!(Key::for_layer("sha256:abc").is_err());
    }

    #[test]
    fn urls_pick_a_backend() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("blobs");
        let store = from_url(&format!("file://{}", root.display())).unwrap();
        assert!(
            store.describe().contains(&root.display().to_string()),
            "{}",
            store.describe()
        );
        assert!(root.is_dir());
        let store = from_url(root.to_str().unwrap()).unwrap();
        assert!(store.describe().starts_with("local dir"));

        let store =
            from_url("s3://bkt/some/prefix?endpoint=http://127.0.0.1:1&access_key_id=a&secret_access_key=b").unwrap();
        assert!(store.describe().contains("bkt"), "{}", store.describe());
        for bad in [
            "relative/dir",
            "ftp://x/y",
            "file://host/x",
            "s3://?endpoint=http://127.0.0.1:1",
            "s3://b?endpoint=http://example.com&access_key_id=a&secret_access_key=b",
            "s3://b/bad//prefix?access_key_id=a&secret_access_key=b",
            "s3://b?unknown=1",
        ] {
            assert!(
                matches!(from_url(bad), Err(BlobError::Invalid(_))),
                "{bad} should be refused"
            );
        }
        assert!(
            from_url("s3://b?endpoint=http://example.com&allow_http=true&access_key_id=a&secret_access_key=b").is_ok()
        );
    }
}
