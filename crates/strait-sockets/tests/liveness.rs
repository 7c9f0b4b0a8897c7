//! The peer's hang-up comes through the program's own TCP socket (no Unix socket of
//! the library's per connection): the kernel hangs it up when the last holder of
//! the peer's socket is gone, and only then. Two things follow, each attacked here:
//! a peer's `shutdown` must never reach the kernel socket (its FIN would read as
//! the peer's death), and an epoll set must keep watching a connection whose
//! registered descriptor the program closes while another one stays open. A close
//! is told by that hang-up too (no mark in the rings, which a process holding the
//! socket unseen would make a lie), and seen at the next look.

use std::sync::Once;
use std::time::{Duration, Instant};

use libc::c_void;
use strait_sockets::calls;

mod common;
use common::*;

/// Sets the library up once; the guard runs the tests one at a time (a child forked
/// by one would hold the other tests' sockets, and their peers would never hang up).
fn init() -> std::sync::MutexGuard<'static, ()> {
    static INIT: Once = Once::new();
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    INIT.call_once(|| {
        strait_sockets::init();
        // SAFETY: plain signal disposition: a wrong EPIPE must fail an assertion,
        // not kill the test process.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    });
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bytes moved after the half-close: several rings' worth, so the writer sleeps in
/// the library waiting for room (where it looks at the peer's hang-up).
const AFTER_HALF_CLOSE: usize = 8 << 20;

/// The connector shuts its sending side; the acceptor reads the end of stream and
/// then writes 8 MiB, which the connector reads whole. A shutdown forwarded to the
/// kernel socket would hang it up at the acceptor, which would take the peer for
/// dead and fail its writes (EPIPE) once it waits for room.
#[test]
fn a_peers_half_close_is_not_its_hang_up() {
    let _serial = init();
    let (a, c) = carried_pair();
    // SAFETY: the library's shutdown on our descriptor.
    assert_eq!(unsafe { calls::shutdown(c, libc::SHUT_WR) }, 0, "shutdown");
    let mut b = [0u8; 16];
    // SAFETY: reads into a local buffer.
    assert_eq!(unsafe { calls::read(a, b.as_mut_ptr().cast::<c_void>(), b.len()) }, 0, "end of stream");
    let reader = std::thread::spawn(move || {
        // The writer fills the ring and waits first.
        std::thread::sleep(Duration::from_millis(200));
        let mut buf = vec![0u8; 1 << 16];
        let (mut got, mut sum) = (0usize, 0u64);
        loop {
            // SAFETY: reads into a local buffer.
            let n = unsafe { calls::read(c, buf.as_mut_ptr().cast::<c_void>(), buf.len()) };
            assert!(n >= 0, "read: {}", std::io::Error::last_os_error());
            if n == 0 {
                break;
            }
            sum += buf[..n as usize].iter().map(|&x| x as u64).sum::<u64>();
            got += n as usize;
        }
        (got, sum)
    });
    let chunk: Vec<u8> = (0..1 << 16).map(|i| (i % 251) as u8).collect();
    let mut sent = 0usize;
    while sent < AFTER_HALF_CLOSE {
        // SAFETY: writes from a local buffer.
        let n = unsafe { calls::write(a, chunk.as_ptr().cast::<c_void>(), chunk.len()) };
        assert!(n > 0, "write after the peer's half-close: {}", std::io::Error::last_os_error());
        sent += n as usize;
        assert_eq!(n as usize, chunk.len(), "a blocking write takes it all");
    }
    // SAFETY: our descriptor: the connector reads its end of stream.
    unsafe { calls::close(a) };
    let (got, sum) = reader.join().expect("reader");
    let want: u64 = chunk.iter().map(|&x| x as u64).sum::<u64>() * (AFTER_HALF_CLOSE / chunk.len()) as u64;
    assert_eq!((got, sum), (AFTER_HALF_CLOSE, want), "every byte arrived");
    // SAFETY: our descriptor.
    unsafe { calls::close(c) };
}

/// A set watches connection 1 through the descriptor the program added; the
/// program deletes that entry (the watch stays, as the library keeps a deleted
/// member's wakers until it is closed), closes the descriptor while a duplicate
/// stays open, and gives its number to connection 2 in the same set; then adds
/// connection 1 back under the duplicate. When connection 1's peer dies, the set
/// reports it. Had the watch stayed on the closed number, the kernel's report of
/// the hang-up would name connection 2, and connection 1 would never be looked at.
#[test]
fn a_set_watches_a_connection_through_its_remaining_descriptor() {
    let _serial = init();
    let (a1, c1) = carried_pair();
    let (child, go) = fork_holder();
    // Connection 1's connector now lives in the child alone.
    // SAFETY: our descriptor.
    unsafe { calls::close(c1) };
    let ep = epoll_set();
    let events = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
    add(ep, a1, events, 1);
    let mut none = libc::epoll_event { events: 0, u64: 0 };
    // SAFETY: the library's calls on our descriptors.
    let dup1 = unsafe {
        ok(calls::epoll_ctl(ep, libc::EPOLL_CTL_DEL, a1, &mut none), "epoll_ctl del");
        let d = ok(calls::dup(a1), "dup");
        calls::close(a1);
        d
    };
    let (a2, c2) = carried_pair();
    // SAFETY: dup2 onto the free number connection 1's descriptor had.
    unsafe {
        ok(calls::dup2(a2, a1), "dup2");
        calls::close(a2);
    }
    add(ep, a1, events, 2);
    add(ep, dup1, events, 1);
    for _ in 0..10 {
        assert!(poll_once(ep).is_empty(), "both peers are alive");
    }
    let_holder_go(child, go);
    let deadline = Instant::now() + Duration::from_secs(5);
    let got = loop {
        let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: the library's epoll_wait into a local buffer of 4 events.
        let n = ok(unsafe { calls::epoll_wait(ep, out.as_mut_ptr(), 4, 100) }, "epoll_wait");
        let got: Vec<(u64, u32)> = out[..n as usize].iter().map(|e| ({ e.u64 }, { e.events })).collect();
        if !got.is_empty() || Instant::now() > deadline {
            break got;
        }
    };
    assert_eq!(got.len(), 1, "connection 1's hang-up is reported, connection 2 stays quiet: {got:?}");
    assert_eq!(got[0].0, 1, "connection 1: {got:?}");
    assert_ne!(got[0].1 & (libc::EPOLLHUP | libc::EPOLLRDHUP) as u32, 0, "a hang-up: {got:?}");
    // SAFETY: our descriptors.
    unsafe {
        calls::close(ep);
        calls::close(dup1);
        calls::close(a1);
        calls::close(c2);
    }
}

/// Non-blocking reads of an idle connection answer EAGAIN (the library asks the
/// kernel about the peer only now and then there); the peer closes; the very next
/// read is the end of stream. Without the close hint in shared memory it would
/// answer EAGAIN until the library next asked the kernel.
#[test]
fn a_closing_peer_is_seen_by_the_next_nonblocking_read() {
    let _serial = init();
    let (a, c) = carried_pair();
    set_nonblocking(a);
    let mut b = [0u8; 16];
    let read = |b: &mut [u8; 16]| {
        // SAFETY: reads into a local buffer.
        let n = unsafe { calls::read(a, b.as_mut_ptr().cast::<c_void>(), b.len()) };
        (n, std::io::Error::last_os_error().raw_os_error())
    };
    for _ in 0..10 {
        assert_eq!(read(&mut b), (-1, Some(libc::EAGAIN)), "nothing yet");
    }
    // SAFETY: our descriptor: the connection's last at that end.
    unsafe { calls::close(c) };
    assert_eq!(read(&mut b).0, 0, "the end of stream, at once");
    // SAFETY: our descriptor.
    unsafe { calls::close(a) };
}

/// The connector's process closes its descriptor while a forked child still holds
/// the socket: the connection lives (reads answer EAGAIN, not the end), as the
/// kernel's would; once the child is gone, the end of stream comes.
#[test]
fn a_close_while_another_process_holds_the_socket_is_no_end() {
    let _serial = init();
    let (a, c) = carried_pair();
    let (child, go) = fork_holder();
    // SAFETY: our descriptor.
    unsafe { calls::close(c) };
    set_nonblocking(a);
    let mut b = [0u8; 16];
    for _ in 0..100 {
        // SAFETY: reads into a local buffer.
        let n = unsafe { calls::read(a, b.as_mut_ptr().cast::<c_void>(), b.len()) };
        assert_eq!(n, -1, "the child still holds the connection: no end of stream");
    }
    let_holder_go(child, go);
    let mut p = libc::pollfd { fd: a, events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd, through the library.
    assert_eq!(unsafe { calls::poll(&mut p, 1, 5000) }, 1, "the child's exit is seen");
    // SAFETY: reads into a local buffer.
    assert_eq!(unsafe { calls::read(a, b.as_mut_ptr().cast::<c_void>(), b.len()) }, 0, "then the end");
    // SAFETY: our descriptors.
    unsafe {
        calls::close(a);
    }
}
