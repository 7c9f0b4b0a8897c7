//! The library's logic driven in-process, without the cdylib or `LD_PRELOAD`: both
//! ends of a TCP connection are threads of this test, calling `strait_sockets::calls`
//! as the shims would. The connection must be carried over shared memory (the
//! descriptor table says so), move a hashed stream both ways, survive `dup` and
//! `close` of the original, and end with end-of-stream as the kernel would. UDP
//! sockets get one table entry of the UDP kind.

use std::sync::Once;
use std::thread;

use libc::{c_int, c_void};
use strait_sockets::{calls, carried, Carried};

mod common;
use common::{connect, listener, ok};

fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(strait_sockets::init);
}

fn write_all(fd: c_int, mut buf: &[u8]) {
    while !buf.is_empty() {
        // SAFETY: a live buffer of buf.len() bytes.
        let n = unsafe { calls::write(fd, buf.as_ptr().cast::<c_void>(), buf.len()) };
        assert!(n > 0, "write: {}", std::io::Error::last_os_error());
        buf = &buf[n as usize..];
    }
}

/// Reads until end of stream.
fn read_to_end(fd: c_int) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        // SAFETY: a live buffer of buf.len() bytes.
        let n = unsafe { calls::read(fd, buf.as_mut_ptr().cast::<c_void>(), buf.len()) };
        assert!(n >= 0, "read: {}", std::io::Error::last_os_error());
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n as usize]);
    }
}

#[test]
fn a_tcp_connection_between_two_threads_is_carried_by_shared_memory() {
    init();
    let (l, port) = listener();
    let out = strait_sys::pattern(1, 4 << 20);
    let back = strait_sys::pattern(2, 3 << 20);
    let (out2, back2) = (out.clone(), back.clone());
    let client = thread::spawn(move || {
        let c = connect(port);
        write_all(c, &out2);
        // SAFETY: the library's shutdown on our descriptor.
        unsafe { ok(calls::shutdown(c, libc::SHUT_WR), "shutdown") };
        let got = read_to_end(c);
        let how = carried(c);
        // SAFETY: our descriptor.
        unsafe { calls::close(c) };
        (got, how)
    });
    // SAFETY: accept on our listener, no address wanted.
    let a = unsafe { ok(calls::accept(l, std::ptr::null_mut(), std::ptr::null_mut()), "accept") };
    assert_eq!(carried(a), Some(Carried::SharedMemory), "the acceptor attached");
    // A duplicate is the same connection; closing the original keeps it open.
    // SAFETY: the library's dup and close on our descriptors.
    let d = unsafe { ok(calls::dup(a), "dup") };
    assert_eq!(carried(d), Some(Carried::SharedMemory));
    // SAFETY: as above.
    unsafe { ok(calls::close(a), "close") };
    assert_eq!(carried(a), None, "a closed descriptor leaves the table");
    let got = read_to_end(d);
    assert!(got == out, "client -> server stream intact ({} of {} bytes)", got.len(), out.len());
    write_all(d, &back2);
    // SAFETY: our descriptors.
    unsafe {
        calls::close(d);
        calls::close(l);
    }
    let (got_back, how) = client.join().expect("client thread");
    assert!(got_back == back, "server -> client stream intact ({} of {} bytes)", got_back.len(), back.len());
    assert_eq!(how, Some(Carried::SharedMemory), "the connector was carried too");
}

#[test]
fn a_udp_socket_is_one_table_entry_of_the_udp_kind_and_dup_shares_it() {
    init();
    // SAFETY: the library's socket, dup and close with valid arguments.
    unsafe {
        let u = ok(calls::socket(libc::AF_INET, libc::SOCK_DGRAM, 0), "socket");
        assert_eq!(carried(u), Some(Carried::Udp));
        let d = ok(calls::dup(u), "dup");
        assert_eq!(carried(d), Some(Carried::Udp));
        calls::close(u);
        assert_eq!(carried(u), None);
        assert_eq!(carried(d), Some(Carried::Udp), "the duplicate still holds the socket");
        // A TCP socket is not carried until it connects or is accepted.
        let t = ok(calls::socket(libc::AF_INET, libc::SOCK_STREAM, 0), "socket");
        assert_eq!(carried(t), None);
        // dup2 of a plain socket onto the UDP socket's number replaces the entry.
        ok(calls::dup2(t, d), "dup2");
        assert_eq!(carried(d), None, "dup2 over a carried number takes it out of the table");
        calls::close(t);
        calls::close(d);
    }
}

