//! How the gateway fails, in one place: [`Failure`], what a sandbox or template operation
//! ran into (mapped from the ledger's errors and the nodes' and placement's statuses), and
//! [`ApiError`], the answer in E2B's shape (`{"code": <status>, "message": "..."}`) every
//! failure and refusal becomes.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ledger_client::LedgerError;
use serde_json::json;
use tonic::Code;

use crate::intent;

/// Why a sandbox operation failed, in terms the REST layer maps to E2B's statuses.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NoCapacity(String),
    /// Larger than any node of the cluster could ever hold.
    #[error("the sandbox is larger than any node can hold: {0}")]
    TooLarge(String),
    #[error("{0}")]
    Unavailable(String),
    /// A ledger write or a node call whose outcome stayed unknown (answered like
    /// `Unavailable`): it may have landed.
    #[error("{0}")]
    Unknown(String),
    #[error("{0}")]
    Internal(String),
    /// The request itself is wrong (400).
    #[error("{0}")]
    Invalid(String),
    /// Exists, but not the caller's to use or change (403).
    #[error("{0}")]
    Forbidden(String),
    /// The caller's team holds as many as it may (429, as E2B answers its concurrency limit).
    #[error("{0}")]
    TooMany(String),
}

impl From<LedgerError> for Failure {
    fn from(err: LedgerError) -> Self {
        match err {
            LedgerError::Unavailable(m) => Failure::Unavailable(format!("ledger unavailable: {m}")),
            LedgerError::OutcomeUnknown(m) => Failure::Unknown(format!(
                "the ledger did not confirm the write ({m}); read the sandbox to see whether it applied"
            )),
            // What the ledger refuses as malformed came from the request (an ID, a name, a
            // value too large): the caller's to fix, never a server error.
            LedgerError::Invalid(m) => Failure::Invalid(format!("the request was refused: {m}")),
            other => Failure::Internal(other.to_string()),
        }
    }
}

/// A node's or placement's refusal, for the call described by `what`.
pub(crate) fn from_status(what: &str, status: tonic::Status) -> Failure {
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => {
            Failure::Unavailable(format!("{what}: {}", status.message()))
        }
        // A call that broke after it was sent (tonic's transport errors): it may have landed.
        Code::Unknown => Failure::Unknown(format!("{what}: no answer, it may have landed ({})", status.message())),
        Code::ResourceExhausted => Failure::NoCapacity(status.message().to_string()),
        Code::OutOfRange => Failure::TooLarge(status.message().to_string()),
        Code::NotFound => Failure::NotFound(status.message().to_string()),
        Code::FailedPrecondition | Code::AlreadyExists => Failure::Conflict(status.message().to_string()),
        _ => Failure::Internal(format!("{what}: {}", status.message())),
    }
}

/// An error answer in E2B's shape.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            Json(json!({"code": self.status.as_u16(), "message": self.message})),
        )
            .into_response();
        // 503 means "not now": say when to try again (the SDK honours Retry-After).
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

impl From<Failure> for ApiError {
    fn from(f: Failure) -> Self {
        let status = match &f {
            Failure::NotFound(_) => StatusCode::NOT_FOUND,
            Failure::Conflict(_) => StatusCode::CONFLICT,
            // Never "try again": no node of this cluster could hold it.
            Failure::TooLarge(_) => StatusCode::BAD_REQUEST,
            // E2B answers "no capacity" with 503 too.
            Failure::NoCapacity(_) | Failure::Unavailable(_) | Failure::Unknown(_) => StatusCode::SERVICE_UNAVAILABLE,
            Failure::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Failure::Invalid(_) => StatusCode::BAD_REQUEST,
            Failure::Forbidden(_) => StatusCode::FORBIDDEN,
            Failure::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
        };
        let message = match &f {
            Failure::NotFound(id) => format!("sandbox \"{id}\" doesn't exist or you don't have access to it"),
            other => other.to_string(),
        };
        ApiError::new(status, message)
    }
}

impl From<intent::Refusal> for ApiError {
    fn from(r: intent::Refusal) -> Self {
        match r {
            intent::Refusal::UnknownTemplate(_) => ApiError::new(StatusCode::NOT_FOUND, r.to_string()),
            intent::Refusal::Invalid(_) => ApiError::new(StatusCode::BAD_REQUEST, r.to_string()),
        }
    }
}
