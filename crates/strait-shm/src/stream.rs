//! The byte-stream ring: one direction of a TCP-like connection between two
//! processes (a stream of bytes that any write may split and any read may join).
//!
//! Two positions live in shared memory, each a byte count that only grows: the
//! producer's `tail` and the consumer's `head`; a position's offset in the data area
//! is `pos % size` (any size, not only powers of two). The bytes in `head..tail` are
//! the consumer's; the bytes in `tail..head + size` are the producer's.
//!
//! * **Publication.** The producer copies bytes at `tail`, then stores the new tail
//!   (Release); the consumer loads the tail (Acquire) before it copies. Symmetrically
//!   the consumer copies out, then stores the new head (Release), and the producer
//!   loads the head (Acquire) before it reuses the space. So a byte is never read
//!   before it is written nor overwritten before it is read.
//! * **Sleeping** uses the same flag-and-fence handshake as the frame ring
//!   ([`crate::ring::announce_sleep`] and [`crate::ring::peer_needs_wake`]): a
//!   consumer announces, re-checks [`ByteRing::readable`], and sleeps only if still
//!   empty; a producer that published checks the flag and rings. The same for a
//!   producer waiting for room.
//! * **The peer is not trusted.** Every position read from shared memory is checked
//!   (`head <= tail <= head + size`) before it is used; a violation is [`Corrupt`],
//!   never followed. Copies never leave the data area whatever the positions say.
//!
//! The loom model in `tests/loom_stream.rs` and the spin model `models/byte_ring.pml`
//! check the protocol, each with broken variants that must fail.

use crate::area::ByteArea;
use crate::ring::{AtomicU64, Corrupt, Ordering};

/// One direction of a byte stream in shared memory.
#[derive(Debug)]
pub struct ByteRing<'a, M: ?Sized> {
    tail: &'a AtomicU64,
    head: &'a AtomicU64,
    mem: &'a M,
}

/// A range of ring positions: `len` bytes from `pos`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// First position.
    pub pos: u64,
    /// Bytes.
    pub len: u64,
}

impl Span {
    /// The position just past the span.
    #[inline]
    pub fn end(&self) -> u64 {
        self.pos + self.len
    }
}

/// The pieces of a range of ring positions that never cross the end of the data
/// area: `(offset, bytes)`, at most two.
#[derive(Debug, Clone)]
pub struct Pieces {
    pos: u64,
    left: usize,
    size: usize,
}

impl Iterator for Pieces {
    type Item = (usize, usize);
    // Inline across crates: the copy loops of `strait run`'s every read and write.
    #[inline]
    fn next(&mut self) -> Option<(usize, usize)> {
        if self.left == 0 {
            return None;
        }
        let off = (self.pos % self.size as u64) as usize;
        let n = self.left.min(self.size - off);
        self.pos += n as u64;
        self.left -= n;
        Some((off, n))
    }
}

/// The pieces of `len` bytes from position `pos` in a data area of `size` bytes.
///
/// # Panics
/// If `size` is 0.
#[inline]
pub fn pieces(pos: u64, len: usize, size: usize) -> Pieces {
    assert!(size > 0, "a ring has a data area");
    Pieces { pos, left: len, size }
}

impl<'a, M: ByteArea + ?Sized> ByteRing<'a, M> {
    /// The ring whose producer position is `tail`, consumer position `head`, and
    /// bytes `mem`.
    pub fn new(tail: &'a AtomicU64, head: &'a AtomicU64, mem: &'a M) -> Self {
        ByteRing { tail, head, mem }
    }

    /// Size of the data area.
    pub fn size(&self) -> usize {
        self.mem.size()
    }

    #[inline]
    fn check(&self, head: u64, tail: u64) -> Result<(), Corrupt> {
        if tail < head || tail - head > self.mem.size() as u64 {
            return Err(Self::corrupt(head, tail, self.mem.size()));
        }
        Ok(())
    }

    /// The error for impossible positions (kept out of the hot path).
    #[cold]
    #[inline(never)]
    fn corrupt(head: u64, tail: u64, size: usize) -> Corrupt {
        Corrupt(format!("byte ring positions head {head} tail {tail} are impossible (ring of {size} bytes)"))
    }

