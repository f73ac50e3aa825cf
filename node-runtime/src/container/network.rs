//! A sandbox's way out, and the walls around it.
//!
//! Every sandbox has its own network namespace. A sandbox that may reach anything beyond
//! itself ([`NetworkPolicy::needs_link`]) gets one veth pair: `eth0` inside, with the second
//! address of a /30 taken from the node's pool, and `sbx<hex of the host address>` on the host
//! with the first, which is the sandbox's default gateway. The host masquerades what leaves.
//! Such a sandbox joins a namespace made before it with its link already up, a network slot
//! ([`super::slots`]), so no link is made on its create or deleted on its kill; one that gains
//! a link later ([`Network::update`]) gets a pair made into its own namespace
//! ([`Network::attach`]). A sandbox with no internet and nothing allowed gets no link at all:
//! loopback only, nothing to get wrong.
//!
//! **Why veth and NAT** rather than a userspace stack (slirp4netns, pasta): the kernel does
//! the work with no process per sandbox (an idle sandbox must cost under 5 MiB; a pasta
//! process alone is more), and the host's packet filter can hold every sandbox to one floor.
//! A userspace stack opens its sockets *on the host*, so a sandbox reaching the host's own
//! addresses would need a filter in that process too.
//!
//! **The floor** is one nftables table, `inet sandboxsched`, shared by every node of the host
//! and replaced (one atomic transaction, all but the count of flows) when a node starts
//! ([`host_ruleset`]):
//! - nothing from a sandbox reaches the host itself, by any of its addresses, IPv4 or IPv6
//!   (`input`): Redis, PostgreSQL, the ledger, every node's gRPC and envd ports, the gateway.
//!   The one exception is what the node's DNS forwarder was redirected to answer: a
//!   sandbox's queries to [`super::resolver::RESOLVER`] port 53;
//! - no sandbox reaches another (`forward`, sandbox link to sandbox link), nothing outside
//!   opens a connection to a sandbox, nor does the host itself (`output`: so an answer the
//!   host sends late, after the flow it answers was forgotten with its sandbox, reaches no
//!   next sandbox on that address), and no sandbox sends IPv6 beyond its link;
//! - the operator's `--egress-deny` blocks (by default private, link-local, shared and
//!   multicast ranges: the control plane's network and cloud metadata) are refused to all;
//! - a packet whose source address is not the one its link was given is dropped (a sandbox
//!   root with raw sockets cannot pose as another sandbox);
//! - a sandbox holds at most [`FLOWS_PER_SANDBOX`] entries of the host's connection-tracking
//!   table at once (`ct count`, keyed by its link): the table has one maximum for the whole
//!   host (`nf_conntrack_max`, 262,144 here), its entries are charged to no sandbox's memory,
//!   and once it is full the host drops every new flow, every other sandbox's and the host's
//!   own included. A new flow past the cap is refused (ICMP admin-prohibited, within the
//!   kernel's ICMP rate limits, rather than after a connect's timeout); what it already holds
//!   goes on. The count survives a node's start, which replaces the rest of the floor.
//!
//! **A sandbox's own lists** (`denyOut`, `allowOut`, no internet) are rules inside its own
//! network namespace ([`sandbox_ruleset`]): they live and die with it, and nothing inside can
//! change them, because the container's capability set has no `CAP_NET_ADMIN`. They protect
//! the sandbox's owner from their own code; the floor, on the host, protects everyone else.
//!
//! **Addresses.** The interface name is derived from the address, and the kernel refuses a
//! second interface of one name, so creating the host end *is* the allocation: atomic across
//! every node on the host. When a namespace goes, its `eth0` goes and takes the host end with
//! it.

use std::collections::HashMap;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use contracts::egress::{Cidr, NetworkPolicy};

use super::resolver::{self, Resolver};

pub use super::HOST_PREFIX;
/// The nftables table of the floor.
pub const TABLE: &str = "sandboxsched";
/// Flows (entries of the host's connection-tracking table) one sandbox may hold at once:
/// more than a browser or a crawler keeps open, and 64 sandboxes' worth fill the kernel's
/// usual table of 262,144.
pub const FLOWS_PER_SANDBOX: u32 = 4096;
/// The pool sandboxes' /30s come from, unless `--sandbox-network` says otherwise.
pub const DEFAULT_POOL: &str = "10.200.0.0/16";

/// The port a node with the default sandbox network listens on for its sandboxes' names
/// ([`super::resolver::port_of`] its pool): test and benchmark harnesses that hand out ports
/// to the services they start on one host must not hand this one out, or a node's forwarder
/// takes it first.
pub fn default_dns_port() -> u16 {
    super::resolver::port_of(&DEFAULT_POOL.parse().unwrap_or(Cidr::ANY))
}

