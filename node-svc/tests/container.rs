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
    id: String,
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
        node_svc::runtime::cgroup::remove_parents(&self.id);
    }
}

async fn node(oci_runtime: Option<PathBuf>) -> Node {
    node_with_templates(oci_runtime, None).await
}

async fn node_with_templates(oci_runtime: Option<PathBuf>, templates: Option<PathBuf>) -> Node {
    node_with(oci_runtime, templates, None).await
}

async fn node_with(oci_runtime: Option<PathBuf>, templates: Option<PathBuf>, envd: Option<PathBuf>) -> Node {
    node_sharing(oci_runtime, templates, envd, None).await
}

/// A node whose blob store (template layers) is `blobs`, shared with other nodes.
async fn node_sharing(
    oci_runtime: Option<PathBuf>,
    templates: Option<PathBuf>,
    envd: Option<PathBuf>,
    blobs: Option<&std::path::Path>,
) -> Node {
    node_configured(oci_runtime, |config| {
        config.host.blob_store = blobs.map(|b| b.display().to_string());
        config.host.templates_dir = templates;
        config.envd_binary = envd;
    })
    .await
}

/// A node on `oci_runtime` with whatever else `adjust` sets.
async fn node_configured(oci_runtime: Option<PathBuf>, adjust: impl FnOnce(&mut NodeConfig)) -> Node {
    let id = format!("c{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let dir = std::env::temp_dir().join(format!("container-test-{id}"));
    let mut config = NodeConfig::new("127.0.0.1:0".parse().unwrap(), &id, &dir);
    config.runtime = RuntimeKind::Container {
        oci_runtime: oci_runtime.clone(),
    };
    adjust(&mut config);
    let node = node_svc::server::start(config).await.unwrap();
    let features = node.host().features();
    assert!(
        features.namespaces,
        "this host cannot isolate sandboxes: {:?}",
        features.degraded
    );
    Node {
        node: Some(node),
        id,
        dir,
        runtime: oci_runtime,
        http: reqwest::Client::new(),
    }
}

fn token_of(sandbox: &str) -> String {
    format!("token-of-{sandbox}")
}

/// E2B's default network: the internet, no lists.
fn internet() -> Option<pb::NetworkPolicy> {
    Some(pb::NetworkPolicy {
        internet: true,
        ..Default::default()
    })
}

impl Node {
    /// A sandbox with loopback only.
    async fn create(&self, sandbox: &str, memory_bytes: u64) {
        self.create_with(sandbox, memory_bytes, None).await;
    }

    async fn create_with(&self, sandbox: &str, memory_bytes: u64, network: Option<pb::NetworkPolicy>) {
        let mut c = NodeClient::connect(self.running().endpoint()).await.unwrap();
        c.create(pb::CreateRequest {
            operation_id: format!("c-{sandbox}"),
            epoch: 1,
            sandbox_id: sandbox.into(),
            template: "base".into(),
            resources: Some(pb::Resources {
                vcpus: 1,
                memory_bytes,
                disk_bytes: 0,
            }),
            access_token: token_of(sandbox),
            network,
            ..Default::default()
        })
        .await
        .unwrap();
    }

    async fn update_network(&self, sandbox: &str, network: Option<pb::NetworkPolicy>) {
        let mut c = NodeClient::connect(self.running().endpoint()).await.unwrap();
        c.update_network(pb::NetworkUpdateRequest {
            operation_id: format!("net-{sandbox}-{}", uuid::Uuid::new_v4().simple()),
            epoch: 1,
            sandbox_id: sandbox.into(),
            network,
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
            let log = std::fs::read_to_string(self.running().host().sandbox_dir(sandbox).join("container.log"));
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

/// The host uid root inside `sandbox` runs as, from its init's `uid_map`.
async fn host_root_of(n: &Node, sandbox: &str) -> (u32, u32) {
    let pid = n.running().host().get(sandbox).await.expect("a record").pgid;
    let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).unwrap();
    let host = map
        .split_whitespace()
        .nth(1)
        .and_then(|h| h.parse().ok())
        .expect("a map");
    (pid, host)
}

/// Runs `script` on the host as uid and gid `id` (what code that escaped a sandbox's
/// namespaces would be): its output and whether it succeeded.
fn on_host_as(id: u32, script: &str) -> (String, bool) {
    use std::os::unix::process::CommandExt;
    let out = std::process::Command::new("/bin/sh")
        .args(["-c", script])
        .uid(id)
        .gid(id)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (text, out.status.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escaped_sandbox_is_a_stranger_to_every_other_sandbox() {
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create("mine", 128 << 20).await;
        n.create("theirs", 128 << 20).await;
        let (_, code) = n
            .sh("theirs", "root", "umask 077; echo their-secret > /root/secret")
            .await;
        assert_eq!(code, 0);
        let (_, me) = host_root_of(&n, "mine").await;
        let (their_pid, them) = host_root_of(&n, "theirs").await;
        assert_ne!(me, them, "{runtime:?}: two sandboxes run as the same host ids");
        for id in [me, them] {
            assert!(id > 165_535, "{runtime:?}: {id} is in the storage range or below");
        }
        // Inside, nothing changed: root is 0 and owns /, user owns its home.
        let (out, _) = n.sh("mine", "root", "id -u; stat -c %u / /home/user").await;
        assert_eq!(out, "0\n0\n1000\n", "{runtime:?}");
        // From the host, as "mine"'s root: "theirs" can be neither signalled nor read, through
        // its root or on disk.
        let on_disk = n.running().host().home("theirs").join("root/secret");
        let (out, ok) = on_host_as(me, &format!("kill -0 {their_pid}"));
        assert!(!ok, "{runtime:?}: signalled another sandbox's init: {out}");
        for path in [
            format!("/proc/{their_pid}/root/root/secret"),
            on_disk.display().to_string(),
        ] {
            let (out, ok) = on_host_as(me, &format!("cat {path}"));
            assert!(!ok && !out.contains("their-secret"), "{runtime:?}: read {path}: {out}");
        }
        // What stops the signal is the ids: "theirs"'s own root may signal its init. On disk
        // the file is the storage range's (whom no sandbox runs as), and the sandboxes' folder
        // is the node's alone: not even that owner reaches it.
        let (out, ok) = on_host_as(them, &format!("kill -0 {their_pid}"));
        assert!(ok, "{runtime:?}: {out}");
        let (out, ok) = on_host_as(100_000, &format!("cat {}", on_disk.display()));
        assert!(!ok && !out.contains("their-secret"), "{runtime:?}: {out}");
        assert_eq!(
            std::fs::metadata(&on_disk).unwrap().uid(),
            100_000,
            "{runtime:?}: on disk, the storage range"
        );
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
        // With a link out: the host is the sandbox's gateway, and still out of reach.
        n.create_with("net", 256 << 20, internet()).await;
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
        assert_eq!(interfaces(&out), vec!["eth0", "lo"], "{runtime:?}");
        n.stop().await;
    }
}

/// Interface names in `/proc/net/dev`, sorted.
fn interfaces(proc_net_dev: &str) -> Vec<&str> {
    let mut names: Vec<&str> = proc_net_dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    names.sort_unstable();
    names
}

/// A network namespace of the test's own playing "the internet": a veth to the host with
/// 198.51.100.1 (host) and 198.51.100.2 (inside), a route back, and a TCP listener inside
/// that answers each connection with the address it came from. Removed on drop.
struct Internet {
    name: String,
    host_end: String,
    port: u16,
    /// One internet at a time: each gives the host 198.51.100.1, and two would split its route.
    _alone: std::sync::MutexGuard<'static, ()>,
}

static ONE_INTERNET: std::sync::Mutex<()> = std::sync::Mutex::new(());

const INTERNET: &str = "198.51.100.2";

fn ip(args: &[&str]) {
    let status = std::process::Command::new("ip").args(args).status().unwrap();
    assert!(status.success(), "ip {args:?}");
}

/// What `make` returns, made inside the named network namespace `name`: a socket keeps the
/// namespace it was made in, so it is made there, on a short-lived thread of its own.
fn inside<T: Send>(name: &str, make: impl FnOnce() -> T + Send) -> T {
    let path = format!("/run/netns/{name}");
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                let ns = std::fs::File::open(&path).unwrap();
                rustix::thread::move_into_link_name_space(
                    std::os::fd::AsFd::as_fd(&ns),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )
                .unwrap();
                make()
            })
            .join()
            .unwrap()
    })
}

impl Internet {
    fn start() -> Internet {
        let alone = ONE_INTERNET.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let name = format!("inet-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let host_end = format!("i{}", &name[5..]);
        ip(&["netns", "add", &name]);
        ip(&[
            "link", "add", &host_end, "type", "veth", "peer", "name", "eth0", "netns", &name,
        ]);
        ip(&["addr", "add", "198.51.100.1/24", "dev", &host_end]);
        ip(&["link", "set", &host_end, "up"]);
        ip(&["-n", &name, "addr", "add", "198.51.100.2/24", "dev", "eth0"]);
        ip(&["-n", &name, "link", "set", "eth0", "up"]);
        ip(&["-n", &name, "route", "add", "default", "via", "198.51.100.1"]);
        let listener = inside(&name, || TcpListener::bind(format!("{INTERNET}:0")).unwrap());
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let peer = stream.peer_addr().map(|a| a.ip().to_string()).unwrap_or_default();
                let _ = std::io::Write::write_all(&mut &stream, format!("from {peer}\n").as_bytes());
            }
        });
        Internet {
            name,
            host_end,
            port,
            _alone: alone,
        }
    }

    /// A shell line that connects to the internet's listener and prints what it says. It
    /// reads on to the listener's close before closing its own end, so the listener closes
    /// first and keeps the connection's `TIME_WAIT`: a sandbox that closed first would keep it
    /// for a minute instead, and its network slot with it (a slot is reused only once its
    /// namespace holds no socket), which a test with a one-slot pool would wait out.
    fn probe(&self) -> String {
        format!(
            "python3 -c \"import socket; s = socket.create_connection(('{INTERNET}', {}), timeout=3); print(s.recv(100).decode()); s.recv(1)\"",
            self.port
        )
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.host_end])
            .status();
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_reaches_the_internet_and_honours_the_lists_and_the_floor() {
    let world = Internet::start();
    let policy = |on: bool, allow: &[&str], deny: &[&str]| {
        Some(pb::NetworkPolicy {
            internet: on,
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
        })
    };
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create_with("open", 256 << 20, internet()).await;
        n.create_with("sealed", 256 << 20, policy(false, &[], &[])).await;
        n.create_with("denied", 256 << 20, policy(true, &[], &["198.51.100.0/24"]))
            .await;
        n.create_with("allowed", 256 << 20, policy(false, &[INTERNET], &[]))
            .await;
        // The default reaches the internet, masqueraded as the host's address on that link.
        let (out, code) = n.sh("open", "user", &world.probe()).await;
        assert_eq!((out.trim(), code), ("from 198.51.100.1", 0), "{runtime:?}");
        // No internet and nothing allowed: no link at all, loopback still works.
        let (out, code) = n.sh("sealed", "root", &world.probe()).await;
        assert_ne!(code, 0, "{runtime:?}: {out}");
        let (out, _) = n.sh("sealed", "root", "cat /proc/net/dev").await;
        assert_eq!(interfaces(&out), vec!["lo"], "{runtime:?}");
        // denyOut holds, and root inside cannot lift it (no CAP_NET_ADMIN).
        let (out, code) = n.sh("denied", "root", &world.probe()).await;
        assert!(code != 0 && out.contains("No route to host"), "{runtime:?}: {out}");
        let (out, code) = n
            .sh("denied", "root", "nft flush ruleset || ip link set eth0 down")
            .await;
        assert_ne!(code, 0, "{runtime:?}: root changed its own rules: {out}");
        // allowOut wins over no internet, for what it names only.
        let (out, code) = n.sh("allowed", "user", &world.probe()).await;
        assert_eq!((out.trim(), code), ("from 198.51.100.1", 0), "{runtime:?}");
        let (out, code) = n
            .sh(
                "allowed",
                "user",
                "python3 -c \"import socket; socket.create_connection(('198.51.100.1', 9), timeout=2)\"",
            )
            .await;
        assert_ne!(code, 0, "{runtime:?}: {out}");
        // The floor: no sandbox reaches another, nor the private ranges (cloud metadata,
        // the control plane's network), whatever its lists say.
        let (out, _) = n.sh("allowed", "root", "ip -4 -o addr show eth0").await;
        let neighbour = out
            .split_whitespace()
            .find(|w| w.starts_with("10.200."))
            .and_then(|w| w.split('/').next())
            .unwrap_or_else(|| panic!("{runtime:?}: no address: {out}"))
            .to_string();
        n.sh("allowed", "root", "nohup python3 -m http.server 8080 >/dev/null 2>&1 &")
            .await;
        let reach = |addr: &str| {
            format!(
                "python3 -c \"import socket; socket.create_connection(('{addr}', 8080), timeout=2); print('reached')\""
            )
        };
        let mut listening = String::new();
        for _ in 0..50 {
            listening = n.sh("allowed", "root", &reach("127.0.0.1")).await.0;
            if listening.contains("reached") {
                break;
            }
        }
        assert!(
            listening.contains("reached"),
            "{runtime:?}: the neighbour's server: {listening}"
        );
        let (out, code) = n.sh("open", "root", &reach(&neighbour)).await;
        assert!(
            code != 0 && !out.contains("reached"),
            "{runtime:?}: reached another sandbox: {out}"
        );
        let (out, code) = n.sh("open", "root", &reach("169.254.169.254")).await;
        assert!(code != 0 && !out.contains("reached"), "{runtime:?}: {out}");
        // A running sandbox's policy is replaced whole: the open one loses the internet, the
        // sealed one gains it (and a link it did not have).
        n.update_network("open", policy(true, &[], &["198.51.100.0/24"])).await;
        let (out, code) = n.sh("open", "user", &world.probe()).await;
        assert!(code != 0 && out.contains("No route to host"), "{runtime:?}: {out}");
        n.update_network("sealed", internet()).await;
        let (out, code) = n.sh("sealed", "user", &world.probe()).await;
        assert_eq!((out.trim(), code), ("from 198.51.100.1", 0), "{runtime:?}");
        n.update_network("sealed", policy(false, &[], &[])).await;
        let (out, code) = n.sh("sealed", "user", &world.probe()).await;
        assert_ne!(code, 0, "{runtime:?}: {out}");
        n.stop().await;
    }
}

