//! The trust boundary under attack (docs/SECURITY.md): victims are real processes
//! (Python programs) under the library, as root; attackers run as another user
//! (`nobody`, through `setpriv`) without it, or as a hostile peer that follows the
//! setup and then writes random values into the shared mapping. Each test fails
//! without the defence it names.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use strait_testkit::stat;

use strait_testkit::is_root;

/// Debian's python3: the attackers run it as another user, who cannot run one
/// installed under root's home.
const PYTHON: &str = "/usr/bin/python3";

fn have(prog: &str) -> bool {
    Command::new(prog).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok()
}

/// Root for the other user, setpriv to become it, python3 for the programs.
fn can_run() -> bool {
    let ok = is_root() && have("setpriv") && have(PYTHON);
    if !ok {
        eprintln!("skipped: needs root, setpriv and python3 (scripts/install-deps)");
    }
    ok
}

/// Writes `body` to a script file of its own, readable by every user.
/// Writes a Python program; `@LAYOUT_VERSION@` in it becomes the library's layout
/// version (the peers played by hand speak the library's own).
fn script(tag: &str, body: &str) -> PathBuf {
    let body = body.replace("@LAYOUT_VERSION@", &strait_sockets::LAYOUT_VERSION.to_string());
    strait_testkit::script("hostile", tag, &body)
}

/// A Python program under the library (as root), its stdout piped.
fn victim(py: &PathBuf, args: &[&str]) -> Command {
    let mut c = Command::new(PYTHON);
    c.arg(py).args(args).env("STRAIT_STATS", "1").env("LD_PRELOAD", common::lib(&common::tcp_peer()));
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// A Python program as `nobody`, without the library.
fn attacker(py: &PathBuf, args: &[&str]) -> Command {
    let mut c = Command::new("setpriv");
    c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", PYTHON])
        .arg(py)
        .args(args)
        .env_remove("LD_PRELOAD");
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// Reads lines from `child`'s stdout until one starts with `want`, for at most
/// `limit`. The lines after it stay in the pipe for [`finish`]: the reader stops
/// at the wanted line.
fn wait_line(child: &mut Child, want: &str, limit: Duration) -> String {
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let (back_tx, back_rx) = std::sync::mpsc::channel();
    let wanted = want.to_string();
    std::thread::spawn(move || {
        let mut r = BufReader::new(out);
        let mut l = String::new();
        while r.read_line(&mut l).is_ok_and(|n| n > 0) {
            let line = l.trim_end().to_string();
            let done = line.starts_with(&wanted);
            if tx.send(line).is_err() || done {
                break;
            }
            l.clear();
        }
        let _ = back_tx.send(r.into_inner());
    });
    let end = Instant::now() + limit;
    let mut seen = Vec::new();
    while let Ok(l) = rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
        if l.starts_with(want) {
            if let Ok(out) = back_rx.recv_timeout(Duration::from_secs(5)) {
                child.stdout = Some(out);
            }
            return l;
        }
        seen.push(l);
    }
    let _ = child.kill();
    panic!("no line starting {want:?} within {limit:?}; saw {seen:?}");
}

/// Waits for `child` with a bound; returns (success, stdout, stderr).
fn finish(child: Child, limit: Duration) -> (bool, String, String) {
    let pid = child.id();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(limit);
        // SAFETY: signals a child of ours that is past its time (no-op if reaped).
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    });
    let o = child.wait_with_output().expect("wait");
    drop(killer);
    (o.status.success(), String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into())
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let u = std::net::UdpSocket::bind(l.local_addr().expect("addr")).ok();
    let port = l.local_addr().expect("addr").port();
    drop((l, u));
    port
}

/// A free port and the scripts `(tag, body)`, each written to its own file.
fn port_and_scripts<const N: usize>(scripts: [(&str, &str); N]) -> (u16, [PathBuf; N]) {
    (free_port(), scripts.map(|(tag, body)| script(tag, body)))
}

/// The files of a marker attack, named with `n`: the counting server, the
/// attacker's `(tag, body)` and the line client, with a free port; `None` where the
/// test cannot run (see [`can_run`]).
fn marker_attack(n: &str, attacker: (&str, &str)) -> Option<(u16, [PathBuf; 3])> {
    if !can_run() {
        return None;
    }
    let (server, client) = (format!("counting-server{n}"), format!("line-client{n}"));
    let body = [PY_LISTEN, COUNTING_SERVER].concat();
    Some(port_and_scripts([(&server, &body), attacker, (&client, LINE_CLIENT)]))
}

/// Starts `c` (`what` for errors) and waits 10 s at most for its line starting with
/// `ready`.
fn start(c: &mut Command, what: &str, ready: &str) -> Child {
    let mut child = c.spawn().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    wait_line(&mut child, ready, Duration::from_secs(10));
    child
}

/// The `GOT ...` line a squatter reports when its time is up.
fn squatter_report(squatter: Child) -> String {
    let (_, out, err) = finish(squatter, Duration::from_secs(30));
    out.lines().find(|l| l.starts_with("GOT ")).unwrap_or_else(|| panic!("squatter: {out} {err}")).to_string()
}

