//! TCP connections to other hosts, carried by strait's reliable udp device when the
//! peer host is listed in `STRAIT_PEERS` and its end runs under strait too.
//!
//! Discovery costs an unlisted peer nothing, and a listed peer without strait one
//! datagram (answered at once by its kernel's ICMP port-unreachable):
//! * `listen()` (only while `STRAIT_PEERS` is set) also binds a UDP socket to the
//!   listener's own address and port number: the marker that this port runs strait.
//!   Nobody answers on it; its only job is not to be closed.
//! * `connect()` to a listed address that is not this host's does the real TCP
//!   connect first (non-blocking inside: the kernel picks the port `p`, and may reuse
//!   one in TIME_WAIT towards another destination, which a `bind` could not), then
//!   binds a UDP socket to the same port number `p` (its bridge socket, where the
//!   offer will come) and sends from it a HELLO to the listener's address and port
//!   (a port without strait's marker answers with an ICMP error, which the socket
//!   reports through `IP_RECVERR` and which ends the attempt at once); a blocking
//!   socket then waits for its connect. (A socket the program bound itself sends its
//!   HELLO before the SYN.)
//! * Whichever process `accept()`s the connection (the listener's, or a worker forked
//!   from it) makes the connection's own UDP socket and sends the connector an OFFER
//!   {nonce, both TCP ports} at the connector's address and port `p`, repeated every
//!   20 ms until it hears back. Until the HELLO is there (it may come after the
//!   accept) it sends a PROBE instead, and lets one ICMP error pass: the connector
//!   may not have bound `p` yet.
//! * The connector (its background thread, or its first use of the socket) checks
//!   the offer against its TCP connection and answers on the TCP connection with 16
//!   bytes: GO and the nonce, the only bytes strait ever writes there, and only to a
//!   peer that has just proved it runs strait; or NO if its side could not be set up.
//!   No offer within `STRAIT_ATTACH_TIMEOUT_MS`, or the ICMP error: kernel, and it
//!   writes nothing.
//! * The acceptor reads the answer with `MSG_PEEK` first, so that bytes of a peer that
//!   is not strait are never consumed; it waits twice as long as the connector may
//!   take, so the two never disagree. Any other bytes, or none in time: kernel.
//!
//! Data path: the program's side is an ordinary strait connection (byte rings in a
//! memfd, see `conn.rs`); a [`Bridge`] plays the peer's side of those rings and moves
//! bytes between them and a `Reliable<UdpLink>` to the other host, with credit flow
//! control (a sender never has more bytes outstanding than the receiver's ring
//! holds, so an arrival always has room). The bridge runs inline in whichever thread
//! of the program uses the connection (a write is on the wire before `send`
//! returns; a waiting reader sleeps on the UDP socket itself), and in one background
//! thread per process for timers and for connections nobody is using.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use libc::{c_int, sockaddr, socklen_t};
use strait_core::{Device, Link, PacketAuth, PacketKey, Reliable, ReliableConfig};
use strait_udp::{Backend, UdpConfig, UdpLink};
use strait_wire::auth::TAG_LEN;
use strait_xdp::{Mac, XdpChannel, XdpConfig, XdpPort};

use crate::conn::{
    ctl, Bells, Carriers, Conn, FarEnd, FarSetup, Liveness, Shm, ATTACHED, HDR, HEAD, KERNEL, RCLOSED,
    RSLEEP, TAIL, WCLOSED, WSLEEP,
};
use crate::listening::Marker;
use crate::real;
use crate::settings::Settings;
use crate::sock::{close_all, key_of, ring_eventfd, sock_key, Key};
use strait_shm::stream::pieces;

const MSG_MAGIC: u64 = 0x3230_5652_5454_5253; // "SRTTRV02"
/// Bytes of a discovery datagram: 48 of fields, then a 16-byte tag (zero without a
/// secret).
const MSG_LEN: usize = 64;
/// Bytes of a discovery datagram or an answer that the tag covers.
const SIGNED_LEN: usize = 48;
const KIND_HELLO: u8 = 1;
const KIND_OFFER: u8 = 2;
/// The acceptor has no HELLO for this connection yet: sent only to draw the ICMP
/// error of a connector that is not strait. Ignored by connectors.
const KIND_PROBE: u8 = 3;
/// The acceptor will not carry this connection (the HELLO's authentication does
/// not match its own: a secret on one end only, or different secrets).
const KIND_REFUSE: u8 = 4;
const GO: u64 = 0x4f47_5449_4152_5453; // "STRAITGO"
const NO: u64 = 0x4f4e_5449_4152_5453; // "STRAITNO"
const GX: u64 = 0x5847_5449_4152_5453; // "STRAITGX": go, over the xdp device
/// Bytes of the connector's answer on the TCP connection: word, the acceptor's
/// nonce, (for GX) its MAC and channel id, the connector's nonce, and the tag (zero
/// without a secret).
const ANSWER_LEN: usize = 64;
/// Domain separation of the tags of discovery datagrams and answers.
const TAG_DISCOVERY: &[u8] = b"strait discovery v2";
const TAG_ANSWER: &[u8] = b"strait answer v2";
/// How often a connector repeats its HELLO, and an acceptor its OFFER, while they
/// wait for an answer.
const REPEAT: Duration = Duration::from_millis(20);
/// Bridge frame kinds (the first byte of every frame on the reliable device).
const F_DATA: u8 = 0;
const F_CREDIT: u8 = 1;
const F_SHUT: u8 = 2;
const F_RESET: u8 = 3;
/// End of stream and end of reading at once (the program closed the socket).
const F_CLOSE: u8 = 4;

// ------------------------------------------------------------------ STRAIT_PEERS

/// The hosts named by `STRAIT_PEERS`: addresses or subnets (`10.0.0.2`,
/// `10.0.0.0/24`, `fd00::/64`), separated by commas or spaces. IPv4 entries are kept
/// as v4-mapped IPv6 networks.
struct Peers {
    nets: Vec<([u8; 16], u32)>,
}

fn parse_peers(text: &str) -> Result<Vec<([u8; 16], u32)>, String> {
    let mut nets = Vec::new();
    for item in text.split(|c: char| c == ',' || c.is_whitespace()).filter(|s| !s.is_empty()) {
        let (addr, bits) = match item.split_once('/') {
            Some((a, b)) => (a, Some(b.parse::<u32>().map_err(|_| format!("{item:?}: bad prefix length"))?)),
            None => (item, None),
        };
        let ip: std::net::IpAddr = addr.parse().map_err(|_| format!("{item:?}: not an IP address"))?;
        let (octets, max, base) = match ip {
            std::net::IpAddr::V4(v4) => (v4.to_ipv6_mapped().octets(), 32, 96),
            std::net::IpAddr::V6(v6) => (v6.octets(), 128, 0),
        };
        let b = bits.unwrap_or(max);
        if b > max {
            return Err(format!("{item:?}: prefix longer than the address"));
        }
        nets.push((octets, base + b));
    }
    Ok(nets)
}

fn in_net(a: &[u8; 16], net: &[u8; 16], bits: u32) -> bool {
    let whole = (bits / 8) as usize;
    if a[..whole] != net[..whole] {
        return false;
    }
    let rest = bits % 8;
    rest == 0 || (a[whole] ^ net[whole]) & (0xffu8 << (8 - rest)) == 0
}

fn peers() -> &'static Peers {
    static P: OnceLock<Peers> = OnceLock::new();
    P.get_or_init(|| {
        let text = std::env::var("STRAIT_PEERS").unwrap_or_default();
        match parse_peers(&text) {
            Ok(nets) => Peers { nets },
            Err(e) => {
                eprintln!("strait: STRAIT_PEERS ignored: {e}");
                Peers { nets: Vec::new() }
            }
        }
    })
}

/// `STRAIT_PEERS_SECRET_FILE`: the shared secret, if one was asked for.
enum Secret {
    /// No secret: discovery and data are not authenticated (nonces only).
    Off,
    /// The secret's root key and the key of discovery datagrams and answers.
    On { root: Box<PacketKey>, discovery: Box<PacketKey> },
    /// A secret was asked for and cannot be used: no connection to another host is
    /// carried by strait (never silently without the secret).
    Broken,
}

static SECRET: OnceLock<Secret> = OnceLock::new();

thread_local! {
    /// This thread is reading the secret file: the library's own `open`, `read` and
    /// `close` come back through the interposed calls, which must not wait for the
    /// secret they are reading.
    static LOADING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The secret; `None` only inside its own loading (see [`LOADING`]).
fn try_secret() -> Option<&'static Secret> {
    if let Some(s) = SECRET.get() {
        return Some(s);
    }
    if LOADING.with(|l| l.replace(true)) {
        return None;
    }
    let s = SECRET.get_or_init(load_secret);
    LOADING.with(|l| l.set(false));
    Some(s)
}

/// The secret, once [`enabled`] said yes (it is loaded then); `Off` otherwise.
fn secret() -> &'static Secret {
    try_secret().unwrap_or(&Secret::Off)
}

fn load_secret() -> Secret {
    match strait_core::secret_from_env() {
        Ok(None) => Secret::Off,
        Ok(Some(root)) => {
            let discovery = root.derive(b"discovery", &[]);
            Secret::On { root: Box::new(root), discovery: Box::new(discovery) }
        }
        Err(e) => {
            eprintln!("strait: {e}; connections to other hosts stay on the kernel");
            Secret::Broken
        }
    }
}

/// The key of discovery datagrams and answers, with a secret.
fn discovery_key() -> Option<&'static PacketKey> {
    match secret() {
        Secret::On { discovery, .. } => Some(discovery),
        _ => None,
    }
}

/// True if a peer's message is authenticated as ours are: both without a secret,
/// or both with this one.
fn auth_matches(a: Auth) -> bool {
    match secret() {
        Secret::On { .. } => a == Auth::Good,
        _ => a == Auth::Plain,
    }
}

