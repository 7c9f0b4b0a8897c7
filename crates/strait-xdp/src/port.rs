//! [`XdpPort`] and [`XdpChannel`]: many point-to-point [`Link`]s sharing one AF_XDP
//! socket.
//!
//! An [`XdpLink`](crate::XdpLink) owns its interface queue's socket and the steering
//! program, so a process could carry only one xdp connection. A port owns them
//! instead (one port per interface per process) and hands out channels: each channel
//! is a `Link` to one peer channel, identified by a pair of channel ids that the
//! caller chose (a discovery exchange carries them; [`XdpPort::new_channel_id`] hands
//! out unused random ids).
//!
//! # Frame format
//!
//! ```text
//! | dst MAC (6) | src MAC (6) | EtherType 0x88b5 (2) | dst channel (4, BE) | src channel (4, BE) | packet |
//! ```
//!
//! A received frame goes to the channel named by its destination id if its source
//! MAC and source id are that channel's peer's; frames for unknown ids and strays
//! (right id, wrong sender) are dropped and counted in [`PortStats`].
//!
//! # Threading
//!
//! Different threads drive different channels at once (each channel by one thread
//! at a time). The port's state (rings, frame pool, channel table) lives behind one
//! mutex, held for ring and table updates only; the transmit and receive doorbells
//! (`sendto`, `recvfrom`) and eventfd writes run outside it. Whoever polls (`recv`
//! on any channel whose own queue is empty) takes a batch from the rx ring and queues
//! each frame, by UMEM frame index (no copy), for its channel; a channel hands the
//! frame back to the kernel at its next `recv` or `arm_sleep`. A channel that gets a
//! frame this way is woken through its eventfd.
//!
//! # Sizing
//!
//! Transmit frames come from a pool shared by all channels
//! ([`XskGeometry::tx_frames`](crate::XskGeometry)), at most
//! [`XdpConfig::channel_tx_frames`] per channel; the reliability layer needs
//! `window + 16` per channel, so `N` channels that may all have full windows at once
//! need `tx_frames >= N * (window + 16)` (fewer only means that channels wait for
//! each other's frames). Each channel queues at most
//! [`XdpConfig::channel_rx_frames`] received frames; `rx_frames` should exceed what
//! the queues may hold together, or the kernel drops frames when the fill ring runs
//! dry. [`XdpConfig::for_port`] gives 4096 + 4096 frames of 2 KiB.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use strait_core::{Link, LinkError, LinkStats};

use crate::bpf::XdpProgram;
use crate::link::{XdpConfig, ETHERTYPE, ETH_HEADER};
use crate::netif::{self, Mac};
use crate::xsk::{Doorbell, TxState, Xsk, XskMode};
use crate::XdpError;

/// Bytes of the multiplexing header after the Ethernet header: destination and
/// source channel ids, big-endian `u32` each.
pub const MUX_HEADER: usize = 8;
/// Ethernet and multiplexing headers together: where a channel's packet starts.
const HEADERS: usize = ETH_HEADER + MUX_HEADER;
/// Frames one poll moves from the rx ring to the channels' queues at most.
const RX_BATCH: usize = 64;

/// Counters of a port (all channels together).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PortStats {
    /// Frames taken from the rx ring.
    pub frames_received: u64,
    /// Dropped: no channel has the destination id (closed, or never opened).
    pub unknown_channel: u64,
    /// Dropped: the channel exists but the source MAC or source id is not its peer's.
    pub strays: u64,
    /// Dropped: too short for the headers.
    pub malformed: u64,
    /// Dropped: the destination channel's receive queue was full.
    pub queue_full: u64,
    /// `tx_alloc` calls refused because the shared pool was empty.
    pub tx_pool_empty: u64,
    /// Channels open now.
    pub channels: u32,
}

/// A received frame queued for a channel: UMEM frame index and byte range.
#[derive(Clone, Copy)]
struct RxEntry {
    idx: u32,
    start: u32,
    end: u32,
}

