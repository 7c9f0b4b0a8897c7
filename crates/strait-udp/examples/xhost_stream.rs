//! Can strait-core's engine carry `strait run --peers`' TCP byte stream as well as
//! the bridge's own framing does? Both carry the same byte stream over the same
//! device (`Reliable<UdpLink>`, set up as `remote.rs` sets it up: the `mmsg` backend,
//! no send coalescing) between two network namespaces joined by a veth pair (made and
//! removed here; needs root), in interleaved rounds.
//!
//! Each side is what the preload has in one thread of a program: a "program" that
//! writes into a transmit byte ring and reads from a receive byte ring
//! (`strait_shm::stream::ByteRing`, 512 KiB per direction as `STRAIT_RING_SIZE`), and
//! the carrier that plays the other end of those rings inline (a write pushes at
//! once; a waiting read pumps the device; a read that freed a quarter of the ring
//! returns credit). Two carriers:
//!
//! * `bridge`: a replica of the data path of `remote.rs`' `Bridge::pump_with`: frames
//!   of one kind byte and the bytes (`F_DATA`, up to the device's largest frame), copied
//!   from the transmit ring straight into the device's packets and from an arrival
//!   straight into the receive ring; flow control by byte credit (`F_CREDIT` with the
//!   consumed total every quarter ring; never more outstanding than the far ring holds).
//! * `engine`: the ring's bytes as engine messages (`Worker::post_send` from the
//!   transmit ring itself: its data area is a `MemoryRegion`, so no staging copy; the
//!   tag is the message's stream position), into posted receive buffers (as many as
//!   the ring holds, any tag), whose completions the carrier copies into the receive
//!   ring in stream order (by tag: a rendezvous completion may overtake an earlier
//!   message's) and reposts; flow control by the engine's credits (per message) and
//!   the posted buffers. Variants by message
//!   size: `engine` (the default eager limit, 32 KiB), `engine-64k` (eager up to the
//!   largest frame, as the bridge's frames), `engine-cred` (32 KiB, and only as many
//!   credits as posted buffers, 16, so that fewer messages wait unexpected) and
//!   `engine-rndv` (128 KiB messages, the program's write size: rendezvous).
//!
//! Measured: one-way latency (half the round trip) of 16-byte write/read ping-pong,
//! median and p99 per round; and streaming in 128 KiB writes (`--write-kib`), MB/s
//! at the reader (every byte checked); and what each carrier did (frames, datagrams,
//! retransmissions, unexpected messages, credit frames, time in the copy into the
//! receive ring). Both ends busy-poll (no sleep), so the wake-up policy, the same for
//! both, is out of the figures.
//!
//! With `--strait-dir DIR` (where `strait` and `libstrait_preload.so` are), each
//! round also runs the real thing between the same namespaces: sockperf TCP
//! ping-pong (16 B) and iperf3 (one stream, 128 KiB writes) under `strait run
//! --peers` and plain (kernel TCP), as an anchor for the replica.
//!
//! Before each round it waits (at most `--quiet-wait` s) until no compiler (`rustc`,
//! `cargo`) runs; a round during which one ran anyway is marked, and the summary is
//! given over all rounds, over the quiet ones, and over the loss-free ones (no
//! retransmission in any measurement of the round: a side descheduled by other work
//! overflows its socket buffer, and the recovery then sets the figures). No round
//! starts after `--budget` s of measuring (waits not counted).
//!
//! `cargo run --release -p strait-udp --example xhost_stream -- [--rounds N]
//! [--pings N] [--stream-mib N] [--strait-dir DIR [--real-seconds S]] [--quiet-wait S]
//! [--budget S] [--write-kib N]` (defaults 5, 20000, 256, none, 2, 60, 240, 128), or
//! `scripts/bench-xhost-stream`.

use std::collections::{BTreeMap, VecDeque};
use std::net::UdpSocket;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use strait_core::{
    Config, Device, EpId, MemoryRegion, OpKind, ReliableConfig, ReliableStats, Status, Worker,
};
use strait_shm::area::MappedArea;
use strait_shm::stream::{pieces, ByteRing};
use strait_udp::netns::VethPair;
use strait_udp::{Backend, UdpConfig, UdpDevice, UdpLink};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The `p` quantile (0..=1) of `v`.
fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Bytes of each direction's ring (`STRAIT_RING_SIZE`'s default).
const RING: usize = 512 * 1024;
/// The program's write (and read) size while streaming.
const WRITE: usize = 128 * 1024;
/// The streaming writer's write size (`--write-kib`, default [`WRITE`]); reads and
/// `engine-rndv`'s messages stay at 128 KiB.
static WRITE_SIZE: AtomicUsize = AtomicUsize::new(WRITE);
/// The ping-pong message.
const PING: usize = 16;
/// Pings before the measured ones.
const WARM: usize = 1000;
/// Longest any wait may take before the run is declared stuck.
const STUCK: Duration = Duration::from_secs(20);
/// Bridge frame kinds (as remote.rs).
const F_DATA: u8 = 0;
const F_CREDIT: u8 = 1;

// ------------------------------------------------------------------ rings

/// One direction's byte ring: positions and a data area, which is a `MemoryRegion`
/// (so the engine carrier can send straight from it).
struct Ring {
    mr: MemoryRegion,
    area: MappedArea,
    tail: AtomicU64,
    head: AtomicU64,
}

impl Ring {
    fn new() -> Res<Ring> {
        let mr = MemoryRegion::new(RING)?;
        // SAFETY: the region is a page-aligned mapping of RING bytes that lives in the
        // same struct as the area and is only dropped with it.
        let area = unsafe { MappedArea::new(mr.addr() as *mut u8, RING) };
        Ok(Ring { mr, area, tail: AtomicU64::new(0), head: AtomicU64::new(0) })
    }

