//! Test peer for libstrait_preload.so: a TCP client or server that checks socket
//! semantics with plain libc calls (which the preload library interposes).
//!
//! `strait-preload-peer server MODE` listens on 127.0.0.1 (or `$PEER_ADDR`; port 0), prints
//! `PORT <n>` and serves one connection; `strait-preload-peer client PORT MODE`
//! connects. Every check that fails panics (non-zero exit). Modes: echo, sink/source
//! (byte counts and a hash, for one side without strait), flags, die, fork.

use std::io::{BufRead, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, IntoRawFd};
use std::time::{Duration, Instant};

use libc::c_int;
use strait_testpeers::alarm_in_100ms;

const SIZES: &[usize] =
    &[1, 2, 7, 63, 64, 65, 1000, 4095, 4096, 4097, 65535, 65536, 65537, 262_143, 262_145, 1_000_003];

/// The IPv4 address the server listens on and the client connects to: 127.0.0.1,
/// or `$PEER_ADDR` (another host, for the cross-host tests).
fn peer_addr() -> std::net::Ipv4Addr {
    std::env::var("PEER_ADDR").ok().and_then(|a| a.parse().ok()).unwrap_or(std::net::Ipv4Addr::LOCALHOST)
}

fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn write_all(fd: c_int, mut buf: &[u8]) {
    while !buf.is_empty() {
        // SAFETY: a live buffer.
        let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
        assert!(n > 0, "write: {}", std::io::Error::last_os_error());
        buf = &buf[n as usize..];
    }
}

fn read_some(fd: c_int, buf: &mut [u8]) -> usize {
    // SAFETY: a live buffer.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n >= 0, "read: {}", std::io::Error::last_os_error());
    n as usize
}

fn read_exact(fd: c_int, buf: &mut [u8]) {
    let mut got = 0;
    while got < buf.len() {
        let n = read_some(fd, &mut buf[got..]);
        assert!(n > 0, "unexpected EOF after {got} of {} bytes", buf.len());
        got += n;
    }
}

fn fnv(h: &mut u64, data: &[u8]) {
    for &b in data {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
}

fn maps_has_strait() -> bool {
    std::fs::read_to_string("/proc/self/maps").map(|m| m.contains("memfd:strait-tcp")).unwrap_or(false)
}

/// True if any open descriptor is a memfd (strait must not keep one: the mapping is
/// the only way to the connection's memory).
fn fds_have_memfd() -> bool {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.flatten()
                .any(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().contains("memfd:")))
        })
        .unwrap_or(false)
}

/// recvmmsg, sendmmsg, splice both ways, pselect and sendfile on an accelerated
/// socket (server side).
fn extras_server(fd: c_int) {
    // SAFETY: libc calls on local buffers and descriptors.
    unsafe {
        let mut a = [0u8; 4];
        let mut b = [0u8; 4];
        let mut iov = [
            libc::iovec { iov_base: a.as_mut_ptr().cast(), iov_len: 4 },
            libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: 4 },
        ];
        let mut mm: [libc::mmsghdr; 2] = std::mem::zeroed();
        for (i, m) in mm.iter_mut().enumerate() {
            m.msg_hdr.msg_iov = &mut iov[i];
            m.msg_hdr.msg_iovlen = 1;
        }
        assert_eq!(libc::recvmmsg(fd, mm.as_mut_ptr(), 2, 0, std::ptr::null_mut()), 2, "recvmmsg");
        assert_eq!((&a, &b, mm[0].msg_len, mm[1].msg_len), (b"aaaa", b"bbbb", 4, 4));
        let (c, d) = (*b"cc", *b"dd");
        let mut siov = [
            libc::iovec { iov_base: c.as_ptr() as *mut _, iov_len: 2 },
            libc::iovec { iov_base: d.as_ptr() as *mut _, iov_len: 2 },
        ];
        let mut sm: [libc::mmsghdr; 2] = std::mem::zeroed();
        for (i, m) in sm.iter_mut().enumerate() {
            m.msg_hdr.msg_iov = &mut siov[i];
            m.msg_hdr.msg_iovlen = 1;
        }
        assert_eq!(libc::sendmmsg(fd, sm.as_mut_ptr(), 2, 0), 2, "sendmmsg");
        // splice socket -> pipe and pipe -> socket.
        let mut p = [0 as c_int; 2];
        assert_eq!(libc::pipe(p.as_mut_ptr()), 0);
        let mut got = 0;
        while got < 9 {
            let n = libc::splice(fd, std::ptr::null_mut(), p[1], std::ptr::null_mut(), 9 - got, 0);
            assert!(n > 0, "splice from the socket: {n} {}", errno());
            got += n as usize;
        }
        let mut buf = [0u8; 16];
        read_exact(p[0], &mut buf[..9]);
        assert_eq!(&buf[..9], b"splice-me");
        write_all(p[1], b"from-pipe");
        assert_eq!(
            libc::splice(p[0], std::ptr::null_mut(), fd, std::ptr::null_mut(), 9, 0),
            9,
            "splice to the socket"
        );
        // pselect.
        let mut rs: libc::fd_set = std::mem::zeroed();
        libc::FD_SET(fd, &mut rs);
        let ts = libc::timespec { tv_sec: 0, tv_nsec: 20_000_000 };
        assert_eq!(
            libc::pselect(fd + 1, &mut rs, std::ptr::null_mut(), std::ptr::null_mut(), &ts, std::ptr::null()),
            0
        );
        write_all(fd, b"!");
        libc::FD_SET(fd, &mut rs);
        let ts = libc::timespec { tv_sec: 5, tv_nsec: 0 };
        assert_eq!(
            libc::pselect(fd + 1, &mut rs, std::ptr::null_mut(), std::ptr::null_mut(), &ts, std::ptr::null()),
            1
        );
        read_exact(fd, &mut buf[..1]);
        assert_eq!(buf[0], b'p');
        // sendfile from a file.
        let path = std::env::temp_dir().join(format!("strait-sendfile-{}", std::process::id()));
        let data: Vec<u8> = (0..100_000u64).map(pattern).collect();
        std::fs::write(&path, &data).expect("temp file");
        let f = std::fs::File::open(&path).expect("open");
        let mut off: libc::off_t = 0;
        let mut sent = 0;
        while sent < data.len() {
            let n = libc::sendfile(fd, f.as_raw_fd(), &mut off, data.len() - sent);
            assert!(n > 0, "sendfile: {n} {}", errno());
            sent += n as usize;
        }
        assert_eq!(off as usize, data.len());
        let _ = std::fs::remove_file(&path);
    }
    println!("extras ok");
}

fn extras_client(fd: c_int) {
    let mut b = vec![0u8; 100_000];
    write_all(fd, b"aaaabbbb");
    read_exact(fd, &mut b[..4]);
    assert_eq!(&b[..4], b"ccdd");
    write_all(fd, b"splice-me");
    read_exact(fd, &mut b[..9]);
    assert_eq!(&b[..9], b"from-pipe");
    read_exact(fd, &mut b[..1]);
    assert_eq!(b[0], b'!');
    write_all(fd, b"p");
    read_exact(fd, &mut b);
    assert!(b.iter().enumerate().all(|(i, &x)| x == pattern(i as u64)), "sendfile data");
    println!("extras client ok");
}

