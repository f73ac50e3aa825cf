//! Pulling real images from Debian's `docker-registry` on loopback (`scripts/blob-services`
//! starts it on 127.0.0.1:5056; `BLOBS_TEST_REGISTRY` overrides). Each test builds and pushes
//! its own tiny image under a repository name no other run uses.

mod support;

use std::io::Write;

use blobs::{pull_image, BlobStore, Key, LocalDir, PullError, RegistryAuth};
use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::manifest::{
    OciImageIndex, IMAGE_LAYER_GZIP_MEDIA_TYPE, IMAGE_LAYER_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE,
};
use oci_client::secrets::RegistryAuth as OciAuth;
use oci_client::{Client, Reference};
use serde_json::json;
use sha2::{Digest, Sha256};

const ZSTD_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+zstd";

async fn registry() -> String {
    let registry = std::env::var("BLOBS_TEST_REGISTRY").unwrap_or_else(|_| "127.0.0.1:5056".into());
    support::require_service(
        &registry,
        "the test OCI registry (docker-registry)",
        "BLOBS_TEST_REGISTRY",
    )
    .await;
    registry
}

fn client() -> Client {
    Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..ClientConfig::default()
    })
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(data))
}

fn tar_of(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append_data(&mut header, path, *data).unwrap();
    }
    builder.into_inner().unwrap()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(data).unwrap();
    encoder.finish().unwrap()
}

/// Pushes an image and returns its manifest's digest and size.
async fn push(reference: &str, layers: &[(Vec<u8>, &str)], process: serde_json::Value, arch: &str) -> (String, usize) {
    let reference: Reference = reference.parse().unwrap();
    let layers: Vec<ImageLayer> = layers
        .iter()
        .map(|(data, media)| ImageLayer::new(data.clone(), media.to_string(), None))
        .collect();
    let config = json!({
        "architecture": arch,
        "os": "linux",
        "config": process,
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| sha256(&l.data)).collect::<Vec<_>>()},
    });
    let config = Config::oci_v1(serde_json::to_vec(&config).unwrap(), None);
    let client = client();
    client
        .push(&reference, &layers, config, &OciAuth::Anonymous, None)
        .await
        .unwrap();
    let (manifest, digest) = client
        .pull_manifest_raw(&reference, &OciAuth::Anonymous, &[OCI_IMAGE_MEDIA_TYPE])
        .await
        .unwrap();
    (digest, manifest.len())
}

/// Pushes an image index whose entries are `(digest, size, arch)` linux images.
async fn push_index(reference: &str, entries: &[(&str, usize, &str)]) -> String {
    let reference: Reference = reference.parse().unwrap();
    let index: OciImageIndex = serde_json::from_value(json!({
        "schemaVersion": 2,
        "mediaType": OCI_IMAGE_INDEX_MEDIA_TYPE,
        "manifests": entries.iter().map(|(digest, size, arch)| json!({
            "mediaType": OCI_IMAGE_MEDIA_TYPE,
            "digest": digest,
            "size": size,
            "platform": {"architecture": arch, "os": "linux"},
        })).collect::<Vec<_>>(),
    }))
    .unwrap();
    let client = client();
    client
        .push_manifest_list(&reference, &OciAuth::Anonymous, index)
        .await
        .unwrap();
    client
        .pull_manifest_raw(&reference, &OciAuth::Anonymous, &[OCI_IMAGE_INDEX_MEDIA_TYPE])
        .await
        .unwrap()
        .1
}

#[tokio::test]
async fn pulls_an_image_then_finds_its_layers_cached() {
    let registry = registry().await;
    let repo = format!("{registry}/{}", support::unique("blobs-test/image"));
    let gz = gzip(&tar_of(&[("hello.txt", b"hello from a layer\n")]));
    let plain = tar_of(&[("etc/motd", b"welcome\n"), ("work/.keep", b"")]);
    let process = json!({
        "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hi"],
        "User": "1000:1000",
        "WorkingDir": "/work",
        "Entrypoint": ["/bin/sh", "-c"],
        "Cmd": ["cat /hello.txt"],
    });
    let (digest, _) = push(
        &format!("{repo}:v1"),
        &[
            (gz.clone(), IMAGE_LAYER_GZIP_MEDIA_TYPE),
            (plain.clone(), IMAGE_LAYER_MEDIA_TYPE),
        ],
        process,
        "amd64",
    )
    .await;

    let root = tempfile::tempdir().unwrap();
    let store = LocalDir::new(root.path()).unwrap();
    let pulled = pull_image(&format!("{repo}:v1"), RegistryAuth::Anonymous, &store)
        .await
        .unwrap();
    assert_eq!(pulled.digest, digest);
    assert_eq!(pulled.index_digest, None);
    assert_eq!(pulled.reference, format!("{repo}:v1"));
    let layers: Vec<_> = pulled
        .layers
        .iter()
        .map(|l| (l.digest.as_str(), l.size, l.media_type.as_str()))
        .collect();
    assert_eq!(
        layers,
        [
            (sha256(&gz).as_str(), gz.len() as u64, IMAGE_LAYER_GZIP_MEDIA_TYPE),
            (sha256(&plain).as_str(), plain.len() as u64, IMAGE_LAYER_MEDIA_TYPE)
        ]
    );
    for (data, layer) in [&gz, &plain].into_iter().zip(&pulled.layers) {
        let key = Key::for_layer(&layer.digest).unwrap();
        assert_eq!(
            store.get_bytes(&key).await.unwrap(),
            data.as_slice(),
            "stored blob {key} differs"
        );
    }
    assert_eq!(pulled.config.env, ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hi"]);
    assert_eq!(pulled.config.user.as_deref(), Some("1000:1000"));
    assert_eq!(pulled.config.working_dir.as_deref(), Some("/work"));
    assert_eq!(pulled.config.entrypoint, ["/bin/sh", "-c"]);
    assert_eq!(pulled.config.cmd, ["cat /hello.txt"]);
    assert_eq!(pulled.cached_layers, 0);
    assert_eq!(pulled.fetched_bytes, (gz.len() + plain.len()) as u64);

    let again = pull_image(&format!("{repo}:v1"), RegistryAuth::Anonymous, &store)
        .await
        .unwrap();
    assert_eq!((again.cached_layers, again.fetched_bytes), (2, 0));
    assert_eq!(
        (again.digest.as_str(), &again.layers, &again.config),
        (digest.as_str(), &pulled.layers, &pulled.config)
    );

    // By digest, too.
    let by_digest = pull_image(&format!("{repo}@{digest}"), RegistryAuth::Anonymous, &store)
        .await
        .unwrap();
    assert_eq!(
        (by_digest.digest.as_str(), by_digest.cached_layers),
        (digest.as_str(), 2)
    );
}

