//! envd as it runs inside a sandbox: the real binary, listening on a Unix socket, with its own
//! passwd file naming `root` and `user` (uid 1000). Paths are the sandbox's own (here the test
//! machine's, under a temporary directory), requests act as the user they name, what envd
//! creates belongs to that user, and files stream both ways. Needs root (to act as uid 1000),
//! as these machines and CI run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use base64::Engine;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{json, Value};

struct Envd {
    child: Child,
    socket: PathBuf,
    dir: PathBuf,
}

impl Drop for Envd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(name: &str) -> Envd {
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "these tests act as uid 1000 and need root (run them as root, as CI does)"
    );
    let dir = std::env::temp_dir().join(format!("envd-inside-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let home = dir.join("home/user");
    std::fs::create_dir_all(&home).unwrap();
    std::os::unix::fs::chown(&home, Some(1000), Some(1000)).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let passwd = dir.join("passwd");
    std::fs::write(
        &passwd,
        format!(
            "root:x:0:0:root:{}:/bin/sh\nuser:x:1000:1000::{}:/bin/sh\n",
            dir.display(),
            home.display()
        ),
    )
    .unwrap();
    let socket = dir.join("envd.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_sandboxsched-envd"))
        .args([
            "--listen".as_ref(),
            socket.as_os_str(),
            "--passwd".as_ref(),
            passwd.as_os_str(),
        ])
        .env(envd::SANDBOX_ID_VAR, "sbx-inside")
        .env(envd::VARS_VAR, r#"{"GREETING":"hello"}"#)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(std::time::Instant::now() < deadline, "envd did not listen");
        std::thread::sleep(Duration::from_millis(10));
    }
    Envd { child, socket, dir }
}

/// One HTTP/1.1 request over the socket: (status, body).
async fn call(socket: &Path, method: &str, path: &str, headers: &[(&str, String)], body: Vec<u8>) -> (u16, Vec<u8>) {
    let stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "envd");
    for (k, v) in headers {
        request = request.header(*k, v);
    }
    let response = sender
        .send_request(request.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, bytes.to_vec())
}

fn as_user(name: &str) -> (&'static str, String) {
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{name}:"));
    ("authorization", format!("Basic {encoded}"))
}

async fn unary(socket: &Path, method: &str, body: Value, user: &str) -> (u16, Value) {
    let (status, bytes) = call(
        socket,
        "POST",
        &format!("/{method}"),
        &[("content-type", "application/json".into()), as_user(user)],
        body.to_string().into_bytes(),
    )
    .await;
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// Runs a command to its end: (stdout, exit code).
async fn run(socket: &Path, process: Value, user: &str) -> (String, i64) {
    let payload = json!({"process": process, "stdin": false}).to_string().into_bytes();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    framed.extend_from_slice(&payload);
    let (status, bytes) = call(
        socket,
        "POST",
        "/process.Process/Start",
        &[("content-type", "application/connect+json".into()), as_user(user)],
        framed,
    )
    .await;
    assert_eq!(status, 200);
    let (mut stdout, mut code, mut at) = (String::new(), i64::MIN, 0);
    while at + 5 <= bytes.len() {
        let len = u32::from_be_bytes([bytes[at + 1], bytes[at + 2], bytes[at + 3], bytes[at + 4]]) as usize;
        let msg: Value = serde_json::from_slice(&bytes[at + 5..at + 5 + len]).unwrap();
        if let Some(data) = msg["event"]["data"]["stdout"].as_str() {
            let raw = base64::engine::general_purpose::STANDARD.decode(data).unwrap();
            stdout.push_str(&String::from_utf8_lossy(&raw));
        }
        if let Some(end) = msg["event"]["end"].as_object() {
            code = end.get("exitCode").and_then(Value::as_i64).unwrap_or(0);
        }
        at += 5 + len;
    }
    (stdout, code)
}

#[tokio::test]
async fn commands_run_as_the_user_they_name_with_its_home_and_the_sandboxs_vars() {
    let envd = start("users");
    let home = envd.dir.join("home/user");
    let (out, code) = run(
        &envd.socket,
        json!({"cmd": "/bin/sh", "args": ["-c", "id -u; pwd; echo $HOME $GREETING $E2B_SANDBOX_ID"]}),
        "user",
    )
    .await;
    assert_eq!(code, 0);
    assert_eq!(out, format!("1000\n{0}\n{0} hello sbx-inside\n", home.display()));
    let (out, _) = run(&envd.socket, json!({"cmd": "id", "args": ["-u"]}), "root").await;
    assert_eq!(out, "0\n");
    // A user the sandbox does not have is refused, not run as someone else.
    let (status, body) = unary(
        &envd.socket,
        "filesystem.Filesystem/Stat",
        json!({"path": "/"}),
        "mallory",
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body["message"].as_str().unwrap().contains("mallory"), "{body}");
    let (status, vars) = call(&envd.socket, "GET", "/envs", &[], Vec::new()).await;
    assert_eq!(
        (status, serde_json::from_slice::<Value>(&vars).unwrap()),
        (200, json!({"GREETING": "hello"}))
    );
}

#[tokio::test]
async fn any_absolute_path_is_the_sandboxs_and_what_envd_makes_belongs_to_the_user() {
    use std::os::unix::fs::MetadataExt;
    let envd = start("paths");
    // Outside the home (E2B users write /tmp, /opt, /code every day).
    let target = envd.dir.join("opt/tool/config.txt");
    let (status, body) = call(
        &envd.socket,
        "POST",
        &format!("/files?path={}", target.display()),
        &[("content-type", "application/octet-stream".into())],
        b"settings".to_vec(),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(std::fs::read(&target).unwrap(), b"settings");
    let meta = std::fs::metadata(&target).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (1000, 1000), "the default user owns the file");
    assert_eq!(
        std::fs::metadata(envd.dir.join("opt/tool")).unwrap().uid(),
        1000,
        "and the parents it made"
    );
    let (_, stat) = unary(
        &envd.socket,
        "filesystem.Filesystem/Stat",
        json!({"path": target}),
        "user",
    )
    .await;
    assert_eq!(stat["entry"]["owner"], "user");
    assert_eq!(stat["entry"]["path"], target.display().to_string());
    // Relative paths start at the requesting user's home; root's files stay root's.
    let (status, _) = unary(
        &envd.socket,
        "filesystem.Filesystem/MakeDir",
        json!({"path": "made"}),
        "root",
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(std::fs::metadata(envd.dir.join("made")).unwrap().uid(), 0);
}

/// Chunk `k` of the test file: one pseudo-random block with `k` stamped in front, so a chunk
/// out of place or repeated is caught.
fn chunk(block: &[u8], k: u64) -> Vec<u8> {
    let mut data = block.to_vec();
    data[..8].copy_from_slice(&k.to_le_bytes());
    data
}

/// envd's peak resident memory (VmHWM) in bytes.
fn peak_rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kb| kb * 1024)
}

