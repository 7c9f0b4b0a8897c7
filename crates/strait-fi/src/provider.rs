//! The provider's state: a domain holds address vectors, completion queues and
//! endpoints behind one lock (so every libfabric threading level is served, up to
//! `FI_THREAD_SAFE`); an endpoint holds one outgoing connection per peer it sent
//! to and one incoming connection per peer that sent to it, and the matching state
//! across all of them.
//!
//! Connections are one-way: each side sends only on the connections it opened
//! (lazily, on its first send to a peer) and receives only on those it accepted.
//! Two endpoints that send to each other hold two connections, and no frame ever
//! flows back on a connection, so nothing has to be arbitrated when both open at
//! once, and a peer's frames reach the matcher in the order it sent them.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use strait_core::{Device, DeviceError, Notifier, ReliableConfig};
use strait_shm::{ShmConfig, ShmDevice, ShmListener};
use strait_udp::{UdpConfig, UdpLink};
use thiserror::Error;

use crate::matching::{fi, finished, Comp, InMsg, Matcher, Pull, Recv, Rndv, UserBuf};
use crate::proto::{
    self, First, Name, DATA, DATA_HDR, FIN, FIN_LEN, FIRST, FIRST_HDR, F_DATA, F_TAGGED, HELLO, HELLO_LEN,
    NAME_LEN, RTS, RTS_LEN,
};

/// Largest message sent in one operation by `fi_inject`.
pub const INJECT_SIZE: usize = 4096;

/// How often an idle endpoint asks its peers whether they still live.
const LIVENESS_INTERVAL: Duration = Duration::from_millis(50);

/// The provider's maps by its own u64 keys (fi_addr indices, endpoint ids): one
/// multiplication per look-up instead of SipHash, on the path of every message.
type IdMap<V> = strait_sys::IntMap<u64, V>;

/// Messages at least this long go by rendezvous on the shm device when the peer can
/// be read with `process_vm_readv`: one copy, by the receiver, straight from the
/// sender's buffer into the posted one.
const RNDV_MIN: usize = 64 << 10;

/// Frames taken from one connection per progress pass (then the next connection's
/// turn).
const RX_BUDGET: usize = 64;

/// Why an operation was refused at once (as a negative `FI_E*` to the caller).
#[derive(Debug, Error)]
pub enum FiError {
    /// A bad argument (unknown address, missing binding, bad length).
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    /// The endpoint is not enabled, or already enabled.
    #[error("endpoint state: {0}")]
    State(&'static str),
    /// Setting up the endpoint failed.
    #[error("setup failed: {0}")]
    Setup(String),
    /// Nothing to cancel.
    #[error("no such operation")]
    NotFound,
}

impl FiError {
    /// The (positive) `FI_E*` value.
    pub fn errno(&self) -> i32 {
        match self {
            FiError::Invalid(_) => fi::EINVAL,
            FiError::State(_) => fi::EOPBADSTATE,
            FiError::Setup(_) => fi::EIO,
            FiError::NotFound => fi::ENOENT,
        }
    }
}

/// A domain: the unit of locking.
#[derive(Default)]
pub struct Domain {
    state: Mutex<State>,
    /// When the application last drove progress (ns since `EPOCH`).
    last_progress: AtomicU64,
    /// Some connection uses the udp device (which must retransmit and acknowledge
    /// even while the application is busy elsewhere).
    lossy: Arc<AtomicBool>,
}

static EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

fn now_ns() -> u64 {
    EPOCH.elapsed().as_nanos() as u64
}

/// How long the application may leave a domain with udp connections without
/// progress before the domain's ticker thread drives it.
const TICK: Duration = Duration::from_millis(1);

/// Starts the thread that keeps a domain's lossy connections alive while the
/// application does not call in (it computes, or blocks in something else): it
/// ends with the domain.
pub fn start_ticker(dom: &Arc<Domain>) {
    let w = Arc::downgrade(dom);
    let _ = std::thread::Builder::new().name("strait-fi-tick".into()).spawn(move || loop {
        let lossy = match w.upgrade() {
            Some(d) => d.lossy.load(Ordering::Relaxed),
            None => return,
        };
        std::thread::sleep(if lossy { TICK } else { TICK * 20 });
        let Some(d) = w.upgrade() else { return };
        if lossy && now_ns().saturating_sub(d.last_progress.load(Ordering::Relaxed)) >= TICK.as_nanos() as u64
        {
            let mut st = d.lock();
            for ep in 0..st.eps.len() {
                progress(&mut st, ep);
            }
        }
    });
}

#[derive(Default)]
struct State {
    avs: Vec<Option<Av>>,
    cqs: Vec<Option<Cq>>,
    eps: Vec<Option<Ep>>,
}

fn slot<T>(v: &mut Vec<Option<T>>, x: T) -> usize {
    if let Some(i) = v.iter().position(Option::is_none) {
        v[i] = Some(x);
        i
    } else {
        v.push(Some(x));
        v.len() - 1
    }
}

/// An address vector: fi_addr_t values are indices (valid for `FI_AV_MAP` and
/// `FI_AV_TABLE` alike).
#[derive(Default)]
struct Av {
    names: Vec<Option<Name>>,
    by_id: IdMap<u64>,
}

impl Av {
    fn lookup_id(&self, id: u64) -> u64 {
        self.by_id.get(&id).copied().unwrap_or(u64::MAX)
    }
}

/// A completion queue.
#[derive(Default)]
struct Cq {
    ok: VecDeque<Comp>,
    err: VecDeque<Comp>,
    eps: Vec<usize>,
}

impl Cq {
    fn push(&mut self, c: Comp) {
        if c.err != 0 {
            self.err.push_back(c);
        } else {
            self.ok.push_back(c);
        }
    }
}

/// One message on its way out.
struct TxMsg {
    /// Application buffer (valid until completion), or a copy (inject).
    src: Src,
    len: usize,
    sent: usize,
    first_sent: bool,
    first: First,
    ctx: usize,
    report: bool,
    flags: u64,
}

enum Src {
    User(usize),
    Owned(Vec<u8>),
}

impl TxMsg {
    /// The bytes `[at, at + n)` of the message.
    fn bytes(&self, at: usize, n: usize) -> &[u8] {
        match &self.src {
            Src::Owned(v) => &v[at..at + n],
            // SAFETY: the application gave a buffer of `len` bytes, readable until
            // the send completes (libfabric's contract); `at + n <= len` (callers
            // never ask past `len`).
            Src::User(p) => unsafe { std::slice::from_raw_parts((*p as *const u8).add(at), n) },
        }
    }

