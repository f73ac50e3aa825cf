//! A sandbox's root filesystem: an overlay of its template's read-only layers under the
//! sandbox's own writable layer (the only part that is the sandbox's data: what a snapshot
//! carries). The node makes it before the runtime starts the container: as a detached mount the
//! runtime attaches in the container's own mount table (the node's own runtime, see
//! [`root_tree`]), or mounted in the node's table for a runtime that takes a path (runc).
//!
//! The built-in `base` template is assembled from the host's own userland so it works offline
//! on a fresh machine: one small generated layer (directories, the merged-`/usr` symlinks, an
//! `/etc` of its own with `root` and `user` (uid 1000, home `/home/user`) and a few read-only
//! copies of the host's `/etc` files the userland needs), with the host's `/usr` bind-mounted
//! read-only by the spec. Everything in the generated layer is owned by the ids the sandbox's
//! user namespace maps, so inside it is root's (or `user`'s), and nothing of it is the host's
//! secrets: `/etc/shadow`, keys and the host's accounts are not copied.

use std::io;
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::unix::fs::{chown, lchown, symlink, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::mount::MountFlags;

use super::spec::{HOST_ID_BASE, SANDBOX_USER_ID};

/// Bumped whenever the generated layer changes, so nodes rebuild it.
const BASE_VERSION: &str = "3";

/// Host `/etc` entries the host userland needs inside (dynamic linker cache, alternatives
/// symlinks, certificates, shell profiles, time zone, protocol tables).
const HOST_ETC: [&str; 20] = [
    "alternatives",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "ssl/certs",
    "ca-certificates",
    "ca-certificates.conf",
    "localtime",
    "timezone",
    "bash.bashrc",
    "profile",
    "profile.d",
    "inputrc",
    "os-release",
    "debian_version",
    "mime.types",
    "protocols",
    "services",
    "environment",
    "skel",
];

/// Top-level directories that on a merged-`/usr` host are symlinks into `/usr`.
const USR_LINKS: [&str; 6] = ["bin", "sbin", "lib", "lib32", "lib64", "libx32"];

/// The host uid (or gid) of `inside` in a sandbox.
fn host_id(inside: u32) -> u32 {
    HOST_ID_BASE + inside
}

/// Builds the `base` template's generated layer at `dir` unless a complete one is there.
/// Returns the top-level host directories that are real directories rather than symlinks into
/// `/usr` (a host without merged `/usr`): the spec must bind those read-only as well.
pub fn ensure_base(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut binds = Vec::new();
    for name in USR_LINKS {
        let host = Path::new("/").join(name);
        if let Ok(meta) = std::fs::symlink_metadata(&host) {
            if meta.is_dir() {
                binds.push(host);
            }
        }
    }
    build_once(dir, ".sandboxsched-base", BASE_VERSION, build_base)?;
    Ok(binds)
}

/// Builds a generated layer at `dir` with `build` unless one of `version` is there (its
/// `marker` file says which): in a scratch directory renamed into place whole, so a layer that
/// exists is complete.
fn build_once(dir: &Path, marker: &str, version: &str, build: impl FnOnce(&Path) -> io::Result<()>) -> io::Result<()> {
    if std::fs::read_to_string(dir.join(marker)).is_ok_and(|v| v == version) {
        return Ok(());
    }
    let scratch = dir.with_extension(format!("new-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    build(&scratch)?;
    std::fs::write(scratch.join(marker), version)?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&scratch, dir)
}

/// Bumped whenever the shim changes.
const SHIM_VERSION: &str = "2";

/// Builds, unless a complete one is there, the layer placed above an image's own layers: the
/// mount points the spec needs (`/proc`, `/sys`, `/dev`, envd's binary) and the name
/// resolution every sandbox gets (`/etc/hosts`, `/etc/resolv.conf`, as the base has them), so
/// a sandbox's writable layer starts empty and a build's layers never carry them.
pub fn ensure_shim(dir: &Path) -> io::Result<()> {
    build_once(dir, ".sandboxsched-shim", SHIM_VERSION, build_shim)
}

fn build_shim(scratch: &Path) -> io::Result<()> {
    let root_id = host_id(0);
    for rel in ["", "proc", "sys", "dev", "etc", ".sandboxsched"] {
        let path = scratch.join(rel);
        std::fs::create_dir_all(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        chown(&path, Some(root_id), Some(root_id))?;
    }
    for (rel, text) in [
        (".sandboxsched/envd", ""),
        ("etc/hosts", HOSTS),
        ("etc/resolv.conf", RESOLV_CONF),
    ] {
        let path = scratch.join(rel);
        std::fs::write(&path, text)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        chown(&path, Some(root_id), Some(root_id))?;
    }
    Ok(())
}

const HOSTS: &str = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";
// The node's forwarder, at the same address in every sandbox (see `resolver`): the host's
// own resolver is on an address no sandbox may reach, and on a closed network the only one.
const RESOLV_CONF: &str = "nameserver 169.254.0.53\n";

fn build_base(root: &Path) -> io::Result<()> {
    let root_id = host_id(0);
    let user_id = host_id(SANDBOX_USER_ID);
    let dir = |rel: &str, mode: u32, owner: u32| -> io::Result<()> {
        let path = root.join(rel);
        std::fs::create_dir_all(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
        chown(&path, Some(owner), Some(owner))
    };
    dir("", 0o755, root_id)?;
    for rel in [
        "usr",
        "proc",
        "sys",
        "dev",
        "run",
        "etc",
        "var",
        "var/log",
        "var/lib",
        "opt",
        "mnt",
        "srv",
        ".sandboxsched",
    ] {
        dir(rel, 0o755, root_id)?;
    }
    dir("tmp", 0o1777, root_id)?;
    dir("var/tmp", 0o1777, root_id)?;
    dir("root", 0o700, root_id)?;
    dir("home", 0o755, root_id)?;
    dir("home/user", 0o755, user_id)?;
    dir("code", 0o755, user_id)?;
    for name in USR_LINKS {
        if let Ok(target) = std::fs::read_link(Path::new("/").join(name)) {
            symlink(&target, root.join(name))?;
            lchown(root.join(name), Some(root_id), Some(root_id))?;
        }
    }
    // envd's binary is bind-mounted here: the mount point must exist as a file.
    let envd = root.join(".sandboxsched/envd");
    std::fs::write(&envd, b"")?;
    chown(&envd, Some(root_id), Some(root_id))?;
    let etc_file = |name: &str, text: &str| -> io::Result<()> {
        let path = root.join("etc").join(name);
        std::fs::write(&path, text)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        chown(&path, Some(root_id), Some(root_id))
    };
    etc_file(
        "passwd",
        "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    )?;
    etc_file(
        "group",
        "root:x:0:\ntty:x:5:\nusers:x:100:user\nuser:x:1000:\nnogroup:x:65534:\n",
    )?;
    etc_file("hosts", HOSTS)?;
    etc_file("resolv.conf", RESOLV_CONF)?;
    etc_file(
        "nsswitch.conf",
        "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n",
    )?;
    for rel in HOST_ETC {
        let from = Path::new("/etc").join(rel);
        if std::fs::symlink_metadata(&from).is_ok() {
            copy_owned(&from, &root.join("etc").join(rel), root_id)?;
        }
    }
    Ok(())
}

/// Copies `from` (file, directory tree or symlink, never following one) to `to`, owned by
/// `owner`, modes kept but set-id bits dropped.
fn copy_owned(from: &Path, to: &Path, owner: u32) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(from)?;
    if let Some(parent) = to.parent() {
        if !parent.exists() {
            std::fs::create_dir_all(parent)?;
            chown(parent, Some(owner), Some(owner))?;
        }
    }
    let mode = meta.permissions().mode() & 0o1777;
    if meta.file_type().is_symlink() {
        symlink(std::fs::read_link(from)?, to)?;
    } else if meta.is_dir() {
        std::fs::create_dir_all(to)?;
        for entry in std::fs::read_dir(from)? {
            let entry = entry?;
            copy_owned(&entry.path(), &to.join(entry.file_name()), owner)?;
        }
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode))?;
    } else if meta.is_file() {
        std::fs::copy(from, to)?;
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode))?;
    } else {
        return Ok(());
    }
    lchown(to, Some(owner), Some(owner))
}

