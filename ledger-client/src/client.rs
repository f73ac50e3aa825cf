//! The client other services use: typed reads and compare-and-swap, and a watch that
//! survives disconnects.
//!
//! ```no_run
//! # async fn demo() -> Result<(), ledger_client::LedgerError> {
//! use ledger_client::{LedgerClient, Txn};
//! let ledger = LedgerClient::connect_lazy("http://127.0.0.1:7001", &mtls::Security::Plaintext)?;
//! // Create a document only if it does not exist yet.
//! ledger.compare(Txn::new().create("plan", "p-1", &serde_json::json!({"moves": []}))?).await?;
//! // Read it back with its version, then update exactly that version.
//! let plan = ledger.get::<serde_json::Value>("plan", "p-1").await?.expect("just created");
//! ledger.compare(Txn::new().update("plan", "p-1", plan.version, &serde_json::json!({"moves": [1]}))?).await?;
//! # Ok(()) }
//! ```

use std::time::Duration;

use common::trace::TracedChannel;
use proto::ledger::v1 as pb;
use proto::ledger::v1::ledger_client::LedgerClient as GrpcClient;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Code;

use crate::document::{Conflict, DocKey, Document};
use crate::wire;

/// What a ledger call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// A guard did not hold; nothing was written. Every mismatching document is named.
    #[error("compare failed at revision {revision}: {}", describe(.conflicts))]
    Conflict { revision: u64, conflicts: Vec<Conflict> },
    /// The ledger or its database cannot be reached, and nothing was applied; retrying later
    /// may succeed.
    #[error("ledger unavailable: {0}")]
    Unavailable(String),
    /// A write was sent and no answer says whether it landed (the connection broke, a deadline
    /// passed, the database never answered COMMIT). Never treat it as "not applied": read the
    /// documents to find out ([`LedgerClient::resolve`] does for a whole compare).
    #[error("write outcome unknown: {0}")]
    OutcomeUnknown(String),
    /// A watch asked for revisions that were compacted away: list again, then watch.
    #[error("{0}")]
    Compacted(String),
    /// The ledger refused the request as malformed.
    #[error("ledger refused the request: {0}")]
    Invalid(String),
    /// A payload is not the JSON shape the caller asked for.
    #[error("document {key} does not decode: {reason}")]
    Decode { key: DocKey, reason: String },
    /// A value could not be encoded as JSON.
    #[error("cannot encode {key} as JSON: {reason}")]
    Encode { key: DocKey, reason: String },
    #[error("bad ledger endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    /// The ledger does not take this call from this caller (no certificate of the cluster,
    /// or a role the ledger's policy does not open the method to). Nothing was applied.
    #[error("ledger refused the caller: {0}")]
    Forbidden(String),
    /// Any other status.
    #[error("ledger error: {0}")]
    Other(tonic::Status),
}

