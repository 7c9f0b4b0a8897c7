//! The xdp device across a veth pair joining two network namespaces that each test
//! creates and removes: native API messages of every size class, with and without
//! injected loss; ordinary IP traffic through the same interfaces while strait's
//! program is attached; a killed process leaves no program behind; an unprivileged
//! process gets an error that names what is missing.
//!
//! Needs root (namespaces, XDP). Every child process runs under `timeout`, so a hang
//! fails the test instead of stalling it.

mod common;
use common::{sh, Pair};

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

const PEER: &str = env!("CARGO_BIN_EXE_strait-xdp-peer");

impl Pair {
    fn cmd(&self, side: usize, secs: u32, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns[side], "timeout", "-s", "KILL", &secs.to_string(), PEER])
            .args(args);
        c
    }

    fn spawn(&self, side: usize, secs: u32, args: &[&str]) -> Child {
        self.cmd(side, secs, args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn peer")
    }

    /// Runs an echo on side 1 and a checker on side 0; returns the checker's line.
    fn echo_check(&self, sizes: &str, rounds: u32, ppm: u32) -> String {
        let mut echo = self.cmd(1, 60, &["echo", &self.ifs[1], &self.macs[0].to_string()]);
        echo.env("STRAIT_XDP_DROP_PPM", ppm.to_string());
        let echo = echo.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn echo");
        let check = self
            .cmd(
                0,
                60,
                &[
                    "check",
                    &self.ifs[0],
                    &self.macs[1].to_string(),
                    sizes,
                    &rounds.to_string(),
                    &ppm.to_string(),
                ],
            )
            .output()
            .expect("run check");
        let echo = echo.wait_with_output().expect("echo");
        let text = |o: &Output| {
            format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
        };
        assert!(check.status.success(), "check failed: {}\necho: {}", text(&check), text(&echo));
        assert!(echo.status.success(), "echo failed: {}", text(&echo));
        String::from_utf8_lossy(&check.stdout).trim().to_owned()
    }
}

fn field(line: &str, name: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {line:?}"))
}

const SIZES: &str = "0,1,8,1400,1449,1450,5000,32768,40000,300000,2000000";

#[test]
fn every_size_class_crosses_the_veth_pair_intact() {
    let p = Pair::new("x", 0x5a, 100);
    let line = p.echo_check(SIZES, 3, 0);
    assert_eq!(field(&line, "messages"), 33, "{line}");
    assert!(!p.attached(0) && !p.attached(1), "programs left attached after the processes exited");
}

#[test]
fn injected_loss_is_repaired() {
    let p = Pair::new("x", 0x5a, 100);
    // 1% of strait frames dropped on receive, at both ends.
    let line = p.echo_check(SIZES, 3, 10_000);
    assert_eq!(field(&line, "messages"), 33, "{line}");
    assert!(field(&line, "retransmits") + field(&line, "fast") > 0, "no loss was repaired: {line}");
}

#[test]
fn ip_traffic_passes_while_attached_and_a_killed_process_leaves_nothing_behind() {
    let p = Pair::new("x", 0x5a, 100);
    let mut holds = [p.spawn(0, 30, &["hold", &p.ifs[0], "30"]), p.spawn(1, 30, &["hold", &p.ifs[1], "30"])];
    let mut attached = false;
    for _ in 0..100 {
        if p.attached(0) && p.attached(1) {
            attached = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(attached, "programs did not attach");
    // Kernel TCP (with ARP) through the same interfaces.
    let addr = format!("{}:7777", p.ips[1]);
    let mut server = p.spawn(1, 20, &["tcp-serve", &addr]);
    let mut hello = None;
    for _ in 0..50 {
        let out = p.cmd(0, 10, &["tcp-hello", &addr]).output().expect("hello");
        if out.status.success() {
            hello = Some(out);
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let hello = hello.expect("kernel TCP across the veth pair failed while XDP was attached");
    assert!(String::from_utf8_lossy(&hello.stdout).contains("ok hello"));
    assert!(server.wait().expect("server").success());
    // SIGKILL every process in both namespaces (the strait processes themselves,
    // not just their launchers): the kernel must detach their programs.
    for ns in &p.ns {
        let out = sh(&["ip", "netns", "pids", ns]);
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
    for h in &mut holds {
        h.wait().expect("reap");
    }
    let mut clean = false;
    for _ in 0..100 {
        if !p.attached(0) && !p.attached(1) {
            clean = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(clean, "a killed process left its XDP program attached");
    // And the next run attaches again and works.
    let line = p.echo_check("8,5000", 2, 0);
    assert_eq!(field(&line, "messages"), 4, "{line}");
}

#[test]
fn without_privileges_the_error_names_what_is_missing() {
    let p = Pair::new("x", 0x5a, 100);
    let out = Command::new("ip")
        .args(["netns", "exec", &p.ns[0], "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(["--inh-caps=-all", "--bounding-set=-all", "timeout", "10", PEER, "hold", &p.ifs[0], "1"])
        .output()
        .expect("run unprivileged");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an unprivileged process attached XDP");
    assert!(err.contains("CAP_NET_ADMIN") && err.contains("CAP_BPF"), "unclear error: {err}");
    assert!(!p.attached(0));
}
