//! Finding out that both ends of a local TCP connection run under strait, and handing
//! the connection's shared memory to the two ends only.
//!
//! * `listen()` on a TCP socket also binds an abstract Unix socket (the marker)
//!   named `strait.tcp.<netns inode>.<port>.<bound address in hex>` (first process
//!   wins; nothing in the filesystem; only visible in this network namespace).
//! * `connect()` to a local address (loopback, or an address of this namespace's
//!   interfaces, see [`crate::local`]) first connects a Unix socket to the marker of
//!   the listener the kernel would pick: the exact address, then the wildcard
//!   (failing costs up to three system calls when the listener is not under strait,
//!   so a listener bound to 127.0.0.1 is never found by a connect to another
//!   address, as the kernel would refuse that connect). It then
//!   binds its own per-connection name `strait.c.<netns>.<socket inode>` (its TCP
//!   socket's inode: known before the SYN, unlike the port, which the kernel's
//!   `connect` picks for an unbound socket as it would without strait), sends a
//!   hello (a sealed memfd; the process pair's memfd and its two eventfds, with the
//!   connector's slot, or two eventfds of the connection's own; and an
//!   `O_PATH` token of its TCP socket: a proof that it holds the socket, with no power
//!   over it) to the marker, and only then does the real TCP connect. Not one byte is
//!   ever sent on the TCP connection. The hello goes out only after the marker's
//!   holder is proven to be root, this user, or the owner of the listening socket
//!   the kernel would pick ([`crate::trust`]); a name squatted by another user is
//!   skipped, and every name look-up is a non-blocking connect.
//! * `accept()` takes the kernel connection and looks, among the hellos queued at
//!   the marker, for one whose token names the accepted connection's other end (the
//!   inode the kernel's socket diagnostics give for the connection's addresses, so no
//!   process can claim someone else's connection, whatever its user). A peer
//!   without strait costs one failed `accept4`.
//! * If another process drained that hello (workers forked from one listener share
//!   the marker), the acceptor asks the connector directly at its per-connection
//!   name (after checking who holds it), sending a token of its accepted socket as
//!   proof; the connector checks it and answers with the hello when it next enters
//!   the library (path B).
//! * Both sides agree through one word in shared memory: pending -> attached (by the
//!   acceptor, path A or B), or pending -> kernel (by the connector after a
//!   timeout). A lost hello only costs a bounded delay, never data.

use std::os::fd::IntoRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libc::{c_int, sockaddr, socklen_t};

use crate::conn::{
    Bells, Carriers, Conn, Liveness, Offered, PairBell, PendingC, ServeWith, Shm, ATTACHED, ATTACHED_B, HDR,
    KERNEL, MAGIC, OFF_ACCEPTOR_SLOT, OFF_ACCEPTOR_SLOT_B, PENDING, VERSION,
};
use crate::listening::{far_end_inode, Claims, Hello, HelloPair, Listener};
use crate::real;
use crate::settings::Settings;
use crate::sock::{
    abstract_name, accept_waiting, close_all, is_tcp_stream, key_of, listen_marker, memfd_ok, netns,
    recv_fds_now, send_fds, sock_key, socket_option, v4_mapped, v6only, Key,
};
use crate::trust::{self, Proto};

const HELLO_LEN: usize = 48;

/// Hellos a listener keeps unclaimed at least before the oldest goes (more when
/// the descriptor limit allows: [`max_hellos`]).
const MIN_HELLOS: usize = 1024;

/// Hellos a listener keeps unclaimed: a burst of connectors as large as the
/// kernel's accept queues may hold each wait for its accept, within a quarter of
/// the descriptor limit (a queued hello holds three or four descriptors).
fn max_hellos() -> usize {
    (crate::fds::soft_nofile() as usize / 4).clamp(MIN_HELLOS, 16 * MIN_HELLOS)
}

/// Queues hello `h` for an accept; the oldest goes when too many wait. The pair
/// it offers is adopted now (the one this process holds already under its inode,
/// if any): the hellos of one connector process that wait together hold its
/// descriptors once, not three each (a client that connects dozens of times
/// before the first accept would fill the descriptor table with copies). A pair
/// that fails the checks refuses the hello.
fn queue_hello(p: &mut Claims, mut h: Hello) {
    if let Some(hp) = h.pair.as_mut() {
        if hp.known.is_none() {
            let adopted = crate::pair::adopt(hp.memfd, hp.bells, h.pid);
            (hp.memfd, hp.bells) = (-1, [-1, -1]);
            match adopted {
                Ok(pair) => hp.known = Some(pair),
                Err(_) => {
                    h.close();
                    trust::refuse::<()>();
                    return;
                }
            }
        }
    }
    // (The limit is asked of the kernel only once the queue is long.)
    if p.hellos.len() >= MIN_HELLOS && p.hellos.len() >= max_hellos() {
        p.hellos.remove(0).close();
    }
    p.hellos.push(h);
}
/// Unix connections at the marker that have not sent their hello yet, at most.
const MAX_WAITING: usize = 256;
/// Hellos and waiting connections one user other than root and ours may hold at a
/// listener: a flood from one account cannot crowd out the others.
const MAX_PER_USER: usize = 128;

/// The marker of a listener bound to `k`: `strait.tcp.<netns>.<port>.<address in
/// hex>`; an IPv6 wildcard listener that takes no IPv4 connections (IPV6_V6ONLY) is
/// `...<port>.v6only`.
fn unix_name(k: Key, v6only: bool) -> (libc::sockaddr_un, socklen_t) {
    let addr: String = if v6only && k.0 == [0u8; 16] {
        "v6only".into()
    } else {
        k.0.iter().map(|b| format!("{b:02x}")).collect()
    };
    abstract_name(&format!("strait.tcp.{}.{}.{}", netns(), k.1, addr))
}

/// The markers a connect to `dest` looks for, in the order the kernel picks the
/// listening socket: the exact address, then the wildcard of the same family, then
/// (IPv4) a dual-stack IPv6 wildcard, (IPv6) an IPv6-only wildcard.
fn marker_candidates(dest: Key) -> [(Key, bool); 3] {
    let port = dest.1;
    let any6 = ([0u8; 16], port);
    if v4_mapped(&dest) {
        let mut any4 = [0u8; 16];
        any4[10] = 0xff;
        any4[11] = 0xff;
        [(dest, false), ((any4, port), false), (any6, false)]
    } else {
        [(dest, false), (any6, false), (any6, true)]
    }
}

