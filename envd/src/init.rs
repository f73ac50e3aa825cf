//! PID 1's duty. In a PID namespace the first process inherits every orphan: a command that
//! leaves a background job behind and exits hands that job to PID 1, which must reap it when it
//! ends or it stays a zombie for the sandbox's life. An async server cannot reap for others
//! without stealing the exit statuses its own children's handles wait for, so envd splits in
//! two before any thread exists: PID 1 forks the server and then does nothing but reap; when
//! the server ends, PID 1 exits with its status (and the kernel ends the namespace with it).

use std::io;

/// Forks when this process is PID 1: returns in the child (which serves) and never returns in
/// the parent. Returns at once when this is not PID 1 (envd run outside a container).
pub fn become_init_if_pid1() -> io::Result<()> {
    if std::process::id() != 1 {
        return Ok(());
    }
    // SAFETY: called before any thread is started, so the child is a full copy of a
    // single-threaded process. (rustix has no fork: it is unsafe in any program with threads.)
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(()),
        server => reap_until(server),
    }
}

/// Reaps every child, forever; exits as `server` did once it has ended.
fn reap_until(server: libc::pid_t) -> ! {
    loop {
        match rustix::process::wait(rustix::process::WaitOptions::empty()) {
            Ok(Some((pid, status))) if pid.as_raw_nonzero().get() == server => {
                let code = status
                    .exit_status()
                    .or_else(|| status.terminating_signal().map(|signal| 128 + signal))
                    .unwrap_or(1);
                std::process::exit(code);
            }
            Err(rustix::io::Errno::CHILD) => std::process::exit(1),
            _ => {}
        }
    }
}
