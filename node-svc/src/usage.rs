//! CPU usage for heartbeats: vCPUs the node's sandboxes use, from a counter of CPU time that
//! only grows (the node's cpuacct group). Pure: the caller reads the counter and the clock.
//!
//! A rate needs two readings some time apart. Heartbeats and `Info` calls both ask; a reading
//! closer than [`MIN_WINDOW`] to the last one answers the last rate instead of dividing a few
//! microseconds of CPU by a few microseconds of wall time.

use std::time::{Duration, Instant};

/// Shortest interval a rate is computed over.
pub const MIN_WINDOW: Duration = Duration::from_millis(500);

/// The last reading and the rate it gave.
#[derive(Debug, Default)]
pub struct CpuRate {
    last: Option<(Instant, u64)>,
    rate: f64,
}

impl CpuRate {
    /// Takes a reading of `cpu_ns` (total CPU time) at `at`; returns vCPUs used since the
    /// previous reading (0 for the first). A counter that went back (its group was made
    /// anew) starts over.
    pub fn observe(&mut self, at: Instant, cpu_ns: u64) -> f64 {
        match self.last {
            Some((_, used)) if cpu_ns < used => {
                self.last = Some((at, cpu_ns));
                self.rate = 0.0;
            }
            Some((then, used)) => {
                let wall = at.saturating_duration_since(then);
                if wall >= MIN_WINDOW {
                    self.rate = (cpu_ns - used) as f64 / wall.as_nanos() as f64;
                    self.last = Some((at, cpu_ns));
                }
            }
            None => self.last = Some((at, cpu_ns)),
        }
        self.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn two_busy_cores_read_as_two_vcpus() {
        let t0 = Instant::now();
        let mut r = CpuRate::default();
        assert_eq!(r.observe(t0, 10 * S), 0.0);
        let rate = r.observe(t0 + Duration::from_secs(1), 12 * S);
        assert!((rate - 2.0).abs() < 1e-9, "{rate}");
    }

    #[test]
    fn a_reading_inside_the_window_answers_the_last_rate() {
        let t0 = Instant::now();
        let mut r = CpuRate::default();
        r.observe(t0, 0);
        r.observe(t0 + Duration::from_secs(1), S / 2);
        // 1 ms later with a burst of CPU: not a rate of 1,000 vCPUs.
        let rate = r.observe(t0 + Duration::from_millis(1001), S / 2 + S);
        assert!((rate - 0.5).abs() < 1e-9, "{rate}");
        // The window counts from the last reading used, so the burst shows next time.
        let rate = r.observe(t0 + Duration::from_secs(2), 3 * S / 2);
        assert!((rate - 1.0).abs() < 1e-9, "{rate}");
    }

    #[test]
    fn a_counter_that_went_back_starts_over() {
        let t0 = Instant::now();
        let mut r = CpuRate::default();
        r.observe(t0, 5 * S);
        assert_eq!(r.observe(t0 + Duration::from_secs(1), S), 0.0);
        let rate = r.observe(t0 + Duration::from_secs(2), 2 * S);
        assert!((rate - 1.0).abs() < 1e-9, "{rate}");
    }
}
