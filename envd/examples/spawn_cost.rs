//! What starting a command as another user costs envd, std's way (fork, then exec) against
//! envd's own ([`envd::spawn`]: clone with CLONE_VM | CLONE_VFORK, then exec), alternated in
//! one process of envd's size so the machine's noise falls on both alike. Run as root (the
//! command runs as nobody): `cargo run --release -p envd --example spawn_cost`. Ends with one
//! JSON object of figures.

use std::process::Stdio;
use std::time::Instant;

const ROUNDS: usize = 400;
const NOBODY: u32 = 65534;

fn p50(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let (mut forked, mut cloned) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let started = Instant::now();
            let mut cmd = tokio::process::Command::new("/bin/true");
            cmd.uid(NOBODY)
                .gid(NOBODY)
                .process_group(0)
                .current_dir("/tmp")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn()?.wait().await?;
            forked.push(started.elapsed().as_secs_f64() * 1e3);

            let started = Instant::now();
            let mut cmd = envd::spawn::Command::new("/bin/true");
            cmd.ids(NOBODY, NOBODY).current_dir("/tmp");
            use envd::spawn::Stdio as S;
            cmd.spawn(S::Null, S::Piped, S::Piped)?.wait().await?;
            cloned.push(started.elapsed().as_secs_f64() * 1e3);
        }
        let (forked, cloned) = (p50(&mut forked), p50(&mut cloned));
        println!(
            "{}",
            serde_json::json!({
                "rounds": ROUNDS,
                "std_fork_p50_ms": (forked * 1000.0).round() / 1000.0,
                "envd_spawn_p50_ms": (cloned * 1000.0).round() / 1000.0,
                "ratio": (cloned / forked * 100.0).round() / 100.0,
            })
        );
        Ok(())
    })
}
