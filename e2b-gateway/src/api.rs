//! The sandbox part of E2B's REST API (paths, JSON names and statuses as `openapi.yml` has
//! them), with every error in E2B's shape, `{"code": <status>, "message": "..."}`.

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
}

impl Gateway {
    /// Whether the caller is an operator (E2B's `AdminApiKeyAuth`: `X-Admin-Token`). A team's
    /// API key is not enough: nodes and what they run are the cluster's, not a tenant's.
    pub(crate) fn admin(&self, headers: &HeaderMap) -> Result<(), ApiError> {
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
        if bool::from(given.as_bytes().ct_eq(expected.as_bytes())) {
            Ok(())
        } else {
            Err(ApiError::new(StatusCode::UNAUTHORIZED, "Invalid admin token"))
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

fn domain_json(domain: &str) -> Value {
    if domain.is_empty() {
        Value::Null
    } else {
        json!(domain)
    }
}

/// `v` with the sandbox's tokens (`envdAccessToken`, and `trafficAccessToken` when its ports
/// are private), derived from its manifest's seals.
fn with_tokens(mut v: Value, d: &SandboxDoc, tokens: &crate::tokens::Tokens) -> Value {
    if let Some(token) = tokens.envd(d) {
        v["envdAccessToken"] = json!(token);
    }
    if let Some(token) = tokens.traffic(d) {
        v["trafficAccessToken"] = json!(token);
    }
    v
}

fn sandbox_json(d: &SandboxDoc, domain: &str, tokens: &crate::tokens::Tokens) -> Value {
    let v = json!({
        "domain": domain_json(domain),
        "templateID": d.template,
        "sandboxID": d.sandbox_id,
        "clientID": d.node_id,
        "envdVersion": ENVD_VERSION,
    });
    with_tokens(v, d, tokens)
}

fn state_name(phase: SandboxPhase) -> &'static str {
    match phase {
        SandboxPhase::Running | SandboxPhase::Creating => "running",
        SandboxPhase::Paused | SandboxPhase::Hibernated => "paused",
    }
}

/// E2B's `diskSizeMB` of a disk of `bytes` (0, a manifest from before disks: the default).
pub(crate) fn disk_mb(bytes: u64) -> u64 {
    if bytes == 0 {
        common::resources::DEFAULT_DISK_BYTES >> 20
    } else {
        bytes >> 20
    }
}

fn detail_json(d: &SandboxDoc, domain: &str, tokens: &crate::tokens::Tokens) -> Value {
    let mut v = json!({
        "domain": domain_json(domain),
        "templateID": d.template,
        "sandboxID": d.sandbox_id,
        "clientID": d.node_id,
        "startedAt": rfc3339(d.started_at_unix_ms),
        "endAt": rfc3339(d.end_at_unix_ms),
        "cpuCount": d.vcpus,
        "memoryMB": d.memory_bytes / (1024 * 1024),
        "diskSizeMB": disk_mb(d.disk_bytes),
        "metadata": d.metadata,
        "state": state_name(d.phase),
        "envdVersion": ENVD_VERSION,
        "lifecycle": {
            "autoResume": d.auto_resume,
            "onTimeout": if d.auto_pause { "pause" } else { "kill" },
        },
    });
    if let Some(network) = &d.network {
        v["allowInternetAccess"] = json!(network.internet);
        v["network"] = json!({
            "allowOut": network.allow_out.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "denyOut": network.deny_out.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "allowPublicTraffic": d.traffic_access_token.is_none(),
        });
    }
    with_tokens(v, d, tokens)
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
pub const OPENAPI: &str = include_str!("../openapi.yaml");

/// `GET /openapi.yaml`: [`OPENAPI`].
pub async fn openapi() -> Response {
    ([(axum::http::header::CONTENT_TYPE, "application/yaml")], OPENAPI).into_response()
}

pub async fn create(State(g): State<Gateway>, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let team = g.team(&headers)?;
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(value) => {
            let key = value.to_str().unwrap_or("");
            idempotency::check_key(key).map_err(|m| ApiError::new(StatusCode::BAD_REQUEST, m))?;
            Some(key.to_string())
        }
    };
    let req: NewSandbox = json_body(&headers, &body, true)?;
    let template = resolve_template(&g, &team, &req.template_id).await?;
    let intent = intent::normalise(req, template.as_ref())?;
    let doc = match key {
        Some(key) => {
            g.sandboxes
                .create_once(&team, &key, idempotency::request_sha256(&body), intent)
                .await?
        }
        None => g.sandboxes.create(&team, intent).await?,
    };
    Ok((
        StatusCode::CREATED,
        Json(sandbox_json(&doc, &g.domain, &g.sandboxes.tokens)),
    )
        .into_response())
}

/// The create's template as the registry resolves `name:tag` for `team`: its ID, the
/// resources it fixes and its image. `None` when there is no such ready template.
async fn resolve_template(g: &Gateway, team: &str, reference: &str) -> Result<Option<Template>, ApiError> {
    let reference = reference.trim();
    if reference.is_empty() {
        return Ok(None);
    }
    crate::ids::check_template_id("templateID", reference)?;
    let mut resolved = g.templates.resolve(team, reference).await?;
    if resolved.is_none() && split_name(reference).0 == code_interpreter::NAME {
        resolved = awaited_code_interpreter(g, team, reference).await?;
    }
    Ok(resolved.map(|r| Template {
        name: r.template.template_id,
        vcpus: Some(r.template.vcpus).filter(|v| *v > 0),
        memory_mb: Some(r.template.memory_mb).filter(|m| *m > 0),
        image: r.image,
    }))
}

/// A create of `code-interpreter-v1` before it is ready: waits for this gateway's build in
/// progress (up to [`code_interpreter::CREATE_WAITS_AT_MOST`]), then resolves it again;
/// still missing, the caller is told why (503 with `Retry-After` while it builds).
async fn awaited_code_interpreter(
    g: &Gateway,
    team: &str,
    reference: &str,
) -> Result<Option<crate::templates::Resolved>, ApiError> {
    use code_interpreter::Availability;
    let mut watch = g.code_interpreter.clone();
    let settled = |a: &Availability| !matches!(a, Availability::Building { .. } | Availability::Waiting(_));
    if !settled(&watch.borrow()) {
        let _ = tokio::time::timeout(code_interpreter::CREATE_WAITS_AT_MOST, watch.wait_for(settled)).await;
    }
    if let Some(resolved) = g.templates.resolve(team, reference).await? {
        return Ok(Some(resolved));
    }
    let state = g.code_interpreter.borrow().clone();
    match (state.explain(), &state) {
        (Some(why), Availability::Building { .. }) => Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why)),
        (Some(why), _) => Err(ApiError::new(StatusCode::NOT_FOUND, why)),
        (None, _) => Ok(None),
    }
}

