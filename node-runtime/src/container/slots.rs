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
//! - the host forgets its connections ([`super::conntrack`]): a reply to one of them would
//!   otherwise be translated back to the address and reach the next sandbox;
//! - a slot whose namespace still holds sockets (TCP keeps a closed connection in `TIME_WAIT`
//!   for a minute, and the next sandbox would list its peers in `/proc/net/tcp`) cools on
//!   until they are gone, and is deleted if they outlast [`MAX_COOLING`].
//!
//! **Kept across restarts.** A slot's namespaces are held by bind mounts in the node's run
//! directory (`slots/sbxGATEWAY-HOSTIDS.{user,net}`), not by the node's descriptors, so a
//! sandbox running in one survives a node restart and the slot is still known: the restarted
//! node finds every slot there, gives back those its re-adopted sandboxes run in, and cleans
//! and reuses the rest ([`SlotPool::settle`]). A node that stops cleanly unmounts the slots
//! no sandbox holds.
//!
//! **Never two sandboxes on one slot**: a slot is in exactly one place of the [`Ledger`]
//! (ready, held by one sandbox, cooling, or found at start), moved under one lock.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::network::{self, Link, NetworkConfig, NetworkError};

/// How long a cleaned slot may keep sockets of its last sandbox before it is deleted
/// instead: a little longer than TCP's `TIME_WAIT`.
pub const MAX_COOLING: Duration = Duration::from_secs(90);
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
    /// The bind-mounted namespace files the spec names.
    pub user: PathBuf,
    pub net: PathBuf,
    /// Since when cleaning has found sockets of its last sandbox left in it.
    sockets_since: Option<Instant>,
}

/// A slot found for a sandbox when the pool's addresses ran out.
enum Taken {
    /// Ready, and now the sandbox's.
    Ready(NetSlotView),
    /// Made on an address another range gave up.
    Made(NetSlot),
}

/// What a sandbox's start needs of its slot, copied out from under the ledger's lock: the
/// namespace files its spec joins, and its link.
pub struct NetSlotView {
    pub user: PathBuf,
    pub net: PathBuf,
    pub link: Link,
}

impl NetSlotView {
    fn of(slot: &NetSlot) -> NetSlotView {
        NetSlotView {
            user: slot.user.clone(),
            net: slot.net.clone(),
            link: slot.link.clone(),
        }
    }
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
    /// Found in the run directory at start, not yet claimed by a re-adopted sandbox.
    found: Vec<S>,
    /// Ranges a slot is being made for right now.
    making: Vec<u32>,
}

impl<S> Default for Ledger<S> {
    fn default() -> Self {
        Ledger {
            ready: Vec::new(),
            cooling: VecDeque::new(),
            held: HashMap::new(),
            found: Vec::new(),
            making: Vec::new(),
        }
    }
}

impl<S: Keyed> Ledger<S> {
    /// A ready slot of range `host_ids`, now `sandbox`'s.
    pub fn take(&mut self, sandbox: &str, host_ids: u32) -> Option<&S> {
        let at = self.ready.iter().position(|s| s.host_ids() == host_ids)?;
        let slot = self.ready.swap_remove(at);
        self.hold(sandbox, slot, false)
    }

