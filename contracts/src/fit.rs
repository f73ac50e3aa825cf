//! The one rule for whether a node's allocation can take a sandbox: CPU with over-commit,
//! memory without.
//!
//! Placement applies it to every create and the balancer to every move it plans, and then
//! placement applies it once more when it reserves the move's target. If the two sides had
//! their own copies, a planner that thought a target had room would keep planning moves that
//! placement refuses (or the reverse: placement would admit creates that a move had already
//! counted on). One function, two callers.
//!
//! Allocation is what sandboxes *asked for* (vCPUs and memory of their templates or requests),
//! not what they measure: a sandbox may grow to what it asked for, so a node must be able to
//! hold every ask at once. The balancer levels *measured* memory, and a move must satisfy both.

use std::fmt;

use crate::docs::Capacity;

/// CPU over-commit R by default: a node may hold R times its vCPUs in allocations. Memory is
/// never over-committed (an over-committed node is one OOM kill away from losing a sandbox).
pub const DEFAULT_CPU_OVERCOMMIT: f64 = 4.0;

/// What a node has allocated. Signed: optimistic accounting can transiently go below zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    pub vcpus: i64,
    pub memory_bytes: i64,
}

impl Allocation {
    /// Adds `ask` (a sandbox arrives).
    pub fn add(&mut self, ask: &Capacity) {
        self.vcpus += i64::from(ask.vcpus);
        self.memory_bytes = self.memory_bytes.saturating_add(bytes(ask.memory_bytes));
    }

    /// Subtracts `ask` (a sandbox leaves).
    pub fn sub(&mut self, ask: &Capacity) {
        self.vcpus -= i64::from(ask.vcpus);
        self.memory_bytes = self.memory_bytes.saturating_sub(bytes(ask.memory_bytes));
    }
}

fn bytes(b: u64) -> i64 {
    i64::try_from(b).unwrap_or(i64::MAX)
}

/// Why a node cannot take a sandbox.
#[derive(Clone, Debug, PartialEq)]
pub enum Misfit {
    /// The vCPUs allocated afterwards would exceed `overcommit` × the node's vCPUs.
    Cpu { after: f64, limit: f64, overcommit: f64 },
    /// The memory allocated afterwards would exceed the node's memory.
    Memory { after_bytes: f64, capacity_bytes: u64 },
}

impl fmt::Display for Misfit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Misfit::Cpu {
                after,
                limit,
                overcommit,
            } => write!(f, "cpu: {after} vCPU would exceed {limit} (R={overcommit})"),
            Misfit::Memory {
                after_bytes,
                capacity_bytes,
            } => write!(
                f,
                "memory: {} MiB would exceed {} MiB",
                (after_bytes / 1048576.0) as u64,
                capacity_bytes >> 20
            ),
        }
    }
}

/// Whether a node of `capacity` that has `allocated` can also take `ask`.
pub fn check(capacity: &Capacity, allocated: Allocation, ask: &Capacity, cpu_overcommit: f64) -> Result<(), Misfit> {
    let limit = f64::from(capacity.vcpus) * cpu_overcommit;
    let after = allocated.vcpus as f64 + f64::from(ask.vcpus);
    if after > limit {
        return Err(Misfit::Cpu {
            after,
            limit,
            overcommit: cpu_overcommit,
        });
    }
    let after_bytes = allocated.memory_bytes as f64 + ask.memory_bytes as f64;
    if after_bytes > capacity.memory_bytes as f64 {
        return Err(Misfit::Memory {
            after_bytes,
            capacity_bytes: capacity.memory_bytes,
        });
    }
    Ok(())
}

/// How much of `allocated` must go before a node of `capacity` can take `ask`: vCPUs and
/// bytes, each 0 when that part fits already (what a create reclaims from a node's pooled
/// sandboxes). With both freed, [`check`] passes.
pub fn shortfall(capacity: &Capacity, allocated: Allocation, ask: &Capacity, cpu_overcommit: f64) -> Capacity {
    let limit = f64::from(capacity.vcpus) * cpu_overcommit;
    let after = allocated.vcpus as f64 + f64::from(ask.vcpus);
    let after_bytes = allocated
        .memory_bytes
        .saturating_add(i64::try_from(ask.memory_bytes).unwrap_or(i64::MAX));
    Capacity {
        vcpus: (after - limit).max(0.0).ceil() as u32,
        memory_bytes: u64::try_from(after_bytes)
            .unwrap_or(0)
            .saturating_sub(capacity.memory_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shortfall_is_what_must_go_for_the_ask_to_fit() {
        let node = cap(2, 4);
        let full = Allocation {
            vcpus: 7,
            memory_bytes: (3 * GIB + GIB / 2) as i64,
        };
        let ask = cap(2, 1);
        let short = shortfall(&node, full, &ask, 4.0);
        assert_eq!(
            short,
            Capacity {
                vcpus: 1,
                memory_bytes: GIB / 2
            }
        );
        let freed = Allocation {
            vcpus: full.vcpus - i64::from(short.vcpus),
            memory_bytes: full.memory_bytes - short.memory_bytes as i64,
        };
        assert!(
            check(&node, freed, &ask, 4.0).is_ok(),
            "with the shortfall freed it fits"
        );
        assert_eq!(shortfall(&node, Allocation::default(), &ask, 4.0), Capacity::default());
    }

    const GIB: u64 = 1 << 30;

    fn cap(vcpus: u32, gib: u64) -> Capacity {
        Capacity {
            vcpus,
            memory_bytes: gib * GIB,
        }
    }

    #[test]
    fn cpu_is_over_committed_and_memory_is_not() {
        let node = cap(2, 4);
        let mut allocated = Allocation::default();
        for _ in 0..7 {
            allocated.add(&cap(1, 0));
        }
        assert_eq!(check(&node, allocated, &cap(1, 1), 4.0), Ok(()), "8 of 2×4 vCPUs fit");
        allocated.add(&cap(1, 0));
        let err = check(&node, allocated, &cap(1, 1), 4.0).unwrap_err();
        assert_eq!(err.to_string(), "cpu: 9 vCPU would exceed 8 (R=4)");

        let mut allocated = Allocation::default();
        allocated.add(&cap(0, 3));
        assert_eq!(check(&node, allocated, &cap(1, 1), 4.0), Ok(()), "exactly full fits");
        let err = check(&node, allocated, &cap(1, 2), 4.0).unwrap_err();
        assert_eq!(err.to_string(), "memory: 5120 MiB would exceed 4096 MiB");
        allocated.sub(&cap(0, 3));
        assert_eq!(allocated, Allocation::default());
    }
}