/// The connector's per-connection name (path B): named by its TCP socket's inode,
/// which the connector knows before its `connect` (its port it does not: the kernel
/// picks that in `connect`) and an acceptor learns from the kernel's diagnostics.
fn conn_name(ino: u64) -> (libc::sockaddr_un, socklen_t) {
    abstract_name(&format!("strait.c.{}.{}", netns(), ino))
}

/// A listening socket this process did not make (passed over a Unix socket, or
/// inherited from a program that ran without the library) is registered, so that
/// its connections are claimed (by path B while another process holds the name).
pub(crate) fn adopt_listener(fd: c_int) {
    match listener(fd) {
        Some(l) => l.claim_name(),
        None if Settings::get().enabled && !known_other(fd) => {
            if is_listening(fd) {
                on_listen(fd);
            } else {
                mark_other(fd, true);
            }
        }
        None => {}
    }
}

/// Before an `accept`: a registered listener without its name takes it if its
/// holder has gone (no system call otherwise).
pub(crate) fn before_accept(fd: c_int) {
    if let Some(l) = listener(fd) {
        l.claim_name();
    }
}

/// Descriptors known not to be listening TCP sockets (a Unix-socket server's
/// accepts are not asked again), one bit per descriptor number below 65536;
/// cleared when the descriptor is closed.
static OTHER: [std::sync::atomic::AtomicU64; 1024] = [const { std::sync::atomic::AtomicU64::new(0) }; 1024];

fn known_other(fd: c_int) -> bool {
    (0..65536).contains(&fd) && OTHER[fd as usize / 64].load(Ordering::Relaxed) & (1 << (fd % 64)) != 0
}

/// Records (or, `false`, forgets) that `fd` is not a listening TCP socket.
pub(crate) fn mark_other(fd: c_int, other: bool) {
    if (0..65536).contains(&fd) {
        let bit = 1u64 << (fd % 64);
        if other {
            OTHER[fd as usize / 64].fetch_or(bit, Ordering::Relaxed);
        } else {
            OTHER[fd as usize / 64].fetch_and(!bit, Ordering::Relaxed);
        }
    }
}

/// True if `fd` is a listening TCP socket.
fn is_listening(fd: c_int) -> bool {
    socket_option(fd, libc::SO_ACCEPTCONN).is_some_and(|v| v != 0) && is_tcp_stream(fd)
}

/// Receives one hello without waiting: `Some(Ok)` got one, `Some(Err)` the socket is
/// dead or sent garbage, `None` nothing yet.
type HelloMsg = ([u8; HELLO_LEN], Vec<c_int>);

fn recv_hello(sock: c_int) -> Option<Result<HelloMsg, ()>> {
    let mut buf = [0u8; HELLO_LEN + 16];
    let m = match recv_fds_now(sock, &mut buf) {
        Ok(m) => m,
        Err(e) => return if e == libc::EAGAIN || e == libc::EINTR { None } else { Some(Err(())) },
    };
    let (n, fds) = (m.len, m.fds);
    let mut out = [0u8; HELLO_LEN];
    if n != HELLO_LEN || !(fds.len() == 4 || fds.len() == 5) || m.truncated {
        close_all(&fds);
        return Some(Err(()));
    }
    out.copy_from_slice(&buf[..HELLO_LEN]);
    Some(Ok((out, fds)))
}

/// Checks a hello's header and descriptors; `None` (all closed) if anything is off:
/// a ring larger than ours (a peer may not make us map more than we would), a
/// doorbell that is not an eventfd, a token that is not a socket's.
fn parse_hello(
    h: &[u8; HELLO_LEN],
    fds: Vec<c_int>,
    unix: c_int,
    cred: Option<libc::ucred>,
) -> Option<Hello> {
    let (uid, pid) = cred.map_or((u32::MAX, 0), |c| (c.uid, c.pid));
    let magic = u64::from_le_bytes(h[0..8].try_into().unwrap_or_default());
    let version = u32::from_le_bytes(h[8..12].try_into().unwrap_or_default());
    let ring = u32::from_le_bytes(h[12..16].try_into().unwrap_or_default()) as usize;
    // [memfd, own eventfds x2, token], or [memfd, pair memfd, pair bells x2, token].
    let with_pair = fds.len() == 5;
    let token = fds.last().copied().unwrap_or(-1);
    let ino = trust::token_inode(token).unwrap_or(0);
    let bells = if with_pair { &fds[2..4] } else { &fds[1..fds.len().min(3)] };
    let ok = magic == MAGIC
        && version == VERSION
        && ring.is_power_of_two()
        && (4096..=Settings::get().ring).contains(&ring)
        && (fds.len() == 4 || with_pair)
        && bells.len() == 2
        && bells.iter().all(|&b| trust::is_eventfd(b))
        && ino != 0;
    if !ok {
        close_all(&fds);
        close_all(&[unix]);
        return trust::refuse();
    }
    let slot = u32::from_le_bytes(h[16..20].try_into().unwrap_or_default());
    let (bells, pair) = if with_pair {
        ([-1, -1], Some(HelloPair { memfd: fds[1], bells: [fds[2], fds[3]], slot, known: None }))
    } else {
        ([fds[1], fds[2]], None)
    };
    // Mapped and kept in the vault now: while the hello waits for its accept, it
    // holds no descriptor for the ring (a burst of thousands of connectors waits in
    // the kernel's accept queue as cheaply as it would without strait).
    let memfd = fds[0];
    let shm = if memfd_ok(memfd, HDR + 2 * ring) { Shm::map(memfd, ring) } else { None };
    let vault = if shm.is_some() { crate::vault::keep(memfd) } else { crate::vault::Kept::Nothing };
    close_all(&[memfd, token]);
    Some(Hello { shm, vault, bells, pair, ino, uid, pid, unix, at: Instant::now() })
}

impl Listener {
    /// The rendezvous name's socket, if this listener holds the name.
    pub(crate) fn marker(&self) -> Option<c_int> {
        Some(self.unix.load(Ordering::Relaxed)).filter(|&u| u >= 0)
    }

    /// Takes the rendezvous name if this listener has none and its holder has gone
    /// (tried at most every [`CLAIM_EVERY`]).
    fn claim_name(&self) {
        if self.unix.load(Ordering::Relaxed) >= 0 {
            return;
        }
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.last_claim.is_some_and(|t| t.elapsed() < CLAIM_EVERY) || self.unix.load(Ordering::Relaxed) >= 0 {
            return;
        }
        p.last_claim = Some(Instant::now());
        if let Some(u) = listen_marker(&self.name.0, self.name.1) {
            self.unix.store(u, Ordering::Relaxed);
        }
    }