    /// Records `slot` as `sandbox`'s (made for it on the spot, or found running it).
    pub fn hold(&mut self, sandbox: &str, slot: S, rules: bool) -> Option<&S> {
        self.held.insert(sandbox.to_string(), (slot, rules));
        self.held.get(sandbox).map(|(s, _)| s)
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
        due
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
        !self.making.is_empty() || !self.cooling.is_empty()
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

    /// Slots found at start: kept aside until [`Ledger::claim_found`] or [`Ledger::settle`].
    pub fn found(&mut self, slots: Vec<S>) {
        self.found.extend(slots);
    }

    /// The found slot that `is_it` picks, now held by `sandbox` (rules assumed: its own
    /// rules may be in it).
    pub fn claim_found(&mut self, sandbox: &str, is_it: impl Fn(&S) -> bool) -> bool {
        match self.found.iter().position(is_it) {
            Some(at) => {
                let slot = self.found.swap_remove(at);
                self.hold(sandbox, slot, true);
                true
            }
            None => false,
        }
    }

    /// Found slots no sandbox claimed: cooling, due `now` (they are cleaned before use).
    pub fn settle(&mut self, now: Instant) {
        for slot in std::mem::take(&mut self.found) {
            self.cooling.push_back((now, slot, true));
        }
    }

    /// Every slot no sandbox holds, taken out (a clean stop).
    pub fn drain_free(&mut self) -> Vec<S> {
        let mut free: Vec<S> = std::mem::take(&mut self.ready);
        free.extend(std::mem::take(&mut self.cooling).into_iter().map(|(_, s, _)| s));
        free.extend(std::mem::take(&mut self.found));
        free
    }

    /// (ready, cooling, held) counts.
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.ready.len(), self.cooling.len(), self.held.len())
    }
}

/// How many slots to keep ready, and how long a returned one cools.
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
    /// Set by the first sandbox that takes a slot: a node none of whose sandboxes reaches out
    /// keeps no slots ready.
    demand: std::sync::atomic::AtomicBool,
}

/// What making, cleaning and deleting slots needs.
struct Maker {
    dir: PathBuf,
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

    fn gauges(&self, ledger: &Ledger<NetSlot>) {
        let (ready, cooling, held) = ledger.counts();
        metrics::gauge!("node_network_slots", "state" => "ready").set(ready as f64);
        metrics::gauge!("node_network_slots", "state" => "cooling").set(cooling as f64);
        metrics::gauge!("node_network_slots", "state" => "held").set(held as f64);
    }
}

