//! Conversion between the two forms a template layer takes in sandboxsched.
//!
//! On a host, a layer is a directory used as an overlayfs *lowerdir*: whiteouts are character
//! devices 0/0, opaque directories carry `trusted.overlay.opaque=y`, and every file is owned by
//! the *shifted* ids of the sandbox user namespace (uid `N` inside is `shift + N` outside).
//! Between hosts and registries, a layer is an OCI layer blob: a tar stream (usually gzip
//! compressed) named by its sha256 digest, where whiteouts are `.wh.NAME` marker files and ids are
//! the unshifted ones seen inside the container.
//!
//! * [`digest`] names blobs and hashes streams as they pass.
//! * [`unpack`] applies a pulled layer blob to a fresh directory ([`unpack::unpack_layer`]),
//!   and is the one path by which a node applies any archive: a sandbox's snapshot (a move's
//!   target, a wake from hibernation) goes through it too, by its own [`unpack::Rules`].
//! * [`pack`] turns the upper directory of a build step into a layer blob ([`pack::pack_layer`]).
//! * [`files`] extracts a user-supplied archive for COPY-like build steps
//!   ([`files::extract_files`]).
//! * [`headers`] bounds what an archive's own descriptions of its entries (long names, PAX
//!   headers) may make a reader hold in memory; every archive read here passes through it.
//!
//! All content is untrusted: images come from anywhere and upper directories are written by
//! code running as root inside a container. Extraction therefore works on directory file
//! descriptors and never follows a symlink found on disk (see the private `safefs` module), and
//! ids are confined to the [`ID_RANGE`] ids a sandbox user namespace maps.

pub mod digest;
pub mod files;
pub mod headers;
pub mod pack;
mod safefs;
pub mod unpack;

pub use digest::{Digest, DigestReader, DigestWriter};
pub use files::{extract_files, FilesError};
pub use pack::{pack_layer, PackError, PackedLayer};
pub use safefs::SafeFsError;
pub use unpack::{unpack_archive, unpack_layer, Compression, Rules, UnpackError, UnpackStats, LITERAL_RECORD};

/// Number of ids a sandbox user namespace maps: ids `0..ID_RANGE` inside are
/// `shift..shift + ID_RANGE` on the host. Ids outside that range are refused in both directions,
/// so that a layer can never produce files owned by host users or by another sandbox's range.
pub const ID_RANGE: u32 = 65536;

#[cfg(test)]
mod testutil;