/// A Python function for the squatters below (put before their text):
/// `squat(names, backlog, secs, bufsize, count_bytes)` binds and listens on each
/// abstract Unix name, says `READY`, accepts whatever connects and reads whatever
/// comes (closing any descriptor passed) for `secs`, then reports what it got on a
/// `GOT {json}` line (with the bytes read if `count_bytes`).
const PY_SQUAT: &str = r#"
import json, os, socket, sys, threading, time
def squat(names, backlog, secs, bufsize, count_bytes, more=None):
    socks = []
    def hold(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind('\0' + n)
        s.listen(backlog)
        s.setblocking(False)
        socks.append(s)
    for n in names:
        hold(n)
    if more:
        # Names that come later, one per line on stdin (each answered SQUATTED).
        def feed():
            for line in sys.stdin:
                hold(more(line.strip()))
                print('SQUATTED', line.strip(), flush=True)
        threading.Thread(target=feed, daemon=True).start()
    print('READY', flush=True)
    conns, msgs, fds, data = [], 0, 0, 0
    end = time.time() + secs
    while time.time() < end:
        for s in socks:
            try:
                c, _ = s.accept()
                c.setblocking(False)
                conns.append(c)
            except BlockingIOError:
                pass
        for c in conns:
            try:
                m, anc, _, _ = c.recvmsg(bufsize, socket.CMSG_SPACE(16 * 4))
            except (BlockingIOError, OSError):
                continue
            if m or anc:
                msgs += 1
                data += len(m)
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = [int.from_bytes(payload[i:i + 4], 'little') for i in range(0, len(payload) - 3, 4)]
                    fds += len(got)
                    for f in got:
                        os.close(f)
        time.sleep(0.002)
    report = {'conns': len(conns), 'msgs': msgs, 'fds': fds}
    if count_bytes:
        report['bytes'] = data
    print('GOT ' + json.dumps(report), flush=True)
"#;

/// Binds every name strait may use for a port (TCP and UDP markers of the
/// loopback, IPv4-wildcard and IPv6 addresses, or only the ones named), accepts
/// whatever connects and reads whatever comes, then reports what it got (after
/// [`PY_SQUAT`]).
const SQUATTER: &str = r#"
import os, sys
port, secs, which = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ns = os.stat('/proc/self/ns/net').st_ino
v4 = lambda h: '00000000000000000000ffff' + h
keys = {'exact': [v4('7f000001')], 'all': [v4('7f000001'), v4('00000000'), '00' * 16, 'v6only']}[which]
names = [f'strait.tcp.{ns}.{port}.{k}' for k in keys] + [f'strait.udp.{ns}.{port}.{k}' for k in keys if k != 'v6only']
squat(names, 64, secs, 65536, True)
"#;

/// An echo server (TCP on `host:port`, or UDP) that serves `n` clients and checks
/// that no read returns more than it asked for.
const ECHO_SERVER: &str = r#"
import socket, sys
proto, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if proto == 'tcp':
    l = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind((host, port))
    l.listen(64)
    print('LISTENING', flush=True)
    for _ in range(n):
        c, _ = l.accept()
        c.settimeout(20)
        try:
            while True:
                b = c.recv(65536)
                assert len(b) <= 65536, 'a read returned more than asked'
                if not b:
                    break
                c.sendall(b)
        except (ConnectionError, socket.timeout, OSError) as e:
            print('client error', e, flush=True)
        c.close()
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, port))
    s.settimeout(20)
    print('LISTENING', flush=True)
    for _ in range(n):
        b, a = s.recvfrom(65536)
        s.sendto(b, a)
print('DONE', flush=True)
"#;

/// A client that sends hashed data and checks the echo; prints its connect time
/// (after [`strait_testkit::PY_ECHO_BACK`]).
const ECHO_CLIENT: &str = r#"
import hashlib, os, socket, sys, time
proto, port, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if proto == 'tcp':
    t = time.monotonic()
    c = socket.create_connection(('127.0.0.1', port), timeout=20)
    print('CONNECT_MS %.1f' % ((time.monotonic() - t) * 1e3), flush=True)
    data = os.urandom(total)
    got = echo_back(c, [data])
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), 'echo differs'
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(20)
    for i in range(total):
        m = os.urandom(100)
        s.sendto(m, ('127.0.0.1', port))
        b, _ = s.recvfrom(65536)
        assert b == m, 'datagram differs'
print('ECHO OK', flush=True)
"#;

/// Runs the squatter (as nobody), then a TCP and a UDP echo pair (as root, under
/// the library) on the squatted port; fails the test unless the squatter got
/// nothing and both pairs echoed; returns the victims' outputs (`None` where the
/// test cannot run, see [`can_run`]).
fn squat_and_talk(which: &str, server_host: &str) -> Option<[(bool, String, String); 4]> {
    if !can_run() {
        return None;
    }
    let echo_client = [strait_testkit::PY_ECHO_BACK, ECHO_CLIENT].concat();
    let (port, [sq, srv, cli]) = port_and_scripts([
        ("squatter", &[PY_SQUAT, SQUATTER].concat()),
        ("echo-server", ECHO_SERVER),
        ("echo-client", &echo_client),
    ]);
    let a = start(&mut attacker(&sq, &[&port.to_string(), "6", which]), "squatter", "READY");
    let s = start(&mut victim(&srv, &["tcp", server_host, &port.to_string(), "1"]), "server", "LISTENING");
    let c = victim(&cli, &["tcp", &port.to_string(), "1048576"]).spawn().expect("client");
    let client = finish(c, Duration::from_secs(30));
    let server = finish(s, Duration::from_secs(30));
    let us =
        start(&mut victim(&srv, &["udp", server_host, &port.to_string(), "20"]), "udp server", "LISTENING");
    let uc = victim(&cli, &["udp", &port.to_string(), "20"]).spawn().expect("udp client");
    let uclient = finish(uc, Duration::from_secs(30));
    let userver = finish(us, Duration::from_secs(30));
    no_leak(&squatter_report(a));
    assert!(client.0 && client.1.contains("ECHO OK"), "client: {client:?}");
    assert!(server.0, "server: {server:?}");
    assert!(uclient.0 && uclient.1.contains("ECHO OK") && userver.0, "udp: {uclient:?} {userver:?}");
    Some([client, server, uclient, userver])
}

