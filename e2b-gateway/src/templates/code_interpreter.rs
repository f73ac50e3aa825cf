//! `code-interpreter-v1`, the template E2B's code-interpreter SDKs create by default: built by
//! the cluster itself, through the same pipeline as a team's build, from `base` plus the
//! server in `code-interpreter/server.py` (Python's Jupyter kernels come from the nodes'
//! Debian packages, which `base` shares).
//!
//! Every gateway started with it on runs [`keep_built`]: it waits for a node, and builds the
//! template unless a ready build of this very recipe exists. The recipe's digest (server,
//! steps, commands) is a tag of the build, so a gateway whose server changed builds again and
//! one that finds its digest tagged does nothing. Meanwhile its [`Availability`] is watched
//! by creates (which wait a while for a build in progress rather than answer "not found")
//! and by `up`, which prints it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::template::{BuildStatus, BASE, DEFAULT_TAG};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use super::build::{effective_status, Builder, StartBuild, Step};
use super::{files, BuildRequest, Templates};
use crate::sandboxes::Failure;

/// The template's name, as both SDKs default to it.
pub const NAME: &str = "code-interpreter-v1";
/// The team that owns the cluster's public built-ins.
const PUBLIC_TEAM: &str = super::CLUSTER_TEAM;
/// The server, its JavaScript contexts' driver and what its Python kernels describe charts
/// with, as the sandbox runs them.
const FILES: [(&str, &[u8]); 3] = [
    ("server.py", include_bytes!("../../../code-interpreter/server.py")),
    (
        "javascript.js",
        include_bytes!("../../../code-interpreter/javascript.js"),
    ),
    ("charts.py", include_bytes!("../../../code-interpreter/charts.py")),
];
const SERVER_DIR: &str = "/opt/sandboxsched/code-interpreter";
const START_CMD: &str = "/usr/bin/python3 /opt/sandboxsched/code-interpreter/server.py";
/// Exits 0 once `/health` says the default kernel answers: it asks once the server listens,
/// and the server holds the answer until the kernel is up, so a create waits no longer than
/// the kernel (the node's retries back off up to half a second).
const READY_CMD: &str = "/usr/bin/python3 /opt/sandboxsched/code-interpreter/server.py --ready";
/// Fails the build with what to install when a node lacks the kernels, and warms what a
/// first cell would otherwise pay for (in `user`'s home, so in the layer every sandbox starts
/// from).
const CHECK_AND_WARM: &str = "/usr/bin/python3 /opt/sandboxsched/code-interpreter/server.py --warm";
/// Its resources: a kernel with pandas and matplotlib loaded is ~150 MB; plots need more.
const VCPUS: u32 = 2;
const MEMORY_MB: u64 = 1024;
/// How long a create waits for a build in progress before it is told to retry.
pub const CREATE_WAITS_AT_MOST: Duration = Duration::from_secs(45);

/// Where the template stands on this gateway.
#[derive(Clone, Debug, PartialEq)]
pub enum Availability {
    /// This gateway does not build it (`--code-interpreter` off).
    Off,
    /// Waiting for what a build needs (a node, the ledger): why.
    Waiting(String),
    /// A build of this recipe is running (this gateway's).
    Building { since: Instant },
    /// Ready: built now (in how long), or found built.
    Ready { built_in: Option<Duration> },
    /// The last build failed (it is tried again): why.
    Failed(String),
}

impl Availability {
    /// How a create that found no ready build is answered.
    pub fn explain(&self) -> Option<String> {
        match self {
            Availability::Off | Availability::Ready { .. } => None,
            Availability::Waiting(why) => Some(format!("{NAME} is not built yet on this cluster: {why}")),
            Availability::Building { since } => Some(format!(
                "{NAME} is being built on this cluster (for {} s so far); retry in a few seconds",
                since.elapsed().as_secs()
            )),
            Availability::Failed(why) => Some(format!("{NAME} failed to build on this cluster (retried): {why}")),
        }
    }
}

/// A watch of the template's availability, `Off` until [`keep_built`] runs.
pub fn availability() -> (watch::Sender<Availability>, watch::Receiver<Availability>) {
    watch::channel(Availability::Off)
}

