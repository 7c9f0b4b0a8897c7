//! The kernel paths a user would otherwise take: TCP and UDP over loopback, a Unix
//! stream socket pair, and pipes. By default all use plain blocking calls, as a
//! program would. With [`set_busy_poll`] (`strait bench --kernel-spin`) their
//! descriptors are non-blocking and every call is retried until it succeeds, so
//! they spin like the shared-memory transports (each retry is a real syscall and is
//! counted as one).

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::transport::{ensure_len, BenchError, Pending, Result, Support, Transport, TransportSpec};

static BUSY_POLL: AtomicBool = AtomicBool::new(false);

/// Environment variable that tells peer processes to busy-poll the kernel paths.
pub const BUSY_POLL_ENV: &str = "STRAIT_BENCH_KERNEL_SPIN";

/// Makes kernel transports created from now on busy-poll (non-blocking fds and
/// retries) instead of blocking.
pub fn set_busy_poll(on: bool) {
    BUSY_POLL.store(on, Ordering::Relaxed);
}

/// True if kernel transports busy-poll.
pub fn busy_poll() -> bool {
    BUSY_POLL.load(Ordering::Relaxed)
}

fn set_nonblocking(fd: &impl AsRawFd, what: &str) -> Result<()> {
    let fd = fd.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own, no pointers.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(BenchError::io(format!("{what}: O_NONBLOCK"), io::Error::last_os_error()));
    }
    Ok(())
}

/// Calls `op` until it stops saying "would block" (busy-poll mode); gives up after
/// [`DATA_TIMEOUT`].
fn retry<T>(mut op: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let mut start: Option<Instant> = None;
    let mut n: u32 = 0;
    loop {
        match op() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::hint::spin_loop();
                n = n.wrapping_add(1);
                if n.is_multiple_of(1024) && start.get_or_insert_with(Instant::now).elapsed() > DATA_TIMEOUT {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "busy-poll timed out"));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

fn write_all(f: &mut File, mut buf: &[u8], spin: bool) -> io::Result<()> {
    if !spin {
        return f.write_all(buf);
    }
    while !buf.is_empty() {
        match retry(|| f.write(buf))? {
            0 => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote 0 bytes")),
            n => buf = &buf[n..],
        }
    }
    Ok(())
}

fn read_exact(f: &mut File, mut buf: &mut [u8], spin: bool) -> io::Result<()> {
    if !spin {
        return f.read_exact(buf);
    }
    while !buf.is_empty() {
        match retry(|| f.read(buf))? {
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "end of stream")),
            n => buf = &mut buf[n..],
        }
    }
    Ok(())
}

/// How long connection setup may take before the benchmark gives up.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

fn read_err(name: &'static str) -> impl Fn(io::Error) -> BenchError {
    move |e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            BenchError::PeerClosed("reading")
        } else if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            BenchError::Timeout(DATA_TIMEOUT, "data from the peer")
        } else {
            BenchError::io(format!("{name}: read"), e)
        }
    }
}

fn write_err(name: &'static str) -> impl Fn(io::Error) -> BenchError {
    move |e| BenchError::io(format!("{name}: write"), e)
}

/// A byte-stream transport: `tx` carries data to the other end, `rx` from it. For
/// sockets both are the same connection; for pipes they are two pipes. Streaming
/// sends data on the driver's `tx` and the acknowledgement on the peer's `tx`.
struct StreamLink {
    name: &'static str,
    rx: File,
    tx: File,
    sbuf: Vec<u8>,
    rbuf: Vec<u8>,
    spin: bool,
}

impl StreamLink {
    fn new(name: &'static str, rx: OwnedFd, tx: OwnedFd) -> Result<StreamLink> {
        let spin = busy_poll();
        if spin {
            set_nonblocking(&rx, name)?;
            set_nonblocking(&tx, name)?;
        }
        Ok(StreamLink {
            name,
            rx: File::from(rx),
            tx: File::from(tx),
            sbuf: Vec::new(),
            rbuf: Vec::new(),
            spin,
        })
    }

    fn send(&mut self, size: usize) -> Result<()> {
        write_all(&mut self.tx, &self.sbuf[..size], self.spin).map_err(write_err(self.name))
    }

    fn recv(&mut self, size: usize) -> Result<()> {
        read_exact(&mut self.rx, &mut self.rbuf[..size], self.spin).map_err(read_err(self.name))
    }
}

