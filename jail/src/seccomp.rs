//! Translating the OCI `linux.seccomp` section into BPF and installing it.
//!
//! A seccomp filter is a small BPF program the kernel runs on every system call; it sees
//! the architecture, the call number and the six arguments, and returns an action (allow,
//! fail with an errno, kill, trap, log, trace). OCI profiles are written in libseccomp's
//! vocabulary: a default action plus rules of the form "these calls, optionally with these
//! argument conditions, get that action". We compile them with `seccompiler` (Firecracker's
//! pure-Rust BPF generator; no libseccomp, no C).
//!
//! `seccompiler` builds one filter with one "match" action and one "mismatch" action, while
//! a profile can mix several actions. We bridge that with the kernel's own rule for stacked
//! filters: **every installed filter runs, and the most restrictive result wins**
//! (KILL_PROCESS > KILL_THREAD > TRAP > ERRNO > TRACE > LOG > ALLOW). So we install:
//!
//! * a *base* filter (only if the default action is not ALLOW): every call named by any rule
//!   is allowed, everything else gets the default action;
//! * one filter per distinct non-ALLOW rule action A: the calls of A's rules get A, the rest
//!   is allowed.
//!
//! A call matching an A-rule gets ALLOW from the base and A from its filter: A. A call no
//! rule names gets the default from the base and ALLOW elsewhere: the default. Overlapping
//! rules with different actions resolve to the more restrictive one (libseccomp refuses
//! some of those combinations outright; we pick the safe side).
//!
//! Two holes a deny-list on x86_64 must close: calls made through the 32-bit `int 0x80`
//! ABI (a different architecture value in the BPF input) are killed by seccompiler's
//! architecture check, and calls through the x32 ABI (same architecture value, call number
//! with bit 30 set) are answered `ENOSYS` by a small extra filter whenever the default
//! action lets unknown calls through (ALLOW or LOG). Otherwise `mkdir` could be denied while
//! `mkdir | 0x40000000` is not.
//!
//! **Unknown call names.** Profiles often list calls of several architectures (docker's
//! default profile names arm-only calls, for instance). Dropping a name from a rule is safe
//! when the rule is *no more restrictive* than the default action: the call then simply
//! gets the default, which is at least as strict. Dropping a name from a *stricter* rule
//! (say ERRNO with an ALLOW default) would silently allow something the profile meant to
//! forbid — perhaps a typo, perhaps a call newer than our table — so that is refused. The
//! skipped names are reported in one note on stderr.
//!
//! The filter is installed last, right before `execve`, so it need not allow the calls the
//! runtime makes while setting up; it must allow `execve` itself. Installing a filter needs
//! `no_new_privs` or CAP_SYS_ADMIN; see `init` for the order.

use std::collections::BTreeMap;

use oci_spec::runtime::{Arch, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompFilterFlag, LinuxSeccompOperator};
use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use crate::sys::{check_long, Errno};

#[cfg(target_arch = "x86_64")]
mod x86_64;

/// Errors from translating or installing a profile.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp: architecture {0} is not supported (only SCMP_ARCH_X86_64)")]
    UnsupportedArch(String),
    #[error("seccomp: action {0} is not supported")]
    UnsupportedAction(String),
    #[error("seccomp: {0} is not supported")]
    Unsupported(&'static str),
    #[error(
        "seccomp: unknown system call {name:?} in a rule with action {action}, which is stricter than the \
         default action; refusing to drop it"
    )]
    UnknownSyscall { name: String, action: String },
    #[error("seccomp: argument index {0} is out of range (0..=5)")]
    ArgIndex(usize),
    #[error("seccomp: {0}")]
    Compile(seccompiler::BackendError),
    /// Installing the filter in the container's init failed.
    #[error("seccomp: install filter: {0}")]
    Install(Errno),
}

/// A compiled profile: the BPF filters to install, in order, and their flags.
#[derive(Debug, Clone, Default)]
pub struct Program {
    pub filters: Vec<BpfProgram>,
    pub flags: libc::c_ulong,
    /// Names dropped because x86_64 has no such call (only from non-strict rules).
    pub skipped: Vec<String>,
}

/// How permissive an action is (0 = most): the reverse of the kernel's precedence.
fn permissiveness(a: &SeccompAction) -> u8 {
    match a {
        SeccompAction::Allow => 0,
        SeccompAction::Log => 1,
        SeccompAction::Trace(_) => 2,
        SeccompAction::Errno(_) => 3,
        SeccompAction::Trap => 4,
        SeccompAction::KillThread => 5,
        SeccompAction::KillProcess => 6,
    }
}

