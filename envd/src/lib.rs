//! envd: E2B's in-sandbox API, served from inside the sandbox it belongs to.
//!
//! The node starts this program as the sandbox's first process (PID 1 in a container). As PID 1
//! it forks once: the parent stays PID 1 and only reaps whatever is orphaned to it (a command's
//! background jobs), the child serves the API ([`init`]). It listens on a Unix socket the node
//! created and handed in as an open file descriptor, so the only way in is the node, which
//! checks the sandbox's access token first ([`server`]).
//!
//! Because it runs inside, every path means what it means in the sandbox, commands are plain
//! children started as the requesting user ([`users`], [`process`], [`pty`]), and the kernel,
//! not this code, keeps the sandbox's files and processes apart from the host's.
//!
//! Modules: [`connect`] and [`wire`] are the Connect protocol and its JSON messages;
//! [`process`], [`pty`], [`filesystem`], [`watch`] and [`files`] the services; [`paths`]
//! and [`users`] how a request's user and paths are read; [`metadata`] the user-defined
//! metadata uploads attach to files.

pub mod connect;
pub mod files;
pub mod filesystem;
pub mod init;
pub mod metadata;
pub mod paths;
pub mod process;
pub mod pty;
pub mod server;
pub mod spawn;
pub mod users;
pub mod watch;
pub mod wire;

use std::ffi::OsString;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::process::ExitCode;

pub use process::SandboxEnv;
pub use server::Envd;
pub use users::Users;

/// The variables the node starts envd with (defined with the node's side of them).
pub use contracts::envd::{DEFAULT_USER_VAR, DEFAULT_WORKDIR_VAR, SANDBOX_ID_VAR, START_COMMAND_VAR, VARS_VAR};

/// Where envd listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A listening Unix socket inherited as this file descriptor (the node's way).
    Fd(i32),
    /// A socket path envd binds itself (tests, manual runs).
    Path(PathBuf),
}

/// How envd runs.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: Listen,
    pub sandbox: SandboxEnv,
    pub users: Users,
    /// Run by `sh -c` as the default user once envd serves.
    pub start_command: Option<String>,
    /// A pipe's read end: the start command waits for it to close (the node closes it once
    /// the sandbox's network is up, so the command never starts without it).
    pub boot_fd: Option<i32>,
}

/// A listening socket at `path`, which appears only once it accepts: bound under a name of
/// its own and then renamed into place. `bind` makes the name before `listen` makes it accept,
/// so whoever waits for the path to exist and then connects could be refused in between
/// (seen under load).
fn listen_at(path: &std::path::Path) -> std::io::Result<tokio::net::UnixListener> {
    let mut staging = path.as_os_str().to_owned();
    staging.push(format!(".binding-{}", std::process::id()));
    let staging = std::path::PathBuf::from(staging);
    let _ = std::fs::remove_file(&staging);
    let listener = tokio::net::UnixListener::bind(&staging)?;
    // Over whatever an earlier envd left at `path`.
    std::fs::rename(&staging, path)?;
    Ok(listener)
}

/// A descriptor number given on the command line: a number, and not negative (`-1` is no
/// descriptor, and borrowing it would panic).
fn descriptor(flag: &str, value: &str) -> Result<i32, String> {
    match value.parse::<i32>() {
        Ok(fd) if fd >= 0 => Ok(fd),
        _ => Err(format!("{flag} {value:?} is not a descriptor number")),
    }
}

const USAGE: &str = "usage: envd (--listen-fd N | --listen PATH) [--boot-fd N] [--passwd FILE] [--fallback-home DIR]
  The sandbox's ID and env vars come from ENVD_SANDBOX_ID and ENVD_VARS (a JSON object).";

