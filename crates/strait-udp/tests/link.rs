//! The udp link on its own (no reliability layer): datagrams between two links on
//! loopback and across a veth pair, with both backends; GSO runs and GRO trains; the
//! sleep/wake protocol; transmit slots recycled; one doorbell per batch.

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

mod common;

use common::warm;
use strait_core::Link;
use strait_udp::netns::VethPair;
use strait_udp::{Backend, UdpConfig, UdpLink};

fn cfg(backend: Backend) -> UdpConfig {
    UdpConfig { backend, coalesce_ns: 0, ..UdpConfig::default() }
}

fn loopback_pair(c: &UdpConfig) -> (UdpLink, UdpLink) {
    let a = UdpSocket::bind("127.0.0.1:0").unwrap();
    let b = UdpSocket::bind("127.0.0.1:0").unwrap();
    a.connect(b.local_addr().unwrap()).unwrap();
    b.connect(a.local_addr().unwrap()).unwrap();
    (UdpLink::from_socket(a, c).unwrap(), UdpLink::from_socket(b, c).unwrap())
}

fn fill(seed: u32, b: &mut [u8]) {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    for v in b.iter_mut() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *v = x as u8;
    }
    if b.len() >= 4 {
        b[..4].copy_from_slice(&seed.to_le_bytes());
    }
}

/// Sends datagram `seed` of `len` bytes (filled by [`fill`]) from `a`, unflushed.
/// Checks that `d` is datagram `k`'s pattern (its first four bytes number it, as
/// [`send_filled`] wrote it) and returns `k`.
fn checked(d: &[u8]) -> u32 {
    assert!(d.len() >= 4, "runt datagram of {} bytes", d.len());
    let k = u32::from_le_bytes(d[..4].try_into().unwrap());
    let mut expect = vec![0u8; d.len()];
    fill(k, &mut expect);
    assert!(d == &expect[..], "datagram {k} corrupted");
    k
}

fn send_filled(a: &mut UdpLink, seed: u32, len: usize) {
    let slot = a.tx_alloc().unwrap();
    fill(seed, &mut a.tx_buf(slot)[..len]);
    assert!(a.send(slot, len).unwrap());
    a.tx_release(slot);
}

/// Sends `lens.len()` datagrams (the first four bytes number them) in batches of
/// `batch` per flush, receives them all, checks every byte; returns the sender.
fn exchange(tx: &mut UdpLink, rx: &mut UdpLink, lens: &[usize], batch: usize) {
    let mut got = vec![false; lens.len()];
    let mut n_got = 0;
    let mut next = 0;
    let mut held: Vec<u32> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut expect = Vec::new();
    while n_got < lens.len() {
        assert!(Instant::now() < deadline, "timed out: {n_got} of {} datagrams arrived", lens.len());
        let mut queued = 0;
        while next < lens.len() && queued < batch {
            let Some(slot) = tx.tx_alloc() else { break };
            fill(next as u32, &mut tx.tx_buf(slot)[..lens[next]]);
            if !tx.send(slot, lens[next]).unwrap() {
                tx.tx_release(slot);
                break;
            }
            held.push(slot);
            next += 1;
            queued += 1;
        }
        tx.flush().unwrap();
        // The "acknowledgement": give slots back once sent (the link keeps them until
        // their transmissions complete).
        for s in held.drain(..) {
            tx.tx_release(s);
        }
        while rx
            .recv(&mut |d| {
                if d == b"warm" {
                    return; // left over from `warm`
                }
                assert!(d.len() >= 4, "runt datagram of {} bytes", d.len());
                let k = u32::from_le_bytes(d[..4].try_into().unwrap()) as usize;
                assert!(k < lens.len() && d.len() == lens[k], "datagram {k} has length {}", d.len());
                expect.resize(d.len(), 0);
                fill(k as u32, &mut expect);
                assert!(d == &expect[..], "datagram {k} corrupted");
                if !got[k] {
                    got[k] = true;
                    n_got += 1;
                }
            })
            .unwrap()
        {}
    }
}

