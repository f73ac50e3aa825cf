//! The whole host's busy CPU time, from `/proc/stat`: what a load costs in CPU, counted
//! wherever the kernel spends it (the process under test, the programs it starts, and the
//! kernel's own threads, such as the workers that tear down a dead network namespace), which
//! no one process's `getrusage` sees.
//!
//! A busy time is a count of CPU-milliseconds, so a load's cost per operation divides by the
//! operations done; the cores the host has then bound the operations per second that cost
//! allows, whatever the load's concurrency. Other programs on a shared host add to it: read it
//! as an upper bound, compared within one run.

use std::io;

/// `/proc/stat`'s unit: the kernel's `USER_HZ`, 100 ticks a second on every architecture
/// Linux exports it for (it is ABI, whatever the kernel's own tick rate).
const TICK_MS: f64 = 10.0;

/// One reading of the host's CPU counters.
#[derive(Clone, Copy, Debug)]
pub struct HostCpu {
    /// CPU-milliseconds spent busy (user, nice, system, irq, softirq, steal), all CPUs.
    pub busy_ms: f64,
    /// The CPUs `/proc/stat` counts.
    pub cores: usize,
}

impl HostCpu {
    pub fn read() -> io::Result<Self> {
        parse(&std::fs::read_to_string("/proc/stat")?)
            .ok_or_else(|| io::Error::other("/proc/stat has no 'cpu' line of at least 8 fields"))
    }

    /// CPU-milliseconds busy since `earlier`.
    pub fn since(&self, earlier: &HostCpu) -> f64 {
        self.busy_ms - earlier.busy_ms
    }
}

/// The busy time of `/proc/stat`'s first line (`cpu user nice system idle iowait irq softirq
/// steal ...`), and its `cpuN` lines counted.
fn parse(stat: &str) -> Option<HostCpu> {
    let total = stat.lines().next()?.strip_prefix("cpu ")?;
    let ticks: Vec<u64> = total
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let busy: u64 = [0, 1, 2, 5, 6, 7]
        .iter()
        .map(|&i| ticks.get(i).copied())
        .sum::<Option<u64>>()?;
    let cores = stat
        .lines()
        .filter(|l| {
            l.strip_prefix("cpu")
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count();
    Some(HostCpu {
        busy_ms: busy as f64 * TICK_MS,
        cores: cores.max(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_leaves_out_idle_and_iowait() {
        let stat =
            "cpu  100 1 20 5000 70 3 4 2 0 0\ncpu0 50 1 10 2500 35 1 2 1 0 0\ncpu1 50 0 10 2500 35 2 2 1 0 0\nintr 1\n";
        let cpu = parse(stat).expect("parses");
        assert_eq!(cpu.busy_ms, (100 + 1 + 20 + 3 + 4 + 2) as f64 * TICK_MS);
        assert_eq!(cpu.cores, 2);
    }

    #[test]
    fn a_short_or_foreign_first_line_is_refused() {
        assert!(parse("cpu  1 2 3\n").is_none());
        assert!(parse("intr 1 2 3 4 5 6 7 8\n").is_none());
        assert!(parse("cpu  1 2 x 4 5 6 7 8\n").is_none());
    }
}
