//! [`S3`]: blobs as objects in an S3 bucket, for a cluster whose machines share no disk.
//!
//! Any server speaking the S3 API works (AWS, MinIO, Ceph RGW, moto in the tests); requests go
//! through the `object_store` crate's `AmazonS3` client with path-style URLs
//! (`http://endpoint/bucket/key`), which every S3 clone understands, rather than AWS's
//! virtual-hosted style (`http://bucket.endpoint/key`), which needs wildcard DNS.
//!
//! Big files are streamed both ways. Uploads over [`SINGLE_PUT_MAX`] use a multipart upload of
//! [`PART_SIZE`] parts with at most [`PARTS_IN_FLIGHT`] uploading at once, so memory stays
//! around 40 MiB whatever the file size; S3 publishes the object only when the upload
//! completes, so readers never see part of it, and a failed upload is aborted. Downloads are
//! written chunk by chunk to a temporary file beside the destination and renamed into place.
//!
//! Plain-HTTP endpoints are accepted only on loopback (a test server, a local MinIO) unless
//! [`S3Config::allow_http`] says otherwise: credentials must not cross a network in the clear
//! by accident.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutPayload, WriteMultipart};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{blocking, BlobError, BlobStore, Key, TempFile};

/// Files up to this size are uploaded with one PUT; larger ones with a multipart upload.
pub const SINGLE_PUT_MAX: u64 = 8 << 20;
/// The part size of multipart uploads (S3's minimum is 5 MiB, its maximum part count 10,000:
/// 8 MiB parts allow objects of up to 78 GiB).
pub const PART_SIZE: usize = 8 << 20;
/// How many parts of one upload are sent concurrently.
pub const PARTS_IN_FLIGHT: usize = 4;
/// How much of a file is read at a time while uploading.
const READ_CHUNK: usize = 1 << 20;

/// Where an [`S3`] store lives and how to sign requests to it.
#[derive(Clone, Default)]
pub struct S3Config {
    /// The bucket, which must already exist.
    pub bucket: String,
    /// A key prefix inside the bucket (`a/b`, no leading or trailing `/`), or empty.
    pub prefix: String,
    /// The server's base URL, e.g. `http://127.0.0.1:5055`; `None` means AWS itself.
    pub endpoint: Option<String>,
    /// The region requests are signed for, e.g. `us-east-1`.
    pub region: String,
    /// Static credentials; when both are `None`, object_store's default AWS chain
    /// (instance metadata, web identity) is used.
    pub access_key_id: Option<String>,
    /// See [`S3Config::access_key_id`].
    pub secret_access_key: Option<String>,
    /// A session token to go with temporary credentials.
    pub session_token: Option<String>,
    /// Accept a plain-HTTP endpoint that is not on loopback.
    pub allow_http: bool,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field(
                "secret_access_key",
                &self.secret_access_key.as_ref().map(|_| "<redacted>"),
            )
            .field("session_token", &self.session_token.as_ref().map(|_| "<redacted>"))
            .field("allow_http", &self.allow_http)
            .finish()
    }
}

impl S3Config {
    /// Reads an `s3://bucket[/prefix]?endpoint=…&region=…` URL; see [`super::from_url`].
    pub(crate) fn from_url(url: &url::Url) -> Result<Self, BlobError> {
        let invalid = |msg: String| BlobError::Invalid(format!("blob store URL {:?}: {msg}", url.as_str()));
        let bucket = url.host_str().unwrap_or_default();
        if bucket.is_empty() {
            return Err(invalid("no bucket: expected s3://BUCKET[/PREFIX]?endpoint=…".into()));
        }
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let mut config = S3Config {
            bucket: bucket.to_string(),
            prefix: url.path().trim_matches('/').to_string(),
            region: env("AWS_REGION").unwrap_or_else(|| "us-east-1".into()),
            ..S3Config::default()
        };
        for (name, value) in url.query_pairs() {
            let value = value.into_owned();
            match name.as_ref() {
                "endpoint" => config.endpoint = Some(value),
                "region" => config.region = value,
                "access_key_id" => config.access_key_id = Some(value),
                "secret_access_key" => config.secret_access_key = Some(value),
                "session_token" => config.session_token = Some(value),
                "allow_http" => {
                    config.allow_http = value.parse().map_err(|_| invalid(format!("allow_http={value:?}")))?
                }
                other => return Err(invalid(format!("unknown parameter {other:?}"))),
            }
        }
        if config.access_key_id.is_none() && config.secret_access_key.is_none() {
            config.access_key_id = env("AWS_ACCESS_KEY_ID");
            config.secret_access_key = env("AWS_SECRET_ACCESS_KEY");
            config.session_token = config.session_token.or_else(|| env("AWS_SESSION_TOKEN"));
        }
        Ok(config)
    }
}