fn datagrams(backend: Backend) {
    let c = cfg(backend);
    let (mut a, mut b) = loopback_pair(&c);
    assert_eq!(a.backend(), backend);
    // Loopback's MTU is 64 KiB: every size up to the largest UDP datagram.
    assert!(a.mtu() > 60_000, "mtu {}", a.mtu());
    let lens: Vec<usize> = (0..2000).map(|i| [4, 5, 100, 1472, 8192, 60_000, a.mtu()][i % 7]).collect();
    exchange(&mut a, &mut b, &lens, 64);
    exchange(&mut b, &mut a, &lens, 1);
    a.flush().unwrap();
    // Every slot comes back once its transmission has completed.
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.slots_in_use() + b.slots_in_use() > 0 {
        assert!(Instant::now() < deadline, "slots still in use: {} {}", a.slots_in_use(), b.slots_in_use());
        a.flush().unwrap();
        b.flush().unwrap();
        let _ = a.recv(&mut |_| {});
        let _ = b.recv(&mut |_| {});
    }
    let s = a.stats();
    assert!(s.datagrams_sent >= 2000 && s.datagrams_received >= 2000, "{s:?}");
    assert_eq!(s.datagrams_dropped, 0);
}

common::test_per_backend!(loopback_datagrams_uring, loopback_datagrams_mmsg: datagrams);

/// One doorbell per batch: 200 datagrams queued, one flush, a handful of system
/// calls (the ring holds 256).
#[test]
fn one_doorbell_per_batch() {
    for backend in [Backend::Uring, Backend::Mmsg] {
        let (mut a, mut b) = loopback_pair(&cfg(backend));
        let before = a.stats().doorbells;
        for i in 0..200u32 {
            send_filled(&mut a, i, 64);
        }
        a.flush().unwrap();
        let rung = a.stats().doorbells - before;
        assert!(rung <= 2, "{backend:?}: {rung} doorbells for one batch");
        let mut n = 0;
        let deadline = Instant::now() + Duration::from_secs(5);
        while n < 200 && Instant::now() < deadline {
            while b.recv(&mut |_| n += 1).unwrap() {}
        }
        assert_eq!(n, 200, "{backend:?}");
    }
}

/// Doorbell moderation: flushes within the window are batched, and the deferred
/// datagrams still leave by the next `recv` after the window, or by `arm_sleep`.
#[test]
fn moderation_defers_and_delivers() {
    let c = UdpConfig { backend: Backend::Uring, coalesce_ns: 200_000_000, ..UdpConfig::default() };
    let (mut a, mut b) = loopback_pair(&c);
    let before = a.stats().doorbells;
    for i in 0..50u32 {
        send_filled(&mut a, i, 100);
        a.flush().unwrap();
    }
    assert!(a.stats().doorbells - before <= 2, "{} doorbells for 50 flushes", a.stats().doorbells - before);
    // Before sleeping, everything queued goes out.
    a.arm_sleep().unwrap();
    a.disarm_sleep();
    let mut n = 0;
    let deadline = Instant::now() + Duration::from_secs(5);
    while n < 50 && Instant::now() < deadline {
        while b.recv(&mut |_| n += 1).unwrap() {}
    }
    assert_eq!(n, 50);
}

/// GSO and GRO: a run of equal datagrams (the last one shorter) goes out as one
/// super-datagram and arrives as separate datagrams, each intact.
#[test]
fn gso_runs_and_gro_trains() {
    let pair = VethPair::create().expect("cannot create a veth pair (root and iproute2 needed)");
    let (sa, sb) = pair.udp_pair(false).unwrap();
    warm(&sa, &sb);
    let c = cfg(Backend::Uring);
    let mut a = UdpLink::from_socket(sa, &c).unwrap();
    let mut b = UdpLink::from_socket(sb, &c).unwrap();
    assert_eq!(a.mtu(), 1472, "veth MTU 1500 less IPv4 and UDP headers");
    let mtu = a.mtu();
    let lens: Vec<usize> = (0..3000).map(|i| if i % 45 == 44 { 700 } else { mtu }).collect();
    exchange(&mut a, &mut b, &lens, 200);
    let (ua, ub) = (a.udp_stats(), b.udp_stats());
    assert!(ua.gso_sends > 0, "no GSO send: {ua:?} ({})", a.features());
    assert!(ub.gro_trains > 0, "no GRO train: {ub:?} ({})", b.features());
    assert!(a.stats().doorbells < 100, "{:?}", a.stats());
}