fn no_leak(got: &str) {
    assert!(got.contains("\"msgs\": 0") && got.contains("\"fds\": 0"), "the squatter got something: {got}");
}

/// The issue's hijack: the server listens on the wildcard, another user holds the
/// exact-address name the connector asks first. The squatter gets no byte and no
/// descriptor, and the connection is accelerated all the same (the connector
/// skips the unproven name and finds the server's).
#[test]
fn a_squatter_of_the_exact_address_name_gets_nothing_and_the_server_is_found() {
    let Some([c, _, uc, _]) = squat_and_talk("exact", "0.0.0.0") else { return };
    assert_eq!(stat(&c.2, "accelerated"), 1, "client: {}", c.2);
    assert!(stat(&c.2, "refused") >= 1, "the squatter was refused: {}", c.2);
    assert!(stat(&uc.2, "udp-out") >= 1, "udp through shared memory: {}", uc.2);
}

/// Every name squatted: the victims talk over the kernel, intact, and no call
/// waits (a connect costs a few look-ups, never the attach timeout).
#[test]
fn a_squatter_of_every_name_gets_nothing_and_costs_only_the_kernel_path() {
    let Some([c, ..]) = squat_and_talk("all", "127.0.0.1") else { return };
    assert_eq!(stat(&c.2, "accelerated"), 0, "{}", c.2);
    let ms: f64 =
        c.1.lines().find_map(|l| l.strip_prefix("CONNECT_MS ")?.trim().parse().ok()).expect("connect time");
    assert!(ms < 500.0, "connect took {ms} ms");
}

/// Fills a real strait server's marker backlog (non-blocking connects until the
/// kernel refuses), holds the connections, then lets a victim connect.
const FLOODER: &str = r#"
import os, socket, sys, time
port, secs = int(sys.argv[1]), float(sys.argv[2])
ns = os.stat('/proc/self/ns/net').st_ino
name = f'\0strait.tcp.{ns}.{port}.00000000000000000000ffff7f000001'
held = []
while len(held) < 20000:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setblocking(False)
    try:
        s.connect(name)
    except (BlockingIOError, ConnectionRefusedError, OSError):
        s.close()
        break
    held.append(s)
print('FLOODED %d' % len(held), flush=True)
time.sleep(secs)
"#;

/// A Python function for the servers below (put before their text): `listen(port)`
/// listens on the loopback's `port` and says `LISTENING`.
const PY_LISTEN: &str = r#"
import socket
def listen(port):
    l = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(('127.0.0.1', port))
    l.listen(64)
    print('LISTENING', flush=True)
    return l
"#;

/// A server that accepts `n` connections, echoes one line each, and prints how
/// many descriptors it holds after each (after [`PY_LISTEN`]).
const COUNTING_SERVER: &str = r#"
import os, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
l = listen(port)
for _ in range(n):
    c, _ = l.accept()
    c.settimeout(20)
    b = c.recv(100)
    c.sendall(b)
    c.close()
    print('FDS %d' % len(os.listdir('/proc/self/fd')), flush=True)
print('DONE', flush=True)
"#;

const LINE_CLIENT: &str = r#"
import socket, sys, time
port = int(sys.argv[1])
t = time.monotonic()
c = socket.create_connection(('127.0.0.1', port), timeout=20)
print('CONNECT_MS %.1f' % ((time.monotonic() - t) * 1e3), flush=True)
c.sendall(b'hello\n')
assert c.recv(100) == b'hello\n'
print('ECHO OK', flush=True)
"#;

/// Another user fills the server's marker backlog: a victim's connect does not
/// wait (the look-up is non-blocking: kernel path at once), and once the server
/// looks at the flood it keeps at most its per-user share of it.
#[test]
fn a_flood_of_the_marker_neither_stalls_connects_nor_grows_the_server() {
    let Some((port, [srv, fl, cli])) = marker_attack("", ("flooder", FLOODER)) else { return };
    let s = start(&mut victim(&srv, &[&port.to_string(), "2"]), "server", "LISTENING");
    let mut f = attacker(&fl, &[&port.to_string(), "8"]).spawn().expect("flooder");
    let flooded = wait_line(&mut f, "FLOODED", Duration::from_secs(30));
    let n: usize = flooded.trim_start_matches("FLOODED ").trim().parse().expect("count");
    assert!(n >= 64, "the flood made {n} connections");
    // The backlog is full: the first connect goes to the kernel at once.
    let c1 = finish(victim(&cli, &[&port.to_string()]).spawn().expect("client"), Duration::from_secs(20));
    // The server's accept drained the flood (keeping its share); the second is
    // accelerated again.
    let c2 = finish(victim(&cli, &[&port.to_string()]).spawn().expect("client"), Duration::from_secs(20));
    let server = finish(s, Duration::from_secs(20));
    drop(finish(f, Duration::from_secs(20)));
    for c in [&c1, &c2] {
        assert!(c.0 && c.1.contains("ECHO OK"), "client: {c:?}");
        let ms: f64 =
            c.1.lines()
                .find_map(|l| l.strip_prefix("CONNECT_MS ")?.trim().parse().ok())
                .expect("connect time");
        assert!(ms < 500.0, "connect took {ms} ms: {c:?}");
    }
    assert!(server.0, "server: {server:?}");
    let fds: Vec<usize> =
        server.1.lines().filter_map(|l| l.strip_prefix("FDS ")?.trim().parse().ok()).collect();
    assert_eq!(fds.len(), 2, "{server:?}");
    assert!(fds.iter().all(|&k| k < 200), "the server holds the flood: {fds:?} descriptors (flood {n})");
    assert_eq!(stat(&c2.2, "accelerated"), 1, "{}", c2.2);
}

