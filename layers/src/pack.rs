//! Turning an overlayfs upper directory (the changes of one build step) into an OCI layer blob.
//!
//! The directory is walked through directory file descriptors without following symlinks (the
//! content was written by untrusted code, and reading through a planted symlink would copy host
//! files into the layer). Entries are emitted depth-first with names on disk sorted bytewise, so the
//! same tree always gives the same bytes and digests. Overlay form is translated to OCI form:
//!
//! * a character device 0/0 (whiteout) becomes an empty `.wh.NAME` file;
//! * a directory with `trusted.overlay.opaque=y` is followed by a `.wh..wh..opq` entry;
//! * `user.*` xattrs travel as PAX `SCHILY.xattr.*` records (other xattrs stay behind);
//! * regular files with several links inside the tree become tar hard links to the first path.
//!
//! Host ids are unshifted (`host - shift`); an id outside the sandbox range is an error naming
//! the file, since it cannot have been created from inside the sandbox. Other devices and
//! sockets are skipped. Upper directories using overlay's `redirect_dir` or `metacopy` features
//! are refused, as their meaning depends on lower layers.
//!
//! The tar stream is hashed (diff id), gzip compressed, and hashed again (blob digest) on its
//! way to the output, in one pass.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use flate2::write::GzEncoder;
use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, Stat};
use tar::{EntryType, Header};

use crate::digest::{Digest, DigestWriter};
use crate::safefs::{list_dir, open_dir, Xattrs, MAX_DEPTH, OPAQUE_XATTR};
use crate::ID_RANGE;

/// Errors of layer packing, each naming the path involved (relative to the packed directory).
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("{path}: {op}: {source}")]
    Io {
        path: String,
        op: &'static str,
        source: io::Error,
    },
    #[error("writing layer: {0}")]
    Write(io::Error),
    #[error("{path}: host id {id} is outside the sandbox range {shift}..{shift}+{ID_RANGE}")]
    IdOutOfRange { path: String, id: u32, shift: u32 },
    #[error("{path}: {what}")]
    Unsupported { path: String, what: &'static str },
    #[error("{0}: deeper than {MAX_DEPTH} levels")]
    TooDeep(String),
    #[error("{0}: changed while being packed")]
    Changed(String),
    #[error(
        "{path}: {holes} bytes of holes would make the layer {holes} bytes longer than what its files hold (a layer carries files whole; at most {MAX_HOLES} bytes of holes in a layer): remove the sparse file or make it dense"
    )]
    Sparse { path: String, holes: u64 },
}

/// Bytes of holes (a sparse file's unwritten ranges) a layer may carry as zeros. OCI layers
/// hold files whole, so a sandbox's `truncate -s 100G` would make a capture read, compress
/// and store 100 GiB of zeros while the sandbox is frozen: past this, a pack is refused.
pub const MAX_HOLES: u64 = 1 << 30;

/// A packed layer: what an image manifest and config need to reference it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedLayer {
    /// Digest of the gzip blob (the manifest's layer digest).
    pub digest: Digest,
    /// Digest of the uncompressed tar (the config's diff id).
    pub diff_id: Digest,
    /// Size of the gzip blob in bytes.
    pub size: u64,
}

type Tar<W> = tar::Builder<DigestWriter<GzEncoder<DigestWriter<W>>>>;

/// Packs the upper directory `src`, owned by ids shifted by `shift`, as a gzip layer blob into
/// `out`. Top-level names in `exclude` (e.g. `.sandboxsched`) are left out.
pub fn pack_layer<W: Write>(src: &Path, shift: u32, exclude: &[&str], out: W) -> Result<PackedLayer, PackError> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let root = rfs::openat(rfs::CWD, src, flags, Mode::empty()).map_err(|e| PackError::Io {
        path: src.display().to_string(),
        op: "open",
        source: e.into(),
    })?;
    let gz = GzEncoder::new(DigestWriter::new(out), flate2::Compression::default());
    let mut packer = Packer {
        tar: tar::Builder::new(DigestWriter::new(gz)),
        shift,
        links: HashMap::new(),
        holes: 0,
    };
    packer.walk(&root, b"", exclude, 0)?;
    let (diff_id, _, gz) = packer.tar.into_inner().map_err(PackError::Write)?.finish();
    let (digest, size, mut out) = gz.finish().map_err(PackError::Write)?.finish();
    out.flush().map_err(PackError::Write)?;
    tracing::debug!(src = %src.display(), %digest, %diff_id, size, "packed layer");
    Ok(PackedLayer { digest, diff_id, size })
}

