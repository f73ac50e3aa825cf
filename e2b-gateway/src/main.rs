//! The `e2b-gateway` binary: configuration from flags or environment, nothing else.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use e2b_gateway::intent;
use e2b_gateway::server::GatewayConfig;

/// E2B's REST API and envd proxy.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The file of the cluster's token key (64 hex digits, 0600; every gateway of a cluster
    /// the same), from which sandboxes' access tokens are derived. Default: `tokens.key` in
    /// `--tls-dir`, where `sandboxsched-ctl certs` makes it.
    #[arg(long, env = "GATEWAY_TOKEN_KEY")]
    token_key: Option<std::path::PathBuf>,
    /// A file holding the operators' token for E2B's admin routes (`GET /nodes` with
    /// `X-Admin-Token`); without it those routes answer 403 to everyone.
    #[arg(long, env = "GATEWAY_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    security: common::config::SecurityArgs,
    /// A TOML file of settings (table `[e2b-gateway]`, keys = these flags' long names); environment
    /// variables and flags override it.
    #[arg(long, env = "SANDBOXSCHED_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Address the REST API (and envd proxy) listens on.
    #[arg(long, env = "GATEWAY_LISTEN", default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Where Prometheus metrics are served (`GET /metrics`); port 0 picks a free one.
    #[arg(long, env = "GATEWAY_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    metrics_listen: SocketAddr,
    #[arg(long, env = "GATEWAY_LEDGER", default_value = "http://127.0.0.1:7001")]
    ledger: String,
    #[arg(long, env = "GATEWAY_PLACEMENT", default_value = "http://127.0.0.1:7002")]
    placement: String,
    /// API keys as KEY=TEAM, comma-separated.
    #[arg(long, env = "GATEWAY_API_KEYS", value_delimiter = ',', required = true)]
    api_keys: Vec<String>,
    /// Where hibernated sandboxes' snapshots are spooled on their way to and from the blob
    /// store (pause with `memory: false`).
    #[arg(long, env = "GATEWAY_HIBERNATE_DIR", default_value = "data/hibernated")]
    hibernate_dir: std::path::PathBuf,
    /// Where template build uploads (COPY archives) are spooled on their way to the blob
    /// store. Made 0700; a folder of another user is refused.
    #[arg(long, env = "GATEWAY_UPLOAD_DIR", default_value = "data/uploads")]
    upload_dir: std::path::PathBuf,
    /// How many sandboxes one team may hold at once (running, paused or being created),
    /// as E2B limits a team's concurrent sandboxes; past it a create is answered 429. 0: no
    /// limit.
    #[arg(long, env = "GATEWAY_MAX_SANDBOXES_PER_TEAM", default_value_t = 100)]
    max_sandboxes_per_team: u32,
    /// Sandboxes' ports are reachable as `{port}-{sandboxID}.{domain}` (what the SDK's
    /// `get_host` returns; point a wildcard DNS name at the gateway). Empty: only through the
    /// `E2b-Sandbox-Id` and `E2b-Sandbox-Port` headers.
    #[arg(long, env = "GATEWAY_DOMAIN", default_value = "")]
    domain: String,
    /// Megabytes of disk each sandbox gets (E2B's `diskSizeMB`): a filesystem of its own on
    /// its node, where writes past it fail with ENOSPC.
    #[arg(long, env = "GATEWAY_SANDBOX_DISK_MB", default_value_t = common::resources::DEFAULT_DISK_BYTES >> 20, value_parser = clap::value_parser!(u64).range(16..))]
    sandbox_disk_mb: u64,
    /// How long a paused sandbox is kept before it is killed (it does not time out while
    /// paused), e.g. `30days`, `12h`.
    #[arg(long, env = "GATEWAY_PAUSED_RETENTION", default_value = "30days", value_parser = humantime::parse_duration)]
    paused_retention: Duration,
    /// How long a create may stay unfinished before it is resolved against the nodes (adopted
    /// where a node runs it, else removed): a gateway that died mid-create leaves such.
    #[arg(long, env = "GATEWAY_ABANDONED_CREATE_AFTER", default_value = "5min", value_parser = humantime::parse_duration)]
    abandoned_create_after: Duration,
    /// How long a kill, pause or resume may hold a sandbox before another operation may take
    /// it over; the reaper resolves a claim no operation comes for (its gateway died).
    #[arg(long, env = "GATEWAY_CLAIM_TTL", default_value = "2min", value_parser = humantime::parse_duration)]
    claim_ttl: Duration,
    /// A JSON file of templates the registry is seeded with at start, besides `base`: names
    /// with fixed resources over the base image, `[{"name": "...", "vcpus": 2, "memory_mb": 1024}]`.
    #[arg(long, env = "GATEWAY_TEMPLATES")]
    templates: Option<std::path::PathBuf>,
    /// The cluster's blob store, shared with the nodes: template layers and the files of COPY
    /// steps. A directory (`file:///abs/dir` or a path) or S3
    /// (`s3://BUCKET?endpoint=http://HOST:PORT&region=...`, credentials from AWS_* variables).
    #[arg(long, env = "SANDBOXSCHED_BLOB_STORE", default_value = "data/blobs")]
    blob_store: String,
    /// Keep E2B's `code-interpreter-v1` built: once a node is there, this gateway builds it
    /// from `base` (the nodes need Debian's python3-ipykernel, python3-jupyter-client,
    /// python3-matplotlib and python3-pandas) unless a build of this version exists.
    #[arg(long, env = "GATEWAY_CODE_INTERPRETER", default_value_t = false)]
    code_interpreter: bool,
}

