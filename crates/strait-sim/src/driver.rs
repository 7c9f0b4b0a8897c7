//! The driver: runs many sans-IO [`Engine`]s (one per simulated host) over one
//! [`SimNet`] deterministically, on the net's virtual clock. A host is an engine
//! only: no eventfd, no clock read, no sleep.
//!
//! One step at virtual time `t`: deliver the datagrams due by `t`, then give a
//! progress pass (and drain the completion queue) to every host that has something
//! to do: datagrams waiting, a timer due, work left from its last pass, or
//! completions just handled. When no host has anything to do at `t`, the clock jumps
//! to the earliest of the next arrival and every worker's next timer
//! ([`Engine::poll_timeout`]). Hosts with nothing to do are not visited, so a
//! step costs what happens in it, not the size of the network.
//!
//! Every run is bounded by virtual time, by steps, and by passes at one instant, and
//! ends with a [`SimError`] that names the seed instead of hanging.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use strait_core::{Completion, Device, Engine};
use thiserror::Error;

use crate::net::SimNet;

/// Why a run stopped before its handler said it was done. Every message names the
/// seed, so a failure can be replayed with `STRAIT_SIM_SEED`.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SimError {
    /// The virtual time limit passed.
    #[error("seed {seed}: virtual time limit reached: {elapsed_ns} ns simulated (limit {limit_ns} ns) after {steps} steps")]
    TimeLimit {
        /// The net's seed.
        seed: u64,
        /// Virtual time simulated in this run.
        elapsed_ns: u64,
        /// The limit.
        limit_ns: u64,
        /// Steps taken.
        steps: u64,
    },
    /// The step limit passed.
    #[error("seed {seed}: step limit of {limit} reached at virtual time {now_ns} ns")]
    StepLimit {
        /// The net's seed.
        seed: u64,
        /// The limit.
        limit: u64,
        /// Virtual time when it was reached.
        now_ns: u64,
    },
    /// Hosts kept reporting work without the clock moving (a busy loop in a device
    /// or the engine).
    #[error("seed {seed}: livelock: {passes} passes at virtual time {now_ns} ns without the clock advancing (hosts still busy: {busy:?}; {why})")]
    Livelock {
        /// The net's seed.
        seed: u64,
        /// Passes at this instant.
        passes: u64,
        /// The instant.
        now_ns: u64,
        /// Some hosts that were still busy.
        busy: Vec<usize>,
        /// Why the first of them stayed busy.
        why: String,
    },
    /// Nothing is in flight and no device has a timer, yet the run is not done: an
    /// operation will never complete (silently lost).
    #[error(
        "seed {seed}: stalled at virtual time {now_ns} ns: nothing in flight, no timer pending, run not done"
    )]
    Stalled {
        /// The net's seed.
        seed: u64,
        /// The instant.
        now_ns: u64,
    },
    /// The wall-clock limit passed.
    #[error("seed {seed}: wall-clock limit of {limit:?} reached at virtual time {now_ns} ns")]
    WallLimit {
        /// The net's seed.
        seed: u64,
        /// The limit.
        limit: Duration,
        /// Virtual time when it was reached.
        now_ns: u64,
    },
}

/// Bounds on one [`Sim::run`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Virtual time one run may simulate, ns.
    pub virtual_ns: u64,
    /// Steps (one per instant at which hosts are visited, plus one per pass round).
    pub steps: u64,
    /// Pass rounds at one virtual instant before the run counts as a livelock.
    pub passes_per_instant: u64,
    /// Wall-clock time one run may take.
    pub wall: Duration,
}

impl Default for Limits {
    /// 10 minutes of virtual time, 100 million steps, 100 000 rounds per instant,
    /// 5 minutes of wall time.
    fn default() -> Self {
        Limits {
            virtual_ns: 600_000_000_000,
            steps: 100_000_000,
            passes_per_instant: 100_000,
            wall: Duration::from_secs(300),
        }
    }
}

/// What a run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RunStats {
    /// Pass rounds.
    pub steps: u64,
    /// Host progress passes.
    pub host_passes: u64,
    /// Completions handed to the handler.
    pub completions: u64,
    /// Virtual time simulated, ns.
    pub virtual_ns: u64,
    /// Times the clock jumped.
    pub clock_jumps: u64,
}

