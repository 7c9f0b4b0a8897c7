//! The multiplexer ([`XdpPort`], [`XdpChannel`]) across a veth pair joining two
//! network namespaces that each test creates and removes. One process: the threads
//! that open the ports enter the namespaces (`setns`), the ports' sockets stay
//! bound there, and any thread drives the channels.
//!
//! Needs root (namespaces, XDP). Every loop is bounded by a deadline.

mod common;
use common::Pair;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strait_core::{Device, Link, Reliable, ReliableConfig};
use strait_xdp::{XdpChannel, XdpConfig, XdpPort};

impl Pair {
    /// Runs `f` on a thread inside side `side`'s namespace (the project's one
    /// helper for that, `strait_sys::netns::within`).
    fn within<T: Send>(&self, side: usize, f: impl FnOnce() -> T + Send) -> T {
        strait_sys::netns::within(Some(&self.ns[side]), || Ok(f()))
            .unwrap_or_else(|e| panic!("entering namespace {}: {e}", self.ns[side]))
    }

    fn port(&self, side: usize) -> Arc<XdpPort> {
        let cfg = XdpConfig::for_port(&self.ifs[side]);
        self.within(side, || XdpPort::open(&cfg)).expect("open port")
    }
}

/// Opens `n` channel pairs between the two ports; returns (side 0, side 1) channels.
fn open_pairs(p: &Pair, ports: &[Arc<XdpPort>; 2], n: usize) -> (Vec<XdpChannel>, Vec<XdpChannel>) {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let (ia, ib) = (ports[0].new_channel_id(), ports[1].new_channel_id());
        assert!(ia != 0 && ib != 0);
        a.push(ports[0].channel(p.macs[1], ia, ib).expect("channel a"));
        b.push(ports[1].channel(p.macs[0], ib, ia).expect("channel b"));
    }
    (a, b)
}

fn rcfg() -> ReliableConfig {
    ReliableConfig { window: 128, ..ReliableConfig::default() }
}

/// Length and bytes of frame `k` of flow `seed`.
fn frame(seed: u64, k: u32) -> Vec<u8> {
    let len = 8 + ((k as usize * 7919 + seed as usize * 131) % 9000);
    let mut v: Vec<u8> = (0..len)
        .map(|i| {
            (seed.wrapping_mul(31)
                ^ (k as u64).wrapping_mul(7)
                ^ (i as u64).wrapping_mul(13)
                ^ (i as u64 >> 8)) as u8
        })
        .collect();
    v[..4].copy_from_slice(&k.to_le_bytes());
    v[4..8].copy_from_slice(&(seed as u32).to_le_bytes());
    v
}

/// One direction pair of a channel: sends `to_send` frames of its pattern, checks
/// `to_recv` frames of the peer's.
struct Flow {
    name: String,
    dev: Option<Reliable<XdpChannel>>,
    my_seed: u64,
    peer_seed: u64,
    to_send: u32,
    sent: u32,
    to_recv: u32,
    recvd: u32,
    next: Option<Vec<u8>>,
    /// Must finish for the test to pass; others are driven while they last.
    required: bool,
    /// Close the channel after receiving this many frames.
    close_after: Option<u32>,
    done: bool,
}

impl Flow {
    fn new(name: String, ch: XdpChannel, my_seed: u64, peer_seed: u64, frames: u32) -> Flow {
        Flow {
            name,
            dev: Some(Reliable::new(ch, rcfg())),
            my_seed,
            peer_seed,
            to_send: frames,
            sent: 0,
            to_recv: frames,
            recvd: 0,
            next: None,
            required: true,
            close_after: None,
            done: false,
        }
    }