/// What no sandbox reaches, unless `--egress-deny` says otherwise: this host's and the
/// control plane's private networks, link-local (cloud metadata at 169.254.169.254), shared
/// address space, loopback, multicast and the reserved ranges.
pub const DEFAULT_FLOOR: [&str; 9] = [
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// How the node's sandboxes reach out.
#[derive(Clone, Debug)]
pub struct NetworkConfig {
    /// Where each sandbox's /30 comes from.
    pub pool: Cidr,
    /// Destinations no sandbox reaches, whatever its `allowOut`.
    pub floor: Vec<Cidr>,
    /// The resolvers sandboxes' names are asked of ([`super::resolver`]); empty: the host's
    /// own, from its `/etc/resolv.conf`.
    pub resolvers: Vec<std::net::SocketAddr>,
    /// Networks made ahead of sandboxes ([`super::slots`]).
    pub slots: SlotSettings,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            pool: DEFAULT_POOL.parse().unwrap_or(Cidr::ANY),
            floor: DEFAULT_FLOOR.iter().filter_map(|c| c.parse().ok()).collect(),
            resolvers: Vec::new(),
            slots: Default::default(),
        }
    }
}

/// How many network slots ([`super::slots`]) to keep ready, and how long a returned one
/// cools.
#[derive(Clone, Debug)]
pub struct SlotSettings {
    /// Slots kept ready beyond those in use (for the ranges the next sandboxes get).
    pub ready: usize,
    /// How long a killed sandbox's slot waits before it is cleaned and reused.
    pub cooldown: Duration,
}

impl Default for SlotSettings {
    fn default() -> Self {
        SlotSettings {
            ready: 16,
            cooldown: Duration::from_secs(2),
        }
    }
}

/// Why a sandbox's network could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("sandboxes cannot reach out on this host: {0}")]
    Unavailable(String),
    #[error("no free address in the sandbox network {0}")]
    PoolExhausted(Cidr),
    #[error("netlink: {0}")]
    Netlink(String),
    #[error("the sandbox's network namespace: {0}")]
    Namespace(std::io::Error),
    #[error("nft: {0}")]
    Rules(String),
}

/// One sandbox's link: the host end and both addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub host_interface: String,
    pub gateway: Ipv4Addr,
    pub address: Ipv4Addr,
}

/// The `index`th /30 of `pool`: host end's name, gateway (host side) and sandbox address.
pub fn slot(pool: &Cidr, index: u64) -> Option<Link> {
    let gateway = pool.nth(index.checked_mul(4)?.checked_add(1)?)?;
    let address = pool.nth(index * 4 + 2)?;
    Some(Link {
        host_interface: format!("{HOST_PREFIX}{:08x}", u32::from(gateway)),
        gateway,
        address,
    })
}

/// How many /30s the pool holds.
pub fn slots(pool: &Cidr) -> u64 {
    pool.size() / 4
}

/// Where a sandbox starts looking for a free slot: spread by its ID, so nodes sharing a host
/// rarely try the same one.
pub(super) fn first_slot(sandbox: &str, count: u64) -> u64 {
    if count == 0 {
        0
    } else {
        super::fnv1a(sandbox.as_bytes()) % count
    }
}

fn elements(cidrs: &[Cidr]) -> String {
    cidrs.iter().map(Cidr::to_string).collect::<Vec<_>>().join(", ")
}

/// The floor, as one nft transaction that replaces every chain and the floor's set (each is
/// added first, so that its `delete` is valid when it does not exist yet), but not the count
/// of flows.
pub fn host_ruleset(floor: &[Cidr]) -> String {
    let p = HOST_PREFIX;
    let resolver = super::resolver::RESOLVER;
    // Both ways a sandbox's new flow enters the host's table: through it, and to the node's
    // DNS forwarder. Keyed by the link the flow came in on, the one thing of a packet no
    // sandbox chooses (a raw socket may pose as another address of its /30). Counted at a
    // flow's first packet only (not yet confirmed): an unanswered flow stays `new` for every
    // packet, and each count walks the sandbox's list of flows.
    let cap = format!(
        "iifname \"{p}*\" ct state new ct status & confirmed == 0 add @flows {{ iifname ct count over {FLOWS_PER_SANDBOX} }} reject with icmpx type admin-prohibited"
    );
    let floor_set = if floor.is_empty() {
        String::new()
    } else {
        format!("    elements = {{ {} }}\n", elements(floor))
    };
    // Everything is replaced but the count of flows, which a node's start must not reset for
    // the sandboxes of the host's other nodes (or its own, adopted): each chain and the floor
    // are made if missing and deleted, then made anew, all in one transaction.
    let mut replace = format!(
        "add table inet {TABLE}
add set inet {TABLE} flows {{ type ifname; size 65535; flags dynamic; }}
"
    );
    for chain in ["prerouting", "input", "forward", "output", "postrouting"] {
        replace += &format!("add chain inet {TABLE} {chain}\ndelete chain inet {TABLE} {chain}\n");
    }
    replace +=
        &format!("add set inet {TABLE} floor {{ type ipv4_addr; flags interval; }}\ndelete set inet {TABLE} floor\n");
    format!(
        "{replace}table inet {TABLE} {{
  set floor {{
    type ipv4_addr
    flags interval
{floor_set}  }}
  chain prerouting {{
    type filter hook prerouting priority -150; policy accept;
    iifname \"{p}*\" fib saddr . iif oif missing drop
  }}
  chain input {{
    type filter hook input priority -10; policy accept;
    {cap}
    iifname \"{p}*\" ct status dnat ct original ip daddr {resolver} meta l4proto {{ tcp, udp }} ct original proto-dst 53 accept
    iifname \"{p}*\" reject with icmpx type admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname \"{p}*\" oifname \"{p}*\" reject with icmpx type admin-prohibited
    {cap}
    oifname \"{p}*\" ct state established,related accept
    oifname \"{p}*\" drop
    iifname \"{p}*\" meta nfproto ipv6 drop
    iifname \"{p}*\" ip daddr @floor reject with icmpx type admin-prohibited
  }}
  chain output {{
    type filter hook output priority -10; policy accept;
    oifname \"{p}*\" ct state new drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    iifname \"{p}*\" masquerade
  }}
}}
"
    )
}

