//! Which descriptors are accelerated connections, strait listeners, or epoll sets with
//! accelerated members.
//!
//! Every interposed call first asks [`lookup`]; while no connection is accelerated
//! that is one relaxed load, so programs that never meet a strait peer pay nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use libc::c_int;

use crate::conn::Conn;
use crate::discover::Listener;

/// Shards of a descriptor table: descriptor `fd` lives in shard `fd % SHARDS`, slot
/// `fd / SHARDS`.
const SHARDS: usize = 64;

/// One shard: its own lock on its own cache lines (two, against the adjacent-line
/// prefetcher), so that threads driving different descriptors do not pass one lock's
/// line between their cores on every call (the kernel's own descriptor look-up
/// shares nothing either). One lock for a whole process's table cost a two-thread
/// ping-pong 97 ns per call against 22 ns in two processes.
#[repr(align(128))]
struct Shard<T> {
    fds: RwLock<Vec<Option<Arc<T>>>>,
}

/// A table from descriptor to shared object, read on every interposed call: while
/// it is empty a lookup is one relaxed load (no lock).
pub struct FdTable<T> {
    live: AtomicUsize,
    shards: [Shard<T>; SHARDS],
}

fn place(fd: c_int) -> (usize, usize) {
    let fd = fd as usize;
    (fd % SHARDS, fd / SHARDS)
}

impl<T> FdTable<T> {
    /// An empty table (usable in a `static`).
    pub const fn new() -> Self {
        FdTable {
            live: AtomicUsize::new(0),
            shards: [const { Shard { fds: RwLock::new(Vec::new()) } }; SHARDS],
        }
    }

