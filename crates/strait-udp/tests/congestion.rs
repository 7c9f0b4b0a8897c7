//! Congestion control on a real bottleneck (issue 20): two network namespaces
//! joined by a veth pair (made and removed by each test), the sender's egress
//! shaped by a `tc` token bucket (tbf) with a bounded drop-tail queue.
//!
//! * One strait flow (the native API over the udp device) and one kernel TCP flow
//!   share the bottleneck: over a common interval after a warm-up, each delivers
//!   between a third and two thirds of the bytes (receivers' byte counters).
//! * With 5% random loss (iptables `statistic` rules, as the other loss tests: this
//!   kernel has no netem), a strait transfer still completes, every byte hashed on
//!   both sides; its goodput is printed.
//!
//! Both need root, `tc` (iproute2) and `iptables` (`scripts/install-deps`).

mod common;

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::device_pair;
use strait_core::{Config, MemoryRegion, OpKind, ReliableStats, Status, WaitError, Worker};
use strait_sys::pattern;
use strait_udp::netns::VethPair;
use strait_udp::{Backend, UdpDevice};

/// The bottleneck: what a 2-core VM drives with both flows and their receivers
/// (four busy threads) while leaving the link, not the CPUs, the limit.
const RATE: &str = "200mbit";
/// Its queue: about 5 ms at the rate, as docs/PERFORMANCE.md section 16's benchmark.
const QUEUE: &str = "128kb";
/// Message size of the strait flow (eager: one frame each, no rendezvous turns).
const MSG: usize = 32 * 1024;
/// Messages each strait side keeps posted.
const DEPTH: usize = 32;

/// One test at a time: each drives four busy threads on a 2-core machine, and a
/// flow short of CPU would lose its share for want of a core, not to the network.
static SERIAL: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    // A failed test poisons the lock; the next one still runs.
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn shaped_veth() -> VethPair {
    let pair = VethPair::create().expect("cannot create network namespaces and a veth pair (root needed)");
    // Side 0 sends; its egress is the bottleneck (the acknowledgements come back
    // unshaped, as on an asymmetric access link).
    pair.exec(
        0,
        &[
            "tc",
            "qdisc",
            "add",
            "dev",
            &pair.dev[0],
            "root",
            "tbf",
            "rate",
            RATE,
            "burst",
            "32kb",
            "limit",
            QUEUE,
        ],
    )
    .expect("cannot install the tbf bottleneck (tc from iproute2 needed)");
    pair
}