/// Hostile hellos from another user at a real server's marker: a ring of 2 GiB, a
/// pipe for a doorbell, a token of the attacker's own socket for someone else's
/// connection, and hellos offering a process pair that is not one (an unsealed
/// memfd; a sealed one of the pair's size without its header), which the server
/// adopts as it queues the hello, before any accept. The server refuses each
/// (counted) and serves the next real client through shared memory.
const FORGER: &str = r#"
import fcntl, os, socket, struct, sys
port = int(sys.argv[1])
ns = os.stat('/proc/self/ns/net').st_ino
name = f'\0strait.tcp.{ns}.{port}.00000000000000000000ffff7f000001'
MAGIC, VERSION = 0x3130504354545253, @LAYOUT_VERSION@
def hello(ring, efd, token, pair=None):
    m = os.memfd_create('x', os.MFD_ALLOW_SEALING)
    os.ftruncate(m, 4096 + 2 * min(ring, 1 << 16))
    fcntl.fcntl(m, 1033, 1 | 2 | 4 | 8)  # F_ADD_SEALS: SEAL, SHRINK, GROW, WRITE
    h = struct.pack('<QII', MAGIC, VERSION, ring) + bytes(32)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(name)
    fds = [m, efd, efd, token] if pair is None else [m, pair, efd, efd, token]
    s.sendmsg([h], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack('%di' % len(fds), *fds))])
    return s
PAIR_LEN = 4096 + 2 * (4096 + 8192)  # pair.rs: LEN
def pair_memfd(sealed):
    p = os.memfd_create('p', os.MFD_ALLOW_SEALING)
    os.ftruncate(p, PAIR_LEN)
    if sealed:
        fcntl.fcntl(p, 1033, 1 | 2 | 4)  # SEAL, SHRINK, GROW: the right kind, but no header
    return p
mine = socket.socket()
mine.bind(('127.0.0.1', 0))
token = os.open('/proc/self/fd/%d' % mine.fileno(), os.O_PATH)
r, w = os.pipe()
e = os.eventfd(0, os.EFD_NONBLOCK)
keep = [hello(1 << 31, e, token), hello(1 << 16, w, token), hello(1 << 16, e, token),
        hello(1 << 16, e, token, pair_memfd(False)), hello(1 << 16, e, token, pair_memfd(True))]
print('SENT', flush=True)
import time; time.sleep(5)
"#;

#[test]
fn forged_hellos_are_refused_and_real_clients_still_attach() {
    let Some((port, [srv, fg, cli])) = marker_attack("-2", ("forger", FORGER)) else { return };
    let s = start(
        victim(&srv, &[&port.to_string(), "1"]).env("STRAIT_RING_SIZE", "65536"),
        "server",
        "LISTENING",
    );
    let f = start(&mut attacker(&fg, &[&port.to_string()]), "forger", "SENT");
    let c = finish(
        victim(&cli, &[&port.to_string()]).env("STRAIT_RING_SIZE", "65536").spawn().expect("client"),
        Duration::from_secs(20),
    );
    let server = finish(s, Duration::from_secs(20));
    drop(finish(f, Duration::from_secs(10)));
    assert!(c.0 && c.1.contains("ECHO OK"), "client: {c:?}");
    assert!(server.0, "{server:?}");
    assert_eq!(stat(&c.2, "accelerated"), 1, "{}", c.2);
    assert!(
        stat(&server.2, "refused") >= 4,
        "the bad ring, the pipe doorbell, the two bad pairs: {}",
        server.2
    );
}

/// The hostile peer: follows the connector's side of the setup (a hello with a
/// real memfd, eventfds and a token of its TCP socket), lets the victim server
/// attach, then writes chosen and random 64-bit values at random 8-byte offsets of
/// the whole mapping (header, positions, locks, rendezvous words, ring data) while
/// sending bytes and reading, for a number of seeded rounds, one connection each.
const HOSTILE_PEER: &str = r#"
import fcntl, os, random, socket, struct, sys, time, mmap
port, seeds, first, messages = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == 'messages'
splits = sys.argv[4] == 'splits'
stopwriter = sys.argv[4] == 'stopwriter'
# Words that decide something: mode, state, holders, and per direction the
# positions, close flags and close hint, sleep flags, locks and the rendezvous
# words (conn.rs layout).
WORDS = [24, 64, 128, 192]
for d in (0, 1):
    base = 1024 + 1024 * d
    WORDS += [base + o for o in (0, 64, 72, 128, 192, 512, 576, 640, 704, 768, 776, 784, 792, 800, 808, 816, 824, 832, 896)]
ns = os.stat('/proc/self/ns/net').st_ino
name = f'\0strait.tcp.{ns}.{port}.00000000000000000000ffff7f000001'
MAGIC, VERSION, RING = 0x3130504354545253, @LAYOUT_VERSION@, 1 << 16
CHOSEN = [0, 1, 2, 3, 7, 8, 4095, 4096, RING - 1, RING, RING + 1, 1 << 31, 1 << 40, (1 << 63) - 1, 1 << 63,
          (1 << 64) - 1, os.getpid(), 1, os.getppid()]
def stopped_for(secs):
    # Stops this process (SIGSTOP, as a debugger or job control would) until a child
    # continues it `secs` later.
    import signal
    me, waker = os.getpid(), os.fork()
    if waker == 0:
        time.sleep(secs)
        os.kill(me, signal.SIGCONT)
        os._exit(0)
    os.kill(me, signal.SIGSTOP)
    os.waitpid(waker, 0)
