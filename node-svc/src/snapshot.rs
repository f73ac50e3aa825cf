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

/// Why a snapshot could not be taken or applied.
#[derive(Clone, Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The sandbox's home could not be read into an archive.
    #[error("{0}")]
    Archive(String),
    /// What arrived is not what was sent, or not an archive a node applies.
    #[error("{0}")]
    Corrupt(String),
}

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
/// `hold` is kept until the archive ends (the sandbox's turn: nothing resumes it meanwhile).
pub fn stream<H: Send + 'static>(home: PathBuf, hold: H) -> mpsc::Receiver<Result<SnapshotPart, SnapshotError>> {
    let (tx, rx) = mpsc::channel(IN_FLIGHT);
    tokio::task::spawn_blocking(move || {
        archive(&home, tx);
        drop(hold);
    });
    rx
}

/// Archives `home` into chunks sent on `tx`, then the end (blocking).
fn archive(home: &Path, tx: mpsc::Sender<Result<SnapshotPart, SnapshotError>>) {
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
        Err(err) => Err(SnapshotError::Archive(format!("archiving {}: {err}", home.display()))),
    };
    // A receiver that went away (or stopped reading) wants nothing more.
    let _ = send_or_give_up(&tx, last, READER_STALL);
}

/// How long a snapshot's reader may leave a chunk untaken before the stream is given up: the
/// stream holds its sandbox's turn (no kill, pause or resume of it meanwhile), so a reader
/// that stalls (a target stuck on its disk, a peer gone without a reset) must not hold it
/// for good.
pub const READER_STALL: std::time::Duration = std::time::Duration::from_secs(60);

/// Sends `part` on `tx` from the archive's blocking thread, failing if the receiver is gone
/// or takes nothing for `stall` ([`READER_STALL`]).
fn send_or_give_up(
    tx: &mpsc::Sender<Result<SnapshotPart, SnapshotError>>,
    part: Result<SnapshotPart, SnapshotError>,
    stall: std::time::Duration,
) -> std::io::Result<()> {
    let gone = |why: &str| std::io::Error::new(std::io::ErrorKind::BrokenPipe, why.to_string());
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        // Outside a runtime (a plain thread) there is no clock to give up by.
        return tx.blocking_send(part).map_err(|_| gone("snapshot receiver gone"));
    };
    match handle.block_on(tokio::time::timeout(stall, tx.send(part))) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(gone("snapshot receiver gone")),
        Err(_) => Err(gone("snapshot receiver took nothing for a minute: given up")),
    }
}

/// PAX's record of a link's target.
const PAX_LINKPATH: &str = "linkpath";

/// OCI's name for a whiteout of `name`, and for an opaque directory's mark.
const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARK: &str = ".wh..wh..opq";
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// Whether overlayfs marked directory `dir` opaque.
fn opaque(dir: &Path) -> bool {
    let mut value = [0u8; 1];
    matches!(rustix::fs::lgetxattr(dir, OPAQUE_XATTR, &mut value), Ok(1)) && value[0] == b'y'
}

/// The largest value the kernel keeps in one extended attribute (`XATTR_SIZE_MAX`).
const XATTR_VALUE_MAX: usize = 64 * 1024;

/// The `user.*` extended attributes of `path` (not following a symlink): where envd keeps
/// files' metadata (E2B's file metadata), which a move must carry. The list of names is as
/// long as the file's attributes make it (a tenant may set many), asked of the kernel first.
fn user_xattrs(path: &Path) -> Vec<(String, Vec<u8>)> {
    let mut names = Vec::new();
    // Asked again when the list grew between the query and the read (ERANGE).
    for _ in 0..8 {
        names = match rustix::fs::llistxattr_query(path) {
            Ok(0) | Err(_) => return Vec::new(),
            Ok(size) => vec![0u8; size],
        };
        match rustix::fs::llistxattr(path, &mut names) {
            Ok(n) => {
                names.truncate(n);
                break;
            }
            Err(rustix::io::Errno::RANGE) => names.clear(),
            // Gone: read as none, as a file that is not there has none.
            Err(_) => return Vec::new(),
        }
    }
    let mut found = Vec::new();
    let mut value = vec![0u8; XATTR_VALUE_MAX];
    for name in names.split(|b| *b == 0).filter(|n| n.starts_with(b"user.")) {
        if let Ok(len) = rustix::fs::lgetxattr(path, name, &mut value[..]) {
            found.push((String::from_utf8_lossy(name).into_owned(), value[..len].to_vec()));
        }
    }
    found
}

