//! The accelerated connection behind a descriptor, once it is settled: a connector's
//! first use waits (bounded) for its acceptor, a connection to another host for the
//! far end's answer; one that settled on the kernel leaves the table.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use libc::c_int;

use crate::conn::{self, Conn, SettleWait};
use crate::socket::Socket;
use crate::table::Held;
use crate::wait::sock_timeout;
use crate::{discover, process, remote, table};

/// Whether a look-up may wait for a connector's acceptor.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Settling {
    /// A read that would block on the kernel too (its bytes can only come once
    /// the acceptor took the connection): a blocking connector waits for its
    /// acceptor (bounded by its deadline, longer while the connection sits
    /// unaccepted in the listener's queue), and no longer than the socket's
    /// SO_RCVTIMEO, after which it is returned pending (the read answers EAGAIN,
    /// as the kernel's would have by then).
    MayWaitToRead,
    /// A write that would block on the kernel (what did not go out early): as
    /// [`Settling::MayWaitToRead`], within SO_SNDTIMEO.
    MayWaitToWrite,
    /// The call never blocks on the kernel (`poll`, `select`, `epoll_ctl`,
    /// `ioctl`, `shutdown`, a `MSG_DONTWAIT` receive): one look, and a connector
    /// still waiting is returned pending, as a non-blocking one always is (its
    /// readiness says nothing yet; a receive answers EAGAIN). Waiting here hung a
    /// client that put blocking connections in an epoll set before its server,
    /// busy with another of them, had accepted them.
    Now,
}

impl Settling {
    /// A receive with `flags`: no wait with `MSG_DONTWAIT`.
    pub(crate) fn for_recv(flags: c_int) -> Settling {
        if flags & libc::MSG_DONTWAIT != 0 {
            Settling::Now
        } else {
            Settling::MayWaitToRead
        }
    }
}

/// What the library carries behind `fd` (one look-up of the descriptor table for
/// every kind) for a call that never blocks on the kernel ([`Settling::Now`]): a
/// TCP connection settled or still waiting for its acceptor; `None` for a
/// descriptor the kernel alone carries, or a connection that settled on the kernel.
#[inline]
pub(crate) fn socket_now(fd: c_int) -> Option<Held> {
    process::check_new_process();
    let s = table::get_held(fd)?;
    match &*s {
        Socket::Tcp(c) if settled(fd, c, Settling::Now) == Found::Kernel => None,
        _ => Some(s),
    }
}

/// A wait for a connector's acceptor that a signal ended (the call answers EINTR).
#[derive(Debug)]
pub(crate) struct Interrupted;

/// As [`socket_now`], for a receive with `flags` ([`Settling::for_recv`]), a
/// connection once settled unless the socket's receive timeout ended the wait;
/// `Err` if a signal whose handler does not restart the call ended it.
#[inline]
pub(crate) fn socket_to_read(fd: c_int, flags: c_int) -> Result<Option<Held>, Interrupted> {
    process::check_new_process();
    let Some(s) = table::get_held(fd) else { return Ok(None) };
    match &*s {
        Socket::Tcp(c) => settled(fd, c, Settling::for_recv(flags)).give(s),
        _ => Ok(Some(s)),
    }
}

/// As [`socket_now`], for a call that writes: a connector still waiting for its
/// acceptor is not settled first (its writes go out early: [`Conn::send_early`]);
/// one whose wait is decided settles as any first use.
#[inline]
pub(crate) fn socket_to_write(fd: c_int) -> Option<Held> {
    process::check_new_process();
    let s = table::get_held(fd)?;
    match &*s {
        Socket::Tcp(c) if c.side == 0 && c.awaiting_attach() && c.try_settle(fd).is_none() => Some(s),
        Socket::Tcp(c) if settled(fd, c, Settling::MayWaitToWrite) == Found::Kernel => None,
        _ => Some(s),
    }
}

/// The accelerated TCP connection behind `fd`, after settling a pending connect.
#[inline]
pub(crate) fn accel(fd: c_int) -> Option<Arc<Conn>> {
    accel_settling(fd, Settling::MayWaitToRead)
}