/// One flush of `n_full` full-size datagrams and a short one from `a` to `b` over
/// the mmsg backend; everything is then received in one go. Checks that every
/// datagram arrives once, intact and on its own, and returns the doorbells each side
/// rang for it.
fn one_flush(a: &mut UdpLink, b: &mut UdpLink, n_full: usize) -> (u64, u64) {
    let mtu = a.mtu();
    let lens: Vec<usize> = (0..=n_full).map(|i| if i < n_full { mtu } else { 700 }).collect();
    let (a0, b0) = (a.stats(), b.stats());
    for (i, &len) in lens.iter().enumerate() {
        send_filled(a, i as u32, len);
    }
    a.flush().unwrap();
    let a_rung = a.stats().doorbells - a0.doorbells;
    assert_eq!(a.stats().datagrams_sent - a0.datagrams_sent, lens.len() as u64, "{:?}", a.udp_stats());
    assert_eq!(a.slots_in_use(), 0);
    // Let everything reach the receiver's socket first.
    std::thread::sleep(Duration::from_millis(100));
    let mut got: Vec<Vec<u8>> = Vec::new();
    let mut warms = 0;
    let mut drain = |b: &mut UdpLink, got: &mut Vec<Vec<u8>>| {
        while b
            .recv(&mut |d| {
                if d == b"warm" {
                    warms += 1; // left over from `warm`
                } else {
                    got.push(d.to_vec());
                }
            })
            .unwrap()
        {}
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.len() < lens.len() {
        assert!(Instant::now() < deadline, "timed out: {} of {} datagrams arrived", got.len(), lens.len());
        drain(b, &mut got);
    }
    drain(b, &mut got);
    assert_eq!(got.len(), lens.len(), "extra datagrams");
    let mut expect = Vec::new();
    for (i, d) in got.iter().enumerate() {
        // UDP keeps the order on a veth pair.
        assert_eq!(d.len(), lens[i], "datagram {i}");
        expect.resize(lens[i], 0);
        fill(i as u32, &mut expect);
        assert!(d == &expect, "datagram {i} corrupted");
    }
    let b1 = b.stats();
    assert_eq!(b1.datagrams_received - b0.datagrams_received, (lens.len() + warms) as u64);
    assert_eq!(b1.datagrams_dropped, b0.datagrams_dropped);
    (a_rung, b1.doorbells - b0.doorbells)
}

fn mmsg_link_pair(pair: &VethPair, v6: bool, tx: &UdpConfig, rx: &UdpConfig) -> (UdpLink, UdpLink) {
    let (sa, sb) = pair.udp_pair(v6).unwrap();
    warm(&sa, &sb);
    let a = UdpLink::from_socket(sa, tx).unwrap();
    let b = UdpLink::from_socket(sb, rx).unwrap();
    assert_eq!((a.backend(), b.backend()), (Backend::Mmsg, Backend::Mmsg));
    (a, b)
}

/// The mmsg backend with GSO and GRO: 200 full-size datagrams and a short one in
/// one flush leave as a few GSO messages of one `sendmmsg`, arrive as a few GRO
/// trains in one `recvmmsg`, and are handed out as 201 separate, intact datagrams.
#[test]
fn mmsg_gso_runs_and_gro_trains() {
    let pair = VethPair::create().expect("cannot create a veth pair (root and iproute2 needed)");
    let c = cfg(Backend::Mmsg);
    for v6 in [false, true] {
        let (mut a, mut b) = mmsg_link_pair(&pair, v6, &c, &c);
        assert_eq!(a.features(), "gso gro");
        assert_eq!(a.mtu(), if v6 { 1452 } else { 1472 });
        for _ in 0..3 {
            let (ua0, ub0) = (a.udp_stats(), b.udp_stats());
            let (a_rung, b_rung) = one_flush(&mut a, &mut b, 200);
            let (ua, ub) = (a.udp_stats(), b.udp_stats());
            // 64 KiB per GSO message: 44 (IPv4) or 45 (IPv6) datagrams each.
            assert_eq!(ua.gso_sends - ua0.gso_sends, 5, "v6 {v6}: {ua:?}");
            assert_eq!(ua.gso_refused, 0);
            assert!(ub.gro_trains - ub0.gro_trains >= 4, "v6 {v6}: {ub:?}");
            assert_eq!(a_rung, 1, "v6 {v6}: one sendmmsg for the flush");
            assert!(b_rung <= 3, "v6 {v6}: {b_rung} recvmmsg calls for 201 datagrams");
        }
    }
}

/// GSO and GRO off (either or both; and the kernel segmenting for a receiver
/// without GRO): the same datagrams, each intact and separate.
#[test]
fn mmsg_gso_gro_off() {
    let pair = VethPair::create().expect("cannot create a veth pair (root and iproute2 needed)");
    for (gso, gro) in [(false, false), (true, false), (false, true)] {
        let c = UdpConfig { gso, gro, ..cfg(Backend::Mmsg) };
        let (mut a, mut b) = mmsg_link_pair(&pair, false, &c, &c);
        let (a_rung, b_rung) = one_flush(&mut a, &mut b, 200);
        let (ua, ub) = (a.udp_stats(), b.udp_stats());
        assert_eq!(ua.gso_sends > 0, gso, "gso {gso} gro {gro}: {ua:?}");
        assert_eq!(ub.gro_trains, 0, "gso {gso} gro {gro}: {ub:?}");
        assert_eq!(a_rung, 1);
        // Without GRO, 32 datagrams per recvmmsg at most.
        assert!(b_rung >= 201 / 32, "gso {gso} gro {gro}: {b_rung} recvmmsg calls");
        // And the other way round, mixed sizes, many flushes.
        let mtu = a.mtu();
        let lens: Vec<usize> = (0..1000).map(|i| [4, 64, 1000, mtu, mtu, mtu][i % 6]).collect();
        exchange(&mut b, &mut a, &lens, 50);
    }
}

/// A route that refuses GSO (here: UDP checksums switched off, with which the kernel
/// cannot segment): the first GSO send fails, the link falls back to plain datagrams
/// for good, and no datagram is lost.
#[test]
fn mmsg_gso_refused_falls_back() {
    let pair = VethPair::create().expect("cannot create a veth pair (root and iproute2 needed)");
    let (sa, sb) = pair.udp_pair(false).unwrap();
    warm(&sa, &sb);
    let one: libc::c_int = 1;
    // SAFETY: setsockopt with a pointer to a local int and its size.
    let r = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&sa),
            libc::SOL_SOCKET,
            libc::SO_NO_CHECK,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "SO_NO_CHECK: {}", std::io::Error::last_os_error());
    let c = cfg(Backend::Mmsg);
    let mut a = UdpLink::from_socket(sa, &c).unwrap();
    let mut b = UdpLink::from_socket(sb, &c).unwrap();
    // Without UDP's checksum the reliability layer keeps its payload CRC.
    assert!(!a.carrier_checksum() && b.carrier_checksum());
    let (a_rung, _) = one_flush(&mut a, &mut b, 100);
    let ua = a.udp_stats();
    assert_eq!((ua.gso_refused, ua.gso_sends, ua.tx_errors), (1, 0, 0), "{ua:?}");
    assert_eq!(a_rung, 2, "the refused try and the plain one");
    let (a_rung, _) = one_flush(&mut a, &mut b, 100);
    assert_eq!(a_rung, 1, "GSO stays off");
    assert_eq!(a.udp_stats().gso_refused, 1);
}

