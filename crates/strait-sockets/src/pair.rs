//! Doorbells per **process pair** (issue 19): one small sealed memfd and two
//! eventfds shared by every connection between two processes, instead of two
//! eventfds per connection.
//!
//! A pair has two *halves*, one per process: the half a process reads holds a ready
//! bitmap of 65,536 slots and a summary (one bit per bitmap word). The process that
//! reads a half allocates its slots (one per connection of the pair), so the two
//! processes never coordinate; each tells the other its slot of a connection (the
//! connector in its hello, the acceptor in the connection's header). To ring the
//! other process for a connection, a process sets the connection's bit in the other
//! half, then its summary bit, then writes the other half's eventfd. Taking what
//! rang costs one swap per summary word and one per bitmap word it names: the work
//! follows what rang, not how many connections the pair carries.
//!
//! ```text
//! 0                  magic u64 ("SRTAIR01"), version u32
//! 64 + 64*h          reader claim of half h: 0 free, a process token, or SHARED
//! HALF + h*HALF_LEN  half h: summary (16 words)
//!   + 4096           ready bitmap (1,024 words: 65,536 slots)
//! ```
//!
//! **The eventfds are never read.** Every waiter registers the eventfd it waits on
//! edge-triggered in an epoll instance of its own (an epoll set of the program's,
//! or a thread's [`crate::hub`]): each write is then one event for every instance
//! that watches it, so a blocked `read` in one thread, an epoll set in another and
//! a forked child never take each other's wake-ups, as they would if one of them
//! drained the count. (A count that only grows saturates after 2^64 rings.)
//!
//! **The bits are handed on in the process.** Whoever takes the bits of a half
//! gives each registered consumer (an epoll set) the connections it did not take
//! itself; a consumer whose backlog overflowed looks at all of its connections of
//! the pair once ([`Rung::All`]).
//!
//! **A half read by two processes is shared** (after a `fork`, a raw `clone`, a
//! descriptor passed, an `exec` whose record says so, or a second process that
//! adopted the pair from a hello): its claim word says `SHARED`, and its readers
//! look at all of their connections of the pair on each ring, since the other
//! reader may have taken the bits. A connector never uses a shared pair for a new
//! connection.
//!
//! **The peer is not trusted**: it can write any word of the pair. A bit names only
//! a slot this process allocated (others are ignored), every index is bounded by
//! construction, and a bit is only a hint: readiness is always read from the
//! connection's rings. What a hostile peer can do is wake this process in vain for
//! its own connections, or fail to wake it for them: never touch another pair.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use libc::c_int;
use strait_sys::mmap::Mapping;

use crate::real;
use crate::sock::close_all;

/// "SRTAIR01".
pub const MAGIC: u64 = u64::from_le_bytes(*b"SRTAIR01");
/// Layout version of the pair's memfd.
pub const VERSION: u32 = 1;
/// Slots per half.
pub const SLOTS: usize = 65_536;
const WORDS: usize = SLOTS / 64;
const SUMMARY_WORDS: usize = WORDS / 64;
const CLAIM: usize = 64;
const HALF: usize = 4096;
const BITMAP: usize = 4096;
const HALF_LEN: usize = BITMAP + WORDS * 8;
/// Bytes of a pair's memfd.
pub const LEN: usize = HALF + 2 * HALF_LEN;
/// A claim word that says two processes read the half.
const SHARED: u64 = u64::MAX;
/// Connections a consumer's backlog holds before it looks at all of them.
const BACKLOG_MAX: usize = 4096;
/// Idle pairs (no connection) a process keeps for its next connections.
pub const IDLE_KEPT: usize = 8;

/// Which half of a pair a process reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Half {
    /// The process that made the pair (a connector).
    Creator,
    /// The process that adopted it from a hello (an acceptor).
    Other,
}

