//! Where each sandbox runs, for the envd proxy: a routing table kept fresh by a ledger watch
//! on the sandbox manifests (no ledger read per request). A miss (a sandbox created a moment
//! ago, before the watch delivered it) is read from the ledger once and remembered.
//!
//! The same watch keeps the manifests that carry a pool's mark (pooled sandboxes, and claims
//! of them not yet confirmed) whole, for the pool keeper: its rounds run on every manifest
//! change, and one ledger read per slot per round would grow with the pools times the
//! cluster's churn.

use std::collections::HashMap;
use std::sync::Arc;

use common::docs::{SandboxDoc, SandboxPhase, SANDBOX_KIND};
use futures::StreamExt;
use ledger_client::{LedgerClient, Versioned, WatchEvent};
use tokio::sync::RwLock;

/// Sandbox → envd endpoint, for running sandboxes.
#[derive(Clone)]
pub struct Routes {
    table: Arc<RwLock<HashMap<String, Route>>>,
    /// Woken on every change of the table, for requests held during a move.
    changed: Arc<tokio::sync::Notify>,
    /// Opens the seals manifests keep into the tokens requests must carry.
    tokens: crate::tokens::Tokens,
    /// The manifests with a pool's mark, as the watch last delivered them.
    pooled: Arc<std::sync::RwLock<HashMap<String, Arc<Versioned<SandboxDoc>>>>>,
    /// The team of every sandbox that holds room (see `sandboxes::quota`), by sandbox; `None`
    /// until the manifests were first listed.
    holders: Arc<std::sync::RwLock<Option<Holders>>>,
}

/// The team of every sandbox that holds room, and how many each team holds (kept together,
/// so a create's count is a lookup, not a walk over the cluster's sandboxes).
#[derive(Default)]
struct Holders {
    team_of: HashMap<String, String>,
    held: HashMap<String, usize>,
}

impl Holders {
    /// Sandbox `id` holds room for `team`, or for nobody.
    fn set(&mut self, id: &str, team: Option<&str>) {
        if let Some(old) = self.team_of.remove(id) {
            if let Some(n) = self.held.get_mut(&old) {
                *n -= 1;
                if *n == 0 {
                    self.held.remove(&old);
                }
            }
        }
        if let Some(team) = team {
            self.team_of.insert(id.to_string(), team.to_string());
            *self.held.entry(team.to_string()).or_default() += 1;
        }
    }

    /// What `team` holds, leaving out the sandboxes of `except`.
    fn held_by(&self, team: &str, except: &std::collections::HashSet<String>) -> usize {
        let excepted = except
            .iter()
            .filter(|id| self.team_of.get(*id).is_some_and(|t| t == team))
            .count();
        self.held.get(team).copied().unwrap_or(0) - excepted
    }
}

/// The team a manifest holds room for: not a pooled one (nobody's), not a hibernated one (its
/// files only, in the blob store).
fn holder_of(doc: &SandboxDoc) -> Option<&str> {
    (!doc.is_pooled() && doc.phase != SandboxPhase::Hibernated).then_some(doc.team_id.as_str())
}

#[derive(Clone, Debug)]
pub struct Route {
    /// The node that runs it, and that node's envd endpoint (`http://HOST:PORT`).
    pub(crate) node_id: String,
    pub(crate) envd: String,
    pub(crate) running: bool,
    /// Another operation (a move) owns the sandbox: hold its requests.
    pub(crate) moving: bool,
    pub(crate) access_token: Option<Arc<str>>,
    /// Required on requests for its ports when set.
    pub(crate) traffic_token: Option<Arc<str>>,
    /// Traffic to it while paused resumes it (as its team, with its own timeout).
    pub(crate) auto_resume: Option<(Arc<str>, u64)>,
}

