//! The io_uring backend.
//!
//! * Transmit slots live in one registered buffer (`IORING_REGISTER_BUFFERS`).
//!   `send` only queues; `flush` turns the queue into SQEs (a run of equal-size
//!   datagrams becomes one `SENDMSG` with a `UDP_SEGMENT` control message: UDP GSO;
//!   a large datagram may go as `SEND_ZC` from the registered slot; the rest as
//!   `SEND`) and submits them with one `io_uring_enter`, which also reaps.
//! * Receives are posted before packets arrive: one multishot `RECVMSG` draws
//!   buffers from a provided-buffer ring; with `UDP_GRO` a buffer may hold a train of
//!   datagrams (one control message gives their size). Completions are read from the
//!   shared completion ring, with no system call.
//! * Sleep: an eventfd registered with the ring, whose notifications are switched
//!   on (through the ring's flags, no system call) only while the worker sleeps.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::{cqueue, opcode, types, IoUring};
use strait_core::{LinkError, LinkStats, SlotPool};

use crate::config::UdpConfig;
use crate::link::{queue_send, Moderation, UdpStats, RX_BUF_LEN};
use crate::sys;
use strait_sys::Mapping;

const UD_KIND: u64 = 0xff << 56;
const UD_RECV: u64 = 1 << 56;
const UD_SEND: u64 = 2 << 56;
const UD_ZC: u64 = 3 << 56;
const UD_GSO: u64 = 4 << 56;
const UD_CANCEL: u64 = 5 << 56;
const UD_RECV_ONE: u64 = 6 << 56;

/// Segments per GSO send (the kernel's `UDP_MAX_SEGMENTS` is 64 on older kernels).
const GSO_SEGS: usize = 64;
/// Bytes per GSO send (an IPv6 or IPv4 datagram's payload must stay below 64 KiB).
const GSO_BYTES: usize = 65_000;
/// GSO send operations that may be in flight at once.
const GSO_OPS: usize = 32;
/// Receive buffers in the provided-buffer ring at first; the rest are kept back and
/// posted only after the kernel ran out (`ENOBUFS`). The kernel takes buffers in
/// ring order, so every buffer in the ring is written once per round through it:
/// 16 buffers of 64 KiB (1 MiB, one core's L2 here) stay in cache between rounds
/// where all 256 (16 MiB) did not. A bulk stream arrives as GRO trains of ~44
/// datagrams per buffer, so 16 hold more than a 256-packet window.
const RX_POSTED_FIRST: u16 = 16;
/// Provided-buffer group id.
const BGID: u16 = 0;
/// Control space reserved in each receive buffer: two control messages of an `int`
/// or less (`UDP_GRO`'s segment size, the ECN codepoint's `IP_TOS` or
/// `IPV6_TCLASS`), `CMSG_SPACE(4)` = 24 bytes each.
const CTRL_LEN: usize = 48;
/// `struct io_uring_recvmsg_out`.
const RECVMSG_OUT_LEN: usize = 16;

/// One GSO send: its message header, one iovec per datagram, the `UDP_SEGMENT`
/// control message, and the slots to recycle when it completes.
struct GsoOp {
    hdr: libc::msghdr,
    iov: [libc::iovec; GSO_SEGS],
    cmsg: [u64; 4],
    slots: [u32; GSO_SEGS],
    n: usize,
}

/// The receive buffer being handed out datagram by datagram (a GRO train).
#[derive(Clone, Copy)]
struct RxCur {
    bid: u16,
    off: usize,
    end: usize,
    seg: usize,
}

