//! A forward proxy on loopback through which a pull makes every connection, so that each
//! one, not only the first, is checked against where the puller may go.
//!
//! An image reference names its registry, and a node can check that name before it pulls.
//! But the registry then decides where the pull goes next: a redirect (registries send blobs
//! to a CDN this way), the `realm` of a `WWW-Authenticate` challenge (where the token is
//! fetched, with the tenant's credentials), a layer's `urls`. The HTTP client follows all of
//! these on its own, so a registry of the tenant's could point the node, on the node's own
//! network, at the control plane or a cloud's metadata service, and read the answer back in
//! the build's error. Routed through this proxy, every connection is one the proxy makes
//! itself, to an address it has resolved and checked ([`Destinations`]): a name that resolves
//! to an address the floor refuses is refused, whatever asked for it, and the address checked
//! is the one connected to (a name cannot change its answer in between).
//!
//! HTTPS goes through as `CONNECT host:port` (the proxy sees only where, never what); plain
//! HTTP, which pulls use only for a registry on loopback, as absolute-form requests, the
//! connection then spliced to the first request's destination (the client pools connections
//! per destination; whatever else came on it would still reach only the checked address).
//!
//! The proxy is the pull's alone: its URL carries a random password which every request must
//! present (`Proxy-Authorization`), so another user of the host cannot borrow the node's way
//! out while a pull runs; the password is taken out of what goes on. Its connections end with
//! it (with the pull), at most [`MAX_CONNECTIONS`] at once, and a client has [`HEAD_TIMEOUT`]
//! to say where it goes.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Where a pull may connect: `authority` (`host:port`, as the client asked) resolved to `ip`.
pub trait Destinations: Send + Sync + 'static {
    fn allowed(&self, authority: &str, ip: IpAddr) -> bool;
}

impl<F: Fn(&str, IpAddr) -> bool + Send + Sync + 'static> Destinations for F {
    fn allowed(&self, authority: &str, ip: IpAddr) -> bool {
        self(authority, ip)
    }
}

/// The longest request head accepted from the client.
const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send its request's head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long resolving a name, and each connection onward, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections through the proxy at once (a pull fetches three layers at a time).
pub const MAX_CONNECTIONS: usize = 32;

/// A running proxy; stops when dropped, and every connection through it with it.
pub struct EgressProxy {
    address: SocketAddr,
    password: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl EgressProxy {
    /// Listens on a free loopback port, allowing what `destinations` allows.
    pub async fn start(destinations: impl Destinations) -> std::io::Result<Self> {
        let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let address = listener.local_addr()?;
        let password = random_password()?;
        let expected: Arc<str> = Arc::from(basic_credentials(&password));
        let destinations: Arc<dyn Destinations> = Arc::new(destinations);
        let task = tokio::spawn(async move {
            // Every connection's task is in this set, dropped (so aborted) with this task.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let accepted = listener.accept().await;
                while connections.try_join_next().is_some() {}
                let client = match accepted {
                    Ok((client, _)) => client,
                    Err(why) => {
                        // Out of descriptors, say: wait rather than spin.
                        tracing::warn!(%why, "egress proxy: cannot accept");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                if connections.len() >= MAX_CONNECTIONS {
                    continue;
                }
                let (destinations, expected) = (destinations.clone(), expected.clone());
                connections.spawn(async move {
                    if let Err(why) = serve(client, destinations.as_ref(), &expected).await {
                        tracing::debug!(%why, "egress proxy: connection ended");
                    }
                });
            }
        });
        Ok(Self {
            address,
            password,
            task,
        })
    }

    /// The proxy's URL, its credentials in it, for an HTTP client's proxy settings.
    pub fn url(&self) -> String {
        format!("http://pull:{}@{}", self.password, self.address)
    }
}

/// 32 random hex digits, from the kernel.
fn random_password() -> std::io::Result<String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The `Proxy-Authorization` value a client sends as user `pull` with `password`.
fn basic_credentials(password: &str) -> String {
    use base64::Engine as _;
    let pair = format!("pull:{password}");
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair))
}

/// Whether a request head carries `expected` as its `Proxy-Authorization` (compared in
/// constant time), and the head without that header.
fn authorized(head: &[u8], expected: &str) -> (bool, Vec<u8>) {
    let mut shown = false;
    let mut kept = Vec::with_capacity(head.len());
    for line in head.split_inclusive(|&b| b == b'\n') {
        if let Some(colon) = line.iter().position(|&b| b == b':') {
            if line[..colon].trim_ascii().eq_ignore_ascii_case(b"proxy-authorization") {
                use subtle::ConstantTimeEq as _;
                shown |= bool::from(line[colon + 1..].trim_ascii().ct_eq(expected.as_bytes()));
                continue;
            }
        }
        kept.extend_from_slice(line);
    }
    (shown, kept)
}

