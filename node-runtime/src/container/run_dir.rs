//! Where a node keeps what lives only as long as its containers: the runtime's state
//! (`runtime/`) and each sandbox's bundle (`sandboxes/ID/`: the spec, the pid file, envd's
//! socket and the mount point of its root).
//!
//! **In memory, as runc's `/run/runc` and containerd's bundles are.** None of it outlives a
//! reboot that ends the containers anyway, and all of it is made and deleted with every
//! sandbox. On disk that churn is not free: a create and kill made and deleted a dozen inodes,
//! and ext4 without a journal (common for scratch disks, and these hosts' root) scans past
//! every recently deleted inode on each allocation, so at a few hundred sandboxes a minute
//! inode allocation took a quarter of a node's CPU. What must outlive the containers (the
//! writable layer, overlayfs's work directory beside it, the record, the log) stays in the
//! state directory.
//!
//! Every node of a host shares one tmpfs at [`RUN_ROOT`] (mounted by the first node that finds
//! none there; `/run` is usually one already), each in a folder named by a hash of its state
//! directory, so a restarted node finds its containers' parts again and two nodes never share.

use std::io;
use std::path::{Path, PathBuf};

/// The host's folder of node run directories.
pub const RUN_ROOT: &str = "/run/sandboxsched";

/// Size of the tmpfs a node mounts at [`RUN_ROOT`] when there is none: a bundle is a few
/// kilobytes, so this holds tens of thousands of sandboxes.
const TMPFS_OPTIONS: &str = "size=128m,mode=0711";

/// The run directory of the node whose state directory is `state_dir`: a pure function of
/// the path, so every process that knows the state directory finds it.
pub fn run_dir(state_dir: &Path) -> PathBuf {
    let path = std::fs::canonicalize(state_dir)
        .or_else(|_| std::path::absolute(state_dir))
        .unwrap_or_else(|_| state_dir.to_path_buf());
    let hash = super::fnv1a(path.as_os_str().as_encoded_bytes());
    Path::new(RUN_ROOT).join(format!("{hash:016x}"))
}

/// `TMPFS_MAGIC` of `<linux/magic.h>`: what `statfs` says of a tmpfs.
const TMPFS_MAGIC: i64 = 0x0102_1994;

fn on_tmpfs(path: &Path) -> bool {
    rustix::fs::statfs(path).is_ok_and(|stat| stat.f_type == TMPFS_MAGIC)
}

/// Makes [`RUN_ROOT`] a tmpfs unless it is on one already (under a lock: two nodes starting
/// at once must not mount twice, the second hiding what the first made), then `dir` in it.
/// A host where no tmpfs can be mounted keeps the folder on whatever filesystem it is:
/// slower, still correct.
pub fn prepare(dir: &Path) -> io::Result<()> {
    let root = Path::new(RUN_ROOT);
    std::fs::create_dir_all(root)?;
    if !on_tmpfs(root) {
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(root.with_extension("lock"))?;
        // Released when `lock` closes.
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)?;
        if !on_tmpfs(root) {
            use rustix::mount::MountFlags;
            let flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
            if let Err(e) = super::rootfs::mount_new("tmpfs", root, flags, TMPFS_OPTIONS) {
                tracing::warn!(path = RUN_ROOT, %e, "no tmpfs for containers' run directories; they stay on disk");
            }
        }
    }
    std::fs::create_dir_all(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_directory_has_one_run_directory_of_its_own() {
        let a = run_dir(Path::new("/var/lib/sandboxsched/node-a"));
        assert_eq!(a, run_dir(Path::new("/var/lib/sandboxsched/node-a")), "stable");
        assert_ne!(a, run_dir(Path::new("/var/lib/sandboxsched/node-b")));
        assert!(a.starts_with(RUN_ROOT));
        assert_eq!(a.file_name().map(|n| n.len()), Some(16));
    }
}
