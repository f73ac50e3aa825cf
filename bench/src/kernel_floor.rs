//! The kernel's floor under a sandbox's create and kill: the same isolation made and undone
//! with nothing of ours in between, so a create's CPU can be read as a multiple of it.
//!
//! One cycle is what the kernel must do for a container like ours, whoever asks it:
//! - four cgroup folders made and removed (memory, cpu, pids and freezer on cgroup v1; one
//!   folder on v2, where one folder holds every controller);
//! - an overlay root mounted over a lower layer and unmounted;
//! - two `exec`s and a clone into six new namespaces (user, PID, mount, network, IPC, UTS):
//!   util-linux's `unshare --fork` is executed (a runtime's exec), writes the user
//!   namespace's maps, and clones and executes `true` inside them (envd's exec), then
//!   everything is torn down as the process exits.
//!
//! It is a floor, not the same work: the container's root is not pivoted into, no `/proc`,
//! `/dev` or `/sys` is mounted in it, no seccomp filter or capability set applied, no limit
//! written, and the process never joins the cgroups; and a linked sandbox joins a network
//! namespace made ahead (a slot) where this makes and tears down a new one each cycle.
//!
//! The cycles run one after another and their CPU is counted host-wide ([`HostCpu`]: the
//! kernel threads that tear down namespaces are counted too), so the figure is directly
//! comparable to the create path's `cpu_ms_per_create` measured the same way; the cheapest
//! of five batches is reported (see [`measure`]).
//!
//! Timed one by one ([`Rig::timed`], [`Rig::timed_until`]), the same cycle is what `bench
//! node` holds its creates' latency during a burst of kills against: the kernel's own share of
//! a create, meeting the same contention with nothing of ours in its way.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::host_cpu::HostCpu;

/// Where util-linux puts `unshare` on Debian.
const UNSHARE: &str = "/usr/bin/unshare";

/// What the loop measured.
pub struct Floor {
    /// Host CPU per cycle, in milliseconds.
    pub cpu_ms: f64,
    /// Wall time per cycle, in milliseconds.
    pub wall_ms: f64,
}

/// The cgroup folders one cycle makes, under `/sys/fs/cgroup`.
fn cgroup_parents(tag: &str) -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("memory").is_dir() {
        ["memory", "cpu", "pids", "freezer"]
            .iter()
            .map(|c| root.join(c).join(tag))
            .collect()
    } else {
        vec![root.join(tag)]
    }
}

/// Batches the cycles are measured in; the floor is the cheapest batch's cost.
const BATCHES: usize = 5;

/// What the cycles need made once: a scratch folder holding the overlay's lower layer, and
/// the cgroup parents the cycles' folders go under (removed, empty, when dropped).
pub struct Rig {
    scratch: tempfile::TempDir,
    lower: PathBuf,
    parents: Vec<PathBuf>,
    /// The next cycle's number, naming its folders.
    next: usize,
}

impl Rig {
    /// A rig with its own cgroup parents (`name` tells two rigs of one process apart); one
    /// unmeasured cycle has run, which finds every binary and page cached.
    pub fn new(name: &str) -> anyhow::Result<Rig> {
        anyhow::ensure!(Path::new(UNSHARE).is_file(), "{UNSHARE} is missing: install util-linux");
        let scratch = tempfile::tempdir().context("a scratch folder")?;
        let lower = scratch.path().join("lower");
        std::fs::create_dir(&lower)?;
        std::fs::write(lower.join("file"), b"lower")?;
        let tag = format!("sandboxsched-bench-floor-{name}-{}", std::process::id());
        let mut rig = Rig {
            scratch,
            lower,
            parents: cgroup_parents(&tag),
            next: 0,
        };
        rig.cycle()?;
        Ok(rig)
    }

    /// One cycle: cgroups, overlay, the clone and its two execs, and all of it undone.
    pub fn cycle(&mut self) -> anyhow::Result<()> {
        self.next += 1;
        cycle(self.scratch.path(), &self.lower, &self.parents, self.next)
    }

    /// Cycles one after another until `done` is set (at least one), each one's wall time.
    pub fn timed_until(&mut self, done: &AtomicBool) -> anyhow::Result<Vec<Duration>> {
        let mut samples = Vec::new();
        loop {
            let started = Instant::now();
            self.cycle()?;
            samples.push(started.elapsed());
            if done.load(Ordering::Relaxed) {
                return Ok(samples);
            }
        }
    }

