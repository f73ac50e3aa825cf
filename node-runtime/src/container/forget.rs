//! Forgetting a sandbox's connections, before its network slot goes to the next sandbox: the
//! host's connection-tracking entries of its address ([`conntrack`]) and what the slot's
//! namespace learnt of its peers ([`tcp_metrics`]).
//!
//! **Conntrack.** The host masquerades what a sandbox sends, and remembers each flow in its connection
//! tracking table (conntrack) so replies find their way back. That memory outlives the sandbox:
//! an established TCP flow is kept for days. A network slot handed to the next sandbox keeps
//! its address, so a reply to the old sandbox's flow (or a peer still sending on it) would be
//! translated back to that address and delivered to the new sandbox, through the floor's
//! "established" rule. So before a slot is used again, every entry whose original direction
//! starts or ends at its address is deleted; what then arrives for the old flow is a new flow
//! to the host's own address, which no rule forwards to a sandbox.
//!
//! The table is read and changed over ctnetlink (netfilter's netlink family): one dump, the
//! entries filtered here, each matching one deleted by its original tuple, which is sent back
//! exactly as the kernel gave it. A few message layouts of `<linux/netfilter/nfnetlink.h>`
//! and `nfnetlink_conntrack.h` are all it takes; no conntrack tool needs to be installed.
//!
//! **TCP metrics.** A network namespace caches, per peer address, what TCP learnt of the path
//! (round-trip time, congestion window, Fast Open cookies), and any process inside may list it
//! (`ip tcp_metrics`: reading needs no privilege). Left in a slot, the next sandbox would read
//! which addresses the last one talked to. The cache is flushed whole, over generic netlink.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;

/// `IPCTNL_MSG_CT_GET` and `IPCTNL_MSG_CT_DELETE` of conntrack's subsystem
/// (`NFNL_SUBSYS_CTNETLINK`, the high byte).
const CTNETLINK_GET: u16 = 1 << 8 | 1;
const CTNETLINK_DELETE: u16 = 1 << 8 | 2;
/// `nfgenmsg` for IPv4: family, version (`NFNETLINK_V0`), resource id (unused).
const IPV4: [u8; NFGEN] = [libc::AF_INET as u8, 0, 0, 0];
/// The generic netlink controller, its `CTRL_CMD_GETFAMILY` and attributes.
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
/// `TCP_METRICS_CMD_DEL` of `<linux/tcp_metrics.h>`.
const TCP_METRICS_CMD_DEL: u8 = 2;
/// `CTA_TUPLE_ORIG` and `CTA_ZONE`: an entry's original direction and its zone.
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_ZONE: u16 = 18;
/// Inside a tuple, `CTA_TUPLE_IP`; inside that, `CTA_IP_V4_SRC` and `CTA_IP_V4_DST`.
const CTA_TUPLE_IP: u16 = 1;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// An attribute type's flag bits (`NLA_F_NESTED`, `NLA_F_NET_BYTEORDER`), not its number.
const NLA_TYPE_MASK: u16 = 0x3fff;
/// `nlmsghdr` and `nfgenmsg`.
const HEADER: usize = 16;
const NFGEN: usize = 4;
/// `genlmsghdr`.
const GENL: usize = 4;
/// How long an answer from the kernel is waited for.
const RECV_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Deletes every IPv4 conntrack entry of this thread's network namespace whose original
/// direction has one of `addresses` as its source or destination; how many went.
pub fn conntrack(addresses: &[Ipv4Addr]) -> io::Result<usize> {
    if addresses.is_empty() {
        return Ok(0);
    }
    let socket = open(rustix::net::netlink::NETFILTER)?;
    let mut doomed = Vec::new();
    let mut seq = 1;
    request(&socket, CTNETLINK_GET, NLM_F_REQUEST | NLM_F_DUMP, seq, &IPV4)?;
    let mut buffer = vec![0u8; 64 * 1024];
    'dump: loop {
        let len = rustix::net::recv(&socket, &mut buffer[..], rustix::net::RecvFlags::empty())?.0;
        for (kind, body) in messages(&buffer[..len]) {
            match kind {
                // A dump cut short says so in its end's error code.
                NLMSG_DONE => match error_code(body) {
                    code if code < 0 && body.len() >= 4 => return Err(errno_of(code)),
                    _ => break 'dump,
                },
                NLMSG_ERROR => {
                    let code = error_code(body);
                    if code != 0 {
                        return Err(errno_of(code));
                    }
                }
                _ => {
                    if let Some(entry) = body.get(NFGEN..).and_then(|attrs| matching(attrs, addresses)) {
                        doomed.push(entry);
                    }
                }
            }
        }
        if len == 0 {
            break;
        }
    }
    let mut gone = 0;
    for entry in doomed {
        seq += 1;
        request(
            &socket,
            CTNETLINK_DELETE,
            NLM_F_REQUEST | NLM_F_ACK,
            seq,
            &[&IPV4[..], &entry].concat(),
        )?;
        match acknowledged(&socket, &mut buffer) {
            Ok(()) => gone += 1,
            // Expired or deleted by someone else since the dump.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(gone)
}

/// Flushes the TCP metrics cache of this thread's network namespace.
pub fn tcp_metrics() -> io::Result<()> {
    let socket = open(rustix::net::netlink::GENERIC)?;
    let mut buffer = vec![0u8; 8 * 1024];
    // The family's number, asked of the generic netlink controller by name.
    let name = attr(CTRL_ATTR_FAMILY_NAME, b"tcp_metrics\0");
    request(
        &socket,
        GENL_ID_CTRL,
        NLM_F_REQUEST,
        1,
        &[&genl(CTRL_CMD_GETFAMILY)[..], &name].concat(),
    )?;
    let len = rustix::net::recv(&socket, &mut buffer[..], rustix::net::RecvFlags::empty())?.0;
    let (kind, body) = messages(&buffer[..len])
        .next()
        .ok_or_else(|| io::Error::other("generic netlink: no answer"))?;
    if kind == NLMSG_ERROR {
        // No such family: a kernel without TCP metrics has nothing to flush.
        let code = error_code(body);
        return if code == -libc::ENOENT {
            Ok(())
        } else {
            Err(errno_of(code))
        };
    }
    let family = body
        .get(GENL..)
        .and_then(|attrs| attributes(attrs).find(|(kind, _, _)| *kind == CTRL_ATTR_FAMILY_ID))
        .and_then(|(_, _, id)| <[u8; 2]>::try_from(id).ok())
        .map(u16::from_ne_bytes)
        .ok_or_else(|| io::Error::other("generic netlink: tcp_metrics has no family number"))?;
    // A delete naming no address flushes them all.
    request(
        &socket,
        family,
        NLM_F_REQUEST | NLM_F_ACK,
        2,
        &genl(TCP_METRICS_CMD_DEL),
    )?;
    acknowledged(&socket, &mut buffer)
}

/// The answer to a request sent with `NLM_F_ACK`: its error, if it has one.
fn acknowledged(socket: &OwnedFd, buffer: &mut [u8]) -> io::Result<()> {
    let len = rustix::net::recv(socket, &mut *buffer, rustix::net::RecvFlags::empty())?.0;
    match messages(&buffer[..len]).find(|(kind, _)| *kind == NLMSG_ERROR) {
        Some((_, body)) => match error_code(body) {
            0 => Ok(()),
            code => Err(errno_of(code)),
        },
        None => Err(io::Error::other("netlink: no acknowledgement")),
    }
}

/// A generic netlink header for `cmd`, version 1.
fn genl(cmd: u8) -> [u8; GENL] {
    [cmd, 1, 0, 0]
}

fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(align(4 + payload.len()));
    out.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize(align(out.len()), 0);
    out
}