/// Sends `MSG`-byte messages (a fixed pattern) until `stop`, or `total` bytes if
/// given; hashes what it sent. Returns (bytes sent, hash, the device's counters).
fn strait_sender(
    dev: UdpDevice,
    stop: &AtomicBool,
    total: Option<u64>,
    limit: Duration,
) -> (u64, u64, ReliableStats) {
    let deadline = Instant::now() + limit;
    let mut w: Worker<UdpDevice> = Worker::new(Config::default()).unwrap();
    let ep = w.attach(dev);
    let msgs: Vec<MemoryRegion> = (0..DEPTH)
        .map(|i| {
            let mut mr = MemoryRegion::new(MSG).unwrap();
            mr.write_at(0, &pattern(i as u64 + 1, MSG)).unwrap();
            mr
        })
        .collect();
    let mut hash = DefaultHasher::new();
    // STRAIT_CC_TRACE=1: the sender's congestion state four times a second.
    let mut trace = std::env::var_os("STRAIT_CC_TRACE").map(|_| Instant::now());
    let (mut posted, mut done, mut bytes) = (0u64, 0u64, 0u64);
    let want = total.map(|t| t.div_ceil(MSG as u64));
    loop {
        let more = !stop.load(Ordering::Relaxed) && want.is_none_or(|n| posted < n);
        while more && posted - done < DEPTH as u64 && want.is_none_or(|n| posted < n) {
            let i = (posted % DEPTH as u64) as usize;
            w.post_send(ep, &msgs[i], 0..MSG, 7, i as u64).unwrap();
            hash.write(&msgs[i].bytes().unwrap()[..MSG]);
            posted += 1;
        }
        if !more && done == posted {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sender: timed out, {done} of {posted} sends done; {:?}",
            w.device(ep).unwrap().rstats()
        );
        if trace.is_some_and(|t| t.elapsed() >= Duration::from_millis(250)) {
            trace = Some(Instant::now());
            let d = w.device(ep).unwrap();
            let r = d.rstats();
            eprintln!(
                "  strait sender: srtt {} us cwnd {} unacked {} reductions {} timeouts {} fast {} rto {}",
                r.srtt_ns / 1000,
                r.cwnd,
                d.unacked(),
                r.cc_reductions,
                r.cc_timeouts,
                r.fast_retransmits,
                r.timeout_retransmits
            );
            eprintln!("    {}", strait_core::Device::describe(d));
        }
        match w.wait(Some(Duration::from_millis(100))) {
            Ok(c) => {
                assert_eq!(c.status, Status::Ok, "sender: {c:?} {:?}", w.endpoint_error(ep));
                assert_eq!(c.op, OpKind::Send);
                done += 1;
                bytes += MSG as u64;
            }
            Err(WaitError::Timeout) => {}
            Err(e) => panic!("sender: wait failed: {e}"),
        }
    }
    let rel = w.device(ep).unwrap().rstats();
    w.close(ep);
    w.linger(Duration::from_secs(2));
    (bytes, hash.finish(), rel)
}

/// Receives until `n` messages arrived (or, without `n`, until `stop` and a quiet
/// spell); counts bytes into `got` as they arrive and hashes them.
fn strait_receiver(
    dev: UdpDevice,
    got: &AtomicU64,
    stop: &AtomicBool,
    n: Option<u64>,
    limit: Duration,
) -> u64 {
    let deadline = Instant::now() + limit;
    let mut w: Worker<UdpDevice> = Worker::new(Config::default()).unwrap();
    let ep = w.attach(dev);
    let mut inbox: Vec<MemoryRegion> = (0..DEPTH).map(|_| MemoryRegion::new(MSG).unwrap()).collect();
    for (i, mr) in inbox.iter_mut().enumerate() {
        w.post_recv(ep, mr, 0..MSG, 7, u64::MAX, i as u64).unwrap();
    }
    let mut hash = DefaultHasher::new();
    let mut received = 0u64;
    let mut quiet_since: Option<Instant> = None;
    loop {
        if n.is_some_and(|n| received == n) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "receiver: timed out after {received} messages; {:?}",
            w.device(ep).unwrap().rstats()
        );
        match w.wait(Some(Duration::from_millis(100))) {
            Ok(c) if c.status == Status::PeerGone && n.is_none() && stop.load(Ordering::Relaxed) => {
                // The sender stopped, closed, and our spare receives end with it.
                break;
            }
            Ok(c) => {
                assert_eq!(c.status, Status::Ok, "receiver: {c:?} {:?}", w.endpoint_error(ep));
                assert_eq!((c.op, c.len), (OpKind::Recv, MSG));
                let i = c.ctx as usize;
                hash.write(&inbox[i].bytes().unwrap()[..MSG]);
                received += 1;
                got.fetch_add(MSG as u64, Ordering::Relaxed);
                quiet_since = None;
                w.post_recv(ep, &mut inbox[i], 0..MSG, 7, u64::MAX, i as u64).unwrap();
            }
            Err(WaitError::Timeout) => {
                // Without a count: done once the sender stopped and nothing more came.
                if n.is_none() && stop.load(Ordering::Relaxed) {
                    let q = *quiet_since.get_or_insert_with(Instant::now);
                    if q.elapsed() > Duration::from_millis(500) {
                        break;
                    }
                }
            }
            Err(e) => panic!("receiver: wait failed: {e}"),
        }
    }
    w.close(ep);
    w.linger(Duration::from_millis(200));
    hash.finish()
}

