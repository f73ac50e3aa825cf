//! How sandboxes actually run. Three runtimes behind one trait:
//! - [`container::ContainerRuntime`] (the default): each sandbox an OCI container with its
//!   own root filesystem and user, PID, mount, network, IPC and UTS namespaces, envd inside;
//! - [`process::ProcessRuntime`] (*unisolated*, only when asked for by name): a process group
//!   per sandbox on the host, as the host's root, in memory and freezer cgroups and PID and
//!   mount namespaces where the host allows; it reports itself degraded everywhere;
//! - [`sim::SimRuntime`]: sandboxes that are only numbers, so one process can host many nodes
//!   and thousands of sandboxes for scale tests and capacity planning.
//!
//! Every method may block (spawning, waiting for processes to go): call them from
//! `spawn_blocking`.
//!
//! The node tells a runtime of a sandbox through [`Sandbox`], the parts of its record that
//! decide how it runs; where the runtime keeps sandboxes on disk is [`layout`], and each
//! sandbox's [`disk`] (a filesystem of its own, so the kernel holds it to its size) is the
//! runtime's too. Nothing here knows of placement, fencing or the ledger: that is the node's.

pub mod cgroup;
pub mod container;
pub mod disk;
pub mod host_crash;
pub mod host_proc;
pub mod host_tables;
pub mod layout;
pub mod process;
pub mod sim;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use contracts::egress::NetworkPolicy;
use contracts::template::Image;

/// What a runtime is told of a sandbox: the node's record of it, seen only in the parts that
/// decide how it runs (borrowed: the runtime is asked of every sandbox every few seconds).
#[derive(Clone, Copy, Debug)]
pub struct Sandbox<'a> {
    pub id: &'a str,
    pub vcpus: u32,
    pub memory_bytes: u64,
    /// Its env vars, which envd gives every process it starts.
    pub env: &'a BTreeMap<String, String>,
    /// The long-running command it starts with, if any (run by `sh -c`).
    pub start_command: Option<&'a str>,
    /// Where its traffic may go; `None`: loopback only.
    pub network: Option<&'a NetworkPolicy>,
    /// What its root filesystem is made of; `None`: the built-in base.
    pub image: Option<&'a Image>,
    /// Process group of its start command (the container's init, for containers); 0 when
    /// none runs.
    pub pgid: u32,
}

/// Why a runtime operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("cannot start sandbox {sandbox}: {reason}")]
    Start { sandbox: String, reason: String },
    #[error("cannot {action} sandbox {sandbox}: {reason}")]
    Control {
        sandbox: String,
        action: &'static str,
        reason: String,
    },
}

/// What isolation is in effect, and what is missing and why.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Features {
    pub cgroup_memory: bool,
    pub freezer: bool,
    pub namespaces: bool,
    pub degraded: Vec<String>,
}

