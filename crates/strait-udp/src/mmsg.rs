//! The fallback backend: `sendmmsg` for each batch, `recvmmsg` for up to
//! [`RX_BATCH`] datagrams at a time, from plain memory. Used where io_uring is
//! refused (the `io_uring_disabled` sysctl, a seccomp filter, an old kernel) or when
//! `STRAIT_UDP_BACKEND=mmsg`.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use strait_core::{LinkError, LinkStats, SlotPool};

use crate::link::{Moderation, UdpStats, RX_BUF_LEN};
use crate::sys;

/// Datagrams one `recvmmsg` may return.
pub(crate) const RX_BATCH: usize = 32;

pub(crate) struct MmsgLink {
    fd: RawFd,
    pool: SlotPool,
    /// The software queue's head: datagrams queued by `send`, not yet handed to the
    /// kernel (bounded by `ring`: the "device ring" of this backend is one batch).
    txq: VecDeque<(u32, u32)>,
    ring: usize,
    tx_hdrs: Vec<libc::mmsghdr>,
    tx_iov: Vec<libc::iovec>,
    rx_mem: Vec<u8>,
    rx_hdrs: Vec<libc::mmsghdr>,
    rx_iov: Vec<libc::iovec>,
    rx_n: usize,
    rx_i: usize,
    pub(crate) stats: LinkStats,
    pub(crate) ustats: UdpStats,
    moder: Moderation,
}

// SAFETY: the raw pointers inside the mmsghdr/iovec arrays point only into memory
// this value owns (`pool`, `rx_mem`, `tx_iov`, `rx_iov`); they are rebuilt before
// every system call and never shared with another thread.
unsafe impl Send for MmsgLink {}

impl MmsgLink {
    pub(crate) fn new(fd: RawFd, slots: u32, slot_len: usize, ring: usize, moder: Moderation) -> Self {
        // SAFETY: mmsghdr and iovec are plain C structs for which all-zero is valid.
        let zero_hdr: libc::mmsghdr = unsafe { std::mem::zeroed() };
        let zero_iov = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        MmsgLink {
            fd,
            pool: SlotPool::new(slots, slot_len),
            txq: VecDeque::with_capacity(ring),
            ring,
            tx_hdrs: vec![zero_hdr; ring],
            tx_iov: vec![zero_iov; ring],
            rx_mem: vec![0; RX_BATCH * RX_BUF_LEN],
            rx_hdrs: vec![zero_hdr; RX_BATCH],
            rx_iov: vec![zero_iov; RX_BATCH],
            rx_n: 0,
            rx_i: 0,
            stats: LinkStats::default(),
            ustats: UdpStats::default(),
            moder,
        }
    }

    pub(crate) fn tx_alloc(&mut self) -> Option<u32> {
        self.pool.alloc()
    }

    pub(crate) fn tx_buf(&mut self, slot: u32) -> &mut [u8] {
        self.pool.buf(slot)
    }

    pub(crate) fn send(&mut self, slot: u32, len: usize) -> Result<bool, LinkError> {
        if slot >= self.pool.count() || len > self.pool.slot_len() {
            return Err(LinkError::BadSlot { slot, len });
        }
        if self.txq.len() >= self.ring {
            self.stats.send_full += 1;
            return Ok(false);
        }
        self.pool.begin_tx(slot);
        self.txq.push_back((slot, len as u32));
        Ok(true)
    }

    pub(crate) fn tx_release(&mut self, slot: u32) {
        self.pool.release(slot);
    }

    pub(crate) fn flush(&mut self) -> Result<(), LinkError> {
        let now = sys::now_ns();
        if self.txq.is_empty() || !self.moder.due(now, self.txq.len()) {
            return Ok(());
        }
        self.ring_now(now)
    }

