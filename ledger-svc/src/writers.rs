//! Who may write which kind of document.
//!
//! The per-RPC policy lets the gateway, placement and the balancer call `Compare`, but each
//! of them owns only some kinds: placement publishes node documents, the balancer its plans,
//! leases and observations, the gateway templates, warm pools and idempotency records, and manifests are
//! the gateway's and the balancer's (a move switches where a sandbox runs). A compromised
//! service therefore rewrites only what it already owns: placement cannot point a manifest
//! at a node of its choosing, the gateway cannot forge a balance plan. A kind no rule names
//! is refused to every service.
//!
//! The operator may write any kind: repairs by hand are an operator's job, and the operator's
//! key is the cluster's key of last resort anyway.
//!
//! Only writes are held to this: a `Check` entry (a version guard that writes nothing) reads,
//! and every caller of `Compare` may read.

use mtls::Role;

use crate::model::{Action, Entry};

/// Each document kind and the services that may create, replace or delete it.
pub const WRITERS: &[(&str, &[Role])] = &[
    ("sandbox", &[Role::Gateway, Role::Balance]),
    ("idempotency", &[Role::Gateway]),
    ("template", &[Role::Gateway]),
    ("template-name", &[Role::Gateway]),
    ("template-build", &[Role::Gateway]),
    ("pool", &[Role::Gateway]),
    ("pool-slot", &[Role::Gateway]),
    ("node", &[Role::Placement]),
    ("balance-plan", &[Role::Balance]),
    ("balance-lease", &[Role::Balance]),
    ("balance-observation", &[Role::Balance]),
    ("balance-control", &[Role::Balance]),
];

/// Whether `role` may write documents of `kind`.
pub fn may_write(role: Role, kind: &str) -> bool {
    role == Role::Operator
        || WRITERS
            .iter()
            .any(|(owned, writers)| *owned == kind && writers.contains(&role))
}

/// The first entry of a batch that `role` may not write, if any.
pub fn refused(role: Role, entries: &[Entry]) -> Option<&Entry> {
    entries
        .iter()
        .find(|entry| !matches!(entry.action, Action::Check) && !may_write(role, &entry.key.kind))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::DocKey;

    fn entry(kind: &str, action: Action) -> Entry {
        Entry {
            key: DocKey::new(kind.to_string(), "x".to_string()),
            expected_version: 0,
            expected_create_revision: 0,
            action,
        }
    }

    #[test]
    fn each_service_writes_only_what_it_owns() {
        let put = |kind| entry(kind, Action::Put(Arc::from("{}")));
        assert!(refused(Role::Gateway, &[put("sandbox"), put("template")]).is_none());
        assert!(refused(Role::Balance, &[put("sandbox"), put("balance-plan")]).is_none());
        assert!(refused(Role::Placement, &[put("node")]).is_none());
        for (role, kind) in [
            (Role::Placement, "sandbox"),
            (Role::Gateway, "balance-plan"),
            (Role::Gateway, "node"),
            (Role::Balance, "template"),
            (Role::Balance, "node"),
            (Role::Node, "node"),
            (Role::Gateway, "a-kind-no-rule-names"),
        ] {
            let batch = [put("sandbox"), put(kind), entry(kind, Action::Delete)];
            let refused_entry = refused(role, &batch[1..]).map(|e| e.key.kind.clone());
            assert_eq!(refused_entry.as_deref(), Some(kind), "{role} wrote {kind}");
        }
        // A guard writes nothing; the operator repairs anything.
        assert!(refused(Role::Placement, &[entry("sandbox", Action::Check), put("node")]).is_none());
        assert!(refused(Role::Operator, &[put("sandbox"), put("anything")]).is_none());
    }
}
