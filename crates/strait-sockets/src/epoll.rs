//! `epoll` over sets with accelerated members: the interest list of each set (its
//! accelerated members, kept beside the kernel set, which holds their doorbells) and
//! `epoll_wait` answered from the rings.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libc::{c_int, epoll_event, sigset_t};
use strait_sys::IntMap;

use crate::conn::Conn;
use crate::fdtable::Shared;
use crate::pair::{ConsumerId, Pair, Rung};
use crate::real;
use crate::settings::Settings;
use crate::socket::Socket;
use crate::udp::UdpSock;
use crate::wait::{remaining, slice_left};

// ---------------------------------------------------------------- epoll

const MAGIC_BELL: u64 = 0x5354_5241_4954_0000 << 16;
const MAGIC_HUP: u64 = 0x5354_5241_4955_0000 << 16;
const MAGIC_MARK: u64 = 0x5354_5241_4956_0000 << 16;
/// The bell of a process pair ([`crate::pair`]), registered edge-triggered once per
/// set for all the set's members of that pair.
const MAGIC_PAIR: u64 = 0x5354_5241_4957_0000 << 16;
/// Sets made so far: each set's consumer identity with the pairs.
static SET_IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
const MAGIC_MASK: u64 = !0xffff_ffff;

/// A zero-timeout `epoll_wait` may leave the kernel set unasked if it asked less
/// than [`Settings::epoll_kernel_look`] ago (2 us by default, as
/// [`crate::udp::KCHECK_NONBLOCKING`] for a UDP receive): what the kernel holds
/// (kernel members, a dead peer's hang-up) is then reported at most that much
/// later, never lost (it stays in the kernel's ready list). And one zero-timeout
/// call in this many asks the kernel set even within that time, so that kernel
/// members are not left behind a member that is always ready.
const KERNEL_LOOK_FAIR: u32 = 64;
/// A call that found nothing of ours leaves the kernel unasked only if it looked at
/// each entry's sleeping flags (queueing those taken, whose bell rang): a look at each entry's
/// shared line, about 2 ns each (measured with docs/epoll_zero.c): at this many
/// entries the call costs about what the kernel's own zero-timeout epoll_wait does
/// (80 ns here), and past about twice as many, more than asking the kernel set.
const QUIET_SCAN_MAX: usize = 16;

/// Forks so far: a set that existed at a fork is shared with the other process,
/// which may add kernel members we never hear of.
static FORKS: AtomicU32 = AtomicU32::new(0);
/// Some set is known (its kernel members are counted from then on).
static SETS_KNOWN: AtomicBool = AtomicBool::new(false);

/// The descriptors that wake a sleeper for this member, with their tags; `None`
/// if it has none yet (a UDP socket not bound yet). `hup` is the program's
/// descriptor of a connection watched through its own socket (-1: not watched).
fn wakers(m: &Socket, hup: c_int) -> Option<Vec<(c_int, u64, i32)>> {
    match m {
        Socket::Tcp(c) => {
            // Our own eventfd (a pair's bell is registered once per set: `watch_pair`).
            // A connection to another host's is edge-triggered and never read by the
            // set (as a pair's bell): the thread that moves arrivals in rings it, and
            // reading it back cost a system call per message ([`Registered::quiet_bell`]).
            let ev = if c.remote_fd().is_some() { libc::EPOLLIN | libc::EPOLLET } else { libc::EPOLLIN };
            let mut w: Vec<(c_int, u64, i32)> =
                (c.my_efd >= 0).then_some((c.my_efd, MAGIC_BELL, ev)).into_iter().collect();
            // The peer's hang-up ([`crate::conn::Liveness`]).
            let hup = c.hup_fd(hup);
            if hup >= 0 {
                w.push((hup, MAGIC_HUP, libc::EPOLLRDHUP));
            }
            // A connection to another host: its UDP socket rings like a bell.
            w.extend(c.remote_fd().map(|fd| (fd, MAGIC_BELL, libc::EPOLLIN)));
            // A connector not attached yet: an acceptor asking by path B (the
            // listener closes at settling, which takes it out of the set).
            w.extend(c.pending_listener().map(|fd| (fd, MAGIC_BELL, libc::EPOLLIN)));
            Some(w)
        }
        Socket::Udp(u) => u
            .rx()
            .map(|rx| vec![(rx.efd, MAGIC_BELL, libc::EPOLLIN), (rx.marker(), MAGIC_MARK, libc::EPOLLIN)]),
        // Never a member (the kernel's set holds a listening socket itself).
        Socket::Listening(_) => None,
    }
}

struct Entry {
    fd: c_int,
    conn: Socket,
    events: u32,
    data: u64,
    last_bits: i16,
    last_rx: u64,
    last_tx: u64,
    disabled: bool,
    /// May have changed since it was last looked at: it is in the set's queue
    /// (once).
    dirty: bool,
    /// Our sleeping flags are set for it, so any change rings its bell. Every entry
    /// is dirty or armed, so a scan only touches dirty entries (a connection's
    /// shared lines are not pulled from the peer on every epoll_wait).
    armed: bool,
    /// A connector that was waiting for its acceptor when it was added or last
    /// looked at: its pairs are looked at again at its next look, including the
    /// one at which it is found settled (it may have settled in another call, a
    /// send that answered a path-B ask, and then rings through a pair this set
    /// does not watch yet).
    settling: bool,
}

/// The accelerated members of one epoll set. Every look-up a call makes is by key
/// (descriptor, member, waker), and `epoll_wait` looks only at the entries in the
/// queue (those that may have changed), so its work follows what rang, not how many
/// members the set has.
#[derive(Default)]
pub struct EpSet {
    /// The entries, at stable indices (a removed entry's slot is reused, with a new
    /// generation).
    entries: Vec<Slot>,
    free: Vec<usize>,
    /// Live entries.
    count: usize,
    /// Entry index of each of the program's descriptors in the set.
    by_fd: IntMap<c_int, usize>,
    /// Entries that may have changed, each once (its `dirty` flag), as (index,
    /// generation): an index whose slot was reused since is stale and skipped.
    queue: VecDeque<(usize, u32)>,
    /// The entries of each member (by [`Socket::key`]).
    of_member: IntMap<usize, Vec<usize>>,
    /// The member behind each waker descriptor in the kernel set (doorbells,
    /// program sockets watched for the peer's hang-up, markers).
    by_waker: IntMap<c_int, Socket>,
    /// Members whose wakers are in the kernel set (by [`Socket::key`]). They stay
    /// after EPOLL_CTL_DEL (programs such as hiredis delete and re-add on every
    /// request) until the connection is closed: a bell with no entry is drained
    /// and ignored. Looked up by key: a set of 10,000 members pays no scan for an
    /// add or a close.
    wakers: IntMap<usize, Registered>,
    /// A UDP member had no wakers yet (not bound when added): look again.
    pending_udp: bool,
    /// Members the program put in the kernel set itself (counted from the set's
    /// `/proc` entry when we first met it, then by `epoll_ctl` and [`to_kernel`];
    /// a member closed without EPOLL_CTL_DEL stays counted); `None`: not known.
    kernel_members: Option<usize>,
    /// [`FORKS`] when the set was met: the count is trusted only in the same era.
    forks_at_join: u32,
    /// When a zero-timeout call last asked the kernel set, and the calls since.
    last_kernel_look: Option<Instant>,
    calls_since_kernel_look: u32,
    /// This set's identity as a consumer of process pairs (never reused).
    id: u64,
    /// The pairs whose bells are in the kernel set (by bell), with how many
    /// members ring through each.
    pairs: IntMap<c_int, (Arc<Pair>, usize)>,
}