/// The data keys of one connection (per direction) under the secret: derived
/// from both nonces and both ports, so no two connections share one and nothing
/// recorded from an earlier connection passes on a new one.
fn data_auth(cnonce: u64, anonce: u64, ports: (u16, u16), connector: bool) -> Option<PacketAuth> {
    let Secret::On { root, .. } = secret() else { return None };
    let (c, a, cp, lp) =
        (cnonce.to_le_bytes(), anonce.to_le_bytes(), ports.0.to_le_bytes(), ports.1.to_le_bytes());
    let ctx: [&[u8]; 4] = [&c, &a, &cp, &lp];
    let to_acceptor = root.derive(b"data connector to acceptor", &ctx);
    let to_connector = root.derive(b"data acceptor to connector", &ctx);
    Some(if connector {
        PacketAuth { tx: to_acceptor, rx: to_connector }
    } else {
        PacketAuth { tx: to_connector, rx: to_acceptor }
    })
}

/// True if connections to other hosts may be carried by strait at all.
pub fn enabled() -> bool {
    Settings::get().enabled
        && !peers().nets.is_empty()
        && try_secret().is_some_and(|s| !matches!(s, Secret::Broken))
}

/// True if `a` is on a host named by `STRAIT_PEERS`.
pub fn listed(a: &[u8; 16]) -> bool {
    peers().nets.iter().any(|(n, b)| in_net(a, n, *b))
}

// ------------------------------------------------------------------ messages

/// A discovery datagram: kind, nonce (the sender's own: the connector's in a HELLO,
/// the acceptor's in an OFFER), echo (in an OFFER or a REFUSE: the connector's
/// nonce from its HELLO), the connector's and the listener's TCP ports, and (in an
/// offer) the acceptor's xdp port: its MAC and the channel id reserved for this
/// connection. With a secret (`key`), the tag over all of it.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 8 | magic "SRTTRV02" |
/// | 8 | 1 | kind |
/// | 9 | 1 | 1: xdp fields present |
/// | 10 | 1 | 1: tagged (a secret) |
/// | 16 | 8 | nonce |
/// | 24 | 2 + 2 | connector's, listener's TCP port |
/// | 28 | 6 | xdp MAC |
/// | 36 | 4 | xdp channel id |
/// | 40 | 8 | echo |
/// | 48 | 16 | HMAC-SHA256 tag of bytes 0..48, truncated (zero without a secret) |
#[allow(clippy::too_many_arguments)]
fn message(
    kind: u8,
    nonce: u64,
    echo: u64,
    connector_port: u16,
    listener_port: u16,
    xdp: Option<(Mac, u32)>,
    key: Option<&PacketKey>,
) -> [u8; MSG_LEN] {
    let mut m = [0u8; MSG_LEN];
    m[0..8].copy_from_slice(&MSG_MAGIC.to_le_bytes());
    m[8] = kind;
    m[16..24].copy_from_slice(&nonce.to_le_bytes());
    m[24..26].copy_from_slice(&connector_port.to_le_bytes());
    m[26..28].copy_from_slice(&listener_port.to_le_bytes());
    if let Some((mac, id)) = xdp {
        m[9] = 1;
        m[28..34].copy_from_slice(&mac.0);
        m[36..40].copy_from_slice(&id.to_le_bytes());
    }
    m[40..48].copy_from_slice(&echo.to_le_bytes());
    if let Some(k) = key {
        m[10] = 1;
        let tag = k.tag(&[TAG_DISCOVERY, &m[..SIGNED_LEN]]);
        m[SIGNED_LEN..].copy_from_slice(&tag[..TAG_LEN]);
    }
    m
}

/// How a received message or answer is authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Auth {
    /// No tag.
    Plain,
    /// A tag that checks under our key.
    Good,
    /// A tag we cannot check (no secret here) or that does not check.
    Bad,
}

fn auth_of(tagged: bool, domain: &[u8], signed: &[u8], tag: &[u8]) -> Auth {
    match (tagged, discovery_key()) {
        (false, _) => Auth::Plain,
        (true, Some(k)) if k.verify(&[domain, signed], tag) => Auth::Good,
        (true, _) => Auth::Bad,
    }
}

/// A parsed discovery datagram.
#[derive(Debug, PartialEq, Eq)]
struct Message {
    kind: u8,
    nonce: u64,
    echo: u64,
    ports: (u16, u16),
    xdp: Option<(Mac, u32)>,
    auth: Auth,
}

fn parse_message(m: &[u8]) -> Option<Message> {
    if m.len() != MSG_LEN || m[0..8] != MSG_MAGIC.to_le_bytes() {
        return None;
    }
    let nonce = u64::from_le_bytes(m[16..24].try_into().ok()?);
    let cport = u16::from_le_bytes(m[24..26].try_into().ok()?);
    let lport = u16::from_le_bytes(m[26..28].try_into().ok()?);
    let id = u32::from_le_bytes(m[36..40].try_into().ok()?);
    let mac: [u8; 6] = m[28..34].try_into().ok()?;
    let echo = u64::from_le_bytes(m[40..48].try_into().ok()?);
    let xdp = (m[9] == 1 && id != 0).then_some((Mac(mac), id));
    let auth = auth_of(m[10] != 0, TAG_DISCOVERY, &m[..SIGNED_LEN], &m[SIGNED_LEN..]);
    Some(Message { kind: m[8], nonce, echo, ports: (cport, lport), xdp, auth })
}

/// 64 bits from the kernel's random pool (`getrandom`); `None` if it has none (then
/// no connection is carried: a guessable nonce would let an off-path host take it).
fn random_u64() -> Option<u64> {
    strait_sys::random_u64()
}

/// An address as the 16 bytes of a key (IPv4 v4-mapped).
fn ip16(a: &SocketAddr) -> [u8; 16] {
    match a {
        SocketAddr::V4(v4) => v4.ip().to_ipv6_mapped().octets(),
        SocketAddr::V6(v6) => v6.ip().octets(),
    }
}

/// The socket address of a key (v4-mapped keys as IPv4).
fn addr_of(k: &Key) -> SocketAddr {
    let v6 = std::net::Ipv6Addr::from(k.0);
    match v6.to_ipv4_mapped() {
        Some(v4) => SocketAddr::new(v4.into(), k.1),
        None => SocketAddr::new(v6.into(), k.1),
    }
}

/// A non-blocking, close-on-exec UDP socket made with the real `socket` (so the
/// library never takes it for one of the program's).
fn udp_socket(v6: bool) -> Option<UdpSocket> {
    let family = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    // SAFETY: plain syscall.
    let fd = unsafe { real::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor we own alone.
    Some(unsafe { UdpSocket::from_raw_fd(fd) })
}

/// A memfd of one connection's rings, sealed, with the header initialised, and the
/// program's mapping of it.
fn new_rings() -> Option<(c_int, Shm)> {
    let ring = Settings::get().ring;
    // Sealed like a local connection's, so a program this one execs can check what
    // it is handed.
    let memfd = strait_sys::sealed_memfd(c"strait-tcp-remote", HDR + 2 * ring).ok()?.into_raw_fd();
    let Some(shm) = Shm::map(memfd, ring) else {
        close_all(&[memfd]);
        return None;
    };
    shm.init_header();
    Some((memfd, shm))
}

fn eventfd() -> c_int {
    // SAFETY: plain syscall.
    unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) }
}

// ------------------------------------------------------------------ pending state

/// What both ends of a connection to another host share until they agreed.
pub struct Pending {
    /// Our own copy of the TCP socket (the program may close or reuse its number).
    tcp: c_int,
    /// The connection's own UDP socket: the connector's is bound to its TCP port
    /// number (the offer comes there); the acceptor's is connected to it.
    udp: UdpSocket,
    /// The acceptor's nonce (the connector learns it from the offer).
    nonce: u64,
    /// The connector's nonce (the acceptor learns it from the HELLO; an offer must
    /// echo it).
    cnonce: u64,
    /// The connector's and the listener's TCP ports.
    ports: (u16, u16),
    started: Instant,
    memfd: c_int,
    bridge_unix: c_int,
    role: Role,
    /// Our xdp port and the channel id reserved on it for this connection, if both
    /// ends may use the xdp device (the acceptor reserves when it offers; the
    /// connector when it takes an offer that has one).
    xdp_local: Option<(Arc<XdpPort>, u32)>,
    /// The peer's xdp MAC and channel id, once known.
    xdp_peer: Option<(Mac, u32)>,
}

enum Role {
    Connector {
        /// The listener's address and port: its marker gets the HELLO, sent from
        /// the bridge socket (which reports an ICMP error for it until the offer
        /// came: `IP_RECVERR`).
        target: SocketAddr,
        hello: [u8; MSG_LEN],
        sent: Instant,
        /// The acceptor's address, once its offer came.
        offered: Option<SocketAddr>,
    },
    Acceptor {
        /// The listener's marker, where the connector's HELLO arrives.
        marker: Arc<Marker>,
        /// The connector's address (a HELLO must come from it).
        peer: [u8; 16],
        /// The offer, once the HELLO came (until then a PROBE is repeated).
        offer: Option<[u8; MSG_LEN]>,
        sent: Instant,
        /// A PROBE went out before the HELLO came: the first ICMP error may be its
        /// answer from a connector that had not bound its port yet (it binds it
        /// right after its connect, and we may accept and probe first).
        probed: bool,
        /// That one ICMP error came and was let pass.
        forgiven: bool,
    },
}

impl Pending {
    /// Our xdp port's MAC and the channel id reserved for this connection, if any.
    fn xdp_mine(&self) -> Option<(Mac, u32)> {
        self.xdp_local.as_ref().map(|(port, id)| (port.local_mac(), *id))
    }
}

/// Tells the connector at the other end of `udp` that we will not carry its
/// connection (its HELLO is authenticated otherwise than we are).
fn refuse(udp: &UdpSocket, cnonce: u64, ports: (u16, u16)) {
    crate::conn::REMOTE_REFUSED.fetch_add(1, Ordering::Relaxed);
    let m = message(KIND_REFUSE, 0, cnonce, ports.0, ports.1, None, discovery_key());
    // (A waiting ICMP error, for a PROBE that came before the connector bound its
    // port, fails the first send and is gone then.)
    if udp.send(&m).is_err() {
        let _ = udp.send(&m);
    }
}

