//! The reliability layer over an in-memory lossy link with a manual clock: every
//! message of every size class arrives exactly once, in order and intact through
//! loss, duplication, reordering and corruption; hostile datagrams are counted and
//! dropped; a silent peer fails outstanding operations; close drains.
//!
//! (The deterministic network simulator in strait-sim tests the same layer at scale.)

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::rc::Rc;

use strait_core::congestion::Congestion;
use strait_core::reliable::{PacketAuth, PacketKey, Reliable, ReliableConfig};
use strait_core::{Config, EpId, Link, LinkError, LinkStats, MemoryRegion, OpKind, SlotPool, Status, Worker};

const MTU: usize = 1500;

/// What happens to the n-th datagram on a wire.
type Fate = Box<dyn FnMut(u64, &mut Vec<u8>) -> usize>;

struct Wire {
    queue: VecDeque<(u64, Vec<u8>)>,
    /// Returns how many copies to deliver (0 = lost) and may change the bytes.
    fate: Fate,
    count: u64,
    latency: u64,
    cut: bool,
}

struct TestLink {
    pool: SlotPool,
    pending: Vec<(u32, usize)>,
    out: Rc<RefCell<Wire>>,
    inn: Rc<RefCell<Wire>>,
    clock: Rc<Cell<u64>>,
    stats: LinkStats,
    /// Claims a carrier that checks payloads (as UDP's checksum does).
    checked: bool,
}

impl Link for TestLink {
    fn mtu(&self) -> usize {
        MTU
    }
    fn tx_alloc(&mut self) -> Option<u32> {
        self.pool.alloc()
    }
    fn tx_buf(&mut self, slot: u32) -> &mut [u8] {
        self.pool.buf(slot)
    }
    fn send(&mut self, slot: u32, len: usize) -> Result<bool, LinkError> {
        if self.pending.len() >= 64 {
            self.stats.send_full += 1;
            return Ok(false);
        }
        self.pool.begin_tx(slot);
        self.pending.push((slot, len));
        Ok(true)
    }
    fn tx_release(&mut self, slot: u32) {
        self.pool.release(slot)
    }
    fn flush(&mut self) -> Result<(), LinkError> {
        self.stats.doorbells += 1;
        let now = self.clock.get();
        let mut w = self.out.borrow_mut();
        for (slot, len) in self.pending.drain(..) {
            let mut bytes = self.pool.bytes(slot, len).expect("slot").to_vec();
            self.pool.end_tx(slot);
            self.stats.datagrams_sent += 1;
            if w.cut {
                continue;
            }
            let n = w.count;
            w.count += 1;
            let copies = (w.fate)(n, &mut bytes);
            let at = now + w.latency;
            for _ in 0..copies {
                w.queue.push_back((at, bytes.clone()));
            }
        }
        Ok(())
    }
    fn recv(&mut self, handle: &mut dyn FnMut(&[u8])) -> Result<bool, LinkError> {
        let now = self.clock.get();
        let d = {
            let mut w = self.inn.borrow_mut();
            match w.queue.front() {
                Some((at, _)) if *at <= now => w.queue.pop_front().map(|(_, d)| d),
                _ => None,
            }
        };
        match d {
            Some(d) => {
                self.stats.datagrams_received += 1;
                handle(&d);
                Ok(true)
            }
            None => Ok(false),
        }
    }
    fn now_ns(&self) -> u64 {
        self.clock.get()
    }
    fn event_fd(&self) -> Option<RawFd> {
        None
    }
    fn stats(&self) -> LinkStats {
        self.stats
    }
    fn tx_slots(&self) -> Option<usize> {
        Some(self.pool.count() as usize)
    }
    fn carrier_checksum(&self) -> bool {
        self.checked
    }
}

fn keep() -> Fate {
    Box::new(|_, _| 1)
}

struct Net {
    clock: Rc<Cell<u64>>,
    ab: Rc<RefCell<Wire>>,
    ba: Rc<RefCell<Wire>>,
}

type W = Worker<Reliable<TestLink>>;

