//! Name resolution for sandboxes: the node's DNS forwarder.
//!
//! Every sandbox's `/etc/resolv.conf` names one address, [`RESOLVER`], the same in every
//! sandbox and every template, so it survives snapshots and moves unchanged. Nothing listens
//! there. The host's packet filter redirects what a sandbox sends to it on port 53 (UDP and
//! TCP) to this forwarder, on a port of the host ([`port_of`]). The forwarder asks the host's
//! own resolvers (its `/etc/resolv.conf`, or `--sandbox-dns`) and relays the answers back.
//!
//! **Why a forwarder** rather than public resolvers written into every sandbox: a host whose
//! only resolver is private (a cloud's or a company's at 10.x, systemd-resolved at
//! 127.0.0.53) has it inside the floor no sandbox passes, and a closed network has no public
//! resolver at all. The forwarder runs on the host and asks from there. It relays DNS
//! messages to the configured resolvers and to nothing else, so it opens no other path to the
//! host.
//!
//! **Nodes sharing a host.** Nodes whose sandboxes come from one sandbox network listen on
//! the same port (`SO_REUSEPORT`): any of them answers, and when one stops the others still
//! do. The redirect lives in a table of its own per sandbox network ([`redirect_ruleset`]),
//! a pure function of that network, so a starting node replaces it with the same rules and a
//! dead node leaves nothing wrong behind. The same table drops every packet to the port that
//! was not redirected there: the forwarder answers sandboxes and nobody else. That table is
//! the wall, not a check of the source address in the forwarder: two sandbox networks whose
//! ports happen to coincide share one port, and the kernel spreads either network's queries
//! over both networks' forwarders.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use contracts::egress::Cidr;
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;

/// The resolver every sandbox's `/etc/resolv.conf` names. Link-local, so it is nobody's real
/// address, and it leaves the sandbox through its default route like any destination.
pub const RESOLVER: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 53);
/// The resolvers a host without any in its `/etc/resolv.conf` falls back to.
const PUBLIC: [Ipv4Addr; 2] = [Ipv4Addr::new(8, 8, 8, 8), Ipv4Addr::new(1, 1, 1, 1)];
/// How long one resolver has to answer before the next is asked.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a sandbox's TCP query connection may last.
const TCP_LIFETIME: Duration = Duration::from_secs(30);
/// UDP queries one sandbox may have in flight: past it its query is dropped (its resolver
/// library asks again). Each sandbox has its own budget, so one that floods the forwarder
/// sheds only its own queries, never another tenant's.
const QUERIES_PER_SANDBOX: usize = 32;
/// TCP query connections one sandbox may hold open at once (a resolver library opens one for
/// a truncated answer; holding hundreds idle is an attack on the others).
const CONNECTIONS_PER_SANDBOX: usize = 8;
/// Queries in flight over all sandboxes: the budgets of 128 sandboxes. A node with more that
/// all flood at once sheds; each query costs a task and a socket.
const MAX_QUERIES: usize = 128 * QUERIES_PER_SANDBOX;
/// TCP query connections over all sandboxes.
const MAX_CONNECTIONS: usize = 128 * CONNECTIONS_PER_SANDBOX;

/// Why sandboxes of this node cannot resolve names.
#[derive(Debug, thiserror::Error)]
pub enum ResolverError {
    #[error("listening on port {port}: {source}")]
    Listen { port: u16, source: std::io::Error },
    #[error("starting the forwarder: {0}")]
    Start(std::io::Error),
}

/// The host port the forwarder of `pool`'s sandboxes listens on: below the kernel's ephemeral
/// range (so no outgoing connection holds it), fixed for a pool so every node using the pool
/// agrees on it without talking.
pub fn port_of(pool: &Cidr) -> u16 {
    let spread = super::fnv1a(pool.to_string().as_bytes()) % 10_000;
    20_000 + u16::try_from(spread).unwrap_or(0)
}

/// The name of `pool`'s redirect table.
fn table_of(pool: &Cidr) -> String {
    format!(
        "sandboxsched_dns_{:08x}",
        super::fnv1a(pool.to_string().as_bytes()) as u32
    )
}

/// `pool`'s redirect table, as one nft transaction that replaces it whole: what its sandboxes
/// send to [`RESOLVER`] port 53 goes to the forwarder's `port`, and nothing else reaches that
/// port. Sandboxes' traffic is matched by the floor's interface prefix and the pool, so
/// another pool's sandboxes go to their own forwarder.
pub fn redirect_ruleset(pool: &Cidr, port: u16) -> String {
    let table = table_of(pool);
    let prefix = super::HOST_PREFIX;
    format!(
        "add table ip {table}
delete table ip {table}
table ip {table} {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname \"{prefix}*\" ip saddr {pool} ip daddr {RESOLVER} meta l4proto {{ tcp, udp }} th dport 53 redirect to :{port}
  }}
  chain input {{
    type filter hook input priority -20; policy accept;
    meta l4proto {{ tcp, udp }} th dport {port} ct status & dnat == 0 drop
  }}
}}
"
    )
}

