//! The udp device against the kernel across a veth pair between two network
//! namespaces (made and removed here; needs root), in interleaved rounds:
//!
//! * 8-byte ping-pong one-way latency (median, p99): strait-udp (native API over
//!   `Reliable<UdpLink>`) vs kernel UDP (blocking `send`/`recv`);
//! * 1 MiB streaming bandwidth: strait-udp vs kernel TCP;
//! * doorbells (system calls that submit or reap) per message while streaming
//!   64-byte messages, and per datagram while streaming 1 MiB messages;
//! * 1 MiB streaming bandwidth with 1% random loss on both sides (iptables).
//!
//! `cargo run --release -p strait-udp --example veth_bench [-- ROUNDS [stream]]`
//! (default 3 rounds; `stream`: only the 64-byte stream, for a syscall profile).
//! `STRAIT_UDP_*` variables (e.g. `STRAIT_UDP_BACKEND=mmsg`) apply.

use std::net::UdpSocket;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use strait_core::{MemoryRegion, OpKind, ReliableConfig, Status, Worker};
use strait_udp::netns::VethPair;
use strait_udp::{UdpConfig, UdpDevice, UdpLink};

mod common;
use common::{kernel_tcp_bulk, median, next, pct, worker_on, Res, MIB};

const PINGS: usize = 5000;
const BULK_MSGS: usize = 96;
const STREAM_MSGS: usize = 100_000;

fn warm(a: &UdpSocket, b: &UdpSocket) -> Res<()> {
    for (x, y) in [(a, b), (b, a)] {
        y.set_read_timeout(Some(Duration::from_millis(100)))?;
        let mut buf = [0u8; 16];
        let mut ok = false;
        for _ in 0..50 {
            x.send(b"warm")?;
            if y.recv(&mut buf).is_ok() {
                ok = true;
                break;
            }
        }
        if !ok {
            return Err("no datagram crosses the veth pair".into());
        }
        std::thread::sleep(Duration::from_millis(10));
        y.set_nonblocking(true)?;
        while y.recv(&mut buf).is_ok() {}
        y.set_nonblocking(false)?;
        y.set_read_timeout(None)?;
    }
    Ok(())
}

/// What one side needs to set up its device: on the thread that drives it, as
/// separate processes do (an io_uring request's work runs on the thread that
/// submitted it, so a link set up on another thread would have that thread do its
/// receives).
struct Side(UdpSocket, UdpConfig, ReliableConfig);

fn devices(pair: &VethPair) -> Res<(Side, Side)> {
    let (sa, sb) = pair.udp_pair(false)?;
    warm(&sa, &sb)?;
    let c = UdpConfig::from_env()?;
    let r = ReliableConfig::from_env()?;
    Ok((Side(sa, c.clone(), r.clone()), Side(sb, c, r)))
}

/// A worker with the side's device attached, driven until the handshake is done.
fn worker(side: Side) -> (Worker<UdpDevice>, strait_core::EpId) {
    let Side(sock, c, r) = side;
    worker_on(UdpLink::from_socket(sock, &c).expect("link").reliable(r))
}

/// Where the two sides of a measurement meet: before the timed part, and at the end.
struct Meet {
    start: Barrier,
    done: AtomicUsize,
}

impl Meet {
    fn new() -> Self {
        Meet { start: Barrier::new(2), done: AtomicUsize::new(0) }
    }

    fn wait(&self) {
        self.start.wait();
    }
}

/// Ends one side: keeps driving the worker until the other side is done too (a
/// sender's last packets may still need resending after its sends completed: a
/// sender that stopped would leave its peer waiting until the liveness timeout),
/// then closes.
fn finish(mut w: Worker<UdpDevice>, ep: strait_core::EpId, meet: &Meet) {
    meet.done.fetch_add(1, Ordering::SeqCst);
    while meet.done.load(Ordering::SeqCst) < 2 {
        w.progress();
        std::thread::yield_now();
    }
    w.close(ep);
    w.linger(Duration::from_secs(1));
}

