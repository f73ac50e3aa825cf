//! The node's cache of template layers: each layer a directory in overlay form
//! (`<root>/sha256/<hex>/`, owned by the ids sandboxes map), ready to be a lowerdir of a
//! sandbox's root filesystem.
//!
//! A layer missing here is fetched from the cluster's blob store by its digest
//! (`layers/sha256/<hex>`), its bytes checked against that digest, and unpacked
//! (`layers::unpack`: whiteouts become overlay whiteouts, no path escapes the layer) into a
//! scratch directory that is renamed into place whole: a layer directory that exists is
//! complete. Several creates needing one layer at once fetch it once.
//!
//! A build's step publishes its layer the other way ([`LayerCache::publish`]): the step's
//! writable directory is packed into a blob (named by its digest) for the store, and the
//! directory itself becomes the cached layer.
//!
//! The cache is bounded ([`LayerCache::evict`]): past its size, the least recently used
//! layers go, never one a sandbox or build on the node uses (a layer is "used" when a create
//! or build last asked for it).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError};

use blobs::{BlobStore, Key};
use common::template::Layer;

use crate::runtime::container::spec::HOST_ID_BASE;

/// Why a layer could not be had.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("layer digest {0:?} is not sha256:<64 hex digits>")]
    BadDigest(String),
    #[error("layer {digest}: {reason}")]
    Fetch { digest: String, reason: String },
    #[error("layer {digest} does not match its digest (got {got})")]
    Corrupt { digest: String, got: String },
    #[error("publishing a layer: {0}")]
    Publish(String),
}

/// The most images a node tells placement it holds.
const MAX_REMEMBERED: usize = 256;

/// Top-level names a build's layer never carries: the mount point of envd's binary.
pub const NOT_IN_LAYERS: [&str; 1] = [".sandboxsched"];

/// Where a node keeps its layers, under its state directory.
pub fn root(state_dir: &Path) -> PathBuf {
    crate::runtime::layout::layers_dir(state_dir)
}

/// The hex of a `sha256:<hex>` digest, checked.
pub fn hex_of(digest: &str) -> Result<&str, LayerError> {
    crate::runtime::layout::digest_hex(digest).ok_or_else(|| LayerError::BadDigest(digest.to_string()))
}

/// The directory of layer `digest` under `root`.
pub fn layer_path(root: &Path, digest: &str) -> Result<PathBuf, LayerError> {
    crate::runtime::layout::layer_dir(root, digest).map_err(|e| LayerError::BadDigest(e.0))
}

/// The blob store key of layer `digest`.
pub fn blob_key(digest: &str) -> Result<Key, LayerError> {
    let hex = hex_of(digest)?;
    Key::new(format!("layers/sha256/{hex}")).map_err(|e| LayerError::BadDigest(e.to_string()))
}

/// The node's layers, and the store they come from.
pub struct LayerCache {
    root: PathBuf,
    store: Arc<dyn BlobStore>,
    /// How many bytes of layers the cache keeps before evicting.
    max_bytes: u64,
    /// Sizes of layer directories measured so far (a walk each, once).
    sizes: std::sync::Mutex<HashMap<String, u64>>,
    /// Images whose layers were made present here lately (build ID, layer digests), newest
    /// last: what the node tells placement it holds, while the layers are still here.
    images: std::sync::Mutex<std::collections::VecDeque<(String, Vec<String>)>>,
    /// One lock per layer being fetched, so concurrent users wait for one fetch.
    fetching: tokio::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Layers builds under way stand on (digest: how many builds), which no eviction takes.
    pinned: Arc<std::sync::Mutex<HashMap<String, usize>>>,
}

/// Layers pinned in the cache until this is dropped (see [`LayerCache::pin`]).
pub struct Pins {
    pinned: Arc<std::sync::Mutex<HashMap<String, usize>>>,
    digests: Vec<String>,
}

impl Drop for Pins {
    fn drop(&mut self) {
        let mut pinned = self.pinned.lock().unwrap_or_else(PoisonError::into_inner);
        for digest in &self.digests {
            if let Some(count) = pinned.get_mut(digest) {
                *count -= 1;
                if *count == 0 {
                    pinned.remove(digest);
                }
            }
        }
    }
}

