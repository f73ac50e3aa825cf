//! `sandboxsched-ctl`: what an operator asks the cluster, over the services' own APIs.
//!
//! Tables for people; `--json` prints one JSON value for scripts. Endpoints default to the
//! local stack's ports and have environment twins.

mod pools;
mod table;

use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use common::docs::{SandboxDoc, SANDBOX_KIND};
use ledger_client::LedgerClient;
use proto::balance::v1 as bpb;
use proto::balance::v1::balance_client::BalanceClient;
use proto::placement::v1 as ppb;
use proto::placement::v1::placement_client::PlacementClient;
use serde_json::{json, Value};
use tonic::transport::Channel;

use crate::table::Table;

#[derive(Parser, Debug)]
#[command(version, about = "The sandboxsched operator's command line")]
struct Cli {
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[arg(
        long,
        global = true,
        env = "SANDBOXSCHED_LEDGER",
        default_value = "http://127.0.0.1:7001"
    )]
    ledger: String,
    #[arg(
        long,
        global = true,
        env = "SANDBOXSCHED_PLACEMENT",
        default_value = "http://127.0.0.1:7002"
    )]
    placement: String,
    #[arg(
        long,
        global = true,
        env = "SANDBOXSCHED_BALANCE",
        default_value = "http://127.0.0.1:7003"
    )]
    balance: String,
    /// The cluster's certificate directory; ctl proves the operator's role with
    /// `operator.pem`/`operator.key` from it (`up` keeps them in `DATA_DIR/certs`).
    #[arg(long, global = true, env = "SANDBOXSCHED_TLS_DIR", default_value = "data/certs")]
    tls_dir: std::path::PathBuf,
    /// Call the services without TLS (only a stack started with --insecure-plaintext).
    #[arg(long, global = true, env = "SANDBOXSCHED_INSECURE_PLAINTEXT")]
    insecure_plaintext: bool,
    #[command(subcommand)]
    command: Command,
}

/// Where the services are, and how ctl proves it is the operator.
struct Cluster {
    ledger: String,
    placement: String,
    balance: String,
    security: mtls::Security,
}

impl Cluster {
    fn new(cli: &Cli) -> anyhow::Result<Self> {
        let security = if cli.insecure_plaintext {
            mtls::Security::Plaintext
        } else {
            mtls::Security::load(&cli.tls_dir, mtls::Role::Operator).with_context(|| {
                format!(
                    "the operator's certificate in {} (--tls-dir; `sandboxsched-ctl certs DIR` makes a cluster's)",
                    cli.tls_dir.display()
                )
            })?
        };
        Ok(Self {
            ledger: cli.ledger.clone(),
            placement: cli.placement.clone(),
            balance: cli.balance.clone(),
            security,
        })
    }

    async fn channel(&self, endpoint: &str, role: mtls::Role) -> anyhow::Result<Channel> {
        self.security
            .endpoint(endpoint, role)
            .with_context(|| format!("bad {role} endpoint {endpoint:?}"))?
            .connect_timeout(Duration::from_secs(3))
            .connect()
            .await
            .with_context(|| format!("cannot reach {role} at {endpoint} (is the stack running?)"))
    }

    async fn placement(&self) -> anyhow::Result<PlacementClient<Channel>> {
        Ok(PlacementClient::new(
            self.channel(&self.placement, mtls::Role::Placement).await?,
        ))
    }

    async fn balance(&self) -> anyhow::Result<BalanceClient<Channel>> {
        Ok(BalanceClient::new(
            self.channel(&self.balance, mtls::Role::Balance).await?,
        ))
    }