    fn get(&self) -> ByteRing<'_, MappedArea> {
        ByteRing::new(&self.tail, &self.head, &self.area)
    }
}

/// The program's side of one connection: it writes `tx`, reads `rx`.
struct Rings {
    tx: Ring,
    rx: Ring,
}

impl Rings {
    fn new() -> Res<Rings> {
        Ok(Rings { tx: Ring::new()?, rx: Ring::new()? })
    }
}

// ------------------------------------------------------------------ carriers

/// What plays the far end of a side's rings.
trait Carrier {
    /// A reader or writer waits: takes arrivals, sends what can go, returns credit.
    fn pump(&mut self, r: &Rings) -> Res<()>;
    /// The program just wrote: sends it now.
    fn push(&mut self, r: &Rings) -> Res<()>;
    /// The program just read (ring room freed).
    fn after_read(&mut self, r: &Rings) -> Res<()>;
    /// Keeps the carrier going (what the program wrote still goes out) until the
    /// other side is done too, then closes.
    fn finish(self, meet: &Meet, r: &Rings) -> Cost;
    /// The carrier's state, for a stuck run's report.
    fn describe(&self) -> String;
}

/// The bridge's framing: a replica of `remote.rs`' `Bridge::pump_with` data path.
struct BridgeCarrier {
    dev: UdpDevice,
    peer_consumed: u64,
    credit_sent: u64,
    max_data: usize,
    /// Credit frames sent.
    credit_frames: u64,
}

impl BridgeCarrier {
    fn new(mut dev: UdpDevice) -> Res<Self> {
        let t = Instant::now();
        while !dev.is_established() {
            dev.recv_frame(&mut |_| {})?;
            dev.doorbell()?;
            if t.elapsed() > Duration::from_secs(5) {
                return Err("the device did not come up in 5 s".into());
            }
        }
        let max_data = dev.max_frame_len().saturating_sub(1).max(1);
        Ok(BridgeCarrier { dev, peer_consumed: 0, credit_sent: 0, max_data, credit_frames: 0 })
    }

    fn pump_with(&mut self, r: &Rings, arrivals: bool) -> Res<()> {
        let ring = RING as u64;
        let mut more = arrivals;
        while more {
            let mut broke: Option<&'static str> = None;
            let BridgeCarrier { dev, peer_consumed, .. } = self;
            let rx = r.rx.get();
            let base = r.rx.area.base();
            let got = dev.recv_frame(&mut |f| {
                let mut kind = [0u8; 1];
                if !f.read(0, &mut kind) {
                    broke = Some("empty frame");
                    return;
                }
                match kind[0] {
                    F_DATA => {
                        let n = f.len() - 1;
                        match rx.writable() {
                            Ok(w) if w.len >= n as u64 => {
                                let mut done = 0;
                                for (off, m) in pieces(w.pos, n, RING) {
                                    // SAFETY: `off + m <= RING` inside the receive
                                    // ring's data area, past its tail (ours to write).
                                    if !unsafe { f.read_raw(1 + done, base.add(off), m) } {
                                        broke = Some("short frame");
                                        return;
                                    }
                                    done += m;
                                }
                                rx.publish_to(w.pos + n as u64);
                            }
                            _ => broke = Some("data beyond the credit"),
                        }
                    }
                    F_CREDIT => {
                        let mut v = [0u8; 8];
                        if f.len() == 9 && f.read(1, &mut v) {
                            *peer_consumed = (*peer_consumed).max(u64::from_le_bytes(v));
                        } else {
                            broke = Some("bad credit frame");
                        }
                    }
                    _ => broke = Some("unknown frame kind"),
                }
            })?;
            if let Some(why) = broke {
                return Err(why.into());
            }
            more = got;
        }
        // Departures: as much as the peer's ring has room for.
        let tx = r.tx.get();
        let base = r.tx.area.base();
        loop {
            let waiting = tx.readable()?;
            let head = waiting.pos;
            let credit = (self.peer_consumed + ring).saturating_sub(head);
            let n = waiting.len.min(credit).min(self.max_data as u64) as usize;
            if n == 0 {
                break;
            }
            let sent = self.dev.send_frame(1 + n, &mut |w| {
                w.write(0, &[F_DATA]);
                let mut done = 0;
                for (off, m) in pieces(head, n, RING) {
                    // SAFETY: `off + m <= RING` inside the transmit ring's data area,
                    // below its published tail (not rewritten before the head moves).
                    let src = unsafe { std::slice::from_raw_parts(base.add(off), m) };
                    w.write(1 + done, src);
                    done += m;
                }
            })?;
            if !sent {
                break;
            }
            tx.consume_to(head + n as u64);
        }
        // Credit for what the program read.
        let consumed = r.rx.head.load(Ordering::Acquire);
        if consumed.saturating_sub(self.credit_sent) >= ring / 4 {
            let mut m = [0u8; 9];
            m[0] = F_CREDIT;
            m[1..].copy_from_slice(&consumed.to_le_bytes());
            if self.dev.send_frame(9, &mut |w| w.write(0, &m))? {
                self.credit_sent = consumed;
                self.credit_frames += 1;
            }
        }
        self.dev.doorbell()?;
        Ok(())
    }
}

impl Carrier for BridgeCarrier {
    fn describe(&self) -> String {
        format!(
            "bridge: peer_consumed {} credit_sent {}; device: {}",
            self.peer_consumed,
            self.credit_sent,
            self.dev.describe()
        )
    }

