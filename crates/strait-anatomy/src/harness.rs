//! The benchmark driver and its peer processes.
//!
//! Every transport gets one peer process for the whole run: the driver re-executes
//! its own binary (`/proc/self/exe`) with a hidden subcommand (by default
//! `__bench-peer <transport> <nfds> <args...>`), handing it the transport's
//! descriptors as fds 3, 4, ... The peer connects its end, then obeys one-line JSON
//! commands on its stdin and answers each with one JSON line on its stdout. Between
//! commands it blocks on that pipe, so an idle peer never spins.
//!
//! Measurement is organised in interleaved rounds: for each message size, each
//! transport is calibrated (probe, warm-up), then `rounds` rounds each run one batch
//! on every transport in turn (in a rotating order), and samples are pooled across
//! rounds. A separate, shorter pass with the `raw_syscalls:sys_enter` counters read
//! around it counts system calls, so the counters never run during timed batches.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde::{Deserialize, Serialize};

use crate::clock::Clock;
use crate::report::{Kind, ResultRow};
use crate::stats::summarize;
use crate::sys::{process_cpu_ns, SyscallCounter};
use crate::transport::{BenchError, Result, Support, Transport, TransportSpec};

/// A command from the driver to a peer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum PeerCommand {
    /// Answer `iters` ping-pongs of `size` bytes.
    Latency {
        /// Message size.
        size: u64,
        /// Iterations.
        iters: u64,
        /// Count system calls around the batch.
        count_syscalls: bool,
    },
    /// Receive `count` messages of `size` bytes, then acknowledge.
    Stream {
        /// Message size.
        size: u64,
        /// Messages.
        count: u64,
        /// Count system calls around the batch.
        count_syscalls: bool,
    },
    /// Exit.
    Quit,
}

/// A peer's answer to one command.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Reply {
    /// Process CPU time the peer used for the batch, in ns.
    pub cpu_ns: u64,
    /// System calls the peer made during the batch (if counted and countable).
    pub syscalls: Option<u64>,
    /// Payload bytes the peer received (streaming).
    pub bytes: u64,
    /// Set if the batch failed.
    pub error: Option<String>,
}

/// The peer process: connects `spec`'s end with `args` and the inherited fds
/// `3..3 + nfds`, then serves commands from stdin until `Quit` or end of input.
pub fn peer_main(spec: &dyn TransportSpec, nfds: usize, args: &[String]) -> Result<()> {
    let fds: Vec<OwnedFd> = (0..nfds)
        .map(|i| {
            // SAFETY: the driver placed exactly `nfds` descriptors at 3.. for us
            // (dup2 in the spawn hook); nothing else in this process owns them.
            unsafe { OwnedFd::from_raw_fd(3 + i as i32) }
        })
        .collect();
    let mut t = spec.connect(args, fds)?;
    let counter = SyscallCounter::open().ok();
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout().lock();
    let mut line = String::new();
    let mut input = stdin.lock();
    loop {
        line.clear();
        if t.needs_idle() {
            // Drive the transport until a command is readable.
            while !stdin_readable(1) {
                t.idle();
            }
        }
        let n = input.read_line(&mut line).map_err(|e| BenchError::io("peer: read command", e))?;
        if n == 0 {
            return Ok(());
        }
        let cmd: PeerCommand = serde_json::from_str(&line)
            .map_err(|e| BenchError::Protocol(format!("bad command {line:?}: {e}")))?;
        let (size, count_syscalls) = match cmd {
            PeerCommand::Quit => return Ok(()),
            PeerCommand::Latency { size, count_syscalls, .. }
            | PeerCommand::Stream { size, count_syscalls, .. } => (size as usize, count_syscalls),
        };
        let mut reply = Reply::default();
        let result = t.prepare(size).and_then(|()| {
            let counter = if count_syscalls { counter.as_ref() } else { None };
            let c0 = process_cpu_ns();
            let s0 = counter.and_then(|c| c.read().ok());
            let r = match cmd {
                PeerCommand::Latency { iters, .. } => t.pong_batch(size, iters).map(|()| 0),
                PeerCommand::Stream { count, .. } => t.stream_recv(size, count),
                PeerCommand::Quit => Ok(0),
            };
            let s1 = counter.and_then(|c| c.read().ok());
            let c1 = process_cpu_ns();
            reply.cpu_ns = c1.saturating_sub(c0);
            if let (Some(c), Some(a), Some(b)) = (counter, s0, s1) {
                reply.syscalls = Some(c.delta(a, b));
            }
            r
        });
        match result {
            Ok(bytes) => reply.bytes = bytes,
            Err(e) => reply.error = Some(e.to_string()),
        }
        let mut text = serde_json::to_string(&reply).map_err(|e| BenchError::Protocol(e.to_string()))?;
        text.push('\n');
        stdout.write_all(text.as_bytes()).map_err(|e| BenchError::io("peer: write reply", e))?;
        stdout.flush().map_err(|e| BenchError::io("peer: write reply", e))?;
        if reply.error.is_some() {
            return Err(BenchError::Protocol(reply.error.unwrap_or_default()));
        }
    }
}

