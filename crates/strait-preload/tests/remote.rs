//! The socket-semantics scenarios of `preload.rs`, between two hosts: the server in
//! one network namespace, the client in another (a veth pair the test creates and
//! removes), both naming the other's subnet in `STRAIT_PEERS`, so that the
//! connection rides the reliable udp device. Needs root (namespaces).

use std::process::Command;
use std::time::{Duration, Instant};

use strait_udp::netns::VethPair;

const TIMEOUT: Duration = Duration::from_secs(40);

mod common;
use common::{check, checked, finish, sent_and_received, spawn_lines, Env, Out, Server};

/// The peer in namespace `i` of `pair`, with the library if `preload`.
fn cmd(pair: &VethPair, i: usize, preload: bool, args: &[&str]) -> Command {
    let mut c = pair.command(i);
    c.env_remove("LD_PRELOAD").env("STRAIT_STATS", "1").env("PEER_ADDR", pair.v4[0].to_string());
    c.env("STRAIT_PEERS", pair.subnet_v4());
    let peer = common::tcp_peer();
    if preload {
        // Through env(1), so that `ip` itself runs without the library.
        c.arg("env").arg(format!("LD_PRELOAD={}", common::lib(&peer).display()));
    }
    c.arg(peer).args(args);
    c
}

/// A server of `smode` in namespace 0 and a client of `cmode` in namespace 1, with
/// `env` for the client.
fn pair_env(sp: bool, cp: bool, smode: &str, cmode: &str, env: Env) -> (Out, Out) {
    pair_envs(sp, cp, smode, cmode, &[], env)
}

/// As [`pair_env`], with `senv` for the server too.
fn pair_envs(sp: bool, cp: bool, smode: &str, cmode: &str, senv: Env, env: Env) -> (Out, Out) {
    let pair = VethPair::create().expect("create namespaces (needs root)");
    let deadline = Instant::now() + TIMEOUT;
    common::run_modes(|i, args| cmd(&pair, i, [sp, cp][i], args), [smode, cmode], [senv, env], deadline)
}

fn pair(smode: &str, cmode: &str) -> (Out, Out) {
    pair_env(true, true, smode, cmode, &[])
}

/// Connections to the other host carried by strait (the `remote` count of the
/// statistics lines).
fn remote(o: &Out) -> usize {
    common::stat_sum(o, "remote")
}

#[test]
fn stream_of_many_sizes_and_nonblocking_connect_between_hosts() {
    for cmode in ["echo", "nbconnect"] {
        let (s, c) = checked(pair("echo", cmode));
        assert!(c.stdout.contains("echo ok 1734389") && c.stdout.contains("maps strait"), "{}", c.stdout);
        assert!(s.stdout.contains("echoed 1734389"), "{}", s.stdout);
        // No memfd stays open once the connection is set up.
        assert!(s.stdout.contains("fds clean") && c.stdout.contains("fds clean"), "{}{}", s.stdout, c.stdout);
        assert_eq!(remote(&s), 1, "{}", s.stderr);
        assert_eq!(remote(&c), 1, "{}", c.stderr);
    }
}

#[test]
fn flags_poll_epoll_select_signals_and_extras_between_hosts() {
    let (s, c) = checked(pair("flags", "flags"));
    assert!(s.stdout.contains("flags ok"), "{}", s.stdout);
    let filled: usize =
        s.stdout.lines().find_map(|l| l.strip_prefix("filled ")?.parse().ok()).expect("filled");
    assert!(c.stdout.contains(&format!("drained {filled}")), "{}", c.stdout);
    assert_eq!(remote(&s), 1);

    let (s, _) = checked(pair("signals", "signals"));
    assert!(s.stdout.contains("signals ok"), "{}", s.stdout);
    assert_eq!(remote(&s), 1);

    let (s, c) = checked(pair("extras", "extras"));
    common::check_extras(&s, &c);
    assert_eq!(remote(&s), 1);
}

#[test]
fn many_connections_on_many_threads_between_hosts() {
    let (s, c) = checked(pair("threads", "threads"));
    assert!(c.stdout.contains("threads client ok") && c.stdout.contains("maps strait"), "{}", c.stdout);
    assert_eq!(remote(&s), 8, "{}", s.stderr);
    assert_eq!(remote(&c), 8, "{}", c.stderr);
}