fn scratch(root: &Path, what: &str) -> PathBuf {
    root.join("tmp")
        .join(format!("{what}-{}", uuid::Uuid::new_v4().simple()))
}

/// Removes what a node that stopped mid-way left in the cache's scratch folder (a fetch, a
/// build step's files, an eviction): nothing else will, and a tenant's build can leave gigabytes
/// there. An entry on another file system (a mount) is left alone.
fn clear_scratch(tmp: &Path) {
    use std::os::unix::fs::MetadataExt as _;
    let (Ok(here), Ok(entries)) = (std::fs::metadata(tmp), std::fs::read_dir(tmp)) else {
        return;
    };
    let mut cleared = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.dev() != here.dev() {
            tracing::warn!(path = %path.display(), "layer scratch: left alone, another file system is mounted there");
            continue;
        }
        let removed = if meta.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match removed {
            Ok(()) => cleared += 1,
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "layer scratch: cannot remove"),
        }
    }
    if cleared > 0 {
        tracing::info!(cleared, "layer scratch left by an earlier run removed");
    }
}

/// How a layer blob is compressed, from its first bytes (gzip, zstd, or a plain tar).
fn compression_of(path: &Path) -> std::io::Result<layers::unpack::Compression> {
    use std::io::Read as _;
    let mut magic = [0u8; 4];
    let n = std::fs::File::open(path)?.read(&mut magic)?;
    Ok(match &magic[..n] {
        [0x1f, 0x8b, ..] => layers::unpack::Compression::Gzip,
        [0x28, 0xb5, 0x2f, 0xfd] => layers::unpack::Compression::Zstd,
        _ => layers::unpack::Compression::None,
    })
}

impl LayerCache {
    pub fn new(root: PathBuf, store: Arc<dyn BlobStore>, max_bytes: u64) -> Self {
        clear_scratch(&root.join("tmp"));
        Self {
            root,
            store,
            max_bytes,
            sizes: Default::default(),
            images: Default::default(),
            fetching: tokio::sync::Mutex::new(HashMap::new()),
            pinned: Arc::default(),
        }
    }