pub trait Runtime: Send + Sync + 'static {
    /// "container", "unisolated" or "sim".
    fn kind(&self) -> &'static str;
    fn features(&self) -> Features;
    /// Starts the sandbox's start command (if any) with `home` as its working directory;
    /// returns its process group (0 when nothing runs).
    fn start(&self, sandbox: &Sandbox<'_>, home: &Path) -> Result<u32, RuntimeError>;
    /// Stops every process of the sandbox where it stands.
    fn pause(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError>;
    /// Continues every process of the sandbox.
    fn resume(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError>;
    /// Kills every process of the sandbox and returns once none is left.
    fn kill(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError>;
    /// Memory the sandbox uses now, in bytes.
    fn memory_used(&self, sandbox: &Sandbox<'_>) -> u64;
    /// Whether the sandbox still has a live process (used to re-adopt after a restart).
    fn alive(&self, sandbox: &Sandbox<'_>) -> bool;
    /// Takes charge of a sandbox found in the state directory at start-up (recreating its
    /// cgroups where they are gone), without starting anything.
    fn adopt(&self, sandbox: &Sandbox<'_>) -> Result<(), RuntimeError>;
    /// Reaps processes that ended by themselves (no zombies).
    fn reap(&self) {}

    /// Removes whatever the runtime may still hold of sandbox `id`, which the node has no
    /// record of (a create cut short by a crash): its processes, its root's mount, its groups.
    /// `home` is where its writable folder would be.
    fn discard(&self, id: &str, home: &Path) {
        let _ = (id, home);
    }

    /// Removes what the runtime holds of sandboxes not in `keep` (found at start, with no
    /// folder at all); returns their IDs.
    fn discard_unknown(&self, keep: &std::collections::HashSet<String>) -> Vec<String> {
        let _ = keep;
        Vec::new()
    }
    /// CPU time (ns) the node's sandboxes have used so far, where the runtime measures it.
    fn cpu_time_ns(&self) -> Option<u64> {
        None
    }
    /// CPU time (ns) one sandbox has used so far, where the runtime measures it.
    fn cpu_time_ns_of(&self, _record: &Sandbox<'_>) -> Option<u64> {
        None
    }
    /// Makes `command` run inside the sandbox: its cgroups, and (where the runtime has a mount
    /// namespace) its `home` seen at `/home/user`; `cwd` is a host path inside `home`. Sets the
    /// working directory and `HOME`. The simulated runtime runs no processes and refuses.
    fn enclose(
        &self,
        sandbox: &Sandbox<'_>,
        home: &Path,
        cwd: &Path,
        command: &mut std::process::Command,
    ) -> Result<(), RuntimeError>;
    /// Where the sandbox's own envd listens, when it runs inside the sandbox (`home` is the
    /// sandbox's writable folder); `None` when the node hosts envd for it.
    fn envd_socket(&self, _home: &Path) -> Option<PathBuf> {
        None
    }
    /// The sandbox's log, a file of the node's outside the sandbox that its envd writes (its
    /// events and the start command's output), when the runtime keeps one (`home` is the
    /// sandbox's writable folder).
    fn log_file(&self, _home: &Path) -> Option<PathBuf> {
        None
    }
    /// Copies a template's `files/` into a new sandbox whose writable folder is `home`, where
    /// its user finds them (before [`Runtime::start`]).
    fn seed(&self, home: &Path, files: &Path) -> std::io::Result<()> {
        layout::copy_tree(files, home)
    }

    /// Whether a running sandbox's processes are all gone (checked every few seconds for
    /// every sandbox: runtimes make it cheap where they can).
    fn died(&self, sandbox: &Sandbox<'_>) -> bool {
        !self.alive(sandbox)
    }

    /// Whether every sandbox has envd running inside it (so always a process to start).
    fn runs_envd(&self) -> bool {
        false
    }

    /// Whether each sandbox should get a disk of its own (see `crate::disk`): the runtimes
    /// that isolate sandboxes; the others run their files in plain folders.
    fn own_disks(&self) -> bool {
        false
    }

    /// Readies a new, empty disk mounted in sandbox folder `dir` before any sandbox is given
    /// it (a spare, see `crate::disk`): the folders this runtime's start would otherwise make
    /// on the create's path, the first writes of a fresh filesystem.
    fn prepare_disk(&self, dir: &Path) -> std::io::Result<()> {
        let _ = dir;
        Ok(())
    }

    /// Why this runtime cannot run a template with its own root filesystem (an OCI image's),
    /// if it cannot.
    fn images_refused(&self) -> Option<String> {
        Some(format!("the {} runtime runs no images", self.kind()))
    }

    /// Replaces the network policy of a sandbox that runs (or is paused): its own rules, and a
    /// link out if it now needs one it did not have.
    fn update_network(&self, sandbox: &Sandbox<'_>, policy: &NetworkPolicy) -> Result<(), RuntimeError> {
        let _ = policy;
        Err(RuntimeError::Control {
            sandbox: sandbox.id.to_string(),
            action: "change the network of",
            reason: format!("the {} runtime has no network of its own per sandbox", self.kind()),
        })
    }

    /// Opens a TCP connection to `port` of the sandbox, as a process inside it would reach
    /// its own `127.0.0.1:port`: the way in for the gateway's port routing. Refused where
    /// nothing listens.
    fn connect_port(&self, sandbox: &Sandbox<'_>, port: u16) -> std::io::Result<std::net::TcpStream> {
        let _ = (sandbox, port);
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            format!("the {} runtime runs no processes to connect to", self.kind()),
        ))
    }
}

/// How long opening a connection to a sandbox's port may take.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Connects to `127.0.0.1:port` in the network namespace of process `pid`. The socket is made
/// on a thread that entered that namespace (a socket belongs to the namespace it was made in
/// for its whole life), so the node's own threads never leave the host's.
pub fn connect_in_namespace_of(pid: u32, port: u16) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::AsFd as _;
    let netns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // This thread only, which ends right after.
                rustix::thread::move_into_link_name_space(
                    netns.as_fd(),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )?;
                let addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port));
                std::net::TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the connecting thread panicked")))
    })
}
