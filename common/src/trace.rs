//! W3C trace context across every hop: REST headers and gRPC metadata in, gRPC metadata out,
//! and a sandbox manifest's `traceparent` so a later operation (a balance move) can link back to
//! the trace that created the sandbox.
//!
//! A client sends through a [`traced`] channel (an interceptor writes the calling span's
//! context into each call's metadata); a server builds each call's span with [`grpc_span`]
//! (tonic's `trace_fn`), a REST handler with [`http_span`]. With no exporter
//! installed, spans have no OpenTelemetry context and nothing is injected: tracing costs nothing
//! when it is off.

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{SpanContext, TraceContextExt};
use tonic::codegen::http;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// What [`traced`] wraps a channel with.
pub type Interceptor = fn(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status>;

/// A gRPC channel whose calls carry the calling span's trace context.
pub type TracedChannel = tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Interceptor>;

/// Wraps a channel so every call made through it continues the caller's trace.
pub fn traced(channel: tonic::transport::Channel) -> TracedChannel {
    tonic::service::interceptor::InterceptedService::new(channel, inject as Interceptor)
}

/// Writes the current span's context into a call's metadata. The interceptor runs when the
/// call is made, inside the caller's span.
fn inject(mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut MetadataInjector(request.metadata_mut()));
    });
    Ok(request)
}

/// The span of one inbound gRPC call, continuing the caller's trace (for tonic's `trace_fn`).
pub fn grpc_span(request: &http::Request<()>) -> tracing::Span {
    let path = request.uri().path();
    let span = tracing::info_span!("grpc", otel.name = %path.trim_start_matches('/'), otel.kind = "server", rpc.system = "grpc");
    continue_from(&span, request.headers());
    span
}

/// The span of one inbound REST request, continuing the caller's trace when it sent a
/// `traceparent` (the E2B SDK may), else starting one.
pub fn http_span(method: &http::Method, route: &str, headers: &http::HeaderMap) -> tracing::Span {
    let span = tracing::info_span!(
        "http",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
    );
    continue_from(&span, headers);
    span
}

fn continue_from(span: &tracing::Span, headers: &http::HeaderMap) {
    let parent = opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
}

/// The current span's W3C `traceparent`, to keep with a document (None when not tracing).
pub fn traceparent() -> Option<String> {
    let context = tracing::Span::current().context();
    let span = context.span();
    let sc = span.span_context();
    sc.is_valid()
        .then(|| format!("00-{}-{}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8()))
}

/// Adds a link from `span` to the span a stored `traceparent` names (a move to the creation
/// of the sandbox it moves).
pub fn link(span: &tracing::Span, traceparent: &str) {
    let mut headers = http::HeaderMap::new();
    if let Ok(value) = http::HeaderValue::from_str(traceparent) {
        headers.insert("traceparent", value);
    }
    let context = opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(&headers)));
    let linked: SpanContext = context.span().span_context().clone();
    if linked.is_valid() {
        span.add_link(linked);
    }
}
