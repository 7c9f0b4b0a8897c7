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

/// Accelerated entries of a pollfd array: (index, connection).
fn accel_entries(fds: &[pollfd]) -> Vec<(usize, Arc<Conn>)> {
    fds.iter().enumerate().filter_map(|(i, p)| crate::accel(p.fd).map(|c| (i, c))).collect()
}

fn conn_revents(c: &Conn, events: i16) -> i16 {
    c.readiness().bits & (events | libc::POLLHUP | libc::POLLERR)
}

/// `poll`/`ppoll` with accelerated members. `None`: no accelerated member, call the
/// real function.
pub fn poll(fds: &mut [pollfd], deadline: Option<Instant>, mask: Option<*const sigset_t>) -> Option<c_int> {
    let acc = accel_entries(fds);
    if acc.is_empty() {
        return None;
    }
    let mut first = true;
    loop {
        let mut ready = 0;
        let mut tmp: Vec<pollfd> = fds.to_vec();
        for (i, c) in &acc {
            let r = conn_revents(c, fds[*i].events);
            tmp[*i].fd = -1;
            tmp[*i].revents = r;
            if r != 0 {
                ready += 1;
            }
        }
        let sleep = ready == 0 && (first || remaining(deadline) != Some(Duration::ZERO));
        first = false;
        if sleep {
            for (i, c) in &acc {
                let ev = fds[*i].events;
                c.announce(ev & libc::POLLIN != 0, ev & libc::POLLOUT != 0);
            }
            if acc.iter().any(|(i, c)| conn_revents(c, fds[*i].events) != 0) {
                continue;
            }
        }
        // Kernel members, plus (when sleeping) each connection's bell and Unix socket.
        let nk = tmp.len();
        if sleep {
            for (_, c) in &acc {
                tmp.push(pollfd { fd: c.my_efd, events: libc::POLLIN, revents: 0 });
                tmp.push(pollfd { fd: c.unix(), events: libc::POLLRDHUP, revents: 0 });
            }
        }
        let ms = if sleep { slice_ms(deadline) } else { 0 };
        let saved: Vec<i16> = acc.iter().map(|(i, _)| tmp[*i].revents).collect();
        // SAFETY: a vector of pollfds and its length; the mask is the caller's.
        let r = unsafe {
            match mask {
                None => real::poll(tmp.as_mut_ptr(), tmp.len() as nfds_t, ms),
                Some(m) => {
                    let ts = libc::timespec {
                        tv_sec: (ms / 1000) as _,
                        tv_nsec: ((ms % 1000) as i64 * 1_000_000) as _,
                    };
                    real::ppoll(tmp.as_mut_ptr(), tmp.len() as nfds_t, &ts, m)
                }
            }
        };
        if r < 0 {
            return Some(-1);
        }
        let mut kernel_ready = 0;
        for (k, p) in tmp[..nk].iter().enumerate() {
            if p.fd >= 0 && p.revents != 0 {
                kernel_ready += 1;
            }
            let _ = k;
        }
        if sleep {
            for (j, (_, c)) in acc.iter().enumerate() {
                if tmp[nk + 2 * j].revents != 0 {
                    c.drain_bell();
                }
                if tmp[nk + 2 * j + 1].revents != 0 {
                    c.check_peer();
                }
            }
        }
        let mut acc_ready = 0;
        for (j, (i, c)) in acc.iter().enumerate() {
            let rv = if sleep { conn_revents(c, fds[*i].events) } else { saved[j] };
            tmp[*i].revents = rv;
            if rv != 0 {
                acc_ready += 1;
            }
        }
        let total = kernel_ready + acc_ready;
        let timed_out = remaining(deadline) == Some(Duration::ZERO);
        if total > 0 || timed_out || !sleep {
            for (k, p) in fds.iter_mut().enumerate() {
                p.revents = tmp[k].revents;
            }
            return Some(total);
        }
    }
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
    if !crate::table::any_live() || !(0..=libc::FD_SETSIZE as c_int).contains(&n) {
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
    if !fds.iter().any(|p| crate::table::lookup(p.fd).is_some()) {
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
const MAGIC_MASK: u64 = !0xffff_ffff;

struct Entry {
    fd: c_int,
    conn: Arc<Conn>,
    events: u32,
    data: u64,
    last_bits: i16,
    last_rx: u64,
    last_tx: u64,
    disabled: bool,
}

/// The accelerated members of one epoll set.
#[derive(Default)]
pub struct EpSet {
    entries: Vec<Entry>,
}

static SETS_LIVE: AtomicUsize = AtomicUsize::new(0);
static SETS: Mutex<Option<HashMap<c_int, EpSet>>> = Mutex::new(None);

fn sets() -> std::sync::MutexGuard<'static, Option<HashMap<c_int, EpSet>>> {
    SETS.lock().unwrap_or_else(|e| e.into_inner())
}

fn add_wakers(epfd: c_int, c: &Conn) {
    for (fd, magic, ev) in [(c.my_efd, MAGIC_BELL, libc::EPOLLIN), (c.unix(), MAGIC_HUP, libc::EPOLLRDHUP)] {
        let mut e = epoll_event { events: ev as u32, u64: magic | fd as u32 as u64 };
        // SAFETY: a local epoll_event. EEXIST (another descriptor of the same
        // connection) is fine.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut e) };
    }
}

fn del_wakers(epfd: c_int, c: &Conn) {
    for fd in [c.my_efd, c.unix()] {
        let mut e = epoll_event { events: 0, u64: 0 };
        // SAFETY: a local epoll_event.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, &mut e) };
    }
}

/// `epoll_ctl` on an accelerated descriptor (never handed to the kernel set).
pub fn ctl(epfd: c_int, op: c_int, fd: c_int, conn: Arc<Conn>, ev: *const epoll_event) -> c_int {
    // Check that epfd is an epoll set: a harmless DEL of an fd that is never in it.
    let mut dummy = epoll_event { events: 0, u64: 0 };
    // SAFETY: a local epoll_event.
    if unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, conn.my_efd, &mut dummy) } < 0 {
        let e = real::errno();
        if e == libc::EBADF || e == libc::EINVAL {
            real::set_errno(e);
            return -1;
        }
    } else {
        // It was there (another descriptor of this connection): put it back.
        add_wakers(epfd, &conn);
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
            add_wakers(epfd, &conn);
            set.entries.push(Entry {
                fd,
                conn,
                events,
                data,
                last_bits: 0,
                last_rx: 0,
                last_tx: 0,
                disabled: false,
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
        }
        libc::EPOLL_CTL_DEL => {
            let Some(i) = pos else {
                real::set_errno(libc::ENOENT);
                return -1;
            };
            let e = set.entries.swap_remove(i);
            if !set.entries.iter().any(|x| Arc::ptr_eq(&x.conn, &e.conn)) {
                del_wakers(epfd, &e.conn);
            }
        }
        _ => {
            real::set_errno(libc::EINVAL);
            return -1;
        }
    }
    let n = map.values().filter(|s| !s.entries.is_empty()).count();
    SETS_LIVE.store(n, Ordering::Relaxed);
    0
}

/// The connection's last descriptor was closed: the kernel would drop it from every
/// epoll set.
pub fn forget_conn(conn: &Arc<Conn>) {
    if SETS_LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut g = sets();
    if let Some(map) = g.as_mut() {
        for (&epfd, set) in map.iter_mut() {
            let before = set.entries.len();
            set.entries.retain(|e| !Arc::ptr_eq(&e.conn, conn));
            if set.entries.len() != before {
                del_wakers(epfd, conn);
            }
        }
        let n = map.values().filter(|s| !s.entries.is_empty()).count();
        SETS_LIVE.store(n, Ordering::Relaxed);
    }
}

/// `close(epfd)`.
pub fn forget_set(epfd: c_int) {
    if SETS_LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut g = sets();
    if let Some(map) = g.as_mut() {
        map.remove(&epfd);
        let n = map.values().filter(|s| !s.entries.is_empty()).count();
        SETS_LIVE.store(n, Ordering::Relaxed);
    }
}

/// Ready accelerated members (level- or edge-triggered, one-shot), at most `max`.
fn collect(set: &mut EpSet, out: &mut Vec<epoll_event>, max: usize) {
    for e in set.entries.iter_mut() {
        if out.len() >= max {
            break;
        }
        if e.disabled {
            continue;
        }
        let r = e.conn.readiness();
        let mask = (e.events as i16) | libc::POLLHUP | libc::POLLERR;
        let mut bits = r.bits & mask;
        if e.events & libc::EPOLLET as u32 != 0 {
            let mut fresh = bits & !(libc::POLLIN | libc::POLLOUT);
            fresh &= !e.last_bits;
            if bits & libc::POLLIN != 0 && (e.last_bits & libc::POLLIN == 0 || r.rx_tail != e.last_rx) {
                fresh |= libc::POLLIN;
            }
            if bits & libc::POLLOUT != 0 && (e.last_bits & libc::POLLOUT == 0 || r.tx_head != e.last_tx) {
                fresh |= libc::POLLOUT;
            }
            e.last_bits = r.bits;
            e.last_rx = r.rx_tail;
            e.last_tx = r.tx_head;
            bits = fresh;
        }
        if bits != 0 {
            out.push(epoll_event { events: bits as u16 as u32, u64: e.data });
            if e.events & libc::EPOLLONESHOT as u32 != 0 {
                e.disabled = true;
            }
        }
    }
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
    let conns: Vec<(Arc<Conn>, u32)> = {
        let g = sets();
        let set = g.as_ref()?.get(&epfd)?;
        if set.entries.is_empty() {
            return None;
        }
        set.entries.iter().filter(|e| !e.disabled).map(|e| (e.conn.clone(), e.events)).collect()
    };
    let max = max as usize;
    let mut first = true;
    loop {
        let mut acc = Vec::new();
        {
            let mut g = sets();
            if let Some(set) = g.as_mut().and_then(|m| m.get_mut(&epfd)) {
                collect(set, &mut acc, max);
            }
        }
        let sleep = acc.is_empty() && (first || remaining(deadline) != Some(Duration::ZERO));
        first = false;
        if sleep {
            for (c, ev) in &conns {
                c.announce(ev & libc::EPOLLIN as u32 != 0, ev & libc::EPOLLOUT as u32 != 0);
            }
            let mut g = sets();
            if let Some(set) = g.as_mut().and_then(|m| m.get_mut(&epfd)) {
                collect(set, &mut acc, max);
            }
        }
        let sleep = sleep && acc.is_empty();
        let room = max - acc.len();
        let ms = if sleep { slice_ms(deadline) } else { 0 };
        let mut kev: Vec<epoll_event> = vec![epoll_event { events: 0, u64: 0 }; room.max(1)];
        let r = if room == 0 {
            0
        } else {
            // SAFETY: `kev` has room for `room` entries.
            unsafe {
                match mask {
                    None => real::epoll_wait(epfd, kev.as_mut_ptr(), room as c_int, ms),
                    Some(m) => real::epoll_pwait(epfd, kev.as_mut_ptr(), room as c_int, ms, m),
                }
            }
        };
        if r < 0 {
            if !acc.is_empty() {
                break finish(events, &acc, &[]);
            }
            return Some(-1);
        }
        let mut kernel = Vec::new();
        let mut woke = false;
        for e in &kev[..r as usize] {
            let data = e.u64;
            if data & MAGIC_MASK == MAGIC_BELL {
                woke = true;
                let fd = (data & 0xffff_ffff) as c_int;
                if let Some((c, _)) = conns.iter().find(|(c, _)| c.my_efd == fd) {
                    c.drain_bell();
                }
            } else if data & MAGIC_MASK == MAGIC_HUP {
                woke = true;
                let fd = (data & 0xffff_ffff) as c_int;
                if let Some((c, _)) = conns.iter().find(|(c, _)| c.unix() == fd) {
                    c.check_peer();
                }
            } else {
                kernel.push(*e);
            }
        }
        if sleep && (woke || !kernel.is_empty()) {
            let mut g = sets();
            if let Some(set) = g.as_mut().and_then(|m| m.get_mut(&epfd)) {
                collect(set, &mut acc, max - kernel.len().min(max));
            }
        }
        if !acc.is_empty() || !kernel.is_empty() || remaining(deadline) == Some(Duration::ZERO) || !sleep {
            break finish(events, &acc, &kernel);
        }
    }
}

fn finish(events: *mut epoll_event, acc: &[epoll_event], kernel: &[epoll_event]) -> Option<c_int> {
    let mut n = 0;
    for e in kernel.iter().chain(acc.iter()) {
        // SAFETY: the caller's buffer has room for `max` entries and we produce at
        // most that many (kernel events were limited to the room left).
        unsafe { std::ptr::write_unaligned(events.add(n), *e) };
        n += 1;
    }
    Some(n as c_int)
}