/// Copies a template's files into `/home/user` of the writable layer `upper`, owned by the
/// sandbox's `user`; `/home` and `/home/user` get the base layer's owners and modes, since an
/// upper folder's own attributes are what the sandbox sees.
pub fn seed_user_files(upper: &Path, files: &Path) -> io::Result<()> {
    let (root_id, user_id) = (host_id(0), host_id(SANDBOX_USER_ID));
    for (rel, owner) in [("", root_id), ("home", root_id), ("home/user", user_id)] {
        let dir = upper.join(rel);
        std::fs::create_dir_all(&dir)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
        chown(&dir, Some(owner), Some(owner))?;
    }
    let home = upper.join("home/user");
    crate::layout::copy_tree(files, &home)?;
    own_tree(&home, user_id)
}

/// Gives everything under `dir` to `owner` (never following a symlink).
fn own_tree(dir: &Path, owner: u32) -> io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            own_tree(&path, owner)?;
        }
        lchown(&path, Some(owner), Some(owner))?;
    }
    Ok(())
}

/// Prepares `upper` (the sandbox's writable layer) to be the root of a sandbox: owned by the
/// sandbox's root, so what root inside creates at `/` is its own.
pub fn prepare_upper(upper: &Path, work: &Path) -> io::Result<()> {
    std::fs::create_dir_all(upper)?;
    chown(upper, Some(host_id(0)), Some(host_id(0)))?;
    std::fs::set_permissions(upper, std::fs::Permissions::from_mode(0o755))?;
    std::fs::create_dir_all(work)
}

