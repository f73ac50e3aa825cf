//! Logging and tracing set-up shared by every binary.
//!
//! `RUST_LOG` picks what is logged (default `info`); `SANDBOXSCHED_LOG_FORMAT=json` switches
//! from human-readable text to one JSON object a line. Logs go to stderr, so what a command
//! prints for people or scripts stays alone on stdout.
//!
//! Traces: when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the standard OpenTelemetry variable;
//! `OTEL_SERVICE_NAME` overrides the service name, `OTEL_BSP_SCHEDULE_DELAY` the export delay),
//! spans are exported over OTLP/gRPC as well: those at `info` and above, whatever `RUST_LOG`
//! says, so quiet logs do not mean empty traces. W3C trace context is always propagated (see
//! [`crate::trace`]).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::{fmt, prelude::*, EnvFilter, Layer};

/// Keeps the trace exporter alive; [`Telemetry::shutdown`] flushes what is buffered.
#[derive(Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports buffered spans now (tests wait for them at a receiver).
    pub async fn flush(&self) {
        if let Some(provider) = self.provider.clone() {
            let _ = tokio::task::spawn_blocking(move || provider.force_flush()).await;
        }
    }

    /// Flushes and stops the exporter.
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        }
    }
}

/// Installs the global subscriber (and, with `OTEL_EXPORTER_OTLP_ENDPOINT`, the OTLP
/// exporter). Calling it twice (tests, the launcher) is harmless: the first call wins. Must be
/// called inside a Tokio runtime when exporting.
pub fn init(service: &'static str) -> Telemetry {
    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("SANDBOXSCHED_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let provider = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|e| !e.trim().is_empty())
        .and_then(|endpoint| match exporter(service) {
            Ok(provider) => Some(provider),
            Err(err) => {
                eprintln!("OTLP export to {endpoint} disabled: {err}");
                None
            }
        });
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer(service))
            .with_filter(LevelFilter::INFO)
    });
    let logs = if json {
        fmt::layer()
            .json()
            .with_current_span(true)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    } else {
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        fmt::layer()
            .with_target(false)
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    };
    let installed = tracing_subscriber::registry().with(logs).with(otel).try_init().is_ok();
    if !installed {
        // Another call installed the subscriber first; this exporter would receive nothing.
        if let Some(p) = provider {
            let _ = p.shutdown();
        }
        return Telemetry::default();
    }
    if provider.is_some() {
        tracing::info!(service, "exporting traces over OTLP");
    }
    Telemetry { provider }
}

fn exporter(service: &'static str) -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic().build()?;
    // Exports from a Tokio task (tonic needs the runtime's reactor, which the SDK's default
    // exporting thread lacks).
    let processor = opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
        exporter,
        opentelemetry_sdk::runtime::Tokio,
    )
    .build();
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_string());
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(opentelemetry_sdk::Resource::builder().with_service_name(name).build())
        .build())
}