/// Both backends across the veth pair, IPv4 and IPv6.
#[test]
fn veth_datagrams_both_backends_v4_v6() {
    let pair = VethPair::create().expect("cannot create a veth pair (root and iproute2 needed)");
    for v6 in [false, true] {
        for backend in [Backend::Uring, Backend::Mmsg] {
            let (sa, sb) = pair.udp_pair(v6).unwrap();
            warm(&sa, &sb);
            let c = cfg(backend);
            let mut a = UdpLink::from_socket(sa, &c).unwrap();
            let mut b = UdpLink::from_socket(sb, &c).unwrap();
            let mtu = a.mtu();
            assert_eq!(mtu, if v6 { 1452 } else { 1472 });
            assert!(a.carrier_checksum() && b.carrier_checksum(), "v6 {v6}");
            let lens: Vec<usize> = (0..1000).map(|i| [4, 64, 1000, mtu][i % 4]).collect();
            exchange(&mut a, &mut b, &lens, 100);
            exchange(&mut b, &mut a, &lens, 7);
        }
    }
}

/// A lone datagram with nothing in flight leaves by a plain `send`, a batch through
/// the ring; either way every datagram arrives intact, in the order sent. With
/// direct sends off, every datagram goes through the ring.
#[test]
fn lone_datagrams_skip_the_ring_batches_do_not() {
    for direct_send in [true, false] {
        let c = UdpConfig { direct_send, ..cfg(Backend::Uring) };
        let (mut a, mut b) = loopback_pair(&c);
        let mut got: Vec<u32> = Vec::new();
        let mut check = |d: &[u8]| got.push(checked(d));
        let mut sent = 0u32;
        let deadline = Instant::now() + Duration::from_secs(10);
        for round in 0..50u32 {
            // One lone datagram, flushed on its own; then a batch of 20.
            let burst = if round % 2 == 0 { 1 } else { 20 };
            for _ in 0..burst {
                send_filled(&mut a, sent, [8, 64, 1000, 1400][sent as usize % 4]);
                sent += 1;
            }
            a.flush().unwrap();
            let mut n = 0;
            while n < burst {
                assert!(Instant::now() < deadline, "round {round}: {n} of {burst} arrived");
                while b
                    .recv(&mut |d| {
                        check(d);
                        n += 1;
                    })
                    .unwrap()
                {}
                // Completions of earlier ring sends are reaped as the sender polls.
                let _ = a.recv(&mut |_| {});
            }
        }
        assert_eq!(got, (0..sent).collect::<Vec<_>>(), "datagrams lost or out of order");
        let u = a.udp_stats();
        if direct_send {
            // Every lone datagram: nothing was in flight when it was flushed (the
            // batch before it had been received, so its completions were reaped).
            assert_eq!(u.direct_sends, 25, "{u:?}");
        } else {
            assert_eq!(u.direct_sends, 0, "{u:?}");
        }
        // The batches always go through the ring.
        assert!(u.tx_doorbells >= 25, "{u:?}");
    }
}