    /// Accepts queued Unix connections and reads the hellos that arrived.
    fn pump(&self, p: &mut Claims) {
        let unix = self.unix.load(Ordering::Relaxed);
        if unix < 0 {
            // No name of our own (see `on_listen`): no hellos come here.
            return;
        }
        self.pump_begins();
        self.pump_marker(p, unix);
        self.pump_ends(p);
    }

    fn pump_marker(&self, p: &mut Claims, unix: c_int) {
        while let Some(c) = accept_waiting(unix) {
            // Any user may connect (a connection between two users is proven by its
            // token), but no account may hold more than its share, and the oldest
            // silent connection goes when too many wait.
            let cred = trust::peer_cred(c);
            let uid = cred.map_or(u32::MAX, |cr| cr.uid);
            if !trust::trusted_user(uid) && p.held_by(uid) >= MAX_PER_USER {
                close_all(&[c]);
                trust::refuse::<()>();
                continue;
            }
            // A connector sends its hello right after connecting: read at once, a
            // burst of thousands of connectors is never cut down to the newest
            // `MAX_WAITING` unread links (their hellos lost, each connection then
            // asked for by path B).
            match recv_hello(c) {
                Some(Ok((h, fds))) => {
                    if let Some(h) = parse_hello(&h, fds, c, cred) {
                        queue_hello(p, h);
                    }
                    continue;
                }
                Some(Err(())) => {
                    close_all(&[c]);
                    continue;
                }
                None => {}
            }
            if p.waiting.len() >= MAX_WAITING {
                let (old, _) = p.waiting.remove(0);
                close_all(&[old]);
            }
            p.waiting.push((c, cred));
        }
        let mut i = 0;
        while i < p.waiting.len() {
            let (c, cred) = p.waiting[i];
            match recv_hello(c) {
                None => i += 1,
                Some(Err(())) => {
                    close_all(&[c]);
                    p.waiting.remove(i);
                }
                Some(Ok((h, fds))) => {
                    p.waiting.remove(i);
                    if let Some(h) = parse_hello(&h, fds, c, cred) {
                        queue_hello(p, h);
                    }
                }
            }
        }
        // Hellos whose connectors went on without us (attached elsewhere by path B,
        // as when another SO_REUSEPORT listener took the connection, or gave up):
        // their Unix sockets hung up. Looked for once several have gathered, so an
        // accept normally costs no extra system call.
        let queued = p.hellos.len();
        if p.hellos.len() >= HELLOS_BEFORE_SWEEP {
            sweep_hung_up(p);
        }
        // Hellos nobody claimed for longer than a connector waits for a
        // connection in the accept queue: their connectors gave up already
        // (no clock reading when none is queued, as at every accept of a
        // connection left on the kernel).
        if !p.hellos.is_empty() {
            let now = Instant::now();
            let stale = Settings::get().attach_timeout * (QUEUE_WAITS + 2);
            p.hellos.retain(|h| {
                let keep = now.duration_since(h.at) < stale;
                if !keep {
                    h.close();
                }
                keep
            });
        }
        if p.hellos.len() < queued {
            // (Pairs adopted for hellos that went may now be idle.)
            crate::pair::retire_idle();
        }
    }

    fn take(&self, fd: c_int) -> Option<Hello> {
        // (The clock is read only once a link waits for its hello: an accept with
        // nothing pending, every accept of a connection left on the kernel, reads
        // none.)
        let mut deadline: Option<Instant> = None;
        // The accepted connection's far end, asked of the kernel once (when a hello
        // waits at all).
        let mut far: Option<Option<u64>> = None;
        loop {
            let waiting = {
                let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                self.pump(&mut p);
                if !p.hellos.is_empty() {
                    let first_look = far.is_none();
                    let looked = far.get_or_insert_with(|| {
                        FAR_END_LOOKS.fetch_add(1, Ordering::Relaxed);
                        far_end_inode(fd)
                    });
                    if let Some(ino) = *looked {
                        if let Some(i) = p.hellos.iter().position(|h| h.names(ino)) {
                            let h = p.hellos.swap_remove(i);
                            self.board_sync(&mut p);
                            return Some(h);
                        }
                    }
                    if first_look {
                        // None is this connection's: some may be of connectors that
                        // closed before their connection was accepted (a client's
                        // probe connection, a health check). Gone now, they would
                        // cost every later accept this look-up until they go stale.
                        let queued = p.hellos.len();
                        sweep_hung_up(&mut p);
                        if p.hellos.len() < queued {
                            self.board_sync(&mut p);
                            crate::pair::retire_idle();
                        }
                    }
                }
                if p.waiting.is_empty() {
                    return None;
                }
                p.waiting.iter().map(|w| w.0).collect::<Vec<_>>()
            };
            let now = Instant::now();
            let deadline = *deadline.get_or_insert(now + Settings::get().announce_wait);
            if now >= deadline {
                return None;
            }
            let mut pfds: Vec<libc::pollfd> =
                waiting.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
            let ms = (deadline - now).as_millis().clamp(1, 10) as c_int;
            // SAFETY: a vector of pollfds and its length.
            unsafe { real::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        }
    }
}

/// After a successful `listen(fd)`: claims the rendezvous name for its port.
pub fn on_listen(fd: c_int) {
    register_listener(fd, None);
}

/// Registers the listening socket `fd` with the rendezvous name's socket `marker`
/// (one passed along with it, see `pass.rs`), or binds the name itself.
pub(crate) fn register_listener(fd: c_int, marker: Option<c_int>) {
    if !Settings::get().enabled || listener(fd).is_some() || !is_tcp_stream(fd) {
        close_all(&marker.into_iter().collect::<Vec<_>>());
        return;
    }
    let Some(key) = sock_key(fd, false) else {
        close_all(&marker.into_iter().collect::<Vec<_>>());
        return;
    };
    let (sa, len) = unix_name(key, key.0 == [0u8; 16] && v6only(fd));
    // Without the name (another process's listener holds it: SO_REUSEPORT, where
    // the kernel spreads connections over both), hellos go to the other process,
    // and this one claims the connections the kernel gives it by asking their
    // connectors (path B) instead of leaving them to wait out the attach timeout.
    let u = marker.map(crate::fds::keep).or_else(|| listen_marker(&sa, len)).unwrap_or(-1);
    add_listener(
        fd,
        Arc::new(Listener {
            unix: std::sync::atomic::AtomicI32::new(u),
            name: (sa, len),
            pending: Mutex::new(Claims::default()),
            shared: std::sync::atomic::AtomicBool::new(marker.is_some()),
            forks_at: crate::vault::forks(),
            // (Only a listener whose name this process bound: for one that came
            // with its name from another process, that process may read hellos
            // too.)
            board: if marker.is_none() && u >= 0 { crate::listening::Board::new() } else { None },
        }),
    );
}

/// Unclaimed hellos at which a listener looks for ones whose connectors hung up.
const HELLOS_BEFORE_SWEEP: usize = 16;

/// Drops the queued hellos whose connectors hung up their Unix sockets (they
/// closed their connection, or went on without us: attached elsewhere by path B,
/// as when another SO_REUSEPORT listener took the connection, or gave up). One
/// `poll`, no waiting.
fn sweep_hung_up(p: &mut Claims) {
    if p.hellos.is_empty() {
        return;
    }
    let mut fds: Vec<libc::pollfd> =
        p.hellos.iter().map(|h| libc::pollfd { fd: h.unix, events: libc::POLLRDHUP, revents: 0 }).collect();
    // SAFETY: a vector of pollfds and its length; no waiting.
    if unsafe { real::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) } > 0 {
        let mut gone = fds.iter().map(|f| f.revents != 0);
        p.hellos.retain(|h| {
            let hung_up = gone.next().unwrap_or(false);
            if hung_up {
                h.close();
            }
            !hung_up
        });
    }
}

