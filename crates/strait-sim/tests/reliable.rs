//! The reliability layer between two hosts of the simulator, under deterministic
//! faults ([`SimNet::set_fault`]: every n-th datagram lost, doubled or changed):
//! every message of every size class arrives exactly once, in order and intact
//! through loss, duplication, reordering and corruption; hostile datagrams are
//! counted and dropped; a silent peer fails outstanding operations; close drains.
//! Some tests drive the two devices bare (no engine) on the virtual clock.
//!
//! (Moved from strait-core's `tests/reliable.rs`, which carried its own in-memory
//! network; `faults.rs` tests the same layer under random faults, `scale.rs` at
//! scale.)

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use strait_core::congestion::Congestion;
use strait_core::reliable::{PacketAuth, PacketKey, Reliable, ReliableConfig};
use strait_core::{Completion, Config, Device, Engine, EpId, Link, MemoryRegion, OpKind, Status};
use strait_sim::{DirId, Fault, Handler, LinkConfig, LinkParams, Sim, SimLink, SimNet};
use strait_sys::pattern;

type Dev = Reliable<SimLink>;

/// The connection nonces of the two ends (the caller's, as in the simulator's own
/// pairs; fixed so that a configuration can tell the ends apart).
const NONCE_A: u64 = 0x1111_2222_3333_4444;
const NONCE_B: u64 = 0x5555_6666_7777_8888;

/// The simulator's seed (the faults here are deterministic; the seed only fixes the
/// net's own draws).
const SEED: u64 = 16;

/// Two hosts' links: 20 us one way, no bandwidth limit, no random fault.
fn wire() -> LinkParams {
    LinkParams { latency_ns: 20_000, jitter_ns: 0, bandwidth_bps: 0, queue_bytes: 0, ..LinkParams::default() }
}

/// Short timers, so that losses and a silent peer show within milliseconds of
/// virtual time. (Every configuration here is a function of the end's nonce, so
/// that it can tell the ends apart; this one is the same for both.)
fn rel_cfg(_nonce: u64) -> ReliableConfig {
    ReliableConfig {
        rto_initial_ns: 2_000_000,
        rto_min_ns: 500_000,
        keepalive_ns: 50_000_000,
        liveness_ns: 400_000_000,
        ..ReliableConfig::default()
    }
}

/// The simulated net between host 0 (a) and host 1 (b).
struct Net {
    net: SimNet,
    /// a to b.
    ab: DirId,
    /// b to a.
    ba: DirId,
}

impl Net {
    /// Moves the virtual clock `ns` on (delivering what arrives by then).
    fn tick(&self, ns: u64) {
        self.net.advance_to(self.net.now_ns() + ns);
    }
}

/// Two reliable devices over the simulator, with these faults a to b and b to a
/// (`None`: none), `cfg` from each end's nonce, and links that claim (or not)
/// carriers that check payloads.
fn devices_over(
    fault_ab: Option<Fault>,
    fault_ba: Option<Fault>,
    cfg: impl Fn(u64) -> ReliableConfig,
    checked: [bool; 2],
) -> (Net, Dev, Dev) {
    let net = SimNet::new(SEED);
    let link = LinkConfig { slots: 512, ring: 64, ..LinkConfig::default() };
    let (mut la, mut lb) = net.link_pair(0, 1, wire(), wire(), &link);
    la.set_carrier_checksum(checked[0]);
    lb.set_carrier_checksum(checked[1]);
    let (ab, ba) = (la.tx_dir(), lb.tx_dir());
    net.set_fault(ab, fault_ab);
    net.set_fault(ba, fault_ba);
    let a = Reliable::with_nonce(la, cfg(NONCE_A), NONCE_A);
    let b = Reliable::with_nonce(lb, cfg(NONCE_B), NONCE_B);
    (Net { net, ab, ba }, a, b)
}

/// [`devices_over`] links that claim no carrier checksum.
fn devices(
    fault_ab: Option<Fault>,
    fault_ba: Option<Fault>,
    cfg: impl Fn(u64) -> ReliableConfig,
) -> (Net, Dev, Dev) {
    devices_over(fault_ab, fault_ba, cfg, [false, false])
}

