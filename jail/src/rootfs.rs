//! Building the container's filesystem view: mounts, devices, `pivot_root`, masked and
//! read-only paths.
//!
//! Everything here happens in the container's new mount namespace, in this order:
//!
//! 1. Make `/` recursively *slave* (or `linux.rootfsPropagation`), so nothing we mount
//!    propagates back to the host, while host mounts still propagate in.
//! 2. Bind-mount the rootfs onto itself. `pivot_root` needs the new root to be a mount
//!    point, and the caller's rootfs (an overlayfs the node mounted) may be one already,
//!    but a plain directory is not.
//! 3. Perform `mounts` in order, then the devices, then the `/dev` symlinks.
//! 4. Apply `maskedPaths` and `readonlyPaths`.
//! 5. `pivot_root(".", ".")` followed by `umount2(".", MNT_DETACH)`: the old root ends up
//!    stacked on top of the new one and is detached, without needing a spare directory
//!    inside the rootfs (runc's trick). `--no-pivot` uses `MS_MOVE` + `chroot` instead.
//! 6. Remount `/` read-only if `root.readonly`.
//!
//! **Untrusted rootfs.** The rootfs contents belong to code we do not trust (snapshots are
//! restored, images are pulled). A symlink planted at `/proc` pointing to `/etc` on the host
//! must not make us mount over the host's `/etc`. So no mount target is ever a path string
//! walked by the kernel from the host's root: targets are resolved with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` relative to a descriptor of the
//! rootfs — symlinks are followed *as if the rootfs were `/`*, and `..` cannot climb out —
//! and the mount then names the resulting descriptor as `/proc/self/fd/N` (what runc does).
//! Missing targets are created one component at a time with `mkdirat` relative to the
//! already-resolved parent, for the same reason.
//!
//! Masked and read-only paths are applied *before* `pivot_root` in step 4, through the
//! same resolver rooted at the rootfs, so they resolve exactly as the container will see
//! them; this way the host's `/proc/self/fd` is available for the descriptor trick even
//! when the spec mounts no `/proc` in the container.
//!
//! **User namespaces.** mknod is not allowed there, so devices are bind mounts of the host's
//! `/dev/X` onto empty files. And a bind mount inherits its source's flags, some of which
//! (nosuid, nodev, noexec, read-only, atime) the kernel *locks* when the mount is copied
//! into a less privileged namespace: a remount that omits them fails with EPERM. Every
//! remount therefore reads the current flags with `fstatvfs` and keeps the locked ones.
//!
//! The plan (all paths as C strings, options parsed) is built in the parent before the
//! clone; [`setup`] runs in the child and only makes system calls.

use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use libc::c_ulong;
use oci_spec::runtime::{LinuxIdMapping, Mount};

use crate::spec::Config;
use crate::sys::{self, fd_path, openat2, CDisplay, Errno};

/// Errors from validating mounts and building the plan (in the parent).
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("path {0:?} contains '..'")]
    DotDot(String),
    #[error("path {0:?} contains a NUL byte")]
    Nul(String),
    #[error("mount on {0:?}: mounting over the container's root is not allowed")]
    OverRoot(String),
    #[error("mount on {dest}: type {kind:?} is not supported (proc, sysfs, tmpfs, devpts, mqueue, bind)")]
    Type { dest: String, kind: String },
    #[error("mount on {dest}: option {option:?} is not supported")]
    Option { dest: String, option: String },
    #[error("mount on {0}: uidMappings/gidMappings (idmapped mounts) are not supported")]
    IdMapped(String),
    #[error("mount on {0}: a bind mount needs a source")]
    NoSource(String),
    #[error("mount on {dest}: source {source_path}: {errno}")]
    Source {
        dest: String,
        source_path: PathBuf,
        errno: Errno,
    },
    #[error("device {0:?} must be an absolute path under /dev")]
    DevicePath(String),
    #[error("device {path}: {errno}")]
    Device { path: String, errno: Errno },
}

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

