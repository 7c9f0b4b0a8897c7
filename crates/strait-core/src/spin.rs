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

use std::time::Duration;

/// Smallest budget a growing policy starts from.
const FLOOR: Duration = Duration::from_micros(2);

/// The adaptive (or fixed) spin budget of one waiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpinPolicy {
    max: Duration,
    budget: Duration,
    adaptive: bool,
    crowding: Crowding,
}

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
        SpinPolicy { max, budget: max, adaptive: true, crowding: Crowding::default() }
    }

    /// A policy that always spins exactly `budget` (a configured value).
    pub fn fixed(budget: Duration) -> Self {
        SpinPolicy { max: budget, budget, adaptive: false, crowding: Crowding::default() }
    }

    /// The spin budget for the next wait, by this policy's own load samples.
    pub fn budget(&self) -> Duration {
        self.budget_when(self.crowding.crowded())
    }

    /// The spin budget for the next wait when the caller keeps the load samples
    /// itself (one [`Crowding`] for many waiters): zero while `crowded`, unless the
    /// budget is fixed.
    pub fn budget_when(&self, crowded: bool) -> Duration {
        if self.adaptive && crowded {
            Duration::ZERO
        } else {
            self.budget
        }
    }

    /// Learns from one finished wait (not from one that timed out or was
    /// interrupted: those say nothing about the peer).
    pub fn record(&mut self, o: WaitOutcome) {
        if !self.adaptive || !o.slept {
            return;
        }
        self.budget =
            if o.waited <= self.max { (self.budget * 2).max(FLOOR).min(self.max) } else { self.budget / 2 };
        if self.budget < FLOOR / 2 {
            self.budget = Duration::ZERO;
        }
    }

    /// Takes a load sample into this policy's own [`Crowding`].
    pub fn sample(&mut self, load: Load) {
        self.crowding.sample(load);
    }

    /// True while this policy's load samples say the machine is crowded.
    pub fn crowded(&self) -> bool {
        self.crowding.crowded()
    }
}

/// Runnable threads system-wide and this process's cores: the fourth field of
/// `/proc/loadavg` (`running/total`) and the affinity mask. `None` if unreadable.
pub fn sample_load() -> Option<Load> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let runnable = text.split_whitespace().nth(3)?.split('/').next()?.parse().ok()?;
    let cores = std::thread::available_parallelism().ok()?.get();
    Some(Load { runnable, cores })
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
        let mut p = SpinPolicy::adaptive(MAX);
        assert_eq!(p.budget(), MAX);
        // Answers take 1 ms: every spin is wasted.
        for _ in 0..10 {
            p.record(slept(1000));
        }
        assert_eq!(p.budget(), Duration::ZERO, "still spinning for a peer that answers in 1 ms");
        // The peer answers in 5 us again: a sleeper sees ~35 us (wake-up included),
        // under the maximum, so spinning would have paid.
        let mut steps = 0;
        while p.budget() < MAX {
            p.record(slept(35));
            steps += 1;
            assert!(steps < 10, "the budget does not come back");
        }
        assert_eq!(p.budget(), MAX);
    }

    #[test]
    fn spins_that_pay_keep_the_budget() {
        let mut p = SpinPolicy::adaptive(MAX);
        for _ in 0..100 {
            p.record(WaitOutcome { waited: Duration::from_micros(3), slept: false });
        }
        assert_eq!(p.budget(), MAX);
    }

    #[test]
    fn a_crowded_machine_sleeps_at_once() {
        let mut p = SpinPolicy::adaptive(MAX);
        p.sample(Load { runnable: 5, cores: 2 });
        assert_eq!(p.budget(), MAX, "one sample can catch a passing thread");
        p.sample(Load { runnable: 5, cores: 2 });
        assert_eq!(p.budget(), Duration::ZERO, "crowded: sleep at once");
        p.sample(Load { runnable: 2, cores: 2 });
        assert_eq!(p.budget(), MAX, "two spinners on two cores are not crowded");
    }

    #[test]
    fn a_fixed_budget_never_moves() {
        let mut p = SpinPolicy::fixed(Duration::from_secs(5));
        p.sample(Load { runnable: 9, cores: 2 });
        for _ in 0..10 {
            p.record(slept(10_000_000));
        }
        assert_eq!(p.budget(), Duration::from_secs(5));
    }

    #[test]
    fn the_load_sample_reads_this_machine() {
        let l = sample_load().expect("/proc/loadavg");
        assert!(l.runnable >= 1, "the sampler itself runs: {l:?}");
        assert!(l.cores >= 1);
    }
}