/// `SandboxForkRequest`.
#[derive(Debug, Default, Deserialize)]
struct Fork {
    timeout: Option<i64>,
    count: Option<u32>,
}

/// The most forks one request may ask for.
pub const MAX_FORKS: u32 = 100;
/// A fork's timeout when the request gives none (E2B's default).
const FORK_TIMEOUT_SECS: i64 = 15;

/// `POST /sandboxes/{id}/fork`: captures the sandbox once (it continues, ID and timeout
/// unchanged) and creates `count` sandboxes from that capture, each as the original was made
/// (resources, env vars, metadata, network, lifecycle) with the fork's timeout. Each fork
/// succeeds or fails on its own; the answer has one entry per fork.
pub async fn fork(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
    body: Bytes,
) -> Result<Response, ApiError> {
    let team = g.team(&headers)?;
    let req: Fork = json_body(&headers, &body, false)?;
    let count = req.count.unwrap_or(1);
    if !(1..=MAX_FORKS).contains(&count) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("count must be 1 to {MAX_FORKS}"),
        ));
    }
    let timeout_secs = intent::timeout(Some(req.timeout.unwrap_or(FORK_TIMEOUT_SECS)))?;
    let (source, mut image) = g.sandboxes.capture(&team, &id).await?;
    image.build_id = format!("fork-{id}");
    let intent = intent::CreateIntent {
        template: source.template.clone(),
        image,
        vcpus: source.vcpus,
        memory_bytes: source.memory_bytes,
        memory_source: source.memory_source,
        timeout_secs,
        auto_pause: source.auto_pause,
        auto_pause_memory: source.auto_pause_memory,
        auto_resume: source.auto_resume,
        env_vars: g.sandboxes.sealed_env(&source)?,
        metadata: source.metadata.clone(),
        // A manifest from before egress existed had loopback only; so does its fork.
        network: source.network.clone().unwrap_or(common::egress::NetworkPolicy {
            internet: false,
            allow_out: Vec::new(),
            deny_out: Vec::new(),
        }),
        public_traffic: source.traffic_access_token.is_none(),
    };
    let forks = futures::future::join_all((0..count).map(|_| g.sandboxes.create(&team, intent.clone()))).await;
    let results: Vec<Value> = forks
        .into_iter()
        .map(|made| match made {
            Ok(doc) => json!({"sandbox": sandbox_json(&doc, &g.domain, &g.sandboxes.tokens)}),
            Err(err) => {
                let e = ApiError::from(err);
                json!({"error": {"code": e.status.as_u16(), "message": e.message}})
            }
        })
        .collect();
    Ok((StatusCode::CREATED, Json(Value::Array(results))).into_response())
}

