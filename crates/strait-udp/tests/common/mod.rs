//! Helpers shared by the udp device tests: a connected pair of udp devices across a
//! veth pair, and a two-sided exchange of native API messages verified byte for
//! byte.

#![allow(dead_code)]

use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use strait_core::{
    Config, EndpointStats, EpId, MemoryRegion, OpKind, ReliableConfig, ReliableStats, Status, Worker,
};
use strait_sys::pattern;
use strait_udp::netns::VethPair;
use strait_udp::{Backend, UdpConfig, UdpDevice, UdpLink, UdpStats};
use strait_wire::packet::{self, PacketHeader, PacketKind, FLAG_FIRST, FLAG_LAST, PACKET_HEADER_LEN};

/// Every size class: empty, small eager, one packet, two packets (fragmented
/// eager), the eager limit and one past it (rendezvous), frame multiples, MiBs.
pub const SIZES: &[usize] = &[
    0,
    1,
    8,
    40,
    64,
    1000,
    1376,
    1377,
    1424,
    1425,
    4096,
    8192,
    32_768,
    32_769,
    65_536,
    65_537,
    300_000,
    1 << 20,
    4 << 20,
];

pub fn cfg(backend: Backend) -> UdpConfig {
    UdpConfig { backend, ..UdpConfig::default() }
}

pub fn rel_cfg() -> ReliableConfig {
    ReliableConfig::default()
}

/// Resolves neighbours both ways (datagrams sent meanwhile could be dropped, which
/// the reliability layer would repair, only slower).
pub fn warm(a: &UdpSocket, b: &UdpSocket) {
    for (x, y) in [(a, b), (b, a)] {
        y.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let mut buf = [0u8; 16];
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            assert!(Instant::now() < deadline, "no datagram crosses the veth pair");
            x.send(b"warm").unwrap();
            if y.recv(&mut buf).is_ok() {
                // Leave no stray "warm" datagram for the device to count as hostile.
                std::thread::sleep(Duration::from_millis(20));
                y.set_nonblocking(true).unwrap();
                while y.recv(&mut buf).is_ok() {}
                y.set_nonblocking(false).unwrap();
                break;
            }
        }
        y.set_read_timeout(None).unwrap();
    }
}

/// Two udp devices, one in each namespace, connected to each other. Also returns
/// a clone of side 0's socket (the same address and port: a forger's tool).
pub fn device_pair(pair: &VethPair, v6: bool, backend: Backend) -> (UdpDevice, UdpDevice, UdpSocket) {
    let (sa, sb) = pair.udp_pair(v6).unwrap();
    warm(&sa, &sb);
    let forger = sa.try_clone().unwrap();
    let c = cfg(backend);
    let a = UdpLink::from_socket(sa, &c).unwrap();
    let b = UdpLink::from_socket(sb, &c).unwrap();
    assert_eq!(a.backend(), backend);
    (a.reliable(rel_cfg()), b.reliable(rel_cfg()), forger)
}

/// What one side saw.
#[derive(Debug, Clone, Copy)]
pub struct SideReport {
    pub ep: EndpointStats,
    pub rel: ReliableStats,
    pub udp: UdpStats,
    pub elapsed: Duration,
}

/// One round of an exchange on side `me`: posts a receive for each of the peer's
/// messages, sends `sizes` (tags from `base`), waits for all, checks every byte.
fn round(w: &mut Worker<UdpDevice>, ep: EpId, me: u64, sizes: &[usize], base: u64, deadline: Instant) {
    let peer = 1 - me;
    let mut inbox: Vec<MemoryRegion> = sizes.iter().map(|&n| MemoryRegion::new(n.max(1)).unwrap()).collect();
    for (i, mr) in inbox.iter_mut().enumerate() {
        let n = sizes[i];
        w.post_recv(ep, mr, 0..n, base + i as u64, u64::MAX, i as u64).unwrap();
    }
    let outbox: Vec<MemoryRegion> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut mr = MemoryRegion::new(n.max(1)).unwrap();
            mr.write_at(0, &pattern(me * 1000 + base + i as u64, n)).unwrap();
            mr
        })
        .collect();
    for (i, mr) in outbox.iter().enumerate() {
        w.post_send(ep, mr, 0..sizes[i], base + i as u64, 1 << 32 | i as u64).unwrap();
    }
    let (mut sends, mut recvs) = (0, 0);
    while sends < sizes.len() || recvs < sizes.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let dev = w.device(ep).unwrap();
            panic!(
                "side {me}: timed out with {sends} sends and {recvs} receives done; {:?} {:?} unacked {} slots {} {:?} {:?}",
                w.stats(ep),
                dev.rstats(),
                dev.unacked(),
                dev.link().slots_in_use(),
                dev.link().udp_stats(),
                w.endpoint_error(ep)
            );
        }
        let c = match w.wait(Some(left.min(Duration::from_millis(200)))) {
            Ok(c) => c,
            Err(strait_core::WaitError::Timeout) => continue,
            Err(e) => panic!("side {me}: wait failed: {e}"),
        };
        if c.status != Status::Ok {
            let dev = w.device(ep).unwrap();
            panic!("side {me}: {c:?} ({:?}: {:?}) {:?}", w.endpoint_error(ep), dev.failure(), dev.rstats());
        }
        match c.op {
            OpKind::Send => sends += 1,
            OpKind::Recv => {
                let i = c.ctx as usize;
                assert_eq!(c.len, sizes[i], "side {me}: message {i} length");
                let got = &inbox[i].bytes().unwrap()[..c.len];
                let want = pattern(peer * 1000 + base + i as u64, sizes[i]);
                assert!(got == &want[..], "side {me}: message {i} corrupted");
                recvs += 1;
            }
        }
    }
}

