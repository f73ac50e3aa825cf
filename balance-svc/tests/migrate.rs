//! balance-svc against real parts: a ledger on SQLite, placement in memory publishing node
//! documents, and two node-svcs running real process sandboxes.
//!
//! The crash tests kill the executor (its loop ends at an injected halt and never releases
//! its lease, as a dead process would) after each step of a move in turn, before and after
//! the plan document records the step, then start a fresh balance-svc and check the
//! invariant: the sandbox runs in exactly one place, with its files, and the plan finishes.

mod support;

use std::time::Duration;

use balance_svc::migrate::Halt;
use balance_svc::record::{PlanDoc, PlanReason, Step, PLAN_KIND};
use common::docs::{NodeDoc, SandboxDoc, SandboxPhase, NODE_KIND, SANDBOX_KIND};
use ledger_client::Txn;
use proto::balance::v1 as bpb;
use proto::balance::v1::balance_client::BalanceClient;
use proto::node::v1 as npb;
use proto::node::v1::node_client::NodeClient;
use support::cluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_move_survives_the_executor_dying_after_every_step() {
    let cluster = cluster(&[4096, 4096]).await;
    let mut halts = Vec::new();
    for step in [
        Step::Owned,
        Step::SourcePaused,
        Step::Restored,
        Step::TargetResumed,
        Step::Switched,
    ] {
        halts.push(Halt { step, recorded: false });
        halts.push(Halt { step, recorded: true });
    }
    halts.push(Halt {
        step: Step::Done,
        recorded: false,
    });
    for (n, halt) in halts.into_iter().enumerate() {
        let id = format!("crash{n}");
        // Alternate directions so each case starts from a fresh source.
        let (from, to) = if n % 2 == 0 { (0, 1) } else { (1, 0) };
        cluster.sandbox(from, &id, "sleep 600").await;
        let plan_id = format!("0000000000000-crash{n}");
        cluster.plan_one(&plan_id, &id, from, to).await;

        let mut dying = cluster.balance(Some(halt)).await;
        tokio::time::timeout(Duration::from_secs(30), dying.loop_done())
            .await
            .unwrap_or_else(|_| panic!("the executor never reached {halt:?}"));
        dying.stop().await;

        let recovered = cluster.balance(None).await;
        let plan = cluster.finished_plan(&plan_id).await;
        recovered.stop().await;
        assert_eq!(plan.moves[0].step, Step::Done, "after {halt:?}: {plan:?}");
        assert!(plan.moves[0].epoch >= 2, "{plan:?}");
        cluster.assert_runs_once(&id, to).await;
    }
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_move_rolls_back_to_the_source() {
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "stays", "sleep 600").await;
    // The target refuses the restore: it already has a sandbox of that ID... of its own.
    // Simplest real failure: a target address where no node listens.
    let plan_id = "0000000000000-rollback";
    let mut doc_plan = {
        cluster.plan_one(plan_id, "stays", 0, 1).await;
        cluster
            .client
            .get::<PlanDoc>(PLAN_KIND, plan_id)
            .await
            .unwrap()
            .unwrap()
    };
    doc_plan.value.moves[0].to_address = "http://127.0.0.1:1".into();
    cluster
        .client
        .compare(
            Txn::new()
                .update(PLAN_KIND, plan_id, doc_plan.version, &doc_plan.value)
                .unwrap(),
        )
        .await
        .unwrap();
    let balance = cluster.balance(None).await;
    let plan = cluster.finished_plan(plan_id).await;
    balance.stop().await;
    assert_eq!(plan.moves[0].step, Step::RolledBack, "{plan:?}");
    assert!(plan.moves[0].error.is_some());
    cluster.assert_runs_once("stays", 0).await;
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_older_executor_is_fenced_out_by_the_epoch() {
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "fenced", "sleep 600").await;
    let plan_id = "0000000000000-fence";
    cluster.plan_one(plan_id, "fenced", 0, 1).await;
    // The first executor owns the sandbox (epoch 2) and pauses it, then "hangs".
    let mut first = cluster
        .balance(Some(Halt {
            step: Step::SourcePaused,
            recorded: true,
        }))
        .await;
    first.loop_done().await;
    first.stop().await;
    let old_epoch = cluster
        .client
        .get::<PlanDoc>(PLAN_KIND, plan_id)
        .await
        .unwrap()
        .unwrap()
        .value
        .moves[0]
        .epoch;
    let second = cluster.balance(None).await;
    cluster.finished_plan(plan_id).await;
    second.stop().await;
    // The hung executor wakes up and tries its next action with its epoch: refused.
    let mut source = NodeClient::new(cluster.stack.channel(&cluster.node(1).endpoint(), stack::Role::Node));
    let refused = source
        .pause(npb::LifecycleRequest {
            operation_id: "late".into(),
            epoch: old_epoch,
            sandbox_id: "fenced".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    cluster.assert_runs_once("fenced", 1).await;
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plan_commits_land_while_node_documents_change_every_100ms() {
    let cluster = cluster(&[4096, 4096]).await;
    // Node documents rewritten every 100 ms by another writer (as placement does).
    let writer = {
        let client = cluster.client.clone();
        tokio::spawn(async move {
            for _ in 0..50 {
                if let Ok((docs, _)) = client.list::<NodeDoc>(NODE_KIND, "").await {
                    for doc in docs {
                        let mut value = doc.value.clone();
                        value.seq += 1;
                        let _ = client
                            .compare(
                                Txn::new()
                                    .update(NODE_KIND, &value.node_id, doc.version, &value)
                                    .unwrap(),
                            )
                            .await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let mut landed = 0;
    for i in 0..20 {
        // Read the node documents (as a scan does); commit only after one was rewritten.
        let (before, _) = cluster.client.list::<NodeDoc>(NODE_KIND, "").await.unwrap();
        let before: Vec<u64> = before.iter().map(|d| d.version).collect();
        cluster
            .until("a node document rewritten since the read", || async {
                let (after, _) = cluster.client.list::<NodeDoc>(NODE_KIND, "").await.ok()?;
                (after.iter().map(|d| d.version).collect::<Vec<_>>() != before).then_some(())
            })
            .await;
        let plan = PlanDoc {
            plan_id: format!("commit-{i}"),
            reason: PlanReason::Balance,
            spread_before: 0.3,
            spread_expected: 0.0,
            skips: Default::default(),
            created_at_unix_ms: 0,
            finished_at_unix_ms: Some(1),
            moves: Vec::new(),
            drops: Vec::new(),
        };
        let balancer = balance_svc::balancer::Balancer::new(
            cluster.client.clone(),
            balance_svc::lease::Lease::new(cluster.client.clone(), "t".into(), Duration::from_secs(5)),
            balance_svc::migrate::Mover::new(cluster.client.clone(), None, balance_svc::migrate::Budget::SERIAL),
            Default::default(),
        );
        balancer
            .commit(&plan)
            .await
            .expect("a plan commit guards only the plan document");
        landed += 1;
    }
    writer.abort();
    assert_eq!(landed, 20);
    cluster.stop().await;
}

/// Skewed memory (sandboxes really allocating it) is observed, planned, moved and judged
/// satisfied; status and history answer over gRPC.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_skewed_cluster_is_balanced_until_satisfied() {
    let cluster = cluster(&[1024, 1024]).await;
    let hog = "python3 -c \"import time; b = b'x' * (60 << 20); time.sleep(600)\"";
    for id in ["hog0", "hog1", "hog2"] {
        cluster.sandbox(0, id, hog).await;
    }
    // Wait until node 0's document shows the memory in use.
    let node0 = cluster.node_id(0);
    cluster
        .until("the skew shows in node documents", || async {
            let (docs, _) = cluster.client.list::<NodeDoc>(NODE_KIND, "").await.ok()?;
            let ratio = |id: &str| {
                docs.iter()
                    .find(|d| d.value.node_id == id)
                    .map(|d| d.value.available_ratio)
            };
            let spread = ratio(&cluster.node_id(1))? - ratio(&node0)?;
            (spread > 0.12).then_some(())
        })
        .await;
    let balance = cluster.balance(None).await;
    let mut api = BalanceClient::new(cluster.stack.channel(&balance.endpoint(), stack::Role::Balance));
    let status = cluster
        .until("Satisfied after a move", || {
            let mut api = api.clone();
            async move {
                let status = api.status(bpb::StatusRequest {}).await.ok()?.into_inner();
                let o = status.observation.clone()?;
                (o.status == "Satisfied/SpreadWithinThreshold"
                    && o.counts.contains_key("PendingBalance/PlanningRequired"))
                .then_some(status)
            }
        })
        .await;
    assert!(status.leader);
    let history = api
        .history(bpb::HistoryRequest { limit: 10 })
        .await
        .unwrap()
        .into_inner()
        .plans;
    let moved: Vec<&bpb::MoveView> = history.iter().flat_map(|p| &p.moves).collect();
    assert!(!moved.is_empty());
    assert!(moved.iter().all(|m| m.step == "Done"), "{moved:?}");
    let fetched = api
        .get_plan(bpb::GetPlanRequest {
            plan_id: history[0].plan_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fetched, history[0]);
    let missing = api
        .get_plan(bpb::GetPlanRequest { plan_id: "nope".into() })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    for m in moved {
        cluster.assert_runs_once(&m.sandbox_id, 1).await;
    }
    balance.stop().await;
    cluster.stop().await;
}

/// Drain: placement stops choosing the node and everything running on it moves off.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drained_node_is_emptied() {
    let cluster = cluster(&[2048, 2048]).await;
    for id in ["d0", "d1"] {
        cluster.sandbox(0, id, "sleep 600").await;
    }
    let balance = cluster.balance(None).await;
    let mut api = BalanceClient::new(cluster.stack.channel(&balance.endpoint(), stack::Role::Balance));
    // Pausing is recorded and reported; resuming lets the drain proceed.
    let paused = api
        .set_paused(bpb::SetPausedRequest { paused: true })
        .await
        .unwrap()
        .into_inner();
    assert!(paused.paused);
    let resumed = api
        .set_paused(bpb::SetPausedRequest { paused: false })
        .await
        .unwrap()
        .into_inner();
    assert!(!resumed.paused);
    let refused = api
        .drain(bpb::DrainRequest {
            node_id: String::new(),
            undo: false,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    let answer = api
        .drain(bpb::DrainRequest {
            node_id: cluster.node_id(0),
            undo: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.draining_nodes, vec![cluster.node_id(0)]);
    assert_eq!(answer.remaining_sandboxes, 2);
    cluster
        .until("the drained node is empty", || async {
            let manifests = cluster.client.list::<SandboxDoc>(SANDBOX_KIND, "").await.ok()?.0;
            // Switched (manifests on node 1, unowned) comes before the paused source copies
            // are deleted: the drain is over when both hold.
            let switched = manifests
                .iter()
                .all(|m| m.value.node_id == cluster.node_id(1) && m.value.lifecycle_owner.is_none());
            (switched && cluster.node(0).host().list().await.is_empty()).then_some(())
        })
        .await;
    for id in ["d0", "d1"] {
        cluster.assert_runs_once(id, 1).await;
    }
    // Placement no longer offers the node.
    let mut placement = proto::placement::v1::placement_client::PlacementClient::new(
        cluster
            .stack
            .channel(&cluster.stack.placement_endpoint(), stack::Role::Placement),
    );
    let nodes = placement
        .nodes(proto::placement::v1::NodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    let drained = nodes.iter().find(|n| n.node_id == cluster.node_id(0)).unwrap();
    assert_eq!(drained.state, proto::placement::v1::NodeState::Draining as i32);
    balance.stop().await;
    cluster.stop().await;
}

/// A pooled sandbox on a draining node is dropped, not moved: the plan asks its pool's keeper
/// (in its manifest) to retire it and records the drop, and the drain is over once it is gone,
/// while the team's sandbox beside it moves as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pooled_sandbox_is_dropped_not_moved() {
    let cluster = cluster(&[2048, 2048]).await;
    cluster.sandbox(0, "team0", "sleep 600").await;
    cluster.sandbox(0, "pool0", "sleep 600").await;
    cluster
        .edit_manifest("pool0", |pooled| {
            pooled.team_id.clear();
            pooled.pool = Some(common::pool::Pooled {
                template_id: "base".into(),
                ..Default::default()
            });
        })
        .await;
    let balance = cluster.balance(None).await;
    let mut api = BalanceClient::new(cluster.stack.channel(&balance.endpoint(), stack::Role::Balance));
    api.drain(bpb::DrainRequest {
        node_id: cluster.node_id(0),
        undo: false,
    })
    .await
    .unwrap();
    let asked = cluster
        .until("the pooled sandbox asked to go", || async {
            let doc = cluster.client.get::<SandboxDoc>(SANDBOX_KIND, "pool0").await.ok()??;
            doc.value.pool.clone()?.retire_asked
        })
        .await;
    assert!(asked.by.starts_with("balance plan "), "{asked:?}");
    // The keeper's part, done by hand: the sandbox killed on its node, its manifest deleted.
    let mut node = NodeClient::new(cluster.stack.channel(&cluster.node(0).endpoint(), stack::Role::Node));
    node.kill(npb::LifecycleRequest {
        operation_id: "keeper-retire".into(),
        epoch: 2,
        sandbox_id: "pool0".into(),
    })
    .await
    .unwrap();
    let doc = cluster
        .client
        .get::<SandboxDoc>(SANDBOX_KIND, "pool0")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(doc.value.node_id, cluster.node_id(0), "never moved");
    assert_eq!(doc.value.lifecycle_owner, None, "never owned by a move");
    cluster
        .client
        .compare(Txn::new().delete(SANDBOX_KIND, "pool0", doc.version))
        .await
        .unwrap();
    cluster
        .until("the drained node is empty", || async {
            let team0 = cluster.client.get::<SandboxDoc>(SANDBOX_KIND, "team0").await.ok()??;
            let moved = team0.value.node_id == cluster.node_id(1) && team0.value.lifecycle_owner.is_none();
            (moved && cluster.node(0).host().list().await.is_empty()).then_some(())
        })
        .await;
    cluster.assert_runs_once("team0", 1).await;
    let history = api
        .history(bpb::HistoryRequest { limit: 10 })
        .await
        .unwrap()
        .into_inner()
        .plans;
    let dropped: Vec<&str> = history
        .iter()
        .flat_map(|p| &p.drops)
        .map(|d| d.sandbox_id.as_str())
        .collect();
    let moved: Vec<&str> = history
        .iter()
        .flat_map(|p| &p.moves)
        .map(|m| m.sandbox_id.as_str())
        .collect();
    assert!(dropped.contains(&"pool0"), "{history:?}");
    assert!(!moved.contains(&"pool0"), "{history:?}");
    assert!(moved.contains(&"team0"), "{history:?}");
    balance.stop().await;
    cluster.stop().await;
}

/// Copies no manifest sends anyone to go, paused or running; wanted ones stay: a running
/// sandbox on its manifest's node, one paused there by its user, and a copy whose manifest is
/// still `creating` (the gateway's reaper resolves those, adopting the copy a node runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orphaned_copies_are_removed_and_nothing_else() {
    let cluster = cluster(&[4096, 4096]).await;
    // Wanted: running on node 0 (its manifest), and paused on node 1 by its user.
    cluster.sandbox(0, "kept", "sleep 600").await;
    cluster.sandbox(1, "napping", "sleep 600").await;
    cluster.pause(1, "napping").await;
    // A create under way: its manifest is written first (`creating`, on no node yet).
    cluster.sandbox(1, "starting", "sleep 600").await;
    cluster
        .edit_manifest("starting", |m| {
            m.phase = SandboxPhase::Creating;
            m.node_id.clear();
            m.node_address.clear();
        })
        .await;
    // Orphans: a paused copy of "kept" on node 1 (a rollback's leftover), a paused copy whose
    // manifest is gone (a kill that never reached the node), a running one alike, and a
    // running copy of a sandbox its manifest places on node 0 (a create made on node 0 after
    // its call to node 1 broke).
    cluster.bare_copy(1, "kept", true).await;
    cluster.bare_copy(1, "killed", true).await;
    cluster.bare_copy(1, "killed-running", false).await;
    cluster.sandbox(0, "twice", "sleep 600").await;
    cluster.bare_copy(1, "twice", false).await;

    let mut config = cluster.balance_config();
    config.tuning.sweep_every = Duration::ZERO;
    // Several cycles (100 ms apart) see each orphan before it goes.
    config.tuning.orphan_grace = Duration::from_millis(300);
    let balance = balance_svc::server::start(config).await.unwrap();
    let on_node_1 = || async {
        let listed = cluster.node(1).host().list().await;
        listed.into_iter().map(|(r, _)| r.id).collect::<Vec<_>>()
    };
    let orphans = ["kept", "killed", "killed-running", "twice"];
    cluster
        .until("every orphan is removed from node 1", || async {
            let ids = on_node_1().await;
            (!ids.iter().any(|id| orphans.contains(&id.as_str()))).then_some(())
        })
        .await;
    balance.stop().await;
    let mut left = on_node_1().await;
    left.sort();
    assert_eq!(left, vec!["napping".to_string(), "starting".to_string()]);
    cluster.assert_runs_once("kept", 0).await;
    cluster.assert_runs_once("twice", 0).await;
    cluster.stop().await;
}

/// A user operation holds the sandbox (its claim is in the manifest): a planned move must not
/// take it, and stands down cleanly — rolled back without touching a node, the claim intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_move_stands_down_for_a_user_claim() {
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "claimed", "sleep 600").await;
    let claimed = cluster
        .edit_manifest("claimed", |claimed| {
            claimed.lifecycle_owner = Some("user:pause:test".into());
            claimed.lifecycle_claimed_at_unix_ms = Some(common::clock::now_ms());
            claimed.epoch += 1;
        })
        .await;
    let plan_id = "0000000000000-claimed";
    cluster.plan_one(plan_id, "claimed", 0, 1).await;
    let balance = cluster.balance(None).await;
    let plan = cluster.finished_plan(plan_id).await;
    balance.stop().await;
    assert_eq!(plan.moves[0].step, Step::RolledBack, "{plan:?}");
    assert!(
        plan.moves[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("user:pause:test")),
        "{plan:?}"
    );
    let after = cluster
        .client
        .get::<SandboxDoc>(SANDBOX_KIND, "claimed")
        .await
        .unwrap()
        .unwrap()
        .value;
    assert_eq!(after, claimed, "the move changed nothing");
    assert_eq!(
        cluster.state_on(0, "claimed").await,
        Some(node_svc::sandbox::State::Running)
    );
    assert_eq!(cluster.state_on(1, "claimed").await, None);
    cluster.stop().await;
}

/// An executor dies holding the lease with its sandbox paused mid-move. With the default
/// lease (3 s, visited every half second) another replica takes over once the lease has been
/// still for a full TTL by its own clock — no wall clocks compared — and the sandbox runs
/// again within 5 s of the death.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_executors_sandbox_runs_again_within_5_s() {
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "orphaned", "sleep 600").await;
    let plan_id = "0000000000000-dead";
    cluster.plan_one(plan_id, "orphaned", 0, 1).await;
    let config = |halt| {
        let mut config = cluster.balance_config();
        config.lease_ttl = balance_svc::server::DEFAULT_LEASE_TTL;
        config.halt = halt;
        config
    };
    let mut dying = balance_svc::server::start(config(Some(Halt {
        step: Step::SourcePaused,
        recorded: true,
    })))
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(30), dying.loop_done())
        .await
        .expect("the executor reaches its halt");
    let died = std::time::Instant::now();
    assert_eq!(
        cluster.state_on(0, "orphaned").await,
        Some(node_svc::sandbox::State::Paused)
    );
    let successor = balance_svc::server::start(config(None)).await.unwrap();
    cluster
        .until("the sandbox runs again", || async {
            let running = |s| s == Some(node_svc::sandbox::State::Running);
            (running(cluster.state_on(0, "orphaned").await) || running(cluster.state_on(1, "orphaned").await))
                .then_some(())
        })
        .await;
    let down = died.elapsed();
    assert!(
        down < Duration::from_secs(5),
        "paused for {down:?} after its executor died"
    );
    cluster.finished_plan(plan_id).await;
    successor.stop().await;
    dying.stop().await;
    cluster.assert_runs_once("orphaned", 1).await;
    cluster.stop().await;
}

/// A move's target passes placement's own rules before anything is touched: placement
/// refuses a draining target (as it would a create), and the move rolls back untouched,
/// saying why. An accepted target is reserved there as a create would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn placement_checks_and_reserves_a_moves_target() {
    use proto::placement::v1 as ppb;
    use proto::placement::v1::placement_client::PlacementClient;
    let cluster = cluster(&[4096, 4096]).await;
    cluster.sandbox(0, "refused", "sleep 600").await;
    let mut placement = PlacementClient::new(
        cluster
            .stack
            .channel(&cluster.stack.placement_endpoint(), stack::Role::Placement),
    );
    placement
        .set_node_state(ppb::SetNodeStateRequest {
            node_id: cluster.node_id(1),
            state: ppb::NodeState::Draining as i32,
        })
        .await
        .unwrap();
    cluster.plan_one("0000000000000-refused", "refused", 0, 1).await;
    let balance = cluster.balance(None).await;
    let plan = cluster.finished_plan("0000000000000-refused").await;
    balance.stop().await;
    assert_eq!(plan.moves[0].step, Step::RolledBack, "{plan:?}");
    let error = plan.moves[0].error.as_deref().unwrap_or_default();
    assert!(
        error.contains("placement refused the target") && error.contains("draining"),
        "{error}"
    );
    assert_eq!(plan.moves[0].epoch, 0, "nothing was touched");
    cluster.assert_runs_once("refused", 0).await;

    // Ready again: the next move reserves there, and runs.
    placement
        .set_node_state(ppb::SetNodeStateRequest {
            node_id: cluster.node_id(1),
            state: ppb::NodeState::Ready as i32,
        })
        .await
        .unwrap();
    cluster.plan_one("0000000000001-accepted", "refused", 0, 1).await;
    let balance = cluster.balance(None).await;
    let plan = cluster.finished_plan("0000000000001-accepted").await;
    balance.stop().await;
    assert_eq!(plan.moves[0].step, Step::Done, "{plan:?}");
    cluster.assert_runs_once("refused", 1).await;
    cluster.stop().await;
}
