//! [`UdpLink`]: a connected UDP socket as a [`strait_core::Link`].

use std::collections::VecDeque;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Once;

use strait_core::{ConfigError, Link, LinkError, LinkStats, Reliable, ReliableConfig, SlotPool};
use thiserror::Error;

use crate::config::{Backend, UdpConfig};
use crate::mmsg::MmsgLink;
use crate::sys;
use crate::uring::UringLink;

/// Bytes of each posted receive buffer: any UDP datagram (and any GRO train, which
/// the kernel keeps below 64 KiB) fits whole, with the io_uring `recvmsg` header and
/// control space in front.
pub(crate) const RX_BUF_LEN: usize = 65536 + 128;

/// Why a udp link could not be set up.
#[derive(Debug, Error)]
pub enum UdpError {
    /// A system call failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The socket handed to [`UdpLink::from_socket`] has no peer.
    #[error("the UDP socket is not connected to a peer")]
    NotConnected,
    /// `STRAIT_UDP_BACKEND=uring` but the kernel refused io_uring.
    #[error("io_uring backend requested but unavailable: {0}")]
    UringUnavailable(std::io::Error),
    /// The path MTU leaves too little room for a datagram.
    #[error("path MTU gives {0}-byte datagrams; at least 256 are needed")]
    MtuTooSmall(usize),
    /// A `STRAIT_UDP_*` variable is malformed.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// udp-specific counters (besides [`LinkStats`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UdpStats {
    /// Datagrams the kernel refused to send (an ICMP error pending on the socket, a
    /// route change); the reliability layer resends them.
    pub tx_errors: u64,
    /// Receive errors reported by the kernel (ICMP errors; the receive is re-posted).
    pub rx_errors: u64,
    /// Datagrams longer than a receive buffer (dropped; also in
    /// [`LinkStats::datagrams_dropped`]).
    pub rx_truncated: u64,
    /// Times the posted receive buffers ran out (the socket buffer holds datagrams
    /// meanwhile).
    pub rx_nobufs: u64,
    /// GSO super-datagrams sent: each carries a run of equal-size datagrams (one
    /// system-call-free SQE, or one message of a `sendmmsg`).
    pub gso_sends: u64,
    /// Times the kernel refused a GSO send (`EIO`/`EINVAL`: the route cannot
    /// segment, no checksum offload, ...); the link then sends plain datagrams for
    /// the rest of its life.
    pub gso_refused: u64,
    /// Receives that held a GRO train of several datagrams (split and handed out
    /// one datagram at a time).
    pub gro_trains: u64,
    /// Zero-copy sends.
    pub zc_sends: u64,
    /// Lone datagrams sent by a plain `send` instead of the io_uring ring (also in
    /// [`LinkStats::doorbells`]; see [`UdpConfig::direct_send`]).
    pub direct_sends: u64,
    /// Doorbells (in [`LinkStats::doorbells`]) that submitted datagrams.
    pub tx_doorbells: u64,
    /// System calls made only for receiving: to let the kernel post receive
    /// completions (cooperative task running), re-post a receive or flush an
    /// overflowed completion ring (io_uring), or an empty `recvmmsg` (mmsg). Also
    /// in [`LinkStats::doorbells`].
    pub rx_doorbells: u64,
    /// Doorbells rung while the link was streaming (the previous [`STREAM_RUN`]
    /// that carried datagrams carried at least [`STREAM_MIN`] of them one way):
    /// moderated by the longer stream window.
    pub stream_doorbells: u64,
}

/// A doorbell that carries at least this many datagrams (or follows at least this
/// many arrivals) is busy; [`STREAM_RUN`] busy doorbells in a row make a stream,
/// moderated by the stream window.
pub const STREAM_MIN: usize = 8;

/// This many consecutive busy doorbells (see [`STREAM_MIN`]) make a stream.
pub const STREAM_RUN: u8 = 2;

