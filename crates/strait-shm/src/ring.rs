//! The single-producer, single-consumer frame ring and its sleep/wake protocol.
//!
//! One ring carries frames in one direction. Positions are byte counts that only
//! grow (`u64`, never wrap in practice); a position's offset in the data area is
//! `pos % size`. Frames start on 64-byte cells. A frame is an 8-byte header word
//! (`len` in the low half, a kind tag with the lap number in the high half) followed
//! by `len` payload bytes, contiguous in memory: a frame that would run past the end
//! of the data area is preceded by a padding header and placed at the start of the
//! next lap.
//!
//! The header word is the publication: the producer writes the payload, then stores
//! the header (Release); the consumer polls the header word of the cell at its
//! position (Acquire), so a message costs the consumer one cache-line transfer (the
//! line holding the header and the first 56 payload bytes), with no separate "tail"
//! line to fetch. For this to be sound, a cell's first word must never hold stale
//! bytes that could look like a header: the consumer zeroes the first word of every
//! cell it has consumed before it hands the space back (`head`, Release), and the
//! producer only reuses space below the consumer's `head` (Acquire). The producer
//! caches `head` and reloads it only when it runs out of room.
//!
//! The peer is not trusted: every position and header read from shared memory is
//! validated (kind, lap, length), and a violation is reported as [`Corrupt`] instead
//! of being followed.
//!
//! Sleeping uses a flag per sleeper and the classic store/fence/load handshake on
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
const KIND_FRAME: u64 = 0x5346; // "SF"
const KIND_PAD: u64 = 0x5350; // "SP"

/// The peer broke the ring protocol; the string says how.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct Corrupt(pub String);

pub use crate::area::{ByteArea, WordArea};

/// The memory a ring's frames live in: a [`WordArea`] whose size is a power of two
/// of at least four [`CELL`]s; frame headers are the words at cell offsets.
pub trait RingMemory: WordArea {
    /// The header word at a cell-aligned `offset` (below `size()`).
    #[inline]
    fn header(&self, offset: usize) -> &AtomicU64 {
        self.word(offset)
    }
}

impl<T: WordArea + ?Sized> RingMemory for T {}

/// A frame reserved by the producer or found by the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Offset of the payload in the data area.
    pub offset: usize,
    /// Payload length.
    pub len: usize,
    /// Ring position of the frame's first cell (or of the padding before it).
    pub start: u64,
    /// Ring position of the frame's header.
    pub at: u64,
    /// Ring position just past this frame.
    pub end: u64,
}

fn frame_span(len: usize) -> u64 {
    (FRAME_HDR + len).div_ceil(CELL) as u64 * CELL as u64
}

fn header_word(kind: u64, pos: u64, size: u64, len: usize) -> u64 {
    let lap = (pos >> size.trailing_zeros()) & 0xffff;
    (kind << 48) | (lap << 32) | len as u64
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
    ///
    /// # Panics
    /// If `size` is not a power of two of at least 4 cells.
    pub fn new(size: usize) -> Self {
        assert!(size.is_power_of_two() && size >= 4 * CELL, "ring size {size} must be a power of two >= 256");
        Producer { tail: 0, head_cache: 0, size: size as u64 }
    }

    fn reload_head(&mut self, head: &AtomicU64) -> Result<(), Corrupt> {
        let h = head.load(Ordering::Acquire);
        if h > self.tail || self.tail - h > self.size || !h.is_multiple_of(CELL as u64) || h < self.head_cache
        {
            return Err(Corrupt(format!(
                "consumer position {h} is impossible (producer at {}, ring of {} bytes)",
                self.tail, self.size
            )));
        }
        self.head_cache = h;
        Ok(())
    }

    /// Bytes of ring a frame of `len` needs at the current position, padding included.
    #[inline]
    fn needed(&self, len: usize) -> (u64, u64) {
        let off = self.tail & (self.size - 1);
        let span = frame_span(len);
        let pad = if off + span > self.size { self.size - off } else { 0 };
        (pad, span)
    }

    /// True if a frame of `len` payload bytes fits now (reloads the consumer position
    /// from `head`).
    pub fn has_room(&mut self, head: &AtomicU64, len: usize) -> Result<bool, Corrupt> {
        self.reload_head(head)?;
        let (pad, span) = self.needed(len);
        Ok(self.tail + pad + span - self.head_cache <= self.size)
    }

    /// Reserves a frame of `len` payload bytes; the caller fills the payload at
    /// `slot.offset` and calls [`Producer::commit`]. `Ok(None)` if the ring is full.
    ///
    /// # Panics
    /// If `len > max_payload(size)`: the device checks lengths before calling.
    #[inline]
    pub fn reserve(&mut self, head: &AtomicU64, len: usize) -> Result<Option<Slot>, Corrupt> {
        assert!(len <= max_payload(self.size as usize), "frame longer than the ring allows");
        let (pad, span) = self.needed(len);
        if self.tail + pad + span - self.head_cache > self.size {
            self.reload_head(head)?;
            if self.tail + pad + span - self.head_cache > self.size {
                return Ok(None);
            }
        }
        let at = self.tail + pad;
        let offset = (at & (self.size - 1)) as usize + FRAME_HDR;
        Ok(Some(Slot { offset, len, start: self.tail, at, end: at + span }))
    }

    /// Publishes a reserved frame (and any padding before it): the payload must be
    /// written by now.
    #[inline]
    pub fn commit<M: RingMemory>(&mut self, mem: &M, slot: Slot) {
        let size = self.size;
        // The frame first, then the padding that leads the consumer to it, so the
        // consumer never follows padding to a cell that is not yet published.
        mem.header((slot.at & (size - 1)) as usize)
            .store(header_word(KIND_FRAME, slot.at, size, slot.len), Ordering::Release);
        if slot.at != slot.start {
            mem.header((slot.start & (size - 1)) as usize)
                .store(header_word(KIND_PAD, slot.start, size, 0), Ordering::Release);
        }
        self.tail = slot.end;
    }
}

