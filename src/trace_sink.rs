//! `sandboxsched trace-sink`: an OTLP trace receiver (gRPC) that prints one line per span it
//! is sent: `span service=<service.name> name=<span name> trace=<trace ID>`. A stand-in for
//! Jaeger where none can be pulled (compose.ci.yaml), and a quick look at what the services
//! export without running a tracing backend.

use std::io::Write;
use std::net::SocketAddr;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;

#[derive(clap::Args, Debug)]
pub struct TraceSinkArgs {
    /// Where OTLP/gRPC exports are received (services' OTEL_EXPORTER_OTLP_ENDPOINT).
    #[arg(long, default_value = "127.0.0.1:4317")]
    listen: SocketAddr,
}

struct Printer;

fn service_name(resource: Option<&opentelemetry_proto::tonic::resource::v1::Resource>) -> String {
    resource
        .into_iter()
        .flat_map(|r| &r.attributes)
        .find(|kv| kv.key == "service.name")
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .map_or_else(
            || "unknown".to_string(),
            |v| match v {
                Value::StringValue(s) => s.clone(),
                other => format!("{other:?}"),
            },
        )
}

#[tonic::async_trait]
impl TraceService for Printer {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = std::io::stdout().lock();
        for resource in request.into_inner().resource_spans {
            let service = service_name(resource.resource.as_ref());
            for span in resource.scope_spans.iter().flat_map(|s| &s.spans) {
                let trace: String = span.trace_id.iter().map(|b| format!("{b:02x}")).collect();
                let _ = writeln!(out, "span service={service} name={} trace={trace}", span.name);
            }
        }
        let _ = out.flush();
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

pub async fn run(args: TraceSinkArgs) -> anyhow::Result<()> {
    println!("receiving OTLP traces on {}", args.listen);
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(Printer))
        .serve_with_shutdown(args.listen, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
