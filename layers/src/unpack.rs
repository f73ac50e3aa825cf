//! Applying an OCI layer blob to a directory that will serve as an overlayfs lowerdir.
//!
//! Every layer of an image is unpacked into its own fresh directory and overlayfs stacks them,
//! so a layer's whiteouts are not *applied* here but *recorded* in overlay form:
//!
//! * `dir/.wh.NAME` becomes a character device 0/0 at `dir/NAME`, which hides `NAME` of lower
//!   layers;
//! * `dir/.wh..wh..opq` sets `trusted.overlay.opaque=y` on `dir`, which hides all of its lower
//!   content.
//!
//! Regular files, directories, symlinks, hard links and fifos are created with their modes,
//! mtimes, ids shifted into the sandbox range and the PAX xattrs `user.*`. What would raise
//! privileges is dropped: set-uid and set-gid bits (the sticky bit stays) and file capabilities
//! (`security.capability`). Inside a sandbox they would do nothing (its root is mounted nosuid
//! and its processes run with no_new_privs); on the host, a layer cache holding a set-uid or
//! capable binary is one path check away from a local root. Other devices cannot be useful in
//! an unprivileged sandbox and are skipped. Path safety (no escapes, never writing through a
//! symlink, hard links only to earlier files) comes from the `safefs` module.
//!
//! The input is read to its end, so a [`crate::DigestReader`] around it sees the whole blob.

use std::ffi::{OsStr, OsString};
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
use ruzstd::decoding::{BlockDecodingStrategy, FrameDecoder};
use tar::EntryType;

use crate::safefs::{self, normalise, Attrs, Policy, SafeFsError, Tree, Xattrs};
use crate::ID_RANGE;

/// Errors of layer unpacking.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// Reading or decompressing the blob failed, or the tar stream is malformed.
    #[error("reading the archive: {0}")]
    Read(#[from] io::Error),
    /// An entry was unsafe or could not be created.
    #[error(transparent)]
    Fs(#[from] SafeFsError),
    /// A uid or gid is outside the range a sandbox maps.
    #[error("{path}: id {id} is outside 0..{ID_RANGE}")]
    IdOutOfRange { path: String, id: u64 },
    /// An entry type this format does not support.
    #[error("{path}: unsupported tar entry type {kind:?}")]
    Unsupported { path: String, kind: EntryType },
}

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The compression of a layer media type, or `None` if it is not a known layer type.
    pub fn from_media_type(media_type: &str) -> Option<Compression> {
        let oci = media_type
            .strip_prefix("application/vnd.oci.image.layer.v1.")
            .or_else(|| media_type.strip_prefix("application/vnd.oci.image.layer.nondistributable.v1."));
        match (oci, media_type) {
            (Some("tar"), _) => Some(Compression::None),
            (Some("tar+gzip"), _) | (None, "application/vnd.docker.image.rootfs.diff.tar.gzip") => {
                Some(Compression::Gzip)
            }
            (Some("tar+zstd"), _) => Some(Compression::Zstd),
            _ => None,
        }
    }
}

/// What an unpack did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UnpackStats {
    /// Archive entries processed (including whiteouts and skipped ones).
    pub entries: u64,
    /// Bytes of regular file content written.
    pub bytes: u64,
    /// Block and character devices (other than whiteouts) left out.
    pub skipped_devices: u64,
}

/// Unpacks one layer blob into `dest` (an existing, normally empty directory) in overlay form,
/// with tar ids `N` stored as host ids `shift + N`.
pub fn unpack_layer(
    reader: impl Read,
    media: Compression,
    dest: &Path,
    shift: u32,
) -> Result<UnpackStats, UnpackError> {
    unpack_layer_within(reader, media, dest, shift, u64::MAX)
}

/// [`unpack_layer`], failing once the uncompressed archive passes `max_bytes`: a few
/// compressed megabytes can inflate to terabytes (a decompression bomb), and a layer is
/// untrusted input written to the host's disk.
pub fn unpack_layer_within(
    reader: impl Read,
    media: Compression,
    dest: &Path,
    shift: u32,
    max_bytes: u64,
) -> Result<UnpackStats, UnpackError> {
    match media {
        Compression::None => unpack_tar(Bounded::new(reader, max_bytes), dest, shift),
        Compression::Gzip => unpack_tar(
            Bounded::new(flate2::read::MultiGzDecoder::new(reader), max_bytes),
            dest,
            shift,
        ),
        Compression::Zstd => unpack_tar(Bounded::new(ZstdReader::new(reader), max_bytes), dest, shift),
    }
}

