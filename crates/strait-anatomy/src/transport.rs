//! The transport abstraction the benchmark drives: one [`TransportSpec`] (a factory,
//! known by name) and one [`Transport`] (a connected end) per mechanism.
//!
//! Each transport connects two processes: the benchmark (the *driver*) and a peer
//! process it spawns. Both ends hold a [`Transport`] built by the same spec: the driver
//! calls [`Transport::ping`] and [`Transport::stream_send`], the peer
//! [`Transport::pong`] and [`Transport::stream_recv`]. Adding a transport means one
//! new spec and one new `Transport` impl; the harness, statistics and reports are
//! shared.

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

use thiserror::Error;

use crate::clock::Clock;

/// Everything that can go wrong while benchmarking.
#[derive(Debug, Error)]
pub enum BenchError {
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer did not answer in time.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, &'static str),
    /// The peer closed its end (it exited or crashed).
    #[error("peer closed the connection while {0}")]
    PeerClosed(&'static str),
    /// The peer answered something unexpected on the control channel or data path.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A transport-specific failure.
    #[error("{transport}: {message}")]
    Transport {
        /// Transport name.
        transport: String,
        /// What happened.
        message: String,
    },
    /// No transport of this name exists.
    #[error("unknown transport {name:?} (known: {known})")]
    UnknownTransport {
        /// The name asked for.
        name: String,
        /// Comma-separated known names.
        known: String,
    },
    /// Writing the result files failed.
    #[error("writing {path}: {source}")]
    Output {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl BenchError {
    /// Wraps an `io::Error` with what was being done.
    pub fn io(context: impl Into<String>, source: io::Error) -> BenchError {
        BenchError::Io { context: context.into(), source }
    }

    /// A transport-specific error.
    pub fn transport(transport: &str, message: impl Into<String>) -> BenchError {
        BenchError::Transport { transport: transport.to_owned(), message: message.into() }
    }
}

/// Short alias used by transports.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// Whether a transport can run a given measurement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Support {
    /// It runs; an optional note explains how (e.g. "sent as 2 datagrams").
    Run(Option<String>),
    /// It cannot run; the reason is reported in the results.
    Skip(String),
}

/// What the driver needs to start a transport's peer, and how it then finishes
/// connecting its own end.
pub struct Pending {
    /// Transport-specific arguments for the peer's [`TransportSpec::connect`].
    pub peer_args: Vec<String>,
    /// Descriptors the peer inherits, in order, as fds 3, 4, ...
    pub peer_fds: Vec<OwnedFd>,
    /// Completes the driver's end once the peer process exists.
    pub finish: Box<dyn FnOnce() -> Result<Box<dyn Transport>>>,
}

/// Writes the methods that name a [`TransportSpec`], inside its `impl` block:
/// `name` returns `$name`, `description` `$description`, and `polls` the value of
/// `$polls` (`true` for a transport that always busy-polls):
/// `spec_identity!("pipe", "anonymous pipes", false);`.
#[macro_export]
macro_rules! spec_identity {
    ($name:expr, $description:expr, $polls:expr) => {
        fn name(&self) -> &'static str {
            $name
        }

        fn description(&self) -> &'static str {
            $description
        }

        fn polls(&self) -> bool {
            $polls
        }
    };
}

/// A named kind of transport: knows what it supports and how to connect both ends.
pub trait TransportSpec: Sync {
    /// The name used on the command line and in reports (e.g. `kernel-tcp`).
    fn name(&self) -> &'static str;

    /// One line describing the mechanism, for `--help`-style listings.
    fn description(&self) -> &'static str;

    /// Whether a ping-pong of `size`-byte messages is possible.
    fn latency_support(&self, size: u64) -> Support {
        let _ = size;
        Support::Run(None)
    }

    /// Whether streaming `size`-byte messages is possible, and how it is done.
    fn bandwidth_support(&self, size: u64) -> Support {
        let _ = size;
        Support::Run(None)
    }

    /// True if this transport busy-polls (so its CPU per message includes spinning).
    fn polls(&self) -> bool {
        false
    }

    /// What this transport chose on this host for settings left to it, and why, for
    /// the report (`None`: nothing chosen).
    fn settings(&self) -> Option<String> {
        None
    }