/// The PAX record that marks a tenant's file named like a whiteout as a file (see
/// `layers::LITERAL_RECORD`, which unpacking reads).
const LITERAL_RECORD: &str = layers::LITERAL_RECORD;

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
    // Owned by host root, as overlayfs makes its own marks.
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
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

/// Unpacks the archive arriving on `data` into `into` and checks it against the trailer
/// (blocking).
///
/// The archive is the sender's word (a peer node, or the blob store for a hibernation), so it
/// is applied by the one path a node applies any archive through, image layers included
/// (`layers::unpack_archive`, by the snapshot's rules): through directory descriptors, never
/// following a symlink (an archive's own `home/evil -> /anywhere` then `home/evil/x` leads
/// nowhere), `user.*` attributes only (no `security.capability`, no `trusted.*`), device
/// nodes left out, holes kept. `into` is a scratch folder the caller installs only once this
/// has verified the checksum.
pub fn unpack(data: mpsc::Receiver<RestoreItem>, into: &Path) -> Result<(), SnapshotError> {
    let mut reader = ChunkReader::new(data);
    let stats = layers::unpack_archive(&mut reader, into, layers::Rules::Snapshot)
        .map_err(|e| SnapshotError::Corrupt(format!("unpacking: {e}")))?;
    if stats.skipped_devices > 0 {
        // No sandbox makes device nodes (its user namespace may not; overlayfs's own deletions
        // travel as `.wh.` marks): one in an archive was crafted, to be opened where it lands.
        tracing::warn!(devices = stats.skipped_devices, "device nodes in a snapshot; left out");
    }
    // Drain what follows the archive's end (tar padding) up to the trailer.
    std::io::copy(&mut reader, &mut std::io::sink()).map_err(|e| SnapshotError::Corrupt(e.to_string()))?;
    let got = reader.checksum();
    verify(&got, reader.trailer.as_ref())
}

