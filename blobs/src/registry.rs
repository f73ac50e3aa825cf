//! Copying an OCI image from a registry into a [`BlobStore`].
//!
//! A template is built from an image such as `127.0.0.1:5056/base:1` or `python:3.12`.
//! [`pull_image`] resolves the reference the way Docker does (short Docker Hub names become
//! `docker.io/library/…`, the tag defaults to `latest`, `name@sha256:…` pins a manifest),
//! fetches the manifest — choosing the linux/amd64 entry when the reference names a
//! multi-platform index — and streams every layer blob into the store under
//! `layers/sha256/<hex>` ([`Key::for_layer`]).
//!
//! Layers are content-addressed, so a layer the store already holds is not fetched again
//! (it is counted in [`PulledImage::cached_layers`]) when it was pulled from the same
//! repository before: pulling a second image that shares a base costs only its own layers.
//! From another repository it is fetched and checked once more, as if it were not there: a
//! manifest may list any digest, and the store holds every team's layers (a private image's,
//! a build's, a sandbox's snapshot), so a digest alone must not hand a layer to whoever names
//! it. Its registry has to show it holds those bytes, and only then is the repository noted
//! beside the layer ([`source_key`]). A fetched layer is written to a scratch file in the system's
//! temporary directory (`TMPDIR`; it should be on disk, not tmpfs, for big images) while its
//! sha256 is computed, and reaches the store only when the digest matches the manifest; a
//! mismatch fails the pull and stores nothing. Up to three layers are fetched at once. Layers are opaque here: gzip, zstd and uncompressed tars are
//! all just blobs, and their media type is recorded for whoever unpacks them.
//!
//! The image config blob is parsed for the process settings a sandbox needs (`Env`, `User`,
//! `WorkingDir`, `Entrypoint`, `Cmd`); see [`ImageConfig`].
//!
//! Registries on loopback (`127.0.0.0/8`, `localhost`, `[::1]`, any port) are spoken to over
//! plain HTTP, every other one over HTTPS only. Authentication (anonymous, or user and password
//! exchanged for a bearer token when the registry asks for one) is done by the `oci-client`
//! crate. Errors say what went wrong in the terms an operator thinks in: the image or tag is
//! unknown, the registry is unreachable, the credentials were refused, the index has no
//! linux/amd64 image, a blob did not match its digest.

use std::fmt;
use std::io;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use oci_client::client::{linux_amd64_resolver, ClientConfig, ClientProtocol};
use oci_client::errors::{DigestError, OciDistributionError, OciErrorCode};
use oci_client::manifest::{OciDescriptor, OciImageManifest, OciManifest};
use oci_client::{Client, Reference, RegistryOperation};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::store::{blocking, BlobError, BlobStore, Key, TempFile};

/// How many layers of one image are fetched at once.
const LAYERS_IN_FLIGHT: usize = 3;
/// Image configs are a few KiB; refuse absurd ones rather than buffer them.
const MAX_CONFIG_SIZE: i64 = 4 << 20;
/// The largest layer blob a pull downloads (a layer cache keeps 20 GiB by default, and a
/// compressed layer is no larger than what it unpacks to), and the bound on one whose
/// manifest declares no size: a registry that never stops sending cannot fill the node's
/// temporary folder.
const MAX_LAYER_BLOB: u64 = 20 << 30;

/// How to authenticate to the registry.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum RegistryAuth {
    /// No credentials.
    #[default]
    Anonymous,
    /// A user name and password (or token), sent as HTTP Basic or exchanged for a bearer
    /// token, as the registry asks.
    Basic {
        /// The user name.
        username: String,
        /// The password or access token.
        password: String,
    },
}

impl fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegistryAuth::Anonymous => f.write_str("Anonymous"),
            RegistryAuth::Basic { username, .. } => f
                .debug_struct("Basic")
                .field("username", username)
                .field("password", &"<redacted>")
                .finish(),
        }
    }
}

impl RegistryAuth {
    fn to_oci(&self) -> oci_client::secrets::RegistryAuth {
        match self {
            RegistryAuth::Anonymous => oci_client::secrets::RegistryAuth::Anonymous,
            RegistryAuth::Basic { username, password } => {
                oci_client::secrets::RegistryAuth::Basic(username.clone(), password.clone())
            }
        }
    }
}

/// One layer of a pulled image, as stored under [`Key::for_layer`]`(digest)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerBlob {
    /// `sha256:<hex>`.
    pub digest: String,
    /// Size of the blob in bytes.
    pub size: u64,
    /// e.g. `application/vnd.oci.image.layer.v1.tar+gzip`, `…tar+zstd`, `…tar`.
    pub media_type: String,
}

