//! Claiming a pooled sandbox: a sandbox started ahead of any create (a template's warm pool)
//! becomes the create's. Its tokens, env vars and metadata are the create's from here on: the
//! pool's access token stops working at once, and envd adds the env vars to every command it
//! starts later. The start command already runs with the pool's env, as it would have run
//! before any request in a memory snapshot.

use super::*;

/// How long envd may take to take a claim's env vars.
const INIT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// What a claim gives a pooled sandbox.
#[derive(Clone, Debug, Default)]
pub struct Claim {
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub access_token: Option<String>,
    pub traffic_access_token: Option<String>,
}

/// What a claim may do with `record`.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Claimable {
    /// A pooled sandbox waiting: claim it under this epoch.
    Apply(u64),
    /// This claim already happened (the same epoch and token: its answer was lost, or the node
    /// restarted and forgot the operation): answer it again, change nothing.
    Done,
}

/// Whether a claim under `epoch` giving `access_token` may take `record`. Only a pooled one is
/// claimed, and only once: a second create's claim (a newer epoch, another token) of a sandbox
/// that is already somebody's is refused, whatever the gateways believe.
pub(super) fn claimable(
    record: &SandboxRecord,
    epoch: u64,
    access_token: Option<&str>,
) -> Result<Claimable, NodeError> {
    if record.state != State::Running {
        return Err(NodeError::Invalid(format!(
            "sandbox {} is {:?}; only a running sandbox is claimed",
            record.id, record.state
        )));
    }
    if record.pooled {
        return Ok(Claimable::Apply(fence(record, epoch)?));
    }
    if record.epoch == epoch && record.access_token.as_deref() == access_token {
        return Ok(Claimable::Done);
    }
    Err(NodeError::Invalid(format!(
        "sandbox {} is no pooled sandbox waiting for a claim: claimed already, or never pooled",
        record.id
    )))
}

/// The record once `claim` is applied: env vars added over its own, everything else replaced,
/// and no longer pooled.
pub(super) fn claimed(record: &SandboxRecord, claim: Claim, epoch: u64) -> SandboxRecord {
    let mut next = record.clone();
    next.pooled = false;
    next.epoch = epoch;
    next.env.extend(claim.env);
    next.metadata = claim.metadata;
    next.access_token = claim.access_token.filter(|t| !t.is_empty());
    next.traffic_access_token = claim.traffic_access_token.filter(|t| !t.is_empty());
    next
}

impl Shared {
    pub(super) async fn claim(
        &self,
        operation_id: &str,
        epoch: u64,
        sandbox_id: &str,
        claim: Claim,
    ) -> Result<SandboxRecord, NodeError> {
        validate_id(sandbox_id)?;
        // A claim that cleared the token would leave the sandbox's envd open to anyone who
        // reaches the node.
        if claim.access_token.as_deref().is_none_or(str::is_empty) {
            return Err(NodeError::Invalid(
                "a claim must give the sandbox an access token".into(),
            ));
        }
        let call = format!("claim {sandbox_id}");
        let turn = match self.admit(sandbox_id, operation_id, &call).await {
            Admission::Answered(answer) => return *answer,
            Admission::Turn(turn) => turn,
        };
        let answer = async {
            let record = turn
                .record()
                .ok_or_else(|| NodeError::NotFound(sandbox_id.to_string()))?;
            let epoch = match claimable(&record, epoch, claim.access_token.as_deref())? {
                Claimable::Apply(epoch) => epoch,
                Claimable::Done => return Ok(record),
            };
            let next = claimed(&record, claim.clone(), epoch);
            // envd told and the record written at once (each waits on its own I/O). Either
            // failing fails the claim, and the caller kills the sandbox rather than hand it out
            // half claimed.
            let socket = self.runtime.envd_socket(&self.dir.home(sandbox_id));
            let told = async {
                match socket {
                    Some(socket) => crate::envd_client::init(&socket, &claim.env, INIT_DEADLINE)
                        .await
                        .map_err(|e| NodeError::Runtime(format!("envd did not take the claim's env vars: {e}"))),
                    None => Ok(()),
                }
            };
            let (told, persisted) = tokio::join!(told, self.persist(&next));
            told?;
            persisted?;
            turn.commit(Some(next.clone()));
            tracing::info!(sandbox_id, "pooled sandbox claimed");
            self.note(sandbox_id, "pooled sandbox claimed");
            Ok(next)
        }
        .await;
        self.remember(operation_id, &call, &answer);
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_adds_env_and_replaces_tokens_and_metadata() {
        let record = SandboxRecord {
            id: "s".into(),
            template: "t".into(),
            resources: Resources::default(),
            env: [
                ("POOL".to_string(), "1".to_string()),
                ("A".to_string(), "old".to_string()),
            ]
            .into(),
            metadata: [("pool".to_string(), "yes".to_string())].into(),
            start_command: None,
            access_token: Some("pool-token".into()),
            network: None,
            traffic_access_token: Some("pool-traffic".into()),
            image: None,
            state: State::Running,
            epoch: 1,
            pgid: 0,
            created_at_unix_ms: 0,
            pooled: true,
        };
        let next = claimed(
            &record,
            Claim {
                env: [("A".to_string(), "new".to_string())].into(),
                metadata: [("user".to_string(), "1".to_string())].into(),
                access_token: Some("mine".into()),
                traffic_access_token: Some(String::new()),
            },
            2,
        );
        assert_eq!(next.env.get("A").map(String::as_str), Some("new"));
        assert_eq!(next.env.get("POOL").map(String::as_str), Some("1"));
        assert_eq!(next.metadata, [("user".to_string(), "1".to_string())].into());
        assert_eq!(next.access_token.as_deref(), Some("mine"));
        assert_eq!(next.traffic_access_token, None, "an empty token: its ports are public");
        assert_eq!(next.epoch, 2);
        assert!(!next.pooled, "a claimed sandbox is pooled no more");
    }

    #[test]
    fn only_a_pooled_sandbox_is_claimed_and_only_once() {
        let pooled = SandboxRecord {
            id: "s".into(),
            template: "t".into(),
            resources: Resources::default(),
            env: Default::default(),
            metadata: Default::default(),
            start_command: None,
            access_token: Some("pool-token".into()),
            network: None,
            traffic_access_token: None,
            image: None,
            state: State::Running,
            epoch: 3,
            pgid: 0,
            created_at_unix_ms: 0,
            pooled: true,
        };
        assert_eq!(claimable(&pooled, 4, Some("mine")).ok(), Some(Claimable::Apply(4)));
        assert!(claimable(&pooled, 2, Some("mine")).is_err(), "an older epoch is fenced");
        let mine = claimed(
            &pooled,
            Claim {
                access_token: Some("mine".into()),
                ..Claim::default()
            },
            4,
        );
        assert_eq!(
            claimable(&mine, 4, Some("mine")).ok(),
            Some(Claimable::Done),
            "the same claim again"
        );
        assert!(
            claimable(&mine, 5, Some("theirs")).is_err(),
            "a second create's claim of a sandbox already claimed"
        );
        assert!(
            claimable(&mine, 4, Some("theirs")).is_err(),
            "another token under the same epoch"
        );
        let never = SandboxRecord {
            pooled: false,
            ..pooled.clone()
        };
        assert!(
            claimable(&never, 4, Some("mine")).is_err(),
            "a team's own sandbox is never claimed"
        );
        let paused = SandboxRecord {
            state: State::Paused,
            ..pooled
        };
        assert!(claimable(&paused, 4, Some("mine")).is_err());
    }
}
