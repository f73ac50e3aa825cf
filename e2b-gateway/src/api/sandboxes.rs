//! The sandbox routes: create (and fork), get, list, kill, pause, resume and connect,
//! timeouts and refreshes, network policy; a sandbox's JSON as E2B's SDKs read it.

use super::*;

pub(super) fn domain_json(domain: &str) -> Value {
    if domain.is_empty() {
        Value::Null
    } else {
        json!(domain)
    }
}

/// `v` with the sandbox's tokens (`envdAccessToken`, and `trafficAccessToken` when its ports
/// are private), derived from its manifest's seals.
pub(super) fn with_tokens(mut v: Value, d: &SandboxDoc, tokens: &crate::tokens::Tokens) -> Value {
    if let Some(token) = tokens.envd(d) {
        v["envdAccessToken"] = json!(token);
    }
    if let Some(token) = tokens.traffic(d) {
        v["trafficAccessToken"] = json!(token);
    }
    v
}

pub(super) fn sandbox_json(d: &SandboxDoc, domain: &str, tokens: &crate::tokens::Tokens) -> Value {
    let v = json!({
        "domain": domain_json(domain),
        "templateID": d.template,
        "sandboxID": d.sandbox_id,
        "clientID": d.node_id,
        "envdVersion": ENVD_VERSION,
    });
    with_tokens(v, d, tokens)
}

pub(super) fn state_name(phase: SandboxPhase) -> &'static str {
    match phase {
        SandboxPhase::Running | SandboxPhase::Creating => "running",
        SandboxPhase::Paused | SandboxPhase::Hibernated => "paused",
    }
}

pub(super) fn detail_json(d: &SandboxDoc, domain: &str, tokens: &crate::tokens::Tokens) -> Value {
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
pub(super) async fn resolve_template(g: &Gateway, team: &str, reference: &str) -> Result<Option<Template>, ApiError> {
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
pub(super) async fn awaited_code_interpreter(
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
pub(super) struct Fork {
    timeout: Option<i64>,
    count: Option<u32>,
}

/// A fork's timeout when the request gives none (E2B's default).
pub(super) const FORK_TIMEOUT_SECS: i64 = 15;

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
pub(super) struct TimeoutBody {
    timeout: Option<i64>,
    /// `ConnectSandboxV2.memory`: false is the SDK's `on_resume="reboot"`.
    memory: Option<bool>,
}

/// The caller's team and the timeout its body asks for (E2B's default when absent).
pub(super) fn team_and_timeout(
    g: &Gateway,
    headers: &HeaderMap,
    body: &Bytes,
    required: bool,
) -> Result<(String, u64), ApiError> {
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
pub(super) struct RefreshBody {
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
pub(super) fn metadata_filter(raw: Option<&String>) -> Result<BTreeMap<String, String>, ApiError> {
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
