//! UDP under libstrait_preload.so: two real processes (strait-testpeers' `strait-udp-peer`),
//! each with or without the library preloaded. Every semantic check also runs with
//! neither preloaded: the kernel's loopback is the reference.

use std::process::Command;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(40);

mod common;
use common::{check, checked, finish, spawn_lines, Out, Server};

fn cmd(preload: bool, args: &[&str]) -> Command {
    common::cmd(&common::udp_peer(), preload, args)
}

/// A started server: its child, output lines, first line and port.
fn server(preload: bool, mode: &str) -> Server {
    Server::start(&mut cmd(preload, &["server", mode]))
}

fn client(preload: bool, port: &str, mode: &str, deadline: Instant) -> Out {
    let (c, rx) = spawn_lines(&mut cmd(preload, &["client", port, mode]));
    finish(c, rx, String::new(), deadline)
}

/// Runs a server and a client of `mode`; returns (server, client) output.
fn pair(sp: bool, cp: bool, mode: &str) -> (Out, Out) {
    let deadline = Instant::now() + TIMEOUT;
    let s = server(sp, mode);
    let c = client(cp, &s.port, mode, deadline);
    let s = s.finish(deadline);
    (s, c)
}

/// The `name N` count of the strait stats lines of a process (and its children).
fn stat(o: &Out, name: &str) -> usize {
    assert!(
        o.stderr.lines().any(|l| l.starts_with("strait-preload: pid ")),
        "no stats line in {:?}",
        o.stderr
    );
    common::stat_sum(o, name)
}

/// Fails the test unless each strait counter `(name, n)` of `want` sums to `n` over
/// the statistics lines of `o`.
fn expect_stats(o: &Out, want: &[(&str, usize)]) {
    for &(name, n) in want {
        assert_eq!(stat(o, name), n, "{name}: {}", o.stderr);
    }
}

#[test]
fn datagram_semantics_match_the_kernel() {
    for preload in [false, true] {
        let (s, c) = pair(preload, preload, "semantics");
        check(&s, &format!("server (preloaded: {preload})"));
        check(&c, &format!("client (preloaded: {preload})"));
        assert!(s.stdout.contains("semantics server ok") && c.stdout.contains("semantics client ok"));
        if preload {
            // Everything went through shared memory: the client's one socket to the
            // server, the server's answers, and the stranger's datagram (dropped by
            // the connected socket, as the kernel drops it).
            expect_stats(&s, &[("udp-in", 1), ("udp-out", 1)]);
            expect_stats(&c, &[("udp-out", 2), ("udp-dropped", 0)]);
            let sent = stat(&c, "udp-sent");
            assert!(sent >= 20, "{}", c.stderr);
            assert_eq!(stat(&s, "udp-received"), sent - 1, "all but the stranger's");
        }
    }
}

#[test]
fn a_sweep_of_unknown_descriptors_leaves_the_channels_working() {
    // Both ends close every descriptor they do not know after the first exchange
    // (a daemon's sweep, one close() at a time and close_range): the library's
    // markers, doorbells, Unix sockets and memfds survive, and the next 100
    // datagrams each way still go through shared memory.
    let (s, c) = checked(pair(true, true, "closeall"));
    assert!(s.stdout.contains("closeall server ok") && c.stdout.contains("closeall client ok"));
    expect_stats(&c, &[("udp-out", 1), ("udp-sent", 101)]);
    expect_stats(&s, &[("udp-sent", 101), ("udp-received", 101)]);
}

#[test]
fn many_senders_to_one_receiver_keep_their_source_addresses() {
    // Four strait senders (threads of one process) and one plain one, at once: the
    // receiver sees every datagram with its sender's port, each sender in order.
    for preload in [false, true] {
        let deadline = Instant::now() + TIMEOUT;
        let s = server(preload, "many5000");
        let port = s.port.clone();
        let plain = std::thread::spawn(move || client(false, &port, "many1x1000", deadline));
        let c = client(preload, &s.port, "many4x1000", deadline);
        let p = plain.join().expect("plain client");
        let s = s.finish(deadline);
        check(&s, "server");
        check(&c, "client");
        check(&p, "plain client");
        assert!(s.stdout.contains("many server ok 5000 from 5 sources"), "{}", s.stdout);
        if preload {
            expect_stats(&c, &[("udp-out", 4), ("udp-sent", 4000)]);
            expect_stats(&s, &[("udp-in", 4), ("udp-received", 4000)]);
        }
    }
}

/// A server under strait reads with edge-triggered epoll until EAGAIN at each edge;
/// a plain client sends bursts through the kernel (several datagrams to one edge).
/// Every datagram is read: a non-blocking receive never answers EAGAIN while a
/// datagram waits in the kernel socket that the last edge announced.
#[test]
fn edge_triggered_reads_until_eagain_strand_no_kernel_datagram() {
    let (s, c) = checked(pair(true, false, "etburst"));
    assert!(c.stdout.contains("etburst sent 1600"), "{}", c.stdout);
    assert!(s.stdout.contains("etburst received 1600"), "{}\n{}", s.stdout, s.stderr);
}

#[test]
fn a_full_receiver_drops_and_counts_like_the_kernel() {
    let (s, c) = checked(pair(true, true, "drops"));
    let received: usize =
        s.stdout.lines().find_map(|l| l.trim().strip_prefix("received ")?.parse().ok()).expect("received");
    let sent = stat(&c, "udp-sent");
    let dropped = stat(&c, "udp-dropped");
    assert_eq!(sent + dropped, 20_000, "{}", c.stderr);
    assert!(dropped > 0 && received > 0, "{}", c.stderr);
    assert_eq!(received, sent, "every datagram that went into the ring arrived");
    assert_eq!(stat(&s, "udp-received"), received);
}

