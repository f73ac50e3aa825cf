//! Starting and stopping the gateway: REST API and envd proxy on one port, told apart by the
//! `E2b-Sandbox-Id` header, plus the reaper.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use common::serve::{BindError, Listener, OnStop, Serving};
use tower::ServiceExt;

use crate::api::{self, Gateway};
use crate::intent::Template;
use crate::proxy::{self, Proxy};
use crate::sandboxes::Sandboxes;
use crate::templates::build::Builder;
use crate::templates::files::Files;
use crate::templates::Templates;

/// How the gateway runs.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    pub ledger: String,
    pub placement: String,
    /// API key → team.
    pub keys: HashMap<String, String>,
    /// Templates the registry is seeded with besides `base` (names with fixed resources over
    /// the base image: the `--templates` file).
    pub templates: Vec<Template>,
    /// The cluster's blob store (`blobs::from_url`): COPY archives, layers.
    pub blob_store: String,
    /// How often the reaper looks for sandboxes whose time is up.
    pub reap_interval: Duration,
    /// Where hibernated sandboxes' snapshots are spooled on their way to and from the blob
    /// store (pause with `memory: false`).
    pub hibernate_dir: std::path::PathBuf,
    /// Where template build uploads (COPY archives) are spooled on their way to the blob
    /// store: the gateway's own folder (see `spool`).
    pub upload_dir: std::path::PathBuf,
    /// How many sandboxes one team may hold at once (running, paused or being created);
    /// 0: no limit. Past it a create is answered 429.
    pub max_sandboxes_per_team: u32,
    /// Sandboxes' ports are addressed as `{port}-{sandboxID}.{domain}` (the SDK's `get_host`);
    /// empty: only by headers. A domain ending in `:0` gets the port the gateway is bound to.
    pub domain: String,
    /// How long a paused sandbox is kept (it does not time out while paused) before the
    /// reaper kills it.
    pub paused_retention: Duration,
    /// Each sandbox's disk (E2B's `diskSizeMB`).
    pub sandbox_disk_bytes: u64,
    /// How long a create may stay unfinished (its manifest `creating`) before the reaper
    /// resolves it against the nodes: its gateway is taken to have stopped mid-way.
    pub abandoned_create_after: Duration,
    /// How long a user operation's claim on a sandbox holds before another operation (or the
    /// reaper) may take it over.
    pub claim_ttl: Duration,
    /// How the gateway proves itself to the ledger, placement and the nodes: mutual TLS with
    /// the cluster's certificates (every binary), or plaintext for a test.
    pub security: mtls::Security,
    /// The cluster's token key: sandboxes' access tokens are derived from it and the seal
    /// each manifest keeps. Every gateway of a cluster must have the same one.
    pub token_key: envd_wire::sealed::TokenKey,
    /// The operators' token for E2B's admin routes (`GET /nodes`, `X-Admin-Token`); none:
    /// those routes answer 403 to everyone.
    pub admin_token: Option<String>,
    /// Whether this gateway keeps E2B's `code-interpreter-v1` built (the cluster builds it
    /// from `base` once a node is there; see `templates::code_interpreter`).
    pub code_interpreter: bool,
}

/// Paused sandboxes are kept this long unless configured otherwise: 30 days.
pub const DEFAULT_PAUSED_RETENTION: Duration = Duration::from_secs(30 * 24 * 3600);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Bind(#[from] BindError),
}

pub struct RunningGateway {
    addr: SocketAddr,
    code_interpreter: tokio::sync::watch::Receiver<crate::templates::code_interpreter::Availability>,
    serving: Serving,
}

impl RunningGateway {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Where `code-interpreter-v1` stands (`Off` unless configured).
    pub fn code_interpreter(&self) -> tokio::sync::watch::Receiver<crate::templates::code_interpreter::Availability> {
        self.code_interpreter.clone()
    }

    pub async fn stop(self) {
        self.serving.stop().await;
    }
}

#[derive(Clone)]
struct Dispatch {
    api: Router,
    proxy: Proxy,
    domain: Arc<str>,
}

/// Traffic for a sandbox (it carries `E2b-Sandbox-Id`, or its host names a sandbox's port)
/// goes to the proxy; everything else is the API.
async fn dispatch(State(d): State<Dispatch>, request: Request) -> Response {
    let started = std::time::Instant::now();
    let method = request.method().to_string();
    let (kind, response) = match proxy::target_of(request.headers(), &d.domain) {
        Some(Ok(target)) => ("envd", proxy::forward(State(d.proxy), target, request).await),
        Some(Err(bad)) => (
            "envd",
            api::ApiError::new(axum::http::StatusCode::BAD_REQUEST, bad.0).into_response(),
        ),
        None => {
            let response = match d.api.oneshot(request).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            ("api", response)
        }
    };
    let status = response.status().as_u16().to_string();
    metrics::counter!("gateway_http_requests_total", "kind" => kind, "method" => method.clone(), "status" => status)
        .increment(1);
    metrics::histogram!("gateway_http_request_duration_seconds", "kind" => kind, "method" => method)
        .record(started.elapsed().as_secs_f64());
    response
}

