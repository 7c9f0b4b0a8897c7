//! The socket calls that `libstrait_preload.so` exports, one function each with the
//! C signature of the libc function it stands for (the cdylib's shims only forward).
//! Every call looks the descriptor up first; a descriptor that is not an accelerated
//! connection goes straight to the real libc function. A panic inside the library
//! never crosses into the host program: the call falls back to libc.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use libc::{
    c_int, c_uint, c_ulong, c_void, epoll_event, iovec, msghdr, nfds_t, pollfd, sigset_t, size_t, ssize_t,
};
use libc::{sockaddr, socklen_t, timespec};

use crate::conn::{Conn, Early, IoErr};
use crate::socket::Socket;
use crate::udp::{self, UdpSock};
use crate::{discover, pass, poll, real, remote, table};

/// Where a UDP receive reports a shared-memory datagram's source and flags.
enum Name {
    None,
    /// recvfrom's address buffer and length word.
    Addr(*mut sockaddr, *mut socklen_t),
    /// recvmsg's header (name, control length and flags).
    Msg(*mut msghdr),
}

/// A receive on a strait UDP socket; `kernel` is the real call with extra flags.
fn udp_recv(
    u: &UdpSock,
    fd: c_int,
    iov: &[(*mut u8, usize)],
    flags: c_int,
    name: Name,
    kernel: &mut dyn FnMut(c_int) -> ssize_t,
) -> ssize_t {
    let fam = udp::family(u);
    let mut deliver = |g: &udp::Delivered| match name {
        Name::None => {}
        // SAFETY: the caller's address buffer and length word (or nulls).
        Name::Addr(a, l) => unsafe { udp::write_addr(fam, &g.src, a, l) },
        // SAFETY: the caller's msghdr.
        Name::Msg(m) => unsafe {
            if (*m).msg_name.is_null() {
                (*m).msg_namelen = 0;
            } else {
                udp::write_addr(fam, &g.src, (*m).msg_name.cast(), &mut (*m).msg_namelen);
            }
            (*m).msg_controllen = 0;
            (*m).msg_flags = if g.copied < g.len { libc::MSG_TRUNC } else { 0 };
        },
    };
    u.recv(fd, iov, flags, &mut deliver, kernel)
}

/// The destination of a UDP send with an explicit address: `Err` when the kernel must
/// handle it (an address this library does not accelerate).
fn udp_dest(
    u: &UdpSock,
    addr: *const sockaddr,
    len: socklen_t,
) -> Result<Option<(crate::sock::Key, bool)>, ()> {
    if addr.is_null() || len == 0 {
        return Ok(None);
    }
    udp::dest_of(u, addr, len).map(Some).ok_or(())
}

/// Runs `body`; a panic falls back to `fallback` (the real libc call).
fn guard<T>(fallback: impl FnOnce() -> T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(_) => fallback(),
    }
}

/// Runs `call`, which makes a descriptor for the program; if the descriptor table
/// is full (EMFILE) while connectors still wait for their acceptors, those stay
/// with the kernel and let go of what they held for the wait
/// ([`discover::shed_pending`]), and `call` runs once more: the program holds as
/// many connections under strait as without it, at the same limit.
fn shedding(call: impl Fn() -> c_int) -> c_int {
    let r = call();
    if r >= 0 || real::errno() != libc::EMFILE {
        return r;
    }
    if guard(|| 0, discover::shed_pending) == 0 {
        real::set_errno(libc::EMFILE);
        return r;
    }
    call()
}

fn io_result(r: Result<usize, IoErr>, sigpipe: bool) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(IoErr::Again) => real::fail(libc::EAGAIN),
        Err(IoErr::MsgSize) => real::fail(libc::EMSGSIZE),
        Err(IoErr::Intr) => real::fail(libc::EINTR),
        Err(IoErr::Reset) => real::fail(libc::ECONNRESET),
        Err(IoErr::Pipe) => {
            if sigpipe {
                // SAFETY: sends SIGPIPE to this thread, as the kernel would.
                unsafe { libc::raise(libc::SIGPIPE) };
            }
            real::fail(libc::EPIPE)
        }
    }
}

fn do_recv(c: &Conn, fd: c_int, iov: &[(*mut u8, usize)], flags: c_int) -> ssize_t {
    let r = c.recv(
        fd,
        iov,
        flags & libc::MSG_PEEK != 0,
        flags & libc::MSG_DONTWAIT != 0,
        flags & libc::MSG_WAITALL != 0,
    );
    if matches!(r, Ok(n) if n > 0) && flags & libc::MSG_PEEK == 0 {
        c.count_op();
    }
    io_result(r, false)
}

/// A write on the connection `c` behind `fd` (from [`crate::settle::socket_to_write`]:
/// possibly a connector still waiting for its acceptor; one that settles on the
/// kernel here has the rest written there).
fn do_send(c: &Conn, fd: c_int, iov: &[(*const u8, usize)], flags: c_int) -> ssize_t {
    strait_probe::probe!(strait_probe::Stage::WriteLookup);
    let sigpipe = flags & libc::MSG_NOSIGNAL == 0;
    c.count_op();
    if !c.awaiting_attach() {
        return io_result(c.send(fd, iov, flags & libc::MSG_DONTWAIT != 0), sigpipe);
    }
    let early = match c.send_early(fd, iov, flags) {
        Early::Kernel => return -1,
        Early::Sent(n) if n == iov.iter().map(|v| v.1).sum::<usize>() => return n as ssize_t,
        Early::Sent(n) => n,
        Early::NotNow => 0,
    };
    // The rest (all of it, or what a blocking write could not put out early) after
    // settling, as any first use: accelerated, or on the kernel.
    let rest = skip_bytes(iov, early);
    let r = match crate::settle::accel_to_write_or_interrupted(fd) {
        // The socket's SO_SNDTIMEO ran out before the acceptor attached: what the
        // ring and the kernel socket take now goes, as the kernel's timed-out
        // write returns what its buffers took (EAGAIN if nothing).
        Ok(Some(c)) if c.awaiting_attach() => match c.send_early(fd, &rest, flags | libc::MSG_DONTWAIT) {
            Early::Sent(n) => n as ssize_t,
            Early::Kernel => -1,
            Early::NotNow => {
                real::set_errno(libc::EAGAIN);
                -1
            }
        },
        Ok(Some(c)) => io_result(c.send(fd, &rest, flags & libc::MSG_DONTWAIT != 0), sigpipe),
        Ok(None) => crate::sock::kernel_sendmsg(fd, &rest, usize::MAX, flags),
        Err(crate::settle::Interrupted) => interrupted(),
    };
    match (early, r) {
        (0, r) => r,
        // Some bytes went already: the call reports them, as a partial write.
        (n, r) if r < 0 => n as ssize_t,
        (n, r) => (n + r as usize) as ssize_t,
    }
}