    /// Consumer: the bytes waiting to be read (from the head).
    #[inline]
    pub fn readable(&self) -> Result<Span, Corrupt> {
        let tail = self.tail.load(Ordering::Acquire);
        let head = self.head.load(Ordering::Relaxed);
        self.check(head, tail)?;
        Ok(Span { pos: head, len: tail - head })
    }

    /// Producer: the room there is to write (from the tail).
    #[inline]
    pub fn writable(&self) -> Result<Span, Corrupt> {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        self.check(head, tail)?;
        Ok(Span { pos: tail, len: self.mem.size() as u64 - (tail - head) })
    }

    /// Producer: the room there is to write by a head the producer read earlier
    /// (`head_seen`), without reading the consumer's head now. Heads only grow, so
    /// the room is there (perhaps more). Keeping off the consumer's line lets the
    /// consumer's next head store stay in its own cache; when the room is not enough,
    /// use [`ByteRing::writable`].
    #[inline]
    pub fn writable_from(&self, head_seen: u64) -> Result<Span, Corrupt> {
        self.writable_between(self.tail.load(Ordering::Relaxed), head_seen)
    }

    /// Producer: as [`ByteRing::writable_from`], by a tail the producer knows
    /// without reading it (it wrote it last, and no other producer wrote since).
    #[inline]
    pub fn writable_between(&self, tail: u64, head_seen: u64) -> Result<Span, Corrupt> {
        self.check(head_seen, tail)?;
        Ok(Span { pos: tail, len: self.mem.size() as u64 - (tail - head_seen) })
    }

    /// Consumer: hints that the bytes at the head are read next, so that a reader
    /// waiting for them fetches their cache line alongside the tail's instead of
    /// after it (the tail and the data are two lines written by the other core).
    #[inline]
    pub fn prefetch_head(&self) {
        let head = self.head.load(Ordering::Relaxed);
        self.mem.prefetch((head % self.mem.size() as u64) as usize);
    }

    /// Copies the bytes at position `pos` into `dst` (the consumer, from a span that
    /// [`ByteRing::readable`] returned).
    ///
    /// # Panics
    /// If `dst` is longer than the data area.
    #[inline]
    pub fn read_at(&self, pos: u64, dst: &mut [u8]) {
        assert!(dst.len() <= self.mem.size(), "read longer than the ring");
        let mut done = 0;
        for (off, n) in pieces(pos, dst.len(), self.mem.size()) {
            // SAFETY: `off + n <= size` (pieces never cross the end of the area).
            unsafe { self.mem.load(off, &mut dst[done..done + n]) };
            done += n;
        }
    }

    /// Copies `src` to position `pos` (the producer, inside a span that
    /// [`ByteRing::writable`] returned).
    ///
    /// # Panics
    /// If `src` is longer than the data area.
    #[inline]
    pub fn write_at(&self, pos: u64, src: &[u8]) {
        assert!(src.len() <= self.mem.size(), "write longer than the ring");
        let mut done = 0;
        for (off, n) in pieces(pos, src.len(), self.mem.size()) {
            // SAFETY: `off + n <= size`; the protocol gives the producer the bytes past
            // the tail (the caller writes inside its writable span).
            unsafe { self.mem.store(off, &src[done..done + n]) };
            done += n;
        }
    }

    /// Consumer: hands the bytes before `head` back to the producer (after copying
    /// them out).
    #[inline]
    pub fn consume_to(&self, head: u64) {
        self.head.store(head, Ordering::Release);
    }