    fn ledger(&self) -> anyhow::Result<LedgerClient> {
        Ok(LedgerClient::connect_lazy(&self.ledger, &self.security)?)
    }
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Make a cluster's certificates in DIR (0700): a CA, one certificate per service role
    /// and for the operator, and one per node named with `--node` (`node-ID.pem`: each node
    /// speaks for itself alone). Keeps what exists; `--renew` reissues every role's pair and
    /// the named nodes' from the same CA. Give each host `ca.pem` and its own pair only.
    Certs {
        dir: std::path::PathBuf,
        #[arg(long)]
        renew: bool,
        /// A node's ID to issue a certificate for (repeat for each node).
        #[arg(long = "node", value_name = "NODE_ID")]
        nodes: Vec<String>,
    },
    /// Nodes as placement sees them: capacity, reported, reserved, state, heartbeat age.
    Nodes,
    /// Sandboxes: node, phase, memory estimate and where it came from.
    Sandboxes,
    /// One sandbox's story: created, placed, moved (from balance plans), its phase now.
    Sandbox { sandbox_id: String },
    /// What placement would do for a sandbox of this size now, and why.
    Explain {
        #[arg(long, default_value_t = 1)]
        vcpus: u32,
        #[arg(long, default_value_t = 512)]
        memory_mb: u64,
    },
    /// Balance: the latest observation, counts per status, paused, draining, active plan.
    Status,
    /// The newest balance plans and their moves.
    History {
        #[arg(long, default_value_t = 10)]
        limit: u32,
    },
    /// One plan (an operation) by ID.
    Plan { plan_id: String },
    /// Drain a node: nothing new lands on it and balance moves its sandboxes off.
    Drain {
        node_id: String,
        /// Make the node ready again.
        #[arg(long)]
        undo: bool,
        /// Show progress until the node is empty (at most `--timeout-secs`).
        #[arg(long)]
        wait: bool,
        #[arg(long, default_value_t = 600)]
        timeout_secs: u64,
    },
    /// Pause or resume balancing.
    Balancing {
        #[arg(value_parser = ["pause", "resume"])]
        action: String,
    },
    /// Warm pools: each template's pool size and the slots taken.
    Pools,
    /// Set how many ready sandboxes a template keeps (0 empties its pool).
    Pool {
        /// The template's ID or name.
        template: String,
        size: u32,
    },
    /// Confirm that a move's target node is gone for good (stop its host first), so a
    /// rollback waiting for that target to confirm its copy stopped resumes the source. A
    /// target that still runs its copy would make two.
    ReleaseTarget {
        plan_id: String,
        #[arg(long, default_value_t = 0)]
        move_index: u32,
    },
}

fn failed(what: &str) -> impl Fn(tonic::Status) -> anyhow::Error + '_ {
    move |status| anyhow::anyhow!("{what}: {} ({:?})", status.message(), status.code())
}

fn mib(bytes: u64) -> Value {
    json!(bytes >> 20)
}

fn node_state(state: i32) -> &'static str {
    match ppb::NodeState::try_from(state) {
        Ok(ppb::NodeState::Ready) => "ready",
        Ok(ppb::NodeState::Draining) => "draining",
        Ok(ppb::NodeState::Unhealthy) => "unhealthy",
        _ => "unknown",
    }
}

async fn manifests(cluster: &Cluster) -> anyhow::Result<Vec<SandboxDoc>> {
    let client = cluster.ledger()?;
    let (docs, _) = client
        .list::<SandboxDoc>(SANDBOX_KIND, "")
        .await
        .with_context(|| format!("listing sandboxes at {}", cluster.ledger))?;
    Ok(docs.into_iter().map(|d| d.value).collect())
}