/// Moderation holds a flush that follows another doorbell within the window (the
/// next doorbell takes it), but never a push: it rings at once, counted, and its
/// datagrams arrive intact behind the held ones. Both backends; the window is long
/// (10 s) so that nothing but the push can ring.
#[test]
fn a_push_rings_at_once_a_flush_in_the_window_waits() {
    for backend in [Backend::Uring, Backend::Mmsg] {
        let c = UdpConfig { coalesce_ns: 10_000_000_000, stream_coalesce_ns: 10_000_000_000, ..cfg(backend) };
        let (mut a, mut b) = loopback_pair(&c);
        // The first flush rings (no doorbell before it) ...
        send_filled(&mut a, 0, 100);
        a.flush().unwrap();
        // (Doorbells that submitted datagrams: the mmsg backend's receive polls
        // are system calls too.)
        let rung = a.udp_stats().tx_doorbells;
        assert_eq!(rung, 1, "{backend:?}: the first flush did not ring");
        // ... the next, within the window, waits, also through the link's polls.
        send_filled(&mut a, 1, 200);
        a.flush().unwrap();
        for _ in 0..100 {
            let _ = a.recv(&mut |_| {});
        }
        assert_eq!(a.udp_stats().tx_doorbells, rung, "{backend:?}: a flush in the window rang");
        assert_eq!(a.stats().pushes, 0);
        // A push rings now, and takes the held datagram along, in order.
        send_filled(&mut a, 2, 300);
        a.push().unwrap();
        assert_eq!(a.stats().pushes, 1, "{backend:?}");
        assert_eq!(a.udp_stats().tx_doorbells, rung + 1, "{backend:?}: the push did not ring");
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.len() < 3 {
            assert!(Instant::now() < deadline, "{backend:?}: {} of 3 arrived", got.len());
            while b.recv(&mut |d| got.push(checked(d))).unwrap() {}
        }
        assert_eq!(got, [0, 1, 2], "{backend:?}");
        // A push with nothing queued rings nothing and counts nothing.
        a.push().unwrap();
        assert_eq!(a.stats().pushes, 1, "{backend:?}");
        assert_eq!(a.udp_stats().tx_doorbells, rung + 1, "{backend:?}");
    }
}

fn poll_in(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd on the stack.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

/// Sleep: `arm_sleep` says "sleep" when idle, the event fd stays quiet while nothing
/// arrives, becomes readable when a datagram does, and `arm_sleep` says "don't" when
/// a datagram is waiting.
#[test]
fn sleep_and_wake() {
    for backend in [Backend::Uring, Backend::Mmsg] {
        let (mut a, mut b) = loopback_pair(&cfg(backend));
        let fd = b.event_fd().unwrap();
        while b.recv(&mut |_| {}).unwrap() {}
        assert!(b.arm_sleep().unwrap(), "{backend:?}: idle link refuses to sleep");
        assert!(!poll_in(fd, 50), "{backend:?}: event fd readable with nothing sent");
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            let slot = a.tx_alloc().unwrap();
            a.tx_buf(slot)[..3].copy_from_slice(b"hey");
            assert!(a.send(slot, 3).unwrap());
            a.flush().unwrap();
            a
        });
        let start = Instant::now();
        assert!(poll_in(fd, 5000), "{backend:?}: no wake-up");
        assert!(start.elapsed() < Duration::from_secs(2));
        b.disarm_sleep();
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(2);
        while got.is_empty() && Instant::now() < deadline {
            b.recv(&mut |d| got = d.to_vec()).unwrap();
        }
        assert_eq!(got, b"hey");
        let mut a = t.join().unwrap();
        // A datagram already waiting: do not sleep.
        let slot = a.tx_alloc().unwrap();
        assert!(a.send(slot, 1).unwrap());
        a.flush().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(!b.arm_sleep().unwrap(), "{backend:?}: would sleep on a waiting datagram");
        b.disarm_sleep();
    }
}

