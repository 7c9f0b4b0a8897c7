//! UDP under `strait run`: sockperf's UDP ping-pong and throughput modes, unchanged,
//! both ends under strait (checked for correct results and for the shared-memory
//! path really being used: `--stats` counts), and with one end only under strait
//! (the kernel path, both directions).

use std::io::{BufRead, BufReader, Read};
use std::net::UdpSocket;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;
use common::{ensure, plain, run_for, strait_run};

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// A sockperf server: started, waited for until its socket is bound, stopped with
/// SIGINT (so it prints its totals and strait its stats line), killed if a test fails.
struct Server {
    child: Option<Child>,
    lines: mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

impl Server {
    fn start(mut c: Command) -> Server {
        let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("sockperf server");
        let out = child.stdout.take().expect("stdout");
        let mut err = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let s = Server { child: Some(child), lines, stderr };
        // "using recvfrom() to block on socket(s)" comes after the bind.
        let end = Instant::now() + Duration::from_secs(15);
        loop {
            let left = end.saturating_duration_since(Instant::now());
            let l = s.lines.recv_timeout(left).expect("sockperf server never got ready");
            if l.contains("to block on socket") {
                break;
            }
        }
        s
    }

    /// SIGINT, then (stdout, stderr).
    fn stop(mut self) -> (String, String) {
        let mut child = self.child.take().expect("child");
        let _ = Command::new("kill").args(["-INT", &child.id().to_string()]).status();
        let end = Instant::now() + Duration::from_secs(10);
        while child.try_wait().ok().flatten().is_none() {
            if Instant::now() > end {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.wait();
        let mut out = String::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(2)) {
            out.push_str(&l);
            out.push('\n');
        }
        let h = std::mem::replace(&mut self.stderr, std::thread::spawn(String::new));
        (out, h.join().unwrap_or_default())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

use strait_testkit::stat;

fn has_stats(stderr: &str) -> bool {
    stderr.lines().any(|l| l.starts_with("strait-preload: pid "))
}

/// The first "Total N" count in sockperf's output (messages handled by a server,
/// observations of a ping-pong client).
fn total(text: &str) -> Option<usize> {
    text.match_indices("Total ").find_map(|(i, _)| {
        let num: String = text[i + 6..].chars().take_while(|c| c.is_ascii_digit()).collect();
        num.parse().ok()
    })
}

/// The number after `prefix` in sockperf's output.
fn number_after(text: &str, prefix: &str) -> Option<f64> {
    let rest = &text[text.find(prefix)? + prefix.len()..];
    let num: String = rest.trim_start().chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    num.parse().ok()
}

fn server_cmd(under_strait: bool, port: &str) -> Command {
    let args = ["sr", "-i", "127.0.0.1", "-p", port];
    if under_strait {
        let mut c = strait_run(&["--stats", "--", "sockperf"]);
        c.args(args);
        c
    } else {
        let mut c = plain("sockperf");
        c.args(args);
        c
    }
}

fn client(under_strait: bool, args: &[&str]) -> (String, String) {
    let mut c = if under_strait {
        let mut c = strait_run(&["--stats", "--", "sockperf"]);
        c.args(args);
        c
    } else {
        let mut c = plain("sockperf");
        c.args(args);
        c
    };
    let out = run_for(&mut c, Duration::from_secs(40)).expect("sockperf client finished in time");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "sockperf {args:?} failed:\n{stdout}\n{stderr}");
    (stdout, stderr)
}

/// Runs a ping-pong client; checks sockperf's verdict (no loss, duplicate or
/// reordering) and returns (median one-way latency in us, stdout, stderr).
fn ping_pong(under_strait: bool, port: &str, msg: &str) -> (f64, String, String) {
    // sockperf sizes its sequence table for at most 600K messages/s unless told
    // otherwise, and strait goes faster than that.
    let (out, err) = client(
        under_strait,
        &["pp", "-i", "127.0.0.1", "-p", port, "-t", "1", "-m", msg, "--mps", "5000000"],
    );
    let text = format!("{out}{err}");
    assert!(text.contains("Summary: Latency is"), "{text}");
    assert!(
        text.contains("# dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0"),
        "{text}"
    );
    let median = number_after(&text, "percentile 50.000 =").expect("median in sockperf's output");
    assert!(median > 0.0 && median < 100_000.0, "implausible median {median} us:\n{text}");
    (median, out, err)
}

#[test]
fn sockperf_udp_ping_pong_with_both_ends_under_strait() {
    ensure("sockperf", "sockperf");
    let port = free_udp_port().to_string();
    let server = Server::start(server_cmd(true, &port));
    let mut sent = 0;
    for msg in ["14", "1024", "65000"] {
        let (_, out, err) = ping_pong(true, &port, msg);
        // One channel each way, and every message went through shared memory.
        assert_eq!(stat(&err, "udp-out"), 1, "{err}");
        assert_eq!(stat(&err, "udp-in"), 1, "{err}");
        assert_eq!(stat(&err, "udp-dropped"), 0, "{err}");
        let observations = total(&out).unwrap_or(0);
        let s = stat(&err, "udp-sent");
        assert!(s >= observations && s > 1000, "sent {s} through shm, {observations} observations:\n{out}");
        // Every reply came back, but perhaps the last one (in flight when the
        // client's timer ended the run).
        let r = stat(&err, "udp-received");
        assert!(r <= s && r + 1 >= s, "{err}");
        sent += s;
    }
    let (out, err) = server.stop();
    let handled = total(&out).expect("server total");
    assert_eq!(stat(&err, "udp-received"), sent, "{out}\n{err}");
    assert_eq!(stat(&err, "udp-sent"), sent, "{out}\n{err}");
    assert_eq!(stat(&err, "udp-in"), 3, "{err}");
    assert!(handled > 0 && handled <= sent, "server handled {handled} of {sent}");
}

#[test]
fn sockperf_udp_throughput_with_both_ends_under_strait() {
    ensure("sockperf", "sockperf");
    let port = free_udp_port().to_string();
    let server = Server::start(server_cmd(true, &port));
    let mut total_sent = 0;
    let mut total_shm = 0;
    for msg in ["14", "1472"] {
        let (out, err) =
            client(true, &["tp", "-i", "127.0.0.1", "-p", &port, "-t", "1", "-m", msg, "--mps", "max"]);
        let sent = number_after(&out, "Total of").expect("messages sent") as usize;
        let rate = number_after(&out, "Message Rate is").expect("message rate");
        assert!(sent > 1000 && rate > 1000.0, "{out}");
        // Every datagram went into the receiver's ring or was dropped there (full).
        let shm = stat(&err, "udp-sent");
        let dropped = stat(&err, "udp-dropped");
        assert_eq!(stat(&err, "udp-out"), 1, "{err}");
        assert!(shm + dropped >= sent && shm > 0, "sent {sent}: {err}");
        assert!(shm + dropped <= sent + 1000, "sent {sent}: {err}");
        total_sent += sent;
        total_shm += shm;
    }
    // Let the server drain its rings.
    std::thread::sleep(Duration::from_millis(300));
    let (out, err) = server.stop();
    let handled = total(&out).expect("server total");
    assert_eq!(stat(&err, "udp-received"), total_shm, "{out}\n{err}");
    assert!(handled <= total_shm && handled > 0 && handled <= total_sent + 2000, "{out}\n{err}");
}

#[test]
fn sockperf_udp_with_one_end_under_strait_goes_through_the_kernel() {
    ensure("sockperf", "sockperf");
    for (server_strait, client_strait) in [(true, false), (false, true)] {
        let port = free_udp_port().to_string();
        let server = Server::start(server_cmd(server_strait, &port));
        let (_, _, err) = ping_pong(client_strait, &port, "14");
        if client_strait {
            assert_eq!(stat(&err, "udp-out"), 0, "{err}");
            assert_eq!(stat(&err, "udp-sent"), 0, "{err}");
        } else {
            assert!(!has_stats(&err));
        }
        let (out, err) = server.stop();
        assert!(total(&out).is_some_and(|n| n > 1000), "{out}");
        if server_strait {
            assert_eq!(stat(&err, "udp-in"), 0, "{err}");
            assert_eq!(stat(&err, "udp-received"), 0, "{err}");
        }
    }
}

#[test]
fn sockperf_udp_server_under_strait_serves_strait_and_plain_clients_at_once() {
    ensure("sockperf", "sockperf");
    let port = free_udp_port().to_string();
    let server = Server::start(server_cmd(true, &port));
    let p2 = port.clone();
    let plain_client = std::thread::spawn(move || ping_pong(false, &p2, "100"));
    let (_, _, err) = ping_pong(true, &port, "100");
    assert_eq!(stat(&err, "udp-out"), 1, "{err}");
    plain_client.join().expect("plain client");
    let (out, err) = server.stop();
    assert!(total(&out).is_some_and(|n| n > 1000), "{out}");
    assert_eq!(stat(&err, "udp-in"), 1, "{err}");
}

/// An asyncio (epoll, non-blocking) UDP echo server, and a client with a socket
/// timeout (poll, then a non-blocking recvfrom) that checks every echo and the
/// source address it came from.
const UDP_PY: &str = r#"import asyncio, socket, sys
class Echo(asyncio.DatagramProtocol):
    def connection_made(self, t):
        self.t = t
    def datagram_received(self, data, addr):
        self.t.sendto(data, addr)
async def server(family, host):
    s = socket.socket(family, socket.SOCK_DGRAM)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind((host, 0))
    print("PORT", s.getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(Echo, sock=s)
    await asyncio.sleep(3600)
def client(family, host, port, want_host):
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.settimeout(10)
    total = 0
    for i in range(2000):
        msg = bytes([(i * 7 + j) % 251 for j in range(1 + (i * 997) % 9000)])
        s.sendto(msg, (host, port))
        data, addr = s.recvfrom(65536)
        assert data == msg, (i, len(data), len(msg))
        assert addr[0] == want_host and addr[1] == port, addr
        total += len(msg)
    print("udp ok", total, flush=True)
fam = {"4": socket.AF_INET, "6": socket.AF_INET6}
if sys.argv[1] == "server":
    asyncio.run(server(fam[sys.argv[2]], sys.argv[3]))
else:
    client(fam[sys.argv[2]], sys.argv[3], int(sys.argv[4]), sys.argv[5])
"#;

#[test]
fn python_asyncio_udp_echo_over_ipv4_ipv6_and_dual_stack_under_strait() {
    ensure("python3", "python3");
    // The interpreter itself (not a shim script that would run under strait too).
    let out =
        Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().expect("python3");
    let py = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let dir = std::env::temp_dir().join(format!("strait-udp-py-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let script = dir.join("udp.py");
    std::fs::write(&script, UDP_PY).expect("script");
    let script = script.display().to_string();
    // (server family, bind address, client family, destination, source the client sees)
    let cases = [
        ("4", "127.0.0.1", "4", "127.0.0.1", "127.0.0.1"),
        ("6", "::1", "6", "::1", "::1"),
        // A dual-stack server (bound to ::) answering an IPv4 client.
        ("6", "::", "4", "127.0.0.1", "127.0.0.1"),
    ];
    for (sfam, bind, cfam, dest, want) in cases {
        let mut c = strait_run(&["--stats", "--", &py, &script, "server", sfam, bind]);
        let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("server");
        let out = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(out).lines();
        let first = lines.next().expect("a line").expect("PORT line");
        let port = first.trim().strip_prefix("PORT ").expect("PORT").to_string();
        struct Kill(Child);
        impl Drop for Kill {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let _server = Kill(child);
        let out = run_for(
            &mut strait_run(&["--stats", "--", &py, &script, "client", cfam, dest, &port, want]),
            Duration::from_secs(60),
        )
        .expect("client finished in time");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            out.status.success() && text.contains("udp ok 9000000"),
            "{sfam} {bind} -> {dest}:\n{text}\n{err}"
        );
        assert_eq!(stat(&err, "udp-out"), 1, "{sfam} {bind} -> {dest}: {err}");
        assert_eq!(stat(&err, "udp-sent"), 2000, "{err}");
        assert_eq!(stat(&err, "udp-received"), 2000, "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sockperf_udp_epoll_poll_select_and_nonblocking_variants_under_strait() {
    ensure("sockperf", "sockperf");
    let dir = std::env::temp_dir().join(format!("strait-udp-iomux-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    // (server multiplexer, client arguments besides the addresses)
    let variants: [(&[&str], &[&str]); 4] = [
        (&["-F", "e"], &["pp"]),
        (&["-F", "p", "--nonblocked"], &["pp", "--nonblocked"]),
        (&["-F", "s"], &["pp", "-F", "e", "--nonblocked", "FILE"]),
        (&["-F", "e", "--nonblocked"], &["pp", "-F", "p", "FILE"]),
    ];
    for (k, (sargs, cargs)) in variants.iter().enumerate() {
        // Two server sockets; the client uses the first, or both (FILE).
        let (p1, p2) = (free_udp_port(), free_udp_port());
        let file = dir.join(format!("ports{k}"));
        std::fs::write(&file, format!("U:127.0.0.1:{p1}\nU:127.0.0.1:{p2}\n")).expect("ports file");
        let file = file.display().to_string();
        let mut sc = strait_run(&["--stats", "--", "sockperf", "sr", "-f", &file]);
        sc.args(*sargs);
        let server = Server::start(sc);
        let mut args: Vec<String> = Vec::new();
        for a in cargs.iter() {
            if *a == "FILE" {
                args.extend(["-f".to_string(), file.clone()]);
            } else {
                args.push(a.to_string());
            }
        }
        if !cargs.contains(&"FILE") {
            args.extend(["-i", "127.0.0.1", "-p", &p1.to_string()].map(String::from));
        }
        args.extend(["-t", "1", "-m", "64", "--mps", "5000000"].map(String::from));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (out, err) = client(true, &refs);
        let text = format!("{out}{err}");
        assert!(
            text.contains("# dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0"),
            "{sargs:?} / {cargs:?}:\n{text}"
        );
        let sockets = if cargs.contains(&"FILE") { 2 } else { 1 };
        assert_eq!(stat(&err, "udp-out"), sockets, "{sargs:?} / {cargs:?}: {err}");
        assert!(stat(&err, "udp-sent") > 1000, "{err}");
        let (sout, serr) = server.stop();
        assert!(total(&sout).is_some_and(|n| n > 1000), "{sout}");
        assert_eq!(stat(&serr, "udp-in"), sockets, "{serr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
