//! `poll`/`ppoll`/`select` and `epoll` over sets that mix accelerated and kernel
//! descriptors.
//!
//! An accelerated descriptor's kernel socket is idle, so its readiness comes from
//! the rings; to sleep, the call waits on the kernel descriptors plus each
//! connection's eventfd (rung by the peer, which sees our "sleeping" flag) and its
//! Unix socket (which hangs up when the peer process is gone).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libc::{c_int, epoll_event, nfds_t, pollfd, sigset_t};

use crate::conn::Conn;
use crate::real;
use crate::udp::UdpSock;

/// Longest single sleep: a safety net against a wake-up taken by another thread
/// waiting on the same connection.
const SLICE: Duration = Duration::from_millis(1000);

fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

fn slice_ms(deadline: Option<Instant>) -> c_int {
    match remaining(deadline) {
        None => SLICE.as_millis() as c_int,
        Some(r) => r.min(SLICE).as_micros().div_ceil(1000) as c_int,
    }
}

/// [`slice_ms`], also ending when the earliest of `attach` deadlines passes (a
/// pending connector decides for the kernel then, and its program must hear it).
fn slice_until(deadline: Option<Instant>, attach: impl Iterator<Item = Instant>) -> c_int {
    let ms = slice_ms(deadline);
    match attach.min() {
        Some(a) => ms.min(a.saturating_duration_since(Instant::now()).as_micros().div_ceil(1000) as c_int),
        None => ms,
    }
}

/// Accelerated entries of a pollfd array: (index, connection).
fn accel_entries(fds: &[pollfd]) -> Vec<(usize, Arc<Conn>)> {
    fds.iter().enumerate().filter_map(|(i, p)| crate::calls::accel(p.fd).map(|c| (i, c))).collect()
}

fn conn_revents(c: &Conn, fd: c_int, events: i16) -> i16 {
    c.readiness(fd).bits & (events | libc::POLLHUP | libc::POLLERR)
}

/// Strait UDP sockets of a pollfd array that can receive through shared memory:
/// (index, socket).
fn udp_entries(fds: &[pollfd]) -> Vec<(usize, Arc<UdpSock>)> {
    if !crate::udp::any_live() {
        return Vec::new();
    }
    fds.iter()
        .enumerate()
        .filter_map(|(i, p)| crate::udp::lookup(p.fd).filter(|u| u.rx().is_some()).map(|u| (i, u)))
        .collect()
}

fn udp_revents(u: &UdpSock, events: i16) -> i16 {
    if events & libc::POLLIN != 0 && u.shm_readable() {
        libc::POLLIN
    } else {
        0
    }
}

