//! File metadata: small `key → value` strings a user attaches to a file when uploading it,
//! kept on the file itself as Linux extended attributes (xattrs), so they travel with the
//! file on rename, survive envd restarts and need no database.
//!
//! How it works, end to end:
//!
//! 1. The SDK sends each pair as an upload header `X-Metadata-<key>: <value>`. HTTP header
//!    names are case-insensitive, so the key is the rest of the name, lowercased ([`parse`]).
//! 2. Before anything is written the pairs are checked: keys and values printable US-ASCII
//!    (0x20-0x7E), a key at most [`MAX_KEY`] bytes, all pairs together at most [`MAX_TOTAL`]
//!    bytes. A refusal is an [`InvalidMetadata`], answered 400.
//! 3. Once the file's content is written, its metadata is *replaced* ([`replace`]): every
//!    `user.e2b.<key>` xattr the upload did not name is removed and the named ones are set. An
//!    upload without metadata therefore clears it.
//! 4. Every `EntryInfo` (Stat, ListDir, watch events) carries the map read back by [`read`].
//!
//! Why `user.e2b.`: Linux has xattr namespaces (`security.`, `trusted.`, `system.`, `user.`);
//! only `user.` is meant for arbitrary application data, and the `e2b.` sub-prefix keeps our
//! keys apart from other tools' `user.*` attributes (which are neither shown nor removed). The
//! kernel caps an xattr name at 255 bytes; minus the 9-byte `user.e2b.` that leaves 246 for
//! the key. The 4096-byte total keeps all of a file's metadata inside what common filesystems
//! (ext4's one xattr block per inode, for instance) can hold.
//!
//! Extended attributes live on the inode, not the name. Reading for an `EntryInfo` uses the
//! `l*` calls so a symlink's own attributes are read rather than its target's (Linux allows no
//! `user.*` xattrs on symlinks, so a symlink simply shows none); writing uses the descriptor
//! envd already has open on the uploaded file, so no path can be swapped underneath it. envd
//! writes as root, which may set `user.*` attributes on any file, including the ones it has
//! just handed to the requesting user.
//!
//! Some filesystems (tmpfs before Linux 6.6, vfat, some FUSE mounts) have no `user.*` xattrs:
//! there [`replace`] fails with `ENOTSUP` only when metadata was asked for (see
//! [`is_unsupported`]), and [`read`] fails the same way; callers treat that as "no metadata".

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use axum::http::HeaderMap;

/// A file's metadata: key (without any prefix) to value.
pub type Metadata = BTreeMap<String, String>;

/// The upload header prefix, as HTTP/1 and HTTP/2 carry names: lowercase.
pub const HEADER_PREFIX: &str = "x-metadata-";
/// The xattr namespace the keys live under.
pub const XATTR_PREFIX: &str = "user.e2b.";
/// The longest key: the kernel's 255-byte xattr name limit minus [`XATTR_PREFIX`].
pub const MAX_KEY: usize = 255 - XATTR_PREFIX.len();
/// The most all of one file's metadata may take, counting [`XATTR_PREFIX`] once per key.
pub const MAX_TOTAL: usize = 4096;

/// Why an upload's metadata headers are refused (HTTP 400).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidMetadata {
    #[error("a metadata header needs a key after `X-Metadata-`")]
    EmptyKey,
    #[error("metadata key {0:?} must be printable US-ASCII (bytes 0x20-0x7E)")]
    KeyNotPrintable(String),
    #[error("metadata key {key:?} is {len} bytes long; at most {MAX_KEY} are allowed")]
    KeyTooLong { key: String, len: usize },
    #[error("the value of metadata key {0:?} must be printable US-ASCII (bytes 0x20-0x7E)")]
    ValueNotPrintable(String),
    #[error(
        "the metadata takes {total} bytes (each key counted with its {} bytes of `{XATTR_PREFIX}`); at most {MAX_TOTAL} are allowed",
        XATTR_PREFIX.len()
    )]
    TooLarge { total: usize },
}

/// The metadata an upload's headers carry (the first value of each).
pub fn from_headers(headers: &HeaderMap) -> Result<Metadata, InvalidMetadata> {
    parse(
        headers
            .keys()
            .filter_map(|name| headers.get(name).map(|value| (name.as_str(), value.as_bytes()))),
    )
}

