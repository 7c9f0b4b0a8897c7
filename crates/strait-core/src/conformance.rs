//! One conformance suite for the [`Device`] contract, written once and run against
//! every implementation (in the manner of iceoryx2's generic test suites).
//!
//! # Design
//!
//! The checks are generic functions over a [`Harness`]: a factory that returns two
//! connected devices ([`Harness::pair`]) and knows how to let time pass for them
//! ([`Harness::advance`], a no-op for in-memory devices, the virtual clock for the
//! simulator). [`device_conformance!`](crate::device_conformance) expands to one
//! `#[test]` per check, so a failure names the check and the implementation.
//! [`Boxed`] turns any harness into one for `Box<D>`, so the boxed forwarding impl is
//! held to the same contract as the device it wraps.
//!
//! The suite lives in strait-core, behind the `conformance` cargo feature, because
//! strait-core is the one crate every implementation already depends on: the lower
//! layer never imports an upper one, each device crate enables the feature only as
//! a dev-dependency (`strait-core = { workspace = true, features = ["conformance"] }`)
//! and instantiates the suite in its own `tests/`, and release builds of the stack
//! do not compile it. Generic functions (rather than a macro holding the test
//! bodies) keep the checks type-checked and documented once; the macro only
//! stamps out the `#[test]` wrappers. strait-core instantiates it for
//! [`crate::loopback::LoopbackDevice`] in its unit tests (where the module is
//! compiled without the feature).
//!
//! # What is checked
//!
//! Each check panics with a message naming the broken part of the contract:
//! * frames of 0, 1, small and [`Device::max_frame_len`] bytes arrive in order and
//!   intact, both ways; a longer frame is refused with
//!   [`DeviceError::FrameTooLong`] without calling `fill`;
//! * a peer that does not consume fills the device: `send_frame` answers
//!   `Ok(false)` (without calling `fill`), nothing accepted is lost, and sending
//!   works again once the peer consumed;
//! * [`DeviceStats`] counts exactly the frames accepted and handled, and nothing
//!   rejected on a clean connection;
//! * [`Device::credits_hint`] is what the implementation documents, and more than
//!   the default credits when it is `Some`; remote reads are refused when not
//!   supported;
//! * `arm_sleep` says `false` while frames wait; a doorbell after `arm_sleep` wakes
//!   the sleeper's eventfd (and counts a wake-up), one without it or after
//!   `disarm_sleep` does not;
//! * a peer's shutdown or drop is reported by `check_peer` as
//!   [`DeviceError::PeerGone`] only after every frame it sent was delivered, later
//!   sends fail the same way, and a worker cannot fall asleep on the connection:
//!   [`Device::event_fd`] (if any) polls readable, or, for a device that says its
//!   fd is not level-triggered on a close ([`Harness::event_fd_readable_after_close`]),
//!   `arm_sleep` refuses.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use crate::device::{Device, DeviceError, DeviceStats, FrameWriter, RxFrame};
use crate::notifier::Notifier;
use strait_sys::pattern;

/// Two connected devices made by a [`Harness`].
pub struct Pair<D> {
    /// One end.
    pub a: D,
    /// The other end.
    pub b: D,
    /// The eventfds that a doorbell from the peer signals when `a` (first) or `b`
    /// (second) has armed sleep, if the device wakes sleepers through one.
    pub wake: Option<(Notifier, Notifier)>,
}

/// Makes connected device pairs for the suite.
pub trait Harness {
    /// The device under test.
    type Dev: Device;

    /// Two connected, established ends (any handshake already done, nothing sent).
    fn pair(&mut self) -> Pair<Self::Dev>;

    /// Lets time pass for `devs` (those still alive of the last pair): moves
    /// whatever is in flight one step on. The default does nothing (in-memory
    /// devices need no time).
    fn advance(&mut self, devs: &[&Self::Dev]) {
        let _ = devs;
    }

    /// What [`Device::credits_hint`] must return on these devices, as the
    /// implementation documents it.
    fn expected_credits_hint(&self) -> Option<u16> {
        None
    }

