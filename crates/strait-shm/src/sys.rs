//! Thin, checked wrappers over the system calls the shm device needs.

use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

pub(crate) fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Builds the address for `name`: a filesystem path if it starts with '/', else an
/// abstract name `\0strait.shm.<name>` (no file anyone could open).
pub(crate) fn unix_addr(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut sa: libc::sockaddr_un = unsafe { zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes: Vec<u8> = if name.starts_with('/') {
        name.as_bytes().to_vec()
    } else {
        let mut v = vec![0u8];
        v.extend_from_slice(b"strait.shm.");
        v.extend_from_slice(name.as_bytes());
        v
    };
    if name.is_empty() || bytes.len() >= sa.sun_path.len() || name.as_bytes().contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "shm endpoint name {name:?} is empty, too long (max {} bytes) or has a NUL",
                sa.sun_path.len() - 13
            ),
        ));
    }
    for (d, s) in sa.sun_path.iter_mut().zip(&bytes) {
        *d = *s as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + bytes.len() + usize::from(name.starts_with('/'));
    Ok((sa, len as libc::socklen_t))
}

pub(crate) fn seqpacket_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = cvt(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(crate) fn set_timeouts(fd: RawFd, t: Option<Duration>) -> io::Result<()> {
    let tv = match t {
        Some(t) => libc::timeval { tv_sec: t.as_secs() as libc::time_t, tv_usec: t.subsec_micros() as _ },
        None => libc::timeval { tv_sec: 0, tv_usec: 0 },
    };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: passes a pointer to a local timeval of the stated size.
        cvt(unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&tv as *const libc::timeval).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        })?;
    }
    Ok(())
}

/// Sends one message with `fds` attached (SCM_RIGHTS).
pub(crate) fn send_with_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let n = strait_sys::send_fds(sock, data, fds, libc::MSG_NOSIGNAL)?;
    if n != data.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short handshake send"));
    }
    Ok(())
}

/// The most descriptors a handshake message may carry; more is a peer to refuse.
const HANDSHAKE_FDS: usize = 12;

/// Receives one message into `buf`, returning its length and any fds that came with
/// it (close-on-exec). A zero length means the peer hung up.
pub(crate) fn recv_with_fds(
    sock: RawFd,
    buf: &mut [u8],
    flags: libc::c_int,
) -> io::Result<(usize, Vec<OwnedFd>)> {
    let m = loop {
        match strait_sys::recv_fds(sock, buf, libc::MSG_CMSG_CLOEXEC | flags, HANDSHAKE_FDS) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => break r?,
        }
    };
    if m.truncated {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "handshake carried too many descriptors"));
    }
    Ok((m.len, m.fds))
}

/// The credentials of a connected Unix socket's peer, as the kernel recorded them
/// when the connection was made (SO_PEERCRED): never anything the peer says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerCred {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    /// The pid, if the peer is visible in our pid namespace.
    pub(crate) pid: Option<libc::pid_t>,
}

/// The connected peer's credentials (SO_PEERCRED).
pub(crate) fn peer_cred(sock: RawFd) -> io::Result<PeerCred> {
    // SAFETY: ucred is plain old data.
    let mut cred: libc::ucred = unsafe { zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: passes a pointer to a local ucred and its length.
    cvt(unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    if len as usize != size_of::<libc::ucred>() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "short SO_PEERCRED answer"));
    }
    Ok(PeerCred { uid: cred.uid, gid: cred.gid, pid: (cred.pid > 0).then_some(cred.pid) })
}

/// A pidfd for the connected peer (SO_PEERPIDFD, Linux 6.5+): it refers to the very
/// process that made the connection, so a check on it after a remote read tells
/// whether the pid could have been reused meanwhile. `None` on older kernels.
pub(crate) fn peer_pidfd(sock: RawFd) -> Option<OwnedFd> {
    const SO_PEERPIDFD: libc::c_int = 77;
    let mut fd: libc::c_int = -1;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: passes a pointer to a local int and its length.
    let r = unsafe {
        libc::getsockopt(sock, libc::SOL_SOCKET, SO_PEERPIDFD, (&mut fd as *mut libc::c_int).cast(), &mut len)
    };
    if r < 0 || fd < 0 {
        return None;
    }
    // SAFETY: the kernel just created this fd for us.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// True if the process behind `pidfd` has exited (its pidfd polls readable).
pub(crate) fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    poll_now(pidfd.as_raw_fd(), libc::POLLIN).map_or(true, |ev| ev != 0)
}

/// This process's effective uid.
pub(crate) fn euid() -> u32 {
    // SAFETY: plain syscall without arguments; cannot fail.
    unsafe { libc::geteuid() }
}

/// Sets O_NONBLOCK on `fd`.
pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: plain fcntl calls on an fd we hold.
    let fl = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) })?;
    Ok(())
}