/// Completions seen during one [`Pair::run`], per host, with their virtual times.
type Got = [Vec<(u64, Completion)>; 2];

/// Hands completions to `got` and asks `done` after every step.
struct Until<F> {
    got: Got,
    done: F,
}

impl<F: FnMut(&Got, &[Engine<Dev>]) -> bool> Handler<Dev> for Until<F> {
    fn on_completion(&mut self, now_ns: u64, host: usize, _: &mut Engine<Dev>, c: Completion) {
        self.got[host].push((now_ns, c));
    }
    fn done(&mut self, _now_ns: u64, engines: &[Engine<Dev>]) -> bool {
        (self.done)(&self.got, engines)
    }
}

/// Two hosts, each an engine with one endpoint over the devices.
struct Pair {
    net: Net,
    sim: Sim<Dev>,
    ea: EpId,
    eb: EpId,
}

impl Pair {
    fn new((net, a, b): (Net, Dev, Dev)) -> Self {
        let mut sim = Sim::new(net.net.clone());
        let mut ends = Vec::new();
        for d in [a, b] {
            let mut e = Engine::new(Config::default());
            ends.push(e.attach(d));
            sim.add_host(e);
        }
        Pair { net, sim, ea: ends[0], eb: ends[1] }
    }

    /// Host a's engine.
    fn a(&mut self) -> &mut Engine<Dev> {
        self.sim.engine(0)
    }

    /// Host b's engine.
    fn b(&mut self) -> &mut Engine<Dev> {
        self.sim.engine(1)
    }

    /// Host a's reliability counters.
    fn a_stats(&self) -> strait_core::ReliableStats {
        self.sim.engine_ref(0).device(self.ea).expect("dev").rstats()
    }

    /// Host b's reliability counters.
    fn b_stats(&self) -> strait_core::ReliableStats {
        self.sim.engine_ref(1).device(self.eb).expect("dev").rstats()
    }

    /// Runs the simulation until `done` says so; returns the completions seen.
    /// Panics after `limit_ns` of virtual time.
    #[track_caller]
    fn run(&mut self, limit_ns: u64, done: impl FnMut(&Got, &[Engine<Dev>]) -> bool) -> Got {
        self.sim.limits.virtual_ns = limit_ns;
        let mut h = Until { got: [Vec::new(), Vec::new()], done };
        if let Err(e) = self.sim.run(&mut h) {
            panic!("{e}; completions so far {:?}", h.got);
        }
        h.got
    }
}

/// Sends `sizes` from a to b (each posted after the previous completes on b) and
/// checks every byte.
fn stream(p: &mut Pair, sizes: &[usize]) {
    let max = sizes.iter().copied().max().unwrap_or(1).max(1);
    let mut inbox = MemoryRegion::new(max).expect("region");
    let (ea, eb) = (p.ea, p.eb);
    for (i, &len) in sizes.iter().enumerate() {
        let data = pattern(i as u64, len);
        let mut outbox = MemoryRegion::new(len.max(1)).expect("region");
        outbox.write_at(0, &data).expect("write");
        p.b().post_recv(eb, &mut inbox, 0..max, i as u64, u64::MAX, i as u64).expect("post recv");
        p.a().post_send(ea, &outbox, 0..len, i as u64, i as u64).expect("post send");
        let got = p.run(5_000_000_000, |got, _| !got[0].is_empty() && !got[1].is_empty());
        for (_, c) in &got[0] {
            assert_eq!((c.op, c.status), (OpKind::Send, Status::Ok), "send {i}");
        }
        let c = got[1][0].1;
        assert_eq!((c.op, c.status, c.len, c.tag), (OpKind::Recv, Status::Ok, len, i as u64), "message {i}");
        let mut back = vec![0u8; len];
        inbox.read_at(0, &mut back).expect("read");
        assert!(back == data, "message {i} ({len} bytes) corrupted");
    }
}

