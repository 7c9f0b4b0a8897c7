//! The interface between the reliability layer and an unreliable datagram carrier
//! (the udp device, the xdp device, the simulator).
//!
//! A [`Link`] moves *datagrams* to exactly one peer with no promise at all: any
//! datagram may be lost, duplicated, reordered, truncated or corrupted, and strangers
//! may inject their own. [`crate::reliable::Reliable`] turns a `Link` into a
//! [`crate::Device`] (in order, exactly once, or a clear error).
//!
//! Transmit buffers belong to the link, so that a link can hand them to the kernel
//! without a copy (io_uring registered buffers, an AF_XDP UMEM): the reliability layer
//! takes a slot with [`Link::tx_alloc`], writes a packet into it once, submits it with
//! [`Link::send`] as often as it needs to (first transmission and retransmissions),
//! and gives it back with [`Link::tx_release`] once the peer acknowledged it. The link
//! recycles a released slot only after every transmission of it has completed.
//!
//! Submissions are batched: [`Link::send`] only queues, [`Link::flush`] is the
//! doorbell (at most one system call per batch).

use std::io;
use std::os::fd::RawFd;

use thiserror::Error;

/// Errors a link reports to the reliability layer.
#[derive(Debug, Error)]
pub enum LinkError {
    /// The link can never carry another datagram (its socket or interface is gone).
    #[error("link is down: {0}")]
    Down(String),
    /// A slot index that the link never handed out, or a length beyond [`Link::mtu`]:
    /// a bug in the caller.
    #[error("bad transmit slot {slot} (length {len})")]
    BadSlot {
        /// Offending slot.
        slot: u32,
        /// Offending length.
        len: usize,
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

/// Counters a link keeps about itself; cheap to read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LinkStats {
    /// Datagrams handed to the carrier (each retransmission counts).
    pub datagrams_sent: u64,
    /// Datagrams received (before any check by the reliability layer).
    pub datagrams_received: u64,
    /// Datagrams the link itself dropped on receive (wrong source, too long ...).
    pub datagrams_dropped: u64,
    /// Doorbells (system calls) made to submit or reap datagrams.
    pub doorbells: u64,
    /// Sends refused because the device ring was full.
    pub send_full: u64,
    /// Doorbells rung by [`Link::push`] with datagrams queued (also in `doorbells`
    /// when the link counts those): new flights sent without moderation. Links
    /// without moderation leave it 0.
    pub pushes: u64,
    /// Datagrams that arrived marked Congestion Experienced by the path (ECN CE):
    /// see [`Link::ce_marked`].
    pub ce_marked: u64,
}

/// An unreliable datagram carrier to one peer. One `Link` value is one connection.
///
/// Methods must not block. `send`, `recv` and `tx_*` must not allocate or make a
/// system call in the steady state; `flush` makes at most one per batch.
pub trait Link {
    /// Largest datagram (bytes) that [`Link::send`] accepts; every transmit slot
    /// holds at least this much.
    fn mtu(&self) -> usize;

    /// Takes a free transmit slot, or `None` if all are in use (the caller keeps its
    /// packet queued and retries after acknowledgements free some).
    fn tx_alloc(&mut self) -> Option<u32>;

    /// The memory of a slot taken with [`Link::tx_alloc`] and not yet released:
    /// exactly [`Link::mtu`] bytes, at the same address for as long as the slot is
    /// taken (the caller may keep a pointer to it meanwhile). Must not be written
    /// while a transmission of the slot is queued and not yet flushed (the caller
    /// writes a slot only once, before its first `send`).
    fn tx_buf(&mut self, slot: u32) -> &mut [u8];

    /// Queues the first `len` bytes of `slot` for transmission. `Ok(false)` if the
    /// device ring is full now (nothing queued; retry after a `flush`).
    fn send(&mut self, slot: u32, len: usize) -> Result<bool, LinkError>;

    /// Gives a slot back; the link reuses it once no transmission of it is pending.
    fn tx_release(&mut self, slot: u32);

    /// Submits every queued datagram and reaps completed transmissions: the doorbell.
    fn flush(&mut self) -> Result<(), LinkError>;