/// A blocking read interrupted by a signal: EINTR without SA_RESTART; with
/// SA_RESTART it goes on and returns the data; SO_RCVTIMEO ends it with EAGAIN.
fn signals_server(fd: c_int) {
    let mut b = [0u8; 16];
    alarm_in_100ms(false);
    let t = Instant::now();
    // SAFETY: a live buffer.
    let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), 16) };
    assert!(n == -1 && errno() == libc::EINTR, "interrupted read: {n} {}", errno());
    assert!(t.elapsed() < Duration::from_secs(2));
    // SO_RCVTIMEO.
    let tv = libc::timeval { tv_sec: 0, tv_usec: 50_000 };
    // SAFETY: a local timeval.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&tv as *const libc::timeval).cast(), 16);
    }
    let t = Instant::now();
    // SAFETY: a live buffer.
    let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), 16) };
    assert!(n == -1 && errno() == libc::EAGAIN, "timed-out read: {n} {}", errno());
    // The timeout bounds the whole wait, a spin included (the test also runs this
    // with a spin budget of 3 s).
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "a 50 ms SO_RCVTIMEO ended the read after {:?}",
        t.elapsed()
    );
    let tv = libc::timeval { tv_sec: 0, tv_usec: 0 };
    // SAFETY: a local timeval.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&tv as *const libc::timeval).cast(), 16);
    }
    // With SA_RESTART the alarm does not end the read: the client's data does.
    alarm_in_100ms(true);
    write_all(fd, b"g");
    let t = Instant::now();
    read_exact(fd, &mut b[..4]);
    assert_eq!(&b[..4], b"late");
    assert!(t.elapsed() >= Duration::from_millis(200), "read returned before the data");
    write_all(fd, b"k");
    println!("signals ok");
}

/// `epoll_wait` is never restarted after a signal handler, SA_RESTART or not: the
/// alarm ends it with EINTR, also when it comes while the wait spins (the test runs
/// this server with a spin budget longer than the alarm's delay).
fn epoll_signal_server(fd: c_int) {
    // SAFETY: a new epoll set watching the connection; local event buffers.
    unsafe {
        let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        assert!(ep >= 0);
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 7 };
        assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
        alarm_in_100ms(true);
        let t = Instant::now();
        let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
        let n = libc::epoll_wait(ep, out.as_mut_ptr(), 4, -1);
        let waited = t.elapsed();
        assert!(n == -1 && errno() == libc::EINTR, "interrupted epoll_wait: {n} {}", errno());
        assert!(waited < Duration::from_millis(1500), "EINTR came {waited:?} after the wait began");
        libc::close(ep);
    }
    write_all(fd, b"k");
    println!("epoll signal ok");
}

fn poll1(fd: c_int, events: i16, ms: c_int) -> i16 {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    // SAFETY: one pollfd.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    assert!(r >= 0, "poll: {}", std::io::Error::last_os_error());
    p.revents
}

fn set_nonblock(fd: c_int, on: bool) {
    // SAFETY: plain fcntl calls.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, if on { fl | libc::O_NONBLOCK } else { fl & !libc::O_NONBLOCK });
    }
}

/// Echo: the server sends back everything until EOF; the client streams every size
/// from a second thread and checks the echo byte for byte, then half-closes and
/// expects EOF.
fn echo_server(fd: c_int) {
    let mut buf = vec![0u8; 70_000];
    let mut total = 0u64;
    loop {
        let n = read_some(fd, &mut buf);
        if n == 0 {
            break;
        }
        total += n as u64;
        write_all(fd, &buf[..n]);
    }
    println!("echoed {total}");
}

fn echo_client(fd: c_int) {
    let total: usize = SIZES.iter().sum();
    let wfd = fd;
    let writer = std::thread::spawn(move || {
        let mut off = 0u64;
        for &s in SIZES {
            let v: Vec<u8> = (off..off + s as u64).map(pattern).collect();
            // Alternate write, send and writev.
            match s % 3 {
                0 => write_all(wfd, &v),
                1 => {
                    let mut sent = 0;
                    while sent < v.len() {
                        // SAFETY: a live buffer.
                        let n = unsafe { libc::send(wfd, v[sent..].as_ptr().cast(), v.len() - sent, 0) };
                        assert!(n > 0);
                        sent += n as usize;
                    }
                }
                _ => {
                    let (a, b) = v.split_at(v.len() / 2);
                    let iov = [
                        libc::iovec { iov_base: a.as_ptr() as *mut _, iov_len: a.len() },
                        libc::iovec { iov_base: b.as_ptr() as *mut _, iov_len: b.len() },
                    ];
                    // SAFETY: two iovecs over a live buffer.
                    let n = unsafe { libc::writev(wfd, iov.as_ptr(), 2) };
                    assert_eq!(n as usize, v.len(), "blocking writev writes everything");
                }
            }
            off += s as u64;
        }
        // SAFETY: plain syscall.
        assert_eq!(unsafe { libc::shutdown(wfd, libc::SHUT_WR) }, 0);
    });
    let mut got = 0usize;
    let mut buf = vec![0u8; 100_000];
    while got < total {
        let n = read_some(fd, &mut buf);
        assert!(n > 0, "EOF after {got} of {total}");
        for (i, &b) in buf[..n].iter().enumerate() {
            assert_eq!(b, pattern((got + i) as u64), "byte {} differs", got + i);
        }
        got += n;
    }
    writer.join().expect("writer");
    assert_eq!(read_some(fd, &mut buf), 0, "EOF after the echo");
    println!("echo ok {total}");
}

fn source(fd: c_int, total: usize) {
    source_in(fd, total, &[50_000], false);
}

/// Writes `total` pattern bytes in writes of the `chunks` sizes in turn, and says
/// how many and their digest. `pause`: 2 ms before each write of 1 MiB or more, so
/// that the reader has emptied the ring and waits (with its buffer posted).
fn source_in(fd: c_int, total: usize, chunks: &[usize], pause: bool) {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut off = 0usize;
    for k in 0.. {
        if off >= total {
            break;
        }
        let n = (total - off).min(chunks[k % chunks.len()]);
        if pause && n >= 1 << 20 {
            std::thread::sleep(Duration::from_millis(2));
        }
        let v: Vec<u8> = (off as u64..(off + n) as u64).map(pattern).collect();
        fnv(&mut h, &v);
        write_all(fd, &v);
        off += n;
    }
    println!("sent {total} {h:016x}");
}

fn sink(fd: c_int) {
    sink_in(fd, &[65536]);
}

/// Reads until the end into buffers of the `lens` sizes in turn, and says how many
/// bytes and their digest.
fn sink_in(fd: c_int, lens: &[usize]) {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut total = 0usize;
    let mut buf = vec![0u8; lens.iter().copied().max().unwrap_or(1)];
    for k in 0.. {
        let n = read_some(fd, &mut buf[..lens[k % lens.len()]]);
        if n == 0 {
            break;
        }
        fnv(&mut h, &buf[..n]);
        total += n;
    }
    println!("received {total} {h:016x}");
}

