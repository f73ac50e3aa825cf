//! The reaper: ends every sandbox whose time is up (paused where it asked for that, else
//! killed), and every create abandoned half-way. The end time lives in the manifest, so this
//! survives gateway restarts.

use common::clock::now_ms;
use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use ledger_client::Txn;

use super::claim::KILL;
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
    Pause,
    /// A create abandoned half-way: its process may run on any node.
    EndCreate,
}

pub(super) fn reap(doc: &SandboxDoc, now: u64) -> Option<Reap> {
    if doc.phase == SandboxPhase::Creating {
        let abandoned = doc.started_at_unix_ms.saturating_add(CREATE_ABANDONED_AFTER_MS) <= now;
        return abandoned.then_some(Reap::EndCreate);
    }
    if doc.end_at_unix_ms > now {
        return None;
    }
    match (doc.auto_pause, doc.phase) {
        (false, _) => Some(Reap::Kill),
        (true, SandboxPhase::Running) => Some(Reap::Pause),
        (true, _) => None,
    }
}

impl Sandboxes {
    /// Ends every sandbox whose time is up: paused where it asked for that, else killed. The
    /// end time lives in the manifest, so this survives gateway restarts.
    pub async fn reap(&self) -> Result<usize, Failure> {
        use futures::StreamExt;
        let now = now_ms();
        let due: Vec<_> = self
            .all()
            .await?
            .into_iter()
            .filter_map(|doc| reap(&doc.value, now).map(|what| (what, doc.value)))
            .collect();
        let ended = futures::stream::iter(due)
            .map(|(what, d)| async move {
                let result = match what {
                    Reap::Pause => self.pause(&d.team_id, &d.sandbox_id, true).await,
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

    /// Ends a create whose gateway stopped before writing where it runs: claims the manifest
    /// (epoch + 1), kills the sandbox on every node placement knows (its process may have
    /// started on any it tried), then deletes the manifest.
    async fn end_abandoned_create(&self, team: &str, id: &str) -> Result<(), Failure> {
        let doc = self.claim(team, id, KILL).await?;
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
        tracing::warn!(sandbox_id = %id, "ended a create abandoned half-way");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reaper_ends_what_is_due_and_abandoned_creates() {
        let doc = |phase, end: u64, auto_pause| SandboxDoc {
            phase,
            started_at_unix_ms: 1_000,
            end_at_unix_ms: end,
            auto_pause,
            ..SandboxDoc::default()
        };
        let now = 10_000;
        assert_eq!(reap(&doc(SandboxPhase::Running, now + 1, false), now), None);
        assert_eq!(reap(&doc(SandboxPhase::Running, now, false), now), Some(Reap::Kill));
        assert_eq!(reap(&doc(SandboxPhase::Running, now, true), now), Some(Reap::Pause));
        assert_eq!(reap(&doc(SandboxPhase::Paused, now, true), now), None);
        assert_eq!(reap(&doc(SandboxPhase::Paused, now, false), now), Some(Reap::Kill));
        // A create in progress is left alone however its timeout stands, until abandoned.
        assert_eq!(reap(&doc(SandboxPhase::Creating, 0, false), now), None);
        let late = 1_000 + CREATE_ABANDONED_AFTER_MS;
        assert_eq!(
            reap(&doc(SandboxPhase::Creating, 0, false), late),
            Some(Reap::EndCreate)
        );
    }
}
