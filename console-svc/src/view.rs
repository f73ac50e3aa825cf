//! The console's picture of the cluster: the pure core, no I/O.
//!
//! The feed hands every ledger document it sees to [`View::apply`] as a [`Change`]; the view
//! keeps what the pages show (one row per node, sandbox, template) and answers with the
//! [`Delta`]s the browsers must hear of. Rows hold only what an operator may see: a
//! manifest's sealed env vars and token seals never enter the view, so no page or event can
//! carry them.
//!
//! Queries ([`View::sandboxes`]) filter and page on the server, so a browser holds one
//! screenful of a 10,000-sandbox cluster, never all of it.

use std::collections::{BTreeMap, HashMap, VecDeque};

use common::docs::{NodeDoc, NodeState, SandboxDoc, SandboxPhase};
use common::pool::PoolDoc;
use common::template::{BuildDoc, TemplateDoc};
use serde::Serialize;

const MIB: u64 = 1 << 20;

/// How long the spread's history reaches back, and how often it is sampled.
pub const SPREAD_WINDOW_MS: u64 = 60 * 60 * 1000;
pub const SPREAD_SAMPLE_MS: u64 = 5_000;
/// Log lines a build event carries at most (a browser asks for the rest).
pub const BUILD_LINES_PER_EVENT: usize = 200;
/// The most rows one query returns.
pub const MAX_PAGE: usize = 500;

/// One node as the cluster page draws it (from its ledger document).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeRow {
    pub node_id: String,
    /// Its gRPC endpoint (the console reads sandboxes' logs and metrics there).
    #[serde(skip)]
    pub address: String,
    /// `ready` or `draining`.
    pub state: &'static str,
    pub vcpus: u32,
    pub allocated_vcpus: u32,
    pub memory_mib: u64,
    pub allocated_mib: u64,
    pub used_mib: u64,
    pub available_mib: u64,
    pub available_ratio: f64,
    pub sandboxes: usize,
    pub reported_at_ms: u64,
    /// Why it runs degraded, as it last reported.
    pub degraded: Vec<String>,
}

impl NodeRow {
    fn of(doc: &NodeDoc) -> Self {
        Self {
            node_id: doc.node_id.clone(),
            address: doc.address.clone(),
            state: match doc.state {
                NodeState::Ready => "ready",
                NodeState::Draining => "draining",
            },
            vcpus: doc.capacity.vcpus,
            allocated_vcpus: doc.allocated.vcpus,
            memory_mib: doc.capacity.memory_bytes / MIB,
            allocated_mib: doc.allocated.memory_bytes / MIB,
            used_mib: doc.memory_used_bytes / MIB,
            available_mib: doc.memory_available_bytes / MIB,
            available_ratio: doc.available_ratio,
            sandboxes: doc.sandboxes.len(),
            reported_at_ms: doc.reported_at_unix_ms,
            degraded: doc.degraded.clone(),
        }
    }
}

/// One sandbox as the sandboxes table draws it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxRow {
    pub sandbox_id: String,
    /// Empty for one waiting unclaimed in a warm pool.
    pub team_id: String,
    pub template: String,
    pub node_id: String,
    /// `creating`, `running`, `paused`, `hibernated`, `moving` (a move owns it) or `pooled`.
    pub state: &'static str,
    pub vcpus: u32,
    /// What it asked for (its estimate), and where that came from.
    pub memory_mib: u64,
    pub memory_source: &'static str,
    /// What its node last reported it using.
    pub measured_mib: Option<u64>,
    pub started_at_ms: u64,
    pub end_at_ms: u64,
    pub epoch: u64,
}

fn state_of(doc: &SandboxDoc) -> &'static str {
    let user = doc
        .lifecycle_owner
        .as_deref()
        .is_some_and(|owner| owner.starts_with(common::docs::USER_CLAIM_PREFIX));
    if doc.is_pooled() {
        return "pooled";
    }
    if doc.lifecycle_owner.is_some() && !user {
        return "moving";
    }
    match doc.phase {
        SandboxPhase::Creating => "creating",
        SandboxPhase::Running => "running",
        SandboxPhase::Paused => "paused",
        SandboxPhase::Hibernated => "hibernated",
    }
}