/// Flags, non-blocking operation, poll/select/epoll, FIONREAD and EPIPE (server side;
/// the client follows the script in `flags_client`).
fn flags_server(fd: c_int) {
    let mut b = [0u8; 64];
    // Non-blocking read of an empty connection.
    // SAFETY: a live buffer.
    let r = unsafe { libc::recv(fd, b.as_mut_ptr().cast(), 64, libc::MSG_DONTWAIT) };
    assert!(r == -1 && errno() == libc::EAGAIN, "MSG_DONTWAIT on empty: {r} {}", errno());
    assert_eq!(poll1(fd, libc::POLLIN, 30), 0, "nothing to read yet");
    assert_eq!(poll1(fd, libc::POLLOUT, 0), libc::POLLOUT, "writable");
    write_all(fd, b"g");
    // The client sends "hello world".
    assert_eq!(poll1(fd, libc::POLLIN, 5000), libc::POLLIN);
    let mut avail: c_int = 0;
    let t0 = Instant::now();
    while avail < 11 && t0.elapsed() < Duration::from_secs(5) {
        // SAFETY: FIONREAD into a local int.
        assert_eq!(unsafe { libc::ioctl(fd, libc::FIONREAD, &mut avail) }, 0);
    }
    assert_eq!(avail, 11, "FIONREAD");
    // SAFETY: live buffers below.
    unsafe {
        assert_eq!(libc::recv(fd, b.as_mut_ptr().cast(), 5, libc::MSG_PEEK), 5);
        assert_eq!(&b[..5], b"hello");
        assert_eq!(libc::recv(fd, b.as_mut_ptr().cast(), 5, 0), 5);
        assert_eq!(&b[..5], b"hello");
        assert_eq!(libc::recv(fd, b.as_mut_ptr().cast(), 6, libc::MSG_WAITALL), 6);
        assert_eq!(&b[..6], b" world");
    }
    // MSG_WAITALL across several writes: the client sends 3 x 1000 bytes with pauses.
    write_all(fd, b"w");
    let mut big = vec![0u8; 3000];
    // SAFETY: a live buffer.
    let n = unsafe { libc::recv(fd, big.as_mut_ptr().cast(), 3000, libc::MSG_WAITALL) };
    assert_eq!(n, 3000, "MSG_WAITALL gathers all");
    assert!(big.iter().all(|&x| x == b'z'));

    // epoll: the connection and a pipe (a kernel fd) in one set.
    let mut pipe = [0 as c_int; 2];
    // SAFETY: plain syscalls on locals.
    unsafe {
        assert_eq!(libc::pipe(pipe.as_mut_ptr()), 0);
        let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        assert!(ep >= 0);
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 1 };
        assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
        assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), -1);
        assert_eq!(errno(), libc::EEXIST);
        let mut ev2 = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 2 };
        assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, pipe[0], &mut ev2), 0);
        // A second set: the pipe first, then the connection. Under strait, meeting
        // the process's second set reads its kernel members from /proc (the pipe),
        // which closes a descriptor while the library holds its sets.
        let ep2 = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        assert!(ep2 >= 0);
        assert_eq!(libc::epoll_ctl(ep2, libc::EPOLL_CTL_ADD, pipe[0], &mut ev2), 0);
        assert_eq!(libc::epoll_ctl(ep2, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
        let mut out = [libc::epoll_event { events: 0, u64: 0 }; 8];
        assert_eq!(libc::epoll_wait(ep, out.as_mut_ptr(), 8, 30), 0, "epoll: nothing ready");
        write_all(fd, b"x"); // ask the client for one byte
        let n = libc::epoll_wait(ep, out.as_mut_ptr(), 8, 5000);
        assert_eq!(n, 1);
        assert_eq!({ out[0].u64 }, 1);
        assert!({ out[0].events } & libc::EPOLLIN as u32 != 0);
        write_all(pipe[1], b"p");
        let n = libc::epoll_wait(ep, out.as_mut_ptr(), 8, 5000);
        assert_eq!(n, 2, "level-triggered: connection still readable, pipe readable");
        let mut ids: Vec<u64> = out[..2].iter().map(|e| e.u64).collect();
        ids.sort();
        assert_eq!(ids, vec![1, 2]);
        // The second set sees both at once, with a zero timeout too.
        let n = libc::epoll_wait(ep2, out.as_mut_ptr(), 8, 0);
        assert_eq!(n, 2, "second set: connection and pipe");
        libc::close(ep2);
        assert_eq!(read_some(fd, &mut b), 1);
        assert_eq!(b[0], b'y');
        let n = libc::epoll_wait(ep, out.as_mut_ptr(), 8, 0);
        assert_eq!(n, 1);
        assert_eq!({ out[0].u64 }, 2);
        assert_eq!(read_some(pipe[0], &mut b), 1);
        // Edge-triggered: one report per arrival.
        let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLET) as u32, u64: 3 };
        assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_MOD, fd, &mut ev), 0);
        write_all(fd, b"x");
        assert_eq!(libc::epoll_wait(ep, out.as_mut_ptr(), 8, 5000), 1);
        assert_eq!({ out[0].u64 }, 3);
        assert_eq!(libc::epoll_wait(ep, out.as_mut_ptr(), 8, 20), 0, "edge already reported");
        assert_eq!(read_some(fd, &mut b), 1);
        assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()), 0);
        assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()), -1);
        assert_eq!(errno(), libc::ENOENT);
        libc::close(ep);

        // select with the connection and the pipe.
        write_all(fd, b"x");
        let mut rs: libc::fd_set = std::mem::zeroed();
        libc::FD_ZERO(&mut rs);
        libc::FD_SET(fd, &mut rs);
        libc::FD_SET(pipe[0], &mut rs);
        let mut tv = libc::timeval { tv_sec: 5, tv_usec: 0 };
        let n =
            libc::select(fd.max(pipe[0]) + 1, &mut rs, std::ptr::null_mut(), std::ptr::null_mut(), &mut tv);
        assert_eq!(n, 1, "select");
        assert!(libc::FD_ISSET(fd, &rs) && !libc::FD_ISSET(pipe[0], &rs));
        assert_eq!(read_some(fd, &mut b), 1);
    }

    // Non-blocking writes until the ring is full (the client does not read yet), and
    // then poll says not writable. To another host, a credit may still be on its way
    // when a write meets EAGAIN (the far end's ring takes what the bridge carried):
    // the space it brings is filled too, until both agree.
    set_nonblock(fd, true);
    let chunk = vec![b'f'; 65536];
    let mut filled = 0usize;
    for round in 0.. {
        assert!(round < 1000, "full: writes fail with EAGAIN but poll says writable");
        loop {
            // SAFETY: a live buffer.
            let n = unsafe { libc::write(fd, chunk.as_ptr().cast(), chunk.len()) };
            if n < 0 {
                assert_eq!(errno(), libc::EAGAIN);
                break;
            }
            filled += n as usize;
            assert!(filled < 1 << 30, "never full");
        }
        if poll1(fd, libc::POLLOUT, 0) == 0 {
            break;
        }
    }
    println!("filled {filled}");
    set_nonblock(fd, false);
    write_all(fd, &(filled as u64).to_le_bytes());
    // The client drains and closes: we see EOF, then writes fail with EPIPE.
    assert_eq!(read_some(fd, &mut b), 0, "EOF after the client closed");
    let r = poll1(fd, libc::POLLIN | libc::POLLRDHUP, 0);
    assert!(r & libc::POLLRDHUP != 0, "POLLRDHUP {r:#x}");
    // SAFETY: a live buffer.
    let r = unsafe { libc::send(fd, b"late".as_ptr().cast(), 4, libc::MSG_NOSIGNAL) };
    assert!(r == -1 && errno() == libc::EPIPE, "EPIPE: {r} {}", errno());
    // SAFETY: counts SIGPIPE with a handler.
    unsafe {
        libc::signal(libc::SIGPIPE, on_sigpipe as *const () as libc::sighandler_t);
        let r = libc::write(fd, b"late".as_ptr().cast(), 4);
        assert!(r == -1 && errno() == libc::EPIPE);
    }
    assert_eq!(SIGPIPES.load(std::sync::atomic::Ordering::Relaxed), 1, "one SIGPIPE");
    println!("flags ok");
}

static SIGPIPES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
extern "C" fn on_sigpipe(_: c_int) {
    SIGPIPES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

fn flags_client(fd: c_int) {
    let mut b = [0u8; 64];
    assert_eq!(read_some(fd, &mut b[..1]), 1);
    assert_eq!(b[0], b'g');
    write_all(fd, b"hello world");
    read_exact(fd, &mut b[..1]);
    assert_eq!(b[0], b'w');
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(10));
        write_all(fd, &[b'z'; 1000]);
    }
    read_exact(fd, &mut b[..1]); // epoll LT test
    write_all(fd, b"y");
    read_exact(fd, &mut b[..1]); // epoll ET test
    write_all(fd, b"e");
    read_exact(fd, &mut b[..1]); // select test
    write_all(fd, b"s");
    // Let the server fill the ring, then drain it.
    std::thread::sleep(Duration::from_millis(100));
    let mut n = 0usize;
    let mut buf = vec![0u8; 65536];
    // Read until the 8-byte count that follows the fill.
    let mut all = Vec::new();
    loop {
        let k = read_some(fd, &mut buf);
        assert!(k > 0);
        all.extend_from_slice(&buf[..k]);
        n += k;
        if n >= 8 && all[..n - 8].iter().all(|&c| c == b'f') {
            let cnt = u64::from_le_bytes(all[n - 8..].try_into().unwrap_or_default()) as usize;
            if cnt == n - 8 {
                break;
            }
        }
        assert!(n < 1 << 30);
    }
    println!("drained {}", n - 8);
}

