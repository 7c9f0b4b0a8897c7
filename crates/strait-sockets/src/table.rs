//! The descriptor table: which of the program's descriptors are sockets strait
//! carries, with one entry type ([`Socket`]) for every kind (TCP connections, UDP
//! sockets, listening sockets).
//!
//! Every interposed call first asks [`get`] (or [`lookup`] / [`udp`] for one kind);
//! while no socket is carried that is one relaxed load, so programs that never meet a
//! strait peer pay nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use libc::c_int;

use crate::conn::Conn;
use crate::epoll;
use crate::fdtable::FdTable;
use crate::listening::Listening;
use crate::sock::Key;
pub use crate::socket::Socket;
use crate::udp::UdpSock;

static SOCKETS: FdTable<Socket> = FdTable::new();
/// Descriptors in the table that are TCP connections.
static TCP_FDS: AtomicUsize = AtomicUsize::new(0);
/// Descriptors in the table that are UDP sockets.
static UDP_FDS: AtomicUsize = AtomicUsize::new(0);
/// Descriptors in the table that are listening sockets.
static LISTENING_FDS: AtomicUsize = AtomicUsize::new(0);

/// The count of descriptors of `s`'s kind.
fn kind_count(s: &Socket) -> &'static AtomicUsize {
    match s {
        Socket::Tcp(_) => &TCP_FDS,
        Socket::Udp(_) => &UDP_FDS,
        Socket::Listening(_) => &LISTENING_FDS,
    }
}

fn counted_in(s: &Socket) {
    kind_count(s).fetch_add(1, Ordering::Relaxed);
}

fn counted_out(s: &Socket) {
    kind_count(s).fetch_sub(1, Ordering::Relaxed);
}

/// Puts `s` at `fd`; returns what `fd` referred to.
fn put(fd: c_int, s: Socket) -> Option<Socket> {
    counted_in(&s);
    let old = SOCKETS.insert(fd, s);
    if let Some(o) = &old {
        counted_out(o);
        forget_held();
    }
    old
}

/// What `fd` is, if the library carries it.
#[inline]
pub fn get(fd: c_int) -> Option<Socket> {
    SOCKETS.lookup(fd)
}

/// Entries of this thread's look-up cache (a descriptor's entry lives in slot
/// `fd % HELD_SLOTS`): a busy-polling or event-loop thread drives a few sockets.
const HELD_SLOTS: usize = 4;

/// This thread's copies of the entries it looked up last, valid while the table's
/// change count reads `changes`: a hit costs no lock and no reference count (the
/// table's read lock and an `Arc` clone and drop were four locked instructions on
/// every interposed call, a tenth of a busy-polled round trip).
struct HeldCache {
    changes: u64,
    slots: [Option<(c_int, Socket)>; HELD_SLOTS],
}

thread_local! {
    static HELD: std::cell::RefCell<HeldCache> =
        const { std::cell::RefCell::new(HeldCache { changes: u64::MAX, slots: [const { None }; HELD_SLOTS] }) };
}

/// What `fd` is, if the library carries it, as [`get`], but from this thread's cache
/// when the table has not changed since the entry was cached (one load): the entry
/// goes back to the cache when the [`Held`] is dropped.
#[inline]
pub fn get_held(fd: c_int) -> Option<Held> {
    if !SOCKETS.any_live() || fd < 0 {
        return None;
    }
    let changes = SOCKETS.generation();
    let slot = fd as usize % HELD_SLOTS;
    let mut stale: [Option<(c_int, Socket)>; HELD_SLOTS] = [const { None }; HELD_SLOTS];
    let hit = HELD
        .try_with(|h| {
            let mut h = h.try_borrow_mut().ok()?;
            if h.changes != changes {
                // The table changed: every copy may be stale (dropped below, after
                // the borrow: a last reference's drop may call back in here).
                stale = std::mem::replace(&mut h.slots, [const { None }; HELD_SLOTS]);
                h.changes = changes;
                return None;
            }
            match h.slots[slot].take() {
                Some((f, s)) if f == fd => Some(s),
                other => {
                    h.slots[slot] = other;
                    None
                }
            }
        })
        .ok()
        .flatten();
    drop(stale);
    let s = match hit {
        Some(s) => s,
        None => SOCKETS.lookup(fd)?,
    };
    Some(Held { fd, changes, socket: Some(s) })
}

