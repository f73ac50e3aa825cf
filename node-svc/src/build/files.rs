//! The steps that write files without running anything in the sandbox (COPY, WORKDIR): done
//! by the node directly into a fresh layer directory, which then becomes the step's layer.
//!
//! The layer is an overlay layer above the ones before it, so a directory it must create on
//! the way to its destination takes the owner and mode that directory already has below
//! (overlay shows the topmost copy's attributes: a `/home/user` made here as root would take
//! `/home/user` from its user). Those are looked up in the layer directories themselves,
//! topmost first, never through a mount and never following a symlink: the content is a
//! sandbox's and untrusted.
//!
//! Blocking: called from `spawn_blocking`.

use std::ffi::OsStr;
use std::io;
use std::os::unix::fs::{chown, FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Component, Path, PathBuf};

/// The layer directories below the step, topmost first.
pub struct Stack(pub Vec<PathBuf>);

/// What a path is in the stack below.
enum Found {
    Dir(std::fs::Metadata),
    Other,
    Absent,
}

impl Stack {
    /// Looks `rel` up, topmost layer first: a whiteout or a non-directory on the way hides
    /// everything below it.
    fn find(&self, rel: &Path) -> io::Result<Found> {
        'layers: for layer in &self.0 {
            let mut at = layer.clone();
            let parts: Vec<&OsStr> = rel
                .components()
                .filter_map(|c| match c {
                    Component::Normal(n) => Some(n),
                    _ => None,
                })
                .collect();
            for (i, part) in parts.iter().enumerate() {
                at.push(part);
                let meta = match std::fs::symlink_metadata(&at) {
                    Ok(meta) => meta,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue 'layers,
                    Err(e) => return Err(e),
                };
                let whiteout = meta.file_type().is_char_device() && meta.rdev() == 0;
                if whiteout {
                    return Ok(Found::Absent);
                }
                let last = i + 1 == parts.len();
                if last {
                    return Ok(if meta.is_dir() { Found::Dir(meta) } else { Found::Other });
                }
                if !meta.is_dir() {
                    // A file or a symlink where a directory is needed: the path does not go
                    // through it (symlinks are never followed here).
                    return Ok(Found::Other);
                }
            }
        }
        Ok(Found::Absent)
    }

    /// A regular file's content at `rel`, if the topmost layer that has `rel` has a regular
    /// file there (for `/etc/passwd`).
    pub fn read_file(&self, rel: &Path) -> Option<String> {
        /// The most of a template's file a build reads into memory (an image's `/etc/passwd`
        /// is the tenant's, and could be gigabytes).
        const MAX_READ: u64 = 1 << 20;
        for layer in &self.0 {
            let path = layer.join(rel);
            if rel.ancestors().skip(1).any(|a| {
                !a.as_os_str().is_empty() && std::fs::symlink_metadata(layer.join(a)).is_ok_and(|m| !m.is_dir())
            }) {
                return None;
            }
            match std::fs::symlink_metadata(&path) {
                Ok(meta) if meta.is_file() && meta.len() <= MAX_READ => {
                    use std::io::Read as _;
                    let mut text = String::new();
                    let file = std::fs::File::open(&path).ok()?;
                    file.take(MAX_READ).read_to_string(&mut text).ok()?;
                    return Some(text);
                }
                Ok(_) => return None,
                Err(_) => continue,
            }
        }
        None
    }
}

/// Makes every directory of `rel` (the directory itself included) in `upper`: those that
/// exist below with their owner and mode, the others owned by `owner` (host ids) with mode
/// 0755. Fails when the path runs into something that is not a directory below (a file, or a
/// symlink, which the build does not follow). Returns whether `rel` itself existed below.
pub fn make_dirs(upper: &Path, stack: &Stack, rel: &Path, owner: (u32, u32)) -> io::Result<bool> {
    let mut so_far = PathBuf::new();
    let mut existed = true;
    for part in rel.components() {
        let Component::Normal(part) = part else { continue };
        so_far.push(part);
        let here = upper.join(&so_far);
        let (mode, uid, gid) = match stack.find(&so_far)? {
            Found::Dir(meta) => (meta.mode() & 0o7777, meta.uid(), meta.gid()),
            Found::Absent => {
                existed = false;
                (0o755, owner.0, owner.1)
            }
            Found::Other => {
                return Err(io::Error::other(format!(
                    "/{} is not a directory in the template (a file or a symlink, which a build does not follow)",
                    so_far.display()
                )))
            }
        };
        match std::fs::symlink_metadata(&here) {
            Ok(meta) if meta.is_dir() => continue,
            Ok(_) => return Err(io::Error::other(format!("/{} is not a directory", so_far.display()))),
            Err(_) => {}
        }
        std::fs::create_dir(&here)?;
        std::fs::set_permissions(&here, std::fs::Permissions::from_mode(mode))?;
        chown(&here, Some(uid), Some(gid))?;
    }
    Ok(existed)
}