/// Sets the permission bits of `fd`'s inode (for a socket before `bind`: the mode its
/// file is created with, less the umask).
pub(crate) fn fchmod(fd: RawFd, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: plain syscall on an fd we hold.
    cvt(unsafe { libc::fchmod(fd, mode) })?;
    Ok(())
}

/// True if `fd` is an eventfd (the only kind of doorbell a peer may hand us: a pipe
/// or socket could make our doorbell write block).
pub(crate) fn is_eventfd(fd: RawFd) -> bool {
    strait_sys::procfs::fd_kind(fd).is_some_and(|p| p == b"anon_inode:[eventfd]")
}

/// A new epoll instance (close-on-exec).
pub(crate) fn epoll() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
    // SAFETY: fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds `fd` to `ep`, level-triggered, for input and hang-up. Closing `fd` (its last
/// reference) removes it again.
pub(crate) fn epoll_add(ep: &OwnedFd, fd: RawFd) -> io::Result<()> {
    let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32, u64: fd as u64 };
    // SAFETY: passes a pointer to a local epoll_event.
    cvt(unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) })?;
    Ok(())
}

/// Polls `fd` without blocking; returns its revents.
pub(crate) fn poll_now(fd: RawFd, events: libc::c_short) -> io::Result<libc::c_short> {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    // SAFETY: one live pollfd, zero timeout.
    cvt(unsafe { libc::poll(&mut p, 1, 0) })?;
    Ok(p.revents)
}

/// Which way a cross-memory-attach copy goes.
#[derive(Clone, Copy)]
enum Cma {
    /// From the other process into ours (`process_vm_readv`).
    Read,
    /// From ours into the other process (`process_vm_writev`).
    Write,
}

/// Copies `len` bytes between `local` (ours) and `remote` in process `pid`, the way
/// `dir` says, resuming after short copies and signals. The remote range comes from
/// the peer: it must not wrap around the address space, and the kernel checks it
/// against the other process's mappings (and refuses, EPERM, unless we may ptrace
/// it).
///
/// # Safety
/// `local` must be valid for `len` bytes: writes for [`Cma::Read`], reads for
/// [`Cma::Write`].
unsafe fn vm_copy(dir: Cma, pid: libc::pid_t, remote: u64, local: *mut u8, len: usize) -> io::Result<()> {
    if usize::try_from(remote).ok().and_then(|r| r.checked_add(len)).is_none() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "remote range wraps around"));
    }
    let mut done = 0usize;
    while done < len {
        let here = libc::iovec {
            // SAFETY: `done < len`, inside the caller's buffer.
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: len - done,
        };
        let there =
            libc::iovec { iov_base: (remote as usize + done) as *mut libc::c_void, iov_len: len - done };
        // SAFETY: the local iovec is valid per the caller's contract; the remote one is
        // checked by the kernel against the other process's mappings.
        let n = unsafe {
            match dir {
                Cma::Read => libc::process_vm_readv(pid, &here, 1, &there, 1, 0),
                Cma::Write => libc::process_vm_writev(pid, &here, 1, &there, 1, 0),
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "cross-memory copy made no progress"));
        }
        done += n as usize;
    }
    Ok(())
}

/// Reads `len` bytes at `remote` in process `pid` into `dst` (`process_vm_readv`).
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes.
pub(crate) unsafe fn vm_read(pid: libc::pid_t, remote: u64, dst: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: forwarded contract.
    unsafe { vm_copy(Cma::Read, pid, remote, dst, len) }
}

/// Writes `len` bytes from `src` to `remote` in process `pid` (`process_vm_writev`):
/// this side's part of a split transfer.
///
/// # Safety
/// `src` must be valid for reads of `len` bytes.
pub(crate) unsafe fn vm_write(pid: libc::pid_t, remote: u64, src: *const u8, len: usize) -> io::Result<()> {
    // SAFETY: forwarded contract; a write only reads `src` (the cast drops no
    // guarantee the kernel relies on).
    unsafe { vm_copy(Cma::Write, pid, remote, src.cast_mut(), len) }
}

/// Creates a sealed memfd of `len` bytes (size fixed: shrink, grow and further
/// sealing are forbidden, so the peer cannot truncate it under us).
pub(crate) fn sealed_memfd(len: usize) -> io::Result<OwnedFd> {
    strait_sys::sealed_memfd(c"strait-shm", len)
}

/// Checks that a received fd is a memfd of exactly `len` bytes that can no longer
/// shrink (a peer that could truncate it could make us fault).
pub(crate) fn check_memfd(fd: &OwnedFd, len: usize) -> Result<(), String> {
    strait_sys::check_sealed(fd.as_raw_fd(), len).map_err(|e| e.to_string())
}