    fn pump(&mut self, r: &Rings) -> Res<()> {
        self.pump_with(r, true)
    }

    fn push(&mut self, r: &Rings) -> Res<()> {
        self.pump_with(r, false)
    }

    fn after_read(&mut self, r: &Rings) -> Res<()> {
        let consumed = r.rx.head.load(Ordering::Acquire);
        if consumed.saturating_sub(self.credit_sent) >= RING as u64 / 4 {
            self.pump_with(r, true)?;
        }
        Ok(())
    }

    fn finish(mut self, meet: &Meet, r: &Rings) -> Cost {
        meet.done.fetch_add(1, Ordering::SeqCst);
        while meet.done.load(Ordering::SeqCst) < 2 {
            if self.pump_with(r, true).is_err() {
                break;
            }
        }
        let mut stats = Cost::of(&self.dev.rstats());
        stats.credit_frames = self.credit_frames;
        self.dev.shutdown();
        let t = Instant::now();
        while self.dev.drain() && t.elapsed() < Duration::from_secs(1) {
            let _ = self.dev.recv_frame(&mut |_| {});
        }
        stats
    }
}

/// The engine: ring bytes as tagged messages into posted receive buffers.
struct EngineCarrier {
    w: Worker<UdpDevice>,
    ep: EpId,
    /// Largest message.
    max_msg: usize,
    /// Receive buffers (`max_msg` bytes each, as many as the ring holds).
    bufs: Vec<MemoryRegion>,
    /// Completed receives by stream position (their tag): (buffer, length), waiting
    /// for their turn and ring room. Completions do not come in send order: a
    /// rendezvous transfer may overtake an earlier one.
    filled: BTreeMap<u64, (usize, usize)>,
    /// Transmit ring position up to which bytes were handed to the engine.
    sent_upto: u64,
    /// Sends in flight: (end position, completed), in ring order.
    inflight: VecDeque<(u64, bool)>,
    /// Time spent copying completed receives into the ring.
    copy_ns: u64,
}

impl EngineCarrier {
    fn new(dev: UdpDevice, cfg: Config, max_msg: usize) -> Res<Self> {
        let mut w = Worker::new(cfg)?;
        let ep = w.attach(dev);
        let t = Instant::now();
        while !w.device(ep).is_some_and(|d| d.is_established()) {
            w.progress();
            if t.elapsed() > Duration::from_secs(5) {
                return Err("the device did not come up in 5 s".into());
            }
        }
        let n = (RING / max_msg).max(1);
        let mut bufs = Vec::with_capacity(n);
        for _ in 0..n {
            bufs.push(MemoryRegion::new(max_msg)?);
        }
        for (i, b) in bufs.iter_mut().enumerate() {
            w.post_recv(ep, b, 0..max_msg, 0, 0, i as u64)?;
        }
        Ok(EngineCarrier {
            w,
            ep,
            max_msg,
            bufs,
            filled: BTreeMap::new(),
            sent_upto: 0,
            inflight: VecDeque::new(),
            copy_ns: 0,
        })
    }

    /// Takes every completion there is.
    fn reap(&mut self, r: &Rings) -> Res<()> {
        while let Some(c) = self.w.poll() {
            if c.status != Status::Ok {
                return Err(format!("completion {c:?}").into());
            }
            match c.op {
                OpKind::Recv => {
                    self.filled.insert(c.tag, (c.ctx as usize, c.len));
                }
                OpKind::Send => {
                    let Some(s) = self.inflight.iter_mut().find(|s| s.0 == c.ctx) else {
                        return Err("completion of an unknown send".into());
                    };
                    s.1 = true;
                    let mut head = None;
                    while self.inflight.front().is_some_and(|s| s.1) {
                        head = self.inflight.pop_front().map(|s| s.0);
                    }
                    if let Some(h) = head {
                        r.tx.get().consume_to(h);
                    }
                }
            }
        }
        Ok(())
    }

    /// Copies completed receives into the receive ring, in order, while it has room,
    /// and reposts their buffers.
    fn deliver(&mut self, r: &Rings) -> Res<()> {
        let rx = r.rx.get();
        loop {
            let room = rx.writable()?;
            let Some(&(i, len)) = self.filled.get(&room.pos) else { break };
            if room.len < len as u64 {
                break;
            }
            let bytes = self.bufs[i].bytes().map_err(|e| format!("{e:?}"))?;
            let t = Instant::now();
            rx.write_at(room.pos, &bytes[..len]);
            self.copy_ns += t.elapsed().as_nanos() as u64;
            rx.publish_to(room.pos + len as u64);
            self.filled.remove(&room.pos);
            self.w.post_recv(self.ep, &mut self.bufs[i], 0..self.max_msg, 0, 0, i as u64)?;
        }
        Ok(())
    }

    /// Hands the transmit ring's new bytes to the engine as messages (never across the
    /// ring's end: a message is one range of the region).
    fn send_new(&mut self, r: &Rings) -> Res<()> {
        let tail = r.tx.tail.load(Ordering::Acquire);
        while self.sent_upto < tail {
            let off = (self.sent_upto % RING as u64) as usize;
            let n = ((tail - self.sent_upto) as usize).min(self.max_msg).min(RING - off);
            let end = self.sent_upto + n as u64;
            self.inflight.push_back((end, false));
            self.w.post_send(self.ep, &r.tx.mr, off..off + n, self.sent_upto, end)?;
            self.sent_upto = end;
        }
        Ok(())
    }
}

impl Carrier for EngineCarrier {
    fn describe(&self) -> String {
        format!(
            "engine: filled {} sent_upto {} inflight {}; {}",
            self.filled.len(),
            self.sent_upto,
            self.inflight.len(),
            self.w.describe(self.ep).unwrap_or_default()
        )
    }