/// Waits up to `ms` for standard input to become readable (or hang up).
fn stdin_readable(ms: i32) -> bool {
    let mut p = libc::pollfd { fd: 0, events: libc::POLLIN, revents: 0 };
    // SAFETY: one live pollfd, count 1.
    unsafe { libc::poll(&mut p, 1, ms) != 0 }
}

/// How to start peers: the executable and the hidden subcommand words before
/// `<transport> <nfds> <args...>`.
#[derive(Debug, Clone)]
pub struct PeerLauncher {
    /// The binary to run (normally `/proc/self/exe`).
    pub exe: PathBuf,
    /// Leading arguments, e.g. `["__bench-peer"]`.
    pub prefix: Vec<String>,
    /// Extra environment for the peers.
    pub env: Vec<(String, String)>,
}

impl Default for PeerLauncher {
    fn default() -> Self {
        PeerLauncher {
            exe: PathBuf::from("/proc/self/exe"),
            prefix: vec!["__bench-peer".into()],
            env: Vec::new(),
        }
    }
}

/// The driver's handle on one transport: its end, the peer process and its
/// control pipes.
pub struct Peer {
    name: &'static str,
    transport: Box<dyn Transport>,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// Moves `fd` to a descriptor >= 100 (close-on-exec), out of the way of the
/// numbers 3.. that the child's copies will take.
fn high_fd(fd: &OwnedFd) -> Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor we own; no pointers.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 100) };
    if r < 0 {
        return Err(BenchError::io("fcntl(F_DUPFD_CLOEXEC)", std::io::Error::last_os_error()));
    }
    // SAFETY: fcntl returned a new descriptor that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

