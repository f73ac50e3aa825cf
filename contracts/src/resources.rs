//! Resource defaults shared by every service.
//!
//! E2B's create request has no resources field. Whatever a sandbox does not state, every part
//! of the system assumes the same values, and the gateway writes them into the manifest so the
//! manifest describes itself.

/// Memory assumed for a sandbox whose template and request say nothing: 512 MiB.
pub const DEFAULT_MEMORY_BYTES: u64 = 512 * 1024 * 1024;

/// A sandbox's disk unless the cluster says otherwise: 2 GiB.
pub const DEFAULT_DISK_BYTES: u64 = 2 << 30;

/// vCPUs assumed for a sandbox whose template and request say nothing.
pub const DEFAULT_VCPUS: u32 = 1;
