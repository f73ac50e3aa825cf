//! The template part of E2B's REST API, as SDK 2.x calls it: request a build
//! (`POST /v3/templates`), upload COPY files, start the build, poll its status and log; list,
//! get, update and delete templates; tags and alias checks. Paths, JSON names and statuses as
//! `openapi.yml` has them; errors in E2B's `{code, message}` shape.

use std::collections::HashMap;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use common::clock::now_ms;
use common::template::{check_name, BuildDoc, BuildLogEntry, BuildStatus, TemplateDoc};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::{backward_of, json_body, level_of, rfc3339, ApiError, Gateway, ENVD_VERSION, LEVELS};
use crate::ids::check_template_id;
use crate::sandboxes::Failure;
use crate::templates::build::{effective_status, StartBuild};
use crate::templates::{files, BuildRequest};

/// A template failure in E2B's shape (the sandbox wording of [`ApiError`]'s conversion does
/// not fit templates).
fn failure(f: Failure) -> ApiError {
    match f {
        Failure::NotFound(what) => ApiError::new(
            StatusCode::NOT_FOUND,
            format!("{what} doesn't exist or you don't have access to it"),
        ),
        other => other.into(),
    }
}

/// `TemplateBuildRequestV3`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewBuild {
    name: Option<String>,
    alias: Option<String>,
    #[serde(default)]
    tags: Option<Vec<String>>,
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u64>,
}

/// `POST /v3/templates`.
pub async fn request_build(State(g): State<Gateway>, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let team = g.team(&headers)?;
    let req: NewBuild = json_body(&headers, &body, true)?;
    let name = req
        .name
        .or(req.alias)
        .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "name is required"))?;
    if req.cpu_count.is_some_and(|c| c == 0 || c > crate::intent::MAX_VCPUS) {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "cpuCount must be 1 to 256"));
    }
    if req
        .memory_mb
        .is_some_and(|m| !(128..=crate::intent::MAX_MEMORY_MB).contains(&m))
    {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "memoryMB must be 128 to 1048576",
        ));
    }
    let requested = g
        .templates
        .request_build(
            &team,
            BuildRequest {
                name,
                tags: req.tags.unwrap_or_default(),
                vcpus: req.cpu_count,
                memory_mb: req.memory_mb,
            },
        )
        .await
        .map_err(failure)?;
    let t = &requested.template;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({
            "templateID": t.template_id,
            "buildID": requested.build_id,
            "public": t.public,
            "names": t.names,
            "aliases": t.names,
            "tags": requested.tags,
        })),
    )
        .into_response())
}

/// The API key of the request (already checked by [`Gateway::team`]).
fn api_key(headers: &HeaderMap) -> &str {
    headers.get("x-api-key").and_then(|v| v.to_str().ok()).unwrap_or("")
}

/// `GET /templates/{templateID}/files/{hash}`: whether the archive is stored, and where to
/// upload it.
pub async fn file_link(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Path((template_id, hash)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let team = g.team(&headers)?;
    check_template_id("templateID", &template_id)?;
    files::check_hash(&hash).map_err(failure)?;
    let template = g
        .templates
        .find(&team, &template_id)
        .await
        .map_err(failure)?
        .ok_or_else(|| failure(Failure::NotFound(format!("template {template_id:?}"))))?;
    let present = g.templates.files.present(&team, &hash).await.map_err(failure)?;
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("127.0.0.1");
    let expires = common::clock::now_ms() / 1000 + files::UPLOAD_URL_TTL_SECS;
    let token = files::upload_token(api_key(&headers), &template.value.template_id, &hash, expires);
    let url = format!(
        "http://{host}/templates/{}/files/{hash}/upload?expires={expires}&token={token}",
        template.value.template_id
    );
    Ok((StatusCode::CREATED, Json(json!({"present": present, "url": url}))).into_response())
}

/// `PUT /templates/{templateID}/files/{hash}/upload?token=…`: the upload itself (the URL is
/// the credential: the SDK sends no API key here).
pub async fn upload(
    State(g): State<Gateway>,
    Path((template_id, hash)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    body: Body,
) -> Result<StatusCode, ApiError> {
    check_template_id("templateID", &template_id)?;
    files::check_hash(&hash).map_err(failure)?;
    let token = query.get("token").map(String::as_str).unwrap_or("");
    let denied = || ApiError::new(StatusCode::FORBIDDEN, "the upload URL is not valid");
    let expires = query
        .get("expires")
        .and_then(|e| e.parse::<u64>().ok())
        .ok_or_else(denied)?;
    if common::clock::now_ms() / 1000 > expires {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "the upload URL has expired: ask for the file's link again",
        ));
    }
    let template = g
        .templates
        .ledger
        .get::<TemplateDoc>(common::template::TEMPLATE_KIND, &template_id)
        .await
        .map_err(|e| failure(e.into()))?
        .ok_or_else(denied)?;
    let team = &template.value.team_id;
    let signed = g
        .keys
        .iter()
        .filter(|(_, t)| *t == team)
        .any(|(key, _)| files::same_token(token, &files::upload_token(key, &template_id, &hash, expires)));
    if !signed {
        return Err(denied());
    }
    g.templates
        .files
        .store_upload(team, &hash, body)
        .await
        .map_err(failure)?;
    Ok(StatusCode::CREATED)
}

