//! The envd proxy: the SDK sends every envd call to one URL with an `E2b-Sandbox-Id` header;
//! the gateway finds the node's envd endpoint for that sandbox and streams the call there and
//! the answer back.
//!
//! Where each sandbox runs comes from the routing table ([`crate::routes`]), kept fresh by a
//! ledger watch.
//!
//! A request addresses a sandbox by the `E2b-Sandbox-Id` (and `E2b-Sandbox-Port`) headers or
//! by a host name `{port}-{sandboxID}.{domain}`. Nothing passes without the sandbox's access
//! token (or, for `/files`, a URL signed with it): knowing a sandbox's ID is not enough, and
//! API keys play no part here, so another team's key opens nothing either. The node checks
//! the same again.

use std::sync::Arc;

use crate::edge_headers::{self, Door};
use crate::routes::{Route, Routes, HOLD_DURING_MOVE};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use envd_wire::access::{self, Presented};
use envd_wire::{headers, ENVD_PORT};
use ledger_client::LedgerClient;
use serde_json::json;

/// The sandbox and port a request is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub sandbox_id: String,
    pub port: u16,
}

/// Why a request's target cannot be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadTarget(pub String);

/// The target a request names: the `E2b-Sandbox-Id` header (with `E2b-Sandbox-Port`, envd's
/// port when absent), else a `Host` of the form `{port}-{sandboxID}.{domain}`. `None`: the
/// request is for the REST API.
pub fn target_of(headers: &HeaderMap, domain: &str) -> Option<Result<Target, BadTarget>> {
    if let Some(id) = headers.get(headers::SANDBOX_ID) {
        let Some(id) = id.to_str().ok().filter(|id| crate::ids::check_id(id).is_ok()) else {
            return Some(Err(BadTarget("the E2b-Sandbox-Id header is not a sandbox ID".into())));
        };
        let port = match headers.get(headers::SANDBOX_PORT) {
            None => ENVD_PORT,
            Some(v) => match v.to_str().ok().and_then(headers::port) {
                Some(port) => port,
                None => return Some(Err(BadTarget("the E2b-Sandbox-Port header is not a port".into()))),
            },
        };
        return Some(Ok(Target {
            sandbox_id: id.to_string(),
            port,
        }));
    }
    let host = headers.get(axum::http::header::HOST)?.to_str().ok()?;
    let (port, id) = envd_wire::host::parse(host, domain)?;
    if crate::ids::check_id(id).is_err() {
        return Some(Err(BadTarget("the host name does not name a sandbox ID".into())));
    }
    Some(Ok(Target {
        sandbox_id: id.to_string(),
        port,
    }))
}

#[derive(Clone)]
pub struct Proxy {
    pub routes: Routes,
    pub ledger: LedgerClient,
    /// The hop to the nodes (mutual TLS, each node checked by its ID).
    pub nodes: crate::node_http::NodeHttp,
    /// For resuming a paused sandbox that asked to be resumed by its traffic.
    pub sandboxes: Arc<crate::sandboxes::Sandboxes>,
}

impl Proxy {
    /// The route of a running sandbox: as it is, or after resuming a paused one that asked
    /// for `autoResume`; else the answer to give.
    async fn running(&self, id: &str, route: Route) -> Result<Route, Response> {
        if route.running {
            return Ok(route);
        }
        let Some((team, timeout_secs)) = &route.auto_resume else {
            return Err(sandbox_error(
                StatusCode::BAD_GATEWAY,
                id,
                "The sandbox is paused; resume or connect to it first",
            ));
        };
        let timeout = if *timeout_secs == 0 {
            crate::intent::DEFAULT_TIMEOUT_SECS
        } else {
            *timeout_secs
        };
        match self.sandboxes.resume(team, id, timeout).await {
            Ok((_, resumed)) => {
                if resumed {
                    metrics::counter!("gateway_auto_resumes_total").increment(1);
                    tracing::info!(sandbox_id = %id, "resumed by its traffic (autoResume)");
                }
                match self.routes.settled(&self.ledger, id, HOLD_DURING_MOVE).await {
                    Some(route) if route.running => Ok(route),
                    _ => Err(sandbox_error(StatusCode::BAD_GATEWAY, id, "The sandbox was not found")),
                }
            }
            Err(err) => {
                // The caller may be anyone the sandbox's port is public to: why it failed
                // (the ledger's, a node's or the owner team's limit) is the operator's to read.
                tracing::warn!(sandbox_id = %id, %err, "auto-resume failed");
                Err(sandbox_error(
                    StatusCode::BAD_GATEWAY,
                    id,
                    "The sandbox is paused and could not be resumed; try again later",
                ))
            }
        }
    }
}