const ATIME_FLAGS: c_ulong = libc::MS_NOATIME | libc::MS_NODIRATIME | libc::MS_RELATIME | libc::MS_STRICTATIME;

/// Flags a remount may change on a bind mount (MS_BIND only takes MS_REC at first).
const REMOUNT_FLAGS: c_ulong = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | ATIME_FLAGS;

/// Openat2 resolution for every path inside the rootfs.
const RESOLVE: u64 = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;

/// The devices every container gets (runc's defaults), bound from the host.
const DEFAULT_DEVICES: [&str; 6] = [
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
];

/// `/dev` symlinks, as runc creates them.
const DEV_SYMLINKS: [(&CStr, &CStr); 4] = [
    (c"/proc/self/fd", c"fd"),
    (c"/proc/self/fd/0", c"stdin"),
    (c"/proc/self/fd/1", c"stdout"),
    (c"/proc/self/fd/2", c"stderr"),
];

/// `private`, `rslave`, ... to mount propagation flags.
pub fn propagation_flag(name: &str) -> Option<c_ulong> {
    Some(match name {
        "private" => libc::MS_PRIVATE,
        "rprivate" => libc::MS_PRIVATE | libc::MS_REC,
        "shared" => libc::MS_SHARED,
        "rshared" => libc::MS_SHARED | libc::MS_REC,
        "slave" => libc::MS_SLAVE,
        "rslave" => libc::MS_SLAVE | libc::MS_REC,
        "unbindable" => libc::MS_UNBINDABLE,
        "runbindable" => libc::MS_UNBINDABLE | libc::MS_REC,
        _ => return None,
    })
}

/// A path inside the container, pre-split for the resolver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPlan {
    /// As written in the spec, for messages.
    pub display: String,
    /// Relative to the rootfs (`dev/null`), or `.` for the root itself.
    full: CString,
    /// `dev`, `dev/null`: each prefix, resolved in turn when creating.
    prefixes: Vec<CString>,
    /// `dev`, `null`: the component created at each step.
    names: Vec<CString>,
}

impl PathPlan {
    pub fn is_root(&self) -> bool {
        self.names.is_empty()
    }
}

/// Splits a container path into components, refusing `..` (which the resolver would clamp
/// safely, but which never means anything sensible in a spec).
pub fn split_container_path(p: &str) -> Result<PathPlan, RootfsError> {
    if p.contains('\0') {
        return Err(RootfsError::Nul(p.to_string()));
    }
    let comps: Vec<&str> = p.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
    if comps.contains(&"..") {
        return Err(RootfsError::DotDot(p.to_string()));
    }
    let cs = |s: &str| CString::new(s).map_err(|_| RootfsError::Nul(p.to_string()));
    let mut prefixes = Vec::with_capacity(comps.len());
    let mut names = Vec::with_capacity(comps.len());
    for (i, c) in comps.iter().enumerate() {
        names.push(cs(c)?);
        prefixes.push(cs(&comps[..=i].join("/"))?);
    }
    let full = if comps.is_empty() {
        cs(".")?
    } else {
        cs(&comps.join("/"))?
    };
    Ok(PathPlan {
        display: format!("/{}", comps.join("/")),
        full,
        prefixes,
        names,
    })
}

/// Mount options (`ro`, `nosuid`, `rbind`, `mode=755`, ...) split into what goes where.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountOptions {
    /// MS_* flags to set (without MS_BIND/MS_REC).
    pub flags: c_ulong,
    /// Flags the options explicitly clear (`rw`, `suid`, `exec`, ...).
    pub cleared: c_ulong,
    pub bind: bool,
    pub recursive: bool,
    /// Propagation changes, applied after the mount in order.
    pub propagation: Vec<c_ulong>,
    /// Filesystem-specific options (`mode=755,size=64k`).
    pub data: Vec<String>,
    /// Whether any atime option was given (otherwise a remount keeps the current ones).
    pub explicit_atime: bool,
}