/// A sandbox's route; none for one that runs nowhere yet, that is still being created, or that
/// waits unclaimed in a warm pool (nobody's requests reach it). A claimed one is routed from
/// the claim's write on, which says `running` with the create's tokens: nobody has those
/// tokens before the create answers, and it answers only once the node took them.
fn route_of(doc: &SandboxDoc, tokens: &crate::tokens::Tokens) -> Option<Route> {
    let routable = !doc.envd_address.is_empty() || doc.lifecycle_owner.is_some();
    let anyones = !doc.is_pooled() && doc.phase != SandboxPhase::Creating;
    (routable && anyones).then(|| Route {
        node_id: doc.node_id.clone(),
        envd: doc.envd_address.clone(),
        running: doc.phase == SandboxPhase::Running,
        moving: doc.lifecycle_owner.is_some(),
        access_token: tokens.envd(doc).map(Arc::from),
        traffic_token: tokens.traffic(doc).map(Arc::from),
        auto_resume: doc
            .auto_resume
            .then(|| (Arc::from(doc.team_id.as_str()), doc.timeout_secs)),
    })
}

/// How long a request may wait for a moving sandbox to resume somewhere.
pub const HOLD_DURING_MOVE: std::time::Duration = std::time::Duration::from_secs(10);

impl Routes {
    pub fn new(tokens: crate::tokens::Tokens) -> Self {
        Self {
            table: Arc::default(),
            changed: Arc::default(),
            tokens,
            pooled: Arc::default(),
            holders: Arc::default(),
        }
    }

    /// How many sandboxes `team` holds, as the watch last delivered the manifests, leaving
    /// out those of `except`; `None` before the manifests were first listed (a gateway just
    /// started knows nobody's count yet).
    pub fn held_by(&self, team: &str, except: &std::collections::HashSet<String>) -> Option<usize> {
        Some(self.holders().as_ref()?.held_by(team, except))
    }

    fn note_holder(&self, id: &str, doc: Option<&SandboxDoc>) {
        if let Some(holders) = self.holders_mut().as_mut() {
            holders.set(id, doc.and_then(holder_of));
        }
    }

