//! `process.Process`: commands inside a sandbox, as the E2B SDK's `commands.*` calls them.
//!
//! A command runs as the requesting user (uid, gid, `HOME`), in its own process group, with
//! the sandbox's env vars and the user's home as the default working directory. Its
//! output goes to a broadcast channel: the `Start` stream that launched it and any `Connect`
//! stream that attaches later each follow it from where they joined. With `pty` the command
//! runs on a pseudo-terminal instead of pipes (see [`crate::pty`]).

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{broadcast, Mutex};

use crate::connect::{Code, RpcError};
use crate::paths::Scope;
use crate::pty::{PtyMaster, DEFAULT_SIZE};
use crate::wire::{
    DataEvent, EndEvent, EventResponse, ListResponse, ProcessEvent, ProcessInfo, ProcessSelector, Pty, StartRequest,
};

/// How often an idle stream says it is alive (E2B's SDK expects keepalives on long streams).
const KEEPALIVE: Duration = Duration::from_secs(30);
/// How long a terminal's remaining output is read after its command has exited.
const PTY_DRAIN: Duration = Duration::from_millis(200);
/// Output chunks buffered for followers; a follower further behind loses the oldest ones.
const BACKLOG: usize = 4096;

struct Running {
    info: ProcessInfo,
    stdin: Mutex<Option<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>>,
    /// The terminal's master side, for a PTY session (input goes there, not to `stdin`).
    pty: Option<Arc<PtyMaster>>,
    events: broadcast::Sender<ProcessEvent>,
}

/// Every command running in the sandbox, by PID.
#[derive(Default)]
pub struct Commands {
    running: Mutex<HashMap<u32, Arc<Running>>>,
}

/// Puts a command into its sandbox when envd is hosted by the node rather than running inside
/// (cgroups, namespaces, the home seen at `/home/user`, its own process group); the path is
/// the host directory it starts in. Sets the working directory and `HOME` itself.
pub type Enclose = Arc<dyn Fn(&mut std::process::Command, &std::path::Path) -> Result<(), String> + Send + Sync>;

/// What every command of the sandbox gets besides its own request.
#[derive(Clone, Debug, Default)]
pub struct SandboxEnv {
    pub sandbox_id: String,
    /// The sandbox's env vars (its create request's `envVars`).
    pub vars: std::collections::BTreeMap<String, String>,
}

fn status_of(status: std::process::ExitStatus) -> EndEvent {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => EndEvent {
            exit_code: code,
            exited: true,
            status: format!("exit status {code}"),
            error: None,
        },
        (None, Some(signal)) => EndEvent {
            exit_code: -1,
            exited: false,
            status: format!(
                "signal: {}",
                match signal {
                    9 => "killed",
                    15 => "terminated",
                    2 => "interrupt",
                    _ => "other",
                }
            ),
            error: None,
        },
        (None, None) => EndEvent {
            exit_code: -1,
            exited: false,
            status: "unknown".to_string(),
            error: None,
        },
    }
}

/// Follows `events` (after a first `start`), with keepalives, until the process ends or
/// the caller goes away.
fn follow(
    pid: u32,
    mut events: broadcast::Receiver<ProcessEvent>,
) -> impl Stream<Item = Result<EventResponse, RpcError>> + Send {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        if tx.send(ProcessEvent::Start { pid }).await.is_err() {
            return;
        }
        loop {
            let event = tokio::select! {
                received = events.recv() => match received {
                    Ok(event) => event,
                    // A follower that fell behind skips what it missed rather than stall.
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                () = tokio::time::sleep(KEEPALIVE) => ProcessEvent::Keepalive {},
                () = tx.closed() => return,
            };
            let last = matches!(event, ProcessEvent::End(_));
            if tx.send(event).await.is_err() || last {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx).map(|event| Ok(EventResponse { event }))
}

/// Copies a pipe into output events until it closes.
async fn pump<R: tokio::io::AsyncRead + Unpin>(pipe: Option<R>, events: broadcast::Sender<ProcessEvent>, stdout: bool) {
    let Some(mut pipe) = pipe else { return };
    let mut buf = vec![0u8; 32 * 1024];
    while let Ok(n) = pipe.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let chunk = buf[..n].to_vec();
        let data = if stdout {
            DataEvent::Stdout(chunk)
        } else {
            DataEvent::Stderr(chunk)
        };
        let _ = events.send(ProcessEvent::Data(data));
    }
}

/// Copies a terminal's output into events until its last user has gone.
async fn pump_pty(pty: Arc<PtyMaster>, events: broadcast::Sender<ProcessEvent>) {
    let mut buf = vec![0u8; 32 * 1024];
    while let Ok(n) = pty.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let _ = events.send(ProcessEvent::Data(DataEvent::Pty(buf[..n].to_vec())));
    }
}

