//! Pauses between retries: exponential from `min` to `max`, each with random jitter, so
//! replicas that lost the same peer at the same instant do not all come back in lockstep.

use std::time::Duration;

use backon::BackoffBuilder;

/// The pauses before each retry, without end: exponential from `min`, capped at `max`, with
/// jitter. Start a new one after a success.
pub fn backoff(min: Duration, max: Duration) -> impl Iterator<Item = Duration> + Send {
    backon::ExponentialBuilder::new()
        .with_min_delay(min)
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_grow_to_the_cap_and_jitter_apart() {
        let (min, max) = (Duration::from_millis(10), Duration::from_millis(80));
        let pauses: Vec<Duration> = backoff(min, max).take(12).collect();
        assert_eq!(pauses.len(), 12, "it never ends");
        // Jitter adds at most one more pause's worth on top of the exponential value.
        assert!(pauses.iter().all(|p| *p >= min && *p <= max * 2), "{pauses:?}");
        assert!(
            pauses[8..].iter().all(|p| *p >= max),
            "capped at max plus jitter: {pauses:?}"
        );
        let other: Vec<Duration> = backoff(min, max).take(12).collect();
        assert_ne!(pauses, other, "two retriers do not pause alike");
    }
}
