//! Network slots: a sandbox's network made before it is asked for, and used again after it.
//!
//! Making a sandbox's link means creating a veth pair, and removing one means deleting it.
//! Both take the kernel's one networking lock (RTNL), and a deletion also waits out an RCU
//! grace period under it, so the host removes links one by one at a few dozen a second
//! whatever its cores: a burst of kills queues behind it, and every create of that moment
//! queues behind the kills. So the node keeps **slots**: a network namespace with its veth
//! pair, both addresses, the route and loopback up, ready for a sandbox to *join* (the spec
//! names it by path) rather than made with it. A killed sandbox's slot is not deleted: it
//! cools for a while (so packets in flight die), is cleaned, and is handed to the next one.
//! No veth is made or deleted on a create or a kill path that finds a slot.
//!
//! **Why a user namespace comes with each slot.** A sandbox mounts its own `/sys`, which the
//! kernel allows only in a network namespace owned by the sandbox's user namespace. So a slot
//! is a user namespace mapped as a sandbox's (`0 → host range`, [`super::ids`]) with the network
//! namespace made inside it, and a sandbox joins both; a sandbox's range decides which slots
//! it may take ([`Ledger::take`] by host ids). Nothing of a user namespace outlives its
//! processes that a sandbox could read: keyrings, the one state it carries, are refused to
//! sandboxes by the seccomp filter.
//!
//! **Cleaning** ([`SlotPool`]'s worker, off every request path), before a slot is ready again:
//! - the sandbox's own rules go (the `inet egress` table, when it had one);
//! - the host forgets its connections ([`super::forget::conntrack`]): a reply to one of them
//!   would otherwise be translated back to the address and reach the next sandbox;
//! - the namespace forgets its peers ([`super::forget::tcp_metrics`]), which any process
//!   inside may list;
//! - a slot whose namespace still holds sockets (TCP keeps a closed connection in `TIME_WAIT`
//!   for a minute, and the next sandbox would list its peers in `/proc/net/tcp`) cools on
//!   until they are gone, and is deleted if they outlast [`MAX_COOLING`].
//!
//! **Held by descriptors, not mounts.** The node keeps each slot's namespaces open and a
//! sandbox's spec names them as `/proc/NODE/fd/N`. Bind mounts would let free slots outlive
//! the node, but every mount is copied into each new container's mount namespace and read
//! back by the runtime at every create: a thousand slots' two mounts each measured 2.9 ms more
//! per mount-namespace copy on these hosts. A node that stops loses its free slots (the kernel
//! frees them); a sandbox still running keeps its own, and the node that re-adopts it takes
//! its namespaces back from its init ([`SlotPool::adopt`]), so its kill gives the slot back
//! as any other's.
//!
//! **Never two sandboxes on one slot**: a slot is in exactly one place of the [`Ledger`]
//! (ready, held by one sandbox, or cooling), moved under one lock.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::network::{self, Link, NetworkConfig, NetworkError};

/// How long a cleaned slot may keep sockets of its last sandbox before it is deleted
/// instead: a little longer than TCP's `TIME_WAIT`.
pub const MAX_COOLING: Duration = Duration::from_secs(90);
/// How long the first slot due for cleaning waits for others to be cleaned with it.
const CLEAN_BATCH: Duration = Duration::from_millis(250);
/// How many slots a stopping node deletes at once.
const DELETE_LANES: usize = 8;
/// How often a slot whose namespace still holds sockets is looked at again.
const RECHECK: Duration = Duration::from_secs(5);

/// One slot: a user namespace and the network namespace it owns, with a link out.
#[derive(Debug)]
pub struct NetSlot {
    /// Host id of root in the user namespace: only a sandbox of that range may join it.
    pub host_ids: u32,
    pub link: Link,
    /// The host end's interface index (what deletes it, whatever its name by then).
    host_index: u32,
    /// The namespaces, kept open by the node.
    user: OwnedFd,
    net: OwnedFd,
    /// Since when cleaning has found sockets of its last sandbox left in it.
    sockets_since: Option<Instant>,
}

impl NetSlot {
    /// The path by which a runtime (a process of its own) opens one of the node's descriptors.
    fn path_of(fd: &OwnedFd) -> PathBuf {
        PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), fd.as_raw_fd()))
    }
}

/// A slot found for a sandbox when the pool's addresses ran out.
enum Taken {
    /// Ready, and now the sandbox's.
    Ready(NetSlotView),
    /// Made on an address another range gave up.
    Made(NetSlot),
}

/// What a sandbox's start needs of its slot, taken out from under the ledger's lock: copies
/// of the namespaces' descriptors (so the numbers its spec names stay theirs until the runtime
/// has joined them, whatever happens to the slot meanwhile), and its link.
pub struct NetSlotView {
    user: OwnedFd,
    net: OwnedFd,
    pub link: Link,
}

impl NetSlotView {
    fn of(slot: &NetSlot) -> io::Result<NetSlotView> {
        Ok(NetSlotView {
            user: slot.user.try_clone()?,
            net: slot.net.try_clone()?,
            link: slot.link.clone(),
        })
    }

    /// The user and network namespaces' paths, for the spec.
    pub fn paths(&self) -> (PathBuf, PathBuf) {
        (NetSlot::path_of(&self.user), NetSlot::path_of(&self.net))
    }