impl Peer {
    /// Creates the transport's listening side, spawns the peer and connects.
    pub fn spawn(spec: &dyn TransportSpec, launcher: &PeerLauncher) -> Result<Peer> {
        let pending = spec.listen()?;
        let moved: Vec<OwnedFd> = pending.peer_fds.iter().map(high_fd).collect::<Result<_>>()?;
        drop(pending.peer_fds);
        let raw: Vec<i32> = moved.iter().map(|f| f.as_raw_fd()).collect();
        let mut cmd = Command::new(&launcher.exe);
        cmd.args(&launcher.prefix)
            .arg(spec.name())
            .arg(raw.len().to_string())
            .args(&pending.peer_args)
            .envs(launcher.env.iter().map(|(k, v)| (k, v)))
            .envs(spec.peer_env())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: between fork and exec only async-signal-safe calls (dup2, prctl)
        // on descriptors that stay open in the parent until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                for (i, &fd) in raw.iter().enumerate() {
                    if libc::dup2(fd, 3 + i as i32) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| BenchError::io(format!("spawn {} peer", spec.name()), e))?;
        drop(moved);
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(BenchError::Protocol("peer without control pipes".into()));
        };
        let transport = match (pending.finish)() {
            Ok(t) => t,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        Ok(Peer { name: spec.name(), transport, child, stdin, stdout: BufReader::new(stdout) })
    }

    fn send(&mut self, cmd: &PeerCommand) -> Result<()> {
        let mut text = serde_json::to_string(cmd).map_err(|e| BenchError::Protocol(e.to_string()))?;
        text.push('\n');
        self.stdin.write_all(text.as_bytes()).map_err(|e| BenchError::io("write peer command", e))?;
        self.stdin.flush().map_err(|e| BenchError::io("write peer command", e))
    }

    fn reply(&mut self) -> Result<Reply> {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).map_err(|e| BenchError::io("read peer reply", e))?;
        if n == 0 {
            return Err(BenchError::PeerClosed("waiting for its reply"));
        }
        let r: Reply = serde_json::from_str(&line).map_err(|e| {
            BenchError::Protocol(format!("bad reply {line:?} from the {} peer: {e}", self.name))
        })?;
        if let Some(e) = r.error {
            return Err(BenchError::transport(self.name, format!("peer: {e}")));
        }
        Ok(r)
    }

    /// Runs one batch with the peer; see [`Batch`].
    pub fn batch(
        &mut self,
        kind: Kind,
        size: u64,
        n: u64,
        clock: &Clock,
        counter: Option<&SyscallCounter>,
        samples: &mut Vec<u64>,
    ) -> Result<Batch> {
        let sz = size as usize;
        self.transport.prepare(sz)?;
        self.transport.count_syscalls(counter.is_some());
        let cmd = match kind {
            Kind::Latency => PeerCommand::Latency { size, iters: n, count_syscalls: counter.is_some() },
            Kind::Bandwidth => PeerCommand::Stream { size, count: n, count_syscalls: counter.is_some() },
        };
        self.send(&cmd)?;
        let c0 = process_cpu_ns();
        let s0 = counter.map(|c| c.read()).transpose().ok().flatten();
        let t0 = clock.now();
        let r = match kind {
            Kind::Latency => self.transport.ping_batch(sz, n, clock, samples),
            Kind::Bandwidth => self.transport.stream_send(sz, n),
        };
        let t1 = clock.now();
        let s1 = counter.map(|c| c.read()).transpose().ok().flatten();
        let c1 = process_cpu_ns();
        // On failure the peer may be stuck mid-batch: it is killed when the Peer drops.
        r?;
        let reply = self.reply()?;
        let mut own_syscalls = match (counter, s0, s1) {
            (Some(c), Some(a), Some(b)) => Some(c.delta(a, b)),
            _ => None,
        };
        let mut own_cpu = c1.saturating_sub(c0);
        if let Some(h) = self.transport.helper_cost() {
            own_cpu = h.cpu_ns;
            own_syscalls = h.syscalls.filter(|_| counter.is_some());
        }
        Ok(Batch {
            ticks: t1.wrapping_sub(t0),
            cpu_ns: own_cpu + reply.cpu_ns,
            syscalls: own_syscalls.zip(reply.syscalls).map(|(a, b)| a + b),
            bytes: match kind {
                Kind::Latency => 2 * size * n,
                Kind::Bandwidth => reply.bytes,
            },
        })
    }

    /// Asks the peer to exit and reaps it.
    pub fn shutdown(mut self) {
        let _ = self.send(&PeerCommand::Quit);
        // Give it a moment to exit by itself; kill it if it does not.
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What one batch measured (both processes together).
#[derive(Debug, Clone, Copy, Default)]
pub struct Batch {
    /// Wall time of the driver's side of the batch, in clock ticks.
    pub ticks: u64,
    /// CPU time of driver and peer, in ns.
    pub cpu_ns: u64,
    /// System calls of driver and peer, if counted.
    pub syscalls: Option<u64>,
    /// Payload bytes moved (latency: both directions; streaming: delivered).
    pub bytes: u64,
}

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Most warm-up iterations (or messages) per transport and size; warm-up is also
    /// capped at half a batch's time.
    pub warmup: u64,
    /// Most ping-pong iterations per latency batch.
    pub iters: u64,
    /// Most messages per bandwidth batch.
    pub bw_msgs: u64,
    /// Interleaved rounds per size.
    pub rounds: u32,
    /// Target duration of one batch, in ms (iterations are chosen to fit it).
    pub batch_ms: f64,
    /// Iterations of the separate syscall-counting pass (0 disables it).
    pub count_iters: u64,
    /// Ping-pong sizes.
    pub lat_sizes: Vec<u64>,
    /// Streaming sizes.
    pub bw_sizes: Vec<u64>,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            warmup: 1000,
            iters: 20_000,
            bw_msgs: 100_000,
            rounds: 10,
            batch_ms: 40.0,
            count_iters: 200,
            lat_sizes: vec![8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20],
            bw_sizes: vec![1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20],
        }
    }
}

/// Progress events for a progress bar.
#[derive(Debug, Clone)]
pub enum Progress {
    /// Total number of steps (batches) the run will take.
    Total(u64),
    /// Steps done, and what is being measured now.
    Step(u64, String),
    /// A warning worth showing to the user (once).
    Warn(String),
}

/// Samples and counters of one (transport, kind, size) cell, pooled over rounds.
#[derive(Default)]
struct Cell {
    samples: Vec<u64>,
    batches: Vec<Batch>,
    msgs: u64,
    syscalls: Option<(u64, u64)>,
    note: Option<String>,
    error: Option<String>,
    skipped: bool,
}