/// The process settings of an image config (`config` in the OCI image config JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `KEY=value` entries.
    pub env: Vec<String>,
    /// `user`, `uid`, `user:group` or `uid:gid`; `None` means root.
    pub user: Option<String>,
    /// `None` means `/`.
    pub working_dir: Option<String>,
    /// The entrypoint argv, possibly empty.
    pub entrypoint: Vec<String>,
    /// The default arguments (or command when there is no entrypoint), possibly empty.
    pub cmd: Vec<String>,
}

impl ImageConfig {
    /// Reads the process settings out of an image config JSON blob.
    pub fn from_json(json: &[u8]) -> Result<Self, serde_json::Error> {
        #[derive(Deserialize)]
        struct File {
            #[serde(default)]
            config: Option<Process>,
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "PascalCase")]
        struct Process {
            env: Option<Vec<String>>,
            user: Option<String>,
            working_dir: Option<String>,
            entrypoint: Option<Vec<String>>,
            cmd: Option<Vec<String>>,
        }
        let process = serde_json::from_slice::<File>(json)?.config;
        let Some(p) = process else {
            return Ok(ImageConfig::default());
        };
        let non_empty = |s: Option<String>| s.filter(|s| !s.is_empty());
        Ok(ImageConfig {
            env: p.env.unwrap_or_default(),
            user: non_empty(p.user),
            working_dir: non_empty(p.working_dir),
            entrypoint: p.entrypoint.unwrap_or_default(),
            cmd: p.cmd.unwrap_or_default(),
        })
    }
}

/// What [`pull_image`] copied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PulledImage {
    /// The reference pulled, normalized (`docker.io/library/alpine:latest`).
    pub reference: String,
    /// Digest of the image manifest (the linux/amd64 one when the reference named an index).
    pub digest: String,
    /// Digest of the index the manifest was chosen from, when there was one.
    pub index_digest: Option<String>,
    /// Digest of the image config blob.
    pub config_digest: String,
    /// The layers, bottom first, each stored under [`Key::for_layer`].
    pub layers: Vec<LayerBlob>,
    /// The image's process settings.
    pub config: ImageConfig,
    /// Bytes of layer blobs downloaded by this pull (cached layers, manifests and the config
    /// are not counted).
    pub fetched_bytes: u64,
    /// How many layers the store already held and were not downloaded.
    pub cached_layers: usize,
}

/// Why a pull failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The reference is not a valid image reference.
    #[error("invalid image reference {reference:?}: {reason}")]
    InvalidReference {
        /// As given.
        reference: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The registry does not know the repository, tag, manifest or a blob (HTTP 404).
    #[error("image {reference} not found in the registry: {detail}")]
    NotFound {
        /// The normalized reference.
        reference: String,
        /// The registry's answer.
        detail: String,
    },
    /// Nothing answered at the registry's address (connection refused, DNS, timeout).
    #[error("registry {registry} is unreachable: {detail}")]
    Unreachable {
        /// `host[:port]`.
        registry: String,
        /// The transport error.
        detail: String,
    },
    /// The registry refused the credentials, or requires some and none were given.
    #[error("registry {registry} refused access to {reference}: {detail}")]
    AuthRefused {
        /// `host[:port]`.
        registry: String,
        /// The normalized reference.
        reference: String,
        /// The registry's answer.
        detail: String,
    },
    /// The reference names a multi-platform index without a linux/amd64 image.
    #[error("image index {reference} has no linux/amd64 image (it has: {})", .available.join(", "))]
    NoPlatform {
        /// The normalized reference.
        reference: String,
        /// The `os/arch` of each entry.
        available: Vec<String>,
    },
    /// A blob's content did not hash to the digest that names it.
    #[error("blob {expected} of {reference} does not match its digest: the registry sent content hashing to {actual}")]
    DigestMismatch {
        /// The normalized reference.
        reference: String,
        /// The digest in the manifest.
        expected: String,
        /// The digest of what arrived.
        actual: String,
    },
    /// The image uses something this puller does not handle (e.g. a non-sha256 digest).
    #[error("image {reference} is not supported: {reason}")]
    Unsupported {
        /// The normalized reference.
        reference: String,
        /// What is not supported.
        reason: String,
    },
    /// Any other registry or transfer failure.
    #[error("pulling {reference} from {registry}: {detail}")]
    Registry {
        /// `host[:port]`.
        registry: String,
        /// The normalized reference.
        reference: String,
        /// What failed.
        detail: String,
    },
    /// Writing to the blob store or the scratch file failed.
    #[error("storing a layer: {0}")]
    Store(#[from] BlobError),
}

/// Parses an image reference as Docker does, also accepting a bracketed IPv6 registry host
/// (`[::1]:5000/name:tag`), which the `oci-spec` grammar lacks.
pub fn parse_reference(reference: &str) -> Result<Reference, PullError> {
    let invalid = |reason: String| PullError::InvalidReference {
        reference: reference.to_string(),
        reason,
    };
    if let Some(rest) = reference.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| invalid("unterminated [ in registry host".into()))?;
        host.parse::<std::net::Ipv6Addr>()
            .map_err(|e| invalid(format!("registry host [{host}]: {e}")))?;
        let (port, path) = after
            .split_once('/')
            .ok_or_else(|| invalid("no repository after the registry".into()))?;
        if !(port.is_empty() || port.strip_prefix(':').is_some_and(|p| p.parse::<u16>().is_ok())) {
            return Err(invalid(format!("bad port {port:?}")));
        }
        // Parse the rest behind a stand-in registry, then put the real one back.
        let parsed: Reference = format!("stand-in.invalid/{path}")
            .parse()
            .map_err(|e: oci_client::ParseError| invalid(e.to_string()))?;
        let registry = format!("[{host}]{port}");
        let repository = parsed.repository().to_string();
        return Ok(match (parsed.tag(), parsed.digest()) {
            (Some(tag), Some(digest)) => {
                Reference::with_tag_and_digest(registry, repository, tag.to_string(), digest.to_string())
            }
            (None, Some(digest)) => Reference::with_digest(registry, repository, digest.to_string()),
            (tag, None) => Reference::with_tag(registry, repository, tag.unwrap_or("latest").to_string()),
        });
    }
    reference
        .parse()
        .map_err(|e: oci_client::ParseError| invalid(e.to_string()))
}

