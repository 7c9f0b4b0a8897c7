//! The connection setup and the [`Device`] implementation.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use strait_core::config::env_num;
use strait_core::device::{Device, DeviceError, DeviceStats, FrameWriter, RndvPath, RxFrame};
use strait_core::notifier::notify_fd;
use strait_core::{ConfigError, Notifier};
use thiserror::Error;

use crate::area::{ByteArea, MappedArea};
use crate::calibrate::{self, RndvChoice};
use crate::ring::{self, AtomicU64, Consumer, Producer};
use crate::sys;
use strait_sys::Mapping;

const MAGIC: u64 = 0x3130_4d48_5354_5253; // "SRTSHM01"
const VERSION: u32 = 1;
const HEADER_BYTES: usize = 4096;
/// Offset of ring `k`'s control block; each word sits on its own 128-byte pair of
/// cache lines so that the producer's and consumer's writes never share one.
const fn ring_ctl(k: usize) -> usize {
    1024 + k * 1024
}
const HEAD: usize = 256;
const SLEEP: usize = 512;
/// Set by a side that shuts down (in the control block of the ring it produces).
const CLOSED: usize = 768;
/// Consumed bytes a doorbell hands back on the way (see `ShmDevice::doorbell`).
const SMALL_HAND_BACK: u64 = 1024;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
const HELLO_LEN: usize = 32;

/// A value at a known address in every strait process: a peer reads it with
/// `process_vm_readv` at setup to learn whether single-copy reads work.
static PROBE: u64 = 0x4542_4f52_5054_5253; // "SRTPROBE"

/// Who may be at the other end of a connection. Both sides check it against the
/// kernel's record of the peer (SO_PEERCRED: the uid of the process that connected,
/// or that called `listen` on the listener) before any descriptor leaves the
/// process, so a peer cannot lie about it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PeerPolicy {
    /// Only processes running with this process's effective uid, and root (the
    /// default).
    #[default]
    SameUser,
    /// The same user and root, and also the listed uids (an explicit opt-in: a peer
    /// of another user gets the shared rings, and may be read with
    /// `process_vm_readv` if the kernel allows it).
    Uids(Vec<u32>),
    /// Any local user (an explicit opt-in; the peer's uid is still recorded).
    AnyUser,
}

impl PeerPolicy {
    /// True if a peer running as `uid` may connect (or be connected to).
    pub fn allows(&self, uid: u32) -> bool {
        if uid == sys::euid() || uid == 0 {
            return true;
        }
        match self {
            PeerPolicy::SameUser => false,
            PeerPolicy::Uids(uids) => uids.contains(&uid),
            PeerPolicy::AnyUser => true,
        }
    }
}

/// Settings of the shm device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmConfig {
    /// Bytes of each direction's ring (a power of two, 64 KiB to 1 GiB). The
    /// largest frame is a quarter of it; copy-mode rendezvous chunks are clamped to
    /// that. For a listener, the largest ring a connector may ask for: a larger
    /// request is refused before anything is mapped.
    pub ring_bytes: usize,
    /// Which peers are accepted (listener) or trusted (connector).
    pub peer_policy: PeerPolicy,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig { ring_bytes: 1 << 20, peer_policy: PeerPolicy::SameUser }
    }
}

impl ShmConfig {
    /// Defaults, overridden by `STRAIT_SHM_RING_SIZE` (k/M suffixes allowed). The
    /// peer policy is never taken from the environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        let mut c = ShmConfig::default();
        if let Some(v) = env_num("STRAIT_SHM_RING_SIZE")? {
            c.ring_bytes = v as usize;
            if c.validate().is_err() {
                return Err(ConfigError {
                    var: "STRAIT_SHM_RING_SIZE",
                    value: v.to_string(),
                    why: "must be a power of two between 64 KiB and 1 GiB",
                });
            }
        }
        Ok(c)
    }

    fn validate(&self) -> Result<(), ShmError> {
        validate_ring(self.ring_bytes)
    }
}

fn validate_ring(ring_bytes: usize) -> Result<(), ShmError> {
    if !ring_bytes.is_power_of_two() || !(64 << 10..=1 << 30).contains(&ring_bytes) {
        return Err(ShmError::Config(format!(
            "ring_bytes {ring_bytes} must be a power of two between 64 KiB and 1 GiB"
        )));
    }
    Ok(())
}

/// Errors setting up an shm connection.
#[derive(Debug, Error)]
pub enum ShmError {
    /// A socket or memory system call failed.
    #[error("{op} ({name}): {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The endpoint name.
        name: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The other side is not a compatible strait peer, or broke the handshake.
    #[error("handshake with {name} failed: {why}")]
    Handshake {
        /// The endpoint name.
        name: String,
        /// What went wrong.
        why: String,
    },
    /// The process at the other end runs as a user the [`PeerPolicy`] does not
    /// allow (for a connector: someone else holds the name). Nothing was sent to it.
    #[error("{name} is held by uid {uid} (pid {pid:?}), which the peer policy does not allow")]
    PeerRefused {
        /// The endpoint name.
        name: String,
        /// The peer's uid (from SO_PEERCRED).
        uid: u32,
        /// The peer's pid, if visible.
        pid: Option<i32>,
    },
    /// Invalid settings.
    #[error("invalid shm settings: {0}")]
    Config(String),
}

fn io_err<'a>(op: &'static str, name: &'a str) -> impl FnOnce(io::Error) -> ShmError + 'a {
    move |source| ShmError::Io { op, name: name.to_string(), source }
}

