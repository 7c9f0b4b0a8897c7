//! Congestion control for the reliability layer: CUBIC (RFC 9438) in packets, with
//! pacing.
//!
//! Flow control (the peer's window) keeps a sender from overrunning its receiver;
//! it does nothing for the path. On a shared or slower link a sender limited only by
//! the window fills the bottleneck's queue, loses packets in bursts, and takes the
//! capacity from everyone else, TCP included. So the reliability layer also keeps a
//! congestion window, the algorithm Linux's TCP uses by default, and paces what the
//! window allows as Linux's TCP does, so that a strait flow and a kernel TCP flow on
//! one bottleneck converge to equal shares:
//!
//! * **Slow start** from [`INITIAL_WINDOW`] packets: +1 per packet acknowledged,
//!   until the first loss or `ssthresh`.
//! * **Congestion avoidance**: the window follows `W(t) = C (t - K)^3 + W_max`
//!   (`C` = [`C`], `t` the time since the last reduction, `K` the time the curve takes
//!   back to `W_max`, the window before it), concave below `W_max` and convex above,
//!   never slower than the Reno-friendly estimate `W_est` (RFC 9438 section 4.3).
//! * **A loss** (fast retransmission, at most once per round trip: the recovery
//!   episode lasts until everything sent before it is acknowledged) multiplies the
//!   window by [`BETA`] (fast convergence lowers `W_max` further when the window had
//!   not regained the last `W_max`); the window does not grow during recovery. The
//!   window limits the packets in the network (RFC 6675's pipe: sent, not yet
//!   acknowledged, not selectively acknowledged), so new data keeps flowing while the
//!   holes are repaired instead of the whole reduced window leaving at once when the
//!   last hole fills.
//! * **A retransmission timeout** restarts from one packet in slow start. A timeout
//!   that proves spurious (the reliability layer sees a packet the timeout queued for
//!   retransmission acknowledged before it was resent: the first copy arrived, F-RTO's
//!   reasoning, RFC 5682; [`Cubic::undo_timeout`]) gives the window back: a round trip
//!   that grew with a filling queue is not a loss. A tail loss probe (RFC 8985),
//!   which the reliability layer sends instead of waiting for a timeout, reduces
//!   nothing by itself (without duplicate reports a repaired tail cannot be told
//!   from a late acknowledgement); the holes it reveals do, as losses.
//! * **Pacing** ([`Pacer`]): packets leave at `gain * cwnd / srtt`, the gain
//!   [`PACING_GAIN_SS`] in slow start and [`PACING_GAIN_CA`] after (Linux's
//!   `tcp_pacing_ss_ratio` and `tcp_pacing_ca_ratio`), at most [`PACING_BURST`]
//!   packets or [`PACING_BURST_NS`] of the rate back to back after an idle spell
//!   (the slack of a sleeping sender's wake-up). Without it a window leaves at the
//!   sender's link rate and arrives at the bottleneck as one burst: into a queue that
//!   a paced or small-queue-limited TCP flow keeps nearly full, a burst loses several
//!   packets where the TCP flow loses one, and the burstier flow ends with the
//!   smaller share (docs/PERFORMANCE.md section 16). Before the first round-trip
//!   sample there is no rate: nothing is paced.
//!
//! * **ECN** (RFC 3168's response, QUIC's counting): a path that marks packets
//!   Congestion Experienced instead of dropping them is answered as a loss is, one
//!   reduction per recovery episode, with nothing to resend. The reliability layer
//!   counts the marks its link saw and echoes the count in every packet header; the
//!   sender calls [`Cubic::on_loss`] when the echo grows.
//!
//! Not done: HyStart.
//! Pure arithmetic, time passed in (sans-IO: the caller asks [`Pacer::next_send_ns`]
//! when to come back): tested here and on the simulator's shared bottleneck
//! (`crates/strait-sim/tests/congestion.rs`), and against kernel TCP through a `tc`
//! bottleneck (`crates/strait-udp/tests/congestion.rs`).

