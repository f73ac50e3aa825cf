//! Paths as the SDK names them, and who acts on them.
//!
//! Inside a sandbox (envd's normal place) an absolute path is simply that path of the
//! sandbox's own filesystem; `~`, `~/...` and relative paths start at the requesting user's
//! home (E2B's rules). `.` and `..` are folded lexically so the path shown back to the SDK is
//! the one it meant.
//!
//! *Hosted* envd (the node's unisolated process runtime runs envd in the node's own process,
//! one instance per sandbox) sees the host's filesystem, so there a sandbox's files are only
//! its home folder: `/home/user/...`, `~/...` and relative paths map into that folder, any
//! other absolute path is refused, and `..` may not climb out.

use std::path::{Component, Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::connect::{Code, RpcError};
use crate::users::{User, Users};
use crate::wire::EntryInfo;

/// Where an E2B sandbox's default user lives.
pub const SANDBOX_HOME: &str = "/home/user";

/// One request's view: who acts, and how paths map.
pub struct Scope<'a> {
    pub user: &'a User,
    pub users: &'a Users,
    /// Hosted envd: the sandbox's home folder on the host, the only place paths may name.
    pub hosted_home: Option<&'a Path>,
}

impl Scope<'_> {
    /// The path `path` names for this request (on the host, for hosted envd).
    pub fn resolve(&self, path: &str) -> Result<PathBuf, RpcError> {
        if path.contains('\0') {
            return Err(RpcError::new(Code::InvalidArgument, "a path may not contain NUL"));
        }
        match self.hosted_home {
            Some(home) => hosted(home, path),
            None => Ok(inside(&self.user.home, path)),
        }
    }

    /// The path the SDK should see for `path`.
    pub fn shown(&self, path: &Path) -> String {
        match self.hosted_home {
            Some(home) => match path.strip_prefix(home) {
                Ok(rel) if rel.as_os_str().is_empty() => SANDBOX_HOME.to_string(),
                Ok(rel) => format!("{SANDBOX_HOME}/{}", rel.display()),
                Err(_) => path.display().to_string(),
            },
            None => path.display().to_string(),
        }
    }

    /// The directory commands start in by default.
    pub fn home(&self) -> PathBuf {
        self.hosted_home
            .map_or_else(|| self.user.home.clone(), Path::to_path_buf)
    }

    /// Describes the entry at `path` (not following a final symlink).
    pub fn entry(&self, path: &Path) -> Result<EntryInfo, RpcError> {
        entry(self, path)
    }
}

/// A [`Scope`] that owns what it names, for work that outlives its request: a watch's
/// callback runs on the watcher's own thread, long after the request that started it, and
/// describes entries as that request's user would see them.
#[derive(Clone, Debug)]
pub struct OwnedScope {
    pub user: User,
    pub users: Users,
    pub hosted_home: Option<PathBuf>,
}

impl OwnedScope {
    /// A copy of `scope` that may be kept.
    pub fn of(scope: &Scope<'_>) -> Self {
        Self {
            user: scope.user.clone(),
            users: scope.users.clone(),
            hosted_home: scope.hosted_home.map(Path::to_path_buf),
        }
    }

    /// The scope to act in.
    pub fn scope(&self) -> Scope<'_> {
        Scope {
            user: &self.user,
            users: &self.users,
            hosted_home: self.hosted_home.as_deref(),
        }
    }
}

