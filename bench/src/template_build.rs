//! `bench template-build`: a 3-step template built from an image in a registry on loopback
//! (a busybox root filesystem this benchmark pushes itself), then built again unchanged (every
//! step from the build cache); sandboxes of it created on a node that has to fetch its layers
//! first (its layer cache emptied before each) and on one that has them; and how fast layers
//! come from an S3 blob store (moto on loopback, as `scripts/blob-services` starts it).
//!
//! Two nodes in this process share one blob store directory, as a cluster shares one store.

use std::io::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context;
use node_svc::server::{NodeConfig, RunningNode, RuntimeKind};
use proto::node::v1 as pb;
use proto::node::v1::node_client::NodeClient;
use sha2::Digest as _;

use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The registry the image is pushed to and built from.
    #[arg(long, default_value = "127.0.0.1:5056")]
    registry: String,
    /// An S3 API endpoint for the layer fetch figure.
    #[arg(long, default_value = "http://127.0.0.1:5055")]
    s3: String,
    /// Creates timed of each kind.
    #[arg(long, default_value_t = 10)]
    creates: usize,
    /// Megabytes the template's RUN step writes (its layer's size).
    #[arg(long, default_value_t = 32)]
    layer_mb: u64,
    /// The static envd (scripts/build-static-envd): an image brings no C library.
    #[arg(long, default_value = "target/x86_64-unknown-linux-gnu/debug/sandboxsched-envd")]
    envd: std::path::PathBuf,
}

struct Scratch {
    node: RunningNode,
    dir: std::path::PathBuf,
    id: String,
}

async fn node(tag: &str, blobs: &std::path::Path, envd: &std::path::Path, registry: &str) -> anyhow::Result<Scratch> {
    let id = format!("bench-{tag}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let dir = std::env::temp_dir().join(&id);
    let mut config = NodeConfig::new("127.0.0.1:0".parse()?, &id, &dir);
    config.runtime = RuntimeKind::Container { oci_runtime: None };
    config.host.blob_store = Some(blobs.display().to_string());
    config.envd_binary = Some(envd.to_path_buf());
    // The benchmark's registry is on loopback, which builds may not reach unless allowed.
    config.host.private_registries = vec![registry.to_string()];
    let node = node_svc::server::start(config).await?;
    Ok(Scratch { node, dir, id })
}

impl Scratch {
    async fn remove(self) {
        self.node.stop().await;
        node_svc::runtime::container::destroy_all(&self.dir, None);
        let _ = std::fs::remove_dir_all(&self.dir);
        node_svc::runtime::cgroup::remove_parents(&self.id);
    }
}

fn sha256_hex(data: &[u8]) -> String {
    sha2::Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// A root filesystem of Debian's static busybox, as a gzip layer, and its uncompressed digest.
fn busybox_layer() -> anyhow::Result<(Vec<u8>, String)> {
    let busybox = std::fs::read("/bin/busybox")
        .context("/bin/busybox is missing: install busybox-static (scripts/blob-services does)")?;
    let mut tar = tar::Builder::new(Vec::new());
    let mut add = |path: &str, kind: tar::EntryType, mode: u32, link: Option<&str>, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_size(data.len() as u64);
        if let Some(link) = link {
            h.set_link_name(link)?;
        }
        h.set_cksum();
        tar.append_data(&mut h, path, data)
    };
    for dir in ["bin", "etc", "tmp", "root", "home", "usr", "usr/bin"] {
        add(
            dir,
            tar::EntryType::Directory,
            if dir == "tmp" { 0o1777 } else { 0o755 },
            None,
            &[],
        )?;
    }
    add("bin/busybox", tar::EntryType::Regular, 0o755, None, &busybox)?;
    for applet in [
        "sh", "cat", "echo", "id", "ls", "grep", "mkdir", "chown", "dd", "true", "sleep",
    ] {
        add(
            &format!("bin/{applet}"),
            tar::EntryType::Symlink,
            0o777,
            Some("busybox"),
            &[],
        )?;
    }
    add(
        "etc/passwd",
        tar::EntryType::Regular,
        0o644,
        None,
        b"root:x:0:0:root:/root:/bin/sh\n",
    )?;
    add("etc/group", tar::EntryType::Regular, 0o644, None, b"root:x:0:\n")?;
    let plain = tar.into_inner()?;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&plain)?;
    Ok((gz.finish()?, sha256_hex(&plain)))
}

