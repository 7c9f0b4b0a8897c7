//! The single-producer, single-consumer frame ring and its sleep/wake protocol.
//!
//! One ring carries frames in one direction. Positions are byte counts that only
//! grow (`u64`, never wrap in practice); a position's offset in the data area is
//! `pos % size`. Frames start on 64-byte cells so that a frame header never shares a
//! cache line with the previous frame's tail. A frame is an 8-byte header
//! (`len: u32`, `kind: u32`) followed by `len` payload bytes, contiguous in memory:
//! a frame that would run past the end of the data area is preceded by a padding
//! header and placed at the start of the next lap.
//!
//! The producer publishes frames by storing its position (`tail`, Release) after
//! writing them; the consumer frees space by storing its position (`head`, Release)
//! after reading. Each side caches the other's position and reloads it only when it
//! runs out (of data or of room), so a steady stream touches the other side's line
//! once per batch rather than once per frame.
//!
//! The peer is not trusted: every position and header read from shared memory is
//! validated, and a violation is reported as [`Corrupt`] instead of being followed.
//!
//! Sleeping uses a flag per consumer and the classic store/fence/load handshake on
//! both sides ([`announce_sleep`] / [`peer_needs_wake`]): with a sequentially
//! consistent fence between each side's store and its load, at least one of the two
//! sees the other's store, so a frame published while the consumer decides to sleep
//! is either seen by the consumer's re-check or triggers a wake-up. The same holds
//! for a producer sleeping on a full ring and the consumer freeing space. The loom
//! model in `tests/loom_ring.rs` checks both, and checks that dropping the fences
//! loses wake-ups.

use thiserror::Error;

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU64, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicU64, Ordering};

/// Frames start on multiples of this many bytes.
pub const CELL: usize = 64;
/// Bytes of the per-frame header.
pub const FRAME_HDR: usize = 8;
const KIND_FRAME: u32 = 0x3146_5253; // "SRF1"
const KIND_PAD: u32 = 0x3150_5253; // "SRP1"

/// The peer broke the ring protocol; the string says how.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct Corrupt(pub String);

/// The memory a ring's frames live in.
pub trait RingMemory {
    /// Size of the data area in bytes: a multiple of [`CELL`].
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
}

/// The two shared positions of one ring.
#[derive(Clone, Copy)]
pub struct RingControl<'a> {
    /// Producer position: everything below it is published.
    pub tail: &'a AtomicU64,
    /// Consumer position: everything below it has been read and may be overwritten.
    pub head: &'a AtomicU64,
}

/// A frame reserved by the producer or found by the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Offset of the payload in the data area.
    pub offset: usize,
    /// Payload length.
    pub len: usize,
    /// Ring position just past this frame.
    pub end: u64,
}

fn frame_span(len: usize) -> u64 {
    (FRAME_HDR + len).div_ceil(CELL) as u64 * CELL as u64
}

fn header(len: u32, kind: u32) -> [u8; FRAME_HDR] {
    let mut h = [0u8; FRAME_HDR];
    h[..4].copy_from_slice(&len.to_le_bytes());
    h[4..].copy_from_slice(&kind.to_le_bytes());
    h
}

/// Largest payload a ring of `size` bytes carries: a quarter of the ring, so that a
/// full-size frame always fits behind a padding cell without waiting for a full drain.
pub fn max_payload(size: usize) -> usize {
    (size / 4).min(u32::MAX as usize) - FRAME_HDR
}

/// The producer's private state.
#[derive(Debug)]
pub struct Producer {
    tail: u64,
    head_cache: u64,
    size: u64,
}

impl Producer {
    /// A producer at position 0 of a ring of `size` bytes.
    pub fn new(size: usize) -> Self {
        Producer { tail: 0, head_cache: 0, size: size as u64 }
    }

