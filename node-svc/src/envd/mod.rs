//! The envd-compatible endpoint: what the E2B SDK calls inside a sandbox, for every sandbox
//! of this node, told apart by the `E2b-Sandbox-Id` header.
//!
//! - `process.Process` over Connect (Start, with pipes or a terminal, Connect, List,
//!   SendInput, StreamInput, SendSignal, CloseStdin, Update to resize a terminal);
//! - `filesystem.Filesystem` over Connect (Stat, MakeDir, Move, ListDir, Remove, WatchDir,
//!   CreateWatcher, GetWatcherEvents, RemoveWatcher);
//! - `GET /files`, `POST /files`, `GET /envs`, `GET /health`.
//!
//! Every call but `/health` must show the sandbox's access token (`X-Access-Token`, or a
//! `/files` URL signed with it), checked by one layer in front of every route so no route
//! can forget it; a sandbox created without a token answers nobody. Served over HTTP/1.1 and
//! h2c on one port.

pub mod connect;
mod files;
mod filesystem;
pub mod paths;
mod process;
mod pty;
mod watch;
pub mod wire;

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use envd_wire::access;
use futures::StreamExt;

use crate::host::Host;
use crate::sandbox::{SandboxRecord, State as SandboxState};
use connect::{stream_request, stream_response, unary_request, unary_response, Code, RpcError};
use process::Commands;

/// What every envd handler needs.
#[derive(Clone)]
pub struct Envd {
    host: Arc<Host>,
    commands: Arc<Commands>,
    watchers: Arc<watch::Watchers>,
}

impl Envd {
    pub fn new(host: Arc<Host>) -> Self {
        Self {
            host,
            commands: Arc::new(Commands::default()),
            watchers: Arc::new(watch::Watchers::default()),
        }
    }

    /// The HTTP routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/health", get(health))
            .route("/envs", get(envs))
            .route("/files", get(download).post(upload))
            .route("/process.Process/StreamInput", post(stream_input))
            .route("/process.Process/{method}", post(process_rpc))
            .route("/filesystem.Filesystem/{method}", post(filesystem_rpc))
            .layer(axum::middleware::from_fn_with_state(self.clone(), authorized))
            .with_state(self)
    }

    /// The running sandbox a request is for (its access token was checked by [`authorized`]).
    async fn sandbox(&self, headers: &HeaderMap) -> Result<SandboxRecord, RpcError> {
        let record = self.record(headers).await?;
        if record.state != SandboxState::Running {
            return Err(RpcError::new(
                Code::Unavailable,
                format!("sandbox {} is {:?}; resume it first", record.id, record.state),
            ));
        }
        Ok(record)
    }

    /// The running sandbox a request that touches its files is for, held so that a pause
    /// waits for the request to finish (see [`crate::host::Host::file_access`]).
    async fn files_of(&self, headers: &HeaderMap) -> Result<crate::host::FileAccess, RpcError> {
        let record = self.sandbox(headers).await?;
        self.host.file_access(&record.id).await.ok_or_else(|| {
            RpcError::new(
                Code::Unavailable,
                format!("sandbox {} was paused; resume it first", record.id),
            )
        })
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
}

/// Lets a request through only with the sandbox's access token (or a `/files` URL signed
/// with it); `/health` passes as it is. Refusals are shaped as the route's protocol shapes
/// errors: Connect's JSON for RPCs, `{code, message}` for the REST routes.
async fn authorized(State(envd): State<Envd>, request: Request, next: axum::middleware::Next) -> Response {
    let path = request.uri().path();
    if path == access::HEALTH_PATH {
        return next.run(request).await;
    }
    let rpc = path.starts_with("/process.") || path.starts_with("/filesystem.");
    let refuse = |err: RpcError| {
        if rpc {
            err.into_response()
        } else {
            files::rest_from_rpc(err)
        }
    };
    let record = match envd.record(request.headers()).await {
        Ok(record) => record,
        Err(err) => return refuse(err),
    };
    let presented = access::Presented {
        path,
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
        return refuse(RpcError::new(Code::Unauthenticated, denied.message()));
    }
    next.run(request).await
}

/// Healthy; with `E2b-Sandbox-Id`, only if that sandbox runs here.
async fn health(State(envd): State<Envd>, headers: HeaderMap) -> Response {
    if !headers.contains_key(envd_wire::headers::SANDBOX_ID) {
        return StatusCode::NO_CONTENT.into_response();
    }
    match envd.sandbox(&headers).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => err.into_response(),
    }
}

