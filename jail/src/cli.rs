//! The command line: a strict subset of runc's, with the same meanings.
//!
//! The node service can run containers with this runtime or with Debian's `runc`, choosing
//! the binary by configuration only, so every flag and command accepted here must be one
//! that runc accepts and must mean what it means to runc. Things runc offers that we do
//! not (terminals, `create`/`start`, `exec`, checkpointing, ...) are simply absent, so a
//! caller relying on them gets a clear usage error rather than a surprise.
//!
//! ```text
//! sandboxsched-jail [--root DIR] [--log FILE] [--log-format text|json] COMMAND
//!   run --detach --bundle DIR [--pid-file FILE] [--preserve-fds N] [--no-pivot] ID
//!   state ID
//!   pause ID
//!   resume ID
//!   kill ID [SIGNAL]
//!   delete [--force] ID
//! ```
//!
//! Global flags go before the command, as with runc.
//!
//! One command is not runc's and is hidden from `--help`: `helper`, the node's pre-forked
//! launcher of `run` (see [`crate::helper`]). Only the node starts it, with its control socket
//! as fd 3; a node pointed at runc never does.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// The default state directory. runc uses `/run/runc`; we keep ours apart so both runtimes
/// can be installed side by side without reading each other's state.
pub const DEFAULT_ROOT: &str = "/run/sandboxsched-jail";

/// The program name shown in usage messages. The library never looks at the real argv[0]:
/// the node re-executes itself as `<node-binary> jail <args...>`.
pub const PROGRAM: &str = "sandboxsched-jail";

/// Errors from parsing the command line.
/// How long a run may go before the helper kills it, in milliseconds: a run ends once the
/// container's first process is executing, which takes milliseconds even on a busy host.
pub const RUN_DEADLINE_MS: u64 = 60_000;

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A usage error, already reduced to one line.
    #[error("{0}")]
    Usage(String),
    /// `--help` or `--version`: not an error, the text goes to stdout and we exit 0.
    #[error("help requested")]
    Display(String),
}

/// A small OCI container runtime (runc-compatible subset).
#[derive(Debug, Parser)]
#[command(name = PROGRAM, version, about, disable_help_subcommand = true)]
pub struct Cli {
    /// Directory for the containers' state.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_ROOT)]
    pub root: PathBuf,

    /// Also write errors to this file (runc: the log file).
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,

    /// Format of the lines written to --log.
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

/// `--log-format`, as runc spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create and start a container (detached only).
    Run(RunArgs),
    /// Print the state of a container as JSON.
    State {
        /// Container ID.
        id: String,
    },
    /// Freeze all processes of a container.
    Pause {
        /// Container ID.
        id: String,
    },
    /// Thaw a paused container.
    Resume {
        /// Container ID.
        id: String,
    },
    /// Send a signal to the container's init process.
    Kill {
        /// Container ID.
        id: String,
        /// Signal name (KILL, SIGKILL, term) or number; default TERM.
        signal: Option<String>,
    },
    /// Not runc's: the node's pre-forked launcher of `run` (see `helper`). The node starts it
    /// with its control socket as fd 3; it is not for people, so `--help` does not list it.
    #[command(hide = true)]
    Helper {
        /// A run still going after this many milliseconds is killed (and answered once it
        /// has ended).
        #[arg(long, default_value_t = RUN_DEADLINE_MS)]
        run_deadline_ms: u64,
        /// Serve from a private mount namespace of the helper's own, without the mounts below
        /// this folder (repeatable; see `jail::view`). Runs may then be sent their root as a
        /// mount.
        #[arg(long, value_name = "DIR")]
        private_below: Vec<PathBuf>,
    },
    /// Delete a stopped container (or, with --force, any container).
    Delete {
        /// Kill the container if it is still running.
        #[arg(short, long)]
        force: bool,
        /// Container ID.
        id: String,
    },
}

/// Flags of `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Detach from the container's process (required: only detached mode is supported).
    #[arg(short, long)]
    pub detach: bool,

    /// Path to the OCI bundle (the directory holding config.json).
    #[arg(short, long, value_name = "DIR", default_value = ".")]
    pub bundle: PathBuf,

    /// Write the container init's host PID to this file.
    #[arg(long, value_name = "FILE")]
    pub pid_file: Option<PathBuf>,

    /// Pass this many extra file descriptors (3, 4, ...) to the container process.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub preserve_fds: u32,

    /// Use MS_MOVE and chroot instead of pivot_root (for a rootfs on ramfs).
    #[arg(long)]
    pub no_pivot: bool,

    /// Container ID.
    pub id: String,
}