/// Queues `slot` (`len` bytes) for the next flush, the same way in both backends: a
/// slot or length out of range is the caller's error, and a full queue (`cap`
/// entries) is counted and refused (the reliability layer sends later).
#[inline]
pub(crate) fn queue_send(
    pool: &mut SlotPool,
    txq: &mut VecDeque<(u32, u32)>,
    cap: usize,
    stats: &mut LinkStats,
    slot: u32,
    len: usize,
) -> Result<bool, LinkError> {
    if slot >= pool.count() || len > pool.slot_len() {
        return Err(LinkError::BadSlot { slot, len });
    }
    if txq.len() >= cap {
        stats.send_full += 1;
        return Ok(false);
    }
    pool.begin_tx(slot);
    txq.push_back((slot, len as u32));
    Ok(true)
}

/// Doorbell moderation: within `window` ns of the previous doorbell (of any kind:
/// one that only collected arrivals submits whatever is queued too), a flush leaves
/// its datagrams queued (up to half the ring), to be sent by the next doorbell,
/// whatever rings it: the link's next `recv` once the window is over, an arrival,
/// a push, or `arm_sleep` before the thread sleeps.
///
/// While the link streams (its last [`STREAM_RUN`] doorbells each carried at least
/// [`STREAM_MIN`] datagrams one way), the window is `stream_window`, and the
/// io_uring backend also lets the kernel post receive completions at most once per
/// stream window: a backlog makes batches, and longer batches make fewer system
/// calls on both sides (acknowledgements included).
///
/// What is not a stream: a ping-pong moves one or two datagrams per doorbell; a
/// message of a dozen datagrams makes one busy doorbell (two with the
/// acknowledgement after its eighth), not a run; and a push (a new flight, which
/// the reliability layer sends with nothing unacknowledged before it:
/// [`strait_core::Link::push`]) rings at once and ends any stream, since an answer
/// is awaited next. The acknowledgement a receiver queues when a message arrives
/// waits in the window for the answer, which carries it in the same doorbell.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Moderation {
    window: u64,
    stream_window: u64,
    batch: usize,
    /// The last doorbell of any kind (0: unknown).
    last_any: u64,
    streaming: bool,
    /// Consecutive doorbells (of those that sent or followed arrivals) that
    /// carried at least [`STREAM_MIN`] datagrams one way.
    busy_run: u8,
    /// Datagrams received by the last doorbell.
    rx_mark: u64,
}

impl Moderation {
    pub(crate) fn new(window: u64, stream_window: u64, ring: usize) -> Self {
        Moderation {
            window,
            stream_window: stream_window.max(window),
            batch: (ring / 2).max(1),
            last_any: 0,
            streaming: false,
            busy_run: 0,
            rx_mark: 0,
        }
    }

    /// Whether a flush with `queued` datagrams waiting should ring now.
    pub(crate) fn due(&self, now: u64, queued: usize) -> bool {
        let window = if self.streaming { self.stream_window } else { self.window };
        self.window == 0 || queued >= self.batch || now.saturating_sub(self.last_any) >= window
    }

    /// Whether the kernel should be let post waiting receive completions now.
    pub(crate) fn rx_due(&self, now: u64) -> bool {
        !self.streaming || self.window == 0 || now.saturating_sub(self.last_any) >= self.stream_window
    }

    /// A push rang the doorbell: the link waits for an answer, not a stream, until
    /// a doorbell shows a stream again (see [`strait_core::Link::push`]).
    pub(crate) fn pushed(&mut self) {
        self.streaming = false;
        self.busy_run = 0;
    }

    /// Whether the link is streaming.
    pub(crate) fn streaming(&self) -> bool {
        self.streaming
    }