/// Runs the whole benchmark over `peers` (already spawned, in the order given) and
/// returns one result row per (transport, kind, size).
pub fn run(
    cfg: &BenchConfig,
    specs: &[&dyn TransportSpec],
    peers: &mut [Option<Peer>],
    clock: &Clock,
    counter: Option<&SyscallCounter>,
    progress: &mut dyn FnMut(Progress),
) -> Vec<ResultRow> {
    let cells = (cfg.lat_sizes.len() + cfg.bw_sizes.len()) as u64 * specs.len() as u64;
    progress(Progress::Total(cells * (cfg.rounds as u64 + 2)));
    let mut done = 0u64;
    let mut rows = Vec::new();
    // STRAIT_BENCH_DEBUG=1 prints every batch on stderr.
    let debug = std::env::var_os("STRAIT_BENCH_DEBUG").is_some();
    let plan: Vec<(Kind, u64)> = cfg
        .lat_sizes
        .iter()
        .map(|&s| (Kind::Latency, s))
        .chain(cfg.bw_sizes.iter().map(|&s| (Kind::Bandwidth, s)))
        .collect();
    for (kind, size) in plan {
        let mut cells: Vec<Cell> = specs.iter().map(|_| Cell::default()).collect();
        let mut batch_n = vec![0u64; specs.len()];
        // Calibration: probe, warm up, size the batches.
        for (i, spec) in specs.iter().enumerate() {
            let cell = &mut cells[i];
            let support = match kind {
                Kind::Latency => spec.latency_support(size),
                Kind::Bandwidth => spec.bandwidth_support(size),
            };
            match support {
                Support::Skip(why) => {
                    cell.skipped = true;
                    cell.note = Some(format!("skipped: {why}"));
                }
                Support::Run(note) => cell.note = note,
            }
            done += 2;
            progress(Progress::Step(done, format!("{} {} {}: warm-up", spec.name(), kind.name(), size)));
            if cell.skipped {
                continue;
            }
            let Some(peer) = peers[i].as_mut() else {
                cell.error = Some("peer not running (failed earlier)".into());
                continue;
            };
            match calibrate(cfg, kind, size, peer, clock) {
                Ok(n) => batch_n[i] = n,
                Err(e) => {
                    cell.error = Some(e.to_string());
                    progress(Progress::Warn(format!("{}: {e}; dropping it from the run", spec.name())));
                    peers[i] = None;
                }
            }
        }
        // Interleaved timed rounds.
        for round in 0..cfg.rounds as usize {
            for k in 0..specs.len() {
                let i = (k + round) % specs.len();
                done += 1;
                if batch_n[i] == 0 || cells[i].error.is_some() {
                    continue;
                }
                let Some(peer) = peers[i].as_mut() else { continue };
                progress(Progress::Step(
                    done,
                    format!(
                        "{} {} {} round {}/{}",
                        specs[i].name(),
                        kind.name(),
                        size,
                        round + 1,
                        cfg.rounds
                    ),
                ));
                let cell = &mut cells[i];
                cell.samples.reserve(batch_n[i] as usize);
                match peer.batch(kind, size, batch_n[i], clock, None, &mut cell.samples) {
                    Ok(b) => {
                        if debug {
                            eprintln!(
                                "[bench] {} {} {size} round {round}: n={} wall={:.0}ns cpu={}ns",
                                specs[i].name(),
                                kind.name(),
                                batch_n[i],
                                clock.to_ns(b.ticks),
                                b.cpu_ns
                            );
                        }
                        cell.batches.push(b);
                        cell.msgs += msgs_of(kind, batch_n[i]);
                    }
                    Err(e) => {
                        cell.error = Some(e.to_string());
                        progress(Progress::Warn(format!(
                            "{}: {e}; dropping it from the run",
                            specs[i].name()
                        )));
                        peers[i] = None;
                    }
                }
            }
        }
        // Separate syscall-counting pass.
        if let Some(counter) = counter.filter(|_| cfg.count_iters > 0) {
            for i in 0..specs.len() {
                if batch_n[i] == 0 || cells[i].error.is_some() {
                    continue;
                }
                let Some(peer) = peers[i].as_mut() else { continue };
                let n = cfg.count_iters.min(batch_n[i]).max(1);
                let mut scratch = Vec::with_capacity(n as usize);
                match peer.batch(kind, size, n, clock, Some(counter), &mut scratch) {
                    Ok(b) => cells[i].syscalls = b.syscalls.map(|s| (s, msgs_of(kind, n))),
                    Err(e) => {
                        cells[i].error = Some(e.to_string());
                        peers[i] = None;
                    }
                }
            }
        }
        for (i, cell) in cells.into_iter().enumerate() {
            rows.push(finish_cell(specs[i].name(), kind, size, cell, clock));
        }
    }
    rows
}