impl SandboxRow {
    fn of(doc: &SandboxDoc, measured: Option<u64>) -> Self {
        use common::docs::EstimateSource;
        Self {
            sandbox_id: doc.sandbox_id.clone(),
            team_id: doc.team_id.clone(),
            template: doc.template.clone(),
            node_id: doc.node_id.clone(),
            state: state_of(doc),
            vcpus: doc.vcpus,
            memory_mib: doc.memory_bytes / MIB,
            memory_source: match doc.memory_source {
                EstimateSource::Request => "request",
                EstimateSource::Template => "template",
                EstimateSource::Default => "default",
                EstimateSource::Measured => "measured",
            },
            measured_mib: measured.map(|bytes| bytes / MIB),
            started_at_ms: doc.started_at_unix_ms,
            end_at_ms: doc.end_at_unix_ms,
            epoch: doc.epoch,
        }
    }
}

/// One template with its tags, newest builds and warm pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateRow {
    pub template_id: String,
    pub names: Vec<String>,
    pub team_id: String,
    pub public: bool,
    pub vcpus: u32,
    pub memory_mb: u64,
    pub tags: BTreeMap<String, String>,
    pub builds: Vec<String>,
    pub snapshot_of: Option<String>,
    pub pool_size: Option<u32>,
    /// Slots taken: pooled sandboxes ready or starting.
    pub pool_slots: usize,
    pub updated_at_ms: u64,
}

/// One build, its status and how much log it has.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildRow {
    pub build_id: String,
    pub template_id: String,
    pub status: &'static str,
    pub node_id: String,
    pub reason: Option<String>,
    pub created_at_ms: u64,
    pub finished_at_ms: Option<u64>,
    /// Log lines written so far (counted from the first ever written).
    pub log_lines: u64,
}

/// A build's log lines from `offset` on.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LogLines {
    pub build_id: String,
    pub offset: u64,
    pub lines: Vec<LogLine>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LogLine {
    pub at_ms: u64,
    pub level: String,
    pub step: String,
    pub message: String,
}

/// A ledger document as the feed hands it over (`None`: deleted).
#[derive(Debug)]
pub enum Change {
    Node(String, Option<NodeDoc>),
    Sandbox(String, Option<SandboxDoc>),
    Template(String, Option<TemplateDoc>),
    Build(String, Option<BuildDoc>),
    Pool(String, Option<PoolDoc>),
    /// A pooled sandbox's slot (only counted).
    PoolSlot(String, bool),
    /// Something of the balancer's (plan, observation, control): browsers re-read it.
    Balance(String),
}

/// What browsers are told. The event's name is [`Delta::event`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged, rename_all_fields = "camelCase")]
pub enum Delta {
    Node(NodeRow),
    NodeGone { node_id: String, gone: bool },
    Sandbox(SandboxRow),
    SandboxGone { sandbox_id: String, gone: bool },
    Spread(SpreadPoint),
    Template(TemplateRow),
    TemplateGone { template_id: String, gone: bool },
    Build(BuildRow, LogLines),
    Balance { key: String },
}

impl Delta {
    /// The server-sent event's name: a page listens to the names it draws.
    pub fn event(&self) -> &'static str {
        match self {
            Delta::Node(_) | Delta::NodeGone { .. } => "node",
            Delta::Sandbox(_) | Delta::SandboxGone { .. } => "sandbox",
            Delta::Spread(_) => "spread",
            Delta::Template(_) | Delta::TemplateGone { .. } => "template",
            Delta::Build(..) => "build",
            Delta::Balance { .. } => "balance",
        }
    }
}

/// The balancer's spread (max minus min of the ready nodes' available ratio) at one time.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SpreadPoint {
    pub t: u64,
    pub v: f64,
}

