//! Driving one template build: checked and marked `building` by the request that starts it,
//! then run by a task of this gateway on a node placement chooses (the builder is reserved
//! like a sandbox with the template's resources), its log flushed into the build's document
//! as it streams, and its outcome recorded: `ready` with the image (and the build's tags
//! moved to it in the same transaction), or `error` with the step and the reason.
//!
//! A gateway that stops mid-build leaves the document `building`; its `updated_at` stops
//! moving, and readers report such a build as failed once it is [`STALE_AFTER`] old
//! ([`effective_status`]).

use std::sync::Arc;
use std::time::Duration;

use common::clock::now_ms;
use common::template::{
    BuildDoc, BuildLogEntry, BuildReason, BuildStatus, Image, TemplateDoc, BASE, BUILD_KIND, TEMPLATE_KIND,
};
use ledger_client::{LedgerError, Txn};
use proto::node::v1 as node_pb;
use serde::Deserialize;

use super::{files, Templates};
use crate::sandboxes::{Failure, Sandboxes};

/// How often a running build's new log lines (and its liveness) are written.
const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// A build whose document has not been written for this long was abandoned.
pub const STALE_AFTER: Duration = Duration::from_secs(60);
/// The longest a build may take.
const BUILD_DEADLINE: Duration = Duration::from_secs(3600);

/// The image the SDK's `Template()` starts from by default: this cluster's `base`.
const SDK_DEFAULT_IMAGES: [&str; 2] = ["e2bdev/base", "e2bdev/base:latest"];

/// `TemplateStep`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub files_hash: Option<String>,
    #[serde(default)]
    pub force: Option<bool>,
}

/// `FromImageRegistry` (the general kind; cloud registries' kinds are refused by name).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Registry {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
}

/// `TemplateBuildStartV2`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartBuild {
    pub from_image: Option<String>,
    pub from_template: Option<String>,
    pub from_image_registry: Option<Registry>,
    #[serde(default)]
    pub force: Option<bool>,
    #[serde(default)]
    pub steps: Vec<Step>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
}

/// The most steps one build may have.
const MAX_STEPS: usize = 512;

/// Checks the steps as the node will read them, so a malformed one is a 400 now rather than
/// a failed build later.
fn check_steps(steps: &[Step]) -> Result<(), Failure> {
    if steps.len() > MAX_STEPS {
        return Err(Failure::Invalid(format!("a build may have at most {MAX_STEPS} steps")));
    }
    for (i, step) in steps.iter().enumerate() {
        let files = step.files_hash.as_deref().unwrap_or_default();
        common::template::Step::parse(&step.kind, &step.args, files)
            .map_err(|bad| Failure::Invalid(format!("step {}: {bad}", i + 1)))?;
    }
    Ok(())
}

/// The status a reader should see: a `building` document not written for [`STALE_AFTER`] is
/// a build whose gateway stopped.
pub fn effective_status(build: &BuildDoc, now_ms: u64) -> (BuildStatus, Option<BuildReason>) {
    let stale = !build.status.is_final()
        && build.status != BuildStatus::Waiting
        && now_ms.saturating_sub(build.updated_at_unix_ms) > STALE_AFTER.as_millis() as u64;
    if stale {
        return (
            BuildStatus::Error,
            Some(BuildReason {
                message: "the build stopped making progress: the gateway driving it is gone; build again".to_string(),
                step: None,
            }),
        );
    }
    (build.status, build.reason.clone())
}

/// Starts and drives builds.
pub struct Builder {
    pub templates: Arc<Templates>,
    pub sandboxes: Arc<Sandboxes>,
}

/// How a build ended.
enum Outcome {
    Ready(Image),
    Failed(BuildReason),
}

