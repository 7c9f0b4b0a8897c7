//! The sans-IO engine: endpoints, the completion queue and the protocol engine,
//! driven by whoever holds it.
//!
//! An [`Engine`] never reads a clock, never sleeps and owns no descriptor: time comes
//! from the caller ([`Engine::progress`] takes the caller's `now`, and
//! [`Engine::poll_timeout`] says when to come back), and the only system calls made
//! are the devices' own. [`crate::Worker`] is the shell that runs an engine on real
//! time (clock, eventfd, `ppoll`); the simulator (`strait-sim`) runs engines on its
//! virtual clock, with no descriptor per simulated host.

use std::collections::VecDeque;
use std::ops::Range;
use std::os::fd::RawFd;

use crate::api::{Completion, EpId, PostError, Status};
use crate::config::Config;
use crate::device::{Device, DeviceStats};
use crate::engine::{complete_send, Endpoint, EpState, PostedRecv};
use crate::region::{Buf, MemoryRegion, RECV, SEND};

/// Progress passes [`Engine::close`] gives a peer to answer the PUTs of split
/// transfers it may be serving (about a millisecond of polling).
const CLOSE_PUT_PASSES: u32 = 20_000;

/// Per-endpoint protocol counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EndpointStats {
    /// Messages sent eagerly.
    pub eager_sent: u64,
    /// Messages sent by rendezvous.
    pub rndv_sent: u64,
    /// Rendezvous messages received by a split transfer (the sender asked to write
    /// part of each: [`crate::RndvMode::Split`]).
    pub rndv_split: u64,
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
/// have work outstanding (a check may be a system call in the device; a pass is
/// ~10-100 ns).
pub(crate) const LIVENESS_EVERY: u32 = 1 << 14;

/// Shortest time between two liveness checks of a spinning engine, ns.
const LIVENESS_INTERVAL_NS: u64 = 5_000_000;

/// Endpoints and their completion queue, without I/O of its own.
///
/// Completions of every endpoint land in one queue, in the order they happen. An
/// engine is single-threaded: `Send` if its device is, not `Sync`.
///
/// ```
/// use strait_core::loopback::LoopbackDevice;
/// use strait_core::{Config, Engine, MemoryRegion, OpKind};
/// let (a, b) = LoopbackDevice::pair(1 << 16);
/// let (mut ea, mut eb) = (Engine::new(Config::default()), Engine::new(Config::default()));
/// let (pa, pb) = (ea.attach(a), eb.attach(b));
/// let mut inbox = MemoryRegion::new(64).unwrap();
/// let mut outbox = MemoryRegion::new(5).unwrap();
/// outbox.write_at(0, b"hello").unwrap();
/// eb.post_recv(pb, &mut inbox, 0..64, 7, u64::MAX, 1).unwrap();
/// ea.post_send(pa, &outbox, 0..5, 7, 2).unwrap();
/// let mut now = 0; // the caller's clock, ns
/// let got = loop {
///     now += 1_000;
///     ea.progress(now);
///     eb.progress(now);
///     if let Some(c) = eb.poll() { break c; }
/// };
/// assert_eq!((got.op, got.len), (OpKind::Recv, 5));
/// ```
pub struct Engine<D: Device> {
    cfg: Config,
    eps: Vec<Option<Endpoint<D>>>,
    cq: VecDeque<Completion>,
    idle_passes: u32,
    /// The caller's time of the last liveness check, ns.
    last_liveness_ns: u64,
    /// The caller's time given to the last [`Engine::progress`], ns.
    now_ns: u64,
    /// Devices of closed endpoints that still deliver what they accepted (lossy
    /// links retransmit until the peer acknowledges).
    closing: Vec<D>,
}

impl<D: Device> Engine<D> {
    /// An engine with no endpoints. Makes no system call.
    pub fn new(cfg: Config) -> Self {
        Engine {
            cfg,
            eps: Vec::new(),
            cq: VecDeque::with_capacity(1024),
            idle_passes: 0,
            last_liveness_ns: 0,
            now_ns: 0,
            closing: Vec::new(),
        }
    }

