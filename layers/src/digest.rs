//! Content digests: how OCI names blobs, and how to compute those names while streaming.
//!
//! A layer is identified twice: by the digest of the compressed blob (what a registry stores
//! and serves) and by its *diff id*, the digest of the uncompressed tar (what an image config
//! lists). Both are computed on the fly by wrapping the stream in a [`DigestWriter`] or
//! [`DigestReader`], so a blob is never buffered whole. Only sha256 is supported, and
//! [`Digest`]'s parser is strict (lowercase hex, exact length), because a digest string that
//! reaches us from a manifest is untrusted input that later becomes part of a file name.

use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::Path;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

/// Errors of the digest module.
#[derive(Debug, thiserror::Error)]
pub enum DigestError {
    /// The string is not `sha256:` followed by 64 lowercase hex digits.
    #[error("invalid digest {0:?}: expected sha256:<64 lowercase hex digits>")]
    Invalid(String),
    /// Reading the data to hash failed.
    #[error("reading {path}: {source}")]
    Io { path: String, source: io::Error },
}

/// A sha256 content digest, displayed as `sha256:<64 lowercase hex>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

impl Digest {
    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Digest {
        Digest(Sha256::digest(data).into())
    }

    /// The digest of a file's contents, streamed.
    pub fn of_file(path: &Path) -> Result<Digest, DigestError> {
        let io_err = |source| DigestError::Io {
            path: path.display().to_string(),
            source,
        };
        let mut reader = DigestReader::new(File::open(path).map_err(io_err)?);
        io::copy(&mut reader, &mut io::sink()).map_err(io_err)?;
        Ok(reader.finish().0)
    }

    /// The 32 raw bytes.
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The 64 lowercase hex digits, without the algorithm prefix.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Digest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Digest, DigestError> {
        let invalid = || DigestError::Invalid(s.chars().take(80).collect());
        let hex = s.strip_prefix("sha256:").ok_or_else(invalid)?.as_bytes();
        if hex.len() != 64 {
            return Err(invalid());
        }
        let nibble = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let mut out = [0u8; 32];
        for (byte, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
            *byte = (nibble(pair[0]).ok_or_else(invalid)? << 4) | nibble(pair[1]).ok_or_else(invalid)?;
        }
        Ok(Digest(out))
    }
}

/// A writer that hashes and counts everything written through it to `inner`.
pub struct DigestWriter<W: Write> {
    inner: W,
    hasher: Sha256,
    count: u64,
}

impl<W: Write> DigestWriter<W> {
    pub fn new(inner: W) -> Self {
        DigestWriter {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }

    /// Bytes written so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The digest and byte count of everything written, and the inner writer.
    pub fn finish(self) -> (Digest, u64, W) {
        (Digest(self.hasher.finalize().into()), self.count, self.inner)
    }
}

impl<W: Write> Write for DigestWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A reader that hashes and counts everything read through it from `inner`.
///
/// Wrap a downloaded blob in one, unpack it, then compare [`DigestReader::finish`] with the
/// expected digest: [`crate::unpack_layer`] reads its input to the end so the digest is complete.
pub struct DigestReader<R: Read> {
    inner: R,
    hasher: Sha256,
    count: u64,
}

impl<R: Read> DigestReader<R> {
    pub fn new(inner: R) -> Self {
        DigestReader {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }

    /// The digest and byte count of everything read.
    pub fn finish(self) -> (Digest, u64) {
        (Digest(self.hasher.finalize().into()), self.count)
    }
}

impl<R: Read> Read for DigestReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::Scratch;

    const ABC: &str = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    #[test]
    fn display_and_parse_round_trip() {
        let d = Digest::of(b"abc");
        assert_eq!(d.to_string(), ABC);
        assert_eq!(ABC.parse::<Digest>().unwrap(), d);
        assert_eq!(d.hex(), &ABC[7..]);
    }

    #[test]
    fn parse_is_strict() {
        let upper = format!("sha256:{}", ABC[7..].to_uppercase());
        let short = &ABC[..ABC.len() - 1];
        let long = format!("{ABC}0");
        let bad_char = ABC.replace('f', "g");
        let sha512 = ABC.replace("sha256", "sha512");
        for s in [
            upper.as_str(),
            short,
            &long,
            &bad_char,
            &sha512,
            &ABC[7..],
            "",
            "sha256:",
        ] {
            assert!(s.parse::<Digest>().is_err(), "{s:?} accepted");
        }
    }

    #[test]
    fn writer_reader_and_file_agree() {
        let mut w = DigestWriter::new(Vec::new());
        w.write_all(b"a").unwrap();
        w.write_all(b"bc").unwrap();
        let (d, n, inner) = w.finish();
        assert_eq!((d.to_string().as_str(), n, inner.as_slice()), (ABC, 3, &b"abc"[..]));

        let mut r = DigestReader::new(&b"abc"[..]);
        io::copy(&mut r, &mut io::sink()).unwrap();
        assert_eq!(r.finish(), (d, 3));

        let dir = Scratch::new("digest");
        let file = dir.path().join("f");
        std::fs::write(&file, b"abc").unwrap();
        assert_eq!(Digest::of_file(&file).unwrap(), d);
        assert!(Digest::of_file(&dir.path().join("missing")).is_err());
    }
}