fn action(a: LinuxSeccompAction, errno_ret: Option<u32>) -> Result<SeccompAction, SeccompError> {
    // libseccomp's default errno for SCMP_ACT_ERRNO/TRACE without a value is EPERM.
    let errno = errno_ret.unwrap_or(libc::EPERM as u32);
    Ok(match a {
        LinuxSeccompAction::ScmpActAllow => SeccompAction::Allow,
        LinuxSeccompAction::ScmpActErrno => SeccompAction::Errno(errno),
        // SCMP_ACT_KILL is libseccomp's name for KILL_THREAD (runc maps it the same way).
        LinuxSeccompAction::ScmpActKill | LinuxSeccompAction::ScmpActKillThread => SeccompAction::KillThread,
        LinuxSeccompAction::ScmpActKillProcess => SeccompAction::KillProcess,
        LinuxSeccompAction::ScmpActTrap => SeccompAction::Trap,
        LinuxSeccompAction::ScmpActLog => SeccompAction::Log,
        LinuxSeccompAction::ScmpActTrace => SeccompAction::Trace(errno),
        LinuxSeccompAction::ScmpActNotify => return Err(SeccompError::UnsupportedAction("SCMP_ACT_NOTIFY".into())),
    })
}

fn op(o: LinuxSeccompOperator, value: u64, value_two: Option<u64>) -> (SeccompCmpOp, u64) {
    match o {
        LinuxSeccompOperator::ScmpCmpEq => (SeccompCmpOp::Eq, value),
        LinuxSeccompOperator::ScmpCmpNe => (SeccompCmpOp::Ne, value),
        LinuxSeccompOperator::ScmpCmpLt => (SeccompCmpOp::Lt, value),
        LinuxSeccompOperator::ScmpCmpLe => (SeccompCmpOp::Le, value),
        LinuxSeccompOperator::ScmpCmpGt => (SeccompCmpOp::Gt, value),
        LinuxSeccompOperator::ScmpCmpGe => (SeccompCmpOp::Ge, value),
        // libseccomp: (arg & value) == valueTwo.
        LinuxSeccompOperator::ScmpCmpMaskedEq => (SeccompCmpOp::MaskedEq(value), value_two.unwrap_or(0)),
    }
}

/// Syscall number -> the conditions under which a rule group matches it. `None` means
/// "unconditionally" (which subsumes any conditional rules for the same call).
type RuleMap = BTreeMap<i64, Option<Vec<SeccompRule>>>;

fn add_rules(map: &mut RuleMap, nr: i64, rules: &Option<Vec<SeccompRule>>) {
    match (map.get_mut(&nr), rules) {
        (Some(None), _) => {}
        (_, None) => {
            map.insert(nr, None);
        }
        (Some(Some(existing)), Some(new)) => existing.extend(new.iter().cloned()),
        (None, Some(new)) => {
            map.insert(nr, Some(new.clone()));
        }
    }
}

fn syscall_number(name: &str) -> Option<i64> {
    #[cfg(target_arch = "x86_64")]
    {
        x86_64::syscall_number(name)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = name;
        None
    }
}