/// `PUT /sandboxes/{id}/network`: replaces the sandbox's egress rules.
pub async fn update_network(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let team = g.team(&headers)?;
    let update: intent::NetworkUpdate = json_body(&headers, &body, true)?;
    let policy = intent::network_update(update)?;
    g.sandboxes.update_network(&team, &id, policy).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn get(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    let doc = g.sandboxes.get(&team, &id).await?;
    Ok(Json(detail_json(&doc.value, &g.domain, &g.sandboxes.tokens)))
}

pub async fn kill(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
) -> Result<StatusCode, ApiError> {
    let team = g.team(&headers)?;
    g.sandboxes.kill(&team, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn pause(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let team = g.team(&headers)?;
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct PauseBody {
        memory: Option<bool>,
    }
    let req: PauseBody = json_body(&headers, &body, false)?;
    g.sandboxes.pause(&team, &id, req.memory.unwrap_or(true)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct TimeoutBody {
    timeout: Option<i64>,
    /// `ConnectSandboxV2.memory`: false is the SDK's `on_resume="reboot"`.
    memory: Option<bool>,
}

/// The caller's team and the timeout its body asks for (E2B's default when absent).
fn team_and_timeout(g: &Gateway, headers: &HeaderMap, body: &Bytes, required: bool) -> Result<(String, u64), ApiError> {
    let team = g.team(headers)?;
    let req: TimeoutBody = json_body(headers, body, required)?;
    Ok((team, intent::timeout(req.timeout)?))
}

pub async fn resume(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (team, secs) = team_and_timeout(&g, &headers, &body, false)?;
    let (doc, resumed) = g.sandboxes.resume(&team, &id, secs).await?;
    if !resumed {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already running"),
        ));
    }
    Ok((
        StatusCode::CREATED,
        Json(sandbox_json(&doc, &g.domain, &g.sandboxes.tokens)),
    )
        .into_response())
}

pub async fn connect(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
    body: Bytes,
) -> Result<Response, ApiError> {
    let team = g.team(&headers)?;
    let req: TimeoutBody = json_body(&headers, &body, true)?;
    let secs = intent::timeout(req.timeout)?;
    let reboot = req.memory == Some(false);
    let (doc, resumed) = g.sandboxes.resume_as(&team, &id, secs, reboot).await?;
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(sandbox_json(&doc, &g.domain, &g.sandboxes.tokens))).into_response())
}

pub async fn set_timeout(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let team = g.team(&headers)?;
    let req: TimeoutBody = json_body(&headers, &body, true)?;
    if req.timeout.is_none() {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "timeout is required"));
    }
    let secs = intent::timeout(req.timeout)?;
    g.sandboxes.set_timeout(&team, &id, secs).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RefreshBody {
    duration: Option<i64>,
}

pub async fn refresh(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let team = g.team(&headers)?;
    let req: RefreshBody = json_body(&headers, &body, false)?;
    let secs = intent::timeout(req.duration)?;
    g.sandboxes.set_timeout(&team, &id, secs).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `metadata=k1%3Dv1%26k2%3Dv2` as E2B's list filters encode it.
fn metadata_filter(raw: Option<&String>) -> Result<BTreeMap<String, String>, ApiError> {
    let Some(raw) = raw.filter(|r| !r.is_empty()) else {
        return Ok(BTreeMap::new());
    };
    raw.split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, format!("invalid metadata filter {pair:?}")))?;
            // Form encoding: `+` is a space, `%XX` a byte; the bytes must be UTF-8.
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(&s.replace('+', " "))
                    .decode_utf8()
                    .map(|d| d.into_owned())
                    .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "invalid metadata encoding"))
            };
            Ok((decode(k)?, decode(v)?))
        })
        .collect()
}

