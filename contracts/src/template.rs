//! Templates as the cluster stores them: what a sandbox's root filesystem is made of (an
//! [`Image`]: read-only layers plus the config every sandbox of it starts with) and the ledger
//! documents that name and version them.
//!
//! Three kinds of documents make the registry, all in the ledger so the gateways and every
//! node read one truth:
//! - `template/<template_id>` ([`TemplateDoc`]): who owns it, its names, its resources, and
//!   which build each tag points at;
//! - `template-name/<name>` ([`TemplateNameDoc`]): a name taken, written in the same
//!   transaction as the template, so two teams cannot both take one;
//! - `template-build/<build_id>` ([`BuildDoc`]): one build, its status, its log and, once
//!   ready, its image.
//!
//! A build's steps are read by one grammar ([`Step`]): the gateway checks a request with it,
//! the node runs what it reads.
//!
//! The built-in `base` is a template like the others (public, seeded by every gateway at
//! start) whose image is the host's userland with no layers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const TEMPLATE_KIND: &str = "template";
pub const TEMPLATE_NAME_KIND: &str = "template-name";
pub const BUILD_KIND: &str = "template-build";

/// The built-in template's ID and name.
pub const BASE: &str = "base";
/// The built-in template's build (a UUID, as E2B's build IDs are: the SDK parses them).
pub const BASE_BUILD_ID: &str = "00000000-0000-0000-0000-000000000000";
/// The tag a name without one means.
pub const DEFAULT_TAG: &str = "default";

/// One read-only layer: an OCI layer blob (gzip tar) in the blob store, named by the SHA-256
/// of its bytes (`sha256:<hex>`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layer {
    pub digest: String,
    pub size: u64,
}

/// A built template: every sandbox of it starts from these layers with this config.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    /// The build that made it ([`BASE_BUILD_ID`] for the built-in one).
    pub build_id: String,
    /// Bottom first.
    #[serde(default)]
    pub layers: Vec<Layer>,
    /// The layers sit on the host's own userland (read-only `/usr`): templates built from
    /// `base`. Otherwise the layers are a whole root filesystem (an OCI image's).
    #[serde(default)]
    pub host_userland: bool,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Default user of commands (empty: `user`).
    #[serde(default)]
    pub user: String,
    /// Default working directory of commands (empty: the user's home).
    #[serde(default)]
    pub workdir: String,
    /// Started at create.
    #[serde(default)]
    pub start_cmd: Option<String>,
    /// Create returns once this exits 0 (E2B's ready check), run as the default user.
    #[serde(default)]
    pub ready_cmd: Option<String>,
}

impl Image {
    /// The built-in `base`: the host's userland, nothing on it.
    pub fn base() -> Self {
        Self {
            build_id: BASE_BUILD_ID.to_string(),
            host_userland: true,
            ..Self::default()
        }
    }
}

/// `template/<template_id>`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateDoc {
    pub template_id: String,
    /// The owning team (empty for public built-ins).
    pub team_id: String,
    pub public: bool,
    pub names: Vec<String>,
    pub vcpus: u32,
    pub memory_mb: u64,
    /// Tag → the build it points at. A build becomes the target of its tags when it is ready.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// Every build requested, oldest first.
    #[serde(default)]
    pub builds: Vec<String>,
    /// Set for a snapshot of a sandbox (E2B's snapshots are templates): that sandbox's ID.
    #[serde(default)]
    pub snapshot_of: Option<String>,
    pub created_at_unix_ms: u64,
    pub updated_at_unix_ms: u64,
}

impl TemplateDoc {
    /// Whether `team` may use (read, start sandboxes of) it.
    pub fn visible_to(&self, team: &str) -> bool {
        self.public || self.team_id == team
    }
}

/// `template-name/<name>`: which template holds a name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateNameDoc {
    pub template_id: String,
}

/// Where a build is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    /// Requested; its steps have not been sent yet.
    #[default]
    Waiting,
    Building,
    Ready,
    Error,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Building => "building",
            Self::Ready => "ready",
            Self::Error => "error",
        }
    }

    pub fn is_final(self) -> bool {
        matches!(self, Self::Ready | Self::Error)
    }
}

/// One line of a build's log.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildLogEntry {
    pub at_unix_ms: u64,
    pub level: String,
    pub message: String,
    /// `base`, a step number from 1, or `finalize`.
    #[serde(default)]
    pub step: String,
}

/// Why a build failed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildReason {
    pub message: String,
    #[serde(default)]
    pub step: Option<String>,
}