/// Whether the data that arrived (`got`) is what the sender stated it sent (`want`).
pub fn verify(got: &Checksum, want: Option<&Checksum>) -> Result<(), SnapshotError> {
    match want {
        Some(want) if want == got => Ok(()),
        Some(want) => Err(SnapshotError::Corrupt(format!(
            "checksum {} over {} bytes, the source said {} over {}",
            got.sha256, got.bytes, want.sha256, want.bytes
        ))),
        None => Err(SnapshotError::Corrupt("the stream ended without a trailer".to_string())),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A `Write` that sends what it is given as chunks of [`CHUNK`] bytes, hashing them.
struct ChunkWriter {
    tx: mpsc::Sender<Result<SnapshotPart, SnapshotError>>,
    buf: Vec<u8>,
    hasher: Sha256,
    bytes: u64,
}

impl ChunkWriter {
    fn new(tx: mpsc::Sender<Result<SnapshotPart, SnapshotError>>) -> Self {
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
        send_or_give_up(&self.tx, Ok(SnapshotPart::Data(chunk)), READER_STALL)
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

    /// A reader that takes nothing (a stalled restore) ends the stream rather than holding
    /// its sandbox's turn; one that reads gets every part.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_reader_is_given_up() {
        let (tx, mut rx) = mpsc::channel(1);
        let stalled = tokio::task::spawn_blocking(move || {
            let part = || Ok(SnapshotPart::Data(vec![1]));
            let stall = std::time::Duration::from_millis(50);
            send_or_give_up(&tx, part(), stall).expect("room for one");
            send_or_give_up(&tx, part(), stall)
        });
        let refused = stalled.await.unwrap().unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::BrokenPipe, "{refused}");
        assert!(matches!(rx.recv().await, Some(Ok(SnapshotPart::Data(_)))));
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("snapshot-test-{name}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    /// Archives `home` on a thread of its own, as `spawn_blocking` would: every part sent.
    fn take(home: &Path) -> Vec<Result<SnapshotPart, SnapshotError>> {
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
    fn restore(items: Vec<RestoreItem>, into: &Path) -> Result<(), SnapshotError> {
        let (tx, rx) = mpsc::channel(items.len().max(1));
        for item in items {
            tx.try_send(item)
                .map_err(|_| SnapshotError::Archive("channel full".into()))?;
        }
        drop(tx);
        unpack(rx, into)
    }

    fn as_restore(parts: Vec<Result<SnapshotPart, SnapshotError>>) -> Vec<RestoreItem> {
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
        let value = b"{\"k\":\"v\"}";
        rustix::fs::lsetxattr(
            home.join("small.txt"),
            "user.e2b.meta",
            value,
            rustix::fs::XattrFlags::empty(),
        )
        .expect("setting a user xattr");
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

    /// Every `user.*` attribute moves, however long the list of their names: ext4 holds about
    /// 3 KiB of them in its one block, tmpfs (as here), XFS and btrfs far more; the node once
    /// read the list into 4 KiB and dropped every attribute of a file whose list was longer.
    #[test]
    fn a_file_with_a_long_list_of_attributes_keeps_them_all() {
        let dir = scratch("many-xattrs");
        std::fs::create_dir_all(&dir).expect("dir");
        rustix::mount::mount("tmpfs", &dir, "tmpfs", rustix::mount::MountFlags::empty(), c"size=16m")
            .expect("a tmpfs (the tests run as root)");
        let home = dir.join("home-src");
        std::fs::create_dir_all(&home).expect("home");
        let file = home.join("tagged.txt");
        std::fs::write(&file, "tagged").expect("file");
        let mut want: Vec<(String, Vec<u8>)> = (0..150)
            .map(|i| {
                (
                    format!("user.{}{i:04}", "k".repeat(40)),
                    format!("value {i}").into_bytes(),
                )
            })
            .collect();
        for (name, value) in &want {
            rustix::fs::lsetxattr(&file, name.as_str(), value, rustix::fs::XattrFlags::empty()).expect("xattr");
        }
        let listed: usize = want.iter().map(|(name, _)| name.len() + 1).sum();
        assert!(listed > 4096, "the list of names is {listed} bytes");

        let into = dir.join("restored");
        std::fs::create_dir_all(&into).expect("into");
        restore(as_restore(take(&home)), &into).expect("restore");
        let mut got = user_xattrs(&into.join("home/tagged.txt"));
        got.sort();
        want.sort();
        let _ = rustix::mount::unmount(&dir, rustix::mount::UnmountFlags::DETACH);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(got.len(), want.len());
        assert_eq!(got, want);
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
        assert!(matches!(restore(lying, &into), Err(SnapshotError::Corrupt(_))));

        // A stream that ends without its trailer.
        let mut truncated = as_restore(take(&home));
        truncated.pop();
        let into = dir.join("truncated");
        std::fs::create_dir_all(&into).expect("into");
        assert!(matches!(restore(truncated, &into), Err(SnapshotError::Corrupt(_))));
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

    /// overlayfs's own marks (a deletion's 0:0 character device, an opaque directory) move
    /// as marks, and so do those of archives written before marks carried an owner.
    #[test]
    fn overlay_marks_move_as_marks_from_archives_old_and_new() {
        use std::os::unix::fs::FileTypeExt;
        let dir = scratch("marks");
        let home = dir.join("home-src");
        std::fs::create_dir_all(home.join("etc")).expect("home");
        // A 0:0 character device is overlayfs's whiteout.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            home.join("etc/hosts"),
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::empty(),
            0,
        )
        .expect("mknod");
        rustix::fs::lsetxattr(home.join("etc"), OPAQUE_XATTR, b"y", rustix::fs::XattrFlags::empty())
            .expect("marking etc opaque");
        let old = crafted(|a| {
            for name in ["home/old/.wh.gone", "home/old/.wh..wh..opq"] {
                // As marks were written before: no owner, no time.
                let mut header = tar::Header::new_gnu();
                header.set_entry_type(tar::EntryType::Regular);
                header.set_size(0);
                header.set_mode(0o600);
                a.append_data(&mut header, name, std::io::empty()).expect("mark");
            }
        });
        for (what, items) in [("new", as_restore(take(&home))), ("old", old)] {
            let into = dir.join(format!("into-{what}"));
            std::fs::create_dir_all(&into).expect("into");
            restore(items, &into).expect(what);
            let (folder, gone) = if what == "new" {
                ("home/etc", "hosts")
            } else {
                ("home/old", "gone")
            };
            let mark = std::fs::symlink_metadata(into.join(folder).join(gone)).expect("whiteout");
            assert!(mark.file_type().is_char_device(), "{what}: {mark:?}");
            assert!(opaque(&into.join(folder)), "{what}: not opaque");
        }
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
                matches!(&result, Err(SnapshotError::Corrupt(m)) if m.contains("not a directory")),
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
        for name in ["security.capability", "trusted.evil"] {
            let mut value = [0u8; 64];
            let read = rustix::fs::lgetxattr(&restored, name, &mut value);
            assert!(read.is_err(), "{name:?} was restored");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A tenant's modes and owners come back as they left, set-id bits included (inside, a
    /// sandbox's root is never host root); a file the archive gives to host root never keeps
    /// a set-id bit, since no sandbox can have made it.
    #[test]
    fn modes_and_owners_come_back_and_no_set_id_file_of_roots_arrives() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = scratch("modes");
        let home = dir.join("home-src");
        std::fs::create_dir_all(&home).expect("home");
        let tenant = home.join("tenant-sudo");
        std::fs::write(&tenant, b"#!/bin/sh\n").expect("file");
        std::os::unix::fs::chown(&tenant, Some(100_000), Some(100_000)).expect("chown");
        std::fs::set_permissions(&tenant, std::fs::Permissions::from_mode(0o6755)).expect("chmod");
        let into = dir.join("restored");
        std::fs::create_dir_all(&into).expect("into");
        restore(as_restore(take(&home)), &into).expect("restore");
        let back = std::fs::metadata(into.join("home/tenant-sudo")).expect("restored");
        assert_eq!(
            (back.mode() & 0o7777, back.uid(), back.gid()),
            (0o6755, 100_000, 100_000)
        );

        let items = crafted(|a| {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(tar::EntryType::Regular);
            header.set_size(3);
            header.set_mode(0o6755);
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            a.append_data(&mut header, "home/rootshell", &b"elf"[..])
                .expect("entry");
        });
        let into = dir.join("crafted");
        std::fs::create_dir_all(&into).expect("into");
        restore(items, &into).expect("restore");
        let back = std::fs::metadata(into.join("home/rootshell")).expect("restored");
        assert_eq!(back.mode() & 0o7777, 0o755, "a set-id file of host root arrived");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A hard link in an archive may name only a file the same archive made before it: one to
    /// a host file (absolute, or climbing out) links nothing and fails the restore.
    #[test]
    fn a_hard_link_reaches_no_file_of_the_host() {
        let dir = scratch("hardlink");
        let victim = dir.join("secret");
        std::fs::write(&victim, b"the host's").expect("victim");
        let depth = dir.components().count();
        let climbing = format!(
            "{}{}",
            "../".repeat(depth + 2),
            victim.display().to_string().trim_start_matches('/')
        );
        for target in [victim.display().to_string(), climbing] {
            let items = crafted(|a| {
                file(a, "home/ok", b"ok");
                let mut header = tar::Header::new_gnu();
                header.set_entry_type(tar::EntryType::Link);
                header.set_size(0);
                header.set_mode(0o644);
                header.set_uid(0);
                header.set_gid(0);
                header.set_mtime(0);
                a.append_link(&mut header, "home/stolen", &target).expect("link");
            });
            let into = dir.join("into");
            let _ = std::fs::remove_dir_all(&into);
            std::fs::create_dir_all(&into).expect("into");
            let result = restore(items, &into);
            assert!(matches!(result, Err(SnapshotError::Corrupt(_))), "{target}: {result:?}");
            assert!(!into.join("home/stolen").exists(), "{target} was linked");
            use std::os::unix::fs::MetadataExt;
            assert_eq!(std::fs::metadata(&victim).expect("victim").nlink(), 1, "{target}");
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
