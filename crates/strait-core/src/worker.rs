//! The worker: a sans-IO [`Engine`] on real time. It owns the eventfd peers ring,
//! reads the clock, and runs the bounded-spin-then-sleep wait; everything else is
//! the engine's.

use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::api::{Completion, EpId, WaitError};
use crate::config::Config;
use crate::device::Device;
use crate::notifier::Notifier;
pub use crate::sansio::EndpointStats;
use crate::sansio::Engine;
use crate::spin::{Crowding, SpinPolicy, WaitOutcome};

/// When a wait that lasts began (its first clock reading), and its deadlines.
#[derive(Clone, Copy)]
struct WaitClock {
    start: Instant,
    deadline: Option<Instant>,
    spin_until: Instant,
}

/// A progress engine with its endpoints and its completion queue, on real time: a
/// sans-IO [`Engine`] (which it dereferences to, for attaching, posting, closing and
/// queries) plus the eventfd peers ring, the clock, and the wait.
///
/// A worker is single-threaded: it is `Send` if its device is, but not `Sync`; use one
/// worker per thread. Completions of every endpoint land in the worker's queue, in
/// the order they happen.
///
/// ```no_run
/// use strait_core::{Config, MemoryRegion, Worker, OpKind};
/// # fn demo<D: strait_core::Device>(dev: D) -> Result<(), Box<dyn std::error::Error>> {
/// let mut worker = Worker::new(Config::from_env()?)?;
/// let ep = worker.attach(dev); // a connected device, e.g. strait_shm::ShmDevice
/// let mut inbox = MemoryRegion::new(4096)?;
/// worker.post_recv(ep, &mut inbox, 0..4096, 7, u64::MAX, 1)?;
/// let mut outbox = MemoryRegion::new(5)?;
/// outbox.write_at(0, b"hello")?;
/// worker.post_send(ep, &outbox, 0..5, 7, 2)?;
/// loop {
///     let c = worker.wait(None)?;
///     if c.op == OpKind::Recv { break; }
/// }
/// # Ok(()) }
/// ```
pub struct Worker<D: Device> {
    engine: Engine<D>,
    notifier: Notifier,
    /// The origin of the time handed to the engine.
    epoch: Instant,
    pollfds: Vec<libc::pollfd>,
    /// How long the next wait spins (see [`crate::spin`]).
    spin: SpinPolicy,
    /// The machine's load, as this worker sampled it.
    crowding: Crowding,
    /// When the machine's load was last sampled for the spin policy.
    load_sampled: Option<Instant>,
}

/// How often an adaptive waiter samples the machine's load (three system calls).
const LOAD_SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Nanoseconds from `epoch` to now: the engine's time.
fn ns_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_nanos() as u64
}

impl<D: Device> Worker<D> {
    /// Creates a worker (and its eventfd).
    pub fn new(cfg: Config) -> io::Result<Self> {
        Ok(Worker {
            notifier: Notifier::new()?,
            epoch: Instant::now(),
            pollfds: Vec::new(),
            spin: if cfg.spin_adaptive {
                SpinPolicy::adaptive(cfg.spin)
            } else {
                SpinPolicy::fixed(cfg.spin)
            },
            crowding: Crowding::new(),
            load_sampled: None,
            engine: Engine::new(cfg),
        })
    }

    /// The spin budget the next [`Worker::wait`] will use (adaptive unless a budget
    /// was configured explicitly: [`crate::spin`]).
    pub fn spin_budget(&self) -> Duration {
        if self.engine.config().spin_adaptive && self.crowding.crowded() {
            Duration::ZERO
        } else {
            self.spin.budget()
        }
    }

    /// The eventfd peers signal to wake this worker; devices hand a duplicate of it to
    /// the peer at connection setup.
    pub fn notifier(&self) -> &Notifier {
        &self.notifier
    }

    /// Adds a connected device as a new endpoint ([`Engine::attach`]). The worker's
    /// own method, not reached through `Deref`, so that
    /// `w.attach(connect(w.notifier()))` compiles: a two-phase borrow does not pass
    /// through `DerefMut`.
    pub fn attach(&mut self, dev: D) -> EpId {
        self.engine.attach(dev)
    }

    /// Advances every endpoint without blocking; returns how much work was done.
    pub fn progress(&mut self) -> usize {
        let epoch = self.epoch;
        // The clock is read only when the engine needs the time (rarely), not per pass.
        self.engine.progress_at(|| ns_since(epoch))
    }

    /// Makes progress and returns the oldest completion, if any.
    pub fn poll(&mut self) -> Option<Completion> {
        if let Some(c) = self.engine.poll() {
            return Some(c);
        }
        self.progress();
        self.engine.poll()
    }