/// `POST /v2/templates/{templateID}/builds/{buildID}`.
pub async fn start_build(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Path((template_id, build_id)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let team = g.team(&headers)?;
    check_template_id("templateID", &template_id)?;
    check_template_id("buildID", &build_id)?;
    let spec: StartBuild = json_body(&headers, &body, true)?;
    g.builder
        .start(&team, &template_id, &build_id, spec)
        .await
        .map_err(failure)?;
    Ok(StatusCode::ACCEPTED)
}

fn log_json(e: &BuildLogEntry) -> Value {
    json!({
        "timestamp": rfc3339(e.at_unix_ms),
        "level": e.level,
        "message": e.message,
        "step": e.step,
    })
}

/// Whether `entry` is at least as severe as `level` (empty: every entry).
fn at_least(entry: &BuildLogEntry, level: &str) -> bool {
    let rank = |l: &str| LEVELS.iter().position(|x| *x == l).unwrap_or(1);
    level.is_empty() || rank(&entry.level) >= rank(level)
}

fn query_u64(query: &HashMap<String, String>, name: &str, default: u64, max: u64) -> Result<u64, ApiError> {
    match query.get(name) {
        None => Ok(default),
        Some(v) => v.parse::<u64>().ok().filter(|n| *n <= max).ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("{name} must be an integer from 0 to {max}"),
            )
        }),
    }
}

