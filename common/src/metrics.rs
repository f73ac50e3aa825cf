//! Prometheus metrics: one recorder per process (the launcher's services share it), served as
//! text at `GET /metrics`. Names follow Prometheus conventions: units in the name, `_total` on
//! counters; `_seconds` histograms get latency buckets from 100 µs to 10 s.

use std::net::SocketAddr;
use std::sync::OnceLock;

use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::task::JoinHandle;

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

const LATENCY_BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0, 10.0,
];

/// How often histogram samples are folded into their buckets.
const UPKEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Installs the process's recorder (once) and returns its handle; `None` if another recorder
/// was installed first.
///
/// The recorder keeps every histogram sample until upkeep folds it into the buckets; a
/// recorder installed this way gets no upkeep of its own, so a thread runs it every five
/// seconds. Without it a placer nobody scrapes would keep every Place's duration in memory,
/// about 7 GB a day at 10,000 placements a second.
pub fn recorder() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".to_string()), &LATENCY_BUCKETS)
                .ok()?;
            let handle = builder.install_recorder().ok()?;
            let upkeep = handle.clone();
            let spawned = std::thread::Builder::new()
                .name("metrics-upkeep".to_string())
                .spawn(move || loop {
                    std::thread::sleep(UPKEEP_INTERVAL);
                    upkeep.run_upkeep();
                });
            if let Err(err) = spawned {
                tracing::warn!(%err, "metrics upkeep thread did not start; histograms grow until scraped");
            }
            Some(handle)
        })
        .clone()
}

/// Serves `GET /metrics` on `addr` (port 0 picks one); returns the address bound.
pub async fn serve(addr: SocketAddr) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let handle = recorder();
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let handle = handle.clone();
            async move { handle.map(|h| h.render()).unwrap_or_default() }
        }),
    );
    let (listener, bound) = crate::net::bind(addr).await?;
    let task = tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::warn!(%err, "metrics endpoint stopped");
        }
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn counters_are_served_in_prometheus_text() {
        let (addr, task) = super::serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        metrics::counter!("test_events_total", "kind" => "probe").increment(3);
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await.unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).await.unwrap();
        assert!(text.contains("test_events_total{kind=\"probe\"} 3"), "{text}");
        task.abort();
    }
}
