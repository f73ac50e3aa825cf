//! A disk per sandbox: its writable layer on a filesystem of its own, so the kernel holds it
//! to its size and its inodes.
//!
//! Each sandbox's folder holds `disk.img`, a sparse file of the sandbox's disk size formatted
//! as ext4, mounted (through a loop device) at `disk/`; the writable layer (`disk/home`) and
//! overlayfs's work folder (`disk/work`) live on it. What that buys:
//!
//! - **Writes past the size fail with ENOSPC** inside the sandbox, and only there: the host's
//!   filesystem and the other sandboxes never see them. Inodes are bounded the same way (one
//!   per 16 KiB of disk), so a sandbox creating millions of empty files stops at its own
//!   table.
//! - **`df` inside shows the sandbox's own disk**: overlayfs answers `statfs` from its upper
//!   layer's filesystem.
//! - **Only what is written costs the host**: the image is sparse, formatted without a
//!   journal and with lazily initialised inode tables (never zeroed behind the sandbox's
//!   back), so a new 2 GiB disk takes about a hundred kilobytes. Formatting runs once per
//!   size: each new disk is a sparse copy of that blank (its few hundred kilobytes of
//!   metadata), which spares every create a `mkfs` process.
//! - **Nothing on it runs set-id on the host**: the disk is mounted `nosuid,nodev`. A set-uid
//!   binary a sandbox's root leaves in its layer gives a host user who reaches it nothing.
//!   (Inside, the overlay's own flags decide, as before.)
//!
//! Why not project quotas, the usual way to cap a folder: they need the kernel's quota
//! support, and the kernels of these hosts are built without it (ext4 and XFS both refuse
//! `prjquota` mounts there). A filesystem per sandbox needs only loop devices, which every
//! kernel has, and says ENOSPC rather than EDQUOT, as a disk does.
//!
//! - **No disk is promised that the host cannot hold**: a sparse image costs only what is
//!   written, so without a check a node would hand out more disk than it has, and the first
//!   tenant to fill the host would make every other sandbox's writes fail with EIO. A new disk
//!   is admitted only while the room every disk may still take (its size less what it already
//!   holds) fits in the host's free space ([`admit`]); otherwise the create is refused for
//!   room and the gateway tries another node. `--disk-overcommit` relaxes the promise
//!   knowingly.
//!
//! A host without loop devices or `mkfs.ext4` keeps each `disk/` a plain folder: sandboxes
//! run, unbounded, and the node says so in its health. So do sandboxes from before disks
//! existed (a `disk/` with files and no image is never mounted over).
//!
//! A mount outlives the node process (as the overlays do): a restarted node finds its
//! sandboxes' disks mounted, and after a reboot mounts them again, checking each with
//! `e2fsck` first. Every folder that may hold a mounted disk is deleted through
//! [`remove_folder`], which unmounts it first.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

mod spares;

/// The prefix of a spare disk's folder in the sandboxes folder: the node's own, listed as no
/// sandbox (see [`spares`]).
pub use spares::PREFIX as SPARE_PREFIX;

/// The mount point of a sandbox's disk, in its folder.
pub const MOUNT: &str = "disk";
/// The image file of a sandbox's disk, in its folder.
const IMAGE: &str = "disk.img";
/// Bytes of disk per inode: ext4's own default ratio.
const BYTES_PER_INODE: u64 = 16 * 1024;
/// The smallest disk the node makes: below this ext4 has no room for its own tables.
pub const MIN_BYTES: u64 = 16 << 20;

/// How a node gives its sandboxes disks.
#[derive(Clone, Debug)]
pub struct Disks {
    kind: Kind,
    /// The size of a sandbox that asks for none.
    default_bytes: u64,
    /// Where formatted blank disks are kept, one per size (`None`: each disk formatted anew).
    blanks: Option<PathBuf>,
    /// How many times the host's free space the disks may promise (1: never more than it has).
    overcommit: f64,
    /// Disks of the default size made before they are asked for (see [`spares`]).
    spares: Option<Arc<spares::Spares>>,
}

/// What readies a new disk in a sandbox folder before a sandbox is given it (the runtime's
/// folders on it): run on each spare once it is mounted.
pub type Prepare = Arc<dyn Fn(&Path) -> io::Result<()> + Send + Sync>;

/// The host's disk has no room for another sandbox's disk: what was asked, what the disks
/// already promise, what is free.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error(
    "no room for a {asked_mib} MiB disk: {disks} disks may still take {promised_mib} MiB and the host has {free_mib} MiB free (over-commit {overcommit})"
)]
pub struct NoRoom {
    pub asked_mib: u64,
    pub disks: usize,
    pub promised_mib: u64,
    pub free_mib: u64,
    pub overcommit: f64,
}

/// What a node's disks may still take from the host: for each image, its size less the blocks
/// it already holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Promised {
    pub disks: usize,
    pub bytes: u64,
}

/// Whether a new disk of `bytes` may be promised when the disks already promise `promised` and
/// the host has `free` bytes free: the whole promise must fit in `overcommit` × `free`.
pub fn admit(promised: Promised, free: u64, bytes: u64, overcommit: f64) -> Result<(), NoRoom> {
    let after = promised.bytes.saturating_add(bytes);
    if (after as f64) <= free as f64 * overcommit {
        return Ok(());
    }
    Err(NoRoom {
        asked_mib: bytes >> 20,
        disks: promised.disks,
        promised_mib: promised.bytes >> 20,
        free_mib: free >> 20,
        overcommit,
    })
}

