//! Spool folders: where a tenant's bytes wait on local disk on their way to or from the blob
//! store (a template's COPY archive, a hibernated sandbox's snapshot).
//!
//! A spool must be the gateway's alone. A folder another local user made first (the
//! gateway's default paths are predictable) would let that user read each file as it is
//! written, or swap one for its own before it is stored: a folder not owned by the gateway is
//! refused, its mode is set to 0700, and each file is created new, readable by the gateway
//! alone.

use std::io;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;

/// Makes `dir` (and its parents) if missing, and checks it is a folder of this process's
/// user, closed to everyone else.
pub async fn private_dir(dir: &Path) -> io::Result<()> {
    let owned = dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&owned)?;
        let meta = std::fs::symlink_metadata(&owned)?;
        let me = rustix::process::geteuid().as_raw();
        unreplaceable_above(&owned, me)?;
        if !meta.is_dir() || meta.uid() != me {
            return Err(refused(format!(
                "{} is not a folder of this gateway's user (uid {me}) but uid {}'s",
                owned.display(),
                meta.uid()
            )));
        }
        std::fs::set_permissions(&owned, std::fs::Permissions::from_mode(0o700))
    })
    .await
    .map_err(io::Error::other)?
}

/// Checks that no other user can put a folder of their own in `dir`'s place: every folder on
/// the way to it (after symlinks) is root's or `me`'s, and writable by no one else unless it
/// is sticky (`/tmp`: there only a folder's owner may rename or remove it).
fn unreplaceable_above(dir: &Path, me: u32) -> io::Result<()> {
    let absolute = std::path::absolute(dir)?;
    for above in absolute.ancestors().skip(1) {
        let meta = std::fs::metadata(above)?;
        let sticky = meta.mode() & 0o1000 != 0;
        let others_write = meta.mode() & 0o022 != 0;
        if (meta.uid() != 0 && meta.uid() != me) || (others_write && !sticky) {
            return Err(refused(format!(
                "{} is on the way to the spool {} and another user can change it (owner uid {}, mode {:o})",
                above.display(),
                dir.display(),
                meta.uid(),
                meta.mode() & 0o7777
            )));
        }
    }
    Ok(())
}

/// A spool refused for `why`.
fn refused(why: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("{why}: refusing to spool tenants' files there"),
    )
}

/// A new file at `path` (never an existing one), readable and writable by this user alone.
pub async fn new_file(path: &Path) -> io::Result<tokio::fs::File> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    Ok(tokio::fs::File::from_std(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_spool_is_closed_to_others_and_its_files_too() {
        let root = std::env::temp_dir().join(format!("spool-test-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        let spool = root.join("a/b");
        private_dir(&spool).await.unwrap();
        assert_eq!(std::fs::metadata(&spool).unwrap().mode() & 0o777, 0o700);
        // One left open by a careless operator is closed again.
        std::fs::set_permissions(&spool, std::fs::Permissions::from_mode(0o777)).unwrap();
        private_dir(&spool).await.unwrap();
        assert_eq!(std::fs::metadata(&spool).unwrap().mode() & 0o777, 0o700);
        let file = spool.join("f");
        drop(new_file(&file).await.unwrap());
        assert_eq!(std::fs::metadata(&file).unwrap().mode() & 0o777, 0o600);
        assert!(new_file(&file).await.is_err(), "an existing file is never reused");
        // A symlink in the spool's place is not followed.
        let link = root.join("link");
        std::os::unix::fs::symlink(&spool, &link).unwrap();
        assert!(private_dir(&link).await.is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[tokio::test]
    async fn a_spool_below_a_folder_another_user_can_change_is_refused() {
        let root = std::env::temp_dir().join(format!("spool-test-{}", uuid::Uuid::new_v4().simple()));
        // Not sticky, writable by all: anyone could rename the spool away and put theirs.
        std::fs::create_dir_all(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).unwrap();
        let refused = private_dir(&root.join("uploads")).await.unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::PermissionDenied, "{refused}");
        // Another user's folder on the way, even one only they can write.
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        let theirs = root.join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        assert!(private_dir(&theirs.join("uploads")).await.is_err());
        // Sticky and root's, as /tmp: fine.
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o1777)).unwrap();
        private_dir(&root.join("uploads")).await.unwrap();
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[tokio::test]
    async fn a_spool_another_user_made_first_is_refused() {
        let root = std::env::temp_dir().join(format!("spool-test-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&root).unwrap();
        // The attacker's folder, made before the gateway's first upload, in a sticky folder
        // anyone may write to (as /tmp).
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let theirs = root.join("uploads");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let refused = private_dir(&theirs).await.unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::PermissionDenied, "{refused}");
        assert!(refused.to_string().contains("uid 65534"), "{refused}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
