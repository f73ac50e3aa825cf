//! A sandbox's logs: envd's own events and its start command's output (envd writes one JSON
//! object a line, as `tracing`'s JSON format has it, to its stderr), and the node's lifecycle
//! events in the same shape, all in the sandbox's `container.log`, a file of the node's outside
//! the sandbox's own layer. Served by E2B's `GET /v2/sandboxes/{id}/logs`.
//!
//! The file's content comes from inside the sandbox, so it is read as untrusted: only its
//! tail ([`READ_AT_MOST`]), lines that are not JSON kept as plain messages, and the file cut
//! back when it grows past [`KEEP_AT_MOST`] (a sandbox that floods its log fills no disk).

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use serde_json::Value;

/// The most of a log read to answer one request.
pub const READ_AT_MOST: u64 = 8 << 20;
/// A log longer than this is emptied (after a last line saying so).
pub const KEEP_AT_MOST: u64 = 16 << 20;

/// One log entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub at_unix_ms: u64,
    /// `debug`, `info`, `warn` or `error`.
    pub level: String,
    pub message: String,
    pub fields: BTreeMap<String, String>,
}

/// What a request asks for.
#[derive(Clone, Debug, Default)]
pub struct Query {
    /// Entries at or after (forward) / at or before (backward) this time, unix ms.
    pub cursor_ms: Option<u64>,
    pub limit: usize,
    pub backward: bool,
    /// The least severe level wanted.
    pub level: Option<String>,
    /// A substring the message must contain.
    pub search: Option<String>,
}

fn severity(level: &str) -> u8 {
    match level {
        "debug" | "trace" => 0,
        "info" => 1,
        "warn" => 2,
        _ => 3,
    }
}

/// Parses one line; `previous_ms` dates a line that carries no time of its own (a plain line
/// a runtime wrote).
pub fn parse(line: &str, previous_ms: u64) -> Option<Entry> {
    let line = line.trim_end();
    if line.is_empty() {
        return None;
    }
    let Ok(Value::Object(event)) = serde_json::from_str::<Value>(line) else {
        return Some(Entry {
            at_unix_ms: previous_ms,
            level: "info".into(),
            message: line.to_string(),
            fields: BTreeMap::new(),
        });
    };
    let at_unix_ms = event
        .get("timestamp")
        .and_then(Value::as_str)
        .and_then(|t| humantime::parse_rfc3339_weak(t.trim_end_matches('Z')).ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(previous_ms, |d| d.as_millis() as u64);
    let level = event
        .get("level")
        .and_then(Value::as_str)
        .unwrap_or("info")
        .to_ascii_lowercase();
    let mut fields = BTreeMap::new();
    let mut message = String::new();
    if let Some(Value::Object(given)) = event.get("fields") {
        for (k, v) in given {
            let text = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            if k == "message" {
                message = text;
            } else {
                fields.insert(k.clone(), text);
            }
        }
    }
    if let Some(Value::String(target)) = event.get("target") {
        fields.insert("logger".into(), target.clone());
    }
    Some(Entry {
        at_unix_ms,
        level,
        message,
        fields,
    })
}

/// The entries of a log's text that `query` asks for, in its direction.
pub fn select(text: &str, query: &Query) -> Vec<Entry> {
    let mut previous = 0;
    let mut entries: Vec<Entry> = text
        .lines()
        .filter_map(|line| {
            let entry = parse(line, previous)?;
            previous = entry.at_unix_ms;
            Some(entry)
        })
        .filter(|e| query.level.as_deref().is_none_or(|l| severity(&e.level) >= severity(l)))
        .filter(|e| query.search.as_deref().is_none_or(|s| e.message.contains(s)))
        .filter(|e| match (query.cursor_ms, query.backward) {
            (None, _) => true,
            (Some(c), false) => e.at_unix_ms >= c,
            (Some(c), true) => e.at_unix_ms <= c,
        })
        .collect();
    if query.backward {
        entries.reverse();
    }
    entries.truncate(query.limit);
    entries
}

/// The tail of the log at `path` (at most [`READ_AT_MOST`], from a line start); empty when
/// there is none.
pub fn tail(path: &Path) -> String {
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let from = len.saturating_sub(READ_AT_MOST);
    if file.seek(SeekFrom::Start(from)).is_err() {
        return String::new();
    }
    let mut bytes = Vec::new();
    let _ = file.take(READ_AT_MOST).read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes).into_owned();
    if from > 0 {
        // Cut mid-line: start at the next whole one.
        text.split_once('\n')
            .map_or_else(String::new, |(_, rest)| rest.to_string())
    } else {
        text
    }
}

/// Appends one of the node's own events to the log at `path`, in envd's shape.
pub fn note(path: &Path, level: &str, message: &str) {
    let line = serde_json::json!({
        "timestamp": humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
        "level": level.to_ascii_uppercase(),
        "fields": {"message": message},
        "target": "node",
    });
    // One write of the whole line: envd appends to the same file at any moment, and
    // `writeln!` on a `File` issues a write per formatted piece, so envd's line could land
    // inside ours (O_APPEND keeps each write whole, not a sequence of them).
    let mut text = line.to_string();
    text.push('\n');
    if let Ok(mut file) = std::fs::OpenOptions::new().append(true).open(path) {
        let _ = file.write_all(text.as_bytes());
    }
}

