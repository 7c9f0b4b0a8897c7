//! `poll`/`ppoll`/`select` and `epoll` over sets that mix accelerated and kernel
//! descriptors.
//!
//! An accelerated descriptor's kernel socket is idle, so its readiness comes from
//! the rings; to sleep, the call waits on the kernel descriptors plus each
//! connection's eventfd (rung by the peer, which sees our "sleeping" flag) and its
//! Unix socket (which hangs up when the peer process is gone).

use std::sync::Arc;
use std::time::{Duration, Instant};

use libc::{c_int, pollfd, sigset_t};

use crate::conn::Conn;
use crate::udp::UdpSock;
use crate::wait::{kernel_poll_for, remaining, slice_left};

/// Accelerated entries of a pollfd array: (index, connection); a connector still
/// waiting for its acceptor is one (a poll never waits for it to settle: its
/// readiness says when it did).
fn accel_entries(fds: &[pollfd]) -> Vec<(usize, Arc<Conn>)> {
    fds.iter().enumerate().filter_map(|(i, p)| crate::settle::accel_now(p.fd).map(|c| (i, c))).collect()
}

fn conn_revents(c: &Conn, fd: c_int, events: i16) -> i16 {
    c.readiness(fd).bits & (events | libc::POLLHUP | libc::POLLERR)
}

/// Strait UDP sockets of a pollfd array that can receive through shared memory:
/// (index, socket).
fn udp_entries(fds: &[pollfd]) -> Vec<(usize, Arc<UdpSock>)> {
    if !crate::table::any_udp() {
        return Vec::new();
    }
    fds.iter()
        .enumerate()
        .filter_map(|(i, p)| crate::table::udp(p.fd).filter(|u| u.rx().is_some()).map(|u| (i, u)))
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
        // Kernel members, plus each connection's hang-up (the peer's close reaches
        // us only through the kernel: `Liveness`), plus (when sleeping) each
        // connection's bell, plus each UDP socket's marker and (when sleeping) its
        // doorbell.
        let nk = tmp.len();
        for (i, c) in &acc {
            let bell = |fd: c_int| if sleep { fd } else { -1 };
            // Our eventfd, or this thread's hub of pair bells (once per pair).
            tmp.push(pollfd { fd: if sleep { c.bell_fd() } else { -1 }, events: libc::POLLIN, revents: 0 });
            tmp.push(pollfd { fd: c.hup_fd(fds[*i].fd), events: libc::POLLRDHUP, revents: 0 });
            // A connection to another host: its UDP socket wakes us directly.
            tmp.push(pollfd { fd: bell(c.remote_fd().unwrap_or(-1)), events: libc::POLLIN, revents: 0 });
            // A connector not attached yet: an acceptor asking by path B.
            tmp.push(pollfd {
                fd: bell(c.pending_listener().unwrap_or(-1)),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let nu = tmp.len();
        for (_, u) in &udp {
            let rx = u.rx().expect("filtered on rx");
            tmp.push(pollfd { fd: rx.marker(), events: libc::POLLIN, revents: 0 });
            tmp.push(pollfd { fd: if sleep { rx.efd } else { -1 }, events: libc::POLLIN, revents: 0 });
        }
        let nap = if sleep {
            slice_left(deadline, acc.iter().filter_map(|(_, c)| c.attach_deadline()))
        } else {
            Duration::ZERO
        };
        let saved: Vec<i16> = acc.iter().map(|(i, _)| tmp[*i].revents).collect();
        let r = kernel_poll_for(&mut tmp, nap, mask);
        if r < 0 {
            return Some(-1);
        }
        let mut hub_settled = false;
        for (j, (_, c)) in acc.iter().enumerate() {
            let bell = tmp[nk + 4 * j];
            if bell.revents != 0 && c.uses_pairs() {
                // One settle of the thread's hub for all members that share it.
                if !hub_settled {
                    c.after_bell(bell.fd);
                    hub_settled = true;
                }
                c.pump_remote();
            } else if bell.revents != 0 || tmp[nk + 4 * j + 2].revents != 0 {
                c.drain_bell();
            }
            c.hung_up(tmp[nk + 4 * j + 1].revents);
            // (A path-B ask is answered by the readiness look below.)
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
            // (Looked at again after a sleep, or when the hang-up was reported.)
            let again = sleep || tmp[nk + 4 * j + 1].revents != 0;
            tmp[*i].revents = if again { conn_revents(c, fds[*i].fd, fds[*i].events) } else { saved[j] };
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
    if !(crate::table::any_live() || crate::table::any_udp()) || !(0..=libc::FD_SETSIZE as c_int).contains(&n)
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
        crate::table::lookup(p.fd).is_some() || crate::table::udp(p.fd).is_some_and(|u| u.rx().is_some())
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
