//! What the library asks of kernel sockets, and how it moves descriptors: address
//! keys, socket options, abstract Unix names, SCM_RIGHTS messages. The lowest layer
//! of the crate (with [`crate::real`]): it imports nothing above it.

use std::os::fd::IntoRawFd;
use std::sync::OnceLock;

use libc::{c_int, sockaddr, sockaddr_storage, socklen_t};

use crate::real;

/// Address key of a TCP endpoint: IPv4 (or v4-mapped IPv6) as `::ffff:a.b.c.d`.
pub type Key = ([u8; 16], u16);

pub(crate) fn netns() -> u64 {
    static NS: OnceLock<u64> = OnceLock::new();
    *NS.get_or_init(|| {
        // (Through the handle on `/proc`: first asked after a `chroot`, too.)
        strait_sys::procfs::inode("self/ns/net").unwrap_or(0)
    })
}

pub(crate) fn v4_mapped(k: &Key) -> bool {
    k.0[..10].iter().all(|&b| b == 0) && k.0[10] == 0xff && k.0[11] == 0xff
}

pub(crate) fn abstract_name(name: &str) -> (libc::sockaddr_un, socklen_t) {
    // SAFETY: sockaddr_un is plain old data.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (i, b) in name.bytes().enumerate() {
        sa.sun_path[i + 1] = b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    (sa, len as socklen_t)
}

/// The key and loopback-ness of a socket address.
pub fn key_of(sa: *const sockaddr, len: socklen_t) -> Option<(Key, bool)> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller passes an address of `len` bytes; we read the family first
    // and the rest only if `len` covers it.
    unsafe {
        match (*sa).sa_family as c_int {
            libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
                let s = &*sa.cast::<libc::sockaddr_in>();
                let ip = s.sin_addr.s_addr.to_ne_bytes();
                let mut k = [0u8; 16];
                k[10] = 0xff;
                k[11] = 0xff;
                k[12..].copy_from_slice(&ip);
                Some(((k, u16::from_be(s.sin_port)), ip[0] == 127))
            }
            libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
                let s = &*sa.cast::<libc::sockaddr_in6>();
                let a = s.sin6_addr.s6_addr;
                let mapped = a[..10].iter().all(|&b| b == 0) && a[10] == 0xff && a[11] == 0xff;
                let lo = a == std::net::Ipv6Addr::LOCALHOST.octets() || (mapped && a[12] == 127);
                Some(((a, u16::from_be(s.sin6_port)), lo))
            }
            _ => None,
        }
    }
}

pub fn sock_key(fd: c_int, peer: bool) -> Option<Key> {
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<sockaddr_storage>() as socklen_t;
    let p = (&mut ss as *mut sockaddr_storage).cast::<sockaddr>();
    // SAFETY: a local sockaddr_storage and its length.
    let r = unsafe {
        if peer {
            libc::getpeername(fd, p, &mut len)
        } else {
            libc::getsockname(fd, p, &mut len)
        }
    };
    if r != 0 {
        return None;
    }
    key_of(p, len).map(|(k, _)| k)
}

pub(crate) fn is_tcp_stream(fd: c_int) -> bool {
    socket_option(fd, libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && socket_option(fd, libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

/// True while the kernel's TCP handshake of `fd` is under way (`SYN_SENT`), as
/// `TCP_INFO` tells; false once it is established or failed, or if the kernel
/// does not say.
pub(crate) fn tcp_connecting(fd: c_int) -> bool {
    /// `TCP_SYN_SENT` in the kernel's `tcp_states.h`.
    const TCP_SYN_SENT: u8 = 2;
    // (The state is the first byte of `struct tcp_info`; the kernel copies as
    // much of the structure as the buffer holds.)
    let mut info = [0u8; 8];
    let mut l = info.len() as socklen_t;
    // SAFETY: a local buffer and its length.
    let r =
        unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, info.as_mut_ptr().cast(), &mut l) };
    r == 0 && l >= 1 && info[0] == TCP_SYN_SENT
}

/// An integer `SOL_SOCKET` option of `fd`, or `None` (not a socket, or refused).
pub(crate) fn socket_option(fd: c_int, opt: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut l = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: a local int and its length.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, opt, (&mut v as *mut c_int).cast(), &mut l) };
    (r == 0).then_some(v)
}

