//! The simulated runtime: sandboxes that exist only as numbers. A sandbox "uses" a fixed share
//! of its allocated memory, so capacity plans and balancer scenarios can run with 50 nodes
//! and 10,000 sandboxes in one process.

use std::path::Path;

use super::{Features, Runtime, RuntimeError};
use crate::Sandbox;

pub struct SimRuntime {
    /// Share of allocated memory each sandbox reports as used (0.0 to 1.0).
    pub used_share: f64,
}

impl Runtime for SimRuntime {
    fn kind(&self) -> &'static str {
        "sim"
    }

    fn features(&self) -> Features {
        Features {
            degraded: vec!["simulated runtime: no processes run".to_string()],
            ..Features::default()
        }
    }

    fn start(&self, _: &Sandbox<'_>, _: &Path) -> Result<u32, RuntimeError> {
        Ok(0)
    }

    fn pause(&self, _: &Sandbox<'_>) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn resume(&self, _: &Sandbox<'_>) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn kill(&self, _: &Sandbox<'_>) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn memory_used(&self, sandbox: &Sandbox<'_>) -> u64 {
        (sandbox.memory_bytes as f64 * self.used_share.clamp(0.0, 1.0)) as u64
    }

    fn alive(&self, _: &Sandbox<'_>) -> bool {
        true
    }

    fn adopt(&self, _: &Sandbox<'_>) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn enclose(
        &self,
        sandbox: &Sandbox<'_>,
        _: &Path,
        _: &Path,
        _: &mut std::process::Command,
    ) -> Result<(), RuntimeError> {
        Err(RuntimeError::Start {
            sandbox: sandbox.id.to_string(),
            reason: "the simulated runtime runs no processes".to_string(),
        })
    }
}