/// A resolver on the host that no sandbox may reach, as a private resolver (10.x) or
/// systemd-resolved (127.0.0.53) is: it listens on every address of the host, TCP and UDP, and
/// answers every A question with 192.0.2.7 (and every other with no records).
struct PrivateResolver {
    port: u16,
}

impl PrivateResolver {
    fn start() -> PrivateResolver {
        // A free UDP port whose TCP twin is free too (a connection may hold it): a few tries.
        let (udp, tcp, port) = (0..64)
            .find_map(|_| {
                let udp = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
                let port = udp.local_addr().ok()?.port();
                let tcp = TcpListener::bind(("0.0.0.0", port)).ok()?;
                Some((udp, tcp, port))
            })
            .expect("a port free for both UDP and TCP");
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok((len, peer)) = udp.recv_from(&mut buf) {
                if let Some(answer) = dns_answer(&buf[..len]) {
                    let _ = udp.send_to(&answer, peer);
                }
            }
        });
        std::thread::spawn(move || {
            for mut stream in tcp.incoming().flatten() {
                use std::io::{Read, Write};
                let mut len = [0u8; 2];
                if stream.read_exact(&mut len).is_err() {
                    continue;
                }
                let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
                if stream.read_exact(&mut query).is_err() {
                    continue;
                }
                if let Some(answer) = dns_answer(&query) {
                    let _ = stream.write_all(&(answer.len() as u16).to_be_bytes());
                    let _ = stream.write_all(&answer);
                }
            }
        });
        PrivateResolver { port }
    }
}

/// The answer to a one-question DNS `query`: its header and question, an A record of
/// 192.0.2.7 when it asks for one.
fn dns_answer(query: &[u8]) -> Option<Vec<u8>> {
    let mut at = 12;
    while *query.get(at)? != 0 {
        at += 1 + usize::from(query[at]);
    }
    let qtype = u16::from_be_bytes([*query.get(at + 1)?, *query.get(at + 2)?]);
    let mut answer = query.get(..at + 5)?.to_vec();
    answer[2] = 0x81; // a response, recursion desired
    answer[3] = 0x80; // recursion available, no error
    answer[6..12].copy_from_slice(&[0, u8::from(qtype == 1), 0, 0, 0, 0]);
    if qtype == 1 {
        answer.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 192, 0, 2, 7]);
    }
    Some(answer)
}

/// Python that asks `169.254.0.53` for `db.example.test` over TCP and prints the address and
/// the answer count.
const TCP_QUERY: &str = r#"
import socket, struct
q = struct.pack('>HHHHHH', 0x4242, 0x0100, 1, 0, 0, 0)
q += b''.join(bytes([len(p)]) + p.encode() for p in 'db.example.test'.split('.')) + b'\x00'
q += struct.pack('>HH', 1, 1)
s = socket.create_connection(('169.254.0.53', 53), timeout=5)
s.sendall(struct.pack('>H', len(q)) + q)
n = struct.unpack('>H', s.recv(2))[0]
a = b''
while len(a) < n:
    a += s.recv(n - len(a))
print(socket.inet_ntoa(a[-4:]), struct.unpack('>H', a[6:8])[0])
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_resolve_through_the_node_when_its_resolver_is_out_of_the_sandboxs_reach() {
    let resolver = PrivateResolver::start();
    // A sandbox network of this test's own: its forwarder is this node's alone.
    let pool: common::egress::Cidr = "10.201.253.0/24".parse().unwrap();
    let forwarder_port = node_svc::runtime::container::resolver::port_of(&pool);
    let python = |script: &str| format!("python3 - <<'EOF'\n{script}\nEOF");
    let reach = |port: u16| {
        python(&format!(
            "import socket, subprocess\ngw = subprocess.run(['ip', '-4', 'route', 'show', 'default'], capture_output=True, text=True).stdout.split()[2]\ntry:\n    socket.create_connection((gw, {port}), timeout=2)\n    print('reached', gw)\nexcept OSError as e:\n    print('walled', gw, e)"
        ))
    };
    for runtime in runtimes() {
        let n = node_configured(runtime.clone(), |config| {
            config.network.pool = pool;
            config.network.resolvers = vec![([127, 0, 0, 1], resolver.port).into()];
        })
        .await;
        let features = n.running().host().features();
        assert!(
            !features.degraded.iter().any(|d| d.contains("resolve")),
            "{runtime:?}: {:?}",
            features.degraded
        );
        n.create_with("named", 256 << 20, internet()).await;
        let only_one = Some(pb::NetworkPolicy {
            internet: false,
            allow_out: vec![INTERNET.to_string()],
            deny_out: Vec::new(),
        });
        n.create_with("listed", 256 << 20, only_one).await;
        let (out, _) = n.sh("named", "user", "cat /etc/resolv.conf").await;
        assert_eq!(out.trim(), "nameserver 169.254.0.53", "{runtime:?}");
        // Through the C library (UDP), and over TCP, as a truncated answer is asked again.
        let lookup = "python3 -c \"import socket; print(socket.gethostbyname('db.example.test'))\"";
        for sandbox in ["named", "listed"] {
            let (out, code) = n.sh(sandbox, "user", lookup).await;
            assert_eq!((out.trim(), code), ("192.0.2.7", 0), "{runtime:?} {sandbox}");
        }
        let (out, code) = n.sh("named", "user", &python(TCP_QUERY)).await;
        assert_eq!((out.trim(), code), ("192.0.2.7 1", 0), "{runtime:?}");
        // From the attacker's side: neither the resolver nor the forwarder is reachable at
        // the host's address directly; only a query redirected from 169.254.0.53:53 is.
        for port in [resolver.port, forwarder_port] {
            let (out, _) = n.sh("named", "root", &reach(port)).await;
            assert!(out.starts_with("walled"), "{runtime:?}: port {port}: {out}");
        }
        let spoofed = python(
            "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.settimeout(2)\ns.sendto(b'\\x42\\x42\\x01\\x00\\x00\\x01' + bytes(6) + b'\\x02db\\x00\\x00\\x01\\x00\\x01', ('169.254.0.53', 5353))\ntry:\n    s.recv(512)\n    print('answered')\nexcept OSError as e:\n    print('walled', e)",
        );
        let (out, _) = n.sh("named", "root", &spoofed).await;
        assert!(
            out.starts_with("walled"),
            "{runtime:?}: another port of 169.254.0.53: {out}"
        );
        n.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_dns_port_is_taken_says_so_and_resolves_names_once_it_is_free() {
    let resolver = PrivateResolver::start();
    let pool: common::egress::Cidr = "10.201.251.0/24".parse().unwrap();
    let port = node_svc::runtime::container::resolver::port_of(&pool);
    // Another program on the forwarder's port, without SO_REUSEPORT: the node cannot share it.
    let squatter = std::net::UdpSocket::bind(("0.0.0.0", port)).expect("the forwarder's port is free to take");
    let n = node_configured(None, |config| {
        config.network.pool = pool;
        config.network.resolvers = vec![([127, 0, 0, 1], resolver.port).into()];
    })
    .await;
    let unresolving = || {
        n.running()
            .host()
            .features()
            .degraded
            .into_iter()
            .find(|d| d.contains("cannot resolve names"))
    };
    assert!(unresolving().is_some(), "the node does not say its forwarder is down");
    // The node keeps running sandboxes meanwhile.
    n.create_with("named", 256 << 20, internet()).await;
    drop(squatter);
    // The node tries again on its own (every DNS_RETRY) and stops saying it cannot.
    let deadline = std::time::Instant::now() + node_svc::runtime::container::network::DNS_RETRY * 5;
    while let Some(still) = unresolving() {
        assert!(std::time::Instant::now() < deadline, "still degraded: {still}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let lookup = "python3 -c \"import socket; print(socket.gethostbyname('db.example.test'))\"";
    let (out, code) = n.sh("named", "user", lookup).await;
    assert_eq!((out.trim(), code), ("192.0.2.7", 0));
    n.stop().await;
}

/// Prints which of the shell's descriptors 0 to 31 are open, using only the shell's builtins
/// (`[ -e ]` is a `stat`, which opens nothing).
const OPEN_DESCRIPTORS: &str =
    "for f in 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31; \
     do [ -e /proc/$$/fd/$f ] && printf '%s ' $f; done; true";

/// A command holds its three standard streams and nothing else of envd's: not the socket
/// envd listens on for the node (a command that could accept on it would read the node's
/// requests, tokens and all, and answer them), not the boot pipe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_inherits_no_descriptor_of_envd() {
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create("fds", 128 << 20).await;
        for user in ["user", "root"] {
            // The shell's own descriptors, by the shell alone: `ls /proc/$$/fd | tr ...` saw
            // the pipe the shell makes for `|` (3 and 4) whenever `ls` ran before the shell
            // closed its copies, and any listing by a program shows the folder it opened.
            let (out, code) = n.sh("fds", user, OPEN_DESCRIPTORS).await;
            assert_eq!((out.as_str(), code), ("0 1 2 ", 0), "{runtime:?} as {user}");
        }
        n.stop().await;
    }
}

/// Field `n` (1-based, as proc(5) numbers them; 3 or more) of a process's `stat`, after its
/// name in parentheses, which may hold spaces.
fn stat_field(pid: &str, n: usize) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(n - 3)?.parse().ok()
}

/// A process's nice value (`stat` field 19).
fn nice_of(pid: &str) -> Option<i32> {
    stat_field(pid, 19)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_run_above_the_node_and_sandboxes_at_its_priority() {
    let node_nice = nice_of("self").expect("this process's nice value");
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create("nice", 128 << 20).await;
        let init = n.running().host().get("nice").await.expect("a record").pgid;
        assert_eq!(
            nice_of(&init.to_string()),
            Some(node_nice),
            "{runtime:?}: the sandbox's init"
        );
        let (out, code) = n.sh("nice", "root", "cut -d' ' -f19 /proc/self/stat").await;
        assert_eq!(
            (out.trim(), code),
            (node_nice.to_string().as_str(), 0),
            "{runtime:?}: a command"
        );
        if runtime.is_none() {
            // This node's helper has served the create, so it has raised itself by now; the
            // helpers of other tests' nodes are children of this process too, some perhaps
            // just starting.
            let me = i32::try_from(std::process::id()).expect("a pid");
            let helpers: Vec<i32> = std::fs::read_dir("/proc")
                .expect("/proc")
                .flatten()
                .filter_map(|e| {
                    let pid = e.file_name().into_string().ok()?;
                    let parent = stat_field(&pid, 4)?;
                    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                    let helper = cmdline.split(|&b| b == 0).any(|arg| arg == b"helper");
                    (parent == me && helper).then(|| nice_of(&pid)).flatten()
                })
                .collect();
            // Without CAP_SYS_NICE (bit 23 of the effective set) a helper stays at the node's.
            let status = std::fs::read_to_string("/proc/self/status").expect("own status");
            let caps = status
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|c| u64::from_str_radix(c.trim(), 16).ok())
                .expect("CapEff");
            let expected = if caps & (1 << 23) != 0 {
                (node_nice - jail::priority::CREATE_BOOST).max(-20)
            } else {
                node_nice
            };
            assert!(
                helpers.contains(&expected),
                "no runtime helper at {expected}: {helpers:?}, the node at {node_nice}"
            );
        }
        n.stop().await;
    }
}