    fn reload_head(&mut self, ctl: RingControl<'_>) -> Result<(), Corrupt> {
        let h = ctl.head.load(Ordering::Acquire);
        if h > self.tail || self.tail - h > self.size || !h.is_multiple_of(CELL as u64) {
            return Err(Corrupt(format!(
                "consumer position {h} is impossible (producer at {}, ring of {} bytes)",
                self.tail, self.size
            )));
        }
        self.head_cache = h;
        Ok(())
    }

    /// Bytes of ring a frame of `len` needs at the current position, padding included.
    fn needed(&self, len: usize) -> (u64, u64) {
        let off = self.tail % self.size;
        let span = frame_span(len);
        let pad = if off + span > self.size { self.size - off } else { 0 };
        (pad, span)
    }

    /// True if a frame of `len` payload bytes fits now (reloads the consumer position).
    pub fn has_room(&mut self, ctl: RingControl<'_>, len: usize) -> Result<bool, Corrupt> {
        self.reload_head(ctl)?;
        let (pad, span) = self.needed(len);
        Ok(self.tail + pad + span - self.head_cache <= self.size)
    }

    /// Reserves a frame of `len` payload bytes and writes its header; the caller fills
    /// the payload at `slot.offset` and calls [`Producer::commit`]. `Ok(None)` if the
    /// ring is full.
    ///
    /// # Panics
    /// If `len > max_payload(size)`: the device checks lengths before calling.
    pub fn reserve<M: RingMemory>(
        &mut self,
        ctl: RingControl<'_>,
        mem: &M,
        len: usize,
    ) -> Result<Option<Slot>, Corrupt> {
        assert!(len <= max_payload(self.size as usize), "frame longer than the ring allows");
        let (pad, span) = self.needed(len);
        if self.tail + pad + span - self.head_cache > self.size {
            self.reload_head(ctl)?;
            if self.tail + pad + span - self.head_cache > self.size {
                return Ok(None);
            }
        }
        let mut pos = self.tail;
        if pad > 0 {
            // SAFETY: the offset is cell-aligned and below `size`, so the 8 header
            // bytes fit; the space is free (checked against the consumer position).
            unsafe { mem.store((pos % self.size) as usize, &header(0, KIND_PAD)) };
            pos += pad;
        }
        let offset = (pos % self.size) as usize;
        // SAFETY: `offset + FRAME_HDR + len <= size` by the padding rule; free space.
        unsafe { mem.store(offset, &header(len as u32, KIND_FRAME)) };
        Ok(Some(Slot { offset: offset + FRAME_HDR, len, end: pos + span }))
    }

    /// Publishes a reserved frame (and any padding before it).
    pub fn commit(&mut self, ctl: RingControl<'_>, slot: Slot) {
        self.tail = slot.end;
        ctl.tail.store(self.tail, Ordering::Release);
    }
}

/// The consumer's private state.
#[derive(Debug)]
pub struct Consumer {
    head: u64,
    tail_cache: u64,
    size: u64,
}

impl Consumer {
    /// A consumer at position 0 of a ring of `size` bytes.
    pub fn new(size: usize) -> Self {
        Consumer { head: 0, tail_cache: 0, size: size as u64 }
    }

    fn reload_tail(&mut self, ctl: RingControl<'_>) -> Result<(), Corrupt> {
        let t = ctl.tail.load(Ordering::Acquire);
        if t < self.tail_cache || t - self.head > self.size || !t.is_multiple_of(CELL as u64) {
            return Err(Corrupt(format!(
                "producer position {t} is impossible (consumer at {}, ring of {} bytes)",
                self.head, self.size
            )));
        }
        self.tail_cache = t;
        Ok(())
    }

    /// True if a frame is waiting (reloads the producer position).
    pub fn has_data(&mut self, ctl: RingControl<'_>) -> Result<bool, Corrupt> {
        self.reload_tail(ctl)?;
        Ok(self.tail_cache != self.head)
    }

