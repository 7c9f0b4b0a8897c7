//! The virtual network: directions with latency, jitter, bandwidth, loss,
//! duplication, reordering, corruption and scheduled partitions, an event queue
//! ordered by (time, sequence number), and [`SimLink`], the [`Link`] the reliability
//! layer runs over.
//!
//! Everything is single-threaded and a pure function of the seed: each direction
//! draws from its own generator (derived from the net's seed and the direction's
//! number), and events at the same virtual time are delivered in the order they
//! were sent.

use std::cell::RefCell;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::os::fd::RawFd;
use std::rc::Rc;

use strait_core::reliable::{Reliable, ReliableConfig};
use strait_core::{Link, LinkError, LinkStats, SlotPool};

use crate::rng::{mix, SimRng};

/// Where virtual time starts (1 s, so that no timestamp is ever zero).
pub const START_NS: u64 = 1_000_000_000;

/// How one direction of a simulated link treats datagrams. Probabilities are per
/// datagram, in `[0, 1]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkParams {
    /// One-way propagation delay, ns.
    pub latency_ns: u64,
    /// Extra delay drawn uniformly from `0..=jitter_ns` for each datagram; datagrams
    /// sent closer together than the jitter can overtake each other.
    pub jitter_ns: u64,
    /// Bottleneck bandwidth in bits per second (serialization delay, one datagram at
    /// a time); 0 for infinite.
    pub bandwidth_bps: u64,
    /// Bytes that may wait in the bottleneck queue; a datagram that finds more is
    /// dropped (tail drop). 0 for unbounded. Ignored at infinite bandwidth.
    pub queue_bytes: usize,
    /// Probability that a datagram is lost.
    pub loss: f64,
    /// Probability that a datagram is delivered twice (the copy takes its own jitter
    /// and may be corrupted independently).
    pub duplicate: f64,
    /// Probability that a datagram is held back by an extra delay drawn from
    /// `1..=reorder_delay_ns` (so later ones overtake it).
    pub reorder: f64,
    /// Largest extra delay of a reordered datagram, ns.
    pub reorder_delay_ns: u64,
    /// Probability that 1 to 3 random bits of a datagram are flipped.
    pub corrupt: f64,
    /// Probability that a datagram is cut short at a random length.
    pub truncate: f64,
    /// An ECN-marking bottleneck: a datagram of an ECN-capable sender
    /// ([`SimLink::set_ecn`]) that finds at least this many bytes queued ahead of it
    /// is marked Congestion Experienced (a step marking, as a datacenter switch's
    /// or DCTCP's); 0 never marks. Marks are counted by the receiving link
    /// ([`Link::ce_marked`]) and in [`DirStats::ce_marked`].
    pub ecn_mark_bytes: usize,
}

impl Default for LinkParams {
    /// A clean 10 Gbit/s link with 10 us of one-way latency and a 1 MiB queue.
    fn default() -> Self {
        LinkParams {
            latency_ns: 10_000,
            jitter_ns: 0,
            bandwidth_bps: 10_000_000_000,
            queue_bytes: 1 << 20,
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_delay_ns: 0,
            corrupt: 0.0,
            truncate: 0.0,
            ecn_mark_bytes: 0,
        }
    }
}

impl LinkParams {
    /// The default link with loss probability `p`.
    pub fn lossy(p: f64) -> Self {
        LinkParams { loss: p, ..LinkParams::default() }
    }

    /// True if the parameters are usable (probabilities in `[0, 1]`).
    pub fn is_valid(&self) -> bool {
        [self.loss, self.duplicate, self.reorder, self.corrupt, self.truncate]
            .iter()
            .all(|p| (0.0..=1.0).contains(p))
    }
}

/// Per-link settings of a [`SimLink`] (the host side of the link, not the wire).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkConfig {
    /// Largest datagram, bytes (1500 as on Ethernet).
    pub mtu: usize,
    /// Transmit slots. [`Reliable`] needs at least its window plus 16 (default 576:
    /// the default window of 512, plus room).
    pub slots: u32,
    /// Datagrams that may be queued between two flushes (the device ring).
    pub ring: usize,
    /// Datagrams that may wait at the receiving end (the socket buffer); more are
    /// dropped and counted in [`DirStats::rx_overflow`].
    pub rx_capacity: usize,
    /// The links' datagrams are ECN-capable: an ECN-marking bottleneck
    /// ([`LinkParams::ecn_mark_bytes`]) marks them (default off, as a carrier
    /// without ECN; [`SimLink::set_ecn`] changes one end's).
    pub ecn: bool,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig { mtu: 1500, slots: 576, ring: 256, rx_capacity: 4096, ecn: false }
    }
}

/// Counters of one direction. A datagram that is sent is either delivered, or
/// counted in exactly one of the drop counters (lost, partition, queue, overflow,
/// no receiver), or still in flight; duplicates add one delivery or drop each, and
/// so do injected datagrams ([`SimNet::inject`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DirStats {
    /// Datagrams handed to the direction by the sending link.
    pub sent: u64,
    /// Bytes handed to the direction.
    pub bytes_sent: u64,
    /// Datagrams (including duplicate copies) put into the receiver's queue.
    pub delivered: u64,
    /// Datagrams lost at random.
    pub lost: u64,
    /// Extra copies made.
    pub duplicated: u64,
    /// Datagrams (copies) with flipped bits.
    pub corrupted: u64,
    /// Datagrams (copies) cut short.
    pub truncated: u64,
    /// Datagrams (copies) held back for reordering.
    pub reordered: u64,
    /// Datagrams dropped because a partition was in force when they were sent or
    /// when they would have arrived.
    pub partition_drops: u64,
    /// Datagrams dropped at a full bottleneck queue.
    pub queue_drops: u64,
    /// Datagrams marked Congestion Experienced at the bottleneck
    /// ([`LinkParams::ecn_mark_bytes`]).
    pub ce_marked: u64,
    /// Datagrams dropped at a full receive queue.
    pub rx_overflow: u64,
    /// Datagrams that arrived after the receiving link was dropped.
    pub no_receiver: u64,
    /// Datagrams put on the direction by [`SimNet::inject`] (not sent by a link).
    pub injected: u64,
}

