//! strait's shared-memory device: one connection between two processes on a host.
//!
//! The connecting side creates a sealed memfd holding a small header and two frame
//! rings (one per direction), and hands it, together with its worker's eventfd, to
//! the accepting side over a Unix socket (SCM_RIGHTS). Nothing is ever created in
//! the filesystem or in `/dev/shm`: only the two ends of the connection hold the
//! memory. The accepting side answers with its own eventfd. After that the socket
//! carries nothing; it stays open as the liveness signal (a dead peer's socket hangs
//! up and wakes a sleeping worker).
//!
//! * Frames move through [`ring`]s: no system call per frame.
//! * A doorbell costs a system call (an eventfd write) only when the peer announced
//!   that it sleeps, either waiting for frames or for room in a full ring.
//! * Large messages are moved once, by the receiver, straight from the sender's
//!   buffer with `process_vm_readv` (cross-memory attach), when the kernel allows it
//!   for the peer (same user, no Yama restriction); each connection probes this at
//!   setup. Otherwise the engine's pipelined copy through the ring is used.
//!
//! ```no_run
//! use strait_core::{Config, MemoryRegion, Worker};
//! use strait_shm::{ShmConfig, ShmDevice, ShmListener};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Server process:
//! let listener = ShmListener::bind("my-service")?;
//! let mut server = Worker::new(Config::from_env()?)?;
//! let ep = server.attach(listener.accept(server.notifier())?);
//! # let _ = ep;
//! // Client process:
//! let mut client = Worker::new(Config::from_env()?)?;
//! let ep = client.attach(ShmDevice::connect("my-service", &ShmConfig::from_env()?, client.notifier())?);
//! # let _ = ep; Ok(()) }
//! ```

pub mod ring;

#[cfg(not(loom))]
mod device;
#[cfg(not(loom))]
mod sys;

#[cfg(not(loom))]
pub use device::{ListenerStats, PeerPolicy, ShmConfig, ShmDevice, ShmError, ShmListener};
