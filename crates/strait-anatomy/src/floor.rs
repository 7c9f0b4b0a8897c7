//! `spin-floor`: the machine's physical floor for moving a message between two
//! processes through shared memory, with no protocol at all.
//!
//! Two processes map one `memfd` region (`MAP_SHARED`). Each direction is a ring of
//! [`SLOTS`] slots; a slot is one 64-byte header line (a sequence word, a length and
//! 56 bytes of inline payload) plus a [`CHUNK`]-byte data area. A message of up to
//! [`INLINE`] bytes travels inside the header line, so a small ping-pong moves exactly
//! one cache line each way. Larger messages are cut into `CHUNK`-byte pieces: the
//! sender copies a piece into a free slot and publishes it, the receiver copies it
//! out, so the two copies overlap (pipelined) and a large message costs about one
//! copy plus one chunk.
//!
//! Waiting spins for a bounded budget ([`SPIN`], or `STRAIT_FLOOR_SPIN_US`), then
//! sleeps on a shared futex; a writer issues `FUTEX_WAKE` only if the reader announced
//! that it sleeps (Dekker-style, sequentially consistent flag/word accesses).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::sys::{futex_wait, futex_wake, memfd};
use crate::transport::{ensure_len, BenchError, Pending, Result, Transport, TransportSpec};
use strait_sys::Mapping as SharedMap;

/// Cache-line size assumed for the layout.
pub const LINE: usize = 64;
/// Slots per direction.
pub const SLOTS: usize = 32;
/// Data bytes per slot (pieces of large messages).
pub const CHUNK: usize = 32 * 1024;
/// Largest message carried inline in the header line with its flag.
pub const INLINE: usize = LINE - 8;
/// Default spin budget before sleeping on the futex.
pub const SPIN: Duration = Duration::from_millis(2);
/// A wait gives up (the peer is presumed dead) after this long.
const DEAD: Duration = Duration::from_secs(30);

// Layout of one direction: control lines, slot header lines, then data (page aligned).
const CONSUMED_OFF: usize = 0; // written by the receiver
const RX_SLEEP_OFF: usize = LINE; // written by the receiver when it sleeps
const TX_SLEEP_OFF: usize = 2 * LINE; // written by the sender when the ring is full
const HDR_OFF: usize = 4 * LINE;
const DATA_OFF: usize = 4096;
const DIR_LEN: usize = DATA_OFF + SLOTS * CHUNK;
/// Bytes of the whole shared region (two directions).
pub const REGION_LEN: usize = 2 * DIR_LEN;

const _: () = assert!(HDR_OFF + SLOTS * LINE <= DATA_OFF);

/// The spin-floor transport spec.
pub struct SpinFloor;

impl TransportSpec for SpinFloor {
    crate::spec_identity!(
        "spin-floor",
        "shared memfd, one cache line flag+payload (<= 56 B) or pipelined 32 KiB memcpy pieces, busy-poll",
        true
    );

    fn listen(&self) -> Result<Pending> {
        let fd =
            memfd(c"strait-spin-floor", REGION_LEN).map_err(|e| BenchError::io("spin-floor: memfd", e))?;
        let map = SharedMap::shared(fd.as_raw_fd(), REGION_LEN, 0)
            .map_err(|e| BenchError::io("spin-floor: mmap", e))?;
        Ok(Pending {
            peer_args: Vec::new(),
            peer_fds: vec![fd],
            finish: Box::new(move || Ok(Box::new(Floor::new(map, 0)))),
        })
    }

    fn connect(&self, _args: &[String], fds: Vec<OwnedFd>) -> Result<Box<dyn Transport>> {
        let fd = fds
            .into_iter()
            .next()
            .ok_or_else(|| BenchError::Protocol("spin-floor peer needs one fd".into()))?;
        let map = SharedMap::shared(fd.as_raw_fd(), REGION_LEN, 0)
            .map_err(|e| BenchError::io("spin-floor: mmap", e))?;
        Ok(Box::new(Floor::new(map, 1)))
    }
}

