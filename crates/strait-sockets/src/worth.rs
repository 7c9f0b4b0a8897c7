//! Whether a new connection is worth its shared-memory setup.
//!
//! Setting a connection up on shared memory costs both ends tens of system calls
//! and a wake-up more than the kernel's `connect`/`accept` (PERFORMANCE.md 23 and
//! 30: ~100 us a connection on a 2-vCPU VM, against ~50 us for the whole kernel
//! exchange). A connection that carries one request and its answer and closes (HTTP
//! with `Connection: close`, `redis-benchmark -k 0`, health checks) never wins that
//! back: under strait it ran at a third of the kernel's rate. So a connector learns,
//! per destination (the listener's address and port), how much its connections
//! carried: when the last [`SHORT_RUN`] connections set up to a destination each
//! carried at most [`Settings::setup_min_ops`] reads and writes with data, or fell
//! back to the kernel (their acceptor never attached: the setup bought nothing), new
//! connections to it stay on the kernel path from their `connect` on (not one extra
//! system call), except samples, set up as before to see whether the destination's
//! connections still are that short: the [`SAMPLE_EVERY`]th, then at intervals that
//! double up to [`SAMPLE_MAX`] (so the samples' setup costs next to nothing in the
//! long run). One connection that
//! carried more makes every connection to it accelerated again.
//!
//! The decision is the connector's alone, made before anything is sent: the
//! acceptor needs no word of it (a connection without a hello stays on the kernel,
//! as one from a program not under strait does). `STRAIT_SETUP=always` sets every
//! connection up, as before. The history is this process's, in its own memory (a
//! forked child starts with a copy), bounded to [`MAX_DESTINATIONS`].
//!
//! The rule is written as a state machine without a clock ([`History`]), so tests
//! drive it directly and a run is deterministic.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::settings::Settings;
use crate::sock::Key;

/// Consecutive short accelerated connections to a destination before new ones
/// stay on the kernel.
pub const SHORT_RUN: u32 = 4;

/// While a destination's connections are short, one in this many is still set up
/// on shared memory at first (a sample: is the destination still short?); each
/// sample taken doubles the interval, up to [`SAMPLE_MAX`].
pub const SAMPLE_EVERY: u32 = 16;

/// The longest interval between samples: a destination whose connections became
/// long is found again within this many connections.
pub const SAMPLE_MAX: u32 = 512;

/// Destinations remembered; the table is emptied when full (every destination is
/// then learned again, from accelerated connections).
pub const MAX_DESTINATIONS: usize = 1024;

/// Connections the connector left on the kernel path because connections to their
/// destination were too short to pay for the setup (`--stats`: `kernel-short`).
pub static KERNEL_SHORT: AtomicU64 = AtomicU64::new(0);

/// What to do with a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    /// Set it up on shared memory.
    SharedMemory,
    /// Leave it to the kernel.
    Kernel,
}

/// What is known of one destination.
#[derive(Debug, Default, Clone, Copy)]
struct Destination {
    /// Accelerated connections in a row, most recent last, that carried at most
    /// the threshold.
    short_run: u32,
    /// Connections left on the kernel since the last sample.
    since_sample: u32,
    /// Connections between samples now (0: [`SAMPLE_EVERY`]).
    interval: u32,
}

/// The per-destination history and rule (no clock, no I/O).
#[derive(Debug, Default)]
pub struct History {
    by_dest: HashMap<Key, Destination>,
}

impl History {
    /// The decision for a new connection to `dest`.
    pub fn decide(&mut self, dest: Key) -> Setup {
        let Some(d) = self.by_dest.get_mut(&dest) else { return Setup::SharedMemory };
        if d.short_run < SHORT_RUN {
            return Setup::SharedMemory;
        }
        let interval = d.interval.max(SAMPLE_EVERY);
        d.since_sample += 1;
        if d.since_sample >= interval {
            d.since_sample = 0;
            d.interval = (interval * 2).min(SAMPLE_MAX);
            return Setup::SharedMemory;
        }
        Setup::Kernel
    }

