//! UDP sockets between two strait processes on this host: datagrams go through a
//! per-(sending socket, receiving socket) message ring in shared memory, everything
//! else through the kernel socket, which stays open and receives as before.
//!
//! * **Marker.** A UDP socket under strait that is bound (explicitly, by `connect`, or
//!   by the library before its first `sendto`) also binds an abstract Unix socket
//!   `strait.udp.<netns>.<port>.<bound address in hex>`, and owns an eventfd (its
//!   doorbell). Nothing is ever sent on the UDP socket for discovery.
//! * **Channel.** The first `sendto`/`send` of a socket to a local address:port
//!   (loopback or one of this namespace's interface addresses, [`crate::local`])
//!   looks for the marker of the exact address, then of the IPv4 wildcard (for IPv4
//!   destinations), then of the IPv6 wildcard, as the kernel would pick the receiving
//!   socket. If found, and its holder is root, this user or the owner of the UDP
//!   socket the kernel would deliver to ([`crate::trust`]; the look-up never waits),
//!   it creates a sealed memfd holding one message ring, sends it with an `O_PATH`
//!   token of its own UDP socket (proof of the source address, which the receiver
//!   checks against the kernel's socket diagnostics; no power over the socket) to
//!   the marker, and writes datagrams into the ring at once: the receiver attaches
//!   when it next enters the library (its sleeps and `poll`/`epoll` watch the marker),
//!   and finds them there. It answers with its doorbell. A destination without a
//!   marker is remembered for a second (kernel path meanwhile).
//! * **Ring.** Records of an 8-byte header (length, kind) and the payload, padded to
//!   8 bytes, never split at the ring's end (a wrap record skips the rest). A full
//!   ring drops the datagram, as a full kernel receive buffer does: the send
//!   succeeds, the drop is counted (in the ring and in `STRAIT_STATS`). Consumers
//!   take a record with a compare-and-swap on the head, so threads and forked
//!   processes sharing a socket each get a datagram exactly once.
//! * **Receive.** A receive takes a shared-memory datagram if one is waiting, else
//!   asks the kernel socket (without waiting; at most every [`KCHECK`] while spinning,
//!   and every [`KCHECK_NONBLOCKING`] across non-blocking misses, so a shared-memory
//!   ping-pong, blocked or busy-polled, makes no system call), spins for `STRAIT_SPIN_US`,
//!   then sleeps in `poll` on the kernel socket, the doorbell and the marker.
//! * **Lifetime.** Closing the receiving socket (in its last process) marks its
//!   channels closed. The sender then offers the same ring (with what it holds) to
//!   the marker again: another process holding the socket takes it over, else the
//!   sender goes back to the kernel (which answers a closed port as it always does).
//!   A dead receiver is noticed by the hang-up of the channel's Unix socket, before
//!   a write if it was asleep, else when the ring is full. A sender's close or death
//!   frees the channel once the receiver drained it.

use std::collections::HashMap;
use std::os::fd::IntoRawFd;
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use libc::{c_int, sockaddr, socklen_t, ssize_t};

use crate::real;
use crate::settings::Settings;
use crate::sock::listen_marker;
use crate::sock::{
    abstract_name, bind_ephemeral, close_all, key_of, memfd_ok, netns, recv_fds_now, send_fds, sock_key,
    v6only, Key,
};
use crate::trust::{self, Proto};
use crate::wait::{signal_restarts, sock_timeout};
use strait_core::spin::{SpinPolicy, WaitOutcome};
use strait_shm::area::MappedArea;
use strait_shm::dgram::{DgramRing, ProducerView, Pushed};
use strait_sys::mmap::Mapping;

const MAGIC: u64 = 0x3130_5044_5554_5253; // "SRTUDP01"
const VERSION: u32 = 1;
const HDR: usize = 4096;
const RCLOSED: usize = 64;
const TXCLOSED: usize = 128;
const RHOLDERS: usize = 192;
const DROPS: usize = 256;
const TAIL: usize = 512;
const RSLEEP: usize = 640;
const HEAD: usize = 768;

const HELLO_LEN: usize = 56;
const REPLY_MAGIC: u64 = 0x3130_5950_4552_5253; // "SRREPY01"

/// Longest interval between two looks at the kernel socket and the marker while a
/// blocked receive spins on shared memory.
pub const KCHECK: Duration = Duration::from_micros(20);
/// Longest interval between two looks at the kernel socket and the marker across
/// non-blocking receives that find nothing in shared memory.
pub const KCHECK_NONBLOCKING: Duration = Duration::from_micros(2);
/// While a blocked receive spins, it yields the processor this often (a peer on the
/// same core then runs at once).
const YIELD_EVERY: Duration = Duration::from_micros(1);
/// One receive in this many looks at the kernel socket and the marker even when
/// shared memory has a datagram.
const FAIR: usize = 64;
/// How long a destination without a marker stays on the kernel path before it is
/// looked up again.
const NEGATIVE_TTL: Duration = Duration::from_secs(1);
/// Largest UDP payload over IPv4 / IPv6.
const MAX_V4: usize = 65_507;
const MAX_V6: usize = 65_527;

/// Channels set up by this process as a sender / as a receiver, shared-memory
/// datagrams sent / received, datagrams dropped because the receiver's ring was full.
pub static OUT_CHANNELS: AtomicUsize = AtomicUsize::new(0);
pub static IN_CHANNELS: AtomicUsize = AtomicUsize::new(0);
pub static SENT: AtomicUsize = AtomicUsize::new(0);
pub static RECEIVED: AtomicUsize = AtomicUsize::new(0);
pub static DROPPED: AtomicUsize = AtomicUsize::new(0);

/// Bumped in the child after `fork`: outgoing channels of an older generation belong
/// to the parent (one producer per ring), the child sets up its own.
static GEN: AtomicU64 = AtomicU64::new(0);

/// Called in the child after `fork`.
pub fn after_fork_child() {
    GEN.fetch_add(1, Ordering::Relaxed);
}

fn ring_size() -> usize {
    // A ring must hold the largest datagram: at least 128 KiB.
    Settings::get().ring.max(128 << 10)
}

fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

// ------------------------------------------------------------------ mapping

/// A channel's shared mapping (unmapped on drop).
struct Map {
    map: Mapping,
    ring: usize,
    /// The ring's data area.
    area: MappedArea,
}

// SAFETY: the area points into the shared mapping this value owns; every word both
// processes write is accessed atomically, payload bytes only by copying.
unsafe impl Send for Map {}
// SAFETY: as above.
unsafe impl Sync for Map {}

