//! The gRPC face of the ledger: turns requests into the core's types, calls the store or the
//! committer, and maps every failure to a status in one place ([`ApiError`]).

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use mtls::CertificateDer;
use proto::ledger::v1 as pb;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use ledger_client::wire::{COMPACTED_HEADER, OUTCOME_HEADER, OUTCOME_NOT_APPLIED, OUTCOME_UNKNOWN, REPLY_BYTES};

use crate::committer::Committer;
use crate::head::HeadTracker;
use crate::model::{self, Action, Conflict, DocKey, Document, Entry, Invalid, Outcome};
use crate::store::{Filter, Store, StoreError};

/// Documents a List returns when the caller does not say.
const DEFAULT_PAGE: u32 = 500;
/// Most documents one List page may return.
const MAX_PAGE: u32 = 5000;
/// Most revisions one watch read covers: bounds memory for a watcher far behind.
const WATCH_WINDOW: u64 = 1000;
/// How often an idle watch stream reports the revision it has reached.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// Everything a request can fail with, and its status.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Invalid(#[from] Invalid),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0} does not exist")]
    NotFound(DocKey),
    #[error("revision {requested} was compacted; the oldest revision a watch can start at is {oldest}")]
    Compacted { requested: u64, oldest: u64 },
    /// The caller's role does not own the kind it tried to write (see [`crate::writers`]).
    #[error("{role} may not write {kind} documents ({kind}/{id})")]
    NotOwner { role: String, kind: String, id: String },
}

impl From<ApiError> for Status {
    fn from(err: ApiError) -> Self {
        let message = err.to_string();
        let marked = |mut status: Status, key: &'static str, value: &str| {
            if let Ok(value) = value.parse() {
                status.metadata_mut().insert(key, value);
            }
            status
        };
        match err {
            ApiError::Invalid(_) => Status::invalid_argument(message),
            // The marker is what lets a client tell this ledger's "nothing was applied" from a
            // transport failure, after which a write's outcome is unknown.
            ApiError::Store(StoreError::Unavailable(_)) => {
                marked(Status::unavailable(message), OUTCOME_HEADER, OUTCOME_NOT_APPLIED)
            }
            ApiError::Store(StoreError::OutcomeUnknown(_)) => {
                marked(Status::unknown(message), OUTCOME_HEADER, OUTCOME_UNKNOWN)
            }
            ApiError::Store(StoreError::Internal(_) | StoreError::BadUrl { .. }) => Status::internal(message),
            ApiError::NotFound(_) => Status::not_found(message),
            ApiError::NotOwner { .. } => Status::permission_denied(message),
            ApiError::Compacted { oldest, .. } => {
                marked(Status::out_of_range(message), COMPACTED_HEADER, &oldest.to_string())
            }
        }
    }
}

/// The `Ledger` gRPC service.
#[derive(Clone)]
pub struct LedgerApi {
    store: Store,
    committer: Committer,
    head: HeadTracker,
    shutdown: watch::Receiver<bool>,
    /// Hold every write to who owns its kind (under mutual TLS, where callers have roles).
    owners: bool,
}

impl LedgerApi {
    /// `shutdown` turning `true` ends every watch stream, so a graceful stop is not held open
    /// by watchers (they reconnect elsewhere and resume from their last revision).
    pub fn new(store: Store, committer: Committer, head: HeadTracker, shutdown: watch::Receiver<bool>) -> Self {
        Self {
            store,
            committer,
            head,
            shutdown,
            owners: false,
        }
    }

    /// Every write must come from a role that owns its document's kind.
    pub fn with_owners(mut self, enforced: bool) -> Self {
        self.owners = enforced;
        self
    }
}