impl Half {
    fn index(self) -> usize {
        match self {
            Half::Creator => 0,
            Half::Other => 1,
        }
    }
    /// The other process's half.
    pub fn peer(self) -> Half {
        match self {
            Half::Creator => Half::Other,
            Half::Other => Half::Creator,
        }
    }
}

/// Why a pair offered by a peer was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PairError {
    #[error("the pair's memfd is not a sealed memfd of {LEN} bytes")]
    NotSealed,
    #[error("a bell of the pair is not an eventfd")]
    NotEventfd,
    #[error("the pair's header has magic {0:#x}, version {1}")]
    BadHeader(u64, u32),
    #[error("mapping the pair failed (errno {0})")]
    Map(i32),
    #[error("making a pair failed (errno {0})")]
    Make(i32),
}

/// What a slot of this process's half is used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotUse {
    Free,
    /// Allocated, its connection not made yet.
    Claimed,
    /// The connection (its key) rings through it.
    Bound(u64),
}

/// What rang since a consumer last looked.
#[derive(Debug, PartialEq, Eq)]
pub enum Rung {
    /// These connections (keys), each at most once per take of the bits.
    These(Vec<u64>),
    /// Any connection of the pair may have changed: look at all of them.
    All,
}

/// An epoll set (or other consumer) registered with a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConsumerId(pub u64);

struct Consumer {
    id: ConsumerId,
    backlog: Vec<u64>,
    all: bool,
}

#[derive(Default)]
struct Local {
    slots: Vec<SlotUse>,
    free: Vec<u32>,
    bound: usize,
    consumers: Vec<Consumer>,
}

/// One process's end of a pair.
pub struct Pair {
    map: Mapping,
    half: Half,
    /// The eventfd the other process rings for us (held, never read).
    my_bell: c_int,
    /// The eventfd we ring.
    peer_bell: c_int,
    /// The memfd's inode: the pair's name (no one can name a pair without holding it).
    inode: u64,
    /// Where the memfd is kept, for `exec` and descriptor passing.
    kept: crate::vault::Kept,
    /// The process the pair was made with (a hint for reuse; never trusted for more).
    peer_pid: libc::pid_t,
    /// Known in this process to be read by two processes (see the module doc).
    shared: AtomicBool,
    local: Mutex<Local>,
}

// SAFETY: the mapping is shared memory accessed only through atomics; the rest is
// plain data or behind the mutex.
unsafe impl Sync for Pair {}
// SAFETY: as above.
unsafe impl Send for Pair {}

/// A random token per process (renewed in a fork child): the claim of a half.
fn process_token() -> u64 {
    static TOKEN: AtomicU64 = AtomicU64::new(0);
    static PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
    // SAFETY: getpid has no preconditions (asked directly: a raw-clone child has
    // no fork handler to refresh a cached id).
    let pid = unsafe { libc::getpid() };
    if PID.load(Ordering::Acquire) != pid {
        // Never 0 (a free half) nor SHARED.
        let t = strait_sys::random::random_u64().unwrap_or(pid as u64 ^ 0x5eed_0000_0000) | 2;
        TOKEN.store(t & !1, Ordering::Relaxed);
        PID.store(pid, Ordering::Release);
    }
    TOKEN.load(Ordering::Relaxed)
}

fn new_eventfd() -> c_int {
    // SAFETY: plain syscall.
    unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) }
}

fn inode_of(fd: c_int) -> Option<u64> {
    // SAFETY: stat is plain old data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a local stat.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
}