/// What the disks in the sandbox folders under `sandboxes` may still take.
pub fn promised(sandboxes: &Path) -> io::Result<Promised> {
    use std::os::unix::fs::MetadataExt as _;
    let mut total = Promised::default();
    for entry in std::fs::read_dir(sandboxes)? {
        let Ok(image) = std::fs::symlink_metadata(entry?.path().join(IMAGE)) else {
            continue;
        };
        total.disks += 1;
        // st_blocks counts 512-byte units whatever the filesystem's block size.
        let held = image.blocks().saturating_mul(512);
        total.bytes = total.bytes.saturating_add(image.len().saturating_sub(held));
    }
    Ok(total)
}

/// Bytes an unprivileged writer may still write on the filesystem holding `path`.
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    let stat = rustix::fs::statvfs(path)?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Held from a new disk's admission until its image exists, so two creates cannot both be
/// admitted into the same free space; it keeps each sandboxes folder's last [`Scan`].
static ADMISSION: std::sync::Mutex<BTreeMap<PathBuf, Scan>> = std::sync::Mutex::new(BTreeMap::new());

/// How long a scan of the disks' promise is used before the next admission walks the folder
/// again (a refusal always walks it first).
const RESCAN: std::time::Duration = std::time::Duration::from_secs(5);

/// What the disks of one sandboxes folder promised when last walked, plus every disk admitted
/// since, at its whole size, and the host's free space at the walk.
///
/// Walking every sandbox's image on every create was 5 % of a busy node's CPU (a `statx` per
/// sandbox, under the lock every create takes), and grows with the sandboxes a node holds.
/// Between walks, [`Scan::trusted`] never says less than a walk would:
/// - images appear only through admission, counted whole here;
/// - an image's held blocks grow as it is written, which only shrinks its promise;
/// - they shrink only where blocks are punched out of it (the disks are mounted `nodiscard`,
///   but a host's `fstrim`, or ext4 zero-filling a split extent, still punches), and a punch
///   frees as much host space as it adds to the promise: every byte the host's free space
///   rose since the walk is counted as promised;
/// - images deleted since still count.
///
/// So what it admits a walk would have admitted; what it would refuse is walked again before
/// it is refused. (A punch that the host's own writes hide from the free space, within the
/// 5 s, is what it can miss.)
#[derive(Clone, Copy, Debug)]
struct Scan {
    at: std::time::Instant,
    promised: Promised,
    free_at_walk: u64,
}

impl Scan {
    /// What the disks may still take by this scan, with the host's free space now `free`.
    fn trusted(&self, free: u64) -> Promised {
        Promised {
            disks: self.promised.disks,
            bytes: self
                .promised
                .bytes
                .saturating_add(free.saturating_sub(self.free_at_walk)),
        }
    }
}

/// Whether a new disk of `bytes` may be made in `sandboxes` (see [`admit`]); on admission,
/// the disk is counted in the folder's scan. With 0 bytes: whether what the disks promise
/// still fits, counting nothing.
fn admit_in(scans: &mut BTreeMap<PathBuf, Scan>, sandboxes: &Path, bytes: u64, overcommit: f64) -> io::Result<()> {
    let free = free_bytes(sandboxes)?;
    let cached = scans.get(sandboxes).filter(|scan| scan.at.elapsed() < RESCAN).copied();
    let admitted = match cached.map(|scan| admit(scan.trusted(free), free, bytes, overcommit)) {
        Some(Ok(())) => Ok(()),
        // No scan, an old one, or one that would refuse: walk the folder now.
        _ => {
            let scan = Scan {
                at: std::time::Instant::now(),
                promised: promised(sandboxes)?,
                free_at_walk: free,
            };
            // One entry per folder a node keeps its sandboxes in; old ones go.
            scans.retain(|_, old| old.at.elapsed() < RESCAN);
            scans.insert(sandboxes.to_path_buf(), scan);
            admit(scan.promised, free, bytes, overcommit)
        }
    };
    admitted.map_err(|no_room| io::Error::new(io::ErrorKind::StorageFull, no_room))?;
    if let Some(scan) = scans.get_mut(sandboxes).filter(|_| bytes > 0) {
        scan.promised.disks += 1;
        scan.promised.bytes = scan.promised.bytes.saturating_add(bytes);
    }
    Ok(())
}

#[derive(Clone, Debug)]
enum Kind {
    /// A loop-mounted ext4 image per sandbox.
    Loop { mkfs: PathBuf, fsck: PathBuf },
    /// A plain folder: no limit. Why, for the node's health.
    Folder { why: String },
}

impl Disks {
    /// Disks as this host can give them: loop-mounted images when `wanted` and the host has
    /// loop devices and e2fsprogs, else plain folders (see [`Disks::degraded`]).
    pub fn probe(wanted: bool, default_bytes: u64) -> Self {
        let default_bytes = default_bytes.max(MIN_BYTES);
        let kind = if !wanted {
            Kind::Folder {
                why: "turned off (--no-sandbox-disks), or a runtime that gives sandboxes no disk of their own".into(),
            }
        } else {
            match (find_program("mkfs.ext4"), find_program("e2fsck")) {
                _ if !Path::new(LOOP_CONTROL).exists() => Kind::Folder {
                    why: format!("{LOOP_CONTROL} is missing (no loop devices)"),
                },
                (Some(mkfs), Some(fsck)) => Kind::Loop { mkfs, fsck },
                _ => Kind::Folder {
                    why: "mkfs.ext4 or e2fsck is missing (install e2fsprogs)".into(),
                },
            }
        };
        Self {
            kind,
            default_bytes,
            blanks: None,
            overcommit: 1.0,
            spares: None,
        }
    }

