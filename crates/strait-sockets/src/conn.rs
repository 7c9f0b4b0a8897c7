//! One accelerated TCP connection: a shared mapping with two byte rings (one per
//! direction) and a doorbell per side: a slot in the doorbells of the process pair
//! ([`crate::pair`]), or (a connection to another host, or a peer that offered no
//! pair) an eventfd of the connection's own. The program's own TCP socket tells
//! that the peer is gone: no byte and no shutdown of the library's ever goes through
//! it, so its hang-up (the kernel's FIN or reset) comes exactly when the last
//! process holding the peer's socket closed it or died, whatever forks, passes and
//! execs happened on the way.
//!
//! Layout of the mapping (a sealed memfd, handed only to the two ends):
//!
//! ```text
//! 0      magic u64, version u32, ring bytes u32
//! 24     mode: bit 0 the connector asks for messages, bit 1 both agreed
//! 32     the connector wrote before the attach
//! 40     the acceptor's pair slot (path A); 48: the same for path B
//! 64     state: 0 pending (connector waits), 1 attached, 2 kernel (given up)
//! 128+64*s  holders of side s (processes that still hold the connection)
//! 1024+1024*d  control block of direction d (0: connector -> acceptor):
//!        +0 tail (producer) +64 write-closed (producer) +72 closes (producer:
//!        a hint, counted, that a process of the producer's end closed its
//!        last descriptor; the kernel's hang-up says whether that was the last
//!        holder) +128 producer sleeps
//!        +192 producer lock
//!        +512 head (consumer) +576 read-closed (consumer) +640 consumer sleeps
//!        +704 consumer lock
//!        +768 rendezvous: state, +776 buffer address, +784 length, +792 reader's
//!        process id, +800 bytes delivered; a split's +808 writer's buffer
//!        address, +816 bytes the reader reads from it, +824 writer's process
//!        id, +832 bytes the reader read
//!        +896 bytes left of the message being read (message mode)
//! 4096 + d*ring  data of direction d
//! ```
//!
//! **Rendezvous.** A blocked reader with one buffer of at least
//! `STRAIT_RENDEZVOUS_MIN` bytes and nothing unread posts it (its address, length
//! and process id, written while the state word says POSTING, so that a reader of
//! another process sharing the connection never mixes its post into ours); a writer
//! that finds the ring empty and a buffer posted copies straight into it
//! (`process_vm_writev`, into the process the kernel named at setup only: one copy
//! instead of two), in a byte stream as many bytes as the buffer takes (the rest of
//! the write follows through the ring), in message mode a whole message that fits.
//!
//! **Message mode** (opt-in, `STRAIT_MESSAGES=1` at both ends, else streaming): each
//! write is one message (an 8-byte length, then the bytes), and a read returns bytes
//! of one message only; a message no larger than the ring arrives whole to a large
//! enough buffer, and one larger than the ring arrives in one read when it goes by
//! rendezvous.
//!
//! Rings are byte rings: positions only grow, `pos % ring` is the offset. The peer is
//! not trusted: a position that breaks `head <= tail <= head + ring` resets the
//! connection instead of being followed. The positions of both ends live in shared
//! memory (not in process memory), so a connection inherited over `fork` can be used
//! by either process; each end's producer and consumer steps take a lock word in the
//! mapping (owner's process id; a dead owner's lock is taken over), so two processes
//! reading or writing one inherited connection at the same time never interleave
//! inside one step.
//!
//! Neither end keeps the memfd in its descriptor table (a same-user process could open
//! it through `/proc/PID/fd`); each keeps it in flight in a Unix socket of its own
//! (the "vault"), from which `exec` takes a copy with `MSG_PEEK` to hand the mapping
//! to the new program (see `exec.rs`).

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libc::{c_int, c_void};

use strait_core::spin::{SpinPolicy, WaitOutcome};
use strait_shm::area::MappedArea;
use strait_shm::ring::{announce_sleep, peer_needs_wake};
use strait_shm::stream::ByteRing;
use strait_sys::mmap::Mapping;

use crate::real;
use crate::settings::{crowded, spin_policy, Settings};
use crate::wait::signal_restarts;

pub const MAGIC: u64 = 0x3130_5043_5454_5253; // "SRTTCP01"
/// 3: a connector no longer binds a port before its hello, and its path-B name is
/// its socket's inode. 4: a close is told by the kernel's hang-up of the TCP
/// socket and the [`CLOSES`] hint, no longer by marks in the rings. 5: doorbells
/// per process pair (the acceptor's slot in the header).
pub const VERSION: u32 = 5;
pub const HDR: usize = 4096;
const OFF_STATE: usize = 64;
pub(crate) const fn off_holders(side: usize) -> usize {
    128 + 64 * side
}
pub(crate) const fn ctl(d: usize) -> usize {
    1024 + 1024 * d
}
pub(crate) const TAIL: usize = 0;
pub(crate) const WCLOSED: usize = 64;
/// A counter the producer's end bumps when one of its processes closed its last
/// descriptor of the connection (in the line of [`WCLOSED`], which every look at
/// the end of stream loads anyway): the consumer then asks the kernel at once
/// whether that was the last holder ([`Conn::look_after_close`]).
const CLOSES: usize = 72;
pub(crate) const WSLEEP: usize = 128;
pub(crate) const WLOCK: usize = 192;
pub(crate) const HEAD: usize = 512;
pub(crate) const RCLOSED: usize = 576;
pub(crate) const RSLEEP: usize = 640;
pub(crate) const RLOCK: usize = 704;
const RV_STATE: usize = 768;
const RV_ADDR: usize = 776;
const RV_LEN: usize = 784;
const RV_PID: usize = 792;
const RV_DONE: usize = 800;
const RV_SRC: usize = 808;
const RV_CUT: usize = 816;
const RV_WPID: usize = 824;
const RV_READ: usize = 832;
const MSG_LEFT: usize = 896;
const RV_IDLE: u64 = 0;
const RV_POSTED: u64 = 1;
const RV_FILLING: u64 = 2;
const RV_DONE_STATE: u64 = 3;
/// A reader is writing its post (address, length, pid): a reader of another
/// process that shares the connection (a fork) does not post meanwhile, so a writer
/// never pairs one reader's address with another's pid.
const RV_POSTING: u64 = 4;
/// A split (writer): the reader may read the first `RV_CUT` bytes from the
/// writer's buffer while the writer writes the rest into the reader's.
const RV_OFFERED: u64 = 5;
/// A split (reader): reading the writer's buffer; the writer waits for it.
const RV_READING: u64 = 6;
/// A split (reader): done reading (`RV_READ` bytes; fewer than `RV_CUT`: the
/// writer writes them itself).
const RV_READ_STATE: u64 = 7;
/// A split (writer): the reader took too long reading; what it read is void.
const RV_REVOKED: u64 = 8;
/// The smallest byte-stream rendezvous that is split ([`Conn::rendezvous`]).
const SPLIT_MIN: usize = 128 << 10;
/// How long a writer waits for a reader that is reading its buffer before it
/// gives up on the connection ([`Conn::finish_split`]).
const SPLIT_READ_GRACE: Duration = Duration::from_secs(1);
/// How long that writer polls before it naps between looks, and each nap.
const SPLIT_SPIN: Duration = Duration::from_micros(200);
const SPLIT_NAP: Duration = Duration::from_micros(50);
/// How often a wait on a peer that is stopped in the middle of a rendezvous looks
/// again ([`peer_stopped`]).
const STOPPED_PEER_NAP: Duration = Duration::from_millis(10);

/// True if process `pid` (a rendezvous peer) is stopped now: a tracer's or a
/// job-control stop. A peer whose state cannot be read (another pid namespace, no
/// `/proc`) counts as running: the grace then ends the wait as before.
fn peer_stopped(pid: libc::pid_t) -> bool {
    pid > 0 && strait_sys::procfs::stopped(pid) == Some(true)
}

/// Header word of the message-mode negotiation.
pub(crate) const OFF_MODE: usize = 24;
/// Header word set by a connector that wrote before its acceptor attached (those
/// bytes went to the kernel socket too: the acceptor discards that copy).
pub(crate) const OFF_EARLY: usize = 32;
/// Header word where an acceptor that attaches by path A publishes its slot of the
/// process pair (written before the attach, read by the connector after it).
pub(crate) const OFF_ACCEPTOR_SLOT: usize = 40;
/// The same for an acceptor that attaches by path B (a separate word: an acceptor
/// that loses the race to attach must not overwrite the winner's slot).
pub(crate) const OFF_ACCEPTOR_SLOT_B: usize = 48;
pub(crate) const MODE_ASKED: u64 = 1;
pub(crate) const MODE_AGREED: u64 = 2;
/// Length header of a message in the ring.
const MSG_HDR: usize = 8;

/// Messages moved by rendezvous (single copy into the reader's buffer).
pub static RENDEZVOUS: AtomicUsize = AtomicUsize::new(0);
/// Of those, the byte-stream writes whose reader read a part from our buffer.
pub static SPLITS: AtomicUsize = AtomicUsize::new(0);
/// Cleared when `process_vm_writev` is refused (no ptrace permission): the ring then.
static CMA_OK: AtomicBool = AtomicBool::new(true);

pub const PENDING: u64 = 0;
pub const ATTACHED: u64 = 1;
pub const KERNEL: u64 = 2;
/// Attached by an acceptor that asked the connector directly (path B): the
/// connector's peer is then the asker, not the marker's holder.
pub const ATTACHED_B: u64 = 3;

/// TCP states in socket diagnostics: a socket that has not sent its FIN.
const TCP_ESTABLISHED: u8 = 1;
const TCP_CLOSE_WAIT: u8 = 8;

/// What a write before the acceptor attached did ([`Conn::send_early`]).
pub enum Early {
    /// These bytes went out (to the kernel socket and to the ring alike).
    Sent(usize),
    /// The kernel socket refused: its answer, with `errno` set (a non-blocking
    /// socket's EAGAIN, or the connection's error).
    Kernel,
    /// Not now (message mode, a full ring, a blocking write the kernel cannot take
    /// whole): settle first, as any first use.
    NotNow,
}

/// A connector's state until the acceptor attached.
pub struct PendingC {
    /// Our Unix socket connected to the listener's marker, which the hello went
    /// out on (its holder drops hellos whose link hung up): kept until settled.
    pub marker: c_int,
    /// Our per-connection name (-1 if it could not be bound).
    pub listener: c_int,
    pub hello: [u8; 48],
    /// When the connector stops waiting for the acceptor (then: the kernel),
    /// unless the acceptor cannot have taken the connection yet then (see
    /// [`PendingC::acceptor_pending`]).
    pub deadline: Instant,
    /// How long the connector waits for its acceptor (the attach timeout, or
    /// nothing for a single thread's own listener).
    pub wait: Duration,
    /// When the connector sent its hello.
    pub since: Instant,
    /// The listener is this process's own (its accept queue waits for us).
    pub own: bool,
    /// Until the next look at the handshake, the accept queue and the hello
    /// (doubles).
    pub look: Duration,
    /// A path-B asker we answered (its socket becomes ours if it attaches).
    pub asked: c_int,
}

/// A shared mapping (unmapped on drop).
pub struct Shm {
    map: Mapping,
    pub(crate) ring: usize,
    /// The data areas of the two directions.
    areas: [MappedArea; 2],
}

// SAFETY: the areas point into the shared mapping this value owns; every word both
// processes write is accessed atomically, data bytes only by copying.
unsafe impl Send for Shm {}
// SAFETY: as above.
unsafe impl Sync for Shm {}

impl Shm {
    /// Maps a memfd of `HDR + 2 * ring` bytes. Not populated: pages come as the
    /// rings reach them, once per connection. Populating both ends' 1 MiB at every
    /// connect cost ~0.7 ms of page clearing and mapping per connection (a client
    /// that connects per request ran at 1/20 of the kernel's rate); a long-lived
    /// connection pays the same faults once, spread over its first pass through the
    /// ring.
    pub fn map(fd: c_int, ring: usize) -> Option<Shm> {
        let map = Mapping::shared_on_demand(fd, HDR + 2 * ring, 0).ok()?;
        crate::fds::shm_mapped(map.len());
        let base = map.ptr();
        // SAFETY: both data areas lie inside the mapping (after the header page, so
        // page-aligned), which this value owns and unmaps only when dropped.
        let areas = [0, 1].map(|d| unsafe { MappedArea::new(base.add(HDR + d * ring), ring) });
        Some(Shm { map, ring, areas })
    }