for seed in range(first, first + seeds):
    rnd = random.Random(seed)
    t = socket.socket()
    t.bind(('127.0.0.1', 0))
    m = os.memfd_create('hostile', os.MFD_ALLOW_SEALING)
    total = 4096 + 2 * RING
    os.ftruncate(m, total)
    fcntl.fcntl(m, 1033, 1 | 2 | 4)  # F_ADD_SEALS: SEAL, SHRINK, GROW
    mm = mmap.mmap(m, total)
    mm[0:16] = struct.pack('<QII', MAGIC, VERSION, RING)
    if messages:
        mm[24:32] = struct.pack('<Q', 1)  # the connector asks for message mode
    ec, ea = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)
    token = os.open('/proc/self/fd/%d' % t.fileno(), os.O_PATH)
    u = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    u.connect(name)
    h = struct.pack('<QII', MAGIC, VERSION, RING) + bytes(32)
    u.sendmsg([h], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack('4i', m, ec, ea, token))])
    os.close(token)
    t.connect(('127.0.0.1', port))
    t.setblocking(False)
    # Scenarios: the first connection holds the victim's step locks with a live pid
    # (ours) for 6 s; the second forges a rendezvous completion of 4000 bytes while
    # the victim waits in a recv of 100; the rest write at random.
    scenario = 'hold' if seed == first else 'forge' if seed == first + 1 else 'random'
    if splits:
        # The victim writes 16 MiB to a buffer we posted and offers us to read its
        # first half from its own buffer: we take the offer and never finish
        # reading ('stall'), say we read a wrong number of bytes ('misread'), or take
        # it and are stopped for 2.5 s, as by a debugger, then say we read nothing
        # ('stopped').
        scenario = 'stall' if seed == first else 'misread' if seed == first + 1 else 'stopped'
    if stopwriter:
        # The victim's blocked recv posts its buffer: we take the post as a writer
        # does, are stopped for 2.5 s (as by a debugger) in the middle, then say we
        # wrote 100 bytes.
        scenario = 'stopped-writer'
    def put(data):
        # Publishes bytes into the victim's receive ring as a writer of ours would
        # (direction 0: data at 4096, tail at 1024), so that it comes to read.
        if messages:
            data = struct.pack('<Q', len(data)) + data
        tail = struct.unpack('<Q', mm[1024:1032])[0]
        o = 4096 + tail % RING
        mm[o:o + len(data)] = data
        mm[1024:1032] = struct.pack('<Q', tail + len(data))
        try:
            os.write(ea, struct.pack('<Q', 1))
        except OSError:
            pass
    if scenario == 'hold':
        hold_end = time.time() + 6
        while time.time() < hold_end:
            for off in (1024 + 704, 2048 + 192):  # victim's consumer and producer locks
                mm[off:off + 8] = struct.pack('<Q', os.getpid())
            if time.time() + 5.9 < hold_end + 0.01 and struct.unpack('<Q', mm[1024:1032])[0] == 0:
                put(b'x' * 100)
            time.sleep(0.01)
    elif scenario == 'forge':
        forge_end = time.time() + 1
        put(b'y' * 50)  # readable: the victim reads it, then waits in its next recv(100)
        while time.time() < forge_end:
            # The moment the victim's buffer is posted, claim 4000 bytes were written
            # into it, and ring.
            if struct.unpack('<Q', mm[1024 + 768:1024 + 776])[0] == 1:
                mm[1024 + 800:1024 + 808] = struct.pack('<Q', 4000)
                mm[1024 + 768:1024 + 776] = struct.pack('<Q', 3)
                try:
                    os.write(ea, struct.pack('<Q', 1))
                except OSError:
                    pass
            time.sleep(0.0005)
    elif scenario == 'stopped-writer':
        state = slice(1024 + 768, 1024 + 776)  # direction 0: we write, the victim reads
        stop_end = time.time() + 6
        while time.time() < stop_end:
            if mm[state] == struct.pack('<Q', 1):  # posted
                mm[state] = struct.pack('<Q', 2)  # filling
                stopped_for(2.5)
                mm[1024 + 800:1024 + 808] = struct.pack('<Q', 100)
                mm[state] = struct.pack('<Q', 3)  # done: 100 bytes
                try:
                    os.write(ea, struct.pack('<Q', 1))
                except OSError:
                    pass
                break
            time.sleep(0.0005)
        time.sleep(0.5)
    elif scenario in ('stall', 'misread', 'stopped'):
        import ctypes
        buf = ctypes.create_string_buffer(16 << 20)
        b = 2048  # direction 1: the victim writes, we read
        mm[b + 776:b + 784] = struct.pack('<Q', ctypes.addressof(buf))
        mm[b + 784:b + 792] = struct.pack('<Q', 16 << 20)
        mm[b + 792:b + 800] = struct.pack('<Q', os.getpid())
        mm[b + 768:b + 776] = struct.pack('<Q', 1)  # posted
        # (Polled without a pause: the offer stands while the victim copies its
        # own half, a millisecond or two.)
        split_end = time.time() + {'stall': 8, 'misread': 3, 'stopped': 6}[scenario]
        state, offered = slice(b + 768, b + 776), struct.pack('<Q', 5)
        took, raced = False, False
        while time.time() < split_end:
            for _ in range(1000):
                if not took and mm[state] == offered:
                    took = True
                    if scenario == 'stall':
                        mm[state] = struct.pack('<Q', 6)  # reading, for ever
                    elif scenario == 'stopped':
                        mm[state] = struct.pack('<Q', 6)  # reading (first: the offer is brief)
                        stopped_for(2.5)
                        raced = struct.unpack('<Q', mm[b + 800:b + 808])[0] != 0
                        mm[b + 832:b + 840] = struct.pack('<Q', 0)
                        mm[state] = struct.pack('<Q', 7)  # read nothing: the writer writes it
                    else:
                        mm[b + 832:b + 840] = struct.pack('<Q', 12345)
                        mm[state] = struct.pack('<Q', 7)  # read, a wrong count
        # (The offer stands for a millisecond or two: on a loaded machine we may not
        # run in time, and the victim then rightly writes it all itself. Our plain
        # read and store of the state word are not one step as a real reader's
        # compare-exchange is: a victim that took the offer back between them wrote
        # all of it and said so in the delivered-count word, which a taken offer
        # leaves at 0 until the reader says it is done.)
        if scenario == 'stall':
            raced = struct.unpack('<Q', mm[b + 800:b + 808])[0] != 0
        took = took and not raced
        print('SPLIT %d %s %s' % (seed - first, scenario, 'took' if took else 'missed'), flush=True)
    end = time.time() + (0.25 if scenario == 'random' else 0)
    while time.time() < end:
        for _ in range(rnd.randrange(1, 16)):
            r = rnd.random()
            if r < 0.4:
                off = rnd.choice(WORDS)
            elif r < 0.7:
                off = rnd.randrange(0, 4096 // 8) * 8
            else:
                off = rnd.randrange(0, total // 8) * 8
            v = rnd.choice(CHOSEN) if rnd.random() < 0.5 else rnd.getrandbits(64)
            mm[off:off + 8] = struct.pack('<Q', v)
        try:
            os.write(ea, struct.pack('<Q', 1))
        except OSError:
            pass
        try:
            t.send(os.urandom(rnd.randrange(1, 3000)))
            t.recv(65536)
        except (BlockingIOError, OSError):
            pass
        time.sleep(0.001)
    t.close(); u.close(); mm.close(); os.close(m); os.close(ec); os.close(ea)
print('HOSTILE DONE', flush=True)
"#;

/// A server that reads and writes each connection with a timeout until it ends
/// and checks that no read returns more than it asked for; it must neither crash
/// nor hang, whatever the peer wrote into the mapping (after [`PY_LISTEN`]).
const ROBUST_SERVER: &str = r#"
import socket, struct, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
l = listen(port)
import time
outcomes, longest = {}, 0.0
for i in range(n):
    c, _ = l.accept()
    # Blocking calls bounded by the kernel's timeouts (not Python's settimeout, which
    # makes the socket non-blocking and waits in poll): a blocked recv is what posts
    # its buffer for a rendezvous, so forged completions meet a real post.
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack('ll', 2, 0))
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack('ll', 2, 0))
    how = 'eof'
    try:
        while True:
            want = 100 if i % 2 else 4000
            t0 = time.monotonic()
            try:
                b = c.recv(want)
            finally:
                longest = max(longest, time.monotonic() - t0)
            assert len(b) <= want, 'recv(%d) returned %d bytes' % (want, len(b))
            if not b:
                break
            c.sendall(b[:50])
    except socket.timeout:
        how = 'timeout'
    except (ConnectionError, OSError) as e:
        how = type(e).__name__
    outcomes[how] = outcomes.get(how, 0) + 1
    c.close()
