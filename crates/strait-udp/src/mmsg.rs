//! The fallback backend: `sendmmsg` for each batch, `recvmmsg` for up to
//! [`RX_BATCH`] datagrams (or 16 GRO trains) at a time, from plain memory. Used where io_uring is
//! refused (the `io_uring_disabled` sysctl, a seccomp filter, an old kernel) or when
//! `STRAIT_UDP_BACKEND=mmsg`.
//!
//! * GSO (`cfg.gso`): a flush groups each run of equal-size queued datagrams (the
//!   last one possibly shorter) into one message of the `sendmmsg` whose iovecs are
//!   the slots and whose `UDP_SEGMENT` control message gives the size: the run goes
//!   down the stack as one super-datagram and is cut into datagrams at the device
//!   (or by the receiver). Still one system call per flush. If the kernel refuses
//!   (`EIO`/`EINVAL`: the route cannot segment), the link sends plain datagrams from
//!   then on; nothing queued is lost.
//! * GRO (`cfg.gro`): with `UDP_GRO` on, one receive may hold a train of datagrams
//!   (a control message gives their size); `recv` hands them out one at a time.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use strait_core::{LinkError, LinkStats, SlotPool};

use crate::config::UdpConfig;
use crate::link::{queue_send, Moderation, UdpStats, RX_BUF_LEN};
use crate::sys::{self, SegCmsg};

/// Receives one `recvmmsg` may return: plain datagrams.
pub(crate) const RX_BATCH: usize = 32;
/// Receives one `recvmmsg` may return with GRO on (each may be a train of up to
/// 64 KiB: over 700 full-size datagrams in all).
const RX_BATCH_GRO: usize = 16;

/// Datagrams per GSO message: the kernel's `UDP_MAX_SEGMENTS` (64 from Linux 4.18;
/// later kernels allow 128).
const GSO_SEGS: usize = 64;

/// Control space of each receive (room for the `UDP_GRO` message and then some).
const CTRL_LEN: usize = 64;

#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct RxCtrl([u8; CTRL_LEN]);

/// The receive being handed out datagram by datagram (offsets into `rx_mem`).
#[derive(Clone, Copy)]
struct RxCur {
    off: usize,
    end: usize,
    seg: usize,
}

/// How many datagrams, of the lengths `lens` (in queue order), go out as the GSO
/// message at the head of the queue: the first gives the segment size; equal ones
/// follow; a shorter one ends the run (the kernel allows only the last segment to be
/// short); at most [`GSO_SEGS`] datagrams and `max_bytes` in all. 0 for an empty
/// queue, 1 for a datagram that goes alone.
fn gso_run(mut lens: impl Iterator<Item = usize>, max_bytes: usize) -> usize {
    let Some(seg) = lens.next() else { return 0 };
    if seg == 0 || seg > u16::MAX as usize {
        return 1;
    }
    let (mut run, mut bytes) = (1, seg);
    for l in lens {
        if run == GSO_SEGS || l == 0 || l > seg || bytes + l > max_bytes {
            break;
        }
        run += 1;
        bytes += l;
        if l < seg {
            break;
        }
    }
    run
}

pub(crate) struct MmsgLink {
    fd: RawFd,
    pool: SlotPool,
    /// The software queue's head: datagrams queued by `send`, not yet handed to the
    /// kernel (bounded by `ring`: the "device ring" of this backend is one batch).
    txq: VecDeque<(u32, u32)>,
    ring: usize,
    /// One message per datagram, or per GSO run.
    tx_hdrs: Vec<libc::mmsghdr>,
    /// One iovec per queued datagram (a GSO message points at several).
    tx_iov: Vec<libc::iovec>,
    /// The `UDP_SEGMENT` control message of each message that is a GSO run.
    tx_cmsg: Vec<SegCmsg>,
    /// Datagrams in each message of the batch being sent.
    tx_runs: Vec<u32>,
    gso: bool,
    /// Largest GSO message payload.
    gso_bytes: usize,
    /// The next batch gives its head datagram a message of its own (a GSO message
    /// met an error that a plain datagram would be handled for).
    head_alone: bool,
    gro: bool,
    /// ECN codepoints are reported with each receive: control space is passed
    /// even without GRO, and CE marks are counted.
    ecn: bool,
    rx_mem: Vec<u8>,
    rx_hdrs: Vec<libc::mmsghdr>,
    rx_iov: Vec<libc::iovec>,
    rx_ctrl: Vec<RxCtrl>,
    /// Receive buffers ([`RX_BUF_LEN`] bytes each).
    rx_batch: usize,
    rx_n: usize,
    rx_i: usize,
    /// The last `recvmmsg` returned fewer datagrams than it had room for: the
    /// socket was empty then, so the next look for more answers "nothing" without
    /// a system call (once; the one after asks the kernel again).
    rx_drained: bool,
    rx_cur: Option<RxCur>,
    pub(crate) stats: LinkStats,
    pub(crate) ustats: UdpStats,
    moder: Moderation,
    features: String,
}