/// A member's wakers in the kernel set.
struct Registered {
    /// The member (held: its key is its address).
    member: Socket,
    /// The descriptors registered (for `by_waker`).
    fds: Vec<c_int>,
    /// The program's descriptor registered for the peer's hang-up (-1: none).
    hup: c_int,
    /// The bells of the pairs it rings through, counted in [`EpSet::pairs`].
    pairs: Vec<c_int>,
    /// A connector still waiting for its acceptor when registered: its pairs are
    /// looked at again until it settles (a path-B asker gets a pair of its own).
    settling: bool,
    /// The member's own eventfd, registered edge-triggered: never read by the set
    /// (-1: none, or registered level-triggered, so read when it rings).
    quiet_bell: c_int,
}

/// One place for an entry.
#[derive(Default)]
struct Slot {
    gen: u32,
    entry: Option<Entry>,
}

impl EpSet {
    fn live(&self) -> bool {
        self.count != 0 || !self.wakers.is_empty()
    }

    fn entry(&mut self, i: usize) -> Option<&mut Entry> {
        self.entries.get_mut(i).and_then(|s| s.entry.as_mut())
    }

    fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter().filter_map(|s| s.entry.as_ref())
    }

    /// The program's own members of the kernel set are known to be none.
    fn no_kernel_members(&self) -> bool {
        self.kernel_members == Some(0) && self.forks_at_join == FORKS.load(Ordering::Relaxed)
    }

    /// For a zero-timeout call, before its pass: true if only shared memory can
    /// have changed for this set's entries, so the pass alone answers. Every entry
    /// must be queued (the pass looks at it), disabled (one-shot, reported), or
    /// armed, and a connection on this host with nothing else in the kernel set
    /// (not UDP, whose kernel socket may get datagrams; not another host's; not a
    /// connector whose listener may be asked). An armed entry whose sleeping flags
    /// were taken (a send, a read that freed room and a close each take the flag
    /// before they ring the bell) is queued now, as its bell would have queued it:
    /// the pass finds what rang without the kernel set, whose bell is drained by
    /// the next call that sleeps.
    fn queue_rung(&mut self) -> bool {
        if self.count > QUIET_SCAN_MAX || !self.no_kernel_members() {
            return false;
        }
        for i in 0..self.entries.len() {
            let Some(e) = self.entries[i].entry.as_ref() else { continue };
            if e.disabled || e.dirty {
                continue;
            }
            let (rx, tx) = (e.events & libc::EPOLLIN as u32 != 0, e.events & libc::EPOLLOUT as u32 != 0);
            let Socket::Tcp(c) = &e.conn else { return false };
            if !e.armed || !(rx || tx) || c.remote_fd().is_some() || c.awaiting_attach() {
                return false;
            }
            if !c.announce_stands(rx, tx) {
                self.mark(i);
            }
        }
        true
    }

    /// Whether a zero-timeout call that found `found_ours` of our members ready may
    /// leave the kernel set unasked: either it reports something anyway (what the
    /// kernel holds waits for the next look) or only shared memory can have
    /// changed (`answered`: [`EpSet::queue_rung`]), and it asked less than [`Settings::epoll_kernel_look`]
    /// ago and fewer than [`KERNEL_LOOK_FAIR`] calls ago. A dead peer's hang-up is
    /// seen at the next look. The clock is read only if the call may skip (the
    /// vDSO clock was a sixth of a call that asks the kernel); a look not recorded
    /// leaves the record older than the truth, which only brings the next look
    /// sooner.
    fn may_skip_kernel(&mut self, found_ours: bool, answered: bool) -> bool {
        if !(found_ours || answered) {
            return false;
        }
        let now = Instant::now();
        let recent = self
            .last_kernel_look
            .is_some_and(|t| now.saturating_duration_since(t) < Settings::get().epoll_kernel_look)
            && self.calls_since_kernel_look < KERNEL_LOOK_FAIR;
        if recent {
            self.calls_since_kernel_look += 1;
        } else {
            self.last_kernel_look = Some(now);
            self.calls_since_kernel_look = 0;
        }
        recent
    }

    /// Queues entry `i` to be looked at (if it is not queued already); its sleeping
    /// flags are set again when it is found not ready.
    fn mark(&mut self, i: usize) {
        let Some(slot) = self.entries.get_mut(i) else { return };
        let gen = slot.gen;
        if let Some(e) = slot.entry.as_mut() {
            e.armed = false;
            if !e.dirty {
                e.dirty = true;
                self.queue.push_back((i, gen));
            }
        }
    }

    fn insert(&mut self, e: Entry) {
        let (fd, key) = (e.fd, e.conn.key());
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.entries.push(Slot::default());
                self.entries.len() - 1
            }
        };
        let slot = &mut self.entries[i];
        slot.gen = slot.gen.wrapping_add(1);
        slot.entry = Some(Entry { dirty: false, ..e });
        self.count += 1;
        self.by_fd.insert(fd, i);
        self.of_member.entry(key).or_default().push(i);
        self.mark(i);
    }

    fn remove(&mut self, i: usize) -> Option<Entry> {
        let e = self.entries.get_mut(i)?.entry.take()?;
        self.free.push(i);
        self.count -= 1;
        self.by_fd.remove(&e.fd);
        let key = e.conn.key();
        if let Some(v) = self.of_member.get_mut(&key) {
            v.retain(|&x| x != i);
            if v.is_empty() {
                self.of_member.remove(&key);
            }
        }
        Some(e)
    }

    /// A waker of member `m` rang: its entries may have changed.
    fn touch(&mut self, m: &Socket) {
        self.touch_key(m.key());
    }

    /// The member with key `key` rang: its entries may have changed (a key with no
    /// entries is ignored).
    fn touch_key(&mut self, key: usize) {
        // Taken out and put back (no copy: this runs for every doorbell).
        let Some(idx) = self.of_member.get_mut(&key).map(std::mem::take) else { return };
        for &i in &idx {
            self.mark(i);
        }
        self.of_member.insert(key, idx);
    }

    /// Puts `m`'s wakers in the kernel set (and in `by_waker`), watching the
    /// peer's hang-up through the program's descriptor `fd`; false if it has none
    /// yet.
    fn add_wakers(&mut self, epfd: c_int, m: &Socket, fd: c_int) -> bool {
        let hup = match m {
            Socket::Tcp(c) if c.watched_by_socket() => fd,
            _ => -1,
        };
        let Some(w) = wakers(m, hup) else { return false };
        let mut fds = Vec::with_capacity(w.len());
        let mut quiet_bell = -1;
        for (fd, magic, ev) in w {
            if magic == MAGIC_BELL && ev & libc::EPOLLET != 0 {
                quiet_bell = fd;
            }
            self.add_waker(epfd, fd, magic, ev, m);
            fds.push(fd);
        }
        let mut reg =
            Registered { member: m.clone(), fds, hup, pairs: Vec::new(), settling: false, quiet_bell };
        if let Socket::Tcp(c) = m {
            reg.settling = c.awaiting_attach();
            for p in c.watched_pairs() {
                self.watch_pair(epfd, &p, &mut reg.pairs);
            }
        }
        self.wakers.insert(m.key(), reg);
        true
    }

    /// Puts one waker `fd` of member `m` in the kernel set, tagged `magic`, with
    /// events `ev`, and in `by_waker`.
    fn add_waker(&mut self, epfd: c_int, fd: c_int, magic: u64, ev: i32, m: &Socket) {
        let mut e = epoll_event { events: ev as u32, u64: magic | fd as u32 as u64 };
        // SAFETY: a local epoll_event. EEXIST (another descriptor of the same
        // connection) is fine.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut e) };
        self.by_waker.insert(fd, m.clone());
    }

    /// Puts pair `p`'s bell in the kernel set (edge-triggered, once per set) and
    /// counts one more member ringing through it (`counted`: the member's list).
    fn watch_pair(&mut self, epfd: c_int, p: &Arc<Pair>, counted: &mut Vec<c_int>) {
        let bell = p.my_bell();
        if counted.contains(&bell) {
            return;
        }
        counted.push(bell);
        let id = self.id;
        let e = self.pairs.entry(bell).or_insert_with(|| {
            let mut ev = epoll_event {
                events: (libc::EPOLLIN | libc::EPOLLET) as u32,
                u64: MAGIC_PAIR | bell as u32 as u64,
            };
            // SAFETY: a local epoll_event; the pair's eventfd.
            unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, bell, &mut ev) };
            p.register(ConsumerId(id));
            (p.clone(), 0)
        });
        e.1 += 1;
    }

    /// One member less rings through the pairs of `bells`: a pair no member rings
    /// through leaves the kernel set.
    fn unwatch_pairs(&mut self, epfd: c_int, bells: &[c_int]) {
        for bell in bells {
            let Some(e) = self.pairs.get_mut(bell) else { continue };
            e.1 -= 1;
            if e.1 == 0 {
                if let Some((p, _)) = self.pairs.remove(bell) {
                    p.unregister(ConsumerId(self.id));
                }
                let mut ev = epoll_event { events: 0, u64: 0 };
                // SAFETY: a local epoll_event.
                unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, *bell, &mut ev) };
            }
        }
    }

    /// A pending connector's pairs may have changed (a path-B asker got one):
    /// watches the new ones; once it settled, stops looking. True if it watches
    /// a bell it did not before.
    fn rewatch_settling(&mut self, epfd: c_int, key: usize) -> bool {
        let Some(reg) = self.wakers.get(&key) else { return false };
        if !reg.settling {
            return false;
        }
        let Socket::Tcp(c) = &reg.member else { return false };
        let c = c.clone();
        let member = reg.member.clone();
        let mut counted = reg.pairs.clone();
        let watched_before = counted.len();
        for p in c.watched_pairs() {
            self.watch_pair(epfd, &p, &mut counted);
        }
        // A connection to another host settled: its UDP socket rings like a bell.
        let link = c.remote_fd().filter(|u| !self.wakers.get(&key).is_some_and(|r| r.fds.contains(u)));
        if let Some(u) = link {
            self.add_waker(epfd, u, MAGIC_BELL, libc::EPOLLIN, &member);
        }
        let added = link.is_some() || counted.len() != watched_before;
        if let Some(reg) = self.wakers.get_mut(&key) {
            reg.pairs = counted;
            reg.fds.extend(link);
            reg.settling = c.awaiting_attach();
        }
        added
    }

    /// Pair bell `bell` rang: the members that rang (or, when the pair cannot
    /// tell, all of this set's members of the pair) may have changed.
    fn pair_rang(&mut self, bell: c_int) {
        let Some((p, _)) = self.pairs.get(&bell) else { return };
        match p.take(Some(ConsumerId(self.id))) {
            Rung::These(keys) => {
                for k in keys {
                    self.touch_key(k as usize);
                }
            }
            Rung::All => {
                let keys: Vec<usize> =
                    self.wakers.iter().filter(|(_, r)| r.pairs.contains(&bell)).map(|(&k, _)| k).collect();
                for k in keys {
                    self.touch_key(k);
                }
            }
        }
    }

    /// Takes the program's descriptor `fd` out of the kernel set where it watches
    /// `m`'s peer, before the program closes it or puts another file at its
    /// number (the kernel would keep the registration while the file lives on
    /// in another descriptor, under a number it may give to another file). The
    /// watch moves to `other`, another descriptor of the same connection, if the
    /// program has one (-1: none).
    fn unwatch(&mut self, epfd: c_int, m: &Socket, fd: c_int, other: c_int) {
        let Some(w) = self.wakers.get_mut(&m.key()).filter(|w| w.hup == fd) else { return };
        let mut e = epoll_event { events: 0, u64: 0 };
        // SAFETY: a local epoll_event; `fd` is still the connection's socket.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, &mut e) };
        self.by_waker.remove(&fd);
        w.fds.retain(|&f| f != fd);
        w.hup = -1;
        if other >= 0 {
            let mut e = epoll_event { events: libc::EPOLLRDHUP as u32, u64: MAGIC_HUP | other as u32 as u64 };
            // SAFETY: a local epoll_event; `other` is the program's descriptor of
            // the same connection.
            if unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, other, &mut e) } == 0 {
                w.hup = other;
                w.fds.push(other);
                self.by_waker.insert(other, m.clone());
            }
        }
    }

    /// Takes member `m` out: its entries, and its wakers (from the kernel set too).
    fn forget(&mut self, epfd: c_int, m: &Socket) {
        for i in self.of_member.get(&m.key()).cloned().unwrap_or_default() {
            self.remove(i);
        }
        if let Some(w) = self.wakers.remove(&m.key()) {
            self.unwatch_pairs(epfd, &w.pairs);
            del_wakers(epfd, &w.member, w.hup);
            for fd in w.fds {
                if self.by_waker.get(&fd).is_some_and(|x| x.same(m)) {
                    self.by_waker.remove(&fd);
                }
            }
        }
    }
}

