//! Listening sockets.

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// Binds `addr` (port 0 picks a free port) and returns the listener with the address it got.
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    Ok((listener, bound))
}
