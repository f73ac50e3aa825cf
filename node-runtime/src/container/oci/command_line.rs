//! Any runtime with runc's command line, every verb a process.
//!
//! Its failures are sentences of another program: they are reported, never matched. Whether
//! a failure meant "no such container" is read from the runtime's root instead, where a
//! runc-compatible runtime keeps a folder per container it knows.

use std::process::{Command, Stdio};

use super::{Engine, EngineError, Launcher, Status};

pub struct CommandLine {
    launcher: Launcher,
}

impl CommandLine {
    pub fn new(launcher: Launcher) -> Self {
        Self { launcher }
    }

    /// Runs `VERB ARGS... ID` and returns what it printed.
    fn call(&self, verb: &'static str, args: &[&str], id: &str) -> Result<String, EngineError> {
        let launcher = &self.launcher;
        let output = Command::new(&launcher.program)
            .args(&launcher.prefix)
            .arg("--root")
            .arg(&launcher.root)
            .arg(verb)
            .args(args)
            .arg(id)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| EngineError::Spawn {
                runtime: self.describe(),
                source,
            })?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(EngineError::Refused {
                runtime: self.describe(),
                verb,
                status: output.status.to_string(),
                said: String::from_utf8_lossy(&output.stderr).trim().to_string(),
            })
        }
    }
}

impl Engine for CommandLine {
    fn launcher(&self) -> &Launcher {
        &self.launcher
    }

    fn state(&self, id: &str) -> Result<Option<Status>, EngineError> {
        let json = match self.call("state", &[], id) {
            Ok(json) => json,
            Err(_) if !self.knows(id) => return Ok(None),
            Err(e) => return Err(e),
        };
        let value: serde_json::Value = serde_json::from_str(&json).map_err(|e| EngineError::BadState {
            runtime: self.describe(),
            id: id.to_string(),
            said: json.clone(),
            reason: e.to_string(),
        })?;
        Ok(Some(match value["status"].as_str() {
            Some("running") => Status::Running,
            Some("paused") => Status::Paused,
            _ => Status::Stopped,
        }))
    }

    fn pause(&self, id: &str) -> Result<(), EngineError> {
        self.call("pause", &[], id).map(drop)
    }

    fn resume(&self, id: &str) -> Result<(), EngineError> {
        self.call("resume", &[], id).map(drop)
    }

    fn delete(&self, id: &str) -> Result<(), EngineError> {
        match self.call("delete", &["--force"], id) {
            Ok(_) => Ok(()),
            Err(_) if !self.knows(id) => Ok(()),
            Err(e) => Err(e),
        }
    }
}