/// Makes a kernel TCP socket run CUBIC, Linux's default and the algorithm strait
/// runs, whatever this host chose as its default (a namespace inherits the host's;
/// BBR on some, and a namespace may only pick the host's allowed ones by sysctl,
/// while a socket of a privileged process may pick any).
fn use_cubic(s: &TcpStream) {
    let name = b"cubic";
    // SAFETY: a live socket descriptor; `name` is valid for its length.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_ptr().cast(),
            name.len() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "TCP_CONGESTION cubic: {}", std::io::Error::last_os_error());
}

#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    strait: u64,
    tcp: u64,
}

/// One strait flow and one kernel TCP flow through the bottleneck at once: after a
/// warm-up, each delivers between a third and two thirds of the bytes of a common
/// interval.
fn shares_with_tcp(backend: Backend) {
    let _serial = one_at_a_time();
    let pair = shaped_veth();
    let (a, b, _) = device_pair(&pair, false, backend);
    let (mut ta, mut tb) = pair.tcp_pair().expect("tcp pair");
    use_cubic(&ta);
    use_cubic(&tb);
    let cc = "cubic";
    let stop = AtomicBool::new(false);
    let (strait_got, tcp_got) = (AtomicU64::new(0), AtomicU64::new(0));
    let limit = Duration::from_secs(40);
    // Seven one-second samples: two CUBIC flows' shares swing by tens of percent from
    // one second to the next, the sum over seven much less.
    let (warmup, interval) = (Duration::from_secs(3), Duration::from_secs(7));
    let (samples, rel) = std::thread::scope(|s| {
        let tx = s.spawn(|| strait_sender(a, &stop, None, limit));
        let rx = s.spawn(|| strait_receiver(b, &strait_got, &stop, None, limit));
        let ttx = s.spawn(|| {
            let buf = vec![0x5au8; 64 * 1024];
            while !stop.load(Ordering::Relaxed) {
                if ta.write_all(&buf).is_err() {
                    break;
                }
            }
            let _ = ta.shutdown(Shutdown::Write);
        });
        let trx = s.spawn(|| {
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                match tb.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        tcp_got.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
            }
        });
        let snap =
            || Sample { strait: strait_got.load(Ordering::Relaxed), tcp: tcp_got.load(Ordering::Relaxed) };
        std::thread::sleep(warmup);
        let mut samples = vec![snap()];
        for _ in 0..interval.as_secs() {
            std::thread::sleep(Duration::from_secs(1));
            samples.push(snap());
        }
        stop.store(true, Ordering::Relaxed);
        let (_, _, rel) = tx.join().expect("strait sender");
        rx.join().expect("strait receiver");
        ttx.join().expect("tcp sender");
        trx.join().expect("tcp receiver");
        (samples, rel)
    });
    let per_second: Vec<String> = samples
        .windows(2)
        .map(|w| {
            format!(
                "{:.0}/{:.0}",
                (w[1].strait - w[0].strait) as f64 * 8e-6,
                (w[1].tcp - w[0].tcp) as f64 * 8e-6
            )
        })
        .collect();
    let (first, last) = (samples[0], samples[samples.len() - 1]);
    let (s, t) = ((last.strait - first.strait) as f64, (last.tcp - first.tcp) as f64);
    let secs = interval.as_secs_f64();
    let share = s / (s + t);
    let jain = (s + t).powi(2) / (2.0 * (s * s + t * t));
    eprintln!(
        "{backend:?}, tbf {RATE} {QUEUE}, kernel TCP {cc}: over {secs} s strait {:.1} Mbit/s, TCP {:.1} Mbit/s; \
         strait's share {share:.2}, Jain {jain:.3}; per second strait/TCP Mbit/s: {}; strait: srtt {} us, cwnd {}, \
         {} reductions, {} timeouts ({} spurious), {} fast and {} timeout retransmits",
        s * 8e-6 / secs,
        t * 8e-6 / secs,
        per_second.join(" "),
        rel.srtt_ns / 1000,
        rel.cwnd,
        rel.cc_reductions,
        rel.cc_timeouts,
        rel.spurious_timeouts,
        rel.fast_retransmits,
        rel.timeout_retransmits,
    );
    assert!(s + t > 0.0, "nothing crossed the bottleneck");
    assert!(
        (1.0 / 3.0..=2.0 / 3.0).contains(&share),
        "strait's share of the bottleneck {share:.2} is outside [1/3, 2/3]"
    );
}