pub(crate) struct UringLink {
    // Declared first so it is dropped (after the explicit cancel in `Drop`) before the
    // memory it used.
    ring: IoUring,
    fd: RawFd,
    pool: SlotPool,
    txq: VecDeque<(u32, u32)>,
    ring_cap: usize,
    /// Transmit CQEs still to come.
    tx_inflight: usize,
    gso: bool,
    /// Never resized after setup, so the addresses handed to the kernel stay put.
    gso_ops: Vec<GsoOp>,
    gso_free: Vec<u32>,
    zc_min: usize,
    /// See [`UdpConfig::direct_send`].
    direct_send: bool,
    rx_hdr: Box<libc::msghdr>,
    bufring: Mapping,
    rx_mem: Mapping,
    rx_count: u16,
    rx_tail: u16,
    /// Buffers in the ring that the kernel has not taken yet.
    rx_posted: u16,
    /// How many buffers the ring is kept filled to; grows when the kernel runs out.
    rx_target: u16,
    /// Buffers kept back from the ring (see `RX_POSTED_FIRST`).
    rx_spare: Vec<u16>,
    rx_armed: bool,
    /// Multishot receive unsupported: one-shot receives are re-posted.
    rx_multishot: bool,
    rx_ready: VecDeque<(u16, u32)>,
    rx_cur: Option<RxCur>,
    evfd: OwnedFd,
    pub(crate) stats: LinkStats,
    pub(crate) ustats: UdpStats,
    moder: Moderation,
    /// Features in force, for the log and the docs.
    pub(crate) features: String,
}

// SAFETY: the raw pointers inside (`GsoOp`, `rx_hdr`, the mappings) point only into
// memory this value owns; the ring is used from one thread at a time through `&mut`.
unsafe impl Send for UringLink {}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> LinkError {
    move |source| LinkError::Io { op, source }
}

impl UringLink {
    /// Sets up the ring, registers the slots, posts the receive. Errors mean "io_uring
    /// is not usable here" (the caller may fall back).
    pub(crate) fn new(
        fd: RawFd,
        cfg: &UdpConfig,
        slot_len: usize,
        rx_bufs: u32,
        moder: Moderation,
    ) -> io::Result<Self> {
        let (slots, ring_cap) = (cfg.slots, cfg.ring as usize);
        let (gso, gro, zc_min) = (cfg.gso, cfg.gro, cfg.zc_min);
        let entries = (ring_cap as u32).next_power_of_two().max(8);
        let cq = (entries * 2 + rx_bufs + 64).next_power_of_two();
        // Cooperative task running with the TASKRUN flag: the kernel never interrupts
        // the busy-polling thread to post a receive completion; it raises a flag in
        // the shared ring instead, and the next poll that sees it enters the kernel
        // once for the whole batch. Older kernels: plain mode.
        let mut coop = true;
        let ring: IoUring = match IoUring::builder()
            .setup_cqsize(cq)
            .setup_clamp()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .build(entries)
        {
            Ok(r) => r,
            Err(_) => {
                coop = false;
                IoUring::builder().setup_cqsize(cq).setup_clamp().build(entries)?
            }
        };
        let mut probe = io_uring::Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        for (code, what) in [
            (opcode::RecvMsgMulti::CODE, "RECVMSG"),
            (opcode::Send::CODE, "SEND"),
            (opcode::SendMsg::CODE, "SENDMSG"),
        ] {
            if !probe.is_supported(code) {
                return Err(io::Error::new(io::ErrorKind::Unsupported, format!("io_uring lacks {what}")));
            }
        }
        let mut features = Vec::new();
        if coop {
            features.push("coop-taskrun");
        }
        let mut pool = SlotPool::new(slots, slot_len);
        let base = pool.buf(0).as_mut_ptr();
        let iov = libc::iovec { iov_base: base.cast(), iov_len: slots as usize * slot_len };
        // SAFETY: the iovec covers `pool`'s memory, a Vec that is never resized and
        // lives in this value until after the ring is gone (field order + Drop).
        let registered = unsafe { ring.submitter().register_buffers(&[iov]) }.is_ok();
        if registered {
            features.push("registered-buffers");
        }
        let zc_min = if zc_min > 0 && registered && probe.is_supported(opcode::SendZc::CODE) {
            features.push("send-zc");
            zc_min
        } else {
            0
        };

        // Provided-buffer ring and its buffers.
        let rx_count = rx_bufs.clamp(8, 32768) as u16;
        let bufring = sys::anonymous_pages(rx_count as usize * 16)?;
        let rx_mem = sys::anonymous_pages(rx_count as usize * RX_BUF_LEN)?;
        // SAFETY: `bufring` is page-aligned memory of `rx_count` 16-byte entries that
        // lives until after the ring is gone.
        unsafe { ring.submitter().register_buf_ring_with_flags(bufring.ptr() as u64, rx_count, BGID, 0)? };
        features.push("provided-buffer-ring");
        let rx_multishot = true;
        features.push("multishot-recv");

        let gro = gro && sys::setsockopt_int(fd, sys::SOL_UDP, sys::UDP_GRO, 1).is_ok();
        if gro {
            features.push("gro");
        }
        // GSO is checked with a harmless socket-wide setting (0 = per message).
        let gso = gso && sys::setsockopt_int(fd, sys::SOL_UDP, sys::UDP_SEGMENT, 0).is_ok();
        if gso {
            features.push("gso");
        }

        let evfd = sys::eventfd()?;
        ring.submitter().register_eventfd(evfd.as_raw_fd())?;

        // SAFETY: msghdr is a plain C struct for which all-zero is valid.
        let mut rx_hdr: Box<libc::msghdr> = Box::new(unsafe { std::mem::zeroed() });
        rx_hdr.msg_controllen = CTRL_LEN as _;
        let gso_ops = (0..if gso { GSO_OPS } else { 0 })
            .map(|_| {
                GsoOp {
                    // SAFETY: plain C struct; all-zero is valid.
                    hdr: unsafe { std::mem::zeroed() },
                    iov: [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; GSO_SEGS],
                    cmsg: [0; 4],
                    slots: [0; GSO_SEGS],
                    n: 0,
                }
            })
            .collect();
        let mut l = UringLink {
            ring,
            fd,
            pool,
            txq: VecDeque::with_capacity(ring_cap),
            ring_cap,
            tx_inflight: 0,
            gso,
            gso_ops,
            gso_free: (0..if gso { GSO_OPS as u32 } else { 0 }).collect(),
            zc_min,
            direct_send: cfg.direct_send,
            rx_hdr,
            bufring,
            rx_mem,
            rx_count,
            rx_tail: 0,
            rx_posted: 0,
            rx_target: RX_POSTED_FIRST.min(rx_count),
            rx_spare: Vec::with_capacity(rx_count as usize),
            rx_armed: false,
            rx_multishot,
            rx_ready: VecDeque::with_capacity(rx_count as usize),
            rx_cur: None,
            evfd,
            stats: LinkStats::default(),
            ustats: UdpStats::default(),
            moder,
            features: features.join(" "),
        };
        l.ring.completion().disable_eventfd();
        for bid in 0..rx_count {
            l.recycle(bid);
        }
        l.arm_recv();
        l.submit()?;
        Ok(l)
    }