/// A HELLO a marker received: from whom, for which ports, its nonce and
/// authentication, and when.
struct Hello {
    from: [u8; 16],
    ports: (u16, u16),
    cnonce: u64,
    auth: Auth,
    at: Instant,
}

/// HELLOs this process read from its markers and no connection took yet (a marker
/// is read by whichever pending connection of its listener looks first).
static HELLOS: Mutex<Vec<Hello>> = Mutex::new(Vec::new());
/// At most this many HELLOs are kept (the oldest go first).
const MAX_HELLOS: usize = 1024;

/// Reads every HELLO waiting at `marker`, then takes the latest one from `from` for
/// `ports`, if any: its nonce and authentication.
fn take_hello(marker: &Marker, from: &[u8; 16], ports: (u16, u16)) -> Option<(u64, Auth)> {
    let mut hellos = HELLOS.lock().unwrap_or_else(|e| e.into_inner());
    let now = Instant::now();
    let keep = Settings::get().attach_timeout * (ACCEPTOR_WAIT_FACTOR + 1);
    hellos.retain(|h| now.duration_since(h.at) < keep);
    let mut buf = [0u8; MSG_LEN + 1];
    while let Ok((n, src)) = marker.udp.recv_from(&mut buf) {
        let Some(m) = parse_message(&buf[..n]).filter(|m| m.kind == KIND_HELLO) else { continue };
        let src = ip16(&src);
        // A repeat replaces the one before (a connector's nonce never changes; a
        // forger's HELLO can only make the acceptor echo a nonce the connector
        // ignores).
        hellos.retain(|h| !(h.from == src && h.ports == m.ports));
        if hellos.len() >= MAX_HELLOS {
            hellos.remove(0);
        }
        hellos.push(Hello { from: src, ports: m.ports, cnonce: m.nonce, auth: m.auth, at: now });
    }
    let i = hellos.iter().rposition(|h| h.from == *from && h.ports == ports)?;
    let h = hellos.remove(i);
    Some((h.cnonce, h.auth))
}

impl Drop for Pending {
    fn drop(&mut self) {
        close_all(&[self.tcp, self.memfd, self.bridge_unix]);
    }
}

/// Where a pending connection stands after one look.
enum Step {
    /// Not decided: sleep on this descriptor for these events, and on the second
    /// one, if any, for input (then look again).
    Wait(c_int, i16, Option<c_int>),
    /// Decided: strait carries it (true) or the kernel does.
    Done(bool),
}

/// The acceptor waits longer for the confirmation than the connector may take to
/// send it (the connector's clock starts first), so they never disagree.
const ACCEPTOR_WAIT_FACTOR: u32 = 2;

/// A program-side connection over fresh rings, with the bridge's eventfd and a
/// socketpair whose other end the bridge keeps. Returns (conn, memfd, bridge end).
fn new_conn(side: usize, nonblock: bool) -> Option<(Arc<Conn>, c_int, c_int)> {
    let efd = eventfd();
    let bg = background().efd;
    let peer_efd = crate::fds::dup_high(bg);
    let mut sp = [-1; 2];
    // SAFETY: a local array of two descriptors.
    let paired = unsafe {
        libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0, sp.as_mut_ptr())
    } == 0;
    let rings = new_rings();
    if efd < 0 || peer_efd < 0 || !paired || rings.is_none() {
        close_all(&[efd, peer_efd, sp[0], sp[1]].into_iter().filter(|&f| f >= 0).collect::<Vec<_>>());
        if let Some((m, _)) = rings {
            close_all(&[m]);
        }
        return None;
    }
    let (memfd, shm) = rings?;
    // The vault lets a forked child that execs hand the rings to the new program.
    let vault = crate::vault::keep(memfd);
    let conn = Arc::new(Conn::new(
        shm,
        side,
        Carriers {
            bells: Bells::Own { mine: efd, peer: peer_efd },
            liveness: Liveness::Socket(sp[0]),
            vault,
            peer_pid: None,
        },
        nonblock,
        None,
    ));
    Some((conn, memfd, sp[1]))
}

fn dup_fd(fd: c_int) -> c_int {
    // SAFETY: plain syscall.
    unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) }
}

/// Binds `u` (a UDP socket of the family of `v6`) to `port` on the wildcard address.
fn bind_udp(u: &UdpSocket, v6: bool, port: u16) -> bool {
    let any: SocketAddr = if v6 {
        (std::net::Ipv6Addr::UNSPECIFIED, port).into()
    } else {
        (std::net::Ipv4Addr::UNSPECIFIED, port).into()
    };
    let sa = socket2_addr(&any);
    // SAFETY: binds our own socket to a local sockaddr of the right length (the real
    // bind: the library must not treat it as one of the program's sockets).
    unsafe { real::bind(u.as_raw_fd(), (&sa.0 as *const libc::sockaddr_storage).cast(), sa.1) == 0 }
}

/// A `SocketAddr` as a sockaddr_storage and its length.
fn socket2_addr(a: &SocketAddr) -> (libc::sockaddr_storage, socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; the writes below stay inside it.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            let s = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            s.sin_family = libc::AF_INET as libc::sa_family_t;
            s.sin_port = v4.port().to_be();
            s.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            let s = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            s.sin6_port = v6.port().to_be();
            s.sin6_addr.s6_addr = v6.ip().octets();
            s.sin6_scope_id = v6.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as socklen_t)
}

/// Before a TCP `connect` to `addr`: if the destination is a listed host (not this
/// one), makes everything the connection needs (the bridge socket, still unbound,
/// the nonce, the rings), so that once the port is known only the bridge socket's
/// bind and the HELLO are left ([`connect`] does the rest).
pub fn pre_connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> Option<(Arc<Conn>, Pending)> {
    if !enabled() {
        return None;
    }
    let (dest, lo) = key_of(addr, len)?;
    if lo || !listed(&dest.0) || crate::local::host_address(&dest.0) || !crate::sock::is_tcp_stream(fd) {
        return None;
    }
    // The program's own port if it bound one; else 0, and the kernel's connect picks
    // it (see [`connect`]).
    let port = sock_key(fd, false)?.1;
    let target = addr_of(&dest);
    let udp = udp_socket(target.is_ipv6())?;
    let cnonce = random_u64()?;
    // SAFETY: plain syscall.
    let nonblock = unsafe { real::fcntl(fd, libc::F_GETFL, 0) } & libc::O_NONBLOCK != 0;
    let tcp = dup_fd(fd);
    if tcp < 0 {
        return None;
    }
    let Some((conn, memfd, bridge_unix)) = new_conn(0, nonblock) else {
        close_all(&[tcp]);
        return None;
    };
    let now = Instant::now();
    let role = Role::Connector { target, hello: [0; MSG_LEN], sent: now, offered: None };
    let p = Pending {
        tcp,
        udp,
        nonce: 0,
        cnonce,
        ports: (port, dest.1),
        started: now,
        memfd,
        bridge_unix,
        role,
        xdp_local: None,
        xdp_peer: None,
    };
    Some((conn, p))
}

/// Connector: binds the bridge socket to our TCP port number `port` (the offer comes
/// there on UDP; if another socket holds it, no strait) and sends the HELLO from it.
///
/// (The HELLO goes from the bridge socket itself, not from a socket of its own
/// connected to the marker: such a socket's automatic bind takes a UDP port, which
/// can be the number the kernel gives the TCP socket of the next connection, whose
/// bridge socket then cannot bind it. `IP_RECVERR` makes the unconnected socket
/// report the ICMP error of a port without a marker.)
fn announce(p: &mut Pending, port: u16) -> bool {
    let Role::Connector { target, hello, sent, .. } = &mut p.role else { return false };
    if port == 0 || !bind_udp(&p.udp, target.is_ipv6(), port) || !recv_errors(&p.udp, target.is_ipv6(), true)
    {
        return false;
    }
    p.ports.0 = port;
    *hello = message(KIND_HELLO, p.cnonce, 0, port, p.ports.1, None, discovery_key());
    *sent = Instant::now();
    p.udp.send_to(hello.as_slice(), *target).is_ok()
}

/// Sets `IP_RECVERR` (`IPV6_RECVERR`) on `u`: on, an unconnected socket reports
/// ICMP errors for what it sent; off, the queued errors go (a connected socket
/// still reports hard errors, and nothing queues up for poll to see).
fn recv_errors(u: &UdpSocket, v6: bool, on: bool) -> bool {
    let (level, name) =
        if v6 { (libc::IPPROTO_IPV6, libc::IPV6_RECVERR) } else { (libc::IPPROTO_IP, libc::IP_RECVERR) };
    let v = c_int::from(on);
    // SAFETY: a local int option on our own socket.
    unsafe {
        libc::setsockopt(
            u.as_raw_fd(),
            level,
            name,
            (&v as *const c_int).cast(),
            std::mem::size_of::<c_int>() as socklen_t,
        ) == 0
    }
}

