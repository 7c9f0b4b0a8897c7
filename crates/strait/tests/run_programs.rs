//! `strait run` with real, unchanged programs from Debian's packages (installed by
//! the tests when missing), both ends under strait, checked for correct answers and
//! for the shared-memory path really being used (`--stats` counts).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{ensure, preload_lib, run_for, strait_run, STRAIT};

/// Kills the child when dropped (a failing test leaves no server behind).
struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Waits until a TCP socket listens on `port` (any address, IPv4 or IPv6), read from
/// /proc/net/tcp{,6} rather than by connecting: a probe connection is a client to
/// the server (iperf3 takes it for a test's control connection and, still busy with
/// it, turns the real client away with a reset).
fn wait_listening(port: u16) {
    let end = Instant::now() + Duration::from_secs(15);
    let want = format!(":{port:04X}");
    let listening = || {
        ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
            std::fs::read_to_string(f).unwrap_or_default().lines().skip(1).any(|l| {
                let v: Vec<&str> = l.split_whitespace().collect();
                v.len() > 3 && v[1].ends_with(&want) && v[3] == "0A"
            })
        })
    };
    while !listening() {
        assert!(Instant::now() < end, "server on port {port} never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts a server under `strait run` with its output discarded and waits until it
/// listens on `port`; killed when dropped.
fn quiet_server(args: &[&str], port: &str, what: &str) -> Killed {
    let server = Killed(
        strait_run(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: {e}")),
    );
    wait_listening(port.parse().expect("port"));
    server
}

fn accelerated(stderr: &str) -> usize {
    stderr
        .lines()
        .filter_map(|l| l.split("accelerated ").nth(1)?.split(' ').next()?.parse::<usize>().ok())
        .sum()
}

#[test]
fn run_preloads_the_library_and_passes_settings() {
    let out = run_for(
        &mut strait_run(&[
            "--ring-size",
            "64K",
            "--spin-us",
            "3",
            "--stats",
            "--",
            "sh",
            "-c",
            "echo \"$LD_PRELOAD|$STRAIT_RING_SIZE|$STRAIT_SPIN_US|$STRAIT_STATS\"",
        ]),
        Duration::from_secs(30),
    )
    .expect("strait run finished");
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.trim().ends_with("libstrait_preload.so|64K|3|1"), "{s}");
    let missing =
        run_for(&mut strait_run(&["--", "/nonexistent/program"]), Duration::from_secs(30)).expect("ran");
    assert_eq!(missing.status.code(), Some(127));
}

#[test]
fn sockperf_ping_pong_with_both_ends_under_strait() {
    ensure("sockperf", "sockperf");
    let port = free_port().to_string();
    let _server = quiet_server(
        &["--", "sockperf", "sr", "--tcp", "-i", "127.0.0.1", "-p", &port],
        &port,
        "sockperf server",
    );
    for (under_strait, msg) in [(true, "14"), (true, "1024"), (false, "14")] {
        // sockperf sizes its sequence table for at most 600K messages/s unless told
        // otherwise, and strait goes faster than that.
        let args = ["pp", "--tcp", "-i", "127.0.0.1", "-p", &port, "-t", "1", "-m", msg, "--mps", "5000000"];
        let mut c = if under_strait {
            let mut c = strait_run(&["--stats", "--", "sockperf"]);
            c.args(args);
            c
        } else {
            let mut c = Command::new("sockperf");
            c.args(args).env_remove("LD_PRELOAD");
            c
        };
        let out = run_for(&mut c, Duration::from_secs(30)).expect("sockperf client finished in time");
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        assert!(text.contains("Summary: Latency is"), "{text}");
        assert!(
            text.contains("# dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0")
        );
        if under_strait {
            assert_eq!(accelerated(&String::from_utf8_lossy(&out.stderr)), 1, "{text}");
        }
    }
}

#[test]
fn redis_benchmark_set_get_with_both_ends_under_strait() {
    redis_benchmark_set_get(false);
}

/// redis-server as its own user (Debian's `redis`, dropped to by setpriv before it
/// starts), redis-benchmark as root: a client and a server of different users,
/// every connection accelerated.
#[test]
fn redis_server_as_its_own_user_and_a_root_client_are_accelerated() {
    redis_benchmark_set_get(true);
}

fn redis_benchmark_set_get(own_user: bool) {
    ensure("redis-server", "redis-server");
    ensure("redis-benchmark", "redis-tools");
    ensure("setpriv", "util-linux");
    let port = free_port().to_string();
    let mut args =
        vec!["--", "redis-server", "--port", &port, "--save", "", "--appendonly", "no", "--dir", "/tmp"];
    if own_user {
        args.splice(1..1, ["setpriv", "--reuid=redis", "--regid=redis", "--clear-groups", "--inh-caps=-all"]);
    }
    let _server = quiet_server(&args, &port, "redis-server");
    let out = run_for(
        &mut strait_run(&[
            "--stats",
            "--",
            "redis-benchmark",
            "-p",
            &port,
            "-q",
            "-n",
            "2000",
            "-t",
            "set,get",
        ]),
        Duration::from_secs(60),
    )
    .expect("redis-benchmark finished in time");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{text}\n{err}");
    assert!(!text.contains("WARNING") && !err.contains("WARNING"), "{text}\n{err}");
    for t in ["SET: ", "GET: "] {
        assert!(
            text.lines().any(|l| l.trim_start().starts_with(t) && l.contains("requests per second")),
            "{text}"
        );
    }
    // 50 benchmark clients, plus the configuration fetch.
    assert!(accelerated(&err) >= 50, "{err}");
    // The data really arrived: one key holding the benchmark's 3-byte value, read
    // through strait and through the kernel alike.
    for under_strait in [true, false] {
        let mut c = if under_strait {
            strait_run(&["--", "redis-cli", "-p", &port, "strlen", "key:__rand_int__"])
        } else {
            let mut c = Command::new("redis-cli");
            c.args(["-p", &port, "strlen", "key:__rand_int__"]).env_remove("LD_PRELOAD");
            c
        };
        let out = run_for(&mut c, Duration::from_secs(30)).expect("redis-cli");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "3", "under strait: {under_strait}");
    }
}

/// Stops the nginx master named in a pid file when dropped (and reaps it when it
/// runs in the foreground, `daemon off;`).
struct NginxGuard(PathBuf, Option<std::process::Child>);
impl Drop for NginxGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.1.take() {
            if let Ok(pid) = std::fs::read_to_string(&self.0) {
                let _ = Command::new("kill").arg(pid.trim()).status();
            }
            let end = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
            return;
        }
        if let Ok(pid) = std::fs::read_to_string(&self.0) {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                let _ = Command::new("kill").arg(pid.to_string()).status();
            }
        }
    }
}