/// How often a listener without its name tries to take it.
const CLAIM_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// Accepted connections whose connectors were asked for their hello by path B
/// (`--stats`: `path-b-asks`; whether they answered or not).
pub static PATH_B_ASKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Accepted connections whose far end the acceptor looked up in the kernel's
/// socket diagnostics to match it with a queued hello (`--stats`:
/// `far-end-looks`): one per connection set up, and one per connection accepted
/// while hellos of others wait.
pub static FAR_END_LOOKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

const REQ_MAGIC: u64 = 0x3130_5145_5254_5253; // "SRTREQ01"

/// Path B: asks the connector of `fd` directly for its hello, proving with a token
/// of the accepted socket that we hold the other end. The connector's name is
/// asked only if its holder is root, us, or the owner of the connector's socket.
fn ask_connector(fd: c_int) -> Option<Hello> {
    PATH_B_ASKS.fetch_add(1, Ordering::Relaxed);
    let (peer, local) = (sock_key(fd, true)?, sock_key(fd, false)?);
    let far = trust::diag_lookup(Proto::Tcp, peer, local).filter(|s| s.inode != 0)?;
    let (sa, len) = conn_name(far.inode);
    let u = trust::connect_name(&sa, len)?;
    let cred = trust::peer_cred(u);
    let holder_ok = cred.is_some_and(|c| trust::trusted_user(c.uid) || far.uid == c.uid);
    let token = if holder_ok { trust::socket_token(fd) } else { None };
    let Some(token) = token else {
        close_all(&[u]);
        return if holder_ok { None } else { trust::refuse() };
    };
    let mut req = [0u8; 16];
    req[0..8].copy_from_slice(&REQ_MAGIC.to_le_bytes());
    let sent = send_fds(u, &req, &[token]);
    close_all(&[token]);
    if !sent {
        close_all(&[u]);
        return None;
    }
    let deadline = Instant::now() + Settings::get().announce_wait;
    loop {
        match recv_hello(u) {
            Some(Ok((h, fds))) => {
                let h = parse_hello(&h, fds, u, cred)?;
                // Its token must name the far end of the connection we accepted.
                if !h.names(far.inode) {
                    h.close();
                    return trust::refuse();
                }
                return Some(h);
            }
            Some(Err(())) => {
                close_all(&[u]);
                return None;
            }
            None => {}
        }
        let now = Instant::now();
        if now >= deadline {
            close_all(&[u]);
            return None;
        }
        let mut p = libc::pollfd { fd: u, events: libc::POLLIN, revents: 0 };
        let ms = (deadline - now).as_millis().clamp(1, 10) as c_int;
        // SAFETY: one pollfd.
        unsafe { real::poll(&mut p, 1, ms) };
    }
}

