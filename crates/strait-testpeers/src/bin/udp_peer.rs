//! Test peer for UDP under libstrait_preload.so: checks datagram semantics with plain
//! libc calls (which the preload library interposes). Every mode passes over the
//! kernel's loopback as well (the tests run it both ways: the kernel is the
//! reference).
//!
//! `strait-udp-peer server MODE` binds 127.0.0.1 (port 0), prints `PORT <n>` and
//! plays its part; `strait-udp-peer client PORT MODE` plays the other. Every failed
//! check panics (non-zero exit). Modes: semantics, many, drops, deadrecv, deadsend,
//! closed, fork.

use std::io::Write;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use libc::c_int;
use strait_testpeers::alarm_in_100ms;

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn pattern(seed: usize, i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) as u8
}

fn sockaddr_in(port: u16) -> libc::sockaddr_in {
    // SAFETY: sockaddr_in is plain old data.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_port = port.to_be();
    sa.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
    sa
}

/// An unbound UDP socket (the kernel, or strait, binds it at the first send).
fn raw_socket() -> c_int {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", errno());
    fd
}

fn send_to(fd: c_int, data: &[u8], port: u16) -> isize {
    let sa = sockaddr_in(port);
    // SAFETY: a live buffer and a local address.
    unsafe {
        libc::sendto(
            fd,
            data.as_ptr().cast(),
            data.len(),
            0,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    }
}

/// recvfrom into `buf` with `flags`: (result, source port, source is 127.0.0.1).
fn recv_from(fd: c_int, buf: &mut [u8], flags: c_int) -> (isize, u16, bool) {
    // SAFETY: sockaddr_in is plain old data.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a live buffer and a local address buffer with its length.
    let n = unsafe {
        libc::recvfrom(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            flags,
            (&mut sa as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if n < 0 {
        return (n, 0, false);
    }
    assert_eq!(len as usize, std::mem::size_of::<libc::sockaddr_in>(), "address length");
    assert_eq!(sa.sin_family as c_int, libc::AF_INET);
    (n, u16::from_be(sa.sin_port), sa.sin_addr.s_addr == u32::from_ne_bytes([127, 0, 0, 1]))
}

fn local_port(fd: c_int) -> u16 {
    // SAFETY: sockaddr_in is plain old data.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a local address buffer and its length.
    assert_eq!(unsafe { libc::getsockname(fd, (&mut sa as *mut libc::sockaddr_in).cast(), &mut len) }, 0);
    u16::from_be(sa.sin_port)
}

fn poll1(fd: c_int, ms: c_int) -> i16 {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    assert!(r >= 0, "poll: {}", errno());
    p.revents
}

fn fionread(fd: c_int) -> c_int {
    let mut n: c_int = -1;
    // SAFETY: FIONREAD writes an int.
    assert_eq!(unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) }, 0);
    n
}

/// Receives one datagram (blocking) and returns it with its source port.
fn recv_dgram(fd: c_int) -> (Vec<u8>, u16) {
    let mut buf = vec![0u8; 70_000];
    let (n, port, lo) = recv_from(fd, &mut buf, 0);
    assert!(n >= 0, "recvfrom: {}", errno());
    assert!(lo, "source address is not 127.0.0.1");
    buf.truncate(n as usize);
    (buf, port)
}

fn expect(fd: c_int, what: &[u8]) -> u16 {
    let (d, p) = recv_dgram(fd);
    assert_eq!(String::from_utf8_lossy(&d), String::from_utf8_lossy(what));
    p
}

const SIZES: &[usize] = &[0, 1, 7, 100, 1472, 8192, 65_507];

// ------------------------------------------------------------------ semantics

fn semantics_server(fd: c_int) {
    let mut buf = vec![0u8; 70_000];
    // The client's socket was unbound: its first datagram carries the port the
    // library (or the kernel) bound, the second tells which port that was.
    let (_, p1) = recv_dgram(fd);
    let (d, p2) = recv_dgram(fd);
    let said: u16 = String::from_utf8_lossy(&d).parse().expect("port");
    assert!(p1 == said && p2 == said, "source ports {p1} {p2}, the client says {said}");
    let client = said;
    let reply = |what: &str| assert_eq!(send_to(fd, what.as_bytes(), client), what.len() as isize);
    // Message boundaries, every size.
    for (k, &size) in SIZES.iter().enumerate() {
        let (d, p) = recv_dgram(fd);
        assert_eq!(p, client);
        assert_eq!(d.len(), size, "datagram {k}");
        assert!(d.iter().enumerate().all(|(i, &b)| b == pattern(k, i)), "datagram {k} content");
    }
    reply("sizes");
    // Truncation: the rest of a datagram is lost; MSG_TRUNC returns the real length;
    // recvmsg flags it.
    let (n, _, _) = recv_from(fd, &mut buf[..10], 0);
    assert_eq!(n, 10);
    assert!(buf[..10].iter().enumerate().all(|(i, &b)| b == pattern(1, i)));
    let (n, _, _) = recv_from(fd, &mut buf[..10], libc::MSG_TRUNC);
    assert_eq!(n, 100, "MSG_TRUNC returns the datagram's length");
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: 10 };
    // SAFETY: msghdr is plain old data.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    m.msg_name = (&mut sa as *mut libc::sockaddr_in).cast();
    m.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: the msghdr points at live locals.
    let n = unsafe { libc::recvmsg(fd, &mut m, 0) };
    assert_eq!(n, 10);
    assert!(m.msg_flags & libc::MSG_TRUNC != 0, "recvmsg sets MSG_TRUNC");
    assert_eq!(u16::from_be(sa.sin_port), client);
    reply("trunc");
    // MSG_PEEK and FIONREAD (the size of the next datagram).
    while poll1(fd, 5000) == 0 {}
    assert_eq!(fionread(fd), 7);
    let (n, p, _) = recv_from(fd, &mut buf, libc::MSG_PEEK);
    assert_eq!((n, p), (7, client));
    assert_eq!(&buf[..7], b"peek-me");
    let (n, _, _) = recv_from(fd, &mut buf, libc::MSG_PEEK);
    assert_eq!(n, 7);
    expect(fd, b"peek-me");
    // Nothing waiting: EAGAIN without blocking, poll times out, FIONREAD is 0.
    let (n, _, _) = recv_from(fd, &mut buf, libc::MSG_DONTWAIT);
    assert!(n < 0 && errno() == libc::EAGAIN, "empty MSG_DONTWAIT: {n} {}", errno());
    assert_eq!(poll1(fd, 30), 0);
    assert_eq!(fionread(fd), 0);
    // A non-blocking socket (FIONBIO) too.
    let on: c_int = 1;
    // SAFETY: FIONBIO reads an int.
    assert_eq!(unsafe { libc::ioctl(fd, libc::FIONBIO, &on) }, 0);
    let (n, _, _) = recv_from(fd, &mut buf, 0);
    assert!(n < 0 && errno() == libc::EAGAIN);
    let off: c_int = 0;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::ioctl(fd, libc::FIONBIO, &off) }, 0);
    reply("go-poll");
    assert_eq!(poll1(fd, 10_000), libc::POLLIN, "poll sees the datagram");
    expect(fd, b"polled");
    // select.
    reply("go-select");
    // SAFETY: fd_set is plain old data; FD_* on a local set.
    unsafe {
        let mut rs: libc::fd_set = std::mem::zeroed();
        libc::FD_SET(fd, &mut rs);
        let mut tv = libc::timeval { tv_sec: 10, tv_usec: 0 };
        let r = libc::select(fd + 1, &mut rs, std::ptr::null_mut(), std::ptr::null_mut(), &mut tv);
        assert_eq!(r, 1);
        assert!(libc::FD_ISSET(fd, &rs));
    }
    expect(fd, b"selected");
    // epoll, level-triggered then edge-triggered.
    // SAFETY: plain syscall.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(ep >= 0);
    let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 77 };
    // SAFETY: a local event.
    assert_eq!(unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) }, 0);
    let wait = |ms: c_int| {
        let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: a local buffer of 4 events.
        let n = unsafe { libc::epoll_wait(ep, out.as_mut_ptr(), 4, ms) };
        assert!(n >= 0, "epoll_wait: {}", errno());
        out[..n as usize].iter().map(|e| (e.u64, e.events)).collect::<Vec<_>>()
    };
    assert!(wait(20).is_empty());
    reply("go-epoll");
    let got = wait(10_000);
    assert_eq!(got.len(), 1, "one event for the socket: {got:?}");
    assert_eq!(got[0].0, 77);
    assert!(got[0].1 & libc::EPOLLIN as u32 != 0);
    // Level-triggered: still ready until read.
    assert_eq!(wait(0).len(), 1);
    expect(fd, b"epolled");
    assert!(wait(0).is_empty());
    let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLET) as u32, u64: 78 };
    // SAFETY: a local event.
    assert_eq!(unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_MOD, fd, &mut ev) }, 0);
    reply("go-et");
    let got = wait(10_000);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].0, 78);
    // Edge-triggered: no second report for the same datagram.
    assert!(wait(30).is_empty());
    expect(fd, b"edge");
    // SAFETY: closes our epoll set.
    unsafe { libc::close(ep) };
    // recvmmsg of three datagrams the client sent with one sendmmsg.
    reply("go-mmsg");
    while poll1(fd, 5000) == 0 {}
    std::thread::sleep(Duration::from_millis(50));
    let mut bufs = [[0u8; 8]; 3];
    // SAFETY: iovec and mmsghdr are plain old data.
    let mut iovs: [libc::iovec; 3] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut names: [libc::sockaddr_in; 3] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut mm: [libc::mmsghdr; 3] = unsafe { std::mem::zeroed() };
    for i in 0..3 {
        iovs[i] = libc::iovec { iov_base: bufs[i].as_mut_ptr().cast(), iov_len: 8 };
        mm[i].msg_hdr.msg_iov = &mut iovs[i];
        mm[i].msg_hdr.msg_iovlen = 1;
        mm[i].msg_hdr.msg_name = (&mut names[i] as *mut libc::sockaddr_in).cast();
        mm[i].msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    }
    // SAFETY: three mmsghdrs pointing at live locals.
    let n = unsafe { libc::recvmmsg(fd, mm.as_mut_ptr(), 3, libc::MSG_WAITFORONE, std::ptr::null_mut()) };
    assert_eq!(n, 3, "recvmmsg: {}", errno());
    for (i, want) in [&b"m1"[..], b"m22", b"m333"].iter().enumerate() {
        assert_eq!(&bufs[i][..mm[i].msg_len as usize], *want);
        assert_eq!(u16::from_be(names[i].sin_port), client);
    }
    // A connected client: it only hears from us.
    reply("go-connected");
    let p = expect(fd, b"via connect");
    assert_eq!(p, client);
    reply("after");
    expect(fd, b"done");
    println!("semantics server ok");
}

