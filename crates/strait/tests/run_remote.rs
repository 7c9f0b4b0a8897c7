//! Unchanged TCP programs between two hosts (two network namespaces joined by a veth
//! pair that each test creates and removes), both ends under `strait run --peers`:
//! the connection rides strait's reliable udp device. One end without strait, or a
//! peer not listed, stays on the kernel and still works. A peer killed mid-transfer
//! ends in an error, not a hang. Needs root (namespaces).

mod common;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{ensure, preload_lib, run_for, STRAIT};
use strait_udp::netns::VethPair;

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Two hosts: namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2), removed
/// on drop.
struct Hosts {
    pair: VethPair,
    subnet: String,
    addr: [String; 2],
}

impl Hosts {
    fn create() -> Hosts {
        let pair = VethPair::create().expect("create namespaces (needs root)");
        let subnet = pair.subnet_v4();
        let addr = [pair.v4[0].to_string(), pair.v4[1].to_string()];
        Hosts { pair, subnet, addr }
    }

    /// `prog args` in namespace `i`, under `strait run --stats --peers SUBNET` if
    /// `strait`, else plain.
    fn cmd(&self, i: usize, strait: bool, prog: &str, args: &[&str]) -> Command {
        self.cmd_with(i, strait, &[], prog, args)
    }

    /// As [`Hosts::cmd`], with more `strait run` flags.
    fn cmd_with(&self, i: usize, strait: bool, flags: &[&str], prog: &str, args: &[&str]) -> Command {
        let mut c = self.pair.command(i);
        c.env_remove("LD_PRELOAD");
        if strait {
            preload_lib();
            c.args([STRAIT, "run", "--stats", "--peers", &self.subnet]).args(flags).arg("--");
        }
        c.arg(prog).args(args);
        c
    }

    fn spawn(&self, i: usize, strait: bool, prog: &str, args: &[&str]) -> Killed {
        self.spawn_with(i, strait, &[], prog, args)
    }

