//! The ledger's contract, run against SQLite and PostgreSQL alike: every test below is
//! instantiated once per backend by `for_both_backends!`.

mod support;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use ledger_client::{LedgerClient, LedgerError, Resolution, Txn, WatchEvent};
use serde_json::{json, Value};
use support::{client, Backend, TestDb};

macro_rules! for_both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::Sqlite).await })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::Postgres).await })*
        }
        mod mariadb {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::Mysql).await })*
        }
    };
}

for_both_backends!(
    create_if_absent,
    update_at_version_and_delete,
    multi_document_compare_is_atomic,
    conflict_names_every_mismatch,
    check_guards_without_writing,
    concurrent_writers_lose_no_update,
    seed_regression_plan_commit_under_node_churn,
    watch_resumes_across_restart_without_gap_or_duplicate,
    bad_input_is_invalid_argument_and_changes_nothing,
    list_pages_by_prefix,
    compacted_revisions_are_out_of_range,
    a_lost_reply_is_an_unknown_outcome_resolved_by_reading,
    a_write_that_lands_after_its_read_back_is_committed_not_a_conflict,
    watch_and_list_replies_stay_under_the_client_limit,
    a_recreated_document_refuses_a_writer_of_the_old_one,
);

fn expect_conflict(result: Result<ledger_client::Committed, LedgerError>) -> Vec<ledger_client::Conflict> {
    match result {
        Err(LedgerError::Conflict { conflicts, .. }) => conflicts,
        other => panic!("expected a conflict, got {other:?}"),
    }
}

async fn create_if_absent(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);

    let first = c
        .compare(Txn::new().create("sandbox", "s1", &json!({"mem": 512})).unwrap())
        .await
        .unwrap();
    assert_eq!(first.versions, vec![1]);
    let doc = c.get::<Value>("sandbox", "s1").await.unwrap().expect("created");
    assert_eq!(
        (doc.version, doc.create_revision, doc.mod_revision),
        (1, first.revision, first.revision)
    );
    assert_eq!(doc.value, json!({"mem": 512}));

    let conflicts = expect_conflict(c.compare(Txn::new().create("sandbox", "s1", &json!({})).unwrap()).await);
    assert_eq!(conflicts.len(), 1);
    assert_eq!((conflicts[0].expected_version, conflicts[0].current_version), (0, 1));
    assert_eq!(
        c.get::<Value>("sandbox", "s1").await.unwrap().unwrap().value,
        json!({"mem": 512})
    );

    ledger.stop().await;
    db.cleanup().await;
}

async fn update_at_version_and_delete(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);

    c.compare(Txn::new().create("node", "n1", &json!(1)).unwrap())
        .await
        .unwrap();
    let updated = c
        .compare(Txn::new().update("node", "n1", 1, &json!(2)).unwrap())
        .await
        .unwrap();
    assert_eq!(updated.versions, vec![2]);
    let stale = expect_conflict(c.compare(Txn::new().update("node", "n1", 1, &json!(3)).unwrap()).await);
    assert_eq!(stale[0].current_version, 2);

    let deleted = c.compare(Txn::new().delete("node", "n1", 2)).await.unwrap();
    assert_eq!(deleted.versions, vec![0]);
    assert!(c.get::<Value>("node", "n1").await.unwrap().is_none());
    let gone = expect_conflict(c.compare(Txn::new().delete("node", "n1", 2)).await);
    assert_eq!(gone[0].current_version, 0);

    // Re-creating starts the version count again.
    let again = c
        .compare(Txn::new().create("node", "n1", &json!(4)).unwrap())
        .await
        .unwrap();
    assert_eq!(again.versions, vec![1]);

    ledger.stop().await;
    db.cleanup().await;
}