/// A call whose wait for a connector's acceptor a signal ended: -1, EINTR.
fn interrupted() -> ssize_t {
    real::set_errno(libc::EINTR);
    -1
}

/// `iov` without its first `skip` bytes.
fn skip_bytes(iov: &[(*const u8, usize)], mut skip: usize) -> Vec<(*const u8, usize)> {
    let mut out = Vec::with_capacity(iov.len());
    for &(p, l) in iov {
        if skip >= l {
            skip -= l;
            continue;
        }
        // SAFETY: `skip < l`: still inside the caller's segment.
        out.push((unsafe { p.add(skip) }, l - skip));
        skip = 0;
    }
    out
}

/// # Safety
/// `iov` points at `n` iovecs (or n == 0).
unsafe fn iovs_mut(iov: *const iovec, n: c_int) -> Vec<(*mut u8, usize)> {
    if iov.is_null() || n <= 0 {
        return Vec::new();
    }
    // SAFETY: per the caller.
    unsafe { std::slice::from_raw_parts(iov, n as usize) }
        .iter()
        .map(|v| (v.iov_base.cast::<u8>(), v.iov_len))
        .collect()
}

fn deadline_ms(ms: c_int) -> Option<Instant> {
    (ms >= 0).then(|| Instant::now() + Duration::from_millis(ms as u64))
}

fn deadline_ts(t: *const timespec) -> Option<Instant> {
    timeout_ts(t).map(|t| Instant::now() + t)
}

/// A timeout in milliseconds as a duration (`None`: no limit); epoll reads the
/// clock itself, once.
fn timeout_ms(ms: c_int) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

fn timeout_ts(t: *const timespec) -> Option<Duration> {
    if t.is_null() {
        return None;
    }
    // SAFETY: the caller's timespec.
    let t = unsafe { *t };
    Some(Duration::new(t.tv_sec.max(0) as u64, t.tv_nsec.clamp(0, 999_999_999) as u32))
}

// ------------------------------------------------------------------ setup

// ------------------------------------------------------------------ sockets

/// # Safety
/// As for libc's `connect`.
pub unsafe fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::connect(fd, addr, len) };
    guard(real, || {
        match table::get(fd) {
            Some(Socket::Udp(u)) => {
                let r = real();
                if r == 0 {
                    let e = real::errno();
                    // SAFETY: the caller's address (at least its family when non-null).
                    let unspec = addr.is_null() || unsafe { (*addr).sa_family } as c_int == libc::AF_UNSPEC;
                    u.on_connect(fd, if unspec { None } else { udp::peer_of(addr, len) });
                    real::set_errno(e);
                }
                return r;
            }
            // A second connect() on a socket already announced (e.g. to complete a
            // non-blocking connect) only asks the kernel.
            Some(_) => return real(),
            None => {}
        }
        if let Some((conn, p)) = remote::pre_connect(fd, addr, len) {
            // SAFETY: forwarded arguments.
            return unsafe { remote::connect(fd, addr, len, conn, p) };
        }
        let Some(u) = discover::pre_connect(fd, addr, len) else { return real() };
        let prepared = discover::prepare(fd, u);
        let r = real();
        let e = real::errno();
        if let Some(p) = prepared {
            if r == 0 || e == libc::EINPROGRESS {
                discover::register(fd, p);
            } else {
                p.abandon();
            }
        }
        real::set_errno(e);
        r
    })
}

/// # Safety
/// As for libc's `socket`.
pub unsafe fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::socket(domain, ty, proto) };
    let fd = shedding(real);
    guard(
        || fd,
        || {
            if fd >= 0 {
                let e = real::errno();
                if let Some(u) = udp::for_socket(domain, ty, proto) {
                    table::insert_udp(fd, u);
                }
                real::set_errno(e);
            }
            fd
        },
    )
}

/// # Safety
/// As for libc's `bind`.
pub unsafe fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::bind(fd, addr, len) };
    guard(real, || {
        let r = real();
        if r == 0 {
            if let Some(u) = crate::table::udp(fd) {
                let e = real::errno();
                udp::on_bind(&u, fd);
                real::set_errno(e);
            }
        }
        r
    })
}

/// `setsockopt`: on a strait UDP socket, options a ring cannot honour (per-datagram
/// ancillary data, corking, segmentation offload) send that direction to the kernel.
///
/// # Safety
/// As for libc's `setsockopt`.
pub unsafe fn setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::setsockopt(fd, level, name, val, len) };
    if !crate::table::any_udp() {
        return real();
    }
    guard(real, || {
        let r = real();
        if r == 0 {
            if let Some(u) = crate::table::udp(fd) {
                let e = real::errno();
                // SAFETY: the caller's option value of `len` bytes (an int, or a
                // byte for some IP options).
                let on = !val.is_null()
                    && match len as usize {
                        0 => false,
                        1..=3 => (unsafe { *val.cast::<u8>() }) != 0,
                        _ => (unsafe { std::ptr::read_unaligned(val.cast::<c_int>()) }) != 0,
                    };
                u.on_setsockopt(level, name, on);
                real::set_errno(e);
            }
        }
        r
    })
}

