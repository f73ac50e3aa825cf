//! `bench move-faults`: moves under lost replies and executor deaths.
//!
//! Two node-svcs and the ledger each sit behind a fault proxy ([`stack::fault`]). Sandboxes
//! (containers, a file each) are moved back and forth by balance-svc's executor, driven
//! directly. Before each move a seeded draw picks its fault: none, a lost reply of one node
//! call (pause or kill on the source, restore or resume on the target), a lost reply of one
//! ledger write (the manifest's or the plan's), or the executor dying after a random step
//! (before or after recording it), after which a fresh executor finishes the plan.
//!
//! After every move the invariants are checked over every sandbox: at most one running copy,
//! exactly one copy named by its manifest, its file intact. `max_unavailable_ms` is the
//! longest a moved sandbox was paused (paused to resumed, as its move recorded it).

use std::time::Duration;

use anyhow::Context;
use balance_svc::migrate::{Halt, Mover};
use balance_svc::record::{PlanDoc, Step, PLAN_KIND};
use common::docs::{SandboxDoc, SANDBOX_KIND};
use ledger_client::{LedgerClient, Txn};
use node_svc::sandbox::State;
use rand::{Rng, SeedableRng};
use stack::fault::{LedgerProxy, NodeProxy, Proxy};

use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Moves made.
    #[arg(long, default_value_t = 40)]
    moves: usize,
    /// Sandboxes moved in turn.
    #[arg(long, default_value_t = 4)]
    sandboxes: usize,
    /// Fraction of moves that get a fault.
    #[arg(long, default_value_t = 0.75)]
    fault_rate: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// The fault one move gets.
#[derive(Clone, Copy, Debug)]
enum Fault {
    None,
    /// The reply of this node call is lost (on the node it goes to).
    NodeReply {
        call: &'static str,
        on_target: bool,
    },
    /// The reply of the next manifest write is lost.
    ManifestReply,
    /// The reply of the next plan write is lost.
    PlanReply,
    /// The executor dies here.
    Kill(Halt),
}

fn draw(rng: &mut rand::rngs::StdRng, rate: f64) -> Fault {
    if !rng.random_bool(rate.clamp(0.0, 1.0)) {
        return Fault::None;
    }
    match rng.random_range(0..7) {
        0 => Fault::NodeReply {
            call: "Pause",
            on_target: false,
        },
        1 => Fault::NodeReply {
            call: "Restore",
            on_target: true,
        },
        2 => Fault::NodeReply {
            call: "Resume",
            on_target: true,
        },
        3 => Fault::NodeReply {
            call: "Kill",
            on_target: false,
        },
        4 => Fault::ManifestReply,
        5 => Fault::PlanReply,
        _ => {
            let steps = [
                Step::Owned,
                Step::SourcePaused,
                Step::Restored,
                Step::TargetResumed,
                Step::Switched,
            ];
            Fault::Kill(Halt {
                step: steps[rng.random_range(0..steps.len())],
                recorded: rng.random_bool(0.5),
            })
        }
    }
}

#[derive(Default)]
struct Tally {
    moves: u64,
    done: u64,
    rolled_back: u64,
    lost_replies: u64,
    kills: u64,
    two_running_copies: u64,
    lost_sandboxes: u64,
    files_lost: u64,
    max_unavailable_ms: u64,
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    let stack = stack::Stack::builder()
        .node(|c| c.placement = None)
        .node(|c| c.placement = None)
        .start()
        .await?;
    let nodes: Vec<(String, Proxy)> = vec![
        (
            stack.nodes[0].id.clone(),
            NodeProxy::start(&stack.nodes[0].id, &stack.nodes[0].running.endpoint(), &stack.certs).await,
        ),
        (
            stack.nodes[1].id.clone(),
            NodeProxy::start(&stack.nodes[1].id, &stack.nodes[1].running.endpoint(), &stack.certs).await,
        ),
    ];
    let ledger_proxy = LedgerProxy::start(&stack.ledger_endpoint(), &stack.certs).await;
    let ledger = LedgerClient::connect_lazy(&ledger_proxy.endpoint(), &stack.security(stack::Role::Operator))?;
    let direct = stack.ledger_client.clone();