    /// A doorbell rang at `now` (0: time not read), submitting `sent` datagrams,
    /// with `received` datagrams received in the link's life so far.
    pub(crate) fn rang(&mut self, now: u64, sent: usize, received: u64) {
        let got = received.wrapping_sub(self.rx_mark);
        self.rx_mark = received;
        if now != 0 {
            self.last_any = now;
        }
        // A doorbell that neither sent nor followed arrivals says nothing. One
        // busy doorbell is not a stream yet: a message of a dozen datagrams (and
        // the acknowledgement its receiver sends after the eighth) makes one, and
        // must not hold back its own last datagrams.
        if sent > 0 || got > 0 {
            let busy = sent >= STREAM_MIN || got >= STREAM_MIN as u64;
            self.busy_run = if busy { self.busy_run.saturating_add(1) } else { 0 };
            self.streaming = self.busy_run >= STREAM_RUN;
        }
    }
}

enum Inner {
    Uring(Box<UringLink>),
    Mmsg(Box<MmsgLink>),
}

static FALLBACK_LOGGED: Once = Once::new();

/// A connected UDP socket as an unreliable [`Link`] to one peer; wrap it in
/// [`Reliable`] (or call [`UdpLink::reliable`]) for a [`strait_core::Device`].
///
/// The socket is `connect`ed, so the kernel drops datagrams from any other address;
/// everything that does arrive is still treated as hostile by the layer above.
///
/// ```no_run
/// use strait_core::{Config, ReliableConfig, Worker};
/// use strait_udp::{UdpConfig, UdpLink};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // Each side knows both addresses (given on its command line, say).
/// let link = UdpLink::connect("10.0.0.1:7000".parse()?, "10.0.0.2:7000".parse()?, &UdpConfig::from_env()?)?;
/// let mut worker = Worker::new(Config::from_env()?)?;
/// let ep = worker.attach(link.reliable(ReliableConfig::from_env()?));
/// # let _ = ep; Ok(()) }
/// ```
pub struct UdpLink {
    // Declared before `sock` so the ring is torn down before the socket closes.
    inner: Inner,
    sock: UdpSocket,
    mtu: usize,
    backend: Backend,
    /// The socket sends UDP checksums (no one switched them off on the socket we
    /// were given): see [`Link::carrier_checksum`].
    checksummed: bool,
    /// Datagrams leave ECN-capable and arrive with their ECN codepoint reported.
    ecn: bool,
}

/// Marks the socket's datagrams ECN-capable (ECT(0), keeping the DSCP bits a
/// caller may have set) and asks for each arrival's ECN codepoint; false (and
/// nothing left half set) if the kernel refuses either.
fn enable_ecn(fd: RawFd, v6: bool) -> bool {
    let (level, tos, recv) = if v6 {
        (libc::IPPROTO_IPV6, libc::IPV6_TCLASS, libc::IPV6_RECVTCLASS)
    } else {
        (libc::IPPROTO_IP, libc::IP_TOS, libc::IP_RECVTOS)
    };
    let Ok(old) = sys::getsockopt_int(fd, level, tos) else { return false };
    if sys::setsockopt_int(fd, level, tos, (old & !3) | i32::from(sys::ECN_ECT0)).is_err() {
        return false;
    }
    if sys::setsockopt_int(fd, level, recv, 1).is_err() {
        let _ = sys::setsockopt_int(fd, level, tos, old);
        return false;
    }
    true
}

impl UdpLink {
    /// Binds `local`, connects to `peer`, and sets up the link.
    pub fn connect(local: SocketAddr, peer: SocketAddr, cfg: &UdpConfig) -> Result<Self, UdpError> {
        let sock = UdpSocket::bind(local).map_err(|source| UdpError::Io { op: "bind", source })?;
        sock.connect(peer).map_err(|source| UdpError::Io { op: "connect", source })?;
        Self::from_socket(sock, cfg)
    }

