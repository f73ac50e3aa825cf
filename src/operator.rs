//! The operator's commands: thin clients of balance-svc's gRPC API that print for people.

use anyhow::Context;
use proto::balance::v1 as pb;
use proto::balance::v1::balance_client::BalanceClient;
use tonic::transport::Channel;

async fn connect(endpoint: &str) -> anyhow::Result<BalanceClient<Channel>> {
    BalanceClient::connect(endpoint.to_string())
        .await
        .with_context(|| format!("cannot reach balance-svc at {endpoint} (is `sandboxsched up` running?)"))
}

fn failed(status: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("balance-svc: {} ({:?})", status.message(), status.code())
}

pub async fn status(endpoint: &str) -> anyhow::Result<()> {
    let s = connect(endpoint)
        .await?
        .status(pb::StatusRequest {})
        .await
        .map_err(failed)?
        .into_inner();
    let o = s.observation.unwrap_or_default();
    println!(
        "observation   {} (spread {:.3}, {} ready nodes)",
        o.status, o.spread, o.ready_nodes
    );
    println!(
        "executor      {}",
        if s.leader {
            "this replica"
        } else {
            "another replica (or none yet)"
        }
    );
    println!("balancing     {}", if s.paused { "paused" } else { "active" });
    println!(
        "active plan   {}",
        if s.active_plan_id.is_empty() {
            "-"
        } else {
            &s.active_plan_id
        }
    );
    println!(
        "draining      {}",
        if s.draining_nodes.is_empty() {
            "-".to_string()
        } else {
            s.draining_nodes.join(", ")
        }
    );
    let mut counts: Vec<_> = o.counts.into_iter().collect();
    counts.sort();
    for (status, n) in counts {
        println!("  {n:>8}  {status}");
    }
    Ok(())
}

fn print_plan(p: &pb::PlanView) {
    println!(
        "{}  {:<8} {:<7} spread {:.3} -> {:.3} expected, {} move(s)",
        p.plan_id,
        p.state,
        p.reason,
        p.spread_before,
        p.spread_expected,
        p.moves.len()
    );
    for m in &p.moves {
        let error = if m.error.is_empty() {
            String::new()
        } else {
            format!("  ({})", m.error)
        };
        println!(
            "    {:<14} {} {} -> {}  {} MiB  downtime {} ms{error}",
            m.step,
            m.sandbox_id,
            m.from_node,
            m.to_node,
            m.memory_bytes >> 20,
            m.downtime_ms
        );
    }
}

pub async fn history(endpoint: &str, limit: u32) -> anyhow::Result<()> {
    let plans = connect(endpoint)
        .await?
        .history(pb::HistoryRequest { limit })
        .await
        .map_err(failed)?
        .into_inner()
        .plans;
    if plans.is_empty() {
        println!("no plans yet");
    }
    plans.iter().for_each(print_plan);
    Ok(())
}

pub async fn plan(endpoint: &str, plan_id: &str) -> anyhow::Result<()> {
    let plan = connect(endpoint)
        .await?
        .get_plan(pb::GetPlanRequest {
            plan_id: plan_id.to_string(),
        })
        .await
        .map_err(failed)?
        .into_inner();
    print_plan(&plan);
    Ok(())
}

pub async fn drain(endpoint: &str, node_id: &str, undo: bool) -> anyhow::Result<()> {
    let answer = connect(endpoint)
        .await?
        .drain(pb::DrainRequest {
            node_id: node_id.to_string(),
            undo,
        })
        .await
        .map_err(failed)?
        .into_inner();
    if undo {
        println!("{node_id} is ready again");
    } else {
        println!(
            "{node_id} is draining: {} running sandbox(es) to move",
            answer.remaining_sandboxes
        );
    }
    Ok(())
}

pub async fn balancing(endpoint: &str, pause: bool) -> anyhow::Result<()> {
    let s = connect(endpoint)
        .await?
        .set_paused(pb::SetPausedRequest { paused: pause })
        .await
        .map_err(failed)?
        .into_inner();
    println!("balancing {}", if s.paused { "paused" } else { "resumed" });
    Ok(())
}
