//! Reading and validating the bundle's `config.json`.
//!
//! The file is parsed with the `oci-spec` crate (runtime types only) and then checked
//! against what this runtime implements. The rule is: **refuse, never silently ignore**.
//! A container that quietly runs without a requested namespace, hook, limit or security
//! setting is worse than one that does not start, so every field we do not implement makes
//! `run` fail with a message naming it, before anything is created.
//!
//! Fields the spec omits get runc's defaults (runc is the reference implementation and the
//! node may use either runtime): no `linux.cgroupsPath` means `/ID`; no
//! `process.capabilities` means the capability sets are left as they are; no `rlimits`
//! means the caller's limits are inherited; `noNewPrivileges` defaults to false; `umask`
//! to 0022; `root.readonly` to false.
//!
//! The result is a [`Config`]: the validated, flattened view the other modules work from,
//! so that only this module knows the shape of the OCI types.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use oci_spec::runtime::{LinuxDevice, LinuxIdMapping, LinuxNamespaceType, LinuxResources, Process, Spec};

use crate::cgroup::{self, Resources};
use crate::sys::IoDisplay;

/// Errors from loading or validating the spec.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("read {path}: {}", IoDisplay(source))]
    Read { path: PathBuf, source: io::Error },
    #[error("parse {path}: {source}")]
    Parse { path: PathBuf, source: serde_json::Error },
    #[error("rootfs {path}: {}", IoDisplay(source))]
    Rootfs { path: PathBuf, source: io::Error },
    #[error("config.json: {0} is not supported by this runtime")]
    Unsupported(String),
    #[error("config.json: {0}")]
    Invalid(String),
}

fn unsupported(what: impl Into<String>) -> SpecError {
    SpecError::Unsupported(what.into())
}

fn invalid(what: impl Into<String>) -> SpecError {
    SpecError::Invalid(what.into())
}

/// Which namespaces the container runs in: new ones, or (user and network only) existing
/// ones it joins by path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Namespaces {
    pub user: bool,
    pub pid: bool,
    pub mount: bool,
    pub net: bool,
    pub ipc: bool,
    pub uts: bool,
    pub cgroup: bool,
    /// An existing user namespace to join (`path`) instead of making one: `user` is then
    /// true too (the container runs in a user namespace), but none is created.
    pub join_user: Option<PathBuf>,
    /// An existing network namespace to join instead of making one (`net` is then true).
    pub join_net: Option<PathBuf>,
}

impl Namespaces {
    /// The `CLONE_NEW*` flags for `clone(2)`: the namespaces to create. The cgroup namespace
    /// is left out on purpose: it captures the cgroup the process is in *when it is created*,
    /// so the child unshares it only after it has been moved into the container's cgroup.
    /// Joined namespaces are left out too: the init is cloned inside them.
    pub fn clone_flags(&self) -> libc::c_int {
        let mut f = 0;
        for (on, flag) in [
            (self.user && self.join_user.is_none(), libc::CLONE_NEWUSER),
            (self.pid, libc::CLONE_NEWPID),
            (self.mount, libc::CLONE_NEWNS),
            (self.net && self.join_net.is_none(), libc::CLONE_NEWNET),
            (self.ipc, libc::CLONE_NEWIPC),
            (self.uts, libc::CLONE_NEWUTS),
        ] {
            if on {
                f |= flag;
            }
        }
        f
    }
}

/// The validated container configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub oci_version: String,
    pub bundle: PathBuf,
    /// Canonical absolute path of the rootfs on the host.
    pub rootfs: PathBuf,
    pub root_readonly: bool,
    /// `mounts`, each with its options parsed once.
    pub mounts: Vec<crate::rootfs::options::SpecMount>,
    pub namespaces: Namespaces,
    pub uid_mappings: Vec<LinuxIdMapping>,
    pub gid_mappings: Vec<LinuxIdMapping>,
    pub hostname: Option<String>,
    pub domainname: Option<String>,
    pub process: Process,
    pub devices: Vec<LinuxDevice>,
    pub masked_paths: Vec<String>,
    pub readonly_paths: Vec<String>,
    pub rootfs_propagation: Option<String>,
    pub cgroups_path: String,
    pub resources: Resources,
    /// The compiled `linux.seccomp` profile.
    pub seccomp: Option<crate::seccomp::Program>,
    pub annotations: BTreeMap<String, String>,
}

