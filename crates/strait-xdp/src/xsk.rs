//! An AF_XDP socket with its UMEM and its four rings (fill, completion, rx, tx).
//!
//! The rings are single-producer single-consumer queues shared with the kernel: the
//! producer writes entries, then publishes its index with a release store; the
//! consumer reads the index with an acquire load, reads entries, then publishes its
//! own index. Indices run freely and wrap; the ring size is a power of two.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use strait_sys::Mapping;

use crate::XdpError;

fn sys(op: &'static str, r: libc::c_int) -> Result<libc::c_int, XdpError> {
    if r < 0 {
        Err(XdpError::Io { op, source: io::Error::last_os_error() })
    } else {
        Ok(r)
    }
}

/// Transmit bookkeeping of one UMEM frame: the sends the kernel has not completed,
/// and whether its owner gave it back. It is free once both are done.
#[derive(Clone, Copy, Default)]
pub(crate) struct TxState {
    /// Transmissions queued or in flight.
    pub(crate) pending: u32,
    /// The owner gave it back; free once `pending` is zero.
    pub(crate) released: bool,
}

impl TxState {
    /// The owner gives the frame back: true if it is free now; otherwise the
    /// completion of its last transmission frees it ([`TxState::complete`]).
    pub(crate) fn release(&mut self) -> bool {
        if self.pending == 0 {
            return true;
        }
        self.released = true;
        false
    }

    /// One of its transmissions completed: true if that freed the frame.
    pub(crate) fn complete(&mut self) -> bool {
        self.pending = self.pending.saturating_sub(1);
        let freed = self.pending == 0 && self.released;
        if freed {
            self.released = false;
        }
        freed
    }
}

/// One mapped ring.
struct Ring {
    /// Kept for its drop: the words below point into it.
    _map: Mapping,
    producer: *const AtomicU32,
    consumer: *const AtomicU32,
    flags: *const AtomicU32,
    desc: *mut u8,
    mask: u32,
    entry: usize,
    /// Our side's index (producer for fill/tx, consumer for rx/completion).
    local: u32,
    /// Last seen index of the other side.
    cached: u32,
}

impl Ring {
    fn map(
        fd: RawFd,
        off: &libc::xdp_ring_offset,
        size: u32,
        entry: usize,
        pgoff: u64,
    ) -> Result<Ring, XdpError> {
        let map_len = off.desc as usize + size as usize * entry;
        // Maps the ring the kernel created for this socket at the offset it published;
        // the length covers the descriptors it said it has.
        let map = Mapping::shared(fd, map_len, pgoff)
            .map_err(|source| XdpError::Io { op: "mmap an AF_XDP ring", source })?;
        let base = map.ptr();
        // SAFETY: the offsets lie inside the mapping (kernel-provided layout).
        let (producer, consumer, flags, desc) = unsafe {
            (
                base.add(off.producer as usize) as *const AtomicU32,
                base.add(off.consumer as usize) as *const AtomicU32,
                base.add(off.flags as usize) as *const AtomicU32,
                base.add(off.desc as usize),
            )
        };
        // A fresh socket's rings start with every index at zero.
        Ok(Ring { _map: map, producer, consumer, flags, desc, mask: size - 1, entry, local: 0, cached: 0 })
    }

    fn size(&self) -> u32 {
        self.mask + 1
    }

    /// Producer side: free entries.
    fn free(&mut self) -> u32 {
        let size = self.size();
        let mut free = size - self.local.wrapping_sub(self.cached);
        if free == 0 {
            // SAFETY: live index word; acquire pairs with the kernel's consumer
            // release, so the entries it gave back are ours to overwrite.
            self.cached = unsafe { (*self.consumer).load(Ordering::Acquire) };
            free = size - self.local.wrapping_sub(self.cached);
        }
        free
    }

    /// Consumer side: entries available.
    fn available(&mut self) -> u32 {
        if self.cached == self.local {
            // SAFETY: live index word; acquire pairs with the kernel's producer
            // release, so the entries up to it are written.
            self.cached = unsafe { (*self.producer).load(Ordering::Acquire) };
        }
        self.cached.wrapping_sub(self.local)
    }