fn rel_cfg(nonce: u64) -> ReliableConfig {
    ReliableConfig {
        nonce: Some(nonce),
        rto_initial_ns: 2_000_000,
        rto_min_ns: 500_000,
        keepalive_ns: 50_000_000,
        liveness_ns: 400_000_000,
        ..ReliableConfig::default()
    }
}

/// Two reliable devices over test wires of these fates (`cfg` from each nonce).
fn devices(
    fate_ab: Fate,
    fate_ba: Fate,
    cfg: impl Fn(u64) -> ReliableConfig,
) -> (Net, Reliable<TestLink>, Reliable<TestLink>) {
    devices_over(fate_ab, fate_ba, cfg, [false, false])
}

/// [`devices`] whose links claim (or not) carriers that check payloads.
fn devices_over(
    fate_ab: Fate,
    fate_ba: Fate,
    cfg: impl Fn(u64) -> ReliableConfig,
    checked: [bool; 2],
) -> (Net, Reliable<TestLink>, Reliable<TestLink>) {
    let clock = Rc::new(Cell::new(1_000_000));
    let wire = |fate| {
        Rc::new(RefCell::new(Wire { queue: VecDeque::new(), fate, count: 0, latency: 20_000, cut: false }))
    };
    let (ab, ba) = (wire(fate_ab), wire(fate_ba));
    let link = |out: &Rc<RefCell<Wire>>, inn: &Rc<RefCell<Wire>>, checked| TestLink {
        pool: SlotPool::new(512, MTU),
        pending: Vec::new(),
        out: out.clone(),
        inn: inn.clone(),
        clock: clock.clone(),
        stats: LinkStats::default(),
        checked,
    };
    let a = Reliable::new(link(&ab, &ba, checked[0]), cfg(0x1111_2222_3333_4444));
    let b = Reliable::new(link(&ba, &ab, checked[1]), cfg(0x5555_6666_7777_8888));
    (Net { clock, ab, ba }, a, b)
}

fn pair(fate_ab: Fate, fate_ba: Fate) -> (Net, W, EpId, W, EpId) {
    let (net, a, b) = devices(fate_ab, fate_ba, rel_cfg);
    let mut wa = Worker::new(Config::default()).expect("worker");
    let mut wb = Worker::new(Config::default()).expect("worker");
    let ea = wa.attach(a);
    let eb = wb.attach(b);
    (net, wa, ea, wb, eb)
}

/// Progresses both workers; when neither has work, advances the clock to the next
/// datagram or timer. Stops when `done` says so; panics after `limit_ns` of
/// virtual time.
#[track_caller]
fn run(net: &Net, wa: &mut W, wb: &mut W, limit_ns: u64, mut done: impl FnMut(&mut W, &mut W) -> bool) {
    let end = net.clock.get() + limit_ns;
    loop {
        if done(wa, wb) {
            return;
        }
        let work = wa.progress() + wb.progress();
        if work > 0 {
            continue;
        }
        let now = net.clock.get();
        let next_dgram =
            [&net.ab, &net.ba].iter().filter_map(|w| w.borrow().queue.front().map(|d| d.0)).min();
        let next_timer =
            [wa.next_timer_ns(), wb.next_timer_ns()].into_iter().flatten().min().map(|t| now + t);
        let next = [next_dgram, next_timer].into_iter().flatten().min().unwrap_or(now + 1_000_000);
        let next = next.max(now + 1_000);
        assert!(next <= end, "no progress within {} ms of virtual time", limit_ns / 1_000_000);
        net.clock.set(next);
    }
}