#[tokio::test]
async fn an_unknown_image_or_tag_is_a_clear_error() {
    let registry = registry().await;
    let repo = format!("{registry}/{}", support::unique("blobs-test/known"));
    push(
        &format!("{repo}:v1"),
        &[(gzip(&tar_of(&[("a", b"a")])), IMAGE_LAYER_GZIP_MEDIA_TYPE)],
        json!({}),
        "amd64",
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let store = LocalDir::new(dir.path()).unwrap();

    for reference in [
        format!("{repo}:no-such-tag"),
        format!("{registry}/{}:v1", support::unique("blobs-test/unknown")),
    ] {
        let err = pull_image(&reference, RegistryAuth::Anonymous, &store)
            .await
            .unwrap_err();
        println!("{err}");
        assert!(matches!(err, PullError::NotFound { .. }), "{reference}: {err:?}");
        assert!(
            err.to_string().contains("not found") && err.to_string().contains(&reference),
            "{err}"
        );
    }
}

#[tokio::test]
async fn an_unreachable_registry_is_a_clear_error() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let dir = tempfile::tempdir().unwrap();
    let store = LocalDir::new(dir.path()).unwrap();
    let err = pull_image(
        &format!("127.0.0.1:{port}/some/image:v1"),
        RegistryAuth::Anonymous,
        &store,
    )
    .await
    .unwrap_err();
    println!("{err}");
    assert!(matches!(err, PullError::Unreachable { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("unreachable") && text.contains(&format!("127.0.0.1:{port}")),
        "{text}"
    );
}

#[tokio::test]
async fn an_index_resolves_to_its_linux_amd64_image() {
    let registry = registry().await;
    let repo = format!("{registry}/{}", support::unique("blobs-test/multi"));
    let amd = gzip(&tar_of(&[("arch", b"amd64\n")]));
    let arm = tar_of(&[("arch", b"arm64\n")]); // labelled zstd: layers are opaque blobs here
    let (amd_digest, amd_size) = push(
        &format!("{repo}:amd64"),
        &[(amd.clone(), IMAGE_LAYER_GZIP_MEDIA_TYPE)],
        json!({"Env": ["ARCH=amd64"]}),
        "amd64",
    )
    .await;
    let (arm_digest, arm_size) = push(
        &format!("{repo}:arm64"),
        &[(arm, ZSTD_LAYER)],
        json!({"Env": ["ARCH=arm64"]}),
        "arm64",
    )
    .await;
    let index_digest = push_index(
        &format!("{repo}:multi"),
        &[(&arm_digest, arm_size, "arm64"), (&amd_digest, amd_size, "amd64")],
    )
    .await;

    let dir = tempfile::tempdir().unwrap();
    let store = LocalDir::new(dir.path()).unwrap();
    let pulled = pull_image(&format!("{repo}:multi"), RegistryAuth::Anonymous, &store)
        .await
        .unwrap();
    assert_eq!(pulled.digest, amd_digest);
    assert_eq!(pulled.index_digest.as_deref(), Some(index_digest.as_str()));
    assert_eq!(pulled.config.env, ["ARCH=amd64"]);
    assert_eq!(pulled.layers.len(), 1);
    assert_eq!(pulled.layers[0].digest, sha256(&amd));
    assert!(store
        .exists(&Key::for_layer(&sha256(&amd)).unwrap())
        .await
        .unwrap()
        .is_some());

    // The arm64 image on its own is just an image, zstd media type and all.
    let arm_only = pull_image(&format!("{repo}:arm64"), RegistryAuth::Anonymous, &store)
        .await
        .unwrap();
    assert_eq!(arm_only.layers[0].media_type, ZSTD_LAYER);

    push_index(&format!("{repo}:arm-only"), &[(&arm_digest, arm_size, "arm64")]).await;
    let err = pull_image(&format!("{repo}:arm-only"), RegistryAuth::Anonymous, &store)
        .await
        .unwrap_err();
    println!("{err}");
    assert!(matches!(err, PullError::NoPlatform { .. }), "{err:?}");
    assert!(
        err.to_string().contains("no linux/amd64") && err.to_string().contains("linux/arm64"),
        "{err}"
    );
}