/// The program's `connect` of a TCP socket to another host, after [`pre_connect`]:
/// the real connect, with the HELLO sent as soon as the local port is known, and
/// the socket registered as a pending connection if the connect started.
///
/// An unbound socket stays unbound until the kernel's `connect` binds it: binding an
/// ephemeral port first would take a port no socket holds, which with the local
/// ports full of TIME_WAIT sockets (as a client that closes first leaves them) costs
/// a long search and then finds none, where `connect` may reuse such a port towards
/// another destination. So the connect goes first, non-blocking even for a blocking
/// socket (the HELLO must not wait for the TCP handshake: the acceptor probes our
/// port once it accepted), the HELLO follows, and a blocking socket then waits in a
/// second, blocking `connect`, as it would have in the first: same result, errors,
/// signals and `SO_SNDTIMEO`.
///
/// # Safety
/// As for libc's `connect`.
pub unsafe fn connect(
    fd: c_int,
    addr: *const sockaddr,
    len: socklen_t,
    conn: Arc<Conn>,
    mut p: Pending,
) -> c_int {
    // Bound by the program: the HELLO goes before the SYN, as the port is known.
    let bound = p.ports.0;
    let early = bound != 0;
    let mut announced = early && announce(&mut p, bound);
    // SAFETY: plain syscall.
    let flags = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    let switch = !early && flags >= 0 && flags & libc::O_NONBLOCK == 0;
    // SAFETY: plain syscall on the program's socket; restored below.
    let switched =
        switch && unsafe { real::fcntl(fd, libc::F_SETFL, (flags | libc::O_NONBLOCK) as usize) } == 0;
    // SAFETY: the caller's arguments.
    let mut r = unsafe { real::connect(fd, addr, len) };
    let mut e = real::errno();
    let started = r == 0 || e == libc::EINPROGRESS;
    if started && !early {
        announced = sock_key(fd, false).is_some_and(|k| announce(&mut p, k.1));
    }
    if switched {
        // SAFETY: as above: the program's own flags back.
        unsafe { real::fcntl(fd, libc::F_SETFL, flags as usize) };
        if r != 0 && e == libc::EINPROGRESS {
            // The program's blocking connect: on a socket whose connect is under way
            // the kernel waits for it to finish, as it would have in the first call.
            // SAFETY: the caller's arguments.
            r = unsafe { real::connect(fd, addr, len) };
            e = real::errno();
            if r != 0 && e == libc::EALREADY {
                // `SO_SNDTIMEO` ran out: the first call would have said EINPROGRESS.
                e = libc::EINPROGRESS;
            }
        }
    }
    // (Interrupted by a signal, the connect goes on as a non-blocking one would.)
    if announced && (r == 0 || e == libc::EINPROGRESS || e == libc::EINTR) {
        register(fd, conn, p);
    }
    real::set_errno(e);
    r
}

/// After the TCP connect started (or finished): the socket is a pending connection
/// to another host, which the background thread settles as soon as it can (so the
/// other end never waits for this program to use the socket).
pub fn register(fd: c_int, conn: Arc<Conn>, p: Pending) {
    *conn.remote_pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(p));
    conn.remote_settler.store(current_pid(), Ordering::Release);
    let bg = background();
    bg.pending.lock().unwrap_or_else(|e| e.into_inner()).push(conn.clone());
    ring_eventfd(bg.efd);
    if let Some(old) = crate::table::insert(fd, conn) {
        crate::table::drop_ref(old);
    }
}

/// Reports a malformed `STRAIT_*` setting of the devices once, then uses defaults
/// (the library cannot refuse to run the program).
fn config_or_default<T: Default, E: std::fmt::Display>(r: Result<T, E>) -> T {
    r.unwrap_or_else(|e| {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| eprintln!("strait: {e}; using the defaults for connections to other hosts"));
        T::default()
    })
}

fn udp_config() -> UdpConfig {
    let mut cfg = config_or_default(UdpConfig::from_env());
    // Threads of the program and the background thread all drive the link: the
    // plain-syscall backend has no per-thread state. Datagrams go out at once.
    cfg.backend = Backend::Mmsg;
    cfg.coalesce_ns = 0;
    cfg
}