fn sandbox_error(status: StatusCode, id: &str, message: &str) -> Response {
    (
        status,
        Json(json!({"sandboxId": id, "message": message, "code": status.as_u16()})),
    )
        .into_response()
}

const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Forwards a request for a sandbox to the node that runs it, streaming both ways, once the
/// request has shown the sandbox's access token.
pub async fn forward(State(proxy): State<Proxy>, target: Target, request: Request) -> Response {
    let id = target.sandbox_id;
    let Some(route) = proxy.routes.settled(&proxy.ledger, &id, HOLD_DURING_MOVE).await else {
        // What E2B's edge answers for a sandbox that does not exist (any more); the SDK maps
        // 502 to "sandbox timed out or not found".
        return sandbox_error(StatusCode::BAD_GATEWAY, &id, "The sandbox was not found");
    };
    if target.port != ENVD_PORT {
        return to_port(&proxy, &id, target.port, route, request).await;
    }
    let presented = Presented {
        path: request.uri().path(),
        method: request.method().as_str(),
        query: request.uri().query(),
        token: request.headers().get(headers::ACCESS_TOKEN).map(HeaderValue::as_bytes),
    };
    if let Err(denied) = access::authorize(
        route.access_token.as_deref(),
        &presented,
        common::clock::now_ms() / 1000,
    ) {
        metrics::counter!("gateway_envd_denied_total", "why" => format!("{denied:?}")).increment(1);
        tracing::info!(sandbox_id = %id, why = ?denied, "envd request refused");
        return sandbox_error(StatusCode::UNAUTHORIZED, &id, denied.message());
    }
    // `/health` is open to anyone, so it must not wake a paused sandbox (which would keep it
    // running, and its owner paying, for whoever knows its ID): only a caller showing the
    // sandbox's token does, and to anyone else a sandbox that is not running is not there.
    if !route.running
        && presented.path == access::HEALTH_PATH
        && !access::shows_token(route.access_token.as_deref(), presented.token)
    {
        return sandbox_error(StatusCode::BAD_GATEWAY, &id, "The sandbox was not found");
    }
    let route = match proxy.running(&id, route).await {
        Ok(route) => route,
        Err(response) => return response,
    };
    let (parts, body) = request.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Ok(uri) = proxy.nodes.uri(&route.node_id, &route.envd, path) else {
        tracing::warn!(sandbox_id = %id, envd = %route.envd, "envd proxy: not a node address");
        return sandbox_error(StatusCode::BAD_GATEWAY, &id, "The sandbox's node is unreachable");
    };
    let mut outbound = Request::builder().method(parts.method.clone()).uri(uri);
    for (name, value) in &parts.headers {
        if name == "host"
            || name == headers::SANDBOX_ID
            || HOP_BY_HOP.contains(&name.as_str())
            || !edge_headers::passes(name.as_str(), Door::Envd)
        {
            continue;
        }
        outbound = outbound.header(name, value);
    }
    // The node tells sandboxes apart by this header, whichever way the request named its own.
    outbound = outbound.header(headers::SANDBOX_ID, &id);
    let Ok(outbound) = outbound.body(body) else {
        return sandbox_error(StatusCode::BAD_REQUEST, &id, "the request cannot be passed on");
    };
    match proxy.nodes.send(outbound).await {
        Ok(answer) if answer.headers().contains_key(headers::MISSING) => {
            // The node no longer has it (killed, or moved away a moment ago).
            proxy.routes.forget(&id).await;
            sandbox_error(StatusCode::BAD_GATEWAY, &id, "The sandbox was not found")
        }
        Ok(answer) => {
            let (mut head, body) = answer.into_parts();
            for name in HOP_BY_HOP {
                head.headers.remove(name);
            }
            edge_headers::host_only_cookies(&mut head.headers);
            Response::from_parts(head, Body::new(body))
        }
        Err(err) => {
            tracing::warn!(sandbox_id = %id, %err, "envd proxy: node unreachable");
            sandbox_error(StatusCode::BAD_GATEWAY, &id, "The sandbox's node is unreachable")
        }
    }
}

