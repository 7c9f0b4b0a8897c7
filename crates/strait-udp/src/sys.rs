//! Thin, checked wrappers over the system calls the link makes outside io_uring.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use strait_sys::Mapping;

/// `SOL_UDP` / `IPPROTO_UDP`.
pub(crate) const SOL_UDP: libc::c_int = 17;
/// `UDP_SEGMENT` (GSO segment size, Linux 4.18).
pub(crate) const UDP_SEGMENT: libc::c_int = 103;
/// `UDP_GRO` (Linux 5.0).
pub(crate) const UDP_GRO: libc::c_int = 104;

/// A `UDP_SEGMENT` control message (GSO segment size), laid out as the kernel reads
/// it: `size_of::<SegCmsg>()` is `CMSG_SPACE(2)` and `cmsg_len` is `CMSG_LEN(2)`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct SegCmsg {
    hdr: libc::cmsghdr,
    seg: u16,
}

impl SegCmsg {
    pub(crate) fn new() -> Self {
        // SAFETY: cmsghdr is a plain C struct (with private padding fields on some
        // libcs) for which all-zero is valid.
        let mut hdr: libc::cmsghdr = unsafe { std::mem::zeroed() };
        hdr.cmsg_len = (std::mem::size_of::<libc::cmsghdr>() + 2) as _;
        hdr.cmsg_level = SOL_UDP;
        hdr.cmsg_type = UDP_SEGMENT;
        SegCmsg { hdr, seg: 0 }
    }

    pub(crate) fn set(&mut self, seg: u16) {
        self.seg = seg;
    }
}

/// The control messages of one receive, as (level, type, data); stops at the first
/// malformed one (`Err(())` then, after the good ones).
fn cmsgs(ctrl: &[u8]) -> impl Iterator<Item = Result<(i32, i32, &[u8]), ()>> {
    // The kernel's `struct cmsghdr`: a size_t length, then level and type (ints);
    // the data follows at the header's size, each message is size_t-aligned.
    const W: usize = std::mem::size_of::<usize>();
    const HDR: usize = std::mem::size_of::<libc::cmsghdr>();
    let word = |o: usize| -> Option<usize> {
        let b: [u8; W] = ctrl.get(o..o + W)?.try_into().ok()?;
        Some(usize::from_ne_bytes(b))
    };
    let int = |o: usize| -> Option<i32> {
        let b: [u8; 4] = ctrl.get(o..o + 4)?.try_into().ok()?;
        Some(i32::from_ne_bytes(b))
    };
    let mut off = 0;
    let mut broken = false;
    std::iter::from_fn(move || {
        if broken || off + HDR > ctrl.len() {
            return None;
        }
        let parsed = (|| {
            let clen = word(off)?;
            if clen < HDR || clen > ctrl.len() - off {
                return None;
            }
            let item = (int(off + W)?, int(off + W + 4)?, &ctrl[off + HDR..off + clen]);
            off += clen.next_multiple_of(W);
            Some(item)
        })();
        broken = parsed.is_none();
        Some(parsed.ok_or(()))
    })
}

/// Finds the `UDP_GRO` segment size among received control messages, if any.
pub(crate) fn gro_size(ctrl: &[u8]) -> Option<usize> {
    for m in cmsgs(ctrl) {
        let (level, kind, data) = m.ok()?;
        if level == SOL_UDP && kind == UDP_GRO && data.len() >= 4 {
            let b: [u8; 4] = data[..4].try_into().ok()?;
            return Some(i32::from_ne_bytes(b) as u32 as usize);
        }
    }
    None
}

/// ECN codepoint "Congestion Experienced" (both bits of the TOS/traffic class's
/// low two).
const ECN_CE: u8 = 3;
/// ECN codepoint "ECN-capable transport (0)", which the link's packets carry.
pub(crate) const ECN_ECT0: u8 = 2;

/// True if the received control messages say the datagram (or GRO train) arrived
/// marked Congestion Experienced: `IP_TOS` (one byte) or `IPV6_TCLASS` (an int)
/// with both ECN bits set.
pub(crate) fn ce_marked(ctrl: &[u8]) -> bool {
    cmsgs(ctrl).map_while(Result::ok).any(|(level, kind, data)| {
        let tos = match (level, kind) {
            (libc::IPPROTO_IP, libc::IP_TOS) => data.first().copied(),
            (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => {
                data.get(..4).and_then(|b| b.try_into().ok()).map(|b: [u8; 4]| i32::from_ne_bytes(b) as u8)
            }
            _ => None,
        };
        tos.is_some_and(|t| t & 3 == ECN_CE)
    })
}

/// Sets an integer socket option.
pub(crate) fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    val: libc::c_int,
) -> io::Result<()> {
    // SAFETY: passes a pointer to a local int and its exact size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&val as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Reads an integer socket option.
pub(crate) fn getsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut val: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: passes a pointer to a local int and its size; the kernel writes at most
    // `len` bytes.
    let r = unsafe { libc::getsockopt(fd, level, name, (&mut val as *mut libc::c_int).cast(), &mut len) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(val)
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds.
pub(crate) fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes one timespec into a local.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A non-blocking, close-on-exec eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain system call; the result is checked before being wrapped.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Resets an eventfd's counter (non-blocking read; nothing to read is fine).
pub(crate) fn eventfd_drain(fd: &OwnedFd) {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into a local u64.
    unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
}

/// Anonymous, page-aligned, populated memory of at least `len` zeroed bytes (for the
/// provided-buffer ring and its buffers), unmapped on drop.
pub(crate) fn anonymous_pages(len: usize) -> io::Result<Mapping> {
    Mapping::anonymous_populated(len.max(1).next_multiple_of(4096))
}
