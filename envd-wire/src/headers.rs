//! Header names of envd traffic (lower case, as HTTP/2 carries them).

/// The sandbox a request is for; the SDK sends it on every envd call when `E2B_SANDBOX_URL`
/// points at one proxy for all sandboxes.
pub const SANDBOX_ID: &str = "e2b-sandbox-id";

/// The sandbox's port the request is for (envd's is [`crate::ENVD_PORT`]).
pub const SANDBOX_PORT: &str = "e2b-sandbox-port";

/// The port an `E2b-Sandbox-Port` value names: 1 to 65535.
pub fn port(value: &str) -> Option<u16> {
    value.parse::<u16>().ok().filter(|p| *p != 0)
}

/// The sandbox's envd access token, issued at create.
pub const ACCESS_TOKEN: &str = "x-access-token";

/// The sandbox's traffic token, required on its ports when public traffic is not allowed.
pub const TRAFFIC_ACCESS_TOKEN: &str = "e2b-traffic-access-token";

/// Set by the node, and only by it, on a request it relays to a sandbox's port when the
/// caller showed the sandbox's envd access token (`X-Access-Token`, which itself never goes
/// inside): a server there that runs code (the code interpreter's) answers only such requests,
/// without ever holding the token. One a caller sends is removed.
pub const ACCESS_VERIFIED: &str = "e2b-access-token-verified";

/// Set by a node on answers about a sandbox it does not have, so a proxy in front can tell
/// "not here" (the sandbox moved or ended) from any other 404.
pub const MISSING: &str = "x-e2b-sandbox-missing";