/// The shortest API key taken: a key is its team's only secret.
const MIN_API_KEY_CHARS: usize = 16;

/// API keys from `KEY=TEAM` pairs. An empty or short key is refused: compose hands the
/// gateway `${E2B_API_KEY:-}=default`, which is `=default` where the operator set none.
fn api_keys(pairs: &[String]) -> anyhow::Result<HashMap<String, String>> {
    let mut keys = HashMap::new();
    for pair in pairs {
        let (key, team) = pair.split_once('=').ok_or_else(|| {
            anyhow::anyhow!(
                "an API key must be KEY=TEAM (got {} characters without '=')",
                pair.len()
            )
        })?;
        anyhow::ensure!(
            key.chars().count() >= MIN_API_KEY_CHARS,
            "the API key of team {team:?} has {} characters, fewer than {MIN_API_KEY_CHARS}: give a secret of your own (with compose: export E2B_API_KEY=e2b_$(openssl rand -hex 20))",
            key.chars().count()
        );
        anyhow::ensure!(!team.is_empty(), "an API key must name its team (KEY=TEAM)");
        keys.insert(key.to_string(), team.to_string());
    }
    Ok(keys)
}

#[global_allocator]
static ALLOCATOR: common::Allocator = common::Allocator;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = common::telemetry::init("e2b-gateway");
    let args = common::config::parse::<Args>("e2b-gateway");
    let (metrics_addr, _metrics) = common::metrics::serve(args.metrics_listen).await?;
    tracing::info!(%metrics_addr, "Prometheus metrics at /metrics");
    let keys = api_keys(&args.api_keys)?;
    let templates: Vec<intent::Template> = match &args.templates {
        Some(path) => serde_json::from_slice(&std::fs::read(path)?)?,
        None => Vec::new(),
    };
    let security = args
        .security
        .security(mtls::Role::Gateway)
        .map_err(anyhow::Error::msg)?;
    let token_key = token_key(args.token_key.as_deref(), args.security.tls_dir.as_deref())?;
    let gateway = e2b_gateway::server::start(GatewayConfig {
        listen: args.listen,
        ledger: args.ledger,
        placement: args.placement,
        keys,
        templates,
        blob_store: if args.blob_store.contains("://") {
            args.blob_store
        } else {
            std::path::absolute(&args.blob_store)?.display().to_string()
        },
        reap_interval: Duration::from_secs(1),
        hibernate_dir: args.hibernate_dir,
        upload_dir: args.upload_dir,
        max_sandboxes_per_team: args.max_sandboxes_per_team,
        domain: args.domain,
        paused_retention: args.paused_retention,
        sandbox_disk_bytes: args.sandbox_disk_mb << 20,
        abandoned_create_after: args.abandoned_create_after,
        claim_ttl: args.claim_ttl,
        security,
        token_key,
        admin_token: admin_token(args.admin_token_file.as_deref())?,
        code_interpreter: args.code_interpreter,
    })
    .await?;
    common::shutdown::signal().await;
    gateway.stop().await;
    telemetry.shutdown().await;
    Ok(())
}

/// The operators' admin token from `file`: one short enough to guess is refused (the admin
/// routes sit on the port every tenant reaches), without echoing it.
fn admin_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    let Some(file) = file else {
        return Ok(None);
    };
    let token = common::config::secret_file(file).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        token.chars().count() >= MIN_API_KEY_CHARS,
        "the admin token in {} has {} characters, fewer than {MIN_API_KEY_CHARS}: give a secret of your own (openssl rand -hex 20)",
        file.display(),
        token.chars().count()
    );
    Ok(Some(token))
}

/// The token key from `file`, or from the certificate directory.
fn token_key(
    file: Option<&std::path::Path>,
    tls_dir: Option<&std::path::Path>,
) -> anyhow::Result<envd_wire::sealed::TokenKey> {
    let text = match (file, tls_dir) {
        (Some(file), _) => mtls::read_secret(file)?,
        (None, Some(dir)) => mtls::read_token_key(dir)?,
        (None, None) => anyhow::bail!(
            "no token key: give --token-key FILE or --tls-dir DIR (`sandboxsched-ctl certs DIR` makes tokens.key)"
        ),
    };
    envd_wire::sealed::TokenKey::from_hex(&text).map_err(|e| anyhow::anyhow!("the token key: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_or_short_api_key_is_refused_and_never_echoed() {
        let pairs = |p: &[&str]| p.iter().map(ToString::to_string).collect::<Vec<_>>();
        let keys = api_keys(&pairs(&["e2b_0123456789abcdef=default"])).unwrap();
        assert_eq!(keys["e2b_0123456789abcdef"], "default");
        for bad in [
            "=default",
            "short=default",
            "e2b_0123456789abcdef=",
            "no-equals-sign-at-all-here",
        ] {
            let refused = api_keys(&pairs(&[bad])).unwrap_err().to_string();
            let key = bad.split('=').next().unwrap_or_default();
            assert!(
                key.is_empty() || !refused.contains(key),
                "the key is not echoed: {refused}"
            );
        }
    }

    #[test]
    fn a_short_admin_token_is_refused_and_never_echoed() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("gateway-admin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("admin_token");
        for (token, kept) in [("admin-0123456789abc", true), ("hunter2", false)] {
            std::fs::write(&file, format!("{token}\n")).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
            match admin_token(Some(&file)) {
                Ok(read) => assert!(kept && read.as_deref() == Some(token)),
                Err(refused) => assert!(!kept && !refused.to_string().contains(token), "{refused}"),
            }
        }
        assert!(admin_token(None).unwrap().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
