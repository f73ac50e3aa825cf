//! `bench proxy`: the gateway's data path to one sandbox (a container), with the whole stack in
//! this process:
//! - a command (`true`) through envd via the gateway, as the SDK's `commands.run` sends it;
//! - a small file from a web server in the sandbox through the gateway's port routing
//!   (`Host: 8000-{id}.{domain}`), against the same request made directly from the node (a
//!   connection opened inside the sandbox's network namespace): what the gateway's and the
//!   node's relays add;
//! - 100 MB downloaded from that server through the gateway;
//! - 1 GiB uploaded through `/files` and read back, with the peak resident memory of this
//!   process (gateway and node) and of envd inside the sandbox.

use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;

use crate::report::{ms, percentile, Report};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Commands run for the command latency.
    #[arg(long, default_value_t = 200)]
    commands: usize,
    /// Requests made each way for the port latency.
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// Megabytes downloaded from the sandbox's port.
    #[arg(long, default_value_t = 100)]
    download_mb: usize,
    /// MiB uploaded (and downloaded back) through /files.
    #[arg(long, default_value_t = 1024)]
    upload_mib: u64,
    /// The services talk without TLS (gRPC and the gateway's hop to the node; a stack is
    /// mutual TLS otherwise), to see what TLS costs.
    #[arg(long)]
    plaintext: bool,
}

const DOMAIN: &str = "bench.test";
const PORT: u16 = 8000;

struct Sandbox {
    url: String,
    id: String,
    token: String,
}

impl Sandbox {
    fn envd(&self, http: &reqwest::Client, path: &str) -> reqwest::RequestBuilder {
        http.post(format!("{}{path}", self.url))
            .header("E2b-Sandbox-Id", &self.id)
            .header("X-Access-Token", &self.token)
    }

    /// Runs `sh -c script` through the gateway; `Ok` when it exits 0.
    async fn sh(&self, http: &reqwest::Client, script: &str) -> anyhow::Result<()> {
        let process = serde_json::json!({"cmd": "/bin/sh", "args": ["-c", script]});
        crate::fixture::run_in(http, &self.url, (&self.id, &self.token), process).await
    }

    fn port(&self, http: &reqwest::Client, path: &str) -> reqwest::RequestBuilder {
        http.get(format!("{}{path}", self.url))
            .header("Host", format!("{PORT}-{}.{DOMAIN}", self.id))
    }
}

