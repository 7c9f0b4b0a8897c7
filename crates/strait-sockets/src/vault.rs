//! Where a connection's memfd is kept while its rings are mapped: the mapping
//! itself needs no descriptor, but `exec` (the new program maps the rings again),
//! descriptor passing and the path-B hello must be able to hand the memfd on.
//!
//! Kept in the **fixed-file table of one io_uring instance per process**
//! ([`Kept::Slot`]): one library descriptor for every connection of the process, not
//! one per connection. `IORING_REGISTER_FILES_UPDATE` puts a memfd in a slot (one
//! system call, the memfd then closed), `IORING_OP_FIXED_FD_INSTALL` (Linux 6.8)
//! gives a close-on-exec copy back, and `IORING_OP_MSG_RING` with
//! `IORING_MSG_SEND_FD` (6.0) copies slots into another ring without a descriptor
//! in between.
//!
//! **A slot is never emptied in a ring another process may share.** A process
//! made by a raw `clone` (no fork handlers) shares the ring and may need a slot of a
//! connection its parent has just closed (a privilege-separated server's middle
//! process closes its copies and exits while the grandchild has yet to `exec` with
//! the connection), and the parent cannot know the child exists. So closing a
//! connection only marks its slot dead here; once dead slots outnumber
//! `max(`[`DEAD_BEFORE_ROTATION`]`, live)`, the process **rotates**: it copies its
//! live slots into a fresh ring and closes its descriptor of the old one, which
//! dies with its dead memfds unless another process still holds it (and then holds
//! what it needs). The cost is amortised O(1) per close, and a fresh ring also
//! grows the table. A process made by `fork` gets a ring of its own, filled before
//! the fork (no other process can touch it); one made by a raw `clone` copies its
//! slots out of the shared ring at its first library call. Submissions to a ring
//! that two processes may share go under a lock in a page they share.
//!
//! Where io_uring is refused (a seccomp filter such as Docker's default profile,
//! `kernel.io_uring_disabled`, a kernel before 6.8) or `STRAIT_VAULT=socket` asks
//! for it, a connection keeps its memfd in flight in a socketpair of its own
//! ([`Kept::Socket`], one descriptor per connection).

use std::cell::RefCell;
use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use io_uring::{opcode, types, IoUring};
use libc::c_int;

use crate::real;

/// Where one connection's memfd is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Nowhere (a connection made without a memfd, or keeping failed).
    Nothing,
    /// A slot of this process's vault ring.
    Slot(u32),
    /// In flight in a socketpair of the connection's own (the fallback); the end
    /// that holds it.
    Socket(c_int),
}

impl Kept {
    /// Whether a memfd is kept at all.
    pub fn is_some(&self) -> bool {
        !matches!(self, Kept::Nothing)
    }
}

/// Dead slots a ring keeps before the process rotates (also when few connections
/// live): bounds the closed connections' memory a ring pins to this many memfds.
pub(crate) const DEAD_BEFORE_ROTATION: usize = 8;
/// The smallest fixed-file table a ring gets.
const MIN_SLOTS: u32 = 64;
/// Submission queue entries: the batch size of a copy.
const ENTRIES: u32 = 64;
/// How long a submission waits for its completions, and how long a holder of the
/// shared lock may keep it before a waiter takes it (a holder that died).
const OP_BOUND: Duration = Duration::from_secs(1);
/// `IORING_MSG_RING_CQE_SKIP`: post nothing on the target ring.
const MSG_RING_CQE_SKIP: u32 = 1;

/// Keeps `memfd` (the caller still owns and closes it).
pub(crate) fn keep(memfd: c_int) -> Kept {
    if memfd < 0 {
        return Kept::Nothing;
    }
    if let Some(slot) = lock().keep(memfd) {
        return Kept::Slot(slot);
    }
    match socket_keep(memfd) {
        -1 => Kept::Nothing,
        s => Kept::Socket(s),
    }
}

/// A close-on-exec copy of the memfd kept in `k`, owned by the caller; `None` if
/// there is none.
pub(crate) fn copy(k: Kept) -> Option<c_int> {
    match k {
        Kept::Nothing => None,
        Kept::Slot(slot) => lock().copy(slot),
        Kept::Socket(s) => socket_copy(s),
    }
}

/// The connection that kept `k` is gone from this process.
pub(crate) fn release(k: Kept) {
    match k {
        Kept::Nothing => {}
        Kept::Slot(slot) => lock().release(slot),
        Kept::Socket(s) => crate::fds::let_go(&[s]),
    }
}

/// What the vault holds, for tests and `--stats`: (live slots, dead slots, rings
/// this process made, teardowns still watched). Watches of ring teardowns that
/// have happened are let go first, so that the library's descriptors counted next
/// are the ones it needs; a watch left is a descriptor for a few milliseconds (a
/// ring's teardown runs on a kernel worker after its last close).
pub(crate) fn census() -> (usize, usize, u64, usize) {
    let mut v = lock();
    if !v.teardowns.watching.is_empty() {
        v.teardowns_pending();
    }
    (v.live_n, v.dead_n, RINGS_MADE.load(Ordering::Relaxed), v.teardowns.watching.len())
}

