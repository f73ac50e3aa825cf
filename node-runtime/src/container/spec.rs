//! The OCI runtime spec (`config.json`) of one sandbox. Pure: a function of the sandbox's
//! settings and where things are, so what a sandbox may do is read and tested in one place.
//!
//! What it asks the runtime for, and why:
//! - namespaces: user (root inside is the unprivileged host uid [`Inputs::host_ids`] starts,
//!   a range of the sandbox's own (see `ids`); files a sandbox writes are never host-root
//!   files), pid, mount, network (only loopback: no route to the host or anywhere else), ipc,
//!   uts (hostname = sandbox ID), cgroup;
//! - the root filesystem the node mounted (an overlay of the template's read-only layers and
//!   the sandbox's own writable layer), plus the host's `/usr` read-only (the built-in `base`
//!   template's userland) and envd's binary read-only at [`ENVD_PATH`];
//! - envd as PID 1, root in the sandbox, listening on the socket the node hands in as fd 3;
//! - a container default capability set, `no_new_privs`, a seccomp filter refusing the system
//!   calls a sandbox has no business making (kernel keyrings, BPF, perf, module loading,
//!   namespace creation, mounting), masked and read-only paths as runc masks them;
//! - cgroup limits: memory = the sandbox's memory, CPU = its vCPUs as a quota, a pids limit.

use std::path::Path;

use oci_spec::runtime::Spec;
use serde_json::{json, Value};

use crate::Sandbox;

/// Host uid and gid of root inside in the storage range: the ids files of layers and of
/// sandboxes' writable layers have on disk (and the ids sandboxes run as on a host that cannot
/// give each its own range; see `ids`).
pub const HOST_ID_BASE: u32 = 100_000;
/// How many ids each sandbox maps (0-65535 inside).
pub const ID_RANGE: u32 = 65_536;
/// uid and gid of E2B's default user inside a sandbox.
pub const SANDBOX_USER_ID: u32 = 1000;
/// Where envd's binary appears inside a sandbox.
pub const ENVD_PATH: &str = "/.sandboxsched/envd";
/// envd's `oom_score_adj`, set by the runtime: below the 900 envd gives every command it
/// starts, so under memory pressure the user's processes go first and the sandbox keeps the
/// envd it is reached through; above the node's own (0), so under the host's pressure a
/// sandbox goes before the node. Positive because lowering below 0 needs CAP_SYS_RESOURCE,
/// which many hosts (containers among them) do not grant even to root.
pub const ENVD_OOM_SCORE_ADJ: i64 = 300;
/// Processes a sandbox may have at once, at most.
pub const PIDS_LIMIT: i64 = 8192;
/// Processes a sandbox may have at once, at least (a shell, envd and a few tools).
pub const PIDS_FLOOR: i64 = 64;

/// The processes a sandbox of `memory_bytes` may have on a node whose sandboxes may have
/// `node_pids` together and which holds `node_memory_bytes`: its share of the node's memory,
/// of the node's processes, within [`PIDS_FLOOR`] and [`PIDS_LIMIT`]. Placement never puts
/// more memory on a node than it has, so the shares add up to the node's limit at most (but
/// for sandboxes so small that the floor lifts them): one tenant's fork bomb leaves its
/// neighbours the processes they were promised, not just the host its own.
pub fn pids_limit(node_pids: u64, node_memory_bytes: u64, memory_bytes: u64) -> i64 {
    if node_memory_bytes == 0 {
        return PIDS_FLOOR;
    }
    let share = u128::from(node_pids) * u128::from(memory_bytes) / u128::from(node_memory_bytes);
    i64::try_from(share).unwrap_or(PIDS_LIMIT).clamp(PIDS_FLOOR, PIDS_LIMIT)
}
/// CFS period for the CPU quota.
const CPU_PERIOD_US: u64 = 100_000;