fn semantics_client(port: u16) {
    let fd = raw_socket();
    assert_eq!(send_to(fd, b"first", port), 5);
    let me = local_port(fd);
    assert!(me != 0, "the first sendto bound the socket");
    let s = me.to_string();
    assert_eq!(send_to(fd, s.as_bytes(), port), s.len() as isize);
    let expect_server = |what: &[u8]| {
        let mut buf = [0u8; 64];
        let (n, p, lo) = recv_from(fd, &mut buf, 0);
        assert!(n >= 0, "recvfrom: {}", errno());
        assert!(lo && p == port, "reply from {p}, not the server's {port}");
        assert_eq!(String::from_utf8_lossy(&buf[..n as usize]), String::from_utf8_lossy(what));
    };
    for (k, &size) in SIZES.iter().enumerate() {
        let d: Vec<u8> = (0..size).map(|i| pattern(k, i)).collect();
        assert_eq!(send_to(fd, &d, port), size as isize, "send {size}");
    }
    expect_server(b"sizes");
    let d: Vec<u8> = (0..100).map(|i| pattern(1, i)).collect();
    for _ in 0..3 {
        assert_eq!(send_to(fd, &d, port), 100);
    }
    expect_server(b"trunc");
    assert_eq!(send_to(fd, b"peek-me", port), 7);
    // One datagram per way the server waits (poll, select, epoll, edge-triggered
    // epoll): after its cue, and a moment later, so that it is really waiting.
    let waits: [(&[u8], &[u8]); 4] = [
        (b"go-poll", b"polled"),
        (b"go-select", b"selected"),
        (b"go-epoll", b"epolled"),
        (b"go-et", b"edge"),
    ];
    for (cue, msg) in waits {
        expect_server(cue);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(send_to(fd, msg, port), msg.len() as isize);
    }
    expect_server(b"go-mmsg");
    let msgs = [&b"m1"[..], b"m22", b"m333"];
    let sa = sockaddr_in(port);
    // SAFETY: iovec and mmsghdr are plain old data.
    let mut iovs: [libc::iovec; 3] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut mm: [libc::mmsghdr; 3] = unsafe { std::mem::zeroed() };
    for i in 0..3 {
        iovs[i] = libc::iovec { iov_base: msgs[i].as_ptr() as *mut _, iov_len: msgs[i].len() };
        mm[i].msg_hdr.msg_iov = &mut iovs[i];
        mm[i].msg_hdr.msg_iovlen = 1;
        mm[i].msg_hdr.msg_name = (&sa as *const libc::sockaddr_in) as *mut _;
        mm[i].msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    }
    // SAFETY: three mmsghdrs pointing at live locals.
    assert_eq!(unsafe { libc::sendmmsg(fd, mm.as_mut_ptr(), 3, 0) }, 3, "sendmmsg");
    for i in 0..3 {
        assert_eq!(mm[i].msg_len as usize, msgs[i].len());
    }
    expect_server(b"go-connected");
    // connect, then write/read without addresses; a stranger's datagram to the
    // connected socket is dropped (it is not from the peer).
    // SAFETY: a local address.
    let r = unsafe {
        libc::connect(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0);
    let stranger = raw_socket();
    assert_eq!(send_to(stranger, b"stranger", me), 8);
    // SAFETY: a live buffer.
    assert_eq!(unsafe { libc::write(fd, b"via connect".as_ptr().cast(), 11) }, 11);
    let mut buf = [0u8; 64];
    // SAFETY: a live buffer.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(&buf[..n.max(0) as usize], b"after", "a connected socket hears only its peer");
    // SAFETY: a live buffer.
    assert_eq!(unsafe { libc::send(fd, b"done".as_ptr().cast(), 4, 0) }, 4);
    println!("semantics client ok");
}

// ------------------------------------------------------------------ many senders

/// `senders` sockets on as many threads, `per` datagrams each: (port, seq) inside.
fn many_client(port: u16, senders: usize, per: usize) {
    let threads: Vec<_> = (0..senders)
        .map(|_| {
            std::thread::spawn(move || {
                let fd = raw_socket();
                let mut me = 0u16;
                for seq in 0..per as u32 {
                    let mut d = [0u8; 64];
                    d[0..2].copy_from_slice(&me.to_le_bytes());
                    d[2..6].copy_from_slice(&seq.to_le_bytes());
                    assert_eq!(
                        send_to(fd, &d[..6 + (seq as usize % 50)], port),
                        (6 + seq as usize % 50) as isize
                    );
                    if seq == 0 {
                        me = local_port(fd);
                    }
                    if seq % 8 == 0 {
                        // Stay below the receiver's buffer (no drops in this test).
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                // SAFETY: our socket.
                unsafe { libc::close(fd) };
            })
        })
        .collect();
    for t in threads {
        t.join().expect("sender");
    }
    println!("many client ok");
}

/// Receives `total` datagrams from any number of sources, waiting with poll; checks
/// each source's port against what it wrote and each source's order.
fn many_server(fd: c_int, total: usize) {
    use std::collections::HashMap;
    let mut last: HashMap<u16, u32> = HashMap::new();
    let mut got = 0;
    let mut buf = [0u8; 128];
    let end = Instant::now() + Duration::from_secs(20);
    while got < total {
        assert!(Instant::now() < end, "only {got} of {total} datagrams");
        if poll1(fd, 1000) == 0 {
            continue;
        }
        loop {
            let (n, p, lo) = recv_from(fd, &mut buf, libc::MSG_DONTWAIT);
            if n < 0 {
                assert_eq!(errno(), libc::EAGAIN);
                break;
            }
            assert!(lo);
            let seq = u32::from_le_bytes(buf[2..6].try_into().expect("4 bytes"));
            let said = u16::from_le_bytes([buf[0], buf[1]]);
            assert!(seq == 0 || said == p, "datagram {seq} says port {said}, came from {p}");
            let prev = last.insert(p, seq);
            assert_eq!(prev.map_or(0, |s| s + 1), seq, "from port {p}: order");
            got += 1;
        }
    }
    println!("many server ok {got} from {} sources", last.len());
}

// ------------------------------------------------------------------ shared

/// Datagrams the `shared` client sends.
const SHARED_COUNT: u32 = 100_000;
/// Threads of the `shared` server receiving on one socket.
const SHARED_THREADS: usize = 4;
/// Bytes of a `shared` datagram: its number, then the number's low byte repeated.
const SHARED_LEN: usize = 40;

/// `shared` server: four threads take datagrams from one socket at once (as a
/// multi-threaded server or processes sharing a socket do). Each datagram must
/// arrive whole and once; a thread's datagrams in order. Stops a while after the
/// client's `END`.
fn shared_server(s: UdpSocket) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let end = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..SHARED_THREADS)
        .map(|_| {
            let s = s.try_clone().expect("clone");
            let end = end.clone();
            std::thread::spawn(move || {
                s.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
                let mut got = Vec::new();
                let mut buf = [0u8; 64];
                let give_up = Instant::now() + Duration::from_secs(30);
                while Instant::now() < give_up {
                    match s.recv_from(&mut buf) {
                        Ok((3, _)) if &buf[..3] == b"END" => end.store(true, Ordering::Relaxed),
                        Ok((n, _)) => {
                            assert_eq!(n, SHARED_LEN, "datagram cut or merged");
                            let seq = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes"));
                            assert!(seq < SHARED_COUNT, "datagram number {seq} torn");
                            assert!(buf[4..n].iter().all(|&b| b == seq as u8), "datagram {seq} torn");
                            assert!(got.last().is_none_or(|&l| seq > l), "datagram {seq} after {got:?}");
                            got.push(seq);
                        }
                        Err(_) if end.load(Ordering::Relaxed) => break,
                        Err(_) => {}
                    }
                }
                got
            })
        })
        .collect();
    let mut all: Vec<u32> = threads.into_iter().flat_map(|t| t.join().expect("receiver thread")).collect();
    let got = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), got, "a datagram was taken twice");
    println!("shared server ok {got}");
}