fn describe(conflicts: &[Conflict]) -> String {
    conflicts
        .iter()
        .map(|c| {
            format!(
                "{} is at version {} (expected {})",
                c.key, c.current_version, c.expected_version
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn marked(status: &tonic::Status, key: &str) -> Option<String> {
    let value = status.metadata().get(key)?;
    value.to_str().ok().map(str::to_string)
}

impl From<tonic::Status> for LedgerError {
    /// For reads, where a lost reply changes nothing: transport failures are "unavailable".
    fn from(status: tonic::Status) -> Self {
        match status.code() {
            Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded | Code::Unknown => {
                LedgerError::Unavailable(status.message().to_string())
            }
            Code::OutOfRange if marked(&status, wire::COMPACTED_HEADER).is_some() => {
                LedgerError::Compacted(status.message().to_string())
            }
            Code::InvalidArgument => LedgerError::Invalid(status.message().to_string()),
            Code::PermissionDenied | Code::Unauthenticated => LedgerError::Forbidden(status.message().to_string()),
            _ => LedgerError::Other(status),
        }
    }
}

impl LedgerError {
    /// A write's error: "unavailable" only when the ledger itself says nothing was applied;
    /// any other failure of transport or time leaves the outcome unknown.
    fn from_write(status: tonic::Status) -> Self {
        let not_applied = marked(&status, wire::OUTCOME_HEADER).as_deref() == Some(wire::OUTCOME_NOT_APPLIED);
        match status.code() {
            Code::Unavailable if not_applied => LedgerError::Unavailable(status.message().to_string()),
            Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded | Code::Unknown => {
                LedgerError::OutcomeUnknown(status.message().to_string())
            }
            _ => status.into(),
        }
    }

    /// Worth retrying later (as opposed to a conflict or a bad request). An unknown outcome is
    /// transient too, but a write must be resolved before it is retried.
    pub fn is_transient(&self) -> bool {
        matches!(self, LedgerError::Unavailable(_) | LedgerError::OutcomeUnknown(_))
    }
}

/// A document decoded into `T`, with the version to compare against when writing it back.
#[derive(Clone, Debug, PartialEq)]
pub struct Versioned<T> {
    pub key: DocKey,
    pub version: u64,
    pub create_revision: u64,
    pub mod_revision: u64,
    pub value: T,
}

impl Versioned<()> {
    /// Decodes a raw document's payload.
    pub fn decode<T: DeserializeOwned>(doc: Document) -> Result<Versioned<T>, LedgerError> {
        let value = serde_json::from_str(&doc.payload).map_err(|err| LedgerError::Decode {
            key: doc.key.clone(),
            reason: err.to_string(),
        })?;
        Ok(Versioned {
            key: doc.key,
            version: doc.version,
            create_revision: doc.create_revision,
            mod_revision: doc.mod_revision,
            value,
        })
    }
}

fn document_from_pb(doc: pb::Document) -> Document {
    Document {
        key: DocKey::new(doc.kind, doc.id),
        version: doc.version,
        create_revision: doc.create_revision,
        mod_revision: doc.mod_revision,
        payload: doc.payload_json,
    }
}

/// A compare being built: the documents it guards and what it does to each.
#[derive(Clone, Debug, Default)]
pub struct Txn {
    entries: Vec<pb::CompareEntry>,
}

impl Txn {
    pub fn new() -> Self {
        Self::default()
    }

    fn push(mut self, kind: &str, id: &str, expected_version: u64, action: pb::compare_entry::Action) -> Self {
        self.entries.push(pb::CompareEntry {
            kind: kind.to_string(),
            id: id.to_string(),
            expected_version,
            action: Some(action),
            expected_create_revision: 0,
        });
        self
    }

    fn json<T: Serialize>(kind: &str, id: &str, value: &T) -> Result<String, LedgerError> {
        serde_json::to_string(value).map_err(|err| LedgerError::Encode {
            key: DocKey::new(kind, id),
            reason: err.to_string(),
        })
    }

    /// Creates the document; fails if it exists.
    pub fn create<T: Serialize>(self, kind: &str, id: &str, value: &T) -> Result<Self, LedgerError> {
        let json = Self::json(kind, id, value)?;
        Ok(self.push(kind, id, 0, pb::compare_entry::Action::PutJson(json)))
    }

    /// Replaces the document if it is still at `version`.
    pub fn update<T: Serialize>(self, kind: &str, id: &str, version: u64, value: &T) -> Result<Self, LedgerError> {
        let json = Self::json(kind, id, value)?;
        Ok(self.push(kind, id, version, pb::compare_entry::Action::PutJson(json)))
    }

    /// Replaces the document read as `read` if it is still that document at that version:
    /// also guards its create revision, so a document deleted and created again since (whose
    /// version restarted) does not match.
    pub fn update_read<T: Serialize, R>(self, read: &Versioned<R>, value: &T) -> Result<Self, LedgerError> {
        let (kind, id) = (read.key.kind.as_str(), read.key.id.as_str());
        let mut txn = self.update(kind, id, read.version, value)?;
        if let Some(entry) = txn.entries.last_mut() {
            entry.expected_create_revision = read.create_revision;
        }
        Ok(txn)
    }

    /// Writes raw JSON text at `expected_version` (0: create).
    pub fn put_json(self, kind: &str, id: &str, expected_version: u64, json: String) -> Self {
        self.push(kind, id, expected_version, pb::compare_entry::Action::PutJson(json))
    }

    /// Deletes the document if it is still at `version`.
    pub fn delete(self, kind: &str, id: &str, version: u64) -> Self {
        self.push(kind, id, version, pb::compare_entry::Action::Delete(pb::Delete {}))
    }

    /// Deletes the document if it is still at `version` and is the one created at revision
    /// `create_revision` (a document deleted and created again since restarts its versions,
    /// as [`Txn::update_read`] guards against too).
    pub fn delete_created(self, kind: &str, id: &str, version: u64, create_revision: u64) -> Self {
        let mut txn = self.delete(kind, id, version);
        if let Some(entry) = txn.entries.last_mut() {
            entry.expected_create_revision = create_revision;
        }
        txn
    }

    /// Requires the document to be at `version` (0: absent) without writing it. Use it only for
    /// documents that must hold still for this write to be right, never for documents other
    /// writers update on their own schedule.
    pub fn check(self, kind: &str, id: &str, version: u64) -> Self {
        self.push(kind, id, version, pb::compare_entry::Action::Check(pb::Check {}))
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// What reading back a compare of unknown outcome shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// Every write of it is there.
    Landed(Committed),
    /// Every document is still at its expected version: nothing of it was applied.
    NotLanded,
    /// Some documents are neither: others wrote them since (the compare may or may not have
    /// landed first).
    Moved(Vec<Conflict>),
}

/// The same JSON value, whatever the spacing or key order of its text.
fn same_json(a: &str, b: &str) -> bool {
    a == b
        || matches!(
            (serde_json::from_str::<serde_json::Value>(a), serde_json::from_str::<serde_json::Value>(b)),
            (Ok(x), Ok(y)) if x == y
        )
}

/// A committed compare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    pub revision: u64,
    /// Each entry's resulting version, in the order the entries were added (0 for a delete).
    pub versions: Vec<u64>,
}

/// One change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    Put(Document),
    Deleted { key: DocKey, revision: u64 },
}

/// Whole revisions from a watch: `events` (possibly none) and the revision reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchUpdate {
    pub revision: u64,
    pub events: Vec<WatchEvent>,
}

/// A handle on a ledger. Cheap to clone; calls share one HTTP/2 connection.
#[derive(Clone)]
pub struct LedgerClient {
    grpc: GrpcClient<TracedChannel>,
    /// Longest a get, list or compare may take (sent to the ledger as the call's deadline too);
    /// none by default. A compare past it is an unknown outcome.
    deadline: Option<Duration>,
}

impl LedgerClient {
    /// A client for `endpoint` (`http://HOST:PORT`) that connects on first use and reconnects
    /// by itself, so a service can start before its ledger does. Under mutual TLS it proves
    /// `security`'s role and accepts only a server that proves it is the ledger.
    pub fn connect_lazy(endpoint: &str, security: &mtls::Security) -> Result<Self, LedgerError> {
        let channel = security
            .endpoint(endpoint, mtls::Role::Ledger)
            .map_err(|err| LedgerError::Endpoint {
                endpoint: endpoint.to_string(),
                reason: err.to_string(),
            })?
            .connect_timeout(Duration::from_secs(2))
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_while_idle(true)
            .connect_lazy();
        Ok(Self::from_channel(channel))
    }

    pub fn from_channel(channel: Channel) -> Self {
        Self {
            grpc: GrpcClient::new(common::trace::traced(channel)).max_decoding_message_size(wire::MAX_REPLY_BYTES),
            deadline: None,
        }
    }

    /// The same client, with every get, list and compare under `deadline`: for callers that
    /// must not wait longer than a lease they hold.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(deadline) = self.deadline {
            request.set_timeout(deadline);
        }
        request
    }

    /// One document as stored, or `None`.
    pub async fn get_raw(&self, kind: &str, id: &str) -> Result<Option<Document>, LedgerError> {
        let request = pb::GetRequest {
            kind: kind.to_string(),
            id: id.to_string(),
        };
        match self.grpc.clone().get(self.request(request)).await {
            Ok(reply) => Ok(reply.into_inner().document.map(document_from_pb)),
            Err(status) if status.code() == Code::NotFound => Ok(None),
            Err(status) => Err(status.into()),
        }
    }

    /// One document decoded into `T`, or `None`.
    pub async fn get<T: DeserializeOwned>(&self, kind: &str, id: &str) -> Result<Option<Versioned<T>>, LedgerError> {
        self.get_raw(kind, id).await?.map(Versioned::decode).transpose()
    }

    /// One page of raw documents, the next page's token (empty on the last) and the revision.
    pub async fn list_page(
        &self,
        kind: &str,
        id_prefix: &str,
        limit: u32,
        page_token: &str,
    ) -> Result<(Vec<Document>, String, u64), LedgerError> {
        let request = pb::ListRequest {
            kind: kind.to_string(),
            id_prefix: id_prefix.to_string(),
            limit,
            page_token: page_token.to_string(),
        };
        let reply = self.grpc.clone().list(self.request(request)).await?.into_inner();
        let docs = reply.documents.into_iter().map(document_from_pb).collect();
        Ok((docs, reply.next_page_token, reply.revision))
    }

    /// Every document of `kind` under `id_prefix`, decoded, and the revision of the first page
    /// (watch from it + 1 to follow what changes next).
    pub async fn list<T: DeserializeOwned>(
        &self,
        kind: &str,
        id_prefix: &str,
    ) -> Result<(Vec<Versioned<T>>, u64), LedgerError> {
        let mut all = Vec::new();
        let (mut token, mut first_revision) = (String::new(), None);
        loop {
            let (docs, next, revision) = self.list_page(kind, id_prefix, 0, &token).await?;
            first_revision.get_or_insert(revision);
            for doc in docs {
                all.push(Versioned::decode(doc)?);
            }
            if next.is_empty() {
                return Ok((all, first_revision.unwrap_or(revision)));
            }
            token = next;
        }
    }

    /// Commits `txn` atomically, or returns [`LedgerError::Conflict`] naming every document
    /// whose version did not match.
    ///
    /// A failure other than a conflict is [`LedgerError::Unavailable`] only when the ledger
    /// says nothing was applied; otherwise it is [`LedgerError::OutcomeUnknown`].
    pub async fn compare(&self, txn: Txn) -> Result<Committed, LedgerError> {
        let reply = self
            .grpc
            .clone()
            .compare(self.request(pb::CompareRequest { entries: txn.entries }))
            .await
            .map_err(LedgerError::from_write)?
            .into_inner();
        if reply.succeeded {
            Ok(Committed {
                revision: reply.revision,
                versions: reply.versions.into_iter().map(|v| v.version).collect(),
            })
        } else {
            Err(LedgerError::Conflict {
                revision: reply.revision,
                conflicts: reply
                    .conflicts
                    .into_iter()
                    .map(|c| Conflict {
                        key: DocKey::new(c.kind, c.id),
                        expected_version: c.expected_version,
                        current_version: c.current_version,
                    })
                    .collect(),
            })
        }
    }

    /// Reads back what a compare whose outcome is unknown wrote, and says whether it landed:
    /// every document it puts holds exactly its payload at the version after the expected one
    /// (and every document it deletes is gone) — landed; every document is still at its
    /// expected version — not landed (compares are atomic); anything else — the documents
    /// moved on, and only the caller's knowledge of them can tell.
    pub async fn resolve(&self, txn: &Txn) -> Result<Resolution, LedgerError> {
        let (mut landed, mut not_landed, mut moved) = (Vec::new(), 0, Vec::new());
        for entry in &txn.entries {
            let key = DocKey::new(entry.kind.clone(), entry.id.clone());
            let ours = match &entry.action {
                Some(pb::compare_entry::Action::PutJson(json)) => Some(json),
                Some(pb::compare_entry::Action::Delete(_)) => None,
                Some(pb::compare_entry::Action::Check(_)) | None => continue,
            };
            let current = self.get_raw(&entry.kind, &entry.id).await?;
            let version = current.as_ref().map_or(0, |d| d.version);
            if version == entry.expected_version {
                not_landed += 1;
                continue;
            }
            let shows_ours = match (ours, &current) {
                (Some(json), Some(doc)) => version == entry.expected_version + 1 && same_json(json, &doc.payload),
                (None, None) => true,
                _ => false,
            };
            if shows_ours {
                landed.push((version, current.map_or(0, |d| d.mod_revision)));
            } else {
                moved.push(Conflict {
                    key,
                    expected_version: entry.expected_version,
                    current_version: version,
                });
            }
        }
        Ok(match (landed.is_empty(), not_landed, moved.is_empty()) {
            (false, 0, true) => Resolution::Landed(Committed {
                revision: landed.iter().map(|&(_, r)| r).max().unwrap_or(0),
                versions: landed.into_iter().map(|(v, _)| v).collect(),
            }),
            (true, _, true) => Resolution::NotLanded,
            _ => Resolution::Moved(moved),
        })
    }

    /// [`compare`](Self::compare), resolving an unknown outcome by reading: a write that landed
    /// is returned as committed, one that did not is sent again, one whose documents moved on
    /// is a [`LedgerError::Conflict`]. Gives up with `OutcomeUnknown` only when the ledger stays
    /// unreadable through `attempts` tries.
    ///
    /// "Landed" means the documents hold what this write puts (or are gone, for a delete) at
    /// the version it expected plus one: for a write another writer may make identically
    /// (two deleting one document), that is the state asked for, whoever made it.
    ///
    /// "Not landed" is only what the read saw: a commit still under way in the database (its
    /// caller's deadline passed, the database had not finished) may land after it. So once an
    /// outcome was unknown, a conflict on sending again is read back too: it may be the first
    /// send's own write, which is this write committed, not another writer's.
    pub async fn compare_resolving(&self, txn: Txn, attempts: usize) -> Result<Committed, LedgerError> {
        let mut pauses = common::retry::backoff(Duration::from_millis(50), Duration::from_secs(1)).take(attempts);
        let mut sent_before = false;
        'send: loop {
            let why = match self.compare(txn.clone()).await {
                Err(LedgerError::OutcomeUnknown(why)) => why,
                Err(conflict @ LedgerError::Conflict { .. }) if sent_before => loop {
                    match self.resolve(&txn).await {
                        Ok(Resolution::Landed(committed)) => {
                            tracing::info!("a send whose outcome was unknown landed after it was read back");
                            return Ok(committed);
                        }
                        Ok(_) => return Err(conflict),
                        Err(err) if err.is_transient() => {}
                        Err(err) => return Err(err),
                    }
                    // Ours or another writer's: only a read can tell.
                    let Some(pause) = pauses.next() else {
                        return Err(LedgerError::OutcomeUnknown(
                            "a conflict after an unknown outcome could not be read back".to_string(),
                        ));
                    };
                    tokio::time::sleep(pause).await;
                },
                other => return other,
            };
            sent_before = true;
            tracing::warn!(%why, "compare outcome unknown; reading back");
            loop {
                match self.resolve(&txn).await {
                    Ok(Resolution::Landed(committed)) => return Ok(committed),
                    Ok(Resolution::NotLanded) => continue 'send,
                    Ok(Resolution::Moved(conflicts)) => {
                        return Err(LedgerError::Conflict { revision: 0, conflicts });
                    }
                    Err(err) if err.is_transient() => {}
                    Err(err) => return Err(err),
                }
                let Some(pause) = pauses.next() else {
                    return Err(LedgerError::OutcomeUnknown(why));
                };
                tokio::time::sleep(pause).await;
            }
        }
    }

    /// Every version of document `kind/id` the change log still holds, from `from_revision`
    /// (its create revision, for all of them) up to `until_revision`, oldest first. Gives
    /// up after `patience` with what it has; `Err(Compacted)` when the log no longer
    /// reaches back that far.
    pub async fn versions(
        &self,
        kind: &str,
        id: &str,
        from_revision: u64,
        until_revision: u64,
        patience: Duration,
    ) -> Result<Vec<Document>, LedgerError> {
        use tokio_stream::StreamExt;
        let mut watch = self.watch(kind, id, from_revision.max(1));
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + patience;
        while let Ok(Some(update)) = tokio::time::timeout_at(deadline, watch.next()).await {
            let update = update?;
            // The prefix also matches longer IDs; keep this one's.
            out.extend(update.events.into_iter().filter_map(|event| match event {
                WatchEvent::Put(doc) if doc.key.id == id => Some(doc),
                _ => None,
            }));
            if update.revision >= until_revision {
                break;
            }
        }
        Ok(out)
    }

    /// Follows every change to `kind` documents under `id_prefix` (every kind when `kind` is
    /// empty) from `start_revision` on (0: from the next change).
    ///
    /// The stream reconnects by itself after a disconnect or a ledger restart and resumes
    /// right after the last revision it delivered, so it neither skips nor repeats a revision.
    /// It ends with [`LedgerError::Compacted`] if it fell so far behind that the ledger no
    /// longer has the revisions it needs, or with another non-transient error.
    pub fn watch(
        &self,
        kind: &str,
        id_prefix: &str,
        start_revision: u64,
    ) -> ReceiverStream<Result<WatchUpdate, LedgerError>> {
        let (tx, rx) = mpsc::channel(64);
        let follower = Follower {
            grpc: self.grpc.clone(),
            kind: kind.to_string(),
            id_prefix: id_prefix.to_string(),
            next: start_revision,
            tx,
        };
        tokio::spawn(follower.run());
        ReceiverStream::new(rx)
    }
}

