//! What a spec's mounts, devices and paths ask for, parsed and checked: mount options to
//! flags (as runc reads them), container paths split for the resolver, and the refusal of
//! what this runtime does not do. Pure: called while validating a spec, and by [`super::plan`].

use std::ffi::CString;
use std::path::{Path, PathBuf};

use libc::c_ulong;
use oci_spec::runtime::Mount;

use crate::sys::Errno;

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

pub(super) const ATIME_FLAGS: c_ulong =
    libc::MS_NOATIME | libc::MS_NODIRATIME | libc::MS_RELATIME | libc::MS_STRICTATIME;

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
    pub(super) full: CString,
    /// `dev`, `dev/null`: each prefix, resolved in turn when creating.
    pub(super) prefixes: Vec<CString>,
    /// `dev`, `null`: the component created at each step.
    pub(super) names: Vec<CString>,
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

/// One entry of a spec's `mounts` with its options parsed, once, while the spec is
/// validated: the plan takes the options from here.
#[derive(Debug, Clone)]
pub struct SpecMount {
    pub mount: Mount,
    pub options: MountOptions,
}

/// Checks one entry of `mounts` (called from spec validation) and parses its options.
pub fn validate_mount(m: &Mount) -> Result<SpecMount, RootfsError> {
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
        return Ok(SpecMount {
            mount: m.clone(),
            options: opts,
        });
    }
    if !FS_TYPES.contains(&kind) {
        return Err(RootfsError::Type {
            dest,
            kind: kind.to_string(),
        });
    }
    Ok(SpecMount {
        mount: m.clone(),
        options: opts,
    })
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
}