    /// Keeps `count` disks of the default size made and mounted in `sandboxes` (the folder of
    /// the sandboxes' folders), each readied by `prepare` once mounted, so a create takes one
    /// rather than making it (see [`spares`]). None are kept for plain folders, which cost
    /// nothing to make.
    pub fn with_spares(self, sandboxes: PathBuf, count: usize, prepare: Prepare) -> Self {
        if count == 0 || !matches!(self.kind, Kind::Loop { .. }) {
            return Self { spares: None, ..self };
        }
        let maker = Self {
            spares: None,
            ..self.clone()
        };
        let spares = spares::Spares::keep(maker, prepare, sandboxes, self.default_bytes, count);
        Self {
            spares: Some(Arc::new(spares)),
            ..self
        }
    }

    /// Lets the disks promise `factor` times the host's free space (see [`admit`]).
    pub fn with_overcommit(self, factor: f64) -> Self {
        Self {
            overcommit: factor,
            ..self
        }
    }

    /// Keeps a formatted blank of each size in `dir` and makes new disks as copies of it.
    pub fn with_blanks(self, dir: PathBuf) -> Self {
        Self {
            blanks: Some(dir),
            ..self
        }
    }

    /// Why sandboxes' disks are not limited here, when they are not.
    pub fn degraded(&self) -> Option<String> {
        match &self.kind {
            Kind::Loop { .. } => None,
            Kind::Folder { why } => Some(format!("sandboxes' disks are not limited: {why}")),
        }
    }

    /// The disk size of a sandbox that asked for `asked` bytes (0: the node's default).
    pub fn size(&self, asked: u64) -> u64 {
        if asked == 0 {
            self.default_bytes
        } else {
            asked.max(MIN_BYTES)
        }
    }

    /// Makes the disk of the sandbox whose folder is `dir` (made if missing) ready at
    /// `dir/disk`: mounted when it is there already, made of `bytes` (0: the default) when it
    /// is not. Idempotent: call it before anything reads or writes the sandbox's files.
    pub fn attach(&self, dir: &Path, bytes: u64) -> io::Result<()> {
        let mount = dir.join(MOUNT);
        if mounted(&mount) {
            return Ok(());
        }
        if self.place_spare(dir, bytes) {
            return Ok(());
        }
        std::fs::create_dir_all(dir)?;
        let Kind::Loop { mkfs, fsck } = &self.kind else {
            return std::fs::create_dir_all(&mount);
        };
        let image = dir.join(IMAGE);
        if image.exists() {
            check(fsck, &image)?;
        } else {
            if std::fs::read_dir(&mount).is_ok_and(|mut entries| entries.next().is_some()) {
                // Files from before this node gave disks: kept where they are, unbounded.
                tracing::warn!(path = %mount.display(), "a sandbox's files with no disk image; it keeps a plain folder");
                return Ok(());
            }
            let bytes = self.size(bytes);
            let mut scans = ADMISSION.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(sandboxes) = dir.parent() {
                self.admit_keeping(&mut scans, sandboxes, bytes, 0)?;
            }
            // Under the lock until the image exists: the next admission's walk must see it.
            self.make(mkfs, &image, bytes)?;
            drop(scans);
        }
        std::fs::create_dir_all(&mount)?;
        mount_image(&image, &mount)
    }

    /// Moves a spare into new sandbox folder `dir` when one of its size is ready: whether it
    /// did. A spare was admitted when it was made, maybe long ago; it is given out only while
    /// what every disk may still take fits in the host's free space now (layers fetched since,
    /// or anything else of the host's, may have taken the room): other spares give their room
    /// first, one at a time. Under the admission lock, rename included, so no walk of the
    /// folder runs while a spare changes its name in it.
    fn place_spare(&self, dir: &Path, bytes: u64) -> bool {
        let (Some(spares), Some(sandboxes)) = (&self.spares, dir.parent()) else {
            return false;
        };
        let bytes = self.size(bytes);
        if !spares.may_place(dir, bytes) {
            return false;
        }
        let mut scans = ADMISSION.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // The last one is not given up for itself: without room for it, the create makes its
        // own disk and is refused for room there.
        self.admit_keeping(&mut scans, sandboxes, 0, 1).is_ok() && spares.place(dir)
    }

    /// Admits a new disk of `bytes` in `sandboxes` (see [`admit_in`]); one refused for room
    /// is admitted in the room of spares, deleted one at a time down to `keep`, before it is
    /// refused: a spare is only ever a create's head start, never the reason a restore, a
    /// build or a create of another size is turned away.
    fn admit_keeping(
        &self,
        scans: &mut BTreeMap<PathBuf, Scan>,
        sandboxes: &Path,
        bytes: u64,
        keep: usize,
    ) -> io::Result<()> {
        loop {
            match admit_in(scans, sandboxes, bytes, self.overcommit) {
                Err(err) if err.kind() == io::ErrorKind::StorageFull => {
                    let gave = self
                        .spares
                        .as_ref()
                        .is_some_and(|s| s.ready() > keep && s.give_up_one());
                    if !gave {
                        return Err(err);
                    }
                }
                admitted => return admitted,
            }
        }
    }

    /// Makes a new disk of `bytes` at `image`: a sparse copy of the blank of that size
    /// (formatted first if there is none yet), or formatted in place without a blanks folder.
    fn make(&self, mkfs: &Path, image: &Path, bytes: u64) -> io::Result<()> {
        let Some(blanks) = &self.blanks else {
            return format(mkfs, image, bytes);
        };
        let blank = blanks.join(format!("blank-{bytes}.img"));
        if !blank.exists() {
            std::fs::create_dir_all(blanks)?;
            format(mkfs, &blank, bytes)?;
        }
        let scratch = scratch_beside(image);
        copy_sparse(&blank, &scratch)
            .and_then(|()| std::fs::rename(&scratch, image))
            .inspect_err(|_| {
                let _ = std::fs::remove_file(&scratch);
            })
    }
}