const SIZES: &[usize] = &[0, 1, 8, 1400, 1452, 1453, 4000, 32 * 1024, 40_000, 200_000, 1 << 20];

/// A fault from a rule on the datagram's number (how many copies go on).
fn every(rule: impl Fn(u64) -> usize + 'static) -> Option<Fault> {
    Some(Box::new(move |n, _| rule(n)))
}

#[test]
fn every_size_arrives_over_a_clean_link() {
    let mut p = Pair::new(devices(None, None, rel_cfg));
    stream(&mut p, SIZES);
    let s = p.a_stats();
    assert_eq!(s.timeout_retransmits + s.fast_retransmits, 0, "{s:?}");
}

#[test]
fn loss_duplication_and_reordering_are_repaired() {
    // a->b: every 7th datagram lost, every 11th doubled; b->a: every 5th lost.
    let ab = every(|n| {
        if n % 7 == 3 {
            0
        } else if n % 11 == 5 {
            2
        } else {
            1
        }
    });
    let ba = every(|n| usize::from(n % 5 != 2));
    let mut p = Pair::new(devices(ab, ba, rel_cfg));
    stream(&mut p, SIZES);
    let (sa, sb) = (p.a_stats(), p.b_stats());
    assert!(sa.fast_retransmits + sa.timeout_retransmits > 0, "{sa:?}");
    assert!(sb.duplicates > 0 && sb.out_of_order > 0, "{sb:?}");
}

#[test]
fn corrupted_datagrams_are_caught_and_never_delivered() {
    let ab: Fault = Box::new(|n, d| {
        if n % 6 == 4 {
            let i = (n as usize * 31) % d.len();
            d[i] ^= 0x20;
        }
        1
    });
    let mut p = Pair::new(devices(Some(ab), None, rel_cfg));
    stream(&mut p, SIZES);
    let sb = p.b_stats();
    assert!(sb.bad_checksum > 0, "{sb:?}");
}

/// Polls two bare devices (no engine) `passes` times, `step_ns` of virtual time
/// apart, so that the handshake and timers run.
fn bare_passes(net: &Net, a: &mut Dev, b: &mut Dev, passes: usize, step_ns: u64) {
    for _ in 0..passes {
        if a.is_established() && b.is_established() {
            return;
        }
        for d in [&mut *a, &mut *b] {
            let _ = d.recv_frame(&mut |_| {});
            let _ = d.check_peer();
        }
        net.tick(step_ns);
    }
}

/// Over carriers that check payloads themselves (UDP's checksum) the CRC covers the
/// header only, unless `payload_crc` asks for more: every size still arrives intact,
/// a corrupted header is still caught, and a receiver whose carrier does not check
/// payloads refuses header-only packets instead of trusting them.
#[test]
fn header_only_crc_over_a_checking_carrier() {
    use strait_wire::packet::FLAG_HEADER_CRC;
    for payload_crc in [false, true] {
        let flagged = Rc::new(Cell::new((0u64, 0u64)));
        let f = flagged.clone();
        let count: Fault = Box::new(move |n, d| {
            let (h, all) = f.get();
            f.set((h + u64::from(d[2] & FLAG_HEADER_CRC != 0), all + 1));
            // Every 9th datagram b-bound gets a header bit flipped.
            if n % 9 == 4 {
                d[13] ^= 0x04;
            }
            1
        });
        let cfg = |nonce| ReliableConfig { payload_crc, ..rel_cfg(nonce) };
        let mut p = Pair::new(devices_over(Some(count), None, cfg, [true, true]));
        stream(&mut p, SIZES);
        let (header_only, all) = flagged.get();
        assert!(all > 700, "{all} datagrams");
        if payload_crc {
            assert_eq!(header_only, 0, "payload_crc set, yet {header_only} of {all} header-only");
        } else {
            assert_eq!(header_only, all, "a packet kept its payload CRC");
        }
        let sb = p.b_stats();
        assert!(sb.bad_checksum > 0, "header corruption unnoticed: {sb:?}");
    }
    // A sender over a checking carrier, a receiver over one that does not check.
    let (net, mut a, mut b) = devices_over(None, None, rel_cfg, [true, false]);
    bare_passes(&net, &mut a, &mut b, 200, 100_000);
    let sb = b.rstats();
    assert!(!b.is_established() && sb.bad_checksum > 0, "{sb:?}");
}