// ---- fork and clone ----------------------------------------------------------

thread_local! {
    static FORK_GUARD: RefCell<Option<MutexGuard<'static, Vault>>> = const { RefCell::new(None) };
}

/// Before `fork`, with the descriptor table locked (the lock order everywhere:
/// the table, then the vault): fills a ring for the child with this process's live
/// slots; the vault stays locked until [`after_fork`], so that no connection is
/// kept or let go in between and the child's copy of the lock is free.
pub(crate) fn before_fork() {
    let mut v = lock();
    v.for_child = None;
    if v.live_n > 0 {
        let slots = v.ring.as_ref().map_or(MIN_SLOTS, |r| r.slots);
        v.for_child = v.ring_with_live(slots);
    }
    FORK_GUARD.with(|g| *g.borrow_mut() = Some(v));
}

/// Forks (in the parent and the child) and raw clones (in the child) this process
/// has seen: a resource met before the last one may be shared with another process.
static FORKS: AtomicU32 = AtomicU32::new(0);

/// [`FORKS`] now.
pub(crate) fn forks() -> u32 {
    FORKS.load(Ordering::Relaxed)
}

/// After `fork`, in the parent (`child == false`) or the child, before the table
/// is unlocked.
pub(crate) fn after_fork(child: bool) {
    FORKS.fetch_add(1, Ordering::Relaxed);
    let Some(mut v) = FORK_GUARD.with(|g| g.borrow_mut().take()) else { return };
    if child {
        // (The rings below were the parent's: the child's id, not the cached one.)
        strait_sys::forget_pid();
        v.teardowns_of_parent();
    }
    // (In the parent the child's ring closes here.)
    let theirs = v.for_child.take();
    let theirs = match theirs {
        Some(r) if !child => {
            v.retire(r);
            None
        }
        t => t,
    };
    if child {
        match theirs {
            // The parent's ring is the parent's: the child closes its copy.
            Some(r) => v.switch_to(r),
            None if v.live_n == 0 => v.drop_ring(),
            // The copy failed: the child shares the parent's ring under the lock,
            // which neither ever empties.
            None => {}
        }
    }
}

/// A process made by a raw `clone` (no fork handlers ran), at its first library
/// call: copies its live slots out of the ring it shares with its parent into one
/// of its own.
pub(crate) fn after_raw_clone() {
    FORKS.fetch_add(1, Ordering::Relaxed);
    let mut v = lock();
    v.teardowns_of_parent();
    if v.live_n == 0 {
        v.drop_ring();
        return;
    }
    let slots = v.ring.as_ref().map_or(MIN_SLOTS, |r| r.slots);
    if let Some(fresh) = v.ring_with_live(slots) {
        v.switch_to(fresh);
    }
}

// ---- the vault ------------------------------------------------------------------

static VAULT: Mutex<Vault> = Mutex::new(Vault::new());

fn lock() -> MutexGuard<'static, Vault> {
    VAULT.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process's vault ring and which of its slots its connections use.
struct Vault {
    ring: Option<Ring>,
    /// Slots of connections this process holds.
    live: Vec<u64>,
    live_n: usize,
    /// Slots of the current ring whose connection is gone (they keep their memfd
    /// until the ring rotates).
    dead_n: usize,
    /// Filled by [`before_fork`] for the child.
    for_child: Option<Ring>,
    /// Rings closed whose teardown may still interrupt an `epoll_wait` here.
    teardowns: Teardowns,
    /// Keeps and releases to let pass before a fresh ring is tried again after
    /// one could not be made (or filled): a failure must not cost every later
    /// connection a ring and a copy of every live slot.
    retry_in: usize,
}

impl Vault {
    const fn new() -> Vault {
        Vault {
            ring: None,
            live: Vec::new(),
            live_n: 0,
            dead_n: 0,
            for_child: None,
            teardowns: Teardowns { deferred: Vec::new(), watching: Vec::new() },
            retry_in: 0,
        }
    }

    /// Whether a fresh ring may be tried now (see `retry_in`).
    fn may_try_ring(&mut self) -> bool {
        if self.retry_in == 0 {
            return true;
        }
        self.retry_in -= 1;
        false
    }

    /// A fresh ring could not be made or filled: wait as many keeps and releases
    /// as connections live (at least 8) before the next try.
    fn ring_failed(&mut self) {
        self.retry_in = self.live_n.max(DEAD_BEFORE_ROTATION);
    }

    fn keep(&mut self, memfd: c_int) -> Option<u32> {
        if !ring_vault_wanted() {
            return None;
        }
        let slot = match self.ring.as_mut().and_then(Ring::free_slot) {
            Some(s) => s,
            None => {
                // No ring yet, or a full one: a fresh ring with room to double.
                if !self.may_try_ring() {
                    return None;
                }
                let Some(fresh) = self.ring_with_live(doubled(self.live_n + 1)) else {
                    self.ring_failed();
                    return None;
                };
                self.switch_to(fresh);
                self.ring.as_mut()?.free_slot()?
            }
        };
        let ring = self.ring.as_mut()?;
        ring.put(slot, memfd).ok()?;
        set(&mut self.live, slot, true);
        self.live_n += 1;
        Some(slot)
    }

