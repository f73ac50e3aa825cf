//! Each sandbox's own host uid and gid range.
//!
//! Root inside a sandbox is an unprivileged host uid; if every sandbox mapped to the same
//! range, a process that escaped one sandbox's namespaces would be, to the host's kernel, the
//! owner of every other sandbox's processes and files: it could signal and trace them and read
//! their roots through `/proc/PID/root`. So each running sandbox gets a range of its own,
//! [`RUN_ID_BASE`] + slot × [`ID_RANGE`], a slot no other live sandbox on the node holds.
//!
//! Files stay in one *storage* range on disk ([`HOST_ID_BASE`]: template layers, writable
//! layers, snapshots), which no sandbox runs as. The node mounts every layer of a sandbox's
//! root through an idmapped mount that shows storage ids as the sandbox's run ids, so inside,
//! root owns `/` and `user` owns `/home/user` as before, what the sandbox writes lands on disk
//! in the storage range, and a snapshot taken on one node restores under whatever range the
//! next node gives it. An idmapped mount takes a user namespace holding the mapping: one per
//! slot, made once (a short-lived child's namespace, kept open by a descriptor) and reused.
//!
//! A host that cannot idmap (a kernel before 5.19, or a state directory on a file system
//! without idmapping) runs every sandbox in the storage range itself, as before, and says so
//! in the node's `degraded` list: isolation between sandboxes then rests on their namespaces
//! alone.
//!
//! No slot is handed out whose range overlaps ids the host delegates to one of its users
//! (`/etc/subuid`, `/etc/subgid`: Debian gives each new user 65,536 from 100,000 up): with
//! `newuidmap` that user could map a namespace onto those ids and be, to the kernel, the
//! owner of that sandbox's processes and files. The storage range cannot move (it is what
//! every layer on disk is owned as), so a host that delegates it says so as a degraded
//! feature.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Mutex;

use super::spec::{HOST_ID_BASE, ID_RANGE};

/// The host id of root in the sandbox of slot 0; slot N's is `RUN_ID_BASE + N * ID_RANGE`.
/// Far above the storage range, the host's own accounts and the subordinate ranges
/// `/etc/subuid` usually hands out from 100000.
pub const RUN_ID_BASE: u32 = 1 << 24;
/// Slots that fit between [`RUN_ID_BASE`] and the top of the 32-bit id space (whose last id
/// is reserved as "no id").
const SLOTS: u32 = (u32::MAX - RUN_ID_BASE) / ID_RANGE;

/// Errors of giving a sandbox its ids.
#[derive(Debug, thiserror::Error)]
pub enum IdError {
    #[error("every one of the node's {SLOTS} id ranges is in use")]
    Exhausted,
    #[error("a user namespace for the ids from {host}: {source}")]
    Namespace { host: u32, source: io::Error },
}

/// Which host ids a sandbox's root runs as, and the namespace that idmaps its layers to them
/// (`None`: the storage range itself, nothing to map).
pub struct Ids {
    pub host_base: u32,
    pub userns: Option<OwnedFd>,
}

/// The node's slots: which sandbox holds which, and each slot's user namespace once made.
pub struct IdRanges {
    /// Why sandboxes share the storage range, if they do.
    shared: Option<String>,
    /// Why a host user may own the storage range, if one may.
    storage: Option<String>,
    inner: Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    held: HashMap<String, u32>,
    namespaces: HashMap<u32, OwnedFd>,
    /// Host id ranges (start, count) delegated to the host's users: no slot overlapping one
    /// is handed out.
    delegated: Vec<(u64, u64)>,
}

impl Slots {
    fn lowest_free(&self) -> Option<u32> {
        self.free().next()
    }

    /// The slots no sandbox holds and no host user is delegated, lowest first.
    fn free(&self) -> impl Iterator<Item = u32> + '_ {
        let mut taken: Vec<u32> = self.held.values().copied().collect();
        taken.sort_unstable();
        taken.dedup();
        let mut taken = taken.into_iter().peekable();
        (0..SLOTS).filter(move |slot| {
            while taken.next_if(|t| t < slot).is_some() {}
            taken.peek() != Some(slot) && overlapping(&self.delegated, host_base(*slot)).is_none()
        })
    }
}

