//! The console's HTTP surface: pages, their JSON, the live event stream and the operator's
//! actions, all under `/console`.
//!
//! Every route but the login form and the static assets asks [`Sessions::check`] first.
//! Errors are mapped in one place ([`ConsoleError`]): JSON `{code, message}` for the API,
//! a redirect to the login form for a page. Actions (drain, pause) are POSTs with a JSON
//! body from the console's own origin: with the `SameSite=Strict` cookie that makes a
//! forged cross-site request fail twice over.
//!
//! Every answer carries a content security policy that lets a page load only the console's
//! own script and style and connect only back to the console, so data drawn from the
//! cluster (sandbox metadata, build logs) can never run as script even if a page drew it
//! carelessly; the script draws everything with `textContent` anyway.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use tokio_stream::wrappers::BroadcastStream;

use crate::control::{Control, ControlError};
use crate::feed::Shared;
use crate::session::{self, Caller, Refusal, Sessions};
use crate::view::Query as SandboxQuery;

/// Shared by every handler.
#[derive(Clone)]
pub struct Console {
    pub shared: Shared,
    /// For what the view does not keep: a manifest's versions from the change log.
    pub ledger: ledger_client::LedgerClient,
    pub sessions: Arc<Sessions>,
    pub control: Control,
    /// The `Host` values browsers may use to reach the console (`host:port`): a request
    /// naming another is refused, so a page whose DNS name was rebound to this address
    /// reaches nothing.
    pub hosts: Arc<Vec<String>>,
    /// Cookies carry `Secure` (browsers reach the console over TLS, through a proxy).
    pub secure_cookie: bool,
    /// Event streams open now.
    pub streams: Arc<std::sync::atomic::AtomicUsize>,
}

/// Event streams open at once, from every browser together.
pub const MAX_STREAMS: usize = 256;
/// How often an open event stream checks that its session is still open.
pub const STREAM_RECHECK: Duration = Duration::from_secs(10);
/// The events a page may ask for.
const TOPICS: [&str; 7] = ["node", "spread", "sandbox", "template", "build", "balance", "plan"];

impl Console {
    /// The caller, if an operator; a presented token is compared in its turn (see
    /// [`Sessions::check_in_turn`]).
    async fn operator(&self, headers: &HeaderMap) -> Result<Caller, ConsoleError> {
        Ok(self.sessions.check_in_turn(headers).await?)
    }

    fn host_allowed(&self, host: &str) -> bool {
        self.hosts.iter().any(|h| h.eq_ignore_ascii_case(host))
    }
}

/// Every way a console request fails, mapped to a status once.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error(transparent)]
    Peer(#[from] ControlError),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("this console is not served under that name ({0}); it answers only its own")]
    WrongHost(String),
    #[error("too many event streams are open; close some pages")]
    TooManyStreams,
}

