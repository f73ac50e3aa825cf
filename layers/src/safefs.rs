//! Creating files from untrusted archives without ever following a symlink on disk.
//!
//! Checking a path with `symlink_metadata` and then writing to it by path is racy and easy to
//! get subtly wrong. Instead every operation here is relative to a directory file descriptor:
//! a path is walked one component at a time with `openat(O_DIRECTORY | O_NOFOLLOW)`, and the
//! final component is created with `mkdirat`/`openat(O_CREAT | O_EXCL)`/`symlinkat`/`mknodat`/
//! `linkat` in its parent. A symlink anywhere along the way (planted by an earlier entry of the
//! same archive, or by code in a running container) makes the walk fail instead of leading
//! outside the destination. Ownership, modes, xattrs and times are set through the new file's
//! own descriptor, or with `AT_SYMLINK_NOFOLLOW`.
//!
//! Archive paths are normalised first: `./` and empty components are dropped; absolute paths,
//! `..` components and paths deeper than [`MAX_DEPTH`] are refused.

use std::collections::{BTreeMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{self as rfs, AtFlags, FileType, Gid, Mode, OFlags, Timespec, Timestamps, Uid, XattrFlags};
use rustix::io::Errno;

/// Deepest path accepted. Bounds recursion and open descriptors when walking or removing trees.
pub(crate) const MAX_DEPTH: usize = 256;

/// The xattr that marks a directory opaque in an overlay lowerdir/upperdir.
pub(crate) const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// Errors of the safe extraction primitives, each naming the archive path involved.
#[derive(Debug, thiserror::Error)]
pub enum SafeFsError {
    #[error("invalid path {0:?}: absolute, containing `..` or NUL, or too deep")]
    InvalidPath(String),
    #[error("{0}: a parent is a symlink or not a directory")]
    NotADirectory(String),
    #[error("{path}: refusing to replace an existing {existing}")]
    Conflict { path: String, existing: &'static str },
    #[error("hard link {path} -> {target}: the target must be an earlier regular file or fifo of the archive")]
    BadLinkTarget { path: String, target: String },
    #[error("{path}: {op}: {source}")]
    Io {
        path: String,
        op: &'static str,
        source: io::Error,
    },
}

type Result<T> = std::result::Result<T, SafeFsError>;

/// Joins components for messages.
pub(crate) fn show(comps: &[OsString]) -> String {
    let parts: Vec<_> = comps.iter().map(|c| c.to_string_lossy()).collect();
    if parts.is_empty() {
        ".".to_string()
    } else {
        parts.join("/")
    }
}

fn io_err<'a>(comps: &'a [OsString], op: &'static str) -> impl FnOnce(Errno) -> SafeFsError + 'a {
    move |e| SafeFsError::Io {
        path: show(comps),
        op,
        source: e.into(),
    }
}

/// Splits an archive path into safe components; the empty list means the destination itself.
pub(crate) fn normalise(raw: &[u8]) -> Result<Vec<OsString>> {
    let bad = || SafeFsError::InvalidPath(String::from_utf8_lossy(raw).into_owned());
    if raw.first() == Some(&b'/') || raw.contains(&0) {
        return Err(bad());
    }
    let mut out = Vec::new();
    for c in raw.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(bad()),
            c => out.push(OsStr::from_bytes(c).to_owned()),
        }
    }
    if out.len() > MAX_DEPTH {
        return Err(bad());
    }
    Ok(out)
}

pub(crate) fn open_dir(dir: impl AsFd, name: &OsStr) -> rustix::io::Result<OwnedFd> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    rfs::openat(dir, name, flags, Mode::empty())
}

/// Names in a directory, without `.` and `..`.
pub(crate) fn list_dir(dir: impl AsFd) -> rustix::io::Result<Vec<OsString>> {
    let mut names = Vec::new();
    for entry in rfs::Dir::read_from(dir)? {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            names.push(OsString::from(OsStr::from_bytes(&name)));
        }
    }
    Ok(names)
}

/// Removes `name` in `dir`, recursively if it is a directory, never following symlinks.
fn remove_tree(dir: BorrowedFd<'_>, name: &OsStr) -> rustix::io::Result<()> {
    match rfs::unlinkat(dir, name, AtFlags::empty()) {
        Err(Errno::ISDIR) => {}
        other => return other,
    }
    let sub = open_dir(dir, name)?;
    for child in list_dir(&sub)? {
        remove_tree(sub.as_fd(), &child)?;
    }
    rfs::unlinkat(dir, name, AtFlags::REMOVEDIR)
}