/// The sandbox's own lists as rules inside its namespace, or `None` when it has none. The
/// loopback is always open (a sandbox without internet still talks to itself), and so is
/// name resolution for a sandbox that may reach anything at all (an `allowOut` list of
/// addresses is little use when no name resolves); allowed blocks are accepted before denied
/// ones are refused.
pub fn sandbox_ruleset(policy: &NetworkPolicy) -> Option<String> {
    let denied = policy.denied();
    if denied.is_empty() {
        return None;
    }
    let mut allow = String::new();
    if policy.needs_link() {
        allow = format!(
            "    ip daddr {} meta l4proto {{ tcp, udp }} th dport 53 accept\n",
            super::resolver::RESOLVER
        );
    }
    if !policy.allow_out.is_empty() {
        allow += &format!("    ip daddr {{ {} }} accept\n", elements(&policy.allow_out));
    }
    Some(format!(
        "table inet egress {{
  chain output {{
    type filter hook output priority 0; policy accept;
    oifname \"lo\" accept
{allow}    ip daddr {{ {} }} reject with icmpx type admin-prohibited
    meta nfproto ipv6 reject with icmpx type admin-prohibited
  }}
}}
",
        elements(&denied)
    ))
}

/// `rules` (a sandbox's own table, or nothing) as one transaction that first removes the
/// table they replace: no moment without rules, no rule twice.
fn replacing(rules: &str) -> String {
    format!("add table inet egress\ndelete table inet egress\n{rules}")
}

/// The nft binary: on `PATH`, or where Debian puts it (a node started without `/usr/sbin` on
/// its path).
fn nft_binary() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("nft"));
    on_path
        .chain([PathBuf::from("/usr/sbin/nft"), PathBuf::from("/sbin/nft")])
        .find(|p| p.is_file())
}

