//! Keeps the [`View`] equal to the ledger and tells every browser what changed.
//!
//! The feed lists each kind the console draws into a fresh view, then watches each kind from
//! just after the revision its own list saw, so nothing is lost between a list and its watch
//! and nothing is applied twice. Each change goes through [`View::apply`]; its deltas become
//! server-sent events on a broadcast channel every open page subscribes to.
//!
//! A watch that fell behind the ledger's retention (`Compacted`) or failed for good starts
//! over: the view is listed again and browsers get a `reset` event, on which they re-read
//! their page. While the ledger cannot be reached the console keeps serving what it last saw
//! and says so (`/console/api/health`, the banner on every page).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use common::docs::{NODE_KIND, SANDBOX_KIND};
use common::pool::{POOL_KIND, POOL_SLOT_KIND};
use common::template::{BUILD_KIND, TEMPLATE_KIND};
use futures::StreamExt;
use ledger_client::{Document, LedgerClient, LedgerError, WatchEvent};
use tokio::sync::broadcast;

use crate::view::{Change, Delta, View};

/// The balancer's kinds: the console re-reads the balancer's status and history over its
/// API when one changes (their shapes are the balancer's own, not a shared contract).
const BALANCE_KINDS: [&str; 3] = ["balance-plan", "balance-observation", "balance-control"];

/// Every kind the console lists at start (the balancer's are read over its API when a
/// page asks).
const KINDS: [&str; 6] = [
    NODE_KIND,
    SANDBOX_KIND,
    TEMPLATE_KIND,
    BUILD_KIND,
    POOL_KIND,
    POOL_SLOT_KIND,
];

/// One server-sent event, encoded once for every browser.
#[derive(Debug)]
pub struct Event {
    pub name: &'static str,
    pub data: String,
    /// The ledger revision it came from.
    pub revision: u64,
}

/// The view and its subscribers, shared by the feed task and the HTTP handlers.
#[derive(Clone)]
pub struct Shared {
    view: Arc<RwLock<View>>,
    events: broadcast::Sender<Arc<Event>>,
    /// Whether the ledger answers now (false: what the view shows may be stale).
    live: Arc<AtomicBool>,
}

impl Default for Shared {
    fn default() -> Self {
        Self::new()
    }
}

impl Shared {
    pub fn new() -> Self {
        Self {
            view: Arc::default(),
            events: broadcast::channel(4096).0,
            live: Arc::default(),
        }
    }

    /// Reads the view (a poisoned lock is taken as it is: the view is rows, each written
    /// whole, never left half-changed by a panic elsewhere).
    pub fn read<R>(&self, f: impl FnOnce(&View) -> R) -> R {
        f(&self.view.read().unwrap_or_else(PoisonError::into_inner))
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Event>> {
        self.events.subscribe()
    }

    pub fn live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Applies changes seen at `revision` and sends their events.
    pub fn apply(&self, changes: impl IntoIterator<Item = Change>, revision: u64) {
        let now = common::clock::now_ms();
        let deltas: Vec<Delta> = {
            let mut view = self.view.write().unwrap_or_else(PoisonError::into_inner);
            changes
                .into_iter()
                .flat_map(|change| view.apply(change, revision, now))
                .collect()
        };
        for delta in deltas {
            self.send(delta.event(), &delta, revision);
        }
    }

    /// Sends one event to every open page.
    pub fn send(&self, name: &'static str, data: &impl serde::Serialize, revision: u64) {
        match serde_json::to_string(data) {
            // No receiver is not an error: no page is open.
            Ok(data) => drop(self.events.send(Arc::new(Event { name, data, revision }))),
            Err(err) => tracing::warn!(%err, event = name, "console event not encoded"),
        }
    }

    /// Records whether the ledger answers; a change is logged and told to every page.
    pub(crate) fn set_live(&self, live: bool) {
        if self.live.swap(live, Ordering::AcqRel) != live {
            if live {
                tracing::info!("console: the ledger answers");
            } else {
                tracing::warn!("console: the ledger does not answer; pages show the last state seen");
            }
            let ledger = if live { "live" } else { "unreachable" };
            self.send("ledger", &serde_json::json!({ "ledger": ledger }), 0);
        }
        metrics::gauge!("console_ledger_live").set(if live { 1.0 } else { 0.0 });
    }
}

/// What a ledger document is to the view (`None`: a kind it does not draw, or a document it
/// cannot read, which is logged and skipped rather than stopping the console).
fn change(doc: Option<&Document>, key: &ledger_client::DocKey) -> Option<Change> {
    fn decode<T: serde::de::DeserializeOwned>(doc: Option<&Document>) -> Result<Option<T>, serde_json::Error> {
        doc.map(|d| serde_json::from_str(&d.payload)).transpose()
    }
    let id = key.id.clone();
    let decoded = match key.kind.as_str() {
        NODE_KIND => decode(doc).map(|d| Change::Node(id, d)),
        SANDBOX_KIND => decode(doc).map(|d| Change::Sandbox(id, d)),
        TEMPLATE_KIND => decode(doc).map(|d| Change::Template(id, d)),
        BUILD_KIND => decode(doc).map(|d| Change::Build(id, d)),
        POOL_KIND => decode(doc).map(|d| Change::Pool(id, d)),
        POOL_SLOT_KIND => Ok(Change::PoolSlot(id, doc.is_some())),
        kind if BALANCE_KINDS.contains(&kind) => Ok(Change::Balance(key.to_string())),
        _ => return None,
    };
    decoded
        .map_err(|err| tracing::warn!(%err, key = %key, "console skips a document it cannot read"))
        .ok()
}

/// Follows the ledger for as long as the console runs.
pub async fn follow(shared: Shared, ledger: LedgerClient) {
    let pauses = || common::retry::backoff(Duration::from_millis(200), Duration::from_secs(5));
    let mut backoff = pauses();
    loop {
        let listed = match list(&shared, &ledger).await {
            Ok(listed) => listed,
            Err(err) => {
                shared.set_live(false);
                tracing::warn!(%err, "console cannot list the ledger; retrying");
                tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(5))).await;
                continue;
            }
        };
        backoff = pauses();
        shared.set_live(true);
        let oldest = listed.iter().map(|(_, revision)| *revision).min().unwrap_or(0);
        shared.send("reset", &serde_json::json!({ "revision": oldest }), oldest);
        // One watch per kind, each from just after the revision its list saw: no change is
        // applied twice, so no row steps back to an older version on the way.
        let watches = listed
            .iter()
            .map(|(kind, revision)| ledger.watch(kind, "", revision + 1))
            .chain(BALANCE_KINDS.iter().map(|kind| ledger.watch(kind, "", oldest + 1)));
        let mut updates = futures::stream::select_all(watches);
        while let Some(update) = updates.next().await {
            match update {
                Ok(update) => {
                    let changes = update.events.iter().filter_map(|event| match event {
                        WatchEvent::Put(doc) => change(Some(doc), &doc.key),
                        WatchEvent::Deleted { key, .. } => change(None, key),
                    });
                    shared.apply(changes.collect::<Vec<_>>(), update.revision);
                }
                // A watch reconnects by itself; it hands over an error only when it gives up.
                Err(err @ LedgerError::Compacted(_)) => {
                    tracing::warn!(%err, "console fell behind the ledger; listing again");
                    break;
                }
                Err(err) => {
                    shared.set_live(false);
                    tracing::warn!(%err, "console's ledger watch ended; listing again");
                    break;
                }
            }
        }
    }
}