    fn copy(&mut self, slot: u32) -> Option<c_int> {
        let ring = self.ring.as_mut()?;
        let e = opcode::FixedFdInstall::new(types::Fixed(slot), 0).build();
        let res = ring.run(&[e]).pop()?;
        (res >= 0).then_some(res)
    }

    fn release(&mut self, slot: u32) {
        if !get(&self.live, slot) {
            return;
        }
        set(&mut self.live, slot, false);
        self.live_n -= 1;
        self.dead_n += 1;
        if self.dead_n < DEAD_BEFORE_ROTATION.max(self.live_n) {
            return;
        }
        if self.live_n == 0 {
            self.drop_ring();
            return;
        }
        // Rotate: the live slots into a fresh ring (room to double), the old one
        // closed here.
        if !self.may_try_ring() {
            return;
        }
        match self.ring_with_live(doubled(self.live_n)) {
            Some(fresh) => self.switch_to(fresh),
            None => self.ring_failed(),
        }
    }

    /// A fresh ring of `slots` holding every live slot of the current one (same
    /// numbers); `None` if it could not be made or a copy failed. The table is
    /// made larger than `slots` where a live connection holds a higher slot
    /// (connections keep their slot numbers, so a table sized for the live count
    /// alone could not take it, and every later rotation and keep would fail).
    fn ring_with_live(&mut self, slots: u32) -> Option<Ring> {
        let highest = ones(&self.live).last().map_or(0, |s| s + 1);
        let mut fresh = Ring::create(slots.max(highest.saturating_add(SENTINEL_SLOTS)))?;
        let copied = match self.ring.as_mut() {
            Some(from) => copy_slots(from, &mut fresh, &self.live),
            None => self.live_n == 0,
        };
        copied.then_some(fresh)
    }

    /// Makes `r` the ring (the old one is closed here).
    fn switch_to(&mut self, r: Ring) {
        if let Some(old) = self.ring.replace(r) {
            self.retire(old);
        }
        self.dead_n = 0;
        self.retry_in = 0;
    }

    fn drop_ring(&mut self) {
        if let Some(old) = self.ring.take() {
            self.retire(old);
        }
        self.dead_n = 0;
    }

    /// Closes our descriptor of `r`. If a thread of this process made or used it,
    /// the ring's teardown (whenever its last holder closes it) sends those threads
    /// task work, which makes a blocking `epoll_wait` fail with EINTR: the close
    /// waits while any thread sleeps in `epoll_wait` directly ([`DirectWait`]), and
    /// the teardown is watched until it has happened.
    fn retire(&mut self, r: Ring) {
        let me = strait_sys::current_pid();
        if r.made_by != me && r.used_by != me {
            // (A copy a fork or clone inherited: no thread here is the ring's.)
            return drop(r);
        }
        // Counted before the waiters are looked at, as `direct_wait` counts itself
        // before it looks at this (one of the two sees the other).
        PENDING.fetch_add(1, Ordering::SeqCst);
        if DIRECT_WAITERS.load(Ordering::SeqCst) > 0 {
            self.teardowns.deferred.push(r);
        } else {
            self.close_watched(r);
        }
    }

    /// Closes `r`, watching its teardown through a sentinel (counted in
    /// [`PENDING`] already).
    fn close_watched(&mut self, r: Ring) {
        // (Teardowns watched before that have happened go first: a process that
        // closes rings often, and seldom sleeps, watches few at a time.)
        if !self.teardowns.watching.is_empty() {
            self.teardowns_pending();
        }
        // (A process that forks with connections open makes each child's ring and
        // so watches its teardown until that child lets go of it: past a few, it
        // sleeps restartably for good rather than hold a descriptor per child.)
        let watchable = self.teardowns.watching.len() < MAX_WATCHED;
        match if watchable { r.sentinel() } else { None } {
            Some(rd) => self.teardowns.watching.push(rd),
            None => {
                // Not watchable: this process sleeps restartably from now on.
                UNWATCHED.store(true, Ordering::Relaxed);
                PENDING.fetch_sub(1, Ordering::SeqCst);
            }
        }
        drop(r);
    }