impl SlotPool {
    /// The pool of the node whose run directory is `run`: slots found there from before a
    /// restart are kept aside for their sandboxes ([`SlotPool::claim_found`]), and a worker
    /// starts keeping `settings.ready` slots ready for the ranges `next_ranges` names.
    pub fn start(
        run: &Path,
        network: NetworkConfig,
        nft: Option<PathBuf>,
        settings: SlotSettings,
        next_ranges: NextRanges,
    ) -> io::Result<SlotPool> {
        let dir = run.join("slots");
        std::fs::create_dir_all(&dir)?;
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        }
        let maker = Maker {
            seed: dir.display().to_string(),
            dir,
            network,
            nft,
            made: Default::default(),
        };
        let mut ledger = Ledger::default();
        ledger.found(maker.find());
        let shared = Arc::new(Shared {
            ledger: Mutex::new(ledger),
            changed: Condvar::new(),
            maker,
            settings,
            next_ranges,
            stopping: Default::default(),
            demand: Default::default(),
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
        self.shared.demand.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(slot) = self.shared.ledger().take(sandbox, host_ids).map(NetSlotView::of) {
            metrics::counter!("node_network_slot_claims_total", "from" => "pool").increment(1);
            return Ok(slot);
        }
        // The worker starts keeping slots ready now, if it did not already.
        self.shared.changed.notify_all();
        let made = match self.shared.maker.make(host_ids) {
            Err(NetworkError::PoolExhausted(pool)) => match self.when_exhausted(sandbox, host_ids, pool)? {
                Taken::Ready(slot) => return Ok(slot),
                Taken::Made(slot) => slot,
            },
            made => made?,
        };
        metrics::counter!("node_network_slot_claims_total", "from" => "made").increment(1);
        let mut ledger = self.shared.ledger();
        let taken = ledger.hold(sandbox, made, false).map(NetSlotView::of);
        self.shared.gauges(&ledger);
        taken.ok_or_else(|| NetworkError::Netlink("a slot vanished".into()))
    }

    /// Every address of the pool is in a slot: the first slot of range `host_ids` to come
    /// back from cooling or out of the making, or the address of a ready slot of another range
    /// (deleted, and one of this range made on it), whichever comes first; bounded by the
    /// cooldown and some.
    fn when_exhausted(
        &self,
        sandbox: &str,
        host_ids: u32,
        pool: contracts::egress::Cidr,
    ) -> Result<Taken, NetworkError> {
        let deadline = Instant::now() + self.shared.settings.cooldown + Duration::from_secs(10);
        let mut ledger = self.shared.ledger();
        loop {
            if let Some(slot) = ledger.take(sandbox, host_ids) {
                metrics::counter!("node_network_slot_claims_total", "from" => "waited").increment(1);
                return Ok(Taken::Ready(NetSlotView::of(slot)));
            }
            if let Some(other) = ledger.evict(host_ids) {
                drop(ledger);
                self.shared.maker.delete(other);
                metrics::counter!("node_network_slots_evicted_total").increment(1);
                match self.shared.maker.make(host_ids) {
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

    /// The namespace file of `sandbox`'s slot, when it holds one.
    pub fn net_of(&self, sandbox: &str) -> Option<PathBuf> {
        self.shared.ledger().held(sandbox).map(|s| s.net.clone())
    }

    /// Notes that `sandbox` set rules of its own in its slot.
    pub fn mark_rules(&self, sandbox: &str) {
        self.shared.ledger().mark_rules(sandbox);
    }

    /// Takes back `sandbox`'s slot, if it has one (its processes are gone): it cools, then is
    /// cleaned and ready again. Whether it had one.
    pub fn give_back(&self, sandbox: &str) -> bool {
        let mut ledger = self.shared.ledger();
        let had = ledger.give_back(sandbox, Instant::now() + self.shared.settings.cooldown);
        if had {
            self.shared.gauges(&ledger);
            drop(ledger);
            self.shared.changed.notify_all();
        }
        had
    }

    /// Gives `sandbox`, found running with init `pid` after a restart, the found slot its
    /// network namespace is; whether it was one.
    pub fn claim_found(&self, sandbox: &str, pid: u32) -> bool {
        use std::os::unix::fs::MetadataExt as _;
        let Ok(theirs) = std::fs::metadata(format!("/proc/{pid}/ns/net")) else {
            return false;
        };
        let key = (theirs.dev(), theirs.ino());
        self.shared.ledger().claim_found(sandbox, |slot| {
            std::fs::metadata(&slot.net).is_ok_and(|m| (m.dev(), m.ino()) == key)
        })
    }

    /// Found slots no re-adopted sandbox runs in go to cleaning, then to use.
    pub fn settle(&self) {
        self.shared.ledger().settle(Instant::now());
        self.shared.changed.notify_all();
    }
}

impl Drop for SlotPool {
    /// Stops the worker and deletes every slot no sandbox holds: those held stay with their
    /// sandboxes, for the next node to find.
    fn drop(&mut self) {
        self.shared.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
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

/// Deletes every slot in the run directory `run`, held or not: for a node that will not come
/// back, once its sandboxes are gone.
pub fn delete_all(run: &Path) {
    let dir = run.join("slots");
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let _ = rustix::mount::unmount(entry.path(), rustix::mount::UnmountFlags::DETACH);
        let _ = std::fs::remove_file(entry.path());
        if let Some(name) = entry.file_name().to_str().and_then(|n| n.split('-').next()) {
            network::delete_link_named(name);
        }
    }
}

/// The worker: cleans slots whose cooling is over, then makes what the next sandboxes lack,
/// one at a time (a create that finds none makes its own meanwhile).
fn work(shared: &Shared) {
    loop {
        if shared.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let due = shared.ledger().due(Instant::now());
        if !due.is_empty() {
            clean(shared, due);
            continue;
        }
        let wanted = if shared.demand.load(std::sync::atomic::Ordering::Relaxed) {
            (shared.next_ranges)(shared.settings.ready)
        } else {
            Vec::new()
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
        wait(shared, next);
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

/// Cleans `due` slots: their rules removed, the host's connections to their addresses
/// forgotten (in one pass over the table), and each ready again, or cooling on while its
/// namespace holds sockets, or deleted.
fn clean(shared: &Shared, due: Vec<(NetSlot, bool)>) {
    let addresses: Vec<Ipv4Addr> = due.iter().map(|(s, _)| s.link.address).collect();
    if let Err(err) = super::conntrack::forget(&addresses) {
        // Not reused without that: a reply to an old connection would reach the next sandbox.
        tracing::warn!(%err, "the host's connections to returned slots could not be forgotten; deleting them");
        for (slot, _) in due {
            shared.maker.delete(slot);
        }
        return;
    }
    let now = Instant::now();
    for (mut slot, rules) in due {
        match shared.maker.clean(&slot, rules) {
            Ok(0) => {
                slot.sockets_since = None;
                shared.ledger().ready(slot);
            }
            Ok(sockets) if now.duration_since(*slot.sockets_since.get_or_insert(now)) < MAX_COOLING => {
                tracing::debug!(interface = %slot.link.host_interface, sockets, "slot cools on: sockets left");
                shared.ledger().cool(slot, now + RECHECK, false);
            }
            Ok(sockets) => {
                tracing::info!(interface = %slot.link.host_interface, sockets, "slot deleted: its sockets outlived cooling");
                shared.maker.delete(slot);
            }
            Err(err) => {
                tracing::warn!(interface = %slot.link.host_interface, %err, "slot deleted: it could not be cleaned");
                shared.maker.delete(slot);
            }
        }
    }
    let ledger = shared.ledger();
    shared.gauges(&ledger);
    drop(ledger);
    shared.changed.notify_all();
}

impl Maker {
    /// A new slot for range `host_ids`: namespaces, link, bind mounts.
    fn make(&self, host_ids: u32) -> Result<NetSlot, NetworkError> {
        let (user, net) = super::ids::hold_namespaces(&super::ids::sandbox_map_text(host_ids), true)
            .map_err(NetworkError::Namespace)?;
        let net = net.ok_or_else(|| NetworkError::Netlink("no network namespace".into()))?;
        let n = self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (link, host_index) = network::slot_link(&self.network, &format!("{}/{n}", self.seed), &net)?;
        let stem = format!("{}-{host_ids}", link.host_interface);
        let slot = NetSlot {
            host_ids,
            host_index,
            user: self.dir.join(format!("{stem}.user")),
            net: self.dir.join(format!("{stem}.net")),
            link,
            sockets_since: None,
        };
        if let Err(e) = keep(&user, &slot.user).and_then(|()| keep(&net, &slot.net)) {
            self.delete(slot);
            return Err(NetworkError::Namespace(e));
        }
        Ok(slot)
    }

    /// Cleans a returned slot; the sockets its namespace still holds.
    fn clean(&self, slot: &NetSlot, rules: bool) -> Result<usize, NetworkError> {
        let net = std::fs::File::open(&slot.net).map_err(NetworkError::Namespace)?;
        if rules {
            network::clear_rules(self.nft.as_deref(), &net)?;
        }
        network::sockets_in(&net)
    }

    /// Deletes a slot: its link (which takes the namespace's end with it) and its mounts.
    fn delete(&self, slot: NetSlot) {
        network::delete_link(slot.host_index, &slot.link.host_interface);
        for file in [&slot.user, &slot.net] {
            let _ = rustix::mount::unmount(file, rustix::mount::UnmountFlags::DETACH);
            let _ = std::fs::remove_file(file);
        }
    }

    /// The slots a node before this one left in the run directory, each checked against its
    /// namespace: its `eth0`'s peer is the host end its name says. Anything else there is
    /// deleted.
    fn find(&self) -> Vec<NetSlot> {
        let mut found = Vec::new();
        let mut stems: Vec<String> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".net"))
                    .map(str::to_string)
            })
            .collect();
        stems.sort();
        for stem in &stems {
            let slot = self.open_found(stem);
            match slot {
                Some(slot) => found.push(slot),
                None => {
                    tracing::warn!(slot = %stem, "a network slot left from before is not whole; deleting it");
                    for file in [format!("{stem}.user"), format!("{stem}.net")] {
                        let path = self.dir.join(file);
                        let _ = rustix::mount::unmount(&path, rustix::mount::UnmountFlags::DETACH);
                        let _ = std::fs::remove_file(path);
                    }
                    if let Some(name) = stem.split('-').next() {
                        network::delete_link_named(name);
                    }
                }
            }
        }
        // Files of no slot (a `.user` without its `.net`).
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !stems.iter().any(|s| name.starts_with(s.as_str())) {
                let _ = rustix::mount::unmount(entry.path(), rustix::mount::UnmountFlags::DETACH);
                let _ = std::fs::remove_file(entry.path());
            }
        }
        if !found.is_empty() {
            tracing::info!(slots = found.len(), "network slots found from before the restart");
        }
        found
    }

    fn open_found(&self, stem: &str) -> Option<NetSlot> {
        let (name, host_ids) = stem.split_once('-')?;
        let host_ids: u32 = host_ids.parse().ok()?;
        let gateway = u32::from_str_radix(name.strip_prefix(super::HOST_PREFIX)?, 16).ok()?;
        let (user, net) = (
            self.dir.join(format!("{stem}.user")),
            self.dir.join(format!("{stem}.net")),
        );
        let netns = std::fs::File::open(&net).ok()?;
        let (found_name, host_index) = network::host_end(&netns).ok()?;
        if found_name != name || !is_namespace(&user) {
            return None;
        }
        Some(NetSlot {
            host_ids,
            link: Link {
                host_interface: name.to_string(),
                gateway: Ipv4Addr::from(gateway),
                address: Ipv4Addr::from(gateway.checked_add(1)?),
            },
            host_index,
            user,
            net,
            sockets_since: None,
        })
    }
}

/// Whether `path` is a namespace file (nsfs), that is, a bind mount still in place.
fn is_namespace(path: &Path) -> bool {
    /// `NSFS_MAGIC` of `<linux/magic.h>`.
    const NSFS_MAGIC: i64 = 0x6e73_6673;
    rustix::fs::statfs(path).is_ok_and(|s| s.f_type == NSFS_MAGIC)
}

/// Keeps the namespace `ns` alive at `path` (a bind mount of it on an empty file there).
fn keep(ns: &OwnedFd, path: &Path) -> io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    let source = jail::sys::fd_path(ns.as_raw_fd()).to_string();
    rustix::mount::mount_bind(source.as_str(), path).map_err(io::Error::from)
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
        assert_eq!(l.take("a", 8), None, "no slot of that range");
        assert_eq!(l.take("a", 7), Some(&S(7, 1)));
        assert_eq!(l.take("b", 7), None, "a taken slot is nobody else's");
        l.mark_rules("a");
        assert!(l.give_back("a", t0 + Duration::from_secs(2)));
        assert!(!l.give_back("a", t0), "given back once");
        assert!(l.anything_coming());
        assert_eq!(l.counts(), (1, 1, 0));
        assert!(l.due(t0 + Duration::from_secs(1)).is_empty(), "still cooling");
        assert_eq!(l.next_due(), Some(t0 + Duration::from_secs(2)));
        let due = l.due(t0 + Duration::from_secs(2));
        assert_eq!(due, vec![(S(7, 1), true)], "cleaned with its rules");
        assert_eq!(l.counts(), (1, 0, 0));
        assert!(!l.anything_coming());
        assert_eq!(l.evict(9), None, "only other ranges give up their address");
        assert_eq!(l.evict(7), Some(S(9, 2)));
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
    fn found_slots_wait_for_their_sandboxes_then_go_to_cleaning() {
        let t0 = Instant::now();
        let mut l = Ledger::default();
        l.found(vec![S(1, 1), S(2, 2)]);
        assert!(l.claim_found("a", |s| s.1 == 2));
        assert!(!l.claim_found("b", |s| s.1 == 2), "claimed once");
        assert_eq!(l.held("a"), Some(&S(2, 2)));
        assert_eq!(l.ready_ranges(), Vec::<u32>::new(), "found is not ready");
        l.settle(t0);
        assert_eq!(l.due(t0), vec![(S(1, 1), true)], "cleaned as if it had rules");
        assert!(l.give_back("a", t0));
        assert_eq!(l.drain_free().len(), 1);
        assert_eq!(l.counts(), (0, 0, 0));
    }
}
