//! Linux capabilities: which privileges of root the container process keeps.
//!
//! A process has five capability sets. The ones the spec controls:
//!
//! * **bounding**: the ceiling; a capability dropped here can never be regained, not even
//!   by executing a setuid-root or file-capability binary. Dropping needs CAP_SETPCAP, so it
//!   happens first, while the init still has every capability (of its user namespace).
//! * **permitted / effective**: what the process may use / is using now.
//! * **inheritable**: what may pass through `execve` to programs with matching file caps.
//! * **ambient**: what passes through `execve` to ordinary programs (for non-root users);
//!   a capability can only be ambient if it is permitted and inheritable.
//!
//! Changing uid from 0 to non-zero normally clears permitted and effective; with
//! `PR_SET_KEEPCAPS` the permitted set survives, and `capset` then sets all three sets
//! exactly. Ambient capabilities are raised last. (For uid 0, `execve` grants the whole
//! bounding set anyway, which is why the bounding set is what matters for root.)
//!
//! As in runc, a spec without `process.capabilities` leaves the capability sets alone.

use oci_spec::runtime::{Capabilities, Capability, LinuxCapabilities};

use crate::sys::{check, check_long, Errno};

/// Errors from applying capabilities in the container's init.
#[derive(Debug, thiserror::Error)]
pub enum CapsError {
    #[error("drop capability {cap} from the bounding set: {errno}")]
    Bounding { cap: u32, errno: Errno },
    #[error("prctl(PR_SET_KEEPCAPS): {0}")]
    KeepCaps(Errno),
    #[error("capset: {0}")]
    Capset(Errno),
    #[error("raise ambient capability {cap}: {errno}")]
    Ambient { cap: u32, errno: Errno },
}

/// The kernel number of a capability (`include/uapi/linux/capability.h`).
pub fn number(c: Capability) -> u32 {
    use Capability::*;
    match c {
        Chown => 0,
        DacOverride => 1,
        DacReadSearch => 2,
        Fowner => 3,
        Fsetid => 4,
        Kill => 5,
        Setgid => 6,
        Setuid => 7,
        Setpcap => 8,
        LinuxImmutable => 9,
        NetBindService => 10,
        NetBroadcast => 11,
        NetAdmin => 12,
        NetRaw => 13,
        IpcLock => 14,
        IpcOwner => 15,
        SysModule => 16,
        SysRawio => 17,
        SysChroot => 18,
        SysPtrace => 19,
        SysPacct => 20,
        SysAdmin => 21,
        SysBoot => 22,
        SysNice => 23,
        SysResource => 24,
        SysTime => 25,
        SysTtyConfig => 26,
        Mknod => 27,
        Lease => 28,
        AuditWrite => 29,
        AuditControl => 30,
        Setfcap => 31,
        MacOverride => 32,
        MacAdmin => 33,
        Syslog => 34,
        WakeAlarm => 35,
        BlockSuspend => 36,
        AuditRead => 37,
        Perfmon => 38,
        Bpf => 39,
        CheckpointRestore => 40,
    }
}

/// A set of capabilities as the kernel's 64-bit mask.
pub fn mask(set: &Option<Capabilities>) -> u64 {
    set.iter().flatten().fold(0, |m, c| m | 1u64 << number(*c))
}

/// The five sets as bit masks, computed before the clone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CapsPlan {
    pub bounding: u64,
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
    pub ambient: u64,
}

impl CapsPlan {
    pub fn new(c: &LinuxCapabilities) -> Self {
        CapsPlan {
            bounding: mask(c.bounding()),
            effective: mask(c.effective()),
            permitted: mask(c.permitted()),
            inheritable: mask(c.inheritable()),
            ambient: mask(c.ambient()),
        }
    }

    /// Drops everything outside the bounding set. Needs CAP_SETPCAP: call while privileged.
    pub fn drop_bounding(&self) -> Result<(), CapsError> {
        for cap in 0..64u32 {
            if self.bounding & (1 << cap) != 0 {
                continue;
            }
            // SAFETY: prctl with integer arguments.
            let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
            if rc != 0 {
                let errno = Errno::last();
                // EINVAL: past the kernel's last capability; we are done.
                if errno.0 == libc::EINVAL {
                    break;
                }
                return Err(CapsError::Bounding { cap, errno });
            }
        }
        Ok(())
    }

    /// Keeps the permitted set across the coming uid change.
    pub fn keep_across_setuid() -> Result<(), CapsError> {
        // SAFETY: prctl with integer arguments.
        check(unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) })
            .map(drop)
            .map_err(CapsError::KeepCaps)
    }

    /// Sets effective/permitted/inheritable exactly, then raises the ambient ones.
    pub fn apply(&self) -> Result<(), CapsError> {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: libc::c_int,
        }
        #[repr(C)]
        #[derive(Clone, Copy)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const VERSION_3: u32 = 0x2008_0522;
        let mut header = Header {
            version: VERSION_3,
            pid: 0,
        };
        let split = |m: u64| (m as u32, (m >> 32) as u32);
        let (e0, e1) = split(self.effective);
        let (p0, p1) = split(self.permitted);
        let (i0, i1) = split(self.inheritable);
        let data = [
            Data {
                effective: e0,
                permitted: p0,
                inheritable: i0,
            },
            Data {
                effective: e1,
                permitted: p1,
                inheritable: i1,
            },
        ];
        // SAFETY: capset reads a v3 header and two data structs.
        let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) };
        check_long(rc).map_err(CapsError::Capset)?;
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) };
        for cap in 0..64u32 {
            if self.ambient & (1 << cap) == 0 {
                continue;
            }
            // SAFETY: prctl with integer arguments.
            let rc = unsafe {
                libc::prctl(
                    libc::PR_CAP_AMBIENT,
                    libc::PR_CAP_AMBIENT_RAISE,
                    cap as libc::c_ulong,
                    0,
                    0,
                )
            };
            if rc != 0 {
                return Err(CapsError::Ambient {
                    cap,
                    errno: Errno::last(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_from_spec() {
        let c: LinuxCapabilities = serde_json::from_value(serde_json::json!({
            "bounding": ["CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_AUDIT_WRITE"],
            "effective": ["CAP_KILL"],
            "ambient": []
        }))
        .unwrap();
        let p = CapsPlan::new(&c);
        assert_eq!(p.bounding, 0x2000_0420);
        assert_eq!(p.effective, 1 << 5);
        assert_eq!(p.permitted, 0);
        assert_eq!(p.ambient, 0);
        assert_eq!(number(Capability::CheckpointRestore), 40);
        assert_eq!(number(Capability::SysAdmin), 21);
    }
}
