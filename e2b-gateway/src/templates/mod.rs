//! The template registry: E2B's templates, builds, names and tags as ledger documents
//! (`common::template`), so every gateway and node reads the same truth and a template cannot
//! exist in one place and not another.
//!
//! Layout: this module reads and writes the documents (request a build, resolve `name:tag`
//! to an image, tags, delete); [`build`] drives one build on a node and records its log and
//! outcome; [`files`] keeps the archives of COPY steps the SDK uploads.
//!
//! Visibility: a template belongs to the team that made it; public ones (the built-in `base`)
//! are visible to all. Another team's private template does not exist for a caller (404),
//! except that its *name* is taken (an alias check answers 403, as E2B's does).

pub mod build;
pub mod code_interpreter;
pub mod files;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::clock::now_ms;
use common::template::{
    check_name, split_name, BuildDoc, BuildStatus, Image, TemplateDoc, TemplateNameDoc, BASE, BASE_BUILD_ID,
    BUILD_KIND, DEFAULT_TAG, TEMPLATE_KIND, TEMPLATE_NAME_KIND,
};
use ledger_client::{LedgerClient, LedgerError, Txn, Versioned};

use crate::sandboxes::Failure;

/// How many ledger transaction retries a registry write makes on a lost reply.
const RESOLVE_ATTEMPTS: usize = 5;

/// How long a resolved `name:tag` is reused by creates before being read again: creates are
/// the hot path, and a tag moves rarely (a create within this long of a tag change may still
/// start the previous build).
const RESOLVED_TTL: Duration = Duration::from_secs(2);

/// What a create needs of its template.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub template: TemplateDoc,
    pub image: Image,
}

/// A template's resources when a build request gives none.
pub const DEFAULT_BUILD_VCPUS: u32 = 2;
pub const DEFAULT_BUILD_MEMORY_MB: u64 = 1024;

/// A new template or build, as `POST /v3/templates` asks for it.
#[derive(Clone, Debug)]
pub struct BuildRequest {
    pub name: String,
    pub tags: Vec<String>,
    pub vcpus: Option<u32>,
    pub memory_mb: Option<u64>,
}

/// What a build request made.
#[derive(Clone, Debug)]
pub struct Requested {
    pub template: TemplateDoc,
    pub build_id: String,
    pub tags: Vec<String>,
}

/// Ledger reads one listing keeps in flight.
const LEDGER_READS_AT_ONCE: usize = 8;

/// The registry.
pub struct Templates {
    pub ledger: LedgerClient,
    pub files: files::Files,
    resolved: Mutex<HashMap<(String, String), (Instant, Resolved)>>,
    /// The names of the cluster's own templates (`base`, the code interpreter's, the
    /// `--templates` file's): no team may take one, even before the cluster has made it.
    /// Names are one namespace for every team, and a team holding one of these (made public)
    /// would have every other team's default creates start its image, with their environment.
    reserved: Vec<String>,
}

/// The team that owns the cluster's built-in templates.
pub const CLUSTER_TEAM: &str = "";

fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", &uuid::Uuid::new_v4().simple().to_string()[..19])
}

fn conflict_or(err: LedgerError, what: impl FnOnce() -> String) -> Failure {
    match err {
        LedgerError::Conflict { .. } => Failure::Conflict(what()),
        other => other.into(),
    }
}

impl Templates {
    /// The registry, `seeds` (the `--templates` file's names) reserved with the built-ins.
    pub fn new(ledger: LedgerClient, files: files::Files, seeds: &[String]) -> Arc<Self> {
        let mut reserved = vec![BASE.to_string(), code_interpreter::NAME.to_string()];
        reserved.extend(seeds.iter().cloned());
        Arc::new(Self {
            ledger,
            files,
            resolved: Mutex::new(HashMap::new()),
            reserved,
        })
    }