/// 64 connections on the udp device, one epoll loop at each end: every echo
/// intact, no wake-up lost.
#[test]
fn many_connections_in_one_epoll_loop_between_hosts() {
    let (s, c) = checked(pair("many64", "many64"));
    assert!(c.stdout.contains("many client ok") && c.stdout.contains("maps strait"), "{}", c.stdout);
    assert_eq!(remote(&s), 64, "{}", s.stderr);
    assert_eq!(remote(&c), 64, "{}", c.stderr);
}

#[test]
fn a_forked_child_keeps_the_connection_and_a_late_accept_uses_the_kernel() {
    let (_, c) = checked(pair("fork", "fork"));
    assert!(c.stdout.contains("fork ok") && c.stdout.contains("maps strait"), "{}", c.stdout);

    // The server accepts only after the client stopped waiting for an offer (300
    // ms): the connection stays on the kernel, exact bytes, no stray confirmation.
    let (_, c) = checked(pair_env(true, true, "lateaccept", "echo", &[("STRAIT_ATTACH_TIMEOUT_MS", "300")]));
    assert!(c.stdout.contains("echo ok 1734389") && c.stdout.contains("maps kernel"), "{}", c.stdout);
    assert_eq!(remote(&c), 0, "{}", c.stderr);
    assert!(c.stderr.contains("kernel-fallback 1"), "{}", c.stderr);
}

#[test]
fn a_program_a_child_execs_or_spawns_keeps_the_connection_between_hosts() {
    // The child (vfork + exec, posix_spawn) takes the rings over; the bridge stays
    // with the parent, which drives it for the new program.
    for mode in ["vfork", "spawn", "spawn-actions"] {
        let (s, c) = pair(mode, "echo");
        common::check_adopted(&s, &c, mode);
        assert_eq!(remote(&c), 1, "{mode}: {}", c.stderr);
    }
    // The process that bridges the connection execs: the bridge goes with its
    // memory, so the connection ends there (the client sees it end, no hang) and the
    // new program reads end of stream from the shut socket.
    let t = Instant::now();
    let (s, c) = pair("exec-v", "echo");
    check(&s, "exec-v");
    assert!(s.stdout.contains("adopted ok") && s.stdout.contains("echoed 0"), "{}", s.stdout);
    assert!(!c.ok, "the client cannot have had its echo: {}", c.stdout);
    assert!(t.elapsed() < Duration::from_secs(20), "took {:?}", t.elapsed());
}

#[test]
fn peer_death_between_hosts_ends_the_stream_promptly() {
    let t = Instant::now();
    let (s, c) = pair_env(true, true, "die", "die", &[]);
    assert!(!c.ok, "the client kills itself");
    check(&s, "server");
    assert!(s.stdout.contains("peer gone"), "{}", s.stdout);
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    assert_eq!(remote(&s), 1);
}

#[test]
fn large_transfers_between_hosts_arrive_intact_with_or_without_strait_at_each_end() {
    for (sp, cp, carried) in [(true, true, 1), (true, false, 0), (false, true, 0)] {
        let (s, c) = checked(pair_env(sp, cp, "sink", "source67108864", &[]));
        let (sent, got) = sent_and_received(&s, &c);
        assert_eq!(sent, got, "server preloaded: {sp}, client preloaded: {cp}");
        let preloaded = if cp { &c } else { &s };
        assert_eq!(remote(preloaded), carried, "{}", preloaded.stderr);
    }
}

#[test]
fn prefork_workers_sharing_a_listener_all_attach_between_hosts() {
    // nginx's pattern: workers forked from the listening process accept; each offers
    // for the connections it accepted itself.
    let (s, c) = checked(pair("prefork", "prefork"));
    assert!(s.stdout.contains("prefork server ok"), "{}", s.stdout);
    assert_eq!(remote(&c), 8, "{}", c.stderr);
    assert!(c.stderr.contains("kernel-fallback 0"), "{}", c.stderr);
    assert_eq!(remote(&s), 8, "{}", s.stderr);
}

