//! Who is at the other end of a rendezvous, decided by this process from what the
//! kernel says, never from what a peer claims (docs/SECURITY.md).
//!
//! Abstract Unix socket names have no permissions: any user of the network
//! namespace can bind the name a strait listener would use, or connect to it. So
//! nothing that gives power (a memfd, a doorbell, a socket) leaves this process
//! before the other side is proven to be the other end of this very connection:
//!
//! * **Tokens, not sockets.** A side proves that it holds its end of a TCP
//!   connection (or its UDP socket) by sending an `O_PATH` descriptor of the socket
//!   ([`socket_token`]). Such a descriptor names the socket's inode and can do
//!   nothing else: no I/O, no socket call, and the kernel refuses to reopen a socket
//!   through `/proc`. The receiver compares its inode with the inode the kernel's
//!   socket diagnostics ([`diag_lookup`], `NETLINK_SOCK_DIAG`, readable by every
//!   user) give for the exact addresses the connection has. Only a holder of the
//!   socket (or a process that may ptrace one, and so could take it anyway) can
//!   produce that token. This works between different users, as TCP itself does.
//! * **Markers by owner.** Before a connector sends its hello to a listener's name,
//!   it checks that the name's holder (`SO_PEERCRED`) is root, itself, or the user
//!   that owns the listening socket the kernel would pick for this connection (from
//!   the socket diagnostics). Another user cannot own a listening socket on a port
//!   the victim listens on, so a squatter is refused and costs only the kernel path.
//! * **Doorbells checked.** A descriptor a peer hands over as a doorbell must be an
//!   eventfd ([`is_eventfd`]): anything else (a pipe whose writes would block) is
//!   refused.
//! * **Never wait on a name.** Look-ups of names are non-blocking connects
//!   ([`connect_name`]): a full backlog (a flood, a squatter that never accepts) is
//!   the kernel path at once.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Mutex;

use libc::{c_int, socklen_t};

use crate::real;
use crate::sock::{close_all, Key};

/// Rendezvous partners refused because they could not be proven (a name held by
/// another user, a token that names another socket, a doorbell that is not one).
pub static REFUSED: AtomicUsize = AtomicUsize::new(0);

/// Counts a refusal and returns `None`, for `?`-style early returns.
pub(crate) fn refuse<T>() -> Option<T> {
    REFUSED.fetch_add(1, Ordering::Relaxed);
    None
}

/// The credentials of the process at the other end of Unix socket `fd`: for a
/// connected socket, its peer's at `connect` (or at `listen`, seen from the
/// connecting side).
pub(crate) fn peer_cred(fd: c_int) -> Option<libc::ucred> {
    // SAFETY: ucred is plain old data.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as socklen_t;
    // SAFETY: a local ucred and its length.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0 && len as usize == std::mem::size_of::<libc::ucred>()).then_some(cred)
}

/// Users this process trusts whatever they hold: root (the kernel lets it do
/// anything to us) and our own effective user (it may ptrace us).
pub(crate) fn trusted_user(uid: u32) -> bool {
    // SAFETY: plain syscall.
    uid == 0 || uid == unsafe { libc::geteuid() }
}

/// An `O_PATH` descriptor of socket `fd` (close-on-exec, owned by the caller): a
/// proof that this process holds the socket, which gives its receiver no power
/// over it. `None` where `/proc` was not mounted when the library was loaded.
pub(crate) fn socket_token(fd: c_int) -> Option<c_int> {
    // (O_PATH opens nothing for I/O.)
    strait_sys::procfs::open(&format!("self/fd/{fd}"), libc::O_PATH)
}