    /// Extra environment for this transport's peer process (e.g. `LD_PRELOAD` for
    /// `strait-run`), on top of the launcher's.
    fn peer_env(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// Driver side, before the peer is spawned: create listening resources.
    fn listen(&self) -> Result<Pending>;

    /// Peer side: connect with the driver's `args` and the inherited `fds`.
    fn connect(&self, args: &[String], fds: Vec<OwnedFd>) -> Result<Box<dyn Transport>>;
}

/// The [`Transport`] methods of a lossless link whose messages go one at a time
/// through its own `send(size)` and `recv(size)` (each `Result<()>`): ping and pong
/// as a message each way, a stream as `count` messages then an 8-byte
/// acknowledgement. Expands inside an `impl Transport for ...` block.
macro_rules! lockstep_transport {
    () => {
        fn ping(&mut self, size: usize) -> Result<()> {
            self.send(size)?;
            self.recv(size)
        }

        fn pong(&mut self, size: usize) -> Result<()> {
            self.recv(size)?;
            self.send(size)
        }

        fn stream_send(&mut self, size: usize, count: u64) -> Result<()> {
            for _ in 0..count {
                self.send(size)?;
            }
            self.recv(8)
        }

        fn stream_recv(&mut self, size: usize, count: u64) -> Result<u64> {
            for _ in 0..count {
                self.recv(size)?;
            }
            self.send(8)?;
            Ok(size as u64 * count)
        }
    };
}
pub(crate) use lockstep_transport;

/// One connected end of a transport.
///
/// Message contents are not checked; the buffers are allocated and touched in
/// [`Transport::prepare`], outside any measurement.
pub trait Transport {
    /// Makes buffers ready for messages of up to `size` bytes (outside timing).
    fn prepare(&mut self, size: usize) -> Result<()>;

    /// Driver: sends one `size`-byte message and waits for the `size`-byte reply.
    fn ping(&mut self, size: usize) -> Result<()>;

    /// Peer: waits for one `size`-byte message and sends a `size`-byte reply.
    fn pong(&mut self, size: usize) -> Result<()>;

    /// Driver: sends `count` messages of `size` bytes, then waits for the peer's
    /// acknowledgement that it has them all.
    fn stream_send(&mut self, size: usize, count: u64) -> Result<()>;

    /// Peer: receives `count` messages of `size` bytes, then acknowledges. Returns
    /// the payload bytes actually delivered (less than `count * size` only for a
    /// lossy transport).
    fn stream_recv(&mut self, size: usize, count: u64) -> Result<u64>;

    /// Driver: `iters` ping-pongs, pushing each round-trip time (in `clock` ticks)
    /// onto `samples`.
    fn ping_batch(&mut self, size: usize, iters: u64, clock: &Clock, samples: &mut Vec<u64>) -> Result<()> {
        for _ in 0..iters {
            let t0 = clock.now();
            self.ping(size)?;
            let t1 = clock.now();
            samples.push(t1.wrapping_sub(t0));
        }
        Ok(())
    }

    /// Peer: `iters` pongs.
    fn pong_batch(&mut self, size: usize, iters: u64) -> Result<()> {
        for _ in 0..iters {
            self.pong(size)?;
        }
        Ok(())
    }

    /// Whether the peer must call [`Transport::idle`] while it waits for the next
    /// command: a transport whose protocol runs in the program (acknowledgements
    /// and retransmissions of a user-level reliability layer) stalls its driver if
    /// the peer stops driving it with packets still unsent or unacknowledged.
    fn needs_idle(&self) -> bool {
        false
    }

    /// Peer, between batches: lets the transport's protocol make progress.
    fn idle(&mut self) {}

    /// Driver, before each batch: whether the batch's system calls are being
    /// counted. A transport whose driver end lives in a helper process (see
    /// [`Transport::helper_cost`]) passes it on; others ignore it.
    fn count_syscalls(&mut self, on: bool) {
        let _ = on;
    }

    /// Driver, after each batch: the cost of the batch when the driver's end of the
    /// transport lives in a helper process (as `strait-run`'s must, under the
    /// preload library, which the driver process is not). It replaces the driver
    /// process's own CPU time and system calls, which were only spent waiting for
    /// the helper. `None`: the end lives in this process.
    fn helper_cost(&mut self) -> Option<HelperCost> {
        None
    }
}

/// What a batch cost in a helper process that holds the driver's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HelperCost {
    /// Process CPU time of the helper during the batch, in ns.
    pub cpu_ns: u64,
    /// System calls the helper made during the batch, if counted.
    pub syscalls: Option<u64>,
}

/// Grows `buf` to at least `size` bytes, touching every page.
pub fn ensure_len(buf: &mut Vec<u8>, size: usize) {
    if buf.len() < size {
        buf.resize(size, 0xa5);
    }
}