/// Python that asks for descriptor 3 of PID 1 (envd's init) and of envd's server (the
/// ancestor of this command whose parent is PID 1) through `pidfd_getfd`, printing "taken" or
/// "refused" for each.
const PIDFD_GETFD: &str = "import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def parent(pid):
    return int(open(\"/proc/%d/stat\" % pid).read().rsplit(\")\", 1)[1].split()[1])
server = os.getpid()
while parent(server) != 1:
    server = parent(server)
said = []
for pid in (1, server):
    pidfd = libc.syscall(434, pid, 0)
    taken = libc.syscall(438, pidfd, 3, 0) if pidfd >= 0 else -1
    said.append(\"taken\" if taken >= 0 else \"refused\")
print(\" \".join(said))";

/// The io_uring system calls are refused: they run calls from kernel workers, outside the
/// filter that screens the sandbox's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_uring_is_refused() {
    const SETUP: &str = "import ctypes
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
fd = libc.syscall(425, 8, params)
print(\"refused %d\" % ctypes.get_errno() if fd < 0 else \"open\")";
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create("uring", 128 << 20).await;
        for user in ["root", "user"] {
            let (out, code) = n.sh("uring", user, &format!("python3 -c '{SETUP}'")).await;
            assert_eq!(
                (out.trim(), code),
                (
                    format!("refused {}", rustix::io::Errno::PERM.raw_os_error()).as_str(),
                    0
                ),
                "{runtime:?} as {user}"
            );
        }
        n.stop().await;
    }
}

/// envd is out of reach of the sandbox's own root: neither the init (PID 1) nor the server
/// that answers the node (the parent of a command) lets root inside read its environment,
/// open its descriptors (the kernel's check for `pidfd_getfd`, which would take the socket
/// the node's requests arrive on, is the same and stricter) or read its memory. (The numbers
/// in `/proc/1/fd` stay listable by the owner of the directory; what they are does not.)
/// Root still reaches its own processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_is_out_of_reach_of_the_sandboxs_root() {
    const PROBE: &str = "for p in 1 $PPID; do \
         for what in environ mem fd/0; do \
           if ( exec 3</proc/$p/$what ) 2>/dev/null; then printf '%s ' \"$p/$what:open\"; fi; \
         done; \
       done; \
       ( exec 3</proc/$$/environ ) && printf 'own'";
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create("reach", 128 << 20).await;
        for user in ["root", "user"] {
            let (out, code) = n.sh("reach", user, PROBE).await;
            assert_eq!((out.as_str(), code), ("own", 0), "{runtime:?} as {user} reached envd");
        }
        // The attack itself: take envd's descriptor 3 through a pidfd of PID 1 (and of the
        // server), as root. pidfd_open is allowed; pidfd_getfd must be refused.
        let (out, code) = n.sh("reach", "root", &format!("python3 -c '{PIDFD_GETFD}'")).await;
        assert_eq!(
            (out.trim(), code),
            ("refused refused", 0),
            "{runtime:?}: pidfd_getfd on envd"
        );
        n.stop().await;
    }
}

/// All of a node's sandboxes together cannot take the host's processes: the node's parent
/// group caps them (here at 64), so a sandbox that forks without end gets EAGAIN while the
/// host goes on forking, and another sandbox's envd still answers once the first is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_stops_at_the_nodes_process_limit() {
    let n = node_configured(None, |c| c.pids_max = Some(64)).await;
    let parent = format!("/sys/fs/cgroup/pids/{}", node_svc::runtime::cgroup::parent_name(&n.id));
    let read = |file: &str| std::fs::read_to_string(format!("{parent}/{file}")).unwrap();
    assert_eq!(read("pids.max").trim(), "64");
    n.create("bomb", 256 << 20).await;
    // Forks until the kernel refuses (the shell then gives up); the sleepers stay.
    let (out, code) = n
        .sh("bomb", "root", "while :; do sleep 60 </dev/null >/dev/null 2>&1 & done")
        .await;
    assert_ne!(code, 0, "the bomb never ran out of forks: {out}");
    let held: u32 = read("pids.current").trim().parse().unwrap();
    assert!(
        (10..=64).contains(&held),
        "the node's sandboxes hold {held} processes (cap 64)"
    );
    // The host forks on.
    assert!(std::process::Command::new("true").status().unwrap().success());
    n.lifecycle("bomb", "kill").await;
    n.create("after", 128 << 20).await;
    let (out, code) = n.sh("after", "user", "echo fine").await;
    assert_eq!((out.as_str(), code), ("fine\n", 0));
    n.stop().await;
}

/// One tenant's fork bomb leaves its neighbour the processes it was promised: each sandbox
/// may have its memory's share of the node's processes (here two halves of 128), so the bomb
/// stops at its own half while the neighbour still starts dozens. Before shares, one sandbox's
/// limit (8192) lay above the node's whole cap and the bomb took all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_leaves_the_neighbour_its_share() {
    let n = node_configured(None, |c| {
        c.pids_max = Some(128);
        c.host.capacity.memory_bytes = 1 << 30;
    })
    .await;
    n.create("bomb", 512 << 20).await;
    n.create("neighbour", 512 << 20).await;
    let (out, code) = n
        .sh("bomb", "root", "while :; do sleep 60 </dev/null >/dev/null 2>&1 & done")
        .await;
    assert_ne!(code, 0, "the bomb never ran out of forks: {out}");
    let (out, code) = n
        .sh(
            "neighbour",
            "user",
            "for i in $(seq 40); do sleep 60 </dev/null >/dev/null 2>&1 & done; echo started",
        )
        .await;
    assert_eq!(
        (out.as_str(), code),
        ("started\n", 0),
        "the neighbour could not start its processes"
    );
    n.stop().await;
}

/// Runs `script` with `sh -c` as `nobody`, the way any local account would (through a shell:
/// setpriv's own exec of a path is not a fair trial of the path's permissions).
fn as_nobody(script: &str) -> std::process::Output {
    std::process::Command::new("setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "--",
            "sh",
            "-c",
        ])
        .arg(script)
        .output()
        .unwrap()
}

/// Another user of the node's host reaches nothing of a sandbox's: not its files through the
/// mount point of its root (runc's; the node's own runtime mounts none there) or through its
/// init's `/proc/PID/root`, not its spec (which holds its environment variables), not envd's
/// socket. Tried as `nobody`, the way any local account would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_host_user_reaches_nothing_of_a_sandbox() {
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        n.create("private", 128 << 20).await;
        let (_, code) = n.sh("private", "user", "echo secret > /home/user/secret.txt").await;
        assert_eq!(code, 0);
        let sandboxes = node_svc::runtime::container::run_dir(&n.dir).join("sandboxes");
        let bundle = std::fs::read_dir(&sandboxes)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.join("config.json").exists())
            .expect("the sandbox's bundle");
        // runc's root is mounted in the node's own table, where the host's root sees it; the
        // node's own runtime mounts it in the container's table alone (see `jail::view`).
        let mounted_here = runtime.is_some();
        assert_eq!(
            bundle.join("rootfs/home/user/secret.txt").exists(),
            mounted_here,
            "{runtime:?}: the host's root sees the file through the bundle's root only with runc"
        );
        // The host's root reads it through the init's `/proc/PID/root`; another user is refused
        // there (the kernel's ptrace check on the init).
        let init = std::fs::read_to_string(bundle.join("container.pid")).unwrap();
        let through_init = PathBuf::from(format!("/proc/{}/root/home/user/secret.txt", init.trim()));
        assert_eq!(
            std::fs::read_to_string(&through_init).unwrap(),
            "secret\n",
            "{runtime:?}"
        );
        for (what, command) in [
            ("the spec", format!("cat {}/config.json", bundle.display())),
            (
                "a tenant's file",
                format!("cat {}/rootfs/home/user/secret.txt", bundle.display()),
            ),
            ("the root's listing", format!("ls {}/rootfs/etc", bundle.display())),
            ("envd's socket", format!("test -w {}/envd.sock", bundle.display())),
            (
                "a tenant's file through its init's root",
                format!("cat {}", through_init.display()),
            ),
            (
                "the state directory",
                format!("ls {}/container {}/sandboxes", n.dir.display(), n.dir.display()),
            ),
            // A sandbox's ID names its public ports.
            ("the list of sandboxes", format!("ls {}", sandboxes.display())),
            (
                "a tenant's file on its disk",
                format!(
                    "cat {}/sandboxes/private/disk/home/home/user/secret.txt",
                    n.dir.display()
                ),
            ),
        ] {
            let out = as_nobody(&command);
            assert!(
                !out.status.success(),
                "{runtime:?}: nobody reached {what}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        // The sandbox itself still reaches its root.
        let (out, code) = n.sh("private", "user", "cat /home/user/secret.txt").await;
        assert_eq!((out.as_str(), code), ("secret\n", 0), "{runtime:?}");
        n.stop().await;
    }
}

