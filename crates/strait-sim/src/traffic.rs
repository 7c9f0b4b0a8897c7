//! A checked traffic scenario: pairs of endpoints over the simulated network, each
//! direction a stream of numbered messages whose every byte is verified.
//!
//! Each message carries a header (stream, sequence number, length, a checksum of
//! the payload) followed by a payload that is a pure function of the seed, the
//! stream and the sequence number. All messages of a stream use one tag, and
//! receives are posted in order, so the k-th receive must get message k: any loss,
//! duplication, reordering or corruption that got past the reliability layer shows
//! up as a wrong sequence number, a wrong length or wrong bytes. Every operation
//! must complete exactly once; in a run without failures every status must be
//! [`Status::Ok`], and in a run with failures every message is either delivered
//! intact or its operations end with an error status (or its post is refused
//! because the endpoint already failed), never silently lost.

use std::time::{Duration, Instant};

use strait_core::reliable::{Reliable, ReliableConfig, ReliableStats};
use strait_core::{Completion, Config, Engine, EpId, MemoryRegion, OpKind, PostError, Status};

use crate::driver::{Handler, Limits, RunStats, Sim, SimError};
use crate::net::{DirStats, LinkConfig, LinkParams, PairId, SimLink, SimNet, Tracer};
use crate::rng::{mix, SimRng};

/// A simulated host's engine over the reliability layer.
pub type SimEngine = Engine<Reliable<SimLink>>;

/// Length of the header at the start of every message (shorter messages carry a
/// prefix of it).
pub const MSG_HEADER_LEN: usize = 32;
const MAGIC: u32 = 0x5354_524d; // "STRM"

/// What to run.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Seed of the net and of every message.
    pub seed: u64,
    /// Endpoint pairs (two endpoints each).
    pub pairs: usize,
    /// Hosts (engines) the endpoints are spread over; 0 puts each endpoint on its
    /// own host. Pair `i`'s endpoints live on hosts `2i % hosts` and `(2i+1) % hosts`.
    pub hosts: usize,
    /// Messages per direction per pair.
    pub msgs: u64,
    /// Send traffic both ways (else only from the first endpoint to the second).
    pub bidirectional: bool,
    /// Message length classes `(min, max)` (inclusive); each message picks a class
    /// and a length in it at random.
    pub sizes: Vec<(usize, usize)>,
    /// Sends in flight and receives posted ahead, per stream.
    pub window: usize,
    /// Both directions of every link.
    pub params: LinkParams,
    /// Host side of every link.
    pub link: LinkConfig,
    /// Reliability layer settings (nonces are drawn from the seed).
    pub rel: ReliableConfig,
    /// Engine settings.
    pub engine: Config,
    /// Bounds of the run.
    pub limits: Limits,
    /// Cut every link both ways during `[from, until)` ns after the start
    /// (`until = None`: forever).
    pub partition: Option<(u64, Option<u64>)>,
    /// Cut only the direction from each pair's first endpoint to its second.
    pub partition_one_way: bool,
    /// After the traffic, close every endpoint and run until every device has
    /// drained (delivered its FIN and had it acknowledged, or given up).
    pub close: bool,
}

impl Scenario {
    /// One pair, both directions, small messages over a clean link, reliability
    /// timers scaled to the simulated 10 us links.
    pub fn new(seed: u64) -> Self {
        Scenario {
            seed,
            pairs: 1,
            hosts: 0,
            msgs: 100,
            bidirectional: true,
            sizes: vec![(0, 256)],
            window: 16,
            params: LinkParams::default(),
            link: LinkConfig::default(),
            rel: sim_reliable_config(),
            engine: Config { spin: Duration::ZERO, ..Config::default() },
            limits: Limits::default(),
            partition: None,
            partition_one_way: false,
            close: false,
        }
    }
}

/// Reliability settings for simulated networks (defaults with a shorter liveness
/// timeout, so that a failing run ends sooner in virtual time).
pub fn sim_reliable_config() -> ReliableConfig {
    ReliableConfig { liveness_ns: 2_000_000_000, keepalive_ns: 100_000_000, ..ReliableConfig::default() }
}