/// Empties the log at `path` when it has grown past [`KEEP_AT_MOST`], saying so in it.
pub fn cap(path: &Path) {
    let Ok(meta) = std::fs::metadata(path) else { return };
    if meta.len() <= KEEP_AT_MOST {
        return;
    }
    if let Ok(file) = std::fs::OpenOptions::new().write(true).open(path) {
        if file.set_len(0).is_ok() {
            note(
                path,
                "warn",
                &format!("the log passed {} MiB and was emptied", KEEP_AT_MOST >> 20),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = r#"{"timestamp":"2026-12-01T10:00:00.000000Z","level":"INFO","fields":{"message":"envd serving","sandbox_id":"s"},"target":"envd"}
{"timestamp":"2026-12-01T10:00:01.000Z","level":"INFO","fields":{"message":"listening on 8000","stream":"stdout","cut":false},"target":"start"}
runc: a plain line a runtime wrote
{"timestamp":"2026-12-01T10:00:02.000Z","level":"ERROR","fields":{"message":"boom","stream":"stderr"},"target":"start"}
"#;

    fn query() -> Query {
        Query {
            limit: 100,
            ..Query::default()
        }
    }

    #[test]
    fn lines_are_envds_json_events_or_plain_text_dated_by_the_one_before() {
        let all = select(LOG, &query());
        assert_eq!(all.len(), 4);
        assert_eq!(all[0].message, "envd serving");
        assert_eq!(all[0].fields.get("logger").map(String::as_str), Some("envd"));
        assert_eq!(all[1].fields.get("stream").map(String::as_str), Some("stdout"));
        assert_eq!(all[1].at_unix_ms, all[0].at_unix_ms + 1_000);
        assert_eq!((all[2].level.as_str(), all[2].at_unix_ms), ("info", all[1].at_unix_ms));
        assert_eq!(all[3].level, "error");
    }

    #[test]
    fn queries_filter_by_time_level_and_text_in_either_direction() {
        let t1 = select(LOG, &query())[1].at_unix_ms;
        let forward = select(
            LOG,
            &Query {
                cursor_ms: Some(t1),
                ..query()
            },
        );
        assert_eq!(forward.len(), 3, "at or after the cursor");
        let backward = select(
            LOG,
            &Query {
                cursor_ms: Some(t1),
                backward: true,
                ..query()
            },
        );
        assert_eq!(
            backward.iter().map(|e| e.message.as_str()).collect::<Vec<_>>()[0],
            "runc: a plain line a runtime wrote"
        );
        let errors = select(
            LOG,
            &Query {
                level: Some("warn".into()),
                ..query()
            },
        );
        assert_eq!(errors.len(), 1);
        let found = select(
            LOG,
            &Query {
                search: Some("8000".into()),
                ..query()
            },
        );
        assert_eq!(found.len(), 1);
        assert_eq!(select(LOG, &Query { limit: 2, ..query() }).len(), 2);
    }

    #[test]
    fn the_node_notes_in_envds_shape_and_a_flooded_log_is_emptied() {
        let path = std::env::temp_dir().join(format!("logs-test-{}.log", std::process::id()));
        std::fs::write(&path, vec![b'x'; (KEEP_AT_MOST + 1) as usize]).unwrap();
        cap(&path);
        let text = tail(&path);
        let entries = select(&text, &query());
        assert_eq!(entries.len(), 1, "{text}");
        assert!(entries[0].message.contains("emptied"));
        note(&path, "info", "sandbox paused");
        let entries = select(&tail(&path), &query());
        assert_eq!(entries[1].message, "sandbox paused");
        assert_eq!(entries[1].fields.get("logger").map(String::as_str), Some("node"));
        let _ = std::fs::remove_file(&path);
    }

    /// envd appends to the log while the node notes in it: every line stays whole (the node's
    /// note once went out in pieces and envd's line landed in the middle of it).
    #[test]
    fn notes_and_envds_lines_never_interleave() {
        let path = std::env::temp_dir().join(format!("logs-interleave-{}.log", std::process::id()));
        std::fs::write(&path, b"").unwrap();
        let writer = {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut file = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
                for i in 0..2_000 {
                    let line = format!(
                        "{{\"timestamp\":\"2026-12-01T10:00:00Z\",\"level\":\"INFO\",\"fields\":{{\"message\":\"envd {i}\"}},\"target\":\"start\"}}\n"
                    );
                    file.write_all(line.as_bytes()).unwrap();
                }
            })
        };
        for i in 0..2_000 {
            note(&path, "info", &format!("node {i}"));
        }
        writer.join().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(text.lines().count(), 4_000);
        for line in text.lines() {
            assert!(serde_json::from_str::<Value>(line).is_ok(), "a broken line: {line}");
        }
    }
}