impl ConsoleError {
    fn status(&self) -> StatusCode {
        match self {
            ConsoleError::Refused(Refusal::Closed) => StatusCode::FORBIDDEN,
            ConsoleError::Refused(Refusal::Busy) => StatusCode::TOO_MANY_REQUESTS,
            ConsoleError::Refused(_) => StatusCode::UNAUTHORIZED,
            ConsoleError::Peer(err) if err.refused() => StatusCode::BAD_REQUEST,
            // The console is up; the peer it needs is not.
            ConsoleError::Peer(_) => StatusCode::BAD_GATEWAY,
            ConsoleError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ConsoleError::NotFound(_) => StatusCode::NOT_FOUND,
            ConsoleError::WrongHost(_) => StatusCode::MISDIRECTED_REQUEST,
            ConsoleError::TooManyStreams => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let status = self.status();
        (
            status,
            Json(json!({"code": status.as_u16(), "message": self.to_string()})),
        )
            .into_response()
    }
}

/// The routes, with the console's state.
pub fn router(console: Console) -> Router {
    Router::new()
        .route("/console", get(|| async { Redirect::to("/console/cluster") }))
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
        .route("/console/", get(|| async { Redirect::to("/console/cluster") }))
        .route("/console/login", get(login_form).post(login))
        .route("/console/logout", post(logout))
        .route("/console/assets/console.js", get(script))
        .route("/console/assets/console.css", get(style))
        .route("/console/cluster", get(page_cluster))
        .route("/console/sandboxes", get(page_sandboxes))
        .route("/console/sandboxes/{id}", get(page_sandbox))
        .route("/console/balance", get(page_balance))
        .route("/console/templates", get(page_templates))
        .route("/console/builds/{id}", get(page_build))
        .route("/console/api/health", get(health))
        .route("/console/api/cluster", get(cluster))
        .route("/console/api/sandboxes", get(sandboxes))
        .route("/console/api/sandboxes/{id}", get(sandbox))
        .route("/console/api/balance", get(balance))
        .route("/console/api/balance/pause", post(pause))
        .route("/console/api/nodes/{id}/drain", post(drain))
        .route("/console/api/templates", get(templates))
        .route("/console/api/builds/{id}", get(build))
        .route("/console/events", get(events))
        .fallback(|| async { ConsoleError::NotFound("no such console page".into()) })
        .layer(axum::middleware::from_fn_with_state(console.clone(), own_host))
        .layer(axum::middleware::map_response(secure_headers))
        .with_state(console)
}

/// Refuses a request whose `Host` is not one of the console's own names.
async fn own_host(State(c): State<Console>, request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    if c.host_allowed(&host) {
        next.run(request).await
    } else {
        ConsoleError::WrongHost(host).into_response()
    }
}

async fn secure_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    let set = |headers: &mut HeaderMap, name: &'static str, value: &'static str| {
        headers.insert(name, HeaderValue::from_static(value));
    };
    set(
        headers,
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
         connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    );
    set(headers, "x-content-type-options", "nosniff");
    set(headers, "referrer-policy", "no-referrer");
    set(headers, "x-frame-options", "DENY");
    if !headers.contains_key(header::CACHE_CONTROL) {
        set(headers, "cache-control", "no-store");
    }
    response
}

// ---- pages -------------------------------------------------------------------------------

/// The pages' navigation: (path, label).
const PAGES: [(&str, &str); 4] = [
    ("cluster", "Cluster"),
    ("sandboxes", "Sandboxes"),
    ("balance", "Balance"),
    ("templates", "Templates"),
];

/// JSON safe to put inside a `<script type="application/json">` element: nothing in it can
/// close the element or start markup.
fn embed(value: &Value) -> String {
    value
        .to_string()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

/// A page: the shell every page shares, the page's name for the script, and its first state
/// so it draws without a second request.
fn shell(page: &str, title: &str, initial: &Value) -> Html<String> {
    let nav: String = PAGES
        .iter()
        .map(|(path, label)| {
            let current = if page.starts_with(path) || (*path == "templates" && page == "build") {
                " aria-current=\"page\""
            } else {
                ""
            };
            format!("<a href=\"/console/{path}\"{current}>{label}</a>")
        })
        .collect();
    Html(format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · sandboxsched console</title>\
         <link rel=\"stylesheet\" href=\"/console/assets/console.css\">\
         <script src=\"/console/assets/console.js\" defer></script></head>\
         <body data-page=\"{page}\"><a class=\"skip\" href=\"#main\">Skip to content</a>\
         <header><span class=\"brand\">sandboxsched</span><nav aria-label=\"Console\">{nav}</nav>\
         <span id=\"live\" class=\"live\" role=\"status\" aria-live=\"polite\">connecting…</span>\
         <button id=\"theme\" type=\"button\" aria-label=\"Switch between dark and light\">◐</button>\
         <form method=\"post\" action=\"/console/logout\"><button type=\"submit\">Sign out</button></form></header>\
         <main id=\"main\" tabindex=\"-1\"><h1>{title}</h1><div id=\"app\"></div></main>\
         <dialog id=\"confirm\" aria-labelledby=\"confirm-text\"><form method=\"dialog\">\
         <p id=\"confirm-text\"></p><menu><button value=\"cancel\" type=\"submit\">Cancel</button>\
         <button value=\"ok\" type=\"submit\" class=\"danger\" id=\"confirm-ok\">Confirm</button></menu></form></dialog>\
         <script type=\"application/json\" id=\"initial\">{initial}</script></body></html>",
        title = escape(title),
        initial = embed(initial),
    ))
}