/// The application side of a simulation: receives completions (and may post new
/// operations on the engine that produced them) and says when the run is over.
pub trait Handler<D: Device> {
    /// One completion from host `host`'s engine, at virtual time `now_ns`.
    fn on_completion(&mut self, now_ns: u64, host: usize, engine: &mut Engine<D>, c: Completion);

    /// True when the run should stop (checked before every step); `engines` are the
    /// hosts' engines, by host number.
    fn done(&mut self, now_ns: u64, engines: &[Engine<D>]) -> bool;
}

/// A handler that stops after a fixed virtual time and hands completions to a
/// closure. See [`Sim::run_for`].
struct ForTime<F> {
    until: u64,
    f: F,
}

impl<D: Device, F: FnMut(usize, Completion)> Handler<D> for ForTime<F> {
    fn on_completion(&mut self, _now: u64, host: usize, _e: &mut Engine<D>, c: Completion) {
        (self.f)(host, c)
    }
    fn done(&mut self, now: u64, _engines: &[Engine<D>]) -> bool {
        now >= self.until
    }
}

/// Hosts (sans-IO engines) over a [`SimNet`], driven deterministically.
pub struct Sim<D: Device> {
    net: SimNet,
    engines: Vec<Engine<D>>,
    /// Per host: absolute time of its next timer (`u64::MAX`: none).
    deadline: Vec<u64>,
    timers: BinaryHeap<Reverse<(u64, usize)>>,
    active: Vec<usize>,
    is_active: Vec<bool>,
    scratch: Vec<usize>,
    /// Bounds of each run.
    pub limits: Limits,
    total: RunStats,
}

impl<D: Device> Sim<D> {
    /// A simulation with no hosts yet.
    pub fn new(net: SimNet) -> Self {
        Sim {
            net,
            engines: Vec::new(),
            deadline: Vec::new(),
            timers: BinaryHeap::new(),
            active: Vec::new(),
            is_active: Vec::new(),
            scratch: Vec::new(),
            limits: Limits::default(),
            total: RunStats::default(),
        }
    }

    /// The network.
    pub fn net(&self) -> &SimNet {
        &self.net
    }

    /// Virtual time, ns.
    pub fn now_ns(&self) -> u64 {
        self.net.now_ns()
    }