print('OUTCOMES', outcomes, flush=True)
print('LONGEST_RECV_S %.2f' % longest, flush=True)
"#;

/// A server that writes 16 MiB to each connection it accepts (blocking, a 5 s
/// send timeout) and says how each write ended and how long it took.
const BIG_WRITER: &str = r#"
import socket, struct, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
l = listen(port)
for i in range(n):
    c, _ = l.accept()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack('ll', 5, 0))
    time.sleep(0.3)
    t0 = time.monotonic()
    try:
        c.sendall(bytes(16 << 20))
        how = 'sent'
    except (ConnectionError, OSError) as e:
        how = type(e).__name__
    print('WRITE %d %s %.2f' % (i, how, time.monotonic() - t0), flush=True)
    c.close()
"#;

/// Runs victim server `sc` (a 64 KiB ring) against [`HOSTILE_PEER`] at `hp` with
/// `seeds` connections of `mode`; both must finish, the victim without failing or
/// hanging. Returns the victim's output and the hostile peer's standard output.
fn against_hostile_peer(
    mut sc: Command,
    hp: &PathBuf,
    port: u16,
    seeds: usize,
    mode: &str,
) -> ((bool, String, String), String) {
    sc.env("STRAIT_RING_SIZE", "65536");
    let s = start(&mut sc, "server", "LISTENING");
    let mut hc = Command::new(PYTHON);
    hc.arg(hp).args([port.to_string(), seeds.to_string(), "1".into(), mode.into()]);
    hc.stdout(Stdio::piped()).stderr(Stdio::piped());
    let h = finish(hc.spawn().expect("hostile peer"), Duration::from_secs(60));
    let server = finish(s, Duration::from_secs(30));
    assert!(h.0, "hostile peer: {h:?}");
    assert!(server.0, "the victim failed or hung: {server:?}");
    (server, h.1)
}

/// A server that makes one blocked `recv(4000)` (a 0.5 s receive timeout) on the
/// connection it accepts, and says how it ended and how long it took.
const TIMED_READER: &str = r#"
import socket, struct, sys, time
port = int(sys.argv[1])
l = listen(port)
c, _ = l.accept()
c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack('ll', 0, 500000))
t0 = time.monotonic()
try:
    how = 'got %d' % len(c.recv(4000))
except (ConnectionError, OSError) as e:
    how = type(e).__name__
print('READ %s %.2f' % (how, time.monotonic() - t0), flush=True)
c.close()
"#;