impl Transport for StreamLink {
    fn prepare(&mut self, size: usize) -> Result<()> {
        ensure_len(&mut self.sbuf, size.max(8));
        ensure_len(&mut self.rbuf, size.max(8));
        Ok(())
    }

    crate::transport::lockstep_transport!();
}

/// Names the variable that moves the kernel transports off loopback:
/// `DRIVER_IP,PEER_IP` (set by `strait bench --across-netns` for the driver and its
/// peers, which then run in two network namespaces joined by a veth pair).
pub const NET_ENV: &str = "STRAIT_BENCH_NET";

/// The driver's and the peer's addresses: loopback unless [`NET_ENV`] says otherwise.
pub fn bench_addrs() -> Result<(IpAddr, IpAddr)> {
    let Ok(v) = std::env::var(NET_ENV) else {
        return Ok((IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V4(Ipv4Addr::LOCALHOST)));
    };
    let bad = || BenchError::Protocol(format!("{NET_ENV}={v:?}: expected DRIVER_IP,PEER_IP"));
    let (a, b) = v.split_once(',').ok_or_else(bad)?;
    Ok((a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?))
}

/// Time a blocking data-path read may take before the peer is presumed dead.
const DATA_TIMEOUT: Duration = Duration::from_secs(30);

fn dup(fd: &impl std::os::fd::AsFd, what: &str) -> Result<OwnedFd> {
    fd.as_fd().try_clone_to_owned().map_err(|e| BenchError::io(format!("dup {what}"), e))
}

/// TCP over loopback with `TCP_NODELAY`.
pub struct KernelTcp;

impl TransportSpec for KernelTcp {
    crate::spec_identity!("kernel-tcp", "TCP over 127.0.0.1, TCP_NODELAY, blocking read/write", busy_poll());

    fn listen(&self) -> Result<Pending> {
        tcp_listen("kernel-tcp")
    }

    fn connect(&self, args: &[String], _fds: Vec<OwnedFd>) -> Result<Box<dyn Transport>> {
        tcp_connect("kernel-tcp", args)
    }
}

/// The driver's end of a TCP transport named `name` (kernel-tcp, or strait-run,
/// whose ends make the same socket calls under the preload library): listens on
/// the driver's address; the peer's argument is the port.
pub fn tcp_listen(name: &'static str) -> Result<Pending> {
    let (driver, _) = bench_addrs()?;
    let l = TcpListener::bind((driver, 0)).map_err(|e| BenchError::io(format!("{name}: bind"), e))?;
    let port = l.local_addr().map_err(|e| BenchError::io(format!("{name}: local_addr"), e))?.port();
    Ok(Pending {
        peer_args: vec![port.to_string()],
        peer_fds: Vec::new(),
        finish: Box::new(move || {
            l.set_nonblocking(true).map_err(|e| BenchError::io(format!("{name}: nonblocking"), e))?;
            let deadline = Instant::now() + SETUP_TIMEOUT;
            let s = loop {
                match l.accept() {
                    Ok((s, _)) => break s,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            return Err(BenchError::Timeout(SETUP_TIMEOUT, "the tcp peer to connect"));
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => return Err(BenchError::io(format!("{name}: accept"), e)),
                }
            };
            tcp_link(name, s)
        }),
    })
}

/// The peer's end of a TCP transport named `name`: connects to the port in `args`.
pub fn tcp_connect(name: &'static str, args: &[String]) -> Result<Box<dyn Transport>> {
    let port: u16 = args
        .first()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| BenchError::Protocol(format!("{name} peer needs a port argument")))?;
    let (driver, _) = bench_addrs()?;
    let s = TcpStream::connect((driver, port)).map_err(|e| BenchError::io(format!("{name}: connect"), e))?;
    tcp_link(name, s)
}

fn tcp_link(name: &'static str, s: TcpStream) -> Result<Box<dyn Transport>> {
    s.set_nonblocking(false).map_err(|e| BenchError::io(format!("{name}: blocking"), e))?;
    s.set_nodelay(true).map_err(|e| BenchError::io(format!("{name}: TCP_NODELAY"), e))?;
    s.set_read_timeout(Some(DATA_TIMEOUT)).map_err(|e| BenchError::io(format!("{name}: SO_RCVTIMEO"), e))?;
    let rx = dup(&s, "tcp socket")?;
    Ok(Box::new(StreamLink::new(name, rx, OwnedFd::from(s))?))
}

/// A connected `AF_UNIX` `SOCK_STREAM` socket pair.
pub struct UnixStreamSpec;

