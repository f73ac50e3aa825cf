//! Where a sandbox's traffic may go: E2B's `allow_internet_access` and `network.allowOut` /
//! `network.denyOut`, checked once where a request enters and carried as a [`NetworkPolicy`]
//! through the manifest to the node that enforces it.
//!
//! The rules, as E2B states them:
//! - `allow_internet_access` (default true): false is the same as denying `0.0.0.0/0`;
//! - `denyOut`: CIDR blocks or bare addresses that traffic may not reach;
//! - `allowOut`: CIDR blocks or bare addresses that traffic may reach even where `denyOut`
//!   denies them ("allowed entries always take precedence").
//!
//! What this cluster does not do is refused by name, never silently ignored: domain names
//! (E2B resolves them in an egress proxy; nodes here filter addresses only) and IPv6 in
//! `allowOut` (sandboxes have IPv4 only; an IPv6 entry in `denyOut` is already true and is
//! dropped). Above every sandbox's own lists sits the node's floor (the host itself, other
//! sandboxes, the operator's `--egress-deny`), which no `allowOut` opens.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An IPv4 block, normalised (host bits zero): `10.0.0.0/8`, `8.8.8.8/32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    network: Ipv4Addr,
    prefix: u8,
}

/// Why an entry of a network rule list is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("{field} entry {entry:?} is a domain name: domain rules are not supported on this cluster (nodes filter IPv4 addresses and CIDR blocks)")]
    Domain { field: &'static str, entry: String },
    #[error("{field} entry {entry:?} is IPv6: sandboxes on this cluster have IPv4 only")]
    Ipv6 { field: &'static str, entry: String },
    #[error("{field} entry {entry:?} is not an IPv4 address or CIDR block ({reason})")]
    Invalid {
        field: &'static str,
        entry: String,
        reason: &'static str,
    },
    #[error("{field} has {count} entries; at most {MAX_ENTRIES} are allowed")]
    TooMany { field: &'static str, count: usize },
}

/// Entries a list may have: each becomes a kernel rule element.
pub const MAX_ENTRIES: usize = 256;

impl Cidr {
    /// Everything: `0.0.0.0/0`.
    pub const ANY: Cidr = Cidr {
        network: Ipv4Addr::UNSPECIFIED,
        prefix: 0,
    };

    pub fn new(addr: Ipv4Addr, prefix: u8) -> Option<Self> {
        (prefix <= 32).then(|| Cidr {
            network: Ipv4Addr::from(u32::from(addr) & Self::mask(prefix)),
            prefix,
        })
    }

    fn mask(prefix: u8) -> u32 {
        if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(prefix))
        }
    }

    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & Self::mask(self.prefix) == u32::from(self.network)
    }

    /// How many addresses the block holds.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }

    /// The `index`th address of the block, if it has one.
    pub fn nth(&self, index: u64) -> Option<Ipv4Addr> {
        (index < self.size()).then(|| Ipv4Addr::from(u32::from(self.network) + index as u32))
    }

    /// Parses one list entry, saying which list it came from when it is refused.
    pub fn parse_entry(field: &'static str, entry: &str) -> Result<Cidr, PolicyError> {
        let trimmed = entry.trim();
        let (addr, prefix) = match trimmed.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (trimmed, None),
        };
        let invalid = |reason| PolicyError::Invalid {
            field,
            entry: entry.to_string(),
            reason,
        };
        match IpAddr::from_str(addr) {
            Ok(IpAddr::V4(v4)) => {
                let prefix = match prefix {
                    None => 32,
                    Some(p) => p
                        .parse::<u8>()
                        .map_err(|_| invalid("the prefix length is not a number"))?,
                };
                Cidr::new(v4, prefix).ok_or_else(|| invalid("the prefix length is over 32"))
            }
            Ok(IpAddr::V6(_)) => Err(PolicyError::Ipv6 {
                field,
                entry: entry.to_string(),
            }),
            Err(_) if prefix.is_none() && looks_like_domain(trimmed) => Err(PolicyError::Domain {
                field,
                entry: entry.to_string(),
            }),
            Err(_) => Err(invalid("not an address")),
        }
    }
}

/// `example.com`, `*.example.com`: labels of letters, digits and hyphens, at least one dot
/// or a leading wildcard, not all digits (that would be a malformed address).
fn looks_like_domain(s: &str) -> bool {
    let s = s.strip_prefix("*.").unwrap_or(s);
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty() && label.len() <= 63 && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
        && s.chars().any(|c| c.is_ascii_alphabetic())
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Cidr::parse_entry("CIDR", s)
    }
}

impl Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A sandbox's egress, as its creator asked for it. A sandbox without one (`None` where it
/// is optional: records from before egress existed) has loopback only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkPolicy {
    /// E2B's `allow_internet_access`.
    pub internet: bool,
    /// Reachable even where denied.
    #[serde(default)]
    pub allow_out: Vec<Cidr>,
    /// Not reachable (unless allowed).
    #[serde(default)]
    pub deny_out: Vec<Cidr>,
}