    /// Adds an engine as the next host; returns its host number (0, 1, ...), which is
    /// what [`SimNet::link_pair`] expects for the links of its endpoints.
    pub fn add_host(&mut self, e: Engine<D>) -> usize {
        let h = self.engines.len();
        self.engines.push(e);
        self.deadline.push(u64::MAX);
        self.is_active.push(false);
        self.wake(h);
        h
    }

    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.engines.len()
    }

    /// A host's engine, to post operations or attach endpoints; the host gets a pass
    /// in the next step.
    ///
    /// # Panics
    /// If `host` does not exist.
    pub fn engine(&mut self, host: usize) -> &mut Engine<D> {
        self.wake(host);
        &mut self.engines[host]
    }

    /// A host's engine, read-only (statistics, device queries).
    pub fn engine_ref(&self, host: usize) -> &Engine<D> {
        &self.engines[host]
    }

    /// Totals over every run so far.
    pub fn total_stats(&self) -> RunStats {
        self.total
    }

    fn wake(&mut self, h: usize) {
        if !self.is_active[h] {
            self.is_active[h] = true;
            self.active.push(h);
        }
    }

    /// Files host `h`'s next timer; call right after its pass at `now`.
    fn set_timer(&mut self, h: usize, now: u64) {
        match self.engines[h].poll_timeout() {
            Some(at) if at <= now => {
                self.deadline[h] = u64::MAX;
                self.wake(h);
            }
            Some(at) => {
                if at != self.deadline[h] {
                    self.deadline[h] = at;
                    self.timers.push(Reverse((at, h)));
                }
            }
            None => self.deadline[h] = u64::MAX,
        }
    }

    /// Wakes hosts whose timer is due by `now`.
    fn timers_due(&mut self, now: u64) {
        while let Some(&Reverse((at, h))) = self.timers.peek() {
            if at > now {
                break;
            }
            self.timers.pop();
            if self.deadline[h] == at {
                self.deadline[h] = u64::MAX;
                self.wake(h);
            }
        }
    }

    fn next_timer(&mut self) -> Option<u64> {
        // Drop stale entries (hosts whose deadline moved).
        while let Some(&Reverse((at, h))) = self.timers.peek() {
            if self.deadline[h] == at {
                return Some(at);
            }
            self.timers.pop();
        }
        None
    }

    /// Runs until `handler.done()`; returns what the run did, or why it stopped
    /// early.
    pub fn run(&mut self, handler: &mut dyn Handler<D>) -> Result<RunStats, SimError> {
        self.run_inner(handler, None)
    }

    /// [`Sim::run`]; the clock never jumps past `stop_at`.
    fn run_inner(
        &mut self,
        handler: &mut dyn Handler<D>,
        stop_at: Option<u64>,
    ) -> Result<RunStats, SimError> {
        let seed = self.net.seed();
        let start_ns = self.net.now_ns();
        let wall_start = Instant::now();
        let mut st = RunStats::default();
        let mut passes_here = 0u64;
        let mut result = Ok(());
        loop {
            let now = self.net.now_ns();
            if handler.done(now, &self.engines) {
                break;
            }
            st.steps += 1;
            if st.steps > self.limits.steps {
                result = Err(SimError::StepLimit { seed, limit: self.limits.steps, now_ns: now });
                break;
            }
            if st.steps % 1024 == 0 && wall_start.elapsed() > self.limits.wall {
                result = Err(SimError::WallLimit { seed, limit: self.limits.wall, now_ns: now });
                break;
            }
            self.net.take_woken(&mut self.scratch);
            for h in std::mem::take(&mut self.scratch) {
                if h < self.engines.len() {
                    self.wake(h);
                }
            }
            self.timers_due(now);
            if self.active.is_empty() {
                let next = [self.net.next_event_ns(), self.next_timer()].into_iter().flatten().min();
                let Some(next) = next else {
                    result = Err(SimError::Stalled { seed, now_ns: now });
                    break;
                };
                let next = next.max(now);
                let next = stop_at.map_or(next, |s| next.min(s.max(now)));
                if next - start_ns > self.limits.virtual_ns {
                    result = Err(SimError::TimeLimit {
                        seed,
                        elapsed_ns: next - start_ns,
                        limit_ns: self.limits.virtual_ns,
                        steps: st.steps,
                    });
                    break;
                }
                if next > now {
                    st.clock_jumps += 1;
                    passes_here = 0;
                }
                self.net.advance_to(next);
                continue;
            }
            passes_here += 1;
            if passes_here > self.limits.passes_per_instant {
                let busy: Vec<usize> = self.active.iter().copied().take(8).collect();
                let h = busy[0];
                let e = &mut self.engines[h];
                let work = e.progress(now);
                let why = format!(
                    "host {h}: progress work {work}, completion {:?}, next timer {:?} ns, datagrams waiting {}",
                    e.poll(),
                    e.next_timer_ns(),
                    self.net.host_pending(h)
                );
                result = Err(SimError::Livelock { seed, passes: passes_here, now_ns: now, busy, why });
                break;
            }
            let mut act = std::mem::take(&mut self.active);
            for &h in &act {
                self.is_active[h] = false;
            }
            for &h in &act {
                let e = &mut self.engines[h];
                let work = e.progress(now);
                let mut n = 0u64;
                while let Some(c) = e.poll() {
                    handler.on_completion(now, h, e, c);
                    n += 1;
                }
                st.host_passes += 1;
                st.completions += n;
                if work > 0 || n > 0 || self.net.host_pending(h) > 0 {
                    self.wake(h);
                }
                self.set_timer(h, now);
            }
            act.clear();
            if self.active.is_empty() {
                // Keep the allocation.
                self.active = act;
            }
        }
        st.virtual_ns = self.net.now_ns() - start_ns;
        self.total.steps += st.steps;
        self.total.host_passes += st.host_passes;
        self.total.completions += st.completions;
        self.total.virtual_ns += st.virtual_ns;
        self.total.clock_jumps += st.clock_jumps;
        result.map(|()| st)
    }

    /// Runs for `ns` of virtual time, handing every completion to `f(host, c)`.
    pub fn run_for(&mut self, ns: u64, f: impl FnMut(usize, Completion)) -> Result<RunStats, SimError> {
        let until = self.net.now_ns().saturating_add(ns);
        let mut h = ForTime { until, f };
        match self.run_inner(&mut h, Some(until)) {
            // Nothing more will ever happen: the time simply passes.
            Err(SimError::Stalled { .. }) => {
                self.net.advance_to(until);
                Ok(RunStats::default())
            }
            r => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::{LinkConfig, LinkParams};
    use strait_core::loopback::LoopbackDevice;
    use strait_core::reliable::{Reliable, ReliableConfig};
    use strait_core::{Config, MemoryRegion, OpKind, Status};

    struct Never;

    impl<D: Device> Handler<D> for Never {
        fn on_completion(&mut self, _: u64, _: usize, _: &mut Engine<D>, _: Completion) {}
        fn done(&mut self, _: u64, _: &[Engine<D>]) -> bool {
            false
        }
    }

    #[test]
    fn a_run_that_cannot_finish_stalls_and_names_its_seed() {
        let mut sim = Sim::new(SimNet::new(77));
        let (a, b) = LoopbackDevice::pair(1 << 16);
        for d in [a, b] {
            let mut e = Engine::new(Config::default());
            e.attach(d);
            sim.add_host(e);
        }
        let e = sim.run(&mut Never).unwrap_err();
        assert!(matches!(e, SimError::Stalled { seed: 77, .. }), "{e}");
        assert!(e.to_string().contains("seed 77"), "{e}");
    }

    #[test]
    fn device_timers_move_the_clock_until_the_time_limit() {
        let net = SimNet::new(78);
        let mut sim = Sim::new(net.clone());
        let (a, b) = net.reliable_pair(
            0,
            1,
            LinkParams::default(),
            &LinkConfig::default(),
            &ReliableConfig::default(),
        );
        for d in [a, b] {
            let mut e = Engine::new(Config::default());
            e.attach(d);
            sim.add_host(e);
        }
        sim.limits.virtual_ns = 3_000_000_000;
        let e = sim.run(&mut Never).unwrap_err();
        assert!(matches!(e, SimError::TimeLimit { seed: 78, .. }), "{e}");
        // Keepalives every 250 ms: a handful of jumps, not one per nanosecond.
        assert!(sim.total_stats().clock_jumps < 200, "{:?}", sim.total_stats());
    }

    #[test]
    fn run_for_delivers_a_message_over_the_reliability_layer() {
        let net = SimNet::new(79);
        let mut sim: Sim<Reliable<crate::SimLink>> = Sim::new(net.clone());
        let (a, b) = net.reliable_pair(
            0,
            1,
            LinkParams::default(),
            &LinkConfig::default(),
            &ReliableConfig::default(),
        );
        let mut eps = Vec::new();
        for d in [a, b] {
            let mut e = Engine::new(Config::default());
            eps.push(e.attach(d));
            sim.add_host(e);
        }
        let mut inbox = MemoryRegion::new(64).unwrap();
        let mut outbox = MemoryRegion::new(5).unwrap();
        outbox.write_at(0, b"hello").unwrap();
        sim.engine(1).post_recv(eps[1], &mut inbox, 0..64, 9, u64::MAX, 1).unwrap();
        sim.engine(0).post_send(eps[0], &outbox, 0..5, 9, 2).unwrap();
        let start = sim.now_ns();
        let mut got = Vec::new();
        sim.run_for(1_000_000, |h, c| got.push((h, c.op, c.status, c.len))).unwrap();
        assert_eq!(sim.now_ns() - start, 1_000_000);
        assert!(got.contains(&(0, OpKind::Send, Status::Ok, 5)), "{got:?}");
        assert!(got.contains(&(1, OpKind::Recv, Status::Ok, 5)), "{got:?}");
        let mut b = [0u8; 5];
        inbox.read_at(0, &mut b).unwrap();
        assert_eq!(&b, b"hello");
    }
}