async fn multi_document_compare_is_atomic(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);

    c.compare(Txn::new().create("node", "b", &json!("b1")).unwrap())
        .await
        .unwrap();
    // `a` would be created, but `b` is not at version 5: nothing may apply.
    let txn = Txn::new()
        .create("node", "a", &json!("a1"))
        .unwrap()
        .update("node", "b", 5, &json!("b2"))
        .unwrap();
    let conflicts = expect_conflict(c.compare(txn).await);
    assert_eq!(conflicts.len(), 1);
    assert_eq!(conflicts[0].key.id, "b");
    assert!(
        c.get::<Value>("node", "a").await.unwrap().is_none(),
        "half of a failed compare applied"
    );

    let txn = Txn::new()
        .create("node", "a", &json!("a1"))
        .unwrap()
        .update("node", "b", 1, &json!("b2"))
        .unwrap();
    let ok = c.compare(txn).await.unwrap();
    assert_eq!(ok.versions, vec![1, 2]);
    let a = c.get::<Value>("node", "a").await.unwrap().unwrap();
    let b = c.get::<Value>("node", "b").await.unwrap().unwrap();
    assert_eq!(
        (a.mod_revision, b.mod_revision),
        (ok.revision, ok.revision),
        "one revision for the batch"
    );

    ledger.stop().await;
    db.cleanup().await;
}

async fn conflict_names_every_mismatch(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);

    let txn = Txn::new()
        .create("plan", "p", &json!({}))
        .unwrap()
        .create("node", "n1", &json!({}))
        .unwrap()
        .create("node", "n2", &json!({}))
        .unwrap();
    c.compare(txn).await.unwrap();
    c.compare(Txn::new().update("node", "n1", 1, &json!({"used": 1})).unwrap())
        .await
        .unwrap();
    c.compare(Txn::new().update("node", "n2", 1, &json!({"used": 2})).unwrap())
        .await
        .unwrap();

    // The failing shape: the plan plus the node documents it read, at the versions it read.
    let txn = Txn::new()
        .update("plan", "p", 1, &json!({"moves": 1}))
        .unwrap()
        .check("node", "n1", 1)
        .check("node", "n2", 1);
    let mut conflicts = expect_conflict(c.compare(txn).await);
    conflicts.sort_by(|a, b| a.key.cmp(&b.key));
    let named: Vec<_> = conflicts
        .iter()
        .map(|c| (c.key.to_string(), c.expected_version, c.current_version))
        .collect();
    assert_eq!(
        named,
        vec![("node/n1".to_string(), 1, 2), ("node/n2".to_string(), 1, 2)]
    );

    ledger.stop().await;
    db.cleanup().await;
}

async fn check_guards_without_writing(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);

    let created = c
        .compare(Txn::new().create("lease", "balance", &json!({"holder": "a"})).unwrap())
        .await
        .unwrap();
    let checked = c.compare(Txn::new().check("lease", "balance", 1)).await.unwrap();
    assert_eq!(checked.revision, created.revision, "a check alone uses no revision");
    assert_eq!(checked.versions, vec![1]);
    expect_conflict(c.compare(Txn::new().check("lease", "balance", 0)).await);
    c.compare(Txn::new().check("lease", "absent", 0)).await.unwrap();

    ledger.stop().await;
    db.cleanup().await;
}

async fn concurrent_writers_lose_no_update(backend: Backend) {
    const WRITERS: u64 = 16;
    const INCREMENTS: u64 = 25;
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);
    c.compare(Txn::new().create("counter", "hot", &json!(0)).unwrap())
        .await
        .unwrap();

    let mut tasks = Vec::new();
    for _ in 0..WRITERS {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut won = Vec::new();
            while (won.len() as u64) < INCREMENTS {
                let doc = c.get::<u64>("counter", "hot").await.unwrap().unwrap();
                let txn = Txn::new()
                    .update("counter", "hot", doc.version, &(doc.value + 1))
                    .unwrap();
                match c.compare(txn).await {
                    Ok(done) => won.push(done.versions[0]),
                    Err(LedgerError::Conflict { .. }) => continue,
                    Err(err) => panic!("unexpected error: {err}"),
                }
            }
            won
        }));
    }
    let mut versions = Vec::new();
    for task in tasks {
        versions.extend(task.await.unwrap());
    }
    let distinct: BTreeSet<u64> = versions.iter().copied().collect();
    assert_eq!(distinct.len(), versions.len(), "two writers won the same version");
    assert_eq!(distinct, (2..=WRITERS * INCREMENTS + 1).collect::<BTreeSet<_>>());
    let final_doc = c.get::<u64>("counter", "hot").await.unwrap().unwrap();
    assert_eq!(final_doc.value, WRITERS * INCREMENTS, "an update was lost");

    ledger.stop().await;
    db.cleanup().await;
}

