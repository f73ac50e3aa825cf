//! Warm pools: sandboxes of a template started ahead of any create, their start command
//! ready, waiting to be claimed.
//!
//! Three documents hold a pool:
//!
//! - `pool/<template_id>` ([`PoolDoc`]): how many sandboxes of the template to keep ready,
//!   set by an operator or by the team that owns the template.
//! - `pool-slot/<template_id>#<k>` ([`PoolSlotDoc`]): slot `k` of the pool and the sandbox
//!   that fills it. A slot is taken by creating its document, which the ledger lets exactly
//!   one writer do: two gateways refilling the same pool never start two sandboxes for one
//!   slot, and neither needs a lease to know it.
//! - the pooled sandbox's own manifest, with [`SandboxDoc::pool`](crate::docs::SandboxDoc)
//!   set and no team: no team lists it, reaches it or is billed for it. A create claims it
//!   by rewriting that manifest (compare-and-swap on its version) and deleting its slot's
//!   document in the same transaction, so one pooled sandbox goes to one create whatever
//!   races, and its slot is free to fill again the moment it is claimed.

use serde::{Deserialize, Serialize};

/// `pool/<template_id>`.
pub const POOL_KIND: &str = "pool";
/// `pool-slot/<template_id>#<k>`.
pub const POOL_SLOT_KIND: &str = "pool-slot";
/// The most sandboxes one template's pool may keep.
pub const MAX_POOL_SIZE: u32 = 64;
/// The most pooled sandboxes one team may keep across its templates' pools (an operator's
/// pools are not counted): pooled sandboxes run before anyone is billed for them.
pub const MAX_TEAM_POOL_SLOTS: u32 = 16;
/// The most memory one team's pooled sandboxes may ask for together, across its templates'
/// pools: a count alone would let 16 sandboxes of the largest size hold a node's worth.
pub const MAX_TEAM_POOL_MEMORY_BYTES: u64 = 8 << 30;

/// How many ready sandboxes to keep of one template.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolDoc {
    pub template_id: String,
    /// Sandboxes kept ready; 0 empties the pool.
    pub size: u32,
    /// Who set it: `operator`, or the team that owns the template. A size an operator set
    /// is the operator's to change.
    pub set_by: String,
    pub updated_at_unix_ms: u64,
}

impl PoolDoc {
    /// Whether an operator set it.
    pub fn by_operator(&self) -> bool {
        self.set_by == OPERATOR
    }
}

/// [`PoolDoc::set_by`] of a size an operator set.
pub const OPERATOR: &str = "operator";

/// One slot of a pool and the sandbox that fills it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSlotDoc {
    pub template_id: String,
    pub slot: u32,
    /// The sandbox started for this slot (the ID it keeps once claimed).
    pub sandbox_id: String,
    /// The build it was started from: a template rebuilt since makes it stale.
    pub build_id: String,
    /// When the slot was taken.
    pub since_unix_ms: u64,
}

/// What a pooled sandbox's manifest says of its pool (absent once claimed).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pooled {
    pub template_id: String,
    pub build_id: String,
    pub slot: u32,
    /// When it became ready, for the refill latency.
    pub ready_at_unix_ms: u64,
    /// An ask that it be retired rather than kept (the balancer's, levelling memory or
    /// draining a node: dropping a pooled sandbox costs a kill and a refill wherever placement
    /// puts it, where a move would copy a sandbox nobody uses yet). Once set, no create of a
    /// gateway that knows the field claims it, and its pool's keeper retires it, then fills
    /// its slot again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retire_asked: Option<RetireAsk>,
}

/// Who asked for a pooled sandbox to be retired, and when.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetireAsk {
    /// `balance plan <plan_id>`.
    pub by: String,
    pub at_unix_ms: u64,
}

/// The ID of slot `slot` of `template_id`'s pool.
pub fn slot_id(template_id: &str, slot: u32) -> String {
    format!("{template_id}#{slot}")
}

/// The prefix every slot ID of `template_id`'s pool starts with.
pub fn slot_prefix(template_id: &str) -> String {
    format!("{template_id}#")
}