    /// The network namespace, open.
    pub fn net_file(&self) -> io::Result<std::fs::File> {
        self.net.try_clone().map(std::fs::File::from)
    }
}

/// What re-adopting a running sandbox's network found.
#[derive(Debug, PartialEq, Eq)]
pub enum Adopted {
    /// Its namespaces are its slot now.
    Slot,
    /// Not a slot's (no link, or not mapped as one sandbox range).
    NoSlot,
    /// The slot of another sandbox the node holds already (two records naming one process).
    HeldByAnother,
}

/// A slot as the [`Ledger`] sees it: which range it serves.
pub trait Keyed {
    fn host_ids(&self) -> u32;
}

impl Keyed for NetSlot {
    fn host_ids(&self) -> u32 {
        self.host_ids
    }
}

/// Where each slot is. Pure: no I/O and no clock of its own, so it is tested alone.
#[derive(Debug)]
pub struct Ledger<S> {
    ready: Vec<S>,
    /// (when it may be cleaned, the slot, whether its sandbox had rules of its own).
    cooling: VecDeque<(Instant, S, bool)>,
    /// By sandbox: the slot and whether rules were set in it.
    held: HashMap<String, (S, bool)>,
    /// Ranges a slot is being made for right now.
    making: Vec<u32>,
    /// Slots out being cleaned.
    cleaning: usize,
}

impl<S> Default for Ledger<S> {
    fn default() -> Self {
        Ledger {
            ready: Vec::new(),
            cooling: VecDeque::new(),
            held: HashMap::new(),
            making: Vec::new(),
            cleaning: 0,
        }
    }
}

impl<S: Keyed> Ledger<S> {
    /// A slot of range `host_ids` for `sandbox`: the one it holds already (a start over its
    /// own dead copy), else a ready one, now its.
    pub fn take(&mut self, sandbox: &str, host_ids: u32, due: Instant) -> Option<&S> {
        if self.held(sandbox).is_some_and(|s| s.host_ids() == host_ids) {
            return self.held(sandbox);
        }
        let at = self.ready.iter().position(|s| s.host_ids() == host_ids)?;
        let slot = self.ready.swap_remove(at);
        self.hold(sandbox, slot, false, due)
    }

    /// Records `slot` as `sandbox`'s (made for it on the spot, or found running it); a slot
    /// it held before goes cooling until `due`, never to be lost or held twice.
    pub fn hold(&mut self, sandbox: &str, slot: S, rules: bool, due: Instant) -> Option<&S> {
        if let Some((before, rules)) = self.held.insert(sandbox.to_string(), (slot, rules)) {
            self.cooling.push_back((due, before, rules));
        }
        self.held.get(sandbox).map(|(s, _)| s)
    }

    /// Whether a slot `is_it` picks is held (by anyone) or free in the pool.
    pub fn knows(&self, is_it: impl Fn(&S) -> bool) -> bool {
        self.held.values().map(|(s, _)| s).any(&is_it)
            || self.ready.iter().any(&is_it)
            || self.cooling.iter().map(|(_, s, _)| s).any(&is_it)
    }

    /// The slot `sandbox` holds.
    pub fn held(&self, sandbox: &str) -> Option<&S> {
        self.held.get(sandbox).map(|(s, _)| s)
    }

    /// Notes that `sandbox` has rules of its own in its slot (cleaning then removes them).
    pub fn mark_rules(&mut self, sandbox: &str) {
        if let Some((_, rules)) = self.held.get_mut(sandbox) {
            *rules = true;
        }
    }

    /// Takes `sandbox`'s slot back: it cools until `due`. Whether it held one.
    pub fn give_back(&mut self, sandbox: &str, due: Instant) -> bool {
        match self.held.remove(sandbox) {
            Some((slot, rules)) => {
                self.cooling.push_back((due, slot, rules));
                true
            }
            None => false,
        }
    }

    /// Slots whose cooling is over at `now`, to be cleaned (each with its rules flag).
    pub fn due(&mut self, now: Instant) -> Vec<(S, bool)> {
        let mut due = Vec::new();
        let mut keep = VecDeque::new();
        while let Some((at, slot, rules)) = self.cooling.pop_front() {
            if at <= now {
                due.push((slot, rules));
            } else {
                keep.push_back((at, slot, rules));
            }
        }
        self.cooling = keep;
        self.cleaning += due.len();
        due
    }

    /// A slot [`Ledger::due`] gave out is back (ready or cooling again) or deleted.
    pub fn cleaned(&mut self) {
        self.cleaning = self.cleaning.saturating_sub(1);
    }