/// One look at a pending connection: reads the offer or the connector's answer,
/// repeats the HELLO or the offer, sends the answer, starts the bridge. Never
/// blocks.
fn step(conn: &Arc<Conn>, p: &mut Pending) -> Step {
    let now = Instant::now();
    let timeout = Settings::get().attach_timeout;
    let mine = p.xdp_mine();
    let Pending { tcp, udp, nonce, cnonce, ports, started, role, xdp_peer, .. } = p;
    let (tcp, started, ports) = (*tcp, *started, *ports);
    match role {
        Role::Connector { target, hello, sent, offered } => {
            let mut buf = [0u8; MSG_LEN + 1];
            while offered.is_none() {
                match udp.recv_from(&mut buf) {
                    Ok((n, from)) => match parse_message(&buf[..n]) {
                        // From the host we connect to, for this connection, echoing
                        // the nonce of our HELLO (which only its listener's marker
                        // received): anything else, whoever sent it, is ignored.
                        Some(m) if m.ports == ports && m.echo == *cnonce && target.ip() == from.ip() => {
                            match m.kind {
                                KIND_OFFER if auth_matches(m.auth) => {
                                    *nonce = m.nonce;
                                    *offered = Some(from);
                                    *xdp_peer = m.xdp;
                                    // The marker is there: no more ICMP errors
                                    // to look for (and none to queue up).
                                    recv_errors(udp, target.is_ipv6(), false);
                                }
                                // An offer authenticated otherwise than ours (a
                                // secret at one end only, or another secret), or a
                                // refusal: the kernel carries it; we wrote nothing.
                                KIND_OFFER | KIND_REFUSE => {
                                    crate::conn::REMOTE_REFUSED.fetch_add(1, Ordering::Relaxed);
                                    return Step::Done(false);
                                }
                                _ => {}
                            }
                        }
                        Some(m) if m.kind == KIND_OFFER || m.kind == KIND_REFUSE => {
                            crate::conn::REMOTE_FORGED.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    },
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    // An ICMP error for the HELLO: no strait marker there.
                    Err(_) => return Step::Done(false),
                }
            }
            if now >= started + timeout {
                return Step::Done(false);
            }
            let Some(acceptor) = *offered else {
                if now >= *sent + REPEAT {
                    let _ = udp.send_to(hello.as_slice(), *target);
                    *sent = now;
                }
                return Step::Wait(udp.as_raw_fd(), libc::POLLIN, None);
            };
            match tcp_connected(tcp) {
                None => Step::Wait(tcp, libc::POLLOUT, None),
                Some(false) => Step::Done(false),
                Some(true) => {
                    // The acceptor offered its xdp port: take it if we have ours.
                    if p.xdp_peer.is_some() {
                        p.xdp_local = sock_key(tcp, false)
                            .zip(sock_key(tcp, true))
                            .and_then(|(l, r)| xdp_port_for(&l.0, &r.0))
                            .map(|port| {
                                let id = port.new_channel_id();
                                (port, id)
                            });
                    }
                    let via = if p.xdp_local.is_some() { Via::Xdp } else { Via::Udp };
                    let bridge = if via == Via::Xdp || p.udp.connect(acceptor).is_ok() {
                        new_bridge(conn, p, via)
                    } else {
                        None
                    };
                    let word = match (bridge.is_some(), via) {
                        (false, _) => NO,
                        (true, Via::Xdp) => GX,
                        (true, Via::Udp) => GO,
                    };
                    let mine = p.xdp_local.as_ref().map(|(port, id)| (port.local_mac(), *id));
                    let sent = send_confirmation(tcp, word, p.nonce, p.cnonce, mine.filter(|_| word == GX));
                    // The bridge is published only once the answer is on the TCP
                    // connection: from then on the program's other threads use the
                    // connection without waiting for this settling, and their
                    // `shutdown` shuts the kernel socket too, whose FIN must follow the
                    // answer (ahead of it, the answer fails and the acceptor reads end
                    // of stream, while bytes already written to the rings would be
                    // carried by neither path). Unpublished, the bridge just goes.
                    match bridge {
                        Some(b) if sent => {
                            publish(conn, b, via);
                            Step::Done(true)
                        }
                        _ => Step::Done(false),
                    }
                }
            }
        }
        Role::Acceptor { marker, peer, offer, sent, probed, forgiven } => {
            if offer.is_none() {
                match take_hello(marker, peer, ports) {
                    Some((c, auth)) if auth_matches(auth) => {
                        *cnonce = c;
                        let m = message(KIND_OFFER, *nonce, c, ports.0, ports.1, mine, discovery_key());
                        if udp.send(&m).is_err() {
                            // An ICMP error waiting on the socket fails a send (and
                            // is gone then): one for a PROBE that came before the
                            // connector bound its port, now that its HELLO is here.
                            // The offer goes now, not a repeat later.
                            *forgiven = true;
                            let _ = udp.send(&m);
                        }
                        *offer = Some(m);
                        *sent = now;
                    }
                    Some((c, _)) => {
                        refuse(udp, c, ports);
                        return Step::Done(false);
                    }
                    None => {}
                }
            }
            // An ICMP error: the connector's port is closed (it gave up, or is not
            // strait after all). Peeking leaves its first packets for the bridge.
            let mut buf = [0u8; 1];
            if let Err(e) = udp.peek(&mut buf) {
                if e.kind() != std::io::ErrorKind::WouldBlock {
                    if !*probed || *forgiven {
                        return Step::Done(false);
                    }
                    // Perhaps a probe that came before the connector bound its
                    // port: the next datagram, a full repeat later, decides (a
                    // connector without strait answers it with an error again).
                    *forgiven = true;
                    *sent = now;
                }
            }
            if now >= *sent + REPEAT {
                let probe = message(KIND_PROBE, 0, 0, ports.0, ports.1, None, None);
                let _ = udp.send(offer.as_ref().unwrap_or(&probe));
                *probed |= offer.is_none();
                *sent = now;
            }
            // Before the offer went out nobody can know our nonce: anything on the
            // connection is the program's.
            match read_confirmation(tcp, *nonce, *cnonce) {
                Some(Some(Answer::Go)) => Step::Done(attach(conn, p, Via::Udp).is_some()),
                Some(Some(Answer::GoXdp(mac, id))) if p.xdp_local.is_some() => {
                    p.xdp_peer = Some((mac, id));
                    Step::Done(attach(conn, p, Via::Xdp).is_some())
                }
                Some(Some(_)) | Some(None) => Step::Done(false),
                None if now >= started + timeout * ACCEPTOR_WAIT_FACTOR => Step::Done(false),
                // Until the HELLO came, its arrival at the marker wakes us too (it
                // may come after the accept: the connector sends it once its
                // connect picked the port).
                None => Step::Wait(tcp, libc::POLLIN, offer.is_none().then(|| marker.udp.as_raw_fd())),
            }
        }
    }
}

/// Settles a pending connection to another host (waiting, bounded, if nobody did
/// yet): true if strait carries it from now on. `None` if it is not one.
pub fn settle(_fd: c_int, conn: &Arc<Conn>) -> Option<bool> {
    if conn.remote.get().is_some() {
        return Some(true);
    }
    let settler = conn.remote_settler.load(Ordering::Acquire);
    if settler == 0 {
        // Never a connection to another host (the common, local case: no lock).
        return None;
    }
    if settler != current_pid() {
        // A forked child of the process settling it: the parent decides (its
        // threads may hold the pending state's lock, copied locked into this
        // process), and its decision shows in the shared header.
        let deadline = Instant::now() + Settings::get().attach_timeout * (ACCEPTOR_WAIT_FACTOR + 1);
        loop {
            match conn.state() {
                ATTACHED => return Some(true),
                KERNEL => return Some(false),
                _ if Instant::now() >= deadline => return Some(false),
                _ => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }
    let mut slot = conn.remote_pending.lock().unwrap_or_else(|e| e.into_inner());
    if conn.remote.get().is_some() {
        return Some(true);
    }
    if conn.state() == KERNEL && conn.is_remote_kernel() {
        return Some(false);
    }
    let p = slot.as_mut()?.downcast_mut::<Pending>()?;
    loop {
        match step(conn, p) {
            Step::Done(ok) => {
                finish(conn, &mut slot, ok);
                return Some(ok);
            }
            Step::Wait(fd, events, also) => {
                let mut pf = [
                    libc::pollfd { fd, events, revents: 0 },
                    libc::pollfd { fd: also.unwrap_or(-1), events: libc::POLLIN, revents: 0 },
                ];
                // SAFETY: two pollfds on the stack (a negative descriptor is skipped).
                unsafe { real::poll(pf.as_mut_ptr(), 2, 5) };
            }
        }
    }
}

/// Records the decision (the pending state and its descriptors go).
fn finish(conn: &Conn, slot: &mut Option<FarSetup>, ok: bool) {
    *slot = None;
    if !ok {
        conn.mark_remote_kernel();
        conn.shm.state().store(KERNEL, Ordering::Release);
        crate::conn::KERNEL_FALLBACKS.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether a non-blocking connect finished: `None` still in progress, else whether
/// it succeeded.
fn tcp_connected(fd: c_int) -> Option<bool> {
    let mut pf = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
    // SAFETY: one pollfd on the stack.
    let r = unsafe { real::poll(&mut pf, 1, 0) };
    if r == 0 {
        return None;
    }
    let mut err: c_int = 0;
    let mut l = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: a local int and its length.
    let ok = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ERROR, (&mut err as *mut c_int).cast(), &mut l)
    } == 0;
    Some(r > 0 && ok && err == 0 && sock_key(fd, true).is_some())
}

/// The connector's answer: word, the acceptor's nonce, xdp MAC and channel id, the
/// connector's nonce, and (with a secret) the tag over all of it.
fn answer(word: u64, nonce: u64, cnonce: u64, xdp: Option<(Mac, u32)>) -> [u8; ANSWER_LEN] {
    let mut m = [0u8; ANSWER_LEN];
    m[0..8].copy_from_slice(&word.to_le_bytes());
    m[8..16].copy_from_slice(&nonce.to_le_bytes());
    if let Some((mac, id)) = xdp {
        m[16..22].copy_from_slice(&mac.0);
        m[24..28].copy_from_slice(&id.to_le_bytes());
    }
    m[32..40].copy_from_slice(&cnonce.to_le_bytes());
    if let Some(k) = discovery_key() {
        m[28] = 1;
        let tag = k.tag(&[TAG_ANSWER, &m[..SIGNED_LEN]]);
        m[SIGNED_LEN..].copy_from_slice(&tag[..TAG_LEN]);
    }
    m
}

fn send_confirmation(fd: c_int, word: u64, nonce: u64, cnonce: u64, xdp: Option<(Mac, u32)>) -> bool {
    let m = answer(word, nonce, cnonce, xdp);
    let mut off = 0;
    let deadline = Instant::now() + Duration::from_millis(200);
    while off < m.len() && Instant::now() < deadline {
        // SAFETY: the rest of a local array.
        let n = unsafe {
            real::send(fd, m[off..].as_ptr().cast(), m.len() - off, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
        };
        if n > 0 {
            off += n as usize;
        } else if n < 0 && matches!(real::errno(), libc::EAGAIN | libc::EINTR) {
            let mut pf = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
            // SAFETY: one pollfd on the stack.
            unsafe { real::poll(&mut pf, 1, 10) };
        } else {
            return false;
        }
    }
    off == m.len()
}

/// The connector's answer.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Go,
    GoXdp(Mac, u32),
    No,
}

/// Acceptor: one look for the connector's answer. `None`: not all here yet;
/// `Some(Some(answer))`: an answer with our nonce, the connector's nonce and (with a
/// secret) a good tag (consumed); `Some(None)`: anything else, or end of stream
/// (left unread: a peer that is not strait after all, or a forged or replayed
/// answer, which the program then reads as the bytes they are).
fn read_confirmation(fd: c_int, nonce: u64, cnonce: u64) -> Option<Option<Answer>> {
    let mut m = [0u8; ANSWER_LEN];
    // SAFETY: a local array.
    let n = unsafe { real::recv(fd, m.as_mut_ptr().cast(), ANSWER_LEN, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    if n < 0 && matches!(real::errno(), libc::EAGAIN | libc::EINTR) {
        return None;
    }
    if n <= 0 {
        return Some(None);
    }
    let k = (n as usize).min(16);
    // Any prefix of word and nonce must be one of ours, or it is the program's data.
    let ours = [GO, GX, NO].iter().any(|w| {
        let mut want = [0u8; 16];
        want[0..8].copy_from_slice(&w.to_le_bytes());
        want[8..16].copy_from_slice(&nonce.to_le_bytes());
        m[..k] == want[..k]
    });
    if !ours {
        return Some(None);
    }
    if (n as usize) < ANSWER_LEN {
        return None;
    }
    let echo = u64::from_le_bytes(m[32..40].try_into().unwrap_or_default());
    let auth = auth_of(m[28] != 0, TAG_ANSWER, &m[..SIGNED_LEN], &m[SIGNED_LEN..]);
    if echo != cnonce || !auth_matches(auth) {
        crate::conn::REMOTE_FORGED.fetch_add(1, Ordering::Relaxed);
        return Some(None);
    }
    let word = u64::from_le_bytes(m[0..8].try_into().unwrap_or_default());
    let id = u32::from_le_bytes(m[24..28].try_into().unwrap_or_default());
    let mac: [u8; 6] = m[16..22].try_into().unwrap_or_default();
    let answer = match word {
        GO => Answer::Go,
        GX if id != 0 => Answer::GoXdp(Mac(mac), id),
        _ => Answer::No,
    };
    // SAFETY: consumes exactly the bytes peeked above into a local array.
    let n = unsafe { real::recv(fd, m.as_mut_ptr().cast(), ANSWER_LEN, libc::MSG_DONTWAIT) };
    Some((n as usize == ANSWER_LEN).then_some(answer))
}

/// Which device carries a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Udp,
    Xdp,
}

// ------------------------------------------------------------------ xdp ports

/// `STRAIT_XDP=1` (or `strait run --xdp`): connections to other hosts on the same
/// link ride the xdp device when both ends have it. Off by default: the XDP program
/// it attaches sends every frame of the interface through the XDP path, which slows
/// the kernel's own traffic there (generic XDP on veth).
fn xdp_wanted() -> bool {
    static W: OnceLock<bool> = OnceLock::new();
    *W.get_or_init(|| std::env::var("STRAIT_XDP").is_ok_and(|v| v == "1"))
}

/// The interface holding IPv4 address `local` if `peer` is on the same subnet (on
/// the link: frames addressed by MAC reach it), by name.
fn onlink_interface(local: &[u8; 16], peer: &[u8; 16]) -> Option<String> {
    let l4 = std::net::Ipv6Addr::from(*local).to_ipv4_mapped()?;
    let p4 = std::net::Ipv6Addr::from(*peer).to_ipv4_mapped()?;
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned; its pointers are null or
        // valid until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() {
            continue;
        }
        // SAFETY: the family says what the address is.
        if unsafe { (*ifa.ifa_addr).sa_family } as c_int != libc::AF_INET {
            continue;
        }
        // SAFETY: AF_INET addresses and masks are sockaddr_in.
        let (a, m) = unsafe {
            (
                (*ifa.ifa_addr.cast::<libc::sockaddr_in>()).sin_addr.s_addr.to_ne_bytes(),
                (*ifa.ifa_netmask.cast::<libc::sockaddr_in>()).sin_addr.s_addr.to_ne_bytes(),
            )
        };
        let mask = u32::from_be_bytes(m);
        if a == l4.octets() && mask != 0 && u32::from(p4) & mask == u32::from(l4) & mask {
            // SAFETY: ifa_name is a NUL-terminated string.
            found = Some(unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned());
            break;
        }
    }
    // SAFETY: frees the list getifaddrs returned.
    unsafe { libc::freeifaddrs(ifap) };
    found.filter(|n| n != "lo")
}

/// This process's xdp port on the interface that reaches `peer` from `local` on the
/// link, opened at first use (attaches the XDP program); `None` if xdp is off, the
/// peer is not on the link, or the port cannot be opened (no privileges, another
/// process holds the interface: then the udp device, and no second try).
fn xdp_port_for(local: &[u8; 16], peer: &[u8; 16]) -> Option<Arc<XdpPort>> {
    type Ports = HashMap<String, Option<Arc<XdpPort>>>;
    static PORTS: Mutex<Option<(u32, Ports)>> = Mutex::new(None);
    if !xdp_wanted() {
        return None;
    }
    let ifname = onlink_interface(local, peer)?;
    let mut g = PORTS.lock().unwrap_or_else(|e| e.into_inner());
    let pid = current_pid();
    if g.as_ref().is_none_or(|(p, _)| *p != pid) {
        // A forked child does not share its parent's AF_XDP socket.
        *g = Some((pid, HashMap::new()));
    }
    let (_, ports) = g.as_mut()?;
    ports
        .entry(ifname.clone())
        .or_insert_with(|| match XdpPort::open(&XdpConfig::for_port(&ifname)) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("strait: no xdp device on {ifname} ({e}); using the udp device");
                None
            }
        })
        .clone()
}