/// Whether `registry` (`host[:port]`) is on this machine and so may be spoken to over HTTP.
pub fn is_loopback_registry(registry: &str) -> bool {
    let host = match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => registry.split(':').next().unwrap_or_default(),
    };
    host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// An `oci-client` client for one registry: HTTP on loopback, HTTPS elsewhere, and the
/// linux/amd64 entry of an index.
fn client_for(registry: &str, proxy: Option<&str>) -> Result<Client, OciDistributionError> {
    let protocol = if is_loopback_registry(registry) {
        ClientProtocol::HttpsExcept(vec![registry.to_string()])
    } else {
        ClientProtocol::Https
    };
    Client::try_from(ClientConfig {
        protocol,
        platform_resolver: Some(Box::new(linux_amd64_resolver)),
        connect_timeout: Some(Duration::from_secs(10)),
        read_timeout: Some(Duration::from_secs(120)),
        https_proxy: proxy.map(str::to_string),
        http_proxy: proxy.map(str::to_string),
        ..ClientConfig::default()
    })
}

/// One pull in progress: the client, the image, the credentials and the target store.
struct Pull<'a> {
    client: Client,
    image: Reference,
    auth: oci_client::secrets::RegistryAuth,
    store: &'a dyn BlobStore,
}

impl Pull<'_> {
    fn registry(&self) -> String {
        self.image.resolve_registry().to_string()
    }

    fn error(&self, e: OciDistributionError) -> PullError {
        let reference = self.image.whole();
        let registry = self.registry();
        let not_found = |detail: String| PullError::NotFound {
            reference: reference.clone(),
            detail,
        };
        let refused = |detail: String| PullError::AuthRefused {
            registry: registry.clone(),
            reference: reference.clone(),
            detail,
        };
        match e {
            OciDistributionError::RequestError(e) if e.is_connect() || e.is_timeout() => PullError::Unreachable {
                registry,
                detail: error_chain(&e),
            },
            OciDistributionError::UnauthorizedError { url } => refused(format!("401 Unauthorized for {url}")),
            OciDistributionError::AuthenticationFailure(detail) => refused(detail),
            OciDistributionError::ImageManifestNotFoundError(detail) => not_found(detail),
            OciDistributionError::RegistryError { envelope, url } => {
                let messages: Vec<String> = envelope
                    .errors
                    .iter()
                    .map(|e| {
                        if e.message.is_empty() {
                            format!("{:?}", e.code)
                        } else {
                            e.message.clone()
                        }
                    })
                    .collect();
                let detail = format!("{} ({url})", messages.join("; "));
                let codes = || envelope.errors.iter().map(|e| &e.code);
                if codes().any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied)) {
                    refused(detail)
                } else if codes().any(|c| {
                    matches!(
                        c,
                        OciErrorCode::ManifestUnknown
                            | OciErrorCode::NameUnknown
                            | OciErrorCode::NotFound
                            | OciErrorCode::BlobUnknown
                    )
                }) {
                    not_found(detail)
                } else {
                    PullError::Registry {
                        registry,
                        reference,
                        detail,
                    }
                }
            }
            OciDistributionError::ServerError {
                code: 404,
                url,
                message,
            } => not_found(format!("404 for {url}: {message}")),
            OciDistributionError::ServerError {
                code: code @ (401 | 403),
                url,
                message,
            } => refused(format!("{code} for {url}: {message}")),
            OciDistributionError::DigestError(DigestError::VerificationError { expected, actual }) => {
                PullError::DigestMismatch {
                    reference,
                    expected,
                    actual,
                }
            }
            e => PullError::Registry {
                registry,
                reference,
                detail: error_chain(&e),
            },
        }
    }

    /// Fetches the image manifest, choosing linux/amd64 from an index.
    async fn manifest(&self) -> Result<(OciImageManifest, String, Option<String>), PullError> {
        let (manifest, digest) = self
            .client
            .pull_manifest(&self.image, &self.auth)
            .await
            .map_err(|e| self.error(e))?;
        let index = match manifest {
            OciManifest::Image(manifest) => return Ok((manifest, digest, None)),
            OciManifest::ImageIndex(index) => index,
        };
        let Some(chosen) = linux_amd64_resolver(&index.manifests) else {
            let available = index
                .manifests
                .iter()
                .map(|m| {
                    m.platform
                        .as_ref()
                        .map_or("unknown".to_string(), |p| format!("{}/{}", p.os, p.architecture))
                })
                .collect();
            return Err(PullError::NoPlatform {
                reference: self.image.whole(),
                available,
            });
        };
        let platform_image = self.image.clone_with_digest(chosen);
        match self
            .client
            .pull_manifest(&platform_image, &self.auth)
            .await
            .map_err(|e| self.error(e))?
        {
            (OciManifest::Image(manifest), platform_digest) => Ok((manifest, platform_digest, Some(digest))),
            (OciManifest::ImageIndex(_), _) => Err(PullError::Unsupported {
                reference: self.image.whole(),
                reason: "the linux/amd64 entry of the index is itself an index".into(),
            }),
        }
    }

    /// Fetches and parses the config blob (its digest is verified by `oci-client`).
    async fn config(&self, descriptor: &OciDescriptor) -> Result<ImageConfig, PullError> {
        if descriptor.size > MAX_CONFIG_SIZE {
            return Err(PullError::Unsupported {
                reference: self.image.whole(),
                reason: format!(
                    "image config of {} bytes (the limit is {MAX_CONFIG_SIZE})",
                    descriptor.size
                ),
            });
        }
        // Read as a stream, at most what the manifest declares (checked above): a registry
        // sending more is refused rather than held in memory.
        let stream = self
            .client
            .pull_blob_stream(&self.image, descriptor)
            .await
            .map_err(|e| self.error(e))?;
        let mut json = Vec::new();
        let limit = u64::try_from(descriptor.size).unwrap_or(0);
        copy_verified(
            stream,
            limit,
            &descriptor.digest,
            &mut json,
            Path::new("the image config"),
        )
        .await
        .map_err(|e| match e {
            CopyError::Mismatch { actual } => PullError::DigestMismatch {
                reference: self.image.whole(),
                expected: descriptor.digest.clone(),
                actual,
            },
            CopyError::TooLong { .. } => PullError::Unsupported {
                reference: self.image.whole(),
                reason: format!(
                    "the registry sent more of image config {} than the {} bytes its manifest declares",
                    descriptor.digest, descriptor.size
                ),
            },
            CopyError::Transfer(e) => PullError::Registry {
                registry: self.registry(),
                reference: self.image.whole(),
                detail: format!("image config {}: {}", descriptor.digest, error_chain(&e)),
            },
            CopyError::Write(e) => PullError::Store(e),
        })?;
        ImageConfig::from_json(&json).map_err(|e| PullError::Registry {
            registry: self.registry(),
            reference: self.image.whole(),
            detail: format!("image config {} is not valid JSON: {e}", descriptor.digest),
        })
    }

    /// Stores one layer unless the store has it; returns it and the bytes downloaded
    /// (`None` when it was cached).
    async fn layer(&self, descriptor: &OciDescriptor) -> Result<(LayerBlob, Option<u64>), PullError> {
        let key = Key::for_layer(&descriptor.digest).map_err(|e| PullError::Unsupported {
            reference: self.image.whole(),
            reason: e.to_string(),
        })?;
        let blob = |size| LayerBlob {
            digest: descriptor.digest.clone(),
            size,
            media_type: descriptor.media_type.clone(),
        };
        let source = source_key(&self.image, &key).map_err(|e| PullError::Unsupported {
            reference: self.image.whole(),
            reason: e.to_string(),
        })?;
        let stored = self.store.exists(&key).await?;
        if let Some(size) = stored {
            if self.store.exists(&source).await?.is_some() {
                tracing::debug!(digest = %descriptor.digest, "layer already stored");
                return Ok((blob(size), None));
            }
            tracing::debug!(digest = %descriptor.digest, "layer stored, never pulled from this repository: fetched to be checked");
        }
        let declared = u64::try_from(descriptor.size).ok().filter(|&size| size > 0);
        if declared.is_some_and(|size| size > MAX_LAYER_BLOB) {
            return Err(PullError::Unsupported {
                reference: self.image.whole(),
                reason: format!(
                    "layer {} of {} bytes (the limit is {MAX_LAYER_BLOB})",
                    descriptor.digest, descriptor.size
                ),
            });
        }
        let stream = self
            .client
            .pull_blob_stream(&self.image, descriptor)
            .await
            .map_err(|e| self.error(e))?;
        let scratch = std::env::temp_dir().join("sandboxsched-layer");
        let (file, tmp) = blocking(move || TempFile::beside(&scratch)).await?;
        let size = copy_verified(
            stream,
            declared.unwrap_or(MAX_LAYER_BLOB),
            &descriptor.digest,
            tokio::fs::File::from_std(file),
            tmp.path(),
        )
        .await
        .map_err(|e| match e {
            CopyError::Mismatch { actual } => PullError::DigestMismatch {
                reference: self.image.whole(),
                expected: descriptor.digest.clone(),
                actual,
            },
            CopyError::Transfer(e) => PullError::Registry {
                registry: self.registry(),
                reference: self.image.whole(),
                detail: format!("downloading layer {}: {}", descriptor.digest, error_chain(&e)),
            },
            CopyError::Write(e) => PullError::Store(e),
            CopyError::TooLong { limit } => PullError::Registry {
                registry: self.registry(),
                reference: self.image.whole(),
                detail: format!(
                    "layer {} went on past {limit} bytes, more than its manifest declares",
                    descriptor.digest
                ),
            },
        })?;
        if stored.is_none() {
            self.store.put_file(&key, tmp.path()).await?;
        }
        self.store.put_bytes(&source, Bytes::new()).await?;
        tracing::debug!(digest = %descriptor.digest, size, "layer stored");
        Ok((blob(size), Some(size)))
    }
}