    fn entry_ptr(&self, idx: u32) -> *mut u8 {
        // SAFETY: masked index within the descriptor array.
        unsafe { self.desc.add((idx & self.mask) as usize * self.entry) }
    }

    fn publish_producer(&self) {
        // SAFETY: live index word; release makes the entries visible first.
        unsafe { (*self.producer).store(self.local, Ordering::Release) }
    }

    fn publish_consumer(&self) {
        // SAFETY: live index word; release orders our reads of the entries before
        // the kernel may reuse them.
        unsafe { (*self.consumer).store(self.local, Ordering::Release) }
    }

    fn needs_wakeup(&self) -> bool {
        // SAFETY: live flags word.
        unsafe { (*self.flags).load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0 }
    }

    fn published_producer(&self) -> u32 {
        // SAFETY: live index word.
        unsafe { (*self.producer).load(Ordering::Acquire) }
    }

    fn seen_consumer(&self) -> u32 {
        // SAFETY: live index word.
        unsafe { (*self.consumer).load(Ordering::Acquire) }
    }
}

/// Transmit doorbell: `sendto` while descriptors are pending and the kernel makes
/// headway (copy mode transmits a bounded batch per call); in zero-copy mode only
/// if the kernel asked for a wakeup. Returns the system calls made.
fn kick_loop(
    fd: RawFd,
    mode: XskMode,
    pending: impl Fn() -> u32,
    needs_wakeup: impl Fn() -> bool,
) -> Result<u32, XdpError> {
    let mut calls = 0;
    for _ in 0..64 {
        let before = pending();
        if before == 0 || (mode == XskMode::ZeroCopy && !needs_wakeup()) {
            break;
        }
        // SAFETY: sendto with no buffer is AF_XDP's transmit doorbell.
        let r = unsafe { libc::sendto(fd, std::ptr::null(), 0, libc::MSG_DONTWAIT, std::ptr::null(), 0) };
        calls += 1;
        if r < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EBUSY) | Some(libc::ENOBUFS) => {}
                Some(libc::ENETDOWN) | Some(libc::ENXIO) => {
                    return Err(XdpError::Io { op: "transmit (sendto)", source: e })
                }
                _ => break,
            }
        }
        if pending() == before {
            break;
        }
    }
    Ok(calls)
}

/// The doorbells of an [`Xsk`], usable without borrowing it (see [`Xsk::doorbell`]).
pub(crate) struct Doorbell {
    fd: RawFd,
    mode: XskMode,
    tx_producer: *const AtomicU32,
    tx_consumer: *const AtomicU32,
    tx_flags: *const AtomicU32,
    fill_flags: *const AtomicU32,
}

// SAFETY: the pointers address ring words shared with the kernel and only ever
// accessed atomically; `Xsk::doorbell`'s contract keeps the mappings alive while the
// handle is used, from any thread.
unsafe impl Send for Doorbell {}
// SAFETY: as above; every access is an atomic load or a system call on the fd.
unsafe impl Sync for Doorbell {}

impl Doorbell {
    /// Wakes the kernel to transmit published descriptors if it needs it (see
    /// [`Xsk::kick`]). Returns the system calls made.
    pub(crate) fn kick(&self) -> Result<u32, XdpError> {
        // SAFETY (both closures): live ring words (`Xsk::doorbell`'s contract).
        let pending = || unsafe {
            (*self.tx_producer)
                .load(Ordering::Acquire)
                .wrapping_sub((*self.tx_consumer).load(Ordering::Acquire))
        };
        // SAFETY: as above.
        let needs = || unsafe { (*self.tx_flags).load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0 };
        kick_loop(self.fd, self.mode, pending, needs)
    }

