//! The routes envd serves, for the one sandbox it runs in:
//!
//! - `process.Process` over Connect (Start, with pipes or a terminal, Connect, List,
//!   SendInput, StreamInput, SendSignal, CloseStdin, Update to resize a terminal);
//! - `filesystem.Filesystem` over Connect (Stat, MakeDir, Move, ListDir, Remove, WatchDir,
//!   CreateWatcher, GetWatcherEvents, RemoveWatcher);
//! - `GET /files`, `POST /files`, `GET /envs`, `GET /health`;
//! - `POST /init` (E2B's, for the node alone: the node never forwards it from outside): env
//!   vars added to every later command's, as when a pooled sandbox is claimed.
//!
//! No route checks an access token: envd listens only on a socket the node opened and handed
//! in, which nothing inside the sandbox can connect to by a path and nothing outside reaches
//! but the node, and the node checks the sandbox's token (and holds file changes against a
//! pause) before it forwards a request.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt;

use crate::connect::{self, stream_request, stream_response, unary_request, unary_response, Code, RpcError};
use crate::paths::{OwnedScope, Scope};
use crate::process::{Commands, Enclose, SandboxEnv};
use crate::users::{User, Users};
use crate::{files, filesystem, watch, wire};

/// What every handler needs.
#[derive(Clone)]
pub struct Envd {
    /// Replaced whole by `/init` (a claim's env vars); each command takes the one current
    /// when it starts.
    sandbox: Arc<std::sync::RwLock<Arc<SandboxEnv>>>,
    users: Arc<Users>,
    commands: Arc<Commands>,
    watchers: Arc<watch::Watchers>,
    hosted: Option<Arc<Hosted>>,
}

/// envd hosted by the node for a sandbox of its unisolated process runtime, rather than
/// running inside the sandbox: paths are confined to the sandbox's home folder and commands
/// are put into the sandbox by `enclose` (see [`crate::paths`]).
pub struct Hosted {
    pub home: std::path::PathBuf,
    pub enclose: Enclose,
}

impl Envd {
    /// envd inside its sandbox.
    pub fn new(sandbox: SandboxEnv, users: Users) -> Self {
        Self {
            sandbox: Arc::new(std::sync::RwLock::new(Arc::new(sandbox))),
            users: Arc::new(users),
            commands: Arc::new(Commands::default()),
            watchers: Arc::new(watch::Watchers::default()),
            hosted: None,
        }
    }

    /// envd hosted by the node for one sandbox; every request acts as the node's own user.
    pub fn hosted(sandbox: SandboxEnv, hosted: Hosted) -> Self {
        let users = Users::new("/nonexistent", Some(hosted.home.clone()));
        Self {
            hosted: Some(Arc::new(hosted)),
            ..Self::new(sandbox, users)
        }
    }

    /// The HTTP routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/health", get(health))
            .route("/envs", get(envs))
            .route("/init", post(init))
            .route("/files", get(download).post(upload))
            .route("/process.Process/StreamInput", post(stream_input))
            .route("/process.Process/{method}", post(process_rpc))
            .route("/filesystem.Filesystem/{method}", post(filesystem_rpc))
            // Uploads stream to disk as they arrive, whatever their size: no body limit.
            .layer(axum::extract::DefaultBodyLimit::disable())
            .with_state(self)
    }

    /// The user a request acts as (`Authorization: Basic`, or `username` for `/files`), or
    /// the default user; hosted, always the node's own.
    fn user(&self, headers: &HeaderMap, query_user: Option<&str>) -> Result<User, RpcError> {
        match &self.hosted {
            Some(_) => self.users.lookup(self.users.default_user()),
            None => self.users.of_request(headers, query_user),
        }
    }

    /// The user a `/files` request acts as (see [`Users::of_file_request`]); hosted, always
    /// the node's own.
    fn file_user(&self, headers: &HeaderMap, query: &HashMap<String, String>) -> Result<User, RpcError> {
        match &self.hosted {
            Some(_) => self.users.lookup(self.users.default_user()),
            None => self.users.of_file_request(
                headers,
                query.get("username").map(String::as_str),
                query.contains_key("signature"),
            ),
        }
    }

    /// The sandbox's env as it is now (a poisoned lock still holds a whole value: it is only
    /// ever replaced, never edited in place).
    fn sandbox(&self) -> Arc<SandboxEnv> {
        match self.sandbox.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn scope<'a>(&'a self, user: &'a User) -> Scope<'a> {
        Scope {
            user,
            users: &self.users,
            hosted_home: self.hosted.as_deref().map(|h| h.home.as_path()),
        }
    }
}

async fn health() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

async fn envs(State(envd): State<Envd>) -> Response {
    axum::Json(envd.sandbox().vars.clone()).into_response()
}

/// E2B's `/init` body; of it this envd takes the env vars (the node checks tokens, and the
/// sandbox's clock is the host's).
#[derive(serde::Deserialize)]
struct Init {
    #[serde(rename = "envVars", default)]
    env_vars: std::collections::BTreeMap<String, String>,
}