/// Rewrites `node/n1` and `node/n2` every 10 ms, as node agents do, until stopped.
fn spawn_reporter(c: LedgerClient, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut writes = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            for id in ["n1", "n2"] {
                let doc = c.get::<Value>("node", id).await.unwrap().unwrap();
                let txn = Txn::new()
                    .update(
                        "node",
                        id,
                        doc.version,
                        &json!({"available_ratio": 0.5, "tick": writes}),
                    )
                    .unwrap();
                c.compare(txn).await.unwrap();
                writes += 1;
            }
        }
        writes
    })
}

/// Waits until a node document has moved past `version`: the reporter wrote in between.
async fn await_node_write(c: &LedgerClient, id: &str, version: u64) {
    let mut watch = c.watch("node", id, 0);
    if c.get::<Value>("node", id).await.unwrap().unwrap().version > version {
        return;
    }
    while let Some(update) = watch.next().await {
        let update = update.unwrap();
        if update
            .events
            .iter()
            .any(|e| matches!(e, WatchEvent::Put(d) if d.version > version))
        {
            return;
        }
    }
}

async fn seed_regression_plan_commit_under_node_churn(backend: Backend) {
    const PLANS: u64 = 10;
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);
    for id in ["n1", "n2"] {
        c.compare(Txn::new().create("node", id, &json!({"available_ratio": 0.5})).unwrap())
            .await
            .unwrap();
    }
    c.compare(Txn::new().create("plan", "current", &json!({"seq": 0})).unwrap())
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let reporter = spawn_reporter(c.clone(), stop.clone());

    let (mut plan_only_ok, mut seed_shape_ok) = (0, 0);
    for seq in 1..=PLANS {
        for seed_shape in [false, true] {
            // Read a snapshot: the node documents and the plan.
            let (nodes, _) = c.list::<Value>("node", "").await.unwrap();
            let plan = c.get::<Value>("plan", "current").await.unwrap().unwrap();
            // Planning takes long enough for a node report to land in between.
            await_node_write(&c, "n1", nodes[0].version).await;
            let mut txn = Txn::new()
                .update("plan", "current", plan.version, &json!({"seq": seq}))
                .unwrap();
            if seed_shape {
                for node in &nodes {
                    txn = txn.check("node", &node.key.id, node.version);
                }
            }
            match c.compare(txn).await {
                Ok(_) if seed_shape => seed_shape_ok += 1,
                Ok(_) => plan_only_ok += 1,
                Err(LedgerError::Conflict { conflicts, .. }) => {
                    assert!(seed_shape, "the plan-only commit conflicted: {conflicts:?}");
                    assert!(
                        conflicts.iter().all(|c| c.key.kind == "node"),
                        "the conflict must name the node documents: {conflicts:?}"
                    );
                }
                Err(err) => panic!("unexpected error: {err}"),
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let writes = reporter.await.unwrap();
    assert!(writes > 0);
    assert_eq!(plan_only_ok, PLANS, "every plan-only commit lands");
    assert_eq!(seed_shape_ok, 0, "guarding read node documents cannot land under churn");

    ledger.stop().await;
    db.cleanup().await;
}

async fn watch_resumes_across_restart_without_gap_or_duplicate(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let addr = ledger.addr();
    let c = client(&ledger);
    let mut watch = c.watch("sandbox", "", 1);

    for i in 0..30 {
        c.compare(Txn::new().create("sandbox", &format!("s{i:03}"), &json!(i)).unwrap())
            .await
            .unwrap();
        // Writes of other kinds advance the revision but must not reach this watcher.
        c.compare(Txn::new().create("node", &format!("n{i:03}"), &json!(i)).unwrap())
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    while seen.len() < 10 {
        for event in watch.next().await.unwrap().unwrap().events {
            seen.push(event);
        }
    }

    // Restart the ledger on the same port and database; the watch must carry on by itself.
    ledger.stop().await;
    let ledger = db.start_ledger_with(|config| config.listen = addr).await;
    for i in 30..60 {
        c.compare(Txn::new().create("sandbox", &format!("s{i:03}"), &json!(i)).unwrap())
            .await
            .unwrap();
    }
    let mut n = 0;
    c.compare(Txn::new().delete("sandbox", "s000", 1)).await.unwrap();
    while seen.len() < 61 {
        let update = tokio::time::timeout(Duration::from_secs(20), watch.next())
            .await
            .expect("watch stalled after the restart")
            .unwrap()
            .unwrap();
        seen.extend(update.events);
        n += 1;
        assert!(n < 10_000);
    }
    let revisions: Vec<u64> = seen
        .iter()
        .map(|e| match e {
            WatchEvent::Put(d) => {
                assert_eq!(d.key.kind, "sandbox");
                d.mod_revision
            }
            WatchEvent::Deleted { revision, .. } => *revision,
        })
        .collect();
    assert!(
        revisions.windows(2).all(|w| w[0] < w[1]),
        "out of order or repeated: {revisions:?}"
    );
    let ids: Vec<String> = seen
        .iter()
        .filter_map(|e| match e {
            WatchEvent::Put(d) => Some(d.key.id.clone()),
            WatchEvent::Deleted { .. } => None,
        })
        .collect();
    assert_eq!(
        ids,
        (0..60).map(|i| format!("s{i:03}")).collect::<Vec<_>>(),
        "a change was lost or repeated"
    );
    assert!(matches!(&seen[60], WatchEvent::Deleted { key, .. } if key.id == "s000"));

    ledger.stop().await;
    db.cleanup().await;
}

async fn bad_input_is_invalid_argument_and_changes_nothing(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);
    let before = c
        .compare(Txn::new().create("node", "n", &json!(1)).unwrap())
        .await
        .unwrap()
        .revision;

    let cases = [
        Txn::new().put_json("node", "x", 0, "{not json".to_string()),
        Txn::new().put_json("", "x", 0, "1".to_string()),
        Txn::new().put_json("node", "", 0, "1".to_string()),
        Txn::new().put_json("node", "big", 0, format!("\"{}\"", "x".repeat(1024 * 1024))),
        Txn::new().delete("node", "n", 0),
        Txn::new()
            .put_json("node", "x", 0, "1".to_string())
            .put_json("node", "x", 0, "2".to_string()),
        Txn::new(),
    ];
    for txn in cases {
        match c.compare(txn).await {
            Err(LedgerError::Invalid(message)) => assert!(!message.is_empty()),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }
    assert!(matches!(c.list_page("", "", 0, "").await, Err(LedgerError::Invalid(_))));
    assert!(matches!(
        c.list_page("node", "", 0, "zz").await,
        Err(LedgerError::Invalid(_))
    ));
    let (docs, _, revision) = c.list_page("node", "", 0, "").await.unwrap();
    assert_eq!(revision, before, "a refused request changed the ledger");
    assert_eq!(docs.len(), 1);

    ledger.stop().await;
    db.cleanup().await;
}

async fn list_pages_by_prefix(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);
    let mut txn = Txn::new();
    for i in 0..20 {
        txn = txn.create("sandbox", &format!("a-{i:02}"), &json!(i)).unwrap();
    }
    for i in 0..5 {
        txn = txn.create("sandbox", &format!("b-{i:02}"), &json!(i)).unwrap();
    }
    txn = txn.create("other", "a-00", &json!(0)).unwrap();
    c.compare(txn).await.unwrap();

    let mut ids = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let (docs, next, _) = c.list_page("sandbox", "a-", 7, &token).await.unwrap();
        ids.extend(docs.into_iter().map(|d| d.key.id));
        pages += 1;
        if next.is_empty() {
            break;
        }
        token = next;
    }
    assert_eq!(pages, 3);
    assert_eq!(ids, (0..20).map(|i| format!("a-{i:02}")).collect::<Vec<_>>());
    let (all, _) = c.list::<Value>("sandbox", "").await.unwrap();
    assert_eq!(all.len(), 25);

    ledger.stop().await;
    db.cleanup().await;
}

async fn compacted_revisions_are_out_of_range(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);
    let mut last = 0;
    for i in 0..20 {
        last = c
            .compare(Txn::new().create("sandbox", &format!("s{i}"), &json!(i)).unwrap())
            .await
            .unwrap()
            .revision;
    }
    // Before compaction the whole history is there.
    let first = c.watch("sandbox", "", 1).next().await.unwrap().unwrap();
    assert!(matches!(first.events.first(), Some(WatchEvent::Put(doc)) if doc.key.id == "s0"));

    let compacted = ledger.compact(5).await.unwrap();
    assert_eq!(compacted, last - 5);
    // A watch from a compacted revision is refused, not served with a gap.
    match c.watch("sandbox", "", 1).next().await {
        Some(Err(LedgerError::Compacted(message))) => {
            assert!(message.contains("compacted"), "{message}")
        }
        other => panic!("expected OUT_OF_RANGE, got {other:?}"),
    }
    // Recent revisions are still served.
    let recent = c.watch("sandbox", "", compacted + 1).next().await.unwrap().unwrap();
    let ids: Vec<_> = recent
        .events
        .iter()
        .filter_map(|e| match e {
            WatchEvent::Put(d) => Some(d.key.id.as_str()),
            WatchEvent::Deleted { .. } => None,
        })
        .collect();
    assert_eq!(ids, vec!["s15", "s16", "s17", "s18", "s19"]);

    ledger.stop().await;
    db.cleanup().await;
}

