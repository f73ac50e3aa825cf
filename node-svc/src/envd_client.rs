//! The node as a client of a sandbox's own envd, over the Unix socket only the node reaches:
//! for running a command inside a sandbox the node started (a template build's steps, a
//! template's ready check), the way the SDK's `commands.run` does through the gateway.
//!
//! The call is envd's `process.Process/Start` in the Connect protocol: one enveloped JSON
//! request, a stream of enveloped events back (start, output, end) closed by an
//! end-of-stream envelope.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use http_body_util::BodyExt as _;

/// What to run.
#[derive(Clone, Debug, Default)]
pub struct Command {
    /// Run by `/bin/sh -c`.
    pub script: String,
    /// Who runs it (empty: the sandbox's default user).
    pub user: String,
    pub env: BTreeMap<String, String>,
    /// Where it starts (empty: the user's home, or the sandbox's default working directory).
    pub cwd: String,
}

/// How a command ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exit {
    pub code: i32,
    /// envd's description when it did not exit by itself (a signal).
    pub status: String,
}

/// Why a command could not be run.
#[derive(Debug, thiserror::Error)]
pub enum EnvdError {
    #[error("cannot reach the sandbox's envd: {0}")]
    Connect(String),
    #[error("envd refused the command: {0}")]
    Refused(String),
    #[error("the command did not end within {0:?}")]
    Timeout(Duration),
    #[error("envd's answer was malformed: {0}")]
    Protocol(String),
}

fn envelope(payload: &[u8]) -> Vec<u8> {
    let mut framed = Vec::with_capacity(payload.len() + 5);
    framed.push(0);
    framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    framed.extend_from_slice(payload);
    framed
}

/// Runs `command` through the envd listening on `socket`, handing each line of its output to
/// `on_line` (`stderr` true for its error stream), within `deadline`.
pub async fn run(
    socket: &Path,
    command: &Command,
    deadline: Duration,
    mut on_line: impl FnMut(bool, &str) + Send,
) -> Result<Exit, EnvdError> {
    let run = async {
        let mut sender = connect(socket).await?;
        let mut process = serde_json::json!({
            "cmd": "/bin/sh",
            "args": ["-c", command.script],
            "envs": command.env,
        });
        if !command.cwd.is_empty() {
            process["cwd"] = serde_json::json!(command.cwd);
        }
        let body = serde_json::json!({"process": process, "stdin": false}).to_string();
        let mut request = hyper::Request::post("http://sandbox/process.Process/Start")
            .header("content-type", "application/connect+json")
            .header("host", "sandbox");
        if !command.user.is_empty() {
            let basic = base64::engine::general_purpose::STANDARD.encode(format!("{}:", command.user));
            request = request.header("authorization", format!("Basic {basic}"));
        }
        let request = request
            .body(Full::new(bytes::Bytes::from(envelope(body.as_bytes()))))
            .map_err(|e| EnvdError::Protocol(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| EnvdError::Connect(e.to_string()))?;
        if !response.status().is_success() {
            return Err(EnvdError::Refused(body_text(response).await));
        }
        let mut body = response.into_body();
        let mut buffer: Vec<u8> = Vec::new();
        let mut lines = Lines::default();
        let mut exit = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| EnvdError::Connect(e.to_string()))?;
            let Ok(data) = frame.into_data() else { continue };
            buffer.extend_from_slice(&data);
            while buffer.len() >= 5 {
                let len = u32::from_be_bytes([buffer[1], buffer[2], buffer[3], buffer[4]]) as usize;
                if buffer.len() < 5 + len {
                    break;
                }
                let flags = buffer[0];
                let message: serde_json::Value =
                    serde_json::from_slice(&buffer[5..5 + len]).map_err(|e| EnvdError::Protocol(e.to_string()))?;
                buffer.drain(..5 + len);
                if flags & 0x02 != 0 {
                    if let Some(error) = message.get("error") {
                        return Err(EnvdError::Refused(error.to_string()));
                    }
                    continue;
                }
                let event = &message["event"];
                if let Some(data) = event.get("data") {
                    for (stream, stderr) in [("stdout", false), ("stderr", true), ("pty", false)] {
                        if let Some(text) = data.get(stream).and_then(|v| v.as_str()) {
                            let bytes = base64::engine::general_purpose::STANDARD
                                .decode(text)
                                .map_err(|e| EnvdError::Protocol(e.to_string()))?;
                            lines.push(stderr, &bytes, &mut on_line);
                        }
                    }
                }
                if let Some(end) = event.get("end") {
                    exit = Some(Exit {
                        code: end.get("exitCode").and_then(|c| c.as_i64()).unwrap_or(-1) as i32,
                        status: end.get("status").and_then(|s| s.as_str()).unwrap_or("").to_string(),
                    });
                }
            }
        }
        lines.flush(&mut on_line);
        exit.ok_or_else(|| EnvdError::Protocol("the stream ended without the command's end".into()))
    };
    tokio::time::timeout(deadline, run)
        .await
        .map_err(|_| EnvdError::Timeout(deadline))?
}

