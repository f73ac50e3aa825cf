//! The envd messages the E2B SDK exchanges, in protobuf's canonical JSON mapping (the SDK
//! speaks Connect with its JSON codec): lowerCamelCase names (the original snake_case names
//! are accepted too), `bytes` as base64, enums by name, 64-bit integers as strings, absent
//! fields as defaults. Names and shapes follow `process.proto` and `filesystem.proto` of
//! E2B's envd (../shared/reference/e2b), so an unmodified SDK understands every answer.

use std::collections::BTreeMap;

use base64::Engine;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `bytes` fields: base64 in JSON (standard alphabet; URL-safe accepted on input).
pub mod b64 {
    use super::*;

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        let engines = [
            &base64::engine::general_purpose::STANDARD,
            &base64::engine::general_purpose::STANDARD_NO_PAD,
            &base64::engine::general_purpose::URL_SAFE,
            &base64::engine::general_purpose::URL_SAFE_NO_PAD,
        ];
        engines
            .iter()
            .find_map(|e| e.decode(text.as_bytes()).ok())
            .ok_or_else(|| serde::de::Error::custom("invalid base64"))
    }
}

// ---- process.Process ------------------------------------------------------------------

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct ProcessConfig {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct PtySize {
    pub cols: u32,
    pub rows: u32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct Pty {
    pub size: Option<PtySize>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct StartRequest {
    pub process: ProcessConfig,
    pub pty: Option<Pty>,
    pub tag: Option<String>,
    pub stdin: Option<bool>,
}

/// `ProcessSelector`: a pid or a tag.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct ProcessSelector {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ConnectRequest {
    pub process: ProcessSelector,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct ProcessInput {
    #[serde(skip_serializing_if = "Option::is_none", with = "opt_b64")]
    pub stdin: Option<Vec<u8>>,
    #[serde(skip_serializing_if = "Option::is_none", with = "opt_b64")]
    pub pty: Option<Vec<u8>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct SendInputRequest {
    pub process: ProcessSelector,
    pub input: ProcessInput,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct SendSignalRequest {
    pub process: ProcessSelector,
    /// `SIGNAL_SIGTERM`, `SIGNAL_SIGKILL` (or their numbers).
    pub signal: serde_json::Value,
}

/// One message of `process.Process/StreamInput`: first `start` (which process), then input
/// and keepalives.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub enum StreamInputRequest {
    Start {
        #[serde(default)]
        process: ProcessSelector,
    },
    Data {
        #[serde(default)]
        input: ProcessInput,
    },
    Keepalive {},
}

/// `process.Process/Update`: a terminal's new size.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct UpdateRequest {
    pub process: ProcessSelector,
    pub pty: Option<Pty>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct SelectorOnly {
    pub process: ProcessSelector,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ListResponse {
    pub processes: Vec<ProcessInfo>,
}

/// `ProcessEvent`, as carried by `StartResponse` and `ConnectResponse` (`{"event": …}`).
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    Start { pid: u32 },
    Data(DataEvent),
    End(EndEvent),
    Keepalive {},
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    Stdout(#[serde(with = "b64")] Vec<u8>),
    Stderr(#[serde(with = "b64")] Vec<u8>),
    /// A terminal's output (stdout and stderr together, as the terminal shows them).
    Pty(#[serde(with = "b64")] Vec<u8>),
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct EventResponse {
    pub event: ProcessEvent,
}

/// An empty message (`{}`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Empty {}

/// Optional `bytes`.
pub mod opt_b64 {
    use super::*;

    pub fn serialize<S: Serializer>(bytes: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(b) => b64::serialize(b, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        b64::deserialize(d).map(Some)
    }
}

// ---- filesystem.Filesystem ------------------------------------------------------------

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct PathRequest {
    pub path: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ListDirRequest {
    pub path: String,
    pub depth: u32,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct MoveRequest {
    pub source: String,
    pub destination: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WatchRequest {
    pub path: String,
    pub recursive: bool,
    /// Each event carries the `EntryInfo` of what it names, when that can still be stat-ed
    /// (envd 0.6.3).
    #[serde(alias = "include_entry")]
    pub include_entry: bool,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WatcherRef {
    #[serde(alias = "watcher_id")]
    pub watcher_id: String,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    /// `FILE_TYPE_FILE`, `FILE_TYPE_DIRECTORY`, `FILE_TYPE_SYMLINK`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    /// int64: a string in JSON.
    #[serde(serialize_with = "as_string")]
    pub size: i64,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    /// RFC 3339.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub modified_time: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// The file's `user.e2b.*` extended attributes, prefix stripped (see [`crate::metadata`]);
    /// a protobuf map, so absent when empty.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

fn as_string<S: Serializer>(n: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&n.to_string())
}

#[derive(Clone, Debug, Serialize)]
pub struct EntryResponse {
    pub entry: EntryInfo,
}

#[derive(Clone, Debug, Serialize)]
pub struct ListDirResponse {
    pub entries: Vec<EntryInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_have_the_sdk_shape() {
        let start = serde_json::to_value(EventResponse {
            event: ProcessEvent::Start { pid: 7 },
        })
        .unwrap();
        assert_eq!(start, serde_json::json!({"event": {"start": {"pid": 7}}}));
        let data = serde_json::to_value(EventResponse {
            event: ProcessEvent::Data(DataEvent::Stdout(b"hi\n".to_vec())),
        })
        .unwrap();
        assert_eq!(data, serde_json::json!({"event": {"data": {"stdout": "aGkK"}}}));
        let end = serde_json::to_value(EventResponse {
            event: ProcessEvent::End(EndEvent {
                exit_code: 1,
                exited: true,
                status: "exit status 1".into(),
                error: None,
            }),
        })
        .unwrap();
        assert_eq!(
            end,
            serde_json::json!({"event": {"end": {"exitCode": 1, "exited": true, "status": "exit status 1"}}})
        );
        let keepalive = serde_json::to_value(EventResponse {
            event: ProcessEvent::Keepalive {},
        })
        .unwrap();
        assert_eq!(keepalive, serde_json::json!({"event": {"keepalive": {}}}));
    }

    #[test]
    fn watches_ask_for_entries_in_either_spelling_and_entries_show_metadata_only_when_set() {
        let camel: WatchRequest = serde_json::from_str(r#"{"path":"/tmp","includeEntry":true}"#).unwrap();
        let snake: WatchRequest =
            serde_json::from_str(r#"{"path":"/tmp","include_entry":true,"allowNetworkMounts":false}"#).unwrap();
        let plain: WatchRequest = serde_json::from_str(r#"{"path":"/tmp","recursive":true}"#).unwrap();
        assert_eq!(
            (camel.include_entry, snake.include_entry, plain.include_entry),
            (true, true, false)
        );
        let mut entry = EntryInfo {
            name: "a.txt".into(),
            kind: "FILE_TYPE_FILE",
            path: "/home/user/a.txt".into(),
            size: 3,
            mode: 0o644,
            permissions: "-rw-r--r--".into(),
            owner: "user".into(),
            group: "user".into(),
            modified_time: None,
            symlink_target: None,
            metadata: BTreeMap::new(),
        };
        let json = serde_json::to_value(&entry).unwrap();
        assert!(json.get("metadata").is_none(), "{json}");
        entry.metadata.insert("owner".into(), "alice".into());
        let json = serde_json::to_value(&entry).unwrap();
        assert_eq!(json["metadata"], serde_json::json!({"owner": "alice"}));
        assert_eq!(json["size"], "3");
    }

    #[test]
    fn requests_parse_from_sdk_json() {
        let start: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/home/user"},"stdin":false}"#,
        )
        .unwrap();
        assert_eq!(start.process.args.len(), 3);
        assert_eq!(start.stdin, Some(false));
        let input: SendInputRequest =
            serde_json::from_str(r#"{"process":{"pid":12},"input":{"stdin":"aGkK"}}"#).unwrap();
        assert_eq!(input.input.stdin.as_deref(), Some(&b"hi\n"[..]));
    }
}