/// Messages one batch of `n` carries: a ping-pong iteration is two one-way messages.
fn msgs_of(kind: Kind, n: u64) -> u64 {
    match kind {
        Kind::Latency => 2 * n,
        Kind::Bandwidth => n,
    }
}

/// Probes, warms up and returns the iteration count that fits one batch.
fn calibrate(cfg: &BenchConfig, kind: Kind, size: u64, peer: &mut Peer, clock: &Clock) -> Result<u64> {
    let mut scratch = Vec::new();
    let target_ns = cfg.batch_ms * 1e6;
    let cap = match kind {
        Kind::Latency => cfg.iters,
        Kind::Bandwidth => cfg.bw_msgs,
    }
    .max(1);
    let probe_n = 4u64.min(cap);
    let b = peer.batch(kind, size, probe_n, clock, None, &mut scratch)?;
    let mut per = clock.to_ns(b.ticks) / probe_n as f64;
    if cfg.warmup > 0 {
        let n = ((target_ns / 2.0 / per.max(1.0)) as u64).clamp(4, cfg.warmup.max(4));
        scratch.clear();
        scratch.reserve(n as usize);
        let b = peer.batch(kind, size, n, clock, None, &mut scratch)?;
        per = clock.to_ns(b.ticks) / n as f64;
        // For ping-pong, the second half of the warm-up is free of start-up effects
        // (the peer waking up, caches filling).
        let tail = &scratch[scratch.len() / 2..];
        if kind == Kind::Latency && !tail.is_empty() {
            per = clock.to_ns(tail.iter().sum::<u64>()) / tail.len() as f64;
        }
    }
    let min = match kind {
        Kind::Latency => 5,
        Kind::Bandwidth => 4,
    };
    Ok(((target_ns / per.max(1.0)) as u64).clamp(min.min(cap), cap))
}

fn finish_cell(name: &str, kind: Kind, size: u64, cell: Cell, clock: &Clock) -> ResultRow {
    let mut row = ResultRow::empty(name, kind, size);
    row.note = cell.note;
    if let Some(e) = cell.error {
        row.note = Some(match row.note {
            Some(n) => format!("{n}; failed: {e}"),
            None => format!("failed: {e}"),
        });
    }
    if cell.skipped || cell.batches.is_empty() {
        return row;
    }
    let cpu: u64 = cell.batches.iter().map(|b| b.cpu_ns).sum();
    row.cpu_ns_per_msg = (cell.msgs > 0).then(|| cpu as f64 / cell.msgs as f64);
    row.syscalls_per_msg = cell.syscalls.map(|(s, m)| s as f64 / m as f64);
    match kind {
        Kind::Latency => {
            // One-way latency = round trip / 2.
            let mut ns: Vec<f64> = cell.samples.iter().map(|&t| clock.to_ns(t) / 2.0).collect();
            if let Some(s) = summarize(&mut ns) {
                row.p50_ns = Some(s.p50);
                row.p99_ns = Some(s.p99);
                row.p999_ns = Some(s.p999);
                row.samples = s.count as u64;
            }
        }
        Kind::Bandwidth => {
            // Per batch: time per delivered message; GB/s from the median batch.
            let mut per_msg: Vec<f64> = cell
                .batches
                .iter()
                .filter(|b| b.bytes > 0)
                .map(|b| clock.to_ns(b.ticks) / (b.bytes as f64 / size as f64))
                .collect();
            let sent: u64 = cell.msgs * size;
            let delivered: u64 = cell.batches.iter().map(|b| b.bytes).sum();
            if delivered < sent {
                let lost = 100.0 * (sent - delivered) as f64 / sent as f64;
                let n = format!("{lost:.1}% of bytes lost (not counted)");
                row.note = Some(match row.note {
                    Some(prev) => format!("{prev}; {n}"),
                    None => n,
                });
            }
            if let Some(s) = summarize(&mut per_msg) {
                row.p50_ns = Some(s.p50);
                row.p99_ns = Some(s.p99);
                row.p999_ns = Some(s.p999);
                row.gbytes_per_s = Some(size as f64 / s.p50);
                row.samples = s.count as u64;
            }
        }
    }
    row
}
