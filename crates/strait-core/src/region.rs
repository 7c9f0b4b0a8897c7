//! Memory regions: page-aligned buffers that descriptors point into.
//!
//! A region is shared between the application and the engine. While a send is in
//! flight the engine (or the peer, for a single-copy read) reads the bytes; while a
//! receive is in flight the engine writes them. The accessors refuse access that
//! would race with an operation in flight instead of handing out aliased slices.

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use strait_sys::Mapping;
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

/// `RegionInner::state`: the handle was dropped.
const ORPHANED: u64 = 1;
/// `RegionInner::state`: one send in flight (bits 1..32).
pub(crate) const SEND: u64 = 2;
/// `RegionInner::state`: one receive in flight (bits 32..64).
pub(crate) const RECV: u64 = 1 << 32;

/// The mapping and its bookkeeping. It lives as long as the application's handle or
/// any operation in flight, whichever ends last; one atomic word counts both, so
/// starting and finishing an operation costs one atomic add each (an `Arc` beside
/// separate counters cost two).
pub(crate) struct RegionInner {
    ptr: *mut u8,
    len: usize,
    /// The pages behind `ptr` (none for an empty region), unmapped when the inner
    /// part is freed: by then neither the handle nor any operation refers to them.
    _map: Option<Mapping>,
    state: AtomicU64,
}

/// Frees the region behind `inner`.
///
/// # Safety
/// The caller must be the one party that saw the state become "orphaned, nothing in
/// flight"; nothing may use `inner` afterwards.
unsafe fn free(inner: NonNull<RegionInner>) {
    fence(Ordering::Acquire);
    // SAFETY: `inner` came from `Box::leak` in `MemoryRegion::new`, and the caller is
    // the last user.
    drop(unsafe { Box::from_raw(inner.as_ptr()) });
}

/// Part of a region held by an operation in flight; releases its hold when dropped.
pub(crate) struct Buf {
    inner: NonNull<RegionInner>,
    kind: u64,
    pub(crate) off: usize,
    pub(crate) len: usize,
}

// SAFETY: a Buf is a counted hold on a region (see `RegionInner`); the bytes it names
// are accessed by the engine only while the operation is in flight, and the
// accessors of `MemoryRegion` refuse conflicting access meanwhile.
unsafe impl Send for Buf {}

impl Buf {
    /// Starts an operation of `kind` ([`SEND`] or [`RECV`]) on `mr[off..off + len]`.
    pub(crate) fn hold(mr: &MemoryRegion, kind: u64, off: usize, len: usize) -> Buf {
        mr.inner().state.fetch_add(kind, Ordering::Acquire);
        Buf { inner: mr.inner, kind, off, len }
    }

    /// Address of the first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        // SAFETY: the hold keeps the region alive; `off <= len` was checked when the
        // operation was posted.
        unsafe { self.inner.as_ref().ptr.add(self.off) }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: the hold keeps the region alive until this decrement.
        let prev = unsafe { self.inner.as_ref() }.state.fetch_sub(self.kind, Ordering::Release);
        if prev == self.kind | ORPHANED {
            // SAFETY: the handle is gone and this was the last operation.
            unsafe { free(self.inner) };
        }
    }
}

/// A registered buffer.
///
/// Not `Clone`: the one handle is what the borrow checker uses to keep application
/// access and engine access apart. `post_recv` takes it by `&mut`, so no slice from
/// [`MemoryRegion::bytes`] can be alive when a receive starts writing; afterwards the
/// accessors refuse while the receive is in flight. Dropping the handle while
/// operations are in flight is safe: the memory stays mapped until the last one
/// completes.
pub struct MemoryRegion {
    inner: NonNull<RegionInner>,
}

// SAFETY: the region is plain memory; every accessor checks the in-flight counts,
// which are atomic, and `&mut` rules keep the application's own accesses apart.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for MemoryRegion {}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        let prev = self.inner().state.fetch_or(ORPHANED, Ordering::AcqRel);
        if prev == 0 {
            // SAFETY: nothing was in flight, so nothing else refers to the region.
            unsafe { free(self.inner) };
        }
    }
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.inner().ptr)
            .field("len", &self.inner().len)
            .finish()
    }
}

impl MemoryRegion {
    /// Allocates a zeroed, page-aligned region of `len` bytes.
    pub fn new(len: usize) -> io::Result<Self> {
        if len == 0 {
            return Ok(Self::wrap(RegionInner {
                ptr: NonNull::dangling().as_ptr(),
                len: 0,
                _map: None,
                state: AtomicU64::new(0),
            }));
        }
        let page = 4096;
        let map_len = len.div_ceil(page) * page;
        let map = Mapping::anonymous(map_len)?;
        Ok(Self::wrap(RegionInner { ptr: map.ptr(), len, _map: Some(map), state: AtomicU64::new(0) }))
    }