/// `poll`/`ppoll` with accelerated members. `None`: no accelerated member, call the
/// real function.
///
/// TCP members are answered from their rings (their idle kernel sockets are left
/// out). UDP members stay in the kernel call (kernel datagrams, POLLOUT, errors) and
/// get POLLIN from their rings too; their markers are always watched (a new sender
/// is attached at once) and, to sleep, their doorbells.
pub fn poll(fds: &mut [pollfd], deadline: Option<Instant>, mask: Option<*const sigset_t>) -> Option<c_int> {
    let acc = accel_entries(fds);
    let udp = udp_entries(fds);
    if acc.is_empty() && udp.is_empty() {
        return None;
    }
    let mut first = true;
    loop {
        let mut ready = 0;
        let mut tmp: Vec<pollfd> = fds.to_vec();
        for (i, c) in &acc {
            let r = conn_revents(c, fds[*i].fd, fds[*i].events);
            tmp[*i].fd = -1;
            tmp[*i].revents = r;
            if r != 0 {
                ready += 1;
            }
        }
        let shm_before: Vec<i16> = udp.iter().map(|(i, u)| udp_revents(u, fds[*i].events)).collect();
        ready += shm_before.iter().filter(|&&b| b != 0).count();
        let sleep = ready == 0 && (first || remaining(deadline) != Some(Duration::ZERO));
        first = false;
        if sleep {
            for (i, c) in &acc {
                let ev = fds[*i].events;
                c.announce(ev & libc::POLLIN != 0, ev & libc::POLLOUT != 0);
            }
            for (i, u) in &udp {
                if fds[*i].events & libc::POLLIN != 0 {
                    u.announce();
                }
            }
            if acc.iter().any(|(i, c)| conn_revents(c, fds[*i].fd, fds[*i].events) != 0)
                || udp.iter().any(|(i, u)| udp_revents(u, fds[*i].events) != 0)
            {
                continue;
            }
        }
        // Kernel members, plus (when sleeping) each connection's bell and Unix socket,
        // plus each UDP socket's marker and (when sleeping) its doorbell.
        let nk = tmp.len();
        if sleep {
            for (_, c) in &acc {
                tmp.push(pollfd { fd: c.my_efd, events: libc::POLLIN, revents: 0 });
                tmp.push(pollfd { fd: c.unix(), events: libc::POLLRDHUP, revents: 0 });
                // A connection to another host: its UDP socket wakes us directly.
                tmp.push(pollfd { fd: c.remote_fd().unwrap_or(-1), events: libc::POLLIN, revents: 0 });
                // A connector not attached yet: an acceptor asking by path B.
                tmp.push(pollfd { fd: c.pending_listener().unwrap_or(-1), events: libc::POLLIN, revents: 0 });
            }
        }
        let nu = tmp.len();
        for (_, u) in &udp {
            let rx = u.rx().expect("filtered on rx");
            tmp.push(pollfd { fd: rx.marker(), events: libc::POLLIN, revents: 0 });
            tmp.push(pollfd { fd: if sleep { rx.efd } else { -1 }, events: libc::POLLIN, revents: 0 });
        }
        let ms = if sleep {
            slice_until(deadline, acc.iter().filter_map(|(_, c)| c.attach_deadline()))
        } else {
            0
        };
        let saved: Vec<i16> = acc.iter().map(|(i, _)| tmp[*i].revents).collect();
        let r = kernel_poll(&mut tmp, ms, mask);
        if r < 0 {
            return Some(-1);
        }
        if sleep {
            for (j, (_, c)) in acc.iter().enumerate() {
                if tmp[nk + 4 * j].revents != 0 || tmp[nk + 4 * j + 2].revents != 0 {
                    c.drain_bell();
                }
                if tmp[nk + 4 * j + 1].revents != 0 {
                    c.check_peer();
                }
                // (A path-B ask is answered by the readiness look below.)
            }
        }
        for (j, (i, u)) in udp.iter().enumerate() {
            if tmp[nu + 2 * j].revents != 0 {
                u.pump();
            }
            if tmp[nu + 2 * j + 1].revents != 0 {
                u.drain_bell();
            }
            tmp[*i].revents |= shm_before[j] | udp_revents(u, fds[*i].events);
        }
        for (j, (i, c)) in acc.iter().enumerate() {
            tmp[*i].revents = if sleep { conn_revents(c, fds[*i].fd, fds[*i].events) } else { saved[j] };
        }
        let total = tmp[..nk].iter().filter(|p| p.revents != 0).count() as c_int;
        let timed_out = remaining(deadline) == Some(Duration::ZERO);
        if total > 0 || timed_out || !sleep {
            for (k, p) in fds.iter_mut().enumerate() {
                p.revents = tmp[k].revents;
            }
            return Some(total);
        }
    }
}

