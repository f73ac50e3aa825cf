//! The mount table a container is cloned from: the helper's own, kept small, and the
//! container's root handed over as a mount rather than found in the host's table.
//!
//! A container's mount namespace starts as a copy of its creator's (`clone(CLONE_NEWNS)`),
//! and `pivot_root` then detaches everything but its own root. On a node that creator was in
//! the host's namespace, which holds two mounts per sandbox (its disk and its root), so every
//! create copied a thousand mounts at a thousand sandboxes to throw them away again, and worse:
//! when a sandbox was killed while a create was between its copy and its detach, the last
//! reference to that sandbox's file systems was the new container's copy. The create's own
//! detach then tore them down (an ext4 superblock's sync, a device flush, a discard, its loop
//! device's removal), which held a create made during a burst of kills for seconds.
//!
//! So, when the node asks:
//! - the helper moves into a mount namespace of its own at start ([`private_view`]) and
//!   detaches there every mount below the folders the node names (its sandboxes' disks and
//!   roots). What a container needs from the host (`/usr`, the node's binaries, the run
//!   folder holding bundles) stays: their files, not the sandboxes' mounts, are what a
//!   container reads. Its mounts are made slaves: nothing it does reaches the host's table,
//!   and where the host's mounts propagate (a systemd host's `/` is shared) the host's mounts
//!   and unmounts reach it, so it never keeps a file system the host has unmounted alive.
//!   Where they do not (a host whose `/` is private, as in many containers), the helper keeps
//!   a file system the host mounted before it started, and unmounts while it runs, until it
//!   ends: the node's own sandboxes' are never among them (detached here), another node's on
//!   the same host may be. (On a host whose mounts propagate, the disks the node mounts after
//!   the helper started reach its table too: a create copies them again, but their unmounts
//!   propagate, so a create never tears one down. Making the sandboxes' folder a private mount
//!   of its own would keep them out; not done.);
//! - the node builds each root as a detached mount (an overlay made with `fsmount`, attached
//!   nowhere; where the kernel cannot, mounted, copied with `open_tree` and unmounted again)
//!   and sends it with the run; the run moves into a namespace of its own copied from
//!   the helper's and attaches it at the bundle's root path ([`attach_root`]). The container's
//!   namespace is then copied from that one, as before, so the kernel locks the root's flags
//!   (`nosuid`, `nodev`) against the container's root exactly as it locks a copied host mount.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::sys::{check, Errno};

/// Why the helper's view or a container's root could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error("a mount namespace of the helper's own: {what}: {errno}")]
    Private { what: &'static str, errno: Errno },
    #[error("attach the container's root at {at}: {what}: {errno}")]
    Attach {
        at: PathBuf,
        what: &'static str,
        errno: Errno,
    },
}

/// Moves this process into a mount namespace of its own, a copy of its current one with every
/// mount made a slave: nothing mounted or unmounted here reaches the namespace it came from.
/// On failure, the step that failed. Must be called single-threaded.
pub(crate) fn own_namespace() -> Result<(), (&'static str, Errno)> {
    // SAFETY: unshare and mount with constant, NUL-terminated arguments.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS)).map_err(|e| ("unshare the mount namespace", e))?;
        check(libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        ))
        .map_err(|e| ("make every mount a slave", e))?;
    }
    Ok(())
}

/// Moves this process into a mount namespace of its own (every mount a slave) and detaches
/// there the mounts strictly below one of `below` (the folders themselves stay as they are
/// mounted; a mount that would not go stays: the view is smaller, not required). Must be
/// called single-threaded.
pub fn private_view(below: &[PathBuf]) -> Result<(), ViewError> {
    // Mount points are read as the kernel prints them: canonical. A folder named through a
    // symlink or relatively would match none of them.
    let below: Vec<PathBuf> = below
        .iter()
        .map(|b| std::fs::canonicalize(b).unwrap_or_else(|_| b.clone()))
        .collect();
    own_namespace().map_err(|(what, errno)| ViewError::Private { what, errno })?;
    // Read once, at the helper's start. Disks the node mounts later reach this table only
    // where the host's mounts propagate, and then so do their unmounts.
    let mountinfo = std::fs::read("/proc/self/mountinfo").map_err(|e| ViewError::Private {
        what: "read /proc/self/mountinfo",
        errno: Errno(e.raw_os_error().unwrap_or(libc::EIO)),
    })?;
    for point in outermost_below(&mountinfo, &below) {
        let Ok(path) = std::ffi::CString::new(point.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // A detach takes the mounts on that mount along; several mounts stacked on one point
        // go one at a time, until none is left (EINVAL: not a mount point any more).
        // SAFETY: umount2 of a NUL-terminated path.
        while unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) } == 0 {}
    }
    Ok(())
}

