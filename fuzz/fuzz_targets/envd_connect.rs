//! envd's Connect codec on arbitrary bytes: a server-streaming request's single envelope, a
//! unary body, and a client stream cut into chunks at arbitrary places (the first byte picks
//! the chunk size). Every outcome must be a message or an `InvalidArgument`, never a panic.
#![no_main]

use bytes::Bytes;
use envd::connect::{stream_request, unary_request, Envelopes};
use envd::wire::{StartRequest, StreamInputRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let body = Bytes::copy_from_slice(data);
    let _ = stream_request::<StartRequest>(&body);
    let _ = unary_request::<StartRequest>(&body);
    let Some((&size, rest)) = data.split_first() else {
        return;
    };
    let size = usize::from(size.max(1));
    let chunks: Vec<Result<Bytes, String>> = rest.chunks(size).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
    let mut envelopes = Envelopes::new(futures::stream::iter(chunks));
    futures::executor::block_on(async {
        // Bounded: each message consumes at least its 5-byte prefix.
        for _ in 0..=rest.len() / 5 + 1 {
            if envelopes.next::<StreamInputRequest>().await.is_none() {
                break;
            }
        }
    });
});
