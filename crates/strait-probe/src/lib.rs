//! Stage probes for strait's own message path (`strait anatomy`).
//!
//! A probe is a time-stamp-counter read plus a push into a per-thread log, placed at
//! one point of the path (API post, engine, device commit, peer poll, match, copy,
//! completion). Probes cost nothing unless both switches are on:
//!
//! - **compile time**: the cargo feature `enabled` of this crate (turned on by the
//!   `probes` features of `strait-core`, `strait-shm` and `strait`). Without it,
//!   [`probe!`] expands to nothing: its argument is not even evaluated.
//! - **run time**: [`set_enabled`] (or `STRAIT_PROBES=1` read by [`init_from_env`]);
//!   while off, a compiled-in probe is one relaxed load and a not-taken branch.
//!
//! Stamps are raw counter ticks ([`now`]); the reader converts them to nanoseconds
//! with its own calibration (strait-anatomy's `Clock`, which reads the same counter).
//! Each thread logs into its own preallocated buffer ([`start_log`]); a full log
//! drops stamps (counted) instead of allocating on the message path.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};

/// True when the probes are compiled in (the `enabled` feature).
pub const COMPILED: bool = cfg!(feature = "enabled");

/// The environment variable that turns the probes on at run time (`1`).
pub const ENV: &str = "STRAIT_PROBES";

/// A point of the message path. The numbering is part of no format: logs are read
/// by the same build that wrote them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Stage {
    /// `Engine::post_send` entered (a `Worker`'s too).
    SendPost = 0,
    /// `Engine::post_recv` entered (a `Worker`'s too).
    RecvPost,
    /// The engine is about to write a message's first frame (eager data or RTS),
    /// after the API checks, credit accounting and queueing decisions.
    TxMsg,
    /// The device reserved a frame and filled it; the commit store follows (the
    /// reliability layer: the frame's packets are built, headers and checksums
    /// included, and go to the link next).
    DevFilled,
    /// The device's doorbell call started.
    DoorbellBegin,
    /// The device's doorbell call returned.
    DoorbellEnd,
    /// The device's receive poll found a frame (the reliability layer: its link
    /// handed over a data packet, before any check).
    RxFound,
    /// The engine matched a message (eager data or RTS) to a posted receive.
    RxMatch,
    /// The engine decoded the last DATA frame of a rendezvous transfer.
    RxLastData,
    /// The copy into the user's buffer is done (eager, or last rendezvous chunk).
    CopyDone,
    /// A receive completion was pushed on the completion queue.
    CqPushRecv,
    /// `Engine::poll` (inside `Worker::poll`) is returning a receive completion to
    /// the application.
    PollRecv,
    /// `strait run` path (the interposer): the application is about to call
    /// `write` (stamped by the measuring program, through the library's log).
    AppSend,
    /// The interposer's `write` was entered.
    WriteEnter,
    /// The interposer found the descriptor's accelerated connection (table look-up
    /// and the checks of a settled connection done).
    WriteLookup,
    /// The bytes are in the byte ring and its new tail is published.
    RingPublished,
    /// A reader found bytes in its byte ring (after spinning or a wake-up).
    RingFound,
    /// The reader copied the bytes out and handed the space back.
    RingConsumed,
    /// The interposer's `read` is returning to the application.
    ReadReturn,
    /// The application's `read` returned (stamped by the measuring program).
    AppRecvd,
    /// Test and calibration stamps.
    Mark,
}

impl Stage {
    /// Every stage, in numbering order.
    pub const ALL: [Stage; 21] = [
        Stage::SendPost,
        Stage::RecvPost,
        Stage::TxMsg,
        Stage::DevFilled,
        Stage::DoorbellBegin,
        Stage::DoorbellEnd,
        Stage::RxFound,
        Stage::RxMatch,
        Stage::RxLastData,
        Stage::CopyDone,
        Stage::CqPushRecv,
        Stage::PollRecv,
        Stage::AppSend,
        Stage::WriteEnter,
        Stage::WriteLookup,
        Stage::RingPublished,
        Stage::RingFound,
        Stage::RingConsumed,
        Stage::ReadReturn,
        Stage::AppRecvd,
        Stage::Mark,
    ];

    /// The stage with this number, if any.
    pub fn from_u8(v: u8) -> Option<Stage> {
        Stage::ALL.get(v as usize).copied()
    }
}

/// One logged probe: the counter reading and the stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// Counter ticks ([`now`]).
    pub tsc: u64,
    /// Where it was taken.
    pub stage: Stage,
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static DOUBLE: AtomicBool = AtomicBool::new(false);

struct Log {
    stamps: Vec<Stamp>,
    dropped: u64,
}

thread_local! {
    static LOG: RefCell<Log> = const { RefCell::new(Log { stamps: Vec::new(), dropped: 0 }) };
}

/// Turns the (compiled-in) probes on or off for every thread.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Calibration: while on, every probe records a second stamp (as [`Stage::Mark`])
/// right after its own, so that a run with doubled probes minus a normal run gives
/// what the probes cost *on the path itself*, where they overlap other work.
pub fn set_double(on: bool) {
    DOUBLE.store(on, Ordering::Relaxed);
}

/// True while probes record (always false when they are compiled out).
#[inline(always)]
pub fn enabled() -> bool {
    COMPILED && ENABLED.load(Ordering::Relaxed)
}

