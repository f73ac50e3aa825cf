//! The pure core of the ledger: what a request may contain, and what a batch of compares does
//! to a set of documents.
//!
//! Nothing here touches a database. [`plan_batch`] takes the current versions of the documents
//! a batch names and returns, for each compare, whether it committed (and at which revision) or
//! which documents conflicted, plus the final state of every document and the change-log rows
//! to write. The store then writes that plan in one transaction. Keeping the decision pure makes
//! the subtle part, versions and revisions across several compares in one batch, testable
//! without SQL.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

pub use ledger_client::{Conflict, DocKey, Document};

/// Largest payload a document may carry.
pub const MAX_PAYLOAD_BYTES: usize = 1024 * 1024;
/// Longest id, in bytes.
pub const MAX_KEY_BYTES: usize = 512;
/// Longest kind, in bytes (kinds are a service's few names; the bound keeps a document's key
/// within every backend's index limits, MariaDB's the tightest).
pub const MAX_KIND_BYTES: usize = 128;
/// Most entries one compare may name.
pub const MAX_ENTRIES: usize = 128;

/// What one compare entry does to its document once every expected version matched.
#[derive(Clone, Debug)]
pub enum Action {
    /// Create or replace the payload (validated JSON text).
    Put(Arc<str>),
    /// Remove the document.
    Delete,
    /// Write nothing: the version is only a guard.
    Check,
}

/// One document a compare names: the version it must be at, and what to do to it.
#[derive(Clone, Debug)]
pub struct Entry {
    pub key: DocKey,
    /// 0 means "must not exist".
    pub expected_version: u64,
    /// When non-zero, the revision the document must have been created at (a document
    /// deleted and created again restarts its version at 1; this tells the two apart).
    pub expected_create_revision: u64,
    pub action: Action,
}

/// A request the ledger refuses before touching anything.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

fn invalid(msg: impl Into<String>) -> Invalid {
    Invalid(msg.into())
}

/// Checks a kind and id: non-empty, at most [`MAX_KIND_BYTES`] and [`MAX_KEY_BYTES`], no
/// control characters.
pub fn validate_key(kind: &str, id: &str) -> Result<(), Invalid> {
    for (what, value, max) in [("kind", kind, MAX_KIND_BYTES), ("id", id, MAX_KEY_BYTES)] {
        if value.is_empty() {
            return Err(invalid(format!("{what} must not be empty")));
        }
        if value.len() > max {
            return Err(invalid(format!(
                "{what} is {} bytes; at most {max} are allowed",
                value.len()
            )));
        }
        if value.chars().any(char::is_control) {
            return Err(invalid(format!("{what} {value:?} contains a control character")));
        }
    }
    Ok(())
}

/// Checks a payload: at most [`MAX_PAYLOAD_BYTES`] and one well-formed JSON value.
pub fn validate_payload(key: &DocKey, json: &str) -> Result<(), Invalid> {
    if json.len() > MAX_PAYLOAD_BYTES {
        return Err(invalid(format!(
            "payload of {key} is {} bytes; at most {MAX_PAYLOAD_BYTES} are allowed",
            json.len()
        )));
    }
    serde_json::from_str::<serde::de::IgnoredAny>(json)
        .map_err(|err| invalid(format!("payload of {key} is not JSON: {err}")))?;
    Ok(())
}

/// Checks a whole compare: 1 to [`MAX_ENTRIES`] entries, each document named once, valid keys
/// and payloads, and no delete of a document expected not to exist.
pub fn validate_entries(entries: &[Entry]) -> Result<(), Invalid> {
    if entries.is_empty() {
        return Err(invalid("a compare needs at least one entry"));
    }
    if entries.len() > MAX_ENTRIES {
        return Err(invalid(format!(
            "a compare names {} documents; at most {MAX_ENTRIES} are allowed",
            entries.len()
        )));
    }
    let mut seen = HashSet::with_capacity(entries.len());
    for entry in entries {
        validate_key(&entry.key.kind, &entry.key.id)?;
        if !seen.insert(&entry.key) {
            return Err(invalid(format!("{} is named twice in one compare", entry.key)));
        }
        match &entry.action {
            Action::Put(json) => validate_payload(&entry.key, json)?,
            Action::Delete if entry.expected_version == 0 => {
                return Err(invalid(format!(
                    "delete of {} expects version 0 (absent): nothing to delete",
                    entry.key
                )))
            }
            Action::Delete | Action::Check => {}
        }
    }
    Ok(())
}

