//! A native-API peer over the xdp device, for tests and benchmarks run in network
//! namespaces (`ip netns exec NS strait-xdp-peer ...`).
//!
//! ```text
//! strait-xdp-peer echo   IF PEER_MAC                      answers every message with itself
//! strait-xdp-peer check  IF PEER_MAC SIZES ROUNDS [PPM]   sends, verifies the echo byte for byte
//! strait-xdp-peer pingpong IF PEER_MAC SIZE ITERS         one-way latency samples (ns), median/p99
//! strait-xdp-peer hold   IF SECONDS                        attaches, prints "attached", waits
//! strait-xdp-peer tcp-serve ADDR / tcp-hello ADDR          a kernel TCP exchange (other traffic)
//! ```
//! `STRAIT_XDP_DROP_PPM` makes the echo side drop that share of received frames.
//! `check` prints one line `ok messages=N retransmits=R ...` and exits 0 if every
//! echo matched; any failure exits 1 with the reason. Both sides stop by
//! themselves: the checker sends a final message with tag `u64::MAX`, and every wait
//! has a deadline.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use strait_core::{Completion, Config, EpId, MemoryRegion, OpKind, Reliable, ReliableConfig, Status, Worker};
use strait_sys::pattern;
use strait_xdp::{Mac, XdpConfig, XdpLink};

type W = Worker<Reliable<XdpLink>>;

const STOP: u64 = u64::MAX;
const DEADLINE: Duration = Duration::from_secs(20);

fn open(ifname: &str, peer: &str) -> Result<(W, EpId), String> {
    let peer: Mac = peer.parse().map_err(|e| format!("{e}"))?;
    let link = XdpLink::open(&XdpConfig::new(ifname), peer).map_err(|e| format!("{e}"))?;
    let mut cfg = Config::from_env().map_err(|e| e.to_string())?;
    cfg.spin = Duration::from_millis(5);
    let rcfg = ReliableConfig::from_env().map_err(|e| e.to_string())?;
    let mut w = Worker::new(cfg).map_err(|e| e.to_string())?;
    let ep = w.attach(Reliable::new(link, rcfg));
    Ok((w, ep))
}

fn wait_for(w: &mut W, what: &str, mut want: impl FnMut(&Completion) -> bool) -> Result<Completion, String> {
    let end = Instant::now() + DEADLINE;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("timed out waiting for {what}"));
        }
        match w.wait(Some(left)) {
            Ok(c) if want(&c) => return Ok(c),
            Ok(c) if c.status != Status::Ok => {
                let why = w
                    .device(c.ep)
                    .map(|d| {
                        format!(
                            "{}; {:?}; kernel {:?}",
                            d.failure().unwrap_or(""),
                            d.rstats(),
                            d.link().kernel_statistics().map(|s| (
                                s.rx_dropped,
                                s.rx_invalid_descs,
                                s.tx_invalid_descs,
                                s.rx_ring_full,
                                s.rx_fill_ring_empty_descs,
                                s.tx_ring_empty_descs
                            ))
                        )
                    })
                    .unwrap_or_default();
                return Err(format!("{what}: {:?} ({why})", c.status));
            }
            Ok(_) => {}
            Err(e) => return Err(format!("waiting for {what}: {e}")),
        }
    }
}

fn echo(ifname: &str, peer: &str) -> Result<String, String> {
    let (mut w, ep) = open(ifname, peer)?;
    let ppm = std::env::var("STRAIT_XDP_DROP_PPM").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    if let Some(d) = w.device(ep) {
        d.link().set_drop_ppm(ppm).map_err(|e| e.to_string())?;
    }
    let max = 4 << 20;
    let mut inbox = MemoryRegion::new(max).map_err(|e| e.to_string())?;
    let mut served = 0u64;
    loop {
        w.post_recv(ep, &mut inbox, 0..max, 0, 0, 1).map_err(|e| e.to_string())?;
        let c = wait_for(&mut w, "a message", |c| c.op == OpKind::Recv && c.status == Status::Ok)?;
        if c.tag == STOP {
            break;
        }
        w.post_send(ep, &inbox, 0..c.len, c.tag, 2).map_err(|e| e.to_string())?;
        wait_for(&mut w, "the echo's send", |c| c.op == OpKind::Send && c.status == Status::Ok)?;
        served += 1;
    }
    w.close(ep);
    w.linger(Duration::from_secs(2));
    Ok(format!("ok served={served}"))
}