/// After a kernel `accept` on `lfd` returned `fd`: attaches the shared memory the
/// connecting strait peer announced, if any.
pub fn on_accept(lfd: c_int, fd: c_int, nonblock: bool) {
    adopt_listener(lfd);
    let Some(l) = listener(lfd) else { return };
    let (h, path_b) = match l.take(fd) {
        Some(h) => (h, false),
        // (Path B only where another process may have taken the hello.)
        None if l.alone()
            || l.nothing_held_elsewhere(&mut l.pending.lock().unwrap_or_else(|e| e.into_inner())) =>
        {
            return
        }
        None => match ask_connector(fd) {
            Some(h) => (h, true),
            None => return,
        },
    };
    let mut h = h;
    let [efd_c, efd_a] = h.bells;
    let own = [efd_c, efd_a].into_iter().filter(|&f| f >= 0).collect::<Vec<_>>();
    let (shm, vault) = (h.shm.take(), h.vault);
    let fall_back = |bell: Option<PairBell>| {
        close_all(&own);
        close_all(&[h.unix]);
        crate::vault::release(vault);
        if let Some(b) = bell {
            b.pair.free(b.my_slot);
            drop(b);
            crate::pair::retire_idle();
        }
        crate::conn::KERNEL_FALLBACKS.fetch_add(1, Ordering::Relaxed);
    };
    let Some(shm) = shm.filter(|s| s.header_ok()) else {
        h.close_pair();
        return fall_back(None);
    };
    let to = if path_b { ATTACHED_B } else { ATTACHED };
    // The pair the hello offered: adopted now that the hello proved itself (the one
    // we hold already under its inode, if any), our slot claimed and published
    // before the attach below (which releases it to the connector).
    let bell = match h.pair {
        None => None,
        Some(HelloPair { memfd, bells, slot, known }) => {
            let adopted = match known {
                Some(p) => Ok(p),
                None => crate::pair::adopt(memfd, bells, h.pid),
            };
            let Ok(pair) = adopted else {
                crate::trust::REFUSED.fetch_add(1, Ordering::Relaxed);
                return fall_back(None);
            };
            let Some(my_slot) = pair.claim() else { return fall_back(None) };
            let word = if path_b { OFF_ACCEPTOR_SLOT_B } else { OFF_ACCEPTOR_SLOT };
            shm.word(word).store(u64::from(my_slot), Ordering::Relaxed);
            Some(PairBell { pair, my_slot, peer_slot: slot })
        }
    };
    // Message mode when both ends ask for it (published by the attach below).
    let mode = shm.word(crate::conn::OFF_MODE);
    if Settings::get().messages && mode.load(Ordering::Relaxed) & crate::conn::MODE_ASKED != 0 {
        mode.fetch_or(crate::conn::MODE_AGREED, Ordering::Relaxed);
    }
    if shm.state().compare_exchange(PENDING, to, Ordering::AcqRel, Ordering::Acquire).is_err() {
        // The connector gave up waiting: the connection stays on the kernel path.
        return fall_back(bell);
    }
    // The link the hello came on has done its work: the TCP socket tells from now
    // on whether the connector lives.
    close_all(&[h.unix]);
    let conn = Arc::new(Conn::new(
        shm,
        1,
        Carriers {
            bells: match bell {
                Some(b) => Bells::Pair(b),
                None => Bells::Own { mine: efd_a, peer: efd_c },
            },
            liveness: Liveness::TcpSocket,
            vault,
            peer_pid: (h.pid > 0).then_some(h.pid),
        },
        nonblock,
        None,
    ));
    conn.bind_bells();
    // Wakes a connector asleep in poll or epoll (for its own eventfd: under its
    // new number, as `Conn::new` moved the one we received above the program's
    // descriptors).
    conn.ring_bell_always();
    crate::conn::ACCELERATED.fetch_add(1, Ordering::Relaxed);
    if path_b {
        crate::conn::PATH_B.fetch_add(1, Ordering::Relaxed);
    }
    // What the connector wrote before we attached is in the ring; its copy in the
    // kernel socket goes.
    conn.discard_early_copy(fd);
    if let Some(old) = crate::table::insert(fd, conn) {
        crate::table::drop_ref(old);
    }
}

/// The marker of the listener a connect will reach, connected.
pub struct MarkerLink {
    /// Our Unix socket, connected to the marker.
    pub unix: c_int,
    /// The marker's holder, as the kernel names it.
    pub holder: libc::pid_t,
    /// The marker was bound by this very process, which still holds the listening
    /// socket.
    pub ours: bool,
    /// The address and port connected to.
    pub dest: Key,
}

/// Before a TCP `connect` to `addr`: connects to the listener's rendezvous name.
/// Returns the Unix socket if the listener runs under strait and the name's holder
/// is proven to be the listener's (root, us, or the owner of the listening socket
/// the kernel would pick: [`trust::marker_holder_ok`]). A name held by anyone else
/// is skipped (and counted); a full backlog is the kernel path at once.
pub fn pre_connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> Option<MarkerLink> {
    if !Settings::get().enabled {
        return None;
    }
    let (dest, lo) = key_of(addr, len)?;
    // (Connections to this destination too short to pay for the setup: the
    // kernel's, without a system call more.)
    if !(lo || crate::local::host_address(&dest.0))
        || !crate::worth::connect_wanted(dest)
        || !is_tcp_stream(fd)
    {
        return None;
    }
    // Remote port 0 is in no connection: the look-up finds the listener.
    let from = (dest.0, 0);
    marker_candidates(dest).iter().find_map(|&(k, v6only)| {
        let (sa, slen) = unix_name(k, v6only);
        let u = trust::connect_name(&sa, slen)?;
        match trust::marker_holder_ok(u, Proto::Tcp, dest, from) {
            Some(cred) => Some(MarkerLink {
                unix: u,
                holder: cred.pid,
                ours: u32::try_from(cred.pid).is_ok_and(|p| p == strait_sys::pid::current_pid())
                    && holds_marker(&sa, slen),
                dest,
            }),
            None => {
                close_all(&[u]);
                trust::refuse()
            }
        }
    })
}

/// This process still holds a listening socket whose marker is `name` (a process
/// that made the listener and closed it after forking, leaving the accepts to a
/// child, has bound the marker but is not the acceptor). Looked at only for a
/// connect to a marker this process bound.
fn holds_marker(sa: &libc::sockaddr_un, len: socklen_t) -> bool {
    let path = |a: &libc::sockaddr_un, l: socklen_t| -> Vec<libc::c_char> {
        let n = (l as usize).saturating_sub(std::mem::size_of::<libc::sa_family_t>()).min(a.sun_path.len());
        a.sun_path[..n].to_vec()
    };
    let want = path(sa, len);
    crate::table::listening_entries()
        .iter()
        .filter_map(|(_, l)| l.local.get())
        .any(|l| path(&l.name.0, l.name.1) == want)
}

/// How long a connector waits for its acceptor before the connection stays with the
/// kernel. A listener this very process made and still holds can be accepted by
/// one of our own threads (or a child that shares it). With one thread, that is the thread that
/// would wait: a program that connects to its own listener and polls for writable,
/// or writes, before it accepts (as the kernel allows) would wait out the whole
/// timeout, so it does not wait at all (an accept made before the connection's
/// first use still attaches it; a child that accepts it later finds it on the
/// kernel). With several threads another one may be the acceptor, and it would be
/// accelerated, so the wait stays (one that connects and waits in the accepting
/// thread still waits out the timeout: a thread cannot tell which one will accept).
fn attach_wait(own_listener: bool) -> Duration {
    let timeout = Settings::get().attach_timeout;
    if !own_listener {
        return timeout;
    }
    match strait_sys::pid::thread_count() {
        Some(1) => Duration::ZERO,
        _ => timeout,
    }
}

/// Everything a connector sets up before its TCP connect.
pub struct Prepared {
    shm: Shm,
    /// The mapping's memfd, until the vault takes it.
    memfd: c_int,
    /// The marker's holder ([`MarkerLink::holder`]).
    holder: libc::pid_t,
    /// Where the connection goes ([`MarkerLink::dest`]).
    dest: Key,
    bells: Offer,
    pending: PendingC,
}

/// The doorbells a connector's hello offers.
enum Offer {
    /// A slot in a process pair with the marker's holder.
    Pair(Arc<crate::pair::Pair>, u32),
    /// Eventfds of the connection's own (connector's, acceptor's): no pair could
    /// be had.
    Own(c_int, c_int),
}