impl Builder {
    /// `POST /v2/templates/{id}/builds/{buildID}`: checks the request, marks the build
    /// `building` (once: a second start is a 409) and runs it in the background.
    pub async fn start(
        self: &Arc<Self>,
        team: &str,
        template_id: &str,
        build_id: &str,
        spec: StartBuild,
    ) -> Result<(), Failure> {
        let build = self.templates.build_of(team, template_id, build_id).await?;
        if build.value.team_id != team {
            return Err(Failure::Forbidden(format!(
                "template {template_id:?} is not yours to build"
            )));
        }
        if build.value.status != BuildStatus::Waiting {
            return Err(Failure::Conflict(format!(
                "build {build_id} was already started ({})",
                build.value.status.as_str()
            )));
        }
        check_steps(&spec.steps)?;
        let mut request = node_pb::BuildRequest {
            build_id: build_id.to_string(),
            resources: Some(node_pb::Resources {
                vcpus: build.value.vcpus.max(1),
                memory_bytes: build.value.memory_mb.max(128) << 20,
                disk_bytes: 0,
            }),
            force: spec.force.unwrap_or(false),
            start_cmd: spec.start_cmd.clone().unwrap_or_default(),
            ready_cmd: spec.ready_cmd.clone().unwrap_or_default(),
            ..Default::default()
        };
        let from_image = spec.from_image.as_deref().map(str::trim).filter(|i| !i.is_empty());
        match (from_image, spec.from_template.as_deref()) {
            (Some(_), Some(_)) => return Err(Failure::Invalid("give fromImage or fromTemplate, not both".into())),
            (Some(image), None) if SDK_DEFAULT_IMAGES.contains(&image) => {
                request.from_template = Some((&Image::base()).into());
            }
            (Some(image), None) => {
                request.from_image = image.to_string();
                if let Some(registry) = &spec.from_image_registry {
                    if registry.kind != "registry" {
                        return Err(Failure::Invalid(format!(
                            "fromImageRegistry type {:?} is not supported (only \"registry\", with username and password)",
                            registry.kind
                        )));
                    }
                    request.registry_username = registry.username.clone().unwrap_or_default();
                    request.registry_password = registry.password.clone().unwrap_or_default();
                }
            }
            (None, reference) => {
                let reference = reference.unwrap_or(BASE);
                let base = self.templates.resolve(team, reference).await?.ok_or_else(|| {
                    Failure::NotFound(format!("template {reference:?} (fromTemplate) has no ready build"))
                })?;
                request.from_template = Some((&base.image).into());
            }
        }
        for (i, step) in spec.steps.iter().enumerate() {
            let files_hash = match (&step.kind[..], &step.files_hash) {
                ("COPY", Some(hash)) => {
                    if !self.templates.files.present(team, hash).await? {
                        return Err(Failure::Invalid(format!(
                            "step {} (COPY): its files ({hash}) were not uploaded",
                            i + 1
                        )));
                    }
                    files::key(team, hash)?.to_string()
                }
                _ => String::new(),
            };
            request.steps.push(node_pb::BuildStep {
                kind: step.kind.clone(),
                args: step.args.clone(),
                files_hash,
                force: step.force.unwrap_or(false),
            });
        }
        let mut marked = build.clone();
        marked.value.status = BuildStatus::Building;
        marked.value.updated_at_unix_ms = now_ms();
        marked
            .value
            .append_logs([log("info", "base", "Build accepted; choosing a node to build on")]);
        match self
            .templates
            .ledger
            .compare(Txn::new().update_read(&build, &marked.value)?)
            .await
        {
            Ok(_) => {}
            Err(LedgerError::Conflict { .. }) => {
                return Err(Failure::Conflict(format!("build {build_id} was started concurrently")))
            }
            Err(err) => return Err(err.into()),
        }
        let this = self.clone();
        let build_id = build_id.to_string();
        tokio::spawn(async move {
            use tracing::Instrument as _;
            let span = tracing::info_span!("template_build", build_id = %build_id);
            let outcome =
                match tokio::time::timeout(BUILD_DEADLINE, this.drive(&marked.value, request).instrument(span)).await {
                    Ok(outcome) => outcome,
                    Err(_) => Outcome::Failed(BuildReason {
                        message: format!("the build took longer than {} s", BUILD_DEADLINE.as_secs()),
                        step: None,
                    }),
                };
            this.finish(&build_id, outcome).await;
        });
        Ok(())
    }