    /// Takes a bound and connected UDP socket (made, say, inside another network
    /// namespace) and sets up the link on it.
    pub fn from_socket(sock: UdpSocket, cfg: &UdpConfig) -> Result<Self, UdpError> {
        let peer = sock.peer_addr().map_err(|_| UdpError::NotConnected)?;
        let fd = sock.as_raw_fd();
        // io_uring retries a blocking socket through its own poll; the mmsg backend
        // passes MSG_DONTWAIT on every call.
        sock.set_nonblocking(false).map_err(|source| UdpError::Io { op: "fcntl", source })?;
        let buf = cfg.sock_buf.min(i32::MAX as usize) as libc::c_int;
        for (force, plain) in
            [(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF), (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)]
        {
            if sys::setsockopt_int(fd, libc::SOL_SOCKET, force, buf).is_err() {
                // Not permitted: the plain option, capped by rmem_max/wmem_max.
                let _ = sys::setsockopt_int(fd, libc::SOL_SOCKET, plain, buf);
            }
        }
        // Never fragment at the IP layer: a lost fragment loses the whole datagram.
        let (v6, hdr) = match peer {
            SocketAddr::V4(_) => (false, 28),
            SocketAddr::V6(_) => (true, 48),
        };
        let path_mtu = if v6 {
            let _ =
                sys::setsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IPV6_PMTUDISC_DO);
            sys::getsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_MTU)
        } else {
            let _ = sys::setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO);
            sys::getsockopt_int(fd, libc::IPPROTO_IP, libc::IP_MTU)
        }
        .map_err(|source| UdpError::Io { op: "getsockopt(IP_MTU)", source })?;
        let from_path = (path_mtu.max(0) as usize).saturating_sub(hdr).min(65507);
        // A caller's socket may have UDP checksums switched off for sending (then
        // every packet keeps its payload CRC).
        const UDP_NO_CHECK6_TX: libc::c_int = 101;
        let no_check = if v6 {
            sys::getsockopt_int(fd, libc::IPPROTO_UDP, UDP_NO_CHECK6_TX)
        } else {
            sys::getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_NO_CHECK)
        };
        let checksummed = matches!(no_check, Ok(0));
        let ecn = cfg.ecn && enable_ecn(fd, v6);
        let mtu = if cfg.max_datagram > 0 { cfg.max_datagram.min(from_path) } else { from_path };
        if mtu < 256 {
            return Err(UdpError::MtuTooSmall(mtu));
        }
        let slot_len = mtu.next_multiple_of(64);
        let ring = cfg.ring as usize;
        let moder = Moderation::new(cfg.coalesce_ns, cfg.stream_coalesce_ns, ring);
        let rx_bufs = if cfg.rx_bufs == 0 { 256 } else { cfg.rx_bufs };
        // `auto` takes the backend measured fastest on this host (crate::calibrate).
        let want = match cfg.backend {
            Backend::Auto => crate::calibrate::calibration().choice,
            b => b,
        };
        let uring = match want {
            Backend::Mmsg => None,
            Backend::Uring | Backend::Auto => match UringLink::new(fd, cfg, slot_len, rx_bufs, moder) {
                Ok(u) => Some(u),
                Err(e) if cfg.backend == Backend::Uring => return Err(UdpError::UringUnavailable(e)),
                Err(e) => {
                    FALLBACK_LOGGED.call_once(|| {
                        eprintln!("strait-udp: io_uring unavailable ({e}); using sendmmsg/recvmmsg");
                    });
                    None
                }
            },
        };
        let (inner, backend) = match uring {
            Some(u) => (Inner::Uring(Box::new(u)), Backend::Uring),
            None => {
                // A GSO send's payload, like any datagram's, must fit in one IP packet
                // of at most 64 KiB (the IPv6 payload length counts the UDP header).
                let gso_bytes = 65_535 - hdr;
                let m = MmsgLink::new(fd, cfg, slot_len, gso_bytes, moder, ecn);
                (Inner::Mmsg(Box::new(m)), Backend::Mmsg)
            }
        };
        Ok(UdpLink { inner, sock, mtu, backend, checksummed, ecn })
    }

    /// Wraps the link in the reliability layer: the device to attach to a worker.
    pub fn reliable(self, cfg: ReliableConfig) -> Reliable<UdpLink> {
        Reliable::new(self, cfg)
    }

    /// True if the link's datagrams are ECN-capable and CE marks on arrivals are
    /// counted ([`UdpConfig::ecn`], and the kernel allowed it).
    pub fn ecn(&self) -> bool {
        self.ecn
    }

    /// The backend in use ([`Backend::Uring`] or [`Backend::Mmsg`]).
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The features in use: io_uring's, or for the mmsg backend `gso` and `gro`
    /// when enabled (empty otherwise).
    pub fn features(&self) -> &str {
        match &self.inner {
            Inner::Uring(u) => &u.features,
            Inner::Mmsg(m) => m.features(),
        }
    }

    /// The local address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.sock.local_addr()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> std::io::Result<SocketAddr> {
        self.sock.peer_addr()
    }

    /// udp-specific counters.
    pub fn udp_stats(&self) -> UdpStats {
        match &self.inner {
            Inner::Uring(u) => u.ustats,
            Inner::Mmsg(m) => m.ustats,
        }
    }

    /// Transmit slots taken and not yet free again (allocated, or released with a
    /// transmission still pending).
    pub fn slots_in_use(&self) -> usize {
        match &self.inner {
            Inner::Uring(u) => u.slots_in_use(),
            Inner::Mmsg(m) => m.slots_in_use(),
        }
    }
}