    /// A server in namespace `i`, its output discarded, killed on drop.
    fn spawn_with(&self, i: usize, strait: bool, flags: &[&str], prog: &str, args: &[&str]) -> Killed {
        Killed(
            self.cmd_with(i, strait, flags, prog, args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn server"),
        )
    }

    /// Waits until a TCP port listens in namespace `i`.
    fn wait_listening(&self, i: usize, port: u16) {
        let end = Instant::now() + Duration::from_secs(15);
        loop {
            let o = self.pair.exec(i, &["ss", "-Htln", &format!("sport = :{port}")]).expect("ss");
            if !String::from_utf8_lossy(&o.stdout).trim().is_empty() {
                return;
            }
            assert!(Instant::now() < end, "nothing listens on port {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr)
}

/// Sum of the `remote N` counts of the stats lines.
fn remote(text: &str) -> usize {
    stat(text, " remote ")
}

/// Sum of the `remote-xdp N` counts (connections on the xdp device).
fn remote_xdp(text: &str) -> usize {
    stat(text, " remote-xdp ")
}

fn stat(text: &str, key: &str) -> usize {
    text.lines().filter_map(|l| l.split(key).nth(1)?.split_whitespace().next()?.parse::<usize>().ok()).sum()
}

fn number_after(text: &str, key: &str) -> Option<f64> {
    text.split(key)
        .nth(1)?
        .split_whitespace()
        .next()?
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .ok()
}

#[test]
fn sockperf_tcp_between_hosts_rides_strait_and_plain_ends_fall_back() {
    ensure("sockperf", "sockperf");
    let h = Hosts::create();
    let _server = h.spawn(0, true, "sockperf", &["sr", "--tcp", "-i", &h.addr[0], "-p", "11201"]);
    h.wait_listening(0, 11201);
    let args = ["pp", "--tcp", "-i", &h.addr[0], "-p", "11201", "-t", "1", "-m", "14", "--mps", "5000000"];
    // Both ends under strait: carried by the udp device.
    let o =
        run_for(&mut h.cmd(1, true, "sockperf", &args), Duration::from_secs(30)).expect("sockperf finished");
    let t = text(&o);
    assert!(o.status.success() && t.contains("Summary: Latency is"), "{t}");
    assert_eq!(remote(&t), 1, "{t}");
    assert!(number_after(&t, "percentile 50.000 =").is_some_and(|v| v > 0.0), "{t}");
    // A client without strait: the strait server serves it through the kernel.
    let o =
        run_for(&mut h.cmd(1, false, "sockperf", &args), Duration::from_secs(30)).expect("sockperf finished");
    let t = text(&o);
    assert!(o.status.success() && t.contains("Summary: Latency is"), "{t}");

    // A server without strait: the strait client's HELLO meets a closed port (ICMP),
    // and the connection stays on the kernel at once.
    let _plain = h.spawn(0, false, "sockperf", &["sr", "--tcp", "-i", &h.addr[0], "-p", "11202"]);
    h.wait_listening(0, 11202);
    let args = ["pp", "--tcp", "-i", &h.addr[0], "-p", "11202", "-t", "1", "-m", "14"];
    let started = Instant::now();
    let o =
        run_for(&mut h.cmd(1, true, "sockperf", &args), Duration::from_secs(30)).expect("sockperf finished");
    let t = text(&o);
    assert!(o.status.success() && t.contains("Summary: Latency is"), "{t}");
    assert_eq!(remote(&t), 0, "{t}");
    assert!(started.elapsed() < Duration::from_secs(10), "fallback took {:?}", started.elapsed());
}

/// A Python function for the scripts below (put before their text):
/// `accept_one(addr, port, backlog)` listens on `addr:port` and returns the first
/// connection accepted and the listening socket (kept open by the caller).
const PY_ACCEPT_ONE: &str = r#"import socket
def accept_one(addr, port, backlog):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(backlog)
    c, _ = s.accept()
    return c, s
"#;

/// A sink and a source of a hashed pattern (after [`PY_ACCEPT_ONE`]).
const HASHED: &str = r#"import hashlib, socket, sys
mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def pattern(i):
    return hashlib.sha256(i.to_bytes(8, "little")).digest() * 2048
if mode == "sink":
    c, s = accept_one(addr, port, 4)
    h, n = hashlib.sha256(), 0
    while True:
        d = c.recv(1 << 20)
        if not d:
            break
        h.update(d)
        n += len(d)
    c.sendall(("%d %s\n" % (n, h.hexdigest())).encode())
    c.close()
else:
    total = int(sys.argv[4])
    c = socket.create_connection((addr, port))
    h, n, i = hashlib.sha256(), 0, 0
    while n < total:
        b = pattern(i)[: total - n]
        c.sendall(b)
        h.update(b)
        n += len(b)
        i += 1
    c.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        d = c.recv(4096)
        if not d:
            break
        reply += d
    print("sent %d %s" % (n, h.hexdigest()))
    print("sink " + reply.decode().strip())
"#;

#[test]
fn iperf3_and_a_hashed_transfer_between_hosts_under_strait() {
    ensure("iperf3", "iperf3");
    let h = Hosts::create();
    let _server = h.spawn(0, true, "iperf3", &["-s", "-p", "5211", "-B", &h.addr[0]]);
    h.wait_listening(0, 5211);
    let o = run_for(
        &mut h.cmd(1, true, "iperf3", &["-c", &h.addr[0], "-p", "5211", "-n", "100M", "-J"]),
        Duration::from_secs(60),
    )
    .expect("iperf3 finished");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("iperf3 JSON");
    let sent = v["end"]["sum_sent"]["bytes"].as_u64().expect("bytes sent");
    let received = v["end"]["sum_received"]["bytes"].as_u64().expect("bytes received");
    assert_eq!(sent, 100 << 20);
    // iperf3's server stops counting at the client's TEST_END (bytes in flight are
    // not reported, over the kernel too); the bytes themselves are checked below.
    assert!(received <= sent && received >= sent / 2, "received {received} of {sent}");
    assert_eq!(remote(&String::from_utf8_lossy(&o.stderr)), 2, "control and data connections");

    // Every byte, hashed at both ends (iperf3's own -F file mode rewrites blocks on
    // the receiving side even over the kernel, so it cannot check content).
    let script = std::env::temp_dir().join(format!("strait-hashed-{}.py", std::process::id()));
    std::fs::write(&script, [PY_ACCEPT_ONE, HASHED].concat()).expect("write script");
    let s = script.to_str().expect("utf-8 path");
    for (strait_sink, strait_source) in [(true, true), (true, false), (false, true)] {
        let t = hashed_transfer(&h, s, [strait_sink, strait_source], &[], 5212, 60_000_000);
        assert_eq!(remote(&t), usize::from(strait_sink && strait_source), "{t}");
        // The sink exits after one connection; the port is free for the next round.
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = std::fs::remove_file(&script);
}

#[test]
fn redis_between_hosts_under_strait() {
    ensure("redis-server", "redis-server");
    ensure("redis-benchmark", "redis-tools");
    let h = Hosts::create();
    let _server = h.spawn(
        0,
        true,
        "redis-server",
        &[
            "--port",
            "6411",
            "--bind",
            &h.addr[0],
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ],
    );
    h.wait_listening(0, 6411);
    let o = run_for(
        &mut h.cmd(
            1,
            true,
            "redis-benchmark",
            &["-h", &h.addr[0], "-p", "6411", "-n", "20000", "-c", "10", "-t", "set,get", "-q"],
        ),
        Duration::from_secs(120),
    )
    .expect("redis-benchmark finished");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for op in ["SET:", "GET:"] {
        assert!(t.lines().any(|l| l.contains(op) && l.contains("requests per second")), "{op} missing: {t}");
    }
    assert!(remote(&t) >= 10, "{t}");
    // A value written through strait reads back through the kernel, and the other way.
    let cli = |strait: bool, args: &[&str]| {
        let mut a = vec!["-h", h.addr[0].as_str(), "-p", "6411"];
        a.extend_from_slice(args);
        let o = run_for(&mut h.cmd(1, strait, "redis-cli", &a), Duration::from_secs(30)).expect("redis-cli");
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    assert_eq!(cli(true, &["set", "k1", "through-strait"]), "OK");
    assert_eq!(cli(false, &["get", "k1"]), "through-strait");
    assert_eq!(cli(false, &["set", "k2", "through-the-kernel"]), "OK");
    assert_eq!(cli(true, &["get", "k2"]), "through-the-kernel");
}

/// Streams `bytes` patterned bytes from namespace 1 to a sink in namespace 0 (each
/// under strait with `flags` if its `strait` is set), and checks that the sink's
/// count and hash are the source's. Returns the source's output.
fn hashed_transfer(
    h: &Hosts,
    script: &str,
    strait: [bool; 2],
    flags: &[&str],
    port: u16,
    bytes: usize,
) -> String {
    let port = port.to_string();
    let _sink = h.spawn_with(0, strait[0], flags, "python3", &[script, "sink", &h.addr[0], &port]);
    h.wait_listening(0, port.parse().expect("port"));
    let o = run_for(
        &mut h.cmd_with(
            1,
            strait[1],
            flags,
            "python3",
            &[script, "source", &h.addr[0], &port, &bytes.to_string()],
        ),
        Duration::from_secs(60),
    )
    .expect("transfer finished");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let sent = t.lines().find_map(|l| l.strip_prefix("sent ")).expect("sent line");
    let sink = t.lines().find_map(|l| l.strip_prefix("sink ")).expect("sink line");
    assert_eq!(sent, sink, "sink under strait {}, source {}: {t}", strait[0], strait[1]);
    t
}

/// `serve ADDR PORT`: accepts one connection after another, reads each to its end
/// and closes it. `fill ADDR PORT N`: opens N connections to it one after another,
/// ends each first and closes it after the server's close came (so each local port
/// stays in TIME_WAIT, as a client of `Connection: close` requests leaves it), then
/// prints how many TIME_WAIT sockets this namespace holds.
const TIME_WAIT_FILL: &str = r#"import socket, sys
mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "serve":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(128)
    while True:
        c, _ = s.accept()
        c.settimeout(10)
        while c.recv(4096):
            pass
        c.close()
else:
    for _ in range(int(sys.argv[4])):
        c = socket.create_connection((addr, port), timeout=10)
        c.shutdown(socket.SHUT_WR)
        assert c.recv(1) == b"", "bytes from the server"
        c.close()
    tw = sum(1 for line in open("/proc/net/tcp").readlines()[1:] if line.split()[3] == "06")
    print("TIME_WAIT", tw, flush=True)
"#;

/// The client host's local port range (64 ports) is full of TIME_WAIT connections
/// towards one port of the server host; a connection to another port there, under
/// `strait run --peers` at both ends, is made (the kernel's `connect` reuses a
/// TIME_WAIT port towards another destination, where a `bind` to an ephemeral port
/// finds none) and carried by strait, every byte intact.
#[test]
fn a_connection_between_hosts_is_carried_when_every_local_port_is_in_time_wait() {
    let h = Hosts::create();
    let ports = 64;
    h.pair
        .exec(1, &["sh", "-c", "echo 40000 40063 > /proc/sys/net/ipv4/ip_local_port_range"])
        .expect("port range");
    let script = std::env::temp_dir().join(format!("strait-tw-{}.py", std::process::id()));
    std::fs::write(&script, [PY_ACCEPT_ONE, HASHED].concat()).expect("write script");
    let fill = std::env::temp_dir().join(format!("strait-tw-fill-{}.py", std::process::id()));
    std::fs::write(&fill, TIME_WAIT_FILL).expect("write script");
    let (s, f) = (script.to_str().expect("utf-8 path"), fill.to_str().expect("utf-8 path"));
    let _server = h.spawn(0, false, "python3", &[f, "serve", &h.addr[0], "5215"]);
    h.wait_listening(0, 5215);
    let o = run_for(
        &mut h.cmd(1, false, "python3", &[f, "fill", &h.addr[0], "5215", &ports.to_string()]),
        Duration::from_secs(60),
    )
    .expect("fill finished");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let tw: usize =
        t.lines().find_map(|l| l.strip_prefix("TIME_WAIT ")).and_then(|n| n.trim().parse().ok()).unwrap_or(0);
    assert!(tw >= ports, "the client's ports are not all in TIME_WAIT ({tw}): {t}");
    // The kernel alone connects (to another destination), and so does strait.
    let t = hashed_transfer(&h, s, [false, false], &[], 5216, 1_000_000);
    assert_eq!(remote(&t), 0, "{t}");
    let started = Instant::now();
    let t = hashed_transfer(&h, s, [true, true], &[], 5217, 10_000_000);
    assert_eq!(remote(&t), 1, "not carried by strait: {t}");
    assert_eq!(stat(&t, " kernel-fallback "), 0, "{t}");
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
    let _ = std::fs::remove_file(&script);
    let _ = std::fs::remove_file(&fill);
}

/// A reader that stops reading and a writer that keeps writing (after
/// [`PY_ACCEPT_ONE`]).
const STREAMER: &str = r#"import socket, sys, time
mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "reader":
    c, s = accept_one(addr, port, 1)
    c.recv(1 << 16)
    print("READING", flush=True)
    time.sleep(600)
else:
    c = socket.create_connection((addr, port))
    block = b"x" * 65536
    started = time.time()
    try:
        while time.time() - started < 60:
            c.sendall(block)
        print("NO ERROR")
    except OSError as e:
        print("ERROR %s after %.1f s" % (type(e).__name__, time.time() - started))
"#;

/// The reading end is killed while the writer streams: the writer's next writes
/// fail (the peer stops answering: liveness), well before its own 60 s limit.
#[test]
fn a_peer_killed_mid_transfer_ends_in_an_error_not_a_hang() {
    let h = Hosts::create();
    let script = std::env::temp_dir().join(format!("strait-streamer-{}.py", std::process::id()));
    std::fs::write(&script, [PY_ACCEPT_ONE, STREAMER].concat()).expect("write script");
    let s = script.to_str().expect("utf-8 path");
    let mut reader = h
        .cmd(0, true, "python3", &[s, "reader", &h.addr[0], "5213"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("reader");
    h.wait_listening(0, 5213);
    let writer = h
        .cmd(1, true, "python3", &[s, "writer", &h.addr[0], "5213"])
        .env("STRAIT_REL_LIVENESS_MS", "1500")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("writer");
    // Let the transfer run, then kill the reader (SIGKILL: no goodbye).
    let mut line = String::new();
    {
        use std::io::BufRead;
        let out = reader.stdout.take().expect("reader stdout");
        let _ = std::io::BufReader::new(out).read_line(&mut line);
    }
    assert_eq!(line.trim(), "READING");
    std::thread::sleep(Duration::from_millis(300));
    let _ = reader.kill();
    let _ = reader.wait();
    let started = Instant::now();
    let o = {
        let mut w = Killed(writer);
        loop {
            if w.0.try_wait().expect("wait").is_some() {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "the writer hangs after its peer died");
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut out = String::new();
        use std::io::Read;
        if let Some(mut so) = w.0.stdout.take() {
            let _ = so.read_to_string(&mut out);
        }
        if let Some(mut se) = w.0.stderr.take() {
            let _ = se.read_to_string(&mut out);
        }
        out
    };
    assert!(o.contains("ERROR"), "{o}");
    assert_eq!(remote(&o), 1, "{o}");
    let _ = std::fs::remove_file(&script);
}

/// With `--xdp` at both ends the connection rides the AF_XDP device (raw Ethernet,
/// addressed by MAC): sockperf and a hashed transfer, every byte intact; with
/// `--xdp` at one end only, the udp device.
#[test]
fn sockperf_and_a_hashed_transfer_over_the_xdp_device_between_hosts() {
    ensure("sockperf", "sockperf");
    let h = Hosts::create();
    let xdp: &[&str] = &["--xdp"];
    let server = h.spawn_with(0, true, xdp, "sockperf", &["sr", "--tcp", "-i", &h.addr[0], "-p", "11221"]);
    h.wait_listening(0, 11221);
    let args = ["pp", "--tcp", "-i", &h.addr[0], "-p", "11221", "-t", "1", "-m", "14", "--mps", "5000000"];
    let o =
        run_for(&mut h.cmd_with(1, true, xdp, "sockperf", &args), Duration::from_secs(30)).expect("sockperf");
    let t = text(&o);
    assert!(o.status.success() && t.contains("Summary: Latency is"), "{t}");
    assert_eq!((remote(&t), remote_xdp(&t)), (1, 1), "{t}");
    // The client without --xdp: the udp device.
    let o = run_for(&mut h.cmd(1, true, "sockperf", &args), Duration::from_secs(30)).expect("sockperf");
    let t = text(&o);
    assert!(o.status.success() && t.contains("Summary: Latency is"), "{t}");
    assert_eq!((remote(&t), remote_xdp(&t)), (1, 0), "{t}");
    // One process per interface holds the xdp device (the XDP program and its
    // AF_XDP socket): the sink below needs the server gone.
    drop(server);

    let script = std::env::temp_dir().join(format!("strait-hashed-xdp-{}.py", std::process::id()));
    std::fs::write(&script, [PY_ACCEPT_ONE, HASHED].concat()).expect("write script");
    let s = script.to_str().expect("utf-8 path");
    let t = hashed_transfer(&h, s, [true, true], xdp, 5222, 30_000_000);
    assert_eq!(remote_xdp(&t), 1, "{t}");
    let _ = std::fs::remove_file(&script);
}

/// `serve ADDR PORT N`: an echo server on one `selectors` loop (epoll) that
/// echoes every byte of N connections and closes each after its client's end.
/// `echo ADDR PORT N SIZE`: N connections at once on one loop, each sending SIZE
/// bytes of its own pattern, ending, and checking that exactly those bytes came
/// back. Either side exits non-zero if its loop waits 30 s for nothing (a lost
/// wake-up) or a connection's echo is short or wrong.
const ECHO_MANY: &str = r#"import hashlib, selectors, socket, sys
mode, addr, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sel = selectors.DefaultSelector()
R, W = selectors.EVENT_READ, selectors.EVENT_WRITE
def pattern(seed, size):
    b, h = bytearray(), seed.to_bytes(8, "little")
    while len(b) < size:
        h = hashlib.sha256(h).digest()
        b += h * 64
    return bytes(b[:size])
if mode == "serve":
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((addr, port))
    ls.listen(256)
    ls.setblocking(False)
    sel.register(ls, R)
    conns, closed = {}, 0
    while closed < n:
        ev = sel.select(30)
        if not ev:
            sys.exit("server stalled: %d of %d connections done" % (closed, n))
        for key, mask in ev:
            s = key.fileobj
            if s is ls:
                while True:
                    try:
                        c, _ = ls.accept()
                    except BlockingIOError:
                        break
                    c.setblocking(False)
                    conns[c] = [bytearray(), False]
                    sel.register(c, R)
                continue
            out = conns[s]
            if mask & R and not out[1]:
                try:
                    d = s.recv(1 << 16)
                except BlockingIOError:
                    d = None
                if d == b"":
                    out[1] = True
                elif d:
                    out[0] += d
            if out[0]:
                try:
                    del out[0][: s.send(out[0])]
                except BlockingIOError:
                    pass
            if out[1] and not out[0]:
                sel.unregister(s)
                s.close()
                del conns[s]
                closed += 1
            else:
                sel.modify(s, (0 if out[1] else R) | (W if out[0] else 0))
else:
    size = int(sys.argv[5])
    st = {}
    for i in range(n):
        c = socket.create_connection((addr, port))
        c.setblocking(False)
        data = pattern(i, size)
        st[c] = [i, data, 0, hashlib.sha256(), 0, hashlib.sha256(data).hexdigest()]
        sel.register(c, R | W)
    done = 0
    while done < n:
        ev = sel.select(30)
        if not ev:
            sys.exit("client stalled: %d of %d connections done" % (done, n))
        for key, mask in ev:
            c = key.fileobj
            s = st[c]
            if mask & W and s[2] < size:
                try:
                    s[2] += c.send(s[1][s[2] : s[2] + (1 << 16)])
                except BlockingIOError:
                    pass
                if s[2] == size:
                    c.shutdown(socket.SHUT_WR)
                    sel.modify(c, R)
            if mask & R:
                try:
                    d = c.recv(1 << 16)
                except BlockingIOError:
                    continue
                if d:
                    s[3].update(d)
                    s[4] += len(d)
                    continue
                if s[4] != size or s[3].hexdigest() != s[5]:
                    sys.exit("connection %d: %d of %d bytes came back, hash %s" % (s[0], s[4], size, s[3].hexdigest() == s[5]))
                sel.unregister(c)
                c.close()
                done += 1
    print("echoed %d connections x %d bytes, every byte intact" % (n, size))
"#;

/// 64 connections at once between two processes over the xdp device (one channel
/// each on one port per host), both ends on one epoll loop: every byte of each
/// connection's own pattern echoes back intact, and neither loop ever waits 30 s
/// for nothing (a lost wake-up would).
#[test]
fn sixty_four_connections_over_the_xdp_device_echo_every_byte() {
    const N: usize = 64;
    let h = Hosts::create();
    let xdp: &[&str] = &["--xdp"];
    let script = std::env::temp_dir().join(format!("strait-echo-many-{}.py", std::process::id()));
    std::fs::write(&script, ECHO_MANY).expect("write script");
    let s = script.to_str().expect("utf-8 path");
    let n = N.to_string();
    let server = h.spawn_with(0, true, xdp, "python3", &[s, "serve", &h.addr[0], "5333", &n]);
    h.wait_listening(0, 5333);
    let o = run_for(
        &mut h.cmd_with(1, true, xdp, "python3", &[s, "echo", &h.addr[0], "5333", &n, "262144"]),
        Duration::from_secs(120),
    )
    .expect("echo client finished");
    let t = text(&o);
    let _ = std::fs::remove_file(&script);
    drop(server);
    assert!(o.status.success() && t.contains("every byte intact"), "{t}");
    assert_eq!(remote_xdp(&t), N, "{t}");
}
