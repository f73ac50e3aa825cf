//! Signal names, parsed the way runc's `kill` parses them.
//!
//! runc upper-cases the argument, strips an optional `SIG` prefix and looks the rest up; a
//! plain number is taken as is. `KILL`, `SIGKILL`, `kill` and `9` are therefore the same.

/// Errors from parsing a signal argument.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignalError {
    #[error("unknown signal {0:?}")]
    Unknown(String),
}

const NAMES: &[(&str, libc::c_int)] = &[
    ("HUP", libc::SIGHUP),
    ("INT", libc::SIGINT),
    ("QUIT", libc::SIGQUIT),
    ("ILL", libc::SIGILL),
    ("TRAP", libc::SIGTRAP),
    ("ABRT", libc::SIGABRT),
    ("IOT", libc::SIGIOT),
    ("BUS", libc::SIGBUS),
    ("FPE", libc::SIGFPE),
    ("KILL", libc::SIGKILL),
    ("USR1", libc::SIGUSR1),
    ("SEGV", libc::SIGSEGV),
    ("USR2", libc::SIGUSR2),
    ("PIPE", libc::SIGPIPE),
    ("ALRM", libc::SIGALRM),
    ("TERM", libc::SIGTERM),
    ("STKFLT", libc::SIGSTKFLT),
    ("CHLD", libc::SIGCHLD),
    ("CONT", libc::SIGCONT),
    ("STOP", libc::SIGSTOP),
    ("TSTP", libc::SIGTSTP),
    ("TTIN", libc::SIGTTIN),
    ("TTOU", libc::SIGTTOU),
    ("URG", libc::SIGURG),
    ("XCPU", libc::SIGXCPU),
    ("XFSZ", libc::SIGXFSZ),
    ("VTALRM", libc::SIGVTALRM),
    ("PROF", libc::SIGPROF),
    ("WINCH", libc::SIGWINCH),
    ("IO", libc::SIGIO),
    ("POLL", libc::SIGPOLL),
    ("PWR", libc::SIGPWR),
    ("SYS", libc::SIGSYS),
];

/// The signal `kill` sends when none is given (runc's default too).
pub const DEFAULT: libc::c_int = libc::SIGTERM;

/// Parses `KILL`, `SIGKILL`, `kill`, `9`, ... into a signal number.
pub fn parse(arg: &str) -> Result<libc::c_int, SignalError> {
    let unknown = || SignalError::Unknown(arg.to_string());
    if let Ok(n) = arg.parse::<libc::c_int>() {
        // 1..=64 are the real-time and standard signals; 0 only probes and is not a signal.
        return if (1..=64).contains(&n) { Ok(n) } else { Err(unknown()) };
    }
    let upper = arg.to_ascii_uppercase();
    let name = upper.strip_prefix("SIG").unwrap_or(&upper);
    NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, s)| s)
        .ok_or_else(unknown)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_numbers_and_prefixes() {
        assert_eq!(parse("KILL"), Ok(libc::SIGKILL));
        assert_eq!(parse("SIGKILL"), Ok(libc::SIGKILL));
        assert_eq!(parse("kill"), Ok(libc::SIGKILL));
        assert_eq!(parse("TERM"), Ok(libc::SIGTERM));
        assert_eq!(parse("sigterm"), Ok(libc::SIGTERM));
        assert_eq!(parse("9"), Ok(9));
        assert_eq!(parse("15"), Ok(15));
        assert_eq!(parse("USR1"), Ok(libc::SIGUSR1));
        assert!(parse("0").is_err());
        assert!(parse("65").is_err());
        assert!(parse("-9").is_err());
        assert!(parse("NOPE").is_err());
        assert!(parse("").is_err());
        assert_eq!(DEFAULT, libc::SIGTERM);
    }
}