/// Server modes that hand the accepted connection to a new program (this binary
/// again, as `adopted FD`, which echoes on it): `exec-v`/`exec-l`/`exec-lp`/`exec-le`
/// exec in this process; `vfork` execs in a vfork child; `spawn` posix_spawns with the
/// descriptor inherited; `spawn-actions` posix_spawns with the (close-on-exec)
/// descriptor moved to 0 by a file action; `system` and `popen` run the new program
/// through the shell (`popen` relays what it prints).
fn exec_server(l: TcpListener, mode: &str) {
    let (s, _) = l.accept().expect("accept");
    let fd = s.as_raw_fd();
    let me =
        std::ffi::CString::new(std::env::current_exe().expect("exe").into_os_string().into_encoded_bytes())
            .expect("path");
    let name = c"strait-preload-peer".as_ptr();
    let adopted = c"adopted".as_ptr();
    let fd_arg =
        std::ffi::CString::new(if mode == "spawn-actions" { "0".to_string() } else { fd.to_string() })
            .expect("fd");
    if mode != "spawn-actions" {
        // SAFETY: clears close-on-exec on our socket, so the new program inherits it.
        unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    }
    let argv = [name, adopted, fd_arg.as_ptr(), std::ptr::null()];
    extern "C" {
        static environ: *const *const libc::c_char;
    }
    // SAFETY: execs this binary with NULL-terminated argument lists; returns only on
    // failure.
    unsafe {
        let null: *const libc::c_char = std::ptr::null();
        match mode {
            "exec-v" => {
                libc::execv(me.as_ptr(), argv.as_ptr());
            }
            "exec-l" => {
                libc::execl(me.as_ptr(), name, adopted, fd_arg.as_ptr(), null);
            }
            "exec-lp" => {
                libc::execlp(me.as_ptr(), name, adopted, fd_arg.as_ptr(), null);
            }
            "exec-le" => {
                libc::execle(me.as_ptr(), name, adopted, fd_arg.as_ptr(), null, environ);
            }
            "vfork" | "spawn" | "spawn-actions" => {
                let pid = if mode == "vfork" {
                    // The child only execs or exits (the one use vfork allows); under
                    // strait it is a fork anyway.
                    #[allow(deprecated)]
                    let pid = libc::vfork();
                    if pid == 0 {
                        libc::execv(me.as_ptr(), argv.as_ptr());
                        libc::_exit(127);
                    }
                    pid
                } else {
                    let mut pid = 0;
                    let mut fa: libc::posix_spawn_file_actions_t = std::mem::zeroed();
                    libc::posix_spawn_file_actions_init(&mut fa);
                    if mode == "spawn-actions" {
                        libc::posix_spawn_file_actions_adddup2(&mut fa, fd, 0);
                    }
                    let r = libc::posix_spawn(
                        &mut pid,
                        me.as_ptr(),
                        &fa,
                        std::ptr::null(),
                        argv.as_ptr() as *const *mut libc::c_char,
                        environ as *const *mut libc::c_char,
                    );
                    libc::posix_spawn_file_actions_destroy(&mut fa);
                    assert_eq!(r, 0, "posix_spawn");
                    pid
                };
                assert!(pid > 0, "spawn");
                // The child holds the connection now; ours goes.
                drop(s);
                let mut st = 0;
                libc::waitpid(pid, &mut st, 0);
                assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "child failed: {st:#x}");
                println!("{mode} server ok");
                return;
            }
            "system" | "popen" => {
                // The shell (preloaded too) takes the connection over and hands it
                // on to this binary when it execs it.
                let cmdline = std::ffi::CString::new(format!(
                    "'{}' adopted {fd}",
                    std::env::current_exe().expect("exe").display()
                ))
                .expect("command");
                let st = if mode == "system" {
                    libc::system(cmdline.as_ptr())
                } else {
                    let f = libc::popen(cmdline.as_ptr(), c"r".as_ptr());
                    assert!(!f.is_null(), "popen: {}", std::io::Error::last_os_error());
                    // Relays what the command prints (the test reads it from us).
                    let mut line = vec![0 as libc::c_char; 4096];
                    while !libc::fgets(line.as_mut_ptr(), line.len() as c_int, f).is_null() {
                        print!("{}", std::ffi::CStr::from_ptr(line.as_ptr()).to_string_lossy());
                    }
                    libc::pclose(f)
                };
                assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "{mode} command failed: {st:#x}");
                // The library's versions (the connection is still live) report the
                // shell's status, take a writing popen and restore SIGINT.
                let mut before: libc::sigaction = std::mem::zeroed();
                libc::sigaction(libc::SIGINT, std::ptr::null(), &mut before);
                let st = libc::system(c"exit 3".as_ptr());
                assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 3, "exit status: {st:#x}");
                let mut after: libc::sigaction = std::mem::zeroed();
                libc::sigaction(libc::SIGINT, std::ptr::null(), &mut after);
                assert_eq!(before.sa_sigaction, after.sa_sigaction, "SIGINT not restored");
                let f = libc::popen(c"test \"$(cat)\" = hello || exit 4".as_ptr(), c"we".as_ptr());
                assert!(!f.is_null(), "popen w: {}", std::io::Error::last_os_error());
                libc::fputs(c"hello".as_ptr(), f);
                let st = libc::pclose(f);
                assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "popen w: {st:#x}");
                drop(s);
                println!("{mode} server ok");
                return;
            }
            _ => panic!("unknown exec mode {mode}"),
        }
    }
    panic!("exec failed: {}", std::io::Error::last_os_error());
}

/// Echoes with stdio streams made by `fdopen` (one for reading on a duplicate, one
/// for writing), checking that `fileno` answers their descriptors.
fn stdio_server(fd: c_int) {
    // SAFETY: stdio calls on descriptors we own; the streams are closed below.
    unsafe {
        let rfd = libc::dup(fd);
        let r = libc::fdopen(rfd, c"r".as_ptr());
        let w = libc::fdopen(fd, c"w".as_ptr());
        assert!(!r.is_null() && !w.is_null(), "fdopen");
        assert_eq!((libc::fileno(r), libc::fileno(w)), (rfd, fd), "fileno");
        let mut buf = vec![0u8; 70_000];
        let mut total = 0u64;
        loop {
            let n = libc::fread(buf.as_mut_ptr().cast(), 1, buf.len(), r);
            if n > 0 {
                assert_eq!(libc::fwrite(buf.as_ptr().cast(), 1, n, w), n, "fwrite");
                assert_eq!(libc::fflush(w), 0, "fflush");
                total += n as u64;
            }
            if n < buf.len() && (libc::feof(r) != 0 || libc::ferror(r) != 0) {
                break;
            }
        }
        assert_eq!(libc::ferror(r), 0, "fread error");
        libc::fclose(r);
        println!("echoed {total}");
        println!("maps {}", if maps_has_strait() { "strait" } else { "kernel" });
        libc::fclose(w);
    }
    std::process::exit(0);
}

/// Message sizes of the message-mode test (the test sets a 256 KiB ring: 262_136 is the
/// largest message that fits whole).
const MESSAGE_SIZES: &[usize] = &[1, 7, 100, 4096, 65_536, 200_000, 262_136, 300_000, 1_000_000, 3];
/// The message written while the server's read already waits (rendezvous).
const RENDEZVOUS_SIZE: usize = 1_500_000;

fn message(i: usize, len: usize) -> Vec<u8> {
    (0..len as u64).map(|b| pattern(b + ((i as u64) << 24))).collect()
}

/// Message mode (both ends under STRAIT_MESSAGES=1): every read returns bytes of one
/// message, a message that fits the ring in one read; then one read waiting with a
/// large buffer gets a message larger than the ring whole (rendezvous).
fn messages_server(fd: c_int) {
    let mut buf = vec![0u8; 4 << 20];
    for (i, &len) in MESSAGE_SIZES.iter().enumerate() {
        let want = message(i, len);
        let mut got = 0;
        while got < len {
            let n = read_some(fd, &mut buf);
            assert!(
                n > 0 && got + n <= len,
                "message {i} ({len} B): a read of {n} after {got} crossed its end"
            );
            assert!(buf[..n] == want[got..got + n], "message {i}: wrong bytes");
            if len <= 262_136 {
                assert_eq!(n, len, "message {i} ({len} B) did not arrive whole");
            }
            got += n;
        }
    }
    write_all(fd, b"R");
    let n = read_some(fd, &mut buf);
    assert_eq!(n, RENDEZVOUS_SIZE, "the waiting read got part of the message");
    assert!(buf[..n] == message(99, n)[..], "rendezvous message: wrong bytes");
    write_all(fd, b"k");
    println!("messages ok {n}");
}

