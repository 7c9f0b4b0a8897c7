//! Hostile datagrams at a strait udp port, across a veth pair: random bytes,
//! truncated headers, wrong versions, forged sequence numbers and acknowledgements
//! (with the real connection ids, learned from a stolen packet), oversized length
//! fields, bad checksums, wrong connection ids, all sent from the peer's own address
//! and port (a clone of its socket, so the kernel's connect filter lets them in),
//! plus strangers' datagrams from another port. Each is counted and dropped; the
//! connection keeps working (a full round of messages before and after the flood),
//! nothing extra is delivered, and the process does not grow.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{device_pair, dropped, hostile, rss, side, steal_header, Rng, CLASSES, SIZES};
use strait_udp::netns::VethPair;
use strait_udp::Backend;

const PER_CLASS: usize = 3000;

/// The RSS check is of the whole process: the floods take turns, so that one test's
/// buffers (GRO trains fill whole receive buffers) do not count against the other.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn flood(backend: Backend) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let pair = VethPair::create()
        .expect("cannot create network namespaces and a veth pair (root and iproute2 needed)");
    let (a, b, forger) = device_pair(&pair, false, backend);
    let stranger = pair.udp_socket(0, false, 0).unwrap();
    let target = forger.peer_addr().unwrap();
    let done = AtomicUsize::new(0);
    let gate = AtomicBool::new(false);
    let limit = Duration::from_secs(60);
    let sizes: Vec<usize> = SIZES.iter().copied().filter(|&n| n <= 1 << 20).collect();
    let (ra, rb, growth, sent) = std::thread::scope(|s| {
        let ta = s.spawn(|| side(0, a, &sizes, &done, limit, Some(&gate)));
        let tb = s.spawn(|| side(1, b, &sizes, &done, limit, Some(&gate)));
        let h = steal_header(&forger, Instant::now() + Duration::from_secs(10));
        let mut rng = Rng(0x5eed_0000 + backend as u64);
        // Warm-up: the first datagrams of each class, then measure.
        let mut sent = 0;
        for i in 0..CLASSES.len() * 200 {
            forger.send(&hostile(&mut rng, i % CLASSES.len(), &h)).unwrap();
            sent += 1;
        }
        std::thread::sleep(Duration::from_millis(200));
        let before = rss();
        for i in 0..CLASSES.len() * PER_CLASS {
            forger.send(&hostile(&mut rng, i % CLASSES.len(), &h)).unwrap();
            sent += 1;
            if i % 64 == 0 {
                stranger.send_to(&rng.bytes(100), target).unwrap();
                // Pace the flood so that the receiver's socket buffer keeps up.
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        let growth = rss() as i64 - before as i64;
        gate.store(true, Ordering::SeqCst);
        (ta.join().expect("side 0 failed"), tb.join().expect("side 1 failed"), growth, sent)
    });
    let counted = dropped(&rb.rel);
    eprintln!(
        "{backend:?}: {sent} hostile datagrams sent, {counted} counted and dropped by side 1 ({:?}); RSS growth {} KiB",
        rb.rel,
        growth / 1024
    );
    assert!(counted as f64 >= sent as f64 * 0.95, "only {counted} of {sent} hostile datagrams were counted");
    assert_eq!(rb.ep.frames_rejected, 0, "a hostile datagram reached the engine");
    assert!(growth < 4 << 20, "RSS grew by {growth} bytes during the flood");
    let _ = ra;
}

common::test_per_backend!(hostile_datagrams_counted_and_dropped_uring, hostile_datagrams_counted_and_dropped_mmsg: flood);
