//! The control plane's gRPC, tried from the attacker's side: a local user or network peer
//! without the cluster's certificates, one holding another cluster's, and a member of the
//! cluster calling what its role may not (a compromised node reaching for every tenant's
//! manifests, creating sandboxes on another node, draining nodes); and a real local user
//! (`nobody`) reaching for the certificates, the ledger's file and the blob store.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use ledger_client::{LedgerClient, LedgerError};
use mtls::{Role, Security};
use proto::balance::v1 as bpb;
use proto::node::v1 as npb;
use proto::placement::v1 as ppb;
use stack::Stack;

const CTL: &str = env!("CARGO_BIN_EXE_sandboxsched-ctl");
/// The unprivileged local user (`nobody`), by number: setpriv takes no names for groups.
const NOBODY: &str = "65534";

async fn started(dir: &std::path::Path) -> Stack {
    Stack::builder()
        .dir(dir)
        .node(|c| c.runtime = node_svc::server::RuntimeKind::Unisolated { cgroups: false })
        .balance(|_| {})
        .gateway(|_| {})
        .start()
        .await
        .expect("the stack starts")
}

/// Tries to create a document of `kind` as `writer`.
async fn forge(writer: &LedgerClient, kind: &str) -> Result<ledger_client::Committed, LedgerError> {
    writer
        .compare(
            ledger_client::Txn::new()
                .create(kind, "forged", &serde_json::json!({}))
                .unwrap(),
        )
        .await
}

fn code(status: Result<impl std::fmt::Debug, tonic::Status>) -> tonic::Code {
    status.expect_err("the call was let through").code()
}