#[test]
fn hostile_datagrams_are_counted_and_dropped() {
    let mut p = Pair::new(devices(None, None, rel_cfg));
    stream(&mut p, &[8]);
    let (ea, eb) = (p.ea, p.eb);
    // A valid packet from a to copy ids from (and drop: b never sees it).
    let last = Rc::new(RefCell::new(None));
    let l = last.clone();
    let keep_and_drop: Fault = Box::new(move |_, d| {
        *l.borrow_mut() = Some(d.clone());
        0
    });
    p.net.net.set_fault(p.net.ab, Some(keep_and_drop));
    let mut outbox = MemoryRegion::new(8).expect("region");
    outbox.write_at(0, b"template").expect("write");
    p.a().post_send(ea, &outbox, 0..8, 99, 0).expect("send");
    p.net.net.set_fault(p.net.ab, None);
    let template = last.borrow_mut().take().expect("packet");
    let mut hostile: Vec<Vec<u8>> = vec![vec![], vec![1; 10], vec![0xff; 48], vec![0; 2000]];
    let mut v = template.clone();
    v[0] = 9; // version
    hostile.push(v);
    let mut v = template.clone();
    v[28] = 0xff; // length field
    hostile.push(v);
    let mut v = template.clone();
    v.truncate(50);
    hostile.push(v);
    for seed in 0..200u64 {
        hostile.push(pattern(seed, (seed as usize * 13) % 1600));
    }
    // Forged sequence numbers and ids with a correct checksum.
    for (off, val) in [(12usize, 0x7fff_0000u32), (4, 12345), (8, 777), (16, 0xdead)] {
        let mut v = template.clone();
        v[off..off + 4].copy_from_slice(&val.to_le_bytes());
        strait_wire::packet::seal(&mut v);
        hostile.push(v);
    }
    let n = hostile.len() as u64;
    let now = p.net.net.now_ns();
    for h in hostile {
        p.net.net.inject(p.net.ab, now, &h);
    }
    let mut inbox = MemoryRegion::new(64).expect("region");
    p.b().post_recv(eb, &mut inbox, 0..64, 5, u64::MAX, 0).expect("recv");
    let got = p.run(100_000_000, |_, engines| {
        let s = engines[1].device(eb).expect("dev").rstats();
        s.bad_checksum + s.bad_header + s.wrong_conn + s.out_of_window >= n
    });
    assert!(got[1].is_empty(), "a hostile datagram was delivered: {:?}", got[1]);
    // The connection still works.
    let mut outbox = MemoryRegion::new(8).expect("region");
    outbox.write_at(0, b"after!!!").expect("write");
    p.a().post_send(ea, &outbox, 0..8, 5, 0).expect("send");
    let got = p.run(1_000_000_000, |got, _| !got[1].is_empty());
    assert_eq!(got[1][0].1.status, Status::Ok);
    let mut b = [0u8; 8];
    inbox.read_at(0, &mut b).expect("read");
    assert_eq!(&b, b"after!!!");
}

/// The keys of one authenticated connection, seen from a (`a_side`) or b.
fn auth(a_side: bool, secret: &[u8]) -> PacketAuth {
    let k = PacketKey::new(secret);
    let (ab, ba) = (k.derive(b"a to b", &[]), k.derive(b"b to a", &[]));
    if a_side {
        PacketAuth { tx: ab, rx: ba }
    } else {
        PacketAuth { tx: ba, rx: ab }
    }
}

