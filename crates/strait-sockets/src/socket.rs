//! One entry type for every kind of socket the library carries: what the
//! descriptor table holds and what an epoll set's accelerated members are.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use libc::c_int;

use crate::conn::{Conn, Ready};
use crate::fdtable::Shared;
use crate::udp::UdpSock;

/// What one of the program's descriptors is to the library.
#[derive(Clone)]
pub enum Socket {
    /// A TCP connection carried by strait (shared memory, or a device to another
    /// host).
    Tcp(Arc<Conn>),
    /// A UDP socket (its datagrams to strait receivers go through shared memory).
    Udp(Arc<UdpSock>),
}

impl Shared for Socket {
    fn same(&self, other: &Self) -> bool {
        match (self, other) {
            (Socket::Tcp(a), Socket::Tcp(b)) => Arc::ptr_eq(a, b),
            (Socket::Udp(a), Socket::Udp(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Socket {
    /// Readiness for the program's descriptor `fd` of this member.
    pub(crate) fn readiness(&self, fd: c_int) -> Ready {
        match self {
            Socket::Tcp(c) => c.readiness(fd),
            Socket::Udp(u) => Ready {
                bits: if u.shm_readable() { libc::POLLIN } else { 0 },
                rx_tail: u.rx_mark(),
                tx_head: 0,
            },
        }
    }

    /// Sets the member's sleeping flags (reading, writing), so that the peer's next
    /// change rings its doorbell.
    pub(crate) fn announce(&self, rx: bool, tx: bool) {
        match self {
            Socket::Tcp(c) => c.announce(rx, tx),
            Socket::Udp(u) => {
                if rx {
                    u.announce();
                }
            }
        }
    }

    /// Empties the member's doorbell after a wake-up.
    pub(crate) fn drain_bell(&self) {
        match self {
            Socket::Tcp(c) => c.drain_bell(),
            Socket::Udp(u) => u.drain_bell(),
        }
    }

    /// The TCP connection, if this is one.
    pub(crate) fn tcp(self) -> Option<Arc<Conn>> {
        match self {
            Socket::Tcp(c) => Some(c),
            Socket::Udp(_) => None,
        }
    }

    /// The UDP socket, if this is one.
    pub(crate) fn udp(self) -> Option<Arc<UdpSock>> {
        match self {
            Socket::Udp(u) => Some(u),
            Socket::Tcp(_) => None,
        }
    }

    /// Descriptors of this process that refer to the socket.
    pub(crate) fn fdrefs(&self) -> &AtomicUsize {
        match self {
            Socket::Tcp(c) => &c.fdrefs,
            Socket::Udp(u) => &u.fdrefs,
        }
    }
}
