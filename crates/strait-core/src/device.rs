//! The interface between the protocol engine and a device (shm, udp, xdp, sim).
//!
//! A device moves *frames* (a `strait-wire` header plus payload) to exactly one peer,
//! in order, without loss (unreliable devices put the reliability layer below this
//! trait). The engine never blocks inside a device call: a device that has no room
//! says so and the engine keeps the frame in its own software queue.

use std::io;
use std::marker::PhantomData;
use std::os::fd::RawFd;

use thiserror::Error;

/// Errors a device reports to the engine.
#[derive(Debug, Error)]
pub enum DeviceError {
    /// The peer closed the connection or died; nothing more will arrive.
    #[error("peer is gone: {0}")]
    PeerGone(String),
    /// The peer wrote something that breaks the device's invariants (a hostile or
    /// buggy peer). The frame was dropped and counted; the connection is unusable.
    #[error("peer corrupted the device state: {0}")]
    Corrupt(String),
    /// The device does not implement this operation (e.g. remote reads).
    #[error("operation not supported by this device")]
    Unsupported,
    /// A frame longer than [`Device::max_frame_len`] was offered.
    #[error("frame of {len} bytes exceeds the device maximum of {max}")]
    FrameTooLong {
        /// Offered length.
        len: usize,
        /// Device maximum.
        max: usize,
    },
    /// A system call failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Counters a device keeps about itself; cheap to read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DeviceStats {
    /// Frames published to the peer.
    pub frames_sent: u64,
    /// Frames consumed from the peer.
    pub frames_received: u64,
    /// Frames or ring states rejected as malformed.
    pub frames_rejected: u64,
    /// Doorbells that needed a system call because the peer slept.
    pub wakeups_sent: u64,
    /// Remote (single-copy) reads performed.
    pub remote_reads: u64,
}

/// Write access to one frame's bytes while the device has it reserved.
///
/// The memory may be shared with another process, so it is never exposed as a Rust
/// slice; every access is a bounds-checked copy.
pub struct FrameWriter<'a> {
    ptr: *mut u8,
    len: usize,
    _frame: PhantomData<&'a mut [u8]>,
}

impl<'a> FrameWriter<'a> {
    /// Wraps raw frame memory.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes for `'a`, and no other code in
    /// this process may access those bytes during `'a`.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Self {
        FrameWriter { ptr, len, _frame: PhantomData }
    }

    /// Length of the frame.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length frame.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` to `offset`.
    ///
    /// # Panics
    /// If the write would end past the frame: an engine bug, never peer input.
    pub fn write(&mut self, offset: usize, src: &[u8]) {
        assert!(offset <= self.len && src.len() <= self.len - offset, "frame write out of bounds");
        // SAFETY: bounds checked above; `from_raw`'s contract makes the range writable.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
    }
}

/// Read access to one received frame while the device holds it.
pub struct RxFrame<'a> {
    ptr: *const u8,
    len: usize,
    _frame: PhantomData<&'a [u8]>,
}

impl<'a> RxFrame<'a> {
    /// Wraps raw frame memory.
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes for `'a`. The bytes may be changed
    /// concurrently by a hostile peer; readers only ever copy them out.
    pub unsafe fn from_raw(ptr: *const u8, len: usize) -> Self {
        RxFrame { ptr, len, _frame: PhantomData }
    }

    /// Length of the frame (header and payload).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length frame.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `dst.len()` bytes starting at `offset` into `dst`; returns false (and
    /// copies nothing) if the range is not inside the frame.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> bool {
        if offset > self.len || dst.len() > self.len - offset {
            return false;
        }
        // SAFETY: bounds checked; `from_raw`'s contract makes the range readable, and
        // `dst` is a distinct, exclusively borrowed buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        true
    }

    /// Copies `len` bytes starting at `offset` to raw memory `dst`; returns false (and
    /// copies nothing) if the range is not inside the frame.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes and not overlap the frame.
    pub unsafe fn read_raw(&self, offset: usize, dst: *mut u8, len: usize) -> bool {
        if offset > self.len || len > self.len - offset {
            return false;
        }
        // SAFETY: bounds checked; caller guarantees `dst`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst, len) };
        true
    }
}

/// A point-to-point frame carrier. One `Device` value is one connection.
///
/// Fast-path methods (`send_frame`, `recv_frame`, `doorbell`) must not block, allocate
/// or make a system call in the steady state, except `doorbell` when the peer sleeps.
pub trait Device {
    /// Largest frame (header and payload) that `send_frame` accepts.
    fn max_frame_len(&self) -> usize;