    /// Refuses a team other than the cluster a reserved name.
    ///
    /// A name with a `/` is namespaced, as E2B's `team/name`: its first part must be the
    /// team's own ID. Names are one namespace for every team and a public template is found
    /// by name from any team, so another team holding `yourteam/app` (made public) would
    /// have a create of `yourteam/app` made before yours, or after you deleted it, start
    /// their image with your environment.
    fn check_reserved(&self, team: &str, name: &str) -> Result<(), Failure> {
        if team != CLUSTER_TEAM && self.reserved.iter().any(|r| r == name) {
            return Err(Failure::Forbidden(format!(
                "the template name {name:?} is reserved for the cluster's built-in templates"
            )));
        }
        if !in_own_namespace(name, team) {
            let namespace = name.split('/').next().unwrap_or_default();
            return Err(Failure::Forbidden(format!(
                "the template name {name:?} is in namespace {namespace:?}: a team names its own templates {team:?}/NAME, or with no '/'"
            )));
        }
        Ok(())
    }

    /// Writes the built-in `base` (and the `--templates` file's entries: names with fixed
    /// resources over the base image) unless they exist. Every gateway does this at start;
    /// the first one's writes win.
    pub async fn seed(&self, extra: &[(String, Option<u32>, Option<u64>)]) -> Result<(), Failure> {
        let now = now_ms();
        let base_build = BuildDoc {
            build_id: BASE_BUILD_ID.to_string(),
            template_id: BASE.to_string(),
            status: BuildStatus::Ready,
            image: Some(Image::base()),
            created_at_unix_ms: now,
            updated_at_unix_ms: now,
            finished_at_unix_ms: Some(now),
            ..BuildDoc::default()
        };
        let mut entries = vec![(BASE.to_string(), None, None)];
        entries.extend(extra.iter().cloned());
        for (name, vcpus, memory_mb) in entries {
            let template = TemplateDoc {
                template_id: name.clone(),
                team_id: String::new(),
                public: true,
                names: vec![name.clone()],
                vcpus: vcpus.unwrap_or(0),
                memory_mb: memory_mb.unwrap_or(0),
                tags: [(DEFAULT_TAG.to_string(), BASE_BUILD_ID.to_string())].into(),
                builds: vec![BASE_BUILD_ID.to_string()],
                snapshot_of: None,
                created_at_unix_ms: now,
                updated_at_unix_ms: now,
            };
            if let Some(held) = self.named(&name).await?.filter(|d| d.value.team_id != CLUSTER_TEAM) {
                tracing::error!(
                    name = %name,
                    template_id = %held.value.template_id,
                    team_id = %held.value.team_id,
                    "a team's template holds a name reserved for the cluster's own: it resolves for nobody; delete it to let the cluster make its own"
                );
            }
            let mut txn = Self::create_txn(&template, Some(&name))?;
            if name == BASE {
                txn = txn.create(BUILD_KIND, BASE_BUILD_ID, &base_build)?;
            }
            match self.ledger.compare_resolving(txn, RESOLVE_ATTEMPTS).await {
                Ok(_) | Err(LedgerError::Conflict { .. }) => {}
                Err(err) => return Err(err.into()),
            }
        }
        Ok(())
    }

    /// The template holding `name`, whoever owns it.
    async fn named(&self, name: &str) -> Result<Option<Versioned<TemplateDoc>>, Failure> {
        let Some(owner) = self.ledger.get::<TemplateNameDoc>(TEMPLATE_NAME_KIND, name).await? else {
            return Ok(None);
        };
        Ok(self
            .ledger
            .get::<TemplateDoc>(TEMPLATE_KIND, &owner.value.template_id)
            .await?)
    }

    /// The template with this ID or name, if `team` may see it.
    pub async fn find(&self, team: &str, id_or_name: &str) -> Result<Option<Versioned<TemplateDoc>>, Failure> {
        let (name, _) = split_name(id_or_name);
        if let Some(doc) = self.ledger.get::<TemplateDoc>(TEMPLATE_KIND, name).await? {
            return Ok(doc.value.visible_to(team).then_some(doc));
        }
        Ok(self
            .named(name)
            .await?
            // A reserved name a team took before it was reserved, or another team's namespace
            // taken before namespaces were its team's, sends nobody to its template.
            .filter(|doc| !self.reserved.iter().any(|r| r == name) || doc.value.team_id == CLUSTER_TEAM)
            .filter(|doc| in_own_namespace(name, &doc.value.team_id))
            .filter(|doc| doc.value.visible_to(team)))
    }

