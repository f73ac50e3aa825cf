//! A bound on what a tar stream may make its reader hold in memory.
//!
//! The `tar` crate reads three kinds of entry whole into memory before the entry they
//! describe: a GNU long name (`L`), a GNU long link target (`K`) and a PAX header (`x`). Their
//! size is the archive's to say, so a layer of a few megabytes of gzip can hold a "long name"
//! of 20 GiB, and the node (host root, serving every tenant on it) would try to hold it all.
//! No bound on the bytes a layer unpacks to helps: those headers are never written to disk.
//!
//! [`HeaderGuard`] sits between the decompressor and the `tar` crate and follows the stream
//! block by block, as the crate does: a 512-byte header, then its data rounded up to 512
//! bytes (the size a preceding PAX header's `size` record gives, where there is one), a GNU
//! sparse file's extension headers first, the end at the first all-zero block. It refuses an
//! `L`, `K`, `x` or `g` entry larger than [`MAX_HEADER_DATA`]: a path is at most 4 KiB on
//! Linux, and a PAX header with every extended attribute a file system allows is well under
//! that bound. The bytes themselves pass through untouched.

use std::io::{self, Read};

/// The largest long name, long link or PAX header accepted.
pub const MAX_HEADER_DATA: u64 = 1 << 20;

const BLOCK: usize = 512;

/// Where in the stream the guard is.
enum At {
    /// Reading a header block (`have` bytes of it so far).
    Header { block: Box<[u8; BLOCK]>, have: usize },
    /// Reading a GNU sparse file's extension header block, before its data of `size` bytes.
    SparseExtension {
        block: Box<[u8; BLOCK]>,
        have: usize,
        size: u64,
    },
    /// Passing `left` bytes of an entry's (padded) data; a PAX header's records (its first
    /// `size` bytes, not the padding) are kept to read its `size` record.
    Data { left: u64, pax: Option<(Vec<u8>, usize)> },
    /// Past the archive's end: whatever follows is read by nobody as headers.
    End,
    /// A header was refused: every later read fails too, so nothing read on past the refusal
    /// goes unchecked.
    Refused(String),
}

/// A reader that fails before a tar stream makes its reader hold more than
/// [`MAX_HEADER_DATA`] for one entry's description.
pub struct HeaderGuard<R> {
    inner: R,
    at: At,
    /// The `size` record of the PAX header before the next entry, which overrides its header's.
    pax_size: Option<u64>,
}

impl<R> HeaderGuard<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            at: At::header(),
            pax_size: None,
        }
    }
}

impl At {
    fn header() -> Self {
        At::Header {
            block: Box::new([0; BLOCK]),
            have: 0,
        }
    }
}

impl<R: Read> Read for HeaderGuard<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.observe(&buf[..n])?;
        Ok(n)
    }
}

impl<R> HeaderGuard<R> {
    /// Follows `bytes`, the stream's next ones.
    fn observe(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        if let At::Refused(why) = &self.at {
            return Err(io::Error::other(why.clone()));
        }
        while !bytes.is_empty() {
            match &mut self.at {
                At::End => return Ok(()),
                At::Refused(why) => return Err(io::Error::other(why.clone())),
                At::Header { block, have } | At::SparseExtension { block, have, .. } => {
                    let take = (BLOCK - *have).min(bytes.len());
                    block[*have..*have + take].copy_from_slice(&bytes[..take]);
                    *have += take;
                    bytes = &bytes[take..];
                    if *have == BLOCK {
                        self.at = match self.after_block() {
                            Ok(next) => next,
                            Err(why) => {
                                self.at = At::Refused(why.to_string());
                                return Err(why);
                            }
                        };
                    }
                }
                At::Data { left, pax } => {
                    let take = usize::try_from(*left).unwrap_or(usize::MAX).min(bytes.len());
                    if let Some((pax, size)) = pax {
                        let room = *size - pax.len();
                        pax.extend_from_slice(&bytes[..take.min(room)]);
                    }
                    *left -= take as u64;
                    bytes = &bytes[take..];
                    if *left == 0 {
                        if let At::Data {
                            pax: Some((pax, _)), ..
                        } = &self.at
                        {
                            self.pax_size = pax_size(pax);
                        }
                        self.at = At::header();
                    }
                }
            }
        }
        Ok(())
    }