/// A ledger on `backend` with document `plan/p` at version 1, a client of it, a fault proxy
/// in front of it and a client through that proxy.
struct Proxied {
    db: TestDb,
    ledger: ledger_svc::RunningLedger,
    direct: LedgerClient,
    proxy: stack::fault::Proxy,
    c: LedgerClient,
}

async fn proxied(backend: Backend) -> Proxied {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let direct = client(&ledger);
    let proxy = stack::fault::LedgerProxy::start(&ledger.endpoint(), &stack::Certs::plaintext()).await;
    let c = LedgerClient::connect_lazy(&proxy.endpoint(), &mtls::Security::Plaintext).unwrap();
    direct
        .compare(Txn::new().create("plan", "p", &json!({"step": 0})).unwrap())
        .await
        .unwrap();
    Proxied {
        db,
        ledger,
        direct,
        proxy,
        c,
    }
}

/// A compare that applied and lost its reply is "outcome unknown", never "unavailable"; reading
/// back tells landed from not landed from moved on, and `compare_resolving` returns the
/// landed write as committed instead of sending it again into a conflict.
async fn a_lost_reply_is_an_unknown_outcome_resolved_by_reading(backend: Backend) {
    let Proxied {
        db,
        ledger,
        direct,
        proxy,
        c,
    } = proxied(backend).await;

    let step1 = Txn::new().update("plan", "p", 1, &json!({"step": 1})).unwrap();
    assert_eq!(c.resolve(&step1).await.unwrap(), Resolution::NotLanded);
    proxy.faults.drop_compare_reply(|_| true, 1);
    match c.compare(step1.clone()).await {
        Err(LedgerError::OutcomeUnknown(_)) => {}
        other => panic!("a lost reply must be an unknown outcome, got {other:?}"),
    }
    match c.resolve(&step1).await.unwrap() {
        Resolution::Landed(committed) => assert_eq!(committed.versions, vec![2]),
        other => panic!("the write applied, got {other:?}"),
    }
    // Sending it again is the mistake this guards against: a conflict with itself.
    expect_conflict(c.compare(step1.clone()).await);

    // compare_resolving: the reply is lost, the read-back finds the write, it is committed.
    proxy.faults.drop_compare_reply(|_| true, 1);
    let step2 = Txn::new().update("plan", "p", 2, &json!({"step": 2})).unwrap();
    let committed = c.compare_resolving(step2, 3).await.unwrap();
    assert_eq!(committed.versions, vec![3]);
    assert_eq!(proxy.faults.count("dropped"), 2);

    // Another writer came after: the documents moved on, and only the caller can tell.
    direct
        .compare(Txn::new().update("plan", "p", 3, &json!({"step": 9})).unwrap())
        .await
        .unwrap();
    let late = Txn::new().update("plan", "p", 2, &json!({"step": 2})).unwrap();
    assert!(matches!(c.resolve(&late).await.unwrap(), Resolution::Moved(m) if m[0].current_version == 4));

    proxy.stop().await;
    ledger.stop().await;
    db.cleanup().await;
}

