//! Snapshot streaming: a sandbox's home as a tar archive cut into chunks, and back.
//!
//! Taking a snapshot archives the home folder (as `home/…`, symlinks kept as links) into a
//! [`ChunkWriter`], which sends fixed-size chunks down a bounded channel while hashing them;
//! the stream ends with the SHA-256 and length of everything sent. The channel's bound makes
//! a slow receiver slow the archiver down instead of buffering the whole home in memory.
//!
//! Restoring reads chunks from a channel through a [`ChunkReader`] (hashing as it goes),
//! unpacks them into a scratch folder, and compares what arrived with the trailer the sender
//! stated. Only a verified folder is installed as a sandbox; [`verify`] is that decision.
//!
//! A container's writable layer holds overlayfs's own marks: a deleted file of a lower layer
//! is a 0:0 character device, a directory that replaced a lower one carries the
//! `trusted.overlay.opaque` attribute. The archive carries them as OCI layers do, as empty
//! `.wh.NAME` and `.wh..wh..opq` entries, and unpacking turns them back into overlay marks,
//! so what was deleted inside a sandbox stays deleted where it is restored.
//!
//! Archiving and unpacking are blocking: they run on `spawn_blocking` threads and talk to the
//! async side through the channels.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::host::NodeError;

/// Size of snapshot data chunks.
const CHUNK: usize = 256 * 1024;
/// Chunks in flight between the archiver and the receiver.
const IN_FLIGHT: usize = 8;

/// A piece of a snapshot stream.
pub enum SnapshotPart {
    Data(Vec<u8>),
    End { sha256: String, bytes: u64 },
}

/// A piece of a restore stream.
pub enum RestoreItem {
    Data(Vec<u8>),
    Trailer { sha256: String, bytes: u64 },
}

/// What a snapshot's data hashes to, as measured or as its trailer states.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checksum {
    pub sha256: String,
    pub bytes: u64,
}

/// Streams `home` as a tar archive in chunks; the last item is the SHA-256 of all the data and
/// its length, or the error that stopped the archive.
pub fn stream(home: PathBuf) -> mpsc::Receiver<Result<SnapshotPart, NodeError>> {
    let (tx, rx) = mpsc::channel(IN_FLIGHT);
    tokio::task::spawn_blocking(move || archive(&home, tx));
    rx
}

/// Archives `home` into chunks sent on `tx`, then the end (blocking).
fn archive(home: &Path, tx: mpsc::Sender<Result<SnapshotPart, NodeError>>) {
    let mut writer = ChunkWriter::new(tx.clone());
    let written = (|| -> std::io::Result<()> {
        let mut archive = tar::Builder::new(&mut writer);
        archive.follow_symlinks(false);
        append_tree(&mut archive, home, Path::new("home"))?;
        archive.finish()?;
        drop(archive);
        writer.flush()
    })();
    let last = match written {
        Ok(()) => {
            let sum = writer.checksum();
            Ok(SnapshotPart::End {
                sha256: sum.sha256,
                bytes: sum.bytes,
            })
        }
        Err(err) => Err(NodeError::Io(format!("archiving {}: {err}", home.display()))),
    };
    // A receiver that went away wants nothing more.
    let _ = tx.blocking_send(last);
}

/// PAX's record of a link's target.
const PAX_LINKPATH: &str = "linkpath";

/// OCI's name for a whiteout of `name`, and for an opaque directory's mark.
const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARK: &str = ".wh..wh..opq";
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

fn cpath(path: &Path) -> std::io::Result<std::ffi::CString> {
    std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)
}

/// Whether overlayfs marked directory `dir` opaque.
fn opaque(dir: &Path) -> bool {
    let (Ok(path), Ok(name)) = (cpath(dir), std::ffi::CString::new(OPAQUE_XATTR)) else {
        return false;
    };
    let mut value = [0u8; 1];
    // SAFETY: valid C strings and a buffer of the stated length.
    let n = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), value.as_mut_ptr().cast(), 1) };
    n == 1 && value[0] == b'y'
}