/// Mounts a new `fstype` file system (its source named as its type) at `target`.
pub(super) fn mount_new(fstype: &str, target: &Path, flags: MountFlags, data: &str) -> io::Result<()> {
    let data = std::ffi::CString::new(data).map_err(|_| io::Error::other("a NUL byte in mount options"))?;
    Ok(rustix::mount::mount(fstype, target, fstype, flags, data.as_c_str())?)
}

/// Mounts the overlay of `lower` layers (topmost first) under `upper` at `target`, unless
/// something is mounted there already (a restarted node finds its sandboxes' roots mounted).
///
/// With `idmap` (a user namespace, see [`super::ids`]) every layer is reached through an
/// idmapped copy of its mount, so the files' storage ids show as the sandbox's own; `upper` and
/// `work` then share one copy of their common parent's mount, as overlayfs wants them on one
/// mount. The copies are detached: once the overlay holds them, closing them unmounts nothing.
pub fn mount_overlay(
    lower: &[PathBuf],
    upper: &Path,
    work: &Path,
    target: &Path,
    idmap: Option<std::os::fd::BorrowedFd<'_>>,
) -> io::Result<()> {
    std::fs::create_dir_all(target)?;
    if crate::disk::mounted(target) {
        return Ok(());
    }
    OverlayLayers::with(lower, upper, work, idmap, |layers| layers.mount_at(target))
}

/// A sandbox's root as a detached mount, for a runtime that attaches it in the container's own
/// mount table (see `jail::view`): made with `fsmount` ([`OverlayLayers::detached`]), attached
/// nowhere, so the node's table never holds it; where the kernel cannot make it so, mounted at
/// `scratch` (an empty folder), copied and unmounted again ([`OverlayLayers::copied_from`],
/// said once in the log). The layers' idmapped copies are made once either way.
pub fn root_tree(
    lower: &[PathBuf],
    upper: &Path,
    work: &Path,
    scratch: &Path,
    idmap: Option<std::os::fd::BorrowedFd<'_>>,
) -> io::Result<OwnedFd> {
    OverlayLayers::with(lower, upper, work, idmap, |layers| {
        layers.detached().or_else(|err| {
            if err.kind() != io::ErrorKind::Unsupported {
                return Err(err);
            }
            static TOLD: std::sync::Once = std::sync::Once::new();
            TOLD.call_once(
                || tracing::warn!(%err, "roots made the way older kernels allow (mounted, copied, unmounted)"),
            );
            layers.copied_from(scratch)
        })
    })
}

/// An overlay's layers as its options name them (topmost lower layer first).
struct OverlayLayers {
    lowers: Vec<String>,
    upper: String,
    work: String,
}

