//! The host's global tables: counts the kernel keeps for the whole host, not per namespace or
//! cgroup, which one sandbox could fill for every other one.
//!
//! Four such tables are within a sandbox's reach:
//! - open files (`fs.file-max`): every `open`, socket, pipe and eventfd takes an entry, and
//!   once the table is full every process without `CAP_SYS_ADMIN` on the host gets `ENFILE`
//!   (root on the host goes on, so the node would not notice). Measured on a 24 GiB host: an
//!   unprivileged process group in a 1 GiB memory cgroup held 2.34 M of the 2.47 M entries
//!   the host allowed, with 590 MB;
//! - asynchronous I/O events (`fs.aio-max-nr`): one `io_setup(65536)` by an unprivileged
//!   process took all 65,536 the host allowed, and every other `io_setup` got `EAGAIN`;
//! - pseudo-terminals (`kernel.pty.max`): every `devpts` mounted with `newinstance`, one per
//!   sandbox, shares the same 3,072 (the table less `kernel.pty.reserve`, kept for the host's
//!   own), so one sandbox's terminals could leave the others none;
//! - connection tracking (`net.netfilter.nf_conntrack_max`): every flow a sandbox opens
//!   through the host is an entry, charged to nobody, and a full table drops every new flow
//!   on the host. The floor holds each sandbox to its share (`container::network`), and the
//!   table is raised so that those shares fit ([`MEMORY_PER_FLOW`]).
//!
//! Open files and AIO events are charged to the memory cgroup of the process that makes them
//! (measured: the AIO rings of one unprivileged process filled its 64 MiB cgroup and it was
//! killed inside it), so the node raises those two tables to more than the host's memory
//! could hold ([`Table::bytes_per_entry`]): a sandbox then meets its own memory limit first.
//! That holds only where the kernel charges its own memory to cgroups: with
//! `cgroup.memory=nokmem` the node leaves them as they are and says so.
//! A pseudo-terminal is mostly charged to nobody (about 23 KiB of `vmalloc` each), so
//! raising its table alone would let one sandbox take host memory outside its limit: each
//! sandbox's `devpts` holds at most [`PTYS_PER_SANDBOX`], and the host's table is raised so
//! that every sandbox's cap fits ([`MEMORY_PER_PTY`]); connection tracking likewise.
//!
//! A table already above what is wanted is left as its operator set it. One that cannot be
//! raised (a node in a container, where `/proc/sys` is read-only) is reported as a degraded
//! feature, with what it leaves open.

use std::path::Path;

/// Pseudo-terminals each sandbox's `devpts` may hold (its `max=`): a terminal costs the host
/// about 23 KiB that no memory cgroup is charged for (measured: 200 opened, 4,644 KiB more
/// `vmalloc`), so 64 of them are about 1.5 MiB outside a sandbox's limit.
pub const PTYS_PER_SANDBOX: u64 = 64;
/// The most `kernel.pty.max` may be (the kernel's `NR_UNIX98_PTY_MAX`).
pub const PTY_CEILING: u64 = 1 << 20;
/// The host's memory per terminal of its table: sandboxes of the smallest size (128 MiB)
/// filling the host's memory each have twice their cap, which leaves room for the host's own
/// reserve (`kernel.pty.reserve`, 1,024) on any host of a few GiB or more.
pub const MEMORY_PER_PTY: u64 = (128 << 20) / (2 * PTYS_PER_SANDBOX);

/// One host-wide table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Table {
    /// Its file under `/proc/sys`.
    pub sysctl: &'static str,
    /// The host's memory per entry of the table wanted, in bytes: for a table charged to its
    /// maker's memory cgroup, the least an entry costs it (so the table holds more than memory
    /// could, and a sandbox's own limit comes first); for one charged to nobody, the memory a
    /// sandbox brings per entry the node lets it hold (so every sandbox's share fits). `None`:
    /// the ceiling.
    pub bytes_per_entry: Option<u64>,
    /// The most the kernel takes, if it has a most.
    pub ceiling: Option<u64>,
    /// What a full table denies, for the report.
    pub denies: &'static str,
    /// Whether the table may be absent (a kernel module not loaded): nothing fills it then.
    pub optional: bool,
    /// Whether its entries are charged to their maker's memory cgroup (as kernel memory):
    /// raised only where the kernel does charge it.
    pub charged: bool,
}

