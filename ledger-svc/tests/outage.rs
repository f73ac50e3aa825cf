//! Losing the database: the ledger answers UNAVAILABLE (never panics), reports NOT_SERVING in
//! gRPC health, and recovers by itself when the database returns. PostgreSQL only: the ledger
//! reaches it through a proxy the test can cut.

mod support;

use std::time::{Duration, Instant};

use ledger_client::{LedgerError, Txn};
use serde_json::json;
use support::{client, Backend, CuttableProxy, TestDb};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const SERVICE: &str = "sandboxsched.ledger.v1.Ledger";

async fn health_client(endpoint: &str) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .expect("endpoint")
        .connect()
        .await
        .expect("connect to the ledger");
    HealthClient::new(channel)
}

async fn health(endpoint: &str) -> ServingStatus {
    let mut client = health_client(endpoint).await;
    let reply = client
        .check(HealthCheckRequest {
            service: SERVICE.to_string(),
        })
        .await
        .expect("health check");
    ServingStatus::try_from(reply.into_inner().status).expect("status")
}

/// Follows the health stream until it reports `want`.
async fn await_health(endpoint: &str, want: ServingStatus) {
    let mut client = health_client(endpoint).await;
    let mut stream = client
        .watch(HealthCheckRequest {
            service: SERVICE.to_string(),
        })
        .await
        .expect("health watch")
        .into_inner();
    let deadline = Duration::from_secs(20);
    tokio::time::timeout(deadline, async {
        while let Some(reply) = stream.message().await.expect("health stream") {
            if reply.status == want as i32 {
                return;
            }
        }
        panic!("health stream ended before {want:?}");
    })
    .await
    .unwrap_or_else(|_| panic!("health never became {want:?}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_is_unavailable_then_recovers() {
    let db = TestDb::new(Backend::Postgres).await;
    // Create the schema directly, then run the ledger through the proxy.
    db.start_ledger().await.stop().await;
    let proxy = CuttableProxy::start(support::postgres_addr()).await;
    let url = db.url_via(proxy.addr);
    let ledger = ledger_svc::start(ledger_svc::LedgerConfig::new("127.0.0.1:0".parse().unwrap(), url))
        .await
        .expect("ledger starts");
    let c = client(&ledger);
    c.compare(Txn::new().create("node", "n1", &json!(1)).unwrap())
        .await
        .unwrap();
    assert_eq!(health(&ledger.endpoint()).await, ServingStatus::Serving);

    proxy.cut().await;
    let started = Instant::now();
    match c.compare(Txn::new().update("node", "n1", 1, &json!(2)).unwrap()).await {
        Err(LedgerError::Unavailable(message)) => {
            assert!(message.contains("database"), "{message}")
        }
        other => panic!("expected UNAVAILABLE while the database is gone, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the failure took {:?}",
        started.elapsed()
    );
    assert!(matches!(
        c.get_raw("node", "n1").await,
        Err(LedgerError::Unavailable(_))
    ));
    await_health(&ledger.endpoint(), ServingStatus::NotServing).await;

    proxy.restore().await;
    await_health(&ledger.endpoint(), ServingStatus::Serving).await;
    // The failed update changed nothing; the next one lands.
    let doc = c.get::<serde_json::Value>("node", "n1").await.unwrap().unwrap();
    assert_eq!((doc.version, doc.value), (1, json!(1)));
    c.compare(Txn::new().update("node", "n1", 1, &json!(2)).unwrap())
        .await
        .unwrap();

    ledger.stop().await;
    db.cleanup().await;
}

/// COMMIT reaches PostgreSQL (which commits it) and its answer never comes back. The caller
/// must hear "outcome unknown" within the ledger's commit deadline, not wait for ever and not
/// "unavailable"; health says NOT_SERVING while writes stall; reading back shows the write
/// landed; and the ledger recovers by itself when commits answer again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_never_answers_is_an_unknown_outcome() {
    let db = TestDb::new(Backend::Postgres).await;
    db.start_ledger().await.stop().await;
    let proxy = CuttableProxy::start(support::postgres_addr()).await;
    let mut config = ledger_svc::LedgerConfig::new("127.0.0.1:0".parse().unwrap(), db.url_via(proxy.addr));
    config.commit_deadline = Duration::from_secs(1);
    let ledger = ledger_svc::start(config).await.expect("ledger starts");
    let c = client(&ledger);
    c.compare(Txn::new().create("node", "n1", &json!(1)).unwrap())
        .await
        .unwrap();

    proxy.stall_commits(true);
    let started = Instant::now();
    let txn = Txn::new().update("node", "n1", 1, &json!(2)).unwrap();
    match c.compare(txn.clone()).await {
        Err(LedgerError::OutcomeUnknown(message)) => assert!(message.contains("COMMIT"), "{message}"),
        other => panic!("expected an unknown outcome, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the caller waited {:?}",
        started.elapsed()
    );
    await_health(&ledger.endpoint(), ServingStatus::NotServing).await;
    // It landed: the database committed what it was sent.
    match c.resolve(&txn).await.unwrap() {
        ledger_client::Resolution::Landed(committed) => assert_eq!(committed.versions, vec![2]),
        other => panic!("the commit reached the database, got {other:?}"),
    }

    proxy.stall_commits(false);
    await_health(&ledger.endpoint(), ServingStatus::Serving).await;
    c.compare(Txn::new().update("node", "n1", 2, &json!(3)).unwrap())
        .await
        .unwrap();
    ledger.stop().await;
    db.cleanup().await;
}
