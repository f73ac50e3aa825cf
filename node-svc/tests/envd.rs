//! The envd-compatible endpoint over real HTTP, speaking Connect's JSON protocol the way the
//! E2B SDK does: commands with their output and exit codes, signals, files up and down,
//! filesystem calls, and the errors the SDK maps.

use std::time::Duration;

use node_svc::server::{NodeConfig, RunningNode, RuntimeKind};
use proto::node::v1 as pb;
use proto::node::v1::node_client::NodeClient;
use serde_json::{json, Value};

struct Env {
    node: RunningNode,
    dir: std::path::PathBuf,
    id: String,
    http: reqwest::Client,
}

async fn env() -> Env {
    let id = format!("e{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let dir = std::env::temp_dir().join(format!("envd-test-{id}"));
    // The node hosting envd itself (the unisolated runtime): envd inside containers is
    // tested in container.rs.
    let mut config = NodeConfig::new("127.0.0.1:0".parse().unwrap(), &id, &dir);
    config.runtime = RuntimeKind::Unisolated { cgroups: true };
    let node = node_svc::server::start(config).await.unwrap();
    Env {
        node,
        dir,
        id,
        http: reqwest::Client::new(),
    }
}

/// The access token the tests give each sandbox.
fn token_of(sandbox: &str) -> String {
    format!("token-of-{sandbox}")
}

impl Env {
    async fn create(&self, sandbox: &str) {
        self.create_with_token(sandbox, &token_of(sandbox)).await;
    }

    async fn create_with_token(&self, sandbox: &str, token: &str) {
        let mut c = NodeClient::connect(self.node.endpoint()).await.unwrap();
        c.create(pb::CreateRequest {
            operation_id: format!("c-{sandbox}"),
            epoch: 1,
            sandbox_id: sandbox.into(),
            template: "base".into(),
            resources: Some(pb::Resources {
                vcpus: 1,
                memory_bytes: 256 << 20,
                disk_bytes: 0,
            }),
            env_vars: [("GREETING".to_string(), "hello".to_string())].into(),
            access_token: token.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.node.envd_endpoint())
    }

    /// A request for `sandbox` carrying its access token, as the SDK sends them.
    fn call(&self, method: reqwest::Method, path: &str, sandbox: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, self.url(path))
            .header("E2b-Sandbox-Id", sandbox)
            .header("X-Access-Token", token_of(sandbox))
    }

    /// A unary Connect call: (HTTP status, JSON body).
    async fn unary(&self, sandbox: &str, method: &str, body: Value) -> (u16, Value) {
        let r = self
            .call(reqwest::Method::POST, &format!("/{method}"), sandbox)
            .header("Content-Type", "application/json")
            .header("Connect-Protocol-Version", "1")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// A server-streaming Connect call: every message, then the end-of-stream JSON.
    async fn stream(&self, sandbox: &str, method: &str, body: Value) -> (Vec<Value>, Value) {
        let payload = body.to_string().into_bytes();
        let mut framed = vec![0u8];
        framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        framed.extend_from_slice(&payload);
        let r = self
            .call(reqwest::Method::POST, &format!("/{method}"), sandbox)
            .header("Content-Type", "application/connect+json")
            .header("Connect-Protocol-Version", "1")
            .body(framed)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(r.headers()["content-type"], "application/connect+json");
        let bytes = tokio::time::timeout(Duration::from_secs(20), r.bytes())
            .await
            .unwrap()
            .unwrap();
        let (mut messages, mut end, mut at) = (Vec::new(), Value::Null, 0);
        while at + 5 <= bytes.len() {
            let flags = bytes[at];
            let len = u32::from_be_bytes([bytes[at + 1], bytes[at + 2], bytes[at + 3], bytes[at + 4]]) as usize;
            let msg: Value = serde_json::from_slice(&bytes[at + 5..at + 5 + len]).unwrap();
            if flags & 0x02 != 0 {
                end = msg;
            } else {
                messages.push(msg);
            }
            at += 5 + len;
        }
        (messages, end)
    }

    async fn cleanup(self) {
        let mut c = NodeClient::connect(self.node.endpoint()).await.unwrap();
        for s in c.list(pb::ListRequest {}).await.unwrap().into_inner().sandboxes {
            c.kill(pb::LifecycleRequest {
                operation_id: String::new(),
                epoch: s.epoch,
                sandbox_id: s.sandbox_id,
            })
            .await
            .unwrap();
        }
        self.node.stop().await;
        let _ = std::fs::remove_dir_all(&self.dir);
        node_svc::runtime::cgroup::remove_parents(&self.id);
    }
}

fn b64(v: &Value) -> String {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(v.as_str().unwrap())
        .unwrap();
    String::from_utf8(bytes).unwrap()
}

fn output(messages: &[Value], stream: &str) -> String {
    messages
        .iter()
        .filter_map(|m| m["event"]["data"].get(stream))
        .map(b64)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_run_with_output_env_cwd_and_exit_codes() {
    let e = env().await;
    e.create("cmd").await;
    let start = json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo $GREETING $EXTRA; pwd; echo oops >&2; exit 3"], "envs": {"EXTRA": "world"}}, "stdin": false});
    let (messages, end) = e.stream("cmd", "process.Process/Start", start).await;
    assert!(messages[0]["event"]["start"]["pid"].as_u64().unwrap() > 0);
    let stdout = output(&messages, "stdout");
    let home = e.node.host().home("cmd");
    // With a mount namespace the sandbox's files are at /home/user, as in E2B's sandboxes.
    let namespaced = e.node.host().features().namespaces;
    let seen_home = if namespaced {
        "/home/user".to_string()
    } else {
        home.display().to_string()
    };
    assert_eq!(stdout, format!("hello world\n{seen_home}\n"));
    assert_eq!(output(&messages, "stderr"), "oops\n");
    let last = &messages.last().unwrap()["event"]["end"];
    assert_eq!(
        (last["exitCode"].as_i64(), last["exited"].as_bool()),
        (Some(3), Some(true))
    );
    assert_eq!(end, json!({}));

    // A working directory inside the home, by the SDK's own path for it.
    std::fs::create_dir_all(home.join("sub")).unwrap();
    let (messages, _) = e
        .stream(
            "cmd",
            "process.Process/Start",
            json!({"process": {"cmd": "pwd", "cwd": "/home/user/sub"}}),
        )
        .await;
    assert_eq!(output(&messages, "stdout"), format!("{seen_home}/sub\n"));
    if namespaced {
        // The host's view of the same files is untouched: this is a bind mount.
        std::fs::write(home.join("sub/from-host.txt"), "shared").unwrap();
        let (messages, _) = e
            .stream(
                "cmd",
                "process.Process/Start",
                json!({"process": {"cmd": "cat", "args": ["/home/user/sub/from-host.txt"]}}),
            )
            .await;
        assert_eq!(output(&messages, "stdout"), "shared");
    }

    // A command that does not exist is refused in Connect's shape, at the end of the stream.
    let (_, end) = e
        .stream(
            "cmd",
            "process.Process/Start",
            json!({"process": {"cmd": "/no/such/binary"}}),
        )
        .await;
    assert_eq!(end["error"]["code"], "invalid_argument");
    e.cleanup().await;
}

/// One PID namespace per sandbox, shared by its commands: a background process outlives the
/// command that started it and the next command sees it, and nothing of the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_has_one_pid_namespace_for_all_its_commands() {
    let e = env().await;
    let degraded = e.node.host().features().degraded;
    assert!(
        degraded.iter().all(|d| !d.contains("PID namespace")),
        "this host (root, cgroup v1) permits PID namespaces, yet: {degraded:?}"
    );
    e.create("pids").await;
    let start = |script: &str| json!({"process": {"cmd": "/bin/sh", "args": ["-c", script]}, "stdin": false});
    let (messages, _) = e
        .stream(
            "pids",
            "process.Process/Start",
            start("sleep 300 >/dev/null 2>&1 & echo $!"),
        )
        .await;
    let background: u32 = output(&messages, "stdout").trim().parse().unwrap();
    assert!(
        background < 100,
        "a PID of the sandbox's own namespace, not the host's: {background}"
    );
    let (messages, _) = e
        .stream(
            "pids",
            "process.Process/Start",
            start(&format!(
                "kill -0 {background} && echo alive; ls /proc | grep -c '^[0-9]'"
            )),
        )
        .await;
    let seen = output(&messages, "stdout");
    let mut lines = seen.lines();
    assert_eq!(lines.next(), Some("alive"), "{seen}");
    let visible: usize = lines.next().unwrap().parse().unwrap();
    assert!(visible < 10, "only the sandbox's processes are visible, saw {visible}");
    e.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_commands_are_listed_fed_and_killed() {
    let e = env().await;
    e.create("bg").await;
    let env = std::sync::Arc::new(e);
    let e2 = env.clone();
    let cat = tokio::spawn(async move {
        e2.stream(
            "bg",
            "process.Process/Start",
            json!({"process": {"cmd": "cat"}, "tag": "reader", "stdin": true}),
        )
        .await
    });
    let pid = loop {
        let (status, list) = env.unary("bg", "process.Process/List", json!({})).await;
        assert_eq!(status, 200);
        if let Some(p) = list["processes"].as_array().and_then(|p| p.first()) {
            assert_eq!(p["tag"], "reader");
            break p["pid"].as_u64().unwrap();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let (status, _) = env
        .unary(
            "bg",
            "process.Process/SendInput",
            json!({"process": {"pid": pid}, "input": {"stdin": "cGluZwo="}}),
        )
        .await;
    assert_eq!(status, 200);
    let (status, _) = env
        .unary(
            "bg",
            "process.Process/CloseStdin",
            json!({"process": {"tag": "reader"}}),
        )
        .await;
    assert_eq!(status, 200);
    let (messages, _) = cat.await.unwrap();
    assert_eq!(output(&messages, "stdout"), "ping\n");
    assert_eq!(messages.last().unwrap()["event"]["end"]["exitCode"], 0);

    let e3 = env.clone();
    let sleeper = tokio::spawn(async move {
        e3.stream(
            "bg",
            "process.Process/Start",
            json!({"process": {"cmd": "sleep", "args": ["60"]}, "tag": "sleeper"}),
        )
        .await
    });
    let pid = loop {
        let (_, list) = env.unary("bg", "process.Process/List", json!({})).await;
        if let Some(p) = list["processes"].as_array().and_then(|p| p.first()) {
            break p["pid"].as_u64().unwrap();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let (status, _) = env
        .unary(
            "bg",
            "process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(status, 200);
    let (messages, _) = sleeper.await.unwrap();
    let end = &messages.last().unwrap()["event"]["end"];
    assert_eq!(
        (end["exitCode"].as_i64(), end["status"].as_str()),
        (Some(-1), Some("signal: killed"))
    );
    let (status, body) = env
        .unary(
            "bg",
            "process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!((status, body["code"].as_str()), (404, Some("not_found")));
    std::sync::Arc::into_inner(env).unwrap().cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_and_filesystem_calls() {
    let e = env().await;
    e.create("fs").await;
    let (status, made) = e
        .unary("fs", "filesystem.Filesystem/MakeDir", json!({"path": "docs"}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(made["entry"]["type"], "FILE_TYPE_DIRECTORY");
    assert_eq!(made["entry"]["path"], "/home/user/docs");
    let (status, again) = e
        .unary("fs", "filesystem.Filesystem/MakeDir", json!({"path": "docs"}))
        .await;
    assert_eq!((status, again["code"].as_str()), (409, Some("already_exists")));

    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(b"hello file".to_vec()).file_name("docs/a.txt"),
    );
    let r = e
        .call(reqwest::Method::POST, "/files?path=docs/a.txt", "fs")
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let written: Value = r.json().await.unwrap();
    assert_eq!(
        written,
        json!([{"path": "/home/user/docs/a.txt", "name": "a.txt", "type": "file"}])
    );
    let r = e
        .call(reqwest::Method::POST, "/files?path=/home/user/raw.bin", "fs")
        .header("Content-Type", "application/octet-stream")
        .body(vec![1u8, 2, 3])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);

    let got = e
        .call(reqwest::Method::GET, "/files?path=docs/a.txt", "fs")
        .send()
        .await
        .unwrap();
    assert_eq!(got.bytes().await.unwrap().as_ref(), b"hello file");
    let missing = e
        .call(reqwest::Method::GET, "/files?path=nope.txt", "fs")
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status().as_u16(), 404);
    assert_eq!(missing.json::<Value>().await.unwrap()["code"], 404);

    let (_, stat) = e
        .unary("fs", "filesystem.Filesystem/Stat", json!({"path": "docs/a.txt"}))
        .await;
    assert_eq!(
        (stat["entry"]["size"].as_str(), stat["entry"]["name"].as_str()),
        (Some("10"), Some("a.txt"))
    );
    let (_, listed) = e
        .unary(
            "fs",
            "filesystem.Filesystem/ListDir",
            json!({"path": "/home/user", "depth": 2}),
        )
        .await;
    let paths: Vec<&str> = listed["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        vec!["/home/user/docs", "/home/user/docs/a.txt", "/home/user/raw.bin"]
    );
    let (status, moved) = e
        .unary(
            "fs",
            "filesystem.Filesystem/Move",
            json!({"source": "docs/a.txt", "destination": "b.txt"}),
        )
        .await;
    assert_eq!(
        (status, moved["entry"]["path"].as_str()),
        (200, Some("/home/user/b.txt"))
    );
    let (status, _) = e
        .unary("fs", "filesystem.Filesystem/Remove", json!({"path": "docs"}))
        .await;
    assert_eq!(status, 200);
    let (status, gone) = e
        .unary("fs", "filesystem.Filesystem/Stat", json!({"path": "docs"}))
        .await;
    assert_eq!((status, gone["code"].as_str()), (404, Some("not_found")));
    let (status, escape) = e
        .unary("fs", "filesystem.Filesystem/Stat", json!({"path": "/etc/passwd"}))
        .await;
    assert_eq!((status, escape["code"].as_str()), (403, Some("permission_denied")));
    e.cleanup().await;
}

/// Every way in without the sandbox's own token, tried from the attacker's side against
/// every kind of route: nothing passes but `/health`, and a signed file URL opens only its
/// own file, for its own operation, until it expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_answers_only_the_sandboxs_token() {
    let e = env().await;
    e.create("victim").await;
    e.create("attacker").await;
    e.create_with_token("tokenless", "").await;
    let routes: [(reqwest::Method, &str, &str); 6] = [
        (reqwest::Method::POST, "/process.Process/List", "{}"),
        (reqwest::Method::POST, "/process.Process/Start", ""),
        (reqwest::Method::POST, "/process.Process/StreamInput", ""),
        (reqwest::Method::POST, "/filesystem.Filesystem/ListDir", "{}"),
        (reqwest::Method::GET, "/files?path=/etc/hostname", ""),
        (reqwest::Method::GET, "/envs", ""),
    ];
    let victim = token_of("victim");
    let attacker = token_of("attacker");
    let cases: [(&str, Option<&str>); 5] = [
        ("victim", None),
        ("victim", Some("")),
        ("victim", Some(&attacker)),
        ("victim", Some(&victim[..victim.len() - 1])),
        ("tokenless", Some("")),
    ];
    for (method, path, body) in &routes {
        for (sandbox, token) in &cases {
            let mut request = e
                .http
                .request(method.clone(), e.url(path))
                .header("E2b-Sandbox-Id", *sandbox)
                .header("Content-Type", "application/json")
                .body(body.to_string());
            if let Some(token) = token {
                request = request.header("X-Access-Token", *token);
            }
            let r = request.send().await.unwrap();
            assert_eq!(r.status().as_u16(), 401, "{method} {path} for {sandbox} with {token:?}");
            let text = r.text().await.unwrap();
            assert!(text.contains("unauthenticated") || text.contains("401"), "{text}");
        }
    }
    let health = e
        .http
        .get(e.url("/health"))
        .header("E2b-Sandbox-Id", "victim")
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 204);

    // Signed URLs, as the SDK's download_url and upload_url make them.
    let signed = |path: &str, op, expiration: Option<u64>| {
        let sig = envd_wire::access::file_signature(path, op, "", &victim, expiration);
        let mut q = format!("/files?path={path}&signature={}", sig.replace('+', "%2B"));
        if let Some(at) = expiration {
            q.push_str(&format!("&signature_expiration={at}"));
        }
        q
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    use envd_wire::access::FileOperation::{Read, Write};
    let bare =
        |method: reqwest::Method, url: String| e.http.request(method, e.url(&url)).header("E2b-Sandbox-Id", "victim");
    let form = || reqwest::multipart::Form::new().part("file", reqwest::multipart::Part::bytes(b"signed".to_vec()));
    let r = bare(reqwest::Method::POST, signed("note.txt", Write, Some(now + 60)))
        .multipart(form())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
    let r = bare(reqwest::Method::GET, signed("note.txt", Read, None))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "signed");
    for (method, url) in [
        // A read signature does not write, nor open another file, nor outlive its expiration.
        (reqwest::Method::POST, signed("note.txt", Read, None)),
        (
            reqwest::Method::GET,
            signed("note.txt", Read, None).replace("note.txt", "other.txt"),
        ),
        (reqwest::Method::GET, signed("note.txt", Read, Some(now - 1))),
        (
            reqwest::Method::GET,
            signed("note.txt", Read, Some(now - 1)).replace(&format!("={}", now - 1), &format!("={}", now + 600)),
        ),
    ] {
        let r = bare(method.clone(), url.clone())
            .multipart(form())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401, "{method} {url}");
    }
    e.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_selection_and_state_are_enforced() {
    let e = env().await;
    e.create("open").await;
    let health = e.http.get(e.url("/health")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 204);
    let (status, body) = e.unary("", "process.Process/List", json!({})).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("invalid_argument")));
    let (status, body) = e.unary("ghost", "process.Process/List", json!({})).await;
    assert_eq!((status, body["code"].as_str()), (404, Some("not_found")));
    let envs = e.call(reqwest::Method::GET, "/envs", "open").send().await.unwrap();
    assert_eq!(envs.json::<Value>().await.unwrap()["GREETING"], "hello");
    let (status, body) = e.unary("open", "process.Process/Nope", json!({})).await;
    assert_eq!((status, body["code"].as_str()), (501, Some("unimplemented")));
    let (status, body) = e.unary("open", "filesystem.Filesystem/Stat", json!({"path": 5})).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("invalid_argument")));

    let mut c = NodeClient::connect(e.node.endpoint()).await.unwrap();
    c.pause(pb::LifecycleRequest {
        operation_id: "p".into(),
        epoch: 1,
        sandbox_id: "open".into(),
    })
    .await
    .unwrap();
    let (status, body) = e.unary("open", "process.Process/List", json!({})).await;
    assert_eq!((status, body["code"].as_str()), (503, Some("unavailable")));

    // Resumed, commands run again (a sandbox without a start command is thawed too).
    c.resume(pb::LifecycleRequest {
        operation_id: "r".into(),
        epoch: 1,
        sandbox_id: "open".into(),
    })
    .await
    .unwrap();
    let (messages, _) = e
        .stream(
            "open",
            "process.Process/Start",
            json!({"process": {"cmd": "echo", "args": ["thawed"]}}),
        )
        .await;
    assert_eq!(output(&messages, "stdout"), "thawed\n");
    e.cleanup().await;
}