    /// Whether a teardown may still interrupt an `epoll_wait`: a ring waits to be
    /// closed, or a closed one's sentinel has not hung up. Drops those that have.
    fn teardowns_pending(&mut self) -> bool {
        if !self.teardowns.deferred.is_empty() {
            return true;
        }
        let w = &mut self.teardowns.watching;
        if w.is_empty() {
            return false;
        }
        let mut fds: Vec<libc::pollfd> =
            w.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
        // SAFETY: a vector of pollfds and its length; no waiting.
        if unsafe { real::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) } > 0 {
            let done: Vec<c_int> = fds.iter().filter(|f| f.revents != 0).map(|f| f.fd).collect();
            w.retain(|fd| !done.contains(fd));
            crate::fds::let_go(&done);
            PENDING.fetch_sub(done.len(), Ordering::SeqCst);
        }
        !w.is_empty()
    }

    /// Closes the rings that waited for the direct sleepers, if none is left.
    fn close_deferred(&mut self) {
        if DIRECT_WAITERS.load(Ordering::SeqCst) != 0 {
            return;
        }
        for r in std::mem::take(&mut self.teardowns.deferred) {
            self.close_watched(r);
        }
    }

    /// In a new process (fork or raw clone): its threads are in no ring's list
    /// (the kernel gives a new task none), so the parent's teardowns are not its;
    /// their copies are closed (a deferred ring too: the parent closes its own).
    fn teardowns_of_parent(&mut self) {
        crate::fds::let_go(&std::mem::take(&mut self.teardowns.watching));
        drop(std::mem::take(&mut self.teardowns.deferred));
        PENDING.store(0, Ordering::SeqCst);
        DIRECT_WAITERS.store(0, Ordering::SeqCst);
        UNWATCHED.store(false, Ordering::Relaxed);
    }
}

/// What [`Vault::retire`] left to happen: rings to close once no thread sleeps in
/// `epoll_wait` directly, and the read ends of closed rings' sentinels.
struct Teardowns {
    deferred: Vec<Ring>,
    /// (Kept library descriptors: see [`crate::fds::keep`].)
    watching: Vec<c_int>,
}

// ---- teardowns and epoll_wait ----------------------------------------------------
//
// A blocking `epoll_wait` fails with EINTR when a ring its thread made or used is
// torn down (the kernel's `io_ring_exit_work` sends each such thread task work, and
// `epoll_wait`, unlike `poll`, is not restarted after it). The epoll shims sleep in
// `epoll_wait` directly when no teardown can come (one system call a sleep, as
// without strait) and restartably otherwise (`epoll::kernel_wait`). A ring this
// process used is closed only while no thread sleeps directly, and its teardown is
// watched through a **sentinel**: the write end of a pipe put in a slot kept for it
// at the top of the ring's table, which the kernel closes when it frees the table,
// after every thread's task work has run; the pipe's read end then reads hang-up.

/// Slots at the top of every ring's table kept for sentinels: one per process that
/// closes the ring having used it (taken in turn through the ring's shared page).
const SENTINEL_SLOTS: u32 = 4;
/// Teardowns watched at once at most (each holds a descriptor).
const MAX_WATCHED: usize = 8;
/// Threads in a blocking `epoll_wait` made directly ([`DirectWait`]).
static DIRECT_WAITERS: AtomicU32 = AtomicU32::new(0);
/// Rings deferred plus sentinels watched (see [`Teardowns`]).
static PENDING: AtomicUsize = AtomicUsize::new(0);
/// A teardown could not be watched: every sleep is restartable from then on.
static UNWATCHED: AtomicBool = AtomicBool::new(false);

/// Leave to sleep in `epoll_wait` directly, held for the sleep; see
/// [`direct_wait`].
pub(crate) struct DirectWait {
    counted: bool,
}

impl DirectWait {
    /// Whether a ring's close may wait for this sleep to end (the sleep should then
    /// be cut into slices).
    pub(crate) fn holds_back_closes(&self) -> bool {
        self.counted
    }
}

impl Drop for DirectWait {
    fn drop(&mut self) {
        if self.counted
            && DIRECT_WAITERS.fetch_sub(1, Ordering::SeqCst) == 1
            && PENDING.load(Ordering::SeqCst) > 0
        {
            lock().close_deferred();
        }
    }
}

/// Whether this thread may sleep in `epoll_wait` directly now: no ring teardown
/// can interrupt it (none made, or every one closed has happened). `None`: sleep
/// restartably (`ppoll`), as a teardown may still come.
pub(crate) fn direct_wait() -> Option<DirectWait> {
    if !MADE_ANY.load(Ordering::Relaxed) {
        // (No thread of ours is in any ring's list: a ring made meanwhile by
        // another thread is not this one's.)
        return Some(DirectWait { counted: false });
    }
    if UNWATCHED.load(Ordering::Relaxed) {
        return None;
    }
    DIRECT_WAITERS.fetch_add(1, Ordering::SeqCst);
    let w = DirectWait { counted: true };
    if PENDING.load(Ordering::SeqCst) == 0 || !lock().teardowns_pending() {
        return Some(w);
    }
    drop(w);
    None
}

/// A table for `live` connections with room to double.
fn doubled(live: usize) -> u32 {
    u32::try_from((2 * live).max(MIN_SLOTS as usize)).unwrap_or(u32::MAX)
}

/// Copies the slots set in `live` from ring `from` into ring `to` (same numbers),
/// 64 per submission; whether every one arrived.
fn copy_slots(from: &mut Ring, to: &mut Ring, live: &[u64]) -> bool {
    let slots: Vec<u32> = ones(live).collect();
    if slots.iter().any(|&s| s >= to.usable()) {
        return false;
    }
    for chunk in slots.chunks(ENTRIES as usize) {
        let mut ops = Vec::with_capacity(chunk.len());
        for &s in chunk {
            let Ok(dest) = types::DestinationSlot::try_from_slot_target(s) else { return false };
            ops.push(
                opcode::MsgRingSendFd::new(types::Fd(to.fd), types::Fixed(s), dest, 0)
                    .opcode_flags(MSG_RING_CQE_SKIP)
                    .build(),
            );
        }
        let res = from.run(&ops);
        if res.len() != chunk.len() || res.iter().any(|&r| r < 0) {
            return false;
        }
        for &s in chunk {
            set(&mut to.occupied, s, true);
        }
    }
    true
}