    /// When the next cooling slot is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.cooling.iter().map(|(at, _, _)| *at).min()
    }

    /// A ready slot of a range other than `host_ids`, taken out to be deleted (its address
    /// is wanted for that range).
    pub fn evict(&mut self, host_ids: u32) -> Option<S> {
        let at = self.ready.iter().position(|s| s.host_ids() != host_ids)?;
        Some(self.ready.swap_remove(at))
    }

    /// A cleaned slot, ready; or one that must cool longer.
    pub fn ready(&mut self, slot: S) {
        self.ready.push(slot);
    }

    pub fn cool(&mut self, slot: S, due: Instant, rules: bool) {
        self.cooling.push_back((due, slot, rules));
    }

    /// The ranges `wanted` (one entry a slot, lowest first) still lacks a slot for, counting
    /// ready, cooling and in-the-making ones.
    pub fn deficit(&self, wanted: &[u32]) -> Vec<u32> {
        let mut have: HashMap<u32, usize> = HashMap::new();
        let cooling = self.cooling.iter().map(|(_, s, _)| s.host_ids());
        for host in self
            .ready
            .iter()
            .map(Keyed::host_ids)
            .chain(cooling)
            .chain(self.making.iter().copied())
        {
            *have.entry(host).or_default() += 1;
        }
        let mut lacking = Vec::new();
        for host in wanted {
            match have.get_mut(host) {
                Some(n) if *n > 0 => *n -= 1,
                _ => lacking.push(*host),
            }
        }
        lacking
    }

    /// Whether any slot is cooling or being made: one to wait for when no other can be made.
    pub fn anything_coming(&self) -> bool {
        !self.making.is_empty() || !self.cooling.is_empty() || self.cleaning > 0
    }

    /// Ranges with a ready slot, for the id ranges to prefer.
    pub fn ready_ranges(&self) -> Vec<u32> {
        let mut ranges: Vec<u32> = self.ready.iter().map(Keyed::host_ids).collect();
        ranges.sort_unstable();
        ranges.dedup();
        ranges
    }

    pub fn start_making(&mut self, host_ids: u32) {
        self.making.push(host_ids);
    }

    pub fn done_making(&mut self, host_ids: u32) {
        if let Some(at) = self.making.iter().position(|h| *h == host_ids) {
            self.making.swap_remove(at);
        }
    }

    /// Every slot no sandbox holds, taken out (a clean stop).
    pub fn drain_free(&mut self) -> Vec<S> {
        let mut free: Vec<S> = std::mem::take(&mut self.ready);
        free.extend(std::mem::take(&mut self.cooling).into_iter().map(|(_, s, _)| s));
        free
    }

    /// (ready, cooling, held) counts.
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.ready.len(), self.cooling.len(), self.held.len())
    }
}

pub use super::network::SlotSettings;

/// The most slots kept ready by demand.
const MAX_READY: usize = 4096;

/// How many slots to keep ready: none before any sandbox took one; then the setting, or as
/// many as sandboxes took over the last cooldown (and a second) when that is more, since
/// that many are out cooling when the next ones come.
pub fn ready_wanted(setting: usize, taken_lately: usize, ever_taken: bool) -> usize {
    if ever_taken {
        setting.max(taken_lately).min(MAX_READY)
    } else {
        0
    }
}

/// Which ranges the next `n` sandboxes will run as: the id ranges' answer.
pub type NextRanges = Box<dyn Fn(usize) -> Vec<u32> + Send + Sync>;

/// The node's slots and the worker that cleans and makes them.
pub struct SlotPool {
    shared: Arc<Shared>,
    worker: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    ledger: Mutex<Ledger<NetSlot>>,
    /// Signalled when a slot is given back or made ready, and on stop.
    changed: Condvar,
    maker: Maker,
    settings: SlotSettings,
    next_ranges: NextRanges,
    stopping: std::sync::atomic::AtomicBool,
    /// When sandboxes took slots, over the last cooldown and a second: a node none of whose
    /// sandboxes reaches out keeps no slots ready, and one whose sandboxes come and go faster
    /// than their slots cool keeps as many ready as that window took.
    demand: Mutex<VecDeque<Instant>>,
    /// Whether any sandbox ever took a slot here.
    demand_seen: std::sync::atomic::AtomicBool,
}

/// What making, cleaning and deleting slots needs.
struct Maker {
    network: NetworkConfig,
    nft: Option<PathBuf>,
    /// Spreads the addresses this node tries first away from other nodes' on the host.
    seed: String,
    made: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger<NetSlot>> {
        self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn demand(&self) -> std::sync::MutexGuard<'_, VecDeque<Instant>> {
        self.demand.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes a slot taken at `now`.
    fn took(&self, now: Instant) {
        self.demand_seen.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut demand = self.demand();
        demand.push_back(now);
        // Not more than a window's worth is kept (the oldest are what `wanted` drops anyway).
        while demand.len() > MAX_READY {
            demand.pop_front();
        }
    }

    /// How many slots to keep ready at `now` ([`ready_wanted`]).
    fn wanted(&self, now: Instant) -> usize {
        let mut demand = self.demand();
        let window = self.settings.cooldown + Duration::from_secs(1);
        while demand.front().is_some_and(|t| now.duration_since(*t) > window) {
            demand.pop_front();
        }
        let ever = self.demand_seen.load(std::sync::atomic::Ordering::Relaxed);
        ready_wanted(self.settings.ready, demand.len(), ever)
    }

    fn gauges(&self, ledger: &Ledger<NetSlot>) {
        let (ready, cooling, held) = ledger.counts();
        metrics::gauge!("node_network_slots", "state" => "ready").set(ready as f64);
        metrics::gauge!("node_network_slots", "state" => "cooling").set(cooling as f64);
        metrics::gauge!("node_network_slots", "state" => "held").set(held as f64);
    }
}

impl SlotPool {
    /// The node's pool: a worker starts keeping `settings.ready` slots ready for the ranges
    /// `next_ranges` names, once a sandbox first takes one.
    pub fn start(
        network: NetworkConfig,
        nft: Option<PathBuf>,
        settings: SlotSettings,
        next_ranges: NextRanges,
    ) -> io::Result<SlotPool> {
        let maker = Maker {
            // Nodes on one host try different addresses first.
            seed: format!("{}-{}", std::process::id(), network.pool),
            network,
            nft,
            made: Default::default(),
        };
        let shared = Arc::new(Shared {
            ledger: Mutex::new(Ledger::default()),
            changed: Condvar::new(),
            maker,
            settings,
            next_ranges,
            stopping: Default::default(),
            demand: Default::default(),
            demand_seen: Default::default(),
        });
        let worker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("network-slots".into())
                .spawn(move || work(&shared))?
        };
        Ok(SlotPool {
            shared,
            worker: Some(worker),
        })
    }

