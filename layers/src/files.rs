//! Extracting a user-supplied archive of build-context files, for Dockerfile-`COPY`-like steps.
//!
//! The archive is made by the client (Python's `tarfile` over a build context), so only
//! regular files, directories and symlinks are accepted; hard links, devices, fifos and anything
//! else are refused rather than interpreted. Everything created gets the step's owner (host
//! ids, already shifted by the caller) and either the step's `--chmod` mode or the archive's
//! mode without setuid/setgid. Directories that already exist in `dest` are merged into and
//! left as they are; a file may replace a file or symlink, but a file/directory clash is an
//! error, as silently deleting a directory of the image would be a surprise.
//!
//! Symlink targets are stored verbatim (they are resolved later, inside the container), but
//! extraction never writes through a symlink, whether it came from the archive or was already in
//! `dest`: see the `safefs` module. `dest` itself is trusted: the caller resolves it.

use std::io::{self, Read};
use std::path::Path;

use tar::EntryType;

use crate::safefs::{self, normalise, Attrs, Policy, SafeFsError, Tree};

/// Errors of build-context extraction.
#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    /// Reading or decompressing the archive failed, or it is malformed.
    #[error("reading archive: {0}")]
    Read(#[from] io::Error),
    /// An entry was unsafe or could not be created.
    #[error(transparent)]
    Fs(#[from] SafeFsError),
    /// An entry that is not a regular file, directory or symlink.
    #[error("{path}: entry type {kind:?} is not allowed (only files, directories and symlinks)")]
    Refused { path: String, kind: EntryType },
}

/// Extracts the (optionally gzip-compressed) tar `reader` into `dest`, every entry owned by the
/// host ids `owner`, with `mode` applied to the files and directories it creates when given.
/// Returns the bytes of file content written.
pub fn extract_files(
    reader: impl Read,
    gzip: bool,
    dest: &Path,
    owner: (u32, u32),
    mode: Option<u32>,
) -> Result<u64, FilesError> {
    extract_files_within(reader, gzip, dest, owner, mode, u64::MAX)
}

/// [`extract_files`], failing once the uncompressed archive passes `max_bytes` (an uploaded
/// archive is untrusted: a small gzip can inflate to fill a disk).
pub fn extract_files_within(
    reader: impl Read,
    gzip: bool,
    dest: &Path,
    owner: (u32, u32),
    mode: Option<u32>,
    max_bytes: u64,
) -> Result<u64, FilesError> {
    if gzip {
        let inflated = crate::unpack::Bounded::new(flate2::read::MultiGzDecoder::new(reader), max_bytes);
        extract_tar(inflated, dest, owner, mode)
    } else {
        extract_tar(crate::unpack::Bounded::new(reader, max_bytes), dest, owner, mode)
    }
}

fn extract_tar<R: Read>(reader: R, dest: &Path, owner: (u32, u32), mode: Option<u32>) -> Result<u64, FilesError> {
    // A step's `--chmod` is the tenant's too: no set-id bit from it either (the files go into
    // a layer on the host as they are).
    let mode = mode.map(|mode| mode & 0o1777);
    let mut tree = Tree::open(dest, Policy::Copy, (owner.0, owner.1, mode.unwrap_or(0o755)))?;
    let mut archive = tar::Archive::new(crate::headers::HeaderGuard::new(reader));
    let mut written = 0;
    for entry in archive.entries()? {
        let mut entry = entry?;
        let header = entry.header().clone();
        let kind = header.entry_type();
        if kind == EntryType::XGlobalHeader {
            continue;
        }
        let comps = normalise(&entry.path_bytes())?;
        let attrs = Attrs {
            uid: owner.0,
            gid: owner.1,
            mode: mode.unwrap_or(header.mode()? & 0o1777),
            mtime: i64::try_from(header.mtime()?).unwrap_or(i64::MAX),
            xattrs: Vec::new(),
        };
        match kind {
            EntryType::Regular | EntryType::Continuous => written += tree.make_file(&comps, &attrs, &mut entry)?,
            EntryType::Directory => tree.make_dir(&comps, &attrs)?,
            EntryType::Symlink => {
                let target = entry.link_name_bytes().map(|t| t.into_owned());
                let target = target.ok_or_else(|| SafeFsError::InvalidPath(safefs::show(&comps)))?;
                tree.make_symlink(&comps, &target, &attrs)?;
            }
            kind => {
                return Err(FilesError::Refused {
                    path: safefs::show(&comps),
                    kind,
                })
            }
        }
    }
    tree.finish()?;
    tracing::debug!(dest = %dest.display(), written, "extracted build files");
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{gzip, meta, Scratch, TarMaker};

    const OWNER: (u32, u32) = (101_000, 101_001);

    fn context() -> Vec<u8> {
        TarMaker::new()
            .dir("app")
            .raw(EntryType::Regular, "app/run.sh", "", 0o4755, b"#!/bin/sh\n")
            .symlink("app/passwd", "/etc/passwd")
            .file("deep/er/x", b"x")
            .finish()
    }

    #[test]
    fn extracts_with_owner_and_modes() {
        let s = Scratch::new("files");
        let dest = s.sub("dest");
        std::fs::create_dir(dest.join("app")).unwrap(); // existing: merged, left as it is
        let before = meta(&dest.join("app"));
        assert_eq!(
            extract_files(&gzip(&context())[..], true, &dest, OWNER, None).unwrap(),
            11
        );
        assert_eq!(meta(&dest.join("app")), before);
        assert_eq!(
            meta(&dest.join("app/run.sh")),
            (0o100755, OWNER.0, OWNER.1),
            "setuid stripped"
        );
        assert_eq!(meta(&dest.join("deep/er")), (0o040755, OWNER.0, OWNER.1));
        assert_eq!(meta(&dest.join("app/passwd")).1, OWNER.0);
        assert_eq!(
            std::fs::read_link(dest.join("app/passwd")).unwrap(),
            Path::new("/etc/passwd")
        );

        let dest = s.sub("chmod");
        extract_files(&context()[..], false, &dest, OWNER, Some(0o640)).unwrap();
        assert_eq!(meta(&dest.join("app/run.sh")), (0o100640, OWNER.0, OWNER.1));
        assert_eq!(meta(&dest.join("app")), (0o040640, OWNER.0, OWNER.1));
        assert_eq!(meta(&dest.join("deep")).0, 0o040640);

        let dest = s.sub("chmod-setid");
        extract_files(&context()[..], false, &dest, OWNER, Some(0o6755)).unwrap();
        assert_eq!(meta(&dest.join("app/run.sh")).0, 0o100755, "--chmod sets no set-id bit");
        assert_eq!(meta(&dest.join("deep")).0, 0o040755);
    }

    #[test]
    fn refuses_other_entry_types() {
        let s = Scratch::new("files-types");
        let tars = [
            TarMaker::new().file("f", b"x").hardlink("h", "f").finish(),
            TarMaker::new().raw(EntryType::Fifo, "p", "", 0o644, b"").finish(),
            TarMaker::new().raw(EntryType::Char, "c", "", 0o644, b"").finish(),
            TarMaker::new().raw(EntryType::Block, "b", "", 0o644, b"").finish(),
        ];
        for tar in tars {
            let err = extract_files(&tar[..], false, s.path(), OWNER, None).unwrap_err();
            assert!(matches!(err, FilesError::Refused { .. }), "{err}");
        }
    }

    #[test]
    fn never_writes_through_symlinks() {
        let s = Scratch::new("files-symlinks");
        let (dest, outside) = (s.sub("dest"), s.sub("outside"));
        std::fs::write(outside.join("t"), b"keep").unwrap();
        std::os::unix::fs::symlink(&outside, dest.join("existing")).unwrap();
        std::os::unix::fs::symlink(outside.join("t"), dest.join("file-link")).unwrap();
        let out = outside.to_str().unwrap();
        let bad = [
            TarMaker::new().file("existing/x", b"x").finish(),
            TarMaker::new().symlink("new", out).file("new/x", b"x").finish(),
            TarMaker::new().dir("existing").finish(),
            TarMaker::new().file("../outside/x", b"x").finish(),
            TarMaker::new().file("/abs", b"x").finish(),
        ];
        for tar in bad {
            assert!(extract_files(&tar[..], false, &dest, OWNER, None).is_err());
        }
        let tar = TarMaker::new().file("file-link", b"replaced").finish();
        extract_files(&tar[..], false, &dest, OWNER, None).unwrap();
        assert_eq!(std::fs::read(dest.join("file-link")).unwrap(), b"replaced");
        assert_eq!(std::fs::read(outside.join("t")).unwrap(), b"keep");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
    }
}
