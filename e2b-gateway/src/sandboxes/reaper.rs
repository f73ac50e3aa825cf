//! The reaper: ends every sandbox whose time is up (paused where it asked for that, else
//! killed). The end time lives in the manifest, so this survives gateway restarts.

use common::clock::now_ms;
use common::docs::SandboxPhase;

use super::{Failure, Sandboxes};

/// Sandboxes ended at once: one that waits for a move (up to the claim's wait) does not hold
/// up the others.
const AT_ONCE: usize = 16;

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
            .map(|doc| doc.value)
            .filter(|d| d.end_at_unix_ms <= now && d.phase != SandboxPhase::Creating)
            .filter(|d| !d.auto_pause || d.phase == SandboxPhase::Running)
            .collect();
        let ended = futures::stream::iter(due)
            .map(|d| async move {
                let result = if d.auto_pause {
                    self.pause(&d.team_id, &d.sandbox_id, true).await
                } else {
                    self.kill(&d.team_id, &d.sandbox_id).await
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
}
