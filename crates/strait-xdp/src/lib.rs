//! strait's raw-Ethernet device: the M-VIA idea on today's kernels.
//!
//! Frames of strait's EtherType ([`ETHERTYPE`], IEEE local experimental) are steered
//! by a tiny XDP program to an AF_XDP socket and handled entirely in user space; no
//! IP, no UDP, no socket buffers. [`XdpLink`] is a [`strait_core::Link`] over that
//! socket, addressed by MAC; wrap it in [`strait_core::Reliable`] for the native API:
//!
//! ```no_run
//! use strait_core::{Config, Reliable, ReliableConfig, Worker};
//! use strait_xdp::{Mac, XdpConfig, XdpLink};
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let peer: Mac = "02:00:00:00:00:02".parse()?;
//! let link = XdpLink::open(&XdpConfig::new("eth1"), peer)?;
//! let mut worker = Worker::new(Config::from_env()?)?;
//! let ep = worker.attach(Reliable::new(link, ReliableConfig::from_env()?));
//! # let _ = ep; Ok(()) }
//! ```
//!
//! [`XdpPort`] shares one socket among many connections: each [`XdpChannel`] is a
//! `Link` to one channel of a peer, told apart by channel ids in a small header
//! after the Ethernet header (see [`port`]).
//!
//! Every other frame (IP, ARP, other EtherTypes) reaches the kernel untouched.
//! Copy mode where the driver has no zero-copy support (veth), zero-copy where it
//! has; the need-wakeup protocol is used, so an idle link costs no CPU. The program
//! is attached through a BPF link, which the kernel removes when the process exits
//! or crashes.

use std::io;

use thiserror::Error;

pub mod bpf;
pub mod link;
pub mod netif;
pub mod port;
pub mod xsk;

pub use link::{XdpConfig, XdpLink, ETHERTYPE};
pub use netif::{Mac, Neighbours};
pub use port::{PortStats, XdpChannel, XdpPort, MUX_HEADER};
pub use xsk::{XskGeometry, XskMode};

/// Errors of the xdp device.
#[derive(Debug, Error)]
pub enum XdpError {
    /// The kernel refused an operation that needs privileges (CAP_NET_ADMIN,
    /// CAP_BPF or CAP_SYS_ADMIN). Fall back to the udp device.
    #[error("cannot {what}: {source} (AF_XDP needs CAP_NET_ADMIN and CAP_BPF, e.g. root; use the udp device instead)")]
    Privilege {
        /// What was refused.
        what: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The kernel's verifier rejected the steering program.
    #[error("the kernel rejected the XDP program: {source}\n{log}")]
    Verifier {
        /// The OS error.
        #[source]
        source: io::Error,
        /// The verifier's log.
        log: String,
    },
    /// An interface could not be inspected.
    #[error("interface {ifname}: {source}")]
    Interface {
        /// The interface.
        ifname: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A bad setting.
    #[error("{0}")]
    Config(String),
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

impl XdpError {
    pub(crate) fn privilege(what: &'static str, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) => XdpError::Privilege { what, source },
            _ => XdpError::Io { op: what, source },
        }
    }
}