/// A page for an operator, or the login form for anyone else.
/// A page for operators only: anyone else is sent to sign in, a wrong token's answer held
/// back as the API's is (a page would otherwise be a guessing route without the wait).
async fn guarded(c: &Console, headers: &HeaderMap, render: impl FnOnce() -> Html<String>) -> Response {
    match c.operator(headers).await {
        Ok(_) => render().into_response(),
        Err(_) => Redirect::to("/console/login").into_response(),
    }
}

async fn page_cluster(State(c): State<Console>, headers: HeaderMap) -> Response {
    guarded(&c, &headers, || {
        let snapshot = c
            .shared
            .read(|v| serde_json::to_value(v.cluster()))
            .unwrap_or(Value::Null);
        shell("cluster", "Cluster", &snapshot)
    })
    .await
}

async fn page_sandboxes(State(c): State<Console>, headers: HeaderMap) -> Response {
    guarded(&c, &headers, || {
        let first = c
            .shared
            .read(|v| serde_json::to_value(v.sandboxes(&SandboxQuery::default())))
            .unwrap_or(Value::Null);
        shell("sandboxes", "Sandboxes", &first)
    })
    .await
}

async fn page_sandbox(State(c): State<Console>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    guarded(&c, &headers, || {
        shell("sandbox", &format!("Sandbox {id}"), &json!({ "sandboxId": id }))
    })
    .await
}

async fn page_balance(State(c): State<Console>, headers: HeaderMap) -> Response {
    guarded(&c, &headers, || shell("balance", "Balance", &Value::Null)).await
}

async fn page_templates(State(c): State<Console>, headers: HeaderMap) -> Response {
    guarded(&c, &headers, || {
        let templates = c
            .shared
            .read(|v| serde_json::to_value(v.templates()))
            .unwrap_or(Value::Null);
        shell("templates", "Templates", &templates)
    })
    .await
}

async fn page_build(State(c): State<Console>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    guarded(&c, &headers, || {
        shell("build", &format!("Build {id}"), &json!({ "buildId": id }))
    })
    .await
}

fn login_page(status: StatusCode, message: Option<&str>) -> Response {
    let message = message.map_or(String::new(), |m| {
        format!("<p class=\"error\" role=\"alert\" id=\"login-error\">{}</p>", escape(m))
    });
    let body = format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>Sign in · sandboxsched console</title>\
         <link rel=\"stylesheet\" href=\"/console/assets/console.css\"></head>\
         <body class=\"login\"><main id=\"main\"><h1>sandboxsched console</h1>\
         <form method=\"post\" action=\"/console/login\">\
         <label for=\"token\">Admin token</label>\
         <input id=\"token\" name=\"token\" type=\"password\" autocomplete=\"current-password\" required autofocus>\
         <p class=\"hint\">The cluster's admin token (<code>DATA_DIR/admin_token</code> for <code>sandboxsched up</code>). \
         A team's API key does not open the console.</p>{message}\
         <button type=\"submit\">Sign in</button></form></main></body></html>"
    );
    (status, Html(body)).into_response()
}

async fn login_form() -> Response {
    login_page(StatusCode::OK, None)
}

#[derive(Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
}

async fn login(
    State(c): State<Console>,
    form: Result<axum::Form<LoginForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    let given = form.map(|f| f.0.token).unwrap_or_default();
    match c.sessions.login_in_turn(&given).await {
        Ok(id) => {
            metrics::counter!("console_logins_total", "result" => "ok").increment(1);
            let mut response = Redirect::to("/console/cluster").into_response();
            if let Ok(cookie) = HeaderValue::from_str(&session::set_cookie(Some(&id), c.secure_cookie)) {
                response.headers_mut().insert(header::SET_COOKIE, cookie);
            }
            response
        }
        Err(refusal) => {
            metrics::counter!("console_logins_total", "result" => "refused").increment(1);
            let status = ConsoleError::from(refusal.clone()).status();
            login_page(status, Some(&refusal.to_string()))
        }
    }
}

