//! Descriptors passed over Unix sockets (`SCM_RIGHTS`).
//!
//! The system call itself is a parameter of the `_with` forms: inside the preload it
//! must be the real libc function (found with `dlsym`), never the preload's own
//! interposed `sendmsg`/`recvmsg`. Everyone else uses the plain forms.

use std::io;
use std::mem::size_of;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// The most descriptors one message may carry: the kernel's `SCM_MAX_FD`. A longer
/// list is refused before the call (the kernel would refuse it too).
pub const MAX_FDS: usize = 253;

/// A `sendmsg`-shaped system call: libc's, or the one the preload resolved.
pub type SendmsgFn = unsafe fn(libc::c_int, *const libc::msghdr, libc::c_int) -> isize;
/// A `recvmsg`-shaped system call: libc's, or the one the preload resolved.
pub type RecvmsgFn = unsafe fn(libc::c_int, *mut libc::msghdr, libc::c_int) -> isize;

/// libc's `sendmsg`.
///
/// # Safety
/// As for `sendmsg(2)`.
unsafe fn libc_sendmsg(fd: libc::c_int, msg: *const libc::msghdr, flags: libc::c_int) -> isize {
    // SAFETY: forwarded contract.
    unsafe { libc::sendmsg(fd, msg, flags) }
}

/// libc's `recvmsg`.
///
/// # Safety
/// As for `recvmsg(2)`.
unsafe fn libc_recvmsg(fd: libc::c_int, msg: *mut libc::msghdr, flags: libc::c_int) -> isize {
    // SAFETY: forwarded contract.
    unsafe { libc::recvmsg(fd, msg, flags) }
}

/// A control buffer for `max_fds` descriptors, u64-aligned as `cmsghdr` needs.
fn control_buffer(max_fds: usize) -> Vec<u64> {
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE((max_fds * size_of::<RawFd>()) as u32) } as usize;
    vec![0u64; space.div_ceil(8)]
}

/// Sends one message of `data` with `fds` attached; returns the bytes sent.
pub fn send_fds(sock: RawFd, data: &[u8], fds: &[RawFd], flags: libc::c_int) -> io::Result<usize> {
    send_fds_with(libc_sendmsg, sock, data, fds, flags)
}

/// [`send_fds`] through the given `sendmsg`.
pub fn send_fds_with(
    sendmsg: SendmsgFn,
    sock: RawFd,
    data: &[u8],
    fds: &[RawFd],
    flags: libc::c_int,
) -> io::Result<usize> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors for one message"));
    }
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    // SAFETY: msghdr is plain old data; all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let mut cbuf = control_buffer(fds.len());
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = (cbuf.len() * 8) as _;
        // SAFETY: the buffer has CMSG_SPACE for `fds` and u64 alignment; the CMSG
        // macros stay inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), fds.len());
        }
    }
    // SAFETY: `msg` points at live locals for the duration of the call.
    let n = unsafe { sendmsg(sock, &msg, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// One message received with the descriptors it carried.
#[derive(Debug)]
pub struct FdMessage {
    /// Bytes of data received (0: the peer hung up, on a stream socket).
    pub len: usize,
    /// Every descriptor that came, owned by the caller.
    pub fds: Vec<OwnedFd>,
    /// The control data was cut (more descriptors came than there was room for;
    /// the kernel closed the rest): the sender is not who the caller expected.
    pub truncated: bool,
}

/// Receives one message into `buf` with room for `max_fds` descriptors, passing
/// `flags` as they are (add `MSG_CMSG_CLOEXEC` to keep the descriptors from execs).
pub fn recv_fds(sock: RawFd, buf: &mut [u8], flags: libc::c_int, max_fds: usize) -> io::Result<FdMessage> {
    recv_fds_with(libc_recvmsg, sock, buf, flags, max_fds)
}

/// [`recv_fds`] through the given `recvmsg`. Only `SCM_RIGHTS` messages of
/// `SOL_SOCKET` are taken; other control messages are ignored.
pub fn recv_fds_with(
    recvmsg: RecvmsgFn,
    sock: RawFd,
    buf: &mut [u8],
    flags: libc::c_int,
    max_fds: usize,
) -> io::Result<FdMessage> {
    let mut cbuf = control_buffer(max_fds.min(MAX_FDS));
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain old data; all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = (cbuf.len() * 8) as _;
    // SAFETY: `msg` points at live locals for the duration of the call.
    let n = unsafe { recvmsg(sock, &mut msg, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walks the control messages the kernel wrote, with the CMSG macros that
    // stay within `msg_controllen`; each descriptor read is a new one the kernel
    // installed for us.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(FdMessage { len: n as usize, fds, truncated: msg.msg_flags & libc::MSG_CTRUNC != 0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixDatagram;

    #[test]
    fn descriptors_cross_and_excess_is_reported() {
        let (a, b) = UnixDatagram::pair().unwrap();
        let m = crate::sealed_memfd(c"scm-test", 4096).unwrap();
        let raw = m.as_raw_fd();
        assert_eq!(send_fds(a.as_raw_fd(), b"hi", &[raw, raw], 0).unwrap(), 2);
        let mut buf = [0u8; 8];
        let got = recv_fds(b.as_raw_fd(), &mut buf, libc::MSG_CMSG_CLOEXEC, 4).unwrap();
        assert_eq!((got.len, got.fds.len(), got.truncated), (2, 2, false));
        crate::check_sealed(got.fds[0].as_raw_fd(), 4096).unwrap();
        send_fds(a.as_raw_fd(), b"x", &[raw, raw, raw], 0).unwrap();
        let got = recv_fds(b.as_raw_fd(), &mut buf, libc::MSG_CMSG_CLOEXEC, 1).unwrap();
        assert!(got.truncated);
        assert!(send_fds(a.as_raw_fd(), b"x", &[raw; MAX_FDS + 1], 0).is_err());
    }
}