/// Parses mount options the way runc does; options it would pass through via
/// `mount_setattr` (recursive `rro`, ...) or emulate (`tmpcopyup`), and idmapped mounts,
/// are refused rather than ignored.
pub fn parse_options(dest: &str, options: &[String]) -> Result<MountOptions, RootfsError> {
    let mut o = MountOptions::default();
    for opt in options {
        let (set, clear): (c_ulong, c_ulong) = match opt.as_str() {
            "defaults" => (0, 0),
            "ro" => (libc::MS_RDONLY, 0),
            "rw" => (0, libc::MS_RDONLY),
            "nosuid" => (libc::MS_NOSUID, 0),
            "suid" => (0, libc::MS_NOSUID),
            "nodev" => (libc::MS_NODEV, 0),
            "dev" => (0, libc::MS_NODEV),
            "noexec" => (libc::MS_NOEXEC, 0),
            "exec" => (0, libc::MS_NOEXEC),
            "sync" => (libc::MS_SYNCHRONOUS, 0),
            "async" => (0, libc::MS_SYNCHRONOUS),
            "dirsync" => (libc::MS_DIRSYNC, 0),
            "mand" => (libc::MS_MANDLOCK, 0),
            "nomand" => (0, libc::MS_MANDLOCK),
            "noatime" => (libc::MS_NOATIME, 0),
            "atime" => (0, libc::MS_NOATIME),
            "nodiratime" => (libc::MS_NODIRATIME, 0),
            "diratime" => (0, libc::MS_NODIRATIME),
            "relatime" => (libc::MS_RELATIME, 0),
            "norelatime" => (0, libc::MS_RELATIME),
            "strictatime" => (libc::MS_STRICTATIME, 0),
            "nostrictatime" => (0, libc::MS_STRICTATIME),
            "lazytime" => (libc::MS_LAZYTIME, 0),
            "nolazytime" => (0, libc::MS_LAZYTIME),
            "iversion" => (libc::MS_I_VERSION, 0),
            "noiversion" => (0, libc::MS_I_VERSION),
            "silent" => (libc::MS_SILENT, 0),
            "loud" => (0, libc::MS_SILENT),
            "nosymfollow" => (libc::MS_NOSYMFOLLOW, 0),
            "symfollow" => (0, libc::MS_NOSYMFOLLOW),
            "bind" => {
                o.bind = true;
                continue;
            }
            "rbind" => {
                o.bind = true;
                o.recursive = true;
                continue;
            }
            p if propagation_flag(p).is_some() => {
                o.propagation.extend(propagation_flag(p));
                continue;
            }
            "remount" | "tmpcopyup" | "idmap" | "ridmap" => {
                return Err(RootfsError::Option {
                    dest: dest.to_string(),
                    option: opt.clone(),
                })
            }
            // Recursive attributes (rro, rnosuid, ...) need mount_setattr(2); not done here.
            p if p.len() > 1
                && p.starts_with('r')
                && matches!(
                    &p[1..],
                    "ro" | "rw"
                        | "nosuid"
                        | "suid"
                        | "nodev"
                        | "dev"
                        | "noexec"
                        | "exec"
                        | "noatime"
                        | "atime"
                        | "nodiratime"
                        | "diratime"
                        | "relatime"
                        | "norelatime"
                        | "strictatime"
                        | "nostrictatime"
                        | "nosymfollow"
                        | "symfollow"
                ) =>
            {
                return Err(RootfsError::Option {
                    dest: dest.to_string(),
                    option: opt.clone(),
                })
            }
            _ => {
                o.data.push(opt.clone());
                continue;
            }
        };
        if (set | clear) & ATIME_FLAGS != 0 {
            o.explicit_atime = true;
        }
        o.flags = (o.flags | set) & !clear;
        o.cleared = (o.cleared | clear) & !set;
    }
    Ok(o)
}