/// Connections on the xdp device (`remote-xdp` of the statistics lines).
fn remote_xdp(o: &Out) -> usize {
    common::stat_sum(o, "remote-xdp")
}

#[test]
fn semantics_and_large_transfers_over_the_xdp_device() {
    let xdp = [("STRAIT_XDP", "1")];
    for (smode, cmode, conns) in [
        ("flags", "flags", 1),
        ("threads", "threads", 8),
        ("many64", "many64", 64),
        ("sink", "source67108864", 1),
    ] {
        let (s, c) = checked(pair_envs(true, true, smode, cmode, &xdp, &xdp));
        assert_eq!(remote_xdp(&c), conns, "{smode}: {}", c.stderr);
        assert_eq!(remote_xdp(&s), conns, "{smode}: {}", s.stderr);
        if smode == "sink" {
            let (sent, got) = sent_and_received(&s, &c);
            assert_eq!(sent, got);
        }
    }
}

// ------------------------------------------------------------------ trust

/// The discovery wire format, as a forger (or a test playing the connector by hand)
/// writes it: see `remote.rs`.
mod wire {
    pub const MSG_LEN: usize = 64;

    fn msg(kind: u8, nonce: u64, echo: u64, cport: u16, lport: u16) -> [u8; MSG_LEN] {
        let mut m = [0u8; MSG_LEN];
        m[0..8].copy_from_slice(b"SRTTRV02");
        m[8] = kind;
        m[16..24].copy_from_slice(&nonce.to_le_bytes());
        m[24..26].copy_from_slice(&cport.to_le_bytes());
        m[26..28].copy_from_slice(&lport.to_le_bytes());
        m[40..48].copy_from_slice(&echo.to_le_bytes());
        m
    }

    pub fn hello(nonce: u64, cport: u16, lport: u16) -> [u8; MSG_LEN] {
        msg(1, nonce, 0, cport, lport)
    }

    pub fn offer(nonce: u64, echo: u64, cport: u16, lport: u16) -> [u8; MSG_LEN] {
        msg(2, nonce, echo, cport, lport)
    }

    /// An offer: (acceptor's nonce, echo).
    pub fn parse_offer(m: &[u8]) -> Option<(u64, u64)> {
        (m.len() == MSG_LEN && &m[0..8] == b"SRTTRV02" && m[8] == 2).then(|| {
            (
                u64::from_le_bytes(m[16..24].try_into().unwrap()),
                u64::from_le_bytes(m[40..48].try_into().unwrap()),
            )
        })
    }

    /// The connector's GO on the TCP connection (no secret).
    pub fn go(anonce: u64, cnonce: u64) -> Vec<u8> {
        let mut m = vec![0u8; 64];
        m[0..8].copy_from_slice(b"STRAITGO");
        m[8..16].copy_from_slice(&anonce.to_le_bytes());
        m[32..40].copy_from_slice(&cnonce.to_le_bytes());
        m
    }

    pub fn random() -> u64 {
        let mut v = [0u8; 8];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut v))
            .unwrap();
        u64::from_le_bytes(v)
    }
}

/// A server of `mode` under the library in namespace 0 of `pair`, with `env`; its
/// TCP port.
fn server_in(
    pair: &VethPair,
    mode: &str,
    env: &[(&str, &str)],
) -> (std::process::Child, std::sync::mpsc::Receiver<String>, String, u16) {
    let mut sc = cmd(pair, 0, true, &["server", mode]);
    sc.envs(env.iter().copied());
    let s = Server::start(&mut sc);
    let port = s.port.parse().expect("port");
    (s.child, s.lines, s.first, port)
}