    /// Ranges with a slot ready now.
    pub fn ready_ranges(&self) -> Vec<u32> {
        self.shared.ledger().ready_ranges()
    }

    /// A slot for `sandbox`, whose root is host id `host_ids`: a ready one, else one made now,
    /// else (every address taken) the first of its range to come back from cooling, else one
    /// made on the address of a ready slot of another range. What its start needs of it.
    pub fn take(&self, sandbox: &str, host_ids: u32) -> Result<NetSlotView, NetworkError> {
        self.shared.took(Instant::now());
        let due = self.due();
        if let Some(slot) = self.shared.ledger().take(sandbox, host_ids, due).map(NetSlotView::of) {
            metrics::counter!("node_network_slot_claims_total", "from" => "pool").increment(1);
            return slot.map_err(NetworkError::Namespace);
        }
        // The worker starts keeping slots ready now, if it did not already.
        self.shared.changed.notify_all();
        let made = match self.make(host_ids) {
            Err(NetworkError::PoolExhausted(pool)) => match self.when_exhausted(sandbox, host_ids, pool)? {
                Taken::Ready(slot) => return Ok(slot),
                Taken::Made(slot) => slot,
            },
            made => made?,
        };
        metrics::counter!("node_network_slot_claims_total", "from" => "made").increment(1);
        let mut ledger = self.shared.ledger();
        let taken = ledger.hold(sandbox, made, false, due).map(NetSlotView::of);
        self.shared.gauges(&ledger);
        taken
            .ok_or_else(|| NetworkError::Netlink("a slot vanished".into()))?
            .map_err(NetworkError::Namespace)
    }

    /// When a slot given back now may be cleaned.
    fn due(&self) -> Instant {
        Instant::now() + self.shared.settings.cooldown
    }

    /// A slot made for range `host_ids`, counted as coming while it is made.
    fn make(&self, host_ids: u32) -> Result<NetSlot, NetworkError> {
        self.shared.ledger().start_making(host_ids);
        let made = self.shared.maker.make(host_ids);
        self.shared.ledger().done_making(host_ids);
        self.shared.changed.notify_all();
        made
    }