/// # Safety
/// As for libc's `listen`.
pub unsafe fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::listen(fd, backlog) };
    guard(real, || {
        let r = real();
        if r == 0 {
            let e = real::errno();
            discover::on_listen(fd);
            remote::on_listen(fd);
            real::set_errno(e);
        }
        r
    })
}

fn after_accept(lfd: c_int, fd: c_int, flags: c_int) -> c_int {
    if fd >= 0 {
        let e = real::errno();
        let nonblock = flags & libc::SOCK_NONBLOCK != 0;
        if !remote::on_accept(lfd, fd, nonblock) {
            discover::on_accept(lfd, fd, nonblock);
        }
        real::set_errno(e);
    }
    fd
}

/// # Safety
/// As for libc's `accept`.
pub unsafe fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    guard(|| (), || discover::before_accept(fd));
    // SAFETY: forwarded arguments.
    let r = shedding(|| unsafe { real::accept(fd, addr, len) });
    guard(|| r, || after_accept(fd, r, 0))
}

/// # Safety
/// As for libc's `accept4`.
pub unsafe fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    guard(|| (), || discover::before_accept(fd));
    // SAFETY: forwarded arguments.
    let r = shedding(|| unsafe { real::accept4(fd, addr, len, flags) });
    guard(|| r, || after_accept(fd, r, flags))
}

/// # Safety
/// As for libc's `read`.
pub unsafe fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::read(fd, buf, n) };
    let r = guard(real, || {
        let Ok(s) = crate::settle::socket_to_read(fd, 0) else { return interrupted() };
        match s.as_deref() {
            Some(Socket::Tcp(c)) => do_recv(c, fd, &[(buf.cast(), n)], 0),
            // SAFETY: forwarded arguments.
            Some(Socket::Udp(u)) => udp_recv(u, fd, &[(buf.cast(), n)], 0, Name::None, &mut |x| unsafe {
                real::recv(fd, buf, n, x)
            }),
            _ => real(),
        }
    });
    strait_probe::probe!(strait_probe::Stage::ReadReturn);
    r
}

/// # Safety
/// As for glibc's `__read_chk` (fortified `read`).
pub unsafe fn __read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t {
    if n > buflen {
        // SAFETY: what glibc does on a fortify failure.
        unsafe { libc::abort() };
    }
    // SAFETY: forwarded.
    unsafe { read(fd, buf, n) }
}

/// # Safety
/// As for libc's `write`.
pub unsafe fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    strait_probe::probe!(strait_probe::Stage::WriteEnter);
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::write(fd, buf, n) };
    guard(real, || match crate::settle::socket_to_write(fd).as_deref() {
        Some(Socket::Tcp(c)) => do_send(c, fd, &[(buf.cast(), n)], 0),
        Some(Socket::Udp(u)) => u.send(fd, None, &[(buf.cast(), n)], 0, &mut || real()),
        _ => real(),
    })
}

/// # Safety
/// As for libc's `readv`.
pub unsafe fn readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::readv(fd, iov, n) };
    guard(real, || {
        let Ok(s) = crate::settle::socket_to_read(fd, 0) else { return interrupted() };
        match s.as_deref() {
            // SAFETY: the caller's iovecs.
            Some(Socket::Tcp(c)) => do_recv(c, fd, &unsafe { iovs_mut(iov, n) }, 0),
            Some(Socket::Udp(u)) => {
                // SAFETY: the caller's iovecs.
                let v = unsafe { iovs_mut(iov, n) };
                udp_recv(u, fd, &v, 0, Name::None, &mut |x| {
                    // SAFETY: msghdr is plain old data; it points at the caller's iovecs.
                    let mut m: msghdr = unsafe { std::mem::zeroed() };
                    m.msg_iov = iov.cast_mut();
                    m.msg_iovlen = n.max(0) as _;
                    // SAFETY: as above.
                    unsafe { real::recvmsg(fd, &mut m, x) }
                })
            }
            _ => real(),
        }
    })
}

/// # Safety
/// As for libc's `writev`.
pub unsafe fn writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::writev(fd, iov, n) };
    guard(real, || match crate::settle::socket_to_write(fd).as_deref() {
        Some(Socket::Tcp(c)) => {
            // SAFETY: the caller's iovecs.
            let v: Vec<(*const u8, usize)> =
                unsafe { iovs_mut(iov, n) }.iter().map(|&(p, l)| (p.cast_const(), l)).collect();
            do_send(c, fd, &v, 0)
        }
        Some(Socket::Udp(u)) => {
            // SAFETY: the caller's iovecs.
            let v: Vec<(*const u8, usize)> =
                unsafe { iovs_mut(iov, n) }.iter().map(|&(p, l)| (p.cast_const(), l)).collect();
            u.send(fd, None, &v, 0, &mut || real())
        }
        _ => real(),
    })
}

/// # Safety
/// As for libc's `recv`.
pub unsafe fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::recv(fd, buf, n, flags) };
    guard(real, || {
        let Ok(s) = crate::settle::socket_to_read(fd, flags) else { return interrupted() };
        match s.as_deref() {
            Some(Socket::Tcp(c)) => do_recv(c, fd, &[(buf.cast(), n)], flags),
            // SAFETY: forwarded arguments.
            Some(Socket::Udp(u)) => udp_recv(u, fd, &[(buf.cast(), n)], flags, Name::None, &mut |x| unsafe {
                real::recv(fd, buf, n, flags | x)
            }),
            _ => real(),
        }
    })
}

/// # Safety
/// As for glibc's `__recv_chk`.
pub unsafe fn __recv_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int) -> ssize_t {
    if n > buflen {
        // SAFETY: what glibc does on a fortify failure.
        unsafe { libc::abort() };
    }
    // SAFETY: forwarded.
    unsafe { recv(fd, buf, n, flags) }
}

