//! The worker: endpoints, the completion queue, and the loop that drives the
//! protocol engine, including the bounded-spin-then-sleep wait.

use std::collections::VecDeque;
use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::api::{Completion, EpId, PostError, Status, WaitError};
use crate::config::Config;
use crate::device::{Device, DeviceStats};
use crate::engine::{complete_send, Endpoint, EpState, PostedRecv};
use crate::notifier::Notifier;
use crate::region::{Buf, MemoryRegion, RECV, SEND};
use crate::spin::{Crowding, SpinPolicy, WaitOutcome};

/// Per-endpoint protocol counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EndpointStats {
    /// Messages sent eagerly.
    pub eager_sent: u64,
    /// Messages sent by rendezvous.
    pub rndv_sent: u64,
    /// Messages that arrived before a matching receive was posted.
    pub unexpected: u64,
    /// Stand-alone credit frames sent (credits not piggybacked).
    pub credit_frames_sent: u64,
    /// Frames dropped as malformed.
    pub frames_rejected: u64,
    /// Device counters.
    pub device: DeviceStats,
}

/// How many idle progress passes go by between liveness checks of endpoints that
/// have work outstanding (a check is a system call; a pass is ~10-100 ns).
const LIVENESS_EVERY: u32 = 1 << 14;

/// Shortest time between two liveness checks of a spinning worker.
const LIVENESS_INTERVAL: Duration = Duration::from_millis(5);

/// A progress engine with its endpoints and its completion queue.
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
    cfg: Config,
    notifier: Notifier,
    eps: Vec<Option<Endpoint<D>>>,
    cq: VecDeque<Completion>,
    idle_passes: u32,
    last_liveness: Instant,
    pollfds: Vec<libc::pollfd>,
    /// Devices of closed endpoints that still deliver what they accepted (lossy
    /// links retransmit until the peer acknowledges).
    closing: Vec<D>,
    /// How long the next wait spins (see [`crate::spin`]).
    spin: SpinPolicy,
    /// The machine's load, as this worker sampled it.
    crowding: Crowding,
    /// When the machine's load was last sampled for the spin policy.
    load_sampled: Option<Instant>,
}

/// How often an adaptive waiter samples the machine's load (three system calls).
const LOAD_SAMPLE_EVERY: Duration = Duration::from_millis(100);

impl<D: Device> Worker<D> {
    /// Creates a worker.
    pub fn new(cfg: Config) -> io::Result<Self> {
        Ok(Worker {
            notifier: Notifier::new()?,
            eps: Vec::new(),
            cq: VecDeque::with_capacity(1024),
            idle_passes: 0,
            last_liveness: Instant::now(),
            pollfds: Vec::new(),
            closing: Vec::new(),
            spin: if cfg.spin_adaptive {
                SpinPolicy::adaptive(cfg.spin)
            } else {
                SpinPolicy::fixed(cfg.spin)
            },
            crowding: Crowding::new(),
            load_sampled: None,
            cfg,
        })
    }

    /// The spin budget the next [`Worker::wait`] will use (adaptive unless a budget
    /// was configured explicitly: [`crate::spin`]).
    pub fn spin_budget(&self) -> Duration {
        if self.cfg.spin_adaptive && self.crowding.crowded() {
            Duration::ZERO
        } else {
            self.spin.budget()
        }
    }

    /// The settings in force.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The eventfd peers signal to wake this worker; devices hand a duplicate of it to
    /// the peer at connection setup.
    pub fn notifier(&self) -> &Notifier {
        &self.notifier
    }

    /// Adds a connected device as a new endpoint.
    pub fn attach(&mut self, dev: D) -> EpId {
        let id = EpId(self.eps.len() as u32);
        let st = EpState::new(id, &self.cfg, dev.max_frame_len(), dev.credits_hint());
        self.eps.push(Some(Endpoint { dev, st }));
        id
    }

