//! What the placer believes each node runs: the last heartbeat, plus the reservations that
//! heartbeat did not list yet, minus the removals it still listed.
//!
//! Three accounting modes, so the benchmark can show the difference side by side:
//! - [`Accounting::Stale`]: heartbeats only (E2B before its fix). Every request between two
//!   heartbeats sees the same numbers, so the node that looked best wins every time: herding.
//! - [`Accounting::Optimistic`]: E2B's fix (PR 2201). Creates in flight count; a successful
//!   create is added to the node's cached totals at once and a kill subtracted; but each
//!   heartbeat overwrites the totals, so one measured before a create and arriving after it
//!   erases the add (undercount), and the herd comes back under delayed heartbeats.
//! - [`Accounting::Reconciled`] (ours, the default): a reservation per sandbox ID stays until a
//!   heartbeat *lists that ID* (then the heartbeat's own totals include it); a removal stays
//!   until a heartbeat *no longer lists it*. The view is exact at the ID level whatever the
//!   order in which heartbeats and creates arrive.

use std::collections::{BTreeMap, HashMap, HashSet};

/// Resources one sandbox asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub vcpus: u32,
    pub memory_bytes: u64,
}

impl From<Resources> for common::docs::Capacity {
    fn from(r: Resources) -> Self {
        common::docs::Capacity {
            vcpus: r.vcpus,
            memory_bytes: r.memory_bytes,
        }
    }
}

/// Signed totals: optimistic accounting can transiently go below zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub vcpus: i64,
    pub memory_bytes: i64,
}

impl Totals {
    fn add(&mut self, r: Resources) {
        self.vcpus += i64::from(r.vcpus);
        self.memory_bytes += i64::try_from(r.memory_bytes).unwrap_or(i64::MAX);
    }

    fn sub(&mut self, r: Resources) {
        self.vcpus -= i64::from(r.vcpus);
        self.memory_bytes -= i64::try_from(r.memory_bytes).unwrap_or(i64::MAX);
    }

    pub fn from_resources(r: Resources) -> Self {
        let mut t = Totals::default();
        t.add(r);
        t
    }
}

/// Which accounting the placer uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Accounting {
    Stale,
    Optimistic,
    #[default]
    Reconciled,
}

impl Accounting {
    pub const ALL: [Accounting; 3] = [Accounting::Stale, Accounting::Optimistic, Accounting::Reconciled];

    pub fn name(self) -> &'static str {
        match self {
            Accounting::Stale => "stale",
            Accounting::Optimistic => "optimistic",
            Accounting::Reconciled => "reconciled",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|mode| mode.name() == name)
    }
}

/// Where a reservation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The create RPC is in flight, since `since_ms` (the placer's clock at `Place`).
    Pending { since_ms: u64 },
    /// The create succeeded; waiting for a heartbeat that lists the sandbox.
    Unconfirmed { heartbeats_unlisted: u32 },
}

/// How long a reservation may stand without a heartbeat that lists its sandbox.
///
/// Neither bound is about correctness of a create that is going well: the heartbeat that lists
/// its sandbox confirms it long before. They bound what a lost reply costs: a `Created` or
/// `Release` that never arrived would otherwise hold the node's room (and, while pending, one
/// of its starting slots) for as long as the placer runs. The pending bound must outlast
/// everything that holds a reservation pending: a create (its layers fetched, its ready
/// command passed: minutes at most), a move's or a wake's restore, and a template build,
/// which reserves its builder's room and never says `Created` (up to an hour). A reservation
/// dropped while its work still runs leaves that work uncounted until a heartbeat lists it
/// (a builder: never), and a node does not refuse a create for memory itself. Only
/// reconciled accounting expires reservations; the others keep none past a heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expiry {
    /// Heartbeats a created sandbox may go unlisted before its reservation is dropped.
    pub unconfirmed_heartbeats: u32,
    /// How long (ms) a reservation may stay pending (no `Created`, no `Release`) before it is
    /// dropped.
    pub pending_ms: u64,
}

impl Expiry {
    /// Three heartbeats; two hours pending (a template build may take one).
    pub const DEFAULT: Expiry = Expiry {
        unconfirmed_heartbeats: 3,
        pending_ms: 2 * 60 * 60 * 1000,
    };
}