/// An off-path or local forger on the server's host: from another UDP port of the
/// server's address, it sends OFFERs for the client's connection (the client's
/// ports are pinned so the forger knows them; the server accepts late, so the
/// forgeries always come first). The client ignores them all (they cannot echo the
/// nonce of its HELLO): its stream reaches the real server intact, carried by
/// strait.
#[test]
fn a_forged_offer_from_another_port_of_the_server_is_ignored() {
    let pair = VethPair::create().expect("create namespaces (needs root)");
    pair.exec(1, &["sh", "-c", "echo 45000 45001 > /proc/sys/net/ipv4/ip_local_port_range"]).expect("ports");
    let deadline = Instant::now() + TIMEOUT;
    let (server, srx, first, lport) = server_in(&pair, "slowaccept", &[]);
    let forger = pair.udp_socket(0, false, 0).expect("forger socket");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let client_ip = pair.v4[1];
    let spray = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for p in [45000u16, 45001] {
                    let m = wire::offer(wire::random(), wire::random(), p, lport);
                    if forger.send_to(&m, (client_ip, p)).is_ok() {
                        sent += 1;
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            sent
        })
    };
    let mut c = cmd(&pair, 1, true, &["client", &lport.to_string(), "echo"]);
    let (client, crx) = spawn_lines(&mut c);
    let c = finish(client, crx, String::new(), deadline);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = spray.join().expect("forger");
    let s = finish(server, srx, first, deadline);
    check(&c, "client");
    check(&s, "server");
    assert!(sent > 50, "the forger sent {sent} offers");
    assert!(c.stdout.contains("echo ok 1734389") && c.stdout.contains("maps strait"), "{}", c.stdout);
    assert!(s.stdout.contains("echoed 1734389"), "{}", s.stdout);
    assert_eq!(remote(&c), 1, "{}", c.stderr);
    assert_eq!(remote(&s), 1, "{}", s.stderr);
    assert!(common::stat_sum(&c, "remote-forged") > 0, "{}", c.stderr);
}

/// Plays a connector by hand from namespace 1: a TCP socket bound to a port `p`, a
/// UDP socket on `p`, a HELLO with nonce `cnonce` to the listener's marker, the TCP
/// connect, and the acceptor's offer. Returns the connection and the acceptor's
/// nonce.
fn hand_connector(pair: &VethPair, lport: u16, cnonce: u64) -> (std::net::TcpStream, u64) {
    use std::os::fd::FromRawFd;
    let (server, client) = (pair.v4[0], pair.v4[1]);
    pair.in_ns(1, move || {
        // SAFETY: a fresh socket, bound and connected through plain syscalls on
        // local sockaddrs; then owned by the TcpStream.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0);
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from_ne_bytes(client.octets());
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            assert_eq!(libc::bind(fd, (&sa as *const libc::sockaddr_in).cast(), len), 0);
            let mut got = sa;
            let mut l = len;
            assert_eq!(libc::getsockname(fd, (&mut got as *mut libc::sockaddr_in).cast(), &mut l), 0);
            let p = u16::from_be(got.sin_port);
            let udp = std::net::UdpSocket::bind((client, p)).expect("udp on the tcp port");
            udp.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
            let probe = std::net::UdpSocket::bind((client, 0)).expect("probe");
            probe.send_to(&wire::hello(cnonce, p, lport), (server, lport)).expect("hello");
            let mut to = sa;
            to.sin_port = lport.to_be();
            to.sin_addr.s_addr = u32::from_ne_bytes(server.octets());
            assert_eq!(libc::connect(fd, (&to as *const libc::sockaddr_in).cast(), len), 0);
            let stream = std::net::TcpStream::from_raw_fd(fd);
            let end = Instant::now() + Duration::from_secs(3);
            let mut buf = [0u8; 128];
            loop {
                assert!(Instant::now() < end, "no offer");
                if let Ok(n) = udp.recv(&mut buf) {
                    if let Some((anonce, echo)) = wire::parse_offer(&buf[..n]) {
                        assert_eq!(echo, cnonce, "the offer echoes our nonce");
                        return (stream, anonce);
                    }
                }
            }
        }
    })
    .expect("namespace")
}