/// The port's view of one channel.
struct ChanState {
    /// Distinguishes incarnations of the same id (frames completing after a close).
    key: u64,
    peer_mac: Mac,
    peer_id: u32,
    rx: VecDeque<RxEntry>,
    /// Transmit frames taken and not yet recycled.
    tx_held: u32,
    /// The eventfd was written and the owner has not drained it yet.
    signalled: bool,
    event: Arc<OwnedFd>,
    /// Frames for this channel dropped by the port (queue full, strays).
    dropped: u64,
}

/// Per transmit frame bookkeeping.
#[derive(Clone, Copy, Default)]
struct TxFrame {
    state: TxState,
    owner_id: u32,
    owner_key: u64,
}

/// Everything behind the port's mutex.
struct PortState {
    xsk: Xsk,
    chans: HashMap<u32, ChanState>,
    /// Ids handed out by `new_channel_id` and not yet opened.
    reserved: HashSet<u32>,
    free: Vec<u32>,
    tx: Vec<TxFrame>,
    next_key: u64,
    stats: PortStats,
}

impl PortState {
    /// Takes completed transmissions; recycles released frames.
    fn reap(&mut self) {
        let (tx, free, chans) = (&mut self.tx, &mut self.free, &mut self.chans);
        self.xsk.reap(|i| {
            let Some(t) = tx.get_mut(i as usize) else { return };
            if t.state.complete() {
                free.push(i);
                if let Some(c) = chans.get_mut(&t.owner_id).filter(|c| c.key == t.owner_key) {
                    c.tx_held = c.tx_held.saturating_sub(1);
                }
            }
        });
    }

    /// The next frame for channel `id`: from its queue, else after moving a batch
    /// of the rx ring to the channels' queues. Channels that got frames and were
    /// not signalled yet are added to `wake`.
    fn next_frame(
        &mut self,
        id: u32,
        local: Mac,
        cap: usize,
        wake: &mut Vec<Arc<OwnedFd>>,
    ) -> Option<RxEntry> {
        if let Some(e) = self.chans.get_mut(&id).and_then(|c| c.rx.pop_front()) {
            return Some(e);
        }
        for _ in 0..RX_BATCH {
            let Some((idx, range)) = self.xsk.rx_pop() else { break };
            self.stats.frames_received += 1;
            let f = &self.xsk.frame(idx)[range.clone()];
            if f.len() < HEADERS || f[12..14] != ETHERTYPE.to_be_bytes() || f[0..6] != local.0 {
                self.stats.malformed += 1;
                self.xsk.rx_release(idx);
                continue;
            }
            let word = |at: usize| u32::from_be_bytes([f[at], f[at + 1], f[at + 2], f[at + 3]]);
            let (dst, src) = (word(14), word(18));
            let smac = [f[6], f[7], f[8], f[9], f[10], f[11]];
            let Some(c) = self.chans.get_mut(&dst) else {
                self.stats.unknown_channel += 1;
                self.xsk.rx_release(idx);
                continue;
            };
            if c.peer_mac.0 != smac || c.peer_id != src {
                c.dropped += 1;
                self.stats.strays += 1;
                self.xsk.rx_release(idx);
                continue;
            }
            if c.rx.len() >= cap {
                c.dropped += 1;
                self.stats.queue_full += 1;
                self.xsk.rx_release(idx);
                continue;
            }
            c.rx.push_back(RxEntry { idx, start: range.start as u32, end: range.end as u32 });
            if dst != id && !c.signalled {
                c.signalled = true;
                wake.push(Arc::clone(&c.event));
            }
        }
        self.chans.get_mut(&id).and_then(|c| c.rx.pop_front())
    }
}

/// The UMEM as seen by channels that own frames of it.
struct UmemView {
    base: NonNull<u8>,
    frame_size: usize,
    tx_frames: u32,
}