async fn logout(State(c): State<Console>, headers: HeaderMap) -> Response {
    // Another page (a sandbox's, under a shared parent domain, is "same-site") must not sign
    // the operator out.
    if let Err(refused) = from_own_page(&c, &headers, false) {
        return refused.into_response();
    }
    c.sessions.logout(&headers);
    let mut response = Redirect::to("/console/login").into_response();
    if let Ok(cookie) = HeaderValue::from_str(&session::set_cookie(None, c.secure_cookie)) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "private, max-age=300"),
        ],
        body,
    )
        .into_response()
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", include_str!("../assets/console.js"))
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", include_str!("../assets/console.css"))
}

// ---- JSON --------------------------------------------------------------------------------

async fn health(State(c): State<Console>, headers: HeaderMap) -> Result<Json<Value>, ConsoleError> {
    c.operator(&headers).await?;
    let revision = c.shared.read(|v| v.revision());
    Ok(Json(
        json!({"ledger": if c.shared.live() { "live" } else { "unreachable" }, "revision": revision}),
    ))
}

/// The cluster: nodes from their documents, joined with placement's view when placement
/// answers (the page still draws from the documents when it does not, and says so).
async fn cluster(State(c): State<Console>, headers: HeaderMap) -> Result<Json<Value>, ConsoleError> {
    c.operator(&headers).await?;
    let mut snapshot = c
        .shared
        .read(|v| serde_json::to_value(v.cluster()))
        .unwrap_or(Value::Null);
    match c.control.nodes().await {
        Ok(placement) => snapshot["placement"] = json!(placement),
        Err(err) => snapshot["placementError"] = json!(err.to_string()),
    }
    Ok(Json(snapshot))
}

