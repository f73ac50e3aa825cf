//! Distributed tracing, checked at a real OTLP receiver: an in-test gRPC server implementing
//! the OTLP trace service, to which the services (here in this process, as the launcher runs
//! them) export.
//!
//! One create through the REST API is one trace: the gateway's request span, the placement
//! decision and the node's create, continued across gRPC hops by W3C context in metadata. A
//! balance move of that sandbox is a trace of its own whose root span links back to the
//! create's trace, and whose steps reach the nodes (snapshot, restore) in the move's trace.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use balance_svc::record::{PlanDoc, PLAN_KIND};
use common::docs::{SandboxDoc, SANDBOX_KIND};
use ledger_client::Txn;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio_stream::wrappers::TcpListenerStream;

/// Every span the receiver got.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            for scope in resource.scope_spans {
                spans.extend(scope.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Receiver {
    fn names_in_trace(&self, trace_id: &str) -> Vec<String> {
        let spans = self.spans.lock().unwrap();
        spans
            .iter()
            .filter(|s| hex(&s.trace_id) == trace_id)
            .map(|s| s.name.clone())
            .collect()
    }

    /// A string attribute of the span named `name` in `trace_id`.
    fn attribute(&self, trace_id: &str, name: &str, key: &str) -> Option<String> {
        use opentelemetry_proto::tonic::common::v1::any_value::Value;
        let spans = self.spans.lock().unwrap();
        let span = spans.iter().find(|s| hex(&s.trace_id) == trace_id && s.name == name)?;
        let kv = span.attributes.iter().find(|kv| kv.key == key)?;
        match kv.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            Value::DoubleValue(d) => Some(d.to_string()),
            other => Some(format!("{other:?}")),
        }
    }

    /// The trace ID of a `balance.move` span linked to `trace_id`.
    fn move_linked_to(&self, trace_id: &str) -> Option<String> {
        let spans = self.spans.lock().unwrap();
        spans
            .iter()
            .find(|s| s.name == "balance.move" && s.links.iter().any(|l| hex(&l.trace_id) == trace_id))
            .map(|s| hex(&s.trace_id))
    }
}

/// Polls `check` until it answers: the spans arrive when the exporter sends them, in batches.
async fn until<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    stack::until(what, Duration::from_secs(30), check).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_create_is_one_trace_and_its_move_links_back_to_it() {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(receiver.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    // The standard variables, as an operator sets them (this test binary holds only this test).
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{collector}"));
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    let telemetry = common::telemetry::init("sandboxsched-test");
    assert!(telemetry.exporting(), "the OTLP exporter was not installed");

    let stack = stack::Stack::builder()
        .nodes(2)
        .gateway(|_| {})
        .start()
        .await
        .expect("the test stack starts");
    let nodes: Vec<(String, &node_svc::server::RunningNode)> =
        stack.nodes.iter().map(|n| (n.id.clone(), &n.running)).collect();
    let gateway = stack.gateway.as_ref().expect("a gateway");
    let client = stack.ledger_client.clone();
    until("both nodes heard of", || async {
        let (docs, _) = client
            .list::<common::docs::NodeDoc>(common::docs::NODE_KIND, "")
            .await
            .ok()?;
        (docs.len() == 2).then_some(())
    })
    .await;

    // A create whose caller sent a traceparent (as an instrumented SDK would).
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let created = reqwest::Client::new()
        .post(format!("{}/sandboxes", gateway.url()))
        .header("X-API-Key", "key")
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .header("Content-Type", "application/json")
        .body(r#"{"templateID":"base","timeout":300}"#)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let created: serde_json::Value = serde_json::from_str(&created).unwrap();
    let sandbox_id = created["sandboxID"].as_str().unwrap().to_string();
    telemetry.flush().await;
    let names = until("the create's spans at the receiver", || async {
        let names = receiver.names_in_trace(trace_id);
        let has = |n: &str| names.iter().any(|x| x.contains(n));
        (has("POST /sandboxes") && has("Placement/Place") && has("placement.decide") && has("Node/Create"))
            .then_some(names)
    })
    .await;
    assert!(
        names.iter().any(|n| n.contains("Ledger/Compare")),
        "ledger writes join the trace: {names:?}"
    );
    // The decision carries its candidates and scores.
    let chosen = receiver
        .attribute(trace_id, "placement.decide", "node_id")
        .expect("the chosen node");
    let candidates = receiver
        .attribute(trace_id, "placement.decide", "candidates")
        .expect("the candidates");
    assert!(candidates.contains(&format!("{chosen}=")), "{candidates}");
    assert!(receiver.attribute(trace_id, "placement.decide", "score").is_some());

    // The manifest keeps the creation's context; a move of the sandbox links back to it.
    let manifest = client
        .get::<SandboxDoc>(SANDBOX_KIND, &sandbox_id)
        .await
        .unwrap()
        .unwrap()
        .value;
    let traceparent = manifest
        .trace_context
        .clone()
        .expect("the manifest keeps its creation context");
    assert!(traceparent.contains(trace_id), "{traceparent}");
    let from = nodes.iter().position(|(id, _)| *id == manifest.node_id).unwrap();
    let to = 1 - from;
    let plan = PlanDoc::one_move(
        "0000000000000-traced",
        &sandbox_id,
        (&nodes[from].0, &nodes[from].1.endpoint()),
        (&nodes[to].0, &nodes[to].1.endpoint()),
        manifest.memory_bytes,
    );
    client
        .compare(Txn::new().create(PLAN_KIND, &plan.plan_id, &plan).unwrap())
        .await
        .unwrap();
    let mut bconfig = balance_svc::server::BalanceConfig::new("127.0.0.1:0".parse().unwrap(), stack.ledger_endpoint());
    bconfig.security = stack.security(stack::Role::Balance);
    bconfig.tuning.interval = Duration::from_millis(100);
    bconfig.lease_ttl = Duration::from_secs(2);
    let balance = balance_svc::server::start(bconfig).await.unwrap();
    let moved = until("the move's trace, linked to the create", || async {
        receiver.move_linked_to(trace_id)
    })
    .await;
    assert_ne!(moved, trace_id, "a move is a trace of its own");
    let names = until("the move's steps at the receiver", || async {
        let names = receiver.names_in_trace(&moved);
        let has = |n: &str| names.iter().any(|x| x.contains(n));
        (has("balance.transfer") && has("Node/Snapshot") && has("Node/Restore") && has("balance.switch_route"))
            .then_some(names)
    })
    .await;
    assert!(names.iter().any(|n| n.contains("balance.pause")), "{names:?}");

    balance.stop().await;
    drop(nodes);
    stack.shut_down().await;
    telemetry.shutdown().await;
}
