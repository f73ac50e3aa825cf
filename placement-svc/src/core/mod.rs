//! The pure core of placement: accounting per node ([`account`]), the decision chain
//! ([`rank`]) and O(k) sampling ([`sample`]). No I/O; deterministic given an RNG.

pub mod account;
pub mod rank;
pub mod sample;

pub use account::{
    Accounting, AdminState, Expiry, Heartbeat, HeartbeatOutcome, Listed, NodeView, Phase, Reservation, Resources,
    Totals,
};
pub use rank::{Decision, Evaluation, RankConfig, Ranker, Request};
