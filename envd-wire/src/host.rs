//! Sandbox host names: `{port}-{sandboxID}.{domain}`, what the SDK's `get_host(port)` returns
//! and what a signed file URL points at when no `E2b-Sandbox-Id` header travels with it.

/// The port and sandbox ID a `Host` header names under `domain`, if it names one.
///
/// `domain` may carry a port (`localhost:3000`); the comparison ignores ASCII case, as DNS
/// does. `8000-abc.localhost:3000` under `localhost:3000` is port 8000 of sandbox `abc`.
pub fn parse<'h>(host: &'h str, domain: &str) -> Option<(u16, &'h str)> {
    if domain.is_empty() || host.len() <= domain.len() + 1 {
        return None;
    }
    let split = host.len() - domain.len();
    if !host.is_char_boundary(split) || !host[split..].eq_ignore_ascii_case(domain) {
        return None;
    }
    let label = host[..split].strip_suffix('.')?;
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    let valid_id = !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    (port != 0 && valid_id).then_some((port, id))
}

/// The host name of a sandbox's port under `domain`.
pub fn format(port: u16, sandbox_id: &str, domain: &str) -> String {
    format!("{port}-{sandbox_id}.{domain}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_host_names_its_port_and_id() {
        assert_eq!(
            parse("8000-abc123.localhost:3000", "localhost:3000"),
            Some((8000, "abc123"))
        );
        assert_eq!(parse("49983-ABC.E2B.example", "e2b.example"), Some((49983, "ABC")));
        assert_eq!(parse(&format(5, "x-y", "d.io"), "d.io"), Some((5, "x-y")));
    }

    #[test]
    fn other_hosts_name_nothing() {
        for host in [
            "localhost:3000",
            "127.0.0.1:3000",
            "abc.localhost:3000",
            "0-abc.localhost:3000",
            "70000-abc.localhost:3000",
            "8000-.localhost:3000",
            "8000-a/b.localhost:3000",
            "8000-abc.localhost:3001",
            "8000-abclocalhost:3000",
            "8000-abc.evil-localhost:3000",
            "é8000-abc.localhost:3000",
        ] {
            assert_eq!(parse(host, "localhost:3000"), None, "{host}");
        }
        assert_eq!(parse("8000-abc.", ""), None);
    }
}