impl TransportSpec for UnixStreamSpec {
    crate::spec_identity!("unix-stream", "AF_UNIX SOCK_STREAM socketpair, blocking read/write", busy_poll());

    fn listen(&self) -> Result<Pending> {
        let (mine, theirs) = UnixStream::pair().map_err(|e| BenchError::io("unix: socketpair", e))?;
        Ok(Pending {
            peer_args: Vec::new(),
            peer_fds: vec![OwnedFd::from(theirs)],
            finish: Box::new(move || unix_link(mine)),
        })
    }

    fn connect(&self, _args: &[String], fds: Vec<OwnedFd>) -> Result<Box<dyn Transport>> {
        let fd =
            fds.into_iter().next().ok_or_else(|| BenchError::Protocol("unix peer needs one fd".into()))?;
        unix_link(UnixStream::from(fd))
    }
}

fn unix_link(s: UnixStream) -> Result<Box<dyn Transport>> {
    s.set_read_timeout(Some(DATA_TIMEOUT)).map_err(|e| BenchError::io("unix: SO_RCVTIMEO", e))?;
    let rx = dup(&s, "unix socket")?;
    Ok(Box::new(StreamLink::new("unix-stream", rx, OwnedFd::from(s))?))
}

/// Two pipes (one each way) for ping-pong; streaming uses one for data and the
/// other only for the final acknowledgement.
pub struct PipeSpec;

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two fds into the local array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(BenchError::io("pipe2", io::Error::last_os_error()));
    }
    // SAFETY: both fds were just created by pipe2 and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

impl TransportSpec for PipeSpec {
    crate::spec_identity!(
        "pipe",
        "anonymous pipes (default 64 KiB capacity), blocking read/write",
        busy_poll()
    );

    fn listen(&self) -> Result<Pending> {
        let (to_peer_r, to_peer_w) = pipe()?;
        let (from_peer_r, from_peer_w) = pipe()?;
        Ok(Pending {
            peer_args: Vec::new(),
            peer_fds: vec![to_peer_r, from_peer_w],
            finish: Box::new(move || Ok(Box::new(StreamLink::new("pipe", from_peer_r, to_peer_w)?))),
        })
    }

    fn connect(&self, _args: &[String], fds: Vec<OwnedFd>) -> Result<Box<dyn Transport>> {
        let mut it = fds.into_iter();
        match (it.next(), it.next()) {
            (Some(rx), Some(tx)) => Ok(Box::new(StreamLink::new("pipe", rx, tx)?)),
            _ => Err(BenchError::Protocol("pipe peer needs two fds".into())),
        }
    }
}

/// Largest UDP payload over IPv4 (65535 - 20 IP - 8 UDP).
pub const UDP_MAX_PAYLOAD: u64 = 65507;

/// How a `size`-byte message is cut into datagrams: `(count, bytes of each but the
/// last)`, as even as possible and each at most [`UDP_MAX_PAYLOAD`].
pub fn udp_split(size: u64) -> (u64, u64) {
    let n = size.div_ceil(UDP_MAX_PAYLOAD).max(1);
    (n, size.div_ceil(n))
}

const UDP_END: u64 = u64::from_le_bytes(*b"STRAITEN");
const UDP_ACK: u64 = u64::from_le_bytes(*b"STRAITAK");
const UDP_HELLO: &[u8] = b"strait-hello";

/// UDP over loopback, both sockets `connect`ed to each other.
///
/// Ping-pong sends one datagram each way, so sizes above 65507 bytes are skipped.
/// Streaming cuts larger messages into even datagrams of at most 65507 bytes; the
/// sender does not wait for the receiver (UDP has no flow control), the receiver
/// counts what arrives, and an end marker (resent until acknowledged) closes the
/// batch. Bandwidth counts only delivered bytes.
pub struct KernelUdp;

struct UdpLink {
    s: UdpSocket,
    spin: bool,
    /// SO_RCVTIMEO in force (blocking mode), so it is set only when it changes.
    timeout: Duration,
    sbuf: Vec<u8>,
    rbuf: Vec<u8>,
    /// Batch number, kept in step on both ends, so stale end markers are ignored.
    batch: u64,
}

fn marker(kind: u64, seq: u64) -> [u8; 16] {
    let mut m = [0u8; 16];
    m[..8].copy_from_slice(&kind.to_le_bytes());
    m[8..].copy_from_slice(&seq.to_le_bytes());
    m
}