fn messages_client(fd: c_int) {
    for (i, &len) in MESSAGE_SIZES.iter().enumerate() {
        let m = message(i, len);
        // SAFETY: a live buffer.
        let r = unsafe { libc::write(fd, m.as_ptr().cast(), len) };
        assert_eq!(r, len as isize, "message {i}: one write, all of it");
    }
    // (Settled by now: a non-blocking call before that would answer EAGAIN.)
    // SAFETY: fcntl on our socket.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) };
    let big = message(0, 300_000);
    // SAFETY: a live buffer.
    let r = unsafe { libc::send(fd, big.as_ptr().cast(), big.len(), 0) };
    assert!(r == -1 && errno() == libc::EMSGSIZE, "non-blocking message larger than the ring: {r}");
    // SAFETY: as above.
    unsafe { libc::fcntl(fd, libc::F_SETFL, fl) };
    let mut b = [0u8; 1];
    read_exact(fd, &mut b);
    // Let the server's read wait first.
    std::thread::sleep(Duration::from_millis(100));
    let m = message(99, RENDEZVOUS_SIZE);
    // SAFETY: a live buffer.
    let r = unsafe { libc::write(fd, m.as_ptr().cast(), m.len()) };
    assert_eq!(r, m.len() as isize);
    read_exact(fd, &mut b);
    println!("messages client ok");
}

/// A non-blocking connector whose acceptor is slow to accept: no call may block
/// (writes answer EAGAIN until the connection is settled), poll or epoll wake it
/// once it is writable, and the bytes go through whichever path it settled on.
fn nonblocking_slow_peer(port: u16, use_epoll: bool) {
    let addr = std::net::SocketAddrV4::new(peer_addr(), port);
    // SAFETY: plain socket calls on a socket we own.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0) };
    assert!(fd >= 0);
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*addr.ip()).to_be() },
        sin_zero: [0; 8],
    };
    let started = Instant::now();
    // SAFETY: a sockaddr_in of the right length.
    let r = unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_in).cast(), 16) };
    assert!(r == 0 || errno() == libc::EINPROGRESS, "connect: {}", std::io::Error::last_os_error());
    // SAFETY: epoll set of our own.
    let ep = if use_epoll { unsafe { libc::epoll_create1(0) } } else { -1 };
    if use_epoll {
        let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLOUT) as u32, u64: 7 };
        // SAFETY: a local event.
        assert_eq!(unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) }, 0);
    }
    let wait = |events: i16| {
        if use_epoll {
            let mut ev = [libc::epoll_event { events: 0, u64: 0 }];
            // SAFETY: a local event array.
            let n = unsafe { libc::epoll_wait(ep, ev.as_mut_ptr(), 1, 5000) };
            assert_eq!(n, 1, "epoll_wait");
        } else {
            let mut p = libc::pollfd { fd, events, revents: 0 };
            // SAFETY: one pollfd.
            assert_eq!(unsafe { libc::poll(&mut p, 1, 5000) }, 1, "poll");
        }
    };
    let mut slowest = Duration::ZERO;
    let mut again = 0;
    loop {
        let t = Instant::now();
        // SAFETY: a live buffer.
        let r = unsafe { libc::write(fd, b"ping".as_ptr().cast(), 4) };
        slowest = slowest.max(t.elapsed());
        if r == 4 {
            break;
        }
        assert!(r == -1 && errno() == libc::EAGAIN, "write: {r} {}", std::io::Error::last_os_error());
        again += 1;
        wait(libc::POLLOUT);
    }
    // How long poll or epoll took to report the settled connection (the test holds
    // it to the acceptor's delay plus a margin, far below a wait's 1 s slice).
    println!("settled_ms {}", started.elapsed().as_millis());
    let mut got = Vec::new();
    while got.len() < 4 {
        let mut b = [0u8; 16];
        let t = Instant::now();
        // SAFETY: a live buffer.
        let r = unsafe { libc::read(fd, b.as_mut_ptr().cast(), b.len()) };
        slowest = slowest.max(t.elapsed());
        if r > 0 {
            got.extend_from_slice(&b[..r as usize]);
            continue;
        }
        assert!(r == -1 && errno() == libc::EAGAIN, "read: {r} {}", std::io::Error::last_os_error());
        wait(libc::POLLIN);
    }
    assert_eq!(got, b"ping");
    assert!(slowest < Duration::from_millis(50), "a non-blocking call took {slowest:?}");
    // SAFETY: our descriptors.
    unsafe {
        libc::shutdown(fd, libc::SHUT_WR);
        libc::close(fd);
        if ep >= 0 {
            libc::close(ep);
        }
    }
    println!("nonblocking ok (EAGAIN {again} times, slowest call {} us)", slowest.as_micros());
    println!("maps {}", if maps_has_strait() { "strait" } else { "kernel" });
}

/// `adopted FD`: the program an exec started, echoing on the inherited connection.
fn adopted(fd: c_int) {
    echo_server(fd);
    println!("adopted ok");
    println!("maps {}", if maps_has_strait() { "strait" } else { "kernel" });
    println!("fds {}", if fds_have_memfd() { "memfd" } else { "clean" });
}

const RECORD: usize = 64;
/// Records each of the two server processes writes.
const RECORDS_EACH: u32 = 20_000;
/// Records the client writes for the two to read (fits in strait's 256 KiB ring, not
/// in the kernel's default receive buffer: this mode is for strait only).
const RECORDS_READ: usize = 3000;

/// A 64-byte record of writer `tag`, number `seq`, with a checksum.
fn record(tag: u8, seq: u32) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    r[0] = tag;
    r[1..5].copy_from_slice(&seq.to_le_bytes());
    for (i, b) in r[5..RECORD - 8].iter_mut().enumerate() {
        *b = pattern(seq as u64 * 131 + i as u64 + tag as u64);
    }
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    fnv(&mut h, &r[..RECORD - 8]);
    r[RECORD - 8..].copy_from_slice(&h.to_le_bytes());
    r
}

/// (tag, seq) of an intact record.
fn parse_record(r: &[u8]) -> Option<(u8, u32)> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    fnv(&mut h, &r[..RECORD - 8]);
    let seq = u32::from_le_bytes(r[1..5].try_into().ok()?);
    (r[RECORD - 8..] == h.to_le_bytes() && r[..] == record(r[0], seq)[..]).then_some((r[0], seq))
}