/// One io_uring instance used only for its fixed-file table.
struct Ring {
    /// (Dropped by hand: see the `Drop`.)
    uring: ManuallyDrop<IoUring>,
    /// The ring's descriptor (the library's, above the program's numbers).
    fd: c_int,
    /// Size of its table.
    slots: u32,
    /// A page shared with every process this ring is inherited by: word 0 the
    /// submission lock, word 1 when it was taken (monotonic nanoseconds).
    shared: strait_sys::Mapping,
    /// Slots holding a memfd (a live connection's or a closed one's).
    occupied: Vec<u64>,
    /// The word of `occupied` the next free-slot search starts at.
    hint: usize,
    /// The process that made it (its making thread is in the ring's list).
    made_by: u32,
    /// The last process that submitted to it (its submitting threads are too).
    used_by: u32,
}

impl Ring {
    /// A ring with a sparse table of `slots` (clamped to what the kernel allows);
    /// `None` if it could not be made (and [`REFUSED`] set if it never will be).
    fn create(slots: u32) -> Option<Ring> {
        let slots = slots.clamp(MIN_SLOTS, table_limit());
        let tmp: IoUring = match IoUring::builder().build(ENTRIES) {
            Ok(u) => {
                MADE_ANY.store(true, Ordering::Relaxed);
                u
            }
            Err(e) => {
                // A seccomp filter or the sysctl (EPERM), no io_uring (ENOSYS): for
                // good. Anything else (EMFILE, ENOMEM) may pass.
                if matches!(e.raw_os_error(), Some(libc::EPERM | libc::ENOSYS | libc::EACCES)) {
                    REFUSED.store(true, Ordering::Relaxed);
                }
                return None;
            }
        };
        // The crate's ring owns the number the kernel gave, among the program's;
        // the library keeps a duplicate above them and maps the queues through it.
        let params = tmp.params().clone();
        let fd = crate::fds::dup_high(tmp.as_raw_fd());
        crate::fds::own_closes(|| drop(tmp));
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is a fresh duplicate of the ring just made with `params`; the
        // IoUring owns it from here (and closes it on drop, also on error).
        let uring = crate::fds::own_closes(|| unsafe { IoUring::from_fd(fd, params) }).ok()?;
        crate::fds::add_internal(&[fd]);
        let shared = strait_sys::Mapping::anonymous_shared(4096).ok()?;
        let me = strait_sys::current_pid();
        let mut r = Ring {
            uring: ManuallyDrop::new(uring),
            fd,
            slots,
            shared,
            occupied: Vec::new(),
            hint: 0,
            made_by: me,
            used_by: 0,
        };
        // (The sentinels' slots are never a connection's.)
        for s in slots - SENTINEL_SLOTS..slots {
            set(&mut r.occupied, s, true);
        }
        if !ops_supported(&r.uring) {
            REFUSED.store(true, Ordering::Relaxed);
            return None;
        }
        r.uring.submitter().register_files_sparse(slots).ok()?;
        RINGS_MADE.fetch_add(1, Ordering::Relaxed);
        Some(r)
    }

    /// A slot holding nothing, found from where the last search stopped (amortised
    /// O(1): the 10,000th connection finds its slot as fast as the first).
    fn free_slot(&mut self) -> Option<u32> {
        let words = (self.slots as usize).div_ceil(64);
        for k in 0..words {
            let w = (self.hint + k) % words;
            let word = self.occupied.get(w).copied().unwrap_or(0);
            if word != u64::MAX {
                let s = w as u32 * 64 + (!word).trailing_zeros();
                if s < self.usable() {
                    self.hint = w;
                    return Some(s);
                }
            }
        }
        None
    }

    /// Slots a connection's memfd may take (below the sentinels').
    fn usable(&self) -> u32 {
        self.slots - SENTINEL_SLOTS
    }

