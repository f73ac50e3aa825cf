//! The ledger's keys and documents on arbitrary bytes: the input is split into a kind, an ID
//! and a payload at its first two NULs; the ledger's validators answer, and what they accept
//! is decoded as each document type the services read (a manifest, a node document).
#![no_main]

use common::docs::{NodeDoc, SandboxDoc};
use ledger_svc::model::{validate_key, validate_payload, DocKey};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut parts = data.splitn(3, |b| *b == 0);
    let (Some(kind), Some(id), Some(payload)) = (parts.next(), parts.next(), parts.next()) else {
        return;
    };
    let (Ok(kind), Ok(id), Ok(payload)) = (
        std::str::from_utf8(kind),
        std::str::from_utf8(id),
        std::str::from_utf8(payload),
    ) else {
        return;
    };
    if validate_key(kind, id).is_err() {
        return;
    }
    let key = DocKey {
        kind: kind.to_string(),
        id: id.to_string(),
    };
    if validate_payload(&key, payload).is_ok() {
        let _ = serde_json::from_str::<SandboxDoc>(payload);
        let _ = serde_json::from_str::<NodeDoc>(payload);
    }
});
