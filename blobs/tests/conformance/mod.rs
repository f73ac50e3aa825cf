//! The behaviour every [`BlobStore`] backend must have, as one suite run against each.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use blobs::{BlobError, BlobStore, Key};
use bytes::Bytes;
use sha2::{Digest, Sha256};

const MIB: usize = 1 << 20;

/// Runs the whole suite against `store`, with keys under `prefix` and local files in `scratch`.
pub async fn run(store: &dyn BlobStore, prefix: &str, scratch: &Path) {
    let key = |name: &str| Key::new(format!("{prefix}/{name}")).unwrap();
    println!("conformance: {}", store.describe());

    missing_keys(store, &key("missing"), scratch).await;
    put_get_overwrite_delete(store, &key("small")).await;
    nested_keys(store, &key("nested/a/b"), &key("nested/a")).await;
    file_round_trip(store, &key("file"), scratch).await;
    big_file_round_trip(store, &key("big"), scratch).await;
    concurrent_puts(store, &key("contended"), scratch).await;
    invalid_keys();
    no_temporary_files_left(scratch);
}

async fn missing_keys(store: &dyn BlobStore, key: &Key, scratch: &Path) {
    assert_eq!(store.exists(key).await.unwrap(), None);
    assert!(matches!(store.get_bytes(key).await, Err(BlobError::NotFound(k)) if &k == key));
    let dest = scratch.join("never-written");
    let err = store.get_to_file(key, &dest).await.unwrap_err();
    assert!(matches!(&err, BlobError::NotFound(_)), "{err}");
    assert!(err.to_string().contains(key.as_str()), "{err}");
    assert!(!dest.exists(), "a failed download must not create its destination");
    store.delete(key).await.expect("deleting an absent blob succeeds");
}

async fn put_get_overwrite_delete(store: &dyn BlobStore, key: &Key) {
    store
        .put_bytes(key, Bytes::from_static(b"first version"))
        .await
        .unwrap();
    assert_eq!(store.exists(key).await.unwrap(), Some(13));
    assert_eq!(store.get_bytes(key).await.unwrap(), &b"first version"[..]);

    store.put_bytes(key, Bytes::from_static(b"v2")).await.unwrap();
    assert_eq!(
        store.exists(key).await.unwrap(),
        Some(2),
        "an overwrite replaces the blob"
    );
    assert_eq!(store.get_bytes(key).await.unwrap(), &b"v2"[..]);

    store.put_bytes(key, Bytes::new()).await.unwrap();
    assert_eq!(store.exists(key).await.unwrap(), Some(0), "empty blobs exist");
    assert!(store.get_bytes(key).await.unwrap().is_empty());

    store.delete(key).await.unwrap();
    assert_eq!(store.exists(key).await.unwrap(), None);
    assert!(matches!(store.get_bytes(key).await, Err(BlobError::NotFound(_))));
    store.delete(key).await.expect("deleting twice succeeds");
}

/// A key that is only a prefix of other keys is not a blob.
async fn nested_keys(store: &dyn BlobStore, deep: &Key, parent: &Key) {
    store.put_bytes(deep, Bytes::from_static(b"deep")).await.unwrap();
    assert_eq!(store.exists(parent).await.unwrap(), None);
    assert!(matches!(store.get_bytes(parent).await, Err(BlobError::NotFound(_))));
    store.delete(parent).await.unwrap();
    assert_eq!(store.get_bytes(deep).await.unwrap(), &b"deep"[..]);
    store.delete(deep).await.unwrap();
}

async fn file_round_trip(store: &dyn BlobStore, key: &Key, scratch: &Path) {
    let src = scratch.join("small-src");
    std::fs::write(&src, b"some file content").unwrap();
    store.put_file(key, &src).await.unwrap();
    assert_eq!(store.exists(key).await.unwrap(), Some(17));

    // The destination is replaced whole, and its directory is created.
    let dest = scratch.join("sub/dir/small-dest");
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    std::fs::write(&dest, b"old content that is longer than the blob").unwrap();
    assert_eq!(store.get_to_file(key, &dest).await.unwrap(), 17);
    assert_eq!(std::fs::read(&dest).unwrap(), b"some file content");
    let fresh = scratch.join("new/dir/dest");
    assert_eq!(store.get_to_file(key, &fresh).await.unwrap(), 17);
    assert_eq!(std::fs::read(&fresh).unwrap(), b"some file content");

    let err = store.put_file(key, &scratch.join("no-such-file")).await.unwrap_err();
    assert!(matches!(err, BlobError::Io { .. }), "{err}");
    assert_eq!(
        store.get_bytes(key).await.unwrap(),
        &b"some file content"[..],
        "a failed put leaves the old blob"
    );
    store.delete(key).await.unwrap();
}