/// Runs `nft -f -` with `rules`, inside the network namespace open at `netns` when given.
fn run_nft(binary: &Path, rules: &str, netns: Option<&std::fs::File>) -> Result<(), NetworkError> {
    let mut cmd = Command::new(binary);
    cmd.args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(ns) = netns {
        let fd = ns.as_raw_fd();
        // SAFETY: setns is one async-signal-safe system call on a descriptor number prepared
        // before the fork, which `ns` keeps open until the command has started.
        unsafe {
            cmd.pre_exec(move || {
                let ns = std::os::fd::BorrowedFd::borrow_raw(fd);
                rustix::thread::move_into_link_name_space(ns, Some(rustix::thread::LinkNameSpaceType::Network))?;
                Ok(())
            });
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| NetworkError::Rules(format!("running {}: {e}", binary.display())))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(rules.as_bytes())
            .map_err(|e| NetworkError::Rules(format!("writing rules: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| NetworkError::Rules(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetworkError::Rules(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

/// The node's side of sandbox networking: the floor installed, forwarding on, the DNS
/// forwarder answering.
pub struct Network {
    config: NetworkConfig,
    nft: Option<PathBuf>,
    /// Why no sandbox can have a link on this host, if none can.
    problem: Option<String>,
    dns: Arc<Mutex<Dns>>,
    /// The host end each linked sandbox holds, by sandbox: its link is taken down with it
    /// ([`Network::detach`]) instead of whenever the kernel gets round to freeing its network
    /// namespace, so a sandbox's address is free again once its kill returns.
    links: Mutex<HashMap<String, HostEnd>>,
}

/// A sandbox's host end: its name and its interface index, which the kernel does not give
/// again to another interface soon (indexes are handed out in turn), so deleting by index
/// never takes a link that has since been made, under the same name, for someone else.
#[derive(Clone, Debug)]
struct HostEnd {
    name: String,
    index: u32,
}

/// How long a node whose DNS forwarder could not start waits before it tries again.
pub const DNS_RETRY: Duration = Duration::from_secs(2);

/// The node's DNS forwarder, or why it is not running. One that could not start (another
/// program holds its port, nft failed) is tried again every [`DNS_RETRY`] until it starts, by a
/// thread that ends then or when the node's [`Network`] is dropped.
#[derive(Default)]
struct Dns {
    /// Kept for as long as the node runs: dropping it stops it.
    resolver: Option<Resolver>,
    /// Why linked sandboxes cannot resolve names, if they cannot.
    problem: Option<String>,
}

impl Dns {
    fn lock(dns: &Mutex<Dns>) -> std::sync::MutexGuard<'_, Dns> {
        dns.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts the forwarder into `dns`; whether it runs.
    fn start(dns: &Mutex<Dns>, config: &NetworkConfig, nft: &Path) -> bool {
        match start_resolver(config, nft) {
            Ok(resolver) => {
                let asks = resolver
                    .upstreams()
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ");
                tracing::info!(port = resolver.port(), %asks, "sandboxes' names resolved through the node");
                let mut dns = Self::lock(dns);
                dns.resolver = Some(resolver);
                dns.problem = None;
                true
            }
            Err(problem) => {
                let mut dns = Self::lock(dns);
                if dns.problem.as_deref() != Some(&problem) {
                    tracing::warn!(%problem, retry_in = ?DNS_RETRY, "sandboxes cannot resolve names");
                }
                dns.problem = Some(problem);
                false
            }
        }
    }

    fn retry(dns: Weak<Mutex<Dns>>, config: NetworkConfig, nft: PathBuf) {
        let retrying = std::thread::Builder::new()
            .name("sandbox-dns-retry".into())
            .spawn(move || loop {
                std::thread::sleep(DNS_RETRY);
                let Some(dns) = dns.upgrade() else { return };
                if Self::start(&dns, &config, &nft) {
                    return;
                }
            });
        if let Err(err) = retrying {
            tracing::error!(%err, "the DNS forwarder will not be tried again");
        }
    }
}

/// Installs the floor ([`host_ruleset`]), keeping every sandbox's count of flows. A table
/// whose count was made otherwise (a node of another version on this host) refuses that
/// transaction whole; then the table is replaced whole, counts and all, and the log says so.
fn install_floor(nft: &Path, floor: &[Cidr]) -> Result<(), String> {
    let rules = host_ruleset(floor);
    let Err(kept) = run_nft(nft, &rules, None) else {
        return Ok(());
    };
    run_nft(
        nft,
        &format!("add table inet {TABLE}\ndelete table inet {TABLE}\n{rules}"),
        None,
    )
    .map_err(|e| format!("installing the host's rules: {e}"))?;
    tracing::warn!(error = %kept, "the floor was replaced whole: every sandbox's count of flows starts again");
    Ok(())
}

impl Network {
    /// Installs the floor and turns on IPv4 forwarding (a host-wide setting: the host routes
    /// its sandboxes' traffic). On failure sandboxes that need a link are refused, saying why;
    /// sandboxes without one still run.
    pub fn new(config: NetworkConfig) -> Self {
        let nft = nft_binary();
        let problem = match &nft {
            None => Some("nft (nftables) is not installed".to_string()),
            Some(binary) => install_floor(binary, &config.floor).and_then(|()| ip_forward()).err(),
        };
        if let Some(problem) = &problem {
            tracing::warn!(%problem, "sandboxes get loopback only");
        } else {
            tracing::info!(pool = %config.pool, floor = %elements(&config.floor), "sandbox egress through the host");
        }
        let dns = Arc::new(Mutex::new(Dns::default()));
        if let (None, Some(binary)) = (&problem, &nft) {
            if !Dns::start(&dns, &config, binary) {
                Dns::retry(Arc::downgrade(&dns), config.clone(), binary.clone());
            }
        }
        Network {
            config,
            nft,
            problem,
            dns,
            links: Mutex::new(HashMap::new()),
        }
    }

    fn links(&self) -> std::sync::MutexGuard<'_, HashMap<String, HostEnd>> {
        self.links.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes down the link of `sandbox`, if it has one this node made: both ends go at once,
    /// and its addresses may be given to the next sandbox. Called once the sandbox is dead
    /// (its kill succeeded). The host end goes by its index, not its name: the slot's name
    /// may belong to a newer sandbox by then (the kernel removes a dead namespace's links on
    /// its own, later), but indexes are handed out in turn, so the index is still this
    /// sandbox's or no one's. A sandbox adopted after a node restart has its entry from
    /// [`Network::adopt`].
    pub fn detach(&self, sandbox: &str) {
        let Some(end) = self.links().remove(sandbox) else {
            return;
        };
        let deleted = on_netlink_thread(move || async move {
            let host = connect()?;
            match host.link().del(end.index).execute().await {
                Err(e) if no_such_device(&e) => Ok(()),
                done => done.map_err(netlink),
            }
        });
        match deleted {
            Ok(()) => tracing::debug!(sandbox_id = sandbox, interface = %end.name, "sandbox unlinked"),
            Err(err) => {
                tracing::warn!(sandbox_id = sandbox, interface = %end.name, %err, "sandbox's link left to the kernel")
            }
        }
    }

    /// Takes charge again of the link of a sandbox found running after a node restart (its
    /// init is `pid`), so its kill takes the link down as a fresh sandbox's does: without it,
    /// the link would last as long as anything held the sandbox's namespace. Found from
    /// inside: `eth0` names its host end's index. A sandbox without `eth0` has no link; a
    /// `pid` in the node's own namespace (its init gone and the number reused) is not a
    /// sandbox's, and is left alone.
    pub fn adopt(&self, sandbox: &str, pid: u32) {
        use std::os::unix::fs::MetadataExt as _;
        let Ok(netns) = std::fs::File::open(format!("/proc/{pid}/ns/net")) else {
            return;
        };
        let ours = std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()).ok();
        if netns.metadata().map(|m| m.ino()).ok() == ours || !has_eth0(pid).unwrap_or(false) {
            return;
        }
        let netns_fd = netns.as_raw_fd();
        let found = on_netlink_thread(move || host_end_of(netns_fd));
        match found {
            Ok(end) => {
                tracing::debug!(sandbox_id = sandbox, interface = %end.name, "sandbox's link adopted");
                self.links().insert(sandbox.to_string(), end);
            }
            Err(err) => {
                tracing::warn!(sandbox_id = sandbox, %err, "sandbox's link not found: it goes when the kernel frees its namespace")
            }
        }
    }

    /// The nft binary, when installed.
    pub fn nft(&self) -> Option<&Path> {
        self.nft.as_deref()
    }

    pub fn config(&self) -> &NetworkConfig {
        &self.config
    }

    /// Why sandboxes cannot reach out here, if they cannot.
    pub fn problem(&self) -> Option<&str> {
        self.problem.as_deref()
    }

    /// Why sandboxes that reach out cannot resolve names here, if they cannot (yet: the
    /// forwarder is being tried again).
    pub fn dns_problem(&self) -> Option<String> {
        Dns::lock(&self.dns).problem.clone()
    }

    /// Gives the sandbox whose init is `pid` what `policy` asks for: a link out and its own
    /// rules. Nothing for a sandbox that keeps loopback only (or has no policy: a record from
    /// before egress existed).
    pub fn attach(
        &self,
        sandbox: &str,
        pid: u32,
        policy: Option<&NetworkPolicy>,
    ) -> Result<Option<Link>, NetworkError> {
        let Some(policy) = policy.filter(|p| p.needs_link()) else {
            return Ok(None);
        };
        if let Some(problem) = &self.problem {
            return Err(NetworkError::Unavailable(problem.clone()));
        }
        let netns = std::fs::File::open(format!("/proc/{pid}/ns/net")).map_err(NetworkError::Namespace)?;
        if let (Some(rules), Some(binary)) = (sandbox_ruleset(policy), &self.nft) {
            run_nft(binary, &replacing(&rules), Some(&netns))?;
        }
        let pool = self.config.pool;
        let count = slots(&pool);
        let start = first_slot(sandbox, count);
        let netns_fd = netns.as_raw_fd();
        let (link, index) = on_netlink_thread(move || link_up(pool, start, count, netns_fd))?;
        self.links().insert(
            sandbox.to_string(),
            HostEnd {
                name: link.host_interface.clone(),
                index,
            },
        );
        tracing::debug!(sandbox_id = sandbox, interface = %link.host_interface, address = %link.address, "sandbox linked");
        Ok(Some(link))
    }
}

impl Network {
    /// Replaces the policy of the sandbox whose init is `pid`: its own rules, swapped in one
    /// transaction (no moment without them), and a link if it now needs one and has none. A
    /// link it no longer needs stays, behind rules that now refuse everything.
    pub fn update(&self, sandbox: &str, pid: u32, policy: &NetworkPolicy) -> Result<Option<Link>, NetworkError> {
        let linked = has_eth0(pid).map_err(NetworkError::Namespace)?;
        let rules = if linked && !policy.needs_link() {
            // Keeps the link, refuses everything but loopback.
            sandbox_ruleset(&NetworkPolicy {
                internet: false,
                allow_out: Vec::new(),
                deny_out: Vec::new(),
            })
        } else {
            sandbox_ruleset(policy)
        };
        let swap = replacing(rules.as_deref().unwrap_or_default());
        if linked || policy.needs_link() {
            let binary = self
                .nft
                .as_ref()
                .ok_or_else(|| NetworkError::Unavailable("nft (nftables) is not installed".into()))?;
            let netns = std::fs::File::open(format!("/proc/{pid}/ns/net")).map_err(NetworkError::Namespace)?;
            run_nft(binary, &swap, Some(&netns))?;
        }
        if linked || !policy.needs_link() {
            return Ok(None);
        }
        // Rules are in place: now the link (attach finds the lists already there and sets
        // them again, the same).
        self.attach(sandbox, pid, Some(policy))
    }
}

/// Whether the namespace of process `pid` has an `eth0`: a link this node made.
fn has_eth0(pid: u32) -> std::io::Result<bool> {
    let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev"))?;
    Ok(dev.lines().any(|l| l.trim_start().starts_with("eth0:")))
}

fn netlink(e: rtnetlink::Error) -> NetworkError {
    NetworkError::Netlink(e.to_string())
}

fn already_exists(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.code.map(|c| c.get()) == Some(-libc::EEXIST))
}

fn no_such_device(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.code.map(|c| c.get()) == Some(-libc::ENODEV))
}

/// Runs the netlink work `make` returns on a thread of its own with a runtime of its own: it
/// may enter a sandbox's namespace (a thread that did so must not go back to a pool), and the
/// callers are synchronous, on threads that may belong to another runtime.
fn on_netlink_thread<T, F>(make: impl FnOnce() -> F + Send) -> Result<T, NetworkError>
where
    T: Send,
    F: std::future::Future<Output = Result<T, NetworkError>>,
{
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .build()
                    .map_err(|e| NetworkError::Netlink(e.to_string()))?;
                runtime.block_on(make())
            })
            .join()
            .unwrap_or_else(|_| Err(NetworkError::Netlink("the netlink thread panicked".into())))
    })
}

