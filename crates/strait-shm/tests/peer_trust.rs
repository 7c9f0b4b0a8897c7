//! Attacks by other local users and by misbehaving connectors on the handshake:
//! name squatting, connecting as another uid, silent connectors, oversized rings,
//! the socket file's mode. Children that attack as another user re-execute this
//! binary (`child` test, selected by `STRAIT_TEST_ROLE`) as uid 65534.

mod common;

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::*;
use strait_core::Notifier;
use strait_shm::{PeerPolicy, ShmConfig, ShmDevice, ShmError, ShmListener};

/// Connects to `name` until a listener is there (the child binds it).
fn connect_when_bound(name: &str, cfg: &ShmConfig, n: &Notifier) -> Result<ShmDevice, ShmError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match ShmDevice::connect(name, cfg, n) {
            Err(ShmError::Io { op: "connect", .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            r => return r,
        }
    }
}

/// Another user binds the name first: with the default policy, `connect` sees the
/// squatter's uid and refuses it before sending it anything.
#[test]
fn a_squatter_of_another_uid_is_refused_by_connect() {
    let name = unique("squat");
    let mut child = spawn_role("squat", &name, true);
    let n = Notifier::new().unwrap();
    match connect_when_bound(&name, &ShmConfig::default(), &n) {
        Err(ShmError::PeerRefused { uid, .. }) => assert_eq!(uid, NOBODY),
        other => panic!("expected PeerRefused, got {other:?}"),
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The same squatter, explicitly allowed: the connection is made.
#[test]
fn a_listener_of_an_allowed_uid_is_accepted_by_connect() {
    let name = unique("squat-ok");
    let mut child = spawn_role("squat", &name, true);
    let n = Notifier::new().unwrap();
    let cfg = ShmConfig { peer_policy: PeerPolicy::Uids(vec![NOBODY]), ..ShmConfig::default() };
    let dev = connect_when_bound(&name, &cfg, &n).expect("an allowed listener");
    assert_eq!(dev.peer_uid(), NOBODY);
    drop(dev);
    assert!(child.wait().unwrap().success(), "the listener child did not get its connection");
}

/// Another user connects: with the default policy the listener closes the
/// connection unanswered and counts it; no device (no ring) is ever handed out.
#[test]
fn a_connector_of_another_uid_never_gets_a_ring() {
    let name = unique("intrude");
    let listener = ShmListener::bind(&name).unwrap();
    let mut child = spawn_role("connect", &name, true);
    let n = Notifier::new().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while listener.stats().refused_peers == 0 {
        assert!(Instant::now() < deadline, "the intruder never showed up: {:?}", listener.stats());
        if let Some(d) = listener.accept_timeout(&n, Some(Duration::from_millis(50))).unwrap() {
            panic!("a ring was handed to uid {}", d.peer_uid());
        }
    }
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(3), "the intruder's connect must fail");
    assert_eq!(listener.stats().accepted, 0);
}

/// The same connector, explicitly allowed, gets its connection.
#[test]
fn a_connector_of_an_allowed_uid_gets_a_ring() {
    let name = unique("intrude-ok");
    let cfg = ShmConfig { peer_policy: PeerPolicy::Uids(vec![NOBODY]), ..ShmConfig::default() };
    let listener = ShmListener::bind_with(&name, &cfg).unwrap();
    let mut child = spawn_role("connect", &name, true);
    let n = Notifier::new().unwrap();
    let dev = listener.accept_timeout(&n, Some(Duration::from_secs(10))).unwrap().expect("a connection");
    assert_eq!(dev.peer_uid(), NOBODY);
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

/// A connector that connects and says nothing does not hold up the next one: the
/// second connector's handshake completes while the silent one is still pending
/// (it was not first timed out).
#[test]
fn a_silent_connector_does_not_delay_others() {
    let name = unique("silent");
    let listener = ShmListener::bind(&name).unwrap();
    let silent = raw_connect(&name).unwrap();
    let t0 = Instant::now();
    let name2 = name.clone();
    let second = std::thread::spawn(move || {
        let n = Notifier::new().unwrap();
        ShmDevice::connect(&name2, &ShmConfig::default(), &n).map(|_| ())
    });
    let n = Notifier::new().unwrap();
    let dev = listener.accept(&n).expect("the second connector");
    let took = t0.elapsed();
    assert!(dev.peer_pid() == Some(std::process::id() as i32));
    second.join().unwrap().expect("second connect");
    let st = listener.stats();
    assert_eq!((st.accepted, st.pending, st.dropped_pending), (1, 1, 0), "{st:?}");
    assert!(took < Duration::from_secs(4), "accept took {took:?}");
    drop(silent);
}

/// A connector cannot make the listener map rings larger than its own setting:
/// a 2 GiB request and a legal but larger-than-configured one are refused before
/// anything is mapped, and an honest connector is told the limit.
#[test]
fn a_connector_cannot_make_the_listener_map_more_than_its_ring() {
    let name = unique("big");
    let cfg = ShmConfig { ring_bytes: 64 << 10, ..ShmConfig::default() };
    let listener = ShmListener::bind_with(&name, &cfg).unwrap();
    let n = Notifier::new().unwrap();
    for ring in [2u64 << 30, 1 << 20] {
        let (sock, _memfd, _wake) = raw_hello(&name, (ring / 4096) as u32, HEADER_BYTES as u64 + 2 * ring);
        let got = listener.accept_timeout(&n, Some(Duration::from_millis(300))).unwrap();
        assert!(got.is_none(), "a {ring}-byte ring was accepted");
        let mut buf = [0u8; 64];
        let (len, fds) = recv_fds(sock.as_raw_fd(), &mut buf);
        assert_eq!(len, 32);
        assert_ne!(u32::from_le_bytes(buf[12..16].try_into().unwrap()), 0, "status must say refused");
        assert!(fds.is_empty(), "a refused connector got a descriptor");
    }
    assert_eq!(listener.stats().failed_handshakes, 2);
    assert!(!std::fs::read_to_string("/proc/self/maps").unwrap().lines().any(|l| {
        let mut r = l.split(' ').next().unwrap().split('-').map(|x| u64::from_str_radix(x, 16).unwrap());
        let (a, b) = (r.next().unwrap(), r.next().unwrap());
        l.contains("memfd:strait-shm") && b - a > (8 << 20)
    }));
    let t = std::thread::spawn({
        let name = name.clone();
        move || {
            let n = Notifier::new().unwrap();
            ShmDevice::connect(&name, &ShmConfig { ring_bytes: 1 << 20, ..ShmConfig::default() }, &n)
        }
    });
    assert!(listener.accept_timeout(&n, Some(Duration::from_millis(500))).unwrap().is_none());
    let e = t.join().unwrap().expect_err("refused");
    assert!(e.to_string().contains("at most 65536"), "{e}");
}

/// A path name's socket file is created owner-only under the default policy (and
/// open to all under the opt-in policies, where SO_PEERCRED does the checking).
#[test]
fn a_path_socket_file_has_a_safe_mode() {
    use std::os::unix::fs::PermissionsExt;
    for (policy, want) in [(PeerPolicy::SameUser, 0o600), (PeerPolicy::AnyUser, 0o666)] {
        let path = format!("/tmp/{}", unique("path"));
        let l = ShmListener::bind_with(&path, &ShmConfig { peer_policy: policy, ..ShmConfig::default() })
            .unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, want, "{path}");
        drop(l);
        assert!(std::fs::metadata(&path).is_err(), "socket file left behind");
    }
}

/// Child roles; a no-op unless `STRAIT_TEST_ROLE` is set.
#[test]
fn child() {
    let Ok(role) = std::env::var("STRAIT_TEST_ROLE") else { return };
    let name = std::env::var("STRAIT_TEST_NAME").unwrap();
    let n = Notifier::new().unwrap();
    match role.as_str() {
        "squat" => {
            // Accepts anyone, so that only the victim's own check can refuse.
            let cfg = ShmConfig { peer_policy: PeerPolicy::AnyUser, ..ShmConfig::default() };
            let l = ShmListener::bind_with(&name, &cfg).unwrap();
            let got = l.accept_timeout(&n, Some(Duration::from_secs(10))).unwrap();
            std::process::exit(if got.is_some() { 0 } else { 4 });
        }
        "connect" => match ShmDevice::connect(&name, &ShmConfig::default(), &n) {
            Ok(_) => std::process::exit(0),
            Err(_) => std::process::exit(3),
        },
        other => panic!("unknown role {other}"),
    }
}
