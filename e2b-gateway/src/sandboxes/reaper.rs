//! The reaper: ends every sandbox whose time is up (paused where it asked for that, else
//! killed), every paused sandbox kept past the retention, and every create abandoned half-way.
//! The end time lives in the manifest, so this survives gateway restarts.
//!
//! A paused sandbox does not time out, as on E2B: it is kept until killed, or until it has
//! been paused for the gateway's `--paused-retention`; `connect` or a resume gives it a
//! timeout again.

use common::clock::now_ms;
use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use ledger_client::Txn;

use proto::node::v1 as node_pb;

use super::claim::{released, KILL};
use super::{Failure, Sandboxes, LEDGER_RESOLVE_ATTEMPTS};

/// Sandboxes ended at once: one that waits for a move (up to the claim's wait) does not hold
/// up the others.
const AT_ONCE: usize = 16;

/// A manifest still `creating` this long after its create began belongs to a create whose
/// gateway stopped mid-way (a create takes milliseconds to seconds).
pub(super) const CREATE_ABANDONED_AFTER_MS: u64 = 5 * 60 * 1000;

/// What the reaper does to a manifest now, if anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reap {
    Kill,
    /// Paused with its memory (true) or its files only.
    Pause {
        memory: bool,
    },
    /// A create abandoned half-way: its process may run on any node.
    EndCreate,
}

pub(super) fn reap(doc: &SandboxDoc, now: u64, retention_ms: u64) -> Option<Reap> {
    match doc.phase {
        SandboxPhase::Creating => {
            let abandoned = doc.started_at_unix_ms.saturating_add(CREATE_ABANDONED_AFTER_MS) <= now;
            abandoned.then_some(Reap::EndCreate)
        }
        SandboxPhase::Paused | SandboxPhase::Hibernated => {
            // A manifest paused before the time was recorded counts from its old end.
            let since = doc.paused_at_unix_ms.unwrap_or(doc.end_at_unix_ms);
            (since.saturating_add(retention_ms) <= now).then_some(Reap::Kill)
        }
        SandboxPhase::Running if doc.end_at_unix_ms > now => None,
        SandboxPhase::Running if doc.auto_pause => Some(Reap::Pause {
            memory: doc.auto_pause_memory,
        }),
        SandboxPhase::Running => Some(Reap::Kill),
    }
}

impl Sandboxes {
    /// Ends every sandbox whose time is up: paused where it asked for that, else killed. The
    /// end time lives in the manifest, so this survives gateway restarts.
    pub async fn reap(&self) -> Result<usize, Failure> {
        use futures::StreamExt;
        let now = now_ms();
        let retention = u64::try_from(self.paused_retention.as_millis()).unwrap_or(u64::MAX);
        let due: Vec<_> = self
            .all()
            .await?
            .into_iter()
            .filter_map(|doc| reap(&doc.value, now, retention).map(|what| (what, doc.value)))
            .collect();
        let ended = futures::stream::iter(due)
            .map(|(what, d)| async move {
                let result = match what {
                    Reap::Pause { memory } => self.pause(&d.team_id, &d.sandbox_id, memory).await,
                    Reap::Kill => self.kill(&d.team_id, &d.sandbox_id).await,
                    Reap::EndCreate => self.end_abandoned_create(&d.team_id, &d.sandbox_id).await,
                };
                match result {
                    Ok(()) => 1,
                    Err(err) => {
                        tracing::warn!(sandbox_id = %d.sandbox_id, %err, "reaper could not end sandbox");
                        0
                    }
                }
            })
            .buffer_unordered(AT_ONCE)
            .fold(0, |sum, n| async move { sum + n })
            .await;
        Ok(ended)
    }