    /// Producer: publishes the bytes before `tail` (after copying them in).
    #[inline]
    pub fn publish_to(&self, tail: u64) {
        self.tail.store(tail, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::area::MappedArea;

    fn ring_over(buf: &mut [u64]) -> MappedArea {
        // SAFETY: the buffer is 8-aligned and outlives the area in each test.
        unsafe { MappedArea::new(buf.as_mut_ptr().cast(), buf.len() * 8) }
    }

    #[test]
    fn bytes_wrap_and_arrive_in_order_whatever_the_split() {
        let mut buf = vec![0u64; 3]; // 24 bytes: not a power of two
        let area = ring_over(&mut buf);
        let (tail, head) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = ByteRing::new(&tail, &head, &area);
        let stream: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let (mut sent, mut got) = (0usize, Vec::new());
        let mut k = 0usize;
        while got.len() < stream.len() {
            k += 1;
            let w = r.writable().unwrap();
            let n = (w.len as usize).min(k % 11 + 1).min(stream.len() - sent);
            r.write_at(w.pos, &stream[sent..sent + n]);
            r.publish_to(w.pos + n as u64);
            sent += n;
            let s = r.readable().unwrap();
            let m = (s.len as usize).min(k % 7 + 1);
            let mut out = vec![0; m];
            r.read_at(s.pos, &mut out);
            r.consume_to(s.pos + m as u64);
            got.extend_from_slice(&out);
        }
        assert_eq!(got, stream);
    }

    #[test]
    fn room_by_an_old_head_is_never_more_than_there_is() {
        let mut buf = vec![0u64; 2]; // 16 bytes
        let area = ring_over(&mut buf);
        let (tail, head) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = ByteRing::new(&tail, &head, &area);
        let mut seen = 0u64;
        for step in 0..200u64 {
            let fresh = r.writable().unwrap();
            match r.writable_from(seen) {
                Ok(old) => assert!(old.pos == fresh.pos && old.len <= fresh.len, "step {step}"),
                // A head so old that the tail ran past it: only the fresh read says.
                Err(_) => assert!(fresh.pos - seen > 16),
            }
            let n = (fresh.len).min(step % 5 + 1);
            r.publish_to(fresh.pos + n);
            if step % 3 == 0 {
                seen = head.load(Ordering::Relaxed);
            }
            let s = r.readable().unwrap();
            r.consume_to(s.pos + s.len.min(step % 4 + 1));
        }
    }

    /// A hostile consumer may write any tail: room by any cached head is either
    /// refused or a span inside one ring's worth of positions.
    #[test]
    fn room_by_a_cached_head_with_a_hostile_tail_is_bounded() {
        let mut buf = vec![0u64; 2]; // 16 bytes
        let area = ring_over(&mut buf);
        let (tail, head) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = ByteRing::new(&tail, &head, &area);
        let words = strait_sys::xorshift_bytes(0xbad, 8 * 2 * 4000);
        let word = |k: usize| u64::from_le_bytes(words[8 * k..8 * k + 8].try_into().unwrap());
        for k in 0..4000 {
            let pick = |w: u64| if w & 1 == 0 { w % 40 } else { w };
            tail.store(pick(word(2 * k)), Ordering::Relaxed);
            if let Ok(s) = r.writable_from(pick(word(2 * k + 1))) {
                assert!(s.len <= 16, "room {} beyond the ring", s.len);
            }
        }
    }

    #[test]
    fn impossible_positions_are_corrupt_not_followed() {
        let mut buf = vec![0u64; 2];
        let area = ring_over(&mut buf);
        let (tail, head) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = ByteRing::new(&tail, &head, &area);
        for (h, t) in [(5u64, 4u64), (0, 17), (u64::MAX - 1, 3), (3, u64::MAX)] {
            head.store(h, Ordering::Relaxed);
            tail.store(t, Ordering::Relaxed);
            assert!(r.readable().is_err(), "head {h} tail {t}");
            assert!(r.writable().is_err(), "head {h} tail {t}");
        }
        head.store(100, Ordering::Relaxed);
        tail.store(116, Ordering::Relaxed);
        assert_eq!(r.readable().unwrap(), Span { pos: 100, len: 16 });
        assert_eq!(r.writable().unwrap(), Span { pos: 116, len: 0 });
    }

    #[test]
    fn pieces_split_at_the_end_only() {
        assert_eq!(pieces(10, 10, 16).collect::<Vec<_>>(), vec![(10, 6), (0, 4)]);
        assert_eq!(pieces(32, 16, 16).collect::<Vec<_>>(), vec![(0, 16)]);
        assert_eq!(pieces(7, 0, 16).count(), 0);
    }
}