    /// The settings in force.
    pub fn config(&self) -> &Config {
        &self.cfg
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
        if e.try_send_eager_now(tag, mr.borrowed(&range), ctx, cq) {
            return Ok(());
        }
        let buf = Buf::hold(mr, SEND, range.start, range.end - range.start);
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
    /// `now` is the caller's clock in nanoseconds (any origin, never going back): it
    /// paces the liveness checks and anchors [`Engine::poll_timeout`].
    pub fn progress(&mut self, now: u64) -> usize {
        self.now_ns = now;
        self.progress_at(|| now)
    }

    /// [`Engine::progress`] for a caller whose clock read costs: `now` is called only
    /// when the time matters (once every [`LIVENESS_EVERY`] idle passes), so a busy
    /// loop pays for no clock read per pass.
    pub(crate) fn progress_at(&mut self, now: impl FnOnce() -> u64) -> usize {
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
                // At most once per LIVENESS_INTERVAL_NS: when this process spins while
                // its peer is descheduled (a loaded machine), passes come fast and a
                // check per 2^14 of them would be a system call every ~0.3 ms.
                let now = now();
                if now.saturating_sub(self.last_liveness_ns) >= LIVENESS_INTERVAL_NS {
                    self.last_liveness_ns = now;
                    self.check_peers();
                }
            }
        } else {
            self.idle_passes = 0;
        }
        work
    }

    /// Asks every endpoint with unfinished work whether its peer still lives (the
    /// device's check; a system call for some devices). [`Engine::progress`] does this
    /// by itself every so often; a caller that learns something happened to a peer
    /// (its descriptor woke) calls it at once.
    pub fn check_peers(&mut self) {
        self.idle_passes = 0;
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

    /// The oldest completion, if any. Makes no progress: call [`Engine::progress`]
    /// first.
    pub fn poll(&mut self) -> Option<Completion> {
        let c = self.cq.pop_front();
        strait_probe::probe!(if c.is_some_and(|c| c.op == crate::api::OpKind::Recv) => strait_probe::Stage::PollRecv);
        c
    }

    /// True if a completion is waiting in the queue.
    pub fn has_completions(&self) -> bool {
        !self.cq.is_empty()
    }

    /// True while some operation on some endpoint is unfinished.
    pub fn has_outstanding(&self) -> bool {
        !self.cq.is_empty() || self.eps.iter().flatten().any(|e| e.st.failed.is_none() && e.st.outstanding())
    }

    /// Nanoseconds until some device needs a progress pass although nothing arrives
    /// (retransmission, acknowledgement and liveness timers of lossy links), or
    /// `None`; counted from now, as the devices see it.
    pub fn next_timer_ns(&self) -> Option<u64> {
        let eps = self.eps.iter().flatten().filter(|e| e.st.failed.is_none()).map(|e| &e.dev);
        eps.chain(self.closing.iter()).filter_map(|d| d.timer_ns()).min()
    }

    /// When, on the caller's clock, the engine next needs a progress pass although
    /// nothing arrives: the `now` of the last [`Engine::progress`] plus
    /// [`Engine::next_timer_ns`] (device timers count from the present, so ask right
    /// after a pass). `None`: no timer.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.next_timer_ns().map(|d| self.now_ns.saturating_add(d))
    }

    /// Closed endpoints whose devices still work to deliver what they accepted.
    pub fn closing(&self) -> usize {
        self.closing.len()
    }

    /// The shortest timer among the closed endpoints' devices still draining.
    pub(crate) fn closing_timer_ns(&self) -> Option<u64> {
        self.closing.iter().filter_map(|d| d.timer_ns()).min()
    }

    /// Announces to every live endpoint's peer that the caller is about to sleep, and
    /// hands `fd` each device's wake-up descriptor. Returns false if some device
    /// could not arm (something arrived meanwhile): the caller must not sleep. Every
    /// arm is undone by [`Engine::disarm_sleep`].
    pub fn arm_sleep(&mut self, mut fd: impl FnMut(RawFd)) -> bool {
        let mut armed = true;
        for e in self.eps.iter_mut().flatten() {
            if e.st.failed.is_some() {
                continue;
            }
            match e.dev.arm_sleep() {
                Ok(true) => {}
                Ok(false) | Err(_) => armed = false,
            }
            if let Some(f) = e.dev.event_fd() {
                fd(f);
            }
        }
        armed
    }

    /// Withdraws the announcement of [`Engine::arm_sleep`] on every endpoint.
    pub fn disarm_sleep(&mut self) {
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
                // The peer may be writing its part of a split transfer into a posted
                // buffer: give its answer a bounded number of passes to arrive
                // (a polling peer answers within microseconds), so that the buffer
                // can be handed back; `fail` keeps the hold of any still unanswered.
                let mut passes = 0u32;
                while e.st.awaiting_puts() && e.st.failed.is_none() && passes < CLOSE_PUT_PASSES {
                    if e.progress(cq) == 0 {
                        std::hint::spin_loop();
                    }
                    passes += 1;
                }
            }
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

impl<D: Device> Drop for Engine<D> {
    fn drop(&mut self) {
        for i in 0..self.eps.len() {
            self.close(EpId(i as u32));
        }
    }
}
