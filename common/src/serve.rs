//! One way for every service to start and stop: bind a port (port 0 picks a free one and the
//! bound address is read back, never guessed), serve gRPC with the standard health service,
//! W3C trace context continued into a span per call and `TCP_NODELAY` on every connection,
//! serve HTTP routers beside it, run background tasks, and stop all of it on one signal.
//!
//! A service builds a [`Grpc`] with its own services, hands it with a [`Listener`] to
//! [`Serving::grpc`], and keeps the [`Serving`] to stop later:
//!
//! ```no_run
//! # async fn demo<S>(api: S) -> Result<(), common::serve::BindError>
//! # where S: tonic::server::NamedService + Clone + Send + Sync + 'static
//! #     + tower::Service<http::Request<tonic::body::Body>, Error = std::convert::Infallible>,
//! #   S::Response: axum::response::IntoResponse, S::Future: Send + 'static {
//! use common::serve::{Grpc, Listener, Serving};
//! let listener = Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let mut serving = Serving::new();
//! serving.grpc("my-svc", listener, Grpc::new().service(api).await);
//! // ... later
//! serving.stop().await;
//! # Ok(()) }
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::server::NamedService;
use tonic_health::server::HealthReporter;

/// How long a draining server may finish in-flight calls once stopped before it is aborted.
/// Long streams (watches, terminals) would otherwise hold a stop forever.
pub const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// A port could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr}: {source}")]
pub struct BindError {
    pub addr: SocketAddr,
    #[source]
    pub source: std::io::Error,
}

/// A bound port, not yet served.
pub struct Listener {
    listener: TcpListener,
    addr: SocketAddr,
}

impl Listener {
    pub async fn bind(addr: SocketAddr) -> Result<Self, BindError> {
        let (listener, bound) = crate::net::bind(addr)
            .await
            .map_err(|source| BindError { addr, source })?;
        Ok(Self { listener, addr: bound })
    }

    /// The address actually bound (the port is known even when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// The gRPC services of one listener, with `grpc.health.v1.Health` always among them.
pub struct Grpc {
    routes: tonic::service::RoutesBuilder,
    health: HealthReporter,
    stream_window: Option<u32>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    authorize: Option<mtls::Authorize>,
}

impl Default for Grpc {
    fn default() -> Self {
        Self::new()
    }
}

impl Grpc {
    pub fn new() -> Self {
        let (health, health_service) = tonic_health::server::health_reporter();
        let mut routes = tonic::service::RoutesBuilder::default();
        routes.add_service(health_service);
        Self {
            routes,
            health,
            stream_window: None,
            tls: None,
            authorize: None,
        }
    }

    /// Serves with `security`: under mutual TLS every connection must present a certificate
    /// of the cluster, and every call is held to `policies` (one per gRPC service served;
    /// a method no policy names is refused). Plaintext serves everyone: tests of one service.
    pub fn secure(mut self, security: &mtls::Security, policies: &[mtls::Policy]) -> Result<Self, mtls::TlsError> {
        if let Some(tls) = security.server() {
            // Built once here so a bad certificate or key fails the start, not the serving.
            tonic::transport::Server::builder()
                .tls_config(tls.clone())
                .map_err(|e| mtls::TlsError::Config(e.to_string()))?;
            self.tls = Some(tls);
            self.authorize = Some(mtls::Authorize::new(policies.to_vec()));
        }
        Ok(self)
    }

    /// Adds a service and reports it `SERVING` (a service whose readiness changes later
    /// updates it through [`Grpc::health`]).
    pub async fn service<S>(mut self, service: S) -> Self
    where
        S: tower::Service<http::Request<tonic::body::Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.health.set_serving::<S>().await;
        self.routes.add_service(service);
        self
    }

    /// The health reporter of these services.
    pub fn health(&self) -> HealthReporter {
        self.health.clone()
    }

    /// HTTP/2 flow-control window per stream (the connection gets twice as much): for
    /// services that stream hundreds of megabytes, which the 64 KiB default would stall on
    /// every window update.
    pub fn stream_window(mut self, bytes: u32) -> Self {
        self.stream_window = Some(bytes);
        self
    }
}

/// What stopping does to an HTTP server's open connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnStop {
    /// Stop accepting, let open requests finish (up to [`DRAIN_GRACE`]).
    Drain,
    /// Drop everything at once: for endpoints whose requests are long streams nobody waits on.
    Abort,
}

struct Server {
    name: &'static str,
    task: JoinHandle<()>,
    on_stop: OnStop,
}

/// Everything a running service has started: its servers and background tasks, stopped
/// together by [`Serving::stop`].
pub struct Serving {
    stop: watch::Sender<bool>,
    servers: Vec<Server>,
    background: Vec<JoinHandle<()>>,
}

impl Default for Serving {
    fn default() -> Self {
        Self::new()
    }
}

impl Serving {
    pub fn new() -> Self {
        Self {
            stop: watch::channel(false).0,
            servers: Vec::new(),
            background: Vec::new(),
        }
    }

