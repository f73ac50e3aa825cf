//! The node's envd endpoint: what the gateway's proxy forwards an SDK's envd calls to, for
//! every sandbox of this node, told apart by the `E2b-Sandbox-Id` header.
//!
//! The API itself is the `envd` crate's. Here the node does what only it can:
//! - lets a request through only with the sandbox's access token (`X-Access-Token`, or a
//!   `/files` URL signed with it), checked by one layer in front of every route so no route
//!   can forget it; a sandbox created without a token answers nobody; `/health` passes;
//! - answers for sandboxes that are not running (unknown here, paused) in the route's own
//!   error shape;
//! - holds a request that changes the sandbox's files against a pause (uploads, MakeDir,
//!   Move, Remove), so a snapshot never catches a half-written file
//!   ([`crate::host::Host::file_access`]);
//! - hosts one envd per sandbox of the unisolated process runtime, whose commands it puts into
//!   the sandbox's cgroups and namespaces ([`crate::runtime::Runtime::enclose`]).
//!
//! The tokens that let a request in (`X-Access-Token`, `E2b-Traffic-Access-Token`) are checked
//! here and never passed inside ([`CREDENTIALS`]): nothing in a sandbox needs them, and a
//! sandbox's root that stood in for envd, or a server on one of its ports, would collect them.
//!
//! A request with an `E2b-Sandbox-Port` other than envd's goes to that port of the sandbox
//! instead ([`to_port`]): over a connection the node opens inside the sandbox's network
//! namespace, so a server listening on the sandbox's loopback is reached and no route into
//! the sandbox exists. Those requests need no envd token, only the sandbox's traffic token
//! when it has one.
//!
//! Served over HTTP/1.1 and h2c on one port.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use envd::connect::{Code, RpcError};
use envd::files::rest_from_rpc;
use envd_wire::access;
use tokio::sync::Mutex;
use tower::ServiceExt;

use crate::host::Host;
use crate::sandbox::{SandboxRecord, State as SandboxState};

/// The endpoint's state.
#[derive(Clone)]
pub struct Envd {
    host: Arc<Host>,
    /// Each sandbox's envd.
    hosted: Arc<Mutex<HashMap<String, HostedEnvd>>>,
}

/// A hosted envd with what it was made for: the creation time of the sandbox it serves (a
/// sandbox ID reused after a kill gets a fresh one) and its env vars (a claim changes them).
type HostedEnvd = (u64, std::collections::BTreeMap<String, String>, envd::Envd);