// SAFETY: the pointer addresses the UMEM mapping owned by the port's socket, which
// lives as long as the port; every access goes to a frame the accessing channel owns
// (see `XdpChannel::tx_buf` and `XdpChannel::recv`).
unsafe impl Send for UmemView {}
// SAFETY: as above.
unsafe impl Sync for UmemView {}

/// One AF_XDP socket and the steering program on one interface queue, shared by any
/// number of [`XdpChannel`]s. See the module docs.
pub struct XdpPort {
    // Field order is drop order: the doorbell and the UMEM view point into the
    // socket's mappings, which go with `state`.
    doorbell: Doorbell,
    umem: UmemView,
    state: Mutex<PortState>,
    prog: XdpProgram,
    xsk_fd: RawFd,
    mode: XskMode,
    local: Mac,
    mtu: usize,
    channel_tx: u32,
    channel_rx: usize,
    epoch: Instant,
}

fn io_err(op: &'static str) -> XdpError {
    XdpError::Io { op, source: io::Error::last_os_error() }
}

fn random_u32() -> u32 {
    // No entropy source: ids only need to differ from the ones in use.
    strait_sys::random_u32()
        .unwrap_or_else(|| (strait_sys::unix_nanos() as u32).wrapping_mul(0x9e37_79b9) ^ std::process::id())
}