impl DirStats {
    fn add(&mut self, o: &DirStats) {
        self.sent += o.sent;
        self.bytes_sent += o.bytes_sent;
        self.delivered += o.delivered;
        self.lost += o.lost;
        self.duplicated += o.duplicated;
        self.corrupted += o.corrupted;
        self.truncated += o.truncated;
        self.reordered += o.reordered;
        self.partition_drops += o.partition_drops;
        self.queue_drops += o.queue_drops;
        self.ce_marked += o.ce_marked;
        self.rx_overflow += o.rx_overflow;
        self.no_receiver += o.no_receiver;
        self.injected += o.injected;
    }
}

/// What happened to a datagram, for a tracer (see [`SimNet::set_tracer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceKind {
    /// Handed to the direction by the sending link (before its fate is drawn).
    Sent,
    /// Lost at random.
    Lost,
    /// Dropped by a partition (at send or arrival).
    PartitionDrop,
    /// Dropped at a full bottleneck queue.
    QueueDrop,
    /// Scheduled for arrival (one event per copy; bytes as they will arrive, after
    /// any corruption or truncation).
    Scheduled {
        /// Virtual arrival time, ns.
        at_ns: u64,
    },
    /// Put into the receiver's queue.
    Delivered,
    /// Dropped at a full receive queue or for want of a receiver.
    RxDrop,
}

/// One datagram event seen by a tracer.
#[derive(Debug, Clone, Copy)]
pub struct TraceEvent<'a> {
    /// Virtual time, ns.
    pub now_ns: u64,
    /// The direction.
    pub dir: DirId,
    /// What happened.
    pub kind: TraceKind,
    /// The datagram's bytes.
    pub bytes: &'a [u8],
}

