//! Sealed memfds: shared memory whose size neither side can change once it is made,
//! so a peer cannot truncate it under a mapping and make us fault.
//!
//! `fcntl` and `close` are made as raw system calls: the preload exports both, and a
//! plain libc call from inside it would land in its own interposer.

use std::ffi::CStr;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// The seals every strait memfd carries: no shrink, no grow, no further sealing.
pub const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Why a received descriptor is not a sealed memfd of the expected size. The texts
/// are the ones the shm device has always reported.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// `fstat` failed (not a descriptor, or closed).
    #[error("fstat: {0}")]
    Stat(io::Error),
    /// The file has another size than the one agreed.
    #[error("shared memory is {actual} bytes, expected {expected}")]
    Size {
        /// Its size.
        actual: i64,
        /// The size agreed.
        expected: usize,
    },
    /// `F_GET_SEALS` failed: not a memfd made with `MFD_ALLOW_SEALING`.
    #[error("shared memory is not a sealable memfd")]
    NotSealable,
    /// Some of [`SEALS`] are missing.
    #[error("shared memory seals {0:#x} lack shrink/grow/seal")]
    Unsealed(libc::c_int),
}

fn raw_fcntl(fd: RawFd, cmd: libc::c_int, arg: libc::c_int) -> libc::c_long {
    // SAFETY: F_ADD_SEALS/F_GET_SEALS take an int argument and touch no memory of ours.
    unsafe { libc::syscall(libc::SYS_fcntl, fd, cmd, arg) }
}

/// Creates a close-on-exec memfd called `name` of `len` bytes, sealed with [`SEALS`].
pub fn sealed_memfd(name: &CStr, len: usize) -> io::Result<OwnedFd> {
    // SAFETY: `name` is NUL-terminated; flags are plain constants.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: plain syscall on the fd we just made.
    let sized = unsafe { libc::ftruncate(fd, len as libc::off_t) } == 0;
    if !sized || raw_fcntl(fd, libc::F_ADD_SEALS, SEALS) != 0 {
        let e = io::Error::last_os_error();
        // SAFETY: closes the fd we made and nobody else knows of.
        unsafe { libc::syscall(libc::SYS_close, fd) };
        return Err(e);
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Checks that `fd` (received from a peer) is a memfd of exactly `len` bytes carrying
/// every one of [`SEALS`].
pub fn check_sealed(fd: RawFd, len: usize) -> Result<(), SealError> {
    // SAFETY: stat is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: passes a pointer to a local stat.
    if unsafe { libc::fstat(fd, &mut st) } < 0 {
        return Err(SealError::Stat(io::Error::last_os_error()));
    }
    if st.st_size as u64 != len as u64 {
        return Err(SealError::Size { actual: st.st_size, expected: len });
    }
    let seals = raw_fcntl(fd, libc::F_GET_SEALS, 0);
    if seals < 0 {
        return Err(SealError::NotSealable);
    }
    let seals = seals as libc::c_int;
    if seals & SEALS != SEALS {
        return Err(SealError::Unsealed(seals));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn made_sealed_and_checked() {
        let fd = sealed_memfd(c"strait-sys-test", 8192).unwrap();
        check_sealed(fd.as_raw_fd(), 8192).unwrap();
        assert!(matches!(check_sealed(fd.as_raw_fd(), 4096), Err(SealError::Size { .. })));
        // SAFETY: a plain memfd without sealing allowed.
        let plain = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: we own the fresh descriptor.
        let plain = unsafe { OwnedFd::from_raw_fd(plain) };
        // A memfd made without MFD_ALLOW_SEALING reports F_SEAL_SEAL alone.
        assert!(matches!(check_sealed(plain.as_raw_fd(), 0), Err(SealError::Unsealed(_))));
    }
}