fn plan_rows(plans: &[bpb::PlanView]) -> Table {
    let mut t = Table::new(&[
        "plan",
        "state",
        "reason",
        "spread_before",
        "spread_expected",
        "move",
        "sandbox",
        "from",
        "to",
        "mib",
        "step",
        "downtime_ms",
        "error",
    ]);
    for p in plans {
        let plan = [
            json!(p.plan_id),
            json!(p.state),
            json!(p.reason),
            json!(p.spread_before),
            json!(p.spread_expected),
        ];
        if p.moves.is_empty() {
            // A plan without moves still gets its row, its move columns empty.
            t.row(
                plan.iter()
                    .cloned()
                    .chain(std::iter::repeat_n(Value::Null, 8))
                    .collect(),
            );
        }
        for m in &p.moves {
            let error = if m.error.is_empty() {
                Value::Null
            } else {
                json!(m.error)
            };
            let moved = [
                json!(m.move_id),
                json!(m.sandbox_id),
                json!(m.from_node),
                json!(m.to_node),
                mib(m.memory_bytes),
                json!(m.step),
                json!(m.downtime_ms),
                error,
            ];
            t.row(plan.iter().cloned().chain(moved).collect());
        }
    }
    t
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Command::Certs { dir, renew, nodes } = &cli.command {
        return certs(dir, *renew, nodes);
    }
    let cluster = Cluster::new(&cli)?;
    match cli.command {
        Command::Certs { .. } => unreachable!("answered above"),
        Command::Nodes => {
            let mut placement = cluster.placement().await?;
            let nodes = placement
                .nodes(ppb::NodesRequest {})
                .await
                .map_err(failed("placement-svc"))?
                .into_inner()
                .nodes;
            let mut t = Table::new(&[
                "node",
                "state",
                "vcpus",
                "memory_mib",
                "reported_vcpus",
                "reported_mib",
                "sandboxes",
                "reserved_vcpus",
                "reserved_mib",
                "pending",
                "used_mib",
                "cpu_used_vcpus",
                "heartbeat_age_ms",
            ]);
            for n in nodes {
                let (cap, rep, res) = (
                    n.capacity.unwrap_or_default(),
                    n.reported.unwrap_or_default(),
                    n.reserved.unwrap_or_default(),
                );
                t.row(vec![
                    json!(n.node_id),
                    json!(node_state(n.state)),
                    json!(cap.vcpus),
                    mib(cap.memory_bytes),
                    json!(rep.vcpus),
                    mib(rep.memory_bytes),
                    json!(n.reported_sandboxes),
                    json!(res.vcpus),
                    mib(res.memory_bytes),
                    json!(n.pending),
                    mib(n.memory_used_bytes),
                    json!((n.cpu_usage * 100.0).round() / 100.0),
                    json!(n.heartbeat_age_ms),
                ]);
            }
            t.print(cli.json);
        }
        Command::Sandboxes => {
            let mut t = Table::new(&["sandbox", "node", "phase", "vcpus", "memory_mib", "estimate", "owner"]);
            for m in manifests(&cluster).await? {
                t.row(vec![
                    json!(m.sandbox_id),
                    if m.node_id.is_empty() {
                        Value::Null
                    } else {
                        json!(m.node_id)
                    },
                    json!(m.phase),
                    json!(m.vcpus),
                    mib(m.memory_bytes),
                    json!(m.memory_source),
                    m.lifecycle_owner.map_or(Value::Null, Value::from),
                ]);
            }
            t.print(cli.json);
        }
        Command::Sandbox { sandbox_id } => sandbox_story(&cluster, cli.json, &sandbox_id).await?,
        Command::Pools => pools::list(&cluster.ledger()?, cli.json).await?,
        Command::Pool { template, size } => pools::set(&cluster.ledger()?, &template, size).await?,
        Command::Explain { vcpus, memory_mb } => {
            let mut placement = cluster.placement().await?;
            let answer = placement
                .explain(ppb::PlaceRequest {
                    sandbox_id: "explain".into(),
                    resources: Some(ppb::Resources {
                        vcpus,
                        memory_bytes: memory_mb << 20,
                    }),
                    ..Default::default()
                })
                .await
                .map_err(failed("placement-svc"))?
                .into_inner();
            let mut t = Table::new(&["node", "feasible", "score", "reason"]);
            for c in &answer.candidates {
                t.row(vec![
                    json!(c.node_id),
                    json!(c.feasible),
                    json!(c.score),
                    json!(c.reason),
                ]);
            }
            if cli.json {
                println!("{}", json!({"chosen": answer.chosen, "candidates": t.json()}));
            } else {
                t.print(false);
                println!(
                    "chosen: {}",
                    if answer.chosen.is_empty() {
                        "nothing fits"
                    } else {
                        &answer.chosen
                    }
                );
            }
        }
        Command::Status => {
            let mut balance = cluster.balance().await?;
            let s = balance
                .status(bpb::StatusRequest {})
                .await
                .map_err(failed("balance-svc"))?
                .into_inner();
            let o = s.observation.unwrap_or_default();
            let value = json!({
                "status": o.status, "spread": o.spread, "ready_nodes": o.ready_nodes,
                "observed_at_unix_ms": o.observed_at_unix_ms, "counts": o.counts,
                "paused": s.paused, "active_plan": s.active_plan_id, "draining": s.draining_nodes,
                "executor_here": s.leader,
                "stuck": s.stuck.iter().map(|t| json!({
                    "sandbox": t.sandbox_id, "node": t.node_id, "failures": t.failures,
                    "error": t.error, "retry_at_unix_ms": t.retry_at_unix_ms,
                })).collect::<Vec<_>>(),
            });
            if cli.json {
                println!("{value}");
            } else {
                println!(
                    "observation  {} (spread {:.3}, {} ready nodes)",
                    o.status, o.spread, o.ready_nodes
                );
                println!("balancing    {}", if s.paused { "paused" } else { "active" });
                println!(
                    "active plan  {}",
                    if s.active_plan_id.is_empty() {
                        "-"
                    } else {
                        &s.active_plan_id
                    }
                );
                println!(
                    "draining     {}",
                    if s.draining_nodes.is_empty() {
                        "-".into()
                    } else {
                        s.draining_nodes.join(", ")
                    }
                );
                for t in &s.stuck {
                    println!(
                        "cannot move {} on {} ({} failed tries; next at {} ms): {}",
                        t.sandbox_id, t.node_id, t.failures, t.retry_at_unix_ms, t.error
                    );
                }
                let mut counts: Vec<_> = o.counts.into_iter().collect();
                counts.sort();
                for (status, n) in counts {
                    println!("  {n:>8}  {status}");
                }
            }
        }
        Command::History { limit } => {
            let mut balance = cluster.balance().await?;
            let plans = balance
                .history(bpb::HistoryRequest { limit })
                .await
                .map_err(failed("balance-svc"))?
                .into_inner()
                .plans;
            plan_rows(&plans).print(cli.json);
        }
        Command::Plan { plan_id } => {
            let mut balance = cluster.balance().await?;
            let plan = balance
                .get_plan(bpb::GetPlanRequest { plan_id })
                .await
                .map_err(failed("balance-svc"))?
                .into_inner();
            plan_rows(&[plan]).print(cli.json);
        }
        Command::Drain {
            node_id,
            undo,
            wait,
            timeout_secs,
        } => {
            let mut balance = cluster.balance().await?;
            let answer = balance
                .drain(bpb::DrainRequest {
                    node_id: node_id.clone(),
                    undo,
                })
                .await
                .map_err(failed("balance-svc"))?
                .into_inner();
            if undo {
                println!("{node_id} is ready again");
                return Ok(());
            }
            let total = answer.remaining_sandboxes;
            println!("{node_id} is draining: {total} running sandbox(es) to move");
            if wait {
                wait_for_drain(&cluster, &node_id, total, Duration::from_secs(timeout_secs)).await?;
            }
        }
        Command::ReleaseTarget { plan_id, move_index } => {
            let mut balance = cluster.balance().await?;
            let plan = balance
                .release_target(bpb::ReleaseTargetRequest {
                    plan_id: plan_id.clone(),
                    move_index,
                })
                .await
                .map_err(failed("balance-svc"))?
                .into_inner();
            println!("move {move_index} of {plan_id}: target released; the rollback resumes the source");
            plan_rows(&[plan]).print(cli.json);
        }
        Command::Balancing { action } => {
            let mut balance = cluster.balance().await?;
            let s = balance
                .set_paused(bpb::SetPausedRequest {
                    paused: action == "pause",
                })
                .await
                .map_err(failed("balance-svc"))?
                .into_inner();
            println!("balancing {}", if s.paused { "paused" } else { "resumed" });
        }
    }
    Ok(())
}

