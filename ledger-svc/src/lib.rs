//! ledger-svc: versioned JSON documents with per-document compare-and-swap and a change feed.
//!
//! etcd's model on SQL. Every document, addressed by `(kind, id)`, has a version that counts
//! its writes. A `Compare` names the documents it guards with the versions it expects and
//! applies all its writes or none; every committed compare gets the next global revision; a
//! `Watch` replays the change log from any revision, so a reader that reconnects with its last
//! revision misses nothing.
//!
//! The rule that makes this ledger useful for a balancer: **compare only
//! what you write**. A plan commit that also guards node documents which node agents rewrite
//! every few seconds can never succeed; conflicts therefore name every mismatching document
//! and its current version, so a caller sees at once which guard was the wrong one.
//!
//! Layout: [`model`] is the pure core (validation, batch planning); [`store`] the sqlx
//! adapter (SQLite or PostgreSQL); `committer` batches writes into group commits; `head`
//! tracks the head revision and database health; [`writers`] says which service owns each
//! kind of document; [`api`] is the gRPC service; [`server`]
//! wires them. Services talk to it through the `ledger-client` crate, which links none of
//! this.

pub mod api;
mod committer;
mod head;
pub mod model;
pub mod server;
pub mod store;
pub mod writers;

pub use model::{Conflict, DocKey, Document};
pub use server::{start, LedgerConfig, RunningLedger, StartError, POLICY};