/// Two processes use one inherited connection at the same time: both write records
/// concurrently (the client checks each is intact and each writer's are in order),
/// then both read the client's records concurrently, 64 bytes a read (each record
/// must reach exactly one of them, intact).
fn shared_server(l: TcpListener) {
    let (s, _) = l.accept().expect("accept");
    let fd = s.as_raw_fd();
    let n = RECORDS_READ;
    // SAFETY: a shared anonymous mapping for the two processes' tallies.
    let tally = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n + 1,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(tally, libc::MAP_FAILED);
    let tally = tally.cast::<std::sync::atomic::AtomicU8>();
    // SAFETY: fork in a single-threaded process.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    let tag = (pid == 0) as u8;
    for seq in 0..RECORDS_EACH {
        write_all(fd, &record(tag, seq));
    }
    // Both read once the client's records are all here.
    let want = (n * RECORD) as c_int;
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let mut avail: c_int = 0;
        // SAFETY: FIONREAD into a local int.
        unsafe { libc::ioctl(fd, libc::FIONREAD, &mut avail) };
        if avail >= want {
            break;
        }
        assert!(Instant::now() < end, "client's records never all arrived ({avail})");
        std::thread::sleep(Duration::from_millis(2));
    }
    // Then both start together (the last slot of the mapping counts who is ready).
    // SAFETY: slot `n` of the shared tally.
    let ready = unsafe { &*tally.add(n) };
    ready.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    while ready.load(std::sync::atomic::Ordering::Acquire) < 2 {
        assert!(Instant::now() < end, "the other reader never got ready");
        std::hint::spin_loop();
    }
    let mut got = 0;
    let mut r = [0u8; RECORD];
    loop {
        // SAFETY: a live buffer.
        let k = unsafe { libc::recv(fd, r.as_mut_ptr().cast(), RECORD, libc::MSG_DONTWAIT) };
        if k < 0 && errno() == libc::EAGAIN {
            break;
        }
        assert_eq!(k, RECORD as isize, "a read split a record: {}", std::io::Error::last_os_error());
        let (t, seq) = parse_record(&r).expect("a record arrived corrupted");
        assert_eq!(t, 2, "not a client record");
        // SAFETY: `seq < n` inside the shared tally.
        unsafe { &*tally.add(seq as usize) }.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        got += 1;
    }
    if pid == 0 {
        println!("shared child read {got}");
        std::io::stdout().flush().ok();
        // SAFETY: ends the child without running the parent's exit handlers twice.
        unsafe { libc::_exit(0) };
    }
    let mut st = 0;
    // SAFETY: waits for our child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
    assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "child failed: {st:#x}");
    // SAFETY: every slot of the tally, after the child exited.
    let counts: Vec<u8> =
        (0..n).map(|i| unsafe { &*tally.add(i) }.load(std::sync::atomic::Ordering::Relaxed)).collect();
    assert!(counts.iter().all(|&c| c == 1), "records read twice or never: {:?}", &counts[..16]);
    println!("shared parent read {got}");
    write_all(fd, b"k");
    println!("shared server ok");
}

fn shared_client(fd: c_int) {
    let mut buf = vec![0u8; 2 * RECORDS_EACH as usize * RECORD];
    read_exact(fd, &mut buf);
    let mut next = [0u32; 2];
    for r in buf.chunks(RECORD) {
        let (t, seq) = parse_record(r).expect("two writers' records interleaved");
        assert!(t < 2 && seq == next[t as usize], "writer {t}: record {seq}, expected {}", next[t as usize]);
        next[t as usize] += 1;
    }
    let mine: Vec<u8> = (0..RECORDS_READ as u32).flat_map(|s| record(2, s)).collect();
    write_all(fd, &mine);
    let mut k = [0u8; 1];
    read_exact(fd, &mut k);
    println!("shared client ok");
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let role = a.get(1).map(String::as_str).unwrap_or("");
    if role == "adopted" {
        return adopted(a.get(2).and_then(|f| f.parse().ok()).expect("adopted FD"));
    }
    let (stream, mode) = match role {
        "server" => {
            let l = TcpListener::bind((peer_addr(), 0)).expect("bind");
            println!("PORT {}", l.local_addr().expect("addr").port());
            std::io::stdout().flush().ok();
            let mode = a[2].clone();
            if mode == "fork" {
                return fork_server(l);
            }
            if mode == "shared" {
                return shared_server(l);
            }
            if mode.starts_with("exec-")
                || mode.starts_with("spawn")
                || ["vfork", "system", "popen"].contains(&mode.as_str())
            {
                return exec_server(l, &mode);
            }
            if mode == "threads" {
                return threads_server(l);
            }
            if let Some(n) = mode.strip_prefix("many").and_then(|n| n.parse().ok()) {
                return many_server(l, n);
            }
            if mode == "prefork" {
                return prefork_server(l);
            }
            if mode == "lateaccept" {
                // Accept only after the connector gave up waiting: the connection
                // must then work through the kernel.
                std::thread::sleep(Duration::from_millis(1500));
            }
            if mode == "slowaccept" {
                // Accept well within the connector's attach timeout.
                std::thread::sleep(Duration::from_millis(300));
            }
            let (s, _) = l.accept().expect("accept");
            (s, mode)
        }
        "client" if a.get(3).is_some_and(|m| m == "prefork") => {
            let port: u16 = a[2].parse().expect("port");
            return prefork_client(port);
        }
        "client" if a.get(3).is_some_and(|m| m == "threads") => {
            let port: u16 = a[2].parse().expect("port");
            return threads_client(port);
        }
        "client"
            if a.get(3).and_then(|m| m.strip_prefix("many")).is_some_and(|n| n.parse::<usize>().is_ok()) =>
        {
            let port: u16 = a[2].parse().expect("port");
            let n = a[3].trim_start_matches("many").parse().expect("count");
            return many_client(port, n);
        }
        "client" if a.get(3).is_some_and(|m| m == "nbslow" || m == "nbslow-epoll") => {
            let port: u16 = a[2].parse().expect("port");
            return nonblocking_slow_peer(port, a[3] == "nbslow-epoll");
        }
        "client" if a.get(3).is_some_and(|m| m == "nbconnect") => {
            let port: u16 = a[2].parse().expect("port");
            (nonblocking_connect(port), "echo".to_string())
        }
        "client" => {
            let port: u16 = a[2].parse().expect("port");
            (TcpStream::connect((peer_addr(), port)).expect("connect"), a[3].clone())
        }
        _ => {
            eprintln!("usage: strait-preload-peer server MODE | client PORT MODE");
            std::process::exit(2);
        }
    };
    let fd = stream.as_raw_fd();
    let before = Instant::now();
    match (role, mode.as_str()) {
        ("server", "echo") | ("server", "lateaccept") | ("server", "slowaccept") => echo_server(fd),
        ("client", "echo") => echo_client(fd),
        ("client", "shared") => shared_client(fd),
        ("server", "stdio") => stdio_server(fd),
        ("server", "messages") => messages_server(fd),
        ("client", "messages") => messages_client(fd),
        ("client", "closeall") => {
            // A daemon's (or a spawn's `close_fds`) sweep of every descriptor it does
            // not know, by close() and by close_range(): the library's own must survive.
            for other in 3..64 {
                if other != fd {
                    // SAFETY: closes descriptors of this process (EBADF if not open).
                    unsafe { libc::close(other) };
                }
            }
            // SAFETY: as above, for every descriptor above ours.
            let r = unsafe { libc::close_range(fd as u32 + 1, u32::MAX, 0) };
            assert_eq!(r, 0, "close_range: {}", std::io::Error::last_os_error());
            echo_client(fd)
        }
        ("server", "sink") | ("client", "sink") => sink(fd),
        // Large writes and reads, each of sizes around the rendezvous threshold and
        // the ring's size: where a reader waits with a large buffer, a writer copies
        // straight into it.
        ("server", "bigsink") | ("client", "bigsink") => {
            sink_in(fd, &[1 << 20, 65_536, 200_000, 10, 3 << 20])
        }
        // Every read into one 3 MiB buffer: each large write finds it posted.
        ("server", "hugesink") | ("client", "hugesink") => sink_in(fd, &[3 << 20]),
        ("client", m) | ("server", m) if m.starts_with("bigsource") => source_in(
            fd,
            m.trim_start_matches("bigsource").parse().unwrap_or(20_000_000),
            &[70_000, 1 << 20, 300_000, 65_536, 100, 2 << 20, 40_000],
            true,
        ),
        ("client", m) | ("server", m) if m.starts_with("source") => {
            source(fd, m.trim_start_matches("source").parse().unwrap_or(3_000_000))
        }
        ("server", "flags") => flags_server(fd),
        ("client", "flags") => flags_client(fd),
        ("client", "die") => {
            write_all(fd, b"a");
            // Wait for the server's go, then die without closing anything.
            let mut b = [0u8; 1];
            read_exact(fd, &mut b);
            // SAFETY: kills this process.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        ("server", "die") => {
            let mut b = [0u8; 4];
            read_exact(fd, &mut b[..1]);
            write_all(fd, b"k");
            let t = Instant::now();
            // SAFETY: a live buffer.
            let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), 4) };
            assert!(n == 0 || (n < 0 && errno() == libc::ECONNRESET), "after peer death: {n} {}", errno());
            println!("peer gone after {} ms", t.elapsed().as_millis());
        }
        ("client", "thief") => {
            // Before this process uses its connection, a "third process" (this code,
            // with a plain Unix socket) asks the connector's per-connection name for
            // the hello, offering a socket that is not the accepted end.
            let got = steal(fd);
            assert!(!got, "the connector handed its shared memory to a stranger");
            echo_client(fd);
            println!("thief refused");
        }
        ("client", "fork") => {
            write_all(fd, b"ping");
            let mut b = [0u8; 9];
            read_exact(fd, &mut b);
            assert_eq!(&b, b"pong from");
            let mut rest = Vec::new();
            let mut buf = [0u8; 64];
            loop {
                let n = read_some(fd, &mut buf);
                if n == 0 {
                    break;
                }
                rest.extend_from_slice(&buf[..n]);
            }
            assert_eq!(rest, b" child");
            println!("fork ok");
        }
        ("server", "signals") => signals_server(fd),
        ("server", "epollsignal") => epoll_signal_server(fd),
        ("server", "extras") => extras_server(fd),
        ("client", "extras") => extras_client(fd),
        ("client", "signals") => {
            // Stay silent while the server's read is interrupted and times out, then
            // answer its go.
            let mut b = [0u8; 1];
            read_exact(fd, &mut b);
            std::thread::sleep(Duration::from_millis(300));
            write_all(fd, b"late");
            read_exact(fd, &mut b);
            println!("signals client ok");
        }
        _ => panic!("unknown mode {mode}"),
    }
    let _ = before;
    println!("maps {}", if maps_has_strait() { "strait" } else { "kernel" });
    println!("fds {}", if fds_have_memfd() { "memfd" } else { "clean" });
    // Keep the connection open until the output is out.
    std::io::stdout().flush().ok();
    drop(stream);
}