    /// Reserves `len` bytes, lets `fill` write the whole frame, and publishes it to
    /// the peer (without waking it: see [`Device::doorbell`]). Returns `Ok(false)` if
    /// the device has no room now; `fill` is then not called.
    fn send_frame(
        &mut self,
        len: usize,
        fill: &mut dyn FnMut(&mut FrameWriter<'_>),
    ) -> Result<bool, DeviceError>;

    /// If a frame has arrived, passes it to `handle`, then releases it. Returns
    /// whether there was one. A malformed frame is counted in
    /// [`DeviceStats::frames_rejected`] and reported as [`DeviceError::Corrupt`].
    fn recv_frame(&mut self, handle: &mut dyn FnMut(&RxFrame<'_>)) -> Result<bool, DeviceError>;

    /// Wakes the peer if it announced that it sleeps; free otherwise.
    fn doorbell(&mut self) -> Result<(), DeviceError>;

    /// Announces that this side is about to sleep, so the peer's next doorbell wakes
    /// it. Returns `Ok(false)` if frames are already waiting (do not sleep then).
    fn arm_sleep(&mut self) -> Result<bool, DeviceError>;

    /// Withdraws the announcement made by [`Device::arm_sleep`].
    fn disarm_sleep(&mut self);

    /// An fd that becomes readable (or hangs up) when the peer closes or dies; the
    /// engine includes it in its sleep so a dead peer wakes it.
    fn event_fd(&self) -> Option<RawFd>;

    /// Checks, with a system call if needed, that the peer is still there.
    fn check_peer(&mut self) -> Result<(), DeviceError>;

    /// True if [`Device::remote_read`] can move bytes from the peer's memory.
    fn supports_remote_read(&self) -> bool {
        false
    }

    /// Copies `len` bytes at `remote_addr` in the peer's address space to `dst`
    /// (single-copy transfer).
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes.
    unsafe fn remote_read(&mut self, remote_addr: u64, dst: *mut u8, len: usize) -> Result<(), DeviceError> {
        let _ = (remote_addr, dst, len);
        Err(DeviceError::Unsupported)
    }

    /// Orderly shutdown: tells the peer no more frames will come.
    fn shutdown(&mut self);

    /// After [`Device::shutdown`]: does housekeeping (acknowledgements,
    /// retransmissions) and returns true while the device still needs such passes
    /// to get what it accepted to the peer. Devices that never lose frames are done
    /// at once.
    fn drain(&mut self) -> bool {
        false
    }

    /// Nanoseconds until the device needs a progress pass even if nothing arrives
    /// (a retransmission or acknowledgement timer), or `None` if it never does on its
    /// own. A sleeping worker wakes up by then.
    fn timer_ns(&self) -> Option<u64> {
        None
    }

    /// Counters.
    fn stats(&self) -> DeviceStats;
}

impl<D: Device + ?Sized> Device for Box<D> {
    fn max_frame_len(&self) -> usize {
        (**self).max_frame_len()
    }
    fn send_frame(
        &mut self,
        len: usize,
        fill: &mut dyn FnMut(&mut FrameWriter<'_>),
    ) -> Result<bool, DeviceError> {
        (**self).send_frame(len, fill)
    }
    fn recv_frame(&mut self, handle: &mut dyn FnMut(&RxFrame<'_>)) -> Result<bool, DeviceError> {
        (**self).recv_frame(handle)
    }
    fn doorbell(&mut self) -> Result<(), DeviceError> {
        (**self).doorbell()
    }
    fn arm_sleep(&mut self) -> Result<bool, DeviceError> {
        (**self).arm_sleep()
    }
    fn disarm_sleep(&mut self) {
        (**self).disarm_sleep()
    }
    fn event_fd(&self) -> Option<RawFd> {
        (**self).event_fd()
    }
    fn check_peer(&mut self) -> Result<(), DeviceError> {
        (**self).check_peer()
    }
    fn supports_remote_read(&self) -> bool {
        (**self).supports_remote_read()
    }
    unsafe fn remote_read(&mut self, remote_addr: u64, dst: *mut u8, len: usize) -> Result<(), DeviceError> {
        // SAFETY: forwarded contract.
        unsafe { (**self).remote_read(remote_addr, dst, len) }
    }
    fn shutdown(&mut self) {
        (**self).shutdown()
    }
    fn drain(&mut self) -> bool {
        (**self).drain()
    }
    fn timer_ns(&self) -> Option<u64> {
        (**self).timer_ns()
    }
    fn stats(&self) -> DeviceStats {
        (**self).stats()
    }
}
