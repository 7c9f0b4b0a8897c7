//! Model check (loom) of the datagram ring (`strait_shm::dgram`), the ring that
//! carries `strait run`'s UDP datagrams; run by the test command as
//! `RUSTFLAGS="--cfg loom" cargo test -p strait-shm --release --test loom_dgram`.
//!
//! The data area is loom atomic words with relaxed payload loads and stores. Checked,
//! over every interleaving loom explores: with one producer and two consumers
//! sharing the ring (threads, or processes that inherited the socket), every
//! datagram is taken exactly once, whole, and each consumer sees them in order,
//! across wrap records. The broken variant (claim the record, then copy it out)
//! must be caught.
#![cfg(loom)]

mod loom_mem;
use loom_mem::LoomMem;

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;
use strait_shm::dgram::{DgramRing, Pushed};
use strait_shm::ring::{ByteArea, WordArea};

struct Shared {
    mem: LoomMem,
    tail: AtomicU64,
    head: AtomicU64,
}

/// Datagram `i`: one word holding `i + 1` (never 0, the area's initial value).
fn datagram(i: u64) -> [u8; 8] {
    (i + 1).to_le_bytes()
}

/// Takes one datagram (`claim_first`: the broken order).
fn take(s: &Shared, claim_first: bool) -> Option<u64> {
    let r = DgramRing::new(&s.tail, &s.head, &s.mem);
    if !claim_first {
        let mut out = [0u8; 8];
        let n = r.take(false, |m, off, len| DgramRing::load(m, off, &mut out[..len])).expect("honest")?;
        assert_eq!(n, 8);
        return Some(u64::from_le_bytes(out) - 1);
    }
    // Broken: claim the record at the head, then copy it out (the producer may
    // already be reusing the space).
    loop {
        let head = s.head.load(Ordering::Acquire);
        let tail = s.tail.load(Ordering::Acquire);
        if head == tail {
            return None;
        }
        let off = (head % s.mem.size() as u64) as usize;
        let w = s.mem.word(off).load(Ordering::Relaxed);
        if w >> 32 == 1 {
            let _ = s.head.compare_exchange(
                head,
                head + (s.mem.size() - off) as u64,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
            continue;
        }
        if s.head.compare_exchange(head, head + 16, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            let mut out = [0u8; 8];
            DgramRing::load(&s.mem, off + 8, &mut out);
            return Some(u64::from_le_bytes(out).wrapping_sub(1));
        }
    }
}

/// One consumer: a bounded number of looks (loom explores bounded programs), in
/// increasing order.
fn consume(s: &Shared, n: u64, claim_first: bool, looks: usize) -> Vec<u64> {
    let mut got: Vec<u64> = Vec::new();
    for _ in 0..looks {
        match take(s, claim_first) {
            Some(v) => {
                assert!(v < n, "datagram torn: read {v}");
                assert!(got.last().is_none_or(|&l| v > l), "datagram {v} after {got:?}: out of order");
                got.push(v);
            }
            None => thread::yield_now(),
        }
    }
    got
}

/// `n` one-word datagrams through a ring of `words` words; one producer (which drops
/// a datagram it finds no room for after two looks, as the preload does), two
/// consumers, then a final drain. Every datagram sent is taken exactly once, whole,
/// each consumer's in increasing order.
fn run(words: usize, n: u64, claim_first: bool) {
    run_with(words, n, claim_first, false)
}

/// [`run`], with a producer that trusts the head it last read while that shows room
/// (`push_from`, as the preload's sender does) when `cached_head`.
fn run_with(words: usize, n: u64, claim_first: bool, cached_head: bool) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.check(move || {
        let s = Arc::new(Shared {
            mem: LoomMem::new(words * 8),
            tail: AtomicU64::new(0),
            head: AtomicU64::new(0),
        });
        let sp = s.clone();
        let prod = thread::spawn(move || {
            let r = DgramRing::new(&sp.tail, &sp.head, &sp.mem);
            let mut sent = Vec::new();
            let mut seen = 0u64;
            for i in 0..n {
                for _ in 0..2 {
                    let d = datagram(i);
                    let fill = |m: &LoomMem, off: usize| DgramRing::store(m, off, &d);
                    let pushed = if cached_head { r.push_from(&mut seen, 8, fill) } else { r.push(8, fill) };
                    match pushed.expect("honest") {
                        Pushed::Sent => {
                            sent.push(i);
                            break;
                        }
                        Pushed::Full => thread::yield_now(),
                    }
                }
            }
            sent
        });
        let sc = s.clone();
        let other = thread::spawn(move || consume(&sc, n, claim_first, 2));
        let mut got = consume(&s, n, claim_first, 2);
        got.extend(other.join().unwrap());
        let sent = prod.join().unwrap();
        got.extend(consume(&s, n, claim_first, n as usize + 1));
        got.sort_unstable();
        assert_eq!(got, sent, "datagram torn, lost or taken twice");
    });
}

/// Three datagrams of 16 bytes (header + one word) through a 40-byte ring: the
/// second lap starts with a wrap record.
#[test]
fn every_datagram_exactly_once_with_two_consumers() {
    run(5, 3, false);
}

/// The same with the producer's cached head: space it reuses is always free.
#[test]
fn every_datagram_exactly_once_with_a_cached_head() {
    run_with(5, 3, false, true);
}

#[test]
#[should_panic(expected = "datagram torn, lost or taken twice")]
fn broken_claim_before_copy_is_caught() {
    run(4, 3, true);
}
