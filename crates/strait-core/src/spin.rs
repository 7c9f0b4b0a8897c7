//! How long a wait spins before it sleeps: only as long as spinning pays.
//!
//! Spinning wins when the answer comes sooner than a sleeper's wake-up would take
//! (tens of microseconds on a VM), and only while the spinner does not take the core
//! that the thread with the work needs. A fixed budget is wrong both ways: with a
//! slow peer every wait burns the whole budget and then sleeps anyway; with more
//! runnable threads than cores the spin delays the very thread it waits for (a
//! 4-thread server and a 4-thread load generator on 2 cores ran slower under strait
//! than on the kernel). So the budget adapts, from what the caller observes:
//!
//! * a wait that ended while spinning keeps the budget (spinning paid);
//! * a wait that had to sleep halves it, unless the whole wait (spin, sleep and
//!   wake-up) still came in under the maximum budget: then a spin would have caught
//!   the answer, so the budget doubles back (from a small floor) towards the maximum;
//! * while the machine is crowded (more runnable threads than cores in two samples
//!   in a row, taken by the caller), the budget is zero: sleep at once and leave the
//!   core to the others; spinning resumes at the first sample that is not.
//!
//! The policy is pure (durations and samples passed in), so its behaviour is tested
//! without clocks. An explicitly configured budget (`STRAIT_SPIN_US`) is honoured as
//! it is: [`SpinPolicy::fixed`].

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Smallest budget a growing policy starts from.
const FLOOR: Duration = Duration::from_micros(2);

/// The adaptive (or fixed) spin budget of one waiter: relaxed atomics, so that a
/// connection shared by threads needs no lock on its wait path (two loads when
/// spinning pays).
#[derive(Debug)]
pub struct SpinPolicy {
    /// The budget spins start from and return to when they pay.
    max_ns: u64,
    /// How far the budget may grow for answers that keep coming a little later than
    /// `max_ns` (a large write waiting for ring space): at most this.
    ceiling_ns: u64,
    budget_ns: AtomicU64,
    adaptive: bool,
    /// Waits since the budget fell to zero: every [`PROBE_EVERY`]th spins the whole
    /// maximum, to find out whether spinning pays again.
    since_probe: AtomicU32,
}

/// While the budget is zero, one wait in this many spins the maximum (a probe): a
/// sleeper's own wait includes its wake-up, which can exceed the maximum spin (the
/// preload's 20 us against a VM's 25-30 us wake-up), so only a spin can show that
/// the answers come fast again.
const PROBE_EVERY: u32 = 8;

/// Whether the machine is crowded (more runnable threads than cores), from load
/// samples; one per process can serve many waiters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Crowding {
    crowded: bool,
    /// Consecutive samples that saw more runnable threads than cores.
    over: u8,
}

impl Crowding {
    /// Not crowded, no sample yet.
    pub const fn new() -> Self {
        Crowding { crowded: false, over: 0 }
    }

    /// Takes a load sample: crowded once two samples in a row saw more runnable
    /// threads than cores (one can catch a passing kernel thread), uncrowded at the
    /// first that does not. Two spinning ends on two cores are not crowded: the
    /// sampler counts itself, and its peer runs too.
    pub fn sample(&mut self, load: Load) {
        if load.runnable > load.cores {
            self.over = self.over.saturating_add(1);
            if self.over >= 2 {
                self.crowded = true;
            }
        } else {
            self.over = 0;
            self.crowded = false;
        }
    }

    /// True while the last samples said the machine is crowded.
    pub fn crowded(&self) -> bool {
        self.crowded
    }
}

/// What one wait did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitOutcome {
    /// From the start of the wait to the answer.
    pub waited: Duration,
    /// Whether it had to sleep (the spin budget ran out first).
    pub slept: bool,
}

/// Runnable threads against cores, as sampled (e.g. from `/proc/loadavg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    /// Threads running or ready to run, system-wide, the sampler included.
    pub runnable: usize,
    /// Cores this process may run on.
    pub cores: usize,
}