/// The mark that layer `layer` (its [`Key::for_layer`]) was pulled from `image`'s repository:
/// `layers/sources/<sha256 of registry/repository>/<the layer's hex>`.
pub fn source_key(image: &Reference, layer: &Key) -> Result<Key, BlobError> {
    let repository = format!("{}/{}", image.resolve_registry(), image.repository());
    let hashed: String = Sha256::digest(repository.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let hex = layer.as_str().rsplit('/').next().unwrap_or_default();
    Key::new(format!("layers/sources/{hashed}/{hex}"))
}

/// Why [`copy_verified`] failed.
#[derive(Debug)]
enum CopyError {
    /// The content hashed to `actual`, not to the expected digest.
    Mismatch { actual: String },
    /// The download broke off.
    Transfer(io::Error),
    /// The scratch file could not be written.
    Write(BlobError),
    /// More bytes came than the limit allows.
    TooLong { limit: u64 },
}

/// Writes `stream` to `file` (at `path`, for messages) while hashing it, and checks the hash
/// against `expected` (`sha256:<hex>`). Returns the number of bytes written.
async fn copy_verified(
    mut stream: impl Stream<Item = io::Result<Bytes>> + Unpin,
    limit: u64,
    expected: &str,
    mut file: impl tokio::io::AsyncWrite + Unpin,
    path: &Path,
) -> Result<u64, CopyError> {
    let write_err = |e| CopyError::Write(BlobError::io(format!("writing {}", path.display()), e));
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| match mismatch_in(&e) {
            Some(actual) => CopyError::Mismatch { actual },
            None => CopyError::Transfer(e),
        })?;
        size += chunk.len() as u64;
        if size > limit {
            return Err(CopyError::TooLong { limit });
        }
        hasher.update(&chunk);
        file.write_all(&chunk).await.map_err(write_err)?;
    }
    file.flush().await.map_err(write_err)?;
    let actual = format!("sha256:{:x}", hasher.finalize());
    if actual != expected {
        return Err(CopyError::Mismatch { actual });
    }
    Ok(size)
}