fn spin_budget() -> Duration {
    std::env::var("STRAIT_FLOOR_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(SPIN, Duration::from_micros)
}

/// One end of the spin-floor: sends on direction `me`, receives on `1 - me`.
struct Floor {
    map: SharedMap,
    tx_dir: usize,
    rx_dir: usize,
    /// Pieces published on the send direction.
    head: u32,
    /// Last `consumed` value seen on the send direction.
    seen_consumed: u32,
    /// Pieces consumed on the receive direction.
    pos: u32,
    spin: Duration,
    buf: Vec<u8>,
}

/// Pieces a `size`-byte message takes.
fn pieces(size: usize) -> usize {
    if size <= INLINE {
        1
    } else {
        size.div_ceil(CHUNK)
    }
}

impl Floor {
    fn new(map: SharedMap, me: usize) -> Floor {
        Floor {
            map,
            tx_dir: me,
            rx_dir: 1 - me,
            head: 0,
            seen_consumed: 0,
            pos: 0,
            spin: spin_budget(),
            buf: Vec::new(),
        }
    }

    fn dir_base(&self, dir: usize) -> *mut u8 {
        // SAFETY: dir is 0 or 1 and the region holds two directions of DIR_LEN bytes.
        unsafe { self.map.ptr().add(dir * DIR_LEN) }
    }

    fn word(&self, dir: usize, off: usize) -> &AtomicU32 {
        // SAFETY: `off` is one of the aligned control or header offsets inside the
        // direction; the mapping lives as long as `self`; AtomicU32 has the layout
        // of u32, and all cross-process accesses to these words are atomic.
        unsafe { &*(self.dir_base(dir).add(off) as *const AtomicU32) }
    }

    fn hdr(&self, dir: usize, slot: usize) -> *mut u8 {
        // SAFETY: slot < SLOTS, so the header line lies inside the direction.
        unsafe { self.dir_base(dir).add(HDR_OFF + slot * LINE) }
    }

    fn data(&self, dir: usize, slot: usize) -> *mut u8 {
        // SAFETY: slot < SLOTS, so the CHUNK-byte data area lies inside the direction.
        unsafe { self.dir_base(dir).add(DATA_OFF + slot * CHUNK) }
    }

    /// Spins (bounded), then sleeps on `word` until `ready(word value)` holds.
    /// `sleep_flag` is set while sleeping so the other side knows to wake us.
    fn wait(&self, word: &AtomicU32, sleep_flag: &AtomicU32, ready: impl Fn(u32) -> bool) -> Result<u32> {
        let v = word.load(Ordering::Acquire);
        if ready(v) {
            return Ok(v);
        }
        let start = Instant::now();
        let mut n: u32 = 0;
        loop {
            let v = word.load(Ordering::Acquire);
            if ready(v) {
                return Ok(v);
            }
            std::hint::spin_loop();
            n = n.wrapping_add(1);
            if !n.is_multiple_of(256) {
                continue;
            }
            let waited = start.elapsed();
            if waited < self.spin {
                continue;
            }
            if waited > DEAD {
                return Err(BenchError::Timeout(DEAD, "the spin-floor peer"));
            }
            sleep_flag.store(1, Ordering::SeqCst);
            let v = word.load(Ordering::SeqCst);
            if !ready(v) {
                futex_wait(word, v, Duration::from_millis(10));
            }
            sleep_flag.store(0, Ordering::Relaxed);
        }
    }

    fn send(&mut self, size: usize) -> Result<()> {
        let dir = self.tx_dir;
        let np = pieces(size);
        let mut off = 0;
        for _ in 0..np {
            if self.head.wrapping_sub(self.seen_consumed) as usize >= SLOTS {
                let head = self.head;
                let consumed = self.word(dir, CONSUMED_OFF);
                let flag = self.word(dir, TX_SLEEP_OFF);
                self.seen_consumed =
                    self.wait(consumed, flag, |c| (head.wrapping_sub(c) as usize) < SLOTS)?;
            }
            let slot = self.head as usize % SLOTS;
            let hdr = self.hdr(dir, slot);
            let len = if size <= INLINE {
                // SAFETY: the slot is free (the receiver consumed it), so only this
                // process touches its payload; size <= INLINE fits after the 8-byte
                // header words; `buf` holds at least `size` bytes.
                unsafe { std::ptr::copy_nonoverlapping(self.buf.as_ptr(), hdr.add(8), size) };
                size
            } else {
                let len = (size - off).min(CHUNK);
                // SAFETY: the slot is free; len <= CHUNK fits its data area; `buf`
                // holds `size` bytes and off + len <= size.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.buf.as_ptr().add(off), self.data(dir, slot), len)
                };
                len
            };
            off += len;
            // SAFETY: the length word at header offset 4 is inside the free slot.
            unsafe { std::ptr::write_volatile(hdr.add(4) as *mut u32, len as u32) };
            self.head = self.head.wrapping_add(1);
            let seq = self.word(dir, HDR_OFF + slot * LINE);
            seq.store(self.head, Ordering::SeqCst);
            if self.word(dir, RX_SLEEP_OFF).load(Ordering::SeqCst) != 0 {
                futex_wake(seq);
            }
        }
        Ok(())
    }

    fn recv(&mut self, size: usize) -> Result<()> {
        let dir = self.rx_dir;
        let np = pieces(size);
        let mut off = 0;
        for _ in 0..np {
            let slot = self.pos as usize % SLOTS;
            let expect = self.pos.wrapping_add(1);
            let seq = self.word(dir, HDR_OFF + slot * LINE);
            self.wait(seq, self.word(dir, RX_SLEEP_OFF), |v| v == expect)?;
            let hdr = self.hdr(dir, slot);
            // SAFETY: the slot is published to us (Acquire above) and the writer does
            // not touch it until we advance `consumed`. The length is peer-written:
            // it is clamped to what this piece may carry, never trusted.
            let len = unsafe { std::ptr::read_volatile(hdr.add(4) as *const u32) } as usize;
            if size <= INLINE {
                let len = len.min(size);
                // SAFETY: len <= size <= INLINE bytes after the 8 header bytes; `buf`
                // holds at least `size` bytes.
                unsafe { std::ptr::copy_nonoverlapping(hdr.add(8), self.buf.as_mut_ptr(), len) };
            } else {
                let len = len.min(CHUNK).min(size - off);
                // SAFETY: len <= CHUNK (the data area) and off + len <= size (`buf`).
                unsafe {
                    std::ptr::copy_nonoverlapping(self.data(dir, slot), self.buf.as_mut_ptr().add(off), len)
                };
                off += len;
            }
            self.pos = expect;
            self.word(dir, CONSUMED_OFF).store(self.pos, Ordering::SeqCst);
            let tx_flag = self.word(dir, TX_SLEEP_OFF);
            if tx_flag.load(Ordering::SeqCst) != 0 {
                futex_wake(self.word(dir, CONSUMED_OFF));
            }
        }
        Ok(())
    }
}