/// The inode of the socket a token names, if it is one.
pub(crate) fn token_inode(token: c_int) -> Option<u64> {
    // SAFETY: stat is plain old data; fstat fills it (O_PATH descriptors allow it).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a local stat.
    if unsafe { libc::fstat(token, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return None;
    }
    Some(st.st_ino)
}

/// True if `fd` is an eventfd (a doorbell a peer may hand us). Asked of `/proc`
/// where it is mounted; else any anonymous-inode descriptor that takes an 8-byte
/// write without blocking would do, and only an eventfd is made non-blocking by
/// its creator here, so the fallback also requires `O_NONBLOCK`.
pub(crate) fn is_eventfd(fd: c_int) -> bool {
    if let Some(kind) = strait_sys::procfs::fd_kind(fd) {
        return kind == b"anon_inode:[eventfd]";
    }
    // SAFETY: stat is plain old data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a local stat; plain fcntl.
    unsafe {
        libc::fstat(fd, &mut st) == 0
            && st.st_mode & libc::S_IFMT == 0
            && real::fcntl(fd, libc::F_GETFL, 0) & libc::O_NONBLOCK != 0
    }
}

/// A new non-blocking seqpacket socket connected to the abstract name `sa`, or
/// `None` at once: no such name, a full backlog, or any other failure. Never waits.
pub(crate) fn connect_name(sa: &libc::sockaddr_un, len: socklen_t) -> Option<c_int> {
    // SAFETY: plain syscall.
    let u = unsafe {
        real::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0)
    };
    if u < 0 {
        return None;
    }
    // SAFETY: an initialised sockaddr_un of `len` bytes.
    if unsafe { real::connect(u, (sa as *const libc::sockaddr_un).cast(), len) } != 0 {
        close_all(&[u]);
        return None;
    }
    Some(u)
}

/// Which kernel socket table a diagnostics look-up searches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proto {
    /// TCP: established connections first, then the listener that would take a
    /// connection with these addresses.
    Tcp,
    /// UDP: the socket that would receive a datagram sent between the addresses.
    Udp,
}

/// What the kernel says of one socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DiagSock {
    /// The socket's inode (what a token names).
    pub inode: u64,
    /// The user that created it.
    pub uid: u32,
    /// TCP state (`10` is LISTEN).
    pub state: u8,
}

/// TCP's LISTEN state in socket diagnostics.
pub(crate) const TCP_LISTEN: u8 = 10;

const NETLINK_SOCK_DIAG: c_int = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_HDR: usize = 16;
/// `inet_diag_req_v2`: family, protocol, ext, pad, states, then the socket id.
const REQ_LEN: usize = 8 + ID_LEN;
/// `inet_diag_sockid`: ports, two 16-byte addresses, interface, cookie.
const ID_LEN: usize = 4 + 32 + 4 + 8;
/// `inet_diag_msg` up to and including the inode.
const MSG_LEN: usize = 4 + ID_LEN + 20;

fn v4_mapped(a: &[u8; 16]) -> bool {
    a[..10].iter().all(|&b| b == 0) && a[10] == 0xff && a[11] == 0xff
}

