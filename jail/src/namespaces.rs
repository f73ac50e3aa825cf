//! Namespaces: creating the container's process inside new ones, and the bits of setup
//! that belong to each (id maps, hostname, loopback, cgroup namespace).
//!
//! **One clone, all namespaces, user namespace first.** The container's init is created
//! with a single `clone(2)` carrying every `CLONE_NEW*` flag the spec asks for (except
//! cgroup, see below). When `CLONE_NEWUSER` is combined with other flags in one call, the
//! kernel creates the user namespace *first* and makes it the owner of the others. That
//! ownership is what runc's ordering (unshare the user namespace, then the rest) achieves,
//! and it is what lets root-in-the-container mount `proc`, `sysfs` and `mqueue`: those
//! mounts are allowed only to a user namespace that owns the pid, network and ipc
//! namespaces in question.
//!
//! runc needs a second fork because a process cannot enter a PID namespace it unshared
//! (only its children do) and because it must also join existing namespaces by path. When
//! a container only creates namespaces, the process `clone` returns is already PID 1 of its
//! new PID namespace: one process less, one round trip less, and the parent learns the host
//! PID directly from `clone`. When `jail` exits, the container is reparented to the nearest
//! subreaper (the node), exactly as with runc's intermediate process.
//!
//! **Joining.** A user and a network namespace may instead be joined by path (a node keeps
//! them ready, with the network set up, so a sandbox's start creates no link). The parent
//! must stay in the host's user namespace, so a short-lived joiner enters them and clones
//! the init, the init's parent set to ours with `CLONE_PARENT` ([`clone_joined`]).
//!
//! **Id maps.** A process in a new user namespace has no uid until `/proc/PID/uid_map` and
//! `gid_map` are written, and only once. The parent (host root) writes them while the child
//! waits on a pipe, so any ranges are allowed and `setgroups` stays permitted. The child then
//! switches to uid/gid 0 of its namespace.
//!
//! **Who owns the user namespace.** The kernel charges what a user holds (inotify instances,
//! queued signals, message queue bytes, locked shared memory, processes) at every level of
//! the chain of user namespaces, up to the host's, where it lands on the namespace's owner:
//! the effective uid of whoever created it. Created by the host's root, every container's
//! counts would be root's one count at the host's level, so one container could use up the
//! others' and the host's own. A new user namespace is therefore created with the effective
//! uid set to the host id that root inside maps to ([`clone_owned`]): each container has its
//! own counts at the host's level, as a separate machine has.
//!
//! **The cgroup namespace** is the exception: it captures the cgroup its creator is in at
//! that moment, so the child unshares it only after the parent has moved it into the
//! container's cgroup; the container then sees its own cgroup as `/`.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::path::PathBuf;

use oci_spec::runtime::LinuxIdMapping;

use crate::sys::{check, check_long, Errno, IoDisplay};

/// Errors from namespace setup.
#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    /// Creating the process failed (parent side).
    #[error("clone: {0}")]
    Clone(Errno),
    #[error("write {path}: {}", IoDisplay(source))]
    IdMap { path: PathBuf, source: io::Error },
    // The rest happen in the container's init.
    /// Taking on, or giving back, the user namespace's owner as effective uid (parent side).
    #[error("set the effective uid to {uid} around the clone: {errno}")]
    Owner { uid: u32, errno: Errno },
    #[error("become root in the user namespace: {0}")]
    BecomeRoot(Errno),
    #[error("unshare the cgroup namespace: {0}")]
    CgroupNs(Errno),
    #[error("sethostname: {0}")]
    Hostname(Errno),
    #[error("setdomainname: {0}")]
    Domainname(Errno),
    #[error("bring up the loopback interface: {0}")]
    Loopback(Errno),
    #[error("unmask /proc in a mount namespace of our own: {what}: {errno}")]
    Unmask { what: &'static str, errno: Errno },
    /// Opening or entering a namespace the spec names by path (parent side).
    #[error("join the {kind} namespace {path}: {errno}")]
    Join {
        kind: &'static str,
        path: PathBuf,
        errno: Errno,
    },
    /// A joined network namespace that the joined user namespace does not own: the sandbox
    /// would run in a network its root has no say over (or the host's own).
    #[error("the network namespace {net} is not owned by the user namespace {user}")]
    NotOwned { net: PathBuf, user: PathBuf },
    /// A joined user namespace whose maps are not the spec's.
    #[error("the joined user namespace's {file} is {found:?}, the spec's is {want:?}")]
    JoinedMaps {
        file: &'static str,
        found: Vec<[u64; 3]>,
        want: Vec<[u64; 3]>,
    },
}