fn certs(dir: &std::path::Path, renew: bool, nodes: &[String]) -> anyhow::Result<()> {
    for id in nodes {
        mtls::check_node_id(id).map_err(anyhow::Error::msg)?;
    }
    let issued =
        mtls::issue_cluster(dir, renew).with_context(|| format!("making certificates in {}", dir.display()))?;
    if issued.new_ca {
        println!("new cluster CA in {}", dir.join("ca.pem").display());
    }
    let mut roles: Vec<String> = issued.roles.iter().map(|r| r.name().to_string()).collect();
    for id in nodes {
        // A new CA invalidates every node's pair: issue them again too.
        if mtls::issue_node(dir, id, &[id.as_str()], renew || issued.new_ca)
            .with_context(|| format!("making node {id}'s certificate in {}", dir.display()))?
        {
            roles.push(format!("node {id}"));
        }
    }
    if roles.is_empty() {
        println!("every role already has a certificate in {}", dir.display());
    } else {
        println!("issued: {}", roles.join(", "));
    }
    Ok(())
}

/// A progress line until no running sandbox is left on the node.
async fn wait_for_drain(cluster: &Cluster, node_id: &str, total: u32, timeout: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = manifests(cluster)
            .await?
            .iter()
            .filter(|m| m.node_id == node_id && m.phase == common::docs::SandboxPhase::Running)
            .count() as u32;
        let done = total.saturating_sub(left);
        let width = 30usize;
        let filled = if total == 0 {
            width
        } else {
            (done as usize * width) / total as usize
        };
        eprint!(
            "\r[{}{}] {done}/{total} moved",
            "#".repeat(filled),
            ".".repeat(width - filled)
        );
        if left == 0 {
            eprintln!();
            println!("{node_id} is empty");
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "\n{left} sandbox(es) still on {node_id} after {timeout:?}; `sandboxsched-ctl status` and `history` say why"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Created, placed, moved, phase now: from the manifest and the balance plans.
async fn sandbox_story(cluster: &Cluster, json: bool, sandbox_id: &str) -> anyhow::Result<()> {
    let client = cluster.ledger()?;
    let manifest = client
        .get::<SandboxDoc>(SANDBOX_KIND, sandbox_id)
        .await
        .with_context(|| format!("reading sandbox {sandbox_id}"))?
        .with_context(|| format!("no sandbox {sandbox_id}"))?;
    let m = &manifest.value;
    let changes = ledger_client::history::changes(&client, &manifest).await;
    let moves: Vec<bpb::MoveView> = match cluster.balance().await {
        Ok(mut balance) => balance
            .history(bpb::HistoryRequest { limit: 1000 })
            .await
            .map_err(failed("balance-svc"))?
            .into_inner()
            .plans
            .into_iter()
            .rev()
            .flat_map(|p| p.moves)
            .filter(|mv| mv.sandbox_id == sandbox_id)
            .collect(),
        Err(_) => Vec::new(),
    };
    if json {
        let moves: Vec<Value> = moves
            .iter()
            .map(|mv| json!({"move": mv.move_id, "from": mv.from_node, "to": mv.to_node, "step": mv.step, "downtime_ms": mv.downtime_ms}))
            .collect();
        let history = match &changes {
            Ok(changes) => json!(changes
                .iter()
                .map(|c| json!({"revision": c.revision, "version": c.version, "changes": c.what}))
                .collect::<Vec<_>>()),
            Err(err) => json!({"error": err.to_string()}),
        };
        println!(
            "{}",
            json!({"manifest": serde_json::to_value(m)?, "version": manifest.version, "moves": moves, "history": history})
        );
        return Ok(());
    }
    println!(
        "sandbox   {} (team {}, template {})",
        m.sandbox_id, m.team_id, m.template
    );
    println!("created   {} ms since the epoch", m.started_at_unix_ms);
    println!(
        "resources {} vCPU, {} MiB ({:?} estimate)",
        m.vcpus,
        m.memory_bytes >> 20,
        m.memory_source
    );
    match &changes {
        Ok(changes) => {
            for c in changes {
                println!("rev {:<8} v{:<3} {}", c.revision, c.version, c.what.join("; "));
            }
        }
        Err(err) => println!("history   not available: {err}"),
    }
    for mv in &moves {
        println!(
            "moved     {} -> {} ({}, {} ms down) by {}",
            mv.from_node, mv.to_node, mv.step, mv.downtime_ms, mv.move_id
        );
    }
    println!(
        "now       {:?} on {} (epoch {}, manifest version {})",
        m.phase,
        if m.node_id.is_empty() { "no node" } else { &m.node_id },
        m.epoch,
        manifest.version
    );
    if let Some(owner) = &m.lifecycle_owner {
        println!("owned by  {owner}");
    }
    if let Some(trace) = &m.trace_context {
        println!("trace     {trace}");
    }
    Ok(())
}