/// The smallest string greater than every string that starts with `prefix`, under byte-wise
/// order: the exclusive upper end of a prefix range. `None` when the prefix is empty (no upper bound) or cannot
/// be bounded (ends in the largest code point).
pub fn prefix_upper_bound(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        let next = (last as u32 + 1..=char::MAX as u32).find_map(char::from_u32);
        if let Some(next) = next {
            chars.push(next);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

/// What a document is now, as far as one batch is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Current {
    pub version: u64,
    pub create_revision: u64,
}

/// The answer to one compare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every guard held. `versions` follows the request's entry order (0 for a delete).
    Committed {
        revision: u64,
        versions: Vec<(DocKey, u64)>,
    },
    /// Nothing was applied; every mismatching entry is named.
    Conflicted { revision: u64, conflicts: Vec<Conflict> },
}

/// The state a document ends a batch in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinalState {
    Put {
        version: u64,
        create_revision: u64,
        mod_revision: u64,
        payload: Arc<str>,
    },
    Deleted,
}

/// One row of the change log: what Watch replays.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub revision: u64,
    /// Position within the revision (a compare may write several documents).
    pub seq: u32,
    pub key: DocKey,
    /// 0 for a delete.
    pub version: u64,
    pub create_revision: u64,
    /// `None` for a delete.
    pub payload: Option<Arc<str>>,
}

/// Everything one batch writes.
#[derive(Debug, Default)]
pub struct BatchPlan {
    pub outcomes: Vec<Outcome>,
    pub finals: BTreeMap<DocKey, FinalState>,
    pub changes: Vec<Change>,
    /// The ledger's revision after the batch.
    pub head: u64,
}