    /// Every address of the pool is in a slot: the first slot of range `host_ids` to come
    /// back from cooling, cleaning or the making, or the address of a ready slot of another
    /// range (deleted, and one of this range made on it), whichever comes first; bounded by
    /// the cooldown and some.
    fn when_exhausted(
        &self,
        sandbox: &str,
        host_ids: u32,
        pool: contracts::egress::Cidr,
    ) -> Result<Taken, NetworkError> {
        let deadline = Instant::now() + self.shared.settings.cooldown + Duration::from_secs(10);
        let mut ledger = self.shared.ledger();
        loop {
            if let Some(slot) = ledger.take(sandbox, host_ids, self.due()) {
                metrics::counter!("node_network_slot_claims_total", "from" => "waited").increment(1);
                return NetSlotView::of(slot).map(Taken::Ready).map_err(NetworkError::Namespace);
            }
            if let Some(other) = ledger.evict(host_ids) {
                drop(ledger);
                self.shared.maker.delete(other);
                metrics::counter!("node_network_slots_evicted_total").increment(1);
                match self.make(host_ids) {
                    Ok(slot) => return Ok(Taken::Made(slot)),
                    Err(NetworkError::PoolExhausted(_)) => {}
                    Err(e) => return Err(e),
                }
                ledger = self.shared.ledger();
                continue;
            }
            let now = Instant::now();
            if !ledger.anything_coming() || now >= deadline {
                return Err(NetworkError::PoolExhausted(pool));
            }
            ledger = self
                .shared
                .changed
                .wait_timeout(ledger, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Notes that `sandbox` set rules of its own in its slot.
    pub fn mark_rules(&self, sandbox: &str) {
        self.shared.ledger().mark_rules(sandbox);
    }

    /// Takes back `sandbox`'s slot, if it has one (its processes are gone): it cools, then is
    /// cleaned and ready again. Whether it had one.
    pub fn give_back(&self, sandbox: &str) -> bool {
        let due = self.due();
        let mut ledger = self.shared.ledger();
        let had = ledger.give_back(sandbox, due);
        if had {
            self.shared.gauges(&ledger);
            drop(ledger);
            self.shared.changed.notify_all();
        }
        had
    }

    /// Takes charge of the network of `sandbox`, found running with init `pid` after a node
    /// restart, as its slot: its user and network namespaces, taken from its init, held
    /// until its kill gives them back. Only a namespace pair a slot could be: a user namespace
    /// mapped as one sandbox range exactly, and an `eth0` whose peer is a host link; and only
    /// one the node holds for no other sandbox.
    pub fn adopt(&self, sandbox: &str, pid: u32) -> Adopted {
        let slot = match adopted(pid) {
            Ok(slot) => slot,
            Err(why) => {
                tracing::debug!(sandbox_id = sandbox, %why, "sandbox's network is no slot");
                return Adopted::NoSlot;
            }
        };
        let key = identity(&slot.net);
        let due = self.due();
        let mut ledger = self.shared.ledger();
        if ledger.knows(|other| identity(&other.net) == key) {
            tracing::warn!(sandbox_id = sandbox, interface = %slot.link.host_interface, "sandbox's network is another sandbox's slot: not adopted");
            return Adopted::HeldByAnother;
        }
        tracing::debug!(sandbox_id = sandbox, interface = %slot.link.host_interface, "sandbox's network adopted as its slot");
        ledger.hold(sandbox, slot, true, due);
        self.shared.gauges(&ledger);
        Adopted::Slot
    }
}

/// A namespace's identity: its file's device and inode.
fn identity(ns: &OwnedFd) -> Option<(u64, u64)> {
    rustix::fs::fstat(ns).ok().map(|st| (st.st_dev, st.st_ino))
}

/// The slot the running sandbox with init `pid` is in.
fn adopted(pid: u32) -> Result<NetSlot, String> {
    use std::os::unix::fs::MetadataExt as _;
    let open = |kind: &str| {
        std::fs::File::open(format!("/proc/{pid}/ns/{kind}"))
            .map(OwnedFd::from)
            .map_err(|e| format!("its {kind} namespace: {e}"))
    };
    let (user, net) = (open("user")?, open("net")?);
    let ours = std::fs::metadata("/proc/self/ns/user").map_err(|e| e.to_string())?;
    let theirs = rustix::fs::fstat(&user).map_err(|e| e.to_string())?;
    if (theirs.st_dev, theirs.st_ino) == (ours.dev(), ours.ino()) {
        return Err("it runs in the node's own user namespace".into());
    }
    let map = |file: &str| std::fs::read_to_string(format!("/proc/{pid}/{file}")).map_err(|e| e.to_string());
    let (uid_map, gid_map) = (map("uid_map")?, map("gid_map")?);
    let host_ids = sole_range(&uid_map).ok_or_else(|| format!("its uid_map is no sandbox's: {uid_map:?}"))?;
    if sole_range(&gid_map) != Some(host_ids) {
        return Err(format!("its gid_map is not its uid_map: {gid_map:?}"));
    }
    // A slot's user namespace is its range's root's (see `ids::hold_namespaces`); one made
    // by an earlier node as the host's root would share root's counts with every sandbox
    // after it, so it goes with its sandbox instead of back to the pool.
    match super::ids::owner(&user) {
        Ok(owner) if owner == host_ids => {}
        Ok(owner) => {
            return Err(format!(
                "its user namespace is uid {owner}'s, not its range's root's ({host_ids})"
            ))
        }
        Err(e) => return Err(format!("its user namespace's owner: {e}")),
    }
    let (host_interface, host_index) =
        network::host_end(&std::fs::File::from(net.try_clone().map_err(|e| e.to_string())?))
            .map_err(|e| e.to_string())?;
    let gateway: u32 = host_interface
        .strip_prefix(super::HOST_PREFIX)
        .and_then(|hex| u32::from_str_radix(hex, 16).ok())
        .ok_or_else(|| format!("its host end {host_interface} is no sandbox link"))?;
    let address = gateway.checked_add(1).ok_or("no address after its gateway")?;
    Ok(NetSlot {
        host_ids,
        link: Link {
            host_interface,
            gateway: Ipv4Addr::from(gateway),
            address: Ipv4Addr::from(address),
        },
        host_index,
        user,
        net,
        sockets_since: None,
    })
}

/// The host id of root in a map of one range, the size of a sandbox's, from 0.
fn sole_range(map: &str) -> Option<u32> {
    let mut lines = map.lines().filter(|l| !l.trim().is_empty());
    let fields: Vec<&str> = lines.next()?.split_whitespace().collect();
    if lines.next().is_some() {
        return None;
    }
    match fields[..] {
        ["0", host, size] if size.parse::<u32>().ok() == Some(super::spec::ID_RANGE) => host.parse().ok(),
        _ => None,
    }
}

impl Drop for SlotPool {
    /// Stops the worker and deletes every slot no sandbox holds: those held stay with their
    /// sandboxes, for the next node to find.
    fn drop(&mut self) {
        // Under the ledger's lock: the worker checks the flag under it before it waits.
        let ledger = self.shared.ledger();
        self.shared.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        drop(ledger);
        self.shared.changed.notify_all();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
        let free = self.shared.ledger().drain_free();
        // Deleted a few at a time: deletions running at once share the kernel's waits, and a
        // busy node may hold hundreds of slots.
        let mut lanes: Vec<Vec<NetSlot>> = (0..DELETE_LANES).map(|_| Vec::new()).collect();
        for (i, slot) in free.into_iter().enumerate() {
            lanes[i % DELETE_LANES].push(slot);
        }
        let maker = &self.shared.maker;
        std::thread::scope(|scope| {
            for lane in lanes.into_iter().filter(|l| !l.is_empty()) {
                scope.spawn(move || lane.into_iter().for_each(|slot| maker.delete(slot)));
            }
        });
    }
}

/// The worker: cleans slots whose cooling is over, then makes what the next sandboxes lack,
/// one at a time (a create that finds none makes its own meanwhile).
fn work(shared: &Shared) {
    loop {
        if shared.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        // Cleaning is done in batches: what became due over the last CLEAN_BATCH together,
        // since a batch pays one pass over the host's conntrack table and over /proc.
        let now = Instant::now();
        let due = {
            let mut ledger = shared.ledger();
            match ledger.next_due() {
                Some(first) if now >= first + CLEAN_BATCH => ledger.due(now),
                _ => Vec::new(),
            }
        };
        if !due.is_empty() {
            clean(shared, due);
            continue;
        }
        let wanted = match shared.wanted(Instant::now()) {
            0 => Vec::new(),
            n => (shared.next_ranges)(n),
        };
        let lacking = {
            let mut ledger = shared.ledger();
            let lacking = ledger.deficit(&wanted).first().copied();
            if let Some(host) = lacking {
                ledger.start_making(host);
            }
            lacking
        };
        if let Some(host) = lacking {
            let made = shared.maker.make(host);
            let mut ledger = shared.ledger();
            ledger.done_making(host);
            match made {
                Ok(slot) => ledger.ready(slot),
                Err(err) => {
                    drop(ledger);
                    tracing::warn!(%err, "a network slot could not be made; trying again later");
                    wait(shared, Some(Instant::now() + RECHECK));
                    continue;
                }
            }
            shared.gauges(&ledger);
            drop(ledger);
            shared.changed.notify_all();
            continue;
        }
        let next = shared.ledger().next_due();
        wait(shared, next.map(|first| first + CLEAN_BATCH));
    }
}

/// Sleeps until `until` (or for long, without one) or until the ledger changes.
fn wait(shared: &Shared, until: Option<Instant>) {
    let ledger = shared.ledger();
    if shared.stopping.load(std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    let timeout = until.map_or(Duration::from_secs(60), |t| t.saturating_duration_since(Instant::now()));
    let _ = shared.changed.wait_timeout(ledger, timeout);
}

/// Cleans `due` slots, in an order that leaves nothing able to make new state once a slot
/// is cleaned: a slot whose namespace still holds TCP sockets (which could yet write metrics
/// or make conntrack entries) cools on and is looked at again; one without is rid of its
/// sandbox's rules, of what its namespace learnt of peers and, in one pass over the host's
/// table for all of them, of the host's conntrack entries of its address; then, unless some
/// process is in its network namespace after all (a container that outlived its kill), it is
/// ready. A slot that cannot be cleaned is deleted.
fn clean(shared: &Shared, due: Vec<(NetSlot, bool)>) {
    let now = Instant::now();
    let mut clean = Vec::new();
    let done = |shared: &Shared, slot: Option<NetSlot>, ready: bool| {
        let mut ledger = shared.ledger();
        ledger.cleaned();
        match slot {
            Some(slot) if ready => ledger.ready(slot),
            Some(slot) => ledger.cool(slot, now + RECHECK, false),
            None => {}
        }
    };
    for (mut slot, rules) in due {
        match shared.maker.clean(&slot, rules) {
            Ok(0) => {
                slot.sockets_since = None;
                clean.push(slot);
            }
            Ok(sockets) if now.duration_since(*slot.sockets_since.get_or_insert(now)) < MAX_COOLING => {
                tracing::debug!(interface = %slot.link.host_interface, sockets, "slot cools on: sockets left");
                done(shared, Some(slot), false);
            }
            Ok(sockets) => {
                tracing::info!(interface = %slot.link.host_interface, sockets, "slot deleted: its sockets outlived cooling");
                shared.maker.delete(slot);
                done(shared, None, false);
            }
            Err(err) => {
                tracing::warn!(interface = %slot.link.host_interface, %err, "slot deleted: it could not be cleaned");
                shared.maker.delete(slot);
                done(shared, None, false);
            }
        }
    }
    let addresses: Vec<Ipv4Addr> = clean.iter().map(|s| s.link.address).collect();
    let forgotten = super::forget::conntrack(&addresses);
    let occupied = occupied_namespaces();
    for slot in clean {
        let problem = match (&forgotten, &occupied) {
            // Not reused without it: a reply to an old connection would reach the next sandbox.
            (Err(err), _) => Some(format!("the host's connections to it could not be forgotten: {err}")),
            (_, Err(err)) => Some(format!("who is in its namespace could not be told: {err}")),
            (_, Ok(occupied)) if identity(&slot.net).is_some_and(|id| occupied.contains(&id)) => {
                Some("a process is in its network namespace".to_string())
            }
            _ => None,
        };
        match problem {
            None => done(shared, Some(slot), true),
            Some(why) => {
                tracing::error!(interface = %slot.link.host_interface, %why, "slot deleted, not reused");
                metrics::counter!("node_network_slots_refused_total").increment(1);
                shared.maker.delete(slot);
                done(shared, None, false);
            }
        }
    }
    let ledger = shared.ledger();
    shared.gauges(&ledger);
    drop(ledger);
    shared.changed.notify_all();
}

/// The network namespaces some process of the host is in (each process's, by its main
/// thread): one pass over `/proc`.
fn occupied_namespaces() -> io::Result<std::collections::HashSet<(u64, u64)>> {
    let mut occupied = std::collections::HashSet::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())) {
            continue;
        }
        // A process that ends meanwhile is in no namespace.
        if let Ok(st) = rustix::fs::stat(entry.path().join("ns/net")) {
            occupied.insert((st.st_dev, st.st_ino));
        }
    }
    Ok(occupied)
}

impl Maker {
    /// A new slot for range `host_ids`: namespaces and link.
    fn make(&self, host_ids: u32) -> Result<NetSlot, NetworkError> {
        let (user, net) = super::ids::hold_namespaces(&super::ids::sandbox_map_text(host_ids), true, Some(host_ids))
            .map_err(NetworkError::Namespace)?;
        let net = net.ok_or_else(|| NetworkError::Netlink("no network namespace".into()))?;
        let n = self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (link, host_index) = network::slot_link(&self.network, &format!("{}/{n}", self.seed), &net)?;
        Ok(NetSlot {
            host_ids,
            link,
            host_index,
            user,
            net,
            sockets_since: None,
        })
    }