    /// Where a complete header (or sparse extension) block leads.
    fn after_block(&mut self) -> io::Result<At> {
        let at = std::mem::replace(&mut self.at, At::End);
        match at {
            At::SparseExtension { block, size, .. } => {
                // Another extension follows while its "is extended" byte is 1.
                Ok(if block[504] == 1 {
                    At::SparseExtension { block, have: 0, size }
                } else {
                    data(size, false)
                })
            }
            At::Header { block, .. } => {
                if block.iter().all(|&b| b == 0) {
                    return Ok(At::End);
                }
                let kind = block[156];
                let Some(mut size) = entry_size(&block[124..136]) else {
                    // The `tar` crate refuses this header itself.
                    return Ok(At::End);
                };
                // The crate reads an `L`, `K` or `x` entry into memory, as the description
                // of the next, only under a ustar or GNU header; any other entry (a `g` one
                // included) is handed out as an entry, and ends what a PAX header described.
                let recognised =
                    (&block[257..263] == b"ustar\0" && &block[263..265] == b"00") || &block[257..265] == b"ustar  \0";
                let extension = matches!(kind, b'L' | b'K' | b'x' | b'g');
                let describes_next = recognised && matches!(kind, b'L' | b'K' | b'x');
                if extension {
                    if size > MAX_HEADER_DATA {
                        return Err(io::Error::other(format!(
                            "an archive entry's {} header holds {size} bytes, more than the {MAX_HEADER_DATA} allowed",
                            match kind {
                                b'L' => "long name",
                                b'K' => "long link",
                                _ => "PAX",
                            }
                        )));
                    }
                    if !describes_next {
                        self.pax_size = None;
                    }
                } else if let Some(pax) = self.pax_size.take() {
                    size = pax;
                }
                let gnu = &block[257..265] == b"ustar  \0";
                if kind == b'S' && gnu && block[482] == 1 {
                    return Ok(At::SparseExtension {
                        block: Box::new([0; BLOCK]),
                        have: 0,
                        size,
                    });
                }
                Ok(data(size, describes_next && kind == b'x'))
            }
            other => Ok(other),
        }
    }
}

/// An entry's data of `size` bytes, padded to whole blocks.
fn data(size: u64, keep: bool) -> At {
    let padded = size.div_ceil(BLOCK as u64).saturating_mul(BLOCK as u64);
    if padded == 0 {
        return At::header();
    }
    At::Data {
        left: padded,
        pax: keep.then(|| (Vec::with_capacity(size as usize), size as usize)),
    }
}

/// A header's size field, read as the `tar` crate reads it: after a 0x80 first byte, its last
/// eight bytes as a big-endian number (as GNU tar writes sizes of 8 GiB and more); else octal
/// digits up to the first NUL, blanks around them trimmed. `None`: the crate refuses it too.
fn entry_size(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        return Some(
            field[field.len() - 8..]
                .iter()
                .fold(0u64, |n, &b| (n << 8) | u64::from(b)),
        );
    }
    let digits = field.split(|&b| b == 0).next().unwrap_or_default();
    u64::from_str_radix(std::str::from_utf8(digits).ok()?.trim(), 8).ok()
}

