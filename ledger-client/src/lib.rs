//! The ledger's client, for every service that reads or writes documents: typed reads,
//! compare-and-swap transactions that guard only what they name, versioned values, and a
//! watch that resumes after disconnects without skipping or repeating a revision.
//!
//! It is a crate of its own so that a service talking to the ledger links a gRPC client and
//! nothing of the ledger's server: no SQL drivers, no migrations.

mod client;
mod document;
pub mod history;
pub mod wire;

pub use client::{Committed, LedgerClient, LedgerError, Resolution, Txn, Versioned, WatchEvent, WatchUpdate};
pub use document::{Conflict, DocKey, Document};
