//! `strait anatomy --transports strait-run` (and `strait-run-udp`): the path users
//! run, dissected. A ping-pong of plain `write`/`read` calls over a TCP connection on
//! 127.0.0.1 (the interposer's byte rings) or two connected UDP sockets (its datagram
//! rings), between processes started with `libstrait_preload.so` preloaded, exactly
//! as under `strait run`; the library's stage probes ([`stages::RUN_STAGES`]) give
//! the stages.
//!
//! The driver (`strait anatomy`) is not preloaded: its other paths must stay on the
//! kernel. It starts `strait __anatomy-run-end` under the library, hands it the
//! configuration as one JSON line on standard input and reads the finished report
//! rows back. That process makes the sockets, forks the answering end, and the two
//! processes run pinned to two cores (the stamps of both share one invariant
//! time-stamp counter); the answering end sends its stamps back over a pipe after
//! each batch. Two processes rather than two threads: threads share the library's
//! descriptor table and would measure its cache-line traffic, which two programs do
//! not have. The library carries its own copy of the probes, reached through its
//! exported `strait_preload_probes_*` functions; the application's own milestones
//! (`write` called, `read` returned) are recorded into the same per-thread logs
//! through them.

use std::ffi::CStr;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::mpsc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strait_anatomy::anatomy::AnatomyRun;
use strait_anatomy::stages::{self, RUN_CHAIN, RUN_STAGES};
use strait_anatomy::sys::{pin, unpin};
use strait_anatomy::Clock;
use strait_probe::{Stage, Stamp};

use crate::anatomy::{
    measure_rounds, report_size, AnatomyConfig, AnatomyError, BatchResult, Probes, SizeData,
};

/// The transport name, as in `strait bench`.
pub const TRANSPORT: &str = "strait-run";

/// The same path with connected UDP sockets: the interposer's datagram rings.
pub const TRANSPORT_UDP: &str = "strait-run-udp";

/// Largest datagram the UDP path is dissected at (as for the kernel paths).
pub const UDP_MAX_SIZE: u64 = 32 << 10;

/// Which sockets the ping-pong uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Proto {
    /// A TCP connection over 127.0.0.1 (the byte rings).
    Tcp,
    /// Two connected UDP sockets on 127.0.0.1 (the datagram rings).
    Udp,
}

impl Proto {
    /// The transport's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Proto::Tcp => TRANSPORT,
            Proto::Udp => TRANSPORT_UDP,
        }
    }
}

/// The hidden subcommand that runs both ends under the preload library.
pub const CHILD_SUBCOMMAND: &str = "__anatomy-run-end";

/// The milestone of [`RUN_CHAIN`] after which the sender's doorbell is looked for
/// (the tail's publication).
const DOORBELL_AFTER: usize = 3;

/// The longest a whole anatomy may take in the child before the driver gives up.
const CHILD_DEADLINE: Duration = Duration::from_secs(600);

/// What the driver asks of the child.
#[derive(Debug, Serialize, Deserialize)]
struct ChildConfig {
    proto: Proto,
    sizes: Vec<u64>,
    iters: u64,
    warmup: u64,
    rounds: u32,
    tolerance: f64,
    ticks_per_ns: f64,
}

/// What the child answers.
#[derive(Debug, Default, Serialize, Deserialize)]
struct ChildReport {
    runs: Vec<AnatomyRun>,
    notes: Vec<String>,
    error: Option<String>,
}

