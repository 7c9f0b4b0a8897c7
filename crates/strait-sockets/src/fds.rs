//! What the library holds for itself: its long-lived descriptors (a connection's
//! doorbells, Unix socket and vault), kept above the program's numbers and hidden
//! from its `close` and `close_range` sweeps, and the shared memory it has mapped;
//! both counted, with their peaks, for `STRAIT_STATS`.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::RwLock;

use libc::c_int;

/// Descriptors the library holds for its own use (a connection's eventfds, Unix
/// socket and vault). A program that closes every descriptor it did not open (a
/// daemon, or a `close_fds` before exec, as Python's subprocess does) must not take
/// them: `close` answers EBADF for them, as if they were not open, and
/// `close_range`/`closefrom` step over them. While none exist a lookup is one load.
pub struct InternalFds {
    live: AtomicUsize,
    /// No descriptor below this was ever the library's: the program's (low)
    /// numbers are answered with one load, though the library always holds some
    /// (its handle on /proc).
    lowest: AtomicI32,
    bits: RwLock<Vec<u64>>,
}

impl InternalFds {
    const fn new() -> Self {
        InternalFds {
            live: AtomicUsize::new(0),
            lowest: AtomicI32::new(c_int::MAX),
            bits: RwLock::new(Vec::new()),
        }
    }

    fn set(&self, fd: c_int, on: bool) {
        if fd < 0 {
            return;
        }
        let (w, b) = (fd as usize / 64, 1u64 << (fd as usize % 64));
        if on {
            // (Before the bit is set: a reader that sees the bit also sees this.)
            self.lowest.fetch_min(fd, Ordering::Relaxed);
        }
        let mut t = self.bits.write().unwrap_or_else(|e| e.into_inner());
        if t.len() <= w {
            t.resize(w + 1, 0);
        }
        let was = t[w] & b != 0;
        if on && !was {
            t[w] |= b;
            let now = self.live.fetch_add(1, Ordering::Relaxed) + 1;
            FDS_PEAK.fetch_max(now, Ordering::Relaxed);
        } else if !on && was {
            t[w] &= !b;
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn contains(&self, fd: c_int) -> bool {
        if self.live.load(Ordering::Relaxed) == 0 || fd < self.lowest.load(Ordering::Relaxed) || fd < 0 {
            return false;
        }
        let t = self.bits.read().unwrap_or_else(|e| e.into_inner());
        t.get(fd as usize / 64).is_some_and(|w| w & (1u64 << (fd as usize % 64)) != 0)
    }
}

static INTERNAL: InternalFds = InternalFds::new();
/// The most descriptors the library held at once.
static FDS_PEAK: AtomicUsize = AtomicUsize::new(0);
/// Bytes of shared memory the library has mapped now (connections' and channels'
/// rings), and the most at once.
static SHM_BYTES: AtomicUsize = AtomicUsize::new(0);
static SHM_PEAK: AtomicUsize = AtomicUsize::new(0);

/// A shared mapping of `len` bytes was made (undo with [`shm_unmapped`]).
pub(crate) fn shm_mapped(len: usize) {
    let now = SHM_BYTES.fetch_add(len, Ordering::Relaxed) + len;
    SHM_PEAK.fetch_max(now, Ordering::Relaxed);
}

/// A shared mapping of `len` bytes was unmapped.
pub(crate) fn shm_unmapped(len: usize) {
    SHM_BYTES.fetch_sub(len, Ordering::Relaxed);
}

/// What the library holds for itself now, and at most so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// Descriptors of the library's own.
    pub fds: usize,
    /// The most descriptors held at once.
    pub fds_peak: usize,
    /// Bytes of shared memory mapped.
    pub shm_bytes: usize,
    /// The most bytes mapped at once.
    pub shm_peak: usize,
}

/// What the library holds for itself.
pub fn held() -> Held {
    Held {
        fds: INTERNAL.live.load(Ordering::Relaxed),
        fds_peak: FDS_PEAK.load(Ordering::Relaxed),
        shm_bytes: SHM_BYTES.load(Ordering::Relaxed),
        shm_peak: SHM_PEAK.load(Ordering::Relaxed),
    }
}

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

/// The library's own descriptors in `first..=last`, ascending.
pub fn internal_in(first: libc::c_uint, last: libc::c_uint) -> Vec<c_int> {
    let t = INTERNAL.bits.read().unwrap_or_else(|e| e.into_inner());
    let mut out = Vec::new();
    for (w, &bits) in t.iter().enumerate() {
        let mut b = bits;
        while b != 0 {
            let fd = w * 64 + b.trailing_zeros() as usize;
            b &= b - 1;
            if (first as usize..=last as usize).contains(&fd) {
                out.push(fd as c_int);
            }
        }
    }
    out
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
    *BASE.get_or_init(|| (soft_nofile() / 2).clamp(64, 4096) as c_int)
}

/// The process's soft descriptor limit now (1024 if it cannot be read).
pub(crate) fn soft_nofile() -> u64 {
    // SAFETY: rlimit is plain old data; getrlimit fills it.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: a local rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
        r.rlim_cur
    } else {
        1024
    }
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

thread_local! {
    static OWN_CLOSES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, in which a value of a library the crate uses closes a descriptor of
/// the library's through libc's `close` (an `io_uring` instance dropped): that
/// `close` reaches the kernel at once, as the library's own closes do, rather than
/// the program's `close` (which would look the number up in tables whose locks the
/// caller, a fork handler say, may hold).
pub(crate) fn own_closes<R>(f: impl FnOnce() -> R) -> R {
    let was = OWN_CLOSES.with(|c| c.replace(true));
    let r = f();
    OWN_CLOSES.with(|c| c.set(was));
    r
}

/// Whether the `close` being made is one of [`own_closes`].
#[inline]
pub(crate) fn closing_own() -> bool {
    OWN_CLOSES.with(std::cell::Cell::get)
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