/// Reads the command line (without the program name) and the environment.
pub fn config(args: impl IntoIterator<Item = OsString>) -> Result<Config, String> {
    let mut listen = None;
    let mut passwd = PathBuf::from("/etc/passwd");
    let mut fallback_home = None;
    let mut boot_fd = None;
    let mut args = args.into_iter().map(|a| a.to_string_lossy().into_owned());
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value\n{USAGE}"));
        match arg.as_str() {
            "--listen-fd" => {
                let fd = value()?;
                listen = Some(Listen::Fd(descriptor("--listen-fd", &fd)?));
            }
            "--listen" => listen = Some(Listen::Path(value()?.into())),
            "--boot-fd" => {
                let fd = value()?;
                boot_fd = Some(descriptor("--boot-fd", &fd)?);
            }
            "--passwd" => passwd = value()?.into(),
            "--fallback-home" => fallback_home = Some(PathBuf::from(value()?)),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let listen = listen.ok_or_else(|| format!("where to listen is required\n{USAGE}"))?;
    let vars = match std::env::var(VARS_VAR) {
        Ok(json) => {
            serde_json::from_str(&json).map_err(|e| format!("{VARS_VAR} is not a JSON object of strings: {e}"))?
        }
        Err(_) => Default::default(),
    };
    Ok(Config {
        listen,
        sandbox: SandboxEnv {
            sandbox_id: std::env::var(SANDBOX_ID_VAR).unwrap_or_default(),
            vars,
        },
        users: Users::new(passwd, fallback_home).with_defaults(
            &std::env::var(DEFAULT_USER_VAR).unwrap_or_default(),
            &std::env::var(DEFAULT_WORKDIR_VAR).unwrap_or_default(),
        ),
        start_command: std::env::var(START_COMMAND_VAR).ok().filter(|c| !c.trim().is_empty()),
        boot_fd,
    })
}

/// Longest line of a start command's output logged as one entry; longer lines are cut.
const MAX_LOG_LINE: usize = 16 << 10;

/// Logs each line of `output` (a start command's stdout or stderr) as an event of envd's
/// own log, which the node keeps outside the sandbox and serves as the sandbox's logs.
fn log_lines(output: impl tokio::io::AsyncRead + Unpin + Send + 'static, stream: &'static str) {
    use tokio::io::AsyncBufReadExt;
    tokio::spawn(async move {
        let mut reader = tokio::io::BufReader::new(output);
        let mut line = Vec::new();
        loop {
            line.clear();
            let mut cut = false;
            // Read one line, keeping at most MAX_LOG_LINE bytes of it.
            loop {
                let (done, used) = match reader.fill_buf().await {
                    Ok([]) | Err(_) if line.is_empty() && !cut => return,
                    Ok([]) | Err(_) => (true, 0),
                    Ok(buf) => match buf.iter().position(|b| *b == b'\n') {
                        Some(at) => {
                            let room = MAX_LOG_LINE.saturating_sub(line.len()).min(at);
                            line.extend_from_slice(&buf[..room]);
                            cut |= room < at;
                            (true, at + 1)
                        }
                        None => {
                            let room = MAX_LOG_LINE.saturating_sub(line.len()).min(buf.len());
                            line.extend_from_slice(&buf[..room]);
                            cut |= room < buf.len();
                            (false, buf.len())
                        }
                    },
                };
                reader.consume(used);
                if done {
                    break;
                }
            }
            let text = String::from_utf8_lossy(&line);
            tracing::info!(target: "start", stream, cut, "{}", text.trim_end_matches('\r'));
        }
    });
}

/// Starts the sandbox's start command in the background as the default user, each line of
/// its output an event of envd's log (see [`log_lines`]); reaped when it ends.
fn boot(config: &Config) {
    let Some(command) = config.start_command.clone() else {
        return;
    };
    let user = match config.users.lookup(config.users.default_user()) {
        Ok(user) => user,
        Err(err) => {
            tracing::error!(message = %err.message, "start command not started");
            return;
        }
    };
    let mut cmd = tokio::process::Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(&command)
        .env_clear()
        .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        .env("HOME", &user.home)
        .env("USER", &user.name)
        .env("E2B_SANDBOX", "true")
        .env("E2B_SANDBOX_ID", &config.sandbox.sandbox_id)
        .envs(&config.sandbox.vars)
        .current_dir(
            config
                .users
                .default_workdir()
                .filter(|w| w.is_dir())
                .unwrap_or(&user.home),
        )
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0);
    if rustix::process::geteuid().is_root() && user.uid != 0 {
        cmd.uid(user.uid).gid(user.gid);
    }
    match cmd.spawn() {
        Ok(mut child) => {
            if let Some(out) = child.stdout.take() {
                log_lines(out, "stdout");
            }
            if let Some(err) = child.stderr.take() {
                log_lines(err, "stderr");
            }
            tracing::info!(target: "start", command = %command, "start command started");
            tokio::spawn(async move {
                let status = child.wait().await;
                tracing::info!(target: "start", ?status, "start command ended");
            });
        }
        Err(err) => tracing::error!(%err, "start command not started"),
    }
}

