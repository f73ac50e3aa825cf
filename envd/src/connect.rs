//! The Connect protocol, server side, for the JSON codec: unary calls are a JSON body in and
//! out; server streams are 5-byte-enveloped JSON messages (flags, big-endian length) ending in
//! an end-of-stream envelope (flag 0x02) that carries the error, if any. Errors of unary calls
//! are `{"code": "...", "message": "..."}` with the HTTP status Connect assigns to the code.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Connect's error codes (the subset envd uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    Unauthenticated,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
}

impl Code {
    pub fn name(self) -> &'static str {
        match self {
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::Unauthenticated => "unauthenticated",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
        }
    }

    /// The HTTP status the Connect protocol maps this code to.
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// A Connect error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.name())]
pub struct RpcError {
    pub code: Code,
    pub message: String,
    /// The sandbox named by the request is not on this node.
    pub missing: bool,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            missing: false,
        }
    }

    /// The sandbox is not on this node.
    pub fn missing(sandbox: &str) -> Self {
        Self {
            missing: true,
            ..Self::new(Code::NotFound, format!("sandbox {sandbox} is not on this node"))
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.name(), "message": self.message})
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        let mut response = (self.code.http_status(), self.json().to_string()).into_response();
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if self.missing {
            response
                .headers_mut()
                .insert(envd_wire::headers::MISSING, HeaderValue::from_static("1"));
        }
        response
    }
}

/// Decodes a unary request body.
pub fn unary_request<T: DeserializeOwned>(body: &Bytes) -> Result<T, RpcError> {
    if body.is_empty() {
        return serde_json::from_str("{}").map_err(|e| RpcError::new(Code::InvalidArgument, e.to_string()));
    }
    serde_json::from_slice(body).map_err(|e| RpcError::new(Code::InvalidArgument, format!("bad request message: {e}")))
}

/// Encodes a unary answer.
pub fn unary_response<T: Serialize>(result: Result<T, RpcError>) -> Response {
    match result.and_then(|m| serde_json::to_string(&m).map_err(|e| RpcError::new(Code::Internal, e.to_string()))) {
        Ok(json) => {
            let mut response = (StatusCode::OK, json).into_response();
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            response
        }
        Err(err) => err.into_response(),
    }
}

/// Decodes the single enveloped message of a server-streaming request.
pub fn stream_request<T: DeserializeOwned>(body: &Bytes) -> Result<T, RpcError> {
    let bad = |why: &str| RpcError::new(Code::InvalidArgument, format!("bad Connect envelope: {why}"));
    if body.len() < 5 {
        return Err(bad("shorter than its 5-byte prefix"));
    }
    if body[0] & 0x01 != 0 {
        return Err(bad("compressed messages are not accepted"));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    let payload = body.get(5..5 + len).ok_or_else(|| bad("length beyond the body"))?;
    unary_request(&Bytes::copy_from_slice(payload))
}

/// Largest message a client stream may carry (input chunks are small).
const MAX_STREAMED_MESSAGE: usize = 4 << 20;

/// The enveloped messages of a client-streaming request, read as they arrive (the client may
/// keep the request open for as long as it has input to send).
pub struct Envelopes<S> {
    body: S,
    buf: Vec<u8>,
}

impl<S, E> Envelopes<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    pub fn new(body: S) -> Self {
        Self { body, buf: Vec::new() }
    }

    /// The next message; `None` when the client has finished.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Option<Result<T, RpcError>> {
        let bad = |why: String| RpcError::new(Code::InvalidArgument, format!("bad Connect envelope: {why}"));
        loop {
            if self.buf.len() >= 5 {
                if self.buf[0] & 0x01 != 0 {
                    return Some(Err(bad("compressed messages are not accepted".into())));
                }
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
                if len > MAX_STREAMED_MESSAGE {
                    return Some(Err(bad(format!("a message of {len} bytes"))));
                }
                if self.buf.len() >= 5 + len {
                    let frame: Vec<u8> = self.buf.drain(..5 + len).collect();
                    return Some(unary_request(&Bytes::copy_from_slice(&frame[5..])));
                }
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(err)) => {
                    return Some(Err(RpcError::new(
                        Code::Unavailable,
                        format!("reading the stream: {err}"),
                    )))
                }
                None if self.buf.is_empty() => return None,
                None => return Some(Err(bad("the stream ended inside a message".into()))),
            }
        }
    }
}

fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&u32::try_from(payload.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(payload);
    Bytes::from(out)
}

/// A server-streaming answer: every message of `messages`, then the end-of-stream envelope
/// (with the error that ended the stream, if one did).
pub fn stream_response<T, S>(messages: S) -> Response
where
    T: Serialize + Send + 'static,
    S: Stream<Item = Result<T, RpcError>> + Send + 'static,
{
    let frames = messages
        .map(Some)
        .chain(futures::stream::iter([None]))
        .scan(false, |ended, item| {
            if *ended {
                return futures::future::ready(None);
            }
            let frame = match item {
                Some(Ok(message)) => match serde_json::to_vec(&message) {
                    Ok(json) => envelope(0, &json),
                    Err(err) => {
                        *ended = true;
                        end_frame(Some(&RpcError::new(Code::Internal, err.to_string())))
                    }
                },
                Some(Err(err)) => {
                    *ended = true;
                    end_frame(Some(&err))
                }
                None => {
                    *ended = true;
                    end_frame(None)
                }
            };
            futures::future::ready(Some(Ok::<_, std::convert::Infallible>(frame)))
        });
    let mut response = Response::new(Body::from_stream(frames));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    response
}

fn end_frame(error: Option<&RpcError>) -> Bytes {
    let body = match error {
        Some(err) => serde_json::json!({"error": err.json()}),
        None => serde_json::json!({}),
    };
    envelope(0x02, body.to_string().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip() {
        let frame = envelope(0, br#"{"path":"a"}"#);
        let parsed: serde_json::Value = stream_request(&frame).unwrap();
        assert_eq!(parsed["path"], "a");
        assert!(stream_request::<serde_json::Value>(&Bytes::from_static(b"\x00\x00")).is_err());
        assert!(stream_request::<serde_json::Value>(&envelope(1, b"{}")).is_err());
        let end = end_frame(Some(&RpcError::new(Code::NotFound, "gone")));
        assert_eq!(end[0], 0x02);
        assert!(std::str::from_utf8(&end[5..]).unwrap().contains("not_found"));
    }

    #[tokio::test]
    async fn a_client_stream_is_read_whatever_its_chunks() {
        let mut wire = envelope(0, br#"{"n":1}"#).to_vec();
        wire.extend_from_slice(&envelope(0, br#"{"n":2}"#));
        // Split into 3-byte chunks: headers and messages straddle chunk boundaries.
        let chunks: Vec<Result<Bytes, std::io::Error>> =
            wire.chunks(3).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        let mut messages = Envelopes::new(futures::stream::iter(chunks));
        for n in [1, 2] {
            let m: serde_json::Value = messages.next().await.unwrap().unwrap();
            assert_eq!(m["n"], n);
        }
        assert!(messages.next::<serde_json::Value>().await.is_none());

        // A stream that ends inside a message is an error, not a silent end.
        let cut = vec![Ok::<_, std::io::Error>(Bytes::copy_from_slice(&wire[..7]))];
        let mut messages = Envelopes::new(futures::stream::iter(cut));
        assert!(messages.next::<serde_json::Value>().await.unwrap().is_err());
    }
}