/// Starts the bridge of a settled connection; `None` if the device could not be
/// set up (the connection then stays with the kernel).
fn attach(conn: &Arc<Conn>, p: &Pending, via: Via) -> Option<()> {
    publish(conn, new_bridge(conn, p, via)?, via);
    Some(())
}

/// The bridge of a connection about to settle on strait, not yet in use; `None` if
/// the device could not be set up.
fn new_bridge(conn: &Arc<Conn>, p: &Pending, via: Via) -> Option<Arc<Bridge>> {
    let (memfd, bridge_unix) = (p.memfd, p.bridge_unix);
    let mut rel = config_or_default(ReliableConfig::from_env());
    rel.auth = data_auth(p.cnonce, p.nonce, p.ports, matches!(p.role, Role::Connector { .. }));
    let (dev, link_fd): (Box<dyn Device + Send>, Option<c_int>) = match via {
        Via::Udp => {
            // The link's socket lives as long as the connection: above the program's
            // descriptor numbers, as the library's others.
            let sock = crate::fds::dup_high(p.udp.as_raw_fd());
            if sock < 0 {
                return None;
            }
            // SAFETY: `sock` is a UDP socket descriptor we own (just duplicated).
            let sock = unsafe { UdpSocket::from_raw_fd(sock) };
            let link = UdpLink::from_socket(sock, &udp_config()).ok()?;
            let fd = link.event_fd();
            (Box::new(Reliable::new(link, rel)), fd)
        }
        Via::Xdp => {
            let ((port, local_id), (mac, peer_id)) = (p.xdp_local.as_ref()?, p.xdp_peer?);
            let chan: XdpChannel = port.channel(mac, *local_id, peer_id).ok()?;
            let fd = chan.event_fd();
            (Box::new(Reliable::new(chan, rel)), fd)
        }
    };
    let shm = Shm::map(memfd, Settings::get().ring)?;
    let (app_efd, unix) = (crate::fds::dup_high(conn.my_efd), crate::fds::dup_high(bridge_unix));
    if app_efd < 0 || unix < 0 {
        close_all(&[app_efd, unix].into_iter().filter(|&f| f >= 0).collect::<Vec<_>>());
        return None;
    }
    let max_data = dev.max_frame_len().saturating_sub(1).max(1);
    let bridge = Arc::new(Bridge {
        shm,
        side: conn.side,
        app_efd,
        unix: AtomicI32::new(unix),
        link_fd: link_fd.unwrap_or(-1),
        owner: owner_pid(),
        max_data,
        retired: AtomicBool::new(false),
        last_inline_ms: AtomicU64::new(0),
        started: Instant::now(),
        st: Mutex::new(BridgeState {
            dev,
            peer_consumed: 0,
            credit_sent: 0,
            shut_sent: false,
            fin_sent: false,
            reset_sent: false,
            failed: false,
        }),
    });
    Some(bridge)
}

/// Makes `bridge` carry `conn`: the program's calls and the background thread use
/// it from now on.
fn publish(conn: &Arc<Conn>, bridge: Arc<Bridge>, via: Via) {
    conn.shm.state().store(ATTACHED, Ordering::Release);
    let _ = conn.remote.set(bridge.clone());
    let bg = background();
    bg.bridges.lock().unwrap_or_else(|e| e.into_inner()).push(bridge);
    ring_eventfd(bg.efd);
    crate::conn::REMOTE.fetch_add(1, Ordering::Relaxed);
    if via == Via::Xdp {
        crate::conn::REMOTE_XDP.fetch_add(1, Ordering::Relaxed);
    }
}

// ------------------------------------------------------------------ listeners

/// After a successful `listen(fd)`: binds the marker beside it.
pub fn on_listen(fd: c_int) {
    if !enabled() || !crate::sock::is_tcp_stream(fd) {
        return;
    }
    if crate::table::listening(fd).is_some_and(|l| l.far.get().is_some()) {
        return;
    }
    let Some(key) = sock_key(fd, false) else { return };
    let wildcard = key.0 == [0u8; 16];
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: a local sockaddr_storage and its length.
    if unsafe { libc::getsockname(fd, (&mut ss as *mut libc::sockaddr_storage).cast(), &mut len) } != 0 {
        return;
    }
    let v6 = ss.ss_family as c_int == libc::AF_INET6;
    let Some(udp) = udp_socket(v6) else { return };
    if v6 {
        let only: c_int = c_int::from(wildcard && crate::sock::v6only(fd));
        // SAFETY: a local int option.
        unsafe {
            libc::setsockopt(
                udp.as_raw_fd(),
                libc::IPPROTO_IPV6,
                libc::IPV6_V6ONLY,
                (&only as *const c_int).cast(),
                std::mem::size_of::<c_int>() as socklen_t,
            )
        };
    }
    // SAFETY: the listener's own address, as the kernel reported it.
    if unsafe { real::bind(udp.as_raw_fd(), (&ss as *const libc::sockaddr_storage).cast(), len) } != 0 {
        if real::errno() == libc::EADDRINUSE {
            // Whoever holds the port would receive the HELLOs meant for this
            // listener: only a shared secret keeps it from answering them.
            eprintln!(
                "strait: UDP port {} is taken by another socket; connections from other hosts to \
                 this listener stay on the kernel{}",
                key.1,
                if discovery_key().is_some() {
                    ""
                } else {
                    " (and, without --peers-secret, their connectors could be answered by that socket's owner)"
                }
            );
        }
        return;
    }
    let _ = crate::table::listening_or_new(fd).far.set(Arc::new(Marker { udp }));
}

/// After a kernel `accept` on `lfd` returned `fd`: a connection from a listed host
/// to a strait listener gets an offer and becomes a pending strait connection.
pub fn on_accept(lfd: c_int, fd: c_int, nonblock: bool) -> bool {
    if !enabled() {
        return false;
    }
    let Some(marker) = crate::table::listening(lfd).and_then(|l| l.far.get().cloned()) else {
        return false;
    };
    let (Some(peer), Some(local)) = (sock_key(fd, true), sock_key(fd, false)) else { return false };
    if !listed(&peer.0) {
        return false;
    }
    let (to, from) = (addr_of(&peer), addr_of(&(local.0, 0)));
    let Some(udp) = udp_socket(to.is_ipv6()) else { return false };
    let sa = socket2_addr(&from);
    // SAFETY: binds our own socket to a local sockaddr of the right length.
    if unsafe { real::bind(udp.as_raw_fd(), (&sa.0 as *const libc::sockaddr_storage).cast(), sa.1) } != 0
        || udp.connect(to).is_err()
    {
        return false;
    }
    let Some(nonce) = random_u64() else { return false };
    let ports = (peer.1, local.1);
    // The connector's HELLO (sent as soon as its connect picked the port, or before
    // its SYN if it bound the port itself) may be here already: then the offer goes
    // at once; else the pending connection looks again when it comes.
    let (cnonce, offer) = match take_hello(&marker, &peer.0, ports) {
        Some((c, auth)) if auth_matches(auth) => (c, true),
        Some((c, _)) => {
            refuse(&udp, c, ports);
            return false;
        }
        None => (0, false),
    };
    let xdp_local = xdp_port_for(&local.0, &peer.0).map(|port| {
        let id = port.new_channel_id();
        (port, id)
    });
    let mine = xdp_local.as_ref().map(|(port, id)| (port.local_mac(), *id));
    let first = if offer {
        message(KIND_OFFER, nonce, cnonce, ports.0, ports.1, mine, discovery_key())
    } else {
        message(KIND_PROBE, 0, 0, ports.0, ports.1, None, None)
    };
    if udp.send(&first).is_err() {
        return false;
    }
    let tcp = dup_fd(fd);
    if tcp < 0 {
        return false;
    }
    let Some((conn, memfd, bridge_unix)) = new_conn(1, nonblock) else {
        close_all(&[tcp]);
        return false;
    };
    let now = Instant::now();
    let role = Role::Acceptor {
        marker,
        peer: peer.0,
        offer: offer.then_some(first),
        sent: now,
        probed: !offer,
        forgiven: false,
    };
    let p = Pending {
        tcp,
        udp,
        nonce,
        cnonce,
        ports,
        started: now,
        memfd,
        bridge_unix,
        role,
        xdp_local,
        xdp_peer: None,
    };
    register(fd, conn, p);
    true
}

// ------------------------------------------------------------------ the bridge

fn owner_pid() -> u32 {
    // SAFETY: plain syscall.
    unsafe { libc::getpid() as u32 }
}

/// The peer's side of the rings of one connection to another host. See the module
/// docs.
pub struct Bridge {
    /// Our own mapping of the connection's rings.
    shm: Shm,
    /// The program's side: we consume direction `side` and produce `1 - side`.
    side: usize,
    /// The program's eventfd (ours to ring when it sleeps).
    app_efd: c_int,
    /// Our end of the socketpair: closing it tells the program the peer is gone.
    unix: AtomicI32,
    /// The UDP socket of the device (readable when the peer host sent something).
    link_fd: c_int,
    /// The process that owns the device state; a forked child leaves the driving to
    /// it (its copy of the state would diverge).
    owner: u32,
    max_data: usize,
    retired: AtomicBool,
    /// When a program thread last drove the device (ms since the bridge's start):
    /// meanwhile the background thread leaves the socket to it.
    last_inline_ms: AtomicU64,
    started: Instant,
    st: Mutex<BridgeState>,
}

/// How long after a program thread drove a connection the background thread keeps
/// off its socket (so one arrival does not wake two threads).
const INLINE_GRACE_MS: u64 = 2;

struct BridgeState {
    dev: Box<dyn Device + Send>,
    /// Total bytes the peer reported consumed (its ring is free beyond this).
    peer_consumed: u64,
    /// Consumed total we last reported.
    credit_sent: u64,
    shut_sent: bool,
    fin_sent: bool,
    reset_sent: bool,
    failed: bool,
}

