//! The reliability layer's congestion control (CUBIC, `strait_core::congestion`) on
//! the simulator: bulk flows of `Reliable<SimLink>` through a 100 Mbit/s bottleneck
//! with a 1 ms one-way delay and a 64 KiB drop-tail queue (about 2.6 times the
//! path's bandwidth-delay product), on virtual time. Each check has its control:
//! the same run with congestion control off.

use strait_core::congestion::Congestion;
use strait_core::{Device, Reliable, ReliableConfig};
use strait_sim::{DirId, LinkConfig, LinkParams, SimLink, SimNet};

const MBIT: u64 = 1_000_000;
const BANDWIDTH: u64 = 100 * MBIT;
const FRAME: usize = 16 << 10;
const MS: u64 = 1_000_000;

fn bottleneck() -> LinkParams {
    LinkParams { latency_ns: MS, bandwidth_bps: BANDWIDTH, queue_bytes: 64 << 10, ..LinkParams::default() }
}

/// One bulk flow: `tx` sends frames as fast as it may, `rx` takes them.
struct Flow {
    tx: Reliable<SimLink>,
    rx: Reliable<SimLink>,
    /// Bytes delivered to the receiver, and when the flow starts sending.
    delivered: u64,
    start_ns: u64,
}

impl Flow {
    fn new(net: &SimNet, host: usize, cc: Congestion, start_ns: u64) -> Flow {
        let rel = ReliableConfig { congestion: cc, ..ReliableConfig::default() };
        let (tx, rx) = net.reliable_pair(host, host + 1, bottleneck(), &LinkConfig::default(), &rel);
        Flow { tx, rx, delivered: 0, start_ns }
    }

    /// One pass: handshake, acknowledgements and timers at both ends; new frames
    /// while the sender may.
    fn step(&mut self, now: u64) {
        let Flow { tx, rx, delivered, start_ns } = self;
        while rx.recv_frame(&mut |f| *delivered += f.len() as u64).expect("receiver") {}
        while tx.recv_frame(&mut |_| panic!("data on the way back")).expect("sender") {}
        if now >= *start_ns && tx.is_established() {
            while tx.send_frame(FRAME, &mut |w| w.write(0, &[0x5a; FRAME])).expect("send") {}
        }
        for d in [&mut *tx, &mut *rx] {
            d.check_peer().expect("timers");
            d.doorbell().expect("doorbell");
        }
    }
}

/// Runs `flows` until `until_ns`, calling `at` with the delivered bytes of each flow
/// every time it passes one of `marks` (virtual times).
fn run(net: &SimNet, flows: &mut [Flow], until_ns: u64, marks: &[u64]) -> Vec<Vec<u64>> {
    let mut seen = Vec::new();
    let mut next_mark = 0;
    loop {
        let now = net.now_ns();
        while next_mark < marks.len() && now >= marks[next_mark] {
            seen.push(flows.iter().map(|f| f.delivered).collect());
            next_mark += 1;
        }
        if now >= until_ns {
            return seen;
        }
        for f in flows.iter_mut() {
            f.step(now);
        }
        let timers = flows
            .iter()
            .flat_map(|f| [f.tx.timer_ns(), f.rx.timer_ns()])
            .flatten()
            .map(|t| now.saturating_add(t.max(1)));
        let starts = flows.iter().map(|f| f.start_ns).filter(|&s| s > now);
        let next = net.next_event_ns().into_iter().chain(timers).chain(starts).min().unwrap_or(until_ns);
        net.advance_to(next.clamp(now + 1, until_ns).max(now + 1));
    }
}

fn mbit_per_s(bytes: u64, ns: u64) -> f64 {
    bytes as f64 * 8.0 / (ns as f64 / 1e9) / 1e6
}

/// One flow through the bottleneck: CUBIC fills it (>= 85% of the rate over the last
/// second) with few drops at the queue; without congestion control the 512-packet
/// window overruns the 46-packet queue again and again.
#[test]
fn one_flow_fills_the_bottleneck_without_overrunning_its_queue() {
    let mut results = Vec::new();
    for cc in [Congestion::Cubic, Congestion::Off] {
        let net = SimNet::new(7);
        let mut flows = [Flow::new(&net, 0, cc, 0)];
        let start = net.now_ns();
        let seen = run(&net, &mut flows, start + 3000 * MS, &[start + 2000 * MS, start + 3000 * MS]);
        let rate = mbit_per_s(seen[1][0] - seen[0][0], 1000 * MS);
        let st = net.dir_stats(DirId(0));
        let drop_pct = 100.0 * st.queue_drops as f64 / st.sent.max(1) as f64;
        eprintln!(
            "{cc:?}: {rate:.1} Mbit/s, {} of {} datagrams dropped at the queue",
            st.queue_drops, st.sent
        );
        results.push((rate, drop_pct, flows[0].tx.rstats()));
    }
    let (cubic_rate, cubic_drops, cubic) = results[0];
    let (_, off_drops, _) = results[1];
    assert!(cubic_rate >= 85.0, "CUBIC used {cubic_rate:.1} of 100 Mbit/s");
    assert!(cubic.cc_reductions > 0, "no loss ever reduced the window: {cubic:?}");
    assert!(cubic_drops < 2.0, "CUBIC lost {cubic_drops:.2}% of its datagrams at the queue");
    assert!(off_drops > 4.0 * cubic_drops, "the control: without congestion control {off_drops:.2}% dropped");
}