/// `GET /sandboxes` and `GET /v2/sandboxes`: the team's sandboxes, filtered by metadata and
/// state, a page at a time (`limit`, `nextToken`; the next token in `X-Next-Token`).
pub async fn list(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Query(query): Query<Vec<(String, String)>>,
) -> Result<Response, ApiError> {
    let team = g.team(&headers)?;
    let one = |name: &str| query.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let wanted = metadata_filter(one("metadata").as_ref())?;
    let states: Vec<String> = query
        .iter()
        .filter(|(k, _)| k == "state")
        .flat_map(|(_, v)| v.split(',').map(str::to_string).collect::<Vec<_>>())
        .collect();
    for s in &states {
        if s != "running" && s != "paused" {
            return Err(ApiError::new(StatusCode::BAD_REQUEST, format!("invalid state {s:?}")));
        }
    }
    let limit = match one("limit") {
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=1000).contains(l))
            .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "limit must be 1 to 1000"))?,
        None => 1000,
    };
    // Newest first unless `order=asc`; pages continue after the token's (start time, ID).
    let ascending = match one("order").as_deref() {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(other) => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("order must be asc or desc (got {other:?})"),
            ))
        }
    };
    let started_after = match one("startedAfter") {
        None => 0,
        Some(t) => humantime::parse_rfc3339_weak(t.trim_end_matches('Z'))
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as u64)
            .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "startedAfter must be an RFC 3339 time"))?,
    };
    let template = one("template");
    let token = match one("nextToken") {
        None => None,
        Some(t) => Some(
            t.split_once('_')
                .and_then(|(ms, id)| Some((ms.parse::<u64>().ok()?, id.to_string())))
                .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "nextToken is not one this API gave"))?,
        ),
    };
    let key = |d: &SandboxDoc| (d.started_at_unix_ms, d.sandbox_id.clone());
    let mut docs: Vec<SandboxDoc> = g
        .sandboxes
        .all()
        .await?
        .into_iter()
        .map(|d| d.value)
        .filter(|d| d.team_id == team && d.phase != SandboxPhase::Creating)
        .filter(|d| wanted.iter().all(|(k, v)| d.metadata.get(k) == Some(v)))
        .filter(|d| states.is_empty() || states.iter().any(|s| s == state_name(d.phase)))
        .filter(|d| {
            template
                .as_deref()
                .is_none_or(|t| t.split(':').next() == Some(d.template.as_str()))
        })
        .filter(|d| d.started_at_unix_ms >= started_after)
        .filter(|d| match &token {
            None => true,
            Some(after) if ascending => key(d) > *after,
            Some(after) => key(d) < *after,
        })
        .collect();
    docs.sort_by_key(key);
    if !ascending {
        docs.reverse();
    }
    let next = (docs.len() > limit).then(|| {
        let last = &docs[limit - 1];
        format!("{}_{}", last.started_at_unix_ms, last.sandbox_id)
    });
    docs.truncate(limit);
    let body: Vec<Value> = docs
        .iter()
        .map(|d| detail_json(d, &g.domain, &g.sandboxes.tokens))
        .collect();
    let mut response = Json(body).into_response();
    if let Some(next) = next {
        if let Ok(v) = HeaderValue::from_str(&next) {
            response.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(response)
}

fn metric(sample: &proto::node::v1::MetricsSample) -> Value {
    json!({
        "timestamp": rfc3339(sample.at_unix_ms),
        "timestampUnix": sample.at_unix_ms / 1000,
        "cpuCount": sample.vcpus,
        "cpuUsedPct": (sample.cpu_used_pct * 100.0).round() / 100.0,
        "memUsed": sample.memory_used_bytes,
        "memTotal": sample.memory_total_bytes,
        "memCache": 0,
        "diskUsed": sample.disk_used_bytes,
        "diskTotal": sample.disk_total_bytes,
    })
}

/// `start`/`end` of a metrics request (unix seconds) as a window in unix ms; absent: all.
fn window(query: &HashMap<String, String>) -> Result<(u64, u64), ApiError> {
    let seconds = |name: &str| -> Result<Option<u64>, ApiError> {
        query
            .get(name)
            .map(|v| {
                v.parse::<u64>()
                    .ok()
                    .and_then(|s| s.checked_mul(1000))
                    .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, format!("{name} must be unix seconds")))
            })
            .transpose()
    };
    let (start, end) = (seconds("start")?.unwrap_or(0), seconds("end")?.unwrap_or(u64::MAX));
    if start > end {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "start is after end"));
    }
    Ok((start, end))
}