fn pattern(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Sends `sizes` from a to b (each posted after the previous completes on b) and
/// checks every byte.
fn stream(net: &Net, wa: &mut W, ea: EpId, wb: &mut W, eb: EpId, sizes: &[usize]) {
    let max = sizes.iter().copied().max().unwrap_or(1).max(1);
    let mut inbox = MemoryRegion::new(max).expect("region");
    for (i, &len) in sizes.iter().enumerate() {
        let data = pattern(i as u64, len);
        let mut outbox = MemoryRegion::new(len.max(1)).expect("region");
        outbox.write_at(0, &data).expect("write");
        wb.post_recv(eb, &mut inbox, 0..max, i as u64, u64::MAX, i as u64).expect("post recv");
        wa.post_send(ea, &outbox, 0..len, i as u64, i as u64).expect("post send");
        let (mut sent, mut got) = (false, None);
        run(net, wa, wb, 5_000_000_000, |wa, wb| {
            while let Some(c) = wa.poll() {
                assert_eq!((c.op, c.status), (OpKind::Send, Status::Ok), "send {i}");
                sent = true;
            }
            if let Some(c) = wb.poll() {
                got = Some(c);
            }
            sent && got.is_some()
        });
        let c = got.expect("recv");
        assert_eq!((c.op, c.status, c.len, c.tag), (OpKind::Recv, Status::Ok, len, i as u64), "message {i}");
        let mut back = vec![0u8; len];
        inbox.read_at(0, &mut back).expect("read");
        assert!(back == data, "message {i} ({len} bytes) corrupted");
    }
}

const SIZES: &[usize] = &[0, 1, 8, 1400, 1452, 1453, 4000, 32 * 1024, 40_000, 200_000, 1 << 20];

#[test]
fn every_size_arrives_over_a_clean_link() {
    let (net, mut wa, ea, mut wb, eb) = pair(keep(), keep());
    stream(&net, &mut wa, ea, &mut wb, eb, SIZES);
    let s = wa.device(ea).expect("dev").rstats();
    assert_eq!(s.timeout_retransmits + s.fast_retransmits, 0, "{s:?}");
}

#[test]
fn loss_duplication_and_reordering_are_repaired() {
    // a->b: every 7th datagram lost, every 11th doubled; b->a: every 5th lost.
    let ab: Fate = Box::new(|n, _| {
        if n % 7 == 3 {
            0
        } else if n % 11 == 5 {
            2
        } else {
            1
        }
    });
    let ba: Fate = Box::new(|n, _| if n % 5 == 2 { 0 } else { 1 });
    let (net, mut wa, ea, mut wb, eb) = pair(ab, ba);
    stream(&net, &mut wa, ea, &mut wb, eb, SIZES);
    let sa = wa.device(ea).expect("dev").rstats();
    let sb = wb.device(eb).expect("dev").rstats();
    assert!(sa.fast_retransmits + sa.timeout_retransmits > 0, "{sa:?}");
    assert!(sb.duplicates > 0 && sb.out_of_order > 0, "{sb:?}");
}

#[test]
fn corrupted_datagrams_are_caught_and_never_delivered() {
    let ab: Fate = Box::new(|n, d| {
        if n % 6 == 4 {
            let i = (n as usize * 31) % d.len();
            d[i] ^= 0x20;
        }
        1
    });
    let (net, mut wa, ea, mut wb, eb) = pair(ab, keep());
    stream(&net, &mut wa, ea, &mut wb, eb, SIZES);
    let sb = wb.device(eb).expect("dev").rstats();
    assert!(sb.bad_checksum > 0, "{sb:?}");
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
        let count = |flagged: &Rc<Cell<(u64, u64)>>| -> Fate {
            let f = flagged.clone();
            Box::new(move |n, d| {
                let (h, all) = f.get();
                f.set((h + u64::from(d[2] & FLAG_HEADER_CRC != 0), all + 1));
                // Every 9th datagram b-bound gets a header bit flipped.
                if n % 9 == 4 {
                    d[13] ^= 0x04;
                }
                1
            })
        };
        let cfg = |nonce| ReliableConfig { payload_crc, ..rel_cfg(nonce) };
        let (net, a, b) = devices_over(count(&flagged), keep(), cfg, [true, true]);
        let mut wa = Worker::new(Config::default()).expect("worker");
        let mut wb = Worker::new(Config::default()).expect("worker");
        let (ea, eb) = (wa.attach(a), wb.attach(b));
        stream(&net, &mut wa, ea, &mut wb, eb, SIZES);
        let (header_only, all) = flagged.get();
        assert!(all > 700, "{all} datagrams");
        if payload_crc {
            assert_eq!(header_only, 0, "payload_crc set, yet {header_only} of {all} header-only");
        } else {
            assert_eq!(header_only, all, "a packet kept its payload CRC");
        }
        let sb = wb.device(eb).expect("dev").rstats();
        assert!(sb.bad_checksum > 0, "header corruption unnoticed: {sb:?}");
    }
    // A sender over a checking carrier, a receiver over one that does not check.
    let (net, mut a, mut b) = devices_over(keep(), keep(), rel_cfg, [true, false]);
    {
        use strait_core::Device;
        for _ in 0..200 {
            for d in [&mut a, &mut b] {
                let _ = d.recv_frame(&mut |_| {});
                let _ = d.check_peer();
            }
            net.clock.set(net.clock.get() + 100_000);
        }
    }
    let sb = b.rstats();
    assert!(!b.is_established() && sb.bad_checksum > 0, "{sb:?}");
}