/// One-way latencies (RTT/2) of 8-byte strait ping-pongs, ns.
fn strait_pingpong(pair: &VethPair) -> Res<Vec<f64>> {
    let (a, b) = devices(pair)?;
    let bar = Meet::new();
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            let (mut w, ep) = worker(b);
            let mut mr = MemoryRegion::new(8).unwrap();
            let out = MemoryRegion::new(8).unwrap();
            bar.wait();
            for _ in 0..PINGS + 500 {
                w.post_recv(ep, &mut mr, 0..8, 0, 0, 0).unwrap();
                next(&mut w, OpKind::Recv);
                w.post_send(ep, &out, 0..8, 0, 0).unwrap();
            }
            finish(w, ep, &bar);
        });
        let (mut w, ep) = worker(a);
        let mut mr = MemoryRegion::new(8).unwrap();
        let out = MemoryRegion::new(8).unwrap();
        bar.wait();
        let mut lat = Vec::with_capacity(PINGS);
        for i in 0..PINGS + 500 {
            let t = Instant::now();
            w.post_recv(ep, &mut mr, 0..8, 0, 0, 0).unwrap();
            w.post_send(ep, &out, 0..8, 0, 0).unwrap();
            next(&mut w, OpKind::Recv);
            if i >= 500 {
                lat.push(t.elapsed().as_nanos() as f64 / 2.0);
            }
        }
        finish(w, ep, &bar);
        lat
    });
    Ok(r)
}

fn kernel_udp_pingpong(pair: &VethPair) -> Res<Vec<f64>> {
    let (a, b) = pair.udp_pair(false)?;
    warm(&a, &b)?;
    let lat = std::thread::scope(|s| {
        s.spawn(|| {
            let mut buf = [0u8; 64];
            for _ in 0..PINGS + 500 {
                let n = b.recv(&mut buf).unwrap();
                b.send(&buf[..n]).unwrap();
            }
        });
        let mut buf = [0u8; 64];
        let mut lat = Vec::with_capacity(PINGS);
        a.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        for i in 0..PINGS + 500 {
            let t = Instant::now();
            a.send(&[7u8; 8]).unwrap();
            a.recv(&mut buf).unwrap();
            if i >= 500 {
                lat.push(t.elapsed().as_nanos() as f64 / 2.0);
            }
        }
        lat
    });
    Ok(lat)
}

struct Bulk {
    gbps: f64,
    doorbells_per_datagram: f64,
    retransmits: u64,
}

/// Streams BULK_MSGS messages of 1 MiB from side 0 to side 1 (8 outstanding).
fn strait_bulk(pair: &VethPair) -> Res<Bulk> {
    let (a, b) = devices(pair)?;
    let bar = Meet::new();
    let r = std::thread::scope(|s| {
        let rx = s.spawn(|| {
            let (mut w, ep) = worker(b);
            let mut mrs: Vec<MemoryRegion> = (0..8).map(|_| MemoryRegion::new(MIB).unwrap()).collect();
            for (i, mr) in mrs.iter_mut().enumerate() {
                w.post_recv(ep, mr, 0..MIB, 0, 0, i as u64).unwrap();
            }
            bar.wait();
            let t = Instant::now();
            let mut got = 0;
            while got < BULK_MSGS {
                let c = next(&mut w, OpKind::Recv);
                got += 1;
                if got + 8 <= BULK_MSGS {
                    let i = c.ctx as usize;
                    w.post_recv(ep, &mut mrs[i], 0..MIB, 0, 0, i as u64).unwrap();
                }
            }
            let el = t.elapsed();
            let st = w.device(ep).unwrap().rstats();
            finish(w, ep, &bar);
            (el, st)
        });
        let (mut w, ep) = worker(a);
        let mrs: Vec<MemoryRegion> = (0..8).map(|_| MemoryRegion::new(MIB).unwrap()).collect();
        bar.wait();
        for (i, mr) in mrs.iter().enumerate() {
            w.post_send(ep, mr, 0..MIB, 0, i as u64).unwrap();
        }
        let mut done = 0;
        while done < BULK_MSGS {
            let c = next(&mut w, OpKind::Send);
            done += 1;
            if done + 8 <= BULK_MSGS {
                w.post_send(ep, &mrs[c.ctx as usize], 0..MIB, 0, c.ctx).unwrap();
            }
        }
        let st = w.device(ep).unwrap().rstats();
        finish(w, ep, &bar);
        let (el, rst) = rx.join().unwrap();
        let datagrams = st.link.datagrams_sent.max(1) as f64;
        Bulk {
            gbps: (BULK_MSGS * MIB) as f64 * 8.0 / el.as_secs_f64() / 1e9,
            doorbells_per_datagram: (st.link.doorbells + rst.link.doorbells) as f64 / datagrams,
            retransmits: st.timeout_retransmits + st.fast_retransmits,
        }
    });
    Ok(r)
}