    /// Wakes the kernel to refill from the fill ring if it asked for it; true if a
    /// system call was made.
    pub(crate) fn rx_wakeup(&self) -> bool {
        // SAFETY: live flags word (`Xsk::doorbell`'s contract).
        let needs = unsafe { (*self.fill_flags).load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0 };
        if !needs {
            return false;
        }
        // SAFETY: a zero-length non-blocking receive is AF_XDP's receive doorbell.
        unsafe {
            libc::recvfrom(
                self.fd,
                std::ptr::null_mut(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        true
    }
}

/// Bind mode actually obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XskMode {
    /// The driver moves frames straight into and out of the UMEM.
    ZeroCopy,
    /// The kernel copies between its buffers and the UMEM (veth, generic XDP).
    Copy,
}

/// Geometry of a socket.
#[derive(Debug, Clone, Copy)]
pub struct XskGeometry {
    /// Bytes per UMEM frame (2048 or 4096).
    pub frame_size: u32,
    /// Frames for transmission.
    pub tx_frames: u32,
    /// Frames for reception (all handed to the fill ring).
    pub rx_frames: u32,
}

impl Default for XskGeometry {
    fn default() -> Self {
        XskGeometry { frame_size: 2048, tx_frames: 1024, rx_frames: 1024 }
    }
}

/// An AF_XDP socket bound to one interface queue.
pub struct Xsk {
    // Field order is drop order: the socket (and its rings) go before the UMEM
    // the kernel may still reference until the socket is closed.
    fd: OwnedFd,
    fill: Ring,
    comp: Ring,
    rx: Ring,
    tx: Ring,
    geo: XskGeometry,
    umem: Mapping,
    /// The mode obtained at bind.
    pub mode: XskMode,
}

// SAFETY: the raw pointers of the rings and the UMEM address mappings this value
// owns (unmapped only on drop); moving the owner to another thread moves nothing the
// pointers refer to. The rings are not `Sync`: users serialise access (a Mutex).
unsafe impl Send for Xsk {}

fn setsockopt<T>(fd: RawFd, opt: libc::c_int, v: &T, what: &'static str) -> Result<(), XdpError> {
    // SAFETY: passes a live, initialised `T` and its exact size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_XDP,
            opt,
            v as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as u32,
        )
    };
    sys(what, r).map(|_| ())
}

