//! Documents as the ledger stores and serves them: an address (kind, id), a version that
//! counts its writes, the revisions at which it was created and last changed, and JSON text.

use std::fmt;

/// A document's address.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DocKey {
    pub kind: String,
    pub id: String,
}

impl DocKey {
    pub fn new(kind: impl Into<String>, id: impl Into<String>) -> Self {
        Self {
            kind: kind.into(),
            id: id.into(),
        }
    }
}

impl fmt::Display for DocKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind, self.id)
    }
}

/// A document as it is stored and served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    pub key: DocKey,
    /// 1 when created, +1 on every write.
    pub version: u64,
    pub create_revision: u64,
    pub mod_revision: u64,
    /// JSON text.
    pub payload: String,
}

/// A document whose version did not match what a compare expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub key: DocKey,
    pub expected_version: u64,
    /// 0 when the document does not exist.
    pub current_version: u64,
}