    pub(crate) fn tx_alloc(&mut self) -> Option<u32> {
        if let Some(s) = self.pool.alloc() {
            return Some(s);
        }
        // Completions of earlier sends may be waiting in the ring.
        self.reap();
        self.pool.alloc()
    }

    pub(crate) fn tx_buf(&mut self, slot: u32) -> &mut [u8] {
        self.pool.buf(slot)
    }

    pub(crate) fn tx_release(&mut self, slot: u32) {
        self.pool.release(slot);
    }

    pub(crate) fn slots_in_use(&self) -> usize {
        self.pool.in_use()
    }

    pub(crate) fn slots(&self) -> usize {
        self.pool.count() as usize
    }

    pub(crate) fn send(&mut self, slot: u32, len: usize) -> Result<bool, LinkError> {
        queue_send(&mut self.pool, &mut self.txq, self.ring_cap, &mut self.stats, slot, len)
    }

    /// Hands a receive buffer back to the kernel, or keeps it back while the ring
    /// holds `rx_target` already.
    fn recycle(&mut self, bid: u16) {
        if self.rx_posted >= self.rx_target {
            self.rx_spare.push(bid);
            return;
        }
        self.rx_posted += 1;
        let mask = self.rx_count - 1;
        let idx = (self.rx_tail & mask) as usize;
        let addr = self.rx_mem.ptr() as u64 + bid as u64 * RX_BUF_LEN as u64;
        // SAFETY: entry `idx` lies inside `bufring` (rx_count entries of 16 bytes);
        // the kernel reads entries only up to the tail published below.
        unsafe {
            let e = self.bufring.ptr().add(idx * 16);
            (e as *mut u64).write(addr);
            (e.add(8) as *mut u32).write(RX_BUF_LEN as u32);
            (e.add(12) as *mut u16).write(bid);
        }
        self.rx_tail = self.rx_tail.wrapping_add(1);
        // SAFETY: the tail is the u16 at offset 14 of the ring (it overlays the first
        // entry's reserved field), 2-byte aligned; the kernel reads it with acquire.
        let tail = unsafe { &*(self.bufring.ptr().add(14) as *const AtomicU16) };
        tail.store(self.rx_tail, Ordering::Release);
    }