/// Inside the sandbox: absolute paths as they are, the rest from `home`.
fn inside(home: &Path, path: &str) -> PathBuf {
    let (base, rest) = if path.is_empty() || path == "~" {
        (home.to_path_buf(), "")
    } else if let Some(rest) = path.strip_prefix("~/") {
        (home.to_path_buf(), rest)
    } else if path.starts_with('/') {
        (PathBuf::from("/"), path)
    } else {
        (home.to_path_buf(), path)
    };
    let mut out = base;
    for part in Path::new(rest).components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// Hosted: every path inside the sandbox's home folder `home`, or refused.
fn hosted(home: &Path, path: &str) -> Result<PathBuf, RpcError> {
    let relative = if path.is_empty() || path == "~" || path == SANDBOX_HOME {
        ""
    } else if let Some(rest) = path.strip_prefix("~/") {
        rest
    } else if let Some(rest) = path.strip_prefix(SANDBOX_HOME).and_then(|r| r.strip_prefix('/')) {
        rest
    } else if path.starts_with('/') {
        return Err(RpcError::new(
            Code::PermissionDenied,
            format!("{path:?} is outside the sandbox's home ({SANDBOX_HOME}); the unisolated process runtime confines files to it"),
        ));
    } else {
        path
    };
    let mut out = home.to_path_buf();
    for part in Path::new(relative).components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::ParentDir => {
                if out == home || !out.pop() || !out.starts_with(home) {
                    return Err(RpcError::new(
                        Code::PermissionDenied,
                        format!("{path:?} climbs out of the sandbox's home"),
                    ));
                }
            }
            Component::RootDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// `-rwxr-xr-x`-style permissions.
fn permissions(mode: u32, dir: bool, link: bool) -> String {
    let kind = if link {
        'l'
    } else if dir {
        'd'
    } else {
        '-'
    };
    let bits = ['r', 'w', 'x'];
    let mut s = String::from(kind);
    for shift in [6, 3, 0] {
        for (i, c) in bits.iter().enumerate() {
            s.push(if mode >> (shift + 2 - i) & 1 == 1 { *c } else { '-' });
        }
    }
    s
}

/// RFC 3339 (UTC) for seconds since the epoch, for any year a file's time can carry. Not
/// humantime's: a tenant's `touch -d` sets times past 9999, which humantime's formatter refuses
/// (its `to_string` panics, it panics before 1970 too), and a listing must not fail over one
/// file's date.
pub fn rfc3339(secs: i64, nanos: u32) -> String {
    // Howard Hinnant's days-to-civil algorithm.
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{nanos:09}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

fn entry(scope: &Scope, path: &Path) -> Result<EntryInfo, RpcError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => RpcError::new(Code::NotFound, format!("{} does not exist", scope.shown(path))),
        std::io::ErrorKind::PermissionDenied => {
            RpcError::new(Code::PermissionDenied, format!("{}: {e}", path.display()))
        }
        _ => RpcError::new(Code::Internal, e.to_string()),
    })?;
    let link = meta.file_type().is_symlink();
    let dir = meta.is_dir();
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| rfc3339(d.as_secs() as i64, d.subsec_nanos()));
    Ok(EntryInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".to_string()),
        kind: if link {
            "FILE_TYPE_SYMLINK"
        } else if dir {
            "FILE_TYPE_DIRECTORY"
        } else {
            "FILE_TYPE_FILE"
        },
        path: scope.shown(path),
        size: i64::try_from(meta.len()).unwrap_or(i64::MAX),
        mode: meta.mode() & 0o7777,
        permissions: permissions(meta.mode(), dir, link),
        owner: scope.users.name_of(meta.uid()),
        group: group_name(meta.gid()),
        modified_time: modified,
        symlink_target: link
            .then(|| std::fs::read_link(path).ok().map(|t| t.display().to_string()))
            .flatten(),
        // Metadata is extra: an entry whose attributes cannot be read is still described.
        metadata: crate::metadata::read(path).unwrap_or_else(|e| {
            if !crate::metadata::is_unsupported(&e) {
                tracing::debug!(path = %path.display(), error = %e, "metadata not read");
            }
            Default::default()
        }),
    })
}

/// The name of group `gid` from the sandbox's `/etc/group`, or the number.
fn group_name(gid: u32) -> String {
    std::fs::read_to_string("/etc/group")
        .unwrap_or_default()
        .lines()
        .find_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            let id: u32 = fields.nth(1)?.parse().ok()?;
            (id == gid).then(|| name.to_string())
        })
        .unwrap_or_else(|| gid.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_the_sandboxs_own_and_relative_ones_start_at_home() {
        let home = Path::new("/home/user");
        assert_eq!(inside(home, "a/b.txt"), Path::new("/home/user/a/b.txt"));
        assert_eq!(inside(home, ""), home);
        assert_eq!(inside(home, "~/x"), Path::new("/home/user/x"));
        assert_eq!(inside(home, "/tmp/x"), Path::new("/tmp/x"));
        assert_eq!(inside(home, "/opt/../code/./a"), Path::new("/code/a"));
        assert_eq!(inside(home, "../../../etc"), Path::new("/etc"));
    }

    #[test]
    fn hosted_paths_stay_in_the_home() {
        let home = Path::new("/data/sbx/home");
        assert_eq!(hosted(home, "a/b.txt").unwrap(), home.join("a/b.txt"));
        assert_eq!(hosted(home, "/home/user/a").unwrap(), home.join("a"));
        assert_eq!(hosted(home, "/home/user").unwrap(), home);
        assert_eq!(hosted(home, "~/x").unwrap(), home.join("x"));
        assert_eq!(hosted(home, "a/../b").unwrap(), home.join("b"));
        assert!(hosted(home, "../etc/passwd").is_err());
        assert!(hosted(home, "/etc/passwd").is_err());
        assert!(hosted(home, "/home/userx").is_err());
        let user = User {
            name: "user".into(),
            uid: 0,
            gid: 0,
            home: home.to_path_buf(),
        };
        let users = Users::new("/nonexistent", None);
        let scope = Scope {
            user: &user,
            users: &users,
            hosted_home: Some(home),
        };
        assert_eq!(scope.shown(&home.join("a/b")), "/home/user/a/b");
        assert!(scope.resolve("a\0b").is_err());
    }

    #[test]
    fn formats() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(rfc3339(1_700_000_000, 5), "2023-11-14T22:13:20.000000005Z");
        assert_eq!(permissions(0o100644, false, false), "-rw-r--r--");
        assert_eq!(permissions(0o40755, true, false), "drwxr-xr-x");
    }
}