impl Default for NetworkPolicy {
    /// E2B's default: the internet, no lists.
    fn default() -> Self {
        NetworkPolicy {
            internet: true,
            allow_out: Vec::new(),
            deny_out: Vec::new(),
        }
    }
}

impl NetworkPolicy {
    /// Checks a create request's network fields.
    pub fn from_request(
        internet: Option<bool>,
        allow_out: Option<&[String]>,
        deny_out: Option<&[String]>,
    ) -> Result<Self, PolicyError> {
        let allow_out = parse_list("network.allowOut", allow_out.unwrap_or_default(), false)?;
        let deny_out = parse_list("network.denyOut", deny_out.unwrap_or_default(), true)?;
        Ok(NetworkPolicy {
            internet: internet.unwrap_or(true),
            allow_out,
            deny_out,
        })
    }

    /// Whether the sandbox needs a link out at all: with no internet and nothing allowed it
    /// keeps loopback only, and no rule can be wrong.
    pub fn needs_link(&self) -> bool {
        self.internet || !self.allow_out.is_empty()
    }

    /// What is denied: `denyOut`, and everything when there is no internet access.
    pub fn denied(&self) -> Vec<Cidr> {
        if self.internet {
            self.deny_out.clone()
        } else {
            vec![Cidr::ANY]
        }
    }

    /// Whether the sandbox's own lists let traffic to `addr` out (the node's floor aside).
    pub fn permits(&self, addr: Ipv4Addr) -> bool {
        self.allow_out.iter().any(|c| c.contains(addr)) || !self.denied().iter().any(|c| c.contains(addr))
    }
}

fn parse_list(field: &'static str, entries: &[String], drop_ipv6: bool) -> Result<Vec<Cidr>, PolicyError> {
    if entries.len() > MAX_ENTRIES {
        return Err(PolicyError::TooMany {
            field,
            count: entries.len(),
        });
    }
    let mut out = Vec::with_capacity(entries.len());
    for entry in entries {
        match Cidr::parse_entry(field, entry) {
            Ok(cidr) => out.push(cidr),
            Err(PolicyError::Ipv6 { .. }) if drop_ipv6 => {}
            Err(e) => return Err(e),
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn entries_are_addresses_or_blocks_normalised() {
        assert_eq!(Cidr::parse_entry("f", "8.8.8.8").unwrap().to_string(), "8.8.8.8/32");
        assert_eq!(Cidr::parse_entry("f", " 10.1.2.3/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(Cidr::parse_entry("f", "0.0.0.0/0").unwrap(), Cidr::ANY);
        assert!(matches!(
            Cidr::parse_entry("f", "example.com"),
            Err(PolicyError::Domain { .. })
        ));
        assert!(matches!(
            Cidr::parse_entry("f", "*.example.com"),
            Err(PolicyError::Domain { .. })
        ));
        assert!(matches!(
            Cidr::parse_entry("f", "::1/128"),
            Err(PolicyError::Ipv6 { .. })
        ));
        for bad in ["10.0.0.0/33", "10.0.0/8", "1.2.3.4/x", "", "300.1.1.1", "a b"] {
            assert!(
                matches!(Cidr::parse_entry("f", bad), Err(PolicyError::Invalid { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn allowed_entries_take_precedence_over_denied_ones() {
        let closed = NetworkPolicy::from_request(Some(false), Some(&strings(&["1.1.1.1"])), None).unwrap();
        assert!(closed.needs_link());
        assert!(closed.permits("1.1.1.1".parse().unwrap()));
        assert!(!closed.permits("1.1.1.2".parse().unwrap()));
        let open = NetworkPolicy::from_request(None, None, Some(&strings(&["10.0.0.0/8", "fd00::/8"]))).unwrap();
        assert_eq!(
            open.deny_out,
            vec!["10.0.0.0/8".parse().unwrap()],
            "IPv6 denials are already true"
        );
        assert!(!open.permits("10.9.9.9".parse().unwrap()));
        assert!(open.permits("8.8.8.8".parse().unwrap()));
        let sealed = NetworkPolicy::from_request(Some(false), None, None).unwrap();
        assert!(!sealed.needs_link(), "no internet and nothing allowed: loopback only");
        let err = NetworkPolicy::from_request(None, Some(&strings(&["fd00::1"])), None).unwrap_err();
        assert!(err.to_string().contains("network.allowOut"), "{err}");
        let many = vec!["1.1.1.1".to_string(); MAX_ENTRIES + 1];
        assert!(matches!(
            NetworkPolicy::from_request(None, None, Some(&many)),
            Err(PolicyError::TooMany { .. })
        ));
    }

    #[test]
    fn a_policy_survives_json() {
        let policy = NetworkPolicy::from_request(Some(true), Some(&strings(&["1.2.3.0/24"])), None).unwrap();
        let json = serde_json::to_string(&policy).unwrap();
        assert!(json.contains("\"1.2.3.0/24\""), "{json}");
        assert_eq!(serde_json::from_str::<NetworkPolicy>(&json).unwrap(), policy);
        assert!(serde_json::from_str::<NetworkPolicy>(r#"{"internet":true,"allow_out":["nope"]}"#).is_err());
    }
}