    /// The template with this ID or name, whoever owns it (for operators).
    pub async fn find_any(&self, id_or_name: &str) -> Result<Option<Versioned<TemplateDoc>>, Failure> {
        let (name, _) = split_name(id_or_name);
        if let Some(doc) = self.ledger.get::<TemplateDoc>(TEMPLATE_KIND, name).await? {
            return Ok(Some(doc));
        }
        self.named(name).await
    }

    /// Whether a name is taken: `Some(true)` by a template `team` may see, `Some(false)` by
    /// another team's.
    pub async fn name_taken(&self, team: &str, name: &str) -> Result<Option<(bool, TemplateDoc)>, Failure> {
        let (name, _) = split_name(name);
        Ok(self.named(name).await?.map(|d| (d.value.visible_to(team), d.value)))
    }

    /// A transaction creating `template` and, when given, the `name` it holds.
    fn create_txn(template: &TemplateDoc, name: Option<&str>) -> Result<Txn, Failure> {
        let mut txn = Txn::new().create(TEMPLATE_KIND, &template.template_id, template)?;
        if let Some(name) = name {
            let holder = TemplateNameDoc {
                template_id: template.template_id.clone(),
            };
            txn = txn.create(TEMPLATE_NAME_KIND, name, &holder)?;
        }
        Ok(txn)
    }

    /// Resolves `name:tag` (or an ID) to the image a create starts, as `team` sees it.
    pub async fn resolve(&self, team: &str, reference: &str) -> Result<Option<Resolved>, Failure> {
        let key = (team.to_string(), reference.to_string());
        if let Ok(cache) = self.resolved.lock() {
            if let Some((at, resolved)) = cache.get(&key) {
                if at.elapsed() < RESOLVED_TTL {
                    return Ok(Some(resolved.clone()));
                }
            }
        }
        let Some(template) = self.find(team, reference).await? else {
            // `base` is there even before the registry is seeded (a ledger that was down when
            // this gateway started).
            return Ok((split_name(reference) == (BASE, DEFAULT_TAG)).then(Self::builtin_base));
        };
        let (_, tag) = split_name(reference);
        let Some(build_id) = template.value.tags.get(tag) else {
            return Ok(None);
        };
        let Some(build) = self.ledger.get::<BuildDoc>(BUILD_KIND, build_id).await? else {
            return Ok(None);
        };
        let Some(image) = build.value.image.filter(|_| build.value.status == BuildStatus::Ready) else {
            return Ok(None);
        };
        let resolved = Resolved {
            template: template.value,
            image,
        };
        if let Ok(mut cache) = self.resolved.lock() {
            if cache.len() > 10_000 {
                cache.clear();
            }
            cache.insert(key, (Instant::now(), resolved.clone()));
        }
        Ok(Some(resolved))
    }

    fn builtin_base() -> Resolved {
        Resolved {
            template: TemplateDoc {
                template_id: BASE.to_string(),
                public: true,
                names: vec![BASE.to_string()],
                ..TemplateDoc::default()
            },
            image: Image::base(),
        }
    }