    fn pump(&mut self, r: &Rings) -> Res<()> {
        self.reap(r)?;
        self.deliver(r)?;
        self.send_new(r)
    }

    fn push(&mut self, r: &Rings) -> Res<()> {
        self.send_new(r)
    }

    fn after_read(&mut self, r: &Rings) -> Res<()> {
        if !self.filled.is_empty() {
            self.deliver(r)?;
        }
        Ok(())
    }

    fn finish(mut self, meet: &Meet, r: &Rings) -> Cost {
        meet.done.fetch_add(1, Ordering::SeqCst);
        while meet.done.load(Ordering::SeqCst) < 2 {
            if self.pump(r).is_err() {
                break;
            }
        }
        let mut stats = Cost::of(&self.w.device(self.ep).map(|d| d.rstats()).unwrap_or_default());
        stats.unexpected = self.w.stats(self.ep).map_or(0, |s| s.unexpected);
        stats.credit_frames = self.w.stats(self.ep).map_or(0, |s| s.credit_frames_sent);
        stats.copy_ns = self.copy_ns;
        self.w.close(self.ep);
        self.w.linger(Duration::from_secs(1));
        stats
    }
}

// ------------------------------------------------------------------ the program

/// Writes all of `src` into the transmit ring, as a blocking `write` would.
fn write_all<C: Carrier>(c: &mut C, r: &Rings, src: &[u8]) -> Res<()> {
    let tx = r.tx.get();
    let mut off = 0;
    let t = Instant::now();
    let mut spins = 0u32;
    while off < src.len() {
        let room = tx.writable()?;
        let n = (room.len as usize).min(src.len() - off);
        if n > 0 {
            tx.write_at(room.pos, &src[off..off + n]);
            tx.publish_to(room.pos + n as u64);
            off += n;
            c.push(r)?;
        } else {
            c.pump(r)?;
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && t.elapsed() > STUCK {
                return Err(format!("write: no ring room for 20 s; {}", c.describe()).into());
            }
        }
    }
    Ok(())
}

/// Reads what is there (at most `dst.len()`, at least one byte), as a blocking `read`.
fn read_some<C: Carrier>(c: &mut C, r: &Rings, dst: &mut [u8]) -> Res<usize> {
    let rx = r.rx.get();
    let t = Instant::now();
    let mut spins = 0u32;
    loop {
        let got = rx.readable()?;
        if got.len > 0 {
            let n = (got.len as usize).min(dst.len());
            rx.read_at(got.pos, &mut dst[..n]);
            rx.consume_to(got.pos + n as u64);
            c.after_read(r)?;
            return Ok(n);
        }
        c.pump(r)?;
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) && t.elapsed() > STUCK {
            return Err(format!("read: nothing for 20 s; {}", c.describe()).into());
        }
    }
}

fn read_exact<C: Carrier>(c: &mut C, r: &Rings, dst: &mut [u8]) -> Res<()> {
    let mut off = 0;
    while off < dst.len() {
        off += read_some(c, r, &mut dst[off..])?;
    }
    Ok(())
}

/// Where the two sides of a measurement meet: before the timed part, and at the end.
struct Meet {
    start: Barrier,
    done: AtomicUsize,
}

/// Which carrier, and for the engine which largest message and configuration.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Bridge,
    Engine,
    Engine64k,
    EngineCredits,
    EngineRndv,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Bridge => "bridge",
            Kind::Engine => "engine",
            Kind::Engine64k => "engine-64k",
            Kind::EngineCredits => "engine-cred",
            Kind::EngineRndv => "engine-rndv",
        }
    }
}

/// One side's device over its socket, made on the thread that drives it.
fn device(sock: UdpSocket) -> Res<UdpDevice> {
    // As remote.rs' `udp_config`: several threads may drive a connection's link, so
    // the plain-syscall backend; datagrams go out at once.
    let mut cfg = UdpConfig::from_env()?;
    cfg.backend = Backend::Mmsg;
    cfg.coalesce_ns = 0;
    Ok(UdpLink::from_socket(sock, &cfg)?.reliable(ReliableConfig::from_env()?))
}