    fn wrap(inner: RegionInner) -> Self {
        MemoryRegion { inner: NonNull::from(Box::leak(Box::new(inner))) }
    }

    fn inner(&self) -> &RegionInner {
        // SAFETY: the handle keeps the region alive (it is freed only after the
        // handle's drop marks it orphaned).
        unsafe { self.inner.as_ref() }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner().len
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.inner().len == 0
    }

    /// Address of the first byte (for diagnostics and single-copy transfers).
    pub fn addr(&self) -> usize {
        self.inner().ptr as usize
    }

    /// The bytes `range` for reading during one call that borrows the region (a
    /// send that completes before the call returns needs no hold: the borrow keeps
    /// the mapping alive and every write to the region needs `&mut`). The caller
    /// checked `range` against [`MemoryRegion::len`].
    pub(crate) fn borrowed(&self, range: &std::ops::Range<usize>) -> (*const u8, usize) {
        debug_assert!(range.start <= range.end && range.end <= self.len());
        // SAFETY: `range.start <= len` (checked by the caller), inside the mapping.
        (unsafe { self.inner().ptr.add(range.start) } as *const u8, range.end - range.start)
    }

    fn busy(&self) -> RegionBusy {
        let st = self.inner().state.load(Ordering::Acquire);
        RegionBusy { sends: ((st >> 1) & 0x7fff_ffff) as u32, recvs: (st >> 32) as u32 }
    }

    /// The bytes, if no receive is writing into the region.
    pub fn bytes(&self) -> Result<&[u8], RegionBusy> {
        let b = self.busy();
        if b.recvs != 0 {
            return Err(b);
        }
        // SAFETY: no receive is in flight, and none can be posted while this slice
        // borrows `self`, because `post_recv` needs `&mut MemoryRegion`.
        Ok(unsafe { std::slice::from_raw_parts(self.inner().ptr, self.inner().len) })
    }

    /// The bytes for writing, if no operation uses the region.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8], RegionBusy> {
        let b = self.busy();
        if b.recvs != 0 || b.sends != 0 {
            return Err(b);
        }
        // SAFETY: no operation is in flight and `&mut self` excludes every other
        // borrow of the only handle.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.inner().ptr, self.inner().len) })
    }

    /// Copies `src` into the region at `offset`, if no operation uses the region.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<(), RegionBusy> {
        let b = self.busy();
        if b.recvs != 0 || b.sends != 0 {
            return Err(b);
        }
        assert!(
            offset <= self.inner().len && src.len() <= self.inner().len - offset,
            "write_at out of bounds"
        );
        // SAFETY: bounds checked, no operation in flight.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.inner().ptr.add(offset), src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` into `dst`, if no receive writes the region.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionBusy> {
        let b = self.busy();
        if b.recvs != 0 {
            return Err(b);
        }
        assert!(
            offset <= self.inner().len && dst.len() <= self.inner().len - offset,
            "read_at out of bounds"
        );
        // SAFETY: bounds checked, no receive in flight.
        unsafe { std::ptr::copy_nonoverlapping(self.inner().ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_are_counted_and_outlive_the_handle() {
        let mut mr = MemoryRegion::new(100).unwrap();
        mr.bytes_mut().unwrap()[0] = 7;
        let send = Buf::hold(&mr, SEND, 0, 10);
        assert!(mr.bytes().is_ok(), "reading beside a send is fine");
        assert_eq!(mr.bytes_mut().unwrap_err(), RegionBusy { sends: 1, recvs: 0 });
        let recv = Buf::hold(&mr, RECV, 10, 10);
        assert_eq!(mr.bytes().unwrap_err(), RegionBusy { sends: 1, recvs: 1 });
        drop(mr);
        // SAFETY: the holds keep the mapping alive after the handle is gone.
        unsafe {
            assert_eq!(*send.ptr(), 7);
            *recv.ptr() = 1;
        }
        drop(send);
        drop(recv);
    }

    #[test]
    fn released_holds_free_the_region_for_the_application() {
        let mut mr = MemoryRegion::new(4096).unwrap();
        for _ in 0..1000 {
            drop(Buf::hold(&mr, SEND, 0, 1));
            drop(Buf::hold(&mr, RECV, 0, 1));
        }
        assert!(mr.bytes_mut().is_ok());
        assert!(MemoryRegion::new(0).unwrap().bytes().unwrap().is_empty());
    }
}
