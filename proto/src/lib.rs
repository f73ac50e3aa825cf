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

pub mod reason;

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

/// A template's image on the wire and as the services hold it (`contracts::template::Image`),
/// converted in one place for the gateway and the node.
mod image {
    use contracts::template::{Image, Layer};

    use crate::node::v1 as pb;

    impl From<&Image> for pb::TemplateImage {
        fn from(image: &Image) -> Self {
            Self {
                build_id: image.build_id.clone(),
                layers: image
                    .layers
                    .iter()
                    .map(|l| pb::Layer {
                        digest: l.digest.clone(),
                        size: l.size,
                    })
                    .collect(),
                host_userland: image.host_userland,
                env: image.env.clone().into_iter().collect(),
                user: image.user.clone(),
                workdir: image.workdir.clone(),
                start_cmd: image.start_cmd.clone().unwrap_or_default(),
                ready_cmd: image.ready_cmd.clone().unwrap_or_default(),
            }
        }
    }

    impl From<pb::TemplateImage> for Image {
        fn from(pb: pb::TemplateImage) -> Self {
            Self {
                build_id: pb.build_id,
                layers: pb
                    .layers
                    .into_iter()
                    .map(|l| Layer {
                        digest: l.digest,
                        size: l.size,
                    })
                    .collect(),
                host_userland: pb.host_userland,
                env: pb.env.into_iter().collect(),
                user: pb.user,
                workdir: pb.workdir,
                start_cmd: Some(pb.start_cmd).filter(|c| !c.is_empty()),
                ready_cmd: Some(pb.ready_cmd).filter(|c| !c.is_empty()),
            }
        }
    }
}
