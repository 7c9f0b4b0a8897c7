//! The strait sides of a listening TCP socket, held by the descriptor table: the
//! marker on this host (discovery's abstract Unix name, where connectors' hellos
//! wait to be claimed by an `accept`) and the marker for other hosts (a UDP socket
//! where connectors' HELLOs arrive). The types live here, beneath the table; what
//! they do is in `discover` and `remote`.

use std::net::UdpSocket;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use libc::{c_int, socklen_t};

use crate::sock::{close_all, sock_key};
use crate::trust::{self, Proto};

/// A listening TCP socket's strait sides; set once each, dropped (and their
/// descriptors closed) with the last descriptor of the socket.
#[derive(Default)]
pub struct Listening {
    /// The marker on this host (`None`: the socket could not be registered).
    pub(crate) local: OnceLock<Arc<Listener>>,
    /// The marker for connections from other hosts (`--peers`).
    pub(crate) far: OnceLock<Arc<Marker>>,
}

/// A connector's hello, waiting at a listener's marker to be claimed by the
/// `accept` of its connection.
pub(crate) struct Hello {
    /// The connection's shared memory, mapped from the hello's memfd, which is
    /// kept in the vault from then on: a queued hello holds no descriptor for it
    /// (`None`: the memfd was not a proper one; the accept falls back).
    pub(crate) shm: Option<crate::conn::Shm>,
    /// Where the memfd is kept.
    pub(crate) vault: crate::vault::Kept,
    /// Connector's eventfd, acceptor's eventfd (-1, -1 when the hello offers a
    /// process pair instead).
    pub(crate) bells: [c_int; 2],
    /// The process pair the hello offers ([`crate::pair`]), if it does.
    pub(crate) pair: Option<HelloPair>,
    /// The inode of the connector's TCP socket, read from the `O_PATH` token the
    /// hello carried ([`trust::socket_token`]), never from the hello's bytes. (The
    /// token is closed at once: sockfs numbers its inodes in sequence, so no other
    /// socket takes the number while the hello waits.)
    pub(crate) ino: u64,
    /// The connector's user (SO_PEERCRED), for the per-user cap.
    pub(crate) uid: u32,
    /// The connector's process (SO_PEERCRED of the link the hello came on; 0: not
    /// known), the one process a rendezvous may write into.
    pub(crate) pid: libc::pid_t,
    /// The link the hello came on (the marker's accepted connection, or a path-B
    /// asker's socket).
    pub(crate) unix: c_int,
    pub(crate) at: Instant,
}

impl Hello {
    /// The hello's token named the socket with inode `ino`: for an accepted
    /// connection, its far end as [`far_end_inode`] gives it (the socket the kernel
    /// has at the peer address, connected to the accepted socket's address).
    pub(crate) fn names(&self, ino: u64) -> bool {
        ino != 0 && self.ino == ino
    }

    /// Lets go of everything the hello holds (its mapping goes when it is dropped).
    pub(crate) fn close(&self) {
        close_all(&self.bells.into_iter().filter(|&f| f >= 0).collect::<Vec<_>>());
        self.close_pair();
        close_all(&[self.unix]);
        crate::vault::release(self.vault);
    }

    /// Closes the descriptors of the pair the hello offers (none if this process
    /// held the pair already).
    pub(crate) fn close_pair(&self) {
        if let Some(p) = &self.pair {
            close_all(&[p.memfd, p.bells[0], p.bells[1]].into_iter().filter(|&f| f >= 0).collect::<Vec<_>>());
        }
    }
}

/// The process pair a hello offers: adopted when the hello is queued at the
/// marker (`discover::queue_hello`), or, for a hello a path-B ask brought, when it
/// is taken.
pub(crate) struct HelloPair {
    /// The pair's sealed memfd.
    pub(crate) memfd: c_int,
    /// Its bells, the creator's (the connector's) first.
    pub(crate) bells: [c_int; 2],
    /// The connector's slot in its half (its word: the ring bounds it).
    pub(crate) slot: u32,
    /// The pair, when this process held it already (its descriptors above are
    /// then closed, -1).
    pub(crate) known: Option<std::sync::Arc<crate::pair::Pair>>,
}