/// A commit still under way when its caller reads back: the read finds nothing, the caller
/// sends again, and the first send lands before the second. The second's conflict is with its
/// own write: `compare_resolving` reads back once more and returns it committed (before, a
/// create under load answered "changed concurrently" for a write that had landed), while a
/// conflict with another writer's stays a conflict.
async fn a_write_that_lands_after_its_read_back_is_committed_not_a_conflict(backend: Backend) {
    let Proxied {
        db,
        ledger,
        direct,
        proxy,
        c,
    } = proxied(backend).await;

    proxy.faults.land_compare_after_next_read(1);
    let step1 = Txn::new().update("plan", "p", 1, &json!({"step": 1})).unwrap();
    let committed = c.compare_resolving(step1, 3).await.expect("its own write, committed");
    assert_eq!(committed.versions, vec![2]);
    assert_eq!(
        proxy.faults.count("landed late"),
        1,
        "the first send landed after the read"
    );
    let doc = direct.get::<Value>("plan", "p").await.unwrap().unwrap();
    assert_eq!((doc.version, doc.value), (2, json!({"step": 1})));

    // The same race, but the write that lands while ours is read back is another writer's:
    // theirs waits for the next read, ours is refused on its way (an unknown outcome).
    proxy.faults.land_compare_after_next_read(1);
    let theirs = Txn::new().update("plan", "p", 2, &json!({"step": "theirs"})).unwrap();
    let lost = c.compare(theirs).await;
    assert!(matches!(lost, Err(LedgerError::OutcomeUnknown(_))), "{lost:?}");
    proxy.faults.refuse("Compare", 1);
    let ours = Txn::new().update("plan", "p", 2, &json!({"step": "ours"})).unwrap();
    let conflicts = expect_conflict(c.compare_resolving(ours, 3).await);
    assert_eq!(conflicts[0].current_version, 3);
    let doc = direct.get::<Value>("plan", "p").await.unwrap().unwrap();
    assert_eq!(doc.value, json!({"step": "theirs"}));

    proxy.stop().await;
    ledger.stop().await;
    db.cleanup().await;
}