impl Default for Expiry {
    fn default() -> Self {
        Self::DEFAULT
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reservation {
    pub resources: Resources,
    pub phase: Phase,
}

/// Whether an operator allows new sandboxes on the node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AdminState {
    #[default]
    Ready,
    Draining,
}

/// One sandbox in a heartbeat.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub sandbox_id: String,
    pub allocated: Resources,
    pub memory_used_bytes: u64,
}

/// A node's report, measured from one consistent snapshot.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Heartbeat {
    pub node_id: String,
    pub boot_id: String,
    pub seq: u64,
    pub address: String,
    pub labels: BTreeMap<String, String>,
    pub capacity: Resources,
    pub allocated: Resources,
    pub memory_used_bytes: u64,
    pub cpu_usage: f64,
    pub sandboxes: Vec<Listed>,
    /// Templates (build IDs) whose layers the node holds.
    pub templates: Vec<String>,
    /// What the node's pooled sandboxes (a warm pool's, unclaimed) hold of `allocated`.
    pub pooled: Resources,
}

/// What applying a heartbeat did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeartbeatOutcome {
    pub applied: bool,
    /// Why it was ignored.
    pub reason: Option<String>,
    /// Reservations confirmed (listed) by this heartbeat.
    pub confirmed: u32,
    /// Removals completed (no longer listed) by this heartbeat.
    pub removed: u32,
    /// Reservations dropped because no heartbeat listed them in time.
    pub expired: Vec<String>,
    /// The boot ID changed: the node restarted and its view was reset.
    pub rebooted: bool,
    /// An operator marked the node draining (node documents carry it to the balancer).
    pub draining: bool,
}

/// The placer's view of one node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeView {
    pub node_id: String,
    pub address: String,
    pub labels: BTreeMap<String, String>,
    pub capacity: Resources,
    pub admin: AdminState,
    pub boot_id: String,
    pub seq: u64,
    /// When the last heartbeat was applied (placer's clock, ms).
    pub last_heartbeat_ms: u64,
    /// Totals of the last heartbeat (in optimistic mode, adjusted by creates and kills).
    pub reported: Totals,
    pub reported_sandboxes: u32,
    pub memory_used_bytes: u64,
    pub cpu_usage: f64,
    /// Sandbox IDs the last heartbeat listed.
    pub listed: HashSet<String>,
    pub reservations: HashMap<String, Reservation>,
    /// Killed sandboxes, with what they held; subtracted while still listed.
    pub removals: HashMap<String, Resources>,
    /// Templates (build IDs) whose layers the last heartbeat said the node holds.
    pub templates: std::collections::BTreeSet<String>,
    /// What its pooled sandboxes hold, as the last heartbeat said: part of `reported`, and
    /// room a create may reclaim by retiring them.
    pub pooled: Resources,
}

impl NodeView {
    pub fn new(node_id: impl Into<String>) -> Self {
        Self {
            node_id: node_id.into(),
            ..Self::default()
        }
    }

    /// Reservations not listed by the last heartbeat (all of them, by construction in
    /// reconciled mode; the in-flight creates in optimistic mode).
    pub fn reserved(&self) -> Totals {
        let mut t = Totals::default();
        for r in self.reservations.values() {
            t.add(r.resources);
        }
        t
    }

    /// Removals the last heartbeat still listed.
    pub fn removing(&self) -> Totals {
        let mut t = Totals::default();
        for (id, r) in &self.removals {
            if self.listed.contains(id) {
                t.add(*r);
            }
        }
        t
    }

    /// What the placer believes is allocated on the node now.
    pub fn believed(&self) -> Totals {
        let (reserved, removing) = (self.reserved(), self.removing());
        Totals {
            vcpus: self.reported.vcpus + reserved.vcpus - removing.vcpus,
            memory_bytes: self.reported.memory_bytes + reserved.memory_bytes - removing.memory_bytes,
        }
    }

    /// What the fit check counts as allocated: everything believed, less the pooled
    /// sandboxes' room when `reclaim_pooled` (a create that may retire them).
    pub fn allocation(&self, reclaim_pooled: bool) -> common::fit::Allocation {
        let mut believed = self.believed();
        if reclaim_pooled {
            believed.sub(self.pooled);
        }
        common::fit::Allocation {
            vcpus: believed.vcpus,
            memory_bytes: believed.memory_bytes,
        }
    }