/// Namespaces the container joins rather than creates, opened by the parent before any
/// process is made (a path that cannot be opened fails here, not in a child).
pub struct Joins {
    /// `(descriptor, CLONE_NEW* type, kind, path)`, user first: joining the user namespace
    /// first is what lets the next join reach a network namespace that user namespace owns.
    entries: Vec<(std::os::fd::OwnedFd, libc::c_int, &'static str, PathBuf)>,
}

impl Joins {
    /// Opens what `ns` joins, each at `min_fd` or above (clear of the descriptors the init
    /// passes on, which it would otherwise keep open past its exec), without blocking on a
    /// path that names a FIFO. A joined network namespace must be owned by the joined user
    /// namespace (the spec validation already asks for both together).
    pub fn open(ns: &crate::spec::Namespaces, min_fd: i32) -> Result<Joins, NamespaceError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut entries = Vec::new();
        for (path, kind, flag) in [
            (&ns.join_user, "user", libc::CLONE_NEWUSER),
            (&ns.join_net, "network", libc::CLONE_NEWNET),
        ] {
            let Some(path) = path else { continue };
            let fail = |errno| NamespaceError::Join {
                kind,
                path: path.clone(),
                errno,
            };
            let file = fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(path)
                .map_err(|e| fail(Errno(e.raw_os_error().unwrap_or(libc::EIO))))?;
            let fd = crate::sys::move_above(file.into(), min_fd).map_err(fail)?;
            entries.push((fd, flag, kind, path.clone()));
        }
        if let (Some(user), Some(net)) = (&ns.join_user, &ns.join_net) {
            let (user_fd, net_fd) = (&entries[0].0, &entries[1].0);
            if !owns(user_fd, net_fd) {
                return Err(NamespaceError::NotOwned {
                    net: net.clone(),
                    user: user.clone(),
                });
            }
        }
        Ok(Joins { entries })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Whether the user namespace `user` owns the namespace `other`: `NS_GET_USERNS` on `other`
/// opens its owner, compared with `user` by device and inode.
fn owns(user: &std::os::fd::OwnedFd, other: &std::os::fd::OwnedFd) -> bool {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    /// `NS_GET_USERNS` of `<linux/nsfs.h>`: `_IO(0xb7, 0x1)`.
    const NS_GET_USERNS: libc::c_ulong = 0xb701;
    // SAFETY: NS_GET_USERNS takes no argument and returns a new descriptor or -1.
    let owner = unsafe { libc::ioctl(other.as_raw_fd(), NS_GET_USERNS) };
    if owner < 0 {
        return false;
    }
    // SAFETY: a descriptor the kernel just gave us, owned by nothing else.
    let owner = unsafe { OwnedFd::from_raw_fd(owner) };
    match (rustix::fs::fstat(&owner), rustix::fs::fstat(user)) {
        (Ok(a), Ok(b)) => (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino),
        _ => false,
    }
}

/// Creates the container's init inside the namespaces of `joins` and new ones of `flags`.
/// Returns the init's host PID in the parent and 0 in the init, like [`clone_process`].
///
/// A process can only create namespaces owned by the user namespace it is in, and the
/// parent must stay in the host's (it writes cgroups, limits and maps for the init). So a
/// short-lived joiner is forked: it enters each joined namespace (user first), then clones
/// the init with `CLONE_PARENT`, which makes the init the parent's child rather than the
/// joiner's (reaped, signalled and guarded exactly as a directly cloned init), reports the
/// init's PID on a pipe and exits. runc's `nsexec` takes the same route.
///
/// The report pipe sits at `min_fd` or above, clear of the descriptors the init passes on
/// (it closes at the init's exec).
pub fn clone_joined(joins: &Joins, flags: libc::c_int, min_fd: i32) -> Result<libc::pid_t, NamespaceError> {
    use std::os::fd::AsRawFd as _;
    let (report_r, report_w) = crate::sys::pipe_above(min_fd).map_err(NamespaceError::Clone)?;
    let joiner = clone_process(0)?;
    if joiner == 0 {
        // The joiner: raw system calls on what the parent prepared, then _exit. Its report
        // is (step, value): (0, the init's PID), (N, errno) when joining entry N failed,
        // (-1, errno) when the clone did.
        drop(report_r);
        let mut failed = (0, 0);
        for (step, (fd, nstype, _, _)) in joins.entries.iter().enumerate() {
            // SAFETY: setns on a namespace descriptor the parent opened; this process has one
            // thread, as joining a user namespace requires.
            if unsafe { libc::setns(fd.as_raw_fd(), *nstype) } != 0 {
                failed = (step as i32 + 1, Errno::last().0);
                break;
            }
        }
        if failed.0 == 0 {
            let flags = (flags | libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong;
            // SAFETY: as in `clone_process`: no new stack and no CLONE_VM, so both processes
            // go on on their own copy of this one.
            let rc = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
            match rc {
                0 => return Ok(0),
                -1 => failed = (-1, Errno::last().0),
                init => failed = (0, init as i32),
            }
        }
        let mut report = [0u8; 8];
        report[..4].copy_from_slice(&failed.0.to_ne_bytes());
        report[4..].copy_from_slice(&failed.1.to_ne_bytes());
        let _ = crate::sys::write_all(report_w.as_raw_fd(), &report);
        crate::sys::exit_now(0);
    }
    drop(report_w);
    let mut report = [0u8; 8];
    let read = crate::sys::read_full(report_r.as_raw_fd(), &mut report);
    // The joiner exits right after its report: reap it, so it is no zombie of ours.
    crate::sys::reap(joiner);
    if read != Ok(8) {
        return Err(NamespaceError::Clone(Errno(libc::EPIPE)));
    }
    let step = i32::from_ne_bytes([report[0], report[1], report[2], report[3]]);
    let value = i32::from_ne_bytes([report[4], report[5], report[6], report[7]]);
    match step {
        0 => Ok(value),
        -1 => Err(NamespaceError::Clone(Errno(value))),
        step => {
            let (_, _, kind, path) = &joins.entries[(step - 1) as usize];
            Err(NamespaceError::Join {
                kind,
                path: path.clone(),
                errno: Errno(value),
            })
        }
    }
}

/// Mount points strictly under `/proc` or `/sys` in a `/proc/self/mountinfo` text, deepest
/// first; never the cgroup hierarchies (`/sys/fs/cgroup`), which the runtime writes to and
/// which cover an empty directory of sysfs, hiding nothing.
fn masking_submounts(mountinfo: &str) -> Vec<String> {
    let mut points: Vec<String> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        // Octal escapes (`\040` for a space) are left as they are: such a path is not one a
        // runtime masks, and unmounting it by its escaped name simply fails.
        .filter(|point| point.starts_with("/proc/") || point.starts_with("/sys/"))
        .filter(|point| *point != "/sys/fs/cgroup" && !point.starts_with("/sys/fs/cgroup/"))
        .map(str::to_string)
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.matches('/').count()));
    points.dedup();
    points
}

/// The mounts under `/proc` and `/sys` as [`masking_submounts`] picks them, found through
/// `listmount` and `statmount` (Linux 6.8): only those mounts are looked at. Reading
/// `/proc/self/mountinfo` instead makes the kernel print every mount of the namespace, and a
/// node's namespace holds two or more per sandbox: with a thousand sandboxes running, that
/// read took a tenth of the host's CPU while sandboxes were being created. `None` where the
/// kernel lacks the calls.
fn listed_submounts() -> Option<Vec<String>> {
    let text: String = listed_points()?
        .iter()
        .map(|p| format!("0 0 0:0 / {p} rw - x x rw\n"))
        .collect();
    Some(masking_submounts(&text))
}

/// Every mount point at or under `/proc` and `/sys`, through `listmount` and `statmount`.
fn listed_points() -> Option<Vec<String>> {
    let (mut points, mut seen) = (Vec::new(), std::collections::HashSet::new());
    for top in ["/proc", "/sys"] {
        let path = std::ffi::CString::new(top).ok()?;
        walk_mounts(unique_mount_id(&path)?, top, &mut points, &mut seen, 0)?;
    }
    Some(points)
}

/// `STATX_MNT_ID_UNIQUE`, and the system calls of `<asm/unistd_64.h>` that libc does not name.
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;
const SYS_STATMOUNT: libc::c_long = 457;
const SYS_LISTMOUNT: libc::c_long = 458;
/// `STATMOUNT_MNT_POINT`: ask for the mount point.
const STATMOUNT_MNT_POINT: u64 = 0x10;
/// `struct statmount`: where its `mask` and `mnt_point` (an offset into the strings) are, and
/// where its strings start.
const STATMOUNT_MASK_AT: usize = 8;
const STATMOUNT_POINT_AT: usize = 108;
const STATMOUNT_STRINGS_AT: usize = 512;
/// How deep mounts under `/proc` and `/sys` are followed.
const MAX_DEPTH: usize = 16;

/// `struct mnt_id_req`, its first version.
#[repr(C)]
struct MountIdRequest {
    size: u32,
    spare: u32,
    mnt_id: u64,
    param: u64,
}

/// The 64-bit ID of the mount `path` is on.
fn unique_mount_id(path: &std::ffi::CStr) -> Option<u64> {
    // SAFETY: an all-zero statx is a valid value of the plain struct the kernel fills.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statx the kernel may write.
    let rc = unsafe { libc::statx(libc::AT_FDCWD, path.as_ptr(), 0, STATX_MNT_ID_UNIQUE, &mut stx) };
    (rc == 0 && stx.stx_mask & STATX_MNT_ID_UNIQUE != 0).then_some(stx.stx_mnt_id)
}

/// Adds to `points` the mount point of every mount below mount `id` whose point is `top` or
/// under it, following those; each mount once (`seen`), whether the kernel lists a mount's
/// children alone or all below it.
fn walk_mounts(
    id: u64,
    top: &str,
    points: &mut Vec<String>,
    seen: &mut std::collections::HashSet<u64>,
    depth: usize,
) -> Option<()> {
    if depth > MAX_DEPTH {
        return Some(());
    }
    let inside = format!("{top}/");
    for child in child_mounts(id)? {
        if !seen.insert(child) {
            continue;
        }
        let point = mount_point(child)?;
        if point == top || point.starts_with(&inside) {
            walk_mounts(child, top, points, seen, depth + 1)?;
            points.push(point);
        }
    }
    Some(())
}

/// The IDs of the mounts right below mount `id`.
fn child_mounts(id: u64) -> Option<Vec<u64>> {
    let mut children = Vec::new();
    let mut batch = [0u64; 64];
    let mut request = MountIdRequest {
        size: std::mem::size_of::<MountIdRequest>() as u32,
        spare: 0,
        mnt_id: id,
        param: 0,
    };
    loop {
        // SAFETY: a request of its own size, and room for `batch.len()` IDs.
        let n = unsafe {
            libc::syscall(
                SYS_LISTMOUNT,
                &request as *const MountIdRequest,
                batch.as_mut_ptr(),
                batch.len(),
                0u32,
            )
        };
        let n = usize::try_from(n).ok()?;
        children.extend_from_slice(&batch[..n.min(batch.len())]);
        match batch[..n.min(batch.len())].last() {
            // The next batch starts after the last ID of this one.
            Some(last) if n == batch.len() => request.param = *last,
            _ => return Some(children),
        }
    }
}

/// The mount point of mount `id`, as this process sees it.
fn mount_point(id: u64) -> Option<String> {
    let request = MountIdRequest {
        size: std::mem::size_of::<MountIdRequest>() as u32,
        spare: 0,
        mnt_id: id,
        param: STATMOUNT_MNT_POINT,
    };
    let mut buffer = vec![0u64; 1024];
    // SAFETY: a request of its own size, and a buffer of the size given.
    let rc = unsafe {
        libc::syscall(
            SYS_STATMOUNT,
            &request as *const MountIdRequest,
            buffer.as_mut_ptr(),
            buffer.len() * 8,
            0u32,
        )
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: the buffer's bytes, as many as it holds.
    let bytes = unsafe { std::slice::from_raw_parts(buffer.as_ptr().cast::<u8>(), buffer.len() * 8) };
    let mask = u64::from_ne_bytes(bytes.get(STATMOUNT_MASK_AT..STATMOUNT_MASK_AT + 8)?.try_into().ok()?);
    if mask & STATMOUNT_MNT_POINT == 0 {
        return None;
    }
    let at = u32::from_ne_bytes(bytes.get(STATMOUNT_POINT_AT..STATMOUNT_POINT_AT + 4)?.try_into().ok()?);
    let text = bytes.get(STATMOUNT_STRINGS_AT + at as usize..)?;
    let end = text.iter().position(|b| *b == 0)?;
    String::from_utf8(text[..end].to_vec()).ok()
}

/// When this process runs where `/proc` or `/sys` have mounts over parts of them (Docker and
/// other runtimes mask `/proc/kcore`, `/proc/keys`, `/proc/sys`, `/sys/firmware`, ... in the
/// containers they run, which is where a node runs under compose), the kernel refuses a new
/// `proc` or `sysfs` mount in any user namespace below: it would reveal what the masks hide. So before the
/// sandbox's process is created, this process moves into a mount namespace of its own
/// (its mounts made slaves first, so nothing here reaches the node's or the host's mount
/// table) and lifts the masks there; the sandbox inherits that view and mounts its own
/// `/proc` and `/sys`, which the sandbox's own masked paths (the spec's) then cover again.
/// With nothing mounted under them, nothing is done. Must be called single-threaded.
pub fn unmask_proc_and_sys() -> Result<usize, NamespaceError> {
    let masks = match listed_submounts() {
        Some(masks) => masks,
        None => {
            let mountinfo = fs::read_to_string("/proc/self/mountinfo").map_err(|e| NamespaceError::Unmask {
                what: "read /proc/self/mountinfo",
                errno: Errno(e.raw_os_error().unwrap_or(libc::EIO)),
            })?;
            masking_submounts(&mountinfo)
        }
    };
    if masks.is_empty() {
        return Ok(0);
    }
    crate::view::own_namespace().map_err(|(what, errno)| NamespaceError::Unmask { what, errno })?;
    let mut lifted = 0;
    for point in masks {
        let Ok(path) = std::ffi::CString::new(point) else {
            continue;
        };
        // SAFETY: umount2 of a NUL-terminated path.
        if unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) } == 0 {
            lifted += 1;
        }
    }
    Ok(lifted)
}