/// The metadata in `headers` (name, value pairs in the order received): names starting with
/// `X-Metadata-` in any case, keyed by the rest of the name lowercased. The first value of a
/// key wins; later ones are ignored unchecked.
pub fn parse<'a>(headers: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Result<Metadata, InvalidMetadata> {
    let mut metadata = Metadata::new();
    for (name, value) in headers {
        let Some(key) = name
            .get(..HEADER_PREFIX.len())
            .filter(|prefix| prefix.eq_ignore_ascii_case(HEADER_PREFIX))
            .map(|_| &name[HEADER_PREFIX.len()..])
        else {
            continue;
        };
        if key.is_empty() {
            return Err(InvalidMetadata::EmptyKey);
        }
        if !printable(key.as_bytes()) {
            return Err(InvalidMetadata::KeyNotPrintable(key.to_string()));
        }
        let key = key.to_ascii_lowercase();
        if key.len() > MAX_KEY {
            return Err(InvalidMetadata::KeyTooLong { len: key.len(), key });
        }
        if metadata.contains_key(&key) {
            continue;
        }
        // Printable ASCII is UTF-8, so the conversion below cannot fail once this holds.
        let value = match std::str::from_utf8(value) {
            Ok(value) if printable(value.as_bytes()) => value.to_string(),
            _ => return Err(InvalidMetadata::ValueNotPrintable(key)),
        };
        metadata.insert(key, value);
    }
    let total = metadata
        .iter()
        .map(|(key, value)| XATTR_PREFIX.len() + key.len() + value.len())
        .sum();
    if total > MAX_TOTAL {
        return Err(InvalidMetadata::TooLarge { total });
    }
    Ok(metadata)
}

fn printable(bytes: &[u8]) -> bool {
    bytes.iter().all(|b| (0x20..=0x7e).contains(b))
}

/// The names in a `listxattr` answer (each NUL-terminated).
fn names(list: &[u8]) -> impl Iterator<Item = &[u8]> {
    list.split(|b| *b == 0).filter(|name| !name.is_empty())
}

/// The metadata key an xattr name holds, if it is one of ours.
fn key_of(name: &[u8]) -> Option<&[u8]> {
    name.strip_prefix(XATTR_PREFIX.as_bytes()).filter(|key| !key.is_empty())
}

/// Whether `err` says the filesystem has no (user) extended attributes.
pub fn is_unsupported(err: &io::Error) -> bool {
    // ENOTSUP and EOPNOTSUPP are one number on Linux; std maps it to no ErrorKind of its own.
    err.raw_os_error() == Some(rustix::io::Errno::NOTSUP.raw_os_error())
}

/// The metadata of the entry at `path`, not following a final symlink. Attributes removed
/// while being read are skipped; values that are not UTF-8 (set by other tools) are shown
/// lossily.
pub fn read(path: &Path) -> io::Result<Metadata> {
    let at = At::Link(CString::new(path.as_os_str().as_bytes())?);
    let list = at.list()?;
    let mut metadata = Metadata::new();
    for name in names(&list) {
        let Some(key) = key_of(name) else { continue };
        let value = match at.get(&CString::new(name)?) {
            Ok(value) => value,
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NODATA.raw_os_error()) => continue,
            Err(e) => return Err(e),
        };
        metadata.insert(
            String::from_utf8_lossy(key).into_owned(),
            String::from_utf8_lossy(&value).into_owned(),
        );
    }
    Ok(metadata)
}

/// Makes `metadata` the whole metadata of the open file `file`: our attributes it does not
/// name are removed first (freeing their space), then each of its pairs is set. With no
/// metadata on a filesystem without xattrs there is nothing to clear, so that succeeds.
pub fn replace(file: BorrowedFd<'_>, metadata: &Metadata) -> io::Result<()> {
    let at = At::Fd(file);
    let existing = match at.list() {
        Ok(list) => list,
        Err(e) if metadata.is_empty() && is_unsupported(&e) => return Ok(()),
        Err(e) => return Err(e),
    };
    for name in names(&existing) {
        let Some(key) = key_of(name) else { continue };
        let kept = std::str::from_utf8(key).is_ok_and(|key| metadata.contains_key(key));
        if !kept {
            match at.remove(&CString::new(name)?) {
                Err(e) if e.raw_os_error() != Some(rustix::io::Errno::NODATA.raw_os_error()) => return Err(e),
                _ => {}
            }
        }
    }
    for (key, value) in metadata {
        at.set(&CString::new(format!("{XATTR_PREFIX}{key}"))?, value.as_bytes())?;
    }
    Ok(())
}