impl Link for UdpLink {
    fn mtu(&self) -> usize {
        self.mtu
    }

    fn carrier_checksum(&self) -> bool {
        // Every datagram carries UDP's checksum and the kernel (or the NIC) drops
        // one that fails it before the link sees it.
        self.checksummed
    }

    fn ecn_off(&mut self) -> bool {
        if !self.ecn {
            return false;
        }
        let fd = self.sock.as_raw_fd();
        let (level, tos) = match self.sock.local_addr() {
            Ok(std::net::SocketAddr::V6(_)) => (libc::IPPROTO_IPV6, libc::IPV6_TCLASS),
            _ => (libc::IPPROTO_IP, libc::IP_TOS),
        };
        // Arrivals' codepoints are still read (the peer may keep marking); only
        // ours go out Not-ECT, keeping the DSCP bits.
        let Ok(old) = sys::getsockopt_int(fd, level, tos) else { return false };
        if sys::setsockopt_int(fd, level, tos, old & !3).is_err() {
            return false;
        }
        self.ecn = false;
        true
    }

    fn ce_marked(&self) -> u64 {
        match &self.inner {
            Inner::Uring(u) => u.stats.ce_marked,
            Inner::Mmsg(m) => m.stats.ce_marked,
        }
    }

    fn tx_slots(&self) -> Option<usize> {
        Some(match &self.inner {
            Inner::Uring(u) => u.slots(),
            Inner::Mmsg(m) => m.slots(),
        })
    }

    fn tx_alloc(&mut self) -> Option<u32> {
        match &mut self.inner {
            Inner::Uring(u) => u.tx_alloc(),
            Inner::Mmsg(m) => m.tx_alloc(),
        }
    }

    fn tx_buf(&mut self, slot: u32) -> &mut [u8] {
        let mtu = self.mtu;
        let b = match &mut self.inner {
            Inner::Uring(u) => u.tx_buf(slot),
            Inner::Mmsg(m) => m.tx_buf(slot),
        };
        &mut b[..mtu]
    }

    fn send(&mut self, slot: u32, len: usize) -> Result<bool, LinkError> {
        if len > self.mtu {
            return Err(LinkError::BadSlot { slot, len });
        }
        match &mut self.inner {
            Inner::Uring(u) => u.send(slot, len),
            Inner::Mmsg(m) => m.send(slot, len),
        }
    }

    fn tx_release(&mut self, slot: u32) {
        match &mut self.inner {
            Inner::Uring(u) => u.tx_release(slot),
            Inner::Mmsg(m) => m.tx_release(slot),
        }
    }