    /// `cycles` cycles one after another, each one's wall time.
    pub fn timed(&mut self, cycles: usize) -> anyhow::Result<Vec<Duration>> {
        (0..cycles)
            .map(|_| {
                let started = Instant::now();
                self.cycle().map(|()| started.elapsed())
            })
            .collect()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // A cycle's `Made` undoes what it made; these folders are then empty.
        for parent in &self.parents {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

/// Runs `cycles` cycles (after one unmeasured, which finds every binary and page cached), in
/// [`BATCHES`] batches, and reports the cheapest batch: the kernel needs at least that much,
/// and whatever else the host ran meanwhile (a shared machine's neighbours) only ever adds
/// to a batch's count, so the lowest is the one least polluted by it.
pub fn measure(cycles: usize) -> anyhow::Result<Floor> {
    // `/proc/stat` counts in 10 ms ticks: a batch must run long enough that one tick more or
    // less does not move its figure much (20 cycles of about 4 ms: 80 ms, 8 ticks, per core).
    anyhow::ensure!(
        cycles >= 20 * BATCHES,
        "--floor-cycles must be at least {}",
        20 * BATCHES
    );
    let mut rig = Rig::new("cpu")?;
    let per_batch = cycles / BATCHES;
    let mut cheapest: Option<Floor> = None;
    for _ in 0..BATCHES {
        let cpu_before = HostCpu::read()?;
        let started = Instant::now();
        for _ in 0..per_batch {
            rig.cycle()?;
        }
        let wall = started.elapsed();
        let cpu = HostCpu::read()?.since(&cpu_before);
        let floor = Floor {
            cpu_ms: cpu / per_batch as f64,
            wall_ms: wall.as_secs_f64() * 1000.0 / per_batch as f64,
        };
        if cheapest.as_ref().is_none_or(|c| floor.cpu_ms < c.cpu_ms) {
            cheapest = Some(floor);
        }
    }
    cheapest.context("no batch ran")
}

/// What one cycle made, undone when dropped (in reverse), whether the cycle got to the end
/// or not: a failed run leaves no cgroup or overlay on the host.
struct Made {
    groups: Vec<PathBuf>,
    mounted: Option<PathBuf>,
    dir: PathBuf,
}

impl Made {
    /// Undoes everything; the first failure, if any.
    fn undo(&mut self) -> anyhow::Result<()> {
        let mut first = None;
        if let Some(root) = self.mounted.take() {
            if let Err(e) = rustix::mount::unmount(&root, rustix::mount::UnmountFlags::DETACH) {
                first.get_or_insert(anyhow::anyhow!("unmounting overlay {}: {e}", root.display()));
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                first.get_or_insert(anyhow::anyhow!("removing {}: {e}", self.dir.display()));
            }
        }
        for g in self.groups.drain(..) {
            if let Err(e) = std::fs::remove_dir(&g) {
                first.get_or_insert(anyhow::anyhow!("removing cgroup {}: {e}", g.display()));
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Made {
    fn drop(&mut self) {
        let _ = self.undo();
    }
}

/// One cycle: cgroups, overlay, the clone and its two execs, and all of it undone.
fn cycle(scratch: &Path, lower: &Path, parents: &[PathBuf], i: usize) -> anyhow::Result<()> {
    use rustix::mount::{mount, MountFlags};
    let mut made = Made {
        groups: Vec::new(),
        mounted: None,
        dir: scratch.join(format!("c{i}")),
    };
    for parent in parents {
        let g = parent.join(i.to_string());
        std::fs::create_dir_all(&g).with_context(|| format!("creating cgroup {}", g.display()))?;
        made.groups.push(g);
    }
    let (upper, work, root) = (made.dir.join("upper"), made.dir.join("work"), made.dir.join("root"));
    for d in [&upper, &work, &root] {
        std::fs::create_dir_all(d)?;
    }
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    let options = std::ffi::CString::new(options).context("overlay options")?;
    mount(
        "overlay",
        &root,
        "overlay",
        MountFlags::empty(),
        Some(options.as_c_str()),
    )
    .context("mounting overlay")?;
    made.mounted = Some(root);
    // `--map-root-user`: the uid and gid maps written, as for every sandbox.
    let ran = Command::new(UNSHARE)
        .args([
            "--user",
            "--map-root-user",
            "--pid",
            "--mount",
            "--net",
            "--ipc",
            "--uts",
            "--fork",
            "true",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .context("running unshare")?;
    anyhow::ensure!(
        ran.status.success(),
        "unshare failed: {}",
        String::from_utf8_lossy(&ran.stderr).trim()
    );
    made.undo()
}