/// An entry of the descriptor table in use by this thread ([`get_held`]); it goes
/// back to the thread's cache when dropped (if the table has not changed since).
pub struct Held {
    fd: c_int,
    changes: u64,
    socket: Option<Socket>,
}

impl std::ops::Deref for Held {
    type Target = Socket;
    fn deref(&self) -> &Socket {
        // Only `drop` takes it.
        self.socket.as_ref().expect("a held entry has its socket until dropped")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut back = self.socket.take();
        let slot = self.fd as usize % HELD_SLOTS;
        let mut evicted = None;
        let _ = HELD.try_with(|h| {
            let Ok(mut h) = h.try_borrow_mut() else { return };
            if h.changes != self.changes || SOCKETS.generation() != self.changes {
                return;
            }
            evicted = std::mem::replace(&mut h.slots[slot], back.take().map(|s| (self.fd, s)));
        });
        // Outside the borrow: dropping a last reference may call back in.
        drop(evicted);
        drop(back);
    }
}

/// Empties this thread's cache now (it changed the table: a copy of what it
/// removed must not keep the socket alive until this thread's next look-up).
fn forget_held() {
    let mut stale: [Option<(c_int, Socket)>; HELD_SLOTS] = [const { None }; HELD_SLOTS];
    let _ = HELD.try_with(|h| {
        if let Ok(mut h) = h.try_borrow_mut() {
            stale = std::mem::replace(&mut h.slots, [const { None }; HELD_SLOTS]);
        }
    });
    drop(stale);
}

/// The TCP connection behind `fd`, if it is one of ours.
#[inline]
pub fn lookup(fd: c_int) -> Option<Arc<Conn>> {
    if TCP_FDS.load(Ordering::Relaxed) == 0 {
        return None;
    }
    SOCKETS.lookup(fd)?.tcp()
}

/// The UDP socket behind `fd`, if it is one of ours (one relaxed load when this
/// process has none).
pub fn udp(fd: c_int) -> Option<Arc<UdpSock>> {
    if UDP_FDS.load(Ordering::Relaxed) == 0 {
        return None;
    }
    SOCKETS.lookup(fd)?.udp()
}

/// True if any descriptor is a TCP connection of ours.
pub fn any_live() -> bool {
    TCP_FDS.load(Ordering::Relaxed) != 0
}

/// True if any descriptor is a UDP socket of ours (else the interposed calls skip
/// every UDP look-up).
pub fn any_udp() -> bool {
    UDP_FDS.load(Ordering::Relaxed) != 0
}

/// Registers `fd` as (another descriptor of) `conn`; returns the connection it
/// replaced, if `fd` was one (a UDP socket it replaced is let go here).
pub fn insert(fd: c_int, conn: Arc<Conn>) -> Option<Arc<Conn>> {
    match put(fd, Socket::Tcp(conn))? {
        Socket::Tcp(c) => Some(c),
        old => {
            drop_socket_ref(old);
            None
        }
    }
}

/// Registers a new UDP socket at `fd` (after `socket()`).
pub fn insert_udp(fd: c_int, u: Arc<UdpSock>) {
    if let Some(old) = put(fd, Socket::Udp(u)) {
        drop_socket_ref(old);
    }
}

/// Removes `fd` if it is a TCP connection; returns its connection.
pub fn remove(fd: c_int) -> Option<Arc<Conn>> {
    if TCP_FDS.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let s = SOCKETS.remove_if(fd, |s| matches!(s, Socket::Tcp(_)))?;
    counted_out(&s);
    forget_held();
    s.tcp()
}