    /// Whether [`Device::event_fd`] stays readable once the peer's close was
    /// reported (a hang-up is level-triggered: shm's liveness socket). A datagram
    /// device's fd is readable while the peer's close is in flight and not after it
    /// was received; such a device must refuse to sleep instead (checked for all).
    fn event_fd_readable_after_close(&self) -> bool {
        true
    }
}

/// The harness of `Box<D>` for the harness of `D`: the boxed device must pass the
/// same suite as the one it wraps.
pub struct Boxed<H>(pub H);

impl<H: Harness> Harness for Boxed<H> {
    type Dev = Box<H::Dev>;

    fn pair(&mut self) -> Pair<Self::Dev> {
        let p = self.0.pair();
        Pair { a: Box::new(p.a), b: Box::new(p.b), wake: p.wake }
    }

    fn advance(&mut self, devs: &[&Self::Dev]) {
        let inner: Vec<&H::Dev> = devs.iter().map(|d| &***d).collect();
        self.0.advance(&inner);
    }

    fn expected_credits_hint(&self) -> Option<u16> {
        self.0.expected_credits_hint()
    }

    fn event_fd_readable_after_close(&self) -> bool {
        self.0.event_fd_readable_after_close()
    }
}

/// Expands to one `#[test]` per conformance check, each running it on a fresh
/// harness made by `$make` (an expression evaluated once per test). Invoke it in a
/// module of its own per implementation.
#[macro_export]
macro_rules! device_conformance {
    ($make:expr) => {
        $crate::device_conformance!(@tests $make;
            frames_arrive_in_order_and_intact,
            an_oversized_frame_is_refused,
            a_full_device_says_so_then_progresses,
            stats_count_frames_exactly,
            hints_are_as_documented,
            arm_sleep_and_doorbell_wake_the_sleeper,
            peer_shutdown_is_reported_after_its_frames,
            peer_drop_is_reported_after_its_frames,
        );
    };
    (@tests $make:expr; $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::$check($make);
            }
        )*
    };
}

/// Upper bound on real time any one wait of the suite takes.
const DEADLINE: Duration = Duration::from_secs(20);
/// Upper bound on progress passes any one wait of the suite takes.
const MAX_PASSES: usize = 2_000_000;

fn copy_out(f: &RxFrame<'_>) -> Vec<u8> {
    let mut v = vec![0u8; f.len()];
    assert!(f.read(0, &mut v), "a received frame cannot be read whole");
    v
}

/// A pair under test plus what each end has received so far.
struct Rig<H: Harness> {
    h: H,
    a: Option<H::Dev>,
    b: H::Dev,
    wake: Option<(Notifier, Notifier)>,
    /// Frames received by `a` (index 0) and `b` (index 1), in arrival order.
    got: [VecDeque<Vec<u8>>; 2],
    passes: usize,
    started: Instant,
    /// Set by a check whose peer `a` closes or is dropped: then `b` may report the
    /// peer gone from any call of a progress pass, not only `check_peer` (a device
    /// that notices by its liveness timeout notices in whichever call runs its
    /// timers first), and the first such report is kept here.
    peer_may_go: bool,
    b_gone: Option<DeviceError>,
}

impl<H: Harness> Rig<H> {
    fn new(mut h: H) -> Self {
        let p = h.pair();
        Rig {
            h,
            a: Some(p.a),
            b: p.b,
            wake: p.wake,
            got: [VecDeque::new(), VecDeque::new()],
            passes: 0,
            started: Instant::now(),
            peer_may_go: false,
            b_gone: None,
        }
    }

    fn a(&mut self) -> &mut H::Dev {
        self.a.as_mut().expect("end a was dropped by this check")
    }

