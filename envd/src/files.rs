//! `GET /files` and `POST /files`: download and upload, as envd serves them
//! (`multipart/form-data` or `application/octet-stream`), answering errors as
//! `{"code": <http status>, "message": ...}`.
//!
//! Both stream: a download is read from the file as the client takes it, an upload is written
//! as it arrives, chunk by chunk, so a file of any size costs a few buffers of memory. What an
//! upload creates (the file and any missing parent directories) belongs to the requesting user,
//! as on E2B.
//!
//! An upload's `X-Metadata-*` headers become the metadata of every file it writes (see
//! [`crate::metadata`]): checked before anything is written, set on each file once its content
//! is, and replacing whatever metadata the file had.

use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::extract::{FromRequest, Multipart, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt, TryStreamExt};
use serde::Serialize;
use tokio::io::AsyncWriteExt;

use crate::connect::{Code, RpcError};
use crate::metadata::{self, Metadata};
use crate::paths::Scope;
use crate::users::User;

/// envd's REST error body.
pub fn rest_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"code": status.as_u16(), "message": message.into()});
    let mut response = (status, body.to_string()).into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// An RPC-style refusal as a REST error.
pub fn rest_from_rpc(err: RpcError) -> Response {
    if err.missing {
        return err.into_response();
    }
    let status = match err.code {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::PermissionDenied | Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::Internal | Code::Unimplemented | Code::Unavailable => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::BAD_REQUEST,
    };
    rest_error(status, err.message)
}

fn io_status(e: &std::io::Error) -> StatusCode {
    match e.kind() {
        std::io::ErrorKind::NotFound => StatusCode::NOT_FOUND,
        std::io::ErrorKind::PermissionDenied => StatusCode::UNAUTHORIZED,
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => StatusCode::INSUFFICIENT_STORAGE,
        _ => StatusCode::BAD_REQUEST,
    }
}

#[derive(Serialize)]
struct Written {
    path: String,
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    /// The metadata the upload set, as the SDK's `WriteInfo.metadata`.
    #[serde(skip_serializing_if = "Metadata::is_empty")]
    metadata: Metadata,
}

/// The file's bytes, streamed.
pub async fn download(scope: &Scope<'_>, path: Option<&str>) -> Response {
    let Some(path) = path.filter(|p| !p.is_empty()) else {
        return rest_error(StatusCode::BAD_REQUEST, "the path query parameter is required");
    };
    let target = match scope.resolve(path) {
        Ok(target) => target,
        Err(err) => return rest_from_rpc(err),
    };
    if target.is_dir() {
        return rest_error(StatusCode::BAD_REQUEST, format!("path '{path}' is a directory"));
    }
    match tokio::fs::File::open(&target).await {
        Ok(file) => {
            let length = file.metadata().await.ok().map(|m| m.len());
            let mut response =
                Body::from_stream(tokio_util::io::ReaderStream::with_capacity(file, 64 * 1024)).into_response();
            let headers = response.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            if let Some(length) = length.and_then(|l| HeaderValue::from_str(&l.to_string()).ok()) {
                headers.insert(header::CONTENT_LENGTH, length);
            }
            response
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            rest_error(StatusCode::NOT_FOUND, format!("file '{path}' does not exist"))
        }
        Err(e) => rest_error(io_status(&e), format!("reading '{path}': {e}")),
    }
}

/// Gives `path` to `user` when envd runs as root and the user is someone else.
pub(crate) fn own(path: &Path, user: &User) -> std::io::Result<()> {
    if !rustix::process::geteuid().is_root() || user.uid == 0 {
        return Ok(());
    }
    std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid))
}

/// Creates `dir` and any missing parents, each owned by `user`.
pub(crate) fn make_dirs(dir: &Path, user: &User) -> std::io::Result<()> {
    let mut missing = Vec::new();
    let mut at = Some(dir);
    while let Some(d) = at {
        if d.exists() {
            break;
        }
        missing.push(d.to_path_buf());
        at = d.parent();
    }
    std::fs::create_dir_all(dir)?;
    for d in missing.iter().rev() {
        own(d, user)?;
    }
    Ok(())
}

/// Writes `chunks` to `path` (as the SDK named it), creating parents as needed, then makes
/// `metadata` the file's metadata.
async fn write<S, E>(scope: &Scope<'_>, path: &str, metadata: &Metadata, mut chunks: S) -> Result<Written, Response>
where
    S: Stream<Item = Result<axum::body::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let target: PathBuf = scope.resolve(path).map_err(rest_from_rpc)?;
    let user = scope.user;
    if target.is_dir() {
        return Err(rest_error(
            StatusCode::BAD_REQUEST,
            format!("path '{path}' is a directory"),
        ));
    }
    if let Some(parent) = target.parent() {
        make_dirs(parent, user).map_err(|e| rest_error(io_status(&e), format!("creating parents of '{path}': {e}")))?;
    }
    let failed = |e: std::io::Error| rest_error(io_status(&e), format!("writing '{path}': {e}"));
    let mut file = tokio::fs::File::create(&target).await.map_err(failed)?;
    own(&target, user).map_err(failed)?;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| rest_error(StatusCode::BAD_REQUEST, format!("reading the upload: {e}")))?;
        file.write_all(&chunk).await.map_err(failed)?;
    }
    file.flush().await.map_err(failed)?;
    // Through the open file: the path may have been replaced since it was opened.
    metadata::replace(std::os::fd::AsFd::as_fd(&file), metadata).map_err(|e| {
        if metadata::is_unsupported(&e) {
            rest_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("the filesystem holding '{path}' does not support file metadata (user extended attributes): the file was written without it"),
            )
        } else {
            rest_error(io_status(&e), format!("setting the metadata of '{path}': {e}"))
        }
    })?;
    Ok(Written {
        path: scope.shown(&target),
        name: target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        kind: "file",
        metadata: metadata.clone(),
    })
}