/// The inode of the socket at the other end of the connected TCP socket `fd` (on
/// this host): the socket the kernel's diagnostics find at `fd`'s peer address,
/// connected to `fd`'s address. One question to the kernel, however many hellos
/// wait.
pub(crate) fn far_end_inode(fd: c_int) -> Option<u64> {
    far_end(fd).map(|s| s.inode).filter(|&i| i != 0)
}

/// What the kernel's diagnostics say of the far end of the connected TCP socket
/// `fd` (on this host).
fn far_end(fd: c_int) -> Option<trust::DiagSock> {
    let (peer, local) = (sock_key(fd, true)?, sock_key(fd, false)?);
    trust::diag_lookup(Proto::Tcp, peer, local)
}

/// True if the far end of the connected TCP socket `fd` is in this network
/// namespace and waits in its listener's accept queue: the kernel reports no
/// inode for a socket no process holds, and a socket in the accept queue is still
/// open (established, or the peer closed its side: a socket the acceptor closed is
/// in one of the closing states, without an inode too).
pub(crate) fn far_end_unaccepted(fd: c_int) -> bool {
    /// `TCP_ESTABLISHED`, `TCP_SYN_RECV` and `TCP_CLOSE_WAIT` of the kernel's
    /// `tcp_states.h`.
    const OPEN: [u8; 3] = [1, 3, 8];
    far_end(fd).is_some_and(|s| s.inode == 0 && OPEN.contains(&s.state))
}

/// What waits at a listener's marker.
#[derive(Default)]
pub(crate) struct Claims {
    pub(crate) hellos: Vec<Hello>,
    /// Unix connections at the marker that have not sent their hello yet, with
    /// their credentials (`None`: the kernel did not say).
    pub(crate) waiting: Vec<(c_int, Option<libc::ucred>)>,
    /// When this listener last tried to take its name (see `Listener::claim_name`).
    pub(crate) last_claim: Option<Instant>,
    /// Entries of `hellos` and `waiting` counted on the listener's [`Board`], and
    /// by which process (a forked child's copies are its own, not yet counted).
    counted: usize,
    counted_by: u32,
}

impl Claims {
    /// Hellos and waiting connections of user `uid`.
    pub(crate) fn held_by(&self, uid: u32) -> usize {
        self.hellos.iter().filter(|h| h.uid == uid).count()
            + self.waiting.iter().filter(|w| w.1.map_or(u32::MAX, |c| c.uid) == uid).count()
    }
}

/// A page shared by the processes of one family (the listener's maker and those
/// it made by `fork` or a raw `clone`, which may all read the marker): how many
/// hellos and unread hello links they hold between them, plus one for each pump of
/// the marker under way. Only this family maps it (anonymous shared memory, not
/// inherited by an `exec`, never passed).
pub(crate) struct Board(strait_sys::Mapping);

// SAFETY: the page is only read and written through atomics (`held`); the mapping
// itself is never changed after it is made.
unsafe impl Sync for Board {}
// SAFETY: as above; the mapping belongs to the board, unmapped once when dropped.
unsafe impl Send for Board {}

impl Board {
    pub(crate) fn new() -> Option<Board> {
        strait_sys::Mapping::anonymous_shared(4096).ok().map(Board)
    }

    fn held(&self) -> &AtomicU64 {
        // SAFETY: the page is 4096 bytes, aligned, mapped for the board's life;
        // word 0 is only used as an atomic.
        unsafe { &*self.0.ptr().cast::<AtomicU64>() }
    }
}

