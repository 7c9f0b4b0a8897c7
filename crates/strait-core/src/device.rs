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
    /// Remote writes performed (this side's part of split transfers).
    pub remote_writes: u64,
}

/// The way a rendezvous message's bytes move, as a device measured fastest on its
/// host ([`Device::preferred_rndv`], for [`RndvMode::Auto`](crate::RndvMode::Auto)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RndvPath {
    /// The pipelined copy through the device.
    Copy,
    /// The receiver reads the whole message from the sender's memory.
    RemoteRead,
    /// Both sides copy one part each at once: the receiver reads, the sender writes.
    Split,
}

/// Write access to one frame's bytes while the device has it reserved.
///
/// The memory may be shared with another process, so it is never exposed as a Rust
/// slice; every access is a bounds-checked copy. A frame is either one contiguous
/// range or a sequence of equal pieces in separate buffers (a device that cuts
/// frames into packets lets the engine write straight into them).
pub struct FrameWriter<'a> {
    ptr: *mut u8,
    len: usize,
    /// Scattered frame: the pieces' start addresses and the length of every piece
    /// but the last.
    pieces: Option<(&'a [*mut u8], usize)>,
    _frame: PhantomData<&'a mut [u8]>,
}

impl<'a> FrameWriter<'a> {
    /// Wraps raw frame memory.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes for `'a`, and no other code in
    /// this process may access those bytes during `'a`.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Self {
        FrameWriter { ptr, len, pieces: None, _frame: PhantomData }
    }

    /// Wraps a frame of `len` bytes scattered over `pieces`: bytes
    /// `[k * piece_len, (k + 1) * piece_len)` live at `pieces[k]`.
    ///
    /// # Safety
    /// `piece_len` must be positive and `pieces` must hold at least
    /// `len.div_ceil(piece_len)` pointers, each valid for writes of `piece_len`
    /// bytes (the last for the remainder) for `'a`, pairwise disjoint, and not
    /// accessed by other code in this process during `'a`.
    pub unsafe fn from_pieces(pieces: &'a [*mut u8], piece_len: usize, len: usize) -> Self {
        debug_assert!(piece_len > 0 && pieces.len() >= len.div_ceil(piece_len));
        FrameWriter { ptr: std::ptr::null_mut(), len, pieces: Some((pieces, piece_len)), _frame: PhantomData }
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
        let Some((pieces, piece_len)) = self.pieces else {
            // SAFETY: bounds checked above; `from_raw`'s contract makes the range writable.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
            return;
        };
        let (mut at, mut rest) = (offset, src);
        while !rest.is_empty() {
            let (k, within) = (at / piece_len, at % piece_len);
            let n = rest.len().min(piece_len - within);
            // SAFETY: `at + n <= len` (checked above), so piece `k` exists and
            // `[within, within + n)` lies inside it (`from_pieces`' contract).
            unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), pieces[k].add(within), n) };
            at += n;
            rest = &rest[n..];
        }
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

    /// Under [`RndvMode::Auto`](crate::RndvMode::Auto): the fastest way to move a
    /// rendezvous message on this device and host (measured, not assumed: the shm
    /// device calibrates it). The default keeps the pipelined copy.
    fn preferred_rndv(&self) -> RndvPath {
        RndvPath::Copy
    }

    /// True if [`Device::remote_write`] can move bytes into the peer's memory.
    fn supports_remote_write(&self) -> bool {
        false
    }

    /// True if the peer may reach this process's memory by the addresses this side
    /// gives it (a rendezvous announcement's buffer): the process that made the
    /// connection, whose id the peer knows. False in a child made by `fork` that
    /// uses the connection, whose buffers lie at the same addresses in another
    /// process: its announcements then offer no single copy, and the peer takes the
    /// bytes through the device instead of reading the parent's stale memory. The
    /// default, true, suits devices without remote access or in one address space.
    fn peer_reaches_us(&self) -> bool {
        true
    }

    /// True if a split transfer may be asked of the peer now: it has not announced
    /// that it sleeps (a sleeping sender would start its part only after a wake-up,
    /// tens of microseconds), and its writes would land in this process (after a
    /// fork they would land in the process that made the connection). The default,
    /// true, suits devices that cannot tell.
    fn split_now(&self) -> bool {
        true
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

    /// Copies `len` bytes from `src` to `remote_addr` in the peer's address space
    /// (this side's part of a split transfer; the peer chose the address, inside its
    /// own receive buffer).
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes.
    unsafe fn remote_write(
        &mut self,
        remote_addr: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        let _ = (remote_addr, src, len);
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

    /// Credits (eager messages outstanding per endpoint) this device wants if that
    /// is more than the default [`crate::Config::credits`], or `None`. The engine takes
    /// the larger of the two when the device is attached, unless the credits were
    /// configured to something other than the default (then they are kept). A device whose doorbells cost system
    /// calls asks for more, so that a stream of small messages is not held to a
    /// credit return (and a doorbell on each side) per half of the default window.
    fn credits_hint(&self) -> Option<u16> {
        None
    }

    /// Counters.
    fn stats(&self) -> DeviceStats;

    /// A one-line account of the device's internal state, for diagnostics (empty if
    /// the device has nothing to add to its counters).
    fn describe(&self) -> String {
        String::new()
    }
}

/// Every method is forwarded, the provided ones included (a provided method left
/// out here would silently answer its default for a boxed device).
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
    fn preferred_rndv(&self) -> RndvPath {
        (**self).preferred_rndv()
    }
    fn supports_remote_write(&self) -> bool {
        (**self).supports_remote_write()
    }
    fn split_now(&self) -> bool {
        (**self).split_now()
    }
    fn peer_reaches_us(&self) -> bool {
        (**self).peer_reaches_us()
    }
    unsafe fn remote_read(&mut self, remote_addr: u64, dst: *mut u8, len: usize) -> Result<(), DeviceError> {
        // SAFETY: forwarded contract.
        unsafe { (**self).remote_read(remote_addr, dst, len) }
    }
    unsafe fn remote_write(
        &mut self,
        remote_addr: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: forwarded contract.
        unsafe { (**self).remote_write(remote_addr, src, len) }
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
    fn credits_hint(&self) -> Option<u16> {
        (**self).credits_hint()
    }
    fn stats(&self) -> DeviceStats {
        (**self).stats()
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device whose provided methods all answer something other than their
    /// defaults, to see that `Box<D>` forwards them.
    struct NonDefault;

    impl Device for NonDefault {
        fn max_frame_len(&self) -> usize {
            7
        }
        fn send_frame(
            &mut self,
            _: usize,
            _: &mut dyn FnMut(&mut FrameWriter<'_>),
        ) -> Result<bool, DeviceError> {
            Ok(true)
        }
        fn recv_frame(&mut self, _: &mut dyn FnMut(&RxFrame<'_>)) -> Result<bool, DeviceError> {
            Ok(true)
        }
        fn doorbell(&mut self) -> Result<(), DeviceError> {
            Ok(())
        }
        fn arm_sleep(&mut self) -> Result<bool, DeviceError> {
            Ok(false)
        }
        fn disarm_sleep(&mut self) {}
        fn event_fd(&self) -> Option<RawFd> {
            Some(99)
        }
        fn check_peer(&mut self) -> Result<(), DeviceError> {
            Err(DeviceError::PeerGone("probe".into()))
        }
        fn supports_remote_read(&self) -> bool {
            true
        }
        unsafe fn remote_read(&mut self, _: u64, _: *mut u8, _: usize) -> Result<(), DeviceError> {
            Ok(())
        }
        fn preferred_rndv(&self) -> RndvPath {
            RndvPath::Split
        }
        fn supports_remote_write(&self) -> bool {
            true
        }
        fn split_now(&self) -> bool {
            false
        }
        fn peer_reaches_us(&self) -> bool {
            false
        }
        unsafe fn remote_write(&mut self, _: u64, _: *const u8, _: usize) -> Result<(), DeviceError> {
            Ok(())
        }
        fn shutdown(&mut self) {}
        fn drain(&mut self) -> bool {
            true
        }
        fn timer_ns(&self) -> Option<u64> {
            Some(5)
        }
        fn credits_hint(&self) -> Option<u16> {
            Some(300)
        }
        fn stats(&self) -> DeviceStats {
            DeviceStats { frames_sent: 3, ..DeviceStats::default() }
        }
        fn describe(&self) -> String {
            "probe".into()
        }
    }

    fn answers_like_the_probe(mut d: impl Device) {
        assert!(d.supports_remote_read());
        let mut x = 0u8;
        // SAFETY: `x` is valid for one byte (and the probe does not touch it).
        assert!(unsafe { d.remote_read(0, &mut x, 1) }.is_ok());
        // SAFETY: `x` is valid for one byte.
        assert!(unsafe { d.remote_write(0, &x, 1) }.is_ok());
        assert!(d.supports_remote_write() && !d.split_now() && !d.peer_reaches_us());
        assert_eq!(d.preferred_rndv(), RndvPath::Split);
        assert!(d.drain());
        assert_eq!(d.timer_ns(), Some(5));
        assert_eq!(d.credits_hint(), Some(300));
        assert_eq!(d.describe(), "probe");
        assert_eq!((d.max_frame_len(), d.event_fd(), d.stats().frames_sent), (7, Some(99), 3));
        assert!(!d.arm_sleep().expect("probe"));
        assert!(d.check_peer().is_err());
    }

    #[test]
    fn a_boxed_device_forwards_every_provided_method() {
        answers_like_the_probe(NonDefault);
        answers_like_the_probe(Box::new(NonDefault));
        answers_like_the_probe(Box::new(NonDefault) as Box<dyn Device>);
        answers_like_the_probe(Box::new(Box::new(NonDefault)));
    }

    #[test]
    fn scattered_writes_land_in_their_pieces() {
        let mut bufs = [[0u8; 4]; 3];
        let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
        // SAFETY: three disjoint 4-byte buffers alive for the writer's life; the
        // frame is 10 bytes (4 + 4 + 2).
        let mut w = unsafe { FrameWriter::from_pieces(&ptrs, 4, 10) };
        w.write(0, &[1, 2, 3]);
        w.write(3, &[4, 5, 6, 7, 8, 9]);
        w.write(9, &[10]);
        assert_eq!(bufs, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]);
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn a_write_past_a_scattered_frame_panics() {
        let mut bufs = [[0u8; 4]; 2];
        let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
        // SAFETY: as above; the frame is 6 bytes.
        let mut w = unsafe { FrameWriter::from_pieces(&ptrs, 4, 6) };
        w.write(5, &[1, 2]);
    }
}
