//! `RndvMode::Auto` on the shm device takes the rendezvous path the host calibration
//! chose (`strait_shm::calibrate`), here forced with `STRAIT_CALIBRATE` so the test
//! is deterministic: with `remote-read` the receiver reads large messages straight
//! out of the sender (counted in the device's `remote_reads`), with `copy` it never
//! does, with `split` it reads once per message too. Real processes: the test binary re-executes itself as the two ends.

use std::process::Command;
use std::time::Duration;

use strait_core::{Config, Device, MemoryRegion, OpKind, RndvMode, Status, Worker};
use strait_shm::{ShmConfig, ShmDevice, ShmListener};

const SIZES: &[usize] = &[100_000, 1 << 20];

fn cfg() -> Config {
    Config { rndv_mode: RndvMode::Auto, spin: Duration::ZERO, ..Config::default() }
}

fn wait(w: &mut Worker<ShmDevice>, op: OpKind) {
    loop {
        let c = w.wait(Some(Duration::from_secs(20))).expect("wait");
        assert_eq!(c.status, Status::Ok, "{c:?}");
        if c.op == op {
            return;
        }
    }
}

/// Receives each size and sends it back; returns the remote reads its device made.
fn echo(w: &mut Worker<ShmDevice>, ep: strait_core::EpId) {
    for (i, &len) in SIZES.iter().enumerate() {
        let mut mr = MemoryRegion::new(len).unwrap();
        w.post_recv(ep, &mut mr, 0..len, i as u64, u64::MAX, 0).unwrap();
        wait(w, OpKind::Recv);
        w.post_send(ep, &mr, 0..len, i as u64, 0).unwrap();
        wait(w, OpKind::Send);
    }
}

/// One run under the environment's `STRAIT_CALIBRATE`: accepts the echo child, sends
/// every size and receives it back; prints the remote reads of both receives.
fn run() {
    let name = format!("test-rndv-auto-{}", std::process::id());
    let listener = ShmListener::bind(&name).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "role", "--nocapture", "--test-threads=1"])
        .env("STRAIT_TEST_ROLE", "echo")
        .env("STRAIT_TEST_NAME", &name)
        .spawn()
        .unwrap();
    let mut w = Worker::new(cfg()).unwrap();
    let ep = w.attach(listener.accept(w.notifier()).unwrap());
    for (i, &len) in SIZES.iter().enumerate() {
        let out = MemoryRegion::new(len).unwrap();
        let mut back = MemoryRegion::new(len).unwrap();
        w.post_recv(ep, &mut back, 0..len, i as u64, u64::MAX, 0).unwrap();
        w.post_send(ep, &out, 0..len, i as u64, 0).unwrap();
        wait(&mut w, OpKind::Recv);
    }
    assert!(child.wait().unwrap().success(), "the echo child failed");
    let reads = w.device(ep).unwrap().stats().remote_reads;
    println!("REMOTE_READS {reads}");
}

#[test]
fn role() {
    match std::env::var("STRAIT_TEST_ROLE").as_deref() {
        Ok("run") => run(),
        Ok("echo") => {
            let name = std::env::var("STRAIT_TEST_NAME").unwrap();
            let mut w = Worker::new(cfg()).unwrap();
            let dev = ShmDevice::connect(&name, &ShmConfig::default(), w.notifier()).unwrap();
            let ep = w.attach(dev);
            echo(&mut w, ep);
        }
        _ => {}
    }
}

#[test]
fn auto_takes_the_path_the_calibration_chose() {
    // Under `split` each large receive still reads once: its own part, or (as
    // here, where both ends sleep rather than spin, so no split is asked of a
    // sleeping sender) the whole message.
    for (choice, reads_expected) in [("remote-read", true), ("copy", false), ("split", true)] {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "role", "--nocapture", "--test-threads=1"])
            .env("STRAIT_TEST_ROLE", "run")
            .env("STRAIT_CALIBRATE", choice)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{choice}: {text}{}", String::from_utf8_lossy(&out.stderr));
        let reads: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("REMOTE_READS "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{choice}: no count in {text}"));
        if reads_expected {
            assert_eq!(reads, SIZES.len() as u64, "{choice}: every large receive is one remote read");
        } else {
            assert_eq!(reads, 0, "{choice}: a remote read under the copy choice");
        }
    }
}