fn hs_err(name: &str, why: impl Into<String>) -> ShmError {
    ShmError::Handshake { name: name.to_string(), why: why.into() }
}

/// Handshakes a listener keeps in progress at once; beyond this the oldest is
/// dropped (from the uid that holds the most).
const PENDING_MAX: usize = 16;
/// Handshakes one uid may have in progress at a listener; beyond this its oldest is
/// dropped.
const PENDING_PER_UID: usize = 8;
/// Connections taken from the kernel's backlog per [`ShmListener::poll_accept`].
const ACCEPT_BATCH: usize = 64;

/// Counters of a listener (see [`ShmListener::stats`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ListenerStats {
    /// Connections handed out as devices.
    pub accepted: u64,
    /// Connections closed at once because the peer's uid is not allowed.
    pub refused_peers: u64,
    /// Handshakes that failed (bad hello, ring too large, peer hung up, ...).
    pub failed_handshakes: u64,
    /// Handshakes dropped unfinished: timed out, or evicted by the caps.
    pub dropped_pending: u64,
    /// Handshakes in progress now.
    pub pending: u64,
}

/// A connection whose hello has not arrived yet.
struct Pending {
    conn: OwnedFd,
    cred: sys::PeerCred,
    since: Instant,
}

struct ListenerState {
    pending: VecDeque<Pending>,
    stats: ListenerStats,
    last_failure: Option<String>,
}

/// Accepts shm connections under a name.
///
/// A name that starts with `/` is a filesystem path for the rendezvous socket
/// (removed when the listener is dropped). Its file is created with mode `0600`
/// under [`PeerPolicy::SameUser`] (only the owner, and root, can connect to it) and
/// `0666` under the other policies (so that the allowed users can reach it; the
/// peer-credential check still applies); connecting also needs search permission on
/// the directories above it. Any other name is an abstract Unix socket name,
/// visible only inside the network namespace and never a file: abstract names have
/// no permissions, so anyone may bind one first, which is why connectors check the
/// listener's credentials too.
///
/// Handshakes run without blocking on any one peer: connections wait in a small
/// table (at most 16, 8 per uid, each at most 5 s; the oldest goes first) and
/// whichever hello arrives is served, so a silent or slow connector costs other
/// connectors nothing.
pub struct ShmListener {
    sock: OwnedFd,
    /// Watches the listening socket and every pending connection.
    epoll: OwnedFd,
    name: String,
    cfg: ShmConfig,
    state: Mutex<ListenerState>,
}

impl std::fmt::Debug for ShmListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmListener").field("name", &self.name).field("cfg", &self.cfg).finish()
    }
}

impl ShmListener {
    /// Binds and listens on `name` with [`ShmConfig::from_env`] (the default peer
    /// policy, and the ring size a connector may ask for at most).
    pub fn bind(name: &str) -> Result<ShmListener, ShmError> {
        let cfg = ShmConfig::from_env().map_err(|e| ShmError::Config(e.to_string()))?;
        Self::bind_with(name, &cfg)
    }