/// Two flows through one bottleneck, the second starting 1 s after the first: over
/// the last 2 s of 6 they share it (Jain's index >= 0.9) and fill it.
#[test]
fn two_flows_share_one_bottleneck_fairly() {
    let net = SimNet::new(11);
    let t0 = net.now_ns();
    let mut flows =
        [Flow::new(&net, 0, Congestion::Cubic, t0), Flow::new(&net, 2, Congestion::Cubic, t0 + 1000 * MS)];
    // Pair 0 is hosts 0-1, pair 1 hosts 2-3: their data directions share the port.
    net.share_bottleneck(&[DirId(0), DirId(2)]);
    let seen = run(&net, &mut flows, t0 + 6000 * MS, &[t0 + 4000 * MS, t0 + 6000 * MS]);
    let rates: Vec<f64> = (0..2).map(|i| mbit_per_s(seen[1][i] - seen[0][i], 2000 * MS)).collect();
    let (sum, sq) = (rates.iter().sum::<f64>(), rates.iter().map(|r| r * r).sum::<f64>());
    let jain = sum * sum / (2.0 * sq);
    eprintln!("rates {rates:.1?} Mbit/s, Jain {jain:.3}");
    assert!(jain >= 0.9, "unfair share: {rates:.1?} Mbit/s (Jain {jain:.3})");
    assert!(sum >= 85.0, "together they used {sum:.1} of 100 Mbit/s");
}

/// 1% random loss (not congestion) on the path: the flow keeps moving at a useful
/// rate instead of collapsing, and everything still arrives (the reliability layer).
#[test]
fn random_loss_does_not_collapse_the_flow() {
    let net = SimNet::new(5);
    let mut flows = [Flow::new(&net, 0, Congestion::Cubic, 0)];
    let lossy = LinkParams { loss: 0.01, queue_bytes: 0, ..bottleneck() };
    net.set_params(DirId(0), lossy);
    let t0 = net.now_ns();
    let seen = run(&net, &mut flows, t0 + 3000 * MS, &[t0 + 1000 * MS, t0 + 3000 * MS]);
    let rate = mbit_per_s(seen[1][0] - seen[0][0], 2000 * MS);
    let st = flows[0].tx.rstats();
    eprintln!("{rate:.1} Mbit/s under 1% loss; {st:?}");
    assert!(st.fast_retransmits > 0 && st.cc_reductions > 0, "{st:?}");
    assert!(rate >= 30.0, "the flow collapsed under 1% random loss: {rate:.1} Mbit/s");
}

/// ECN: the bottleneck marks the datagrams of ECN-capable links that find 32 KiB
/// (half its queue) queued ahead of them, as a switch marks instead of letting its
/// queue fill. With ECN-capable links the flow still fills the bottleneck (>= 85%),
/// its window reductions come from the marks, after the first second (slow start's
/// overshoot) no datagram is dropped at the queue, and the round trip is shorter.
/// The control: the same flow with links that are not ECN-capable is never marked,
/// fills the 64 KiB queue and loses datagrams at it. (Marking at 16 KiB held the
/// window near 20 packets, under two of the flow's 12-packet frames, and the frame
/// admission of `Reliable` then left the link idle 40% of the time:
/// docs/PERFORMANCE.md section 46.)
#[test]
fn ecn_marks_keep_the_queue_short_without_drops() {
    let mut results = Vec::new();
    for ecn in [true, false] {
        let net = SimNet::new(13);
        let params = LinkParams { ecn_mark_bytes: 32 << 10, ..bottleneck() };
        let cfg = LinkConfig { ecn, ..LinkConfig::default() };
        let (tx, rx) = net.reliable_pair(0, 1, params, &cfg, &ReliableConfig::default());
        let mut flows = [Flow { tx, rx, delivered: 0, start_ns: 0 }];
        let t0 = net.now_ns();
        let first = run(&net, &mut flows, t0 + 1000 * MS, &[t0 + 1000 * MS]);
        let before = net.dir_stats(DirId(0));
        let rest = run(&net, &mut flows, t0 + 3000 * MS, &[t0 + 3000 * MS]);
        let after = net.dir_stats(DirId(0));
        let rate = mbit_per_s(rest[0][0] - first[0][0], 2000 * MS);
        let drops = after.queue_drops - before.queue_drops;
        let st = flows[0].tx.rstats();
        eprintln!(
            "ECN {ecn}: {rate:.1} Mbit/s over the last 2 s, {drops} drops at the queue then ({} in all), \
             {} datagrams marked, {} marks echoed, {} reductions ({} for marks), srtt {} us",
            after.queue_drops,
            after.ce_marked,
            st.ce_echoed,
            st.cc_reductions,
            st.cc_ecn_reductions,
            st.srtt_ns / 1000
        );
        results.push((rate, drops, after.ce_marked, st));
    }
    let (rate, drops, marked, ecn) = results[0];
    let (_, control_drops, control_marked, control) = results[1];
    assert!(rate >= 85.0, "with ECN the flow used {rate:.1} of 100 Mbit/s");
    assert!(marked > 0 && ecn.ce_echoed > 0 && ecn.cc_ecn_reductions > 0, "no ECN at work: {ecn:?}");
    assert_eq!(drops, 0, "with ECN, datagrams were still dropped at the queue: {ecn:?}");
    assert!(ecn.srtt_ns < control.srtt_ns, "the queue was not kept shorter: {ecn:?} against {control:?}");
    assert_eq!((control_marked, control.ce_echoed, control.cc_ecn_reductions), (0, 0, 0), "{control:?}");
    assert!(control_drops > 0, "the control never filled its queue: {control:?}");
}