impl SpinPolicy {
    /// A policy that spins at most `max`, starting there and adapting.
    pub fn adaptive(max: Duration) -> Self {
        Self::adaptive_up_to(max, max)
    }

    /// A policy that starts at `base` and adapts: down to zero when spins are
    /// wasted, up to `ceiling` when the answers keep coming just after `base` (each
    /// of those waits would otherwise sleep and pay a wake-up).
    pub fn adaptive_up_to(base: Duration, ceiling: Duration) -> Self {
        let max_ns = base.as_nanos() as u64;
        SpinPolicy {
            max_ns,
            ceiling_ns: (ceiling.as_nanos() as u64).max(max_ns),
            budget_ns: AtomicU64::new(max_ns),
            adaptive: true,
            since_probe: AtomicU32::new(0),
        }
    }

    /// A policy that always spins exactly `budget` (a configured value).
    pub fn fixed(budget: Duration) -> Self {
        let max_ns = budget.as_nanos() as u64;
        SpinPolicy {
            max_ns,
            ceiling_ns: max_ns,
            budget_ns: AtomicU64::new(max_ns),
            adaptive: false,
            since_probe: AtomicU32::new(0),
        }
    }

    /// True if the budget adapts (a fixed one needs no load samples).
    pub fn is_adaptive(&self) -> bool {
        self.adaptive
    }

    /// The current budget, without counting a wait: for reports and tests.
    pub fn budget(&self) -> Duration {
        Duration::from_nanos(self.budget_ns.load(Ordering::Relaxed))
    }

    /// The spin budget of a wait about to start: zero while the machine is
    /// `crowded` (see [`Crowding`]; a fixed budget ignores it); while the budget is
    /// zero, every `PROBE_EVERY`th wait spins the maximum.
    pub fn next_budget(&self, crowded: bool) -> Duration {
        if !self.adaptive {
            return Duration::from_nanos(self.max_ns);
        }
        if crowded {
            return Duration::ZERO;
        }
        let b = self.budget_ns.load(Ordering::Relaxed);
        if b == 0 && self.since_probe.fetch_add(1, Ordering::Relaxed) + 1 >= PROBE_EVERY {
            self.since_probe.store(0, Ordering::Relaxed);
            return Duration::from_nanos(self.max_ns);
        }
        Duration::from_nanos(b)
    }

    /// Learns from one finished wait (not from one that timed out or was
    /// interrupted: those say nothing about the peer): a spin that caught the answer
    /// (a probe's too) keeps the budget, at least the base; a sleep after which the
    /// answer still came within the base restores the base; one within the ceiling
    /// grows the budget to cover such a wait (half as long again, at most the
    /// ceiling); a longer one halves the budget.
    pub fn record(&self, o: WaitOutcome) {
        if !self.adaptive {
            return;
        }
        let b = self.budget_ns.load(Ordering::Relaxed);
        let waited = o.waited.as_nanos() as u64;
        let next = if !o.slept || waited <= self.max_ns {
            b.max(self.max_ns)
        } else if waited <= self.ceiling_ns {
            (waited + waited / 2).clamp(self.max_ns, self.ceiling_ns).max(b)
        } else if b / 2 < FLOOR.as_nanos() as u64 {
            0
        } else {
            b / 2
        };
        if next != b {
            self.budget_ns.store(next, Ordering::Relaxed);
        }
    }
}