/// The tables the node raises.
pub const TABLES: [Table; 4] = [
    Table {
        sysctl: "fs/file-max",
        // A `struct file` is 192-256 bytes of an accounted slab; 128 is below any of them.
        bytes_per_entry: Some(128),
        ceiling: Some(i64::MAX as u64),
        denies: "open files, sockets and pipes",
        optional: false,
        charged: true,
    },
    Table {
        sysctl: "fs/aio-max-nr",
        // An event reserved is at least one 32-byte `io_event` of the context's ring.
        bytes_per_entry: Some(32),
        ceiling: None,
        denies: "asynchronous I/O contexts (io_setup)",
        optional: false,
        charged: true,
    },
    Table {
        sysctl: "kernel/pty/max",
        bytes_per_entry: Some(MEMORY_PER_PTY),
        ceiling: Some(PTY_CEILING),
        denies: "terminals",
        optional: false,
        charged: false,
    },
    Table {
        sysctl: "net/netfilter/nf_conntrack_max",
        // Not charged to anyone: the floor holds each sandbox to its flows (`ct count`), and
        // the table is sized so that sandboxes of the smallest size filling the host's memory
        // fit at their caps: 4,096 flows for 128 MiB.
        bytes_per_entry: Some(MEMORY_PER_FLOW),
        ceiling: Some(i32::MAX as u64),
        denies: "new network flows",
        optional: true,
        charged: false,
    },
];

/// The host's memory per flow of its table: sandboxes of the smallest size (128 MiB) filling
/// the host's memory each have twice the floor's cap (`container::network::
/// FLOWS_PER_SANDBOX`), which leaves room for the host's own flows and the node's DNS
/// forwarder's.
pub const MEMORY_PER_FLOW: u64 = (128 << 20) / (2 * crate::container::network::FLOWS_PER_SANDBOX as u64);

impl Table {
    /// The size wanted on a host of `memory_bytes`: more entries than that memory could hold
    /// (the kernel's ceiling if lower), or the ceiling where memory does not bound it.
    pub fn wanted(&self, memory_bytes: u64) -> u64 {
        let ceiling = self.ceiling.unwrap_or(u64::MAX);
        match self.bytes_per_entry {
            Some(bytes) => (memory_bytes / bytes.max(1)).min(ceiling),
            None => ceiling,
        }
    }

    /// The value to write over `current`, if it is below what is wanted.
    pub fn raise(&self, current: u64, memory_bytes: u64) -> Option<u64> {
        let wanted = self.wanted(memory_bytes);
        (current < wanted).then_some(wanted)
    }
}

/// Whether the kernel charges its own memory (files, AIO rings) to memory cgroups: unless
/// booted with `cgroup.memory=nokmem`.
pub fn kernel_memory_charged() -> bool {
    std::fs::read_to_string("/proc/cmdline").is_ok_and(|line| {
        !line
            .split_whitespace()
            .filter_map(|w| w.strip_prefix("cgroup.memory="))
            .any(|options| options.split(',').any(|o| o == "nokmem"))
    })
}

