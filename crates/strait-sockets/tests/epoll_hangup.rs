//! A dead peer's hang-up on a set of carried members alone: a zero-timeout
//! `epoll_wait` that leaves the kernel set unasked (the set has no kernel member
//! and no bell rang) must still ask it now and then, since only the kernel sees the
//! peer's process die (its liveness socket hangs up; nothing in shared memory
//! changes). The time window is made long (10 s), so the one call in 64 that asks
//! is what finds it. One test in its own process: it forks.

use std::sync::Once;

use libc::{c_int, c_void, epoll_event, sockaddr, sockaddr_in, socklen_t};
use strait_sockets::{calls, carried, Carried};

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

fn ok(r: c_int, what: &str) -> c_int {
    assert!(r >= 0, "{what}: {}", std::io::Error::last_os_error());
    r
}

fn loopback(port: u16) -> sockaddr_in {
    // SAFETY: sockaddr_in is plain old data.
    let mut a: sockaddr_in = unsafe { std::mem::zeroed() };
    a.sin_family = libc::AF_INET as libc::sa_family_t;
    a.sin_port = port.to_be();
    a.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
    a
}

/// A listening socket on 127.0.0.1 made through the library; (fd, port).
fn listener() -> (c_int, u16) {
    // SAFETY: the library's stand-ins for libc's calls, with valid arguments.
    unsafe {
        let l = ok(calls::socket(libc::AF_INET, libc::SOCK_STREAM, 0), "socket");
        let a = loopback(0);
        let len = std::mem::size_of::<sockaddr_in>() as socklen_t;
        ok(calls::bind(l, (&a as *const sockaddr_in).cast(), len), "bind");
        ok(calls::listen(l, 16), "listen");
        let mut got = loopback(0);
        let mut glen = len;
        ok(libc::getsockname(l, (&mut got as *mut sockaddr_in).cast::<sockaddr>(), &mut glen), "getsockname");
        (l, u16::from_be(got.sin_port))
    }
}

fn connect(port: u16) -> c_int {
    // SAFETY: as above.
    unsafe {
        let c = ok(calls::socket(libc::AF_INET, libc::SOCK_STREAM, 0), "socket");
        let a = loopback(port);
        let len = std::mem::size_of::<sockaddr_in>() as socklen_t;
        ok(calls::connect(c, (&a as *const sockaddr_in).cast(), len), "connect");
        c
    }
}

/// A carried connection whose two ends are descriptors of this process:
/// (accepted, connector).
fn carried_pair() -> (c_int, c_int) {
    let (l, port) = listener();
    let c = connect(port);
    // SAFETY: accept on our listener, no address wanted; then our listener closed.
    let a = unsafe { ok(calls::accept(l, std::ptr::null_mut(), std::ptr::null_mut()), "accept") };
    // SAFETY: our listener.
    unsafe { calls::close(l) };
    assert_eq!(carried(a), Some(Carried::SharedMemory), "the acceptor attached");
    assert_eq!(carried(c), Some(Carried::SharedMemory), "the connector attached");
    (a, c)
}

fn epoll_set() -> c_int {
    // SAFETY: plain epoll_create1.
    ok(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }, "epoll_create1")
}

fn add(ep: c_int, fd: c_int, events: u32, data: u64) {
    let mut ev = epoll_event { events, u64: data };
    // SAFETY: the library's epoll_ctl with a local event.
    ok(unsafe { calls::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) }, "epoll_ctl add");
}

/// One `epoll_wait(ep, .., 0)`: the events reported, as (data, events).
fn poll_once(ep: c_int) -> Vec<(u64, u32)> {
    let mut out = [epoll_event { events: 0, u64: 0 }; 16];
    // SAFETY: a local buffer of 16 events.
    let n = ok(unsafe { calls::epoll_wait(ep, out.as_mut_ptr(), 16, 0) }, "epoll_wait");
    out[..n as usize].iter().map(|e| ({ e.u64 }, { e.events })).collect()
}

fn pipe() -> [c_int; 2] {
    let mut p = [0; 2];
    // SAFETY: a local array of two descriptors.
    ok(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) }, "pipe2");
    p
}

#[test]
fn a_dead_peer_is_reported_to_a_set_of_carried_members_alone() {
    init();
    let (a, c) = carried_pair();
    let go = pipe();
    // SAFETY: fork; the child only reads a pipe and leaves with _exit.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork: {}", std::io::Error::last_os_error());
    if child == 0 {
        let mut b = [0u8; 1];
        // SAFETY: the child waits for its cue (blocking read of a local byte), then
        // dies without closing anything, as a crashed process would.
        unsafe {
            let flags = libc::fcntl(go[0], libc::F_GETFL);
            libc::fcntl(go[0], libc::F_SETFL, flags & !libc::O_NONBLOCK);
            libc::read(go[0], b.as_mut_ptr().cast::<c_void>(), 1);
            libc::_exit(0);
        }
    }
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
    // SAFETY: the cue, one byte from a local; then the child's end.
    unsafe {
        assert_eq!(libc::write(go[1], b"q".as_ptr().cast::<c_void>(), 1), 1);
        let mut status = 0;
        assert_eq!(libc::waitpid(child, &mut status, 0), child);
    }
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
        libc::close(go[0]);
        libc::close(go[1]);
    }
}