/// Runs `f` on a side with the carrier of `kind`, then finishes it; also returns
/// the side's device counters.
fn side<T>(
    kind: Kind,
    sock: UdpSocket,
    meet: &Meet,
    f: impl FnOnce(&mut dyn FnMut(Op<'_>) -> Res<()>) -> Res<T>,
) -> Res<(T, Cost)> {
    let dev = device(sock)?;
    let rings = Rings::new()?;
    let max_payload = dev.max_frame_len() - strait_wire::MAX_HEADER_LEN;
    let base = Config::from_env()?;
    let (out, stats);
    match kind {
        Kind::Bridge => {
            let mut c = BridgeCarrier::new(dev)?;
            meet.start.wait();
            out = f(&mut |op| op.run(&mut c, &rings));
            stats = c.finish(meet, &rings);
        }
        _ => {
            let (cfg, max_msg) = match kind {
                Kind::Engine => {
                    let m = base.eager_threshold.min(max_payload);
                    (base, m)
                }
                Kind::Engine64k => (Config { eager_threshold: max_payload, ..base }, max_payload),
                Kind::EngineCredits => {
                    // As many credits as posted buffers: the sender never has more
                    // messages out than the receiver has buffers for.
                    let m = base.eager_threshold.min(max_payload);
                    (Config { credits: (RING / m) as u16, ..base }, m)
                }
                _ => (base, WRITE),
            };
            let mut c = EngineCarrier::new(dev, cfg, max_msg)?;
            meet.start.wait();
            out = f(&mut |op| op.run(&mut c, &rings));
            stats = c.finish(meet, &rings);
        }
    }
    Ok((out?, stats))
}

/// One program operation on a side.
enum Op<'a> {
    Write(&'a [u8]),
    ReadExact(&'a mut [u8]),
    ReadSome(&'a mut [u8], &'a mut usize),
}

impl Op<'_> {
    fn run<C: Carrier>(self, c: &mut C, r: &Rings) -> Res<()> {
        match self {
            Op::Write(src) => write_all(c, r, src),
            Op::ReadExact(dst) => read_exact(c, r, dst),
            Op::ReadSome(dst, n) => {
                *n = read_some(c, r, dst)?;
                Ok(())
            }
        }
    }
}

// ------------------------------------------------------------------ measurements

fn meet() -> Meet {
    Meet { start: Barrier::new(2), done: AtomicUsize::new(0) }
}

/// Counters of one side of a measurement, or of both added.
#[derive(Debug, Default, Clone, Copy)]
struct Cost {
    /// Frames (the carrier's messages, credits and control frames).
    frames: u64,
    /// Datagrams on the wire (retransmissions and acknowledgements included).
    datagrams: u64,
    /// Packets resent (timeouts and fast retransmissions).
    retransmits: u64,
    /// Congestion window reductions.
    cc_reductions: u64,
    /// Engine: messages that arrived before a receive buffer was posted for them
    /// (copied into the unexpected queue, and out again when a buffer is posted).
    unexpected: u64,
    /// Engine: stand-alone credit frames.
    credit_frames: u64,
    /// Engine: time spent copying completed receives into the receive ring.
    copy_ns: u64,
}

impl Cost {
    fn of(s: &ReliableStats) -> Cost {
        Cost {
            frames: s.frames_sent,
            datagrams: s.link.datagrams_sent,
            retransmits: s.timeout_retransmits + s.fast_retransmits,
            cc_reductions: s.cc_reductions + s.cc_timeouts,
            ..Cost::default()
        }
    }

    fn add(self, o: Cost) -> Cost {
        Cost {
            frames: self.frames + o.frames,
            datagrams: self.datagrams + o.datagrams,
            retransmits: self.retransmits + o.retransmits,
            cc_reductions: self.cc_reductions + o.cc_reductions,
            unexpected: self.unexpected + o.unexpected,
            credit_frames: self.credit_frames + o.credit_frames,
            copy_ns: self.copy_ns + o.copy_ns,
        }
    }
}

/// Joins the two sides' outcomes.
fn both<T>(a: Res<((), Cost)>, b: Res<(T, Cost)>) -> Res<(T, Cost)> {
    match (a, b) {
        (Ok(((), ca)), Ok((t, cb))) => Ok((t, ca.add(cb))),
        (Err(e), Ok(_)) => Err(format!("first side: {e}").into()),
        (Ok(_), Err(e)) => Err(format!("second side: {e}").into()),
        (Err(x), Err(y)) => Err(format!("first side: {x}; second side: {y}").into()),
    }
}

/// One-way latencies (half the round trip) of `pings` 16-byte ping-pongs, ns.
fn pingpong(pair: &VethPair, kind: Kind, pings: usize) -> Res<(Vec<f64>, Cost)> {
    let (sa, sb) = pair.udp_pair(false)?;
    let m = meet();
    let r = std::thread::scope(|s| {
        let server = s.spawn(|| {
            side(kind, sb, &m, |op| {
                let mut buf = [0u8; PING];
                for _ in 0..WARM + pings {
                    op(Op::ReadExact(&mut buf))?;
                    op(Op::Write(&buf))?;
                }
                Ok(())
            })
        });
        let lat = side(kind, sa, &m, |op| {
            let mut lat = Vec::with_capacity(pings);
            let mut back = [0u8; PING];
            for i in 0..WARM + pings {
                let ping = [(i % 251) as u8; PING];
                let t = Instant::now();
                op(Op::Write(&ping))?;
                op(Op::ReadExact(&mut back))?;
                let el = t.elapsed();
                if back != ping {
                    return Err(format!("ping {i}: wrong bytes back").into());
                }
                if i >= WARM {
                    lat.push(el.as_nanos() as f64 / 2.0);
                }
            }
            Ok(lat)
        });
        let srv = server.join().map_err(|_| "server side panicked")?;
        both(srv, lat)
    });
    r.map_err(|e| format!("ping-pong over {}: {e}", kind.name()).into())
}

/// Streams `total` bytes in writes of `--write-kib` (128 KiB); MB/s at the reader (every byte checked).
fn stream(pair: &VethPair, kind: Kind, total: usize) -> Res<(f64, Cost)> {
    let (sa, sb) = pair.udp_pair(false)?;
    let m = meet();
    // Byte at stream position p is p % 251 (a period prime to every size here).
    let write = WRITE_SIZE.load(Ordering::Relaxed);
    let pat: Vec<u8> = (0..write.max(WRITE) + 251).map(|i| (i % 251) as u8).collect();
    let r = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            side(kind, sa, &m, |op| {
                let mut pos = 0;
                while pos < total {
                    let n = write.min(total - pos);
                    let o = pos % 251;
                    op(Op::Write(&pat[o..o + n]))?;
                    pos += n;
                }
                Ok(())
            })
        });
        let secs = side(kind, sb, &m, |op| {
            let mut buf = vec![0u8; WRITE];
            let mut pos = 0;
            let t = Instant::now();
            while pos < total {
                let mut n = 0;
                let want = WRITE.min(total - pos);
                op(Op::ReadSome(&mut buf[..want], &mut n))?;
                let o = pos % 251;
                if buf[..n] != pat[o..o + n] {
                    return Err(format!("stream: wrong bytes at {pos}").into());
                }
                pos += n;
            }
            Ok(total as f64 / t.elapsed().as_secs_f64() / 1e6)
        });
        let w = writer.join().map_err(|_| "writer side panicked")?;
        both(w, secs)
    });
    r.map_err(|e| format!("stream over {}: {e}", kind.name()).into())
}

