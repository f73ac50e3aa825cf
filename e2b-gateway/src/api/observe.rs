//! What a sandbox's node says of it: metrics samples (one sandbox's or every sandbox's
//! latest) and logs (v1 lines as E2B's JSON objects, v2 entries with level, direction and
//! search); a node that does not answer gives none, never an error.

use super::*;

pub(super) fn metric(sample: &proto::node::v1::MetricsSample) -> Value {
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
pub(super) fn window(query: &HashMap<String, String>) -> Result<(u64, u64), ApiError> {
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
pub(super) async fn samples(
    g: &Gateway,
    doc: &SandboxDoc,
    start: u64,
    end: u64,
) -> Vec<proto::node::v1::MetricsSample> {
    or_empty(g.sandboxes.metrics(doc, start, end).await, doc, "metrics")
}

/// What a node answered, or nothing (logged) when it did not: a read of metrics or logs never
/// fails because a node is away.
pub(super) fn or_empty<T>(answer: Result<Vec<T>, crate::sandboxes::Failure>, doc: &SandboxDoc, what: &str) -> Vec<T> {
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
pub(super) async fn log_entries(
    g: &Gateway,
    doc: &SandboxDoc,
    query: proto::node::v1::LogsRequest,
) -> Vec<proto::node::v1::LogEntry> {
    or_empty(g.sandboxes.logs(doc, query).await, doc, "logs")
}

pub(super) fn entry_json(e: &proto::node::v1::LogEntry) -> Value {
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
pub(super) fn line_json(e: &proto::node::v1::LogEntry) -> String {
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

pub(super) fn log_limit(query: &HashMap<String, String>) -> Result<u32, ApiError> {
    match query.get("limit") {
        None => Ok(1000),
        Some(v) => v
            .parse::<u32>()
            .ok()
            .filter(|n| *n <= 1000)
            .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "limit must be 0 to 1000")),
    }
}

pub(super) fn unix_ms(query: &HashMap<String, String>, name: &str) -> Result<u64, ApiError> {
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
