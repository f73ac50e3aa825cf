//! `bench code-interpreter`: E2B's code interpreter as its SDKs use it, with the whole stack in
//! this process and the gateway building `code-interpreter-v1` from base as `up` does:
//! - the build itself, from a fresh data directory;
//! - cold creates of the template timed to the first `1+1` answered (what an agent waits for:
//!   the sandbox, its server and a started kernel), beside creates of `base` in the same run,
//!   so the difference is what the kernel costs;
//! - `1+1` round trips through the gateway to the sandbox's port 49999, as the SDK sends them;
//! - how long after the kernel prints a line the client has it (the line's own timestamp,
//!   taken in the sandbox on the host's clock, against the arrival);
//! - the memory an idle code-interpreter sandbox (server and kernel) holds, as the node
//!   samples it;
//! - the same creates claimed from a warm pool of the template (size 1, refilled between
//!   them out of the timing): the first answer of a sandbox whose kernel is already up.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use e2b_gateway::templates::code_interpreter::{Availability, NAME};

use crate::report::{ms, percentile, Report};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Cold creates of each template (code-interpreter-v1, then base).
    #[arg(long, default_value_t = 10)]
    creates: usize,
    /// `1+1` round trips on one sandbox.
    #[arg(long, default_value_t = 200)]
    round_trips: usize,
    /// Cells that print a line, for the stream's delay.
    #[arg(long, default_value_t = 30)]
    streams: usize,
}

const KEY: &str = "bench";
/// The code interpreter's server listens on this port in its sandbox.
const PORT: &str = "49999";

struct Client {
    http: reqwest::Client,
    url: String,
}

/// What one `POST /execute` gave: its JSON lines, and when each arrived (unix ns).
struct Executed {
    lines: Vec<(serde_json::Value, u128)>,
}

impl Executed {
    fn main_text(&self) -> Option<&str> {
        self.lines.iter().find_map(|(l, _)| {
            (l["type"] == "result" && l["is_main_result"] == true)
                .then(|| l["text"].as_str())
                .flatten()
        })
    }
}

fn unix_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

impl Client {
    /// Creates a sandbox of `template`: its ID and envd access token.
    async fn create(&self, template: &str) -> anyhow::Result<(String, String)> {
        let r = self
            .http
            .post(format!("{}/sandboxes", self.url))
            .header("X-API-Key", KEY)
            .json(&serde_json::json!({"templateID": template, "timeout": 600}))
            .send()
            .await?;
        anyhow::ensure!(r.status().as_u16() == 201, "create of {template}: {}", r.text().await?);
        let created: serde_json::Value = r.json().await?;
        let id = created["sandboxID"].as_str().context("sandboxID")?;
        let token = created["envdAccessToken"].as_str().context("envdAccessToken")?;
        Ok((id.to_string(), token.to_string()))
    }

    async fn kill(&self, id: &str) {
        let _ = self
            .http
            .delete(format!("{}/sandboxes/{id}", self.url))
            .header("X-API-Key", KEY)
            .send()
            .await;
    }

