//! An in-process device pair: frames move through a bounded queue in memory.
//!
//! Used for the engine's unit and property tests and for runnable documentation
//! examples; it is a real [`Device`] (bounded room, optional single-copy reads,
//! wake-ups through the peer worker's eventfd) with no shared memory or sockets.
//!
//! ```
//! use strait_core::{loopback::LoopbackDevice, Config, MemoryRegion, OpKind, Status, Worker};
//! let (a, b) = LoopbackDevice::pair(1 << 20);
//! let mut wa = Worker::new(Config::default()).unwrap();
//! let mut wb = Worker::new(Config::default()).unwrap();
//! let ea = wa.attach(a);
//! let eb = wb.attach(b);
//! let mut inbox = MemoryRegion::new(64).unwrap();
//! wb.post_recv(eb, &mut inbox, 0..64, 42, u64::MAX, 0).unwrap();
//! let mut outbox = MemoryRegion::new(5).unwrap();
//! outbox.write_at(0, b"hello").unwrap();
//! wa.post_send(ea, &outbox, 0..5, 42, 0).unwrap();
//! let sent = wa.poll().unwrap();
//! assert_eq!((sent.op, sent.status), (OpKind::Send, Status::Ok));
//! let got = wb.poll().unwrap();
//! assert_eq!((got.op, got.len, got.tag), (OpKind::Recv, 5, 42));
//! assert_eq!(&inbox.bytes().unwrap()[..5], b"hello");
//! ```

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::device::{Device, DeviceError, DeviceStats, FrameWriter, RxFrame};

#[derive(Default)]
struct Lane {
    frames: VecDeque<Vec<u8>>,
    bytes: usize,
    reader_sleeps: bool,
    reader_notify: Option<RawFd>,
}

#[derive(Default)]
struct Shared {
    lanes: [Lane; 2],
    closed: [bool; 2],
}

/// One end of an in-memory device pair.
pub struct LoopbackDevice {
    shared: Arc<Mutex<Shared>>,
    side: usize,
    capacity: usize,
    remote_read: bool,
    /// Whether this end writes into its peer for split transfers (as it reads).
    remote_write: bool,
    stats: DeviceStats,
    spare: Vec<Vec<u8>>,
}

impl LoopbackDevice {
    /// Two connected ends, each direction holding at most `capacity` bytes of frames.
    pub fn pair(capacity: usize) -> (LoopbackDevice, LoopbackDevice) {
        Self::pair_with(capacity, false)
    }

    /// Like [`LoopbackDevice::pair`]; `remote_read` enables single-copy reads (valid
    /// because both ends live in one address space).
    pub fn pair_with(capacity: usize, remote_read: bool) -> (LoopbackDevice, LoopbackDevice) {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let mk = |side| LoopbackDevice {
            shared: Arc::clone(&shared),
            side,
            capacity,
            remote_read,
            remote_write: remote_read,
            stats: DeviceStats::default(),
            spare: Vec::new(),
        };
        (mk(0), mk(1))
    }

    /// Makes this end refuse remote writes (as a device without them, or a kernel
    /// that forbids them, would): a split transfer's PUT to it is answered failed.
    pub fn refuse_remote_writes(&mut self) {
        self.remote_write = false;
    }

