//! The pure part of a template build: the steps as the node reads them, the build cache's
//! keys, and the small rules of E2B's step arguments (users, paths, COPY destinations).

use std::path::{Component, Path, PathBuf};

use sha2::{Digest as _, Sha256};

/// One step, read from the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// `/bin/sh -c SCRIPT` as `user` (empty: the build's current user).
    Run {
        script: String,
        user: String,
    },
    /// The archive at `files` (a blob store key), its `src` placed at `dest`, owned by `user`,
    /// with `mode` when given.
    Copy {
        files: String,
        src: String,
        dest: String,
        user: String,
        mode: Option<u32>,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
}

/// Why a step cannot be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadStep(pub String);

impl Step {
    /// Reads E2B's `{type, args, filesHash}`.
    pub fn parse(kind: &str, args: &[String], files: &str) -> Result<Self, BadStep> {
        let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
        match kind {
            "RUN" if !arg(0).trim().is_empty() => Ok(Step::Run {
                script: arg(0),
                user: arg(1),
            }),
            "COPY" if args.len() >= 2 && !files.is_empty() => {
                let mode = match arg(3).trim() {
                    "" => None,
                    m => Some(
                        u32::from_str_radix(m, 8)
                            .ok()
                            .filter(|m| *m <= 0o7777)
                            .ok_or_else(|| BadStep(format!("COPY mode {m:?} is not octal permissions")))?,
                    ),
                };
                Ok(Step::Copy {
                    files: files.to_string(),
                    src: arg(0),
                    dest: arg(1),
                    user: arg(2),
                    mode,
                })
            }
            "ENV" if !args.is_empty() && args.len().is_multiple_of(2) => Ok(Step::Env(
                args.chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect(),
            )),
            "WORKDIR" if args.len() == 1 && !args[0].is_empty() => Ok(Step::Workdir(arg(0))),
            "USER" if args.len() == 1 && !args[0].is_empty() => Ok(Step::User(arg(0))),
            "RUN" | "COPY" | "ENV" | "WORKDIR" | "USER" => Err(BadStep(format!("{kind} with arguments {args:?}"))),
            other => Err(BadStep(format!("unknown step type {other:?}"))),
        }
    }

    /// How the build's log names it (`RUN echo hi`, as a Dockerfile would).
    pub fn describe(&self) -> String {
        match self {
            Step::Run { script, .. } => format!("RUN {script}"),
            Step::Copy { src, dest, .. } => format!("COPY {src} {dest}"),
            Step::Env(pairs) => format!(
                "ENV {}",
                pairs
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
            Step::Workdir(dir) => format!("WORKDIR {dir}"),
            Step::User(user) => format!("USER {user}"),
        }
    }
}

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
    fn steps_read_as_the_sdk_sends_them() {
        assert_eq!(
            Step::parse("RUN", &strings(&["echo hi", "root"]), "").unwrap(),
            Step::Run {
                script: "echo hi".into(),
                user: "root".into()
            }
        );
        assert_eq!(
            Step::parse("COPY", &strings(&["a.txt", "/app/", "", "0755"]), "files/t/ab").unwrap(),
            Step::Copy {
                files: "files/t/ab".into(),
                src: "a.txt".into(),
                dest: "/app/".into(),
                user: String::new(),
                mode: Some(0o755)
            }
        );
        assert_eq!(
            Step::parse("ENV", &strings(&["A", "1", "B", "2"]), "").unwrap(),
            Step::Env(vec![("A".into(), "1".into()), ("B".into(), "2".into())])
        );
        assert!(Step::parse("COPY", &strings(&["a", "b", "", "9"]), "k").is_err());
        assert!(Step::parse("COPY", &strings(&["a", "b"]), "").is_err());
        assert!(Step::parse("ENV", &strings(&["A"]), "").is_err());
        assert!(Step::parse("FROM", &strings(&["x"]), "").is_err());
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