/// The kernel's `poll` (or `ppoll` with `mask`) over `fds` for at most `ms`
/// milliseconds, within the process's descriptor limit. The kernel refuses a set
/// longer than `RLIMIT_NOFILE` (EINVAL), and the library adds its own descriptors
/// to the program's: a sandboxed process that lowered the limit (OpenSSH's
/// pre-authentication child sets it to 1) would see every wait fail. Then the
/// entries that name a descriptor are polled without waiting, in pieces the limit
/// allows (one at a time), and the call waits at most a millisecond before it
/// answers 0 (callers wait in slices and come back).
pub(crate) fn kernel_poll(fds: &mut [pollfd], ms: c_int, mask: Option<*const sigset_t>) -> c_int {
    // SAFETY: a slice of pollfds and its length; the mask is the caller's.
    let r = unsafe {
        match mask {
            None => real::poll(fds.as_mut_ptr(), fds.len() as nfds_t, ms),
            Some(m) => {
                let ts = libc::timespec {
                    tv_sec: (ms / 1000) as _,
                    tv_nsec: ((ms % 1000) as i64 * 1_000_000) as _,
                };
                real::ppoll(fds.as_mut_ptr(), fds.len() as nfds_t, &ts, m)
            }
        }
    };
    if r >= 0 || real::errno() != libc::EINVAL {
        return r;
    }
    // One descriptor at a time is within any limit but 0 (asking the limit is a
    // system call a sandbox may forbid: OpenSSH's kills the process for it).
    let live: Vec<usize> = (0..fds.len()).filter(|&i| fds[i].fd >= 0).collect();
    let mut ready = 0;
    for &i in &live {
        let mut one = [fds[i]];
        // SAFETY: one pollfd, no waiting.
        if unsafe { real::poll(one.as_mut_ptr(), 1, 0) } < 0 {
            return -1;
        }
        fds[i].revents = one[0].revents;
        ready += (one[0].revents != 0) as c_int;
    }
    if ready == 0 && ms != 0 {
        // Wait a millisecond at most on the first descriptor (the library puts a
        // doorbell first where it sleeps), then answer: callers come back.
        if let Some(&i) = live.first() {
            let mut one = [fds[i]];
            // SAFETY: one pollfd.
            if unsafe { real::poll(one.as_mut_ptr(), 1, 1) } > 0 {
                fds[i].revents = one[0].revents;
                ready = 1;
            }
        }
    }
    ready
}

/// `select` expressed as `poll` when an accelerated descriptor is in a set.
///
/// # Safety
/// The sets are null or valid `fd_set`s for `n` descriptors.
pub unsafe fn select(
    n: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    deadline: Option<Instant>,
    mask: Option<*const sigset_t>,
) -> Option<c_int> {
    if !(crate::table::any_live() || crate::udp::any_live()) || !(0..=libc::FD_SETSIZE as c_int).contains(&n)
    {
        return None;
    }
    let mut fds = Vec::new();
    // SAFETY: the caller's sets cover `n` descriptors.
    unsafe {
        for fd in 0..n {
            let mut ev = 0;
            if !r.is_null() && libc::FD_ISSET(fd, r) {
                ev |= libc::POLLIN;
            }
            if !w.is_null() && libc::FD_ISSET(fd, w) {
                ev |= libc::POLLOUT;
            }
            if !e.is_null() && libc::FD_ISSET(fd, e) {
                ev |= libc::POLLPRI;
            }
            if ev != 0 {
                fds.push(pollfd { fd, events: ev, revents: 0 });
            }
        }
    }
    if !fds.iter().any(|p| {
        crate::table::lookup(p.fd).is_some() || crate::udp::lookup(p.fd).is_some_and(|u| u.rx().is_some())
    }) {
        return None;
    }
    let res = poll(&mut fds, deadline, mask)?;
    if res < 0 {
        return Some(-1);
    }
    let mut count = 0;
    // SAFETY: as above.
    unsafe {
        for s in [r, w, e] {
            if !s.is_null() {
                libc::FD_ZERO(s);
            }
        }
        for p in &fds {
            let rd = p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
                && p.events & libc::POLLIN != 0;
            let wr = p.revents & (libc::POLLOUT | libc::POLLERR) != 0 && p.events & libc::POLLOUT != 0;
            let ex = p.revents & libc::POLLPRI != 0 && p.events & libc::POLLPRI != 0;
            for (set, on) in [(r, rd), (w, wr), (e, ex)] {
                if on {
                    libc::FD_SET(p.fd, set);
                    count += 1;
                }
            }
        }
    }
    Some(count)
}

// ---------------------------------------------------------------- epoll

const MAGIC_BELL: u64 = 0x5354_5241_4954_0000 << 16;
const MAGIC_HUP: u64 = 0x5354_5241_4955_0000 << 16;
const MAGIC_MARK: u64 = 0x5354_5241_4956_0000 << 16;
const MAGIC_MASK: u64 = !0xffff_ffff;