/// A reader that fails once more than its bound has been read through it.
pub(crate) struct Bounded<R> {
    inner: R,
    left: u64,
    bound: u64,
}

impl<R> Bounded<R> {
    pub(crate) fn new(inner: R, bound: u64) -> Self {
        Self {
            inner,
            left: bound,
            bound,
        }
    }
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        match self.left.checked_sub(n as u64) {
            Some(left) => {
                self.left = left;
                Ok(n)
            }
            None => Err(io::Error::other(format!(
                "the layer unpacks to more than {} bytes",
                self.bound
            ))),
        }
    }
}

/// The rules by which an archive's entries become files: the two kinds of archive a node
/// applies, through the one path below.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rules {
    /// An OCI image layer: tar ids `N` become host ids `shift + N` (ids outside
    /// [`ID_RANGE`] are refused), set-uid and set-gid bits are dropped, and every `.wh.` entry
    /// is a whiteout.
    Layer { shift: u32 },
    /// A sandbox's own files (a move's snapshot, a hibernation's archive): ids are host ids
    /// already and stay as archived, a tenant's modes come back as they left, except that no
    /// file owned by host root keeps a set-id bit (a sandbox's root is never host root, so
    /// such a file was crafted); an entry carrying the PAX record [`LITERAL_RECORD`] is the
    /// tenant's own file whatever its name, and regular files keep their holes.
    Snapshot,
}

/// The PAX record that marks an entry named like a whiteout (`.wh.…`) as a tenant's own file:
/// a tenant may name a file anything, and `/etc/.wh.nsswitch.conf` must come back as a file,
/// not delete `/etc/nsswitch.conf`. Snapshots from before it carry no user file of that name
/// unmarked on purpose, so an unmarked `.wh.` entry stays a whiteout.
pub const LITERAL_RECORD: &str = "SANDBOXSCHED.literal";

/// Applies an uncompressed tar stream to `dest` (an existing, normally empty directory) by
/// `rules`, in overlay form (whiteouts become overlayfs's marks), and reads the stream to its
/// end. Nothing is ever written through a symlink, outside `dest`, or with an attribute other
/// than `user.*`; device nodes are left out.
pub fn unpack_archive(reader: impl Read, dest: &Path, rules: Rules) -> Result<UnpackStats, UnpackError> {
    let implicit = match rules {
        Rules::Layer { shift } => (shift, shift, 0o755),
        // As a folder the node makes for itself.
        Rules::Snapshot => (0, 0, 0o755),
    };
    let mut tree = Tree::open(dest, Policy::Layer, implicit)?;
    let mut archive = tar::Archive::new(crate::headers::HeaderGuard::new(reader));
    let mut stats = UnpackStats::default();
    for entry in archive.entries()? {
        apply_entry(&mut tree, &mut entry?, rules, &mut stats)?;
    }
    tree.finish()?;
    io::copy(&mut archive.into_inner(), &mut io::sink())?;
    tracing::debug!(dest = %dest.display(), ?stats, ?rules, "unpacked archive");
    Ok(stats)
}

fn unpack_tar<R: Read>(reader: R, dest: &Path, shift: u32) -> Result<UnpackStats, UnpackError> {
    unpack_archive(reader, dest, Rules::Layer { shift })
}

fn map_id(id: u64, rules: Rules, comps: &[OsString]) -> Result<u32, UnpackError> {
    let host = u32::try_from(id).ok();
    match rules {
        Rules::Layer { shift } => host.filter(|&id| id < ID_RANGE).and_then(|id| shift.checked_add(id)),
        Rules::Snapshot => host,
    }
    .filter(|&host| host != u32::MAX)
    .ok_or_else(|| UnpackError::IdOutOfRange {
        path: safefs::show(comps),
        id,
    })
}

/// Mode bits that would make a file run as its owner or group.
const SET_UID: u32 = 0o4000;
const SET_GID: u32 = 0o2000;