impl OverlayLayers {
    /// The layers' names, and the idmapped copies those names reach (held until the overlay
    /// is made).
    fn new(
        lower: &[PathBuf],
        upper: &Path,
        work: &Path,
        idmap: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> io::Result<(Self, Vec<OwnedFd>)> {
        let Some(userns) = idmap else {
            let layers = Self {
                lowers: lower.iter().map(|p| p.display().to_string()).collect(),
                upper: upper.display().to_string(),
                work: work.display().to_string(),
            };
            return Ok((layers, Vec::new()));
        };
        let mut held = Vec::new();
        let mut lowers = Vec::with_capacity(lower.len());
        for layer in lower {
            let tree = super::ids::idmapped(layer, userns)?;
            lowers.push(super::ids::fd_path(&tree));
            held.push(tree);
        }
        let (Some(parent), Some(up), Some(wk)) = (upper.parent(), upper.file_name(), work.file_name()) else {
            return Err(io::Error::other("the writable layer has no parent folder"));
        };
        if work.parent() != Some(parent) {
            return Err(io::Error::other(format!(
                "{} and {} are not in one folder",
                upper.display(),
                work.display()
            )));
        }
        let tree = super::ids::idmapped(parent, userns)?;
        let folder = super::ids::fd_path(&tree);
        held.push(tree);
        let layers = Self {
            lowers,
            upper: format!("{folder}/{}", up.display()),
            work: format!("{folder}/{}", wk.display()),
        };
        Ok((layers, held))
    }

    /// Runs `make` with the layers of an overlay of `lower` under `upper` (reached through
    /// idmapped copies with `idmap`), then closes those copies: the overlay holds its own.
    fn with<T>(
        lower: &[PathBuf],
        upper: &Path,
        work: &Path,
        idmap: Option<std::os::fd::BorrowedFd<'_>>,
        make: impl FnOnce(&Self) -> io::Result<T>,
    ) -> io::Result<T> {
        let (layers, held) = Self::new(lower, upper, work, idmap)?;
        let made = make(&layers);
        close_later(held);
        made
    }

    /// Mounts the overlay at `target` (`mount(2)`: its options may fill a page).
    fn mount_at(&self, target: &Path) -> io::Result<()> {
        let options = format!(
            "lowerdir={},upperdir={},workdir={}",
            self.lowers.join(":"),
            self.upper,
            self.work
        );
        mount_new("overlay", target, MountFlags::NOSUID | MountFlags::NODEV, &options)
            .map_err(|e| io::Error::other(format!("mounting the overlay at {}: {e}", target.display())))
    }

    /// The overlay as a detached mount (`fsmount`). `Unsupported` where the kernel cannot make
    /// it so: no `fsopen` (before Linux 5.2), or a layer `lowerdir+` refuses (before 6.8, or
    /// one name past the 255 bytes an `fsconfig` value holds).
    fn detached(&self) -> io::Result<OwnedFd> {
        use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags};
        let mut unsupported = false;
        let made = (|| -> rustix::io::Result<OwnedFd> {
            let context = rustix::mount::fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC).inspect_err(|e| {
                unsupported = *e == rustix::io::Errno::NOSYS;
            })?;
            // One layer a call: a whole colon-separated list of a dozen layers is past what
            // one value holds.
            for layer in &self.lowers {
                rustix::mount::fsconfig_set_string(&context, "lowerdir+", layer.as_str()).inspect_err(|e| {
                    unsupported = *e == rustix::io::Errno::INVAL;
                })?;
            }
            rustix::mount::fsconfig_set_string(&context, "upperdir", self.upper.as_str())?;
            rustix::mount::fsconfig_set_string(&context, "workdir", self.work.as_str())?;
            rustix::mount::fsconfig_create(&context)?;
            rustix::mount::fsmount(
                &context,
                FsMountFlags::FSMOUNT_CLOEXEC,
                MountAttrFlags::MOUNT_ATTR_NOSUID | MountAttrFlags::MOUNT_ATTR_NODEV,
            )
        })();
        made.map_err(|e| {
            let kind = if unsupported {
                io::ErrorKind::Unsupported
            } else {
                io::ErrorKind::Other
            };
            io::Error::new(kind, format!("making the overlay over {}: {e}", self.upper))
        })
    }

    /// The overlay made the way any kernel allows: mounted at `scratch`, copied as a detached
    /// mount (`open_tree`, Linux 5.2), and unmounted again, so the node's table keeps no copy.
    fn copied_from(&self, scratch: &Path) -> io::Result<OwnedFd> {
        use rustix::mount::OpenTreeFlags;
        std::fs::create_dir_all(scratch)?;
        self.mount_at(scratch)?;
        let tree = rustix::mount::open_tree(
            rustix::fs::CWD,
            scratch,
            OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
        )
        .map_err(|e| io::Error::other(format!("copying the overlay at {}: {e}", scratch.display())));
        unmount(scratch)?;
        tree
    }
}

