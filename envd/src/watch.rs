//! Directory watches (inotify through the `notify` crate), for both ways the SDK watches:
//! `WatchDir` streams events; `CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher` let the
//! sync SDK poll for them.
//!
//! With `includeEntry` (envd 0.6.3) each event also carries the `EntryInfo` of what it names.
//! That entry is stat-ed on notify's thread as the event arrives, not when the SDK collects it
//! (a polled watcher may be read seconds later, when the file has changed again or is gone), so
//! the watch keeps an [`OwnedScope`] of the request that started it to show paths and owners
//! as that request would. An entry that can no longer be stat-ed (renamed away, or removed:
//! those are never stat-ed, lest a new file at the same path be described) has none.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use notify::event::{EventKind, ModifyKind};
use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::connect::{Code, RpcError};
use crate::paths::OwnedScope;
use crate::wire::EntryInfo;

/// Events kept per polled watcher before the oldest are dropped.
const BUFFERED: usize = 10_000;

/// `FilesystemEvent`: the entry's path relative to the watched directory, what happened, and
/// (when asked for and still there) the entry itself.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct FsEvent {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

const REMOVE: &str = "EVENT_TYPE_REMOVE";

fn event_type(kind: &EventKind) -> Option<&'static str> {
    Some(match kind {
        EventKind::Create(_) => "EVENT_TYPE_CREATE",
        EventKind::Modify(ModifyKind::Name(_)) => "EVENT_TYPE_RENAME",
        EventKind::Modify(ModifyKind::Metadata(_)) => "EVENT_TYPE_CHMOD",
        EventKind::Modify(_) => "EVENT_TYPE_WRITE",
        EventKind::Remove(_) => REMOVE,
        EventKind::Access(_) | EventKind::Any | EventKind::Other => return None,
    })
}

/// Starts watching `dir`; every event goes to `sink`, with its entry described in `entries`
/// when given.
pub fn watch(
    dir: &Path,
    recursive: bool,
    entries: Option<OwnedScope>,
    sink: impl Fn(FsEvent) + Send + 'static,
) -> Result<RecommendedWatcher, RpcError> {
    if !dir.is_dir() {
        return Err(RpcError::new(
            Code::NotFound,
            format!("{} is not a directory", dir.display()),
        ));
    }
    let root: PathBuf = dir.to_path_buf();
    let mut watcher = notify::recommended_watcher(move |result: notify::Result<notify::Event>| {
        let Ok(event) = result else { return };
        let Some(kind) = event_type(&event.kind) else { return };
        for path in &event.paths {
            let name = path.strip_prefix(&root).unwrap_or(path).display().to_string();
            let entry = match &entries {
                Some(scope) if kind != REMOVE => scope.scope().entry(path).ok(),
                _ => None,
            };
            sink(FsEvent { name, kind, entry });
        }
    })
    .map_err(|e| RpcError::new(Code::Internal, format!("cannot watch: {e}")))?;
    let mode = if recursive {
        RecursiveMode::Recursive
    } else {
        RecursiveMode::NonRecursive
    };
    watcher
        .watch(dir, mode)
        .map_err(|e| RpcError::new(Code::Internal, format!("cannot watch {}: {e}", dir.display())))?;
    Ok(watcher)
}

/// A streaming watch: the watcher lives as long as the returned receiver is read.
pub fn stream(
    dir: &Path,
    recursive: bool,
    entries: Option<OwnedScope>,
) -> Result<(RecommendedWatcher, mpsc::UnboundedReceiver<FsEvent>), RpcError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let watcher = watch(dir, recursive, entries, move |e| {
        let _ = tx.send(e);
    })?;
    Ok((watcher, rx))
}

struct Polled {
    events: Arc<Mutex<Vec<FsEvent>>>,
    _watcher: RecommendedWatcher,
}

/// Watchers the SDK polls, by ID.
#[derive(Default)]
pub struct Watchers {
    by_id: Mutex<HashMap<String, Polled>>,
}

impl Watchers {
    pub fn create(&self, dir: &Path, recursive: bool, entries: Option<OwnedScope>) -> Result<String, RpcError> {
        let events = Arc::new(Mutex::new(Vec::new()));
        let buffer = events.clone();
        let watcher = watch(dir, recursive, entries, move |e| {
            if let Ok(mut b) = buffer.lock() {
                if b.len() >= BUFFERED {
                    b.remove(0);
                }
                b.push(e);
            }
        })?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        if let Ok(mut map) = self.by_id.lock() {
            map.insert(
                id.clone(),
                Polled {
                    events,
                    _watcher: watcher,
                },
            );
        }
        Ok(id)
    }

    /// Takes the events gathered since the last call.
    pub fn take(&self, id: &str) -> Result<Vec<FsEvent>, RpcError> {
        let map = self
            .by_id
            .lock()
            .map_err(|_| RpcError::new(Code::Internal, "watcher registry poisoned"))?;
        let polled = map
            .get(id)
            .ok_or_else(|| RpcError::new(Code::NotFound, format!("watcher {id} not found")))?;
        let events = polled
            .events
            .lock()
            .map(|mut e| std::mem::take(&mut *e))
            .unwrap_or_default();
        Ok(events)
    }

    pub fn remove(&self, id: &str) -> Result<(), RpcError> {
        let mut map = self
            .by_id
            .lock()
            .map_err(|_| RpcError::new(Code::Internal, "watcher registry poisoned"))?;
        map.remove(id)
            .map(|_| ())
            .ok_or_else(|| RpcError::new(Code::NotFound, format!("watcher {id} not found")))
    }
}