/// The resolvers named in a `resolv.conf`, or the public ones when it names none.
pub fn upstreams_of(resolv_conf: &str) -> Vec<SocketAddr> {
    let named: Vec<SocketAddr> = resolv_conf
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("nameserver")).then(|| words.next()).flatten()
        })
        // A scoped IPv6 address (`fe80::1%eth0`) names an interface of the host: kept
        // without its scope it would be wrong, so it is left out.
        .filter_map(|address| address.parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .collect();
    if named.is_empty() {
        PUBLIC.iter().map(|ip| SocketAddr::new((*ip).into(), 53)).collect()
    } else {
        named
    }
}

/// The host's resolvers, from its `/etc/resolv.conf`.
pub fn host_upstreams() -> Vec<SocketAddr> {
    upstreams_of(&std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default())
}

/// The running forwarder. Dropping it stops it and closes its port.
pub struct Resolver {
    port: u16,
    upstreams: Vec<SocketAddr>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Resolver {
    /// Listens on [`port_of`] `pool` and forwards on a thread of its own (the node's runtime
    /// may be any, or none, where this is called).
    pub fn start(pool: Cidr, upstreams: Vec<SocketAddr>) -> Result<Resolver, ResolverError> {
        let port = port_of(&pool);
        let listen = |source| ResolverError::Listen { port, source };
        let udp = bind(port, socket2::Type::DGRAM).map_err(listen)?;
        let tcp = bind(port, socket2::Type::STREAM).map_err(listen)?;
        tcp.listen(128).map_err(listen)?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let asked = upstreams.clone();
        std::thread::Builder::new()
            .name("sandbox-dns".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .enable_time()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(err) => return tracing::error!(%err, "sandboxes' DNS forwarder did not start"),
                };
                runtime.block_on(async move {
                    let forwarder = Forwarder::new(asked, udp.into(), tcp.into());
                    match forwarder {
                        Ok(forwarder) => forwarder.serve(stopped).await,
                        Err(err) => tracing::error!(%err, "sandboxes' DNS forwarder did not start"),
                    }
                });
            })
            .map_err(ResolverError::Start)?;
        Ok(Resolver {
            port,
            upstreams,
            stop: Some(stop),
        })
    }

    /// The host port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The resolvers it asks.
    pub fn upstreams(&self) -> &[SocketAddr] {
        &self.upstreams
    }
}

impl Drop for Resolver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A non-blocking IPv4 socket on `0.0.0.0:port`, shared with the other nodes of the pool.
fn bind(port: u16, kind: socket2::Type) -> std::io::Result<socket2::Socket> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, kind, None)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())?;
    Ok(socket)
}

struct Forwarder {
    upstreams: Arc<[SocketAddr]>,
    udp: Arc<UdpSocket>,
    tcp: TcpListener,
}

impl Forwarder {
    fn new(
        upstreams: Vec<SocketAddr>,
        udp: std::net::UdpSocket,
        tcp: std::net::TcpListener,
    ) -> std::io::Result<Forwarder> {
        Ok(Forwarder {
            upstreams: upstreams.into(),
            udp: Arc::new(UdpSocket::from_std(udp)?),
            tcp: TcpListener::from_std(tcp)?,
        })
    }