impl Xsk {
    /// Creates a socket with its UMEM and rings and binds it to `queue` of
    /// interface `ifindex`, zero-copy if the driver can, else copy mode.
    pub fn bind(ifindex: u32, queue: u32, geo: XskGeometry) -> Result<Xsk, XdpError> {
        let total = geo.tx_frames + geo.rx_frames;
        if !geo.frame_size.is_power_of_two()
            || !(2048..=4096).contains(&geo.frame_size)
            || !geo.tx_frames.is_power_of_two()
            || !geo.rx_frames.is_power_of_two()
        {
            return Err(XdpError::Config(format!("bad UMEM geometry {geo:?}")));
        }
        // SAFETY: plain socket creation.
        let raw = sys("socket(AF_XDP)", unsafe {
            libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0)
        })
        .map_err(|e| match e {
            XdpError::Io { source, .. } => XdpError::privilege("create an AF_XDP socket", source),
            other => other,
        })?;
        // SAFETY: the kernel just returned this descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let umem_len = total as usize * geo.frame_size as usize;
        let umem = Mapping::anonymous_populated(umem_len)
            .map_err(|source| XdpError::Io { op: "mmap the UMEM", source })?;
        let reg = libc::xdp_umem_reg {
            addr: umem.ptr() as u64,
            len: umem_len as u64,
            chunk_size: geo.frame_size,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        };
        let fdr = fd.as_raw_fd();
        setsockopt(fdr, libc::XDP_UMEM_REG, &reg, "register the UMEM")?;
        let ring_size: u32 = geo.rx_frames.max(geo.tx_frames);
        setsockopt(fdr, libc::XDP_UMEM_FILL_RING, &ring_size, "size the fill ring")?;
        setsockopt(fdr, libc::XDP_UMEM_COMPLETION_RING, &ring_size, "size the completion ring")?;
        setsockopt(fdr, libc::XDP_RX_RING, &ring_size, "size the rx ring")?;
        setsockopt(fdr, libc::XDP_TX_RING, &ring_size, "size the tx ring")?;
        // SAFETY: an all-zero xdp_mmap_offsets is a valid value of this plain struct.
        let mut off: libc::xdp_mmap_offsets = unsafe { std::mem::zeroed() };
        let mut optlen = std::mem::size_of::<libc::xdp_mmap_offsets>() as libc::socklen_t;
        // SAFETY: `off` is a live buffer of `optlen` bytes.
        let r = unsafe {
            libc::getsockopt(
                fdr,
                libc::SOL_XDP,
                libc::XDP_MMAP_OFFSETS,
                &mut off as *mut _ as *mut libc::c_void,
                &mut optlen,
            )
        };
        sys("read the ring offsets", r)?;
        let fill = Ring::map(fdr, &off.fr, ring_size, 8, libc::XDP_UMEM_PGOFF_FILL_RING)?;
        let comp = Ring::map(fdr, &off.cr, ring_size, 8, libc::XDP_UMEM_PGOFF_COMPLETION_RING)?;
        let rx = Ring::map(fdr, &off.rx, ring_size, 16, libc::XDP_PGOFF_RX_RING as u64)?;
        let tx = Ring::map(fdr, &off.tx, ring_size, 16, libc::XDP_PGOFF_TX_RING as u64)?;
        let mut xsk = Xsk { fd, fill, comp, rx, tx, geo, umem, mode: XskMode::Copy };
        // Post every receive frame before binding, so frames can land at once.
        for i in 0..geo.rx_frames {
            let addr = (geo.tx_frames + i) as u64 * geo.frame_size as u64;
            xsk.fill_push(addr);
        }
        xsk.fill.publish_producer();
        let bind = |flags: u16| {
            let sa = libc::sockaddr_xdp {
                sxdp_family: libc::AF_XDP as u16,
                sxdp_flags: flags,
                sxdp_ifindex: ifindex,
                sxdp_queue_id: queue,
                sxdp_shared_umem_fd: 0,
            };
            // SAFETY: passes a live sockaddr_xdp and its size.
            unsafe {
                libc::bind(
                    fdr,
                    &sa as *const _ as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_xdp>() as u32,
                )
            }
        };
        if bind(libc::XDP_ZEROCOPY | libc::XDP_USE_NEED_WAKEUP) == 0 {
            xsk.mode = XskMode::ZeroCopy;
        } else {
            sys("bind the AF_XDP socket", bind(libc::XDP_COPY | libc::XDP_USE_NEED_WAKEUP))?;
        }
        Ok(xsk)
    }

    /// The socket's descriptor (readable when frames wait in the rx ring).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The geometry.
    pub fn geometry(&self) -> XskGeometry {
        self.geo
    }

    /// Bytes of frame `idx` (transmit frames first, then receive frames).
    ///
    /// # Panics
    /// If `idx` is not a frame index (a caller bug).
    pub fn frame(&mut self, idx: u32) -> &mut [u8] {
        assert!(idx < self.geo.tx_frames + self.geo.rx_frames, "frame index out of range");
        let fs = self.geo.frame_size as usize;
        // SAFETY: the frame lies inside the UMEM; the caller owns it (a transmit
        // frame not in flight, or a receive frame between rx and fill).
        unsafe { std::slice::from_raw_parts_mut(self.umem.ptr().add(idx as usize * fs), fs) }
    }

    fn fill_push(&mut self, addr: u64) -> bool {
        if self.fill.free() == 0 {
            return false;
        }
        let p = self.fill.entry_ptr(self.fill.local) as *mut u64;
        // SAFETY: a free entry of the fill ring (8-byte aligned).
        unsafe { p.write(addr) };
        self.fill.local = self.fill.local.wrapping_add(1);
        true
    }

    /// Queues frame `idx` (first `len` bytes) on the tx ring; false if it is full.
    /// Visible to the kernel after [`Xsk::kick`].
    pub fn tx_push(&mut self, idx: u32, len: u32) -> bool {
        if self.tx.free() == 0 {
            return false;
        }
        let d = libc::xdp_desc { addr: idx as u64 * self.geo.frame_size as u64, len, options: 0 };
        let p = self.tx.entry_ptr(self.tx.local) as *mut libc::xdp_desc;
        // SAFETY: a free entry of the tx ring (16-byte aligned).
        unsafe { p.write(d) };
        self.tx.local = self.tx.local.wrapping_add(1);
        true
    }

    /// Publishes queued transmissions and, if the kernel needs it, wakes it. Returns
    /// the system calls made.
    pub fn kick(&mut self) -> Result<u32, XdpError> {
        self.tx.publish_producer();
        kick_loop(
            self.fd(),
            self.mode,
            || self.tx.published_producer().wrapping_sub(self.tx.seen_consumer()),
            || self.tx.needs_wakeup(),
        )
    }

    /// Publishes queued transmissions without waking the kernel (see
    /// [`Doorbell::kick`], which can then run without holding the socket).
    pub(crate) fn tx_publish(&mut self) {
        self.tx.publish_producer();
    }

    /// Start of the UMEM mapping (for code that owns frames and reads or writes
    /// them without borrowing the socket).
    pub(crate) fn umem_base(&self) -> NonNull<u8> {
        self.umem.base()
    }

    /// A handle that rings the socket's doorbells (`sendto`, `recvfrom`) and reads
    /// the ring words that decide whether to, without borrowing the socket.
    ///
    /// # Safety
    /// The handle points into this socket's ring mappings and uses its descriptor:
    /// it must not be used after the socket is dropped.
    pub(crate) unsafe fn doorbell(&self) -> Doorbell {
        Doorbell {
            fd: self.fd(),
            mode: self.mode,
            tx_producer: self.tx.producer,
            tx_consumer: self.tx.consumer,
            tx_flags: self.tx.flags,
            fill_flags: self.fill.flags,
        }
    }

    /// Takes completed transmissions: calls `done` with each frame index.
    pub fn reap(&mut self, mut done: impl FnMut(u32)) {
        let n = self.comp.available();
        for _ in 0..n {
            let p = self.comp.entry_ptr(self.comp.local) as *const u64;
            // SAFETY: an entry the kernel published.
            let addr = unsafe { p.read() };
            self.comp.local = self.comp.local.wrapping_add(1);
            done((addr / self.geo.frame_size as u64) as u32);
        }
        if n > 0 {
            self.comp.publish_consumer();
        }
    }

    /// True if a received frame waits.
    pub fn rx_ready(&mut self) -> bool {
        self.rx.available() > 0
    }

    /// Takes the next received frame: its frame index and the byte range of the
    /// packet inside the frame (the kernel may leave headroom before it).
    pub fn rx_pop(&mut self) -> Option<(u32, std::ops::Range<usize>)> {
        if self.rx.available() == 0 {
            return None;
        }
        let p = self.rx.entry_ptr(self.rx.local) as *const libc::xdp_desc;
        // SAFETY: an entry the kernel published.
        let d = unsafe { p.read() };
        self.rx.local = self.rx.local.wrapping_add(1);
        self.rx.publish_consumer();
        let fs = self.geo.frame_size as u64;
        let idx = (d.addr / fs) as u32;
        let start = (d.addr % fs) as usize;
        let end = (start + d.len as usize).min(fs as usize);
        Some((idx, start..end))
    }

    /// Gives a receive frame back to the kernel.
    pub fn rx_release(&mut self, idx: u32) {
        let addr = idx as u64 * self.geo.frame_size as u64;
        if self.fill_push(addr) {
            self.fill.publish_producer();
        }
    }

    /// Wakes the kernel to refill from the fill ring if it asked for it.
    pub fn rx_wakeup(&mut self) -> bool {
        if !self.fill.needs_wakeup() {
            return false;
        }
        // SAFETY: a zero-length non-blocking receive is AF_XDP's receive doorbell.
        unsafe {
            libc::recvfrom(
                self.fd(),
                std::ptr::null_mut(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        true
    }

    /// The kernel's counters for this socket.
    pub fn statistics(&self) -> Option<libc::xdp_statistics> {
        // SAFETY: zeroed plain struct.
        let mut s: libc::xdp_statistics = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::xdp_statistics>() as libc::socklen_t;
        // SAFETY: `s` is a live buffer of `len` bytes.
        let r = unsafe {
            libc::getsockopt(
                self.fd(),
                libc::SOL_XDP,
                libc::XDP_STATISTICS,
                &mut s as *mut _ as *mut libc::c_void,
                &mut len,
            )
        };
        (r == 0).then_some(s)
    }
}