/// `shared` client: sends the datagrams as fast as it can (a full ring drops, and
/// the library counts it), then `END` three times.
fn shared_client(port: u16) {
    let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let to: SocketAddr = ([127, 0, 0, 1], port).into();
    let mut d = [0u8; SHARED_LEN];
    for seq in 0..SHARED_COUNT {
        d[..4].copy_from_slice(&seq.to_le_bytes());
        d[4..].fill(seq as u8);
        s.send_to(&d, to).expect("send");
    }
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(100));
        s.send_to(b"END", to).expect("send");
    }
    println!("shared client ok {SHARED_COUNT}");
}

// ------------------------------------------------------------------ closeall

/// Rounds of the `closeall` echo; both ends sweep their descriptors after the first.
const SWEEP_ROUNDS: usize = 100;

/// A daemon's sweep of every descriptor it does not know (close() one by one, then
/// close_range above `keep`): the library's own must survive it.
fn sweep_descriptors(keep: c_int) {
    for other in 3..64 {
        if other != keep {
            // SAFETY: closes descriptors of this process (EBADF if not open).
            unsafe { libc::close(other) };
        }
    }
    // SAFETY: as above, every descriptor above ours.
    let r = unsafe { libc::close_range(keep as u32 + 1, u32::MAX, 0) };
    assert_eq!(r, 0, "close_range: {}", std::io::Error::last_os_error());
}