/// Asks the kernel's socket diagnostics for the one socket of this network
/// namespace that `local` and `remote` name (see [`Proto`] for which), as
/// `ss` does. `None` if there is none or the question cannot be asked.
pub(crate) fn diag_lookup(proto: Proto, local: Key, remote: Key) -> Option<DiagSock> {
    // An IPv4 (or v4-mapped) pair is looked up in the IPv4 tables, where the kernel
    // also keeps dual-stack sockets' IPv4 connections.
    let v4 = v4_mapped(&local.0) && (v4_mapped(&remote.0) || remote.0 == [0; 16]);
    let family = if v4 { libc::AF_INET } else { libc::AF_INET6 };
    let addr = |a: &[u8; 16]| -> [u8; 16] {
        let mut o = [0u8; 16];
        if v4 {
            o[..4].copy_from_slice(&a[12..]);
        } else {
            o = *a;
        }
        o
    };
    // TCP's id is (local, remote); UDP's look-up takes them the other way round
    // ("swapped for historical reasons", net/ipv4/udp_diag.c).
    let (src, dst) = match proto {
        Proto::Tcp => (local, remote),
        Proto::Udp => (remote, local),
    };
    let mut req = [0u8; NLMSG_HDR + REQ_LEN];
    let total = req.len() as u32;
    req[0..4].copy_from_slice(&total.to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    let r = &mut req[NLMSG_HDR..];
    r[0] = family as u8;
    r[1] = match proto {
        Proto::Tcp => libc::IPPROTO_TCP,
        Proto::Udp => libc::IPPROTO_UDP,
    } as u8;
    r[4..8].copy_from_slice(&u32::MAX.to_ne_bytes());
    let id = &mut r[8..];
    id[0..2].copy_from_slice(&src.1.to_be_bytes());
    id[2..4].copy_from_slice(&dst.1.to_be_bytes());
    id[4..20].copy_from_slice(&addr(&src.0));
    id[20..36].copy_from_slice(&addr(&dst.0));
    // INET_DIAG_NOCOOKIE
    id[40..48].copy_from_slice(&[0xff; 8]);
    let mut g = DIAG.lock().unwrap_or_else(|e| e.into_inner());
    let s = diag_socket(&mut g)?;
    let seq = DIAG_SEQ.fetch_add(1, Ordering::Relaxed);
    req[8..12].copy_from_slice(&seq.to_ne_bytes());
    // `Ok(None)`: the kernel answered that no such socket exists (a connection
    // closed at both ends already, as a close of the second end finds it on
    // loopback); `Err`: no usable answer, and the socket is made anew.
    let answer: Result<Option<DiagSock>, ()> = (|| {
        // SAFETY: sends the local request buffer.
        let n = unsafe { real::send(s, req.as_ptr().cast(), req.len(), 0) };
        if n != req.len() as isize {
            return Err(());
        }
        let mut buf = [0u64; 128];
        // The kernel answers within the send: the answer is queued already. An
        // answer to an earlier request (one given up half-way) is skipped by its
        // sequence number.
        for _ in 0..8 {
            // SAFETY: a local buffer of its length; not waiting.
            let n = unsafe {
                real::recv(s, buf.as_mut_ptr().cast(), std::mem::size_of_val(&buf), libc::MSG_DONTWAIT)
            };
            if n < NLMSG_HDR as isize {
                return Err(());
            }
            // SAFETY: `n` bytes of the u64 buffer were written; viewed as bytes.
            let b = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), n as usize) };
            if u32::from_ne_bytes([b[8], b[9], b[10], b[11]]) != seq {
                continue;
            }
            let ty = u16::from_ne_bytes([b[4], b[5]]);
            if ty == NLMSG_ERROR {
                // nlmsgerr: the (negative) errno right after the header.
                let errno =
                    b.get(NLMSG_HDR..NLMSG_HDR + 4).and_then(|e| e.try_into().ok()).map(i32::from_ne_bytes);
                return if errno == Some(-libc::ENOENT) { Ok(None) } else { Err(()) };
            }
            if ty != SOCK_DIAG_BY_FAMILY || b.len() < NLMSG_HDR + MSG_LEN {
                return Err(());
            }
            let m = &b[NLMSG_HDR..];
            let field = |at: usize| m[at..at + 4].try_into().map(u32::from_ne_bytes).map_err(|_| ());
            let (uid, inode) = (field(4 + ID_LEN + 12)?, field(4 + ID_LEN + 16)?);
            return Ok(Some(DiagSock { inode: u64::from(inode), uid, state: m[1] }));
        }
        Err(())
    })();
    if answer.is_err() {
        // Whatever went wrong, the next look-up starts on a fresh socket.
        if let Some((_, fd)) = g.take() {
            crate::fds::let_go(&[fd]);
        }
    }
    answer.ok().flatten()
}

/// The process's `NETLINK_SOCK_DIAG` socket, made at its first look-up and kept (one
/// socket and one close less per connection). A new process makes its own: the one
/// it inherited is its parent's, and a socket used by two processes could hand
/// either the other's answer.
static DIAG: Mutex<Option<(u32, c_int)>> = Mutex::new(None);
/// Sequence numbers of the look-ups on [`DIAG`].
static DIAG_SEQ: AtomicU32 = AtomicU32::new(1);

/// The socket of [`DIAG`] for this process (made if needed), or `None`.
fn diag_socket(slot: &mut Option<(u32, c_int)>) -> Option<c_int> {
    let pid = strait_sys::pid::current_pid();
    match *slot {
        Some((p, fd)) if p == pid => return Some(fd),
        // The parent's socket: our copy goes (the parent keeps its own).
        Some((_, fd)) => crate::fds::let_go(&[fd]),
        None => {}
    }
    *slot = None;
    // SAFETY: plain syscall.
    let s =
        unsafe { real::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, NETLINK_SOCK_DIAG) };
    if s < 0 {
        return None;
    }
    let s = crate::fds::keep(s);
    *slot = Some((pid, s));
    Some(s)
}

