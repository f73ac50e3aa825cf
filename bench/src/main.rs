//! `bench`: the project's benchmarks, one subcommand each.
//!
//! Every scenario prints a readable table; with `--json` the output ends with one line holding
//! one JSON object with the figures. Ratios measured within one run are what to compare: this
//! machine is shared and noisy.

mod balance_convergence;
mod chaos;
mod code_interpreter;
mod console;
mod fixture;
mod gateway_create;
mod host_cpu;
mod kernel_floor;
mod ledger_cas;
mod migration;
mod move_faults;
mod node;
mod placement_distribution;
mod placement_throughput;
mod proxy;
mod report;
mod soak;
mod template_build;
mod warm_pool;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(version, about = "sandboxsched benchmarks")]
struct Cli {
    /// End the output with one JSON object holding the figures.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand, Debug)]
enum Scenario {
    /// Ledger compare-and-swap throughput, and plan commits under node-document churn.
    LedgerCas(ledger_cas::Args),
    /// The three accounting modes side by side on a seeded virtual clock.
    PlacementDistribution(placement_distribution::Args),
    /// placement-svc on Redis with 1,000 nodes: closed-loop rate, open-loop latency, pure decisions.
    PlacementThroughput(placement_throughput::Args),
    /// node-svc with containers: lifecycle latency, runc compared, a command through envd,
    /// idle cost, density, and a 100 MB snapshot+restore.
    Node(node::Args),
    /// Creates through the E2B REST API until running (then a kill): latency and throughput.
    GatewayCreate(gateway_create::Args),
    /// The balance planner on a simulated, skewed cluster (or a grid of them): moves against a
    /// lower bound, cycles to converge, and small clusters against the exact optimum.
    BalanceConvergence(balance_convergence::Args),
    /// One sandbox (a container) with 100 MB of files moved by the balance executor: downtime.
    Migration(migration::Args),
    /// Moves with a seeded fraction of lost replies and executor deaths: invariants counted.
    MoveFaults(move_faults::Args),
    /// The gateway's data path to a container: a command, a port request against the same
    /// from the node, a download from a port, 1 GiB through /files with peak memory.
    Proxy(proxy::Args),
    TemplateBuild(template_build::Args),
    /// E2B's code interpreter through the gateway: its template's build, cold creates to the
    /// first result, `run_code` round trips, the stream's delay, an idle sandbox's memory.
    CodeInterpreter(code_interpreter::Args),
    /// The operator's console over 1,000 simulated nodes and 10,000 sandboxes: its pages'
    /// time to serve, a search, a ledger change's delay to the browser, its memory.
    Console(console::Args),
    /// A seeded fault suite: a multi-process cluster under a client workload while services
    /// are killed and nodes cut off, then a history checker (lost, duplicated, files lost,
    /// accounting error, stuck, leaked).
    Chaos(chaos::Args),
    /// The fault suite's cluster and workload without faults, for a long time: resident
    /// memory and open descriptors of every service sampled, growth after warm-up.
    Soak(soak::Args),
}

#[global_allocator]
static ALLOCATOR: common::Allocator = common::Allocator;

fn main() -> anyhow::Result<std::process::ExitCode> {
    // The benchmarks start node-svcs in this process, whose containers run envd and the
    // runtime from this very binary (`bench envd ...`, `bench jail ...`).
    if let Some(code) = node_svc::multicall() {
        return Ok(code);
    }
    tokio::runtime::Runtime::new()?.block_on(run())?;
    Ok(std::process::ExitCode::SUCCESS)
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let report = match cli.scenario {
        Scenario::LedgerCas(args) => ledger_cas::run(args).await?,
        Scenario::PlacementDistribution(args) => placement_distribution::run(args)?,
        Scenario::PlacementThroughput(args) => placement_throughput::run(args).await?,
        Scenario::Node(args) => node::run(args).await?,
        Scenario::GatewayCreate(args) => gateway_create::run(args).await?,
        Scenario::BalanceConvergence(args) => balance_convergence::run(args)?,
        Scenario::Migration(args) => migration::run(args).await?,
        Scenario::MoveFaults(args) => move_faults::run(args).await?,
        Scenario::Proxy(args) => proxy::run(args).await?,
        Scenario::TemplateBuild(args) => template_build::run(args).await?,
        Scenario::CodeInterpreter(args) => code_interpreter::run(args).await?,
        Scenario::Console(args) => console::run(args).await?,
        Scenario::Chaos(args) => chaos::run(args).await?,
        Scenario::Soak(args) => soak::run(args).await?,
    };
    report.print(cli.json);
    Ok(())
}