struct Packer<W: Write> {
    tar: Tar<W>,
    shift: u32,
    /// (dev, ino) of multiply-linked regular files already written, with their tar path.
    links: HashMap<(u64, u64), Vec<u8>>,
    /// Bytes of holes written as zeros so far (see [`MAX_HOLES`]).
    holes: u64,
}

fn lossy(path: &[u8]) -> String {
    String::from_utf8_lossy(path).into_owned()
}

fn io_err<'a>(path: &'a [u8], op: &'static str) -> impl FnOnce(rustix::io::Errno) -> PackError + 'a {
    move |e| PackError::Io {
        path: lossy(path),
        op,
        source: e.into(),
    }
}

// Stat field widths differ between architectures.
#[allow(clippy::unnecessary_cast)]
fn inode(st: &Stat) -> (u64, u64, u64, u64) {
    (
        st.st_dev as u64,
        st.st_ino as u64,
        st.st_nlink as u64,
        st.st_size as u64,
    )
}

/// Reads exactly `left` bytes, failing if the file is shorter (the tar header promised them).
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let max = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        if max == 0 {
            return Ok(0);
        }
        let n = self.inner.read(&mut buf[..max])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file shrank while being packed",
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// The `user.*` xattrs of `fd`, and whether it is an opaque directory.
fn read_xattrs(fd: &OwnedFd, path: &[u8]) -> Result<(Xattrs, bool), PackError> {
    let mut names = vec![0u8; rfs::flistxattr_query(fd).map_err(io_err(path, "listxattr"))?];
    let len = rfs::flistxattr(fd, &mut names[..]).map_err(io_err(path, "listxattr"))?;
    let get = |name: &[u8]| -> Result<Vec<u8>, PackError> {
        let name = OsStr::from_bytes(name);
        let mut value = vec![0u8; rfs::fgetxattr_query(fd, name).map_err(io_err(path, "getxattr"))?];
        let len = rfs::fgetxattr(fd, name, &mut value[..]).map_err(io_err(path, "getxattr"))?;
        value.truncate(len);
        Ok(value)
    };
    let (mut user, mut opaque) = (Vec::new(), false);
    for name in names[..len].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        if name == OPAQUE_XATTR.as_bytes() {
            opaque = get(name)? == b"y";
        } else if name.starts_with(b"trusted.overlay.redirect") || name.starts_with(b"trusted.overlay.metacopy") {
            let what = "overlay redirect_dir/metacopy entries cannot be packed";
            return Err(PackError::Unsupported {
                path: lossy(path),
                what,
            });
        } else if name.starts_with(b"user.") {
            let what = "xattr name is not UTF-8";
            let key = std::str::from_utf8(name).map_err(|_| PackError::Unsupported {
                path: lossy(path),
                what,
            })?;
            user.push((key.to_string(), get(name)?));
        }
    }
    Ok((user, opaque))
}

impl<W: Write> Packer<W> {
    fn unshift(&self, host: u32, path: &[u8]) -> Result<u64, PackError> {
        match host.checked_sub(self.shift) {
            Some(id) if id < ID_RANGE => Ok(id.into()),
            _ => Err(PackError::IdOutOfRange {
                path: lossy(path),
                id: host,
                shift: self.shift,
            }),
        }
    }

