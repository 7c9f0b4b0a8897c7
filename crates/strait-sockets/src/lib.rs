//! The logic of `strait run`: `libstrait_preload.so` is this crate plus thin C shims
//! (crate `strait-preload`). It carries TCP connections between two processes that
//! both run under strait on this host over per-connection shared memory (or, with
//! `--peers`, over a strait device to another host), and UDP datagrams between their
//! sockets over per-(sender, receiver) message rings, with no change to either
//! program.
//!
//! * `discover`: how the two ends find each other (abstract Unix socket named by
//!   network namespace and port; never a byte on the TCP connection).
//! * `conn`: the shared-memory connection (two byte rings, eventfd doorbells).
//! * `udp`: UDP sockets (markers by port and address, message rings, the kernel
//!   socket kept for everything else).
//! * `table`: the one descriptor table (`Socket`: TCP, UDP or listening).
//! * `poll`, `epoll`: `poll`/`select`/`epoll` over mixed accelerated and kernel
//!   descriptors.
//! * [`calls`], [`exec`], [`stdio`]: the functions the shims forward to, with the
//!   signatures of the libc functions they stand for.
//!
//! Every call looks the descriptor up first; a descriptor that is not an accelerated
//! connection goes straight to the real libc function. A panic inside this library
//! never crosses into the host program: the call falls back to libc. The modules
//! are layered (below); `tests/layers.rs` checks that none imports a higher layer.

// Layers, lowest first; a module imports only modules of its own or a lower layer.
// System: what the library asks of the kernel and keeps for itself.
mod fds;
mod fdtable;
mod hub;
mod local;
mod pair;
mod real;
mod settings;
pub mod sigmask;
mod sock;
mod trust;
mod vault;
mod wait;
mod worth;
// Transports: one connection or socket over shared memory (or a far end).
mod conn;
mod udp;
// One entry type for every kind of socket (and a listening socket's sides), and
// the epoll interest lists.
mod epoll;
mod listening;
mod socket;
// The descriptor table.
mod table;
// Setup: discovery on this host and to other hosts.
mod discover;
mod remote;
// Process events and settling.
mod process;
mod settle;
// Handing connections over: exec, descriptor passing.
pub mod exec;
mod pass;
// Readiness over mixed sets.
mod poll;
// The calls.
pub mod calls;
mod stats;
pub mod stdio;

/// The version of the connection mapping's layout that a hello names (tests that
/// play a peer by hand write it).
pub use conn::VERSION as LAYOUT_VERSION;

/// Sets the library up in a new process (called once, when it is loaded, by the
/// cdylib's initialiser).
pub fn init() {
    // First: a handle on `/proc` for every later look-up, taken before the program
    // can `chroot` away from it.
    if let Some(fd) = strait_sys::procfs::open_root() {
        strait_sys::procfs::set_root(fds::keep(fd));
    }
    process::start();
    stats::init();
    let _ = std::panic::catch_unwind(exec::adopt);
    let _ = std::panic::catch_unwind(stdio::adopt_standard_streams);
}

/// How the library carries a descriptor of the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carried {
    /// A TCP connection over shared memory with a process on this host.
    SharedMemory,
    /// A TCP connection to another host over a strait device.
    OtherHost,
    /// A TCP connection still being set up (a connector whose acceptor has not
    /// answered yet).
    Settling,
    /// A UDP socket (datagrams to strait receivers go through shared memory).
    Udp,
}

/// How the library carries `fd`, or `None` if the kernel alone does (for tests and
/// diagnostics; answers from the descriptor table, without settling anything).
pub fn carried(fd: libc::c_int) -> Option<Carried> {
    Some(match table::get(fd)? {
        socket::Socket::Udp(_) => Carried::Udp,
        socket::Socket::Tcp(c) if c.remote.get().is_some() => Carried::OtherHost,
        socket::Socket::Tcp(c) if c.attached() => Carried::SharedMemory,
        socket::Socket::Tcp(_) => Carried::Settling,
        socket::Socket::Listening(_) => return None,
    })
}