/// The consumer's private state.
#[derive(Debug)]
pub struct Consumer {
    head: u64,
    published: u64,
    size: u64,
}

impl Consumer {
    /// A consumer at position 0 of a ring of `size` bytes.
    ///
    /// # Panics
    /// If `size` is not a power of two of at least 4 cells.
    pub fn new(size: usize) -> Self {
        assert!(size.is_power_of_two() && size >= 4 * CELL, "ring size {size} must be a power of two >= 256");
        Consumer { head: 0, published: 0, size: size as u64 }
    }

    /// True if a frame (or padding) is waiting.
    #[inline]
    pub fn has_data<M: RingMemory>(&self, mem: &M) -> bool {
        mem.header((self.head & (self.size - 1)) as usize).load(Ordering::Acquire) != 0
    }

    /// The next frame, validated, without releasing it; `Ok(None)` if none is there.
    #[inline]
    pub fn peek<M: RingMemory>(&self, mem: &M) -> Result<Option<Slot>, Corrupt> {
        // The idle poll, the hottest path of all, is one load.
        if mem.header((self.head & (self.size - 1)) as usize).load(Ordering::Acquire) == 0 {
            return Ok(None);
        }
        self.peek_frame(mem)
    }

    #[inline]
    fn peek_frame<M: RingMemory>(&self, mem: &M) -> Result<Option<Slot>, Corrupt> {
        let size = self.size;
        let max = max_payload(size as usize);
        let mut at = self.head;
        loop {
            let off = (at & (size - 1)) as usize;
            let h = mem.header(off).load(Ordering::Acquire);
            if h == 0 {
                return Ok(None);
            }
            let len = (h & 0xffff_ffff) as usize;
            if h == header_word(KIND_PAD, at, size, 0) && at == self.head && off != 0 {
                at += size - off as u64;
                continue;
            }
            if h != header_word(KIND_FRAME, at, size, len) {
                return Err(Corrupt(format!("bad frame header {h:#018x} at ring position {at}")));
            }
            if len > max || off + FRAME_HDR + len > size as usize {
                return Err(Corrupt(format!(
                    "frame header at ring position {at} claims {len} bytes (limit {max}, {} to the end of the ring)",
                    size as usize - off - FRAME_HDR
                )));
            }
            return Ok(Some(Slot {
                offset: off + FRAME_HDR,
                len,
                start: self.head,
                at,
                end: at + frame_span(len),
            }));
        }
    }

    /// Consumes a frame returned by [`Consumer::peek`] (and any padding before it).
    /// The space goes back to the producer only at the next [`Consumer::publish`].
    #[inline]
    pub fn release(&mut self, slot: Slot) {
        self.head = slot.end;
    }

    /// Bytes consumed but not yet handed back to the producer.
    pub fn unpublished(&self) -> u64 {
        self.head - self.published
    }

    /// Hands consumed space back to the producer: zeroes the first word of every
    /// consumed cell, then stores `head` (Release). Returns whether anything was
    /// handed back.
    ///
    /// Publishing is batched on purpose: zeroing a cell takes its cache line back
    /// from the producer, and doing that on every frame would put a cache-line
    /// round trip in front of the next store (stores leave the core in order) and
    /// in front of the doorbell's fence.
    pub fn publish<M: RingMemory>(&mut self, head: &AtomicU64, mem: &M) -> bool {
        if self.head == self.published {
            return false;
        }
        let size = self.size;
        let mut p = self.published;
        while p < self.head {
            mem.header((p & (size - 1)) as usize).store(0, Ordering::Relaxed);
            p += CELL as u64;
        }
        self.published = self.head;
        head.store(self.head, Ordering::Release);
        true
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

    /// Test memory: words, so header words can be handed out as atomics.
    struct Mem(Vec<AtomicU64>, UnsafeCell<()>);
    impl Mem {
        fn new(size: usize) -> Mem {
            Mem((0..size / 8).map(|_| AtomicU64::new(0)).collect(), UnsafeCell::new(()))
        }
        fn bytes(&self) -> *mut u8 {
            self.0.as_ptr() as *mut u8
        }
    }
    impl WordArea for Mem {
        fn word(&self, offset: usize) -> &AtomicU64 {
            &self.0[offset / 8]
        }
    }
    impl ByteArea for Mem {
        fn size(&self) -> usize {
            self.0.len() * 8
        }
        unsafe fn store(&self, offset: usize, src: &[u8]) {
            // SAFETY: single-threaded test; bounds per the trait contract.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.bytes().add(offset), src.len()) }
        }
        unsafe fn load(&self, offset: usize, dst: &mut [u8]) {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(self.bytes().add(offset), dst.as_mut_ptr(), dst.len()) }
        }
    }