async fn sandboxes(
    State(c): State<Console>,
    headers: HeaderMap,
    query: Result<Query<SandboxQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ConsoleError> {
    c.operator(&headers).await?;
    let Query(query) = query.map_err(|e| ConsoleError::BadRequest(e.body_text()))?;
    let page = c
        .shared
        .read(|v| serde_json::to_value(v.sandboxes(&query)))
        .unwrap_or(Value::Null);
    Ok(Json(page))
}

/// One sandbox: its row, its manifest's history, its log and metrics from its node, and
/// where placement would put a sandbox of its size now. Each part that cannot be read says
/// why in its place; the others still answer.
async fn sandbox(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ConsoleError> {
    c.operator(&headers).await?;
    let (row, address) = c
        .shared
        .read(|v| {
            v.sandbox(&id)
                .map(|row| (row.clone(), v.node(&row.node_id).map(|n| n.address.clone())))
        })
        .ok_or_else(|| ConsoleError::NotFound(format!("sandbox {id} not found")))?;
    let or_error = |answer: Result<Value, String>| answer.unwrap_or_else(|err| json!({ "error": err }));
    let from_node = async {
        let Some(address) = &address else {
            let none = Err("it runs on no node now".to_string());
            return (none.clone(), none);
        };
        let (logs, metrics) = tokio::join!(
            c.control.sandbox_logs(&row.node_id, address, &id, 200),
            c.control.sandbox_metrics(&row.node_id, address, &id),
        );
        (logs.map_err(|e| e.to_string()), metrics.map_err(|e| e.to_string()))
    };
    let (history, explain, (logs, metrics)) = tokio::join!(
        manifest_history(&c.ledger, &id),
        c.control.explain(row.vcpus.max(1), row.memory_mib.max(1)),
        from_node,
    );
    Ok(Json(json!({
        "sandbox": row,
        "history": or_error(history.map_err(|e| e.to_string())),
        "explain": or_error(explain.map_err(|e| e.to_string())),
        "logs": or_error(logs),
        "metrics": or_error(metrics),
    })))
}

/// Every version of a sandbox's manifest the ledger's change log still holds, each with what
/// changed from the one before.
async fn manifest_history(ledger: &ledger_client::LedgerClient, id: &str) -> Result<Value, ledger_client::LedgerError> {
    let Some(manifest) = ledger
        .get::<common::docs::SandboxDoc>(common::docs::SANDBOX_KIND, id)
        .await?
    else {
        return Ok(json!([]));
    };
    let changes = ledger_client::history::changes(ledger, &manifest).await?;
    Ok(json!(changes
        .iter()
        .map(|c| json!({"revision": c.revision, "version": c.version, "changes": c.what}))
        .collect::<Vec<_>>()))
}

async fn balance(State(c): State<Console>, headers: HeaderMap) -> Result<Json<Value>, ConsoleError> {
    c.operator(&headers).await?;
    let mut answer = c.control.balance(20).await?;
    // A drain's progress: what each draining node still runs, per the manifests.
    if let Some(draining) = answer["draining"].as_array().cloned() {
        let left: serde_json::Map<String, Value> = c.shared.read(|v| {
            draining
                .iter()
                .filter_map(Value::as_str)
                .map(|node| (node.to_string(), json!(v.sandboxes_on(node))))
                .collect()
        });
        answer["remaining"] = Value::Object(left);
    }
    Ok(Json(answer))
}

async fn templates(State(c): State<Console>, headers: HeaderMap) -> Result<Json<Value>, ConsoleError> {
    c.operator(&headers).await?;
    let answer = c.shared.read(|v| {
        let templates: Vec<Value> = v
            .templates()
            .into_iter()
            .map(|t| {
                let builds = v.builds(&t.template_id);
                json!({"template": t, "builds": builds.into_iter().take(5).collect::<Vec<_>>()})
            })
            .collect();
        json!(templates)
    });
    Ok(Json(answer))
}

#[derive(Deserialize)]
struct LogQuery {
    #[serde(default)]
    offset: u64,
}

async fn build(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(id): Path<String>,
    query: Result<Query<LogQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ConsoleError> {
    c.operator(&headers).await?;
    let Query(query) = query.map_err(|e| ConsoleError::BadRequest(e.body_text()))?;
    let (row, lines) = c
        .shared
        .read(|v| v.build_log(&id, query.offset, common::template::MAX_BUILD_LOG))
        .ok_or_else(|| ConsoleError::NotFound(format!("build {id} not found")))?;
    Ok(Json(json!({"build": row, "log": lines})))
}

// ---- actions -----------------------------------------------------------------------------

/// An action's body, checked to come from the console's own page: JSON (which a form on
/// another site cannot send without a preflight this server never grants) and, from a
/// signed-in browser, with an `Origin` naming the console itself (or `Sec-Fetch-Site:
/// same-origin`): without either it is refused, never assumed. A script sending the token
/// itself is no browser's to forge; an `Origin` it sends must still be the console's.
fn action_body<T: for<'de> Deserialize<'de>>(
    c: &Console,
    caller: &Caller,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<T, ConsoleError> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|v| v.trim() == "application/json"));
    if !json {
        return Err(ConsoleError::BadRequest("an action's body must be JSON".into()));
    }
    from_own_page(c, headers, *caller == Caller::Token)?;
    serde_json::from_slice(body).map_err(|e| ConsoleError::BadRequest(format!("invalid body: {e}")))
}

/// Whether a state-changing request comes from the console's own page: an `Origin` naming
/// the console, or, without one, `Sec-Fetch-Site: same-origin`. A `script` sending the admin
/// token itself may name no origin (no browser sends that header for another site).
fn from_own_page(c: &Console, headers: &HeaderMap, script: bool) -> Result<(), ConsoleError> {
    // `null` names no origin: browsers send it for the console's own sign-out form, since its
    // pages are served with `Referrer-Policy: no-referrer` (and for sandboxed frames, which
    // then say `Sec-Fetch-Site: cross-site`).
    let origin = headers
        .get(header::ORIGIN)
        .map(|v| v.to_str().unwrap_or("?"))
        .filter(|o| *o != "null");
    let same_site = headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes() == b"same-origin");
    let own = |origin: &str| {
        let bare = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .unwrap_or("");
        c.host_allowed(bare)
    };
    let allowed = match origin {
        Some(origin) => own(origin),
        None => script || same_site,
    };
    if allowed {
        Ok(())
    } else {
        Err(ConsoleError::BadRequest(format!(
            "an action must come from the console's own page, not {}",
            origin.unwrap_or("a page that names no origin")
        )))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    #[serde(default)]
    undo: bool,
}

async fn drain(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ConsoleError> {
    let caller = c.operator(&headers).await?;
    let DrainBody { undo } = action_body(&c, &caller, &headers, &body)?;
    if c.shared.read(|v| v.node(&node).is_none()) {
        return Err(ConsoleError::NotFound(format!("node {node} not found")));
    }
    tracing::info!(node_id = %node, undo, "console: drain");
    Ok(Json(c.control.drain(&node, undo).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    paused: bool,
}

async fn pause(State(c): State<Console>, headers: HeaderMap, body: Bytes) -> Result<Json<Value>, ConsoleError> {
    let caller = c.operator(&headers).await?;
    let PauseBody { paused } = action_body(&c, &caller, &headers, &body)?;
    tracing::info!(paused, "console: balancing paused or resumed");
    Ok(Json(c.control.set_paused(paused).await?))
}

// ---- live --------------------------------------------------------------------------------

#[derive(Deserialize)]
struct Topics {
    /// Comma-separated event names the page draws (`node,spread`); empty: all.
    #[serde(default)]
    topics: String,
}

/// Server-sent events: every change the page draws, as it happens. A page that falls so
/// far behind that events were dropped for it gets `reset` and re-reads its state; `reset`
/// and `ledger` (whether the ledger answers) reach every page. A stream ends when its
/// session does.
async fn events(
    State(c): State<Console>,
    headers: HeaderMap,
    Query(Topics { topics }): Query<Topics>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ConsoleError> {
    let caller = c.operator(&headers).await?;
    let wanted: Vec<&'static str> = TOPICS
        .into_iter()
        .filter(|known| topics.split(',').any(|t| t == *known))
        .collect();
    let guard = StreamGuard::open(&c.streams).ok_or(ConsoleError::TooManyStreams)?;
    let live = c.shared.live();
    let hello = futures::stream::once(async move {
        Ok(SseEvent::default()
            .event("hello")
            .data(json!({ "ledger": if live { "live" } else { "unreachable" } }).to_string()))
    });
    let stream = BroadcastStream::new(c.shared.subscribe()).filter_map(move |item| {
        let _held = &guard;
        let event = match item {
            Ok(event)
                if event.name == "reset"
                    || event.name == "ledger"
                    || wanted.is_empty()
                    || wanted.contains(&event.name) =>
            {
                Some(SseEvent::default().event(event.name).data(event.data.as_str()))
            }
            Ok(_) => None,
            Err(BroadcastStreamRecvError::Lagged(missed)) => {
                metrics::counter!("console_events_dropped_total").increment(missed);
                Some(SseEvent::default().event("reset").data("{\"lagged\":true}"))
            }
        };
        futures::future::ready(event.map(Ok))
    });
    let sessions = c.sessions.clone();
    let ended = async move {
        let Caller::Session(id) = caller else {
            return futures::future::pending().await;
        };
        loop {
            tokio::time::sleep(STREAM_RECHECK).await;
            if !sessions.alive(&id) {
                return;
            }
        }
    };
    Ok(Sse::new(hello.chain(stream).take_until(Box::pin(ended)))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

/// One open event stream, counted until its browser goes.
struct StreamGuard(Arc<std::sync::atomic::AtomicUsize>);

impl StreamGuard {
    /// Counts a stream in, unless [`MAX_STREAMS`] are open.
    fn open(open: &Arc<std::sync::atomic::AtomicUsize>) -> Option<Self> {
        use std::sync::atomic::Ordering;
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < MAX_STREAMS).then_some(n + 1)
        })
        .ok()?;
        metrics::gauge!("console_event_streams").increment(1.0);
        Some(Self(open.clone()))
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        metrics::gauge!("console_event_streams").decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn console() -> Console {
        let security = mtls::Security::Plaintext;
        Console {
            shared: Shared::new(),
            ledger: ledger_client::LedgerClient::connect_lazy("http://127.0.0.1:1", &security).unwrap(),
            sessions: Arc::new(Sessions::new(Some("admin_0123456789abcdef".into()))),
            control: Control::new(&security, "http://127.0.0.1:1", "").unwrap(),
            hosts: Arc::new(vec!["127.0.0.1:3001".into(), "localhost:3001".into()]),
            secure_cookie: false,
            streams: Arc::default(),
        }
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[tokio::test]
    async fn an_action_from_a_browser_must_name_the_console_as_its_origin() {
        let c = console();
        let session = Caller::Session("s".into());
        let body = Bytes::from_static(br#"{"paused":true}"#);
        let json = ("content-type", "application/json");
        let decide = |caller: &Caller, pairs: &[(&'static str, &str)]| {
            action_body::<PauseBody>(&c, caller, &headers(pairs), &body).map(|b| b.paused)
        };
        assert!(decide(&session, &[json, ("origin", "http://127.0.0.1:3001")]).is_ok());
        assert!(decide(&session, &[json, ("origin", "http://LOCALHOST:3001")]).is_ok());
        assert!(decide(&session, &[json, ("sec-fetch-site", "same-origin")]).is_ok());
        // Another site, a look-alike, no origin at all, a cross-site fetch: refused.
        for pairs in [
            &[json, ("origin", "http://evil.example")][..],
            &[json, ("origin", "http://127.0.0.1:3001.evil.example")],
            &[json, ("origin", "null")],
            &[json],
            &[json, ("sec-fetch-site", "cross-site")],
        ] {
            assert!(decide(&session, pairs).is_err(), "{pairs:?}");
        }
        // A script with the token itself: no origin needed, but a foreign one still refused.
        assert!(decide(&Caller::Token, &[json]).is_ok());
        assert!(decide(&Caller::Token, &[json, ("origin", "http://evil.example")]).is_err());
        // Not JSON (what a plain form on another site sends): refused whatever the origin.
        assert!(decide(
            &session,
            &[("content-type", "text/plain"), ("origin", "http://127.0.0.1:3001")]
        )
        .is_err());
    }

    #[tokio::test]
    async fn another_page_cannot_sign_the_operator_out() {
        let c = console();
        let id = c.sessions.login("admin_0123456789abcdef").unwrap();
        let cookie = format!("{}={id}", session::COOKIE);
        for foreign in [
            &[
                ("cookie", cookie.as_str()),
                ("origin", "http://8000-sbx.sandbox.example"),
            ][..],
            &[("cookie", cookie.as_str()), ("sec-fetch-site", "same-site")],
            &[
                ("cookie", cookie.as_str()),
                ("origin", "null"),
                ("sec-fetch-site", "cross-site"),
            ],
        ] {
            let answer = logout(State(c.clone()), headers(foreign)).await;
            assert_eq!(answer.status(), StatusCode::BAD_REQUEST, "{foreign:?}");
            assert!(c.sessions.alive(&id), "signed out by {foreign:?}");
        }
        // What a browser sends for the console's own form under `no-referrer`.
        let own = [
            ("cookie", cookie.as_str()),
            ("origin", "null"),
            ("sec-fetch-site", "same-origin"),
        ];
        assert_eq!(
            logout(State(c.clone()), headers(&own)).await.status(),
            StatusCode::SEE_OTHER
        );
        assert!(!c.sessions.alive(&id));
    }

    #[tokio::test]
    async fn a_wrong_token_on_a_page_waits_as_on_the_api() {
        let c = console();
        let page = |token: &'static str| page_balance(State(c.clone()), headers(&[("x-admin-token", token)]));
        let started = std::time::Instant::now();
        assert_eq!(page("guess_0123456789abcdef").await.status(), StatusCode::SEE_OTHER);
        assert!(
            started.elapsed() >= session::GUESS_DELAY,
            "a page answered a guess at once"
        );
        assert_eq!(page("admin_0123456789abcdef").await.status(), StatusCode::OK);
    }

    #[test]
    fn stream_slots_are_bounded_and_given_back() {
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let held: Vec<_> = (0..MAX_STREAMS).map(|_| StreamGuard::open(&open).unwrap()).collect();
        assert!(StreamGuard::open(&open).is_none());
        drop(held);
        assert!(StreamGuard::open(&open).is_some());
    }

    #[test]
    fn embedded_state_cannot_close_its_script_element() {
        let text = embed(&json!({"name": "</script><script>alert(1)</script>&"}));
        assert!(
            !text.contains('<') && !text.contains('>') && !text.contains('&'),
            "{text}"
        );
        assert_eq!(escape(r#"<a href="x">'&"#), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;");
    }
}
