//! What the pool keeper does next, decided from what it observed: which slots to fill, free
//! or retire. Pure: no I/O, no clock but the `now` it is given.
//!
//! A slot is *filled* when its pool wants it (slot number below the pool's size) and no slot
//! document holds it; *freed* (its document deleted, to be filled again) when its sandbox was
//! claimed, or when nothing was started for it within the grace (a gateway died between
//! taking the slot and writing the manifest, or the create failed), or when its sandbox's
//! node has been gone for long (no claim could reach it there; the reaper ends the sandbox,
//! which no slot names any more, once its node answers); *retired* (its sandbox killed, then
//! its document deleted) when the pool no longer wants it: the pool shrank, the template was
//! rebuilt since the sandbox started, the template is gone, its node is draining (retiring a
//! pooled sandbox is cheaper than moving it: the refill lands on another node), or it has
//! waited longer than the pools' longest wait (only while every slot of its pool is ready,
//! and one at a time, so a pool filled at once is recycled one refill after another, never
//! emptied at once), or someone asked for it to go (the balancer, which drops a pooled
//! sandbox rather than move it).
//!
//! A team's pools are filled only within its budget of memory, counted with each template's
//! size now: a template rebuilt larger after its pool was sized is not filled past it.

use std::collections::{BTreeMap, HashSet};

use common::docs::Capacity;
use common::pool::{PoolDoc, PoolSlotDoc};

/// Where a pool's template stands now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TemplateNow {
    /// Its default tag points at this ready build.
    Build(String),
    /// Deleted: its pool is emptied, then dropped.
    Gone,
    /// No ready build (yet), or it could not be read: nothing is filled or retired for it.
    Unknown,
}

/// What a slot's sandbox is, by its manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotSandbox {
    /// Running, unclaimed, owned by no operation: claimable.
    Ready,
    /// Running and unowned, but someone asked for it to be retired (the balancer dropped it
    /// rather than move it): never claimed, retired as soon as a retirement may start.
    Unwanted,
    /// Being created, or owned by an operation (a move, a retirement): left alone this round.
    Busy,
    /// Claimed by a create: the slot is free to fill again.
    Claimed,
    /// No manifest.
    Absent,
}

/// Where a node stands, by its node document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeNow {
    Ready,
    /// Its sandboxes are being moved away: pooled ones are retired instead.
    Draining,
    /// No heartbeat reached placement for a while: a claim there would wait and fail, so
    /// none is tried, but its slots are kept (placement itself may be what is down).
    Quiet,
    /// Silent for long: its slots are freed, to be filled elsewhere.
    Gone,
}

/// One slot document and what its sandbox is.
#[derive(Clone, Debug)]
pub struct SlotView {
    pub id: String,
    pub version: u64,
    /// The ledger revision that created the slot document: a slot freed and taken again
    /// restarts at version 1, and only this tells the two apart.
    pub create_revision: u64,
    pub doc: PoolSlotDoc,
    pub sandbox: SlotSandbox,
    /// The node its sandbox runs on (empty: none yet) and what it holds there.
    pub node_id: String,
    pub resources: Capacity,
}

impl SlotView {
    /// Whether a create may claim its sandbox now: ready, on a node not known to be silent
    /// or draining.
    pub fn claimable(&self, nodes: &BTreeMap<String, NodeNow>) -> bool {
        self.sandbox == SlotSandbox::Ready && nodes.get(&self.node_id).is_none_or(|n| *n == NodeNow::Ready)
    }
}

/// What the keeper saw: pools, their slots, each pool's template, and the slots' nodes (a
/// node without a document is taken as ready: only what is known is acted on).
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub pools: Vec<(u64, PoolDoc)>,
    pub slots: Vec<SlotView>,
    pub templates: BTreeMap<String, TemplateNow>,
    pub nodes: BTreeMap<String, NodeNow>,
    /// The memory one sandbox of each template asks for now (its current build's).
    pub memory: BTreeMap<String, u64>,
}

/// What a team's pools may hold together.
#[derive(Clone, Copy, Debug)]
pub struct TeamBudget {
    pub memory_bytes: u64,
}

/// How long a keeper lets slots wait.
#[derive(Clone, Copy, Debug)]
pub struct Waits {
    /// A slot with no sandbox is freed this long after it was taken.
    pub grace_ms: u64,
    /// A ready sandbox is recycled (retired, then refilled) this long after its slot was
    /// taken: a long-idle start command drifts (caches, clocks, leaked memory), and a pool's
    /// sandboxes then come from this hour's build of the node's state.
    pub max_age_ms: u64,
    pub budget: TeamBudget,
}

