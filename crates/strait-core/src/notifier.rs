//! The kernel object a sleeping worker waits on: an eventfd.
//!
//! Each worker owns one; every peer holds a duplicate (handed over at connection
//! setup) and writes to it only when the worker has announced that it sleeps.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// An eventfd used as a worker's wake-up doorbell.
#[derive(Debug)]
pub struct Notifier {
    fd: OwnedFd,
}

impl Notifier {
    /// Creates a non-blocking, close-on-exec eventfd.
    pub fn new() -> io::Result<Self> {
        // SAFETY: plain syscall, no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        Ok(Notifier { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Wraps an eventfd received from a peer.
    pub fn from_fd(fd: OwnedFd) -> Self {
        Notifier { fd }
    }

    /// Signals the eventfd (one `write`).
    pub fn notify(&self) -> io::Result<()> {
        notify_fd(self.fd.as_raw_fd())
    }

    /// Consumes any pending signal so the next sleep blocks again.
    pub fn drain(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a local u64; the fd is non-blocking.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

/// Signals an eventfd given by raw fd.
pub fn notify_fd(fd: RawFd) -> io::Result<()> {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a local u64.
    let r = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    if r == 8 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    // A saturated counter means a wake-up is already pending: nothing is lost.
    if e.kind() == io::ErrorKind::WouldBlock {
        return Ok(());
    }
    Err(e)
}

impl AsFd for Notifier {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Notifier {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