/// As [`accel`], for a write ([`Settling::MayWaitToWrite`]).
#[inline]
pub(crate) fn accel_to_write(fd: c_int) -> Option<Arc<Conn>> {
    accel_settling(fd, Settling::MayWaitToWrite)
}

/// As [`accel`], for a call that never blocks on the kernel ([`Settling::Now`]):
/// possibly a connector still waiting for its acceptor.
#[inline]
pub(crate) fn accel_now(fd: c_int) -> Option<Arc<Conn>> {
    accel_settling(fd, Settling::Now)
}

/// As [`accel_to_write`], `Err` if a signal whose handler does not restart the
/// call ended the wait for the acceptor.
#[inline]
pub(crate) fn accel_to_write_or_interrupted(fd: c_int) -> Result<Option<Arc<Conn>>, Interrupted> {
    process::check_new_process();
    let Some(c) = table::lookup(fd) else { return Ok(None) };
    settled(fd, &c, Settling::MayWaitToWrite).give(c)
}

/// As [`accel_to_write_or_interrupted`], settling as `how` says; an interrupted
/// wait leaves the connection pending (its call answers EAGAIN).
#[inline]
fn accel_settling(fd: c_int, how: Settling) -> Option<Arc<Conn>> {
    process::check_new_process();
    let c = table::lookup(fd)?;
    (settled(fd, &c, how) != Found::Kernel).then_some(c)
}

/// What is behind a connection once [`settled`] looked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// The library carries it, or (for [`Settling::Now`], a non-blocking socket
    /// or a wait that reached the socket's timeout) it still waits for its
    /// acceptor.
    Carried,
    /// It settled on the kernel.
    Kernel,
    /// Still waiting: a signal whose handler does not restart the call ended the
    /// wait.
    Interrupted,
}

impl Found {
    /// `x`, the socket or connection looked at, as its call sees it: `None` once
    /// it settled on the kernel, `Err` if a signal ended the wait.
    fn give<T>(self, x: T) -> Result<Option<T>, Interrupted> {
        match self {
            Found::Carried => Ok(Some(x)),
            Found::Kernel => Ok(None),
            Found::Interrupted => Err(Interrupted),
        }
    }
}

/// Settles `c`, the connection behind `fd`, as far as `how` allows.
#[inline]
fn settled(fd: c_int, c: &Arc<Conn>, how: Settling) -> Found {
    // A connection to another host: the first use waits (bounded) for the other end.
    if let Some(ok) = remote::settle(fd, c) {
        if !ok {
            // Counted once, where it was decided.
            table::remove_conn(c);
            return Found::Kernel;
        }
        return Found::Carried;
    }
    // A connector's first use waits (bounded) for the acceptor to attach; on a
    // non-blocking socket it does not wait (the connection answers EAGAIN until then).
    if c.side == 0 && !c.counted.load(Ordering::Relaxed) {
        let settled = match how {
            _ if c.nonblock.load(Ordering::Relaxed) => c.try_settle(fd),
            Settling::Now => c.try_settle(fd),
            Settling::MayWaitToRead | Settling::MayWaitToWrite => {
                // The socket's timeout is looked up only when the wait is long.
                let start = Instant::now();
                match c.try_settle(fd) {
                    Some(ok) => Some(ok),
                    None => {
                        let opt = if how == Settling::MayWaitToRead {
                            libc::SO_RCVTIMEO
                        } else {
                            libc::SO_SNDTIMEO
                        };
                        match c.settle_within(fd, sock_timeout(fd, opt).map(|t| start + t), true) {
                            SettleWait::Decided(ok) => Some(ok),
                            SettleWait::TimedOut => None,
                            SettleWait::Interrupted => return Found::Interrupted,
                        }
                    }
                }
            }
        };
        let Some(attached) = settled else { return Found::Carried };
        if !attached {
            discover::give_up(fd, c);
            return Found::Kernel;
        }
        if !c.counted.swap(true, Ordering::Relaxed) {
            conn::ACCELERATED.fetch_add(1, Ordering::Relaxed);
        }
    }
    Found::Carried
}