/// # Safety
/// As for libc's `send`.
pub unsafe fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::send(fd, buf, n, flags) };
    guard(real, || match crate::settle::socket_to_write(fd).as_deref() {
        Some(Socket::Tcp(c)) => do_send(c, fd, &[(buf.cast(), n)], flags),
        Some(Socket::Udp(u)) => u.send(fd, None, &[(buf.cast(), n)], flags, &mut || real()),
        _ => real(),
    })
}

/// # Safety
/// As for libc's `recvfrom`.
pub unsafe fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::recvfrom(fd, buf, n, flags, addr, alen) };
    guard(real, || {
        let Ok(s) = crate::settle::socket_to_read(fd, flags) else { return interrupted() };
        match s.as_deref() {
            Some(Socket::Tcp(c)) => {
                let r = do_recv(c, fd, &[(buf.cast(), n)], flags);
                if r >= 0 && !addr.is_null() && !alen.is_null() {
                    // SAFETY: the caller's length word. TCP reports no source address.
                    unsafe { *alen = 0 };
                }
                r
            }
            Some(Socket::Udp(u)) => {
                udp_recv(u, fd, &[(buf.cast(), n)], flags, Name::Addr(addr, alen), &mut |x| {
                    // SAFETY: forwarded arguments.
                    unsafe { real::recvfrom(fd, buf, n, flags | x, addr, alen) }
                })
            }
            _ => real(),
        }
    })
}

/// # Safety
/// As for glibc's `__recvfrom_chk`.
pub unsafe fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: what glibc does on a fortify failure.
        unsafe { libc::abort() };
    }
    // SAFETY: forwarded.
    unsafe { recvfrom(fd, buf, n, flags, addr, alen) }
}

/// # Safety
/// As for libc's `sendto`.
pub unsafe fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::sendto(fd, buf, n, flags, addr, alen) };
    // A connected TCP socket ignores the address, as the kernel does.
    guard(real, || match crate::settle::socket_to_write(fd).as_deref() {
        Some(Socket::Tcp(c)) => do_send(c, fd, &[(buf.cast(), n)], flags),
        Some(Socket::Udp(u)) => match udp_dest(u, addr, alen) {
            Ok(d) => u.send(fd, d, &[(buf.cast(), n)], flags, &mut || real()),
            Err(()) => real(),
        },
        _ => real(),
    })
}

/// # Safety
/// As for libc's `sendmsg`.
pub unsafe fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::sendmsg(fd, msg, flags) };
    guard(real, || {
        if msg.is_null() {
            return real();
        }
        match crate::settle::socket_to_write(fd).as_deref() {
            Some(Socket::Tcp(c)) => {
                // SAFETY: the caller's msghdr and its iovecs.
                let v: Vec<(*const u8, usize)> =
                    unsafe { iovs_mut((*msg).msg_iov, (*msg).msg_iovlen as c_int) }
                        .iter()
                        .map(|&(p, l)| (p.cast_const(), l))
                        .collect();
                do_send(c, fd, &v, flags)
            }
            // SAFETY: the caller's msghdr.
            Some(Socket::Udp(u)) => unsafe { udp_sendmsg(u, fd, msg, flags, &mut || real()) },
            // Accelerated sockets passed over a Unix socket take their rings along.
            // SAFETY: the caller's msghdr.
            _ => unsafe { pass::sendmsg(fd, msg, flags) }.unwrap_or_else(real),
        }
    })
}

/// One `sendmsg` on a strait UDP socket (control data goes to the kernel).
///
/// # Safety
/// `msg` is a valid msghdr.
unsafe fn udp_sendmsg(
    u: &UdpSock,
    fd: c_int,
    msg: *const msghdr,
    flags: c_int,
    kernel: &mut dyn FnMut() -> ssize_t,
) -> ssize_t {
    // SAFETY: per the caller.
    let m = unsafe { &*msg };
    if m.msg_controllen > 0 {
        return kernel();
    }
    match udp_dest(u, m.msg_name.cast(), m.msg_namelen) {
        Ok(d) => {
            // SAFETY: the caller's iovecs.
            let v: Vec<(*const u8, usize)> = unsafe { iovs_mut(m.msg_iov, m.msg_iovlen as c_int) }
                .iter()
                .map(|&(p, l)| (p.cast_const(), l))
                .collect();
            u.send(fd, d, &v, flags, kernel)
        }
        Err(()) => kernel(),
    }
}

/// # Safety
/// As for libc's `recvmsg`.
pub unsafe fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::recvmsg(fd, msg, flags) };
    guard(real, || {
        if msg.is_null() {
            return real();
        }
        let Ok(s) = crate::settle::socket_to_read(fd, flags) else { return interrupted() };
        match s.as_deref() {
            Some(Socket::Tcp(c)) => {
                // SAFETY: the caller's msghdr and its iovecs.
                let v = unsafe { iovs_mut((*msg).msg_iov, (*msg).msg_iovlen as c_int) };
                let r = do_recv(c, fd, &v, flags);
                if r >= 0 {
                    // SAFETY: the caller's msghdr: no address, no control data for TCP.
                    unsafe {
                        (*msg).msg_namelen = 0;
                        (*msg).msg_controllen = 0;
                        (*msg).msg_flags = 0;
                    }
                }
                r
            }
            Some(Socket::Udp(u)) => {
                // SAFETY: the caller's msghdr and its iovecs.
                let v = unsafe { iovs_mut((*msg).msg_iov, (*msg).msg_iovlen as c_int) };
                // SAFETY: forwarded arguments.
                udp_recv(u, fd, &v, flags, Name::Msg(msg), &mut |x| unsafe {
                    real::recvmsg(fd, msg, flags | x)
                })
            }
            _ => {
                let r = real();
                if r >= 0 {
                    // SAFETY: the msghdr the kernel just filled.
                    unsafe { pass::after_recvmsg(msg) };
                }
                r
            }
        }
    })
}

