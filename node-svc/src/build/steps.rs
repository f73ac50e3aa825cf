//! The pure part of a template build: the build cache's keys, and the small rules of E2B's
//! step arguments (users, paths, COPY destinations). The steps themselves are read by
//! `common::template::Step`, the grammar the gateway checks requests with too.

use std::path::{Component, Path, PathBuf};

use sha2::{Digest as _, Sha256};

/// The build cache key of a step: what came before it (the parent's key) and the step
/// itself, so an unchanged prefix of steps finds its layers again.
pub fn cache_key(parent: &str, kind: &str, args: &[String], files: &str) -> String {
    let mut h = Sha256::new();
    for part in [parent, kind, files].into_iter().chain(args.iter().map(String::as_str)) {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex(&h.finalize())
}

/// The key a build's chain starts from: the image it starts from.
pub fn base_key(what: &str) -> String {
    cache_key("", "FROM", &[what.to_string()], "")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An absolute path inside the sandbox, relative to `cwd` when relative, with `.` and `..`
/// resolved lexically (never above `/`). Returned without its leading `/`.
pub fn in_sandbox(path: &str, cwd: &str) -> PathBuf {
    let joined = if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        Path::new(if cwd.is_empty() { "/" } else { cwd }).join(path)
    };
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    out
}

/// uid and gid of the users every template knows without reading its `/etc/passwd`: `root`,
/// E2B's `user` (1000), and numeric `uid[:gid]`.
pub fn known_ids(user: &str) -> Option<(u32, u32)> {
    match user {
        "root" => Some((0, 0)),
        "user" | "" => Some((1000, 1000)),
        numeric => {
            let (uid, gid) = numeric.split_once(':').unwrap_or((numeric, numeric));
            Some((uid.parse().ok()?, gid.parse().ok()?))
        }
    }
}

/// uid and gid of `name` in a passwd file's text.
pub fn ids_in_passwd(text: &str, name: &str) -> Option<(u32, u32)> {
    text.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        (f.len() >= 4 && f[0] == name).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}

/// Where COPY puts what it copies, as Docker's COPY does: a file to `dest` (or into `dest`
/// when it ends with `/`), a directory's contents into `dest`.
#[derive(Debug, PartialEq, Eq)]
pub enum Placement {
    /// The one file lands at this path.
    File(PathBuf),
    /// Everything under the source lands under this directory.
    Into(PathBuf),
}

pub fn placement(src_is_dir: bool, src: &str, dest: &str, cwd: &str) -> Placement {
    let target = in_sandbox(dest, cwd);
    if src_is_dir {
        return Placement::Into(target);
    }
    if dest.ends_with('/') {
        let name = Path::new(src).file_name().map(PathBuf::from).unwrap_or_default();
        Placement::File(target.join(name))
    } else {
        Placement::File(target)
    }
}

/// The E2B user account an image's provisioning adds when it has none (uid 1000, home
/// `/home/user`), run as root by `/bin/sh` in the image.
pub const PROVISION: &str = "set -e
if ! grep -q '^user:' /etc/passwd 2>/dev/null; then
  echo 'user:x:1000:1000::/home/user:/bin/sh' >> /etc/passwd
  grep -q '^user:' /etc/group 2>/dev/null || echo 'user:x:1000:' >> /etc/group
fi
mkdir -p /home/user
chown 1000:1000 /home/user";

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn cache_keys_follow_the_chain_and_every_argument() {
        let base = base_key("sha256:aa");
        let a = cache_key(&base, "RUN", &strings(&["echo", ""]), "");
        assert_eq!(a, cache_key(&base, "RUN", &strings(&["echo", ""]), ""));
        assert_ne!(a, cache_key(&base, "RUN", &strings(&["echo", "root"]), ""));
        assert_ne!(a, cache_key(&base_key("sha256:bb"), "RUN", &strings(&["echo", ""]), ""));
        // Boundaries between parts are not ambiguous.
        assert_ne!(
            cache_key("", "RUN", &strings(&["ab", "c"]), ""),
            cache_key("", "RUN", &strings(&["a", "bc"]), "")
        );
    }

    #[test]
    fn paths_stay_inside_and_copy_lands_as_docker_puts_it() {
        assert_eq!(in_sandbox("/app/../etc", ""), PathBuf::from("etc"));
        assert_eq!(in_sandbox("../../x", "/home/user"), PathBuf::from("x"));
        assert_eq!(in_sandbox("sub", "/app"), PathBuf::from("app/sub"));
        assert_eq!(
            placement(false, "dir/a.txt", "/app/", ""),
            Placement::File("app/a.txt".into())
        );
        assert_eq!(
            placement(false, "a.txt", "/app/b.txt", ""),
            Placement::File("app/b.txt".into())
        );
        assert_eq!(placement(true, "dir", "/app", ""), Placement::Into("app".into()));
        assert_eq!(known_ids("root"), Some((0, 0)));
        assert_eq!(known_ids("1001:100"), Some((1001, 100)));
        assert_eq!(known_ids("nobody"), None);
        assert_eq!(
            ids_in_passwd(
                "root:x:0:0::/root:/bin/sh\nnode:x:1000:1001::/home/node:/bin/sh\n",
                "node"
            ),
            Some((1000, 1001))
        );
    }
}