fn open(protocol: rustix::net::Protocol) -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let socket = rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::RAW,
        SocketFlags::CLOEXEC,
        Some(protocol),
    )?;
    // A kernel that never answers must not hold the slots' worker (and a node's stop) forever.
    rustix::net::sockopt::set_socket_timeout(&socket, rustix::net::sockopt::Timeout::Recv, Some(RECV_TIMEOUT))?;
    Ok(socket)
}

/// Sends one netlink message of type `kind` to the kernel, `payload` after its header.
fn request(socket: &OwnedFd, kind: u16, flags: u16, seq: u32, payload: &[u8]) -> io::Result<()> {
    let len = HEADER + payload.len();
    let mut message = Vec::with_capacity(len);
    message.extend_from_slice(&(len as u32).to_ne_bytes());
    message.extend_from_slice(&kind.to_ne_bytes());
    message.extend_from_slice(&flags.to_ne_bytes());
    message.extend_from_slice(&seq.to_ne_bytes());
    message.extend_from_slice(&0u32.to_ne_bytes());
    message.extend_from_slice(payload);
    let sent = rustix::net::send(socket, &message, rustix::net::SendFlags::empty())?;
    if sent != message.len() {
        return Err(io::Error::other("conntrack: a request was cut short"));
    }
    Ok(())
}

/// The netlink messages in `buffer` as (type, body after the header); stops at the first
/// one whose length does not fit.
fn messages(buffer: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut rest = buffer;
    std::iter::from_fn(move || {
        let len = u32::from_ne_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(rest.get(4..6)?.try_into().ok()?);
        if len < HEADER || len > rest.len() {
            return None;
        }
        let body = &rest[HEADER..len];
        rest = rest.get(align(len)..).unwrap_or_default();
        Some((kind, body))
    })
}

/// The error of a negative netlink error code.
fn errno_of(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code.checked_neg().unwrap_or(libc::EIO))
}

/// The (negative) errno of an `NLMSG_ERROR` body (or of an `NLMSG_DONE` one); 0 acknowledges.
fn error_code(body: &[u8]) -> i32 {
    body.get(..4)
        .and_then(|b| b.try_into().ok())
        .map_or(-libc::EIO, i32::from_ne_bytes)
}