/// The token `token` names the socket the kernel finds at (`local`, `remote`).
pub(crate) fn token_names(token: c_int, proto: Proto, local: Key, remote: Key) -> bool {
    match (token_inode(token), diag_lookup(proto, local, remote)) {
        (Some(have), Some(sock)) => sock.inode != 0 && have == sock.inode,
        _ => false,
    }
}

/// The holder of the listener name `unix` is connected to may receive our hello
/// for a TCP connection from `from` to `dest`: root, ourselves, or the owner of
/// the listening socket the kernel would pick for it. `Some`: the holder's
/// credentials (its pid is the process that bound the name).
pub(crate) fn marker_holder_ok(unix: c_int, proto: Proto, dest: Key, from: Key) -> Option<libc::ucred> {
    let cred = peer_cred(unix)?;
    if trusted_user(cred.uid) {
        return Some(cred);
    }
    let sock = diag_lookup(proto, dest, from)?;
    (sock.uid == cred.uid && (proto == Proto::Udp || sock.state == TCP_LISTEN)).then_some(cred)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream, UdpSocket};
    use std::os::fd::AsRawFd;

    fn key(a: std::net::SocketAddr) -> Key {
        match a {
            std::net::SocketAddr::V4(v) => {
                let mut k = [0u8; 16];
                k[10] = 0xff;
                k[11] = 0xff;
                k[12..].copy_from_slice(&v.ip().octets());
                (k, v.port())
            }
            std::net::SocketAddr::V6(v) => (v.ip().octets(), v.port()),
        }
    }

    /// A token names its socket's inode, which the diagnostics give for the
    /// connection's addresses from either end; it names nothing else.
    #[test]
    fn tokens_match_the_diagnostics_of_exactly_their_connection() {
        let l = TcpListener::bind("127.0.0.1:0").expect("listen");
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (a, _) = l.accept().expect("accept");
        let other = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (cl, cr) = (key(c.local_addr().expect("l")), key(c.peer_addr().expect("p")));
        let tc = socket_token(c.as_raw_fd()).expect("token");
        let ta = socket_token(a.as_raw_fd()).expect("token");
        let to = socket_token(other.as_raw_fd()).expect("token");
        assert!(token_names(tc, Proto::Tcp, cl, cr), "the connector's socket");
        assert!(token_names(ta, Proto::Tcp, cr, cl), "the accepted socket");
        assert!(!token_names(to, Proto::Tcp, cl, cr), "another connection's socket");
        assert!(!token_names(ta, Proto::Tcp, cl, cr), "the other end's socket");
        // SAFETY: an O_PATH descriptor: socket calls on it fail.
        assert!(unsafe { libc::send(tc, b"x".as_ptr().cast(), 1, 0) } < 0, "a token carries no power");
        // The listener the kernel would pick for a new connection, with its owner
        // (for `cl` the kernel has the accepted connection itself).
        let fresh = (cl.0, 1);
        let ls = diag_lookup(Proto::Tcp, key(l.local_addr().expect("a")), fresh).expect("listener");
        assert_eq!(diag_lookup(Proto::Tcp, key(l.local_addr().expect("a")), cl).map(|s| s.state), Some(1));
        // SAFETY: plain syscall.
        assert_eq!((ls.state, ls.uid), (TCP_LISTEN, unsafe { libc::geteuid() }));
        close_all(&[tc, ta, to]);
    }

    #[test]
    fn udp_tokens_name_the_bound_socket() {
        let a = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let b = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let (ka, kb) = (key(a.local_addr().expect("a")), key(b.local_addr().expect("b")));
        let ta = socket_token(a.as_raw_fd()).expect("token");
        assert!(token_names(ta, Proto::Udp, ka, kb));
        let tb = socket_token(b.as_raw_fd()).expect("token");
        assert!(!token_names(tb, Proto::Udp, ka, kb));
        close_all(&[ta, tb]);
    }

    #[test]
    fn only_eventfds_pass_as_doorbells() {
        // SAFETY: plain syscalls creating descriptors this test owns.
        let (e, mut p) = (unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) }, [0; 2]);
        // SAFETY: a local array of two.
        assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) }, 0);
        assert!(is_eventfd(e));
        assert!(!is_eventfd(p[0]) && !is_eventfd(p[1]));
        close_all(&[e, p[0], p[1]]);
    }
}