impl Transport for Floor {
    fn prepare(&mut self, size: usize) -> Result<()> {
        ensure_len(&mut self.buf, size.max(8));
        Ok(())
    }

    crate::transport::lockstep_transport!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn piece_counts() {
        assert_eq!(pieces(1), 1);
        assert_eq!(pieces(INLINE), 1);
        assert_eq!(pieces(INLINE + 1), 1);
        assert_eq!(pieces(CHUNK), 1);
        assert_eq!(pieces(CHUNK + 1), 2);
        assert_eq!(pieces(1 << 20), 32);
    }

    fn pattern(seed: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i.wrapping_mul(31) ^ seed) as u8).collect()
    }

    /// Bytes arrive intact and in order through inline, single-piece and multi-piece
    /// messages, and the ring wraps many times.
    #[test]
    fn data_arrives_intact() {
        let fd = memfd(c"floor-test", REGION_LEN).unwrap();
        let theirs = fd.try_clone().unwrap();
        let mut a = Floor::new(SharedMap::shared(fd.as_raw_fd(), REGION_LEN, 0).unwrap(), 0);
        let sizes = [1usize, 8, INLINE, INLINE + 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, (SLOTS + 3) * CHUNK];
        let peer = std::thread::spawn(move || {
            let mut b = Floor::new(SharedMap::shared(theirs.as_raw_fd(), REGION_LEN, 0).unwrap(), 1);
            for round in 0..3 {
                for (i, &s) in sizes.iter().enumerate() {
                    b.buf = vec![0; s];
                    b.recv(s).unwrap();
                    assert_eq!(b.buf, pattern(i + round, s), "size {s}");
                    b.buf = pattern(i + 100, s);
                    b.send(s).unwrap();
                }
            }
        });
        for round in 0..3 {
            for (i, &s) in sizes.iter().enumerate() {
                a.buf = pattern(i + round, s);
                a.send(s).unwrap();
                a.buf = vec![0; s];
                a.recv(s).unwrap();
                assert_eq!(a.buf, pattern(i + 100, s), "reply size {s}");
            }
        }
        peer.join().unwrap();
    }

    /// With no spin budget every wait sleeps on the futex: wake-ups must never be
    /// lost (a lost one would show up as a 10 ms stall per message).
    #[test]
    fn futex_sleep_path_loses_no_wakeups() {
        let fd = memfd(c"floor-test", REGION_LEN).unwrap();
        let theirs = fd.try_clone().unwrap();
        let mut a = Floor::new(SharedMap::shared(fd.as_raw_fd(), REGION_LEN, 0).unwrap(), 0);
        a.spin = Duration::ZERO;
        let peer = std::thread::spawn(move || {
            let mut b = Floor::new(SharedMap::shared(theirs.as_raw_fd(), REGION_LEN, 0).unwrap(), 1);
            b.spin = Duration::ZERO;
            b.prepare(CHUNK * 2).unwrap();
            b.pong_batch(8, 300).unwrap();
            b.stream_recv(CHUNK * 2, 200).unwrap();
        });
        a.prepare(CHUNK * 2).unwrap();
        let t = Instant::now();
        a.pong_batch(8, 0).unwrap();
        for _ in 0..300 {
            a.ping(8).unwrap();
        }
        a.stream_send(CHUNK * 2, 200).unwrap();
        peer.join().unwrap();
        assert!(t.elapsed() < Duration::from_secs(2), "took {:?}: lost wake-ups", t.elapsed());
    }

    /// Both ends in one process on two threads over one mapping.
    #[test]
    fn ping_pong_and_stream_between_threads() {
        let spec = SpinFloor;
        let p = spec.listen().unwrap();
        let fd = p.peer_fds.into_iter().next().unwrap();
        let mut a = (p.finish)().unwrap();
        let peer = std::thread::spawn(move || {
            let mut b = SpinFloor.connect(&[], vec![fd]).unwrap();
            for &s in &[8usize, 56, 57, 4096, CHUNK + 3, 1 << 20] {
                b.prepare(s).unwrap();
                b.pong_batch(s, 50).unwrap();
            }
            b.prepare(100_000).unwrap();
            b.stream_recv(100_000, 200).unwrap()
        });
        let clock = crate::clock::Clock::new();
        let mut samples = Vec::new();
        for &s in &[8usize, 56, 57, 4096, CHUNK + 3, 1 << 20] {
            a.prepare(s).unwrap();
            a.ping_batch(s, 50, &clock, &mut samples).unwrap();
        }
        a.prepare(100_000).unwrap();
        a.stream_send(100_000, 200).unwrap();
        assert_eq!(peer.join().unwrap(), 100_000 * 200);
        assert_eq!(samples.len(), 300);
    }
}
