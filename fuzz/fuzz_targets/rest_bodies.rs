//! The gateway's REST bodies on arbitrary bytes: a create (`NewSandbox`) through intent
//! normalisation, with and without a template's fixed resources, and a network update. A
//! body either becomes an intent or a refusal (a 400); sizes never wrap.
#![no_main]

use e2b_gateway::intent::{network_update, normalise, NetworkUpdate, NewSandbox, Template};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = serde_json::from_slice::<NewSandbox>(data) {
        let template: Template =
            serde_json::from_str(r#"{"name": "fuzz", "vcpus": 2, "memory_mb": 1024}"#).expect("a template");
        if let Ok(intent) = normalise(req.clone(), Some(&template)) {
            assert!(intent.vcpus >= 1 && intent.memory_bytes >= 1);
        }
        let _ = normalise(req, None);
    }
    if let Ok(update) = serde_json::from_slice::<NetworkUpdate>(data) {
        let _ = network_update(update);
    }
});
