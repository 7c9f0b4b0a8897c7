//! The memory a ring lives in: a byte area that only copies (the peer may write it
//! at any time), with atomic words where a ring keeps headers.

#[cfg(loom)]
use loom::sync::atomic::AtomicU64;
#[cfg(not(loom))]
use std::sync::atomic::AtomicU64;

/// A ring's data area. Implementations only copy bytes in and out: the peer may
/// change them concurrently, so no reference to them is ever handed out.
pub trait ByteArea {
    /// Size of the area in bytes.
    fn size(&self) -> usize;
    /// Copies `src` to `offset`.
    ///
    /// # Safety
    /// `offset + src.len() <= size()`, and the ring protocol must give the caller
    /// exclusive use of those bytes (the producer, before it publishes them).
    unsafe fn store(&self, offset: usize, src: &[u8]);
    /// Copies bytes at `offset` into `dst`.
    ///
    /// # Safety
    /// `offset + dst.len() <= size()`; the bytes may be concurrently written by a
    /// hostile peer, so the implementation must only copy them.
    unsafe fn load(&self, offset: usize, dst: &mut [u8]);
    /// Hints that the bytes at `offset` will be read soon (no effect by default; a
    /// shared mapping asks the CPU to fetch their cache line). Never faults.
    #[inline]
    fn prefetch(&self, offset: usize) {
        let _ = offset;
    }
}

/// A data area whose 8-aligned words can also be used atomically (ring headers).
pub trait WordArea: ByteArea {
    /// The word at an 8-aligned `offset` below `size()`.
    fn word(&self, offset: usize) -> &AtomicU64;
}

/// A data area inside a shared mapping: `size` bytes at `base`.
#[cfg(not(loom))]
#[derive(Debug)]
pub struct MappedArea {
    base: *mut u8,
    size: usize,
}

// SAFETY: the area is shared memory that both processes access only by copying bytes
// and through atomic words; no Rust object lives in it.
#[cfg(not(loom))]
unsafe impl Send for MappedArea {}
// SAFETY: as above.
#[cfg(not(loom))]
unsafe impl Sync for MappedArea {}

#[cfg(not(loom))]
impl MappedArea {
    /// The area of `size` bytes at `base`.
    ///
    /// # Safety
    /// `base` must be 8-aligned and `size` bytes from it mapped read-write for as long
    /// as the value is used (the owner of the mapping outlives it).
    pub unsafe fn new(base: *mut u8, size: usize) -> MappedArea {
        debug_assert!((base as usize).is_multiple_of(8));
        MappedArea { base, size }
    }

    /// Address of the first byte.
    pub fn base(&self) -> *mut u8 {
        self.base
    }
}

#[cfg(not(loom))]
impl ByteArea for MappedArea {
    #[inline]
    fn size(&self) -> usize {
        self.size
    }
    #[inline]
    unsafe fn store(&self, offset: usize, src: &[u8]) {
        debug_assert!(offset + src.len() <= self.size);
        // SAFETY: the caller keeps the range inside the area (trait contract).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(offset), src.len()) }
    }
    #[inline]
    unsafe fn load(&self, offset: usize, dst: &mut [u8]) {
        debug_assert!(offset + dst.len() <= self.size);
        // SAFETY: as above; the bytes are only copied, so a concurrent hostile write
        // yields garbage that the ring's validation rejects, never undefined reads of
        // Rust objects.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(offset), dst.as_mut_ptr(), dst.len()) }
    }
    #[inline]
    fn prefetch(&self, offset: usize) {
        #[cfg(target_arch = "x86_64")]
        if offset < self.size {
            // SAFETY: SSE is part of x86-64's baseline; a prefetch is a hint that never
            // faults nor changes memory, whatever the address.
            unsafe {
                core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                    self.base.wrapping_add(offset).cast::<i8>(),
                )
            };
        }
    }
}

#[cfg(not(loom))]
impl WordArea for MappedArea {
    #[inline]
    fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(offset.is_multiple_of(8) && offset + 8 <= self.size, "word offset {offset} outside the area");
        // SAFETY: an 8-aligned offset inside the area (asserted; the base is 8-aligned
        // by `new`'s contract); both processes access such words only atomically.
        unsafe { &*self.base.add(offset).cast::<AtomicU64>() }
    }
}
