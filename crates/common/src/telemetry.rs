//! Logging set-up shared by every binary.
//!
//! `RUST_LOG` picks what is logged (default `info`); `SANDBOXSCHED_LOG_FORMAT=json` switches
//! from human-readable text to one JSON object a line. Logs go to stderr, so what a command
//! prints for people or scripts stays alone on stdout.

use tracing_subscriber::{fmt, prelude::*, EnvFilter};

/// Installs the global subscriber. Calling it twice (tests, the launcher) is harmless.
pub fn init(service: &'static str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("SANDBOXSCHED_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let registry = tracing_subscriber::registry().with(filter);
    let result = if json {
        registry
            .with(fmt::layer().json().with_current_span(true).with_writer(std::io::stderr))
            .try_init()
    } else {
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        registry
            .with(
                fmt::layer()
                    .with_target(false)
                    .with_ansi(ansi)
                    .with_writer(std::io::stderr),
            )
            .try_init()
    };
    if result.is_ok() {
        tracing::debug!(service, "logging initialised");
    }
}