/// What an entry's PAX records say: the xattrs worth keeping, `user.*` (file capabilities,
/// `trusted.*` and `security.*` are the host's business, never an archive's), and whether it
/// carries [`LITERAL_RECORD`].
fn pax_records<R: Read>(entry: &mut tar::Entry<'_, R>) -> io::Result<(Xattrs, bool)> {
    let (mut out, mut literal) = (Vec::new(), false);
    if let Some(exts) = entry.pax_extensions()? {
        for ext in exts {
            let ext = ext?;
            let Ok(key) = ext.key() else { continue };
            if key == LITERAL_RECORD {
                literal = true;
            }
            let Some(name) = key.strip_prefix("SCHILY.xattr.") else {
                continue;
            };
            if name.starts_with("user.") {
                out.push((name.to_string(), ext.value_bytes().to_vec()));
            }
        }
    }
    Ok((out, literal))
}

/// The mode an entry's file is given: a layer's loses its set-id bits; a snapshot's keeps
/// them unless host root would own the file (uid for set-uid, gid for set-gid).
fn mode_under(rules: Rules, mode: u32, uid: u32, gid: u32) -> u32 {
    let dropped = match rules {
        Rules::Layer { .. } => SET_UID | SET_GID,
        Rules::Snapshot => (if uid == 0 { SET_UID } else { 0 }) | (if gid == 0 { SET_GID } else { 0 }),
    };
    mode & !dropped
}

fn apply_entry<R: Read>(
    tree: &mut Tree,
    entry: &mut tar::Entry<'_, R>,
    rules: Rules,
    stats: &mut UnpackStats,
) -> Result<(), UnpackError> {
    let header = entry.header().clone();
    let kind = header.entry_type();
    if kind == EntryType::XGlobalHeader {
        return Ok(());
    }
    stats.entries += 1;
    if matches!(kind, EntryType::Char | EntryType::Block) {
        // No unprivileged sandbox can use one, and overlayfs's whiteouts travel as `.wh.`
        // names: any other device is left out, whatever it is named or claims.
        stats.skipped_devices += 1;
        return Ok(());
    }
    let comps = normalise(&entry.path_bytes())?;
    let (xattrs, literal) = pax_records(entry)?;

    if let Some((name, parent)) = comps.split_last().filter(|_| !literal) {
        let name = name.as_encoded_bytes();
        if name == b".wh..wh..opq" {
            return Ok(tree.set_opaque(parent)?);
        }
        let aufs =
            matches!(rules, Rules::Layer { .. }) && comps.iter().any(|c| c.as_encoded_bytes().starts_with(b".wh..wh."));
        if aufs {
            tracing::debug!(path = %safefs::show(&comps), "ignoring aufs metadata entry");
            return Ok(());
        }
        if let Some(hidden) = name.strip_prefix(b".wh.") {
            if matches!(hidden, b"" | b"." | b"..") {
                return Err(SafeFsError::InvalidPath(safefs::show(&comps)).into());
            }
            let mut target = parent.to_vec();
            target.push(OsStr::from_bytes(hidden).to_owned());
            // A mark carries no file: an owner or time left blank (as snapshots before
            // these rules wrote their marks) is root's and the epoch.
            let uid = map_id(header.uid().unwrap_or(0), rules, &comps)?;
            let gid = map_id(header.gid().unwrap_or(0), rules, &comps)?;
            let mtime = i64::try_from(header.mtime().unwrap_or(0)).unwrap_or(i64::MAX);
            return Ok(tree.make_whiteout(&target, uid, gid, mtime)?);
        }
    }

    let uid = map_id(header.uid()?, rules, &comps)?;
    let gid = map_id(header.gid()?, rules, &comps)?;
    let mtime = i64::try_from(header.mtime()?).unwrap_or(i64::MAX);

    let attrs = Attrs {
        uid,
        gid,
        mode: mode_under(rules, header.mode()?, uid, gid),
        mtime,
        xattrs,
    };
    // The link name, including GNU long link names and PAX `linkpath`.
    let link = |entry: &tar::Entry<'_, R>| {
        let link = entry.link_name_bytes().map(|l| l.into_owned());
        link.ok_or_else(|| SafeFsError::InvalidPath(safefs::show(&comps)))
    };
    match kind {
        // A snapshot's sparse file keeps its holes (a tenant's `truncate -s 8G` moves as a few
        // KiB); a layer's is written whole, as its image describes it.
        EntryType::GNUSparse if rules == Rules::Snapshot => {
            // The tar reader alone knows the sparse map (its `Read` hands holes over as
            // zeros, gigabytes of them): it writes the file, seeking over the holes, at a path
            // that reaches the parent through its descriptor.
            stats.bytes += tree.make_file_by(&comps, &attrs, &mut |path| match entry.unpack(path)? {
                tar::Unpacked::File(file) => Ok(file),
                _ => Err(io::Error::other("a sparse entry unpacked as no file")),
            })?;
        }
        EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
            stats.bytes += tree.make_file(&comps, &attrs, entry)?;
        }
        EntryType::Directory => tree.make_dir(&comps, &attrs)?,
        EntryType::Symlink => tree.make_symlink(&comps, &link(entry)?, &attrs)?,
        EntryType::Link => tree.make_hardlink(&comps, &normalise(&link(entry)?)?)?,
        EntryType::Fifo => tree.make_fifo(&comps, &attrs)?,
        kind => {
            return Err(UnpackError::Unsupported {
                path: safefs::show(&comps),
                kind,
            })
        }
    }
    Ok(())
}