static SETS_LIVE: AtomicUsize = AtomicUsize::new(0);
/// The sets are looked up on every `epoll_wait`, where SipHash cost more than the
/// rest of a zero-timeout call.
type Sets = IntMap<c_int, EpSet>;

static SETS: Mutex<Option<Sets>> = Mutex::new(None);

fn sets() -> std::sync::MutexGuard<'static, Option<Sets>> {
    SETS.lock().unwrap_or_else(|e| e.into_inner())
}

fn del_wakers(epfd: c_int, c: &Socket, hup: c_int) {
    let Some(w) = wakers(c, hup) else { return };
    for (fd, _, _) in w {
        let mut e = epoll_event { events: 0, u64: 0 };
        // SAFETY: a local epoll_event.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, &mut e) };
    }
}

/// `epoll_ctl` on an accelerated descriptor (never handed to the kernel set).
/// True if `epfd` is an epoll descriptor (asked once per set, not per call).
fn is_epoll(epfd: c_int) -> bool {
    strait_sys::procfs::fd_kind(epfd).is_some_and(|l| l == b"anon_inode:[eventpoll]")
}

pub fn ctl(epfd: c_int, op: c_int, fd: c_int, conn: Arc<Conn>, ev: *const epoll_event) -> c_int {
    ctl_member(epfd, op, fd, Socket::Tcp(conn), ev)
}

/// `epoll_ctl` on a strait UDP socket, after the kernel set took the socket itself.
pub fn ctl_udp(epfd: c_int, op: c_int, fd: c_int, u: Arc<UdpSock>, ev: *const epoll_event) {
    ctl_member(epfd, op, fd, Socket::Udp(u), ev);
}