/// 64 MiB up and down: streamed both ways (memory use is not measured here, but neither side
/// ever holds the file: it is written, uploaded, downloaded and hashed 1 MiB at a time).
async fn big_file_round_trip(store: &dyn BlobStore, key: &Key, scratch: &Path) {
    let src = scratch.join("big-src");
    let expected = write_pseudo_random(&src, 64 * MIB, 7);
    store.put_file(key, &src).await.unwrap();
    assert_eq!(store.exists(key).await.unwrap(), Some(64 * MIB as u64));
    let dest = scratch.join("big-dest");
    assert_eq!(store.get_to_file(key, &dest).await.unwrap(), 64 * MIB as u64);
    assert_eq!(
        hash_file(&dest),
        expected,
        "the downloaded file differs from the uploaded one"
    );
    std::fs::remove_file(&src).unwrap();
    std::fs::remove_file(&dest).unwrap();
    store.delete(key).await.unwrap();
}

/// Four writers race on one key with different 12 MiB files (multipart on S3): afterwards the
/// key holds exactly one of them, whole.
async fn concurrent_puts(store: &dyn BlobStore, key: &Key, scratch: &Path) {
    let size = 12 * MIB;
    let sources: Vec<PathBuf> = (1..=4u8)
        .map(|fill| {
            let path = scratch.join(format!("contender-{fill}"));
            std::fs::write(&path, vec![fill; size]).unwrap();
            path
        })
        .collect();
    let puts = sources.iter().map(|src| store.put_file(key, src));
    for result in futures::future::join_all(puts).await {
        result.unwrap();
    }
    let blob = store.get_bytes(key).await.unwrap();
    assert_eq!(blob.len(), size);
    let first = blob[0];
    assert!(
        (1..=4).contains(&first) && blob.iter().all(|&b| b == first),
        "the blob mixes concurrent writes"
    );
    for src in &sources {
        std::fs::remove_file(src).unwrap();
    }
    store.delete(key).await.unwrap();
}

fn invalid_keys() {
    for bad in [
        "",
        "/abs",
        "a//b",
        "../escape",
        "a/./b",
        "a/..",
        "sp ace",
        "back\\slash",
        "q?x",
        "tilde~",
    ] {
        assert!(
            matches!(Key::new(bad), Err(BlobError::Invalid(_))),
            "{bad:?} must be refused"
        );
    }
    assert!(Key::new("x".repeat(513)).is_err());
}

fn no_temporary_files_left(scratch: &Path) {
    for entry in walk(scratch) {
        let name = entry.file_name().unwrap().to_string_lossy().into_owned();
        assert!(!name.contains('~'), "temporary file left behind: {}", entry.display());
    }
}

/// Every file under `dir`, recursively.
pub fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// Writes `size` pseudo-random bytes (1 MiB at a time) and returns their sha256.
fn write_pseudo_random(path: &Path, size: usize, seed: u64) -> Vec<u8> {
    let mut file = File::create(path).unwrap();
    let mut hasher = Sha256::new();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut chunk = vec![0u8; MIB];
    for _ in 0..size / MIB {
        for word in chunk.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        hasher.update(&chunk);
        file.write_all(&chunk).unwrap();
    }
    hasher.finalize().to_vec()
}

fn hash_file(path: &Path) -> Vec<u8> {
    let mut file = File::open(path).unwrap();
    let mut hasher = Sha256::new();
    let mut chunk = vec![0u8; MIB];
    loop {
        let n = file.read(&mut chunk).unwrap();
        if n == 0 {
            return hasher.finalize().to_vec();
        }
        hasher.update(&chunk[..n]);
    }
}