    /// The byte ring of direction `d` (0: connector to acceptor).
    pub(crate) fn ring(&self, d: usize) -> ByteRing<'_, MappedArea> {
        ByteRing::new(self.word(ctl(d) + TAIL), self.word(ctl(d) + HEAD), &self.areas[d])
    }

    pub(crate) fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off < HDR && off.is_multiple_of(8));
        // SAFETY: `off` is an 8-aligned offset inside the page-aligned header page.
        unsafe { &*self.map.ptr().add(off).cast::<AtomicU64>() }
    }

    pub fn init_header(&self) {
        self.word(0).store(MAGIC, Ordering::Relaxed);
        self.word(8).store(VERSION as u64 | ((self.ring as u64) << 32), Ordering::Relaxed);
        self.word(off_holders(0)).store(1, Ordering::Relaxed);
        self.word(off_holders(1)).store(1, Ordering::Relaxed);
    }

    pub fn header_ok(&self) -> bool {
        self.word(0).load(Ordering::Relaxed) == MAGIC
            && self.word(8).load(Ordering::Relaxed) == VERSION as u64 | ((self.ring as u64) << 32)
    }

    pub fn state(&self) -> &AtomicU64 {
        self.word(OFF_STATE)
    }

    pub(crate) fn data(&self, d: usize) -> *mut u8 {
        self.areas[d].base()
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        // (The mapping itself goes with `map`.)
        crate::fds::shm_unmapped(self.map.len());
    }
}

/// The far side of a connection to another host: it plays the peer's side of the
/// rings (the bridge of the `remote` module, over a strait device). The connection
/// calls it after its own ring steps; it never knows what carries the bytes.
pub(crate) trait FarEnd: Send + Sync {
    /// True in the process that drives the device (not in a forked child).
    fn owned_here(&self) -> bool;
    /// A descriptor to sleep on, for a program thread waiting on this connection.
    fn wake_fd(&self) -> Option<c_int>;
    /// A program thread's turn: drives the device now.
    fn pump_inline(&self);
    /// After the program read: ring space may be credited back to the peer.
    fn after_read(&self);
    /// A program thread just wrote: the bytes may leave now.
    fn push_inline(&self);
}

/// What a far end keeps with a connection until it is set up; the connection never
/// looks inside (only the far end's module knows the type).
pub(crate) type FarSetup = Box<dyn std::any::Any + Send>;

/// Connectors of this process waiting for their acceptors: while there are none,
/// a sleeping epoll_wait looks for no attach deadline among its members.
static AWAITING: AtomicUsize = AtomicUsize::new(0);

/// True if some connector of this process still waits for its acceptor.
pub(crate) fn any_awaiting_attach() -> bool {
    AWAITING.load(Ordering::Relaxed) != 0
}

/// Process-wide counters (printed at exit with `STRAIT_STATS=1`).
pub static ACCELERATED: AtomicUsize = AtomicUsize::new(0);
pub static KERNEL_FALLBACKS: AtomicUsize = AtomicUsize::new(0);
/// Connections to other hosts carried by the udp device.
pub static REMOTE: AtomicUsize = AtomicUsize::new(0);
/// Of those, connections carried by the xdp device.
pub static REMOTE_XDP: AtomicUsize = AtomicUsize::new(0);
/// Connections to other hosts refused because the two ends' secrets differ (or one
/// end has none): they stay on the kernel.
pub static REMOTE_REFUSED: AtomicUsize = AtomicUsize::new(0);
/// Offers, refusals and answers ignored because they did not echo this
/// connection's nonces or carried a bad tag (forged or replayed).
pub static REMOTE_FORGED: AtomicUsize = AtomicUsize::new(0);
/// Connections attached by asking the connector directly (path B).
pub static PATH_B: AtomicUsize = AtomicUsize::new(0);

/// How one end learns that every process at the other end is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// The program's TCP socket of the connection (any of its descriptors): the
    /// kernel reports its hang-up when the last holder of the peer's socket closed
    /// it or died. The library never forwards a `shutdown` to it (a half-close
    /// travels in the rings), so nothing else hangs it up. No descriptor of the
    /// library's.
    TcpSocket,
    /// A Unix socket of the library's whose other end the peer holds (a connection
    /// to another host: the bridge's end of a socketpair).
    Socket(c_int),
}

/// A connection's doorbell in the pair of its two processes.
pub struct PairBell {
    pub pair: Arc<crate::pair::Pair>,
    /// Our slot, in the half we read.
    pub my_slot: u32,
    /// The peer's slot, in its half (the peer's word: [`crate::pair::Pair::ring`]
    /// bounds it).
    pub peer_slot: u32,
}

/// A pair a pending connector offered in a hello, with the state the attach sets
/// when the acceptor took that hello.
pub struct Offered {
    /// [`ATTACHED`] (the marker's holder) or [`ATTACHED_B`] (a path-B asker).
    pub attach: u64,
    pub pair: Arc<crate::pair::Pair>,
    pub my_slot: u32,
}

/// What a pending connector answers a path-B asker with.
pub enum ServeWith {
    /// Its own eventfds (connector's, acceptor's).
    Own([c_int; 2]),
    /// A process pair with the asker (made or reused when serving it).
    Pair,
}

/// How the two ends of a connection ring each other.
pub enum Bells {
    /// An eventfd per end, the connection's own: ours (the peer rings it), the
    /// peer's.
    Own { mine: c_int, peer: c_int },
    /// A slot in the doorbells of the process pair.
    Pair(PairBell),
    /// A connector before its acceptor attached: the pairs its hellos offered.
    Pending(Vec<Offered>),
}

/// The descriptors that carry one end of a connection besides its mapping (owned by
/// the [`Conn`] made from them).
pub struct Carriers {
    /// The doorbells.
    pub bells: Bells,
    /// How the peer's end is watched.
    pub liveness: Liveness,
    /// Where the mapping's memfd is kept ([`crate::vault`]).
    pub vault: crate::vault::Kept,
    /// The process a rendezvous may write into: the kernel's word on who sent the
    /// hello (or, for a connector, who holds the marker or asked by path B), never
    /// a pid read from shared memory. `None`: the ring only.
    pub peer_pid: Option<libc::pid_t>,
}

/// One end of an accelerated connection.
pub struct Conn {
    pub shm: Shm,
    /// 0: connector, 1: acceptor. We produce direction `side`, consume `1 - side`.
    pub side: usize,
    /// Our own eventfd ([`Bells::Own`]; -1 for a connection that rings through its
    /// process pair).
    pub my_efd: c_int,
    /// The peer's own eventfd ([`Bells::Own`]; else -1).
    pub peer_efd: c_int,
    /// The pair bell ([`Bells::Pair`], or a connector's offer once its acceptor
    /// attached).
    pair: std::sync::OnceLock<PairBell>,
    /// A pending connector's offers ([`Bells::Pending`]) until one is chosen.
    offered: Mutex<Vec<Offered>>,
    liveness: Liveness,
    /// Where the mapping's memfd is kept, for `exec`, descriptor passing and path B.
    pub vault: crate::vault::Kept,
    pending: Mutex<Option<PendingC>>,
    /// A connector whose acceptor has not attached yet (`pending` is set).
    awaiting: AtomicBool,
    pub nonblock: AtomicBool,
    rd_shut: AtomicBool,
    wr_shut: AtomicBool,
    /// Shutdowns the kernel socket owes if the connection ends on the kernel
    /// (bit 0 read, bit 1 write; [`Conn::defer_kernel_shutdown`]).
    kernel_shut: AtomicU8,
    peer_dead: AtomicBool,
    /// Descriptors of this process that refer to this connection.
    pub fdrefs: AtomicUsize,
    released: AtomicBool,
    /// Non-blocking calls that found nothing to do (see `check_peer_now_and_then`).
    idle_polls: std::sync::atomic::AtomicU32,
    /// Released before it was settled (see [`Conn::after_late_attach`]).
    release_deferred: AtomicBool,
    /// Counted in the statistics (connector side, once attached).
    pub counted: AtomicBool,
    rlock: Mutex<()>,
    wlock: Mutex<()>,
    /// A connection to another host: the bridge that plays the peer's side of the
    /// rings (see [`FarEnd`]).
    pub(crate) remote: std::sync::OnceLock<Arc<dyn FarEnd>>,
    /// A connection to another host that is not settled yet.
    pub(crate) remote_pending: Mutex<Option<FarSetup>>,
    /// The process that settles `remote_pending` (a forked child reads the decision
    /// from the shared header instead: the parent's threads may hold the lock).
    pub(crate) remote_settler: std::sync::atomic::AtomicU32,
    /// A connection to another host that settled on the kernel path.
    remote_kernel: AtomicBool,
    /// Message mode, decided once (our setting, and the peer's word read once
    /// after the attach): the peer cannot switch it later.
    mode: std::sync::OnceLock<bool>,
    /// Bytes of the reader buffer this process posted for a rendezvous (0: none).
    /// A completion is believed only up to this, and only if we posted.
    rv_posted: AtomicUsize,
    /// The address of that buffer (ours: the copy in shared memory is the peer's to
    /// change).
    rv_buf: AtomicUsize,
    /// A pending connector's kernel connect was seen complete (so its readiness
    /// stops asking the kernel: a pending entry is looked at on every epoll_wait).
    kernel_connected: AtomicBool,
    /// The peer process a rendezvous may write into ([`Carriers::peer_pid`]; 0:
    /// none). A connector settled by path B learns it from the asker's socket.
    rv_peer: AtomicI32,
    /// A connection this process made on this host: where to, and when (see
    /// [`Conn::set_origin`]).
    origin: std::sync::OnceLock<Origin>,
    /// Reads and writes with data this process made on the connection, counted up
    /// to a bound (what `worth.rs` learns from).
    ops: std::sync::atomic::AtomicU32,
    /// How long this connection's blocked calls spin before they sleep.
    spin: SpinPolicy,
    /// The reader's head of our transmit ring as this process last read it: never
    /// ahead of the real one (heads only grow), so the room it implies is there.
    /// A writer that finds enough room by it leaves the reader's head alone, and the
    /// reader's next store to its head stays in its own cache instead of pulling the
    /// line back (which the fence of its wake check would wait for: `strait anatomy
    /// --transports strait-run` measured that as most of a read's return).
    head_seen: AtomicU64,
    /// The tail of our transmit ring as this process published it last, and the
    /// process that did (0: none yet): see [`Conn::tail_known`].
    tail_mine: AtomicU64,
    tail_mine_pid: AtomicU64,
    /// The peer's [`CLOSES`] counter when this end last asked the kernel about it.
    closes_seen: AtomicU64,
}

enum Waited {
    Ready,
    Timeout,
    Interrupted,
}

/// Readiness of a connection, as poll bits.
pub struct Ready {
    pub bits: i16,
    /// Ring positions, to tell new data/space for edge-triggered epoll.
    pub rx_tail: u64,
    pub tx_head: u64,
}

/// How a connector's wait for its acceptor ended ([`Conn::settle_within`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleWait {
    /// Decided: true if shared memory carries the connection from now on, false
    /// if the kernel does.
    Decided(bool),
    /// Still waiting at the call's deadline.
    TimedOut,
    /// A signal came whose handler does not restart the call.
    Interrupted,
}

pub enum IoErr {
    /// A non-blocking message larger than the ring (message mode).
    MsgSize,
    Again,
    Intr,
    Pipe,
    Reset,
}

