//! The accelerated connection behind a descriptor, once it is settled: a connector's
//! first use waits (bounded) for its acceptor, a connection to another host for the
//! far end's answer; one that settled on the kernel leaves the table.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use libc::c_int;

use crate::conn::{self, Conn};
use crate::socket::Socket;
use crate::table::Held;
use crate::{discover, process, remote, table};

/// What the library carries behind `fd` (one look-up of the descriptor table for
/// every kind), a TCP connection only once settled: `None` for a descriptor the
/// kernel alone carries, or a connection that settled on the kernel.
#[inline]
pub(crate) fn socket(fd: c_int) -> Option<Held> {
    process::check_new_process();
    let s = table::get_held(fd)?;
    match &*s {
        Socket::Tcp(c) if !settled(fd, c) => None,
        _ => Some(s),
    }
}

/// As [`socket`], for a call that writes: a connector still waiting for its
/// acceptor is not settled first (its writes go out early: [`Conn::send_early`]);
/// one whose wait is decided settles as any first use.
#[inline]
pub(crate) fn socket_to_write(fd: c_int) -> Option<Held> {
    process::check_new_process();
    let s = table::get_held(fd)?;
    match &*s {
        Socket::Tcp(c) if c.side == 0 && c.awaiting_attach() && c.try_settle(fd).is_none() => Some(s),
        Socket::Tcp(c) if !settled(fd, c) => None,
        _ => Some(s),
    }
}

/// The accelerated TCP connection behind `fd`, after settling a pending connect.
#[inline]
pub(crate) fn accel(fd: c_int) -> Option<Arc<Conn>> {
    process::check_new_process();
    let c = table::lookup(fd)?;
    settled(fd, &c).then_some(c)
}

/// True once `c`, the connection behind `fd`, is settled (false: it settled on the
/// kernel).
#[inline]
fn settled(fd: c_int, c: &Arc<Conn>) -> bool {
    // A connection to another host: the first use waits (bounded) for the other end.
    if let Some(ok) = remote::settle(fd, c) {
        if !ok {
            // Counted once, where it was decided.
            table::remove_conn(c);
        }
        return ok;
    }
    // A connector's first use waits (bounded) for the acceptor to attach; on a
    // non-blocking socket it does not wait (the connection answers EAGAIN until then).
    if c.side == 0 && !c.counted.load(Ordering::Relaxed) {
        let settled = if c.nonblock.load(Ordering::Relaxed) { c.try_settle(fd) } else { Some(c.settle(fd)) };
        let Some(attached) = settled else { return true };
        if !attached {
            discover::give_up(fd, c);
            return false;
        }
        if !c.counted.swap(true, Ordering::Relaxed) {
            conn::ACCELERATED.fetch_add(1, Ordering::Relaxed);
        }
    }
    true
}
