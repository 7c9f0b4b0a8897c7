//! A bounded, seeded fuzz run (stable Rust, part of `cargo test`): mutated genuine
//! packets (bit flips, byte overwrites, truncation, extension, splices, header
//! fields randomized and re-sealed with a valid CRC) and random datagrams, sent to a
//! udp device from its peer's own address and port for `STRAIT_UDP_FUZZ_SECS`
//! (default 5) seconds with seed `STRAIT_UDP_FUZZ_SEED` (printed). No crash, every
//! datagram counted and dropped, the connection works before and after, nothing
//! extra delivered, no memory growth.
//!
//! A re-sealed mutation that still carries both real connection ids and passes every
//! check is indistinguishable from a genuine packet (the CRC is an integrity check,
//! not authentication), so such datagrams are not sent.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{device_pair, dropped, rss, side, steal_header, Rng, SIZES};
use strait_udp::netns::VethPair;
use strait_udp::Backend;
use strait_wire::packet::{self, PacketKind, PACKET_HEADER_LEN};

fn mutate(rng: &mut Rng, pool: &[Vec<u8>]) -> Vec<u8> {
    let mut p = pool[rng.below(pool.len() as u64) as usize].clone();
    for _ in 0..1 + rng.below(3) {
        match rng.below(7) {
            0 => {
                for _ in 0..1 + rng.below(8) {
                    let i = rng.below(p.len().max(1) as u64) as usize;
                    if let Some(b) = p.get_mut(i) {
                        *b ^= 1 << rng.below(8);
                    }
                }
            }
            1 => {
                let i = rng.below(p.len().max(1) as u64) as usize;
                if let Some(b) = p.get_mut(i) {
                    *b = rng.next() as u8;
                }
            }
            2 => p.truncate(rng.below(p.len() as u64 + 1) as usize),
            3 => {
                let n = rng.below(200) as usize;
                p.extend(rng.bytes(n));
            }
            4 => {
                let q = &pool[rng.below(pool.len() as u64) as usize];
                // Splice: this packet's head, another's tail.
                let cut = rng.below(p.len().min(q.len()) as u64 + 1) as usize;
                p.truncate(cut);
                p.extend_from_slice(&q[cut..]);
            }
            5 if p.len() >= PACKET_HEADER_LEN => {
                // A header field randomized, then a valid CRC.
                let fields: [(usize, usize); 10] =
                    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 4), (8, 4), (12, 4), (16, 4), (20, 8), (28, 2)];
                let (o, n) = fields[rng.below(10) as usize];
                let r = rng.bytes(n);
                p[o..o + n].copy_from_slice(&r);
                packet::seal(&mut p);
            }
            _ => {
                let n = rng.below(1473) as usize;
                p = rng.bytes(n);
            }
        }
    }
    p
}

#[test]
fn fuzz_bounded_seeded() {
    let secs: u64 = std::env::var("STRAIT_UDP_FUZZ_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let seed: u64 =
        std::env::var("STRAIT_UDP_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("fuzz: seed {seed} for {secs} s (STRAIT_UDP_FUZZ_SEED / STRAIT_UDP_FUZZ_SECS reproduce)");
    let pair = VethPair::create()
        .expect("cannot create network namespaces and a veth pair (root and iproute2 needed)");
    let (a, b, forger) = device_pair(&pair, false, Backend::Uring);
    let done = AtomicUsize::new(0);
    let gate = AtomicBool::new(false);
    let limit = Duration::from_secs(60 + secs);
    let sizes: Vec<usize> = SIZES.iter().copied().filter(|&n| n <= 300_000).collect();
    let (rb, sent, skipped, growth) = std::thread::scope(|s| {
        let ta = s.spawn(|| side(0, a, &sizes, &done, limit, Some(&gate)));
        let tb = s.spawn(|| side(1, b, &sizes, &done, limit, Some(&gate)));
        // Genuine packets from side 1 to side 0, turned around: what side 0 would send.
        let h = steal_header(&forger, Instant::now() + Duration::from_secs(10));
        let (id0, id1) = (h.dst_id, h.src_id);
        let mut rng = Rng(seed | 1);
        let mut pool = Vec::new();
        for k in [PacketKind::Data, PacketKind::Ack, PacketKind::Ping, PacketKind::Fin] {
            for len in [0usize, 1, 100, 1400] {
                let len = if k == PacketKind::Data { len } else { 0 };
                let mut f = h;
                (f.dst_id, f.src_id, f.kind, f.len) = (id1, id0, k, len as u16);
                let mut p = vec![0u8; PACKET_HEADER_LEN + len];
                f.encode(&mut p);
                p[PACKET_HEADER_LEN..].copy_from_slice(&rng.bytes(len));
                packet::seal(&mut p);
                pool.push(p);
            }
        }
        let (mut sent, mut skipped) = (0u64, 0u64);
        let end = Instant::now() + Duration::from_secs(secs);
        let mut before = None;
        let t0 = Instant::now();
        while Instant::now() < end {
            let p = mutate(&mut rng, &pool);
            if let Ok(x) = packet::open_with(&p, true) {
                // Passes every check (of a receiver over UDP, which also takes
                // header-only CRCs) with the real ids: a genuine packet as far as any
                // receiver without a secret can tell.
                if x.dst_id == id1 && x.src_id == id0
                    || x.kind == PacketKind::Syn
                    || x.kind == PacketKind::Reset
                {
                    skipped += 1;
                    continue;
                }
            }
            if forger.send(&p).is_err() {
                continue; // longer than the path MTU: the kernel refuses it
            }
            sent += 1;
            if sent % 32 == 0 {
                std::thread::sleep(Duration::from_micros(100));
            }
            if before.is_none() && t0.elapsed() > Duration::from_millis(500) {
                before = Some(rss());
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        let growth = rss() as i64 - before.unwrap_or_else(rss) as i64;
        gate.store(true, Ordering::SeqCst);
        let _ = ta.join().expect("side 0 failed");
        (tb.join().expect("side 1 failed"), sent, skipped, growth)
    });
    let counted = dropped(&rb.rel);
    eprintln!(
        "fuzz: {sent} datagrams sent ({skipped} genuine-looking skipped), {counted} counted and dropped: {:?}; RSS growth {} KiB",
        rb.rel,
        growth / 1024
    );
    assert!(sent > 1000, "fuzzer sent only {sent} datagrams");
    assert!(counted as f64 >= sent as f64 * 0.95, "only {counted} of {sent} fuzz datagrams were counted");
    assert_eq!(rb.ep.frames_rejected, 0, "a fuzz datagram reached the engine");
    assert!(growth < 4 << 20, "RSS grew by {growth} bytes during the fuzz run");
}