/// One step of the keeper.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Take slot `slot` of `template_id`'s pool and start a sandbox of `build_id` in it.
    Fill {
        template_id: String,
        slot: u32,
        build_id: String,
    },
    /// Delete slot document `id` (at `version`, as created at `create_revision`): its sandbox
    /// is claimed or never came.
    Free {
        id: String,
        version: u64,
        create_revision: u64,
    },
    /// Kill `sandbox_id`, then delete slot document `id` (at `version`, as created at
    /// `create_revision`).
    Retire {
        id: String,
        version: u64,
        create_revision: u64,
        sandbox_id: String,
    },
    /// Delete the pool document of a template that is gone, once its slots are.
    Drop { template_id: String, version: u64 },
}

/// The keeper's next steps for `observed` at `now` (unix ms).
pub fn plan(observed: &Observed, now: u64, waits: Waits) -> Vec<Action> {
    let size_of = |template: &str| {
        observed
            .pools
            .iter()
            .find(|(_, p)| p.template_id == template)
            .map_or(0, |(_, p)| p.size)
    };
    let mut actions = Vec::new();
    let mut held: HashSet<(&str, u32)> = HashSet::new();
    // A template's pool is whole when every slot it wants holds a ready sandbox: only then is
    // an aged one recycled, and one at a time.
    let whole = |template: &str| {
        let size = size_of(template);
        (0..size).all(|k| {
            observed
                .slots
                .iter()
                .any(|s| s.doc.template_id == template && s.doc.slot == k && s.sandbox == SlotSandbox::Ready)
        })
    };
    let mut recycled: HashSet<&str> = HashSet::new();
    for slot in &observed.slots {
        let template = slot.doc.template_id.as_str();
        held.insert((template, slot.doc.slot));
        let now_template = observed.templates.get(template).unwrap_or(&TemplateNow::Unknown);
        let free = Action::Free {
            id: slot.id.clone(),
            version: slot.version,
            create_revision: slot.create_revision,
        };
        let retire = || Action::Retire {
            id: slot.id.clone(),
            version: slot.version,
            create_revision: slot.create_revision,
            sandbox_id: slot.doc.sandbox_id.clone(),
        };
        let node = observed.nodes.get(&slot.node_id).copied();
        match slot.sandbox {
            SlotSandbox::Claimed => actions.push(free),
            SlotSandbox::Absent if slot.doc.since_unix_ms.saturating_add(waits.grace_ms) <= now => actions.push(free),
            SlotSandbox::Absent | SlotSandbox::Busy => {}
            SlotSandbox::Ready | SlotSandbox::Unwanted if node == Some(NodeNow::Gone) => actions.push(free),
            SlotSandbox::Unwanted => actions.push(retire()),
            SlotSandbox::Ready => {
                let unwanted = slot.doc.slot >= size_of(template)
                    || *now_template == TemplateNow::Gone
                    || matches!(now_template, TemplateNow::Build(b) if *b != slot.doc.build_id)
                    || node == Some(NodeNow::Draining);
                let aged = slot.doc.since_unix_ms.saturating_add(waits.max_age_ms) <= now;
                if unwanted || (aged && whole(template) && recycled.insert(template)) {
                    actions.push(retire());
                }
            }
        }
    }
    // What each team's pools hold now (slots taken, at their template's size now).
    let team_of = |template: &str| {
        observed
            .pools
            .iter()
            .find(|(_, p)| p.template_id == template && !p.by_operator())
            .map(|(_, p)| p.set_by.as_str())
    };
    let memory_of = |template: &str| observed.memory.get(template).copied().unwrap_or(0);
    let mut spent: BTreeMap<&str, u64> = BTreeMap::new();
    for (template, _) in &held {
        if let Some(team) = team_of(template) {
            *spent.entry(team).or_default() += memory_of(template);
        }
    }
    for (version, pool) in &observed.pools {
        match observed.templates.get(&pool.template_id) {
            Some(TemplateNow::Build(build_id)) => {
                for slot in 0..pool.size {
                    if held.contains(&(pool.template_id.as_str(), slot)) {
                        continue;
                    }
                    if let Some(team) = team_of(&pool.template_id) {
                        let after = spent.get(team).copied().unwrap_or(0) + memory_of(&pool.template_id);
                        if after > waits.budget.memory_bytes {
                            continue;
                        }
                        spent.insert(team, after);
                    }
                    actions.push(Action::Fill {
                        template_id: pool.template_id.clone(),
                        slot,
                        build_id: build_id.clone(),
                    });
                }
            }
            Some(TemplateNow::Gone) if !held.iter().any(|(t, _)| *t == pool.template_id) => {
                actions.push(Action::Drop {
                    template_id: pool.template_id.clone(),
                    version: *version,
                });
            }
            _ => {}
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(template: &str, size: u32) -> (u64, PoolDoc) {
        (
            7,
            PoolDoc {
                template_id: template.into(),
                size,
                ..PoolDoc::default()
            },
        )
    }

    fn slot(template: &str, k: u32, build: &str, sandbox: SlotSandbox, since: u64) -> SlotView {
        SlotView {
            id: common::pool::slot_id(template, k),
            version: 1,
            create_revision: 1,
            doc: PoolSlotDoc {
                template_id: template.into(),
                slot: k,
                sandbox_id: format!("s{k}"),
                build_id: build.into(),
                since_unix_ms: since,
            },
            sandbox,
            node_id: "n1".into(),
            resources: Capacity::default(),
        }
    }

    fn observed(pools: Vec<(u64, PoolDoc)>, slots: Vec<SlotView>, template: TemplateNow) -> Observed {
        Observed {
            pools,
            slots,
            templates: [("t".to_string(), template)].into(),
            nodes: Default::default(),
            memory: Default::default(),
        }
    }

    const WAITS: Waits = Waits {
        grace_ms: 1000,
        max_age_ms: 1_000_000,
        budget: TeamBudget { memory_bytes: u64::MAX },
    };

    fn waits(grace_ms: u64) -> Waits {
        Waits { grace_ms, ..WAITS }
    }

    fn build(b: &str) -> TemplateNow {
        TemplateNow::Build(b.into())
    }

    #[test]
    fn an_empty_pool_is_filled_slot_by_slot() {
        let o = observed(
            vec![pool("t", 3)],
            vec![slot("t", 1, "b", SlotSandbox::Ready, 0)],
            build("b"),
        );
        let fills: Vec<u32> = plan(&o, 0, WAITS)
            .into_iter()
            .filter_map(|a| match a {
                Action::Fill { slot, .. } => Some(slot),
                _ => None,
            })
            .collect();
        assert_eq!(fills, vec![0, 2]);
    }

    #[test]
    fn a_claimed_slot_is_freed_and_a_stale_empty_one_after_the_grace() {
        let o = observed(
            vec![pool("t", 3)],
            vec![
                slot("t", 0, "b", SlotSandbox::Claimed, 0),
                slot("t", 1, "b", SlotSandbox::Absent, 500),
                slot("t", 2, "b", SlotSandbox::Busy, 0),
            ],
            build("b"),
        );
        let actions = plan(&o, 1000, waits(1000));
        assert_eq!(
            actions,
            vec![Action::Free {
                id: common::pool::slot_id("t", 0),
                version: 1,
                create_revision: 1
            }],
            "slot 1 is within its grace; slot 2 is being created"
        );
        assert!(plan(&o, 1500, waits(1000)).contains(&Action::Free {
            id: common::pool::slot_id("t", 1),
            version: 1,
            create_revision: 1
        }));
    }

    #[test]
    fn a_shrunk_pool_or_a_rebuilt_template_retires_ready_sandboxes() {
        let slots = vec![
            slot("t", 0, "old", SlotSandbox::Ready, 0),
            slot("t", 1, "new", SlotSandbox::Ready, 0),
            slot("t", 2, "new", SlotSandbox::Ready, 0),
        ];
        let retired = |o: &Observed| -> Vec<String> {
            plan(o, 0, WAITS)
                .into_iter()
                .filter_map(|a| match a {
                    Action::Retire { sandbox_id, .. } => Some(sandbox_id),
                    _ => None,
                })
                .collect()
        };
        let o = observed(vec![pool("t", 2)], slots.clone(), build("new"));
        assert_eq!(retired(&o), vec!["s0", "s2"]);
        // Not known where the template stands: only the size decides.
        let o = observed(vec![pool("t", 2)], slots.clone(), TemplateNow::Unknown);
        assert_eq!(retired(&o), vec!["s2"]);
        assert!(!plan(&o, 0, WAITS).iter().any(|a| matches!(a, Action::Fill { .. })));
        // No pool document at all: everything goes.
        let o = observed(vec![], slots, build("new"));
        assert_eq!(retired(&o).len(), 3);
    }

    #[test]
    fn a_sandbox_asked_to_go_is_retired_never_claimed_and_its_pool_not_whole() {
        let o = observed(
            vec![pool("t", 2)],
            vec![
                slot("t", 0, "b", SlotSandbox::Unwanted, 0),
                // Aged: recycled only while its pool is whole, which a slot asked to go is not.
                slot("t", 1, "b", SlotSandbox::Ready, 0),
            ],
            build("b"),
        );
        assert_eq!(
            plan(&o, 2_000_000, WAITS),
            vec![Action::Retire {
                id: "t#0".into(),
                version: 1,
                create_revision: 1,
                sandbox_id: "s0".into(),
            }]
        );
        assert!(!o.slots[0].claimable(&o.nodes));
        assert!(o.slots[1].claimable(&o.nodes));
    }

    #[test]
    fn a_deleted_templates_pool_is_emptied_then_dropped() {
        let o = observed(
            vec![pool("t", 2)],
            vec![slot("t", 0, "b", SlotSandbox::Ready, 0)],
            TemplateNow::Gone,
        );
        let actions = plan(&o, 0, WAITS);
        assert!(matches!(&actions[..], [Action::Retire { .. }]), "{actions:?}");
        let o = observed(vec![pool("t", 2)], vec![], TemplateNow::Gone);
        assert_eq!(
            plan(&o, 0, WAITS),
            vec![Action::Drop {
                template_id: "t".into(),
                version: 7
            }]
        );
    }

    #[test]
    fn a_gone_nodes_slots_are_freed_a_draining_nodes_retired_and_none_is_claimable() {
        let mut o = observed(
            vec![pool("t", 3)],
            vec![
                slot("t", 0, "b", SlotSandbox::Ready, 0),
                slot("t", 1, "b", SlotSandbox::Ready, 0),
                slot("t", 2, "b", SlotSandbox::Ready, 0),
            ],
            build("b"),
        );
        o.slots[1].node_id = "gone".into();
        o.slots[2].node_id = "leaving".into();
        o.nodes = [
            ("n1".to_string(), NodeNow::Ready),
            ("gone".to_string(), NodeNow::Gone),
            ("leaving".to_string(), NodeNow::Draining),
        ]
        .into();
        assert_eq!(
            plan(&o, 0, WAITS),
            vec![
                Action::Free {
                    id: common::pool::slot_id("t", 1),
                    version: 1,
                    create_revision: 1
                },
                Action::Retire {
                    id: common::pool::slot_id("t", 2),
                    version: 1,
                    create_revision: 1,
                    sandbox_id: "s2".into()
                },
            ]
        );
        let claimable: Vec<bool> = o.slots.iter().map(|s| s.claimable(&o.nodes)).collect();
        assert_eq!(claimable, vec![true, false, false]);
        // Quiet (placement may be what is down): not claimed from, but kept.
        o.nodes.insert("gone".into(), NodeNow::Quiet);
        assert!(!o.slots[1].claimable(&o.nodes));
        assert!(!plan(&o, 0, WAITS).iter().any(|a| matches!(a, Action::Free { .. })));
        o.nodes.clear();
        assert!(
            o.slots[1].claimable(&o.nodes),
            "a node with no document is not held against it"
        );
    }

    #[test]
    fn aged_sandboxes_are_recycled_one_at_a_time_while_the_pool_is_whole() {
        let o = observed(
            vec![pool("t", 3)],
            vec![
                slot("t", 0, "b", SlotSandbox::Ready, 0),
                slot("t", 1, "b", SlotSandbox::Ready, 0),
                slot("t", 2, "b", SlotSandbox::Ready, 5_000),
            ],
            build("b"),
        );
        let waits = Waits {
            max_age_ms: 10_000,
            ..WAITS
        };
        assert!(plan(&o, 9_999, waits).is_empty(), "none has waited its longest");
        let retired: Vec<Action> = plan(&o, 12_000, waits);
        assert_eq!(
            retired,
            vec![Action::Retire {
                id: common::pool::slot_id("t", 0),
                version: 1,
                create_revision: 1,
                sandbox_id: "s0".into()
            }],
            "two have aged; one goes this round"
        );
        // While one is being refilled, no other aged one goes.
        let mut refilling = o.clone();
        refilling.slots[0].sandbox = SlotSandbox::Busy;
        assert!(
            plan(&refilling, 12_000, waits).is_empty(),
            "{:?}",
            plan(&refilling, 12_000, waits)
        );
    }

    #[test]
    fn a_teams_pools_are_filled_only_within_its_memory_budget_at_the_templates_size_now() {
        let mut team_pool = pool("t", 4);
        team_pool.1.set_by = "team-a".into();
        let mut o = observed(
            vec![team_pool],
            vec![slot("t", 0, "b", SlotSandbox::Ready, 0)],
            build("b"),
        );
        // Rebuilt at 1 GiB after the pool was sized: 2.5 GiB of budget holds two of them.
        o.memory.insert("t".into(), 1 << 30);
        let waits = Waits {
            budget: TeamBudget { memory_bytes: 5 << 29 },
            ..WAITS
        };
        let fills = plan(&o, 0, waits)
            .into_iter()
            .filter(|a| matches!(a, Action::Fill { .. }))
            .count();
        assert_eq!(fills, 1, "one held, one more within 2.5 GiB");
        // An operator's pool is not a team's to budget.
        o.pools[0].1.set_by = common::pool::OPERATOR.into();
        let fills = plan(&o, 0, waits)
            .into_iter()
            .filter(|a| matches!(a, Action::Fill { .. }))
            .count();
        assert_eq!(fills, 3);
    }
}