#[test]
fn an_event_loop_polling_epoll_with_a_zero_timeout_sees_each_arrival_once() {
    init();
    let (l, port) = listener();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let client = thread::spawn(move || {
        let c = connect(port);
        for _ in 0..3 {
            go_rx.recv().expect("go");
            write_all(c, b"x");
        }
        go_rx.recv().expect("done");
        // SAFETY: our descriptor.
        unsafe { calls::close(c) };
    });
    // SAFETY: the library's calls with valid arguments and a local event buffer.
    unsafe {
        let a = ok(calls::accept(l, std::ptr::null_mut(), std::ptr::null_mut()), "accept");
        assert_eq!(carried(a), Some(Carried::SharedMemory));
        let ep = ok(libc::epoll_create1(libc::EPOLL_CLOEXEC), "epoll_create1");
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 7 };
        ok(calls::epoll_ctl(ep, libc::EPOLL_CTL_ADD, a, &mut ev), "epoll_ctl");
        let mut out = [libc::epoll_event { events: 0, u64: 0 }; 8];
        assert_eq!(calls::epoll_wait(ep, out.as_mut_ptr(), 8, 0), 0, "nothing yet");
        for round in 0..3 {
            go_tx.send(()).expect("go");
            // Busy-poll as an event loop does (bounded: a lost bell fails here).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let n = loop {
                let n = calls::epoll_wait(ep, out.as_mut_ptr(), 8, 0);
                if n != 0 || std::time::Instant::now() > deadline {
                    break n;
                }
            };
            assert_eq!(n, 1, "round {round}: the arrival was reported");
            assert_eq!({ out[0].u64 }, 7);
            let mut b = [0u8; 8];
            assert_eq!(calls::read(a, b.as_mut_ptr().cast::<c_void>(), 8), 1);
            assert_eq!(calls::epoll_wait(ep, out.as_mut_ptr(), 8, 0), 0, "round {round}: drained, not ready");
        }
        go_tx.send(()).expect("done");
        client.join().expect("client");
        calls::close(a);
        calls::close(ep);
        calls::close(l);
    }
}

/// Connected pairs made through the library: (accepted, connector) descriptors.
fn pairs(n: usize) -> Vec<(c_int, c_int)> {
    let (l, port) = listener();
    let clients: Vec<c_int> = (0..n).map(|_| connect(port)).collect();
    let out = clients
        .into_iter()
        .map(|c| {
            // SAFETY: accept on our listener, no address wanted.
            let a = unsafe { ok(calls::accept(l, std::ptr::null_mut(), std::ptr::null_mut()), "accept") };
            (a, c)
        })
        .collect();
    // SAFETY: our listener.
    unsafe { calls::close(l) };
    out
}

#[test]
fn epoll_entries_removed_and_readded_report_each_ready_descriptor_once() {
    init();
    // Both ends are threads of this process; the connector's first write settles it.
    let ps = pairs(6);
    // SAFETY: the library's calls with valid arguments and local buffers.
    unsafe {
        for &(a, c) in &ps {
            assert_eq!(carried(a), Some(Carried::SharedMemory));
            write_all(c, b"x");
        }
        let ep = ok(libc::epoll_create1(libc::EPOLL_CLOEXEC), "epoll_create1");
        let add = |fd: c_int, events: u32| {
            let mut ev = libc::epoll_event { events, u64: fd as u64 };
            ok(calls::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), "add");
        };
        let ready = || {
            let mut out = [libc::epoll_event { events: 0, u64: 0 }; 16];
            let n = ok(calls::epoll_wait(ep, out.as_mut_ptr(), 16, 0), "epoll_wait");
            let mut fds: Vec<c_int> = out[..n as usize].iter().map(|e| e.u64 as c_int).collect();
            fds.sort_unstable();
            fds
        };
        let level = libc::EPOLLIN as u32;
        for &(a, _) in &ps {
            add(a, level);
        }
        // (Descriptor numbers in the order epoll reports them: ready() sorts; other
        // tests of this process open descriptors meanwhile, so order of acceptance
        // says nothing.)
        let sorted = |v: &[(c_int, c_int)]| {
            let mut f: Vec<c_int> = v.iter().map(|p| p.0).collect();
            f.sort_unstable();
            f
        };
        let all = sorted(&ps);
        assert_eq!(ready(), all, "every connection has a byte: each reported once");
        assert_eq!(ready(), all, "level-triggered: still ready, still once each");
        // Remove three (their places in the set are reused below) and add two back
        // in another mode: no entry is reported twice, none lost.
        for &(a, _) in &ps[..3] {
            let mut ev = libc::epoll_event { events: 0, u64: 0 };
            ok(calls::epoll_ctl(ep, libc::EPOLL_CTL_DEL, a, &mut ev), "del");
        }
        let rest = sorted(&ps[3..]);
        assert_eq!(ready(), rest, "the removed ones are gone");
        add(ps[0].0, level | libc::EPOLLET as u32);
        add(ps[1].0, level | libc::EPOLLONESHOT as u32);
        let mut want: Vec<c_int> = vec![ps[0].0, ps[1].0];
        want.extend(&rest);
        want.sort_unstable();
        assert_eq!(ready(), want, "re-added entries reported once each");
        assert_eq!(ready(), rest, "edge-triggered and one-shot entries fired once");
        // A new byte on the edge-triggered one reports it again; the one-shot one
        // stays quiet until re-armed.
        write_all(ps[0].1, b"y");
        write_all(ps[1].1, b"y");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut got = ready();
        while !got.contains(&ps[0].0) && std::time::Instant::now() < deadline {
            got = ready();
        }
        assert!(got.contains(&ps[0].0) && !got.contains(&ps[1].0), "{got:?}");
        let mut ev = libc::epoll_event { events: level | libc::EPOLLONESHOT as u32, u64: ps[1].0 as u64 };
        ok(calls::epoll_ctl(ep, libc::EPOLL_CTL_MOD, ps[1].0, &mut ev), "mod");
        assert!(ready().contains(&ps[1].0), "re-armed one-shot entry reports");
        for (a, c) in ps {
            calls::close(a);
            calls::close(c);
        }
        calls::close(ep);
    }
}