/// The first of `delegated` that overlaps the range of ids from `base` ([`ID_RANGE`] long).
fn overlapping(delegated: &[(u64, u64)], base: u32) -> Option<(u64, u64)> {
    let (start, end) = (u64::from(base), u64::from(base) + u64::from(ID_RANGE));
    delegated
        .iter()
        .copied()
        .find(|&(from, count)| from < end && start < from.saturating_add(count))
}

/// The id ranges an `/etc/subuid` or `/etc/subgid` text delegates (`user:start:count` lines;
/// anything else is skipped).
pub fn delegated_ranges(text: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.trim().split(':');
            let (_, start, count) = (fields.next()?, fields.next()?, fields.next()?);
            Some((start.parse().ok()?, count.parse().ok()?))
        })
        .filter(|&(_, count)| count > 0)
        .collect()
}

/// What this host delegates to its users, uids and gids alike.
fn host_delegated() -> Vec<(u64, u64)> {
    ["/etc/subuid", "/etc/subgid"]
        .iter()
        .flat_map(|path| delegated_ranges(&std::fs::read_to_string(path).unwrap_or_default()))
        .collect()
}

/// The host id of root in slot `slot`.
pub(super) fn host_base(slot: u32) -> u32 {
    RUN_ID_BASE + slot * ID_RANGE
}

impl IdRanges {
    /// Ranges for a node, given what probing its file system for idmapped layers found
    /// (`rootfs::probe_idmapped_overlay`): slot 0's mapping namespace, or why sandboxes must
    /// share the storage range.
    pub fn new(probed: io::Result<OwnedFd>) -> Self {
        Self::with_delegated(probed, host_delegated())
    }

    /// [`IdRanges::new`] on a host that delegates `delegated` id ranges to its users.
    pub fn with_delegated(probed: io::Result<OwnedFd>, delegated: Vec<(u64, u64)>) -> Self {
        let shares = probed.is_err();
        let storage = overlapping(&delegated, HOST_ID_BASE).map(|(from, count)| {
            // Without idmapping, sandboxes also run as the storage range.
            let owns = if shares {
                "every sandbox's processes and files"
            } else {
                "sandboxes' files on disk"
            };
            format!(
                "a host user may own {owns}: the ids sandboxes use there ({HOST_ID_BASE}-{}) overlap ids the host delegates ({from}-{}, /etc/subuid or /etc/subgid; a node in a container sees only its own): give that user another range",
                u64::from(HOST_ID_BASE) + u64::from(ID_RANGE) - 1,
                from + count - 1
            )
        });
        let mut slots = Slots {
            delegated,
            ..Slots::default()
        };
        let shared = match probed {
            // The probe's namespace is slot 0's: the first sandbox needs no other.
            Ok(userns) => {
                slots.namespaces.insert(0, userns);
                None
            }
            Err(e) => Some(format!(
                "every sandbox runs as the same host ids ({HOST_ID_BASE}-), and shares the kernel's per-user counts (inotify instances, queued signals) with the others: layers cannot be idmapped here: {e}"
            )),
        };
        Self {
            shared,
            storage,
            inner: Mutex::new(slots),
        }
    }

    /// Why sandboxes share one range, if they do.
    pub fn shared(&self) -> Option<&str> {
        self.shared.as_deref()
    }