/// Raises every table in `TABLES` that is below what a host of `memory_bytes` wants, under
/// `proc_sys` (`/proc/sys`); what could not be raised, as degraded features. A table whose
/// entries are charged to cgroups is left as it is where the kernel does not charge its
/// memory (`kmem_charged`): raised there, nothing would bound it.
pub fn raise_all(proc_sys: &Path, memory_bytes: u64, kmem_charged: bool) -> Vec<String> {
    let mut degraded = Vec::new();
    for table in TABLES {
        if table.charged && !kmem_charged {
            degraded.push(format!(
                "{} is left as the host has it: the kernel does not charge its memory to cgroups (cgroup.memory=nokmem), so one sandbox can use up the host's {} for every other one",
                table.sysctl.replace('/', "."),
                table.denies
            ));
            continue;
        }
        let path = proc_sys.join(table.sysctl);
        let current = match std::fs::read_to_string(&path) {
            Ok(text) => text.trim().parse::<u64>().ok(),
            Err(e) if table.optional && e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => None,
        };
        let Some(current) = current else {
            degraded.push(format!(
                "cannot read {}: the host's table of {} is unknown",
                path.display(),
                table.denies
            ));
            continue;
        };
        let Some(wanted) = table.raise(current, memory_bytes) else {
            continue;
        };
        match std::fs::write(&path, wanted.to_string()) {
            Ok(()) => tracing::info!(sysctl = table.sysctl, from = current, to = wanted, "raised a host-wide table"),
            Err(err) => degraded.push(format!(
                "{} is {current} and cannot be raised to {wanted} ({err}): sandboxes can use up the host's {} for each other",
                table.sysctl.replace('/', "."),
                table.denies
            )),
        }
    }
    degraded
}

/// The host's memory in bytes (`MemTotal`), if `/proc/meminfo` says.
pub fn host_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib = line.split_whitespace().nth(1)?.parse::<u64>().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn charged_tables_are_raised_past_what_memory_holds_and_terminals_to_the_ceiling() {
        let [files, aio, ptys, flows] = TABLES;
        // Debian's defaults on a 24 GiB host.
        assert_eq!(files.raise(2_466_239, 24 * GIB), Some(24 * GIB / 128));
        assert_eq!(aio.raise(65_536, 24 * GIB), Some(24 * GIB / 32));
        // 192 sandboxes of 128 MiB, each twice its cap of 64 terminals.
        assert_eq!(ptys.raise(4_096, 24 * GIB), Some(192 * 2 * 64));
        // 192 sandboxes of 128 MiB, each twice its cap of 4,096 flows.
        assert_eq!(flows.raise(262_144, 24 * GIB), Some(192 * 2 * 4_096));
        // The ceiling bounds it, whatever the memory (`fs.file-max` takes a signed long).
        assert!(files.wanted(u64::MAX) <= i64::MAX as u64);
        assert_eq!(ptys.wanted(u64::MAX), PTY_CEILING);
    }

    #[test]
    fn a_table_an_operator_set_higher_is_left_alone() {
        let [files, aio, ptys, _] = TABLES;
        assert_eq!(files.raise(i64::MAX as u64, 24 * GIB), None);
        assert_eq!(aio.raise(24 * GIB / 32, 24 * GIB), None);
        assert_eq!(ptys.raise(PTY_CEILING, 24 * GIB), None);
        assert_eq!(ptys.raise(100_000, 24 * GIB), None);
    }

    #[test]
    fn tables_are_raised_in_a_proc_sys_and_the_ones_that_cannot_be_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path();
        std::fs::create_dir_all(sys.join("fs")).unwrap();
        std::fs::create_dir_all(sys.join("kernel/pty")).unwrap();
        std::fs::write(sys.join("fs/file-max"), "2466239\n").unwrap();
        std::fs::write(sys.join("fs/aio-max-nr"), format!("{}\n", u64::MAX)).unwrap();
        // No kernel/pty/max: unknown, and reported; no net/netfilter (connection tracking
        // not loaded): nothing to raise, nothing reported.
        let degraded = raise_all(sys, 4 * GIB, true);
        let read = |p: &str| std::fs::read_to_string(sys.join(p)).unwrap();
        assert_eq!(read("fs/file-max"), (4 * GIB / 128).to_string());
        assert_eq!(read("fs/aio-max-nr").trim(), u64::MAX.to_string());
        assert_eq!(degraded.len(), 1, "{degraded:?}");
        assert!(degraded[0].contains("terminals"), "{degraded:?}");
        // Where the kernel does not charge its memory, files and AIO events are left alone.
        std::fs::write(sys.join("fs/file-max"), "2466239\n").unwrap();
        let degraded = raise_all(sys, 4 * GIB, false);
        assert_eq!(read("fs/file-max"), "2466239\n");
        assert!(
            degraded
                .iter()
                .any(|d| d.contains("nokmem") && d.contains("open files")),
            "{degraded:?}"
        );
    }
}