/// `close(fd)` of a UDP socket of ours: one descriptor fewer.
pub fn remove_udp(fd: c_int) {
    if UDP_FDS.load(Ordering::Relaxed) == 0 {
        return;
    }
    if let Some(s) = SOCKETS.remove_if(fd, |s| matches!(s, Socket::Udp(_))) {
        counted_out(&s);
        forget_held();
        drop_socket_ref(s);
    }
}

/// `dup`-like calls: `new` now refers to what `old` refers to (and no longer to
/// what it referred to before).
pub fn dup(old: c_int, new: c_int) {
    if new < 0 || old == new {
        return;
    }
    let prev = match get(old) {
        Some(s) => {
            if let Some(refs) = s.fdrefs() {
                refs.fetch_add(1, Ordering::AcqRel);
            }
            put(new, s)
        }
        None => SOCKETS.remove(new).inspect(counted_out),
    };
    if let Some(p) = prev {
        forget_held();
        drop_socket_ref(p);
    }
}

/// The strait sides of the listening socket `fd`, if it has any (one relaxed load
/// when this process has none).
pub fn listening(fd: c_int) -> Option<Arc<Listening>> {
    if LISTENING_FDS.load(Ordering::Relaxed) == 0 {
        return None;
    }
    SOCKETS.lookup(fd)?.listening()
}

/// The strait sides of the listening socket `fd`, made empty if it had none.
pub fn listening_or_new(fd: c_int) -> Arc<Listening> {
    if let Some(l) = listening(fd) {
        return l;
    }
    let l = Arc::new(Listening::default());
    if let Some(old) = put(fd, Socket::Listening(l.clone())) {
        drop_socket_ref(old);
    }
    l
}

/// True if any listening socket has a strait side.
pub fn any_listening() -> bool {
    LISTENING_FDS.load(Ordering::Relaxed) != 0
}

/// Every listening socket's descriptor, with its strait sides.
pub fn listening_entries() -> Vec<(c_int, Arc<Listening>)> {
    if !any_listening() {
        return Vec::new();
    }
    SOCKETS.entries().into_iter().filter_map(|(fd, s)| Some((fd, s.listening()?))).collect()
}

/// `close(fd)` of a listening socket.
pub fn remove_listening(fd: c_int) {
    if !any_listening() {
        return;
    }
    if let Some(s) = SOCKETS.remove_if(fd, |s| matches!(s, Socket::Listening(_))) {
        counted_out(&s);
        forget_held();
    }
}

/// Removes every descriptor of `conn` (it fell back to the kernel); how many
/// there were (0: removed already).
pub fn remove_conn(conn: &Arc<Conn>) -> usize {
    let n = SOCKETS.remove_all(&Socket::Tcp(conn.clone()));
    TCP_FDS.fetch_sub(n, Ordering::Relaxed);
    forget_held();
    n
}

/// The table's write locks, taken.
type TableGuard = Vec<std::sync::RwLockWriteGuard<'static, Vec<Option<Socket>>>>;

thread_local! {
    /// The table's write locks, held by the forking thread across `fork`.
    static FORK_GUARD: std::cell::RefCell<Option<TableGuard>> = const { std::cell::RefCell::new(None) };
}

/// Before `fork`: no other thread may be inside the table (the child would inherit
/// its lock taken, by a thread it does not have).
pub fn lock_for_fork() {
    let g = SOCKETS.write_all();
    FORK_GUARD.with(|c| *c.borrow_mut() = Some(g));
}

/// After `fork`, in the parent and in the child.
pub fn unlock_after_fork() {
    FORK_GUARD.with(|c| drop(c.borrow_mut().take()));
}

/// All distinct TCP connections (for fork).
pub fn all_conns() -> Vec<Arc<Conn>> {
    if !any_live() {
        return Vec::new();
    }
    SOCKETS.all().into_iter().filter_map(Socket::tcp).collect()
}

/// All distinct UDP sockets (for fork and exit).
pub fn all_udp() -> Vec<Arc<UdpSock>> {
    if !any_udp() {
        return Vec::new();
    }
    SOCKETS.all().into_iter().filter_map(Socket::udp).collect()
}

