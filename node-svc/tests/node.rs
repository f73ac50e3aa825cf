//! node-svc with real processes: lifecycle, pause that really stops, kill that leaves no
//! process, snapshot/restore across two nodes, re-adoption after a restart, operation IDs,
//! fencing, and heartbeats that reach a real placement-svc.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use node_svc::server::{NodeConfig, RunningNode};
use proto::node::v1 as pb;
use proto::node::v1::node_client::NodeClient;
use tonic::transport::Channel;
use tonic::Code;

const COUNTER: &str = "i=0; while :; do i=$((i+1)); echo $i > count.tmp; mv count.tmp count; sleep 0.01; done";
const MIB: u64 = 1 << 20;

struct TestNode {
    node: Option<RunningNode>,
    dir: PathBuf,
    node_id: String,
}

impl TestNode {
    async fn start(dir: Option<PathBuf>, node_id: Option<String>, placement: Option<String>) -> Self {
        let node_id = node_id.unwrap_or_else(|| format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
        let dir = dir.unwrap_or_else(|| std::env::temp_dir().join(format!("node-test-{node_id}")));
        let mut config = NodeConfig::new("127.0.0.1:0".parse().unwrap(), node_id.clone(), dir.clone());
        config.placement = placement;
        config.heartbeat_interval = Duration::from_millis(50);
        let node = node_svc::server::start(config).await.expect("node starts");
        Self {
            node: Some(node),
            dir,
            node_id,
        }
    }

    fn running(&self) -> &RunningNode {
        self.node.as_ref().expect("running")
    }

    async fn client(&self) -> NodeClient<Channel> {
        NodeClient::connect(self.running().endpoint()).await.expect("connect")
    }

    /// The folder a sandbox's start command runs in, seen from the host: `/home/user` in the
    /// sandbox's own layer.
    fn home(&self, id: &str) -> PathBuf {
        self.running().host().home(id).join("home/user")
    }

    /// Stops the server, keeping its state directory (sandboxes keep running).
    async fn stop(&mut self) {
        if let Some(node) = self.node.take() {
            node.stop().await;
        }
    }

    async fn cleanup(mut self) {
        if self.node.is_some() {
            let mut c = self.client().await;
            let list = c.list(pb::ListRequest {}).await.unwrap().into_inner();
            for s in list.sandboxes {
                // At the sandbox's own epoch: an older one would be fenced off.
                c.kill(lifecycle(&s.sandbox_id, "", s.epoch))
                    .await
                    .expect("cleanup kill");
            }
            self.stop().await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        node_svc::runtime::cgroup::remove_parents(&self.node_id);
    }
}

fn create(id: &str, start_command: &str) -> pb::CreateRequest {
    pb::CreateRequest {
        operation_id: format!("create-{id}"),
        epoch: 1,
        sandbox_id: id.into(),
        template: "base".into(),
        resources: Some(pb::Resources {
            vcpus: 1,
            memory_bytes: 256 * MIB,
            disk_bytes: 0,
        }),
        start_command: start_command.into(),
        env_vars: [("GREETING".to_string(), "hello".to_string())].into(),
        ..Default::default()
    }
}

fn lifecycle(id: &str, op: &str, epoch: u64) -> pb::LifecycleRequest {
    pb::LifecycleRequest {
        operation_id: op.into(),
        epoch,
        sandbox_id: id.into(),
    }
}

fn count(home: &Path) -> u64 {
    std::fs::read_to_string(home.join("count"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits (bounded) until the counter passes `above`: the processes are running.
fn await_count_above(home: &Path, above: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = count(home);
        if n > above {
            return n;
        }
        assert!(Instant::now() < deadline, "counter stuck at {n} (wanted > {above})");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_stops_resume_continues_kill_leaves_nothing() {
    let node = TestNode::start(None, None, None).await;
    let mut c = node.client().await;
    let info = c.create(create("counter", COUNTER)).await.unwrap().into_inner();
    assert_eq!(info.state, pb::SandboxState::Running as i32);
    assert!(info.pgid > 0);
    let home = node.home("counter");
    let before = await_count_above(&home, 3);

    c.pause(lifecycle("counter", "p1", 1)).await.unwrap();
    let frozen = count(&home);
    assert!(frozen >= before);
    // Paused means no progress at all, for many times the counter's period.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(count(&home), frozen, "a paused sandbox kept counting");

    c.resume(lifecycle("counter", "r1", 1)).await.unwrap();
    await_count_above(&home, frozen);

    let pgid = info.pgid;
    assert!(alive(pgid));
    let killed = c.kill(lifecycle("counter", "k1", 1)).await.unwrap().into_inner();
    assert_eq!(killed.state, pb::SandboxState::Killed as i32);
    assert!(!alive(pgid), "the start command survived kill");
    let orphans: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, r)| r.split_whitespace().nth(2)?.parse::<u32>().ok())
                    == Some(pgid)
            }) && alive(*pid)
        })
        .map(|p| p.to_string())
        .collect();
    assert!(
        orphans.is_empty(),
        "processes of the killed sandbox remain: {orphans:?}"
    );
    assert!(!home.exists(), "a killed sandbox's files remain");
    node.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_on_one_node_restores_on_another_with_its_files() {
    let a = TestNode::start(None, None, None).await;
    let b = TestNode::start(None, None, None).await;
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    // The sandbox writes its own notes: folders the host made in a running sandbox's layer
    // would be the host's, and its user could not write beside them.
    let start = format!("mkdir -p work && printf 'keep me' > work/notes.txt; {COUNTER}");
    ca.create(create("mover", &start)).await.unwrap();
    let home = a.home("mover");
    await_count_above(&home, 1);

    // A snapshot needs a paused sandbox.
    let refused = ca.snapshot(lifecycle("mover", "", 2)).await.err().map(|s| s.code());
    assert_eq!(refused, Some(Code::InvalidArgument));
    ca.pause(lifecycle("mover", "p", 2)).await.unwrap();
    let mut stream = ca.snapshot(lifecycle("mover", "", 2)).await.unwrap().into_inner();
    let mut chunks = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        chunks.push(chunk);
    }
    let Some(pb::snapshot_chunk::Part::Header(header)) = chunks[0].part.clone() else {
        panic!("the first chunk is the header")
    };
    assert!(matches!(
        chunks.last().unwrap().part,
        Some(pb::snapshot_chunk::Part::Trailer(_))
    ));