/// Documents near the size limit: a watch from far behind and a list of them arrive in
/// replies the client accepts (before, a reply of every revision in the window could exceed
/// gRPC's 4 MiB and the client took the refusal for compaction).
async fn watch_and_list_replies_stay_under_the_client_limit(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);
    let big = "x".repeat(600 * 1024);
    for i in 0..12 {
        c.compare(Txn::new().create("blob", &format!("b{i:02}"), &json!(big)).unwrap())
            .await
            .unwrap();
    }
    // A plain gRPC client, with gRPC's default 4 MiB limit on a reply.
    let mut raw = proto::ledger::v1::ledger_client::LedgerClient::connect(ledger.endpoint())
        .await
        .unwrap();
    let mut replies = raw
        .watch(proto::ledger::v1::WatchRequest {
            start_revision: 1,
            kind: "blob".into(),
            id_prefix: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut seen = 0;
    while seen < 12 {
        let reply = tokio::time::timeout(std::time::Duration::from_secs(20), replies.message())
            .await
            .expect("the watch delivers")
            .expect("no error: every reply fits the default limit")
            .expect("the watch stream stays open");
        seen += reply.events.len();
    }
    assert_eq!(seen, 12);
    // The ledger's own client follows the same history.
    let mut watch = c.watch("blob", "", 1);
    let mut followed = 0;
    while followed < 12 {
        let update = watch.next().await.expect("open").expect("no error");
        followed += update.events.len();
    }
    let (docs, _) = c.list::<Value>("blob", "").await.unwrap();
    assert_eq!(docs.len(), 12);
    ledger.stop().await;
    db.cleanup().await;
}

/// Deleted and created again, a document's version restarts; a writer still holding the old
/// document at the same version number must not overwrite the new one (ABA). `update_read`
/// guards the create revision too; a bare version compare would let it through.
async fn a_recreated_document_refuses_a_writer_of_the_old_one(backend: Backend) {
    let db = TestDb::new(backend).await;
    let ledger = db.start_ledger().await;
    let c = client(&ledger);
    c.compare(Txn::new().create("lease", "x", &json!({"holder": "a"})).unwrap())
        .await
        .unwrap();
    let old = c.get::<Value>("lease", "x").await.unwrap().unwrap();
    c.compare(Txn::new().delete("lease", "x", old.version)).await.unwrap();
    c.compare(Txn::new().create("lease", "x", &json!({"holder": "b"})).unwrap())
        .await
        .unwrap();
    let new = c.get::<Value>("lease", "x").await.unwrap().unwrap();
    assert_eq!(
        new.version, old.version,
        "the version restarted: a bare compare cannot tell"
    );
    expect_conflict(
        c.compare(Txn::new().update_read(&old, &json!({"holder": "a"})).unwrap())
            .await,
    );
    c.compare(Txn::new().update_read(&new, &json!({"holder": "b2"})).unwrap())
        .await
        .unwrap();
    ledger.stop().await;
    db.cleanup().await;
}