fn written(files: Vec<Written>) -> Response {
    let mut response = (
        StatusCode::OK,
        serde_json::to_string(&files).unwrap_or_else(|_| "[]".into()),
    )
        .into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// An upload: one raw body to `path`, or a multipart body whose single part goes to `path`
/// (or its file name) and whose several parts go each to their file name.
pub async fn upload(scope: &Scope<'_>, path: Option<&str>, request: Request) -> Response {
    let path = path.filter(|p| !p.is_empty());
    // Refused before anything is created or truncated.
    let metadata = match metadata::from_headers(request.headers()) {
        Ok(metadata) => metadata,
        Err(invalid) => return rest_error(StatusCode::BAD_REQUEST, invalid.to_string()),
    };
    let multipart = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("multipart/form-data"));
    if !multipart {
        let Some(path) = path else {
            return rest_error(
                StatusCode::BAD_REQUEST,
                "the path query parameter is required for octet-stream uploads",
            );
        };
        let encoding = request
            .headers()
            .get(header::CONTENT_ENCODING)
            .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase());
        let body = request.into_body().into_data_stream();
        let result = match encoding.as_deref() {
            None | Some("identity") => write(scope, path, &metadata, body).await,
            // The SDK's `gzip=True`: stored as sent before compression, inflated as it streams.
            Some("gzip") => {
                let compressed = tokio_util::io::StreamReader::new(body.map_err(std::io::Error::other));
                let inflated = async_compression::tokio::bufread::GzipDecoder::new(compressed);
                write(scope, path, &metadata, tokio_util::io::ReaderStream::new(inflated)).await
            }
            Some(other) => Err(rest_error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("Content-Encoding {other:?} is not supported (gzip is)"),
            )),
        };
        return match result {
            Ok(w) => written(vec![w]),
            Err(response) => response,
        };
    }
    let (request, rest) = drained(request);
    let mut parts = match Multipart::from_request(request, &()).await {
        Ok(parts) => parts,
        Err(e) => return rest_error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let mut done = Vec::new();
    loop {
        let field = match parts.next_field().await {
            Ok(Some(field)) => field,
            Ok(None) => break,
            Err(e) => return rest_error(StatusCode::BAD_REQUEST, format!("bad multipart body: {e}")),
        };
        // A path applies to the first part only: several parts are named by their file names.
        let target = match (done.is_empty().then_some(path).flatten(), field.file_name()) {
            (Some(path), _) => path.to_string(),
            (None, Some(name)) if !name.is_empty() => name.to_string(),
            _ => {
                return rest_error(
                    StatusCode::BAD_REQUEST,
                    "each uploaded part needs a file name or a path",
                )
            }
        };
        let chunks = futures::stream::unfold(field, |mut field| async move {
            match field.chunk().await {
                Ok(Some(chunk)) => Some((Ok(chunk), field)),
                Ok(None) => None,
                Err(e) => Some((Err(e), field)),
            }
        });
        match write(scope, &target, &metadata, Box::pin(chunks)).await {
            Ok(w) => done.push(w),
            Err(response) => return response,
        }
    }
    if done.is_empty() {
        return rest_error(StatusCode::BAD_REQUEST, "the multipart body has no parts");
    }
    // The parser stops at the closing boundary; what a client sends after it (the epilogue,
    // often a last CRLF in a chunk of its own) is read before answering. Answering first
    // would close the connection under a client still writing, which then sees an error
    // instead of this answer.
    drop(parts);
    let _ = rest.await;
    written(done)
}

/// `request` with its body passed through a task that reads the original to its end, even
/// after the returned request's body is dropped; await the task to know the body is consumed.
fn drained(request: Request) -> (Request, tokio::task::JoinHandle<()>) {
    let (head, body) = request.into_parts();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, axum::Error>>(4);
    let task = tokio::spawn(async move {
        let mut stream = body.into_data_stream();
        let mut forwarding = true;
        while let Some(chunk) = stream.next().await {
            if forwarding && tx.send(chunk).await.is_err() {
                forwarding = false;
            }
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    (Request::from_parts(head, body), task)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_drained_body_is_read_to_its_end_though_its_reader_stops_early() {
        let read = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = read.clone();
        let chunks = futures::stream::iter(["part", "closing boundary", "\r\n"]).map(move |c| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, std::io::Error>(axum::body::Bytes::from(c))
        });
        let request = Request::new(Body::from_stream(chunks));
        let (request, rest) = drained(request);
        let mut body = request.into_body().into_data_stream();
        assert_eq!(
            body.next().await.map(|c| c.map(|b| b.to_vec()).ok()),
            Some(Some(b"part".to_vec()))
        );
        drop(body);
        rest.await.expect("the draining task");
        assert_eq!(
            read.load(std::sync::atomic::Ordering::SeqCst),
            3,
            "the epilogue was read too"
        );
    }
}
