//! The plan of a container's filesystem, built in the parent before the clone from a
//! validated config: every path a C string, every option parsed, every bind source and host
//! device checked to exist, so the child ([`super::setup`]) only makes system calls.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use libc::c_ulong;
use oci_spec::runtime::LinuxIdMapping;

use super::options::{propagation_flag, split_container_path, MountOptions, PathPlan, RootfsError, SpecMount};
use crate::spec::Config;
use crate::sys::Errno;

/// The devices every container gets (runc's defaults), bound from the host.
pub(super) const DEFAULT_DEVICES: [&str; 6] = [
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
];

#[derive(Debug)]
pub(super) enum MountKind {
    Bind { recursive: bool },
    Fs { fstype: CString },
}

/// One prepared entry of `mounts`.
#[derive(Debug)]
pub struct MountPlan {
    pub(super) dest: PathPlan,
    /// `proc`, `bind /usr`, ... for messages.
    pub(super) what: String,
    pub(super) kind: MountKind,
    pub(super) source: Option<CString>,
    pub(super) opts: MountOptions,
    pub(super) data: Option<CString>,
    /// A bind mount of a non-directory needs an empty file as its target.
    pub(super) is_file: bool,
}

/// A device to bind from the host.
#[derive(Debug)]
pub struct DevicePlan {
    pub(super) dest: PathPlan,
    pub(super) source: CString,
}

/// Everything the child needs to build the container's filesystem.
#[derive(Debug)]
pub struct RootfsPlan {
    pub(super) rootfs: CString,
    pub(super) rootfs_display: String,
    /// Propagation applied to `/` first (slave unless rootfsPropagation says otherwise).
    pub(super) root_propagation: c_ulong,
    /// rootfsPropagation to apply to the new `/` after pivot (shared ones cannot be set
    /// before `pivot_root`, which refuses shared mounts).
    pub(super) final_propagation: Option<c_ulong>,
    pub(super) readonly: bool,
    pub(super) no_pivot: bool,
    pub(super) mounts: Vec<MountPlan>,
    pub(super) devices: Vec<DevicePlan>,
    pub(super) setup_dev: bool,
    pub(super) dev_dir: PathPlan,
    pub(super) masked: Vec<PathPlan>,
    pub(super) readonly_paths: Vec<PathPlan>,
    pub(super) cwd: PathPlan,
}

fn cstring(path: &Path) -> Result<CString, RootfsError> {
    crate::sys::cstring(path).map_err(|_| RootfsError::Nul(path.to_string_lossy().to_string()))
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
        for SpecMount { mount: m, options } in &config.mounts {
            let dest_s = m.destination().to_string_lossy().to_string();
            let dest = split_container_path(&dest_s)?;
            let mut opts = options.clone();
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