    /// Answers until `stopped`; queries in flight are dropped with the thread's runtime.
    async fn serve(self, mut stopped: tokio::sync::oneshot::Receiver<()>) {
        let queries = Arc::new(Semaphore::new(MAX_QUERIES));
        let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let sandbox_queries = Budgets::new(QUERIES_PER_SANDBOX);
        let sandbox_connections = Budgets::new(CONNECTIONS_PER_SANDBOX);
        let mut buf = vec![0u8; 65_535];
        loop {
            tokio::select! {
                _ = &mut stopped => return,
                received = self.udp.recv_from(&mut buf) => {
                    let Ok((len, peer)) = received else { continue };
                    let Some(own) = sandbox_queries.take(peer.ip()) else {
                        counted("udp", "shed");
                        continue;
                    };
                    let Ok(permit) = queries.clone().try_acquire_owned() else {
                        counted("udp", "shed");
                        continue;
                    };
                    let (query, udp, upstreams) = (buf[..len].to_vec(), self.udp.clone(), self.upstreams.clone());
                    tokio::spawn(async move {
                        match ask(&query, &upstreams).await {
                            Some(answer) => {
                                let _ = udp.send_to(&answer, peer).await;
                                counted("udp", "answered");
                            }
                            None => counted("udp", "unanswered"),
                        }
                        drop((permit, own));
                    });
                }
                accepted = self.tcp.accept() => {
                    let Ok((stream, peer)) = accepted else { continue };
                    let Some(own) = sandbox_connections.take(peer.ip()) else {
                        counted("tcp", "shed");
                        continue;
                    };
                    let Ok(permit) = connections.clone().try_acquire_owned() else {
                        counted("tcp", "shed");
                        continue;
                    };
                    let upstreams = self.upstreams.clone();
                    tokio::spawn(async move {
                        let relayed = tokio::time::timeout(TCP_LIFETIME, relay(stream, &upstreams)).await;
                        counted("tcp", if matches!(relayed, Ok(true)) { "answered" } else { "unanswered" });
                        drop((permit, own));
                    });
                }
            }
        }
    }
}

/// What each sandbox (by its address: the redirect keeps the sender's) has in use, against
/// one budget per sandbox.
#[derive(Clone)]
struct Budgets {
    per_sandbox: usize,
    in_use: Arc<std::sync::Mutex<std::collections::HashMap<IpAddr, usize>>>,
}

/// One unit of a sandbox's budget, given back when dropped.
struct Taken {
    budgets: Budgets,
    sandbox: IpAddr,
}

impl Budgets {
    fn new(per_sandbox: usize) -> Self {
        Self {
            per_sandbox,
            in_use: Arc::default(),
        }
    }

