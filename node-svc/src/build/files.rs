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
        for layer in &self.0 {
            let path = layer.join(rel);
            if rel.ancestors().skip(1).any(|a| {
                !a.as_os_str().is_empty() && std::fs::symlink_metadata(layer.join(a)).is_ok_and(|m| !m.is_dir())
            }) {
                return None;
            }
            match std::fs::symlink_metadata(&path) {
                Ok(meta) if meta.is_file() => return std::fs::read_to_string(&path).ok(),
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
/// through real directories only: the archive a COPY step unpacks is the tenant's, and may
/// hold a symlink such as `x -> /`, through which `x/etc` would name the host's own `/etc`
/// for the root-owned moves that follow. The last component is not followed either: a
/// symlink there is copied as the symlink it is.
///
/// Nothing but the build itself writes below `root` (the host's scratch folder, after the
/// archive is unpacked), so what is checked here stays as it was checked.
pub fn beneath(root: &Path, relative: &Path) -> io::Result<PathBuf> {
    let mut here = root.to_path_buf();
    let mut components = relative.components().peekable();
    while let Some(component) = components.next() {
        let std::path::Component::Normal(name) = component else {
            return Err(io::Error::other(format!(
                "{} is not a plain relative path",
                relative.display()
            )));
        };
        here.push(name);
        let meta = std::fs::symlink_metadata(&here)?;
        if components.peek().is_some() && !meta.is_dir() {
            return Err(io::Error::other(format!(
                "/{} passes through a file or a symlink, which a build does not follow",
                relative.display()
            )));
        }
    }
    Ok(here)
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
    fn a_copy_source_never_passes_through_a_symlink_of_the_archive() {
        let dir = scratch("beneath");
        let (extracted, host) = (dir.join("extracted"), dir.join("host"));
        std::fs::create_dir_all(extracted.join("app/src")).unwrap();
        std::fs::write(extracted.join("app/src/main.py"), "print(1)").unwrap();
        std::fs::create_dir_all(host.join("etc")).unwrap();
        std::fs::write(host.join("etc/shadow"), "root:secret").unwrap();
        // What a crafted archive unpacks to: links to the host, absolute and relative.
        std::os::unix::fs::symlink(&host, extracted.join("abs")).unwrap();
        std::os::unix::fs::symlink("../host", extracted.join("rel")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", extracted.join("app/link")).unwrap();
        assert_eq!(
            beneath(&extracted, Path::new("app/src/main.py")).unwrap(),
            extracted.join("app/src/main.py")
        );
        for through in ["abs/etc/shadow", "abs/etc", "rel/etc/shadow", "rel/etc", "app/link/x"] {
            assert!(
                beneath(&extracted, Path::new(through)).is_err(),
                "{through} was followed"
            );
        }
        // The link itself, last on the path, is what is copied (as a link).
        assert_eq!(
            beneath(&extracted, Path::new("app/link")).unwrap(),
            extracted.join("app/link")
        );
        assert!(beneath(&extracted, Path::new("missing")).is_err());
        assert!(beneath(&extracted, Path::new("/etc")).is_err(), "not relative");
        assert!(beneath(&extracted, Path::new("app/../abs")).is_err(), "not clean");
        // Placing what was found moves the archive's own file and nothing of the host's.
        let layer = dir.join("layer");
        std::fs::create_dir_all(&layer).unwrap();
        place(&beneath(&extracted, Path::new("app/src")).unwrap(), &layer.join("src")).unwrap();
        assert!(layer.join("src/main.py").is_file());
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
        std::os::unix::fs::symlink("/etc", top.join("etc")).unwrap();
        assert_eq!(
            stack.read_file(Path::new("etc/passwd")),
            None,
            "a symlinked /etc is not read"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
