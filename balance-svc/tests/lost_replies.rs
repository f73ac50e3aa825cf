//! Moves when replies are lost: fault proxies in front of the ledger and a target node apply
//! a request and drop its reply, or become unreachable right after, and each test checks the
//! invariant that matters there — never two running copies, never the live copy killed,
//! never a stale copy adopted.

mod support;

use std::time::Duration;

use balance_svc::record::{PlanDoc, Step, PLAN_KIND};
use common::docs::{SandboxDoc, SANDBOX_KIND};
use node_svc::sandbox::State;
use stack::fault::{writes, LedgerProxy, NodeProxy};
use support::cluster;

/// The switch's manifest write lands but its reply is lost. The executor must recognise its
/// own write, not roll back: a rollback from `TargetResumed` kills the copy the manifest now
/// names and resumes one that nothing names.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_switch_whose_reply_is_lost_is_recognised_not_rolled_back() {
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "switch", "sleep 600").await;
    let ledger = LedgerProxy::start(&cluster.stack.ledger_endpoint(), &cluster.stack.certs).await;
    let target_node = format!("\"node_id\":\"{}\"", cluster.node_id(1));
    ledger.faults.drop_compare_reply(
        move |r| writes(r, SANDBOX_KIND, &target_node) && writes(r, SANDBOX_KIND, "\"lifecycle_owner\":null"),
        1,
    );
    let plan_id = "0000000000000-lost-switch";
    cluster.plan_one(plan_id, "switch", 0, 1).await;
    let balance = cluster.balance_via(&ledger.endpoint()).await;
    let plan = cluster.finished_plan(plan_id).await;
    balance.stop().await;
    assert_eq!(ledger.faults.count("dropped"), 1, "the switch's reply was lost once");
    assert_eq!(plan.moves[0].step, Step::Done, "{plan:?}");
    cluster.assert_runs_once("switch", 1).await;
    ledger.stop().await;
    cluster.stop().await;
}

/// The target applies the resume, its reply is lost, and the target becomes unreachable.
/// The rollback cannot confirm the target's copy stopped, so the source must stay paused
/// (one running copy: the target's), and only once the target answers again is its copy
/// killed and the source resumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_target_that_may_run_is_stopped_before_the_source_resumes() {
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "twice", "sleep 600").await;
    let target = NodeProxy::start(
        &cluster.stack.nodes[1].id,
        &cluster.node(1).endpoint(),
        &cluster.stack.certs,
    )
    .await;
    target.faults.drop_reply_then_down("Resume", 1);
    let plan_id = "0000000000000-lost-resume";
    cluster.plan_one_via(plan_id, "twice", 0, 1, &target.endpoint()).await;
    let balance = cluster.balance(None).await;

    // The resume applied: the target runs its copy, unreachable.
    target.faults.await_count("dropped", 1, Duration::from_secs(30)).await;
    // Let the executor give up on the resume and try to roll back, refused by the target.
    cluster
        .until("the move is rolling back", || async {
            let plan = cluster.client.get::<PlanDoc>(PLAN_KIND, plan_id).await.ok()??;
            (plan.value.moves[0].step == Step::RollingBack).then_some(())
        })
        .await;
    let refused = target.faults.count("refused");
    target
        .faults
        .await_count("refused", refused + 3, Duration::from_secs(30))
        .await;
    assert_eq!(cluster.state_on(1, "twice").await, Some(State::Running));
    assert_eq!(
        cluster.state_on(0, "twice").await,
        Some(State::Paused),
        "the source must not run while the target may"
    );

    // The target answers again: its copy is killed, then the source resumes.
    target.faults.set_down(false);
    let plan = cluster.finished_plan(plan_id).await;
    balance.stop().await;
    assert_eq!(plan.moves[0].step, Step::RolledBack, "{plan:?}");
    cluster.assert_runs_once("twice", 0).await;
    target.stop().await;
    cluster.stop().await;
}

/// A paused copy from an older epoch waits on the target (an earlier move that rolled back
/// without reaching it). The restore must replace it with the snapshot, not adopt it: adopting
/// resumes stale files and the source, with the newer ones, is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_copy_on_the_target_is_replaced_not_adopted() {
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "stale", "sleep 600").await;
    cluster.bare_copy(1, "stale", true).await;
    assert!(!cluster.node(1).host().home("stale").join("notes.txt").exists());
    let plan_id = "0000000000000-stale";
    cluster.plan_one(plan_id, "stale", 0, 1).await;
    let balance = cluster.balance(None).await;
    let plan = cluster.finished_plan(plan_id).await;
    balance.stop().await;
    assert_eq!(plan.moves[0].step, Step::Done, "{plan:?}");
    // The files are the source's (assert_runs_once reads notes.txt on the target).
    cluster.assert_runs_once("stale", 1).await;
    cluster.stop().await;
}

