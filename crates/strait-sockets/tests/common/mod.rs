//! Helpers shared by this crate's integration tests: TCP sockets and epoll sets made
//! through the library's calls (`strait_sockets::calls`), as the preload's shims
//! would make them, with both ends of a connection in this process.
#![allow(dead_code)] // each test binary uses some of them

use libc::{c_int, c_void, epoll_event, sockaddr, sockaddr_in, socklen_t};
use strait_sockets::{calls, carried, Carried};

pub fn ok(r: c_int, what: &str) -> c_int {
    assert!(r >= 0, "{what}: {}", std::io::Error::last_os_error());
    r
}

pub fn loopback(port: u16) -> sockaddr_in {
    // SAFETY: sockaddr_in is plain old data.
    let mut a: sockaddr_in = unsafe { std::mem::zeroed() };
    a.sin_family = libc::AF_INET as libc::sa_family_t;
    a.sin_port = port.to_be();
    a.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
    a
}

/// A listening socket on 127.0.0.1 made through the library; (fd, port).
pub fn listener() -> (c_int, u16) {
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

pub fn connect(port: u16) -> c_int {
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
pub fn carried_pair() -> (c_int, c_int) {
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

pub fn epoll_set() -> c_int {
    // SAFETY: plain epoll_create1.
    ok(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }, "epoll_create1")
}

pub fn add(ep: c_int, fd: c_int, events: u32, data: u64) {
    let mut ev = epoll_event { events, u64: data };
    // SAFETY: the library's epoll_ctl with a local event.
    ok(unsafe { calls::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) }, "epoll_ctl add");
}

/// One `epoll_wait(ep, .., 0)`: the events reported, as (data, events).
pub fn poll_once(ep: c_int) -> Vec<(u64, u32)> {
    let mut out = [epoll_event { events: 0, u64: 0 }; 16];
    // SAFETY: a local buffer of 16 events.
    let n = ok(unsafe { calls::epoll_wait(ep, out.as_mut_ptr(), 16, 0) }, "epoll_wait");
    out[..n as usize].iter().map(|e| ({ e.u64 }, { e.events })).collect()
}

/// Makes `fd` non-blocking, through the library (as a program's `fcntl` would).
pub fn set_nonblocking(fd: c_int) {
    // SAFETY: the library's fcntl on our descriptor.
    unsafe {
        let fl = calls::fcntl(fd, libc::F_GETFL, 0);
        ok(calls::fcntl(fd, libc::F_SETFL, (fl | libc::O_NONBLOCK) as usize), "O_NONBLOCK");
    }
}

pub fn write_byte(fd: c_int) {
    // SAFETY: one byte from a local.
    assert_eq!(unsafe { calls::write(fd, b"x".as_ptr().cast::<c_void>(), 1) }, 1, "write");
}

pub fn read_byte(fd: c_int) {
    let mut b = [0u8; 1];
    // SAFETY: one byte into a local.
    assert_eq!(unsafe { calls::read(fd, b.as_mut_ptr().cast::<c_void>(), 1) }, 1, "read");
}

pub fn pipe() -> [c_int; 2] {
    let mut p = [0; 2];
    // SAFETY: a local array of two descriptors.
    ok(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) }, "pipe2");
    p
}

/// Forks a child that holds every descriptor of this process (sockets included)
/// until [`let_holder_go`]: it waits for one byte on a pipe, then leaves with
/// `_exit` without closing anything, as a crashed process would. Returns (child,
/// pipe).
pub fn fork_holder() -> (libc::pid_t, [c_int; 2]) {
    let go = pipe();
    // SAFETY: fork; the child only reads a pipe and leaves with _exit.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork: {}", std::io::Error::last_os_error());
    if child == 0 {
        let mut b = [0u8; 1];
        // SAFETY: the child waits for its cue (blocking read of a local byte), then
        // dies without closing anything.
        unsafe {
            let flags = libc::fcntl(go[0], libc::F_GETFL);
            libc::fcntl(go[0], libc::F_SETFL, flags & !libc::O_NONBLOCK);
            libc::read(go[0], b.as_mut_ptr().cast::<c_void>(), 1);
            libc::_exit(0);
        }
    }
    (child, go)
}

/// Lets a [`fork_holder`] child go and waits until it is gone.
pub fn let_holder_go(child: libc::pid_t, go: [c_int; 2]) {
    // SAFETY: the cue, one byte from a local; then the child's end; then our pipe.
    unsafe {
        assert_eq!(libc::write(go[1], b"q".as_ptr().cast::<c_void>(), 1), 1);
        let mut status = 0;
        assert_eq!(libc::waitpid(child, &mut status, 0), child);
        libc::close(go[0]);
        libc::close(go[1]);
    }
}
