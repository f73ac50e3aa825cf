//! Test helpers: scratch directories and hand-made (possibly malicious) tar archives.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use tar::{EntryType, Header};

/// A unique directory under the system temp dir, removed on drop.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("layers-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Scratch(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Creates and returns a subdirectory.
    pub fn sub(&self, name: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::create_dir_all(&p).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds tar archives entry by entry, writing names raw so that `..` and absolute paths can be
/// produced (tar-rs's `set_path` refuses them).
pub struct TarMaker(tar::Builder<Vec<u8>>);

impl TarMaker {
    pub fn new() -> TarMaker {
        TarMaker(tar::Builder::new(Vec::new()))
    }

    fn header(kind: EntryType, path: &str, mode: u32, size: u64) -> Header {
        let mut h = Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_600_000_000);
        h.set_size(size);
        let name = &mut h.as_old_mut().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        h
    }

    /// Appends an entry of any kind with an optional link name and raw data.
    pub fn raw(&mut self, kind: EntryType, path: &str, link: &str, mode: u32, data: &[u8]) -> &mut Self {
        let mut h = Self::header(kind, path, mode, data.len() as u64);
        let ln = &mut h.as_old_mut().linkname;
        ln[..link.len()].copy_from_slice(link.as_bytes());
        h.set_cksum();
        self.0.append(&h, data).unwrap();
        self
    }

    pub fn file(&mut self, path: &str, data: &[u8]) -> &mut Self {
        self.raw(EntryType::Regular, path, "", 0o644, data)
    }

    pub fn dir(&mut self, path: &str) -> &mut Self {
        self.raw(EntryType::Directory, path, "", 0o755, b"")
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        self.raw(EntryType::Symlink, path, target, 0o777, b"")
    }

    pub fn hardlink(&mut self, path: &str, target: &str) -> &mut Self {
        self.raw(EntryType::Link, path, target, 0o644, b"")
    }

    /// Appends a header with custom settings (ids, mode, PAX xattrs) via `f`.
    pub fn custom(
        &mut self,
        kind: EntryType,
        path: &str,
        data: &[u8],
        pax: &[(&str, &[u8])],
        f: impl FnOnce(&mut Header),
    ) -> &mut Self {
        self.0.append_pax_extensions(pax.iter().copied()).unwrap();
        let mut h = Self::header(kind, path, 0o644, data.len() as u64);
        f(&mut h);
        h.set_cksum();
        self.0.append(&h, data).unwrap();
        self
    }

    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::replace(&mut self.0, tar::Builder::new(Vec::new()))
            .into_inner()
            .unwrap()
    }
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

/// (mode incl. file type, uid, gid) without following symlinks.
pub fn meta(p: &Path) -> (u32, u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.mode(), m.uid(), m.gid())
}

pub fn xattr(p: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    let n = rustix::fs::lgetxattr(p, name, &mut buf[..]).ok()?;
    buf.truncate(n);
    Some(buf)
}

/// A description of every entry under `root` (type, mode, ids, mtime, content or target,
/// `user.*` and opaque xattrs), keyed by relative path, for comparing trees.
pub fn snapshot(root: &Path) -> std::collections::BTreeMap<String, String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let m = std::fs::symlink_metadata(&path).unwrap();
            let ft = m.file_type();
            let detail = if ft.is_dir() {
                stack.push(path.clone());
                String::new()
            } else if ft.is_file() {
                String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned()
            } else if ft.is_symlink() {
                std::fs::read_link(&path).unwrap().display().to_string()
            } else {
                format!("rdev {}", m.rdev())
            };
            let mut names = vec![0u8; 4096];
            let n = rustix::fs::llistxattr(&path, &mut names[..]).unwrap();
            let xattrs: Vec<String> = names[..n]
                .split(|&b| b == 0)
                .map(|n| String::from_utf8_lossy(n).into_owned())
                .filter(|n| n.starts_with("user.") || n == "trusted.overlay.opaque")
                .map(|n| format!("{n}={:?}", xattr(&path, &n).unwrap()))
                .collect();
            let ids = if ft.is_char_device() {
                "whiteout".to_string()
            } else {
                format!("{} {}", m.uid(), m.gid())
            };
            let desc = format!("{:o} {ids} {} {detail} {xattrs:?}", m.mode(), m.mtime());
            out.insert(path.strip_prefix(root).unwrap().display().to_string(), desc);
        }
    }
    out
}

/// The (path, uid, type) of each entry of an uncompressed tar.
pub fn list_tar(tar: &[u8]) -> Vec<(String, u64, tar::EntryType)> {
    let mut archive = tar::Archive::new(tar);
    let entries = archive.entries().unwrap().map(|e| {
        let e = e.unwrap();
        (
            String::from_utf8_lossy(&e.path_bytes()).into_owned(),
            e.header().uid().unwrap(),
            e.header().entry_type(),
        )
    });
    entries.collect()
}
