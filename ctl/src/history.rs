//! A sandbox's history, from the ledger's change log: every version of its manifest that the
//! log still holds (it keeps the newest 100,000 revisions by default), each described by what
//! changed from the one before.

use std::time::Duration;

use common::docs::{SandboxDoc, SANDBOX_KIND};
use ledger_client::{LedgerClient, LedgerError, Versioned, WatchEvent};
use tokio_stream::StreamExt;

/// One version of the manifest and what changed to make it.
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    pub revision: u64,
    pub version: u64,
    pub what: Vec<String>,
}

/// What changed from `before` (none: the manifest was created) to `after`, in words.
pub fn describe(before: Option<&SandboxDoc>, after: &SandboxDoc) -> Vec<String> {
    let node = |d: &SandboxDoc| {
        if d.node_id.is_empty() {
            "no node".to_string()
        } else {
            d.node_id.clone()
        }
    };
    let Some(b) = before else {
        return vec![format!("created: {:?} on {}", after.phase, node(after))];
    };
    let mut what = Vec::new();
    if b.phase != after.phase {
        what.push(format!("{:?} -> {:?}", b.phase, after.phase));
    }
    if b.node_id != after.node_id {
        what.push(format!("moved {} -> {}", node(b), node(after)));
    }
    if b.epoch != after.epoch {
        what.push(format!("epoch {} -> {}", b.epoch, after.epoch));
    }
    match (&b.lifecycle_owner, &after.lifecycle_owner) {
        (None, Some(owner)) => what.push(format!("owned by {owner}")),
        (Some(owner), None) => what.push(format!("released by {owner}")),
        (Some(x), Some(y)) if x != y => what.push(format!("owner {x} -> {y}")),
        _ => {}
    }
    if b.end_at_unix_ms != after.end_at_unix_ms {
        what.push(format!("ends at {} ms", after.end_at_unix_ms));
    }
    if what.is_empty() {
        what.push("rewritten".to_string());
    }
    what
}

/// The manifest's versions from its creation to `current`, read from the change log. Gives
/// up (with what it has) after a few seconds; `Err` when the log no longer reaches back.
pub async fn changes(client: &LedgerClient, current: &Versioned<SandboxDoc>) -> Result<Vec<Change>, LedgerError> {
    let id = current.value.sandbox_id.as_str();
    let mut watch = client.watch(SANDBOX_KIND, id, current.create_revision);
    let mut before: Option<SandboxDoc> = None;
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while let Ok(Some(update)) = tokio::time::timeout_at(deadline, watch.next()).await {
        let update = update?;
        for event in update.events {
            // The prefix also matches longer ids; keep this one's.
            let WatchEvent::Put(doc) = event else { continue };
            if doc.key.id != id {
                continue;
            }
            let Ok(after) = serde_json::from_str::<SandboxDoc>(&doc.payload) else {
                continue;
            };
            out.push(Change {
                revision: doc.mod_revision,
                version: doc.version,
                what: describe(before.as_ref(), &after),
            });
            before = Some(after);
        }
        if update.revision >= current.mod_revision {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::docs::SandboxPhase;

    fn doc(phase: SandboxPhase, node: &str, epoch: u64, owner: Option<&str>) -> SandboxDoc {
        SandboxDoc {
            sandbox_id: "s".into(),
            phase,
            node_id: node.into(),
            epoch,
            end_at_unix_ms: 10,
            lifecycle_owner: owner.map(str::to_string),
            ..SandboxDoc::default()
        }
    }

    #[test]
    fn a_move_reads_as_owned_then_moved_and_released() {
        let running = doc(SandboxPhase::Running, "a", 1, None);
        let owned = doc(SandboxPhase::Running, "a", 2, Some("plan.0"));
        let moved = doc(SandboxPhase::Running, "b", 2, None);
        assert_eq!(describe(None, &running), vec!["created: Running on a"]);
        assert_eq!(
            describe(Some(&running), &owned),
            vec!["epoch 1 -> 2", "owned by plan.0"]
        );
        assert_eq!(
            describe(Some(&owned), &moved),
            vec!["moved a -> b", "released by plan.0"]
        );
        let paused = doc(SandboxPhase::Paused, "b", 2, None);
        assert_eq!(describe(Some(&moved), &paused), vec!["Running -> Paused"]);
        assert_eq!(describe(Some(&paused), &paused), vec!["rewritten"]);
    }
}