/// # Safety
/// As for libc's `sendfile`.
pub unsafe fn sendfile(out: c_int, inp: c_int, off: *mut libc::off_t, count: size_t) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::sendfile(out, inp, off, count) };
    guard(real, || {
        let Some(c) = crate::settle::accel_to_write(out) else { return real() };
        let mut buf = vec![0u8; count.min(256 << 10)];
        let mut done = 0usize;
        while done < count {
            let want = (count - done).min(buf.len());
            // SAFETY: reads into our buffer; `off` is the caller's offset word.
            let n = unsafe {
                if off.is_null() {
                    real::read(inp, buf.as_mut_ptr().cast(), want)
                } else {
                    libc::pread(inp, buf.as_mut_ptr().cast(), want, *off)
                }
            };
            if n <= 0 {
                if done == 0 {
                    return n;
                }
                break;
            }
            let w = do_send(&c, out, &[(buf.as_ptr(), n as usize)], 0);
            if w < 0 {
                return if done == 0 { w } else { done as ssize_t };
            }
            if !off.is_null() {
                // SAFETY: the caller's offset word.
                unsafe { *off += w as libc::off_t };
            } else if (w as usize) < n as usize {
                // SAFETY: rewinds the file position by what was not sent.
                unsafe { libc::lseek(inp, w as libc::off_t - n as libc::off_t, libc::SEEK_CUR) };
            }
            done += w as usize;
            if (w as usize) < n as usize {
                break;
            }
        }
        done as ssize_t
    })
}

/// `sendfile64` (what programs built with 64-bit file offsets call; the same
/// function on 64-bit targets).
///
/// # Safety
/// As for libc's `sendfile64`.
pub unsafe fn sendfile64(out: c_int, inp: c_int, off: *mut libc::off_t, count: size_t) -> ssize_t {
    // SAFETY: forwarded.
    unsafe { sendfile(out, inp, off, count) }
}

/// Runs `one(i, m)` on each of the caller's `n` mmsghdrs at `v` in order, as
/// `sendmmsg` and `recvmmsg` do: a message's result (bytes, or -1 with errno set)
/// goes to its `msg_len`; an error ends the call (-1 on the first message, else the
/// count so far), and so does a result for which `last` is true, after counting it.
/// Returns how many messages were done.
///
/// # Safety
/// `v` points to `n` mmsghdrs the caller lets us write.
unsafe fn each_mmsg(
    v: *mut libc::mmsghdr,
    n: libc::c_uint,
    last: impl Fn(ssize_t) -> bool,
    mut one: impl FnMut(usize, &mut libc::mmsghdr) -> ssize_t,
) -> c_int {
    let mut done = 0;
    for i in 0..n as usize {
        // SAFETY: the caller's array of `n` mmsghdrs.
        let m = unsafe { &mut *v.add(i) };
        let r = one(i, m);
        if r < 0 {
            return if done == 0 { -1 } else { done };
        }
        m.msg_len = r as libc::c_uint;
        done += 1;
        if last(r) {
            break;
        }
    }
    done
}

/// # Safety
/// As for libc's `sendmmsg`.
pub unsafe fn sendmmsg(fd: c_int, v: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::sendmmsg(fd, v, n, flags) };
    guard(real, || {
        if let Some(u) = crate::table::udp(fd) {
            // SAFETY: the caller's array of `n` mmsghdrs.
            return unsafe {
                each_mmsg(
                    v,
                    n,
                    |_| false,
                    |_, m| {
                        let h: *const msghdr = &m.msg_hdr;
                        // SAFETY: the caller's msghdr; the kernel call sends just this one.
                        udp_sendmsg(&u, fd, h, flags, &mut || real::sendmsg(fd, h, flags))
                    },
                )
            };
        }
        let Some(c) = crate::settle::accel_to_write(fd) else { return real() };
        // SAFETY: the caller's array of `n` mmsghdrs and their iovecs.
        unsafe {
            each_mmsg(
                v,
                n,
                |_| false,
                |_, m| {
                    let iov: Vec<(*const u8, usize)> =
                        iovs_mut(m.msg_hdr.msg_iov, m.msg_hdr.msg_iovlen as c_int)
                            .iter()
                            .map(|&(p, l)| (p.cast_const(), l))
                            .collect();
                    do_send(&c, fd, &iov, flags)
                },
            )
        }
    })
}

/// `recvmmsg` (the timeout is not applied to accelerated sockets).
///
/// # Safety
/// As for libc's `recvmmsg`.
pub unsafe fn recvmmsg(
    fd: c_int,
    v: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
    t: *mut timespec,
) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::recvmmsg(fd, v, n, flags, t) };
    // After the first message, MSG_WAITFORONE makes the rest non-blocking.
    let flags_for = |i: usize| {
        let f = if i > 0 && flags & libc::MSG_WAITFORONE != 0 { flags | libc::MSG_DONTWAIT } else { flags };
        f & !libc::MSG_WAITFORONE
    };
    guard(real, || {
        if let Some(u) = crate::table::udp(fd) {
            // SAFETY: the caller's array of `n` mmsghdrs and their iovecs.
            return unsafe {
                each_mmsg(
                    v,
                    n,
                    |_| false,
                    |i, m| {
                        let iov = iovs_mut(m.msg_hdr.msg_iov, m.msg_hdr.msg_iovlen as c_int);
                        let f = flags_for(i);
                        let h: *mut msghdr = &mut m.msg_hdr;
                        // SAFETY: the caller's msghdr.
                        udp_recv(&u, fd, &iov, f, Name::Msg(h), &mut |x| real::recvmsg(fd, h, f | x))
                    },
                )
            };
        }
        let Some(c) = crate::settle::accel(fd) else { return real() };
        // SAFETY: the caller's array of `n` mmsghdrs and their iovecs.
        unsafe {
            each_mmsg(
                v,
                n,
                |r| r == 0,
                |i, m| {
                    let iov = iovs_mut(m.msg_hdr.msg_iov, m.msg_hdr.msg_iovlen as c_int);
                    let r = do_recv(&c, fd, &iov, flags_for(i));
                    if r >= 0 {
                        m.msg_hdr.msg_namelen = 0;
                        m.msg_hdr.msg_controllen = 0;
                        m.msg_hdr.msg_flags = 0;
                    }
                    r
                },
            )
        }
    })
}