    fn check_range(mr: &MemoryRegion, range: &Range<usize>) -> Result<(), PostError> {
        if range.start > range.end || range.end > mr.len() {
            return Err(PostError::OutOfBounds { start: range.start, end: range.end, region_len: mr.len() });
        }
        if range.end - range.start > u32::MAX as usize {
            return Err(PostError::TooLong(range.end - range.start));
        }
        Ok(())
    }

    /// Posts a send of `mr[range]` with `tag`. Messages up to the eager threshold are
    /// copied out at once (the completion follows immediately when the device has
    /// room and a credit is available); larger ones use rendezvous, and `mr` must not
    /// be written until the send completes (the region refuses `bytes_mut` meanwhile).
    pub fn post_send(
        &mut self,
        ep: EpId,
        mr: &MemoryRegion,
        range: Range<usize>,
        tag: u64,
        ctx: u64,
    ) -> Result<(), PostError> {
        strait_probe::probe!(strait_probe::Stage::SendPost);
        Self::check_range(mr, &range)?;
        let cq = &mut self.cq;
        let e =
            self.eps.get_mut(ep.0 as usize).and_then(|e| e.as_mut()).ok_or(PostError::UnknownEndpoint(ep))?;
        if let Some(status) = e.st.failed {
            return Err(PostError::Closed { ep, status });
        }
        let buf = Buf::hold(mr, SEND, range.start, range.end - range.start);
        let Some(buf) = e.try_send_eager_now(tag, buf, ctx, cq) else { return Ok(()) };
        if let Some(status) = e.st.failed {
            // The device failed during the attempt: the message ends like the rest.
            complete_send(cq, ep, buf, ctx, tag, status);
            return Ok(());
        }
        e.st.queue_send(tag, buf, ctx);
        e.progress_tx(cq, 0);
        if e.st.tx_waiting() {
            // Out of credits or ring room: what frees them arrives on the receive side.
            e.progress(cq);
        }
        Ok(())
    }

    /// Posts a receive into `mr[range]` for a message whose tag satisfies
    /// `msg_tag & mask == tag & mask` (mask 0 matches any tag). Receives on one
    /// endpoint match messages in arrival order, each against the receives in post
    /// order.
    pub fn post_recv(
        &mut self,
        ep: EpId,
        mr: &mut MemoryRegion,
        range: Range<usize>,
        tag: u64,
        mask: u64,
        ctx: u64,
    ) -> Result<(), PostError> {
        strait_probe::probe!(strait_probe::Stage::RecvPost);
        Self::check_range(mr, &range)?;
        let cq = &mut self.cq;
        let e =
            self.eps.get_mut(ep.0 as usize).and_then(|e| e.as_mut()).ok_or(PostError::UnknownEndpoint(ep))?;
        let buf = Buf::hold(mr, RECV, range.start, range.end - range.start);
        let recv = PostedRecv::new(tag, mask, buf, ctx);
        if let Some(status) = e.st.failed {
            return match e.st.post_recv_after_close(recv, cq) {
                Ok(()) => Ok(()),
                Err(r) => {
                    r.into_buf_release();
                    Err(PostError::Closed { ep, status })
                }
            };
        }
        e.st.post_recv(recv, cq);
        if e.st.has_rndv_starts() {
            // It matched a rendezvous that already arrived: start moving data now.
            e.progress_tx(cq, 0);
        }
        Ok(())
    }

    /// Advances every endpoint without blocking; returns how much work was done.
    pub fn progress(&mut self) -> usize {
        let mut work = 0;
        let cq = &mut self.cq;
        for e in self.eps.iter_mut().flatten() {
            work += e.progress(cq);
        }
        if !self.closing.is_empty() {
            self.closing.retain_mut(|d| d.drain());
        }
        if work == 0 {
            self.idle_passes += 1;
            if self.idle_passes >= LIVENESS_EVERY {
                self.idle_passes = 0;
                // At most once per LIVENESS_INTERVAL: when this process spins while
                // its peer is descheduled (a loaded machine), passes come fast and a
                // check per 2^14 of them would be a system call every ~0.3 ms.
                let now = Instant::now();
                if now.duration_since(self.last_liveness) >= LIVENESS_INTERVAL {
                    self.last_liveness = now;
                    self.check_liveness();
                }
            }
        } else {
            self.idle_passes = 0;
        }
        work
    }

