//! 1 MiB streaming bandwidth of the udp device against kernel TCP across a veth pair
//! between two network namespaces (made and removed here; needs root), in
//! interleaved rounds, with the reliability layer's counters: the focused form of
//! `veth_bench`'s bandwidth row, for profiling the bulk path.
//!
//! `cargo run --release -p strait-udp --example bulk_bench [-- ROUNDS [MESSAGES [only]]]`
//! (defaults 5 rounds of 256 messages; `only` skips kernel TCP, for a profiler).
//! `STRAIT_UDP_*` and `STRAIT_REL_*` variables apply.

use std::time::{Duration, Instant};

use strait_core::{MemoryRegion, OpKind, ReliableConfig, ReliableStats, Worker};
use strait_udp::netns::VethPair;
use strait_udp::{UdpConfig, UdpDevice, UdpLink};

mod common;
use common::{kernel_tcp_bulk, median, next, worker_on as worker, Res, MIB};

const DEPTH: usize = 8;

/// Streams `msgs` messages of 1 MiB, `DEPTH` outstanding: (Gb/s, sender's and
/// receiver's counters).
fn strait_bulk(pair: &VethPair, msgs: usize) -> Res<(f64, ReliableStats, ReliableStats)> {
    let (sa, sb) = pair.udp_pair(false)?;
    let c = UdpConfig::from_env()?;
    let r = ReliableConfig::from_env()?;
    // Each side sets up its link on its own thread, as separate processes do: an
    // io_uring request's work runs on the thread that submitted it.
    let dev = move |s: std::net::UdpSocket| UdpLink::from_socket(s, &c).expect("link").reliable(r.clone());
    let done = std::sync::atomic::AtomicUsize::new(0);
    let start = std::sync::Barrier::new(2);
    let finish = |mut w: Worker<UdpDevice>, ep| {
        done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        while done.load(std::sync::atomic::Ordering::SeqCst) < 2 {
            w.progress();
            std::thread::yield_now();
        }
        w.close(ep);
        w.linger(Duration::from_secs(1));
    };
    let r = std::thread::scope(|s| {
        let rx = s.spawn(|| {
            let (mut w, ep) = worker(dev(sb));
            let mut mrs: Vec<MemoryRegion> = (0..DEPTH).map(|_| MemoryRegion::new(MIB).unwrap()).collect();
            for (i, mr) in mrs.iter_mut().enumerate() {
                w.post_recv(ep, mr, 0..MIB, 0, 0, i as u64).unwrap();
            }
            start.wait();
            let t = Instant::now();
            let mut got = 0;
            while got < msgs {
                let c = next(&mut w, OpKind::Recv);
                got += 1;
                if got + DEPTH <= msgs {
                    let i = c.ctx as usize;
                    w.post_recv(ep, &mut mrs[i], 0..MIB, 0, 0, i as u64).unwrap();
                }
            }
            let el = t.elapsed();
            let st = w.device(ep).unwrap().rstats();
            finish(w, ep);
            (el, st)
        });
        let (mut w, ep) = worker(dev(sa));
        let mrs: Vec<MemoryRegion> = (0..DEPTH).map(|_| MemoryRegion::new(MIB).unwrap()).collect();
        start.wait();
        for (i, mr) in mrs.iter().enumerate() {
            w.post_send(ep, mr, 0..MIB, 0, i as u64).unwrap();
        }
        let mut sent = 0;
        while sent < msgs {
            let c = next(&mut w, OpKind::Send);
            sent += 1;
            if sent + DEPTH <= msgs {
                w.post_send(ep, &mrs[c.ctx as usize], 0..MIB, 0, c.ctx).unwrap();
            }
        }
        let st = w.device(ep).unwrap().rstats();
        finish(w, ep);
        let (el, rst) = rx.join().unwrap();
        ((msgs * MIB) as f64 * 8.0 / el.as_secs_f64() / 1e9, st, rst)
    });
    Ok(r)
}

fn main() -> Res<()> {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let msgs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    let only = args.next().is_some_and(|a| a == "only");
    let pair = VethPair::create()?;
    let probe = UdpLink::from_socket(pair.udp_pair(false)?.0, &UdpConfig::from_env()?)?;
    println!(
        "strait-udp backend {:?} [{}], datagram {} B, {msgs} x 1 MiB, {DEPTH} outstanding",
        probe.backend(),
        probe.features(),
        strait_core::Link::mtu(&probe)
    );
    drop(probe);
    let (mut s_bw, mut t_bw, mut ratio) = (vec![], vec![], vec![]);
    for r in 0..rounds {
        let (sb, st, rst) = strait_bulk(&pair, msgs)?;
        let tb = if only { f64::NAN } else { kernel_tcp_bulk(&pair, msgs)? };
        let dg = st.link.datagrams_sent.max(1) as f64;
        println!(
            "round {r}: strait {sb:.2} Gb/s tcp {tb:.2} Gb/s ratio {:.2} | sender: {} pkts, {} acks, {} retx (fast {}), srtt {} us, doorbells/dg {:.3}, send_full {} | receiver: {} acks sent, {} ooo, {} dup, {} dg rx",
            sb / tb,
            st.packets_sent,
            st.acks_sent,
            st.timeout_retransmits + st.fast_retransmits,
            st.fast_retransmits,
            st.srtt_ns / 1000,
            (st.link.doorbells + rst.link.doorbells) as f64 / dg,
            st.link.send_full,
            rst.acks_sent,
            rst.out_of_order,
            rst.duplicates,
            rst.link.datagrams_received,
        );
        s_bw.push(sb);
        t_bw.push(tb);
        ratio.push(sb / tb);
    }
    println!(
        "medians over {rounds} rounds: strait-udp {:.2} Gb/s, kernel TCP {:.2} Gb/s, ratio {:.2}",
        median(s_bw),
        median(t_bw),
        median(ratio)
    );
    Ok(())
}