/// `splice` to or from an accelerated socket, through a buffer (the other end is a
/// pipe, as splice requires).
///
/// # Safety
/// As for libc's `splice`.
pub unsafe fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: libc::c_uint,
) -> ssize_t {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) };
    if !table::any_live() {
        return real();
    }
    guard(real, || {
        let nb = if flags & libc::SPLICE_F_NONBLOCK != 0 { libc::MSG_DONTWAIT } else { 0 };
        let mut buf = vec![0u8; len.min(64 << 10)];
        if let Some(c) = crate::settle::accel_to_write(fd_out) {
            // SAFETY: reads from the caller's pipe into our buffer.
            let n = unsafe { real::read(fd_in, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return n;
            }
            return do_send(&c, fd_out, &[(buf.as_ptr(), n as usize)], nb | libc::MSG_NOSIGNAL);
        }
        if let Some(c) = crate::settle::accel(fd_in) {
            // Peek, hand the pipe what it takes, then consume exactly that much.
            let n = do_recv(&c, fd_in, &[(buf.as_mut_ptr(), buf.len())], nb | libc::MSG_PEEK);
            if n <= 0 {
                return n;
            }
            // SAFETY: writes our buffer to the caller's pipe.
            let w = unsafe { real::write(fd_out, buf.as_ptr().cast(), n as usize) };
            if w > 0 {
                do_recv(&c, fd_in, &[(buf.as_mut_ptr(), w as usize)], libc::MSG_DONTWAIT);
            }
            return w;
        }
        real()
    })
}

/// # Safety
/// As for libc's `close`.
pub unsafe fn close(fd: c_int) -> c_int {
    // SAFETY: forwarded argument.
    let real = || unsafe { real::close(fd) };
    if crate::fds::closing_own() {
        return real();
    }
    guard(real, || {
        if crate::fds::is_internal(fd) {
            // Not the program's: as if it were not open.
            real::set_errno(libc::EBADF);
            return -1;
        }
        // An accelerated connection is let go after the real close, so that the
        // kernel can tell whether another process (one made by a raw clone, which
        // the library never saw) still holds the socket.
        let conn = table::remove(fd);
        let last = conn.as_ref().filter(|c| c.fdrefs.load(std::sync::atomic::Ordering::Acquire) == 1);
        if let Some(c) = last {
            // Unread early bytes in the kernel socket would make its close a reset.
            c.discard_early_copy(fd);
        }
        // (The socket's addresses are asked only where the library, not the
        // kernel's hang-up, tells the peer: see `Conn::release_closed`.)
        let ids = last
            .filter(|c| !c.watched_by_socket())
            .and_then(|_| Some((crate::sock::sock_key(fd, false)?, crate::sock::sock_key(fd, true)?)));
        // (Its connection, if any, is out of the table already.)
        forget_all_but_conn(fd);
        if let Some(c) = &conn {
            // Before the number is free for another file.
            unwatch_before_close(fd, c);
        }
        let r = real();
        if let Some(c) = conn {
            table::drop_ref_closed(c, ids);
        }
        r
    })
}

/// Everything the library knows about `fd`, which is being closed.
fn forget(fd: c_int) {
    if let Some(c) = table::remove(fd) {
        unwatch_before_close(fd, &c);
        table::drop_ref(c);
    }
    forget_all_but_conn(fd);
}

/// What the library knows about `fd` besides an accelerated connection.
fn forget_all_but_conn(fd: c_int) {
    discover::mark_other(fd, false);
    table::remove_listening(fd);
    table::remove_udp(fd);
    crate::epoll::forget_set(fd);
}

/// The open descriptors in `first..=last`, or `None` if they cannot be listed.
fn open_fds_in(first: c_uint, last: c_uint) -> Option<Vec<c_int>> {
    let mut v = strait_sys::procfs::own_fds()?;
    v.retain(|&fd| c_uint::try_from(fd).is_ok_and(|u| u >= first && u <= last));
    Some(v)
}

/// # Safety
/// As for libc's `close_range`.
pub unsafe fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { libc::syscall(libc::SYS_close_range, first, last, flags) as c_int };
    guard(real, || {
        if first > last || flags & !(libc::CLOSE_RANGE_CLOEXEC | libc::CLOSE_RANGE_UNSHARE) as c_int != 0 {
            real::set_errno(libc::EINVAL);
            return -1;
        }
        let carried = table::any_live() || crate::table::any_udp() || table::any_listening();
        if !(carried || crate::fds::any_internal()) {
            return real();
        }
        if flags & libc::CLOSE_RANGE_UNSHARE as c_int != 0 {
            // SAFETY: plain syscall: this thread gets its own descriptor table.
            if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
                return -1;
            }
        }
        let flags = flags & !(libc::CLOSE_RANGE_UNSHARE as c_int);
        if !carried {
            // Only the library's own descriptors to step over (such as its handle on
            // /proc, held from the start): the ranges between them, one call each.
            let mut from = first;
            for fd in crate::fds::internal_in(first, last) {
                // (Descriptors are below i32::MAX: no overflow.)
                let fd = fd as c_uint;
                if fd > from {
                    // SAFETY: plain syscall on the program's descriptors only.
                    unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, flags) };
                }
                from = fd + 1;
            }
            if from > last {
                return 0;
            }
            // SAFETY: as above.
            return unsafe { libc::syscall(libc::SYS_close_range, from, last, flags) as c_int };
        }
        // Descriptor by descriptor, stepping over the library's own (the directory
        // listing's own descriptor is closed by the time we close, and skipped).
        let Some(fds) = open_fds_in(first, last) else { return real() };
        for fd in fds {
            if crate::fds::is_internal(fd) {
                continue;
            }
            if flags & libc::CLOSE_RANGE_CLOEXEC as c_int != 0 {
                // SAFETY: plain syscalls on the program's descriptor.
                unsafe {
                    let f = real::fcntl(fd, libc::F_GETFD, 0);
                    if f >= 0 {
                        real::fcntl(fd, libc::F_SETFD, (f | libc::FD_CLOEXEC) as usize);
                    }
                }
            } else {
                forget(fd);
                // SAFETY: closes the program's descriptor.
                unsafe { real::close(fd) };
            }
        }
        0
    })
}