    /// Keeps `layers` from eviction until the answer is dropped (a build's, whose containers
    /// stand on them outside any sandbox's record).
    pub fn pin(&self, layers: &[Layer]) -> Pins {
        let digests: Vec<String> = layers.iter().map(|l| l.digest.clone()).collect();
        let mut pinned = self.pinned.lock().unwrap_or_else(PoisonError::into_inner);
        for digest in &digests {
            *pinned.entry(digest.clone()).or_default() += 1;
        }
        Pins {
            pinned: self.pinned.clone(),
            digests,
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The most bytes of layers the cache keeps (and so the largest one layer may be).
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    pub fn store(&self) -> &Arc<dyn BlobStore> {
        &self.store
    }

    /// Makes every layer of an image present; returns how many had to be fetched.
    pub async fn ensure_all(&self, layers: &[Layer]) -> Result<usize, LayerError> {
        let mut fetched = 0;
        for layer in layers {
            if self.ensure(layer).await? {
                fetched += 1;
            }
        }
        Ok(fetched)
    }

    /// Makes the layer present (fetching and unpacking it if it is not); true when it had to
    /// be fetched.
    pub async fn ensure(&self, layer: &Layer) -> Result<bool, LayerError> {
        let path = layer_path(&self.root, &layer.digest)?;
        if path.is_dir() {
            touch(&path);
            return Ok(false);
        }
        let lock = self
            .fetching
            .lock()
            .await
            .entry(layer.digest.clone())
            .or_default()
            .clone();
        let _held = lock.lock().await;
        if path.is_dir() {
            return Ok(false);
        }
        let fetched = self.fetch(&layer.digest, &path).await;
        self.fetching.lock().await.remove(&layer.digest);
        fetched.map(|()| true)
    }

    async fn fetch(&self, digest: &str, path: &Path) -> Result<(), LayerError> {
        let failed = |reason: String| LayerError::Fetch {
            digest: digest.to_string(),
            reason,
        };
        let key = blob_key(digest)?;
        let blob = scratch(&self.root, "blob");
        let dir = scratch(&self.root, "layer");
        let tmp = self.root.join("tmp");
        tokio::fs::create_dir_all(&tmp)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let result = async {
            self.store
                .get_to_file(&key, &blob)
                .await
                .map_err(|e| failed(format!("from the blob store: {e}")))?;
            let (blob_c, dir_c, digest_c, path_c) = (blob.clone(), dir.clone(), digest.to_string(), path.to_path_buf());
            let max_bytes = self.max_bytes;
            tokio::task::spawn_blocking(move || -> Result<(), LayerError> {
                let failed = |reason: String| LayerError::Fetch {
                    digest: digest_c.clone(),
                    reason,
                };
                let got = layers::digest::Digest::of_file(&blob_c).map_err(|e| failed(e.to_string()))?;
                if got.to_string() != digest_c {
                    return Err(LayerError::Corrupt {
                        digest: digest_c.clone(),
                        got: got.to_string(),
                    });
                }
                let compression = compression_of(&blob_c).map_err(|e| failed(e.to_string()))?;
                let file = std::fs::File::open(&blob_c).map_err(|e| failed(e.to_string()))?;
                std::fs::create_dir_all(&dir_c).map_err(|e| failed(e.to_string()))?;
                // A layer larger than the whole cache could never be kept: the bound also stops
                // a decompression bomb before it fills the disk.
                layers::unpack::unpack_layer_within(
                    std::io::BufReader::new(file),
                    compression,
                    &dir_c,
                    HOST_ID_BASE,
                    max_bytes,
                )
                .map_err(|e| failed(format!("unpacking: {e}")))?;
                if let Some(parent) = path_c.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| failed(e.to_string()))?;
                }
                std::fs::rename(&dir_c, &path_c).map_err(|e| failed(e.to_string()))
            })
            .await
            .map_err(|e| failed(e.to_string()))?
        }
        .await;
        let _ = tokio::fs::remove_file(&blob).await;
        if result.is_err() {
            let _ = tokio::fs::remove_dir_all(&dir).await;
        }
        if result.is_ok() {
            tracing::info!(%digest, "layer fetched");
        }
        result
    }

    /// Notes that `image`'s layers are here (after [`LayerCache::ensure_all`] or a build).
    pub fn remember(&self, image: &common::template::Image) {
        if image.layers.is_empty() || image.build_id.is_empty() {
            return;
        }
        let Ok(mut images) = self.images.lock() else { return };
        images.retain(|(id, _)| *id != image.build_id);
        images.push_back((
            image.build_id.clone(),
            image.layers.iter().map(|l| l.digest.clone()).collect(),
        ));
        while images.len() > MAX_REMEMBERED {
            images.pop_front();
        }
    }