/// With keys, a forger on the path who changes a payload and fixes the CRC (which
/// covers the header only once the tag covers the payload) gets nothing delivered:
/// every such packet is counted and dropped, and every message still arrives intact
/// (the sender retransmits). A packet without a tag is dropped too.
#[test]
fn authenticated_packets_with_a_bad_tag_are_dropped_never_delivered() {
    use strait_wire::packet::{seal_with, CrcCoverage, PACKET_HEADER_LEN, TAG_LEN};
    let forged = Rc::new(Cell::new(0u64));
    let last = Rc::new(RefCell::new(None));
    let (f, l) = (forged.clone(), last.clone());
    let tamper: Fault = Box::new(move |n, d| {
        if n % 9 == 3 && d.len() > PACKET_HEADER_LEN + TAG_LEN {
            d[PACKET_HEADER_LEN] ^= 0x5a;
            let body = d.len() - TAG_LEN;
            seal_with(&mut d[..body], CrcCoverage::Header);
            f.set(f.get() + 1);
        }
        *l.borrow_mut() = Some(d.clone());
        1
    });
    let cfg = |nonce| ReliableConfig { auth: Some(auth(nonce == NONCE_A, b"s")), ..rel_cfg(nonce) };
    let mut p = Pair::new(devices(Some(tamper), None, cfg));
    stream(&mut p, SIZES);
    let sb = p.b_stats();
    assert!(forged.get() > 50, "{} forged", forged.get());
    assert_eq!(sb.bad_mac, forged.get(), "{sb:?}");
    assert_eq!(sb.bad_checksum, 0, "the forger fixed every CRC: {sb:?}");
    // An unauthenticated packet with a valid CRC, addressed to b.
    let mut v = last.borrow_mut().take().expect("a packet a to b");
    v.truncate(v.len() - TAG_LEN);
    v[2] &= !strait_wire::packet::FLAG_MAC;
    let plen = (v.len() - PACKET_HEADER_LEN) as u16;
    v[28..30].copy_from_slice(&plen.to_le_bytes());
    strait_wire::packet::seal(&mut v);
    p.net.net.inject(p.net.ab, p.net.net.now_ns(), &v);
    let eb = p.eb;
    let got =
        p.run(100_000_000, |_, engines| engines[1].device(eb).expect("dev").rstats().bad_mac > forged.get());
    assert!(got[1].is_empty(), "an unauthenticated packet was delivered");
}

/// Different keys at the two ends: nothing passes, the connection never comes up.
#[test]
fn different_keys_never_establish() {
    let cfg = |nonce| {
        let secret: &[u8] = if nonce == NONCE_A { b"one" } else { b"two" };
        ReliableConfig { auth: Some(auth(nonce == NONCE_A, secret)), ..rel_cfg(nonce) }
    };
    let (net, mut a, mut b) = devices(None, None, cfg);
    bare_passes(&net, &mut a, &mut b, 200, 100_000);
    let (sa, sb) = (a.rstats(), b.rstats());
    assert!(!a.is_established() && !b.is_established(), "{sa:?} {sb:?}");
    assert!(sa.bad_mac > 0 && sb.bad_mac > 0, "{sa:?} {sb:?}");
}

#[test]
fn a_silent_peer_fails_outstanding_operations() {
    let mut p = Pair::new(devices(None, None, rel_cfg));
    stream(&mut p, &[100]);
    let start = p.net.net.now_ns();
    p.net.net.partition_all(start, None);
    let (ea, eb) = (p.ea, p.eb);
    let outbox = MemoryRegion::new(100_000).expect("region");
    p.a().post_send(ea, &outbox, 0..100_000, 1, 7).expect("send");
    let mut inbox = MemoryRegion::new(64).expect("region");
    p.b().post_recv(eb, &mut inbox, 0..64, 0, 0, 8).expect("recv");
    let got = p.run(2_000_000_000, |got, _| !got[0].is_empty() && !got[1].is_empty());
    for (at, c) in [got[0][0], got[1][0]] {
        assert_eq!(c.status, Status::PeerGone);
        let waited = at - start;
        assert!((399_000_000..1_000_000_000).contains(&waited), "failed after {waited} ns");
    }
}