/// Starts nginx under strait in its default daemon mode (fork, setsid, fork) with two
/// workers sharing the listener on 127.0.0.1:`port`, serving `dir`/www with sendfile
/// on; the workers run as Debian's default user, www-data, while the clients run as
/// root (a connection between two users, proven by tokens). Waits until it listens.
fn start_nginx(dir: &std::path::Path, port: u16, stats: bool) -> NginxGuard {
    start_nginx_as(dir, port, stats, true)
}

/// As [`start_nginx`]; `daemon: false` runs it in the foreground (`daemon off;`, as
/// containers and service managers do), a child of this test.
fn start_nginx_as(dir: &std::path::Path, port: u16, stats: bool, daemon: bool) -> NginxGuard {
    let d = dir.display();
    let foreground = if daemon { "" } else { "daemon off;\n" };
    let conf = format!(
        "{foreground}user www-data;\nworker_processes 2;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{ worker_connections 64; }}\n\
         http {{ access_log off; sendfile on; client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n\
         server {{ listen 127.0.0.1:{port}; root {d}/www; }} }}\n"
    );
    std::fs::write(dir.join("nginx.conf"), conf).expect("conf");
    let conf_path = dir.join("nginx.conf").display().to_string();
    let prefix = dir.display().to_string();
    let mut args = vec!["--", "nginx", "-c", &conf_path, "-p", &prefix];
    if stats {
        args.insert(0, "--stats");
    }
    let pid_file = dir.join("nginx.pid");
    if !daemon {
        // The workers' stderr is the master's: the error log takes the stats lines
        // only in daemon mode, so here they go to a file of our own.
        let log = std::fs::File::create(dir.join("error.log")).expect("log");
        let child =
            strait_run(&args).stdout(std::process::Stdio::null()).stderr(log).spawn().expect("nginx started");
        let guard = NginxGuard(pid_file, Some(child));
        wait_listening(port);
        return guard;
    }
    let guard = NginxGuard(pid_file, None);
    let started = run_for(&mut strait_run(&args), Duration::from_secs(30)).expect("nginx started");
    assert!(started.status.success(), "{}", String::from_utf8_lossy(&started.stderr));
    wait_listening(port);
    guard
}

