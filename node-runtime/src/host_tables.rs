//! The host's global tables: counts the kernel keeps for the whole host, not per namespace or
//! cgroup, which one sandbox could fill for every other one.
//!
//! Three such tables are within a sandbox's reach:
//! - open files (`fs.file-max`): every `open`, socket, pipe and eventfd takes an entry, and
//!   once the table is full every process without `CAP_SYS_ADMIN` on the host gets `ENFILE`
//!   (root on the host goes on, so the node would not notice). Measured on a 24 GiB host: an
//!   unprivileged process group in a 1 GiB memory cgroup held 2.34 M of the 2.47 M entries
//!   the host allowed, with 590 MB;
//! - asynchronous I/O events (`fs.aio-max-nr`): one `io_setup(65536)` by an unprivileged
//!   process took all 65,536 the host allowed, and every other `io_setup` got `EAGAIN`;
//! - pseudo-terminals (`kernel.pty.max`): every `devpts` mounted with `newinstance`, one per
//!   sandbox, shares the same 3,072 (the table less `kernel.pty.reserve`, kept for the host's
//!   own), so one sandbox's terminals could leave the others none.
//!
//! Open files and AIO events are charged to the memory cgroup of the process that makes them
//! (measured: the AIO rings of one unprivileged process filled its 64 MiB cgroup and it was
//! killed inside it), so the node raises those two tables to more than the host's memory
//! could hold ([`Table::bytes_per_entry`]): a sandbox then meets its own memory limit first.
//! A pseudo-terminal is only partly charged (about 3 KiB of it), so raising its table alone
//! would let one sandbox take kernel memory nobody is charged for: each sandbox's `devpts`
//! holds at most [`PTYS_PER_SANDBOX`], and the host's table is raised to the kernel's ceiling,
//! which holds that many for [`PTY_CEILING`] / [`PTYS_PER_SANDBOX`] sandboxes.
//!
//! A table already above what is wanted is left as its operator set it. One that cannot be
//! raised (a node in a container, where `/proc/sys` is read-only) is reported as a degraded
//! feature, with what it leaves open.

use std::path::Path;

/// Pseudo-terminals each sandbox's `devpts` may hold (its `max=`).
pub const PTYS_PER_SANDBOX: u64 = 512;
/// The most `kernel.pty.max` may be (the kernel's `NR_UNIX98_PTY_MAX`).
pub const PTY_CEILING: u64 = 1 << 20;

// The ceiling holds the density benchmark's 1,000 sandboxes each at its cap, and the
// host's own reserve (`kernel.pty.reserve`, 1,024).
const _: () = assert!(1_000 * PTYS_PER_SANDBOX + 1_024 <= PTY_CEILING);

/// One host-wide table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Table {
    /// Its file under `/proc/sys`.
    pub sysctl: &'static str,
    /// What one entry costs its maker's memory cgroup at least, in bytes; `None`: not charged
    /// enough to let memory bound it, raised to [`Table::ceiling`] only.
    pub bytes_per_entry: Option<u64>,
    /// The most the kernel takes, if it has a most.
    pub ceiling: Option<u64>,
    /// What a full table denies, for the report.
    pub denies: &'static str,
}

/// The tables the node raises.
pub const TABLES: [Table; 3] = [
    Table {
        sysctl: "fs/file-max",
        // A `struct file` is 192-256 bytes of an accounted slab; 128 is below any of them.
        bytes_per_entry: Some(128),
        ceiling: Some(i64::MAX as u64),
        denies: "open files, sockets and pipes",
    },
    Table {
        sysctl: "fs/aio-max-nr",
        // An event reserved is at least one 32-byte `io_event` of the context's ring.
        bytes_per_entry: Some(32),
        ceiling: None,
        denies: "asynchronous I/O contexts (io_setup)",
    },
    Table {
        sysctl: "kernel/pty/max",
        bytes_per_entry: None,
        ceiling: Some(PTY_CEILING),
        denies: "terminals",
    },
];

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

/// Raises every table in `TABLES` that is below what a host of `memory_bytes` wants, under
/// `proc_sys` (`/proc/sys`); what could not be raised, as degraded features.
pub fn raise_all(proc_sys: &Path, memory_bytes: u64) -> Vec<String> {
    let mut degraded = Vec::new();
    for table in TABLES {
        let path = proc_sys.join(table.sysctl);
        let current = match std::fs::read_to_string(&path) {
            Ok(text) => text.trim().parse::<u64>().ok(),
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
                "{} is {current} and cannot be raised to {wanted} ({err}): one sandbox can use up the host's {} for every other one",
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
        let [files, aio, ptys] = TABLES;
        // Debian's defaults on a 24 GiB host.
        assert_eq!(files.raise(2_466_239, 24 * GIB), Some(24 * GIB / 128));
        assert_eq!(aio.raise(65_536, 24 * GIB), Some(24 * GIB / 32));
        assert_eq!(ptys.raise(4_096, 24 * GIB), Some(PTY_CEILING));
        // The ceiling bounds it, whatever the memory (`fs.file-max` takes a signed long).
        assert!(files.wanted(u64::MAX) <= i64::MAX as u64);
        assert_eq!(ptys.wanted(u64::MAX), PTY_CEILING);
    }

    #[test]
    fn a_table_an_operator_set_higher_is_left_alone() {
        let [files, aio, ptys] = TABLES;
        assert_eq!(files.raise(i64::MAX as u64, 24 * GIB), None);
        assert_eq!(aio.raise(24 * GIB / 32, 24 * GIB), None);
        assert_eq!(ptys.raise(PTY_CEILING, 24 * GIB), None);
    }

    #[test]
    fn tables_are_raised_in_a_proc_sys_and_the_ones_that_cannot_be_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path();
        std::fs::create_dir_all(sys.join("fs")).unwrap();
        std::fs::create_dir_all(sys.join("kernel/pty")).unwrap();
        std::fs::write(sys.join("fs/file-max"), "2466239\n").unwrap();
        std::fs::write(sys.join("fs/aio-max-nr"), format!("{}\n", u64::MAX)).unwrap();
        // No kernel/pty/max: unknown, and reported.
        let degraded = raise_all(sys, 4 * GIB);
        let read = |p: &str| std::fs::read_to_string(sys.join(p)).unwrap();
        assert_eq!(read("fs/file-max"), (4 * GIB / 128).to_string());
        assert_eq!(read("fs/aio-max-nr").trim(), u64::MAX.to_string());
        assert_eq!(degraded.len(), 1, "{degraded:?}");
        assert!(degraded[0].contains("terminals"), "{degraded:?}");
    }
}