    /// One pass: sends what the window allows, receives and checks what arrived.
    /// Returns whether anything moved.
    fn step(&mut self) -> Result<bool, String> {
        let Some(dev) = self.dev.as_mut() else { return Ok(false) };
        let mut progress = false;
        for _ in 0..64 {
            if self.sent >= self.to_send {
                break;
            }
            let data = self.next.take().unwrap_or_else(|| frame(self.my_seed, self.sent));
            match dev.send_frame(data.len(), &mut |w| w.write(0, &data)) {
                Ok(true) => {
                    self.sent += 1;
                    progress = true;
                }
                Ok(false) => {
                    self.next = Some(data);
                    break;
                }
                Err(e) => return Err(format!("{}: send: {e}", self.name)),
            }
        }
        for _ in 0..256 {
            let mut got: Option<Vec<u8>> = None;
            match dev.recv_frame(&mut |f| {
                let mut v = vec![0; f.len()];
                assert!(f.read(0, &mut v));
                got = Some(v);
            }) {
                Ok(true) => progress = true,
                Ok(false) => break,
                Err(e) => return Err(format!("{}: recv: {e}", self.name)),
            }
            if let Some(v) = got {
                let want = frame(self.peer_seed, self.recvd);
                if v != want {
                    return Err(format!(
                        "{}: frame {} corrupt or out of order ({} bytes, want {})",
                        self.name,
                        self.recvd,
                        v.len(),
                        want.len()
                    ));
                }
                self.recvd += 1;
            }
        }
        dev.doorbell().map_err(|e| format!("{}: doorbell: {e}", self.name))?;
        if self.close_after.is_some_and(|n| self.recvd >= n) {
            self.dev = None;
            return Ok(true);
        }
        Ok(progress)
    }

    fn finished(&self) -> bool {
        self.dev
            .as_ref()
            .is_some_and(|d| self.sent == self.to_send && self.recvd == self.to_recv && d.unacked() == 0)
    }
}

/// Drives `groups` (one thread each) until every required flow finished, or fails
/// after `limit`. Idle threads sleep on their channels' event fds.
fn drive(groups: Vec<Vec<Flow>>, limit: Duration) -> Vec<Vec<Flow>> {
    let required: usize = groups.iter().flatten().filter(|f| f.required).count();
    let done = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + limit;
    let handles: Vec<_> = groups
        .into_iter()
        .map(|mut flows| {
            let (done, failed) = (Arc::clone(&done), Arc::clone(&failed));
            std::thread::spawn(move || -> Result<Vec<Flow>, String> {
                while done.load(Ordering::Acquire) < required && failed.load(Ordering::Acquire) == 0 {
                    if Instant::now() > deadline {
                        failed.fetch_add(1, Ordering::AcqRel);
                        let state: Vec<String> = flows
                            .iter()
                            .map(|f| {
                                format!(
                                    "{} sent {}/{} recvd {}/{}",
                                    f.name, f.sent, f.to_send, f.recvd, f.to_recv
                                )
                            })
                            .collect();
                        return Err(format!("deadline: {state:?}"));
                    }
                    let mut progress = false;
                    for f in flows.iter_mut() {
                        match f.step() {
                            Ok(p) => progress |= p,
                            Err(e) if f.required => {
                                failed.fetch_add(1, Ordering::AcqRel);
                                return Err(e);
                            }
                            Err(_) => f.dev = None,
                        }
                        if f.required && !f.done && f.finished() {
                            f.done = true;
                            done.fetch_add(1, Ordering::AcqRel);
                        }
                    }
                    if !progress {
                        sleep(&mut flows);
                    }
                }
                Ok(flows)
            })
        })
        .collect();
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for h in handles {
        match h.join() {
            Ok(Ok(f)) => out.push(f),
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push("a driver thread panicked".into()),
        }
    }
    assert!(errors.is_empty(), "{errors:#?}");
    out
}

/// Arms every live channel and sleeps on their event fds (at most 2 ms: timers).
fn sleep(flows: &mut [Flow]) {
    let mut fds: Vec<RawFd> = Vec::new();
    let mut can_sleep = true;
    for f in flows.iter_mut() {
        if let Some(d) = f.dev.as_mut() {
            match d.arm_sleep() {
                Ok(true) => fds.extend(d.event_fd()),
                _ => can_sleep = false,
            }
        }
    }
    if can_sleep && !fds.is_empty() {
        let mut pfds: Vec<libc::pollfd> =
            fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
        // SAFETY: a live array of pollfd records and its length.
        unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 2) };
    }
    for f in flows.iter_mut() {
        if let Some(d) = f.dev.as_mut() {
            d.disarm_sleep();
        }
    }
}