/// Prepares an empty layer directory as a build step's: its root as the base has it.
pub fn new_layer_dir(dir: &Path, root_id: u32) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    chown(dir, Some(root_id), Some(root_id))
}

/// `relative` (a lexically clean path, as [`super::steps::in_sandbox`] makes) under `root`,
/// with the archive's own links on the way followed as if `root` were `/`: the archive a COPY
/// step unpacks is the tenant's, and may hold a link such as `x -> /` or `x -> ../..`, which
/// the kernel would follow out of `root` to the host's own files, for the root-owned moves
/// that follow. Resolved here instead, an absolute target starts again at `root` and `..`
/// stops there, as Docker's build context keeps links inside it (`lib -> shared/lib` still
/// leads to `shared/lib`). The last component is not followed: a link there is copied as
/// the link it is.
///
/// Nothing but the build itself writes below `root` (the host's scratch folder, after the
/// archive is unpacked), so what is checked here stays as it was checked.
pub fn beneath(root: &Path, relative: &Path) -> io::Result<PathBuf> {
    use std::ffi::OsString;
    use std::path::Component;
    /// Links followed on the way at most (the kernel's own limit).
    const MAX_LINKS: usize = 40;
    let mut pending: Vec<OsString> = Vec::new();
    for component in relative.components().rev() {
        let Component::Normal(name) = component else {
            return Err(io::Error::other(format!(
                "{} is not a plain relative path",
                relative.display()
            )));
        };
        pending.push(name.to_os_string());
    }
    let mut resolved = PathBuf::new();
    let mut links = 0;
    while let Some(name) = pending.pop() {
        if name == ".." {
            resolved.pop();
            continue;
        }
        let here = root.join(&resolved).join(&name);
        let meta = std::fs::symlink_metadata(&here)?;
        if pending.is_empty() || meta.is_dir() {
            resolved.push(name);
            continue;
        }
        if !meta.file_type().is_symlink() {
            return Err(io::Error::other(format!(
                "/{} passes through a file, not a directory",
                relative.display()
            )));
        }
        links += 1;
        if links > MAX_LINKS {
            return Err(io::Error::other(format!(
                "/{}: too many links on the way",
                relative.display()
            )));
        }
        let target = std::fs::read_link(&here)?;
        if target.is_absolute() {
            resolved = PathBuf::new();
        }
        for component in target.components().rev() {
            match component {
                Component::Normal(name) => pending.push(name.to_os_string()),
                Component::ParentDir => pending.push(OsString::from("..")),
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            }
        }
    }
    Ok(root.join(resolved))
}

