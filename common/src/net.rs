//! Listening sockets.

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

/// Binds `addr` (port 0 picks a free port) and returns the listener with the address it got.
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    Ok((listener, bound))
}

/// The connections a gRPC server accepts on `listener`, with `TCP_NODELAY` set. Without it a
/// unary response (headers, message and trailers, often written separately) can wait for the
/// client's delayed ACK under Nagle's algorithm: tens of milliseconds added to a call that
/// takes a few hundred microseconds. tonic sets it only when it binds the socket itself.
pub fn grpc_incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}