/// What the spec points at outside the sandbox.
pub struct Inputs<'a> {
    /// The mounted root filesystem.
    pub rootfs: &'a Path,
    /// The program that is envd (the node's own binary, run as `BINARY envd ...`).
    pub envd_binary: &'a Path,
    /// The cgroup the runtime creates for the sandbox (`/sandboxsched-NODE/ID`).
    pub cgroups_path: String,
    /// Host top-level directories to bind read-only besides `/usr` (a host without merged
    /// `/usr`, where `/bin` or `/lib` are real directories).
    pub host_dirs: &'a [std::path::PathBuf],
    /// Whether the host's `/usr` is bound in (templates built on `base`); an image's own root
    /// brings its own.
    pub host_userland: bool,
    /// The host uid and gid root inside runs as: the first of the sandbox's [`ID_RANGE`] ids.
    pub host_ids: u32,
    /// Processes it may have at once ([`pids_limit`]).
    pub pids_limit: i64,
    /// A network slot's user and network namespaces to join (`super::slots`), instead of new
    /// ones; the user namespace is mapped as `host_ids` says.
    pub joins: Option<(&'a Path, &'a Path)>,
    /// Whether the spec sets the sandbox's rlimits ([`RLIMITS`]); otherwise it keeps the
    /// node's.
    pub rlimits: bool,
}

/// The rlimits a sandbox starts with, whatever the node was started with: no real-time
/// scheduling (a FIFO task is outside the CFS quota that holds the sandbox to its vCPUs, on
/// a kernel without real-time group scheduling) and no nice value below the one it starts at.
pub const RLIMITS: [(&str, u64); 2] = [("RLIMIT_RTPRIO", 0), ("RLIMIT_NICE", 0)];

const CAPABILITIES: [&str; 14] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// System calls refused with EPERM. Most need capabilities a sandbox does not have anyway;
/// the filter is the second wall, and it also closes what a user namespace would otherwise
/// open to unprivileged code (new namespaces of its own, mounts inside them).
const REFUSED: &[&str] = &[
    "add_key",
    "request_key",
    "keyctl",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "name_to_handle_at",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "acct",
    "quotactl",
    "lookup_dcookie",
    "iopl",
    "ioperm",
    "mount",
    "umount2",
    "pivot_root",
    "setns",
    "unshare",
    "fsopen",
    "fsmount",
    "move_mount",
    // io_uring runs system calls from kernel workers, outside the filter that screens the
    // process's own calls, and has been a steady source of kernel bugs (Docker's default
    // profile refuses it too).
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
];

