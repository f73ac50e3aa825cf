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

//!
//! The work is split by where it runs: [`options`] parses and checks what a spec asks (the
//! parent, while validating the spec), [`plan`] turns a validated config into the plan (the
//! parent, before the clone), [`setup`] carries the plan out (the child, system calls only).

pub mod options;
pub mod plan;
pub mod setup;

pub use options::RootfsError;
pub use plan::RootfsPlan;
pub use setup::{setup, SetupError};
