//! Model check (loom) of the shm ring and its sleep/wake doorbell, run by the test
//! command as `RUSTFLAGS="--cfg loom" cargo test -p strait-shm --release --test loom_ring`.
//!
//! It drives the real `strait_shm::ring` code (compiled against loom's atomics) over
//! a data area of loom atomics (relaxed loads and stores for the payload, so loom
//! lets a payload read see any older value unless the header's release/acquire
//! orders it), and explores every interleaving and every weak-memory outcome it
//! models for:
//! * frames arrive complete, once, in order, across wrap-around and padding, and
//!   stale words left from an earlier lap are never taken for a header;
//! * no lost wake-up: a consumer that decides to sleep is woken by the producer's
//!   doorbell, and a producer sleeping on a full ring is woken by the consumer;
//! * the same wake-up protocol without its fences loses a wake-up (the model must
//!   catch the broken variant, or it proves nothing).
#![cfg(loom)]

mod loom_mem;
use loom_mem::LoomMem;

use loom::sync::atomic::Ordering;
use loom::sync::Arc;
use loom::thread;
use strait_shm::ring::{ByteArea, Consumer, Producer, RingMemory};

type Shared = loom_mem::Shared<LoomMem>;

impl Shared {
    fn new(size: usize) -> Arc<Shared> {
        Shared::with(LoomMem::new(size))
    }
}

fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| (i * 31 + k) as u8).collect()
}

fn try_push(p: &mut Producer, s: &Shared, data: &[u8]) -> bool {
    match p.reserve(&s.head, data.len()).expect("honest consumer") {
        Some(slot) => {
            // SAFETY: the slot is reserved for the producer.
            unsafe { s.mem.store(slot.offset, data) };
            p.commit(&s.mem, slot);
            true
        }
        None => false,
    }
}

fn try_pop(c: &mut Consumer, s: &Shared) -> Option<Vec<u8>> {
    let slot = c.peek(&s.mem).expect("honest producer")?;
    let mut v = vec![0; slot.len];
    // SAFETY: the slot was published and not yet released.
    unsafe { s.mem.load(slot.offset, &mut v) };
    c.release(slot);
    c.publish(&s.head, &s.mem);
    Some(v)
}

/// Frames of `sizes` (frame `i` is `payload(i, len)`) from a producer thread through
/// a ring of `ring` bytes, the producer waiting for room: every byte read must be
/// ordered after its write (loom's cell checking), and the consumer must get every
/// frame intact and in order.
fn frames_through(ring: usize, sizes: &'static [usize]) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(move || {
        let s = Shared::new(ring);
        let sp = s.clone();
        let prod = thread::spawn(move || {
            let mut p = Producer::new(ring);
            for (i, &len) in sizes.iter().enumerate() {
                while !try_push(&mut p, &sp, &payload(i, len)) {
                    thread::yield_now();
                }
            }
        });
        let mut c = Consumer::new(ring);
        let mut got = 0;
        while got < sizes.len() {
            match try_pop(&mut c, &s) {
                Some(v) => {
                    assert_eq!(v, payload(got, sizes[got]), "frame {got} stale, torn or out of order");
                    got += 1;
                }
                None => thread::yield_now(),
            }
        }
        prod.join().unwrap();
    });
}

/// Five frames through a 512-byte ring (eight cells; one frame of one cell, then
/// frames of two): the fifth needs padding and wraps onto cells that held the first
/// frames, and the producer must wait for room.
#[test]
fn frames_arrive_whole_and_in_order_across_wrap() {
    frames_through(512, &[8, 72, 72, 72, 72]);
}

/// Five one-cell frames through a four-cell ring: the consumer reaches the wrapped
/// cell 0 while it may still hold the first lap's words, and must wait there for
/// the new frame instead of taking stale words for one.
#[test]
fn stale_cells_from_an_earlier_lap_are_never_read_as_frames() {
    frames_through(256, &[8; 5]);
}

/// The consumer announces sleep and re-checks; the producer publishes and rings.
/// If the consumer went to sleep, the producer must have seen its flag.
fn consumer_wakeup(fenced: bool) {
    loom_mem::consumer_wakeup(
        fenced,
        || Shared::new(256),
        |s| &s.consumer_sleeps,
        |s| assert!(try_push(&mut Producer::new(256), s, &[7; 8])),
        |s| Consumer::new(256).has_data(&s.mem),
        |s| s.mem.header(0).load(Ordering::Relaxed) != 0,
        "a published frame",
    );
}

#[test]
fn no_lost_wakeup_for_a_sleeping_consumer() {
    consumer_wakeup(true);
}

#[test]
#[should_panic(expected = "lost wake-up")]
fn broken_doorbell_without_fences_loses_a_wakeup() {
    consumer_wakeup(false);
}

/// A producer finds the ring full, announces sleep and re-checks for room; the
/// consumer frees a frame and rings. If the producer sleeps, it must be woken.
#[test]
fn no_lost_wakeup_for_a_producer_waiting_for_room() {
    loom_mem::producer_wakeup(
        || {
            let s = Shared::new(256);
            let mut p = Producer::new(256);
            for i in 0..4 {
                assert!(try_push(&mut p, &s, &payload(i, 8)));
            }
            assert!(!try_push(&mut p, &s, &payload(4, 8)));
            (s, p)
        },
        |s| &s.producer_sleeps,
        |s| assert_eq!(try_pop(&mut Consumer::new(256), s).unwrap(), payload(0, 8)),
        |s, p| p.has_room(&s.head, 8).unwrap(),
    );
}