    /// Build IDs of the remembered images whose layers are all still here.
    pub fn held(&self) -> Vec<String> {
        let Ok(images) = self.images.lock() else {
            return Vec::new();
        };
        images
            .iter()
            .filter(|(_, digests)| {
                digests
                    .iter()
                    .all(|d| layer_path(&self.root, d).is_ok_and(|p| p.is_dir()))
            })
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Removes the least recently used layers until the cache holds at most its bound, never
    /// one whose digest is in `in_use`. Blocking (walks new layers once to size them). Returns
    /// the digests removed.
    pub fn evict(&self, in_use: &std::collections::HashSet<String>) -> Vec<String> {
        let mut layers = Vec::new();
        for entry in std::fs::read_dir(self.root.join("sha256"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let hex = entry.file_name().to_string_lossy().into_owned();
            let digest = format!("sha256:{hex}");
            let used = entry
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            let size = {
                let known = self.sizes.lock().ok().and_then(|s| s.get(&digest).copied());
                known.unwrap_or_else(|| {
                    let size = tree_size(&entry.path());
                    if let Ok(mut sizes) = self.sizes.lock() {
                        sizes.insert(digest.clone(), size);
                    }
                    size
                })
            };
            layers.push((used, size, digest, entry.path()));
        }
        let mut total: u64 = layers.iter().map(|l| l.1).sum();
        layers.sort_by_key(|l| l.0);
        let mut removed = Vec::new();
        for (_, size, digest, path) in layers {
            if total <= self.max_bytes {
                break;
            }
            if in_use.contains(&digest) {
                continue;
            }
            // Renamed away first, so a create never mounts a half-deleted layer; pins are
            // read under their lock, held across the rename, so a build that pins a layer
            // (before it looks for it) either keeps it or finds it gone and fetches it again.
            let doomed = self
                .root
                .join("tmp")
                .join(format!("evicted-{}", uuid::Uuid::new_v4().simple()));
            let renamed = {
                let pinned = self.pinned.lock().unwrap_or_else(PoisonError::into_inner);
                !pinned.contains_key(&digest) && std::fs::rename(&path, &doomed).is_ok()
            };
            if renamed {
                let _ = std::fs::remove_dir_all(&doomed);
                total = total.saturating_sub(size);
                if let Ok(mut sizes) = self.sizes.lock() {
                    sizes.remove(&digest);
                }
                tracing::info!(%digest, size, "layer evicted from the cache");
                removed.push(digest);
            }
        }
        removed
    }

    /// Packs a layer directory into a blob in the store (named by its digest), leaving the
    /// directory as it is (a sandbox's writable layer, captured while it lives on).
    pub async fn pack(&self, dir: &Path) -> Result<Layer, LayerError> {
        let publish = |e: String| LayerError::Publish(e);
        let tmp = self.root.join("tmp");
        tokio::fs::create_dir_all(&tmp)
            .await
            .map_err(|e| publish(e.to_string()))?;
        let blob = scratch(&self.root, "packed");
        let (dir_c, blob_c) = (dir.to_path_buf(), blob.clone());
        let packed = tokio::task::spawn_blocking(move || -> Result<layers::pack::PackedLayer, LayerError> {
            let file = std::fs::File::create(&blob_c).map_err(|e| LayerError::Publish(e.to_string()))?;
            layers::pack::pack_layer(&dir_c, HOST_ID_BASE, &NOT_IN_LAYERS, std::io::BufWriter::new(file))
                .map_err(|e| LayerError::Publish(e.to_string()))
        })
        .await
        .map_err(|e| publish(e.to_string()))
        .and_then(|p| p);
        let stored = match &packed {
            Ok(p) => match blob_key(&p.digest.to_string()) {
                Ok(key) => self
                    .store
                    .put_file(&key, &blob)
                    .await
                    .map_err(|e| publish(format!("to the blob store: {e}"))),
                Err(e) => Err(e),
            },
            Err(_) => Ok(()),
        };
        let _ = tokio::fs::remove_file(&blob).await;
        let packed = packed?;
        stored?;
        Ok(Layer {
            digest: packed.digest.to_string(),
            size: packed.size,
        })
    }

    /// Publishes a build step's writable directory as a layer: packed into the store
    /// ([`LayerCache::pack`]), the directory itself moved into the cache. `None` (and the
    /// directory removed) when the step changed nothing: no empty layers. Consumes `upper`.
    pub async fn publish(&self, upper: &Path) -> Result<Option<Layer>, LayerError> {
        // A step's folder in the cache's scratch is consumed whatever happens: one whose layer
        // cannot be published (packing refused it, the store failed) leaves nothing behind on
        // the host's disk. (A builder's own writable layer, on its disk, goes with that disk.)
        let published = self.move_into_cache(upper).await;
        if published.is_err() && upper.starts_with(self.root.join("tmp")) {
            let _ = tokio::fs::remove_dir_all(upper).await;
        }
        published
    }

    async fn move_into_cache(&self, upper: &Path) -> Result<Option<Layer>, LayerError> {
        let publish = |e: String| LayerError::Publish(e);
        if !has_content(upper).map_err(|e| publish(e.to_string()))? {
            let _ = tokio::fs::remove_dir_all(upper).await;
            return Ok(None);
        }
        let layer = self.pack(upper).await?;
        let path = layer_path(&self.root, &layer.digest)?;
        if path.is_dir() {
            let _ = tokio::fs::remove_dir_all(upper).await;
        } else {
            if let Some(parent) = path.parent() {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(|e| publish(e.to_string()))?;
            }
            for name in NOT_IN_LAYERS {
                let _ = tokio::fs::remove_dir_all(upper.join(name)).await;
            }
            match tokio::fs::rename(upper, &path).await {
                Ok(()) => {}
                // A builder's layer on a disk of its own cannot move into the cache: the layer
                // is unpacked from the store (through the same checks as any other) when a
                // sandbox needs it.
                Err(e) if e.kind() == std::io::ErrorKind::CrossesDevices => {
                    let _ = tokio::fs::remove_dir_all(upper).await;
                }
                Err(e) => return Err(publish(e.to_string())),
            }
        }
        Ok(Some(layer))
    }
}

/// Whether a layer directory holds anything a layer carries (anything but [`NOT_IN_LAYERS`]).
fn has_content(dir: &Path) -> std::io::Result<bool> {
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        if !NOT_IN_LAYERS.iter().any(|i| std::ffi::OsStr::new(i) == name) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Marks a layer as just used (its directory's modification time is its place in the LRU).
fn touch(path: &Path) {
    if let Ok(dir) = std::fs::File::open(path) {
        let _ = dir.set_modified(std::time::SystemTime::now());
    }
}

/// Bytes of the regular files under `dir` (symlinks not followed).
fn tree_size(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).into_iter().flatten().flatten() {
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(entry.path()),
                Ok(t) if t.is_file() => total += entry.metadata().map_or(0, |m| m.len()),
                _ => {}
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_takes_the_least_recently_used_and_never_one_in_use() {
        let root = std::env::temp_dir().join(format!("layer-cache-{}", uuid::Uuid::new_v4().simple()));
        let store = blobs::from_url(&root.join("blobs").display().to_string()).unwrap();
        // What an earlier run left in the scratch folder is gone once the cache opens.
        std::fs::create_dir_all(root.join("tmp/step-left/deep")).unwrap();
        std::fs::write(root.join("tmp/blob-left"), b"x").unwrap();
        let cache = LayerCache::new(root.clone(), store, 2048);
        assert_eq!(std::fs::read_dir(root.join("tmp")).unwrap().count(), 0);
        let digest = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        for (i, c) in ['a', 'b', 'c'].into_iter().enumerate() {
            let dir = layer_path(&root, &digest(c)).unwrap();
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("f"), vec![0u8; 1024]).unwrap();
            let when = std::time::SystemTime::now() - std::time::Duration::from_secs(100 - i as u64);
            std::fs::File::open(&dir).unwrap().set_modified(when).unwrap();
        }
        // 3 KiB held, 2 KiB allowed: the oldest goes, unless in use, then the next.
        let in_use = [digest('a')].into_iter().collect();
        assert_eq!(cache.evict(&in_use), vec![digest('b')]);
        assert!(layer_path(&root, &digest('a')).unwrap().is_dir());
        assert!(cache.evict(&in_use).is_empty(), "within the bound now");
        // A build's pinned layer stays however old, and goes once the build lets it go.
        let layer = |c: char| Layer {
            digest: digest(c),
            size: 1024,
        };
        let cache = LayerCache::new(root.clone(), cache.store().clone(), 0);
        let pins = cache.pin(&[layer('a')]);
        assert_eq!(cache.evict(&Default::default()), vec![digest('c')]);
        drop(pins);
        assert_eq!(cache.evict(&Default::default()), vec![digest('a')]);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn digests_name_paths_and_keys_only_when_well_formed() {
        let hex = "a".repeat(64);
        let digest = format!("sha256:{hex}");
        assert_eq!(
            layer_path(Path::new("/c"), &digest).unwrap(),
            Path::new("/c/sha256").join(&hex)
        );
        assert_eq!(blob_key(&digest).unwrap().to_string(), format!("layers/sha256/{hex}"));
        for bad in [
            "",
            "sha256:",
            "sha512:aa",
            &format!("sha256:{}", "A".repeat(64)),
            &format!("sha256:../{}", "a".repeat(61)),
        ] {
            assert!(layer_path(Path::new("/c"), bad).is_err(), "{bad}");
        }
    }
}