/// The `user.*` extended attributes of `path` (not following a symlink): where envd keeps
/// files' metadata (E2B's file metadata), which a move must carry.
fn user_xattrs(path: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(c) = cpath(path) else { return Vec::new() };
    let mut names = vec![0u8; 4096];
    // SAFETY: a valid C string and a buffer of the stated length.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n <= 0 {
        return Vec::new();
    }
    names.truncate(n as usize);
    let mut found = Vec::new();
    for name in names.split(|b| *b == 0).filter(|n| n.starts_with(b"user.")) {
        let Ok(cname) = std::ffi::CString::new(name) else {
            continue;
        };
        let mut value = vec![0u8; 64 * 1024];
        // SAFETY: valid C strings and a buffer of the stated length.
        let len = unsafe { libc::lgetxattr(c.as_ptr(), cname.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
        if len >= 0 {
            value.truncate(len as usize);
            found.push((String::from_utf8_lossy(name).into_owned(), value));
        }
    }
    found
}

/// The PAX record that marks an entry named like a whiteout (`.wh.…`) as the user's own file:
/// a tenant may name a file anything, and `/etc/.wh.nsswitch.conf` must come back as a file,
/// not delete `/etc/nsswitch.conf`. Archives from before it carry no user file of that name
/// unmarked on purpose, so an unmarked `.wh.` entry stays a whiteout.
const LITERAL_RECORD: &str = "SANDBOXSCHED.literal";

/// Appends `path` as `name`, its `user.*` attributes first as PAX records (`SCHILY.xattr.*`,
/// which unpacking applies), and the literal mark if its name looks like a whiteout.
/// `symlink`: whether `path` is one (its caller has looked already).
fn append_entry<W: Write>(
    archive: &mut tar::Builder<W>,
    path: &Path,
    name: &Path,
    symlink: bool,
) -> std::io::Result<()> {
    let xattrs = user_xattrs(path);
    let mut records: Vec<(String, &[u8])> = xattrs
        .iter()
        .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v.as_slice()))
        .collect();
    // A symlink's target byte for byte: the tar header's own field holds it normalised as a
    // path (`/` became `//`, `a//b/` became `a/b`), and readers take PAX's `linkpath` first.
    let target = if symlink { Some(std::fs::read_link(path)?) } else { None };
    if let Some(target) = &target {
        records.push((PAX_LINKPATH.to_string(), target.as_os_str().as_encoded_bytes()));
    }
    let looks_like_whiteout = name
        .file_name()
        .is_some_and(|n| n.as_encoded_bytes().starts_with(WHITEOUT_PREFIX.as_bytes()));
    if looks_like_whiteout {
        records.push((LITERAL_RECORD.to_string(), b"1"));
    }
    if !records.is_empty() {
        archive.append_pax_extensions(records.iter().map(|(k, v)| (k.as_str(), *v)))?;
    }
    archive.append_path_with_name(path, name)
}

/// An empty entry named `name` (a whiteout or an opaque mark).
fn append_mark<W: Write>(archive: &mut tar::Builder<W>, name: &Path) -> std::io::Result<()> {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(0);
    header.set_mode(0o600);
    archive.append_data(&mut header, name, std::io::empty())
}

/// Appends `dir` as `name` and everything below it (never following a symlink), with
/// overlayfs's marks as OCI whiteouts.
fn append_tree<W: Write>(archive: &mut tar::Builder<W>, dir: &Path, name: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    append_entry(archive, dir, name, false)?;
    if opaque(dir) {
        append_mark(archive, &name.join(OPAQUE_MARK))?;
    }
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let (path, file_name) = (entry.path(), entry.file_name());
        let meta = std::fs::symlink_metadata(&path)?;
        let file_type = meta.file_type();
        if file_type.is_char_device() && meta.rdev() == 0 {
            let mut whiteout = std::ffi::OsString::from(WHITEOUT_PREFIX);
            whiteout.push(&file_name);
            append_mark(archive, &name.join(whiteout))?;
        } else if file_type.is_dir() {
            append_tree(archive, &path, &name.join(&file_name))?;
        } else if file_type.is_socket() {
            // A socket is a live process's, meaningless once that process is gone (and tar
            // has no entry for one): left out, as Docker's commits and exports do.
            continue;
        } else {
            append_entry(archive, &path, &name.join(&file_name), file_type.is_symlink())?;
        }
    }
    Ok(())
}