/// Every TCP descriptor with its connection (for exec).
pub fn entries() -> Vec<(c_int, Arc<Conn>)> {
    if !any_live() {
        return Vec::new();
    }
    SOCKETS.entries().into_iter().filter_map(|(fd, s)| Some((fd, s.tcp()?))).collect()
}

/// One of the program's descriptors of `conn` other than `except` (a look at the
/// whole table: only when an epoll set's watch must move off a descriptor that
/// is closing).
pub fn fd_of(conn: &Arc<Conn>, except: c_int) -> Option<c_int> {
    entries().into_iter().find(|(fd, c)| *fd != except && Arc::ptr_eq(c, conn)).map(|e| e.0)
}

/// One descriptor of a socket went away: the last one releases it and takes it out
/// of every epoll set (as the kernel would).
fn drop_socket_ref(s: Socket) {
    match s {
        Socket::Tcp(c) => drop_ref(c),
        Socket::Udp(u) => {
            if u.fdrefs.fetch_sub(1, Ordering::AcqRel) == 1 {
                u.release();
                epoll::forget_udp(&u);
            }
        }
        // Its sides go (their descriptors closed) with the last entry that holds them.
        Socket::Listening(_) => {}
    }
}

/// One descriptor of a connection went away.
pub fn drop_ref(conn: Arc<Conn>) {
    if conn.fdrefs.fetch_sub(1, Ordering::AcqRel) == 1 {
        conn.release();
        epoll::forget_conn(&conn);
    }
}

/// One descriptor of a connection was really closed; `ids` are the TCP socket's
/// (local, peer) addresses read before (see [`Conn::release_closed`]).
pub fn drop_ref_closed(conn: Arc<Conn>, ids: Option<(Key, Key)>) {
    if conn.fdrefs.fetch_sub(1, Ordering::AcqRel) == 1 {
        conn.release_closed(ids);
        epoll::forget_conn(&conn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Descriptors no other test of this binary uses (the table is the process's).
    const FD: c_int = 1_000_001;

    fn listening_at(fd: c_int) -> Arc<Listening> {
        let l = Arc::new(Listening::default());
        if let Some(old) = put(fd, Socket::Listening(l.clone())) {
            drop_socket_ref(old);
        }
        l
    }

    fn held_listening(fd: c_int) -> Option<Arc<Listening>> {
        get_held(fd).and_then(|h| (*h).clone().listening())
    }

    #[test]
    fn a_cached_entry_is_never_what_the_descriptor_no_longer_is() {
        let first = listening_at(FD);
        let got = held_listening(FD).expect("carried");
        assert!(Arc::ptr_eq(&got, &first));
        drop(got);
        // Cached now: found again, the same object.
        assert!(held_listening(FD).is_some_and(|l| Arc::ptr_eq(&l, &first)));
        // Replaced: the cache must not answer with the old one.
        let second = listening_at(FD);
        assert!(held_listening(FD).is_some_and(|l| Arc::ptr_eq(&l, &second)));
        // Closed: not carried any more, and this thread's cache does not keep it alive.
        remove_listening(FD);
        assert!(get_held(FD).is_none());
        assert_eq!(Arc::strong_count(&second), 1, "only the test holds the closed socket");
        assert_eq!(Arc::strong_count(&first), 1);
    }

    #[test]
    fn a_change_made_while_an_entry_is_in_use_keeps_it_out_of_the_cache() {
        const FD2: c_int = FD + 1;
        let l = listening_at(FD2);
        let held = get_held(FD2).expect("carried");
        // Another thread closes the descriptor while this one uses the entry.
        std::thread::scope(|s| s.spawn(|| remove_listening(FD2)).join().expect("closer"));
        drop(held);
        assert!(get_held(FD2).is_none());
        assert_eq!(Arc::strong_count(&l), 1, "the entry in use went back to no cache");
    }
}