/// Which sandboxes a table shows.
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(default)]
pub struct Query {
    /// Substring of the ID, team, template or node (case-insensitive).
    pub q: String,
    /// One state (`running`, `paused`, ...); empty: all.
    pub state: String,
    pub node: String,
    pub team: String,
    pub offset: usize,
    pub limit: usize,
}

/// One page of a query's answer.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxPage {
    /// Sandboxes in the cluster.
    pub total: usize,
    /// Of them, the ones the query matches.
    pub matched: usize,
    /// Every sandbox of the cluster by state.
    pub by_state: BTreeMap<&'static str, usize>,
    pub offset: usize,
    pub rows: Vec<SandboxRow>,
}

/// The cluster page's whole state.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSnapshot {
    pub nodes: Vec<NodeRow>,
    pub spread: Vec<SpreadPoint>,
    pub sandboxes: usize,
    pub by_state: BTreeMap<&'static str, usize>,
    pub revision: u64,
}

/// Everything the console shows, kept up to date by [`View::apply`].
#[derive(Default)]
pub struct View {
    nodes: BTreeMap<String, NodeRow>,
    sandboxes: BTreeMap<String, SandboxRow>,
    /// Sandboxes by state, kept as rows change (every page's summary reads it).
    by_state: BTreeMap<&'static str, usize>,
    /// Sandbox → memory used, from its node's last document.
    measured: HashMap<String, u64>,
    /// Node → the sandboxes its last document listed (to forget their measures when it
    /// stops listing them).
    listed: HashMap<String, Vec<String>>,
    templates: BTreeMap<String, TemplateRow>,
    builds: HashMap<String, BuildDoc>,
    pools: HashMap<String, u32>,
    /// Template → its slots taken (a slot's document is rewritten in place, so they are
    /// kept by ID, never counted up and down).
    slots: HashMap<String, std::collections::HashSet<String>>,
    spread: VecDeque<SpreadPoint>,
    revision: u64,
}

impl View {
    /// Applies one change seen at ledger `revision` and time `now_ms`; returns what browsers
    /// must hear of (nothing when the change alters nothing they draw).
    pub fn apply(&mut self, change: Change, revision: u64, now_ms: u64) -> Vec<Delta> {
        self.revision = self.revision.max(revision);
        match change {
            Change::Node(id, doc) => self.apply_node(id, doc, now_ms),
            Change::Sandbox(id, doc) => self.apply_sandbox(id, doc),
            Change::Template(id, doc) => self.template(id, doc),
            Change::Build(id, doc) => self.build(id, doc),
            Change::Pool(template, doc) => {
                match doc {
                    Some(doc) => self.pools.insert(template.clone(), doc.size),
                    None => self.pools.remove(&template),
                };
                self.template_delta(&template)
            }
            Change::PoolSlot(slot_id, present) => {
                let template = slot_id
                    .rsplit_once('#')
                    .map_or(slot_id.as_str(), |(t, _)| t)
                    .to_string();
                let taken = self.slots.entry(template.clone()).or_default();
                if present {
                    taken.insert(slot_id);
                } else {
                    taken.remove(&slot_id);
                }
                self.template_delta(&template)
            }
            Change::Balance(key) => vec![Delta::Balance { key }],
        }
    }

    fn apply_node(&mut self, id: String, doc: Option<NodeDoc>, now_ms: u64) -> Vec<Delta> {
        let mut deltas = Vec::new();
        let listed_before = self.listed.remove(&id).unwrap_or_default();
        let mut listed_now = Vec::new();
        match &doc {
            Some(doc) => {
                for sandbox in &doc.sandboxes {
                    listed_now.push(sandbox.sandbox_id.clone());
                    let old = self
                        .measured
                        .insert(sandbox.sandbox_id.clone(), sandbox.memory_used_bytes);
                    if old.map(|b| b / MIB) != Some(sandbox.memory_used_bytes / MIB) {
                        deltas.extend(self.remeasure(&sandbox.sandbox_id));
                    }
                }
                let row = NodeRow::of(doc);
                if self.nodes.get(&id) != Some(&row) {
                    self.nodes.insert(id.clone(), row.clone());
                    deltas.push(Delta::Node(row));
                }
            }
            None => {
                if self.nodes.remove(&id).is_some() {
                    deltas.push(Delta::NodeGone {
                        node_id: id.clone(),
                        gone: true,
                    });
                }
            }
        }
        let still: std::collections::HashSet<&String> = listed_now.iter().collect();
        for gone in listed_before.iter().filter(|s| !still.contains(s)) {
            if self.measured.remove(gone).is_some() {
                deltas.extend(self.remeasure(gone));
            }
        }
        if doc.is_some() {
            self.listed.insert(id, listed_now);
        }
        deltas.extend(self.sample_spread(now_ms));
        deltas
    }