fn align(len: usize) -> usize {
    (len + 3) & !3
}

/// The attributes in `buffer` as (type without flags, the whole attribute, its payload).
fn attributes(buffer: &[u8]) -> impl Iterator<Item = (u16, &[u8], &[u8])> {
    let mut rest = buffer;
    std::iter::from_fn(move || {
        let len = usize::from(u16::from_ne_bytes(rest.get(..2)?.try_into().ok()?));
        let kind = u16::from_ne_bytes(rest.get(2..4)?.try_into().ok()?) & NLA_TYPE_MASK;
        if len < 4 || len > rest.len() {
            return None;
        }
        let (whole, payload) = (&rest[..len], &rest[4..len]);
        rest = rest.get(align(len)..).unwrap_or_default();
        Some((kind, whole, payload))
    })
}

/// When the entry whose attributes are `attrs` has one of `addresses` at either end of its
/// original direction: the attributes that name it for a delete (its original tuple, and its
/// zone when it has one).
fn matching(attrs: &[u8], addresses: &[Ipv4Addr]) -> Option<Vec<u8>> {
    let mut key = Vec::new();
    let mut hit = false;
    for (kind, whole, payload) in attributes(attrs) {
        match kind {
            CTA_TUPLE_ORIG => {
                hit = ends(payload).iter().flatten().any(|a| addresses.contains(a));
                key.extend_from_slice(whole);
                key.resize(align(key.len()), 0);
            }
            CTA_ZONE => {
                key.extend_from_slice(whole);
                key.resize(align(key.len()), 0);
            }
            _ => {}
        }
    }
    hit.then_some(key)
}

/// The IPv4 source and destination of a tuple's payload.
fn ends(tuple: &[u8]) -> [Option<Ipv4Addr>; 2] {
    let mut found = [None, None];
    for (kind, _, ip) in attributes(tuple) {
        if kind != CTA_TUPLE_IP {
            continue;
        }
        for (kind, _, value) in attributes(ip) {
            let address = <[u8; 4]>::try_from(value).ok().map(Ipv4Addr::from);
            match kind {
                CTA_IP_V4_SRC => found[0] = address,
                CTA_IP_V4_DST => found[1] = address,
                _ => {}
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tuple(src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
        let ip = [attr(CTA_IP_V4_SRC, &src), attr(CTA_IP_V4_DST, &dst)].concat();
        // Nested, as the kernel marks it.
        let proto = attr(2 | 0x8000, &attr(1, &[17]));
        attr(
            CTA_TUPLE_ORIG | 0x8000,
            &[attr(CTA_TUPLE_IP | 0x8000, &ip), proto].concat(),
        )
    }

    #[test]
    fn an_entry_is_named_by_its_original_tuple_and_zone_when_an_end_is_ours() {
        let ours = [Ipv4Addr::new(10, 200, 0, 2)];
        let orig = tuple([10, 200, 0, 2], [198, 51, 100, 2]);
        let reply = attr(2 | 0x8000, &tuple([198, 51, 100, 2], [192, 0, 2, 1])[4..]);
        let zone = attr(CTA_ZONE, &3u16.to_be_bytes());
        let entry = [orig.clone(), reply.clone(), attr(3, &[0; 4]), zone.clone()].concat();
        assert_eq!(matching(&entry, &ours), Some([orig.clone(), zone].concat()));
        let inbound = tuple([198, 51, 100, 2], [10, 200, 0, 2]);
        assert_eq!(matching(&inbound, &ours), Some(inbound.clone()));
        let other = [tuple([10, 200, 0, 6], [198, 51, 100, 2]), reply].concat();
        assert_eq!(matching(&other, &ours), None, "another sandbox's");
    }

    /// The host's table is dumped and read to its end (root, as the node runs).
    #[test]
    fn an_address_with_no_connections_loses_nothing() {
        assert_eq!(
            conntrack(&[Ipv4Addr::new(192, 0, 2, 254)]).expect("ctnetlink (run as root)"),
            0
        );
        assert_eq!(conntrack(&[]).unwrap(), 0);
    }

    /// The family is found by name and the flush acknowledged (root, as the node runs).
    #[test]
    fn the_tcp_metrics_cache_is_flushed() {
        tcp_metrics().expect("generic netlink (run as root)");
    }

    #[test]
    fn truncated_messages_and_attributes_end_the_walk_without_panicking() {
        assert_eq!(messages(&[0xff; 3]).count(), 0);
        let mut too_long = vec![0u8; HEADER];
        too_long[..4].copy_from_slice(&64u32.to_ne_bytes());
        assert_eq!(messages(&too_long).count(), 0);
        assert_eq!(attributes(&[8, 0, 1, 0, 1]).count(), 0);
        assert_eq!(matching(&[2, 0, 1, 0], &[Ipv4Addr::LOCALHOST]), None);
        assert_eq!(error_code(&[]), -libc::EIO);
    }
}