/// Lists every kind the console draws into a fresh view, swapped in whole (pages never see
/// it half-built; they are told `reset` and read it again). Returns each kind with the
/// revision its list saw.
async fn list(shared: &Shared, ledger: &LedgerClient) -> Result<Vec<(&'static str, u64)>, LedgerError> {
    let mut changes = Vec::new();
    let mut listed = Vec::new();
    for kind in KINDS {
        let mut token = String::new();
        let mut first = None;
        loop {
            let (docs, next, revision) = ledger.list_page(kind, "", 0, &token).await?;
            first.get_or_insert(revision);
            changes.extend(docs.iter().filter_map(|doc| change(Some(doc), &doc.key)));
            if next.is_empty() {
                break;
            }
            token = next;
        }
        listed.push((kind, first.unwrap_or(0)));
    }
    let newest = listed.iter().map(|(_, revision)| *revision).max().unwrap_or(0);
    let now = common::clock::now_ms();
    let mut view = shared.view.write().unwrap_or_else(PoisonError::into_inner);
    let mut fresh = view.emptied();
    for change in changes {
        // What the view draws is what the browsers re-read on `reset`: no event per row.
        drop(fresh.apply(change, newest, now));
    }
    *view = fresh;
    Ok(listed)
}

/// Asks the ledger something cheap every few seconds: a watch that reconnects by itself
/// says nothing while the ledger is gone, and pages must not call stale data live.
pub async fn probe(shared: Shared, ledger: LedgerClient) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let answered = tokio::time::timeout(PROBE_EVERY, ledger.get_raw(NODE_KIND, "console-probe"))
            .await
            .is_ok_and(|r| r.is_ok());
        shared.set_live(answered);
    }
}

/// How often [`probe`] asks.
pub const PROBE_EVERY: Duration = Duration::from_secs(3);
/// Relays each change of a balance plan as the plan itself (`plan` events), read from the
/// balancer the moment the ledger shows the change: a move's steps follow each other within
/// milliseconds, and a page that re-read the whole history after each would draw only the
/// last. Changes are relayed one at a time, in the order the ledger made them.
pub async fn relay_plans(shared: Shared, control: crate::control::Control) {
    let mut events = shared.subscribe();
    loop {
        let event = match events.recv().await {
            Ok(event) => event,
            Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => return,
        };
        let plan_id = (event.name == "balance")
            .then(|| serde_json::from_str::<serde_json::Value>(&event.data).ok())
            .flatten()
            .and_then(|data| {
                data["key"]
                    .as_str()
                    .and_then(|k| k.strip_prefix("balance-plan/"))
                    .map(str::to_string)
            });
        let Some(plan_id) = plan_id else { continue };
        match control.plan(&plan_id).await {
            Ok(plan) => shared.send("plan", &plan, event.revision),
            Err(err) => tracing::debug!(%err, plan_id, "console could not read a changed plan"),
        }
    }
}