/// Files opened after a sweep, taking the lowest free numbers (where the library's
/// descriptors were, had the sweep closed them); each must stay open and empty (the
/// library must neither ring nor close a number it no longer owns).
fn occupy_low_numbers() -> Vec<(std::path::PathBuf, std::fs::File)> {
    (0..24)
        .map(|i| {
            let p = std::env::temp_dir().join(format!("strait-sweep-{}-{i}", std::process::id()));
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&p)
                .expect("temp file");
            (p, f)
        })
        .collect()
}

fn check_untouched(files: Vec<(std::path::PathBuf, std::fs::File)>) {
    for (p, f) in files {
        let len = f
            .metadata()
            .unwrap_or_else(|e| panic!("the program's file {} was closed under it: {e}", p.display()))
            .len();
        let _ = std::fs::remove_file(&p);
        assert_eq!(len, 0, "the library wrote {len} bytes into the program's file {}", p.display());
    }
}

fn closeall_server(s: &UdpSocket) {
    let mut buf = [0u8; 64];
    let mut files = Vec::new();
    for i in 0..=SWEEP_ROUNDS {
        let (n, from) = s.recv_from(&mut buf).expect("recv");
        s.send_to(&buf[..n], from).expect("echo");
        if i == 0 {
            sweep_descriptors(s.as_raw_fd());
            files = occupy_low_numbers();
        }
    }
    check_untouched(files);
    println!("closeall server ok");
}