    /// Cleans a returned slot unless its namespace still holds TCP sockets: its sandbox's
    /// rules go, and what the namespace learnt of peers (TCP metrics, the route cache, its own
    /// conntrack entries, should anything have turned conntrack on in it). The TCP sockets
    /// left, cleaning nothing while there are any.
    fn clean(&self, slot: &NetSlot, rules: bool) -> Result<usize, NetworkError> {
        let net = std::fs::File::from(slot.net.try_clone().map_err(NetworkError::Namespace)?);
        let address = slot.link.address;
        let sockets = network::in_namespace(&net, || {
            let sockets = tcp_sockets()?;
            if sockets == 0 {
                super::forget::tcp_metrics()?;
                if conntrack_in_use() {
                    super::forget::conntrack(&[address])?;
                }
                // Cached path MTUs to the last sandbox's peers (`ip route show cache`). /proc/sys/net
                // is the namespace of the thread that opens it. Where /proc/sys is read-only (a node
                // in a container) they are left to expire (ten minutes): a peer's address, no data.
                let _ = std::fs::write("/proc/sys/net/ipv4/route/flush", "1");
            }
            Ok(sockets)
        })
        .map_err(NetworkError::Namespace)?;
        if sockets == 0 && rules {
            network::clear_rules(self.nft.as_deref(), &net)?;
        }
        Ok(sockets)
    }