    fn read(&self, shard: usize) -> std::sync::RwLockReadGuard<'_, Vec<Option<Arc<T>>>> {
        self.shards[shard].fds.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self, shard: usize) -> std::sync::RwLockWriteGuard<'_, Vec<Option<Arc<T>>>> {
        self.shards[shard].fds.write().unwrap_or_else(|e| e.into_inner())
    }

    /// What `fd` refers to, if anything.
    pub fn lookup(&self, fd: c_int) -> Option<Arc<T>> {
        if self.live.load(Ordering::Relaxed) == 0 || fd < 0 {
            return None;
        }
        let (shard, slot) = place(fd);
        self.read(shard).get(slot).and_then(|c| c.clone())
    }

    /// True if any descriptor is in the table.
    pub fn any_live(&self) -> bool {
        self.live.load(Ordering::Relaxed) != 0
    }

    /// Registers `fd` as (another descriptor of) `v`; returns what `fd` referred to.
    pub fn insert(&self, fd: c_int, v: Arc<T>) -> Option<Arc<T>> {
        if fd < 0 {
            return None;
        }
        let (shard, slot) = place(fd);
        let mut t = self.write(shard);
        if t.len() <= slot {
            t.resize(slot + 1, None);
        }
        let old = t[slot].replace(v);
        if old.is_none() {
            self.live.fetch_add(1, Ordering::Relaxed);
        }
        old
    }

    /// Removes `fd`; returns what it referred to.
    pub fn remove(&self, fd: c_int) -> Option<Arc<T>> {
        if self.live.load(Ordering::Relaxed) == 0 || fd < 0 {
            return None;
        }
        let (shard, slot) = place(fd);
        let old = self.write(shard).get_mut(slot).and_then(|c| c.take());
        if old.is_some() {
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
        old
    }

    /// Removes every descriptor of `v`.
    pub fn remove_all(&self, v: &Arc<T>) {
        for shard in 0..SHARDS {
            let mut t = self.write(shard);
            for slot in t.iter_mut() {
                if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, v)) {
                    *slot = None;
                    self.live.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Every descriptor in the table with what it refers to, by descriptor.
    pub fn entries(&self) -> Vec<(c_int, Arc<T>)> {
        if !self.any_live() {
            return Vec::new();
        }
        let mut v = Vec::new();
        for shard in 0..SHARDS {
            let t = self.read(shard);
            v.extend(
                t.iter()
                    .enumerate()
                    .filter_map(|(slot, c)| Some(((slot * SHARDS + shard) as c_int, c.clone()?))),
            );
        }
        v.sort_by_key(|e| e.0);
        v
    }

    /// Every distinct object in the table (for fork and exit).
    pub fn all(&self) -> Vec<Arc<T>> {
        if !self.any_live() {
            return Vec::new();
        }
        let mut v: Vec<Arc<T>> = Vec::new();
        for shard in 0..SHARDS {
            for c in self.read(shard).iter().flatten() {
                if !v.iter().any(|x| Arc::ptr_eq(x, c)) {
                    v.push(c.clone());
                }
            }
        }
        v
    }

    /// Takes every shard's write lock (in shard order, the only order in which more
    /// than one is ever held), for `fork`.
    fn write_all(&self) -> Vec<std::sync::RwLockWriteGuard<'_, Vec<Option<Arc<T>>>>> {
        (0..SHARDS).map(|shard| self.write(shard)).collect()
    }
}

/// The accelerated TCP connections.
static CONNS: FdTable<Conn> = FdTable::new();
static LISTENERS_LIVE: AtomicUsize = AtomicUsize::new(0);
static LISTENERS: Mutex<Vec<(c_int, Arc<Listener>)>> = Mutex::new(Vec::new());

pub fn lookup(fd: c_int) -> Option<Arc<Conn>> {
    CONNS.lookup(fd)
}

pub fn any_live() -> bool {
    CONNS.any_live()
}

/// Registers `fd` as (another descriptor of) `conn`; returns the connection it
/// replaced, if `fd` was one.
pub fn insert(fd: c_int, conn: Arc<Conn>) -> Option<Arc<Conn>> {
    CONNS.insert(fd, conn)
}

/// Removes `fd`; returns its connection.
pub fn remove(fd: c_int) -> Option<Arc<Conn>> {
    CONNS.remove(fd)
}

/// Removes every descriptor of `conn` (it fell back to the kernel).
pub fn remove_conn(conn: &Arc<Conn>) {
    CONNS.remove_all(conn)
}

/// The connection table's write locks, taken.
type TableGuard = Vec<std::sync::RwLockWriteGuard<'static, Vec<Option<Arc<Conn>>>>>;

thread_local! {
    /// The connection table's write lock, held by the forking thread across `fork`.
    static FORK_GUARD: std::cell::RefCell<Option<TableGuard>> = const { std::cell::RefCell::new(None) };
}

/// Before `fork`: no other thread may be inside the connection table (the child
/// would inherit its lock taken, by a thread it does not have).
pub fn lock_for_fork() {
    let g = CONNS.write_all();
    FORK_GUARD.with(|c| *c.borrow_mut() = Some(g));
}

/// After `fork`, in the parent and in the child.
pub fn unlock_after_fork() {
    FORK_GUARD.with(|c| drop(c.borrow_mut().take()));
}

/// All distinct connections (for fork).
pub fn all_conns() -> Vec<Arc<Conn>> {
    CONNS.all()
}

/// Every accelerated descriptor with its connection (for exec).
pub fn entries() -> Vec<(c_int, Arc<Conn>)> {
    CONNS.entries()
}

/// One descriptor of a connection went away.
pub fn drop_ref(conn: Arc<Conn>) {
    if conn.fdrefs.fetch_sub(1, Ordering::AcqRel) == 1 {
        conn.release();
        crate::poll::forget_conn(&conn);
    }
}

/// One descriptor of a connection was really closed; `ids` are the TCP socket's
/// (local, peer) addresses read before (see [`Conn::release_closed`]).
pub fn drop_ref_closed(conn: Arc<Conn>, ids: Option<(crate::sock::Key, crate::sock::Key)>) {
    if conn.fdrefs.fetch_sub(1, Ordering::AcqRel) == 1 {
        conn.release_closed(ids);
        crate::poll::forget_conn(&conn);
    }
}

pub fn listener(fd: c_int) -> Option<Arc<Listener>> {
    if LISTENERS_LIVE.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
    l.iter().find(|(f, _)| *f == fd).map(|(_, l)| l.clone())
}

pub fn add_listener(fd: c_int, l: Arc<Listener>) {
    let mut v = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
    v.retain(|(f, _)| *f != fd);
    v.push((fd, l));
    LISTENERS_LIVE.store(v.len(), Ordering::Relaxed);
}

/// True if any strait listener is open.
/// The descriptors of every registered listening socket.
pub fn listener_fds() -> Vec<c_int> {
    if LISTENERS_LIVE.load(Ordering::Relaxed) == 0 {
        return Vec::new();
    }
    LISTENERS.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(f, _)| *f).collect()
}

pub fn any_listener() -> bool {
    LISTENERS_LIVE.load(Ordering::Relaxed) != 0
}

pub fn remove_listener(fd: c_int) {
    if LISTENERS_LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut v = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
    v.retain(|(f, _)| *f != fd);
    LISTENERS_LIVE.store(v.len(), Ordering::Relaxed);
}

