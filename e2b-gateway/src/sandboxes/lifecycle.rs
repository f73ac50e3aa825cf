//! What a user does to a sandbox after its create: kill, pause (with memory, or hibernated),
//! resume, and change its timeout.

use common::clock::now_ms;
use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use ledger_client::{LedgerError, Txn};
use proto::node::v1 as node_pb;

use super::{from_status, Failure, Sandboxes};

/// The node calls a pause or resume makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Freeze {
    Pause,
    Resume,
}

impl Freeze {
    fn name(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Resume => "resume",
        }
    }
}

impl Sandboxes {
    /// Kills a sandbox and deletes its manifest.
    pub async fn kill(&self, team: &str, id: &str) -> Result<(), Failure> {
        let doc = self.get_settled(team, id).await?;
        self.routes.forget(id).await;
        self.stop_on_node(&doc.value).await;
        let (meta, tar) = self.hibernation_files(id);
        let _ = tokio::fs::remove_file(meta).await;
        let _ = tokio::fs::remove_file(tar).await;
        match self
            .ledger
            .compare(Txn::new().delete(SANDBOX_KIND, id, doc.version))
            .await
        {
            Ok(_) | Err(LedgerError::Conflict { .. }) => {}
            Err(err) => return Err(err.into()),
        }
        tracing::info!(sandbox_id = %id, "sandbox killed");
        Ok(())
    }

    pub(super) async fn node_call(&self, doc: &SandboxDoc, op: Freeze) -> Result<(), Failure> {
        let mut node = self.nodes.client(&doc.node_address).await?;
        let req = node_pb::LifecycleRequest {
            operation_id: format!("{}-{}-{}", op.name(), doc.sandbox_id, uuid::Uuid::new_v4().simple()),
            epoch: doc.epoch,
            sandbox_id: doc.sandbox_id.clone(),
        };
        let result = match op {
            Freeze::Pause => node.pause(req).await,
            Freeze::Resume => node.resume(req).await,
        };
        result.map(|_| ()).map_err(|s| from_status(op.name(), s))
    }

    /// Pauses a running sandbox: frozen in place with its memory (`memory`), or hibernated:
    /// only its files kept (here, off the node), its processes stopped and the node freed.
    pub async fn pause(&self, team: &str, id: &str, memory: bool) -> Result<(), Failure> {
        let mut doc = self.get_settled(team, id).await?;
        if doc.value.phase != SandboxPhase::Running {
            return Err(Failure::Conflict(format!("sandbox {id} is already paused")));
        }
        self.routes.set_running(id, false).await;
        if let Err(err) = self.node_call(&doc.value, Freeze::Pause).await {
            self.routes.set_running(id, true).await;
            return Err(err);
        }
        if !memory {
            if let Err(err) = self.hibernate(&doc.value).await {
                tracing::warn!(sandbox_id = %id, %err, "hibernation failed; kept paused in place");
            } else {
                self.stop_on_node(&doc.value).await;
                doc.value.node_id.clear();
                doc.value.node_address.clear();
                doc.value.envd_address.clear();
                doc.value.epoch += 1;
                doc.value.phase = SandboxPhase::Hibernated;
                self.save(&doc).await?;
                self.routes.forget(id).await;
                return Ok(());
            }
        }
        doc.value.phase = SandboxPhase::Paused;
        self.save(&doc).await?;
        Ok(())
    }

    /// Resumes a paused sandbox (true) or finds it running already (false), and sets its end.
    pub async fn resume(&self, team: &str, id: &str, timeout_secs: u64) -> Result<(SandboxDoc, bool), Failure> {
        let mut doc = self.get_settled(team, id).await?;
        let resumed = doc.value.phase != SandboxPhase::Running;
        match doc.value.phase {
            SandboxPhase::Running => {}
            SandboxPhase::Hibernated => self.wake(&mut doc).await?,
            SandboxPhase::Paused | SandboxPhase::Creating => {
                self.node_call(&doc.value, Freeze::Resume).await?;
                doc.value.phase = SandboxPhase::Running;
            }
        }
        doc.value.end_at_unix_ms = doc.value.end_at_unix_ms.max(now_ms() + timeout_secs * 1000);
        self.save(&doc).await?;
        self.routes.set_running(id, true).await;
        Ok((doc.value, resumed))
    }

    /// Sets when the sandbox ends, `secs` from now.
    pub async fn set_timeout(&self, team: &str, id: &str, secs: u64) -> Result<(), Failure> {
        let mut doc = self.get_settled(team, id).await?;
        doc.value.end_at_unix_ms = now_ms() + secs * 1000;
        self.save(&doc).await?;
        Ok(())
    }
}
