//! The host's process table as every other local user sees it.
//!
//! Unless `/proc` is mounted with `hidepid`, any user of the host reads any process's
//! `/proc/PID/cmdline` and `/proc/PID/cgroup`: for a sandbox's processes, the commands its
//! tenant runs (the SDK runs each as `bash -l -c COMMAND`, with whatever secret the tenant
//! wrote into it) and the cgroups named by sandbox ID (a sandbox's ID is all its public
//! ports ask for). The kernel checks nothing more for those files: no user namespace or
//! ownership stands in the way. Only the host's operator can mount `/proc` so; the node
//! checks and says what is left open if it is not.

/// Why the host's `/proc` shows other users' processes, from the text of `/proc/mounts`:
/// `None` when it is mounted with `hidepid` 1, 2 or 4 (`noaccess`, `invisible`, `ptraceable`:
/// another user cannot trace a sandbox's processes).
pub fn exposure(mounts: &str) -> Option<String> {
    let proc_options = mounts
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() >= 4 && fields[1] == "/proc" && fields[2] == "proc").then(|| fields[3])
        })
        // The last mount at a path is the one seen there.
        .next_back()?;
    let hidden = proc_options.split(',').any(|option| {
        matches!(
            option,
            "hidepid=1" | "hidepid=2" | "hidepid=4" | "hidepid=noaccess" | "hidepid=invisible" | "hidepid=ptraceable"
        )
    });
    (!hidden).then(|| {
        "every local user of this host reads the sandboxes' command lines (the commands tenants run) and cgroups (named by sandbox ID) in /proc: mount /proc with hidepid=invisible (gid= a group for monitoring)".to_string()
    })
}

/// [`exposure`] of this host (of this node's own `/proc`, for a node in a container).
pub fn check() -> Option<String> {
    exposure(&std::fs::read_to_string("/proc/mounts").ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_proc_that_hides_other_users_processes_is_closed() {
        let open = "sysfs /sys sysfs rw 0 0\nproc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n";
        assert!(exposure(open).is_some_and(|why| why.contains("hidepid")));
        for hidden in [
            "hidepid=2",
            "hidepid=invisible",
            "hidepid=1",
            "hidepid=noaccess",
            "hidepid=ptraceable",
        ] {
            let mounts = format!("proc /proc proc rw,relatime,{hidden},gid=27 0 0\n");
            assert_eq!(exposure(&mounts), None, "{hidden}");
        }
        // `subset=pid` hides the rest of /proc, not other users' processes.
        assert!(exposure("proc /proc proc rw,relatime,subset=pid 0 0\n").is_some());
        // Mounted again over the first: the last one counts.
        let remounted = "proc /proc proc rw,hidepid=2 0 0\nproc /proc proc rw 0 0\n";
        assert!(exposure(remounted).is_some());
        // A proc elsewhere (a container's) says nothing of the host's.
        assert_eq!(exposure("proc /srv/x/proc proc rw 0 0\n"), None);
    }
}