/// Streams STREAM_MSGS 64-byte messages; (doorbells per message both sides,
/// messages per second).
fn strait_stream(pair: &VethPair) -> Res<(f64, f64, f64)> {
    let (a, b) = devices(pair)?;
    let bar = Meet::new();
    let r = std::thread::scope(|s| {
        let rx = s.spawn(|| {
            let (mut w, ep) = worker(b);
            let mut mrs: Vec<MemoryRegion> = (0..256).map(|_| MemoryRegion::new(64).unwrap()).collect();
            for (i, mr) in mrs.iter_mut().enumerate() {
                w.post_recv(ep, mr, 0..64, 0, 0, i as u64).unwrap();
            }
            let d0 = w.device(ep).unwrap().rstats().link.doorbells;
            let u0 = w.device(ep).unwrap().link().udp_stats();
            bar.wait();
            let t = Instant::now();
            let mut got = 0;
            while got < STREAM_MSGS {
                let c = next(&mut w, OpKind::Recv);
                got += 1;
                if got + 256 <= STREAM_MSGS {
                    let i = c.ctx as usize;
                    w.post_recv(ep, &mut mrs[i], 0..64, 0, 0, i as u64).unwrap();
                }
            }
            let el = t.elapsed();
            let d = w.device(ep).unwrap().rstats().link.doorbells - d0;
            let u = w.device(ep).unwrap().link().udp_stats();
            finish(w, ep, &bar);
            (el, d, (u.tx_doorbells - u0.tx_doorbells, u.rx_doorbells - u0.rx_doorbells))
        });
        let (mut w, ep) = worker(a);
        let mr = MemoryRegion::new(64).unwrap();
        let d0 = w.device(ep).unwrap().rstats().link.doorbells;
        let u0 = w.device(ep).unwrap().link().udp_stats();
        bar.wait();
        let mut posted = 0;
        let mut done = 0;
        while done < STREAM_MSGS {
            while posted < STREAM_MSGS && posted - done < 1024 {
                w.post_send(ep, &mr, 0..64, 0, 0).unwrap();
                posted += 1;
            }
            while let Some(c) = w.poll() {
                assert_eq!(c.status, Status::Ok);
                done += 1;
            }
        }
        let d = w.device(ep).unwrap().rstats().link.doorbells - d0;
        let u = w.device(ep).unwrap().link().udp_stats();
        finish(w, ep, &bar);
        let (el, rd, (rtx, rrx)) = rx.join().unwrap();
        let per = |n: u64| n as f64 / STREAM_MSGS as f64;
        println!(
            "  64B stream doorbells/msg: sender {:.3} (submitting {:.3}, receive-only {:.3}), receiver {:.3} (submitting {:.3}, receive-only {:.3})",
            per(d),
            per(u.tx_doorbells - u0.tx_doorbells),
            per(u.rx_doorbells - u0.rx_doorbells),
            per(rd),
            per(rtx),
            per(rrx)
        );
        (
            d as f64 / STREAM_MSGS as f64,
            (d + rd) as f64 / STREAM_MSGS as f64,
            STREAM_MSGS as f64 / el.as_secs_f64(),
        )
    });
    Ok(r)
}