    /// Sends the frame `bytes` from `a` (`from_a`) or `b`; returns whether the
    /// device took it, checking that `fill` ran exactly when it did.
    fn try_send(&mut self, from_a: bool, bytes: &[u8]) -> Result<bool, DeviceError> {
        let dev = if from_a { self.a() } else { &mut self.b };
        let mut filled = 0;
        let took = dev.send_frame(bytes.len(), &mut |w: &mut FrameWriter<'_>| {
            assert_eq!(w.len(), bytes.len(), "fill got a frame of the wrong length");
            w.write(0, bytes);
            filled += 1;
        })?;
        assert_eq!(filled, usize::from(took), "send_frame returned {took} but called fill {filled} times");
        Ok(took)
    }

    /// Sends, making progress passes while the device has no room.
    fn send(&mut self, from_a: bool, bytes: &[u8]) {
        self.wait("room to send", |r| r.try_send(from_a, bytes).expect("send_frame on a healthy pair"));
    }

    /// One progress pass: both ends receive everything they can (kept in `got`),
    /// ring their doorbells, and time moves on.
    fn pump(&mut self) {
        self.passes += 1;
        assert!(
            self.passes < MAX_PASSES && self.started.elapsed() < DEADLINE,
            "the suite made no progress in {} passes / {:?}",
            self.passes,
            self.started.elapsed()
        );
        let Rig { a, b, got, peer_may_go, b_gone, .. } = self;
        if let Some(a) = a.as_mut() {
            while a.recv_frame(&mut |f| got[0].push_back(copy_out(f))).expect("recv_frame at a") {}
            a.doorbell().expect("doorbell at a");
        }
        if b_gone.is_none() {
            let mut pass = || -> Result<(), DeviceError> {
                while b.recv_frame(&mut |f| got[1].push_back(copy_out(f)))? {}
                b.doorbell()
            };
            match pass() {
                Ok(()) => {}
                Err(e @ DeviceError::PeerGone(_)) if *peer_may_go => *b_gone = Some(e),
                Err(e) => panic!("recv_frame or doorbell at b: {e:?}"),
            }
        }
        self.advance();
    }

    fn advance(&mut self) {
        let Rig { h, a, b, .. } = self;
        match a.as_ref() {
            Some(a) => h.advance(&[a, b]),
            None => h.advance(&[b]),
        }
    }

    /// Pumps until `done` says so.
    fn wait(&mut self, what: &str, mut done: impl FnMut(&mut Self) -> bool) {
        let (p0, t0) = (self.passes, Instant::now());
        while !done(self) {
            assert!(self.passes - p0 < MAX_PASSES && t0.elapsed() < DEADLINE, "timed out waiting for {what}");
            self.pump();
        }
    }

    /// Pumps until `side` (0: a, 1: b) has received `n` frames, then checks they
    /// are `expected`, in order, and takes them.
    fn expect_frames(&mut self, side: usize, expected: &[Vec<u8>]) {
        let n = expected.len();
        self.wait("frames to arrive", |r| r.got[side].len() >= n);
        let got: Vec<Vec<u8>> = self.got[side].drain(..).collect();
        assert_eq!(got.len(), n, "more frames arrived than were sent");
        for (i, (g, e)) in got.iter().zip(expected).enumerate() {
            assert_eq!(g.len(), e.len(), "frame {i} arrived with the wrong length");
            assert!(g == e, "frame {i} ({} bytes) arrived corrupted or out of order", e.len());
        }
    }
}