/// A socket that is not connected is refused; strangers' datagrams are filtered by
/// the kernel (connect), so the link never sees them.
#[test]
fn connected_only() {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    assert!(UdpLink::from_socket(s, &UdpConfig::default()).is_err());
    let (mut a, mut b) = loopback_pair(&cfg(Backend::Uring));
    let stranger = UdpSocket::bind("127.0.0.1:0").unwrap();
    let to: SocketAddr = b.local_addr().unwrap();
    for _ in 0..100 {
        stranger.send_to(b"intruder", to).unwrap();
    }
    let slot = a.tx_alloc().unwrap();
    a.tx_buf(slot)[..2].copy_from_slice(b"ok");
    a.send(slot, 2).unwrap();
    a.flush().unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline && got.is_empty() {
        while b.recv(&mut |d| got.push(d.to_vec())).unwrap() {}
    }
    assert_eq!(got, vec![b"ok".to_vec()]);
}

/// The io_uring backend posts 16 receive buffers at first and more each time the
/// kernel runs out: bursts of datagrams that cannot be coalesced (one buffer each)
/// all arrive, and once the ring has grown a burst no longer exhausts it.
#[test]
fn receive_buffers_grow_when_the_kernel_runs_out() {
    let c = cfg(Backend::Uring);
    let a = UdpSocket::bind("127.0.0.1:0").unwrap();
    let b = UdpSocket::bind("127.0.0.1:0").unwrap();
    a.connect(b.local_addr().unwrap()).unwrap();
    b.connect(a.local_addr().unwrap()).unwrap();
    let mut rx = UdpLink::from_socket(b, &c).unwrap();
    assert_eq!(rx.backend(), Backend::Uring);
    let mut nobufs = Vec::new();
    for burst in 0..6u32 {
        for i in 0..200u32 {
            let mut d = vec![0u8; 100 + (i % 7) as usize];
            fill(burst * 1000 + i, &mut d);
            a.send(&d).unwrap();
        }
        let mut got = 0;
        let deadline = Instant::now() + Duration::from_secs(10);
        while got < 200 {
            assert!(Instant::now() < deadline, "burst {burst}: {got} of 200 arrived");
            while rx
                .recv(&mut |d| {
                    let k = u32::from_le_bytes(d[..4].try_into().unwrap());
                    assert_eq!(k, burst * 1000 + got, "lost or reordered");
                    got += 1;
                })
                .unwrap()
            {}
        }
        nobufs.push(rx.udp_stats().rx_nobufs);
    }
    assert!(nobufs[0] > 0, "the first burst should outrun 16 buffers: {nobufs:?}");
    assert_eq!(nobufs[5], nobufs[4], "the ring did not grow: {nobufs:?}");
    assert_eq!(rx.stats().datagrams_dropped, 0);
}

/// `auto` takes the backend this host's calibration chose (io_uring or mmsg,
/// whichever carried a lone datagram faster here), and the choice is explained.
#[test]
fn auto_takes_the_backend_measured_fastest_here() {
    let cal = strait_udp::calibrate::calibration();
    let (a, _b) = loopback_pair(&cfg(Backend::Auto));
    assert_eq!(a.backend(), cal.choice, "{}", cal.describe());
    assert!(cal.describe().starts_with("udp backend auto = "), "{}", cal.describe());
    if matches!(
        cal.source,
        strait_udp::calibrate::Source::Measured | strait_udp::calibrate::Source::Cached(_)
    ) {
        assert!(cal.uring_round_trip_ns > 0.0 && cal.mmsg_round_trip_ns > 0.0, "{cal:?}");
        assert_eq!(
            strait_udp::calibrate::decide(cal.uring_round_trip_ns, cal.mmsg_round_trip_ns),
            cal.choice
        );
    }
}