fn ctl_member(epfd: c_int, op: c_int, fd: c_int, conn: Socket, ev: *const epoll_event) -> c_int {
    // The first time a set meets an accelerated descriptor, check it is a set (the
    // calls on it after that cost no system call unless wakers come or go).
    let known = sets().as_ref().is_some_and(|m| m.contains_key(&epfd));
    if !known && !is_epoll(epfd) {
        // SAFETY: plain fcntl to tell EBADF from EINVAL.
        let bad = unsafe { real::fcntl(epfd, libc::F_GETFD, 0) } < 0;
        real::set_errno(if bad { libc::EBADF } else { libc::EINVAL });
        return -1;
    }
    // Counted before the sets' lock is taken: no file reading under it.
    let kernel_members = if known { None } else { count_kernel_members(epfd) };
    let (events, data) = if ev.is_null() {
        (0, 0)
    } else {
        // SAFETY: the caller's event (read unaligned: epoll_event is packed on x86-64).
        let e = unsafe { std::ptr::read_unaligned(ev) };
        (e.events, e.u64)
    };
    let mut g = sets();
    let map = g.get_or_insert_with(Sets::default);
    let set = map.entry(epfd).or_insert_with(|| EpSet {
        // `None` if the set was known and has gone since (closed by another thread).
        kernel_members,
        forks_at_join: FORKS.load(Ordering::Relaxed),
        id: SET_IDS.fetch_add(1, Ordering::Relaxed),
        ..EpSet::default()
    });
    SETS_KNOWN.store(true, Ordering::Relaxed);
    let pos = set.by_fd.get(&fd).copied();
    match op {
        libc::EPOLL_CTL_ADD => {
            if pos.is_some() {
                real::set_errno(libc::EEXIST);
                return -1;
            }
            if !set.wakers.contains_key(&conn.key()) && !set.add_wakers(epfd, &conn, fd) {
                set.pending_udp = true;
            }
            let settling = matches!(&conn, Socket::Tcp(c) if c.awaiting_attach());
            set.insert(Entry {
                fd,
                conn,
                events,
                data,
                last_bits: 0,
                last_rx: 0,
                last_tx: 0,
                disabled: false,
                dirty: false,
                armed: false,
                settling,
            });
        }
        libc::EPOLL_CTL_MOD => {
            let Some(i) = pos else {
                real::set_errno(libc::ENOENT);
                return -1;
            };
            if let Some(e) = set.entry(i) {
                e.events = events;
                e.data = data;
                e.last_bits = 0;
                e.disabled = false;
            }
            set.mark(i);
        }
        libc::EPOLL_CTL_DEL => {
            let Some(i) = pos else {
                real::set_errno(libc::ENOENT);
                return -1;
            };
            set.remove(i);
        }
        _ => {
            real::set_errno(libc::EINVAL);
            return -1;
        }
    }
    let n = map.values().filter(|s| s.live()).count();
    SETS_LIVE.store(n, Ordering::Relaxed);
    0
}

/// The members of kernel set `epfd` (its `/proc` entry lists one `tfd:` line per
/// member); `None` if it cannot be read.
fn count_kernel_members(epfd: c_int) -> Option<usize> {
    // (Large enough for every member of a set the library would count at all.)
    let info = strait_sys::procfs::read(&format!("self/fdinfo/{epfd}"), 16 << 20)?;
    Some(info.split(|&b| b == b'\n').filter(|l| l.starts_with(b"tfd:")).count())
}

/// True once some set is known: [`note_kernel_ctl`] must then hear of the
/// program's `epoll_ctl` calls on descriptors we do not carry.
pub fn sets_known() -> bool {
    SETS_KNOWN.load(Ordering::Relaxed)
}

/// The program's `epoll_ctl(epfd, op, ..)` on a descriptor we do not carry
/// returned `result`: counts the set's kernel members.
pub fn note_kernel_ctl(epfd: c_int, op: c_int, result: c_int) {
    if result != 0 || (op != libc::EPOLL_CTL_ADD && op != libc::EPOLL_CTL_DEL) {
        return;
    }
    let mut g = sets();
    let Some(set) = g.as_mut().and_then(|m| m.get_mut(&epfd)) else { return };
    set.kernel_members =
        set.kernel_members.map(|n| if op == libc::EPOLL_CTL_ADD { n + 1 } else { n.saturating_sub(1) });
}

/// After a fork, in both processes: every set known now is shared with the other
/// process, so its kernel members are no longer known.
pub fn after_fork() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// The connection's last descriptor was closed: the kernel would drop it from every
/// epoll set.
pub fn forget_conn(conn: &Arc<Conn>) {
    forget_member(&Socket::Tcp(conn.clone()));
}

/// The program is about to close its descriptor `fd` of `conn` (or to put another
/// file at its number): wherever it watches the peer's hang-up, the watch moves
/// to another of the program's descriptors of the connection (`other_fd` finds
/// one, asked only if needed), or ends with the last.
pub fn hup_fd_closing(fd: c_int, conn: &Arc<Conn>, other_fd: &dyn Fn() -> Option<c_int>) {
    if SETS_LIVE.load(Ordering::Relaxed) == 0 || !conn.watched_by_socket() {
        return;
    }
    let m = Socket::Tcp(conn.clone());
    let mut g = sets();
    let Some(map) = g.as_mut() else { return };
    let mut other: Option<c_int> = None;
    for (&epfd, set) in map.iter_mut() {
        if set.wakers.get(&m.key()).is_some_and(|w| w.hup == fd) {
            // (Not the last descriptor: `fdrefs` still counts `fd`.)
            let last = conn.fdrefs.load(Ordering::Acquire) <= 1;
            let to = *other.get_or_insert_with(|| if last { -1 } else { other_fd().unwrap_or(-1) });
            set.unwatch(epfd, &m, fd, to);
        }
    }
}

/// A UDP socket's last descriptor was closed.
pub fn forget_udp(u: &Arc<UdpSock>) {
    forget_member(&Socket::Udp(u.clone()));
}

fn forget_member(conn: &Socket) {
    if SETS_LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut g = sets();
    if let Some(map) = g.as_mut() {
        for (&epfd, set) in map.iter_mut() {
            set.forget(epfd, conn);
        }
        let n = map.values().filter(|s| s.live()).count();
        SETS_LIVE.store(n, Ordering::Relaxed);
    }
}