fn parse_marker(b: &[u8]) -> Option<(u64, u64)> {
    if b.len() != 16 {
        return None;
    }
    let kind = u64::from_le_bytes(b[..8].try_into().ok()?);
    let seq = u64::from_le_bytes(b[8..].try_into().ok()?);
    (kind == UDP_END || kind == UDP_ACK).then_some((kind, seq))
}

impl UdpLink {
    /// One datagram, or `None` after `timeout`.
    fn recv_within(&mut self, timeout: Duration) -> Result<Option<usize>> {
        let r = if self.spin {
            let start = Instant::now();
            let mut n: u32 = 0;
            loop {
                match self.s.recv(&mut self.rbuf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::hint::spin_loop();
                        n = n.wrapping_add(1);
                        if n.is_multiple_of(256) && start.elapsed() > timeout {
                            break Err(e);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    r => break r,
                }
            }
        } else {
            if self.timeout != timeout {
                self.s.set_read_timeout(Some(timeout)).map_err(|e| BenchError::io("udp: SO_RCVTIMEO", e))?;
                self.timeout = timeout;
            }
            loop {
                // A signal (a child's exit, say) interrupts a blocking receive.
                match self.s.recv(&mut self.rbuf) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    r => break r,
                }
            }
        };
        match r {
            Ok(n) => Ok(Some(n)),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => Ok(None),
            Err(e) => Err(BenchError::io("kernel-udp: recv", e)),
        }
    }

    fn recv(&mut self) -> Result<usize> {
        self.recv_within(DATA_TIMEOUT)?.ok_or(BenchError::Timeout(DATA_TIMEOUT, "a udp datagram"))
    }

    /// Receives until a datagram of exactly `size` bytes that is not a marker.
    fn recv_exact(&mut self, size: usize) -> Result<()> {
        loop {
            let n = self.recv()?;
            let b = &self.rbuf[..n];
            if n == size && parse_marker(b).is_none() && b != UDP_HELLO {
                return Ok(());
            }
        }
    }

    fn send(&self, buf: &[u8]) -> Result<()> {
        let n = if self.spin { retry(|| self.s.send(buf)) } else { self.s.send(buf) }
            .map_err(write_err("kernel-udp"))?;
        if n != buf.len() {
            return Err(BenchError::transport("kernel-udp", format!("short send {n} of {}", buf.len())));
        }
        Ok(())
    }
}

impl Transport for UdpLink {
    fn prepare(&mut self, size: usize) -> Result<()> {
        ensure_len(&mut self.sbuf, size.clamp(16, UDP_MAX_PAYLOAD as usize));
        ensure_len(&mut self.rbuf, 65536);
        Ok(())
    }

    fn ping(&mut self, size: usize) -> Result<()> {
        self.send(&self.sbuf[..size])?;
        self.recv_exact(size)
    }

    fn pong(&mut self, size: usize) -> Result<()> {
        self.recv_exact(size)?;
        self.send(&self.sbuf[..size])
    }

    fn stream_send(&mut self, size: usize, count: u64) -> Result<()> {
        self.batch += 1;
        let (n, chunk) = udp_split(size as u64);
        let (n, chunk) = (n as usize, chunk as usize);
        for _ in 0..count {
            let mut left = size;
            for _ in 0..n {
                let len = left.min(chunk);
                self.send(&self.sbuf[..len])?;
                left -= len;
            }
        }
        let end = marker(UDP_END, self.batch);
        for _ in 0..150 {
            self.send(&end)?;
            while let Some(n) = self.recv_within(Duration::from_millis(200))? {
                if parse_marker(&self.rbuf[..n]) == Some((UDP_ACK, self.batch)) {
                    return Ok(());
                }
            }
        }
        Err(BenchError::Timeout(Duration::from_secs(30), "the udp end-of-stream acknowledgement"))
    }

    fn stream_recv(&mut self, _size: usize, _count: u64) -> Result<u64> {
        self.batch += 1;
        let mut bytes = 0u64;
        loop {
            let n = self.recv()?;
            match parse_marker(&self.rbuf[..n]) {
                Some((UDP_END, seq)) if seq == self.batch => break,
                Some(_) => {}
                None => bytes += n as u64,
            }
        }
        self.send(&marker(UDP_ACK, self.batch))?;
        Ok(bytes)
    }
}

