//! Carrying out a [`RootfsPlan`] in the container's init: mounts, devices, masked and
//! read-only paths, `pivot_root`, in the order the module above describes. Nothing here
//! allocates or parses: the plan holds everything ready.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use libc::c_ulong;

use super::options::{MountOptions, PathPlan, ATIME_FLAGS};
use super::plan::{MountKind, MountPlan, RootfsPlan};
use crate::sys::{self, fd_path, openat2, CDisplay, Errno};

/// Errors while setting up the rootfs in the container's init. They borrow the plan's
/// strings so that reporting them does not allocate.
#[derive(Debug, thiserror::Error)]
pub enum SetupError<'a> {
    #[error("make / {what}: {errno}")]
    RootPropagation { what: &'static str, errno: Errno },
    #[error("bind-mount rootfs {path} onto itself: {errno}")]
    BindRootfs { path: &'a str, errno: Errno },
    #[error("open rootfs {path}: {errno}")]
    OpenRootfs { path: &'a str, errno: Errno },
    #[error("resolve {path} in the rootfs: {errno}")]
    Resolve { path: &'a str, errno: Errno },
    #[error("mount {what} on {target}: {errno}")]
    Mount {
        what: &'a str,
        target: &'a str,
        errno: Errno,
    },
    #[error("remount {target} with flags {flags:#x}: {errno}")]
    Remount {
        target: &'a str,
        flags: c_ulong,
        errno: Errno,
    },
    #[error("set propagation of {target}: {errno}")]
    Propagation { target: &'a str, errno: Errno },
    #[error("bind device {path}: {errno}")]
    Device { path: &'a str, errno: Errno },
    #[error("create symlink /dev/{name}: {errno}")]
    Symlink { name: CDisplay<'a>, errno: Errno },
    #[error("mask {path}: {errno}")]
    Mask { path: &'a str, errno: Errno },
    #[error("make {path} read-only: {errno}")]
    ReadonlyPath { path: &'a str, errno: Errno },
    #[error("{step}: {errno}")]
    Pivot { step: &'static str, errno: Errno },
}

const ST_RDONLY: c_ulong = 1;
const ST_NOSUID: c_ulong = 2;
const ST_NODEV: c_ulong = 4;
const ST_NOEXEC: c_ulong = 8;
const ST_NOATIME: c_ulong = 1024;
const ST_NODIRATIME: c_ulong = 2048;
const ST_RELATIME: c_ulong = 4096;

/// Flags a remount may change on a bind mount (MS_BIND only takes MS_REC at first).
const REMOUNT_FLAGS: c_ulong = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | ATIME_FLAGS;

/// Openat2 resolution for every path inside the rootfs.
const RESOLVE: u64 = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;

/// `/dev` symlinks, as runc creates them.
const DEV_SYMLINKS: [(&CStr, &CStr); 4] = [
    (c"/proc/self/fd", c"fd"),
    (c"/proc/self/fd/0", c"stdin"),
    (c"/proc/self/fd/1", c"stdout"),
    (c"/proc/self/fd/2", c"stderr"),
];

/// What to do when a path does not exist yet.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Create {
    No,
    Dir,
    File,
}

/// Resolves `p` inside the rootfs (`rootfd`) to an `O_PATH` descriptor, creating missing
/// components if asked. Symlinks are followed as if `rootfd` were `/`.
fn resolve(rootfd: RawFd, p: &PathPlan, create: Create) -> Result<OwnedFd, Errno> {
    match openat2(rootfd, &p.full, libc::O_PATH, RESOLVE) {
        Err(e) if e.0 == libc::ENOENT && create != Create::No => {}
        r => return r,
    }
    let mut parent: Option<OwnedFd> = None;
    for (i, (prefix, name)) in p.prefixes.iter().zip(&p.names).enumerate() {
        match openat2(rootfd, prefix, libc::O_PATH, RESOLVE) {
            Ok(fd) => {
                parent = Some(fd);
                continue;
            }
            Err(e) if e.0 == libc::ENOENT => {}
            Err(e) => return Err(e),
        }
        let pfd = parent.as_ref().map_or(rootfd, |f| f.as_raw_fd());
        let last = i + 1 == p.names.len();
        if last && create == Create::File {
            // O_NOFOLLOW|O_EXCL: never open through a symlink someone placed here.
            // SAFETY: `name` is a valid C string; the descriptor is closed right away.
            let fd = unsafe {
                libc::openat(
                    pfd,
                    name.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                    0o644,
                )
            };
            if fd >= 0 {
                // SAFETY: we own `fd`.
                unsafe { libc::close(fd) };
            } else if Errno::last().0 != libc::EEXIST {
                return Err(Errno::last());
            }
        } else {
            // SAFETY: `name` is a single component (no '/'), created relative to the
            // already-resolved parent.
            if unsafe { libc::mkdirat(pfd, name.as_ptr(), 0o755) } != 0 && Errno::last().0 != libc::EEXIST {
                return Err(Errno::last());
            }
        }
        parent = Some(openat2(rootfd, prefix, libc::O_PATH, RESOLVE)?);
    }
    parent.ok_or(Errno(libc::ENOENT))
}

/// The flags of the mount `fd` is on that a remount must keep: those locked in a user
/// namespace (nosuid, nodev, noexec, read-only) unless the options clear them explicitly,
/// and the atime flags unless the options set atime themselves.
fn kept_flags(fd: RawFd, opts: &MountOptions) -> Result<c_ulong, Errno> {
    // SAFETY: fstatvfs writes into the zeroed struct; O_PATH descriptors are accepted.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: the live struct above to write into; a bad descriptor is an error, not UB.
    sys::check(unsafe { libc::fstatvfs(fd, &mut st) })?;
    let f = st.f_flag;
    let mut keep = 0;
    for (st_flag, ms_flag) in [
        (ST_RDONLY, libc::MS_RDONLY),
        (ST_NOSUID, libc::MS_NOSUID),
        (ST_NODEV, libc::MS_NODEV),
        (ST_NOEXEC, libc::MS_NOEXEC),
    ] {
        if f & st_flag != 0 && opts.cleared & ms_flag == 0 {
            keep |= ms_flag;
        }
    }
    if !opts.explicit_atime {
        for (st_flag, ms_flag) in [
            (ST_NOATIME, libc::MS_NOATIME),
            (ST_NODIRATIME, libc::MS_NODIRATIME),
            (ST_RELATIME, libc::MS_RELATIME),
        ] {
            if f & st_flag != 0 {
                keep |= ms_flag;
            }
        }
    }
    Ok(keep)
}

/// Remounts the bind mount at `target` (resolved afresh, so we get the new mount and not
/// the directory under it) with `flags`, keeping the locked ones.
fn remount_bind<'a>(
    rootfd: RawFd,
    target: &'a PathPlan,
    flags: c_ulong,
    opts: &MountOptions,
) -> Result<(), SetupError<'a>> {
    let fd = resolve(rootfd, target, Create::No).map_err(|errno| SetupError::Resolve {
        path: &target.display,
        errno,
    })?;
    let all = libc::MS_REMOUNT | libc::MS_BIND | flags | kept_flags(fd.as_raw_fd(), opts).unwrap_or(0);
    let mut p = fd_path(fd.as_raw_fd());
    sys::mount(None, p.as_cstr(), None, all, None).map_err(|errno| SetupError::Remount {
        target: &target.display,
        flags: all,
        errno,
    })
}

fn do_mount<'a>(rootfd: RawFd, m: &'a MountPlan) -> Result<(), SetupError<'a>> {
    let create = if m.is_file { Create::File } else { Create::Dir };
    let fd = resolve(rootfd, &m.dest, create).map_err(|errno| SetupError::Resolve {
        path: &m.dest.display,
        errno,
    })?;
    let mut target = fd_path(fd.as_raw_fd());
    let err = |errno| SetupError::Mount {
        what: &m.what,
        target: &m.dest.display,
        errno,
    };
    match &m.kind {
        MountKind::Bind { recursive } => {
            let rec = if *recursive { libc::MS_REC } else { 0 };
            sys::mount(m.source.as_deref(), target.as_cstr(), None, libc::MS_BIND | rec, None).map_err(err)?;
            // The first bind ignores every flag but MS_REC; ro/nosuid/... need a remount.
            let flags = m.opts.flags & REMOUNT_FLAGS;
            if flags != 0 {
                remount_bind(rootfd, &m.dest, flags, &m.opts)?;
            }
        }
        MountKind::Fs { fstype } => {
            let source = m.source.as_deref().unwrap_or(fstype);
            sys::mount(
                Some(source),
                target.as_cstr(),
                Some(fstype),
                m.opts.flags,
                m.data.as_deref(),
            )
            .map_err(err)?;
        }
    }
    drop(fd);
    for &p in &m.opts.propagation {
        let fd = resolve(rootfd, &m.dest, Create::No).map_err(|errno| SetupError::Resolve {
            path: &m.dest.display,
            errno,
        })?;
        let mut t = fd_path(fd.as_raw_fd());
        sys::mount(None, t.as_cstr(), None, p, None).map_err(|errno| SetupError::Propagation {
            target: &m.dest.display,
            errno,
        })?;
    }
    Ok(())
}

fn setup_dev<'a>(rootfd: RawFd, plan: &'a RootfsPlan) -> Result<(), SetupError<'a>> {
    for d in &plan.devices {
        let fd = resolve(rootfd, &d.dest, Create::File).map_err(|errno| SetupError::Device {
            path: &d.dest.display,
            errno,
        })?;
        let mut t = fd_path(fd.as_raw_fd());
        sys::mount(Some(&d.source), t.as_cstr(), None, libc::MS_BIND, None).map_err(|errno| SetupError::Device {
            path: &d.dest.display,
            errno,
        })?;
    }
    let dev = resolve(rootfd, &plan.dev_dir, Create::Dir).map_err(|errno| SetupError::Resolve {
        path: &plan.dev_dir.display,
        errno,
    })?;
    let dfd = dev.as_raw_fd();
    // /dev/ptmx must be the devpts instance's ptmx, so replace whatever is there.
    // SAFETY: valid C strings and descriptors; symlinkat/unlinkat act relative to /dev.
    unsafe { libc::unlinkat(dfd, c"ptmx".as_ptr(), 0) };
    let links = DEV_SYMLINKS.iter().copied().chain([(c"pts/ptmx", c"ptmx")]);
    for (target, name) in links {
        // SAFETY: see above.
        if unsafe { libc::symlinkat(target.as_ptr(), dfd, name.as_ptr()) } != 0 {
            let errno = Errno::last();
            if errno.0 != libc::EEXIST {
                return Err(SetupError::Symlink {
                    name: CDisplay(name),
                    errno,
                });
            }
        }
    }
    Ok(())
}

/// Masks paths: `/dev/null` over files, an empty read-only tmpfs over directories.
/// Paths that do not exist are skipped (they may be absent on this kernel).
fn mask_paths<'a>(rootfd: RawFd, paths: &'a [PathPlan]) -> Result<(), SetupError<'a>> {
    for p in paths {
        let fd = match resolve(rootfd, p, Create::No) {
            Ok(fd) => fd,
            Err(e) if e.0 == libc::ENOENT => continue,
            Err(errno) => {
                return Err(SetupError::Mask {
                    path: &p.display,
                    errno,
                })
            }
        };
        // SAFETY: fstat on an O_PATH descriptor into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: an open descriptor and the live struct above to write into.
        sys::check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }).map_err(|errno| SetupError::Mask {
            path: &p.display,
            errno,
        })?;
        let mut t = fd_path(fd.as_raw_fd());
        let r = if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            sys::mount(Some(c"tmpfs"), t.as_cstr(), Some(c"tmpfs"), libc::MS_RDONLY, None)
        } else {
            sys::mount(Some(c"/dev/null"), t.as_cstr(), None, libc::MS_BIND, None)
        };
        r.map_err(|errno| SetupError::Mask {
            path: &p.display,
            errno,
        })?;
    }
    Ok(())
}