    /// Resolves a create whose gateway stopped before writing where it runs, against the
    /// nodes: claims the manifest (epoch + 1) and asks every node placement knows whether it
    /// runs the sandbox. One that does keeps it: the manifest is completed as running there
    /// (a retry with the create's `Idempotency-Key` then finds it), and any other copy is
    /// killed. When none does, the manifest is deleted (every node told to kill it first, in
    /// case a start is still landing).
    async fn end_abandoned_create(&self, team: &str, id: &str) -> Result<(), Failure> {
        let mut doc = self.claim(team, id, KILL).await?;
        let mut running_on = Vec::new();
        for node in self.nodes().await? {
            let Ok(mut client) = self.nodes.client(&node.address).await else {
                continue;
            };
            let Ok(listed) = client.list(node_pb::ListRequest {}).await else {
                continue;
            };
            let runs = listed
                .into_inner()
                .sandboxes
                .iter()
                .any(|s| s.sandbox_id == id && s.state == node_pb::SandboxState::Running as i32);
            if runs {
                running_on.push(node);
            }
        }
        if let Some((keep, others)) = running_on.split_first() {
            if let Ok(envd) = self.nodes.envd(&keep.address).await {
                for other in others {
                    let mut on = doc.value.clone();
                    on.node_address = other.address.clone();
                    self.kill_on_node(&on).await?;
                }
                doc.value.phase = SandboxPhase::Running;
                doc.value.node_id = keep.node_id.clone();
                doc.value.node_address = keep.address.clone();
                doc.value.envd_address = envd;
                released(&mut doc.value);
                self.save(&doc).await?;
                self.routes.set_running(id, true).await;
                metrics::counter!("gateway_half_made_creates_total", "outcome" => "adopted").increment(1);
                tracing::warn!(sandbox_id = %id, node_id = %keep.node_id, "adopted a create abandoned half-way: its node runs it");
                return Ok(());
            }
        }
        for node in self.nodes().await? {
            let mut on = doc.value.clone();
            on.node_address = node.address;
            self.kill_on_node(&on).await?;
        }
        self.ledger
            .compare_resolving(
                Txn::new().delete(SANDBOX_KIND, id, doc.version),
                LEDGER_RESOLVE_ATTEMPTS,
            )
            .await?;
        metrics::counter!("gateway_half_made_creates_total", "outcome" => "removed").increment(1);
        tracing::warn!(sandbox_id = %id, "removed a create abandoned half-way: no node runs it");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reaper_ends_what_is_due_keeps_what_is_paused_and_ends_abandoned_creates() {
        let doc = |phase, end: u64, auto_pause| SandboxDoc {
            phase,
            started_at_unix_ms: 1_000,
            end_at_unix_ms: end,
            auto_pause,
            auto_pause_memory: true,
            ..SandboxDoc::default()
        };
        let (now, keep) = (10_000, 50_000);
        let reap = |d: &SandboxDoc, now| reap(d, now, keep);
        assert_eq!(reap(&doc(SandboxPhase::Running, now + 1, false), now), None);
        assert_eq!(reap(&doc(SandboxPhase::Running, now, false), now), Some(Reap::Kill));
        assert_eq!(
            reap(&doc(SandboxPhase::Running, now, true), now),
            Some(Reap::Pause { memory: true })
        );
        let mut files_only = doc(SandboxPhase::Running, now, true);
        files_only.auto_pause_memory = false;
        assert_eq!(reap(&files_only, now), Some(Reap::Pause { memory: false }));
        // Paused, by hand or by timeout: kept past its timeout, until the retention passes.
        for phase in [SandboxPhase::Paused, SandboxPhase::Hibernated] {
            let mut paused = doc(phase, now, false);
            paused.paused_at_unix_ms = Some(now);
            assert_eq!(reap(&paused, now + keep - 1), None, "{phase:?}");
            assert_eq!(reap(&paused, now + keep), Some(Reap::Kill), "{phase:?}");
        }
        // A create in progress is left alone however its timeout stands, until abandoned.
        assert_eq!(reap(&doc(SandboxPhase::Creating, 0, false), now), None);
        let late = 1_000 + CREATE_ABANDONED_AFTER_MS;
        assert_eq!(
            reap(&doc(SandboxPhase::Creating, 0, false), late),
            Some(Reap::EndCreate)
        );
    }
}
