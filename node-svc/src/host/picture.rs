//! The host as a heartbeat reports it: what every sandbox was allotted and uses, and the
//! node's own memory.

use super::*;

/// What a heartbeat measures on a blocking thread.
pub(super) struct Measured {
    pub(super) listed: Vec<(SandboxRecord, u64)>,
    pub(super) cpu_time_ns: Option<u64>,
    pub(super) own_rss: u64,
}

/// Each record with the memory the runtime says it uses (blocking).
pub(super) fn measure(runtime: &dyn Runtime, records: Vec<SandboxRecord>) -> Vec<(SandboxRecord, u64)> {
    records
        .into_iter()
        .map(|r| {
            let used = runtime.memory_used(&r.view());
            (r, used)
        })
        .collect()
}

/// The heartbeat's picture of `listed` sandboxes on a node of `capacity`, whose own process
/// uses `own_rss` bytes.
pub(super) fn picture_of(
    listed: Vec<(SandboxRecord, u64)>,
    capacity: Resources,
    own_rss: u64,
    cpu_usage: f64,
) -> Picture {
    let mut allocated = Resources::default();
    let mut pooled = Resources::default();
    let mut used = own_rss;
    let sandboxes = listed
        .into_iter()
        .map(|(r, memory_used)| {
            allocated.vcpus += r.resources.vcpus;
            allocated.memory_bytes += r.resources.memory_bytes;
            if r.pooled {
                pooled.vcpus += r.resources.vcpus;
                pooled.memory_bytes += r.resources.memory_bytes;
            }
            used += memory_used;
            Reported {
                sandbox_id: r.id,
                state: r.state,
                resources: r.resources,
                memory_used_bytes: memory_used,
            }
        })
        .collect();
    Picture {
        sandboxes,
        allocated,
        pooled,
        memory_used_bytes: used,
        memory_available_bytes: capacity.memory_bytes.saturating_sub(used),
        cpu_usage,
    }
}

/// Resident memory of this process, counted as the node's own use.
pub(super) fn own_rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}