/// A UDP peer on the test's internet: it answers `hello` with `hi` and `probe` with `fresh`,
/// each to whoever sent it, and on demand sends `stale` to whoever said `hello` last: a
/// packet of an old flow arriving after its sandbox is gone.
struct UdpPeer {
    socket: std::net::UdpSocket,
    said_hello: std::sync::Arc<std::sync::Mutex<Option<std::net::SocketAddr>>>,
}

impl Internet {
    fn udp(&self) -> UdpPeer {
        let socket = inside(&self.name, || {
            std::net::UdpSocket::bind(format!("{INTERNET}:0")).unwrap()
        });
        let said_hello = std::sync::Arc::new(std::sync::Mutex::new(None));
        let (answering, last) = (socket.try_clone().unwrap(), said_hello.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            while let Ok((len, peer)) = answering.recv_from(&mut buf) {
                let answer: &[u8] = match &buf[..len] {
                    b"hello" => {
                        *last.lock().unwrap() = Some(peer);
                        b"hi"
                    }
                    b"probe" => b"fresh",
                    _ => continue,
                };
                let _ = answering.send_to(answer, peer);
            }
        });
        UdpPeer { socket, said_hello }
    }
}

impl UdpPeer {
    fn port(&self) -> u16 {
        self.socket.local_addr().unwrap().port()
    }

    /// Sends `stale` to the last sandbox that said hello, as the host translated it.
    fn send_stale(&self) {
        let to = self.said_hello.lock().unwrap().expect("a sandbox said hello");
        self.socket.send_to(b"stale", to).unwrap();
    }
}

/// The interface index of host link `name`.
fn ifindex(name: &str) -> String {
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .trim()
        .to_string()
}

/// A killed sandbox's network slot goes to the next sandbox, clean, and no link is made or
/// deleted for either: with one address in the pool, four sandboxes in turn get it through the
/// same host link (its index never changes), the last one killed by a node that found it
/// running at start. Nothing of one reaches the next: the rules it had are gone, so is what
/// TCP learnt of its peers, the host sends it nothing of its own, and a packet of its flow
/// sent after its kill (here a UDP peer answering late to the address the host had
/// translated its flow to) never reaches the next sandbox on the same address and port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sandboxs_slot_goes_to_the_next_sandbox_clean() {
    let world = Internet::start();
    let peer = world.udp();
    let pool: common::egress::Cidr = "10.201.250.0/30".parse().unwrap();
    let slot = node_svc::runtime::container::network::slot(&pool, 0).unwrap();
    let configure = |config: &mut NodeConfig| {
        config.network.pool = pool;
        config.network.slots.ready = 1;
        config.network.slots.cooldown = Duration::from_millis(100);
    };
    for runtime in runtimes() {
        let mut n = node_configured(runtime.clone(), configure).await;
        let mut index = None;
        for round in 0..4 {
            let sandbox = format!("slotted-{round}");
            let policy = pb::NetworkPolicy {
                internet: true,
                // The first has rules of its own; the next must not inherit them.
                deny_out: if round == 0 {
                    vec!["203.0.113.0/24".into()]
                } else {
                    vec![]
                },
                ..Default::default()
            };
            n.create_with(&sandbox, 128 << 20, Some(policy)).await;
            let (out, _) = n.sh(&sandbox, "root", "ip -4 -o addr show eth0").await;
            assert!(
                out.contains(&format!("{}/30", slot.address)),
                "{runtime:?} round {round}: {out}"
            );
            let now = ifindex(&slot.host_interface);
            assert_eq!(
                *index.get_or_insert(now.clone()),
                now,
                "{runtime:?} round {round}: the link was made again"
            );
            let pid = n.running().host().get(&sandbox).await.expect("a record").pgid;
            let tables = std::process::Command::new("nsenter")
                .arg(format!("--net=/proc/{pid}/ns/net"))
                .args(["nft", "list", "tables"])
                .output()
                .expect("nsenter (util-linux)");
            let tables = String::from_utf8_lossy(&tables.stdout);
            assert_eq!(
                tables.contains("egress"),
                round == 0,
                "{runtime:?} round {round}: {tables}"
            );
            // What TCP learnt of the last sandbox's peers, which anyone inside may list, is gone.
            let (peers, _) = n.sh(&sandbox, "user", "ip tcp_metrics show").await;
            assert!(!peers.contains(INTERNET), "{runtime:?} round {round}: {peers}");
            if round == 0 {
                let (out, code) = n.sh(&sandbox, "user", &world.probe()).await;
                assert_eq!((out.trim(), code), ("from 198.51.100.1", 0), "{runtime:?}");
                // Saved when the connection's last ACK arrives, a moment after the probe ends.
                let mut peers = String::new();
                for _ in 0..100 {
                    peers = n.sh(&sandbox, "user", "ip tcp_metrics show").await.0;
                    if peers.contains(INTERNET) {
                        break;
                    }
                }
                assert!(
                    peers.contains(INTERNET),
                    "{runtime:?}: TCP keeps what it learnt: {peers}"
                );
            }
            // Bound before the late packet is sent, so it would be seen if it came.
            let script = format!(
                "python3 -c \"
import socket, os, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(('0.0.0.0', 40000))
s.settimeout(5)
open('/tmp/bound', 'w').close()
deadline = time.time() + 20
while {round} > 0 and not os.path.exists('/tmp/go') and time.time() < deadline:
    time.sleep(0.01)
if {round} > 0:
    s.sendto(b'probe', ('{INTERNET}', {port}))
    print(s.recv(64).decode())
s.sendto(b'hello', ('{INTERNET}', {port}))
print(s.recv(64).decode())
\" > /tmp/said 2>&1; touch /tmp/done",
                port = peer.port()
            );
            n.sh(
                &sandbox,
                "root",
                &format!("nohup sh -c '{}' >/dev/null 2>&1 &", script.replace('\'', "'\\''")),
            )
            .await;
            let wait_for = |file: &'static str| {
                let (n, sandbox) = (&n, sandbox.clone());
                async move {
                    for _ in 0..400 {
                        if n.sh(&sandbox, "root", &format!("test -e /tmp/{file}")).await.1 == 0 {
                            return;
                        }
                    }
                    panic!("{sandbox}: /tmp/{file} never appeared");
                }
            };
            wait_for("bound").await;
            if round > 0 {
                peer.send_stale();
                // Nor does the host open anything to a sandbox (an answer of its own sent late,
                // after the flow it answered was forgotten, would otherwise get through).
                let host = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
                // (Dropped on its way out: the send itself fails with EPERM.)
                let _ = host.send_to(b"host", (slot.address, 40000));
                n.sh(&sandbox, "root", "touch /tmp/go").await;
            }
            wait_for("done").await;
            let (said, _) = n.sh(&sandbox, "root", "cat /tmp/said").await;
            let expected = if round > 0 { "fresh\nhi\n" } else { "hi\n" };
            assert_eq!(
                said, expected,
                "{runtime:?} round {round}: the last sandbox's flow reached this one"
            );
            if round == 3 {
                // The last sandbox is killed by a node that found it at start.
                let (dir, id) = (n.dir.clone(), n.id.clone());
                if let Some(running) = n.node.take() {
                    running.stop().await;
                }
                let mut config = NodeConfig::new("127.0.0.1:0".parse().unwrap(), &id, &dir);
                config.runtime = RuntimeKind::Container {
                    oci_runtime: runtime.clone(),
                };
                configure(&mut config);
                n.node = Some(node_svc::server::start(config).await.unwrap());
            }
            n.lifecycle(&sandbox, "kill").await;
        }
        assert_eq!(index.as_deref(), Some(ifindex(&slot.host_interface).as_str()));
        n.stop().await;
    }
}

/// Sandboxes created and killed at once, over and over, never share a network slot: at every
/// point the running ones have addresses and network namespaces of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sandboxes_never_share_a_network_slot() {
    let configure = |config: &mut NodeConfig| {
        config.network.pool = "10.201.248.0/28".parse().unwrap();
        config.network.slots.ready = 2;
        config.network.slots.cooldown = Duration::from_millis(50);
    };
    let n = node_configured(None, configure).await;
    for round in 0..3 {
        let names: Vec<String> = (0..4).map(|i| format!("crowd-{round}-{i}")).collect();
        futures::future::join_all(names.iter().map(|s| n.create_with(s, 64 << 20, internet()))).await;
        let mut seen = std::collections::HashSet::new();
        for sandbox in &names {
            let (out, _) = n
                .sh(
                    sandbox,
                    "root",
                    "ip -4 -o addr show eth0 | awk '{print $4}'; stat -L -c %i /proc/self/ns/net",
                )
                .await;
            for line in out.lines() {
                assert!(seen.insert(line.to_string()), "round {round}: {sandbox} shares {line}");
            }
        }
        futures::future::join_all(names.iter().map(|s| n.lifecycle(s, "kill"))).await;
    }
    n.stop().await;
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
        // And so it would under any pressure: envd (init and server) is the last the OOM
        // killer picks, below every command, and a command cannot go below envd.
        for user in ["user", "root"] {
            let (out, code) = n
                .sh(
                    "hog",
                    user,
                    "read init < /proc/1/oom_score_adj; read server < /proc/$PPID/oom_score_adj; \
                     read mine < /proc/$$/oom_score_adj; echo $init $server $mine; \
                     echo -600 > /proc/$$/oom_score_adj 2>/dev/null && echo lowered; true",
                )
                .await;
            assert_eq!((out.as_str(), code), ("300 300 900\n", 0), "{runtime:?} as {user}");
        }
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