/// Translates an OCI seccomp section into BPF filters.
pub fn compile(sc: &LinuxSeccomp) -> Result<Program, SeccompError> {
    if !cfg!(target_arch = "x86_64") {
        return Err(SeccompError::UnsupportedArch(std::env::consts::ARCH.to_string()));
    }
    for a in sc.architectures().iter().flatten() {
        if !matches!(a, Arch::ScmpArchX86_64 | Arch::ScmpArchNative) {
            return Err(SeccompError::UnsupportedArch(a.to_string()));
        }
    }
    if sc.listener_path().is_some() || sc.listener_metadata().is_some() {
        return Err(SeccompError::Unsupported(
            "listenerPath/listenerMetadata (seccomp notify)",
        ));
    }
    let mut flags: libc::c_ulong = 0;
    for f in sc.flags().iter().flatten() {
        flags |= match f {
            LinuxSeccompFilterFlag::SeccompFilterFlagLog => libc::SECCOMP_FILTER_FLAG_LOG,
            LinuxSeccompFilterFlag::SeccompFilterFlagSpecAllow => libc::SECCOMP_FILTER_FLAG_SPEC_ALLOW,
            // The init is single-threaded, so synchronising threads is a no-op.
            LinuxSeccompFilterFlag::SeccompFilterFlagTsync => libc::SECCOMP_FILTER_FLAG_TSYNC,
            LinuxSeccompFilterFlag::SeccompFilterFlagWaitKillableRecv => {
                return Err(SeccompError::Unsupported("SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV"))
            }
        };
    }
    let default = action(sc.default_action(), sc.default_errno_ret())?;

    // Rule groups keyed by the BPF return value, which identifies action + errno.
    let mut groups: Vec<(u32, SeccompAction, RuleMap)> = Vec::new();
    let mut skipped = Vec::new();
    for rule in sc.syscalls().iter().flatten() {
        let act = action(rule.action(), rule.errno_ret())?;
        if act == default {
            // Same as the default: naming the call changes nothing.
            continue;
        }
        let conds = conditions(rule.args().as_deref().unwrap_or(&[]))?;
        let key = u32::from(act.clone());
        let idx = match groups.iter().position(|g| g.0 == key) {
            Some(i) => i,
            None => {
                groups.push((key, act.clone(), RuleMap::new()));
                groups.len() - 1
            }
        };
        for name in rule.names() {
            match syscall_number(name) {
                Some(nr) => add_rules(&mut groups[idx].2, nr, &conds),
                None if permissiveness(&act) <= permissiveness(&default) => skipped.push(name.clone()),
                None => {
                    return Err(SeccompError::UnknownSyscall {
                        name: name.clone(),
                        action: rule.action().to_string(),
                    })
                }
            }
        }
    }

    let arch = TargetArch::x86_64;
    let to_filter = |rules: &RuleMap, mismatch: SeccompAction, on_match: SeccompAction| {
        let rules = rules
            .iter()
            .map(|(nr, r)| (*nr, r.clone().unwrap_or_default()))
            .collect();
        let filter = SeccompFilter::new(rules, mismatch, on_match, arch).map_err(SeccompError::Compile)?;
        BpfProgram::try_from(filter).map_err(SeccompError::Compile)
    };

    let mut filters = Vec::new();
    if default != SeccompAction::Allow {
        let mut all = RuleMap::new();
        for (_, _, rules) in &groups {
            for (nr, r) in rules {
                add_rules(&mut all, *nr, r);
            }
        }
        filters.push(to_filter(&all, default.clone(), SeccompAction::Allow)?);
    }
    for (_, act, rules) in &groups {
        if *act != SeccompAction::Allow && !rules.is_empty() {
            filters.push(to_filter(rules, SeccompAction::Allow, act.clone())?);
        }
    }
    if matches!(default, SeccompAction::Allow | SeccompAction::Log) && !filters.is_empty() {
        filters.push(x32_guard());
    }
    Ok(Program {
        filters,
        flags,
        skipped,
    })
}

/// OCI argument conditions to seccompiler rules. Conditions on distinct arguments must all
/// hold (one rule). If an argument index repeats, runc (and libseccomp before it) treats
/// each condition as an alternative, so we emit one rule per condition.
fn conditions(args: &[oci_spec::runtime::LinuxSeccompArg]) -> Result<Option<Vec<SeccompRule>>, SeccompError> {
    if args.is_empty() {
        return Ok(None);
    }
    let mut conds = Vec::with_capacity(args.len());
    for a in args {
        let index = u8::try_from(a.index())
            .ok()
            .filter(|i| *i <= 5)
            .ok_or(SeccompError::ArgIndex(a.index()))?;
        let (o, v) = op(a.op(), a.value(), a.value_two());
        conds.push(SeccompCondition::new(index, SeccompCmpArgLen::Qword, o, v).map_err(SeccompError::Compile)?);
    }
    let mut indexes: Vec<usize> = args.iter().map(|a| a.index()).collect();
    indexes.sort_unstable();
    let repeated = indexes.windows(2).any(|w| w[0] == w[1]);
    let rules = if repeated {
        conds
            .into_iter()
            .map(|c| SeccompRule::new(vec![c]))
            .collect::<Result<Vec<_>, _>>()
    } else {
        SeccompRule::new(conds).map(|r| vec![r])
    };
    rules.map(Some).map_err(SeccompError::Compile)
}