/// A tracer: sees every datagram event. It must not call into the net.
pub type Tracer = Box<dyn FnMut(&TraceEvent<'_>)>;

/// A test's own deterministic fault on one direction ([`SimNet::set_fault`]): called
/// with the datagram's number on the direction (0, 1, ...) and its bytes, which it
/// may change; returns how many copies go on (0: lost). It must not call into the
/// net.
pub type Fault = Box<dyn FnMut(u64, &mut Vec<u8>) -> usize>;

/// One direction of a link: the wire from one [`SimLink`] to its peer.
struct Dir {
    params: LinkParams,
    rng: SimRng,
    /// When the bottleneck finishes serializing what it has accepted.
    busy_until: u64,
    /// A bottleneck shared with other directions ([`SimNet::share_bottleneck`]):
    /// its index in `NetInner::shared`; `None`: this direction's own.
    shared: Option<usize>,
    /// Partitions: `[from, until)` windows of virtual time.
    partitions: Vec<(u64, u64)>,
    /// Datagrams that arrived, waiting for the receiving link's `recv`, each with
    /// its Congestion Experienced mark.
    rx: VecDeque<(Vec<u8>, bool)>,
    /// The sending link marks its datagrams ECN-capable ([`SimLink::set_ecn`]).
    ect: bool,
    rx_capacity: usize,
    dst_host: usize,
    receiver_alive: bool,
    stats: DirStats,
    /// The test's own fault, applied before the random ones.
    fault: Option<Fault>,
    /// Datagrams the fault has seen.
    faulted: u64,
}

impl Dir {
    fn cut_at(&self, t: u64) -> bool {
        self.partitions.iter().any(|&(from, until)| from <= t && t < until)
    }
}

/// A datagram in flight.
struct Ev {
    at: u64,
    seq: u64,
    dir: u32,
    data: Vec<u8>,
    /// Marked Congestion Experienced on the way.
    ce: bool,
}

impl PartialEq for Ev {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Ev {}
impl PartialOrd for Ev {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Ev {
    /// Reversed: the max-heap pops the earliest (time, sequence) first.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

struct NetInner {
    seed: u64,
    now: u64,
    dirs: Vec<Dir>,
    events: BinaryHeap<Ev>,
    next_seq: u64,
    spare: Vec<Vec<u8>>,
    /// Per host: datagrams waiting in the receive queues of its links.
    host_pending: Vec<usize>,
    /// Hosts that received datagrams since the driver last asked.
    woken: Vec<usize>,
    woken_flag: Vec<bool>,
    /// Draws for things that are not per direction (connection nonces).
    rng: SimRng,
    /// Busy-until times of bottlenecks shared by several directions.
    shared: Vec<u64>,
    tracer: Option<Tracer>,
}

fn trace(t: &mut Option<Tracer>, now_ns: u64, dir: usize, kind: TraceKind, bytes: &[u8]) {
    if let Some(f) = t {
        f(&TraceEvent { now_ns, dir: DirId(dir as u32), kind, bytes });
    }
}

impl NetInner {
    fn host(&mut self, h: usize) {
        if self.host_pending.len() <= h {
            self.host_pending.resize(h + 1, 0);
            self.woken_flag.resize(h + 1, false);
        }
    }

    fn transmit(&mut self, dir: usize, bytes: &[u8]) {
        let now = self.now;
        let d = &mut self.dirs[dir];
        let len = bytes.len() as u64;
        d.stats.sent += 1;
        d.stats.bytes_sent += len;
        trace(&mut self.tracer, now, dir, TraceKind::Sent, bytes);
        if d.cut_at(now) {
            d.stats.partition_drops += 1;
            trace(&mut self.tracer, now, dir, TraceKind::PartitionDrop, bytes);
            return;
        }
        let mut copies = 1;
        let mut changed = None;
        if let Some(f) = d.fault.as_mut() {
            let mut v = bytes.to_vec();
            copies = f(d.faulted, &mut v);
            d.faulted += 1;
            changed = Some(v);
        }
        let bytes = changed.as_deref().unwrap_or(bytes);
        let p = &d.params;
        if copies == 0 || d.rng.chance(p.loss) {
            d.stats.lost += 1;
            trace(&mut self.tracer, now, dir, TraceKind::Lost, bytes);
            return;
        }
        let mut ready = now;
        let mut ce = false;
        if p.bandwidth_bps > 0 {
            let busy = match d.shared {
                Some(i) => &mut self.shared[i],
                None => &mut d.busy_until,
            };
            let start = now.max(*busy);
            let backlog = ((start - now) as u128 * p.bandwidth_bps as u128 / 8_000_000_000) as u64;
            if p.queue_bytes > 0 && backlog + len > p.queue_bytes as u64 {
                d.stats.queue_drops += 1;
                trace(&mut self.tracer, now, dir, TraceKind::QueueDrop, bytes);
                return;
            }
            if d.ect && p.ecn_mark_bytes > 0 && backlog >= p.ecn_mark_bytes as u64 {
                ce = true;
                d.stats.ce_marked += 1;
            }
            let ser = (len as u128 * 8_000_000_000).div_ceil(p.bandwidth_bps as u128) as u64;
            *busy = start + ser;
            ready = *busy;
        }
        let base = ready + p.latency_ns;
        if d.rng.chance(p.duplicate) {
            copies += 1;
        }
        d.stats.duplicated += copies as u64 - 1;
        for _ in 0..copies {
            let p = &d.params;
            let mut at = base;
            if p.jitter_ns > 0 {
                at += d.rng.range_inclusive(0, p.jitter_ns);
            }
            if p.reorder_delay_ns > 0 && d.rng.chance(p.reorder) {
                at += d.rng.range_inclusive(1, p.reorder_delay_ns);
                d.stats.reordered += 1;
            }
            let mut buf = self.spare.pop().unwrap_or_default();
            buf.clear();
            buf.extend_from_slice(bytes);
            if !buf.is_empty() && d.rng.chance(p.corrupt) {
                let flips = 1 + d.rng.below(3);
                let bits = buf.len() as u64 * 8;
                let mut done: [u64; 3] = [u64::MAX; 3];
                for k in 0..flips as usize {
                    // Distinct bits, so that two flips never cancel out.
                    let mut b = d.rng.below(bits);
                    while done[..k].contains(&b) {
                        b = d.rng.below(bits);
                    }
                    done[k] = b;
                    buf[(b / 8) as usize] ^= 1 << (b % 8);
                }
                d.stats.corrupted += 1;
            }
            if !buf.is_empty() && d.rng.chance(p.truncate) {
                let keep = d.rng.below(buf.len() as u64) as usize;
                buf.truncate(keep);
                d.stats.truncated += 1;
            }
            trace(&mut self.tracer, now, dir, TraceKind::Scheduled { at_ns: at }, &buf);
            let seq = self.next_seq;
            self.next_seq += 1;
            self.events.push(Ev { at, seq, dir: dir as u32, data: buf, ce });
        }
    }

    fn deliver_due(&mut self) {
        while self.events.peek().is_some_and(|e| e.at <= self.now) {
            let Some(ev) = self.events.pop() else { break };
            let d = &mut self.dirs[ev.dir as usize];
            let (now, dir) = (self.now, ev.dir as usize);
            if d.cut_at(ev.at) {
                d.stats.partition_drops += 1;
                trace(&mut self.tracer, now, dir, TraceKind::PartitionDrop, &ev.data);
            } else if !d.receiver_alive {
                d.stats.no_receiver += 1;
                trace(&mut self.tracer, now, dir, TraceKind::RxDrop, &ev.data);
            } else if d.rx.len() >= d.rx_capacity {
                d.stats.rx_overflow += 1;
                trace(&mut self.tracer, now, dir, TraceKind::RxDrop, &ev.data);
            } else {
                d.stats.delivered += 1;
                trace(&mut self.tracer, now, dir, TraceKind::Delivered, &ev.data);
                d.rx.push_back((ev.data, ev.ce));
                let h = d.dst_host;
                self.host_pending[h] += 1;
                if !self.woken_flag[h] {
                    self.woken_flag[h] = true;
                    self.woken.push(h);
                }
                continue;
            }
            self.recycle(ev.data);
        }
    }

    fn recycle(&mut self, buf: Vec<u8>) {
        if self.spare.len() < 4096 {
            self.spare.push(buf);
        }
    }
}

/// Identifies one direction of one link: `2 * pair` from the first host of
/// [`SimNet::link_pair`] to the second, `2 * pair + 1` back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DirId(pub u32);

/// Identifies a link (both directions) made by [`SimNet::link_pair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PairId(pub u32);

impl PairId {
    /// From the first host to the second.
    pub fn forward(self) -> DirId {
        DirId(self.0 * 2)
    }

    /// From the second host to the first.
    pub fn backward(self) -> DirId {
        DirId(self.0 * 2 + 1)
    }
}

/// A seeded virtual network with a virtual clock. Cheap to clone (a shared handle);
/// single-threaded.
#[derive(Clone)]
pub struct SimNet {
    inner: Rc<RefCell<NetInner>>,
}

impl std::fmt::Debug for SimNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.inner.borrow();
        f.debug_struct("SimNet")
            .field("seed", &n.seed)
            .field("now_ns", &n.now)
            .field("dirs", &n.dirs.len())
            .field("in_flight", &n.events.len())
            .finish()
    }
}

impl SimNet {
    /// An empty network whose every random choice follows from `seed`; the clock
    /// starts at [`START_NS`].
    pub fn new(seed: u64) -> Self {
        SimNet {
            inner: Rc::new(RefCell::new(NetInner {
                seed,
                now: START_NS,
                dirs: Vec::new(),
                events: BinaryHeap::new(),
                next_seq: 0,
                spare: Vec::new(),
                host_pending: Vec::new(),
                woken: Vec::new(),
                woken_flag: Vec::new(),
                rng: SimRng::new(mix(&[seed, u64::MAX])),
                shared: Vec::new(),
                tracer: None,
            })),
        }
    }

    /// Installs (or removes) a tracer that sees every datagram event, for debugging
    /// a seed. It must not call into the net.
    pub fn set_tracer(&self, tracer: Option<Tracer>) {
        self.inner.borrow_mut().tracer = tracer;
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.inner.borrow().seed
    }

    /// Virtual time, ns.
    pub fn now_ns(&self) -> u64 {
        self.inner.borrow().now
    }

    /// A random value from the net's own stream (for connection nonces and the
    /// like), so that everything a run draws follows from the seed.
    pub fn draw(&self) -> u64 {
        self.inner.borrow_mut().rng.next_u64()
    }

    /// Connects host `a` to host `b`: returns the link at `a` and the link at `b`.
    /// `ab` governs datagrams from `a` to `b`, `ba` the way back. Host numbers only
    /// tell the driver whom to wake when datagrams arrive; any `usize` will do.
    ///
    /// # Panics
    /// If a probability in `ab` or `ba` is outside `[0, 1]`, or `cfg.mtu` is 0.
    pub fn link_pair(
        &self,
        a: usize,
        b: usize,
        ab: LinkParams,
        ba: LinkParams,
        cfg: &LinkConfig,
    ) -> (SimLink, SimLink) {
        assert!(ab.is_valid() && ba.is_valid(), "link probabilities must lie in [0, 1]");
        assert!(cfg.mtu > 0, "mtu must be positive");
        let mut n = self.inner.borrow_mut();
        n.host(a.max(b));
        let pair = (n.dirs.len() / 2) as u32;
        let seed = n.seed;
        for (i, (params, dst)) in [(ab, b), (ba, a)].into_iter().enumerate() {
            let id = pair as u64 * 2 + i as u64;
            n.dirs.push(Dir {
                params,
                rng: SimRng::new(mix(&[seed, id])),
                busy_until: 0,
                shared: None,
                partitions: Vec::new(),
                rx: VecDeque::new(),
                ect: cfg.ecn,
                rx_capacity: cfg.rx_capacity,
                dst_host: dst,
                receiver_alive: true,
                stats: DirStats::default(),
                fault: None,
                faulted: 0,
            });
        }
        drop(n);
        let mk = |tx: u32, rx: u32| SimLink {
            net: self.clone(),
            tx_dir: tx as usize,
            rx_dir: rx as usize,
            pool: SlotPool::new(cfg.slots, cfg.mtu),
            pending: Vec::with_capacity(cfg.ring),
            ring: cfg.ring,
            mtu: cfg.mtu,
            stats: LinkStats::default(),
            carrier_checksum: false,
        };
        (mk(pair * 2, pair * 2 + 1), mk(pair * 2 + 1, pair * 2))
    }

    /// Like [`SimNet::link_pair`] with the same parameters both ways, wrapped in the
    /// reliability layer. Each side's connection nonce is drawn from the net's
    /// stream (any nonce in `rcfg` is replaced).
    pub fn reliable_pair(
        &self,
        a: usize,
        b: usize,
        params: LinkParams,
        cfg: &LinkConfig,
        rcfg: &ReliableConfig,
    ) -> (Reliable<SimLink>, Reliable<SimLink>) {
        let (la, lb) = self.link_pair(a, b, params.clone(), params, cfg);
        let ra = Reliable::with_nonce(la, rcfg.clone(), self.draw());
        let rb = Reliable::with_nonce(lb, rcfg.clone(), self.draw());
        (ra, rb)
    }

    /// Replaces the parameters of one direction from now on (datagrams in flight
    /// keep their fate).
    ///
    /// # Panics
    /// If `dir` does not exist or a probability is outside `[0, 1]`.
    pub fn set_params(&self, dir: DirId, params: LinkParams) {
        assert!(params.is_valid(), "link probabilities must lie in [0, 1]");
        self.inner.borrow_mut().dirs[dir.0 as usize].params = params;
    }

    /// Installs (or removes) a test's own deterministic fault on one direction,
    /// applied to every datagram sent on it (not dropped by a partition) before the
    /// random fates of its [`LinkParams`]: the fault may change the bytes (not
    /// counted as corruption) and says how many copies go on (0 counts as lost, each
    /// extra copy as duplicated). For faults a probability cannot express: "every
    /// 7th datagram", "flip this header bit", a forger who fixes the checksum.
    ///
    /// # Panics
    /// If `dir` does not exist.
    pub fn set_fault(&self, dir: DirId, fault: Option<Fault>) {
        let mut n = self.inner.borrow_mut();
        let d = &mut n.dirs[dir.0 as usize];
        d.fault = fault;
        d.faulted = 0;
    }

    /// Puts `bytes` on `dir` as a forger on the path would: they arrive at `at_ns`
    /// (at the earliest now), past the direction's faults but not its partitions,
    /// as if the direction's sender had sent them.
    ///
    /// # Panics
    /// If `dir` does not exist.
    pub fn inject(&self, dir: DirId, at_ns: u64, bytes: &[u8]) {
        let mut n = self.inner.borrow_mut();
        let now = n.now;
        let at = at_ns.max(now);
        let seq = n.next_seq;
        n.next_seq += 1;
        n.dirs[dir.0 as usize].stats.injected += 1;
        trace(&mut n.tracer, now, dir.0 as usize, TraceKind::Scheduled { at_ns: at }, bytes);
        n.events.push(Ev { at, seq, dir: dir.0, data: bytes.to_vec(), ce: false });
    }

    /// Datagrams on `dir` that its receiver has not taken yet: in flight, or arrived
    /// and waiting in its queue.
    ///
    /// # Panics
    /// If `dir` does not exist.
    pub fn unreceived(&self, dir: DirId) -> usize {
        let n = self.inner.borrow();
        n.dirs[dir.0 as usize].rx.len() + n.events.iter().filter(|e| e.dir == dir.0).count()
    }

    /// Makes `dirs` share one bottleneck (one serialization queue): datagrams of
    /// all of them wait behind each other, as flows through one router port do.
    /// The bottleneck's rate and queue are each direction's `bandwidth_bps` and
    /// `queue_bytes` (give them the same ones).
    ///
    /// # Panics
    /// If a direction does not exist.
    pub fn share_bottleneck(&self, dirs: &[DirId]) {
        let mut n = self.inner.borrow_mut();
        let i = n.shared.len();
        n.shared.push(0);
        for d in dirs {
            n.dirs[d.0 as usize].shared = Some(i);
        }
    }

    /// The parameters of one direction.
    pub fn params(&self, dir: DirId) -> LinkParams {
        self.inner.borrow().dirs[dir.0 as usize].params.clone()
    }

    /// Cuts one direction from `from_ns` until `until_ns` (virtual time; `None`:
    /// forever). Datagrams sent or arriving inside the window are dropped.
    pub fn partition_dir(&self, dir: DirId, from_ns: u64, until_ns: Option<u64>) {
        self.inner.borrow_mut().dirs[dir.0 as usize].partitions.push((from_ns, until_ns.unwrap_or(u64::MAX)));
    }

    /// Cuts both directions of a link (see [`SimNet::partition_dir`]).
    pub fn partition(&self, pair: PairId, from_ns: u64, until_ns: Option<u64>) {
        self.partition_dir(pair.forward(), from_ns, until_ns);
        self.partition_dir(pair.backward(), from_ns, until_ns);
    }

    /// Cuts every link that exists now (see [`SimNet::partition_dir`]).
    pub fn partition_all(&self, from_ns: u64, until_ns: Option<u64>) {
        let n = self.inner.borrow().dirs.len();
        for d in 0..n {
            self.partition_dir(DirId(d as u32), from_ns, until_ns);
        }
    }

    /// True if `dir` is cut at virtual time `t`.
    pub fn is_cut(&self, dir: DirId, t: u64) -> bool {
        self.inner.borrow().dirs[dir.0 as usize].cut_at(t)
    }

    /// Number of directions (twice the number of links).
    pub fn dirs(&self) -> usize {
        self.inner.borrow().dirs.len()
    }

    /// Counters of one direction.
    pub fn dir_stats(&self, dir: DirId) -> DirStats {
        self.inner.borrow().dirs[dir.0 as usize].stats
    }

    /// Counters summed over every direction.
    pub fn stats(&self) -> DirStats {
        let n = self.inner.borrow();
        let mut s = DirStats::default();
        for d in &n.dirs {
            s.add(&d.stats);
        }
        s
    }

    /// Datagrams in flight (sent, not yet arrived or dropped).
    pub fn in_flight(&self) -> usize {
        self.inner.borrow().events.len()
    }

    /// Virtual time of the next arrival, if any datagram is in flight.
    pub fn next_event_ns(&self) -> Option<u64> {
        self.inner.borrow().events.peek().map(|e| e.at)
    }

    /// Moves the clock to `t` (never backwards) and delivers every datagram due by
    /// then into its receiver's queue.
    pub fn advance_to(&self, t: u64) {
        let mut n = self.inner.borrow_mut();
        n.now = n.now.max(t);
        n.deliver_due();
    }

    /// Moves the hosts that received datagrams since the last call into `out`.
    pub fn take_woken(&self, out: &mut Vec<usize>) {
        let mut n = self.inner.borrow_mut();
        let NetInner { woken, woken_flag, .. } = &mut *n;
        for h in woken.drain(..) {
            woken_flag[h] = false;
            out.push(h);
        }
    }

    /// Datagrams waiting in the receive queues of host `h`'s links.
    pub fn host_pending(&self, h: usize) -> usize {
        self.inner.borrow().host_pending.get(h).copied().unwrap_or(0)
    }
}

/// One end of a simulated link: a [`Link`] whose clock is the net's virtual time.
///
/// `send` queues into a bounded ring; `flush` hands the ring to the network (the
/// datagram's fate is decided then); `recv` takes datagrams that have arrived.
pub struct SimLink {
    net: SimNet,
    tx_dir: usize,
    rx_dir: usize,
    pool: SlotPool,
    pending: Vec<(u32, usize)>,
    ring: usize,
    mtu: usize,
    stats: LinkStats,
    /// What [`Link::carrier_checksum`] claims.
    carrier_checksum: bool,
}

impl std::fmt::Debug for SimLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimLink").field("tx_dir", &self.tx_dir).field("rx_dir", &self.rx_dir).finish()
    }
}