/// Rings an eventfd (adds 1; never blocks: the library's eventfds are
/// non-blocking, and a full counter already means "rung").
pub(crate) fn ring_eventfd(fd: c_int) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a local to an eventfd.
    unsafe { real::write(fd, (&one as *const u64).cast(), 8) };
}

/// Empties an eventfd after a wake-up (non-blocking: an empty one stays so).
pub(crate) fn drain_eventfd(fd: c_int) {
    let mut v: u64 = 0;
    // SAFETY: an 8-byte eventfd read into a local; the library's eventfds are
    // non-blocking.
    unsafe { real::read(fd, (&mut v as *mut u64).cast(), 8) };
}

pub(crate) fn send_fds(sock: c_int, data: &[u8], fds: &[c_int]) -> bool {
    strait_sys::send_fds_with(real::sendmsg, sock, data, fds, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
        .is_ok_and(|n| n == data.len())
}

/// One message received without waiting, with the descriptors it carried (all of
/// them, close-on-exec, owned by the caller), and whether its control data was cut.
pub(crate) struct FdMessage {
    pub len: usize,
    pub fds: Vec<c_int>,
    pub truncated: bool,
}

/// `recvmsg` with SCM_RIGHTS, not waiting: `Err(errno)` when nothing came.
pub(crate) fn recv_fds_now(sock: c_int, buf: &mut [u8]) -> Result<FdMessage, c_int> {
    recv_fds(sock, buf, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT)
}

/// `recvmsg` with SCM_RIGHTS and `flags`: `Err(errno)` when nothing came.
pub(crate) fn recv_fds(sock: c_int, buf: &mut [u8], flags: c_int) -> Result<FdMessage, c_int> {
    recv_fds_max(sock, buf, flags, 12)
}

/// [`recv_fds`] with room for up to `max_fds` descriptors.
pub(crate) fn recv_fds_max(
    sock: c_int,
    buf: &mut [u8],
    flags: c_int,
    max_fds: usize,
) -> Result<FdMessage, c_int> {
    let m = strait_sys::recv_fds_with(real::recvmsg, sock, buf, flags, max_fds)
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    let fds = m.fds.into_iter().map(IntoRawFd::into_raw_fd).collect();
    Ok(FdMessage { len: m.len, fds, truncated: m.truncated })
}

pub(crate) fn close_all(fds: &[c_int]) {
    for &fd in fds {
        // SAFETY: descriptors we own.
        unsafe { real::close(fd) };
    }
}

/// An unspecified address (0.0.0.0, ::ffff:0.0.0.0 or ::), as in keys.
#[cfg(test)]
pub(crate) fn is_wildcard(a: &[u8; 16]) -> bool {
    a.iter().all(|&b| b == 0) || (a[..10].iter().all(|&b| b == 0) && a[10..] == [255, 255, 0, 0, 0, 0])
}

/// True if the IPv6 socket `fd` accepts IPv6 only (IPV6_V6ONLY).
pub(crate) fn v6only(fd: c_int) -> bool {
    let mut v: c_int = 0;
    let mut l = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: a local int and its length.
    unsafe {
        libc::getsockopt(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, (&mut v as *mut c_int).cast(), &mut l)
    };
    v != 0
}

/// True if `fd` is a memfd of exactly `len` bytes carrying every seal strait puts on
/// one (a peer that could resize it could make us fault).
pub(crate) fn memfd_ok(fd: c_int, len: usize) -> bool {
    strait_sys::check_sealed(fd, len).is_ok()
}

pub(crate) fn bind_ephemeral(fd: c_int) -> bool {
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<sockaddr_storage>() as socklen_t;
    let p = (&mut ss as *mut sockaddr_storage).cast::<sockaddr>();
    // SAFETY: a local sockaddr_storage and its length.
    if unsafe { libc::getsockname(fd, p, &mut len) } != 0 {
        return false;
    }
    // An unbound socket reports the wildcard address with port 0 in its own family:
    // binding exactly that picks an ephemeral port and leaves the source address to
    // the connect, as the kernel's automatic bind would.
    // SAFETY: binds the socket to the address the kernel just reported.
    unsafe { real::bind(fd, p, len) == 0 }
}

/// A listening, non-blocking Unix seqpacket socket at `sa` (a marker), or `None`
/// (nothing left open) if the name is taken or a call fails.
pub(crate) fn listen_marker(sa: &libc::sockaddr_un, len: socklen_t) -> Option<c_int> {
    // SAFETY: plain syscall.
    let u = unsafe {
        real::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0)
    };
    if u < 0 {
        return None;
    }
    // SAFETY: an initialised sockaddr_un of `len` bytes; plain syscalls.
    let ok = unsafe {
        real::bind(u, (sa as *const libc::sockaddr_un).cast(), len) == 0 && real::listen(u, 4096) == 0
    };
    if !ok {
        close_all(&[u]);
        return None;
    }
    Some(u)
}