/// A filter answering ENOSYS to x32-ABI calls (number >= 0x40000000 with the x86_64
/// architecture value) and allowing everything else. Foreign architectures are killed, as
/// seccompiler's filters do.
fn x32_guard() -> BpfProgram {
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    let ins = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        ins(LD_W_ABS, 0, 0, 4), // seccomp_data.arch
        ins(JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        ins(LD_W_ABS, 0, 0, 0), // seccomp_data.nr
        ins(JGE_K, 0, 1, 0x4000_0000),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

/// Installs the filters into the calling thread. Runs in the container's init after the
/// clone: it only reads memory prepared earlier and makes system calls.
pub fn install(p: &Program) -> Result<(), SeccompError> {
    for f in &p.filters {
        let prog = libc::sock_fprog {
            len: f.len() as libc::c_ushort,
            // seccompiler's sock_filter is #[repr(C)] with the kernel's layout.
            filter: f.as_ptr() as *mut libc::sock_filter,
        };
        // SAFETY: `prog` points at a valid BPF program that outlives the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                p.flags,
                &prog as *const libc::sock_fprog,
            )
        };
        check_long(rc).map_err(SeccompError::Install)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: serde_json::Value) -> LinuxSeccomp {
        serde_json::from_value(v).unwrap()
    }

    fn returns(p: &BpfProgram, k: u32) -> bool {
        p.iter().any(|i| i.code == 0x06 && i.k == k)
    }

    #[test]
    fn errno_rule_with_allow_default() {
        let p = compile(&parse(json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "architectures": ["SCMP_ARCH_X86_64"],
            "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO"}]
        })))
        .unwrap();
        // One ERRNO filter plus the x32 guard; no base filter for an ALLOW default.
        assert_eq!(p.filters.len(), 2);
        let f = &p.filters[0];
        assert!(returns(f, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32));
        assert!(f.iter().any(|i| i.code == 0x15 && i.k == libc::SYS_mkdir as u32));
        assert!(f.iter().any(|i| i.code == 0x15 && i.k == libc::SYS_mkdirat as u32));
        assert!(returns(&p.filters[1], libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32));
        assert!(p.skipped.is_empty());
    }

    #[test]
    fn allow_list_with_errno_default_and_mixed_actions() {
        let p = compile(&parse(json!({
            "defaultAction": "SCMP_ACT_ERRNO",
            "defaultErrnoRet": 38,
            "syscalls": [
                {"names": ["read", "write", "exit_group", "arm_fadvise64_64"], "action": "SCMP_ACT_ALLOW"},
                {"names": ["ptrace"], "action": "SCMP_ACT_KILL_PROCESS"},
                {"names": ["personality"], "action": "SCMP_ACT_ALLOW",
                 "args": [{"index": 0, "value": 0, "op": "SCMP_CMP_EQ"},
                          {"index": 0, "value": 8, "op": "SCMP_CMP_EQ"}]},
                {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
                 "args": [{"index": 0, "value": 2114060288, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]}
            ]
        })))
        .unwrap();
        // Base (allow-list, default ENOSYS) + KILL_PROCESS filter; no x32 guard needed.
        assert_eq!(p.filters.len(), 2);
        assert!(returns(&p.filters[0], libc::SECCOMP_RET_ERRNO | 38));
        assert!(returns(&p.filters[1], libc::SECCOMP_RET_KILL_PROCESS));
        assert_eq!(p.skipped, vec!["arm_fadvise64_64".to_string()]);
    }

    #[test]
    fn refusals() {
        let unknown_strict = compile(&parse(json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": ["mkdir", "no_such_call"], "action": "SCMP_ACT_ERRNO"}]
        })));
        assert!(matches!(unknown_strict, Err(SeccompError::UnknownSyscall { .. })));
        let arch = compile(&parse(
            json!({"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86"]}),
        ));
        assert!(matches!(arch, Err(SeccompError::UnsupportedArch(_))));
        let notify = compile(&parse(json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_NOTIFY"}]
        })));
        assert!(matches!(notify, Err(SeccompError::UnsupportedAction(_))));
        let bad_index = compile(&parse(json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_ERRNO", "args": [{"index": 6, "value": 0, "op": "SCMP_CMP_EQ"}]}]
        })));
        assert!(matches!(bad_index, Err(SeccompError::ArgIndex(6))));
        let bad_action: Result<LinuxSeccomp, _> = serde_json::from_value(json!({"defaultAction": "SCMP_ACT_BOOM"}));
        assert!(bad_action.is_err());
    }

    /// Installs a filter in a forked child and checks the kernel's verdicts.
    #[test]
    fn filter_works_in_a_child() {
        let p = compile(&parse(json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [
                {"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO"},
                {"names": ["getpriority"], "action": "SCMP_ACT_ERRNO", "errnoRet": 33,
                 "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_EQ"}]}
            ]
        })))
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let target = std::ffi::CString::new(dir.path().join("x").into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: the child only makes system calls on memory prepared before the fork.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: the forked child makes system calls on memory prepared before the fork.
            let code = (|| unsafe {
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || install(&p).is_err() {
                    return 10;
                }
                if libc::mkdir(target.as_ptr(), 0o755) != -1 || *libc::__errno_location() != libc::EPERM {
                    return 11;
                }
                // getpriority(PRIO_PROCESS=0, 0) is allowed; getpriority(PRIO_PGRP=1, 0) fails with 33.
                *libc::__errno_location() = 0;
                libc::getpriority(0, 0);
                if *libc::__errno_location() != 0 {
                    return 12;
                }
                if libc::getpriority(1, 0) != -1 || *libc::__errno_location() != 33 {
                    return 13;
                }
                // An x32-ABI mkdir must not slip past the deny rule.
                let r = libc::syscall(libc::SYS_mkdir | 0x4000_0000, target.as_ptr(), 0o755);
                if r != -1 || *libc::__errno_location() != libc::ENOSYS {
                    return 14;
                }
                0
            })();
            crate::sys::exit_now(code);
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child died: {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0);
        assert!(!dir.path().join("x").exists());
    }
}