impl SimLink {
    /// The direction this link sends on.
    pub fn tx_dir(&self) -> DirId {
        DirId(self.tx_dir as u32)
    }

    /// The direction this link receives from.
    pub fn rx_dir(&self) -> DirId {
        DirId(self.rx_dir as u32)
    }

    /// The link (both directions) this end belongs to.
    pub fn pair(&self) -> PairId {
        PairId((self.tx_dir / 2) as u32)
    }

    /// The network.
    pub fn net(&self) -> &SimNet {
        &self.net
    }

    /// Transmit slots in use (taken and not yet recycled).
    pub fn slots_in_use(&self) -> usize {
        self.pool.in_use()
    }

    /// Makes this end's datagrams ECN-capable (or not, the default): an
    /// ECN-marking bottleneck ([`LinkParams::ecn_mark_bytes`]) marks them instead of
    /// letting its queue grow.
    pub fn set_ecn(&mut self, capable: bool) {
        self.net.inner.borrow_mut().dirs[self.tx_dir].ect = capable;
    }

    /// Makes this end claim (or not, the default) a carrier that checks payloads
    /// itself, as UDP's checksum does ([`Link::carrier_checksum`]): the reliability
    /// layer over it may then cover headers only. The net does not check payloads,
    /// so random corruption ([`LinkParams::corrupt`]) then models damage the
    /// carrier's checksum missed.
    pub fn set_carrier_checksum(&mut self, claimed: bool) {
        self.carrier_checksum = claimed;
    }
}