impl Offer {
    /// The descriptors the hello carries for it (the pair's memfd is a copy from
    /// the vault, owned by the caller: the first of the returned, to close).
    fn hello_fds(&self) -> Option<(Vec<c_int>, Option<c_int>)> {
        match self {
            Offer::Own(c, a) => Some((vec![*c, *a], None)),
            Offer::Pair(p, _) => {
                let m = crate::vault::copy(p.kept())?;
                let [c, o] = p.bells();
                Some((vec![m, c, o], Some(m)))
            }
        }
    }

    fn undo(self) {
        match self {
            Offer::Own(c, a) => close_all(&[c, a]),
            Offer::Pair(p, slot) => {
                p.free(slot);
                drop(p);
                crate::pair::retire_idle();
            }
        }
    }
}

/// A process pair with `peer` and a slot of ours in it, or eventfds of the
/// connection's own when none can be had (`None`: not even those).
fn offer_for(peer: libc::pid_t) -> Option<Offer> {
    if Settings::get().pairs {
        if let Some(p) = crate::pair::for_peer(peer) {
            if let Some(slot) = p.claim() {
                return Some(Offer::Pair(p, slot));
            }
        }
    }
    // SAFETY: plain syscalls.
    let (c, a) = unsafe {
        (
            libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK),
            libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK),
        )
    };
    if c < 0 || a < 0 {
        close_all(&[c, a].into_iter().filter(|&f| f >= 0).collect::<Vec<_>>());
        return None;
    }
    Some(Offer::Own(c, a))
}

/// Before the TCP connect: creates the shared memory and sends the hello to the
/// marker `unix`. `None`: stay on the kernel.
///
/// An unbound socket stays unbound: the kernel's `connect` picks its port, as it
/// would without strait. (Binding an ephemeral port first would take a port no
/// socket holds, which with thousands of connections in TIME_WAIT, as a client
/// that closes first leaves, costs a long search and then fails; `connect` may
/// reuse such a port for another destination.)
pub fn prepare(fd: c_int, link: MarkerLink) -> Option<Prepared> {
    settle_attached();
    let unix = link.unix;
    let fail = |fds: &[c_int]| {
        close_all(&fds.iter().copied().filter(|&f| f >= 0).collect::<Vec<_>>());
        None
    };
    let Some(ino) = trust::token_inode(fd) else { return fail(&[unix]) };
    let ring = Settings::get().ring;
    let total = HDR + 2 * ring;
    let memfd = strait_sys::sealed_memfd(c"strait-tcp", total).map_or(-1, IntoRawFd::into_raw_fd);
    if memfd < 0 {
        return fail(&[unix]);
    }
    let Some(bells) = offer_for(link.holder) else { return fail(&[memfd, unix]) };
    let fail = |fds: &[c_int], bells: Offer| {
        bells.undo();
        fail(fds)
    };
    let Some(shm) = Shm::map(memfd, ring) else { return fail(&[memfd, unix], bells) };
    shm.init_header();
    if Settings::get().messages {
        shm.word(crate::conn::OFF_MODE).store(crate::conn::MODE_ASKED, Ordering::Relaxed);
    }
    let mut h = [0u8; HELLO_LEN];
    h[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(ring as u32).to_le_bytes());
    if let Offer::Pair(_, slot) = &bells {
        h[16..20].copy_from_slice(&slot.to_le_bytes());
    }
    let Some(token) = trust::socket_token(fd) else { return fail(&[memfd, unix], bells) };
    let Some((carried, copy)) = bells.hello_fds() else {
        close_all(&[token]);
        return fail(&[memfd, unix], bells);
    };
    let mut all = vec![memfd];
    all.extend_from_slice(&carried);
    all.push(token);
    let sent = send_fds(unix, &h, &all);
    close_all(&[token]);
    close_all(&copy.into_iter().collect::<Vec<_>>());
    if !sent {
        return fail(&[memfd, unix], bells);
    }
    // Path B: our own name, for an acceptor that did not get the hello.
    // SAFETY: plain syscall.
    let mut listener = unsafe {
        real::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0)
    };
    if listener >= 0 {
        let (sa, len) = conn_name(ino);
        // SAFETY: an initialised sockaddr_un; plain syscalls.
        let ok = unsafe {
            real::bind(listener, (&sa as *const libc::sockaddr_un).cast(), len) == 0
                && real::listen(listener, 4) == 0
        };
        if !ok {
            close_all(&[listener]);
            listener = -1;
        }
    }
    // (Asked once: for our own listener it counts our threads in /proc.)
    let (wait, now) = (attach_wait(link.ours), Instant::now());
    Some(Prepared {
        shm,
        memfd,
        holder: link.holder,
        dest: link.dest,
        bells,
        pending: PendingC {
            marker: unix,
            listener,
            hello: h,
            deadline: now + wait,
            wait,
            since: now,
            own: link.ours,
            look: Duration::ZERO,
            asked: -1,
        },
    })
}

/// After the TCP connect started (or finished): registers the pending connection.
pub fn register(fd: c_int, p: Prepared) {
    // SAFETY: plain syscall.
    let nonblock = unsafe { real::fcntl(fd, libc::F_GETFL, 0) } & libc::O_NONBLOCK != 0;
    // The vault keeps the memfd from now on (path B and `exec` take copies).
    let vault = crate::vault::keep(p.memfd);
    close_all(&[p.memfd]);
    let conn = Arc::new(Conn::new(
        p.shm,
        0,
        Carriers {
            bells: match p.bells {
                Offer::Own(c, a) => Bells::Own { mine: c, peer: a },
                Offer::Pair(pair, my_slot) => {
                    Bells::Pending(vec![Offered { attach: ATTACHED, pair, my_slot }])
                }
            },
            liveness: Liveness::TcpSocket,
            vault,
            peer_pid: (p.holder > 0).then_some(p.holder),
        },
        nonblock,
        Some(p.pending),
    ));
    conn.bind_bells();
    conn.set_origin(p.dest);
    awaiting().push_back(Arc::downgrade(&conn));
    if let Some(old) = crate::table::insert(fd, conn) {
        crate::table::drop_ref(old);
    }
}

/// This process's connectors that may still wait for their acceptors, oldest
/// first.
static AWAITING: Mutex<std::collections::VecDeque<std::sync::Weak<Conn>>> =
    Mutex::new(std::collections::VecDeque::new());