impl Map {
    fn open(fd: c_int, ring: usize) -> Option<Map> {
        // Not populated: pages come as the ring reaches them (see `Shm::map`).
        let map = Mapping::shared_on_demand(fd, HDR + ring, 0).ok()?;
        crate::fds::shm_mapped(map.len());
        // SAFETY: the data area follows the header page inside the mapping (so it is
        // page-aligned), which this value owns and unmaps only when dropped.
        let area = unsafe { MappedArea::new(map.ptr().add(HDR), ring) };
        Some(Map { map, ring, area })
    }

    /// The channel's datagram ring.
    fn dgram(&self) -> DgramRing<'_, MappedArea> {
        DgramRing::new(self.word(TAIL), self.word(HEAD), &self.area)
    }

    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off < HDR && off.is_multiple_of(8));
        // SAFETY: `off` is an 8-aligned offset inside the page-aligned header page.
        unsafe { &*self.map.ptr().add(off).cast::<AtomicU64>() }
    }

    fn header_ok(&self) -> bool {
        self.word(0).load(Ordering::Relaxed) == MAGIC
            && self.word(8).load(Ordering::Relaxed) == VERSION as u64 | ((self.ring as u64) << 32)
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // (The mapping itself goes with `map`.)
        crate::fds::shm_unmapped(self.map.len());
    }
}

// ------------------------------------------------------------------ channels

/// The receiving end of one channel.
struct InChan {
    map: Map,
    unix: c_int,
    /// The sender's address as the kernel would report it.
    src: Key,
    dead: AtomicBool,
}

/// One datagram taken from a ring.
struct Got {
    len: usize,
    src: Key,
}

impl InChan {
    fn has_data(&self) -> bool {
        !self.dead.load(Ordering::Relaxed) && self.map.dgram().has_data() == Ok(true)
    }

    fn tail(&self) -> u64 {
        self.map.dgram().tail()
    }

    /// Hints that the next record is read soon (see `DgramRing::prefetch_head`).
    fn prefetch(&self) {
        if !self.dead.load(Ordering::Relaxed) {
            self.map.dgram().prefetch_head();
        }
    }

    /// Length of the next datagram, if any.
    fn next_len(&self) -> Option<usize> {
        match self.map.dgram().next_len() {
            Ok(n) => n,
            Err(_) => {
                self.dead.store(true, Ordering::Relaxed);
                None
            }
        }
    }

    /// Takes (or, with `peek`, copies without taking) the next datagram into `iov`.
    /// `Err` if the ring is broken.
    fn take(&self, iov: &[(*mut u8, usize)], peek: bool) -> Result<Option<Got>, ()> {
        let got = self.map.dgram().take(peek, |area, mut src, len| {
            let mut left = len;
            for &(p, l) in iov {
                if left == 0 {
                    break;
                }
                let n = l.min(left);
                // SAFETY: the caller's segment has room for `l >= n` bytes (the recv
                // call's contract).
                let dst = unsafe { std::slice::from_raw_parts_mut(p, n) };
                DgramRing::load(area, src, dst);
                src += n;
                left -= n;
            }
        });
        match got {
            Ok(Some(len)) => {
                if !peek {
                    RECEIVED.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Some(Got { len, src: self.src }))
            }
            Ok(None) => Ok(None),
            Err(_) => {
                self.dead.store(true, Ordering::Relaxed);
                Err(())
            }
        }
    }

    fn announce(&self) {
        self.map.word(RSLEEP).store(1, Ordering::Relaxed);
    }

    /// The sender closed its socket or died.
    fn sender_gone(&self) -> bool {
        if self.map.word(TXCLOSED).load(Ordering::Acquire) != 0 {
            return true;
        }
        let mut p = libc::pollfd { fd: self.unix, events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: one pollfd on the stack.
        let r = unsafe { real::poll(&mut p, 1, 0) };
        r > 0 && p.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0
    }

    fn add_holder(&self) {
        self.map.word(RHOLDERS).fetch_add(1, Ordering::AcqRel);
    }

    /// This process closed the receiving socket: if no other process holds it, the
    /// senders go back to the kernel.
    fn release(&self) {
        if self.map.word(RHOLDERS).fetch_sub(1, Ordering::AcqRel) <= 1 {
            self.map.word(RCLOSED).store(1, Ordering::Release);
        }
    }
}

impl Drop for InChan {
    fn drop(&mut self) {
        crate::fds::let_go(&[self.unix]);
    }
}

/// The sending end of one channel.
struct OutChan {
    map: Map,
    /// Connection to the receiver's marker (replaced when the ring is offered again).
    unix: AtomicI32,
    /// Kept, so the ring (with what it holds) can be offered to another process
    /// holding the receiving socket when the one that took it closes or exits.
    memfd: c_int,
    hello: [u8; HELLO_LEN],
    /// The receiver's doorbell, once its answer arrived.
    efd: AtomicI32,
    gen: u64,
    /// Serializes this process's senders on the ring (it is the ring's only
    /// producer: a forked child sets up channels of its own); holds what the
    /// producer knows of the positions (see `DgramRing::push_as_sole_producer`).
    lock: Mutex<ProducerView>,
    dead: AtomicBool,
    /// Sends that found the ring full.
    full: AtomicUsize,
}

enum Push {
    Sent,
    Dropped,
    /// The receiver is gone: use the kernel.
    Dead,
}

impl OutChan {
    /// Reads the receiver's answer (its doorbell) if it came. False if the receiver
    /// refused or hung up.
    fn fetch_reply(&self) -> bool {
        if self.efd.load(Ordering::Relaxed) >= 0 {
            return true;
        }
        let mut buf = [0u8; 16];
        match recv_fds_now(self.unix.load(Ordering::Relaxed), &mut buf) {
            Ok(m) => {
                // The doorbell must be one: a pipe would block our writes.
                let ok = m.len == 8
                    && m.fds.len() == 1
                    && u64::from_le_bytes(buf[..8].try_into().unwrap_or_default()) == REPLY_MAGIC
                    && trust::is_eventfd(m.fds[0]);
                if !ok {
                    close_all(&m.fds);
                    self.dead.store(true, Ordering::Relaxed);
                    return false;
                }
                self.efd.store(crate::fds::keep(m.fds[0]), Ordering::Relaxed);
                true
            }
            Err(e) if e == libc::EAGAIN || e == libc::EINTR => true,
            Err(_) => {
                self.dead.store(true, Ordering::Relaxed);
                false
            }
        }
    }