    /// Why a host user may own the storage range, if one may.
    pub fn storage_delegated(&self) -> Option<&str> {
        self.storage.as_deref()
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The ids for sandbox `id`: the slot it holds already (a start over its own dead copy),
    /// else, for a sandbox that reaches out (`linked`), the first free one whose range is
    /// among `ready` (host ids of root: ranges with a network slot ready for them), else the
    /// lowest free one not among `ready` (left for sandboxes that need them), else any.
    pub fn claim(&self, id: &str, ready: &[u32], linked: bool) -> Result<Ids, IdError> {
        if self.shared.is_some() {
            return Ok(Ids {
                host_base: HOST_ID_BASE,
                userns: None,
            });
        }
        let mut slots = self.slots();
        // A slot two sandboxes claim (one adopted through a PID the kernel had given to
        // another's init) is kept by neither on a new start.
        let slot = match slots.held.get(id) {
            Some(slot) if slots.held.values().filter(|s| *s == slot).count() == 1 => *slot,
            _ => {
                let ready: Vec<u32> = ready.iter().filter_map(|host| slot_of_host(*host)).collect();
                let free_ready = ready.iter().copied().find(|slot| {
                    !slots.held.values().any(|h| h == slot) && overlapping(&slots.delegated, host_base(*slot)).is_none()
                });
                linked
                    .then_some(free_ready)
                    .flatten()
                    .or_else(|| slots.free().take(ready.len() + 1).find(|slot| !ready.contains(slot)))
                    .or_else(|| slots.lowest_free())
                    .ok_or(IdError::Exhausted)?
            }
        };
        let host = host_base(slot);
        let userns = match slots.namespaces.get(&slot) {
            Some(fd) => fd.try_clone(),
            None => mapping_namespace(host).and_then(|fd| {
                let copy = fd.try_clone();
                slots.namespaces.insert(slot, fd);
                copy
            }),
        }
        .map_err(|source| IdError::Namespace { host, source })?;
        slots.held.insert(id.to_string(), slot);
        Ok(Ids {
            host_base: host,
            userns: Some(userns),
        })
    }

    /// The host ids of root in the `count` ranges the next sandboxes will be given, lowest
    /// first (all the storage range on a host that shares it): what a pool of namespaces
    /// made ahead of need should be made for.
    pub fn next_free(&self, count: usize) -> Vec<u32> {
        if self.shared.is_some() {
            return vec![HOST_ID_BASE; count];
        }
        self.slots().free().take(count).map(host_base).collect()
    }

    /// Gives back `id`'s slot (its sandbox's processes are gone).
    pub fn release(&self, id: &str) {
        self.slots().held.remove(id);
    }

    /// Takes note of the slot a running sandbox found after a restart holds: the range its
    /// init's user namespace maps root to (`/proc/PID/uid_map`).
    pub fn adopt(&self, id: &str, pid: u32) {
        if self.shared.is_some() || pid == 0 {
            return;
        }
        let Ok(map) = std::fs::read_to_string(format!("/proc/{pid}/uid_map")) else {
            return;
        };
        if let Some(slot) = slot_of_map(&map) {
            self.slots().held.insert(id.to_string(), slot);
        }
    }
}

/// The slot whose range a `uid_map` maps root to, if it is one of the slots.
fn slot_of_map(map: &str) -> Option<u32> {
    let line = map.lines().find(|l| l.split_whitespace().next() == Some("0"))?;
    slot_of_host(line.split_whitespace().nth(1)?.parse().ok()?)
}

/// The slot whose range starts at host id `host`, if it is one of the slots.
fn slot_of_host(host: u32) -> Option<u32> {
    let offset = host.checked_sub(RUN_ID_BASE)?;
    (offset % ID_RANGE == 0 && offset / ID_RANGE < SLOTS).then_some(offset / ID_RANGE)
}

/// The `uid_map` (and `gid_map`) text of a sandbox's own user namespace when root inside is
/// host id `host`: its whole range, nothing else.
pub fn sandbox_map_text(host: u32) -> String {
    format!("0 {host} {ID_RANGE}\n")
}

/// The `uid_map` (and `gid_map`) text of the namespace that idmaps layers for the range at
/// `host`: storage ids become the sandbox's ids, and the host's root stays itself, because
/// overlayfs makes its work directory and whiteouts as the root that mounted it.
fn mapping_text(host: u32) -> String {
    format!("0 0 1\n{HOST_ID_BASE} {host} {ID_RANGE}\n")
}

/// A user namespace whose maps are [`mapping_text`]`(host)`, held by a descriptor. No
/// process ever runs in it (it only idmaps layers), so the node owns it.
pub(super) fn mapping_namespace(host: u32) -> io::Result<OwnedFd> {
    hold_namespaces(&mapping_text(host), false, None).map(|(user, _)| user)
}

/// A new user namespace whose uid and gid maps are `maps` and, with `network`, a network
/// namespace it owns, held by descriptors: made by a child cloned into them, which waits only
/// until its maps are written and its namespaces opened. (Cloned with both flags at once, the
/// kernel makes the user namespace first and gives it the network one.)
///
/// With `owner`, the user namespace is that host uid's (root inside's host id), not the
/// node's: the kernel charges what a sandbox's users hold (inotify instances, queued signals,
/// message queues) to the namespace's owner at the host's level, so each sandbox's counts are
/// its own there rather than the host root's, shared with every sandbox (see the jail's
/// `namespaces` module). The clone then runs on a thread of its own, as
/// [`jail::namespaces::AsOwner`]: a thread's credentials are its own, and the process's
/// dumpable flag, which any change of them clears, is set back.
///
/// The child shares the node's memory (`CLONE_VM`) and runs on a small stack of its own. A
/// fork-like clone would copy the page tables of the whole node, a large threaded process,
/// and then pay copy-on-write faults and TLB shootdowns on every CPU: 3 ms or more a slot,
/// most of a sandbox's create wherever it needed a fresh slot.
pub(super) fn hold_namespaces(maps: &str, network: bool, owner: Option<u32>) -> io::Result<(OwnedFd, Option<OwnedFd>)> {
    let mut stack = vec![0u8; HOLDER_STACK];
    // The stack grows down from its end, 16-byte aligned as the ABI wants.
    let top = (stack.as_mut_ptr() as usize + stack.len()) & !15;
    let flags = libc::CLONE_NEWUSER | libc::CLONE_VM | libc::SIGCHLD | if network { libc::CLONE_NEWNET } else { 0 };
    let (pid, cloned) = match owner.filter(|_| rustix::process::geteuid().is_root()) {
        None => clone_holder(top, flags),
        Some(uid) => std::thread::scope(|scope| {
            let cloned = std::thread::Builder::new()
                .name("userns-owner".into())
                .spawn_scoped(scope, move || {
                    let as_owner = jail::namespaces::AsOwner::become_owner(uid)
                        .map_err(|e| io::Error::other(format!("taking uid {uid} to own the namespace: {e}")))?;
                    let cloned = clone_holder(top, flags);
                    // Whatever comes of this, the child is the caller's to kill and reap (it
                    // runs on the caller's stack); this thread ends with its credentials.
                    if let Err(e) = as_owner.restore() {
                        tracing::warn!(uid, "giving a namespace owner's uid back: {e}");
                    }
                    Ok(cloned)
                })?;
            cloned
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the thread cloning a user namespace panicked")))
        })?,
    };
    if pid < 0 {
        return Err(io::Error::other(format!("cloning a user namespace: {cloned}")));
    }
    let opened = (|| {
        std::fs::write(format!("/proc/{pid}/uid_map"), maps)?;
        std::fs::write(format!("/proc/{pid}/gid_map"), maps)?;
        let user = std::fs::File::open(format!("/proc/{pid}/ns/user")).map(OwnedFd::from)?;
        let net = if network {
            Some(std::fs::File::open(format!("/proc/{pid}/ns/net")).map(OwnedFd::from)?)
        } else {
            None
        };
        Ok((user, net))
    })();
    // SAFETY: signalling our own child; reaping it.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    jail::sys::reap(pid);
    drop(stack);
    opened
}

/// The host uid that owns the user namespace `userns` (`NS_GET_OWNER_UID`).
pub fn owner(userns: &OwnedFd) -> io::Result<u32> {
    use std::os::fd::AsRawFd as _;
    // `_IO(0xb7, 0x4)` in linux/nsfs.h.
    const NS_GET_OWNER_UID: libc::c_ulong = 0xb704;
    let mut uid: libc::uid_t = 0;
    // SAFETY: the ioctl writes one uid_t through the pointer, which points at one.
    let rc = unsafe { libc::ioctl(userns.as_raw_fd(), NS_GET_OWNER_UID, &mut uid) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(uid)
}

/// Clones [`hold`] onto the stack ending at `top` with `flags`, every signal blocked for it:
/// its PID (or -1) and the error of the call.
fn clone_holder(top: usize, flags: libc::c_int) -> (libc::pid_t, io::Error) {
    // SAFETY: the signal sets are plain values on this stack. `hold` runs on the stack at
    // `top`, which outlives the child (it is reaped before that stack is dropped), and touches
    // no memory besides it. The child starts with every signal blocked, so no handler of the
    // node's ever runs on its shared memory, and pause never returns to write errno.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut before: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut before);
        let pid = libc::clone(hold, top as *mut libc::c_void, flags, std::ptr::null_mut());
        let cloned = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut());
        (pid, cloned)
    }
}

