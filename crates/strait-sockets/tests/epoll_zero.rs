//! A zero-timeout `epoll_wait` on a set with accelerated members (issue 17: no
//! dearer than the kernel's) leaves the kernel set unasked when it can, and what it
//! leaves there is still reported. These tests make the time window long
//! (`STRAIT_EPOLL_KERNEL_LOOK_US`, 10 s) so that only the library's other bounds are
//! at work: a change of a carried member is seen by the very next call, a kernel
//! member within `KERNEL_LOOK_FAIR` (64) calls, a dead peer's hang-up likewise.
//! Both ends of each connection are descriptors of this process (as in
//! `in_process.rs`), except for the peer that dies, a forked child.

use std::sync::{Mutex, MutexGuard, Once};

use libc::{c_int, c_void, epoll_event};
use strait_sockets::calls;

mod common;
use common::*;

/// Calls within which a kernel member must be reported (the library's one call in
/// 64 that asks the kernel set, and the call that finds it).
const FAIR_BOUND: usize = 65;

/// One test at a time: the sets' lock is the process's, and another test's calls on
/// it would add futex calls to the counted ones.
static SERIAL: Mutex<()> = Mutex::new(());

fn init() -> MutexGuard<'static, ()> {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        // Before the library reads its settings (once, here); the other tests wait
        // on this `Once` before they touch the library or the environment.
        std::env::set_var("STRAIT_EPOLL_KERNEL_LOOK_US", "10000000");
        strait_sockets::init();
    });
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Calls until one reports `data`: how many it took (panics past `bound`), and
/// that every call before it reported `always` (if given).
fn calls_until(ep: c_int, data: u64, bound: usize, always: Option<u64>) -> usize {
    for i in 1..=bound {
        let got = poll_once(ep);
        if let Some(a) = always {
            assert!(
                got.iter().any(|&(d, _)| d == a),
                "call {i}: the always-ready member is reported: {got:?}"
            );
        }
        if got.iter().any(|&(d, _)| d == data) {
            return i;
        }
    }
    panic!("member {data} not reported within {bound} zero-timeout calls");
}

#[test]
fn a_set_of_carried_members_alone_polls_without_system_calls_and_sees_each_change_at_once() {
    let _serial = init();
    let (a, c) = carried_pair();
    let ep = epoll_set();
    add(ep, a, (libc::EPOLLIN | libc::EPOLLRDHUP) as u32, 1);
    assert!(poll_once(ep).is_empty(), "nothing yet");
    // The old library asked the kernel set on every call.
    let counter = strait_anatomy::sys::SyscallCounter::open()
        .map_err(|e| eprintln!("system calls not counted here: {e}"))
        .ok();
    let count = || counter.as_ref().map(|c| c.read().expect("counter"));
    let made = |before: Option<u64>| {
        let (c, b) = (counter.as_ref()?, before?);
        Some(c.delta(b, c.read().expect("counter")))
    };
    let before = count();
    for _ in 0..1000 {
        assert!(poll_once(ep).is_empty());
    }
    if let Some(made) = made(before) {
        assert!(made <= 1000 / 64 + 2, "1000 empty zero-timeout calls made {made} system calls");
    }
    // A send that returned is seen by the next call (it took the sleeping flag),
    // without asking the kernel set (one call in 64 does, so at most once here).
    let mut made_at_arrivals = 0;
    for round in 0..3 {
        for _ in 0..10 {
            assert!(poll_once(ep).is_empty(), "round {round}: nothing yet");
        }
        write_byte(c);
        let before = count();
        assert_eq!(poll_once(ep), vec![(1, libc::EPOLLIN as u32)], "round {round}: the byte, at once");
        made_at_arrivals += made(before).unwrap_or(0);
        read_byte(a);
        assert!(poll_once(ep).is_empty(), "round {round}: drained");
    }
    assert!(made_at_arrivals <= 1, "3 calls that found an arrival made {made_at_arrivals} system calls");
    // So is the peer's shutdown of its sending side (it takes the flag too).
    for _ in 0..10 {
        assert!(poll_once(ep).is_empty());
    }
    // SAFETY: our descriptor.
    ok(unsafe { calls::shutdown(c, libc::SHUT_WR) }, "shutdown");
    let got = poll_once(ep);
    assert_eq!(got.len(), 1, "the shutdown, at once: {got:?}");
    assert_ne!(got[0].1 & libc::EPOLLRDHUP as u32, 0, "EPOLLRDHUP: {got:?}");
    // SAFETY: our descriptors.
    unsafe {
        calls::close(ep);
        calls::close(a);
        calls::close(c);
    }
}