pub async fn start(config: GatewayConfig) -> Result<RunningGateway, StartError> {
    if config.keys.is_empty() {
        return Err(StartError::Config("at least one API key is needed".into()));
    }
    let listener = Listener::bind(config.listen).await?;
    let addr = listener.addr();
    let domain: Arc<str> = match config.domain.strip_suffix(":0") {
        Some(host) => format!("{host}:{}", addr.port()).into(),
        None => config.domain.as_str().into(),
    };
    let ledger = ledger_client::LedgerClient::connect_lazy(&config.ledger, &config.security)
        .map_err(|e| StartError::Config(e.to_string()))?;
    let store = blobs::from_url(&config.blob_store).map_err(|e| StartError::Config(format!("blob store: {e}")))?;
    let sandboxes = Sandboxes::new(
        ledger.clone(),
        &config.placement,
        &config.security,
        crate::tokens::Tokens::new(config.token_key.clone()),
        config.hibernate_dir.clone(),
        store.clone(),
        crate::sandboxes::Patience {
            paused_retention: config.paused_retention,
            abandoned_create_after: config.abandoned_create_after,
            claim_ttl: config.claim_ttl,
        },
    )
    .map(|s| {
        Arc::new(
            s.with_disk(config.sandbox_disk_bytes)
                .with_team_limit(config.max_sandboxes_per_team),
        )
    })
    .map_err(|e| StartError::Config(e.to_string()))?;
    // Checked now, not at the first upload or pause: a spool another user could read or
    // replace is a configuration error.
    for spool in [&config.upload_dir, &config.hibernate_dir] {
        crate::spool::private_dir(spool)
            .await
            .map_err(|e| StartError::Config(format!("spool {}: {e}", spool.display())))?;
    }
    let seed_names: Vec<String> = config.templates.iter().map(|t| t.name.clone()).collect();
    let templates = Templates::new(
        ledger.clone(),
        Files {
            store,
            spool: config.upload_dir.clone(),
        },
        &seed_names,
    );
    let seeds: Vec<_> = config
        .templates
        .iter()
        .map(|t| (t.name.clone(), t.vcpus, t.memory_mb))
        .collect();
    let seeding = templates.clone();
    let (interpreter_state, interpreter_watch) = crate::templates::code_interpreter::availability();
    let keeper = crate::pools::Keeper::new(ledger.clone(), sandboxes.clone(), templates.clone());
    let gateway = Gateway {
        pools: Arc::new(crate::pools::Pools::new(ledger.clone(), sandboxes.clone())),
        sandboxes: sandboxes.clone(),
        keys: Arc::new(config.keys.clone()),
        builder: Arc::new(Builder {
            templates: templates.clone(),
            sandboxes: sandboxes.clone(),
        }),
        templates,
        domain: domain.clone(),
        admin_token: config.admin_token.as_deref().map(Arc::from),
        admin_guesses: Arc::new(common::guesses::GuessGate::new("gateway admin token")),
        code_interpreter: interpreter_watch.clone(),
    };
    let interpreter_builder = gateway.builder.clone();
    let mut api_router = Router::new()
        .route("/health", get(api::health))
        .route("/openapi.yaml", get(api::openapi))
        .route("/sandboxes", get(api::list).post(api::create))
        .route("/v2/sandboxes", get(api::list).post(api::create))
        .route("/v2/sandboxes/{id}/connect", post(api::connect))
        .route("/sandboxes/metrics", get(api::list_metrics))
        .route("/sandboxes/{id}", get(api::get).delete(api::kill))
        .route("/sandboxes/{id}/pause", post(api::pause))
        .route("/sandboxes/{id}/resume", post(api::resume))
        .route("/sandboxes/{id}/connect", post(api::connect))
        .route("/sandboxes/{id}/timeout", post(api::set_timeout))
        .route("/sandboxes/{id}/network", axum::routing::put(api::update_network))
        .route("/sandboxes/{id}/refreshes", post(api::refresh))
        .route("/sandboxes/{id}/metrics", get(api::metrics))
        .route("/sandboxes/{id}/logs", get(api::logs))
        .route("/v2/sandboxes/{id}/logs", get(api::logs_v2))
        .route("/sandboxes/{id}/fork", post(api::fork))
        .route("/v2/sandboxes/{id}/fork", post(api::fork))
        .route("/sandboxes/{id}/snapshots", post(api::templates::snapshot))
        .route("/snapshots", get(api::templates::list_snapshots))
        .route("/nodes", get(api::nodes))
        .route("/nodes/{id}", get(api::node))
        .route("/v3/templates", post(api::templates::request_build))
        .route("/templates", get(api::templates::list).post(legacy_build))
        .route("/v2/templates", get(api::templates::list).post(legacy_build))
        .route(
            "/templates/tags",
            post(api::templates::assign_tags).delete(api::templates::remove_tags),
        )
        .route("/templates/aliases/{alias}", get(api::templates::alias))
        .route(
            "/templates/{id}",
            get(api::templates::get)
                .delete(api::templates::delete)
                .patch(api::templates::update)
                .post(legacy_build),
        )
        .route("/v2/templates/{id}", axum::routing::patch(api::templates::update))
        .route("/templates/{id}/tags", get(api::templates::tags))
        .route("/templates/{id}/pool", get(api::pools::get).put(api::pools::set))
        .route("/pools", get(api::pools::list))
        .route("/templates/{id}/files/{hash}", get(api::templates::file_link))
        .route(
            "/templates/{id}/files/{hash}/upload",
            axum::routing::put(api::templates::upload).layer(DefaultBodyLimit::disable()),
        )
        .route("/templates/{id}/builds/{build}", post(legacy_build))
        .route("/v2/templates/{id}/builds/{build}", post(api::templates::start_build))
        .route(
            "/templates/{id}/builds/{build}/status",
            get(api::templates::build_status),
        )
        .route("/templates/{id}/builds/{build}/logs", get(api::templates::build_logs));
    for (path, what) in api::UNSUPPORTED {
        api_router = api_router.route(path, axum::routing::any(move || async move { api::unsupported(what) }));
    }
    let api_router = api_router
        .route_layer(axum::middleware::from_fn(traced))
        .fallback(api::not_found)
        .layer(DefaultBodyLimit::max(api::MAX_BODY_BYTES))
        .layer(axum::middleware::map_response(api::e2b_shaped))
        .with_state(gateway);
    let routes = sandboxes.routes.clone();
    let app = Router::new().fallback(dispatch).with_state(Dispatch {
        api: api_router,
        proxy: Proxy {
            routes: routes.clone(),
            ledger: ledger.clone(),
            nodes: crate::node_http::NodeHttp::new(&config.security),
            sandboxes: sandboxes.clone(),
        },
        domain,
    });
    let mut serving = Serving::new();
    serving.background(routes.follow(ledger));
    // The registry's built-ins: written now, or (the ledger may be down) retried until the
    // ledger takes them.
    let seeded = seeding.seed(&seeds).await;
    serving.background(tokio::spawn(async move {
        let mut wait = Duration::from_millis(100);
        if seeded.is_ok() {
            return;
        }
        while let Err(err) = seeding.seed(&seeds).await {
            tracing::warn!(%err, "template registry not seeded yet; retrying");
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(5));
        }
    }));
    if config.code_interpreter {
        serving.background(tokio::spawn(crate::templates::code_interpreter::keep_built(
            interpreter_builder,
            interpreter_state,
        )));
    }
    serving.background(tokio::spawn(keeper.run()));
    let reaper = sandboxes.clone();
    let interval = config.reap_interval;
    serving.background(tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Old idempotency claims go about once a minute, not on every pass.
        let sweep_every = (Duration::from_secs(60).as_millis() / interval.as_millis().max(1)).max(1);
        let mut passes: u128 = 0;
        loop {
            tick.tick().await;
            passes += 1;
            if passes.is_multiple_of(sweep_every) {
                if let Err(err) = reaper.forget_old_claims().await {
                    tracing::debug!(%err, "idempotency sweep failed");
                }
            }
            match reaper.reap().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(ended = n, "reaper ended sandboxes whose time was up"),
                Err(err) => tracing::debug!(%err, "reaper pass failed"),
            }
        }
    }));
    serving.http("e2b-gateway", listener, app, OnStop::Drain);
    tracing::info!(%addr, "e2b-gateway serving");
    Ok(RunningGateway {
        addr,
        serving,
        code_interpreter: interpreter_watch,
    })
}

/// The builds of E2B's SDKs before 2.x (`POST /templates`, `/v2/templates`, rebuilds): this
/// cluster builds only as SDK 2.x asks.
async fn legacy_build() -> api::ApiError {
    api::ApiError::new(
        axum::http::StatusCode::NOT_IMPLEMENTED,
        "this template build API is not supported; use POST /v3/templates (E2B SDK 2.x)",
    )
}

/// Each REST call is a span named by its route, continuing the caller's `traceparent` (or
/// starting the trace): a create's ledger writes, placement decision and node call join it.
async fn traced(request: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    use tracing::Instrument;
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| request.uri().path().to_string(), |p| p.as_str().to_string());
    let span = common::trace::http_span(request.method(), &route, request.headers());
    let response = next.run(request).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    response
}