/// A blob store in an S3 bucket. See the [module documentation](self).
pub struct S3 {
    client: Arc<AmazonS3>,
    config: S3Config,
}

impl fmt::Debug for S3 {
    /// The config with its secrets redacted (the client's own `Debug` would show them).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Whether `endpoint` is a plain-HTTP URL on a loopback host.
fn is_loopback_http(endpoint: &url::Url) -> bool {
    endpoint.scheme() == "http"
        && match endpoint.host() {
            Some(url::Host::Domain(d)) => d == "localhost",
            Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
            Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
            None => false,
        }
}

impl S3 {
    /// Checks `config` and builds the client (no request is made yet).
    pub fn new(config: S3Config) -> Result<Self, BlobError> {
        let invalid = |msg: String| BlobError::Invalid(format!("S3 store: {msg}"));
        if config.bucket.is_empty() {
            return Err(invalid("no bucket given".into()));
        }
        if !config.prefix.is_empty() {
            Key::new(config.prefix.as_str()).map_err(|e| invalid(format!("prefix {:?}: {e}", config.prefix)))?;
        }
        if config.access_key_id.is_some() != config.secret_access_key.is_some() {
            return Err(invalid(
                "give both an access key id and a secret access key, or neither".into(),
            ));
        }
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_virtual_hosted_style_request(false);
        if let Some(endpoint) = &config.endpoint {
            let url = url::Url::parse(endpoint).map_err(|e| invalid(format!("endpoint {endpoint:?}: {e}")))?;
            match url.scheme() {
                "https" => {}
                "http" if config.allow_http || is_loopback_http(&url) => builder = builder.with_allow_http(true),
                "http" => {
                    return Err(invalid(format!(
                        "endpoint {endpoint:?} is plain HTTP and not on loopback; use https or set allow_http"
                    )))
                }
                other => {
                    return Err(invalid(format!(
                        "endpoint {endpoint:?} has unsupported scheme {other:?}"
                    )))
                }
            }
            builder = builder.with_endpoint(endpoint);
        }
        if let (Some(id), Some(secret)) = (&config.access_key_id, &config.secret_access_key) {
            builder = builder.with_access_key_id(id).with_secret_access_key(secret);
            if let Some(token) = &config.session_token {
                builder = builder.with_token(token);
            }
        }
        let client = builder.build().map_err(|e| invalid(e.to_string()))?;
        Ok(S3 {
            client: Arc::new(client),
            config,
        })
    }

    /// The object name of `key`, below the prefix.
    fn location(&self, key: &Key) -> Result<ObjectPath, BlobError> {
        let name = if self.config.prefix.is_empty() {
            key.as_str().to_string()
        } else {
            format!("{}/{}", self.config.prefix, key)
        };
        ObjectPath::parse(&name).map_err(|e| BlobError::Invalid(format!("object name {name:?}: {e}")))
    }

    /// Maps an object_store error from a read, turning "no such object" into
    /// [`BlobError::NotFound`].
    fn error(&self, what: &str, key: &Key, e: object_store::Error) -> BlobError {
        match e {
            object_store::Error::NotFound { .. } => BlobError::NotFound(key.clone()),
            e => self.write_error(what, key, e),
        }
    }

    /// Maps an object_store error from a write, where a 404 means a missing bucket, not blob.
    fn write_error(&self, what: &str, key: &Key, e: object_store::Error) -> BlobError {
        BlobError::Backend(format!("{what} {key} in s3://{}: {e}", self.config.bucket))
    }