// ------------------------------------------------------------------ real programs

/// Where `strait` and `libstrait_preload.so` are (`--strait-dir`): then each round
/// also runs sockperf (TCP ping-pong, 16 B) and iperf3 (one stream, its default
/// 128 KiB writes) between the same namespaces under `strait run --peers` (the real
/// bridge, in `remote.rs`) and plain (kernel TCP).
struct Real {
    dir: std::path::PathBuf,
    seconds: u32,
    port: std::cell::Cell<u16>,
}

/// A started server in its own process group (killed whole at the end).
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let pid = self.0.id() as libc::pid_t;
        // SAFETY: signals the process group this harness started for the server.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

impl Real {
    /// `prog` in namespace `ns`, under `strait run --peers` if `strait`.
    fn argv(&self, pair: &VethPair, ns: usize, strait: bool, prog: &[&str]) -> std::process::Command {
        use std::os::unix::process::CommandExt;
        let mut c = pair.command(ns);
        if strait {
            c.arg(self.dir.join("strait"))
                .args(["run", "--stats", "--peers", &pair.subnet_v4(), "--preload"])
                .arg(self.dir.join("libstrait_preload.so"))
                .arg("--");
        }
        c.args(prog).env_remove("LD_PRELOAD").stdin(std::process::Stdio::null()).process_group(0);
        c
    }

    fn next_port(&self) -> String {
        self.port.set(self.port.get() + 1);
        self.port.get().to_string()
    }

    fn serve(&self, pair: &VethPair, strait: bool, prog: &[&str], port: &str) -> Res<Server> {
        let child = self
            .argv(pair, 0, strait, prog)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let srv = Server(child);
        let t = Instant::now();
        loop {
            let out = pair.exec(0, &["ss", "-Htln", &format!("sport = :{port}")])?;
            if !out.stdout.is_empty() {
                return Ok(srv);
            }
            if t.elapsed() > Duration::from_secs(10) {
                return Err(format!("nothing listens on port {port} after 10 s: {prog:?}").into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn client(&self, pair: &VethPair, strait: bool, prog: &[&str]) -> Res<(String, String)> {
        let out = self.argv(pair, 1, strait, prog).output()?;
        let (o, e) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        if !out.status.success() {
            return Err(format!("{prog:?} failed ({}): {o}{e}", out.status).into());
        }
        if strait && carried(&e) == 0 {
            return Err(format!(
                "{prog:?} under strait: the connection was not carried across (remote 0): {e}"
            )
            .into());
        }
        Ok((o, e))
    }

    /// sockperf TCP ping-pong, 16 B: one-way median and p99 (us), as sockperf reports.
    fn sockperf(&self, pair: &VethPair, strait: bool) -> Res<(f64, f64)> {
        let port = self.next_port();
        let a = pair.v4[0].to_string();
        let _srv = self.serve(pair, strait, &["sockperf", "sr", "--tcp", "-i", &a, "-p", &port], &port)?;
        let secs = self.seconds.to_string();
        let m = PING.to_string();
        let args = ["sockperf", "pp", "--tcp", "-i", &a, "-p", &port, "-t", &secs, "-m", &m, "--mps", "max"];
        let (o, e) = self.client(pair, strait, &args)?;
        let text = o + &e;
        let p = |q: &str| {
            text.lines()
                .find(|l| l.contains(&format!("percentile {q} =")))
                .and_then(|l| l.rsplit('=').next())
                .and_then(|v| v.trim().parse::<f64>().ok())
        };
        match (p("50.000"), p("99.000")) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => Err(format!("no percentiles from sockperf: {text}").into()),
        }
    }

    /// iperf3, one stream: MB/s the server received.
    fn iperf3(&self, pair: &VethPair, strait: bool) -> Res<f64> {
        let port = self.next_port();
        let a = pair.v4[0].to_string();
        let _srv = self.serve(pair, strait, &["iperf3", "-s", "-1", "-p", &port, "-B", &a], &port)?;
        let secs = self.seconds.to_string();
        let (o, _) = self.client(pair, strait, &["iperf3", "-c", &a, "-p", &port, "-t", &secs, "-J"])?;
        let bps = o
            .find("\"sum_received\"")
            .and_then(|i| o[i..].find("\"bits_per_second\":").map(|j| i + j + "\"bits_per_second\":".len()))
            .and_then(|k| o[k..].split([',', '\n', '}']).next())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .ok_or_else(|| format!("no sum_received in iperf3's output: {o}"))?;
        Ok(bps / 8.0 / 1e6)
    }
}

/// The real runs' names: under strait, plain.
const REAL: [&str; 2] = ["strait run --peers (bridge)", "kernel TCP"];

/// The `remote` count of the stats line(s) in `stderr`: connections strait carried
/// across hosts.
fn carried(stderr: &str) -> u64 {
    stderr
        .lines()
        .filter(|l| l.contains("strait-preload:"))
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w.windows(2).find(|p| p[0] == "remote").and_then(|p| p[1].parse::<u64>().ok())
        })
        .sum()
}

// ------------------------------------------------------------------ main

fn arg(args: &[String], name: &str, default: usize) -> Res<usize> {
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args.get(i + 1).ok_or(format!("{name} needs a value"))?.parse()?),
        None => Ok(default),
    }
}