/// Peak resident memory (VmHWM) of a process, in MiB.
fn peak_mib(pid: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The envd that serves the sandbox whose init is `pid`: init itself, or its child (envd
/// forks when it is PID 1 and serves from the child).
fn envd_pids(pid: u32) -> Vec<String> {
    let mut pids = vec![pid.to_string()];
    if let Ok(children) = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
        pids.extend(children.split_whitespace().map(str::to_string));
    }
    pids
}

/// One GET of `path` over a fresh connection opened inside the sandbox's network namespace
/// (what the node's relay does before it relays): the time to the last byte.
fn direct_get(pid: u32, path: &str) -> anyhow::Result<Duration> {
    use std::io::{Read, Write};
    let started = Instant::now();
    let mut stream = node_svc::runtime::connect_in_namespace_of(pid, PORT)?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    anyhow::ensure!(
        answer.starts_with(b"HTTP/1.0 200") || answer.starts_with(b"HTTP/1.1 200"),
        "direct GET failed"
    );
    Ok(started.elapsed())
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    let mut stack = stack::Stack::builder()
        .placement(|c| c.ledger_endpoint = None)
        .heartbeat(Duration::from_millis(200))
        .nodes(1)
        .gateway(|c| {
            c.keys = [("bench".to_string(), "bench".to_string())].into();
            c.domain = DOMAIN.to_string();
        });
    if args.plaintext {
        stack = stack.plaintext();
    }
    let stack = stack.start().await?;
    let gateway = stack.gateway.as_ref().context("the stack has a gateway")?;
    let url = gateway.url();
    let http = reqwest::Client::new();
    let ready = Instant::now();
    let created = loop {
        let r = http
            .post(format!("{url}/sandboxes"))
            .header("X-API-Key", "bench")
            .header("Content-Type", "application/json")
            .body(r#"{"templateID":"base","timeout":3600}"#)
            .send()
            .await?;
        if r.status().as_u16() == 201 {
            break r.json::<serde_json::Value>().await?;
        }
        let why = r.text().await.unwrap_or_default();
        anyhow::ensure!(
            ready.elapsed() < Duration::from_secs(10),
            "the stack never accepted a create: {why}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let sbx = Sandbox {
        url: url.clone(),
        id: created["sandboxID"].as_str().context("sandboxID")?.to_string(),
        token: created["envdAccessToken"]
            .as_str()
            .context("envdAccessToken")?
            .to_string(),
    };
    let pid = stack.nodes[0]
        .running
        .host()
        .get(&sbx.id)
        .await
        .context("the sandbox is on the node")?
        .pgid;

    // A command through the gateway.
    let mut commands = Vec::with_capacity(args.commands);
    for _ in 0..args.commands {
        let started = Instant::now();
        sbx.sh(&http, "true").await?;
        commands.push(started.elapsed());
    }

    // A web server in the sandbox, bound to its loopback.
    sbx.sh(
        &http,
        &format!(
            "cd /home/user && echo ok > small.txt && head -c {}M /dev/urandom > blob.bin && \
             (nohup python3 -m http.server {PORT} --bind 127.0.0.1 >/dev/null 2>&1 &)",
            args.download_mb
        ),
    )
    .await?;
    let ready = Instant::now();
    while !sbx
        .port(&http, "/small.txt")
        .send()
        .await
        .is_ok_and(|r| r.status().as_u16() == 200)
    {
        anyhow::ensure!(
            ready.elapsed() < Duration::from_secs(10),
            "the sandbox's server never answered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut through, mut direct) = (Vec::new(), Vec::new());
    for _ in 0..args.requests {
        let started = Instant::now();
        let r = sbx.port(&http, "/small.txt").send().await?;
        anyhow::ensure!(r.status().as_u16() == 200, "port request answered {}", r.status());
        r.bytes().await?;
        through.push(started.elapsed());
        direct.push(tokio::task::spawn_blocking(move || direct_get(pid, "/small.txt")).await??);
    }
    let started = Instant::now();
    let mut download = sbx.port(&http, "/blob.bin").send().await?;
    let mut downloaded = 0usize;
    while let Some(chunk) = download.chunk().await? {
        downloaded += chunk.len();
    }
    let download_secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(downloaded == args.download_mb << 20, "downloaded {downloaded} bytes");

    // 1 GiB up through /files, generated as it goes, and back down, counted as it comes.
    let before_mib = peak_mib("self");
    let size = args.upload_mib << 20;
    let block = vec![0x5au8; 1 << 20];
    let chunks = futures::stream::iter(0..args.upload_mib).map(move |_| Ok::<_, std::io::Error>(block.clone()));
    let started = Instant::now();
    let up = sbx
        .envd(&http, "/files?path=/home/user/big.bin")
        .header("Content-Type", "application/octet-stream")
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await?;
    anyhow::ensure!(up.status().is_success(), "upload answered {}", up.status());
    let upload_secs = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut down = http
        .get(format!("{url}/files?path=/home/user/big.bin"))
        .header("E2b-Sandbox-Id", &sbx.id)
        .header("X-Access-Token", &sbx.token)
        .send()
        .await?;
    let mut back = 0u64;
    while let Some(chunk) = down.chunk().await? {
        back += chunk.len() as u64;
    }
    let download_back_secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(back == size, "read back {back} of {size} bytes");
    let stack_peak = peak_mib("self");
    let envd_peak = envd_pids(pid).iter().map(|p| peak_mib(p)).fold(0.0, f64::max);

    let _ = http
        .delete(format!("{url}/sandboxes/{}", sbx.id))
        .header("X-API-Key", "bench")
        .send()
        .await;
    stack.stop().await;

    let us = |d: Duration| (d.as_secs_f64() * 1_000_000.0).round();
    let (through_p50, direct_p50) = (percentile(&mut through, 0.5), percentile(&mut direct, 0.5));
    let mib = args.upload_mib as f64;
    let mut report = Report::new(format!(
        "proxy: one container through the gateway; {} commands, {} port requests each way, {} MB download, {} MiB through /files; {}",
        args.commands,
        args.requests,
        args.download_mb,
        args.upload_mib,
        if args.plaintext { "plaintext" } else { "mutual TLS to the node" }
    ));
    report
        .figure(
            "envd_command_p50_ms",
            ms(percentile(&mut commands, 0.5)),
            "ms, `true` through the gateway",
        )
        .figure("envd_command_p99_ms", ms(percentile(&mut commands, 0.99)), "ms")
        .figure(
            "port_gateway_p50_us",
            us(through_p50),
            "µs, a small file through the gateway",
        )
        .figure(
            "port_direct_p50_us",
            us(direct_p50),
            "µs, the same from the node, in the sandbox's namespace",
        )
        .figure(
            "port_added_latency_p50_us",
            us(through_p50.saturating_sub(direct_p50)),
            "µs the gateway's and node's relays add",
        )
        .figure(
            "port_download_mb_per_sec",
            ((args.download_mb as f64 / download_secs) * 10.0).round() / 10.0,
            "MB/s from the sandbox's port through the gateway",
        )
        .figure(
            "upload_mib_per_sec",
            ((mib / upload_secs) * 10.0).round() / 10.0,
            "MiB/s up through /files",
        )
        .figure(
            "files_download_mib_per_sec",
            ((mib / download_back_secs) * 10.0).round() / 10.0,
            "MiB/s back down",
        )
        .figure(
            "upload_1gib_peak_rss_mib",
            (stack_peak * 10.0).round() / 10.0,
            &format!("MiB, this process (gateway + node) at its peak; {before_mib:.1} before the transfer"),
        )
        .figure(
            "upload_1gib_envd_peak_rss_mib",
            (envd_peak * 10.0).round() / 10.0,
            "MiB, envd in the sandbox at its peak",
        );
    Ok(report)
}