/// Closes detached mounts (the idmapped copies an overlay was made from) on a thread of their
/// own. Closing the last descriptor of a detached mount unmounts it, and the kernel then waits
/// for an expedited RCU grace period before it returns: about 0.45 ms a create for its two
/// copies, measured on a create's path, where nothing needs to wait for it (the overlay holds
/// copies of its own). Closed here instead when no thread can be started.
fn close_later(trees: Vec<OwnedFd>) {
    use std::sync::mpsc::Sender;
    static CLOSER: std::sync::OnceLock<Option<Sender<Vec<OwnedFd>>>> = std::sync::OnceLock::new();
    if trees.is_empty() {
        return;
    }
    let closer = CLOSER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<OwnedFd>>();
        std::thread::Builder::new()
            .name("mount-closer".into())
            .spawn(move || rx.into_iter().for_each(drop))
            .ok()
            .map(|_| tx)
    });
    if let Some(Err(unsent)) = closer.as_ref().map(|tx| tx.send(trees)) {
        drop(unsent.0);
    }
}

/// Unmounts the overlay at `target` if one is mounted there.
pub fn unmount(target: &Path) -> io::Result<()> {
    if !crate::disk::mounted(target) {
        return Ok(());
    }
    Ok(rustix::mount::unmount(target, rustix::mount::UnmountFlags::DETACH)?)
}

