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

/// The record once `claim` is applied: env vars added over its own, everything else replaced.
pub(super) fn claimed(record: &SandboxRecord, claim: Claim, epoch: u64) -> SandboxRecord {
    let mut next = record.clone();
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
            if record.state != State::Running {
                return Err(NodeError::Invalid(format!(
                    "sandbox {sandbox_id} is {:?}; only a running sandbox is claimed",
                    record.state
                )));
            }
            let next = claimed(&record, claim.clone(), fence(&record, epoch)?);
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
    }
}
