//! Paths inside a sandbox, as the SDK names them, and the host paths they map to.
//!
//! An E2B sandbox's user lives in `/home/user`; the process runtime gives each sandbox a home
//! folder of its own instead, so `/home/user/...`, `~/...` and relative paths all land in it.
//! Other absolute paths are refused: without a mount namespace (not used yet) they would name
//! the host's files, and `..` may not climb out of the home either.

use std::path::{Component, Path, PathBuf};
use std::time::UNIX_EPOCH;

use super::connect::{Code, RpcError};
use super::wire::EntryInfo;

/// Where the SDK believes a sandbox's home is.
pub const SANDBOX_HOME: &str = "/home/user";

/// The host path for `path` as the SDK gave it.
pub fn resolve(home: &Path, path: &str) -> Result<PathBuf, RpcError> {
    let relative = if path.is_empty() || path == "~" || path == SANDBOX_HOME {
        ""
    } else if let Some(rest) = path.strip_prefix("~/") {
        rest
    } else if let Some(rest) = path.strip_prefix(SANDBOX_HOME).and_then(|r| r.strip_prefix('/')) {
        rest
    } else if path.starts_with('/') {
        return Err(RpcError::new(
            Code::PermissionDenied,
            format!(
                "{path:?} is outside the sandbox's home ({SANDBOX_HOME}); the process runtime confines files to it"
            ),
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

/// The path the SDK should see for a host path inside `home`.
pub fn sandbox_path(home: &Path, host: &Path) -> String {
    match host.strip_prefix(home) {
        Ok(rel) if rel.as_os_str().is_empty() => SANDBOX_HOME.to_string(),
        Ok(rel) => format!("{SANDBOX_HOME}/{}", rel.display()),
        Err(_) => host.display().to_string(),
    }
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

/// RFC 3339 (UTC) for seconds since the epoch.
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

/// Describes the entry at `host` (not following a final symlink).
pub fn entry(home: &Path, host: &Path) -> Result<EntryInfo, RpcError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(host).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            RpcError::new(Code::NotFound, format!("{} does not exist", sandbox_path(home, host)))
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
    let name_of = |uid: u32| if uid == 0 { "root".to_string() } else { uid.to_string() };
    Ok(EntryInfo {
        name: host
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "user".to_string()),
        kind: if link {
            "FILE_TYPE_SYMLINK"
        } else if dir {
            "FILE_TYPE_DIRECTORY"
        } else {
            "FILE_TYPE_FILE"
        },
        path: sandbox_path(home, host),
        size: i64::try_from(meta.len()).unwrap_or(i64::MAX),
        mode: meta.mode() & 0o7777,
        permissions: permissions(meta.mode(), dir, link),
        owner: name_of(meta.uid()),
        group: name_of(meta.gid()),
        modified_time: modified,
        symlink_target: link
            .then(|| std::fs::read_link(host).ok().map(|t| t.display().to_string()))
            .flatten(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_in_the_home() {
        let home = Path::new("/data/sbx/home");
        assert_eq!(resolve(home, "a/b.txt").unwrap(), home.join("a/b.txt"));
        assert_eq!(resolve(home, "/home/user/a").unwrap(), home.join("a"));
        assert_eq!(resolve(home, "/home/user").unwrap(), home);
        assert_eq!(resolve(home, "~/x").unwrap(), home.join("x"));
        assert_eq!(resolve(home, "a/../b").unwrap(), home.join("b"));
        assert!(resolve(home, "../etc/passwd").is_err());
        assert!(resolve(home, "/etc/passwd").is_err());
        assert!(resolve(home, "/home/userx").is_err());
        assert_eq!(sandbox_path(home, &home.join("a/b")), "/home/user/a/b");
    }

    #[test]
    fn formats() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(rfc3339(1_700_000_000, 5), "2023-11-14T22:13:20.000000005Z");
        assert_eq!(permissions(0o100644, false, false), "-rw-r--r--");
        assert_eq!(permissions(0o40755, true, false), "drwxr-xr-x");
    }
}
