//! `bench migration`: one sandbox (a container) holding 100 MB of files moved between two
//! node-svcs by balance-svc's executor (own, pause, stream snapshot into restore, resume,
//! switch, delete the source), on a ledger in SQLite. `downtime_ms` is paused-to-resumed.

use std::time::Instant;

use anyhow::Context;
use balance_svc::migrate::Mover;
use balance_svc::record::{PlanDoc, Step, PLAN_KIND};
use ledger_client::Txn;
use node_svc::server::RunningNode;

use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Megabytes of files in the moved sandbox.
    #[arg(long, default_value_t = 100)]
    mb: usize,
    /// Moves measured (back and forth); the median is reported.
    #[arg(long, default_value_t = 5)]
    moves: usize,
    /// The services talk without TLS (a stack is mutual TLS otherwise), to see what TLS costs
    /// a snapshot's stream.
    #[arg(long)]
    plaintext: bool,
    /// The nodes give the sandbox no disk of its own (its files in a plain folder), to see
    /// what the disk costs a move.
    #[arg(long)]
    no_disks: bool,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    // Two nodes that report to nobody: the mover is driven directly, with no planner.
    let mut stack = stack::Stack::builder();
    if args.plaintext {
        stack = stack.plaintext();
    }
    let own_disks = !args.no_disks;
    let stack = stack
        .node(move |c| {
            c.placement = None;
            c.host.own_disks = own_disks;
        })
        .node(move |c| {
            c.placement = None;
            c.host.own_disks = own_disks;
        })
        .start()
        .await?;
    let client = stack.ledger_client.clone();
    let nodes: Vec<(String, &RunningNode)> = stack.nodes.iter().map(|n| (n.id.clone(), &n.running)).collect();
    let id = "moving";
    crate::fixture::running_sandbox(
        &client,
        &stack.certs,
        nodes[0].1,
        (&nodes[0].0, &nodes[0].1.endpoint()),
        id,
        256 << 20,
    )
    .await?;
    let block: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let home = nodes[0].1.host().home(id);
    for f in 0..args.mb {
        std::fs::write(home.join(format!("data-{f:03}.bin")), &block).context("writing sandbox files")?;
    }

    let mover = Mover::new(client.clone(), None, balance_svc::migrate::Budget::SERIAL)
        .with_security(stack.security(stack::Role::Balance));
    let (mut downtime, mut total, mut rate) = (Vec::new(), Vec::new(), Vec::new());
    for n in 0..args.moves {
        let (from, to) = if n.is_multiple_of(2) { (0, 1) } else { (1, 0) };
        let plan_id = format!("bench-{n}");
        let plan = PlanDoc::one_move(
            &plan_id,
            id,
            (&nodes[from].0, &nodes[from].1.endpoint()),
            (&nodes[to].0, &nodes[to].1.endpoint()),
            256 << 20,
        );
        client.compare(Txn::new().create(PLAN_KIND, &plan_id, &plan)?).await?;
        let committed = client
            .get::<PlanDoc>(PLAN_KIND, &plan_id)
            .await?
            .context("plan just written")?;
        let started = Instant::now();
        let done = mover.execute(committed).await?;
        let elapsed = started.elapsed();
        let record = &done.moves[0];
        anyhow::ensure!(
            record.step == Step::Done,
            "the move ended {:?}: {:?}",
            record.step,
            record.error
        );
        let moved = nodes[to].1.host().home(id).join("data-000.bin");
        anyhow::ensure!(std::fs::read(moved)? == block, "the moved files differ");
        let d = record.downtime_ms().unwrap_or(0) as f64;
        downtime.push(d);
        total.push(elapsed.as_secs_f64() * 1000.0);
        rate.push(args.mb as f64 / (d.max(1.0) / 1000.0));
    }
    drop(nodes);
    stack.shut_down().await;

    let mut report = Report::new(format!(
        "migration: one container with {} MB of files, {} moves between two node-svcs (medians, {})",
        args.mb,
        args.moves,
        if args.plaintext { "plaintext gRPC" } else { "mutual TLS" }
    ));
    report
        .figure("downtime_ms", median(downtime), "ms paused -> resumed (goal < 1000)")
        .figure(
            "move_ms",
            (median(total) * 10.0).round() / 10.0,
            "ms whole move, own to source deleted",
        )
        .figure(
            "mb_per_sec",
            (median(rate) * 10.0).round() / 10.0,
            "MB/s during the downtime",
        );
    Ok(report)
}