// SAFETY: the device is only touched under the mutex; the rings are shared memory
// accessed with atomics and copies (see conn.rs).
unsafe impl Send for Bridge {}
// SAFETY: as above.
unsafe impl Sync for Bridge {}

impl Drop for Bridge {
    fn drop(&mut self) {
        let u = self.unix.swap(-1, Ordering::Relaxed);
        close_all(&[self.app_efd]);
        if u >= 0 {
            close_all(&[u]);
        }
    }
}

impl FarEnd for Bridge {
    /// True in the process that drives the device (not in a forked child).
    fn owned_here(&self) -> bool {
        self.owner == current_pid()
    }

    /// The UDP socket to sleep on, for a program thread waiting on this connection.
    fn wake_fd(&self) -> Option<c_int> {
        (self.owner == current_pid() && self.link_fd >= 0).then_some(self.link_fd)
    }

    /// A program thread's turn: drives the device now (not in a forked child).
    fn pump_inline(&self) {
        if self.owner != current_pid() || self.retired.load(Ordering::Relaxed) {
            return;
        }
        self.last_inline_ms.store(self.started.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
        let mut st = self.st.lock().unwrap_or_else(|e| e.into_inner());
        self.pump(&mut st);
    }

    /// After the program read: return credit once a quarter of the ring was freed.
    fn after_read(&self) {
        let consumed = self.w(1 - self.side, HEAD).load(Ordering::Acquire);
        let ring = self.shm.ring as u64;
        if let Ok(st) = self.st.try_lock() {
            if consumed.saturating_sub(st.credit_sent) < ring / 4 {
                return;
            }
        }
        self.pump_inline();
    }

    /// A program thread just wrote: sends it now, without first looking for
    /// arrivals (that costs a system call; whoever waits for data looks anyway).
    fn push_inline(&self) {
        if self.owner != current_pid() || self.retired.load(Ordering::Relaxed) {
            return;
        }
        self.last_inline_ms.store(self.started.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
        let mut st = self.st.lock().unwrap_or_else(|e| e.into_inner());
        self.pump_with(&mut st, false);
    }
}

impl Bridge {
    fn w(&self, d: usize, off: usize) -> &AtomicU64 {
        self.shm.word(ctl(d) + off)
    }

    fn wake_app(&self, flag: &AtomicU64) {
        fence(Ordering::SeqCst);
        if flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::Relaxed) != 0 {
            ring_eventfd(self.app_efd);
        }
    }

    /// True if a program thread drove the device within the grace period.
    fn driven_inline(&self) -> bool {
        let last = self.last_inline_ms.load(Ordering::Relaxed);
        last != 0 && (self.started.elapsed().as_millis() as u64) < last + INLINE_GRACE_MS
    }

    /// Moves everything that can move now; true once the bridge is finished (closed
    /// and drained, or failed).
    fn pump(&self, st: &mut BridgeState) -> bool {
        self.pump_with(st, true)
    }

    fn pump_with(&self, st: &mut BridgeState, arrivals: bool) -> bool {
        if st.failed {
            return true;
        }
        let ring = self.shm.ring as u64;
        let (tx, rx) = (self.side, 1 - self.side);
        let app_gone = self.w(rx, RCLOSED).load(Ordering::Acquire) != 0;
        // Arrivals.
        let mut broke = false;
        let mut woke_reader = false;
        let mut more = arrivals;
        while more {
            let BridgeState { dev, peer_consumed, .. } = &mut *st;
            let r = dev.recv_frame(&mut |f| {
                let mut kind = [0u8; 1];
                if !f.read(0, &mut kind) {
                    broke = true;
                    return;
                }
                match kind[0] {
                    F_DATA => {
                        let n = f.len() - 1;
                        let tail = self.w(rx, TAIL).load(Ordering::Relaxed);
                        if app_gone {
                            // Nobody reads any more: thrown away, and credited.
                            self.w(rx, TAIL).store(tail + n as u64, Ordering::Release);
                            self.w(rx, HEAD).store(tail + n as u64, Ordering::Release);
                            return;
                        }
                        let ring_rx = self.shm.ring(rx);
                        if !matches!(ring_rx.writable(), Ok(w) if w.len >= n as u64) {
                            // More than the credit we gave: a broken peer.
                            broke = true;
                            return;
                        }
                        let base = self.shm.data(rx);
                        let mut done = 0usize;
                        for (off, m) in pieces(tail, n, self.shm.ring) {
                            // SAFETY: `off + m <= ring` inside the data area of the
                            // direction we produce; the consumer does not read beyond
                            // the tail we publish after the copy. Straight from the
                            // frame into the ring, no copy in between.
                            let ok = unsafe { f.read_raw(1 + done, base.add(off), m) };
                            if !ok {
                                broke = true;
                                return;
                            }
                            done += m;
                        }
                        ring_rx.publish_to(tail + n as u64);
                        woke_reader = true;
                    }
                    F_CREDIT => {
                        let mut v = [0u8; 8];
                        if f.len() == 9 && f.read(1, &mut v) {
                            *peer_consumed = (*peer_consumed).max(u64::from_le_bytes(v));
                        } else {
                            broke = true;
                        }
                    }
                    F_SHUT | F_CLOSE => {
                        if kind[0] == F_CLOSE {
                            self.w(tx, RCLOSED).store(1, Ordering::Release);
                            self.wake_app(self.w(tx, WSLEEP));
                        }
                        self.w(rx, WCLOSED).store(1, Ordering::Release);
                        woke_reader = true;
                    }
                    F_RESET => {
                        // The peer program closed without reading: our writes fail.
                        self.w(tx, RCLOSED).store(1, Ordering::Release);
                        self.wake_app(self.w(tx, WSLEEP));
                    }
                    _ => broke = true,
                }
            });
            match r {
                Ok(true) if !broke => {}
                Ok(_) if !broke => more = false,
                _ => {
                    self.fail(st);
                    return true;
                }
            }
        }
        if woke_reader {
            self.wake_app(self.w(rx, RSLEEP));
        }
        // Departures: as much as the peer's ring has room for.
        let ring_tx = self.shm.ring(tx);
        loop {
            let Ok(waiting) = ring_tx.readable() else {
                self.fail(st);
                return true;
            };
            let head = waiting.pos;
            let credit = (st.peer_consumed + ring).saturating_sub(head);
            let n = waiting.len.min(credit).min(self.max_data as u64) as usize;
            if n == 0 {
                break;
            }
            let base = self.shm.data(tx);
            let sent = st.dev.send_frame(1 + n, &mut |w| {
                w.write(0, &[F_DATA]);
                let mut done = 0usize;
                for (off, m) in pieces(head, n, self.shm.ring) {
                    // SAFETY: `off + m <= ring` inside the data area the program
                    // produces (a mapping only this process and its forks hold);
                    // bytes below its published tail are not written again until we
                    // advance the head.
                    let src = unsafe { std::slice::from_raw_parts(base.add(off), m) };
                    w.write(1 + done, src);
                    done += m;
                }
            });
            match sent {
                Ok(true) => {
                    ring_tx.consume_to(head + n as u64);
                    self.wake_app(self.w(tx, WSLEEP));
                }
                Ok(false) => break,
                Err(_) => {
                    self.fail(st);
                    return true;
                }
            }
        }
        // Credit for what the program read (or we threw away).
        let consumed = self.w(rx, HEAD).load(Ordering::Acquire);
        // (A sender blocked on credit has at least a ring's worth outstanding, so
        // once the program read it all this fires: no deadlock.)
        if consumed.saturating_sub(st.credit_sent) >= ring / 4 {
            let mut m = [0u8; 9];
            m[0] = F_CREDIT;
            m[1..].copy_from_slice(&consumed.to_le_bytes());
            if let Ok(true) = st.dev.send_frame(9, &mut |w| w.write(0, &m)) {
                st.credit_sent = consumed;
            }
        }
        // End of stream once everything written went out.
        let tx_done = self.w(tx, HEAD).load(Ordering::Relaxed) == self.w(tx, TAIL).load(Ordering::Acquire);
        if !st.shut_sent && tx_done && self.w(tx, WCLOSED).load(Ordering::Acquire) != 0 {
            // Closed altogether: one frame, so the peer never reads end of stream
            // without its writes failing too.
            let closed = self.w(rx, RCLOSED).load(Ordering::Acquire) != 0;
            let kind = if closed { F_CLOSE } else { F_SHUT };
            if let Ok(true) = st.dev.send_frame(1, &mut |w| w.write(0, &[kind])) {
                st.shut_sent = true;
                st.reset_sent = closed;
            }
        }
        // The program closed its end: the peer's writes fail from now on (EPIPE), as
        // they do between local strait processes.
        if app_gone && st.shut_sent && !st.reset_sent {
            if let Ok(true) = st.dev.send_frame(1, &mut |w| w.write(0, &[F_RESET])) {
                st.reset_sent = true;
            }
        }
        let mut finished = false;
        if st.shut_sent && app_gone {
            if !st.fin_sent {
                st.dev.shutdown();
                st.fin_sent = true;
            }
            finished = !st.dev.drain();
        }
        if st.dev.doorbell().is_err() {
            self.fail(st);
            return true;
        }
        finished
    }

    /// The connection is dead (peer gone, broken peer, link down): the program sees
    /// it as a reset peer.
    fn fail(&self, st: &mut BridgeState) {
        st.failed = true;
        if self.link_fd >= 0 {
            // The socket goes (a peer's retransmissions would keep it readable in
            // the program's poll and epoll sets); its descriptor number now names an
            // eventfd that never becomes readable, until the device is dropped.
            let quiet = eventfd();
            if quiet >= 0 {
                // SAFETY: replaces a descriptor the device owns with a fresh eventfd.
                unsafe { libc::dup3(quiet, self.link_fd, libc::O_CLOEXEC) };
                close_all(&[quiet]);
            }
        }
        let u = self.unix.swap(-1, Ordering::Relaxed);
        if u >= 0 {
            close_all(&[u]);
        }
        ring_eventfd(self.app_efd);
    }

    fn timer_ms(st: &BridgeState) -> Option<c_int> {
        st.dev.timer_ns().map(|ns| ns.div_ceil(1_000_000).min(1000) as c_int)
    }
}

/// This process's id, cached (refreshed in a forked child by [`after_fork_child`]).
fn current_pid() -> u32 {
    strait_sys::current_pid()
}

// ------------------------------------------------------------------ background

struct Background {
    /// Rung by the program (a closed or shut connection, a write from a forked
    /// child) and when a bridge is added.
    efd: c_int,
    bridges: Mutex<Vec<Arc<Bridge>>>,
    /// Connections still agreeing on their path.
    /// (Held, not weak: a program that closes its socket before the connection is
    /// settled may have forked a child that still holds it; once settled, the
    /// connection ends if nobody does.)
    pending: Mutex<Vec<Arc<Conn>>>,
}

/// The background thread of this process (a forked child starts its own: the
/// parent's thread did not come along).
static BACKGROUND: Mutex<Option<(u32, &'static Background)>> = Mutex::new(None);

/// This process's background thread, if it started one.
fn existing_background() -> Option<&'static Background> {
    let g = BACKGROUND.lock().unwrap_or_else(|e| e.into_inner());
    g.filter(|(p, _)| *p == current_pid()).map(|(_, bg)| bg)
}

fn background() -> &'static Background {
    let mut g = BACKGROUND.lock().unwrap_or_else(|e| e.into_inner());
    let pid = current_pid();
    if let Some((p, bg)) = *g {
        if p == pid {
            return bg;
        }
    }
    let bg: &'static Background = Box::leak(Box::new(Background {
        efd: eventfd(),
        bridges: Mutex::new(Vec::new()),
        pending: Mutex::new(Vec::new()),
    }));
    let _ = std::thread::Builder::new().name("strait-bridge".into()).spawn(move || bg.run());
    *g = Some((pid, bg));
    bg
}

