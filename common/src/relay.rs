//! Relaying one HTTP request over a connection the caller opened, and its answer back, with
//! bodies streamed both ways and protocol upgrades (WebSocket) spliced through.
//!
//! The gateway relays a request for a sandbox's port to the node that runs it; the node
//! relays it into the sandbox, over a connection it opened inside the sandbox's network
//! namespace. Both speak HTTP/1.1 on that hop whatever the client spoke (an HTTP/2 request
//! is rewritten to origin form with a `Host` header), because HTTP/1.1 is what every server
//! in a sandbox answers and what an upgrade needs.
//!
//! An upgrade is a handshake, then bytes: when the far side answers `101 Switching
//! Protocols`, both connections are taken over from HTTP and copied into each other until
//! either side closes.

use axum::body::Body;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

/// Headers that describe one hop, not the message: never passed on, except the `Connection:
/// upgrade` and `Upgrade` pair of an upgrade.
const HOP_BY_HOP: [header::HeaderName; 8] = [
    header::CONNECTION,
    header::HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Why a relay failed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("HTTP handshake with the far side: {0}")]
    Handshake(hyper::Error),
    #[error("the far side did not answer: {0}")]
    Request(hyper::Error),
}

/// Whether `headers` ask for a protocol upgrade (WebSocket): such a request needs a connection
/// of its own ([`relay`]); any other can go over a pooled one ([`prepare`]).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// Removes the hop-by-hop headers (and those the `Connection` header names), keeping an
/// upgrade's pair when `upgrading`.
fn strip_hop_by_hop(headers: &mut HeaderMap, upgrading: bool) {
    let named: Vec<header::HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| header::HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .filter(|n| !(upgrading && n == header::UPGRADE))
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        if upgrading && (name == header::CONNECTION || name == header::UPGRADE) {
            continue;
        }
        headers.remove(name);
    }
    if upgrading {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
}

/// Sends `request` over `stream` (HTTP/1.1) and returns the answer, its body streaming. Headers
/// named in `drop` are not passed on (the relay's own routing headers, say).
pub async fn relay<S>(stream: S, mut request: Request<Body>, drop: &[&str]) -> Result<Response<Body>, RelayError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let upgrading = is_upgrade(request.headers());
    let client_side = upgrading.then(|| hyper::upgrade::on(&mut request));
    prepare(&mut request, drop);

    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(RelayError::Handshake)?;
    tokio::spawn(async move {
        if let Err(err) = connection.with_upgrades().await {
            tracing::debug!(%err, "relayed connection ended");
        }
    });
    let mut response = sender.send_request(request).await.map_err(RelayError::Request)?;
    let switched = response.status() == StatusCode::SWITCHING_PROTOCOLS;
    if let (true, Some(client_side)) = (switched, client_side) {
        let far_side = hyper::upgrade::on(&mut response);
        tokio::spawn(async move {
            let (Ok(client), Ok(far)) = (client_side.await, far_side.await) else {
                return;
            };
            let (mut client, mut far) = (TokioIo::new(client), TokioIo::new(far));
            if let Err(err) = tokio::io::copy_bidirectional(&mut client, &mut far).await {
                tracing::debug!(%err, "upgraded connection ended");
            }
        });
    } else {
        prepare_answer(&mut response);
    }
    Ok(response.map(Body::new))
}

/// Readies `request` for the far side as [`relay`] sends it: a `Host` header and origin form
/// whatever the client spoke, HTTP/1.1, no hop-by-hop headers (an upgrade's pair kept), none
/// of the headers named in `drop`. A caller that sends it over a pooled client sets the URI
/// the pool needs afterwards; the `Host` header stays the client's.
pub fn prepare<B>(request: &mut Request<B>, drop: &[&str]) {
    let upgrading = is_upgrade(request.headers());
    // Origin form and a Host header, whatever the client spoke.
    if !request.headers().contains_key(header::HOST) {
        if let Some(authority) = request.uri().authority().cloned() {
            if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
                request.headers_mut().insert(header::HOST, host);
            }
        }
    }
    let origin = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .parse::<Uri>()
        .unwrap_or_else(|_| Uri::from_static("/"));
    *request.uri_mut() = origin;
    *request.version_mut() = http::Version::HTTP_11;
    strip_hop_by_hop(request.headers_mut(), upgrading);
    for name in drop {
        request.headers_mut().remove(*name);
    }
}

/// Readies an answer that is not an upgrade's for the client: no hop-by-hop headers, and
/// HTTP/1.1 whatever the far side spoke. (A server in a sandbox that answers HTTP/1.0, as
/// Python's `http.server` does, would otherwise have every hop back to the client close its
/// connection after this answer: hyper writes a response in the version it carries.)
pub fn prepare_answer<B>(response: &mut Response<B>) {
    strip_hop_by_hop(response.headers_mut(), false);
    *response.version_mut() = http::Version::HTTP_11;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_goes_back_as_http_1_1_without_hop_by_hop_headers() {
        let mut answer = Response::builder()
            .version(http::Version::HTTP_10)
            .header(header::CONNECTION, "close")
            .header("x-kept", "1")
            .body(())
            .unwrap();
        prepare_answer(&mut answer);
        assert_eq!(
            answer.version(),
            http::Version::HTTP_11,
            "an HTTP/1.0 answer closes every hop"
        );
        assert!(!answer.headers().contains_key(header::CONNECTION));
        assert!(answer.headers().contains_key("x-kept"));
    }

    #[test]
    fn hop_by_hop_headers_go_and_an_upgrades_pair_stays() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), vec!["x-kept"]);

        let mut ws = HeaderMap::new();
        ws.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, Upgrade"));
        ws.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(is_upgrade(&ws));
        strip_hop_by_hop(&mut ws, true);
        assert_eq!(ws.get(header::CONNECTION).unwrap(), "upgrade");
        assert_eq!(ws.get(header::UPGRADE).unwrap(), "websocket");
    }
}