/// A name beside `path` no other maker uses.
fn scratch_beside(path: &Path) -> PathBuf {
    path.with_extension(format!("new-{}", uuid::Uuid::new_v4().simple()))
}

/// Copies `from` to a new file `to` (0600) with its holes: only the ranges that hold data are
/// read and written.
fn copy_sparse(from: &Path, to: &Path) -> io::Result<()> {
    use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
    let source = File::open(from)?;
    let length = source.metadata()?.len();
    let target = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(to)?;
    target.set_len(length)?;
    let seek = |to: rustix::fs::SeekFrom| -> io::Result<Option<u64>> {
        match rustix::fs::seek(&source, to) {
            Ok(found) => Ok(Some(found)),
            // ENXIO: no data past where we asked.
            Err(rustix::io::Errno::NXIO) => Ok(None),
            Err(err) => Err(err.into()),
        }
    };
    let mut buffer = vec![0u8; 1 << 20];
    let mut at = 0;
    while at < length {
        let Some(data) = seek(rustix::fs::SeekFrom::Data(at))? else {
            break;
        };
        let end = seek(rustix::fs::SeekFrom::Hole(data))?.unwrap_or(length).min(length);
        let mut offset = data;
        while offset < end {
            let want = usize::try_from((end - offset).min(buffer.len() as u64)).map_err(io::Error::other)?;
            let read = source.read_at(&mut buffer[..want], offset)?;
            if read == 0 {
                break;
            }
            target.write_all_at(&buffer[..read], offset)?;
            offset += read as u64;
        }
        at = end;
    }
    Ok(())
}

/// Unmounts the disk in sandbox folder `dir`, if one is mounted there. Lazily: whatever
/// still holds it (an overlay a failed kill left) keeps it until it lets go, and the loop
/// device frees itself then.
pub fn detach(dir: &Path) -> io::Result<()> {
    let mount = dir.join(MOUNT);
    if !mounted(&mount) {
        return Ok(());
    }
    Ok(rustix::mount::unmount(&mount, rustix::mount::UnmountFlags::DETACH)?)
}

/// Deletes a sandbox folder (or a scratch one) that may hold a mounted disk: unmounted first,
/// so the deletion neither walks the disk's files one by one nor stops at its mount point.
pub fn remove_folder(dir: &Path) -> io::Result<()> {
    detach(dir)?;
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Bytes used and the size of the disk in sandbox folder `dir`, when it has one mounted: what
/// `df` inside says.
pub fn usage(dir: &Path) -> Option<(u64, u64)> {
    let mount = dir.join(MOUNT);
    if !mounted(&mount) {
        return None;
    }
    let stat = rustix::fs::statvfs(&mount).ok()?;
    let total = stat.f_blocks.saturating_mul(stat.f_frsize);
    let free = stat.f_bfree.saturating_mul(stat.f_frsize);
    Some((total.saturating_sub(free), total))
}

/// Whether `path` is a folder something is mounted on (its device differs from its
/// parent's).
pub(crate) fn mounted(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(here), Some(Ok(parent))) = (std::fs::symlink_metadata(path), path.parent().map(std::fs::metadata)) else {
        return false;
    };
    here.is_dir() && here.dev() != parent.dev()
}

fn find_program(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file())
}