#[test]
fn hostile_datagrams_are_counted_and_dropped() {
    let (net, mut wa, ea, mut wb, eb) = pair(keep(), keep());
    stream(&net, &mut wa, ea, &mut wb, eb, &[8]);
    // A valid packet from a to copy ids from.
    let template = {
        let mut outbox = MemoryRegion::new(8).expect("region");
        outbox.write_at(0, b"template").expect("write");
        wa.post_send(ea, &outbox, 0..8, 99, 0).expect("send");
        let w = net.ab.borrow();
        w.queue.back().expect("packet").1.clone()
    };
    net.ab.borrow_mut().queue.clear();
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
    {
        let mut w = net.ab.borrow_mut();
        let now = net.clock.get();
        for h in hostile {
            w.queue.push_back((now, h));
        }
    }
    let mut inbox = MemoryRegion::new(64).expect("region");
    wb.post_recv(eb, &mut inbox, 0..64, 5, u64::MAX, 0).expect("recv");
    run(&net, &mut wa, &mut wb, 100_000_000, |_, wb| {
        let s = wb.device(eb).expect("dev").rstats();
        s.bad_checksum + s.bad_header + s.wrong_conn + s.out_of_window >= n
    });
    assert!(wb.poll().is_none(), "a hostile datagram was delivered");
    // The connection still works.
    let mut outbox = MemoryRegion::new(8).expect("region");
    outbox.write_at(0, b"after!!!").expect("write");
    wa.post_send(ea, &outbox, 0..8, 5, 0).expect("send");
    let mut got = None;
    run(&net, &mut wa, &mut wb, 1_000_000_000, |wa, wb| {
        while wa.poll().is_some() {}
        if let Some(c) = wb.poll() {
            got = Some(c);
        }
        got.is_some()
    });
    assert_eq!(got.expect("recv").status, Status::Ok);
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
    let f = forged.clone();
    let tamper: Fate = Box::new(move |n, d| {
        if n % 9 == 3 && d.len() > PACKET_HEADER_LEN + TAG_LEN {
            d[PACKET_HEADER_LEN] ^= 0x5a;
            let body = d.len() - TAG_LEN;
            seal_with(&mut d[..body], CrcCoverage::Header);
            f.set(f.get() + 1);
        }
        1
    });
    let cfg =
        |nonce| ReliableConfig { auth: Some(auth(nonce == 0x1111_2222_3333_4444, b"s")), ..rel_cfg(nonce) };
    let (net, a, b) = devices(tamper, keep(), cfg);
    let mut wa = Worker::new(Config::default()).expect("worker");
    let mut wb = Worker::new(Config::default()).expect("worker");
    let (ea, eb) = (wa.attach(a), wb.attach(b));
    stream(&net, &mut wa, ea, &mut wb, eb, SIZES);
    // An unauthenticated packet with a valid CRC, addressed to b.
    let template = net.ab.borrow().queue.back().map(|d| d.1.clone());
    let sb = wb.device(eb).expect("dev").rstats();
    assert!(forged.get() > 50, "{} forged", forged.get());
    assert_eq!(sb.bad_mac, forged.get(), "{sb:?}");
    assert_eq!(sb.bad_checksum, 0, "the forger fixed every CRC: {sb:?}");
    if let Some(mut v) = template {
        v.truncate(v.len() - TAG_LEN);
        v[2] &= !strait_wire::packet::FLAG_MAC;
        let plen = (v.len() - PACKET_HEADER_LEN) as u16;
        v[28..30].copy_from_slice(&plen.to_le_bytes());
        strait_wire::packet::seal(&mut v);
        let now = net.clock.get();
        net.ab.borrow_mut().queue.push_back((now, v));
        run(&net, &mut wa, &mut wb, 100_000_000, |_, wb| {
            wb.device(eb).expect("dev").rstats().bad_mac > forged.get()
        });
        assert!(wb.poll().is_none(), "an unauthenticated packet was delivered");
    }
}

