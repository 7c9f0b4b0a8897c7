//! Memory mappings owned by a value and unmapped when it is dropped.

use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;

/// A read-write mapping made by `mmap`, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; whoever shares the memory
// across threads or processes synchronises through atomics of their own.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` from byte `offset`, shared and read-write, with every
    /// page populated up front (no page fault lands later on a fast path).
    pub fn shared(fd: RawFd, len: usize, offset: u64) -> io::Result<Mapping> {
        Self::map(len, libc::MAP_SHARED | libc::MAP_POPULATE, fd, offset)
    }

    /// Maps `len` bytes of `fd` from byte `offset`, shared and read-write, not
    /// populated: pages come on first touch (for mappings made per connection,
    /// where populating every page up front costs more than the connection's own
    /// work; see strait-sockets' `Shm::map`).
    pub fn shared_on_demand(fd: RawFd, len: usize, offset: u64) -> io::Result<Mapping> {
        Self::map(len, libc::MAP_SHARED, fd, offset)
    }

    /// Maps `len` zeroed private bytes, not populated (pages come on first touch).
    pub fn anonymous(len: usize) -> io::Result<Mapping> {
        Self::map(len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    }

    /// Maps `len` zeroed bytes shared with every process this one forks or clones
    /// from now on (and with no other): memory for words that several processes
    /// of one family update, such as a lock.
    pub fn anonymous_shared(len: usize) -> io::Result<Mapping> {
        Self::map(len, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
    }

    /// Maps `len` zeroed private bytes with every page populated up front.
    pub fn anonymous_populated(len: usize) -> io::Result<Mapping> {
        Self::map(len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE, -1, 0)
    }

    fn map(len: usize, flags: libc::c_int, fd: RawFd, offset: u64) -> io::Result<Mapping> {
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "mmap offset out of range"))?;
        // SAFETY: no address hint and no MAP_FIXED, so nothing already mapped is
        // replaced; the result is checked before use.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, offset)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Mapping { ptr, len })
    }

    /// Base address.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Base address, never null.
    pub fn base(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Length in bytes, as asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe the mapping made in `map`; the owner lets no
        // pointer into it outlive this value.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_is_zeroed_and_writable() {
        for m in [Mapping::anonymous(8192).unwrap(), Mapping::anonymous_populated(4096).unwrap()] {
            // SAFETY: the mapping is `len` bytes of private memory we own.
            let s = unsafe { std::slice::from_raw_parts_mut(m.ptr(), m.len()) };
            assert!(s.iter().all(|&b| b == 0));
            s[0] = 1;
        }
    }
}
