//! Congestion control for the reliability layer: CUBIC (RFC 9438), in packets.
//!
//! Flow control (the peer's window) keeps a sender from overrunning its receiver;
//! it does nothing for the path. On a shared or slower link a sender limited only by
//! the window fills the bottleneck's queue, loses packets in bursts, and takes the
//! capacity from everyone else, TCP included. So the reliability layer also keeps a
//! congestion window, the algorithm Linux's TCP uses by default, so that a strait
//! flow and a kernel TCP flow on one bottleneck converge to equal shares:
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
//!   not regained the last `W_max`); the window does not grow during recovery.
//! * **A retransmission timeout** restarts from one packet in slow start.
//!
//! Not done: pacing (bursts leave at the link's rate) and ECN (the udp device does
//! not set or read ECN codepoints yet). Pure arithmetic, time passed in: tested here
//! and on the simulator's shared bottleneck (`crates/strait-sim/tests/congestion.rs`).

/// Packets a connection may send before its first acknowledgement (RFC 6928's ten).
pub const INITIAL_WINDOW: f64 = 10.0;
/// CUBIC's multiplicative decrease.
pub const BETA: f64 = 0.7;
/// CUBIC's scaling constant, in packets per second cubed.
pub const C: f64 = 0.4;
/// The smallest window.
const MIN_WINDOW: f64 = 2.0;

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

    /// A loss was detected (the first of a recovery episode) at `now_ns`.
    pub fn on_loss(&mut self, now_ns: u64) {
        let _ = now_ns;
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

    /// The retransmission timer expired: one packet, slow start up to half the
    /// window (4.8).
    pub fn on_timeout(&mut self) {
        self.timeouts += 1;
        self.ssthresh = (self.cwnd * BETA).max(MIN_WINDOW);
        self.w_max = self.cwnd;
        self.k = (self.w_max * (1.0 - BETA) / C).cbrt();
        self.cwnd = 1.0;
        self.w_est = self.cwnd;
        self.epoch_ns = None;
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