/// A terminal's size from the request, clamped to what a terminal can be.
fn pty_size(pty: &Pty) -> (u16, u16) {
    let (cols, rows) = pty.size.as_ref().map_or(DEFAULT_SIZE, |s| {
        (s.cols.clamp(1, 10_000) as u16, s.rows.clamp(1, 10_000) as u16)
    });
    (cols, rows)
}

impl Commands {
    async fn find(&self, selector: &ProcessSelector) -> Result<Arc<Running>, RpcError> {
        let table = self.running.lock().await;
        let found = match (&selector.pid, &selector.tag) {
            (Some(pid), _) => table.get(pid).cloned(),
            (None, Some(tag)) => table.values().find(|r| r.info.tag.as_deref() == Some(tag)).cloned(),
            (None, None) => None,
        };
        found.ok_or_else(|| RpcError::new(Code::NotFound, format!("process {selector:?} not found")))
    }

    /// Starts a command and returns the stream of its events.
    pub async fn start(
        self: &Arc<Self>,
        sandbox: &SandboxEnv,
        scope: &Scope<'_>,
        enclose: Option<&Enclose>,
        req: StartRequest,
    ) -> Result<impl Stream<Item = Result<EventResponse, RpcError>> + Send, RpcError> {
        if req.process.cmd.is_empty() {
            return Err(RpcError::new(Code::InvalidArgument, "process.cmd is empty"));
        }
        let cwd = match &req.process.cwd {
            Some(cwd) if !cwd.is_empty() => scope.resolve(cwd)?,
            _ => match scope.users.default_workdir() {
                Some(workdir) if scope.hosted_home.is_none() && workdir.is_dir() => workdir.to_path_buf(),
                // A home that is not there (an image's account with `/nonexistent`, a bare
                // uid): `/`, where Docker starts a process with no working directory.
                _ if scope.hosted_home.is_none() && !scope.home().is_dir() => std::path::PathBuf::from("/"),
                _ => scope.home(),
            },
        };
        let user = scope.user;
        if !cwd.is_dir() {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!(
                    "working directory {:?} does not exist",
                    req.process.cwd.as_deref().unwrap_or("")
                ),
            ));
        }
        let terminal = match &req.pty {
            Some(pty) => {
                let (cols, rows) = pty_size(pty);
                let (master, slave) = crate::pty::open(cols, rows)
                    .map_err(|e| RpcError::new(Code::Internal, format!("cannot open a terminal: {e}")))?;
                Some((Arc::new(master), slave))
            }
            None => None,
        };
        let mut env: Vec<(&str, &str)> = vec![
            ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
            ("USER", &user.name),
            ("LOGNAME", &user.name),
            ("E2B_SANDBOX", "true"),
            ("E2B_SANDBOX_ID", &sandbox.sandbox_id),
        ];
        if terminal.is_some() {
            env.push(("TERM", "xterm-256color"));
        }
        env.extend(sandbox.vars.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        env.extend(req.process.envs.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let launch = Launch {
            program: program(&req.process.cmd, scope.hosted_home.is_some()),
            args: &req.process.args,
            env,
            cwd: &cwd,
            user,
            terminal: terminal.as_ref().map(|(_, slave)| slave),
            stdin: req.stdin.unwrap_or(true),
        };
        let spawned = match enclose {
            Some(enclose) => launch.hosted(enclose),
            None => launch.inside(),
        };
        // The command has its copies of the terminal; ours must close, or reading the master
        // would never see the end.
        let pty = terminal.map(|(master, _slave)| master);
        let Spawned {
            mut child,
            stdin,
            stdout,
            stderr,
        } = spawned.map_err(|e| match e {
            LaunchError::Refused(e) => e,
            LaunchError::Start(e) => RpcError::new(
                Code::InvalidArgument,
                format!("cannot start {:?}: {e}", req.process.cmd),
            ),
        })?;
        let pid = child.id();
        let (events, first) = broadcast::channel(BACKLOG);
        let running = Arc::new(Running {
            info: ProcessInfo {
                config: req.process.clone(),
                pid,
                tag: req.tag.clone(),
            },
            stdin: Mutex::new(stdin),
            pty: pty.clone(),
            events: events.clone(),
        });
        self.running.lock().await.insert(pid, running);
        tracing::debug!(pid, user = %user.name, cmd = %req.process.cmd, "command started");

        let this = self.clone();
        tokio::spawn(async move {
            let status = match pty {
                Some(pty) => {
                    // A terminal's output ends when its last user closes it, which a job the
                    // shell left running may never do: once the command itself has exited,
                    // what is left is read for a moment and the session ends.
                    let pump = pump_pty(pty, events.clone());
                    tokio::pin!(pump);
                    let exited = tokio::select! {
                        status = child.wait() => Some(status),
                        () = &mut pump => None,
                    };
                    match exited {
                        Some(status) => {
                            let _ = tokio::time::timeout(PTY_DRAIN, pump).await;
                            status
                        }
                        None => child.wait().await,
                    }
                }
                None => {
                    tokio::join!(pump(stdout, events.clone(), true), pump(stderr, events.clone(), false));
                    child.wait().await
                }
            };
            let end = match status {
                Ok(status) => status_of(status),
                Err(err) => EndEvent {
                    exit_code: -1,
                    exited: false,
                    status: "unknown".into(),
                    error: Some(err.to_string()),
                },
            };
            this.running.lock().await.remove(&pid);
            let _ = events.send(ProcessEvent::End(end));
        });
        Ok(follow(pid, first))
    }

    /// Attaches to a running command.
    pub async fn connect(
        &self,
        selector: &ProcessSelector,
    ) -> Result<impl Stream<Item = Result<EventResponse, RpcError>> + Send, RpcError> {
        let running = self.find(selector).await?;
        Ok(follow(running.info.pid, running.events.subscribe()))
    }

    pub async fn list(&self) -> ListResponse {
        let table = self.running.lock().await;
        let mut processes: Vec<ProcessInfo> = table.values().map(|r| r.info.clone()).collect();
        processes.sort_by_key(|p| p.pid);
        ListResponse { processes }
    }

    pub async fn send_input(&self, selector: &ProcessSelector, data: &[u8]) -> Result<(), RpcError> {
        let running = self.find(selector).await?;
        if let Some(pty) = &running.pty {
            return pty
                .write_all(data)
                .await
                .map_err(|e| RpcError::new(Code::FailedPrecondition, format!("writing to the terminal: {e}")));
        }
        let mut stdin = running.stdin.lock().await;
        let pipe = stdin
            .as_mut()
            .ok_or_else(|| RpcError::new(Code::FailedPrecondition, "the process has no open stdin"))?;
        pipe.write_all(data)
            .await
            .map_err(|e| RpcError::new(Code::FailedPrecondition, format!("writing stdin: {e}")))?;
        pipe.flush()
            .await
            .map_err(|e| RpcError::new(Code::Internal, e.to_string()))
    }

    pub async fn close_stdin(&self, selector: &ProcessSelector) -> Result<(), RpcError> {
        let running = self.find(selector).await?;
        if running.pty.is_some() {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                "a terminal has no stdin to close; send Ctrl+D (0x04) instead",
            ));
        }
        running.stdin.lock().await.take();
        Ok(())
    }

    /// Resizes a command's terminal.
    pub async fn resize(&self, selector: &ProcessSelector, pty: &Pty) -> Result<(), RpcError> {
        let running = self.find(selector).await?;
        let terminal = running
            .pty
            .as_ref()
            .ok_or_else(|| RpcError::new(Code::FailedPrecondition, "the process has no terminal"))?;
        let (cols, rows) = pty_size(pty);
        terminal
            .resize(cols, rows)
            .map_err(|e| RpcError::new(Code::Internal, format!("resizing the terminal: {e}")))
    }

    /// Sends `signal` to the command's whole process group.
    pub async fn signal(&self, selector: &ProcessSelector, signal: &serde_json::Value) -> Result<(), RpcError> {
        let number = match signal {
            serde_json::Value::String(s) if s == "SIGNAL_SIGKILL" => rustix::process::Signal::KILL,
            serde_json::Value::String(s) if s == "SIGNAL_SIGTERM" => rustix::process::Signal::TERM,
            serde_json::Value::Number(n) if n.as_i64() == Some(9) => rustix::process::Signal::KILL,
            serde_json::Value::Number(n) if n.as_i64() == Some(15) => rustix::process::Signal::TERM,
            other => {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    format!("unsupported signal {other}"),
                ))
            }
        };
        let running = self.find(selector).await?;
        let pid = i32::try_from(running.info.pid).map_err(|_| RpcError::new(Code::Internal, "pid out of range"))?;
        if let Some(pid) = rustix::process::Pid::from_raw(pid) {
            // The group first, so what the command started dies with it; the command itself
            // too, in case it left its group. Either may have gone already.
            let _ = rustix::process::kill_process_group(pid, number);
            let _ = rustix::process::kill_process(pid, number);
        }
        Ok(())
    }
}