#[test]
fn a_closing_peer_is_seen_by_the_next_zero_timeout_call() {
    let _serial = init();
    let (a, c) = carried_pair();
    let ep = epoll_set();
    add(ep, a, libc::EPOLLIN as u32, 1);
    for _ in 0..10 {
        assert!(poll_once(ep).is_empty());
    }
    // SAFETY: our descriptor (the connection's last in this process at this end).
    unsafe { calls::close(c) };
    let got = poll_once(ep);
    assert_eq!(got.len(), 1, "the close, at once: {got:?}");
    assert_ne!(got[0].1 & libc::EPOLLIN as u32, 0, "end of stream reads: {got:?}");
    // SAFETY: our descriptors.
    unsafe {
        calls::close(ep);
        calls::close(a);
    }
}

#[test]
fn kernel_members_are_reported_behind_a_carried_member_that_is_always_ready() {
    let _serial = init();
    let (a, c) = carried_pair();
    // Never read: `a` stays readable, so every call finds a member of ours ready.
    write_byte(c);
    let ep = epoll_set();
    add(ep, a, libc::EPOLLIN as u32, 1);
    let (level, edge, oneshot) = (pipe(), pipe(), pipe());
    add(ep, level[0], libc::EPOLLIN as u32, 2);
    add(ep, edge[0], (libc::EPOLLIN | libc::EPOLLET) as u32, 3);
    add(ep, oneshot[0], (libc::EPOLLIN | libc::EPOLLONESHOT) as u32, 4);
    for _ in 0..100 {
        assert_eq!(poll_once(ep), vec![(1, libc::EPOLLIN as u32)], "only the carried member");
    }
    // SAFETY: one byte into each pipe, from a local.
    let fill = |p: [c_int; 2]| assert_eq!(unsafe { libc::write(p[1], b"k".as_ptr().cast::<c_void>(), 1) }, 1);
    // Level-triggered: reported within the bound, then on every call that asks
    // the kernel set.
    fill(level);
    calls_until(ep, 2, FAIR_BOUND, Some(1));
    calls_until(ep, 2, FAIR_BOUND, Some(1));
    let mut b = [0u8; 8];
    // SAFETY: a local buffer.
    assert_eq!(unsafe { libc::read(level[0], b.as_mut_ptr().cast::<c_void>(), 8) }, 1);
    // Edge-triggered: the edge is reported once, within the bound (the kernel keeps
    // it until a look takes it), and a new edge again.
    for round in 0..2 {
        fill(edge);
        calls_until(ep, 3, FAIR_BOUND, Some(1));
        for _ in 0..3 * FAIR_BOUND {
            assert!(!poll_once(ep).iter().any(|&(d, _)| d == 3), "round {round}: one report per edge");
        }
    }
    // One-shot: once, until re-armed.
    fill(oneshot);
    calls_until(ep, 4, FAIR_BOUND, Some(1));
    for _ in 0..3 * FAIR_BOUND {
        assert!(!poll_once(ep).iter().any(|&(d, _)| d == 4), "one-shot: once");
    }
    let mut ev = epoll_event { events: (libc::EPOLLIN | libc::EPOLLONESHOT) as u32, u64: 4 };
    // SAFETY: the library's epoll_ctl with a local event.
    ok(unsafe { calls::epoll_ctl(ep, libc::EPOLL_CTL_MOD, oneshot[0], &mut ev) }, "epoll_ctl mod");
    calls_until(ep, 4, FAIR_BOUND, Some(1));
    // SAFETY: our descriptors.
    unsafe {
        calls::close(ep);
        calls::close(a);
        calls::close(c);
        for p in [level, edge, oneshot] {
            libc::close(p[0]);
            libc::close(p[1]);
        }
    }
}

#[test]
fn a_kernel_member_added_and_deleted_is_counted() {
    let _serial = init();
    let (a, c) = carried_pair();
    let ep = epoll_set();
    add(ep, a, libc::EPOLLIN as u32, 1);
    let p = pipe();
    add(ep, p[0], libc::EPOLLIN as u32, 2);
    assert!(poll_once(ep).is_empty());
    // With a kernel member, a call that finds nothing of ours asks the kernel: the
    // pipe is reported by the first call after the write.
    // SAFETY: one byte into the pipe, from a local.
    assert_eq!(unsafe { libc::write(p[1], b"k".as_ptr().cast::<c_void>(), 1) }, 1);
    assert_eq!(poll_once(ep), vec![(2, libc::EPOLLIN as u32)], "the kernel member, at once");
    let mut ev = epoll_event { events: 0, u64: 0 };
    // SAFETY: the library's epoll_ctl.
    ok(unsafe { calls::epoll_ctl(ep, libc::EPOLL_CTL_DEL, p[0], &mut ev) }, "epoll_ctl del");
    assert!(poll_once(ep).is_empty(), "deleted");
    // SAFETY: our descriptors.
    unsafe {
        calls::close(ep);
        calls::close(a);
        calls::close(c);
        libc::close(p[0]);
        libc::close(p[1]);
    }
}