    /// `POST /v3/templates`: a new build of the template named `name` (created, owned by
    /// `team`, when the name is free; refused when another team holds it).
    pub async fn request_build(&self, team: &str, req: BuildRequest) -> Result<Requested, Failure> {
        let (name, tag) = split_name(&req.name);
        check_name("name", name).map_err(Failure::Invalid)?;
        self.check_reserved(team, name)?;
        let mut tags: Vec<String> = req.tags.clone();
        if tag != DEFAULT_TAG || tags.is_empty() {
            tags.insert(0, tag.to_string());
        }
        tags.dedup();
        for tag in &tags {
            check_name("tag", tag).map_err(Failure::Invalid)?;
        }
        let now = now_ms();
        let build_id = uuid::Uuid::new_v4().to_string();
        let existing = self.named(name).await?;
        let (template, txn) = match existing {
            Some(doc) if doc.value.team_id != team => {
                return Err(Failure::Forbidden(format!(
                    "the template name {name:?} is taken by another team"
                )))
            }
            Some(mut doc) => {
                if let Some(v) = req.vcpus {
                    doc.value.vcpus = v;
                }
                if let Some(m) = req.memory_mb {
                    doc.value.memory_mb = m;
                }
                doc.value.builds.push(build_id.clone());
                doc.value.updated_at_unix_ms = now;
                let txn = Txn::new().update_read(&doc, &doc.value)?;
                (doc.value, txn)
            }
            None => {
                let template = TemplateDoc {
                    template_id: new_id("t"),
                    team_id: team.to_string(),
                    public: false,
                    names: vec![name.to_string()],
                    vcpus: req.vcpus.unwrap_or(DEFAULT_BUILD_VCPUS),
                    memory_mb: req.memory_mb.unwrap_or(DEFAULT_BUILD_MEMORY_MB),
                    tags: Default::default(),
                    builds: vec![build_id.clone()],
                    snapshot_of: None,
                    created_at_unix_ms: now,
                    updated_at_unix_ms: now,
                };
                let txn = Self::create_txn(&template, Some(name))?;
                (template, txn)
            }
        };
        let build = BuildDoc {
            build_id: build_id.clone(),
            template_id: template.template_id.clone(),
            team_id: team.to_string(),
            status: BuildStatus::Waiting,
            vcpus: template.vcpus,
            memory_mb: template.memory_mb,
            tags: tags.clone(),
            created_at_unix_ms: now,
            updated_at_unix_ms: now,
            ..BuildDoc::default()
        };
        let txn = txn.create(BUILD_KIND, &build_id, &build)?;
        self.ledger
            .compare_resolving(txn, RESOLVE_ATTEMPTS)
            .await
            .map_err(|e| conflict_or(e, || format!("template {name:?} changed concurrently; retry")))?;
        Ok(Requested {
            template,
            build_id,
            tags,
        })
    }

    /// Registers a snapshot of sandbox `source` (E2B's snapshots are templates): under
    /// `name` (a new build of the team's template of that name, or a new template), or under a
    /// new template's ID; its `default` tag points at a build that is ready with `image`.
    /// Returns the template.
    pub async fn register_snapshot(
        &self,
        team: &str,
        name: Option<&str>,
        source: &str,
        mut image: Image,
        (vcpus, memory_mb): (u32, u64),
    ) -> Result<TemplateDoc, Failure> {
        if let Some(name) = name {
            check_name("name", name).map_err(Failure::Invalid)?;
            self.check_reserved(team, name)?;
        }
        let now = now_ms();
        let build_id = uuid::Uuid::new_v4().to_string();
        image.build_id = build_id.clone();
        let existing = match name {
            Some(name) => self.named(name).await?,
            None => None,
        };
        let (template, txn) = match existing {
            Some(doc) if doc.value.team_id != team => {
                return Err(Failure::Forbidden(format!(
                    "the template name {:?} is taken by another team",
                    name.unwrap_or_default()
                )))
            }
            Some(mut doc) => {
                doc.value.builds.push(build_id.clone());
                doc.value.tags.insert(DEFAULT_TAG.to_string(), build_id.clone());
                doc.value.snapshot_of = Some(source.to_string());
                doc.value.updated_at_unix_ms = now;
                let txn = Txn::new().update_read(&doc, &doc.value)?;
                (doc.value, txn)
            }
            None => {
                let template = TemplateDoc {
                    template_id: new_id("s"),
                    team_id: team.to_string(),
                    public: false,
                    names: name.map(|n| vec![n.to_string()]).unwrap_or_default(),
                    vcpus,
                    memory_mb,
                    tags: [(DEFAULT_TAG.to_string(), build_id.clone())].into(),
                    builds: vec![build_id.clone()],
                    snapshot_of: Some(source.to_string()),
                    created_at_unix_ms: now,
                    updated_at_unix_ms: now,
                };
                let txn = Self::create_txn(&template, name)?;
                (template, txn)
            }
        };
        let build = BuildDoc {
            build_id: build_id.clone(),
            template_id: template.template_id.clone(),
            team_id: team.to_string(),
            status: BuildStatus::Ready,
            vcpus,
            memory_mb,
            tags: vec![DEFAULT_TAG.to_string()],
            image: Some(image),
            created_at_unix_ms: now,
            updated_at_unix_ms: now,
            finished_at_unix_ms: Some(now),
            ..BuildDoc::default()
        };
        self.ledger
            .compare_resolving(txn.create(BUILD_KIND, &build_id, &build)?, RESOLVE_ATTEMPTS)
            .await
            .map_err(|e| conflict_or(e, || format!("snapshot of {source} raced another write; retry")))?;
        self.forget_resolved();
        Ok(template)
    }