/// Builds flows for channel pairs: flow `i` of side 0 and side 1 talk to each other.
fn flows(a: Vec<XdpChannel>, b: Vec<XdpChannel>, frames: u32) -> (Vec<Flow>, Vec<Flow>) {
    let mut fa = Vec::new();
    let mut fb = Vec::new();
    for (i, (ca, cb)) in a.into_iter().zip(b).enumerate() {
        let (sa, sb) = (100 + i as u64 * 2, 101 + i as u64 * 2);
        fa.push(Flow::new(format!("a{i}"), ca, sa, sb, frames));
        fb.push(Flow::new(format!("b{i}"), cb, sb, sa, frames));
    }
    (fa, fb)
}

/// Splits flows into `n` groups round-robin.
fn groups(flows: Vec<Flow>, n: usize) -> Vec<Vec<Flow>> {
    let mut g: Vec<Vec<Flow>> = (0..n).map(|_| Vec::new()).collect();
    for (i, f) in flows.into_iter().enumerate() {
        g[i % n].push(f);
    }
    g
}

#[test]
fn eight_reliable_channels_per_port_carry_patterned_data_under_loss() {
    let p = Pair::new("mx", 0x5b, 200);
    let ports = [p.port(0), p.port(1)];
    for port in &ports {
        port.set_drop_ppm(10_000).expect("loss");
    }
    let (a, b) = open_pairs(&p, &ports, 8);
    let (fa, fb) = flows(a, b, 300);
    let mut all = groups(fa, 3);
    all.extend(groups(fb, 3));
    let t = Instant::now();
    let out = drive(all, Duration::from_secs(18));
    let elapsed = t.elapsed();
    let mut bytes = 0usize;
    let mut retransmits = 0;
    for f in out.iter().flatten() {
        assert_eq!(f.recvd, f.to_recv, "{}", f.name);
        bytes += (0..f.recvd).map(|k| frame(f.peer_seed, k).len()).sum::<usize>();
        if let Some(d) = &f.dev {
            let s = d.rstats();
            retransmits += s.timeout_retransmits + s.fast_retransmits;
        }
    }
    let (sa, sb) = (ports[0].stats(), ports[1].stats());
    println!(
        "16 flows, {bytes} bytes checked in {:.2?} ({:.1} MB/s), retransmits {retransmits}, port a {sa:?}, port b {sb:?}",
        elapsed,
        bytes as f64 / elapsed.as_secs_f64() / 1e6
    );
    assert!(retransmits > 0, "no loss was repaired");
    assert_eq!(sa.unknown_channel + sb.unknown_channel + sa.strays + sb.strays, 0);
    assert_eq!(sa.channels, 8);
    drop(out);
    assert_eq!(ports[0].stats().channels, 0, "closing channels frees their ids");
    drop(ports);
    assert!(p.detached_soon(), "dropping the last port detaches the program");
}

/// Raw frames through a channel's `Link` methods, `n` of them.
fn blast(ch: &mut XdpChannel, n: u32) {
    let mut sent = 0;
    for _ in 0..n * 10 {
        if sent == n {
            break;
        }
        if let Some(s) = ch.tx_alloc() {
            ch.tx_buf(s)[..5].copy_from_slice(b"stray");
            if ch.send(s, 64).expect("send") {
                sent += 1;
            }
            ch.tx_release(s);
        }
        ch.flush().expect("flush");
    }
    assert_eq!(sent, n);
}