/// Pushes a one-layer image through the registry's HTTP API; returns its reference.
async fn push_image(http: &reqwest::Client, registry: &str) -> anyhow::Result<String> {
    let (layer, diff_id) = busybox_layer()?;
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin:/usr/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]},
    })
    .to_string()
    .into_bytes();
    let repository = format!("bench/busybox-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let base = format!("http://{registry}/v2/{repository}");
    for blob in [&layer, &config] {
        let started = http
            .post(format!("{base}/blobs/uploads/"))
            .send()
            .await
            .with_context(|| format!("no registry answers at {registry}: run scripts/blob-services"))?;
        anyhow::ensure!(started.status().as_u16() == 202, "upload start: {}", started.status());
        let location = started.headers()["location"].to_str()?.to_string();
        let location = if location.starts_with('/') {
            format!("http://{registry}{location}")
        } else {
            location
        };
        let sep = if location.contains('?') { '&' } else { '?' };
        let put = http
            .put(format!("{location}{sep}digest=sha256:{}", sha256_hex(blob)))
            .body(blob.clone())
            .send()
            .await?;
        anyhow::ensure!(put.status().as_u16() == 201, "upload: {}", put.status());
    }
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": format!("sha256:{}", sha256_hex(&config)), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": format!("sha256:{}", sha256_hex(&layer)), "size": layer.len()}],
    });
    let put = http
        .put(format!("{base}/manifests/1"))
        .header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
        .body(manifest.to_string())
        .send()
        .await?;
    anyhow::ensure!(put.status().as_u16() == 201, "manifest: {}", put.status());
    Ok(format!("{registry}/{repository}:1"))
}

/// Builds `steps` from `image` on `node`: the image and the seconds it took.
async fn build(node: &RunningNode, image: &str, steps: &[pb::BuildStep]) -> anyhow::Result<(pb::TemplateImage, f64)> {
    let mut c = NodeClient::connect(node.endpoint()).await?;
    let started = Instant::now();
    let mut events = c
        .build(pb::BuildRequest {
            build_id: uuid::Uuid::new_v4().to_string(),
            resources: Some(pb::Resources {
                vcpus: 1,
                memory_bytes: 512 << 20,
                disk_bytes: 0,
            }),
            from_image: image.to_string(),
            steps: steps.to_vec(),
            ..Default::default()
        })
        .await?
        .into_inner();
    while let Some(event) = events.message().await? {
        match event.event {
            Some(pb::build_event::Event::Done(image)) => return Ok((image, started.elapsed().as_secs_f64())),
            Some(pb::build_event::Event::Failed(f)) => anyhow::bail!("build failed at step {}: {}", f.step, f.message),
            _ => {}
        }
    }
    anyhow::bail!("the build ended without an outcome")
}

