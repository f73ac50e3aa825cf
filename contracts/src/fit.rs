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

#[cfg(test)]
mod tests {
    use super::*;

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
