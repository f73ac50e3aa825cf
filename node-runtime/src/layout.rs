//! Where the runtime keeps a node's sandboxes on disk, under the node's state directory:
//!
//! ```text
//! sandboxes/ID/            a sandbox's folder (the node keeps its record beside these)
//! sandboxes/ID/disk/home/  its writable layer, on its disk (see `crate::disk`)
//! container/base/          the base template's layer (the host's userland)
//! container/shim/          the layer above an image's own
//! container/layers/sha256/HEX/
//!                          template layers in overlay form, by digest
//! ```

use std::path::{Path, PathBuf};

/// The folder of every sandbox's folder in `state_dir`.
pub fn sandboxes_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("sandboxes")
}

/// The writable layer in sandbox folder `dir` (or a restore's scratch folder).
pub fn home_in(dir: &Path) -> PathBuf {
    dir.join(crate::disk::MOUNT).join("home")
}

/// Where template layers are kept in `state_dir`.
pub fn layers_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("container").join("layers")
}

/// The hex of a `sha256:<hex>` digest, when it is one: the only form a layer is named by.
pub fn digest_hex(digest: &str) -> Option<&str> {
    digest
        .strip_prefix("sha256:")
        .filter(|hex| hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// A digest that is not `sha256:` and 64 lowercase hex digits.
#[derive(Debug, thiserror::Error)]
#[error("not a layer digest: {0:?}")]
pub struct BadDigest(pub String);

/// The folder of layer `digest` under `layers` ([`layers_dir`]).
pub fn layer_dir(layers: &Path, digest: &str) -> Result<PathBuf, BadDigest> {
    let hex = digest_hex(digest).ok_or_else(|| BadDigest(digest.to_string()))?;
    Ok(layers.join("sha256").join(hex))
}

/// Copies a directory tree (a template's files into a new sandbox's home), creating `to` if
/// needed.
pub fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_named_by_sha256_digests_only() {
        let hex = "ab".repeat(32);
        let dir = layer_dir(Path::new("/l"), &format!("sha256:{hex}")).unwrap();
        assert_eq!(dir, Path::new("/l/sha256").join(&hex));
        for bad in [
            "",
            "sha256:",
            "sha512:00",
            &format!("sha256:{}", "AB".repeat(32)),
            &format!("sha256:{hex}/.."),
        ] {
            assert!(layer_dir(Path::new("/l"), bad).is_err(), "{bad:?}");
        }
    }
}