    /// An accelerated connection to `dest` ended having carried `ops` reads and
    /// writes with data; `min_ops` is the most a connection may carry and still
    /// count as short.
    pub fn record(&mut self, dest: Key, ops: u32, min_ops: u32) {
        if !self.by_dest.contains_key(&dest) && self.by_dest.len() >= MAX_DESTINATIONS {
            self.by_dest.clear();
        }
        let d = self.by_dest.entry(dest).or_default();
        if ops <= min_ops {
            d.short_run = d.short_run.saturating_add(1);
        } else {
            *d = Destination::default();
        }
    }
}

static HISTORY: Mutex<Option<History>> = Mutex::new(None);

fn with_history<T>(f: impl FnOnce(&mut History) -> T) -> T {
    let mut g = HISTORY.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(History::default))
}

/// Before a connect to `dest` on this host: whether to set it up on shared memory
/// (always, with `STRAIT_SETUP=always`). A connection left to the kernel is counted.
pub fn connect_wanted(dest: Key) -> bool {
    let s = Settings::get();
    if !s.setup_adaptive {
        return true;
    }
    match with_history(|h| h.decide(dest)) {
        Setup::SharedMemory => true,
        Setup::Kernel => {
            KERNEL_SHORT.fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}

/// A connection this process set up to `dest` ended here, having carried `ops`
/// reads and writes with data in this process (0 if it fell back to the kernel).
pub fn connection_ended(dest: Key, ops: u32) {
    let s = Settings::get();
    if s.setup_adaptive {
        with_history(|h| h.record(dest, ops, s.setup_min_ops));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Key = ([1; 16], 80);
    const B: Key = ([1; 16], 81);
    const MIN: u32 = 8;

    #[test]
    fn an_unknown_destination_is_set_up() {
        let mut h = History::default();
        assert_eq!(h.decide(A), Setup::SharedMemory);
    }

    #[test]
    fn short_connections_move_their_destination_to_the_kernel_with_samples() {
        let mut h = History::default();
        for i in 0..SHORT_RUN {
            assert_eq!(h.decide(A), Setup::SharedMemory, "connection {i}: not enough known yet");
            h.record(A, MIN, MIN);
        }
        // Samples at intervals of SAMPLE_EVERY, doubling, up to SAMPLE_MAX.
        let mut at = Vec::new();
        for i in 1..=4 * SAMPLE_MAX {
            if h.decide(A) == Setup::SharedMemory {
                at.push(i);
            }
        }
        let gaps: Vec<u32> = at.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(at[0], SAMPLE_EVERY);
        let mut want = SAMPLE_EVERY;
        for g in gaps {
            want = (want * 2).min(SAMPLE_MAX);
            assert_eq!(g, want);
        }
        assert!(at.len() >= 6, "{at:?}");
        // Another destination is not affected.
        assert_eq!(h.decide(B), Setup::SharedMemory);
    }

    #[test]
    fn one_long_connection_sets_every_connection_up_again() {
        let mut h = History::default();
        for _ in 0..SHORT_RUN {
            h.record(A, 2, MIN);
        }
        assert_eq!(h.decide(A), Setup::Kernel);
        // A sample (or a connection opened before the run) carried more.
        h.record(A, MIN + 1, MIN);
        for _ in 0..SAMPLE_MAX {
            assert_eq!(h.decide(A), Setup::SharedMemory);
        }
        // And it takes a whole run of short ones to go back.
        for _ in 0..SHORT_RUN - 1 {
            h.record(A, 1, MIN);
            assert_eq!(h.decide(A), Setup::SharedMemory);
        }
        h.record(A, 1, MIN);
        assert_eq!(h.decide(A), Setup::Kernel);
    }

    #[test]
    fn the_table_is_bounded() {
        let mut h = History::default();
        for port in 0..(MAX_DESTINATIONS as u16 + 10) {
            h.record(([2; 16], port), 0, MIN);
        }
        assert!(h.by_dest.len() <= MAX_DESTINATIONS);
    }
}