/// A writer that took a reader's posted buffer and is stopped in the middle of
/// filling it (a debugger, job control) for longer than the reader's grace keeps
/// the connection: the reader, which cannot return while another process may
/// still write into its buffer, waits for it past its timeout (it reset after
/// its grace before). A writer that is not stopped and holds the post is still
/// cut off after the grace (`hostile_round`'s 'forge' and 'hold' scenarios).
#[test]
fn a_writer_stopped_while_filling_a_post_keeps_the_connection() {
    if !can_run() {
        return;
    }
    let (port, [srv, hp]) = port_and_scripts([
        ("timed-reader", &[PY_LISTEN, TIMED_READER].concat()),
        ("hostile-peer", HOSTILE_PEER),
    ]);
    let mut sc = victim(&srv, &[&port.to_string()]);
    sc.env("STRAIT_RENDEZVOUS_MIN", "64");
    let (server, _) = against_hostile_peer(sc, &hp, port, 1, "stopwriter");
    let read = server.1.lines().find_map(|l| l.strip_prefix("READ ")).unwrap_or_else(|| panic!("{server:?}"));
    let (how, secs) = read.rsplit_once(' ').expect("READ how secs");
    let secs: f64 = secs.parse().expect("seconds");
    assert!(how == "got 100" && secs >= 2.0, "{read}: {server:?}");
    assert_eq!(stat(&server.2, "accelerated"), 1, "{}", server.2);
}

/// A writer that split a large write (the reader reads half from the writer's
/// buffer) waits until the reader is done with that buffer. A reader that takes
/// the offer and never finishes costs the write at most its grace (1 s), then the
/// connection, not a hang; one that reports a wrong count gets the half written
/// by the writer, and the write completes. A reader stopped in the middle for
/// longer than the grace (a debugger, job control) keeps the connection: the
/// write waits for it, as the kernel's would.
///
/// The offer stands only while the writer copies its own half (a millisecond or two for
/// 8 MiB), so a hostile reader without a core at that moment misses it and
/// the writer, rightly, writes everything itself; each scenario is judged on a
/// round where the reader took the offer (up to six rounds).
#[test]
fn a_reader_that_takes_a_split_and_never_finishes_cannot_hang_the_writer() {
    if !can_run() {
        return;
    }
    let scenarios = ["stall", "misread", "stopped"];
    let mut judged = [false; 3];
    for round in 0..6 {
        let (port, [srv, hp]) = port_and_scripts([
            ("big-writer", &[PY_LISTEN, BIG_WRITER].concat()),
            ("hostile-peer", HOSTILE_PEER),
        ]);
        let (server, peer) =
            against_hostile_peer(victim(&srv, &[&port.to_string(), "3"]), &hp, port, 3, "splits");
        let writes: Vec<(String, f64)> = server
            .1
            .lines()
            .filter_map(|l| {
                let mut w = l.strip_prefix("WRITE ")?.split(' ').skip(1);
                Some((w.next()?.to_owned(), w.next()?.parse().ok()?))
            })
            .collect();
        assert_eq!(writes.len(), 3, "{server:?}");
        for (i, scenario) in scenarios.iter().enumerate() {
            let took = peer.lines().any(|l| l == format!("SPLIT {i} {scenario} took"));
            let missed = peer.lines().any(|l| l == format!("SPLIT {i} {scenario} missed"));
            assert!(took != missed, "round {round}: no report of {scenario}: {peer}");
            let (how, secs) = (&writes[i].0, writes[i].1);
            if missed {
                // Not offered in time: the writer wrote it all, at once.
                assert_eq!(how, "sent", "round {round} {scenario} (missed): {writes:?} {server:?}");
                continue;
            }
            match *scenario {
                // The stalled split: the connection goes after the grace (the hostile
                // reader stalls for 8 s, then closes).
                "stall" => assert!(how != "sent" && (0.9..3.0).contains(&secs), "{writes:?} {server:?}"),
                // The wrong count: the writer writes the reader's half itself.
                "misread" => assert_eq!(how, "sent", "{writes:?} {server:?}"),
                // The reader stopped for 2.5 s: the write waits past the grace and
                // completes.
                _ => assert!(how == "sent" && secs >= 2.0, "{writes:?} {server:?}"),
            }
            judged[i] = true;
        }
        assert!(stat(&server.2, "accelerated") >= 2, "{}", server.2);
        if judged.iter().all(|&j| j) {
            return;
        }
        eprintln!("round {round}: judged {judged:?}; another round");
    }
    panic!("the hostile reader never took the offer in some scenario in six rounds: {judged:?}");
}