/// The filesystem types we mount (besides bind mounts).
const FS_TYPES: [&str; 5] = ["proc", "sysfs", "tmpfs", "devpts", "mqueue"];

/// Checks one entry of `mounts` (called from spec validation).
pub fn validate_mount(m: &Mount) -> Result<(), RootfsError> {
    let dest = m.destination().to_string_lossy().to_string();
    let plan = split_container_path(&dest)?;
    if plan.is_root() {
        return Err(RootfsError::OverRoot(dest));
    }
    if m.uid_mappings().is_some() || m.gid_mappings().is_some() {
        return Err(RootfsError::IdMapped(dest));
    }
    let opts = parse_options(&dest, m.options().as_deref().unwrap_or(&[]))?;
    let kind = m.typ().as_deref().unwrap_or("");
    if opts.bind {
        if m.source().is_none() {
            return Err(RootfsError::NoSource(dest));
        }
        return Ok(());
    }
    if !FS_TYPES.contains(&kind) {
        return Err(RootfsError::Type {
            dest,
            kind: kind.to_string(),
        });
    }
    Ok(())
}

/// Checks a `linux.devices` path.
pub fn validate_device_path(p: &Path) -> Result<(), RootfsError> {
    let s = p.to_string_lossy();
    let plan = split_container_path(&s)?;
    if !p.is_absolute() || plan.names.len() < 2 || plan.names[0].as_bytes() != b"dev" {
        return Err(RootfsError::DevicePath(s.to_string()));
    }
    Ok(())
}

#[derive(Debug)]
enum MountKind {
    Bind { recursive: bool },
    Fs { fstype: CString },
}

/// One prepared entry of `mounts`.
#[derive(Debug)]
pub struct MountPlan {
    dest: PathPlan,
    /// `proc`, `bind /usr`, ... for messages.
    what: String,
    kind: MountKind,
    source: Option<CString>,
    opts: MountOptions,
    data: Option<CString>,
    /// A bind mount of a non-directory needs an empty file as its target.
    is_file: bool,
}

/// A device to bind from the host.
#[derive(Debug)]
pub struct DevicePlan {
    dest: PathPlan,
    source: CString,
}

/// Everything the child needs to build the container's filesystem.
#[derive(Debug)]
pub struct RootfsPlan {
    rootfs: CString,
    rootfs_display: String,
    /// Propagation applied to `/` first (slave unless rootfsPropagation says otherwise).
    root_propagation: c_ulong,
    /// rootfsPropagation to apply to the new `/` after pivot (shared ones cannot be set
    /// before `pivot_root`, which refuses shared mounts).
    final_propagation: Option<c_ulong>,
    readonly: bool,
    no_pivot: bool,
    mounts: Vec<MountPlan>,
    devices: Vec<DevicePlan>,
    setup_dev: bool,
    dev_dir: PathPlan,
    masked: Vec<PathPlan>,
    readonly_paths: Vec<PathPlan>,
    cwd: PathPlan,
}

fn cstring(path: &Path) -> Result<CString, RootfsError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| RootfsError::Nul(path.to_string_lossy().to_string()))
}

/// Whether container gid `gid` is mapped by `maps` (devpts's `gid=` must name a mapped gid).
fn gid_mapped(gid: u32, maps: &[LinuxIdMapping]) -> bool {
    maps.iter()
        .any(|m| gid >= m.container_id() && (gid - m.container_id()) < m.size())
}