    /// The next frame, validated, without releasing it; `Ok(None)` if none is there.
    pub fn peek<M: RingMemory>(&mut self, ctl: RingControl<'_>, mem: &M) -> Result<Option<Slot>, Corrupt> {
        if self.head == self.tail_cache {
            self.reload_tail(ctl)?;
            if self.head == self.tail_cache {
                return Ok(None);
            }
        }
        let max = max_payload(self.size as usize);
        let mut padded = false;
        loop {
            let off = (self.head % self.size) as usize;
            let mut h = [0u8; FRAME_HDR];
            // SAFETY: `off` is cell-aligned and below `size`; 8 bytes fit.
            unsafe { mem.load(off, &mut h) };
            let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let kind = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
            match kind {
                KIND_PAD if !padded && off != 0 => {
                    // Skip to the next lap; published with the next release.
                    self.head += self.size - off as u64;
                    padded = true;
                    if self.head >= self.tail_cache {
                        return Err(Corrupt("padding with no frame after it".into()));
                    }
                }
                KIND_FRAME => {
                    let end = self.head + frame_span(len.min(max));
                    if len > max || off + FRAME_HDR + len > self.size as usize || end > self.tail_cache {
                        return Err(Corrupt(format!(
                            "frame header at {} claims {len} bytes (limit {max}, {} published)",
                            self.head,
                            self.tail_cache - self.head
                        )));
                    }
                    return Ok(Some(Slot { offset: off + FRAME_HDR, len, end }));
                }
                _ => {
                    return Err(Corrupt(format!("bad frame header kind {kind:#x} at position {}", self.head)))
                }
            }
        }
    }

    /// Frees a frame returned by [`Consumer::peek`] (and any padding before it).
    pub fn release(&mut self, ctl: RingControl<'_>, slot: Slot) {
        self.head = slot.end;
        ctl.head.store(self.head, Ordering::Release);
    }
}

/// Announces that the owner of `flag` is about to sleep. Call, then re-check for
/// work; sleep only if there is none.
pub fn announce_sleep(flag: &AtomicU64) {
    flag.store(1, Ordering::Relaxed);
    fence(Ordering::SeqCst);
}

/// Withdraws [`announce_sleep`].
pub fn withdraw_sleep(flag: &AtomicU64) {
    flag.store(0, Ordering::Relaxed);
}