/// Runs the anatomy of the strait-run path in a child under `lib` (the preload
/// library, which must have its probes compiled in); returns the runs and notes.
pub fn run(
    proto: Proto,
    cfg: &AnatomyConfig,
    clock: &Clock,
    lib: &std::path::Path,
) -> Result<(Vec<AnatomyRun>, Vec<String>), AnatomyError> {
    if cfg!(target_arch = "x86_64") && clock.tsc_ghz().is_none() {
        return Err(AnatomyError::NoInvariantTsc(clock.source().name()));
    }
    let setup = |what: &str, e: std::io::Error| AnatomyError::Setup(format!("{what}: {e}"));
    let mut cmd = crate::preload::helper_under(CHILD_SUBCOMMAND, lib);
    let mut child = cmd.spawn().map_err(|e| setup("start the strait-run anatomy process", e))?;
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(AnatomyError::Setup("the strait-run anatomy process has no pipes".into()));
    };
    let conf = ChildConfig {
        proto,
        sizes: cfg.sizes.clone(),
        iters: cfg.iters,
        warmup: cfg.warmup,
        rounds: cfg.rounds,
        tolerance: cfg.tolerance,
        ticks_per_ns: clock.ticks_per_ns(),
    };
    let mut line = serde_json::to_string(&conf).map_err(|e| AnatomyError::Setup(e.to_string()))?;
    line.push('\n');
    let sent = stdin.write_all(line.as_bytes()).and_then(|_| stdin.flush());
    drop(stdin);
    // The answer, read in a thread so that a stuck child is killed at the deadline.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let r = BufReader::new(stdout).read_line(&mut text).map(|_| text);
        let _ = tx.send(r);
    });
    let answer = rx.recv_timeout(CHILD_DEADLINE);
    if answer.is_err() {
        let _ = child.kill();
    }
    let status = child.wait();
    sent.map_err(|e| setup("configure the strait-run anatomy process", e))?;
    let text = match answer {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Err(setup("read the strait-run anatomy process's report", e)),
        Err(_) => {
            return Err(AnatomyError::PingPong(format!(
                "no report within {CHILD_DEADLINE:?}; the process was killed"
            )))
        }
    };
    if text.trim().is_empty() {
        return Err(AnatomyError::PingPong(format!(
            "the strait-run anatomy process ended without a report ({status:?})"
        )));
    }
    let rep: ChildReport = serde_json::from_str(&text).map_err(|e| {
        AnatomyError::PingPong(format!("bad report from the strait-run anatomy process: {e}"))
    })?;
    match rep.error {
        Some(e) => Err(AnatomyError::PingPong(e)),
        None => Ok((rep.runs, rep.notes)),
    }
}

/// The library's probe controls (see `crates/strait-preload/src/probes.rs`).
#[derive(Clone, Copy)]
struct Controls {
    set: extern "C" fn(libc::c_int),
    start_log: extern "C" fn(libc::size_t),
    mark: extern "C" fn(u8),
    take: unsafe extern "C" fn(*mut RawStamp, libc::size_t, *mut u64) -> libc::size_t,
}

/// The library's stamp layout.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawStamp {
    tsc: u64,
    stage: u8,
}

fn symbol(name: &CStr) -> Option<*mut libc::c_void> {
    // SAFETY: a look-up in the process's global symbol scope by a NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

impl Controls {
    /// The controls of the preloaded library, or why they cannot be used.
    fn find() -> Result<Controls, String> {
        let not_preloaded = || {
            "libstrait_preload.so is not loaded in the anatomy process (or it is from an older build)"
                .to_owned()
        };
        let compiled = symbol(c"strait_preload_probes_compiled").ok_or_else(not_preloaded)?;
        // SAFETY: the library exports this name with this signature (same build).
        let compiled: extern "C" fn() -> libc::c_int = unsafe { std::mem::transmute(compiled) };
        if compiled() == 0 {
            return Err("libstrait_preload.so was built without stage probes; rebuild it with \
                 `cargo build --release -p strait-preload --features probes`"
                .into());
        }
        let get = |n: &CStr| symbol(n).ok_or_else(not_preloaded);
        let (set, start_log, mark, take) = (
            get(c"strait_preload_probes_set")?,
            get(c"strait_preload_probes_start_log")?,
            get(c"strait_preload_probes_mark")?,
            get(c"strait_preload_probes_take")?,
        );
        // SAFETY: the library exports these names with these signatures (same build;
        // its `probes.rs`).
        unsafe {
            Ok(Controls {
                set: std::mem::transmute::<*mut libc::c_void, extern "C" fn(libc::c_int)>(set),
                start_log: std::mem::transmute::<*mut libc::c_void, extern "C" fn(libc::size_t)>(start_log),
                mark: std::mem::transmute::<*mut libc::c_void, extern "C" fn(u8)>(mark),
                take: std::mem::transmute::<
                    *mut libc::c_void,
                    unsafe extern "C" fn(*mut RawStamp, libc::size_t, *mut u64) -> libc::size_t,
                >(take),
            })
        }
    }

    /// Takes the calling thread's log (room for `cap` stamps).
    fn take(&self, cap: usize) -> (Vec<Stamp>, u64) {
        let mut raw = vec![RawStamp { tsc: 0, stage: 0 }; cap];
        let mut dropped = 0u64;
        // SAFETY: `raw` has room for `cap` stamps; `dropped` is a local.
        let n = unsafe { (self.take)(raw.as_mut_ptr(), cap, &mut dropped) };
        let stamps = raw[..n.min(cap)]
            .iter()
            .filter_map(|r| Some(Stamp { tsc: r.tsc, stage: Stage::from_u8(r.stage)? }))
            .collect();
        (stamps, dropped)
    }
}

/// A batch the pinging process asks of the answering one, over a pipe: four
/// native-endian `u64`s (size, round trips, log room, probe mode); zero round trips
/// ends it. The probe switch is per process, so each end sets its own.
struct Batch {
    size: usize,
    iters: u64,
    log: usize,
    mode: Probes,
}

impl Batch {
    fn write(&self, f: &mut File) -> std::io::Result<()> {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&(self.size as u64).to_ne_bytes());
        b[8..16].copy_from_slice(&self.iters.to_ne_bytes());
        b[16..24].copy_from_slice(&(self.log as u64).to_ne_bytes());
        b[24..].copy_from_slice(&(self.mode as u64).to_ne_bytes());
        f.write_all(&b)
    }

    fn read(f: &mut File) -> std::io::Result<Batch> {
        let mut b = [0u8; 32];
        f.read_exact(&mut b)?;
        let word = |i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        let mode = match word(24) {
            1 => Probes::On,
            2 => Probes::Double,
            _ => Probes::Off,
        };
        Ok(Batch { size: word(0) as usize, iters: word(8), log: word(16) as usize, mode })
    }
}