    /// One `sendmmsg` for everything queued (until the socket buffer is full).
    pub(crate) fn ring_now(&mut self, now: u64) -> Result<(), LinkError> {
        self.moder.rang(now);
        // A bounded number of tries: each either sends something or drops the head.
        for _ in 0..4 {
            let n = self.txq.len().min(self.ring);
            if n == 0 {
                return Ok(());
            }
            for (i, &(slot, len)) in self.txq.iter().take(n).enumerate() {
                let Some(bytes) = self.pool.bytes(slot, len as usize) else {
                    return Err(LinkError::BadSlot { slot, len: len as usize });
                };
                self.tx_iov[i] =
                    libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: len as usize };
                let h = &mut self.tx_hdrs[i].msg_hdr;
                h.msg_name = std::ptr::null_mut();
                h.msg_namelen = 0;
                h.msg_iov = &mut self.tx_iov[i];
                h.msg_iovlen = 1;
                h.msg_control = std::ptr::null_mut();
                h.msg_controllen = 0;
                h.msg_flags = 0;
            }
            // SAFETY: the first `n` headers point at live iovecs, which point at slot
            // memory owned by `pool`; the kernel only reads them during the call.
            let r =
                unsafe { libc::sendmmsg(self.fd, self.tx_hdrs.as_mut_ptr(), n as u32, libc::MSG_DONTWAIT) };
            self.stats.doorbells += 1;
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR) => return Ok(()),
                    // An ICMP error from an earlier datagram (the peer's port was not
                    // open yet), a route that changed: the head datagram is lost, as
                    // on any lossy link; the reliability layer resends it.
                    Some(libc::ECONNREFUSED)
                    | Some(libc::EHOSTUNREACH)
                    | Some(libc::ENETUNREACH)
                    | Some(libc::EMSGSIZE)
                    | Some(libc::EPERM) => {
                        self.ustats.tx_errors += 1;
                        if let Some((slot, _)) = self.txq.pop_front() {
                            self.pool.end_tx(slot);
                        }
                        continue;
                    }
                    _ => return Err(LinkError::Io { op: "sendmmsg", source: e }),
                }
            }
            let sent = r as usize;
            for _ in 0..sent {
                if let Some((slot, _)) = self.txq.pop_front() {
                    self.pool.end_tx(slot);
                }
            }
            self.stats.datagrams_sent += sent as u64;
            if sent < n {
                // Socket buffer full: the rest waits for the next flush.
                return Ok(());
            }
        }
        Ok(())
    }

    pub(crate) fn recv(&mut self, handle: &mut dyn FnMut(&[u8])) -> Result<bool, LinkError> {
        loop {
            while self.rx_i < self.rx_n {
                let i = self.rx_i;
                self.rx_i += 1;
                let h = &self.rx_hdrs[i];
                let len = (h.msg_len as usize).min(RX_BUF_LEN);
                self.stats.datagrams_received += 1;
                if h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0 {
                    self.stats.datagrams_dropped += 1;
                    self.ustats.rx_truncated += 1;
                    continue;
                }
                handle(&self.rx_mem[i * RX_BUF_LEN..i * RX_BUF_LEN + len]);
                return Ok(true);
            }
            if !self.txq.is_empty() {
                let now = sys::now_ns();
                if self.moder.due(now, self.txq.len()) {
                    self.ring_now(now)?;
                }
            }
            if !self.fill_rx()? {
                return Ok(false);
            }
        }
    }

    /// One `recvmmsg` into the local batch; false if nothing came.
    fn fill_rx(&mut self) -> Result<bool, LinkError> {
        {
            for i in 0..RX_BATCH {
                self.rx_iov[i] = libc::iovec {
                    iov_base: self.rx_mem[i * RX_BUF_LEN..].as_mut_ptr().cast(),
                    iov_len: RX_BUF_LEN,
                };
                let h = &mut self.rx_hdrs[i];
                h.msg_hdr.msg_name = std::ptr::null_mut();
                h.msg_hdr.msg_namelen = 0;
                h.msg_hdr.msg_iov = &mut self.rx_iov[i];
                h.msg_hdr.msg_iovlen = 1;
                h.msg_hdr.msg_control = std::ptr::null_mut();
                h.msg_hdr.msg_controllen = 0;
                h.msg_hdr.msg_flags = 0;
                h.msg_len = 0;
            }
            // SAFETY: RX_BATCH headers, each pointing at its own iovec and its own
            // RX_BUF_LEN bytes of `rx_mem`, all live for the call.
            let r = unsafe {
                libc::recvmmsg(
                    self.fd,
                    self.rx_hdrs.as_mut_ptr(),
                    RX_BATCH as u32,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            self.stats.doorbells += 1;
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
            self.rx_n = r as usize;
            self.rx_i = 0;
            Ok(self.rx_n > 0)
        }
    }

    pub(crate) fn arm_sleep(&mut self) -> Result<bool, LinkError> {
        if !self.txq.is_empty() {
            self.ring_now(sys::now_ns())?;
        }
        // Look once more (the sleep is a system call anyway).
        Ok(self.rx_i >= self.rx_n && !self.fill_rx()?)
    }

    pub(crate) fn slots_in_use(&self) -> usize {
        self.pool.in_use()
    }
}
