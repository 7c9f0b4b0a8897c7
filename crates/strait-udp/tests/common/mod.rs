//! Helpers shared by the udp device tests: a connected pair of udp devices across a
//! veth pair, and a two-sided exchange of native API messages verified byte for
//! byte.

#![allow(dead_code)]

use std::net::UdpSocket;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use strait_core::{
    Config, EndpointStats, MemoryRegion, OpKind, ReliableConfig, ReliableStats, Status, Worker,
};
use strait_udp::netns::VethPair;
use strait_udp::{Backend, UdpConfig, UdpDevice, UdpLink, UdpStats};

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

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

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

/// Side `me` (0 or 1) of an exchange: posts a receive for each of the peer's
/// messages, sends `sizes` (tag = index), waits for all, checks every byte; then
/// keeps the connection going until the peer is done too (`done`), closes and
/// lingers. Panics on any error or after `limit`.
pub fn side(me: u64, dev: UdpDevice, sizes: &[usize], done: &AtomicUsize, limit: Duration) -> SideReport {
    let start = Instant::now();
    let deadline = start + limit;
    let mut w: Worker<UdpDevice> = Worker::new(Config::default()).unwrap();
    let ep = w.attach(dev);
    let peer = 1 - me;
    let mut inbox: Vec<MemoryRegion> = sizes.iter().map(|&n| MemoryRegion::new(n.max(1)).unwrap()).collect();
    for (i, mr) in inbox.iter_mut().enumerate() {
        let n = sizes[i];
        w.post_recv(ep, mr, 0..n, i as u64, u64::MAX, i as u64).unwrap();
    }
    let outbox: Vec<MemoryRegion> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut mr = MemoryRegion::new(n.max(1)).unwrap();
            mr.write_at(0, &pattern(me * 1000 + i as u64, n)).unwrap();
            mr
        })
        .collect();
    for (i, mr) in outbox.iter().enumerate() {
        w.post_send(ep, mr, 0..sizes[i], i as u64, 1 << 32 | i as u64).unwrap();
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
        assert_eq!(c.status, Status::Ok, "side {me}: {c:?} ({:?})", w.endpoint_error(ep));
        match c.op {
            OpKind::Send => sends += 1,
            OpKind::Recv => {
                let i = c.ctx as usize;
                assert_eq!(c.len, sizes[i], "side {me}: message {i} length");
                let got = &inbox[i].bytes().unwrap()[..c.len];
                assert!(
                    got == &pattern(peer * 1000 + i as u64, sizes[i])[..],
                    "side {me}: message {i} corrupted"
                );
                recvs += 1;
            }
        }
    }
    let elapsed = start.elapsed();
    done.fetch_add(1, Ordering::SeqCst);
    while done.load(Ordering::SeqCst) < 2 {
        assert!(Instant::now() < deadline, "side {me}: peer never finished");
        w.progress();
        std::hint::spin_loop();
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
        let ta = s.spawn(|| side(0, a, sizes, &done, limit));
        let tb = s.spawn(|| side(1, b, sizes, &done, limit));
        [ta.join().expect("side 0 failed"), tb.join().expect("side 1 failed")]
    })
}

/// Resident set size of this process, bytes.
pub fn rss() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    s.split_whitespace().nth(1).and_then(|v| v.parse::<usize>().ok()).unwrap_or(0) * 4096
}