/// Creates the veth pair (trying slots from `start` until a name is free), addresses both
/// ends, brings them up and routes the sandbox through the host end; the link and the host
/// end's index. Runs [`on_netlink_thread`]: it enters the sandbox's namespace to configure
/// `eth0`.
async fn link_up(
    pool: Cidr,
    start: u64,
    count: u64,
    netns_fd: std::os::fd::RawFd,
) -> Result<(Link, u32), NetworkError> {
    use rtnetlink::packet_route::link::{InfoData, InfoVeth};
    use rtnetlink::{LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder};

    let host = connect()?;
    let mut chosen = None;
    for step in 0..count {
        let Some(link) = slot(&pool, (start + step) % count) else {
            continue;
        };
        let peer = one_queue_each_way(
            LinkMessageBuilder::<LinkUnspec>::new()
                .name("eth0".to_string())
                .setns_by_fd(netns_fd),
        )
        .build();
        let message = one_queue_each_way(
            LinkVeth::new(&link.host_interface, "eth0").set_info_data(InfoData::Veth(InfoVeth::Peer(peer))),
        )
        .build();
        match host.link().add(message).execute().await {
            Ok(()) => {
                chosen = Some(link);
                break;
            }
            Err(e) if already_exists(&e) => continue,
            Err(e) => return Err(netlink(e)),
        }
    }
    let link = chosen.ok_or(NetworkError::PoolExhausted(pool))?;
    // The host end speaks IPv4 only: no link-local IPv6 address for a sandbox to find. (By
    // name, in the host's /proc/sys/net: before this thread enters the sandbox's namespace.)
    let _ = std::fs::write(
        format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", link.host_interface),
        "1",
    );

    // The host's netlink socket stays in the host's namespace.
    let inside = enter(netns_fd)?;
    // The host end by the index eth0 names as its peer, not by name: the name is the slot's,
    // and a slot freed by another sandbox's death may be someone else's by now.
    let (eth0, host_index) = eth0_and_peer(&inside).await?;
    host.address()
        .add(host_index, link.gateway.into(), 30)
        .execute()
        .await
        .map_err(netlink)?;
    set_up(&host, host_index).await?;
    inside
        .address()
        .add(eth0, link.address.into(), 30)
        .execute()
        .await
        .map_err(netlink)?;
    set_up(&inside, eth0).await?;
    inside
        .route()
        .add(RouteMessageBuilder::<Ipv4Addr>::new().gateway(link.gateway).build())
        .execute()
        .await
        .map_err(netlink)?;
    // A slot's namespace is made without a container, which brings loopback up itself in a
    // namespace it makes (and finds it up in one it joins).
    set_up(&inside, index_of(&inside, "lo").await?).await?;
    Ok((link, host_index))
}

