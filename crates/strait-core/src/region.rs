//! Memory regions: page-aligned buffers that descriptors point into.
//!
//! A region is shared between the application and the engine. While a send is in
//! flight the engine (or the peer, for a single-copy read) reads the bytes; while a
//! receive is in flight the engine writes them. The accessors refuse access that
//! would race with an operation in flight instead of handing out aliased slices.

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use thiserror::Error;

/// Access to a region was refused because operations on it are still in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("memory region busy: {sends} send(s) and {recvs} receive(s) in flight")]
pub struct RegionBusy {
    /// Sends in flight from this region.
    pub sends: u32,
    /// Receives in flight into this region.
    pub recvs: u32,
}

pub(crate) struct RegionInner {
    ptr: *mut u8,
    len: usize,
    map_len: usize,
    pub(crate) sends: AtomicU32,
    pub(crate) recvs: AtomicU32,
}

// SAFETY: the mapping is plain memory owned by this struct; concurrent access is
// governed by the in-flight counters checked by every accessor.
unsafe impl Send for RegionInner {}
// SAFETY: as above.
unsafe impl Sync for RegionInner {}

impl Drop for RegionInner {
    fn drop(&mut self) {
        if self.map_len > 0 {
            // SAFETY: `ptr`/`map_len` describe a mapping created in `MemoryRegion::new`
            // and referenced by nothing else once the last Arc is gone.
            unsafe { libc::munmap(self.ptr.cast(), self.map_len) };
        }
    }
}

impl RegionInner {
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// A registered buffer.
///
/// Not `Clone`: the one handle is what the borrow checker uses to keep application
/// access and engine access apart. `post_recv` takes it by `&mut`, so no slice from
/// [`MemoryRegion::bytes`] can be alive when a receive starts writing; afterwards the
/// accessors refuse while the receive is in flight.
pub struct MemoryRegion {
    pub(crate) inner: Arc<RegionInner>,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion").field("addr", &self.inner.ptr).field("len", &self.inner.len).finish()
    }
}

impl MemoryRegion {
    /// Allocates a zeroed, page-aligned region of `len` bytes.
    pub fn new(len: usize) -> io::Result<Self> {
        if len == 0 {
            return Ok(MemoryRegion {
                inner: Arc::new(RegionInner {
                    ptr: std::ptr::NonNull::dangling().as_ptr(),
                    len: 0,
                    map_len: 0,
                    sends: AtomicU32::new(0),
                    recvs: AtomicU32::new(0),
                }),
            });
        }
        let page = 4096;
        let map_len = len.div_ceil(page) * page;
        // SAFETY: anonymous private mapping, no fd, no address hint.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(MemoryRegion {
            inner: Arc::new(RegionInner {
                ptr: p.cast(),
                len,
                map_len,
                sends: AtomicU32::new(0),
                recvs: AtomicU32::new(0),
            }),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Address of the first byte (for diagnostics and single-copy transfers).
    pub fn addr(&self) -> usize {
        self.inner.ptr as usize
    }

    fn busy(&self) -> RegionBusy {
        RegionBusy {
            sends: self.inner.sends.load(Ordering::Acquire),
            recvs: self.inner.recvs.load(Ordering::Acquire),
        }
    }

    /// The bytes, if no receive is writing into the region.
    pub fn bytes(&self) -> Result<&[u8], RegionBusy> {
        let b = self.busy();
        if b.recvs != 0 {
            return Err(b);
        }
        // SAFETY: no receive is in flight, and none can be posted while this slice
        // borrows `self`, because `post_recv` needs `&mut MemoryRegion`.
        Ok(unsafe { std::slice::from_raw_parts(self.inner.ptr, self.inner.len) })
    }

    /// The bytes for writing, if no operation uses the region.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8], RegionBusy> {
        let b = self.busy();
        if b.recvs != 0 || b.sends != 0 {
            return Err(b);
        }
        // SAFETY: no operation is in flight and `&mut self` excludes every other
        // borrow of the only handle.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.inner.ptr, self.inner.len) })
    }

    /// Copies `src` into the region at `offset`, if no operation uses the region.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<(), RegionBusy> {
        let b = self.busy();
        if b.recvs != 0 || b.sends != 0 {
            return Err(b);
        }
        assert!(offset <= self.inner.len && src.len() <= self.inner.len - offset, "write_at out of bounds");
        // SAFETY: bounds checked, no operation in flight.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.inner.ptr.add(offset), src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` into `dst`, if no receive writes the region.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionBusy> {
        let b = self.busy();
        if b.recvs != 0 {
            return Err(b);
        }
        assert!(offset <= self.inner.len && dst.len() <= self.inner.len - offset, "read_at out of bounds");
        // SAFETY: bounds checked, no receive in flight.
        unsafe { std::ptr::copy_nonoverlapping(self.inner.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}
