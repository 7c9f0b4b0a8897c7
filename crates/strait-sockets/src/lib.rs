//! The logic of `strait run` (`libstrait_preload.so` is this crate plus thin C shims):
//! it carries TCP
//! connections between two processes that both run under strait on this host over
//! per-connection shared memory, and UDP datagrams between their sockets over
//! per-(sender, receiver) message rings, with no change to either program.
//!
//! * [`discover`]: how the two ends find each other (abstract Unix socket named by
//!   network namespace and port; never a byte on the TCP connection).
//! * [`conn`]: the shared-memory connection (two byte rings, eventfd doorbells).
//! * [`udp`]: UDP sockets (markers by port and address, message rings, the kernel
//!   socket kept for everything else).
//! * [`poll`]: `poll`/`select`/`epoll` over mixed accelerated and kernel descriptors.
//!
//! Every exported function looks the descriptor up first; a descriptor that is not an
//! accelerated connection goes straight to the real libc function. A panic inside
//! this library never crosses into the host program: the call falls back to libc.

pub mod calls;
mod conn;
mod discover;
pub mod exec;
mod local;
mod pass;
mod poll;
mod real;
mod remote;
mod sock;
mod stats;
pub mod stdio;
mod table;
mod trust;
mod udp;