/// What an xattr call acts on: a path whose final symlink is not followed (the `l*` calls), or
/// an open file (the `f*` calls).
enum At<'a> {
    Link(CString),
    Fd(BorrowedFd<'a>),
}

impl At<'_> {
    /// The raw, NUL-separated list of attribute names.
    fn list(&self) -> io::Result<Vec<u8>> {
        sized(
            || match self {
                At::Link(path) => rustix::fs::llistxattr_query(path.as_c_str()),
                At::Fd(fd) => rustix::fs::flistxattr_query(fd),
            },
            |buf| match self {
                At::Link(path) => rustix::fs::llistxattr(path.as_c_str(), buf),
                At::Fd(fd) => rustix::fs::flistxattr(fd, buf),
            },
        )
    }

    fn get(&self, name: &CStr) -> io::Result<Vec<u8>> {
        sized(
            || match self {
                At::Link(path) => rustix::fs::lgetxattr_query(path.as_c_str(), name),
                At::Fd(fd) => rustix::fs::fgetxattr_query(fd, name),
            },
            |buf| match self {
                At::Link(path) => rustix::fs::lgetxattr(path.as_c_str(), name, buf),
                At::Fd(fd) => rustix::fs::fgetxattr(fd, name, buf),
            },
        )
    }

    fn set(&self, name: &CStr, value: &[u8]) -> io::Result<()> {
        let flags = rustix::fs::XattrFlags::empty();
        Ok(match self {
            At::Link(path) => rustix::fs::lsetxattr(path.as_c_str(), name, value, flags),
            At::Fd(fd) => rustix::fs::fsetxattr(fd, name, value, flags),
        }?)
    }

    fn remove(&self, name: &CStr) -> io::Result<()> {
        Ok(match self {
            At::Link(path) => rustix::fs::lremovexattr(path.as_c_str(), name),
            At::Fd(fd) => rustix::fs::fremovexattr(fd, name),
        }?)
    }
}