/// Creates the child process with `flags` (`CLONE_NEW*`). Returns the child's host PID in
/// the parent and 0 in the child, like `fork`.
///
/// This is the raw system call without a new stack, which behaves as `fork` does at the
/// kernel level. glibc's `fork()` wrapper would not let us pass namespace flags; its
/// `clone()` wrapper needs a separate stack for a callback. The child must only use
/// memory prepared before the call (see `init`).
pub fn clone_process(flags: libc::c_int) -> Result<libc::pid_t, NamespaceError> {
    let flags = (flags | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: clone without CLONE_VM or a new stack duplicates the address space, so both
    // processes continue on their own copy of this stack, as after fork().
    let rc = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    check_long(rc).map(|p| p as libc::pid_t).map_err(NamespaceError::Clone)
}

/// [`clone_process`], with the new user namespace (if `flags` make one) owned by host uid
/// `owner` rather than by the caller (see the module's doc): the calling thread is
/// [`AsOwner`] for the clone alone. Only a caller that is root does this (anyone else owns
/// what it makes, and could not set it back).
pub fn clone_owned(flags: libc::c_int, owner: Option<u32>) -> Result<libc::pid_t, NamespaceError> {
    let owner =
        owner.filter(|&uid| uid != 0 && flags & libc::CLONE_NEWUSER != 0 && rustix::process::geteuid().is_root());
    let Some(uid) = owner else {
        return clone_process(flags);
    };
    let as_owner = AsOwner::become_owner(uid)?;
    let pid = clone_process(flags);
    if matches!(pid, Ok(0)) {
        // The child: its ids and securebits are those of its new namespace from here on
        // (`become_root`); nothing of the parent's to give back.
        drop(as_owner);
        return pid;
    }
    as_owner.restore()?;
    pid
}

/// This thread, for a moment, with a user namespace's owner-to-be as its effective uid, so
/// that a namespace it creates is that uid's. The raw system calls change this thread only
/// (glibc's `setresuid` would signal every thread of the process to follow), and the real
/// and saved uids stay root, so root can be taken back.
///
/// Two side effects are undone on the way back: [`AsOwner::restore`] says which. It must be
/// called (dropping it leaves the thread as the owner); a clone's child drops it.
#[must_use = "the thread stays the owner until restored"]
pub struct AsOwner {
    /// One at a time in a process: the dumpable flag is the process's, and one thread saving
    /// it while another has it cleared would set it back cleared.
    _alone: std::sync::MutexGuard<'static, ()>,
    uid: u32,
    /// The securebits to set back, if they were changed.
    securebits: Option<libc::c_int>,
    dumpable: libc::c_int,
}

/// `SECBIT_NO_SETUID_FIXUP` (linux/securebits.h).
const SECBIT_NO_SETUID_FIXUP: libc::c_int = 1 << 2;

impl AsOwner {
    /// Takes on `uid`, keeping this thread's capabilities: `SECBIT_NO_SETUID_FIXUP` first
    /// (needs CAP_SETPCAP; without it they are cleared), since a user namespace made without
    /// them counts as an unprivileged one, which hosts may forbid (Ubuntu's AppArmor
    /// restriction, Debian's `unprivileged_userns_clone`). A new user namespace starts with
    /// the default securebits, so none of this reaches it.
    pub fn become_owner(uid: u32) -> Result<AsOwner, NamespaceError> {
        static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let alone = ALONE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let err = |errno| NamespaceError::Owner { uid, errno };
        // SAFETY: prctl reads of this thread's and process's flags.
        let (securebits, dumpable) = unsafe {
            (
                check(libc::prctl(libc::PR_GET_SECUREBITS)).map_err(err)?,
                check(libc::prctl(libc::PR_GET_DUMPABLE)).map_err(err)?,
            )
        };
        // SAFETY: prctl with integer arguments. A failure only clears the capabilities.
        let kept = unsafe {
            libc::prctl(
                libc::PR_SET_SECUREBITS,
                (securebits | SECBIT_NO_SETUID_FIXUP) as libc::c_ulong,
            )
        };
        let securebits = (kept == 0).then_some(securebits);
        if let Err(e) = set_euid(uid) {
            if let Some(bits) = securebits {
                // SAFETY: prctl with integer arguments: the bits this thread had.
                unsafe { libc::prctl(libc::PR_SET_SECUREBITS, bits as libc::c_ulong) };
            }
            return Err(e);
        }
        Ok(AsOwner {
            _alone: alone,
            uid,
            securebits,
            dumpable,
        })
    }

    /// Root again, with the securebits as they were, and the process's dumpable flag: any
    /// change of effective uid makes the whole process non-dumpable, after which its
    /// `/proc/PID` files (the node's `/proc/NODE/fd/N`, which runtimes open to join a slot)
    /// are out of reach of anyone without CAP_SYS_PTRACE.
    pub fn restore(self) -> Result<(), NamespaceError> {
        let err = |errno| NamespaceError::Owner { uid: self.uid, errno };
        set_euid(0)?;
        // SAFETY: prctl with integer arguments.
        unsafe {
            if let Some(bits) = self.securebits {
                check(libc::prctl(libc::PR_SET_SECUREBITS, bits as libc::c_ulong)).map_err(err)?;
            }
            // 2 (`suid_dumpable` 2) cannot be set back; 0 needs nothing.
            if self.dumpable == 1 {
                check(libc::prctl(libc::PR_SET_DUMPABLE, 1 as libc::c_ulong)).map_err(err)?;
            }
        }
        Ok(())
    }
}

/// Sets this thread's effective uid, leaving the real and saved ones (root) as they are.
fn set_euid(uid: u32) -> Result<(), NamespaceError> {
    const UNCHANGED: libc::c_long = -1;
    // SAFETY: a system call on plain values.
    let rc = unsafe { libc::syscall(libc::SYS_setresuid, UNCHANGED, libc::c_long::from(uid), UNCHANGED) };
    check_long(rc)
        .map(drop)
        .map_err(|errno| NamespaceError::Owner { uid, errno })
}

/// The host uid that root inside maps to, which is to own a new user namespace.
pub fn owner_of(uids: &[LinuxIdMapping]) -> Option<u32> {
    uids.iter().find(|m| m.container_id() == 0).map(|m| m.host_id())
}

/// The text of a `uid_map`/`gid_map` file: one `inside outside count` line per range.
pub fn id_map_text(maps: &[LinuxIdMapping]) -> String {
    let mut s = String::new();
    for m in maps {
        let _ = writeln!(s, "{} {} {}", m.container_id(), m.host_id(), m.size());
    }
    s
}

/// The ranges of an id map as `/proc/PID/uid_map` shows them (columns padded with spaces).
fn parsed_id_map(text: &str) -> Vec<[u64; 3]> {
    text.lines()
        .filter_map(|line| {
            let mut n = line.split_whitespace().map(|v| v.parse::<u64>());
            match (n.next(), n.next(), n.next()) {
                (Some(Ok(a)), Some(Ok(b)), Some(Ok(c))) => Some([a, b, c]),
                _ => None,
            }
        })
        .collect()
}

/// Checks that the child (in a joined user namespace) has exactly the spec's uid and gid
/// maps (parent side).
pub fn check_id_maps(pid: libc::pid_t, uids: &[LinuxIdMapping], gids: &[LinuxIdMapping]) -> Result<(), NamespaceError> {
    for (file, maps) in [("uid_map", uids), ("gid_map", gids)] {
        let path = PathBuf::from(format!("/proc/{pid}/{file}"));
        let found = fs::read_to_string(&path).map_err(|source| NamespaceError::IdMap {
            path: path.clone(),
            source,
        })?;
        let mut found = parsed_id_map(&found);
        let mut want: Vec<[u64; 3]> = maps
            .iter()
            .map(|m| [m.container_id(), m.host_id(), m.size()].map(u64::from))
            .collect();
        found.sort_unstable();
        want.sort_unstable();
        if found != want {
            return Err(NamespaceError::JoinedMaps { file, found, want });
        }
    }
    Ok(())
}

/// Writes the child's uid and gid maps (parent side; each file takes one write).
pub fn write_id_maps(pid: libc::pid_t, uids: &[LinuxIdMapping], gids: &[LinuxIdMapping]) -> Result<(), NamespaceError> {
    for (file, maps) in [("uid_map", uids), ("gid_map", gids)] {
        let path = PathBuf::from(format!("/proc/{pid}/{file}"));
        fs::write(&path, id_map_text(maps)).map_err(|source| NamespaceError::IdMap { path, source })?;
    }
    Ok(())
}

/// Child: become uid/gid 0 of the new user namespace (until now the child's ids are
/// unmapped and show as the overflow id). Capabilities are kept: they are relative to the
/// namespace, and uid 0 there is its root.
pub fn become_root() -> Result<(), NamespaceError> {
    // SAFETY: plain id-changing system calls.
    unsafe {
        check(libc::setresgid(0, 0, 0)).map_err(NamespaceError::BecomeRoot)?;
        check(libc::setresuid(0, 0, 0)).map_err(NamespaceError::BecomeRoot)?;
    }
    Ok(())
}

/// Child: a new cgroup namespace rooted at the cgroup we were just moved into.
pub fn unshare_cgroup() -> Result<(), NamespaceError> {
    // SAFETY: unshare with a flag.
    check(unsafe { libc::unshare(libc::CLONE_NEWCGROUP) })
        .map(drop)
        .map_err(NamespaceError::CgroupNs)
}

/// Child: set the hostname of the new UTS namespace.
pub fn set_hostname(name: &std::ffi::CStr) -> Result<(), NamespaceError> {
    let b = name.to_bytes();
    // SAFETY: pointer and length of a valid buffer.
    check(unsafe { libc::sethostname(b.as_ptr().cast(), b.len()) })
        .map(drop)
        .map_err(NamespaceError::Hostname)
}

/// Child: set the NIS domain name of the new UTS namespace.
pub fn set_domainname(name: &std::ffi::CStr) -> Result<(), NamespaceError> {
    let b = name.to_bytes();
    // SAFETY: pointer and length of a valid buffer.
    check(unsafe { libc::setdomainname(b.as_ptr().cast(), b.len()) })
        .map(drop)
        .map_err(NamespaceError::Domainname)
}

/// Child: a new network namespace starts with `lo` down; bring it up as runc does, so that
/// 127.0.0.1 works inside the container. (One ioctl pair on a throwaway socket; no netlink.)
pub fn loopback_up() -> Result<(), NamespaceError> {
    // SAFETY: socket/ioctl/close on a descriptor we own, with a zeroed ifreq naming "lo".
    unsafe {
        let fd = check(libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0))
            .map_err(NamespaceError::Loopback)?;
        let mut req: libc::ifreq = std::mem::zeroed();
        for (i, b) in b"lo".iter().enumerate() {
            req.ifr_name[i] = *b as libc::c_char;
        }
        let mut r = check(libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req));
        if r.is_ok() {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            r = check(libc::ioctl(fd, libc::SIOCSIFFLAGS, &req));
        }
        libc::close(fd);
        r.map(drop).map_err(NamespaceError::Loopback)
    }
}