/// Blocks until the write end of the pipe at `fd` is closed, then closes `fd`.
fn wait_for_close(fd: i32) {
    use std::io::Read as _;
    // SAFETY: the node handed this descriptor in for exactly this; nothing else here owns it.
    let mut pipe = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut buf = [0u8; 16];
    while matches!(pipe.read(&mut buf), Ok(n) if n > 0) {}
}

/// Serves until the listener fails.
pub async fn serve(listener: tokio::net::UnixListener, envd: Envd) -> std::io::Result<()> {
    axum::serve(listener, envd.router()).await
}

/// The program: `sandboxsched-envd ARGS`, or `node-svc envd ARGS` (the node's binary carries
/// envd too and runs itself inside each sandbox).
pub fn main(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let config = match config(args) {
        Ok(config) => config,
        Err(message) => {
            eprintln!("envd: {message}");
            return ExitCode::from(2);
        }
    };
    // Out of reach of the sandbox's root: a process that is not dumpable may be traced, have
    // its memory read or its descriptors taken (`ptrace`, `process_vm_readv`, `pidfd_getfd`,
    // `/proc/PID/fd`, `/proc/PID/mem`, `/proc/PID/environ`) only by a holder of CAP_SYS_PTRACE,
    // which no sandbox has. Without this, root in the sandbox (the same uid as envd) could
    // take envd's listening socket and answer the node's requests itself. The fork into init
    // and server keeps the flag; the commands envd starts are dumpable again from their exec,
    // so users still debug their own programs.
    if let Err(err) = rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable) {
        eprintln!("envd: cannot make itself non-dumpable: {err}");
        return ExitCode::FAILURE;
    }
    // The descriptors the node handed in (envd's listening socket, the boot pipe) arrive
    // without close-on-exec, as every inherited descriptor does: every command would inherit
    // them, and any user could accept the node's connections to envd, tokens and all.
    let handed_in = [
        match config.listen {
            Listen::Fd(fd) => Some(fd),
            Listen::Path(_) => None,
        },
        config.boot_fd,
    ];
    for fd in handed_in.into_iter().flatten() {
        // SAFETY: the node handed this descriptor in, open, for envd alone; it is only
        // borrowed for the one call that marks it.
        let handed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        if let Err(err) = rustix::io::fcntl_setfd(handed, rustix::io::FdFlags::CLOEXEC) {
            eprintln!("envd: descriptor {fd}: {err}");
            return ExitCode::FAILURE;
        }
    }
    // SAFETY: removing variables before any thread exists.
    unsafe {
        std::env::remove_var(SANDBOX_ID_VAR);
        std::env::remove_var(VARS_VAR);
        std::env::remove_var(START_COMMAND_VAR);
    }
    // Forks when PID 1: must happen before the runtime starts threads.
    if let Err(e) = init::become_init_if_pid1() {
        eprintln!("envd: cannot start as init: {e}");
        return ExitCode::FAILURE;
    }
    // One JSON object a line: the node reads this log back as the sandbox's logs.
    let _ = tracing_subscriber::fmt()
        .json()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ENVD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    // One thread serves: a sandbox's envd is mostly idle and waits on I/O when it is not, and
    // a command is started with fork (it must change user), whose copy-on-write faults after
    // it shoot down TLB entries on every CPU another thread of this process runs on.
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("envd: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    let served = runtime.block_on(async move {
        let listener = match &config.listen {
            Listen::Fd(fd) => {
                // SAFETY: the node handed this descriptor in for exactly this; nothing else
                // in this process owns it.
                let std = unsafe { std::os::unix::net::UnixListener::from_raw_fd(*fd) };
                std.set_nonblocking(true)?;
                tokio::net::UnixListener::from_std(std)?
            }
            Listen::Path(path) => listen_at(path)?,
        };
        tracing::info!(sandbox_id = %config.sandbox.sandbox_id, "envd serving");
        let booting = config.clone();
        tokio::spawn(async move {
            if let Some(fd) = booting.boot_fd {
                let _ = tokio::task::spawn_blocking(move || wait_for_close(fd)).await;
            }
            boot(&booting);
        });
        serve(listener, Envd::new(config.sandbox, config.users)).await
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("envd: {e}");
            ExitCode::FAILURE
        }
    }
}