impl XdpPort {
    /// Attaches the steering program to `cfg.ifname`, binds an AF_XDP socket to
    /// `cfg.queue` with `cfg.geometry` (see [`XdpConfig::for_port`]), and returns the
    /// port, ready to open channels. One port per interface per process.
    ///
    /// Needs CAP_NET_ADMIN and CAP_BPF (root); without them the error names what
    /// was refused.
    pub fn open(cfg: &XdpConfig) -> Result<Arc<XdpPort>, XdpError> {
        let geo = cfg.geometry;
        if cfg.channel_tx_frames == 0 || cfg.channel_tx_frames > geo.tx_frames {
            return Err(XdpError::Config(format!(
                "channel_tx_frames {} must be 1..={} (the transmit frames)",
                cfg.channel_tx_frames, geo.tx_frames
            )));
        }
        if cfg.channel_rx_frames == 0 || cfg.channel_rx_frames > geo.rx_frames {
            return Err(XdpError::Config(format!(
                "channel_rx_frames {} must be 1..={} (the receive frames)",
                cfg.channel_rx_frames, geo.rx_frames
            )));
        }
        let ifindex = netif::ifindex(&cfg.ifname)?;
        let local = netif::mac(&cfg.ifname)?;
        let if_mtu = netif::mtu(&cfg.ifname)?;
        let prog = XdpProgram::attach(ifindex, ETHERTYPE)?;
        let xsk = Xsk::bind(ifindex, cfg.queue, geo)?;
        prog.bind_socket(cfg.queue, xsk.fd())?;
        let geo = xsk.geometry();
        let mtu = if_mtu.saturating_sub(MUX_HEADER).min(geo.frame_size as usize - HEADERS);
        // SAFETY: the doorbell is stored next to the socket in the port and dropped
        // before it (field order); it is used only through `&self` of the port.
        let doorbell = unsafe { xsk.doorbell() };
        let umem =
            UmemView { base: xsk.umem_base(), frame_size: geo.frame_size as usize, tx_frames: geo.tx_frames };
        let (xsk_fd, mode) = (xsk.fd(), xsk.mode);
        let state = PortState {
            xsk,
            chans: HashMap::new(),
            reserved: HashSet::new(),
            free: (0..geo.tx_frames).rev().collect(),
            tx: vec![TxFrame::default(); geo.tx_frames as usize],
            next_key: 1,
            stats: PortStats::default(),
        };
        Ok(Arc::new(XdpPort {
            doorbell,
            umem,
            state: Mutex::new(state),
            prog,
            xsk_fd,
            mode,
            local,
            mtu,
            channel_tx: cfg.channel_tx_frames,
            channel_rx: cfg.channel_rx_frames as usize,
            epoch: Instant::now(),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, PortState> {
        // A panic under the lock leaves the rings consistent (every update is a
        // single index store), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A random non-zero id that no open channel uses and that no earlier call
    /// handed out (it stays reserved until a channel opens with it).
    pub fn new_channel_id(&self) -> u32 {
        loop {
            let id = random_u32();
            if id == 0 {
                continue;
            }
            let mut st = self.lock();
            if !st.chans.contains_key(&id) && st.reserved.insert(id) {
                return id;
            }
        }
    }

    /// Opens channel `local_id` to channel `peer_id` of the port with MAC
    /// `peer_mac`. Both ids must be non-zero; `local_id` must not be open already.
    pub fn channel(
        self: &Arc<Self>,
        peer_mac: Mac,
        local_id: u32,
        peer_id: u32,
    ) -> Result<XdpChannel, XdpError> {
        if local_id == 0 || peer_id == 0 {
            return Err(XdpError::Config("channel ids must be non-zero".into()));
        }
        // SAFETY: plain eventfd creation.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(io_err("create a channel eventfd"));
        }
        // SAFETY: the kernel just returned this descriptor; nothing else owns it.
        let event = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        // SAFETY: plain epoll creation.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(io_err("create a channel epoll set"));
        }
        // SAFETY: the kernel just returned this descriptor; nothing else owns it.
        let wake = unsafe { OwnedFd::from_raw_fd(ep) };
        for fd in [event.as_raw_fd(), self.xsk_fd] {
            let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: fd as u64 };
            // SAFETY: registers a live descriptor with a live epoll set; `ev` is a
            // valid event record.
            if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
                return Err(io_err("add to a channel epoll set"));
            }
        }
        let mut st = self.lock();
        if st.chans.contains_key(&local_id) {
            return Err(XdpError::Config(format!("channel id {local_id} is already open")));
        }
        st.reserved.remove(&local_id);
        let key = st.next_key;
        st.next_key += 1;
        st.chans.insert(
            local_id,
            ChanState {
                key,
                peer_mac,
                peer_id,
                rx: VecDeque::with_capacity(self.channel_rx),
                tx_held: 0,
                signalled: false,
                event: Arc::clone(&event),
                dropped: 0,
            },
        );
        st.stats.channels = st.chans.len() as u32;
        drop(st);
        Ok(XdpChannel {
            port: Arc::clone(self),
            id: local_id,
            peer_id,
            peer_mac,
            header: header(peer_mac, self.local, local_id, peer_id),
            mine: vec![false; self.umem.tx_frames as usize],
            held: None,
            queued: 0,
            wake_list: Vec::with_capacity(RX_BATCH),
            event,
            wake,
            stats: LinkStats::default(),
        })
    }

    /// This side's MAC.
    pub fn local_mac(&self) -> Mac {
        self.local
    }

    /// Zero-copy or copy mode, as the driver allowed.
    pub fn mode(&self) -> XskMode {
        self.mode
    }

    /// True if the program runs in the generic (skb) hook.
    pub fn generic_xdp(&self) -> bool {
        self.prog.generic
    }

    /// Largest packet a channel carries (interface MTU less the mux header).
    pub fn mtu(&self) -> usize {
        self.mtu
    }

    /// The AF_XDP socket's descriptor (readable when frames wait in the rx ring).
    pub fn fd(&self) -> RawFd {
        self.xsk_fd
    }

    /// Drops this share (parts per million) of received strait frames: loss
    /// injection for tests.
    pub fn set_drop_ppm(&self, ppm: u32) -> Result<(), XdpError> {
        self.prog.set_drop_ppm(ppm)
    }

    /// Counters.
    pub fn stats(&self) -> PortStats {
        self.lock().stats
    }

    /// The kernel's counters of the socket (one `getsockopt`, under the port's lock).
    pub fn kernel_statistics(&self) -> Option<libc::xdp_statistics> {
        self.lock().xsk.statistics()
    }
}

/// The Ethernet and mux headers of a channel's frames.
fn header(peer: Mac, local: Mac, local_id: u32, peer_id: u32) -> [u8; HEADERS] {
    let mut h = [0u8; HEADERS];
    h[0..6].copy_from_slice(&peer.0);
    h[6..12].copy_from_slice(&local.0);
    h[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
    h[14..18].copy_from_slice(&peer_id.to_be_bytes());
    h[18..22].copy_from_slice(&local_id.to_be_bytes());
    h
}

fn link_err(e: XdpError) -> LinkError {
    match e {
        XdpError::Io { op, source } => LinkError::Io { op, source },
        other => LinkError::Down(other.to_string()),
    }
}

/// One connection over an [`XdpPort`]: a [`Link`] to one channel of one peer.
///
/// `Send`, driven by one thread at a time. Dropping it closes the channel: its
/// queued frames and transmit frames go back to the port and its id becomes free.
pub struct XdpChannel {
    port: Arc<XdpPort>,
    id: u32,
    peer_id: u32,
    peer_mac: Mac,
    header: [u8; HEADERS],
    /// Per transmit frame of the port: taken by this channel and not released.
    mine: Vec<bool>,
    /// The received frame last passed to a handler, given back at the next poll.
    held: Option<u32>,
    /// Descriptors queued since the last flush.
    queued: u32,
    /// Scratch: eventfds to write after a poll (kept to avoid allocating).
    wake_list: Vec<Arc<OwnedFd>>,
    event: Arc<OwnedFd>,
    /// Epoll set of the eventfd and the socket: the fd sleepers wait on.
    wake: OwnedFd,
    stats: LinkStats,
}

impl std::fmt::Debug for XdpChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdpChannel")
            .field("local_id", &self.id)
            .field("peer_id", &self.peer_id)
            .field("peer_mac", &self.peer_mac)
            .finish()
    }
}

