//! What may cross the gateway between a caller and a sandbox, besides the request itself.
//!
//! Every sandbox's ports are served under one domain (`{port}-{sandboxID}.{domain}`), so each
//! tenant's web app is a sibling of every other's. Two things would otherwise cross between
//! them, or from the platform into tenant code:
//!
//! - **Cookies for the whole domain.** A server in a sandbox answering
//!   `Set-Cookie: s=x; Domain={domain}` would plant that cookie in the browser for every other
//!   tenant's host (session fixation, cookie tossing). Answers from sandboxes have the
//!   `Domain` attribute taken out of every cookie they set, so each cookie stays with the host
//!   that set it. That covers cookies a server sets, not ones a page's script sets
//!   (`document.cookie = "s=x; Domain=…"`): only a domain browsers treat as a public suffix
//!   (listed in the Public Suffix List), or a registrable domain of its own for every
//!   sandbox's ports, keeps scripts apart. An operator serving untrusted tenants' web apps
//!   needs one of those; this is the part the gateway can do.
//! - **The platform's own credentials.** The operators' `X-Admin-Token` never goes on into a
//!   sandbox, and neither does a team's `X-API-Key` on envd's path, where envd never needs it
//!   (a sandbox's own web app may use a header of that name for its own API, so a port keeps
//!   it).

use axum::http::header::SET_COOKIE;
use axum::http::{HeaderMap, HeaderValue};

/// The operators' token for the admin routes.
const ADMIN_TOKEN: &str = "x-admin-token";
/// A team's API key.
const API_KEY: &str = "x-api-key";

/// Which of a sandbox's doors a request goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Door {
    /// envd's port: the SDK's own calls.
    Envd,
    /// Any other port: whatever the tenant serves.
    Port,
}

/// Removes the platform's credentials from a request on its way into a sandbox.
pub fn strip_credentials(headers: &mut HeaderMap, door: Door) {
    headers.remove(ADMIN_TOKEN);
    if door == Door::Envd {
        headers.remove(API_KEY);
    }
}

/// Whether a request header goes on into a sandbox through `door`.
pub fn passes(name: &str, door: Door) -> bool {
    !(name.eq_ignore_ascii_case(ADMIN_TOKEN) || (door == Door::Envd && name.eq_ignore_ascii_case(API_KEY)))
}

/// Makes every cookie a sandbox's answer sets a host-only one: its `Domain` attribute is
/// taken out (values are bytes: a cookie's value may be UTF-8, or anything but controls).
pub fn host_only_cookies(headers: &mut HeaderMap) {
    if !headers.contains_key(SET_COOKIE) {
        return;
    }
    let cookies: Vec<HeaderValue> = headers.get_all(SET_COOKIE).iter().cloned().collect();
    headers.remove(SET_COOKIE);
    for cookie in cookies {
        if let Ok(value) = HeaderValue::from_bytes(&without_domain(cookie.as_bytes())) {
            headers.append(SET_COOKIE, value);
        }
    }
}

/// A `Set-Cookie` value without its `Domain` attributes (the name=value pair is the first
/// `;`-separated part; attribute names are case-insensitive).
fn without_domain(cookie: &[u8]) -> Vec<u8> {
    let mut parts = cookie.split(|&b| b == b';');
    let mut kept = parts.next().unwrap_or_default().to_vec();
    for attribute in parts {
        let name = attribute.split(|&b| b == b'=').next().unwrap_or_default().trim_ascii();
        if name.eq_ignore_ascii_case(b"domain") {
            continue;
        }
        kept.push(b';');
        kept.extend_from_slice(attribute);
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandboxs_cookie_stays_with_its_own_host() {
        let mut headers = HeaderMap::new();
        for cookie in [
            "s=x; Domain=sandbox.example; Path=/",
            "t=y; path=/; DOMAIN = .sandbox.example ; HttpOnly",
            "plain=1",
            "odd=a=b; Secure",
        ] {
            headers.append(SET_COOKIE, HeaderValue::from_static(cookie));
        }
        headers.append(
            SET_COOKIE,
            HeaderValue::from_bytes("name=é; Domain=x".as_bytes()).unwrap(),
        );
        headers.insert("x-kept", HeaderValue::from_static("1"));
        host_only_cookies(&mut headers);
        let cookies: Vec<_> = headers
            .get_all(SET_COOKIE)
            .iter()
            .map(|v| String::from_utf8(v.as_bytes().to_vec()).unwrap())
            .collect();
        assert_eq!(
            cookies,
            [
                "s=x; Path=/",
                "t=y; path=/; HttpOnly",
                "plain=1",
                "odd=a=b; Secure",
                "name=é"
            ]
        );
        assert!(headers.contains_key("x-kept"));
    }

    #[test]
    fn the_platforms_credentials_stay_out_of_sandboxes() {
        let mut headers = HeaderMap::new();
        headers.insert("x-admin-token", HeaderValue::from_static("admin"));
        headers.insert("x-api-key", HeaderValue::from_static("team"));
        headers.insert("authorization", HeaderValue::from_static("Basic x"));
        let mut envd = headers.clone();
        strip_credentials(&mut envd, Door::Envd);
        assert!(!envd.contains_key("x-admin-token") && !envd.contains_key("x-api-key"));
        assert!(envd.contains_key("authorization"), "envd's own user header");
        strip_credentials(&mut headers, Door::Port);
        assert!(!headers.contains_key("x-admin-token"));
        assert!(headers.contains_key("x-api-key"), "a tenant's app may use the name");
        assert!(!passes("X-Admin-Token", Door::Port) && passes("X-API-Key", Door::Port));
        assert!(!passes("X-API-Key", Door::Envd) && passes("content-type", Door::Envd));
    }
}
