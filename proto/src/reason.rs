//! Why a call was refused, carried typed beside a gRPC status's message.
//!
//! A status's code says what kind of failure it is (`FAILED_PRECONDITION`), not which one:
//! the balancer must tell "a newer owner acts on this sandbox, stop at once" from "this
//! sandbox is not paused", both preconditions. A caller that told them apart by reading the
//! message would depend on a sentence another crate may reword. So the server names the
//! [`Reason`] in the status's metadata ([`REASON_KEY`]), mapped once where each service turns
//! its errors into statuses, and callers match on [`Reason::of`]; the message stays for
//! people.

use tonic::metadata::MetadataValue;
use tonic::Status;

/// The metadata key a refusal's [`Reason`] travels under.
pub const REASON_KEY: &str = "sandboxsched-reason";

/// A refusal a caller acts on differently from others of its status code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The call's fencing epoch is older than one the server has seen for the sandbox: a
    /// newer owner acts on it, and this caller must stop acting.
    StaleEpoch,
    /// The sandbox's state does not allow the move asked for (a resume of a running one).
    IllegalMove,
}

impl Reason {
    const ALL: [Reason; 2] = [Reason::StaleEpoch, Reason::IllegalMove];

    /// The reason's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::StaleEpoch => "stale-epoch",
            Reason::IllegalMove => "illegal-move",
        }
    }

    /// `status` with this reason named in its metadata.
    pub fn mark(self, mut status: Status) -> Status {
        status
            .metadata_mut()
            .insert(REASON_KEY, MetadataValue::from_static(self.as_str()));
        status
    }

    /// The reason `status` names, if it names one this build knows.
    pub fn of(status: &Status) -> Option<Reason> {
        let named = status.metadata().get(REASON_KEY)?.to_str().ok()?;
        Reason::ALL.into_iter().find(|r| r.as_str() == named)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_survives_its_status_and_a_message_names_none() {
        for reason in Reason::ALL {
            let status = reason.mark(Status::failed_precondition("anything at all"));
            assert_eq!(Reason::of(&status), Some(reason));
        }
        assert_eq!(Reason::of(&Status::failed_precondition("stale epoch 3 < 4")), None);
        let mut unknown = Status::failed_precondition("x");
        unknown
            .metadata_mut()
            .insert(REASON_KEY, MetadataValue::from_static("from-a-newer-build"));
        assert_eq!(Reason::of(&unknown), None);
    }
}
