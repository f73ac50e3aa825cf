//! `jail`: a small OCI container runtime.
//!
//! An OCI *bundle* (a `config.json` plus a root filesystem) goes in, a running container
//! comes out. It is the default runtime of the sandboxsched node; the node can be pointed at
//! Debian's `runc` instead, so the command line is a strict subset of runc's with the same
//! meanings (see [`cli`]).
//!
//! The node starts its own binary as `<node-binary> jail <args...>`, which calls [`main`]
//! with the arguments after `jail`; the stand-alone binary `sandboxsched-jail` does the same
//! with its own arguments. The node starts it once, as its [`helper`], and each `run` is a
//! fork of that small process; a runc-style caller starts it once per command. Either way
//! `run` works in a process of its own that is single-threaded, which the container setup
//! relies on (see [`init`]).
//!
//! How `run` works, module by module:
//!
//! * [`spec`] reads `config.json` (with `oci-spec`) and refuses what we do not implement;
//! * [`rootfs`] prepares the mount plan, [`seccomp`] compiles the filter,
//!   [`capabilities`] the capability masks, all before any process is created;
//! * [`state`] creates `ROOT/ID` (the ID is taken atomically by `mkdir`);
//! * [`cgroup`] creates the cgroup and writes the limits;
//! * [`process`] clones the init into new namespaces ([`namespaces`]), writes its id maps,
//!   moves it into the cgroup and releases it;
//! * [`init`] (in the child) builds the filesystem, drops privileges and executes the
//!   program, reporting any failure back through a pipe.
//!
//! Every failure is one line on stderr (and in `--log`, if given) and exit code 1.

pub mod capabilities;
pub mod cgroup;
pub mod cli;
pub mod container;
pub mod helper;
pub mod init;
pub mod namespaces;
pub mod priority;
pub mod process;
pub mod rlimits;
pub mod rootfs;
pub mod seccomp;
pub mod signal;
pub mod spec;
pub mod state;
pub mod sys;
pub mod view;

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use cli::{CliError, Command, LogFormat};
use state::StateDir;

/// Runs the CLI with the arguments *after* the program name.
pub fn main(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let cli = match cli::parse(args) {
        Ok(cli) => cli,
        Err(CliError::Display(text)) => {
            let _ = std::io::stdout().write_all(text.as_bytes());
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "{e}");
            return ExitCode::FAILURE;
        }
    };
    let log = Logger {
        path: cli.log.clone(),
        format: cli.log_format,
    };
    let dir = StateDir::new(&cli.root);
    let result = match &cli.command {
        Command::Helper {
            run_deadline_ms,
            private_below,
        } => helper::serve(&dir, std::time::Duration::from_millis(*run_deadline_ms), private_below)
            .map_err(|e| e.to_string()),
        command => container_command(&dir, &log, command).map_err(|e| e.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log.error(&e);
            ExitCode::FAILURE
        }
    }
}

/// The runc commands.
fn container_command(dir: &StateDir, log: &Logger, command: &Command) -> Result<(), container::ContainerError> {
    match command {
        Command::Run(a) => container::run(dir, log, a),
        Command::State { id } => container::state(dir, id).map(|json| {
            let _ = std::io::stdout().write_all(json.as_bytes());
        }),
        Command::Pause { id } => container::pause(dir, id),
        Command::Resume { id } => container::resume(dir, id),
        Command::Kill { id, signal } => container::kill(dir, id, signal.as_deref()),
        Command::Delete { id, force } => container::delete(dir, id, *force),
        // Served by `main` itself: it is no container command.
        Command::Helper { .. } => Ok(()),
    }
}

/// Where messages go: always one line on stderr, and a line in `--log` if given, in
/// runc's (logrus) text or JSON format.
pub struct Logger {
    path: Option<PathBuf>,
    format: LogFormat,
}

impl Logger {
    /// Lines on stderr only (no `--log`): the helper's, whose stderr is the node's and, in each
    /// run's process, the container's log.
    pub fn stderr() -> Self {
        Self {
            path: None,
            format: LogFormat::Text,
        }
    }

    pub fn error(&self, msg: &str) {
        self.emit("error", msg);
    }

    pub fn warn(&self, msg: &str) {
        self.emit("warning", msg);
    }

    fn emit(&self, level: &str, msg: &str) {
        // One line, whatever the message contains.
        let msg = msg.replace(['\n', '\r'], " ");
        let prefix = if level == "error" { "" } else { "warning: " };
        // Each line in one write: stderr is often the sandbox's log, appended to by others.
        let _ = std::io::stderr().write_all(format!("{prefix}{msg}\n").as_bytes());
        let Some(path) = &self.path else { return };
        let time = state::now_rfc3339();
        let line = match self.format {
            LogFormat::Json => serde_json::json!({"level": level, "msg": msg, "time": time}).to_string(),
            LogFormat::Text => format!("time={time:?} level={level} msg={msg:?}"),
        };
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
    }
}
