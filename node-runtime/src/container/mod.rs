//! Sandboxes as OCI containers: the default runtime.
//!
//! Each sandbox is a container with its own root filesystem ([`rootfs`]: the template's
//! read-only layers under the sandbox's writable layer), user namespace (root inside is an
//! unprivileged host uid, in a range no other sandbox on the node runs as: [`ids`]), PID,
//! mount, network (loopback only), IPC and UTS namespaces, a container capability set,
//! `no_new_privs`, a seccomp filter and cgroup limits, as [`spec`] writes them. envd runs
//! inside as PID 1 and listens on a Unix socket the node opens and hands in, so the node
//! reaches it without any network route and nothing inside can replace that socket. An OCI
//! runtime does the work ([`oci`]): the node's own `jail` by default, or any runc-compatible
//! binary.
//!
//! Namespaces are not a VM: a kernel bug reachable from inside a sandbox reaches the host. An
//! operator who needs VM-grade isolation points `--oci-runtime` at gVisor's `runsc` or Kata's
//! runtime; nothing else changes.
//!
//! The sandbox's folder in the node's state directory holds its disk (`crate::disk`) with
//! `home/` (the writable layer: what snapshots carry) and `work/` (overlayfs's) on it, and
//! `container.log` (envd's output and the runtime's errors) beside it; its bundle, in the
//! node's [`run_dir`] (in memory), holds `config.json` (the spec), `container.pid`,
//! `envd.sock` and `rootfs/` (the mounted root).

pub mod forget;
pub mod ids;
pub mod network;
pub mod oci;
pub mod resolver;
pub mod rootfs;
pub mod run_dir;
pub mod slots;
pub mod spare_cgroups;
pub mod spec;

pub use run_dir::run_dir;

use std::io;
use std::os::fd::AsFd as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use super::cgroup::Cgroups;
use super::{Features, Runtime, RuntimeError};
use crate::layout;
use crate::Sandbox;

/// Where a sandbox's parts live, beside its writable layer (`home`).
struct Parts {
    bundle: PathBuf,
    rootfs: PathBuf,
    work: PathBuf,
    socket: PathBuf,
    pid_file: PathBuf,
    log: PathBuf,
}

/// The parts of the sandbox whose writable layer is `home` (`STATE/sandboxes/ID/disk/home`):
/// the bundle in the node's run directory `run` ([`run_dir`]), overlayfs's work folder beside
/// `home` on its disk, the log in the sandbox's folder.
fn parts(run: &Path, home: &Path) -> Parts {
    let disk = home.parent().unwrap_or(home);
    let dir = disk.parent().unwrap_or(disk).to_path_buf();
    let bundle = run.join("sandboxes").join(dir.file_name().unwrap_or_default());
    Parts {
        rootfs: bundle.join("rootfs"),
        work: disk.join("work"),
        socket: bundle.join("envd.sock"),
        pid_file: bundle.join("container.pid"),
        log: dir.join("container.log"),
        bundle,
    }
}

/// The host end of every sandbox's link is named with this prefix: what the network floor's
/// rules and the DNS redirect match a sandbox's traffic by (`network` names the links,
/// `resolver` redirects their queries; here, so neither reaches into the other for it).
pub const HOST_PREFIX: &str = "sbx";

/// `s` as a C string for a system call (a path with a NUL in it is refused): the jail's one
/// conversion, its error as I/O's.
pub(super) fn cstring(s: impl AsRef<std::ffi::OsStr>) -> std::io::Result<std::ffi::CString> {
    jail::sys::cstring(s).map_err(std::io::Error::other)
}

/// FNV-1a of `bytes`: a hash stable across builds and platforms (which `DefaultHasher` does
/// not promise), for names and spreads that must come out the same in every process.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash: u64, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Unmounts the sandbox's root and deletes its bundle: what a container leaves in the run
/// directory once the runtime has deleted it.
fn dismantle(parts: &Parts) -> io::Result<()> {
    rootfs::unmount(&parts.rootfs)?;
    match std::fs::remove_dir_all(&parts.bundle) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// How the container runtime is set up.
#[derive(Clone, Debug)]
pub struct ContainerConfig {
    /// The node's state directory (the base layer and the runtime's state live under it).
    pub state_dir: PathBuf,
    /// A runc-compatible runtime binary; `None` runs the node's own `jail`.
    pub oci_runtime: Option<PathBuf>,
    /// The envd injected into every sandbox (run as `PROGRAM envd ...`): a static one
    /// (`scripts/build-static-envd`) runs in any template's root filesystem; by default the
    /// node's own binary ([`multicall_binary`]), which needs the host's C library there.
    pub envd_binary: Option<PathBuf>,
    /// Sandboxes' links out and the host's floor.
    pub network: network::NetworkConfig,
    /// Processes all this node's sandboxes may have together (each has its share of them by
    /// its memory: [`spec::pids_limit`]); `None`: [`crate::cgroup::default_pids_max`].
    pub pids_max: Option<u64>,
    /// The node's memory for sandboxes, against which each one's share is measured.
    pub memory_bytes: u64,
}

/// The base template's generated layer (under the host's userland), in a node's state
/// directory.
pub fn base_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("container").join("base")
}

/// The layer above an image's own layers (see [`rootfs::ensure_shim`]).
pub fn shim_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("container").join("shim")
}