/// The program to run for `cmd`. E2B's SDKs run every command as `/bin/bash -l -c …`; in a
/// template whose image has no bash (Alpine, busybox) that is the image's POSIX `/bin/sh`,
/// which takes the same flags, so any Linux image serves the SDK.
fn program(cmd: &str, hosted: bool) -> &str {
    let missing = |p: &str| !std::path::Path::new(p).exists();
    if cmd == "/bin/bash" && !hosted && missing(cmd) && !missing("/bin/sh") {
        return "/bin/sh";
    }
    cmd
}

/// What starting one command takes, whichever way it starts.
struct Launch<'a> {
    program: &'a str,
    args: &'a [String],
    /// In order: a later value of a name replaces an earlier one.
    env: Vec<(&'a str, &'a str)>,
    cwd: &'a std::path::Path,
    user: &'a crate::users::User,
    /// The terminal's slave side, for a PTY session: the command's three streams.
    terminal: Option<&'a std::os::fd::OwnedFd>,
    /// Whether the command's stdin is a pipe envd writes (else `/dev/null`).
    stdin: bool,
}

/// A started command and envd's ends of its pipes.
struct Spawned {
    child: Child,
    stdin: Option<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>,
    stdout: Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>>,
    stderr: Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>>,
}

enum LaunchError {
    /// Refused before anything started, in the RPC's own words.
    Refused(RpcError),
    /// The system would not start it.
    Start(std::io::Error),
}

