//! `console-svc`: the operator's web console.
//!
//! A small service of its own rather than pages of the gateway, for three reasons:
//! - **Who may reach it.** The gateway's port faces every tenant's SDK; the console is for
//!   operators and listens on an address of its own (loopback by default), which a
//!   deployment keeps on its operators' network.
//! - **What it may do.** It drains nodes and pauses the balancer, which the gateway's role
//!   may not; it proves the console's own role (`mtls::Role::Console`), which reads what an
//!   operator reads and writes no ledger document.
//! - **What it costs.** Its view of a whole cluster and its browsers' event streams live in
//!   their own process, never beside the creates on the gateway's hot path.
//!
//! Inside, as every service here: a pure core ([`view`]: rows, queries, deltas), the
//! adapters that feed it ([`feed`] follows the ledger; [`control`] asks placement and the
//! balancer), and a thin HTTP layer ([`http`]) whose errors are mapped in one place.
//! [`session`] says who is an operator. The browser side is one script and one stylesheet
//! (`assets/`), served by the console itself: nothing is fetched from elsewhere at run time.

pub mod control;
pub mod feed;
pub mod http;
pub mod server;
pub mod session;
pub mod view;