fn closeall_client(port: u16) {
    let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let to: SocketAddr = ([127, 0, 0, 1], port).into();
    let mut buf = [0u8; 64];
    let mut files = Vec::new();
    for i in 0..=SWEEP_ROUNDS {
        let msg = format!("round {i}");
        s.send_to(msg.as_bytes(), to).expect("send");
        let (n, _) = s.recv_from(&mut buf).expect("echo within 10 s");
        assert_eq!(&buf[..n], msg.as_bytes(), "round {i}");
        if i == 0 {
            sweep_descriptors(s.as_raw_fd());
            files = occupy_low_numbers();
        }
        // Let the server's receive go to sleep now and then (its doorbell rings).
        if i % 10 == 5 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    check_untouched(files);
    println!("closeall client ok");
}

// ------------------------------------------------------------------ main

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let role = a.get(1).map(String::as_str).unwrap_or("");
    match role {
        "server" => {
            let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
            let port = s.local_addr().expect("addr").port();
            let mode = a.get(2).cloned().unwrap_or_default();
            if mode == "fork" {
                return fork_server(s);
            }
            if mode == "shared" {
                println!("PORT {port}");
                std::io::stdout().flush().ok();
                return shared_server(s);
            }
            println!("PORT {port}");
            std::io::stdout().flush().ok();
            let fd = s.as_raw_fd();
            match mode.as_str() {
                "semantics" => semantics_server(fd),
                "closeall" => closeall_server(&s),
                m if m.starts_with("many") => {
                    // Room for every datagram over the kernel too (root may exceed
                    // rmem_max).
                    set_int_option(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 8 << 20);
                    many_server(fd, m[4..].parse().expect("count"))
                }
                "drops" => {
                    // Not reading while the client sends more than fits: the rest is
                    // dropped, as a full kernel receive buffer drops.
                    std::thread::sleep(Duration::from_millis(1500));
                    let mut n = 0;
                    let mut buf = [0u8; 2048];
                    loop {
                        let (r, _, _) = recv_from(fd, &mut buf, libc::MSG_DONTWAIT);
                        if r < 0 {
                            break;
                        }
                        assert_eq!(r, 1000);
                        n += 1;
                    }
                    println!("received {n}");
                }
                "pktinfo" => pktinfo_server(fd),
                "etburst" => etburst_server(fd),
                "signals" => signals_server(fd),
                "deadrecv" => {
                    recv_dgram(fd);
                    // SAFETY: kills this process without closing anything.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                "deadsend" => {
                    s.set_read_timeout(Some(Duration::from_millis(500))).expect("timeout");
                    expect(fd, b"before death");
                    let t = Instant::now();
                    let mut buf = [0u8; 16];
                    let e = s.recv_from(&mut buf).expect_err("nothing after the sender died");
                    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
                    assert!(t.elapsed() < Duration::from_secs(3));
                    // A new sender still gets through.
                    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
                    expect(fd, b"newcomer");
                    println!("deadsend ok");
                }
                "closed" => {
                    let (_, p) = recv_dgram(fd);
                    assert_eq!(send_to(fd, b"bye", p), 3);
                    drop(s);
                    println!("closed");
                    std::io::stdout().flush().ok();
                    std::thread::sleep(Duration::from_millis(1500));
                }
                _ => panic!("unknown mode {mode}"),
            }
        }
        "client" => {
            let port: u16 = a[2].parse().expect("port");
            match a.get(3).map(String::as_str).unwrap_or("") {
                "semantics" => semantics_client(port),
                "closeall" => closeall_client(port),
                m if m.starts_with("many") => {
                    let (n, per) = m[4..].split_once('x').expect("manyNxM");
                    many_client(port, n.parse().expect("n"), per.parse().expect("m"));
                }
                "drops" => {
                    let fd = raw_socket();
                    let d = [7u8; 1000];
                    for _ in 0..20_000 {
                        assert_eq!(send_to(fd, &d, port), 1000, "a send to a full receiver succeeds");
                    }
                    println!("sent 20000");
                }
                "deadrecv" => {
                    let fd = raw_socket();
                    assert_eq!(send_to(fd, b"x", port), 1);
                    std::thread::sleep(Duration::from_millis(300));
                    // The receiver is gone: sends still succeed (as the kernel's do on
                    // an unconnected socket) and never block.
                    let t = Instant::now();
                    for _ in 0..20_000 {
                        assert_eq!(send_to(fd, &[1u8; 100], port), 100);
                    }
                    assert!(t.elapsed() < Duration::from_secs(10));
                    println!("deadrecv ok");
                }
                "deadsend" => {
                    let fd = raw_socket();
                    assert_eq!(send_to(fd, b"before death", port), 12);
                    // Die; the test then runs a "newcomer" client.
                    std::thread::sleep(Duration::from_millis(50));
                    // SAFETY: kills this process without closing anything.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                "newcomer" => {
                    // After the receiver's wait timed out.
                    std::thread::sleep(Duration::from_millis(1200));
                    let fd = raw_socket();
                    assert_eq!(send_to(fd, b"newcomer", port), 8);
                }
                "closed" => closed_client(port),
                "signals" => signals_client(port),
                "etburst" => {
                    // Bursts that arrive together (one edge for several datagrams),
                    // through the kernel when this client runs without strait.
                    let fd = raw_socket();
                    for b in 0..ET_BURSTS {
                        for i in 0..ET_BURST {
                            let d = ((b * ET_BURST + i) as u32).to_le_bytes();
                            assert_eq!(send_to(fd, &d, port), 4);
                        }
                        std::thread::sleep(Duration::from_micros(500));
                    }
                    println!("etburst sent {}", ET_BURSTS * ET_BURST);
                }
                "pktinfo" => {
                    let fd = raw_socket();
                    for _ in 0..3 {
                        assert_eq!(send_to(fd, b"where to?", port), 9);
                    }
                }
                "shared" => shared_client(port),
                "fork" => {
                    let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
                    let to: SocketAddr = ([127, 0, 0, 1], port).into();
                    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
                    let mut buf = [0u8; 16];
                    for (msg, want) in [(&b"1"[..], &b"child"[..]), (b"2", b"parent")] {
                        if msg == b"2" {
                            // After the child's exit: a datagram sent to a process that
                            // then exits without reading it is lost under strait.
                            std::thread::sleep(Duration::from_millis(300));
                        }
                        s.send_to(msg, to).expect("send");
                        let (n, from) = s.recv_from(&mut buf).expect("reply");
                        assert_eq!(from, to);
                        assert_eq!(&buf[..n], want);
                    }
                    println!("fork client ok");
                }
                m => panic!("unknown mode {m}"),
            }
        }
        _ => {
            eprintln!("usage: strait-udp-peer server MODE | client PORT MODE");
            std::process::exit(2);
        }
    }
    std::io::stdout().flush().ok();
}