impl Pair {
    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= LEN && off.is_multiple_of(8));
        // SAFETY: an 8-aligned offset inside the page-aligned mapping of LEN bytes,
        // which this value owns; shared words are only accessed atomically.
        unsafe { &*self.map.ptr().add(off).cast::<AtomicU64>() }
    }

    fn summary(&self, half: Half, i: usize) -> &AtomicU64 {
        self.word(HALF + half.index() * HALF_LEN + i * 8)
    }

    fn bitmap(&self, half: Half, w: usize) -> &AtomicU64 {
        self.word(HALF + half.index() * HALF_LEN + BITMAP + w * 8)
    }

    fn claim_word(&self, half: Half) -> &AtomicU64 {
        self.word(CLAIM + 64 * half.index())
    }

    /// Makes a pair with process `peer_pid` (a hint): this process reads the
    /// creator's half.
    pub fn create(peer_pid: libc::pid_t) -> Result<Pair, PairError> {
        let memfd = strait_sys::sealed_memfd(c"strait-pair", LEN)
            .map(std::os::fd::IntoRawFd::into_raw_fd)
            .map_err(|e| PairError::Make(e.raw_os_error().unwrap_or(0)))?;
        let bells = [new_eventfd(), new_eventfd()];
        if bells.iter().any(|&b| b < 0) {
            let e = real::errno();
            close_all(&[memfd, bells[0], bells[1]].into_iter().filter(|&f| f >= 0).collect::<Vec<_>>());
            return Err(PairError::Make(e));
        }
        let p = Pair::open(memfd, bells, Half::Creator, peer_pid, true)?;
        p.word(0).store(MAGIC, Ordering::Relaxed);
        p.word(8).store(u64::from(VERSION), Ordering::Release);
        Ok(p)
    }

    /// Adopts a pair a peer offered (its memfd and the two bells, creator's
    /// first; ownership of the three descriptors passes to this call, which
    /// closes what it does not keep): this process reads the other half.
    pub fn adopt(memfd: c_int, bells: [c_int; 2], peer_pid: libc::pid_t) -> Result<Pair, PairError> {
        Pair::checked_open(memfd, bells, Half::Other, peer_pid, false)
    }

    /// Checks what another process handed over (a sealed memfd of [`LEN`] bytes,
    /// two eventfds, the pair's header) and opens it for `half` (ownership of the
    /// three descriptors passes to this call, which closes what it does not keep;
    /// `fresh`: take the half's claim over, see [`Pair::claim_half`]).
    fn checked_open(
        memfd: c_int,
        bells: [c_int; 2],
        half: Half,
        peer_pid: libc::pid_t,
        fresh: bool,
    ) -> Result<Pair, PairError> {
        let checked = if !crate::sock::memfd_ok(memfd, LEN) {
            Err(PairError::NotSealed)
        } else if !bells.iter().all(|&b| crate::trust::is_eventfd(b)) {
            Err(PairError::NotEventfd)
        } else {
            Ok(())
        };
        if let Err(e) = checked {
            close_all(&[memfd, bells[0], bells[1]]);
            return Err(e);
        }
        let p = Pair::open(memfd, bells, half, peer_pid, fresh)?;
        let magic = p.word(0).load(Ordering::Acquire);
        let version = p.word(8).load(Ordering::Acquire) as u32;
        if magic != MAGIC || version != VERSION {
            return Err(PairError::BadHeader(magic, version));
        }
        Ok(p)
    }

    /// Maps `memfd` and keeps it in the vault, keeps `bells`: ownership of the
    /// three passes to this call.
    fn open(
        memfd: c_int,
        bells: [c_int; 2],
        half: Half,
        peer_pid: libc::pid_t,
        fresh: bool,
    ) -> Result<Pair, PairError> {
        let inode = inode_of(memfd);
        let map = match (inode, Mapping::shared(memfd, LEN, 0)) {
            (Some(_), Ok(m)) => m,
            (_, Err(e)) => {
                close_all(&[memfd, bells[0], bells[1]]);
                return Err(PairError::Map(e.raw_os_error().unwrap_or(0)));
            }
            (None, Ok(_)) => {
                close_all(&[memfd, bells[0], bells[1]]);
                return Err(PairError::Map(real::errno()));
            }
        };
        let [mine, peers] = match half {
            Half::Creator => [bells[0], bells[1]],
            Half::Other => [bells[1], bells[0]],
        };
        let p = Pair {
            map,
            half,
            my_bell: crate::fds::keep(mine),
            peer_bell: crate::fds::keep(peers),
            inode: inode.unwrap_or(0),
            kept: crate::vault::keep(memfd),
            peer_pid,
            shared: AtomicBool::new(false),
            local: Mutex::new(Local::default()),
        };
        // (The vault holds it now.)
        close_all(&[memfd]);
        p.claim_half(fresh);
        Ok(p)
    }

    /// Claims this process's half; a half another process already reads becomes
    /// shared (both then look at all their connections of the pair on a ring).
    fn claim_half(&self, fresh: bool) {
        let me = process_token();
        let w = self.claim_word(self.half);
        if fresh {
            w.store(me, Ordering::Release);
            return;
        }
        match w.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {}
            Err(now) if now == me => {}
            Err(_) => self.mark_shared(),
        }
    }

    /// Marks the half this process reads as read by another process too.
    pub fn mark_shared(&self) {
        self.shared.store(true, Ordering::Relaxed);
        self.claim_word(self.half).store(SHARED, Ordering::Release);
    }

    /// True if another process may take this half's bits.
    pub fn is_shared(&self) -> bool {
        self.shared.load(Ordering::Relaxed) || self.claim_word(self.half).load(Ordering::Acquire) == SHARED
    }

    /// True if the other half is read by more than one process: a connector makes
    /// a new pair rather than add to it.
    pub fn peer_shared(&self) -> bool {
        self.claim_word(self.half.peer()).load(Ordering::Acquire) == SHARED
    }

    /// The half this process reads.
    pub fn half(&self) -> Half {
        self.half
    }
    /// The eventfd this process waits on (register it edge-triggered; never read it).
    pub fn my_bell(&self) -> c_int {
        self.my_bell
    }
    /// The bells in the creator's order (for a hello or a record).
    pub fn bells(&self) -> [c_int; 2] {
        match self.half {
            Half::Creator => [self.my_bell, self.peer_bell],
            Half::Other => [self.peer_bell, self.my_bell],
        }
    }
    /// Where the memfd is kept.
    pub fn kept(&self) -> crate::vault::Kept {
        self.kept
    }

    fn local(&self) -> MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Allocates a slot of this process's half; `None` when all are in use.
    pub fn claim(&self) -> Option<u32> {
        let mut l = self.local();
        let slot = match l.free.pop() {
            Some(s) => s,
            None if l.slots.len() < SLOTS => {
                l.slots.push(SlotUse::Free);
                (l.slots.len() - 1) as u32
            }
            None => return None,
        };
        l.slots[slot as usize] = SlotUse::Claimed;
        l.bound += 1;
        Some(slot)
    }

    /// Binds a claimed slot to the connection `key` (bits for it are reported
    /// from now on).
    pub fn bind(&self, slot: u32, key: u64) {
        let mut l = self.local();
        if let Some(s) = l.slots.get_mut(slot as usize) {
            if *s == SlotUse::Claimed {
                *s = SlotUse::Bound(key);
            }
        }
    }

    /// Claims `slot` exactly (an `exec`'d program re-creating its table from a
    /// record; [`Pair::bind`] it then); false if it is in use already or out of
    /// range.
    pub fn claim_exact(&self, slot: u32) -> bool {
        let mut l = self.local();
        let i = slot as usize;
        if i >= SLOTS {
            return false;
        }
        while l.slots.len() <= i {
            let n = l.slots.len() as u32;
            l.slots.push(SlotUse::Free);
            l.free.push(n);
        }
        if l.slots[i] != SlotUse::Free {
            return false;
        }
        l.free.retain(|&f| f != slot);
        l.slots[i] = SlotUse::Claimed;
        l.bound += 1;
        true
    }

    /// Gives a slot back (its connection is gone from this process).
    pub fn free(&self, slot: u32) {
        let mut l = self.local();
        if let Some(s) = l.slots.get_mut(slot as usize) {
            if *s != SlotUse::Free {
                *s = SlotUse::Free;
                l.free.push(slot);
                l.bound -= 1;
            }
        }
    }

    /// What slot `slot` of this process's half is used for.
    #[cfg(test)]
    pub fn slot_use(&self, slot: u32) -> SlotUse {
        self.local().slots.get(slot as usize).copied().unwrap_or(SlotUse::Free)
    }

    /// Connections of this process on the pair (claimed or bound slots).
    pub fn in_use(&self) -> usize {
        self.local().bound
    }

    /// Rings the other process for its slot `peer_slot`: its bit, its summary
    /// bit, then the bell. A slot out of range (the peer's own word) rings nothing.
    pub fn ring(&self, peer_slot: u32) {
        let slot = peer_slot as usize;
        if slot >= SLOTS {
            return;
        }
        let (w, b) = (slot / 64, slot % 64);
        let half = self.half.peer();
        // Release: the reader that takes the bit sees what the ring published.
        self.bitmap(half, w).fetch_or(1 << b, Ordering::Release);
        self.summary(half, w / 64).fetch_or(1 << (w % 64), Ordering::Release);
        crate::sock::ring_eventfd(self.peer_bell);
    }

    /// Registers a consumer (an epoll set): from now on, bits another consumer
    /// takes for connections of this pair reach it through its backlog.
    pub fn register(&self, id: ConsumerId) {
        let mut l = self.local();
        if !l.consumers.iter().any(|c| c.id == id) {
            l.consumers.push(Consumer { id, backlog: Vec::new(), all: false });
        }
    }

    /// Takes a consumer out.
    pub fn unregister(&self, id: ConsumerId) {
        self.local().consumers.retain(|c| c.id != id);
    }

    /// Takes this half's bits: the connections that rang since anyone in this
    /// process last took them, plus what other consumers took for `me`.
    pub fn take(&self, me: Option<ConsumerId>) -> Rung {
        let mut l = self.local();
        let mut fresh = Vec::new();
        for s in 0..SUMMARY_WORDS {
            let sum = self.summary(self.half, s);
            if sum.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut words = sum.swap(0, Ordering::Acquire);
            while words != 0 {
                let w = s * 64 + words.trailing_zeros() as usize;
                words &= words - 1;
                let mut bits = self.bitmap(self.half, w).swap(0, Ordering::Acquire);
                while bits != 0 {
                    let slot = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    // A bit of a slot we did not bind is the peer's noise: ignored.
                    if let Some(SlotUse::Bound(k)) = l.slots.get(slot) {
                        fresh.push(*k);
                    }
                }
            }
        }
        if self.is_shared() {
            for c in &mut l.consumers {
                c.backlog.clear();
                c.all = false;
            }
            return Rung::All;
        }
        let mut mine = None;
        for c in &mut l.consumers {
            if Some(c.id) == me {
                mine = Some(c);
                continue;
            }
            if c.all || fresh.is_empty() {
                continue;
            }
            if c.backlog.len() + fresh.len() > BACKLOG_MAX {
                c.backlog.clear();
                c.all = true;
            } else {
                c.backlog.extend_from_slice(&fresh);
            }
        }
        match mine {
            Some(c) if c.all => {
                c.all = false;
                c.backlog.clear();
                Rung::All
            }
            Some(c) => {
                let mut out = std::mem::take(&mut c.backlog);
                out.extend_from_slice(&fresh);
                out.sort_unstable();
                out.dedup();
                Rung::These(out)
            }
            None => Rung::These(fresh),
        }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        crate::hub::forget(self.my_bell);
        crate::fds::let_go(&[self.my_bell, self.peer_bell]);
        crate::vault::release(self.kept);
    }
}