impl Background {
    /// Moves every pending connection on (one look each), adding what to wait for.
    fn settle_pending(&self, fds: &mut Vec<libc::pollfd>, ms: &mut c_int) {
        let list: Vec<Arc<Conn>> = self.pending.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut done = Vec::new();
        for conn in &list {
            // The program is settling it itself right now: leave it.
            let Ok(mut slot) = conn.remote_pending.try_lock() else {
                *ms = (*ms).min(5);
                continue;
            };
            let Some(p) = slot.as_mut().and_then(|p| p.downcast_mut::<Pending>()) else {
                done.push(conn.clone());
                continue;
            };
            match step(conn, p) {
                Step::Done(ok) => {
                    finish(conn, &mut slot, ok);
                    drop(slot);
                    if ok {
                        conn.after_late_attach();
                    }
                    done.push(conn.clone());
                }
                Step::Wait(fd, events, also) => {
                    fds.push(libc::pollfd { fd, events, revents: 0 });
                    if let Some(fd) = also {
                        fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                    }
                    *ms = (*ms).min(REPEAT.as_millis() as c_int);
                }
            }
        }
        if !done.is_empty() {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|c| !done.iter().any(|d| Arc::ptr_eq(d, c)));
        }
    }

    fn run(&self) {
        // When each bridge next needs a pass of its own (a timer), by its address.
        let mut due: HashMap<usize, Instant> = HashMap::new();
        // Bridges whose socket was readable in the last sleep; and whether the
        // program rang (a close, a shutdown, a forked child's write, a new bridge):
        // then every bridge gets a pass.
        let mut readable: Vec<usize> = Vec::new();
        let mut rung = true;
        loop {
            let list: Vec<Arc<Bridge>> = self.bridges.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let mut ms: c_int = 200;
            let mut fds = vec![libc::pollfd { fd: self.efd, events: libc::POLLIN, revents: 0 }];
            self.settle_pending(&mut fds, &mut ms);
            let mut watched = Vec::new();
            let mut finished = Vec::new();
            let now = Instant::now();
            for b in &list {
                let key = Arc::as_ptr(b) as usize;
                let timer_due = due.get(&key).is_none_or(|t| *t <= now);
                if rung || timer_due || readable.contains(&key) {
                    let mut st = b.st.lock().unwrap_or_else(|e| e.into_inner());
                    if b.pump(&mut st) {
                        finished.push(b.clone());
                        due.remove(&key);
                        continue;
                    }
                    let t = Bridge::timer_ms(&st).unwrap_or(200);
                    due.insert(key, now + Duration::from_millis(t as u64));
                }
                if let Some(t) = due.get(&key) {
                    ms = ms.min(t.saturating_duration_since(now).as_millis() as c_int);
                }
                // Nobody drives it inline (the program is busy elsewhere, or a forked
                // child uses the connection): writes to its ring ring us.
                let shared = b.shm.word(crate::conn::off_holders(b.side)).load(Ordering::Relaxed) > 1;
                if shared || !b.driven_inline() {
                    b.w(b.side, RSLEEP).store(1, Ordering::Relaxed);
                }
                if b.driven_inline() {
                    ms = ms.min(INLINE_GRACE_MS as c_int);
                } else {
                    fds.push(libc::pollfd { fd: b.link_fd, events: libc::POLLIN, revents: 0 });
                    watched.push(key);
                }
            }
            if !finished.is_empty() {
                let mut g = self.bridges.lock().unwrap_or_else(|e| e.into_inner());
                g.retain(|b| !finished.iter().any(|f| Arc::ptr_eq(f, b)));
                for f in &finished {
                    f.retired.store(true, Ordering::Relaxed);
                }
            }
            // SAFETY: a vector of pollfds and its length.
            unsafe { real::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            rung = fds[0].revents != 0;
            if rung {
                crate::sock::drain_eventfd(self.efd);
            }
            // The pollfds after the eventfd and the pending connections' are the
            // watched bridges', in order.
            let first = fds.len() - watched.len();
            readable =
                watched.iter().zip(&fds[first..]).filter(|(_, p)| p.revents != 0).map(|(k, _)| *k).collect();
        }
    }
}

/// At exit: what the program wrote still reaches the peer (as the kernel would send
/// it after the process is gone), bounded by `STRAIT_LINGER_MS` (default 2000).
pub fn at_exit() {
    end_bridges();
}

/// Closes every connection this process bridges and sends what they hold (at most
/// `STRAIT_LINGER_MS`): at exit, and before an exec (the bridges live in this
/// program's memory).
pub fn end_bridges() {
    if !enabled() {
        return;
    }
    let Some(bg) = existing_background() else { return };
    let list: Vec<Arc<Bridge>> = bg.bridges.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if list.is_empty() {
        return;
    }
    let linger = std::env::var("STRAIT_LINGER_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000u64);
    let deadline = Instant::now() + Duration::from_millis(linger);
    for b in &list {
        // The program is going: its ends close now (read side first, as in
        // `Conn::release`).
        b.w(1 - b.side, RCLOSED).store(1, Ordering::Release);
        b.w(b.side, WCLOSED).store(1, Ordering::Release);
    }
    let mut left = list;
    while !left.is_empty() && Instant::now() < deadline {
        left.retain(|b| {
            let mut st = b.st.lock().unwrap_or_else(|e| e.into_inner());
            !b.pump(&mut st)
        });
        let mut fds: Vec<libc::pollfd> =
            left.iter().map(|b| libc::pollfd { fd: b.link_fd, events: libc::POLLIN, revents: 0 }).collect();
        // SAFETY: a vector of pollfds and its length.
        unsafe { real::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1) };
    }
}

/// In a forked child: refresh the cached process id (the bridges stay the parent's:
/// the child's reads and writes go through the rings, which the parent drives).
pub fn after_fork_child() {
    strait_sys::forget_pid();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse_and_match() {
        let nets = parse_peers("10.0.0.2, 192.168.1.0/24 fd00::/64").unwrap();
        let p = Peers { nets };
        let has = |a: &str| {
            let ip: std::net::IpAddr = a.parse().unwrap();
            let k = match ip {
                std::net::IpAddr::V4(v) => v.to_ipv6_mapped().octets(),
                std::net::IpAddr::V6(v) => v.octets(),
            };
            p.nets.iter().any(|(n, b)| in_net(&k, n, *b))
        };
        assert!(has("10.0.0.2"));
        assert!(!has("10.0.0.3"));
        assert!(has("192.168.1.77"));
        assert!(!has("192.168.2.1"));
        assert!(has("fd00::1234"));
        assert!(!has("fd01::1"));
        assert!(parse_peers("10.0.0.0/33").is_err());
        assert!(parse_peers("host.example").is_err());
        assert!(parse_peers("").unwrap().is_empty());
    }

    #[test]
    fn messages_round_trip_and_reject_garbage() {
        // (No secret in the unit tests' environment.)
        let m = message(KIND_OFFER, 0x1234_5678_9abc_def0, 77, 4242, 80, None, None);
        let want = Message {
            kind: KIND_OFFER,
            nonce: 0x1234_5678_9abc_def0,
            echo: 77,
            ports: (4242, 80),
            xdp: None,
            auth: Auth::Plain,
        };
        assert_eq!(parse_message(&m), Some(want));
        let x = message(KIND_OFFER, 7, 8, 1, 2, Some((Mac([1, 2, 3, 4, 5, 6]), 99)), None);
        assert_eq!(parse_message(&x).and_then(|m| m.xdp), Some((Mac([1, 2, 3, 4, 5, 6]), 99)));
        assert_eq!(parse_message(&m[..MSG_LEN - 1]), None);
        let mut bad = m;
        bad[0] ^= 1;
        assert_eq!(parse_message(&bad), None);
        // A tagged message, to a host without the secret: not authentic.
        let k = PacketKey::new(b"0123456789abcdef");
        let t = message(KIND_OFFER, 1, 2, 3, 4, None, Some(&k));
        assert_eq!(parse_message(&t).map(|m| m.auth), Some(Auth::Bad));
        assert!(!auth_matches(Auth::Bad) && auth_matches(Auth::Plain));
    }
}