    fn push(p: &mut Producer, head: &AtomicU64, m: &Mem, data: &[u8]) -> bool {
        match p.reserve(head, data.len()).unwrap() {
            Some(s) => {
                // SAFETY: reserved slot.
                unsafe { m.store(s.offset, data) };
                p.commit(m, s);
                true
            }
            None => false,
        }
    }

    fn pop(c: &mut Consumer, head: &AtomicU64, m: &Mem) -> Option<Vec<u8>> {
        let s = c.peek(m).unwrap()?;
        let mut v = vec![0; s.len];
        // SAFETY: slot inside the ring.
        unsafe { m.load(s.offset, &mut v) };
        c.release(s);
        c.publish(head, m);
        Some(v)
    }

    #[test]
    fn frames_wrap_with_padding_and_keep_order() {
        let size = 1024;
        let m = Mem::new(size);
        let h = AtomicU64::new(0);
        let (mut p, mut c) = (Producer::new(size), Consumer::new(size));
        let mut next = 0u32;
        let mut expect = 0u32;
        for round in 0..2000usize {
            // Payload bytes that look like headers must never be taken for one.
            let len = (round * 37) % (max_payload(size) + 1);
            let data: Vec<u8> =
                (0..len).map(|i| if i % 8 == 7 { 0x53 } else { (i as u32 ^ next) as u8 }).collect();
            if push(&mut p, &h, &m, &data) {
                next += 1;
            }
            if round % 3 != 0 {
                while let Some(v) = pop(&mut c, &h, &m) {
                    assert!(v
                        .iter()
                        .enumerate()
                        .all(|(i, &b)| b == if i % 8 == 7 { 0x53 } else { (i as u32 ^ expect) as u8 }));
                    expect += 1;
                }
            }
        }
        assert!(next > 1000, "ring made too little progress: {next}");
        assert!(expect + 2 >= next);
    }

    #[test]
    fn full_ring_refuses_then_accepts_after_release() {
        let size = 256;
        let m = Mem::new(size);
        let h = AtomicU64::new(0);
        let (mut p, mut c) = (Producer::new(size), Consumer::new(size));
        for _ in 0..4 {
            assert!(push(&mut p, &h, &m, &[1; 8]));
        }
        assert!(!push(&mut p, &h, &m, &[2; 8]));
        assert!(!p.has_room(&h, 8).unwrap());
        assert_eq!(pop(&mut c, &h, &m).unwrap(), vec![1; 8]);
        assert!(p.has_room(&h, 8).unwrap());
        assert!(push(&mut p, &h, &m, &[2; 8]));
    }

    #[test]
    fn hostile_positions_and_headers_are_rejected() {
        let size = 256;
        let m = Mem::new(size);
        let h = AtomicU64::new(0);
        let c = Consumer::new(size);
        // Garbage in the header word.
        m.header(0).store(0xffff_ffff_ffff_ffff, Ordering::Relaxed);
        let e = c.peek(&m).unwrap_err();
        assert!(e.0.contains("bad frame header"), "{e}");
        // A valid-looking frame header from the wrong lap.
        m.header(0).store(header_word(KIND_FRAME, size as u64, size as u64, 8), Ordering::Relaxed);
        assert!(c.peek(&m).is_err());
        // A frame header claiming more than the ring holds.
        m.header(0).store(header_word(KIND_FRAME, 0, size as u64, 60), Ordering::Relaxed);
        assert!(c.peek(&m).unwrap_err().0.contains("claims 60 bytes"));
        // Padding at offset 0 (never legal).
        m.header(0).store(header_word(KIND_PAD, 0, size as u64, 0), Ordering::Relaxed);
        assert!(c.peek(&m).is_err());
        // A consumer position ahead of the producer, or unaligned.
        h.store(128, Ordering::Relaxed);
        assert!(Producer::new(size).has_room(&h, 8).is_err());
        h.store(0, Ordering::Relaxed);
        let mut p = Producer::new(size);
        assert!(p.has_room(&h, 8).unwrap());
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
