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
//! HTTP, which pulls use only for a registry on loopback, as one absolute-form request per
//! connection (the client pools connections per destination, so a connection to the proxy
//! carries one destination's requests).

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
/// How long a connection onward may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A running proxy; stops when dropped.
pub struct EgressProxy {
    address: SocketAddr,
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
        let destinations: Arc<dyn Destinations> = Arc::new(destinations);
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let destinations = destinations.clone();
                tokio::spawn(async move {
                    if let Err(why) = serve(client, destinations.as_ref()).await {
                        tracing::debug!(%why, "egress proxy: connection ended");
                    }
                });
            }
        });
        Ok(Self { address, task })
    }

    /// The proxy's URL, for an HTTP client's proxy settings.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }
}

/// One client connection: its request head read, its destination checked and connected,
/// then bytes both ways.
async fn serve(mut client: TcpStream, destinations: &dyn Destinations) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let end = loop {
        let mut chunk = [0u8; 1024];
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        if head.len() > MAX_HEAD {
            return refuse(
                &mut client,
                "431 Request Header Fields Too Large",
                "request head too large",
            )
            .await;
        }
    };
    let Some(request) = Request::parse(&head[..end]) else {
        return refuse(&mut client, "400 Bad Request", "not a proxy request").await;
    };
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
        // Whatever followed the CONNECT's head is the tunnel's first bytes.
        upstream.write_all(&head[end..]).await?;
    } else {
        upstream.write_all(&head).await?;
    }
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

/// Resolves `authority` and connects to the first address `destinations` allows; every
/// refused one is named in the answer when none is allowed.
async fn connect(authority: &str, destinations: &dyn Destinations) -> Result<TcpStream, Onward> {
    let host = authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = authority
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| Onward::Failed(format!("{authority} names no port")))?;
    let addresses: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| Onward::Failed(format!("{authority} does not resolve: {e}")))?
        .collect();
    let Some(address) = addresses.iter().find(|a| destinations.allowed(authority, a.ip())) else {
        return Err(Onward::Refused(format!(
            "{authority} resolves to {}, where a pull may not connect (an operator can allow a registry with --private-registries)",
            addresses
                .iter()
                .map(|a| a.ip().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    };
    tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
        .await
        .map_err(|_| Onward::Failed(format!("{authority} ({address}) did not answer in time")))?
        .map_err(|e| Onward::Failed(format!("{authority} ({address}): {e}")))
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
        let ask = |head: String| {
            let proxy = proxy.address;
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