fn times(mtime: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: mtime,
        tv_nsec: 0,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

fn ids(uid: u32, gid: u32) -> (Option<Uid>, Option<Gid>) {
    (Some(Uid::from_raw_unchecked(uid)), Some(Gid::from_raw_unchecked(gid)))
}

/// How an entry meets what is already at its path.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Policy {
    /// Layer semantics: anything in the way is replaced (a directory with its whole tree), an
    /// existing directory is merged into and takes the new entry's attributes.
    Layer,
    /// COPY semantics: files and symlinks are replaced, existing directories are merged into and
    /// left as they are, and a directory/non-directory clash is an error.
    Copy,
}

/// Extended attributes as (name, value) pairs.
pub(crate) type Xattrs = Vec<(String, Vec<u8>)>;

/// Metadata for a created entry. Ids are host ids.
pub(crate) struct Attrs {
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
    pub mtime: i64,
    pub xattrs: Xattrs,
}

/// A destination directory being filled from an archive.
pub(crate) struct Tree {
    root: OwnedFd,
    policy: Policy,
    /// (uid, gid, mode) of missing parent directories created on the way.
    implicit: (u32, u32, u32),
    /// Directory mtimes, set at the end because creating children changes them.
    dir_times: BTreeMap<Vec<OsString>, i64>,
    /// Paths created as regular files or fifos: the only valid hard link targets.
    linkable: HashSet<Vec<OsString>>,
}