/// A connection went back to the kernel after it joined epoll sets: its socket
/// joins the kernel sets in its place, with the same events and data.
pub fn to_kernel(conn: &Arc<Conn>) {
    if SETS_LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let m = Socket::Tcp(conn.clone());
    let joins: Vec<(c_int, c_int, epoll_event)> = sets()
        .as_ref()
        .map(|map| {
            map.iter()
                .flat_map(|(&epfd, set)| {
                    set.entries().filter(|e| e.conn.same(&m)).map(move |e| {
                        (
                            epfd,
                            e.fd,
                            epoll_event { events: if e.disabled { 0 } else { e.events }, u64: e.data },
                        )
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    // Our wakers leave first: one of them may be the very socket, registered for
    // the peer's hang-up, which the kernel would not take twice.
    forget_member(&m);
    for (epfd, fd, mut ev) in joins {
        // SAFETY: a local epoll_event; the program's descriptor and set.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) };
        // The socket is a kernel member now (counted even if the kernel refused it:
        // counting one too many costs only a system call).
        note_kernel_ctl(epfd, libc::EPOLL_CTL_ADD, 0);
    }
}

/// `close(epfd)`.
pub fn forget_set(epfd: c_int) {
    if SETS_LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut g = sets();
    if let Some(map) = g.as_mut() {
        // (Counted again only when a set went: every close of a descriptor that
        // is no epoll set passes here.)
        if let Some(set) = map.remove(&epfd) {
            for (p, _) in set.pairs.values() {
                p.unregister(ConsumerId(set.id));
            }
            let n = map.values().filter(|s| s.live()).count();
            SETS_LIVE.store(n, Ordering::Relaxed);
        }
    }
}

/// What entry `e` reports now (`arrivals`: see [`Socket::readiness`]).
fn evaluate(e: &mut Entry, arrivals: bool) -> i16 {
    let r = e.conn.readiness(e.fd, arrivals);
    let mask = (e.events as i16) | libc::POLLHUP | libc::POLLERR;
    let bits = r.bits & mask;
    if e.events & libc::EPOLLET as u32 == 0 {
        return bits;
    }
    let mut fresh = bits & !(libc::POLLIN | libc::POLLOUT) & !e.last_bits;
    if bits & libc::POLLIN != 0 && (e.last_bits & libc::POLLIN == 0 || r.rx_tail != e.last_rx) {
        fresh |= libc::POLLIN;
    }
    if bits & libc::POLLOUT != 0 && (e.last_bits & libc::POLLOUT == 0 || r.tx_head != e.last_tx) {
        fresh |= libc::POLLOUT;
    }
    e.last_bits = r.bits;
    e.last_rx = r.rx_tail;
    e.last_tx = r.tx_head;
    fresh
}

/// Ready accelerated members (level- or edge-triggered, one-shot), at most `max`.
/// Only dirty entries are looked at; an entry found not ready is armed (its
/// sleeping flags set, then looked at once more, closing the race with the peer).
fn collect(epfd: c_int, set: &mut EpSet, out: &mut Vec<epoll_event>, max: usize) {
    // Each queued entry at most once per call: those that stay queued go to the back.
    for _ in 0..set.queue.len() {
        if out.len() >= max {
            break;
        }
        let Some((i, gen)) = set.queue.pop_front() else { break };
        let Some(slot) = set.entries.get_mut(i) else { continue };
        if slot.gen != gen {
            continue;
        }
        let Some(e) = slot.entry.as_mut() else { continue };
        if !e.dirty {
            continue;
        }
        if e.disabled {
            // Out of the queue until EPOLL_CTL_MOD queues it again.
            e.dirty = false;
            continue;
        }
        // A connection to another host whose UDP socket this set's kernel half
        // watches (level-triggered) is not asked for arrivals: that socket's bell
        // moves them in. One look at the kernel for the whole set instead of a
        // `recvmmsg` per connection per evaluation (redis with 10 clients across two
        // hosts made 5 a request, most of them empty).
        let watched = match &e.conn {
            Socket::Tcp(c) => c
                .remote_fd()
                .is_some_and(|u| set.wakers.get(&e.conn.key()).is_some_and(|r| r.fds.contains(&u))),
            _ => false,
        };
        let mut bits = evaluate(e, !watched);
        if bits == 0 && !e.armed {
            e.conn.announce(e.events & libc::EPOLLIN as u32 != 0, e.events & libc::EPOLLOUT as u32 != 0);
            e.armed = true;
            bits = evaluate(e, !watched);
        }
        let level = e.events & libc::EPOLLET as u32 == 0;
        if bits != 0 {
            out.push(epoll_event { events: bits as u16 as u32, u64: e.data });
            if e.events & libc::EPOLLONESHOT as u32 != 0 {
                e.disabled = true;
            }
        }
        // Level-triggered entries that were ready stay queued (still ready next time
        // unless drained); others wait for their bell, armed. A connector still
        // waiting for its acceptor is looked at every time (its deadline rings no
        // bell).
        // (After the look: a path-B asker served in it got a pair of its own.)
        let awaiting = matches!(&e.conn, Socket::Tcp(c) if c.awaiting_attach());
        let settling = std::mem::replace(&mut e.settling, awaiting);
        let key = e.conn.key();
        let mut stay = (bits != 0 && level) || awaiting;
        if !stay && !e.armed {
            e.conn.announce(e.events & libc::EPOLLIN as u32 != 0, e.events & libc::EPOLLOUT as u32 != 0);
            e.armed = true;
            // A change between the evaluation and the arming rang no bell.
            stay = true;
        }
        e.dirty = stay;
        if stay {
            // Behind the others: a set with more ready entries than `max` reports
            // them all in turn.
            set.queue.push_back((i, gen));
        }
        if settling && set.rewatch_settling(epfd, key) {
            // A bell watched only now may have rung before: looked at once more.
            set.mark(i);
        }
    }
}

/// What one pass over a set found.
struct Gathered {
    /// Our ready members' events.
    ready: Vec<epoll_event>,
    /// The earliest attach deadline of a pending connector (only for a call that
    /// may sleep and found nothing).
    attach: Option<Instant>,
    /// The kernel set need not be asked ([`EpSet::may_skip_kernel`]).
    skip_kernel: bool,
}

/// One pass over a live set: UDP members bound since they were added get their
/// wakers, then what is ready (looked at twice when nothing is: entries armed by
/// the first look are dirty once more), if `may_sleep` and nothing is, the
/// earliest attach deadline of a pending connector, and for a zero-timeout call
/// without a signal mask (`may_skip`) whether the kernel set must be asked. `None` if
/// the set has no accelerated member.
fn gather(epfd: c_int, set: &mut EpSet, max: usize, may_sleep: bool, may_skip: bool) -> Option<Gathered> {
    if !set.live() {
        return None;
    }
    if set.pending_udp {
        set.pending_udp = false;
        let members: Vec<(Socket, c_int)> = set.entries().map(|e| (e.conn.clone(), e.fd)).collect();
        for (m, fd) in members {
            if !set.wakers.contains_key(&m.key()) && !set.add_wakers(epfd, &m, fd) {
                set.pending_udp = true;
            }
        }
    }
    let answered = may_skip && set.queue_rung();
    let mut acc = Vec::new();
    collect(epfd, set, &mut acc, max);
    if acc.is_empty() {
        collect(epfd, set, &mut acc, max);
    }
    let attach = if acc.is_empty() && may_sleep && crate::conn::any_awaiting_attach() {
        set.entries()
            .filter_map(|e| match &e.conn {
                Socket::Tcp(c) => c.attach_deadline(),
                _ => None,
            })
            .min()
    } else {
        None
    };
    let skip_kernel = may_skip && set.may_skip_kernel(!acc.is_empty(), answered);
    Some(Gathered { ready: acc, attach, skip_kernel })
}

fn with_set<T>(epfd: c_int, f: impl FnOnce(&mut EpSet) -> T) -> Option<T> {
    let mut g = sets();
    g.as_mut().and_then(|m| m.get_mut(&epfd)).map(f)
}

/// The kernel's `epoll_pwait` (`epoll_wait` without `mask`) for `ms` milliseconds
/// (-1: no bound). It sleeps in `epoll_wait` itself unless the teardown of an
/// io_uring instance this process used (the vault's) may still come: that
/// interrupts `epoll_wait` with EINTR though no signal came
/// ([`crate::vault::direct_wait`]). Then it sleeps in `poll` (`ppoll` with a mask)
/// on the set, which the kernel restarts then and fails with EINTR only when a
/// signal handler ran, as `epoll_wait` would without strait, and takes the events
/// without sleeping (one system call more). Either sleep is cut into slices in a
/// process that made a ring (a ring's close waits for the direct sleepers).
///
/// # Safety
/// `events` has room for `max` entries.
pub(crate) unsafe fn kernel_wait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    ms: c_int,
    mask: Option<*const sigset_t>,
) -> c_int {
    let timeout = u64::try_from(ms).ok().map(Duration::from_millis);
    // SAFETY: the caller's contract.
    unsafe { kernel_wait_for(epfd, events, max, timeout, mask) }
}

/// `epoll_pwait2` failed as a call the kernel or a seccomp filter does not allow.
static PWAIT2_REFUSED: AtomicBool = AtomicBool::new(false);

/// [`kernel_wait`] for exactly `timeout` (`None`: no bound): a part of a
/// millisecond is slept as such (`epoll_pwait2`, `ppoll`), not rounded up, so a
/// wait that spun first ends when the program's timeout does (it ran late by the
/// spin: an event loop's 1 ms timers fired after 1.19 ms instead of the kernel's
/// 1.12).
///
/// # Safety
/// `events` has room for `max` entries.
pub(crate) unsafe fn kernel_wait_for(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: Option<Duration>,
    mask: Option<*const sigset_t>,
) -> c_int {
    // SAFETY (every call): the caller's buffer of `max` entries.
    let now = |t: Option<Duration>| unsafe {
        let ms = t.map_or(-1, |t| c_int::try_from(t.as_micros().div_ceil(1000)).unwrap_or(c_int::MAX));
        let exact = t.filter(|t| !t.subsec_nanos().is_multiple_of(1_000_000));
        if let Some(t) = exact.filter(|_| !PWAIT2_REFUSED.load(Ordering::Relaxed)) {
            let ts = crate::wait::timespec(t);
            let r = real::epoll_pwait2(epfd, events, max, &ts, mask.unwrap_or(std::ptr::null()));
            let e = real::errno();
            if r >= 0 || !matches!(e, libc::ENOSYS | libc::EPERM | libc::EACCES) {
                return r;
            }
            // An older kernel, or a seccomp filter that knows only the older calls
            // (systemd's `SystemCallFilter=` lists, sandboxes): those from now on.
            PWAIT2_REFUSED.store(true, Ordering::Relaxed);
        }
        match mask {
            None => real::epoll_wait(epfd, events, max, ms),
            Some(m) => real::epoll_pwait(epfd, events, max, ms, m),
        }
    };
    if timeout == Some(Duration::ZERO) {
        return now(timeout);
    }
    // What is left of the timeout (`None`: none), counted down by the slices that
    // ran out (a slice that times out slept at least its length): the usual sleep
    // reads no clock. Only a pass that ends early without events (another thread
    // took them) reads it, around that pass.
    let mut left = timeout;
    loop {
        let slice = left.map_or(crate::wait::SLICE, |l| l.min(crate::wait::SLICE));
        let slept = match crate::vault::direct_wait() {
            Some(direct) if !direct.holds_back_closes() => return now(left),
            Some(direct) => {
                let r = now(Some(slice));
                drop(direct);
                if r != 0 {
                    return r;
                }
                slice
            }
            None => {
                let began = Instant::now();
                let mut set = [libc::pollfd { fd: epfd, events: libc::POLLIN, revents: 0 }];
                let r = crate::wait::kernel_poll_for(&mut set, slice, mask);
                if r < 0 {
                    return r;
                }
                if r == 0 {
                    slice
                } else {
                    // (No mask here: the wait that could deliver signals is over.)
                    // SAFETY: the caller's buffer of `max` entries.
                    let n = unsafe { real::epoll_wait(epfd, events, max, 0) };
                    if n != 0 {
                        return n;
                    }
                    // Another thread took the events: sleep on for the rest.
                    began.elapsed()
                }
            }
        };
        if let Some(l) = &mut left {
            *l = l.saturating_sub(slept);
            if l.is_zero() {
                return 0;
            }
        }
    }
}

thread_local! {
    /// How long this thread's `epoll_wait`s spin before they sleep (an event loop
    /// is a thread): adaptive, as a blocked read's ([`crate::settings::spin_policy`]).
    static SPIN: std::cell::OnceCell<strait_core::spin::SpinPolicy> = const { std::cell::OnceCell::new() };
}

/// `epoll_wait`/`epoll_pwait` on a set with accelerated members; `None`: none.
///
/// A wait that finds nothing ready spins first, as long as spinning pays (the
/// thread's [`strait_core::spin::SpinPolicy`]: none while the machine has more
/// runnable threads than cores), looking at the set as a zero-timeout call does
/// (the kernel set within its bounds), then sleeps. Two event loops that answer
/// each other (a server and its load generator, one core each) then neither sleep
/// nor pay the other's wake-up, which on a VM costs more than the request: nginx's
/// worker spent a quarter of its time in the `eventfd_write` that woke wrk.
/// Signals are blocked while it spins and let through by the sleep's own mask
/// (`epoll_pwait`), so a signal that comes meanwhile still ends the wait with
/// EINTR, as the kernel's would (a handler that only sets a flag relies on it).
///
/// # Safety
/// `events` has room for `max` entries.
pub unsafe fn wait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: Option<Duration>,
    mask: Option<*const sigset_t>,
) -> Option<c_int> {
    if timeout == Some(Duration::ZERO) || mask.is_some() {
        // SAFETY: the caller's contract.
        return unsafe { wait_once(epfd, events, max, timeout, mask) };
    }
    // A first look without spinning: not one of ours, or something ready.
    // SAFETY: the caller's contract.
    let ours = match unsafe { wait_once(epfd, events, max, Some(Duration::ZERO), None) } {
        Some(0) => true,
        None => false,
        other => return other,
    };
    if !ours {
        // SAFETY: the caller's contract.
        return unsafe { wait_kernel_set(epfd, events, max, timeout) };
    }
    spin_then_sleep(
        timeout,
        Looks { per_clock: 8, per_signal_check: 64 },
        // SAFETY: the caller's contract.
        || unsafe { wait_once(epfd, events, max, Some(Duration::ZERO), None) },
        // SAFETY: the caller's contract; the mask is the thread's own, saved.
        |rest, mask| unsafe { wait_once(epfd, events, max, rest, mask) },
    )
}

/// `epoll_wait` on a set of the kernel's alone (no accelerated member), spinning
/// first as [`wait`] does on ours: each turn a zero-timeout `epoll_wait`. A server
/// whose connections stay on the kernel (a connection per request) and its client
/// then answer each other without sleeping, and without the wake-up that each of
/// them would otherwise pay the other. `None`: not spun (the caller's `epoll_wait`
/// goes to the kernel as it is).
///
/// # Safety
/// `events` has room for `max` entries.
unsafe fn wait_kernel_set(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: Option<Duration>,
) -> Option<c_int> {
    if max <= 0 {
        return None;
    }
    spin_then_sleep(
        timeout,
        // Each look is a system call: the clock at every one.
        Looks { per_clock: 1, per_signal_check: 16 },
        // SAFETY: the caller's buffer of `max` entries.
        || Some(unsafe { real::epoll_wait(epfd, events, max, 0) }),
        |rest, mask| {
            // Not spun: the caller's own call.
            let mask = mask?;
            // SAFETY: the caller's buffer; the thread's own saved mask.
            Some(unsafe { kernel_wait_for(epfd, events, max, rest, Some(mask)) })
        },
    )
}

/// How often a spin does its slower checks, in looks at the set.
struct Looks {
    /// Looks per clock reading (and yield of the core: [`give_way`]).
    per_clock: u32,
    /// Looks per check for a signal held back (a system call).
    per_signal_check: u32,
}

/// The spin of a wait that found nothing ready, then its sleep: `look` (a
/// zero-timeout look at the set; any answer but `Some(0)` ends the spin and is the
/// wait's) for as long as the thread's budget allows, signals held meanwhile; then
/// `sleep(rest of the timeout, the saved mask to sleep with)`. With no budget (or
/// no way to hold signals) it only sleeps, with no mask.
fn spin_then_sleep(
    timeout: Option<Duration>,
    looks: Looks,
    mut look: impl FnMut() -> Option<c_int>,
    sleep: impl FnOnce(Option<Duration>, Option<*const sigset_t>) -> Option<c_int>,
) -> Option<c_int> {
    let start = Instant::now();
    let budget = spin_budget(start);
    let unblocked = if budget.is_zero() { None } else { crate::sigmask::block_all() };
    let Some(unblocked) = unblocked else { return sleep(timeout, None) };
    let mut turns = 0u32;
    let caught = loop {
        match look() {
            Some(0) => {}
            other => break other,
        }
        turns = turns.wrapping_add(1);
        // A signal that came meanwhile ends the spin (the sleep then delivers it and
        // the wait ends with EINTR, a few microseconds after the kernel's would).
        if turns.is_multiple_of(looks.per_clock) {
            if Instant::now() >= start + budget {
                break Some(0);
            }
            give_way();
        }
        if turns.is_multiple_of(looks.per_signal_check) && unblocked.signal_waits() {
            break Some(0);
        }
        std::hint::spin_loop();
    };
    let r = match caught {
        Some(0) => {
            // Nothing came: sleep for the rest of the timeout, signals let through.
            let r = sleep(timeout.map(|t| t.saturating_sub(start.elapsed())), Some(unblocked.as_ptr()));
            record_spin(start, true, r);
            r
        }
        other => {
            record_spin(start, false, other);
            other
        }
    };
    drop(unblocked);
    r
}

/// Lets a thread that waits for this core run (each look at the clock of a spin:
/// every few hundred nanoseconds). With more busy threads than cores (nginx's two
/// workers and wrk on two) a spinner would otherwise keep the core that the thread
/// with the work needs until the scheduler takes it: wrk's p99 went from 0.2 to 3.5
/// ms with no yield, to 0.9-2.4 ms with this one (see docs/PERFORMANCE.md section
/// 41: a spinner still pays for the time it ran when it has work again). Alone on
/// its core, `sched_yield` returns at once (0.26 us here).
fn give_way() {
    // SAFETY: plain system call.
    unsafe { libc::sched_yield() };
}

/// The spin budget of an `epoll_wait` starting `now` (zero while the machine is
/// crowded).
fn spin_budget(now: Instant) -> Duration {
    SPIN.with(|s| {
        let s = s.get_or_init(crate::settings::spin_policy);
        s.next_budget(s.is_adaptive() && crate::settings::crowded(now))
    })
}

/// Teaches the thread's spin policy how a wait that spun ended (one that failed,
/// e.g. interrupted, says nothing about the peers).
fn record_spin(start: Instant, slept: bool, r: Option<c_int>) {
    if matches!(r, Some(n) if n > 0) {
        let waited = start.elapsed();
        SPIN.with(|s| {
            if let Some(s) = s.get() {
                s.record(strait_core::spin::WaitOutcome { waited, slept });
            }
        });
    }
}

/// One `epoll_wait` as the program asked it, without a spin.
///
/// # Safety
/// `events` has room for `max` entries.
unsafe fn wait_once(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: Option<Duration>,
    mask: Option<*const sigset_t>,
) -> Option<c_int> {
    if SETS_LIVE.load(Ordering::Relaxed) == 0 || max <= 0 {
        return None;
    }
    let max = max as usize;
    // A zero timeout (an event loop polling): one pass, and no deadline (it never
    // sleeps), so no clock reading unless it may leave the kernel set unasked. Else
    // the deadline is taken once the set proved to be one of ours (a set without
    // accelerated members goes to the kernel without a clock reading).
    let mut deadline: Option<Instant> = None;
    let poll_only = timeout == Some(Duration::ZERO);
    // Not with a signal mask: the system call is also where signals the mask lets
    // through are delivered (and the call then fails with EINTR).
    let may_skip = poll_only && mask.is_none();
    let mut first = true;
    loop {
        // One visit to the set per pass (each is a lock and a look-up): what is
        // ready, and when the earliest pending connector decides (only if this call
        // may sleep).
        let now_due = poll_only || (!first && remaining(deadline) == Some(Duration::ZERO));
        let Gathered { ready: mut acc, attach, skip_kernel } =
            match with_set(epfd, |set| gather(epfd, set, max, !now_due, may_skip)) {
                Some(Some(g)) => g,
                // Not one of ours (any more), or nothing accelerated in it: the kernel's.
                _ if first => return None,
                _ => Gathered { ready: Vec::new(), attach: None, skip_kernel: false },
            };
        if first {
            deadline = timeout.filter(|t| !t.is_zero()).map(|t| Instant::now() + t);
        }
        if skip_kernel {
            break finish(events, 0, &acc);
        }
        let sleep = acc.is_empty() && !poll_only && (first || !now_due);
        first = false;
        let room = max - acc.len();
        let nap = if sleep { slice_left(deadline, attach.into_iter()) } else { Duration::ZERO };
        // Kernel events go straight into the caller's buffer (no copy of a possibly
        // huge maxevents array); ours are appended after them.
        let r = if room == 0 {
            0
        } else {
            // SAFETY: the caller's buffer has room for `max >= room` entries.
            unsafe { kernel_wait_for(epfd, events, room as c_int, Some(nap), mask) }
        };
        if r < 0 {
            if !acc.is_empty() {
                break finish(events, 0, &acc);
            }
            return Some(-1);
        }
        let mut kernel = 0usize;
        let mut woke = false;
        for i in 0..r as usize {
            // SAFETY: the kernel filled `r` entries (read unaligned: packed struct).
            let e = unsafe { std::ptr::read_unaligned(events.add(i)) };
            let data = e.u64;
            let fd = (data & 0xffff_ffff) as c_int;
            if data & MAGIC_MASK == MAGIC_BELL {
                woke = true;
                with_set(epfd, |set| {
                    if let Some(c) = set.by_waker.get(&fd).cloned() {
                        match set.wakers.get(&c.key()).map(|r| r.quiet_bell) {
                            // Its eventfd, edge-triggered: whoever rang it moved
                            // arrivals into the ring; the look below finds them.
                            Some(q) if q == fd => {}
                            // Its UDP socket: arrivals to move in (the eventfd is not
                            // read).
                            Some(q) if q >= 0 => c.pump(),
                            _ => c.drain_bell(),
                        }
                        set.touch(&c);
                    }
                });
            } else if data & MAGIC_MASK == MAGIC_PAIR {
                woke = true;
                with_set(epfd, |set| set.pair_rang(fd));
            } else if data & MAGIC_MASK == MAGIC_MARK {
                woke = true;
                with_set(epfd, |set| {
                    if let Some(m) = set.by_waker.get(&fd).cloned() {
                        if let Socket::Udp(u) = &m {
                            u.pump();
                            set.touch(&m);
                        }
                    }
                });
            } else if data & MAGIC_MASK == MAGIC_HUP {
                woke = true;
                with_set(epfd, |set| {
                    if let Some(m) = set.by_waker.get(&fd).cloned() {
                        let Socket::Tcp(c) = &m else { return };
                        // A hang-up stays reported (level-triggered), or every wait
                        // would return at once: once the peer is known gone (the
                        // connection remembers), its watch leaves the kernel set,
                        // and a connection without entries leaves it altogether.
                        if c.hung_up(e.events as i16) && c.watched_by_socket() {
                            set.unwatch(epfd, &m, fd, -1);
                        }
                        if set.of_member.contains_key(&m.key()) {
                            set.touch(&m);
                        } else {
                            set.forget(epfd, &m);
                        }
                    }
                });
            } else {
                // SAFETY: compacting in place, `kernel <= i`.
                unsafe { std::ptr::write_unaligned(events.add(kernel), e) };
                kernel += 1;
            }
        }
        // After a sleep (or a poll that found nothing of ours), look at what the bells
        // marked (nothing was reported yet in this call, so no entry is reported twice).
        if (sleep || poll_only) && acc.is_empty() && (woke || kernel > 0) {
            let left = max - acc.len() - kernel.min(max - acc.len());
            let mut more = Vec::new();
            with_set(epfd, |set| collect(epfd, set, &mut more, left));
            acc.extend(more);
        }
        if !acc.is_empty() || kernel > 0 || !sleep || remaining(deadline) == Some(Duration::ZERO) {
            break finish(events, kernel, &acc);
        }
    }
}

fn finish(events: *mut epoll_event, kernel: usize, acc: &[epoll_event]) -> Option<c_int> {
    let mut n = kernel;
    'next: for e in acc {
        // A UDP socket the kernel reported too (kernel datagrams): one event.
        for i in 0..kernel {
            // SAFETY: the kernel filled `kernel` entries (read unaligned: packed struct).
            let mut k = unsafe { std::ptr::read_unaligned(events.add(i)) };
            if k.u64 == e.u64 {
                k.events |= e.events;
                // SAFETY: as above.
                unsafe { std::ptr::write_unaligned(events.add(i), k) };
                continue 'next;
            }
        }
        // SAFETY: the caller's buffer has room for `max` entries and we produce at
        // most that many (kernel events were limited to the room left).
        unsafe { std::ptr::write_unaligned(events.add(n), *e) };
        n += 1;
    }
    Some(n as c_int)
}

#[cfg(test)]
mod tests {
    /// The teardown of an io_uring instance this thread made sends it task work,
    /// which makes a blocking `epoll_wait` fail with EINTR though no signal came
    /// (10 times in 10 on Linux 6.18, right after the vault dropped its ring): the
    /// shims' kernel wait sleeps restartably (`ppoll`) until the ring's sentinel
    /// says the teardown has happened, and times out as it should.
    #[test]
    fn a_torn_down_vault_ring_does_not_interrupt_an_epoll_wait() {
        let _g = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..5 {
            // Eight connections' memfds kept and let go: the last release finds
            // the ring empty and drops it.
            for _ in 0..8 {
                let m = strait_sys::sealed_memfd(c"epoll-test", 4096)
                    .map(std::os::fd::IntoRawFd::into_raw_fd)
                    .expect("memfd");
                let k = crate::vault::keep(m);
                // SAFETY: our memfd (the vault holds its own reference).
                unsafe { libc::close(m) };
                crate::vault::release(k);
            }
            if !crate::vault::made_any() {
                return; // io_uring refused here: nothing to interrupt.
            }
            // SAFETY: plain syscalls on a fresh epoll set; a local event array.
            unsafe {
                let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
                assert!(ep >= 0);
                let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
                let t = std::time::Instant::now();
                let n = super::kernel_wait(ep, ev.as_mut_ptr(), 4, 30, None);
                let e = std::io::Error::last_os_error();
                libc::close(ep);
                assert_eq!(n, 0, "an empty set times out, no EINTR: {e}");
                assert!(t.elapsed() >= std::time::Duration::from_millis(25), "slept its timeout");
            }
        }
    }

    /// In a process that made a vault ring, a direct sleep is cut into slices of
    /// [`crate::wait::SLICE`] and counts down what is left by the slices that ran
    /// out (no clock reading): a timeout longer than a slice is slept whole, not
    /// cut short at the first slice nor restarted at each.
    #[test]
    fn a_wait_of_part_of_a_millisecond_sleeps_that_part_not_a_whole_one() {
        use std::time::{Duration, Instant};
        let _g = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        // What is left of a program's timeout after a spin is rarely whole
        // milliseconds; rounded up to one, each such wait ran late by up to a
        // millisecond. Twenty waits of 1.5 ms on an empty set, both ways the
        // kernel sleeps (directly, and in `poll` while a ring's teardown may come).
        let timeout = Duration::from_micros(1500);
        for ring_live in [false, true] {
            let k = ring_live.then(|| {
                let m = strait_sys::sealed_memfd(c"epoll-test", 4096)
                    .map(std::os::fd::IntoRawFd::into_raw_fd)
                    .expect("memfd");
                let k = crate::vault::keep(m);
                // SAFETY: our memfd (the vault holds its own reference).
                unsafe { libc::close(m) };
                k
            });
            // SAFETY: plain syscalls on a fresh epoll set; a local event array.
            let mut slept: Vec<Duration> = unsafe {
                let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
                assert!(ep >= 0);
                let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
                let slept = (0..20)
                    .map(|_| {
                        let t = Instant::now();
                        let n = super::kernel_wait_for(ep, ev.as_mut_ptr(), 4, Some(timeout), None);
                        assert_eq!(n, 0, "an empty set times out");
                        t.elapsed()
                    })
                    .collect();
                libc::close(ep);
                slept
            };
            if let Some(k) = k {
                crate::vault::release(k);
            }
            slept.sort();
            // Never early (the kernel's guarantee), and not a whole 2 ms.
            assert!(
                slept[0] >= timeout,
                "ring {ring_live}: a wait of {timeout:?} ended after {:?}",
                slept[0]
            );
            assert!(
                slept[10] < Duration::from_micros(1900),
                "ring {ring_live}: median {:?}: {slept:?}",
                slept[10]
            );
        }
    }

    #[test]
    fn a_wait_longer_than_a_slice_sleeps_its_whole_timeout() {
        use std::time::{Duration, Instant};
        let _g = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let m = strait_sys::sealed_memfd(c"epoll-test", 4096)
            .map(std::os::fd::IntoRawFd::into_raw_fd)
            .expect("memfd");
        let k = crate::vault::keep(m);
        // SAFETY: our memfd (the vault holds its own reference).
        unsafe { libc::close(m) };
        let timeout = crate::wait::SLICE + Duration::from_millis(300);
        // SAFETY: plain syscalls on a fresh epoll set; a local event array.
        let (n, slept) = unsafe {
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            assert!(ep >= 0);
            let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
            let t = Instant::now();
            let n = super::kernel_wait(ep, ev.as_mut_ptr(), 4, timeout.as_millis() as libc::c_int, None);
            let slept = t.elapsed();
            libc::close(ep);
            (n, slept)
        };
        crate::vault::release(k);
        assert_eq!(n, 0, "an empty set times out");
        assert!(slept >= timeout, "slept {slept:?} of a {timeout:?} timeout");
        assert!(slept < 2 * timeout, "slept {slept:?}: the slices did not count down a {timeout:?} timeout");
    }

    /// A ring closed by one thread while another thread that used it sleeps in
    /// `epoll_wait` directly: the close waits for that sleep to end (else the
    /// teardown's task work would make it fail with EINTR, as it did 10 times in
    /// 10 when the close went ahead), and once the teardowns have happened (their
    /// sentinels hung up) sleeps are direct again: one system call each.
    #[test]
    fn a_ring_closed_while_a_thread_that_used_it_sleeps_in_epoll_wait_does_not_interrupt_it() {
        use std::time::{Duration, Instant};
        let _g = crate::vault::tests::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let direct_again = |what: &str| {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                if crate::vault::direct_wait().is_some_and(|d| d.holds_back_closes()) {
                    return;
                }
                assert!(Instant::now() < deadline, "{what}: the teardowns were watched to their end");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        for round in 0..4 {
            let (tx, rx) = std::sync::mpsc::channel();
            let waiter = std::thread::spawn(move || {
                // This thread keeps the memfds and submits to the ring (a copy out),
                // which puts it in the ring's list for the teardown's task work.
                let kept: Vec<crate::vault::Kept> = (0..8)
                    .map(|_| {
                        let m = strait_sys::sealed_memfd(c"epoll-test", 4096)
                            .map(std::os::fd::IntoRawFd::into_raw_fd)
                            .expect("memfd");
                        let k = crate::vault::keep(m);
                        // SAFETY: our memfd (the vault holds its own reference).
                        unsafe { libc::close(m) };
                        k
                    })
                    .collect();
                if let Some(c) = crate::vault::copy(kept[0]) {
                    // SAFETY: the copy is ours.
                    unsafe { libc::close(c) };
                }
                tx.send(kept).expect("send");
                // SAFETY: plain syscalls on a fresh epoll set; a local event array.
                unsafe {
                    let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
                    assert!(ep >= 0);
                    let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
                    let t = Instant::now();
                    let n = super::kernel_wait(ep, ev.as_mut_ptr(), 4, 400, None);
                    let e = std::io::Error::last_os_error();
                    libc::close(ep);
                    (n, e, t.elapsed())
                }
            });
            let kept = rx.recv().expect("kept");
            if !matches!(kept[0], crate::vault::Kept::Slot(_)) {
                // io_uring refused here: nothing to interrupt.
                kept.into_iter().for_each(crate::vault::release);
                let _ = waiter.join();
                return;
            }
            // The waiter sleeps now; the last release drops the ring.
            std::thread::sleep(Duration::from_millis(100));
            for k in kept {
                crate::vault::release(k);
            }
            let (n, e, took) = waiter.join().expect("waiter");
            assert_eq!(n, 0, "round {round}: an empty set times out, no EINTR: {e}");
            assert!(took >= Duration::from_millis(390), "round {round}: slept its timeout");
            direct_again("after a deferred close");
        }
    }
}