/// A zstd decoder for streams of several frames (as zstd:chunked produces), skipping
/// skippable frames.
struct ZstdReader<R: Read> {
    src: BufReader<R>,
    frame: FrameDecoder,
    in_frame: bool,
}

impl<R: Read> ZstdReader<R> {
    fn new(src: R) -> Self {
        ZstdReader {
            src: BufReader::new(src),
            frame: FrameDecoder::new(),
            in_frame: false,
        }
    }
}

impl<R: Read> Read for ZstdReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if self.in_frame {
                while self.frame.can_collect() == 0 && !self.frame.is_finished() {
                    self.frame
                        .decode_blocks(&mut self.src, BlockDecodingStrategy::UptoBlocks(1))
                        .map_err(io::Error::other)?;
                }
                let n = self.frame.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                self.in_frame = false;
            }
            if self.src.fill_buf()?.is_empty() {
                return Ok(0);
            }
            match self.frame.reset(&mut self.src) {
                Ok(()) => self.in_frame = true,
                Err(FrameDecoderError::ReadFrameHeaderError(ReadFrameHeaderError::SkipFrame { length, .. })) => {
                    let skipped = io::copy(&mut (&mut self.src).take(length.into()), &mut io::sink())?;
                    if skipped != u64::from(length) {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                }
                Err(e) => return Err(io::Error::other(e)),
            }
        }
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;

    #[test]
    fn a_layer_that_inflates_past_the_bound_is_refused() {
        let mut tar = tar::Builder::new(Vec::new());
        let data = vec![0u8; 1 << 20];
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        header.set_cksum();
        tar.append_data(&mut header, "zeros", data.as_slice()).unwrap();
        let plain = tar.into_inner().unwrap();
        let dest = std::env::temp_dir().join(format!("bounded-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dest);
        std::fs::create_dir_all(&dest).unwrap();
        let refused = unpack_layer_within(plain.as_slice(), Compression::None, &dest, 100_000, 64 << 10);
        assert!(refused.is_err(), "1 MiB through a 64 KiB bound");
        let _ = std::fs::remove_dir_all(&dest);
        std::fs::create_dir_all(&dest).unwrap();
        assert!(unpack_layer_within(plain.as_slice(), Compression::None, &dest, 100_000, 4 << 20).is_ok());
        std::fs::remove_dir_all(&dest).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{gzip, meta, xattr, Scratch, TarMaker};
    use crate::{Digest, DigestReader};
    use std::os::unix::fs::MetadataExt;

    const SHIFT: u32 = 100_000;
    /// A valid VFS_CAP_REVISION_2 xattr granting cap_net_raw (permitted + effective).
    const CAP: &[u8] = &[1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

    fn unpack(tar: &[u8], dest: &Path) -> Result<UnpackStats, UnpackError> {
        unpack_layer(tar, Compression::None, dest, SHIFT)
    }

    fn sample() -> Vec<u8> {
        let xattrs: &[(&str, &[u8])] = &[
            ("SCHILY.xattr.user.note", b"hi"),
            ("SCHILY.xattr.trusted.evil", b"x"),
            ("SCHILY.xattr.security.capability", CAP),
        ];
        TarMaker::new()
            .dir("etc")
            .custom(EntryType::Regular, "etc/passwd", b"root:x:0:0", xattrs, |h| {
                h.set_mode(0o4755);
                h.set_uid(1000);
                h.set_gid(1001);
            })
            .symlink("etc/link", "passwd")
            .hardlink("etc/hard", "./etc/passwd")
            .raw(EntryType::Fifo, "run/fifo", "", 0o600, b"")
            .custom(EntryType::Char, "dev/null", b"", &[], |h| {
                h.set_device_major(1).unwrap();
                h.set_device_minor(3).unwrap();
            })
            .file("etc/.wh.old", b"")
            .dir("var")
            .file("var/.wh..wh..opq", b"")
            .file(".wh..wh.plnk/1.2", b"aufs")
            .file("./usr/bin/tool", b"#!")
            .finish()
    }

    #[test]
    fn unpacks_into_overlay_form() {
        let s = Scratch::new("unpack");
        let d = s.path();
        let stats = unpack(&sample(), d).unwrap();
        assert_eq!(
            stats,
            UnpackStats {
                entries: 11,
                bytes: 12,
                skipped_devices: 1
            }
        );

        assert_eq!(
            meta(&d.join("etc/passwd")),
            (0o100755, SHIFT + 1000, SHIFT + 1001),
            "no set-uid bit"
        );
        assert_eq!(std::fs::read(d.join("etc/passwd")).unwrap(), b"root:x:0:0");
        assert_eq!(xattr(&d.join("etc/passwd"), "user.note").as_deref(), Some(&b"hi"[..]));
        assert_eq!(
            xattr(&d.join("etc/passwd"), "security.capability"),
            None,
            "no file capabilities"
        );
        assert_eq!(xattr(&d.join("etc/passwd"), "trusted.evil"), None);
        assert_eq!(std::fs::read_link(d.join("etc/link")).unwrap(), Path::new("passwd"));
        let ino = |p: &str| std::fs::symlink_metadata(d.join(p)).unwrap().ino();
        assert_eq!(ino("etc/hard"), ino("etc/passwd"));
        assert_eq!(meta(&d.join("run/fifo")).0, 0o010600);
        assert_eq!(meta(&d.join("run")), (0o040755, SHIFT, SHIFT));
        assert!(!d.join("dev/null").exists());
        let wh = std::fs::symlink_metadata(d.join("etc/old")).unwrap();
        assert_eq!((wh.mode() & 0o170000, wh.rdev()), (0o020000, 0));
        assert!(!d.join("etc/.wh.old").exists() && !d.join(".wh..wh.plnk").exists());
        assert_eq!(
            xattr(&d.join("var"), "trusted.overlay.opaque").as_deref(),
            Some(&b"y"[..])
        );
        assert!(d.join("usr/bin/tool").is_file());
        assert_eq!(std::fs::metadata(d.join("etc")).unwrap().mtime(), 1_600_000_000);
    }

    #[test]
    fn symlink_escapes_write_nothing_outside() {
        let s = Scratch::new("unpack-symlink");
        let outside = s.sub("outside");
        for (link, target) in [("a", outside.to_str().unwrap()), ("b", "../outside"), ("c", ".")] {
            let dest = s.sub(&format!("dest-{link}"));
            let tar = TarMaker::new()
                .symlink(link, target)
                .file(&format!("{link}/passwd"), b"pwned")
                .finish();
            let err = unpack(&tar, &dest).unwrap_err();
            assert!(matches!(err, UnpackError::Fs(SafeFsError::NotADirectory(_))), "{err}");
        }
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    }

    #[test]
    fn hardlink_escapes_are_refused() {
        let s = Scratch::new("unpack-hardlink");
        let outside = s.sub("outside");
        std::fs::write(outside.join("secret"), b"s").unwrap();
        let abs = outside.join("secret");
        let cases: Vec<Vec<u8>> = vec![
            TarMaker::new().hardlink("h", "../outside/secret").finish(),
            TarMaker::new().hardlink("h", abs.to_str().unwrap()).finish(),
            TarMaker::new()
                .symlink("s", outside.to_str().unwrap())
                .hardlink("h", "s/secret")
                .finish(),
            TarMaker::new()
                .symlink("s", abs.to_str().unwrap())
                .hardlink("h", "s")
                .finish(),
            TarMaker::new().hardlink("h", "later").file("later", b"x").finish(),
            TarMaker::new().dir("d").hardlink("h", "d").finish(),
            TarMaker::new().file("f", b"x").hardlink("f", "f").finish(),
        ];
        for (i, tar) in cases.iter().enumerate() {
            let dest = s.sub(&format!("dest-{i}"));
            assert!(unpack(tar, &dest).is_err(), "case {i} accepted");
            assert!(!dest.join("h").exists(), "case {i}");
        }
        assert_eq!(std::fs::metadata(&abs).unwrap().nlink(), 1);
    }

    #[test]
    fn path_escapes_are_refused() {
        let s = Scratch::new("unpack-escape");
        let dest = s.sub("dest");
        for path in [
            "../evil",
            "/tmp/evil",
            "a/../../evil",
            "./../evil",
            "x/.wh...",
            "x/.wh.",
        ] {
            let err = unpack(&TarMaker::new().file(path, b"x").finish(), &dest).unwrap_err();
            assert!(
                matches!(err, UnpackError::Fs(SafeFsError::InvalidPath(_))),
                "{path}: {err}"
            );
        }
        let names: Vec<_> = std::fs::read_dir(s.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["dest"]);
    }

    #[test]
    fn later_entries_replace_earlier_ones() {
        let s = Scratch::new("unpack-replace");
        let (dest, outside) = (s.sub("dest"), s.sub("outside"));
        std::fs::write(outside.join("t"), b"keep").unwrap();
        let tar = TarMaker::new()
            .file("d/sub/f", b"x")
            .file("d", b"file now")
            .file("m/one", b"1")
            .dir("m")
            .file("m/two", b"2")
            .symlink("s", outside.join("t").to_str().unwrap())
            .file("s", b"replaced")
            .finish();
        unpack(&tar, &dest).unwrap();
        assert_eq!(std::fs::read(dest.join("d")).unwrap(), b"file now");
        assert!(dest.join("m/one").exists() && dest.join("m/two").exists());
        assert!(std::fs::symlink_metadata(dest.join("s")).unwrap().is_file());
        assert_eq!(std::fs::read(outside.join("t")).unwrap(), b"keep");
    }

    #[test]
    fn ids_outside_the_range_are_refused() {
        let s = Scratch::new("unpack-ids");
        let tar = TarMaker::new()
            .custom(EntryType::Regular, "f", b"", &[], |h| h.set_uid(u64::from(ID_RANGE)))
            .finish();
        assert!(matches!(
            unpack(&tar, &s.sub("a")),
            Err(UnpackError::IdOutOfRange { id: 65536, .. })
        ));
        let tar = TarMaker::new()
            .custom(EntryType::Regular, "f", b"", &[], |h| h.set_gid(20))
            .finish();
        let err = unpack_layer(&tar[..], Compression::None, &s.sub("b"), u32::MAX - 10).unwrap_err();
        assert!(matches!(err, UnpackError::IdOutOfRange { id: 20, .. }), "{err}");
    }

    #[test]
    fn compressed_blobs_unpack_and_are_read_to_the_end() {
        let tar = sample();
        let gz = gzip(&tar);
        let (half1, half2) = tar.split_at(tar.len() / 2);
        let fastest = ruzstd::encoding::CompressionLevel::Fastest;
        let mut zst = ruzstd::encoding::compress_to_vec(half1, fastest);
        zst.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 9, 9, 9]); // skippable frame
        zst.extend(ruzstd::encoding::compress_to_vec(half2, fastest));
        let s = Scratch::new("unpack-compressed");
        for (blob, media) in [(&gz, Compression::Gzip), (&zst, Compression::Zstd)] {
            let mut reader = DigestReader::new(&blob[..]);
            let stats = unpack_layer(&mut reader, media, &s.sub(&format!("{media:?}")), SHIFT).unwrap();
            assert_eq!(stats.entries, 11);
            assert_eq!(reader.finish(), (Digest::of(blob), blob.len() as u64));
        }
        assert_eq!(std::fs::read(s.path().join("Zstd/etc/passwd")).unwrap(), b"root:x:0:0");
        assert!(unpack_layer(&gz[..gz.len() - 4], Compression::Gzip, &s.sub("cut"), SHIFT).is_err());
    }

    #[test]
    fn media_types() {
        let m = Compression::from_media_type;
        assert_eq!(m("application/vnd.oci.image.layer.v1.tar"), Some(Compression::None));
        assert_eq!(
            m("application/vnd.oci.image.layer.v1.tar+gzip"),
            Some(Compression::Gzip)
        );
        assert_eq!(
            m("application/vnd.oci.image.layer.v1.tar+zstd"),
            Some(Compression::Zstd)
        );
        assert_eq!(
            m("application/vnd.docker.image.rootfs.diff.tar.gzip"),
            Some(Compression::Gzip)
        );
        assert_eq!(m("application/vnd.oci.image.config.v1+json"), None);
    }
}
