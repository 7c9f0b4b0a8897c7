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
//! # Trust
//!
//! * **Other users.** Both sides check the peer's credentials as the kernel recorded
//!   them (SO_PEERCRED) against [`PeerPolicy`] before any descriptor leaves the
//!   process: by default only the same effective uid and root. A connector that
//!   finds a name held by someone else gets [`ShmError::PeerRefused`]; a listener
//!   closes a refused connection unanswered and counts it ([`ListenerStats`]).
//!   Path names get a socket file of mode `0600` (default policy).
//! * **Connectors.** A listener never blocks on one connector: half-done handshakes
//!   wait in a table capped per listener and per uid (oldest dropped, 5 s at most),
//!   and a connector cannot ask for rings larger than the listener's
//!   [`ShmConfig::ring_bytes`].
//! * **A hostile peer.** Everything the peer can write (ring positions, frame
//!   headers and lengths, sleep and close flags, protocol headers) is validated
//!   against bounds this process set; a violation fails the connection with
//!   `Corrupt`. The pid for `process_vm_readv` is the kernel's (SO_PEERCRED, with a
//!   pidfd to detect reuse), never read from shared memory; reads only go into the
//!   posted buffer, never past it; the peer's doorbell must be an eventfd and is
//!   written only when that cannot block.
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

pub mod area;
#[cfg(not(loom))]
pub mod calibrate;
pub mod dgram;
pub mod ring;
pub mod stream;

#[cfg(not(loom))]
mod device;
#[cfg(not(loom))]
mod sys;

#[cfg(not(loom))]
pub use device::{ListenerStats, PeerPolicy, ShmConfig, ShmDevice, ShmError, ShmListener};