    /// Binds and listens on `name`: `cfg.ring_bytes` caps the rings connectors may
    /// ask for, `cfg.peer_policy` says who may connect.
    pub fn bind_with(name: &str, cfg: &ShmConfig) -> Result<ShmListener, ShmError> {
        cfg.validate()?;
        let (sa, len) = sys::unix_addr(name).map_err(io_err("address", name))?;
        let sock = sys::seqpacket_socket().map_err(io_err("socket", name))?;
        let path_mode = if cfg.peer_policy == PeerPolicy::SameUser { 0o600 } else { 0o666 };
        if name.starts_with('/') {
            // The socket file is created with the socket inode's mode less the umask:
            // set it before `bind`, so the file is never more open than this.
            sys::fchmod(sock.as_raw_fd(), path_mode).map_err(io_err("fchmod", name))?;
        }
        sys::set_nonblocking(sock.as_raw_fd()).map_err(io_err("fcntl", name))?;
        let epoll = sys::epoll().map_err(io_err("epoll_create", name))?;
        // SAFETY: `sa` is an initialised sockaddr_un of length `len`.
        sys::cvt(unsafe { libc::bind(sock.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), len) })
            .map_err(io_err("bind", name))?;
        // From here on, dropping the listener removes a path name's socket file.
        let l = ShmListener {
            sock,
            epoll,
            name: name.to_string(),
            cfg: cfg.clone(),
            state: Mutex::new(ListenerState {
                pending: VecDeque::new(),
                stats: ListenerStats::default(),
                last_failure: None,
            }),
        };
        if name.starts_with('/') && path_mode != 0o600 {
            // Widen past the umask on purpose (the allowed users need write access).
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(name, std::fs::Permissions::from_mode(path_mode))
                .map_err(io_err("chmod", name))?;
        }
        sys::epoll_add(&l.epoll, l.sock.as_raw_fd()).map_err(io_err("epoll_ctl", name))?;
        // SAFETY: plain syscall.
        sys::cvt(unsafe { libc::listen(l.sock.as_raw_fd(), 128) }).map_err(io_err("listen", name))?;
        Ok(l)
    }

    /// The name this listener was bound to.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// An fd for use in an event loop: it polls readable when
    /// [`ShmListener::poll_accept`] has something to do (a new connection, or a hello
    /// on a pending one). Call `poll_accept` then, and at least every few seconds
    /// while [`ListenerStats::pending`] is nonzero (to expire stalled handshakes).
    pub fn as_raw_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// The listener's counters.
    pub fn stats(&self) -> ListenerStats {
        let st = self.lock();
        ListenerStats { pending: st.pending.len() as u64, ..st.stats }
    }

    /// Why the most recent handshake failed, if one did (connectors are not
    /// reported to the caller one by one: a bad connector must not stop a server).
    pub fn last_failure(&self) -> Option<String> {
        self.lock().last_failure.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ListenerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a connection and completes its handshake; `notifier` is the eventfd
    /// of the worker the device will be attached to (the peer writes it to wake that
    /// worker). Connections from users the peer policy does not allow, and failed
    /// handshakes, are dropped and counted (see [`ShmListener::stats`]); a peer that
    /// stalls its handshake is dropped after 5 s without delaying anyone else.
    pub fn accept(&self, notifier: &Notifier) -> Result<ShmDevice, ShmError> {
        loop {
            if let Some(d) = self.accept_timeout(notifier, None)? {
                return Ok(d);
            }
        }
    }

    /// Like [`ShmListener::accept`], but gives up after `timeout` (`None`: never),
    /// returning `Ok(None)`.
    pub fn accept_timeout(
        &self,
        notifier: &Notifier,
        timeout: Option<Duration>,
    ) -> Result<Option<ShmDevice>, ShmError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(d) = self.poll_accept(notifier)? {
                return Ok(Some(d));
            }
            let now = Instant::now();
            // Wake for the oldest pending handshake's expiry, or the caller's deadline.
            let expiry = self.lock().pending.front().map(|p| p.since + HANDSHAKE_TIMEOUT);
            let until = match (deadline, expiry) {
                (Some(d), Some(e)) => Some(d.min(e)),
                (d, e) => d.or(e),
            };
            let ms = match until {
                Some(u) if u <= now => {
                    if deadline.is_some_and(|d| d <= now) {
                        return Ok(None);
                    }
                    0
                }
                Some(u) => ((u - now).as_micros().div_ceil(1000)).min(i32::MAX as u128) as i32,
                None => -1,
            };
            let mut p = libc::pollfd { fd: self.epoll.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one live pollfd.
            let r = unsafe { libc::poll(&mut p, 1, ms) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(io_err("poll", &self.name)(e));
                }
            }
        }
    }

    /// Does whatever handshake work is ready, without blocking: takes new
    /// connections (checking their credentials), serves any hello that arrived, drops
    /// expired handshakes. Returns a device if a handshake completed.
    pub fn poll_accept(&self, notifier: &Notifier) -> Result<Option<ShmDevice>, ShmError> {
        let mut st = self.lock();
        let now = Instant::now();
        let before = st.pending.len();
        st.pending.retain(|p| now.duration_since(p.since) < HANDSHAKE_TIMEOUT);
        st.stats.dropped_pending += (before - st.pending.len()) as u64;
        for _ in 0..ACCEPT_BATCH {
            // SAFETY: accept4 without an address buffer.
            let fd = unsafe {
                libc::accept4(
                    self.sock.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                )
            };
            if fd < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR | libc::ECONNABORTED) => continue,
                    // Out of descriptors: serve what is pending; the backlog waits.
                    Some(libc::EAGAIN | libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => break,
                    _ => return Err(io_err("accept", &self.name)(e)),
                }
            }
            // SAFETY: fresh fd owned by nobody else.
            let conn = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            let Ok(cred) = sys::peer_cred(conn.as_raw_fd()) else {
                st.stats.failed_handshakes += 1;
                continue;
            };
            if !self.cfg.peer_policy.allows(cred.uid) {
                // Closed without a word: the peer learns nothing but the hang-up.
                st.stats.refused_peers += 1;
                continue;
            }
            self.admit(&mut st, Pending { conn, cred, since: now });
        }
        // Serve the hellos that arrived, oldest connection first.
        let mut i = 0;
        while i < st.pending.len() {
            let mut hello = [0u8; 64];
            let got = sys::recv_with_fds(st.pending[i].conn.as_raw_fd(), &mut hello, libc::MSG_DONTWAIT);
            if matches!(&got, Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
                i += 1;
                continue;
            }
            let Some(p) = st.pending.remove(i) else { break };
            let res = match got {
                Ok((0, _)) => Err(hs_err(&self.name, "the connector hung up before its hello")),
                Ok((n, fds)) => self.finish(p, &hello[..n.min(hello.len())], fds, notifier),
                Err(e) => Err(io_err("handshake recv", &self.name)(e)),
            };
            match res {
                Ok(dev) => {
                    st.stats.accepted += 1;
                    return Ok(Some(dev));
                }
                Err(e) => {
                    st.stats.failed_handshakes += 1;
                    st.last_failure = Some(e.to_string());
                }
            }
        }
        Ok(None)
    }

    /// Puts a new connection in the pending table, making room by the caps.
    fn admit(&self, st: &mut ListenerState, p: Pending) {
        let uid = p.cred.uid;
        let of_uid = st.pending.iter().filter(|q| q.cred.uid == uid).count();
        let evict_uid = if of_uid >= PENDING_PER_UID {
            Some(uid)
        } else if st.pending.len() >= PENDING_MAX {
            // The uid holding the most entries gives up its oldest.
            let mut counts: Vec<(u32, usize)> = Vec::new();
            for q in &st.pending {
                match counts.iter_mut().find(|c| c.0 == q.cred.uid) {
                    Some(c) => c.1 += 1,
                    None => counts.push((q.cred.uid, 1)),
                }
            }
            counts.iter().max_by_key(|c| c.1).map(|c| c.0)
        } else {
            None
        };
        if let Some(victim) = evict_uid {
            if let Some(pos) = st.pending.iter().position(|q| q.cred.uid == victim) {
                st.pending.remove(pos);
                st.stats.dropped_pending += 1;
            }
        }
        if sys::epoll_add(&self.epoll, p.conn.as_raw_fd()).is_err() {
            st.stats.failed_handshakes += 1;
            return;
        }
        st.pending.push_back(p);
    }

    /// Completes a handshake whose hello arrived: validates everything the connector
    /// sent against this listener's own limits, maps the rings, answers.
    fn finish(
        &self,
        p: Pending,
        hello: &[u8],
        mut fds: Vec<OwnedFd>,
        notifier: &Notifier,
    ) -> Result<ShmDevice, ShmError> {
        let name = &self.name;
        let conn = p.conn;
        let max_pages = (self.cfg.ring_bytes / 4096) as u32;
        let refuse = |why: String| {
            let _ = sys::send_with_fds(conn.as_raw_fd(), &reply(1, 0, max_pages), &[]);
            hs_err(name, why)
        };
        if hello.len() != HELLO_LEN || fds.len() != 2 {
            return Err(refuse(format!(
                "hello of {} bytes with {} fds (expected {HELLO_LEN} and 2)",
                hello.len(),
                fds.len()
            )));
        }
        let magic = le_u64(&hello[0..8]);
        let version = le_u32(&hello[8..12]);
        let ring_bytes = le_u32(&hello[12..16]) as usize * 4096;
        let probe_addr = le_u64(&hello[16..24]);
        if magic != MAGIC || version != VERSION {
            return Err(refuse(format!(
                "not a strait shm peer of version {VERSION} (magic {magic:#x}, version {version})"
            )));
        }
        validate_ring(ring_bytes).map_err(|e| refuse(e.to_string()))?;
        if ring_bytes > self.cfg.ring_bytes {
            return Err(refuse(format!(
                "the connector asked for rings of {ring_bytes} bytes; this listener allows {}",
                self.cfg.ring_bytes
            )));
        }
        let (Some(peer_wake), Some(memfd)) = (fds.pop(), fds.pop()) else {
            return Err(refuse("hello without its descriptors".into()));
        };
        if !sys::is_eventfd(peer_wake.as_raw_fd()) {
            return Err(refuse("the connector's doorbell is not an eventfd".into()));
        }
        let total = HEADER_BYTES + 2 * ring_bytes;
        sys::check_memfd(&memfd, total).map_err(&refuse)?;
        let map = Mapping::shared(memfd.as_raw_fd(), total, 0).map_err(io_err("mmap", name))?;
        drop(memfd);
        // SAFETY: the mapping is at least HEADER_BYTES long and page-aligned.
        let hdr_magic = unsafe { std::ptr::read_volatile(map.ptr().cast::<u64>()) };
        if hdr_magic != MAGIC {
            return Err(refuse("shared memory header has the wrong magic".into()));
        }
        sys::send_with_fds(
            conn.as_raw_fd(),
            &reply(0, std::ptr::addr_of!(PROBE) as u64, max_pages),
            &[notifier.as_raw_fd()],
        )
        .map_err(io_err("handshake send", name))?;
        let pidfd = sys::peer_pidfd(conn.as_raw_fd());
        ShmDevice::new(map, ring_bytes, conn, peer_wake, Side::Acceptor, probe_addr, (p.cred, pidfd))
    }
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn reply(status: u32, probe_addr: u64, max_pages: u32) -> [u8; HELLO_LEN] {
    let mut r = [0u8; HELLO_LEN];
    r[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    r[8..12].copy_from_slice(&VERSION.to_le_bytes());
    r[12..16].copy_from_slice(&status.to_le_bytes());
    r[16..24].copy_from_slice(&probe_addr.to_le_bytes());
    r[24..28].copy_from_slice(&max_pages.to_le_bytes());
    r
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        if self.name.starts_with('/') {
            let _ = std::fs::remove_file(&self.name);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Connector,
    Acceptor,
}

/// One end of an shm connection: a [`Device`] for [`strait_core::Engine::attach`] (a
/// `Worker`'s too).
pub struct ShmDevice {
    map: Mapping,
    sock: OwnedFd,
    peer_wake: OwnedFd,
    peer_pid: Option<libc::pid_t>,
    peer_uid: u32,
    /// The peer process itself (SO_PEERPIDFD), to tell after a remote read whether
    /// its pid could have been reused.
    pidfd: Option<OwnedFd>,
    remote_read_ok: bool,
    /// Remote writes into the peer possible: remote reads work and the peer is
    /// another process (a process paired with itself gains nothing from them, and a
    /// write at an address its own peer named must never land in its own memory).
    remote_write_ok: bool,
    /// This process when the connection was made: the peer reads and writes it (by
    /// the pid it learned then), so a fork child offers neither (no address in its
    /// announcements, no split asked for).
    own_pid: libc::pid_t,
    /// The rendezvous path measured fastest on this host ([`calibrate`]).
    preferred: RndvPath,
    tx: Producer,
    rx: Consumer,
    tx_data: MappedArea,
    rx_data: MappedArea,
    tx_ring: usize,
    rx_ring: usize,
    tx_blocked: Option<usize>,
    /// Frames published since the last doorbell.
    tx_dirty: bool,
    /// Ring space handed back to the peer since the last doorbell.
    rx_freed: bool,
    /// Consumed bytes are handed back in batches of this size (or sooner when
    /// sending or going to sleep): see `ring::Consumer::publish`.
    publish_batch: u64,
    max_payload: usize,
    failed: Option<DeviceError>,
    shut: bool,
    stats: DeviceStats,
}

// SAFETY: the raw pointers point into the device's own shared mapping, which lives as
// long as the device and is not tied to a thread; all shared words are atomics.
unsafe impl Send for ShmDevice {}

impl std::fmt::Debug for ShmDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmDevice")
            .field("peer_pid", &self.peer_pid)
            .field("peer_uid", &self.peer_uid)
            .field("remote_read", &self.remote_read_ok)
            .field("ring_bytes", &self.tx_data.size())
            .field("stats", &self.stats)
            .finish()
    }
}