    async fn upload_file(&self, key: &Key, path: &Path) -> Result<(), BlobError> {
        let location = self.location(key)?;
        let io_err = |what: &str, e| BlobError::io(format!("{what} {}", path.display()), e);
        let mut file = tokio::fs::File::open(path).await.map_err(|e| io_err("opening", e))?;
        let len = file.metadata().await.map_err(|e| io_err("inspecting", e))?.len();
        if len <= SINGLE_PUT_MAX {
            let mut data = Vec::with_capacity(len as usize);
            file.read_to_end(&mut data).await.map_err(|e| io_err("reading", e))?;
            self.client
                .put(&location, PutPayload::from(data))
                .await
                .map_err(|e| self.write_error("uploading", key, e))?;
            return Ok(());
        }
        let upload = self
            .client
            .put_multipart(&location)
            .await
            .map_err(|e| self.write_error("starting upload of", key, e))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
        let fed: Result<(), BlobError> = async {
            loop {
                writer
                    .wait_for_capacity(PARTS_IN_FLIGHT)
                    .await
                    .map_err(|e| self.write_error("uploading", key, e))?;
                let mut chunk = BytesMut::with_capacity(READ_CHUNK);
                if file.read_buf(&mut chunk).await.map_err(|e| io_err("reading", e))? == 0 {
                    return Ok(());
                }
                writer.put(chunk.freeze());
            }
        }
        .await;
        match fed {
            Ok(()) => writer
                .finish()
                .await
                .map(drop)
                .map_err(|e| self.write_error("completing upload of", key, e)),
            Err(e) => {
                if let Err(abort) = writer.abort().await {
                    tracing::warn!(%key, error = %abort, "could not abort failed multipart upload");
                }
                Err(e)
            }
        }
    }

    async fn download_file(&self, key: &Key, dest: &Path) -> Result<u64, BlobError> {
        let location = self.location(key)?;
        let result = self
            .client
            .get(&location)
            .await
            .map_err(|e| self.error("downloading", key, e))?;
        let owned_dest = dest.to_path_buf();
        let (file, tmp) = blocking(move || TempFile::beside(&owned_dest)).await?;
        let io_err = |e| BlobError::io(format!("writing {}", tmp.path().display()), e);
        let mut file = tokio::fs::File::from_std(file);
        let mut stream = result.into_stream();
        let mut size = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.error("downloading", key, e))?;
            file.write_all(&chunk).await.map_err(io_err)?;
            size += chunk.len() as u64;
        }
        file.flush().await.map_err(io_err)?;
        file.sync_all().await.map_err(io_err)?;
        drop(file);
        let dest = dest.to_path_buf();
        blocking(move || tmp.commit(&dest)).await?;
        Ok(size)
    }
}

impl BlobStore for S3 {
    fn put_file<'a>(&'a self, key: &'a Key, path: &'a Path) -> BoxFuture<'a, Result<(), BlobError>> {
        self.upload_file(key, path).boxed()
    }

    fn put_bytes<'a>(&'a self, key: &'a Key, data: Bytes) -> BoxFuture<'a, Result<(), BlobError>> {
        async move {
            let location = self.location(key)?;
            self.client
                .put(&location, PutPayload::from(data))
                .await
                .map_err(|e| self.write_error("uploading", key, e))?;
            Ok(())
        }
        .boxed()
    }

    fn get_to_file<'a>(&'a self, key: &'a Key, path: &'a Path) -> BoxFuture<'a, Result<u64, BlobError>> {
        self.download_file(key, path).boxed()
    }

    fn get_bytes<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Bytes, BlobError>> {
        async move {
            let location = self.location(key)?;
            let result = self
                .client
                .get(&location)
                .await
                .map_err(|e| self.error("downloading", key, e))?;
            result.bytes().await.map_err(|e| self.error("downloading", key, e))
        }
        .boxed()
    }

    fn exists<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<u64>, BlobError>> {
        async move {
            let location = self.location(key)?;
            match self.client.head(&location).await {
                Ok(meta) => Ok(Some(meta.size)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.error("inspecting", key, e)),
            }
        }
        .boxed()
    }

    fn delete<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<(), BlobError>> {
        async move {
            let location = self.location(key)?;
            match self.client.delete(&location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(self.write_error("deleting", key, e)),
            }
        }
        .boxed()
    }

    fn describe(&self) -> String {
        let endpoint = self.config.endpoint.as_deref().unwrap_or("AWS");
        if self.config.prefix.is_empty() {
            format!("s3 bucket {} at {endpoint}", self.config.bucket)
        } else {
            format!(
                "s3 bucket {} prefix {} at {endpoint}",
                self.config.bucket, self.config.prefix
            )
        }
    }
}
