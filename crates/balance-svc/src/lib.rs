//! balance-svc: keeps the cluster's memory balanced by migrating sandboxes.
//!
//! So far the pure core exists ([`plan`]): observing the spread, planning the fewest moves,
//! and the lower bound the benchmark compares plans to. The executor (moves as persisted,
//! fenced state machines with a lease) and the service around it are issue 6's next steps.

pub mod plan;
