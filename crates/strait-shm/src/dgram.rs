//! The datagram ring: UDP-like messages from one producer to any number of consumers
//! (threads or forked processes sharing one receiving socket), each datagram taken
//! exactly once.
//!
//! Records are an 8-byte header word (payload length in the low half, kind in the
//! high half) and the payload, padded to 8 bytes, never split at the end of the data
//! area: a record that would not fit before the end is preceded by a wrap record that
//! skips the rest. Positions are byte counts that only grow, 8-aligned; the producer
//! stores `tail` (Release) after the record, consumers load it (Acquire).
//!
//! * **Exactly once.** A consumer copies a record out first and then claims it with
//!   a compare-and-swap of `head` from the record's position to the next; a consumer
//!   that loses the race throws its copy away and looks again. The producer reuses
//!   space only below `head` (Acquire), so a successful claim proves that the bytes
//!   copied were the record's.
//! * **One producer.** Callers serialize producers (a lock per sending channel).
//! * **Full** is not an error: the caller decides (the preload drops the datagram and
//!   counts it, as a full kernel receive buffer does).
//! * **The peer is not trusted.** Positions, kinds and lengths are validated
//!   ([`Corrupt`]); nothing is read or written outside the data area.
//!
//! Checked by `tests/loom_dgram.rs` and `models/dgram_ring.pml`.

use crate::area::WordArea;
use crate::ring::{AtomicU64, Corrupt, Ordering};

/// Bytes of a record's header.
pub const RECORD_HDR: usize = 8;
const KIND_DATA: u64 = 0;
const KIND_WRAP: u64 = 1;

/// Bytes a datagram of `len` takes in the ring (header and padding included).
pub fn record_bytes(len: usize) -> usize {
    RECORD_HDR + len.next_multiple_of(8)
}

/// Largest datagram a ring of `size` bytes can carry.
pub fn max_datagram(size: usize) -> usize {
    size.saturating_sub(RECORD_HDR)
}

/// One datagram ring in shared memory.
#[derive(Debug)]
pub struct DgramRing<'a, M: ?Sized> {
    tail: &'a AtomicU64,
    head: &'a AtomicU64,
    mem: &'a M,
}

/// What a ring's sole producer knows of the positions without reading them
/// ([`DgramRing::push_as_sole_producer`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProducerView {
    /// The consumers' head as last read (heads only grow: room by it is there).
    pub head_seen: u64,
    /// The tail this producer stored last (`None`: not yet; it is read once).
    pub tail: Option<u64>,
}

/// What [`DgramRing::push`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// The datagram is in the ring.
    Sent,
    /// No room for it now.
    Full,
}

impl<'a, M: WordArea + ?Sized> DgramRing<'a, M> {
    /// The ring with producer position `tail`, consumer position `head` and data
    /// area `mem` (a multiple of 8 bytes, else every operation is [`Corrupt`]).
    pub fn new(tail: &'a AtomicU64, head: &'a AtomicU64, mem: &'a M) -> Self {
        DgramRing { tail, head, mem }
    }

    /// `(head, tail)`, validated.
    ///
    /// Other consumers move the head meanwhile, so two loads are no snapshot: a
    /// stale head with a new tail looks like an overfull ring, and a head moved past
    /// a stale tail like a negative one (both found by `tests/loom_dgram.rs`). So the
    /// head is read before and after the tail, and the pair is used only if the head
    /// did not move: then `head <= tail` (the consumer that stored that head had read
    /// a tail at least as large, and our Acquire orders that before our tail load)
    /// and `tail - head <= size` (the producer published that tail after reading a
    /// head at least `tail - size`, which our head load after it cannot precede). A
    /// head that keeps moving (only a hostile peer keeps it up) is corrupt after a
    /// bound.
    fn used(&self) -> Result<(u64, u64), Corrupt> {
        let size = self.mem.size() as u64;
        let mut head = self.head.load(Ordering::Acquire);
        for _ in 0..64 {
            let tail = self.tail.load(Ordering::Acquire);
            let again = self.head.load(Ordering::Acquire);
            if again != head {
                head = again;
                continue;
            }
            if tail < head || tail - head > size || !head.is_multiple_of(8) || !size.is_multiple_of(8) {
                return Err(Corrupt(format!(
                    "datagram ring positions head {head} tail {tail} are impossible (ring of {size} bytes)"
                )));
            }
            return Ok((head, tail));
        }
        Err(Corrupt("datagram ring head keeps moving".into()))
    }

