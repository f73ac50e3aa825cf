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
    // single-threaded process.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(()),
        server => reap_until(server),
    }
}

/// Reaps every child, forever; exits as `server` did once it has ended.
fn reap_until(server: libc::pid_t) -> ! {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes only to `status`.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid == server {
            let code = if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                128 + libc::WTERMSIG(status)
            };
            std::process::exit(code);
        }
        if pid == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
            std::process::exit(1);
        }
    }
}