impl Conn {
    pub fn new(shm: Shm, side: usize, fds: Carriers, nonblock: bool, pending: Option<PendingC>) -> Conn {
        let Carriers { bells, liveness, vault, peer_pid } = fds;
        let (mut my_efd, mut peer_efd) = (-1, -1);
        let pair = std::sync::OnceLock::new();
        let mut offered = Vec::new();
        match bells {
            Bells::Own { mine, peer } => [my_efd, peer_efd] = [mine, peer].map(crate::fds::keep),
            Bells::Pair(b) => {
                let _ = pair.set(b);
            }
            Bells::Pending(o) => offered = o,
        }
        let liveness = match liveness {
            Liveness::Socket(u) => Liveness::Socket(crate::fds::keep(u)),
            Liveness::TcpSocket => Liveness::TcpSocket,
        };
        if pending.is_some() {
            AWAITING.fetch_add(1, Ordering::Relaxed);
        }
        Conn {
            shm,
            side,
            my_efd,
            peer_efd,
            pair,
            offered: Mutex::new(offered),
            liveness,
            vault,
            awaiting: AtomicBool::new(pending.is_some()),
            pending: Mutex::new(pending),
            nonblock: AtomicBool::new(nonblock),
            rd_shut: AtomicBool::new(false),
            wr_shut: AtomicBool::new(false),
            kernel_shut: AtomicU8::new(0),
            peer_dead: AtomicBool::new(false),
            fdrefs: AtomicUsize::new(1),
            released: AtomicBool::new(false),
            idle_polls: std::sync::atomic::AtomicU32::new(0),
            release_deferred: AtomicBool::new(false),
            counted: AtomicBool::new(false),
            rlock: Mutex::new(()),
            wlock: Mutex::new(()),
            remote: std::sync::OnceLock::new(),
            remote_pending: Mutex::new(None),
            remote_settler: std::sync::atomic::AtomicU32::new(0),
            remote_kernel: AtomicBool::new(false),
            mode: std::sync::OnceLock::new(),
            rv_posted: AtomicUsize::new(0),
            rv_buf: AtomicUsize::new(0),
            kernel_connected: AtomicBool::new(false),
            rv_peer: AtomicI32::new(peer_pid.unwrap_or(0)),
            head_seen: AtomicU64::new(0),
            tail_mine: AtomicU64::new(0),
            tail_mine_pid: AtomicU64::new(0),
            closes_seen: AtomicU64::new(0),
            spin: spin_policy(),
            origin: std::sync::OnceLock::new(),
            ops: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// Marks a connection this process made to `dest` (a connector on this host),
    /// so that what it carried is learned when it ends here.
    pub fn set_origin(&self, dest: crate::sock::Key) {
        let _ = self.origin.set(Origin {
            dest,
            pid: strait_sys::pid::current_pid(),
            forks: crate::vault::forks(),
        });
    }

    /// Counts a read or write that moved data, only up to one past the threshold
    /// (only "more than it" matters): past it, a load and no store. A count two
    /// threads race on may lose one, which changes nothing that matters.
    pub fn count_op(&self) {
        if self.origin.get().is_some() {
            let n = self.ops.load(Ordering::Relaxed);
            if n <= Settings::get().setup_min_ops {
                self.ops.store(n + 1, Ordering::Relaxed);
            }
        }
    }

    /// Takes the lock word at `off` of direction `d` (see the module doc). A peer
    /// that keeps the word held (it lives in memory the peer can write) resets
    /// the connection after a bound instead of holding this process forever.
    fn step_lock(&self, d: usize, off: usize) -> Result<StepLock<'_>, IoErr> {
        let lock = StepLock::take(self.w(d, off)).ok_or_else(|| {
            self.peer_dead.store(true, Ordering::Relaxed);
            IoErr::Reset
        })?;
        if off == WLOCK && !lock.was_mine {
            // Another process wrote since this one's last step: the tail kept is
            // stale, and stays forgotten even if this step publishes nothing (its
            // release names this process as the last holder all the same).
            self.tail_mine_pid.store(0, Ordering::Relaxed);
        }
        Ok(lock)
    }

    fn tx(&self) -> usize {
        self.side
    }
    fn rx(&self) -> usize {
        1 - self.side
    }
    fn w(&self, d: usize, off: usize) -> &AtomicU64 {
        self.shm.word(ctl(d) + off)
    }

    pub fn state(&self) -> u64 {
        self.shm.state().load(Ordering::Acquire)
    }

    /// The descriptor whose hang-up means the peer is gone, for the program's
    /// descriptor `fd` of this connection (-1 if not known: nothing to watch).
    pub fn hup_fd(&self, fd: c_int) -> c_int {
        match self.liveness {
            Liveness::TcpSocket => fd,
            Liveness::Socket(u) => u,
        }
    }

    /// True if the peer is watched through the program's own socket (no
    /// descriptor of the library's).
    pub fn watched_by_socket(&self) -> bool {
        self.liveness == Liveness::TcpSocket
    }

    pub fn attached(&self) -> bool {
        matches!(self.state(), ATTACHED | ATTACHED_B)
    }

    /// Bytes waiting to be read, or `Err` if the peer broke the ring.
    fn avail(&self) -> Result<(u64, u64), IoErr> {
        match self.shm.ring(self.rx()).readable() {
            Ok(s) => Ok((s.pos, s.len)),
            Err(_) => {
                self.peer_dead.store(true, Ordering::Relaxed);
                Err(IoErr::Reset)
            }
        }
    }

    /// Free bytes in our transmit ring (the reader's head read now).
    fn room(&self) -> Result<(u64, u64), IoErr> {
        let ring = self.shm.ring(self.tx());
        match ring.writable() {
            Ok(s) => {
                // A plain store, not a read-modify-write (this runs for every poll of
                // the connection's readiness): a racing thread that stores an older
                // head only makes the hint smaller, never larger than the real head.
                let head = s.end() - ring.size() as u64;
                if head > self.head_seen.load(Ordering::Relaxed) {
                    self.head_seen.store(head, Ordering::Relaxed);
                }
                Ok((s.pos, s.len))
            }
            Err(_) => {
                self.peer_dead.store(true, Ordering::Relaxed);
                Err(IoErr::Reset)
            }
        }
    }

    /// Free bytes in our transmit ring, at least `need` of them if there are: by the
    /// head last seen when that shows enough room, else as [`Conn::room`]. Room it
    /// reports is always there; it may report less than there is.
    fn room_for(&self, need: usize, lock: &StepLock) -> Result<(u64, u64), IoErr> {
        let ring = self.shm.ring(self.tx());
        let head_seen = self.head_seen.load(Ordering::Relaxed);
        let span = match self.tail_known(lock) {
            Some(tail) => ring.writable_between(tail, head_seen),
            None => ring.writable_from(head_seen),
        };
        match span {
            Ok(s) if s.len >= need as u64 => Ok((s.pos, s.len)),
            _ => self.room(),
        }
    }

    /// The tail this process published last, if no other process wrote since (the
    /// lock's last holder was this process, and the tail was published by this
    /// process, not a parent it was forked from).
    fn tail_known(&self, lock: &StepLock) -> Option<u64> {
        (lock.was_mine && self.tail_mine_pid.load(Ordering::Relaxed) == lock.me)
            .then(|| self.tail_mine.load(Ordering::Relaxed))
    }

    /// Publishes the bytes of our transmit ring before `tail`, under the producer
    /// lock `lock`, and keeps the tail for this process's next step.
    fn publish(&self, lock: &StepLock, tail: u64) {
        self.shm.ring(self.tx()).publish_to(tail);
        self.tail_mine.store(tail, Ordering::Relaxed);
        self.tail_mine_pid.store(lock.me, Ordering::Relaxed);
    }

    fn rx_eof(&self) -> bool {
        self.rd_shut.load(Ordering::Relaxed)
            || self.w(self.rx(), WCLOSED).load(Ordering::Acquire) != 0
            || self.peer_dead.load(Ordering::Relaxed)
    }

    fn tx_broken(&self) -> bool {
        self.w(self.tx(), RCLOSED).load(Ordering::Acquire) != 0 || self.peer_dead.load(Ordering::Relaxed)
    }

    fn ring_bell(&self) {
        if self.peer_efd >= 0 {
            crate::sock::ring_eventfd(self.peer_efd);
        } else if let Some(b) = self.pair_bell() {
            b.pair.ring(b.peer_slot);
        }
    }

    /// The key this connection's pair slots are bound to: its address in its
    /// `Arc` (the key the epoll sets know it by).
    fn key(&self) -> u64 {
        self as *const Conn as u64
    }

    /// Binds the connection's pair slots to it: call once it is in its `Arc`
    /// (rings for it are reported to epoll sets from then on).
    pub fn bind_bells(&self) {
        if let Some(b) = self.pair.get() {
            b.pair.bind(b.my_slot, self.key());
        }
        for o in self.offered_now().iter() {
            o.pair.bind(o.my_slot, self.key());
        }
    }

    /// A pending connector served a path-B asker with `o`: it replaces an earlier
    /// path-B offer (whose slot goes back).
    pub(crate) fn offer(&self, o: Offered) {
        o.pair.bind(o.my_slot, self.key());
        let mut offered = self.offered_now();
        if let Some(i) = offered.iter().position(|x| x.attach == o.attach) {
            let old = offered.swap_remove(i);
            old.pair.free(old.my_slot);
        }
        offered.push(o);
    }

    /// True if the connection rings through process pairs (not eventfds of its own).
    pub fn uses_pairs(&self) -> bool {
        self.my_efd < 0 && (self.pair.get().is_some() || !self.offered_now().is_empty())
    }

    fn offered_now(&self) -> std::sync::MutexGuard<'_, Vec<Offered>> {
        self.offered.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pair bell; a connector's is chosen at the first look after its acceptor
    /// attached (the offer that acceptor took, with the slot it published), and
    /// the other offers' slots go back.
    pub(crate) fn pair_bell(&self) -> Option<&PairBell> {
        if let Some(b) = self.pair.get() {
            return Some(b);
        }
        let st = self.state();
        if st != ATTACHED && st != ATTACHED_B {
            return None;
        }
        let rest = {
            let mut offered = self.offered_now();
            if offered.is_empty() {
                return self.pair.get();
            }
            let mut rest = std::mem::take(&mut *offered);
            if let Some(i) = rest.iter().position(|o| o.attach == st) {
                let o = rest.swap_remove(i);
                let word = if st == ATTACHED { OFF_ACCEPTOR_SLOT } else { OFF_ACCEPTOR_SLOT_B };
                // The peer's word: out of range rings nothing.
                let peer_slot =
                    u32::try_from(self.shm.word(word).load(Ordering::Acquire)).unwrap_or(u32::MAX);
                let _ = self.pair.set(PairBell { pair: o.pair, my_slot: o.my_slot, peer_slot });
            }
            rest
        };
        for o in rest {
            o.pair.free(o.my_slot);
        }
        crate::pair::retire_idle();
        self.pair.get()
    }

    /// The pairs this connection may be rung through (its own, or a pending
    /// connector's offers), for epoll sets.
    pub(crate) fn watched_pairs(&self) -> Vec<Arc<crate::pair::Pair>> {
        if let Some(b) = self.pair_bell() {
            return vec![b.pair.clone()];
        }
        self.offered_now().iter().map(|o| o.pair.clone()).collect()
    }

    /// The descriptor a sleeper on this connection polls for its bell: its own
    /// eventfd, or this thread's [`crate::hub`] with the pairs' bells in it (-1:
    /// none).
    pub fn bell_fd(&self) -> c_int {
        if self.my_efd >= 0 {
            return self.my_efd;
        }
        // No hub (a seccomp filter): the pair's bell itself.
        let watch = |p: &crate::pair::Pair| crate::hub::watch(p.my_bell()).unwrap_or(p.my_bell());
        if let Some(b) = self.pair_bell() {
            return watch(&b.pair);
        }
        self.offered_now().iter().fold(-1, |_, o| watch(&o.pair))
    }

    /// A poll found `fd` (what [`Conn::bell_fd`] gave) readable: consumes the
    /// wake-up (reads our eventfd, or settles the thread's hub).
    pub fn after_bell(&self, fd: c_int) {
        if self.my_efd >= 0 {
            self.drain_bell();
        } else if crate::hub::is_mine(fd) {
            crate::hub::settle(fd);
        } else if fd >= 0 {
            // A pair's bell polled directly (no hub: see `hub.rs`): read, or it
            // stays readable.
            crate::sock::drain_eventfd(fd);
        }
    }

    /// Rings the peer's eventfd whether or not it said it sleeps (a rendezvous
    /// completion must not wait for the sleeper's next look).
    pub(crate) fn ring_bell_always(&self) {
        self.ring_bell();
    }

    fn wake_if(&self, flag: &AtomicU64) {
        if peer_needs_wake(flag) {
            strait_probe::probe!(strait_probe::Stage::DoorbellBegin);
            self.ring_bell();
            strait_probe::probe!(strait_probe::Stage::DoorbellEnd);
        }
    }

    /// [`Conn::check_peer`] on one call in 256: a non-blocking caller that finds the
    /// ring empty (or full) would otherwise make a system call each time, and a
    /// busy-polling program calls millions of times a second (an empty `recv` costs
    /// ~50 ns, so a crashed peer is still noticed within ~15 us; an orderly close at
    /// once through the close hint, and poll/epoll and blocked calls watch the
    /// hang-up). The count is a plain load and store, not a locked add: threads that
    /// race on it only make the next check come a little later, and the locked add
    /// was a fifth of an empty `recv`.
    fn check_peer_now_and_then(&self, fd: c_int) -> bool {
        if self.peer_dead.load(Ordering::Relaxed) || self.look_after_close(fd) {
            return true;
        }
        let n = self.idle_polls.load(Ordering::Relaxed);
        self.idle_polls.store(n.wrapping_add(1), Ordering::Relaxed);
        if !n.is_multiple_of(256) {
            return false;
        }
        self.check_peer(fd)
    }

    /// What a non-blocking call that can go no further now returns: `Ok(done)` if
    /// it moved some bytes, else `Err(Again)`; `None` where
    /// [`Conn::check_peer_now_and_then`] finds the peer gone (a read looks again and
    /// finds the end, a write fails).
    fn nonblocking_result(&self, fd: c_int, done: usize) -> Option<Result<usize, IoErr>> {
        if done > 0 {
            return Some(Ok(done));
        }
        if self.check_peer_now_and_then(fd) {
            return None;
        }
        Some(Err(IoErr::Again))
    }

    /// Checks (with a zero-timeout poll) whether the peer hung up ([`Liveness`]),
    /// through the program's descriptor `fd` of this connection when the TCP
    /// socket is what tells (-1: not known, nothing checked). Bytes waiting in
    /// the TCP socket (a connector's early write not yet discarded) are no
    /// hang-up; anything arriving on a liveness socket of the library's is one.
    pub fn check_peer(&self, fd: c_int) -> bool {
        if self.peer_dead.load(Ordering::Relaxed) {
            return true;
        }
        let (watch, gone) = match self.liveness {
            Liveness::TcpSocket => (fd, libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR),
            Liveness::Socket(u) => (u, libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR | libc::POLLIN),
        };
        if watch < 0 {
            return false;
        }
        let mut p = libc::pollfd { fd: watch, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
        // SAFETY: one pollfd on the stack.
        let r = unsafe { real::poll(&mut p, 1, 0) };
        if r > 0 && p.revents & gone != 0 {
            self.peer_dead.store(true, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// A poll or epoll set that asked for `POLLRDHUP` on the hang-up descriptor
    /// ([`Conn::hup_fd`]) reported `revents` for it: true (and remembered) if
    /// they say the peer is gone. The report is the kernel's answer already; no
    /// second look.
    pub fn hung_up(&self, revents: i16) -> bool {
        if revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0 {
            self.peer_dead.store(true, Ordering::Relaxed);
        }
        self.peer_dead.load(Ordering::Relaxed)
    }

    /// After a process of the peer's end closed its last descriptor (its
    /// [`CLOSES`] hint moved since we last looked): asks the kernel at once, through
    /// the program's descriptor `fd`, whether the peer's socket hung up (true: the
    /// peer is gone). Once per hint, so a peer whose other holders live on (a
    /// forked child) costs one system call, not one per look.
    fn look_after_close(&self, fd: c_int) -> bool {
        let closes = self.w(self.rx(), CLOSES).load(Ordering::Acquire);
        if fd < 0 || closes == self.closes_seen.load(Ordering::Relaxed) {
            return false;
        }
        self.closes_seen.store(closes, Ordering::Relaxed);
        self.check_peer(fd)
    }

    /// A connection to another host: moves what arrived into the rings and what the
    /// rings hold out to the peer (a no-op for a local connection).
    pub fn pump_remote(&self) {
        if let Some(b) = self.remote.get() {
            b.pump_inline();
        }
    }

    /// Marks a connection to another host that stays with the kernel.
    pub fn mark_remote_kernel(&self) {
        self.remote_kernel.store(true, Ordering::Relaxed);
    }

    /// True for a connection to another host that stays with the kernel.
    pub fn is_remote_kernel(&self) -> bool {
        self.remote_kernel.load(Ordering::Relaxed)
    }

    /// The descriptor that becomes readable when the peer host sent something, for
    /// a sleeper on a connection to another host.
    pub fn remote_fd(&self) -> Option<c_int> {
        self.remote.get().and_then(|b| b.wake_fd())
    }

    /// Moves a connection to another host along and reads our own eventfd (a pair's
    /// bell is never read: [`crate::pair`]).
    pub fn drain_bell(&self) {
        self.pump_remote();
        if self.my_efd >= 0 {
            crate::sock::drain_eventfd(self.my_efd);
        }
    }

    /// The path-B listener of a connector still waiting for its acceptor: an
    /// acceptor that missed the hello (another process's listener took it, as with
    /// SO_REUSEPORT) asks there, so a program asleep in poll or epoll must wake to
    /// answer it.
    pub fn pending_listener(&self) -> Option<c_int> {
        if !self.awaiting_attach() {
            return None;
        }
        self.pending.try_lock().ok()?.as_ref().map(|p| p.listener).filter(|&l| l >= 0)
    }

    /// Current readiness as poll bits (POLLIN/POLLOUT/POLLHUP/POLLRDHUP/POLLERR), for
    /// the program's descriptor `fd` of this connection (-1: not known; then a
    /// path-B ask waits for the program's next call).
    pub fn readiness(&self, fd: c_int) -> Ready {
        self.readiness_with(fd, true)
    }

    /// Readiness, a connection to another host driven first: what its ring holds
    /// is sent, and with `arrivals` what came is looked for. (An epoll set whose
    /// kernel half holds the connection's UDP socket, level-triggered, does not
    /// look: that socket's bell moves arrivals in, [`Conn::drain_bell`].)
    pub(crate) fn readiness_with(&self, fd: c_int, arrivals: bool) -> Ready {
        if self.awaiting_attach() {
            // Nothing until the acceptor attached; once the connection stays with the
            // kernel, readable and writable, so the program's next call finds the
            // kernel socket. An acceptor asking by path B is answered here (the
            // descriptor proves to it that we hold the other end).
            match self.try_settle(fd) {
                // Writable once the kernel's connect completed and the ring has room:
                // writes go out early ([`Conn::send_early`]), as a kernel socket takes
                // bytes before the accept.
                None => {
                    let bits = if self.early_writable(fd) { libc::POLLOUT } else { 0 };
                    return Ready { bits, rx_tail: 0, tx_head: 0 };
                }
                Some(false) => return Ready { bits: libc::POLLIN | libc::POLLOUT, rx_tail: 0, tx_head: 0 },
                Some(true) => {}
            }
        }
        match self.remote.get() {
            Some(b) if arrivals => b.pump_inline(),
            Some(b) => b.push_inline(),
            None => {}
        }
        self.look_after_close(fd);
        let mut bits = 0i16;
        let (rx_tail, readable) = match self.avail() {
            Ok((h, n)) => (h + n, n > 0 || self.rx_eof()),
            Err(_) => (0, true),
        };
        if readable {
            bits |= libc::POLLIN;
        }
        let (tx_head, writable) = match self.room() {
            Ok((t, r)) => (t + r, r > 0 || self.tx_broken() || self.wr_shut.load(Ordering::Relaxed)),
            Err(_) => (0, true),
        };
        if writable {
            bits |= libc::POLLOUT;
        }
        let peer_wclosed = self.w(self.rx(), WCLOSED).load(Ordering::Acquire) != 0;
        if peer_wclosed || self.peer_dead.load(Ordering::Relaxed) {
            bits |= libc::POLLRDHUP;
        }
        let both_shut = (peer_wclosed || self.rd_shut.load(Ordering::Relaxed))
            && (self.wr_shut.load(Ordering::Relaxed) || self.tx_broken());
        if self.peer_dead.load(Ordering::Relaxed) || both_shut {
            bits |= libc::POLLHUP;
        }
        Ready { bits, rx_tail, tx_head }
    }

    /// Announces that this thread is about to sleep waiting for data (`rx`) and/or
    /// room (`tx`); the peer rings our eventfd when it changes either.
    pub fn announce(&self, rx: bool, tx: bool) {
        if rx {
            announce_sleep(self.w(self.rx(), RSLEEP));
        }
        if tx {
            announce_sleep(self.w(self.tx(), WSLEEP));
        }
    }

    /// True while the sleeping flags [`Conn::announce`]`(rx, tx)` set are all still
    /// set: the peer has published nothing, freed no room and closed nothing since
    /// (each of those takes the flag before it rings our bell, so a send or close
    /// that has returned took it), so no bell has rung for this connection since.
    /// An epoll set whose members all say so need not ask the kernel.
    pub fn announce_stands(&self, rx: bool, tx: bool) -> bool {
        (!rx || self.w(self.rx(), RSLEEP).load(Ordering::Relaxed) != 0)
            && (!tx || self.w(self.tx(), WSLEEP).load(Ordering::Relaxed) != 0)
    }

    /// Rings the peer's bell for a close of our sending side (or of both): takes the
    /// peer's sleeping flags first, as a send does, so that a peer's epoll set that
    /// trusts standing flags ([`Conn::announce_stands`]) sees the change.
    fn ring_bell_for_close(&self) {
        // The bell rings whatever the flags said: a close always wakes.
        self.take_peer_flags();
        self.ring_bell();
    }

    /// Takes both of the peer's sleeping flags (it may wait for data and for
    /// room), so that its next look does not trust them.
    fn take_peer_flags(&self) {
        for flag in [self.w(self.tx(), RSLEEP), self.w(self.rx(), WSLEEP)] {
            peer_needs_wake(flag);
        }
    }

    /// Blocks until `ready()` or `deadline`, spinning first (as long as spinning
    /// pays: [`spin_policy`]); false on timeout.
    fn wait(&self, fd: c_int, rx: bool, ready: &dyn Fn(&Conn) -> bool) -> Waited {
        let start = Instant::now();
        let budget = self.spin.next_budget(self.spin.is_adaptive() && crowded(start));
        // SO_RCVTIMEO / SO_SNDTIMEO of the (idle) kernel socket bound the wait, the
        // spin included.
        let opt = if rx { libc::SO_RCVTIMEO } else { libc::SO_SNDTIMEO };
        let (mut timeout, budget) = crate::wait::CallTimeout::new(fd, opt, start, budget);
        let spin_end = start + budget;
        // Signals are held from the first microseconds of the spin on, and between
        // sleeps, when a handler could end this call; each sleep's mask lets them
        // through (see `sigmask`).
        let mut signals = crate::sigmask::WaitSignals::default();
        let mut spins = 0u32;
        // The clock every 16 turns: the turn is what a waiting reader's latency is
        // made of; the pending signals (a system call) every 64.
        loop {
            if spins.is_multiple_of(16) {
                let now = Instant::now();
                if now >= spin_end {
                    break;
                }
                signals.spun(now - start);
            }
            spins = spins.wrapping_add(1);
            self.pump_remote();
            if ready(self) {
                self.learn(start, false);
                return Waited::Ready;
            }
            if spins.is_multiple_of(64) && signals.signal_waits() {
                break;
            }
            std::hint::spin_loop();
        }
        let mask = signals.sleep_mask();
        let deadline = timeout.deadline();
        loop {
            self.announce(rx, !rx);
            if ready(self) {
                self.learn(start, true);
                return Waited::Ready;
            }
            let mut ms = 100; // safety net against a wake-up taken by another waiter
            if let Some(d) = deadline {
                let now = Instant::now();
                if now >= d {
                    return Waited::Timeout;
                }
                ms = ms.min((d - now).as_millis() as c_int + 1);
            }
            let mut p = [
                libc::pollfd { fd: self.bell_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.hup_fd(fd), events: libc::POLLRDHUP, revents: 0 },
                libc::pollfd { fd: self.remote_fd().unwrap_or(-1), events: libc::POLLIN, revents: 0 },
            ];
            let r = crate::wait::kernel_poll(&mut p, ms, mask);
            let interrupted = r < 0 && real::errno() == libc::EINTR;
            self.pump_remote();
            if interrupted && !signal_restarts(deadline.is_some()) {
                return Waited::Interrupted;
            }
            if r > 0 {
                if p[0].revents != 0 {
                    self.after_bell(p[0].fd);
                }
                self.hung_up(p[1].revents);
            }
        }
    }

    /// Tells the spin policy how a wait that began at `start` ended.
    fn learn(&self, start: Instant, slept: bool) {
        self.spin.record(WaitOutcome { waited: start.elapsed(), slept });
    }

    /// Connector only: waits (bounded) until the acceptor attached or gave up,
    /// answering an acceptor that asks directly (path B). True if the connection is
    /// carried by shared memory from now on.
    pub fn settle(&self, fd: c_int) -> bool {
        // (Without a deadline or signals it returns only once decided.)
        matches!(self.settle_within(fd, None, false), SettleWait::Decided(true))
    }

    /// As [`Conn::settle`], for a program's call: giving up at `deadline` (the
    /// socket's SO_RCVTIMEO or SO_SNDTIMEO from the call's start: the kernel's
    /// call would have returned EAGAIN by then), and, if `interruptible`, when a
    /// signal came whose handler would not have the kernel restart the call (its
    /// EINTR; the handler itself ran in the wait).
    pub fn settle_within(&self, fd: c_int, deadline: Option<Instant>, interruptible: bool) -> SettleWait {
        loop {
            if let Some(ok) = self.try_settle(fd) {
                return SettleWait::Decided(ok);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return SettleWait::TimedOut;
            }
            let listener =
                self.pending.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(-1, |p| p.listener);
            let mut fds = [
                libc::pollfd { fd: self.bell_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: listener, events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: two pollfds on the stack (a negative fd is ignored).
            let r = unsafe { real::poll(fds.as_mut_ptr(), 2, 5) };
            if r < 0
                && interruptible
                && real::errno() == libc::EINTR
                && !crate::wait::signal_restarts(deadline.is_some())
            {
                return SettleWait::Interrupted;
            }
            if r > 0 && fds[0].revents != 0 {
                self.after_bell(fds[0].fd);
            }
        }
    }

    /// When a connector still waiting for its acceptor gives up (then: the kernel);
    /// `None` once settled. A sleep that may have to decide wakes by then.
    pub fn attach_deadline(&self) -> Option<Instant> {
        if !self.awaiting_attach() {
            return None;
        }
        self.pending.try_lock().ok()?.as_ref().map(|p| p.deadline)
    }

    /// True while a connector waits for its acceptor to attach.
    pub fn awaiting_attach(&self) -> bool {
        self.awaiting.load(Ordering::Acquire)
    }

    /// Connector only, without waiting: `Some(true)` once the acceptor attached,
    /// `Some(false)` once the connection stays with the kernel (the deadline passed),
    /// `None` while it is still open (a non-blocking socket's calls then answer
    /// EAGAIN, and poll/epoll report nothing for it).
    pub fn try_settle(&self, fd: c_int) -> Option<bool> {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let Some(p) = pending.as_mut() else { return Some(self.attached()) };
        let mut st = self.state();
        if st == PENDING && p.listener >= 0 && fd >= 0 {
            // Path B: an acceptor that did not get our hello asks us.
            let with =
                if self.my_efd >= 0 { ServeWith::Own([self.my_efd, self.peer_efd]) } else { ServeWith::Pair };
            if let Some((c, offer)) = p.serve(fd, with, self.vault) {
                if let Some(o) = offer {
                    self.offer(o);
                }
                if p.asked >= 0 {
                    // SAFETY: our socket.
                    unsafe { real::close(p.asked) };
                }
                p.asked = c;
            }
            st = self.state();
        }
        if st == PENDING {
            let now = Instant::now();
            if now < p.deadline {
                return None;
            }
            // Without the program's descriptor the handshake cannot be looked at:
            // the program's next call decides.
            if fd < 0 || p.acceptor_pending(fd, now) {
                return None;
            }
            st = match self.shm.state().compare_exchange(PENDING, KERNEL, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => KERNEL,
                Err(now) => now,
            };
        }
        let p = pending.take()?;
        self.awaiting.store(false, Ordering::Release);
        AWAITING.fetch_sub(1, Ordering::Relaxed);
        if st == ATTACHED_B && p.asked >= 0 {
            // The acceptor that asked is the peer a rendezvous may write into (the
            // marker's holder, who got the hello first, is not).
            let pid = crate::trust::peer_cred(p.asked).map_or(0, |c| c.pid);
            self.rv_peer.store(pid, Ordering::Relaxed);
        }
        // The marker link, the path-B name and the asker's socket all go: the TCP
        // socket tells from now on whether the peer lives.
        p.close();
        Some(st == ATTACHED || st == ATTACHED_B)
    }

    /// Connector only, for the shedding under descriptor pressure: a connection still
    /// waiting for its acceptor stays with the kernel, and what it held for the
    /// wait closes now; its next use settles it there. False if it was decided
    /// already.
    pub fn shed_pending(&self) -> bool {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let Some(p) = pending.as_mut() else { return false };
        if self.shm.state().compare_exchange(PENDING, KERNEL, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return false;
        }
        p.close_now();
        true
    }

    /// Reads into the iovecs. `Ok(0)` is end of stream.
    pub fn recv(
        &self,
        fd: c_int,
        iov: &[(*mut u8, usize)],
        peek: bool,
        dontwait: bool,
        waitall: bool,
    ) -> Result<usize, IoErr> {
        let want: usize = iov.iter().map(|v| v.1).sum();
        if want == 0 {
            return Ok(0);
        }
        if self.awaiting_attach() {
            return Err(IoErr::Again);
        }
        if self.messages() {
            return self.recv_message(fd, iov, peek, dontwait, waitall);
        }
        let nonblock = dontwait || self.nonblock.load(Ordering::Relaxed);
        // A non-blocking read that finds nothing (an event loop's last read before
        // EAGAIN, a busy-polling reader) answers without the locks: nothing would be
        // consumed under them, and they cost four atomic operations per call.
        if nonblock && matches!(self.shm.ring(self.rx()).readable(), Ok(s) if s.len == 0) && !self.rx_eof() {
            // The next bytes' line is fetched now, beside the tail's, so that the read
            // that finds them does not wait for it after the tail (two lines the
            // writer's core wrote, one after the other).
            self.shm.ring(self.rx()).prefetch_head();
            if let Some(r) = self.nonblocking_result(fd, 0) {
                return r;
            }
        }
        if !waitall && self.rv_posted.load(Ordering::Relaxed) == 0 {
            if let Some(n) = self.read_step(iov, 0, want, peek)? {
                return Ok(n);
            }
        }
        let _g = self.rlock.lock().unwrap_or_else(|e| e.into_inner());
        let mut got = 0usize;
        loop {
            // A writer took the buffer this read posted: its bytes are the next.
            if self.rv_posted.load(Ordering::Relaxed) != 0 {
                if let Some(n) = self.take_rendezvous(fd)? {
                    return Ok(n);
                }
            }
            if let Some(take) = self.read_step(iov, got, want - got, peek)? {
                if peek {
                    return Ok(take);
                }
                got += take;
                if got == want || !waitall || nonblock {
                    return Ok(got);
                }
                continue;
            }
            if self.rx_eof() {
                return Ok(got);
            }
            if got > 0 && !waitall {
                return Ok(got);
            }
            if nonblock {
                match self.nonblocking_result(fd, got) {
                    Some(r) => return r,
                    None => continue,
                }
            }
            // Nothing unread and one buffer large enough: a writer may copy its bytes
            // straight into it (one copy instead of two). Not for MSG_WAITALL (a
            // rendezvous ends the read with the bytes it brought) nor a bridged
            // connection (no peer process to write into us).
            let posted = got == 0
                && !peek
                && !waitall
                && iov.len() == 1
                && want >= Settings::get().rendezvous_min
                && CMA_OK.load(Ordering::Relaxed)
                && self.remote.get().is_none()
                && self.post(iov[0].0, iov[0].1);
            let waited = self.wait(fd, true, &|c| {
                c.shm.ring(c.rx()).prefetch_head();
                matches!(c.avail(), Ok((_, n)) if n > 0)
                    || c.rx_eof()
                    || c.avail().is_err()
                    || (posted
                        && matches!(
                            c.w(c.rx(), RV_STATE).load(Ordering::Acquire),
                            RV_DONE_STATE | RV_OFFERED
                        ))
            });
            if posted && !self.unpost() {
                // A writer took the post: its bytes come first, whatever else came.
                continue;
            }
            match waited {
                Waited::Ready => {}
                Waited::Timeout if got == 0 => return Err(IoErr::Again),
                Waited::Interrupted if got == 0 => return Err(IoErr::Intr),
                _ => return Ok(got),
            }
        }
    }

    /// One step of a read: up to `want` bytes into the caller's segments from their
    /// byte `skip` on, under the step lock (`None`: nothing waits). Called first
    /// without this process's read lock, for a read that finds bytes waiting (then
    /// the read goes no further). The step lock in
    /// the mapping keeps it from interleaving with any other reader's step; between
    /// the steps of another thread's read (waiting for the rest of a MSG_WAITALL
    /// read) it may take the next bytes, as a second reader of a kernel socket may
    /// while the first waits (the kernel lets go of the socket's lock to wait). A
    /// read of this process that posted a buffer for a rendezvous is never overtaken
    /// (the caller checked that none is posted). The read lock was two locked
    /// instructions on the path from the bytes' arrival to the program.
    #[inline]
    fn read_step(
        &self,
        iov: &[(*mut u8, usize)],
        skip: usize,
        want: usize,
        peek: bool,
    ) -> Result<Option<usize>, IoErr> {
        let lock = self.step_lock(self.rx(), RLOCK)?;
        let (head, n) = self.avail()?;
        if n == 0 {
            return Ok(None);
        }
        strait_probe::probe!(strait_probe::Stage::RingFound);
        let take = (n as usize).min(want);
        self.copy_out(head, skip, take, iov);
        if peek {
            return Ok(Some(take));
        }
        self.shm.ring(self.rx()).consume_to(head + take as u64);
        drop(lock);
        strait_probe::probe!(strait_probe::Stage::RingConsumed);
        self.wake_if(self.w(self.rx(), WSLEEP));
        if let Some(b) = self.remote.get() {
            b.after_read();
        }
        Ok(Some(take))
    }

    /// Walks `len` bytes of the caller's segments (pointer, length) from byte `skip`
    /// of them: `f(ring position, caller address, bytes)` for each piece, the ring
    /// positions from `pos` on (the ring splits a piece at its end).
    fn walk<P: Address>(
        pos: u64,
        segs: &[(P, usize)],
        skip: usize,
        len: usize,
        mut f: impl FnMut(u64, usize, usize),
    ) {
        let (mut pos, mut skip, mut left) = (pos, skip, len);
        for &(p, l) in segs {
            if left == 0 {
                break;
            }
            if skip >= l {
                skip -= l;
                continue;
            }
            let n = (l - skip).min(left);
            f(pos, p.address() + skip, n);
            skip = 0;
            left -= n;
            pos += n as u64;
        }
    }

    fn copy_out(&self, head: u64, skip: usize, len: usize, iov: &[(*mut u8, usize)]) {
        let ring = self.shm.ring(self.rx());
        Self::walk(head, iov, skip, len, |pos, user, n| {
            // SAFETY: `n` bytes of the caller's buffer, within one of its segments
            // (the read or recv call's contract makes them ours to write).
            let dst = unsafe { std::slice::from_raw_parts_mut(user as *mut u8, n) };
            ring.read_at(pos, dst);
        });
    }

    /// A write on a connector whose acceptor has not attached yet (a kernel socket
    /// takes bytes before the accept, and a client's request then waits for the
    /// server instead of the server waiting for the request): the bytes go to the
    /// kernel socket first, then the same bytes to the ring. Whichever way the
    /// connection settles, its reader finds every byte once and in order: attached,
    /// the acceptor reads the ring and discards the kernel's copy; on the kernel
    /// (the connector gave up waiting, or its acceptor could not prove it because
    /// it closed or exited meanwhile), the kernel socket has them, and the ring's
    /// copy is never read. The producer step lock is held across both copies, so
    /// two processes sharing the socket cannot order them differently.
    pub fn send_early(&self, fd: c_int, iov: &[(*const u8, usize)], flags: c_int) -> Early {
        if Settings::get().messages || self.remote.get().is_some() || flags & libc::MSG_OOB != 0 {
            return Early::NotNow;
        }
        let want: usize = iov.iter().map(|v| v.1).sum();
        let _g = self.wlock.lock().unwrap_or_else(|e| e.into_inner());
        if want == 0 || self.wr_shut.load(Ordering::Relaxed) || self.tx_broken() {
            return Early::NotNow;
        }
        // Under the pending lock our side cannot decide meanwhile (the deadline's
        // fall back to the kernel is taken under it).
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if pending.is_none() || self.state() != PENDING {
            return Early::NotNow;
        }
        let Ok(lock) = self.step_lock(self.tx(), WLOCK) else { return Early::NotNow };
        let Ok((tail, room)) = self.room_for(want, &lock) else { return Early::NotNow };
        let n = (room as usize).min(want);
        let nonblock = flags & libc::MSG_DONTWAIT != 0 || self.nonblock.load(Ordering::Relaxed);
        if n == 0 || (n < want && !nonblock) {
            return Early::NotNow;
        }
        // Said before the kernel's copy exists, so an acceptor that attaches after it
        // sees it no later than at its close (the discard then).
        self.shm.word(OFF_EARLY).store(1, Ordering::Release);
        // The first `n` bytes, never blocking here: a blocking write the kernel
        // cannot take whole settles first instead. SIGPIPE is the caller's to raise
        // (as for the ring's EPIPE).
        let k = crate::sock::kernel_sendmsg(fd, iov, n, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
        if k < 0 {
            let e = real::errno();
            if e == libc::EAGAIN && !nonblock {
                return Early::NotNow;
            }
            if e == libc::EPIPE && flags & libc::MSG_NOSIGNAL == 0 {
                // SAFETY: sends SIGPIPE to this thread, as the kernel would.
                unsafe { libc::raise(libc::SIGPIPE) };
            }
            real::set_errno(e);
            return Early::Kernel;
        }
        let k = k as usize;
        self.copy_in(tail, iov, 0, k);
        self.publish(&lock, tail + k as u64);
        drop(lock);
        // An acceptor may have attached meanwhile and gone to sleep waiting for
        // these bytes: the same wake-up as any write.
        self.wake_if(self.w(self.tx(), RSLEEP));
        // (Short of a blocking write's whole: the rest after settling.)
        Early::Sent(k)
    }

    /// A connector waiting for its acceptor can write now: the kernel's connect
    /// completed (one `poll` of the kernel socket until it has) and the ring has room.
    fn early_writable(&self, fd: c_int) -> bool {
        if fd < 0 || Settings::get().messages || !matches!(self.room(), Ok((_, r)) if r > 0) {
            return false;
        }
        if self.kernel_connected.load(Ordering::Relaxed) {
            return true;
        }
        let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
        // SAFETY: one pollfd on the stack; not waiting.
        let connected = unsafe {
            real::poll(&mut p, 1, 0) == 1
                && p.revents & libc::POLLOUT != 0
                && p.revents & (libc::POLLERR | libc::POLLHUP) == 0
        };
        // (A later error of the kernel socket is the early write's answer.)
        self.kernel_connected.store(connected, Ordering::Relaxed);
        connected
    }

    /// Acceptor: discards what the connector wrote to the kernel socket before we
    /// attached ([`Conn::send_early`]); the ring has the same bytes. Costs nothing
    /// unless the connector said it wrote early. Also before the socket's close:
    /// unread bytes there would make the kernel send a reset.
    pub fn discard_early_copy(&self, fd: c_int) {
        if self.side != 1 || fd < 0 || self.shm.word(OFF_EARLY).load(Ordering::Acquire) == 0 {
            return;
        }
        for _ in 0..64 {
            // SAFETY: MSG_TRUNC on TCP drops queued bytes without copying them; the
            // buffer is never written.
            let n = unsafe {
                real::recv(fd, std::ptr::null_mut(), 1 << 30, libc::MSG_TRUNC | libc::MSG_DONTWAIT)
            };
            if n <= 0 {
                return;
            }
        }
    }

    /// Writes from the iovecs (all of it when blocking).
    pub fn send(&self, fd: c_int, iov: &[(*const u8, usize)], dontwait: bool) -> Result<usize, IoErr> {
        let want: usize = iov.iter().map(|v| v.1).sum();
        if let Some(n) = self.send_now(iov, want)? {
            return Ok(n);
        }
        let _g = self.wlock.lock().unwrap_or_else(|e| e.into_inner());
        if self.wr_shut.load(Ordering::Relaxed) || self.tx_broken() {
            return Err(IoErr::Pipe);
        }
        if want == 0 {
            return Ok(0);
        }
        if self.awaiting_attach() {
            return Err(IoErr::Again);
        }
        if self.messages() {
            return self.send_message(fd, iov, want, dontwait);
        }
        let nonblock = dontwait || self.nonblock.load(Ordering::Relaxed);
        // (A split makes the write wait for the reader: blocking writes only.)
        let may_split = (!nonblock).then_some(fd);
        let mut sent = 0usize;
        loop {
            if self.tx_broken() {
                return if sent > 0 { Ok(sent) } else { Err(IoErr::Pipe) };
            }
            let lock = self.step_lock(self.tx(), WLOCK)?;
            if sent == 0 && self.rendezvous_offered(want) {
                // A reader waits with a large buffer: if the ring is empty (the exact
                // room, not the cached one), the first bytes go straight into it.
                let (_, room) = self.room()?;
                let moved = if room as usize == self.shm.ring {
                    self.rendezvous(iov, want, false, may_split)
                } else {
                    0
                };
                if moved > 0 {
                    drop(lock);
                    self.wake_if(self.w(self.tx(), RSLEEP));
                    self.ring_bell_always();
                    sent = moved;
                    if sent == want {
                        return Ok(sent);
                    }
                    continue;
                }
            }
            let (tail, room) = self.room_for(want - sent, &lock)?;
            if room == 0 {
                drop(lock);
                if nonblock {
                    return self.nonblocking_result(fd, sent).unwrap_or(Err(IoErr::Pipe));
                }
                match self.wait(fd, false, &|c| matches!(c.room(), Ok((_, r)) if r > 0) || c.tx_broken()) {
                    Waited::Ready => continue,
                    Waited::Timeout if sent == 0 => return Err(IoErr::Again),
                    Waited::Interrupted if sent == 0 => return Err(IoErr::Intr),
                    _ => return Ok(sent),
                }
            }
            let chunk = (room as usize).min(want - sent);
            self.write_step(lock, tail, iov, sent, chunk);
            sent += chunk;
            if sent == want {
                return Ok(sent);
            }
        }
    }

    /// A byte-stream write that fits the room there is (by the head last seen), in
    /// one step and without this process's write lock (`None`: it does not, or it
    /// is for a message, a rendezvous or a connection still settling; the write goes
    /// the whole way). The step lock in the mapping keeps it from interleaving with
    /// any other writer's step; between the steps of another thread's write that
    /// waits for room it may put its bytes, as a second writer of a kernel socket
    /// may while the first waits for buffer space. The write lock was two locked
    /// instructions on the path from the program's write to the bytes' publication.
    #[inline]
    fn send_now(&self, iov: &[(*const u8, usize)], want: usize) -> Result<Option<usize>, IoErr> {
        if want == 0
            || want >= Settings::get().rendezvous_min
            || self.wr_shut.load(Ordering::Relaxed)
            || self.awaiting_attach()
            || self.messages()
        {
            return Ok(None);
        }
        let lock = self.step_lock(self.tx(), WLOCK)?;
        if self.tx_broken() {
            return Ok(None);
        }
        let (tail, room) = self.room_for(want, &lock)?;
        if (room as usize) < want {
            return Ok(None);
        }
        self.write_step(lock, tail, iov, 0, want);
        Ok(Some(want))
    }

    /// One step of a write, under the producer lock `lock` (let go here): `len`
    /// bytes of the caller's segments from their byte `skip` on, copied in at `tail`
    /// (inside the room the caller found) and published; then the reader is woken if
    /// it sleeps.
    fn write_step(&self, lock: StepLock, tail: u64, iov: &[(*const u8, usize)], skip: usize, len: usize) {
        self.copy_in(tail, iov, skip, len);
        self.publish(&lock, tail + len as u64);
        drop(lock);
        strait_probe::probe!(strait_probe::Stage::RingPublished);
        self.wake_if(self.w(self.tx(), RSLEEP));
        if let Some(b) = self.remote.get() {
            b.push_inline();
        }
    }

    /// True once both ends agreed on message mode. Only if this process asked for
    /// it (`STRAIT_MESSAGES`); the peer's agreement is read once, after the attach
    /// published it, and kept here: a peer that rewrites the word later changes
    /// nothing.
    pub fn messages(&self) -> bool {
        if !Settings::get().messages {
            return false;
        }
        if let Some(&m) = self.mode.get() {
            return m;
        }
        let agreed = self.shm.word(OFF_MODE).load(Ordering::Acquire) & MODE_AGREED != 0;
        if self.attached() {
            *self.mode.get_or_init(|| agreed)
        } else {
            agreed
        }
    }

    /// The length header of the message at `head` of our receive ring.
    fn peek_header(&self, head: u64) -> u64 {
        let mut h = [0u8; MSG_HDR];
        self.copy_out(head, 0, MSG_HDR, &[(h.as_mut_ptr(), MSG_HDR)]);
        u64::from_le_bytes(h)
    }

    /// A rendezvous that completed: its byte count (the post is free again). Waits
    /// out a writer that is copying, as a blocked read would (its timeouts and
    /// signals apply; no spinning). A completion we did not post for, or one that
    /// claims more bytes than we posted, is the peer breaking the protocol: reset.
    fn take_rendezvous(&self, fd: c_int) -> Result<Option<usize>, IoErr> {
        let st = self.w(self.rx(), RV_STATE);
        let mut give_up = None;
        loop {
            match st.load(Ordering::Acquire) {
                RV_DONE_STATE => {
                    let posted = self.rv_posted.swap(0, Ordering::Relaxed);
                    let n = self.w(self.rx(), RV_DONE).load(Ordering::Relaxed);
                    st.store(RV_IDLE, Ordering::Release);
                    if posted == 0 || n > posted as u64 {
                        self.peer_dead.store(true, Ordering::Relaxed);
                        return Err(IoErr::Reset);
                    }
                    return Ok(Some(n as usize));
                }
                s @ (RV_FILLING | RV_OFFERED | RV_READ_STATE | RV_READING) => {
                    if self.rv_posted.load(Ordering::Relaxed) == 0 {
                        // Nothing of ours is being filled: not a state a writer of
                        // ours leaves.
                        self.peer_dead.store(true, Ordering::Relaxed);
                        return Err(IoErr::Reset);
                    }
                    if s == RV_OFFERED && self.read_split()? {
                        continue;
                    }
                    if self.check_peer(fd) {
                        return Err(IoErr::Reset);
                    }
                    // (An offer this read cannot take waits to be withdrawn.) The
                    // read does not end while a writer fills its buffer: the
                    // program would get the buffer back while another process
                    // still writes into it. A signal or the timeout only start a
                    // grace; a writer that holds the post past it is not copying
                    // (a peer that only wrote the state word): reset.
                    // (A writer that died never moves the state: its hang-up
                    // ends the wait, and `check_peer` then the read.)
                    if let Waited::Timeout | Waited::Interrupted = self.wait(fd, true, &|c| {
                        c.w(c.rx(), RV_STATE).load(Ordering::Acquire) != s
                            || c.peer_dead.load(Ordering::Relaxed)
                    }) {
                        let now = Instant::now();
                        if now >= *give_up.get_or_insert(now + SPLIT_READ_GRACE) {
                            // A writer stopped in the middle (a debugger, job
                            // control) restarts the grace: it will finish once it
                            // runs again.
                            if peer_stopped(self.rv_peer.load(Ordering::Relaxed)) {
                                give_up = Some(now + SPLIT_READ_GRACE);
                                continue;
                            }
                            self.peer_dead.store(true, Ordering::Relaxed);
                            return Err(IoErr::Reset);
                        }
                    }
                }
                _ => return Ok(None),
            }
        }
    }

    /// A split offered for the buffer this read posted: reads its first part from
    /// the writer's buffer (`process_vm_readv`, from the process the kernel named
    /// at setup only, into our posted buffer only), then says how many bytes it
    /// read. False if the offer is not one to take (then it waits to be
    /// withdrawn). An offer revoked while we read (we took longer than the writer
    /// waits) voids the connection: the writer's buffer may have changed under us.
    fn read_split(&self) -> Result<bool, IoErr> {
        let d = self.rx();
        let st = self.w(d, RV_STATE);
        let cut = self.w(d, RV_CUT).load(Ordering::Relaxed);
        let src = self.w(d, RV_SRC).load(Ordering::Relaxed);
        let writer = self.rv_peer.load(Ordering::Relaxed);
        let posted = self.rv_posted.load(Ordering::Relaxed) as u64;
        let buf = self.rv_buf.load(Ordering::Relaxed);
        if cut == 0
            || cut > posted
            || buf == 0
            || writer <= 0
            || self.w(d, RV_WPID).load(Ordering::Relaxed) != writer as u64
            || st.compare_exchange(RV_OFFERED, RV_READING, Ordering::AcqRel, Ordering::Acquire).is_err()
        {
            return Ok(false);
        }
        let local = libc::iovec { iov_base: buf as *mut c_void, iov_len: cut as usize };
        let remote = libc::iovec { iov_base: src as *mut c_void, iov_len: cut as usize };
        // SAFETY: writes only our own posted buffer (its address and length are
        // ours, not the shared words); reads the writer's process, which the kernel
        // checks.
        let n = unsafe { libc::process_vm_readv(writer, &local, 1, &remote, 1, 0) };
        let read = if n as u64 == cut { cut } else { 0 };
        self.w(d, RV_READ).store(read, Ordering::Relaxed);
        if st.compare_exchange(RV_READING, RV_READ_STATE, Ordering::AcqRel, Ordering::Acquire).is_err() {
            self.peer_dead.store(true, Ordering::Relaxed);
            return Err(IoErr::Reset);
        }
        self.wake_if(self.w(d, WSLEEP));
        Ok(true)
    }

    /// Posts the reader's buffer for a writer to fill; false if another post
    /// stands (a reader of another process sharing the connection).
    fn post(&self, buf: *mut u8, len: usize) -> bool {
        let d = self.rx();
        let st = self.w(d, RV_STATE);
        if st.compare_exchange(RV_IDLE, RV_POSTING, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return false;
        }
        self.rv_posted.store(len, Ordering::Relaxed);
        self.rv_buf.store(buf as usize, Ordering::Relaxed);
        self.w(d, RV_ADDR).store(buf as u64, Ordering::Relaxed);
        self.w(d, RV_LEN).store(len as u64, Ordering::Relaxed);
        self.w(d, RV_PID).store(process_id(), Ordering::Relaxed);
        st.store(RV_POSTED, Ordering::Release);
        true
    }

    /// Takes a post back; false if a writer already took it (then it completes).
    fn unpost(&self) -> bool {
        let back = self
            .w(self.rx(), RV_STATE)
            .compare_exchange(RV_POSTED, RV_IDLE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if back {
            self.rv_posted.store(0, Ordering::Relaxed);
        }
        back
    }

    /// Message mode: reads bytes of one message.
    fn recv_message(
        &self,
        fd: c_int,
        iov: &[(*mut u8, usize)],
        peek: bool,
        dontwait: bool,
        waitall: bool,
    ) -> Result<usize, IoErr> {
        let want: usize = iov.iter().map(|v| v.1).sum();
        let _g = self.rlock.lock().unwrap_or_else(|e| e.into_inner());
        let nonblock = dontwait || self.nonblock.load(Ordering::Relaxed);
        let mut got = 0usize;
        loop {
            if got == 0 && !peek {
                if let Some(n) = self.take_rendezvous(fd)? {
                    return Ok(n);
                }
            }
            let lock = self.step_lock(self.rx(), RLOCK)?;
            let (mut head, mut n) = self.avail()?;
            let mut left = self.w(self.rx(), MSG_LEFT).load(Ordering::Relaxed);
            let mut skip = 0u64;
            if left == 0 && got == 0 && n > MSG_HDR as u64 {
                left = self.peek_header(head);
                if left == 0 || left > 1 << 40 {
                    // Not a length a writer of ours would send.
                    self.peer_dead.store(true, Ordering::Relaxed);
                    return Err(IoErr::Reset);
                }
                if peek {
                    skip = MSG_HDR as u64;
                } else {
                    head += MSG_HDR as u64;
                    self.shm.ring(self.rx()).consume_to(head);
                    self.w(self.rx(), MSG_LEFT).store(left, Ordering::Relaxed);
                }
                n -= MSG_HDR as u64;
            }
            if left > 0 && n > 0 {
                let take = (left.min(n) as usize).min(want - got);
                self.copy_out(head + skip, got, take, iov);
                if peek {
                    return Ok(take);
                }
                self.shm.ring(self.rx()).consume_to(head + take as u64);
                self.w(self.rx(), MSG_LEFT).store(left - take as u64, Ordering::Relaxed);
                drop(lock);
                self.wake_if(self.w(self.rx(), WSLEEP));
                got += take;
                // Only more of the same message, and only for MSG_WAITALL.
                if got == want || !waitall || left == take as u64 || nonblock {
                    return Ok(got);
                }
                continue;
            }
            drop(lock);
            if self.rx_eof() {
                return Ok(got);
            }
            if nonblock {
                match self.nonblocking_result(fd, got) {
                    Some(r) => return r,
                    None => continue,
                }
            }
            // Nothing unread and one buffer large enough: let a writer fill it.
            let posted = got == 0
                && !peek
                && left == 0
                && n == 0
                && iov.len() == 1
                && want >= Settings::get().rendezvous_min
                && CMA_OK.load(Ordering::Relaxed)
                && self.post(iov[0].0, iov[0].1);
            let waited = self.wait(fd, true, &|c| {
                matches!(c.avail(), Ok((_, n)) if n > 0)
                    || c.rx_eof()
                    || c.avail().is_err()
                    || c.w(c.rx(), RV_STATE).load(Ordering::Acquire) == RV_DONE_STATE
            });
            if posted && !self.unpost() {
                // A writer took the post: its message is next, whatever else came.
                continue;
            }
            match waited {
                Waited::Ready => {}
                Waited::Timeout if got == 0 => return Err(IoErr::Again),
                Waited::Interrupted if got == 0 => return Err(IoErr::Intr),
                _ => return Ok(got),
            }
        }
    }

    /// Whether a write of `want` bytes may go by rendezvous now: large enough, cross
    /// memory attach not refused before, and a reader's buffer posted (a load of the
    /// posting word, before the caller looks at the ring).
    fn rendezvous_offered(&self, want: usize) -> bool {
        want >= Settings::get().rendezvous_min
            && CMA_OK.load(Ordering::Relaxed)
            && self.w(self.tx(), RV_STATE).load(Ordering::Acquire) == RV_POSTED
    }

    /// Copies the first bytes of a write straight into a posted reader buffer: the
    /// whole message (message mode, `whole`: only if the buffer takes it all), or as
    /// many bytes as the buffer takes (byte stream). The bytes moved (0: none). The
    /// caller saw a post offered ([`Conn::rendezvous_offered`]), holds the producer
    /// lock and found the ring empty, so these bytes are the next the reader gets.
    ///
    /// `fd`: a blocking byte-stream write, which may **split** a large transfer:
    /// the reader reads the first
    /// half from our buffer while we write the second half into its buffer, one
    /// copy of each byte on each core (`process_vm_writev` of 1 MiB runs at ~10
    /// GB/s here). The write then returns only once the reader is done with our
    /// buffer ([`Conn::finish_split`]).
    fn rendezvous(&self, iov: &[(*const u8, usize)], want: usize, whole: bool, fd: Option<c_int>) -> usize {
        let d = self.tx();
        let st = self.w(d, RV_STATE);
        let posted = self.w(d, RV_LEN).load(Ordering::Relaxed) as usize;
        let want = if whole { want } else { want.min(posted) };
        if posted < want
            || want == 0
            || st.compare_exchange(RV_POSTED, RV_FILLING, Ordering::AcqRel, Ordering::Acquire).is_err()
        {
            return 0;
        }
        // Only into the process the kernel named at setup ([`Carriers::peer_pid`]):
        // the pid word in shared memory merely has to agree (a forked reader of the
        // peer's is served through the ring).
        let peer = self.rv_peer.load(Ordering::Relaxed);
        let pid = match peer {
            p if p > 0 && p as u64 == self.w(d, RV_PID).load(Ordering::Relaxed) => p,
            _ => {
                st.store(RV_POSTED, Ordering::Release);
                return 0;
            }
        };
        let addr = self.w(d, RV_ADDR).load(Ordering::Relaxed) as usize;
        // The reader's part of a split: half, cut at a page, from our first segment
        // (the reader is given one address).
        let cut = match fd {
            Some(_) if !whole && want >= SPLIT_MIN => {
                Some((want / 2) & !4095).filter(|&c| c > 0 && iov.first().is_some_and(|v| v.1 >= c))
            }
            _ => None,
        };
        if let Some(c) = cut {
            self.w(d, RV_SRC).store(iov[0].0 as u64, Ordering::Relaxed);
            self.w(d, RV_CUT).store(c as u64, Ordering::Relaxed);
            self.w(d, RV_WPID).store(process_id(), Ordering::Relaxed);
            st.store(RV_OFFERED, Ordering::Release);
            // A sleeping reader wakes while we copy our part; if it is not reading
            // by the end of that, we copy its part too.
            self.wake_if(self.w(d, RSLEEP));
        }
        let from = cut.unwrap_or(0);
        if !write_into(pid, iov, from, want - from, addr.wrapping_add(from)) {
            // Refused (no ptrace permission) or cut short: the ring from now on; the
            // reader's buffer holds nothing it will report.
            CMA_OK.store(false, Ordering::Relaxed);
            if cut.is_none() || self.finish_split(fd, pid, iov, addr) {
                st.store(RV_POSTED, Ordering::Release);
            }
            return 0;
        }
        if cut.is_some() && !self.finish_split(fd, pid, iov, addr) {
            return 0;
        }
        self.w(d, RV_DONE).store(want as u64, Ordering::Relaxed);
        st.store(RV_DONE_STATE, Ordering::Release);
        RENDEZVOUS.fetch_add(1, Ordering::Relaxed);
        want
    }

    /// The end of a split, once our own part is written: takes the offer back if
    /// the reader has not taken it (it sleeps, or cannot read us) and writes that
    /// part too; else waits until the reader is done with our buffer (we must not
    /// return it to the program before), writing the part ourselves if its read
    /// failed. True when the reader's part is in its buffer. A reader that reads
    /// for longer than [`SPLIT_READ_GRACE`] (it stopped in the middle, or it is
    /// not reading at all but wrote the state word) loses the connection: false,
    /// the connection broken.
    fn finish_split(
        &self,
        fd: Option<c_int>,
        pid: libc::pid_t,
        iov: &[(*const u8, usize)],
        addr: usize,
    ) -> bool {
        let d = self.tx();
        let st = self.w(d, RV_STATE);
        let cut = self.w(d, RV_CUT).load(Ordering::Relaxed) as usize;
        let mut give_up = None;
        loop {
            match st.load(Ordering::Acquire) {
                RV_OFFERED => {
                    if st
                        .compare_exchange(RV_OFFERED, RV_FILLING, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        return write_into(pid, iov, 0, cut, addr);
                    }
                }
                RV_READ_STATE => {
                    st.store(RV_FILLING, Ordering::Relaxed);
                    if self.w(d, RV_READ).load(Ordering::Relaxed) == cut as u64 {
                        SPLITS.fetch_add(1, Ordering::Relaxed);
                        return true;
                    }
                    return write_into(pid, iov, 0, cut, addr);
                }
                RV_READING => {
                    // Signals and SO_SNDTIMEO do not end this wait (our buffer is
                    // being read); the grace does.
                    let now = Instant::now();
                    let start = *give_up.get_or_insert(now);
                    let dead = self.peer_dead.load(Ordering::Relaxed)
                        || fd.is_some_and(|fd| self.check_peer_now_and_then(fd));
                    if !dead && now >= start + SPLIT_READ_GRACE && peer_stopped(pid) {
                        // A reader stopped in the middle (a debugger, job control)
                        // is not a reader that stalls: the kernel's write would wait
                        // for it too. Its stop restarts the grace.
                        give_up = Some(now);
                        std::thread::sleep(STOPPED_PEER_NAP);
                        continue;
                    }
                    if dead || now >= start + SPLIT_READ_GRACE {
                        if st
                            .compare_exchange(RV_READING, RV_REVOKED, Ordering::AcqRel, Ordering::Acquire)
                            .is_ok()
                        {
                            self.peer_dead.store(true, Ordering::Relaxed);
                            return false;
                        }
                        continue;
                    }
                    // The reader copies for tens of microseconds: let it have the
                    // core if it shares ours, then nap, short enough to notice.
                    if now - start < SPLIT_SPIN {
                        // SAFETY: plain system call.
                        unsafe { libc::sched_yield() };
                    } else {
                        std::thread::sleep(SPLIT_NAP);
                    }
                }
                _ => {
                    // Not a state the reader leaves: the peer broke the protocol.
                    self.peer_dead.store(true, Ordering::Relaxed);
                    return false;
                }
            }
        }
    }

    /// Message mode: writes one message (all of it, or nothing when it would block).
    fn send_message(
        &self,
        fd: c_int,
        iov: &[(*const u8, usize)],
        want: usize,
        dontwait: bool,
    ) -> Result<usize, IoErr> {
        let nonblock = dontwait || self.nonblock.load(Ordering::Relaxed);
        let ring = self.shm.ring;
        let need = want + MSG_HDR;
        if need > ring && nonblock {
            return Err(IoErr::MsgSize);
        }
        let hdr = (want as u64).to_le_bytes();
        let mut parts: Vec<(*const u8, usize)> = Vec::with_capacity(iov.len() + 1);
        parts.push((hdr.as_ptr(), MSG_HDR));
        parts.extend(iov.iter().copied().filter(|v| v.1 > 0));
        // Bytes of `parts` written so far.
        let mut done = 0usize;
        // A message larger than the ring keeps the producer lock between its pieces,
        // so no other process's message lands inside it.
        let mut held: Option<StepLock<'_>> = None;
        loop {
            if self.tx_broken() {
                return Err(IoErr::Pipe);
            }
            let lock = match held.take() {
                Some(l) => l,
                None => self.step_lock(self.tx(), WLOCK)?,
            };
            let (tail, room) = self.room()?;
            if done == 0
                && room as usize == ring
                && self.rendezvous_offered(want)
                && self.rendezvous(iov, want, true, None) == want
            {
                drop(lock);
                self.wake_if(self.w(self.tx(), RSLEEP));
                self.ring_bell_always();
                return Ok(want);
            }
            // Whole small messages only; a large one in pieces, the header never alone.
            let fits = if need <= ring {
                room as usize >= need
            } else {
                room as usize > MSG_HDR.saturating_sub(done)
            };
            if !fits {
                if done > 0 {
                    held = Some(lock);
                } else {
                    drop(lock);
                }
                if nonblock && done == 0 {
                    return self.nonblocking_result(fd, 0).unwrap_or(Err(IoErr::Pipe));
                }
                let room_for = if done == 0 && need <= ring { need } else { 1 };
                // Once a message started it is finished: signals and timeouts wait.
                match self.wait(fd, false, &|c| {
                    matches!(c.room(), Ok((_, r)) if r as usize >= room_for) || c.tx_broken()
                }) {
                    Waited::Timeout if done == 0 => return Err(IoErr::Again),
                    Waited::Interrupted if done == 0 => return Err(IoErr::Intr),
                    _ => continue,
                }
            }
            let n = (room as usize).min(need - done);
            self.copy_in(tail, &parts, done, n);
            done += n;
            self.publish(&lock, tail + n as u64);
            if done < need {
                held = Some(lock);
            } else {
                drop(lock);
            }
            self.wake_if(self.w(self.tx(), RSLEEP));
            if done == need {
                return Ok(want);
            }
        }
    }

    /// Copies `len` bytes of `parts`, from byte `skip` of them, into our transmit
    /// ring at `tail`.
    fn copy_in(&self, tail: u64, parts: &[(*const u8, usize)], skip: usize, len: usize) {
        let ring = self.shm.ring(self.tx());
        Self::walk(tail, parts, skip, len, |pos, user, n| {
            // SAFETY: `n` bytes of the caller's data, within one of its segments (the
            // write or send call's contract makes them readable).
            let src = unsafe { std::slice::from_raw_parts(user as *const u8, n) };
            ring.write_at(pos, src);
        });
    }

    pub fn fionread(&self) -> usize {
        let Ok((head, n)) = self.avail() else { return 0 };
        if !self.messages() {
            return n as usize;
        }
        // The readable bytes of the next message.
        let left = self.w(self.rx(), MSG_LEFT).load(Ordering::Relaxed);
        if left > 0 {
            return left.min(n) as usize;
        }
        if n as usize <= MSG_HDR {
            return 0;
        }
        self.peek_header(head).min(n - MSG_HDR as u64) as usize
    }

    pub fn shutdown(&self, how: c_int) {
        if how == libc::SHUT_RD || how == libc::SHUT_RDWR {
            self.rd_shut.store(true, Ordering::Relaxed);
        }
        if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
            self.wr_shut.store(true, Ordering::Relaxed);
            self.w(self.tx(), WCLOSED).store(1, Ordering::Release);
            self.ring_bell_for_close();
            self.pump_remote();
        }
    }

    /// A `shutdown(how)` made while the connector waits for its acceptor: the
    /// kernel socket gets it if the connection ends on the kernel
    /// ([`Conn::deferred_kernel_shutdown`]), never if it attaches (the peer would
    /// take the kernel's FIN for its hang-up).
    pub fn defer_kernel_shutdown(&self, how: c_int) {
        let bits = match how {
            libc::SHUT_RD => 1,
            libc::SHUT_WR => 2,
            _ => 3,
        };
        self.kernel_shut.fetch_or(bits, Ordering::Relaxed);
    }

    /// The `how` of the shutdowns [`Conn::defer_kernel_shutdown`] kept, if any.
    pub fn deferred_kernel_shutdown(&self) -> Option<c_int> {
        match self.kernel_shut.load(Ordering::Relaxed) {
            1 => Some(libc::SHUT_RD),
            2 => Some(libc::SHUT_WR),
            3 => Some(libc::SHUT_RDWR),
            _ => None,
        }
    }

    /// The local shutdown state, for an `exec` handoff: bit 0 read side, bit 1 write
    /// side.
    pub fn shut_flags(&self) -> u8 {
        self.rd_shut.load(Ordering::Relaxed) as u8 | (self.wr_shut.load(Ordering::Relaxed) as u8) << 1
    }

    /// Restores [`Conn::shut_flags`] in the program an `exec` started.
    pub fn restore_shut_flags(&self, flags: u8) {
        self.rd_shut.store(flags & 1 != 0, Ordering::Relaxed);
        self.wr_shut.store(flags & 2 != 0, Ordering::Relaxed);
    }

    /// Gives back a hold taken with [`Conn::add_holder`] for a process that never
    /// started.
    pub fn drop_holder(&self) {
        self.shm.word(off_holders(self.side)).fetch_sub(1, Ordering::AcqRel);
    }

    /// Called before `fork`: the child will hold the connection too.
    pub fn add_holder(&self) {
        self.shm.word(off_holders(self.side)).fetch_add(1, Ordering::AcqRel);
    }

    /// The last descriptor of this process was closed: if no other process holds our
    /// side, the peer reads end of stream and its writes fail.
    pub fn release(&self) {
        self.release_closed(None);
    }

    /// As [`Conn::release`], after the program's last descriptor of the TCP socket
    /// whose addresses were `ids` (local, peer) was really closed. The holder count
    /// in the mapping knows only the processes the library saw being made; a
    /// process made by a raw `clone` (no fork handlers) holds the socket unseen.
    /// So when the count says this was the last holder, the kernel decides: if its
    /// TCP socket is still open (established, or the peer closed first), another
    /// process holds it and the peer must not see the close. When that process
    /// closes or exits, the peer learns it (its close, or the liveness socket's
    /// hang-up). A connection on this host watched through its TCP socket leaves
    /// all of this to the kernel, whose hang-up comes exactly then.
    pub fn release_closed(&self, ids: Option<(crate::sock::Key, crate::sock::Key)>) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        if !self.attached() {
            // Not settled yet: if it attaches later, the hold ends then.
            self.release_deferred.store(true, Ordering::Release);
            return;
        }
        // A local connector closed before any call of the program settled it (a
        // client that opened more connections than it used) was attached all the
        // same, and its acceptor counted it: count it here once.
        let on_this_host = self.remote.get().is_none() && !self.remote_kernel.load(Ordering::Relaxed);
        if self.side == 0 && on_this_host && !self.counted.swap(true, Ordering::Relaxed) {
            ACCELERATED.fetch_add(1, Ordering::Relaxed);
        }
        if self.watched_by_socket() {
            // The kernel tells the peer: our TCP socket hangs up when its last
            // holder, here or in any other process (one made by a raw clone
            // included), closes it or dies, and the peer reads what we wrote, then
            // the end ([`Liveness::TcpSocket`]); the hang-up wakes it wherever it
            // sleeps. No mark in the rings, no question to the kernel, no bell:
            // only the close hint is counted and its sleeping flags taken, so that
            // its next look (a zero-timeout epoll_wait that trusts the flags,
            // [`Conn::announce_stands`], or a non-blocking read) asks the kernel now.
            self.w(self.tx(), CLOSES).fetch_add(1, Ordering::Release);
            self.take_peer_flags();
            return;
        }
        if let Some((local, peer)) = ids.filter(|_| self.vault.is_some()) {
            let h = self.shm.word(off_holders(self.side));
            let before = h.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| Some(v.saturating_sub(1)));
            if before.unwrap_or(0) > 1 {
                return;
            }
            let open = crate::trust::diag_lookup(crate::trust::Proto::Tcp, local, peer)
                .is_some_and(|s| s.state == TCP_ESTABLISHED || s.state == TCP_CLOSE_WAIT);
            if !open {
                self.mark_closed();
            }
            return;
        }
        self.drop_hold();
    }

    /// A connection settled after the program closed it (a forked child may still
    /// hold it): this process's hold ends now.
    pub fn after_late_attach(&self) {
        if self.release_deferred.swap(false, Ordering::AcqRel) && self.attached() && !self.watched_by_socket()
        {
            self.drop_hold();
        }
    }

    /// This process's hold ends: if it was the last, the peer reads end of stream and
    /// its writes fail.
    fn drop_hold(&self) {
        let h = self.shm.word(off_holders(self.side));
        let before = h.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| Some(v.saturating_sub(1)));
        if before.unwrap_or(0) <= 1 {
            self.mark_closed();
        }
    }

    /// Our side is closed: the peer reads end of stream and its writes fail.
    fn mark_closed(&self) {
        // Read-closed first: whoever sees write-closed also sees the close (a
        // bridge then sends one frame for both).
        self.w(self.rx(), RCLOSED).store(1, Ordering::Release);
        self.w(self.tx(), WCLOSED).store(1, Ordering::Release);
        self.ring_bell_for_close();
    }
}

/// A caller's segment pointer, read or written (`Conn::walk`).
trait Address: Copy {
    fn address(self) -> usize;
}

impl Address for *mut u8 {
    fn address(self) -> usize {
        self as usize
    }
}

impl Address for *const u8 {
    fn address(self) -> usize {
        self as usize
    }
}

/// This process's id without a system call (strait-sys's cache, which
/// [`after_fork_child`] refreshes).
pub(crate) fn process_id() -> u64 {
    strait_sys::current_pid() as u64
}

/// In a forked child: its own process id.
pub(crate) fn after_fork_child() {
    strait_sys::forget_pid();
}

/// A held lock word in the shared mapping (released on drop). The word holds the
/// owner's process id, so a lock left by a process that died inside a step is taken
/// over instead of blocking the connection for ever. Uncontended, it costs one
/// compare-and-swap on a line only this end's processes touch.
///
/// The word lives in memory the peer can write: a peer that writes a live pid
/// there (or holds it) must not hold this process. A step is a copy of at most a
/// ring's worth of bytes, so a holder that keeps the word for [`STEP_LOCK_LIMIT`]
/// is not one of ours at work: the waiter gives up (the connection resets). The
/// waiter spins briefly, then yields, then sleeps, so it never burns a core.
struct StepLock<'a> {
    word: &'a AtomicU64,
    me: u64,
    /// The last holder before this one was this process (see [`LAST_HOLDER`]).
    was_mine: bool,
}

/// Longest time a step lock is waited for.
const STEP_LOCK_LIMIT: Duration = Duration::from_secs(2);

/// Set in a free lock word beside the process id of its last holder (0: free, last
/// holder unknown). A producer that finds its own process there knows that no other
/// process wrote since its own last step, so the tail it wrote then is the tail now:
/// it need not read the shared one (a line the reader's polling keeps pulling to
/// its own core).
const LAST_HOLDER: u64 = 1 << 63;

impl<'a> StepLock<'a> {
    fn take(word: &'a AtomicU64) -> Option<StepLock<'a>> {
        let me = process_id();
        let mut spins = 0u32;
        let mut since: Option<Instant> = None;
        let mut seen = word.load(Ordering::Relaxed);
        loop {
            let free = seen == 0 || seen & LAST_HOLDER != 0;
            let owner = if free {
                match word.compare_exchange_weak(seen, me, Ordering::Acquire, Ordering::Relaxed) {
                    Ok(_) => return Some(StepLock { word, me, was_mine: seen == me | LAST_HOLDER }),
                    Err(now) => {
                        seen = now;
                        continue;
                    }
                }
            } else {
                seen
            };
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(256) {
                std::hint::spin_loop();
                seen = word.load(Ordering::Relaxed);
                continue;
            }
            // SAFETY: signal 0 only asks whether the process exists.
            let dead = owner != me
                && unsafe { libc::kill(owner as libc::pid_t, 0) } != 0
                && real::errno() == libc::ESRCH;
            if dead && word.compare_exchange(owner, me, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return Some(StepLock { word, me, was_mine: false });
            }
            let start = *since.get_or_insert_with(Instant::now);
            let waited = start.elapsed();
            if waited >= STEP_LOCK_LIMIT {
                return None;
            }
            if waited < Duration::from_millis(1) {
                // SAFETY: plain syscall; the holder may need this processor.
                unsafe { libc::sched_yield() };
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
            seen = word.load(Ordering::Relaxed);
        }
    }
}

impl Drop for StepLock<'_> {
    fn drop(&mut self) {
        self.word.store(self.me | LAST_HOLDER, Ordering::Release);
    }
}

#[cfg(test)]
mod step_lock_tests {
    use super::*;

    /// A producer trusts the tail it wrote only when the lock says that no other
    /// process held it since: never after another process's step, after a peer's
    /// write of the word, or when the last holder is unknown.
    #[test]
    fn the_lock_says_whether_this_process_held_it_last() {
        let word = AtomicU64::new(0);
        let me = process_id();
        let first = StepLock::take(&word).expect("free");
        assert!(!first.was_mine, "a word never released says nothing");
        assert_eq!(word.load(Ordering::Relaxed), me, "held: the holder's id");
        drop(first);
        assert_eq!(word.load(Ordering::Relaxed), me | LAST_HOLDER);
        assert!(StepLock::take(&word).expect("free").was_mine);
        // Another process released it last (a forked sibling), or the peer wrote
        // the word (it is in memory the peer can write).
        for other in [(me + 1) | LAST_HOLDER, 0, LAST_HOLDER, (me << 32) | me | LAST_HOLDER] {
            word.store(other, Ordering::Relaxed);
            let l = StepLock::take(&word).expect("free");
            assert!(!l.was_mine, "word {other:#x}");
        }
    }
}

/// Where and when a connector made its connection ([`Conn::set_origin`]).
#[derive(Debug, Clone, Copy)]
struct Origin {
    dest: crate::sock::Key,
    /// The process that made it: a forked child's copy learns nothing.
    pid: u32,
    /// This process's forks when it was made: after a fork, the other process
    /// may have carried what this one did not see.
    forks: u32,
}

/// Writes `len` bytes of the segments `iov`, from their byte `skip` on, to `addr`
/// in process `pid` (`process_vm_writev`); true if all of them went.
fn write_into(pid: libc::pid_t, iov: &[(*const u8, usize)], skip: usize, len: usize, addr: usize) -> bool {
    if len == 0 {
        return true;
    }
    let mut skip = skip;
    let mut left = len;
    let local: Vec<libc::iovec> = iov
        .iter()
        .filter_map(|&(p, l)| {
            let from = skip.min(l);
            skip -= from;
            let n = (l - from).min(left);
            left -= n;
            (n > 0).then(|| libc::iovec { iov_base: p.wrapping_add(from) as *mut c_void, iov_len: n })
        })
        .collect();
    let remote = libc::iovec { iov_base: addr as *mut c_void, iov_len: len };
    // SAFETY: reads our caller's buffers and writes the posted buffer of the reader,
    // which waits in recv (it cannot take the post back while we hold it); the
    // kernel checks both ranges.
    let n =
        unsafe { libc::process_vm_writev(pid, local.as_ptr(), local.len() as libc::c_ulong, &remote, 1, 0) };
    n >= 0 && n as usize == len
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(o) = self.origin.get() {
            if o.pid == strait_sys::pid::current_pid() && o.forks == crate::vault::forks() {
                // One that fell back (its acceptor never attached: a single thread
                // that connects to its own listener and uses the connection before
                // it accepts, an acceptor that refused it or came too late) paid the
                // whole setup and carried nothing on shared memory: it counts as short.
                let ops = if self.attached() { *self.ops.get_mut() } else { 0 };
                crate::worth::connection_ended(o.dest, ops);
            }
        }
        if let Some(p) = self.pending.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            AWAITING.fetch_sub(1, Ordering::Relaxed);
            p.close();
        }
        // These descriptors belong to this connection alone.
        if self.my_efd >= 0 {
            crate::fds::let_go(&[self.my_efd, self.peer_efd]);
        }
        // Our slots of process pairs go back (the pairs themselves are shared).
        let mut offered = std::mem::take(self.offered.get_mut().unwrap_or_else(|e| e.into_inner()));
        if let Some(b) = self.pair.take() {
            offered.push(Offered { attach: 0, pair: b.pair, my_slot: b.my_slot });
        }
        if !offered.is_empty() {
            for o in &offered {
                o.pair.free(o.my_slot);
            }
            drop(offered);
            crate::pair::retire_idle();
        }
        crate::vault::release(self.vault);
        if let Liveness::Socket(u) = self.liveness {
            crate::fds::let_go(&[u]);
        }
    }
}