/// Reads `bundle/config.json`, validates it and resolves the rootfs.
pub fn load(bundle: &Path, id: &str) -> Result<Config, SpecError> {
    let path = bundle.join("config.json");
    let bytes = fs::read(&path).map_err(|source| SpecError::Read {
        path: path.clone(),
        source,
    })?;
    let spec: Spec = serde_json::from_slice(&bytes).map_err(|source| SpecError::Parse { path, source })?;
    let mut config = validate(spec, bundle, id)?;
    let rootfs = if config.rootfs.is_absolute() {
        config.rootfs.clone()
    } else {
        bundle.join(&config.rootfs)
    };
    // Canonical, so the child bind-mounts exactly this directory and no symlink in the
    // path can be swapped between now and then.
    config.rootfs = fs::canonicalize(&rootfs).map_err(|source| SpecError::Rootfs {
        path: rootfs.clone(),
        source,
    })?;
    if !config.rootfs.is_dir() {
        return Err(SpecError::Rootfs {
            path: rootfs,
            source: io::Error::other("not a directory"),
        });
    }
    Ok(config)
}

/// Checks a parsed spec and flattens it. `rootfs` in the result is still as written in the
/// spec (relative or absolute); [`load`] resolves it.
pub fn validate(spec: Spec, bundle: &Path, id: &str) -> Result<Config, SpecError> {
    let version = spec.version();
    if !version.starts_with("1.") {
        return Err(invalid(format!("unsupported ociVersion {version:?} (want 1.x)")));
    }
    if let Some(hooks) = spec.hooks() {
        #[allow(deprecated)]
        let any = [
            hooks.prestart(),
            hooks.create_runtime(),
            hooks.create_container(),
            hooks.start_container(),
            hooks.poststart(),
            hooks.poststop(),
        ]
        .iter()
        .any(|h| h.as_ref().is_some_and(|v| !v.is_empty()));
        if any {
            return Err(unsupported("hooks"));
        }
    }
    if spec.solaris().is_some() || spec.windows().is_some() || spec.vm().is_some() || spec.zos().is_some() {
        return Err(unsupported("a non-Linux platform section (solaris/windows/vm/zos)"));
    }
    let root = spec.root().as_ref().ok_or_else(|| invalid("root is missing"))?;
    if root.path().as_os_str().is_empty() {
        return Err(invalid("root.path is empty"));
    }
    let process = spec.process().clone().ok_or_else(|| invalid("process is missing"))?;
    validate_process(&process)?;

    let linux = match spec.linux() {
        Some(l) => l.clone(),
        None => empty_linux()?,
    };
    let mut ns = Namespaces::default();
    for n in linux.namespaces().iter().flatten() {
        // A user and a network namespace may be joined (a node keeps them ready for its
        // sandboxes); joining any other is refused.
        if let Some(path) = n.path() {
            let join = match n.typ() {
                LinuxNamespaceType::User => &mut ns.join_user,
                LinuxNamespaceType::Network => &mut ns.join_net,
                other => return Err(unsupported(format!("joining an existing {other} namespace (path)"))),
            };
            if !path.is_absolute() {
                return Err(invalid(format!(
                    "the {} namespace's path {} is not absolute",
                    n.typ(),
                    path.display()
                )));
            }
            *join = Some(path.clone());
        }
        let slot = match n.typ() {
            LinuxNamespaceType::User => &mut ns.user,
            LinuxNamespaceType::Pid => &mut ns.pid,
            LinuxNamespaceType::Mount => &mut ns.mount,
            LinuxNamespaceType::Network => &mut ns.net,
            LinuxNamespaceType::Ipc => &mut ns.ipc,
            LinuxNamespaceType::Uts => &mut ns.uts,
            LinuxNamespaceType::Cgroup => &mut ns.cgroup,
            LinuxNamespaceType::Time => return Err(unsupported("the time namespace")),
        };
        if std::mem::replace(slot, true) {
            return Err(invalid(format!("namespace {} listed twice", n.typ())));
        }
    }
    if ns.join_net.is_some() && ns.join_user.is_none() {
        // Joined by host root, any network namespace could be named (the host's own among
        // them); joined from inside a joined user namespace, only one that namespace owns.
        return Err(unsupported(
            "joining a network namespace without joining the user namespace that owns it",
        ));
    }
    if !ns.mount {
        // Without a private mount namespace the rootfs mounts would land on the host.
        return Err(unsupported("a container without a mount namespace"));
    }
    let uid_mappings = linux.uid_mappings().clone().unwrap_or_default();
    let gid_mappings = linux.gid_mappings().clone().unwrap_or_default();
    if ns.user {
        if uid_mappings.is_empty() || gid_mappings.is_empty() {
            return Err(invalid(
                "a user namespace needs linux.uidMappings and linux.gidMappings",
            ));
        }
        for m in uid_mappings.iter().chain(&gid_mappings) {
            if m.size() == 0 {
                return Err(invalid("an id mapping has size 0"));
            }
        }
        if uid_mappings.len() > 340 || gid_mappings.len() > 340 {
            return Err(invalid("more than 340 id mappings (the kernel's limit)"));
        }
    } else if !uid_mappings.is_empty() || !gid_mappings.is_empty() {
        return Err(invalid("uidMappings/gidMappings without a user namespace"));
    }
    if spec.hostname().as_ref().is_some_and(|h| !h.is_empty()) && !ns.uts {
        return Err(invalid("hostname is set but there is no new uts namespace"));
    }
    if spec.domainname().as_ref().is_some_and(|h| !h.is_empty()) && !ns.uts {
        return Err(invalid("domainname is set but there is no new uts namespace"));
    }
    if linux.net_devices().as_ref().is_some_and(|d| !d.is_empty()) {
        return Err(unsupported("linux.netDevices"));
    }
    if linux.sysctl().as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("linux.sysctl"));
    }
    if linux.mount_label().as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("linux.mountLabel (SELinux)"));
    }
    if linux.intel_rdt().is_some() {
        return Err(unsupported("linux.intelRdt"));
    }
    if linux.memory_policy().is_some() {
        return Err(unsupported("linux.memoryPolicy"));
    }
    if linux.personality().is_some() {
        return Err(unsupported("linux.personality"));
    }
    if linux.time_offsets().as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(unsupported("linux.timeOffsets"));
    }
    if let Some(p) = linux.rootfs_propagation() {
        if !p.is_empty() {
            crate::rootfs::options::propagation_flag(p)
                .ok_or_else(|| invalid(format!("unknown rootfsPropagation {p:?}")))?;
        }
    }
    let mounts = spec
        .mounts()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|m| crate::rootfs::options::validate_mount(m).map_err(|e| invalid(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    let devices = linux.devices().clone().unwrap_or_default();
    for d in &devices {
        crate::rootfs::options::validate_device_path(d.path()).map_err(|e| invalid(e.to_string()))?;
    }
    let masked_paths = linux.masked_paths().clone().unwrap_or_default();
    let readonly_paths = linux.readonly_paths().clone().unwrap_or_default();
    for p in masked_paths.iter().chain(&readonly_paths) {
        crate::rootfs::options::split_container_path(p).map_err(|e| invalid(e.to_string()))?;
    }

    let cgroups_path = match linux.cgroups_path() {
        None => format!("/{id}"),
        Some(p) => {
            let s = p.to_str().ok_or_else(|| invalid("linux.cgroupsPath is not UTF-8"))?;
            if !s.starts_with('/') {
                // runc resolves relative paths against its own cgroup (or, with systemd,
                // reads "slice:prefix:name"); we only support the plain absolute form.
                return Err(unsupported(format!(
                    "a relative linux.cgroupsPath ({s:?}); use an absolute path"
                )));
            }
            cgroup::normalize_path(s).map_err(|e| invalid(e.to_string()))?
        }
    };
    let resources = match linux.resources() {
        Some(r) => resources(r)?,
        None => Resources::default(),
    };
    // Compiled here, so a bad profile is refused before anything is created.
    let seccomp = linux
        .seccomp()
        .as_ref()
        .map(crate::seccomp::compile)
        .transpose()
        .map_err(|e| invalid(e.to_string()))?;

    Ok(Config {
        oci_version: version.clone(),
        bundle: bundle.to_path_buf(),
        rootfs: root.path().clone(),
        root_readonly: root.readonly().unwrap_or(false),
        mounts,
        namespaces: ns,
        uid_mappings,
        gid_mappings,
        hostname: spec.hostname().clone().filter(|h| !h.is_empty()),
        domainname: spec.domainname().clone().filter(|h| !h.is_empty()),
        process,
        devices,
        masked_paths,
        readonly_paths,
        rootfs_propagation: linux.rootfs_propagation().clone().filter(|p| !p.is_empty()),
        cgroups_path,
        resources,
        seccomp,
        annotations: spec.annotations().clone().unwrap_or_default().into_iter().collect(),
    })
}

/// An empty `linux` section. (`Linux::default()` in oci-spec is a *populated* example with
/// default namespaces and masked paths; a spec without `linux` must mean none of that.)
fn empty_linux() -> Result<oci_spec::runtime::Linux, SpecError> {
    serde_json::from_str("{}").map_err(|e| invalid(format!("empty linux section: {e}")))
}

fn validate_process(p: &Process) -> Result<(), SpecError> {
    if p.terminal() == Some(true) {
        return Err(unsupported(
            "process.terminal=true (only detached containers without a terminal)",
        ));
    }
    let args = p
        .args()
        .as_ref()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| invalid("process.args is empty"))?;
    if args[0].is_empty() {
        return Err(invalid("process.args[0] is empty"));
    }
    if p.command_line().is_some() {
        return Err(unsupported("process.commandLine (Windows)"));
    }
    if !p.cwd().is_absolute() {
        return Err(invalid(format!("process.cwd {:?} is not absolute", p.cwd())));
    }
    crate::rootfs::options::split_container_path(&p.cwd().to_string_lossy()).map_err(|e| invalid(e.to_string()))?;
    if p.user().username().is_some() {
        return Err(unsupported("process.user.username (Windows)"));
    }
    if p.apparmor_profile().as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("process.apparmorProfile"));
    }
    if p.selinux_label().as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("process.selinuxLabel"));
    }
    if p.io_priority().is_some() {
        return Err(unsupported("process.ioPriority"));
    }
    if p.scheduler().is_some() {
        return Err(unsupported("process.scheduler"));
    }
    if p.exec_cpu_affinity().is_some() {
        return Err(unsupported("process.execCPUAffinity"));
    }
    for e in p.env().iter().flatten() {
        if !e.contains('=') {
            return Err(invalid(format!("process.env entry {e:?} has no '='")));
        }
    }
    for s in args.iter().chain(p.env().iter().flatten()) {
        if s.contains('\0') {
            return Err(invalid("process.args/env contain a NUL byte"));
        }
    }
    if let Some(adj) = p.oom_score_adj() {
        if !(-1000..=1000).contains(&adj) {
            return Err(invalid(format!("process.oomScoreAdj {adj} is outside -1000..1000")));
        }
    }
    Ok(())
}