/// Parses the arguments that follow the program name.
pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Cli, CliError> {
    let argv = std::iter::once(OsString::from(PROGRAM)).chain(args);
    Cli::try_parse_from(argv).map_err(|e| {
        use clap::error::ErrorKind;
        match e.kind() {
            ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                let mut text = e.render().to_string();
                if !text.ends_with('\n') {
                    text.push('\n');
                }
                CliError::Display(text)
            }
            ErrorKind::MissingSubcommand | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => CliError::Usage(
                format!("missing command: run, state, pause, resume, kill or delete (see `{PROGRAM} --help`)"),
            ),
            _ => CliError::Usage(one_line(&e.render().to_string())),
        }
    })
}

/// clap's messages span several lines (error, tip, usage); the node logs one line per error.
fn one_line(rendered: &str) -> String {
    let first = rendered
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("invalid arguments");
    let first = first.trim().trim_start_matches("error: ");
    format!("{first} (see `{PROGRAM} --help`)")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Cli, CliError> {
        parse(args.iter().map(OsString::from))
    }

    #[test]
    fn run_with_all_flags() {
        let cli = p(&[
            "--root",
            "/tmp/r",
            "--log",
            "/tmp/l",
            "--log-format",
            "json",
            "run",
            "--detach",
            "--bundle",
            "/b",
            "--pid-file",
            "/p",
            "--preserve-fds",
            "2",
            "--no-pivot",
            "c1",
        ])
        .unwrap();
        assert_eq!(cli.root, PathBuf::from("/tmp/r"));
        assert_eq!(cli.log, Some(PathBuf::from("/tmp/l")));
        assert_eq!(cli.log_format, LogFormat::Json);
        let Command::Run(run) = cli.command else {
            panic!("not run")
        };
        assert!(run.detach && run.no_pivot);
        assert_eq!(run.bundle, PathBuf::from("/b"));
        assert_eq!(run.pid_file, Some(PathBuf::from("/p")));
        assert_eq!(run.preserve_fds, 2);
        assert_eq!(run.id, "c1");
    }

    #[test]
    fn defaults_and_short_flags_like_runc() {
        let cli = p(&["run", "-d", "-b", "/b", "c1"]).unwrap();
        assert_eq!(cli.root, PathBuf::from(DEFAULT_ROOT));
        assert_eq!(cli.log_format, LogFormat::Text);
        let Command::Run(run) = cli.command else {
            panic!("not run")
        };
        assert!(run.detach);
        assert_eq!(run.preserve_fds, 0);

        let cli = p(&["run", "c2"]).unwrap();
        let Command::Run(run) = cli.command else {
            panic!("not run")
        };
        assert!(!run.detach);
        assert_eq!(run.bundle, PathBuf::from("."));

        assert!(matches!(
            p(&["delete", "-f", "c"]).unwrap().command,
            Command::Delete { force: true, .. }
        ));
        assert!(matches!(
            p(&["delete", "c"]).unwrap().command,
            Command::Delete { force: false, .. }
        ));
        match p(&["kill", "c", "KILL"]).unwrap().command {
            Command::Kill { id, signal } => assert_eq!((id.as_str(), signal.as_deref()), ("c", Some("KILL"))),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            p(&["kill", "c"]).unwrap().command,
            Command::Kill { signal: None, .. }
        ));
        assert!(matches!(p(&["state", "c"]).unwrap().command, Command::State { .. }));
        assert!(matches!(p(&["pause", "c"]).unwrap().command, Command::Pause { .. }));
        assert!(matches!(p(&["resume", "c"]).unwrap().command, Command::Resume { .. }));
    }

    #[test]
    fn usage_errors_are_one_line() {
        for bad in [
            &["create", "c"][..],
            &["run", "--terminal", "c"],
            &["state"],
            &["--log-format", "xml", "state", "c"],
        ] {
            match p(bad) {
                Err(CliError::Usage(msg)) => assert!(!msg.contains('\n'), "{msg}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        assert!(matches!(p(&["--help"]), Err(CliError::Display(t)) if t.ends_with('\n')));
        assert!(matches!(p(&[]), Err(CliError::Usage(m)) if m.starts_with("missing command")));
    }
}