/// Packets a connection may send before its first acknowledgement (RFC 6928's ten).
pub const INITIAL_WINDOW: f64 = 10.0;
/// CUBIC's multiplicative decrease.
pub const BETA: f64 = 0.7;
/// CUBIC's scaling constant, in packets per second cubed.
pub const C: f64 = 0.4;
/// The smallest window.
const MIN_WINDOW: f64 = 2.0;
/// Pacing gain in slow start: the window doubles per round trip, so packets leave at
/// twice the rate the last round trip delivered.
pub const PACING_GAIN_SS: f64 = 2.0;
/// Pacing gain in congestion avoidance: a little above the window's rate, so that
/// pacing never becomes the limit (the window is).
pub const PACING_GAIN_CA: f64 = 1.2;
/// Full packets a pacer lets go back to back after an idle spell.
pub const PACING_BURST: u64 = 4;
/// ... or this much of the pacing rate, if more: a sender woken from a sleep comes
/// back tens of microseconds late, and some drivers wake on a millisecond clock
/// (the bridges of `strait run` time their passes in milliseconds); Linux's TCP
/// too sends about a millisecond of its rate per segment offload.
pub const PACING_BURST_NS: u64 = 1_000_000;

/// Which congestion control the reliability layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    /// CUBIC (the default).
    Cubic,
    /// None: only the window and the peer's window limit the sender (a dedicated
    /// link, or measurements of the protocol alone).
    Off,
}

/// One connection's CUBIC state.
#[derive(Debug, Clone, PartialEq)]
pub struct Cubic {
    cwnd: f64,
    ssthresh: f64,
    w_max: f64,
    /// Seconds from the start of the epoch to the plateau at `w_max`.
    k: f64,
    /// Start of the current congestion-avoidance epoch (ns), once one began.
    epoch_ns: Option<u64>,
    /// The Reno-friendly window estimate.
    w_est: f64,
    /// Window reductions for losses so far.
    reductions: u64,
    /// Restarts after retransmission timeouts so far.
    timeouts: u64,
    /// Spurious timeouts undone so far.
    undone: u64,
    /// The state before the last retransmission timeout, until the recovery from it
    /// ends (kept to undo a spurious one).
    before_timeout: Option<Box<Cubic>>,
}

impl Default for Cubic {
    fn default() -> Self {
        Cubic::new()
    }
}

impl Cubic {
    /// A connection that has sent nothing yet.
    pub fn new() -> Self {
        Cubic {
            cwnd: INITIAL_WINDOW,
            ssthresh: f64::INFINITY,
            w_max: 0.0,
            k: 0.0,
            epoch_ns: None,
            w_est: 0.0,
            reductions: 0,
            timeouts: 0,
            undone: 0,
            before_timeout: None,
        }
    }

    /// Packets that may be unacknowledged now.
    pub fn window(&self) -> u32 {
        self.cwnd.max(MIN_WINDOW).min(u32::MAX as f64) as u32
    }

    /// True while in slow start.
    pub fn slow_start(&self) -> bool {
        self.cwnd < self.ssthresh
    }

    /// Window reductions for losses, and restarts after timeouts, so far.
    pub fn events(&self) -> (u64, u64) {
        (self.reductions, self.timeouts)
    }

    /// `acked` packets were newly acknowledged at `now_ns`; `srtt_ns` is the
    /// smoothed round trip (0 before any sample). The caller does not call this
    /// during a recovery episode.
    pub fn on_ack(&mut self, acked: usize, now_ns: u64, srtt_ns: u64) {
        if acked == 0 {
            return;
        }
        let acked = acked as f64;
        if self.slow_start() {
            self.cwnd = (self.cwnd + acked).min(self.ssthresh.max(self.cwnd));
            if self.cwnd < self.ssthresh {
                return;
            }
        }
        let epoch = *self.epoch_ns.get_or_insert_with(|| {
            // A first epoch without a loss (slow start ended at ssthresh): the curve
            // starts at the current window.
            if self.w_max < self.cwnd {
                self.w_max = self.cwnd;
                self.k = 0.0;
                self.w_est = self.cwnd;
            }
            now_ns
        });
        let rtt = srtt_ns as f64 / 1e9;
        // RFC 9438 4.2: the target one round trip ahead.
        let t = now_ns.saturating_sub(epoch) as f64 / 1e9 + rtt;
        let target = (C * (t - self.k).powi(3) + self.w_max).clamp(self.cwnd, 1.5 * self.cwnd);
        // 4.3: the Reno-friendly estimate grows by alpha per window acknowledged.
        let alpha = 3.0 * (1.0 - BETA) / (1.0 + BETA);
        self.w_est += alpha * acked / self.cwnd;
        if self.w_est > self.cwnd {
            self.cwnd = self.w_est;
        } else {
            self.cwnd += (target - self.cwnd) / self.cwnd * acked;
        }
    }

    /// The recovery from the last timeout ended: it can no longer be undone.
    pub fn timeout_recovered(&mut self) {
        self.before_timeout = None;
    }