/// Binaries that answer `envd ...` and `jail ...` (see `node_svc::multicall`).
const MULTICALL: [&str; 2] = ["node-svc", "sandboxsched"];

/// Set by `node_svc::multicall`: this executable answers `envd ...` and `jail ...`.
pub static MULTICALL_HERE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The binary that carries envd and jail: this executable when its `main` calls
/// `node_svc::multicall` (node-svc, the launcher, the bench), else node-svc or the launcher
/// beside it or one folder up (a test executable in `target/*/deps` finds `target/*/node-svc`).
pub fn multicall_binary() -> Option<PathBuf> {
    if MULTICALL_HERE.load(std::sync::atomic::Ordering::Relaxed) {
        return std::env::current_exe().ok();
    }
    beside_this_executable(&MULTICALL)
}

/// The first of `names` beside this executable, or one folder up (a test executable in
/// `target/*/deps` finds `target/*/NAME`).
fn beside_this_executable(names: &[&str]) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let found = [Some(dir), dir.parent()]
        .into_iter()
        .flatten()
        .flat_map(|d| names.iter().map(move |name| d.join(name)))
        .find(|candidate| candidate.is_file());
    found
}

/// The stand-alone runtime and envd binaries a build makes beside the node's (`jail` and
/// `envd` crates): preferred to the multicall binary when present.
const JAIL_COMPANION: &str = "sandboxsched-jail";
const ENVD_COMPANION: &str = "sandboxsched-envd";

/// `name` where [`multicall_binary`] looks.
///
/// Why prefer them: every create and kill runs the runtime, and every sandbox's PID 1 is
/// envd. Started from the multicall binary (the whole node, over a hundred megabytes) each
/// of those `exec`s relocates and faults in the node's code and data; the stand-alone
/// binaries are a fraction of that, and the same code.
pub fn companion_binary(name: &str) -> Option<PathBuf> {
    beside_this_executable(&[name])
}

/// How to call the runtime: `oci_runtime` when given, else the stand-alone jail when it is
/// there, else the multicall binary's `jail`, whose helper leaves the mounts below
/// `private_below` out of its own mount table.
fn engine(
    oci_runtime: Option<&Path>,
    carrier: Option<PathBuf>,
    root: PathBuf,
    private_below: Vec<PathBuf>,
) -> Option<Box<dyn oci::Engine>> {
    if let Some(program) = oci_runtime {
        let launcher = oci::Launcher::new(program.to_path_buf(), Vec::new(), root);
        return Some(Box::new(oci::CommandLine::new(launcher)));
    }
    let launcher = match companion_binary(JAIL_COMPANION) {
        Some(jail) => oci::Launcher::new(jail, Vec::new(), root),
        None => oci::Launcher::new(carrier?, vec!["jail".into()], root),
    };
    Some(Box::new(oci::Jail::new(launcher, private_below)))
}

pub struct ContainerRuntime {
    node_id: String,
    /// Every sandbox's folder ([`layout::sandboxes_dir`]).
    sandboxes: PathBuf,
    /// What lives only as long as the containers ([`run_dir`]).
    run: PathBuf,
    engine: Box<dyn oci::Engine>,
    base: PathBuf,
    /// The layer above an image's own (templates not built on the host's userland): the mount
    /// points the spec needs, so nothing is created in a sandbox's writable layer for them.
    shim: PathBuf,
    /// Where template layers are kept ([`layout::layers_dir`]; the node's cache fills it).
    layers: PathBuf,
    host_dirs: Vec<PathBuf>,
    envd_binary: PathBuf,
    /// For measuring: the runtime creates each sandbox's groups under the node's parents.
    cgroups: Cgroups,
    /// Killed sandboxes' groups, kept for the next ones ([`spare_cgroups`]).
    spare_cgroups: spare_cgroups::SpareCgroups,
    /// Links out, and the host's floor.
    network: network::Network,
    /// Which host ids each sandbox runs as.
    ids: std::sync::Arc<ids::IdRanges>,
    /// Networks made ahead of sandboxes ([`slots`]); none where sandboxes cannot reach out.
    slots: Option<slots::SlotPool>,
    /// Processes all sandboxes may have together, and the memory they share them by.
    pids_max: u64,
    memory_bytes: u64,
    /// Whether sandboxes' specs carry their rlimits ([`spec::Inputs::rlimits`]).
    rlimits: bool,
    /// Why this host cannot run isolated sandboxes, if it cannot: every start is refused.
    missing: Vec<String>,
    degraded: Vec<String>,
}

fn start_error(sandbox: &Sandbox<'_>, reason: impl ToString) -> RuntimeError {
    RuntimeError::Start {
        sandbox: sandbox.id.to_string(),
        reason: reason.to_string(),
    }
}

fn control(sandbox: &Sandbox<'_>, action: &'static str, reason: impl ToString) -> RuntimeError {
    RuntimeError::Control {
        sandbox: sandbox.id.to_string(),
        action,
        reason: reason.to_string(),
    }
}