#[test]
fn a_dead_receiver_never_blocks_the_sender() {
    for preload in [false, true] {
        let (s, c) = pair(preload, preload, "deadrecv");
        assert!(!s.ok, "the server kills itself");
        check(&c, "client");
        assert!(c.stdout.contains("deadrecv ok"));
        if preload {
            // The channel was used, then the sender noticed the death (at the latest
            // when the ring filled) and went back to the kernel.
            assert_eq!(stat(&c, "udp-out"), 1, "{}", c.stderr);
            assert!(stat(&c, "udp-sent") < 20_000, "{}", c.stderr);
        }
    }
}

#[test]
fn a_dead_sender_leaves_the_receiver_working() {
    for preload in [false, true] {
        let deadline = Instant::now() + TIMEOUT;
        let s = server(preload, "deadsend");
        let c = client(preload, &s.port, "deadsend", deadline);
        assert!(!c.ok, "the client kills itself");
        let n = client(preload, &s.port, "newcomer", deadline);
        check(&n, "newcomer");
        let s = s.finish(deadline);
        check(&s, "server");
        assert!(s.stdout.contains("deadsend ok"));
        if preload {
            assert_eq!(stat(&s, "udp-in"), 2, "{}", s.stderr);
        }
    }
}

#[test]
fn a_closed_receiver_sends_the_connected_sender_to_the_kernel() {
    // As over the kernel: the send after the close succeeds, the port-unreachable
    // answer then fails the connected socket's receive with ECONNREFUSED.
    for preload in [false, true] {
        let (_, c) = checked(pair(preload, preload, "closed"));
        assert!(c.stdout.contains("closed client ok"), "{}", c.stdout);
        if preload {
            expect_stats(&c, &[("udp-out", 1), ("udp-sent", 1)]);
        }
    }
}

#[test]
fn a_forked_child_shares_the_socket() {
    for preload in [false, true] {
        let (s, c) = checked(pair(preload, preload, "fork"));
        assert!(s.stdout.contains("fork server ok") && c.stdout.contains("fork client ok"));
        if preload {
            // The child attached the client's ring and answered through shared
            // memory; at its exit the client offered the same ring again and the
            // parent (holding the socket too) took it: both datagrams went through
            // shared memory, both answers too.
            expect_stats(&s, &[("udp-in", 2), ("udp-received", 2)]);
            expect_stats(&c, &[("udp-out", 1), ("udp-sent", 2), ("udp-received", 2)]);
        }
    }
}

#[test]
fn threads_sharing_a_socket_take_every_datagram_once_and_keep_the_channel() {
    // Four receiving threads race for the datagrams of one ring: each datagram
    // whole and once, none lost beyond the drops counted at a full ring. (The two
    // position races the models found, models/README.md, hit a window of a few
    // instructions: this run is not known to reproduce them; the loom and spin
    // models are their regression tests.)
    let (s, c) = checked(pair(true, true, "shared"));
    let got: usize = s
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("shared server ok "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count in {:?}", s.stdout));
    assert_eq!(stat(&c, "udp-out"), 1, "{}", c.stderr);
    assert_eq!(stat(&s, "udp-in"), 1, "{}", s.stderr);
    // Every datagram either arrived (exactly once: the server checked) or was
    // counted as dropped at a full ring, none lost otherwise; the three ENDs too.
    let sent = stat(&c, "udp-sent");
    assert_eq!(sent + stat(&c, "udp-dropped"), 100_003, "{}", c.stderr);
    assert_eq!(stat(&s, "udp-received"), sent, "{}\n{}", s.stderr, c.stderr);
    assert!(got + 3 >= stat(&s, "udp-received"), "{got} numbered datagrams; {}", s.stderr);
}

#[test]
fn a_receiver_asking_for_ancillary_data_gets_it_from_the_kernel() {
    for preload in [false, true] {
        let deadline = Instant::now() + TIMEOUT;
        let mut s = server(preload, "pktinfo");
        let l = s.lines.recv_timeout(Duration::from_secs(10)).expect("pktinfo on");
        assert_eq!(l.trim(), "pktinfo on");
        let c = client(preload, &s.port, "pktinfo", deadline);
        check(&c, "client");
        s.first.push_str(&l);
        let s = s.finish(deadline);
        check(&s, "server");
        assert!(s.stdout.contains("pktinfo ok"), "{}", s.stdout);
        if preload {
            assert_eq!(stat(&c, "udp-out"), 0, "{}", c.stderr);
            assert_eq!(stat(&s, "udp-in"), 0, "{}", s.stderr);
        }
    }
}

#[test]
fn a_signal_during_a_blocked_receives_spin_ends_it_as_the_kernel_would() {
    // The server's spin budget (3 s, fixed) outlasts the alarm (100 ms): the signal
    // comes while its receive spins. Run then, its handler would be followed by more
    // waiting for a client that stays silent until told; held, it ends the spin and
    // the sleep's mask lets it through: EINTR, as the kernel's receive. With
    // SA_RESTART the receive goes on to the datagram. A 50 ms SO_RCVTIMEO ends the
    // spin too (it spun the whole 3 s before). The kernel's run is the reference.
    for preload in [false, true] {
        let deadline = Instant::now() + TIMEOUT;
        let s = Server::start(cmd(preload, &["server", "signals"]).env("STRAIT_SPIN_US", "3000000"));
        let c = client(preload, &s.port, "signals", deadline);
        let (s, c) = checked((s.finish(deadline), c));
        assert!(s.stdout.contains("signals server ok") && c.stdout.contains("signals client ok"));
        if preload {
            expect_stats(&s, &[("udp-in", 1), ("udp-out", 1)]);
        }
    }
}