/// Brings up the interface of index `index` (`handle`'s namespace).
async fn set_up(handle: &rtnetlink::Handle, index: u32) -> Result<(), NetworkError> {
    handle
        .link()
        .set(rtnetlink::LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .map_err(netlink)
}

/// The index of interface `name` (`handle`'s namespace).
async fn index_of(handle: &rtnetlink::Handle, name: &str) -> Result<u32, NetworkError> {
    use futures::TryStreamExt as _;
    let found = handle
        .link()
        .get()
        .match_name(name.to_string())
        .execute()
        .try_next()
        .await
        .map_err(netlink)?
        .ok_or_else(|| NetworkError::Netlink(format!("no interface {name}")))?;
    Ok(found.header.index)
}

/// `link` asking for one queue each way at creation: a veth otherwise gets one per CPU and is
/// then cut down to one, and cutting queues waits out an RCU grace period while holding the
/// kernel's one networking lock (RTNL), which every other sandbox's link set-up and removal
/// then queues behind.
fn one_queue_each_way<T>(link: rtnetlink::LinkMessageBuilder<T>) -> rtnetlink::LinkMessageBuilder<T> {
    use rtnetlink::packet_route::link::LinkAttribute;
    link.append_extra_attribute(LinkAttribute::NumTxQueues(1))
        .append_extra_attribute(LinkAttribute::NumRxQueues(1))
}

/// A netlink handle in this thread's network namespace, its connection driven by the
/// thread's runtime. A socket stays in the namespace it was made in, whatever the thread
/// enters later.
fn connect() -> Result<rtnetlink::Handle, NetworkError> {
    let (connection, handle, _) = rtnetlink::new_connection().map_err(|e| NetworkError::Netlink(e.to_string()))?;
    tokio::spawn(connection);
    Ok(handle)
}

/// Moves this thread into the network namespace `netns_fd` and returns a netlink handle
/// there. Only on [`on_netlink_thread`]'s threads, which end with their work.
fn enter(netns_fd: std::os::fd::RawFd) -> Result<rtnetlink::Handle, NetworkError> {
    // SAFETY: the caller keeps the namespace's descriptor open for this thread's work.
    let netns = unsafe { std::os::fd::BorrowedFd::borrow_raw(netns_fd) };
    // On this thread only; the thread never returns to a pool.
    rustix::thread::move_into_link_name_space(netns, Some(rustix::thread::LinkNameSpaceType::Network))
        .map_err(|e| NetworkError::Namespace(e.into()))?;
    connect()
}

/// The host end of the link of the namespace `netns_fd`: its index, as the namespace's
/// `eth0` names it, and its name in the host's namespace. Runs [`on_netlink_thread`]: it
/// enters the namespace.
async fn host_end_of(netns_fd: std::os::fd::RawFd) -> Result<HostEnd, NetworkError> {
    use futures::TryStreamExt as _;
    use rtnetlink::packet_route::link::LinkAttribute;
    // The host's socket before entering the namespace.
    let host = connect()?;
    let inside = enter(netns_fd)?;
    let (_, index) = eth0_and_peer(&inside).await?;
    let end = host
        .link()
        .get()
        .match_index(index)
        .execute()
        .try_next()
        .await
        .map_err(netlink)?
        .ok_or_else(|| NetworkError::Netlink(format!("no host link of index {index}")))?;
    let name = end
        .attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::IfName(name) => Some(name.clone()),
            _ => None,
        })
        .unwrap_or_default();
    Ok(HostEnd { name, index })
}