// SAFETY: the raw pointers inside the mmsghdr/iovec arrays point only into memory
// this value owns (`pool`, `rx_mem`, `tx_iov`, `rx_iov`, `tx_cmsg`, `rx_ctrl`); they
// are rebuilt before every system call and never shared with another thread.
unsafe impl Send for MmsgLink {}

impl MmsgLink {
    /// Sets the socket's GRO as configured (and checks that GSO is available);
    /// `gso_bytes` is the largest payload of one GSO message.
    pub(crate) fn new(
        fd: RawFd,
        cfg: &UdpConfig,
        slot_len: usize,
        gso_bytes: usize,
        moder: Moderation,
        ecn: bool,
    ) -> Self {
        let ring = cfg.ring as usize;
        // GRO changes what a receive returns: on only if wanted (a failed io_uring
        // setup may have left it on).
        let gro = cfg.gro && sys::setsockopt_int(fd, sys::SOL_UDP, sys::UDP_GRO, 1).is_ok();
        if !gro {
            let _ = sys::setsockopt_int(fd, sys::SOL_UDP, sys::UDP_GRO, 0);
        }
        // GSO is checked with a harmless socket-wide setting (0 = per message).
        let gso = cfg.gso && sys::setsockopt_int(fd, sys::SOL_UDP, sys::UDP_SEGMENT, 0).is_ok();
        let features: Vec<&str> = [(gso, "gso"), (gro, "gro")].iter().filter(|f| f.0).map(|f| f.1).collect();
        // SAFETY: mmsghdr is a plain C struct for which all-zero is valid.
        let zero_hdr: libc::mmsghdr = unsafe { std::mem::zeroed() };
        let zero_iov = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        let rx_batch = if gro { RX_BATCH_GRO } else { RX_BATCH };
        let rx_mem = if gro {
            // GRO trains fill whole buffers: written through now, so that the
            // memory is resident from the start rather than growing under traffic
            // (plain datagrams touch only the head of each buffer).
            vec![0xa5; rx_batch * RX_BUF_LEN]
        } else {
            vec![0; rx_batch * RX_BUF_LEN]
        };
        MmsgLink {
            fd,
            pool: SlotPool::new(cfg.slots, slot_len),
            txq: VecDeque::with_capacity(ring),
            ring,
            tx_hdrs: vec![zero_hdr; ring],
            tx_iov: vec![zero_iov; ring],
            tx_cmsg: vec![SegCmsg::new(); ring],
            tx_runs: vec![0; ring],
            gso,
            gso_bytes,
            head_alone: false,
            gro,
            ecn,
            rx_mem,
            rx_hdrs: vec![zero_hdr; rx_batch],
            rx_iov: vec![zero_iov; rx_batch],
            rx_ctrl: vec![RxCtrl([0; CTRL_LEN]); rx_batch],
            rx_batch,
            rx_n: 0,
            rx_i: 0,
            rx_drained: false,
            rx_cur: None,
            stats: LinkStats::default(),
            ustats: UdpStats::default(),
            moder,
            features: features.join(" "),
        }
    }

    pub(crate) fn features(&self) -> &str {
        &self.features
    }

    pub(crate) fn tx_alloc(&mut self) -> Option<u32> {
        self.pool.alloc()
    }

    pub(crate) fn tx_buf(&mut self, slot: u32) -> &mut [u8] {
        self.pool.buf(slot)
    }

    pub(crate) fn send(&mut self, slot: u32, len: usize) -> Result<bool, LinkError> {
        queue_send(&mut self.pool, &mut self.txq, self.ring, &mut self.stats, slot, len)
    }

    pub(crate) fn tx_release(&mut self, slot: u32) {
        self.pool.release(slot);
    }