/// 1 GiB up and back down, generated and checked as it flows: envd's own memory stays a few
/// buffers, whatever the file's size.
#[tokio::test]
async fn a_1_gib_file_streams_both_ways_in_bounded_memory() {
    use futures::StreamExt;
    const SIZE: u64 = 1 << 30;
    const CHUNK: u64 = 1 << 20;
    let envd = start("stream");
    let path = envd.dir.join("big.bin");
    let block: Vec<u8> = (0..CHUNK)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let up = block.clone();
    let chunks = futures::stream::iter(0..SIZE / CHUNK)
        .map(move |k| Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(Bytes::from(chunk(&up, k)))));
    let stream = tokio::net::UnixStream::connect(&envd.socket).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let upload = hyper::Request::post(format!("/files?path={}", path.display()))
        .header("host", "envd")
        .header("content-type", "application/octet-stream")
        .body(http_body_util::StreamBody::new(chunks))
        .unwrap();
    let response = sender.send_request(upload).await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), SIZE);

    let stream = tokio::net::UnixStream::connect(&envd.socket).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let download = hyper::Request::get(format!("/files?path={}", path.display()))
        .header("host", "envd")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let mut body = sender.send_request(download).await.unwrap().into_body();
    let (mut at, mut expected) = (0u64, chunk(&block, 0));
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.unwrap().into_data() else { continue };
        let mut rest = &data[..];
        while !rest.is_empty() {
            let offset = (at % CHUNK) as usize;
            if offset == 0 {
                expected = chunk(&block, at / CHUNK);
            }
            let n = rest.len().min(CHUNK as usize - offset);
            assert!(rest[..n] == expected[offset..offset + n], "bytes from {at} differ");
            rest = &rest[n..];
            at += n as u64;
        }
    }
    assert_eq!(at, SIZE);
    let peak = peak_rss(envd.child.id());
    assert!(peak < 64 << 20, "envd peaked at {} MiB for a 1 GiB file", peak >> 20);
    eprintln!("envd peak RSS {} MiB streaming 1 GiB each way", peak >> 20);
}

/// The SDK's default upload is multipart (several files in one body when it writes several),
/// and `gzip=True` sends an octet-stream body with `Content-Encoding: gzip`: both of any size,
/// stored as the user wrote them.
#[tokio::test]
async fn multipart_uploads_of_any_size_and_gzip_bodies_are_stored_as_written() {
    let envd = start("multipart");
    let big: Vec<u8> = (0..(12u32 << 20))
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let small = b"second file".to_vec();
    let boundary = "sandboxsched-boundary";
    let mut body = Vec::new();
    for (name, data) in [("big.bin", &big), ("small.txt", &small)] {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{}\"\r\nContent-Type: application/octet-stream\r\n\r\n",
                envd.dir.join(name).display()
            )
            .as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let (status, answer) = call(
        &envd.socket,
        "POST",
        "/files",
        &[("content-type", format!("multipart/form-data; boundary={boundary}"))],
        body,
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    assert!(std::fs::read(envd.dir.join("big.bin")).unwrap() == big, "12 MiB part");
    assert_eq!(std::fs::read(envd.dir.join("small.txt")).unwrap(), small);

    // gzip: a stream compressed by the test, inflated by envd as it arrives.
    let mut gz = Vec::new();
    {
        use std::io::Write;
        let mut encoder = flate2::write::GzEncoder::new(&mut gz, flate2::Compression::fast());
        encoder.write_all(&big).unwrap();
        encoder.finish().unwrap();
    }
    let target = envd.dir.join("inflated.bin");
    let (status, answer) = call(
        &envd.socket,
        "POST",
        &format!("/files?path={}", target.display()),
        &[
            ("content-type", "application/octet-stream".to_string()),
            ("content-encoding", "gzip".to_string()),
        ],
        gz,
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    assert!(std::fs::read(&target).unwrap() == big, "stored inflated");
    let (status, _) = call(
        &envd.socket,
        "POST",
        &format!("/files?path={}", target.display()),
        &[
            ("content-type", "application/octet-stream".to_string()),
            ("content-encoding", "br".to_string()),
        ],
        b"x".to_vec(),
    )
    .await;
    assert_eq!(status, 415, "an encoding envd cannot read is refused, not stored raw");
}