    fn remeasure(&mut self, sandbox_id: &str) -> Option<Delta> {
        let measured = self.measured.get(sandbox_id).map(|bytes| bytes / MIB);
        let row = self.sandboxes.get_mut(sandbox_id)?;
        (row.measured_mib != measured).then(|| {
            row.measured_mib = measured;
            Delta::Sandbox(row.clone())
        })
    }

    /// The spread now, when the last sample is older than [`SPREAD_SAMPLE_MS`].
    fn sample_spread(&mut self, now_ms: u64) -> Option<Delta> {
        if self
            .spread
            .back()
            .is_some_and(|last| now_ms < last.t + SPREAD_SAMPLE_MS)
        {
            return None;
        }
        let ratios = self
            .nodes
            .values()
            .filter(|n| n.state == "ready")
            .map(|n| n.available_ratio);
        let (min, max) = ratios.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), r| (lo.min(r), hi.max(r)));
        let point = SpreadPoint {
            t: now_ms,
            v: if max >= min { max - min } else { 0.0 },
        };
        while self.spread.front().is_some_and(|p| p.t + SPREAD_WINDOW_MS < now_ms) {
            self.spread.pop_front();
        }
        self.spread.push_back(point);
        Some(Delta::Spread(point))
    }

    fn apply_sandbox(&mut self, id: String, doc: Option<SandboxDoc>) -> Vec<Delta> {
        let Some(doc) = doc else {
            return match self.sandboxes.remove(&id) {
                Some(old) => {
                    self.count(old.state, false);
                    vec![Delta::SandboxGone {
                        sandbox_id: id,
                        gone: true,
                    }]
                }
                None => Vec::new(),
            };
        };
        let row = SandboxRow::of(&doc, self.measured.get(&id).copied());
        if self.sandboxes.get(&id) == Some(&row) {
            return Vec::new();
        }
        self.count(row.state, true);
        if let Some(old) = self.sandboxes.insert(id, row.clone()) {
            self.count(old.state, false);
        }
        vec![Delta::Sandbox(row)]
    }

    fn count(&mut self, state: &'static str, up: bool) {
        let n = self.by_state.entry(state).or_default();
        *n = if up { *n + 1 } else { n.saturating_sub(1) };
        if *n == 0 {
            self.by_state.remove(state);
        }
    }

    fn template(&mut self, id: String, doc: Option<TemplateDoc>) -> Vec<Delta> {
        match doc {
            Some(doc) => {
                let row = TemplateRow {
                    template_id: doc.template_id,
                    names: doc.names,
                    team_id: doc.team_id,
                    public: doc.public,
                    vcpus: doc.vcpus,
                    memory_mb: doc.memory_mb,
                    tags: doc.tags,
                    builds: doc.builds,
                    snapshot_of: doc.snapshot_of,
                    pool_size: None,
                    pool_slots: 0,
                    updated_at_ms: doc.updated_at_unix_ms,
                };
                self.templates.insert(id.clone(), row);
                self.template_delta(&id)
            }
            None => match self.templates.remove(&id) {
                Some(_) => vec![Delta::TemplateGone {
                    template_id: id,
                    gone: true,
                }],
                None => Vec::new(),
            },
        }
    }

    fn template_delta(&mut self, id: &str) -> Vec<Delta> {
        let pool_size = self.pools.get(id).copied();
        let pool_slots = self.slots.get(id).map_or(0, |taken| taken.len());
        match self.templates.get_mut(id) {
            Some(row) => {
                row.pool_size = pool_size;
                row.pool_slots = pool_slots;
                vec![Delta::Template(row.clone())]
            }
            None => Vec::new(),
        }
    }

    fn build(&mut self, id: String, doc: Option<BuildDoc>) -> Vec<Delta> {
        let Some(doc) = doc else {
            self.builds.remove(&id);
            return Vec::new();
        };
        let before = self
            .builds
            .get(&id)
            .map_or(doc.logs_dropped, |old| old.logs_dropped + old.logs.len() as u64);
        let lines = log_lines(&doc, before, BUILD_LINES_PER_EVENT);
        let row = build_row(&doc);
        self.builds.insert(id, doc);
        vec![Delta::Build(row, lines)]
    }

    /// A view with nothing but this one's spread history (for the feed to list the ledger
    /// into before it replaces this one).
    pub fn emptied(&mut self) -> Self {
        Self {
            spread: std::mem::take(&mut self.spread),
            ..Self::default()
        }
    }

    pub fn cluster(&self) -> ClusterSnapshot {
        ClusterSnapshot {
            nodes: self.nodes.values().cloned().collect(),
            spread: self.spread.iter().copied().collect(),
            sandboxes: self.sandboxes.len(),
            by_state: self.by_state.clone(),
            revision: self.revision,
        }
    }

    pub fn node(&self, id: &str) -> Option<&NodeRow> {
        self.nodes.get(id)
    }

    /// The sandboxes `query` matches, newest first, one page of them.
    pub fn sandboxes(&self, query: &Query) -> SandboxPage {
        let needle = query.q.trim().to_ascii_lowercase();
        let matches = |row: &&SandboxRow| {
            (query.state.is_empty() || row.state == query.state)
                && (query.node.is_empty() || row.node_id == query.node)
                && (query.team.is_empty() || row.team_id == query.team)
                && (needle.is_empty()
                    || [&row.sandbox_id, &row.team_id, &row.template, &row.node_id]
                        .iter()
                        .any(|field| field.to_ascii_lowercase().contains(&needle)))
        };
        let mut by_state = BTreeMap::new();
        let mut rows: Vec<&SandboxRow> = Vec::new();
        for row in self.sandboxes.values() {
            *by_state.entry(row.state).or_default() += 1;
            if matches(&row) {
                rows.push(row);
            }
        }
        let matched = rows.len();
        rows.sort_by(|a, b| {
            b.started_at_ms
                .cmp(&a.started_at_ms)
                .then_with(|| a.sandbox_id.cmp(&b.sandbox_id))
        });
        let limit = if query.limit == 0 {
            100
        } else {
            query.limit.min(MAX_PAGE)
        };
        SandboxPage {
            total: self.sandboxes.len(),
            matched,
            by_state,
            offset: query.offset,
            rows: rows.into_iter().skip(query.offset).take(limit).cloned().collect(),
        }
    }

    pub fn sandbox(&self, id: &str) -> Option<&SandboxRow> {
        self.sandboxes.get(id)
    }

    /// How many sandboxes a node runs per the manifests (a drain's progress).
    pub fn sandboxes_on(&self, node_id: &str) -> usize {
        self.sandboxes.values().filter(|row| row.node_id == node_id).count()
    }

    pub fn templates(&self) -> Vec<TemplateRow> {
        self.templates.values().cloned().collect()
    }

    /// A template's builds, newest first.
    pub fn builds(&self, template_id: &str) -> Vec<BuildRow> {
        let mut builds: Vec<BuildRow> = self
            .builds
            .values()
            .filter(|b| b.template_id == template_id)
            .map(build_row)
            .collect();
        builds.sort_by_key(|b| std::cmp::Reverse(b.created_at_ms));
        builds
    }

    pub fn build_log(&self, build_id: &str, offset: u64, limit: usize) -> Option<(BuildRow, LogLines)> {
        let doc = self.builds.get(build_id)?;
        Some((build_row(doc), log_lines(doc, offset, limit)))
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }
}