#[test]
fn unknown_channels_and_strays_are_dropped_and_counted_while_ip_works() {
    let p = Pair::new("mx", 0x5b, 200);
    let ports = [p.port(0), p.port(1)];
    let (a, b) = open_pairs(&p, &ports, 2);
    let known_b = b[0].local_id();
    // A channel to an id side 1 never opened, and one that names a real channel of
    // side 1 but is not its peer.
    let mut unknown = ports[0].channel(p.macs[1], ports[0].new_channel_id(), 0x5eed_0001).expect("chan");
    let mut stray = ports[0].channel(p.macs[1], ports[0].new_channel_id(), known_b).expect("chan");
    // Kernel TCP across the same interfaces meanwhile.
    let addr = format!("{}:7781", p.ips[1]);
    let listener = p.within(1, || std::net::TcpListener::bind(&addr)).expect("listen");
    let server = std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
        let (mut s, _) = listener.accept()?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut buf = vec![0u8; 100_000];
        s.read_exact(&mut buf)?;
        s.write_all(b"ok")?;
        Ok(buf)
    });
    let client = p.within(0, || {
        blast(&mut unknown, 200);
        blast(&mut stray, 50);
        let mut s =
            std::net::TcpStream::connect_timeout(&addr.parse().expect("addr"), Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        s.write_all(&data)?;
        let mut ok = [0u8; 2];
        s.read_exact(&mut ok)?;
        blast(&mut unknown, 100);
        Ok::<_, std::io::Error>(ok)
    });
    assert_eq!(&client.expect("kernel TCP through the interfaces"), b"ok");
    let got = server.join().expect("server thread").expect("server");
    assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
    // The real channels still work: drive them (the polls also sort the strays).
    let (fa, fb) = flows(a, b, 40);
    let out = drive(vec![fa, fb], Duration::from_secs(15));
    assert!(out.iter().flatten().all(|f| f.recvd == f.to_recv));
    let s = ports[1].stats();
    println!("port b {s:?}");
    assert_eq!(s.unknown_channel, 300, "{s:?}");
    assert_eq!(s.strays, 50, "{s:?}");
    let dropped: u64 =
        out[1].iter().filter_map(|f| f.dev.as_ref()).map(|d| d.link().stats().datagrams_dropped).sum();
    assert_eq!(dropped, 50, "strays count against the channel they named");
}

#[test]
fn a_closed_channel_does_not_disturb_the_others() {
    let p = Pair::new("mx", 0x5b, 200);
    let ports = [p.port(0), p.port(1)];
    let (a, b) = open_pairs(&p, &ports, 4);
    let closed_id = b[0].local_id();
    let (mut fa, mut fb) = flows(a, b, 150);
    // Side 1 closes channel 0 early; side 0 keeps sending on it (and eventually
    // gives up). Neither is required to finish.
    fa[0].required = false;
    fb[0].required = false;
    fb[0].close_after = Some(10);
    let mut all = groups(fa, 2);
    all.extend(groups(fb, 2));
    let out = drive(all, Duration::from_secs(18));
    let by_name: HashMap<&str, &Flow> = out.iter().flatten().map(|f| (f.name.as_str(), f)).collect();
    for i in 1..4 {
        for side in ["a", "b"] {
            let f = by_name[format!("{side}{i}").as_str()];
            assert_eq!(f.recvd, f.to_recv, "{}", f.name);
        }
    }
    assert!(by_name["b0"].dev.is_none(), "channel b0 was closed");
    let s = ports[1].stats();
    println!("port b {s:?}");
    assert!(s.unknown_channel > 0, "side 0 kept sending to the closed channel: {s:?}");
    assert_eq!(s.channels, 3);
    // The closed id can be opened again.
    let again = ports[1].channel(p.macs[0], closed_id, 77).expect("reopen a closed id");
    drop(again);
}