/// Makes paths read-only: bind each onto itself, then remount read-only keeping the locked
/// flags. Missing paths are skipped.
fn readonly_paths<'a>(rootfd: RawFd, paths: &'a [PathPlan]) -> Result<(), SetupError<'a>> {
    for p in paths {
        let fd = match resolve(rootfd, p, Create::No) {
            Ok(fd) => fd,
            Err(e) if e.0 == libc::ENOENT => continue,
            Err(errno) => {
                return Err(SetupError::ReadonlyPath {
                    path: &p.display,
                    errno,
                })
            }
        };
        let mut t = fd_path(fd.as_raw_fd());
        let t = t.as_cstr();
        sys::mount(Some(t), t, None, libc::MS_BIND | libc::MS_REC, None).map_err(|errno| SetupError::ReadonlyPath {
            path: &p.display,
            errno,
        })?;
        drop(fd);
        remount_bind(rootfd, p, libc::MS_RDONLY, &MountOptions::default())?;
    }
    Ok(())
}

/// Builds the container's filesystem and switches the root to it. Runs in the child, in
/// the new mount namespace; leaves the working directory at the new `/`.
pub fn setup(plan: &RootfsPlan) -> Result<(), SetupError<'_>> {
    let pivot = |step, errno| SetupError::Pivot { step, errno };
    sys::mount(None, c"/", None, plan.root_propagation, None).map_err(|errno| SetupError::RootPropagation {
        what: "slave/private",
        errno,
    })?;
    sys::mount(
        Some(&plan.rootfs),
        &plan.rootfs,
        None,
        libc::MS_BIND | libc::MS_REC,
        None,
    )
    .map_err(|errno| SetupError::BindRootfs {
        path: &plan.rootfs_display,
        errno,
    })?;
    // Opened after the bind, so this names the new mount, not the directory under it.
    let root = openat2(libc::AT_FDCWD, &plan.rootfs, libc::O_PATH | libc::O_DIRECTORY, 0).map_err(|errno| {
        SetupError::OpenRootfs {
            path: &plan.rootfs_display,
            errno,
        }
    })?;
    let rootfd = root.as_raw_fd();

    for m in &plan.mounts {
        do_mount(rootfd, m)?;
    }
    if plan.setup_dev {
        setup_dev(rootfd, plan)?;
    }
    if !plan.cwd.is_root() {
        // runc creates a missing working directory rather than failing.
        resolve(rootfd, &plan.cwd, Create::Dir).map_err(|errno| SetupError::Resolve {
            path: &plan.cwd.display,
            errno,
        })?;
    }
    mask_paths(rootfd, &plan.masked)?;
    readonly_paths(rootfd, &plan.readonly_paths)?;

    // SAFETY: fchdir on our O_PATH descriptor of the rootfs mount.
    sys::check(unsafe { libc::fchdir(rootfd) }).map_err(|e| pivot("chdir to rootfs", e))?;
    if plan.no_pivot {
        sys::mount(Some(c"."), c"/", None, libc::MS_MOVE, None).map_err(|e| pivot("move rootfs to /", e))?;
        // SAFETY: plain path-based calls with static strings.
        sys::check(unsafe { libc::chroot(c".".as_ptr()) }).map_err(|e| pivot("chroot", e))?;
    } else {
        // SAFETY: pivot_root with two valid C strings.
        let rc = unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) };
        sys::check_long(rc).map_err(|e| pivot("pivot_root", e))?;
        // The old root is now mounted on top of the new one, at "."; detach it. `/` is a
        // slave, so the unmount does not propagate to the host.
        // SAFETY: static C string.
        sys::check(unsafe { libc::umount2(c".".as_ptr(), libc::MNT_DETACH) })
            .map_err(|e| pivot("detach old root", e))?;
    }
    // SAFETY: static C string.
    sys::check(unsafe { libc::chdir(c"/".as_ptr()) }).map_err(|e| pivot("chdir to /", e))?;
    drop(root);

    if let Some(p) = plan.final_propagation {
        sys::mount(None, c"/", None, p, None).map_err(|errno| SetupError::RootPropagation { what: "shared", errno })?;
    }
    if plan.readonly {
        let root_fd = openat2(libc::AT_FDCWD, c"/", libc::O_PATH, 0).map_err(|e| pivot("open /", e))?;
        let keep = kept_flags(root_fd.as_raw_fd(), &MountOptions::default()).unwrap_or(0);
        let flags = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | keep;
        sys::mount(None, c"/", None, flags, None).map_err(|errno| SetupError::Remount {
            target: "/",
            flags,
            errno,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;

    use super::*;
    use crate::rootfs::options::split_container_path;

    /// Masked and read-only paths that do not exist are skipped, not errors. Runs the real
    /// setup functions in a child with its own user and mount namespaces (we may be root,
    /// but the host's mounts must not change either way).
    #[test]
    fn missing_masked_and_readonly_paths_are_skipped() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("present")).unwrap();
        std::fs::write(tmp.path().join("file"), "secret").unwrap();
        let masked: Vec<PathPlan> = ["/missing", "/present/missing", "/file"]
            .iter()
            .map(|p| split_container_path(p).unwrap())
            .collect();
        let ro: Vec<PathPlan> = ["/nope", "/present"]
            .iter()
            .map(|p| split_container_path(p).unwrap())
            .collect();
        let root = CString::new(tmp.path().as_os_str().as_bytes()).unwrap();
        // SAFETY: the child only makes system calls on memory prepared before the fork.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: the forked child makes system calls on memory prepared before the fork.
            let code = (|| unsafe {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    // Not privileged enough for a mount namespace: the parent says so.
                    return 77;
                }
                if sys::mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None).is_err() {
                    return 2;
                }
                let Ok(rootfd) = openat2(libc::AT_FDCWD, &root, libc::O_PATH | libc::O_DIRECTORY, 0) else {
                    return 3;
                };
                if mask_paths(rootfd.as_raw_fd(), &masked).is_err() {
                    return 4;
                }
                if readonly_paths(rootfd.as_raw_fd(), &ro).is_err() {
                    return 5;
                }
                // /file is now /dev/null: empty. /present is read-only.
                let mut buf = [0u8; 16];
                let fd = libc::openat(rootfd.as_raw_fd(), c"file".as_ptr(), libc::O_RDONLY);
                if fd < 0 || libc::read(fd, buf.as_mut_ptr().cast(), 16) != 0 {
                    return 6;
                }
                let d = libc::openat(
                    rootfd.as_raw_fd(),
                    c"present".as_ptr(),
                    libc::O_DIRECTORY | libc::O_RDONLY,
                );
                if libc::mkdirat(d, c"x".as_ptr(), 0o755) == 0 || *libc::__errno_location() != libc::EROFS {
                    return 7;
                }
                0
            })();
            sys::exit_now(code);
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        let code = libc::WEXITSTATUS(status);
        assert_ne!(code, 77, "cannot make a mount namespace here: run the tests as root");
        assert_eq!(code, 0, "child failed at step {code}");
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("file")).unwrap(),
            "secret",
            "host view unchanged"
        );
    }
}