/// Extracts the limits we implement; anything else in `linux.resources` is refused.
fn resources(r: &LinuxResources) -> Result<Resources, SpecError> {
    if r.devices().as_ref().is_some_and(|d| !d.is_empty()) {
        // Device access is governed by what we bind-mount into /dev (and, in a user
        // namespace, mknod is impossible anyway); we do not program the devices cgroup.
        return Err(unsupported("linux.resources.devices (device cgroup rules)"));
    }
    if r.block_io().is_some() {
        return Err(unsupported("linux.resources.blockIO"));
    }
    if r.hugepage_limits().as_ref().is_some_and(|h| !h.is_empty()) {
        return Err(unsupported("linux.resources.hugepageLimits"));
    }
    if r.network().is_some() {
        return Err(unsupported("linux.resources.network"));
    }
    if r.rdma().as_ref().is_some_and(|x| !x.is_empty()) {
        return Err(unsupported("linux.resources.rdma"));
    }
    if r.unified().as_ref().is_some_and(|x| !x.is_empty()) {
        return Err(unsupported("linux.resources.unified"));
    }
    let mut out = Resources::default();
    if let Some(m) = r.memory() {
        #[allow(deprecated)]
        let kernel = m.kernel();
        if kernel.is_some()
            || m.kernel_tcp().is_some()
            || m.swappiness().is_some()
            || m.disable_oom_killer().is_some()
            || m.use_hierarchy().is_some()
            || m.check_before_update().is_some()
        {
            return Err(unsupported(
                "linux.resources.memory fields other than limit, reservation and swap \
                 (kernel, kernelTCP, swappiness, disableOOMKiller, useHierarchy, checkBeforeUpdate)",
            ));
        }
        out.memory_limit = m.limit();
        out.memory_reservation = m.reservation();
        out.memory_swap = m.swap();
        if let (Some(s), Some(l)) = (m.swap(), m.limit()) {
            if s > 0 && l > 0 && s < l {
                return Err(invalid(format!(
                    "memory.swap ({s}) must be >= memory.limit ({l}): it is memory+swap"
                )));
            }
        }
    }
    if let Some(c) = r.cpu() {
        if c.realtime_runtime().is_some()
            || c.realtime_period().is_some()
            || c.cpus().as_ref().is_some_and(|s| !s.is_empty())
            || c.mems().as_ref().is_some_and(|s| !s.is_empty())
            || c.idle().is_some()
            || c.burst().is_some()
        {
            return Err(unsupported(
                "linux.resources.cpu fields other than shares, quota and period \
                 (realtimeRuntime, realtimePeriod, cpus, mems, idle, burst)",
            ));
        }
        out.cpu_shares = c.shares();
        out.cpu_quota = c.quota();
        out.cpu_period = c.period();
    }
    if let Some(p) = r.pids() {
        out.pids_limit = Some(p.limit());
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// A minimal valid spec, as JSON, for tests to modify.
    pub(crate) fn base() -> Value {
        json!({
            "ociVersion": "1.0.2",
            "root": {"path": "rootfs"},
            "process": {"cwd": "/", "user": {"uid": 0, "gid": 0}, "args": ["/bin/sh"], "env": ["PATH=/bin"]},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {
                "namespaces": [{"type": "user"}, {"type": "pid"}, {"type": "mount"}, {"type": "network"},
                               {"type": "ipc"}, {"type": "uts"}, {"type": "cgroup"}],
                "uidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}],
                "gidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}]
            }
        })
    }

    pub(crate) fn check(v: Value) -> Result<Config, SpecError> {
        let spec: Spec = serde_json::from_value(v).map_err(|source| SpecError::Parse {
            path: "config.json".into(),
            source,
        })?;
        validate(spec, Path::new("/bundle"), "c1")
    }

    fn refused(v: Value, needle: &str) {
        match check(v) {
            Ok(_) => panic!("accepted, wanted an error mentioning {needle:?}"),
            Err(e) => assert!(e.to_string().contains(needle), "{e} does not mention {needle:?}"),
        }
    }

    #[test]
    fn base_is_valid_with_runc_defaults() {
        let c = check(base()).unwrap();
        assert_eq!(c.cgroups_path, "/c1");
        assert!(!c.root_readonly);
        assert!(c.namespaces.user && c.namespaces.pid && c.namespaces.cgroup);
        assert_eq!(c.namespaces.clone_flags() & libc::CLONE_NEWCGROUP, 0);
        assert_eq!(c.resources, Resources::default());
        assert!(c.process.capabilities().is_none());
    }

    #[test]
    fn refusals_name_the_feature() {
        let mut v = base();
        v["linux"]["namespaces"][1] = json!({"type": "pid", "path": "/proc/1/ns/pid"});
        refused(v, "joining an existing pid namespace");

        let mut v = base();
        v["linux"]["namespaces"][3] = json!({"type": "network", "path": "/proc/1/ns/net"});
        refused(
            v,
            "joining a network namespace without joining the user namespace that owns it",
        );

        let mut v = base();
        v["hooks"] = json!({"prestart": [{"path": "/bin/true"}]});
        refused(v, "hooks");

        let mut v = base();
        v["process"]["terminal"] = json!(true);
        refused(v, "terminal");

        let mut v = base();
        v["mounts"] = json!([{"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"}]);
        refused(v, "cgroup");

        let mut v = base();
        v["linux"]["namespaces"] = json!([{"type": "pid"}]);
        refused(v, "mount namespace");

        let mut v = base();
        v["linux"]["uidMappings"] = json!([]);
        refused(v, "uidMappings");

        let mut v = base();
        v["linux"]["resources"] = json!({"devices": [{"allow": false, "access": "rwm"}]});
        refused(v, "linux.resources.devices");

        let mut v = base();
        v["linux"]["resources"] = json!({"blockIO": {"weight": 10}});
        refused(v, "blockIO");

        let mut v = base();
        v["linux"]["sysctl"] = json!({"net.ipv4.ip_forward": "1"});
        refused(v, "sysctl");

        let mut v = base();
        v["linux"]["cgroupsPath"] = json!("relative/path");
        refused(v, "relative linux.cgroupsPath");

        let mut v = base();
        v["linux"]["cgroupsPath"] = json!("/a/../b");
        refused(v, "invalid cgroup path");

        let mut v = base();
        v["process"]["args"] = json!([]);
        refused(v, "process.args is empty");

        let mut v = base();
        v["process"]["apparmorProfile"] = json!("docker-default");
        refused(v, "apparmorProfile");

        let mut v = base();
        v["linux"]["namespaces"] = json!([{"type": "mount"}, {"type": "time"}]);
        refused(v, "time namespace");

        let mut v = base();
        v["mounts"] = json!([{"destination": "/x/../../etc", "type": "tmpfs", "source": "tmpfs"}]);
        refused(v, "..");

        let mut v = base();
        v["linux"]["seccomp"] = json!({"defaultAction": "SCMP_ACT_ALLOW", "listenerPath": "/run/x.sock"});
        refused(v, "listenerPath");

        let mut v = base();
        v["hostname"] = json!("box");
        v["linux"]["namespaces"] = json!([{"type": "mount"}]);
        v["linux"]["uidMappings"] = json!([]);
        v["linux"]["gidMappings"] = json!([]);
        refused(v, "uts namespace");
    }

    #[test]
    fn unknown_seccomp_action_is_a_parse_error() {
        let mut v = base();
        v["linux"]["seccomp"] = json!({"defaultAction": "SCMP_ACT_EXPLODE"});
        refused(v, "SCMP_ACT_EXPLODE");
    }

    #[test]
    fn resources_are_extracted() {
        let mut v = base();
        v["linux"]["cgroupsPath"] = json!("/sandboxsched/c1");
        v["linux"]["resources"] = json!({
            "memory": {"limit": 67108864, "swap": 67108864},
            "cpu": {"quota": 50000, "period": 100000, "shares": 512},
            "pids": {"limit": 64}
        });
        let c = check(v).unwrap();
        assert_eq!(c.cgroups_path, "/sandboxsched/c1");
        assert_eq!(
            c.resources,
            Resources {
                memory_limit: Some(67108864),
                memory_swap: Some(67108864),
                memory_reservation: None,
                cpu_shares: Some(512),
                cpu_quota: Some(50000),
                cpu_period: Some(100000),
                pids_limit: Some(64),
            }
        );
        let mut v = base();
        v["linux"]["resources"] = json!({"memory": {"limit": 100, "swap": 50}});
        refused(v, "memory+swap");
    }

    #[test]
    fn load_reports_missing_rootfs_and_config() {
        let tmp = tempfile::tempdir().unwrap();
        let err = load(tmp.path(), "c1").unwrap_err();
        assert!(err.to_string().contains("config.json"), "{err}");
        fs::write(tmp.path().join("config.json"), base().to_string()).unwrap();
        let err = load(tmp.path(), "c1").unwrap_err();
        assert!(err.to_string().starts_with("rootfs "), "{err}");
        assert!(err.to_string().contains("no such file or directory") || err.to_string().contains("No such file"));
        fs::create_dir(tmp.path().join("rootfs")).unwrap();
        let c = load(tmp.path(), "c1").unwrap();
        assert!(c.rootfs.is_absolute() && c.rootfs.ends_with("rootfs"));
    }
}