/// Asks the connector of `fd` (this process) for its hello with a wrong socket;
/// true if any descriptor came back.
fn steal(fd: c_int) -> bool {
    use std::os::unix::fs::MetadataExt;
    let ns = std::fs::metadata("/proc/self/ns/net").expect("netns").ino();
    // The connector's per-connection name is its socket's inode.
    let ino = std::fs::metadata(format!("/proc/self/fd/{fd}")).expect("socket").ino();
    let name = format!("strait.c.{ns}.{ino}");
    // SAFETY: plain socket calls on locals.
    unsafe {
        let u = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0);
        let mut sa: libc::sockaddr_un = std::mem::zeroed();
        sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (i, b) in name.bytes().enumerate() {
            sa.sun_path[i + 1] = b as libc::c_char;
        }
        let len = (2 + 1 + name.len()) as libc::socklen_t;
        if libc::connect(u, (&sa as *const libc::sockaddr_un).cast(), len) != 0 {
            // The name is already gone: nothing to steal.
            libc::close(u);
            return false;
        }
        // A socket of ours that is not the other end of `fd`.
        let wrong = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        let mut req = [0u8; 16];
        req[..8].copy_from_slice(&0x3130_5145_5254_5253u64.to_le_bytes());
        let _ = strait_sys::send_fds(u, &req, &[wrong], 0);
        // The connector answers when this process next enters the library; do that
        // from another thread while we wait here for an answer.
        let t = std::thread::spawn(move || {
            let mut b = [0u8; 1];
            libc::recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT);
        });
        let mut p = libc::pollfd { fd: u, events: libc::POLLIN, revents: 0 };
        libc::poll(&mut p, 1, 3000);
        t.join().ok();
        let mut buf = [0u8; 64];
        // Stolen if any descriptor came (the connector answers with its hello's).
        let got = strait_sys::recv_fds(u, &mut buf, libc::MSG_DONTWAIT, 12)
            .is_ok_and(|m| m.len > 0 && (!m.fds.is_empty() || m.truncated));
        libc::close(u);
        libc::close(wrong);
        got
    }
}

const WORKERS: usize = 2;
const PREFORK_CONNS: usize = 6;

/// The prefork pattern (nginx, Apache): workers forked after listen() accept on the
/// shared listening socket, so a worker may drain another worker's hello.
fn prefork_server(l: TcpListener) {
    let mut kids = Vec::new();
    for _ in 0..WORKERS {
        // SAFETY: fork in a single-threaded process.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            loop {
                let (s, _) = l.accept().expect("accept");
                let fd = s.as_raw_fd();
                let mut buf = [0u8; 64];
                let n = read_some(fd, &mut buf);
                if &buf[..n] == b"quit" {
                    write_all(fd, b"bye");
                    drop(s);
                    // Run the exit handlers (stats) but not the parent's test logic.
                    std::process::exit(0);
                }
                write_all(fd, &buf[..n]);
                while read_some(fd, &mut buf) > 0 {}
            }
        }
        kids.push(pid);
    }
    for pid in kids {
        let mut st = 0;
        // SAFETY: waits for our child.
        unsafe { libc::waitpid(pid, &mut st, 0) };
        assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "worker failed: {st:#x}");
    }
    println!("prefork server ok");
}

fn prefork_client(port: u16) {
    let t = Instant::now();
    // Connect all first, so that hellos queue up at the shared marker.
    let conns: Vec<TcpStream> =
        (0..PREFORK_CONNS).map(|_| TcpStream::connect((peer_addr(), port)).expect("connect")).collect();
    for (i, s) in conns.into_iter().enumerate() {
        let fd = s.as_raw_fd();
        let msg = format!("hello {i}");
        write_all(fd, msg.as_bytes());
        let mut b = vec![0u8; msg.len()];
        read_exact(fd, &mut b);
        assert_eq!(b, msg.as_bytes());
    }
    for _ in 0..WORKERS {
        let s = TcpStream::connect((peer_addr(), port)).expect("connect");
        write_all(s.as_raw_fd(), b"quit");
        let mut b = [0u8; 3];
        read_exact(s.as_raw_fd(), &mut b);
        assert_eq!(&b, b"bye");
    }
    println!("prefork client ok in {} ms", t.elapsed().as_millis());
}

const THREADS: usize = 8;

/// Many connections on many threads: each server thread echoes one connection.
fn threads_server(l: TcpListener) {
    let mut hs = Vec::new();
    for _ in 0..THREADS {
        let (s, _) = l.accept().expect("accept");
        hs.push(std::thread::spawn(move || {
            echo_server(s.as_raw_fd());
            drop(s);
        }));
    }
    for h in hs {
        h.join().expect("server thread");
    }
    println!("threads server ok");
}