/// The frame sizes every device must carry: 0, 1, small, around a typical
/// header, and the device's maximum (and one less).
fn sizes(max: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [0, 1, 2, 17, 40, 64, 100, 1000, 4096, max.saturating_sub(1), max]
        .into_iter()
        .filter(|&s| s <= max)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Frames of every size class arrive in order and intact, both ways.
pub fn frames_arrive_in_order_and_intact<H: Harness>(h: H) {
    let mut r = Rig::new(h);
    let max = r.a().max_frame_len();
    assert!(max > 0, "max_frame_len is 0");
    assert_eq!(max, r.b.max_frame_len(), "the two ends disagree on max_frame_len");
    for (side, from_a) in [(1, true), (0, false)] {
        let frames: Vec<Vec<u8>> =
            sizes(max).into_iter().enumerate().map(|(i, s)| pattern(i as u64 + 7 * side as u64, s)).collect();
        for f in &frames {
            r.send(from_a, f);
        }
        r.expect_frames(side, &frames);
    }
    // Many small frames interleaved both ways.
    let ab: Vec<Vec<u8>> = (0..200).map(|i| pattern(1000 + i, (i as usize * 13) % 97)).collect();
    let ba: Vec<Vec<u8>> = (0..200).map(|i| pattern(5000 + i, (i as usize * 7) % 53)).collect();
    for (x, y) in ab.iter().zip(&ba) {
        r.send(true, x);
        r.send(false, y);
    }
    r.expect_frames(1, &ab);
    r.expect_frames(0, &ba);
}

/// A frame longer than `max_frame_len` is refused with `FrameTooLong`, without
/// calling `fill` or counting it; the device stays usable.
pub fn an_oversized_frame_is_refused<H: Harness>(h: H) {
    let mut r = Rig::new(h);
    let max = r.a().max_frame_len();
    let before = r.a().stats();
    let mut called = false;
    let res = r.a().send_frame(max + 1, &mut |_| called = true);
    match res {
        Err(DeviceError::FrameTooLong { len, max: m }) => {
            assert_eq!((len, m), (max + 1, max), "FrameTooLong reports the wrong lengths")
        }
        other => panic!("a frame of max_frame_len + 1 bytes gave {other:?}, not FrameTooLong"),
    }
    assert!(!called, "fill was called for a refused frame");
    assert_eq!(r.a().stats().frames_sent, before.frames_sent, "a refused frame was counted as sent");
    let f = pattern(1, 10.min(max));
    r.send(true, &f);
    r.expect_frames(1, &[f]);
}

/// With a peer that does not consume, the device fills up and says so with
/// `Ok(false)` (not an error, not a block, `fill` not called); nothing it accepted
/// is lost, and once the peer consumed, sending works again.
pub fn a_full_device_says_so_then_progresses<H: Harness>(h: H) {
    let mut r = Rig::new(h);
    let len = r.a().max_frame_len().min(1000);
    let mut sent = Vec::new();
    loop {
        let f = pattern(sent.len() as u64, len);
        let took = r.try_send(true, &f).expect("send_frame while the peer is not consuming");
        if !took {
            break;
        }
        sent.push(f);
        assert!(sent.len() < 1_000_000, "a device never says it is full");
    }
    assert!(!sent.is_empty(), "an empty device refused its first frame");
    assert!(
        !r.try_send(true, &pattern(0, len)).expect("send_frame on a full device"),
        "a full device took a frame without the peer consuming"
    );
    assert_eq!(r.a().stats().frames_sent, sent.len() as u64, "frames_sent does not count accepted frames");
    // The peer consumes: everything accepted arrives, and the sender makes progress.
    r.expect_frames(1, &sent);
    let more: Vec<Vec<u8>> = (0..3).map(|i| pattern(1 << 40 | i, len)).collect();
    for f in &more {
        r.send(true, f);
    }
    r.expect_frames(1, &more);
}

/// `frames_sent` and `frames_received` move by one per frame accepted or handled,
/// and no further; nothing is rejected on a clean connection; no remote reads.
pub fn stats_count_frames_exactly<H: Harness>(h: H) {
    let mut r = Rig::new(h);
    let zero = |s: DeviceStats, who: &str| {
        assert_eq!(
            (s.frames_sent, s.frames_received, s.frames_rejected, s.remote_reads),
            (0, 0, 0, 0),
            "{who}: a fresh device's counters are not zero: {s:?}"
        );
    };
    zero(r.a().stats(), "a");
    zero(r.b.stats(), "b");
    let frames: Vec<Vec<u8>> = (0..5).map(|i| pattern(i, 3 + i as usize)).collect();
    for (i, f) in frames.iter().enumerate() {
        r.send(true, f);
        assert_eq!(r.a().stats().frames_sent, i as u64 + 1, "frames_sent after {} frames", i + 1);
    }
    r.expect_frames(1, &frames);
    // Nothing more is waiting: idle receive passes count nothing.
    for _ in 0..3 {
        r.pump();
    }
    let (sa, sb) = (r.a().stats(), r.b.stats());
    assert_eq!(sb.frames_received, 5, "frames_received at b: {sb:?}");
    assert_eq!(sb.frames_sent, 0, "b sent nothing: {sb:?}");
    assert_eq!(sa.frames_received, 0, "a received nothing: {sa:?}");
    assert_eq!((sa.frames_rejected, sb.frames_rejected), (0, 0), "frames rejected on a clean connection");
    assert_eq!((sa.remote_reads, sb.remote_reads), (0, 0), "remote reads counted without any");
    r.pump();
    assert!(r.a().stats().wakeups_sent >= sa.wakeups_sent, "wakeups_sent went backwards");
}

/// `credits_hint` is what the implementation documents (and, when `Some`, more
/// than the default credits); `max_frame_len` is stable; remote reads are refused
/// with `Unsupported` when not supported; `describe` and `timer_ns` answer.
pub fn hints_are_as_documented<H: Harness>(h: H) {
    let mut r = Rig::new(h);
    let want = r.h.expected_credits_hint();
    assert_eq!(r.a().credits_hint(), want, "credits_hint at a");
    assert_eq!(r.b.credits_hint(), want, "credits_hint at b");
    if let Some(c) = want {
        assert!(c > crate::Config::default().credits, "a credits_hint of {c} is not more than the default");
    }
    let max = r.a().max_frame_len();
    let f = pattern(3, 8.min(max));
    r.send(true, &f);
    r.expect_frames(1, &[f]);
    assert_eq!(r.a().max_frame_len(), max, "max_frame_len changed");
    assert_eq!(r.a().credits_hint(), want, "credits_hint changed after traffic");
    let _ = (r.a().describe(), r.a().timer_ns());
    for dev in [r.a.as_mut().expect("end a"), &mut r.b] {
        if !dev.supports_remote_read() {
            let mut x = 0u8;
            // SAFETY: `x` is valid for one byte; the device must refuse anyway.
            let res = unsafe { dev.remote_read(0x1000, &mut x, 1) };
            assert!(matches!(res, Err(DeviceError::Unsupported)), "remote_read without support gave {res:?}");
        }
    }
}

fn readable(fd: RawFd, wait: Duration) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = wait.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR | libc::POLLRDHUP) != 0
}