/// The mount points of `mountinfo` strictly below one of `below` and below no other such
/// point, shallowest first.
fn outermost_below(mountinfo: &[u8], below: &[PathBuf]) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStringExt as _;
    let mut points: Vec<PathBuf> = mountinfo
        .split(|b| *b == b'\n')
        .filter_map(|line| line.split(|b| *b == b' ').nth(4))
        .map(|p| PathBuf::from(std::ffi::OsString::from_vec(unescape(p))))
        .filter(|p| below.iter().any(|b| p.starts_with(b) && p != b))
        .collect();
    points.sort_by(|a, b| {
        a.components()
            .count()
            .cmp(&b.components().count())
            .then_with(|| a.cmp(b))
    });
    points.dedup();
    let mut outermost: Vec<PathBuf> = Vec::new();
    for p in points {
        if !outermost.iter().any(|o| p.starts_with(o)) {
            outermost.push(p);
        }
    }
    outermost
}

/// A mountinfo path with its octal escapes (`\040` for a space, `\134` for a backslash) read.
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let octal = field
            .get(i + 1..i + 4)
            .filter(|d| field[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') << 6 | (d[1] - b'0') << 3 | (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(field[i]);
                i += 1;
            }
        }
    }
    out
}

/// Moves this process into a mount namespace of its own (a copy of its creator's, every mount
/// a slave so nothing done here reaches the creator's) and attaches `tree`, a detached mount,
/// at `at`. The descriptor is closed: the namespace holds the mount now. Must be called
/// single-threaded, before the container's process is cloned.
pub fn attach_root(tree: OwnedFd, at: &Path) -> Result<(), ViewError> {
    let fail = |what| {
        move |errno| ViewError::Attach {
            at: at.to_path_buf(),
            what,
            errno,
        }
    };
    let target = std::ffi::CString::new(at.as_os_str().as_encoded_bytes()).map_err(|_| ViewError::Attach {
        at: at.to_path_buf(),
        what: "the path",
        errno: Errno(libc::EINVAL),
    })?;
    own_namespace().map_err(|(what, errno)| fail(what)(errno))?;
    // SAFETY: `tree` is an open mount descriptor, named by the empty path; `target` is a
    // NUL-terminated path.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    crate::sys::check_long(rc).map_err(fail("move_mount"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 8:1 / / rw - ext4 /dev/sda1 rw
30 22 0:40 / /state/run rw - tmpfs tmpfs rw
31 30 0:41 / /state/run/a/bundle/rootfs rw - overlay overlay rw
32 22 7:0 / /state/sandboxes/a/disk rw - ext4 /dev/loop0 rw
33 32 0:42 / /state/sandboxes/a/disk/inner rw - tmpfs tmpfs rw
34 22 7:1 / /state/sandboxes\\040b/disk rw - ext4 /dev/loop1 rw
35 22 0:43 / /state/sandboxes-other/x rw - tmpfs tmpfs rw
36 22 0:44 / /usr/local rw - tmpfs tmpfs rw
";

    #[test]
    fn only_the_outermost_mounts_strictly_below_the_folders_are_detached() {
        let below = [PathBuf::from("/state/run"), PathBuf::from("/state/sandboxes")];
        assert_eq!(
            outermost_below(MOUNTINFO.as_bytes(), &below),
            vec![
                PathBuf::from("/state/sandboxes/a/disk"),
                PathBuf::from("/state/run/a/bundle/rootfs"),
            ],
            "the run folder's own mount stays, a nested mount goes with its parent, a folder \
             that merely shares a prefix is not below"
        );
        assert_eq!(
            outermost_below(MOUNTINFO.as_bytes(), &[PathBuf::from("/state")]),
            vec![
                PathBuf::from("/state/run"),
                PathBuf::from("/state/sandboxes b/disk"),
                PathBuf::from("/state/sandboxes-other/x"),
                PathBuf::from("/state/sandboxes/a/disk"),
            ]
        );
    }

    #[test]
    fn octal_escapes_are_read() {
        assert_eq!(unescape(b"/a\\040b\\134c"), b"/a b\\c");
        assert_eq!(unescape(b"/plain"), b"/plain");
        assert_eq!(unescape(b"/cut\\04"), b"/cut\\04");
        assert_eq!(unescape(b"/not\\377utf8"), b"/not\xffutf8");
    }
}
