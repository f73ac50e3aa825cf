//! What every sandboxsched service shares.
//!
//! Kept deliberately small: a constant that two services must agree on lives here, defined
//! once, so the gateway, the placer, the node and the balancer can never disagree about it
//! (disagreeing about the default memory estimate is exactly how the system in the brief's
//! lesson 2 ended up unable to move anything).

pub mod clock;
pub mod config;
pub mod docs;
pub mod metrics;
pub mod net;
pub mod resources;
pub mod shutdown;
pub mod telemetry;
pub mod trace;