/// `arm_sleep` answers `false` while frames wait; after `arm_sleep`, the peer's
/// doorbell signals the sleeper's eventfd and counts a wake-up; a doorbell to a
/// peer that is awake, or that withdrew with `disarm_sleep`, does neither.
pub fn arm_sleep_and_doorbell_wake_the_sleeper<H: Harness>(h: H) {
    let mut r = Rig::new(h);
    let f = pattern(9, 16.min(r.a().max_frame_len()));
    // Frames waiting: arm_sleep must say so (once they are visible at b).
    r.send(true, &f);
    r.a().doorbell().expect("doorbell");
    let mut waiting_seen = false;
    for _ in 0..100_000 {
        let idle = r.b.arm_sleep().expect("arm_sleep");
        r.b.disarm_sleep();
        if !idle {
            waiting_seen = true;
            break;
        }
        r.advance();
    }
    assert!(waiting_seen, "arm_sleep kept answering true while a frame was waiting");
    r.expect_frames(1, &[f]);
    let Some((_, wake_b)) = r.wake.take() else {
        return;
    };
    for _ in 0..3 {
        r.pump();
    }
    wake_b.drain();
    // An awake peer: no wake-up.
    let w0 = r.a().stats().wakeups_sent;
    let g = pattern(10, 4.min(r.a().max_frame_len()));
    r.send(true, &g);
    r.a().doorbell().expect("doorbell");
    assert!(!readable(wake_b.as_raw_fd(), Duration::ZERO), "a doorbell woke a peer that did not sleep");
    assert_eq!(r.a().stats().wakeups_sent, w0, "wakeups_sent counted a doorbell to an awake peer");
    r.expect_frames(1, std::slice::from_ref(&g));
    for _ in 0..3 {
        r.pump();
    }
    wake_b.drain();
    // Armed, then withdrawn: no wake-up.
    assert!(r.b.arm_sleep().expect("arm_sleep"), "arm_sleep with nothing waiting said frames wait");
    r.b.disarm_sleep();
    r.send(true, &g);
    r.a().doorbell().expect("doorbell");
    assert!(!readable(wake_b.as_raw_fd(), Duration::ZERO), "a doorbell woke a peer that disarmed sleep");
    r.expect_frames(1, std::slice::from_ref(&g));
    for _ in 0..3 {
        r.pump();
    }
    wake_b.drain();
    // Armed: the doorbell wakes it.
    let w0 = r.a().stats().wakeups_sent;
    assert!(r.b.arm_sleep().expect("arm_sleep"), "arm_sleep with nothing waiting said frames wait");
    assert!(r.try_send(true, &g).expect("send_frame"), "an empty device refused a frame");
    r.a().doorbell().expect("doorbell");
    assert!(
        readable(wake_b.as_raw_fd(), Duration::from_secs(5)),
        "a doorbell after arm_sleep did not wake the peer"
    );
    assert!(r.a().stats().wakeups_sent > w0, "a doorbell that woke the peer was not counted in wakeups_sent");
    r.b.disarm_sleep();
    r.expect_frames(1, &[g]);
}