    /// Manifest `id` as the watch last delivered it, if it carries a pool's mark. A miss says
    /// nothing (claimed and confirmed, deleted, or not delivered yet): read the ledger.
    pub fn pooled_manifest(&self, id: &str) -> Option<Arc<Versioned<SandboxDoc>>> {
        self.pooled
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    fn pooled_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<Versioned<SandboxDoc>>>> {
        self.pooled.write().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn holders(&self) -> std::sync::RwLockReadGuard<'_, Option<Holders>> {
        self.holders.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn holders_mut(&self) -> std::sync::RwLockWriteGuard<'_, Option<Holders>> {
        self.holders.write().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps `doc` among the pooled manifests while it carries a pool's mark.
    fn note_pooled(&self, doc: Versioned<SandboxDoc>) {
        let mut pooled = self.pooled_mut();
        if doc.value.pool.is_some() {
            pooled.insert(doc.value.sandbox_id.clone(), Arc::new(doc));
        } else {
            pooled.remove(&doc.value.sandbox_id);
        }
    }

    /// Lists the manifests, then follows the ledger from that revision on.
    pub fn follow(&self, ledger: LedgerClient) -> tokio::task::JoinHandle<()> {
        let routes = self.clone();
        tokio::spawn(async move {
            let pause = std::time::Duration::from_secs(2);
            let mut backoff = common::retry::backoff(std::time::Duration::from_millis(100), pause);
            loop {
                let start = match ledger.list::<SandboxDoc>(SANDBOX_KIND, "").await {
                    Ok((docs, revision)) => {
                        let mut table = routes.table.write().await;
                        table.clear();
                        routes.pooled_mut().clear();
                        // Built whole, then swapped in: a count is never read half-listed.
                        let mut holders = Holders::default();
                        for d in docs {
                            if let Some(r) = route_of(&d.value, &routes.tokens) {
                                table.insert(d.value.sandbox_id.clone(), r);
                            }
                            holders.set(&d.value.sandbox_id, holder_of(&d.value));
                            routes.note_pooled(d);
                        }
                        *routes.holders_mut() = Some(holders);
                        routes.changed.notify_waiters();
                        backoff = common::retry::backoff(std::time::Duration::from_millis(100), pause);
                        revision + 1
                    }
                    Err(err) => {
                        tracing::warn!(%err, "routing table: cannot list manifests; retrying");
                        tokio::time::sleep(backoff.next().unwrap_or(pause)).await;
                        continue;
                    }
                };
                let mut watch = ledger.watch(SANDBOX_KIND, "", start);
                while let Some(update) = watch.next().await {
                    let Ok(update) = update else { break };
                    let _woken = Wake(&routes.changed);
                    let mut table = routes.table.write().await;
                    for event in update.events {
                        match event {
                            WatchEvent::Put(doc) => {
                                let id = doc.key.id.clone();
                                match Versioned::decode::<SandboxDoc>(doc) {
                                    Ok(d) => {
                                        match route_of(&d.value, &routes.tokens) {
                                            Some(r) => table.insert(d.value.sandbox_id.clone(), r),
                                            None => table.remove(&d.value.sandbox_id),
                                        };
                                        routes.note_holder(&id, Some(&d.value));
                                        routes.note_pooled(d);
                                    }
                                    // Not what it was, whatever it is now: read afresh.
                                    Err(_) => {
                                        routes.pooled_mut().remove(&id);
                                        routes.note_holder(&id, None);
                                    }
                                }
                            }
                            WatchEvent::Deleted { key, .. } => {
                                table.remove(&key.id);
                                routes.pooled_mut().remove(&key.id);
                                routes.note_holder(&key.id, None);
                            }
                        }
                    }
                }
                // The watch ended (compacted, or an error that is not transient): list again.
            }
        })
    }

    /// Resolves at the next change of the table (the ledger's watch, or a local update).
    /// Created before looking at what it guards, it misses no change made in between.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Drops a sandbox's route (it was killed, or its node says it is not there).
    pub async fn forget(&self, id: &str) {
        self.table.write().await.remove(id);
        self.changed.notify_waiters();
    }

    /// Waits, at most `limit`, until the manifests have been listed once (the teams' counts
    /// are known): at a gateway's start, a moment.
    pub async fn listed(&self, limit: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.changed();
            if self.holders().is_some() {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return false;
            }
        }
    }

    /// Counts sandbox `id` as holding no room any more (killed), before the watch says so.
    pub fn release_holder(&self, id: &str) {
        self.note_holder(id, None);
    }

    /// Marks a sandbox paused or running without waiting for the watch.
    pub async fn set_running(&self, id: &str, running: bool) {
        if let Some(route) = self.table.write().await.get_mut(id) {
            route.running = running;
        }
        self.changed.notify_waiters();
    }

    /// The sandbox's route once it is not being moved, waiting at most `limit`.
    pub async fn settled(&self, ledger: &LedgerClient, id: &str, limit: std::time::Duration) -> Option<Route> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            // Register for the next change before looking, so none is missed in between.
            let changed = self.changed.notified();
            let route = self.lookup(ledger, id).await?;
            if !route.moving {
                return Some(route);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Some(route);
            }
        }
    }

    async fn lookup(&self, ledger: &LedgerClient, id: &str) -> Option<Route> {
        if let Some(r) = self.table.read().await.get(id) {
            return Some(r.clone());
        }
        let doc = ledger.get::<SandboxDoc>(SANDBOX_KIND, id).await.ok()??;
        let route = route_of(&doc.value, &self.tokens)?;
        self.table.write().await.insert(id.to_string(), route.clone());
        Some(route)
    }
}

/// Wakes held requests when dropped (after the table's write lock is released).
struct Wake<'a>(&'a tokio::sync::Notify);

impl Drop for Wake<'_> {
    fn drop(&mut self) {
        self.0.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_teams_count_follows_its_sandboxes_through_every_change() {
        let mut holders = Holders::default();
        holders.set("s1", Some("a"));
        holders.set("s2", Some("a"));
        holders.set("s3", Some("b"));
        let none = std::collections::HashSet::new();
        assert_eq!((holders.held_by("a", &none), holders.held_by("b", &none)), (2, 1));
        // Written again (running after creating): still one.
        holders.set("s1", Some("a"));
        assert_eq!(holders.held_by("a", &none), 2);
        // A pool claim: nobody's, then a team's.
        holders.set("p1", None);
        holders.set("p1", Some("b"));
        assert_eq!(holders.held_by("b", &none), 2);
        // Hibernated or deleted: no room held.
        holders.set("s2", None);
        assert_eq!(holders.held_by("a", &none), 1);
        let under_way: std::collections::HashSet<String> = ["s1".to_string(), "s3".to_string()].into();
        assert_eq!(
            (holders.held_by("a", &under_way), holders.held_by("b", &under_way)),
            (0, 1)
        );
        assert_eq!(holders.held_by("nobody", &none), 0);
    }
}