/// Plays a connector by hand from namespace 1 the way the library connects an
/// unbound socket: the TCP connect first (the kernel picks the port `p`), then,
/// `late` afterwards, a UDP socket on `p` and a HELLO from it to the listener's
/// marker. Returns the connection and the acceptor's offer (its nonce), if one came
/// within 3 s.
fn late_hello_connector(
    pair: &VethPair,
    lport: u16,
    cnonce: u64,
    late: Duration,
) -> (std::net::TcpStream, Option<u64>) {
    let (server, client) = (pair.v4[0], pair.v4[1]);
    pair.in_ns(1, move || {
        let stream = std::net::TcpStream::connect((server, lport)).expect("connect");
        let p = stream.local_addr().expect("local address").port();
        std::thread::sleep(late);
        let udp = std::net::UdpSocket::bind((client, p)).expect("udp on the tcp port");
        udp.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
        udp.send_to(&wire::hello(cnonce, p, lport), (server, lport)).expect("hello");
        let end = Instant::now() + Duration::from_secs(3);
        let mut buf = [0u8; 128];
        while Instant::now() < end {
            if let Ok(n) = udp.recv(&mut buf) {
                if let Some((anonce, echo)) = wire::parse_offer(&buf[..n]) {
                    assert_eq!(echo, cnonce, "the offer echoes our nonce");
                    return (stream, Some(anonce));
                }
            }
        }
        (stream, None)
    })
    .expect("namespace")
}

/// ICMP destination-unreachable messages namespace `i` of `pair` has sent
/// (`OutDestUnreachs` of `/proc/net/snmp`).
fn icmp_unreachables_sent(pair: &VethPair, i: usize) -> u64 {
    let o = pair.exec(i, &["cat", "/proc/net/snmp"]).expect("snmp");
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    let mut icmp = text.lines().filter(|l| l.starts_with("Icmp:"));
    let (names, values) = (icmp.next().expect("Icmp names"), icmp.next().expect("Icmp values"));
    let col = names.split_whitespace().position(|n| n == "OutDestUnreachs").expect("OutDestUnreachs");
    values.split_whitespace().nth(col).and_then(|v| v.parse().ok()).expect("count")
}

/// The connector sends its HELLO once its connect picked the port, so the acceptor
/// may accept and probe that port before the connector's UDP socket is there: the
/// ICMP error that probe draws does not end the attempt, and the HELLO that comes
/// after it is answered with an offer. (Then the connector writes plain bytes: the
/// connection stays on the kernel, every byte echoed.) Only a round whose probe
/// drew the error counts (the kernel may not send one when it is rate limited):
/// up to five rounds.
#[test]
fn a_hello_after_the_accept_and_its_probe_still_gets_an_offer() {
    let pair = VethPair::create().expect("create namespaces (needs root)");
    let mut drawn = 0;
    for _ in 0..5 {
        let deadline = Instant::now() + TIMEOUT;
        let icmp = icmp_unreachables_sent(&pair, 1);
        let (server, srx, first, lport) = server_in(&pair, "echo", &[]);
        let c = wire::random();
        // Long enough for the acceptor to have probed the port and seen the error
        // (its program reads at once: within a millisecond), short of the 20 ms
        // after which its next probe decides.
        let (s, offer) = late_hello_connector(&pair, lport, c, Duration::from_millis(12));
        let probe_refused = icmp_unreachables_sent(&pair, 1) > icmp;
        echo_exactly(s, b"");
        let s = finish(server, srx, first, deadline);
        check(&s, "server");
        assert!(s.stdout.contains(&format!("echoed {}", 65_536)), "{}", s.stdout);
        assert_eq!(remote(&s), 0, "{}", s.stderr);
        if probe_refused {
            assert!(offer.is_some(), "no offer for a HELLO that came after the accept and the probe's error");
            drawn += 1;
            break;
        }
    }
    assert!(drawn > 0, "no round's probe drew an ICMP error");
}

/// Writes `first` then a pattern to `s`, ends the stream, and checks the echo
/// returns exactly that.
fn echo_exactly(mut s: std::net::TcpStream, first: &[u8]) {
    use std::io::{Read, Write};
    let mut sent = first.to_vec();
    sent.extend((0..65_536u32).map(|i| (i * 7 + 3) as u8));
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.write_all(&sent).expect("write");
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut back = Vec::new();
    s.read_to_end(&mut back).expect("echo");
    assert!(back == sent, "echo of {} bytes differs from the {} sent", back.len(), sent.len());
}

