//! `GET /files` and `POST /files`: whole-file download and upload, as envd serves them
//! (`multipart/form-data` or `application/octet-stream`), answering errors as
//! `{"code": <http status>, "message": ...}`.

use std::path::Path;

use axum::body::Bytes;
use axum::extract::Multipart;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::connect::{Code, RpcError};
use super::paths::{resolve, sandbox_path};

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

#[derive(Serialize)]
struct Written {
    path: String,
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// The file's bytes.
pub async fn download(home: &Path, path: Option<&str>) -> Response {
    let Some(path) = path.filter(|p| !p.is_empty()) else {
        return rest_error(StatusCode::BAD_REQUEST, "the path query parameter is required");
    };
    let host = match resolve(home, path) {
        Ok(host) => host,
        Err(err) => return rest_from_rpc(err),
    };
    if host.is_dir() {
        return rest_error(StatusCode::BAD_REQUEST, format!("path '{path}' is a directory"));
    }
    match tokio::fs::read(&host).await {
        Ok(bytes) => {
            let mut response = (StatusCode::OK, bytes).into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            response
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            rest_error(StatusCode::NOT_FOUND, format!("file '{path}' does not exist"))
        }
        Err(e) => rest_error(StatusCode::INTERNAL_SERVER_ERROR, format!("reading '{path}': {e}")),
    }
}

async fn write(home: &Path, path: &str, data: &[u8]) -> Result<Written, Response> {
    let host = resolve(home, path).map_err(rest_from_rpc)?;
    if host.is_dir() {
        return Err(rest_error(
            StatusCode::BAD_REQUEST,
            format!("path '{path}' is a directory"),
        ));
    }
    if let Some(parent) = host.parent() {
        tokio::fs::create_dir_all(parent).await.map_err(|e| {
            rest_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("creating parents of '{path}': {e}"),
            )
        })?;
    }
    tokio::fs::write(&host, data)
        .await
        .map_err(|e| rest_error(StatusCode::INTERNAL_SERVER_ERROR, format!("writing '{path}': {e}")))?;
    Ok(Written {
        path: sandbox_path(home, &host),
        name: host
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        kind: "file",
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

/// A raw upload to `path`.
pub async fn upload_raw(home: &Path, path: Option<&str>, body: Bytes) -> Response {
    let Some(path) = path.filter(|p| !p.is_empty()) else {
        return rest_error(
            StatusCode::BAD_REQUEST,
            "the path query parameter is required for octet-stream uploads",
        );
    };
    match write(home, path, &body).await {
        Ok(w) => written(vec![w]),
        Err(response) => response,
    }
}

/// One part of a multipart upload: its file name, if any, and its bytes.
pub type Part = (Option<String>, Bytes);

/// Reads every part of a multipart upload (before anything is written).
pub async fn read_parts(mut multipart: Multipart) -> Result<Vec<Part>, Response> {
    let mut parts = Vec::new();
    loop {
        match multipart.next_field().await {
            Ok(Some(field)) => {
                let name = field.file_name().map(str::to_string);
                match field.bytes().await {
                    Ok(data) => parts.push((name, data)),
                    Err(e) => return Err(rest_error(StatusCode::BAD_REQUEST, format!("bad multipart body: {e}"))),
                }
            }
            Ok(None) => return Ok(parts),
            Err(e) => return Err(rest_error(StatusCode::BAD_REQUEST, format!("bad multipart body: {e}"))),
        }
    }
}

/// Writes a multipart upload: one file goes to `path` (or its part's file name); several go
/// each to their part's file name.
pub async fn upload_parts(home: &Path, path: Option<&str>, parts: Vec<Part>) -> Response {
    let single = parts.len() == 1;
    let mut done = Vec::with_capacity(parts.len());
    for (name, data) in parts {
        let target = match (single, path.filter(|p| !p.is_empty()), name.as_deref()) {
            (true, Some(path), _) => path.to_string(),
            (_, _, Some(name)) if !name.is_empty() => name.to_string(),
            _ => {
                return rest_error(
                    StatusCode::BAD_REQUEST,
                    "each uploaded part needs a file name or a path",
                )
            }
        };
        match write(home, &target, &data).await {
            Ok(w) => done.push(w),
            Err(response) => return response,
        }
    }
    written(done)
}
