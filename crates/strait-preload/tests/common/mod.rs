//! Helpers shared by the preload's process tests: the peers and the library (built
//! on first use), peer commands with or without the library, and bounded waits that
//! collect output.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The TCP test peer (`strait-preload-peer` of strait-testpeers), built on first use.
pub fn tcp_peer() -> PathBuf {
    strait_testkit::test_peer("strait-preload-peer")
}

/// The UDP test peer (`strait-udp-peer` of strait-testpeers), built on first use.
pub fn udp_peer() -> PathBuf {
    strait_testkit::test_peer("strait-udp-peer")
}

/// The preload library next to the peer binary, built on first use.
pub fn lib(peer: &Path) -> PathBuf {
    strait_testkit::preload_lib_beside(peer)
}

pub fn cmd(peer: &Path, preload: bool, args: &[&str]) -> Command {
    let mut c = Command::new(peer);
    c.args(args).env("STRAIT_STATS", "1").env_remove("LD_PRELOAD");
    if preload {
        c.env("LD_PRELOAD", lib(peer));
    }
    c
}

pub struct Out {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Waits for `child` (killing it at `deadline`), collecting the rest of its output.
pub fn finish(mut child: Child, lines: mpsc::Receiver<String>, mut first: String, deadline: Instant) -> Out {
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    while let Ok(l) = lines.recv_timeout(Duration::from_secs(2)) {
        first.push_str(&l);
    }
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    Out { ok: status.is_some_and(|s| s.success()), stdout: first, stderr }
}

pub fn spawn_lines(c: &mut Command) -> (Child, mpsc::Receiver<String>) {
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn peer");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l + "\n").is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// A peer server, started and past the `PORT n` line it prints when it listens.
pub struct Server {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
    /// Its first line (kept for its output).
    pub first: String,
    pub port: String,
}

impl Server {
    /// Starts `c` and waits (10 s at most) for its port.
    pub fn start(c: &mut Command) -> Server {
        let (child, lines) = spawn_lines(c);
        let first = lines.recv_timeout(Duration::from_secs(10)).expect("server printed its port");
        let port = first.trim().strip_prefix("PORT ").expect("PORT line").to_string();
        Server { child, lines, first, port }
    }

    /// Waits for the server to end (killed at `deadline`) and collects its output.
    pub fn finish(self, deadline: Instant) -> Out {
        finish(self.child, self.lines, self.first, deadline)
    }
}

/// Runs `server`, then the client `client` makes for the server's port, both to the
/// end (killed at `deadline`); returns (server, client) output.
pub fn server_and_client(
    server: &mut Command,
    client: impl FnOnce(&str) -> Command,
    deadline: Instant,
) -> (Out, Out) {
    let s = Server::start(server);
    let (c, crx) = spawn_lines(&mut client(&s.port));
    let c = finish(c, crx, String::new(), deadline);
    (s.finish(deadline), c)
}

/// Extra environment for a process.
pub type Env<'a> = &'a [(&'a str, &'a str)];

/// Runs a server of `modes[0]`, then a client of `modes[1]` for its port, with the
/// extra environment `envs[0]` and `envs[1]`, both to the end (killed at
/// `deadline`); `make(0, args)` makes the server's command, `make(1, args)` the
/// client's. Returns (server, client) output.
pub fn run_modes(
    make: impl Fn(usize, &[&str]) -> Command,
    modes: [&str; 2],
    envs: [Env; 2],
    deadline: Instant,
) -> (Out, Out) {
    let mut server = make(0, &["server", modes[0]]);
    server.envs(envs[0].iter().copied());
    server_and_client(
        &mut server,
        |port| {
            let mut c = make(1, &["client", port, modes[1]]);
            c.envs(envs[1].iter().copied());
            c
        },
        deadline,
    )
}

/// Fails the test with both outputs unless the process succeeded.
pub fn check(o: &Out, what: &str) {
    assert!(o.ok, "{what} failed:\nstdout:\n{}\nstderr:\n{}", o.stdout, o.stderr);
}

/// Fails the test unless both the server and the client of `pair` succeeded;
/// returns the pair.
pub fn checked(pair: (Out, Out)) -> (Out, Out) {
    check(&pair.0, "server");
    check(&pair.1, "client");
    pair
}

/// What a `source` client says it sent and a `sink` server says it received (byte
/// count and digest), in that order.
pub fn sent_and_received(s: &Out, c: &Out) -> (String, String) {
    let sent = c.stdout.lines().find(|l| l.starts_with("sent ")).expect("sent").replace("sent ", "");
    let got =
        s.stdout.lines().find(|l| l.starts_with("received ")).expect("received").replace("received ", "");
    (sent, got)
}

/// Fails the test unless the `mode` server (one that hands its connection to a
/// new program) and its `echo` client both succeeded, the client's echo came back
/// whole and the new program took the connection over (`adopted`, one `inherited`).
pub fn check_adopted(s: &Out, c: &Out, mode: &str) {
    check(s, mode);
    check(c, mode);
    assert!(c.stdout.contains("echo ok 1734389"), "{mode}: {}", c.stdout);
    assert!(s.stdout.contains("adopted ok") && s.stdout.contains("echoed 1734389"), "{mode}: {}", s.stdout);
    assert_eq!(stat_sum(s, "inherited"), 1, "{mode}: {}", s.stderr);
}

/// Fails the test unless the `extras` server and client both passed.
pub fn check_extras(s: &Out, c: &Out) {
    assert!(
        s.stdout.contains("extras ok") && c.stdout.contains("extras client ok"),
        "{}{}",
        s.stdout,
        c.stdout
    );
}

/// Sum of counter `name` over the `strait-preload: pid ...` statistics lines.
pub fn stat_sum(o: &Out, name: &str) -> usize {
    strait_testkit::stat(&o.stderr, name)
}
