//! Where a sandbox's crash goes on the host.
//!
//! The kernel's `kernel.core_pattern` is the host's, not a namespace's. As a file name (the
//! kernel's `core`), a crashing process's core is written where that process is, in its own
//! mount namespace, with its own credentials: inside the sandbox, on its disk. As a pipe
//! (`|/usr/lib/systemd/systemd-coredump …`, apport), every crash in any sandbox starts the
//! host's handler as the host's root, outside every limit of the sandbox, fed the crashing
//! process's memory (its tenant's secrets), which it keeps on the host's disk after the
//! sandbox is gone. No rlimit stops it: the kernel ignores `RLIMIT_CORE` for pipes unless it
//! is 1, and a sandbox lowers its own limit as it likes. Only the host's operator can change
//! it; the node says what is left open when it is a pipe.

/// Why `core_pattern` (the text of `/proc/sys/kernel/core_pattern`) hands sandboxes'
/// crashes to the host, if it does.
pub fn exposure(core_pattern: &str) -> Option<String> {
    let pattern = core_pattern.trim();
    // `|PROGRAM …` runs a program; `@SOCKET` and `@@SOCKET` (Linux 6.16 on) send the core to
    // a host daemon listening there.
    let handler = pattern.strip_prefix('|').or_else(|| pattern.strip_prefix('@'))?;
    let program = handler
        .trim_start_matches('@')
        .split_whitespace()
        .next()
        .unwrap_or_default();
    Some(format!(
        "a crash in any sandbox runs the host's core handler ({program}) as the host's root, outside the sandbox's limits, and leaves the sandbox's memory on the host: set kernel.core_pattern to a file name (core) on sandbox hosts"
    ))
}

/// [`exposure`] of this host.
pub fn check() -> Option<String> {
    exposure(&std::fs::read_to_string("/proc/sys/kernel/core_pattern").ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_piped_core_pattern_reaches_the_host() {
        assert_eq!(exposure("core\n"), None);
        assert_eq!(exposure("/var/crash/core.%e.%p\n"), None);
        let piped = exposure("|/usr/lib/systemd/systemd-coredump %P %u %g %s %t %c %h %d\n").unwrap();
        assert!(piped.contains("/usr/lib/systemd/systemd-coredump"), "{piped}");
        assert!(exposure("|/usr/share/apport/apport -p%p -s%s -c%c").is_some());
        assert!(exposure("@@/run/systemd/coredump").is_some_and(|why| why.contains("(/run/systemd/coredump)")));
    }
}