/// Creates and kills a sandbox of `image` on `node`; how long the create took.
async fn create(node: &RunningNode, image: &pb::TemplateImage, i: usize) -> anyhow::Result<Duration> {
    let mut c = NodeClient::connect(node.endpoint()).await?;
    let id = format!("t{i}-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
    let started = Instant::now();
    c.create(pb::CreateRequest {
        operation_id: format!("c-{id}"),
        epoch: 1,
        sandbox_id: id.clone(),
        template: "bench".into(),
        resources: Some(pb::Resources {
            vcpus: 1,
            memory_bytes: 128 << 20,
            disk_bytes: 0,
        }),
        image: Some(image.clone()),
        ..Default::default()
    })
    .await?;
    let took = started.elapsed();
    c.kill(pb::LifecycleRequest {
        operation_id: format!("k-{id}"),
        epoch: 1,
        sandbox_id: id,
    })
    .await?;
    Ok(took)
}

fn p50_ms(samples: &mut [Duration]) -> f64 {
    samples.sort();
    samples.get(samples.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// Seconds to fetch a `mb`-megabyte blob from S3 at `endpoint` to a local file.
async fn s3_fetch(endpoint: &str, mb: u64) -> anyhow::Result<f64> {
    let bucket = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let made = reqwest::Client::new().put(format!("{endpoint}/{bucket}")).send().await;
    made.with_context(|| format!("no S3 server answers at {endpoint}: run scripts/blob-services"))?;
    let url = format!("s3://{bucket}?endpoint={endpoint}&region=us-east-1&access_key_id=bench&secret_access_key=bench");
    let store = blobs::from_url(&url)?;
    let key = blobs::Key::new("layers/bench")?;
    let file = std::env::temp_dir().join(format!("{bucket}.blob"));
    let data: Vec<u8> = (0..mb << 20).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&file, &data)?;
    store.put_file(&key, &file).await?;
    let back = std::env::temp_dir().join(format!("{bucket}.back"));
    let started = Instant::now();
    let bytes = store.get_to_file(&key, &back).await?;
    let seconds = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&back);
    let _ = store.delete(&key).await;
    Ok(bytes as f64 / (1 << 20) as f64 / seconds)
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    anyhow::ensure!(
        args.envd.is_file(),
        "{} is missing: run scripts/build-static-envd",
        args.envd.display()
    );
    let blobs = std::env::temp_dir().join(format!(
        "bench-blobs-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    let http = reqwest::Client::new();
    let image = push_image(&http, &args.registry).await?;
    let (a, b) = (
        node("builder", &blobs, &args.envd, &args.registry).await?,
        node("runner", &blobs, &args.envd, &args.registry).await?,
    );
    let step = |kind: &str, args: &[String]| pb::BuildStep {
        kind: kind.into(),
        args: args.to_vec(),
        ..Default::default()
    };
    let steps = vec![
        step(
            "RUN",
            &[
                format!(
                    "dd if=/dev/urandom of=/home/user/data bs=1M count={} 2>/dev/null",
                    args.layer_mb
                ),
                String::new(),
            ],
        ),
        step(
            "RUN",
            &[
                "mkdir -p /home/user/app && echo ready > /home/user/app/state".into(),
                String::new(),
            ],
        ),
        step("WORKDIR", &["/home/user/app".into()]),
    ];
    let (built, cold_build_s) = build(&a.node, &image, &steps).await?;
    let (_, cached_rebuild_s) = build(&a.node, &image, &steps).await?;

    let layers_dir = b.dir.join("container/layers/sha256");
    let mut cold = Vec::new();
    for i in 0..args.creates {
        let _ = std::fs::remove_dir_all(&layers_dir);
        cold.push(create(&b.node, &built, i).await?);
    }
    let mut cached = Vec::new();
    for i in 0..args.creates {
        cached.push(create(&b.node, &built, args.creates + i).await?);
    }
    let fetch = s3_fetch(&args.s3, 64).await?;
    a.remove().await;
    b.remove().await;
    let _ = std::fs::remove_dir_all(&blobs);

    let bytes: u64 = built.layers.iter().map(|l| l.size).sum();
    let mut report = Report::new("template build: 3 steps from a registry image, built cold and again");
    report
        .figure("cold_build_s", round2(cold_build_s), "s")
        .figure("cached_rebuild_s", round2(cached_rebuild_s), "s")
        .figure("cached_over_cold", round2(cached_rebuild_s / cold_build_s), "")
        .figure("image_layers", built.layers.len(), "")
        .figure("image_mb", round2(bytes as f64 / (1 << 20) as f64), "MiB (compressed)")
        .figure("create_cold_layers_p50_ms", round2(p50_ms(&mut cold)), "ms")
        .figure("create_cached_p50_ms", round2(p50_ms(&mut cached)), "ms")
        .figure("layer_fetch_mb_per_sec", round2(fetch), "MiB/s (S3, 64 MiB)");
    Ok(report)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