    /// True if a record is waiting.
    pub fn has_data(&self) -> Result<bool, Corrupt> {
        let (h, t) = self.used()?;
        Ok(t != h)
    }

    /// The producer's position (grows with every datagram: a cheap "anything new?").
    pub fn tail(&self) -> u64 {
        self.tail.load(Ordering::Relaxed)
    }

    /// The record at `head`: `Ok(Some((kind, len, offset)))`, checked against the
    /// published tail; `Ok(None)` if another consumer took it meanwhile (look again).
    ///
    /// A record that does not check out is not yet proof of a broken peer: another
    /// consumer may have taken it since `head` was read and the producer may have
    /// written the next lap's header there (found by `models/dgram_ring.pml`). Only
    /// if `head` is still where it was (no consumer took the record, so the producer
    /// cannot have touched it) is the record corrupt. The header load is Acquire so
    /// that the second look at `head` cannot be answered before it.
    fn record(&self, head: u64, tail: u64) -> Result<Option<(u64, usize, usize)>, Corrupt> {
        let size = self.mem.size();
        let off = (head % size as u64) as usize;
        let w = self.mem.word(off).load(Ordering::Acquire);
        let (kind, len) = (w >> 32, (w & 0xffff_ffff) as usize);
        let ok = match kind {
            KIND_WRAP => tail - head >= (size - off) as u64,
            KIND_DATA => {
                let rec = record_bytes(len);
                off + rec <= size && tail - head >= rec as u64
            }
            _ => false,
        };
        if !ok {
            if self.head.load(Ordering::Acquire) != head {
                return Ok(None);
            }
            return Err(Corrupt(format!(
                "bad datagram record {w:#018x} at ring position {head} (tail {tail})"
            )));
        }
        Ok(Some((kind, len, off)))
    }