// ---- the process's pairs -------------------------------------------------------

/// The pairs of this process.
static PAIRS: Mutex<Vec<Arc<Pair>>> = Mutex::new(Vec::new());

fn pairs() -> MutexGuard<'static, Vec<Arc<Pair>>> {
    PAIRS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A pair to ring process `peer_pid` through for a new connection: one this
/// process made with it and reads alone (whose other half one process reads),
/// else a new one. `None` if none can be made.
pub fn for_peer(peer_pid: libc::pid_t) -> Option<Arc<Pair>> {
    let mut all = pairs();
    let reuse = all.iter().find(|p| {
        p.half == Half::Creator
            && p.peer_pid == peer_pid
            && !p.is_shared()
            && !p.peer_shared()
            && p.in_use() < SLOTS
    });
    if let Some(p) = reuse {
        return Some(p.clone());
    }
    let p = Arc::new(Pair::create(peer_pid).ok()?);
    all.push(p.clone());
    Some(p)
}

/// Adopts the pair a hello offered (see [`Pair::adopt`]): the one this process
/// already reads under that memfd's inode (the copies are closed), else a new one.
pub fn adopt(memfd: c_int, bells: [c_int; 2], peer_pid: libc::pid_t) -> Result<Arc<Pair>, PairError> {
    let mut all = pairs();
    if let Some(p) = held(&all, memfd, Half::Other) {
        close_all(&[memfd, bells[0], bells[1]]);
        return Ok(p);
    }
    let p = Arc::new(Pair::adopt(memfd, bells, peer_pid)?);
    all.push(p.clone());
    Ok(p)
}