/// The stack of [`mapping_namespace`]'s child: it only calls `pause`.
const HOLDER_STACK: usize = 64 * 1024;

/// [`mapping_namespace`]'s child: waits to be killed (its signals are blocked, so nothing
/// else ends the wait). It shares the node's memory, so it makes the system call and nothing
/// else.
extern "C" fn hold(_: *mut libc::c_void) -> libc::c_int {
    loop {
        // SAFETY: pause takes no arguments and touches no memory.
        unsafe { libc::syscall(libc::SYS_pause) };
    }
}

/// A detached copy of the mount at `path`, rooted there, showing its files' ids through the
/// user namespace `userns` (storage ids as the sandbox's). Overlayfs takes it as a layer by
/// its `/proc/self/fd/N` path.
pub fn idmapped(path: &Path, userns: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    use rustix::mount::OpenTreeFlags;
    let tree = rustix::mount::open_tree(
        rustix::fs::CWD,
        path,
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )
    .map_err(|e| io::Error::other(format!("cloning the mount at {}: {e}", path.display())))?;
    // mount_setattr is the one call here rustix does not offer.
    let attr = libc::mount_attr {
        attr_set: libc::MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: an empty path with AT_EMPTY_PATH names the descriptor; `attr` outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc != 0 {
        return Err(io::Error::other(format!(
            "idmapping the mount of {}: {}",
            path.display(),
            io::Error::last_os_error()
        )));
    }
    Ok(tree)
}

/// The path by which overlayfs reaches a detached mount, `/proc/self/fd/N` (the jail's
/// allocation-free one, as text).
pub fn fd_path(fd: &impl AsFd) -> String {
    jail::sys::fd_path(fd.as_fd().as_raw_fd()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host user given subordinate ids (Debian's first user: 100,000 up, 65,536 of them)
    /// could map a namespace onto them with `newuidmap`: no sandbox runs in a range that
    /// overlaps one, and a host that delegates the storage range says so.
    #[test]
    fn no_sandbox_runs_as_ids_a_host_user_is_delegated() {
        let subuid = "alice:100000:65536\n# a comment\nbob:16777216:131072\nbroken line\nnone:0:0\n";
        let delegated = delegated_ranges(subuid);
        assert_eq!(delegated, vec![(100_000, 65_536), (16_777_216, 131_072)]);
        // Slots 0 and 1 (bob's ids) are skipped; 2 is the first handed out.
        let ids = IdRanges::with_delegated(Err(io::Error::other("no probe")), delegated.clone());
        assert!(ids.storage_delegated().is_some_and(|why| why.contains("100000-165535")));
        assert!(ids
            .storage_delegated()
            .is_some_and(|why| why.contains("every sandbox's processes")));
        let slots = Slots {
            delegated: delegated.clone(),
            ..Slots::default()
        };
        let free: Vec<u32> = slots.free().take(3).collect();
        assert_eq!(free, vec![2, 3, 4]);
        // A network slot ready in a delegated range is not taken either.
        let ids = IdRanges {
            shared: None,
            storage: None,
            inner: Mutex::new(Slots {
                delegated,
                ..Slots::default()
            }),
        };
        let claimed = ids.claim("linked", &[host_base(1), host_base(5)], true).unwrap();
        assert_eq!(claimed.host_base, host_base(5));
        // Touching at the edges is not overlapping.
        assert_eq!(overlapping(&[(host_base(1) as u64 - 10, 10)], host_base(1)), None);
        assert!(overlapping(&[(host_base(1) as u64 + ID_RANGE as u64 - 1, 1)], host_base(1)).is_some());
        let clean = IdRanges::with_delegated(Err(io::Error::other("no probe")), vec![(1_000_000_000, 65_536)]);
        assert_eq!(clean.storage_delegated(), None);
    }

    fn ranges() -> IdRanges {
        IdRanges {
            shared: None,
            storage: None,
            inner: Mutex::default(),
        }
    }

    #[test]
    fn slots_are_the_lowest_free_and_a_sandbox_keeps_its_own() {
        let mut slots = Slots::default();
        assert_eq!(slots.lowest_free(), Some(0));
        slots.held.insert("a".into(), 0);
        slots.held.insert("c".into(), 2);
        assert_eq!(slots.lowest_free(), Some(1));
        slots.held.insert("b".into(), 1);
        assert_eq!(slots.lowest_free(), Some(3));
        slots.held.remove("a");
        assert_eq!(slots.lowest_free(), Some(0));
    }

    #[test]
    fn every_slot_is_a_whole_range_above_storage_within_32_bits() {
        assert!(host_base(0) > HOST_ID_BASE + ID_RANGE);
        let last = u64::from(host_base(SLOTS - 1)) + u64::from(ID_RANGE);
        assert!(last <= u64::from(u32::MAX), "{last}");
    }

    #[test]
    fn the_mapping_keeps_hosts_root_and_shows_storage_as_the_sandboxs_ids() {
        assert_eq!(mapping_text(1 << 24), "0 0 1\n100000 16777216 65536\n");
    }

    #[test]
    fn a_running_sandboxs_slot_is_read_off_its_uid_map() {
        let map = format!("         0   {}      65536\n", host_base(7));
        assert_eq!(slot_of_map(&map), Some(7));
        assert_eq!(slot_of_map("0 100000 65536\n"), None, "the storage range is no slot");
        assert_eq!(slot_of_map(&format!("0 {} 65536\n", host_base(1) + 5)), None);
        assert_eq!(slot_of_map("garbage"), None);
    }

    #[test]
    fn a_shared_host_hands_out_the_storage_range_and_holds_nothing() {
        let r = IdRanges {
            shared: Some("no idmapping".into()),
            storage: None,
            inner: Mutex::default(),
        };
        let ids = r.claim("a", &[], false).unwrap();
        assert_eq!(ids.host_base, HOST_ID_BASE);
        assert_eq!(r.next_free(2), vec![HOST_ID_BASE; 2]);
        assert!(ids.userns.is_none());
        assert!(r.slots().held.is_empty());
    }

    #[test]
    fn sandboxes_get_ranges_of_their_own_and_a_released_one_is_reused() {
        let r = ranges();
        let a = r.claim("a", &[], false).expect("a user namespace (run as root)");
        let b = r.claim("b", &[], true).unwrap();
        assert_eq!((a.host_base, b.host_base), (host_base(0), host_base(1)));
        assert_eq!(r.next_free(2), vec![host_base(2), host_base(3)]);
        assert_eq!(
            r.claim("a", &[host_base(5)], true).unwrap().host_base,
            a.host_base,
            "a start over its own dead copy"
        );
        r.release("a");
        assert_eq!(r.next_free(2), vec![host_base(0), host_base(2)]);
        assert_eq!(r.claim("c", &[], false).unwrap().host_base, host_base(0));
        // "d" adopted with "c"'s slot (its init's PID reused): its next start gets one alone.
        r.slots().held.insert("d".into(), 0);
        assert_eq!(r.claim("d", &[], false).unwrap().host_base, host_base(2));
        // A ready range is taken by a linked sandbox when free (skipped when held or not a
        // range at all), and left alone by one that is not linked.
        let ready = [host_base(1), 7, host_base(6), host_base(3)];
        assert_eq!(r.claim("e", &ready, true).unwrap().host_base, host_base(6));
        assert_eq!(r.claim("f", &ready, false).unwrap().host_base, host_base(4));
        // The slot's namespace maps as it says.
        let ns = a.userns.expect("a namespace");
        let fd = format!("/proc/self/fd/{}", ns.as_raw_fd());
        assert!(std::fs::read_link(fd).unwrap().to_string_lossy().starts_with("user:["));
    }

    /// A sandbox's namespace is its range's root's, so the kernel's per-user counts land on
    /// that id at the host's level; the layers' mapping namespace (no process runs in it)
    /// stays the node's. Needs root, as every container test.
    #[test]
    fn a_sandboxs_user_namespace_is_owned_by_its_root_and_a_mapping_one_by_the_node() {
        let host = host_base(5);
        let (user, net) = hold_namespaces(&sandbox_map_text(host), true, Some(host)).unwrap();
        assert_eq!(owner(&user).unwrap(), host);
        assert!(net.is_some());
        let mapping = mapping_namespace(host).unwrap();
        assert_eq!(owner(&mapping).unwrap(), rustix::process::geteuid().as_raw());
        // The thread that made the first is gone; this one is still the node's, and the
        // process is as dumpable as before (a change of credentials clears the flag).
        assert!(rustix::process::geteuid().is_root());
        // SAFETY: a prctl read.
        assert_eq!(unsafe { libc::prctl(libc::PR_GET_DUMPABLE) }, 1);
    }
}
