//! The data area of the loom models: 8-byte words of loom atomics, with relaxed
//! loads and stores for the payload, so loom lets a payload read see any older value
//! unless the ring's release/acquire publication orders it.

// Each model uses its own subset.
#![allow(dead_code)]

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;
use strait_shm::ring::{announce_sleep, peer_needs_wake, withdraw_sleep, ByteArea, WordArea};

/// A data area of loom atomic words.
pub struct LoomMem(pub Vec<AtomicU64>);

impl LoomMem {
    /// `size` bytes (a multiple of 8), zeroed.
    pub fn new(size: usize) -> Self {
        LoomMem((0..size / 8).map(|_| AtomicU64::new(0)).collect())
    }
}

impl WordArea for LoomMem {
    fn word(&self, offset: usize) -> &AtomicU64 {
        &self.0[offset / 8]
    }
}

impl ByteArea for LoomMem {
    fn size(&self) -> usize {
        self.0.len() * 8
    }
    unsafe fn store(&self, offset: usize, src: &[u8]) {
        assert!(offset.is_multiple_of(8) && src.len().is_multiple_of(8), "model payloads are whole words");
        for (i, w) in src.chunks(8).enumerate() {
            self.0[offset / 8 + i].store(u64::from_le_bytes(w.try_into().unwrap()), Ordering::Relaxed);
        }
    }
    unsafe fn load(&self, offset: usize, dst: &mut [u8]) {
        for (i, w) in dst.chunks_mut(8).enumerate() {
            w.copy_from_slice(&self.0[offset / 8 + i].load(Ordering::Relaxed).to_le_bytes());
        }
    }
}

/// A ring's shared state in a model: its data area, its positions (the frame ring
/// keeps its tail in the frame headers and leaves `tail` at 0) and both sides'
/// sleep flags.
pub struct Shared<M> {
    pub mem: M,
    pub tail: AtomicU64,
    pub head: AtomicU64,
    pub consumer_sleeps: AtomicU64,
    pub producer_sleeps: AtomicU64,
}

impl<M> Shared<M> {
    /// The state over `mem`, positions and flags at 0.
    pub fn with(mem: M) -> Arc<Self> {
        Arc::new(Shared {
            mem,
            tail: AtomicU64::new(0),
            head: AtomicU64::new(0),
            consumer_sleeps: AtomicU64::new(0),
            producer_sleeps: AtomicU64::new(0),
        })
    }
}

/// The waking side of the doorbell, once it has published (or freed room): whether
/// it rings, having seen the sleeper's `flag`. `fenced` false is the broken variant
/// (a relaxed swap, no fence) the models must catch.
pub fn rings(fenced: bool, flag: &AtomicU64) -> bool {
    if fenced {
        peer_needs_wake(flag)
    } else {
        flag.swap(0, Ordering::Relaxed) != 0
    }
}

/// The sleeping side: announces its sleep in `flag`, then checks `ready` again and
/// withdraws if it is; returns whether it goes to sleep.
pub fn sleeps_after_check(flag: &AtomicU64, ready: impl FnOnce() -> bool) -> bool {
    announce_sleep(flag);
    let ready = ready();
    if ready {
        withdraw_sleep(flag);
    }
    !ready
}

/// The no-lost-wake-up model of a sleeping consumer: another thread runs `publish`
/// on the state `shared()` makes, then decides whether to ring ([`rings`]); the
/// consumer decides whether to sleep: with the fences it announces its sleep in
/// `flag` and checks `ready` again ([`sleeps_after_check`]); without them (`fenced`
/// false, the broken variant) it stores its flag relaxed and checks `ready_relaxed`.
/// Fails with "lost wake-up: the consumer sleeps on `what`" if it sleeps unrung.
pub fn consumer_wakeup<S: Send + Sync + 'static>(
    fenced: bool,
    shared: fn() -> Arc<S>,
    flag: fn(&S) -> &AtomicU64,
    publish: fn(&S),
    ready: fn(&S) -> bool,
    ready_relaxed: fn(&S) -> bool,
    what: &'static str,
) {
    loom::model(move || {
        let s = shared();
        let sp = s.clone();
        let prod = thread::spawn(move || {
            publish(&sp);
            rings(fenced, flag(&sp))
        });
        let slept = if fenced {
            sleeps_after_check(flag(&s), || ready(&s))
        } else {
            flag(&s).store(1, Ordering::Relaxed);
            !ready_relaxed(&s)
        };
        let woke = prod.join().unwrap();
        assert!(!slept || woke, "lost wake-up: the consumer sleeps on {what}");
    });
}

/// The no-lost-wake-up model of a producer waiting for room: `full()` makes the
/// state, its ring full, and the producer; another thread runs `free` (takes a
/// message out) and rings if the producer's `flag` says it sleeps; the producer
/// announces its sleep and checks `room` again ([`sleeps_after_check`]). Fails with
/// "lost wake-up: the producer sleeps on free room" if it sleeps unrung.
pub fn producer_wakeup<S: Send + Sync + 'static, P: 'static>(
    full: fn() -> (Arc<S>, P),
    flag: fn(&S) -> &AtomicU64,
    free: fn(&S),
    room: fn(&S, &mut P) -> bool,
) {
    loom::model(move || {
        let (s, mut p) = full();
        let sc = s.clone();
        let cons = thread::spawn(move || {
            free(&sc);
            peer_needs_wake(flag(&sc))
        });
        let slept = sleeps_after_check(flag(&s), || room(&s, &mut p));
        let woke = cons.join().unwrap();
        assert!(!slept || woke, "lost wake-up: the producer sleeps on free room");
    });
}
