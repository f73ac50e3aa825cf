//! The seeded skewed clusters `bench balance-convergence` measures the planner on, and the
//! planner's regression tests hold it to: one generator, so the two cannot drift apart.
//! Built for tests and with the `skewed` feature (the benchmark's).

use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Each node's capacity in these clusters.
pub const NODE_BYTES: u64 = 64 * GIB;

/// 64 GiB nodes, `sandboxes` of 128-768 MiB dealt round-robin (an even cluster to start
/// from), then each of the first `hot` nodes takes sandboxes (in ID order, `sbx-{i:05}`, each
/// with probability 1/2) from the others until 5 GiB are left free. Returns each sandbox's
/// (node, bytes), sandbox `i` at index `i`.
pub fn cluster(nodes: usize, sandboxes: usize, hot: usize, seed: u64) -> Vec<(usize, u64)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut placed: Vec<(usize, u64)> = (0..sandboxes)
        .map(|i| (i % nodes, rng.random_range(128u64..=768) * MIB))
        .collect();
    // IDs are "sbx-{i:05}": for fewer than 100,000 sandboxes their order is i's.
    assert!(
        sandboxes <= 100_000,
        "sandbox IDs sort as their numbers only below 100,000"
    );
    for h in 0..hot.min(nodes) {
        let mut used: u64 = placed.iter().filter(|(n, _)| *n == h).map(|(_, m)| m).sum();
        for entry in placed.iter_mut() {
            let (at, bytes) = *entry;
            if at < hot || used + bytes > NODE_BYTES - 5 * GIB {
                continue;
            }
            if rng.random_bool(0.5) {
                *entry = (h, bytes);
                used += bytes;
            }
        }
    }
    placed
}