    // A corrupted stream is refused and leaves nothing behind.
    let mut corrupted: Vec<pb::RestoreChunk> = vec![pb::RestoreChunk {
        part: Some(pb::restore_chunk::Part::Header(pb::RestoreHeader {
            operation_id: "restore-bad".into(),
            epoch: 3,
            snapshot: Some(header.clone()),
        })),
    }];
    for chunk in &chunks[1..] {
        corrupted.push(pb::RestoreChunk {
            part: match chunk.part.clone() {
                Some(pb::snapshot_chunk::Part::Data(mut d)) => {
                    if let Some(byte) = d.get_mut(600) {
                        *byte ^= 0xff;
                    }
                    Some(pb::restore_chunk::Part::Data(d))
                }
                Some(pb::snapshot_chunk::Part::Trailer(t)) => Some(pb::restore_chunk::Part::Trailer(t)),
                _ => None,
            },
        });
    }
    let bad = cb.restore(tokio_stream::iter(corrupted)).await.unwrap_err();
    assert_eq!(bad.code(), Code::DataLoss, "{}", bad.message());
    assert!(cb
        .list(pb::ListRequest {})
        .await
        .unwrap()
        .into_inner()
        .sandboxes
        .is_empty());

    let mut restore: Vec<pb::RestoreChunk> = vec![pb::RestoreChunk {
        part: Some(pb::restore_chunk::Part::Header(pb::RestoreHeader {
            operation_id: "restore-1".into(),
            epoch: 3,
            snapshot: Some(header),
        })),
    }];
    for chunk in &chunks[1..] {
        restore.push(pb::RestoreChunk {
            part: match chunk.part.clone() {
                Some(pb::snapshot_chunk::Part::Data(d)) => Some(pb::restore_chunk::Part::Data(d)),
                Some(pb::snapshot_chunk::Part::Trailer(t)) => Some(pb::restore_chunk::Part::Trailer(t)),
                _ => None,
            },
        });
    }
    let restored = cb.restore(tokio_stream::iter(restore)).await.unwrap().into_inner();
    assert_eq!((restored.state, restored.epoch), (pb::SandboxState::Paused as i32, 3));
    let moved = b.home("mover");
    assert_eq!(
        std::fs::read_to_string(moved.join("work/notes.txt")).unwrap(),
        "keep me"
    );
    let at_move = count(&moved);
    // Resume on the target starts the start command afresh (process memory is not carried).
    cb.resume(lifecycle("mover", "r", 3)).await.unwrap();
    // The counter starts again from 1 (never touch a live sandbox's layer from the host: an
    // overlay mounted on it would see stale files), and passes where it was.
    await_count_above(&moved, at_move);
    assert!(at_move > 0);
    // The source copy is deleted last.
    ca.kill(lifecycle("mover", "k", 3)).await.unwrap();
    a.cleanup().await;
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_readopts_its_sandboxes() {
    let mut node = TestNode::start(None, None, None).await;
    let mut c = node.client().await;
    let info = c.create(create("survivor", COUNTER)).await.unwrap().into_inner();
    c.create(create("sleeper", COUNTER)).await.unwrap();
    c.pause(lifecycle("sleeper", "p", 1)).await.unwrap();
    let home = node.home("survivor");
    let before = await_count_above(&home, 1);

    node.stop().await;
    let (dir, id) = (node.dir.clone(), node.node_id.clone());
    let node = TestNode::start(Some(dir), Some(id), None).await;
    let mut c = node.client().await;
    let list = c.list(pb::ListRequest {}).await.unwrap().into_inner().sandboxes;
    let states: Vec<(String, i32, u32)> = list.iter().map(|s| (s.sandbox_id.clone(), s.state, s.pgid)).collect();
    assert_eq!(
        states,
        vec![
            ("sleeper".to_string(), pb::SandboxState::Paused as i32, states[0].2),
            ("survivor".to_string(), pb::SandboxState::Running as i32, info.pgid),
        ]
    );
    // The same processes carry on.
    await_count_above(&home, before);
    assert!(alive(info.pgid));
    c.kill(lifecycle("survivor", "k", 1)).await.unwrap();
    assert!(!alive(info.pgid));
    node.cleanup().await;
}

/// A sandbox that cannot be started again after a restart (its files gone, as on a host
/// that lost them) used to stop the whole node from starting, stranding every other sandbox
/// (found running a node in a Docker container). Now the node starts, keeps the others, and
/// lists the broken one with no process, so it stays accounted and a kill removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sandbox_that_cannot_come_back_does_not_keep_the_node_down() {
    let mut node = TestNode::start(None, None, None).await;
    let mut c = node.client().await;
    let kept = c.create(create("kept", COUNTER)).await.unwrap().into_inner();
    let broken = c.create(create("broken", COUNTER)).await.unwrap().into_inner();
    let broken_root = node_svc::runtime::container::run_dir(&node.dir).join("sandboxes/broken/rootfs");
    node.stop().await;
    // Its processes die with the host; its root's mount point is no longer a directory.
    let _ = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", broken.pgid)])
        .status();
    for _ in 0..100 {
        if !alive(broken.pgid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = std::process::Command::new("umount")
        .arg("-l")
        .arg(&broken_root)
        .status();
    std::fs::remove_dir_all(&broken_root).unwrap();
    std::fs::write(&broken_root, b"not a directory").unwrap();

    let (dir, id) = (node.dir.clone(), node.node_id.clone());
    let node = TestNode::start(Some(dir), Some(id), None).await;
    let mut c = node.client().await;
    let list = c.list(pb::ListRequest {}).await.unwrap().into_inner().sandboxes;
    let listed: Vec<(&str, u32)> = list.iter().map(|s| (s.sandbox_id.as_str(), s.pgid)).collect();
    assert_eq!(listed, vec![("broken", 0), ("kept", kept.pgid)], "{list:?}");
    assert!(alive(kept.pgid), "the other sandbox carries on");
    c.kill(lifecycle("broken", "k", 1)).await.unwrap();
    node.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operation_ids_and_epochs_guard_every_mutation() {
    let node = TestNode::start(None, None, None).await;
    let mut c = node.client().await;
    c.create(create("guarded", "")).await.unwrap();
    // A retried create with the same operation ID returns the first answer.
    let again = c.create(create("guarded", "")).await.unwrap().into_inner();
    assert_eq!(again.state, pb::SandboxState::Running as i32);
    // A new create of the same sandbox is refused.
    let mut second = create("guarded", "");
    second.operation_id = "another".into();
    assert_eq!(c.create(second).await.unwrap_err().code(), Code::AlreadyExists);

    let first = c.pause(lifecycle("guarded", "op-pause", 5)).await.unwrap().into_inner();
    c.resume(lifecycle("guarded", "op-resume", 5)).await.unwrap();
    // The retry answers as the first time (paused) and does not pause again.
    let retry = c.pause(lifecycle("guarded", "op-pause", 5)).await.unwrap().into_inner();
    assert_eq!(retry, first);
    let now = c
        .list(pb::ListRequest {})
        .await
        .unwrap()
        .into_inner()
        .sandboxes
        .remove(0);
    assert_eq!(now.state, pb::SandboxState::Running as i32);
    // The same ID for a different call is a client bug.
    let reused = c.kill(lifecycle("guarded", "op-pause", 5)).await.unwrap_err();
    assert_eq!(reused.code(), Code::InvalidArgument);

    // An older epoch is fenced off.
    let stale = c.pause(lifecycle("guarded", "op-stale", 4)).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition);
    assert_eq!(
        proto::reason::Reason::of(&stale),
        Some(proto::reason::Reason::StaleEpoch)
    );
    assert!(stale.message().contains("epoch 4"), "{}", stale.message());
    c.kill(lifecycle("guarded", "op-kill", 6)).await.unwrap();
    node.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_in_grpc_terms() {
    let node = TestNode::start(None, None, None).await;
    let mut c = node.client().await;
    assert_eq!(
        c.create(create("../escape", "")).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let mut no_memory = create("m", "");
    no_memory.resources = Some(pb::Resources {
        vcpus: 1,
        memory_bytes: 0,
        disk_bytes: 0,
    });
    assert_eq!(c.create(no_memory).await.unwrap_err().code(), Code::InvalidArgument);
    let mut unknown = create("t", "");
    unknown.template = "no-such-template".into();
    assert_eq!(c.create(unknown).await.unwrap_err().code(), Code::NotFound);
    assert_eq!(
        c.kill(lifecycle("ghost", "", 0)).await.unwrap_err().code(),
        Code::NotFound
    );
    assert!(c
        .list(pb::ListRequest {})
        .await
        .unwrap()
        .into_inner()
        .sandboxes
        .is_empty());
    let info = c.info(pb::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.runtime, "container");
    assert!(
        info.namespaces,
        "this host allows mount namespaces: {:?}",
        info.degraded
    );
    assert!(
        info.degraded.iter().all(|d| !d.contains("PID namespace")),
        "this host allows PID namespaces: {:?}",
        info.degraded
    );
    node.cleanup().await;
}

/// A placement-svc and a node heartbeating to it, with a client of placement.
async fn reporting_to_placement() -> (
    placement_svc::server::RunningPlacement,
    TestNode,
    proto::placement::v1::placement_client::PlacementClient<tonic::transport::Channel>,
) {
    let placement = placement_svc::server::start(placement_svc::server::PlacementConfig::new(
        "127.0.0.1:0".parse().unwrap(),
    ))
    .await
    .unwrap();
    let node = TestNode::start(None, None, Some(placement.endpoint())).await;
    let client = proto::placement::v1::placement_client::PlacementClient::connect(placement.endpoint())
        .await
        .unwrap();
    (placement, node, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_list_sandboxes_to_placement() {
    let (placement, node, mut p) = reporting_to_placement().await;
    let mut c = node.client().await;
    c.create(create("listed", "sleep 30")).await.unwrap();
    // Heartbeats come every 50 ms; wait (bounded) for one that lists the sandbox.
    let deadline = Instant::now() + Duration::from_secs(10);
    let view = loop {
        let nodes = p
            .nodes(proto::placement::v1::NodesRequest {})
            .await
            .unwrap()
            .into_inner()
            .nodes;
        if let Some(v) = nodes
            .into_iter()
            .find(|n| n.node_id == node.node_id && n.reported_sandboxes == 1)
        {
            break v;
        }
        assert!(Instant::now() < deadline, "no heartbeat listed the sandbox");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(view.reported.unwrap().memory_bytes, 256 * MIB);
    assert_eq!(view.address, node.running().endpoint());
    assert!(view.memory_used_bytes > 0);
    node.cleanup().await;
    placement.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_report_the_cpu_sandboxes_use() {
    let (placement, node, mut p) = reporting_to_placement().await;
    let node_id = node.node_id.clone();
    // Waits (bounded) for a heartbeat whose cpu_usage satisfies `ok`; returns the last seen.
    let mut usage_until = async |what: &str, ok: fn(f64) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let nodes = p
                .nodes(proto::placement::v1::NodesRequest {})
                .await
                .unwrap()
                .into_inner()
                .nodes;
            let usage = nodes.iter().find(|n| n.node_id == node_id).map_or(0.0, |n| n.cpu_usage);
            if ok(usage) {
                return usage;
            }
            assert!(Instant::now() < deadline, "cpu_usage never {what}: last {usage}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let mut c = node.client().await;
    c.create(create("spin", "while :; do :; done")).await.unwrap();
    // One busy loop: most of a core, on a machine other tests share.
    usage_until("rose above 0.3 vCPU", |u| u > 0.3).await;
    c.kill(lifecycle("spin", "kill-spin", 1)).await.unwrap();
    usage_until("fell below 0.1 vCPU", |u| u < 0.1).await;
    node.cleanup().await;
    placement.stop().await;
}