    /// Puts a sentinel of this ring's teardown in a slot kept for it: the read end
    /// of a pipe (a kept library descriptor) whose only write end is in the ring's
    /// table, so that it hangs up once the kernel has freed the ring. `None` if
    /// the slots are used up or a call failed.
    fn sentinel(&self) -> Option<c_int> {
        // SAFETY: the shared page is 4096 bytes, mapped for the ring's life; the u32
        // at byte 16 is only used as an atomic.
        let next = unsafe { &*self.shared.ptr().add(16).cast::<AtomicU32>() };
        let k = next.fetch_add(1, Ordering::Relaxed);
        if k >= SENTINEL_SLOTS {
            return None;
        }
        let mut p = [-1; 2];
        // SAFETY: a local array for the pipe's two descriptors.
        if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return None;
        }
        let put = self.uring.submitter().register_files_update(self.slots - 1 - k, &[p[1]]);
        // SAFETY: the write end just made (the ring holds its own reference).
        unsafe { real::close(p[1]) };
        if put.ok() != Some(1) {
            // SAFETY: the read end just made.
            unsafe { real::close(p[0]) };
            return None;
        }
        match crate::fds::keep(p[0]) {
            -1 => None,
            rd => Some(rd),
        }
    }

    fn put(&mut self, slot: u32, memfd: c_int) -> std::io::Result<()> {
        let n = self.uring.submitter().register_files_update(slot, &[memfd])?;
        if n != 1 {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        set(&mut self.occupied, slot, true);
        Ok(())
    }

    /// Submits `ops` (at most [`ENTRIES`]) under the shared lock and returns their
    /// results in order (fewer if some did not complete within [`OP_BOUND`]).
    fn run(&mut self, ops: &[io_uring::squeue::Entry]) -> Vec<i32> {
        self.used_by = strait_sys::current_pid();
        let _held = SharedLock::take(&self.shared);
        // Completions a holder that died left behind are not ours.
        self.uring.completion().for_each(drop);
        {
            let mut sq = self.uring.submission();
            for (i, op) in ops.iter().enumerate() {
                // SAFETY: the entries reference no memory of ours (fixed slots and
                // a ring descriptor only).
                if unsafe { sq.push(&op.clone().user_data(i as u64)) }.is_err() {
                    return Vec::new();
                }
            }
        }
        let mut out = vec![i32::MIN; ops.len()];
        let mut got = 0;
        let ts = types::Timespec::from(OP_BOUND);
        let args = types::SubmitArgs::new().timespec(&ts);
        for _ in 0..4 {
            match self.uring.submitter().submit_with_args(ops.len() - got, &args) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(_) => break,
            }
            for c in self.uring.completion() {
                if let Some(slot) = out.get_mut(c.user_data() as usize) {
                    if *slot == i32::MIN {
                        *slot = c.result();
                        got += 1;
                    }
                }
            }
            if got == ops.len() {
                break;
            }
        }
        if got < ops.len() {
            // (An operation that never completed within the bound counts as failed.)
            out.truncate(out.iter().position(|&r| r == i32::MIN).unwrap_or(out.len()));
        }
        out
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        crate::fds::remove_internal(&[self.fd]);
        // The IoUring closes the descriptor (through libc's `close`: see
        // `own_closes`) and unmaps the queues.
        // SAFETY: dropped once, here; the field is not used after.
        crate::fds::own_closes(|| unsafe { ManuallyDrop::drop(&mut self.uring) });
    }
}

/// The submission lock of a ring shared by processes of one family: a holder that
/// died (or stalls beyond [`OP_BOUND`]) loses it, so no wait is unbounded.
struct SharedLock<'a>(&'a AtomicU32);