common::test_per_backend!(strait_and_tcp_share_a_bottleneck_uring, strait_and_tcp_share_a_bottleneck_mmsg: shares_with_tcp);

/// Moves `total` bytes from `a` to `b` in `MSG`-byte messages and checks that all
/// arrived, hashed as sent; returns how long it took and the sender's counters.
fn transfer(a: UdpDevice, b: UdpDevice, total: u64) -> (Duration, ReliableStats) {
    let n = total / MSG as u64;
    let stop = AtomicBool::new(false);
    let got = AtomicU64::new(0);
    let limit = Duration::from_secs(45);
    let start = Instant::now();
    let ((sent, sent_hash, rel), got_hash, elapsed) = std::thread::scope(|s| {
        let tx = s.spawn(|| strait_sender(a, &stop, Some(total), limit));
        let rx = s.spawn(|| {
            let h = strait_receiver(b, &got, &stop, Some(n), limit);
            (h, start.elapsed())
        });
        let (h, elapsed) = rx.join().expect("strait receiver");
        (tx.join().expect("strait sender"), h, elapsed)
    });
    assert_eq!(sent, n * MSG as u64);
    assert_eq!(got.load(Ordering::Relaxed), sent);
    assert_eq!(got_hash, sent_hash, "the payload arrived altered");
    (elapsed, rel)
}

/// 5% of the data direction's packets dropped at random, on the bottleneck: a
/// 16 MiB transfer completes, its hash the sender's.
fn five_percent_loss(backend: Backend) {
    let _serial = one_at_a_time();
    let pair = shaped_veth();
    let (a, b, _) = device_pair(&pair, false, backend);
    pair.set_loss(1, 0.05).expect("cannot install the iptables loss rule");
    let total: u64 = 16 << 20;
    let (elapsed, rel) = transfer(a, b, total);
    let dropped = pair.dropped(1).unwrap_or(0);
    eprintln!(
        "{backend:?}, 5% loss, tbf {RATE}: {} MiB in {:.2} s, goodput {:.1} Mbit/s; {dropped} packets dropped by \
         iptables; {} fast and {} timeout retransmits, {} reductions, {} timeouts, srtt {} us",
        total >> 20,
        elapsed.as_secs_f64(),
        total as f64 * 8e-6 / elapsed.as_secs_f64(),
        rel.fast_retransmits,
        rel.timeout_retransmits,
        rel.cc_reductions,
        rel.cc_timeouts,
        rel.srtt_ns / 1000,
    );
    assert!(dropped > 0, "the loss rule dropped nothing");
}

common::test_per_backend!(five_percent_loss_completes_hashed_uring, five_percent_loss_completes_hashed_mmsg: five_percent_loss);