/// The task behind [`LedgerClient::watch`].
struct Follower {
    grpc: GrpcClient<TracedChannel>,
    kind: String,
    id_prefix: String,
    /// The next revision wanted; 0 until the first response when starting "from now".
    next: u64,
    tx: mpsc::Sender<Result<WatchUpdate, LedgerError>>,
}

impl Follower {
    async fn run(mut self) {
        let pauses = || common::retry::backoff(Duration::from_millis(50), Duration::from_secs(2));
        let mut backoff = pauses();
        loop {
            let request = pb::WatchRequest {
                start_revision: self.next,
                kind: self.kind.clone(),
                id_prefix: self.id_prefix.clone(),
            };
            let result = self.grpc.watch(request).await;
            let error = match result {
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    loop {
                        let message = tokio::select! {
                            message = stream.message() => message,
                            () = self.tx.closed() => return,
                        };
                        match message {
                            Ok(Some(response)) => {
                                backoff = pauses();
                                if !self.forward(response).await {
                                    return;
                                }
                            }
                            Ok(None) => break LedgerError::Unavailable("watch stream ended".to_string()),
                            Err(status) => break LedgerError::from(status),
                        }
                    }
                }
                Err(status) => LedgerError::from(status),
            };
            if !error.is_transient() {
                let _ = self.tx.send(Err(error)).await;
                return;
            }
            tracing::debug!(%error, next = self.next, "watch interrupted; resuming");
            let pause = backoff.next().unwrap_or(Duration::from_secs(2));
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = self.tx.closed() => return,
            }
        }
    }

    /// Hands one response to the consumer; `false` once the consumer is gone.
    async fn forward(&mut self, response: pb::WatchResponse) -> bool {
        // Whole revisions only: anything below the next wanted revision is a repeat.
        let floor = self.next;
        let events: Vec<WatchEvent> = response
            .events
            .into_iter()
            .filter_map(|event| {
                let doc = event.document?;
                if doc.mod_revision < floor {
                    return None;
                }
                Some(if event.r#type == pb::event::Type::Delete as i32 {
                    WatchEvent::Deleted {
                        revision: doc.mod_revision,
                        key: DocKey::new(doc.kind, doc.id),
                    }
                } else {
                    WatchEvent::Put(document_from_pb(doc))
                })
            })
            .collect();
        if response.revision < floor && events.is_empty() {
            return true;
        }
        self.next = floor.max(response.revision + 1);
        self.tx
            .send(Ok(WatchUpdate {
                revision: response.revision,
                events,
            }))
            .await
            .is_ok()
    }
}