/// Different keys at the two ends: nothing passes, the connection never comes up.
#[test]
fn different_keys_never_establish() {
    let cfg = |nonce| {
        let secret: &[u8] = if nonce == 0x1111_2222_3333_4444 { b"one" } else { b"two" };
        ReliableConfig { auth: Some(auth(nonce == 0x1111_2222_3333_4444, secret)), ..rel_cfg(nonce) }
    };
    let (net, mut a, mut b) = devices(keep(), keep(), cfg);
    {
        use strait_core::Device;
        for _ in 0..200 {
            for d in [&mut a, &mut b] {
                let _ = d.recv_frame(&mut |_| {});
                let _ = d.check_peer();
            }
            net.clock.set(net.clock.get() + 100_000);
        }
    }
    let (sa, sb) = (a.rstats(), b.rstats());
    assert!(!a.is_established() && !b.is_established(), "{sa:?} {sb:?}");
    assert!(sa.bad_mac > 0 && sb.bad_mac > 0, "{sa:?} {sb:?}");
}

#[test]
fn a_silent_peer_fails_outstanding_operations() {
    let (net, mut wa, ea, mut wb, eb) = pair(keep(), keep());
    stream(&net, &mut wa, ea, &mut wb, eb, &[100]);
    net.ab.borrow_mut().cut = true;
    net.ba.borrow_mut().cut = true;
    let outbox = MemoryRegion::new(100_000).expect("region");
    wa.post_send(ea, &outbox, 0..100_000, 1, 7).expect("send");
    let mut inbox = MemoryRegion::new(64).expect("region");
    wb.post_recv(eb, &mut inbox, 0..64, 0, 0, 8).expect("recv");
    let start = net.clock.get();
    let (mut a_done, mut b_done) = (None, None);
    run(&net, &mut wa, &mut wb, 2_000_000_000, |wa, wb| {
        if let Some(c) = wa.poll() {
            a_done = Some((c, net.clock.get()));
        }
        if let Some(c) = wb.poll() {
            b_done = Some((c, net.clock.get()));
        }
        a_done.is_some() && b_done.is_some()
    });
    for (c, at) in [a_done, b_done].into_iter().flatten() {
        assert_eq!(c.status, Status::PeerGone);
        let waited = at - start;
        assert!((399_000_000..1_000_000_000).contains(&waited), "failed after {waited} ns");
    }
}