async fn envs(State(envd): State<Envd>, headers: HeaderMap) -> Response {
    match envd.sandbox(&headers).await {
        Ok(record) => axum::Json(record.env).into_response(),
        Err(err) => files::rest_from_rpc(err),
    }
}

async fn download(State(envd): State<Envd>, headers: HeaderMap, Query(q): Query<HashMap<String, String>>) -> Response {
    match envd.sandbox(&headers).await {
        Ok(record) => files::download(&envd.host.home(&record.id), q.get("path").map(String::as_str)).await,
        Err(err) => files::rest_from_rpc(err),
    }
}

/// An upload: the body is read first, then the files are written while the sandbox's files
/// are held, so a pause waits for the write (never for a slow client) and a pause under way
/// turns the upload away rather than letting it write into a frozen sandbox.
async fn upload(State(envd): State<Envd>, Query(q): Query<HashMap<String, String>>, request: Request) -> Response {
    let record = match envd.sandbox(request.headers()).await {
        Ok(record) => record,
        Err(err) => return files::rest_from_rpc(err),
    };
    let headers = request.headers().clone();
    let home = envd.host.home(&record.id);
    let path = q.get("path").map(String::as_str);
    let multipart = request
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("multipart/form-data"));
    /// What the request carried, read in full before anything is written.
    enum Body {
        Parts(Vec<files::Part>),
        Raw(Bytes),
    }
    let body = if multipart {
        match axum::extract::Multipart::from_request(request, &()).await {
            Ok(multipart) => match files::read_parts(multipart).await {
                Ok(parts) => Body::Parts(parts),
                Err(response) => return response,
            },
            Err(e) => return files::rest_error(StatusCode::BAD_REQUEST, e.body_text()),
        }
    } else {
        match Bytes::from_request(request, &()).await {
            Ok(bytes) => Body::Raw(bytes),
            Err(e) => return files::rest_error(StatusCode::BAD_REQUEST, e.body_text()),
        }
    };
    let _access = match envd.files_of(&headers).await {
        Ok(access) => access,
        Err(err) => return files::rest_from_rpc(err),
    };
    match body {
        Body::Parts(parts) => files::upload_parts(&home, path, parts).await,
        Body::Raw(bytes) => files::upload_raw(&home, path, bytes).await,
    }
}

/// `process.Process/StreamInput` (client streaming): a `start` naming the process, then input
/// written to it as each message arrives, until the client ends the request.
async fn stream_input(State(envd): State<Envd>, headers: HeaderMap, body: axum::body::Body) -> Response {
    let record = match envd.sandbox(&headers).await {
        Ok(record) => record,
        Err(err) => return err.into_response(),
    };
    let mut messages = connect::Envelopes::new(body.into_data_stream());
    let fed = async {
        let process = match messages.next::<wire::StreamInputRequest>().await {
            Some(Ok(wire::StreamInputRequest::Start { process })) => process,
            Some(Ok(_)) | None => {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    "the stream must begin with `start`",
                ));
            }
            Some(Err(err)) => return Err(err),
        };
        while let Some(message) = messages.next::<wire::StreamInputRequest>().await {
            match message? {
                wire::StreamInputRequest::Data { input } => {
                    let data = input.stdin.or(input.pty).unwrap_or_default();
                    envd.commands.send_input(&record.id, &process, &data).await?;
                }
                wire::StreamInputRequest::Keepalive {} => {}
                wire::StreamInputRequest::Start { .. } => {
                    return Err(RpcError::new(Code::InvalidArgument, "`start` may only come first"));
                }
            }
        }
        Ok(wire::Empty {})
    }
    .await;
    stream_response(futures::stream::iter([fed]))
}