#[test]
fn close_delivers_everything_then_drains() {
    let ab = every(|n| usize::from(n % 4 != 1));
    let mut p = Pair::new(devices(ab, None, rel_cfg));
    let (ea, eb) = (p.ea, p.eb);
    let data = pattern(3, 300_000);
    let mut outbox = MemoryRegion::new(data.len()).expect("region");
    outbox.write_at(0, &data).expect("write");
    let mut inbox = MemoryRegion::new(data.len()).expect("region");
    p.b().post_recv(eb, &mut inbox, 0..data.len(), 0, 0, 0).expect("recv");
    p.a().post_send(ea, &outbox, 0..data.len(), 1, 0).expect("send");
    let mut got_b = p.run(5_000_000_000, |got, _| !got[0].is_empty())[1].clone();
    let small = MemoryRegion::new(16).expect("region");
    let mut inbox2 = MemoryRegion::new(16).expect("region");
    p.b().post_recv(eb, &mut inbox2, 0..16, 0, 0, 0).expect("recv");
    p.a().post_send(ea, &small, 0..16, 2, 0).expect("send");
    // Close once the device took the message: close cancels what it has not (the
    // congestion window may still hold it back behind the large transfer).
    let sent = |got: &Got| got[0].iter().any(|(_, c)| c.op == OpKind::Send && c.status == Status::Ok);
    let got = p.run(5_000_000_000, |got, _| sent(got));
    got_b.extend_from_slice(&got[1]);
    p.a().close(ea);
    let got = p.run(5_000_000_000, |got, _| got_b.len() + got[1].len() >= 2);
    got_b.extend_from_slice(&got[1]);
    p.run(5_000_000_000, |_, engines| engines[0].closing() == 0);
    assert!(got_b.iter().all(|(_, c)| c.status == Status::Ok), "{got_b:?}");
    let mut back = vec![0u8; data.len()];
    inbox.read_at(0, &mut back).expect("read");
    assert!(back == data);
}

/// Two bare devices (no engine) over the simulator, past the handshake.
fn bare_pair(cfg: impl Fn(u64) -> ReliableConfig) -> (Net, Dev, Dev) {
    let (net, mut a, mut b) = devices(None, None, cfg);
    bare_passes(&net, &mut a, &mut b, 1000, 10_000);
    assert!(a.is_established() && b.is_established());
    (net, a, b)
}

/// Sends one frame of `len` bytes from `d` and pushes everything queued to the wire.
fn bare_send(d: &mut Dev, len: usize) {
    assert!(d.send_frame(len, &mut |w| w.write(0, &vec![7u8; len])).expect("send"));
    for _ in 0..8 {
        d.doorbell().expect("doorbell");
    }
}

#[test]
fn an_acknowledgement_leaves_while_a_stream_still_arrives() {
    // The acknowledgement mechanism with a full window: no congestion window (whose
    // slow start would hold the frames back).
    let (net, mut a, mut b) = bare_pair(|n| ReliableConfig { congestion: Congestion::Off, ..rel_cfg(n) });
    // Nine frames of 42 packets, within the default window of 512.
    for _ in 0..9 {
        bare_send(&mut a, 60_000);
    }
    let acks_before = net.net.dir_stats(net.ba).sent;
    net.tick(30_000);
    let mut frames = 0;
    assert!(b.recv_frame(&mut |_| frames += 1).expect("recv"));
    // One frame's acknowledgement waits for more (one doorbell for several) ...
    assert_eq!(net.net.dir_stats(net.ba).sent, acks_before, "acknowledged at once");
    // Six more: 7 x 42 = 294 packets, past half the window (256).
    for _ in 0..6 {
        assert!(b.recv_frame(&mut |_| frames += 1).expect("recv"));
    }
    assert_eq!(frames, 7);
    assert!(net.net.unreceived(net.ab) > 0, "the rest of the stream is still waiting");
    // ... but not until the receiver has handled everything that arrived: once
    // the acknowledgements held back cover half the window, they leave.
    assert!(net.net.dir_stats(net.ba).sent > acks_before, "no acknowledgement sent yet");
}