fn threads_client(port: u16) {
    let hs: Vec<_> = (0..THREADS)
        .map(|t| {
            std::thread::spawn(move || {
                let s = TcpStream::connect((peer_addr(), port)).expect("connect");
                let fd = s.as_raw_fd();
                let total = 300_000 + t * 1000;
                let data: Vec<u8> = (0..total as u64).map(|i| pattern(i + t as u64)).collect();
                let d2 = data.clone();
                // One thread writes while this one reads the echo on the same fd.
                let w = std::thread::spawn(move || {
                    for c in d2.chunks(7_000 + t) {
                        write_all(fd, c);
                    }
                    // SAFETY: plain syscall.
                    unsafe { libc::shutdown(fd, libc::SHUT_WR) };
                });
                let mut got = Vec::with_capacity(total);
                let mut buf = vec![0u8; 32768];
                loop {
                    let n = read_some(fd, &mut buf);
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                w.join().expect("writer");
                assert!(got == data, "thread {t}: echo differs ({} of {total} bytes)", got.len());
                maps_has_strait()
            })
        })
        .collect();
    let mut strait = 0;
    for h in hs {
        if h.join().expect("client thread") {
            strait += 1;
        }
    }
    println!("threads client ok");
    println!("maps {}", if strait == THREADS { "strait" } else { "kernel" });
}

/// One connection of [`many_server`] or [`many_client`] in an epoll loop: bytes to
/// write (the echo, or the payload) and what arrived.
struct Flow {
    fd: c_int,
    out: Vec<u8>,
    sent: usize,
    got: Vec<u8>,
    /// The client has shut its writing side / this side read the end.
    shut: bool,
    eof: bool,
}

impl Flow {
    fn new(s: TcpStream, out: Vec<u8>) -> Flow {
        let fd = s.into_raw_fd();
        // SAFETY: plain syscalls on our descriptor.
        unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
        Flow { fd, out, sent: 0, got: Vec::new(), shut: false, eof: false }
    }

    /// Writes what it can (until the socket is full).
    fn push(&mut self) {
        while self.sent < self.out.len() {
            let rest = &self.out[self.sent..];
            // SAFETY: a live buffer.
            let n = unsafe { libc::write(self.fd, rest.as_ptr().cast(), rest.len().min(65536)) };
            if n < 0 {
                assert_eq!(errno(), libc::EAGAIN, "write: {}", std::io::Error::last_os_error());
                return;
            }
            self.sent += n as usize;
        }
    }

    /// Reads what arrived; returns the bytes read now.
    fn pull(&mut self) -> usize {
        let mut buf = [0u8; 65536];
        let mut now = 0;
        loop {
            // SAFETY: a live buffer.
            let n = unsafe { libc::read(self.fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                assert_eq!(errno(), libc::EAGAIN, "read: {}", std::io::Error::last_os_error());
                return now;
            }
            if n == 0 {
                self.eof = true;
                return now;
            }
            self.got.extend_from_slice(&buf[..n as usize]);
            now += n as usize;
        }
    }

    fn interest(&self) -> u32 {
        let mut ev = 0;
        if !self.eof {
            ev |= libc::EPOLLIN as u32;
        }
        if self.sent < self.out.len() {
            ev |= libc::EPOLLOUT as u32;
        }
        ev
    }
}

/// An epoll loop over `flows` until every one is `done`; `step` runs for a flow
/// after its readiness (it may queue bytes to write). One thread for all: a lost
/// wake-up hangs it (the test's bound then fails it).
fn epoll_loop(flows: &mut [Flow], step: impl Fn(&mut Flow), done: impl Fn(&Flow) -> bool) {
    // SAFETY: plain syscall.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(ep >= 0);
    let mut set = vec![0u32; flows.len()];
    let ctl = |op: c_int, i: usize, events: u32, fd: c_int| {
        let mut ev = libc::epoll_event { events, u64: i as u64 };
        // SAFETY: a live event; our descriptors.
        let r = unsafe { libc::epoll_ctl(ep, op, fd, &mut ev) };
        assert_eq!(r, 0, "epoll_ctl: {}", std::io::Error::last_os_error());
    };
    for (i, f) in flows.iter().enumerate() {
        set[i] = f.interest();
        ctl(libc::EPOLL_CTL_ADD, i, set[i], f.fd);
    }
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
    while !flows.iter().all(&done) {
        // SAFETY: a live event array and its length.
        let n = unsafe { libc::epoll_wait(ep, events.as_mut_ptr(), events.len() as c_int, 20_000) };
        assert!(
            n > 0,
            "epoll_wait: nothing for 20 s ({n}, {}): a lost wake-up",
            std::io::Error::last_os_error()
        );
        for e in &events[..n as usize] {
            let i = e.u64 as usize;
            let f = &mut flows[i];
            if set[i] == 0 {
                continue;
            }
            f.pull();
            step(f);
            f.push();
            // Again: what was pushed may have finished the flow's part.
            step(f);
            let want = f.interest();
            if want != set[i] {
                set[i] = want;
                // A flow with nothing left to wait for leaves the set (a closed
                // socket would report a hang-up on every wait).
                let op = if want == 0 { libc::EPOLL_CTL_DEL } else { libc::EPOLL_CTL_MOD };
                ctl(op, i, want, f.fd);
            }
        }
    }
    // SAFETY: our descriptor.
    unsafe { libc::close(ep) };
}

/// `n` connections served by one epoll loop: each echoes what it reads and ends
/// its side when the client ended its own.
fn many_server(l: TcpListener, n: usize) {
    let mut flows: Vec<Flow> = (0..n).map(|_| Flow::new(l.accept().expect("accept").0, Vec::new())).collect();
    epoll_loop(
        &mut flows,
        |f| {
            // Echo: everything read is queued for writing back.
            let fresh = f.got.split_off(0);
            f.out.extend_from_slice(&fresh);
            if f.eof && f.sent == f.out.len() && !f.shut {
                // SAFETY: our descriptor.
                unsafe { libc::shutdown(f.fd, libc::SHUT_WR) };
                f.shut = true;
            }
        },
        |f| f.shut,
    );
    let strait = maps_has_strait();
    for f in &flows {
        // SAFETY: our descriptors.
        unsafe { libc::close(f.fd) };
    }
    println!("many server ok");
    println!("maps {}", if strait { "strait" } else { "kernel" });
}

/// `n` connections driven by one epoll loop: each sends its own payload, ends its
/// side, and checks that the echo is the payload.
fn many_client(port: u16, n: usize) {
    let mut flows: Vec<Flow> = (0..n)
        .map(|i| {
            let s = TcpStream::connect((peer_addr(), port)).expect("connect");
            let len = 100_000 + i * 997;
            Flow::new(s, (0..len as u64).map(|b| pattern(b + 7 * i as u64)).collect())
        })
        .collect();
    epoll_loop(
        &mut flows,
        |f| {
            if f.sent == f.out.len() && !f.shut {
                // SAFETY: our descriptor.
                unsafe { libc::shutdown(f.fd, libc::SHUT_WR) };
                f.shut = true;
            }
        },
        |f| f.eof,
    );
    for (i, f) in flows.iter().enumerate() {
        assert!(f.got == f.out, "connection {i}: echo differs ({} of {} bytes)", f.got.len(), f.out.len());
    }
    let strait = maps_has_strait();
    for f in &flows {
        // SAFETY: our descriptors.
        unsafe { libc::close(f.fd) };
    }
    println!("many client ok");
    println!("maps {}", if strait { "strait" } else { "kernel" });
}

/// The hiredis pattern: non-blocking connect, poll for writable, SO_ERROR, a second
/// connect() that reports the outcome, back to blocking mode.
fn nonblocking_connect(port: u16) -> TcpStream {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a fresh descriptor and local addresses.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0);
        set_nonblock(fd, true);
        let mut sa: libc::sockaddr_in = std::mem::zeroed();
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_port = port.to_be();
        sa.sin_addr.s_addr = u32::from_ne_bytes(peer_addr().octets());
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let r = libc::connect(fd, (&sa as *const libc::sockaddr_in).cast(), len);
        assert!(r == 0 || errno() == libc::EINPROGRESS, "connect: {}", errno());
        assert!(poll1(fd, libc::POLLOUT, 5000) & libc::POLLOUT != 0, "connected");
        let mut err: c_int = -1;
        let mut l = 4 as libc::socklen_t;
        assert_eq!(
            libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ERROR, (&mut err as *mut c_int).cast(), &mut l),
            0
        );
        assert_eq!(err, 0, "SO_ERROR");
        let r = libc::connect(fd, (&sa as *const libc::sockaddr_in).cast(), len);
        assert!(r == 0 || errno() == libc::EISCONN, "second connect: {r} {}", errno());
        set_nonblock(fd, false);
        TcpStream::from_raw_fd(fd)
    }
}

/// The vsftpd pattern: accept, fork a child for the connection, the parent closes its
/// copy at once. The peer must not see end of stream before the child is done.
fn fork_server(l: TcpListener) {
    let (s, _) = l.accept().expect("accept");
    let fd = s.as_raw_fd();
    // SAFETY: fork in a single-threaded process.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let mut b = [0u8; 4];
        read_exact(fd, &mut b);
        assert_eq!(&b, b"ping");
        std::thread::sleep(Duration::from_millis(50));
        write_all(fd, b"pong from");
        std::thread::sleep(Duration::from_millis(20));
        write_all(fd, b" child");
        // SAFETY: ends the child without running the parent's exit handlers twice.
        unsafe { libc::_exit(0) };
    }
    drop(s);
    let mut st = 0;
    // SAFETY: waits for our child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
    assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "child failed: {st:#x}");
    println!("fork server ok");
    println!("maps {}", if maps_has_strait() { "strait" } else { "kernel" });
}

#[allow(dead_code)]
fn read_line(r: &mut impl BufRead) -> String {
    let mut s = String::new();
    r.read_line(&mut s).ok();
    s
}