fn awaiting() -> std::sync::MutexGuard<'static, std::collections::VecDeque<std::sync::Weak<Conn>>> {
    AWAITING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Before a new connect: settles the oldest connectors whose acceptors attached
/// (or whose wait for them ended) although the program has not used them since,
/// so their marker links and path-B names close now (an acceptor asking by path B
/// then learns at once that there is nothing to attach to). A client that opens thousands of connections before it
/// uses any (a pool filled at start) then holds what the kernel would, not three
/// descriptors for each until its first use. Amortised: each connector leaves the
/// queue once; the sweep stops at the first still waiting (acceptors attach in
/// about the order connectors came).
fn settle_attached() {
    let mut q = awaiting();
    while let Some(w) = q.front() {
        let Some(c) = w.upgrade() else {
            q.pop_front();
            continue;
        };
        // (One whose deadline passed stays too: deciding takes its descriptor.)
        if c.awaiting_attach() && c.state() == PENDING {
            break;
        }
        q.pop_front();
        drop(q);
        // Without the program's descriptor: only a decided state is taken (a
        // path-B ask is answered by the program's next call).
        c.try_settle(-1);
        q = awaiting();
    }
}

/// Under descriptor pressure (a call of the program's that makes a descriptor
/// failed with EMFILE): the connectors of this process still waiting for their
/// acceptors stay with the kernel (decided now: an acceptor that comes later finds
/// the connection taken), and the descriptors they held for the wait (the marker
/// link, the path-B name, an asker's socket) close. Each one's next use finds it
/// on the kernel. Returns how many were let go.
pub(crate) fn shed_pending() -> usize {
    let waiting: Vec<Arc<Conn>> = awaiting().iter().filter_map(std::sync::Weak::upgrade).collect();
    waiting.iter().filter(|c| c.shed_pending()).count()
}

impl Prepared {
    /// The TCP connect failed: undo.
    pub fn abandon(self) {
        close_all(&[self.memfd]);
        self.bells.undo();
        self.pending.close();
    }
}

/// The first look at a connection whose acceptor cannot have attached yet, after
/// the attach deadline (then every twice as long, up to [`QUEUE_LOOK_MAX`]).
const QUEUE_LOOK_FIRST: Duration = Duration::from_millis(20);
const QUEUE_LOOK_MAX: Duration = Duration::from_millis(500);
/// A connection another process's listener holds in its accept queue is waited
/// for at most this many attach waits after the hello.
const QUEUE_WAITS: u32 = 60;
/// An accepted connection whose hello the listener's process still holds is
/// waited for at most this many attach waits after the hello.
const HELD_WAITS: u32 = 2;

impl PendingC {
    /// At the attach deadline: true if the connector keeps waiting because its
    /// acceptor cannot have attached yet: the kernel's handshake is still under way
    /// (a SYN dropped at a full accept queue is sent again only after a second),
    /// the connection waits in another process's accept queue (the kernel's
    /// diagnostics show no inode for its far end: a busy server accepts thousands
    /// late, and the kernel would keep them there too), or it was accepted but the
    /// marker's holder still holds our hello (our link to it is open: the acceptor
    /// is between the kernel's accept and its attach, which closes the link, as
    /// dropping the hello does). A connection to our own listener is not waited for
    /// beyond the attach wait (our own thread may be the acceptor); another's, at
    /// most [`QUEUE_WAITS`] attach waits in the accept queue and [`HELD_WAITS`]
    /// once accepted. The deadline moves to the next look.
    pub fn acceptor_pending(&mut self, fd: c_int, now: Instant) -> bool {
        if self.wait.is_zero() {
            return false;
        }
        let until = |n: u32| self.since + self.wait * n;
        // Waiting until when, for what reason.
        let end = if crate::sock::tcp_connecting(fd) {
            // (The kernel's connect gives up by itself.)
            Some(now + QUEUE_LOOK_MAX)
        } else if self.own {
            None
        } else if now < until(QUEUE_WAITS) && crate::listening::far_end_unaccepted(fd) {
            Some(until(QUEUE_WAITS))
        } else if now < until(HELD_WAITS) && self.hello_held() {
            Some(until(HELD_WAITS))
        } else {
            None
        };
        let Some(end) = end else { return false };
        self.look = (self.look * 2).clamp(QUEUE_LOOK_FIRST, QUEUE_LOOK_MAX);
        self.deadline = (now + self.look).min(end);
        true
    }