/// The answering process's reply to a batch, over a pipe: an error text, or its
/// stamps and the count dropped.
fn write_reply(f: &mut File, r: &Result<(Vec<Stamp>, u64), String>) -> std::io::Result<()> {
    let mut b = Vec::new();
    match r {
        Err(e) => {
            b.extend_from_slice(&(e.len() as u64 | 1 << 63).to_ne_bytes());
            b.extend_from_slice(e.as_bytes());
        }
        Ok((stamps, dropped)) => {
            b.extend_from_slice(&(stamps.len() as u64).to_ne_bytes());
            b.extend_from_slice(&dropped.to_ne_bytes());
            for s in stamps {
                b.extend_from_slice(&s.tsc.to_ne_bytes());
                b.extend_from_slice(&u64::from(s.stage as u8).to_ne_bytes());
            }
        }
    }
    f.write_all(&b)
}

fn read_reply(f: &mut File) -> Result<(Vec<Stamp>, u64), String> {
    let gone = |e: std::io::Error| format!("the answering process stopped: {e}");
    let mut w = [0u8; 8];
    f.read_exact(&mut w).map_err(gone)?;
    let head = u64::from_ne_bytes(w);
    if head & 1 << 63 != 0 {
        // Bounded: our own child's message.
        let mut t = vec![0u8; (head & !(1 << 63)).min(1 << 16) as usize];
        f.read_exact(&mut t).map_err(gone)?;
        return Err(String::from_utf8_lossy(&t).into_owned());
    }
    f.read_exact(&mut w).map_err(gone)?;
    let dropped = u64::from_ne_bytes(w);
    // Never more stamps than the logs we size (a corrupt count is an error, not an
    // allocation of any size).
    if head > 1 << 28 {
        return Err(format!("the answering process reported {head} stamps"));
    }
    let mut raw = vec![0u8; head as usize * 16];
    f.read_exact(&mut raw).map_err(gone)?;
    let stamps = raw
        .chunks_exact(16)
        .filter_map(|c| {
            let tsc = u64::from_ne_bytes(c[..8].try_into().ok()?);
            let stage = Stage::from_u8(u8::try_from(u64::from_ne_bytes(c[8..].try_into().ok()?)).ok()?)?;
            Some(Stamp { tsc, stage })
        })
        .collect();
    Ok((stamps, dropped))
}

/// A pipe's two ends (read, write), closed on exec.
fn pipe() -> Result<(File, File), String> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 fills the two-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: two fresh descriptors that nothing else owns.
    Ok(unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) })
}

/// The entry point of `strait __anatomy-run-end` (a process under the library):
/// reads the configuration on standard input, writes one JSON report line.
pub fn child_main() -> std::process::ExitCode {
    let report = match child_run() {
        Ok((runs, notes)) => ChildReport { runs, notes, error: None },
        Err(e) => ChildReport { error: Some(e), ..ChildReport::default() },
    };
    let text = serde_json::to_string(&report).unwrap_or_else(|e| format!("{{\"error\":\"report: {e}\"}}"));
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|_| out.flush()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(_) => std::process::ExitCode::FAILURE,
    }
}

