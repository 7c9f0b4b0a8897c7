//! `strait-run`: the path users run. Both ends make plain socket calls (TCP over
//! 127.0.0.1, `TCP_NODELAY`, blocking `read`/`write`, the same code as `kernel-tcp`)
//! in processes started with `libstrait_preload.so` preloaded, exactly as under
//! `strait run -- PROGRAM`, so the bytes go through the preload's shared-memory
//! byte rings.
//!
//! The driver process itself is not preloaded (its other transports must stay on
//! the kernel), so its end of the connection lives in a helper process started
//! with the library: `strait __bench-run-end`. The helper obeys one-line JSON
//! commands on its standard input (prepare, a batch of ping-pongs, a stream), times
//! each ping-pong with the same TSC clock as the driver, and reports the samples
//! and its own CPU time and system calls, which the harness counts instead of the
//! driver's (the driver only waited; [`Transport::helper_cost`]).

use std::io::{BufRead, BufReader, Write};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout};

use serde::{Deserialize, Serialize};
use strait_anatomy::kernel;
use strait_anatomy::sys::{process_cpu_ns, SyscallCounter};
use strait_anatomy::transport::Result;
use strait_anatomy::{BenchError, Clock, HelperCost, Pending, Support, Transport, TransportSpec};

const NAME: &str = "strait-run";

/// The hidden subcommand that runs the driver's end under the preload library.
pub const HELPER_SUBCOMMAND: &str = "__bench-run-end";

/// The preload library `strait run` would use, or why there is none.
fn library() -> std::result::Result<PathBuf, String> {
    crate::preload::find_lib(None)
}

/// The strait-run transport spec.
pub struct StraitRun;

impl TransportSpec for StraitRun {
    // A blocked read spins for STRAIT_SPIN_US before it sleeps.
    strait_anatomy::spec_identity!(
        NAME,
        "unchanged socket calls (TCP over 127.0.0.1, blocking read/write) under strait run's preload library",
        true
    );

    fn latency_support(&self, _size: u64) -> Support {
        match library() {
            Ok(_) => Support::Run(None),
            Err(e) => Support::Skip(e),
        }
    }

    fn bandwidth_support(&self, size: u64) -> Support {
        self.latency_support(size)
    }

    fn peer_env(&self) -> Vec<(String, String)> {
        library().map(|l| vec![("LD_PRELOAD".to_owned(), l.display().to_string())]).unwrap_or_default()
    }

    fn listen(&self) -> Result<Pending> {
        let lib = library().map_err(|e| BenchError::transport(NAME, e))?;
        let mut cmd = crate::preload::helper_under(HELPER_SUBCOMMAND, &lib);
        let mut child = cmd.spawn().map_err(|e| BenchError::io("spawn the strait-run helper", e))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(BenchError::Protocol("strait-run helper without control pipes".into()));
        };
        let mut end = RunEnd { child, stdin, stdout: BufReader::new(stdout), counting: false, cost: None };
        let listening = end.reply()?;
        let Some(port) = listening.port else {
            return Err(BenchError::Protocol("strait-run helper did not say its port".into()));
        };
        Ok(Pending {
            peer_args: vec![port.to_string()],
            peer_fds: Vec::new(),
            finish: Box::new(move || {
                // The helper answers once its end is connected (or failed).
                end.reply()?;
                Ok(Box::new(end))
            }),
        })
    }

    fn connect(&self, args: &[String], _fds: Vec<OwnedFd>) -> Result<Box<dyn Transport>> {
        kernel::tcp_connect(NAME, args)
    }
}

/// A command to the helper.
#[derive(Debug, Serialize, Deserialize)]
enum HelperCommand {
    Prepare { size: usize },
    Ping { size: usize, iters: u64, count_syscalls: bool },
    Stream { size: usize, count: u64, count_syscalls: bool },
    Quit,
}

/// The helper's answer to one command.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Answer {
    /// The port the helper listens on (its first answer).
    #[serde(default)]
    port: Option<u16>,
    /// Round-trip times of a ping batch, in clock ticks.
    #[serde(default)]
    samples: Vec<u64>,
    /// The helper's CPU time during the batch, in ns.
    #[serde(default)]
    cpu_ns: u64,
    /// The helper's system calls during the batch, if counted.
    #[serde(default)]
    syscalls: Option<u64>,
    #[serde(default)]
    error: Option<String>,
}

/// The driver's handle on the helper that holds its end.
struct RunEnd {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    counting: bool,
    cost: Option<HelperCost>,
}

impl RunEnd {
    fn send(&mut self, c: &HelperCommand) -> Result<()> {
        let mut text = serde_json::to_string(c).map_err(|e| BenchError::Protocol(e.to_string()))?;
        text.push('\n');
        self.stdin
            .write_all(text.as_bytes())
            .map_err(|e| BenchError::io("write to the strait-run helper", e))?;
        self.stdin.flush().map_err(|e| BenchError::io("write to the strait-run helper", e))
    }

    fn reply(&mut self) -> Result<Answer> {
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .map_err(|e| BenchError::io("read from the strait-run helper", e))?;
        if n == 0 {
            return Err(BenchError::PeerClosed("the strait-run helper's answer"));
        }
        let a: Answer = serde_json::from_str(&line).map_err(|e| {
            BenchError::Protocol(format!("bad answer {line:?} from the strait-run helper: {e}"))
        })?;
        if let Some(e) = a.error {
            return Err(BenchError::transport(NAME, format!("helper: {e}")));
        }
        Ok(a)
    }