impl Link for SimLink {
    fn mtu(&self) -> usize {
        self.mtu
    }

    fn tx_slots(&self) -> Option<usize> {
        Some(self.pool.count() as usize)
    }

    fn tx_alloc(&mut self) -> Option<u32> {
        self.pool.alloc()
    }

    fn tx_buf(&mut self, slot: u32) -> &mut [u8] {
        self.pool.buf(slot)
    }

    fn send(&mut self, slot: u32, len: usize) -> Result<bool, LinkError> {
        if slot >= self.pool.count() || len > self.mtu {
            return Err(LinkError::BadSlot { slot, len });
        }
        if self.pending.len() >= self.ring {
            self.stats.send_full += 1;
            return Ok(false);
        }
        self.pool.begin_tx(slot);
        self.pending.push((slot, len));
        Ok(true)
    }

    fn tx_release(&mut self, slot: u32) {
        self.pool.release(slot);
    }

    fn flush(&mut self) -> Result<(), LinkError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.stats.doorbells += 1;
        let mut n = self.net.inner.borrow_mut();
        for &(slot, len) in &self.pending {
            let bytes = self.pool.bytes(slot, len).ok_or(LinkError::BadSlot { slot, len })?;
            n.transmit(self.tx_dir, bytes);
            self.stats.datagrams_sent += 1;
        }
        drop(n);
        for (slot, _) in self.pending.drain(..) {
            self.pool.end_tx(slot);
        }
        Ok(())
    }

    /// A flush (the simulated link does not moderate), counted as a push.
    fn push(&mut self) -> Result<(), LinkError> {
        if !self.pending.is_empty() {
            self.stats.pushes += 1;
        }
        self.flush()
    }

    fn recv(&mut self, handle: &mut dyn FnMut(&[u8])) -> Result<bool, LinkError> {
        let d = {
            let mut n = self.net.inner.borrow_mut();
            let d = n.dirs[self.rx_dir].rx.pop_front();
            if d.is_some() {
                let h = n.dirs[self.rx_dir].dst_host;
                n.host_pending[h] -= 1;
            }
            d
        };
        let Some((d, ce)) = d else { return Ok(false) };
        self.stats.datagrams_received += 1;
        self.stats.ce_marked += u64::from(ce);
        handle(&d);
        self.net.inner.borrow_mut().recycle(d);
        Ok(true)
    }

    fn now_ns(&self) -> u64 {
        self.net.inner.borrow().now
    }

    fn event_fd(&self) -> Option<RawFd> {
        None
    }

    fn arm_sleep(&mut self) -> Result<bool, LinkError> {
        Ok(self.net.inner.borrow().dirs[self.rx_dir].rx.is_empty())
    }

    fn stats(&self) -> LinkStats {
        self.stats
    }

    fn carrier_checksum(&self) -> bool {
        self.carrier_checksum
    }

    fn ce_marked(&self) -> u64 {
        self.stats.ce_marked
    }
}