    /// Becomes `true` when the service is told to stop: for loops and streams that should end
    /// by themselves rather than be aborted.
    pub fn stopping(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// Serves `grpc` on `listener` until stopped (in-flight calls drain).
    pub fn grpc(&mut self, name: &'static str, listener: Listener, grpc: Grpc) {
        let mut builder = tonic::transport::Server::builder().trace_fn(crate::trace::grpc_span);
        if let Some(window) = grpc.stream_window {
            builder = builder
                .initial_stream_window_size(Some(window))
                .initial_connection_window_size(Some(window.saturating_mul(2)));
        }
        if let Some(tls) = grpc.tls {
            builder = match builder.tls_config(tls) {
                Ok(builder) => builder,
                // `Grpc::secure` built the same configuration already; this cannot fail.
                Err(err) => {
                    tracing::error!(server = name, %err, "TLS refused; not serving");
                    return;
                }
            };
        }
        let router = builder
            .layer(tower::util::option_layer(grpc.authorize))
            .add_routes(grpc.routes.routes());
        let mut stopped = self.stopping();
        let task = tokio::spawn(async move {
            let result = router
                .serve_with_incoming_shutdown(crate::net::grpc_incoming(listener.listener), async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                })
                .await;
            if let Err(err) = result {
                tracing::error!(server = name, %err, "gRPC server ended with an error");
            }
        });
        self.servers.push(Server {
            name,
            task,
            on_stop: OnStop::Drain,
        });
    }

    /// Serves an HTTP router (HTTP/1.1 and h2c) on `listener` until stopped.
    pub fn http(&mut self, name: &'static str, listener: Listener, router: axum::Router, on_stop: OnStop) {
        let mut stopped = self.stopping();
        let task = tokio::spawn(async move {
            use axum::serve::ListenerExt;
            // Small writes go out at once: a streamed answer (a command's start, then its end)
            // would otherwise wait out the client's delayed ACK behind Nagle's algorithm.
            let listener = listener.listener.tap_io(|tcp| {
                if let Err(err) = tcp.set_nodelay(true) {
                    tracing::debug!(%err, "TCP_NODELAY not set");
                }
            });
            let result = axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                })
                .await;
            if let Err(err) = result {
                tracing::error!(server = name, %err, "HTTP server ended with an error");
            }
        });
        self.servers.push(Server { name, task, on_stop });
    }

    /// Serves an HTTP router (HTTP/1.1 and h2, upgrades spliced) over mutual TLS on
    /// `listener` until stopped: every connection must complete a handshake with a client
    /// certificate of the cluster (`tls`, from [`mtls::Credentials::http_server`]) naming one
    /// of `callers`, or it is closed before a byte of HTTP is read.
    pub fn https(
        &mut self,
        name: &'static str,
        listener: Listener,
        router: axum::Router,
        tls: std::sync::Arc<tokio_rustls::rustls::ServerConfig>,
        callers: &'static [mtls::Role],
        on_stop: OnStop,
    ) {
        let mut stopped = self.stopping();
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        let task = tokio::spawn(async move {
            // Owned by this task: aborting it (OnStop::Abort) drops every connection with it.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let accepted = tokio::select! {
                    accepted = listener.listener.accept() => accepted,
                    _ = stopped.wait_for(|stop| *stop) => break,
                    Some(_) = connections.join_next(), if !connections.is_empty() => continue,
                };
                let (tcp, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(err) => {
                        // Out of descriptors, most likely: give the open ones a moment.
                        tracing::warn!(server = name, %err, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                if let Err(err) = tcp.set_nodelay(true) {
                    tracing::debug!(%err, "TCP_NODELAY not set");
                }
                connections.spawn(serve_tls(name, acceptor.clone(), tcp, peer, router.clone(), callers));
            }
            while connections.join_next().await.is_some() {}
        });
        self.servers.push(Server { name, task, on_stop });
    }

    /// A task that lives as long as the service and is aborted when it stops.
    pub fn background(&mut self, task: JoinHandle<()>) {
        self.background.push(task);
    }

    /// Stops accepting, drains or aborts each server as it asked, then aborts background
    /// tasks (after the servers: draining calls may still need them, a ledger's committer for
    /// one).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for mut server in self.servers {
            if server.on_stop == OnStop::Abort {
                server.task.abort();
            }
            match tokio::time::timeout(DRAIN_GRACE, &mut server.task).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) if err.is_cancelled() => {}
                Ok(Err(err)) => tracing::warn!(server = server.name, %err, "server task failed"),
                Err(_) => {
                    tracing::warn!(server = server.name, grace = ?DRAIN_GRACE, "open calls outlived the grace period; aborted");
                    server.task.abort();
                }
            }
        }
        for task in &self.background {
            task.abort();
        }
    }
}

/// How long a client may take over its TLS handshake before it is dropped.
const TLS_HANDSHAKE: Duration = Duration::from_secs(10);

/// One connection of [`Serving::https`]: the handshake, the caller's role, then HTTP.
async fn serve_tls(
    name: &'static str,
    acceptor: tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    router: axum::Router,
    callers: &'static [mtls::Role],
) {
    let tls = match tokio::time::timeout(TLS_HANDSHAKE, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(err)) => {
            tracing::info!(server = name, %peer, %err, "TLS handshake refused");
            return;
        }
        Err(_) => {
            tracing::info!(server = name, %peer, "TLS handshake timed out");
            return;
        }
    };
    let role = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .and_then(mtls::authorize::role_of);
    if !role.is_some_and(|role| callers.contains(&role)) {
        tracing::warn!(server = name, %peer, ?role, "connection refused: not a caller of this server");
        return;
    }
    let service = hyper_util::service::TowerToHyperService::new(router);
    let builder = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    if let Err(err) = builder
        .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(tls), service)
        .await
    {
        tracing::debug!(server = name, %peer, %err, "connection ended with an error");
    }
}