/// What a scenario did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Messages to send in total (all streams).
    pub messages: u64,
    /// Receives that completed Ok with the right message.
    pub delivered: u64,
    /// Sends completed Ok.
    pub sends_ok: u64,
    /// Sends completed with an error status.
    pub sends_failed: u64,
    /// Receives completed with an error status.
    pub recvs_failed: u64,
    /// Sends refused at post time because the endpoint had failed (never posted).
    pub refused_sends: u64,
    /// Receives refused at post time because the endpoint had failed.
    pub refused_recvs: u64,
    /// Virtual time of the first and the last intact delivery, ns after the start.
    pub first_delivery_ns: Option<u64>,
    /// See `first_delivery_ns`.
    pub last_delivery_ns: Option<u64>,
    /// Intact deliveries at or after the end of the scenario's partition.
    pub delivered_after_partition: u64,
    /// Error statuses seen, with counts.
    pub statuses: Vec<(Status, u64)>,
    /// Virtual time at which the first and the last error completion came, ns after
    /// the start.
    pub first_error_ns: Option<u64>,
    /// See `first_error_ns`.
    pub last_error_ns: Option<u64>,
    /// Everything that broke a rule (empty in a correct run); at most 20 kept.
    pub violations: Vec<String>,
    /// Violations in total.
    pub violation_count: u64,
    /// Network counters summed over every direction.
    pub net: DirStats,
    /// Reliability counters summed over every endpoint.
    pub rel: ReliableStats,
    /// Driver counters.
    pub run: RunStats,
    /// Virtual time of the traffic phase, ns.
    pub virtual_ns: u64,
    /// Wall time of the whole scenario.
    pub wall: Duration,
    /// Devices still draining when the close phase ended (0 when it succeeded).
    pub still_closing: usize,
    /// How the run ended, if not by finishing.
    pub error: Option<SimError>,
    /// When the run did not finish: the state of every endpoint still open (at most
    /// 8 lines).
    pub endpoints: Vec<String>,
}

impl Report {
    /// True if nothing broke a rule and the run finished.
    pub fn clean(&self) -> bool {
        self.violation_count == 0 && self.error.is_none()
    }

    /// Panics with the seed, the violations and the counters unless the run was
    /// clean and every message was delivered.
    #[track_caller]
    pub fn assert_all_delivered(&self) {
        assert!(
            self.clean() && self.delivered == self.messages && self.sends_ok == self.messages,
            "seed {} (rerun with STRAIT_SIM_SEED={}): {} of {} delivered, {} sends ok\n{}",
            self.seed,
            self.seed,
            self.delivered,
            self.messages,
            self.sends_ok,
            self.summary()
        );
    }

    /// True if every message is accounted for: each one delivered intact, or its
    /// receive ended with an error or was refused; each send completed (Ok or
    /// error) or was refused; and nothing broke a rule. This is "delivered exactly
    /// once and in order, or failed with an error, never silently lost".
    pub fn accounted(&self) -> bool {
        self.clean()
            && self.delivered + self.recvs_failed + self.refused_recvs == self.messages
            && self.sends_ok + self.sends_failed + self.refused_sends == self.messages
    }

    /// Panics with the seed and the counters unless [`Report::accounted`].
    #[track_caller]
    pub fn assert_accounted(&self) {
        assert!(
            self.accounted(),
            "seed {} (rerun with STRAIT_SIM_SEED={}): messages not all accounted for\n{}",
            self.seed,
            self.seed,
            self.summary()
        );
    }

    /// A multi-line description for failure messages and logs.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "seed {}: {} messages, {} delivered, sends ok {} failed {} refused {}, recvs failed {} refused {}, \
             statuses {:?}, deliveries {:?}..{:?} ns ({} after the partition), errors {:?}..{:?} ns\n\
             run end: {:?}\nvirtual {:.3} ms, wall {:.3} s, {:?}\nnet {:?}\nrel {:?}\n",
            self.seed,
            self.messages,
            self.delivered,
            self.sends_ok,
            self.sends_failed,
            self.refused_sends,
            self.recvs_failed,
            self.refused_recvs,
            self.statuses,
            self.first_delivery_ns,
            self.last_delivery_ns,
            self.delivered_after_partition,
            self.first_error_ns,
            self.last_error_ns,
            self.error,
            self.virtual_ns as f64 / 1e6,
            self.wall.as_secs_f64(),
            self.run,
            self.net,
            self.rel,
        );
        for e in &self.endpoints {
            s.push_str("endpoint: ");
            s.push_str(e);
            s.push('\n');
        }
        for v in &self.violations {
            s.push_str("violation: ");
            s.push_str(v);
            s.push('\n');
        }
        if self.violation_count > self.violations.len() as u64 {
            s.push_str(&format!("... {} violations in all\n", self.violation_count));
        }
        s
    }
}