    fn in_use(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<IpAddr, usize>> {
        self.in_use.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A unit of `sandbox`'s budget, if it has one left.
    fn take(&self, sandbox: IpAddr) -> Option<Taken> {
        let mut in_use = self.in_use();
        let used = in_use.entry(sandbox).or_insert(0);
        if *used >= self.per_sandbox {
            return None;
        }
        *used += 1;
        Some(Taken {
            budgets: self.clone(),
            sandbox,
        })
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        let mut in_use = self.budgets.in_use();
        if let Some(used) = in_use.get_mut(&self.sandbox) {
            *used -= 1;
            if *used == 0 {
                in_use.remove(&self.sandbox);
            }
        }
    }
}

/// Asks each resolver in turn until one answers `query` (a DNS message over UDP); the answer
/// must carry the query's ID.
async fn ask(query: &[u8], upstreams: &[SocketAddr]) -> Option<Vec<u8>> {
    let id = query.get(..2)?;
    for upstream in upstreams {
        let local: SocketAddr = if upstream.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let Ok(socket) = UdpSocket::bind(local).await else {
            continue;
        };
        if socket.connect(upstream).await.is_err() || socket.send(query).await.is_err() {
            continue;
        }
        let mut answer = vec![0u8; 65_535];
        if let Ok(Ok(len)) = tokio::time::timeout(ASK_TIMEOUT, socket.recv(&mut answer)).await {
            if answer.get(..2) == Some(id) {
                answer.truncate(len);
                return Some(answer);
            }
        }
    }
    None
}

/// Joins a sandbox's TCP query connection to the first resolver that accepts one; whether
/// one did.
async fn relay(mut stream: TcpStream, upstreams: &[SocketAddr]) -> bool {
    for upstream in upstreams {
        if let Ok(Ok(mut resolver)) = tokio::time::timeout(ASK_TIMEOUT, TcpStream::connect(upstream)).await {
            let _ = tokio::io::copy_bidirectional(&mut stream, &mut resolver).await;
            return true;
        }
    }
    let _ = stream.shutdown().await;
    false
}

/// Counts a query (UDP) or query connection (TCP) in `node_sandbox_dns_queries_total`:
/// `answered`, `unanswered` (no resolver answered in time) or `shed` (too many at once).
fn counted(transport: &'static str, outcome: &'static str) {
    metrics::counter!("node_sandbox_dns_queries_total", "transport" => transport, "outcome" => outcome).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_resolvers_are_asked_and_public_ones_only_when_it_names_none() {
        let conf = "# generated\nsearch corp.example\nnameserver 10.255.255.53\nnameserver  ::1\nnameserver fe80::1%eth0\noptions ndots:2\n";
        assert_eq!(
            upstreams_of(conf),
            vec!["10.255.255.53:53".parse().unwrap(), "[::1]:53".parse().unwrap()]
        );
        assert_eq!(
            upstreams_of("search x\n"),
            vec!["8.8.8.8:53".parse().unwrap(), "1.1.1.1:53".parse().unwrap()]
        );
    }

    #[test]
    fn a_pool_has_one_port_and_one_table_and_the_port_takes_only_redirected_queries() {
        let pool: Cidr = "10.200.0.0/16".parse().unwrap();
        let other: Cidr = "10.201.0.0/16".parse().unwrap();
        assert_eq!(port_of(&pool), port_of(&"10.200.0.0/16".parse().unwrap()));
        assert!((20_000..30_000).contains(&port_of(&pool)));
        assert_ne!(table_of(&pool), table_of(&other));
        let rules = redirect_ruleset(&pool, 23_456);
        assert!(rules.starts_with(&format!("add table ip {0}\ndelete table ip {0}\n", table_of(&pool))));
        assert!(rules.contains(
            "iifname \"sbx*\" ip saddr 10.200.0.0/16 ip daddr 169.254.0.53 meta l4proto { tcp, udp } th dport 53 redirect to :23456"
        ));
        assert!(rules.contains("th dport 23456 ct status & dnat == 0 drop"));
    }

    #[test]
    fn each_sandbox_has_its_own_budget() {
        let budgets = Budgets::new(2);
        let (a, b): (IpAddr, IpAddr) = ("10.200.0.2".parse().unwrap(), "10.200.0.3".parse().unwrap());
        let first = budgets.take(a).unwrap();
        let _second = budgets.take(a).unwrap();
        assert!(budgets.take(a).is_none(), "a sandbox went past its budget");
        assert!(budgets.take(b).is_some(), "one sandbox's use shed another's");
        drop(first);
        assert!(budgets.take(a).is_some(), "a finished query gave nothing back");
    }

    /// The attack on shared limits: one sandbox opens TCP query connections and holds them
    /// idle. Past its own budget its connections are closed at once, and another sandbox's
    /// query is still answered.
    #[tokio::test]
    async fn a_sandbox_holding_connections_sheds_only_its_own() {
        use tokio::io::AsyncReadExt;
        // A resolver that answers every TCP query with a fixed message.
        let resolver = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = resolver.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = resolver.accept().await {
                tokio::spawn(async move {
                    let mut query = [0u8; 64];
                    if s.read(&mut query).await.unwrap_or(0) > 0 {
                        let _ = s.write_all(b"\x00\x02ok").await;
                    }
                });
            }
        });
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        tcp.set_nonblocking(true).unwrap();
        udp.set_nonblocking(true).unwrap();
        let at = tcp.local_addr().unwrap();
        let forwarder = Forwarder::new(vec![upstream], udp, tcp).unwrap();
        let (_stop, stopped) = tokio::sync::oneshot::channel();
        tokio::spawn(forwarder.serve(stopped));

        // Loopback's other addresses stand for two sandboxes.
        let from = |ip: &str| {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
            socket.connect(at)
        };
        let mut held = Vec::new();
        for _ in 0..CONNECTIONS_PER_SANDBOX {
            held.push(from("127.0.0.2").await.unwrap());
        }
        // The forwarder takes connections in the order they arrived: by the time it reaches
        // this one, the eight before it hold the sandbox's whole budget.
        let mut over = from("127.0.0.2").await.unwrap();
        let mut buf = [0u8; 8];
        let closed = tokio::time::timeout(Duration::from_secs(2), over.read(&mut buf)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "the ninth connection was kept: {closed:?}"
        );

        let mut other = from("127.0.0.3").await.unwrap();
        other.write_all(b"\x00\x05query").await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(2), other.read(&mut buf))
            .await
            .expect("another sandbox's query was shed")
            .unwrap();
        assert_eq!(&buf[..n], b"\x00\x02ok");
        drop(held);
    }

    #[tokio::test]
    async fn a_query_goes_to_the_first_resolver_that_answers_with_its_id() {
        let silent = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let wrong = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let right = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let (wrong_at, right_at) = (wrong.local_addr().unwrap(), right.local_addr().unwrap());
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let (_, peer) = wrong.recv_from(&mut buf).await.unwrap();
            wrong.send_to(b"\xff\xffspoofed", peer).await.unwrap();
        });
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let (len, peer) = right.recv_from(&mut buf).await.unwrap();
            let mut answer = buf[..len].to_vec();
            answer.extend_from_slice(b" answered");
            right.send_to(&answer, peer).await.unwrap();
        });
        // The silent one costs its whole timeout; a wrong ID moves on at once.
        let upstreams = [silent.local_addr().unwrap(), wrong_at, right_at];
        let answer = ask(b"\x12\x34query", &upstreams).await.unwrap();
        assert_eq!(answer, b"\x12\x34query answered");
    }
}