/// # Safety
/// As for libc's `closefrom`.
pub unsafe fn closefrom(first: c_int) {
    // SAFETY: forwarded; closefrom has no result.
    unsafe { close_range(first.max(0) as c_uint, c_uint::MAX, 0) };
}

/// # Safety
/// As for libc's `shutdown`.
pub unsafe fn shutdown(fd: c_int, how: c_int) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::shutdown(fd, how) };
    guard(real, || {
        if let Some(c) = crate::settle::accel_now(fd) {
            if !(libc::SHUT_RD..=libc::SHUT_RDWR).contains(&how) {
                real::set_errno(libc::EINVAL);
                return -1;
            }
            c.shutdown(how);
            if !c.watched_by_socket() {
                // A connection to another host: the kernel socket follows, so its
                // state answers as expected.
                real();
            } else if c.awaiting_attach() {
                // Not settled: if it ends on the kernel, the kernel socket shuts
                // down then ([`crate::discover::give_up`]).
                c.defer_kernel_shutdown(how);
            }
            // Otherwise never forwarded: the kernel socket's hang-up must mean
            // that the peer's last holder is gone
            // ([`crate::conn::Liveness::TcpSocket`]); the half-close travels in
            // the rings.
            return 0;
        }
        real()
    })
}

/// After a successful dup-like call made `r` a copy of `fd`: `r` refers to what
/// `fd` refers to. Returns `r`.
fn after_dup(fd: c_int, r: c_int) -> c_int {
    guard(
        || r,
        || {
            if r >= 0 && (table::any_live() || crate::table::any_udp()) {
                table::dup(fd, r);
            }
            r
        },
    )
}

/// # Safety
/// As for libc's `dup`.
pub unsafe fn dup(fd: c_int) -> c_int {
    // SAFETY: forwarded argument.
    let r = unsafe { real::dup(fd) };
    after_dup(fd, r)
}

/// # Safety
/// As for libc's `dup2`.
pub unsafe fn dup2(fd: c_int, new: c_int) -> c_int {
    before_dup_onto(fd, new);
    // SAFETY: forwarded arguments.
    let r = unsafe { real::dup2(fd, new) };
    after_dup(fd, r)
}

/// The program's descriptor `fd` of `c` is about to close (or to get another
/// file): epoll sets that watch the peer's hang-up through it move to another.
fn unwatch_before_close(fd: c_int, c: &std::sync::Arc<Conn>) {
    crate::epoll::hup_fd_closing(fd, c, &|| table::fd_of(c, fd));
}

/// Before a dup-like call puts `fd`'s file at `new`: if `new` was a descriptor of
/// another connection, the epoll sets stop watching through it while it still
/// is that connection's.
fn before_dup_onto(fd: c_int, new: c_int) {
    if fd == new || !table::any_live() {
        return;
    }
    guard(
        || (),
        || {
            if let Some(c) = table::lookup(new) {
                if !table::lookup(fd).is_some_and(|o| std::sync::Arc::ptr_eq(&o, &c)) {
                    unwatch_before_close(new, &c);
                }
            }
        },
    );
}

/// # Safety
/// As for libc's `dup3`.
pub unsafe fn dup3(fd: c_int, new: c_int, flags: c_int) -> c_int {
    before_dup_onto(fd, new);
    // SAFETY: forwarded arguments.
    let r = unsafe { real::dup3(fd, new, flags) };
    after_dup(fd, r)
}

fn fcntl_impl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    // SAFETY: forwarded arguments.
    let r = unsafe { real::fcntl(fd, cmd, arg) };
    if r < 0 || !(table::any_live() || crate::table::any_udp()) {
        return r;
    }
    let e = real::errno();
    guard(
        || (),
        || match cmd {
            libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => table::dup(fd, r),
            libc::F_SETFL => {
                if let Some(s) = table::get(fd) {
                    s.set_nonblock(arg as c_int & libc::O_NONBLOCK != 0);
                }
            }
            _ => {}
        },
    );
    real::set_errno(e);
    r
}

/// `fcntl` (variadic in C: the third argument arrives in the same register as a
/// fixed one would on the supported ABIs).
///
/// # Safety
/// As for libc's `fcntl`.
pub unsafe fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    fcntl_impl(fd, cmd, arg)
}

/// # Safety
/// As for libc's `fcntl64`.
pub unsafe fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    fcntl_impl(fd, cmd, arg)
}

/// `ioctl`: FIONREAD and FIONBIO on accelerated sockets.
///
/// # Safety
/// As for libc's `ioctl`.
pub unsafe fn ioctl(fd: c_int, req: c_ulong, arg: usize) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::ioctl(fd, req, arg) };
    if !(table::any_live() || crate::table::any_udp()) {
        return real();
    }
    guard(real, || {
        if req == libc::FIONREAD && arg != 0 {
            let queued = match crate::settle::socket_now(fd).as_deref() {
                Some(Socket::Tcp(c)) => Some(c.fionread().min(c_int::MAX as usize)),
                // UDP: the size of the next datagram (shared memory first, as a
                // receive would take it).
                Some(Socket::Udp(u)) => u.next_len(),
                _ => None,
            };
            if let Some(n) = queued {
                // SAFETY: FIONREAD's argument is an int pointer.
                unsafe { *(arg as *mut c_int) = n as c_int };
                return 0;
            }
        }
        let r = real();
        if r == 0 && req == libc::FIONBIO && arg != 0 {
            // SAFETY: FIONBIO's argument is an int pointer.
            let on = unsafe { *(arg as *const c_int) } != 0;
            if let Some(s) = table::get(fd) {
                s.set_nonblock(on);
            }
        }
        r
    })
}