    /// A build of a template of `team`'s own. Another team's public template is there to
    /// start sandboxes from, not to read how it was made: a build's logs hold whatever its
    /// steps printed.
    pub async fn build_of(
        &self,
        team: &str,
        template_id: &str,
        build_id: &str,
    ) -> Result<Versioned<BuildDoc>, Failure> {
        let template = self
            .find(team, template_id)
            .await?
            .filter(|t| t.value.team_id == team)
            .ok_or_else(|| Failure::NotFound(format!("template {template_id:?}")))?;
        match self.ledger.get::<BuildDoc>(BUILD_KIND, build_id).await? {
            Some(build) if build.value.template_id == template.value.template_id => Ok(build),
            _ => Err(Failure::NotFound(format!(
                "build {build_id:?} of template {template_id:?}"
            ))),
        }
    }

    /// Every template `team` may see, newest first.
    pub async fn list(&self, team: &str) -> Result<Vec<TemplateDoc>, Failure> {
        let (docs, _) = self.ledger.list::<TemplateDoc>(TEMPLATE_KIND, "").await?;
        let mut docs: Vec<TemplateDoc> = docs
            .into_iter()
            .map(|d| d.value)
            .filter(|t| t.visible_to(team))
            .collect();
        docs.sort_by_key(|t| std::cmp::Reverse(t.created_at_unix_ms));
        Ok(docs)
    }

    /// Builds of a template, oldest first: read a few at a time, so a template with many
    /// builds costs a few round trips to the ledger rather than one per build.
    pub async fn builds(&self, template: &TemplateDoc) -> Result<Vec<BuildDoc>, Failure> {
        use futures::{StreamExt as _, TryStreamExt as _};
        // Owned IDs and a client per read: the futures borrow nothing, so the handler stays
        // `Send` for any lifetime.
        let found: Vec<_> = futures::stream::iter(template.builds.clone())
            .map(|id| {
                let ledger = self.ledger.clone();
                async move { ledger.get::<BuildDoc>(BUILD_KIND, &id).await }
            })
            .buffered(LEDGER_READS_AT_ONCE)
            .try_collect()
            .await?;
        Ok(found.into_iter().flatten().map(|b| b.value).collect())
    }

    /// Every template `team` sees, newest first, each with its builds (oldest first): the
    /// templates' builds are read concurrently, a bounded number at a time.
    pub async fn list_with_builds(&self, team: &str) -> Result<Vec<(TemplateDoc, Vec<BuildDoc>)>, Failure> {
        use futures::{StreamExt as _, TryStreamExt as _};
        let templates = self.list(team).await?;
        let mut listed = Vec::with_capacity(templates.len());
        let mut reads = futures::stream::iter(templates)
            .map(|t| async move {
                let builds = self.builds(&t).await;
                builds.map(|b| (t, b))
            })
            .buffered(LEDGER_READS_AT_ONCE);
        while let Some(entry) = reads.try_next().await? {
            listed.push(entry);
        }
        Ok(listed)
    }

    /// Deletes a template `team` owns: its document, names and builds. Sandboxes running it
    /// keep running (their image travels with them); new creates of it fail.
    pub async fn delete(&self, team: &str, id_or_name: &str) -> Result<(), Failure> {
        let doc = self
            .find(team, id_or_name)
            .await?
            .ok_or_else(|| Failure::NotFound(format!("template {id_or_name:?}")))?;
        if doc.value.team_id != team {
            return Err(Failure::Forbidden(format!(
                "template {id_or_name:?} is public and cannot be deleted"
            )));
        }
        let mut txn = Txn::new().delete(TEMPLATE_KIND, &doc.value.template_id, doc.version);
        for name in &doc.value.names {
            if let Some(n) = self.ledger.get::<TemplateNameDoc>(TEMPLATE_NAME_KIND, name).await? {
                txn = txn.delete(TEMPLATE_NAME_KIND, name, n.version);
            }
        }
        for id in &doc.value.builds {
            if let Some(b) = self.ledger.get::<BuildDoc>(BUILD_KIND, id).await? {
                txn = txn.delete(BUILD_KIND, id, b.version);
            }
        }
        self.ledger
            .compare_resolving(txn, RESOLVE_ATTEMPTS)
            .await
            .map_err(|e| conflict_or(e, || format!("template {id_or_name:?} changed concurrently; retry")))?;
        self.forget_resolved();
        Ok(())
    }