    /// Submits every queued datagram now, whatever doorbell moderation the link
    /// does: the reliability layer calls this instead of [`Link::flush`] when the
    /// queued packets start a new flight (nothing of the connection was
    /// unacknowledged before them, Nagle's condition), so someone is waiting for
    /// them and no more are coming soon. A link that also moderates receiving stops
    /// doing so until a stream shows again: the answer is what is awaited next.
    /// Links without moderation keep the default, a flush.
    fn push(&mut self) -> Result<(), LinkError> {
        self.flush()
    }

    /// If a datagram has arrived, passes its bytes to `handle` (valid only during the
    /// call) and releases it. Returns whether there was one.
    fn recv(&mut self, handle: &mut dyn FnMut(&[u8])) -> Result<bool, LinkError>;

    /// The link's clock, in nanoseconds from an arbitrary origin; monotonic. Real
    /// links use `CLOCK_MONOTONIC`; the simulator returns its virtual time.
    fn now_ns(&self) -> u64;

    /// An fd that becomes readable when a datagram arrives, for the worker's sleep;
    /// `None` if the link cannot be slept on (the simulator).
    fn event_fd(&self) -> Option<RawFd>;

    /// Prepares to sleep on [`Link::event_fd`]. `Ok(false)` if datagrams are already
    /// waiting (do not sleep then).
    fn arm_sleep(&mut self) -> Result<bool, LinkError> {
        Ok(true)
    }

    /// Withdraws [`Link::arm_sleep`].
    fn disarm_sleep(&mut self) {}

    /// Counters.
    fn stats(&self) -> LinkStats;

    /// How many transmit slots this link has in all, if it knows: the reliability
    /// layer keeps its window 16 below (a window its own unacknowledged packets
    /// could fill would leave no slot for the acknowledgements and retransmissions
    /// that free them).
    fn tx_slots(&self) -> Option<usize> {
        None
    }

    /// Whether the carrier itself verifies every datagram's bytes before the link
    /// hands them over (UDP's checksum, checked by the kernel or the NIC). The
    /// reliability layer then accepts packets whose CRC covers only the header, and
    /// sends such packets unless told otherwise: a second pass over every payload
    /// byte would find nothing the carrier did not. Links over raw frames or the
    /// simulator's corrupting network keep the default, `false`.
    fn carrier_checksum(&self) -> bool {
        false
    }

    /// How many datagrams have arrived marked Congestion Experienced by the path
    /// (ECN: a router's queue filling marks the packet instead of dropping it),
    /// cumulative. The reliability layer echoes it to the sender, which reduces
    /// its congestion window as for a loss but has nothing to resend. Links whose
    /// carrier has no ECN field (raw frames, the simulator) or that do not ask for
    /// it keep the default, 0. Must be cheap: read after every receive.
    fn ce_marked(&self) -> u64 {
        0
    }