/// Reads a request's head; returns it with what came after it, or `None` when the client
/// closed first or sent more than [`MAX_HEAD`] without ending it.
async fn read_head(client: &mut TcpStream) -> std::io::Result<Option<(Vec<u8>, Vec<u8>)>> {
    let mut head = Vec::with_capacity(1024);
    loop {
        let mut chunk = [0u8; 1024];
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = head.split_off(end + 4);
            return Ok(Some((head, rest)));
        }
        if head.len() > MAX_HEAD {
            return Ok(None);
        }
    }
}

/// One client connection: its request head read, its credentials and destination checked,
/// then bytes both ways.
async fn serve(mut client: TcpStream, destinations: &dyn Destinations, expected: &str) -> std::io::Result<()> {
    let Ok(read) = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut client)).await else {
        return refuse(&mut client, "408 Request Timeout", "no request in time").await;
    };
    let Some((head, rest)) = read? else {
        return refuse(&mut client, "400 Bad Request", "no whole request head").await;
    };
    let Some(request) = Request::parse(&head) else {
        return refuse(&mut client, "400 Bad Request", "not a proxy request").await;
    };
    let (shown, head) = authorized(&head, expected);
    if !shown {
        return refuse(
            &mut client,
            "407 Proxy Authentication Required",
            "this proxy is one pull's alone",
        )
        .await;
    }
    let mut upstream = match connect(&request.authority, destinations).await {
        Ok(upstream) => upstream,
        Err(Onward::Refused(why)) => {
            tracing::warn!(authority = %request.authority, %why, "egress proxy: a pull was sent where it may not go");
            return refuse(&mut client, "403 Forbidden", &why).await;
        }
        Err(Onward::Failed(why)) => return refuse(&mut client, "502 Bad Gateway", &why).await,
    };
    if request.tunnel {
        client.write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n").await?;
    } else {
        upstream.write_all(&head).await?;
    }
    // Whatever followed the head: a tunnel's first bytes, or a request's body.
    upstream.write_all(&rest).await?;
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await?;
    Ok(())
}

/// What a client asked the proxy for.
#[derive(Debug, PartialEq, Eq)]
struct Request {
    /// `host:port` to connect to.
    authority: String,
    /// `CONNECT` (a tunnel), else one plain HTTP request in absolute form.
    tunnel: bool,
}

impl Request {
    fn parse(head: &[u8]) -> Option<Self> {
        let line = head.split(|&b| b == b'\r').next()?;
        let line = std::str::from_utf8(line).ok()?;
        let mut parts = line.split(' ');
        let (method, target) = (parts.next()?, parts.next()?);
        if method == "CONNECT" {
            let (host, port) = target.rsplit_once(':')?;
            port.parse::<u16>().ok()?;
            return (!host.is_empty()).then(|| Request {
                authority: target.to_string(),
                tunnel: true,
            });
        }
        let rest = target.strip_prefix("http://")?;
        let authority = rest.split('/').next().filter(|a| !a.is_empty() && !a.contains('@'))?;
        let authority = if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        Some(Request {
            authority,
            tunnel: false,
        })
    }
}

/// Why no connection onward was made.
enum Onward {
    /// Where the pull may not go.
    Refused(String),
    /// Where it may, but that failed (no such name, nothing listening, no answer in time).
    Failed(String),
}

