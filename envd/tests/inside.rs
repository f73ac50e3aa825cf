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
        // SAFETY: geteuid cannot fail and touches no memory.
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
    // Until a connection is taken: the socket's file appears at bind, a moment before envd
    // listens, and a request in that moment is refused (seen once in CI under load).
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
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

/// An octet-stream upload of `body` to `path` with extra `headers`: (status, JSON answer).
async fn upload(envd: &Envd, path: &Path, body: &[u8], headers: &[(&str, &str)]) -> (u16, Value) {
    let mut all = vec![("content-type", "application/octet-stream".to_string())];
    all.extend(headers.iter().map(|(k, v)| (*k, v.to_string())));
    let (status, answer) = call(
        &envd.socket,
        "POST",
        &format!("/files?path={}", path.display()),
        &all,
        body.to_vec(),
    )
    .await;
    (status, serde_json::from_slice(&answer).unwrap_or(Value::Null))
}

/// `Stat`'s entry for `path`.
async fn stat(envd: &Envd, path: &Path) -> Value {
    let (status, answer) = unary(
        &envd.socket,
        "filesystem.Filesystem/Stat",
        json!({"path": path}),
        "user",
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    answer["entry"].clone()
}

/// The raw extended attribute `name` of `path`, if it has one.
fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let name = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 8192];
    // SAFETY: NUL-terminated strings and a buffer of the length given.
    let got = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    let got = usize::try_from(got).ok()?;
    buf.truncate(got);
    Some(buf)
}