    fn arm_recv(&mut self) {
        let sqe = if self.rx_multishot {
            opcode::RecvMsgMulti::new(types::Fd(self.fd), &*self.rx_hdr, BGID).build().user_data(UD_RECV)
        } else {
            opcode::RecvMsg::new(types::Fd(self.fd), &mut *self.rx_hdr as *mut libc::msghdr)
                .buf_group(BGID)
                .build()
                .flags(io_uring::squeue::Flags::BUFFER_SELECT)
                .user_data(UD_RECV_ONE)
        };
        // SAFETY: the SQE points at `rx_hdr`, boxed in this value for its lifetime.
        if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
            self.rx_armed = true;
        }
    }

    fn submit(&mut self) -> io::Result<()> {
        loop {
            match self.ring.submit() {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // The completion ring is full: reap, then try again.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) || e.raw_os_error() == Some(libc::EAGAIN) => {
                    self.stats.doorbells += 1;
                    self.reap();
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
        self.stats.doorbells += 1;
        Ok(())
    }

    /// Moves queued datagrams into SQEs while the submission ring has room.
    fn fill_sq(&mut self) {
        while let Some(&(slot, len)) = self.txq.front() {
            if self.tx_inflight + 2 > self.ring_cap * 2 || self.ring.submission().is_full() {
                break;
            }
            let len = len as usize;
            // A GSO run: equal-size datagrams, the last one possibly shorter.
            let mut run = 1;
            if self.gso && !self.gso_free.is_empty() {
                let mut bytes = len;
                for &(_, l) in self.txq.iter().skip(1) {
                    let l = l as usize;
                    if run == GSO_SEGS || l > len || bytes + l > GSO_BYTES || l == 0 {
                        break;
                    }
                    run += 1;
                    bytes += l;
                    if l < len {
                        break;
                    }
                }
            }
            let base = self.pool.buf(0).as_mut_ptr();
            let slot_len = self.pool.slot_len();
            let sqe = if run > 1 {
                let Some(op_id) = self.gso_free.pop() else { break };
                let op = &mut self.gso_ops[op_id as usize];
                for i in 0..run {
                    let Some((s, l)) = self.txq.pop_front() else { break };
                    // SAFETY: `s` is a valid slot index (checked in `send`), so the
                    // offset lies inside the pool's memory.
                    let p = unsafe { base.add(s as usize * slot_len) };
                    op.iov[i] = libc::iovec { iov_base: p.cast(), iov_len: l as usize };
                    op.slots[i] = s;
                }
                op.n = run;
                // One cmsg: cmsghdr (len 8, level 4, type 4) + u16 + padding.
                let c = &mut op.cmsg;
                *c = [0; 4];
                let cm = c.as_mut_ptr() as *mut u8;
                // SAFETY: `cmsg` is 32 bytes, 8-aligned; the header (16 bytes) and the
                // u16 fit.
                unsafe {
                    (cm as *mut usize).write(16 + 2);
                    (cm.add(8) as *mut i32).write(sys::SOL_UDP);
                    (cm.add(12) as *mut i32).write(sys::UDP_SEGMENT);
                    (cm.add(16) as *mut u16).write(len as u16);
                }
                op.hdr.msg_name = std::ptr::null_mut();
                op.hdr.msg_namelen = 0;
                op.hdr.msg_iov = op.iov.as_mut_ptr();
                op.hdr.msg_iovlen = run as _;
                op.hdr.msg_control = cm.cast();
                op.hdr.msg_controllen = 24;
                op.hdr.msg_flags = 0;
                self.ustats.gso_sends += 1;
                opcode::SendMsg::new(types::Fd(self.fd), &op.hdr).build().user_data(UD_GSO | op_id as u64)
            } else {
                self.txq.pop_front();
                // SAFETY: as above.
                let p = unsafe { base.add(slot as usize * slot_len) };
                if self.zc_min > 0 && len >= self.zc_min {
                    self.ustats.zc_sends += 1;
                    opcode::SendZc::new(types::Fd(self.fd), p, len as u32)
                        .buf_index(Some(0))
                        .build()
                        .user_data(UD_ZC | slot as u64)
                } else {
                    opcode::Send::new(types::Fd(self.fd), p, len as u32)
                        .build()
                        .user_data(UD_SEND | slot as u64)
                }
            };
            // SAFETY: every SQE points at slot memory (registered, owned by `pool`) or a
            // boxed GsoOp, both kept until the completion is reaped (`pending` in the
            // pool keeps the slot from reuse; the op is freed only on completion).
            if unsafe { self.ring.submission().push(&sqe) }.is_err() {
                // Cannot happen: fullness was checked above.
                break;
            }
            self.tx_inflight += if self.zc_min > 0 && run == 1 && len >= self.zc_min { 2 } else { 1 };
        }
    }

    /// Submits everything queued: the doorbell.
    pub(crate) fn ring_now(&mut self, now: u64) -> Result<(), LinkError> {
        self.reap();
        let queued = self.txq.len();
        let direct = self.send_direct();
        self.fill_sq();
        let sent = queued - self.txq.len();
        if sent > 0 {
            self.ustats.tx_doorbells += 1;
            if self.moder.streaming() {
                self.ustats.stream_doorbells += 1;
            }
        } else {
            self.ustats.rx_doorbells += 1;
        }
        self.moder.rang(now, sent, self.stats.datagrams_received);
        if !self.rx_armed {
            self.arm_recv();
        }
        // The lone datagram went out by itself: enter the kernel only if the ring
        // has something for it (a re-armed receive, completions to post).
        let idle_ring = {
            let sq = self.ring.submission();
            sq.is_empty() && !sq.taskrun() && !sq.cq_overflow()
        };
        if direct && idle_ring {
            return Ok(());
        }
        self.submit().map_err(io_err("io_uring_enter"))?;
        self.reap();
        Ok(())
    }

    /// Sends a lone queued datagram with a plain `send` when nothing is in flight
    /// through the ring (so it cannot overtake an earlier datagram) and nothing
    /// waits in the submission queue. Returns whether it went out this way.
    ///
    /// For one small datagram, io_uring's submission and completion cost more than
    /// the send itself; a batch still goes through the ring (one call for many).
    /// A send the socket cannot take now (`EAGAIN`, `ENOBUFS`, a signal) stays
    /// queued for the ring, which waits for room; any other error is a failed
    /// send, as a failed completion would be (the reliability layer resends).
    fn send_direct(&mut self) -> bool {
        if !self.direct_send
            || self.txq.len() != 1
            || self.tx_inflight != 0
            || !self.ring.submission().is_empty()
        {
            return false;
        }
        let Some(&(slot, len)) = self.txq.front() else { return false };
        let buf = &self.pool.buf(slot)[..len as usize];
        // SAFETY: `buf` is `len` initialised bytes of a slot this link owns (range
        // checked in `send`); the kernel only reads them during the call.
        let r = unsafe { libc::send(self.fd, buf.as_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if r < 0 {
            let e = io::Error::last_os_error().raw_os_error();
            if matches!(e, Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR)) {
                return false;
            }
        }
        self.txq.pop_front();
        self.stats.doorbells += 1;
        self.ustats.direct_sends += 1;
        self.tx_done(slot, if r < 0 { -1 } else { r as i32 });
        true
    }

    pub(crate) fn flush(&mut self) -> Result<(), LinkError> {
        let now = if self.txq.is_empty() { 0 } else { sys::now_ns() };
        if self.txq.is_empty() || !self.moder.due(now, self.txq.len()) {
            // Nothing to submit now; completions are still reaped (no system call).
            self.reap();
            return Ok(());
        }
        self.ring_now(now)
    }

    pub(crate) fn push(&mut self) -> Result<(), LinkError> {
        if self.txq.is_empty() {
            return self.flush();
        }
        self.stats.pushes += 1;
        self.ring_now(sys::now_ns())?;
        self.moder.pushed();
        Ok(())
    }

    fn tx_done(&mut self, slot: u32, res: i32) {
        if res < 0 {
            self.ustats.tx_errors += 1;
        } else {
            self.stats.datagrams_sent += 1;
        }
        if slot < self.pool.count() {
            self.pool.end_tx(slot);
        }
    }

    /// Reads every completion in the ring; returns how many there were.
    fn reap(&mut self) -> usize {
        let mut n = 0;
        loop {
            let Some(cqe) = self.ring.completion().next() else { break };
            n += 1;
            let ud = cqe.user_data();
            let res = cqe.result();
            let flags = cqe.flags();
            match ud & UD_KIND {
                UD_RECV | UD_RECV_ONE => {
                    if res >= 0 {
                        if let Some(bid) = cqueue::buffer_select(flags) {
                            self.rx_posted = self.rx_posted.saturating_sub(1);
                            if bid < self.rx_count {
                                self.rx_ready.push_back((bid, res as u32));
                            }
                        }
                    } else if res == -libc::ENOBUFS {
                        self.ustats.rx_nobufs += 1;
                        // Arrivals outran the buffers in the ring (datagrams the
                        // kernel could not coalesce take one each): post more.
                        self.rx_target = self.rx_target.saturating_mul(2).min(self.rx_count);
                        while self.rx_posted < self.rx_target {
                            let Some(bid) = self.rx_spare.pop() else { break };
                            self.recycle(bid);
                        }
                    } else if res != -libc::ECANCELED {
                        self.ustats.rx_errors += 1;
                    }
                    if ud & UD_KIND == UD_RECV_ONE || !cqueue::more(flags) {
                        self.rx_armed = false;
                    }
                }
                UD_SEND => {
                    self.tx_inflight = self.tx_inflight.saturating_sub(1);
                    self.tx_done((ud & 0xffff_ffff) as u32, res);
                }
                UD_ZC => {
                    self.tx_inflight = self.tx_inflight.saturating_sub(1);
                    let slot = (ud & 0xffff_ffff) as u32;
                    if cqueue::notif(flags) {
                        if slot < self.pool.count() {
                            self.pool.end_tx(slot);
                        }
                    } else {
                        if res < 0 {
                            self.ustats.tx_errors += 1;
                        } else {
                            self.stats.datagrams_sent += 1;
                        }
                        if !cqueue::more(flags) {
                            // No notification will follow.
                            self.tx_inflight = self.tx_inflight.saturating_sub(1);
                            if slot < self.pool.count() {
                                self.pool.end_tx(slot);
                            }
                        }
                    }
                }
                UD_GSO => {
                    self.tx_inflight = self.tx_inflight.saturating_sub(1);
                    let id = (ud & 0xffff_ffff) as usize;
                    if id < self.gso_ops.len() {
                        let op = &self.gso_ops[id];
                        let n = op.n;
                        let slots = op.slots;
                        if res < 0 {
                            self.ustats.tx_errors += 1;
                            if res == -libc::EIO || res == -libc::EINVAL || res == -libc::EOPNOTSUPP {
                                // The path cannot segment (no checksum offload, ...):
                                // stop using GSO; the reliability layer resends.
                                if self.gso {
                                    self.ustats.gso_refused += 1;
                                }
                                self.gso = false;
                            }
                        } else {
                            self.stats.datagrams_sent += n as u64;
                        }
                        for &s in &slots[..n] {
                            if s < self.pool.count() {
                                self.pool.end_tx(s);
                            }
                        }
                        self.gso_free.push(id as u32);
                    }
                }
                _ => {}
            }
        }
        n
    }

    pub(crate) fn recv(&mut self, handle: &mut dyn FnMut(&[u8])) -> Result<bool, LinkError> {
        loop {
            if let Some(mut cur) = self.rx_cur {
                let end = (cur.off + cur.seg).min(cur.end);
                let start = cur.bid as usize * RX_BUF_LEN;
                // SAFETY: `start + end` lies inside `rx_mem` (end <= the completion's
                // length <= RX_BUF_LEN); the kernel does not write this buffer until it
                // is recycled.
                let d = unsafe {
                    std::slice::from_raw_parts(self.rx_mem.ptr().add(start + cur.off), end - cur.off)
                };
                self.stats.datagrams_received += 1;
                handle(d);
                cur.off = end;
                if cur.off >= cur.end {
                    self.rx_cur = None;
                    self.recycle(cur.bid);
                } else {
                    self.rx_cur = Some(cur);
                }
                return Ok(true);
            }
            if let Some((bid, len)) = self.rx_ready.pop_front() {
                let start = bid as usize * RX_BUF_LEN;
                let len = (len as usize).min(RX_BUF_LEN);
                // SAFETY: as above; the kernel wrote `len` bytes of this buffer.
                let buf = unsafe { std::slice::from_raw_parts(self.rx_mem.ptr().add(start), len) };
                let Ok(out) = io_uring::types::RecvMsgOut::parse(buf, &self.rx_hdr) else {
                    self.stats.datagrams_dropped += 1;
                    self.recycle(bid);
                    continue;
                };
                if out.is_payload_truncated() {
                    self.stats.datagrams_received += 1;
                    self.stats.datagrams_dropped += 1;
                    self.ustats.rx_truncated += 1;
                    self.recycle(bid);
                    continue;
                }
                let off = RECVMSG_OUT_LEN + CTRL_LEN;
                let plen = out.payload_data().len();
                let seg = match sys::gro_size(out.control_data()) {
                    Some(s) if s > 0 && s < plen => {
                        self.ustats.gro_trains += 1;
                        s
                    }
                    _ => plen.max(1),
                };
                if sys::ce_marked(out.control_data()) {
                    // Every datagram of a GRO train carried the same codepoint (the
                    // kernel coalesces only datagrams whose IP headers agree).
                    self.stats.ce_marked += plen.div_ceil(seg).max(1) as u64;
                }
                if plen == 0 {
                    // An empty datagram: hand it over as such.
                    self.stats.datagrams_received += 1;
                    handle(&[]);
                    self.recycle(bid);
                    return Ok(true);
                }
                self.rx_cur = Some(RxCur { bid, off, end: off + plen, seg });
                continue;
            }
            if self.reap() > 0 {
                continue;
            }
            // Nothing arrived. Ring a deferred doorbell, re-post a finished receive,
            // or let the kernel flush completions that overflowed the ring.
            let (overflow, taskrun) = {
                let sq = self.ring.submission();
                (sq.cq_overflow(), sq.taskrun())
            };
            let now = if self.txq.is_empty() && !taskrun { 0 } else { sys::now_ns() };
            // Completions wait for us in the kernel. While the link streams, the
            // kernel is let post them once per stream window (the datagrams queue
            // in the socket meanwhile), not once per arrival: one system call per
            // batch.
            let rx_due = taskrun && self.moder.rx_due(now);
            if !self.rx_armed
                || overflow
                || rx_due
                || (!self.txq.is_empty() && self.moder.due(now, self.txq.len()))
            {
                self.ring_now(now.max(1))?;
                if !self.rx_ready.is_empty() {
                    continue;
                }
            }
            return Ok(false);
        }
    }

    pub(crate) fn event_fd(&self) -> RawFd {
        self.evfd.as_raw_fd()
    }

    pub(crate) fn arm_sleep(&mut self) -> Result<bool, LinkError> {
        if !self.txq.is_empty() || !self.rx_armed {
            self.ring_now(sys::now_ns())?;
        }
        self.ring.completion().enable_eventfd();
        sys::eventfd_drain(&self.evfd);
        if self.ring.submission().taskrun() {
            // Completions are waiting for the kernel to post them: do not sleep.
            return Ok(false);
        }
        let idle = self.rx_cur.is_none() && self.rx_ready.is_empty() && self.ring.completion().is_empty();
        Ok(idle && self.rx_armed)
    }

    pub(crate) fn disarm_sleep(&mut self) {
        self.ring.completion().disable_eventfd();
    }
}

impl Drop for UringLink {
    fn drop(&mut self) {
        // Cancel the posted receive and wait (bounded) for its last completion, so the
        // kernel writes no receive buffer after the memory is gone.
        if !self.rx_armed {
            return;
        }
        let sqe = opcode::AsyncCancel::new(UD_RECV).build().user_data(UD_CANCEL);
        let sqe2 = opcode::AsyncCancel::new(UD_RECV_ONE).build().user_data(UD_CANCEL);
        // SAFETY: cancel SQEs carry no pointers.
        unsafe {
            let mut sq = self.ring.submission();
            let _ = sq.push(&sqe);
            let _ = sq.push(&sqe2);
        }
        let ts = types::Timespec::new().nsec(20_000_000);
        for _ in 0..50 {
            let args = types::SubmitArgs::new().timespec(&ts);
            let _ = self.ring.submitter().submit_with_args(1, &args);
            self.reap();
            if !self.rx_armed {
                break;
            }
        }
    }
}