/// Runs an xattr read the kernel's way: ask the size, then read into a buffer that big,
/// again if the attributes grew in between (`ERANGE`).
fn sized(
    query: impl Fn() -> rustix::io::Result<usize>,
    mut read: impl FnMut(&mut [u8]) -> rustix::io::Result<usize>,
) -> io::Result<Vec<u8>> {
    for _ in 0..8 {
        let mut buf = vec![0u8; query()?];
        if buf.is_empty() {
            return Ok(buf);
        }
        match read(&mut buf) {
            Ok(got) => {
                buf.truncate(got);
                return Ok(buf);
            }
            Err(rustix::io::Errno::RANGE) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Err(io::Error::other("extended attributes kept growing while being read"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(headers: &[(&str, &str)]) -> Result<Metadata, InvalidMetadata> {
        parse(headers.iter().map(|(n, v)| (*n, v.as_bytes())))
    }

    #[test]
    fn keys_are_the_header_names_rest_lowercased_and_other_headers_are_ignored() {
        let metadata = parsed(&[
            ("X-Metadata-Owner", "Alice"),
            ("x-metadata-BUILD-id", "42"),
            ("Content-Type", "application/octet-stream"),
            ("X-Metadata", "not ours"),
            ("x-metadata-empty-value", ""),
        ])
        .unwrap();
        assert_eq!(
            metadata,
            Metadata::from([
                ("owner".to_string(), "Alice".to_string()),
                ("build-id".to_string(), "42".to_string()),
                ("empty-value".to_string(), String::new()),
            ])
        );
        assert_eq!(parsed(&[("x-metadata-", "v")]), Err(InvalidMetadata::EmptyKey));
    }

    #[test]
    fn the_first_value_of_a_key_wins() {
        let metadata = parsed(&[("x-metadata-a", "first"), ("X-Metadata-A", "second\x01")]).unwrap();
        assert_eq!(metadata["a"], "first");
        // Through a real header map too (which keeps every value of a repeated header).
        let mut headers = HeaderMap::new();
        headers.append("x-metadata-a", "one".parse().unwrap());
        headers.append("x-metadata-a", "two".parse().unwrap());
        headers.append("x-metadata-b", "bee".parse().unwrap());
        let metadata = from_headers(&headers).unwrap();
        assert_eq!(metadata.len(), 2);
        assert_eq!((metadata["a"].as_str(), metadata["b"].as_str()), ("one", "bee"));
    }

    #[test]
    fn only_printable_ascii_is_accepted() {
        assert_eq!(
            parsed(&[("x-metadata-tab", "a\tb")]),
            Err(InvalidMetadata::ValueNotPrintable("tab".into()))
        );
        assert_eq!(
            parse([("x-metadata-latin", &b"caf\xc3\xa9"[..])]),
            Err(InvalidMetadata::ValueNotPrintable("latin".into()))
        );
        assert_eq!(
            parse([("x-metadata-del", &b"\x7f"[..])]),
            Err(InvalidMetadata::ValueNotPrintable("del".into()))
        );
        assert_eq!(
            parsed(&[("x-metadata-k\u{e9}y", "v")]),
            Err(InvalidMetadata::KeyNotPrintable("k\u{e9}y".into()))
        );
        assert!(parsed(&[("x-metadata-all", " !~azAZ09\"'{}")]).is_ok());
    }

    #[test]
    fn a_key_may_take_246_bytes_not_247() {
        let longest = format!("x-metadata-{}", "k".repeat(MAX_KEY));
        assert_eq!(MAX_KEY, 246);
        assert!(parsed(&[(&longest, "v")]).is_ok());
        let too_long = format!("x-metadata-{}", "k".repeat(247));
        assert_eq!(
            parsed(&[(&too_long, "v")]),
            Err(InvalidMetadata::KeyTooLong {
                key: "k".repeat(247),
                len: 247
            })
        );
    }

    #[test]
    fn all_of_a_files_metadata_fits_in_4096_bytes_prefix_counted_per_key() {
        // Two keys of 1 byte: 2 * (9 + 1) = 20 bytes of names, the rest values.
        let values = 4096 - 20;
        let (a, b) = ("a".repeat(values / 2), "b".repeat(values - values / 2));
        let fits = parsed(&[("x-metadata-a", &a), ("x-metadata-b", &b)]).unwrap();
        let total: usize = fits.iter().map(|(k, v)| XATTR_PREFIX.len() + k.len() + v.len()).sum();
        assert_eq!(total, MAX_TOTAL);
        let b = format!("{b}+");
        assert_eq!(
            parsed(&[("x-metadata-a", &a), ("x-metadata-b", &b)]),
            Err(InvalidMetadata::TooLarge { total: 4097 })
        );
        // Ignored repeats do not count.
        let big = "z".repeat(4000);
        assert!(parsed(&[
            ("x-metadata-a", "small"),
            ("x-metadata-a", &big),
            ("x-metadata-c", &big)
        ])
        .is_ok());
    }

    #[test]
    fn xattr_lists_are_read_for_our_keys_only() {
        let list = b"user.e2b.owner\0security.selinux\0user.other\0user.e2b.\0user.e2b.x\0";
        let keys: Vec<&[u8]> = names(list).filter_map(key_of).collect();
        assert_eq!(keys, [&b"owner"[..], &b"x"[..]]);
        assert_eq!(names(b"").count(), 0);
    }

    /// The I/O half against the machine's temporary directory, which must hold user xattrs
    /// (ext4, XFS, btrfs, tmpfs since Linux 6.6): one that does not fails, saying so, rather
    /// than passing without testing anything.
    #[test]
    fn metadata_is_replaced_on_the_file_and_read_back() {
        let path = std::env::temp_dir().join(format!("envd-metadata-unit-{}", std::process::id()));
        let file = std::fs::File::create(&path).unwrap();
        let fd = std::os::fd::AsFd::as_fd(&file);
        let first = Metadata::from([("a".into(), "1".into()), ("b".into(), "2".into())]);
        if let Err(e) = replace(fd, &first) {
            let _ = std::fs::remove_file(&path);
            panic!(
                "{} holds no user xattrs ({e}): set TMPDIR to a folder on ext4, XFS, btrfs or a recent tmpfs",
                path.display()
            );
        }
        // Someone else's attribute is neither shown nor removed.
        At::Link(CString::new(path.as_os_str().as_bytes()).unwrap())
            .set(c"user.other", b"kept")
            .unwrap();
        assert_eq!(read(&path).unwrap(), first);
        let second = Metadata::from([("b".into(), "two".into()), ("c".into(), "3".into())]);
        replace(fd, &second).unwrap();
        assert_eq!(read(&path).unwrap(), second);
        replace(fd, &Metadata::new()).unwrap();
        assert_eq!(read(&path).unwrap(), Metadata::new());
        assert_eq!(At::Fd(fd).get(c"user.other").unwrap(), b"kept");
        drop(file);
        std::fs::remove_file(&path).unwrap();
    }
}