    /// Waits for the next completion: polls for up to the spin budget (the
    /// configured one, or less while spinning does not pay: [`crate::spin`]), then
    /// sleeps on the worker's eventfd (and every peer's liveness fd) until a peer
    /// rings, a peer dies, or `timeout` expires. Returns [`WaitError::Idle`] at once if
    /// nothing is outstanding.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<Completion, WaitError> {
        // A completion already there: no wait, and nothing for the spin policy to learn.
        if let Some(c) = self.poll() {
            return Ok(c);
        }
        // The clock is first read after 64 polls (and every 64 after): a completion
        // that comes sooner, as in a ping-pong, costs no clock read (two had been
        // about 40 ns of a 215 ns one-way hop), and a spin that caught its answer
        // tells the spin policy nothing that needs the time. The wait's start, its
        // deadline and the end of its spin are taken at that first reading.
        let mut clock: Option<WaitClock> = None;
        let mut slept = false;
        let mut n: u32 = 0;
        loop {
            if let Some(c) = self.poll() {
                let waited = match (slept, clock) {
                    (true, Some(k)) => k.start.elapsed(),
                    _ => Duration::ZERO,
                };
                self.spin.record(WaitOutcome { waited, slept });
                return Ok(c);
            }
            if !self.has_outstanding() {
                return Err(WaitError::Idle);
            }
            n = n.wrapping_add(1);
            if !n.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            let k = match clock {
                Some(k) => k,
                None => {
                    let k = self.start_clock(now, timeout);
                    clock = Some(k);
                    k
                }
            };
            if let Some(d) = k.deadline {
                if now >= d {
                    return Err(WaitError::Timeout);
                }
            }
            if now < k.spin_until {
                continue;
            }
            slept = true;
            self.sleep(k.deadline)?;
        }
    }

    /// The times of a wait that lasts, from its first clock reading `now`: samples
    /// the machine's load (at most every [`LOAD_SAMPLE_EVERY`]) and takes the spin
    /// budget.
    fn start_clock(&mut self, now: Instant, timeout: Option<Duration>) -> WaitClock {
        if self.engine.config().spin_adaptive
            && self.load_sampled.is_none_or(|t| now.duration_since(t) >= LOAD_SAMPLE_EVERY)
        {
            self.load_sampled = Some(now);
            if let Some(l) = crate::spin::sample_load() {
                self.crowding.sample(l);
            }
        }
        WaitClock {
            start: now,
            deadline: timeout.map(|t| now + t),
            spin_until: now + self.spin.next_budget(self.crowding.crowded()),
        }
    }

    /// Drives closed endpoints' devices until they have delivered everything (or
    /// given up on the peer), for at most `timeout`. Returns how many are still
    /// draining. Dropping a worker does not wait; call this first for a clean
    /// close over a lossy link.
    pub fn linger(&mut self, timeout: Duration) -> usize {
        let end = Instant::now() + timeout;
        while self.engine.closing() > 0 && Instant::now() < end {
            self.progress();
            if self.engine.closing() > 0 {
                let wait = self.engine.closing_timer_ns().unwrap_or(1_000_000);
                std::thread::sleep(Duration::from_nanos(wait.clamp(1_000, 1_000_000)));
            }
        }
        self.engine.closing()
    }

    /// Announces sleep on every endpoint, re-checks, and blocks in `ppoll`.
    fn sleep(&mut self, deadline: Option<Instant>) -> Result<(), WaitError> {
        self.pollfds.clear();
        self.pollfds.push(libc::pollfd { fd: self.notifier.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        let pollfds = &mut self.pollfds;
        let armed = self.engine.arm_sleep(|fd| {
            pollfds.push(libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 })
        });
        let mut must_stay_awake = !armed;
        let timer = self.engine.next_timer_ns().map(|ns| Instant::now() + Duration::from_nanos(ns));
        if timer.is_some_and(|t| t <= Instant::now()) {
            must_stay_awake = true;
        }
        let wake = match (deadline, timer) {
            (Some(d), Some(t)) => Some(d.min(t)),
            (d, t) => d.or(t),
        };
        let mut peer_woke = false;
        if !must_stay_awake && !self.engine.has_completions() {
            let ts = wake.map(|d| {
                let left = d.saturating_duration_since(Instant::now());
                libc::timespec {
                    tv_sec: left.as_secs() as libc::time_t,
                    tv_nsec: left.subsec_nanos() as libc::c_long,
                }
            });
            let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
            // SAFETY: `pollfds` is a live Vec of initialised pollfd; `tsp` is null or
            // points at a local timespec; no signal mask is passed.
            let r = unsafe {
                libc::ppoll(
                    self.pollfds.as_mut_ptr(),
                    self.pollfds.len() as libc::nfds_t,
                    tsp,
                    std::ptr::null(),
                )
            };
            if r < 0 {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    self.engine.disarm_sleep();
                    return Err(WaitError::Io(err));
                }
            }
            peer_woke = r > 0 && self.pollfds[1..].iter().any(|p| p.revents != 0);
        }
        self.engine.disarm_sleep();
        self.notifier.drain();
        if peer_woke {
            // A peer's descriptor (not the doorbell) woke us: it may have died.
            self.engine.check_peers();
        }
        Ok(())
    }
}

/// A worker is its engine plus the means to wait: attaching devices, posting, closing
/// and every query are the [`Engine`]'s. ([`Worker::progress`] and [`Worker::poll`]
/// are the worker's own: they read the clock, and `poll` makes progress first.)
impl<D: Device> Deref for Worker<D> {
    type Target = Engine<D>;

    fn deref(&self) -> &Engine<D> {
        &self.engine
    }
}

impl<D: Device> DerefMut for Worker<D> {
    fn deref_mut(&mut self) -> &mut Engine<D> {
        &mut self.engine
    }
}