    let ids: Vec<String> = (0..args.sandboxes).map(|i| format!("faulty{i}")).collect();
    for id in &ids {
        create(&stack, &direct, id, &nodes[0]).await?;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut tally = Tally::default();
    for n in 0..args.moves {
        let id = &ids[n % ids.len()];
        let manifest = direct
            .get::<SandboxDoc>(SANDBOX_KIND, id)
            .await?
            .context("every sandbox keeps its manifest")?;
        let from = usize::from(manifest.value.node_id != nodes[0].0);
        let to = 1 - from;
        let fault = draw(&mut rng, args.fault_rate);
        let halt = match fault {
            Fault::None => None,
            Fault::NodeReply { call, on_target } => {
                let at = if on_target { to } else { from };
                nodes[at].1.faults.drop_reply(call, 1);
                tally.lost_replies += 1;
                None
            }
            Fault::ManifestReply => {
                let sandbox = format!("\"sandbox_id\":\"{id}\"");
                ledger_proxy
                    .faults
                    .drop_compare_reply(move |r| stack::fault::writes(r, SANDBOX_KIND, &sandbox), 1);
                tally.lost_replies += 1;
                None
            }
            Fault::PlanReply => {
                ledger_proxy
                    .faults
                    .drop_compare_reply(|r| stack::fault::writes(r, PLAN_KIND, "\"step\""), 1);
                tally.lost_replies += 1;
                None
            }
            Fault::Kill(halt) => {
                tally.kills += 1;
                Some(halt)
            }
        };
        let plan_id = format!("faults-{n:04}");
        let plan = PlanDoc::one_move(
            &plan_id,
            id,
            (&nodes[from].0, &nodes[from].1.endpoint()),
            (&nodes[to].0, &nodes[to].1.endpoint()),
            64 << 20,
        );
        direct.compare(Txn::new().create(PLAN_KIND, &plan_id, &plan)?).await?;
        let record = finish(&ledger, &stack.certs, &plan_id, halt).await?;
        // A lost reply whose call never came (the move failed earlier) must not hit the next.
        for (_, proxy) in &nodes {
            for call in ["Pause", "Restore", "Resume", "Kill"] {
                proxy.faults.drop_reply(call, 0);
            }
        }
        tally.moves += 1;
        match record.step {
            Step::Done => tally.done += 1,
            Step::RolledBack => tally.rolled_back += 1,
            other => anyhow::bail!("move {plan_id} ended at {other:?}: {:?}", record.error),
        }
        tally.max_unavailable_ms = tally.max_unavailable_ms.max(record.downtime_ms().unwrap_or(0));
        check(&stack, &direct, &ids, &nodes, &mut tally).await?;
    }
    for (_, proxy) in nodes {
        proxy.stop().await;
    }
    ledger_proxy.stop().await;
    stack.shut_down().await;

    let mut report = Report::new(format!(
        "move-faults: {} moves of {} sandboxes between two nodes, {:.0} % with a lost reply or an executor death (seed {})",
        args.moves,
        args.sandboxes,
        args.fault_rate * 100.0,
        args.seed
    ));
    report
        .figure("moves", tally.moves, "")
        .figure("done", tally.done, "")
        .figure("rolled_back", tally.rolled_back, "")
        .figure("lost_replies", tally.lost_replies, "")
        .figure("kills", tally.kills, "executor deaths")
        .figure("two_running_copies", tally.two_running_copies, "(must be 0)")
        .figure("lost_sandboxes", tally.lost_sandboxes, "(must be 0)")
        .figure("files_lost", tally.files_lost, "(must be 0)")
        .figure(
            "max_unavailable_ms",
            tally.max_unavailable_ms,
            "ms paused (goal <= 5000)",
        );
    Ok(report)
}

/// Runs the plan to its end: once with `halt`, then, if the executor "died", with a fresh
/// executor (as the next lease holder would), until the move is final.
async fn finish(
    ledger: &LedgerClient,
    certs: &stack::Certs,
    plan_id: &str,
    halt: Option<Halt>,
) -> anyhow::Result<balance_svc::record::MoveRecord> {
    let mut halt = halt;
    for _ in 0..20 {
        let plan = ledger
            .get::<PlanDoc>(PLAN_KIND, plan_id)
            .await?
            .context("plan just written")?;
        if plan.value.moves[0].step.is_final() {
            return Ok(plan.value.moves[0].clone());
        }
        let mover = Mover::new(ledger.clone(), None, balance_svc::migrate::Budget::SERIAL)
            .with_halt(halt.take())
            .with_security(certs.security(stack::Role::Balance));
        // A stop (a death, or a step left for the next cycle) is picked up by a fresh one.
        if mover.execute(plan).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    anyhow::bail!("plan {plan_id} did not finish in 20 executor runs")
}

/// A running sandbox on node 0 with a marker file, its manifest naming node 0 through its
/// proxy.
async fn create(stack: &stack::Stack, ledger: &LedgerClient, id: &str, node: &(String, Proxy)) -> anyhow::Result<()> {
    let running = &stack.nodes[0].running;
    crate::fixture::running_sandbox(
        ledger,
        &stack.certs,
        running,
        (&node.0, &node.1.endpoint()),
        id,
        64 << 20,
    )
    .await?;
    std::fs::write(running.host().home(id).join("marker.txt"), id)?;
    Ok(())
}

/// Counts every broken invariant over all sandboxes.
async fn check(
    stack: &stack::Stack,
    ledger: &LedgerClient,
    ids: &[String],
    nodes: &[(String, Proxy)],
    tally: &mut Tally,
) -> anyhow::Result<()> {
    for id in ids {
        let mut running = 0;
        for node in &stack.nodes {
            if node
                .running
                .host()
                .get(id)
                .await
                .is_some_and(|r| r.state == State::Running)
            {
                running += 1;
            }
        }
        if running > 1 {
            tally.two_running_copies += 1;
        }
        let Some(manifest) = ledger.get::<SandboxDoc>(SANDBOX_KIND, id).await? else {
            tally.lost_sandboxes += 1;
            continue;
        };
        let Some(at) = nodes.iter().position(|(node_id, _)| *node_id == manifest.value.node_id) else {
            tally.lost_sandboxes += 1;
            continue;
        };
        let host = stack.nodes[at].running.host();
        let named_runs = host.get(id).await.is_some_and(|r| r.state == State::Running);
        if !named_runs || manifest.value.lifecycle_owner.is_some() {
            tally.lost_sandboxes += 1;
            continue;
        }
        if std::fs::read_to_string(host.home(id).join("marker.txt"))
            .ok()
            .as_deref()
            != Some(id.as_str())
        {
            tally.files_lost += 1;
        }
    }
    Ok(())
}