impl<'a> SharedLock<'a> {
    fn take(page: &'a strait_sys::Mapping) -> SharedLock<'a> {
        // SAFETY: the page is 4096 bytes, mapped for the ring's life, aligned; words
        // 0 (u32) and 1 (u64 at byte 8) are only used as atomics.
        let (word, since) =
            unsafe { (&*page.ptr().cast::<AtomicU32>(), &*page.ptr().add(8).cast::<AtomicU64>()) };
        let mut spins = 0u32;
        loop {
            let now = monotonic_ns();
            if word.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                since.store(now, Ordering::Relaxed);
                return SharedLock(word);
            }
            let at = since.load(Ordering::Relaxed);
            if now.saturating_sub(at) > OP_BOUND.as_nanos() as u64
                && since.compare_exchange(at, now, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                // Its holder died holding it: ours now.
                return SharedLock(word);
            }
            spins += 1;
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl Drop for SharedLock<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The largest table the kernel allows now (the soft descriptor limit, at most 2^20).
fn table_limit() -> u32 {
    crate::fds::soft_nofile().clamp(MIN_SLOTS as u64, 1 << 20) as u32
}

/// Whether the kernel knows the two operations the vault needs (asked once).
fn ops_supported(u: &IoUring) -> bool {
    static KNOWN: OnceLock<bool> = OnceLock::new();
    *KNOWN.get_or_init(|| {
        let mut p = io_uring::Probe::new();
        u.submitter().register_probe(&mut p).is_ok()
            && p.is_supported(opcode::FixedFdInstall::CODE)
            && p.is_supported(opcode::MsgRingSendFd::CODE)
    })
}

/// Whether the ring vault is to be tried: not when `STRAIT_VAULT=socket` asks for
/// the socketpair per connection, nor once the kernel refused io_uring.
fn ring_vault_wanted() -> bool {
    static WANTED: OnceLock<bool> = OnceLock::new();
    *WANTED.get_or_init(|| crate::settings::Settings::get().vault_ring) && !REFUSED.load(Ordering::Relaxed)
}

/// The kernel refused io_uring or lacks an operation the vault needs: every
/// connection of this process keeps its memfd in a socketpair.
static REFUSED: AtomicBool = AtomicBool::new(false);

/// This process has made an io_uring instance (see [`direct_wait`]).
static MADE_ANY: AtomicBool = AtomicBool::new(false);

/// True once this process has made an io_uring instance.
#[cfg(test)]
pub(crate) fn made_any() -> bool {
    MADE_ANY.load(Ordering::Relaxed)
}
/// Rings this process made.
static RINGS_MADE: AtomicU64 = AtomicU64::new(0);

// ---- the fallback: a socketpair per connection --------------------------------

/// Puts `memfd` in flight in a new socketpair and returns the end that holds it
/// (close-on-exec, kept by the library; -1 on failure). The caller still owns
/// `memfd`.
fn socket_keep(memfd: c_int) -> c_int {
    let mut sp = [-1; 2];
    // SAFETY: socketpair writes two descriptors into `sp`.
    if unsafe {
        libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, sp.as_mut_ptr())
    } != 0
    {
        return -1;
    }
    let sent = crate::sock::send_fds(sp[1], b"memfd", &[memfd]);
    // SAFETY: our socket; the message stays queued at sp[0] after the sender closes.
    unsafe { real::close(sp[1]) };
    if !sent {
        // SAFETY: our socket.
        unsafe { real::close(sp[0]) };
        return -1;
    }
    crate::fds::keep(sp[0])
}

/// A copy of the memfd that socket `vault` holds, peeked (the socket keeps it).
fn socket_copy(vault: c_int) -> Option<c_int> {
    let mut buf = [0u8; 8];
    match crate::sock::recv_fds(vault, &mut buf, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
        Ok(m) if m.fds.len() == 1 => Some(m.fds[0]),
        Ok(m) => {
            crate::sock::close_all(&m.fds);
            None
        }
        Err(_) => None,
    }
}

// ---- bits ---------------------------------------------------------------------------

fn get(bits: &[u64], i: u32) -> bool {
    bits.get(i as usize / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
}

fn set(bits: &mut Vec<u64>, i: u32, on: bool) {
    let w = i as usize / 64;
    if bits.len() <= w {
        bits.resize(w + 1, 0);
    }
    if on {
        bits[w] |= 1 << (i % 64);
    } else {
        bits[w] &= !(1 << (i % 64));
    }
}

fn ones(bits: &[u64]) -> impl Iterator<Item = u32> + '_ {
    bits.iter().enumerate().flat_map(|(w, &word)| {
        let mut rest = word;
        std::iter::from_fn(move || {
            if rest == 0 {
                return None;
            }
            let b = rest.trailing_zeros();
            rest &= rest - 1;
            Some(w as u32 * 64 + b)
        })
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The vault is one per process: its tests (and the pairs', which keep memfds
    /// in it) take turns.
    pub(crate) static SERIAL: Mutex<()> = Mutex::new(());

    /// A memfd holding `tag`.
    fn tagged(tag: u64) -> c_int {
        // SAFETY: plain syscalls on a fresh memfd of ours; a local buffer.
        unsafe {
            let fd = libc::memfd_create(c"vault-test".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::pwrite(fd, (&tag as *const u64).cast(), 8, 0), 8);
            fd
        }
    }

    /// Keeps a memfd holding `tag` (closing the test's descriptor, as the library
    /// does once the vault has it).
    fn kept(tag: u64) -> Kept {
        let fd = tagged(tag);
        let k = keep(fd);
        close(fd);
        k
    }

    /// The tag the memfd `fd` holds.
    fn tag_of(fd: c_int) -> u64 {
        let mut t = 0u64;
        // SAFETY: a local buffer of 8 bytes.
        assert_eq!(unsafe { libc::pread(fd, (&mut t as *mut u64).cast(), 8, 0) }, 8);
        t
    }

    fn close(fd: c_int) {
        // SAFETY: a descriptor the test owns.
        unsafe { libc::close(fd) };
    }

    /// Kept, the memfd is closed by its owner, and a copy still reads what it held;
    /// copies are close-on-exec.
    #[test]
    fn a_kept_memfd_comes_back() {
        let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let k = kept(0xfeed);
        assert!(matches!(k, Kept::Slot(_)), "this kernel has io_uring's fixed-file install: {k:?}");
        let c = copy(k).expect("a copy");
        assert_eq!(tag_of(c), 0xfeed);
        // SAFETY: plain syscall.
        assert_ne!(unsafe { libc::fcntl(c, libc::F_GETFD) } & libc::FD_CLOEXEC, 0);
        close(c);
        release(k);
    }

    /// Closing connections never empties a slot; once dead slots outnumber live
    /// ones the live ones move to a fresh ring, where each still holds its memfd.
    #[test]
    fn closed_slots_rotate_away_and_the_live_ones_survive() {
        let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let made = RINGS_MADE.load(Ordering::Relaxed);
        let kept: Vec<(u64, Kept)> = (0..40u64).map(|t| (t, kept(t))).collect();
        let (live, ..) = census();
        assert!(live >= 40);
        // Close the even ones: 20 dead against 20 live makes a rotation.
        for (t, k) in &kept {
            if t % 2 == 0 {
                release(*k);
            }
        }
        let (_, dead, rings, _) = census();
        assert!(rings > made, "a fresh ring was made");
        assert!(dead < DEAD_BEFORE_ROTATION.max(20), "the dead slots went with the old ring: {dead}");
        for (t, k) in &kept {
            if t % 2 == 1 {
                let c = copy(*k).expect("a live slot survives rotation");
                assert_eq!(tag_of(c), *t);
                close(c);
                release(*k);
            }
        }
    }

    /// A burst of connections grows the ring; then all but the one in the highest
    /// slot close, and connections come and go: each rotation's fresh ring must
    /// still cover that slot. (A ring sized for the live count alone could not take
    /// it, so every rotation and every keep made a ring that failed its copy, and
    /// each new connection fell back to a socketpair: a descriptor per connection,
    /// EMFILE in the 100 x 100 test.)
    #[test]
    fn a_live_connection_in_a_high_slot_does_not_stop_rotation() {
        let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let burst: Vec<(u64, Kept)> = (0..300u64).map(|t| (t, kept(t))).collect();
        let (high_tag, high) = *burst
            .iter()
            .max_by_key(|(_, k)| match k {
                Kept::Slot(s) => *s,
                _ => 0,
            })
            .expect("a burst");
        assert!(matches!(high, Kept::Slot(s) if s >= 250), "{high:?}");
        for (_, k) in &burst {
            if *k != high {
                release(*k);
            }
        }
        let made = RINGS_MADE.load(Ordering::Relaxed);
        for round in 0..200u64 {
            let k = kept(1000 + round);
            assert!(matches!(k, Kept::Slot(_)), "round {round}: fell back to {k:?}");
            release(k);
        }
        let rings = RINGS_MADE.load(Ordering::Relaxed) - made;
        assert!(rings <= 40, "{rings} rings for 200 connections one at a time");
        let c = copy(high).expect("the high slot survives every rotation");
        assert_eq!(tag_of(c), high_tag);
        close(c);
        release(high);
    }

    /// How a child process is made in [`child_copies_after`].
    #[derive(Clone, Copy, PartialEq)]
    enum Made {
        /// With the vault's fork handlers (called by hand: unit tests register none).
        ByFork,
        /// Without them, as by a raw clone(2).
        ByRawClone,
    }

    /// Makes a child, lets the parent run `meanwhile`, then has the child (at what
    /// is its first library call) copy `k` out of its vault; whether the copy held
    /// `tag`.
    fn child_copies_after(k: Kept, tag: u64, made: Made, meanwhile: impl FnOnce()) -> bool {
        if made == Made::ByFork {
            before_fork();
        }
        let (mut go, mut done) = ([-1; 2], [-1; 2]);
        // SAFETY: two local arrays for pipe descriptors.
        unsafe {
            assert_eq!(libc::pipe(go.as_mut_ptr()), 0);
            assert_eq!(libc::pipe(done.as_mut_ptr()), 0);
        }
        // libc's fork keeps the allocator usable in the child of this many-threaded
        // harness; no handler of the library's is registered in unit tests.
        // SAFETY: the child only makes system calls and uses the vault before it
        // exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            if made == Made::ByFork {
                after_fork(true);
            }
            let mut b = 0u8;
            // SAFETY: waits for the parent's cue on a pipe of ours, then exits.
            unsafe {
                libc::read(go[0], (&mut b as *mut u8).cast(), 1);
                if made == Made::ByRawClone {
                    after_raw_clone();
                }
                let ok = copy(k).is_some_and(|c| tag_of(c) == tag);
                libc::write(done[1], [u8::from(ok)].as_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        assert!(pid > 0);
        if made == Made::ByFork {
            after_fork(false);
        }
        meanwhile();
        let mut b = 0u8;
        // SAFETY: pipes of ours; a local byte; the child is ours to reap.
        unsafe {
            libc::write(go[1], [1u8].as_ptr().cast(), 1);
            assert_eq!(libc::read(done[0], (&mut b as *mut u8).cast(), 1), 1);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
            for f in go.into_iter().chain(done) {
                libc::close(f);
            }
        }
        b == 1
    }

    /// The attack the rotation answers: a process made by a raw `clone` (no fork
    /// handlers) shares the ring; its parent closes the connection and enough
    /// others to rotate and drop its ring; the child, at its first library call,
    /// still gets the memfd (an emptied slot would lose the connection at the
    /// child's `exec`).
    #[test]
    fn a_raw_clone_child_keeps_what_its_parent_closed() {
        let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let k = kept(0xc10e);
        let got = child_copies_after(k, 0xc10e, Made::ByRawClone, || {
            release(k);
            for t in 0..(2 * DEAD_BEFORE_ROTATION as u64) {
                release(kept(t));
            }
        });
        assert!(got, "the child got the memfd its parent had closed");
    }

    /// The fork handlers give the child a ring of its own, filled before the fork:
    /// the child's copy works after the parent closed the connection.
    #[test]
    fn a_forked_child_gets_a_ring_of_its_own() {
        let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let k = kept(0xf0f0);
        assert!(
            child_copies_after(k, 0xf0f0, Made::ByFork, || release(k)),
            "the forked child's own ring holds the memfd"
        );
    }
}
