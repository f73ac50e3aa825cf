//! What a user does to a sandbox after its create: kill, pause (with memory, or hibernated),
//! resume, and change its timeout.

use common::clock::now_ms;
use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use ledger_client::{LedgerError, Txn, Versioned};
use proto::node::v1 as node_pb;

use tonic::Code;

use super::claim::{released, KILL};
use super::{from_status, Failure, Sandboxes, LEDGER_RESOLVE_ATTEMPTS};

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
    /// Kills a sandbox and deletes its manifest. The sandbox is claimed first, and the user
    /// never hears "killed" while it may run: a node that refuses the kill fails the call and
    /// gives the claim back (nothing changed); a node that does not answer fails the call
    /// and keeps the claim — the kill may have landed, so the sandbox stays "being killed",
    /// and the next kill takes the claim over at once and tries again.
    pub async fn kill(&self, team: &str, id: &str) -> Result<(), Failure> {
        self.kill_as(team, id, KILL).await
    }

    /// A kill under a claim for operation `op` (see `claim::EVICT`).
    pub(super) async fn kill_as(&self, team: &str, id: &str, op: &str) -> Result<(), Failure> {
        let mut doc = self.claim(team, id, op).await?;
        match self.kill_on_node(&doc.value).await {
            Ok(()) => {}
            // Not confirmed (the node did not answer, or the call broke after it was sent: a
            // node killed under it): the claim stays, so the next kill, or the reaper, ends it.
            Err(Failure::Unavailable(why) | Failure::Unknown(why)) => {
                return Err(Failure::Unavailable(format!(
                    "the node did not confirm the kill ({why}); it may have landed: kill again"
                )));
            }
            Err(err) => {
                self.unclaim(&mut doc).await;
                return Err(err);
            }
        }
        self.routes.forget(id).await;
        // Its team's room is free at once: a create right after the kill need not wait for
        // the watch to deliver the deletion.
        self.routes.release_holder(id);
        self.tell_placement_removed(&doc.value).await;
        if doc.value.phase == common::docs::SandboxPhase::Hibernated {
            self.forget_snapshot(id).await;
        }
        let deleted = self
            .ledger
            .compare_resolving(
                Txn::new().delete(SANDBOX_KIND, id, doc.version),
                LEDGER_RESOLVE_ATTEMPTS,
            )
            .await;
        match deleted {
            Ok(_) => {}
            // Only a takeover of this claim (after its time to live) writes meanwhile; the
            // sandbox is gone from its node either way, and that operation ends the manifest.
            Err(LedgerError::Conflict { .. }) => {
                tracing::warn!(sandbox_id = %id, "the manifest changed under the kill's claim; left to its new owner")
            }
            Err(err) => return Err(err.into()),
        }
        tracing::info!(sandbox_id = %id, "sandbox killed");
        Ok(())
    }

    /// Kills the sandbox's copy on its node under the claimed epoch; "not there" is done.
    pub(super) async fn kill_on_node(&self, doc: &SandboxDoc) -> Result<(), Failure> {
        if doc.node_address.is_empty() {
            return Ok(());
        }
        let mut node = self.nodes.client(&doc.node_id, &doc.node_address).await?;
        let killed = node
            .kill(node_pb::LifecycleRequest {
                operation_id: format!("kill-{}-{}", doc.sandbox_id, doc.epoch),
                epoch: doc.epoch,
                sandbox_id: doc.sandbox_id.clone(),
            })
            .await;
        match killed {
            Ok(_) => Ok(()),
            Err(status) if status.code() == Code::NotFound => Ok(()),
            Err(status) => Err(from_status("kill", status)),
        }
    }

    pub(super) async fn node_call(&self, doc: &SandboxDoc, op: Freeze) -> Result<(), Failure> {
        let mut node = self.nodes.client(&doc.node_id, &doc.node_address).await?;
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
        let mut doc = self.claim(team, id, "pause").await?;
        if doc.value.phase != SandboxPhase::Running {
            self.unclaim(&mut doc).await;
            return Err(Failure::Conflict(format!("sandbox {id} is already paused")));
        }
        self.routes.set_running(id, false).await;
        if let Err(err) = self.node_call(&doc.value, Freeze::Pause).await {
            // A pause that may have landed keeps its claim: past its time to live the reaper
            // makes the manifest say what the node holds.
            if !matches!(err, Failure::Unknown(_)) {
                self.routes.set_running(id, true).await;
                self.unclaim(&mut doc).await;
            }
            return Err(err);
        }
        released(&mut doc.value);
        doc.value.paused_at_unix_ms = Some(now_ms());
        if !memory {
            match self.hibernate(&doc.value).await {
                Err(err) => tracing::warn!(sandbox_id = %id, %err, "hibernation failed; kept paused in place"),
                Ok(sealed) => match self.leave_node(&mut doc, sealed).await {
                    Ok(()) => {
                        self.save(&doc).await?;
                        self.routes.forget(id).await;
                        return Ok(());
                    }
                    Err(err) => {
                        tracing::warn!(sandbox_id = %id, %err, "the hibernation's seal was not saved; kept paused in place")
                    }
                },
            }
        }
        doc.value.phase = SandboxPhase::Paused;
        self.save(&doc).await?;
        Ok(())
    }

    /// Resumes a paused sandbox (true) or finds it running already (false), and sets its end.
    pub async fn resume(&self, team: &str, id: &str, timeout_secs: u64) -> Result<(SandboxDoc, bool), Failure> {
        self.resume_as(team, id, timeout_secs, false).await
    }

    /// [`Sandboxes::resume`]; with `reboot` (E2B's `on_resume="reboot"`), a paused sandbox
    /// starts afresh from its files instead of continuing where it stood: its files go to the
    /// blob store as a filesystem pause takes them, its frozen copy is killed, and it is woken
    /// wherever placement chooses.
    pub async fn resume_as(
        &self,
        team: &str,
        id: &str,
        timeout_secs: u64,
        reboot: bool,
    ) -> Result<(SandboxDoc, bool), Failure> {
        let mut doc = self.claim(team, id, "resume").await?;
        // A hibernated sandbox holds no room; woken, it does again: within its team's limit.
        let _admitted = match doc.value.phase {
            SandboxPhase::Hibernated => match self.admit(team, id).await {
                Ok(admitted) => admitted,
                Err(err) => {
                    self.unclaim(&mut doc).await;
                    return Err(err);
                }
            },
            _ => None,
        };
        let resumed = doc.value.phase != SandboxPhase::Running;
        let in_place = matches!(doc.value.phase, SandboxPhase::Paused | SandboxPhase::Creating) && !reboot;
        let woken = match doc.value.phase {
            SandboxPhase::Running => Ok(()),
            SandboxPhase::Hibernated => self.wake(&mut doc).await,
            SandboxPhase::Paused if reboot => self.reboot(&mut doc).await,
            SandboxPhase::Paused | SandboxPhase::Creating => self.node_call(&doc.value, Freeze::Resume).await,
        };
        if let Err(err) = woken {
            // As for a pause: a resume in place that may have landed is left to the reaper.
            if !(in_place && matches!(err, Failure::Unknown(_))) {
                self.unclaim(&mut doc).await;
            }
            return Err(err);
        }
        doc.value.phase = SandboxPhase::Running;
        released(&mut doc.value);
        doc.value.paused_at_unix_ms = None;
        doc.value.end_at_unix_ms = doc.value.end_at_unix_ms.max(now_ms() + timeout_secs * 1000);
        self.save(&doc).await?;
        self.routes.set_running(id, true).await;
        Ok((doc.value, resumed))
    }

    /// A paused sandbox's files off its node, its frozen copy killed, then woken from the files.
    async fn reboot(&self, doc: &mut Versioned<SandboxDoc>) -> Result<(), Failure> {
        let sealed = self.hibernate(&doc.value).await?;
        self.leave_node(doc, sealed).await?;
        doc.version = self.save(doc).await?;
        self.routes.forget(&doc.value.sandbox_id).await;
        self.wake(doc).await
    }

    /// A sandbox whose files are in the store (`sealed`: the seal of its description, from
    /// [`Sandboxes::hibernate`]) leaves its node: the frozen copy is killed, the manifest names
    /// no node and a new epoch fences whatever the old copy might still be asked. The seal is
    /// saved in the manifest before the copy is killed: the archive in the store opens only
    /// with it, so a save failing after the kill would lose the sandbox. The caller saves what
    /// this leaves in `doc`.
    async fn leave_node(&self, versioned: &mut Versioned<SandboxDoc>, sealed: String) -> Result<(), Failure> {
        versioned.value.hibernation = Some(sealed);
        versioned.version = self.save(versioned).await?;
        let doc = &mut versioned.value;
        self.stop_on_node(doc).await;
        doc.node_id.clear();
        doc.node_address.clear();
        doc.envd_address.clear();
        doc.epoch += 1;
        doc.phase = SandboxPhase::Hibernated;
        Ok(())
    }

    /// Sets when the sandbox ends, `secs` from now: one compare-and-swap on the version read,
    /// once no operation owns the sandbox.
    pub async fn set_timeout(&self, team: &str, id: &str, secs: u64) -> Result<(), Failure> {
        let mut doc = self.get_settled(team, id).await?;
        doc.value.end_at_unix_ms = now_ms() + secs * 1000;
        self.save(&doc).await?;
        Ok(())
    }

    /// Replaces a running or paused sandbox's network policy (E2B's `PUT .../network`): the
    /// node applies it first, then the manifest records it. A hibernated sandbox is resumed
    /// first (its files are not on any node to apply it to).
    pub async fn update_network(
        &self,
        team: &str,
        id: &str,
        policy: common::egress::NetworkPolicy,
    ) -> Result<(), Failure> {
        let mut doc = self.claim(team, id, "network").await?;
        if !matches!(doc.value.phase, SandboxPhase::Running | SandboxPhase::Paused) {
            self.unclaim(&mut doc).await;
            return Err(Failure::Conflict(format!(
                "sandbox {id} is not running or paused in place; resume it first"
            )));
        }
        let applied = async {
            let mut node = self.nodes.client(&doc.value.node_id, &doc.value.node_address).await?;
            node.update_network(node_pb::NetworkUpdateRequest {
                operation_id: format!("network-{id}-{}", uuid::Uuid::new_v4().simple()),
                epoch: doc.value.epoch,
                sandbox_id: id.to_string(),
                network: Some(node_pb::NetworkPolicy {
                    internet: policy.internet,
                    allow_out: policy.allow_out.iter().map(ToString::to_string).collect(),
                    deny_out: policy.deny_out.iter().map(ToString::to_string).collect(),
                }),
            })
            .await
            .map(drop)
            .map_err(|s| from_status("network update", s))
        }
        .await;
        if let Err(err) = applied {
            self.unclaim(&mut doc).await;
            return Err(err);
        }
        doc.value.network = Some(policy);
        released(&mut doc.value);
        self.save(&doc).await?;
        Ok(())
    }
}