fn main() -> Res<()> {
    let rounds: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(3);
    let pair = VethPair::create()?;
    let probe = UdpLink::from_socket(pair.udp_pair(false)?.0, &UdpConfig::from_env()?)?;
    println!(
        "veth pair {} <-> {}; strait-udp backend {:?} [{}], datagram {} B",
        pair.ns[0],
        pair.ns[1],
        probe.backend(),
        probe.features(),
        strait_core::Link::mtu(&probe)
    );
    drop(probe);
    if std::env::args().nth(2).as_deref() == Some("stream") {
        // The 64-byte stream alone (for `perf stat -e 'syscalls:sys_enter_*'`).
        for r in 0..rounds {
            let (d_tx, d_all, mps) = strait_stream(&pair)?;
            println!("round {r}: 64B stream {mps:.0} msg/s, doorbells/msg {d_tx:.3} sender {d_all:.3} both");
        }
        return Ok(());
    }
    let (mut s_med, mut s_p99, mut k_med, mut k_p99) = (vec![], vec![], vec![], vec![]);
    let (mut s_bw, mut t_bw, mut l_bw, mut dpd, mut retx) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut dpm_tx, mut dpm, mut rate) = (vec![], vec![], vec![]);
    for r in 0..rounds {
        let mut s = strait_pingpong(&pair)?;
        let mut k = kernel_udp_pingpong(&pair)?;
        let sb = strait_bulk(&pair)?;
        let tb = kernel_tcp_bulk(&pair, BULK_MSGS)?;
        let (d_tx, d_all, mps) = strait_stream(&pair)?;
        pair.set_loss(0, 0.01)?;
        pair.set_loss(1, 0.01)?;
        let lb = strait_bulk(&pair);
        pair.set_loss(0, 0.0)?;
        pair.set_loss(1, 0.0)?;
        let lb = lb?;
        println!(
            "round {r}: 8B one-way strait {:.1}/{:.1} us kernel-udp {:.1}/{:.1} us (median/p99) | 1MiB strait {:.2} Gb/s tcp {:.2} Gb/s, 1% loss {:.2} Gb/s ({} retx) | doorbells/datagram {:.3} | 64B stream {:.0} msg/s, doorbells/msg {:.3} sender {:.3} both",
            pct(&mut s, 0.5) / 1e3,
            pct(&mut s, 0.99) / 1e3,
            pct(&mut k, 0.5) / 1e3,
            pct(&mut k, 0.99) / 1e3,
            sb.gbps,
            tb,
            lb.gbps,
            lb.retransmits,
            sb.doorbells_per_datagram,
            mps,
            d_tx,
            d_all
        );
        s_med.push(pct(&mut s, 0.5));
        s_p99.push(pct(&mut s, 0.99));
        k_med.push(pct(&mut k, 0.5));
        k_p99.push(pct(&mut k, 0.99));
        s_bw.push(sb.gbps);
        t_bw.push(tb);
        l_bw.push(lb.gbps);
        dpd.push(sb.doorbells_per_datagram);
        retx.push(lb.retransmits as f64);
        dpm_tx.push(d_tx);
        dpm.push(d_all);
        rate.push(mps);
    }
    let (sm, km) = (median(s_med), median(k_med));
    let (sb, tb, lb) = (median(s_bw), median(t_bw), median(l_bw));
    println!("\nmedians over {rounds} rounds:");
    println!("| measure | strait-udp | kernel | ratio | target |");
    println!("|---|---|---|---|---|");
    println!(
        "| 8 B one-way latency, median (p99) | {:.1} us ({:.1}) | UDP {:.1} us ({:.1}) | {:.2}x | < 1 |",
        sm / 1e3,
        median(s_p99) / 1e3,
        km / 1e3,
        median(k_p99) / 1e3,
        sm / km
    );
    println!("| 1 MiB streaming bandwidth | {sb:.2} Gb/s | TCP {tb:.2} Gb/s | {:.2}x | >= 1 |", sb / tb);
    println!("| same with 1% loss each way | {lb:.2} Gb/s | | {:.2}x of lossless | >= 0.7 |", lb / sb);
    println!(
        "| doorbells per 64 B message, streaming (sender; both sides) | {:.3}; {:.3} | | | < 0.1 |",
        median(dpm_tx),
        median(dpm)
    );
    println!("| doorbells per datagram, 1 MiB streaming (both sides) | {:.3} | | | |", median(dpd));
    println!("| 64 B messages per second, streaming | {:.0} | | | |", median(rate));
    println!("| retransmissions per 96 MiB with 1% loss | {:.0} | | | |", median(retx));
    Ok(())
}