    fn append(
        &mut self,
        h: &mut Header,
        path: &[u8],
        xattrs: &[(String, Vec<u8>)],
        data: impl Read,
    ) -> Result<(), PackError> {
        let pax: Vec<(String, &[u8])> = xattrs
            .iter()
            .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v.as_slice()))
            .collect();
        self.tar
            .append_pax_extensions(pax.iter().map(|(k, v)| (k.as_str(), *v)))
            .map_err(PackError::Write)?;
        self.tar
            .append_data(h, Path::new(OsStr::from_bytes(path)), data)
            .map_err(PackError::Write)
    }

    /// Appends a symlink or hard link with its target stored byte for byte.
    fn append_link(&mut self, h: &mut Header, path: &[u8], target: &[u8]) -> Result<(), PackError> {
        h.set_size(0);
        let slot = &mut h.as_old_mut().linkname;
        if target.len() <= slot.len() {
            slot[..target.len()].copy_from_slice(target);
            self.append(h, path, &[], io::empty())
        } else {
            let (path, target) = (Path::new(OsStr::from_bytes(path)), Path::new(OsStr::from_bytes(target)));
            self.tar.append_link(h, path, target).map_err(PackError::Write)
        }
    }

    fn walk(&mut self, dir: &OwnedFd, rel: &[u8], exclude: &[&str], depth: usize) -> Result<(), PackError> {
        if depth > MAX_DEPTH {
            return Err(PackError::TooDeep(lossy(rel)));
        }
        let mut names = list_dir(dir).map_err(io_err(rel, "readdir"))?;
        names.sort();
        for name in names {
            if depth == 0 && exclude.iter().any(|e| OsStr::new(e) == name) {
                continue;
            }
            self.entry(dir, rel, &name, exclude, depth)?;
        }
        Ok(())
    }

    fn entry(
        &mut self,
        dir: &OwnedFd,
        rel: &[u8],
        name: &OsString,
        exclude: &[&str],
        depth: usize,
    ) -> Result<(), PackError> {
        let join = |name: &[u8]| [rel, if rel.is_empty() { b"" } else { b"/" }, name].concat();
        let path = join(name.as_bytes());
        let st = rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(io_err(&path, "stat"))?;
        let mut h = Header::new_gnu();
        h.set_mode(st.st_mode & 0o7777);
        // Overlay creates whiteouts with the mounter's ids; they carry no ownership worth keeping.
        let whiteout = FileType::from_raw_mode(st.st_mode) == FileType::CharacterDevice && st.st_rdev == 0;
        let (uid, gid) = match whiteout {
            true => (0, 0),
            false => (self.unshift(st.st_uid, &path)?, self.unshift(st.st_gid, &path)?),
        };
        h.set_uid(uid);
        h.set_gid(gid);
        h.set_mtime(st.st_mtime.max(0) as u64);
        h.set_size(0);
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                let fd = open_dir(dir, name).map_err(io_err(&path, "open"))?;
                let (xattrs, opaque) = read_xattrs(&fd, &path)?;
                h.set_entry_type(EntryType::Directory);
                self.append(&mut h, &path, &xattrs, io::empty())?;
                if opaque {
                    h.set_entry_type(EntryType::Regular);
                    h.set_mode(0o644);
                    self.append(&mut h, &[&path[..], b"/.wh..wh..opq"].concat(), &[], io::empty())?;
                }
                self.walk(&fd, &path, exclude, depth + 1)?;
            }
            FileType::RegularFile => {
                // NONBLOCK: should the name have been swapped for a fifo, do not hang on it.
                let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
                let fd = rfs::openat(dir, name, flags, Mode::empty()).map_err(io_err(&path, "open"))?;
                let fst = rfs::fstat(&fd).map_err(io_err(&path, "stat"))?;
                let (dev, ino, nlink, size) = inode(&fst);
                if (dev, ino) != (inode(&st).0, inode(&st).1)
                    || FileType::from_raw_mode(fst.st_mode) != FileType::RegularFile
                {
                    return Err(PackError::Changed(lossy(&path)));
                }
                let (xattrs, _) = read_xattrs(&fd, &path)?;
                if nlink > 1 {
                    if let Some(first) = self.links.get(&(dev, ino)).cloned() {
                        h.set_entry_type(EntryType::Link);
                        return self.append_link(&mut h, &path, &first);
                    }
                    self.links.insert((dev, ino), path.clone());
                }
                // Counted once per file, not per link to it.
                let allocated = u64::try_from(fst.st_blocks).unwrap_or(0).saturating_mul(512);
                self.holes += size.saturating_sub(allocated);
                if self.holes > MAX_HOLES {
                    return Err(PackError::Sparse {
                        path: lossy(&path),
                        holes: self.holes,
                    });
                }
                h.set_entry_type(EntryType::Regular);
                h.set_size(size);
                self.append(
                    &mut h,
                    &path,
                    &xattrs,
                    Exact {
                        inner: File::from(fd),
                        left: size,
                    },
                )?;
            }
            FileType::Symlink => {
                let target = rfs::readlinkat(dir, name, Vec::new()).map_err(io_err(&path, "readlink"))?;
                h.set_entry_type(EntryType::Symlink);
                self.append_link(&mut h, &path, target.as_bytes())?;
            }
            FileType::CharacterDevice if whiteout => {
                h.set_entry_type(EntryType::Regular);
                self.append(&mut h, &join(&[b".wh.", name.as_bytes()].concat()), &[], io::empty())?;
            }
            FileType::Fifo => {
                h.set_entry_type(EntryType::Fifo);
                self.append(&mut h, &path, &[], io::empty())?;
            }
            other => tracing::debug!(path = %lossy(&path), ?other, "not packing device or socket"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{list_tar, snapshot, Scratch};
    use crate::unpack::{unpack_layer, Compression};
    use std::os::unix::fs::{lchown, symlink, MetadataExt, PermissionsExt};

    const S: u32 = 100_000;

    fn setxattr(path: &Path, name: &str, value: &[u8]) {
        rustix::fs::lsetxattr(path, name, value, rustix::fs::XattrFlags::empty()).unwrap();
    }

    /// An upper directory with one of everything, owned by shifted ids.
    fn make_upper(src: &Path) {
        let p = |rel: &str| src.join(rel);
        for dir in ["bin", "opq", "run", "data", ".sandboxsched"] {
            std::fs::create_dir(p(dir)).unwrap();
        }
        std::fs::write(p("bin/tool"), b"tool").unwrap();
        std::fs::write(p("opq/new"), b"new").unwrap();
        std::fs::write(p(".sandboxsched/secret"), b"no").unwrap();
        std::fs::hard_link(p("bin/tool"), p("bin/tool2")).unwrap();
        symlink("/usr/bin/busybox", p("bin/sh")).unwrap();
        symlink("usr/lib", p("lib")).unwrap();
        symlink("x".repeat(150), p("long")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            p("run/pipe"),
            rustix::fs::FileType::Fifo,
            0o640.into(),
            0,
        )
        .unwrap();
        std::os::unix::net::UnixListener::bind(p("run/sock")).unwrap();
        for entry in [
            "bin", "bin/tool", "bin/sh", "lib", "long", "opq", "opq/new", "run", "run/pipe", "run/sock", "data",
        ] {
            lchown(p(entry), Some(S), Some(S)).unwrap();
        }
        lchown(p("bin/tool"), Some(S + 1000), Some(S + 1001)).unwrap();
        std::fs::set_permissions(p("bin/tool"), std::fs::Permissions::from_mode(0o2755)).unwrap();
        setxattr(&p("bin/tool"), "user.origin", b"build");
        setxattr(&p("data"), "user.kind", b"dir");
        setxattr(&p("opq"), "trusted.overlay.opaque", b"y");
        // A whiteout as overlayfs makes it: owned by the mounter (host root).
        let whiteout = rustix::fs::FileType::CharacterDevice;
        rustix::fs::mknodat(rustix::fs::CWD, p("gone"), whiteout, 0.into(), 0).unwrap();
    }

    fn gunzip(blob: &[u8]) -> Vec<u8> {
        let mut tar = Vec::new();
        flate2::read::GzDecoder::new(blob).read_to_end(&mut tar).unwrap();
        tar
    }

    #[test]
    fn round_trip_preserves_the_tree() {
        let s = Scratch::new("pack");
        let (src, dest) = (s.sub("src"), s.sub("dest"));
        make_upper(&src);
        let mut blob = Vec::new();
        let packed = pack_layer(&src, S, &[".sandboxsched"], &mut blob).unwrap();
        assert_eq!((packed.digest, packed.size), (Digest::of(&blob), blob.len() as u64));
        let tar = gunzip(&blob);
        assert_eq!(packed.diff_id, Digest::of(&tar));

        let listing = list_tar(&tar);
        let find = |path: &str| {
            listing
                .iter()
                .find(|(p, ..)| p == path)
                .map(|(_, uid, kind)| (*uid, *kind))
        };
        assert_eq!(find("bin/tool"), Some((1000, EntryType::Regular)));
        assert_eq!(find("bin/tool2"), Some((1000, EntryType::Link)));
        assert_eq!(find(".wh.gone"), Some((0, EntryType::Regular)));
        assert_eq!(find("opq/.wh..wh..opq").map(|f| f.1), Some(EntryType::Regular));
        assert!(listing
            .iter()
            .all(|(p, ..)| !p.starts_with(".sandboxsched") && p != "run/sock"));
        let order = [
            "bin",
            "bin/sh",
            "bin/tool",
            "bin/tool2",
            "data",
            ".wh.gone",
            "lib",
            "long",
            "opq",
        ];
        let paths: Vec<_> = listing.iter().map(|(p, ..)| p.as_str()).collect();
        assert_eq!(paths[..9], order, "depth first, sorted by name on disk");

        unpack_layer(&blob[..], Compression::Gzip, &dest, S).unwrap();
        let mut expected = snapshot(&src);
        expected.retain(|path, _| !path.starts_with(".sandboxsched") && path != "run/sock");
        // All of it but the set-gid bit of bin/tool (and its hard link), which unpacking drops.
        for path in ["bin/tool", "bin/tool2"] {
            let entry = expected.get_mut(path).unwrap();
            assert!(entry.starts_with("102755 "), "{entry}");
            entry.replace_range(..6, "100755");
        }
        assert_eq!(snapshot(&dest), expected);
        let ino = |p: &str| std::fs::metadata(dest.join(p)).unwrap().ino();
        assert_eq!(ino("bin/tool"), ino("bin/tool2"));

        let mut again = Vec::new();
        assert_eq!(pack_layer(&src, S, &[".sandboxsched"], &mut again).unwrap(), packed);
        assert_eq!(again, blob);
    }

    /// A sandbox's `truncate -s 100G` is refused by name (checked before its zeros are read);
    /// a little sparseness (below the bound, counted once per hard-linked file) packs.
    #[test]
    fn a_layer_of_mostly_holes_is_refused_by_name() {
        let s = Scratch::new("pack-holes");
        let src = s.sub("src");
        lchown(&src, Some(S), Some(S)).unwrap();
        let small = std::fs::File::create(src.join("small")).unwrap();
        small.set_len(MAX_HOLES / 8).unwrap();
        drop(small);
        lchown(src.join("small"), Some(S), Some(S)).unwrap();
        std::fs::hard_link(src.join("small"), src.join("small-again")).unwrap();
        pack_layer(&src, S, &[], io::sink()).expect("an eighth of the bound, linked twice, packs");
        let huge = std::fs::File::create(src.join("huge")).unwrap();
        huge.set_len(100 << 30).unwrap();
        drop(huge);
        lchown(src.join("huge"), Some(S), Some(S)).unwrap();
        let err = pack_layer(&src, S, &[], io::sink()).unwrap_err();
        assert!(
            matches!(&err, PackError::Sparse { path, .. } if path == "huge"),
            "{err}"
        );
    }

    #[test]
    fn ids_outside_the_sandbox_range_name_the_path() {
        let s = Scratch::new("pack-ids");
        let src = s.sub("src");
        std::fs::create_dir(src.join("d")).unwrap();
        lchown(src.join("d"), Some(S), Some(S)).unwrap();
        std::fs::write(src.join("d/host-owned"), b"").unwrap();
        let err = pack_layer(&src, S, &[], io::sink()).unwrap_err();
        assert!(
            matches!(&err, PackError::IdOutOfRange { path, id: 0, .. } if path == "d/host-owned"),
            "{err}"
        );
        lchown(src.join("d/host-owned"), Some(S + ID_RANGE), Some(S)).unwrap();
        let err = pack_layer(&src, S, &[], io::sink()).unwrap_err();
        assert!(err.to_string().contains("d/host-owned"), "{err}");
    }

    #[test]
    fn excludes_only_top_level_names() {
        let s = Scratch::new("pack-exclude");
        let src = s.sub("src");
        for dir in [".sandboxsched", "sub", "sub/.sandboxsched"] {
            std::fs::create_dir(src.join(dir)).unwrap();
            lchown(src.join(dir), Some(S), Some(S)).unwrap();
        }
        let mut blob = Vec::new();
        pack_layer(&src, S, &[".sandboxsched"], &mut blob).unwrap();
        let paths: Vec<_> = list_tar(&gunzip(&blob)).into_iter().map(|e| e.0).collect();
        assert_eq!(paths, ["sub", "sub/.sandboxsched"]);
    }
}