/// Resolves `authority` and connects to the addresses `destinations` allows, in turn, until
/// one answers; every refused one is named in the answer when none is allowed.
async fn connect(authority: &str, destinations: &dyn Destinations) -> Result<TcpStream, Onward> {
    let (host, port) = authority
        .rsplit_once(':')
        .ok_or_else(|| Onward::Failed(format!("{authority} names no port")))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port
        .parse::<u16>()
        .map_err(|_| Onward::Failed(format!("{authority} names no port")))?;
    let addresses: Vec<SocketAddr> = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::lookup_host((host, port)))
        .await
        .map_err(|_| Onward::Failed(format!("{authority} did not resolve in time")))?
        .map_err(|e| Onward::Failed(format!("{authority} does not resolve: {e}")))?
        .collect();
    let allowed: Vec<&SocketAddr> = addresses
        .iter()
        .filter(|a| destinations.allowed(authority, a.ip()))
        .collect();
    if allowed.is_empty() {
        return Err(Onward::Refused(format!(
            "{authority} resolves to {}, where a pull may not connect (an operator can allow a registry with --private-registries)",
            addresses
                .iter()
                .map(|a| a.ip().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let mut last = String::new();
    for address in allowed {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address)).await {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(e)) => last = format!("{authority} ({address}): {e}"),
            Err(_) => last = format!("{authority} ({address}) did not answer in time"),
        }
    }
    Err(Onward::Failed(last))
}

async fn refuse(client: &mut TcpStream, status: &str, why: &str) -> std::io::Result<()> {
    let answer = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{why}",
        why.len()
    );
    client.write_all(answer.as_bytes()).await?;
    client.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pulls_credentials_are_checked_and_go_no_further() {
        let expected = basic_credentials("secret");
        let head = format!("GET http://r/ HTTP/1.1\r\nHost: r\r\nproxy-authorization:  {expected} \r\n\r\n");
        let (shown, kept) = authorized(head.as_bytes(), &expected);
        assert!(shown);
        assert_eq!(kept, b"GET http://r/ HTTP/1.1\r\nHost: r\r\n\r\n");
        let wrong = head.replace(&expected, &basic_credentials("guess"));
        assert!(!authorized(wrong.as_bytes(), &expected).0);
        assert!(!authorized(b"GET http://r/ HTTP/1.1\r\n\r\n", &expected).0);
    }

    #[test]
    fn requests_name_their_destination() {
        let parse = |head: &str| Request::parse(head.as_bytes());
        assert_eq!(
            parse("CONNECT registry-1.docker.io:443 HTTP/1.1\r\nHost: x\r\n\r\n"),
            Some(Request {
                authority: "registry-1.docker.io:443".into(),
                tunnel: true
            })
        );
        assert_eq!(
            parse("GET http://127.0.0.1:5056/v2/ HTTP/1.1\r\n\r\n")
                .unwrap()
                .authority,
            "127.0.0.1:5056"
        );
        assert_eq!(
            parse("GET http://reg.example/v2/ HTTP/1.1\r\n\r\n").unwrap().authority,
            "reg.example:80"
        );
        for bad in [
            "GET /v2/ HTTP/1.1\r\n\r\n",
            "CONNECT host HTTP/1.1\r\n\r\n",
            "CONNECT :443 HTTP/1.1\r\n\r\n",
            "GET http://user@evil/ HTTP/1.1\r\n\r\n",
            "GET http:///x HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    /// A client told to use the proxy reaches an allowed destination, and not a refused one,
    /// whichever way it asks (a tunnel or a plain request).
    #[tokio::test]
    async fn only_allowed_destinations_are_reached() {
        let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = server.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    let _ = s.read(&mut buf).await;
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
                        .await;
                });
            }
        });
        let allowed = format!("127.0.0.1:{port}");
        let only = allowed.clone();
        let proxy = EgressProxy::start(move |authority: &str, _ip: IpAddr| authority == only)
            .await
            .unwrap();
        let credentials = basic_credentials(&proxy.password);
        let ask = |head: String| {
            let proxy = proxy.address;
            // The pull's own credentials, as reqwest sends them from the proxy's URL.
            let head = head.replacen("\r\n", &format!("\r\nProxy-Authorization: {credentials}\r\n"), 1);
            async move {
                let mut s = TcpStream::connect(proxy).await.unwrap();
                s.write_all(head.as_bytes()).await.unwrap();
                let mut answer = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer)).await;
                String::from_utf8_lossy(&answer).into_owned()
            }
        };
        let plain = ask(format!("GET http://{allowed}/ HTTP/1.1\r\nHost: {allowed}\r\n\r\n")).await;
        assert!(plain.ends_with("hello"), "{plain}");
        let tunnel = ask(format!(
            "CONNECT {allowed} HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\nHost: {allowed}\r\n\r\n"
        ))
        .await;
        assert!(
            tunnel.starts_with("HTTP/1.1 200 Connection Established") && tunnel.ends_with("hello"),
            "{tunnel}"
        );
        // Without the pull's password (another user of the host): refused, never reached.
        let mut s = TcpStream::connect(proxy.address).await.unwrap();
        s.write_all(format!("GET http://{allowed}/ HTTP/1.1\r\nHost: {allowed}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.starts_with("HTTP/1.1 407") && !answer.contains("hello"),
            "{answer}"
        );
        assert!(proxy.url().contains(&format!("pull:{}@", proxy.password)));
        // The same server by another name is another destination: refused, never reached.
        for head in [
            format!("GET http://localhost:{port}/ HTTP/1.1\r\n\r\n"),
            format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n"),
        ] {
            let refused = ask(head).await;
            assert!(refused.starts_with("HTTP/1.1 403"), "{refused}");
            assert!(!refused.contains("hello"), "{refused}");
        }
    }
}