    /// The marker's holder still holds our hello: its end of our link is open.
    fn hello_held(&self) -> bool {
        if self.marker < 0 {
            return false;
        }
        let mut p = libc::pollfd { fd: self.marker, events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: one pollfd; no waiting.
        let r = unsafe { real::poll(&mut p, 1, 0) };
        r == 0
    }

    /// Closes everything kept until settling, now, leaving nothing to close later.
    pub fn close_now(&mut self) {
        self.close();
        (self.marker, self.listener, self.asked) = (-1, -1, -1);
    }

    /// Closes everything kept until settling (the marker link, the path-B name and
    /// the socket of an acceptor that asked there).
    pub fn close(&self) {
        let fds: Vec<c_int> =
            [self.marker, self.listener, self.asked].into_iter().filter(|&f| f >= 0).collect();
        close_all(&fds);
    }

    /// Path B, connector side: serves one request waiting at our name, after
    /// checking that the asker holds the other end of `fd`. Returns the Unix socket
    /// the hello went out on, and the pair offered to the asker (a pair with the
    /// asker's process: the marker's holder is another process).
    pub fn serve(
        &self,
        fd: c_int,
        with: ServeWith,
        vault: crate::vault::Kept,
    ) -> Option<(c_int, Option<Offered>)> {
        if self.listener < 0 {
            return None;
        }
        let c = accept_waiting(self.listener)?;
        // The request is sent right after connecting: wait a little for it (a
        // silent asker costs at most this, once per connection).
        let mut p = libc::pollfd { fd: c, events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd.
        unsafe { real::poll(&mut p, 1, 10) };
        let mut buf = [0u8; 16];
        let (n, theirs) = match recv_fds_now(c, &mut buf) {
            Ok(m) => {
                // The connector's socket comes first; anything else is not ours to keep.
                close_all(m.fds.get(1..).unwrap_or_default());
                (m.len as isize, m.fds.first().copied().unwrap_or(-1))
            }
            Err(_) => (-1, -1),
        };
        // The asker's token must name the accepted end of our connection.
        let ok = n == 16
            && u64::from_le_bytes(buf[0..8].try_into().unwrap_or_default()) == REQ_MAGIC
            && theirs >= 0
            && matches!((sock_key(fd, true), sock_key(fd, false)), (Some(peer), Some(local))
                if trust::token_names(theirs, Proto::Tcp, peer, local));
        if theirs >= 0 {
            close_all(&[theirs]);
        }
        if !ok {
            close_all(&[c]);
            return trust::refuse();
        }
        let Some(token) = trust::socket_token(fd) else {
            close_all(&[c]);
            return None;
        };
        let offer = match with {
            ServeWith::Own([efd_c, efd_a]) => Offer::Own(efd_c, efd_a),
            ServeWith::Pair => {
                let asker = trust::peer_cred(c).map_or(0, |cr| cr.pid);
                let pair = crate::pair::for_peer(asker);
                match pair.and_then(|p| p.claim().map(|s| (p, s))) {
                    Some((p, s)) => Offer::Pair(p, s),
                    None => {
                        close_all(&[c, token]);
                        return None;
                    }
                }
            }
        };
        let fail = |offer: Offer, fds: &[c_int]| {
            close_all(fds);
            if matches!(offer, Offer::Pair(..)) {
                offer.undo();
            }
            None
        };
        let Some(memfd) = crate::vault::copy(vault) else { return fail(offer, &[c, token]) };
        let Some((carried, copy)) = offer.hello_fds() else { return fail(offer, &[c, token, memfd]) };
        let mut hello = self.hello;
        if let Offer::Pair(_, slot) = &offer {
            hello[16..20].copy_from_slice(&slot.to_le_bytes());
        }
        let mut all = vec![memfd];
        all.extend_from_slice(&carried);
        all.push(token);
        let sent = send_fds(c, &hello, &all);
        close_all(&[token, memfd]);
        close_all(&copy.into_iter().collect::<Vec<_>>());
        if !sent {
            return fail(offer, &[c]);
        }
        let offered = match offer {
            Offer::Pair(pair, my_slot) => Some(Offered { attach: ATTACHED_B, pair, my_slot }),
            Offer::Own(..) => None,
        };
        Some((c, offered))
    }
}

/// A pending connector whose peer never attached: back to the kernel for good.
pub fn give_up(fd: c_int, conn: &Arc<Conn>) {
    debug_assert_eq!(conn.state(), KERNEL);
    if crate::table::remove_conn(conn) == 0 {
        // Another thread gave it up (two of the program's calls were settling it,
        // a read and a write): once.
        return;
    }
    if let Some(how) = conn.deferred_kernel_shutdown() {
        // The program shut it down while it waited: the kernel socket does now.
        // SAFETY: plain syscall on the program's socket.
        unsafe { real::shutdown(fd, how) };
    }
    crate::conn::KERNEL_FALLBACKS.fetch_add(1, Ordering::Relaxed);
    // A non-blocking connector may already be in epoll sets: its socket joins them.
    crate::epoll::to_kernel(conn);
}

// ------------------------------------------------------------------ listeners

/// The strait side of the listening socket `fd` on this host, if it has one.
pub fn listener(fd: c_int) -> Option<Arc<Listener>> {
    crate::table::listening(fd)?.local.get().cloned()
}

fn add_listener(fd: c_int, l: Arc<Listener>) {
    // Set once: a second registration was refused before it made a marker.
    let _ = crate::table::listening_or_new(fd).local.set(l);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sock::is_wildcard;
    use std::os::fd::AsRawFd;

    #[test]
    fn wildcard_addresses_are_recognised() {
        let mut v4_any = [0u8; 16];
        v4_any[10] = 255;
        v4_any[11] = 255;
        let mut v4_lo = v4_any;
        v4_lo[12] = 127;
        v4_lo[15] = 1;
        assert!(is_wildcard(&[0; 16]) && is_wildcard(&v4_any));
        assert!(!is_wildcard(&v4_lo));
    }

    /// A hello's token is taken while the connector's socket is still unconnected
    /// (unbound, or bound to the wildcard, as when the hello goes out); once
    /// connected, it proves exactly that connection: the accepted socket of another
    /// connection is not claimed.
    #[test]
    fn a_hello_proves_its_own_connection_only() {
        for bound in [false, true] {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
            let sock = tcp_socket(bound);
            let token = crate::trust::socket_token(sock).expect("token");
            let ino = crate::trust::token_inode(token).expect("a socket's token");
            assert_eq!(crate::trust::token_inode(sock), Some(ino), "the socket and its token name one inode");
            let h = Hello {
                shm: None,
                vault: crate::vault::Kept::Nothing,
                bells: [-1; 2],
                pair: None,
                ino,
                uid: 0,
                pid: 0,
                unix: -1,
                at: Instant::now(),
            };
            let addr = listener.local_addr().expect("addr");
            let sa = libc::sockaddr_in {
                sin_family: libc::AF_INET as u16,
                sin_port: addr.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be() },
                sin_zero: [0; 8],
            };
            // SAFETY: a sockaddr_in of the right length, our socket.
            let r = unsafe { libc::connect(sock, (&sa as *const libc::sockaddr_in).cast(), 16) };
            assert_eq!(r, 0, "connect");
            let (accepted, _) = listener.accept().expect("accept");
            let other = std::net::TcpStream::connect(addr).expect("connect");
            let (other_accepted, _) = listener.accept().expect("accept");
            assert_eq!(far_end_inode(accepted.as_raw_fd()), Some(ino));
            let is_for = |fd: c_int| far_end_inode(fd).is_some_and(|i| h.names(i));
            assert!(is_for(accepted.as_raw_fd()));
            assert!(!is_for(other_accepted.as_raw_fd()));
            assert!(!h.names(0), "an inode the kernel could not give names nothing");
            close_all(&[sock, token]);
            drop((accepted, other, other_accepted));
        }
    }

    /// A TCP socket, unbound or bound to 0.0.0.0 with an ephemeral port.
    fn tcp_socket(bound: bool) -> c_int {
        // SAFETY: plain socket calls on a socket we own.
        unsafe {
            let s = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(s >= 0);
            let sa = libc::sockaddr_in {
                sin_family: libc::AF_INET as u16,
                sin_port: 0,
                sin_addr: libc::in_addr { s_addr: 0 },
                sin_zero: [0; 8],
            };
            assert!(!bound || libc::bind(s, (&sa as *const libc::sockaddr_in).cast(), 16) == 0);
            s
        }
    }
}