/// ECN on the bottleneck: 2% of the data direction's ECN-capable datagrams arrive
/// marked Congestion Experienced (iptables' TOS target on the receiver, as an AQM
/// marks instead of dropping). The receiver echoes the marks in its headers; the
/// sender reduces its congestion window for them as for losses, with nothing to
/// resend, and a 16 MiB transfer completes, its hash the sender's. With ECN off at
/// both ends the datagrams are not ECN-capable: the rule marks none, and nothing is
/// echoed or reduced for marks.
fn ecn_marks(backend: Backend) {
    let _serial = one_at_a_time();
    for ecn in [true, false] {
        let pair = shaped_veth();
        let (sa, sb) = pair.udp_pair(false).unwrap();
        common::warm(&sa, &sb);
        let c = strait_udp::UdpConfig { ecn, ..common::cfg(backend) };
        let (la, lb) = (
            strait_udp::UdpLink::from_socket(sa, &c).unwrap(),
            strait_udp::UdpLink::from_socket(sb, &c).unwrap(),
        );
        assert_eq!((la.ecn(), lb.ecn()), (ecn, ecn), "the kernel refused ECN");
        let (a, b) = (la.reliable(common::rel_cfg()), lb.reliable(common::rel_cfg()));
        pair.set_ce_marking(1, 0.02).expect("cannot install the iptables CE marking rule");
        let total: u64 = 16 << 20;
        let (elapsed, rel) = transfer(a, b, total);
        let marked = pair.ce_marked(1).unwrap_or(0);
        eprintln!(
            "{backend:?}, ECN {ecn}, 2% CE marks, tbf {RATE}: {} MiB in {:.2} s, goodput {:.1} Mbit/s; {marked} \
             datagrams marked; {} marks echoed, {} ECN reductions of {} in all, {} fast and {} timeout \
             retransmits, srtt {} us",
            total >> 20,
            elapsed.as_secs_f64(),
            total as f64 * 8e-6 / elapsed.as_secs_f64(),
            rel.ce_echoed,
            rel.cc_ecn_reductions,
            rel.cc_reductions,
            rel.fast_retransmits,
            rel.timeout_retransmits,
            rel.srtt_ns / 1000,
        );
        if ecn {
            assert!(marked > 0, "the rule marked nothing");
            // Marks on data datagrams reach the sender as echoes (the receiver's own
            // acknowledgements are marked too, and echoed back to it).
            assert!(rel.ce_echoed > 0, "no mark was echoed: {rel:?}");
            assert!(rel.cc_ecn_reductions > 0, "the sender never reduced for a mark: {rel:?}");
            assert!(rel.cc_ecn_reductions <= rel.cc_reductions);
        } else {
            assert_eq!(marked, 0, "datagrams went out ECN-capable with ECN off");
            assert_eq!((rel.ce_echoed, rel.cc_ecn_reductions), (0, 0), "{rel:?}");
        }
    }
}

common::test_per_backend!(ecn_marks_slow_the_sender_uring, ecn_marks_slow_the_sender_mmsg: ecn_marks);

/// A path that drops ECN-capable datagrams (a rare middlebox; here iptables drops
/// every ECT(0) datagram arriving at either side): the connection setup goes
/// unanswered, each side's link stops marking after a few tries, and a 1 MiB
/// transfer completes, hashed. Without the fallback the setup never completes
/// (the liveness timeout ends it).
fn ect_dropping_path(backend: Backend) {
    let _serial = one_at_a_time();
    let pair = VethPair::create().expect("cannot create network namespaces and a veth pair (root needed)");
    strait_udp::netns::ensure_iptables().expect("iptables");
    for side in 0..2 {
        pair.exec(
            side,
            &["iptables", "-A", "INPUT", "-p", "udp", "-m", "tos", "--tos", "0x02/0x03", "-j", "DROP"],
        )
        .expect("cannot install the iptables rule that drops ECN-capable datagrams");
    }
    let (a, b, _) = device_pair(&pair, false, backend);
    let (elapsed, rel) = transfer(a, b, 1 << 20);
    eprintln!("{backend:?}, ECT dropped: 1 MiB in {:.2} s; {rel:?}", elapsed.as_secs_f64());
    assert!(rel.ecn_fallbacks >= 1, "the sender never stopped marking: {rel:?}");
}

common::test_per_backend!(a_path_that_drops_ecn_capable_datagrams_falls_back_uring, a_path_that_drops_ecn_capable_datagrams_falls_back_mmsg: ect_dropping_path);