/// Relays a request for a sandbox's port (not envd's) to its node, which relays it into the
/// sandbox: HTTP/1.1 on both hops whatever the client spoke, upgrades (WebSocket) spliced
/// through. Public unless the sandbox has a traffic token; envd's access token plays no part.
async fn to_port(proxy: &Proxy, id: &str, port: u16, route: Route, mut request: Request) -> Response {
    let presented = request
        .headers()
        .get(headers::TRAFFIC_ACCESS_TOKEN)
        .map(HeaderValue::as_bytes);
    if let Err(denied) = access::authorize_traffic(route.traffic_token.as_deref(), presented) {
        metrics::counter!("gateway_port_denied_total").increment(1);
        return sandbox_error(StatusCode::UNAUTHORIZED, id, denied);
    }
    let route = match proxy.running(id, route).await {
        Ok(route) => route,
        Err(response) => return response,
    };
    // The node tells sandboxes and ports apart by these, whichever way the request named them.
    let (Ok(sandbox), Ok(port)) = (HeaderValue::from_str(id), HeaderValue::from_str(&port.to_string())) else {
        return sandbox_error(StatusCode::BAD_REQUEST, id, "not a sandbox ID");
    };
    request.headers_mut().insert(headers::SANDBOX_ID, sandbox);
    request.headers_mut().insert(headers::SANDBOX_PORT, port);
    edge_headers::strip_credentials(request.headers_mut(), Door::Port);
    if !common::relay::is_upgrade(request.headers()) {
        return to_port_pooled(proxy, id, &route, request).await;
    }
    let stream = match proxy.nodes.connect(&route.node_id, &route.envd).await {
        Ok(stream) => stream,
        Err(err) => {
            tracing::warn!(sandbox_id = %id, %err, "port proxy: node unreachable");
            return sandbox_error(StatusCode::BAD_GATEWAY, id, "The sandbox's node is unreachable");
        }
    };
    match common::relay::relay(stream, request, &[]).await {
        Ok(mut response) => {
            edge_headers::host_only_cookies(response.headers_mut());
            response
        }
        Err(err) => {
            tracing::warn!(sandbox_id = %id, %err, "port proxy: node did not answer");
            sandbox_error(StatusCode::BAD_GATEWAY, id, "The sandbox's node did not answer")
        }
    }
}

/// A request for a sandbox's port that asks for no upgrade: over the pooled connections to
/// its node, so it pays no connection (and no TLS handshake) of its own.
async fn to_port_pooled(proxy: &Proxy, id: &str, route: &Route, mut request: Request) -> Response {
    common::relay::prepare(&mut request, &[]);
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
    let Ok(uri) = proxy.nodes.uri(&route.node_id, &route.envd, &path) else {
        tracing::warn!(sandbox_id = %id, envd = %route.envd, "port proxy: not a node address");
        return sandbox_error(StatusCode::BAD_GATEWAY, id, "The sandbox's node is unreachable");
    };
    *request.uri_mut() = uri;
    match proxy.nodes.send(request).await {
        Ok(answer) => {
            let mut answer = answer.map(Body::new);
            common::relay::prepare_answer(&mut answer);
            edge_headers::host_only_cookies(answer.headers_mut());
            answer
        }
        Err(err) => {
            tracing::warn!(sandbox_id = %id, %err, "port proxy: node did not answer");
            sandbox_error(StatusCode::BAD_GATEWAY, id, "The sandbox's node did not answer")
        }
    }
}