    /// `reclaim` of the node's pooled room is promised to a create (it retires that much):
    /// no other create counts on it until the next heartbeat says what is pooled.
    pub fn promise_pooled(&mut self, reclaim: Resources) {
        self.pooled.vcpus = self.pooled.vcpus.saturating_sub(reclaim.vcpus);
        self.pooled.memory_bytes = self.pooled.memory_bytes.saturating_sub(reclaim.memory_bytes);
    }

    /// Creates in flight to this node.
    pub fn pending(&self) -> u32 {
        let n = self
            .reservations
            .values()
            .filter(|r| matches!(r.phase, Phase::Pending { .. }))
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    pub fn unconfirmed(&self) -> u32 {
        let n = self.reservations.len() - self.pending() as usize;
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Place chose this node for `sandbox_id` at `now_ms`.
    pub fn reserve(&mut self, mode: Accounting, sandbox_id: &str, resources: Resources, now_ms: u64) {
        if mode == Accounting::Stale {
            return;
        }
        self.reservations.insert(
            sandbox_id.to_string(),
            Reservation {
                resources,
                phase: Phase::Pending { since_ms: now_ms },
            },
        );
    }

    /// The create RPC succeeded.
    pub fn created(&mut self, mode: Accounting, sandbox_id: &str) {
        match mode {
            Accounting::Stale => {}
            Accounting::Optimistic => {
                // OptimisticAdd: straight into the cached totals, which the next heartbeat
                // overwrites.
                if let Some(r) = self.reservations.remove(sandbox_id) {
                    self.reported.add(r.resources);
                }
            }
            Accounting::Reconciled => {
                if let Some(r) = self.reservations.get_mut(sandbox_id) {
                    if matches!(r.phase, Phase::Pending { .. }) {
                        r.phase = Phase::Unconfirmed { heartbeats_unlisted: 0 };
                    }
                }
            }
        }
    }

    /// The create RPC failed: nothing will run.
    pub fn release(&mut self, _mode: Accounting, sandbox_id: &str) {
        self.reservations.remove(sandbox_id);
    }

    /// The sandbox was killed (or moved away). `resources` is what it held, used when the
    /// placer has no reservation for it.
    pub fn removed(&mut self, mode: Accounting, sandbox_id: &str, resources: Resources) {
        match mode {
            Accounting::Stale => {}
            Accounting::Optimistic => {
                // OptimisticRemove.
                let held = self.reservations.remove(sandbox_id).map_or(resources, |r| r.resources);
                self.reported.sub(held);
            }
            Accounting::Reconciled => {
                let held = self.reservations.remove(sandbox_id).map_or(resources, |r| r.resources);
                // Subtracted only while a heartbeat lists it; if none ever did, the marker
                // still guards against a late heartbeat that lists it.
                self.removals.insert(sandbox_id.to_string(), held);
            }
        }
    }

    /// Applies a heartbeat received at `now_ms`. Older or repeated sequence numbers of the
    /// same boot are ignored; a new boot ID resets the view. Reservations it does not list and
    /// that have stood longer than `expiry` allows are dropped.
    pub fn apply_heartbeat(
        &mut self,
        mode: Accounting,
        hb: &Heartbeat,
        now_ms: u64,
        expiry: Expiry,
    ) -> HeartbeatOutcome {
        let mut outcome = HeartbeatOutcome {
            draining: self.admin == AdminState::Draining,
            ..HeartbeatOutcome::default()
        };
        if hb.boot_id == self.boot_id {
            if hb.seq <= self.seq {
                outcome.reason = Some(format!(
                    "sequence {} of boot {} is not newer than {} already applied",
                    hb.seq, hb.boot_id, self.seq
                ));
                return outcome;
            }
        } else {
            outcome.rebooted = !self.boot_id.is_empty();
            self.boot_id = hb.boot_id.clone();
        }
        outcome.applied = true;
        self.seq = hb.seq;
        self.last_heartbeat_ms = now_ms;
        self.address = hb.address.clone();
        self.labels = hb.labels.clone();
        self.templates = hb.templates.iter().cloned().collect();
        self.capacity = hb.capacity;
        self.pooled = hb.pooled;
        self.reported = Totals::from_resources(hb.allocated);
        self.reported_sandboxes = u32::try_from(hb.sandboxes.len()).unwrap_or(u32::MAX);
        self.memory_used_bytes = hb.memory_used_bytes;
        self.cpu_usage = hb.cpu_usage;
        if mode != Accounting::Reconciled {
            return outcome;
        }
        self.listed = hb.sandboxes.iter().map(|s| s.sandbox_id.clone()).collect();
        let listed = &self.listed;
        self.reservations.retain(|id, r| {
            if listed.contains(id) {
                outcome.confirmed += 1;
                return false;
            }
            let expired = match &mut r.phase {
                Phase::Unconfirmed { heartbeats_unlisted } => {
                    *heartbeats_unlisted += 1;
                    *heartbeats_unlisted > expiry.unconfirmed_heartbeats
                }
                // Made by a placer that kept no time (before pending expiry): its clock starts
                // now, as if it had just been placed.
                Phase::Pending { since_ms } if *since_ms == 0 => {
                    *since_ms = now_ms;
                    false
                }
                // Work whose caller died, or whose `Created` or `Release` was lost.
                Phase::Pending { since_ms } => now_ms.saturating_sub(*since_ms) > expiry.pending_ms,
            };
            if expired {
                outcome.expired.push(id.clone());
            }
            !expired
        });
        self.removals.retain(|id, _| {
            let still = listed.contains(id);
            if !still {
                outcome.removed += 1;
            }
            still
        });
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: Resources = Resources {
        vcpus: 1,
        memory_bytes: 1 << 30,
    };

    fn hb(seq: u64, ids: &[&str]) -> Heartbeat {
        let n = ids.len() as u32;
        Heartbeat {
            node_id: "n".into(),
            boot_id: "b1".into(),
            seq,
            capacity: Resources {
                vcpus: 8,
                memory_bytes: 16 << 30,
            },
            allocated: Resources {
                vcpus: n,
                memory_bytes: u64::from(n) << 30,
            },
            sandboxes: ids
                .iter()
                .map(|id| Listed {
                    sandbox_id: id.to_string(),
                    allocated: ONE,
                    memory_used_bytes: 0,
                })
                .collect(),
            ..Heartbeat::default()
        }
    }

    const R: Accounting = Accounting::Reconciled;
    const EXPIRY: Expiry = Expiry {
        unconfirmed_heartbeats: 3,
        pending_ms: 1_000,
    };

    #[test]
    fn reservation_counts_until_a_heartbeat_lists_it() {
        let mut v = NodeView::new("n");
        v.apply_heartbeat(R, &hb(1, &[]), 0, EXPIRY);
        v.reserve(R, "a", ONE, 0);
        assert_eq!(v.believed().vcpus, 1);
        v.created(R, "a");
        // Measured before the create landed: does not list it; the reservation must stay.
        v.apply_heartbeat(R, &hb(2, &[]), 10, EXPIRY);
        assert_eq!(v.believed().vcpus, 1);
        // Lists it: the heartbeat's own totals include it now.
        let out = v.apply_heartbeat(R, &hb(3, &["a"]), 20, EXPIRY);
        assert_eq!(out.confirmed, 1);
        assert!(v.reservations.is_empty());
        assert_eq!(v.believed().vcpus, 1);
    }

    #[test]
    fn heartbeat_that_already_lists_a_pending_create_does_not_double_count() {
        let mut v = NodeView::new("n");
        v.apply_heartbeat(R, &hb(1, &[]), 0, EXPIRY);
        v.reserve(R, "a", ONE, 0);
        v.apply_heartbeat(R, &hb(2, &["a"]), 5, EXPIRY);
        v.created(R, "a");
        assert_eq!(v.believed().vcpus, 1);
    }

    #[test]
    fn removal_subtracts_while_listed_then_disappears() {
        let mut v = NodeView::new("n");
        v.apply_heartbeat(R, &hb(1, &["a", "b"]), 0, EXPIRY);
        v.removed(R, "a", ONE);
        assert_eq!(v.believed().vcpus, 1);
        // A heartbeat measured before the kill still lists it: still subtracted once.
        v.apply_heartbeat(R, &hb(2, &["a", "b"]), 5, EXPIRY);
        assert_eq!(v.believed().vcpus, 1);
        v.apply_heartbeat(R, &hb(3, &["b"]), 10, EXPIRY);
        assert!(v.removals.is_empty());
        assert_eq!(v.believed().vcpus, 1);
    }

    #[test]
    fn stale_sequences_are_ignored_and_a_new_boot_resets() {
        let mut v = NodeView::new("n");
        v.apply_heartbeat(R, &hb(5, &["a"]), 0, EXPIRY);
        let out = v.apply_heartbeat(R, &hb(4, &[]), 1, EXPIRY);
        assert!(!out.applied);
        assert_eq!(v.believed().vcpus, 1);
        let mut rebooted = hb(1, &[]);
        rebooted.boot_id = "b2".into();
        let out = v.apply_heartbeat(R, &rebooted, 2, EXPIRY);
        assert!(out.applied && out.rebooted);
        assert_eq!(v.believed().vcpus, 0);
    }

    #[test]
    fn unconfirmed_reservation_expires_after_the_bound() {
        let mut v = NodeView::new("n");
        v.reserve(R, "ghost", ONE, 0);
        v.created(R, "ghost");
        for seq in 1..=3 {
            assert!(v.apply_heartbeat(R, &hb(seq, &[]), seq, EXPIRY).expired.is_empty());
        }
        assert_eq!(
            v.apply_heartbeat(R, &hb(4, &[]), 4, EXPIRY).expired,
            vec!["ghost".to_string()]
        );
        assert_eq!(v.believed().vcpus, 0);
    }

    #[test]
    fn pending_reservation_stands_while_the_create_may_be_in_flight_and_no_longer() {
        let mut v = NodeView::new("n");
        v.reserve(R, "slow", ONE, 500);
        // However many heartbeats pass, a create in flight keeps its room...
        for seq in 1..=10 {
            assert!(v
                .apply_heartbeat(R, &hb(seq, &[]), 500 + seq * 100, EXPIRY)
                .expired
                .is_empty());
        }
        assert_eq!(v.pending(), 1);
        // ...up to the bound: one whose `Created` or `Release` was lost gives it back.
        assert!(v.apply_heartbeat(R, &hb(11, &[]), 1_500, EXPIRY).expired.is_empty());
        assert_eq!(
            v.apply_heartbeat(R, &hb(12, &[]), 1_501, EXPIRY).expired,
            vec!["slow".to_string()]
        );
        assert_eq!((v.pending(), v.believed().vcpus), (0, 0));
    }

    #[test]
    fn a_pending_reservation_of_a_placer_that_kept_no_time_starts_its_clock_at_a_heartbeat() {
        let mut v = NodeView::new("n");
        // As Redis holds one written by a placer from before pending expiry (`p,0`).
        v.reserve(R, "old", ONE, 0);
        assert!(v.apply_heartbeat(R, &hb(1, &[]), 50_000, EXPIRY).expired.is_empty());
        assert_eq!(v.reservations["old"].phase, Phase::Pending { since_ms: 50_000 });
        assert!(v.apply_heartbeat(R, &hb(2, &[]), 51_000, EXPIRY).expired.is_empty());
        assert_eq!(
            v.apply_heartbeat(R, &hb(3, &[]), 51_001, EXPIRY).expired,
            vec!["old".to_string()]
        );
    }

    #[test]
    fn optimistic_add_is_erased_by_a_heartbeat_measured_before_the_create() {
        let o = Accounting::Optimistic;
        let mut v = NodeView::new("n");
        v.apply_heartbeat(o, &hb(1, &[]), 0, EXPIRY);
        v.reserve(o, "a", ONE, 0);
        v.created(o, "a");
        assert_eq!(v.believed().vcpus, 1);
        // The undercount: a heartbeat measured before the create erases the optimistic add.
        v.apply_heartbeat(o, &hb(2, &[]), 10, EXPIRY);
        assert_eq!(v.believed().vcpus, 0);
    }

    #[test]
    fn stale_mode_sees_heartbeats_only() {
        let s = Accounting::Stale;
        let mut v = NodeView::new("n");
        v.reserve(s, "a", ONE, 0);
        v.created(s, "a");
        assert_eq!(v.believed().vcpus, 0);
        v.apply_heartbeat(s, &hb(1, &["a"]), 0, EXPIRY);
        assert_eq!(v.believed().vcpus, 1);
    }
}