/// Refuses a batch that writes a kind the caller's role does not own.
fn check_owners(certs: Option<&[CertificateDer<'_>]>, entries: &[Entry]) -> Result<(), ApiError> {
    let role = certs.and_then(|certs| certs.first().and_then(|cert| mtls::authorize::role_of(cert)));
    let Some(role) = role else {
        // The transport let through no role: refuse every write, name none.
        return match entries.iter().find(|e| !matches!(e.action, Action::Check)) {
            Some(entry) => Err(ApiError::NotOwner {
                role: "a caller without a role".into(),
                kind: entry.key.kind.clone(),
                id: entry.key.id.clone(),
            }),
            None => Ok(()),
        };
    };
    match crate::writers::refused(role, entries) {
        Some(entry) => Err(ApiError::NotOwner {
            role: role.to_string(),
            kind: entry.key.kind.clone(),
            id: entry.key.id.clone(),
        }),
        None => Ok(()),
    }
}

pub(crate) fn document_to_pb(doc: Document) -> pb::Document {
    pb::Document {
        kind: doc.key.kind,
        id: doc.key.id,
        version: doc.version,
        create_revision: doc.create_revision,
        mod_revision: doc.mod_revision,
        payload_json: doc.payload,
    }
}

fn entry_from_pb(entry: pb::CompareEntry) -> Result<Entry, Invalid> {
    let key = DocKey::new(entry.kind, entry.id);
    let action = match entry.action {
        Some(pb::compare_entry::Action::PutJson(json)) => Action::Put(Arc::from(json)),
        Some(pb::compare_entry::Action::Delete(_)) => Action::Delete,
        Some(pb::compare_entry::Action::Check(_)) => Action::Check,
        None => {
            return Err(Invalid(format!(
                "entry for {key} has no action (put_json, delete or check)"
            )))
        }
    };
    Ok(Entry {
        key,
        expected_version: entry.expected_version,
        expected_create_revision: entry.expected_create_revision,
        action,
    })
}

fn conflict_to_pb(c: Conflict) -> pb::Conflict {
    pb::Conflict {
        kind: c.key.kind,
        id: c.key.id,
        expected_version: c.expected_version,
        current_version: c.current_version,
    }
}

fn change_to_event(change: model::Change) -> pb::Event {
    let deleted = change.payload.is_none();
    pb::Event {
        r#type: if deleted {
            pb::event::Type::Delete
        } else {
            pb::event::Type::Put
        } as i32,
        document: Some(pb::Document {
            kind: change.key.kind,
            id: change.key.id,
            version: change.version,
            create_revision: change.create_revision,
            mod_revision: change.revision,
            payload_json: change.payload.map(|p| p.to_string()).unwrap_or_default(),
        }),
    }
}

fn filter_from_pb(req: &pb::WatchRequest) -> Result<Filter, Invalid> {
    if !req.id_prefix.is_empty() && req.kind.is_empty() {
        return Err(Invalid("id_prefix needs a kind".to_string()));
    }
    if !req.kind.is_empty() {
        model::validate_key(&req.kind, "x")?;
    }
    Ok(Filter {
        kind: req.kind.clone(),
        id_prefix: req.id_prefix.clone(),
    })
}