    /// Runs `code` in the sandbox's default Python context, as the SDK's `run_code` does.
    async fn execute(&self, (id, token): (&str, &str), code: &str) -> anyhow::Result<Executed> {
        let mut r = self
            .http
            .post(format!("{}/execute", self.url))
            .header("E2b-Sandbox-Id", id)
            .header("E2b-Sandbox-Port", PORT)
            .header("X-Access-Token", token)
            .json(&serde_json::json!({"code": code}))
            .send()
            .await?;
        anyhow::ensure!(r.status().is_success(), "execute answered {}", r.status());
        let (mut lines, mut pending) = (Vec::new(), Vec::new());
        while let Some(chunk) = r.chunk().await? {
            let at = unix_ns();
            pending.extend_from_slice(&chunk);
            while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let value: serde_json::Value = serde_json::from_slice(&line)?;
                let done = value["type"] == "end_of_execution";
                lines.push((value, at));
                if done {
                    return Ok(Executed { lines });
                }
            }
        }
        anyhow::bail!("the execution's stream ended before end_of_execution")
    }
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    let started = Instant::now();
    let stack = stack::Stack::builder()
        .placement(|c| c.ledger_endpoint = None)
        .heartbeat(Duration::from_millis(200))
        .nodes(1)
        .node(|c| c.sample_interval = Duration::from_millis(500))
        .gateway(|c| {
            c.keys = [(KEY.to_string(), KEY.to_string())].into();
            c.code_interpreter = true;
        })
        .start()
        .await?;
    let gateway = stack.gateway.as_ref().context("the stack has a gateway")?;
    let mut availability = gateway.code_interpreter();
    let built = tokio::time::timeout(
        Duration::from_secs(300),
        availability.wait_for(|a| matches!(a, Availability::Ready { .. })),
    )
    .await
    .context("code-interpreter-v1 was not built within 300 s")??
    .clone();
    let build_secs = match built {
        Availability::Ready { built_in: Some(took) } => took.as_secs_f64(),
        _ => 0.0,
    };
    let stack_to_ready = started.elapsed();
    let client = Client {
        http: reqwest::Client::new(),
        url: gateway.url(),
    };

    // Cold creates, each to its first answer, then killed; base beside them.
    let (mut to_first_result, mut interpreter_creates, mut base_creates) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.creates {
        let t0 = Instant::now();
        let (id, token) = client.create(NAME).await?;
        interpreter_creates.push(t0.elapsed());
        let first = client.execute((&id, &token), "1+1").await?;
        to_first_result.push(t0.elapsed());
        anyhow::ensure!(first.main_text() == Some("2"), "1+1 answered {:?}", first.main_text());
        client.kill(&id).await;
        let t0 = Instant::now();
        let (id, _) = client.create("base").await?;
        base_creates.push(t0.elapsed());
        client.kill(&id).await;
    }

    // Claimed from a warm pool, each to its first answer.
    let ledger = &stack.ledger_client;
    let template_id = crate::warm_pool::template_id(ledger, NAME).await?;
    crate::warm_pool::size(ledger, &template_id, 1).await?;
    let (mut warm_to_first_result, mut warm_hits) = (Vec::new(), 0);
    for _ in 0..args.creates {
        let pooled = crate::warm_pool::ready(&client.http, &client.url, KEY, ledger, &template_id, 1).await?;
        let t0 = Instant::now();
        let (id, token) = client.create(NAME).await?;
        let first = client.execute((&id, &token), "1+1").await?;
        warm_to_first_result.push(t0.elapsed());
        anyhow::ensure!(first.main_text() == Some("2"), "1+1 answered {:?}", first.main_text());
        warm_hits += usize::from(pooled.contains(&id));
        client.kill(&id).await;
    }
    crate::warm_pool::empty(ledger, &template_id).await?;

    // Round trips and streams on one sandbox.
    let (id, token) = client.create(NAME).await?;
    let mut round_trips = Vec::with_capacity(args.round_trips);
    for _ in 0..args.round_trips {
        let t0 = Instant::now();
        let answer = client.execute((&id, &token), "1+1").await?;
        round_trips.push(t0.elapsed());
        anyhow::ensure!(answer.main_text() == Some("2"), "1+1 answered {:?}", answer.main_text());
    }
    let mut stream_delays = Vec::with_capacity(args.streams);
    for _ in 0..args.streams {
        let cell = client
            .execute((&id, &token), "import time\nprint('tick', flush=True)\ntime.sleep(0.2)")
            .await?;
        let (line, arrived) = cell
            .lines
            .iter()
            .find(|(l, _)| l["type"] == "stdout")
            .context("the cell printed nothing")?;
        let printed = line["timestamp"].as_u64().context("a stdout line has its timestamp")? as u128;
        stream_delays.push(Duration::from_nanos(arrived.saturating_sub(printed) as u64));
    }

    // Idle: nothing runs for a few samples; the node's latest sample of the sandbox.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let metrics: serde_json::Value = client
        .http
        .get(format!("{}/sandboxes/{id}/metrics", client.url))
        .header("X-API-Key", KEY)
        .send()
        .await?
        .json()
        .await?;
    let idle_bytes = metrics
        .as_array()
        .and_then(|samples| samples.last())
        .and_then(|s| s["memUsed"].as_u64())
        .context("the node has no memory sample of the sandbox")?;
    client.kill(&id).await;
    stack.stop().await;

    let (p50, p99) = (
        percentile(&mut to_first_result, 0.5),
        percentile(&mut to_first_result, 0.99),
    );
    let (warm50, warm99) = (
        percentile(&mut warm_to_first_result, 0.5),
        percentile(&mut warm_to_first_result, 0.99),
    );
    let create_p50 = percentile(&mut interpreter_creates, 0.5);
    let base_p50 = percentile(&mut base_creates, 0.5);
    let (rt50, rt99) = (percentile(&mut round_trips, 0.5), percentile(&mut round_trips, 0.99));
    let (st50, st99) = (
        percentile(&mut stream_delays, 0.5),
        percentile(&mut stream_delays, 0.99),
    );
    let idle_mib = idle_bytes as f64 / (1024.0 * 1024.0);
    let mut report = Report::new(format!(
        "code-interpreter: {} cold creates of {NAME} (and of base), as many claimed from a warm pool, {} round trips, {} streamed lines",
        args.creates, args.round_trips, args.streams
    ));
    report
        .figure("template_build_s", (build_secs * 100.0).round() / 100.0, "s")
        .figure(
            "stack_start_to_ready_s",
            (stack_to_ready.as_secs_f64() * 100.0).round() / 100.0,
            "s",
        )
        .figure("create_to_first_result_p50_ms", ms(p50), "ms")
        .figure("create_to_first_result_p99_ms", ms(p99), "ms")
        .figure(
            "warm_create_to_first_result_p50_ms",
            ms(warm50),
            "ms (claimed from a warm pool)",
        )
        .figure(
            "warm_create_to_first_result_p99_ms",
            ms(warm99),
            "ms (claimed from a warm pool)",
        )
        .figure(
            "warm_hits",
            format!("{warm_hits}/{}", args.creates),
            "warm creates that were claims",
        )
        .figure("interpreter_create_p50_ms", ms(create_p50), "ms")
        .figure("base_create_p50_ms", ms(base_p50), "ms")
        .figure("run_code_roundtrip_p50_ms", ms(rt50), "ms")
        .figure("run_code_roundtrip_p99_ms", ms(rt99), "ms")
        .figure("stream_first_byte_p50_ms", ms(st50), "ms")
        .figure("stream_first_byte_p99_ms", ms(st99), "ms")
        .figure("idle_memory_mib", (idle_mib * 10.0).round() / 10.0, "MiB");
    Ok(report)
}
