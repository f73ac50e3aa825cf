//! The conformance suite against both backends: a local directory, and S3 on moto's server
//! (`scripts/blob-services` starts it on 127.0.0.1:5055; `BLOBS_TEST_S3` overrides).

mod conformance;
mod support;

use blobs::{from_url, BlobStore, Key, LocalDir};
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_dir_conformance() {
    let root = tempfile::tempdir().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let store = from_url(&format!("file://{}", root.path().display())).unwrap();
    conformance::run(store.as_ref(), "conformance", scratch.path()).await;
    for file in conformance::walk(root.path()) {
        assert!(
            !file.to_string_lossy().contains('~'),
            "temporary file left in the store: {}",
            file.display()
        );
    }
}

/// Two stores on one root (as two processes on one host would have) see each other's blobs.
#[tokio::test]
async fn local_dirs_share_a_root() {
    let root = tempfile::tempdir().unwrap();
    let a = LocalDir::new(root.path()).unwrap();
    let b = LocalDir::new(root.path()).unwrap();
    let key = Key::new("files/shared").unwrap();
    a.put_bytes(&key, Bytes::from_static(b"hello")).await.unwrap();
    assert_eq!(b.get_bytes(&key).await.unwrap(), &b"hello"[..]);
    assert_eq!(std::fs::read(root.path().join("files/shared")).unwrap(), b"hello");
    b.delete(&key).await.unwrap();
    assert_eq!(a.exists(&key).await.unwrap(), None);
}

fn s3_endpoint() -> String {
    std::env::var("BLOBS_TEST_S3").unwrap_or_else(|_| "http://127.0.0.1:5055".into())
}

/// Creates `bucket` with a plain path-style `PUT /<bucket>` (moto does not check signatures).
async fn create_bucket(endpoint: &str, bucket: &str) {
    let url = url::Url::parse(endpoint).unwrap();
    let addr = format!("{}:{}", url.host_str().unwrap(), url.port_or_known_default().unwrap());
    support::require_service(&addr, "the S3 test server (moto)", "BLOBS_TEST_S3").await;
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let request = format!("PUT /{bucket} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response).await.unwrap();
    assert!(
        response.starts_with("HTTP/1.1 200"),
        "creating bucket {bucket} failed: {response}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_conformance() {
    let endpoint = s3_endpoint();
    let bucket = support::unique("blobs-test-");
    create_bucket(&endpoint, &bucket).await;
    let credentials = "region=us-east-1&access_key_id=test&secret_access_key=test";
    let store = from_url(&format!("s3://{bucket}/some/prefix?endpoint={endpoint}&{credentials}")).unwrap();
    assert!(store.describe().contains(&bucket), "{}", store.describe());
    let scratch = tempfile::tempdir().unwrap();
    conformance::run(store.as_ref(), "conformance", scratch.path()).await;

    // The prefix really is a prefix of the object names.
    let key = Key::new("files/prefixed").unwrap();
    store.put_bytes(&key, Bytes::from_static(b"x")).await.unwrap();
    let whole_bucket = from_url(&format!("s3://{bucket}?endpoint={endpoint}&{credentials}")).unwrap();
    assert_eq!(
        whole_bucket
            .exists(&Key::new("some/prefix/files/prefixed").unwrap())
            .await
            .unwrap(),
        Some(1)
    );
    assert_eq!(whole_bucket.exists(&key).await.unwrap(), None);
}

#[tokio::test]
async fn s3_reports_a_missing_bucket() {
    let endpoint = s3_endpoint();
    create_bucket(&endpoint, &support::unique("blobs-probe-")).await;
    let store = from_url(&format!(
        "s3://{}?endpoint={endpoint}&access_key_id=test&secret_access_key=test",
        support::unique("no-such-bucket-")
    ))
    .unwrap();
    let err = store
        .put_bytes(&Key::new("a").unwrap(), Bytes::from_static(b"x"))
        .await
        .unwrap_err();
    println!("{err}");
    assert!(matches!(err, blobs::BlobError::Backend(_)), "{err}");
}
