//! IDs from a request, checked at the edge before any service is asked: a sandbox's (or a
//! node's) and a template's, each a 400 naming the field when it is not one.

use axum::extract::Path;
use axum::http::StatusCode;

use crate::error::ApiError;

/// A sandbox (or node) ID from the path, checked at the edge by the cluster's rule
/// (`contracts::ids`: 1 to 128 letters, digits, `-`, `_` or `.`, starting with a letter or a
/// digit). Anything else is a 400 naming the field, before
/// any service is asked (a control character or a kilobyte of ID used to reach the ledger and
/// come back as a 500).
pub struct SandboxId(pub String);

pub use common::ids::MAX_ID_BYTES;

pub fn check_id(id: &str) -> Result<(), ApiError> {
    if common::ids::is_sandbox_id(id) {
        Ok(())
    } else {
        let shown: String = id.chars().take(40).flat_map(char::escape_default).collect();
        Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("sandboxID \"{shown}\" is not an ID: {}", common::ids::ID_RULE),
        ))
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for SandboxId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("sandboxID: {e}")))?;
        check_id(&id)?;
        Ok(SandboxId(id))
    }
}

/// Checks a template ID, name or reference (`team/name:tag`) from a path or a body: plain
/// characters only, as any other ID at the edge.
pub(crate) fn check_template_id(what: &str, id: &str) -> Result<(), ApiError> {
    let ok = !id.is_empty()
        && id.len() <= 256
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/' | b':'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::new(StatusCode::BAD_REQUEST, format!("invalid {what} {id:?}")))
    }
}