/// GO is only taken with this connection's nonces. A GO with a guessed acceptor
/// nonce (an off-path forger, or a program that is not strait whose data happen to
/// start with "STRAITGO"), a GO replayed from an earlier connection, and a GO with
/// the right acceptor nonce but not the connector's are all left to the program:
/// the server reads them as the bytes they are, the connection stays on the kernel.
#[test]
fn a_forged_or_replayed_go_is_rejected() {
    let pair = VethPair::create().expect("create namespaces (needs root)");
    let deadline = Instant::now() + TIMEOUT;
    // An earlier connection whose GO an on-path attacker recorded.
    let (old_a, old_c) = {
        let (server, srx, first, lport) = server_in(&pair, "echo", &[]);
        let c = wire::random();
        let (s, a) = hand_connector(&pair, lport, c);
        echo_exactly(s, b"");
        let _ = finish(server, srx, first, deadline);
        (a, c)
    };
    type Go = Box<dyn Fn(u64, u64) -> Vec<u8>>;
    let cases: [(&str, Go); 3] = [
        ("guessed", Box::new(|_, c| wire::go(wire::random(), c))),
        ("replayed", Box::new(move |_, _| wire::go(old_a, old_c))),
        ("without the connector's nonce", Box::new(|a, _| wire::go(a, wire::random()))),
    ];
    for (what, go) in cases {
        let (server, srx, first, lport) = server_in(&pair, "echo", &[]);
        let c = wire::random();
        let (s, a) = hand_connector(&pair, lport, c);
        echo_exactly(s, &go(a, c));
        let s = finish(server, srx, first, deadline);
        check(&s, what);
        assert!(s.stdout.contains(&format!("echoed {}", 64 + 65_536)), "{what}: {}", s.stdout);
        assert_eq!(remote(&s), 0, "{what}: {}", s.stderr);
        if what == "without the connector's nonce" {
            assert_eq!(common::stat_sum(&s, "remote-forged"), 1, "{what}: {}", s.stderr);
        }
    }
}

/// A secret file of `body`, mode 600, in a fresh directory.
fn secret_file(name: &str, body: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("strait-remote-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let p = dir.join(name);
    std::fs::write(&p, body).expect("write");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    p.display().to_string()
}

/// With the same secret at both ends the connection is carried by strait and every
/// byte arrives (hashed); with a secret at one end only, or different secrets, the
/// peer is refused and the kernel carries every byte; an unusable secret file is
/// reported by the variable's name and nothing is carried by strait.
#[test]
fn a_shared_secret_authenticates_and_a_missing_or_different_one_is_refused() {
    let one = secret_file("one", "correct horse battery staple 1\n");
    let two = secret_file("two", "correct horse battery staple 2\n");
    let open = secret_file("open", "correct horse battery staple 1\n");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    }
    let var = "STRAIT_PEERS_SECRET_FILE";
    let cases: [(&str, Option<&str>, Option<&str>, usize); 5] = [
        ("same secret", Some(&one), Some(&one), 1),
        ("server only", Some(&one), None, 0),
        ("client only", None, Some(&one), 0),
        ("different secrets", Some(&one), Some(&two), 0),
        ("unusable secret file", Some(&open), Some(&open), 0),
    ];
    for (what, sec_s, sec_c, carried) in cases {
        let t = Instant::now();
        let senv: Vec<(&str, &str)> = sec_s.map(|f| (var, f)).into_iter().collect();
        let cenv: Vec<(&str, &str)> = sec_c.map(|f| (var, f)).into_iter().collect();
        let (s, c) = pair_envs(true, true, "sink", "source16777216", &senv, &cenv);
        check(&s, what);
        check(&c, what);
        let (sent, got) = sent_and_received(&s, &c);
        assert_eq!(sent, got, "{what}");
        assert_eq!(remote(&s), carried, "{what}: {}", s.stderr);
        assert_eq!(remote(&c), carried, "{what}: {}", c.stderr);
        if carried == 0 && what != "unusable secret file" {
            let refused = common::stat_sum(&s, "remote-refused") + common::stat_sum(&c, "remote-refused");
            assert!(refused >= 1, "{what}: {}{}", s.stderr, c.stderr);
        }
        if what == "unusable secret file" {
            assert!(
                s.stderr.contains("STRAIT_PEERS_SECRET_FILE=") && s.stderr.contains("too open"),
                "{}",
                s.stderr
            );
        }
        assert!(t.elapsed() < Duration::from_secs(15), "{what}: {:?}", t.elapsed());
    }
}