impl Drop for SimLink {
    fn drop(&mut self) {
        // Queued datagrams are never sent (the host went away with them).
        if let Ok(mut n) = self.net.inner.try_borrow_mut() {
            let d = &mut n.dirs[self.rx_dir];
            d.receiver_alive = false;
            let left = d.rx.len();
            d.rx.clear();
            let h = d.dst_host;
            n.host_pending[h] -= left;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(net: &SimNet, ab: LinkParams) -> (SimLink, SimLink) {
        net.link_pair(0, 1, ab, LinkParams::default(), &LinkConfig::default())
    }

    fn send(l: &mut SimLink, bytes: &[u8]) {
        let s = l.tx_alloc().expect("slot");
        l.tx_buf(s)[..bytes.len()].copy_from_slice(bytes);
        assert!(l.send(s, bytes.len()).expect("send"));
        l.tx_release(s);
    }

    fn recv_all(l: &mut SimLink) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while l.recv(&mut |d| out.push(d.to_vec())).expect("recv") {}
        out
    }

    /// Runs the clock until nothing is in flight; returns arrivals with their times.
    fn run(net: &SimNet, l: &mut SimLink) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        while let Some(t) = net.next_event_ns() {
            net.advance_to(t);
            for d in recv_all(l) {
                out.push((t, d));
            }
        }
        out
    }