// ------------------------------------------------------------------ waiting

/// # Safety
/// As for libc's `poll`.
pub unsafe fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::poll(fds, n, timeout) };
    if !(table::any_live() || crate::table::any_udp()) || fds.is_null() || n == 0 {
        return real();
    }
    guard(real, || {
        // SAFETY: the caller's array of `n` pollfds.
        let s = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
        poll::poll(s, deadline_ms(timeout), None).unwrap_or_else(real)
    })
}

/// # Safety
/// As for glibc's `__poll_chk`.
pub unsafe fn __poll_chk(fds: *mut pollfd, n: nfds_t, timeout: c_int, fdslen: size_t) -> c_int {
    if (fdslen / std::mem::size_of::<pollfd>()) < n as usize {
        // SAFETY: what glibc does on a fortify failure.
        unsafe { libc::abort() };
    }
    // SAFETY: forwarded.
    unsafe { poll(fds, n, timeout) }
}

/// # Safety
/// As for libc's `ppoll`.
pub unsafe fn ppoll(fds: *mut pollfd, n: nfds_t, t: *const timespec, mask: *const sigset_t) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::ppoll(fds, n, t, mask) };
    if !(table::any_live() || crate::table::any_udp()) || fds.is_null() || n == 0 {
        return real();
    }
    guard(real, || {
        // SAFETY: the caller's array of `n` pollfds.
        let s = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
        let m = (!mask.is_null()).then_some(mask);
        poll::poll(s, deadline_ts(t), m).unwrap_or_else(real)
    })
}

/// # Safety
/// As for libc's `select`.
pub unsafe fn select(
    n: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    t: *mut libc::timeval,
) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::select(n, r, w, e, t) };
    if !(table::any_live() || crate::table::any_udp()) {
        return real();
    }
    guard(real, || {
        let deadline = if t.is_null() {
            None
        } else {
            // SAFETY: the caller's timeval.
            let tv = unsafe { *t };
            Some(
                Instant::now()
                    + Duration::from_micros(tv.tv_sec.max(0) as u64 * 1_000_000 + tv.tv_usec.max(0) as u64),
            )
        };
        // SAFETY: the caller's sets.
        unsafe { poll::select(n, r, w, e, deadline, None) }.unwrap_or_else(real)
    })
}

/// # Safety
/// As for libc's `pselect`.
pub unsafe fn pselect(
    n: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    t: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::pselect(n, r, w, e, t, mask) };
    if !(table::any_live() || crate::table::any_udp()) {
        return real();
    }
    guard(real, || {
        let m = (!mask.is_null()).then_some(mask);
        // SAFETY: the caller's sets.
        unsafe { poll::select(n, r, w, e, deadline_ts(t), m) }.unwrap_or_else(real)
    })
}

/// # Safety
/// As for libc's `epoll_pwait2`.
pub unsafe fn epoll_pwait2(
    ep: c_int,
    ev: *mut epoll_event,
    max: c_int,
    t: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::epoll_pwait2(ep, ev, max, t, mask) };
    guard(real, || {
        let m = (!mask.is_null()).then_some(mask);
        // SAFETY: the caller's event buffer of `max` entries.
        unsafe { crate::epoll::wait(ep, ev, max, timeout_ts(t), m) }.unwrap_or_else(real)
    })
}

/// # Safety
/// As for libc's `epoll_ctl`.
pub unsafe fn epoll_ctl(ep: c_int, op: c_int, fd: c_int, ev: *mut epoll_event) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { real::epoll_ctl(ep, op, fd, ev) };
    // A member we do not carry: the kernel's, counted if the set is one we know.
    let kernel = || {
        let r = real();
        if crate::epoll::sets_known() {
            let e = real::errno();
            crate::epoll::note_kernel_ctl(ep, op, r);
            real::set_errno(e);
        }
        r
    };
    if !(table::any_live() || crate::table::any_udp()) {
        return kernel();
    }
    guard(real, || match crate::settle::socket_now(fd).as_deref() {
        Some(Socket::Tcp(c)) => crate::epoll::ctl(ep, op, fd, c.clone(), ev),
        // The kernel set keeps the socket (kernel datagrams); the library adds
        // its shared-memory side.
        Some(Socket::Udp(u)) => {
            let r = real();
            if r == 0 {
                let e = real::errno();
                crate::epoll::ctl_udp(ep, op, fd, u.clone(), ev);
                real::set_errno(e);
            }
            r
        }
        _ => kernel(),
    })
}

/// # Safety
/// As for libc's `epoll_wait`.
pub unsafe fn epoll_wait(ep: c_int, ev: *mut epoll_event, max: c_int, timeout: c_int) -> c_int {
    // SAFETY: forwarded arguments.
    let real = || unsafe { crate::epoll::kernel_wait(ep, ev, max, timeout, None) };
    guard(real, || {
        // SAFETY: the caller's event buffer of `max` entries.
        unsafe { crate::epoll::wait(ep, ev, max, timeout_ms(timeout), None) }.unwrap_or_else(real)
    })
}

/// # Safety
/// As for libc's `epoll_pwait`.
pub unsafe fn epoll_pwait(
    ep: c_int,
    ev: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    // SAFETY: forwarded arguments.
    let real =
        || unsafe { crate::epoll::kernel_wait(ep, ev, max, timeout, (!mask.is_null()).then_some(mask)) };
    guard(real, || {
        let m = (!mask.is_null()).then_some(mask);
        // SAFETY: the caller's event buffer of `max` entries.
        unsafe { crate::epoll::wait(ep, ev, max, timeout_ms(timeout), m) }.unwrap_or_else(real)
    })
}