impl XdpChannel {
    /// This channel's id.
    pub fn local_id(&self) -> u32 {
        self.id
    }

    /// The peer channel's id.
    pub fn peer_id(&self) -> u32 {
        self.peer_id
    }

    /// The peer's MAC.
    pub fn peer_mac(&self) -> Mac {
        self.peer_mac
    }

    /// The port.
    pub fn port(&self) -> &Arc<XdpPort> {
        &self.port
    }

    /// The descriptors a sleeper waits on (readable): the channel's eventfd (another
    /// thread queued frames for it) and the AF_XDP socket (frames wait in the rx
    /// ring that nobody has sorted yet). Call [`Link::arm_sleep`] first.
    /// [`Link::event_fd`] is an epoll set of both.
    pub fn wake_fds(&self) -> [RawFd; 2] {
        [self.event.as_raw_fd(), self.port.xsk_fd]
    }

    /// Closes the channel (the same as dropping it).
    pub fn close(self) {}

    fn check(&self, slot: u32, len: usize) -> Result<(), LinkError> {
        if !self.mine.get(slot as usize).copied().unwrap_or(false) || len > self.port.mtu {
            return Err(LinkError::BadSlot { slot, len });
        }
        Ok(())
    }

    /// The bytes of transmit frame `slot`, which this channel owns.
    fn frame_mut(&mut self, slot: u32) -> &mut [u8] {
        assert!(
            self.mine.get(slot as usize).copied().unwrap_or(false),
            "transmit slot not taken by this channel"
        );
        let fs = self.port.umem.frame_size;
        // SAFETY: `slot` is a transmit frame inside the UMEM (the port's pool) that
        // this channel took and has not released, so no other channel touches it;
        // the UMEM lives as long as the port this channel holds; the borrow of
        // `self` keeps the slice from outliving this call's caller's use.
        unsafe { std::slice::from_raw_parts_mut(self.port.umem.base.as_ptr().add(slot as usize * fs), fs) }
    }
}