/// The index of the sandbox's `eth0` and of its peer, the host end (`inside` is a netlink
/// handle in the sandbox's namespace). The kernel answers for the peer: no sandbox can rename
/// or fake it, having no CAP_NET_ADMIN.
async fn eth0_and_peer(inside: &rtnetlink::Handle) -> Result<(u32, u32), NetworkError> {
    use futures::TryStreamExt as _;
    use rtnetlink::packet_route::link::LinkAttribute;
    let eth0 = inside
        .link()
        .get()
        .match_name("eth0".to_string())
        .execute()
        .try_next()
        .await
        .map_err(netlink)?
        .ok_or_else(|| NetworkError::Netlink("the sandbox has no eth0".into()))?;
    let peer = eth0
        .attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::Link(peer) => Some(*peer),
            _ => None,
        })
        .ok_or_else(|| NetworkError::Netlink("eth0 names no peer".into()))?;
    Ok((eth0.header.index, peer))
}

/// A network slot's link: a veth pair between the host and the namespace `netns`, its
/// addresses the first free /30 of the pool from a place `seed` spreads; the link and the host
/// end's index.
pub(super) fn slot_link(
    config: &NetworkConfig,
    seed: &str,
    netns: &std::os::fd::OwnedFd,
) -> Result<(Link, u32), NetworkError> {
    let pool = config.pool;
    let count = slots(&pool);
    let start = first_slot(seed, count);
    let netns_fd = netns.as_raw_fd();
    on_netlink_thread(move || link_up(pool, start, count, netns_fd))
}

/// The name and index of the host end of the link of the namespace open at `netns`.
pub(super) fn host_end(netns: &std::fs::File) -> Result<(String, u32), NetworkError> {
    let netns_fd = netns.as_raw_fd();
    on_netlink_thread(move || host_end_of(netns_fd)).map(|end| (end.name, end.index))
}

/// Deletes the host interface of index `index` (both ends of its pair go); `name` is for the
/// log. One already gone is no error.
pub(super) fn delete_link(index: u32, name: &str) {
    let deleted = on_netlink_thread(move || async move {
        let host = connect()?;
        match host.link().del(index).execute().await {
            Err(e) if no_such_device(&e) => Ok(()),
            done => done.map_err(netlink),
        }
    });
    if let Err(err) = deleted {
        tracing::warn!(interface = name, %err, "a link was not deleted");
    }
}

/// Sets `policy`'s own rules in the namespace open at `netns` (none: whatever was there goes).
pub(super) fn set_rules(
    nft: Option<&Path>,
    netns: &std::fs::File,
    policy: &NetworkPolicy,
) -> Result<bool, NetworkError> {
    match (sandbox_ruleset(policy), nft) {
        (Some(rules), Some(binary)) => run_nft(binary, &replacing(&rules), Some(netns)).map(|()| true),
        (Some(_), None) => Err(NetworkError::Unavailable("nft (nftables) is not installed".into())),
        (None, _) => Ok(false),
    }
}

/// Removes a sandbox's own rules from the namespace open at `netns`.
pub(super) fn clear_rules(nft: Option<&Path>, netns: &std::fs::File) -> Result<(), NetworkError> {
    match nft {
        Some(binary) => run_nft(binary, &replacing(""), Some(netns)),
        None => Ok(()),
    }
}

/// Runs `work` on a short-lived thread moved into the network namespace open at `netns`
/// (what it opens, it opens there; `/proc/thread-self/net` is that namespace's).
pub(super) fn in_namespace<T: Send>(
    netns: &std::fs::File,
    work: impl FnOnce() -> std::io::Result<T> + Send,
) -> std::io::Result<T> {
    let netns = std::os::fd::AsFd::as_fd(netns);
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                // On this thread only, which ends with the work.
                rustix::thread::move_into_link_name_space(netns, Some(rustix::thread::LinkNameSpaceType::Network))?;
                work()
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("a thread in a network namespace panicked")))
    })
}

/// Starts the DNS forwarder of the node's pool and the redirect to it.
fn start_resolver(config: &NetworkConfig, nft: &Path) -> Result<Resolver, String> {
    let upstreams = if config.resolvers.is_empty() {
        resolver::host_upstreams()
    } else {
        config.resolvers.clone()
    };
    let resolver = Resolver::start(config.pool, upstreams).map_err(|e| e.to_string())?;
    run_nft(nft, &resolver::redirect_ruleset(&config.pool, resolver.port()), None)
        .map_err(|e| format!("redirecting sandboxes' queries: {e}"))?;
    Ok(resolver)
}