/// A sandbox's metrics samples: its node's series within the window; a sandbox on no node
/// (hibernated), or a node that does not answer, gives an empty series, never an error.
async fn samples(g: &Gateway, doc: &SandboxDoc, start: u64, end: u64) -> Vec<proto::node::v1::MetricsSample> {
    or_empty(g.sandboxes.metrics(doc, start, end).await, doc, "metrics")
}

/// What a node answered, or nothing (logged) when it did not: a read of metrics or logs never
/// fails because a node is away.
fn or_empty<T>(answer: Result<Vec<T>, crate::sandboxes::Failure>, doc: &SandboxDoc, what: &str) -> Vec<T> {
    answer.unwrap_or_else(|err| {
        tracing::warn!(sandbox_id = %doc.sandbox_id, %err, "no {what} from the node");
        Vec::new()
    })
}

pub async fn metrics(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    let (start, end) = window(&query)?;
    let doc = g.sandboxes.get(&team, &id).await?;
    let series = samples(&g, &doc.value, start, end).await;
    Ok(Json(Value::Array(series.iter().map(metric).collect())))
}

pub async fn list_metrics(
    State(g): State<Gateway>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    let ids: Vec<&str> = query
        .get("sandbox_ids")
        .map(|s| s.split(',').filter(|s| !s.is_empty()).collect())
        .unwrap_or_default();
    let mut out = serde_json::Map::new();
    for id in ids {
        check_id(id)?;
        let doc = g.sandboxes.get(&team, id).await?;
        // The latest sample of each.
        if let Some(last) = samples(&g, &doc.value, 0, u64::MAX).await.last() {
            out.insert(id.to_string(), metric(last));
        }
    }
    Ok(Json(json!({"sandboxes": out})))
}

/// A sandbox's log entries: its node's, for the query; a sandbox on no node (hibernated) or
/// a node that does not answer gives none, never an error.
async fn log_entries(
    g: &Gateway,
    doc: &SandboxDoc,
    query: proto::node::v1::LogsRequest,
) -> Vec<proto::node::v1::LogEntry> {
    or_empty(g.sandboxes.logs(doc, query).await, doc, "logs")
}

fn entry_json(e: &proto::node::v1::LogEntry) -> Value {
    json!({
        "timestamp": rfc3339(e.at_unix_ms),
        "level": e.level,
        "message": e.message,
        "fields": e.fields,
    })
}

/// A v1 log `line`: the entry as one JSON object, as E2B's lines are (its CLI parses each
/// line and filters on `level` and on `logger` by service name). Our sources take E2B's
/// service names: the start command's output is `process`; envd's and the node's own events
/// are `system`.
fn line_json(e: &proto::node::v1::LogEntry) -> String {
    let mut line = serde_json::Map::new();
    for (key, value) in &e.fields {
        line.insert(key.clone(), Value::String(value.clone()));
    }
    let logger = match e.fields.get("logger").map(String::as_str) {
        Some("start") => "process",
        _ => "system",
    };
    line.insert("logger".into(), Value::String(logger.into()));
    line.insert("level".into(), Value::String(e.level.clone()));
    line.insert("message".into(), Value::String(e.message.clone()));
    Value::Object(line).to_string()
}

/// Log levels, least severe first.
pub(crate) const LEVELS: [&str; 4] = ["debug", "info", "warn", "error"];

/// A log query's `level` (the least severe wanted; empty: all).
pub(crate) fn level_of(query: &HashMap<String, String>) -> Result<String, ApiError> {
    match query.get("level").map(String::as_str) {
        None => Ok(String::new()),
        Some(l) if LEVELS.contains(&l) => Ok(l.to_string()),
        Some(_) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "level must be debug, info, warn or error",
        )),
    }
}