    /// Tells this end which eventfd wakes its own worker (the peer signals it).
    pub fn set_wake_fd(&mut self, fd: RawFd) {
        let mut s = self.lock();
        s.lanes[self.side ^ 1].reader_notify = Some(fd);
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Device for LoopbackDevice {
    fn max_frame_len(&self) -> usize {
        self.capacity / 4
    }

    fn send_frame(
        &mut self,
        len: usize,
        fill: &mut dyn FnMut(&mut FrameWriter<'_>),
    ) -> Result<bool, DeviceError> {
        if len > self.max_frame_len() {
            return Err(DeviceError::FrameTooLong { len, max: self.max_frame_len() });
        }
        let side = self.side;
        {
            let s = self.lock();
            if s.closed[side ^ 1] {
                return Err(DeviceError::PeerGone("peer closed".into()));
            }
            if s.lanes[side].bytes + len > self.capacity {
                return Ok(false);
            }
        }
        let mut v = self.spare.pop().unwrap_or_default();
        v.clear();
        v.resize(len, 0);
        // SAFETY: `v` is a local buffer of exactly `len` bytes.
        let mut w = unsafe { FrameWriter::from_raw(v.as_mut_ptr(), len) };
        fill(&mut w);
        {
            let mut s = self.lock();
            s.lanes[side].bytes += len;
            s.lanes[side].frames.push_back(v);
        }
        self.stats.frames_sent += 1;
        Ok(true)
    }

    fn recv_frame(&mut self, handle: &mut dyn FnMut(&RxFrame<'_>)) -> Result<bool, DeviceError> {
        let side = self.side;
        let f = {
            let mut s = self.lock();
            let lane = &mut s.lanes[side ^ 1];
            match lane.frames.pop_front() {
                Some(f) => {
                    lane.bytes -= f.len();
                    f
                }
                None => return Ok(false),
            }
        };
        // SAFETY: `f` is an owned buffer that outlives the frame view.
        let rx = unsafe { RxFrame::from_raw(f.as_ptr(), f.len()) };
        handle(&rx);
        self.stats.frames_received += 1;
        if self.spare.len() < 64 {
            self.spare.push(f);
        }
        Ok(true)
    }

    fn doorbell(&mut self) -> Result<(), DeviceError> {
        let fd = {
            let mut s = self.lock();
            let lane = &mut s.lanes[self.side];
            if !lane.reader_sleeps {
                return Ok(());
            }
            lane.reader_sleeps = false;
            lane.reader_notify
        };
        if let Some(fd) = fd {
            self.stats.wakeups_sent += 1;
            crate::notifier::notify_fd(fd).map_err(|e| DeviceError::Io { op: "eventfd write", source: e })?;
        }
        Ok(())
    }

    fn arm_sleep(&mut self) -> Result<bool, DeviceError> {
        let mut s = self.lock();
        let lane = &mut s.lanes[self.side ^ 1];
        lane.reader_sleeps = true;
        Ok(lane.frames.is_empty())
    }

    fn disarm_sleep(&mut self) {
        let mut s = self.lock();
        s.lanes[self.side ^ 1].reader_sleeps = false;
    }

    fn event_fd(&self) -> Option<RawFd> {
        None
    }

    fn check_peer(&mut self) -> Result<(), DeviceError> {
        let s = self.lock();
        if s.closed[self.side ^ 1] && s.lanes[self.side ^ 1].frames.is_empty() {
            return Err(DeviceError::PeerGone("peer closed".into()));
        }
        Ok(())
    }

    fn supports_remote_read(&self) -> bool {
        self.remote_read
    }

    unsafe fn remote_read(&mut self, remote_addr: u64, dst: *mut u8, len: usize) -> Result<(), DeviceError> {
        if !self.remote_read {
            return Err(DeviceError::Unsupported);
        }
        if self.lock().closed[self.side ^ 1] {
            return Err(DeviceError::PeerGone("peer closed".into()));
        }
        // SAFETY: both ends share this address space; the sender keeps the announced
        // buffer alive until it gets FIN, and the caller guarantees `dst`.
        unsafe { std::ptr::copy_nonoverlapping(remote_addr as usize as *const u8, dst, len) };
        self.stats.remote_reads += 1;
        Ok(())
    }

    fn supports_remote_write(&self) -> bool {
        self.remote_write
    }

    unsafe fn remote_write(
        &mut self,
        remote_addr: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        if !self.remote_write {
            return Err(DeviceError::Unsupported);
        }
        if self.lock().closed[self.side ^ 1] {
            return Err(DeviceError::PeerGone("peer closed".into()));
        }
        // SAFETY: both ends share this address space; the receiver keeps the buffer
        // it named held until our PUT-DONE, and the caller guarantees `src`.
        unsafe { std::ptr::copy_nonoverlapping(src, remote_addr as usize as *mut u8, len) };
        self.stats.remote_writes += 1;
        Ok(())
    }

    fn shutdown(&mut self) {
        let mut s = self.lock();
        s.closed[self.side] = true;
    }

    fn stats(&self) -> DeviceStats {
        self.stats
    }
}

impl Drop for LoopbackDevice {
    fn drop(&mut self) {
        self.shutdown();
    }
}