fn build_row(doc: &BuildDoc) -> BuildRow {
    BuildRow {
        build_id: doc.build_id.clone(),
        template_id: doc.template_id.clone(),
        status: doc.status.as_str(),
        node_id: doc.node_id.clone(),
        reason: doc.reason.as_ref().map(|r| r.message.clone()),
        created_at_ms: doc.created_at_unix_ms,
        finished_at_ms: doc.finished_at_unix_ms,
        log_lines: doc.logs_dropped + doc.logs.len() as u64,
    }
}

fn log_lines(doc: &BuildDoc, offset: u64, limit: usize) -> LogLines {
    let first = offset.max(doc.logs_dropped);
    LogLines {
        build_id: doc.build_id.clone(),
        offset: first,
        lines: doc
            .logs_from(first, limit)
            .iter()
            .map(|e| LogLine {
                at_ms: e.at_unix_ms,
                level: e.level.clone(),
                step: e.step.clone(),
                message: e.message.clone(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use common::docs::{Capacity, NodeSandbox};
    use common::template::{BuildLogEntry, BuildStatus};

    use super::*;

    fn node(id: &str, ratio: f64, sandboxes: &[(&str, u64)]) -> NodeDoc {
        NodeDoc {
            node_id: id.into(),
            capacity: Capacity {
                vcpus: 4,
                memory_bytes: 4096 * MIB,
            },
            allocated: Capacity {
                vcpus: 1,
                memory_bytes: 1024 * MIB,
            },
            memory_used_bytes: 300 * MIB,
            available_ratio: ratio,
            sandboxes: sandboxes
                .iter()
                .map(|(id, used)| NodeSandbox {
                    sandbox_id: (*id).into(),
                    allocated_memory_bytes: 512 * MIB,
                    memory_used_bytes: used * MIB,
                })
                .collect(),
            ..NodeDoc::default()
        }
    }

    fn manifest(id: &str, team: &str, node: &str, started: u64) -> SandboxDoc {
        SandboxDoc {
            sandbox_id: id.into(),
            team_id: team.into(),
            template: "base".into(),
            memory_bytes: 512 * MIB,
            node_id: node.into(),
            phase: SandboxPhase::Running,
            started_at_unix_ms: started,
            sealed_env: Some("sealed secret".into()),
            envd_access_token: Some("seal".into()),
            ..SandboxDoc::default()
        }
    }

    #[test]
    fn a_sandbox_row_carries_no_secret_of_its_manifest() {
        let mut view = View::default();
        let deltas = view.apply(Change::Sandbox("s1".into(), Some(manifest("s1", "t", "n1", 1))), 1, 0);
        let json = serde_json::to_string(&deltas).unwrap();
        assert!(json.contains("\"sandboxId\":\"s1\""), "{json}");
        assert!(!json.contains("sealed secret") && !json.contains("seal\""), "{json}");
    }

    #[test]
    fn removals_reach_browsers_with_the_names_their_rows_have() {
        let mut view = View::default();
        view.apply(Change::Node("n1".into(), Some(node("n1", 0.5, &[]))), 1, 0);
        view.apply(Change::Sandbox("s1".into(), Some(manifest("s1", "t", "n1", 1))), 2, 0);
        let gone = view.apply(Change::Node("n1".into(), None), 3, SPREAD_SAMPLE_MS);
        let sandbox = view.apply(Change::Sandbox("s1".into(), None), 4, 0);
        let json = serde_json::to_string(&[&gone[0], &sandbox[0]]).unwrap();
        assert_eq!(json, r#"[{"nodeId":"n1","gone":true},{"sandboxId":"s1","gone":true}]"#);
        assert!(view.cluster().by_state.is_empty(), "{:?}", view.cluster().by_state);
    }

    #[test]
    fn a_node_document_measures_its_sandboxes_and_forgets_those_it_stops_listing() {
        let mut view = View::default();
        view.apply(Change::Sandbox("s1".into(), Some(manifest("s1", "t", "n1", 1))), 1, 0);
        let deltas = view.apply(Change::Node("n1".into(), Some(node("n1", 0.5, &[("s1", 100)]))), 2, 0);
        assert!(deltas
            .iter()
            .any(|d| matches!(d, Delta::Node(n) if n.memory_mib == 4096 && n.sandboxes == 1)));
        assert!(deltas
            .iter()
            .any(|d| matches!(d, Delta::Sandbox(s) if s.measured_mib == Some(100))));
        // The same document again: nothing new to draw but the spread's next sample.
        let again = view.apply(Change::Node("n1".into(), Some(node("n1", 0.5, &[("s1", 100)]))), 3, 1);
        assert!(again.is_empty(), "{again:?}");
        let dropped = view.apply(Change::Node("n1".into(), Some(node("n1", 0.5, &[]))), 4, 2);
        assert!(dropped
            .iter()
            .any(|d| matches!(d, Delta::Sandbox(s) if s.measured_mib.is_none())));
        let gone = view.apply(Change::Node("n1".into(), None), 5, 3);
        assert!(gone
            .iter()
            .any(|d| matches!(d, Delta::NodeGone { node_id, .. } if node_id == "n1")));
        assert!(view.cluster().nodes.is_empty());
    }

    #[test]
    fn the_spread_is_sampled_over_ready_nodes_and_kept_for_an_hour() {
        let mut view = View::default();
        view.apply(Change::Node("a".into(), Some(node("a", 0.9, &[]))), 1, 0);
        let mut draining = node("b", 0.1, &[]);
        draining.state = NodeState::Draining;
        view.apply(Change::Node("b".into(), Some(draining)), 2, SPREAD_SAMPLE_MS);
        view.apply(
            Change::Node("c".into(), Some(node("c", 0.4, &[]))),
            3,
            2 * SPREAD_SAMPLE_MS,
        );
        let spread = view.cluster().spread;
        assert_eq!(spread.len(), 3);
        assert_eq!(spread[1].v, 0.0, "a draining node is not in the spread");
        assert!((spread[2].v - 0.5).abs() < 1e-9);
        view.apply(
            Change::Node("c".into(), Some(node("c", 0.3, &[]))),
            4,
            SPREAD_WINDOW_MS + 2 * SPREAD_SAMPLE_MS,
        );
        let spread = view.cluster().spread;
        assert_eq!(
            spread.first().map(|p| p.t),
            Some(2 * SPREAD_SAMPLE_MS),
            "older than an hour dropped"
        );
    }

    #[test]
    fn a_query_filters_and_pages_on_the_server_newest_first() {
        let mut view = View::default();
        for i in 0..250u64 {
            let team = if i % 2 == 0 { "even" } else { "odd" };
            let id = format!("sbx{i:03}");
            view.apply(
                Change::Sandbox(id.clone(), Some(manifest(&id, team, "n1", i))),
                i + 1,
                0,
            );
        }
        let page = view.sandboxes(&Query {
            team: "odd".into(),
            limit: 10,
            offset: 5,
            ..Query::default()
        });
        assert_eq!((page.total, page.matched, page.rows.len()), (250, 125, 10));
        assert_eq!(page.rows[0].sandbox_id, "sbx239", "newest first, from the offset");
        let ids: Vec<_> = page.rows.iter().map(|r| r.sandbox_id.as_str()).collect();
        assert_eq!(ids.last(), Some(&"sbx221"), "{ids:?}");
        assert_eq!(page.by_state.get("running"), Some(&250));
        let last = view.sandboxes(&Query {
            offset: 245,
            limit: 10,
            ..Query::default()
        });
        let ids: Vec<_> = last.rows.iter().map(|r| r.sandbox_id.as_str()).collect();
        assert_eq!(ids, ["sbx004", "sbx003", "sbx002", "sbx001", "sbx000"]);
        let found = view.sandboxes(&Query {
            q: "SBX24".into(),
            ..Query::default()
        });
        assert_eq!(found.matched, 10);
        let none = view.sandboxes(&Query {
            state: "paused".into(),
            ..Query::default()
        });
        assert_eq!(none.matched, 0);
        let capped = view.sandboxes(&Query {
            limit: 10_000,
            ..Query::default()
        });
        assert_eq!(capped.rows.len(), 250.min(MAX_PAGE));
    }

    #[test]
    fn a_sandbox_a_move_owns_reads_moving_and_a_user_operation_does_not() {
        let mut view = View::default();
        let mut doc = manifest("s1", "t", "n1", 1);
        doc.lifecycle_owner = Some("plan-1.0".into());
        view.apply(Change::Sandbox("s1".into(), Some(doc.clone())), 1, 0);
        assert_eq!(view.sandbox("s1").map(|r| r.state), Some("moving"));
        doc.lifecycle_owner = Some(format!("{}kill", common::docs::USER_CLAIM_PREFIX));
        view.apply(Change::Sandbox("s1".into(), Some(doc.clone())), 2, 0);
        assert_eq!(view.sandbox("s1").map(|r| r.state), Some("running"));
        doc.pool = Some(common::pool::Pooled::default());
        view.apply(Change::Sandbox("s1".into(), Some(doc.clone())), 3, 0);
        assert_eq!(
            view.sandbox("s1").map(|r| r.state),
            Some("running"),
            "claimed from a pool: the team's, its hand-over not yet confirmed"
        );
        doc.team_id.clear();
        view.apply(Change::Sandbox("s1".into(), Some(doc)), 4, 0);
        assert_eq!(view.sandbox("s1").map(|r| r.state), Some("pooled"));
        view.apply(Change::Sandbox("s1".into(), None), 5, 0);
        assert!(view.sandbox("s1").is_none());
    }

    #[test]
    fn a_build_event_carries_only_the_lines_written_since_the_last() {
        let mut view = View::default();
        let mut build = BuildDoc {
            build_id: "b1".into(),
            template_id: "t1".into(),
            status: BuildStatus::Building,
            ..BuildDoc::default()
        };
        let line = |m: &str| BuildLogEntry {
            message: m.into(),
            ..BuildLogEntry::default()
        };
        build.append_logs([line("one"), line("two")]);
        let first = view.apply(Change::Build("b1".into(), Some(build.clone())), 1, 0);
        build.append_logs([line("three")]);
        build.status = BuildStatus::Ready;
        let second = view.apply(Change::Build("b1".into(), Some(build)), 2, 0);
        let lines = |d: &[Delta]| match &d[0] {
            Delta::Build(row, lines) => (
                row.status,
                lines.offset,
                lines.lines.iter().map(|l| l.message.clone()).collect::<Vec<_>>(),
            ),
            other => panic!("{other:?}"),
        };
        assert_eq!(lines(&first), ("building", 0, vec!["one".into(), "two".into()]));
        assert_eq!(lines(&second), ("ready", 2, vec!["three".into()]));
        assert_eq!(view.builds("t1").len(), 1);
    }

    #[test]
    fn a_templates_row_counts_its_pool() {
        let mut view = View::default();
        let doc = TemplateDoc {
            template_id: "t1".into(),
            names: vec!["py".into()],
            ..TemplateDoc::default()
        };
        view.apply(Change::Template("t1".into(), Some(doc)), 1, 0);
        view.apply(
            Change::Pool(
                "t1".into(),
                Some(PoolDoc {
                    template_id: "t1".into(),
                    size: 3,
                    ..PoolDoc::default()
                }),
            ),
            2,
            0,
        );
        view.apply(Change::PoolSlot("t1#0".into(), true), 3, 0);
        view.apply(Change::PoolSlot("t1#1".into(), true), 4, 0);
        let deltas = view.apply(Change::PoolSlot("t1#1".into(), true), 5, 0);
        assert!(matches!(&deltas[0], Delta::Template(t) if t.pool_size == Some(3) && t.pool_slots == 2));
        let deltas = view.apply(Change::PoolSlot("t1#0".into(), false), 6, 0);
        assert!(matches!(&deltas[0], Delta::Template(t) if t.pool_slots == 1));
    }
}