/// Makes `image`: a sparse file of `bytes`, formatted, readable by root alone. Built under a
/// temporary name and renamed into place, so an image that exists is whole.
fn format(mkfs: &Path, image: &Path, bytes: u64) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let scratch = scratch_beside(image);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&scratch)?;
    file.set_len(bytes)?;
    drop(file);
    let inodes = (bytes / BYTES_PER_INODE).max(1024);
    let out = Command::new(mkfs)
        .args(["-q", "-F", "-b", "4096", "-m", "0", "-N"])
        .arg(inodes.to_string())
        // No journal and no reserved growth: each costs megabytes of real blocks per
        // sandbox; a sandbox's disk is rebuilt from its snapshot, not replayed.
        .args(["-O", "^has_journal,^resize_inode", "-E", "nodiscard,lazy_itable_init=1"])
        .arg(&scratch)
        .output()?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&scratch);
        return Err(io::Error::other(format!(
            "mkfs.ext4: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    std::fs::rename(&scratch, image)
}

/// Checks an existing image before mounting it (after a reboot, or a node killed mid-write),
/// repairing what `e2fsck -p` may repair without asking.
fn check(fsck: &Path, image: &Path) -> io::Result<()> {
    let out = Command::new(fsck).arg("-p").arg(image).output()?;
    // 0: clean; 1: errors corrected. Anything else needs a person.
    match out.status.code() {
        Some(0 | 1) => Ok(()),
        _ => Err(io::Error::other(format!(
            "e2fsck on {}: {}{}",
            image.display(),
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
    }
}

// The loop devices' ioctls are the one place here that calls libc directly: rustix has no
// loop-device calls, and LOOP_CTL_GET_FREE answers in the ioctl's return value, which
// rustix's generic `ioctl` does not hand back.
const LOOP_CONTROL: &str = "/dev/loop-control";
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;

/// `struct loop_info64` of `<linux/loop.h>`.
#[repr(C)]
struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    size_limit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; 64],
    crypt_name: [u8; 64],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

/// `struct loop_config` of `<linux/loop.h>`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// Binds `image` to a free loop device that frees itself once unmounted, and mounts it at
/// `mount`. Another process may take the device the kernel named free before we bind it: then
/// the bind says EBUSY and the next free one is asked for.
fn mount_image(image: &Path, mount: &Path) -> io::Result<()> {
    let backing = std::fs::OpenOptions::new().read(true).write(true).open(image)?;
    let device = bind_loop(&backing)?;
    let flags = rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NODEV;
    // `nodiscard` whatever the image's default mount options say: a tenant's deleted files
    // are not punched out of the image, so what it holds does not shrink behind admission's
    // back (see `Scan`).
    if let Err(err) = rustix::mount::mount(&device.1, mount, "ext4", flags, c"noinit_itable,nodiscard") {
        // The device frees itself when `device.0` closes (autoclear) only once mounted:
        // unbind it by hand.
        // SAFETY: LOOP_CLR_FD takes no argument.
        unsafe { libc::ioctl(device.0.as_raw_fd(), LOOP_CLR_FD) };
        return Err(io::Error::other(format!("mounting {}: {err}", image.display())));
    }
    Ok(())
}

/// Opens loop device `n` at `path`, making its node first where the kernel's new device has
/// none (a container's `/dev` is a copy made at its start, not the host's devtmpfs).
fn open_device(path: &Path, n: libc::c_int) -> io::Result<File> {
    let open = || std::fs::OpenOptions::new().read(true).write(true).open(path);
    match open() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let minor = u32::try_from(n).map_err(io::Error::other)?;
            // 7 is the loop devices' major number.
            let made = rustix::fs::mknodat(
                rustix::fs::CWD,
                path,
                rustix::fs::FileType::BlockDevice,
                rustix::fs::Mode::from_raw_mode(0o600),
                rustix::fs::makedev(7, minor),
            );
            match made {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(err) => return Err(io::Error::other(format!("making {}: {err}", path.display()))),
            }
            open()
        }
        other => other,
    }
}

/// Held while a free loop device is asked for and bound: the kernel names the same free device
/// to every asker until one binds it, so concurrent creates in this process would all but one
/// lose the race. (Another process on the host may still take one first: that costs a retry.)
static BINDING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn bind_loop(backing: &File) -> io::Result<(File, PathBuf)> {
    let control = std::fs::OpenOptions::new().read(true).write(true).open(LOOP_CONTROL)?;
    let fd = u32::try_from(backing.as_raw_fd()).map_err(io::Error::other)?;
    let mut last = io::Error::other("no loop device");
    let _one_at_a_time = BINDING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    for _ in 0..64 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let device = open_device(&path, n)?;
        // SAFETY: all-zero is a valid `loop_config` (no offset, no limit, no name).
        let mut config: LoopConfig = unsafe { std::mem::zeroed() };
        config.fd = fd;
        config.info.flags = LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO;
        // SAFETY: LOOP_CONFIGURE reads a `loop_config` that outlives the call.
        if unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE, &config) } == 0 {
            return Ok((device, path));
        }
        last = io::Error::last_os_error();
        if last.raw_os_error() != Some(libc::EBUSY) {
            break;
        }
    }
    Err(io::Error::other(format!("binding a loop device: {last}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_structs_have_their_sizes() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    #[test]
    fn a_size_of_zero_is_the_default_and_none_is_below_the_minimum() {
        let disks = Disks::probe(false, 1 << 30);
        assert_eq!(disks.size(0), 1 << 30);
        assert_eq!(disks.size(1), MIN_BYTES);
        assert_eq!(disks.size(5 << 30), 5 << 30);
        assert!(disks.degraded().is_some(), "plain folders say so");
    }

    /// A real disk: made sparse, mounted, full at its size with ENOSPC, counted by `usage`,
    /// kept across a second attach, unmounted and deleted by `remove_folder`.
    #[test]
    fn a_disk_fills_up_at_its_size_and_goes_with_its_folder() {
        let root = std::env::temp_dir().join(format!("disk-test-{}", uuid::Uuid::new_v4().simple()));
        let disks = Disks::probe(true, 32 << 20).with_blanks(root.join("blanks"));
        assert_eq!(disks.degraded(), None, "a disk of its own");
        let dir = root.join("sandbox");
        std::fs::create_dir_all(&dir).unwrap();
        disks.attach(&dir, 0).unwrap();
        assert!(
            root.join(format!("blanks/blank-{}.img", 32 << 20)).is_file(),
            "formatted once"
        );
        let mount = dir.join(MOUNT);
        assert!(mounted(&mount));
        use std::os::unix::fs::MetadataExt as _;
        let image = std::fs::metadata(dir.join(IMAGE)).unwrap();
        assert_eq!(image.len(), 32 << 20);
        assert!(
            image.blocks() * 512 < 4 << 20,
            "the image is sparse: {} blocks",
            image.blocks()
        );
        assert_eq!(image.mode() & 0o777, 0o600);
        let (_, total) = usage(&dir).unwrap();
        assert!((24 << 20..=32 << 20).contains(&total), "size {total}");

        let mut file = File::create(mount.join("fill")).unwrap();
        let chunk = vec![7u8; 1 << 20];
        let full = (0..64).find_map(|_| io::Write::write_all(&mut file, &chunk).err());
        assert_eq!(full.and_then(|e| e.raw_os_error()), Some(libc::ENOSPC));
        drop(file);
        let (used, _) = usage(&dir).unwrap();
        assert!(used > 20 << 20, "used {used}");

        disks.attach(&dir, 0).unwrap();
        assert!(mount.join("fill").exists(), "a second attach keeps the disk");
        detach(&dir).unwrap();
        assert!(!mounted(&mount));
        disks.attach(&dir, 0).unwrap();
        assert!(mount.join("fill").exists(), "mounted again after a check");
        remove_folder(&dir).unwrap();
        assert!(!dir.exists());

        // A second disk of the size is a copy of the blank: empty, sparse, its own.
        let other = root.join("other");
        std::fs::create_dir_all(&other).unwrap();
        disks.attach(&other, 0).unwrap();
        assert!(!other.join(MOUNT).join("fill").exists());
        let image = std::fs::metadata(other.join(IMAGE)).unwrap();
        assert!(
            image.blocks() * 512 < 4 << 20,
            "the copy is sparse: {} blocks",
            image.blocks()
        );
        std::fs::write(other.join(MOUNT).join("mine"), "x").unwrap();
        remove_folder(&other).unwrap();
        let _ = std::fs::remove_dir_all(&root);
    }

    /// The spare folders in `sandboxes`.
    fn spare_folders(sandboxes: &Path) -> Vec<PathBuf> {
        std::fs::read_dir(sandboxes)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(SPARE_PREFIX))
            })
            .collect()
    }

    /// Spares: made and mounted ahead, moved whole into a new sandbox's folder, never into one
    /// that exists, never a disk a sandbox had, made again after each take, and deleted (with
    /// their mounts) when the node's disks are dropped.
    #[test]
    fn a_create_takes_a_new_spare_disk_and_the_next_is_made() {
        let root = std::env::temp_dir().join(format!("disk-spares-{}", uuid::Uuid::new_v4().simple()));
        let sandboxes = root.join("sandboxes");
        std::fs::create_dir_all(&sandboxes).unwrap();
        let disks = Disks::probe(true, 32 << 20)
            .with_blanks(root.join("blanks"))
            .with_spares(
                sandboxes.clone(),
                2,
                Arc::new(|dir: &Path| std::fs::create_dir(dir.join(MOUNT).join("home"))),
            );
        let spares = disks.spares.clone().expect("spares kept");
        assert!(
            spares.wait_ready(2, std::time::Duration::from_secs(20)),
            "two spares made"
        );
        let made = spare_folders(&sandboxes);
        assert_eq!(made.len(), 2);
        assert!(made.iter().all(|s| mounted(&s.join(MOUNT))), "each mounted ahead");
        assert!(made.iter().all(|s| s.join(MOUNT).join("home").is_dir()), "and readied");

        // A new sandbox's folder is a spare, moved: mounted, and the spare is gone.
        use std::os::unix::fs::MetadataExt as _;
        let image_of = |dir: &Path| std::fs::metadata(dir.join(IMAGE)).unwrap().ino();
        let spare_images: Vec<u64> = made.iter().map(|s| image_of(s)).collect();
        let a = sandboxes.join("a");
        disks.attach(&a, 0).unwrap();
        assert!(mounted(&a.join(MOUNT)));
        let taken = spare_images
            .iter()
            .position(|ino| *ino == image_of(&a))
            .expect("a spare's image");
        assert!(!made[taken].exists(), "moved, not copied");
        std::fs::write(a.join(MOUNT).join("tenant-a"), "secret").unwrap();
        assert!(
            spares.wait_ready(2, std::time::Duration::from_secs(20)),
            "the next made"
        );

        // A folder that exists (a restore's files) makes its own disk there: no spare taken.
        let b = sandboxes.join("b");
        let before: Vec<u64> = spare_folders(&sandboxes).iter().map(|s| image_of(s)).collect();
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(b.join("record"), "kept").unwrap();
        disks.attach(&b, 0).unwrap();
        assert!(!before.contains(&image_of(&b)), "no spare moved over existing files");
        assert!(b.join("record").exists());

        // A disk of another size is made, not taken.
        let c = sandboxes.join("c");
        disks.attach(&c, 64 << 20).unwrap();
        assert!(!before.contains(&image_of(&c)), "another size is made");

        // A sandbox killed: its disk is deleted, and what the next create takes is a new one.
        remove_folder(&a).unwrap();
        let d = sandboxes.join("d");
        disks.attach(&d, 0).unwrap();
        let files: Vec<_> = std::fs::read_dir(d.join(MOUNT))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(files.len(), 2, "an empty disk: {files:?}");
        assert!(!d.join(MOUNT).join("tenant-a").exists());
        assert!(spares.wait_ready(2, std::time::Duration::from_secs(20)));

        // Dropped with the node's disks: the ready spares go, mounts and all.
        let left = spare_folders(&sandboxes);
        drop(spares);
        drop(disks);
        for spare in &left {
            assert!(!spare.exists(), "{} deleted", spare.display());
        }
        for dir in ["b", "c", "d"] {
            remove_folder(&sandboxes.join(dir)).unwrap();
        }
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Spares are admitted as any disk: on 80 MiB of host, two 32 MiB spares take the room,
    /// two creates take them without an admission of their own, no third spare is made, and a
    /// third create is refused for room.
    #[test]
    fn spares_count_in_what_the_disks_promise() {
        let host = SmallHost::with_spares("disk-spare-room", 80);
        let sandboxes = &host.sandboxes;
        assert_eq!(promised(sandboxes).unwrap().disks, 2, "the spares are promised");
        host.disks.attach(&sandboxes.join("a"), 0).unwrap();
        host.disks.attach(&sandboxes.join("b"), 0).unwrap();
        let refused = host.disks.attach(&sandboxes.join("c"), 0).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::StorageFull, "{refused}");
        assert_eq!(host.spares.ready(), 0, "no spare past the room");
        host.tear_down(&["a", "b"]);
    }

    /// A host filesystem of a few MiB (a tmpfs) whose node has disks of 32 MiB and two spares
    /// ready in its `sandboxes`.
    struct SmallHost {
        root: PathBuf,
        sandboxes: PathBuf,
        disks: Disks,
        spares: Arc<spares::Spares>,
    }

    impl SmallHost {
        fn with_spares(name: &str, mib: u64) -> Self {
            let root = std::env::temp_dir().join(format!("{name}-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir_all(&root).unwrap();
            let size = std::ffi::CString::new(format!("size={mib}m")).unwrap();
            rustix::mount::mount(
                "tmpfs",
                &root,
                "tmpfs",
                rustix::mount::MountFlags::empty(),
                size.as_c_str(),
            )
            .expect("a tmpfs");
            let sandboxes = root.join("sandboxes");
            std::fs::create_dir_all(&sandboxes).unwrap();
            let disks = Disks::probe(true, 32 << 20)
                .with_blanks(root.join("blanks"))
                .with_spares(sandboxes.clone(), 2, Arc::new(|_: &Path| Ok(())));
            let spares = disks.spares.clone().expect("spares kept");
            assert!(spares.wait_ready(2, std::time::Duration::from_secs(20)));
            Self {
                root,
                sandboxes,
                disks,
                spares,
            }
        }

        /// Drops the node's disks (and spares), deletes the sandbox folders `dirs`, unmounts.
        fn tear_down(self, dirs: &[&str]) {
            let Self {
                root,
                sandboxes,
                disks,
                spares,
            } = self;
            drop(spares);
            drop(disks);
            for dir in dirs {
                remove_folder(&sandboxes.join(dir)).unwrap();
            }
            rustix::mount::unmount(&root, rustix::mount::UnmountFlags::DETACH).unwrap();
            let _ = std::fs::remove_dir_all(&root);
        }
    }

    /// Spares never cost a sandbox its disk: on 80 MiB of host with two 32 MiB spares ready, a
    /// restore's disk (its folder exists, so it takes no spare) is admitted in a spare's room
    /// (the spare is deleted for it) rather than refused; once that disk goes, the spares are
    /// made again.
    #[test]
    fn a_disk_refused_for_room_takes_the_room_of_a_spare() {
        let host = SmallHost::with_spares("disk-spare-gives", 80);
        let restored = host.sandboxes.join("restored");
        std::fs::create_dir_all(&restored).unwrap();
        host.disks.attach(&restored, 0).expect("admitted in a spare's room");
        assert!(mounted(&restored.join(MOUNT)));
        assert_eq!(host.spares.ready(), 1, "one spare gave its room");
        assert_eq!(promised(&host.sandboxes).unwrap().disks, 2);
        // Once the room is free again, the spares come back (after the worker's pause).
        remove_folder(&restored).unwrap();
        assert!(
            host.spares.wait_ready(2, std::time::Duration::from_secs(20)),
            "spares made again once there is room"
        );
        host.tear_down(&[]);
    }

    /// A spare made while the host had room is not handed out as is once the host has filled:
    /// on 100 MiB with two 32 MiB spares ready, the host's own 60 MiB leaves room for one
    /// disk's promise. One spare gives its room, the create is handed the other, and the next
    /// create is refused for room.
    #[test]
    fn a_spare_is_handed_out_only_while_the_disks_promise_fits() {
        let host = SmallHost::with_spares("disk-spare-full", 100);
        // The host fills (a template's layers, say) after the spares were made.
        let mut file = File::create(host.root.join("layers")).unwrap();
        let chunk = vec![7u8; 1 << 20];
        (0..60).for_each(|_| io::Write::write_all(&mut file, &chunk).unwrap());
        drop(file);
        use std::os::unix::fs::MetadataExt as _;
        let image_of = |dir: &Path| std::fs::metadata(dir.join(IMAGE)).unwrap().ino();
        let spare_images: Vec<u64> = spare_folders(&host.sandboxes).iter().map(|s| image_of(s)).collect();
        let a = host.sandboxes.join("a");
        host.disks.attach(&a, 0).expect("one disk's promise fits");
        assert!(mounted(&a.join(MOUNT)));
        assert!(spare_images.contains(&image_of(&a)), "handed a spare");
        assert_eq!(host.spares.ready(), 0, "the other spare gave its room");
        let refused = host.disks.attach(&host.sandboxes.join("b"), 0).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::StorageFull, "{refused}");
        host.tear_down(&["a"]);
    }

    /// A tenant cannot be promised disk the host does not have: on a host filesystem of 80 MiB
    /// two 32 MiB disks are admitted and a third is refused for room, so each admitted disk
    /// fills to its own size (ENOSPC inside it) instead of the host filling first (EIO for
    /// everyone). Once a disk goes, its room is free again.
    #[test]
    fn no_disk_is_promised_past_the_hosts_free_space() {
        let root = std::env::temp_dir().join(format!("disk-room-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&root).unwrap();
        rustix::mount::mount("tmpfs", &root, "tmpfs", rustix::mount::MountFlags::empty(), c"size=80m")
            .expect("a tmpfs of 80 MiB");
        let disks = Disks::probe(true, 32 << 20).with_blanks(root.join("blanks"));
        let sandboxes = root.join("sandboxes");
        let [a, b, c] = ["a", "b", "c"].map(|id| sandboxes.join(id));
        disks.attach(&a, 0).unwrap();
        disks.attach(&b, 0).unwrap();
        let promised = promised(&sandboxes).unwrap();
        assert_eq!(promised.disks, 2);
        assert!(promised.bytes > 60 << 20, "{promised:?}");
        let refused = disks.attach(&c, 0).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::StorageFull, "{refused}");
        assert!(refused.to_string().contains("no room for a 32 MiB disk"), "{refused}");
        assert!(!c.join(IMAGE).exists(), "nothing of a refused disk is made");

        for dir in [&a, &b] {
            let mut file = File::create(dir.join(MOUNT).join("fill")).unwrap();
            let chunk = vec![7u8; 1 << 20];
            let full = (0..64).find_map(|_| {
                io::Write::write_all(&mut file, &chunk)
                    .and_then(|()| file.sync_data())
                    .err()
            });
            assert_eq!(
                full.and_then(|e| e.raw_os_error()),
                Some(rustix::io::Errno::NOSPC.raw_os_error()),
                "{}",
                dir.display()
            );
        }

        remove_folder(&b).unwrap();
        disks.attach(&c, 0).unwrap();
        for dir in [&a, &c] {
            remove_folder(dir).unwrap();
        }
        let _ = rustix::mount::unmount(&root, rustix::mount::UnmountFlags::DETACH);
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Admission trusts its last walk of the folder while that walk admits (plus the disks
    /// admitted since, whole), and walks again before it refuses or once the walk is old.
    #[test]
    fn admission_walks_the_folder_again_only_to_refuse_or_when_its_scan_is_old() {
        let root = std::env::temp_dir().join(format!("disk-scan-{}", uuid::Uuid::new_v4().simple()));
        let sandboxes = root.join("sandboxes");
        std::fs::create_dir_all(&sandboxes).unwrap();
        let mut scans = BTreeMap::new();
        admit_in(&mut scans, &sandboxes, 1 << 20, 1.0).unwrap();
        assert_eq!(
            scans[&sandboxes].promised,
            Promised {
                disks: 1,
                bytes: 1 << 20
            },
            "an empty folder walked, and the admitted disk counted whole"
        );
        // An image appearing behind admission's back (nothing makes one so) promising more
        // than the host has: any walk now refuses every disk, so an admission is the scan's.
        let free = free_bytes(&sandboxes).unwrap();
        std::fs::create_dir_all(sandboxes.join("x")).unwrap();
        File::create(sandboxes.join("x").join(IMAGE))
            .unwrap()
            .set_len(free + (1 << 30))
            .unwrap();
        scans.get_mut(&sandboxes).unwrap().at = std::time::Instant::now();
        admit_in(&mut scans, &sandboxes, 1 << 20, 1.0).unwrap();
        assert_eq!(scans[&sandboxes].promised.bytes, 2 << 20, "the last walk, trusted");
        // One the scan would refuse (past the free space by far more than it can change in
        // between): walked again first, finding only `x`, and refused.
        let refused = admit_in(&mut scans, &sandboxes, free + (512 << 20), 1.0).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::StorageFull);
        assert_eq!(scans[&sandboxes].promised.disks, 1, "walked again before refusing");
        // An old walk is not trusted even when it would admit.
        let scan = scans.get_mut(&sandboxes).unwrap();
        scan.at = std::time::Instant::now()
            .checked_sub(RESCAN)
            .expect("the machine has been up 5 s");
        scan.promised = Promised::default();
        assert!(
            admit_in(&mut scans, &sandboxes, 1 << 20, 1.0).is_err(),
            "x's promise, found again"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Every byte the host's free space rose since the walk may be a block punched out of an
    /// image, which its promise got back: counted as promised.
    #[test]
    fn a_scan_counts_free_space_that_appeared_since_its_walk_as_promised() {
        let scan = Scan {
            at: std::time::Instant::now(),
            promised: Promised {
                disks: 2,
                bytes: 100 << 20,
            },
            free_at_walk: 1 << 30,
        };
        assert_eq!(scan.trusted(1 << 30).bytes, 100 << 20);
        assert_eq!(
            scan.trusted((1 << 30) + (7 << 20)).bytes,
            107 << 20,
            "7 MiB punched, perhaps"
        );
        assert_eq!(scan.trusted(1 << 29).bytes, 100 << 20, "written: promises only shrink");
        assert_eq!(scan.trusted(1 << 30).disks, 2);
    }

    #[test]
    fn admission_counts_what_disks_may_still_take() {
        let two = Promised {
            disks: 2,
            bytes: 60 << 20,
        };
        assert_eq!(admit(two, 100 << 20, 32 << 20, 1.0), Ok(()));
        let refused = admit(two, 80 << 20, 32 << 20, 1.0).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "no room for a 32 MiB disk: 2 disks may still take 60 MiB and the host has 80 MiB free (over-commit 1)"
        );
        assert_eq!(admit(two, 80 << 20, 32 << 20, 2.0), Ok(()), "over-commit is a choice");
        assert_eq!(admit(Promised::default(), 0, 1, 1.0).map_err(|e| e.asked_mib), Err(0));
    }

    #[test]
    fn a_sparse_copy_keeps_data_and_holes() {
        use std::io::{Seek, SeekFrom, Write};
        let dir = std::env::temp_dir().join(format!("sparse-copy-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut file = File::create(dir.join("from")).unwrap();
        file.write_all(b"head").unwrap();
        file.seek(SeekFrom::Start(64 << 20)).unwrap();
        file.write_all(b"tail").unwrap();
        file.set_len(128 << 20).unwrap();
        drop(file);
        copy_sparse(&dir.join("from"), &dir.join("to")).unwrap();
        let (from, to) = (
            std::fs::read(dir.join("from")).unwrap(),
            std::fs::read(dir.join("to")).unwrap(),
        );
        assert!(from == to, "the copy differs");
        use std::os::unix::fs::MetadataExt as _;
        assert!(std::fs::metadata(dir.join("to")).unwrap().blocks() * 512 < 1 << 20);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
