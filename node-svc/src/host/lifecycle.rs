//! Pause, resume and kill, fenced by the move's epoch; a network policy replaced; a
//! sandbox whose process died restarted.

use super::*;

impl Shared {
    /// Pause, resume or kill, fenced by `epoch`.
    pub(super) async fn lifecycle(
        &self,
        operation_id: &str,
        epoch: u64,
        sandbox_id: &str,
        action: Move,
    ) -> Result<SandboxRecord, NodeError> {
        validate_id(sandbox_id)?;
        let call = format!("{action:?} {sandbox_id}");
        let turn = match self.admit(sandbox_id, operation_id, &call).await {
            Admission::Answered(answer) => return *answer,
            Admission::Turn(turn) => turn,
        };
        let answer = self.lifecycle_now(&turn, epoch, action).await;
        self.remember(operation_id, &call, &answer);
        answer
    }

    pub(super) async fn update_network(
        &self,
        operation_id: &str,
        epoch: u64,
        sandbox_id: &str,
        policy: common::egress::NetworkPolicy,
    ) -> Result<SandboxRecord, NodeError> {
        validate_id(sandbox_id)?;
        let call = format!("network {sandbox_id}");
        let turn = match self.admit(sandbox_id, operation_id, &call).await {
            Admission::Answered(answer) => return *answer,
            Admission::Turn(turn) => turn,
        };
        let answer = async {
            let record = turn
                .record()
                .ok_or_else(|| NodeError::NotFound(sandbox_id.to_string()))?;
            let mut next = record.clone();
            next.epoch = fence(&record, epoch)?;
            next.network = Some(policy.clone());
            let (runtime, dir) = (self.runtime.clone(), self.dir.clone());
            let next = blocking(move || {
                runtime.update_network(&record.view(), &policy)?;
                dir.persist(&next).map_err(io)?;
                Ok(next)
            })
            .await?;
            turn.commit(Some(next.clone()));
            tracing::info!(sandbox_id, "network policy replaced");
            self.note(sandbox_id, "network policy replaced");
            Ok(next)
        }
        .await;
        self.remember(operation_id, &call, &answer);
        answer
    }

    pub(super) async fn lifecycle_now(
        &self,
        turn: &Turn<'_>,
        epoch: u64,
        action: Move,
    ) -> Result<SandboxRecord, NodeError> {
        let id = turn.id.as_str();
        let record = turn.record().ok_or_else(|| NodeError::NotFound(id.to_string()))?;
        let epoch = fence(&record, epoch)?;
        let mut next = record.clone();
        next.epoch = epoch;
        let Some(state) = next_state(&record, action)? else {
            // Nothing to do but record a newer epoch.
            if next != record {
                self.persist(&next).await?;
            }
            turn.commit(Some(next.clone()));
            return Ok(next);
        };
        next.state = state;
        // A pause waits for envd requests already touching the files, and holds new ones
        // back until it is done (they then find the sandbox paused).
        let _quiet = match action {
            Move::Pause => Some(turn.slot.files.clone().write_owned().await),
            Move::Resume | Move::Kill => None,
        };
        // Held for the runtime's work only (moved into it). Never closed, so acquiring fails
        // only if it were: then the kill goes on unbounded.
        let kill_turn = match action {
            Move::Kill => {
                // Kills queued behind a burst, for whoever wonders why theirs is slow.
                let waiting = metrics::gauge!("node_kills_waiting");
                waiting.increment(1.0);
                let permit = self.kills.clone().acquire_owned().await.ok();
                waiting.decrement(1.0);
                permit
            }
            Move::Pause | Move::Resume => None,
        };
        let (runtime, dir, home) = (self.runtime.clone(), self.dir.clone(), self.dir.home(id));
        let gone = id.to_string();
        // The runtime call and the record's persistence (or, for a kill, its folder renamed
        // away) in one trip to a blocking thread.
        let (next, trash) = blocking(move || {
            let _kill_turn = kill_turn;
            match action {
                Move::Pause => runtime.pause(&record.view())?,
                Move::Resume => {
                    // Thaw first: commands started through envd live in the sandbox's cgroups
                    // too, whether or not it has a start command.
                    runtime.resume(&record.view())?;
                    if record.pgid == 0 && has_process(runtime.as_ref(), &record) {
                        // Its start command was not preserved (restored from a snapshot, or
                        // the host restarted while it was paused): start it afresh, files
                        // intact.
                        next.pgid = runtime.start(&record.view(), &home)?;
                    }
                }
                Move::Kill => runtime.kill(&record.view())?,
            }
            if next.state != State::Killed {
                dir.persist(&next).map_err(io)?;
                return Ok((next, None));
            }
            // Renamed away: the ID is free on disk for a create of the same ID, and a node
            // restart deletes what is left rather than bring the sandbox back.
            let trash = dir.discard(&gone).map_err(io)?;
            Ok((next, Some(trash)))
        })
        .await?;
        if next.state == State::Killed {
            turn.commit(None);
            if let Some(trash) = trash {
                self.janitor.delete_later(trash);
            }
            tracing::info!(sandbox_id = %id, "sandbox killed");
        } else {
            turn.commit(Some(next.clone()));
            self.note(
                id,
                &format!(
                    "sandbox {}",
                    if next.state == State::Paused {
                        "paused"
                    } else {
                        "resumed"
                    }
                ),
            );
        }
        Ok(next)
    }

    /// Starts sandbox `id` again if it is running by its record and dead by its runtime (see
    /// [`Host::revive`]), within its turn; nothing when an operation got there first.
    pub(super) async fn revive(&self, id: &str) -> Result<(), NodeError> {
        let turn = self.enter(id).await;
        let Some(record) = turn.record().filter(|r| r.state == State::Running) else {
            return Ok(());
        };
        let (runtime, dir, r) = (self.runtime.clone(), self.dir.clone(), record.clone());
        let started = blocking(move || {
            if runtime.alive(&r.view()) {
                return Ok(None);
            }
            // What is left of it (the stopped container, its link, its root's mount), then
            // a fresh start over the same files.
            let _ = runtime.kill(&r.view());
            let mut next = r.clone();
            next.pgid = runtime.start(&r.view(), &dir.home(&r.id))?;
            dir.persist(&next).map_err(io)?;
            Ok(Some(next))
        })
        .await?;
        let Some(next) = started else { return Ok(()) };
        turn.commit(Some(next.clone()));
        metrics::counter!("node_sandbox_revived_total").increment(1);
        tracing::warn!(sandbox_id = %id, pgid = next.pgid, "the sandbox's envd had died; started it again (files kept, processes afresh)");
        self.note(
            id,
            "envd died; the sandbox was started again: its files are kept, its processes are not",
        );
        Ok(())
    }
}