fn child_run() -> Result<(Vec<AnatomyRun>, Vec<String>), String> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| format!("read the configuration: {e}"))?;
    let cfg: ChildConfig = serde_json::from_str(&line).map_err(|e| format!("bad configuration: {e}"))?;
    let probes = Controls::find()?;
    // The connection, made with plain socket calls so that the library carries it,
    // between two processes as under `strait run` (two threads of one process would
    // share the library's tables and measure their cache-line traffic instead). Made
    // before the fork, each process keeps its own end.
    let ends = Ends::open(cfg.proto)?;
    let maxlen = cfg.sizes.iter().copied().max().unwrap_or(8).max(1) as usize;
    let (cmd_r, mut cmd_w) = pipe()?;
    let (mut rep_r, rep_w) = pipe()?;
    // SAFETY: this process has one thread (no lock can be held across the fork); the
    // child runs `pong` and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: {}", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        drop((cmd_w, rep_r));
        let code = i32::from(pong(ends, cmd_r, rep_w, probes, maxlen).is_err());
        // SAFETY: ends the answering process without the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    drop((cmd_r, rep_w));
    let result = ends.ping_end().and_then(|mut f| {
        let two_cores = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
        let old_cpus = if two_cores { pin(0) } else { None };
        let r = measure(&cfg, &probes, &mut f, maxlen, &mut cmd_w, &mut rep_r);
        unpin(old_cpus);
        r
    });
    (probes.set)(Probes::Off as libc::c_int);
    let _ = Batch { size: 0, iters: 0, log: 0, mode: Probes::Off }.write(&mut cmd_w);
    drop(cmd_w);
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let data = result?;
    let mut runs = Vec::new();
    let mut notes = Vec::new();
    for d in data {
        if d.paths.is_empty() {
            notes.push(format!(
                "{} {} B: no complete probed path: were the sockets carried by the library \
                 (is `strait run` working here)?",
                cfg.proto.name(),
                d.size
            ));
            continue;
        }
        // The in-situ calibration always has both batches; no fallback is needed.
        if let Some(r) =
            report_size(cfg.proto.name(), &RUN_STAGES, &d, 0.0, cfg.ticks_per_ns, cfg.tolerance, &mut notes)
        {
            runs.push(r);
        }
    }
    if runs.is_empty() {
        return Err(notes.join("; "));
    }
    Ok((runs, notes))
}

/// The two ends' sockets, made before the fork.
enum Ends {
    Tcp(TcpListener),
    Udp(UdpSocket, UdpSocket),
}

impl Ends {
    fn open(proto: Proto) -> Result<Ends, String> {
        match proto {
            Proto::Tcp => TcpListener::bind("127.0.0.1:0").map(Ends::Tcp).map_err(|e| format!("listen: {e}")),
            Proto::Udp => {
                let bind = || UdpSocket::bind("127.0.0.1:0").map_err(|e| format!("udp bind: {e}"));
                Ok(Ends::Udp(bind()?, bind()?))
            }
        }
    }

    /// The pinging end (its connection made), in the parent.
    fn ping_end(self) -> Result<File, String> {
        match self {
            Ends::Tcp(l) => {
                let addr = l.local_addr().map_err(|e| format!("listen: {e}"))?;
                drop(l);
                let s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
                let _ = s.set_nodelay(true);
                Ok(File::from(OwnedFd::from(s)))
            }
            Ends::Udp(a, b) => {
                let to = b.local_addr().map_err(|e| format!("udp: {e}"))?;
                drop(b);
                a.connect(to).map_err(|e| format!("udp connect: {e}"))?;
                Ok(File::from(OwnedFd::from(a)))
            }
        }
    }