/// Kills every container a node with state directory `state_dir` left running and unmounts
/// their roots and disks: for cleaning up after a node that will not come back (a test that failed
/// half-way, a host being retired). `oci_runtime` is the runtime that node used.
pub fn destroy_all(state_dir: &Path, oci_runtime: Option<&Path>) {
    let run = run_dir(state_dir);
    let root = run.join("runtime");
    let Some(engine) = engine(oci_runtime, multicall_binary(), root.clone(), Vec::new()) else {
        return;
    };
    let sandboxes = layout::sandboxes_dir(state_dir);
    for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let id = entry.file_name().to_string_lossy().into_owned();
        if let Err(err) = engine.delete(&id) {
            tracing::warn!(sandbox_id = %id, %err, "left-over container not deleted");
        }
        let _ = dismantle(&parts(&run, &layout::home_in(&sandboxes.join(&id))));
    }
    let _ = std::fs::remove_dir_all(&run);
    // Then every sandbox's disk, so the folder can be deleted.
    for entry in std::fs::read_dir(&sandboxes).into_iter().flatten().flatten() {
        let _ = crate::disk::detach(&entry.path());
    }
}

/// Reaps the sandbox's init (this node's child, as subreaper) as soon as it dies, on a thread
/// of its own, so the runtime's `delete` finds the sandbox's cgroup empty. Waits for that one
/// PID only: children someone else waits for are left alone. A PID that is not our child
/// (an init from before a node restart) returns at once.
fn reap_when_dead(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return };
    if pid <= 1 {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("reap-init".into())
        .spawn(move || jail::sys::reap(pid));
}

/// Whether process `pid` exists and is not a zombie (`/proc/PID/stat`'s state, after the
/// command name's closing parenthesis).
fn init_runs(pid: u32) -> bool {
    if pid <= 1 {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next())
        .is_some_and(|state| state != 'Z' && state != 'X')
}