#[test]
fn the_retransmission_timer_restarts_when_acknowledgements_progress() {
    // Two frames at once, past the initial congestion window: the timer alone here.
    let cfg = |nonce| ReliableConfig {
        rto_min_ns: 5_000_000,
        rto_initial_ns: 5_000_000,
        congestion: Congestion::Off,
        ..rel_cfg(nonce)
    };
    let (net, mut a, mut b) = bare_pair(cfg);
    let tick = |ms: f64| net.tick((ms * 1e6) as u64);
    // A short round trip first, so that the timeout is the 5 ms floor.
    bare_send(&mut a, 100);
    tick(0.1);
    b.recv_frame(&mut |_| {}).expect("recv");
    tick(0.06);
    b.check_peer().expect("delayed acknowledgement");
    tick(0.03);
    a.recv_frame(&mut |_| {}).expect("recv");
    assert!(a.rstats().srtt_ns > 0);
    // Two frames go at t0; the first is acknowledged 3 ms later.
    bare_send(&mut a, 60_000);
    bare_send(&mut a, 60_000);
    tick(3.0);
    let mut frames = 0;
    b.recv_frame(&mut |_| frames += 1).expect("recv");
    assert_eq!(frames, 1);
    b.doorbell().expect("doorbell");
    tick(0.05);
    a.recv_frame(&mut |_| {}).expect("recv");
    assert!(a.unacked() > 0 && a.unacked() < 60, "first frame acknowledged: {}", a.unacked());
    // t0 + 6 ms: the second frame's packets went out more than a timeout ago, but
    // the acknowledgement 3 ms in restarted the timer.
    tick(2.95);
    a.check_peer().expect("timers");
    assert_eq!(a.rstats().timeout_retransmits, 0, "{:?}", a.rstats());
    // A timeout after that acknowledgement, they are resent.
    tick(2.1);
    a.check_peer().expect("timers");
    assert!(a.rstats().timeout_retransmits > 0, "{:?}", a.rstats());
}

/// Polls both bare devices `passes` times, `step_ns` apart, handing frames that
/// arrive to nobody: acknowledgements and their delayed timers run.
fn settle(net: &Net, a: &mut Dev, b: &mut Dev, passes: usize, step_ns: u64) {
    for _ in 0..passes {
        for d in [&mut *a, &mut *b] {
            while d.recv_frame(&mut |_| {}).expect("recv") {}
            d.doorbell().expect("doorbell");
        }
        net.tick(step_ns);
    }
}

/// A frame sent with nothing unacknowledged before it starts a new flight, and the
/// link is pushed (rung past its moderation: someone waits for it); frames that
/// follow while earlier ones are unacknowledged are a stream, flushed as usual; an
/// acknowledgement alone is never pushed.
#[test]
fn a_new_flight_is_pushed_a_stream_and_acknowledgements_are_not() {
    let (net, mut a, mut b) = bare_pair(|n| ReliableConfig { congestion: Congestion::Off, ..rel_cfg(n) });
    settle(&net, &mut a, &mut b, 20, 10_000);
    let (a0, b0) = (a.link().stats().pushes, b.link().stats().pushes);
    // Three frames of 15 packets back to back: one flight.
    for _ in 0..3 {
        bare_send(&mut a, 20_000);
    }
    assert_eq!(a.link().stats().pushes, a0 + 1, "the stream's frames after the first were pushed");
    // The receiver acknowledges (every 8 packets, the rest after the delay) but
    // pushes nothing.
    let acks = b.rstats().acks_sent;
    settle(&net, &mut a, &mut b, 20, 10_000);
    assert!(b.rstats().acks_sent > acks, "no acknowledgement sent");
    assert_eq!(b.link().stats().pushes, b0, "an acknowledgement was pushed");
    assert_eq!(a.unacked(), 0, "the flight was not acknowledged");
    // Everything acknowledged: the next frame is a new flight again, and so is
    // the answer.
    bare_send(&mut a, 20_000);
    assert_eq!(a.link().stats().pushes, a0 + 2);
    bare_send(&mut b, 20_000);
    assert_eq!(b.link().stats().pushes, b0 + 1);
}