fn check(ifname: &str, peer: &str, sizes: &str, rounds: u32, ppm: u32) -> Result<String, String> {
    let sizes: Vec<usize> = sizes
        .split(',')
        .map(|s| s.trim().parse().map_err(|_| format!("bad size {s:?}")))
        .collect::<Result<_, _>>()?;
    let (mut w, ep) = open(ifname, peer)?;
    if let Some(d) = w.device(ep) {
        d.link().set_drop_ppm(ppm).map_err(|e| e.to_string())?;
    }
    let max = sizes.iter().copied().max().unwrap_or(1).max(8);
    let mut inbox = MemoryRegion::new(max).map_err(|e| e.to_string())?;
    let mut outbox = MemoryRegion::new(max).map_err(|e| e.to_string())?;
    let mut n = 0u64;
    for r in 0..rounds {
        for &len in &sizes {
            let tag = (r as u64) << 32 | n;
            let data = pattern(tag, len);
            outbox.write_at(0, &data).map_err(|e| e.to_string())?;
            w.post_recv(ep, &mut inbox, 0..max, tag, u64::MAX, 1).map_err(|e| e.to_string())?;
            w.post_send(ep, &outbox, 0..len, tag, 2).map_err(|e| e.to_string())?;
            let (mut sent, mut got) = (false, None);
            while !sent || got.is_none() {
                let c = wait_for(&mut w, "the echo", |c| c.status == Status::Ok)?;
                match c.op {
                    OpKind::Send => sent = true,
                    OpKind::Recv => got = Some(c),
                }
            }
            let c = got.ok_or("no echo")?;
            if c.len != len {
                return Err(format!("message {n}: echo of {} bytes, sent {len}", c.len));
            }
            let mut back = vec![0u8; len];
            inbox.read_at(0, &mut back).map_err(|e| e.to_string())?;
            if back != data {
                return Err(format!("message {n} ({len} bytes): echo differs"));
            }
            n += 1;
        }
    }
    outbox.write_at(0, b"stop").map_err(|e| e.to_string())?;
    w.post_send(ep, &outbox, 0..4, STOP, 3).map_err(|e| e.to_string())?;
    wait_for(&mut w, "the stop message", |c| c.op == OpKind::Send)?;
    let s = w.device(ep).map(|d| d.rstats()).ok_or("no device")?;
    let mode = w.device(ep).map(|d| d.link().mode());
    w.close(ep);
    w.linger(Duration::from_secs(2));
    Ok(format!(
        "ok messages={n} retransmits={} fast={} bad_checksum={} mode={:?}",
        s.timeout_retransmits, s.fast_retransmits, s.bad_checksum, mode
    ))
}

fn pingpong(ifname: &str, peer: &str, size: usize, iters: u32) -> Result<String, String> {
    let (mut w, ep) = open(ifname, peer)?;
    let len = size.max(1);
    let mut inbox = MemoryRegion::new(len).map_err(|e| e.to_string())?;
    let outbox = MemoryRegion::new(len).map_err(|e| e.to_string())?;
    let mut samples = Vec::with_capacity(iters as usize);
    for i in 0..iters + 100 {
        w.post_recv(ep, &mut inbox, 0..len, 0, 0, 1).map_err(|e| e.to_string())?;
        let t = Instant::now();
        w.post_send(ep, &outbox, 0..size, 1, 2).map_err(|e| e.to_string())?;
        // Busy-poll: latency runs spin, as every contender in the comparison does.
        let end = t + DEADLINE;
        let mut got = false;
        while !got {
            if let Some(c) = w.poll() {
                if c.status != Status::Ok {
                    return Err(format!("{c:?}"));
                }
                got |= c.op == OpKind::Recv;
            } else if Instant::now() > end {
                return Err("timed out".into());
            }
        }
        if i >= 100 {
            samples.push(t.elapsed().as_nanos() as u64 / 2);
        }
    }
    let outbox2 = MemoryRegion::new(4).map_err(|e| e.to_string())?;
    w.post_send(ep, &outbox2, 0..4, STOP, 3).map_err(|e| e.to_string())?;
    wait_for(&mut w, "the stop message", |c| c.op == OpKind::Send)?;
    samples.sort_unstable();
    let q = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize];
    let s = w.device(ep).map(|d| d.rstats()).ok_or("no device")?;
    Ok(format!(
        "ok one_way_ns median={} p99={} n={} retransmits={} fast={} acks={} srtt_ns={}",
        q(0.5),
        q(0.99),
        samples.len(),
        s.timeout_retransmits,
        s.fast_retransmits,
        s.acks_sent,
        s.srtt_ns
    ))
}

fn hold(ifname: &str, secs: u32) -> Result<String, String> {
    let link = XdpLink::open(&XdpConfig::new(ifname), Mac::default()).map_err(|e| e.to_string())?;
    println!("attached mode={:?} generic={}", link.mode(), link.generic_xdp());
    std::thread::sleep(Duration::from_secs(secs.into()));
    Ok("ok released".into())
}

fn tcp_serve(addr: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind(addr).map_err(|e| e.to_string())?;
    println!("listening");
    let (mut s, _) = l.accept().map_err(|e| e.to_string())?;
    let mut b = [0u8; 5];
    s.read_exact(&mut b).map_err(|e| e.to_string())?;
    s.write_all(&b).map_err(|e| e.to_string())?;
    Ok("ok served".into())
}

fn tcp_hello(addr: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let a: std::net::SocketAddr = addr.parse().map_err(|_| format!("bad address {addr}"))?;
    let mut s =
        std::net::TcpStream::connect_timeout(&a, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    s.write_all(b"hello").map_err(|e| e.to_string())?;
    let mut b = [0u8; 5];
    s.read_exact(&mut b).map_err(|e| e.to_string())?;
    if &b != b"hello" {
        return Err("wrong reply".into());
    }
    Ok("ok hello".into())
}

fn main() -> ExitCode {
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize| a.get(i).map(String::as_str).unwrap_or("");
    let num = |i: usize, d: u32| arg(i).parse::<u32>().unwrap_or(d);
    let r = match arg(1) {
        "echo" => echo(arg(2), arg(3)),
        "check" => check(arg(2), arg(3), arg(4), num(5, 1), num(6, 0)),
        "pingpong" => pingpong(arg(2), arg(3), arg(4).parse().unwrap_or(8), num(5, 10_000)),
        "hold" => hold(arg(2), num(3, 5)),
        "tcp-serve" => tcp_serve(arg(2)),
        "tcp-hello" => tcp_hello(arg(2)),
        _ => Err("usage: strait-xdp-peer echo|check|pingpong|hold|tcp-serve|tcp-hello ...".into()),
    };
    match r {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("strait-xdp-peer: {e}");
            ExitCode::FAILURE
        }
    }
}