/// The pair of `pairs` under `memfd`'s inode whose `half` this process reads.
fn held(pairs: &[Arc<Pair>], memfd: c_int, half: Half) -> Option<Arc<Pair>> {
    let ino = inode_of(memfd)?;
    pairs.iter().find(|p| p.inode == ino && p.half == half).cloned()
}

/// Takes over a pair from an `exec` or descriptor-passing record: its memfd and
/// bells (creator's first; ownership passes to this call), the half the
/// connection's end reads, and whether another process reads it too. The pair this
/// process holds already under that inode and half, if any (the copies closed).
pub fn reopen(memfd: c_int, bells: [c_int; 2], half: Half, shared: bool) -> Result<Arc<Pair>, PairError> {
    let mut all = pairs();
    if let Some(p) = held(&all, memfd, half) {
        close_all(&[memfd, bells[0], bells[1]]);
        if shared {
            p.mark_shared();
        }
        return Ok(p);
    }
    let p = Pair::checked_open(memfd, bells, half, 0, !shared)?;
    if shared {
        p.mark_shared();
    }
    let p = Arc::new(p);
    all.push(p.clone());
    Ok(p)
}

/// A connection let its slot of `p` go: drops idle pairs beyond [`IDLE_KEPT`]
/// (the oldest first), and any idle shared one (it is never reused).
pub fn retire_idle() {
    let mut all = pairs();
    let idle = |p: &Arc<Pair>| Arc::strong_count(p) == 1 && p.in_use() == 0;
    all.retain(|p| !(idle(p) && (p.is_shared() || p.peer_shared())));
    let mut n = all.iter().filter(|p| idle(p)).count();
    all.retain(|p| {
        if n > IDLE_KEPT && idle(p) {
            n -= 1;
            return false;
        }
        true
    });
}