/// Accepts one connection waiting at the library's own non-blocking Unix listener
/// `listener` (a marker, a connector's path-B name, a UDP socket's marker), close-on-
/// exec and non-blocking, or `None` if none waits. Asks `poll` first: an `accept4`
/// that finds nothing still makes and frees a socket in the kernel (~2 us on a
/// 2-vCPU VM, against ~0.25 us for the `poll`), and the library asks at every
/// `accept` of a listener that has a marker, where usually nothing waits.
pub(crate) fn accept_waiting(listener: c_int) -> Option<c_int> {
    let mut p = libc::pollfd { fd: listener, events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd; no waiting.
    if unsafe { real::poll(&mut p, 1, 0) } <= 0 || p.revents & libc::POLLIN == 0 {
        return None;
    }
    // SAFETY: accept4 without an address buffer.
    let c = unsafe {
        real::accept4(
            listener,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
        )
    };
    (c >= 0).then_some(c)
}

/// The kernel's `sendmsg` on `fd` with `flags` of at most `limit` bytes of `iov`
/// (the caller's segments, as `(pointer, length)`); the kernel's result, errno set.
pub(crate) fn kernel_sendmsg(fd: c_int, iov: &[(*const u8, usize)], limit: usize, flags: c_int) -> isize {
    let mut left = limit;
    let mut parts: Vec<libc::iovec> = Vec::with_capacity(iov.len());
    for &(p, l) in iov {
        if left == 0 {
            break;
        }
        let take = l.min(left);
        parts.push(libc::iovec { iov_base: p.cast_mut().cast(), iov_len: take });
        left -= take;
    }
    // SAFETY: msghdr is plain old data; it points at our iovec array, which points
    // at the caller's buffers (its write call's contract).
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = parts.as_mut_ptr();
    m.msg_iovlen = parts.len() as _;
    // SAFETY: as above.
    unsafe { crate::real::sendmsg(fd, &m, flags) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `accept_waiting` takes exactly the connections that wait, one per call, and
    /// says `None` (without failing) when none does, before and after.
    #[test]
    fn accept_waiting_takes_what_waits_and_nothing_else() {
        let name = format!("strait.test.accept-waiting.{}", std::process::id());
        let (sa, len) = abstract_name(&name);
        let l = listen_marker(&sa, len).expect("a marker");
        assert_eq!(accept_waiting(l), None, "nothing waits yet");
        let mut clients = Vec::new();
        for _ in 0..3 {
            // SAFETY: plain syscalls on our own sockets and a local address.
            let c = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
            assert!(c >= 0);
            // SAFETY: as above.
            assert_eq!(unsafe { libc::connect(c, (&sa as *const libc::sockaddr_un).cast(), len) }, 0);
            clients.push(c);
        }
        let mut taken = Vec::new();
        while let Some(c) = accept_waiting(l) {
            // SAFETY: F_GETFL/F_GETFD on the descriptor just accepted.
            let (fl, fd_fl) = unsafe { (libc::fcntl(c, libc::F_GETFL), libc::fcntl(c, libc::F_GETFD)) };
            assert!(
                fl & libc::O_NONBLOCK != 0 && fd_fl & libc::FD_CLOEXEC != 0,
                "non-blocking, close-on-exec"
            );
            taken.push(c);
            assert!(taken.len() <= 3, "more accepted than connected");
        }
        assert_eq!(taken.len(), 3, "every waiting connection taken");
        assert_eq!(accept_waiting(l), None, "nothing waits any more");
        close_all(&taken);
        close_all(&clients);
        close_all(&[l]);
    }
}
