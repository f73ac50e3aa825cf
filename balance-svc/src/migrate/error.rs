//! What can stop a step, and how node and ledger answers map onto it.

use ledger_client::LedgerError;
use proto::reason::Reason;
use tonic::Code;

/// Why a step did not complete.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    /// Worth trying again shortly (a node or the ledger is unreachable).
    #[error("transient: {0}")]
    Transient(String),
    /// A write was sent and nothing says whether it landed. Never rolled back on: the move
    /// keeps its step and the next cycle reads what is true before acting again.
    #[error("outcome unknown: {0}")]
    Unknown(String),
    /// The step cannot succeed; roll back if the step allows it.
    #[error("{0}")]
    Failed(String),
    /// The sandbox's manifest is gone: its user killed it mid-move.
    #[error("sandbox {0} was deleted while moving")]
    Gone(String),
    /// Another executor holds the lease or a newer epoch: stop acting at once.
    #[error("fenced: {0}")]
    Fenced(String),
    /// Fault injection for crash tests: the executor "dies" here.
    #[error("halted by fault injection after {0}")]
    Halted(&'static str),
}

/// A node's gRPC refusal, for the call described by `what`.
pub(crate) fn from_status(what: &str, status: tonic::Status) -> MoveError {
    let message = format!("{what}: {}", status.message());
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => MoveError::Transient(message),
        Code::FailedPrecondition if Reason::of(&status) == Some(Reason::StaleEpoch) => MoveError::Fenced(message),
        _ => MoveError::Failed(message),
    }
}

/// A ledger failure: transient if retrying may help, else the step fails.
pub(crate) fn from_ledger(err: LedgerError) -> MoveError {
    match err {
        LedgerError::OutcomeUnknown(_) => MoveError::Unknown(err.to_string()),
        _ if err.is_transient() => MoveError::Transient(err.to_string()),
        _ => MoveError::Failed(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_answers_map_to_what_the_executor_does_next() {
        let status = |code, message: &str| tonic::Status::new(code, message);
        assert!(matches!(
            from_status("x", status(Code::Unavailable, "down")),
            MoveError::Transient(_)
        ));
        assert!(matches!(
            from_status(
                "x",
                Reason::StaleEpoch.mark(status(Code::FailedPrecondition, "newer owner"))
            ),
            MoveError::Fenced(_)
        ));
        // The reason, not the wording: a sentence that mentions epochs fences nothing.
        assert!(matches!(
            from_status("x", status(Code::FailedPrecondition, "stale epoch 3 < 4")),
            MoveError::Failed(_)
        ));
        assert!(matches!(
            from_status("x", Reason::IllegalMove.mark(status(Code::FailedPrecondition, "epoch"))),
            MoveError::Failed(_)
        ));
        assert!(matches!(
            from_status("x", status(Code::FailedPrecondition, "not paused")),
            MoveError::Failed(_)
        ));
        assert!(matches!(
            from_status("x", status(Code::NotFound, "no")),
            MoveError::Failed(_)
        ));
        assert!(matches!(
            from_ledger(LedgerError::OutcomeUnknown("lost".into())),
            MoveError::Unknown(_)
        ));
        assert!(matches!(
            from_ledger(LedgerError::Unavailable("down".into())),
            MoveError::Transient(_)
        ));
    }
}
