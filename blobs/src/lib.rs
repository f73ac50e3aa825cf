//! Blob storage shared by the nodes and gateways of a sandboxsched cluster.
//!
//! Three kinds of large, immutable-ish files travel between machines: template layers (OCI
//! layer blobs, named by their sha256 digest), build-context file archives and sandbox
//! snapshots. None of them belongs in the ledger database, and none of them should be copied
//! around by hand; they go into a *blob store* under a [`store::Key`] such as
//! `layers/sha256/<hex>`, `files/<hash>` or `snapshots/<id>`, and any machine that needs one
//! fetches it by key.
//!
//! - [`store`] defines the [`BlobStore`] trait and its two backends: [`LocalDir`] (a directory,
//!   the embedded default for a single host) and [`S3`] (any S3 API server, for a cluster).
//!   [`from_url`] picks one from a URL given on the command line or in a config file.
//! - [`registry`] copies an OCI image from a registry into a blob store: every layer is
//!   streamed, verified against its digest and stored once under `layers/sha256/<hex>`, and
//!   the image config's process settings (`Env`, `User`, `WorkingDir`, `Entrypoint`, `Cmd`)
//!   are returned for the template builder.
//! - [`egress`] is the forward proxy a pull can go through, which checks every connection it
//!   makes (a registry's redirects and token realms included) against where it may go.

pub mod egress;
pub mod registry;
pub mod store;

pub use registry::{pull_image, ImageConfig, LayerBlob, PullError, PulledImage, RegistryAuth};
pub use store::{from_url, BlobError, BlobStore, Key, LocalDir, S3Config, S3};
