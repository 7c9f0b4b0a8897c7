//! A cheap, monotonic timestamp clock for 100 ns-scale measurements.
//!
//! On x86-64 with an invariant TSC (`constant_tsc` and `nonstop_tsc` in
//! `/proc/cpuinfo`) a timestamp is `lfence; rdtsc; lfence` (about 10-40 ns, no system
//! call, consistent across cores), and the tick rate is calibrated against
//! `CLOCK_MONOTONIC` when the clock is created. Elsewhere it falls back to
//! `clock_gettime(CLOCK_MONOTONIC)`, with one tick per nanosecond.

use std::time::Duration;

/// Which hardware or OS source a [`Clock`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockSource {
    /// The invariant time-stamp counter, read with `rdtsc` between `lfence`s.
    Tsc,
    /// `clock_gettime(CLOCK_MONOTONIC)` (vDSO), used when no invariant TSC exists.
    Monotonic,
}

impl ClockSource {
    /// Short lower-case name, as printed in reports.
    pub fn name(self) -> &'static str {
        match self {
            ClockSource::Tsc => "tsc",
            ClockSource::Monotonic => "clock_gettime(CLOCK_MONOTONIC)",
        }
    }
}

/// A calibrated timestamp clock. Cheap to copy; timestamps are raw ticks.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    source: ClockSource,
    /// Ticks per nanosecond (GHz); 1.0 for the monotonic fallback.
    ticks_per_ns: f64,
    /// Measured cost of one [`Clock::now`] in nanoseconds.
    overhead_ns: f64,
}

/// Nanoseconds of `CLOCK_MONOTONIC`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the local we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn rdtsc_fenced() -> u64 {
    // SAFETY: lfence and rdtsc are available on every x86-64 CPU and touch no memory.
    unsafe {
        core::arch::x86_64::_mm_lfence();
        let t = core::arch::x86_64::_rdtsc();
        core::arch::x86_64::_mm_lfence();
        t
    }
}

/// True if `/proc/cpuinfo` advertises an invariant TSC on an x86-64 CPU.
pub fn has_invariant_tsc() -> bool {
    if !cfg!(target_arch = "x86_64") {
        return false;
    }
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else { return false };
    let Some(flags) = info.lines().find(|l| l.starts_with("flags")) else { return false };
    let has = |f: &str| flags.split_whitespace().any(|w| w == f);
    has("constant_tsc") && has("nonstop_tsc")
}

impl Clock {
    /// The best clock this machine offers: the TSC if it is invariant (calibrated
    /// here, which takes about 60 ms), else `CLOCK_MONOTONIC`.
    pub fn new() -> Clock {
        if has_invariant_tsc() {
            Clock::tsc()
        } else {
            Clock::monotonic()
        }
    }

    /// The `CLOCK_MONOTONIC` fallback, whatever the CPU.
    pub fn monotonic() -> Clock {
        let mut c = Clock { source: ClockSource::Monotonic, ticks_per_ns: 1.0, overhead_ns: 0.0 };
        c.overhead_ns = c.measure_overhead();
        c
    }

    #[cfg(target_arch = "x86_64")]
    fn tsc() -> Clock {
        // A (tsc, monotonic) pair whose TSC reads bracket the clock_gettime tightly.
        fn pair() -> (u64, u64) {
            let mut best = (u64::MAX, 0, 0);
            for _ in 0..16 {
                let a = rdtsc_fenced();
                let m = monotonic_ns();
                let b = rdtsc_fenced();
                if b.wrapping_sub(a) < best.0 {
                    best = (b.wrapping_sub(a), a + (b - a) / 2, m);
                }
            }
            (best.1, best.2)
        }
        // Two 30 ms spans; keep the median-free simple mean of both (they agree to
        // a few ppm on an invariant TSC).
        let mut rates = Vec::with_capacity(2);
        for _ in 0..2 {
            let (t0, m0) = pair();
            std::thread::sleep(Duration::from_millis(30));
            let (t1, m1) = pair();
            if m1 > m0 && t1 > t0 {
                rates.push((t1 - t0) as f64 / (m1 - m0) as f64);
            }
        }
        if rates.is_empty() {
            return Clock::monotonic();
        }
        let ticks_per_ns = rates.iter().sum::<f64>() / rates.len() as f64;
        let mut c = Clock { source: ClockSource::Tsc, ticks_per_ns, overhead_ns: 0.0 };
        c.overhead_ns = c.measure_overhead();
        c
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn tsc() -> Clock {
        Clock::monotonic()
    }

    /// Median cost of back-to-back `now()` calls, in nanoseconds.
    fn measure_overhead(&self) -> f64 {
        let mut d: Vec<u64> = (0..1001)
            .map(|_| {
                let a = self.now();
                let b = self.now();
                b.wrapping_sub(a)
            })
            .collect();
        d.sort_unstable();
        self.to_ns(d[d.len() / 2])
    }

    /// The current timestamp in ticks.
    #[inline(always)]
    pub fn now(&self) -> u64 {
        match self.source {
            #[cfg(target_arch = "x86_64")]
            ClockSource::Tsc => rdtsc_fenced(),
            _ => monotonic_ns(),
        }
    }

    /// Converts a tick count to nanoseconds.
    #[inline]
    pub fn to_ns(&self, ticks: u64) -> f64 {
        ticks as f64 / self.ticks_per_ns
    }

    /// Converts nanoseconds to ticks (rounded down).
    pub fn ticks_for_ns(&self, ns: f64) -> u64 {
        (ns * self.ticks_per_ns) as u64
    }

    /// Ticks per nanosecond: the TSC rate in GHz, or 1.0 for the fallback.
    pub fn ticks_per_ns(&self) -> f64 {
        self.ticks_per_ns
    }

    /// The TSC rate in GHz, or `None` when the fallback clock is in use.
    pub fn tsc_ghz(&self) -> Option<f64> {
        (self.source == ClockSource::Tsc).then_some(self.ticks_per_ns)
    }

    /// What the clock reads.
    pub fn source(&self) -> ClockSource {
        self.source
    }

    /// The measured cost of one timestamp, in nanoseconds.
    pub fn overhead_ns(&self) -> f64 {
        self.overhead_ns
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_tracks_monotonic_time() {
        let c = Clock::new();
        let t0 = c.now();
        let m0 = monotonic_ns();
        std::thread::sleep(Duration::from_millis(20));
        let t1 = c.now();
        let m1 = monotonic_ns();
        let measured = c.to_ns(t1 - t0);
        let truth = (m1 - m0) as f64;
        assert!((measured - truth).abs() / truth < 0.01, "clock {measured} ns vs monotonic {truth} ns");
        assert!(c.overhead_ns() < 10_000.0);
    }

    #[test]
    fn fallback_is_nanoseconds() {
        let c = Clock::monotonic();
        assert_eq!(c.tsc_ghz(), None);
        assert_eq!(c.to_ns(1234), 1234.0);
        assert!(c.now() > 0);
    }
}