    /// The answering end, in the child.
    fn pong_end(self) -> Result<File, String> {
        match self {
            Ends::Tcp(l) => {
                let (s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
                let _ = s.set_nodelay(true);
                Ok(File::from(OwnedFd::from(s)))
            }
            Ends::Udp(a, b) => {
                let to = a.local_addr().map_err(|e| format!("udp: {e}"))?;
                drop(a);
                b.connect(to).map_err(|e| format!("udp connect: {e}"))?;
                Ok(File::from(OwnedFd::from(b)))
            }
        }
    }
}

/// Reads one message of `buf.len()` bytes: a datagram arrives whole (a short one is
/// an error), a byte stream may take several reads.
fn recv_message(f: &mut File, buf: &mut [u8], datagrams: bool) -> std::io::Result<()> {
    if !datagrams {
        return f.read_exact(buf);
    }
    let n = f.read(buf)?;
    if n != buf.len() {
        return Err(std::io::Error::other(format!("a datagram of {n} bytes, {} expected", buf.len())));
    }
    Ok(())
}

/// Sends one message: one datagram, or the whole buffer on a byte stream.
fn send_message(f: &mut File, buf: &[u8], datagrams: bool) -> std::io::Result<()> {
    if !datagrams {
        return f.write_all(buf);
    }
    let n = f.write(buf)?;
    if n != buf.len() {
        return Err(std::io::Error::other(format!("sent {n} of {} bytes", buf.len())));
    }
    Ok(())
}

/// The answering process: its end of the connection, then each batch asked on
/// `cmds` answered and its stamps sent back on `replies`.
fn pong(ends: Ends, mut cmds: File, mut replies: File, probes: Controls, maxlen: usize) -> Result<(), ()> {
    let datagrams = matches!(ends, Ends::Udp(..));
    let mut f = ends.pong_end().map_err(|e| {
        let _ = write_reply(&mut replies, &Err(e));
    })?;
    let _ = pin(1);
    let mut buf = vec![0u8; maxlen];
    loop {
        let Ok(Batch { size, iters, log, mode }) = Batch::read(&mut cmds) else { return Err(()) };
        if iters == 0 {
            return Ok(());
        }
        if log > 0 {
            (probes.start_log)(log);
        }
        (probes.set)(mode as libc::c_int);
        let size = size.min(maxlen);
        let r = (|| {
            for _ in 0..iters {
                recv_message(&mut f, &mut buf[..size], datagrams)?;
                (probes.mark)(Stage::AppRecvd as u8);
                (probes.mark)(Stage::AppSend as u8);
                send_message(&mut f, &buf[..size], datagrams)?;
            }
            Ok::<_, std::io::Error>(())
        })();
        (probes.set)(Probes::Off as libc::c_int);
        let r = r.map(|_| if log > 0 { probes.take(log) } else { (Vec::new(), 0) });
        let r = r.map_err(|e| format!("answering end: {e}"));
        if write_reply(&mut replies, &r).is_err() || r.is_err() {
            return Err(());
        }
    }
}

/// The pinging end: every size's interleaved probed, doubled and unprobed batches.
fn measure(
    cfg: &ChildConfig,
    probes: &Controls,
    f: &mut File,
    maxlen: usize,
    cmds: &mut File,
    replies: &mut File,
) -> Result<Vec<SizeData>, String> {
    let mut buf = vec![0x5au8; maxlen];
    let datagrams = cfg.proto == Proto::Udp;
    let mut out = Vec::new();
    for &size in &cfg.sizes {
        let size = (size as usize).max(1);
        // Room for every stamp of a batch: a message split over several ring passes
        // stamps more than once per round trip.
        let per_iter = 24 + 8 * size.div_ceil(64 << 10);
        let mut batch = |iters: u64, mode: Probes| -> Result<BatchResult, String> {
            let log = mode.log_room(iters, per_iter);
            if log > 0 {
                (probes.start_log)(log);
            }
            (probes.set)(mode as libc::c_int);
            Batch { size, iters, log, mode }
                .write(cmds)
                .map_err(|e| format!("the answering process stopped: {e}"))?;
            let mut ts = Vec::with_capacity(iters as usize);
            let r = (|| {
                for _ in 0..iters {
                    ts.push(strait_probe::now());
                    (probes.mark)(Stage::AppSend as u8);
                    send_message(f, &buf[..size], datagrams)?;
                    recv_message(f, &mut buf[..size], datagrams)?;
                    (probes.mark)(Stage::AppRecvd as u8);
                }
                Ok::<_, std::io::Error>(())
            })();
            let theirs = read_reply(replies);
            (probes.set)(Probes::Off as libc::c_int);
            r.map_err(|e| format!("ping end: {e}"))?;
            let (theirs, dropped_b) = theirs?;
            let (mine, dropped_a) = if log > 0 { probes.take(log) } else { (Vec::new(), 0) };
            let periods = ts.windows(2).map(|w| w[1].saturating_sub(w[0]) as f64).collect();
            Ok((periods, mine, theirs, dropped_a + dropped_b))
        };
        let walk = |a: &[Stamp], b: &[Stamp]| stages::walk_chain(a, b, &RUN_CHAIN, DOORBELL_AFTER);
        let d = measure_rounds(size as u64, (cfg.warmup, cfg.iters, cfg.rounds), &mut batch, walk)?;
        out.push(d);
    }
    Ok(out)
}