/// The strait side of a listening TCP socket.
pub struct Listener {
    /// The rendezvous name's listening socket (-1: another process holds the name).
    pub(crate) unix: std::sync::atomic::AtomicI32,
    /// The name, to claim it later when its holder has gone (a listener passed on
    /// by a process that then exited).
    pub(crate) name: (libc::sockaddr_un, socklen_t),
    pub(crate) pending: Mutex<Claims>,
    /// The rendezvous name's socket came from another process (passed, or kept
    /// over an `exec`) or went to one (passed on), which may read hellos from it.
    pub(crate) shared: std::sync::atomic::AtomicBool,
    /// Forks this process had seen when the listener was made
    /// ([`crate::vault::forks`]).
    pub(crate) forks_at: u32,
    /// What the processes of this family that read the marker hold (`None`: a
    /// listener that came from another process, or the page could not be made).
    pub(crate) board: Option<Board>,
}

impl Listener {
    /// No other process can read this listener's hellos: it holds the name's
    /// socket, made here and never shared by a fork since. A connection accepted
    /// here whose hello is not queued then never sent one (or it went stale): no
    /// use asking its connector by path B.
    pub(crate) fn alone(&self) -> bool {
        !self.shared.load(std::sync::atomic::Ordering::Relaxed)
            && self.forks_at == crate::vault::forks()
            && self.unix.load(std::sync::atomic::Ordering::Relaxed) >= 0
    }

    /// Before reading the marker: counts a pump under way on the board (so that
    /// an acceptor of the family that looks meanwhile asks by path B).
    pub(crate) fn pump_begins(&self) {
        if let Some(b) = &self.board {
            b.held().fetch_add(1, Ordering::SeqCst);
        }
    }

    /// After reading the marker: the board counts what this process holds now,
    /// then no longer the pump.
    pub(crate) fn pump_ends(&self, p: &mut Claims) {
        self.board_sync(p);
        if let Some(b) = &self.board {
            b.held().fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Brings the board's count of this process's hellos and links up to date.
    pub(crate) fn board_sync(&self, p: &mut Claims) {
        let Some(b) = &self.board else { return };
        let me = strait_sys::pid::current_pid();
        if p.counted_by != me {
            // Copies a fork made: this process's own from now on.
            (p.counted, p.counted_by) = (0, me);
        }
        let now = p.hellos.len() + p.waiting.len();
        if now > p.counted {
            b.held().fetch_add((now - p.counted) as u64, Ordering::SeqCst);
        } else if now < p.counted {
            b.held().fetch_sub((p.counted - now) as u64, Ordering::SeqCst);
        }
        p.counted = now;
    }

    /// No other process can hold the hello of a connection this process accepted
    /// and found none for, after it read the marker (`p` locked since): the
    /// listener holds the name, was never shared with another program, and the
    /// board shows nothing held and no pump under way in the rest of its family.
    /// A connector sends its hello before its TCP connect, so the hello is then
    /// either read by us already or was never sent (the connector chose the kernel,
    /// or is not under strait), and asking by path B would only cost system calls.
    pub(crate) fn nothing_held_elsewhere(&self, p: &mut Claims) -> bool {
        if self.shared.load(Ordering::Relaxed) || self.unix.load(Ordering::Relaxed) < 0 {
            return false;
        }
        let Some(b) = &self.board else { return false };
        self.board_sync(p);
        b.held().load(Ordering::SeqCst) == p.counted as u64
    }
}

/// The marker of one listening socket: connectors' HELLOs arrive there.
pub(crate) struct Marker {
    pub(crate) udp: UdpSocket,
}

impl Drop for Listener {
    fn drop(&mut self) {
        let p = self.pending.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = &self.board {
            if p.counted_by == strait_sys::pid::current_pid() {
                b.held().fetch_sub(p.counted as u64, Ordering::SeqCst);
            }
        }
        for h in p.hellos.drain(..) {
            h.close();
        }
        close_all(&p.waiting.iter().map(|w| w.0).collect::<Vec<_>>());
        let u = *self.unix.get_mut();
        if u >= 0 {
            close_all(&[u]);
        }
    }
}
