//! The reaper: ends every sandbox whose time is up (paused where it asked for that, else
//! killed). The end time lives in the manifest, so this survives gateway restarts.

use common::clock::now_ms;
use common::docs::SandboxPhase;

use super::{Failure, Sandboxes};

impl Sandboxes {
    /// Ends every sandbox whose time is up: paused where it asked for that, else killed. The
    /// end time lives in the manifest, so this survives gateway restarts.
    pub async fn reap(&self) -> Result<usize, Failure> {
        let now = now_ms();
        let mut ended = 0;
        for doc in self.all().await? {
            let d = &doc.value;
            if d.end_at_unix_ms > now || d.phase == SandboxPhase::Creating {
                continue;
            }
            let result = if d.auto_pause && d.phase == SandboxPhase::Running {
                self.pause(&d.team_id, &d.sandbox_id, true).await
            } else if d.auto_pause {
                continue;
            } else {
                self.kill(&d.team_id, &d.sandbox_id).await
            };
            match result {
                Ok(()) => ended += 1,
                Err(err) => tracing::warn!(sandbox_id = %d.sandbox_id, %err, "reaper could not end sandbox"),
            }
        }
        Ok(ended)
    }
}
