//! The wire contracts of sandboxsched: one module per service, generated at build time from
//! `proto/sandboxsched/*.proto`.
//!
//! Every message and service lives in a versioned package (`sandboxsched.<service>.v1`) so a
//! breaking change can ship beside the old one.

/// Versioned JSON documents with compare-and-swap and a change feed.
pub mod ledger {
    pub mod v1 {
        tonic::include_proto!("sandboxsched.ledger.v1");
    }
}

/// Node choice, reservations and heartbeats.
pub mod placement {
    pub mod v1 {
        tonic::include_proto!("sandboxsched.placement.v1");
    }
}

/// Sandboxes on one host: lifecycle, snapshots, node information.
pub mod node {
    pub mod v1 {
        tonic::include_proto!("sandboxsched.node.v1");
    }
}

/// Memory balance: observations, plans, drains.
pub mod balance {
    pub mod v1 {
        tonic::include_proto!("sandboxsched.balance.v1");
    }
}