    /// Skips the wrap record at `head` (a racing consumer may have done it: the
    /// compare-and-swap settles it).
    fn skip_wrap(&self, head: u64, off: usize) {
        let _ = self.head.compare_exchange(
            head,
            head + (self.mem.size() - off) as u64,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    /// Length of the next datagram, if one is waiting.
    pub fn next_len(&self) -> Result<Option<usize>, Corrupt> {
        Ok(self.next_datagram()?.map(|(_, len, _)| len))
    }

    /// The next datagram record, past any wrap records (which it takes): its
    /// position, payload length and record offset; `None` if the ring is empty.
    fn next_datagram(&self) -> Result<Option<(u64, usize, usize)>, Corrupt> {
        loop {
            let (head, tail) = self.used()?;
            if head == tail {
                return Ok(None);
            }
            let Some((kind, len, off)) = self.record(head, tail)? else { continue };
            if kind == KIND_WRAP {
                self.skip_wrap(head, off);
                continue;
            }
            return Ok(Some((head, len, off)));
        }
    }

    /// Takes the next datagram: `copy(area, payload offset, length)` copies it out
    /// (it may run more than once when another consumer wins a race; only the last
    /// run's copy is the datagram). With `peek`, copies without taking. `Ok(None)` if
    /// the ring is empty; otherwise the datagram's length.
    pub fn take(&self, peek: bool, mut copy: impl FnMut(&M, usize, usize)) -> Result<Option<usize>, Corrupt> {
        loop {
            let Some((head, len, off)) = self.next_datagram()? else { return Ok(None) };
            // Copy first, then claim: a claim that succeeds proves the producer did
            // not reuse the space meanwhile (it only writes below `head`).
            copy(self.mem, off + RECORD_HDR, len);
            if peek {
                return Ok(Some(len));
            }
            let next = head + record_bytes(len) as u64;
            if self.head.compare_exchange(head, next, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                return Ok(Some(len));
            }
        }
    }

    /// Producer: appends a datagram of `len` bytes, which `fill(area, payload
    /// offset)` writes. Callers serialize producers.
    pub fn push(&self, len: usize, fill: impl FnOnce(&M, usize)) -> Result<Pushed, Corrupt> {
        self.push_seen(None, None, len, fill)
    }

    /// Producer: [`DgramRing::push`] that first trusts `head_seen`, the consumers'
    /// head as this producer last read it (0 at first), and reads the real head
    /// (updating `head_seen`) only when that shows too little room. Heads only grow,
    /// so room by an old head is there; keeping off the consumers' line lets their
    /// claims (a compare-and-swap of the head) stay in their own caches.
    pub fn push_from(
        &self,
        head_seen: &mut u64,
        len: usize,
        fill: impl FnOnce(&M, usize),
    ) -> Result<Pushed, Corrupt> {
        self.push_seen(Some(head_seen), None, len, fill)
    }

    /// Producer: [`DgramRing::push_from`] by a producer that is the ring's only one
    /// for the ring's life (no other process or thread ever stores its tail): the
    /// tail it stored last is the tail, so the shared one is not read (a line the
    /// polling consumers keep pulling to their cores). `view` starts as
    /// [`ProducerView::default`].
    pub fn push_as_sole_producer(
        &self,
        view: &mut ProducerView,
        len: usize,
        fill: impl FnOnce(&M, usize),
    ) -> Result<Pushed, Corrupt> {
        self.push_seen(Some(&mut view.head_seen), Some(&mut view.tail), len, fill)
    }

    fn push_seen(
        &self,
        seen: Option<&mut u64>,
        tail_known: Option<&mut Option<u64>>,
        len: usize,
        fill: impl FnOnce(&M, usize),
    ) -> Result<Pushed, Corrupt> {
        let size = self.mem.size();
        let rec = record_bytes(len);
        if rec > size {
            return Ok(Pushed::Full);
        }
        let tail = match tail_known.as_deref() {
            Some(Some(t)) => *t,
            _ => self.tail.load(Ordering::Relaxed),
        };
        let off = (tail % size as u64) as usize;
        let waste = if size - off < rec { size - off } else { 0 };
        let fits = |head: u64| head <= tail && (tail - head) as usize + waste + rec <= size;
        match seen {
            Some(h) if fits(*h) && tail.is_multiple_of(8) && size.is_multiple_of(8) => {}
            seen => {
                let head = self.head.load(Ordering::Acquire);
                if head > tail
                    || tail - head > size as u64
                    || !tail.is_multiple_of(8)
                    || !size.is_multiple_of(8)
                {
                    return Err(Corrupt(format!(
                        "datagram ring positions head {head} tail {tail} are impossible (ring of {size} bytes)"
                    )));
                }
                if let Some(h) = seen {
                    *h = head;
                }
                if !fits(head) {
                    return Ok(Pushed::Full);
                }
            }
        }
        if waste > 0 {
            self.mem.word(off).store(KIND_WRAP << 32, Ordering::Relaxed);
        }
        let at = (off + waste) % size;
        fill(self.mem, at + RECORD_HDR);
        self.mem.word(at).store(len as u64 | (KIND_DATA << 32), Ordering::Relaxed);
        let next = tail + (waste + rec) as u64;
        self.tail.store(next, Ordering::Release);
        if let Some(t) = tail_known {
            *t = Some(next);
        }
        Ok(Pushed::Sent)
    }

    /// Consumer: hints that the record at the head is read next, so that a receiver
    /// waiting for it fetches its cache line alongside the tail's.
    #[inline]
    pub fn prefetch_head(&self) {
        let head = self.head.load(Ordering::Relaxed);
        self.mem.prefetch((head % self.mem.size() as u64) as usize);
    }

    /// Copies `src` into the data area at `offset` (for a `fill` of
    /// [`DgramRing::push`]).
    ///
    /// # Panics
    /// If the range leaves the data area.
    pub fn store(mem: &M, offset: usize, src: &[u8]) {
        assert!(offset + src.len() <= mem.size(), "datagram outside the ring");
        // SAFETY: in bounds (asserted); the producer owns the reserved record.
        unsafe { mem.store(offset, src) }
    }

    /// Copies bytes at `offset` of the data area into `dst` (for a `copy` of
    /// [`DgramRing::take`]).
    ///
    /// # Panics
    /// If the range leaves the data area.
    pub fn load(mem: &M, offset: usize, dst: &mut [u8]) {
        assert!(offset + dst.len() <= mem.size(), "datagram outside the ring");
        // SAFETY: in bounds (asserted); bytes are only copied.
        unsafe { mem.load(offset, dst) }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::area::MappedArea;

    fn area(buf: &mut [u64]) -> MappedArea {
        // SAFETY: 8-aligned buffer that outlives the area in each test.
        unsafe { MappedArea::new(buf.as_mut_ptr().cast(), buf.len() * 8) }
    }

    fn send(r: &DgramRing<MappedArea>, d: &[u8]) -> Pushed {
        r.push(d.len(), |m, off| DgramRing::store(m, off, d)).unwrap()
    }

    fn recv(r: &DgramRing<MappedArea>) -> Option<Vec<u8>> {
        let mut out = vec![0u8; 64];
        let n = r.take(false, |m, off, len| DgramRing::load(m, off, &mut out[..len.min(64)])).unwrap()?;
        out.truncate(n);
        Some(out)
    }

    /// A hostile receiver may write any tail and head: a producer with any cached
    /// head either refuses (corrupt or full) or writes inside the data area.
    #[test]
    fn push_from_with_hostile_positions_stays_in_the_area() {
        let mut buf = vec![0u64; 6]; // 48 bytes
        let m = area(&mut buf);
        let (tail, head) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = DgramRing::new(&tail, &head, &m);
        let words = strait_sys::xorshift_bytes(0x5eed, 8 * 3 * 4000);
        let word = |k: usize| u64::from_le_bytes(words[8 * k..8 * k + 8].try_into().unwrap());
        for k in 0..4000 {
            // Small values too, so that some positions are plausible.
            let pick = |w: u64| if w & 1 == 0 { w % 200 } else { w };
            tail.store(pick(word(3 * k)), Ordering::Relaxed);
            head.store(pick(word(3 * k + 1)), Ordering::Relaxed);
            let mut seen = pick(word(3 * k + 2));
            let len = (word(3 * k + 2) % 40) as usize;
            let _ = r.push_from(&mut seen, len, |mm, off| {
                assert!(off + len <= crate::area::ByteArea::size(mm), "record outside the area");
                DgramRing::store(mm, off, &vec![7u8; len]);
            });
        }
    }

    /// A sole producer keeps its own tail: a consumer that rewrites the tail word
    /// changes nothing it writes (no record lands where the lie points, no lie makes
    /// it refuse), and every datagram still arrives once, intact, in order, across
    /// many wraps.
    #[test]
    fn a_sole_producer_writes_by_its_own_tail_whatever_the_shared_word_says() {
        let mut buf = vec![0u64; 8]; // 64 bytes: a wrap every few datagrams
        let m = area(&mut buf);
        let (tail, head) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = DgramRing::new(&tail, &head, &m);
        let mut view = ProducerView::default();
        for i in 0..200u8 {
            let before = view.tail.unwrap_or(0);
            match i % 3 {
                1 => tail.store(before + 8, Ordering::Relaxed),
                2 => tail.store(u64::MAX - 7, Ordering::Relaxed),
                _ => {}
            }
            let d = [i; 12];
            let pushed = r.push_as_sole_producer(&mut view, 12, |mm, off| DgramRing::store(mm, off, &d));
            assert_eq!(pushed.expect("its own positions are sound"), Pushed::Sent, "datagram {i}");
            assert_eq!(view.tail, Some(tail.load(Ordering::Relaxed)), "the view is the published tail");
            assert_eq!(recv(&r).expect("the datagram just sent"), d.to_vec(), "datagram {i}");
        }
    }

    #[test]
    fn push_from_an_old_head_never_overwrites_and_learns_the_new_one() {
        let mut buf = vec![0u64; 6]; // 48 bytes: three 8-byte datagrams
        let m = area(&mut buf);
        let (tail, head) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = DgramRing::new(&tail, &head, &m);
        let mut seen = 0u64;
        let mut out = Vec::new();
        for i in 0..50u8 {
            let d = [i; 8];
            let pushed = r.push_from(&mut seen, 8, |mm, off| DgramRing::store(mm, off, &d)).unwrap();
            assert!(seen <= head.load(Ordering::Relaxed), "a head seen ahead of the real one");
            if pushed == Pushed::Full {
                // Full by the real head too: the fresh read found no room.
                assert_eq!(r.push(8, |_, _| {}).unwrap(), Pushed::Full);
            }
            if i % 2 == 0 {
                while let Some(n) = r
                    .take(false, |mm, off, n| {
                        let mut v = vec![0u8; n];
                        DgramRing::load(mm, off, &mut v);
                        out.push(v[0]);
                    })
                    .unwrap()
                {
                    assert_eq!(n, 8);
                }
            }
        }
        assert!(out.windows(2).all(|w| w[0] < w[1]), "order or duplicates: {out:?}");
        assert!(out.len() > 30, "most datagrams got through: {out:?}");
    }

    #[test]
    fn datagrams_keep_their_boundaries_across_wrap_records() {
        let mut buf = vec![0u64; 8]; // 64 bytes
        let a = area(&mut buf);
        let (tail, head) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = DgramRing::new(&tail, &head, &a);
        for round in 0..50u8 {
            let len = (round as usize * 5) % 27;
            let d: Vec<u8> = (0..len as u8).map(|b| b ^ round).collect();
            assert_eq!(send(&r, &d), Pushed::Sent, "round {round}");
            assert_eq!(r.next_len().unwrap(), Some(len));
            assert_eq!(recv(&r).unwrap(), d);
            assert_eq!(recv(&r), None);
        }
    }

    #[test]
    fn a_full_ring_refuses_and_a_too_large_datagram_never_fits() {
        let mut buf = vec![0u64; 8];
        let a = area(&mut buf);
        let (tail, head) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = DgramRing::new(&tail, &head, &a);
        assert_eq!(send(&r, &[1; 56]), Pushed::Sent);
        assert_eq!(send(&r, &[2; 1]), Pushed::Full);
        assert_eq!(recv(&r).unwrap(), vec![1; 56]);
        assert_eq!(send(&r, &[3; 57]), Pushed::Full);
        assert_eq!(max_datagram(64), 56);
    }

    #[test]
    fn hostile_positions_and_records_are_corrupt() {
        let mut buf = vec![0u64; 8];
        let a = area(&mut buf);
        let (tail, head) = (AtomicU64::new(0), AtomicU64::new(0));
        let r = DgramRing::new(&tail, &head, &a);
        tail.store(16, Ordering::Relaxed);
        a.word(0).store(200, Ordering::Relaxed); // claims 200 bytes
        assert!(r.take(false, |_, _, _| panic!("copied a bad record")).is_err());
        a.word(0).store(7 << 32, Ordering::Relaxed); // unknown kind
        assert!(r.next_len().is_err());
        a.word(0).store(KIND_WRAP << 32, Ordering::Relaxed); // wrap past the tail
        assert!(r.next_len().is_err());
        head.store(3, Ordering::Relaxed);
        assert!(r.has_data().is_err());
        head.store(32, Ordering::Relaxed);
        assert!(r.push(1, |_, _| panic!("wrote past a bad head")).is_err());
    }
}
