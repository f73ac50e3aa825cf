//! Helpers shared by the integration tests: the loopback services they need, unique names.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Fails the test (never skips it) when nothing listens at `addr` (`host:port`).
pub async fn require_service(addr: &str, what: &str, env: &str) {
    let connect = tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(addr)).await;
    if !matches!(connect, Ok(Ok(_))) {
        panic!(
            "{what} does not answer at {addr} (set by {env}); start it with `scripts/blob-services` \
             from the repository root, then run the tests again"
        );
    }
}

/// A name no earlier run used: `<prefix><pid>x<nanoseconds>`, lowercase alphanumerics.
pub fn unique(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{prefix}{}x{nanos}", std::process::id())
}