/// One victim server, `seeds` hostile connections; `messages`: both ask for message
/// mode (and the victim posts its buffers for a rendezvous).
fn hostile_round(messages: bool) {
    let seeds: usize = std::env::var("STRAIT_HOSTILE_SEEDS").ok().and_then(|v| v.parse().ok()).unwrap_or(24);
    let (port, [srv, hp]) = port_and_scripts([
        ("robust-server", &[PY_LISTEN, ROBUST_SERVER].concat()),
        ("hostile-peer", HOSTILE_PEER),
    ]);
    let mut sc = victim(&srv, &[&port.to_string(), &seeds.to_string()]);
    // Every blocked recv of the victim posts its buffer for a rendezvous (in a
    // byte stream as in message mode), so that forged completions meet one.
    sc.env("STRAIT_RING_SIZE", "65536").env("STRAIT_RENDEZVOUS_MIN", "64");
    if messages {
        sc.env("STRAIT_MESSAGES", "1");
    }
    let s = start(&mut sc, "server", "LISTENING");
    // The hostile peer runs as root: it is the victim's legitimate peer, which
    // follows the setup and then misbehaves.
    let mut hc = Command::new(PYTHON);
    hc.arg(&hp)
        .args([
            port.to_string(),
            seeds.to_string(),
            "1".into(),
            if messages { "messages" } else { "stream" }.into(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let h = finish(hc.spawn().expect("hostile peer"), Duration::from_secs(120));
    let server = finish(s, Duration::from_secs(60));
    assert!(h.0, "hostile peer: {h:?}");
    assert!(server.0, "the victim failed (crash, oversized read or hang): {server:?}");
    assert!(server.1.contains("OUTCOMES"), "{server:?}");
    // A recv waits at most its timeout (2 s) plus the step-lock bound (2 s); a peer
    // holding a lock word with a live pid held it for ever before.
    let longest: f64 = server
        .1
        .lines()
        .find_map(|l| l.strip_prefix("LONGEST_RECV_S ")?.trim().parse().ok())
        .expect("longest recv");
    assert!(longest < 5.0, "a recv waited {longest} s: {server:?}");
    assert!(stat(&server.2, "accelerated") >= 1, "the hostile peers were attached: {}", server.2);
    let _ = std::io::stderr().write_all(server.1.as_bytes());
}

#[test]
fn a_hostile_peer_writing_random_words_into_the_mapping_never_crashes_or_hangs_the_victim() {
    if can_run() {
        hostile_round(false);
    }
}

/// The same in message mode (forged rendezvous completions, lengths and pids, as in
/// the byte stream above).
#[test]
fn a_hostile_peer_cannot_forge_rendezvous_completions_in_message_mode() {
    if can_run() {
        hostile_round(true);
    }
}

/// Squats connectors' per-connection names (`strait.c.<netns>.<socket inode>`),
/// each as soon as it reads the inode on stdin, then reports what it got (after
/// [`PY_SQUAT`]).
const CONN_SQUATTER: &str = r#"
import os, sys
secs = float(sys.argv[1])
ns = os.stat('/proc/self/ns/net').st_ino
squat([], 16, secs, 4096, False, lambda ino: f'strait.c.{ns}.{int(ino)}')
"#;

/// Two SO_REUSEPORT servers (separate processes, as prefork or reload setups run
/// them): the kernel spreads connections over both, and the one without the hello
/// asks the connector at its per-connection name (path B).
const REUSEPORT_SERVER: &str = r#"
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
l = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
l.bind(('127.0.0.1', port))
l.listen(64)
l.settimeout(15)
print('LISTENING', flush=True)
try:
    while True:
        c, _ = l.accept()
        c.settimeout(10)
        b = c.recv(100)
        c.sendall(b)
        c.close()
except socket.timeout:
    pass
"#;

/// Connects `count` times, one line echoed each; before each connect it tells its
/// socket's inode (`INO n`) and waits for a line on stdin: the test hands the
/// inode to the squatter, as an attacker that predicted it would have it.
const INODE_CLIENT: &str = r#"
import os, socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
ok = 0
for p in range(count):
    c = socket.socket()
    print('INO', os.fstat(c.fileno()).st_ino, flush=True)
    sys.stdin.readline()
    c.settimeout(10)
    c.connect(('127.0.0.1', port))
    m = b'line %d\n' % p
    c.sendall(m)
    assert c.recv(100) == m, 'echo differs'
    c.close()
    ok += 1
print('ECHO OK %d' % ok, flush=True)
"#;

/// Path B under attack: another user holds the per-connection names of the
/// client's sockets (handed each inode before the connect: stronger than any real
/// attacker, who must guess it before the connector binds the name). The acceptor that asks a connector checks who holds the name
/// before it sends anything, so the squatter gets nothing; every connection is
/// answered, intact (by shared memory where the hello reached the acceptor, else
/// by the kernel).
#[test]
fn a_squatter_of_connectors_names_gets_nothing_from_path_b() {
    if !can_run() {
        return;
    }
    let (port, [sq, srv, cli]) = port_and_scripts([
        ("conn-squatter", &[PY_SQUAT, CONN_SQUATTER].concat()),
        ("reuseport-server", REUSEPORT_SERVER),
        ("inode-client", INODE_CLIENT),
    ]);
    let count = 16usize;
    let mut a = attacker(&sq, &["8"]).stdin(Stdio::piped()).spawn().expect("squatter");
    wait_line(&mut a, "READY", Duration::from_secs(10));
    let mut servers = Vec::new();
    for _ in 0..2 {
        servers.push(start(&mut victim(&srv, &[&port.to_string(), "0"]), "server", "LISTENING"));
    }
    let mut client = victim(&cli, &[&port.to_string(), &count.to_string()])
        .env("STRAIT_ATTACH_TIMEOUT_MS", "200")
        .stdin(Stdio::piped())
        .spawn()
        .expect("client");
    let (mut to_squatter, mut to_client) =
        (a.stdin.take().expect("squatter stdin"), client.stdin.take().expect("client stdin"));
    for _ in 0..count {
        let ino = wait_line(&mut client, "INO ", Duration::from_secs(30));
        let ino = ino.trim_start_matches("INO ").to_string();
        writeln!(to_squatter, "{ino}").expect("tell the squatter");
        wait_line(&mut a, &format!("SQUATTED {ino}"), Duration::from_secs(10));
        writeln!(to_client, "go").expect("let the client connect");
    }
    drop((to_squatter, to_client));
    let c = finish(client, Duration::from_secs(60));
    let outs: Vec<_> = servers.into_iter().map(|s| finish(s, Duration::from_secs(30))).collect();
    // The squatter reports when its time is up.
    no_leak(&squatter_report(a));
    assert!(c.0 && c.1.contains(&format!("ECHO OK {count}")), "client: {c:?}");
    for s in &outs {
        assert!(s.0, "server: {s:?}");
    }
    // The acceptors that got no hello asked, and refused the squatted names.
    let refused: usize = outs.iter().map(|s| stat(&s.2, "refused")).sum();
    assert!(refused >= 1, "path B was not exercised: {outs:?}");
}
