//! `STRAIT_STATS=1`: one line on stderr at exit with this process's counts.

use std::sync::atomic::Ordering;

use crate::conn::{ACCELERATED, KERNEL_FALLBACKS, PATH_B};

extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let line = format!(
            "strait-preload: pid {} accelerated {} kernel-fallback {} path-b {}\n",
            std::process::id(),
            ACCELERATED.load(Ordering::Relaxed),
            KERNEL_FALLBACKS.load(Ordering::Relaxed),
            PATH_B.load(Ordering::Relaxed)
        );
        // SAFETY: writes a local buffer to stderr.
        unsafe { crate::real::write(2, line.as_ptr().cast(), line.len()) };
    });
}

/// Called once at load time.
pub fn init() {
    if std::env::var_os("STRAIT_STATS").is_some_and(|v| !v.is_empty() && v != "0") {
        // SAFETY: registers a plain extern "C" function.
        unsafe { libc::atexit(at_exit) };
    }
}

/// A connection was accelerated (hook for future per-connection records).
pub fn note() {}
