//! A flood of idle connections leaves the listener's descriptor count bounded (its
//! own test binary: it counts this process's descriptors).

mod common;

use std::time::{Duration, Instant};

use common::*;
use strait_core::Notifier;
use strait_shm::ShmListener;

const FLOOD: usize = 300;

#[test]
fn a_flood_of_idle_connections_keeps_the_listener_bounded() {
    if std::env::var("STRAIT_TEST_ROLE").is_ok() {
        // The flooder: FLOOD silent connections, held until killed.
        let name = std::env::var("STRAIT_TEST_NAME").unwrap();
        let socks: Vec<_> = (0..FLOOD).map(|_| raw_connect(&name).expect("connect")).collect();
        println!("flooded {}", socks.len());
        std::thread::sleep(Duration::from_secs(30));
        return;
    }
    let name = unique("flood");
    let listener = ShmListener::bind(&name).unwrap();
    let n = Notifier::new().unwrap();
    let before = open_fds();
    let mut child = {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["--exact", "a_flood_of_idle_connections_keeps_the_listener_bounded", "--nocapture"])
            .env("STRAIT_TEST_ROLE", "flood")
            .env("STRAIT_TEST_NAME", &name);
        cmd.spawn().unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut most = 0;
    while listener.stats().pending + listener.stats().dropped_pending < FLOOD as u64 {
        assert!(Instant::now() < deadline, "the flood did not arrive: {:?}", listener.stats());
        assert!(listener.accept_timeout(&n, Some(Duration::from_millis(20))).unwrap().is_none());
        most = most.max(open_fds());
    }
    let st = listener.stats();
    assert!(st.pending <= 16, "{st:?}");
    assert!(most <= before + 16 + 2, "descriptors grew from {before} to {most} ({st:?})");
    let _ = child.kill();
    let _ = child.wait();
}