    /// A loss was detected (the first of a recovery episode) at `now_ns`.
    pub fn on_loss(&mut self, now_ns: u64) {
        let _ = now_ns;
        self.before_timeout = None;
        self.reductions += 1;
        // Fast convergence (4.7): a flow that lost before regaining its last W_max
        // releases bandwidth for newcomers.
        self.w_max = if self.cwnd < self.w_max { self.cwnd * (1.0 + BETA) / 2.0 } else { self.cwnd };
        self.cwnd = (self.cwnd * BETA).max(MIN_WINDOW);
        self.ssthresh = self.cwnd;
        self.k = (self.w_max * (1.0 - BETA) / C).cbrt();
        self.w_est = self.cwnd;
        self.epoch_ns = None;
    }

    /// Nanoseconds between two full packets at the pacing rate, `gain * cwnd /
    /// srtt`; 0 (no pacing) before a round trip was measured.
    pub fn pacing_interval_ns(&self, srtt_ns: u64) -> u64 {
        let gain = if self.slow_start() { PACING_GAIN_SS } else { PACING_GAIN_CA };
        (srtt_ns as f64 / (gain * self.cwnd.max(MIN_WINDOW))) as u64
    }

    /// The last retransmission timeout was spurious (the packets it resent had
    /// arrived: only the round trip had grown): the window, threshold and curve go
    /// back to what they were before it.
    pub fn undo_timeout(&mut self) {
        if let Some(saved) = self.before_timeout.take() {
            let (reductions, timeouts) = (self.reductions, self.timeouts);
            *self = *saved;
            self.reductions = reductions;
            self.timeouts = timeouts;
            self.undone += 1;
        }
    }

    /// Spurious timeouts undone so far.
    pub fn undone(&self) -> u64 {
        self.undone
    }

    /// The retransmission timer expired: one packet, slow start up to half the
    /// window (4.8).
    pub fn on_timeout(&mut self) {
        // A second timeout in a row keeps the state from before the first.
        if self.before_timeout.is_none() {
            let mut saved = self.clone();
            saved.before_timeout = None;
            self.before_timeout = Some(Box::new(saved));
        }
        self.timeouts += 1;
        self.ssthresh = (self.cwnd * BETA).max(MIN_WINDOW);
        self.w_max = self.cwnd;
        self.k = (self.w_max * (1.0 - BETA) / C).cbrt();
        self.cwnd = 1.0;
        self.w_est = self.cwnd;
        self.epoch_ns = None;
    }
}

/// Spaces a connection's packets in time (sans-IO: time passed in). An
/// earliest-departure clock: each packet sent moves the next departure a gap later,
/// from no earlier than a burst's worth before now, so an idle pacer lends at most
/// [`PACING_BURST`] packets (or [`PACING_BURST_NS`]) back to back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pacer {
    next_ns: u64,
}

impl Pacer {
    /// A pacer that lets the first packet go at once.
    pub fn new() -> Self {
        Pacer { next_ns: 0 }
    }

    /// When the next packet may leave (at or before `now`: at once).
    pub fn next_send_ns(&self) -> u64 {
        self.next_ns
    }

    /// True if a packet may leave at `now_ns`.
    pub fn ready(&self, now_ns: u64) -> bool {
        self.next_ns <= now_ns
    }