#[cfg(test)]
mod proc_tests {
    use super::{listed_points, listed_submounts, masking_submounts};

    /// The mounts listed under `/proc` and `/sys` are those the whole table shows there, the
    /// cgroup hierarchies included before they are left out (on a kernel with listmount, as
    /// these hosts have; every host with cgroups mounts something under `/sys`).
    #[test]
    fn listed_mounts_are_those_of_mountinfo() {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let under = |p: &str| p.starts_with("/proc/") || p.starts_with("/sys/");
        let mut read: Vec<String> = mountinfo
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| under(p))
            .map(str::to_string)
            .collect();
        let mut listed: Vec<String> = listed_points()
            .expect("listmount and statmount (Linux 6.8)")
            .into_iter()
            .filter(|p| under(p))
            .collect();
        read.sort();
        listed.sort();
        assert!(!read.is_empty(), "nothing mounted under /proc or /sys to compare");
        assert_eq!(listed, read);
        let mut masks = masking_submounts(&mountinfo);
        let mut listed_masks = listed_submounts().unwrap();
        masks.sort();
        listed_masks.sort();
        assert_eq!(listed_masks, masks);
    }

    #[test]
    fn the_mounts_over_proc_and_sys_are_found_deepest_first_and_cgroups_kept() {
        let mountinfo = "\
22 1 0:21 / / rw,relatime - overlay overlay rw
23 22 0:22 / /proc rw,nosuid - proc proc rw
24 23 0:23 / /proc/bus ro,relatime - proc proc ro
25 23 0:5 /null /proc/kcore rw,nosuid - devtmpfs udev rw
26 23 0:24 / /proc/sys ro - proc proc ro
27 26 0:25 / /proc/sys/fs/binfmt_misc rw - binfmt_misc binfmt_misc rw
28 22 0:26 / /sys ro - sysfs sysfs ro
29 22 0:27 / /processes rw - tmpfs tmpfs rw
30 28 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw
31 30 0:29 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
32 28 0:30 / /sys/firmware ro - tmpfs tmpfs ro";
        assert_eq!(
            masking_submounts(mountinfo),
            [
                "/proc/sys/fs/binfmt_misc",
                "/proc/bus",
                "/proc/kcore",
                "/proc/sys",
                "/sys/firmware"
            ]
        );
        assert!(masking_submounts("23 22 0:22 / /proc rw - proc proc rw").is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_map_lines() {
        let maps: Vec<LinuxIdMapping> = serde_json::from_value(serde_json::json!([
            {"containerID": 0, "hostID": 100000, "size": 65536},
            {"containerID": 65536, "hostID": 5000, "size": 1}
        ]))
        .unwrap();
        assert_eq!(id_map_text(&maps), "0 100000 65536\n65536 5000 1\n");
    }
}