/// A started command: envd's own ([`crate::spawn`]) inside a sandbox, or std's for one the
/// node hosts (its enclosing needs code run between fork and exec).
enum Child {
    Inside(crate::spawn::Child),
    Hosted(tokio::process::Child),
}

impl Child {
    fn id(&self) -> u32 {
        match self {
            Child::Inside(child) => child.id(),
            // A child not yet waited for always has its PID.
            Child::Hosted(child) => child.id().unwrap_or_default(),
        }
    }

    async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match self {
            Child::Inside(child) => child.wait().await,
            Child::Hosted(child) => child.wait().await,
        }
    }
}

impl Launch<'_> {
    /// Envd inside its sandbox, as root: the command runs as the user, in its own process
    /// group (or session, on a terminal), started without copying envd.
    fn inside(self) -> Result<Spawned, LaunchError> {
        use crate::spawn::{Command, Session, Stdio as Stream};
        let mut cmd = Command::new(self.program);
        cmd.args(self.args)
            .envs(self.env.iter().copied())
            .env("HOME", &self.user.home)
            .current_dir(self.cwd);
        let me = rustix::process::geteuid().as_raw();
        if me == 0 && self.user.uid != 0 {
            cmd.ids(self.user.uid, self.user.gid);
        } else if me != self.user.uid {
            return Err(LaunchError::Refused(RpcError::new(
                Code::PermissionDenied,
                format!("envd runs as uid {me} and cannot act as {}", self.user.name),
            )));
        }
        let streams = match self.terminal {
            Some(slave) => {
                cmd.session(Session::Terminal);
                let fd = || -> Result<Stream, LaunchError> {
                    let copy = slave
                        .try_clone()
                        .map_err(|e| LaunchError::Refused(RpcError::new(Code::Internal, format!("terminal: {e}"))))?;
                    Ok(Stream::Fd(copy))
                };
                (fd()?, fd()?, fd()?)
            }
            None => (
                if self.stdin { Stream::Piped } else { Stream::Null },
                Stream::Piped,
                Stream::Piped,
            ),
        };
        let mut child = cmd.spawn(streams.0, streams.1, streams.2).map_err(LaunchError::Start)?;
        Ok(Spawned {
            stdin: child.stdin.take().map(|s| Box::new(s) as _),
            stdout: child.stdout.take().map(|s| Box::new(s) as _),
            stderr: child.stderr.take().map(|s| Box::new(s) as _),
            child: Child::Inside(child),
        })
    }

    /// Envd hosted by the node (its unisolated mode): `enclose` puts the command into the
    /// sandbox, sets its working directory and `HOME`, and runs it as the node runs.
    fn hosted(self, enclose: &Enclose) -> Result<Spawned, LaunchError> {
        use std::os::unix::process::CommandExt;
        let mut std_cmd = std::process::Command::new(self.program);
        std_cmd.args(self.args).env_clear().envs(self.env.iter().copied());
        enclose(&mut std_cmd, self.cwd).map_err(|e| LaunchError::Refused(RpcError::new(Code::Unavailable, e)))?;
        if self.terminal.is_some() {
            // SAFETY: take_terminal makes only async-signal-safe system calls, in the forked
            // child before exec; it runs after the enclosing's own (closures run in the order
            // they were added), so in the process that execs.
            unsafe {
                std_cmd.pre_exec(|| crate::pty::take_terminal());
            }
        }
        let mut cmd = tokio::process::Command::from(std_cmd);
        match self.terminal {
            Some(slave) => {
                let stdio = || {
                    slave
                        .try_clone()
                        .map(Stdio::from)
                        .map_err(|e| LaunchError::Refused(RpcError::new(Code::Internal, format!("terminal: {e}"))))
                };
                cmd.stdin(stdio()?).stdout(stdio()?).stderr(stdio()?);
            }
            None => {
                cmd.stdin(if self.stdin { Stdio::piped() } else { Stdio::null() })
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
            }
        }
        let spawned = cmd.spawn();
        // The command has its copies of the terminal; these must close with the command.
        drop(cmd);
        let mut child = spawned.map_err(LaunchError::Start)?;
        Ok(Spawned {
            stdin: child.stdin.take().map(|s| Box::new(s) as _),
            stdout: child.stdout.take().map(|s| Box::new(s) as _),
            stderr: child.stderr.take().map(|s| Box::new(s) as _),
            child: Child::Hosted(child),
        })
    }
}
