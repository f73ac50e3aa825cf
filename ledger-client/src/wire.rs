//! What the ledger's server and its client agree on beyond the protobuf messages: status
//! metadata that says what an error means, and how large a reply may grow.
//!
//! A gRPC status code alone cannot say whether a write landed: `UNAVAILABLE` comes as much
//! from a connection that broke after the request left as from a ledger that refused it
//! before touching the database. So the ledger marks its own errors, and the client treats a
//! write's error without the "not applied" mark as "outcome unknown".

/// Metadata key on a ledger error status saying what happened to a write.
pub const OUTCOME_HEADER: &str = "ledger-outcome";
/// Nothing of the request was applied: retrying it as it is is safe.
pub const OUTCOME_NOT_APPLIED: &str = "not-applied";
/// COMMIT was sent and never answered: the write may or may not have landed.
pub const OUTCOME_UNKNOWN: &str = "unknown";
/// Metadata key on an `OUT_OF_RANGE` status from a watch that starts below the compaction
/// point; its value is the oldest revision a watch can start at. Without it, `OUT_OF_RANGE`
/// is something else (for example a reply larger than the client accepts).
pub const COMPACTED_HEADER: &str = "ledger-compacted";

/// Bytes of documents the ledger puts in one List page or one Watch reply before starting
/// another (a single document, or a single revision, may exceed it alone).
pub const REPLY_BYTES: usize = 2 << 20;
/// The largest reply the client accepts: one revision may hold the most entries of the
/// largest payload (128 × 1 MiB), with room for their keys.
pub const MAX_REPLY_BYTES: usize = 160 << 20;
