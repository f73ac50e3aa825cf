//! A sandbox's access tokens, as the gateway hands them out and checks them: derived from the
//! seal its manifest keeps and the cluster's token key (see `envd_wire::sealed`), never read
//! from the ledger in clear.

use std::sync::Arc;

use common::docs::SandboxDoc;
use envd_wire::sealed::{self, Purpose, TokenKey};

/// The gateway's token key, shared by everything in it that needs a sandbox's token.
#[derive(Clone, Debug)]
pub struct Tokens {
    key: Arc<TokenKey>,
}

impl Tokens {
    pub fn new(key: TokenKey) -> Self {
        Self { key: Arc::new(key) }
    }

    /// What a new manifest keeps for a token: a fresh seal.
    pub fn seal(&self) -> String {
        sealed::new_seal()
    }

    /// The sandbox's envd access token (`X-Access-Token`), if it was issued one.
    pub fn envd(&self, doc: &SandboxDoc) -> Option<String> {
        let seal = doc.envd_access_token.as_deref()?;
        Some(self.key.open(Purpose::Envd, &doc.sandbox_id, seal))
    }

    /// The token its ports require (`allowPublicTraffic: false`), if any.
    pub fn traffic(&self, doc: &SandboxDoc) -> Option<String> {
        let seal = doc.traffic_access_token.as_deref()?;
        Some(self.key.open(Purpose::Traffic, &doc.sandbox_id, seal))
    }
}