    /// Runs the build on a node, flushing its log as it goes.
    async fn drive(&self, build: &BuildDoc, request: node_pb::BuildRequest) -> Outcome {
        let resources = request.resources.unwrap_or_default();
        let reservation = format!("build-{}", build.build_id);
        let (placed, mut node) = match self
            .sandboxes
            .reserve(&reservation, resources.vcpus, resources.memory_bytes)
            .await
        {
            Ok(found) => found,
            Err(err) => {
                return Outcome::Failed(BuildReason {
                    message: format!("no node could build it: {err}"),
                    step: Some("base".into()),
                })
            }
        };
        tracing::info!(node_id = %placed.node_id, "building");
        self.flush(
            &build.build_id,
            vec![log("info", "base", &format!("Building on node {}", placed.node_id))],
            Some(placed.node_id.clone()),
        )
        .await;
        let outcome = self.stream(&build.build_id, &mut node, request).await;
        self.sandboxes.release(&reservation, &placed.node_id).await;
        outcome
    }

    async fn stream(
        &self,
        build_id: &str,
        node: &mut proto::node::v1::node_client::NodeClient<common::trace::TracedChannel>,
        request: node_pb::BuildRequest,
    ) -> Outcome {
        let lost = |status: String| {
            Outcome::Failed(BuildReason {
                message: format!("the builder node failed: {status}"),
                step: None,
            })
        };
        let mut events = match node.build(request).await {
            Ok(events) => events.into_inner(),
            Err(status) => return lost(status.message().to_string()),
        };
        let mut pending = Vec::new();
        let mut tick = tokio::time::interval(FLUSH_EVERY);
        loop {
            tokio::select! {
                event = events.message() => match event {
                    Ok(Some(node_pb::BuildEvent { event: Some(event) })) => match event {
                        node_pb::build_event::Event::Log(l) => pending.push(BuildLogEntry {
                            at_unix_ms: l.at_unix_ms,
                            level: l.level,
                            message: l.message,
                            step: l.step,
                        }),
                        node_pb::build_event::Event::Done(image) => {
                            self.flush(build_id, std::mem::take(&mut pending), None).await;
                            return Outcome::Ready(image.into());
                        }
                        node_pb::build_event::Event::Failed(f) => {
                            self.flush(build_id, std::mem::take(&mut pending), None).await;
                            return Outcome::Failed(BuildReason {
                                message: f.message,
                                step: Some(f.step).filter(|s| !s.is_empty()),
                            });
                        }
                    },
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        self.flush(build_id, std::mem::take(&mut pending), None).await;
                        return lost("it ended the build without an outcome".into());
                    }
                    Err(status) => {
                        self.flush(build_id, std::mem::take(&mut pending), None).await;
                        return lost(status.message().to_string());
                    }
                },
                _ = tick.tick() => self.flush(build_id, std::mem::take(&mut pending), None).await,
            }
        }
    }

    /// Appends log lines (and refreshes `updated_at`, the build's liveness).
    async fn flush(&self, build_id: &str, entries: Vec<BuildLogEntry>, node_id: Option<String>) {
        for _ in 0..10 {
            let Ok(Some(mut doc)) = self.templates.ledger.get::<BuildDoc>(BUILD_KIND, build_id).await else {
                return;
            };
            let read = doc.clone();
            doc.value.append_logs(entries.iter().cloned());
            doc.value.updated_at_unix_ms = now_ms();
            if let Some(node) = &node_id {
                doc.value.node_id = node.clone();
            }
            let Ok(txn) = Txn::new().update_read(&read, &doc.value) else {
                return;
            };
            match self.templates.ledger.compare(txn).await {
                Ok(_) => return,
                Err(LedgerError::Conflict { .. }) => continue,
                Err(err) => {
                    tracing::warn!(%err, "build log not written");
                    return;
                }
            }
        }
    }

    /// Records the outcome: ready (tags moved to it with the same write) or error.
    async fn finish(&self, build_id: &str, outcome: Outcome) {
        let ledger = &self.templates.ledger;
        for _ in 0..20 {
            let Ok(Some(build)) = ledger.get::<BuildDoc>(BUILD_KIND, build_id).await else {
                tracing::warn!(%build_id, "build gone before its outcome was written (template deleted?)");
                return;
            };
            let mut done = build.value.clone();
            let now = now_ms();
            done.updated_at_unix_ms = now;
            done.finished_at_unix_ms = Some(now);
            let mut txn = Txn::new();
            match &outcome {
                Outcome::Ready(image) => {
                    let Ok(Some(template)) = ledger.get::<TemplateDoc>(TEMPLATE_KIND, &done.template_id).await else {
                        return;
                    };
                    let mut moved = template.value.clone();
                    for tag in &done.tags {
                        moved.tags.insert(tag.clone(), build_id.to_string());
                    }
                    moved.updated_at_unix_ms = now;
                    done.status = BuildStatus::Ready;
                    done.image = Some(image.clone());
                    done.append_logs([log("info", "finalize", "Build finished")]);
                    txn = match txn.update_read(&template, &moved) {
                        Ok(t) => t,
                        Err(_) => return,
                    };
                }
                Outcome::Failed(reason) => {
                    done.status = BuildStatus::Error;
                    done.reason = Some(reason.clone());
                    done.append_logs([log(
                        "error",
                        reason.step.as_deref().unwrap_or("finalize"),
                        &format!("Build failed: {}", reason.message),
                    )]);
                }
            }
            let Ok(txn) = txn.update_read(&build, &done) else {
                return;
            };
            match ledger.compare_resolving(txn, 5).await {
                Ok(_) => {
                    self.templates.forget_resolved();
                    tracing::info!(%build_id, status = done.status.as_str(), "build ended");
                    return;
                }
                Err(LedgerError::Conflict { .. }) => continue,
                Err(err) => {
                    tracing::warn!(%build_id, %err, "build outcome not written; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }
}

fn log(level: &str, step: &str, message: &str) -> BuildLogEntry {
    BuildLogEntry {
        at_unix_ms: now_ms(),
        level: level.to_string(),
        message: message.to_string(),
        step: step.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(kind: &str, args: &[&str]) -> Step {
        Step {
            kind: kind.into(),
            args: args.iter().map(|a| a.to_string()).collect(),
            files_hash: (kind == "COPY").then(|| "ab".to_string()),
            force: None,
        }
    }

    #[test]
    fn steps_are_checked_before_a_node_sees_them() {
        assert!(check_steps(&[
            step("RUN", &["echo hi", "root"]),
            step("COPY", &["a.txt", "/app/", "", ""]),
            step("ENV", &["A", "1", "B", "2"]),
            step("WORKDIR", &["/app"]),
            step("USER", &["root"]),
        ])
        .is_ok());
        for bad in [
            step("RUN", &[]),
            step("ENV", &["A"]),
            step("WORKDIR", &[]),
            step("FROM", &["x"]),
            step("RUN", &["a\0b"]),
            Step {
                files_hash: None,
                ..step("COPY", &["a", "b"])
            },
        ] {
            assert!(
                matches!(check_steps(std::slice::from_ref(&bad)), Err(Failure::Invalid(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn an_abandoned_build_reads_as_failed() {
        let build = BuildDoc {
            status: BuildStatus::Building,
            updated_at_unix_ms: 1_000,
            ..BuildDoc::default()
        };
        assert_eq!(effective_status(&build, 2_000).0, BuildStatus::Building);
        let (status, reason) = effective_status(&build, 1_000 + STALE_AFTER.as_millis() as u64 + 1);
        assert_eq!(status, BuildStatus::Error);
        assert!(reason.is_some());
    }
}