/// Whether an ELF executable names a program interpreter (`PT_INTERP`: the dynamic linker),
/// so it runs only where that linker and its libraries are.
fn needs_interpreter(binary: &Path) -> io::Result<bool> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    const PT_INTERP: u32 = 3;
    let mut file = std::fs::File::open(binary)?;
    let mut header = [0u8; 64];
    file.read_exact(&mut header)?;
    if &header[..4] != b"\x7fELF" || header[4] != 2 {
        return Err(io::Error::other("not a 64-bit ELF executable"));
    }
    let le_u16 = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    let phoff = u64::from_le_bytes(header[0x20..0x28].try_into().map_err(io::Error::other)?);
    let (phentsize, phnum) = (le_u16(&header[0x36..]), le_u16(&header[0x38..]));
    for i in 0..u64::from(phnum) {
        file.seek(SeekFrom::Start(phoff + i * u64::from(phentsize)))?;
        let mut p_type = [0u8; 4];
        file.read_exact(&mut p_type)?;
        if u32::from_le_bytes(p_type) == PT_INTERP {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether the node holds `capability` (in its effective set).
fn holds(capability: rustix::thread::CapabilitySet) -> bool {
    rustix::thread::capabilities(None).is_ok_and(|c| c.effective.contains(capability))
}

/// What this host lacks to isolate sandboxes.
fn probe_host() -> Vec<String> {
    let mut missing = Vec::new();
    let userns = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    if userns == 0 {
        missing.push("user namespaces (/proc/sys/user/max_user_namespaces is 0 or missing)".to_string());
    }
    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !filesystems.lines().any(|l| l.trim_end().ends_with("overlay")) {
        missing.push("overlayfs (not in /proc/filesystems)".to_string());
    }
    if !rustix::process::geteuid().is_root() {
        missing.push("root (the node maps user namespaces and mounts root filesystems)".to_string());
    }
    // Each sandbox's user namespace is its own root's, not the node's (see the jail's
    // `namespaces`), so the node reaches a sandbox's namespaces and processes (its ports, its
    // network after a restart) as root over another user's: with CAP_SYS_PTRACE.
    if !holds(rustix::thread::CapabilitySet::SYS_PTRACE) {
        missing.push(
            "CAP_SYS_PTRACE (the node reaches into sandboxes whose user namespaces are their own roots')".to_string(),
        );
    }
    missing
}

/// Makes `dir` the node's alone (0700): its sandboxes' files, records and logs, its layer
/// cache and the base layer are reached by the kernel on the node's behalf (overlays act with
/// the credentials of who mounted them), never by a sandbox's uid walking a path, so no other
/// host user needs to pass through it.
fn private(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Makes `dir` and its ancestors searchable (`o+x`, not readable) where they are not: the
/// runtime mounts a sandbox's root filesystem from inside its user namespace, as an
/// unprivileged host uid that must be able to walk the path to it.
fn searchable(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::fs::canonicalize(dir)?;
    for ancestor in dir.ancestors() {
        let mode = std::fs::metadata(ancestor)?.permissions().mode();
        if mode & 0o001 == 0 {
            tracing::warn!(path = %ancestor.display(), "adding o+x so sandboxes' mapped root can reach the state directory");
            std::fs::set_permissions(ancestor, std::fs::Permissions::from_mode((mode & 0o7777) | 0o001))?;
        }
    }
    Ok(())
}

/// Makes the run folder `run` and its `sandboxes/` passable but not listable (0711) by other
/// host users: a sandbox's ID names its public ports, and a bundle's name is its sandbox's.
fn unlistable(run: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let sandboxes = run.join("sandboxes");
    std::fs::create_dir_all(&sandboxes)?;
    for dir in [run, sandboxes.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
    }
    Ok(())
}

/// Closes a sandbox's bundle (its spec, envd's socket, the mount point of its root) to every
/// host user but root and the sandbox's own mapped root, which must pass through it to its
/// root before `pivot_root`: owner root, group the sandbox's host gid, mode 0710. Without
/// this any local user could read the sandbox's files through `rootfs/`, its environment in
/// `config.json`, or connect to envd's socket.
fn close_bundle(bundle: &Path, host_gid: u32) -> io::Result<()> {
    std::os::unix::fs::chown(bundle, Some(0), Some(host_gid))?;
    std::fs::set_permissions(bundle, std::fs::Permissions::from_mode(0o710))
}

/// Writes `bytes` to `path` as a file only its owner (root) may read.
fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    // An existing file keeps its mode through the open: close it too.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(bytes)
}

impl ContainerRuntime {
    pub fn new(node_id: &str, config: ContainerConfig) -> Self {
        let pids_max = config.pids_max.unwrap_or_else(crate::cgroup::default_pids_max);
        let (cgroups, mut degraded) = Cgroups::probe(node_id, pids_max);
        let mut missing = probe_host();
        // A runtime's `run` exits once the container runs, orphaning its init: as a subreaper
        // the node inherits it and can reap it the moment it is killed (see `kill`). Left to
        // the host's PID 1, a killed sandbox stays a zombie in its cgroup for as long as that
        // init takes to reap (seconds, on these machines), and the kill waits.
        // `Some(..)` turns the flag on (the kernel takes any non-zero value); it names no
        // process.
        if let Err(err) = rustix::process::set_child_subreaper(Some(rustix::process::Pid::INIT)) {
            degraded.push(format!("not a child subreaper: {err}"));
        }
        if !cgroups.has_memory() || !cgroups.has_freezer() {
            missing.push("memory and freezer cgroups".to_string());
        }
        let root = config.state_dir.join("container");
        let base = base_dir(&config.state_dir);
        let shim = shim_dir(&config.state_dir);
        if let Err(e) = rootfs::ensure_shim(&shim) {
            missing.push(format!("the layer above images at {}: {e}", shim.display()));
        }
        if let Err(e) = std::fs::create_dir_all(&config.state_dir).and_then(|()| private(&config.state_dir)) {
            missing.push(format!("a state directory of the node's own: {e}"));
        }
        let host_dirs = match std::fs::create_dir_all(&root).and_then(|()| rootfs::ensure_base(&base)) {
            Ok(dirs) => dirs,
            Err(e) => {
                missing.push(format!("the base template's layer at {}: {e}", base.display()));
                Vec::new()
            }
        };
        let run = run_dir(&config.state_dir);
        if let Err(e) = run_dir::prepare(&run)
            .and_then(|()| searchable(&run))
            .and_then(|()| unlistable(&run))
        {
            missing.push(format!("a run directory at {}: {e}", run.display()));
        }
        let carrier = multicall_binary();
        // The sandboxes' disks and roots are mounted below these two: a container's mount
        // table starts without them (see `jail::view`).
        // (Every node's run folder is in one tmpfs: the mounts below it are roots of any node.)
        let private_below = vec![
            layout::sandboxes_dir(&config.state_dir),
            PathBuf::from(run_dir::RUN_ROOT),
        ];
        let engine = engine(
            config.oci_runtime.as_deref(),
            carrier.clone(),
            run.join("runtime"),
            private_below,
        )
        .unwrap_or_else(|| {
            missing.push(format!(
                "an OCI runtime: no {JAIL_COMPANION}, node-svc or sandboxsched binary beside this one"
            ));
            let nowhere = oci::Launcher::new(PathBuf::from("/nonexistent/jail"), Vec::new(), run.join("runtime"));
            Box::new(oci::CommandLine::new(nowhere))
        });
        // Absolute: the runtime reads the spec's paths from each sandbox's bundle directory.
        let envd_binary = match config.envd_binary.clone().map(|e| std::path::absolute(&e).unwrap_or(e)) {
            Some(envd) if envd.is_file() => envd,
            Some(envd) => {
                missing.push(format!("the envd binary {} (--envd-binary)", envd.display()));
                envd
            }
            None => companion_binary(ENVD_COMPANION).or(carrier).unwrap_or_else(|| {
                missing.push(format!(
                    "an envd: no {ENVD_COMPANION}, node-svc or sandboxsched binary beside this one"
                ));
                PathBuf::from("/nonexistent/envd")
            }),
        };
        let ids = std::sync::Arc::new(ids::IdRanges::new(rootfs::probe_idmapped_overlay(&root)));
        degraded.extend(
            ids.shared()
                .into_iter()
                .chain(ids.storage_delegated())
                .map(str::to_string),
        );
        let network = network::Network::new(config.network.clone());
        // Before any sandbox runs, and once the floor has loaded connection tracking: a table
        // one sandbox could fill for all (see `host_tables`).
        let memory = crate::host_tables::host_memory_bytes().unwrap_or(config.memory_bytes);
        degraded.extend(crate::host_tables::raise_all(
            Path::new("/proc/sys"),
            memory,
            crate::host_tables::kernel_memory_charged(),
        ));
        let mut slots = None;
        if let Some(problem) = network.problem() {
            degraded.push(format!("sandboxes that need a network are refused: {problem}"));
        } else {
            let next = ids.clone();
            match slots::SlotPool::start(
                network.config().clone(),
                network.nft().map(Path::to_path_buf),
                config.network.slots.clone(),
                Box::new(move |n| next.next_free(n)),
            ) {
                Ok(pool) => slots = Some(pool),
                Err(e) => degraded.push(format!(
                    "no network slots (every linked sandbox makes its own link): {e}"
                )),
            }
        }
        if !missing.is_empty() {
            degraded.push(format!("sandboxes refused: this host lacks {}", missing.join(", ")));
        }
        degraded.extend(crate::host_proc::check());
        degraded.extend(crate::host_crash::check());
        for line in &degraded {
            tracing::warn!(node_id, "container runtime: {line}");
        }
        tracing::info!(node_id, runtime = %engine.describe(), envd = %envd_binary.display(), "sandboxes are OCI containers");
        // The jail lowers a spec's rlimits from inside the container; runc sets them with
        // `prlimit` from outside, which needs CAP_SYS_RESOURCE once the sandbox's user
        // namespace is its own root's rather than the node's (hosts in containers lack it).
        let rlimits = config.oci_runtime.is_none() || holds(rustix::thread::CapabilitySet::SYS_RESOURCE);
        if !rlimits {
            degraded.push(
                "sandboxes keep the node's rlimits (RLIMIT_RTPRIO, RLIMIT_NICE): runc sets them from outside, which needs CAP_SYS_RESOURCE"
                    .to_string(),
            );
        }
        // The jail keeps a killed sandbox's group when asked; another runtime removes its own.
        let spare_cgroups = match config.oci_runtime {
            None => spare_cgroups::SpareCgroups::new(format!("/{}", super::cgroup::parent_name(node_id))),
            Some(_) => spare_cgroups::SpareCgroups::none(),
        };
        Self {
            node_id: node_id.to_string(),
            sandboxes: layout::sandboxes_dir(&config.state_dir),
            run,
            engine,
            base,
            shim,
            layers: layout::layers_dir(&config.state_dir),
            host_dirs,
            envd_binary,
            cgroups,
            spare_cgroups,
            network,
            ids,
            slots,
            pids_max,
            memory_bytes: config.memory_bytes,
            rlimits,
            missing,
            degraded,
        }
    }

    fn cgroups_path(&self, sandbox: &str) -> String {
        format!("/{}/{sandbox}", super::cgroup::parent_name(&self.node_id))
    }

    /// The read-only layers of the sandbox's root, topmost first: its template's layers on
    /// the base (the host's userland), or on nothing but the shim (an image's own root).
    fn lower_dirs(&self, sandbox: &Sandbox<'_>) -> Result<Vec<PathBuf>, String> {
        let image = sandbox.image;
        let mut lower = Vec::new();
        let own_root = image.is_some_and(|i| !i.host_userland);
        if own_root {
            lower.push(self.shim.clone());
        }
        for layer in image.map_or(&[][..], |i| &i.layers[..]).iter().rev() {
            let dir = layout::layer_dir(&self.layers, &layer.digest).map_err(|e| e.to_string())?;
            if !dir.is_dir() {
                return Err(format!("layer {} is not on this node", layer.digest));
            }
            lower.push(dir);
        }
        if !own_root {
            lower.push(self.base.clone());
        }
        Ok(lower)
    }

    fn write_spec(
        &self,
        sandbox: &Sandbox<'_>,
        parts: &Parts,
        host_ids: u32,
        joins: Option<&(PathBuf, PathBuf)>,
    ) -> Result<(), String> {
        let host_userland = sandbox.image.is_none_or(|i| i.host_userland);
        let inputs = spec::Inputs {
            rootfs: &parts.rootfs,
            envd_binary: &self.envd_binary,
            cgroups_path: self.cgroups_path(sandbox.id),
            host_dirs: if host_userland { &self.host_dirs } else { &[] },
            host_userland,
            host_ids,
            pids_limit: spec::pids_limit(self.pids_max, self.memory_bytes, sandbox.memory_bytes),
            joins: joins.map(|(user, net)| (user.as_path(), net.as_path())),
            rlimits: self.rlimits,
        };
        let spec = spec::spec(sandbox, &inputs)?;
        let json = serde_json::to_vec_pretty(&spec).map_err(|e| e.to_string())?;
        // The spec holds the user's environment variables: the node's alone to read.
        write_private(&parts.bundle.join("config.json"), &json).map_err(|e| format!("writing config.json: {e}"))
    }

    /// Takes a network slot for `sandbox` of range `host_ids` and sets its own rules in it
    /// (before its first process runs): the namespace paths its spec joins.
    fn join_slot(
        &self,
        slots: &slots::SlotPool,
        sandbox: &str,
        host_ids: u32,
        policy: &contracts::egress::NetworkPolicy,
    ) -> Result<slots::NetSlotView, String> {
        let view = slots.take(sandbox, host_ids).map_err(|e| e.to_string())?;
        let netns = view.net_file().map_err(|e| format!("the network slot: {e}"))?;
        if network::set_rules(self.network.nft(), &netns, policy).map_err(|e| e.to_string())? {
            slots.mark_rules(sandbox);
        }
        tracing::debug!(sandbox_id = sandbox, interface = %view.link.host_interface, address = %view.link.address, "sandbox takes a network slot");
        Ok(view)
    }

    /// Whether nothing is left of `sandbox`'s container: none was there, or it is deleted
    /// now. One that could not be deleted keeps its ids and its network slot held (a slot two
    /// tenants shared would give each the other's traffic).
    fn gone(&self, sandbox: &str) -> bool {
        if !self.engine.knows(sandbox) {
            return true;
        }
        match self.delete_container(sandbox) {
            Ok(()) => true,
            Err(err) => {
                tracing::error!(sandbox_id = sandbox, %err, "its container was not deleted: its ids and network slot stay held");
                false
            }
        }
    }

    /// Deletes `sandbox`'s container, its group kept as a spare while there is room for one.
    fn delete_container(&self, sandbox: &str) -> Result<(), oci::EngineError> {
        let Some(spare) = self.spare_cgroups.next_path() else {
            return self.engine.delete(sandbox);
        };
        if self.engine.delete_keeping_cgroup(sandbox, &spare)? {
            self.spare_cgroups.kept(spare);
        }
        Ok(())
    }

    /// Gives back `sandbox`'s network slot, if it holds one.
    fn give_back_slot(&self, sandbox: &str) {
        if let Some(slots) = &self.slots {
            slots.give_back(sandbox);
        }
    }

    fn bind_socket(parts: &Parts) -> io::Result<std::os::unix::net::UnixListener> {
        match std::fs::remove_file(&parts.socket) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::os::unix::net::UnixListener::bind(&parts.socket)
    }
}

impl Runtime for ContainerRuntime {
    fn kind(&self) -> &'static str {
        "container"
    }

    fn features(&self) -> Features {
        Features {
            cgroup_memory: self.cgroups.has_memory(),
            freezer: self.cgroups.has_freezer(),
            namespaces: self.missing.is_empty(),
            // The DNS forwarder's state is read each time: one that could not start is tried
            // again, and the node stops saying so once it runs.
            degraded: self
                .degraded
                .iter()
                .cloned()
                .chain(
                    self.network
                        .dns_problem()
                        .map(|p| format!("sandboxes cannot resolve names: {p}")),
                )
                .collect(),
        }
    }

    fn start(&self, sandbox: &Sandbox<'_>, home: &Path) -> Result<u32, RuntimeError> {
        if !self.missing.is_empty() {
            return Err(start_error(
                sandbox,
                format!(
                    "this host cannot isolate sandboxes: it lacks {}",
                    self.missing.join(", ")
                ),
            ));
        }
        if sandbox.image.is_some_and(|i| !i.host_userland) {
            if let Some(why) = self.images_refused() {
                return Err(start_error(sandbox, format!("its template is an image, and {why}")));
            }
        }
        let parts = parts(&self.run, home);
        // A container of this ID left from before (a restore over a dead copy) goes first; the
        // runtime keeps a folder per container under its root, so a new ID costs no call.
        if self.engine.knows(sandbox.id) {
            self.delete_container(sandbox.id).map_err(|e| start_error(sandbox, e))?;
        }
        // A sandbox that reaches out takes a network slot: its id range one with a slot ready.
        let pool = self.slots.as_ref().zip(sandbox.network.filter(|p| p.needs_link()));
        let ready = self
            .slots
            .as_ref()
            .map(slots::SlotPool::ready_ranges)
            .unwrap_or_default();
        let ids = self
            .ids
            .claim(sandbox.id, &ready, pool.is_some())
            .map_err(|e| start_error(sandbox, e))?;
        // A killed sandbox's group, renamed to this one's: the runtime finds it and sets this
        // sandbox's limits in it.
        let took_spare = self.spare_cgroups.take(&self.cgroups_path(sandbox.id));
        let started = (|| -> Result<u32, String> {
            let joins = match pool {
                Some((slots, policy)) => Some(self.join_slot(slots, sandbox.id, ids.host_base, policy)?),
                None => None,
            };
            rootfs::prepare_upper(home, &parts.work).map_err(|e| format!("writable layer: {e}"))?;
            let lower = self.lower_dirs(sandbox)?;
            std::fs::create_dir_all(&parts.bundle).map_err(|e| format!("bundle: {e}"))?;
            close_bundle(&parts.bundle, ids.host_base).map_err(|e| format!("bundle: {e}"))?;
            let idmap = ids.userns.as_ref().map(|fd| fd.as_fd());
            // The root as a mount the runtime takes into the container's own table, where it
            // can (the node's table then never holds it, see `jail::view`), else mounted here.
            let tree = if self.engine.takes_root_mount() {
                // A root an older node mounted here, still there for a sandbox started again
                // (its container gone): a second overlay over the same layers must not sit
                // beside it.
                rootfs::unmount(&parts.rootfs).map_err(|e| format!("the root left mounted: {e}"))?;
                std::fs::create_dir_all(&parts.rootfs).map_err(|e| format!("bundle: {e}"))?;
                Some(rootfs::root_tree(&lower, home, &parts.work, &parts.rootfs, idmap).map_err(|e| e.to_string())?)
            } else {
                rootfs::mount_overlay(&lower, home, &parts.work, &parts.rootfs, idmap).map_err(|e| e.to_string())?;
                None
            };
            let paths = joins.as_ref().map(slots::NetSlotView::paths);
            self.write_spec(sandbox, &parts, ids.host_base, paths.as_ref())?;
            let listener = Self::bind_socket(&parts).map_err(|e| format!("envd socket: {e}"))?;
            // envd starts the start command when this pipe closes: after the network is up.
            let (boot_read, boot_write) = io::pipe().map_err(|e| format!("boot pipe: {e}"))?;
            let passed = [listener.as_fd(), boot_read.as_fd()];
            match tree {
                Some(tree) => {
                    let root = oci::Root {
                        tree,
                        at: &parts.rootfs,
                    };
                    self.engine
                        .run_rooted(sandbox.id, &parts.bundle, &parts.pid_file, &parts.log, root, &passed)
                }
                None => self
                    .engine
                    .run(sandbox.id, &parts.bundle, &parts.pid_file, &parts.log, &passed),
            }
            .map_err(|e| e.to_string())?;
            drop(boot_read);
            let pid = std::fs::read_to_string(&parts.pid_file).map_err(|e| format!("reading the pid file: {e}"))?;
            let pid = pid
                .trim()
                .parse::<u32>()
                .map_err(|e| format!("pid file {pid:?}: {e}"))?;
            // The runtime has joined the slot's namespaces: the view's descriptors may close.
            let linked = match joins {
                Some(_) => Ok(None),
                None => self.network.attach(sandbox.id, pid, sandbox.network),
            };
            drop(boot_write);
            if let Err(e) = linked {
                reap_when_dead(pid);
                let _ = self.delete_container(sandbox.id);
                return Err(e.to_string());
            }
            Ok(pid)
        })();
        started.map_err(|e| {
            // Its ids and its network slot are free only once nothing of its container is left
            // (a start that failed after the runtime's `run` may have left one running).
            if self.gone(sandbox.id) {
                self.give_back_slot(sandbox.id);
                self.ids.release(sandbox.id);
                // The runtime removes only groups it made: the spare this create took is left
                // where the run failed before its container's state was whole.
                if took_spare {
                    self.spare_cgroups.give_back(&self.cgroups_path(sandbox.id));
                }
            }
            let _ = dismantle(&parts);
            start_error(sandbox, e)
        })
    }

    fn pause(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError> {
        self.engine.pause(sandbox.id).map_err(|e| control(sandbox, "pause", e))
    }

    fn resume(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError> {
        match self
            .engine
            .state(sandbox.id)
            .map_err(|e| control(sandbox, "resume", e))?
        {
            Some(oci::Status::Paused) => self
                .engine
                .resume(sandbox.id)
                .map_err(|e| control(sandbox, "resume", e)),
            Some(oci::Status::Running) => Ok(()),
            // Restored from a snapshot (or its container died): nothing to thaw; the host
            // starts it afresh.
            Some(oci::Status::Stopped) | None => Ok(()),
        }
    }

    fn kill(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError> {
        reap_when_dead(sandbox.pgid);
        self.delete_container(sandbox.id)
            .map_err(|e| control(sandbox, "kill", e))?;
        // Then its link, by the host end's index (which the kernel does not hand out again
        // soon): its address is free for the next sandbox when this returns, not when the
        // kernel frees the namespace. Not before the delete: a kill that fails leaves the
        // sandbox running, and running with its network.
        self.network.detach(sandbox.id);
        // Every process of the sandbox is gone with its container: its ids may be reused, and
        // its network slot, once cooled and cleaned.
        self.give_back_slot(sandbox.id);
        self.ids.release(sandbox.id);
        dismantle(&parts(&self.run, &layout::home_in(&self.sandboxes.join(sandbox.id))))
            .map_err(|e| control(sandbox, "kill", e))
    }

    fn memory_used(&self, sandbox: &Sandbox<'_>) -> u64 {
        self.cgroups.memory_usage(sandbox.id).unwrap_or(0)
    }

    fn alive(&self, sandbox: &Sandbox<'_>) -> bool {
        matches!(
            self.engine.state(sandbox.id),
            Ok(Some(oci::Status::Running | oci::Status::Paused))
        )
    }

    /// Its init (envd) still runs under its PID: alive, without asking the runtime (a `runc
    /// state` per sandbox every few seconds adds up). Gone or a zombie (the node, as the
    /// subreaper, inherits inits and reaps one only when it kills it): the runtime confirms,
    /// since a PID proves nothing either way once it may have been reused.
    fn died(&self, sandbox: &Sandbox<'_>) -> bool {
        !init_runs(sandbox.pgid) && !self.alive(sandbox)
    }

    fn adopt(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError> {
        self.ids.adopt(sandbox.id, sandbox.pgid);
        // Its network slot, or its own link, so its kill gives back or takes down what it has.
        // Only while its container runs: a PID number reused by some other process must not
        // hand that process's network to this kill. (A restored sandbox has no process yet:
        // its start links it.)
        if sandbox.pgid > 1 && self.alive(sandbox) {
            let adopted = self.slots.as_ref().map(|slots| slots.adopt(sandbox.id, sandbox.pgid));
            match adopted {
                Some(slots::Adopted::Slot) => {}
                // Another sandbox's record names the same process (a PID reused): neither the
                // slot nor its link becomes this one's to give back or take down.
                Some(slots::Adopted::HeldByAnother) => {}
                Some(slots::Adopted::NoSlot) | None => self.network.adopt(sandbox.id, sandbox.pgid),
            }
        }
        Ok(())
    }

    fn cpu_time_ns(&self) -> Option<u64> {
        self.cgroups.cpu_time_ns()
    }

    fn discard(&self, id: &str, home: &Path) {
        let gone = self.gone(id);
        if gone {
            self.network.detach(id);
            self.give_back_slot(id);
            self.ids.release(id);
        }
        if let Err(err) = dismantle(&parts(&self.run, home)) {
            tracing::warn!(sandbox_id = %id, %err, "the root of a sandbox without a sandbox was not unmounted");
        }
        // A group a create renamed from a spare before its container existed (the node died
        // in between) is in no container's state: kept again, or removed in every hierarchy.
        if gone {
            self.spare_cgroups.give_back(&self.cgroups_path(id));
        }
        self.cgroups.remove(id);
    }

    fn discard_unknown(&self, keep: &std::collections::HashSet<String>) -> Vec<String> {
        let mut gone = Vec::new();
        for entry in std::fs::read_dir(self.engine.root()).into_iter().flatten().flatten() {
            let id = entry.file_name().to_string_lossy().into_owned();
            if keep.contains(&id) {
                continue;
            }
            match self.engine.delete(&id) {
                Ok(()) => {
                    self.network.detach(&id);
                    self.give_back_slot(&id);
                    self.cgroups.remove(&id);
                    gone.push(id);
                }
                Err(err) => tracing::warn!(sandbox_id = %id, %err, "an unknown container was not deleted"),
            }
        }
        gone
    }

    fn cpu_time_ns_of(&self, sandbox: &Sandbox<'_>) -> Option<u64> {
        self.cgroups.cpu_usage_ns(sandbox.id)
    }

    fn enclose(
        &self,
        sandbox: &Sandbox<'_>,
        _home: &Path,
        _cwd: &Path,
        _command: &mut std::process::Command,
    ) -> Result<(), RuntimeError> {
        Err(control(
            sandbox,
            "run a command in",
            "commands run through envd inside the container",
        ))
    }

    fn envd_socket(&self, home: &Path) -> Option<PathBuf> {
        Some(parts(&self.run, home).socket)
    }

    fn runs_envd(&self) -> bool {
        true
    }

    fn own_disks(&self) -> bool {
        true
    }

    fn prepare_disk(&self, dir: &Path) -> io::Result<()> {
        let home = layout::home_in(dir);
        rootfs::prepare_upper(&home, &parts(&self.run, &home).work)
    }

    fn log_file(&self, home: &Path) -> Option<PathBuf> {
        Some(parts(&self.run, home).log)
    }

    /// An image brings its own C library, or none: envd must need nothing of it.
    fn images_refused(&self) -> Option<String> {
        match needs_interpreter(&self.envd_binary) {
            Ok(false) => None,
            Ok(true) => Some(format!(
                "its envd ({}) is dynamically linked and needs the host's C library; give the node a static one (--envd-binary, built by scripts/build-static-envd)",
                self.envd_binary.display()
            )),
            Err(e) => Some(format!("its envd ({}) cannot be read: {e}", self.envd_binary.display())),
        }
    }

    fn update_network(
        &self,
        sandbox: &Sandbox<'_>,
        policy: &contracts::egress::NetworkPolicy,
    ) -> Result<(), RuntimeError> {
        if let Some(slots) = &self.slots {
            // Rules it may now have are cleaned out of its slot when it is given back.
            slots.mark_rules(sandbox.id);
        }
        self.network
            .update(sandbox.id, sandbox.pgid, policy)
            .map(drop)
            .map_err(|e| control(sandbox, "change the network of", e))
    }

    /// Inside the sandbox's own network namespace: its `127.0.0.1:port`, so a server bound
    /// to loopback only is reachable too, and no route into the sandbox is needed.
    fn connect_port(&self, sandbox: &Sandbox<'_>, port: u16) -> io::Result<std::net::TcpStream> {
        super::connect_in_namespace_of(sandbox.pgid, port)
    }

    /// Into `/home/user` of the sandbox's own layer, owned by its user (and `/home` as the
    /// base layer has it: the upper layer's folders are what the sandbox sees).
    fn seed(&self, home: &Path, files: &Path) -> io::Result<()> {
        rootfs::seed_user_files(home, files)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_process_runs_and_a_zombie_does_not() {
        assert!(init_runs(std::process::id()));
        assert!(!init_runs(0) && !init_runs(1));
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let pid = child.id();
        // Exited but not waited for: a zombie until `wait`, which must not count as running.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while init_runs(pid) && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(!init_runs(pid), "a zombie counted as running");
        child.wait().expect("wait");
        assert!(!init_runs(pid));
    }

    #[test]
    fn a_dynamically_linked_binary_needs_its_interpreter() {
        let exe = std::env::current_exe().expect("test binary");
        assert!(
            needs_interpreter(&exe).expect("an ELF file"),
            "test binaries link the C library"
        );
        let not_elf = std::env::temp_dir().join(format!("not-elf-{}", std::process::id()));
        std::fs::write(
            &not_elf,
            b"#!/bin/sh\nexit 0\n-----------------------------------------------------------------",
        )
        .expect("write");
        assert!(needs_interpreter(&not_elf).is_err());
        let _ = std::fs::remove_file(&not_elf);
    }
}