/// Moves `from` (something extracted from a COPY archive) to `to` inside the layer, replacing
/// what is there.
pub fn place(from: &Path, to: &Path) -> io::Result<()> {
    if let Ok(meta) = std::fs::symlink_metadata(to) {
        if meta.is_dir() && !std::fs::symlink_metadata(from)?.is_dir() {
            std::fs::remove_dir_all(to)?;
        } else if !meta.is_dir() {
            std::fs::remove_file(to)?;
        } else {
            // Directory onto directory: merge.
            for entry in std::fs::read_dir(from)? {
                let entry = entry?;
                place(&entry.path(), &to.join(entry.file_name()))?;
            }
            return Ok(());
        }
    }
    std::fs::rename(from, to)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("build-files-{tag}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn directories_on_the_way_keep_the_attributes_they_have_below() {
        let dir = scratch("dirs");
        let (lower, upper) = (dir.join("lower"), dir.join("upper"));
        std::fs::create_dir_all(lower.join("home/user")).unwrap();
        chown(lower.join("home/user"), Some(101_000), Some(101_000)).unwrap();
        std::fs::set_permissions(lower.join("home/user"), std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink("/etc", lower.join("link")).unwrap();
        std::fs::create_dir_all(&upper).unwrap();
        let stack = Stack(vec![lower.clone()]);
        let existed = make_dirs(&upper, &stack, Path::new("home/user/app/sub"), (100_000, 100_000)).unwrap();
        assert!(!existed);
        let user = std::fs::metadata(upper.join("home/user")).unwrap();
        assert_eq!((user.uid(), user.mode() & 0o7777), (101_000, 0o700));
        let new = std::fs::metadata(upper.join("home/user/app/sub")).unwrap();
        assert_eq!((new.uid(), new.mode() & 0o7777), (100_000, 0o755));
        assert!(make_dirs(&upper, &stack, Path::new("home/user"), (0, 0)).unwrap());
        // A symlink below is never followed.
        assert!(make_dirs(&upper, &stack, Path::new("link/x"), (0, 0)).is_err());
        assert!(!upper.join("link").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_copy_source_never_leaves_the_archive_through_its_links() {
        let dir = scratch("beneath");
        let (extracted, host) = (dir.join("extracted"), dir.join("host"));
        std::fs::create_dir_all(extracted.join("app/src")).unwrap();
        std::fs::write(extracted.join("app/src/main.py"), "print(1)").unwrap();
        std::fs::create_dir_all(host.join("etc")).unwrap();
        std::fs::write(host.join("etc/shadow"), "root:secret").unwrap();
        // What a crafted archive unpacks to: links to the host, absolute and relative.
        std::os::unix::fs::symlink(&host, extracted.join("abs")).unwrap();
        std::os::unix::fs::symlink("../host", extracted.join("rel")).unwrap();
        std::os::unix::fs::symlink("../../../../../..", extracted.join("app/up")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", extracted.join("app/link")).unwrap();
        std::os::unix::fs::symlink("loop", extracted.join("loop")).unwrap();
        // Links that stay inside lead where they point, as in Docker's build context.
        std::os::unix::fs::symlink("app/src", extracted.join("inside")).unwrap();
        std::os::unix::fs::symlink("/app", extracted.join("rooted")).unwrap();
        assert_eq!(
            beneath(&extracted, Path::new("app/src/main.py")).unwrap(),
            extracted.join("app/src/main.py")
        );
        assert_eq!(
            beneath(&extracted, Path::new("inside/main.py")).unwrap(),
            extracted.join("app/src/main.py")
        );
        assert_eq!(
            beneath(&extracted, Path::new("rooted/src/main.py")).unwrap(),
            extracted.join("app/src/main.py")
        );
        // `..` stops at the archive's root: the host's folder is not found there.
        assert_eq!(
            beneath(&extracted, Path::new("app/up/app/src")).unwrap(),
            extracted.join("app/src")
        );
        for through in [
            "abs/etc/shadow",
            "abs/etc",
            "rel/etc/shadow",
            "rel/etc",
            "app/link/x",
            "loop/x",
        ] {
            let found = beneath(&extracted, Path::new(through));
            assert!(
                found.as_ref().is_err() || found.as_ref().unwrap().starts_with(&extracted),
                "{through} left the archive: {found:?}"
            );
            assert!(found.is_err(), "{through}: {found:?}");
        }
        // The link itself, last on the path, is what is copied (as a link).
        assert_eq!(
            beneath(&extracted, Path::new("app/link")).unwrap(),
            extracted.join("app/link")
        );
        assert_eq!(beneath(&extracted, Path::new("abs")).unwrap(), extracted.join("abs"));
        assert!(beneath(&extracted, Path::new("missing")).is_err());
        assert!(beneath(&extracted, Path::new("/etc")).is_err(), "not relative");
        assert!(beneath(&extracted, Path::new("app/../abs")).is_err(), "not clean");
        // Placing what was found moves the archive's own file and nothing of the host's.
        let layer = dir.join("layer");
        std::fs::create_dir_all(&layer).unwrap();
        place(&beneath(&extracted, Path::new("inside")).unwrap(), &layer.join("src")).unwrap();
        assert!(std::fs::symlink_metadata(layer.join("src"))
            .unwrap()
            .file_type()
            .is_symlink());
        place(&beneath(&extracted, Path::new("app/src")).unwrap(), &layer.join("code")).unwrap();
        assert!(layer.join("code/main.py").is_file());
        assert_eq!(std::fs::read_to_string(host.join("etc/shadow")).unwrap(), "root:secret");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn files_are_read_from_the_topmost_layer_without_following_links() {
        let dir = scratch("read");
        let (top, bottom) = (dir.join("top"), dir.join("bottom"));
        std::fs::create_dir_all(bottom.join("etc")).unwrap();
        std::fs::write(bottom.join("etc/passwd"), "root:x:0:0::/:/bin/sh\n").unwrap();
        std::fs::create_dir_all(&top).unwrap();
        let stack = Stack(vec![top.clone(), bottom.clone()]);
        assert!(stack.read_file(Path::new("etc/passwd")).unwrap().starts_with("root"));
        // A file too large to read into memory is not read (sparse: no disk is used).
        std::fs::create_dir_all(top.join("big")).unwrap();
        std::fs::File::create(top.join("big/passwd"))
            .unwrap()
            .set_len(2 << 20)
            .unwrap();
        assert_eq!(stack.read_file(Path::new("big/passwd")), None);
        std::os::unix::fs::symlink("/etc", top.join("etc")).unwrap();
        assert_eq!(
            stack.read_file(Path::new("etc/passwd")),
            None,
            "a symlinked /etc is not read"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