/// One HTTP/1.1 connection to the envd listening on `socket`.
async fn connect(socket: &Path) -> Result<hyper::client::conn::http1::SendRequest<Full>, EnvdError> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| EnvdError::Connect(e.to_string()))?;
    let (sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| EnvdError::Connect(e.to_string()))?;
    tokio::spawn(connection);
    Ok(sender)
}

type Full = http_body_util::Full<bytes::Bytes>;

/// What a refusal's body says (empty when it cannot be read).
async fn body_text(response: hyper::Response<hyper::body::Incoming>) -> String {
    let body = response
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    String::from_utf8_lossy(&body).into_owned()
}

/// Adds `env` to the env vars every later command of the sandbox gets (envd's `/init`, as a
/// claim of a pooled sandbox does), within `deadline`.
pub async fn init(socket: &Path, env: &BTreeMap<String, String>, deadline: Duration) -> Result<(), EnvdError> {
    let call = async {
        let mut sender = connect(socket).await?;
        let body = serde_json::json!({ "envVars": env }).to_string();
        let request = hyper::Request::post("http://sandbox/init")
            .header("content-type", "application/json")
            .header("host", "sandbox")
            .body(Full::new(bytes::Bytes::from(body)))
            .map_err(|e| EnvdError::Protocol(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| EnvdError::Connect(e.to_string()))?;
        if response.status().is_success() {
            return Ok(());
        }
        let status = response.status();
        Err(EnvdError::Refused(format!("{status}: {}", body_text(response).await)))
    };
    tokio::time::timeout(deadline, call)
        .await
        .map_err(|_| EnvdError::Timeout(deadline))?
}

/// Output cut into lines per stream (a line longer than [`MAX_LINE`] is cut there).
#[derive(Default)]
struct Lines {
    partial: [Vec<u8>; 2],
}

/// Longest line handed on whole.
const MAX_LINE: usize = 16 << 10;

impl Lines {
    fn push(&mut self, stderr: bool, bytes: &[u8], on_line: &mut impl FnMut(bool, &str)) {
        let buf = &mut self.partial[usize::from(stderr)];
        for &b in bytes {
            if b == b'\n' || buf.len() >= MAX_LINE {
                on_line(stderr, String::from_utf8_lossy(buf).trim_end_matches('\r'));
                buf.clear();
                if b == b'\n' {
                    continue;
                }
            }
            buf.push(b);
        }
    }

    fn flush(&mut self, on_line: &mut impl FnMut(bool, &str)) {
        for (i, buf) in self.partial.iter_mut().enumerate() {
            if !buf.is_empty() {
                on_line(i == 1, String::from_utf8_lossy(buf).trim_end_matches('\r'));
                buf.clear();
            }
        }
    }
}

/// Runs `command` until it exits 0 (a template's ready check), backing off between tries,
/// for at most `deadline`; the error says how the last try ended.
pub async fn until_ok(socket: &Path, command: &Command, deadline: Duration) -> Result<(), String> {
    let until = tokio::time::Instant::now() + deadline;
    let mut pause = Duration::from_millis(20);
    loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let last = run(socket, command, left, |_, _| {}).await;
        match last {
            Ok(exit) if exit.code == 0 => return Ok(()),
            _ if tokio::time::Instant::now() + pause >= until => {
                let how = match last {
                    Ok(exit) => format!("its last try exited {}", exit.code),
                    Err(err) => err.to_string(),
                };
                return Err(format!(
                    "{:?} did not succeed within {} s ({how})",
                    command.script,
                    deadline.as_secs()
                ));
            }
            _ => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_cut_into_lines_per_stream() {
        let mut lines = Lines::default();
        let mut got = Vec::new();
        let mut collect = |stderr: bool, line: &str| got.push((stderr, line.to_string()));
        lines.push(false, b"a\r\nb", &mut collect);
        lines.push(true, b"err\n", &mut collect);
        lines.push(false, b"c\n", &mut collect);
        lines.push(false, b"tail", &mut collect);
        lines.flush(&mut collect);
        assert_eq!(
            got,
            vec![
                (false, "a".to_string()),
                (true, "err".to_string()),
                (false, "bc".to_string()),
                (false, "tail".to_string())
            ]
        );
        assert_eq!(envelope(b"{}"), vec![0, 0, 0, 0, 2, b'{', b'}']);
    }
}