#[tokio::test(flavor = "multi_thread")]
async fn internal_grpc_takes_only_the_cluster_and_each_role_only_its_own_calls() {
    let temp = tempfile::tempdir().unwrap();
    // A data directory as `up` makes one (0755, like ./data): the certificates' own
    // directory must be what keeps other users out.
    let data = temp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    let s = started(&data).await;
    let ledger = s.ledger_endpoint();
    let node = s.nodes[0].running.endpoint();
    let balance = s.balance.as_ref().unwrap().endpoint();
    let placement = s.placement_endpoint();

    // What a member may do still works: the operator reads, the gateway writes.
    let operator = LedgerClient::connect_lazy(&ledger, &s.security(Role::Operator)).unwrap();
    operator
        .list::<serde_json::Value>("sandboxes", "")
        .await
        .expect("the operator reads the ledger");

    // No TLS at all: the server never completes a call.
    let plain = LedgerClient::connect_lazy(&ledger, &Security::Plaintext).unwrap();
    let listed = plain.list::<serde_json::Value>("sandbox", "").await;
    assert!(listed.is_err(), "plaintext listed the manifests");

    // A certificate of another cluster (a CA the services do not trust).
    let other = tempfile::tempdir().unwrap();
    mtls::issue_cluster(other.path(), false).unwrap();
    let stranger = LedgerClient::connect_lazy(&ledger, &Security::load(other.path(), Role::Operator).unwrap()).unwrap();
    let listed = stranger.list::<serde_json::Value>("sandbox", "").await;
    assert!(listed.is_err(), "another cluster's certificate listed the manifests");

    // A node of this cluster, compromised: it reaches for what is not a node's.
    let compromised = s.certs.node("compromised").expect("a node's certificate");
    let as_node = |address: &str, peer: Role| compromised.endpoint(address, peer).unwrap().connect_lazy();
    let from_node = LedgerClient::connect_lazy(&ledger, &compromised).unwrap();
    let err = from_node.list::<serde_json::Value>("sandbox", "").await.unwrap_err();
    assert!(
        matches!(&err, LedgerError::Forbidden(m) if m.contains("node may not call")),
        "a node read every manifest: {err}"
    );
    let mut other_node = npb::node_client::NodeClient::new(as_node(&node, Role::Node));
    let created = other_node
        .create(npb::CreateRequest {
            operation_id: "attack".into(),
            epoch: 1,
            sandbox_id: "attack".into(),
            template: "base".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(created), tonic::Code::PermissionDenied);
    let mut to_balance = bpb::balance_client::BalanceClient::new(as_node(&balance, Role::Balance));
    let drained = to_balance
        .drain(bpb::DrainRequest {
            node_id: s.nodes[0].id.clone(),
            undo: false,
        })
        .await;
    assert_eq!(code(drained), tonic::Code::PermissionDenied);
    let mut to_placement = ppb::placement_client::PlacementClient::new(as_node(&placement, Role::Placement));
    assert_eq!(
        code(to_placement.place(ppb::PlaceRequest::default()).await),
        tonic::Code::PermissionDenied
    );
    // Nor may it report in another node's name: a heartbeat sets the address the gateway
    // sends that node's sandboxes' traffic (and tokens) to.
    let victim = s.nodes[0].id.clone();
    let forged = to_placement
        .heartbeat(ppb::HeartbeatRequest {
            node_id: victim.clone(),
            boot_id: "forged".into(),
            seq: u64::MAX / 2,
            address: "http://127.0.0.1:9".into(),
            capacity: Some(ppb::Resources {
                vcpus: 1024,
                memory_bytes: 1 << 40,
            }),
            ..Default::default()
        })
        .await;
    let refused = forged.expect_err("a node reported in another's name");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains(&victim), "{}", refused.message());
    let mut operator_to_placement = ppb::placement_client::PlacementClient::new(
        s.security(Role::Operator)
            .endpoint(&placement, Role::Placement)
            .unwrap()
            .connect_lazy(),
    );
    let listed = operator_to_placement
        .nodes(ppb::NodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    let seen = listed
        .iter()
        .find(|n| n.node_id == victim)
        .expect("the victim is listed");
    assert_eq!(seen.address, node, "the forged heartbeat moved the victim's address");
    // And a node's key answers for that node alone: a gateway that dials a node expecting
    // another refuses it (an address that leads to the wrong node, or to a thief of one
    // node's key, is not the node it meant), and takes it under its own name.
    let as_gateway = s.security(Role::Gateway);
    let mut impostor =
        npb::node_client::NodeClient::new(as_gateway.node_endpoint(&node, "node-other").unwrap().connect_lazy());
    assert_eq!(code(impostor.info(npb::InfoRequest {}).await), tonic::Code::Unavailable);
    let mut genuine =
        npb::node_client::NodeClient::new(as_gateway.node_endpoint(&node, &victim).unwrap().connect_lazy());
    genuine
        .info(npb::InfoRequest {})
        .await
        .expect("the node answers in its own name");

    // A service writes only the kinds of documents it owns: a compromised gateway forges no
    // balance plan, a compromised placement points no manifest at a node of its choosing.
    for (role, kind) in [
        (Role::Gateway, "balance-plan"),
        (Role::Placement, "sandbox"),
        (Role::Balance, "node"),
    ] {
        let writer = LedgerClient::connect_lazy(&ledger, &s.security(role)).unwrap();
        let forged = forge(&writer, kind).await;
        assert!(
            matches!(&forged, Err(LedgerError::Forbidden(m)) if m.contains(&format!("{role} may not write {kind}"))),
            "{role} wrote a {kind} document: {forged:?}"
        );
        assert!(operator
            .get::<serde_json::Value>(kind, "forged")
            .await
            .unwrap()
            .is_none());
    }

    // The gateway may create on a node, but may not drain.
    let mut gateway_to_balance = bpb::balance_client::BalanceClient::new(
        s.security(Role::Gateway)
            .endpoint(&balance, Role::Balance)
            .unwrap()
            .connect_lazy(),
    );
    assert_eq!(
        code(gateway_to_balance.status(bpb::StatusRequest {}).await),
        tonic::Code::PermissionDenied
    );
    // The console, taken over: it reads and drains as the operator does, but writes no
    // document (the operator's key may, the console's may not even call Compare) and cannot
    // declare a move's target dead, nor create on a node.
    let console = s.security(Role::Console);
    let console_ledger = LedgerClient::connect_lazy(&ledger, &console).unwrap();
    console_ledger
        .list::<serde_json::Value>("sandbox", "")
        .await
        .expect("the console reads the manifests");
    for kind in ["sandbox", "node", "balance-control", "pool"] {
        let forged = forge(&console_ledger, kind).await;
        // Refused before any kind is looked at: the console may not call Compare at all.
        assert!(
            matches!(&forged, Err(LedgerError::Forbidden(m)) if m.contains("console may not call") && m.contains("Compare")),
            "the console wrote a {kind} document: {forged:?}"
        );
    }
    let mut console_to_balance =
        bpb::balance_client::BalanceClient::new(console.endpoint(&balance, Role::Balance).unwrap().connect_lazy());
    console_to_balance
        .status(bpb::StatusRequest {})
        .await
        .expect("the console reads the balancer's status");
    assert_eq!(
        code(
            console_to_balance
                .release_target(bpb::ReleaseTargetRequest {
                    plan_id: "any".into(),
                    move_index: 0,
                })
                .await
        ),
        tonic::Code::PermissionDenied
    );
    let mut console_to_node =
        npb::node_client::NodeClient::new(console.node_endpoint(&node, &victim).unwrap().connect_lazy());
    console_to_node
        .logs(npb::LogsRequest::default())
        .await
        .expect("the console reads a sandbox's log");
    assert_eq!(
        code(console_to_node.create(npb::CreateRequest::default()).await),
        tonic::Code::PermissionDenied
    );
    assert_eq!(
        code(console_to_node.list(npb::ListRequest::default()).await),
        tonic::Code::PermissionDenied
    );
    // It drains through the balancer, which plans around a drain; it may not set a node's
    // state behind the balancer's back.
    let mut console_to_placement = ppb::placement_client::PlacementClient::new(
        console.endpoint(&placement, Role::Placement).unwrap().connect_lazy(),
    );
    assert_eq!(
        code(
            console_to_placement
                .set_node_state(ppb::SetNodeStateRequest {
                    node_id: victim.clone(),
                    state: ppb::NodeState::Draining as i32,
                })
                .await
        ),
        tonic::Code::PermissionDenied
    );

    // A client that dials the right port but expects another role refuses the server: a
    // ledger is not a node, whatever address it answers on.
    let mut confused = npb::node_client::NodeClient::new(
        s.security(Role::Gateway)
            .endpoint(&ledger, Role::Node)
            .unwrap()
            .connect_lazy(),
    );
    assert_eq!(code(confused.info(npb::InfoRequest {}).await), tonic::Code::Unavailable);

    // A real local user: the certificates are out of its reach, and without them ctl gets
    // nothing, in TLS or in clear. (The operator, with them, gets the table.)
    let certs = s.certs.dir().unwrap().to_path_buf();
    assert_eq!(std::fs::metadata(&certs).unwrap().permissions().mode() & 0o777, 0o700);
    // The user must be able to run ctl itself (the build tree may be closed to it), so that
    // every refusal below is the cluster's.
    let ctl = temp.path().join("sandboxsched-ctl");
    std::fs::copy(CTL, &ctl).unwrap();
    std::fs::set_permissions(&ctl, std::fs::Permissions::from_mode(0o755)).unwrap();
    let ctl_as = |user: Option<&str>, extra: &[&str]| {
        let mut command = match user {
            Some(user) => {
                let mut c = Command::new("setpriv");
                c.args(["--reuid", user, "--regid", user, "--clear-groups", "--"])
                    .arg(&ctl);
                c
            }
            None => Command::new(&ctl),
        };
        let out = command
            .args(["--json", "--ledger", &ledger, "--tls-dir"])
            .arg(&certs)
            .args(extra)
            .arg("sandboxes")
            .output()
            .expect("setpriv and sandboxsched-ctl run");
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, stderr) = ctl_as(None, &[]);
    assert!(ok, "the operator's ctl failed: {stderr}");
    let (ok, stderr) = ctl_as(Some(NOBODY), &[]);
    assert!(
        !ok && stderr.contains("operator's certificate") && stderr.contains("Permission denied"),
        "nobody read the certificates: {stderr}"
    );
    let (ok, stderr) = ctl_as(Some(NOBODY), &["--insecure-plaintext"]);
    assert!(
        !ok && stderr.contains("listing sandboxes"),
        "nobody listed every manifest in plaintext, or failed before asking: {stderr}"
    );
    // Nor does it read the ledger's file (every manifest) or the blob store behind the
    // services' backs.
    for (what, tool, path) in [
        ("the ledger's database", "cat", "ledger.db"),
        ("the blob store", "ls", "blobs"),
    ] {
        let path = data.join(path);
        assert!(path.exists(), "{}", path.display());
        let out = Command::new("setpriv")
            .args(["--reuid", NOBODY, "--regid", NOBODY, "--clear-groups", "--", tool])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success(), "nobody reached {what} with {tool}");
    }
    s.shut_down().await;
}
