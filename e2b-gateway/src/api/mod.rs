//! The sandbox part of E2B's REST API (paths, JSON names and statuses as `openapi.yml` has
//! them), with every error in E2B's shape, `{"code": <status>, "message": "..."}`.
//!
//! Here: what every handler shares (the `Gateway` state, the caller's team or operator
//! role, JSON bodies, times, the framework's refusals reshaped); the routes are in
//! `sandboxes`, `observe` (metrics and logs) and `nodes`, and the template routes in
//! `templates` (named, not merged: their `list`, `get` and `delete` are templates'), and
//! `pools` the warm pools' routes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use common::docs::{SandboxDoc, SandboxPhase};
use serde::Deserialize;
use serde_json::{json, Value};

pub use crate::error::ApiError;
pub use crate::ids::{check_id, SandboxId, MAX_ID_BYTES};
use crate::intent::{self, NewSandbox, Template};
use crate::sandboxes::{idempotency, Sandboxes};
use crate::templates::code_interpreter;
use common::template::split_name;

mod nodes;
mod observe;
pub mod pools;
mod sandboxes;
pub mod templates;

pub use nodes::*;
pub use observe::*;
pub use sandboxes::*;

/// The envd protocol version this stack speaks (what the SDK gates features on).
pub const ENVD_VERSION: &str = "0.6.3";
/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// Shared by every handler.
#[derive(Clone)]
pub struct Gateway {
    pub sandboxes: Arc<Sandboxes>,
    /// API key → team.
    pub keys: Arc<HashMap<String, String>>,
    /// The template registry.
    pub templates: Arc<crate::templates::Templates>,
    /// Templates' warm pools.
    pub pools: Arc<crate::pools::Pools>,
    /// Runs template builds.
    pub builder: Arc<crate::templates::build::Builder>,
    /// The domain under which sandboxes' ports are reachable (`domain` in answers; empty:
    /// none, answered as null).
    pub domain: Arc<str>,
    /// Where `code-interpreter-v1` stands on this gateway: a create of it waits for a build
    /// in progress, and is told why when none is ready.
    pub code_interpreter: tokio::sync::watch::Receiver<crate::templates::code_interpreter::Availability>,
    /// The operators' token for E2B's admin routes (`X-Admin-Token`); none: they are closed.
    pub admin_token: Option<Arc<str>>,
    /// Every comparison of a presented admin token takes its turn here, a wrong one holding
    /// it (see `common::guesses`): the admin routes are on the port every tenant reaches.
    pub admin_guesses: Arc<common::guesses::GuessGate>,
}

impl Gateway {
    /// Whether the caller is an operator (E2B's `AdminApiKeyAuth`: `X-Admin-Token`). A team's
    /// API key is not enough: nodes and what they run are the cluster's, not a tenant's.
    pub(crate) async fn admin(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        use subtle::ConstantTimeEq;
        let Some(expected) = &self.admin_token else {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "admin routes are closed: this gateway has no admin token configured",
            ));
        };
        let given = headers
            .get("x-admin-token")
            .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "missing X-Admin-Token header"))?;
        let compared = self
            .admin_guesses
            .compare(
                || {
                    if bool::from(given.as_bytes().ct_eq(expected.as_bytes())) {
                        Ok(())
                    } else {
                        Err(())
                    }
                },
                |()| true,
            )
            .await;
        match compared {
            Ok(()) => Ok(()),
            Err(common::guesses::Gated::Busy) => Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too many admin tokens are being tried at once; try again",
            )),
            Err(common::guesses::Gated::Refused(())) => {
                metrics::counter!("gateway_admin_tokens_refused_total").increment(1);
                Err(ApiError::new(StatusCode::UNAUTHORIZED, "Invalid admin token"))
            }
        }
    }

    pub(crate) fn team(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        let key = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "missing X-API-Key header"))?;
        self.keys
            .get(key)
            .cloned()
            .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "Invalid API key"))
    }
}

pub(crate) fn json_body<T: for<'de> Deserialize<'de>>(
    headers: &HeaderMap,
    body: &Bytes,
    required: bool,
) -> Result<T, ApiError> {
    if body.len() > MAX_BODY_BYTES {
        return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "request body too large"));
    }
    let json = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase())
        .is_some_and(|v| v == "application/json" || (v.starts_with("application/") && v.ends_with("+json")));
    if !body.is_empty() && !json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the request body must be JSON (Content-Type: application/json)",
        ));
    }
    if body.is_empty() && !required {
        return serde_json::from_str("{}").map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("invalid request body: {e}")))
}

pub(crate) fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms)).to_string()
}

/// E2B's `diskSizeMB` of a disk of `bytes` (0, a manifest from before disks: the default).
pub(crate) fn disk_mb(bytes: u64) -> u64 {
    if bytes == 0 {
        common::resources::DEFAULT_DISK_BYTES >> 20
    } else {
        bytes >> 20
    }
}

/// Rewrites the framework's own refusals (body too large, unreadable body, bad path) into
/// E2B's error shape, so no answer of this API is ever plain text.
pub async fn e2b_shaped(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let text = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let message = if text.trim().is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    ApiError::new(status, message).into_response()
}

pub async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// What this gateway serves of E2B's API, as OpenAPI 3 (what schemathesis tests it against).
pub const OPENAPI: &str = include_str!("../../openapi.yaml");

/// `GET /openapi.yaml`: [`OPENAPI`].
pub async fn openapi() -> Response {
    ([(axum::http::header::CONTENT_TYPE, "application/yaml")], OPENAPI).into_response()
}

/// The most forks one request may ask for.
pub const MAX_FORKS: u32 = 100;
pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such route")
}

/// E2B routes this cluster does not serve yet, each with what it is: a client is told so
/// (501 in E2B's shape) rather than getting a 404 its SDK reports as "sandbox not found".
pub const UNSUPPORTED: [(&str, &str); 4] = [
    ("/volumes", "volumes"),
    ("/volumes/{id}", "volumes"),
    ("/secrets", "secrets"),
    ("/secrets/{id}", "secrets"),
];

/// The answer for one of [`UNSUPPORTED`].
pub fn unsupported(what: &'static str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        format!("{what} is not supported by this cluster yet"),
    )
}