    fn flush(&mut self) -> Result<(), LinkError> {
        match &mut self.inner {
            Inner::Uring(u) => u.flush(),
            Inner::Mmsg(m) => m.flush(),
        }
    }

    fn push(&mut self) -> Result<(), LinkError> {
        match &mut self.inner {
            Inner::Uring(u) => u.push(),
            Inner::Mmsg(m) => m.push(),
        }
    }

    fn recv(&mut self, handle: &mut dyn FnMut(&[u8])) -> Result<bool, LinkError> {
        match &mut self.inner {
            Inner::Uring(u) => u.recv(handle),
            Inner::Mmsg(m) => m.recv(handle),
        }
    }

    fn now_ns(&self) -> u64 {
        sys::now_ns()
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(match &self.inner {
            Inner::Uring(u) => u.event_fd(),
            Inner::Mmsg(_) => self.sock.as_raw_fd(),
        })
    }

    fn arm_sleep(&mut self) -> Result<bool, LinkError> {
        match &mut self.inner {
            Inner::Uring(u) => u.arm_sleep(),
            Inner::Mmsg(m) => m.arm_sleep(),
        }
    }

    fn disarm_sleep(&mut self) {
        if let Inner::Uring(u) = &mut self.inner {
            u.disarm_sleep();
        }
    }

    fn stats(&self) -> LinkStats {
        match &self.inner {
            Inner::Uring(u) => u.stats,
            Inner::Mmsg(m) => m.stats,
        }
    }
}

#[cfg(test)]
mod moderation_tests {
    use super::*;

    #[test]
    fn a_stream_widens_the_window_and_a_ping_pong_does_not() {
        let mut m = Moderation::new(8_000, 64_000, 256);
        assert!(m.due(1_000_000, 1), "idle: ring at once");
        m.rang(1_000_000, 1, 1);
        assert!(!m.due(1_004_000, 1));
        assert!(m.due(1_008_000, 1));
        // A doorbell that only collected arrivals starts the window too: what is
        // queued after it (an acknowledgement) waits for company.
        m.rang(1_010_000, 0, 2);
        assert!(!m.due(1_012_000, 1));
        assert!(m.due(1_018_000, 1));
        // One busy doorbell (a message of a dozen datagrams) is not a stream ...
        m.rang(1_020_000, STREAM_MIN + 4, 2);
        assert!(!m.streaming(), "one busy doorbell made a stream");
        assert!(m.rx_due(1_021_000));
        // ... a run of them is.
        m.rang(1_030_000, STREAM_MIN, 2);
        assert!(m.streaming());
        assert!(!m.due(1_050_000, 1), "streaming: the wider window holds");
        assert!(m.due(1_050_000, 128), "half the ring rings at once");
        assert!(m.due(1_094_000, 1));
        assert!(!m.rx_due(1_050_000));
        assert!(m.rx_due(1_094_000));
        // A reap-only doorbell with nothing new keeps the state.
        m.rang(1_100_000, 0, 2);
        assert!(m.streaming());
        // A quiet doorbell ends the run.
        m.rang(1_110_000, 1, 3);
        assert!(!m.streaming(), "one datagram each way: a ping-pong");
        // Arrivals alone make a stream too (a receiver's acknowledgements wait).
        m.rang(1_120_000, 0, 3 + STREAM_MIN as u64);
        m.rang(1_130_000, 1, 3 + 2 * STREAM_MIN as u64);
        assert!(m.streaming());
        // A push (a new flight, an answer awaited) ends the stream: receive
        // completions are let in at once, the next flush waits only the short
        // window.
        m.pushed();
        assert!(!m.streaming());
        assert!(m.rx_due(1_131_000));
        assert!(m.due(1_138_000, 1));
        m.rang(1_140_000, STREAM_MIN, 3 + 3 * STREAM_MIN as u64);
        assert!(!m.streaming(), "a push restarts the run");
        // Moderation off.
        let m = Moderation::new(0, 64_000, 256);
        assert!(m.due(1, 1) && m.rx_due(1));
    }
}
