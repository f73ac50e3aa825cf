//! The sandbox-ID rule, one for every place an ID arrives: the gateway's REST paths, the
//! node's RPCs and the jail's command line. An ID names a folder on the node, a cgroup, a
//! host name and a runtime's argument, so it is plain ASCII, bounded, and cannot start with
//! what a path (`.`) or a command line (`-`) would read as something else.

/// The longest ID accepted (IDs the gateway makes are 20 characters).
pub const MAX_ID_BYTES: usize = 128;

/// The rule in words, for error messages.
pub const ID_RULE: &str = "1 to 128 letters, digits, '-', '_' or '.', starting with a letter or a digit";

/// Whether `id` may name a sandbox (or a node, or a builder container).
pub fn is_sandbox_id(id: &str) -> bool {
    let bytes = id.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_ID_BYTES
        && bytes[0].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_ids_pass() {
        for id in [
            "a",
            "ixyz0123456789abcdef",
            "build-0a1b2c3d4e5f-7",
            "node_1.local",
            &"x".repeat(128),
        ] {
            assert!(is_sandbox_id(id), "{id:?} refused");
        }
    }

    #[test]
    fn what_a_path_or_a_command_line_would_misread_is_refused() {
        for id in [
            "",
            ".",
            "..",
            ".hidden",
            "-rf",
            "_x",
            "a/b",
            "../x",
            "a b",
            "a\0b",
            "é",
            "a\n",
            &"x".repeat(129),
        ] {
            assert!(!is_sandbox_id(id), "{id:?} accepted");
        }
    }
}
