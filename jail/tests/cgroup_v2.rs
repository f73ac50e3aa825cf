//! The cgroup v2 code on a real cgroup2 file system, not a fake tree.
//!
//! Hosts of either layout have one: a pure v2 host at `/sys/fs/cgroup`, a hybrid v1 host (the
//! development machines) at `/sys/fs/cgroup/unified`, where it has no controllers because v1
//! holds them all. What every cgroup2 has is the core: `cgroup.procs`, `cgroup.freeze`,
//! `cgroup.events` (whose changes the kernel signals with `POLLPRI`) and `cgroup.kill`. This
//! test runs the jail's v2 code on that: creation, joining, a process's forks following it,
//! freezing and thawing as the kernel reports them, killing the whole subtree, removal. The
//! limits (`memory.max`, `cpu.max`, `pids.max`) are written and read back too where the
//! host gives the cgroup2 those controllers; on a hybrid host they cannot be, and the
//! module's fake-tree tests are what covers them.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use jail::cgroup::{Cgroup, Hierarchy, Resources, Version};

/// The mount point of this host's cgroup2 file system, from `/proc/self/mountinfo`.
fn cgroup2_mount() -> PathBuf {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("reading /proc/self/mountinfo");
    info.lines()
        .find_map(|line| {
            let (mount, fs) = line.split_once(" - ")?;
            let point = mount.split_whitespace().nth(4)?;
            (fs.split_whitespace().next() == Some("cgroup2")).then(|| PathBuf::from(point))
        })
        .expect("no cgroup2 file system is mounted: mount one (`mount -t cgroup2 none /sys/fs/cgroup/unified`)")
}

/// Removes the test's cgroups however the test ends.
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let leaf = self.0.join("box");
        let _ = std::fs::write(leaf.join("cgroup.kill"), "1");
        for _ in 0..100 {
            if std::fs::remove_dir(&leaf).is_ok() || !leaf.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn events(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("cgroup.events")).unwrap()
}

/// A shell that waits for a line on stdin, then forks two sleepers and says so.
fn forking_shell() -> Child {
    Command::new("sh")
        .args(["-c", "read go; sleep 60 & sleep 60 & echo forked; wait"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn the_v2_code_creates_joins_freezes_kills_and_removes_on_a_real_cgroup2() {
    let mount = cgroup2_mount();
    let hierarchy = Hierarchy::detect_at(&mount).unwrap();
    assert_eq!(hierarchy.version, Version::V2, "{} is a cgroup2 mount", mount.display());
    let parent = format!("sandboxsched-v2-test-{}", std::process::id());
    let _cleanup = Cleanup(mount.join(&parent));
    let mut cgroup = Cgroup::new(&hierarchy, &format!("/{parent}/box")).unwrap();
    cgroup.create_dirs().unwrap();
    let leaf = mount.join(&parent).join("box");
    assert!(leaf.join("cgroup.procs").is_file(), "the kernel made the leaf");

    // Limits, where this cgroup2 has the controllers (a pure v2 host).
    let available = std::fs::read_to_string(leaf.join("cgroup.controllers")).unwrap();
    let has = |c: &str| available.split_whitespace().any(|a| a == c);
    let resources = Resources {
        memory_limit: has("memory").then_some(64 << 20),
        cpu_quota: has("cpu").then_some(50_000),
        cpu_period: has("cpu").then_some(100_000),
        pids_limit: has("pids").then_some(16),
        ..Resources::default()
    };
    cgroup.apply(&resources).unwrap();
    let read = |file: &str| std::fs::read_to_string(leaf.join(file)).unwrap().trim().to_string();
    if has("memory") {
        assert_eq!(read("memory.max"), (64u64 << 20).to_string());
    }
    if has("cpu") {
        assert_eq!(read("cpu.max"), "50000 100000");
    }
    if has("pids") {
        assert_eq!(read("pids.max"), "16");
    }

    // A process joins, and what it forks afterwards is in the cgroup too.
    let mut shell = forking_shell();
    let pid = shell.id() as i32;
    cgroup.add_process(pid).unwrap();
    let membership = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(
        membership.lines().any(|l| l == format!("0::/{parent}/box")),
        "{membership}"
    );
    writeln!(shell.stdin.as_mut().unwrap(), "go").unwrap();
    let mut said = String::new();
    BufReader::new(shell.stdout.take().unwrap())
        .read_line(&mut said)
        .unwrap();
    assert_eq!(said.trim(), "forked");
    assert_eq!(cgroup.procs().unwrap().len(), 3, "the shell and its two sleepers");
    assert!(events(&leaf).contains("populated 1"));

    // Freezing waits for the kernel's word (`frozen 1`, signalled with POLLPRI).
    cgroup.freeze().unwrap();
    assert!(cgroup.is_frozen().unwrap());
    assert!(events(&leaf).contains("frozen 1"), "{}", events(&leaf));
    cgroup.thaw().unwrap();
    assert!(!cgroup.is_frozen().unwrap());
    assert!(events(&leaf).contains("frozen 0"));

    // Kill takes the whole subtree at once (cgroup.kill), frozen or not.
    cgroup.freeze().unwrap();
    cgroup.kill_all(Duration::from_secs(5)).unwrap();
    assert!(cgroup.procs().unwrap().is_empty());
    assert!(events(&leaf).contains("populated 0"));
    let status = shell.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );

    cgroup.remove(false).unwrap();
    assert!(!leaf.exists());
}