/// Whether a log query's `direction` is `backward` (default `forward`).
pub(crate) fn backward_of(query: &HashMap<String, String>) -> Result<bool, ApiError> {
    match query.get("direction").map(String::as_str) {
        None | Some("forward") => Ok(false),
        Some("backward") => Ok(true),
        Some(_) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "direction must be forward or backward",
        )),
    }
}

fn log_limit(query: &HashMap<String, String>) -> Result<u32, ApiError> {
    match query.get("limit") {
        None => Ok(1000),
        Some(v) => v
            .parse::<u32>()
            .ok()
            .filter(|n| *n <= 1000)
            .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "limit must be 0 to 1000")),
    }
}

fn unix_ms(query: &HashMap<String, String>, name: &str) -> Result<u64, ApiError> {
    query.get(name).map_or(Ok(0), |v| {
        v.parse::<u64>()
            .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, format!("{name} must be unix milliseconds")))
    })
}

/// `GET /sandboxes/{id}/logs` (v1): entries from `start` (unix ms), as lines and structured.
pub async fn logs(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    let request = proto::node::v1::LogsRequest {
        sandbox_id: id.clone(),
        cursor_unix_ms: unix_ms(&query, "start")?,
        limit: log_limit(&query)?,
        ..Default::default()
    };
    let doc = g.sandboxes.get(&team, &id).await?;
    let entries = log_entries(&g, &doc.value, request).await;
    let lines: Vec<Value> = entries
        .iter()
        .map(|e| json!({"timestamp": rfc3339(e.at_unix_ms), "line": line_json(e)}))
        .collect();
    Ok(Json(
        json!({"logs": lines, "logEntries": entries.iter().map(entry_json).collect::<Vec<_>>()}),
    ))
}

/// `GET /v2/sandboxes/{id}/logs`: entries from `cursor` (unix ms) in `direction`, at least
/// `level`, containing `search`.
pub async fn logs_v2(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let team = g.team(&headers)?;
    let backward = backward_of(&query)?;
    let level = level_of(&query)?;
    let request = proto::node::v1::LogsRequest {
        sandbox_id: id.clone(),
        cursor_unix_ms: unix_ms(&query, "cursor")?,
        limit: log_limit(&query)?,
        backward,
        level,
        search: query.get("search").cloned().unwrap_or_default(),
    };
    let doc = g.sandboxes.get(&team, &id).await?;
    let entries = log_entries(&g, &doc.value, request).await;
    Ok(Json(
        json!({"logs": entries.iter().map(entry_json).collect::<Vec<_>>()}),
    ))
}

fn node_json(n: &proto::placement::v1::NodeView) -> Value {
    let state = match proto::placement::v1::NodeState::try_from(n.state) {
        Ok(proto::placement::v1::NodeState::Ready) => "ready",
        Ok(proto::placement::v1::NodeState::Draining) => "draining",
        _ => "unhealthy",
    };
    let cap = n.capacity.unwrap_or_default();
    let believed = n.believed.unwrap_or_default();
    json!({
        "nodeID": n.node_id,
        "status": state,
        "sandboxCount": n.reported_sandboxes,
        "cpuCount": cap.vcpus,
        "memoryMB": cap.memory_bytes / (1024 * 1024),
        "allocatedCPU": believed.vcpus,
        "allocatedMemoryMiB": believed.memory_bytes / (1024 * 1024),
        "memoryUsedMiB": n.memory_used_bytes / (1024 * 1024),
        "pending": n.pending,
        "unconfirmed": n.unconfirmed,
        "heartbeatAgeMs": n.heartbeat_age_ms,
    })
}

pub async fn nodes(State(g): State<Gateway>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    g.admin(&headers)?;
    let nodes = g.sandboxes.nodes().await?;
    Ok(Json(Value::Array(nodes.iter().map(node_json).collect())))
}

pub async fn node(
    State(g): State<Gateway>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
) -> Result<Json<Value>, ApiError> {
    g.admin(&headers)?;
    let nodes = g.sandboxes.nodes().await?;
    let node = nodes
        .iter()
        .find(|n| n.node_id == id)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("node {id} not found")))?;
    Ok(Json(node_json(node)))
}

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