/// `setsockopt` of an int option; its result.
/// Bursts and datagrams per burst of the `etburst` modes.
const ET_BURSTS: usize = 200;
const ET_BURST: usize = 8;

/// Edge-triggered epoll, reading until EAGAIN at each edge, as event loops do:
/// every datagram must be read (a receive that answers EAGAIN while one waits
/// strands it until the next edge, and after the last burst there is none).
fn etburst_server(fd: c_int) {
    // SAFETY: plain syscalls on our descriptors.
    let ep = unsafe {
        libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK);
        libc::epoll_create1(libc::EPOLL_CLOEXEC)
    };
    let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLET) as u32, u64: 1 };
    // SAFETY: a live event; our descriptors.
    assert_eq!(unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) }, 0);
    let mut seen = vec![false; ET_BURSTS * ET_BURST];
    let mut got = 0;
    let mut buf = [0u8; 64];
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 4];
    // Until a quiet second after the first datagram (or 20 s without any).
    let mut wait_ms = 20_000;
    // SAFETY: a live event array.
    while unsafe { libc::epoll_wait(ep, events.as_mut_ptr(), 4, wait_ms) } > 0 {
        wait_ms = 1000;
        loop {
            let (r, _, _) = recv_from(fd, &mut buf, 0);
            if r < 0 {
                assert_eq!(errno(), libc::EAGAIN, "recv");
                break;
            }
            assert_eq!(r, 4);
            let i = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            assert!(!seen[i], "datagram {i} twice");
            seen[i] = true;
            got += 1;
        }
    }
    println!("etburst received {got}");
}

