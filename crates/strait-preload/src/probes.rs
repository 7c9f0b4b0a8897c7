//! The stage probes of the interposed TCP path, as seen from outside the library.
//!
//! The library carries its own copy of `strait-probe` (a cdylib shares no Rust
//! statics with the program it is loaded into), so a measuring program reaches the
//! library's switch and per-thread logs through these C functions, looked up with
//! `dlsym` (`strait anatomy --transports strait-run`, whose ends are threads of a
//! process started under the library). Every function is safe to call whether or
//! not the probes are compiled in; without them nothing is recorded.

use libc::{c_int, size_t};
use strait_probe::Stage;

/// One stamp as handed out: counter ticks and the stage's number
/// (`strait_probe::Stage as u8`, read by the same build).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawStamp {
    /// Time-stamp counter ticks.
    pub tsc: u64,
    /// The stage's number.
    pub stage: u8,
}

/// 1 when the probes are compiled into this library, else 0.
#[no_mangle]
pub extern "C" fn strait_preload_probes_compiled() -> c_int {
    c_int::from(strait_probe::COMPILED)
}

/// Switches the probes: 0 off, 1 on, 2 on with every stamp doubled (the in-situ
/// probe cost calibration). For every thread of the process.
#[no_mangle]
pub extern "C" fn strait_preload_probes_set(mode: c_int) {
    strait_probe::set_double(mode == 2);
    strait_probe::set_enabled(mode != 0);
}

/// Starts (or restarts) the calling thread's log with room for `capacity` stamps.
#[no_mangle]
pub extern "C" fn strait_preload_probes_start_log(capacity: size_t) {
    strait_probe::start_log(capacity);
}

/// Records `stage` (a stage number) on the calling thread's log, if the probes are
/// compiled in and on; an unknown number is ignored. For the measuring program's own
/// milestones (the application's calls), so that they share the library's log.
#[no_mangle]
pub extern "C" fn strait_preload_probes_mark(stage: u8) {
    if strait_probe::enabled() {
        if let Some(s) = Stage::from_u8(stage) {
            strait_probe::record(s);
        }
    }
}

/// Moves up to `cap` of the calling thread's stamps into `out` (in time order) and
/// empties the log; returns how many were written. `*dropped` (if not null) gets the
/// count of stamps lost for lack of room.
///
/// # Safety
/// `out` points at room for `cap` stamps (or `cap` is 0); `dropped` is null or
/// points at a writable `u64`.
#[no_mangle]
pub unsafe extern "C" fn strait_preload_probes_take(
    out: *mut RawStamp,
    cap: size_t,
    dropped: *mut u64,
) -> size_t {
    let (stamps, lost) = strait_probe::take_log();
    let n = stamps.len().min(cap);
    for (i, s) in stamps.iter().take(n).enumerate() {
        // SAFETY: i < n <= cap, and the caller gave room for cap stamps.
        unsafe { out.add(i).write(RawStamp { tsc: s.tsc, stage: s.stage as u8 }) };
    }
    if !dropped.is_null() {
        // SAFETY: per the caller, a writable u64.
        unsafe { dropped.write(lost + (stamps.len() - n) as u64) };
    }
    n
}