fn udp_link(s: UdpSocket) -> Result<Box<dyn Transport>> {
    s.set_read_timeout(Some(DATA_TIMEOUT)).map_err(|e| BenchError::io("udp: SO_RCVTIMEO", e))?;
    let spin = busy_poll();
    if spin {
        s.set_nonblocking(true).map_err(|e| BenchError::io("udp: O_NONBLOCK", e))?;
    }
    Ok(Box::new(UdpLink { s, spin, timeout: DATA_TIMEOUT, sbuf: Vec::new(), rbuf: Vec::new(), batch: 0 }))
}

impl TransportSpec for KernelUdp {
    crate::spec_identity!(
        "kernel-udp",
        "UDP over 127.0.0.1, connected sockets, blocking send/recv (no flow control)",
        busy_poll()
    );

    fn latency_support(&self, size: u64) -> Support {
        if size > UDP_MAX_PAYLOAD {
            Support::Skip(format!("a UDP datagram carries at most {UDP_MAX_PAYLOAD} bytes"))
        } else {
            Support::Run(None)
        }
    }

    fn bandwidth_support(&self, size: u64) -> Support {
        let (n, chunk) = udp_split(size);
        if n > 1 {
            Support::Run(Some(format!("each message sent as {n} datagrams of <= {chunk} B")))
        } else {
            Support::Run(None)
        }
    }

    fn listen(&self) -> Result<Pending> {
        let (driver, _) = bench_addrs()?;
        let s = UdpSocket::bind((driver, 0)).map_err(|e| BenchError::io("udp: bind", e))?;
        let port = s.local_addr().map_err(|e| BenchError::io("udp: local_addr", e))?.port();
        Ok(Pending {
            peer_args: vec![port.to_string()],
            peer_fds: Vec::new(),
            finish: Box::new(move || {
                s.set_read_timeout(Some(SETUP_TIMEOUT)).map_err(|e| BenchError::io("udp: SO_RCVTIMEO", e))?;
                let mut b = [0u8; 64];
                let peer: SocketAddr = loop {
                    let (n, from) = s.recv_from(&mut b).map_err(|e| {
                        if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
                            BenchError::Timeout(SETUP_TIMEOUT, "the udp peer's hello")
                        } else {
                            BenchError::io("udp: recv hello", e)
                        }
                    })?;
                    if &b[..n] == UDP_HELLO {
                        break from;
                    }
                };
                s.connect(peer).map_err(|e| BenchError::io("udp: connect", e))?;
                s.send(UDP_HELLO).map_err(|e| BenchError::io("udp: send hello", e))?;
                udp_link(s)
            }),
        })
    }

    fn connect(&self, args: &[String], _fds: Vec<OwnedFd>) -> Result<Box<dyn Transport>> {
        let port: u16 = args
            .first()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| BenchError::Protocol("udp peer needs a port argument".into()))?;
        let (driver, me) = bench_addrs()?;
        let s = UdpSocket::bind((me, 0)).map_err(|e| BenchError::io("udp: bind", e))?;
        s.connect((driver, port)).map_err(|e| BenchError::io("udp: connect", e))?;
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .map_err(|e| BenchError::io("udp: SO_RCVTIMEO", e))?;
        // Hello until the driver answers (a datagram can be lost, in principle).
        let deadline = Instant::now() + SETUP_TIMEOUT;
        let mut b = [0u8; 64];
        loop {
            s.send(UDP_HELLO).map_err(|e| BenchError::io("udp: send hello", e))?;
            match s.recv(&mut b) {
                Ok(n) if &b[..n] == UDP_HELLO => break,
                Ok(_) => {}
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
                Err(e) => return Err(BenchError::io("udp: recv hello", e)),
            }
            if Instant::now() > deadline {
                return Err(BenchError::Timeout(SETUP_TIMEOUT, "the udp driver's hello"));
            }
        }
        udp_link(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_split_is_even_and_bounded() {
        assert_eq!(udp_split(1024), (1, 1024));
        assert_eq!(udp_split(65507), (1, 65507));
        assert_eq!(udp_split(65536), (2, 32768));
        assert_eq!(udp_split(1 << 20), (17, 61681));
        for s in [1u64, 1000, 65508, 262144, 4 << 20] {
            let (n, c) = udp_split(s);
            assert!(c <= UDP_MAX_PAYLOAD && n * c >= s && (n - 1) * c < s, "{s}: {n} x {c}");
        }
    }

    #[test]
    fn markers_round_trip() {
        assert_eq!(parse_marker(&marker(UDP_END, 7)), Some((UDP_END, 7)));
        assert_eq!(parse_marker(&[0xa5; 16]), None);
        assert_eq!(parse_marker(&[0xa5; 15]), None);
    }
}