/// Turns on IPv4 forwarding, unless it is on already: in a container /proc/sys is read-only
/// and the container's own setting (compose's `sysctls`) is what there is.
fn ip_forward() -> Result<(), String> {
    const PATH: &str = "/proc/sys/net/ipv4/ip_forward";
    if std::fs::read_to_string(PATH).is_ok_and(|v| v.trim() == "1") {
        return Ok(());
    }
    std::fs::write(PATH, "1").map_err(|e| format!("turning on IPv4 forwarding: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_slash_30s_named_by_their_gateway() {
        let pool: Cidr = "10.200.0.0/16".parse().unwrap();
        assert_eq!(slots(&pool), 16_384);
        let first = slot(&pool, 0).unwrap();
        assert_eq!(first.gateway, Ipv4Addr::new(10, 200, 0, 1));
        assert_eq!(first.address, Ipv4Addr::new(10, 200, 0, 2));
        assert_eq!(first.host_interface, "sbx0ac80001");
        assert!(first.host_interface.len() <= 15, "a Linux interface name");
        let last = slot(&pool, 16_383).unwrap();
        assert_eq!(last.address, Ipv4Addr::new(10, 200, 255, 254));
        assert!(slot(&pool, 16_384).is_none());
        assert!(first_slot("sbx-a", 16_384) < 16_384);
        assert_ne!(first_slot("sbx-a", 16_384), first_slot("sbx-b", 16_384));
    }

    #[test]
    fn the_floor_walls_off_the_host_other_sandboxes_and_its_blocks() {
        let rules = host_ruleset(&["10.0.0.0/8".parse().unwrap(), "169.254.0.0/16".parse().unwrap()]);
        assert!(rules.starts_with("add table inet sandboxsched\nadd set inet sandboxsched flows"));
        assert!(
            !rules.contains("delete table") && !rules.contains("delete set inet sandboxsched flows"),
            "a node's start keeps every sandbox's count of flows"
        );
        for chain in ["prerouting", "input", "forward", "output", "postrouting"] {
            assert!(
                rules.contains(&format!("delete chain inet sandboxsched {chain}\n")),
                "{chain}"
            );
        }
        assert!(rules.contains("elements = { 10.0.0.0/8, 169.254.0.0/16 }"));
        assert!(rules.contains("hook input") && rules.contains("iifname \"sbx*\" reject"));
        let redirected = rules
            .find("ct status dnat ct original ip daddr 169.254.0.53 meta l4proto { tcp, udp } ct original proto-dst 53 accept")
            .unwrap();
        assert!(
            redirected < rules.find("iifname \"sbx*\" reject").unwrap(),
            "only queries redirected to the forwarder reach the host"
        );
        assert!(rules.contains("iifname \"sbx*\" oifname \"sbx*\" reject"));
        assert!(rules.contains("fib saddr . iif oif missing drop"));
        assert!(rules.contains("masquerade"));
        let cap =
            "iifname \"sbx*\" ct state new ct status & confirmed == 0 add @flows { iifname ct count over 4096 } reject";
        let input = rules.find("hook input").unwrap();
        let forward = rules.find("hook forward").unwrap();
        assert!(
            rules[input..forward].find(cap).unwrap() < rules[input..forward].find("ct status dnat").unwrap(),
            "a sandbox's queries to the forwarder count towards its flows"
        );
        assert!(rules[forward..].contains(cap), "{rules}");
        assert!(
            rules.contains("oifname \"sbx*\" ct state new drop"),
            "the host opens nothing to a sandbox"
        );
        assert!(
            !host_ruleset(&[]).contains("elements"),
            "an empty set has no elements clause"
        );
    }

    #[test]
    fn a_sandboxs_own_rules_keep_loopback_and_let_allowed_blocks_win() {
        let policy = |internet, allow: &[&str], deny: &[&str]| NetworkPolicy {
            internet,
            allow_out: allow.iter().map(|c| c.parse().unwrap()).collect(),
            deny_out: deny.iter().map(|c| c.parse().unwrap()).collect(),
        };
        assert_eq!(sandbox_ruleset(&policy(true, &[], &[])), None, "the internet, no lists");
        let closed = sandbox_ruleset(&policy(false, &["1.1.1.1"], &[])).unwrap();
        let (lo, allow, deny) = (
            closed.find("oifname \"lo\" accept").unwrap(),
            closed.find("ip daddr { 1.1.1.1/32 } accept").unwrap(),
            closed.find("ip daddr { 0.0.0.0/0 } reject").unwrap(),
        );
        assert!(lo < allow && allow < deny, "{closed}");
        let dns = closed
            .find("ip daddr 169.254.0.53 meta l4proto { tcp, udp } th dport 53 accept")
            .unwrap();
        assert!(
            lo < dns && dns < deny,
            "names resolve for a sandbox with a link: {closed}"
        );
        let refused = sandbox_ruleset(&policy(false, &[], &[])).unwrap();
        assert!(
            !refused.contains("169.254.0.53"),
            "a sandbox that may reach nothing resolves nothing: {refused}"
        );
        let denied = sandbox_ruleset(&policy(true, &[], &["8.8.8.8"])).unwrap();
        assert!(
            denied.contains("ip daddr { 8.8.8.8/32 } reject") && !denied.contains("} accept"),
            "{denied}"
        );
    }
}
