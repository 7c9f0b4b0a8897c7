//! The data area of the loom models: 8-byte words of loom atomics, with relaxed
//! loads and stores for the payload, so loom lets a payload read see any older value
//! unless the ring's release/acquire publication orders it.

// Each model uses its own subset.
#![allow(dead_code)]

use loom::sync::atomic::{AtomicU64, Ordering};
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