/// The `size` record of PAX header `records`, read as the `tar` crate reads it: lines
/// `LEN key=value`, the first empty line ending them; none where a line before it is
/// malformed, or its value is no number.
fn pax_size(records: &[u8]) -> Option<u64> {
    for line in records.split(|&b| b == b'\n') {
        if line.is_empty() {
            return None;
        }
        let space = line.iter().position(|&b| b == b' ')?;
        let len: usize = std::str::from_utf8(&line[..space]).ok()?.parse().ok()?;
        if line.len() + 1 != len {
            return None;
        }
        let record = &line[space + 1..];
        let equals = record.iter().position(|&b| b == b'=')?;
        if &record[..equals] == b"size" {
            return std::str::from_utf8(&record[equals + 1..]).ok()?.parse().ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar header block of `kind` for `size` bytes of data (checksum set).
    fn header(kind: u8, size: u64) -> Vec<u8> {
        let mut h = tar::Header::new_gnu();
        h.set_size(size);
        h.set_entry_type(tar::EntryType::new(kind));
        h.set_path("x").unwrap();
        h.set_cksum();
        h.as_bytes().to_vec()
    }

    /// Reads all of `stream` through the guard and the `tar` crate, in reads of `chunk` bytes.
    fn read_all(stream: &[u8], chunk: usize) -> io::Result<Vec<String>> {
        struct Chunks<'a>(&'a [u8], usize);
        impl Read for Chunks<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = self.0.len().min(self.1).min(buf.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut archive = tar::Archive::new(HeaderGuard::new(Chunks(stream, chunk)));
        let mut names = Vec::new();
        for entry in archive.entries()? {
            let mut entry = entry?;
            names.push(String::from_utf8_lossy(&entry.path_bytes()).into_owned());
            io::copy(&mut entry, &mut io::sink())?;
        }
        io::copy(&mut archive.into_inner(), &mut io::sink())?;
        Ok(names)
    }

    #[test]
    fn ordinary_archives_pass_whole_whatever_the_reads() {
        let mut tar = tar::Builder::new(Vec::new());
        let long = "d/".repeat(300) + "file";
        for (name, size) in [("a.txt", 0usize), ("b.bin", 513), (long.as_str(), 1024)] {
            let mut h = tar::Header::new_gnu();
            h.set_size(size as u64);
            h.set_mode(0o644);
            tar.append_data(&mut h, name, &vec![7u8; size][..]).unwrap();
        }
        // A PAX header (xattrs) before an entry, as image layers carry.
        let mut pax = tar::Builder::new(Vec::new());
        pax.append_pax_extensions([("SCHILY.xattr.user.a", &b"v"[..]), ("path", b"p/q")])
            .unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_size(3);
        h.set_path("ignored").unwrap();
        h.set_cksum();
        pax.append(&h, &b"abc"[..]).unwrap();
        let mut stream = tar.into_inner().unwrap();
        stream.truncate(stream.len() - 2 * BLOCK);
        stream.extend(pax.into_inner().unwrap());
        let whole = ["a.txt".to_string(), "b.bin".into(), long.clone(), "p/q".into()];
        for chunk in [1, 7, 512, 4096, usize::MAX] {
            assert_eq!(read_all(&stream, chunk).unwrap(), whole, "reads of {chunk}");
        }
    }

    #[test]
    fn an_oversized_long_name_link_or_pax_header_is_refused_before_it_is_read() {
        for kind in [b'L', b'K', b'x', b'g'] {
            // The header alone: the refusal comes before any of its data is there.
            let stream = header(kind, 20 << 30);
            let refused = read_all(&stream, 4096).unwrap_err();
            assert!(refused.to_string().contains("allowed"), "{}: {refused}", kind as char);
            let mut fine = header(kind, 100);
            fine.extend([b'a'; BLOCK]);
            fine.extend(header(b'0', 0));
            fine.extend([0; 2 * BLOCK]);
            assert!(read_all(&fine, 4096).is_ok(), "{}", kind as char);
        }
    }

    #[test]
    fn a_refusal_stays_for_every_later_read() {
        let mut stream = header(b'L', 20 << 30);
        stream.extend([0u8; 4 * BLOCK]);
        let mut guard = HeaderGuard::new(&stream[..]);
        let mut buf = [0u8; BLOCK];
        assert!(guard.read(&mut buf).is_err());
        assert!(guard.read(&mut buf).is_err(), "a later read passed unchecked");
    }

    #[test]
    fn a_pax_size_record_moves_the_next_header_as_it_does_for_the_tar_crate() {
        // A PAX header says the next entry has 1024 bytes though its own header says 0: an
        // oversized long-name header hidden in those bytes is data, never read as a header.
        let record = "size=1024\n";
        let records = format!("{} {record}", record.len() + 3);
        let mut stream = header(b'x', records.len() as u64);
        let mut block = records.into_bytes();
        block.resize(BLOCK, 0);
        stream.extend(block);
        stream.extend(header(b'0', 0));
        stream.extend(header(b'L', 20 << 30));
        stream.extend([9; BLOCK]);
        stream.extend(header(b'0', 0));
        stream.extend([0; 2 * BLOCK]);
        assert_eq!(read_all(&stream, 100).unwrap(), ["x", "x"]);
        assert_eq!(pax_size(b"9 size=1\n"), Some(1));
        assert_eq!(pax_size(b"8 size=1\n"), None, "a record whose length is wrong");
        assert_eq!(pax_size(b"11 size=12\n"), Some(12));
        assert_eq!(pax_size(b"12 path=abc\n11 size=12\n"), Some(12));
        assert_eq!(
            pax_size(b"12 path=abc\n\n11 size=12\n"),
            None,
            "an empty line ends them"
        );
    }

    #[test]
    fn every_archive_a_node_applies_passes_through_the_guard() {
        let scratch = crate::testutil::Scratch::new("headers");
        let mut stream = header(b'L', 20 << 30);
        stream.extend(vec![b'a'; 1 << 16]);
        let dest = scratch.sub("layer");
        std::fs::create_dir_all(&dest).unwrap();
        let refused = crate::unpack::unpack_archive(&stream[..], &dest, crate::Rules::Snapshot).unwrap_err();
        assert!(refused.to_string().contains("allowed"), "{refused}");
        let dest = scratch.sub("files");
        std::fs::create_dir_all(&dest).unwrap();
        let refused = crate::files::extract_files(&stream[..], false, &dest, (1000, 1000), None).unwrap_err();
        assert!(refused.to_string().contains("allowed"), "{refused}");
    }

    #[test]
    fn sizes_are_read_in_octal_and_in_binary() {
        assert_eq!(entry_size(b"00000001750\0"), Some(1000));
        assert_eq!(entry_size(b"     1750 \0\0"), Some(1000));
        assert_eq!(entry_size(b"\0\0\0\0\0\0\0\0\0\0\0\0"), None, "as the crate");
        let mut binary = [0u8; 12];
        binary[0] = 0x80;
        binary[7] = 5;
        binary[11] = 1;
        assert_eq!(entry_size(&binary), Some((5 << 32) + 1));
        assert_eq!(entry_size(b"00000001790\0"), None);
    }
}
