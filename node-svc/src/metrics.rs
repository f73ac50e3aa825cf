//! Each sandbox's metrics as a time series: a sample every few seconds (CPU %, memory used,
//! disk used), kept for an hour, answered for any window (E2B's `GET
//! /sandboxes/{id}/metrics?start&end`).
//!
//! Pure: the node measures (cgroup counters, the writable layer's size) and hands the readings
//! in with the time; this module turns CPU-time counters into percentages and keeps the rings.
//! A paused sandbox goes on being sampled (its CPU is 0, its memory and files are still held);
//! a sandbox that leaves the node leaves its ring behind with it.

use std::collections::{BTreeMap, VecDeque};

/// Samples kept per sandbox: an hour at the default interval of 5 s.
pub const KEPT: usize = 720;

/// One sample of one sandbox.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub at_unix_ms: u64,
    /// Of the sandbox's vCPUs, since the previous sample (100 = all of them busy).
    pub cpu_used_pct: f64,
    pub vcpus: u32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// What its writable layer holds on disk.
    pub disk_used_bytes: u64,
    /// What the filesystem holding that layer can hold.
    pub disk_total_bytes: u64,
}

/// What the node read for one sandbox at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reading {
    pub at_unix_ms: u64,
    /// The sandbox's total CPU time so far, if its runtime counts it.
    pub cpu_time_ns: Option<u64>,
    pub vcpus: u32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub disk_used_bytes: u64,
    pub disk_total_bytes: u64,
}

#[derive(Debug, Default)]
struct Series {
    /// The previous reading's time and CPU counter, for the next rate.
    last_cpu: Option<(u64, u64)>,
    samples: VecDeque<Sample>,
}

/// Every sandbox's series.
#[derive(Debug, Default)]
pub struct Book {
    series: BTreeMap<String, Series>,
}

impl Book {
    /// Adds a reading of `sandbox`; the CPU share is the counter's growth over the time since
    /// the previous reading (0 for the first, and after a counter that went back).
    pub fn record(&mut self, sandbox: &str, reading: Reading) {
        let series = self.series.entry(sandbox.to_string()).or_default();
        let cpu_used_pct = match (series.last_cpu, reading.cpu_time_ns) {
            (Some((then_ms, then_ns)), Some(now_ns)) if now_ns >= then_ns && reading.at_unix_ms > then_ms => {
                let wall_ns = (reading.at_unix_ms - then_ms) as f64 * 1e6;
                let share = (now_ns - then_ns) as f64 / wall_ns / f64::from(reading.vcpus.max(1));
                (share * 100.0).clamp(0.0, 100.0)
            }
            _ => 0.0,
        };
        if let Some(ns) = reading.cpu_time_ns {
            series.last_cpu = Some((reading.at_unix_ms, ns));
        }
        if series.samples.len() == KEPT {
            series.samples.pop_front();
        }
        series.samples.push_back(Sample {
            at_unix_ms: reading.at_unix_ms,
            cpu_used_pct,
            vcpus: reading.vcpus,
            memory_used_bytes: reading.memory_used_bytes,
            memory_total_bytes: reading.memory_total_bytes,
            disk_used_bytes: reading.disk_used_bytes,
            disk_total_bytes: reading.disk_total_bytes,
        });
    }

    /// Samples of `sandbox` taken within `[start, end]` (unix ms), oldest first.
    pub fn window(&self, sandbox: &str, start_ms: u64, end_ms: u64) -> Vec<Sample> {
        self.series.get(sandbox).map_or_else(Vec::new, |s| {
            s.samples
                .iter()
                .filter(|x| x.at_unix_ms >= start_ms && x.at_unix_ms <= end_ms)
                .copied()
                .collect()
        })
    }

    /// Forgets every sandbox not in `live`.
    pub fn retain(&mut self, live: &[String]) {
        self.series.retain(|id, _| live.contains(id));
    }
}

/// Bytes a directory tree takes on disk (allocated blocks, hard links once), walking at most
/// `budget` entries and never following a symlink: a sandbox's layer is its own to fill, and
/// its size must cost the node a bounded walk.
pub fn disk_usage(root: &std::path::Path, budget: usize) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let (mut total, mut walked) = (0u64, 0usize);
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            walked += 1;
            if walked > budget {
                return total;
            }
            let Ok(meta) = entry.metadata() else { continue };
            if meta.nlink() > 1 && !seen.insert((meta.dev(), meta.ino())) {
                continue;
            }
            total += meta.blocks() * 512;
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(at_ms: u64, cpu_ns: u64) -> Reading {
        Reading {
            at_unix_ms: at_ms,
            cpu_time_ns: Some(cpu_ns),
            vcpus: 2,
            memory_used_bytes: 100,
            memory_total_bytes: 1000,
            ..Reading::default()
        }
    }

    #[test]
    fn cpu_is_the_counters_growth_over_the_sandboxs_vcpus() {
        let mut book = Book::default();
        book.record("s", reading(1_000, 0));
        // 1 s of CPU over 1 s of wall time, on 2 vCPUs: half of them.
        book.record("s", reading(2_000, 1_000_000_000));
        // A counter that went back (its group made anew): no rate, not a negative one.
        book.record("s", reading(3_000, 10));
        let samples = book.window("s", 0, u64::MAX);
        let cpu: Vec<f64> = samples.iter().map(|s| s.cpu_used_pct).collect();
        assert_eq!(cpu, vec![0.0, 50.0, 0.0]);
        assert_eq!(
            book.window("s", 1_500, 2_500).len(),
            1,
            "the window is inclusive and in ms"
        );
        assert!(book.window("other", 0, u64::MAX).is_empty());
    }

    #[test]
    fn an_hour_is_kept_and_gone_sandboxes_are_forgotten() {
        let mut book = Book::default();
        for i in 0..(KEPT as u64 + 10) {
            book.record("s", reading(i * 5_000, i));
        }
        let samples = book.window("s", 0, u64::MAX);
        assert_eq!(samples.len(), KEPT);
        assert_eq!(samples[0].at_unix_ms, 10 * 5_000, "the oldest went first");
        book.record("t", reading(0, 0));
        book.retain(&["t".to_string()]);
        assert!(book.window("s", 0, u64::MAX).is_empty());
        assert_eq!(book.window("t", 0, u64::MAX).len(), 1);
    }

    #[test]
    fn disk_usage_counts_blocks_once_and_stops_at_its_budget() {
        let dir = std::env::temp_dir().join(format!("disk-usage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/a"), vec![1u8; 64 << 10]).unwrap();
        std::fs::hard_link(dir.join("sub/a"), dir.join("b")).unwrap();
        std::os::unix::fs::symlink("/usr", dir.join("outside")).unwrap();
        let used = disk_usage(&dir, 1_000);
        assert!((64 << 10..(64 << 10) + (64 << 10)).contains(&used), "{used}");
        assert!(disk_usage(&dir, 1) < used, "a budget of one entry stops early");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