/// Side `me` (0 or 1) of an exchange: one round of `sizes` each way; if `gate` is
/// given, waits (driving the connection) until it opens, then a second round. Then
/// checks that nothing else arrives, keeps the connection going until the peer is
/// done too (`done`), closes and lingers. Panics on any error or after `limit`.
pub fn side(
    me: u64,
    dev: UdpDevice,
    sizes: &[usize],
    done: &AtomicUsize,
    limit: Duration,
    gate: Option<&AtomicBool>,
) -> SideReport {
    let start = Instant::now();
    let deadline = start + limit;
    let mut w: Worker<UdpDevice> = Worker::new(Config::default()).unwrap();
    let ep = w.attach(dev);
    round(&mut w, ep, me, sizes, 0, deadline);
    if let Some(g) = gate {
        while !g.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "side {me}: gate never opened");
            w.progress();
            std::thread::sleep(Duration::from_micros(50));
        }
        round(&mut w, ep, me, sizes, 1 << 20, deadline);
    }
    let elapsed = start.elapsed();
    // Nothing but what the peer sent is ever delivered.
    let mut extra = MemoryRegion::new(1 << 16).unwrap();
    w.post_recv(ep, &mut extra, 0..1 << 16, 0, 0, 77).unwrap();
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(100) {
        if let Some(c) = w.poll() {
            let dev = w.device(ep).unwrap();
            panic!("side {me}: unexpected delivery {c:?} ({:?}) {:?}", dev.failure(), dev.rstats());
        }
    }
    done.fetch_add(1, Ordering::SeqCst);
    while done.load(Ordering::SeqCst) < 2 {
        assert!(Instant::now() < deadline, "side {me}: peer never finished");
        if let Some(c) = w.poll() {
            if c.ctx == 77 && c.status == Status::PeerGone {
                // The peer saw both sides done and closed first: our spare receive
                // ends with it.
                break;
            }
            let dev = w.device(ep).unwrap();
            panic!("side {me}: unexpected delivery {c:?} ({:?}) {:?}", dev.failure(), dev.rstats());
        }
    }
    let ep_stats = w.stats(ep).unwrap();
    let dev = w.device(ep).unwrap();
    let rel = dev.rstats();
    let udp = dev.link().udp_stats();
    w.close(ep);
    w.linger(Duration::from_secs(2));
    SideReport { ep: ep_stats, rel, udp, elapsed }
}

/// Runs both sides on their own threads.
pub fn exchange(a: UdpDevice, b: UdpDevice, sizes: &[usize], limit: Duration) -> [SideReport; 2] {
    let done = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let ta = s.spawn(|| side(0, a, sizes, &done, limit, None));
        let tb = s.spawn(|| side(1, b, sizes, &done, limit, None));
        [ta.join().expect("side 0 failed"), tb.join().expect("side 1 failed")]
    })
}

/// Resident set size of this process, bytes.
pub fn rss() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    s.split_whitespace().nth(1).and_then(|v| v.parse::<usize>().ok()).unwrap_or(0) * 4096
}