/// The `len` bytes of message `seq` of stream `stream` under `seed`.
pub fn message_bytes(seed: u64, stream: u32, seq: u64, len: usize, out: &mut Vec<u8>) {
    out.clear();
    out.resize(len.max(MSG_HEADER_LEN), 0);
    let mut x = mix(&[seed, stream as u64, seq]) | 1;
    let mut sum = 0xcbf2_9ce4_8422_2325u64;
    for chunk in out[MSG_HEADER_LEN..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    for &b in &out[MSG_HEADER_LEN..] {
        sum = (sum ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&stream.to_le_bytes());
    out[8..16].copy_from_slice(&seq.to_le_bytes());
    out[16..20].copy_from_slice(&(len as u32).to_le_bytes());
    out[20..24].fill(0);
    out[24..32].copy_from_slice(&sum.to_le_bytes());
    out.truncate(len);
}

/// Decodes a message header (for diagnostics): (stream, seq, len).
fn decode_header(b: &[u8]) -> Option<(u32, u64, u32)> {
    if b.len() < MSG_HEADER_LEN || b[0..4] != MAGIC.to_le_bytes() {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let seq = u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
    Some((u32_at(4), seq, u32_at(16)))
}

/// Length of message `seq` of `stream`.
fn message_len(seed: u64, stream: u32, seq: u64, sizes: &[(usize, usize)]) -> usize {
    let mut r = SimRng::new(mix(&[seed, 0x5153_u64, stream as u64, seq]));
    let (lo, hi) = sizes[r.below(sizes.len() as u64) as usize];
    r.range_inclusive(lo as u64, hi as u64) as usize
}

/// One direction of one pair.
struct Stream {
    id: u32,
    tx_host: usize,
    tx_ep: EpId,
    rx_host: usize,
    rx_ep: EpId,
    next_send: u64,
    send_done: Vec<bool>,
    sends_pending: u64,
    send_slots: Vec<MemoryRegion>,
    free_send: Vec<usize>,
    send_closed: bool,
    next_recv: u64,
    recv_done: Vec<bool>,
    recvs_pending: u64,
    recv_slots: Vec<MemoryRegion>,
    free_recv: Vec<usize>,
    recv_closed: bool,
    /// Next receive expected to complete (eager-only streams complete in order).
    next_recv_completion: u64,
    /// Counted as finished.
    counted: bool,
}

impl Stream {
    fn finished(&self, msgs: u64) -> bool {
        self.sends_pending == 0
            && self.recvs_pending == 0
            && (self.next_send == msgs || self.send_closed)
            && (self.next_recv == msgs || self.recv_closed)
    }
}

struct App {
    seed: u64,
    start_ns: u64,
    /// End of the scenario's partition, ns after the start.
    heal_ns: Option<u64>,
    msgs: u64,
    sizes: Vec<(usize, usize)>,
    max_len: usize,
    in_order: bool,
    streams: Vec<Stream>,
    /// Per host, per endpoint: (stream it sends, stream it receives).
    roles: Vec<Vec<(Option<usize>, Option<usize>)>>,
    unfinished: usize,
    buf: Vec<u8>,
    got: Vec<u8>,
    report: Report,
}

impl App {
    fn violation(&mut self, now: u64, what: String) {
        self.report.violation_count += 1;
        if self.report.violations.len() < 20 {
            let t = now.saturating_sub(self.start_ns);
            self.report.violations.push(format!("seed {} t={} ns: {what}", self.seed, t));
        }
    }

    fn error_status(&mut self, now: u64, s: Status) {
        let t = now.saturating_sub(self.start_ns);
        self.report.first_error_ns.get_or_insert(t);
        self.report.last_error_ns = Some(t);
        match self.report.statuses.iter_mut().find(|(x, _)| *x == s) {
            Some((_, n)) => *n += 1,
            None => self.report.statuses.push((s, 1)),
        }
    }

    /// Posts sends while the window has room.
    fn fill_sends(&mut self, now: u64, si: usize, w: &mut SimEngine) {
        loop {
            let st = &mut self.streams[si];
            if st.send_closed || st.next_send >= self.msgs {
                return;
            }
            let Some(slot) = st.free_send.pop() else { return };
            let seq = st.next_send;
            let len = message_len(self.seed, st.id, seq, &self.sizes);
            message_bytes(self.seed, st.id, seq, len, &mut self.buf);
            let mr = &mut st.send_slots[slot];
            mr.write_at(0, &self.buf).expect("free send slot is idle");
            let ctx = (seq << 16) | slot as u64;
            match w.post_send(st.tx_ep, mr, 0..len, st.id as u64, ctx) {
                Ok(()) => {
                    st.next_send += 1;
                    st.sends_pending += 1;
                }
                Err(PostError::Closed { .. }) => {
                    st.free_send.push(slot);
                    st.send_closed = true;
                    let left = self.msgs - st.next_send;
                    self.report.refused_sends += left;
                    self.finish_check(si);
                    return;
                }
                Err(e) => {
                    st.free_send.push(slot);
                    st.send_closed = true;
                    self.violation(now, format!("stream {si}: post_send failed: {e}"));
                    self.finish_check(si);
                    return;
                }
            }
        }
    }

    /// Posts receives while the window has room.
    fn fill_recvs(&mut self, now: u64, si: usize, w: &mut SimEngine) {
        loop {
            let st = &mut self.streams[si];
            if st.recv_closed || st.next_recv >= self.msgs {
                return;
            }
            let Some(slot) = st.free_recv.pop() else { return };
            let k = st.next_recv;
            let ctx = (k << 16) | slot as u64;
            let len = self.max_len;
            match w.post_recv(st.rx_ep, &mut st.recv_slots[slot], 0..len, st.id as u64, u64::MAX, ctx) {
                Ok(()) => {
                    st.next_recv += 1;
                    st.recvs_pending += 1;
                }
                Err(PostError::Closed { .. }) => {
                    st.free_recv.push(slot);
                    st.recv_closed = true;
                    let left = self.msgs - st.next_recv;
                    self.report.refused_recvs += left;
                    self.finish_check(si);
                    return;
                }
                Err(e) => {
                    st.free_recv.push(slot);
                    st.recv_closed = true;
                    self.violation(now, format!("stream {si}: post_recv failed: {e}"));
                    self.finish_check(si);
                    return;
                }
            }
        }
    }

    fn finish_check(&mut self, si: usize) {
        let st = &mut self.streams[si];
        if !st.counted && st.finished(self.msgs) {
            st.counted = true;
            self.unfinished -= 1;
        }
    }

    fn on_send(&mut self, now: u64, si: usize, w: &mut SimEngine, c: Completion) {
        let seq = c.ctx >> 16;
        let slot = (c.ctx & 0xffff) as usize;
        let st = &mut self.streams[si];
        if seq >= self.msgs || st.send_done[seq as usize] {
            self.violation(now, format!("stream {si}: send {seq} completed twice or unknown: {c:?}"));
            return;
        }
        st.send_done[seq as usize] = true;
        st.sends_pending -= 1;
        st.free_send.push(slot);
        let want = message_len(self.seed, st.id, seq, &self.sizes);
        match c.status {
            Status::Ok => {
                self.report.sends_ok += 1;
                if c.len != want {
                    self.violation(
                        now,
                        format!("stream {si}: send {seq} completed with len {} not {want}", c.len),
                    );
                }
            }
            s => {
                self.report.sends_failed += 1;
                self.error_status(now, s);
                if s == Status::Truncated {
                    self.violation(now, format!("stream {si}: send {seq} truncated"));
                }
            }
        }
        self.fill_sends(now, si, w);
        self.finish_check(si);
    }

    fn on_recv(&mut self, now: u64, si: usize, w: &mut SimEngine, c: Completion) {
        let k = c.ctx >> 16;
        let slot = (c.ctx & 0xffff) as usize;
        let st = &mut self.streams[si];
        if k >= self.msgs || st.recv_done.get(k as usize).copied().unwrap_or(true) {
            self.violation(now, format!("stream {si}: receive {k} completed twice or unknown: {c:?}"));
            return;
        }
        st.recv_done[k as usize] = true;
        st.recvs_pending -= 1;
        let in_order_violation = self.in_order && c.status == Status::Ok && k != st.next_recv_completion;
        st.next_recv_completion = st.next_recv_completion.max(k + 1);
        let id = st.id;
        match c.status {
            Status::Ok => {
                let want_len = message_len(self.seed, id, k, &self.sizes);
                message_bytes(self.seed, id, k, want_len, &mut self.buf);
                let mr = &self.streams[si].recv_slots[slot];
                let n = c.len.min(mr.len());
                self.got.clear();
                self.got.resize(n, 0);
                mr.read_at(0, &mut self.got).expect("completed receive is readable");
                if c.len != want_len || self.got != self.buf || c.tag != id as u64 {
                    let what = match decode_header(&self.got) {
                        Some((s, q, l)) if s == id && q != k => {
                            format!("got message {q} (len {l}) instead: duplicated, reordered or lost")
                        }
                        Some((s, q, l)) => format!("header says stream {s} seq {q} len {l}: payload corrupt"),
                        None => "unrecognizable bytes (corrupted)".into(),
                    };
                    self.violation(
                        now,
                        format!(
                            "stream {si}: receive {k} wants {want_len} bytes, completion has len {} tag {}: {what}",
                            c.len, c.tag
                        ),
                    );
                } else {
                    self.report.delivered += 1;
                    let t = now - self.start_ns;
                    self.report.first_delivery_ns.get_or_insert(t);
                    self.report.last_delivery_ns = Some(t);
                    if self.heal_ns.is_some_and(|h| t >= h) {
                        self.report.delivered_after_partition += 1;
                    }
                }
                if in_order_violation {
                    self.violation(now, format!("stream {si}: receive {k} completed out of order"));
                }
            }
            s => {
                self.report.recvs_failed += 1;
                self.error_status(now, s);
                if s == Status::Truncated {
                    self.violation(now, format!("stream {si}: receive {k} truncated"));
                }
            }
        }
        self.streams[si].free_recv.push(slot);
        self.fill_recvs(now, si, w);
        self.finish_check(si);
    }
}

impl Handler<Reliable<SimLink>> for App {
    fn on_completion(&mut self, now: u64, host: usize, w: &mut SimEngine, c: Completion) {
        let role = self.roles.get(host).and_then(|r| r.get(c.ep.0 as usize)).copied();
        let Some((tx, rx)) = role else {
            self.violation(now, format!("completion for unknown host {host} endpoint {:?}", c.ep));
            return;
        };
        match (c.op, tx, rx) {
            (OpKind::Send, Some(si), _) => self.on_send(now, si, w, c),
            (OpKind::Recv, _, Some(si)) => self.on_recv(now, si, w, c),
            _ => self.violation(now, format!("unexpected completion {c:?} on host {host}")),
        }
    }

    fn done(&mut self, _now: u64, _engines: &[SimEngine]) -> bool {
        self.unfinished == 0
    }
}

struct UntilClosed;

impl Handler<Reliable<SimLink>> for UntilClosed {
    fn on_completion(&mut self, _: u64, _: usize, _: &mut SimEngine, _: Completion) {}
    fn done(&mut self, _now: u64, engines: &[SimEngine]) -> bool {
        engines.iter().all(|e| e.closing() == 0)
    }
}

/// The two ends of a pair: (host, endpoint) of the first and of the second.
pub type PairEnds = [(usize, EpId); 2];

/// A scenario's simulation before any traffic.
pub struct Built {
    /// The hosts over the network.
    pub sim: Sim<Reliable<SimLink>>,
    /// Each pair's link.
    pub pairs: Vec<PairId>,
    /// Each pair's ends.
    pub ends: Vec<PairEnds>,
    /// The largest engine frame the pairs' devices carry (the reliability layer cuts
    /// `ReliableConfig::max_frame` to half its window of packets): what decides which
    /// messages go eagerly.
    pub max_frame: usize,
}

/// Builds the network and hosts of a scenario (before any traffic).
pub fn build(sc: &Scenario) -> Built {
    let net = SimNet::new(sc.seed);
    let mut sim = Sim::new(net.clone());
    sim.limits = sc.limits.clone();
    let hosts = if sc.hosts == 0 { sc.pairs * 2 } else { sc.hosts };
    for _ in 0..hosts {
        sim.add_host(Engine::new(sc.engine.clone()));
    }
    let mut pairs = Vec::with_capacity(sc.pairs);
    let mut ends = Vec::with_capacity(sc.pairs);
    let mut max_frame = usize::MAX;
    for i in 0..sc.pairs {
        let (ha, hb) = ((2 * i) % hosts, (2 * i + 1) % hosts);
        let (da, db) = net.reliable_pair(ha, hb, sc.params.clone(), &sc.link, &sc.rel);
        max_frame = max_frame
            .min(strait_core::Device::max_frame_len(&da))
            .min(strait_core::Device::max_frame_len(&db));
        pairs.push(da.link().pair());
        let ea = sim.engine(ha).attach(da);
        let eb = sim.engine(hb).attach(db);
        ends.push([(ha, ea), (hb, eb)]);
    }
    Built { sim, pairs, ends, max_frame }
}

/// One line about an endpoint's reliability state (for failure reports).
pub fn describe_endpoint(sim: &Sim<Reliable<SimLink>>, h: usize, ep: EpId) -> String {
    use strait_core::Device;
    let w = sim.engine_ref(h);
    let out = match w.device(ep) {
        Some(d) => format!(
            "host {h} {ep:?}: established {}, failure {:?}, unacked {}, link slots in use {}, timer {:?} ns, \
             endpoint error {:?}, {:?}",
            d.is_established(),
            d.failure(),
            d.unacked(),
            d.link().slots_in_use(),
            d.timer_ns(),
            w.endpoint_error(ep),
            d.rstats()
        ),
        None => format!("host {h} {ep:?}: closed"),
    };
    out
}

/// Sums the reliability counters of every endpoint.
pub fn rel_stats(sim: &Sim<Reliable<SimLink>>, ends: &[PairEnds]) -> ReliableStats {
    let mut t = ReliableStats::default();
    for pair in ends {
        for &(h, ep) in pair {
            if let Some(d) = sim.engine_ref(h).device(ep) {
                let s = d.rstats();
                t.packets_sent += s.packets_sent;
                t.packets_delivered += s.packets_delivered;
                t.frames_sent += s.frames_sent;
                t.frames_delivered += s.frames_delivered;
                t.timeout_retransmits += s.timeout_retransmits;
                t.fast_retransmits += s.fast_retransmits;
                t.acks_sent += s.acks_sent;
                t.probes_sent += s.probes_sent;
                t.duplicates += s.duplicates;
                t.out_of_order += s.out_of_order;
                t.bad_checksum += s.bad_checksum;
                t.bad_header += s.bad_header;
                t.wrong_conn += s.wrong_conn;
                t.out_of_window += s.out_of_window;
                t.srtt_ns = t.srtt_ns.max(s.srtt_ns);
                t.link.datagrams_sent += s.link.datagrams_sent;
                t.link.datagrams_received += s.link.datagrams_received;
                t.link.doorbells += s.link.doorbells;
                t.link.send_full += s.link.send_full;
            }
        }
    }
    t
}

/// Runs a scenario and checks every message; returns what happened (see
/// [`Report::assert_all_delivered`] and [`Report::violations`]).
pub fn run(sc: &Scenario) -> Report {
    run_inner(sc, None)
}

/// Like [`run`], with a tracer on the network (see [`SimNet::set_tracer`]).
pub fn run_traced(sc: &Scenario, tracer: Tracer) -> Report {
    run_inner(sc, Some(tracer))
}

fn run_inner(sc: &Scenario, tracer: Option<Tracer>) -> Report {
    let wall = Instant::now();
    assert!(sc.window > 0 && sc.window < 1 << 16, "window must be 1..65535");
    assert!(!sc.sizes.is_empty(), "at least one size class");
    let Built { mut sim, pairs, ends, max_frame } = build(sc);
    if tracer.is_some() {
        sim.net().set_tracer(tracer);
    }
    let start_ns = sim.now_ns();
    if let Some((from, until)) = sc.partition {
        let (from, until) = (start_ns + from, until.map(|u| start_ns + u));
        for p in &pairs {
            sim.net().partition_dir(p.forward(), from, until);
            if !sc.partition_one_way {
                sim.net().partition_dir(p.backward(), from, until);
            }
        }
    }
    let max_len = sc.sizes.iter().map(|s| s.1).max().unwrap_or(0).max(MSG_HEADER_LEN);
    let hosts = sim.hosts();
    let mut roles = vec![Vec::new(); hosts];
    let mut streams = Vec::new();
    for (i, pair) in ends.iter().enumerate() {
        for &(h, ep) in pair {
            let r: &mut Vec<(Option<usize>, Option<usize>)> = &mut roles[h];
            if r.len() <= ep.0 as usize {
                r.resize(ep.0 as usize + 1, (None, None));
            }
        }
        let dirs: &[(usize, usize)] = if sc.bidirectional { &[(0, 1), (1, 0)] } else { &[(0, 1)] };
        for &(from, to) in dirs {
            let si = streams.len();
            let (tx_host, tx_ep) = pair[from];
            let (rx_host, rx_ep) = pair[to];
            roles[tx_host][tx_ep.0 as usize].0 = Some(si);
            roles[rx_host][rx_ep.0 as usize].1 = Some(si);
            let regions =
                |n: usize| (0..n).map(|_| MemoryRegion::new(max_len).expect("region")).collect::<Vec<_>>();
            let w = sc.window.min(sc.msgs.max(1) as usize);
            streams.push(Stream {
                id: (2 * i + from) as u32,
                tx_host,
                tx_ep,
                rx_host,
                rx_ep,
                next_send: 0,
                send_done: vec![false; sc.msgs as usize],
                sends_pending: 0,
                send_slots: regions(w),
                free_send: (0..w).rev().collect(),
                send_closed: false,
                next_recv: 0,
                recv_done: vec![false; sc.msgs as usize],
                recvs_pending: 0,
                recv_slots: regions(w),
                free_recv: (0..w).rev().collect(),
                recv_closed: false,
                next_recv_completion: 0,
                counted: false,
            });
        }
    }
    // The engine's eager limit (anything longer goes by rendezvous, whose receives may
    // complete after later eager ones): the device's frame less the engine header.
    let eager = sc.engine.eager_threshold.min(max_frame.saturating_sub(strait_wire::MAX_HEADER_LEN));
    let in_order = sc.sizes.iter().all(|s| s.1 <= eager);
    let mut app = App {
        seed: sc.seed,
        start_ns,
        heal_ns: sc.partition.and_then(|p| p.1),
        msgs: sc.msgs,
        sizes: sc.sizes.clone(),
        max_len,
        in_order,
        unfinished: streams.len(),
        streams,
        roles,
        buf: Vec::new(),
        got: Vec::new(),
        report: Report { seed: sc.seed, ..Report::default() },
    };
    app.report.messages = sc.msgs * app.streams.len() as u64;
    for si in 0..app.streams.len() {
        let (rh, th) = (app.streams[si].rx_host, app.streams[si].tx_host);
        app.fill_recvs(start_ns, si, sim.engine(rh));
        app.fill_sends(start_ns, si, sim.engine(th));
        app.finish_check(si);
    }
    let r = sim.run(&mut app);
    let mut report = std::mem::take(&mut app.report);
    report.virtual_ns = sim.now_ns() - start_ns;
    report.run = sim.total_stats();
    report.error = r.err();
    if report.error.is_none() {
        for (si, st) in app.streams.iter().enumerate() {
            if !st.finished(sc.msgs) {
                report.violation_count += 1;
                report.violations.push(format!("seed {}: stream {si} did not finish", sc.seed));
            }
        }
    }
    report.rel = rel_stats(&sim, &ends);
    if report.error.is_some() {
        'outer: for pair in &ends {
            for &(h, ep) in pair {
                if report.endpoints.len() >= 8 {
                    break 'outer;
                }
                report.endpoints.push(describe_endpoint(&sim, h, ep));
            }
        }
    }
    if sc.close && report.error.is_none() {
        for pair in &ends {
            for &(h, ep) in pair {
                sim.engine(h).close(ep);
            }
        }
        if let Err(e) = sim.run(&mut UntilClosed) {
            report.error = Some(e);
        }
        report.still_closing = (0..sim.hosts()).map(|h| sim.engine_ref(h).closing()).sum();
        report.run = sim.total_stats();
    }
    report.net = sim.net().stats();
    report.wall = wall.elapsed();
    report
}