/// An accelerated member of an epoll set.
#[derive(Clone)]
enum Member {
    Tcp(Arc<Conn>),
    /// A UDP socket: the kernel set holds the socket itself (kernel datagrams); this
    /// side adds the datagrams waiting in shared memory.
    Udp(Arc<UdpSock>),
}

impl Member {
    fn same(&self, o: &Member) -> bool {
        match (self, o) {
            (Member::Tcp(a), Member::Tcp(b)) => Arc::ptr_eq(a, b),
            (Member::Udp(a), Member::Udp(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Readiness for the program's descriptor `fd` of this member.
    fn readiness(&self, fd: c_int) -> crate::conn::Ready {
        match self {
            Member::Tcp(c) => c.readiness(fd),
            Member::Udp(u) => crate::conn::Ready {
                bits: if u.shm_readable() { libc::POLLIN } else { 0 },
                rx_tail: u.rx_mark(),
                tx_head: 0,
            },
        }
    }

    fn announce(&self, rx: bool, tx: bool) {
        match self {
            Member::Tcp(c) => c.announce(rx, tx),
            Member::Udp(u) => {
                if rx {
                    u.announce();
                }
            }
        }
    }

    /// The descriptors that wake a sleeper for this member, with their tags; `None`
    /// if it has none yet (a UDP socket not bound yet).
    fn wakers(&self) -> Option<Vec<(c_int, u64, i32)>> {
        match self {
            Member::Tcp(c) => {
                let mut w =
                    vec![(c.my_efd, MAGIC_BELL, libc::EPOLLIN), (c.unix(), MAGIC_HUP, libc::EPOLLRDHUP)];
                // A connection to another host: its UDP socket rings like a bell.
                w.extend(c.remote_fd().map(|fd| (fd, MAGIC_BELL, libc::EPOLLIN)));
                // A connector not attached yet: an acceptor asking by path B (the
                // listener closes at settling, which takes it out of the set).
                w.extend(c.pending_listener().map(|fd| (fd, MAGIC_BELL, libc::EPOLLIN)));
                Some(w)
            }
            Member::Udp(u) => u.rx().map(|rx| {
                vec![(rx.efd, MAGIC_BELL, libc::EPOLLIN), (rx.marker(), MAGIC_MARK, libc::EPOLLIN)]
            }),
        }
    }

    /// True if `fd` is one of this member's bells.
    fn has_bell(&self, fd: c_int) -> bool {
        match self {
            Member::Tcp(c) => c.my_efd == fd || c.remote_fd() == Some(fd) || c.pending_listener() == Some(fd),
            Member::Udp(u) => u.rx().is_some_and(|rx| rx.efd == fd),
        }
    }

    fn drain_bell(&self) {
        match self {
            Member::Tcp(c) => c.drain_bell(),
            Member::Udp(u) => u.drain_bell(),
        }
    }
}

struct Entry {
    fd: c_int,
    conn: Member,
    events: u32,
    data: u64,
    last_bits: i16,
    last_rx: u64,
    last_tx: u64,
    disabled: bool,
    /// May have changed since it was last looked at: scan it.
    dirty: bool,
    /// Our sleeping flags are set for it, so any change rings its bell. Every entry
    /// is dirty or armed, so a scan only touches dirty entries (a connection's
    /// shared lines are not pulled from the peer on every epoll_wait).
    armed: bool,
}

/// The accelerated members of one epoll set.
#[derive(Default)]
pub struct EpSet {
    entries: Vec<Entry>,
    /// Connections whose bell and Unix socket are in the kernel set. They stay
    /// after EPOLL_CTL_DEL (programs such as hiredis delete and re-add on every
    /// request) until the connection is closed: a bell with no entry is drained
    /// and ignored.
    wakers: Vec<Member>,
    /// A UDP member had no wakers yet (not bound when added): look again.
    pending_udp: bool,
}

impl EpSet {
    fn live(&self) -> bool {
        !self.entries.is_empty() || !self.wakers.is_empty()
    }
}

static SETS_LIVE: AtomicUsize = AtomicUsize::new(0);
static SETS: Mutex<Option<HashMap<c_int, EpSet>>> = Mutex::new(None);

fn sets() -> std::sync::MutexGuard<'static, Option<HashMap<c_int, EpSet>>> {
    SETS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Puts the member's wakers in the kernel set; false if it has none yet.
fn add_wakers(epfd: c_int, c: &Member) -> bool {
    let Some(w) = c.wakers() else { return false };
    for (fd, magic, ev) in w {
        let mut e = epoll_event { events: ev as u32, u64: magic | fd as u32 as u64 };
        // SAFETY: a local epoll_event. EEXIST (another descriptor of the same
        // connection) is fine.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut e) };
    }
    true
}

fn del_wakers(epfd: c_int, c: &Member) {
    let Some(w) = c.wakers() else { return };
    for (fd, _, _) in w {
        let mut e = epoll_event { events: 0, u64: 0 };
        // SAFETY: a local epoll_event.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, &mut e) };
    }
}

/// `epoll_ctl` on an accelerated descriptor (never handed to the kernel set).
/// True if `epfd` is an epoll descriptor (asked once per set, not per call).
fn is_epoll(epfd: c_int) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{epfd}"))
        .is_ok_and(|l| l.to_string_lossy() == "anon_inode:[eventpoll]")
}

pub fn ctl(epfd: c_int, op: c_int, fd: c_int, conn: Arc<Conn>, ev: *const epoll_event) -> c_int {
    ctl_member(epfd, op, fd, Member::Tcp(conn), ev)
}

/// `epoll_ctl` on a strait UDP socket, after the kernel set took the socket itself.
pub fn ctl_udp(epfd: c_int, op: c_int, fd: c_int, u: Arc<UdpSock>, ev: *const epoll_event) {
    ctl_member(epfd, op, fd, Member::Udp(u), ev);
}

fn ctl_member(epfd: c_int, op: c_int, fd: c_int, conn: Member, ev: *const epoll_event) -> c_int {
    // The first time a set meets an accelerated descriptor, check it is a set (the
    // calls on it after that cost no system call unless wakers come or go).
    let known = sets().as_ref().is_some_and(|m| m.contains_key(&epfd));
    if !known && !is_epoll(epfd) {
        // SAFETY: plain fcntl to tell EBADF from EINVAL.
        let bad = unsafe { real::fcntl(epfd, libc::F_GETFD, 0) } < 0;
        real::set_errno(if bad { libc::EBADF } else { libc::EINVAL });
        return -1;
    }
    let (events, data) = if ev.is_null() {
        (0, 0)
    } else {
        // SAFETY: the caller's event (read unaligned: epoll_event is packed on x86-64).
        let e = unsafe { std::ptr::read_unaligned(ev) };
        (e.events, e.u64)
    };
    let mut g = sets();
    let map = g.get_or_insert_with(HashMap::new);
    let set = map.entry(epfd).or_default();
    let pos = set.entries.iter().position(|e| e.fd == fd);
    match op {
        libc::EPOLL_CTL_ADD => {
            if pos.is_some() {
                real::set_errno(libc::EEXIST);
                return -1;
            }
            if !set.wakers.iter().any(|x| x.same(&conn)) {
                if add_wakers(epfd, &conn) {
                    set.wakers.push(conn.clone());
                } else {
                    set.pending_udp = true;
                }
            }
            set.entries.push(Entry {
                fd,
                conn,
                events,
                data,
                last_bits: 0,
                last_rx: 0,
                last_tx: 0,
                disabled: false,
                dirty: true,
                armed: false,
            });
        }
        libc::EPOLL_CTL_MOD => {
            let Some(i) = pos else {
                real::set_errno(libc::ENOENT);
                return -1;
            };
            let e = &mut set.entries[i];
            e.events = events;
            e.data = data;
            e.last_bits = 0;
            e.disabled = false;
            e.dirty = true;
            e.armed = false;
        }
        libc::EPOLL_CTL_DEL => {
            let Some(i) = pos else {
                real::set_errno(libc::ENOENT);
                return -1;
            };
            set.entries.swap_remove(i);
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

/// The connection's last descriptor was closed: the kernel would drop it from every
/// epoll set.
pub fn forget_conn(conn: &Arc<Conn>) {
    forget_member(&Member::Tcp(conn.clone()));
}

/// A UDP socket's last descriptor was closed.
pub fn forget_udp(u: &Arc<UdpSock>) {
    forget_member(&Member::Udp(u.clone()));
}

fn forget_member(conn: &Member) {
    if SETS_LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut g = sets();
    if let Some(map) = g.as_mut() {
        for (&epfd, set) in map.iter_mut() {
            set.entries.retain(|e| !e.conn.same(conn));
            let before = set.wakers.len();
            set.wakers.retain(|c| !c.same(conn));
            if set.wakers.len() != before {
                del_wakers(epfd, conn);
            }
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
    let m = Member::Tcp(conn.clone());
    let joins: Vec<(c_int, c_int, epoll_event)> = sets()
        .as_ref()
        .map(|map| {
            map.iter()
                .flat_map(|(&epfd, set)| {
                    set.entries.iter().filter(|e| e.conn.same(&m)).map(move |e| {
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
    for (epfd, fd, mut ev) in joins {
        // SAFETY: a local epoll_event; the program's descriptor and set.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    }
    forget_member(&m);
}

/// `close(epfd)`.
pub fn forget_set(epfd: c_int) {
    if SETS_LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut g = sets();
    if let Some(map) = g.as_mut() {
        map.remove(&epfd);
        let n = map.values().filter(|s| s.live()).count();
        SETS_LIVE.store(n, Ordering::Relaxed);
    }
}

fn evaluate(e: &mut Entry) -> i16 {
    let r = e.conn.readiness(e.fd);
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
fn collect(set: &mut EpSet, out: &mut Vec<epoll_event>, max: usize) {
    for e in set.entries.iter_mut() {
        if out.len() >= max {
            break;
        }
        if e.disabled || !e.dirty {
            continue;
        }
        let mut bits = evaluate(e);
        if bits == 0 && !e.armed {
            e.conn.announce(e.events & libc::EPOLLIN as u32 != 0, e.events & libc::EPOLLOUT as u32 != 0);
            e.armed = true;
            bits = evaluate(e);
        }
        let level = e.events & libc::EPOLLET as u32 == 0;
        if bits != 0 {
            out.push(epoll_event { events: bits as u16 as u32, u64: e.data });
            if e.events & libc::EPOLLONESHOT as u32 != 0 {
                e.disabled = true;
            }
        }
        // Level-triggered entries that were ready stay dirty (still ready next time
        // unless drained); others wait for their bell, armed. A connector still
        // waiting for its acceptor is looked at every time (its deadline rings no
        // bell).
        e.dirty = (bits != 0 && level) || matches!(&e.conn, Member::Tcp(c) if c.awaiting_attach());
        if !e.dirty && !e.armed {
            e.conn.announce(e.events & libc::EPOLLIN as u32 != 0, e.events & libc::EPOLLOUT as u32 != 0);
            e.armed = true;
            // A change between the evaluation and the arming rang no bell.
            e.dirty = true;
        }
    }
}

/// A bell (or hang-up) of connection `c` came: its entries may have changed.
fn touch(set: &mut EpSet, pred: impl Fn(&Member) -> bool) {
    for e in set.entries.iter_mut() {
        if pred(&e.conn) {
            e.dirty = true;
            e.armed = false;
        }
    }
}

fn with_set<T>(epfd: c_int, f: impl FnOnce(&mut EpSet) -> T) -> Option<T> {
    let mut g = sets();
    g.as_mut().and_then(|m| m.get_mut(&epfd)).map(f)
}

/// `epoll_wait`/`epoll_pwait` on a set with accelerated members; `None`: none.
///
/// # Safety
/// `events` has room for `max` entries.
pub unsafe fn wait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    deadline: Option<Instant>,
    mask: Option<*const sigset_t>,
) -> Option<c_int> {
    if SETS_LIVE.load(Ordering::Relaxed) == 0 || max <= 0 {
        return None;
    }
    if !with_set(epfd, |s| s.live())? {
        return None;
    }
    let max = max as usize;
    let mut first = true;
    loop {
        let mut acc = Vec::new();
        with_set(epfd, |set| {
            // UDP members bound since they were added: their wakers join the set now.
            if set.pending_udp {
                set.pending_udp = false;
                let members: Vec<Member> = set.entries.iter().map(|e| e.conn.clone()).collect();
                for m in members {
                    if set.wakers.iter().any(|x| x.same(&m)) {
                        continue;
                    }
                    if add_wakers(epfd, &m) {
                        set.wakers.push(m);
                    } else {
                        set.pending_udp = true;
                    }
                }
            }
            collect(set, &mut acc, max)
        });
        // Entries armed just now are dirty once more: look again before sleeping.
        if acc.is_empty() {
            with_set(epfd, |set| collect(set, &mut acc, max));
        }
        let sleep = acc.is_empty() && (first || remaining(deadline) != Some(Duration::ZERO));
        first = false;
        let room = max - acc.len();
        let ms = if sleep {
            let attach = with_set(epfd, |set| {
                set.entries
                    .iter()
                    .filter_map(|e| match &e.conn {
                        Member::Tcp(c) => c.attach_deadline(),
                        _ => None,
                    })
                    .min()
            })
            .flatten();
            slice_until(deadline, attach.into_iter())
        } else {
            0
        };
        // Kernel events go straight into the caller's buffer (no copy of a possibly
        // huge maxevents array); ours are appended after them.
        let r = if room == 0 {
            0
        } else {
            // SAFETY: the caller's buffer has room for `max >= room` entries.
            unsafe {
                match mask {
                    None => real::epoll_wait(epfd, events, room as c_int, ms),
                    Some(m) => real::epoll_pwait(epfd, events, room as c_int, ms, m),
                }
            }
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
                    if let Some(c) = set.wakers.iter().find(|c| c.has_bell(fd)) {
                        c.drain_bell();
                    }
                    touch(set, |c| c.has_bell(fd));
                });
            } else if data & MAGIC_MASK == MAGIC_MARK {
                woke = true;
                with_set(epfd, |set| {
                    let u = set.wakers.iter().find_map(|c| match c {
                        Member::Udp(u) if u.rx().is_some_and(|rx| rx.marker() == fd) => Some(u.clone()),
                        _ => None,
                    });
                    if let Some(u) = u {
                        u.pump();
                        touch(set, |c| matches!(c, Member::Udp(x) if Arc::ptr_eq(x, &u)));
                    }
                });
            } else if data & MAGIC_MASK == MAGIC_HUP {
                woke = true;
                with_set(epfd, |set| {
                    let found = set.wakers.iter().find_map(|c| match c {
                        Member::Tcp(t) if t.unix() == fd => Some(t.clone()),
                        _ => None,
                    });
                    if let Some(c) = found {
                        c.check_peer();
                        let m = Member::Tcp(c);
                        // A hang-up stays reported: a connection without entries
                        // leaves the kernel set, or every wait would return at once.
                        if !set.entries.iter().any(|e| e.conn.same(&m)) {
                            del_wakers(epfd, &m);
                            set.wakers.retain(|x| !x.same(&m));
                        }
                    }
                    touch(set, |c| matches!(c, Member::Tcp(t) if t.unix() == fd));
                });
            } else {
                // SAFETY: compacting in place, `kernel <= i`.
                unsafe { std::ptr::write_unaligned(events.add(kernel), e) };
                kernel += 1;
            }
        }
        // After a sleep, look at what the bells marked (nothing was reported yet in
        // this call, so no entry is reported twice).
        if sleep && (woke || kernel > 0) {
            let left = max - acc.len() - kernel.min(max - acc.len());
            let mut more = Vec::new();
            with_set(epfd, |set| collect(set, &mut more, left));
            acc.extend(more);
        }
        if !acc.is_empty() || kernel > 0 || remaining(deadline) == Some(Duration::ZERO) || !sleep {
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
