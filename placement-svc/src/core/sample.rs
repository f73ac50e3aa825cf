//! Sampling k distinct indices out of n in O(k) time and space (Robert Floyd's algorithm), so
//! a Best-of-K decision over a thousand nodes touches three of them, not a thousand.

use rand::Rng;

/// `k` distinct indices in `0..n`, in random order (all of them when `k >= n`).
pub fn sample_distinct(n: usize, k: usize, rng: &mut impl Rng) -> Vec<usize> {
    let k = k.min(n);
    let mut chosen: Vec<usize> = Vec::with_capacity(k);
    for j in (n - k)..n {
        let t = rng.random_range(0..=j);
        // `chosen` is tiny (k is 3 to 12), so a linear search beats hashing.
        let pick = if chosen.contains(&t) { j } else { t };
        chosen.push(pick);
    }
    // Floyd's set is uniform but its order is not; shuffle so "first feasible" is fair too.
    for i in (1..chosen.len()).rev() {
        let j = rng.random_range(0..=i);
        chosen.swap(i, j);
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    #[test]
    fn distinct_in_range_and_roughly_uniform() {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut hits = [0u32; 10];
        for _ in 0..30_000 {
            let s = sample_distinct(10, 3, &mut rng);
            assert_eq!(s.len(), 3);
            assert!(s[0] != s[1] && s[1] != s[2] && s[0] != s[2]);
            for i in s {
                hits[i] += 1;
            }
        }
        // Each index is expected 9,000 times.
        assert!(hits.iter().all(|&h| (8_400..9_600).contains(&h)), "{hits:?}");
        assert_eq!(sample_distinct(2, 5, &mut rng).len(), 2);
        assert!(sample_distinct(0, 3, &mut rng).is_empty());
    }
}