    #[test]
    fn clean_link_delivers_in_order_after_latency_and_serialization() {
        let net = SimNet::new(1);
        let (mut a, mut b) = pair(&net, LinkParams::default());
        for i in 0..10u8 {
            send(&mut a, &[i; 1250]); // 1 us each at 10 Gbit/s
        }
        assert_eq!(net.in_flight(), 0, "nothing leaves before flush");
        a.flush().unwrap();
        let got = run(&net, &mut b);
        assert_eq!(got.len(), 10);
        for (i, (t, d)) in got.iter().enumerate() {
            assert_eq!(d, &vec![i as u8; 1250]);
            assert_eq!(*t, START_NS + 10_000 + (i as u64 + 1) * 1000, "datagram {i}");
        }
        assert_eq!(a.slots_in_use(), 0, "released slots are recycled after the flush");
        let s = net.dir_stats(a.tx_dir());
        assert_eq!((s.sent, s.delivered), (10, 10));
    }

    fn trace(seed: u64) -> (Vec<(u64, Vec<u8>)>, DirStats) {
        let net = SimNet::new(seed);
        let p = LinkParams {
            loss: 0.1,
            duplicate: 0.1,
            jitter_ns: 5_000,
            reorder: 0.1,
            reorder_delay_ns: 50_000,
            corrupt: 0.1,
            truncate: 0.05,
            ..LinkParams::default()
        };
        let (mut a, mut b) = pair(&net, p);
        for i in 0..2000u32 {
            send(&mut a, &i.to_le_bytes().repeat(50));
            if i % 7 == 0 {
                a.flush().unwrap();
                let t = net.now_ns() + 700;
                net.advance_to(t);
            }
        }
        a.flush().unwrap();
        let mut got: Vec<(u64, Vec<u8>)> = recv_all(&mut b).into_iter().map(|d| (0, d)).collect();
        got.extend(run(&net, &mut b));
        (got, net.dir_stats(a.tx_dir()))
    }

    #[test]
    fn same_seed_same_fate_different_seed_different_fate() {
        let (t1, s1) = trace(99);
        let (t2, s2) = trace(99);
        let (t3, s3) = trace(100);
        assert_eq!(t1, t2);
        assert_eq!(s1, s2);
        assert_ne!(t1, t3);
        assert_ne!(s1, s3);
    }

    #[test]
    fn fault_rates_match_their_probabilities() {
        let (got, s) = trace(5);
        let n = s.sent as f64;
        assert_eq!(s.sent, 2000);
        for (what, count, p) in [
            ("lost", s.lost, 0.1),
            ("duplicated", s.duplicated, 0.1 * 0.9),
            ("corrupted", s.corrupted, 0.1 * 0.9 * 1.1),
            ("reordered", s.reordered, 0.1 * 0.9 * 1.1),
        ] {
            let rate = count as f64 / n;
            assert!((rate - p).abs() < 0.03, "{what}: {rate} vs {p} ({s:?})");
        }
        assert_eq!(s.delivered, s.sent - s.lost + s.duplicated);
        assert_eq!(got.len() as u64, s.delivered);
        // Reordering happened: some arrival is out of send order.
        let idx: Vec<u32> = got
            .iter()
            .filter(|(_, d)| d.len() == 200)
            .map(|(_, d)| u32::from_le_bytes([d[0], d[1], d[2], d[3]]))
            .collect();
        assert!(idx.windows(2).any(|w| w[1] < w[0]), "no reordering seen");
    }

    #[test]
    fn corruption_flips_bits_and_truncation_shortens() {
        let net = SimNet::new(3);
        let (mut a, mut b) = pair(&net, LinkParams { corrupt: 1.0, truncate: 0.5, ..LinkParams::default() });
        let orig = vec![0x5au8; 1000];
        for _ in 0..200 {
            send(&mut a, &orig);
        }
        a.flush().unwrap();
        let got = run(&net, &mut b);
        assert_eq!(got.len(), 200);
        let mut truncated = 0;
        for (_, d) in &got {
            if d.len() < orig.len() {
                truncated += 1;
                continue;
            }
            let flipped: u32 = d.iter().zip(&orig).map(|(x, y)| (x ^ y).count_ones()).sum();
            assert!((1..=3).contains(&flipped), "{flipped} bits flipped");
        }
        assert!((60..140).contains(&truncated), "{truncated}");
    }