impl ShmDevice {
    /// Connects to the listener named `name` (see [`ShmListener`]); `notifier` is the
    /// eventfd of the worker the device will be attached to. The process holding the
    /// name must be allowed by `cfg.peer_policy` ([`ShmError::PeerRefused`] if not:
    /// checked before the shared memory or the eventfd is sent). Every step waits at
    /// most 5 s.
    pub fn connect(name: &str, cfg: &ShmConfig, notifier: &Notifier) -> Result<ShmDevice, ShmError> {
        cfg.validate()?;
        let (sa, len) = sys::unix_addr(name).map_err(io_err("address", name))?;
        let sock = sys::seqpacket_socket().map_err(io_err("socket", name))?;
        // Bounds `connect` too: a listener whose backlog stays full (one that never
        // accepts) would otherwise hold us forever.
        sys::set_timeouts(sock.as_raw_fd(), Some(HANDSHAKE_TIMEOUT)).map_err(io_err("setsockopt", name))?;
        loop {
            // SAFETY: `sa` is an initialised sockaddr_un of length `len`.
            let r = unsafe { libc::connect(sock.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), len) };
            if r == 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(io_err("connect", name)(e));
            }
        }
        // Who holds the name? Checked before our memory or doorbell leaves the process.
        let cred = sys::peer_cred(sock.as_raw_fd()).map_err(io_err("SO_PEERCRED", name))?;
        if !cfg.peer_policy.allows(cred.uid) {
            return Err(ShmError::PeerRefused { name: name.to_string(), uid: cred.uid, pid: cred.pid });
        }
        let pidfd = sys::peer_pidfd(sock.as_raw_fd());
        let total = HEADER_BYTES + 2 * cfg.ring_bytes;
        let memfd = sys::sealed_memfd(total).map_err(io_err("memfd", name))?;
        let map = Mapping::shared(memfd.as_raw_fd(), total, 0).map_err(io_err("mmap", name))?;
        // SAFETY: the fresh mapping is page-aligned and at least HEADER_BYTES long;
        // the peer has not seen it yet.
        unsafe {
            std::ptr::write_volatile(map.ptr().cast::<u64>(), MAGIC);
            std::ptr::write_volatile(map.ptr().add(8).cast::<u32>(), VERSION);
            std::ptr::write_volatile(map.ptr().add(12).cast::<u32>(), (cfg.ring_bytes / 4096) as u32);
        }
        let mut hello = [0u8; HELLO_LEN];
        hello[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        hello[8..12].copy_from_slice(&VERSION.to_le_bytes());
        hello[12..16].copy_from_slice(&((cfg.ring_bytes / 4096) as u32).to_le_bytes());
        hello[16..24].copy_from_slice(&(std::ptr::addr_of!(PROBE) as u64).to_le_bytes());
        sys::send_with_fds(sock.as_raw_fd(), &hello, &[memfd.as_raw_fd(), notifier.as_raw_fd()])
            .map_err(io_err("handshake send", name))?;
        drop(memfd);
        let mut buf = [0u8; 64];
        let (n, mut fds) =
            sys::recv_with_fds(sock.as_raw_fd(), &mut buf, 0).map_err(io_err("handshake recv", name))?;
        if n == 0 {
            return Err(hs_err(name, "listener closed the connection during the handshake"));
        }
        if n != HELLO_LEN || le_u64(&buf[0..8]) != MAGIC {
            return Err(hs_err(name, "the listener is not a strait shm endpoint"));
        }
        let status = le_u32(&buf[12..16]);
        let max_ring = le_u32(&buf[24..28]) as usize * 4096;
        if status != 0 && max_ring != 0 && cfg.ring_bytes > max_ring {
            return Err(hs_err(
                name,
                format!(
                    "the listener allows rings of at most {max_ring} bytes (asked for {})",
                    cfg.ring_bytes
                ),
            ));
        }
        if status != 0 || fds.len() != 1 {
            return Err(hs_err(name, "the listener refused the connection (see its error for why)"));
        }
        let probe_addr = le_u64(&buf[16..24]);
        let Some(peer_wake) = fds.pop() else {
            return Err(hs_err(name, "the listener sent no doorbell"));
        };
        if !sys::is_eventfd(peer_wake.as_raw_fd()) {
            return Err(hs_err(name, "the listener's doorbell is not an eventfd"));
        }
        sys::set_timeouts(sock.as_raw_fd(), None).map_err(io_err("setsockopt", name))?;
        ShmDevice::new(map, cfg.ring_bytes, sock, peer_wake, Side::Connector, probe_addr, (cred, pidfd))
    }

    fn new(
        map: Mapping,
        ring_bytes: usize,
        sock: OwnedFd,
        peer_wake: OwnedFd,
        side: Side,
        probe_addr: u64,
        (cred, pidfd): (sys::PeerCred, Option<OwnedFd>),
    ) -> Result<ShmDevice, ShmError> {
        // The pid used for remote reads is the kernel's record (SO_PEERCRED), kept
        // here; nothing the peer writes can change it.
        let peer_pid = cred.pid;
        // Ring 0 carries connector -> acceptor, ring 1 the other way.
        let (tx_ring, rx_ring) = match side {
            Side::Connector => (0, 1),
            Side::Acceptor => (1, 0),
        };
        // SAFETY: both data areas lie inside the mapping (HEADER_BYTES + 2 rings),
        // page-aligned, and the device keeps the mapping as long as its areas.
        let data =
            |k: usize| unsafe { MappedArea::new(map.ptr().add(HEADER_BYTES + k * ring_bytes), ring_bytes) };
        let remote_read_ok = match peer_pid {
            Some(pid) => {
                let mut v = 0u64;
                // SAFETY: reads 8 bytes into a local u64.
                let r = unsafe { sys::vm_read(pid, probe_addr, (&mut v as *mut u64).cast(), 8) };
                r.is_ok() && v == PROBE
            }
            None => false,
        };
        // Measured once per host (cached), and only where it could matter.
        let own_pid = this_pid();
        let remote_write_ok = remote_read_ok && peer_pid != Some(own_pid);
        let preferred = if remote_read_ok {
            match calibrate::calibration().choice {
                RndvChoice::Copy => RndvPath::Copy,
                RndvChoice::RemoteRead => RndvPath::RemoteRead,
                RndvChoice::Split => RndvPath::Split,
            }
        } else {
            RndvPath::Copy
        };
        Ok(ShmDevice {
            tx_data: data(tx_ring),
            rx_data: data(rx_ring),
            map,
            sock,
            peer_wake,
            peer_pid,
            peer_uid: cred.uid,
            pidfd,
            remote_read_ok,
            remote_write_ok,
            own_pid,
            preferred,
            tx: Producer::new(ring_bytes),
            rx: Consumer::new(ring_bytes),
            tx_ring,
            rx_ring,
            tx_blocked: None,
            tx_dirty: false,
            rx_freed: false,
            publish_batch: (ring_bytes / 8) as u64,
            max_payload: ring::max_payload(ring_bytes),
            failed: None,
            shut: false,
            stats: DeviceStats::default(),
        })
    }

    /// A control word. The reference is not tied to `&self` so that the ring state
    /// (`self.tx`, `self.rx`) can be borrowed mutably beside it; it stays valid as
    /// long as the mapping, which every caller (a method of `self`) outlives.
    fn word<'a>(&self, ring: usize, at: usize) -> &'a AtomicU64 {
        // SAFETY: the control words lie inside the header page of the mapping,
        // 8-byte aligned; AtomicU64 has the layout of u64, and the memory is only ever
        // accessed atomically by both processes. The mapping outlives every use (the
        // references never escape a method of the device that owns it).
        unsafe { &*self.map.ptr().add(ring_ctl(ring) + at).cast::<AtomicU64>() }
    }

    /// True if the peer can be read with single-copy remote reads.
    pub fn remote_read_available(&self) -> bool {
        self.remote_read_ok
    }

    /// The peer's process id (from SO_PEERCRED), if visible in our pid namespace.
    pub fn peer_pid(&self) -> Option<i32> {
        self.peer_pid
    }

    /// The peer's uid (from SO_PEERCRED).
    pub fn peer_uid(&self) -> u32 {
        self.peer_uid
    }

    fn corrupt(&mut self, why: String) -> DeviceError {
        self.stats.frames_rejected += 1;
        self.failed = Some(DeviceError::Corrupt(why.clone()));
        DeviceError::Corrupt(why)
    }

    #[inline]
    fn check_failed(&self) -> Result<(), DeviceError> {
        match self.failed {
            None => Ok(()),
            Some(_) => Err(self.failure()),
        }
    }

    #[cold]
    fn failure(&self) -> DeviceError {
        match &self.failed {
            Some(DeviceError::Corrupt(w)) => DeviceError::Corrupt(w.clone()),
            Some(e) => DeviceError::PeerGone(e.to_string()),
            None => DeviceError::PeerGone("no failure recorded".into()),
        }
    }

    fn peer_hung_up(&self) -> Result<bool, DeviceError> {
        if self.word(self.rx_ring, CLOSED).load(ring::Ordering::Acquire) != 0 {
            return Ok(true);
        }
        let ev = sys::poll_now(self.sock.as_raw_fd(), libc::POLLIN | libc::POLLRDHUP)
            .map_err(|source| DeviceError::Io { op: "poll", source })?;
        Ok(ev & (libc::POLLIN | libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0)
    }
}