    fn receiver_gone(&self) -> bool {
        if self.dead.load(Ordering::Relaxed) || self.map.word(RCLOSED).load(Ordering::Acquire) != 0 {
            return true;
        }
        let mut p =
            libc::pollfd { fd: self.unix.load(Ordering::Relaxed), events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: one pollfd on the stack.
        let r = unsafe { real::poll(&mut p, 1, 0) };
        if r > 0 && p.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0 {
            self.dead.store(true, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// The process that took the ring closed the socket or exited: offers the ring,
    /// with the datagrams still in it, to whichever process holds the receiving
    /// socket's marker now (a forked sibling sharing the socket). False if none does.
    fn offer_again(&self, fd: c_int, dest: Key) -> bool {
        let Some(u) = find_marker(dest) else { return false };
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.map.word(RHOLDERS).store(1, Ordering::Relaxed);
        self.map.word(RSLEEP).store(0, Ordering::Relaxed);
        self.map.word(RCLOSED).store(0, Ordering::Release);
        let token = trust::socket_token(fd);
        let sent = token.is_some_and(|t| send_fds(u, &self.hello, &[self.memfd, t]));
        close_all(&token.into_iter().collect::<Vec<_>>());
        if !sent {
            self.map.word(RCLOSED).store(1, Ordering::Release);
            close_all(&[u]);
            return false;
        }
        // SAFETY: plain fcntl on our socket (answers are read without waiting).
        unsafe { real::fcntl(u, libc::F_SETFL, libc::O_NONBLOCK as usize) };
        let u = crate::fds::keep(u);
        crate::fds::let_go(&[self.unix.swap(u, Ordering::Relaxed), self.efd.swap(-1, Ordering::Relaxed)]);
        self.dead.store(false, Ordering::Relaxed);
        true
    }

    fn push(&self, iov: &[(*const u8, usize)], len: usize) -> Push {
        if self.dead.load(Ordering::Relaxed) || self.map.word(RCLOSED).load(Ordering::Acquire) != 0 {
            return Push::Dead;
        }
        // A sleeping receiver gets a system call from us anyway (its doorbell): look
        // first whether it is still there (a receiver that died asleep never clears
        // its flag), so no datagram goes into a ring nobody will read.
        if self.map.word(RSLEEP).load(Ordering::Relaxed) != 0 && self.receiver_gone() {
            return Push::Dead;
        }
        let mut view = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let ring = self.map.dgram();
        let fill = |area: &MappedArea, mut dst: usize| {
            for &(p, l) in iov {
                // SAFETY: the caller's segment holds `l` bytes (the send call's
                // contract).
                let src = unsafe { std::slice::from_raw_parts(p, l) };
                DgramRing::store(area, dst, src);
                dst += l;
            }
        };
        let mut yielded = false;
        loop {
            match ring.push_as_sole_producer(&mut view, len, fill) {
                Ok(Pushed::Sent) => break,
                Err(_) => {
                    self.dead.store(true, Ordering::Relaxed);
                    return Push::Dead;
                }
                Ok(Pushed::Full) => {}
            }
            // Full. A receiver sharing our core gets it once (else a sender that
            // never blocks would keep it from ever draining).
            if !yielded {
                yielded = true;
                // SAFETY: plain syscall.
                unsafe { libc::sched_yield() };
                continue;
            }
            // Still full, as a kernel receive buffer can be: the datagram is lost
            // (counted). A receiver that died leaves its ring full: now and then,
            // look whether it is still there, else use the kernel.
            if self.full.fetch_add(1, Ordering::Relaxed).is_multiple_of(256) && self.receiver_gone() {
                return Push::Dead;
            }
            self.map.word(DROPS).fetch_add(1, Ordering::Relaxed);
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return Push::Dropped;
        }
        strait_probe::probe!(strait_probe::Stage::RingPublished);
        drop(view);
        SENT.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let sleep = self.map.word(RSLEEP);
        if sleep.load(Ordering::Relaxed) != 0 && sleep.swap(0, Ordering::Relaxed) != 0 {
            strait_probe::probe!(strait_probe::Stage::DoorbellBegin);
            // The receiver answers before it ever sleeps: its doorbell is here.
            self.fetch_reply();
            let efd = self.efd.load(Ordering::Relaxed);
            if efd >= 0 {
                crate::sock::ring_eventfd(efd);
            }
            strait_probe::probe!(strait_probe::Stage::DoorbellEnd);
        }
        Push::Sent
    }
}

impl Drop for OutChan {
    fn drop(&mut self) {
        if self.gen == GEN.load(Ordering::Relaxed) {
            self.map.word(TXCLOSED).store(1, Ordering::Release);
        }
        crate::fds::let_go(&[
            self.unix.load(Ordering::Relaxed),
            self.memfd,
            self.efd.load(Ordering::Relaxed),
        ]);
    }
}

// ------------------------------------------------------------------ sockets

enum Out {
    Chan(Arc<OutChan>),
    Kernel(Instant),
}

#[derive(Default)]
struct State {
    /// Destination -> channel (or "no strait receiver there", with when we looked).
    out: HashMap<Key, Out>,
    /// Connected peer.
    peer: Option<Key>,
    released: bool,
}

/// The receiving side of a bound socket: its marker and doorbell.
pub struct Rx {
    /// The marker's listening socket (-1 once withdrawn).
    marker: AtomicI32,
    pub efd: c_int,
    v6only: bool,
    port: u16,
}

impl Rx {
    /// The marker's listening socket (-1 once withdrawn: poll ignores it).
    pub fn marker(&self) -> c_int {
        self.marker.load(Ordering::Relaxed)
    }

    /// Takes the marker down: no new sender finds this socket.
    fn withdraw(&self) {
        crate::fds::let_go(&[self.marker.swap(-1, Ordering::Relaxed)]);
    }
}

/// A UDP socket (AF_INET or AF_INET6, SOCK_DGRAM) of this process.
pub struct UdpSock {
    family: c_int,
    pub nonblock: AtomicBool,
    pub fdrefs: AtomicUsize,
    st: Mutex<State>,
    rx: OnceLock<Rx>,
    incoming: RwLock<Vec<Arc<InChan>>>,
    rr: AtomicUsize,
    /// When the kernel socket and the marker were last looked at ([`now_ns`]).
    last_check: AtomicU64,
    /// That look found the kernel socket and the marker with nothing.
    last_check_empty: AtomicBool,
    last_gc: AtomicU64,
    /// How long this socket's blocked receives spin before they sleep.
    spin: SpinPolicy,
    /// Receives so far: every [`FAIR`]th looks at the kernel socket and the marker
    /// first, so a steady shared-memory stream starves neither kernel senders nor
    /// new strait senders.
    receives: AtomicUsize,
    /// The program asked for per-datagram ancillary data (IP_PKTINFO, timestamps,
    /// ...), which a ring does not carry: receive through the kernel only.
    kernel_rx: AtomicBool,
    /// The program corks or segments its sends (UDP_CORK, UDP_SEGMENT): send through
    /// the kernel only.
    kernel_tx: AtomicBool,
    /// A peer is set (`connect`): receives filter on it.
    connected: AtomicBool,
}

impl UdpSock {
    fn new(family: c_int, nonblock: bool) -> UdpSock {
        UdpSock {
            family,
            nonblock: AtomicBool::new(nonblock),
            fdrefs: AtomicUsize::new(1),
            st: Mutex::new(State::default()),
            rx: OnceLock::new(),
            incoming: RwLock::new(Vec::new()),
            rr: AtomicUsize::new(0),
            last_check: AtomicU64::new(0),
            last_check_empty: AtomicBool::new(false),
            last_gc: AtomicU64::new(0),
            spin: crate::settings::spin_policy(),
            receives: AtomicUsize::new(0),
            kernel_rx: AtomicBool::new(false),
            kernel_tx: AtomicBool::new(false),
            connected: AtomicBool::new(false),
        }
    }

    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The marker and doorbell, if this socket can receive through shared memory.
    pub fn rx(&self) -> Option<&Rx> {
        self.rx.get()
    }

    /// After the socket got its port: publishes the marker (once).
    fn publish(&self, fd: c_int) {
        if self.rx.get().is_some() || !Settings::get().enabled || self.kernel_rx.load(Ordering::Relaxed) {
            return;
        }
        let Some(key) = sock_key(fd, false).filter(|k| k.1 != 0) else { return };
        let v6only = self.family == libc::AF_INET6 && v6only(fd);
        let (sa, len) = marker_name(key);
        let Some(u) = listen_marker(&sa, len) else { return };
        // SAFETY: plain syscall.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            close_all(&[u]);
            return;
        }
        let (u, efd) = (crate::fds::keep(u), crate::fds::keep(efd));
        if self.rx.set(Rx { marker: AtomicI32::new(u), efd, v6only, port: key.1 }).is_err() {
            crate::fds::let_go(&[u, efd]);
        }
    }

    /// Binds an unbound socket to an ephemeral port (as the kernel's automatic bind
    /// at the first send would) and publishes its marker. True if the socket is
    /// bound (it can send through shared memory even without a marker of its own:
    /// the answers then come through the kernel).
    ///
    /// (Unlike a TCP connector's, this bind finds what the automatic bind would:
    /// both search UDP's ports for one no UDP socket holds, and UDP leaves nothing
    /// in TIME_WAIT; with none free, the kernel's send would fail as well.)
    fn ensure_bound(&self, fd: c_int) -> bool {
        if self.rx.get().is_some() {
            return true;
        }
        match sock_key(fd, false) {
            Some((_, 0)) => {
                if !bind_ephemeral(fd) {
                    return false;
                }
            }
            Some(_) => {}
            None => return false,
        }
        self.publish(fd);
        true
    }

    // ---------------------------------------------------------- receiving

    /// Accepts the senders waiting at the marker.
    pub fn pump(&self) {
        let Some(rx) = self.rx.get() else { return };
        while let Some(c) = crate::sock::accept_waiting(rx.marker()) {
            if let Some(ch) = attach(rx, c) {
                IN_CHANNELS.fetch_add(1, Ordering::Relaxed);
                self.incoming.write().unwrap_or_else(|e| e.into_inner()).push(Arc::new(ch));
            }
        }
        self.gc();
    }

    /// Frees channels whose sender is gone and that are drained (at most every 100 ms).
    fn gc(&self) {
        let now = now_ns();
        let last = self.last_gc.load(Ordering::Relaxed);
        if now.saturating_sub(last) < 100_000_000
            || self.last_gc.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_err()
        {
            return;
        }
        let chans = self.incoming.read().unwrap_or_else(|e| e.into_inner()).clone();
        let gone: Vec<Arc<InChan>> = chans
            .into_iter()
            .filter(|c| c.dead.load(Ordering::Relaxed) || (!c.has_data() && c.sender_gone()))
            .collect();
        if gone.is_empty() {
            return;
        }
        let mut w = self.incoming.write().unwrap_or_else(|e| e.into_inner());
        w.retain(|c| !gone.iter().any(|g| Arc::ptr_eq(g, c)));
        drop(w);
        for c in gone {
            c.release();
        }
    }

    fn chans(&self) -> Vec<Arc<InChan>> {
        self.incoming.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A shared-memory datagram is waiting.
    pub fn shm_readable(&self) -> bool {
        let v = self.incoming.read().unwrap_or_else(|e| e.into_inner());
        v.iter().any(|c| c.has_data())
    }

    /// Sum of the rings' tails (changes whenever a datagram arrives; for
    /// edge-triggered epoll).
    pub fn rx_mark(&self) -> u64 {
        let v = self.incoming.read().unwrap_or_else(|e| e.into_inner());
        v.iter().map(|c| c.tail()).fold(0u64, |a, b| a.wrapping_add(b))
    }

    /// Size of the next shared-memory datagram.
    pub fn next_len(&self) -> Option<usize> {
        let v = self.incoming.read().unwrap_or_else(|e| e.into_inner());
        v.iter().find_map(|c| c.next_len())
    }

    /// The receiver's sleeping flags, set in every channel (the senders ring the
    /// doorbell when they see it).
    pub fn announce(&self) {
        for c in self.incoming.read().unwrap_or_else(|e| e.into_inner()).iter() {
            c.announce();
        }
        fence(Ordering::SeqCst);
    }

    /// Empties the doorbell after a wake-up.
    pub fn drain_bell(&self) {
        if let Some(rx) = self.rx.get() {
            crate::sock::drain_eventfd(rx.efd);
        }
    }

    /// One datagram from the rings, round robin over the channels. Datagrams from
    /// other sources than the connected peer are dropped, as the kernel does.
    /// Whether the kernel socket `fd` and the marker are readable now, remembered
    /// with `now` ([`now_ns`]) for the receives that follow: every look counts, so
    /// that a miss after a look that found something looks again.
    fn look(&self, fd: c_int, marker: c_int, now: u64) -> (bool, bool) {
        let (kernel_ready, marker_ready) = readable_now(fd, marker);
        self.last_check.store(now, Ordering::Relaxed);
        self.last_check_empty.store(!kernel_ready && !marker_ready, Ordering::Relaxed);
        (kernel_ready, marker_ready)
    }

    fn take_shm(&self, iov: &[(*mut u8, usize)], peek: bool) -> Option<Got> {
        let chans = self.incoming.read().unwrap_or_else(|e| e.into_inner());
        let n = chans.len();
        if n == 0 {
            return None;
        }
        // The next record's line, asked for before the tail is looked at, arrives
        // with it instead of after it.
        for c in chans.iter() {
            c.prefetch();
        }
        if !chans.iter().any(|c| c.has_data()) {
            return None;
        }
        let peer = if self.connected.load(Ordering::Relaxed) { self.st().peer } else { None };
        strait_probe::probe!(strait_probe::Stage::RingFound);
        let start = self.rr.load(Ordering::Relaxed);
        for k in 0..n {
            let i = (start + k) % n;
            while let Ok(Some(g)) = chans[i].take(iov, peek) {
                if peer.is_some_and(|p| p != g.src) {
                    if peek {
                        let _ = chans[i].take(&[], false);
                    }
                    continue;
                }
                self.rr.store(i + 1, Ordering::Relaxed);
                strait_probe::probe!(strait_probe::Stage::RingConsumed);
                return Some(g);
            }
        }
        None
    }

    /// Receives one datagram: from shared memory, or through `kernel` (the real call
    /// with the extra flags given, MSG_DONTWAIT). `deliver` gets a shared-memory
    /// datagram's length and source. Returns what the interposed call returns.
    pub fn recv(
        &self,
        fd: c_int,
        iov: &[(*mut u8, usize)],
        flags: c_int,
        deliver: &mut dyn FnMut(&Delivered),
        kernel: &mut dyn FnMut(c_int) -> ssize_t,
    ) -> ssize_t {
        let peek = flags & libc::MSG_PEEK != 0;
        let nonblock = flags & libc::MSG_DONTWAIT != 0 || self.nonblock.load(Ordering::Relaxed);
        let Some(rx) = self.rx.get() else { return kernel(0) };
        let want: usize = iov.iter().map(|v| v.1).sum();
        let give = |g: Got, deliver: &mut dyn FnMut(&Delivered)| -> ssize_t {
            let copied = g.len.min(want);
            deliver(&Delivered { len: g.len, copied, src: g.src });
            if flags & libc::MSG_TRUNC != 0 {
                g.len as ssize_t
            } else {
                copied as ssize_t
            }
        };
        let try_kernel = |kernel: &mut dyn FnMut(c_int) -> ssize_t| -> Option<ssize_t> {
            let r = kernel(libc::MSG_DONTWAIT);
            if r >= 0 {
                return Some(r);
            }
            let e = real::errno();
            (e != libc::EAGAIN && e != libc::EWOULDBLOCK).then_some(r)
        };
        if self.receives.fetch_add(1, Ordering::Relaxed) % FAIR == FAIR - 1 {
            let (kernel_ready, marker_ready) = self.look(fd, rx.marker(), now_ns());
            if marker_ready {
                self.pump();
            }
            if kernel_ready {
                if let Some(r) = try_kernel(kernel) {
                    return r;
                }
            }
        }
        if let Some(g) = self.take_shm(iov, peek) {
            return give(g, deliver);
        }
        // A blocked receive spins first (a non-blocking one neither spins nor reads
        // the clock for it: a busy-polling program makes millions of these).
        let spin_start = (!nonblock).then(Instant::now);
        // SO_RCVTIMEO bounds the wait, the spin included.
        let mut timeout = None;
        let spin_end = spin_start.map(|start| {
            let budget = self.spin.next_budget(self.spin.is_adaptive() && crate::settings::crowded(start));
            let (t, budget) = crate::wait::CallTimeout::new(fd, libc::SO_RCVTIMEO, start, budget);
            timeout = Some(t);
            start + budget
        });
        // Tells the socket's spin policy how this blocked receive's wait ended.
        let learn = |slept: bool| {
            if let Some(start) = spin_start {
                self.spin.record(WaitOutcome { waited: start.elapsed(), slept });
            }
        };
        let mut yield_at = spin_start.map(|start| start + YIELD_EVERY);
        // Signals are held from the first microseconds of a blocked receive's spin
        // on, and between its sleeps, when a handler could end the call; each
        // sleep's mask lets them through (see `sigmask`).
        let mut signals = crate::sigmask::WaitSignals::default();
        // Look at the kernel socket and the marker when they were not looked at for a
        // while: [`KCHECK`] while a blocked receive spins. A non-blocking miss looks
        // unless the last look, less than [`KCHECK_NONBLOCKING`] ago, found both
        // empty: a busy-polling program's empty receives then cost one system call in
        // many, and a datagram that came through the kernel since waits at most that
        // long. (After a look that found something, the next miss looks again: an
        // edge-triggered epoll reported one edge for all that had come, and the
        // program reads until EAGAIN, which must then be true.)
        loop {
            let now = now_ns();
            let last = self.last_check.load(Ordering::Relaxed);
            // (0: never looked; a clock that went back: look.)
            let fresh = last != 0 && now >= last;
            let every = if nonblock { KCHECK_NONBLOCKING } else { KCHECK }.as_nanos() as u64;
            let recent = fresh && now - last < every;
            if !recent || (nonblock && !self.last_check_empty.load(Ordering::Relaxed)) {
                let (kernel_ready, marker_ready) = self.look(fd, rx.marker(), now);
                if marker_ready {
                    self.pump();
                    if let Some(g) = self.take_shm(iov, peek) {
                        learn(false);
                        return give(g, deliver);
                    }
                }
                // (One `poll` answers for both: a non-blocking miss asks the kernel
                // socket only when it has something, so an empty poll by a
                // busy-polling program is one system call, not two.)
                if kernel_ready {
                    if let Some(r) = try_kernel(kernel) {
                        if !nonblock {
                            learn(false);
                        }
                        return r;
                    }
                }
            }
            if nonblock {
                real::set_errno(libc::EAGAIN);
                return -1;
            }
            let now = Instant::now();
            let (Some(end), Some(at)) = (spin_end, yield_at) else { break };
            if now >= end {
                break;
            }
            // Past the first microseconds, let a peer that shares this core run (a
            // ping-pong over an oversubscribed machine would otherwise cost each side
            // a whole spin per message).
            if now >= at {
                yield_at = Some(now + YIELD_EVERY);
                // SAFETY: plain syscall.
                unsafe { libc::sched_yield() };
                if signals.signal_waits() {
                    break;
                }
                if let Some(s) = spin_start {
                    signals.spun(now - s);
                }
            }
            std::hint::spin_loop();
            if let Some(g) = self.take_shm(iov, peek) {
                learn(false);
                return give(g, deliver);
            }
        }
        // Sleep on the kernel socket, the doorbell and the marker.
        let mask = signals.sleep_mask();
        let deadline = match timeout.as_mut() {
            Some(t) => t.deadline(),
            None => sock_timeout(fd, libc::SO_RCVTIMEO).map(|t| Instant::now() + t),
        };
        loop {
            self.announce();
            if let Some(g) = self.take_shm(iov, peek) {
                learn(true);
                return give(g, deliver);
            }
            let mut ms = 100;
            if let Some(d) = deadline {
                let now = Instant::now();
                if now >= d {
                    real::set_errno(libc::EAGAIN);
                    return -1;
                }
                ms = ms.min((d - now).as_millis() as c_int + 1);
            }
            let mut p = [
                libc::pollfd { fd, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: rx.marker(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: rx.efd, events: libc::POLLIN, revents: 0 },
            ];
            let r = crate::wait::kernel_poll(&mut p, ms, mask);
            if r < 0 && real::errno() == libc::EINTR && !signal_restarts(deadline.is_some()) {
                real::set_errno(libc::EINTR);
                return -1;
            }
            if p[2].revents != 0 {
                self.drain_bell();
            }
            if p[1].revents != 0 {
                self.pump();
            }
            if let Some(g) = self.take_shm(iov, peek) {
                learn(true);
                return give(g, deliver);
            }
            if p[0].revents != 0 {
                if let Some(r) = try_kernel(kernel) {
                    learn(true);
                    return r;
                }
            }
            if r == 0 {
                self.gc();
            }
        }
    }

    // ---------------------------------------------------------- sending

    /// The channel to `dest`, set up on first use; `None`: use the kernel.
    fn channel(&self, fd: c_int, dest: Key) -> Option<Arc<OutChan>> {
        let gen = GEN.load(Ordering::Relaxed);
        {
            let st = self.st();
            match st.out.get(&dest) {
                // A dead one too: its ring may be offered again (see `send`).
                Some(Out::Chan(c)) if c.gen == gen => return Some(c.clone()),
                Some(Out::Kernel(at)) if at.elapsed() < NEGATIVE_TTL => return None,
                _ => {}
            }
        }
        // Bind (and publish our own marker, for the answers) only when a strait
        // socket receives there: a send to anyone else costs only the lookup.
        let found = match find_marker(dest) {
            Some(u) if self.ensure_bound(fd) => open_channel(fd, dest, gen, u),
            Some(u) => {
                close_all(&[u]);
                None
            }
            None => None,
        };
        let mut st = self.st();
        if st.released {
            return None;
        }
        match found {
            Some(c) => {
                let c = Arc::new(c);
                OUT_CHANNELS.fetch_add(1, Ordering::Relaxed);
                st.out.insert(dest, Out::Chan(c.clone()));
                Some(c)
            }
            None => {
                st.out.insert(dest, Out::Kernel(Instant::now()));
                None
            }
        }
    }

    /// Sends one datagram of `len` bytes to `dest` (the connected peer if `None`)
    /// through shared memory if a strait socket receives there; else `kernel()`.
    pub fn send(
        &self,
        fd: c_int,
        dest: Option<(Key, bool)>,
        iov: &[(*const u8, usize)],
        flags: c_int,
        kernel: &mut dyn FnMut() -> ssize_t,
    ) -> ssize_t {
        strait_probe::probe!(strait_probe::Stage::WriteLookup);
        let (dest, lo) = match dest {
            Some(d) => d,
            None => match self.st().peer {
                Some(p) => (p, is_local(&p)),
                None => return kernel(),
            },
        };
        // Corked, segmented or out-of-band sends, and destinations not on this host: the
        // kernel.
        if !lo || flags & (libc::MSG_MORE | libc::MSG_OOB) != 0 || self.kernel_tx.load(Ordering::Relaxed) {
            return kernel();
        }
        let len: usize = iov.iter().map(|v| v.1).sum();
        let max = if is_v4(&dest) { MAX_V4 } else { MAX_V6 };
        if len > max {
            return kernel();
        }
        let Some(ch) = self.channel(fd, dest) else { return kernel() };
        let mut r = ch.push(iov, len);
        if matches!(r, Push::Dead) && ch.map.dgram().has_data().is_ok() && ch.offer_again(fd, dest) {
            r = ch.push(iov, len);
        }
        match r {
            Push::Sent | Push::Dropped => len as ssize_t,
            Push::Dead => {
                self.st().out.insert(dest, Out::Kernel(Instant::now()));
                kernel()
            }
        }
    }

    /// After a successful `connect`: the peer (none after AF_UNSPEC), and the port
    /// the kernel bound.
    pub fn on_connect(&self, fd: c_int, peer: Option<Key>) {
        self.st().peer = peer;
        self.connected.store(peer.is_some(), Ordering::Relaxed);
        self.publish(fd);
    }

    /// Called before `fork`: the child holds the receiving side too.
    pub fn add_holder(&self) {
        for c in self.chans() {
            c.add_holder();
        }
    }

    /// The last descriptor of this process was closed.
    pub(crate) fn release(&self) {
        let out = {
            let mut st = self.st();
            if st.released {
                return;
            }
            st.released = true;
            std::mem::take(&mut st.out)
        };
        drop(out);
        let chans = std::mem::take(&mut *self.incoming.write().unwrap_or_else(|e| e.into_inner()));
        for c in chans {
            c.release();
        }
        // The name goes with the last holder (a forked child keeps its copy).
        if let Some(rx) = self.rx.get() {
            rx.withdraw();
        }
    }

    /// After a successful `setsockopt`: options a ring cannot honour send that
    /// direction to the kernel.
    pub fn on_setsockopt(&self, level: c_int, name: c_int, on: bool) {
        if on && rx_ancillary(level, name) {
            self.receive_through_kernel();
        }
        if tx_option(level, name) {
            self.kernel_tx.store(on, Ordering::Relaxed);
        }
    }
}

impl UdpSock {
    /// From now on this socket receives through the kernel only: no new sender
    /// finds it, the current ones go back to the kernel (what they already sent is
    /// still read here). For options a ring cannot honour, and for a socket passed
    /// to another process, whose library does not see these rings.
    pub fn receive_through_kernel(&self) {
        if self.kernel_rx.swap(true, Ordering::Relaxed) {
            return;
        }
        if let Some(rx) = self.rx.get() {
            rx.withdraw();
        }
        for c in self.chans() {
            c.map.word(RCLOSED).store(1, Ordering::Release);
        }
    }
}

impl Drop for UdpSock {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.get() {
            rx.withdraw();
            crate::fds::let_go(&[rx.efd]);
        }
    }
}

/// A shared-memory datagram handed to the caller.
pub struct Delivered {
    /// Its full length.
    pub len: usize,
    /// Bytes copied into the caller's buffers (less than `len`: truncated).
    pub copied: usize,
    pub src: Key,
}

/// Socket options that ask for per-datagram ancillary data on receive.
fn rx_ancillary(level: c_int, name: c_int) -> bool {
    const SO: &[c_int] = &[
        29, // SO_TIMESTAMP
        35, // SO_TIMESTAMPNS
        37, // SO_TIMESTAMPING
        40, // SO_RXQ_OVFL
        63, // SO_TIMESTAMP_NEW
        64, // SO_TIMESTAMPNS_NEW
        65, // SO_TIMESTAMPING_NEW
    ];
    const IP: &[c_int] = &[
        6,  // IP_RECVOPTS
        7,  // IP_RETOPTS
        8,  // IP_PKTINFO
        11, // IP_RECVERR
        12, // IP_RECVTTL
        13, // IP_RECVTOS
        20, // IP_RECVORIGDSTADDR
        25, // IP_RECVFRAGSIZE
    ];
    const IP6: &[c_int] = &[
        2,  // IPV6_2292PKTINFO
        8,  // IPV6_2292HOPLIMIT
        25, // IPV6_RECVERR
        49, // IPV6_RECVPKTINFO
        51, // IPV6_RECVHOPLIMIT
        53, // IPV6_RECVHOPOPTS
        56, // IPV6_RECVRTHDR
        58, // IPV6_RECVDSTOPTS
        60, // IPV6_RECVPATHMTU
        66, // IPV6_RECVTCLASS
        74, // IPV6_RECVORIGDSTADDR
        77, // IPV6_RECVFRAGSIZE
    ];
    match level {
        libc::SOL_SOCKET => SO.contains(&name),
        libc::IPPROTO_IP => IP.contains(&name),
        libc::IPPROTO_IPV6 => IP6.contains(&name),
        libc::IPPROTO_UDP => name == 104, // UDP_GRO
        _ => false,
    }
}

/// Socket options that change what a send puts on the wire: UDP_CORK, UDP_SEGMENT.
fn tx_option(level: c_int, name: c_int) -> bool {
    level == libc::IPPROTO_UDP && (name == 1 || name == 103)
}

fn is_v4(k: &Key) -> bool {
    k.0[..10].iter().all(|&b| b == 0) && k.0[10] == 0xff && k.0[11] == 0xff
}

fn is_loopback(k: &Key) -> bool {
    if is_v4(k) {
        // Not the 127/8 broadcast address (several receivers, or none).
        k.0[12] == 127 && k.0[13..] != [255, 255, 255]
    } else {
        k.0 == std::net::Ipv6Addr::LOCALHOST.octets()
    }
}

/// A destination on this host: loopback, or an address of this namespace's
/// interfaces (see [`crate::local`]).
fn is_local(k: &Key) -> bool {
    is_loopback(k) || crate::local::host_address(&k.0)
}

fn v4_key(a: [u8; 4], port: u16) -> Key {
    let mut k = [0u8; 16];
    k[10] = 0xff;
    k[11] = 0xff;
    k[12..].copy_from_slice(&a);
    (k, port)
}

fn marker_name(k: Key) -> (libc::sockaddr_un, socklen_t) {
    let hex: String = k.0.iter().map(|b| format!("{b:02x}")).collect();
    abstract_name(&format!("strait.udp.{}.{}.{}", netns(), k.1, hex))
}

/// The source address the kernel would report for datagrams from `fd` to `dest`.
fn source_of(fd: c_int, dest: &Key) -> Option<Key> {
    let (a, port) = sock_key(fd, false)?;
    let wildcard = a == [0u8; 16] || (is_v4(&(a, port)) && a[12..] == [0, 0, 0, 0]);
    // A wildcard-bound socket's datagrams leave from the local route's source
    // address: 127.0.0.1 (or ::1) for loopback, the address itself for the host's
    // own addresses.
    Some(if !wildcard {
        (a, port)
    } else if !is_loopback(dest) {
        (dest.0, port)
    } else if is_v4(dest) {
        v4_key([127, 0, 0, 1], port)
    } else {
        (std::net::Ipv6Addr::LOCALHOST.octets(), port)
    })
}

/// Finds the receiving socket's marker for `dest` (as the kernel would pick the
/// socket: exact address, then the IPv4 wildcard, then the IPv6 one): a Unix socket
/// connected to it, if a strait process receives there and the name's holder is
/// root, this user, or the owner of the socket the kernel would deliver to. Never
/// waits: a full backlog is the kernel path.
fn find_marker(dest: Key) -> Option<c_int> {
    let mut names = vec![dest];
    if is_v4(&dest) {
        names.push(v4_key([0, 0, 0, 0], dest.1));
    }
    names.push(([0u8; 16], dest.1));
    names.iter().find_map(|k| {
        let (sa, len) = marker_name(*k);
        let u = trust::connect_name(&sa, len)?;
        if trust::marker_holder_ok(u, Proto::Udp, dest, (dest.0, 0)).is_some() {
            Some(u)
        } else {
            close_all(&[u]);
            trust::refuse()
        }
    })
}

/// Sets up a channel to `dest`, whose marker is connected to `u` (closed on
/// failure). `fd` is bound.
fn open_channel(fd: c_int, dest: Key, gen: u64, u: c_int) -> Option<OutChan> {
    let Some(src) = source_of(fd, &dest) else {
        close_all(&[u]);
        return None;
    };
    let ring = ring_size();
    let Ok(memfd) = strait_sys::sealed_memfd(c"strait-udp", HDR + ring) else {
        close_all(&[u]);
        return None;
    };
    let memfd = memfd.into_raw_fd();
    let Some(map) = Map::open(memfd, ring) else {
        close_all(&[memfd, u]);
        return None;
    };
    map.word(0).store(MAGIC, Ordering::Relaxed);
    map.word(8).store(VERSION as u64 | ((ring as u64) << 32), Ordering::Relaxed);
    map.word(RHOLDERS).store(1, Ordering::Relaxed);
    let mut h = [0u8; HELLO_LEN];
    h[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(ring as u32).to_le_bytes());
    h[16..32].copy_from_slice(&src.0);
    h[32..34].copy_from_slice(&src.1.to_le_bytes());
    h[34..50].copy_from_slice(&dest.0);
    h[50..52].copy_from_slice(&dest.1.to_le_bytes());
    let Some(token) = trust::socket_token(fd) else {
        close_all(&[u, memfd]);
        return None;
    };
    let sent = send_fds(u, &h, &[memfd, token]);
    close_all(&[token]);
    if !sent {
        close_all(&[u, memfd]);
        return None;
    }
    // SAFETY: plain fcntl on our socket: non-blocking from now on (answers are read
    // without waiting).
    unsafe { real::fcntl(u, libc::F_SETFL, libc::O_NONBLOCK as usize) };
    Some(OutChan {
        map,
        unix: AtomicI32::new(crate::fds::keep(u)),
        memfd: crate::fds::keep(memfd),
        hello: h,
        efd: AtomicI32::new(-1),
        gen,
        lock: Mutex::new(ProducerView::default()),
        dead: AtomicBool::new(false),
        full: AtomicUsize::new(0),
    })
}

/// The sender of a hello proves its source address `src` with a token of its UDP
/// socket: the one the kernel has bound at `src`. A sender that is gone (its
/// datagrams wait in the ring, as they would in a kernel queue) can no longer be
/// looked up: then nothing is bound at `src`, and its datagrams are taken if the
/// port is one any user could have bound (unprivileged), or the sender is root or
/// us. A source someone else holds is never taken on a claim.
fn source_proven(token: c_int, src: Key, dest: Key, unix: c_int) -> bool {
    if trust::token_names(token, Proto::Udp, src, dest) {
        return true;
    }
    let nobody_there = trust::diag_lookup(Proto::Udp, src, dest).is_none();
    nobody_there && (src.1 >= 1024 || trust::peer_cred(unix).is_some_and(|c| trust::trusted_user(c.uid)))
}

/// Receiving side: checks a sender's hello on the accepted Unix socket `c`, maps its
/// ring and answers with our doorbell.
fn attach(rx: &Rx, c: c_int) -> Option<InChan> {
    let refuse = |fds: &[c_int]| {
        close_all(fds);
        close_all(&[c]);
        None
    };
    // Any user may send to us, as over the kernel socket; the token proves the
    // source.
    // The hello follows the connect at once.
    let mut p = libc::pollfd { fd: c, events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd.
    unsafe { real::poll(&mut p, 1, 50) };
    let mut buf = [0u8; HELLO_LEN + 8];
    let Ok(m) = recv_fds_now(c, &mut buf) else { return refuse(&[]) };
    if m.len != HELLO_LEN || m.fds.len() != 2 || m.truncated {
        return refuse(&m.fds);
    }
    let (memfd, theirs) = (m.fds[0], m.fds[1]);
    let h = &buf[..HELLO_LEN];
    let magic = u64::from_le_bytes(h[0..8].try_into().unwrap_or_default());
    let version = u32::from_le_bytes(h[8..12].try_into().unwrap_or_default());
    let ring = u32::from_le_bytes(h[12..16].try_into().unwrap_or_default()) as usize;
    let src: Key = (h[16..32].try_into().unwrap_or_default(), u16::from_le_bytes([h[32], h[33]]));
    let dest: Key = (h[34..50].try_into().unwrap_or_default(), u16::from_le_bytes([h[50], h[51]]));
    let ok = magic == MAGIC
        && version == VERSION
        && ring.is_power_of_two()
        // No larger than we would make: a peer may not make us map more.
        && (128 << 10..=ring_size().max(128 << 10)).contains(&ring)
        && dest.1 == rx.port
        && !(rx.v6only && is_v4(&dest))
        && source_proven(theirs, src, dest, c);
    close_all(&[theirs]);
    if !ok || !memfd_ok(memfd, HDR + ring) {
        trust::refuse::<()>();
        return refuse(&[memfd]);
    }
    let map = Map::open(memfd, ring);
    close_all(&[memfd]);
    let map = map.filter(|m| m.header_ok())?;
    let mut reply = [0u8; 8];
    reply.copy_from_slice(&REPLY_MAGIC.to_le_bytes());
    // A sender that already closed (or died) cannot take the answer, but the
    // datagrams it sent are in the ring and are read as a kernel socket's queue
    // would be; the channel is freed once drained.
    let _ = send_fds(c, &reply, &[rx.efd]);
    Some(InChan { map, unix: crate::fds::keep(c), src, dead: AtomicBool::new(false) })
}

// ------------------------------------------------------------------ table

/// The strait side of a socket `socket(domain, ty, proto)` just made, if strait
/// carries sockets of that kind (UDP over IPv4 or IPv6).
pub fn for_socket(domain: c_int, ty: c_int, proto: c_int) -> Option<Arc<UdpSock>> {
    if !Settings::get().enabled
        || !(domain == libc::AF_INET || domain == libc::AF_INET6)
        || ty & 0xff != libc::SOCK_DGRAM
        || !(proto == 0 || proto == libc::IPPROTO_UDP)
    {
        return None;
    }
    Some(Arc::new(UdpSock::new(domain, ty & libc::SOCK_NONBLOCK != 0)))
}

/// After a successful `bind(fd)`.
pub fn on_bind(s: &UdpSock, fd: c_int) {
    s.publish(fd);
}

/// The destination of a send: its key and whether it is a local address this
/// socket can reach through shared memory (family as the socket's).
pub fn dest_of(s: &UdpSock, addr: *const sockaddr, len: socklen_t) -> Option<(Key, bool)> {
    if addr.is_null() || len == 0 {
        return None;
    }
    // SAFETY: the caller's address of `len >= 2` bytes: its family first.
    let fam = unsafe { (*addr).sa_family } as c_int;
    let (k, _) = key_of(addr, len)?;
    Some((k, fam == s.family && is_local(&k)))
}

/// Writes `k` as a socket address of `family` into the caller's buffer (truncated to
/// its length; the length word gets the full size, as the kernel does).
///
/// # Safety
/// `addr` is null or points at `*alen` writable bytes; `alen` is null or valid.
pub unsafe fn write_addr(family: c_int, k: &Key, addr: *mut sockaddr, alen: *mut socklen_t) {
    if addr.is_null() || alen.is_null() {
        return;
    }
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let size = if family == libc::AF_INET && is_v4(k) {
        // SAFETY: sockaddr_in fits in the storage.
        let s = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
        s.sin_family = libc::AF_INET as libc::sa_family_t;
        s.sin_port = k.1.to_be();
        s.sin_addr.s_addr = u32::from_ne_bytes([k.0[12], k.0[13], k.0[14], k.0[15]]);
        std::mem::size_of::<libc::sockaddr_in>()
    } else {
        // SAFETY: sockaddr_in6 fits in the storage.
        let s = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
        s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        s.sin6_port = k.1.to_be();
        s.sin6_addr.s6_addr = k.0;
        std::mem::size_of::<libc::sockaddr_in6>()
    };
    // SAFETY: per the caller: `*alen` bytes at `addr`.
    unsafe {
        let room = (*alen as usize).min(size);
        std::ptr::copy_nonoverlapping(
            (&ss as *const libc::sockaddr_storage).cast::<u8>(),
            addr.cast::<u8>(),
            room,
        );
        *alen = size as socklen_t;
    }
}

/// The socket's family.
pub fn family(s: &UdpSock) -> c_int {
    s.family
}

/// A connect's target as a peer key (`None`: AF_UNSPEC, i.e. disconnect).
pub fn peer_of(addr: *const sockaddr, len: socklen_t) -> Option<Key> {
    key_of(addr, len).map(|(k, _)| k)
}

/// Whether the kernel socket `fd` and the channel marker `marker` are readable now
/// (a poll that does not wait).
fn readable_now(fd: c_int, marker: c_int) -> (bool, bool) {
    let mut p = [
        libc::pollfd { fd, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: marker, events: libc::POLLIN, revents: 0 },
    ];
    // SAFETY: two pollfds on the stack.
    unsafe { real::poll(p.as_mut_ptr(), 2, 0) };
    (p[0].revents != 0, p[1].revents != 0)
}