fn peer_gone_after_frames<H: Harness>(h: H, drop_it: bool) {
    let mut r = Rig::new(h);
    let max = r.a().max_frame_len();
    let frames: Vec<Vec<u8>> = (0..3).map(|i| pattern(40 + i, (10 * i as usize).min(max))).collect();
    for f in &frames {
        r.send(true, f);
    }
    r.a().doorbell().expect("doorbell");
    r.peer_may_go = true;
    if drop_it {
        drop(r.a.take());
    } else {
        r.a().shutdown();
    }
    let mut gone = None;
    r.wait("the peer's close to be reported", |r| {
        if let Some(a) = r.a.as_mut() {
            a.drain();
        }
        if let Some(e) = r.b_gone.take() {
            gone = Some((e, r.got[1].len()));
            return true;
        }
        match r.b.check_peer() {
            Ok(()) => false,
            Err(e) => {
                gone = Some((e, r.got[1].len()));
                true
            }
        }
    });
    let (e, delivered) = gone.expect("wait ended");
    assert!(matches!(e, DeviceError::PeerGone(_)), "a closed peer was reported as {e:?}, not PeerGone");
    assert_eq!(delivered, frames.len(), "PeerGone was reported before every frame the peer sent arrived");
    r.expect_frames(1, &frames);
    let res = r.try_send(false, &[1, 2, 3]);
    assert!(matches!(res, Err(DeviceError::PeerGone(_))), "sending to a closed peer gave {res:?}");
    // A worker must not go to sleep on a connection whose peer is gone: either
    // arm_sleep refuses, or the fd it sleeps on stays readable.
    let sleeps = r.b.arm_sleep();
    if matches!(sleeps, Ok(true)) {
        r.b.disarm_sleep();
    }
    let level = r.h.event_fd_readable_after_close();
    assert!(level || !matches!(sleeps, Ok(true)), "arm_sleep lets a worker sleep on a closed peer");
    if let Some(fd) = r.b.event_fd().filter(|_| level) {
        assert!(readable(fd, Duration::from_secs(5)), "event_fd is not readable after the peer closed");
    }
}

/// After the peer's `shutdown`, every frame it sent arrives, then `check_peer`
/// reports `PeerGone`; sends fail the same way; a worker cannot fall asleep on it
/// (`event_fd`, if any, stays readable, or `arm_sleep` refuses).
pub fn peer_shutdown_is_reported_after_its_frames<H: Harness>(h: H) {
    peer_gone_after_frames(h, false)
}

/// As [`peer_shutdown_is_reported_after_its_frames`], when the peer is dropped.
pub fn peer_drop_is_reported_after_its_frames<H: Harness>(h: H) {
    peer_gone_after_frames(h, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loopback::LoopbackDevice;

    /// Loopback pairs with the wake eventfds wired as a worker would.
    pub(super) struct LoopbackHarness;

    impl Harness for LoopbackHarness {
        type Dev = LoopbackDevice;
        fn pair(&mut self) -> Pair<LoopbackDevice> {
            let (mut a, mut b) = LoopbackDevice::pair(64 << 10);
            let wa = Notifier::new().expect("eventfd");
            let wb = Notifier::new().expect("eventfd");
            a.set_wake_fd(wa.as_raw_fd());
            b.set_wake_fd(wb.as_raw_fd());
            Pair { a, b, wake: Some((wa, wb)) }
        }
    }

    mod loopback {
        use super::*;
        crate::device_conformance!(LoopbackHarness);
    }

    mod boxed_loopback {
        use super::*;
        crate::device_conformance!(Boxed(LoopbackHarness));
    }
}