/// The spec for `sandbox`.
pub fn spec(sandbox: &Sandbox<'_>, inputs: &Inputs) -> Result<Spec, String> {
    let mut env = vec![
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        format!("{}={}", contracts::envd::SANDBOX_ID_VAR, sandbox.id),
        format!(
            "{}={}",
            contracts::envd::VARS_VAR,
            serde_json::to_string(&sandbox.env).map_err(|e| e.to_string())?
        ),
    ];
    if let Some(command) = sandbox.start_command.filter(|c| !c.trim().is_empty()) {
        env.push(format!("{}={command}", contracts::envd::START_COMMAND_VAR));
    }
    if let Some(image) = &sandbox.image {
        if !image.user.is_empty() {
            env.push(format!("{}={}", contracts::envd::DEFAULT_USER_VAR, image.user));
        }
        if !image.workdir.is_empty() {
            env.push(format!("{}={}", contracts::envd::DEFAULT_WORKDIR_VAR, image.workdir));
        }
    }
    let caps: Vec<&str> = CAPABILITIES.to_vec();
    let vcpus = u64::from(sandbox.vcpus.max(1));
    let memory = i64::try_from(sandbox.memory_bytes).unwrap_or(i64::MAX);
    let no_sandbox_user_namespaces = json!({
        "names": ["clone"],
        "action": "SCMP_ACT_ERRNO",
        "errnoRet": libc::EPERM,
        "args": [{
            "index": 0,
            "value": libc::CLONE_NEWUSER as u64,
            "valueTwo": libc::CLONE_NEWUSER as u64,
            "op": "SCMP_CMP_MASKED_EQ"
        }]
    });
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        // Its own instance, with a cap of its own on the host's shared table of terminals.
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5", format!("max={}", crate::host_tables::PTYS_PER_SANDBOX)]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}),
    ];
    if inputs.host_userland {
        mounts.push(json!({"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro", "nosuid", "nodev"]}));
    }
    for dir in inputs.host_dirs {
        mounts.push(
            json!({"destination": dir, "type": "bind", "source": dir, "options": ["rbind", "ro", "nosuid", "nodev"]}),
        );
    }
    mounts.push(json!({"destination": ENVD_PATH, "type": "bind", "source": inputs.envd_binary, "options": ["bind", "ro", "nosuid", "nodev"]}));
    let (user, network) = match inputs.joins {
        Some((user, net)) => (
            json!({"type": "user", "path": user}),
            json!({"type": "network", "path": net}),
        ),
        None => (json!({"type": "user"}), json!({"type": "network"})),
    };
    let namespaces = json!([
        user, {"type": "pid"}, network, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "cgroup"}
    ]);
    let value: Value = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": [ENVD_PATH, "envd", "--listen-fd", "3", "--boot-fd", "4"],
            "env": env,
            "cwd": "/",
            "capabilities": {
                "bounding": caps,
                "effective": caps,
                "permitted": caps,
            },
            "noNewPrivileges": true,
            "rlimits": if inputs.rlimits {
                RLIMITS.iter().map(|(typ, limit)| json!({"type": typ, "hard": limit, "soft": limit})).collect()
            } else {
                Vec::new()
            },
            "oomScoreAdj": ENVD_OOM_SCORE_ADJ
        },
        "root": {"path": inputs.rootfs, "readonly": false},
        "hostname": sandbox.id,
        "mounts": mounts,
        "linux": {
            "namespaces": namespaces,
            "uidMappings": [{"containerID": 0, "hostID": inputs.host_ids, "size": ID_RANGE}],
            "gidMappings": [{"containerID": 0, "hostID": inputs.host_ids, "size": ID_RANGE}],
            "cgroupsPath": inputs.cgroups_path,
            "resources": {
                "memory": {"limit": memory, "swap": memory},
                "cpu": {"quota": (vcpus * CPU_PERIOD_US) as i64, "period": CPU_PERIOD_US},
                "pids": {"limit": inputs.pids_limit}
            },
            "seccomp": {
                "defaultAction": "SCMP_ACT_ALLOW",
                "architectures": ["SCMP_ARCH_X86_64"],
                "syscalls": [
                    {"names": REFUSED, "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM},
                    // clone3 cannot be filtered by its flags (they are behind a pointer): say it
                    // does not exist, and the C library falls back to clone, which can be.
                    {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": libc::ENOSYS},
                    no_sandbox_user_namespaces
                ]
            },
            "maskedPaths": [
                "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
                "/sys/firmware", "/sys/devices/virtual/powercap"
            ],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
        }
    });
    serde_json::from_value(value).map_err(|e| format!("building the OCI spec: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn sandbox<'a>(env: &'a BTreeMap<String, String>, image: Option<&'a contracts::template::Image>) -> Sandbox<'a> {
        Sandbox {
            id: "sbx1",
            vcpus: 2,
            memory_bytes: 512 << 20,
            env,
            start_command: Some("sleep 9"),
            network: None,
            image,
            pgid: 0,
        }
    }

    fn env() -> BTreeMap<String, String> {
        [("A".to_string(), "1".to_string())].into()
    }

    /// A sandbox's inputs on the host's userland, in the first id range.
    fn inputs() -> Inputs<'static> {
        Inputs {
            rootfs: Path::new("/state/sbx1/rootfs"),
            envd_binary: Path::new("/bin/node-svc"),
            cgroups_path: "/sandboxsched-n1/sbx1".into(),
            host_dirs: &[],
            host_userland: true,
            host_ids: 1 << 24,
            pids_limit: 300,
            joins: None,
            rlimits: true,
        }
    }

    #[test]
    fn a_sandbox_with_a_network_slot_joins_its_user_and_network_namespaces_and_makes_the_rest() {
        let inputs = Inputs {
            joins: Some((Path::new("/run/s/slots/a.user"), Path::new("/run/s/slots/a.net"))),
            ..inputs()
        };
        let json = serde_json::to_value(spec(&sandbox(&env(), None), &inputs).unwrap()).unwrap();
        let namespaces = json["linux"]["namespaces"].as_array().unwrap();
        let path_of = |kind: &str| {
            namespaces
                .iter()
                .find(|n| n["type"] == kind)
                .map(|n| n["path"].as_str().unwrap_or_default().to_string())
        };
        assert_eq!(path_of("user").as_deref(), Some("/run/s/slots/a.user"));
        assert_eq!(path_of("network").as_deref(), Some("/run/s/slots/a.net"));
        for kind in ["pid", "ipc", "uts", "mount", "cgroup"] {
            assert_eq!(path_of(kind).as_deref(), Some(""), "{kind} is new");
        }
        assert_eq!(json["linux"]["uidMappings"][0]["hostID"], 1 << 24, "the slot's map");
    }

    #[test]
    fn a_sandbox_is_namespaced_mapped_limited_and_filtered() {
        let inputs = inputs();
        let spec = spec(&sandbox(&env(), None), &inputs).unwrap();
        let json = serde_json::to_value(&spec).unwrap();
        let kinds: Vec<&str> = json["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["type"].as_str().unwrap())
            .collect();
        for kind in ["user", "pid", "network", "ipc", "uts", "mount"] {
            assert!(kinds.contains(&kind), "{kind} missing: {kinds:?}");
        }
        assert_eq!(json["linux"]["uidMappings"][0]["hostID"], 1 << 24);
        assert_eq!(json["linux"]["gidMappings"][0]["hostID"], 1 << 24);
        assert_eq!(json["hostname"], "sbx1");
        assert_eq!(json["process"]["noNewPrivileges"], true);
        assert_eq!(
            json["process"]["rlimits"],
            json!([
                {"type": "RLIMIT_RTPRIO", "hard": 0, "soft": 0},
                {"type": "RLIMIT_NICE", "hard": 0, "soft": 0},
            ])
        );
        let devpts = json["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["type"] == "devpts")
            .unwrap();
        assert!(
            devpts["options"]
                .as_array()
                .unwrap()
                .contains(&json!(format!("max={}", crate::host_tables::PTYS_PER_SANDBOX))),
            "{devpts}"
        );
        assert_eq!(json["linux"]["resources"]["memory"]["limit"], 512 << 20);
        assert_eq!(json["linux"]["resources"]["cpu"]["quota"], 200_000);
        assert_eq!(json["linux"]["resources"]["pids"]["limit"], 300);
        let bounding = json["process"]["capabilities"]["bounding"].as_array().unwrap();
        assert!(!bounding.iter().any(|c| c == "CAP_SYS_ADMIN" || c == "CAP_NET_ADMIN"));
        let env: Vec<&str> = json["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(env.contains(&"ENVD_VARS={\"A\":\"1\"}"), "{env:?}");
        assert!(env.contains(&"ENVD_START_COMMAND=sleep 9"), "{env:?}");
        // envd's binary and /usr are read-only; nothing else of the host is mounted.
        let binds: Vec<&str> = json["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["type"] == "bind")
            .map(|m| m["source"].as_str().unwrap())
            .collect();
        assert_eq!(binds, vec!["/usr", "/bin/node-svc"]);
    }

    #[test]
    fn a_sandbox_gets_its_memory_share_of_the_nodes_processes() {
        const GIB: u64 = 1 << 30;
        // Half the memory, half the processes; shares add up to the node's limit.
        assert_eq!(pids_limit(24_576, 16 * GIB, 8 * GIB), 12_288.min(PIDS_LIMIT));
        assert_eq!(pids_limit(4096, 16 * GIB, 4 * GIB), 1024);
        assert_eq!((0..4).map(|_| pids_limit(4096, 16 * GIB, 4 * GIB)).sum::<i64>(), 4096);
        // Within the floor and the ceiling, whatever the numbers.
        assert_eq!(pids_limit(4096, 16 * GIB, 1 << 20), PIDS_FLOOR);
        assert_eq!(pids_limit(u64::MAX, 1, u64::MAX), PIDS_LIMIT);
        assert_eq!(pids_limit(4096, 0, GIB), PIDS_FLOOR);
    }

    #[test]
    fn an_image_brings_its_own_userland_and_defaults() {
        let inputs = Inputs {
            rootfs: Path::new("/state/sbx1/rootfs"),
            envd_binary: Path::new("/bin/envd"),
            cgroups_path: "/sandboxsched-n1/sbx1".into(),
            host_dirs: &[],
            host_userland: false,
            host_ids: HOST_ID_BASE,
            pids_limit: PIDS_LIMIT,
            joins: None,
            rlimits: false,
        };
        let image = contracts::template::Image {
            user: "root".into(),
            workdir: "/app".into(),
            ..Default::default()
        };
        let env = env();
        let json = serde_json::to_value(spec(&sandbox(&env, Some(&image)), &inputs).unwrap()).unwrap();
        let binds: Vec<&str> = json["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["type"] == "bind")
            .map(|m| m["source"].as_str().unwrap())
            .collect();
        assert_eq!(binds, vec!["/bin/envd"], "nothing of the host's userland");
        let env = json["process"]["env"].to_string();
        assert!(
            env.contains("ENVD_DEFAULT_USER=root") && env.contains("ENVD_DEFAULT_WORKDIR=/app"),
            "{env}"
        );
        // A runtime that cannot set them (runc without CAP_SYS_RESOURCE): the node's.
        assert_eq!(json["process"]["rlimits"], json!([]));
    }
}