/// Page tokens are the last id of the previous page, hex-encoded so callers treat them as
/// opaque.
fn encode_token(id: &str) -> String {
    id.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_token(token: &str) -> Result<String, Invalid> {
    let bad = || Invalid(format!("page_token {token:?} is not one this ledger issued"));
    if !token.len().is_multiple_of(2) {
        return Err(bad());
    }
    let bytes = (0..token.len())
        .step_by(2)
        .map(|i| token.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(bad)?;
    String::from_utf8(bytes).map_err(|_| bad())
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::ledger_server::Ledger for LedgerApi {
    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        let req = request.into_inner();
        model::validate_key(&req.kind, &req.id).map_err(ApiError::from)?;
        let key = DocKey::new(req.kind, req.id);
        let (doc, revision) = self.store.get(&key).await.map_err(ApiError::from)?;
        let doc = doc.ok_or(ApiError::NotFound(key))?;
        Ok(Response::new(pb::GetResponse {
            document: Some(document_to_pb(doc)),
            revision,
        }))
    }

    async fn list(&self, request: Request<pb::ListRequest>) -> Result<Response<pb::ListResponse>, Status> {
        let req = request.into_inner();
        model::validate_key(&req.kind, if req.id_prefix.is_empty() { "x" } else { &req.id_prefix })
            .map_err(ApiError::from)?;
        if req.limit > MAX_PAGE {
            return Err(ApiError::Invalid(Invalid(format!(
                "limit {} is over the maximum of {MAX_PAGE}",
                req.limit
            )))
            .into());
        }
        let limit = if req.limit == 0 { DEFAULT_PAGE } else { req.limit };
        let after = decode_token(&req.page_token).map_err(ApiError::from)?;
        // One more than asked tells whether another page follows.
        let (mut docs, revision) = self
            .store
            .list(&req.kind, &req.id_prefix, &after, limit + 1)
            .await
            .map_err(ApiError::from)?;
        // A page also ends once it holds REPLY_BYTES of payload (always at least one document).
        let mut bytes = 0;
        let fits = docs
            .iter()
            .position(|doc| {
                bytes += doc.payload.len() + doc.key.id.len();
                bytes > REPLY_BYTES
            })
            .map_or(docs.len(), |i| i.max(1));
        let next_page_token = if docs.len() > (limit as usize).min(fits) {
            docs.truncate((limit as usize).min(fits));
            docs.last().map(|d| encode_token(&d.key.id)).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListResponse {
            documents: docs.into_iter().map(document_to_pb).collect(),
            next_page_token,
            revision,
        }))
    }

    async fn compare(&self, request: Request<pb::CompareRequest>) -> Result<Response<pb::CompareResponse>, Status> {
        let caller = request.peer_certs();
        let entries = request
            .into_inner()
            .entries
            .into_iter()
            .map(entry_from_pb)
            .collect::<Result<Vec<_>, _>>()
            .map_err(ApiError::from)?;
        model::validate_entries(&entries).map_err(ApiError::from)?;
        if self.owners {
            check_owners(caller.as_deref().map(Vec::as_slice), &entries)?;
        }
        let started = std::time::Instant::now();
        let outcome = self.committer.submit(entries).await;
        metrics::histogram!("ledger_compare_duration_seconds").record(started.elapsed().as_secs_f64());
        let outcome =
            outcome.inspect_err(|_| metrics::counter!("ledger_compares_total", "outcome" => "error").increment(1));
        let reply = match outcome.map_err(ApiError::from)? {
            Outcome::Committed { revision, versions } => {
                metrics::counter!("ledger_compares_total", "outcome" => "committed").increment(1);
                metrics::gauge!("ledger_revision").set(revision as f64);
                pb::CompareResponse {
                    succeeded: true,
                    revision,
                    versions: versions
                        .into_iter()
                        .map(|(key, version)| pb::DocumentVersion {
                            kind: key.kind,
                            id: key.id,
                            version,
                        })
                        .collect(),
                    conflicts: Vec::new(),
                }
            }
            Outcome::Conflicted { revision, conflicts } => {
                metrics::counter!("ledger_compares_total", "outcome" => "conflict").increment(1);
                for c in &conflicts {
                    metrics::counter!("ledger_cas_conflicts_total", "kind" => c.key.kind.clone()).increment(1);
                }
                tracing::debug!(
                    conflicts = ?conflicts.iter().map(|c| c.key.to_string()).collect::<Vec<_>>(),
                    "compare conflicted"
                );
                pb::CompareResponse {
                    succeeded: false,
                    revision,
                    versions: Vec::new(),
                    conflicts: conflicts.into_iter().map(conflict_to_pb).collect(),
                }
            }
        };
        Ok(Response::new(reply))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, request: Request<pb::WatchRequest>) -> Result<Response<WatchStream>, Status> {
        let req = request.into_inner();
        let filter = filter_from_pb(&req).map_err(ApiError::from)?;
        let start = if req.start_revision == 0 {
            self.head.revision() + 1
        } else {
            req.start_revision
        };
        let compacted = self.head.compacted();
        if start <= compacted {
            return Err(ApiError::Compacted {
                requested: start,
                oldest: compacted + 1,
            }
            .into());
        }
        let (tx, rx) = mpsc::channel(16);
        let tail = Tail {
            store: self.store.clone(),
            head: self.head.clone(),
            filter,
            last: start - 1,
            tx,
            shutdown: self.shutdown.clone(),
        };
        tokio::spawn(tail.run());
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Splits the changes of `(last, upto]` into replies of whole revisions, each ending once it
/// holds [`REPLY_BYTES`] of payload, so a watcher far behind never meets a reply larger than
/// it accepts. Each reply's revision is the last one it completes; the last reply's is `upto`.
fn replies(changes: Vec<model::Change>, upto: u64) -> Vec<pb::WatchResponse> {
    let mut replies = Vec::new();
    let mut events = Vec::new();
    let mut bytes = 0;
    let mut changes = changes.into_iter().peekable();
    while let Some(change) = changes.next() {
        let revision = change.revision;
        bytes += change.key.id.len() + change.payload.as_deref().map_or(0, str::len);
        events.push(change_to_event(change));
        let revision_ends = changes.peek().is_none_or(|next| next.revision != revision);
        if bytes >= REPLY_BYTES && revision_ends && changes.peek().is_some() {
            replies.push(pb::WatchResponse {
                events: std::mem::take(&mut events),
                revision,
            });
            bytes = 0;
        }
    }
    replies.push(pb::WatchResponse { events, revision: upto });
    replies
}

/// One watch stream: reads the change log behind the head and forwards whole revisions.
struct Tail {
    store: Store,
    head: HeadTracker,
    filter: Filter,
    /// Every revision up to this one has been delivered.
    last: u64,
    tx: mpsc::Sender<Result<pb::WatchResponse, Status>>,
    shutdown: watch::Receiver<bool>,
}

impl Tail {
    async fn run(mut self) {
        let mut head_rx = self.head.subscribe();
        // Say at once where this stream starts, so a client that asked for "from now" knows
        // the revision to resume from if the stream breaks before the first change.
        let start = pb::WatchResponse {
            events: Vec::new(),
            revision: self.last,
        };
        if self.tx.send(Ok(start)).await.is_err() {
            return;
        }
        let mut last_sent = Instant::now();
        loop {
            if *self.shutdown.borrow() {
                return;
            }
            let head = *head_rx.borrow_and_update();
            if head > self.last {
                let upto = head.min(self.last + WATCH_WINDOW);
                let changes = match self.read(upto).await {
                    Ok(changes) => changes,
                    Err(err) => {
                        let _ = self.tx.send(Err(err.into())).await;
                        return;
                    }
                };
                let caught_up = upto == head;
                if !changes.is_empty() || (caught_up && last_sent.elapsed() >= PROGRESS_EVERY) {
                    for response in replies(changes, upto) {
                        if self.tx.send(Ok(response)).await.is_err() {
                            return;
                        }
                    }
                    last_sent = Instant::now();
                }
                self.last = upto;
                continue;
            }
            tokio::select! {
                changed = head_rx.changed() => if changed.is_err() { return },
                () = self.tx.closed() => return,
                _ = self.shutdown.changed() => return,
                () = tokio::time::sleep(PROGRESS_EVERY) => {
                    let progress = pb::WatchResponse { events: Vec::new(), revision: self.last };
                    if self.tx.send(Ok(progress)).await.is_err() {
                        return;
                    }
                    last_sent = Instant::now();
                }
            }
        }
    }

    /// The changes in `(last, upto]`, refusing to return a range compaction has cut into.
    async fn read(&self, upto: u64) -> Result<Vec<model::Change>, ApiError> {
        let changes = self.store.changes(self.last, upto, &self.filter).await?;
        // Read the compaction point after the rows: if it passed `last` meanwhile, the rows may
        // have lost their oldest part, and a silent gap is the one thing a watch must not have.
        let compacted = self.store.head().await?.compacted.max(self.head.compacted());
        if compacted > self.last {
            return Err(ApiError::Compacted {
                requested: self.last + 1,
                oldest: compacted + 1,
            });
        }
        Ok(changes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(revision: u64, seq: u32, bytes: usize) -> model::Change {
        model::Change {
            revision,
            seq,
            key: DocKey::new("k", format!("d{revision}.{seq}")),
            version: 1,
            create_revision: revision,
            payload: Some(Arc::from("x".repeat(bytes))),
        }
    }

    #[test]
    fn watch_replies_split_at_whole_revisions_by_bytes() {
        let big = REPLY_BYTES / 2 + 1;
        // Revision 2 holds two large changes; revision 3 one; 4 a small one.
        let changes = vec![
            change(2, 0, big),
            change(2, 1, big),
            change(3, 0, big),
            change(4, 0, 10),
        ];
        let replies = replies(changes, 9);
        let shape: Vec<(u64, usize)> = replies.iter().map(|r| (r.revision, r.events.len())).collect();
        // Revision 2 stays whole although it alone is over the bound; the rest fits one more.
        assert_eq!(shape, [(2, 2), (9, 2)]);
        // Nothing to split: one reply at `upto`, even when empty.
        assert_eq!(replies_shape(vec![], 5), [(5, 0)]);
        assert_eq!(replies_shape(vec![change(3, 0, 1), change(4, 0, 1)], 5), [(5, 2)]);
    }

    fn replies_shape(changes: Vec<model::Change>, upto: u64) -> Vec<(u64, usize)> {
        replies(changes, upto)
            .iter()
            .map(|r| (r.revision, r.events.len()))
            .collect()
    }

    #[test]
    fn page_tokens_round_trip_and_reject_garbage() {
        for id in ["", "sbx-1", "ünï/cødé"] {
            assert_eq!(decode_token(&encode_token(id)).as_deref(), Ok(id));
        }
        assert!(decode_token("abc").is_err());
        assert!(decode_token("zz").is_err());
        assert!(decode_token("ff").is_err());
    }
}