/// What is charged to spare cgroup `spare` once it is under what a create takes it with: until
/// the janitor has unmounted a killed sandbox's disk, its cache and kernel objects are still
/// charged to the group, and a create passes it over. (No event says when; at most 60 s.)
async fn settled(spare: &std::path::Path) -> u64 {
    let charge_left = node_svc::runtime::container::spare_cgroups::charge_left();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let path = spare.join("memory.usage_in_bytes");
        let left: u64 = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .trim()
            .parse()
            .unwrap();
        if left <= charge_left || std::time::Instant::now() > deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A killed sandbox's cgroup is kept for the next sandbox rather than removed (removing a
/// memory cgroup costs the kernel in proportion to every file system on the host): emptied,
/// its limits lifted and its figures zeroed while it waits, and the next sandbox that takes it
/// holds its own limit and none of the first one's peak or CPU time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sandboxs_cgroup_goes_to_the_next_sandbox_reset() {
    let mut n = node(None).await;
    let (dir, id) = (n.dir.clone(), n.id.clone());
    let group = |hierarchy: &str, leaf: &str| {
        PathBuf::from("/sys/fs/cgroup")
            .join(hierarchy)
            .join(node_svc::runtime::cgroup::parent_name(&id))
            .join(leaf)
    };
    let read = |path: PathBuf| {
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .trim()
            .to_string()
    };
    let number = |path: PathBuf| -> u64 { read(path).parse().unwrap() };
    // A group is the same kernel object across a rename: its inode number stays.
    let inode = |path: PathBuf| {
        std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .ino()
    };
    let spares = |hierarchy: &str| -> Vec<String> {
        std::fs::read_dir(group(hierarchy, ""))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with(".spare-"))
            .collect()
    };
    let hierarchies = ["memory", "cpuacct", "cpu", "pids", "freezer"];
    // A memory peak of its own (40 MB in its /dev/shm, then freed) and CPU time (a fixed
    // amount of work, not of wall time, which a loaded host would shorten).
    let work = "dd if=/dev/zero of=/dev/shm/x bs=1M count=40 2>&1 && rm /dev/shm/x && \
                i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done";
    // A group holds the charge of the files its sandbox was the first to read for as long as
    // they stay cached (a test binary just built: envd's pages), and is then not kept: a
    // sandbox that stays does that first.
    n.create("warm", 256 << 20).await;
    let (out, code) = n.sh("warm", "user", work).await;
    assert_eq!(code, 0, "{out}");
    n.create("first", 256 << 20).await;
    let first: Vec<u64> = hierarchies.iter().map(|h| inode(group(h, "first"))).collect();
    let (out, code) = n.sh("first", "user", work).await;
    assert_eq!(code, 0, "{out}");
    let peak = number(group("memory", "first/memory.max_usage_in_bytes"));
    let cpu = number(group("cpuacct", "first/cpuacct.usage"));
    assert!(peak > 40 << 20, "the first sandbox's peak: {peak}");
    n.lifecycle("first", "kill").await;
    for hierarchy in hierarchies {
        assert!(
            !group(hierarchy, "first").exists(),
            "{hierarchy}: the killed sandbox's group"
        );
        assert_eq!(spares(hierarchy).len(), 1, "{hierarchy}: one spare");
    }
    let spare = spares("memory").remove(0);
    assert_eq!(read(group("memory", &spare).join("tasks")), "", "empty");
    assert_eq!(read(group("freezer", &spare).join("freezer.state")), "THAWED");
    assert!(
        number(group("memory", &spare).join("memory.limit_in_bytes")) > 1 << 50,
        "no limit while it waits"
    );
    let left = settled(&group("memory", &spare)).await;
    assert!(number(group("memory", &spare).join("memory.max_usage_in_bytes")) < 20 << 20);
    // Zeroed by the kill; what the last of the first sandbox's exit ran after that (some
    // microseconds) is zeroed again by the create that takes it.
    let spare_cpu = number(group("cpuacct", &spare).join("cpuacct.usage"));
    assert!(spare_cpu < 1_000_000, "the spare's CPU time: {spare_cpu} ns");
    assert_eq!(read(group("pids", &spare).join("pids.max")), "max");

    n.create("second", 128 << 20).await;
    for (hierarchy, first) in hierarchies.iter().zip(&first) {
        assert!(
            spares(hierarchy).is_empty(),
            "{hierarchy}: the spare was taken ({left} bytes charged to it)"
        );
        assert_eq!(
            inode(group(hierarchy, "second")),
            *first,
            "{hierarchy}: as the second sandbox's ({left} bytes were charged to it)"
        );
    }
    let (out, code) = n.sh("second", "user", "echo mine").await;
    assert_eq!((out.as_str(), code), ("mine\n", 0));
    // A sandbox whose group is new (no spare left) gets the same limits.
    n.create("third", 128 << 20).await;
    for (hierarchy, file) in [
        ("memory", "memory.limit_in_bytes"),
        ("memory", "memory.soft_limit_in_bytes"),
        ("cpu", "cpu.cfs_quota_us"),
        ("cpu", "cpu.shares"),
        ("pids", "pids.max"),
    ] {
        assert_eq!(
            read(group(hierarchy, "second").join(file)),
            read(group(hierarchy, "third").join(file)),
            "{file}"
        );
    }
    let second_peak = number(group("memory", "second/memory.max_usage_in_bytes"));
    assert!(
        second_peak < 100 << 20,
        "the second sandbox's peak {second_peak} is its own"
    );
    let second_cpu = number(group("cpuacct", "second/cpuacct.usage"));
    assert!(second_cpu < cpu / 2, "and its CPU time ({second_cpu} ns)");

    // A node started again takes back the spares its earlier run left.
    n.lifecycle("second", "kill").await;
    let kept = group("memory", &spares("memory")[0]);
    let left = settled(&kept).await;
    let kept = inode(kept);
    if let Some(running) = n.node.take() {
        running.stop().await;
    }
    let mut config = NodeConfig::new("127.0.0.1:0".parse().unwrap(), &id, &dir);
    config.runtime = RuntimeKind::Container { oci_runtime: None };
    n.node = Some(node_svc::server::start(config).await.unwrap());
    n.create("fourth", 128 << 20).await;
    assert!(spares("memory").is_empty(), "the spare was taken after the restart");
    assert_eq!(
        inode(group("memory", "fourth")),
        kept,
        "{left} bytes were charged to it"
    );
    let (out, code) = n.sh("fourth", "user", "echo mine").await;
    assert_eq!((out.as_str(), code), ("mine\n", 0));
    n.stop().await;
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

/// A server in the sandbox that answers an upgrade with 101 and then echoes bytes: the
/// shape of a WebSocket without its framing.
const UPGRADE_ECHO: &str = r#"
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', 8081))
s.listen()
while True:
    c, _ = s.accept()
    head = b''
    while b'\r\n\r\n' not in head:
        head += c.recv(1024)
    c.sendall(b'HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n')
    while True:
        data = c.recv(1024)
        if not data:
            break
        c.sendall(data)
    c.close()
"#;

