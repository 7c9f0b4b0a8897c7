//! Model check (loom) of the byte-stream ring (`strait_shm::stream`), the ring that
//! carries `strait run`'s TCP connections; run by the test command as
//! `RUSTFLAGS="--cfg loom" cargo test -p strait-shm --release --test loom_stream`.
//!
//! The data area is one loom atomic per byte with relaxed loads and stores, so loom
//! lets a read see any older value of a byte unless the positions' release/acquire
//! orders it. Checked: bytes arrive once, in order and intact across wrap-around
//! whatever the split of writes and reads; no lost wake-up of a consumer waiting for
//! bytes or of a producer waiting for room. Each property has a broken variant of
//! the protocol (publishing before copying, handing space back before copying it
//! out, sleeping without the fence) that the model must catch, or it proves nothing.
#![cfg(loom)]

mod loom_mem;

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;
use strait_shm::ring::ByteArea;
use strait_shm::stream::ByteRing;

/// The data area, a loom atomic per byte.
struct LoomBytes(Vec<AtomicU64>);

impl ByteArea for LoomBytes {
    fn size(&self) -> usize {
        self.0.len()
    }
    unsafe fn store(&self, offset: usize, src: &[u8]) {
        for (i, &b) in src.iter().enumerate() {
            self.0[offset + i].store(b as u64, Ordering::Relaxed);
        }
    }
    unsafe fn load(&self, offset: usize, dst: &mut [u8]) {
        for (i, b) in dst.iter_mut().enumerate() {
            *b = self.0[offset + i].load(Ordering::Relaxed) as u8;
        }
    }
}

type Shared = loom_mem::Shared<LoomBytes>;

impl Shared {
    fn new(size: usize) -> Arc<Shared> {
        Shared::with(LoomBytes((0..size).map(|_| AtomicU64::new(0)).collect()))
    }
    fn ring(&self) -> ByteRing<'_, LoomBytes> {
        ByteRing::new(&self.tail, &self.head, &self.mem)
    }
}

/// The stream: bytes 1, 2, 3, ... (never 0, the area's initial value).
fn byte(i: usize) -> u8 {
    (i % 250 + 1) as u8
}

#[derive(Clone, Copy, PartialEq)]
enum Protocol {
    Correct,
    /// The producer publishes the tail before it copies the bytes in.
    PublishBeforeCopy,
    /// The consumer hands the space back before it copies the bytes out.
    ReleaseBeforeCopy,
    /// Correct, with the producer trusting the head it last read while that shows
    /// enough room (`writable_from`, as `strait run`'s writer does).
    CachedHead,
}

/// Writes `writes` (chunk sizes) through a ring of `size` bytes while the consumer
/// reads at most `read_max` at a time; every byte must arrive once, in order.
fn stream(size: usize, writes: &'static [usize], read_max: usize, protocol: Protocol) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.check(move || {
        let s = Shared::new(size);
        let total: usize = writes.iter().sum();
        let sp = s.clone();
        let prod = thread::spawn(move || {
            let r = sp.ring();
            let mut sent = 0;
            let mut seen = 0u64;
            for &w in writes {
                let mut left = w;
                while left > 0 {
                    let span = match r.writable_from(seen) {
                        Ok(s) if protocol == Protocol::CachedHead && s.len as usize >= left => s,
                        _ => {
                            let s = r.writable().expect("honest consumer");
                            seen = s.end() - size as u64;
                            s
                        }
                    };
                    let n = (span.len as usize).min(left);
                    if n == 0 {
                        thread::yield_now();
                        continue;
                    }
                    let chunk: Vec<u8> = (sent..sent + n).map(byte).collect();
                    if protocol == Protocol::PublishBeforeCopy {
                        r.publish_to(span.pos + n as u64);
                        r.write_at(span.pos, &chunk);
                    } else {
                        r.write_at(span.pos, &chunk);
                        r.publish_to(span.pos + n as u64);
                    }
                    sent += n;
                    left -= n;
                }
            }
        });
        let r = s.ring();
        let mut got = 0;
        while got < total {
            let span = r.readable().expect("honest producer");
            let n = (span.len as usize).min(read_max);
            if n == 0 {
                thread::yield_now();
                continue;
            }
            let mut out = vec![0u8; n];
            if protocol == Protocol::ReleaseBeforeCopy {
                r.consume_to(span.pos + n as u64);
                r.read_at(span.pos, &mut out);
            } else {
                r.read_at(span.pos, &mut out);
                r.consume_to(span.pos + n as u64);
            }
            for (k, &v) in out.iter().enumerate() {
                assert_eq!(v, byte(got + k), "byte {} torn, lost or out of order", got + k);
            }
            got += n;
        }
        prod.join().unwrap();
    });
}

/// Nine bytes through a 4-byte ring in writes of 3, 4 and 2 (both wrap), reads of
/// at most 3: the producer waits for room, the consumer for bytes.
#[test]
fn bytes_arrive_once_in_order_across_wrap() {
    stream(4, &[3, 4, 2], 3, Protocol::Correct);
}

/// The same with a producer that reads the consumer's head only when the head it
/// saw last shows too little room: what it writes is always free.
#[test]
fn bytes_arrive_once_in_order_with_a_cached_head() {
    stream(4, &[1, 1, 2, 3, 2], 3, Protocol::CachedHead);
}

#[test]
#[should_panic(expected = "torn, lost or out of order")]
fn broken_publish_before_copy_is_caught() {
    stream(4, &[2, 2], 2, Protocol::PublishBeforeCopy);
}

#[test]
#[should_panic(expected = "torn, lost or out of order")]
fn broken_release_before_copy_is_caught() {
    stream(2, &[2, 2], 2, Protocol::ReleaseBeforeCopy);
}

/// The consumer announces sleep and re-checks; the producer publishes and rings.
fn consumer_wakeup(fenced: bool) {
    loom_mem::consumer_wakeup(
        fenced,
        || Shared::new(4),
        |s| &s.consumer_sleeps,
        |s| {
            let r = s.ring();
            let span = r.writable().unwrap();
            r.write_at(span.pos, &[7]);
            r.publish_to(span.pos + 1);
        },
        |s| s.ring().readable().unwrap().len > 0,
        |s| s.tail.load(Ordering::Relaxed) != 0,
        "published bytes",
    );
}

#[test]
fn no_lost_wakeup_for_a_consumer_waiting_for_bytes() {
    consumer_wakeup(true);
}

#[test]
#[should_panic(expected = "lost wake-up")]
fn broken_sleep_without_fences_loses_a_wakeup() {
    consumer_wakeup(false);
}

/// The producer finds the ring full, announces and re-checks; the consumer reads and
/// rings.
#[test]
fn no_lost_wakeup_for_a_producer_waiting_for_room() {
    loom_mem::producer_wakeup(
        || {
            let s = Shared::new(2);
            let r = s.ring();
            r.write_at(0, &[1, 2]);
            r.publish_to(2);
            assert_eq!(r.writable().unwrap().len, 0);
            (s, ())
        },
        |s| &s.producer_sleeps,
        |s| {
            let r = s.ring();
            let span = r.readable().unwrap();
            let mut out = [0u8; 1];
            r.read_at(span.pos, &mut out);
            r.consume_to(span.pos + 1);
        },
        |s, _| s.ring().writable().unwrap().len > 0,
    );
}