/// envd 0.6.2: `X-Metadata-*` upload headers become `user.e2b.*` xattrs that Stat and ListDir
/// show; each upload replaces the file's metadata, and an invalid one changes nothing.
#[tokio::test]
async fn upload_metadata_is_kept_on_the_file_shown_by_stat_and_list_dir_and_replaced_by_each_upload() {
    let envd = start("metadata");
    let docs = envd.dir.join("docs");
    let file = docs.join("a.txt");
    // A repeated header counts once, with its first value.
    let (status, answer) = upload(
        &envd,
        &file,
        b"first",
        &[
            ("X-Metadata-Owner", "Alice"),
            ("x-metadata-stage", "draft"),
            ("x-metadata-stage", "final"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let first = json!({"owner": "Alice", "stage": "draft"});
    assert_eq!(answer[0]["metadata"], first, "the upload's answer shows what it set");
    assert_eq!(xattr(&file, "user.e2b.owner").as_deref(), Some(&b"Alice"[..]));
    assert_eq!(stat(&envd, &file).await["metadata"], first);
    let (status, plain) = upload(&envd, &docs.join("b.txt"), b"no metadata", &[]).await;
    assert_eq!(status, 200, "{plain}");
    assert!(plain[0].get("metadata").is_none(), "{plain}");
    let (status, listed) = unary(
        &envd.socket,
        "filesystem.Filesystem/ListDir",
        json!({"path": docs, "depth": 1}),
        "user",
    )
    .await;
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed["entries"][0]["name"], "a.txt");
    assert_eq!(listed["entries"][0]["metadata"], first);
    assert_eq!(listed["entries"][1]["name"], "b.txt");
    assert!(listed["entries"][1].get("metadata").is_none(), "{listed}");

    // Another upload's keys replace the old ones.
    let (status, answer) = upload(&envd, &file, b"second", &[("x-metadata-version", "2")]).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(stat(&envd, &file).await["metadata"], json!({"version": "2"}));
    assert_eq!(xattr(&file, "user.e2b.owner"), None);

    // Refused before anything is written: the file keeps its content and its metadata.
    let too_long = format!("x-metadata-{}", "k".repeat(247));
    for bad in [
        ("x-metadata-city", "Z\u{fc}rich"),
        ("x-metadata-tab", "a\tb"),
        (too_long.as_str(), "v"),
    ] {
        let (status, answer) = upload(&envd, &file, b"refused", &[bad]).await;
        assert_eq!(status, 400, "{bad:?}: {answer}");
        assert_eq!(answer["code"], 400, "{answer}");
        assert!(answer["message"].as_str().unwrap().contains("metadata"), "{answer}");
    }
    let (status, answer) = upload(&envd, &file, b"refused", &[("x-metadata-big", &"v".repeat(4096))]).await;
    assert_eq!(status, 400, "over the 4096-byte budget: {answer}");
    assert_eq!(std::fs::read(&file).unwrap(), b"second");
    assert_eq!(stat(&envd, &file).await["metadata"], json!({"version": "2"}));

    // No metadata headers: the file's metadata is cleared, other tools' attributes stay.
    {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(file.as_os_str().as_bytes()).unwrap();
        // SAFETY: NUL-terminated strings and a value of the length given.
        let set = unsafe { libc::lsetxattr(path.as_ptr(), c"user.other".as_ptr(), b"x".as_ptr().cast(), 1, 0) };
        assert_eq!(set, 0);
    }
    let (status, answer) = upload(&envd, &file, b"third", &[]).await;
    assert_eq!(status, 200, "{answer}");
    let entry = stat(&envd, &file).await;
    assert!(entry.get("metadata").is_none(), "{entry}");
    assert_eq!(xattr(&file, "user.e2b.version"), None);
    assert_eq!(xattr(&file, "user.other").as_deref(), Some(&b"x"[..]));
    assert_eq!(std::fs::read(&file).unwrap(), b"third");
}

/// Every file of one multipart upload gets the upload's metadata.
#[tokio::test]
async fn every_file_of_a_multipart_upload_gets_its_metadata() {
    let envd = start("metadata-multipart");
    let boundary = "sandboxsched-boundary";
    let mut body = Vec::new();
    for name in ["one.txt", "two.txt"] {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{}\"\r\nContent-Type: application/octet-stream\r\n\r\n{name}\r\n",
                envd.dir.join(name).display()
            )
            .as_bytes(),
        );
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let (status, answer) = call(
        &envd.socket,
        "POST",
        "/files",
        &[
            ("content-type", format!("multipart/form-data; boundary={boundary}")),
            ("x-metadata-batch", "7".into()),
            ("X-Metadata-Source", "ci".into()),
        ],
        body,
    )
    .await;
    let answer: Value = serde_json::from_slice(&answer).unwrap_or(Value::Null);
    assert_eq!(status, 200, "{answer}");
    let expected = json!({"batch": "7", "source": "ci"});
    assert_eq!(answer.as_array().map(Vec::len), Some(2), "{answer}");
    for (i, name) in ["one.txt", "two.txt"].into_iter().enumerate() {
        assert_eq!(answer[i]["metadata"], expected, "{answer}");
        assert_eq!(stat(&envd, &envd.dir.join(name)).await["metadata"], expected, "{name}");
        assert_eq!(std::fs::read(envd.dir.join(name)).unwrap(), name.as_bytes());
    }
}

/// Polls a watcher until an event matches `wanted` (bounded: 10 s), returning every event
/// seen so far.
async fn events_until(envd: &Envd, watcher: &str, wanted: impl Fn(&Value) -> bool) -> Vec<Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    loop {
        let (status, answer) = unary(
            &envd.socket,
            "filesystem.Filesystem/GetWatcherEvents",
            json!({"watcherId": watcher}),
            "user",
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        seen.extend(answer["events"].as_array().cloned().unwrap_or_default());
        if seen.iter().any(&wanted) {
            return seen;
        }
        assert!(std::time::Instant::now() < deadline, "no such event; saw {seen:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// envd 0.6.3: a watcher created with `includeEntry` carries each event's `EntryInfo` (as Stat
/// shows it), except where the entry is gone; without it, events carry none.
#[tokio::test]
async fn watch_events_carry_the_entry_when_asked_to() {
    let envd = start("watch-entry");
    let watched = envd.dir.join("watched");
    std::fs::create_dir(&watched).unwrap();
    let mut ids = Vec::new();
    for request in [json!({"path": watched, "includeEntry": true}), json!({"path": watched})] {
        let (status, answer) = unary(&envd.socket, "filesystem.Filesystem/CreateWatcher", request, "user").await;
        assert_eq!(status, 200, "{answer}");
        ids.push(answer["watcherId"].as_str().unwrap().to_string());
    }
    let file = watched.join("new.txt");
    std::fs::write(&file, b"hello").unwrap();
    let created = |e: &Value| e["name"] == "new.txt" && e["type"] == "EVENT_TYPE_CREATE";

    let with = events_until(&envd, &ids[0], created).await;
    let event = with.iter().find(|e| created(e)).unwrap();
    let entry = &event["entry"];
    assert_eq!(entry["name"], "new.txt", "{event}");
    assert_eq!(entry["type"], "FILE_TYPE_FILE", "{event}");
    assert_eq!(entry["path"], file.display().to_string(), "{event}");
    assert_eq!(entry["owner"], "root", "{event}");

    let without = events_until(&envd, &ids[1], created).await;
    assert!(without.iter().all(|e| e.get("entry").is_none()), "{without:?}");

    // Gone: a removal names the entry but cannot describe it.
    std::fs::remove_file(&file).unwrap();
    let removed = |e: &Value| e["name"] == "new.txt" && e["type"] == "EVENT_TYPE_REMOVE";
    let after = events_until(&envd, &ids[0], removed).await;
    let event = after.iter().find(|e| removed(e)).unwrap();
    assert!(event.get("entry").is_none(), "{event}");
}
