//! Warm pools over REST. E2B's API has none, so these routes are this cluster's own, beside
//! E2B's template routes:
//!
//! - `GET /templates/{templateID}/pool`: the pool of a template the caller may use:
//!   `{"templateID", "size", "ready", "setBy", "updatedAt"}`.
//! - `PUT /templates/{templateID}/pool` with `{"size": N}`: sets it (0 empties it). An
//!   operator (`X-Admin-Token`) may set any template's; a team (`X-API-Key`) its own
//!   templates' only, never a public built-in's nor a size an operator set, and at most
//!   `MAX_TEAM_POOL_SLOTS` pooled sandboxes across its templates.
//! - `GET /pools`: every pool, for operators.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{json_body, rfc3339, ApiError, Gateway};
use crate::pools::{Asker, PoolView};

/// `PUT /templates/{templateID}/pool`'s body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetPool {
    size: u32,
}

fn pool_json(view: &PoolView) -> Value {
    json!({
        "templateID": view.template_id,
        "size": view.size,
        "ready": view.ready,
        "setBy": (!view.set_by.is_empty()).then_some(&view.set_by),
        "updatedAt": (view.updated_at_unix_ms > 0).then(|| rfc3339(view.updated_at_unix_ms)),
    })
}

/// The operator when `X-Admin-Token` is given (and right), else the team of `X-API-Key`.
async fn asker(g: &Gateway, headers: &HeaderMap) -> Result<Asker, ApiError> {
    if headers.contains_key("x-admin-token") {
        g.admin(headers).await?;
        return Ok(Asker::Operator);
    }
    g.team(headers).map(Asker::Team)
}

/// The template `id` names (an ID or a name), as `asker` sees it: an operator sees every one.
async fn template(g: &Gateway, asker: &Asker, id: &str) -> Result<common::template::TemplateDoc, ApiError> {
    crate::ids::check_template_id("templateID", id)?;
    let team = match asker {
        Asker::Operator => None,
        Asker::Team(team) => Some(team.as_str()),
    };
    let found = match team {
        Some(team) => g.templates.find(team, id).await?,
        None => g.templates.find_any(id).await?,
    };
    found
        .map(|d| d.value)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("template {id} not found")))
}

pub async fn get(State(g): State<Gateway>, headers: HeaderMap, Path(id): Path<String>) -> Result<Response, ApiError> {
    let asker = asker(&g, &headers).await?;
    let template = template(&g, &asker, &id).await?;
    let mut view = g.pools.get(&template).await?;
    // Who set it names a team: another team using a public template is not told which.
    if matches!(&asker, Asker::Team(team) if *team != template.team_id) && view.set_by != common::pool::OPERATOR {
        view.set_by.clear();
    }
    Ok(Json(pool_json(&view)).into_response())
}

pub async fn set(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let asker = asker(&g, &headers).await?;
    let req: SetPool = json_body(&headers, &body, true)?;
    let template = template(&g, &asker, &id).await?;
    let view = g.pools.set(&asker, &template, req.size).await?;
    Ok(Json(pool_json(&view)).into_response())
}

pub async fn list(State(g): State<Gateway>, headers: HeaderMap) -> Result<Response, ApiError> {
    g.admin(&headers).await?;
    let pools = g.pools.list().await?;
    Ok(Json(pools.iter().map(pool_json).collect::<Vec<_>>()).into_response())
}