/// A blocked receive interrupted by a signal: EINTR without SA_RESTART (the client
/// is silent until told); SO_RCVTIMEO ends it with EAGAIN; with SA_RESTART it goes
/// on and returns the datagram.
fn signals_server(fd: c_int) {
    let p = expect(fd, b"hello");
    alarm_in_100ms(false);
    let t = Instant::now();
    let mut buf = [0u8; 64];
    let (n, _, _) = recv_from(fd, &mut buf, 0);
    assert!(n == -1 && errno() == libc::EINTR, "interrupted receive: {n} {}", errno());
    assert!(t.elapsed() < Duration::from_secs(2), "EINTR after {:?}", t.elapsed());
    // SO_RCVTIMEO bounds the whole wait, a spin included (the test also runs this
    // with a spin budget of 3 s).
    let tv = libc::timeval { tv_sec: 0, tv_usec: 50_000 };
    let set = |tv: &libc::timeval| {
        // SAFETY: a local timeval and its size.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        }
    };
    assert_eq!(set(&tv), 0);
    let t = Instant::now();
    let (n, _, _) = recv_from(fd, &mut buf, 0);
    assert!(n == -1 && errno() == libc::EAGAIN, "timed-out receive: {n} {}", errno());
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "a 50 ms SO_RCVTIMEO ended the receive after {:?}",
        t.elapsed()
    );
    assert_eq!(set(&libc::timeval { tv_sec: 0, tv_usec: 0 }), 0);
    alarm_in_100ms(true);
    assert_eq!(send_to(fd, b"go", p), 2);
    let t = Instant::now();
    expect(fd, b"late");
    assert!(t.elapsed() >= Duration::from_millis(200), "received before the datagram was sent");
    println!("signals server ok");
}