    /// Asks every endpoint with unfinished work whether its peer still lives.
    fn check_liveness(&mut self) {
        let cq = &mut self.cq;
        for e in self.eps.iter_mut().flatten() {
            if e.st.failed.is_none() && (e.st.outstanding() || e.st.tx_blocked) {
                if let Err(err) = e.dev.check_peer() {
                    // Frames the peer wrote before it went away are still delivered.
                    e.progress(cq);
                    if e.st.failed.is_none() && !e.st.peer_closed() {
                        e.device_failed(err, cq);
                    }
                }
            }
        }
    }

    /// Makes progress and returns the oldest completion, if any.
    pub fn poll(&mut self) -> Option<Completion> {
        if let Some(c) = self.cq.pop_front() {
            strait_probe::probe!(if c.op == crate::api::OpKind::Recv => strait_probe::Stage::PollRecv);
            return Some(c);
        }
        self.progress();
        let c = self.cq.pop_front();
        strait_probe::probe!(if c.is_some_and(|c| c.op == crate::api::OpKind::Recv) => strait_probe::Stage::PollRecv);
        c
    }

    /// True while some operation on some endpoint is unfinished.
    pub fn has_outstanding(&self) -> bool {
        !self.cq.is_empty() || self.eps.iter().flatten().any(|e| e.st.failed.is_none() && e.st.outstanding())
    }

    /// Waits for the next completion: polls for up to the spin budget (the
    /// configured one, or less while spinning does not pay: [`crate::spin`]), then
    /// sleeps on the worker's eventfd (and every peer's liveness fd) until a peer
    /// rings, a peer dies, or `timeout` expires. Returns [`WaitError::Idle`] at once if
    /// nothing is outstanding.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<Completion, WaitError> {
        let start = Instant::now();
        let deadline = timeout.map(|t| start + t);
        // A completion already there: no wait, and nothing for the spin policy to learn.
        if let Some(c) = self.poll() {
            return Ok(c);
        }
        if self.cfg.spin_adaptive
            && self.load_sampled.is_none_or(|t| start.duration_since(t) >= LOAD_SAMPLE_EVERY)
        {
            self.load_sampled = Some(start);
            if let Some(l) = crate::spin::sample_load() {
                self.crowding.sample(l);
            }
        }
        let spin_until = start + self.spin.next_budget(self.crowding.crowded());
        let mut slept = false;
        let mut n: u32 = 0;
        loop {
            if let Some(c) = self.poll() {
                self.spin.record(WaitOutcome { waited: start.elapsed(), slept });
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
            if let Some(d) = deadline {
                if now >= d {
                    return Err(WaitError::Timeout);
                }
            }
            if now < spin_until {
                continue;
            }
            slept = true;
            self.sleep(deadline)?;
        }
    }

    /// Nanoseconds until some device needs a progress pass although nothing arrives
    /// (retransmission, acknowledgement and liveness timers of lossy links), or
    /// `None`. A program that drives the worker by [`Worker::progress`] alone (the
    /// simulator) uses it to know when to come back.
    pub fn next_timer_ns(&self) -> Option<u64> {
        let eps = self.eps.iter().flatten().filter(|e| e.st.failed.is_none()).map(|e| &e.dev);
        eps.chain(self.closing.iter()).filter_map(|d| d.timer_ns()).min()
    }

    /// Closed endpoints whose devices still work to deliver what they accepted.
    pub fn closing(&self) -> usize {
        self.closing.len()
    }

    /// Drives closed endpoints' devices until they have delivered everything (or
    /// given up on the peer), for at most `timeout`. Returns how many are still
    /// draining. Dropping a worker does not wait; call this first for a clean
    /// close over a lossy link.
    pub fn linger(&mut self, timeout: Duration) -> usize {
        let end = Instant::now() + timeout;
        while !self.closing.is_empty() && Instant::now() < end {
            self.progress();
            if !self.closing.is_empty() {
                let wait = self.closing.iter().filter_map(|d| d.timer_ns()).min().unwrap_or(1_000_000);
                std::thread::sleep(Duration::from_nanos(wait.clamp(1_000, 1_000_000)));
            }
        }
        self.closing.len()
    }