/// A small seeded generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Steals one genuine packet travelling from side 1 to side 0 through a clone of
/// side 0's socket (a lost packet for the connection, which it repairs); returns
/// its header: `src_id` is side 1's connection id, `dst_id` side 0's.
pub fn steal_header(forger: &UdpSocket, deadline: Instant) -> PacketHeader {
    forger.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
    let mut buf = vec![0u8; 65536];
    loop {
        assert!(Instant::now() < deadline, "no genuine packet to learn the connection ids from");
        if let Ok(n) = forger.recv(&mut buf) {
            // Side 0's link turns UDP_GRO on for the socket (the forger's too): one
            // read may return a train of datagrams. The first is the stolen packet;
            // the rest were sent after it, so forgeries acknowledging up to it
            // acknowledge nothing that was not delivered (discarding the train
            // would lose packets before the one whose header is used).
            let opened = match packet::open_with(&buf[..n], true) {
                Err(packet::PacketError::Length { claimed, actual }) if claimed < actual => {
                    packet::open_with(&buf[..PACKET_HEADER_LEN + claimed], true)
                }
                r => r,
            };
            if let Ok(h) = opened {
                if h.dst_id != 0 && h.src_id != 0 {
                    return h;
                }
            }
        }
    }
}

/// Hostile datagram classes sent to side 1 (as if from side 0).
pub const CLASSES: &[&str] = &[
    "random bytes",
    "truncated header",
    "wrong version",
    "forged sequence",
    "oversized length",
    "bad crc",
    "wrong ids",
];

/// A hostile datagram of class `class` (see [`CLASSES`]); `h` is a genuine header
/// from side 1 to side 0, so forgeries use the real connection ids.
pub fn hostile(rng: &mut Rng, class: usize, h: &PacketHeader) -> Vec<u8> {
    // What side 0 would send to side 1.
    let mut f = PacketHeader { dst_id: h.src_id, src_id: h.dst_id, seq: h.ack, ack: h.seq, sack: 0, ..*h };
    f.kind = PacketKind::Data;
    f.flags = FLAG_FIRST | FLAG_LAST;
    let payload = rng.below(1200) as usize;
    let sealed = |f: &PacketHeader, rng: &mut Rng, payload: usize| {
        let mut p = vec![0u8; PACKET_HEADER_LEN + payload];
        let mut f = *f;
        f.len = payload as u16;
        f.encode(&mut p);
        p[PACKET_HEADER_LEN..].copy_from_slice(&rng.bytes(payload));
        packet::seal(&mut p);
        p
    };
    match class {
        0 => {
            let n = rng.below(1473) as usize;
            rng.bytes(n)
        }
        1 => {
            let mut p = sealed(&f, rng, 0);
            p.truncate(rng.below(PACKET_HEADER_LEN as u64) as usize);
            p
        }
        2 => {
            let mut p = sealed(&f, rng, payload);
            p[0] = 2 + rng.below(254) as u8;
            packet::seal(&mut p);
            p
        }
        3 => {
            // Far outside the window, ahead or behind, or acknowledging packets
            // never sent.
            match rng.below(3) {
                0 => f.seq = f.seq.wrapping_add(100_000 + rng.below(1 << 30) as u32),
                1 => f.seq = f.seq.wrapping_sub(100_000 + rng.below(1 << 30) as u32),
                _ => f.ack = f.ack.wrapping_add(100_000 + rng.below(1 << 30) as u32),
            }
            sealed(&f, rng, payload)
        }
        4 => {
            let mut p = sealed(&f, rng, payload);
            let claim = payload as u16 + 1 + rng.below(65535 - payload as u64 - 1) as u16;
            p[28..30].copy_from_slice(&claim.to_le_bytes());
            packet::seal(&mut p);
            p
        }
        5 => {
            let mut p = sealed(&f, rng, payload);
            let i = rng.below(p.len() as u64) as usize;
            p[i] ^= 1 << rng.below(8);
            p
        }
        _ => {
            f.dst_id = rng.next() as u32 | 1;
            f.src_id = rng.next() as u32 | 1;
            f.kind =
                [PacketKind::Data, PacketKind::Ack, PacketKind::Ping, PacketKind::Fin][rng.below(4) as usize];
            sealed(&f, rng, payload)
        }
    }
}

/// Sum of the reliability layer's drop counters.
pub fn dropped(r: &ReliableStats) -> u64 {
    r.bad_checksum + r.bad_header + r.wrong_conn + r.out_of_window + r.duplicates
}

/// One `#[test]` per backend, `$uring` and `$mmsg`, each running `$run(backend,
/// $args...)`: the tests that differ only in the backend are written once.
// Not every test binary has per-backend tests.
#[allow(unused_macros)]
macro_rules! test_per_backend {
    ($uring:ident, $mmsg:ident: $run:path $(, $arg:expr)*) => {
        #[test]
        fn $uring() {
            $run(strait_udp::Backend::Uring $(, $arg)*);
        }

        #[test]
        fn $mmsg() {
            $run(strait_udp::Backend::Mmsg $(, $arg)*);
        }
    };
}
#[allow(unused_imports)]
pub(crate) use test_per_backend;