    /// Stops marking datagrams ECN-capable, for a path that seems to drop them (a
    /// middlebox that does is rare but real: QUIC validates ECN for the same
    /// reason). True if marking was on and is now off. The reliability layer calls
    /// it when its connection setup goes unanswered for several tries.
    fn ecn_off(&mut self) -> bool {
        false
    }
}

impl<L: Link + ?Sized> Link for Box<L> {
    fn mtu(&self) -> usize {
        (**self).mtu()
    }
    fn tx_slots(&self) -> Option<usize> {
        (**self).tx_slots()
    }
    fn carrier_checksum(&self) -> bool {
        (**self).carrier_checksum()
    }
    fn ce_marked(&self) -> u64 {
        (**self).ce_marked()
    }
    fn ecn_off(&mut self) -> bool {
        (**self).ecn_off()
    }
    fn tx_alloc(&mut self) -> Option<u32> {
        (**self).tx_alloc()
    }
    fn tx_buf(&mut self, slot: u32) -> &mut [u8] {
        (**self).tx_buf(slot)
    }
    fn send(&mut self, slot: u32, len: usize) -> Result<bool, LinkError> {
        (**self).send(slot, len)
    }
    fn tx_release(&mut self, slot: u32) {
        (**self).tx_release(slot)
    }
    fn flush(&mut self) -> Result<(), LinkError> {
        (**self).flush()
    }
    fn push(&mut self) -> Result<(), LinkError> {
        (**self).push()
    }
    fn recv(&mut self, handle: &mut dyn FnMut(&[u8])) -> Result<bool, LinkError> {
        (**self).recv(handle)
    }
    fn now_ns(&self) -> u64 {
        (**self).now_ns()
    }
    fn event_fd(&self) -> Option<RawFd> {
        (**self).event_fd()
    }
    fn arm_sleep(&mut self) -> Result<bool, LinkError> {
        (**self).arm_sleep()
    }
    fn disarm_sleep(&mut self) {
        (**self).disarm_sleep()
    }
    fn stats(&self) -> LinkStats {
        (**self).stats()
    }
}

/// A pool of fixed-size transmit slots with release-after-completion bookkeeping,
/// for links whose buffers are plain memory (the simulator, the `sendmmsg` path).
#[derive(Debug)]
pub struct SlotPool {
    mem: Vec<u8>,
    slot_len: usize,
    free: Vec<u32>,
    /// Per slot: transmissions queued or in flight.
    pending: Vec<u32>,
    /// Per slot: released by the owner, waiting for `pending` to reach zero.
    released: Vec<bool>,
}

impl SlotPool {
    /// `count` slots of `slot_len` bytes each.
    pub fn new(count: u32, slot_len: usize) -> Self {
        SlotPool {
            mem: vec![0; count as usize * slot_len],
            slot_len,
            free: (0..count).rev().collect(),
            pending: vec![0; count as usize],
            released: vec![false; count as usize],
        }
    }

    /// Number of slots.
    pub fn count(&self) -> u32 {
        self.pending.len() as u32
    }

    /// Bytes per slot.
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Takes a free slot.
    pub fn alloc(&mut self) -> Option<u32> {
        let s = self.free.pop()?;
        self.released[s as usize] = false;
        Some(s)
    }

    /// The slot's bytes.
    ///
    /// # Panics
    /// If `slot` is out of range (a caller bug).
    pub fn buf(&mut self, slot: u32) -> &mut [u8] {
        let start = slot as usize * self.slot_len;
        &mut self.mem[start..start + self.slot_len]
    }

    /// The first `len` bytes of the slot, or `None` if slot or length is invalid.
    pub fn bytes(&self, slot: u32, len: usize) -> Option<&[u8]> {
        if slot >= self.count() || len > self.slot_len {
            return None;
        }
        let start = slot as usize * self.slot_len;
        Some(&self.mem[start..start + len])
    }

    /// Notes that a transmission of `slot` was queued.
    pub fn begin_tx(&mut self, slot: u32) {
        self.pending[slot as usize] += 1;
    }

    /// Notes that a transmission of `slot` completed; recycles it if released.
    pub fn end_tx(&mut self, slot: u32) {
        let p = &mut self.pending[slot as usize];
        *p = p.saturating_sub(1);
        if *p == 0 && self.released[slot as usize] {
            self.released[slot as usize] = false;
            self.free.push(slot);
        }
    }

    /// The owner gives the slot back.
    pub fn release(&mut self, slot: u32) {
        if slot >= self.count() || self.released[slot as usize] {
            return;
        }
        if self.pending[slot as usize] == 0 {
            self.free.push(slot);
        } else {
            self.released[slot as usize] = true;
        }
    }

    /// Slots neither free nor waiting for release.
    pub fn in_use(&self) -> usize {
        self.count() as usize - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_slot_waits_for_its_transmissions() {
        let mut p = SlotPool::new(2, 16);
        let a = p.alloc().unwrap();
        let b = p.alloc().unwrap();
        assert!(p.alloc().is_none());
        p.begin_tx(a);
        p.begin_tx(a);
        p.release(a);
        assert!(p.alloc().is_none(), "a still has transmissions pending");
        p.end_tx(a);
        assert!(p.alloc().is_none());
        p.end_tx(a);
        assert_eq!(p.alloc(), Some(a));
        p.release(b);
        assert_eq!(p.alloc(), Some(b));
        assert_eq!(p.in_use(), 2);
    }
}