impl ShmDevice {
    /// Wakes the peer if it announced sleep. Its flag sits in the control block of
    /// the ring it consumes.
    fn ring_peer(&mut self) -> Result<(), DeviceError> {
        if ring::peer_needs_wake(self.word(self.tx_ring, SLEEP)) {
            self.stats.wakeups_sent += 1;
            // The eventfd's file (and its O_NONBLOCK flag) is shared with the peer,
            // which could make a write block by filling the counter: write only when
            // it has room (a full counter has woken the peer anyway).
            let fd = self.peer_wake.as_raw_fd();
            let room =
                sys::poll_now(fd, libc::POLLOUT).map_err(|source| DeviceError::Io { op: "poll", source })?;
            if room & libc::POLLOUT == 0 {
                return Ok(());
            }
            if let Err(source) = notify_fd(fd) {
                return Err(DeviceError::Io { op: "eventfd write", source });
            }
        }
        Ok(())
    }

    fn arm_sleep_announced(&mut self) -> Result<bool, DeviceError> {
        ring::announce_sleep(self.word(self.rx_ring, SLEEP));
        let has_data = self.rx.has_data(&self.rx_data);
        let room = match self.tx_blocked {
            Some(len) => match self.tx.has_room(self.word(self.tx_ring, HEAD), len) {
                Ok(r) => r,
                Err(e) => {
                    ring::withdraw_sleep(self.word(self.rx_ring, SLEEP));
                    return Err(self.corrupt(e.0));
                }
            },
            None => false,
        };
        if has_data || room {
            ring::withdraw_sleep(self.word(self.rx_ring, SLEEP));
            return Ok(false);
        }
        Ok(true)
    }
}