impl Node {
    /// A request for `port` of `sandbox` through the node's envd endpoint, as the gateway
    /// sends it.
    fn port(&self, sandbox: &str, port: u16, path: &str) -> reqwest::RequestBuilder {
        self.http
            .get(format!("{}{path}", self.running().envd_endpoint()))
            .header("E2b-Sandbox-Id", sandbox)
            .header("E2b-Sandbox-Port", port.to_string())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxs_ports_are_reached_through_the_node_and_only_its_own() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for runtime in runtimes() {
        let n = node(runtime.clone()).await;
        // Loopback only, and a server bound to the sandbox's 127.0.0.1: still reachable.
        n.create("web", 256 << 20).await;
        n.sh("web", "user", "echo hello-from-the-sandbox > index.html; nohup python3 -m http.server 8080 --bind 127.0.0.1 >/dev/null 2>&1 &")
            .await;
        let write =
            format!("cat > /tmp/echo.py <<'PY'\n{UPGRADE_ECHO}\nPY\nnohup python3 /tmp/echo.py >/dev/null 2>&1 &");
        n.sh("web", "user", &write).await;
        let mut answer = None;
        for _ in 0..100 {
            let response = n.port("web", 8080, "/index.html").send().await.unwrap();
            if response.status() == 200 {
                answer = Some(response.text().await.unwrap());
                break;
            }
            assert_eq!(response.status(), 502, "{runtime:?}: before the server listens");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(answer.as_deref(), Some("hello-from-the-sandbox\n"), "{runtime:?}");
        // Nothing on a port: 502 in E2B's shape, saying so.
        let response = n.port("web", 9, "/").send().await.unwrap();
        assert_eq!(response.status(), 502, "{runtime:?}");
        let body: Value = response.json().await.unwrap();
        assert!(body["message"].as_str().unwrap().contains("port 9"), "{body}");
        // The port belongs to the sandbox named: another sandbox's 8080 is its own (closed).
        n.create("other", 256 << 20).await;
        assert_eq!(
            n.port("other", 8080, "/").send().await.unwrap().status(),
            502,
            "{runtime:?}"
        );
        // An upgrade is spliced through: bytes both ways after the 101.
        let endpoint = n.running().envd_endpoint();
        let address = endpoint.trim_start_matches("http://").to_string();
        let mut upgraded = false;
        for _ in 0..100 {
            let mut tcp = tokio::net::TcpStream::connect(&address).await.unwrap();
            let hello = "GET /echo HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: web\r\nE2b-Sandbox-Port: 8081\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n";
            tcp.write_all(hello.as_bytes()).await.unwrap();
            let mut head = vec![0u8; 4096];
            let n_read = tcp.read(&mut head).await.unwrap();
            let head = String::from_utf8_lossy(&head[..n_read]).to_string();
            if head.starts_with("HTTP/1.1 502") {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            assert!(head.starts_with("HTTP/1.1 101"), "{runtime:?}: {head}");
            tcp.write_all(b"ping through the node").await.unwrap();
            let mut echoed = vec![0u8; 21];
            tokio::time::timeout(Duration::from_secs(5), tcp.read_exact(&mut echoed))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(&echoed, b"ping through the node");
            upgraded = true;
            break;
        }
        assert!(upgraded, "{runtime:?}: the echo server never answered");
        n.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_ports_take_the_sandboxs_traffic_token_and_envd_is_not_one_of_them() {
    let runtime = None;
    let n = node(runtime).await;
    let mut c = NodeClient::connect(n.running().endpoint()).await.unwrap();
    c.create(pb::CreateRequest {
        operation_id: "c-private".into(),
        epoch: 1,
        sandbox_id: "private".into(),
        template: "base".into(),
        resources: Some(pb::Resources {
            vcpus: 1,
            memory_bytes: 256 << 20,
            disk_bytes: 0,
        }),
        access_token: token_of("private"),
        traffic_access_token: "traffic-secret".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    n.sh("private", "user", "nohup python3 -m http.server 8080 >/dev/null 2>&1 &")
        .await;
    let denied = n.port("private", 8080, "/").send().await.unwrap();
    assert_eq!(denied.status(), 401);
    let wrong = n
        .port("private", 8080, "/")
        .header("e2b-traffic-access-token", "traffic-secreT")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let mut status = 0;
    for _ in 0..100 {
        status = n
            .port("private", 8080, "/")
            .header("e2b-traffic-access-token", "traffic-secret")
            .send()
            .await
            .unwrap()
            .status()
            .as_u16();
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, 200);
    // The traffic token opens ports, not envd; envd's port by header is envd, token-checked.
    let envd = n
        .port("private", 49983, "/envs")
        .header("e2b-traffic-access-token", "traffic-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(envd.status(), 401);
    n.stop().await;
}

/// The start command's output reaches the sandbox's log (outside the sandbox, in the node's
/// keeping) line by line, stdout and stderr told apart; it starts only once the network is
/// up (a sandbox with a link sees its eth0 from its first line).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_commands_output_is_the_sandboxs_log() {
    let n = node(None).await;
    let mut c = NodeClient::connect(n.running().endpoint()).await.unwrap();
    c.create(pb::CreateRequest {
        operation_id: "c-logged".into(),
        epoch: 1,
        sandbox_id: "logged".into(),
        template: "base".into(),
        resources: Some(pb::Resources {
            vcpus: 1,
            memory_bytes: 256 << 20,
            disk_bytes: 0,
        }),
        access_token: token_of("logged"),
        start_command: "echo out-line; echo err-line >&2; cat /sys/class/net/eth0/operstate".into(),
        network: internet(),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut messages = Vec::new();
    for _ in 0..100 {
        let logs = c
            .logs(pb::LogsRequest {
                sandbox_id: "logged".into(),
                limit: 1000,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        messages = logs
            .entries
            .iter()
            .map(|e| (e.message.clone(), e.fields.get("stream").cloned().unwrap_or_default()))
            .collect::<Vec<_>>();
        if messages.iter().any(|(m, _)| m == "up") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        messages.contains(&("out-line".to_string(), "stdout".to_string())),
        "{messages:?}"
    );
    assert!(
        messages.contains(&("err-line".to_string(), "stderr".to_string())),
        "{messages:?}"
    );
    assert!(
        messages.iter().any(|(m, _)| m == "up"),
        "eth0 was not up for the start command: {messages:?}"
    );
    n.stop().await;
}

/// A node given the static envd (`--envd-binary`, built by scripts/build-static-envd) injects
/// it into its sandboxes instead of its own binary; they work the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_injects_the_static_envd_it_is_given() {
    let envd = std::env::var_os("SANDBOXSCHED_STATIC_ENVD")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/x86_64-unknown-linux-gnu/debug/sandboxsched-envd")
        });
    assert!(
        envd.is_file(),
        "{} is missing: run scripts/build-static-envd (scripts/test-all does)",
        envd.display()
    );
    let n = node_with(None, None, Some(envd.clone())).await;
    n.create("static", 256 << 20).await;
    let (out, code) = n.sh("static", "user", "id -u; ls -l /.sandboxsched/envd").await;
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("1000\n"), "{out}");
    let size = std::fs::metadata(&envd).unwrap().len().to_string();
    assert!(
        out.contains(&size),
        "the sandbox's envd is the static one ({size} bytes): {out}"
    );
    n.stop().await;
}

/// Builds `steps` (kind, args) on `node` from the base template; the image, or the failure.
async fn build(node: &Node, steps: &[(&str, &[&str])]) -> Result<pb::TemplateImage, pb::BuildFailure> {
    let mut c = NodeClient::connect(node.running().endpoint()).await.unwrap();
    let request = pb::BuildRequest {
        build_id: uuid::Uuid::new_v4().to_string(),
        resources: Some(pb::Resources {
            vcpus: 1,
            memory_bytes: 256 << 20,
            disk_bytes: 0,
        }),
        from_template: Some((&common::template::Image::base()).into()),
        steps: steps
            .iter()
            .map(|(kind, args)| pb::BuildStep {
                kind: kind.to_string(),
                args: args.iter().map(|a| a.to_string()).collect(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let mut events = c.build(request).await.unwrap().into_inner();
    let mut log = Vec::new();
    while let Some(event) = events.message().await.unwrap() {
        match event.event {
            Some(pb::build_event::Event::Log(l)) => log.push(l.message),
            Some(pb::build_event::Event::Done(image)) => return Ok(image),
            Some(pb::build_event::Event::Failed(f)) => return Err(f),
            None => {}
        }
    }
    panic!("the build ended without an outcome; log: {log:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_built_template_runs_and_moves_to_a_node_that_never_had_its_layers() {
    let blobs = std::env::temp_dir().join(format!("container-test-blobs-{}", uuid::Uuid::new_v4().simple()));
    let a = node_sharing(None, None, None, Some(&blobs)).await;
    let b = node_sharing(None, None, None, Some(&blobs)).await;
    let image = build(
        &a,
        &[
            ("RUN", &["echo built > /opt/built.txt && id -un > /opt/by.txt", "root"]),
            ("ENV", &["FROM_TEMPLATE", "yes"]),
            ("WORKDIR", &["/srv/app"]),
        ],
    )
    .await
    .expect("the build succeeds");
    assert_eq!(image.layers.len(), 2, "RUN and WORKDIR made layers: {image:?}");
    let failed = build(&a, &[("RUN", &["echo about-to-fail; exit 7", ""])])
        .await
        .unwrap_err();
    assert_eq!(failed.step, "1");
    assert!(
        failed.message.contains("about-to-fail") && failed.message.contains('7'),
        "{failed:?}"
    );

    let mut c = NodeClient::connect(a.running().endpoint()).await.unwrap();
    c.create(pb::CreateRequest {
        operation_id: "c-built".into(),
        epoch: 1,
        sandbox_id: "built".into(),
        template: "t-built".into(),
        resources: Some(pb::Resources {
            vcpus: 1,
            memory_bytes: 256 << 20,
            disk_bytes: 0,
        }),
        access_token: token_of("built"),
        image: Some(image),
        ..Default::default()
    })
    .await
    .unwrap();
    let check = "cat /opt/built.txt /opt/by.txt; echo $FROM_TEMPLATE; pwd; stat -c %U /srv/app";
    let expected = "built\nroot\nyes\n/srv/app\nuser\n";
    let (out, code) = a.sh("built", "user", check).await;
    assert_eq!((out.as_str(), code), (expected, 0));

    assert_eq!(
        std::fs::read_dir(b.dir.join("container/layers/sha256"))
            .map(|d| d.count())
            .unwrap_or(0),
        0
    );
    move_sandbox(&a, &b, "built").await;
    let (out, code) = b.sh("built", "user", check).await;
    assert_eq!(
        (out.as_str(), code),
        (expected, 0),
        "the layers came from the blob store"
    );
    a.stop().await;
    b.stop().await;
    let _ = std::fs::remove_dir_all(&blobs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_at_start_removes_a_create_cut_short_and_keeps_the_rest() {
    let a = node(None).await;
    a.create("kept", 128 << 20).await;
    a.create("cut", 128 << 20).await;
    let (dir, id) = (a.dir.clone(), a.id.clone());
    let mut a = a;
    if let Some(running) = a.node.take() {
        running.stop().await;
    }
    // As if the node died between starting the container and writing its record.
    std::fs::remove_file(dir.join("sandboxes/cut/sandbox.json")).unwrap();
    let mut config = NodeConfig::new("127.0.0.1:0".parse().unwrap(), &id, &dir);
    config.runtime = RuntimeKind::Container { oci_runtime: None };
    a.node = Some(node_svc::server::start(config).await.unwrap());
    assert!(
        !dir.join("sandboxes/cut").exists(),
        "the folder of the create cut short is gone"
    );
    assert!(
        !node_svc::runtime::container::run_dir(&dir).join("runtime/cut").exists(),
        "and its container"
    );
    let cgroups = std::fs::read_dir("/sys/fs/cgroup")
        .unwrap()
        .flatten()
        .map(|h| h.path().join(format!("sandboxsched-{id}")).join("cut"))
        .filter(|p| p.exists())
        .collect::<Vec<_>>();
    assert!(cgroups.is_empty(), "its groups: {cgroups:?}");
    let (out, code) = a.sh("kept", "user", "echo still").await;
    assert_eq!(
        (out.as_str(), code),
        ("still\n", 0),
        "the sandbox with a record was adopted"
    );
    a.stop().await;
}

/// Free bytes of the filesystem holding `path`, for an unprivileged writer.
fn free_bytes(path: &std::path::Path) -> u64 {
    let stat = rustix::fs::statvfs(path).unwrap();
    stat.f_bavail * stat.f_frsize
}

/// A sandbox fills its own disk and nothing else: `df` inside shows its size, not the host's;
/// writing past it fails with ENOSPC inside, as does making files past its inodes; the host's
/// free space loses at most the disk's size, and the sandbox beside it writes on. The size is
/// the sandbox's wherever it goes: restored on a node whose default is four times larger, it
/// has the same disk and its files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_fills_its_own_disk_and_nothing_else() {
    const DISK_MB: u64 = 64;
    let a = node_configured(None, |c| c.host.disk_bytes = DISK_MB << 20).await;
    let b = node_configured(None, |c| c.host.disk_bytes = (4 * DISK_MB) << 20).await;
    a.create("filler", 128 << 20).await;
    a.create("neighbour", 128 << 20).await;
    let df = "df -k / | tail -1 | awk '{print $2}'";
    let size_kb = |out: &str| out.trim().parse::<u64>().unwrap_or_else(|_| panic!("df said {out:?}"));
    let (out, _) = a.sh("filler", "user", df).await;
    assert!(
        (DISK_MB * 1024 * 3 / 4..=DISK_MB * 1024).contains(&size_kb(&out)),
        "df inside shows {out} KiB, not the sandbox's {DISK_MB} MiB"
    );

    let host_free = free_bytes(&a.dir);
    let (out, _) = a
        .sh(
            "filler",
            "user",
            "dd if=/dev/zero of=/home/user/big bs=1M count=512 2>&1; echo rc=$?",
        )
        .await;
    assert!(
        out.contains("No space left on device") && out.contains("rc=1"),
        "writing 512 MiB into a {DISK_MB} MiB disk: {out}"
    );
    let taken = host_free.saturating_sub(free_bytes(&a.dir));
    assert!(taken < (DISK_MB + 32) << 20, "the host lost {} MiB", taken >> 20);
    let (out, code) = a
        .sh("neighbour", "user", "echo fine > /home/user/x && cat /home/user/x")
        .await;
    assert_eq!((out.as_str(), code), ("fine\n", 0), "the neighbour writes on");

    // Inodes: one per 16 KiB of disk, then ENOSPC however little is written.
    let files = "rm -f /home/user/big; python3 -c '\nimport os\nn = 0\ntry:\n    while True:\n        open(\"/tmp/f%d\" % n, \"w\").close(); n += 1\nexcept OSError as e:\n    print(n, e.errno)\n'";
    let (out, code) = a.sh("filler", "root", files).await;
    let (made, errno) = out.trim().split_once(' ').unwrap_or_else(|| panic!("{out} ({code})"));
    assert_eq!(errno, "28", "ENOSPC: {out}");
    let made: u64 = made.parse().unwrap();
    assert!(
        made <= (DISK_MB << 20) / (16 << 10),
        "{made} files in a {DISK_MB} MiB disk"
    );

    let (_, code) = a
        .sh("filler", "root", "rm -f /tmp/f*; echo kept > /home/user/kept")
        .await;
    assert_eq!(code, 0);
    move_sandbox(&a, &b, "filler").await;
    let (out, code) = b.sh("filler", "user", &format!("cat /home/user/kept; {df}")).await;
    assert_eq!(code, 0, "{out}");
    let (kept, size) = out.split_once('\n').unwrap();
    assert_eq!(kept, "kept");
    assert!(size_kb(size) <= DISK_MB * 1024, "moved, its disk became {size} KiB");
    a.stop().await;
    b.stop().await;
}

/// A set-uid binary a sandbox's root leaves in its files gives a host user nothing: the
/// sandboxes' folders are the node's alone, and the disks they sit on are mounted nosuid.
/// Before, a local user ran such a copy as the sandbox's host uid and read what that uid owns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_uid_binary_from_a_sandbox_is_no_way_up_on_the_host() {
    let n = node(None).await;
    n.create("planter", 128 << 20).await;
    let (out, code) = n
        .sh(
            "planter",
            "root",
            "cp /usr/bin/id /home/user/sid && chmod 4755 /home/user/sid && ls -l /home/user/sid",
        )
        .await;
    assert_eq!(code, 0, "{out}");
    let planted = n.running().host().home("planter").join("home/user/sid");
    assert!(planted.exists());
    let run = as_nobody(&format!("{} -u", planted.display()));
    assert!(
        !run.status.success(),
        "nobody ran the planted binary: {}",
        String::from_utf8_lossy(&run.stdout)
    );
    // Even reached (a copy an operator made readable), it runs as its caller.
    let reachable = std::env::temp_dir().join(format!("sid-{}", n.id));
    std::fs::create_dir_all(&reachable).unwrap();
    let mount = n.running().host().sandbox_dir("planter").join("disk");
    let status = std::process::Command::new("mount")
        .args(["--bind"])
        .arg(&mount)
        .arg(&reachable)
        .status()
        .unwrap();
    assert!(status.success());
    let run = as_nobody(&format!("{} -u", reachable.join("home/home/user/sid").display()));
    let _ = std::process::Command::new("umount").arg(&reachable).status();
    let _ = std::fs::remove_dir_all(&reachable);
    assert_eq!(
        String::from_utf8_lossy(&run.stdout).trim(),
        "65534",
        "the set-uid bit took effect on the host: {run:?}"
    );
    n.stop().await;
}

/// What a server on a sandbox's port receives carries none of the tokens that let the request
/// in: the node checks them and keeps them (they would let whatever runs inside act as the
/// sandbox's owner wherever the token is accepted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_reaches_a_server_inside_the_sandbox() {
    const ECHO_HEADERS: &str = r#"
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = str(self.headers).lower().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", 8082), H).serve_forever()
"#;
    let n = node(None).await;
    n.create("listener", 256 << 20).await;
    let start = format!("cat > /tmp/h.py <<'PY'\n{ECHO_HEADERS}\nPY\nnohup python3 /tmp/h.py >/dev/null 2>&1 &");
    let (_, code) = n.sh("listener", "user", &start).await;
    assert_eq!(code, 0);
    let mut seen = None;
    for _ in 0..100 {
        let response = n
            .port("listener", 8082, "/")
            .header("X-Access-Token", token_of("listener"))
            .header("E2b-Traffic-Access-Token", "traffic-secret")
            .header("X-Plain", "kept")
            .send()
            .await
            .unwrap();
        if response.status() == 200 {
            seen = Some(response.text().await.unwrap());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = seen.expect("the header echo never answered");
    assert!(seen.contains("x-plain: kept"), "{seen}");
    assert!(
        !seen.contains("x-access-token") && !seen.contains(&token_of("listener")),
        "the envd token went inside: {seen}"
    );
    assert!(
        !seen.contains("traffic-secret"),
        "the traffic token went inside: {seen}"
    );
    n.stop().await;
}

/// A sandbox whose envd dies (here killed from the host, as the OOM killer would) is not left
/// listed as running with nothing answering: the node starts it again within a sampling
/// interval, its files kept, and says so in its log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_whose_envd_died_is_started_again() {
    let n = node_configured(None, |c| c.sample_interval = Duration::from_millis(200)).await;
    n.create("fragile", 256 << 20).await;
    let (_, code) = n.sh("fragile", "user", "echo kept > /home/user/kept").await;
    assert_eq!(code, 0);
    let host = n.running().host();
    let before = host.get("fragile").await.expect("the sandbox").pgid;
    // SIGKILL to the sandbox's envd (its init), a process of this test's host.
    let envd = rustix::process::Pid::from_raw(before as i32).expect("envd's PID");
    rustix::process::kill_process(envd, rustix::process::Signal::KILL).unwrap();
    let mut after = before;
    for _ in 0..200 {
        after = host.get("fragile").await.expect("still listed").pgid;
        if after != before && after != 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_ne!(after, before, "the node never noticed its envd had died");
    let (out, code) = n.sh("fragile", "user", "cat /home/user/kept").await;
    assert_eq!((out.as_str(), code), ("kept\n", 0));
    let log = std::fs::read_to_string(host.sandbox_dir("fragile").join("container.log")).unwrap();
    assert!(log.contains("envd died"), "{log}");
    n.stop().await;
}

/// The PIDs of the jail helpers serving the node whose state folder is `dir` (their command
/// line names that node's runtime root).
fn jail_helpers(dir: &std::path::Path) -> Vec<i32> {
    let root = node_svc::runtime::container::run_dir(dir).join("runtime");
    let root = root.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.iter().any(|a| a == "helper") && args.contains(&root) {
            found.push(pid);
        }
    }
    found
}

/// The node's own runtime starts containers through one helper process (no runtime process
/// per create). That helper holds nothing of the node's but its control socket and the
/// standard streams; killed, it is replaced by the next create, which succeeds, and a
/// sandbox started before it died keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_runtime_helper_died_starts_another_at_the_next_create() {
    let n = node(None).await;
    n.create("before", 256 << 20).await;
    let helpers = jail_helpers(&n.dir);
    assert_eq!(helpers.len(), 1, "one helper after the first create: {helpers:?}");
    let helper = helpers[0];
    // The helper answers a run before it drops that run's descriptors (its reply socket,
    // pidfd and copy of the output), so those may outlive the answer by a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let fds: Vec<String> = std::fs::read_dir(format!("/proc/{helper}/fd"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        let mut fds: Vec<i32> = fds.iter().filter_map(|f| f.parse().ok()).collect();
        fds.sort();
        if fds == [0, 1, 2, 3] {
            break;
        }
        let what: Vec<String> = fds
            .iter()
            .map(|fd| format!("{fd}: {:?}", std::fs::read_link(format!("/proc/{helper}/fd/{fd}"))))
            .collect();
        assert!(
            std::time::Instant::now() < deadline,
            "the helper's descriptors: stdio and its socket only: {what:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    n.create("second", 256 << 20).await;
    assert_eq!(
        jail_helpers(&n.dir),
        vec![helper],
        "the same helper serves every create"
    );

    let pid = rustix::process::Pid::from_raw(helper).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    n.create("after", 256 << 20).await;
    let now = jail_helpers(&n.dir);
    assert!(
        now.len() == 1 && now[0] != helper,
        "a new helper: {now:?} (was {helper})"
    );
    for sandbox in ["before", "second", "after"] {
        let (out, code) = n.sh(sandbox, "user", "echo alive").await;
        assert_eq!((out.as_str(), code), ("alive\n", 0), "{sandbox}");
    }
    n.stop().await;
}

/// Whether the mount holding `path` in this process's table propagates to others (it is
/// shared: `shared:N` among its optional fields).
fn propagates(path: &std::path::Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines()
        .filter_map(|l| {
            let point = PathBuf::from(l.split(' ').nth(4)?);
            path.starts_with(&point)
                .then(|| (point.components().count(), l.contains(" shared:")))
        })
        .max_by_key(|(depth, _)| *depth)
        .is_some_and(|(_, shared)| shared)
}

/// The mount points of process `pid`'s (or `self`'s) mount table.
fn mount_points(pid: &str) -> Vec<PathBuf> {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .collect()
}

/// A sandbox's root is in no mount table but its container's: not the node's (which keeps the
/// sandbox's disk), not the runtime helper's (which holds no root, and no disk but where the
/// host's mounts propagate: so a create never becomes the last holder of a killed sandbox's
/// file systems), and from inside a sandbox no other sandbox's mount is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxs_root_is_mounted_in_its_container_alone() {
    let n = node(None).await;
    n.create("one", 256 << 20).await;
    n.create("two", 256 << 20).await;
    let sandboxes = node_svc::runtime::layout::sandboxes_dir(&n.dir);
    let run = node_svc::runtime::container::run_dir(&n.dir);
    let ours = mount_points("self");
    let disk = sandboxes.join("one").join("disk");
    assert!(
        ours.contains(&disk),
        "the node's table holds the sandbox's disk (so this test sees the node's mounts): {ours:?}"
    );
    assert!(
        !ours.iter().any(|p| p.starts_with(&run) && p != &run),
        "no root (nor anything else) mounted in the node's run folder: {ours:?}"
    );
    let helpers = jail_helpers(&n.dir);
    assert_eq!(helpers.len(), 1, "{helpers:?}");
    let theirs = mount_points(&helpers[0].to_string());
    assert!(
        !theirs.iter().any(|p| p.starts_with(&run) && p != &run),
        "the helper's table holds no root: {theirs:?}"
    );
    // The helper started at the first create, after that sandbox's disk was mounted: that
    // disk is detached from its table on any host. Disks mounted later reach its table where
    // the host's mounts propagate (their unmounts then do too); where they do not, none is.
    assert!(
        !theirs.contains(&disk),
        "the helper's table holds the first sandbox's disk: {theirs:?}"
    );
    if !propagates(&sandboxes) {
        assert!(
            !theirs.iter().any(|p| p.starts_with(&sandboxes)),
            "the helper's table holds no sandbox's disk: {theirs:?}"
        );
    }
    let (out, code) = n.sh("two", "root", "cat /proc/self/mountinfo").await;
    assert_eq!(code, 0, "{out}");
    assert!(
        !out.contains("/one/") && !out.contains("/sandboxes/one"),
        "a sandbox's table names no other sandbox: {out}"
    );
    // Both still run, and a kill and a create after it work as before.
    n.lifecycle("one", "kill").await;
    n.create("three", 256 << 20).await;
    for sandbox in ["two", "three"] {
        let (out, code) = n.sh(sandbox, "user", "echo alive").await;
        assert_eq!((out.as_str(), code), ("alive\n", 0), "{sandbox}");
    }
    n.stop().await;
}

/// What the hog runs (as the sandbox's root, with `python3` from the host's `/usr`): it forks
/// children that each open files up to their own descriptor limit, until together they hold
/// `argv[1]` or one is refused for another reason; then it reserves AIO events with
/// `io_setup(65536)` four times (the kernel's default table is 65,536 for the whole host) and
/// opens terminals until refused. It writes what it got to the FIFO `argv[2]` and holds it all.
const HOG: &str = r#"
import ctypes, errno, os, resource, signal, sys
target = int(sys.argv[1])
# Opened first: a host whose table fills must not keep the hog from saying so.
out = open(sys.argv[2], "w")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
name = lambda e: errno.errorcode.get(e, str(e))
files, files_err = 0, "-"
while files < target and files_err in ("-", "EMFILE"):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        n, err = 0, "EMFILE"
        try:
            for _ in range(min(hard - 16, target - files)):
                os.open("/dev/null", os.O_RDONLY)
                n += 1
        except OSError as e:
            err = name(e.errno)
        os.write(w, f"{n} {err}".encode())
        signal.pause()
    os.close(w)
    n, files_err = os.read(r, 100).decode().split()
    files += int(n)
libc = ctypes.CDLL(None, use_errno=True)
aio, aio_err = 0, "-"
for _ in range(4):
    ctx = ctypes.c_ulong(0)
    if libc.syscall(206, 65536, ctypes.byref(ctx)) != 0:
        aio_err = name(ctypes.get_errno())
        break
    aio += 65536
ptys, ptys_err = [], "-"
try:
    while len(ptys) < 4096:
        ptys.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
except OSError as e:
    ptys_err = name(e.errno)
out.write(f"files={files} {files_err} aio={aio} {aio_err} ptys={len(ptys)} {ptys_err}\n")
out.flush()
signal.pause()
"#;

/// What the neighbour checks it can still do: open files, set up AIO and open a terminal.
const NEIGHBOUR: &str = r#"
import ctypes, os
fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(100)]
libc = ctypes.CDLL(None, use_errno=True)
ctx = ctypes.c_ulong(0)
assert libc.syscall(206, 4096, ctypes.byref(ctx)) == 0, f"io_setup: errno {ctypes.get_errno()}"
os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
print("neighbour ok")
"#;

/// One sandbox cannot use up the host's tables of open files, AIO events or terminals for the
/// others (the kernel counts those host-wide, not per namespace or cgroup; see
/// `node_svc::runtime::host_tables`). The hog holds more files than the kernel's default table on
/// this host (about one per 10 KiB of memory) and four times its default AIO events, within
/// its own memory; its terminals stop at its own cap; and while it holds all of that the
/// neighbour still opens files, sets up AIO and gets a terminal. Before the node raised the
/// tables, the hog was refused with ENFILE at the host's 2.47 M files (24 GiB), its second
/// `io_setup` with EAGAIN, and the neighbour could do none of the three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_filling_the_hosts_tables_leaves_its_neighbour_their_own() {
    let memory = node_svc::runtime::host_tables::host_memory_bytes().expect("the host's memory");
    // The kernel's default: a tenth of memory, in KiB (2.47 M on 24 GiB), and a tenth more;
    // at most 3 M, so that the test stays bounded on a large host (where it then holds fewer
    // than the default table, and tests only the hog's room). A file costs the hog about 256
    // bytes; its forked children (one per hard descriptor limit's worth) a little each.
    let files = (memory / 1024 / 10 * 11 / 10).min(3_000_000);
    let n = node(None).await;
    n.create("hog", files * 256 * 13 / 10 + (1 << 30)).await;
    n.create("neighbour", 256 << 20).await;
    let script = format!(
        "mkfifo /tmp/got && (python3 -c '{HOG}' {files} /tmp/got </dev/null >/tmp/hog.log 2>&1 &) && read got < /tmp/got && echo \"$got\"; cat /tmp/hog.log; true"
    );
    let (out, code) = n.sh("hog", "root", &script).await;
    assert_eq!(code, 0, "{out}");
    let got: Vec<&str> = out.lines().next().unwrap_or_default().split_whitespace().collect();
    assert_eq!(got.len(), 6, "the hog said {out:?}");
    assert_eq!(got[0], format!("files={files}"), "the hog was refused files: {out}");
    assert_eq!(got[2], "aio=262144", "the hog was refused AIO events: {out}");
    assert_eq!(
        (got[4], got[5]),
        (
            format!("ptys={}", node_svc::runtime::host_tables::PTYS_PER_SANDBOX).as_str(),
            "ENOSPC"
        ),
        "the hog's terminals did not stop at its own cap: {out}"
    );
    let (out, code) = n
        .sh("neighbour", "user", &format!("python3 -c '{NEIGHBOUR}' 2>&1"))
        .await;
    assert_eq!(
        (out.as_str(), code),
        ("neighbour ok\n", 0),
        "while the hog holds its share"
    );
    n.lifecycle("hog", "kill").await;
    n.stop().await;
}

/// What the hog takes of the counts the kernel keeps per user (inotify instances, queued
/// signals): all it may, held; it says how many it got.
const PER_USER_HOG: &str = r#"
import ctypes, errno, os, signal, sys
# Opened first: whatever happens next, the hog says so.
out = open(sys.argv[1], "w")
libc = ctypes.CDLL(None, use_errno=True)
name = lambda e: errno.errorcode.get(e, str(e))
fds, ino_err = [], "-"
while len(fds) < 100000:
    fd = libc.inotify_init()
    if fd < 0:
        ino_err = name(ctypes.get_errno())
        break
    fds.append(fd)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
queued, sig_err = 0, "-"
while queued < 1000000:
    if libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0)) != 0:
        sig_err = name(ctypes.get_errno())
        break
    queued += 1
out.write(f"inotify={len(fds)} {ino_err} signals={queued} {sig_err}\n")
out.flush()
signal.pause()
"#;

/// What a neighbour (or the host's root) checks it can still do: an inotify instance and a
/// queued real-time signal (`sigqueue`: a `kill` that finds the queue full is not refused,
/// it only loses the signal's information).
const PER_USER_NEIGHBOUR: &str = r#"
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
assert libc.inotify_init() >= 0, f"inotify_init: errno {ctypes.get_errno()}"
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
assert libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0)) == 0, f"sigqueue: errno {ctypes.get_errno()}"
print("ok")
"#;

/// The kernel charges what a user holds (inotify instances, queued signals, message queues)
/// up the chain of user namespaces, to each namespace's owner: a sandbox's namespace owned by
/// the host's root would put every sandbox's on root's one count, so one sandbox could use up
/// the others' and the host's. Each sandbox's namespace is owned by its own host root id, so
/// the hog stops at its own counts while a neighbour, linked or not, and the host's root go
/// on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_using_up_its_per_user_counts_leaves_the_others_theirs() {
    let n = node(None).await;
    n.create("hog", 512 << 20).await;
    n.create("neighbour", 256 << 20).await;
    n.create_with("linked", 256 << 20, internet()).await;
    let script = format!(
        "mkfifo /tmp/got && (python3 -c '{PER_USER_HOG}' /tmp/got </dev/null >/tmp/hog.log 2>&1 &) && read got < /tmp/got && echo \"$got\"; cat /tmp/hog.log; true"
    );
    let (out, code) = n.sh("hog", "root", &script).await;
    assert_eq!(code, 0, "{out}");
    // It took all its counts allowed it (the host's limits per user: 128 inotify instances
    // and the node's RLIMIT_SIGPENDING on a stock host), and was refused for its own.
    let got: Vec<&str> = out.lines().next().unwrap_or_default().split_whitespace().collect();
    let count = |field: &str, name: &str| field.strip_prefix(name).and_then(|n| n.parse::<u64>().ok());
    assert!(
        matches!(got[..], [i, "EMFILE", s, "EAGAIN"] if count(i, "inotify=").is_some_and(|n| n >= 64) && count(s, "signals=").is_some_and(|n| n >= 1_000)),
        "the hog did not use up its counts: {out}"
    );
    for neighbour in ["neighbour", "linked"] {
        let (out, code) = n
            .sh(neighbour, "user", &format!("python3 -c '{PER_USER_NEIGHBOUR}' 2>&1"))
            .await;
        assert_eq!(
            (out.as_str(), code),
            ("ok\n", 0),
            "{neighbour}, while the hog holds its counts"
        );
    }
    // The host's root: a queued signal (its inotify instances are whatever else on this
    // machine left of its 128, which says nothing of the hog).
    let host_signal = r#"
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
assert libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0)) == 0, f"sigqueue: errno {ctypes.get_errno()}"
print("ok")
"#;
    let host = std::process::Command::new("python3")
        .args(["-c", host_signal])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&host.stdout),
        "ok\n",
        "the host's root, while the hog holds its counts: {}",
        String::from_utf8_lossy(&host.stderr)
    );
    n.lifecycle("hog", "kill").await;
    n.stop().await;
}

