//! [`LocalDir`]: blobs as files under one directory, the embedded default.
//!
//! The blob `files/ab12` is the file `<root>/files/ab12`, so the store can be inspected and
//! cleaned with ordinary tools. Every write goes to a temporary file in the destination's
//! directory, is fsynced, and is then renamed into place (and the directory fsynced): rename
//! is atomic within a file system, so readers — in this process or in any other process on
//! the host that shares the root — see the old blob or the new one, never a partial one, and
//! concurrent writers of one key simply race to the last rename. Temporary names contain `~`,
//! which keys may not, so they never collide with a blob.
//!
//! The work is blocking file I/O, so each operation runs on tokio's blocking pool.

use std::fs::File;
use std::io::{self, ErrorKind, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use super::{blocking, BlobError, BlobStore, Key, TempFile};

/// A blob store in a local directory. See the [module documentation](self).
#[derive(Clone, Debug)]
pub struct LocalDir {
    root: PathBuf,
}

impl LocalDir {
    /// Opens (creating if missing) the store rooted at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Result<Self, BlobError> {
        let root = root.into();
        std::fs::create_dir_all(&root)
            .map_err(|e| BlobError::io(format!("creating blob directory {}", root.display()), e))?;
        // Layers, build files and hibernated sandboxes' files are tenants' data: only the
        // services (root) may enter, whatever mode each file below has.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| BlobError::io(format!("closing blob directory {}", root.display()), e))?;
        Ok(LocalDir { root })
    }

    /// The directory the blobs live in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file that holds (or would hold) the blob `key`.
    pub fn path_of(&self, key: &Key) -> PathBuf {
        self.root.join(key.as_str())
    }

    /// Writes a blob atomically: `fill` writes the content into the temporary file.
    fn write_atomically(dest: &Path, fill: impl FnOnce(&mut File) -> io::Result<()>) -> Result<(), BlobError> {
        let (mut file, tmp) = TempFile::beside(dest)?;
        fill(&mut file)
            .and_then(|()| file.sync_all())
            .map_err(|e| BlobError::io(format!("writing {}", tmp.path().display()), e))?;
        drop(file);
        tmp.commit(dest)
    }
}

/// Whether an error opening `<root>/<key>` means "there is no such blob": the file is
/// missing, a path component is a file (`a` exists, `a/b` is asked for), or the key names a
/// directory of other blobs (`layers`).
fn is_absent(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::NotFound | ErrorKind::NotADirectory | ErrorKind::IsADirectory
    )
}

impl BlobStore for LocalDir {
    fn put_file<'a>(&'a self, key: &'a Key, path: &'a Path) -> BoxFuture<'a, Result<(), BlobError>> {
        let dest = self.path_of(key);
        let src = path.to_path_buf();
        blocking(move || {
            let mut input = File::open(&src).map_err(|e| BlobError::io(format!("opening {}", src.display()), e))?;
            // io::copy between files uses copy_file_range/sendfile: no user-space buffer.
            Self::write_atomically(&dest, |out| io::copy(&mut input, out).map(drop))
        })
        .boxed()
    }

    fn put_bytes<'a>(&'a self, key: &'a Key, data: Bytes) -> BoxFuture<'a, Result<(), BlobError>> {
        let dest = self.path_of(key);
        blocking(move || Self::write_atomically(&dest, |out| out.write_all(&data))).boxed()
    }

    fn get_to_file<'a>(&'a self, key: &'a Key, path: &'a Path) -> BoxFuture<'a, Result<u64, BlobError>> {
        let src = self.path_of(key);
        let dest = path.to_path_buf();
        let key = key.clone();
        blocking(move || {
            let mut input = match File::open(&src) {
                Ok(f) if f.metadata().is_ok_and(|m| m.is_dir()) => return Err(BlobError::NotFound(key)),
                Ok(f) => f,
                Err(e) if is_absent(&e) => return Err(BlobError::NotFound(key)),
                Err(e) => return Err(BlobError::io(format!("opening {}", src.display()), e)),
            };
            let mut size = 0;
            Self::write_atomically(&dest, |out| {
                size = io::copy(&mut input, out)?;
                Ok(())
            })?;
            Ok(size)
        })
        .boxed()
    }

    fn get_bytes<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Bytes, BlobError>> {
        let src = self.path_of(key);
        let key = key.clone();
        blocking(move || match std::fs::read(&src) {
            Ok(data) => Ok(Bytes::from(data)),
            Err(e) if is_absent(&e) => Err(BlobError::NotFound(key)),
            Err(e) => Err(BlobError::io(format!("reading {}", src.display()), e)),
        })
        .boxed()
    }

    fn exists<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<u64>, BlobError>> {
        let src = self.path_of(key);
        blocking(move || match std::fs::metadata(&src) {
            Ok(m) if m.is_file() => Ok(Some(m.len())),
            Ok(_) => Ok(None),
            Err(e) if is_absent(&e) => Ok(None),
            Err(e) => Err(BlobError::io(format!("inspecting {}", src.display()), e)),
        })
        .boxed()
    }

    fn delete<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<(), BlobError>> {
        let src = self.path_of(key);
        // Empty parent directories are left behind on purpose: removing them would race with
        // another process creating a blob beside this one.
        blocking(move || match std::fs::remove_file(&src) {
            Ok(()) => Ok(()),
            Err(e) if is_absent(&e) => Ok(()),
            Err(e) => Err(BlobError::io(format!("deleting {}", src.display()), e)),
        })
        .boxed()
    }

    fn describe(&self) -> String {
        format!("local dir {}", self.root.display())
    }
}