/// The directory `relative` names under `into`, made where missing, one component at a time
/// and never through a symlink: an archive may hold `home/evil -> /anywhere` and then an
/// entry under `home/evil/`, which must not reach outside `into`. (Nothing else writes to the
/// scratch folder while it is unpacked, so what is checked here is what is acted on.)
fn directory_beneath(into: &Path, relative: &Path) -> std::io::Result<PathBuf> {
    let mut dir = into.to_path_buf();
    for component in relative.components() {
        let std::path::Component::Normal(name) = component else {
            return Err(std::io::Error::other(format!(
                "{} leaves the archive",
                relative.display()
            )));
        };
        dir.push(name);
        match std::fs::symlink_metadata(&dir) {
            Ok(meta) if meta.file_type().is_dir() => {}
            Ok(_) => {
                return Err(std::io::Error::other(format!(
                    "{} is not a directory (a symlink is never followed)",
                    dir.display()
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir(&dir)?,
            Err(e) => return Err(e),
        }
    }
    Ok(dir)
}

/// Turns an OCI whiteout entry at `relative` (under `into`) back into overlayfs's mark;
/// `false` when the entry is an ordinary one.
fn restore_mark(into: &Path, relative: &Path) -> std::io::Result<bool> {
    let Some(name) = relative.file_name().and_then(|n| n.to_str()) else {
        return Ok(false);
    };
    let Some(deleted) = name.strip_prefix(WHITEOUT_PREFIX) else {
        return Ok(false);
    };
    let parent = directory_beneath(into, relative.parent().unwrap_or(Path::new("")))?;
    if name == OPAQUE_MARK {
        let (path, key) = (
            cpath(&parent)?,
            std::ffi::CString::new(OPAQUE_XATTR).map_err(std::io::Error::other)?,
        );
        // SAFETY: valid C strings and a one-byte value.
        if unsafe { libc::lsetxattr(path.as_ptr(), key.as_ptr(), b"y".as_ptr().cast(), 1, 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        return Ok(true);
    }
    if deleted.is_empty() || deleted.contains('/') || deleted == "." || deleted == ".." {
        return Err(std::io::Error::other(format!("bad whiteout {name:?}")));
    }
    let target = cpath(&parent.join(deleted))?;
    // SAFETY: a valid C string; a 0:0 character device is overlayfs's whiteout.
    if unsafe { libc::mknod(target.as_ptr(), libc::S_IFCHR, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(true)
}

/// Unpacks the archive arriving on `data` into `into` and checks it against the trailer
/// (blocking).
pub fn unpack(data: mpsc::Receiver<RestoreItem>, into: &Path) -> Result<(), NodeError> {
    let mut reader = ChunkReader::new(data);
    let mut archive = tar::Archive::new(&mut reader);
    // A container's files belong to the ids its user namespace maps (and overlayfs marks
    // deletions as 0:0 character devices): both must arrive as they left.
    archive.set_preserve_ownerships(true);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    // Files' metadata (envd's `user.*` attributes) arrives with them, and nothing else: an
    // archive is the sender's word, and `security.capability` (a file that grants
    // capabilities when run), `trusted.*` or `security.*` from it would be the host
    // trusting a tenant. So attributes are applied here, `user.*` only, not by the tar reader.
    archive.set_unpack_xattrs(false);
    let corrupt = |e: std::io::Error| {
        // The tar reader wraps the cause ("failed to unpack `PATH`": why?).
        let cause = std::error::Error::source(&e)
            .map(|c| format!(": {c}"))
            .unwrap_or_default();
        NodeError::Corrupt(format!("unpacking: {e}{cause}"))
    };
    // The folder of the last entry, checked: archives list a folder's files together, so it
    // is walked once for all of them, and forgotten when an entry could have replaced it.
    let mut checked: Option<PathBuf> = None;
    for entry in archive.entries().map_err(corrupt)? {
        let mut entry = entry.map_err(corrupt)?;
        let relative = entry.path().map_err(corrupt)?.into_owned();
        if relative
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(NodeError::Corrupt(format!(
                "unpacking: entry {} leaves the archive",
                relative.display()
            )));
        }
        let (literal, xattrs) = pax_records(&mut entry).map_err(corrupt)?;
        if checked.as_deref().is_some_and(|dir| dir.starts_with(&relative)) {
            checked = None;
        }
        if !literal && restore_mark(into, &relative).map_err(corrupt)? {
            continue;
        }
        if matches!(
            entry.header().entry_type(),
            tar::EntryType::Char | tar::EntryType::Block
        ) {
            // No sandbox makes device nodes (its user namespace may not; overlayfs's own
            // deletions travel as `.wh.` marks): one in an archive was crafted, to be opened
            // where it lands. Left out, as a socket is on the way in.
            tracing::warn!(entry = %relative.display(), "a device node in a snapshot; left out");
            continue;
        }
        // Its folder exists and is a real one (checked as whiteouts are), so the tar reader's
        // own containment check and the attributes below act on a path inside `into`.
        if let Some(parent) = relative.parent() {
            if checked.as_deref() != Some(parent) {
                directory_beneath(into, parent).map_err(corrupt)?;
                checked = Some(parent.to_path_buf());
            }
        }
        if !entry.unpack_in(into).map_err(corrupt)? {
            return Err(NodeError::Corrupt(format!(
                "unpacking: entry {} leaves the archive",
                relative.display()
            )));
        }
        let path = cpath(&into.join(&relative)).map_err(corrupt)?;
        for (name, value) in xattrs {
            let name = std::ffi::CString::new(name).map_err(|e| corrupt(std::io::Error::other(e)))?;
            // SAFETY: valid C strings and a value of the stated length; never follows a link.
            if unsafe { libc::lsetxattr(path.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) } != 0 {
                return Err(corrupt(std::io::Error::last_os_error()));
            }
        }
    }
    // Drain what follows the archive's end (tar padding) up to the trailer.
    std::io::copy(&mut reader, &mut std::io::sink()).map_err(|e| NodeError::Corrupt(e.to_string()))?;
    let got = reader.checksum();
    verify(&got, reader.trailer.as_ref())
}

/// What an entry's PAX records say: whether it carries the literal mark (a user's file named
/// like a whiteout), and the `user.*` attributes it carries (`SCHILY.xattr.user.*`); every
/// other attribute is dropped.
type PaxRecords = (bool, Vec<(String, Vec<u8>)>);

fn pax_records<R: Read>(entry: &mut tar::Entry<'_, R>) -> std::io::Result<PaxRecords> {
    let (mut literal, mut xattrs) = (false, Vec::new());
    if let Some(extensions) = entry.pax_extensions()? {
        for extension in extensions {
            let extension = extension?;
            let Ok(key) = extension.key() else { continue };
            if key == LITERAL_RECORD {
                literal = true;
            } else if let Some(name) = key.strip_prefix("SCHILY.xattr.").filter(|n| n.starts_with("user.")) {
                xattrs.push((name.to_string(), extension.value_bytes().to_vec()));
            }
        }
    }
    Ok((literal, xattrs))
}

/// Whether the data that arrived (`got`) is what the sender stated it sent (`want`).
pub fn verify(got: &Checksum, want: Option<&Checksum>) -> Result<(), NodeError> {
    match want {
        Some(want) if want == got => Ok(()),
        Some(want) => Err(NodeError::Corrupt(format!(
            "checksum {} over {} bytes, the source said {} over {}",
            got.sha256, got.bytes, want.sha256, want.bytes
        ))),
        None => Err(NodeError::Corrupt("the stream ended without a trailer".to_string())),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A `Write` that sends what it is given as chunks of [`CHUNK`] bytes, hashing them.
struct ChunkWriter {
    tx: mpsc::Sender<Result<SnapshotPart, NodeError>>,
    buf: Vec<u8>,
    hasher: Sha256,
    bytes: u64,
}

impl ChunkWriter {
    fn new(tx: mpsc::Sender<Result<SnapshotPart, NodeError>>) -> Self {
        Self {
            tx,
            buf: Vec::with_capacity(CHUNK),
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// What has been sent so far.
    fn checksum(&mut self) -> Checksum {
        Checksum {
            sha256: hex(&self.hasher.finalize_reset()),
            bytes: self.bytes,
        }
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.hasher.update(&chunk);
        self.bytes += chunk.len() as u64;
        self.tx
            .blocking_send(Ok(SnapshotPart::Data(chunk)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "snapshot receiver gone"))
    }
}

/// A `Read` over the data chunks arriving on a channel, hashing them; it ends at the trailer
/// (which it keeps) or when the sender goes.
struct ChunkReader {
    rx: mpsc::Receiver<RestoreItem>,
    current: Vec<u8>,
    offset: usize,
    hasher: Sha256,
    bytes: u64,
    trailer: Option<Checksum>,
}

impl ChunkReader {
    fn new(rx: mpsc::Receiver<RestoreItem>) -> Self {
        Self {
            rx,
            current: Vec::new(),
            offset: 0,
            hasher: Sha256::new(),
            bytes: 0,
            trailer: None,
        }
    }

    /// What has arrived so far.
    fn checksum(&mut self) -> Checksum {
        Checksum {
            sha256: hex(&self.hasher.finalize_reset()),
            bytes: self.bytes,
        }
    }
}

impl Read for ChunkReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.offset >= self.current.len() {
            if self.trailer.is_some() {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(RestoreItem::Data(chunk)) => {
                    self.hasher.update(&chunk);
                    self.bytes += chunk.len() as u64;
                    self.current = chunk;
                    self.offset = 0;
                }
                Some(RestoreItem::Trailer { sha256, bytes }) => self.trailer = Some(Checksum { sha256, bytes }),
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.current.len() - self.offset);
        out[..n].copy_from_slice(&self.current[self.offset..self.offset + n]);
        self.offset += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("snapshot-test-{name}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    /// Archives `home` on a thread of its own, as `spawn_blocking` would: every part sent.
    fn take(home: &Path) -> Vec<Result<SnapshotPart, NodeError>> {
        let (tx, mut rx) = mpsc::channel(IN_FLIGHT);
        let home = home.to_path_buf();
        let archiver = std::thread::spawn(move || archive(&home, tx));
        let mut parts = Vec::new();
        while let Some(part) = rx.blocking_recv() {
            parts.push(part);
        }
        archiver.join().expect("archiver");
        parts
    }

    /// Feeds `items` to [`unpack`] into `into`.
    fn restore(items: Vec<RestoreItem>, into: &Path) -> Result<(), NodeError> {
        let (tx, rx) = mpsc::channel(items.len().max(1));
        for item in items {
            tx.try_send(item).map_err(|_| NodeError::Io("channel full".into()))?;
        }
        drop(tx);
        unpack(rx, into)
    }

    fn as_restore(parts: Vec<Result<SnapshotPart, NodeError>>) -> Vec<RestoreItem> {
        parts
            .into_iter()
            .map(|part| match part {
                Ok(SnapshotPart::Data(data)) => RestoreItem::Data(data),
                Ok(SnapshotPart::End { sha256, bytes }) => RestoreItem::Trailer { sha256, bytes },
                Err(err) => panic!("archive failed: {err}"),
            })
            .collect()
    }

    #[test]
    fn a_home_survives_the_round_trip_in_several_chunks() {
        let dir = scratch("round-trip");
        let home = dir.join("home-src");
        std::fs::create_dir_all(home.join("sub")).expect("home");
        // Big enough to need several chunks, and not a multiple of their size.
        let big: Vec<u8> = (0..(CHUNK * 2 + 12345)).map(|i| (i % 251) as u8).collect();
        std::fs::write(home.join("sub/big.bin"), &big).expect("big");
        std::fs::write(home.join("small.txt"), "small").expect("small");
        let c = cpath(&home.join("small.txt")).expect("path");
        let (name, value) = (std::ffi::CString::new("user.e2b.meta").expect("name"), b"{\"k\":\"v\"}");
        // SAFETY: valid C strings and a value of the stated length.
        let set = unsafe { libc::lsetxattr(c.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        assert_eq!(set, 0, "setting a user xattr: {}", std::io::Error::last_os_error());
        let parts = take(&home);
        let data_chunks = parts.iter().filter(|p| matches!(p, Ok(SnapshotPart::Data(_)))).count();
        assert!(data_chunks >= 3, "{data_chunks} chunks");
        assert!(matches!(parts.last(), Some(Ok(SnapshotPart::End { .. }))));

        let into = dir.join("restored");
        std::fs::create_dir_all(&into).expect("into");
        restore(as_restore(parts), &into).expect("restore");
        assert_eq!(std::fs::read(into.join("home/sub/big.bin")).expect("big"), big);
        assert_eq!(
            std::fs::read_to_string(into.join("home/small.txt")).expect("small"),
            "small"
        );
        assert_eq!(
            user_xattrs(&into.join("home/small.txt")),
            vec![("user.e2b.meta".to_string(), value.to_vec())],
            "files' metadata moves with them"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_changed_or_truncated_stream_is_refused() {
        let dir = scratch("corrupt");
        let home = dir.join("home-src");
        std::fs::create_dir_all(&home).expect("home");
        std::fs::write(home.join("a.txt"), "the data").expect("a");
        let items = as_restore(take(&home));

        // A trailer that states another checksum.
        let mut lying = items;
        if let Some(RestoreItem::Trailer { sha256, .. }) = lying.last_mut() {
            *sha256 = "0".repeat(64);
        }
        let into = dir.join("lying");
        std::fs::create_dir_all(&into).expect("into");
        assert!(matches!(restore(lying, &into), Err(NodeError::Corrupt(_))));

        // A stream that ends without its trailer.
        let mut truncated = as_restore(take(&home));
        truncated.pop();
        let into = dir.join("truncated");
        std::fs::create_dir_all(&into).expect("into");
        assert!(matches!(restore(truncated, &into), Err(NodeError::Corrupt(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Symlinks come back byte for byte, `/` and relative or dangling targets included.
    #[test]
    fn symlinks_come_back_as_they_were() {
        let dir = scratch("links");
        let home = dir.join("home-src");
        std::fs::create_dir_all(&home).expect("home");
        let targets = ["/", "/etc/passwd", "../up", "rel/path", "dangling", "/a//b/"];
        for (i, target) in targets.iter().enumerate() {
            std::os::unix::fs::symlink(target, home.join(format!("l{i}"))).expect("link");
        }
        let into = dir.join("restored");
        std::fs::create_dir_all(&into).expect("into");
        restore(as_restore(take(&home)), &into).expect("restore");
        for (i, target) in targets.iter().enumerate() {
            let back = std::fs::read_link(into.join(format!("home/l{i}"))).expect("link back");
            assert_eq!(back.as_os_str(), std::ffi::OsStr::new(target), "link {i}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A sparse file moves as what it holds, not its length: a sandbox's `truncate -s 64G`
    /// costs the stream (and the sandbox's pause) a few blocks, and comes back sparse, so it
    /// fits the same disk on the other side.
    #[test]
    fn a_sparse_file_moves_as_its_data_and_stays_sparse() {
        use std::io::{Seek, SeekFrom};
        use std::os::unix::fs::MetadataExt;
        let dir = scratch("sparse");
        let home = dir.join("home-src");
        std::fs::create_dir_all(&home).expect("home");
        let mut file = std::fs::File::create(home.join("holes.img")).expect("file");
        file.write_all(b"head").expect("head");
        file.seek(SeekFrom::Start(8 << 30)).expect("seek");
        file.write_all(b"tail").expect("tail");
        drop(file);
        let items = as_restore(take(&home));
        let streamed: usize = items
            .iter()
            .map(|i| match i {
                RestoreItem::Data(d) => d.len(),
                RestoreItem::Trailer { .. } => 0,
            })
            .sum();
        assert!(streamed < 1 << 20, "8 GiB of holes took {streamed} bytes");
        let into = dir.join("restored");
        std::fs::create_dir_all(&into).expect("into");
        restore(items, &into).expect("restore");
        let back = into.join("home/holes.img");
        let meta = std::fs::metadata(&back).expect("restored");
        assert_eq!(meta.len(), (8 << 30) + 4);
        assert!(meta.blocks() * 512 < 1 << 20, "restored with {} blocks", meta.blocks());
        let mut tail = [0u8; 4];
        let mut file = std::fs::File::open(&back).expect("open");
        file.seek(SeekFrom::Start(8 << 30)).expect("seek");
        std::io::Read::read_exact(&mut file, &mut tail).expect("tail");
        assert_eq!(&tail, b"tail");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A tenant's own files of any name come back as files: `.wh.NAME` and `.wh..wh..opq` are
    /// not whiteouts when the user made them; a socket (a live process's) is left out and
    /// the rest of the home still moves.
    #[test]
    fn files_named_like_whiteouts_and_sockets_move_as_what_they_are() {
        let dir = scratch("names");
        let home = dir.join("home-src");
        std::fs::create_dir_all(home.join("etc")).expect("home");
        std::fs::write(home.join("etc/nsswitch.conf"), "passwd: files").expect("conf");
        std::fs::write(home.join("etc/.wh.nsswitch.conf"), "mine").expect("user whiteout-like");
        std::fs::write(home.join(".wh..wh..opq"), "also mine").expect("user opaque-like");
        let _socket = std::os::unix::net::UnixListener::bind(home.join("app.sock")).expect("socket");
        let into = dir.join("restored");
        std::fs::create_dir_all(&into).expect("into");
        restore(as_restore(take(&home)), &into).expect("restore");
        let read = |p: &str| std::fs::read_to_string(into.join("home").join(p)).expect(p);
        assert_eq!(read("etc/nsswitch.conf"), "passwd: files");
        assert_eq!(read("etc/.wh.nsswitch.conf"), "mine");
        assert_eq!(read(".wh..wh..opq"), "also mine");
        assert!(!opaque(&into.join("home")), "a user's file made the home opaque");
        assert!(!into.join("home/app.sock").exists(), "a socket was restored");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A crafted archive, as a restore stream with a trailer that matches it.
    fn crafted(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<RestoreItem> {
        let mut archive = tar::Builder::new(Vec::new());
        build(&mut archive);
        let data = archive.into_inner().expect("archive");
        let sha256 = hex(&Sha256::digest(&data));
        let bytes = data.len() as u64;
        vec![RestoreItem::Data(data), RestoreItem::Trailer { sha256, bytes }]
    }

    fn file(archive: &mut tar::Builder<Vec<u8>>, path: &str, content: &[u8]) {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(content.len() as u64);
        header.set_mode(0o644);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        archive.append_data(&mut header, path, content).expect("entry");
    }

    fn symlink(archive: &mut tar::Builder<Vec<u8>>, path: &str, target: &Path) {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_size(0);
        header.set_mode(0o777);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        archive.append_link(&mut header, path, target).expect("link");
    }

    /// The attack on restore: a symlink in the archive to a directory of the host, then an
    /// entry under it (a whiteout, an opaque mark, a file). Nothing lands outside the scratch
    /// folder; the restore fails.
    #[test]
    fn an_archive_cannot_write_through_its_own_symlinks() {
        let dir = scratch("symlink-attack");
        let victim = dir.join("root-only");
        std::fs::create_dir_all(&victim).expect("victim");
        for (what, last) in [
            ("a whiteout", "home/evil/.wh.x"),
            ("an opaque mark", "home/evil/.wh..wh..opq"),
            ("a file", "home/evil/planted"),
            ("a file deeper", "home/evil/sub/planted"),
        ] {
            let items = crafted(|a| {
                symlink(a, "home/evil", &victim);
                file(a, last, b"");
            });
            let into = dir.join(format!("into-{}", what.replace(' ', "-")));
            std::fs::create_dir_all(&into).expect("into");
            let result = restore(items, &into);
            assert!(
                matches!(&result, Err(NodeError::Corrupt(m)) if m.contains("not a directory")),
                "{what}: {result:?}"
            );
            let planted: Vec<_> = std::fs::read_dir(&victim).expect("victim").collect();
            assert!(planted.is_empty(), "{what} landed in the host's directory: {planted:?}");
            assert!(!opaque(&victim), "{what} marked the host's directory opaque");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A device node in an archive (which no sandbox can make) is left out: a crafted
    /// `home/disk` for the host's first disk (8:0) must not appear, even behind nodev mounts.
    #[test]
    fn device_nodes_in_an_archive_are_left_out() {
        let dir = scratch("devices");
        let items = crafted(|a| {
            for (kind, name, major) in [
                (tar::EntryType::Block, "home/disk", 8),
                (tar::EntryType::Char, "home/mem", 1),
            ] {
                let mut header = tar::Header::new_gnu();
                header.set_entry_type(kind);
                header.set_size(0);
                header.set_mode(0o666);
                header.set_device_major(major).expect("major");
                header.set_device_minor(0).expect("minor");
                a.append_data(&mut header, name, std::io::empty()).expect("device");
            }
            file(a, "home/kept.txt", b"kept");
        });
        let into = dir.join("into");
        std::fs::create_dir_all(&into).expect("into");
        restore(items, &into).expect("restore");
        assert!(
            std::fs::symlink_metadata(into.join("home/disk")).is_err(),
            "a block device arrived"
        );
        assert!(
            std::fs::symlink_metadata(into.join("home/mem")).is_err(),
            "a char device arrived"
        );
        assert_eq!(std::fs::read(into.join("home/kept.txt")).expect("kept"), b"kept");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Only `user.*` attributes arrive from an archive: a file capability (or any `trusted.*`
    /// or `security.*` attribute) in it is dropped, so no restored file grants privileges.
    #[test]
    fn only_user_attributes_are_restored() {
        // VFS_CAP_REVISION_2 granting every capability, permitted and effective.
        let mut capability = vec![0x01, 0x00, 0x00, 0x02];
        capability.extend_from_slice(&[0xff; 16]);
        let items = crafted(|a| {
            a.append_pax_extensions([
                ("SCHILY.xattr.security.capability", capability.as_slice()),
                ("SCHILY.xattr.trusted.evil", b"y".as_slice()),
                ("SCHILY.xattr.user.note", b"kept".as_slice()),
            ])
            .expect("pax");
            file(a, "home/tool", b"#!/bin/sh\n");
        });
        let dir = scratch("xattrs");
        restore(items, &dir).expect("restore");
        let restored = dir.join("home/tool");
        assert_eq!(
            user_xattrs(&restored),
            vec![("user.note".to_string(), b"kept".to_vec())]
        );
        let c = cpath(&restored).expect("path");
        for name in ["security.capability", "trusted.evil"] {
            let name = std::ffi::CString::new(name).expect("name");
            let mut value = [0u8; 64];
            // SAFETY: valid C strings and a buffer of the stated length.
            let n = unsafe { libc::lgetxattr(c.as_ptr(), name.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
            assert!(n < 0, "{name:?} was restored");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn verify_compares_sum_and_length() {
        let sum = |s: &str, bytes| Checksum {
            sha256: s.into(),
            bytes,
        };
        assert!(verify(&sum("ab", 2), Some(&sum("ab", 2))).is_ok());
        assert!(verify(&sum("ab", 2), Some(&sum("ab", 3))).is_err());
        assert!(verify(&sum("ab", 2), Some(&sum("cd", 2))).is_err());
        assert!(verify(&sum("ab", 2), None).is_err());
    }
}