impl Tree {
    pub fn open(dest: &Path, policy: Policy, implicit: (u32, u32, u32)) -> Result<Tree> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let root = rfs::openat(rfs::CWD, dest, flags, Mode::empty()).map_err(|e| SafeFsError::Io {
            path: dest.display().to_string(),
            op: "open destination",
            source: e.into(),
        })?;
        Ok(Tree {
            root,
            policy,
            implicit,
            dir_times: BTreeMap::new(),
            linkable: HashSet::new(),
        })
    }

    /// Opens the directory at `comps`, creating missing ones if `create`.
    fn walk(&self, comps: &[OsString], create: bool) -> Result<OwnedFd> {
        let mut fd = open_dir(&self.root, OsStr::new(".")).map_err(io_err(&[], "open"))?;
        for (i, name) in comps.iter().enumerate() {
            let here = &comps[..=i];
            fd = match open_dir(&fd, name) {
                Ok(next) => next,
                Err(Errno::NOENT) if create => {
                    rfs::mkdirat(&fd, name, Mode::from_raw_mode(0o700)).map_err(io_err(here, "mkdir"))?;
                    let next = open_dir(&fd, name).map_err(io_err(here, "open"))?;
                    let (uid, gid, mode) = self.implicit;
                    let (u, g) = ids(uid, gid);
                    rfs::fchown(&next, u, g).map_err(io_err(here, "chown"))?;
                    rfs::fchmod(&next, Mode::from_raw_mode(mode)).map_err(io_err(here, "chmod"))?;
                    next
                }
                Err(Errno::NOTDIR | Errno::LOOP) => return Err(SafeFsError::NotADirectory(show(here))),
                Err(e) => return Err(io_err(here, "open")(e)),
            };
        }
        Ok(fd)
    }

    /// Opens (creating if needed) the parent of `comps` and returns it with the final name.
    fn parent<'a>(&self, comps: &'a [OsString]) -> Result<(OwnedFd, &'a OsStr)> {
        let (name, parent) = comps.split_last().ok_or_else(|| SafeFsError::InvalidPath(".".into()))?;
        Ok((self.walk(parent, true)?, name.as_os_str()))
    }

    /// Makes room for `comps` in `dir`; returns true if an existing directory is kept.
    fn clear(&mut self, dir: &OwnedFd, name: &OsStr, comps: &[OsString], want_dir: bool) -> Result<bool> {
        let st = match rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(false),
            Err(e) => return Err(io_err(comps, "stat")(e)),
        };
        self.linkable.remove(comps);
        let is_dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
        if is_dir && want_dir {
            return Ok(true);
        }
        if is_dir != want_dir && self.policy == Policy::Copy {
            let existing = if is_dir { "directory" } else { "non-directory" };
            return Err(SafeFsError::Conflict {
                path: show(comps),
                existing,
            });
        }
        remove_tree(dir.as_fd(), name).map_err(io_err(comps, "remove"))?;
        Ok(false)
    }

    fn apply(&self, fd: BorrowedFd<'_>, a: &Attrs, comps: &[OsString]) -> Result<()> {
        let (u, g) = ids(a.uid, a.gid);
        // chown clears setuid/setgid and security.capability, so it goes first.
        rfs::fchown(fd, u, g).map_err(io_err(comps, "chown"))?;
        rfs::fchmod(fd, Mode::from_raw_mode(a.mode & 0o7777)).map_err(io_err(comps, "chmod"))?;
        for (name, value) in &a.xattrs {
            rfs::fsetxattr(fd, name.as_str(), value, XattrFlags::empty()).map_err(io_err(comps, "setxattr"))?;
        }
        Ok(())
    }

    pub fn make_dir(&mut self, comps: &[OsString], a: &Attrs) -> Result<()> {
        if comps.is_empty() {
            return Ok(()); // the destination itself belongs to the caller
        }
        let (dir, name) = self.parent(comps)?;
        let kept = self.clear(&dir, name, comps, true)?;
        if kept && self.policy == Policy::Copy {
            return Ok(());
        }
        if !kept {
            rfs::mkdirat(&dir, name, Mode::from_raw_mode(0o700)).map_err(io_err(comps, "mkdir"))?;
        }
        let fd = open_dir(&dir, name).map_err(io_err(comps, "open"))?;
        self.apply(fd.as_fd(), a, comps)?;
        self.dir_times.insert(comps.to_vec(), a.mtime);
        Ok(())
    }

    /// Creates a regular file with the contents of `data`; returns the bytes written.
    pub fn make_file(&mut self, comps: &[OsString], a: &Attrs, data: &mut dyn Read) -> Result<u64> {
        let (dir, name) = self.parent(comps)?;
        self.clear(&dir, name, comps, false)?;
        let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rfs::openat(&dir, name, flags, Mode::from_raw_mode(0o600)).map_err(io_err(comps, "create"))?;
        let mut file = File::from(fd);
        let written = io::copy(data, &mut file).map_err(|source| SafeFsError::Io {
            path: show(comps),
            op: "copy contents",
            source,
        })?;
        self.finish_file(file, a, comps)?;
        Ok(written)
    }

    /// Creates a regular file by `write`, which is handed a path to create it at (and must
    /// create it new, as `O_CREAT | O_EXCL` does, which follows no symlink) and returns the
    /// file; returns its length. The path reaches the parent through the descriptor this
    /// walk opened (`/proc/self/fd/N/NAME`), so nothing along it is resolved again: for a
    /// writer that only works by path (the tar reader's sparse unpacking).
    pub fn make_file_by(
        &mut self,
        comps: &[OsString],
        a: &Attrs,
        write: &mut dyn FnMut(&Path) -> io::Result<File>,
    ) -> Result<u64> {
        let (dir, name) = self.parent(comps)?;
        self.clear(&dir, name, comps, false)?;
        let mut path = std::path::PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
        path.push(name);
        let file = write(&path).map_err(|source| SafeFsError::Io {
            path: show(comps),
            op: "write contents",
            source,
        })?;
        let st = rfs::fstat(&file).map_err(io_err(comps, "stat"))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(io_err(comps, "create")(Errno::INVAL));
        }
        self.finish_file(file, a, comps)?;
        Ok(st.st_size as u64)
    }

    /// Gives a new regular file its attributes and times, and lets later hard links name it.
    fn finish_file(&mut self, file: File, a: &Attrs, comps: &[OsString]) -> Result<()> {
        self.apply(file.as_fd(), a, comps)?;
        rfs::futimens(&file, &times(a.mtime)).map_err(io_err(comps, "utimens"))?;
        self.linkable.insert(comps.to_vec());
        Ok(())
    }

    /// Creates a symlink. The target is stored verbatim and never resolved here.
    pub fn make_symlink(&mut self, comps: &[OsString], target: &[u8], a: &Attrs) -> Result<()> {
        if target.is_empty() || target.contains(&0) {
            return Err(SafeFsError::InvalidPath(format!(
                "{} -> {:?}",
                show(comps),
                String::from_utf8_lossy(target)
            )));
        }
        let (dir, name) = self.parent(comps)?;
        self.clear(&dir, name, comps, false)?;
        rfs::symlinkat(OsStr::from_bytes(target), &dir, name).map_err(io_err(comps, "symlink"))?;
        let (u, g) = ids(a.uid, a.gid);
        rfs::chownat(&dir, name, u, g, AtFlags::SYMLINK_NOFOLLOW).map_err(io_err(comps, "chown"))?;
        rfs::utimensat(&dir, name, &times(a.mtime), AtFlags::SYMLINK_NOFOLLOW).map_err(io_err(comps, "utimens"))
    }

    pub fn make_fifo(&mut self, comps: &[OsString], a: &Attrs) -> Result<()> {
        let (dir, name) = self.parent(comps)?;
        self.clear(&dir, name, comps, false)?;
        rfs::mknodat(&dir, name, FileType::Fifo, Mode::from_raw_mode(0o600), 0).map_err(io_err(comps, "mkfifo"))?;
        // A non-blocking read-only open of a fifo succeeds without a writer and gives us an fd
        // to set metadata through, without following anything.
        let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rfs::openat(&dir, name, flags, Mode::empty()).map_err(io_err(comps, "open"))?;
        let plain = Attrs {
            xattrs: Vec::new(),
            ..*a
        };
        self.apply(fd.as_fd(), &plain, comps)?;
        rfs::futimens(&fd, &times(a.mtime)).map_err(io_err(comps, "utimens"))?;
        self.linkable.insert(comps.to_vec());
        Ok(())
    }

    /// Creates an overlay whiteout: a character device 0/0.
    pub fn make_whiteout(&mut self, comps: &[OsString], uid: u32, gid: u32, mtime: i64) -> Result<()> {
        let (dir, name) = self.parent(comps)?;
        self.clear(&dir, name, comps, false)?;
        rfs::mknodat(&dir, name, FileType::CharacterDevice, Mode::empty(), 0).map_err(io_err(comps, "mknod"))?;
        let (u, g) = ids(uid, gid);
        rfs::chownat(&dir, name, u, g, AtFlags::SYMLINK_NOFOLLOW).map_err(io_err(comps, "chown"))?;
        rfs::utimensat(&dir, name, &times(mtime), AtFlags::SYMLINK_NOFOLLOW).map_err(io_err(comps, "utimens"))
    }

    /// Creates a hard link to an earlier regular file or fifo of this archive.
    pub fn make_hardlink(&mut self, comps: &[OsString], target: &[OsString]) -> Result<()> {
        let bad = || SafeFsError::BadLinkTarget {
            path: show(comps),
            target: show(target),
        };
        if comps == target || !self.linkable.contains(target) {
            return Err(bad());
        }
        let (tname, tparent) = target.split_last().ok_or_else(bad)?;
        let tdir = self.walk(tparent, false)?;
        let st = rfs::statat(&tdir, tname, AtFlags::SYMLINK_NOFOLLOW).map_err(io_err(target, "stat"))?;
        if !matches!(
            FileType::from_raw_mode(st.st_mode),
            FileType::RegularFile | FileType::Fifo
        ) {
            return Err(bad());
        }
        let (dir, name) = self.parent(comps)?;
        self.clear(&dir, name, comps, false)?;
        rfs::linkat(&tdir, tname, &dir, name, AtFlags::empty()).map_err(io_err(comps, "link"))?;
        self.linkable.insert(comps.to_vec());
        Ok(())
    }

    /// Marks the directory at `comps` (created if missing) opaque.
    pub fn set_opaque(&mut self, comps: &[OsString]) -> Result<()> {
        let fd = self.walk(comps, true)?;
        rfs::fsetxattr(&fd, OPAQUE_XATTR, b"y", XattrFlags::empty()).map_err(io_err(comps, "setxattr"))
    }

    /// Sets the recorded directory mtimes. Directories replaced since are skipped.
    pub fn finish(self) -> Result<()> {
        for (comps, mtime) in &self.dir_times {
            if let Ok(fd) = self.walk(comps, false) {
                rfs::futimens(&fd, &times(*mtime)).map_err(io_err(comps, "utimens"))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalise_accepts_relative_and_refuses_escapes() {
        let ok = |s: &str| {
            normalise(s.as_bytes())
                .unwrap()
                .iter()
                .map(|c| c.to_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(ok("./a//b/./c/"), ["a", "b", "c"]);
        assert_eq!(ok("./"), Vec::<String>::new());
        assert_eq!(ok("a..b/..c"), ["a..b", "..c"]);
        for bad in ["/etc/passwd", "../x", "a/../../x", "a/..", "a\0b"] {
            assert!(normalise(bad.as_bytes()).is_err(), "{bad:?} accepted");
        }
        assert!(normalise("a/".repeat(MAX_DEPTH + 1).as_bytes()).is_err());
    }
}