/// The most log entries a build keeps (older ones are dropped, counted in `logs_dropped`).
pub const MAX_BUILD_LOG: usize = 2_000;

/// `template-build/<build_id>`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildDoc {
    pub build_id: String,
    pub template_id: String,
    pub team_id: String,
    pub status: BuildStatus,
    pub vcpus: u32,
    pub memory_mb: u64,
    /// Tags it takes once ready.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Set once ready.
    #[serde(default)]
    pub image: Option<Image>,
    #[serde(default)]
    pub reason: Option<BuildReason>,
    #[serde(default)]
    pub logs: Vec<BuildLogEntry>,
    /// Entries dropped from the front of `logs` (so `logsOffset` keeps counting from the
    /// first entry ever written).
    #[serde(default)]
    pub logs_dropped: u64,
    /// The node building it.
    #[serde(default)]
    pub node_id: String,
    pub created_at_unix_ms: u64,
    /// Written at least every few seconds while it builds: a build not updated for long was
    /// left by a gateway that stopped, and is ended as failed.
    pub updated_at_unix_ms: u64,
    #[serde(default)]
    pub finished_at_unix_ms: Option<u64>,
}

impl BuildDoc {
    /// Appends log entries, dropping the oldest past [`MAX_BUILD_LOG`].
    pub fn append_logs(&mut self, entries: impl IntoIterator<Item = BuildLogEntry>) {
        self.logs.extend(entries);
        if self.logs.len() > MAX_BUILD_LOG {
            let excess = self.logs.len() - MAX_BUILD_LOG;
            self.logs.drain(..excess);
            self.logs_dropped += excess as u64;
        }
    }

    /// Entries from `offset` (counted from the first entry ever written), at most `limit`.
    pub fn logs_from(&self, offset: u64, limit: usize) -> &[BuildLogEntry] {
        let start = offset.saturating_sub(self.logs_dropped).min(self.logs.len() as u64) as usize;
        let end = start.saturating_add(limit).min(self.logs.len());
        &self.logs[start..end]
    }
}

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
        if args.iter().any(|a| a.contains('\0')) {
            return Err(BadStep(format!("{kind}: an argument contains a NUL byte")));
        }
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

/// Splits E2B's `name:tag` (a bare name means [`DEFAULT_TAG`]).
pub fn split_name(reference: &str) -> (&str, &str) {
    match reference.rsplit_once(':') {
        Some((name, tag)) if !name.is_empty() && !tag.is_empty() => (name, tag),
        _ => (reference, DEFAULT_TAG),
    }
}

/// Checks a template name or tag: 1 to 128 lowercase letters, digits, `-`, `_`, `.` or `/`
/// (a namespace), starting with a letter or digit.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.' | b'/'))
        && !name.contains("..")
        && !name.contains("//");
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {name:?} must be 1 to 128 lowercase letters, digits, '-', '_', '.' or '/', starting with a letter or digit"
        ))
    }
}

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
        assert!(Step::parse("RUN", &strings(&["a\0b"]), "").is_err());
    }

    #[test]
    fn names_and_tags_split_as_e2b_writes_them() {
        assert_eq!(split_name("py"), ("py", "default"));
        assert_eq!(split_name("py:v1"), ("py", "v1"));
        assert_eq!(split_name("team/py:v1"), ("team/py", "v1"));
        assert_eq!(split_name("py:"), ("py:", "default"));
        assert!(check_name("name", "my-template_1.0").is_ok());
        for bad in ["", "Py", "-x", "a b", "a..b", "a//b", "x\u{0}", &"a".repeat(129)] {
            assert!(check_name("name", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn build_logs_page_from_the_first_entry_ever_written() {
        let mut doc = BuildDoc::default();
        let entry = |i: usize| BuildLogEntry {
            message: i.to_string(),
            ..BuildLogEntry::default()
        };
        doc.append_logs((0..MAX_BUILD_LOG + 10).map(entry));
        assert_eq!(doc.logs.len(), MAX_BUILD_LOG);
        assert_eq!(doc.logs_dropped, 10);
        assert_eq!(doc.logs_from(0, 1)[0].message, "10", "dropped entries are skipped");
        assert_eq!(doc.logs_from(15, 2)[1].message, "16");
        assert!(doc.logs_from(u64::MAX, 100).is_empty());
        assert_eq!(doc.logs_from(0, usize::MAX).len(), MAX_BUILD_LOG);
    }
}