/// (pairs, connections bound through them) held by this process, for `--stats`.
pub fn census() -> (usize, usize) {
    let all = pairs();
    (all.len(), all.iter().map(|p| p.in_use()).sum())
}

// ---- fork and clone ---------------------------------------------------------------

thread_local! {
    static FORK_GUARD: std::cell::RefCell<Option<MutexGuard<'static, Vec<Arc<Pair>>>>> =
        const { std::cell::RefCell::new(None) };
}

/// Before a fork: no other thread may be inside the registry while the child's copy
/// is made.
pub(crate) fn before_fork() {
    let g = pairs();
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// After a fork, in both processes: every pair is read by both (the child holds the
/// same mappings and eventfds).
pub(crate) fn after_fork() {
    FORK_GUARD.with(|f| {
        if let Some(g) = f.borrow_mut().take() {
            for p in g.iter() {
                p.mark_shared();
            }
        }
    });
}

/// At the first library call of a process made by a raw `clone` (no fork
/// handlers ran): as after a fork.
pub(crate) fn after_raw_clone() {
    for p in pairs().iter() {
        p.mark_shared();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dup(fd: c_int) -> c_int {
        // SAFETY: plain syscall.
        unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) }
    }

    /// Both ends of one pair in this process, as two processes would hold them.
    fn both() -> (Pair, Pair) {
        let a = Pair::create(0).expect("create");
        let memfd = crate::vault::copy(a.kept()).expect("memfd");
        let [c, o] = a.bells();
        let b = Pair::adopt(memfd, [dup(c), dup(o)], 0).expect("adopt");
        (a, b)
    }

    /// A slot of `p`'s reader, claimed and bound to `key`.
    fn bound(p: &Pair, key: u64) -> u32 {
        let s = p.claim().expect("slot");
        p.bind(s, key);
        s
    }

    /// Two consumers of `b` (epoll sets) registered.
    fn two_consumers(b: &Pair) -> (ConsumerId, ConsumerId) {
        let (c1, c2) = (ConsumerId(1), ConsumerId(2));
        b.register(c1);
        b.register(c2);
        (c1, c2)
    }

    fn epoll_on(fd: c_int) -> c_int {
        // SAFETY: plain syscalls on a local event.
        unsafe {
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            let mut e = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLET) as u32, u64: 7 };
            assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut e), 0);
            ep
        }
    }

    fn events(ep: c_int) -> i32 {
        let mut e = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: a local array of 4 events.
        unsafe { libc::epoll_wait(ep, e.as_mut_ptr(), 4, 0) }
    }

    #[test]
    fn ring_reaches_the_bound_slot_only() {
        let _s = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (a, b) = both();
        let sb = b.claim().expect("slot");
        b.bind(sb, 42);
        let stray = b.claim().expect("slot"); // claimed, not bound: not reported
        a.ring(sb);
        a.ring(stray);
        a.ring(70_000); // out of range: nothing
        assert_eq!(b.take(None), Rung::These(vec![42]));
        assert_eq!(b.take(None), Rung::These(vec![]));
        // The creator's half is untouched by rings for the other half.
        assert_eq!(a.take(None), Rung::These(vec![]));
    }

    #[test]
    fn every_epoll_instance_gets_every_ring() {
        let _s = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (a, b) = both();
        let (e1, e2) = (epoll_on(b.my_bell()), epoll_on(b.my_bell()));
        for _ in 0..3 {
            a.ring(0);
            // Each watcher sees the ring once: nobody drains the count.
            assert_eq!(events(e1), 1);
            assert_eq!(events(e2), 1);
            assert_eq!(events(e1), 0);
        }
        close_all(&[e1, e2]);
    }

    #[test]
    fn bits_taken_by_one_consumer_reach_the_others() {
        let _s = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (a, b) = both();
        let (c1, c2) = two_consumers(&b);
        let slots: Vec<u32> = (0..3).map(|k| bound(&b, 100 + k)).collect();
        a.ring(slots[0]);
        a.ring(slots[2]);
        assert_eq!(b.take(Some(c1)), Rung::These(vec![100, 102]));
        // c2 did not take: it gets them from its backlog, with what rang since.
        a.ring(slots[1]);
        assert_eq!(b.take(Some(c2)), Rung::These(vec![100, 101, 102]));
        assert_eq!(b.take(Some(c1)), Rung::These(vec![101]));
        b.unregister(c2);
        a.ring(slots[0]);
        assert_eq!(b.take(Some(c1)), Rung::These(vec![100]));
    }

    #[test]
    fn an_overflowing_backlog_asks_for_all() {
        let _s = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (a, b) = both();
        let (c1, c2) = two_consumers(&b);
        for k in 0..(BACKLOG_MAX as u64 + 10) {
            a.ring(bound(&b, k));
        }
        assert!(matches!(b.take(Some(c1)), Rung::These(v) if v.len() == BACKLOG_MAX + 10));
        assert_eq!(b.take(Some(c2)), Rung::All);
        assert_eq!(b.take(Some(c2)), Rung::These(vec![]));
    }

    #[test]
    fn a_second_reader_makes_the_half_shared() {
        let _s = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (a, b) = both();
        assert!(!b.is_shared() && !a.peer_shared());
        // Another process's claim (a token that is not ours) in the other half.
        b.claim_word(Half::Other).store(12, Ordering::Release);
        let memfd = crate::vault::copy(a.kept()).expect("memfd");
        let [c, o] = a.bells();
        let b2 = Pair::adopt(memfd, [dup(c), dup(o)], 0).expect("adopt");
        assert!(b2.is_shared() && b.is_shared() && a.peer_shared());
        a.ring(bound(&b, 5));
        assert_eq!(b.take(None), Rung::All);
    }

    #[test]
    fn slots_are_reused_and_bounded() {
        let _s = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (_a, b) = both();
        let s0 = b.claim().expect("slot");
        let s1 = b.claim().expect("slot");
        assert_ne!(s0, s1);
        assert_eq!(b.in_use(), 2);
        b.free(s0);
        b.free(s0); // twice: counted once
        assert_eq!(b.in_use(), 1);
        assert_eq!(b.claim(), Some(s0));
        assert!(b.claim_exact(500));
        assert!(!b.claim_exact(500));
        assert!(!b.claim_exact(SLOTS as u32));
        assert_eq!(b.slot_use(500), SlotUse::Claimed);
        b.bind(500, 9);
        assert_eq!(b.slot_use(500), SlotUse::Bound(9));
    }

    #[test]
    fn adopt_refuses_what_is_not_a_pair() {
        let _s = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (a, _b) = both();
        let [c, o] = a.bells();
        // A memfd of the wrong size.
        let wrong =
            strait_sys::sealed_memfd(c"x", 4096).map(std::os::fd::IntoRawFd::into_raw_fd).expect("memfd");
        assert_eq!(Pair::adopt(wrong, [dup(c), dup(o)], 0).err(), Some(PairError::NotSealed));
        // A bell that is not an eventfd.
        let memfd = crate::vault::copy(a.kept()).expect("memfd");
        let other_memfd = crate::vault::copy(a.kept()).expect("memfd");
        assert_eq!(Pair::adopt(memfd, [dup(c), other_memfd], 0).err(), Some(PairError::NotEventfd));
        // The right shape, the wrong header.
        let blank =
            strait_sys::sealed_memfd(c"x", LEN).map(std::os::fd::IntoRawFd::into_raw_fd).expect("memfd");
        assert!(matches!(Pair::adopt(blank, [dup(c), dup(o)], 0), Err(PairError::BadHeader(0, 0))));
    }

    /// A hostile peer writes random words over the whole pair (summaries, bitmaps,
    /// claims, header) between rings: takes stay bounded and report only slots this
    /// process bound, and a ring after the noise is still reported.
    #[test]
    fn random_words_from_the_peer_report_only_our_slots() {
        let _s = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (a, b) = both();
        let mut keys = std::collections::HashSet::new();
        let mut slots = Vec::new();
        for k in 0..50u64 {
            keys.insert(1000 + k);
            slots.push(bound(&b, 1000 + k));
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..200 {
            for _ in 0..64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let off = (x as usize % (LEN / 8)) * 8;
                a.word(off).store(x.rotate_left(round), Ordering::Relaxed);
            }
            let target = slots[round as usize % slots.len()];
            a.ring(target);
            match b.take(None) {
                Rung::All => {}
                Rung::These(v) => {
                    assert!(v.iter().all(|k| keys.contains(k)), "a key we never bound: {v:?}");
                    assert!(v.contains(&(1000 + (round as u64 % 50))), "the real ring was lost");
                }
            }
        }
    }
}