/// Ping-pong rounds: each round side 0 sends one 32-byte frame on every device and
/// waits for all the echoes from side 1 (both sides busy-poll, one thread each).
/// Returns the median and 99th percentile of half a round, in nanoseconds.
fn rounds<L: Link + Send + 'static>(a: Vec<Reliable<L>>, b: Vec<Reliable<L>>, iters: u32) -> (u64, u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let total = b.len() as u32 * (iters + 200);
    let echo = std::thread::spawn(move || {
        let mut b = b;
        let mut echoed = 0;
        while echoed < total && Instant::now() < deadline {
            for d in b.iter_mut() {
                let mut got: Option<Vec<u8>> = None;
                if d.recv_frame(&mut |f| {
                    let mut v = vec![0; f.len()];
                    f.read(0, &mut v);
                    got = Some(v);
                })
                .expect("echo recv")
                {
                    if let Some(v) = got {
                        while !d.send_frame(v.len(), &mut |w| w.write(0, &v)).expect("echo send") {
                            d.recv_frame(&mut |_| {}).expect("echo drain");
                        }
                        echoed += 1;
                    }
                }
                d.doorbell().expect("echo doorbell");
            }
        }
        // Linger so the last acknowledgements get out.
        let end = Instant::now() + Duration::from_millis(50);
        while Instant::now() < end {
            for d in b.iter_mut() {
                let _ = d.recv_frame(&mut |_| {});
                let _ = d.doorbell();
            }
        }
        let r: u64 = b.iter().map(|d| d.rstats().timeout_retransmits + d.rstats().fast_retransmits).sum();
        (echoed, r)
    });
    let mut a = a;
    let msg = [7u8; 32];
    let mut samples = Vec::new();
    for i in 0..iters + 200 {
        let t = Instant::now();
        for d in a.iter_mut() {
            while !d.send_frame(msg.len(), &mut |w| w.write(0, &msg)).expect("send") {
                d.recv_frame(&mut |_| {}).expect("recv");
                assert!(Instant::now() < deadline, "ping-pong setup timed out");
            }
            d.doorbell().expect("doorbell");
        }
        let mut pending = a.len();
        let mut got = vec![false; a.len()];
        while pending > 0 {
            assert!(Instant::now() < deadline, "ping-pong timed out");
            for (k, d) in a.iter_mut().enumerate() {
                let mut frame = false;
                d.recv_frame(&mut |_| frame = true).expect("recv");
                if frame && !got[k] {
                    got[k] = true;
                    pending -= 1;
                }
            }
        }
        if i >= 200 {
            samples.push(t.elapsed().as_nanos() as u64 / 2);
        }
    }
    let (echoed, rb) = echo.join().expect("echo thread");
    assert_eq!(echoed, total);
    let ra: u64 = a.iter().map(|d| d.rstats().timeout_retransmits + d.rstats().fast_retransmits).sum();
    samples.sort_unstable();
    (samples[samples.len() / 2], samples[samples.len() * 99 / 100], ra + rb)
}

/// Not a pass/fail test: prints one-way latencies of an `XdpLink` pair, one channel
/// pair and eight channel pairs driven together (`--ignored --nocapture`).
#[test]
#[ignore]
fn latency_of_channels_against_xdp_link() {
    let p = Pair::new("mx", 0x5b, 200);
    let iters = 3000;
    let rel = || ReliableConfig { window: 128, ..ReliableConfig::default() };
    {
        let cfg = [XdpConfig::new(&p.ifs[0]), XdpConfig::new(&p.ifs[1])];
        let la = p.within(0, || strait_xdp::XdpLink::open(&cfg[0], p.macs[1])).expect("link a");
        let lb = p.within(1, || strait_xdp::XdpLink::open(&cfg[1], p.macs[0])).expect("link b");
        let (m, p99, r) = rounds(vec![Reliable::new(la, rel())], vec![Reliable::new(lb, rel())], iters);
        println!("XdpLink:       one-way median {m} ns p99 {p99} ns, retransmits {r}");
    }
    let ports = [p.port(0), p.port(1)];
    for n in [1usize, 8] {
        let (a, b) = open_pairs(&p, &ports, n);
        let a = a.into_iter().map(|c| Reliable::new(c, rel())).collect();
        let b = b.into_iter().map(|c| Reliable::new(c, rel())).collect();
        let (m, p99, r) = rounds(a, b, iters);
        println!("{n} channel(s): half a round median {m} ns p99 {p99} ns, retransmits {r}");
    }
}