    /// Announces sleep on every endpoint, re-checks, and blocks in `ppoll`.
    fn sleep(&mut self, deadline: Option<Instant>) -> Result<(), WaitError> {
        let mut must_stay_awake = false;
        self.pollfds.clear();
        self.pollfds.push(libc::pollfd { fd: self.notifier.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        for e in self.eps.iter_mut().flatten() {
            if e.st.failed.is_some() {
                continue;
            }
            match e.dev.arm_sleep() {
                Ok(true) => {}
                Ok(false) | Err(_) => must_stay_awake = true,
            }
            if let Some(fd) = e.dev.event_fd() {
                self.pollfds.push(libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 });
            }
        }
        let timer = self.next_timer_ns().map(|ns| Instant::now() + Duration::from_nanos(ns));
        if timer.is_some_and(|t| t <= Instant::now()) {
            must_stay_awake = true;
        }
        let wake = match (deadline, timer) {
            (Some(d), Some(t)) => Some(d.min(t)),
            (d, t) => d.or(t),
        };
        if !must_stay_awake && self.cq.is_empty() {
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
                    self.disarm_all();
                    return Err(WaitError::Io(err));
                }
            }
            if r > 0 && self.pollfds[1..].iter().any(|p| p.revents != 0) {
                self.idle_passes = LIVENESS_EVERY;
            }
        }
        self.disarm_all();
        self.notifier.drain();
        if self.idle_passes >= LIVENESS_EVERY {
            self.idle_passes = 0;
            self.check_liveness();
        }
        Ok(())
    }

    fn disarm_all(&mut self) {
        for e in self.eps.iter_mut().flatten() {
            e.dev.disarm_sleep();
        }
    }

    /// Closes an endpoint: tells the peer (best effort), and completes every
    /// outstanding operation with [`Status::Canceled`].
    pub fn close(&mut self, ep: EpId) {
        let cq = &mut self.cq;
        let Some(slot) = self.eps.get_mut(ep.0 as usize) else { return };
        if let Some(mut e) = slot.take() {
            if e.st.failed.is_none() {
                e.st.fail(Status::Canceled, cq);
                e.st.failed = None;
                e.st.queue_close();
                // Transmit only: receiving now could only bring frames for the
                // transfers just canceled (which would read as a protocol violation).
                e.progress_tx(cq, 0);
            }
            e.dev.shutdown();
            if e.dev.drain() {
                self.closing.push(e.dev);
            }
        }
    }

    /// Counters of one endpoint.
    pub fn stats(&self, ep: EpId) -> Option<EndpointStats> {
        let e = self.eps.get(ep.0 as usize)?.as_ref()?;
        let mut s = e.st.stats;
        s.device = e.dev.stats();
        Some(s)
    }

    /// Why an endpoint failed, if it did: its status, and the reason (a corrupt
    /// peer's first violation, or the device's account of a lost peer).
    pub fn endpoint_error(&self, ep: EpId) -> Option<(Status, Option<String>)> {
        let e = self.eps.get(ep.0 as usize)?.as_ref()?;
        e.st.failed.map(|s| (s, e.st.last_error().map(str::to_owned)))
    }

    /// A diagnostic line about an endpoint's device ([`Device::describe`]).
    pub fn describe(&self, ep: EpId) -> Option<String> {
        let e = self.eps.get(ep.0 as usize)?.as_ref()?;
        Some(format!("engine: {}; device: {}", e.st.describe(), e.dev.describe()))
    }

    /// Borrow an endpoint's device (for device-specific queries).
    pub fn device(&self, ep: EpId) -> Option<&D> {
        self.eps.get(ep.0 as usize)?.as_ref().map(|e| &e.dev)
    }
}

impl<D: Device> Drop for Worker<D> {
    fn drop(&mut self) {
        for i in 0..self.eps.len() {
            self.close(EpId(i as u32));
        }
    }
}