/// Descriptors the library holds for its own use (a connection's eventfds, Unix
/// socket and vault). A program that closes every descriptor it did not open (a
/// daemon, or a `close_fds` before exec, as Python's subprocess does) must not take
/// them: `close` answers EBADF for them, as if they were not open, and
/// `close_range`/`closefrom` step over them. While none exist a lookup is one load.
pub struct InternalFds {
    live: AtomicUsize,
    bits: RwLock<Vec<u64>>,
}

impl InternalFds {
    const fn new() -> Self {
        InternalFds { live: AtomicUsize::new(0), bits: RwLock::new(Vec::new()) }
    }

    fn set(&self, fd: c_int, on: bool) {
        if fd < 0 {
            return;
        }
        let (w, b) = (fd as usize / 64, 1u64 << (fd as usize % 64));
        let mut t = self.bits.write().unwrap_or_else(|e| e.into_inner());
        if t.len() <= w {
            t.resize(w + 1, 0);
        }
        let was = t[w] & b != 0;
        if on && !was {
            t[w] |= b;
            self.live.fetch_add(1, Ordering::Relaxed);
        } else if !on && was {
            t[w] &= !b;
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn contains(&self, fd: c_int) -> bool {
        if self.live.load(Ordering::Relaxed) == 0 || fd < 0 {
            return false;
        }
        let t = self.bits.read().unwrap_or_else(|e| e.into_inner());
        t.get(fd as usize / 64).is_some_and(|w| w & (1u64 << (fd as usize % 64)) != 0)
    }
}

static INTERNAL: InternalFds = InternalFds::new();

/// Marks descriptors as the library's own.
pub fn add_internal(fds: &[c_int]) {
    for &fd in fds {
        INTERNAL.set(fd, true);
    }
}

/// The library is closing (or giving away) these descriptors of its own.
pub fn remove_internal(fds: &[c_int]) {
    for &fd in fds {
        INTERNAL.set(fd, false);
    }
}

/// True if the library holds descriptors of its own.
pub fn any_internal() -> bool {
    INTERNAL.live.load(Ordering::Relaxed) != 0
}

/// True if `fd` is one of the library's own descriptors.
pub fn is_internal(fd: c_int) -> bool {
    INTERNAL.contains(fd)
}

/// Where the library's long-lived descriptors go: above the numbers programs use.
/// Programs size tables by descriptor number (wrk's event loop holds 10 + 3 per
/// connection; select() stops at 1024), so a connection's eventfds, Unix socket and
/// vault must not crowd the low numbers. Half the soft descriptor limit, at most 4096
/// (the kernel sizes a process's descriptor table to its highest descriptor).
fn high_base() -> c_int {
    static BASE: std::sync::OnceLock<c_int> = std::sync::OnceLock::new();
    *BASE.get_or_init(|| {
        // SAFETY: rlimit is plain old data; getrlimit fills it.
        let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: a local rlimit.
        let soft =
            if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 { r.rlim_cur } else { 1024 };
        (soft / 2).clamp(64, 4096) as c_int
    })
}

/// A close-on-exec duplicate of `fd` for the library's own use, above the program's
/// numbers (see [`high_base`]) if there is room there, else anywhere; -1 on failure.
pub fn dup_high(fd: c_int) -> c_int {
    // SAFETY: plain syscalls duplicating a descriptor the caller holds.
    unsafe {
        let d = crate::real::fcntl(fd, libc::F_DUPFD_CLOEXEC, high_base() as usize);
        if d >= 0 {
            d
        } else {
            crate::real::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0)
        }
    }
}

/// Keeps a long-lived descriptor of the library: above the program's numbers and
/// marked internal (the program's `close`/`close_range` pass it by). Undo with
/// [`let_go`].
pub fn keep(fd: c_int) -> c_int {
    let fd = to_high(fd);
    if fd >= 0 {
        add_internal(&[fd]);
    }
    fd
}

/// Closes descriptors taken with [`keep`] (negative ones are skipped).
pub fn let_go(fds: &[c_int]) {
    for &fd in fds.iter().filter(|&&fd| fd >= 0) {
        remove_internal(&[fd]);
        // SAFETY: a descriptor the library kept and no longer uses.
        unsafe { crate::real::close(fd) };
    }
}

/// Moves one of the library's own descriptors above the program's numbers (see
/// [`high_base`]); keeps it where it is if that fails (descriptors are short).
pub fn to_high(fd: c_int) -> c_int {
    if fd < 0 || fd >= high_base() {
        return fd;
    }
    // SAFETY: plain syscall on a descriptor the library owns.
    let moved = unsafe { crate::real::fcntl(fd, libc::F_DUPFD_CLOEXEC, high_base() as usize) };
    if moved < 0 {
        return fd;
    }
    // SAFETY: the old number of the descriptor just duplicated.
    unsafe { crate::real::close(fd) };
    moved
}