    /// A packet of `len` bytes left at `now_ns`; `interval_ns` is the gap after a
    /// packet of `full_len` bytes (0: unpaced).
    pub fn on_send(&mut self, now_ns: u64, len: usize, full_len: usize, interval_ns: u64) {
        if interval_ns == 0 {
            self.next_ns = now_ns;
            return;
        }
        // The first packet of a burst costs a gap too: PACING_BURST - 1 gaps banked.
        let bank = ((PACING_BURST - 1) * interval_ns).max(PACING_BURST_NS);
        let gap = (interval_ns as u128 * len as u128 / full_len.max(1) as u128) as u64;
        self.next_ns = self.next_ns.max(now_ns.saturating_sub(bank)) + gap;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn slow_start_doubles_per_round_trip_until_a_loss() {
        let mut c = Cubic::new();
        let mut now = 0;
        for _ in 0..4 {
            let w = c.window() as usize;
            c.on_ack(w, now, MS);
            now += MS;
        }
        assert_eq!(c.window(), 160, "10 doubled four times");
        c.on_loss(now);
        assert_eq!(c.window(), 112, "times beta");
        assert!(!c.slow_start());
    }

    #[test]
    fn after_a_loss_the_window_returns_to_w_max_after_k_then_probes_beyond() {
        let mut c = Cubic::new();
        c.cwnd = 100.0;
        c.ssthresh = 100.0;
        c.on_loss(0);
        assert_eq!(c.window(), 70);
        let k = c.k;
        assert!((k - (100.0 * 0.3 / 0.4f64).cbrt()).abs() < 1e-9, "K = cbrt(W_max (1 - beta) / C)");
        // One ack per window per 10 ms round trip, for K seconds plus a bit.
        let rtt = 10 * MS;
        let mut now = 0;
        while (now as f64) < (k + 0.2) * 1e9 {
            let w = c.window() as usize;
            c.on_ack(w, now, rtt);
            now += rtt;
        }
        assert!(c.window() >= 99, "back at W_max after K: {}", c.window());
        let at_plateau = c.window();
        for _ in 0..200 {
            let w = c.window() as usize;
            c.on_ack(w, now, rtt);
            now += rtt;
        }
        assert!(c.window() > at_plateau + 10, "no probing beyond W_max: {}", c.window());
    }

    #[test]
    fn a_timeout_restarts_from_one_packet() {
        let mut c = Cubic::new();
        c.cwnd = 64.0;
        c.on_timeout();
        assert_eq!(c.cwnd, 1.0);
        assert!(c.slow_start());
        assert_eq!(c.window(), 2, "never below the minimum window");
        c.on_ack(10, 0, MS);
        assert!(c.cwnd <= c.ssthresh.max(11.0));
        assert_eq!(c.events(), (0, 1));
    }

    #[test]
    fn a_spurious_timeout_is_undone() {
        let mut c = Cubic::new();
        c.cwnd = 64.0;
        c.ssthresh = 64.0;
        let before = c.clone();
        c.on_timeout();
        c.on_timeout();
        assert_eq!(c.window(), 2);
        c.undo_timeout();
        assert_eq!(c.window(), 64);
        assert_eq!(c.ssthresh, before.ssthresh);
        assert_eq!(c.events(), (0, 2), "the timeouts still count");
        assert_eq!(c.undone(), 1);
        c.undo_timeout();
        assert_eq!(c.undone(), 1, "nothing left to undo");
    }

    #[test]
    fn the_pacer_spaces_packets_after_a_burst() {
        let mut p = Pacer::new();
        let gap = 1_000_000; // 1 ms per full packet
        let mut now = 100_000_000;
        // Idle: PACING_BURST packets go back to back (3 gaps banked > PACING_BURST_NS).
        let mut burst = 0;
        while p.ready(now) {
            p.on_send(now, 1500, 1500, gap);
            burst += 1;
        }
        assert_eq!(burst, PACING_BURST);
        // At a high rate, PACING_BURST_NS of it.
        let mut fast = Pacer::new();
        let mut n = 0;
        while fast.ready(now) {
            fast.on_send(now, 1500, 1500, 10_000);
            n += 1;
        }
        assert_eq!(n, PACING_BURST_NS / 10_000 + 1);
        // Then one per gap.
        now = p.next_send_ns();
        p.on_send(now, 1500, 1500, gap);
        assert!(!p.ready(now + gap - 1));
        assert!(p.ready(now + gap));
        // A small packet costs its share of the gap.
        let t = p.next_send_ns();
        p.on_send(t, 150, 1500, gap);
        assert_eq!(p.next_send_ns(), t + gap / 10);
        // Unpaced: always ready.
        let mut u = Pacer::new();
        u.on_send(5, 1500, 1500, 0);
        assert!(u.ready(5));
    }

    #[test]
    fn pacing_rate_follows_window_and_round_trip() {
        let mut c = Cubic::new();
        assert_eq!(c.pacing_interval_ns(0), 0, "no round trip, no pacing");
        // Slow start: 10 packets per 1 ms at gain 2: 50 us apart.
        assert_eq!(c.pacing_interval_ns(1_000_000), 50_000);
        c.on_loss(0);
        // 7 packets at gain 1.2.
        assert_eq!(c.pacing_interval_ns(1_000_000), (1e6 / (1.2 * 7.0)) as u64);
    }

    #[test]
    fn fast_convergence_lowers_w_max_for_a_flow_that_had_not_recovered() {
        let mut c = Cubic::new();
        c.cwnd = 100.0;
        c.on_loss(0);
        // Loses again at 80 (below the last W_max of 100).
        c.cwnd = 80.0;
        c.on_loss(1);
        assert!((c.w_max - 80.0 * 1.7 / 2.0).abs() < 1e-9);
    }
}
