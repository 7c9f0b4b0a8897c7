//! strait's udp device: the modern form of Asynchronous UDP.
//!
//! [`UdpLink`] is a connected UDP socket as a [`strait_core::Link`]; wrapped in
//! [`strait_core::Reliable`] (see [`UdpLink::reliable`]) it is a
//! [`strait_core::Device`] for the native messaging API. Sends return as soon as
//! they are queued and move data from the link's registered transmit slots; receives
//! are posted before packets arrive (a multishot receive on a provided-buffer ring)
//! and land in posted buffers.
//!
//! Submissions go through a two-level queue: the reliability layer's unbounded
//! software queue in front of the link's bounded device ring (the io_uring
//! submission queue), with one doorbell (`io_uring_enter`) per batch. Where io_uring
//! is refused the link falls back to `sendmmsg`/`recvmmsg`, and says so once on
//! stderr; where `sendmmsg`/`recvmmsg` carried a lone datagram faster in a short
//! measurement on this host ([`calibrate`]), `auto` takes them from the start;
//! `STRAIT_UDP_BACKEND=uring|mmsg` forces one. See `docs/UDP.md`.
//!
//! Integrity: UDP's own checksum (verified by the kernel or the NIC) plus the
//! reliability layer's CRC32C on every packet.

pub mod calibrate;
mod config;
mod link;
mod mmsg;
pub mod netns;
mod sys;
mod uring;

pub use config::{Backend, UdpConfig};
pub use link::{UdpError, UdpLink, UdpStats, STREAM_MIN, STREAM_RUN};

/// The udp device: the reliability layer over a [`UdpLink`].
pub type UdpDevice = strait_core::Reliable<UdpLink>;