    #[test]
    fn bandwidth_paces_and_a_full_queue_drops() {
        let net = SimNet::new(4);
        // 1 Gbit/s: 1000 bytes take 8 us; the queue holds 10 of them.
        let p = LinkParams {
            bandwidth_bps: 1_000_000_000,
            queue_bytes: 10_000,
            latency_ns: 0,
            ..Default::default()
        };
        let (mut a, mut b) = pair(&net, p);
        for _ in 0..20 {
            send(&mut a, &[1; 1000]);
        }
        a.flush().unwrap();
        let got = run(&net, &mut b);
        let s = net.dir_stats(a.tx_dir());
        assert_eq!(s.queue_drops, 10, "{s:?}");
        assert_eq!(got.len(), 10);
        let last = got.last().unwrap().0 - START_NS;
        assert_eq!(last, 80_000, "ten datagrams serialized back to back");
    }

    #[test]
    fn partition_drops_inside_its_window_only() {
        let net = SimNet::new(5);
        let (mut a, mut b) = pair(&net, LinkParams::default());
        let t0 = net.now_ns();
        net.partition(a.pair(), t0 + 100_000, Some(t0 + 200_000));
        let mut sent_at = Vec::new();
        for i in 0..30u64 {
            let t = t0 + i * 10_000;
            net.advance_to(t);
            recv_all(&mut b);
            send(&mut a, &i.to_le_bytes());
            a.flush().unwrap();
            sent_at.push(t);
        }
        let mut got = Vec::new();
        while let Some(t) = net.next_event_ns() {
            net.advance_to(t);
            got.extend(recv_all(&mut b));
        }
        // Sent at 0..=80 us arrive (by 90 us); sent at 90 us arrives at 100 us (cut);
        // sent at 100..=190 us are cut; sent at 200 us and later arrive.
        let s = net.dir_stats(a.tx_dir());
        assert!(net.is_cut(a.tx_dir(), t0 + 150_000) && !net.is_cut(a.tx_dir(), t0 + 200_000));
        assert_eq!(s.partition_drops, 11, "{s:?}");
        assert_eq!(s.delivered, 19);
    }

    #[test]
    fn ring_limits_unflushed_sends_and_bad_slots_are_refused() {
        let net = SimNet::new(6);
        let cfg = LinkConfig { ring: 2, slots: 4, ..LinkConfig::default() };
        let (mut a, _b) = net.link_pair(0, 1, LinkParams::default(), LinkParams::default(), &cfg);
        let s = a.tx_alloc().unwrap();
        assert!(a.send(s, 10).unwrap());
        assert!(a.send(s, 10).unwrap());
        assert!(!a.send(s, 10).unwrap(), "ring full");
        assert_eq!(a.stats().send_full, 1);
        a.flush().unwrap();
        assert!(a.send(s, 10).unwrap());
        assert!(matches!(a.send(s, 1501), Err(LinkError::BadSlot { .. })));
        assert!(matches!(a.send(99, 10), Err(LinkError::BadSlot { .. })));
    }

    #[test]
    fn a_fault_numbers_datagrams_and_injected_ones_arrive_untouched() {
        let net = SimNet::new(8);
        let (mut a, mut b) = pair(&net, LinkParams::default());
        // Every 3rd datagram lost, every 4th doubled, the first byte of all marked.
        net.set_fault(
            a.tx_dir(),
            Some(Box::new(|n, d| {
                d[0] = 0xee;
                match n % 12 {
                    0 | 3 | 6 | 9 => 0,
                    4 | 8 => 2,
                    _ => 1,
                }
            })),
        );
        for i in 0..12u8 {
            send(&mut a, &[i, i]);
        }
        a.flush().unwrap();
        net.inject(a.tx_dir(), 0, b"forged");
        assert_eq!(net.unreceived(a.tx_dir()), 11);
        let got: Vec<Vec<u8>> = run(&net, &mut b).into_iter().map(|(_, d)| d).collect();
        assert_eq!(got[0], b"forged", "injected now, it arrives first");
        let rest: Vec<u8> = got[1..].iter().map(|d| d[1]).collect();
        assert_eq!(rest, [1, 2, 4, 4, 5, 7, 8, 8, 10, 11]);
        assert!(got[1..].iter().all(|d| d[0] == 0xee));
        let s = net.dir_stats(a.tx_dir());
        assert_eq!((s.sent, s.lost, s.duplicated, s.injected, s.delivered), (12, 4, 2, 1, 11));
        assert_eq!(net.unreceived(a.tx_dir()), 0);
        assert!(!a.carrier_checksum());
        a.set_carrier_checksum(true);
        assert!(a.carrier_checksum());
    }

    #[test]
    fn arrivals_wake_the_receiving_host_and_a_dropped_link_receives_nothing() {
        let net = SimNet::new(7);
        let (mut a, b) =
            net.link_pair(3, 8, LinkParams::default(), LinkParams::default(), &LinkConfig::default());
        send(&mut a, b"x");
        send(&mut a, b"y");
        a.flush().unwrap();
        net.advance_to(net.next_event_ns().unwrap() + 1000);
        let mut woken = Vec::new();
        net.take_woken(&mut woken);
        assert_eq!(woken, vec![8]);
        assert_eq!(net.host_pending(8), 2);
        drop(b);
        assert_eq!(net.host_pending(8), 0);
        send(&mut a, b"z");
        a.flush().unwrap();
        net.advance_to(net.next_event_ns().unwrap());
        assert_eq!(net.dir_stats(a.tx_dir()).no_receiver, 1);
    }
}
