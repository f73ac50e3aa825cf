//! What both sides of envd traffic agree on: the gateway that routes SDK calls and the node
//! (and, later, the envd inside each sandbox) that answers them.
//!
//! - [`headers`]: the header names the E2B SDK sends and the marker a node adds to say "this
//!   sandbox is not here";
//! - [`host`]: the `{port}-{sandboxID}.{domain}` host names that address a sandbox's port;
//! - [`access`]: who may talk to a sandbox's envd — the sandbox's access token in
//!   `X-Access-Token`, or a signed `/files` URL made from that token — checked in constant
//!   time;
//! - [`sealed`]: what the ledger keeps instead of a token (a seal the gateways' key opens).
//!
//! Pure code, no I/O: linking it costs a service nothing and pulls in no other service.

pub mod access;
pub mod headers;
pub mod host;
pub mod sealed;

/// The port envd listens on inside an E2B sandbox; `E2b-Sandbox-Port` or a sandbox host name
/// naming it addresses envd itself rather than a server the user started.
pub const ENVD_PORT: u16 = 49983;