    pub(crate) fn flush(&mut self) -> Result<(), LinkError> {
        if self.txq.is_empty() {
            return Ok(());
        }
        let now = sys::now_ns();
        if !self.moder.due(now, self.txq.len()) {
            return Ok(());
        }
        self.ring_now(now)
    }

    pub(crate) fn push(&mut self) -> Result<(), LinkError> {
        if self.txq.is_empty() {
            return Ok(());
        }
        self.stats.pushes += 1;
        self.ring_now(sys::now_ns())?;
        self.moder.pushed();
        Ok(())
    }

    /// Builds the messages for the first `queued` datagrams of the queue (GSO runs
    /// where possible); returns how many messages.
    fn build(&mut self, queued: usize) -> Result<usize, LinkError> {
        for (i, &(slot, len)) in self.txq.iter().take(queued).enumerate() {
            let Some(bytes) = self.pool.bytes(slot, len as usize) else {
                return Err(LinkError::BadSlot { slot, len: len as usize });
            };
            self.tx_iov[i] =
                libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: len as usize };
        }
        let mut msgs = 0;
        let mut i = 0;
        while i < queued {
            let run = if self.gso && !(i == 0 && self.head_alone) {
                gso_run(self.txq.range(i..queued).map(|&(_, l)| l as usize), self.gso_bytes).max(1)
            } else {
                1
            };
            if run > 1 {
                // `gso_run` keeps the segment size within u16.
                self.tx_cmsg[msgs].set(self.txq[i].1 as u16);
            }
            self.tx_runs[msgs] = run as u32;
            msgs += 1;
            i += run;
        }
        self.head_alone = false;
        // Pointers are taken once the arrays are written.
        let iov = self.tx_iov.as_mut_ptr();
        let cmsg = self.tx_cmsg.as_mut_ptr();
        let mut i = 0;
        for m in 0..msgs {
            let run = self.tx_runs[m] as usize;
            let h = &mut self.tx_hdrs[m].msg_hdr;
            h.msg_name = std::ptr::null_mut();
            h.msg_namelen = 0;
            h.msg_iov = iov.wrapping_add(i);
            h.msg_iovlen = run as _;
            if run > 1 {
                h.msg_control = cmsg.wrapping_add(m).cast();
                h.msg_controllen = std::mem::size_of::<SegCmsg>() as _;
            } else {
                h.msg_control = std::ptr::null_mut();
                h.msg_controllen = 0;
            }
            h.msg_flags = 0;
            i += run;
        }
        Ok(msgs)
    }

    /// Takes the first `n` datagrams off the queue (sent, or lost and counted).
    fn pop(&mut self, n: usize) {
        for _ in 0..n {
            if let Some((slot, _)) = self.txq.pop_front() {
                self.pool.end_tx(slot);
            }
        }
    }

    /// One `sendmmsg` for everything queued (until the socket buffer is full).
    pub(crate) fn ring_now(&mut self, now: u64) -> Result<(), LinkError> {
        let sent = self.txq.len().min(self.ring);
        if sent > 0 {
            self.ustats.tx_doorbells += 1;
            if self.moder.streaming() {
                self.ustats.stream_doorbells += 1;
            }
        }
        self.moder.rang(now, sent, self.stats.datagrams_received);
        // A bounded number of tries: each sends something, drops the head, or stops
        // using GSO for the head (or for good).
        for _ in 0..4 {
            let queued = self.txq.len().min(self.ring);
            if queued == 0 {
                return Ok(());
            }
            let msgs = self.build(queued)?;
            // SAFETY: the first `msgs` headers point at live iovecs (inside `tx_iov`,
            // which point at slot memory owned by `pool`) and at control messages
            // inside `tx_cmsg`; the kernel only reads them during the call.
            let r = unsafe {
                libc::sendmmsg(self.fd, self.tx_hdrs.as_mut_ptr(), msgs as u32, libc::MSG_DONTWAIT)
            };
            self.stats.doorbells += 1;
            if r < 0 {
                let e = io::Error::last_os_error();
                let head_gso = self.tx_runs[0] > 1;
                match e.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR) => return Ok(()),
                    // The route cannot segment (no checksum offload, a tunnel, ...):
                    // nothing was sent; plain datagrams from now on.
                    Some(libc::EIO) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) if head_gso => {
                        self.gso = false;
                        self.ustats.gso_refused += 1;
                        continue;
                    }
                    // An error a plain datagram is dropped for: nothing was sent; the
                    // head datagram goes alone next, and fares as below.
                    Some(libc::ECONNREFUSED)
                    | Some(libc::EHOSTUNREACH)
                    | Some(libc::ENETUNREACH)
                    | Some(libc::EMSGSIZE)
                    | Some(libc::EPERM)
                        if head_gso =>
                    {
                        self.head_alone = true;
                        continue;
                    }
                    // An ICMP error from an earlier datagram (the peer's port was not
                    // open yet), a route that changed: the head datagram is lost, as
                    // on any lossy link; the reliability layer resends it.
                    Some(libc::ECONNREFUSED)
                    | Some(libc::EHOSTUNREACH)
                    | Some(libc::ENETUNREACH)
                    | Some(libc::EMSGSIZE)
                    | Some(libc::EPERM) => {
                        self.ustats.tx_errors += 1;
                        self.pop(1);
                        continue;
                    }
                    _ => return Err(LinkError::Io { op: "sendmmsg", source: e }),
                }
            }
            let done = (r as usize).min(msgs);
            let mut sent = 0;
            for &run in &self.tx_runs[..done] {
                sent += run as usize;
                if run > 1 {
                    self.ustats.gso_sends += 1;
                }
            }
            self.pop(sent);
            self.stats.datagrams_sent += sent as u64;
            if done < msgs {
                // Socket buffer full: the rest waits for the next flush.
                return Ok(());
            }
        }
        Ok(())
    }

    /// Whether received datagrams are waiting to be handed out.
    fn rx_pending(&self) -> bool {
        self.rx_cur.is_some() || self.rx_i < self.rx_n
    }

    pub(crate) fn recv(&mut self, handle: &mut dyn FnMut(&[u8])) -> Result<bool, LinkError> {
        loop {
            if let Some(cur) = &mut self.rx_cur {
                let (off, end) = (cur.off, (cur.off + cur.seg).min(cur.end));
                cur.off = end;
                if end >= cur.end {
                    self.rx_cur = None;
                }
                self.stats.datagrams_received += 1;
                handle(&self.rx_mem[off..end]);
                return Ok(true);
            }
            if self.rx_i < self.rx_n {
                let i = self.rx_i;
                self.rx_i += 1;
                let h = &self.rx_hdrs[i];
                let len = (h.msg_len as usize).min(RX_BUF_LEN);
                let flags = h.msg_hdr.msg_flags;
                if flags & libc::MSG_TRUNC != 0 {
                    self.stats.datagrams_received += 1;
                    self.stats.datagrams_dropped += 1;
                    self.ustats.rx_truncated += 1;
                    continue;
                }
                let mut seg = len;
                let clen = CTRL_LEN.min(h.msg_hdr.msg_controllen as _);
                let ce = self.ecn && sys::ce_marked(&self.rx_ctrl[i].0[..clen]);
                if self.gro {
                    match sys::gro_size(&self.rx_ctrl[i].0[..clen]) {
                        Some(s) if s > 0 && s < len => {
                            self.ustats.gro_trains += 1;
                            seg = s;
                        }
                        Some(_) => {}
                        None if flags & libc::MSG_CTRUNC != 0 => {
                            // The segment size may have been cut off: whether this
                            // is one datagram or a train is unknown.
                            self.stats.datagrams_received += 1;
                            self.stats.datagrams_dropped += 1;
                            self.ustats.rx_truncated += 1;
                            continue;
                        }
                        None => {}
                    }
                }
                if ce {
                    // Every datagram of a GRO train carried the same codepoint (the
                    // kernel coalesces only datagrams whose IP headers agree).
                    self.stats.ce_marked += len.div_ceil(seg.max(1)).max(1) as u64;
                }
                let off = i * RX_BUF_LEN;
                // An empty datagram is handed out once, as such.
                self.rx_cur = Some(RxCur { off, end: off + len, seg });
                continue;
            }
            if !self.txq.is_empty() {
                let now = sys::now_ns();
                if self.moder.due(now, self.txq.len()) {
                    self.ring_now(now)?;
                }
            }
            // (A pump that took a partial batch would otherwise end with an empty
            // `recvmmsg` every time: one system call per message that finds
            // nothing. A datagram that came since is found by the next look, or
            // rings whoever sleeps on the socket.)
            if std::mem::take(&mut self.rx_drained) {
                return Ok(false);
            }
            if !self.fill_rx()? {
                return Ok(false);
            }
        }
    }

    /// One `recvmmsg` into the local batch; false if nothing came. Only when every
    /// earlier receive has been handed out.
    fn fill_rx(&mut self) -> Result<bool, LinkError> {
        let mem = self.rx_mem.as_mut_ptr();
        for i in 0..self.rx_batch {
            self.rx_iov[i] =
                libc::iovec { iov_base: mem.wrapping_add(i * RX_BUF_LEN).cast(), iov_len: RX_BUF_LEN };
        }
        let iov = self.rx_iov.as_mut_ptr();
        let ctrl = self.rx_ctrl.as_mut_ptr();
        for i in 0..self.rx_batch {
            let h = &mut self.rx_hdrs[i];
            h.msg_hdr.msg_name = std::ptr::null_mut();
            h.msg_hdr.msg_namelen = 0;
            h.msg_hdr.msg_iov = iov.wrapping_add(i);
            h.msg_hdr.msg_iovlen = 1;
            if self.gro || self.ecn {
                h.msg_hdr.msg_control = ctrl.wrapping_add(i).cast();
                h.msg_hdr.msg_controllen = CTRL_LEN as _;
            } else {
                h.msg_hdr.msg_control = std::ptr::null_mut();
                h.msg_hdr.msg_controllen = 0;
            }
            h.msg_hdr.msg_flags = 0;
            h.msg_len = 0;
        }
        // SAFETY: `rx_batch` headers, each pointing at its own iovec (its own
        // RX_BUF_LEN bytes of `rx_mem`) and its own CTRL_LEN bytes of `rx_ctrl`, all
        // live for the call.
        let r = unsafe {
            libc::recvmmsg(
                self.fd,
                self.rx_hdrs.as_mut_ptr(),
                self.rx_batch as u32,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        self.stats.doorbells += 1;
        self.ustats.rx_doorbells += 1;
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(false),
                Some(libc::ECONNREFUSED) | Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH) => {
                    // A pending ICMP error, reported once; datagrams may follow.
                    self.ustats.rx_errors += 1;
                    Ok(false)
                }
                _ => Err(LinkError::Io { op: "recvmmsg", source: e }),
            };
        }
        self.rx_n = (r as usize).min(self.rx_batch);
        self.rx_i = 0;
        self.rx_drained = self.rx_n < self.rx_batch;
        Ok(self.rx_n > 0)
    }

    pub(crate) fn arm_sleep(&mut self) -> Result<bool, LinkError> {
        if !self.txq.is_empty() {
            self.ring_now(sys::now_ns())?;
        }
        // Look once more (the sleep is a system call anyway).
        Ok(!self.rx_pending() && !self.fill_rx()?)
    }

    pub(crate) fn slots_in_use(&self) -> usize {
        self.pool.in_use()
    }

    pub(crate) fn slots(&self) -> usize {
        self.pool.count() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GSO messages a queue of these lengths is cut into.
    fn plan(lens: &[usize], max_bytes: usize) -> Vec<usize> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < lens.len() {
            let run = gso_run(lens[i..].iter().copied(), max_bytes);
            out.push(run);
            i += run;
        }
        out
    }

    #[test]
    fn gso_runs() {
        let max = 65_507;
        assert_eq!(gso_run(std::iter::empty(), max), 0);
        // Full-size datagrams: as many as fit in 64 KiB (44 of 1472 bytes).
        assert_eq!(plan(&[1472; 100], max), vec![44, 44, 12]);
        // IPv6: 45 of 1452 within 65487.
        assert_eq!(plan(&[1452; 50], 65_487), vec![45, 5]);
        // A shorter one ends a run; a longer one starts a new one.
        assert_eq!(plan(&[1472, 1472, 700, 1472, 1472], max), vec![3, 2]);
        assert_eq!(plan(&[100, 200, 200, 50, 50], max), vec![1, 3, 1]);
        // Small datagrams: the segment count caps the run.
        assert_eq!(plan(&[64; 130], max), vec![64, 64, 2]);
        // Empty datagrams go alone and end nothing else's run but their own.
        assert_eq!(plan(&[0, 0, 8, 0], max), vec![1, 1, 1, 1]);
        // Two that do not fit together go alone.
        assert_eq!(plan(&[40_000, 40_000], max), vec![1, 1]);
        // The cap is inclusive.
        assert_eq!(plan(&[1000, 1000, 1000], 3000), vec![3]);
        assert_eq!(plan(&[1000, 1000, 1000], 2999), vec![2, 1]);
    }

    #[test]
    fn gro_size_parses_the_control_message() {
        const W: usize = std::mem::size_of::<usize>();
        const HDR: usize = std::mem::size_of::<libc::cmsghdr>();
        let mut b = vec![0u8; 64];
        // Some other message first, then UDP_GRO.
        b[..W].copy_from_slice(&(HDR + 4).to_ne_bytes());
        b[W..W + 4].copy_from_slice(&0i32.to_ne_bytes());
        b[W + 4..W + 8].copy_from_slice(&1i32.to_ne_bytes());
        let o = (HDR + 4).next_multiple_of(W);
        b[o..o + W].copy_from_slice(&(HDR + 4).to_ne_bytes());
        b[o + W..o + W + 4].copy_from_slice(&sys::SOL_UDP.to_ne_bytes());
        b[o + W + 4..o + W + 8].copy_from_slice(&sys::UDP_GRO.to_ne_bytes());
        b[o + HDR..o + HDR + 4].copy_from_slice(&1472i32.to_ne_bytes());
        assert_eq!(sys::gro_size(&b[..o + HDR + 4]), Some(1472));
        assert_eq!(sys::gro_size(&b[..o]), None);
        // A length running past the end, or too short, stops the parse.
        assert_eq!(sys::gro_size(&b[..o + HDR + 3]), None);
        let mut bad = b.clone();
        bad[..W].copy_from_slice(&3usize.to_ne_bytes());
        assert_eq!(sys::gro_size(&bad), None);
        assert_eq!(sys::gro_size(&[]), None);
    }

    /// One control message (level, type, data) as the kernel lays it out.
    fn cmsg(level: i32, kind: i32, data: &[u8]) -> Vec<u8> {
        const W: usize = std::mem::size_of::<usize>();
        const HDR: usize = std::mem::size_of::<libc::cmsghdr>();
        let mut b = vec![0u8; (HDR + data.len()).next_multiple_of(W)];
        b[..W].copy_from_slice(&(HDR + data.len()).to_ne_bytes());
        b[W..W + 4].copy_from_slice(&level.to_ne_bytes());
        b[W + 4..W + 8].copy_from_slice(&kind.to_ne_bytes());
        b[HDR..HDR + data.len()].copy_from_slice(data);
        b
    }

    #[test]
    fn ce_marks_are_read_from_the_tos_or_traffic_class() {
        let tos = |t: u8| cmsg(libc::IPPROTO_IP, libc::IP_TOS, &[t]);
        let tclass = |t: i32| cmsg(libc::IPPROTO_IPV6, libc::IPV6_TCLASS, &t.to_ne_bytes());
        let gro = cmsg(sys::SOL_UDP, sys::UDP_GRO, &1472i32.to_ne_bytes());
        assert!(sys::ce_marked(&tos(0x03)));
        assert!(sys::ce_marked(&tos(0xb8 | 0x03)), "DSCP bits beside CE");
        assert!(!sys::ce_marked(&tos(0x02)), "ECT(0) is not CE");
        assert!(!sys::ce_marked(&tos(0x01)), "ECT(1) is not CE");
        assert!(sys::ce_marked(&tclass(0x03)));
        assert!(!sys::ce_marked(&tclass(0x02)));
        // After a GRO message, beside which it arrives.
        let both = [gro.clone(), tos(0x03)].concat();
        assert!(sys::ce_marked(&both));
        assert_eq!(sys::gro_size(&both), Some(1472));
        assert!(!sys::ce_marked(&gro));
        // A malformed message ends the parse: nothing after it counts.
        let mut bad = tos(0x03);
        bad[..8].copy_from_slice(&1000usize.to_ne_bytes());
        assert!(!sys::ce_marked(&bad));
        assert!(!sys::ce_marked(&[]));
    }

    #[test]
    fn seg_cmsg_layout() {
        // CMSG_SPACE(2) and CMSG_LEN(2), as the kernel checks them.
        // SAFETY: pure arithmetic macros.
        let (space, len) = unsafe { (libc::CMSG_SPACE(2) as usize, libc::CMSG_LEN(2) as usize) };
        assert_eq!(std::mem::size_of::<SegCmsg>(), space);
        assert_eq!(std::mem::size_of::<libc::cmsghdr>() + 2, len);
    }
}