impl Envd {
    pub fn new(host: Arc<Host>) -> Self {
        Self {
            host,
            hosted: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// The HTTP routes: every path goes to the sandbox's envd, behind the token check.
    pub fn router(self) -> Router {
        Router::new()
            .fallback(forward)
            .layer(axum::middleware::from_fn_with_state(self.clone(), authorized))
            .with_state(self)
    }

    /// The sandbox named by `E2b-Sandbox-Id`, whatever its state.
    async fn record(&self, headers: &HeaderMap) -> Result<SandboxRecord, RpcError> {
        let id = headers
            .get(envd_wire::headers::SANDBOX_ID)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| RpcError::new(Code::InvalidArgument, "the E2b-Sandbox-Id header is required"))?;
        self.host.get(id).await.ok_or_else(|| RpcError::missing(id))
    }

    /// The running sandbox a request is for.
    async fn running(&self, headers: &HeaderMap) -> Result<SandboxRecord, RpcError> {
        let record = self.record(headers).await?;
        if record.state != SandboxState::Running {
            return Err(RpcError::new(
                Code::Unavailable,
                format!("sandbox {} is {:?}; resume it first", record.id, record.state),
            ));
        }
        Ok(record)
    }

    /// The envd serving `record`, made on first use; instances of sandboxes gone from this
    /// node are dropped then too (with the commands they still track).
    async fn instance(&self, record: &SandboxRecord) -> envd::Envd {
        let mut hosted = self.hosted.lock().await;
        if let Some((created, env, instance)) = hosted.get(&record.id) {
            // A claim changes the env vars: the instance is made again with them.
            if *created == record.created_at_unix_ms && *env == record.env {
                return instance.clone();
            }
        }
        let live: Vec<String> = self.host.list_ids().await;
        hosted.retain(|id, _| live.contains(id));
        let runtime = self.host.runtime().clone();
        let (for_enclose, home) = (record.clone(), self.host.home(&record.id));
        let enclose_home = home.clone();
        let instance = envd::Envd::hosted(
            envd::SandboxEnv {
                sandbox_id: record.id.clone(),
                vars: record.env.clone(),
            },
            envd::server::Hosted {
                home,
                enclose: Arc::new(move |cmd, cwd| {
                    runtime
                        .enclose(&for_enclose.view(), &enclose_home, cwd, cmd)
                        .map_err(|e| e.to_string())
                }),
            },
        );
        hosted.insert(
            record.id.clone(),
            (record.created_at_unix_ms, record.env.clone(), instance.clone()),
        );
        instance
    }
}

/// envd's `/init`: the node calls it over the sandbox's socket; it is never forwarded.
const INIT_PATH: &str = "/init";

/// Whether a request changes the sandbox's files (and so must not overlap a pause). Streams
/// (watches) are not held: a watch may last for ever.
fn changes_files(method: &Method, path: &str) -> bool {
    (method == Method::POST && path == "/files")
        || matches!(
            path,
            "/filesystem.Filesystem/MakeDir" | "/filesystem.Filesystem/Move" | "/filesystem.Filesystem/Remove"
        )
}

/// An error in the shape of the route's protocol: Connect's JSON for RPCs, `{code, message}`
/// for the REST routes.
fn refusal(path: &str, err: RpcError) -> Response {
    if path.starts_with("/process.") || path.starts_with("/filesystem.") {
        err.into_response()
    } else {
        rest_from_rpc(err)
    }
}

/// The sandbox port a request is for, when it is not envd's: `Ok(None)` for envd.
fn port_of(headers: &HeaderMap) -> Result<Option<u16>, RpcError> {
    let Some(value) = headers.get(envd_wire::headers::SANDBOX_PORT) else {
        return Ok(None);
    };
    match value.to_str().ok().and_then(envd_wire::headers::port) {
        Some(envd_wire::ENVD_PORT) => Ok(None),
        Some(port) => Ok(Some(port)),
        None => Err(RpcError::new(
            Code::InvalidArgument,
            "the E2b-Sandbox-Port header is not a port",
        )),
    }
}

/// Lets a request through only with the sandbox's access token (or a `/files` URL signed
/// with it); `/health` passes as it is. A request for another port needs the sandbox's
/// traffic token instead, when it has one.
async fn authorized(State(envd): State<Envd>, request: Request, next: axum::middleware::Next) -> Response {
    let path = request.uri().path().to_string();
    let port = match port_of(request.headers()) {
        Ok(port) => port,
        Err(err) => return rest_from_rpc(err),
    };
    if path == access::HEALTH_PATH && port.is_none() {
        return next.run(request).await;
    }
    let record = match envd.record(request.headers()).await {
        Ok(record) => record,
        Err(err) => return refusal(&path, err),
    };
    if port.is_some() {
        let presented = request
            .headers()
            .get(envd_wire::headers::TRAFFIC_ACCESS_TOKEN)
            .map(axum::http::HeaderValue::as_bytes);
        if let Err(denied) = access::authorize_traffic(record.traffic_access_token.as_deref(), presented) {
            metrics::counter!("node_port_denied_total").increment(1);
            return rest_from_rpc(RpcError::new(Code::Unauthenticated, denied));
        }
        return next.run(request).await;
    }
    let presented = access::Presented {
        path: &path,
        method: request.method().as_str(),
        query: request.uri().query(),
        token: request
            .headers()
            .get(envd_wire::headers::ACCESS_TOKEN)
            .map(axum::http::HeaderValue::as_bytes),
    };
    let now = common::clock::now_ms() / 1000;
    if let Err(denied) = access::authorize(record.access_token.as_deref(), &presented, now) {
        metrics::counter!("node_envd_denied_total", "why" => format!("{denied:?}")).increment(1);
        tracing::info!(sandbox_id = %record.id, why = ?denied, "envd request refused");
        return refusal(&path, RpcError::new(Code::Unauthenticated, denied.message()));
    }
    next.run(request).await
}

/// Hands the request to its sandbox's envd, or to the port it names; `/health` without a
/// sandbox is the node's own.
async fn forward(State(envd): State<Envd>, request: Request) -> Response {
    if let Ok(Some(port)) = port_of(request.headers()) {
        return to_port(&envd, port, request).await;
    }
    let path = request.uri().path().to_string();
    let health = path == access::HEALTH_PATH;
    if health && !request.headers().contains_key(envd_wire::headers::SANDBOX_ID) {
        return StatusCode::NO_CONTENT.into_response();
    }
    if path == INIT_PATH {
        // The node's own call (a claim's env vars): a request from outside would let whoever
        // holds the token change what every later command of the sandbox starts with.
        return refusal(
            &path,
            RpcError::new(
                Code::PermissionDenied,
                "/init is the node's, not reachable from outside",
            ),
        );
    }
    let record = match envd.running(request.headers()).await {
        Ok(record) => record,
        Err(err) => return refusal(&path, err),
    };
    if health {
        return StatusCode::NO_CONTENT.into_response();
    }
    // Held until envd has answered (an upload is written by then).
    let _access = if changes_files(request.method(), &path) {
        match envd.host.file_access(&record.id).await {
            Some(access) => Some(access),
            None => {
                return refusal(
                    &path,
                    RpcError::new(
                        Code::Unavailable,
                        format!("sandbox {} was paused; resume it first", record.id),
                    ),
                )
            }
        }
    } else {
        None
    };
    if let Some(socket) = envd.host.runtime().envd_socket(&envd.host.home(&record.id)) {
        let mut request = request;
        strip_credentials(request.headers_mut());
        return match through_socket(&socket, request).await {
            Ok(response) => response,
            Err(reason) => {
                tracing::warn!(sandbox_id = %record.id, %reason, "envd inside the sandbox did not answer");
                refusal(
                    &path,
                    RpcError::new(
                        Code::Unavailable,
                        format!("envd of sandbox {} did not answer: {reason}", record.id),
                    ),
                )
            }
        };
    }
    let instance = envd.instance(&record).await;
    match instance.router().oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// Relays `request` to `port` of its sandbox (HTTP/1.1, upgrades spliced through); answers
/// 502 in E2B's shape when nothing listens there. The server there learns whether the caller
/// showed the sandbox's access token ([`envd_wire::headers::ACCESS_VERIFIED`]), never the
/// token.
async fn to_port(envd: &Envd, port: u16, mut request: Request) -> Response {
    let record = match envd.running(request.headers()).await {
        Ok(record) => record,
        Err(err) => return rest_from_rpc(err),
    };
    let verified = match (
        record.access_token.as_deref().filter(|t| !t.is_empty()),
        request.headers().get(envd_wire::headers::ACCESS_TOKEN),
    ) {
        (Some(expected), Some(given)) => access::same_secret(expected.as_bytes(), given.as_bytes()),
        _ => false,
    };
    let headers = request.headers_mut();
    headers.remove(envd_wire::headers::ACCESS_VERIFIED);
    if verified {
        headers.insert(
            envd_wire::headers::ACCESS_VERIFIED,
            axum::http::HeaderValue::from_static("true"),
        );
    }
    let runtime = envd.host.runtime().clone();
    let for_connect = record.clone();
    let connected = tokio::task::spawn_blocking(move || runtime.connect_port(&for_connect.view(), port)).await;
    let stream = match connected {
        Ok(Ok(stream)) => stream,
        Ok(Err(err)) => {
            tracing::debug!(sandbox_id = %record.id, port, %err, "sandbox port did not answer");
            return port_error(&record.id, port, &err.to_string());
        }
        Err(err) => return port_error(&record.id, port, &err.to_string()),
    };
    let stream = match stream
        .set_nonblocking(true)
        .and_then(|()| tokio::net::TcpStream::from_std(stream))
    {
        Ok(stream) => stream,
        Err(err) => return port_error(&record.id, port, &err.to_string()),
    };
    let routing = [
        envd_wire::headers::SANDBOX_ID,
        envd_wire::headers::SANDBOX_PORT,
        envd_wire::headers::TRAFFIC_ACCESS_TOKEN,
        envd_wire::headers::ACCESS_TOKEN,
    ];
    match common::relay::relay(stream, request, &routing).await {
        Ok(response) => response,
        Err(err) => port_error(&record.id, port, &err.to_string()),
    }
}

/// The headers that prove a caller may reach a sandbox: checked by the node, never passed
/// into the sandbox.
pub const CREDENTIALS: [&str; 2] = [
    envd_wire::headers::ACCESS_TOKEN,
    envd_wire::headers::TRAFFIC_ACCESS_TOKEN,
];

/// Removes [`CREDENTIALS`] from a request bound for the inside of a sandbox.
fn strip_credentials(headers: &mut HeaderMap) {
    for name in CREDENTIALS {
        headers.remove(name);
    }
}

/// 502 `{code, message}`: nothing answered on the sandbox's port.
fn port_error(sandbox: &str, port: u16, reason: &str) -> Response {
    let body = serde_json::json!({
        "code": 502,
        "message": format!("nothing answered on port {port} of sandbox {sandbox}: {reason}"),
    });
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}

/// Sends `request` to the envd listening on `socket` (inside its sandbox) and streams its
/// answer back: bodies flow through as they come, in both directions.
async fn through_socket(socket: &std::path::Path, request: Request) -> Result<Response, String> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| format!("connecting: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        if let Err(err) = connection.await {
            tracing::debug!(%err, "envd connection ended");
        }
    });
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("request: {e}"))?;
    Ok(response.map(axum::body::Body::new))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_token_goes_inside() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("x-access-token", "envd-token"),
            ("e2b-traffic-access-token", "traffic-token"),
            ("authorization", "Basic dXNlcjo="),
        ] {
            headers.insert(name, value.parse().expect("header"));
        }
        strip_credentials(&mut headers);
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert!(headers.contains_key("authorization"), "envd picks the user from it");
    }
}