async fn process_rpc(
    State(envd): State<Envd>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let record = match envd.sandbox(&headers).await {
        Ok(record) => record,
        Err(err) => return err.into_response(),
    };
    let commands = &envd.commands;
    let id = record.id.as_str();
    match method.as_str() {
        "Start" => {
            let started = async {
                let req = stream_request(&body)?;
                commands
                    .start(&record, &envd.host.home(id), envd.host.runtime(), req)
                    .await
            }
            .await;
            match started {
                Ok(events) => stream_response(events),
                Err(err) => stream_response(futures::stream::iter([Err::<wire::EventResponse, _>(err)])),
            }
        }
        "Connect" => {
            let connected = async {
                let req: wire::ConnectRequest = stream_request(&body)?;
                commands.connect(id, &req.process).await
            }
            .await;
            match connected {
                Ok(events) => stream_response(events),
                Err(err) => stream_response(futures::stream::iter([Err::<wire::EventResponse, _>(err)])),
            }
        }
        "List" => unary_response(Ok::<_, RpcError>(commands.list(id).await)),
        "SendInput" => unary_response(
            async {
                let req: wire::SendInputRequest = unary_request(&body)?;
                let data = req.input.stdin.or(req.input.pty).unwrap_or_default();
                commands.send_input(id, &req.process, &data).await?;
                Ok(wire::Empty {})
            }
            .await,
        ),
        "SendSignal" => unary_response(
            async {
                let req: wire::SendSignalRequest = unary_request(&body)?;
                commands.signal(id, &req.process, &req.signal).await?;
                Ok(wire::Empty {})
            }
            .await,
        ),
        "CloseStdin" => unary_response(
            async {
                let req: wire::SelectorOnly = unary_request(&body)?;
                commands.close_stdin(id, &req.process).await?;
                Ok(wire::Empty {})
            }
            .await,
        ),
        "Update" => unary_response(
            async {
                let req: wire::UpdateRequest = unary_request(&body)?;
                if let Some(pty) = &req.pty {
                    commands.resize(id, &req.process, pty).await?;
                }
                Ok(wire::Empty {})
            }
            .await,
        ),
        other => RpcError::new(
            Code::Unimplemented,
            format!("process.Process/{other} is not implemented"),
        )
        .into_response(),
    }
}

async fn filesystem_rpc(
    State(envd): State<Envd>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let record = match envd.sandbox(&headers).await {
        Ok(record) => record,
        Err(err) => return err.into_response(),
    };
    // Changes to the files are held against a pause, as uploads are (streams are not: a
    // watch may last for ever).
    let _access = match method.as_str() {
        "MakeDir" | "Move" | "Remove" => match envd.files_of(&headers).await {
            Ok(access) => Some(access),
            Err(err) => return err.into_response(),
        },
        _ => None,
    };
    let home = envd.host.home(&record.id);
    match method.as_str() {
        "Stat" => unary_response(unary_request(&body).and_then(|r| filesystem::stat(&home, r))),
        "MakeDir" => unary_response(unary_request(&body).and_then(|r| filesystem::make_dir(&home, r))),
        "Move" => unary_response(unary_request(&body).and_then(|r| filesystem::rename(&home, r))),
        "ListDir" => unary_response(unary_request(&body).and_then(|r| filesystem::list_dir(&home, r))),
        "Remove" => unary_response(unary_request(&body).and_then(|r| filesystem::remove(&home, r))),
        "CreateWatcher" => unary_response(unary_request(&body).and_then(|r: wire::WatchRequest| {
            let dir = paths::resolve(&home, &r.path)?;
            let watcher_id = envd.watchers.create(&record.id, &dir, r.recursive)?;
            Ok(serde_json::json!({ "watcherId": watcher_id }))
        })),
        "GetWatcherEvents" => unary_response(unary_request(&body).and_then(|r: wire::WatcherRef| {
            let events = envd.watchers.take(&record.id, &r.watcher_id)?;
            Ok(serde_json::json!({ "events": events }))
        })),
        "RemoveWatcher" => unary_response(unary_request(&body).and_then(|r: wire::WatcherRef| {
            envd.watchers.remove(&record.id, &r.watcher_id)?;
            Ok(wire::Empty {})
        })),
        "WatchDir" => {
            let watching = stream_request(&body).and_then(|r: wire::WatchRequest| {
                let dir = paths::resolve(&home, &r.path)?;
                watch::stream(&dir, r.recursive)
            });
            match watching {
                Ok((watcher, events)) => {
                    let start = futures::stream::iter([Ok(serde_json::json!({"start": {}}))]);
                    let follow = tokio_stream::wrappers::UnboundedReceiverStream::new(events).map(move |e| {
                        // The watcher lives as long as the stream is read.
                        let _keep = &watcher;
                        Ok(serde_json::json!({ "filesystem": e }))
                    });
                    stream_response(start.chain(follow))
                }
                Err(err) => stream_response(futures::stream::iter([Err::<serde_json::Value, _>(err)])),
            }
        }
        other => RpcError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{other} is not implemented"),
        )
        .into_response(),
    }
}