/// One sandbox cannot fill the host's connection-tracking table, which is one for the whole
/// host and charged to no sandbox: the hog sends a datagram to 600 more ports of the internet
/// than its cap, each a flow of its own, and the host's table holds its cap of them, while
/// its neighbour still connects. Without the cap every one of the hog's flows was in the table
/// (checked by hand).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_holds_its_share_of_the_hosts_connection_table_and_no_more() {
    use node_svc::runtime::container::network::FLOWS_PER_SANDBOX;
    let world = Internet::start();
    let n = node(None).await;
    n.create_with("hog", 256 << 20, internet()).await;
    n.create_with("neighbour", 256 << 20, internet()).await;
    let flows = FLOWS_PER_SANDBOX + 600;
    let hog = format!(
        "python3 -c \"
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for port in range(20000, 20000 + {flows}):
    s.sendto(b'x', ('{INTERNET}', port))
me = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
me.connect(('{INTERNET}', 9))
print(me.getsockname()[0], s.getsockname()[1])
\""
    );
    let (out, code) = n.sh("hog", "root", &hog).await;
    assert_eq!(code, 0, "{out}");
    let (address, port) = out
        .trim()
        .split_once(' ')
        .unwrap_or_else(|| panic!("the hog said {out:?}"));
    // The host's table, as it stands now (an unanswered datagram's entry lasts 30 s), and
    // only this run's flows (an earlier run's sandbox may have had the same address).
    let table = std::fs::read_to_string("/proc/net/nf_conntrack").unwrap();
    let held = table
        .lines()
        .filter(|l| l.contains(" udp ") && l.contains(&format!("src={address} dst={INTERNET} sport={port} ")))
        .count() as u32;
    // At most its cap; and nearly all of it (a slot's last sandbox's flows, forgotten at its
    // kill, may count until the kernel collects them, a few at each new flow).
    assert!(
        (FLOWS_PER_SANDBOX - 64..=FLOWS_PER_SANDBOX).contains(&held),
        "the hog ({address}) holds {held} of the host's flows (cap {FLOWS_PER_SANDBOX})"
    );
    let (out, code) = n.sh("neighbour", "user", &world.probe()).await;
    assert_eq!(code, 0, "the neighbour could not connect: {out}");
    assert!(out.starts_with("from "), "{out}");
    n.stop().await;
}