/// Turns the probes on if `STRAIT_PROBES=1`; returns whether they are on.
pub fn init_from_env() -> bool {
    if std::env::var(ENV).is_ok_and(|v| v == "1") {
        set_enabled(true);
    }
    enabled()
}

/// The time-stamp counter (x86-64: a bare `rdtsc`; elsewhere `CLOCK_MONOTONIC`
/// nanoseconds).
///
/// No fence: measured on the development VM (AMD EPYC), `rdtsc` costs 30 cycles,
/// `lfence; rdtsc` 61 and `rdtscp` 61, and the probe cost is what most distorts
/// short stages. An unfenced read may execute a few dozen cycles away from its
/// place in program order; that moves time between two adjacent stages but not out
/// of their sum (the chain telescopes), and a frame's commit stamp still precedes
/// the peer's "found" stamp because a store becomes visible only after it retires.
#[inline(always)]
pub fn now() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc exists on every x86-64 CPU and touches no memory.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        monotonic_ns()
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn monotonic_ns() -> u64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Logs `stage` now on this thread (if a log was started and has room). Called by
/// [`probe!`] after checking [`enabled`]; callable directly for calibration.
#[inline]
pub fn record(stage: Stage) {
    push(stage);
    if DOUBLE.load(Ordering::Relaxed) {
        push(Stage::Mark);
    }
}

#[inline(always)]
fn push(stage: Stage) {
    let tsc = now();
    LOG.with(|l| {
        // A re-entrant probe (none exists) would find the log borrowed: drop the stamp.
        if let Ok(mut l) = l.try_borrow_mut() {
            if l.stamps.len() < l.stamps.capacity() {
                l.stamps.push(Stamp { tsc, stage });
            } else {
                l.dropped += 1;
            }
        }
    });
}

/// Starts (or restarts) this thread's log with room for `capacity` stamps; this is
/// the only allocation the probes make.
pub fn start_log(capacity: usize) {
    LOG.with(|l| {
        let mut l = l.borrow_mut();
        l.stamps = Vec::with_capacity(capacity);
        l.dropped = 0;
    });
}

/// Empties this thread's log (keeping its room), returning nothing.
pub fn clear_log() {
    LOG.with(|l| {
        let mut l = l.borrow_mut();
        l.stamps.clear();
        l.dropped = 0;
    });
}

/// Takes this thread's stamps (in time order) and the count of stamps dropped for
/// lack of room; the log keeps its room for more.
pub fn take_log() -> (Vec<Stamp>, u64) {
    LOG.with(|l| {
        let mut l = l.borrow_mut();
        let cap = l.stamps.capacity();
        let stamps = std::mem::replace(&mut l.stamps, Vec::with_capacity(cap));
        let dropped = std::mem::take(&mut l.dropped);
        (stamps, dropped)
    })
}

/// Records a stage stamp when probes are compiled in and switched on; expands to
/// nothing otherwise (the arguments are not evaluated). `probe!(if cond => stage)`
/// records only when `cond` holds.
///
/// ```
/// strait_probe::probe!(strait_probe::Stage::Mark);
/// ```
#[cfg(feature = "enabled")]
#[macro_export]
macro_rules! probe {
    (if $cond:expr => $stage:expr) => {
        if $crate::enabled() && $cond {
            $crate::record($stage);
        }
    };
    ($stage:expr) => {
        if $crate::enabled() {
            $crate::record($stage);
        }
    };
}

/// Records a stage stamp when probes are compiled in and switched on; expands to
/// nothing otherwise (the arguments are not evaluated). `probe!(if cond => stage)`
/// records only when `cond` holds.
///
/// ```
/// strait_probe::probe!(strait_probe::Stage::Mark);
/// ```
#[cfg(not(feature = "enabled"))]
#[macro_export]
macro_rules! probe {
    (if $cond:expr => $stage:expr) => {};
    ($stage:expr) => {};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_numbers_round_trip() {
        for (i, s) in Stage::ALL.iter().enumerate() {
            assert_eq!(*s as u8 as usize, i);
            assert_eq!(Stage::from_u8(i as u8), Some(*s));
        }
        assert_eq!(Stage::from_u8(Stage::ALL.len() as u8), None);
    }

    #[test]
    fn log_keeps_order_and_drops_when_full() {
        start_log(3);
        for _ in 0..5 {
            record(Stage::Mark);
        }
        let (s, dropped) = take_log();
        assert_eq!(s.len(), 3);
        assert_eq!(dropped, 2);
        assert!(s.windows(2).all(|w| w[0].tsc <= w[1].tsc));
        let (s, dropped) = take_log();
        assert!(s.is_empty() && dropped == 0);
    }

    #[test]
    fn macro_follows_feature_and_switch() {
        start_log(16);
        set_enabled(false);
        probe!(Stage::Mark);
        assert!(take_log().0.is_empty(), "a disabled probe recorded");
        set_enabled(true);
        #[allow(unused_mut)]
        let mut evaluated = false;
        probe!({
            evaluated = true;
            Stage::Mark
        });
        set_enabled(false);
        let (s, _) = take_log();
        assert_eq!(s.len(), usize::from(COMPILED));
        assert_eq!(evaluated, COMPILED, "the argument is evaluated only when compiled in");
    }
}