    fn run(&mut self, c: &HelperCommand) -> Result<Answer> {
        self.send(c)?;
        let a = self.reply()?;
        self.cost = Some(HelperCost { cpu_ns: a.cpu_ns, syscalls: a.syscalls });
        Ok(a)
    }
}

impl Transport for RunEnd {
    fn prepare(&mut self, size: usize) -> Result<()> {
        self.send(&HelperCommand::Prepare { size })?;
        self.reply().map(|_| ())
    }

    fn ping(&mut self, size: usize) -> Result<()> {
        self.run(&HelperCommand::Ping { size, iters: 1, count_syscalls: false }).map(|_| ())
    }

    fn ping_batch(&mut self, size: usize, iters: u64, _clock: &Clock, samples: &mut Vec<u64>) -> Result<()> {
        let a = self.run(&HelperCommand::Ping { size, iters, count_syscalls: self.counting })?;
        if a.samples.len() as u64 != iters {
            return Err(BenchError::Protocol(format!(
                "strait-run helper timed {} of {iters} ping-pongs",
                a.samples.len()
            )));
        }
        samples.extend_from_slice(&a.samples);
        Ok(())
    }

    fn pong(&mut self, _size: usize) -> Result<()> {
        Err(BenchError::Protocol("the strait-run helper is the driver's end only".into()))
    }

    fn stream_send(&mut self, size: usize, count: u64) -> Result<()> {
        self.run(&HelperCommand::Stream { size, count, count_syscalls: self.counting }).map(|_| ())
    }

    fn stream_recv(&mut self, _size: usize, _count: u64) -> Result<u64> {
        Err(BenchError::Protocol("the strait-run helper is the driver's end only".into()))
    }

    fn count_syscalls(&mut self, on: bool) {
        self.counting = on;
    }

    fn helper_cost(&mut self) -> Option<HelperCost> {
        self.cost.take()
    }
}

impl Drop for RunEnd {
    fn drop(&mut self) {
        let _ = self.send(&HelperCommand::Quit);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `strait __bench-run-end`: the driver's end of `strait-run`, in a process started
/// with the preload library. Listens, says its port, accepts the peer, then obeys
/// commands until `Quit` or the end of its input.
pub fn helper_main() -> Result<()> {
    if std::env::var(kernel::BUSY_POLL_ENV).is_ok_and(|v| v == "1") {
        kernel::set_busy_poll(true);
    }
    let stdout = std::io::stdout();
    let answer = |a: &Answer| -> Result<()> {
        let mut text = serde_json::to_string(a).map_err(|e| BenchError::Protocol(e.to_string()))?;
        text.push('\n');
        let mut out = stdout.lock();
        out.write_all(text.as_bytes()).map_err(|e| BenchError::io("helper: write answer", e))?;
        out.flush().map_err(|e| BenchError::io("helper: write answer", e))
    };
    let pending = match kernel::tcp_listen(NAME) {
        Ok(p) => p,
        Err(e) => return answer(&Answer { error: Some(e.to_string()), ..Answer::default() }),
    };
    let port = pending.peer_args.first().and_then(|p| p.parse().ok());
    answer(&Answer { port, ..Answer::default() })?;
    let mut t = match (pending.finish)() {
        Ok(t) => t,
        Err(e) => return answer(&Answer { error: Some(e.to_string()), ..Answer::default() }),
    };
    answer(&Answer::default())?;
    let clock = Clock::new();
    let counter = SyscallCounter::open().ok();
    let mut input = BufReader::new(std::io::stdin());
    let mut line = String::new();
    loop {
        line.clear();
        let n = input.read_line(&mut line).map_err(|e| BenchError::io("helper: read command", e))?;
        if n == 0 {
            return Ok(());
        }
        let c: HelperCommand = serde_json::from_str(&line)
            .map_err(|e| BenchError::Protocol(format!("helper: bad command {line:?}: {e}")))?;
        let counting = match c {
            HelperCommand::Ping { count_syscalls, .. } | HelperCommand::Stream { count_syscalls, .. } => {
                count_syscalls
            }
            _ => false,
        };
        let counter = counter.as_ref().filter(|_| counting);
        let c0 = process_cpu_ns();
        let s0 = counter.map(|c| c.read()).transpose().ok().flatten();
        let mut a = Answer::default();
        let r = match c {
            HelperCommand::Quit => return Ok(()),
            HelperCommand::Prepare { size } => t.prepare(size),
            HelperCommand::Ping { size, iters, .. } => {
                a.samples.reserve(iters as usize);
                t.ping_batch(size, iters, &clock, &mut a.samples)
            }
            HelperCommand::Stream { size, count, .. } => t.stream_send(size, count),
        };
        let s1 = counter.map(|c| c.read()).transpose().ok().flatten();
        a.cpu_ns = process_cpu_ns().saturating_sub(c0);
        if let (Some(c), Some(x), Some(y)) = (counter, s0, s1) {
            a.syscalls = Some(c.delta(x, y));
        }
        if let Err(e) = r {
            a.error = Some(e.to_string());
        }
        answer(&a)?;
    }
}
