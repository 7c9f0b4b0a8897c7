//! One entry type for every kind of socket the library carries (TCP connections,
//! UDP sockets, listening sockets): what the descriptor table holds, and what an
//! epoll set's accelerated members are.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use libc::c_int;

use crate::conn::{Conn, Ready};
use crate::fdtable::Shared;
use crate::listening::Listening;
use crate::udp::UdpSock;

/// What one of the program's descriptors is to the library.
#[derive(Clone)]
pub enum Socket {
    /// A TCP connection carried by strait (shared memory, or a device to another
    /// host).
    Tcp(Arc<Conn>),
    /// A UDP socket (its datagrams to strait receivers go through shared memory).
    Udp(Arc<UdpSock>),
    /// A listening TCP socket with a strait side (its connections are claimed at
    /// `accept`); never a member of an epoll set of ours (the kernel's set holds it).
    Listening(Arc<Listening>),
}

impl Shared for Socket {
    fn same(&self, other: &Self) -> bool {
        match (self, other) {
            (Socket::Tcp(a), Socket::Tcp(b)) => Arc::ptr_eq(a, b),
            (Socket::Udp(a), Socket::Udp(b)) => Arc::ptr_eq(a, b),
            (Socket::Listening(a), Socket::Listening(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Socket {
    /// Readiness for the program's descriptor `fd` of this member of an epoll set
    /// (`arrivals`: a connection to another host looks for what came, see
    /// [`crate::conn::Conn::readiness_with`]).
    pub(crate) fn readiness(&self, fd: c_int, arrivals: bool) -> Ready {
        match self {
            Socket::Tcp(c) => c.readiness_with(fd, arrivals),
            Socket::Udp(u) => Ready {
                bits: if u.shm_readable() { libc::POLLIN } else { 0 },
                rx_tail: u.rx_mark(),
                tx_head: 0,
            },
            Socket::Listening(_) => Ready { bits: 0, rx_tail: 0, tx_head: 0 },
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
            Socket::Listening(_) => {}
        }
    }

    /// Empties the member's doorbell after a wake-up.
    pub(crate) fn drain_bell(&self) {
        match self {
            Socket::Tcp(c) => c.drain_bell(),
            Socket::Udp(u) => u.drain_bell(),
            Socket::Listening(_) => {}
        }
    }

    /// After a wake-up on a doorbell that is not read (edge-triggered): moves a
    /// connection to another host along, as [`Socket::drain_bell`] does, without
    /// reading the bell.
    pub(crate) fn pump(&self) {
        match self {
            Socket::Tcp(c) => c.pump_remote(),
            Socket::Udp(u) => u.drain_bell(),
            Socket::Listening(_) => {}
        }
    }

    /// The socket's identity (the address of what its descriptors share).
    pub(crate) fn key(&self) -> usize {
        match self {
            Socket::Tcp(c) => Arc::as_ptr(c) as usize,
            Socket::Udp(u) => Arc::as_ptr(u) as usize,
            Socket::Listening(l) => Arc::as_ptr(l) as usize,
        }
    }

    /// The TCP connection, if this is one.
    pub(crate) fn tcp(self) -> Option<Arc<Conn>> {
        match self {
            Socket::Tcp(c) => Some(c),
            _ => None,
        }
    }

    /// The UDP socket, if this is one.
    pub(crate) fn udp(self) -> Option<Arc<UdpSock>> {
        match self {
            Socket::Udp(u) => Some(u),
            _ => None,
        }
    }

    /// The listening socket's strait sides, if this is one.
    pub(crate) fn listening(self) -> Option<Arc<Listening>> {
        match self {
            Socket::Listening(l) => Some(l),
            _ => None,
        }
    }

    /// `O_NONBLOCK` was set or cleared on a descriptor of the socket.
    pub(crate) fn set_nonblock(&self, on: bool) {
        match self {
            Socket::Tcp(c) => c.nonblock.store(on, Ordering::Relaxed),
            Socket::Udp(u) => u.nonblock.store(on, Ordering::Relaxed),
            Socket::Listening(_) => {}
        }
    }

    /// Descriptors of this process that refer to the socket (`None`: not counted; a
    /// listening socket's sides live as long as a descriptor holds them).
    pub(crate) fn fdrefs(&self) -> Option<&AtomicUsize> {
        match self {
            Socket::Tcp(c) => Some(&c.fdrefs),
            Socket::Udp(u) => Some(&u.fdrefs),
            Socket::Listening(_) => None,
        }
    }
}