fn signal(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to an eventfd (non-blocking; a full
    // counter only means it is readable already).
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

fn drain(fd: &OwnedFd) {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64 from a non-blocking eventfd.
    unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
}

impl Link for XdpChannel {
    fn mtu(&self) -> usize {
        self.port.mtu
    }

    fn tx_slots(&self) -> Option<usize> {
        // Its cap; the pool it shares may hold fewer free at a time, which only
        // makes channels wait for each other.
        Some(self.port.channel_tx as usize)
    }

    fn tx_alloc(&mut self) -> Option<u32> {
        let cap = self.port.channel_tx;
        let slot = {
            let mut st = self.port.lock();
            let held = st.chans.get(&self.id).map_or(cap, |c| c.tx_held);
            if held >= cap || st.free.is_empty() {
                st.reap();
            }
            let st = &mut *st;
            let c = st.chans.get_mut(&self.id)?;
            if c.tx_held >= cap {
                return None;
            }
            let Some(s) = st.free.pop() else {
                st.stats.tx_pool_empty += 1;
                return None;
            };
            c.tx_held += 1;
            let key = c.key;
            st.tx[s as usize] = TxFrame { state: TxState::default(), owner_id: self.id, owner_key: key };
            s
        };
        self.mine[slot as usize] = true;
        let h = self.header;
        self.frame_mut(slot)[..HEADERS].copy_from_slice(&h);
        Some(slot)
    }

    fn tx_buf(&mut self, slot: u32) -> &mut [u8] {
        let mtu = self.port.mtu;
        &mut self.frame_mut(slot)[HEADERS..HEADERS + mtu]
    }

    fn send(&mut self, slot: u32, len: usize) -> Result<bool, LinkError> {
        self.check(slot, len)?;
        let mut st = self.port.lock();
        if !st.xsk.tx_push(slot, (HEADERS + len) as u32) {
            drop(st);
            self.stats.send_full += 1;
            return Ok(false);
        }
        st.tx[slot as usize].state.pending += 1;
        drop(st);
        self.queued += 1;
        self.stats.datagrams_sent += 1;
        Ok(true)
    }

    fn tx_release(&mut self, slot: u32) {
        if !self.mine.get(slot as usize).copied().unwrap_or(false) {
            return;
        }
        self.mine[slot as usize] = false;
        let mut st = self.port.lock();
        let st = &mut *st;
        if st.tx[slot as usize].state.release() {
            st.free.push(slot);
            if let Some(c) = st.chans.get_mut(&self.id) {
                c.tx_held = c.tx_held.saturating_sub(1);
            }
        }
    }

    fn flush(&mut self) -> Result<(), LinkError> {
        let queued = std::mem::take(&mut self.queued);
        {
            let mut st = self.port.lock();
            if queued > 0 {
                st.xsk.tx_publish();
            }
            st.reap();
        }
        if queued > 0 {
            let calls = self.port.doorbell.kick().map_err(link_err)?;
            self.stats.doorbells += calls as u64;
        }
        Ok(())
    }

    fn recv(&mut self, handle: &mut dyn FnMut(&[u8])) -> Result<bool, LinkError> {
        let mut wake = std::mem::take(&mut self.wake_list);
        let got = {
            let mut st = self.port.lock();
            if let Some(idx) = self.held.take() {
                st.xsk.rx_release(idx);
            }
            if !st.chans.contains_key(&self.id) {
                return Err(LinkError::Down("channel closed".into()));
            }
            st.next_frame(self.id, self.port.local, self.port.channel_rx, &mut wake)
        };
        for fd in wake.drain(..) {
            signal(&fd);
        }
        self.wake_list = wake;
        let Some(e) = got else {
            if self.port.doorbell.rx_wakeup() {
                self.stats.doorbells += 1;
            }
            return Ok(false);
        };
        self.held = Some(e.idx);
        self.stats.datagrams_received += 1;
        let fs = self.port.umem.frame_size;
        let (start, end) = (e.start as usize, (e.end as usize).min(fs));
        // SAFETY: frame `e.idx` is a receive frame inside the UMEM that the port
        // took from the rx ring and queued for this channel alone; it goes back to
        // the fill ring only at this channel's next poll (`held`), so neither the
        // kernel nor another channel writes it meanwhile. `start <= end <= fs`
        // (`Xsk::rx_pop` and the headers check of `next_frame`).
        let f = unsafe {
            std::slice::from_raw_parts(
                self.port.umem.base.as_ptr().add(e.idx as usize * fs + start),
                end - start,
            )
        };
        handle(&f[HEADERS.min(f.len())..]);
        Ok(true)
    }

    fn now_ns(&self) -> u64 {
        self.port.epoch.elapsed().as_nanos() as u64
    }

    /// An epoll set of the channel's eventfd and the AF_XDP socket (see
    /// [`XdpChannel::wake_fds`]): readable when frames were queued for this channel
    /// or wait in the rx ring. The socket is included because when every channel
    /// sleeps, nobody else would sort the rx ring.
    fn event_fd(&self) -> Option<RawFd> {
        Some(self.wake.as_raw_fd())
    }

    fn arm_sleep(&mut self) -> Result<bool, LinkError> {
        let signalled = {
            let mut st = self.port.lock();
            st.chans.get_mut(&self.id).is_some_and(|c| std::mem::take(&mut c.signalled))
        };
        // Drained before the check below: a frame queued after the check writes the
        // eventfd again (the flag is clear now), so no wakeup is lost.
        if signalled {
            drain(&self.event);
        }
        let mut st = self.port.lock();
        if let Some(idx) = self.held.take() {
            st.xsk.rx_release(idx);
        }
        let queued = st.chans.get(&self.id).is_some_and(|c| !c.rx.is_empty());
        Ok(!queued && !st.xsk.rx_ready())
    }

    fn stats(&self) -> LinkStats {
        let mut s = self.stats;
        s.datagrams_dropped += self.port.lock().chans.get(&self.id).map_or(0, |c| c.dropped);
        s
    }
}

impl Drop for XdpChannel {
    fn drop(&mut self) {
        let mut st = self.port.lock();
        let st = &mut *st;
        if let Some(idx) = self.held.take() {
            st.xsk.rx_release(idx);
        }
        if let Some(c) = st.chans.remove(&self.id) {
            for e in c.rx {
                st.xsk.rx_release(e.idx);
            }
        }
        for (slot, mine) in self.mine.iter().enumerate() {
            if !mine {
                continue;
            }
            if st.tx[slot].state.release() {
                st.free.push(slot as u32);
            }
        }
        st.stats.channels = st.chans.len() as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>() {}
    fn assert_sync<T: Sync>() {}

    #[test]
    fn channels_move_between_threads_and_ports_are_shared() {
        assert_send::<XdpChannel>();
        assert_send::<Arc<XdpPort>>();
        assert_sync::<XdpPort>();
    }

    #[test]
    fn headers_name_both_channels() {
        let h = header(Mac([2, 0, 0, 0, 0, 2]), Mac([2, 0, 0, 0, 0, 1]), 0x0102_0304, 0x0a0b_0c0d);
        assert_eq!(&h[0..6], &[2, 0, 0, 0, 0, 2]);
        assert_eq!(&h[6..12], &[2, 0, 0, 0, 0, 1]);
        assert_eq!(&h[12..14], &[0x88, 0xb5]);
        assert_eq!(&h[14..18], &[0x0a, 0x0b, 0x0c, 0x0d], "destination: the peer's channel");
        assert_eq!(&h[18..22], &[1, 2, 3, 4], "source: ours");
    }
}
