//! A container's rlimits, and who sets each one.
//!
//! The init inherits the limits of the process that clones it. A spec's limit whose hard
//! value is above that process's would raise it, which needs CAP_SYS_RESOURCE on the host:
//! the parent sets it with `prlimit` before releasing the init. Every other limit only
//! lowers, or keeps, what the init inherits, which any process may do to itself: the init
//! sets it, before it execs. The parent could not always: once the init's user namespace is
//! owned by its own host id (see `namespaces`), the init's effective uid is not the parent's,
//! and `prlimit` on it needs CAP_SYS_RESOURCE, which many hosts (containers among them) do
//! not grant even to root.

use oci_spec::runtime::PosixRlimitType;
use rustix::process::{Resource, Rlimit};

use crate::spec::Config;

fn rlimit_resource(t: PosixRlimitType) -> Resource {
    use PosixRlimitType::*;
    match t {
        RlimitCpu => Resource::Cpu,
        RlimitFsize => Resource::Fsize,
        RlimitData => Resource::Data,
        RlimitStack => Resource::Stack,
        RlimitCore => Resource::Core,
        RlimitRss => Resource::Rss,
        RlimitNproc => Resource::Nproc,
        RlimitNofile => Resource::Nofile,
        RlimitMemlock => Resource::Memlock,
        RlimitAs => Resource::As,
        RlimitLocks => Resource::Locks,
        RlimitSigpending => Resource::Sigpending,
        RlimitMsgqueue => Resource::Msgqueue,
        RlimitNice => Resource::Nice,
        RlimitRtprio => Resource::Rtprio,
        RlimitRttime => Resource::Rttime,
    }
}

/// A limit as the kernel takes it: an OCI spec writes "unlimited" as `u64::MAX`
/// (`RLIM_INFINITY`), rustix as `None`.
fn finite(limit: u64) -> Option<u64> {
    (limit != u64::MAX).then_some(limit)
}

/// One of the spec's rlimits, as the kernel takes it.
#[derive(Debug, Clone)]
pub struct Limit {
    pub name: String,
    pub resource: Resource,
    pub limit: Rlimit,
}

/// The spec's rlimits, split by who sets them (see the module's doc).
#[derive(Debug, Default)]
pub struct Rlimits {
    pub raise: Vec<Limit>,
    pub lower: Vec<Limit>,
}

impl Rlimits {
    pub fn of(config: &Config) -> Rlimits {
        let mut split = Rlimits::default();
        for r in config.process.rlimits().iter().flatten() {
            let resource = rlimit_resource(r.typ());
            let limit = Rlimit {
                current: finite(r.soft()),
                maximum: finite(r.hard()),
            };
            // `None` is unlimited: above any finite limit.
            let inherited = rustix::process::getrlimit(resource).maximum;
            let raises = match (limit.maximum, inherited) {
                (_, None) => false,
                (None, Some(_)) => true,
                (Some(wanted), Some(held)) => wanted > held,
            };
            let entry = Limit {
                name: r.typ().to_string(),
                resource,
                limit,
            };
            match raises {
                true => split.raise.push(entry),
                false => split.lower.push(entry),
            }
        }
        split
    }
}