/// `POST /init`: adds the body's env vars over the sandbox's (E2B's envd merges them too).
async fn init(State(envd): State<Envd>, body: Bytes) -> Response {
    let init: Init = match serde_json::from_slice(&body) {
        Ok(init) => init,
        Err(err) => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(serde_json::json!({"code": 400, "message": format!("invalid /init body: {err}")})),
            )
                .into_response()
        }
    };
    let mut next = (*envd.sandbox()).clone();
    next.vars.extend(init.env_vars);
    match envd.sandbox.write() {
        Ok(mut current) => *current = Arc::new(next),
        Err(poisoned) => *poisoned.into_inner() = Arc::new(next),
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn download(State(envd): State<Envd>, headers: HeaderMap, Query(q): Query<HashMap<String, String>>) -> Response {
    match envd.file_user(&headers, &q) {
        Ok(user) => files::download(&envd.scope(&user), q.get("path").map(String::as_str)).await,
        Err(err) => files::rest_from_rpc(err),
    }
}

async fn upload(State(envd): State<Envd>, Query(q): Query<HashMap<String, String>>, request: Request) -> Response {
    match envd.file_user(request.headers(), &q) {
        Ok(user) => files::upload(&envd.scope(&user), q.get("path").map(String::as_str), request).await,
        Err(err) => files::rest_from_rpc(err),
    }
}

/// `process.Process/StreamInput` (client streaming): a `start` naming the process, then input
/// written to it as each message arrives, until the client ends the request.
async fn stream_input(State(envd): State<Envd>, body: axum::body::Body) -> Response {
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
                    envd.commands.send_input(&process, &data).await?;
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
    let commands = &envd.commands;
    match method.as_str() {
        "Start" => {
            let started = async {
                let req = stream_request(&body)?;
                let user = envd.user(&headers, None)?;
                let enclose = envd.hosted.as_ref().map(|h| &h.enclose);
                commands.start(&envd.sandbox(), &envd.scope(&user), enclose, req).await
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
                commands.connect(&req.process).await
            }
            .await;
            match connected {
                Ok(events) => stream_response(events),
                Err(err) => stream_response(futures::stream::iter([Err::<wire::EventResponse, _>(err)])),
            }
        }
        "List" => unary_response(Ok::<_, RpcError>(commands.list().await)),
        "SendInput" => unary_response(
            async {
                let req: wire::SendInputRequest = unary_request(&body)?;
                let data = req.input.stdin.or(req.input.pty).unwrap_or_default();
                commands.send_input(&req.process, &data).await?;
                Ok(wire::Empty {})
            }
            .await,
        ),
        "SendSignal" => unary_response(
            async {
                let req: wire::SendSignalRequest = unary_request(&body)?;
                commands.signal(&req.process, &req.signal).await?;
                Ok(wire::Empty {})
            }
            .await,
        ),
        "CloseStdin" => unary_response(
            async {
                let req: wire::SelectorOnly = unary_request(&body)?;
                commands.close_stdin(&req.process).await?;
                Ok(wire::Empty {})
            }
            .await,
        ),
        "Update" => unary_response(
            async {
                let req: wire::UpdateRequest = unary_request(&body)?;
                if let Some(pty) = &req.pty {
                    commands.resize(&req.process, pty).await?;
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

/// Runs `call` on the blocking pool with an owned copy of `scope`: a deep listing, the removal
/// of a large tree or a recursive watch takes as long as the disk does, and envd's one serving
/// thread must go on answering everything else meanwhile.
async fn off_thread<T: Send + 'static>(
    scope: &Scope<'_>,
    call: impl FnOnce(&OwnedScope) -> Result<T, RpcError> + Send + 'static,
) -> Result<T, RpcError> {
    let owned = OwnedScope::of(scope);
    tokio::task::spawn_blocking(move || call(&owned))
        .await
        .unwrap_or_else(|e| Err(RpcError::new(Code::Internal, format!("filesystem call failed: {e}"))))
}

/// A unary filesystem call, run [`off_thread`].
async fn on_disk<Req, Res>(
    scope: &Scope<'_>,
    body: &Bytes,
    call: impl FnOnce(&Scope<'_>, Req) -> Result<Res, RpcError> + Send + 'static,
) -> Response
where
    Req: serde::de::DeserializeOwned + Send + 'static,
    Res: serde::Serialize + Send + 'static,
{
    let request = match unary_request(body) {
        Ok(request) => request,
        Err(err) => return err.into_response(),
    };
    unary_response(off_thread(scope, move |owned| call(&owned.scope(), request)).await)
}

async fn filesystem_rpc(
    State(envd): State<Envd>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let user = match envd.user(&headers, None) {
        Ok(user) => user,
        Err(err) => return err.into_response(),
    };
    let scope = envd.scope(&user);
    match method.as_str() {
        "Stat" => on_disk(&scope, &body, filesystem::stat).await,
        "MakeDir" => on_disk(&scope, &body, filesystem::make_dir).await,
        "Move" => on_disk(&scope, &body, filesystem::rename).await,
        "ListDir" => on_disk(&scope, &body, filesystem::list_dir).await,
        "Remove" => on_disk(&scope, &body, filesystem::remove).await,
        "CreateWatcher" => {
            let watchers = envd.watchers.clone();
            let create = move |scope: &Scope<'_>, r: wire::WatchRequest| {
                let dir = scope.resolve(&r.path)?;
                let entries = r.include_entry.then(|| OwnedScope::of(scope));
                let watcher_id = watchers.create(&dir, r.recursive, entries)?;
                Ok(serde_json::json!({ "watcherId": watcher_id }))
            };
            on_disk(&scope, &body, create).await
        }
        "GetWatcherEvents" => unary_response(unary_request(&body).and_then(|r: wire::WatcherRef| {
            let events = envd.watchers.take(&r.watcher_id)?;
            Ok(serde_json::json!({ "events": events }))
        })),
        "RemoveWatcher" => unary_response(unary_request(&body).and_then(|r: wire::WatcherRef| {
            envd.watchers.remove(&r.watcher_id)?;
            Ok(wire::Empty {})
        })),
        "WatchDir" => {
            let watching = match stream_request::<wire::WatchRequest>(&body) {
                Ok(r) => {
                    off_thread(&scope, move |owned| {
                        let dir = owned.scope().resolve(&r.path)?;
                        watch::stream(&dir, r.recursive, r.include_entry.then(|| owned.clone()))
                    })
                    .await
                }
                Err(err) => Err(err),
            };
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