/// The server as the COPY step's archive (a tar of its folder, reproducible: fixed owner and
/// time), and its digest.
fn archive() -> Result<(Vec<u8>, String), std::io::Error> {
    let mut tar = tar::Builder::new(Vec::new());
    for (name, bytes) in FILES {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        tar.append_data(&mut header, format!("code-interpreter/{name}"), bytes)?;
    }
    let bytes = tar.into_inner()?;
    let hash = hex(&Sha256::digest(&bytes));
    Ok((bytes, hash))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The build's steps (COPY of `files_hash`, then the check-and-warm RUN).
fn steps(files_hash: &str) -> Vec<Step> {
    vec![
        Step {
            kind: "COPY".into(),
            args: vec![
                "code-interpreter".into(),
                SERVER_DIR.into(),
                "root".into(),
                "0644".into(),
            ],
            files_hash: Some(files_hash.to_string()),
            force: None,
        },
        Step {
            kind: "RUN".into(),
            args: vec![CHECK_AND_WARM.into(), "user".into()],
            files_hash: None,
            force: None,
        },
    ]
}

/// The tag naming this recipe: a build tagged so was made from exactly this server and
/// these steps.
fn recipe_tag(files_hash: &str) -> String {
    let mut h = Sha256::new();
    for part in [files_hash, CHECK_AND_WARM, START_CMD, READY_CMD, &MEMORY_MB.to_string()] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    format!("recipe-{}", &hex(&h.finalize())[..12])
}

/// Keeps the template built: returns once a ready build of this recipe exists, retrying
/// (with backoff) whatever stood in the way, and reporting each state to `state`.
pub async fn keep_built(builder: Arc<Builder>, state: watch::Sender<Availability>) {
    let mut wait = Duration::from_secs(1);
    loop {
        match attempt(&builder, &state).await {
            Ok(built_in) => {
                match built_in {
                    Some(took) => tracing::info!(template = NAME, seconds = took.as_secs_f64(), "built and ready"),
                    None => tracing::info!(template = NAME, "already built; ready"),
                }
                state.send_replace(Availability::Ready { built_in });
                return;
            }
            Err(Attempt::NotYet(why)) => {
                tracing::debug!(template = NAME, %why, "cannot build yet");
                state.send_replace(Availability::Waiting(why));
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(Attempt::Failed(why)) => {
                tracing::warn!(template = NAME, %why, "build failed; trying again in {} s", wait.as_secs());
                state.send_replace(Availability::Failed(why));
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(300));
            }
        }
    }
}

enum Attempt {
    /// What a build needs is not there yet (no node; the ledger down).
    NotYet(String),
    Failed(String),
}

impl From<Failure> for Attempt {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::Unavailable(why) | Failure::Unknown(why) => Attempt::NotYet(why),
            other => Attempt::Failed(other.to_string()),
        }
    }
}

/// One try: `Ok(None)` when the recipe's build is already there, `Ok(Some(took))` when this
/// try built it.
async fn attempt(builder: &Arc<Builder>, state: &watch::Sender<Availability>) -> Result<Option<Duration>, Attempt> {
    let templates: &Templates = &builder.templates;
    let (archive, files_hash) = archive().map_err(|e| Attempt::Failed(format!("packing the server: {e}")))?;
    let tag = recipe_tag(&files_hash);
    if let Some(found) = templates.find(PUBLIC_TEAM, NAME).await? {
        if found.value.tags.contains_key(&tag) {
            return Ok(None);
        }
    }
    if builder.sandboxes.nodes().await?.is_empty() {
        return Err(Attempt::NotYet("waiting for a node to build on".into()));
    }
    let key = files::key(PUBLIC_TEAM, &files_hash)?;
    templates
        .files
        .store
        .put_bytes(&key, archive.into())
        .await
        .map_err(|e| Attempt::NotYet(format!("blob store: {e}")))?;
    let since = Instant::now();
    state.send_replace(Availability::Building { since });
    tracing::info!(template = NAME, %tag, "building");
    let requested = templates
        .request_build(
            PUBLIC_TEAM,
            BuildRequest {
                name: NAME.to_string(),
                tags: vec![DEFAULT_TAG.to_string(), tag],
                vcpus: Some(VCPUS),
                memory_mb: Some(MEMORY_MB),
            },
        )
        .await?;
    templates.set_public(PUBLIC_TEAM, NAME, Some(true)).await?;
    let template_id = requested.template.template_id;
    let spec = StartBuild {
        from_template: Some(BASE.to_string()),
        steps: steps(&files_hash),
        start_cmd: Some(START_CMD.to_string()),
        ready_cmd: Some(READY_CMD.to_string()),
        ..StartBuild::default()
    };
    builder
        .start(PUBLIC_TEAM, &template_id, &requested.build_id, spec)
        .await?;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let build = match templates.build_of(PUBLIC_TEAM, &template_id, &requested.build_id).await {
            Ok(build) => build,
            Err(Failure::Unavailable(_)) => continue,
            Err(other) => return Err(other.into()),
        };
        match effective_status(&build.value, common::clock::now_ms()) {
            (BuildStatus::Ready, _) => {
                templates.forget_resolved();
                return Ok(Some(since.elapsed()));
            }
            (BuildStatus::Error, reason) => {
                let why = reason.map(|r| r.message).unwrap_or_else(|| "no reason recorded".into());
                let log: Vec<String> = build
                    .value
                    .logs
                    .iter()
                    .rev()
                    .take(5)
                    .map(|l| l.message.clone())
                    .collect();
                return Err(Attempt::Failed(format!("{why} (last log lines: {})", log.join(" | "))));
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recipe_is_reproducible_and_its_steps_parse() {
        let (a, hash_a) = archive().unwrap();
        let (b, hash_b) = archive().unwrap();
        assert_eq!(a, b);
        assert_eq!(hash_a, hash_b);
        assert_eq!(recipe_tag(&hash_a), recipe_tag(&hash_b));
        assert_ne!(recipe_tag(&hash_a), recipe_tag("00"));
        for step in steps(&hash_a) {
            let files = step.files_hash.clone().unwrap_or_default();
            common::template::Step::parse(&step.kind, &step.args, &files).unwrap();
        }
        common::template::check_name("tag", &recipe_tag(&hash_a)).unwrap();
    }

    #[test]
    fn a_create_is_told_why_the_template_is_not_there() {
        assert_eq!(Availability::Off.explain(), None);
        assert_eq!(Availability::Ready { built_in: None }.explain(), None);
        let building = Availability::Building { since: Instant::now() }.explain().unwrap();
        assert!(building.contains("being built"), "{building}");
        assert!(Availability::Failed("x".into()).explain().unwrap().contains("failed"));
    }
}