#[test]
fn close_delivers_everything_then_drains() {
    let ab: Fate = Box::new(|n, _| if n % 4 == 1 { 0 } else { 1 });
    let (net, mut wa, ea, mut wb, eb) = pair(ab, keep());
    let data = pattern(3, 300_000);
    let mut outbox = MemoryRegion::new(data.len()).expect("region");
    outbox.write_at(0, &data).expect("write");
    let mut inbox = MemoryRegion::new(data.len()).expect("region");
    wb.post_recv(eb, &mut inbox, 0..data.len(), 0, 0, 0).expect("recv");
    wa.post_send(ea, &outbox, 0..data.len(), 1, 0).expect("send");
    run(&net, &mut wa, &mut wb, 5_000_000_000, |wa, _| wa.poll().is_some());
    let small = MemoryRegion::new(16).expect("region");
    let mut inbox2 = MemoryRegion::new(16).expect("region");
    wb.post_recv(eb, &mut inbox2, 0..16, 0, 0, 0).expect("recv");
    wa.post_send(ea, &small, 0..16, 2, 0).expect("send");
    // Close once the device took the message: close cancels what it has not (the
    // congestion window may still hold it back behind the large transfer).
    run(
        &net,
        &mut wa,
        &mut wb,
        5_000_000_000,
        |wa, _| matches!(wa.poll(), Some(c) if c.op == OpKind::Send && c.status == Status::Ok),
    );
    wa.close(ea);
    let mut got = Vec::new();
    run(&net, &mut wa, &mut wb, 5_000_000_000, |_, wb| {
        while let Some(c) = wb.poll() {
            got.push(c);
        }
        got.len() >= 2
    });
    run(&net, &mut wa, &mut wb, 5_000_000_000, |wa, _| wa.closing() == 0);
    assert!(got.iter().all(|c| c.status == Status::Ok), "{got:?}");
    let mut back = vec![0u8; data.len()];
    inbox.read_at(0, &mut back).expect("read");
    assert!(back == data);
}

/// Two bare devices (no engine) over the test wires, past the handshake.
fn bare_pair(cfg: impl Fn(u64) -> ReliableConfig) -> (Net, Reliable<TestLink>, Reliable<TestLink>) {
    use strait_core::Device;
    let (net, mut a, mut b) = devices(keep(), keep(), cfg);
    for _ in 0..1000 {
        if a.is_established() && b.is_established() {
            break;
        }
        for d in [&mut a, &mut b] {
            let _ = d.recv_frame(&mut |_| {});
            let _ = d.check_peer();
        }
        net.clock.set(net.clock.get() + 10_000);
    }
    assert!(a.is_established() && b.is_established());
    (net, a, b)
}

/// Sends one frame of `len` bytes from `d` and pushes everything queued to the wire.
fn bare_send(d: &mut Reliable<TestLink>, len: usize) {
    use strait_core::Device;
    assert!(d.send_frame(len, &mut |w| w.write(0, &vec![7u8; len])).expect("send"));
    for _ in 0..8 {
        d.doorbell().expect("doorbell");
    }
}

#[test]
fn an_acknowledgement_leaves_while_a_stream_still_arrives() {
    use strait_core::Device;
    // The acknowledgement mechanism with a full window: no congestion window (whose
    // slow start would hold the frames back).
    let (net, mut a, mut b) = bare_pair(|n| ReliableConfig { congestion: Congestion::Off, ..rel_cfg(n) });
    // Nine frames of 42 packets, within the default window of 512.
    for _ in 0..9 {
        bare_send(&mut a, 60_000);
    }
    net.ba.borrow_mut().queue.clear();
    net.clock.set(net.clock.get() + 30_000);
    let mut frames = 0;
    assert!(b.recv_frame(&mut |_| frames += 1).expect("recv"));
    // One frame's acknowledgement waits for more (one doorbell for several) ...
    assert!(net.ba.borrow().queue.is_empty(), "acknowledged at once");
    // Six more: 7 x 42 = 294 packets, past half the window (256).
    for _ in 0..6 {
        assert!(b.recv_frame(&mut |_| frames += 1).expect("recv"));
    }
    assert_eq!(frames, 7);
    assert!(!net.ab.borrow().queue.is_empty(), "the rest of the stream is still waiting");
    // ... but not until the receiver has handled everything that arrived: once
    // the acknowledgements held back cover half the window, they leave.
    assert!(!net.ba.borrow().queue.is_empty(), "no acknowledgement sent yet");
}

#[test]
fn the_retransmission_timer_restarts_when_acknowledgements_progress() {
    use strait_core::Device;
    // Two frames at once, past the initial congestion window: the timer alone here.
    let cfg = |nonce| ReliableConfig {
        rto_min_ns: 5_000_000,
        rto_initial_ns: 5_000_000,
        congestion: Congestion::Off,
        ..rel_cfg(nonce)
    };
    let (net, mut a, mut b) = bare_pair(cfg);
    let tick = |ms: f64| net.clock.set(net.clock.get() + (ms * 1e6) as u64);
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
