//! The socket-semantics scenarios of `preload.rs`, between two hosts: the server in
//! one network namespace, the client in another (a veth pair the test creates and
//! removes), both naming the other's subnet in `STRAIT_PEERS`, so that the
//! connection rides the reliable udp device. Needs root (namespaces).

use std::process::Command;
use std::time::{Duration, Instant};

use strait_udp::netns::VethPair;

const PEER: &str = env!("CARGO_BIN_EXE_strait-preload-peer");
const TIMEOUT: Duration = Duration::from_secs(40);

mod common;
use common::{check, finish, spawn_lines, Out};

/// The peer in namespace `i` of `pair`, with the library if `preload`.
fn cmd(pair: &VethPair, i: usize, preload: bool, args: &[&str]) -> Command {
    let mut c = pair.command(i);
    c.env_remove("LD_PRELOAD").env("STRAIT_STATS", "1").env("PEER_ADDR", pair.v4[0].to_string());
    c.env("STRAIT_PEERS", pair.subnet_v4());
    if preload {
        // Through env(1), so that `ip` itself runs without the library.
        c.arg("env").arg(format!("LD_PRELOAD={}", common::lib(PEER).display()));
    }
    c.arg(PEER).args(args);
    c
}

/// A server of `smode` in namespace 0 and a client of `cmode` in namespace 1, with
/// `env` for the client.
fn pair_env(sp: bool, cp: bool, smode: &str, cmode: &str, env: &[(&str, &str)]) -> (Out, Out) {
    pair_envs(sp, cp, smode, cmode, &[], env)
}

/// As [`pair_env`], with `senv` for the server too.
fn pair_envs(
    sp: bool,
    cp: bool,
    smode: &str,
    cmode: &str,
    senv: &[(&str, &str)],
    env: &[(&str, &str)],
) -> (Out, Out) {
    let pair = VethPair::create().expect("create namespaces (needs root)");
    let deadline = Instant::now() + TIMEOUT;
    let mut sc = cmd(&pair, 0, sp, &["server", smode]);
    sc.envs(senv.iter().copied());
    let (server, srx) = spawn_lines(&mut sc);
    let first = srx.recv_timeout(Duration::from_secs(10)).expect("server printed its port");
    let port = first.trim().strip_prefix("PORT ").expect("PORT line").to_string();
    let mut c = cmd(&pair, 1, cp, &["client", &port, cmode]);
    c.envs(env.iter().copied());
    let (client, crx) = spawn_lines(&mut c);
    let c = finish(client, crx, String::new(), deadline);
    let s = finish(server, srx, first, deadline);
    (s, c)
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
        let (s, c) = pair("echo", cmode);
        check(&s, "server");
        check(&c, "client");
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
    let (s, c) = pair("flags", "flags");
    check(&s, "server");
    check(&c, "client");
    assert!(s.stdout.contains("flags ok"), "{}", s.stdout);
    let filled: usize =
        s.stdout.lines().find_map(|l| l.strip_prefix("filled ")?.parse().ok()).expect("filled");
    assert!(c.stdout.contains(&format!("drained {filled}")), "{}", c.stdout);
    assert_eq!(remote(&s), 1);

    let (s, c) = pair("signals", "signals");
    check(&s, "server");
    check(&c, "client");
    assert!(s.stdout.contains("signals ok"), "{}", s.stdout);
    assert_eq!(remote(&s), 1);

    let (s, c) = pair("extras", "extras");
    check(&s, "server");
    check(&c, "client");
    assert!(
        s.stdout.contains("extras ok") && c.stdout.contains("extras client ok"),
        "{}{}",
        s.stdout,
        c.stdout
    );
    assert_eq!(remote(&s), 1);
}

#[test]
fn many_connections_on_many_threads_between_hosts() {
    let (s, c) = pair("threads", "threads");
    check(&s, "server");
    check(&c, "client");
    assert!(c.stdout.contains("threads client ok") && c.stdout.contains("maps strait"), "{}", c.stdout);
    assert_eq!(remote(&s), 8, "{}", s.stderr);
    assert_eq!(remote(&c), 8, "{}", c.stderr);
}

#[test]
fn a_forked_child_keeps_the_connection_and_a_late_accept_uses_the_kernel() {
    let (s, c) = pair("fork", "fork");
    check(&s, "server");
    check(&c, "client");
    assert!(c.stdout.contains("fork ok") && c.stdout.contains("maps strait"), "{}", c.stdout);

    // The server accepts only after the client stopped waiting for an offer (300
    // ms): the connection stays on the kernel, exact bytes, no stray confirmation.
    let (s, c) = pair_env(true, true, "lateaccept", "echo", &[("STRAIT_ATTACH_TIMEOUT_MS", "300")]);
    check(&s, "server");
    check(&c, "client");
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
        check(&s, mode);
        check(&c, mode);
        assert!(c.stdout.contains("echo ok 1734389"), "{mode}: {}", c.stdout);
        assert!(
            s.stdout.contains("adopted ok") && s.stdout.contains("echoed 1734389"),
            "{mode}: {}",
            s.stdout
        );
        assert_eq!(common::stat_sum(&s, "inherited"), 1, "{mode}: {}", s.stderr);
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
        let (s, c) = pair_env(sp, cp, "sink", "source67108864", &[]);
        check(&s, "server");
        check(&c, "client");
        let sent = c.stdout.lines().find(|l| l.starts_with("sent ")).expect("sent").replace("sent ", "");
        let got =
            s.stdout.lines().find(|l| l.starts_with("received ")).expect("received").replace("received ", "");
        assert_eq!(sent, got, "server preloaded: {sp}, client preloaded: {cp}");
        let preloaded = if cp { &c } else { &s };
        assert_eq!(remote(preloaded), carried, "{}", preloaded.stderr);
    }
}

#[test]
fn prefork_workers_sharing_a_listener_all_attach_between_hosts() {
    // nginx's pattern: workers forked from the listening process accept; each offers
    // for the connections it accepted itself.
    let (s, c) = pair("prefork", "prefork");
    check(&s, "server");
    check(&c, "client");
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
    for (smode, cmode, conns) in
        [("flags", "flags", 1), ("threads", "threads", 8), ("sink", "source67108864", 1)]
    {
        let (s, c) = pair_envs(true, true, smode, cmode, &xdp, &xdp);
        check(&s, "server");
        check(&c, "client");
        assert_eq!(remote_xdp(&c), conns, "{smode}: {}", c.stderr);
        assert_eq!(remote_xdp(&s), conns, "{smode}: {}", s.stderr);
        if smode == "sink" {
            let sent = c.stdout.lines().find(|l| l.starts_with("sent ")).expect("sent").replace("sent ", "");
            let got = s
                .stdout
                .lines()
                .find(|l| l.starts_with("received "))
                .expect("received")
                .replace("received ", "");
            assert_eq!(sent, got);
        }
    }
}