/// `GET /templates/{templateID}/builds/{buildID}/status?logsOffset&limit&level`.
pub async fn build_status(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Path((template_id, build_id)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    check_template_id("templateID", &template_id)?;
    check_template_id("buildID", &build_id)?;
    let offset = query_u64(&query, "logsOffset", 0, u64::from(u32::MAX))?;
    let limit = query_u64(&query, "limit", 100, 100)? as usize;
    let level = level_of(&query)?;
    let build = g
        .templates
        .build_of(&team, &template_id, &build_id)
        .await
        .map_err(failure)?
        .value;
    let entries: Vec<Value> = build
        .logs_from(offset, limit)
        .iter()
        .filter(|e| at_least(e, &level))
        .map(log_json)
        .collect();
    let (status, reason) = effective_status(&build, now_ms());
    let mut answer = json!({
        "templateID": build.template_id,
        "buildID": build.build_id,
        "status": status.as_str(),
        "logs": [],
        "logEntries": entries,
    });
    if let Some(reason) = reason {
        let mut step_logs: Vec<Value> = build
            .logs
            .iter()
            .rev()
            .filter(|e| reason.step.as_deref().is_some_and(|s| s == e.step))
            .take(20)
            .map(log_json)
            .collect();
        step_logs.reverse();
        answer["reason"] = json!({
            "message": reason.message,
            "step": reason.step,
            "logEntries": step_logs,
        });
    }
    Ok(Json(answer))
}

/// `GET /templates/{templateID}/builds/{buildID}/logs?cursor&limit&direction&level`.
pub async fn build_logs(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Path((template_id, build_id)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    check_template_id("templateID", &template_id)?;
    check_template_id("buildID", &build_id)?;
    let cursor = query_u64(&query, "cursor", 0, u64::MAX)?;
    let limit = query_u64(&query, "limit", 100, 100)? as usize;
    let level = level_of(&query)?;
    let backward = backward_of(&query)?;
    let build = g
        .templates
        .build_of(&team, &template_id, &build_id)
        .await
        .map_err(failure)?
        .value;
    let wanted = |e: &&BuildLogEntry| at_least(e, &level) && (cursor == 0 || (e.at_unix_ms >= cursor) != backward);
    let logs: Vec<Value> = if backward {
        build
            .logs
            .iter()
            .rev()
            .filter(wanted)
            .take(limit)
            .map(log_json)
            .collect()
    } else {
        build.logs.iter().filter(wanted).take(limit).map(log_json).collect()
    };
    Ok(Json(json!({"logs": logs})))
}

fn build_json(b: &BuildDoc, disk_mb: u64) -> Value {
    let (status, _) = effective_status(b, now_ms());
    json!({
        "buildID": b.build_id,
        "status": status.as_str(),
        "createdAt": rfc3339(b.created_at_unix_ms),
        "updatedAt": rfc3339(b.updated_at_unix_ms),
        "finishedAt": b.finished_at_unix_ms.map(rfc3339),
        "cpuCount": b.vcpus.max(1),
        "memoryMB": b.memory_mb.max(128),
        "diskSizeMB": disk_mb,
        "envdVersion": ENVD_VERSION,
    })
}

/// `Template`: the newest ready build is the one its `buildID` names.
fn template_json(t: &TemplateDoc, builds: &[BuildDoc], disk_mb: u64) -> Value {
    let latest = builds.iter().rev().find(|b| b.status == BuildStatus::Ready);
    let last = builds.last();
    json!({
        "templateID": t.template_id,
        "buildID": latest.map_or("", |b| b.build_id.as_str()),
        "cpuCount": t.vcpus.max(1),
        "memoryMB": if t.memory_mb == 0 { common::resources::DEFAULT_MEMORY_BYTES >> 20 } else { t.memory_mb },
        "diskSizeMB": disk_mb,
        "public": t.public,
        "aliases": t.names,
        "names": t.names,
        "createdAt": rfc3339(t.created_at_unix_ms),
        "updatedAt": rfc3339(t.updated_at_unix_ms),
        "createdBy": null,
        "lastSpawnedAt": null,
        "spawnCount": 0,
        "buildCount": builds.len(),
        "envdVersion": ENVD_VERSION,
        "buildStatus": last.map_or("ready", |b| effective_status(b, now_ms()).0.as_str()),
    })
}

/// `GET /templates` and `GET /v2/templates`.
pub async fn list(State(g): State<Gateway>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    let listed = g.templates.list_with_builds(&team).await.map_err(failure)?;
    Ok(Json(Value::Array(
        listed
            .iter()
            .map(|(t, builds)| template_json(t, builds, g.sandboxes.disk_bytes >> 20))
            .collect(),
    )))
}

async fn found(g: &Gateway, team: &str, id: &str) -> Result<TemplateDoc, ApiError> {
    check_template_id("templateID", id)?;
    g.templates
        .find(team, id)
        .await
        .map_err(failure)?
        .map(|d| d.value)
        .ok_or_else(|| failure(Failure::NotFound(format!("template {id:?}"))))
}

/// `GET /templates/{templateID}`: the template with its builds.
pub async fn get(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    let t = found(&g, &team, &id).await?;
    let builds = g.templates.builds(&t).await.map_err(failure)?;
    Ok(Json(json!({
        "templateID": t.template_id,
        "public": t.public,
        "aliases": t.names,
        "names": t.names,
        "createdAt": rfc3339(t.created_at_unix_ms),
        "updatedAt": rfc3339(t.updated_at_unix_ms),
        "lastSpawnedAt": null,
        "spawnCount": 0,
        "builds": builds.iter().map(|b| build_json(b, g.sandboxes.disk_bytes >> 20)).collect::<Vec<_>>(),
    })))
}

/// `DELETE /templates/{templateID}`.
pub async fn delete(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let team = g.team(&headers)?;
    check_template_id("templateID", &id)?;
    g.templates.delete(&team, &id).await.map_err(failure)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
struct Update {
    public: Option<bool>,
}

/// `PATCH /templates/{templateID}` and `/v2/templates/{templateID}`: makes it public or not.
pub async fn update(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    check_template_id("templateID", &id)?;
    let update: Update = json_body(&headers, &body, true)?;
    let names = g
        .templates
        .set_public(&team, &id, update.public)
        .await
        .map_err(failure)?;
    Ok(Json(json!({"names": names})))
}

#[derive(Debug, Deserialize)]
struct AssignTags {
    target: String,
    tags: Vec<String>,
}

/// `POST /templates/tags`.
pub async fn assign_tags(State(g): State<Gateway>, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let team = g.team(&headers)?;
    let req: AssignTags = json_body(&headers, &body, true)?;
    check_template_id("target", &req.target)?;
    let build = g
        .templates
        .assign_tags(&team, &req.target, &req.tags)
        .await
        .map_err(failure)?;
    Ok((StatusCode::CREATED, Json(json!({"buildID": build, "tags": req.tags}))).into_response())
}

#[derive(Debug, Deserialize)]
struct RemoveTags {
    name: String,
    tags: Vec<String>,
}

/// `DELETE /templates/tags`.
pub async fn remove_tags(State(g): State<Gateway>, headers: HeaderMap, body: Bytes) -> Result<StatusCode, ApiError> {
    let team = g.team(&headers)?;
    let req: RemoveTags = json_body(&headers, &body, true)?;
    check_template_id("name", &req.name)?;
    g.templates
        .remove_tags(&team, &req.name, &req.tags)
        .await
        .map_err(failure)?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /templates/{templateID}/tags`.
pub async fn tags(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    let t = found(&g, &team, &id).await?;
    let builds = g.templates.builds(&t).await.map_err(failure)?;
    let tags: Vec<Value> = t
        .tags
        .iter()
        .map(|(tag, build)| {
            let at = builds
                .iter()
                .find(|b| &b.build_id == build)
                .map_or(t.updated_at_unix_ms, |b| {
                    b.finished_at_unix_ms.unwrap_or(b.created_at_unix_ms)
                });
            json!({"tag": tag, "buildID": build, "createdAt": rfc3339(at)})
        })
        .collect();
    Ok(Json(Value::Array(tags)))
}

/// `GET /templates/aliases/{alias}`: 200 for a name the caller may use, 403 for another
/// team's (the name is taken), 404 when free.
pub async fn alias(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Path(alias): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    let (name, _) = common::template::split_name(&alias);
    check_name("alias", name).map_err(|m| ApiError::new(StatusCode::BAD_REQUEST, m))?;
    match g.templates.name_taken(&team, name).await.map_err(failure)? {
        Some((true, t)) => Ok(Json(json!({"templateID": t.template_id, "public": t.public}))),
        Some((false, _)) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("the template name {name:?} belongs to another team"),
        )),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("template {name:?} not found"),
        )),
    }
}

#[derive(Debug, Default, Deserialize)]
struct NewSnapshot {
    name: Option<String>,
}

fn snapshot_json(t: &TemplateDoc) -> Value {
    let names: Vec<String> = t.names.iter().map(|n| format!("{n}:default")).collect();
    let id = names
        .first()
        .cloned()
        .unwrap_or_else(|| format!("{}:default", t.template_id));
    json!({"snapshotID": id, "names": names})
}

/// `POST /sandboxes/{id}/snapshots`: the sandbox's files now, as a template of the team's
/// (named, or by its ID) that new sandboxes start from; the sandbox continues.
pub async fn snapshot(
    State(g): State<Gateway>,
    headers: HeaderMap,
    crate::api::SandboxId(id): crate::api::SandboxId,
    body: Bytes,
) -> Result<Response, ApiError> {
    let team = g.team(&headers)?;
    let req: NewSnapshot = json_body(&headers, &body, false)?;
    let name = req.name.as_deref().map(str::trim).filter(|n| !n.is_empty());
    if let Some(name) = name {
        check_name("name", name).map_err(|m| ApiError::new(StatusCode::BAD_REQUEST, m))?;
    }
    let (doc, image) = g.sandboxes.capture(&team, &id).await?;
    let template = g
        .templates
        .register_snapshot(&team, name, &id, image, (doc.vcpus, doc.memory_bytes >> 20))
        .await
        .map_err(failure)?;
    Ok((StatusCode::CREATED, Json(snapshot_json(&template))).into_response())
}

/// `GET /snapshots?sandboxID&name`: the team's snapshots.
pub async fn list_snapshots(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    let source = query.get("sandboxID");
    let name = query.get("name").map(|n| common::template::split_name(n).0.to_string());
    let snapshots: Vec<Value> = g
        .templates
        .list(&team)
        .await
        .map_err(failure)?
        .iter()
        .filter(|t| t.team_id == team && t.snapshot_of.is_some())
        .filter(|t| source.is_none_or(|s| t.snapshot_of.as_ref() == Some(s)))
        .filter(|t| name.as_ref().is_none_or(|n| *n == t.template_id || t.names.contains(n)))
        .map(snapshot_json)
        .collect();
    Ok(Json(Value::Array(snapshots)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_filter_by_severity() {
        let e = |level: &str| BuildLogEntry {
            level: level.into(),
            ..BuildLogEntry::default()
        };
        assert!(at_least(&e("error"), "warn"));
        assert!(!at_least(&e("info"), "warn"));
        assert!(at_least(&e("debug"), ""));
        assert!(check_template_id("templateID", "t123").is_ok());
        assert!(check_template_id("templateID", "a b").is_err());
        assert!(check_template_id("templateID", "").is_err());
    }
}