/// Mounts, under `scratch`, an overlay whose lower and upper layers are idmapped to slot 0's
/// range, writes through it as that range's root, and checks the file lands in the storage
/// range; then takes it all away. Returns slot 0's mapping namespace.
pub fn probe_idmapped_overlay(scratch: &Path) -> io::Result<OwnedFd> {
    use std::os::unix::fs::MetadataExt;
    let dir = scratch.join(format!("idmap-probe-{}", std::process::id()));
    let _ = unmount(&dir.join("root"));
    let _ = std::fs::remove_dir_all(&dir);
    let result = (|| {
        for rel in ["lower", "layer/upper", "layer/work", "root"] {
            std::fs::create_dir_all(dir.join(rel))?;
        }
        for rel in ["lower", "layer/upper", "layer/work"] {
            std::os::unix::fs::chown(dir.join(rel), Some(HOST_ID_BASE), Some(HOST_ID_BASE))?;
        }
        let host = super::ids::host_base(0);
        let userns = super::ids::mapping_namespace(host)?;
        mount_overlay(
            &[dir.join("lower")],
            &dir.join("layer/upper"),
            &dir.join("layer/work"),
            &dir.join("root"),
            Some(userns.as_fd()),
        )?;
        let seen = std::fs::metadata(dir.join("root"))?.uid();
        std::fs::write(dir.join("root/probe"), b"")?;
        std::os::unix::fs::chown(dir.join("root/probe"), Some(host + 1), Some(host + 1))?;
        let stored = std::fs::metadata(dir.join("layer/upper/probe"))?.uid();
        unmount(&dir.join("root"))?;
        if (seen, stored) != (host, HOST_ID_BASE + 1) {
            return Err(io::Error::other(format!(
                "the layers' root showed as {seen} (not {host}) and a file of {} was stored as {stored}",
                host + 1
            )));
        }
        Ok(userns)
    })();
    let _ = unmount(&dir.join("root"));
    let _ = std::fs::remove_dir_all(&dir);
    result
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn sandboxes_ask_the_nodes_forwarder_for_names() {
        assert_eq!(
            RESOLV_CONF,
            format!("nameserver {}\n", super::super::resolver::RESOLVER)
        );
    }

    #[test]
    fn the_base_layer_has_its_own_accounts_and_none_of_the_hosts_secrets() {
        let dir = std::env::temp_dir().join(format!("base-layer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        ensure_base(&dir).unwrap();
        let passwd = std::fs::read_to_string(dir.join("etc/passwd")).unwrap();
        assert!(passwd.contains("user:x:1000:1000::/home/user"));
        assert!(!dir.join("etc/shadow").exists());
        assert!(!dir.join("etc/ssl/private").exists());
        let home = std::fs::metadata(dir.join("home/user")).unwrap();
        assert_eq!(home.uid(), HOST_ID_BASE + 1000, "user's home is user's inside");
        assert_eq!(std::fs::metadata(dir.join("tmp")).unwrap().mode() & 0o7777, 0o1777);
        // Built once: a second call finds it complete.
        let before = std::fs::metadata(dir.join("etc/passwd")).unwrap().ino();
        ensure_base(&dir).unwrap();
        assert_eq!(std::fs::metadata(dir.join("etc/passwd")).unwrap().ino(), before);
        std::fs::remove_dir_all(&dir).unwrap();
    }
    /// A root of many layers made as a detached mount: every layer's file is seen through it,
    /// the topmost first where two hold the same name, and a write lands in the writable
    /// layer. Long paths on purpose: the layers' names together are far past the 255 bytes
    /// `fsconfig` takes in one value.
    #[test]
    fn a_detached_root_of_many_layers_sees_them_all() {
        let dir = std::env::temp_dir().join(format!("overlay-tree-{}-{}", std::process::id(), "x".repeat(40)));
        let _ = std::fs::remove_dir_all(&dir);
        let lower: Vec<PathBuf> = (0..24)
            .map(|i| dir.join(format!("layer-{i:02}-{}", "l".repeat(40))))
            .collect();
        for (i, layer) in lower.iter().enumerate() {
            std::fs::create_dir_all(layer).unwrap();
            std::fs::write(layer.join(format!("f{i}")), format!("{i}")).unwrap();
            std::fs::write(layer.join("same"), format!("{i}")).unwrap();
        }
        let (upper, work) = (dir.join("upper"), dir.join("work"));
        std::fs::create_dir_all(&upper).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        assert!(lower.iter().map(|l| l.as_os_str().len() + 1).sum::<usize>() > 255);
        let tree = OverlayLayers::with(&lower, &upper, &work, None, |l| l.detached()).unwrap();
        let root = PathBuf::from(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&tree)));
        for i in 0..lower.len() {
            assert_eq!(
                std::fs::read_to_string(root.join(format!("f{i}"))).unwrap(),
                format!("{i}")
            );
        }
        assert_eq!(
            std::fs::read_to_string(root.join("same")).unwrap(),
            "0",
            "the topmost first"
        );
        std::fs::write(root.join("written"), "w").unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("written")).unwrap(), "w");
        drop(tree);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A layer whose name alone is past what `fsconfig` takes: the detached way says it cannot
    /// (Unsupported, so the node falls back), and the root made the older way is whole and is
    /// left mounted nowhere.
    #[test]
    fn a_root_the_kernel_cannot_make_detached_is_made_the_older_way() {
        let dir = std::env::temp_dir().join(format!("overlay-older-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let layer = dir.join("a".repeat(200)).join("b".repeat(100));
        std::fs::create_dir_all(&layer).unwrap();
        std::fs::write(layer.join("f"), "layer").unwrap();
        let (upper, work, scratch) = (dir.join("upper"), dir.join("work"), dir.join("root"));
        for d in [&upper, &work, &scratch] {
            std::fs::create_dir_all(d).unwrap();
        }
        let lower = [layer];
        let err = OverlayLayers::with(&lower, &upper, &work, None, |l| l.detached()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::Unsupported, "{err}");
        let tree = root_tree(&lower, &upper, &work, &scratch, None).unwrap();
        let root = PathBuf::from(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&tree)));
        assert_eq!(std::fs::read_to_string(root.join("f")).unwrap(), "layer");
        assert!(!crate::disk::mounted(&scratch), "the node's table keeps no copy");
        drop(tree);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
