//! A dead peer's hang-up on a set of carried members alone: a zero-timeout
//! `epoll_wait` that leaves the kernel set unasked (the set has no kernel member
//! and no bell rang) must still ask it now and then, since only the kernel sees the
//! peer's process die (its TCP socket hangs up; nothing in shared memory
//! changes). The time window is made long (10 s), so the one call in 64 that asks
//! is what finds it. One test in its own process: it forks.

use std::sync::Once;

use strait_sockets::calls;

mod common;
use common::*;

/// Calls within which the hang-up must be reported (the library's one call in 64
/// that asks the kernel set, and the call that finds it).
const FAIR_BOUND: usize = 65;

fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        // Before the library reads its settings (once, here); the other tests wait
        // on this `Once` before they touch the library or the environment.
        std::env::set_var("STRAIT_EPOLL_KERNEL_LOOK_US", "10000000");
        strait_sockets::init();
    });
}

#[test]
fn a_dead_peer_is_reported_to_a_set_of_carried_members_alone() {
    init();
    let (a, c) = carried_pair();
    let (child, go) = fork_holder();
    // The connector's end now lives in the child alone.
    // SAFETY: our descriptor.
    unsafe { calls::close(c) };
    // Made after the fork: a set that existed at a fork may have kernel members
    // the other process added, and always asks the kernel.
    let ep = epoll_set();
    add(ep, a, (libc::EPOLLIN | libc::EPOLLRDHUP) as u32, 1);
    for _ in 0..10 {
        assert!(poll_once(ep).is_empty(), "the peer is alive");
    }
    let_holder_go(child, go);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut calls_made = 0usize;
    let got = loop {
        calls_made += 1;
        let got = poll_once(ep);
        if !got.is_empty() || std::time::Instant::now() > deadline {
            break got;
        }
    };
    assert_eq!(got.len(), 1, "the hang-up is reported ({calls_made} calls)");
    assert_ne!(got[0].1 & (libc::EPOLLHUP | libc::EPOLLRDHUP) as u32, 0, "a hang-up: {got:?}");
    assert!(calls_made <= FAIR_BOUND, "within the one-in-64 look: {calls_made} calls");
    // SAFETY: our descriptors.
    unsafe {
        calls::close(ep);
        calls::close(a);
    }
}