fn signals_client(port: u16) {
    let fd = raw_socket();
    assert_eq!(send_to(fd, b"hello", port), 5);
    let mut buf = [0u8; 16];
    let (n, _, _) = recv_from(fd, &mut buf, 0);
    assert_eq!(n, 2, "go: {}", errno());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(send_to(fd, b"late", port), 4);
    println!("signals client ok");
}

fn set_int_option(fd: c_int, level: c_int, name: c_int, value: c_int) -> c_int {
    // SAFETY: a local int option and its size.
    unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const c_int).cast(),
            std::mem::size_of::<c_int>() as libc::socklen_t,
        )
    }
}

/// A receiver that asks for IP_PKTINFO gets it with every datagram (strait then
/// leaves its receiving side to the kernel).
fn pktinfo_server(fd: c_int) {
    assert_eq!(set_int_option(fd, libc::IPPROTO_IP, libc::IP_PKTINFO, 1), 0);
    println!("pktinfo on");
    std::io::stdout().flush().ok();
    for _ in 0..3 {
        let mut buf = [0u8; 64];
        let mut cbuf = [0u64; 16];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        // SAFETY: msghdr is plain old data.
        let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
        m.msg_iov = &mut iov;
        m.msg_iovlen = 1;
        m.msg_control = cbuf.as_mut_ptr().cast();
        m.msg_controllen = std::mem::size_of_val(&cbuf) as _;
        // SAFETY: the msghdr points at live locals.
        let n = unsafe { libc::recvmsg(fd, &mut m, 0) };
        assert_eq!(n, 9, "recvmsg: {}", errno());
        let mut found = false;
        // SAFETY: walks the control messages the kernel wrote.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&m);
            while !c.is_null() {
                if (*c).cmsg_level == libc::IPPROTO_IP && (*c).cmsg_type == libc::IP_PKTINFO {
                    let info = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::in_pktinfo>());
                    assert_eq!(info.ipi_addr.s_addr, u32::from_ne_bytes([127, 0, 0, 1]));
                    found = true;
                }
                c = libc::CMSG_NXTHDR(&m, c);
            }
        }
        assert!(found, "no IP_PKTINFO with the datagram");
    }
    println!("pktinfo ok");
}

/// A connected client whose server closes its socket: sends still succeed, then the
/// kernel's port-unreachable answer surfaces as ECONNREFUSED.
fn closed_client(port: u16) {
    let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
    s.connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    s.send(b"hello").expect("send");
    let mut buf = [0u8; 16];
    let n = s.recv(&mut buf).expect("bye");
    assert_eq!(&buf[..n], b"bye");
    // The server closes its socket right after answering.
    std::thread::sleep(Duration::from_millis(300));
    s.send(b"anyone?").expect("a send to a closed port succeeds");
    let e = s.recv(&mut buf).expect_err("nothing comes back");
    assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED), "{e}");
    println!("closed client ok");
}

/// Forks after binding: the child answers the first datagram and exits, the parent
/// (after waiting for it) answers the second.
fn fork_server(s: UdpSocket) {
    println!("PORT {}", s.local_addr().expect("addr").port());
    std::io::stdout().flush().ok();
    let fd = s.as_raw_fd();
    // SAFETY: fork in a single-threaded test program.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    let mut buf = [0u8; 16];
    if pid == 0 {
        let (n, p, _) = recv_from(fd, &mut buf, 0);
        assert_eq!(&buf[..n as usize], b"1");
        assert_eq!(send_to(fd, b"child", p), 5);
        std::process::exit(0);
    }
    let mut st = 0;
    // SAFETY: waits for our child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
    assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "child failed");
    let (n, p, _) = recv_from(fd, &mut buf, 0);
    assert_eq!(&buf[..n as usize], b"2");
    assert_eq!(send_to(fd, b"parent", p), 6);
    println!("fork server ok");
}
