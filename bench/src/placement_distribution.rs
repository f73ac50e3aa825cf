//! `bench placement-distribution`: stale, optimistic and reconciled accounting side by side,
//! on a seeded virtual clock (see `placement_svc::sim`), for one scenario or all of them.
//!
//! Besides the three modes, each scenario reports `reference_full_scan_cv`: reconciled
//! accounting with every node scored (K = N). It is what exact knowledge can achieve at that
//! scale, so the sampling noise of Best-of-3 is not mistaken for an accounting error. `cv` is
//! taken the moment the last create lands (E2B's figure); `cv_mean` averages it over one
//! sample a second while creates arrive, the steady-state figure for steady traffic.

use std::time::Instant;

use anyhow::bail;
use placement_svc::core::{Accounting, RankConfig};
use placement_svc::sim::{self, ModeResult, Scenario};
use serde_json::{json, Map, Value};

use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// e2b, delayed-heartbeat, short-lived, replicas3, or all.
    #[arg(long, default_value = "e2b")]
    scenario: String,
    /// Seed of the simulation (each scenario has its own default).
    #[arg(long)]
    seed: Option<u64>,
    /// Nodes each decision samples (Best-of-K; the placer's default is 3).
    #[arg(long)]
    k: Option<usize>,
}

fn mode_json(r: &ModeResult) -> Value {
    json!({
        "cv": round(r.cv),
        "cv_mean": round(r.cv_mean),
        "max": r.max,
        "min": r.min,
        "placed": r.placed,
        "rejected": r.rejected,
        "accounting_error_max": r.accounting_error_max,
        "placed_cv": round(r.placed_cv),
        "load_cv": round(r.load_cv),
    })
}

fn round(x: f64) -> f64 {
    (x * 10_000.0).round() / 10_000.0
}

fn one(name: &str, seed: Option<u64>, k: Option<usize>) -> anyhow::Result<(Value, Vec<String>)> {
    let Some(mut scenario) = Scenario::named(name) else {
        bail!("unknown scenario {name:?}; one of {:?} or all", Scenario::NAMES);
    };
    if let Some(seed) = seed {
        scenario.seed = seed;
    }
    let mut rank = RankConfig::default();
    if let Some(k) = k {
        rank.k = k.max(1);
    }
    let mut object = Map::new();
    object.insert("scenario".into(), json!(name));
    let mut lines = vec![format!(
        "{name}: {} nodes, Best-of-{}, {} placer(s), heartbeat every {} ms arriving {} ms after measurement, create RPC {} ms, seed {}",
        scenario.nodes,
        rank.k,
        scenario.placers,
        scenario.heartbeat_interval_ms,
        scenario.heartbeat_delay_ms,
        scenario.create_rpc_ms,
        scenario.seed
    )];
    lines.push(format!(
        "  {:<11} {:>7} {:>7} {:>5} {:>5} {:>7} {:>9} {:>14} {:>9} {:>8}",
        "mode", "cv", "cv_mean", "max", "min", "placed", "rejected", "acct_err_vcpu", "placed_cv", "load_cv"
    ));
    for mode in Accounting::ALL {
        let started = Instant::now();
        let r = sim::run(&scenario, mode, &rank);
        lines.push(format!(
            "  {:<11} {:>7.4} {:>7.4} {:>5} {:>5} {:>7} {:>9} {:>14} {:>9.4} {:>8.4}   ({} ms)",
            mode.name(),
            r.cv,
            r.cv_mean,
            r.max,
            r.min,
            r.placed,
            r.rejected,
            r.accounting_error_max,
            r.placed_cv,
            r.load_cv,
            started.elapsed().as_millis()
        ));
        object.insert(mode.name().into(), mode_json(&r));
    }
    if scenario.templates > 0 {
        // The same traffic placed blind to templates: what the template term buys (cold
        // starts avoided) and costs (spread).
        let with = sim::run(&scenario, Accounting::Reconciled, &rank);
        let blind = sim::run(
            &scenario,
            Accounting::Reconciled,
            &RankConfig {
                template_weight: 0.0,
                ..rank.clone()
            },
        );
        lines.push(format!(
            "  templates ({} of them, weight {}): cold starts {} vs {} placing blind to them; cv_mean {:.4} vs {:.4} ({:.2}x)",
            scenario.templates,
            rank.template_weight,
            with.cold_starts,
            blind.cold_starts,
            with.cv_mean,
            blind.cv_mean,
            with.cv_mean / blind.cv_mean.max(1e-9)
        ));
        object.insert("cold_starts".into(), json!(with.cold_starts));
        object.insert("cold_starts_blind".into(), json!(blind.cold_starts));
        object.insert("cv_mean_blind".into(), json!(round(blind.cv_mean)));
        object.insert(
            "cv_mean_over_blind".into(),
            json!(round(with.cv_mean / blind.cv_mean.max(1e-9))),
        );
    }
    let full = sim::run(
        &scenario,
        Accounting::Reconciled,
        &RankConfig {
            k: scenario.nodes,
            ..rank
        },
    );
    lines.push(format!(
        "  reference (reconciled, every node scored): cv {:.4}, cv_mean {:.4}",
        full.cv, full.cv_mean
    ));
    object.insert("reference_full_scan_cv".into(), json!(round(full.cv)));
    object.insert("reference_full_scan_cv_mean".into(), json!(round(full.cv_mean)));
    Ok((Value::Object(object), lines))
}

pub fn run(args: Args) -> anyhow::Result<Report> {
    let names: Vec<&str> = if args.scenario == "all" {
        Scenario::NAMES.to_vec()
    } else {
        vec![args.scenario.as_str()]
    };
    let mut report = Report::new("placement-distribution: sandboxes per node by accounting mode");
    let mut results = Vec::new();
    for name in names {
        let (value, lines) = one(name, args.seed, args.k)?;
        for line in lines {
            report.line(line);
        }
        results.push(value);
    }
    if results.len() == 1 {
        report.merge(results.remove(0));
    } else {
        report.merge(json!({ "scenarios": results }));
    }
    Ok(report)
}