    /// Points `tags` of the template named in `target` (`name:tag`) at the build `target`'s
    /// tag points at. Returns that build.
    pub async fn assign_tags(&self, team: &str, target: &str, tags: &[String]) -> Result<String, Failure> {
        if tags.is_empty() {
            return Err(Failure::Invalid("tags must not be empty".to_string()));
        }
        for tag in tags {
            check_name("tag", tag).map_err(Failure::Invalid)?;
        }
        let (_, source_tag) = split_name(target);
        let mut doc = self.owned(team, target).await?;
        let build = doc
            .value
            .tags
            .get(source_tag)
            .cloned()
            .ok_or_else(|| Failure::NotFound(format!("tag {source_tag:?} of template {target:?}")))?;
        for tag in tags {
            doc.value.tags.insert(tag.clone(), build.clone());
        }
        doc.value.updated_at_unix_ms = now_ms();
        self.write(&doc).await?;
        Ok(build)
    }

    /// Removes `tags` from the template named `name`.
    pub async fn remove_tags(&self, team: &str, name: &str, tags: &[String]) -> Result<(), Failure> {
        let mut doc = self.owned(team, name).await?;
        for tag in tags {
            if doc.value.tags.remove(tag).is_none() {
                return Err(Failure::NotFound(format!("tag {tag:?} of template {name:?}")));
            }
        }
        doc.value.updated_at_unix_ms = now_ms();
        self.write(&doc).await
    }

    /// Makes a template `team` owns public (visible to every team) or private again; returns
    /// its names.
    pub async fn set_public(&self, team: &str, id_or_name: &str, public: Option<bool>) -> Result<Vec<String>, Failure> {
        let mut doc = self.owned(team, id_or_name).await?;
        if let Some(public) = public {
            if doc.value.public != public {
                doc.value.public = public;
                doc.value.updated_at_unix_ms = now_ms();
                self.write(&doc).await?;
            }
        }
        Ok(doc.value.names)
    }

    async fn owned(&self, team: &str, name: &str) -> Result<Versioned<TemplateDoc>, Failure> {
        let doc = self
            .find(team, name)
            .await?
            .ok_or_else(|| Failure::NotFound(format!("template {name:?}")))?;
        if doc.value.team_id != team {
            return Err(Failure::Forbidden(format!("template {name:?} is not yours to change")));
        }
        Ok(doc)
    }

    async fn write(&self, doc: &Versioned<TemplateDoc>) -> Result<(), Failure> {
        self.ledger
            .compare_resolving(Txn::new().update_read(doc, &doc.value)?, RESOLVE_ATTEMPTS)
            .await
            .map_err(|e| {
                conflict_or(e, || {
                    format!("template {} changed concurrently; retry", doc.value.template_id)
                })
            })?;
        self.forget_resolved();
        Ok(())
    }

    pub(crate) fn forget_resolved(&self) {
        if let Ok(mut cache) = self.resolved.lock() {
            cache.clear();
        }
    }
}

/// Whether `name` may be `team`'s: a name with a `/` is in the namespace its first part
/// names, which is that team's alone (the cluster's own may be anywhere).
fn in_own_namespace(name: &str, team: &str) -> bool {
    team == CLUSTER_TEAM || name.split_once('/').is_none_or(|(namespace, _)| namespace == team)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespaced_name_is_its_namespaces_team_alone() {
        assert!(in_own_namespace("app", "team-a"));
        assert!(in_own_namespace("team-a/app", "team-a"));
        assert!(in_own_namespace("team-a/x/app", "team-a"));
        assert!(!in_own_namespace("team-b/app", "team-a"));
        assert!(
            !in_own_namespace("team-a-x/app", "team-a"),
            "a prefix of the ID is not the ID"
        );
        assert!(in_own_namespace("anyone/app", CLUSTER_TEAM), "the cluster's own");
    }
}