/// The digest a blob's bytes had, when `e` is oci-client's report that they did not match
/// (it verifies a blob's stream too, and says so as a stream error).
fn mismatch_in(e: &io::Error) -> Option<String> {
    match e.get_ref().and_then(|inner| inner.downcast_ref::<DigestError>()) {
        Some(DigestError::VerificationError { actual, .. }) => Some(actual.clone()),
        _ => None,
    }
}

/// An error and its sources, `: `-separated (reqwest's own message omits the cause).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text = format!("{text}: {s_text}");
        }
        source = s.source();
    }
    text
}

/// Copies the image `reference` from its registry into `store`; see the
/// [module documentation](self).
pub async fn pull_image(reference: &str, auth: RegistryAuth, store: &dyn BlobStore) -> Result<PulledImage, PullError> {
    pull_image_via(reference, auth, store, None).await
}

/// [`pull_image`], every connection made through the forward proxy at `proxy` (an
/// [`crate::egress::EgressProxy`]'s URL), which checks where each one goes: redirects and
/// token realms included.
pub async fn pull_image_via(
    reference: &str,
    auth: RegistryAuth,
    store: &dyn BlobStore,
    proxy: Option<&str>,
) -> Result<PulledImage, PullError> {
    let image = parse_reference(reference)?;
    let registry = image.resolve_registry().to_string();
    let client = client_for(&registry, proxy).map_err(|e| PullError::Registry {
        registry: registry.clone(),
        reference: image.whole(),
        detail: format!("cannot set up an HTTP client: {}", error_chain(&e)),
    })?;
    let pull = Pull {
        client,
        auth: auth.to_oci(),
        image,
        store,
    };
    tracing::info!(reference = %pull.image, store = %store.describe(), "pulling image");

    // Authenticating first makes an unreachable registry or refused credentials fail here,
    // with that error, rather than as an anonymous request's 401 later.
    pull.client
        .auth(&pull.image, &pull.auth, RegistryOperation::Pull)
        .await
        .map_err(|e| pull.error(e))?;
    let (manifest, digest, index_digest) = pull.manifest().await?;
    let config = pull.config(&manifest.config).await?;
    // The futures are made first: a stream mapping borrowed descriptors through a closure
    // is not `Send` for every lifetime, and callers spawn this on a multi-threaded runtime.
    let downloads: Vec<_> = manifest.layers.iter().map(|layer| pull.layer(layer)).collect();
    let fetched: Vec<(LayerBlob, Option<u64>)> = futures::stream::iter(downloads)
        .buffered(LAYERS_IN_FLIGHT)
        .try_collect()
        .await?;

    let cached_layers = fetched.iter().filter(|(_, f)| f.is_none()).count();
    let fetched_bytes = fetched.iter().filter_map(|(_, f)| *f).sum();
    let layers: Vec<LayerBlob> = fetched.into_iter().map(|(layer, _)| layer).collect();
    tracing::info!(reference = %pull.image, %digest, layers = layers.len(), cached_layers, fetched_bytes, "image pulled");
    Ok(PulledImage {
        reference: pull.image.whole(),
        digest,
        index_digest,
        config_digest: manifest.config.digest.clone(),
        layers,
        config,
        fetched_bytes,
        cached_layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_like_docker() {
        let r = parse_reference("127.0.0.1:5056/name:tag").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("127.0.0.1:5056", "name", Some("tag"))
        );
        let r = parse_reference("alpine").unwrap();
        assert_eq!(r.whole(), "docker.io/library/alpine:latest");
        assert_eq!(r.resolve_registry(), "index.docker.io");
        let digest = format!("sha256:{}", "ab".repeat(32));
        let r = parse_reference(&format!("ghcr.io/o/n@{digest}")).unwrap();
        assert_eq!(
            (r.registry(), r.tag(), r.digest()),
            ("ghcr.io", None, Some(digest.as_str()))
        );
        let r = parse_reference("[::1]:5000/a/b:v1").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("[::1]:5000", "a/b", Some("v1"))
        );
        let r = parse_reference(&format!("[::1]/x@{digest}")).unwrap();
        assert_eq!((r.registry(), r.digest()), ("[::1]", Some(digest.as_str())));
        for bad in [
            "",
            "Upper",
            "docker.io/library/Upper",
            "a:b:c",
            "[::1",
            "[nothost]:1/x",
            "name@sha256:short",
        ] {
            assert!(
                matches!(parse_reference(bad), Err(PullError::InvalidReference { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn only_loopback_registries_get_plain_http() {
        for yes in [
            "127.0.0.1:5056",
            "127.1.2.3",
            "localhost:5000",
            "LOCALHOST",
            "[::1]:5000",
            "[::1]",
        ] {
            assert!(is_loopback_registry(yes), "{yes}");
        }
        for no in [
            "index.docker.io",
            "10.0.0.1:5000",
            "ghcr.io",
            "[2001:db8::1]:5000",
            "localhost.evil.com",
        ] {
            assert!(!is_loopback_registry(no), "{no}");
        }
    }

    #[test]
    fn config_fields_are_read() {
        let json = br#"{"architecture":"amd64","os":"linux","config":{"Env":["A=1","PATH=/bin"],"User":"1000:1000",
            "WorkingDir":"/app","Entrypoint":["/bin/sh","-c"],"Cmd":["echo hi"],"Labels":{"x":"y"}},"rootfs":{}}"#;
        let c = ImageConfig::from_json(json).unwrap();
        assert_eq!(c.env, ["A=1", "PATH=/bin"]);
        assert_eq!(
            (c.user.as_deref(), c.working_dir.as_deref()),
            (Some("1000:1000"), Some("/app"))
        );
        assert_eq!(
            (c.entrypoint.len(), c.cmd.as_slice()),
            (2, ["echo hi".to_string()].as_slice())
        );
        let c = ImageConfig::from_json(br#"{"config":{"User":"","Cmd":null}}"#).unwrap();
        assert_eq!(c, ImageConfig::default());
        assert_eq!(ImageConfig::from_json(b"{}").unwrap(), ImageConfig::default());
        assert!(ImageConfig::from_json(b"[").is_err());
    }

    fn chunks(parts: &[&'static [u8]]) -> impl Stream<Item = io::Result<Bytes>> + Unpin {
        futures::stream::iter(parts.iter().map(|p| Ok(Bytes::from_static(p))).collect::<Vec<_>>())
    }

    #[tokio::test]
    async fn copies_are_verified_while_streaming() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blob");
        let digest = format!("sha256:{:x}", Sha256::digest(b"hello world"));
        let file = tokio::fs::File::create(&path).await.unwrap();
        let n = copy_verified(chunks(&[b"hello ", b"world"]), 11, &digest, file, &path)
            .await
            .unwrap();
        assert_eq!(n, 11);
        assert_eq!(std::fs::read(&path).unwrap(), b"hello world");

        let file = tokio::fs::File::create(&path).await.unwrap();
        match copy_verified(chunks(&[b"hello ", b"there"]), 11, &digest, file, &path).await {
            Err(CopyError::Mismatch { actual }) => {
                assert_eq!(actual, format!("sha256:{:x}", Sha256::digest(b"hello there")))
            }
            other => panic!("expected a digest mismatch, got {other:?}"),
        }
        let broken = futures::stream::iter(vec![Ok(Bytes::from_static(b"x")), Err(io::Error::other("reset"))]);
        let file = tokio::fs::File::create(&path).await.unwrap();
        assert!(matches!(
            copy_verified(broken, 11, &digest, file, &path).await,
            Err(CopyError::Transfer(_))
        ));
        // A registry that goes on past what the manifest declares is cut off there.
        let endless = futures::stream::iter(std::iter::repeat_with(|| Ok(Bytes::from_static(b"xxxxxxxx"))));
        let file = tokio::fs::File::create(&path).await.unwrap();
        assert!(matches!(
            copy_verified(endless, 1 << 16, &digest, file, &path).await,
            Err(CopyError::TooLong { limit: 65536 })
        ));
        assert!(std::fs::metadata(&path).unwrap().len() <= 1 << 16);
    }

    /// What a fake registry answers: status line, extra headers, content type and body.
    type Answer = (&'static str, String, &'static str, Vec<u8>);

    /// Serves HTTP/1.1 on a loopback port, answering each request from its request line.
    async fn fake_registry(
        answer: impl Fn(&str) -> Answer + Send + Sync + 'static,
    ) -> (u16, tokio::task::JoinHandle<()>) {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let answer = std::sync::Arc::new(answer);
        let server = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let answer = answer.clone();
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let line = String::from_utf8_lossy(&request)
                        .lines()
                        .next()
                        .unwrap_or_default()
                        .to_string();
                    let (status, headers, content_type, body) = answer(&line);
                    let head = format!(
                        "HTTP/1.1 {status}\r\n{headers}Content-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = conn.write_all(head.as_bytes()).await;
                    let _ = conn.write_all(&body).await;
                });
            }
        });
        (port, server)
    }

    /// A fake registry serving one image: its config, and a manifest naming one layer of
    /// `digest` and `size`, whose blob `blob` answers.
    async fn one_layer_registry(
        digest: &str,
        size: usize,
        blob: impl Fn() -> Answer + Send + Sync + 'static,
    ) -> (u16, tokio::task::JoinHandle<()>) {
        let config = br#"{"config":{"Cmd":["sh"]}}"#.to_vec();
        let config_digest = format!("sha256:{:x}", Sha256::digest(&config));
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": size}],
        })
        .to_string();
        fake_registry(move |line| {
            let ok = "200 OK";
            if line.contains("/manifests/") {
                (
                    ok,
                    String::new(),
                    "application/vnd.oci.image.manifest.v1+json",
                    manifest.clone().into_bytes(),
                )
            } else if line.contains(&config_digest) {
                (ok, String::new(), "application/octet-stream", config.clone())
            } else if line.contains("/blobs/") {
                blob()
            } else {
                (ok, String::new(), "application/json", b"{}".to_vec())
            }
        })
        .await
    }

    /// A registry's redirect is a connection the puller did not choose: through the egress
    /// proxy it is held to the same rules as the registry's own name, and a destination the
    /// proxy refuses is never reached. (Without the proxy, in the same run, it is.)
    #[tokio::test]
    async fn a_registry_cannot_send_a_pull_where_it_may_not_go() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let secret = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let secret_port = secret.local_addr().unwrap().port();
        let reached = std::sync::Arc::new(AtomicUsize::new(0));
        let counter = reached.clone();
        let secret_server = tokio::spawn(async move {
            while let Ok((conn, _)) = secret.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                drop(conn);
            }
        });
        let claimed = format!("sha256:{:x}", Sha256::digest(b"a layer"));
        let (port, server) = one_layer_registry(&claimed, 7, move || {
            let to = format!("Location: http://localhost:{secret_port}/latest/meta-data\r\n");
            ("307 Temporary Redirect", to, "text/plain", Vec::new())
        })
        .await;
        let registry = format!("127.0.0.1:{port}");
        let only = registry.clone();
        let proxy = crate::egress::EgressProxy::start(move |authority: &str, _: std::net::IpAddr| authority == only)
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::LocalDir::new(dir.path()).unwrap();
        let reference = format!("{registry}/redirects:1");
        let err = pull_image_via(&reference, RegistryAuth::Anonymous, &store, Some(&proxy.url()))
            .await
            .unwrap_err();
        assert_eq!(
            reached.load(Ordering::SeqCst),
            0,
            "the proxy let the redirect through: {err}"
        );
        pull_image(&reference, RegistryAuth::Anonymous, &store)
            .await
            .unwrap_err();
        assert!(
            reached.load(Ordering::SeqCst) > 0,
            "without the proxy the redirect is followed"
        );
        server.abort();
        secret_server.abort();
    }

    /// A layer the store holds (another team's private layer, say) is not handed to a pull
    /// from a repository it never came from, whose manifest merely names its digest: that
    /// registry must serve the bytes, and this one cannot.
    #[tokio::test]
    async fn a_stored_layer_is_not_given_to_whoever_names_its_digest() {
        let private = b"another team's private layer".to_vec();
        let claimed = format!("sha256:{:x}", Sha256::digest(&private));
        let (port, server) = one_layer_registry(&claimed, private.len(), || {
            let unknown = br#"{"errors":[{"code":"BLOB_UNKNOWN"}]}"#.to_vec();
            ("404 Not Found", String::new(), "application/json", unknown)
        })
        .await;
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::LocalDir::new(dir.path()).unwrap();
        let layer = Key::for_layer(&claimed).unwrap();
        store.put_bytes(&layer, Bytes::from(private)).await.unwrap();
        let err = pull_image(&format!("127.0.0.1:{port}/thief:1"), RegistryAuth::Anonymous, &store)
            .await
            .unwrap_err();
        assert!(err.to_string().contains(&claimed), "{err}");
        // Once the repository it came from is noted, the same pull finds it stored.
        let image: Reference = format!("127.0.0.1:{port}/thief:1").parse().unwrap();
        store
            .put_bytes(&source_key(&image, &layer).unwrap(), Bytes::new())
            .await
            .unwrap();
        let pulled = pull_image(&format!("127.0.0.1:{port}/thief:1"), RegistryAuth::Anonymous, &store)
            .await
            .unwrap();
        assert_eq!(pulled.cached_layers, 1);
        server.abort();
    }

    /// A mismatching layer never reaches the store: the fake registry serves a manifest whose
    /// layer digest does not match the layer's bytes (a real registry would refuse the push).
    #[tokio::test]
    async fn a_digest_mismatch_stores_nothing() {
        let claimed = format!("sha256:{:x}", Sha256::digest(b"the real layer"));
        let (port, server) = one_layer_registry(&claimed, 14, || {
            (
                "200 OK",
                String::new(),
                "application/octet-stream",
                b"a forged layer".to_vec(),
            )
        })
        .await;
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::LocalDir::new(dir.path()).unwrap();
        let err = pull_image(&format!("127.0.0.1:{port}/forged:1"), RegistryAuth::Anonymous, &store)
            .await
            .unwrap_err();
        println!("{err}");
        assert!(matches!(err, PullError::DigestMismatch { .. }), "{err}");
        assert!(err.to_string().contains("does not match its digest"), "{err}");
        assert_eq!(store.exists(&Key::for_layer(&claimed).unwrap()).await.unwrap(), None);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "nothing may be stored"
        );
        server.abort();
    }

    /// A registry that wants credentials it was not given (or refuses the ones it was).
    #[tokio::test]
    async fn refused_credentials_are_a_clear_error() {
        let (port, server) = fake_registry(|_| {
            let challenge = "WWW-Authenticate: Basic realm=\"test\"\r\n".to_string();
            let body = br#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}"#.to_vec();
            ("401 Unauthorized", challenge, "application/json", body)
        })
        .await;
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::LocalDir::new(dir.path()).unwrap();
        for auth in [
            RegistryAuth::Anonymous,
            RegistryAuth::Basic {
                username: "u".into(),
                password: "wrong".into(),
            },
        ] {
            let err = pull_image(&format!("localhost:{port}/private:1"), auth, &store)
                .await
                .unwrap_err();
            println!("{err}");
            assert!(matches!(err, PullError::AuthRefused { .. }), "{err:?}");
            assert!(err.to_string().contains("refused access"), "{err}");
        }
        server.abort();
    }
}