/// A floor left by a node of another version, whose count of flows was made otherwise (the
/// transaction that keeps the count is then refused whole): the next node replaces the table
/// whole, and its sandboxes reach out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_of_another_version_is_replaced_whole() {
    let nft = |script: &str| {
        let mut child = std::process::Command::new("nft")
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), script.as_bytes()).unwrap();
        assert!(child.wait().unwrap().success(), "nft -f: {script}");
    };
    nft("add table inet sandboxsched\ndelete table inet sandboxsched\ntable inet sandboxsched {\n  set flows {\n    type ipv4_addr\n    size 65535\n    flags dynamic\n  }\n}\n");
    let world = Internet::start();
    let n = node(None).await;
    let listed = std::process::Command::new("nft")
        .args(["list", "set", "inet", "sandboxsched", "flows"])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.contains("type ifname"), "{listed}");
    n.create_with("out", 256 << 20, internet()).await;
    let (out, code) = n.sh("out", "user", &world.probe()).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("from "), "{out}");
    n.stop().await;
}

/// A local user of the host (here `nobody`) reads the command lines of a sandbox's processes
/// through the host's `/proc` exactly when the node says so: where `/proc` is not mounted
/// with `hidepid`, the node reports it as a degraded feature, and the user finds the
/// tenant's secret; where it is, the user finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_user_reads_sandboxes_command_lines_only_where_the_node_says_so() {
    let n = node(None).await;
    n.create("seen", 256 << 20).await;
    let started = "python3 -c 'import time; time.sleep(300)' tenant-secret-4711 >/dev/null 2>&1 &";
    let (out, code) = n.sh("seen", "user", started).await;
    assert_eq!(code, 0, "{out}");
    let says_exposed = n
        .running()
        .host()
        .features()
        .degraded
        .iter()
        .any(|d| d.contains("hidepid"));
    // The bracket keeps the search's own command line from matching itself.
    let search = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c 'tenant-secret-[4]711'";
    let count =
        |output: std::process::Output| -> u32 { String::from_utf8_lossy(&output.stdout).trim().parse().unwrap_or(0) };
    // The host's root sees every process: the tenant's is there before nobody looks.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while count(std::process::Command::new("sh").args(["-c", search]).output().unwrap()) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the tenant's process never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let count = count(as_nobody(search));
    assert_eq!(
        count > 0,
        says_exposed,
        "nobody found the secret {count} times; the node says exposed: {says_exposed}"
    );
    n.stop().await;
}