#[test]
fn nginx_daemon_with_two_workers_serves_files_to_curl_under_strait() {
    ensure("nginx", "nginx");
    ensure("curl", "curl");
    let dir = std::env::temp_dir().join(format!("strait-nginx-{}", std::process::id()));
    let www = dir.join("www");
    std::fs::create_dir_all(&www).expect("mkdir");
    let big: Vec<u8> = (0..1_500_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    std::fs::write(www.join("big.bin"), &big).expect("write");
    std::fs::write(www.join("small.txt"), b"hello from nginx\n").expect("write");
    let port = free_port();
    let _guard = start_nginx(&dir, port, false);
    for (file, body) in [("small.txt", b"hello from nginx\n".to_vec()), ("big.bin", big.clone())] {
        for under_strait in [true, false] {
            let url = format!("http://127.0.0.1:{port}/{file}");
            let mut c = if under_strait {
                strait_run(&["--stats", "--", "curl", "-s", "--max-time", "20", &url])
            } else {
                let mut c = Command::new("curl");
                c.args(["-s", "--max-time", "20", &url]).env_remove("LD_PRELOAD");
                c
            };
            let out = run_for(&mut c, Duration::from_secs(30)).expect("curl finished");
            assert!(out.status.success(), "curl {file} (strait: {under_strait}) failed");
            assert!(
                out.stdout == body,
                "{file} (strait: {under_strait}): body of {} bytes differs",
                out.stdout.len()
            );
            if under_strait {
                assert_eq!(accelerated(&String::from_utf8_lossy(&out.stderr)), 1);
            }
        }
    }
    drop(_guard);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Checks every response's status and body (Lua strings are interned: comparing the
/// body with the file is one pointer comparison) and reports the counts at the end.
const WRK_CHECK: &str = r#"local expected = io.open(os.getenv("STRAIT_WRK_FILE"), "rb"):read("*a")
local threads = {}
function setup(thread)
  table.insert(threads, thread)
end
function init(args)
  checked = 0
  mismatches = 0
end
function response(status, headers, body)
  checked = checked + 1
  if status ~= 200 or body ~= expected then
    mismatches = mismatches + 1
  end
end
function done(summary, latency, requests)
  local c, m = 0, 0
  for _, t in ipairs(threads) do
    c = c + t:get("checked")
    m = m + t:get("mismatches")
  end
  io.write(string.format("strait-check checked %d mismatches %d\n", c, m))
end
"#;

#[test]
fn nginx_daemon_with_two_workers_serves_a_file_to_wrk_under_strait() {
    nginx_serves_a_file_to_wrk(true, false);
}

/// The same with `daemon off;`: the master stays in the foreground, as containers
/// run it; workers as www-data, wrk as root.
#[test]
fn nginx_in_the_foreground_with_two_workers_serves_a_file_to_wrk_under_strait() {
    nginx_serves_a_file_to_wrk(false, false);
}

/// A connection per request (`Connection: close`): wrk writes each request as soon
/// as its connect completes, before nginx has accepted (it goes out early, to the
/// ring and the kernel socket), while a worker may attach and sleep in epoll at that
/// very moment. A lost wake-up there stalls the connection until wrk's timeout,
/// which it reports as a socket error.
#[test]
fn nginx_serves_a_connection_per_request_to_wrk_under_strait() {
    nginx_serves_a_file_to_wrk(false, true);
}

fn nginx_serves_a_file_to_wrk(daemon: bool, close: bool) {
    ensure("nginx", "nginx");
    ensure("wrk", "wrk");
    let dir = std::env::temp_dir().join(format!("strait-nginx-wrk-{}-{daemon}-{close}", std::process::id()));
    let www = dir.join("www");
    std::fs::create_dir_all(&www).expect("mkdir");
    let body: Vec<u8> = (0..100_000u32).map(|i| (i.wrapping_mul(2_246_822_519) >> 13) as u8).collect();
    let file = www.join("f.bin");
    std::fs::write(&file, &body).expect("write");
    let script = dir.join("check.lua");
    std::fs::write(&script, WRK_CHECK).expect("script");
    let port = free_port();
    // The workers' stderr is the error log in daemon mode: their stats lines land there.
    let guard = start_nginx_as(&dir, port, true, daemon);
    let url = format!("http://127.0.0.1:{port}/f.bin");
    let script_s = script.display().to_string();
    let mut args = vec!["--stats", "--", "wrk", "-t", "2", "-c", "4", "-d", "2s", "-s", &script_s];
    if close {
        // A stalled request counts as a timeout after 1 s (wrk's default is 2 s,
        // the whole run).
        args.extend(["-H", "Connection: close", "--timeout", "1s"]);
    }
    args.push(&url);
    let out = run_for(strait_run(&args).env("STRAIT_WRK_FILE", &file), Duration::from_secs(60))
        .expect("wrk finished in time");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{text}\n{err}");
    assert!(!text.contains("Non-2xx"), "{text}");
    if close {
        // No request stalled (timeout) or failed; a rare failed connect (about one
        // in 10^4, with the library's build before this test too, never on the
        // kernel alone) is a known open bug, reported apart: see docs/PERFORMANCE.md.
        let errors = text.lines().find_map(|l| l.trim().strip_prefix("Socket errors: ")).unwrap_or("");
        let count = |what: &str| -> u64 {
            errors.split(", ").find_map(|p| p.strip_prefix(what)?.trim().parse().ok()).unwrap_or(0)
        };
        assert_eq!((count("read "), count("write "), count("timeout ")), (0, 0, 0), "{text}");
        assert!(count("connect ") <= 2, "{text}");
    } else {
        assert!(!text.contains("Socket errors"), "{text}");
    }
    let requests: u64 = text
        .lines()
        .find_map(|l| l.split_once(" requests in ").and_then(|(n, _)| n.trim().parse().ok()))
        .expect("wrk's request count");
    assert!(requests >= 200, "only {requests} requests\n{text}");
    let checked: Vec<u64> = text
        .lines()
        .find_map(|l| l.strip_prefix("strait-check checked "))
        .map(|l| l.split(" mismatches ").filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_default();
    assert_eq!(checked.len(), 2, "{text}");
    assert!(checked[0] >= requests && checked[1] == 0, "{text}");
    // wrk's 4 connections (and those it opened again after nginx's keepalive_requests)
    // were attached by the nginx workers.
    assert!(accelerated(&err) >= 4, "{err}");
    // The workers count them too (their stats go to the error log when they exit).
    drop(guard);
    let log = dir.join("error.log");
    let end = Instant::now() + Duration::from_secs(10);
    let served = loop {
        let n = accelerated(&std::fs::read_to_string(&log).unwrap_or_default());
        if n >= 4 || Instant::now() > end {
            break n;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(served >= 4, "nginx attached {served}:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    let _ = std::fs::remove_dir_all(&dir);
}

/// An asyncio (epoll) echo server and client.
const ASYNCIO_ECHO: &str = r#"import asyncio, sys, hashlib
async def handle(r, w):
    while True:
        data = await r.read(65536)
        if not data:
            break
        w.write(data)
        await w.drain()
    w.close()
async def server(port):
    srv = await asyncio.start_server(handle, '127.0.0.1', port)
    print("LISTENING", flush=True)
    async with srv:
        await srv.serve_forever()
async def client(port):
    r, w = await asyncio.open_connection('127.0.0.1', port)
    total = 0
    h1, h2 = hashlib.sha256(), hashlib.sha256()
    for i in range(200):
        msg = bytes([(i * 7 + j) % 251 for j in range(1 + (i * 997) % 20000)])
        h1.update(msg)
        w.write(msg)
        await w.drain()
        got = await r.readexactly(len(msg))
        h2.update(got)
        total += len(msg)
    w.close()
    print("asyncio ok", total, h1.hexdigest() == h2.hexdigest(), flush=True)
port = int(sys.argv[2])
asyncio.run(server(port) if sys.argv[1] == "server" else client(port))
"#;

fn python() -> String {
    ensure("python3", "python3");
    let out =
        Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().expect("python3");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Writes `text` as `name` into a fresh temporary directory tagged `tag`: the
/// directory (to remove after) and the script's path.
fn temp_script(tag: &str, name: &str, text: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("strait-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let script = dir.join(name);
    std::fs::write(&script, text).expect("script");
    let path = script.display().to_string();
    (dir, path)
}

#[test]
fn python_asyncio_streams_and_threaded_http_server_under_strait() {
    let py = python();
    let (dir, script) = temp_script("python", "aio.py", ASYNCIO_ECHO);

    let port = free_port().to_string();
    let server = quiet_server(&["--", &py, &script, "server", &port], &port, "asyncio server");
    let out =
        run_for(&mut strait_run(&["--stats", "--", &py, &script, "client", &port]), Duration::from_secs(60))
            .expect("asyncio client finished");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("asyncio ok 2020500 True"), "{text}");
    assert_eq!(accelerated(&String::from_utf8_lossy(&out.stderr)), 1);
    drop(server);

    // http.server is a ThreadingHTTPServer: one thread per connection.
    ensure("curl", "curl");
    let www = dir.join("www");
    std::fs::create_dir_all(&www).expect("mkdir");
    let body: Vec<u8> = (0..700_000u32).map(|i| (i.wrapping_mul(40_503) >> 7) as u8).collect();
    std::fs::write(www.join("f.bin"), &body).expect("write");
    let port = free_port().to_string();
    let www_s = www.display().to_string();
    let _server = quiet_server(
        &["--", &py, "-m", "http.server", &port, "--bind", "127.0.0.1", "--directory", &www_s],
        &port,
        "http.server",
    );
    for _ in 0..3 {
        let url = format!("http://127.0.0.1:{port}/f.bin");
        let out = run_for(
            &mut strait_run(&["--stats", "--", "curl", "-s", "--max-time", "20", &url]),
            Duration::from_secs(30),
        )
        .expect("curl finished");
        assert!(out.status.success() && out.stdout == body, "body of {} bytes differs", out.stdout.len());
        assert_eq!(accelerated(&String::from_utf8_lossy(&out.stderr)), 1);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn iperf3_transfer_with_both_ends_under_strait() {
    ensure("iperf3", "iperf3");
    let port = free_port().to_string();
    let _server = quiet_server(&["--", "iperf3", "-s", "-p", &port], &port, "iperf3 server");
    let out = run_for(
        &mut strait_run(&["--stats", "--", "iperf3", "-c", "127.0.0.1", "-p", &port, "-n", "200M", "-J"]),
        Duration::from_secs(60),
    )
    .expect("iperf3 client finished");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).expect("iperf3 JSON");
    let sent = v["end"]["sum_sent"]["bytes"].as_u64().unwrap_or_else(|| panic!("no bytes sent in {text}"));
    let received =
        v["end"]["sum_received"]["bytes"].as_u64().unwrap_or_else(|| panic!("no bytes received in {text}"));
    // `-n` stops the test once at least that much was sent: a block or a few more
    // under load (iperf3 documents it; the kernel path does the same).
    assert!((200 << 20..=(200 << 20) + 16 * 131_072).contains(&sent), "sent {sent}");
    // iperf3's server stops counting at the client's TEST_END, so bytes still in
    // flight are not reported (over kernel TCP too, where the gap is larger); the
    // bytes themselves are checked by strait-preload's hashed transfer test.
    assert!(received <= sent && received >= sent / 2, "received {received} of {sent}");
    // The control connection and the data connection.
    assert_eq!(accelerated(&String::from_utf8_lossy(&out.stderr)), 2);
}

/// An epoll server answering one request per connection and closing it, and a
/// client keeping four non-blocking connections in flight in one epoll set,
/// reconnecting after each answer: connection churn, as a `Connection: close` HTTP
/// load generator makes it. The client prints its request count and slowest
/// request.
const CHURN: &str = r#"import socket, select, sys, time
mode, port = sys.argv[1], int(sys.argv[2])
if mode in ("server", "reuseport"):
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if mode == "reuseport":
        l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    l.bind(("127.0.0.1", port)); l.listen(128); l.setblocking(False)
    print("LISTENING", flush=True)
    ep = select.epoll(); ep.register(l.fileno(), select.EPOLLIN); conns = {}
    while True:
        for fd, _ in ep.poll():
            if fd == l.fileno():
                try:
                    c, _ = l.accept()
                except BlockingIOError:
                    continue
                c.setblocking(False); conns[c.fileno()] = c; ep.register(c.fileno(), select.EPOLLIN)
                continue
            c = conns[fd]
            try:
                d = c.recv(100)
            except BlockingIOError:
                continue
            ep.unregister(fd); del conns[fd]
            if d:
                c.sendall(b"answer:" + d)
            c.close()
total = int(sys.argv[3])
ep = select.epoll(); conns = {}; slowest = 0.0; done = 0
def start():
    s = socket.socket(); s.setblocking(False); s.connect_ex(("127.0.0.1", port))
    conns[s.fileno()] = [s, time.perf_counter(), False]; ep.register(s.fileno(), select.EPOLLOUT)
for _ in range(4):
    start()
while done < total:
    for fd, _ in ep.poll(5):
        s, t0, sent = conns[fd]
        try:
            if not sent:
                s.send(b"question"); conns[fd][2] = True; ep.modify(fd, select.EPOLLIN); continue
            d = s.recv(100)
        except BlockingIOError:
            continue
        if d:
            assert d == b"answer:question", d
            continue
        ep.unregister(fd); s.close(); del conns[fd]
        slowest = max(slowest, time.perf_counter() - t0); done += 1; start()
print(f"done {done} slowest_ms {slowest * 1000:.1f}", flush=True)
"#;

/// Runs the churn client (`CHURN`) for `n` connections against `port`: (answered,
/// slowest ms, connections the client's library accelerated).
fn churn_client(py: &str, script: &str, port: &str, n: usize) -> (usize, f64, usize) {
    let out = run_for(
        // (Every short connection set up: the churn of accelerated connections is
        // what is tested, not the choice of `STRAIT_SETUP`'s default.)
        strait_run(&["--stats", "--", py, script, "client", port, &n.to_string()])
            .env("STRAIT_SETUP", "always"),
        Duration::from_secs(120),
    )
    .expect("churn client finished");
    let text = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}{stderr}");
    let field = |name: &str| -> f64 {
        text.split(name)
            .nth(1)
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    (field("done ") as usize, field("slowest_ms "), accelerated(&stderr))
}

#[test]
fn two_servers_sharing_a_port_by_reuseport_both_attach_their_connections() {
    // Two independent epoll servers on one port with SO_REUSEPORT: the kernel
    // spreads connections over both, but only the first holds the rendezvous name,
    // so every hello goes to it. The second claims its connections by asking their
    // connectors (path B), which answer from epoll_wait. Before, it did not try,
    // and its connectors waited the 1 s attach timeout and fell back to the kernel.
    let py = python();
    let (dir, script) = temp_script("reuseport", "churn.py", CHURN);
    let port = free_port().to_string();
    let servers: Vec<Killed> = (0..2)
        .map(|_| {
            let mut c = strait_run(&["--", &py, &script, "reuseport", &port])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("reuseport server");
            let mut line = String::new();
            let out = c.stdout.take().expect("stdout");
            std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).expect("server line");
            assert_eq!(line.trim(), "LISTENING");
            Killed(c)
        })
        .collect();
    let (done, slowest, made) = churn_client(&py, &script, &port, 300);
    assert!(done >= 300);
    // (The bugs cost 1 s each; the bound leaves room for a loaded machine.)
    assert!(slowest < 500.0, "a request took {slowest} ms (a connection waited for the attach timeout)");
    assert!((done..=done + 4).contains(&made), "{made} accelerated for {done} answered");
    // The hellos of connections the other server claimed do not pile up in the one
    // holding the name (each keeps four descriptors until it is dropped).
    for s in &servers {
        let fds = std::fs::read_dir(format!("/proc/{}/fd", s.0.id())).expect("fds").count();
        assert!(fds < 150, "a server holds {fds} descriptors after the run");
    }
    drop(servers);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn connection_churn_in_epoll_sets_never_stalls() {
    // 2000 short connections, four in flight, each answered and closed by an epoll
    // server; none may take 150 ms. Two bugs made some wait for a timeout: the acceptor rang the
    // connector's bell on a descriptor number it had just given up (a client
    // asleep in epoll slept on for 1 s), and it recorded a connector's address
    // before the connect had chosen it (0.0.0.0), so it waited 200 ms for a hello
    // it already held.
    let py = python();
    let (dir, script) = temp_script("churn", "churn.py", CHURN);
    let port = free_port().to_string();
    let _server = quiet_server(&["--", &py, &script, "server", &port], &port, "churn server");
    let (done, slowest, made) = churn_client(&py, &script, &port, 2000);
    assert!(done >= 2000);
    // (The bugs cost 1 s and 200 ms; the bound leaves room for a loaded machine.)
    assert!(slowest < 150.0, "a request took {slowest} ms (a lost wake-up or a missed hello)");
    // Every connection the client made (the answered ones and up to four still in
    // flight at the end) went through shared memory.
    assert!((done..=done + 4).contains(&made), "{made} accelerated for {done} answered");
    let _ = std::fs::remove_dir_all(&dir);
}

/// TCP and UDP echo servers and clients for the host-address test; the clients send
/// patterned data and check that exactly the same comes back.
const HOST_ECHO: &str = r#"import socket, sys, threading
mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
def pattern(n, seed):
    return bytes((i * 131 + seed) % 251 for i in range(n))
if mode in ("server", "server6only"):
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if mode == "server6only":
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((addr, port))
    s.listen(16)
    def serve(c):
        while True:
            d = c.recv(65536)
            if not d:
                break
            c.sendall(d)
        c.close()
    print("LISTENING", flush=True)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
elif mode == "client":
    c = socket.socket(fam, socket.SOCK_STREAM)
    try:
        c.connect((addr, port))
    except ConnectionRefusedError:
        print("refused", flush=True)
        sys.exit(0)
    total, same = 0, True
    for i in range(100):
        msg = pattern(1 + (i * 7919) % 40000, i)
        c.sendall(msg)
        got = b""
        while len(got) < len(msg):
            d = c.recv(len(msg) - len(got))
            if not d:
                break
            got += d
        same = same and got == msg
        total += len(msg)
    c.close()
    print("tcp ok", total, same, flush=True)
elif mode == "userver":
    s = socket.socket(fam, socket.SOCK_DGRAM)
    s.bind((addr, port))
    print("LISTENING", flush=True)
    while True:
        d, a = s.recvfrom(65536)
        s.sendto(d, a)
else:
    c = socket.socket(fam, socket.SOCK_DGRAM)
    c.settimeout(5)
    n, same = 0, True
    for i in range(200):
        msg = pattern(1 + (i * 613) % 1400, i)
        c.sendto(msg, (addr, port))
        d, a = c.recvfrom(65536)
        same = same and d == msg and a[0] == addr and a[1] == port
        n += 1
    print("udp ok", n, same, flush=True)
"#;

/// A network namespace with a veth pair, one end holding 10.55.0.1/24 and fd55::1/64;
/// deleted when dropped (also when the test fails).
struct Netns(String);
impl Netns {
    fn new() -> Netns {
        ensure("ip", "iproute2");
        let ns = Netns(format!("strait-test-{}", std::process::id()));
        let _ = Command::new("ip").args(["netns", "del", &ns.0]).stderr(Stdio::null()).status();
        let steps: [&[&str]; 7] = [
            &["netns", "add", &ns.0],
            &["-n", &ns.0, "link", "add", "d0", "type", "veth", "peer", "name", "d1"],
            &["-n", &ns.0, "addr", "add", "10.55.0.1/24", "dev", "d0"],
            &["-n", &ns.0, "addr", "add", "fd55::1/64", "dev", "d0", "nodad"],
            &["-n", &ns.0, "link", "set", "d0", "up"],
            &["-n", &ns.0, "link", "set", "d1", "up"],
            &["-n", &ns.0, "link", "set", "lo", "up"],
        ];
        for args in steps {
            let ok = Command::new("ip").args(args).status().is_ok_and(|s| s.success());
            assert!(ok, "ip {} failed", args.join(" "));
        }
        ns
    }

    /// `CMD` in the namespace, under `strait run --stats` if `strait`.
    fn cmd(&self, strait: bool, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0]).env_remove("LD_PRELOAD");
        if strait {
            preload_lib();
            c.args([STRAIT, "run", "--stats", "--"]);
        }
        c.args(args);
        c
    }

    /// Starts a server of the echo script and waits for it to listen.
    fn server(&self, strait: bool, script: &str, mode: &str, addr: &str, port: &str) -> Killed {
        use std::io::BufRead;
        let py = python();
        let mut child = Killed(
            self.cmd(strait, &[&py, script, mode, addr, port])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("echo server"),
        );
        let mut line = String::new();
        let out = child.0.stdout.take().expect("stdout");
        std::io::BufReader::new(out).read_line(&mut line).expect("server output");
        assert_eq!(line.trim(), "LISTENING", "{mode} on {addr}:{port}");
        child
    }
}
impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn stat(stderr: &str, name: &str) -> usize {
    stderr
        .lines()
        .filter_map(|l| l.split(&format!(" {name} ")).nth(1)?.split(' ').next()?.parse::<usize>().ok())
        .sum()
}

#[test]
fn connections_to_the_hosts_own_addresses_are_accelerated_like_loopback() {
    let ns = Netns::new();
    let dir = std::env::temp_dir().join(format!("strait-hostaddr-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let script = dir.join("echo.py");
    std::fs::write(&script, HOST_ECHO).expect("script");
    let script = script.display().to_string();
    let py = python();
    let tcp_ok = "tcp ok 1959150 True";
    // Runs a client in the namespace: (stdout, strait's stderr).
    let client = |strait: bool, mode: &str, addr: &str, port: &str| {
        let out = run_for(&mut ns.cmd(strait, &[&py, &script, mode, addr, port]), Duration::from_secs(60))
            .expect("client finished in time");
        let (text, err) = (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        );
        assert!(out.status.success(), "{mode} {addr}:{port}: {text}\n{err}");
        (text.trim().to_string(), err)
    };

    // A wildcard listener: found by a connect to the host's address, and to loopback.
    let _any = ns.server(true, &script, "server", "0.0.0.0", "5001");
    for addr in ["10.55.0.1", "127.0.0.1"] {
        let (text, err) = client(true, "client", addr, "5001");
        assert_eq!(text, tcp_ok, "{addr}");
        assert_eq!(accelerated(&err), 1, "{addr}: {err}");
    }
    // A client without strait gets the kernel, with the same bytes.
    let (text, err) = client(false, "client", "10.55.0.1", "5001");
    assert_eq!((text.as_str(), accelerated(&err)), (tcp_ok, 0));

    // A listener on 127.0.0.1 only: the kernel refuses a connect to the host's other
    // address, and so does strait (no marker found, no wait for an attach).
    let lo = ns.server(true, &script, "server", "127.0.0.1", "5002");
    let t = Instant::now();
    let (text, _) = client(true, "client", "10.55.0.1", "5002");
    assert_eq!(text, "refused");
    assert!(t.elapsed() < Duration::from_millis(900), "refused after {:?}", t.elapsed());
    let (text, err) = client(true, "client", "127.0.0.1", "5002");
    assert_eq!((text.as_str(), accelerated(&err)), (tcp_ok, 1));
    // With a server without strait on the host's address and the same port, a
    // connect there reaches that one through the kernel at once (the strait
    // listener on 127.0.0.1 never sees a hello, the client never waits for it).
    let _plain = ns.server(false, &script, "server", "10.55.0.1", "5002");
    let t = Instant::now();
    let (text, err) = client(true, "client", "10.55.0.1", "5002");
    assert_eq!((text.as_str(), accelerated(&err), stat(&err, "kernel-fallback")), (tcp_ok, 0, 0), "{err}");
    assert!(t.elapsed() < Duration::from_millis(900), "served after {:?}", t.elapsed());
    drop(lo);

    // A listener on the host's address only: found from there, not from loopback.
    let _host = ns.server(true, &script, "server", "10.55.0.1", "5003");
    let (text, err) = client(true, "client", "10.55.0.1", "5003");
    assert_eq!((text.as_str(), accelerated(&err)), (tcp_ok, 1));
    let (text, _) = client(true, "client", "127.0.0.1", "5003");
    assert_eq!(text, "refused");

    // IPv6: a dual-stack wildcard listener, reached at the host's IPv6 and IPv4
    // addresses.
    let _v6 = ns.server(true, &script, "server", "::", "5004");
    for addr in ["fd55::1", "10.55.0.1"] {
        let (text, err) = client(true, "client", addr, "5004");
        assert_eq!((text.as_str(), accelerated(&err)), (tcp_ok, 1), "{addr}: {err}");
    }

    // An IPv6-only wildcard listener: found from IPv6 only. An IPv4 connect to the same
    // port reaches the kernel server on the IPv4 wildcard beside it at once.
    let _v6only = ns.server(true, &script, "server6only", "::", "5007");
    let (text, err) = client(true, "client", "fd55::1", "5007");
    assert_eq!((text.as_str(), accelerated(&err)), (tcp_ok, 1), "{err}");
    let _plain4 = ns.server(false, &script, "server", "0.0.0.0", "5007");
    for addr in ["10.55.0.1", "127.0.0.1"] {
        let t = Instant::now();
        let (text, err) = client(true, "client", addr, "5007");
        assert_eq!(
            (text.as_str(), accelerated(&err), stat(&err, "kernel-fallback")),
            (tcp_ok, 0, 0),
            "{err}"
        );
        assert!(t.elapsed() < Duration::from_millis(900), "{addr}: served after {:?}", t.elapsed());
    }

    // UDP to the host's addresses: through shared memory, answers from the address
    // the client sent to; a client without strait through the kernel.
    let _u4 = ns.server(true, &script, "userver", "0.0.0.0", "5005");
    let _u6 = ns.server(true, &script, "userver", "::", "5006");
    for (addr, port) in [("10.55.0.1", "5005"), ("fd55::1", "5006")] {
        let (text, err) = client(true, "uclient", addr, port);
        assert_eq!(text, "udp ok 200 True", "{addr}");
        assert_eq!(stat(&err, "udp-out"), 1, "{addr}: {err}");
        assert_eq!(stat(&err, "udp-sent"), 200, "{addr}: {err}");
        let (text, err) = client(false, "uclient", addr, port);
        assert_eq!((text.as_str(), stat(&err, "udp-sent")), ("udp ok 200 True", 0), "{addr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sends `data` through `strait run -- socat` to the server on `port` and checks that
/// exactly `want` comes back, over shared memory.
fn socat_round_trip(port: &str, tag: &str, data: &[u8], want: &[u8]) {
    let dir = std::env::temp_dir().join(format!("strait-socat-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let input = dir.join("in.bin");
    std::fs::write(&input, data).expect("write");
    let out = run_for(
        strait_run(&["--stats", "--", "socat", "-t", "10", "-", &format!("TCP:127.0.0.1:{port}")])
            .stdin(std::fs::File::open(&input).expect("input")),
        Duration::from_secs(60),
    )
    .expect("socat client finished");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(out.stdout == want, "{} of {} bytes came back, or different ones", out.stdout.len(), want.len());
    assert_eq!(accelerated(&err), 1, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sends a few MB through `strait run -- socat` to an echoing server on `port` and
/// checks that exactly the same bytes come back over shared memory.
fn echo_through_socat(port: &str, seed: u32) {
    let data: Vec<u8> =
        (0..3_000_000u32).map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    socat_round_trip(port, &seed.to_string(), &data, &data);
}

#[test]
fn socat_execs_cat_on_each_accepted_connection_under_strait() {
    // The inetd pattern: socat forks a child per connection, which execs cat with the
    // accepted socket as its standard input and output (`nofork`: no relay process).
    // cat inherits an accelerated socket across exec and must keep using the shared
    // memory (the client reads only from it).
    ensure("socat", "socat");
    let port = free_port().to_string();
    let _server = quiet_server(
        &["--", "socat", &format!("TCP-LISTEN:{port},reuseaddr,fork"), "EXEC:cat,nofork"],
        &port,
        "socat server",
    );
    for seed in 0..3 {
        echo_through_socat(&port, seed);
    }
}

#[test]
fn socat_execs_sed_whose_stdio_streams_are_the_accelerated_socket() {
    // sed reads and writes through glibc's stdio (getdelim, fwrite), which calls
    // libc-internal read/write that no preload library sees: its standard streams
    // must be strait's own streams over the inherited socket.
    ensure("socat", "socat");
    let port = free_port().to_string();
    let _server = quiet_server(
        &["--", "socat", &format!("TCP-LISTEN:{port},reuseaddr,fork"), "EXEC:sed s/a/A/g,nofork"],
        &port,
        "socat server",
    );
    let text: String = (0..100_000).map(|i| format!("{i} banana split\n")).collect();
    socat_round_trip(&port, "sed", text.as_bytes(), text.replace('a', "A").as_bytes());
}

/// A server that hands each accepted connection to `cat` with `subprocess.Popen`
/// (fork or vfork, dup2 onto 0 and 1, exec) and closes its own copy.
const PY_SPAWNS_CAT: &str = r#"import socket, subprocess, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(8)
children = []
while True:
    c, _ = s.accept()
    children.append(subprocess.Popen(["cat"], stdin=c, stdout=c))
    c.close()
    children = [p for p in children if p.poll() is None]
"#;

#[test]
fn python_subprocess_hands_accepted_connections_to_cat_under_strait() {
    ensure("socat", "socat");
    let py = python();
    let port = free_port().to_string();
    let _server = quiet_server(&["--", &py, "-c", PY_SPAWNS_CAT, &port], &port, "python server");
    for seed in 10..12 {
        echo_through_socat(&port, seed);
    }
}