    /// Deletes a slot: its link (which takes the namespace's end with it); its namespaces go
    /// with their descriptors.
    fn delete(&self, slot: NetSlot) {
        network::delete_link(slot.host_index, &slot.link.host_interface);
    }
}

/// How many TCP sockets this thread's network namespace holds (a connection closed by a
/// process that is gone stays in `TIME_WAIT` or `FIN_WAIT` a while). UDP and raw sockets die
/// with their last descriptor, and so with the sandbox's processes.
///
/// Counted from `/proc/net/sockstat` and `sockstat6`, whose `inuse` and `tw` are the
/// namespace's own (kernels from 5.17 count `TIME_WAIT` per namespace): a constant-time read.
/// Listing `/proc/net/tcp` instead walks the host's whole connection table for each slot,
/// and cleaning 500 slots that way took seconds of a core.
fn tcp_sockets() -> io::Result<usize> {
    let v4 = std::fs::read_to_string("/proc/thread-self/net/sockstat")?;
    let v6 = std::fs::read_to_string("/proc/thread-self/net/sockstat6").unwrap_or_default();
    Ok(sockstat_tcp(&v4, "TCP:") + sockstat_tcp(&v6, "TCP6:"))
}

/// The `inuse` and `tw` counts of the line starting with `label` in a sockstat text.
fn sockstat_tcp(text: &str, label: &str) -> usize {
    let Some(line) = text.lines().find(|l| l.starts_with(label)) else {
        return 0;
    };
    let fields: Vec<&str> = line.split_whitespace().collect();
    fields
        .windows(2)
        .filter(|pair| pair[0] == "inuse" || pair[0] == "tw")
        .filter_map(|pair| pair[1].parse::<usize>().ok())
        .sum()
}

/// Whether conntrack holds entries in this thread's network namespace (it runs there only
/// when something in it asked for it; nothing of ours does). Dumping a namespace's table
/// walks the host's whole one, so it is done only then.
fn conntrack_in_use() -> bool {
    std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_count")
        .ok()
        .and_then(|n| n.trim().parse::<u64>().ok())
        .is_some_and(|n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct S(u32, u8);
    impl Keyed for S {
        fn host_ids(&self) -> u32 {
            self.0
        }
    }

    #[test]
    fn a_slot_is_in_one_place_and_cools_before_it_is_ready_again() {
        let t0 = Instant::now();
        let mut l = Ledger::default();
        l.ready(S(7, 1));
        l.ready(S(9, 2));
        assert_eq!(l.ready_ranges(), vec![7, 9]);
        assert_eq!(l.take("a", 8, t0), None, "no slot of that range");
        assert_eq!(l.take("a", 7, t0), Some(&S(7, 1)));
        assert_eq!(l.take("b", 7, t0), None, "a taken slot is nobody else's");
        assert_eq!(
            l.take("a", 7, t0),
            Some(&S(7, 1)),
            "a start over its own dead copy keeps it"
        );
        assert!(l.knows(|s| s.1 == 1) && l.knows(|s| s.1 == 2) && !l.knows(|s| s.1 == 3));
        l.mark_rules("a");
        assert!(l.give_back("a", t0 + Duration::from_secs(2)));
        assert!(!l.give_back("a", t0), "given back once");
        assert!(l.anything_coming());
        assert_eq!(l.counts(), (1, 1, 0));
        assert!(l.due(t0 + Duration::from_secs(1)).is_empty(), "still cooling");
        assert_eq!(l.next_due(), Some(t0 + Duration::from_secs(2)));
        let due = l.due(t0 + Duration::from_secs(2));
        assert_eq!(due, vec![(S(7, 1), true)], "cleaned with its rules");
        l.cleaned();
        assert_eq!(l.counts(), (1, 0, 0));
        assert!(!l.anything_coming());
        assert_eq!(l.evict(9), None, "only other ranges give up their address");
        assert_eq!(l.evict(7), Some(S(9, 2)));
    }

    #[test]
    fn a_sandbox_given_a_second_slot_sends_the_first_to_cooling() {
        let t0 = Instant::now();
        let mut l = Ledger::default();
        l.hold("a", S(1, 1), true, t0);
        l.hold("a", S(2, 2), false, t0);
        assert_eq!(l.held("a"), Some(&S(2, 2)));
        assert_eq!(l.due(t0), vec![(S(1, 1), true)], "not lost, not held twice");
        assert!(l.anything_coming(), "being cleaned");
        l.cleaned();
        assert!(!l.anything_coming());
    }

    #[test]
    fn slots_are_kept_ready_once_asked_for_and_as_many_as_a_cooldown_took() {
        assert_eq!(
            ready_wanted(16, 0, false),
            0,
            "a node whose sandboxes never reached out"
        );
        assert_eq!(ready_wanted(16, 0, true), 16);
        assert_eq!(ready_wanted(16, 100, true), 100, "50 creates/s with 2 s of cooling");
        assert_eq!(ready_wanted(16, 1 << 20, true), MAX_READY);
    }

    #[test]
    fn the_deficit_counts_ready_cooling_and_making_by_range() {
        let t0 = Instant::now();
        let mut l = Ledger::default();
        l.ready(S(1, 0));
        l.cool(S(2, 0), t0, false);
        l.start_making(3);
        assert_eq!(l.deficit(&[1, 2, 3, 4]), vec![4]);
        assert_eq!(l.deficit(&[5, 5, 1, 1]), vec![5, 5, 1], "a shared range wants one each");
        l.done_making(3);
        assert_eq!(l.deficit(&[3]), vec![3]);
    }

    #[test]
    fn tcp_sockets_are_read_off_sockstat_in_use_and_in_time_wait() {
        let v4 = "sockets: used 120\nTCP: inuse 3 orphan 0 tw 2 alloc 9 mem 1\nUDP: inuse 4 mem 2\n";
        assert_eq!(sockstat_tcp(v4, "TCP:"), 5);
        assert_eq!(sockstat_tcp("TCP6: inuse 1\nUDP6: inuse 7\n", "TCP6:"), 1);
        assert_eq!(sockstat_tcp("UDP: inuse 4\n", "TCP:"), 0);
        assert_eq!(
            sockstat_tcp("TCP: inuse x tw\n", "TCP:"),
            0,
            "nothing readable counts nothing"
        );
    }

    /// In a namespace of its own, a closed connection is counted until it is gone, and no
    /// socket of the host's (which has many) is. Root, as the node runs.
    #[test]
    fn a_namespaces_tcp_sockets_are_its_own_time_wait_included() {
        use std::io::Read as _;
        let (_user, net) =
            super::super::ids::hold_namespaces(&super::super::ids::sandbox_map_text(1 << 24), true, Some(1 << 24))
                .expect("namespaces (run as root)");
        let net = std::fs::File::from(net.expect("a network namespace"));
        let counted = network::in_namespace(&net, || {
            let fresh = tcp_sockets()?;
            let lo = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()?;
            assert!(lo.success(), "ip link set lo up");
            let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
            let client = std::net::TcpStream::connect(listener.local_addr()?)?;
            let (mut server, _) = listener.accept()?;
            let open = tcp_sockets()?;
            // The client closes first: its side waits in TIME_WAIT once the server closes too.
            drop(client);
            let mut rest = Vec::new();
            server.read_to_end(&mut rest)?;
            drop(server);
            drop(listener);
            Ok((fresh, open, tcp_sockets()?))
        })
        .unwrap();
        assert_eq!(counted.0, 0, "a new namespace holds none of the host's");
        assert_eq!(counted.1, 3, "listener, client and server");
        assert_eq!(counted.2, 1, "the client's side in TIME_WAIT");
    }

    #[test]
    fn only_a_map_of_one_sandbox_range_is_a_slots() {
        assert_eq!(sole_range("         0   16777216      65536\n"), Some(1 << 24));
        assert_eq!(sole_range("0 100000 65536\n"), Some(100_000));
        assert_eq!(sole_range("0 0 4294967295\n"), None, "the host's own");
        assert_eq!(sole_range("0 100000 65536\n65536 0 1\n"), None, "two ranges");
        assert_eq!(sole_range("1 100000 65536\n"), None);
        assert_eq!(sole_range(""), None);
    }
}