/// Applies `compares` in order to the documents described by `current` (a key absent from it
/// does not exist), starting from revision `head`.
///
/// Each compare that writes something gets the next revision; a compare that only checks
/// versions commits at the current revision without using one up; a compare whose guards do
/// not all hold changes nothing and names every mismatching entry. Later compares in the batch
/// see the effect of earlier ones, exactly as if each had been its own transaction.
pub fn plan_batch(current: &HashMap<DocKey, Current>, compares: &[Vec<Entry>], head: u64) -> BatchPlan {
    let mut state: HashMap<&DocKey, Option<Current>> = HashMap::new();
    let mut plan = BatchPlan {
        head,
        ..BatchPlan::default()
    };
    for entries in compares {
        let version_of = |state: &HashMap<&DocKey, Option<Current>>, key: &DocKey| -> Option<Current> {
            match state.get(key) {
                Some(seen) => *seen,
                None => current.get(key).copied(),
            }
        };
        let conflicts: Vec<Conflict> = entries
            .iter()
            .filter_map(|entry| {
                let found = version_of(&state, &entry.key);
                let now = found.map_or(0, |c| c.version);
                let recreated = entry.expected_create_revision != 0
                    && found.is_some_and(|c| c.create_revision != entry.expected_create_revision);
                (now != entry.expected_version || recreated).then(|| Conflict {
                    key: entry.key.clone(),
                    expected_version: entry.expected_version,
                    current_version: now,
                })
            })
            .collect();
        if !conflicts.is_empty() {
            plan.outcomes.push(Outcome::Conflicted {
                revision: plan.head,
                conflicts,
            });
            continue;
        }
        let writes = entries.iter().any(|e| !matches!(e.action, Action::Check));
        let revision = if writes { plan.head + 1 } else { plan.head };
        let mut versions = Vec::with_capacity(entries.len());
        let mut seq = 0u32;
        for entry in entries {
            let before = version_of(&state, &entry.key);
            match &entry.action {
                Action::Check => versions.push((entry.key.clone(), before.map_or(0, |c| c.version))),
                Action::Put(payload) => {
                    let after = Current {
                        version: before.map_or(1, |c| c.version + 1),
                        create_revision: before.map_or(revision, |c| c.create_revision),
                    };
                    state.insert(&entry.key, Some(after));
                    plan.finals.insert(
                        entry.key.clone(),
                        FinalState::Put {
                            version: after.version,
                            create_revision: after.create_revision,
                            mod_revision: revision,
                            payload: payload.clone(),
                        },
                    );
                    plan.changes.push(Change {
                        revision,
                        seq,
                        key: entry.key.clone(),
                        version: after.version,
                        create_revision: after.create_revision,
                        payload: Some(payload.clone()),
                    });
                    seq += 1;
                    versions.push((entry.key.clone(), after.version));
                }
                Action::Delete => {
                    state.insert(&entry.key, None);
                    plan.finals.insert(entry.key.clone(), FinalState::Deleted);
                    plan.changes.push(Change {
                        revision,
                        seq,
                        key: entry.key.clone(),
                        version: 0,
                        create_revision: before.map_or(0, |c| c.create_revision),
                        payload: None,
                    });
                    seq += 1;
                    versions.push((entry.key.clone(), 0));
                }
            }
        }
        plan.head = revision;
        plan.outcomes.push(Outcome::Committed { revision, versions });
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> DocKey {
        DocKey::new("node", id)
    }

    fn put(id: &str, expected: u64, json: &str) -> Entry {
        Entry {
            key: key(id),
            expected_version: expected,
            expected_create_revision: 0,
            action: Action::Put(Arc::from(json)),
        }
    }

    fn at(version: u64, create_revision: u64) -> Current {
        Current {
            version,
            create_revision,
        }
    }

    #[test]
    fn create_then_update_in_one_batch_takes_two_revisions() {
        let plan = plan_batch(&HashMap::new(), &[vec![put("a", 0, "1")], vec![put("a", 1, "2")]], 10);
        assert_eq!(plan.head, 12);
        assert_eq!(
            plan.outcomes,
            vec![
                Outcome::Committed {
                    revision: 11,
                    versions: vec![(key("a"), 1)]
                },
                Outcome::Committed {
                    revision: 12,
                    versions: vec![(key("a"), 2)]
                },
            ]
        );
        assert_eq!(
            plan.finals[&key("a")],
            FinalState::Put {
                version: 2,
                create_revision: 11,
                mod_revision: 12,
                payload: Arc::from("2")
            }
        );
        assert_eq!(plan.changes.len(), 2);
    }

    #[test]
    fn a_conflict_names_every_mismatch_and_changes_nothing() {
        let current = HashMap::from([(key("a"), at(3, 1)), (key("b"), at(5, 2))]);
        let compare = vec![put("a", 3, "{}"), put("b", 4, "{}"), put("c", 1, "{}")];
        let plan = plan_batch(&current, &[compare], 7);
        assert_eq!(plan.head, 7);
        assert!(plan.finals.is_empty() && plan.changes.is_empty());
        let Outcome::Conflicted { conflicts, revision } = &plan.outcomes[0] else {
            panic!("expected a conflict, got {:?}", plan.outcomes[0]);
        };
        assert_eq!(*revision, 7);
        let named: Vec<_> = conflicts
            .iter()
            .map(|c| (c.key.id.as_str(), c.current_version))
            .collect();
        assert_eq!(named, vec![("b", 5), ("c", 0)]);
    }

    #[test]
    fn second_writer_of_the_same_version_loses() {
        let current = HashMap::from([(key("a"), at(1, 1))]);
        let plan = plan_batch(&current, &[vec![put("a", 1, "\"x\"")], vec![put("a", 1, "\"y\"")]], 1);
        assert!(matches!(plan.outcomes[0], Outcome::Committed { revision: 2, .. }));
        assert!(
            matches!(&plan.outcomes[1], Outcome::Conflicted { conflicts, .. } if conflicts[0].current_version == 2)
        );
    }

    #[test]
    fn delete_then_recreate_resets_create_revision() {
        let current = HashMap::from([(key("a"), at(4, 2))]);
        let delete = Entry {
            key: key("a"),
            expected_version: 4,
            expected_create_revision: 0,
            action: Action::Delete,
        };
        let plan = plan_batch(&current, &[vec![delete], vec![put("a", 0, "[]")]], 9);
        assert_eq!(
            plan.finals[&key("a")],
            FinalState::Put {
                version: 1,
                create_revision: 11,
                mod_revision: 11,
                payload: Arc::from("[]")
            }
        );
        assert_eq!(plan.changes[0].version, 0);
        assert_eq!(plan.changes[0].payload, None);
    }

    #[test]
    fn check_only_compare_uses_no_revision() {
        let current = HashMap::from([(key("lease"), at(2, 1))]);
        let check = Entry {
            key: key("lease"),
            expected_version: 2,
            expected_create_revision: 0,
            action: Action::Check,
        };
        let plan = plan_batch(&current, &[vec![check]], 5);
        assert_eq!(plan.head, 5);
        assert_eq!(
            plan.outcomes[0],
            Outcome::Committed {
                revision: 5,
                versions: vec![(key("lease"), 2)]
            }
        );
    }

    #[test]
    fn multi_document_compare_shares_one_revision() {
        let plan = plan_batch(&HashMap::new(), &[vec![put("a", 0, "1"), put("b", 0, "2")]], 0);
        assert_eq!(plan.head, 1);
        let seqs: Vec<_> = plan.changes.iter().map(|c| (c.revision, c.seq)).collect();
        assert_eq!(seqs, vec![(1, 0), (1, 1)]);
    }

    #[test]
    fn validation_rejects_what_it_should() {
        assert!(validate_key("", "x").is_err());
        assert!(validate_key("k", "").is_err());
        assert!(validate_key("k", "a\nb").is_err());
        assert!(validate_key("k", &"x".repeat(MAX_KEY_BYTES + 1)).is_err());
        assert!(validate_key(&"k".repeat(MAX_KIND_BYTES + 1), "x").is_err());
        assert!(validate_key(&"k".repeat(MAX_KIND_BYTES), &"x".repeat(MAX_KEY_BYTES)).is_ok());
        assert!(validate_payload(&key("a"), "{not json").is_err());
        assert!(validate_payload(&key("a"), &format!("\"{}\"", "x".repeat(MAX_PAYLOAD_BYTES))).is_err());
        assert!(validate_entries(&[]).is_err());
        assert!(validate_entries(&[put("a", 0, "1"), put("a", 0, "2")]).is_err());
        let delete_absent = Entry {
            key: key("a"),
            expected_version: 0,
            expected_create_revision: 0,
            action: Action::Delete,
        };
        assert!(validate_entries(&[delete_absent]).is_err());
        assert!(validate_entries(&[put("a", 0, "{\"ok\":true}")]).is_ok());
    }

    #[test]
    fn prefix_bounds_are_byte_wise() {
        assert_eq!(prefix_upper_bound(""), None);
        assert_eq!(prefix_upper_bound("sbx-"), Some("sbx.".to_string()));
        assert_eq!(prefix_upper_bound("a\u{10FFFF}"), Some("b".to_string()));
        // Skips the surrogate gap, which no `char` can hold.
        assert_eq!(prefix_upper_bound("\u{D7FF}"), Some("\u{E000}".to_string()));
    }
}