    fn comp(&self, err: i32) -> Comp {
        let mut flags = fi::SEND | (self.flags & (fi::TAGGED | fi::MSG));
        if self.first.flags & F_DATA != 0 {
            flags |= fi::REMOTE_CQ_DATA;
        }
        Comp { ctx: self.ctx, flags, len: 0, buf: 0, data: 0, tag: 0, olen: 0, err, pad: 0 }
    }
}

type BoxDev = Box<dyn Device + Send>;

struct TxConn {
    dev: BoxDev,
    /// Rendezvous sends the receiver has not read yet, by sequence number.
    waiting: IdMap<TxMsg>,
    next_seq: u64,
    /// Large messages may go by rendezvous (shm, and the receiver said it can
    /// read this process: `process_vm_readv` permission need not be symmetric).
    rndv: bool,
    /// The receiver's answer arrived (or never will: udp).
    rndv_known: bool,
    /// The udp device: answers (acknowledgements) come back on it.
    lossy: bool,
    /// Our name, until the first frame (a HELLO) is out.
    hello: Option<[u8; NAME_LEN]>,
    queue: VecDeque<TxMsg>,
    failed: Option<i32>,
}

struct RxConn {
    dev: BoxDev,
    /// Unique within the endpoint (rendezvous messages name their connection).
    id: u64,
    /// FINs (sequence number, status) not sent yet.
    fins: VecDeque<(u64, u8)>,
    /// The udp device (acknowledges and retransmits on its own schedule).
    lossy: bool,
    /// The peer's name, from its HELLO.
    peer: Option<Name>,
    cur: Option<InMsg>,
    failed: bool,
}

struct Net {
    name: Name,
    notifier: Arc<Notifier>,
    /// Connections the acceptor thread finished (device, lossy), and how many.
    incoming: Arc<Mutex<Vec<(BoxDev, bool)>>>,
    pending: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
    shm_cfg: ShmConfig,
    udp: Option<UdpSetup>,
}

/// Settings of the udp device (peers on other hosts or namespaces).
#[derive(Clone)]
struct UdpSetup {
    udp: UdpConfig,
    rel: ReliableConfig,
}

/// The udp device's settings: `STRAIT_UDP_*` as everywhere, except that the
/// backend defaults to sendmmsg/recvmmsg: io_uring's completion work interrupts the
/// application's own blocking system calls (a libfabric program's `read` of its
/// control socket returned `EINTR`), which a library inside someone else's
/// program must not cause. `STRAIT_UDP_BACKEND=uring` still asks for it.
fn udp_config() -> Result<UdpConfig, FiError> {
    let mut c = UdpConfig::from_env().map_err(|e| FiError::Setup(e.to_string()))?;
    if std::env::var_os("STRAIT_UDP_BACKEND").is_none() {
        c.backend = strait_udp::Backend::Mmsg;
    }
    Ok(c)
}

/// Bootstrap exchanges an endpoint serves at once.
const MAX_BOOTSTRAPS: usize = 8;

/// How long a peer may take over the udp device's TCP bootstrap exchange.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(5);

/// The IPv4 address to advertise to peers elsewhere: `STRAIT_FI_IP`, else the
/// first address of an interface that is up and not loopback.
fn local_ip() -> Option<Ipv4Addr> {
    if let Ok(v) = std::env::var("STRAIT_FI_IP") {
        return v.trim().parse().ok();
    }
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifa` with a list we free below.
    if unsafe { libc::getifaddrs(&mut ifa) } != 0 {
        return None;
    }
    let mut found = None;
    let mut p = ifa;
    while !p.is_null() {
        // SAFETY: `p` walks the list getifaddrs returned, which lives until freeifaddrs.
        let a = unsafe { &*p };
        let up = a.ifa_flags & libc::IFF_UP as u32 != 0 && a.ifa_flags & libc::IFF_LOOPBACK as u32 == 0;
        // SAFETY: `ifa_addr` is null or points at a sockaddr of its family.
        if up && !a.ifa_addr.is_null() && i32::from(unsafe { (*a.ifa_addr).sa_family }) == libc::AF_INET {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*a.ifa_addr.cast::<libc::sockaddr_in>() };
            found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            break;
        }
        p = a.ifa_next;
    }
    // SAFETY: frees the list getifaddrs allocated, once.
    unsafe { libc::freeifaddrs(ifa) };
    found
}

/// The accepting half of the udp bootstrap: reads the connector's name and UDP
/// port, answers with a fresh UDP socket's port, and makes the device.
fn udp_accept(mut s: TcpStream, setup: &UdpSetup) -> Result<BoxDev, String> {
    s.set_read_timeout(Some(BOOTSTRAP_TIMEOUT)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(BOOTSTRAP_TIMEOUT)).map_err(|e| e.to_string())?;
    let mut b = [0u8; NAME_LEN + 2];
    s.read_exact(&mut b).map_err(|e| e.to_string())?;
    Name::decode(&b[..NAME_LEN]).map_err(|e| e.to_string())?;
    let port = u16::from_le_bytes([b[NAME_LEN], b[NAME_LEN + 1]]);
    let peer_ip = s.peer_addr().map_err(|e| e.to_string())?.ip();
    let local_ip = s.local_addr().map_err(|e| e.to_string())?.ip();
    let sock = UdpSocket::bind(SocketAddr::new(local_ip, 0)).map_err(|e| e.to_string())?;
    sock.connect(SocketAddr::new(peer_ip, port)).map_err(|e| e.to_string())?;
    let mine = sock.local_addr().map_err(|e| e.to_string())?.port();
    s.write_all(&mine.to_le_bytes()).map_err(|e| e.to_string())?;
    let link = UdpLink::from_socket(sock, &setup.udp).map_err(|e| e.to_string())?;
    Ok(Box::new(link.reliable(setup.rel.clone())))
}

/// The connecting half of the udp bootstrap.
fn udp_connect(me: &Name, peer: &Name, setup: &UdpSetup) -> Result<BoxDev, String> {
    if peer.ip.is_unspecified() || peer.port == 0 {
        return Err("the peer has no address for other hosts (see STRAIT_FI_IP)".into());
    }
    let to = SocketAddr::new(IpAddr::V4(peer.ip), peer.port);
    let mut s = TcpStream::connect_timeout(&to, BOOTSTRAP_TIMEOUT).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(BOOTSTRAP_TIMEOUT)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(BOOTSTRAP_TIMEOUT)).map_err(|e| e.to_string())?;
    let local_ip = s.local_addr().map_err(|e| e.to_string())?.ip();
    let sock = UdpSocket::bind(SocketAddr::new(local_ip, 0)).map_err(|e| e.to_string())?;
    let mut b = [0u8; NAME_LEN + 2];
    b[..NAME_LEN].copy_from_slice(&me.encode());
    b[NAME_LEN..].copy_from_slice(&sock.local_addr().map_err(|e| e.to_string())?.port().to_le_bytes());
    s.write_all(&b).map_err(|e| e.to_string())?;
    let mut p = [0u8; 2];
    s.read_exact(&mut p).map_err(|e| e.to_string())?;
    sock.connect(SocketAddr::new(IpAddr::V4(peer.ip), u16::from_le_bytes(p))).map_err(|e| e.to_string())?;
    let link = UdpLink::from_socket(sock, &setup.udp).map_err(|e| e.to_string())?;
    Ok(Box::new(link.reliable(setup.rel.clone())))
}

impl Drop for Net {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

/// An endpoint.
#[derive(Default)]
struct Ep {
    directed: bool,
    av: Option<usize>,
    tx_cq: Option<usize>,
    rx_cq: Option<usize>,
    tx_selective: bool,
    rx_selective: bool,
    net: Option<Net>,
    tx: IdMap<TxConn>,
    rx: Vec<RxConn>,
    m: Matcher,
    out: Vec<Comp>,
    next_conn: u64,
    last_liveness: Option<Instant>,
    idle_passes: u32,
}

/// Endpoint `ep` of `eps`, if it exists and is enabled.
fn enabled_ep(eps: &mut [Option<Ep>], ep: usize) -> Result<&mut Ep, FiError> {
    let Some(Some(e)) = eps.get_mut(ep) else { return Err(FiError::Invalid("endpoint")) };
    if e.net.is_none() {
        return Err(FiError::State("endpoint not enabled"));
    }
    Ok(e)
}

/// Reads this host's boot id.
fn boot_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let hex: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
        for (i, pair) in hex.chunks(2).take(16).enumerate() {
            let v = std::str::from_utf8(pair).ok().and_then(|p| u8::from_str_radix(p, 16).ok());
            id[i] = v.unwrap_or(0);
        }
    }
    id
}

fn netns_inode() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()).unwrap_or(0)
}

fn random_u64() -> u64 {
    let mut v = 0u64;
    // SAFETY: writes at most 8 bytes into a local u64.
    let r = unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, 0) };
    if r != 8 {
        // No entropy syscall: pid and time still make a collision unlikely.
        let t =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64);
        v = (std::process::id() as u64) << 40 ^ t.unwrap_or(0);
    }
    v
}

/// Says why, on stderr, when `STRAIT_FI_DEBUG` is set.
fn debug(what: &str, why: &dyn std::fmt::Display) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("STRAIT_FI_DEBUG").is_some()) {
        eprintln!("strait-fi[{}]: {what}: {why}", std::process::id());
    }
}

fn dev_errno(e: &DeviceError) -> i32 {
    debug("device", e);
    match e {
        DeviceError::PeerGone(_) => fi::ECONNRESET,
        DeviceError::Corrupt(_) => fi::EPROTO,
        _ => fi::EIO,
    }
}

impl Domain {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The application drove progress now (noted only where the ticker looks).
    fn touched(&self) {
        if self.lossy.load(Ordering::Relaxed) {
            self.last_progress.store(now_ns(), Ordering::Relaxed);
        }
    }

    /// Opens an address vector.
    pub fn av_open(&self) -> usize {
        slot(&mut self.lock().avs, Av::default())
    }

    /// Closes an address vector.
    pub fn av_close(&self, av: usize) {
        if let Some(s) = self.lock().avs.get_mut(av) {
            *s = None;
        }
    }

    /// Inserts names; returns, per name, its fi_addr or `None` if it is not a
    /// strait name.
    pub fn av_insert(&self, av: usize, names: &[u8]) -> Vec<Option<u64>> {
        let mut st = self.lock();
        let Some(Some(a)) = st.avs.get_mut(av) else { return vec![None; names.len() / NAME_LEN] };
        names
            .chunks_exact(NAME_LEN)
            .map(|b| {
                let n = Name::decode(b).ok()?;
                let i = a.names.len() as u64;
                a.names.push(Some(n));
                a.by_id.entry(n.id).or_insert(i);
                Some(i)
            })
            .collect()
    }

    /// Removes addresses.
    pub fn av_remove(&self, av: usize, addrs: &[u64]) -> Result<(), FiError> {
        let mut st = self.lock();
        let Some(Some(a)) = st.avs.get_mut(av) else { return Err(FiError::Invalid("address vector")) };
        for &x in addrs {
            if let Some(Some(n)) = a.names.get(x as usize).copied() {
                a.names[x as usize] = None;
                if a.by_id.get(&n.id) == Some(&x) {
                    a.by_id.remove(&n.id);
                }
            } else {
                return Err(FiError::Invalid("fi_addr not in the address vector"));
            }
        }
        Ok(())
    }

    /// The name behind an fi_addr.
    pub fn av_lookup(&self, av: usize, addr: u64) -> Option<[u8; NAME_LEN]> {
        let st = self.lock();
        let a = st.avs.get(av)?.as_ref()?;
        a.names.get(usize::try_from(addr).ok()?)?.map(|n| n.encode())
    }

    /// Opens a completion queue.
    pub fn cq_open(&self) -> usize {
        slot(&mut self.lock().cqs, Cq::default())
    }

    /// Closes a completion queue; refused while an endpoint is bound to it.
    pub fn cq_close(&self, cq: usize) -> Result<(), FiError> {
        let mut st = self.lock();
        let bound = st.eps.iter().flatten().any(|e| e.tx_cq == Some(cq) || e.rx_cq == Some(cq));
        if bound {
            return Err(FiError::State("an endpoint is still bound to the completion queue"));
        }
        if let Some(s) = st.cqs.get_mut(cq) {
            *s = None;
        }
        Ok(())
    }

    /// Drives every endpoint bound to `cq`, then takes up to `max` completions.
    /// `Err(true)`: nothing, but errors wait; `Err(false)`: nothing.
    pub fn cq_read(&self, cq: usize, max: usize, sink: &mut dyn FnMut(usize, Comp)) -> Result<usize, bool> {
        self.touched();
        let mut st = self.lock();
        let st = &mut *st;
        let n = match st.cqs.get(cq) {
            Some(Some(q)) => q.eps.len(),
            _ => return Err(false),
        };
        for i in 0..n {
            let Some(Some(q)) = st.cqs.get(cq) else { return Err(false) };
            let Some(&e) = q.eps.get(i) else { break };
            progress(st, e);
        }
        let Some(Some(q)) = st.cqs.get_mut(cq) else { return Err(false) };
        let mut k = 0;
        while k < max {
            match q.ok.pop_front() {
                Some(c) => sink(k, c),
                None => break,
            }
            k += 1;
        }
        if k > 0 {
            Ok(k)
        } else {
            Err(!q.err.is_empty())
        }
    }

    /// Takes one error completion.
    pub fn cq_readerr(&self, cq: usize) -> Option<Comp> {
        let mut st = self.lock();
        st.cqs.get_mut(cq)?.as_mut()?.err.pop_front()
    }

    /// Opens an endpoint; without `directed` (`FI_DIRECTED_RECV`) receives ignore
    /// their source address.
    pub fn ep_open(&self, directed: bool) -> usize {
        slot(&mut self.lock().eps, Ep { directed, ..Ep::default() })
    }

    /// Closes an endpoint: tells its peers (orderly shutdown of its connections).
    pub fn ep_close(&self, ep: usize) {
        let mut st = self.lock();
        let Some(s) = st.eps.get_mut(ep) else { return };
        if let Some(mut e) = s.take() {
            // Whatever is still queued goes out if the peer takes it soon.
            let deadline = Instant::now() + Duration::from_millis(500);
            while e.tx.values().any(|c| (!c.queue.is_empty() || c.hello.is_some()) && c.failed.is_none())
                && Instant::now() < deadline
            {
                for c in e.tx.values_mut().filter(|c| c.failed.is_none()) {
                    let mut sink = Vec::new();
                    if c.dev.recv_frame(&mut |_| {}).is_err() {
                        c.failed = Some(fi::ECONNRESET);
                        continue;
                    }
                    pump_tx(c, &mut sink);
                }
                std::thread::yield_now();
            }
            for c in e.tx.values_mut() {
                c.dev.shutdown();
            }
            for c in e.rx.iter_mut() {
                c.dev.shutdown();
            }
            // A lossy device delivers what it accepted (retransmitting) for a while.
            let mut devs: Vec<&mut BoxDev> =
                e.tx.values_mut().map(|c| &mut c.dev).chain(e.rx.iter_mut().map(|c| &mut c.dev)).collect();
            while !devs.is_empty() && Instant::now() < deadline + Duration::from_millis(500) {
                devs.retain_mut(|d| d.drain());
                if !devs.is_empty() {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
        for q in st.cqs.iter_mut().flatten() {
            q.eps.retain(|&x| x != ep);
        }
    }

    /// Binds a completion queue (`FI_TRANSMIT`, `FI_RECV`, `FI_SELECTIVE_COMPLETION`).
    pub fn ep_bind_cq(&self, ep: usize, cq: usize, flags: u64) -> Result<(), FiError> {
        const TRANSMIT: u64 = fi::SEND;
        const RECV: u64 = fi::RECV;
        const SELECTIVE: u64 = 1 << 59;
        let mut st = self.lock();
        if !matches!(st.cqs.get(cq), Some(Some(_))) {
            return Err(FiError::Invalid("completion queue"));
        }
        let Some(Some(e)) = st.eps.get_mut(ep) else { return Err(FiError::Invalid("endpoint")) };
        if e.net.is_some() {
            return Err(FiError::State("endpoint already enabled"));
        }
        if flags & (TRANSMIT | RECV) == 0 {
            return Err(FiError::Invalid("bind a CQ with FI_TRANSMIT and/or FI_RECV"));
        }
        if flags & TRANSMIT != 0 {
            e.tx_cq = Some(cq);
            e.tx_selective = flags & SELECTIVE != 0;
        }
        if flags & RECV != 0 {
            e.rx_cq = Some(cq);
            e.rx_selective = flags & SELECTIVE != 0;
        }
        if let Some(Some(q)) = st.cqs.get_mut(cq) {
            if !q.eps.contains(&ep) {
                q.eps.push(ep);
            }
        }
        Ok(())
    }

    /// Binds the address vector.
    pub fn ep_bind_av(&self, ep: usize, av: usize) -> Result<(), FiError> {
        let mut st = self.lock();
        if !matches!(st.avs.get(av), Some(Some(_))) {
            return Err(FiError::Invalid("address vector"));
        }
        let Some(Some(e)) = st.eps.get_mut(ep) else { return Err(FiError::Invalid("endpoint")) };
        e.av = Some(av);
        Ok(())
    }

    /// Enables the endpoint: binds its shm listener and starts accepting.
    pub fn ep_enable(&self, ep: usize) -> Result<(), FiError> {
        let mut st = self.lock();
        let Some(Some(e)) = st.eps.get_mut(ep) else { return Err(FiError::Invalid("endpoint")) };
        if e.net.is_some() {
            return Ok(());
        }
        if e.av.is_none() || e.tx_cq.is_none() || e.rx_cq.is_none() {
            return Err(FiError::State("bind an address vector and transmit and receive CQs first"));
        }
        let shm_cfg = ShmConfig::from_env().map_err(|e| FiError::Setup(e.to_string()))?;
        let mut name = Name {
            boot_id: boot_id(),
            netns: netns_inode(),
            id: random_u64(),
            ip: Ipv4Addr::UNSPECIFIED,
            port: 0,
        };
        let listener =
            ShmListener::bind_with(&name.shm_name(), &shm_cfg).map_err(|e| FiError::Setup(e.to_string()))?;
        // Peers on other hosts (or namespaces) reach us over the udp device, set up
        // through a TCP bootstrap port; without an address only this host can.
        let setup = UdpSetup {
            udp: udp_config()?,
            rel: ReliableConfig::from_env().map_err(|e| FiError::Setup(e.to_string()))?,
        };
        let mut boot = None;
        if let Some(ip) = local_ip() {
            if let Ok(l) = TcpListener::bind(SocketAddr::new(IpAddr::V4(ip), 0)) {
                if let (Ok(a), Ok(())) = (l.local_addr(), l.set_nonblocking(true)) {
                    name.ip = ip;
                    name.port = a.port();
                    boot = Some(l);
                }
            }
        }
        let notifier = Arc::new(Notifier::new().map_err(|e| FiError::Setup(e.to_string()))?);
        let incoming = Arc::new(Mutex::new(Vec::new()));
        let pending = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        // Handshakes are served by a thread of their own, so that two endpoints that
        // connect to each other at once (each inside a send) never wait on each other.
        let acceptor = {
            let (notifier, incoming, stop) = (notifier.clone(), incoming.clone(), stop.clone());
            let pending = pending.clone();
            let lossy = self.lossy.clone();
            let setup = setup.clone();
            std::thread::Builder::new()
                .name("strait-fi-accept".into())
                .spawn(move || {
                    let push = move |d: BoxDev, lossy: bool| {
                        incoming.lock().unwrap_or_else(|e| e.into_inner()).push((d, lossy));
                        pending.fetch_add(1, Ordering::Release);
                    };
                    let bootstraps = Arc::new(AtomicUsize::new(0));
                    while !stop.load(Ordering::Acquire) {
                        match listener.accept_timeout(&notifier, Some(Duration::from_millis(20))) {
                            Ok(Some(d)) => push(Box::new(d), false),
                            Ok(None) => {}
                            Err(_) => std::thread::sleep(Duration::from_millis(10)),
                        }
                        let Some(l) = &boot else { continue };
                        while let Ok((s, _)) = l.accept() {
                            // Each bootstrap on a thread of its own (a silent connector
                            // holds only that one, for BOOTSTRAP_TIMEOUT), at most
                            // MAX_BOOTSTRAPS at once: beyond, connections are closed.
                            if bootstraps.load(Ordering::Acquire) >= MAX_BOOTSTRAPS {
                                continue;
                            }
                            bootstraps.fetch_add(1, Ordering::AcqRel);
                            let (setup, lossy, push, n) =
                                (setup.clone(), lossy.clone(), push.clone(), bootstraps.clone());
                            let spawned =
                                std::thread::Builder::new().name("strait-fi-boot".into()).spawn(move || {
                                    // A failed bootstrap costs the connector its connection only.
                                    if let Ok(d) = udp_accept(s, &setup) {
                                        lossy.store(true, Ordering::Relaxed);
                                        push(d, true);
                                    }
                                    n.fetch_sub(1, Ordering::AcqRel);
                                });
                            if spawned.is_err() {
                                bootstraps.fetch_sub(1, Ordering::AcqRel);
                            }
                        }
                    }
                })
                .map_err(|e| FiError::Setup(e.to_string()))?
        };
        e.net = Some(Net {
            name,
            notifier,
            incoming,
            pending,
            stop,
            acceptor: Some(acceptor),
            shm_cfg,
            udp: Some(setup),
        });
        Ok(())
    }

    /// The endpoint's name.
    pub fn ep_getname(&self, ep: usize) -> Result<[u8; NAME_LEN], FiError> {
        let st = self.lock();
        let Some(Some(e)) = st.eps.get(ep) else { return Err(FiError::Invalid("endpoint")) };
        let net = e.net.as_ref().ok_or(FiError::State("endpoint not enabled"))?;
        Ok(net.name.encode())
    }

    /// Posts a send of `len` bytes at `buf` (copied now when `FI_INJECT`).
    #[allow(clippy::too_many_arguments)]
    pub fn ep_send(
        &self,
        ep: usize,
        buf: usize,
        len: usize,
        dest: u64,
        tag: u64,
        data: u64,
        flags: u64,
        ctx: usize,
    ) -> Result<(), FiError> {
        let mut st = self.lock();
        let st = &mut *st;
        let e = enabled_ep(&mut st.eps, ep)?;
        if len as u64 > proto::MAX_MSG {
            return Err(FiError::Invalid("message too long"));
        }
        if len > 0 && buf == 0 {
            return Err(FiError::Invalid("null buffer"));
        }
        let inject = flags & fi::INJECT != 0;
        if inject && len > INJECT_SIZE {
            return Err(FiError::Invalid("inject larger than inject_size"));
        }
        let Some(av) = e.av.and_then(|a| st.avs.get(a)).and_then(Option::as_ref) else {
            return Err(FiError::State("no address vector"));
        };
        let Some(peer) = av.names.get(dest as usize).copied().flatten() else {
            return Err(FiError::Invalid("destination not in the address vector"));
        };
        let tagged = flags & fi::TAGGED != 0;
        let mut mflags = if tagged { F_TAGGED } else { 0 };
        if flags & fi::REMOTE_CQ_DATA != 0 {
            mflags |= F_DATA;
        }
        // An inject is sent from the application's buffer if it goes out now, and
        // copied below only if it has to wait.
        let src = Src::User(buf);
        let report = !inject && (!e.tx_selective || flags & fi::COMPLETION != 0);
        let msg = TxMsg {
            src,
            len,
            sent: 0,
            first_sent: false,
            first: First {
                flags: mflags,
                tag,
                data: if mflags & F_DATA != 0 { data } else { 0 },
                total: len as u64,
            },
            ctx,
            report,
            flags: flags & (fi::TAGGED | fi::MSG),
        };
        if !e.tx.contains_key(&dest) {
            match connect(e, &peer) {
                Ok(c) => {
                    if !e.net.as_ref().is_some_and(|n| n.name.same_host(&peer)) {
                        self.lossy.store(true, Ordering::Relaxed);
                    }
                    e.tx.insert(dest, c);
                }
                Err(_) => {
                    // An unreachable peer: the send fails through the CQ.
                    let c = msg.comp(fi::EHOSTUNREACH);
                    if let Some(Some(q)) = e.tx_cq.and_then(|q| st.cqs.get_mut(q)) {
                        q.push(c);
                    }
                    return Ok(());
                }
            }
        }
        let Some(conn) = e.tx.get_mut(&dest) else { return Err(FiError::Invalid("destination")) };
        if let Some(err) = conn.failed {
            if let Some(Some(q)) = e.tx_cq.and_then(|q| st.cqs.get_mut(q)) {
                q.push(msg.comp(err));
            }
            return Ok(());
        }
        conn.queue.push_back(msg);
        let mut done = Vec::new();
        pump_tx(conn, &mut done);
        // Messages leave in order: if any is still queued, the last, ours, is.
        if inject {
            if let Some(m) = conn.queue.back_mut() {
                // SAFETY: the application's buffer of `len` bytes is readable for the
                // duration of this call; the copy keeps the message after it.
                m.src = Src::Owned(unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec());
            }
        }
        if let Some(Some(q)) = e.tx_cq.and_then(|q| st.cqs.get_mut(q)) {
            for c in done {
                q.push(c);
            }
        }
        Ok(())
    }

    /// Posts a receive (or a peek/claim, by `flags`).
    #[allow(clippy::too_many_arguments)]
    pub fn ep_recv(
        &self,
        ep: usize,
        buf: usize,
        len: usize,
        src: u64,
        tag: u64,
        ignore: u64,
        flags: u64,
        ctx: usize,
    ) -> Result<(), FiError> {
        let mut st = self.lock();
        let st = &mut *st;
        let e = enabled_ep(&mut st.eps, ep)?;
        if len > 0 && buf == 0 && flags & fi::PEEK == 0 {
            return Err(FiError::Invalid("null buffer"));
        }
        let src = if e.directed { src } else { fi::ADDR_UNSPEC };
        if src != fi::ADDR_UNSPEC {
            let known =
                e.av.and_then(|a| st.avs.get(a))
                    .and_then(Option::as_ref)
                    .is_some_and(|a| a.names.get(src as usize).is_some_and(Option::is_some));
            if !known {
                return Err(FiError::Invalid("source not in the address vector"));
            }
        }
        let tagged = flags & fi::TAGGED != 0;
        let r = Recv {
            buf: UserBuf { ptr: buf, cap: if buf == 0 { 0 } else { len } },
            src,
            tag: if tagged { tag } else { 0 },
            ignore: if tagged { ignore } else { 0 },
            tagged,
            ctx,
            report: !e.rx_selective || flags & fi::COMPLETION != 0,
        };
        let mut out = std::mem::take(&mut e.out);
        if flags & fi::PEEK != 0 {
            // Bring in what has arrived, so a probe sees it.
            drop(out);
            progress(st, ep);
            let Some(Some(e)) = st.eps.get_mut(ep) else { return Err(FiError::Invalid("endpoint")) };
            out = std::mem::take(&mut e.out);
            e.m.peek(r, flags & fi::CLAIM != 0, flags & fi::DISCARD != 0, &mut out);
        } else if flags & fi::CLAIM != 0 {
            if !e.m.claim(r, flags & fi::DISCARD != 0, &mut out) {
                e.out = out;
                return Err(FiError::Invalid("FI_CLAIM without a claimed message for this context"));
            }
        } else {
            e.m.post(r, &mut out);
        }
        let Some(Some(e)) = st.eps.get_mut(ep) else { return Err(FiError::Invalid("endpoint")) };
        // A rendezvous message it matched (or discarded) is read (answered) now.
        run_pulls(e, &mut out);
        if let Some(Some(q)) = e.rx_cq.and_then(|q| st.cqs.get_mut(q)) {
            for c in out.drain(..) {
                q.push(c);
            }
        }
        e.out = out;
        Ok(())
    }

    /// Cancels a posted receive.
    pub fn ep_cancel(&self, ep: usize, ctx: usize) -> Result<(), FiError> {
        let mut st = self.lock();
        let st = &mut *st;
        let Some(Some(e)) = st.eps.get_mut(ep) else { return Err(FiError::Invalid("endpoint")) };
        let mut out = Vec::new();
        if !e.m.cancel(ctx, &mut out) {
            return Err(FiError::NotFound);
        }
        if let Some(Some(q)) = e.rx_cq.and_then(|q| st.cqs.get_mut(q)) {
            for c in out {
                q.push(c);
            }
        }
        Ok(())
    }
}

/// Opens a connection to `peer` and queues the HELLO that names us.
/// Opens a connection to `peer`: the shm device on this host and network
/// namespace, the udp device otherwise. Its first frame will be a HELLO naming us.
fn connect(e: &mut Ep, peer: &Name) -> Result<TxConn, FiError> {
    let net = e.net.as_ref().ok_or(FiError::State("endpoint not enabled"))?;
    let lossy = !net.name.same_host(peer);
    let dev: BoxDev = if !lossy {
        let d = ShmDevice::connect(&peer.shm_name(), &net.shm_cfg, &net.notifier)
            .map_err(|e| FiError::Setup(e.to_string()))?;
        Box::new(d)
    } else {
        let setup = net.udp.as_ref().ok_or(FiError::Setup("no udp device".into()))?;
        udp_connect(&net.name, peer, setup).map_err(FiError::Setup)?
    };
    Ok(TxConn {
        dev,
        // Until the receiver says it can read us, messages are copied.
        rndv: false,
        rndv_known: lossy,
        waiting: IdMap::default(),
        next_seq: 0,
        lossy,
        hello: Some(net.name.encode()),
        queue: VecDeque::new(),
        failed: None,
    })
}

/// `STRAIT_FI_RNDV=0` turns the single-copy rendezvous off (every message is
/// copied through the ring).
fn rndv_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRAIT_FI_RNDV").map_or(true, |v| v.trim() != "0"))
}

/// The sequence number of the FIN a receiver sends first: status 0 if it can read
/// the sender's memory (rendezvous allowed), 1 if not.
const CAN_READ: u64 = u64::MAX;

/// Reads the FINs the receiver sent back for rendezvous messages.
fn take_fins(c: &mut TxConn, done: &mut Vec<Comp>) {
    for _ in 0..RX_BUDGET {
        let mut fin: Option<(u64, u8)> = None;
        let mut bad = false;
        let r = c.dev.recv_frame(&mut |f| {
            let mut b = [0u8; FIN_LEN];
            if f.len() == FIN_LEN && f.read(0, &mut b) && b[0] == FIN {
                let mut q = [0u8; 8];
                q.copy_from_slice(&b[8..16]);
                fin = Some((u64::from_le_bytes(q), b[1]));
            } else {
                bad = true;
            }
        });
        match r {
            Ok(true) => {}
            Ok(false) => return,
            Err(err) => {
                fail_tx(c, dev_errno(&err), done);
                return;
            }
        }
        if let Some((CAN_READ, st)) = fin {
            c.rndv = st == 0 && c.dev.supports_remote_read();
            c.rndv_known = true;
            continue;
        }
        match fin.and_then(|(seq, st)| c.waiting.remove(&seq).map(|m| (m, st))) {
            Some((m, 0)) if m.report => done.push(m.comp(0)),
            Some((_, 0)) => {}
            Some((m, _)) => done.push(m.comp(fi::EIO)),
            None if bad || fin.is_some() => {
                debug("protocol violation", &"a FIN that answers nothing");
                fail_tx(c, fi::EPROTO, done);
                return;
            }
            None => {}
        }
    }
}

/// Reads the rendezvous messages matched since the last call, straight into their
/// receive buffers, and queues the FIN that releases each sender's buffer.
fn run_pulls(e: &mut Ep, out: &mut Vec<Comp>) {
    if !e.m.has_pulls() {
        return;
    }
    for Pull { recv, first, rndv } in e.m.take_pulls() {
        let Some(c) = e.rx.iter_mut().find(|c| c.id == rndv.conn && !c.failed) else {
            if let Some(r) = recv {
                out.push(Comp { olen: 0, len: 0, err: fi::ECONNRESET, ..finished(&first, &r, first.total) });
            }
            continue;
        };
        let mut status = 0u8;
        if let Some(r) = recv {
            let n = (first.total as usize).min(r.buf.cap);
            let res = if n == 0 {
                Ok(())
            } else {
                // SAFETY: the application posted `r.buf` as writable for `cap` bytes
                // until the receive completes; `n <= cap`. The source is the peer's
                // memory, read by the kernel from the process SO_PEERCRED named.
                unsafe { c.dev.remote_read(rndv.addr, r.buf.ptr as *mut u8, n) }
            };
            match res {
                Ok(()) => {
                    let comp = finished(&first, &r, first.total);
                    if r.report || comp.err != 0 {
                        out.push(comp);
                    }
                }
                Err(err) => {
                    debug("rendezvous read", &err);
                    status = 1;
                    out.push(Comp { olen: 0, len: 0, err: fi::EIO, ..finished(&first, &r, first.total) });
                }
            }
        }
        c.fins.push_back((rndv.seq, status));
        push_fins(c);
    }
}

/// Sends queued FINs (back on a connection we receive on).
fn push_fins(c: &mut RxConn) {
    let mut sent = false;
    while let Some(&(seq, status)) = c.fins.front() {
        let r = c.dev.send_frame(FIN_LEN, &mut |w| {
            w.write(0, &[FIN, status, 0, 0, 0, 0, 0, 0]);
            w.write(8, &seq.to_le_bytes());
        });
        match r {
            Ok(true) => {
                c.fins.pop_front();
                sent = true;
            }
            _ => break,
        }
    }
    if sent {
        let _ = c.dev.doorbell();
    }
}

/// Writes as many frames of the queued messages as the connection takes;
/// completions of finished sends go to `done`.
fn pump_tx(c: &mut TxConn, done: &mut Vec<Comp>) -> usize {
    if c.failed.is_some() {
        return 0;
    }
    let max = c.dev.max_frame_len();
    let mut frames = 0;
    if let Some(hello) = c.hello {
        let r = c.dev.send_frame(HELLO_LEN, &mut |w| {
            w.write(0, &[HELLO, 0, 0, 0, 0, 0, 0, 0]);
            w.write(8, &hello);
        });
        match r {
            Ok(true) => {
                c.hello = None;
                frames += 1;
            }
            // Not set up yet (the udp device's handshake), or no room.
            Ok(false) => return 0,
            Err(err) => {
                fail_tx(c, dev_errno(&err), done);
                return 0;
            }
        }
    }
    while let Some(m) = c.queue.front_mut() {
        if !m.first_sent && c.rndv && m.len >= RNDV_MIN && matches!(m.src, Src::User(_)) {
            let Src::User(addr) = m.src else { break };
            let seq = c.next_seq;
            let hdr = m.first.encode();
            let r = c.dev.send_frame(RTS_LEN, &mut |w| {
                let mut h = hdr;
                h[0] = RTS;
                w.write(0, &h);
                w.write(FIRST_HDR, &(addr as u64).to_le_bytes());
                w.write(FIRST_HDR + 8, &seq.to_le_bytes());
            });
            match r {
                Ok(true) => {
                    frames += 1;
                    c.next_seq += 1;
                    if let Some(m) = c.queue.pop_front() {
                        c.waiting.insert(seq, m);
                    }
                    continue;
                }
                Ok(false) => break,
                Err(err) => {
                    fail_tx(c, dev_errno(&err), done);
                    return frames;
                }
            }
        }
        let res = if !m.first_sent {
            let n = m.len.min(max - FIRST_HDR);
            let hdr = m.first.encode();
            let r = c.dev.send_frame(FIRST_HDR + n, &mut |w| {
                w.write(0, &hdr);
                w.write(FIRST_HDR, m.bytes(0, n));
            });
            if matches!(r, Ok(true)) {
                m.first_sent = true;
                m.sent = n;
            }
            r
        } else {
            let n = (m.len - m.sent).min(max - DATA_HDR);
            let at = m.sent;
            let r = c.dev.send_frame(DATA_HDR + n, &mut |w| {
                w.write(0, &[DATA, 0, 0, 0, 0, 0, 0, 0]);
                w.write(DATA_HDR, m.bytes(at, n));
            });
            if matches!(r, Ok(true)) {
                m.sent += n;
            }
            r
        };
        match res {
            Ok(true) => {
                frames += 1;
                if m.sent == m.len {
                    if m.report {
                        done.push(m.comp(0));
                    }
                    c.queue.pop_front();
                }
            }
            Ok(false) => break,
            Err(err) => {
                fail_tx(c, dev_errno(&err), done);
                return frames;
            }
        }
    }
    if frames > 0 {
        if let Err(err) = c.dev.doorbell() {
            fail_tx(c, dev_errno(&err), done);
        }
    }
    frames
}

fn fail_tx(c: &mut TxConn, err: i32, done: &mut Vec<Comp>) {
    c.failed = Some(err);
    for (_, m) in c.waiting.drain() {
        done.push(m.comp(err));
    }
    for m in c.queue.drain(..) {
        done.push(m.comp(err));
    }
}

/// One progress pass over an endpoint: accepts connections, sends what is queued,
/// receives and matches what arrived, checks liveness now and then.
fn progress(st: &mut State, ep: usize) {
    let State { avs, cqs, eps } = st;
    let Some(Some(e)) = eps.get_mut(ep) else { return };
    let Some(net) = e.net.as_ref() else { return };
    if net.pending.load(Ordering::Acquire) > 0 {
        let mut inc = net.incoming.lock().unwrap_or_else(|e| e.into_inner());
        net.pending.store(0, Ordering::Release);
        for (dev, lossy) in inc.drain(..) {
            e.next_conn += 1;
            let id = e.next_conn;
            // Tell the sender whether we can read its memory (its rendezvous needs it).
            let mut fins = VecDeque::new();
            if !lossy {
                fins.push_back((CAN_READ, u8::from(!dev.supports_remote_read() || !rndv_enabled())));
            }
            e.rx.push(RxConn { dev, id, fins, lossy, peer: None, cur: None, failed: false });
        }
    }
    let av = e.av.and_then(|a| avs.get(a)).and_then(Option::as_ref);
    // Sends.
    let mut tx_done = Vec::new();
    for c in e.tx.values_mut() {
        if c.failed.is_some() {
            continue;
        }
        if !c.lossy {
            // The shm device needs no pass of its own on a connection we only send
            // on, except to hear that rendezvous messages were read.
            if !c.waiting.is_empty() || !c.rndv_known {
                take_fins(c, &mut tx_done);
            }
            if !c.queue.is_empty() || c.hello.is_some() {
                pump_tx(c, &mut tx_done);
            }
            continue;
        }
        // Nothing comes back on a connection we opened, except what the device
        // itself exchanges (the udp device's handshake and acknowledgements); a
        // frame is a protocol violation.
        let mut stray = false;
        match c.dev.recv_frame(&mut |_| stray = true) {
            Err(err) => fail_tx(c, dev_errno(&err), &mut tx_done),
            Ok(_) if stray => fail_tx(c, fi::EPROTO, &mut tx_done),
            // What the device queued in answer (acknowledgements, a handshake) goes out.
            Ok(_) => {
                if let Err(err) = c.dev.doorbell() {
                    fail_tx(c, dev_errno(&err), &mut tx_done);
                }
            }
        }
        if !c.queue.is_empty() || c.hello.is_some() {
            pump_tx(c, &mut tx_done);
        }
    }
    // Receives.
    let mut out = std::mem::take(&mut e.out);
    let mut work = 0;
    let mut gone = Vec::new();
    for c in e.rx.iter_mut().filter(|c| !c.failed) {
        let mut violation: Option<&'static str> = None;
        let mut got = 0;
        for _ in 0..RX_BUDGET {
            let RxConn { dev, peer, cur, id, .. } = c;
            let id = *id;
            let m = &mut e.m;
            let o = &mut out;
            let r = dev.recv_frame(&mut |f| {
                if violation.is_none() {
                    if let Err(v) = on_frame(f, id, peer, cur, m, av, o) {
                        violation = Some(v);
                    }
                }
            });
            match r {
                Ok(true) => got += 1,
                Ok(false) => break,
                Err(err) => {
                    gone.push((c.peer, dev_errno(&err)));
                    c.failed = true;
                    if let Some(m) = c.cur.take() {
                        e.m.abort(&m, dev_errno(&err), &mut out);
                    }
                    break;
                }
            }
            if violation.is_some() {
                break;
            }
        }
        work += got;
        // Acknowledgements the device queued while receiving go out now (the shm
        // device hands consumed ring space back).
        if !c.failed && (c.lossy || got > 0) {
            if let Err(err) = c.dev.doorbell() {
                gone.push((c.peer, dev_errno(&err)));
                c.failed = true;
                if let Some(m) = c.cur.take() {
                    e.m.abort(&m, dev_errno(&err), &mut out);
                }
            }
        }
        if let Some(why) = violation {
            debug("protocol violation", &why);
            // A peer that breaks the protocol loses its connection.
            c.failed = true;
            c.dev.shutdown();
            if let Some(m) = c.cur.take() {
                e.m.abort(&m, fi::EPROTO, &mut out);
            }
            gone.push((c.peer, fi::EPROTO));
        }
    }
    run_pulls(e, &mut out);
    for c in e.rx.iter_mut().filter(|c| !c.fins.is_empty() && !c.failed) {
        push_fins(c);
    }
    // Liveness: a peer that died without a word is found here.
    if work == 0 {
        e.idle_passes = e.idle_passes.wrapping_add(1);
    }
    let check = work == 0 && e.idle_passes % 256 == 0 && {
        let now = Instant::now();
        let due = e.last_liveness.is_none_or(|t| now.duration_since(t) >= LIVENESS_INTERVAL);
        if due {
            e.last_liveness = Some(now);
        }
        due
    };
    if check {
        for c in e.rx.iter_mut().filter(|c| !c.failed) {
            if let Err(err) = c.dev.check_peer() {
                // Frames it wrote before it went are still taken on the next pass;
                // here only what can no longer complete fails.
                if c.cur.is_none() {
                    c.failed = true;
                    gone.push((c.peer, dev_errno(&err)));
                }
            }
        }
        for c in e.tx.values_mut() {
            if c.failed.is_none() {
                if let Err(err) = c.dev.check_peer() {
                    fail_tx(c, dev_errno(&err), &mut tx_done);
                }
            }
        }
    }
    for (peer, err) in gone {
        if let (Some(p), Some(a)) = (peer, av) {
            let src = a.lookup_id(p.id);
            if src != u64::MAX {
                e.m.fail_source(src, err, &mut out);
            }
        }
    }
    if e.rx.iter().any(|c| c.failed && c.cur.is_none()) {
        e.rx.retain(|c| !c.failed || c.cur.is_some());
    }
    if let Some(Some(q)) = e.rx_cq.and_then(|q| cqs.get_mut(q)) {
        for c in out.drain(..) {
            q.push(c);
        }
    }
    e.out = out;
    if let Some(Some(q)) = e.tx_cq.and_then(|q| cqs.get_mut(q)) {
        for c in tx_done {
            q.push(c);
        }
    }
}

/// Handles one frame from a peer; an `Err` is a protocol violation.
#[allow(clippy::too_many_arguments)]
fn on_frame(
    f: &strait_core::RxFrame<'_>,
    conn: u64,
    peer: &mut Option<Name>,
    cur: &mut Option<InMsg>,
    m: &mut Matcher,
    av: Option<&Av>,
    out: &mut Vec<Comp>,
) -> Result<(), &'static str> {
    let mut kind = [0u8; 1];
    if !f.read(0, &mut kind) {
        return Err("empty frame");
    }
    match kind[0] {
        HELLO => {
            if peer.is_some() || f.len() != HELLO_LEN {
                return Err("unexpected or malformed hello");
            }
            let mut b = [0u8; NAME_LEN];
            if !f.read(8, &mut b) {
                return Err("short hello");
            }
            *peer = Some(Name::decode(&b).map_err(|_| "hello without a valid name")?);
        }
        FIRST => {
            let Some(p) = peer else { return Err("message before hello") };
            if cur.is_some() {
                return Err("new message before the last one ended");
            }
            if f.len() < FIRST_HDR {
                return Err("short first frame");
            }
            let mut h = [0u8; FIRST_HDR];
            if !f.read(0, &mut h) {
                return Err("short first frame");
            }
            let first = First::decode(&h, f.len()).map_err(|_| "bad message header")?;
            let src = av.map_or(u64::MAX, |a| a.lookup_id(p.id));
            let mut im = m.arrive(src, first);
            let n = f.len() - FIRST_HDR;
            if !m.deliver(&mut im, f, FIRST_HDR, n) {
                return Err("frame shorter than its payload");
            }
            if im.got == first.total {
                m.finish(&im, out);
            } else {
                *cur = Some(im);
            }
        }
        RTS => {
            let Some(p) = peer else { return Err("message before hello") };
            if cur.is_some() {
                return Err("new message before the last one ended");
            }
            let mut h = [0u8; RTS_LEN];
            if f.len() != RTS_LEN || !f.read(0, &mut h) {
                return Err("malformed rendezvous frame");
            }
            let mut hdr = [0u8; FIRST_HDR];
            hdr.copy_from_slice(&h[..FIRST_HDR]);
            // The whole message is announced, none of it carried.
            let first = First::decode(&hdr, FIRST_HDR).map_err(|_| "bad message header")?;
            let u = |i: usize| {
                let mut a = [0u8; 8];
                a.copy_from_slice(&h[i..i + 8]);
                u64::from_le_bytes(a)
            };
            let src = av.map_or(u64::MAX, |a| a.lookup_id(p.id));
            m.arrive_rndv(src, first, Rndv { conn, addr: u(FIRST_HDR), seq: u(FIRST_HDR + 8) });
        }
        DATA => {
            let Some(im) = cur.as_mut() else { return Err("data frame outside a message") };
            if f.len() < DATA_HDR {
                return Err("short data frame");
            }
            let n = f.len() - DATA_HDR;
            if n as u64 > im.first.total - im.got {
                return Err("data past the end of the message");
            }
            if !m.deliver(im, f, DATA_HDR, n) {
                return Err("frame shorter than its payload");
            }
            if im.got == im.first.total {
                let done = *im;
                *cur = None;
                m.finish(&done, out);
            }
        }
        _ => return Err("unknown frame kind"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matching::Recv;
    use strait_core::RxFrame;

    fn name(id: u64) -> Name {
        Name { boot_id: [1; 16], netns: 2, id, ip: Ipv4Addr::UNSPECIFIED, port: 0 }
    }

    fn hello(id: u64) -> Vec<u8> {
        let mut f = vec![HELLO, 0, 0, 0, 0, 0, 0, 0];
        f.extend_from_slice(&name(id).encode());
        f
    }

    fn first(tag: u64, total: u64, payload: &[u8]) -> Vec<u8> {
        let mut f = First { flags: F_TAGGED, tag, data: 0, total }.encode().to_vec();
        f.extend_from_slice(payload);
        f
    }

    struct Conn {
        peer: Option<Name>,
        cur: Option<InMsg>,
    }

    fn feed(c: &mut Conn, m: &mut Matcher, out: &mut Vec<Comp>, frame: &[u8]) -> Result<(), &'static str> {
        // SAFETY: `frame` is a live slice of its length.
        let f = unsafe { RxFrame::from_raw(frame.as_ptr(), frame.len()) };
        on_frame(&f, 1, &mut c.peer, &mut c.cur, m, None, out)
    }

    #[test]
    fn protocol_violations_are_refused() {
        let (mut m, mut out) = (Matcher::default(), Vec::new());
        let mut c = Conn { peer: None, cur: None };
        assert!(feed(&mut c, &mut m, &mut out, &first(1, 3, b"abc")).is_err(), "message before hello");
        assert!(feed(&mut c, &mut m, &mut out, &[]).is_err());
        assert!(feed(&mut c, &mut m, &mut out, &hello(5)).is_ok());
        assert!(feed(&mut c, &mut m, &mut out, &hello(5)).is_err(), "second hello");
        assert!(feed(&mut c, &mut m, &mut out, &first(1, 2, b"abc")).is_err(), "payload past total");
        assert!(feed(&mut c, &mut m, &mut out, &first(1, proto::MAX_MSG + 1, b"")).is_err(), "too long");
        assert!(feed(&mut c, &mut m, &mut out, &[DATA, 0, 0, 0, 0, 0, 0, 0, 1]).is_err(), "data outside");
        assert!(feed(&mut c, &mut m, &mut out, &first(1, 10, b"abc")).is_ok());
        assert!(feed(&mut c, &mut m, &mut out, &first(1, 10, b"abc")).is_err(), "new message mid-message");
        let mut d = vec![DATA, 0, 0, 0, 0, 0, 0, 0];
        d.extend_from_slice(&[7; 8]);
        assert!(feed(&mut c, &mut m, &mut out, &d).is_err(), "data past the end");
        assert!(feed(&mut c, &mut m, &mut out, &[9, 0, 0]).is_err(), "unknown kind");
        let mut c = Conn { peer: None, cur: None };
        assert!(feed(&mut c, &mut m, &mut out, &hello(6)).is_ok());
        let mut rts = first(1, 1 << 20, b"");
        rts[0] = RTS;
        assert!(feed(&mut c, &mut m, &mut out, &rts).is_err(), "short rendezvous frame");
        rts.extend_from_slice(&[0; 16]);
        assert!(feed(&mut c, &mut m, &mut out, &rts).is_ok());
        rts[24..32].copy_from_slice(&(proto::MAX_MSG + 1).to_le_bytes());
        assert!(feed(&mut c, &mut m, &mut out, &rts).is_err(), "rendezvous too long");
    }

    /// Random frames from a hostile peer: never a panic, never a byte outside the
    /// posted buffer (guard bytes around it stay intact).
    #[test]
    fn random_frames_never_write_outside_the_posted_buffer() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut mem = vec![0xeeu8; 64 + 100 + 64];
        for round in 0..2000 {
            let (mut m, mut out) = (Matcher::default(), Vec::new());
            let mut c = Conn { peer: None, cur: None };
            let ptr = mem[64..].as_mut_ptr() as usize;
            let r = Recv {
                buf: UserBuf { ptr, cap: 100 },
                src: fi::ADDR_UNSPEC,
                tag: 0,
                ignore: u64::MAX,
                tagged: true,
                ctx: 1,
                report: true,
            };
            m.post(r, &mut out);
            if round % 2 == 0 {
                let _ = feed(&mut c, &mut m, &mut out, &hello(3));
            }
            for _ in 0..20 {
                let len = (rnd() % 300) as usize;
                let mut f: Vec<u8> = (0..len).map(|_| rnd() as u8).collect();
                if !f.is_empty() {
                    f[0] = [HELLO, FIRST, DATA, 0][(rnd() % 4) as usize];
                }
                if f.len() >= FIRST_HDR && f[0] == FIRST && rnd() % 2 == 0 {
                    // Plausible headers too, to get past the first checks.
                    let total = (f.len() - FIRST_HDR) as u64 + rnd() % 400;
                    f[1] = F_TAGGED;
                    f[24..32].copy_from_slice(&total.to_le_bytes());
                }
                if feed(&mut c, &mut m, &mut out, &f).is_err() {
                    break;
                }
            }
            assert!(mem[..64].iter().all(|&b| b == 0xee), "guard before the buffer written (round {round})");
            assert!(mem[164..].iter().all(|&b| b == 0xee), "guard after the buffer written (round {round})");
        }
    }
}
