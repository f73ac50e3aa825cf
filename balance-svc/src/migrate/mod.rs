//! Executes moves: one action per step, each persisted in the plan document before the next.
//!
//! The steps and why their order keeps a sandbox in exactly one running place are in
//! [`crate::record`]. Here is what each step *does*, and how it stays safe to repeat:
//!
//! - node calls carry `<move_id>/<action>/<epoch>` as operation ID, and repeats of an action
//!   that already happened are answered as done (pausing a paused sandbox, a restore that
//!   finds its copy, a kill that finds nothing);
//! - every time an executor picks up a move that is under way it takes the sandbox's fencing
//!   epoch again (manifest compare-and-swap, guarded by `lifecycle_owner` = this move), so a
//!   node refuses anything an older executor still tries with the old epoch;
//! - the plan document is written by compare-and-swap on its own version only; a conflict
//!   means another executor took the lease, and this one stops ([`MoveError::Fenced`]).
//!
//! Layout: [`decide`] is the pure part (what a picked-up move resumes at, where a failure
//! leads, what each node action means); [`error`] maps node and ledger answers to
//! [`MoveError`]; [`nodes`] pools node clients; [`schedule`] says which moves may run at once; `executor` drives a plan's moves and records
//! each step; `steps` does each step's I/O.

pub mod decide;
pub mod error;
mod executor;
mod model;
pub mod nodes;
pub mod schedule;
mod steps;

pub use error::MoveError;
pub use executor::{Halt, Mover};
pub use nodes::NodeClients;
pub use schedule::Budget;
