//! Sandboxes as containers, attacked from inside: each test runs code in a real sandbox through
//! the node's envd endpoint (as the gateway forwards an SDK's calls) and checks what that code
//! can reach. Every test runs twice: on the node's own OCI runtime and on Debian's runc
//! (`/usr/sbin/runc`; scripts/test-all installs it).

use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::Duration;

use base64::Engine;
use node_svc::server::{NodeConfig, RunningNode, RuntimeKind};
use proto::node::v1 as pb;
use proto::node::v1::node_client::NodeClient;
use serde_json::{json, Value};

const RUNC: &str = "/usr/sbin/runc";

/// The runtimes every test runs on: the built-in one, and runc.
fn runtimes() -> Vec<Option<PathBuf>> {
    assert!(
        std::path::Path::new(RUNC).exists(),
        "{RUNC} is missing: install Debian's runc (`apt-get install -y runc`; scripts/test-all does)"
    );
    vec![None, Some(PathBuf::from(RUNC))]
}

struct Node {
    node: Option<RunningNode>,
    dir: PathBuf,
    runtime: Option<PathBuf>,
    http: reqwest::Client,
}

impl Drop for Node {
    /// A test that fails half-way leaves no sandbox running to load the machine for the tests
    /// after it.
    fn drop(&mut self) {
        node_svc::runtime::container::destroy_all(&self.dir, self.runtime.as_deref());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn node(oci_runtime: Option<PathBuf>) -> Node {
    node_with_templates(oci_runtime, None).await
}

async fn node_with_templates(oci_runtime: Option<PathBuf>, templates: Option<PathBuf>) -> Node {
    let id = format!("c{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let dir = std::env::temp_dir().join(format!("container-test-{id}"));
    let mut config = NodeConfig::new("127.0.0.1:0".parse().unwrap(), &id, &dir);
    config.runtime = RuntimeKind::Container {
        oci_runtime: oci_runtime.clone(),
    };
    config.host.templates_dir = templates;
    let node = node_svc::server::start(config).await.unwrap();
    let features = node.host().features();
    assert!(
        features.namespaces,
        "this host cannot isolate sandboxes: {:?}",
        features.degraded
    );
    Node {
        node: Some(node),
        dir,
        runtime: oci_runtime,
        http: reqwest::Client::new(),
    }
}

fn token_of(sandbox: &str) -> String {
    format!("token-of-{sandbox}")
}

impl Node {
    async fn create(&self, sandbox: &str, memory_bytes: u64) {
        let mut c = NodeClient::connect(self.running().endpoint()).await.unwrap();
        c.create(pb::CreateRequest {
            operation_id: format!("c-{sandbox}"),
            epoch: 1,
            sandbox_id: sandbox.into(),
            template: "base".into(),
            resources: Some(pb::Resources { vcpus: 1, memory_bytes }),
            access_token: token_of(sandbox),
            ..Default::default()
        })
        .await
        .unwrap();
    }

    async fn lifecycle(&self, sandbox: &str, action: &str) {
        let mut c = NodeClient::connect(self.running().endpoint()).await.unwrap();
        let request = pb::LifecycleRequest {
            operation_id: format!("{action}-{sandbox}"),
            epoch: 1,
            sandbox_id: sandbox.into(),
        };
        match action {
            "pause" => c.pause(request).await.map(drop),
            "resume" => c.resume(request).await.map(drop),
            _ => c.kill(request).await.map(drop),
        }
        .unwrap();
    }

    /// Runs `script` with `sh -c` as `user` in `sandbox`: (stdout + stderr, exit code).
    async fn sh(&self, sandbox: &str, user: &str, script: &str) -> (String, i64) {
        let payload = json!({"process": {"cmd": "/bin/sh", "args": ["-c", script]}, "stdin": false})
            .to_string()
            .into_bytes();
        let mut framed = vec![0u8];
        framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        framed.extend_from_slice(&payload);
        let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:"));
        let response = self
            .http
            .post(format!("{}/process.Process/Start", self.running().envd_endpoint()))
            .header("E2b-Sandbox-Id", sandbox)
            .header("X-Access-Token", token_of(sandbox))
            .header("Authorization", format!("Basic {basic}"))
            .header("Content-Type", "application/connect+json")
            .body(framed)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        if status != 200 {
            let log = std::fs::read_to_string(self.running().host().home(sandbox).with_file_name("container.log"));
            panic!(
                "{status}: {} (container log: {log:?})",
                response.text().await.unwrap_or_default()
            );
        }
        let bytes = tokio::time::timeout(Duration::from_secs(60), response.bytes())
            .await
            .unwrap()
            .unwrap();
        let (mut out, mut code, mut at) = (String::new(), i64::MIN, 0);
        while at + 5 <= bytes.len() {
            let len = u32::from_be_bytes([bytes[at + 1], bytes[at + 2], bytes[at + 3], bytes[at + 4]]) as usize;
            let msg: Value = serde_json::from_slice(&bytes[at + 5..at + 5 + len]).unwrap();
            for stream in ["stdout", "stderr"] {
                if let Some(data) = msg["event"]["data"][stream].as_str() {
                    let raw = base64::engine::general_purpose::STANDARD.decode(data).unwrap();
                    out.push_str(&String::from_utf8_lossy(&raw));
                }
            }
            if let Some(end) = msg["event"]["end"].as_object() {
                code = end.get("exitCode").and_then(Value::as_i64).unwrap_or(0);
                if end.get("exited") == Some(&Value::Bool(false)) {
                    code = -1;
                }
            }
            if msg.get("error").is_some() {
                panic!("envd error: {msg}");
            }
            at += 5 + len;
        }
        (out, code)
    }

    /// Stops the node; Drop then removes its sandboxes and folder.
    async fn stop(mut self) {
        if let Some(node) = self.node.take() {
            node.stop().await;
        }
    }

    fn running(&self) -> &RunningNode {
        self.node.as_ref().expect("the node runs until stop")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_inside_is_nobody_outside_and_the_hosts_files_are_out_of_sight() {
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create("iso", 256 << 20).await;
        let (out, code) = n.sh("iso", "root", "id -u; hostname; echo $$ > /dev/null; ls /").await;
        assert_eq!(code, 0, "{runtime:?}: {out}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "0", "{runtime:?}: root inside");
        assert_eq!(lines[1], "iso", "{runtime:?}: the hostname is the sandbox's ID");
        assert!(
            !lines.contains(&"work"),
            "{runtime:?}: the host's / is not the sandbox's: {out}"
        );
        // The host's secrets and other folders are not there.
        let (out, code) = n
            .sh("iso", "root", "cat /etc/shadow || ls /work || ls /root/.cargo")
            .await;
        assert_ne!(code, 0, "{runtime:?}: {out}");
        // A file root writes in /tmp lands in the sandbox's own layer, owned by an
        // unprivileged host uid, and not in the host's /tmp.
        let marker = format!("sandbox-wrote-{}", uuid::Uuid::new_v4().simple());
        let (_, code) = n.sh("iso", "root", &format!("echo secret > /tmp/{marker}")).await;
        assert_eq!(code, 0);
        assert!(
            !std::path::Path::new("/tmp").join(&marker).exists(),
            "{runtime:?}: wrote the host's /tmp"
        );
        let layer = n.running().host().home("iso").join("tmp").join(&marker);
        let owner = std::fs::metadata(&layer).unwrap().uid();
        assert_eq!(owner, 100_000, "{runtime:?}: root's file is host uid 100000");
        // The default user is uid 1000 inside, 101000 outside, at home in /home/user.
        let (out, _) = n.sh("iso", "user", "id -u; pwd; touch mine").await;
        assert_eq!(out, "1000\n/home/user\n", "{runtime:?}");
        let mine = n.running().host().home("iso").join("home/user/mine");
        assert_eq!(std::fs::metadata(mine).unwrap().uid(), 101_000, "{runtime:?}");
        // The user cannot become root again (no_new_privs; /usr is nosuid anyway).
        let (out, _) = n.sh("iso", "user", "grep NoNewPrivs /proc/self/status").await;
        assert!(out.contains('1'), "{runtime:?}: {out}");
        n.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_port_of_the_host_answers_from_inside() {
    // A listener on every address of this host: from inside, none may answer.
    let mut addresses = vec!["127.0.0.1".to_string()];
    if let Ok(out) = std::process::Command::new("hostname").arg("-I").output() {
        addresses.extend(
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .map(str::to_string),
        );
    }
    let listeners: Vec<(String, TcpListener)> = addresses
        .iter()
        .filter(|a| !a.contains(':'))
        .filter_map(|a| TcpListener::bind(format!("{a}:0")).ok().map(|l| (a.clone(), l)))
        .collect();
    assert!(!listeners.is_empty());
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create("net", 256 << 20).await;
        for (address, listener) in &listeners {
            let port = listener.local_addr().unwrap().port();
            let probe = format!(
                "python3 -c \"import socket; s = socket.socket(); s.settimeout(2); s.connect(('{address}', {port})); print('reached')\""
            );
            let (out, code) = n.sh("net", "root", &probe).await;
            assert_ne!(code, 0, "{runtime:?}: {address}:{port} answered from inside: {out}");
            assert!(!out.contains("reached"), "{runtime:?}: {out}");
        }
        let (out, _) = n.sh("net", "root", "cat /proc/net/dev").await;
        let interfaces: Vec<&str> = out
            .lines()
            .skip(2)
            .filter_map(|l| l.split(':').next())
            .map(str::trim)
            .collect();
        assert_eq!(interfaces, vec!["lo"], "{runtime:?}: only loopback");
        n.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_hog_is_killed_alone_and_nobody_leaves_their_cgroup() {
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create("hog", 64 << 20).await;
        let (out, code) = n
            .sh(
                "hog",
                "user",
                "python3 -c \"b = bytearray(256 << 20); print('survived')\"",
            )
            .await;
        assert!(!out.contains("survived") && code != 0, "{runtime:?}: {out} ({code})");
        // The sandbox (and its envd) lived through it.
        let (out, code) = n.sh("hog", "user", "echo still here").await;
        assert_eq!((out.as_str(), code), ("still here\n", 0), "{runtime:?}");
        // No cgroup file system to move itself with, and /sys is read-only.
        let (out, code) = n
            .sh(
                "hog",
                "root",
                "echo $$ > /sys/fs/cgroup/cgroup.procs || mkdir /sys/fs/cgroup/escape",
            )
            .await;
        assert_ne!(code, 0, "{runtime:?}: {out}");
        n.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_freezes_resume_continues_and_kill_leaves_nothing() {
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create("life", 256 << 20).await;
        let (_, code) = n.sh("life", "user", "echo kept > ~/kept.txt").await;
        assert_eq!(code, 0);
        n.lifecycle("life", "pause").await;
        n.lifecycle("life", "resume").await;
        let (out, _) = n.sh("life", "user", "cat ~/kept.txt").await;
        assert_eq!(out, "kept\n", "{runtime:?}");
        n.lifecycle("life", "kill").await;
        assert!(
            !n.running().host().home("life").exists(),
            "{runtime:?}: the sandbox's folder is gone"
        );
        let cgroup = PathBuf::from("/sys/fs/cgroup/memory")
            .join(format!("sandboxsched-{}", n.running().host().node_id()))
            .join("life");
        assert!(!cgroup.exists(), "{runtime:?}: {} is left", cgroup.display());
        n.stop().await;
    }
}

/// Moves `sandbox` from `a` to `b` as the balancer does: pause, snapshot, restore, resume.
async fn move_sandbox(a: &Node, b: &Node, sandbox: &str) {
    let mut ca = NodeClient::connect(a.running().endpoint()).await.unwrap();
    let mut cb = NodeClient::connect(b.running().endpoint()).await.unwrap();
    let at = |op: &str, epoch| pb::LifecycleRequest {
        operation_id: format!("{op}-{sandbox}"),
        epoch,
        sandbox_id: sandbox.into(),
    };
    ca.pause(at("move-pause", 2)).await.unwrap();
    let mut stream = ca.snapshot(at("", 2)).await.unwrap().into_inner();
    let mut restore = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        restore.push(pb::RestoreChunk {
            part: match chunk.part {
                Some(pb::snapshot_chunk::Part::Header(h)) => Some(pb::restore_chunk::Part::Header(pb::RestoreHeader {
                    operation_id: format!("restore-{sandbox}"),
                    epoch: 3,
                    snapshot: Some(h),
                })),
                Some(pb::snapshot_chunk::Part::Data(d)) => Some(pb::restore_chunk::Part::Data(d)),
                Some(pb::snapshot_chunk::Part::Trailer(t)) => Some(pb::restore_chunk::Part::Trailer(t)),
                None => None,
            },
        });
    }
    cb.restore(tokio_stream::iter(restore)).await.unwrap();
    cb.resume(at("move-resume", 3)).await.unwrap();
    ca.kill(at("move-kill", 3)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_carries_the_sandboxs_own_layer_to_another_node() {
    for runtime in runtimes() {
        let (a, b) = (node(runtime.clone()).await, node(runtime.clone()).await);
        a.create("mover", 256 << 20).await;
        let script = "echo notes > /home/user/notes.txt && echo scratch > /tmp/scratch && mkdir -p /opt/tool \
                      && rm /etc/hosts && rm -r /etc/profile.d && mkdir /etc/profile.d \
                      && ln -s /home/user/notes.txt /tmp/link";
        let (out, code) = a.sh("mover", "root", script).await;
        assert_eq!(code, 0, "{runtime:?}: {out}");
        let (_, code) = a.sh("mover", "user", "echo mine > ~/mine.txt").await;
        assert_eq!(code, 0);
        move_sandbox(&a, &b, "mover").await;
        let (out, code) = b
            .sh("mover", "user", "cat ~/notes.txt /tmp/scratch /tmp/link ~/mine.txt; ls -d /opt/tool; stat -c %u ~/mine.txt; test -e /etc/hosts || echo deleted; ls -A /etc/profile.d | wc -l")
            .await;
        assert_eq!(code, 0, "{runtime:?}: {out}");
        assert_eq!(
            out, "notes\nscratch\nnotes\nmine\n/opt/tool\n1000\ndeleted\n0\n",
            "{runtime:?}: files, ownership, links, deletions and a replaced directory moved"
        );
        a.stop().await;
        b.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_templates_files_are_in_the_users_home_and_the_users() {
    let templates = std::env::temp_dir().join(format!("container-templates-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(templates.join("base/files/src")).unwrap();
    std::fs::write(templates.join("base/files/src/main.py"), "print('hi')\n").unwrap();
    for runtime in runtimes() {
        let n = node_with_templates(runtime.clone(), Some(templates.clone())).await;
        n.create("seeded", 256 << 20).await;
        let (out, code) = n
            .sh(
                "seeded",
                "user",
                "python3 ~/src/main.py && stat -c '%U %a' ~ ~/src/main.py /home && touch ~/src/new",
            )
            .await;
        assert_eq!(code, 0, "{runtime:?}: {out}");
        assert_eq!(out, "hi\nuser 755\nuser 644\nroot 755\n", "{runtime:?}");
        n.stop().await;
    }
    std::fs::remove_dir_all(&templates).unwrap();
}