impl RootfsPlan {
    /// Prepares the plan from a validated config. Checks bind sources and host devices, so
    /// a missing one is reported before anything is created.
    pub fn new(config: &Config, no_pivot: bool) -> Result<Self, RootfsError> {
        let mut mounts = Vec::with_capacity(config.mounts.len());
        let mut dev_is_bind = false;
        for m in &config.mounts {
            let dest_s = m.destination().to_string_lossy().to_string();
            let dest = split_container_path(&dest_s)?;
            let mut opts = parse_options(&dest_s, m.options().as_deref().unwrap_or(&[]))?;
            let kind_s = m.typ().clone().unwrap_or_default();
            let (kind, source, what, is_file) = if opts.bind {
                let src = m
                    .source()
                    .as_ref()
                    .ok_or_else(|| RootfsError::NoSource(dest_s.clone()))?;
                let src = if src.is_absolute() {
                    src.clone()
                } else {
                    config.bundle.join(src)
                };
                let meta = std::fs::metadata(&src).map_err(|e| RootfsError::Source {
                    dest: dest_s.clone(),
                    source_path: src.clone(),
                    errno: Errno(e.raw_os_error().unwrap_or(libc::EIO)),
                })?;
                if dest.display == "/dev" {
                    dev_is_bind = true;
                }
                let what = format!("bind {}", src.display());
                (
                    MountKind::Bind {
                        recursive: opts.recursive,
                    },
                    Some(cstring(&src)?),
                    what,
                    !meta.is_dir(),
                )
            } else {
                if kind_s == "devpts" && !config.uid_mappings.is_empty() {
                    // In a user namespace devpts refuses gid= of an unmapped group.
                    opts.data.retain(|d| {
                        d.strip_prefix("gid=")
                            .and_then(|g| g.parse::<u32>().ok())
                            .is_none_or(|g| gid_mapped(g, &config.gid_mappings))
                    });
                }
                let source = m.source().as_ref().map(|s| cstring(s)).transpose()?;
                let fstype = CString::new(kind_s.clone()).map_err(|_| RootfsError::Nul(kind_s.clone()))?;
                (MountKind::Fs { fstype }, source, kind_s.clone(), false)
            };
            let data = if opts.data.is_empty() {
                None
            } else {
                Some(CString::new(opts.data.join(",")).map_err(|_| RootfsError::Nul(dest_s.clone()))?)
            };
            mounts.push(MountPlan {
                dest,
                what,
                kind,
                source,
                opts,
                data,
                is_file,
            });
        }

        let mut devices: Vec<DevicePlan> = Vec::new();
        let spec_paths = config.devices.iter().map(|d| d.path().to_string_lossy().to_string());
        for path in DEFAULT_DEVICES.iter().map(|s| s.to_string()).chain(spec_paths) {
            let dest = split_container_path(&path)?;
            if devices.iter().any(|d| d.dest == dest) {
                continue;
            }
            // In a user namespace we cannot mknod, so the device must exist on the host to
            // be bound; check now for a clear error.
            let source = PathBuf::from(&path);
            if let Err(e) = std::fs::metadata(&source) {
                return Err(RootfsError::Device {
                    path,
                    errno: Errno(e.raw_os_error().unwrap_or(libc::EIO)),
                });
            }
            devices.push(DevicePlan {
                dest,
                source: cstring(&source)?,
            });
        }

        let (root_propagation, final_propagation) = match config.rootfs_propagation.as_deref() {
            None => (libc::MS_SLAVE | libc::MS_REC, None),
            Some(p) => {
                let f = propagation_flag(p).unwrap_or(libc::MS_SLAVE | libc::MS_REC);
                if f & libc::MS_SHARED != 0 {
                    (libc::MS_SLAVE | libc::MS_REC, Some(f))
                } else {
                    (f, None)
                }
            }
        };
        let plans = |v: &[String]| v.iter().map(|p| split_container_path(p)).collect::<Result<Vec<_>, _>>();
        Ok(RootfsPlan {
            rootfs: cstring(&config.rootfs)?,
            rootfs_display: config.rootfs.display().to_string(),
            root_propagation,
            final_propagation,
            readonly: config.root_readonly,
            no_pivot,
            mounts,
            devices,
            setup_dev: !dev_is_bind,
            dev_dir: split_container_path("/dev")?,
            masked: plans(&config.masked_paths)?,
            readonly_paths: plans(&config.readonly_paths)?,
            cwd: split_container_path(&config.process.cwd().to_string_lossy())?,
        })
    }
}

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
    use super::*;
    use oci_spec::runtime::Mount;
    use serde_json::json;

    fn opts(o: &[&str]) -> MountOptions {
        parse_options("/x", &o.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn option_parsing() {
        let o = opts(&["rbind", "ro", "nosuid", "nodev", "rprivate"]);
        assert!(o.bind && o.recursive);
        assert_eq!(o.flags, libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV);
        assert_eq!(o.propagation, vec![libc::MS_PRIVATE | libc::MS_REC]);
        assert!(o.data.is_empty());
        assert!(!o.explicit_atime);

        let o = opts(&["nosuid", "strictatime", "mode=755", "size=65536k"]);
        assert_eq!(o.flags, libc::MS_NOSUID | libc::MS_STRICTATIME);
        assert_eq!(o.data, vec!["mode=755", "size=65536k"]);
        assert!(o.explicit_atime);

        let o = opts(&["ro", "rw", "suid"]);
        assert_eq!(o.flags, 0);
        assert_eq!(o.cleared, libc::MS_RDONLY | libc::MS_NOSUID);

        let o = opts(&["bind"]);
        assert!(o.bind && !o.recursive);

        for bad in ["rro", "rnosuid", "tmpcopyup", "idmap", "remount"] {
            let e = parse_options("/x", &[bad.to_string()]).unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn container_paths() {
        let p = split_container_path("/dev//pts/./ptmx").unwrap();
        assert_eq!(p.display, "/dev/pts/ptmx");
        assert_eq!(p.full.to_str().unwrap(), "dev/pts/ptmx");
        let prefixes: Vec<_> = p.prefixes.iter().map(|c| c.to_str().unwrap()).collect();
        assert_eq!(prefixes, ["dev", "dev/pts", "dev/pts/ptmx"]);
        assert!(split_container_path("/").unwrap().is_root());
        assert_eq!(split_container_path("/").unwrap().full.to_str().unwrap(), ".");
        assert!(split_container_path("/a/../b").is_err());
        assert!(validate_device_path(Path::new("/dev/fuse")).is_ok());
        assert!(validate_device_path(Path::new("/etc/passwd")).is_err());
        assert!(validate_device_path(Path::new("/dev")).is_err());
    }

    #[test]
    fn mount_validation() {
        let m = |v| serde_json::from_value::<Mount>(v).unwrap();
        assert!(validate_mount(&m(json!({"destination": "/proc", "type": "proc", "source": "proc"}))).is_ok());
        assert!(validate_mount(&m(
            json!({"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]})
        ))
        .is_ok());
        assert!(validate_mount(&m(
            json!({"destination": "/usr", "type": "none", "source": "/usr", "options": ["bind"]})
        ))
        .is_ok());
        let e = validate_mount(&m(json!({"destination": "/c", "type": "cgroup", "source": "cgroup"}))).unwrap_err();
        assert!(e.to_string().contains("\"cgroup\" is not supported"), "{e}");
        let e = validate_mount(&m(json!({"destination": "/d", "type": "ext4", "source": "/dev/sda"}))).unwrap_err();
        assert!(e.to_string().contains("ext4"), "{e}");
        assert!(validate_mount(&m(json!({"destination": "/", "type": "tmpfs", "source": "tmpfs"}))).is_err());
        assert!(validate_mount(&m(json!({"destination": "/x", "type": "bind", "options": ["bind"]}))).is_err());
    }

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
            let code = (|| unsafe {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    // Not privileged enough for a mount namespace here: nothing to check.
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
        if code == 77 {
            eprintln!("skipped: cannot create a mount namespace here");
            return;
        }
        assert_eq!(code, 0, "child failed at step {code}");
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("file")).unwrap(),
            "secret",
            "host view unchanged"
        );
    }
}