fn cpu_model() -> String {
    let out =
        std::process::Command::new("lscpu").output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    out.ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Model name:"))
                .map(|l| l["Model name:".len()..].trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn loadavg() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn med(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    pct(&mut v, 0.5)
}

/// How many compilers (`rustc`, `cargo`) run on the machine now.
fn compilers() -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .filter(|c| matches!(c.trim(), "rustc" | "cargo"))
        .count()
}

/// Everything one round measured.
struct Round {
    /// No compiler ran at any of its checks (start, after each measurement).
    quiet: bool,
    load: String,
    /// Per ping-pong carrier: p50 and p99 one-way (us), counters.
    pp: Vec<(f64, f64, Cost)>,
    /// Per streaming carrier: MB/s, counters.
    st: Vec<(f64, Cost)>,
    /// Real programs, under strait and plain: sockperf p50, p99 (us), iperf3 MB/s.
    real: Option<[(f64, f64, f64); 2]>,
}

const PP_KINDS: [Kind; 2] = [Kind::Bridge, Kind::Engine];
const ST_KINDS: [Kind; 5] =
    [Kind::Bridge, Kind::Engine, Kind::Engine64k, Kind::EngineCredits, Kind::EngineRndv];

fn round(pair: &VethPair, real: Option<&Real>, flip: bool, pings: usize, total: usize) -> Res<Round> {
    let mut busy = compilers() > 0;
    let load = loadavg();
    let order = |n: usize| -> Vec<usize> {
        if flip {
            (0..n).rev().collect()
        } else {
            (0..n).collect()
        }
    };
    let mut pp = vec![(0.0, 0.0, Cost::default()); PP_KINDS.len()];
    for k in order(PP_KINDS.len()) {
        let (mut lat, c) = pingpong(pair, PP_KINDS[k], pings)?;
        pp[k] = (pct(&mut lat, 0.5) / 1e3, pct(&mut lat, 0.99) / 1e3, c);
        busy |= compilers() > 0;
    }
    let mut st = vec![(0.0, Cost::default()); ST_KINDS.len()];
    for k in order(ST_KINDS.len()) {
        st[k] = stream(pair, ST_KINDS[k], total)?;
        busy |= compilers() > 0;
    }
    let real = match real {
        Some(r) => {
            let mut out = [(0.0, 0.0, 0.0); 2];
            // Under strait (the real bridge) and plain (kernel TCP), alternating.
            for strait in if flip { [false, true] } else { [true, false] } {
                let (a, b) = r.sockperf(pair, strait)?;
                let v = r.iperf3(pair, strait)?;
                out[usize::from(!strait)] = (a, b, v);
                busy |= compilers() > 0;
            }
            Some(out)
        }
        None => None,
    };
    Ok(Round { quiet: !busy, load, pp, st, real })
}

fn print_round(i: usize, r: &Round) {
    let mut line =
        format!("round {:>2} ({}, load {}):", i + 1, if r.quiet { "quiet" } else { "COMPILING" }, r.load);
    for (k, (a, b, c)) in r.pp.iter().enumerate() {
        line += &format!(" pp {} {a:.2}/{b:.2} us rx{};", PP_KINDS[k].name(), c.retransmits);
    }
    for (k, (v, c)) in r.st.iter().enumerate() {
        line += &format!(" st {} {v:.0} MB/s rx{};", ST_KINDS[k].name(), c.retransmits);
    }
    if let Some(real) = &r.real {
        for (k, (a, b, v)) in real.iter().enumerate() {
            line += &format!(" {}: sockperf {a:.2}/{b:.2} us, iperf3 {v:.0} MB/s;", REAL[k]);
        }
    }
    println!("{line}");
}

/// Medians over `rounds` (counters: both sides added).
fn summary(what: &str, rounds: &[&Round], pings: usize, total: usize) {
    let n = (WARM + pings) as f64;
    let mib = (total >> 20) as f64;
    let m = |f: &dyn Fn(&Round) -> f64| med(&rounds.iter().map(|r| f(r)).collect::<Vec<_>>());
    println!("\nmedians over {} {what} rounds (counters: both sides added)", rounds.len());
    println!(
        "  {:<12} {:>10} {:>10} {:>12} {:>14} {:>10}",
        "16 B pp", "p50 us", "p99 us", "frames/ping", "datagrams/ping", "rexmits"
    );
    for (k, kind) in PP_KINDS.iter().enumerate() {
        println!(
            "  {:<12} {:>10.2} {:>10.2} {:>12.2} {:>14.2} {:>10.0}",
            kind.name(),
            m(&|r| r.pp[k].0),
            m(&|r| r.pp[k].1),
            m(&|r| r.pp[k].2.frames as f64 / n),
            m(&|r| r.pp[k].2.datagrams as f64 / n),
            m(&|r| r.pp[k].2.retransmits as f64)
        );
    }
    println!(
        "  {:<12} {:>10} {:>10} {:>12} {:>14} {:>10} {:>8} {:>10} {:>10} {:>12}",
        "streaming",
        "MB/s",
        "us/MiB",
        "frames/MiB",
        "datagrams/MiB",
        "rexmits",
        "cc cuts",
        "unexp/MiB",
        "credit/MiB",
        "ring-copy us/MiB"
    );
    for (k, kind) in ST_KINDS.iter().enumerate() {
        let v = m(&|r| r.st[k].0);
        println!(
            "  {:<12} {:>10.0} {:>10.1} {:>12.2} {:>14.1} {:>10.0} {:>8.0} {:>10.2} {:>10.2} {:>12.1}",
            kind.name(),
            v,
            1048576.0 / v,
            m(&|r| r.st[k].1.frames as f64 / mib),
            m(&|r| r.st[k].1.datagrams as f64 / mib),
            m(&|r| r.st[k].1.retransmits as f64),
            m(&|r| r.st[k].1.cc_reductions as f64),
            m(&|r| r.st[k].1.unexpected as f64 / mib),
            m(&|r| r.st[k].1.credit_frames as f64 / mib),
            m(&|r| r.st[k].1.copy_ns as f64 / mib / 1000.0)
        );
    }
    if rounds.iter().all(|r| r.real.is_some()) {
        println!("  real programs between the same namespaces (sockperf pp --tcp -m {PING}; iperf3, 128 KiB writes):");
        for (k, name) in REAL.iter().enumerate() {
            let g = |f: fn(&(f64, f64, f64)) -> f64| m(&|r| r.real.as_ref().map_or(0.0, |x| f(&x[k])));
            println!(
                "  {:<28} sockperf one-way p50 {:.2} us, p99 {:.2} us; iperf3 {:.0} MB/s",
                name,
                g(|x| x.0),
                g(|x| x.1),
                g(|x| x.2)
            );
        }
    }
    println!("  engine / bridge, median of the per-round ratios (latency above 1: slower; throughput below 1: slower)");
    println!(
        "    16 B one-way p50 {:.3}, p99 {:.3}",
        m(&|r| r.pp[1].0 / r.pp[0].0),
        m(&|r| r.pp[1].1 / r.pp[0].1)
    );
    for (k, kind) in ST_KINDS.iter().enumerate().skip(1) {
        println!("    streaming, {} {:.3}", kind.name(), m(&|r| r.st[k].0 / r.st[0].0));
    }
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let real = match args.iter().position(|a| a == "--strait-dir") {
        Some(i) => Some(Real {
            dir: args.get(i + 1).ok_or("--strait-dir needs a value")?.into(),
            seconds: arg(&args, "--real-seconds", 2)? as u32,
            port: std::cell::Cell::new(12000),
        }),
        None => None,
    };
    let rounds = arg(&args, "--rounds", 5)?;
    let pings = arg(&args, "--pings", 20000)?;
    let total = arg(&args, "--stream-mib", 256)? << 20;
    let quiet_wait = arg(&args, "--quiet-wait", 60)? as u64;
    let write_kib = arg(&args, "--write-kib", WRITE >> 10)?;
    if write_kib == 0 || write_kib << 10 > RING {
        return Err("--write-kib must be 1..512".into());
    }
    WRITE_SIZE.store(write_kib << 10, Ordering::Relaxed);
    let budget = arg(&args, "--budget", 240)? as u64;
    if rounds == 0 || pings == 0 || total == 0 {
        return Err("--rounds, --pings and --stream-mib must be positive".into());
    }
    println!(
        "xhost_stream: CPU {} ({} cpus), kernel {}, load {}",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        loadavg()
    );
    println!(
        "{rounds} interleaved rounds; ring {} KiB per direction; ping-pong {PING} B x {pings} (+{WARM} warm-up); \
         stream {} MiB in {} KiB writes; Reliable<UdpLink> (mmsg, no coalescing) across a veth pair",
        RING >> 10,
        total >> 20,
        WRITE_SIZE.load(Ordering::Relaxed) >> 10
    );
    let pair = VethPair::create()?;
    // Time spent measuring (the waits for quiet not counted).
    let mut measured = Duration::ZERO;
    let mut done: Vec<Round> = Vec::new();
    for i in 0..rounds {
        if measured.as_secs() >= budget {
            println!("measuring budget of {budget} s spent: {i} of {rounds} rounds done");
            break;
        }
        // Before each round, wait (bounded) until no compiler runs; rounds with a
        // compiler at any check are marked and summed up apart.
        let t = Instant::now();
        while compilers() > 0 && t.elapsed().as_secs() < quiet_wait {
            std::thread::sleep(Duration::from_secs(1));
        }
        // The order alternates from round to round (drift hits all alike).
        let t = Instant::now();
        let r = round(&pair, real.as_ref(), i % 2 == 1, pings, total)?;
        measured += t.elapsed();
        print_round(i, &r);
        done.push(r);
    }
    if done.is_empty() {
        return Err("no round done".into());
    }
    let all: Vec<&Round> = done.iter().collect();
    summary("interleaved", &all, pings, total);
    let quiet: Vec<&Round> = done.iter().filter(|r| r.quiet).collect();
    if quiet.len() >= 3 && quiet.len() < all.len() {
        summary("quiet (no compiler running)", &quiet, pings, total);
    } else if quiet.len() < all.len() {
        println!("\nonly {} of {} rounds ran without a compiler on the machine", quiet.len(), all.len());
    }
    // A thread descheduled by other work lets its socket's buffer overflow: the
    // losses and their recovery, not the carrier, then set the streaming figures.
    let lossless: Vec<&Round> = done
        .iter()
        .filter(|r| r.pp.iter().map(|x| x.2).chain(r.st.iter().map(|x| x.1)).all(|c| c.retransmits == 0))
        .collect();
    if lossless.len() >= 3 && lossless.len() < all.len() {
        summary("loss-free (no retransmission in any measurement)", &lossless, pings, total);
    } else if lossless.len() < all.len() {
        println!("\nonly {} of {} rounds ran without a retransmission", lossless.len(), all.len());
    }
    println!("measured for {} s (waits for quiet not counted)", measured.as_secs());
    println!("load after: {}", loadavg());
    Ok(())
}