/// After publishing frames or freeing space: true if the peer announced sleep and
/// must be woken (the flag is cleared, so one wake-up is sent per sleep).
pub fn peer_needs_wake(flag: &AtomicU64) -> bool {
    fence(Ordering::SeqCst);
    flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::Relaxed) != 0
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::cell::UnsafeCell;

    struct Mem(UnsafeCell<Vec<u8>>);
    impl RingMemory for Mem {
        fn size(&self) -> usize {
            // SAFETY: single-threaded test; no outstanding mutable borrow.
            unsafe { (*self.0.get()).len() }
        }
        unsafe fn store(&self, offset: usize, src: &[u8]) {
            // SAFETY: single-threaded test; bounds per the trait contract.
            unsafe { (&mut *self.0.get())[offset..offset + src.len()].copy_from_slice(src) }
        }
        unsafe fn load(&self, offset: usize, dst: &mut [u8]) {
            // SAFETY: as above.
            unsafe { dst.copy_from_slice(&(&*self.0.get())[offset..offset + dst.len()]) }
        }
    }

    fn push(p: &mut Producer, ctl: RingControl<'_>, m: &Mem, data: &[u8]) -> bool {
        match p.reserve(ctl, m, data.len()).unwrap() {
            Some(s) => {
                // SAFETY: reserved slot.
                unsafe { m.store(s.offset, data) };
                p.commit(ctl, s);
                true
            }
            None => false,
        }
    }

    fn pop(c: &mut Consumer, ctl: RingControl<'_>, m: &Mem) -> Option<Vec<u8>> {
        let s = c.peek(ctl, m).unwrap()?;
        let mut v = vec![0; s.len];
        // SAFETY: slot inside the ring.
        unsafe { m.load(s.offset, &mut v) };
        c.release(ctl, s);
        Some(v)
    }

    #[test]
    fn frames_wrap_with_padding_and_keep_order() {
        let size = 1024;
        let m = Mem(UnsafeCell::new(vec![0; size]));
        let (t, h) = (AtomicU64::new(0), AtomicU64::new(0));
        let ctl = RingControl { tail: &t, head: &h };
        let (mut p, mut c) = (Producer::new(size), Consumer::new(size));
        let mut next = 0u32;
        let mut expect = 0u32;
        for round in 0..2000usize {
            let len = (round * 37) % (max_payload(size) + 1);
            let data: Vec<u8> = (0..len).map(|i| (i as u32 ^ next) as u8).collect();
            if push(&mut p, ctl, &m, &data) {
                next += 1;
            }
            if round % 3 != 0 {
                while let Some(v) = pop(&mut c, ctl, &m) {
                    assert!(v.iter().enumerate().all(|(i, &b)| b == (i as u32 ^ expect) as u8));
                    expect += 1;
                }
            }
        }
        assert!(next > 1000, "ring made too little progress: {next}");
    }

    #[test]
    fn full_ring_refuses_then_accepts_after_release() {
        let size = 256;
        let m = Mem(UnsafeCell::new(vec![0; size]));
        let (t, h) = (AtomicU64::new(0), AtomicU64::new(0));
        let ctl = RingControl { tail: &t, head: &h };
        let (mut p, mut c) = (Producer::new(size), Consumer::new(size));
        for _ in 0..4 {
            assert!(push(&mut p, ctl, &m, &[1; 8]));
        }
        assert!(!push(&mut p, ctl, &m, &[2; 8]));
        assert!(!p.has_room(ctl, 8).unwrap());
        assert_eq!(pop(&mut c, ctl, &m).unwrap(), vec![1; 8]);
        assert!(p.has_room(ctl, 8).unwrap());
        assert!(push(&mut p, ctl, &m, &[2; 8]));
    }

    #[test]
    fn hostile_positions_and_headers_are_rejected() {
        let size = 256;
        let m = Mem(UnsafeCell::new(vec![0; size]));
        let (t, h) = (AtomicU64::new(0), AtomicU64::new(0));
        let ctl = RingControl { tail: &t, head: &h };
        // Tail beyond a full ring.
        t.store(size as u64 + 64, Ordering::Relaxed);
        assert!(Consumer::new(size).peek(ctl, &m).is_err());
        // Unaligned tail.
        t.store(3, Ordering::Relaxed);
        assert!(Consumer::new(size).has_data(ctl).is_err());
        // Published cell whose header is garbage.
        t.store(64, Ordering::Relaxed);
        // SAFETY: single-threaded test.
        unsafe { m.store(0, &[0xff; 8]) };
        let e = Consumer::new(size).peek(ctl, &m).unwrap_err();
        assert!(e.0.contains("bad frame header kind"), "{e}");
        // A frame header claiming more than was published.
        // SAFETY: as above.
        unsafe { m.store(0, &header(60, KIND_FRAME)) };
        assert!(Consumer::new(size).peek(ctl, &m).unwrap_err().0.contains("claims 60 bytes"));
        // Padding at offset 0 (never legal) and padding followed by nothing.
        // SAFETY: as above.
        unsafe { m.store(0, &header(0, KIND_PAD)) };
        assert!(Consumer::new(size).peek(ctl, &m).is_err());
        // A consumer position ahead of the producer.
        h.store(128, Ordering::Relaxed);
        assert!(Producer::new(size).has_room(ctl, 8).is_err());
    }

    #[test]
    fn wake_flag_is_consumed_once() {
        let f = AtomicU64::new(0);
        assert!(!peer_needs_wake(&f));
        announce_sleep(&f);
        assert!(peer_needs_wake(&f));
        assert!(!peer_needs_wake(&f));
        announce_sleep(&f);
        withdraw_sleep(&f);
        assert!(!peer_needs_wake(&f));
    }
}