/// Taking ownership lands and its reply is lost: the executor reads back, finds its own
/// write, and goes on under the epoch it took, leaving no owner behind when the move ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ownership_write_whose_reply_is_lost_is_released_by_the_rollback() {
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "owned", "sleep 600").await;
    let ledger = LedgerProxy::start(&cluster.stack.ledger_endpoint(), &cluster.stack.certs).await;
    ledger.faults.drop_compare_reply(
        |r| writes(r, SANDBOX_KIND, "\"lifecycle_owner\":\"0000000000000-owned.0\""),
        1,
    );
    let plan_id = "0000000000000-owned";
    cluster.plan_one(plan_id, "owned", 0, 1).await;
    let balance = cluster.balance_via(&ledger.endpoint()).await;
    let plan = cluster.finished_plan(plan_id).await;
    balance.stop().await;
    assert_eq!(ledger.faults.count("dropped"), 1);
    // Resolved by reading back: the move went on under the epoch it took.
    assert_eq!(plan.moves[0].step, Step::Done, "{plan:?}");
    let manifest = cluster
        .client
        .get::<SandboxDoc>(SANDBOX_KIND, "owned")
        .await
        .unwrap()
        .unwrap()
        .value;
    assert_eq!(manifest.lifecycle_owner, None);
    cluster.assert_runs_once("owned", 1).await;
    ledger.stop().await;
    cluster.stop().await;
}

/// Found by the model of the protocol (`balance-svc/src/migrate/model.rs`): a pause the
/// executor gave up on is stuck in the network and arrives after the rollback resumed the
/// source. Under the move's epoch it would freeze the sandbox with nobody owning it; the
/// rollback acts under a new epoch, so the node refuses the late pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_arriving_after_the_rollback_is_refused() {
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "late", "sleep 600").await;
    let source = NodeProxy::start(
        &cluster.stack.nodes[0].id,
        &cluster.node(0).endpoint(),
        &cluster.stack.certs,
    )
    .await;
    source.faults.hold_next("Pause");
    let plan_id = "0000000000000-late-pause";
    cluster
        .plan_one_between(
            plan_id,
            "late",
            (0, &source.endpoint()),
            (1, &cluster.node(1).endpoint()),
        )
        .await;
    let balance = cluster.balance(None).await;
    source.faults.await_count("held", 1, Duration::from_secs(30)).await;
    // Every retry of the pause is refused: the move gives up and rolls back.
    source.faults.refuse("Pause", 1_000);
    let plan = cluster.finished_plan(plan_id).await;
    balance.stop().await;
    assert_eq!(plan.moves[0].step, Step::RolledBack, "{plan:?}");

    source.faults.release_held();
    source
        .faults
        .await_count("delivered late", 1, Duration::from_secs(30))
        .await;
    assert_eq!(
        cluster.state_on(0, "late").await,
        Some(State::Running),
        "the late pause froze the sandbox"
    );
    cluster.assert_runs_once("late", 0).await;
    source.stop().await;
    cluster.stop().await;
}

/// The target applied the resume and then died for good: the rollback waits (never two
/// running copies) until an operator, having stopped the target's host, releases it with
/// `ReleaseTarget`; then the source runs again. The call refuses moves that do not wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_releases_a_dead_target_and_the_rollback_finishes() {
    use proto::balance::v1 as bpb;
    use proto::balance::v1::balance_client::BalanceClient;
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "stuck", "sleep 600").await;
    let target = NodeProxy::start(
        &cluster.stack.nodes[1].id,
        &cluster.node(1).endpoint(),
        &cluster.stack.certs,
    )
    .await;
    target.faults.drop_reply_then_down("Resume", 1);
    let plan_id = "0000000000000-dead-target";
    cluster.plan_one_via(plan_id, "stuck", 0, 1, &target.endpoint()).await;
    let balance = cluster.balance(None).await;
    let mut api = BalanceClient::new(cluster.stack.channel(&balance.endpoint(), stack::Role::Balance));
    cluster
        .until("the move waits for its target", || async {
            let plan = cluster.client.get::<PlanDoc>(PLAN_KIND, plan_id).await.ok()??;
            (plan.value.moves[0].step == Step::RollingBack).then_some(())
        })
        .await;
    assert_eq!(cluster.state_on(0, "stuck").await, Some(State::Paused));

    // Refused: no such move, and a move that does not wait for its target.
    let missing = api
        .release_target(bpb::ReleaseTargetRequest {
            plan_id: plan_id.into(),
            move_index: 3,
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound, "{missing:?}");

    // The operator stops the target's host (here: its copy goes), then releases it.
    cluster.node(1).kill_all().await.unwrap();
    api.release_target(bpb::ReleaseTargetRequest {
        plan_id: plan_id.into(),
        move_index: 0,
    })
    .await
    .unwrap();
    let plan = cluster.finished_plan(plan_id).await;
    assert_eq!(plan.moves[0].step, Step::RolledBack, "{plan:?}");
    assert!(plan.moves[0].target_released);
    let again = api
        .release_target(bpb::ReleaseTargetRequest {
            plan_id: plan_id.into(),
            move_index: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(again.code(), tonic::Code::FailedPrecondition, "{again:?}");
    balance.stop().await;
    cluster.assert_runs_once("stuck", 0).await;
    target.stop().await;
    cluster.stop().await;
}