impl Device for ShmDevice {
    fn max_frame_len(&self) -> usize {
        self.max_payload
    }

    fn send_frame(
        &mut self,
        len: usize,
        fill: &mut dyn FnMut(&mut FrameWriter<'_>),
    ) -> Result<bool, DeviceError> {
        self.check_failed()?;
        if len > self.max_payload {
            return Err(DeviceError::FrameTooLong { len, max: self.max_payload });
        }
        let slot = match self.tx.reserve(self.word(self.tx_ring, HEAD), len) {
            Ok(Some(s)) => s,
            Ok(None) => {
                self.tx_blocked = Some(len);
                return Ok(false);
            }
            Err(e) => return Err(self.corrupt(e.0)),
        };
        // SAFETY: the slot is inside the tx data area and reserved for us until commit.
        let mut w = unsafe { FrameWriter::from_raw(self.tx_data.base().add(slot.offset), len) };
        fill(&mut w);
        // Stamped before the commit store, so the peer's "found" stamp follows it.
        strait_probe::probe!(strait_probe::Stage::DevFilled);
        self.tx.commit(&self.tx_data, slot);
        self.tx_blocked = None;
        self.tx_dirty = true;
        self.stats.frames_sent += 1;
        Ok(true)
    }

    fn recv_frame(&mut self, handle: &mut dyn FnMut(&RxFrame<'_>)) -> Result<bool, DeviceError> {
        self.check_failed()?;
        let slot = match self.rx.peek(&self.rx_data) {
            Ok(Some(s)) => s,
            Ok(None) => {
                // Idle: the time to hand consumed space back (zeroing takes a cache
                // line per 64 bytes consumed, microseconds for a large message), off
                // the path of any message. Nothing else in this pass rings the peer,
                // so ring here if it sleeps waiting for room.
                if self.rx.unpublished() > 0 && self.rx.publish(self.word(self.rx_ring, HEAD), &self.rx_data)
                {
                    self.rx_freed = false;
                    self.ring_peer()?;
                }
                return Ok(false);
            }
            Err(e) => return Err(self.corrupt(e.0)),
        };
        strait_probe::probe!(strait_probe::Stage::RxFound);
        if self.rx.unpublished() >= self.publish_batch {
            // A long stream leaves no idle moment: hand back what earlier frames
            // freed before taking this one (the doorbell at the end of the pass rings).
            self.rx_freed |= self.rx.publish(self.word(self.rx_ring, HEAD), &self.rx_data);
        }
        // SAFETY: the validated slot lies inside the rx data area; the peer will not
        // reuse it before we release it (and if it does anyway, RxFrame only copies).
        let f = unsafe { RxFrame::from_raw(self.rx_data.base().add(slot.offset), slot.len) };
        handle(&f);
        self.rx.release(slot);
        self.stats.frames_received += 1;
        Ok(true)
    }

    fn doorbell(&mut self) -> Result<(), DeviceError> {
        if self.tx_dirty && self.rx.unpublished() <= SMALL_HAND_BACK {
            // Hand back a little consumed space now, behind our frames in store order,
            // so the cache-line transfers of zeroing never delay a frame. Larger
            // amounts wait for an idle `recv_frame`, for the batch threshold there
            // (in the middle of a long stream) or for `arm_sleep`: zeroing a whole
            // 128 KiB chunk before the completion is returned took microseconds.
            self.rx_freed |= self.rx.publish(self.word(self.rx_ring, HEAD), &self.rx_data);
        }
        if !(self.tx_dirty || self.rx_freed) {
            return Ok(());
        }
        self.tx_dirty = false;
        self.rx_freed = false;
        self.ring_peer()
    }

    fn arm_sleep(&mut self) -> Result<bool, DeviceError> {
        self.check_failed()?;
        // Everything consumed goes back before we sleep, and a peer waiting for that
        // room is woken.
        if self.rx.publish(self.word(self.rx_ring, HEAD), &self.rx_data) || self.tx_dirty || self.rx_freed {
            self.tx_dirty = false;
            self.rx_freed = false;
            self.ring_peer()?;
        }
        self.arm_sleep_announced()
    }

    fn disarm_sleep(&mut self) {
        ring::withdraw_sleep(self.word(self.rx_ring, SLEEP));
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.sock.as_raw_fd())
    }

    fn check_peer(&mut self) -> Result<(), DeviceError> {
        self.check_failed()?;
        if !self.peer_hung_up()? {
            return Ok(());
        }
        // Frames the peer published before it went away are still delivered.
        if self.rx.has_data(&self.rx_data) {
            return Ok(());
        }
        let why = "the peer closed the connection or exited";
        self.failed = Some(DeviceError::PeerGone(why.into()));
        Err(DeviceError::PeerGone(why.into()))
    }

    fn supports_remote_read(&self) -> bool {
        self.remote_read_ok
    }

    fn preferred_rndv(&self) -> RndvPath {
        // What the calibration chose, less what this peer refused since.
        if !self.remote_read_ok {
            RndvPath::Copy
        } else if self.preferred == RndvPath::Split && !self.remote_write_ok {
            RndvPath::RemoteRead
        } else {
            self.preferred
        }
    }

    fn supports_remote_write(&self) -> bool {
        self.remote_write_ok
    }

    fn peer_reaches_us(&self) -> bool {
        this_pid() == self.own_pid
    }

    fn split_now(&self) -> bool {
        // The peer's sleep flag sits in the control block of the ring it consumes.
        self.word(self.tx_ring, SLEEP).load(ring::Ordering::Relaxed) == 0 && self.peer_reaches_us()
    }

    unsafe fn remote_write(
        &mut self,
        remote_addr: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        let Some(pid) = self.peer_pid.filter(|_| self.remote_write_ok) else {
            return Err(DeviceError::Unsupported);
        };
        // A write into a reused pid would land in another process, so the peer must
        // be known alive before, not only after: its socket hangs up before its pid
        // is freed, and its pidfd polls readable once it exits.
        if self.peer_hung_up()? || self.pidfd.as_ref().is_some_and(sys::pidfd_exited) {
            return Err(DeviceError::PeerGone("the peer exited before a remote write".into()));
        }
        // SAFETY: the caller guarantees `src` for `len` bytes.
        let r = unsafe { sys::vm_write(pid, remote_addr, src, len) };
        cma_outcome(r, "process_vm_writev", &mut self.remote_write_ok, &mut self.stats.remote_writes)
    }

    unsafe fn remote_read(&mut self, remote_addr: u64, dst: *mut u8, len: usize) -> Result<(), DeviceError> {
        let Some(pid) = self.peer_pid.filter(|_| self.remote_read_ok) else {
            return Err(DeviceError::Unsupported);
        };
        // SAFETY: the caller guarantees `dst` for `len` bytes.
        let r = unsafe { sys::vm_read(pid, remote_addr, dst, len) };
        // A dead peer's pid could in principle be reused by another process before we
        // read; its socket hangs up before the pid is freed, and its pidfd polls
        // readable once it exits, so check both after reading.
        if self.peer_hung_up()? || self.pidfd.as_ref().is_some_and(sys::pidfd_exited) {
            return Err(DeviceError::PeerGone("the peer exited during a remote read".into()));
        }
        cma_outcome(r, "process_vm_readv", &mut self.remote_read_ok, &mut self.stats.remote_reads)
    }

    fn shutdown(&mut self) {
        if self.shut {
            return;
        }
        self.shut = true;
        self.word(self.tx_ring, CLOSED).store(1, ring::Ordering::Release);
        // SAFETY: plain syscall on our socket; the peer sees the hang-up.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
    }

    fn stats(&self) -> DeviceStats {
        self.stats
    }
}

/// This process's id without a system call per use (asked on every rendezvous
/// message): `strait_sys`'s cached id, forgotten in a forked child by a fork handler
/// registered at the first use. (A child made by a raw `clone`, which runs no fork
/// handlers, keeps its parent's id here.)
fn this_pid() -> libc::pid_t {
    static HANDLER: std::sync::Once = std::sync::Once::new();
    extern "C" fn forget_in_child() {
        strait_sys::forget_pid();
    }
    HANDLER.call_once(|| {
        // SAFETY: registers a child handler that only stores to an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(forget_in_child)) };
    });
    strait_sys::current_pid() as libc::pid_t
}

/// What a cross-memory-attach copy's result means for the engine: counted in `done`
/// if it worked; the peer gone if its process is (ESRCH); refused for good (EPERM:
/// no ptrace rights over the peer) by clearing `allowed`; else an I/O error of `op`.
fn cma_outcome(
    r: io::Result<()>,
    op: &'static str,
    allowed: &mut bool,
    done: &mut u64,
) -> Result<(), DeviceError> {
    match r {
        Ok(()) => {
            *done += 1;
            Ok(())
        }
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
            Err(DeviceError::PeerGone("the peer process no longer exists".into()))
        }
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            *allowed = false;
            Err(DeviceError::Unsupported)
        }
        Err(source) => Err(DeviceError::Io { op, source }),
    }
}

impl Drop for ShmDevice {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_bounds() {
        assert!(ShmConfig::default().validate().is_ok());
        assert!(ShmConfig { ring_bytes: 4096, ..Default::default() }.validate().is_err());
        assert!(ShmConfig { ring_bytes: (1 << 20) + 1, ..Default::default() }.validate().is_err());
        assert!(ShmConfig { ring_bytes: 3 << 20, ..Default::default() }.validate().is_err());
    }

    #[test]
    fn names_map_to_abstract_or_path_addresses() {
        let (sa, len) = sys::unix_addr("x").unwrap();
        assert_eq!(sa.sun_path[0], 0);
        assert_eq!(len as usize, 2 + 1 + "strait.shm.x".len());
        let (sa, _) = sys::unix_addr("/tmp/s").unwrap();
        assert_eq!(sa.sun_path[0] as u8, b'/');
        assert!(sys::unix_addr("").is_err());
        assert!(sys::unix_addr(&"n".repeat(200)).is_err());
    }
}