/// Runnable threads system-wide and this process's cores: the fourth field of
/// `/proc/loadavg` (`running/total`) and the affinity mask. `None` if unreadable.
/// Read through [`strait_sys::procfs`]: raw system calls (the preload interposes
/// `read` and `close`), and the handle on `/proc` where the library took one, so a
/// program that `chroot`s keeps sampling.
pub fn sample_load() -> Option<Load> {
    let raw = strait_sys::procfs::read("loadavg", 4096)?;
    let text = String::from_utf8_lossy(&raw);
    let runnable = text.split_whitespace().nth(3)?.split('/').next()?.parse().ok()?;
    let cores = strait_sys::cpu::count();
    (cores > 0).then_some(Load { runnable, cores })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(100);

    fn slept(us: u64) -> WaitOutcome {
        WaitOutcome { waited: Duration::from_micros(us), slept: true }
    }

    #[test]
    fn a_slow_peer_drives_the_budget_to_zero_and_a_fast_one_brings_it_back() {
        let p = SpinPolicy::adaptive(MAX);
        assert_eq!(p.budget(), MAX);
        // Answers take 1 ms: every spin is wasted.
        for _ in 0..10 {
            p.record(slept(1000));
        }
        assert_eq!(p.budget(), Duration::ZERO, "still spinning for a peer that answers in 1 ms");
        // The peer answers in 5 us again: a sleeper sees ~35 us (wake-up included),
        // under the maximum, so spinning would have paid.
        p.record(slept(35));
        assert_eq!(p.budget(), MAX);
    }

    #[test]
    fn a_wake_up_longer_than_the_spin_is_seen_through_by_probing() {
        // The preload's case: 20 us of spin, 30 us to wake a sleeper.
        let max = Duration::from_micros(20);
        let p = SpinPolicy::adaptive(max);
        for _ in 0..10 {
            p.record(slept(1000));
        }
        assert_eq!(p.budget(), Duration::ZERO);
        // The peer answers in 1 us again, but every sleeping wait takes 31 us.
        let mut waits = 0;
        loop {
            waits += 1;
            assert!(waits <= PROBE_EVERY, "no probe within {PROBE_EVERY} waits");
            let b = p.next_budget(false);
            if b >= Duration::from_micros(1) {
                p.record(WaitOutcome { waited: Duration::from_micros(1), slept: false });
                break;
            }
            p.record(slept(31));
        }
        assert_eq!(p.budget(), max, "a probe that caught the answer restores the spin");
    }

    #[test]
    fn spins_that_pay_keep_the_budget() {
        let p = SpinPolicy::adaptive(MAX);
        for _ in 0..100 {
            p.record(WaitOutcome { waited: Duration::from_micros(3), slept: false });
        }
        assert_eq!(p.budget(), MAX);
    }

    #[test]
    fn a_crowded_machine_sleeps_at_once() {
        let p = SpinPolicy::adaptive(MAX);
        let mut c = Crowding::new();
        c.sample(Load { runnable: 5, cores: 2 });
        assert_eq!(p.next_budget(c.crowded()), MAX, "one sample can catch a passing thread");
        c.sample(Load { runnable: 5, cores: 2 });
        assert_eq!(p.next_budget(c.crowded()), Duration::ZERO, "crowded: sleep at once");
        c.sample(Load { runnable: 2, cores: 2 });
        assert_eq!(p.next_budget(c.crowded()), MAX, "two spinners on two cores are not crowded");
    }

    #[test]
    fn answers_just_after_the_base_grow_the_budget_up_to_the_ceiling() {
        let (base, ceiling) = (Duration::from_micros(20), Duration::from_micros(200));
        let p = SpinPolicy::adaptive_up_to(base, ceiling);
        // A large write waits ~60 us for ring space each time (wake-up included).
        p.record(slept(60));
        assert_eq!(p.budget(), Duration::from_micros(90));
        p.record(WaitOutcome { waited: Duration::from_micros(50), slept: false });
        assert_eq!(p.budget(), Duration::from_micros(90), "a spin that paid keeps the grown budget");
        p.record(slept(150));
        assert_eq!(p.budget(), ceiling);
        // Far slower answers still drive it down.
        for _ in 0..12 {
            p.record(slept(5000));
        }
        assert_eq!(p.budget(), Duration::ZERO);
    }

    #[test]
    fn a_fixed_budget_never_moves() {
        let p = SpinPolicy::fixed(Duration::from_secs(5));
        for _ in 0..10 {
            p.record(slept(10_000_000));
        }
        assert_eq!(p.next_budget(true), Duration::from_secs(5), "a fixed budget ignores crowding too");
    }

    #[test]
    fn the_load_sample_reads_this_machine() {
        let l = sample_load().expect("/proc/loadavg");
        assert!(l.runnable >= 1, "the sampler itself runs: {l:?}");
        assert!(l.cores >= 1);
    }
}
