//! The seeded fault suite, short: `bench chaos` for 60 s of faults (SIGKILLs of every kind of
//! service, an empty Redis restart, nodes cut off from placement) under four clients and an
//! operator draining nodes, then the history checker. Nothing acknowledged may be lost or
//! duplicated, no acknowledged file may be lost, the accounting must be exact, nothing stuck
//! or leaked. Then a planted loss (a sandbox killed on its node behind the control plane's
//! back) must be caught, so the checker is shown to fail when it should.
//!
//! Needs root (containers), PostgreSQL, `redis-server` and the service binaries:
//! `scripts/services` starts and installs what is missing; `cargo test --workspace` builds the
//! binaries.

use std::process::Command;

#[test]
fn a_seeded_fault_schedule_loses_nothing_and_a_planted_loss_is_caught() {
    let seed = std::env::var("CHAOS_SEED").unwrap_or_else(|_| "7".into());
    let output = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args([
            "chaos",
            "--seed",
            &seed,
            "--seconds",
            "60",
            "--settle-secs",
            "60",
            "--plant-loss",
            "--json",
        ])
        .output()
        .expect("bench runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench chaos failed:\n{stdout}\n{stderr}");
    let last = stdout.lines().last().unwrap_or_default();
    let figures: serde_json::Value =
        serde_json::from_str(last).unwrap_or_else(|e| panic!("no JSON at the end ({e}):\n{stdout}\n{stderr}"));
    let figure = |key: &str| {
        figures[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} missing:\n{stdout}"))
    };
    for invariant in [
        "lost",
        "duplicated",
        "files_lost",
        "accounting_error",
        "stuck_manifests",
        "leaked",
    ] {
        assert_eq!(
            figure(invariant),
            0,
            "{invariant} under seed {seed}:\n{stdout}\n{stderr}"
        );
    }
    // The run did something worth checking.
    assert!(figure("faults_injected") >= 10, "{stdout}");
    assert!(figure("acked_creates") >= 10, "{stdout}");
    assert!(figure("files_checked") >= 5, "{stdout}");
    assert_eq!(
        figures["planted_loss_caught"], true,
        "the checker missed a planted loss:\n{stdout}\n{stderr}"
    );
}
