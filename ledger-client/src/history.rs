//! A sandbox's history, from the ledger's change log: every version of its manifest that the
//! log still holds (it keeps the newest 100,000 revisions by default), each described by what
//! changed from the one before.

use std::time::Duration;

use common::docs::describe_change;
use common::docs::{SandboxDoc, SANDBOX_KIND};

use crate::{LedgerClient, LedgerError, Versioned};

/// One version of the manifest and what changed to make it.
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    pub revision: u64,
    pub version: u64,
    pub what: Vec<String>,
}

/// The manifest's versions from its creation to `current`, read from the change log. Gives
/// up (with what it has) after a few seconds; `Err` when the log no longer reaches back.
pub async fn changes(client: &LedgerClient, current: &Versioned<SandboxDoc>) -> Result<Vec<Change>, LedgerError> {
    let versions = client
        .versions(
            SANDBOX_KIND,
            &current.value.sandbox_id,
            current.create_revision,
            current.mod_revision,
            Duration::from_secs(5),
        )
        .await?;
    let mut before: Option<SandboxDoc> = None;
    let mut out = Vec::new();
    for doc in versions {
        let Ok(after) = serde_json::from_str::<SandboxDoc>(&doc.payload) else {
            continue;
        };
        out.push(Change {
            revision: doc.mod_revision,
            version: doc.version,
            what: describe_change(before.as_ref(), &after),
        });
        before = Some(after);
    }
    Ok(out)
}
