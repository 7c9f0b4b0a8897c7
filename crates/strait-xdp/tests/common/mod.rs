//! The veth pair between two network namespaces that the xdp tests create and remove.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use strait_sys::netns;
use strait_xdp::Mac;

/// Runs a command that must succeed; returns its output.
pub fn sh(args: &[&str]) -> Output {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// Two namespaces joined by a veth pair, deleted on drop (even on panic).
pub struct Pair {
    pub ns: [String; 2],
    pub ifs: [String; 2],
    pub macs: [Mac; 2],
    pub ips: [String; 2],
}

static SEQ: AtomicU32 = AtomicU32::new(0);

impl Pair {
    /// Namespaces `s{tag}a<id>`/`s{tag}b<id>`, interfaces `{tag}a<id>`/`{tag}b<id>`,
    /// MACs `02:{mac_tag}:..`, addresses in `10.{subnet_base + n}.x.0/24` (unique per
    /// process and call).
    pub fn new(tag: &str, mac_tag: u8, subnet_base: u32) -> Pair {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let id = (std::process::id() % 10_000) * 10 + n;
        let ns = [format!("s{tag}a{id}"), format!("s{tag}b{id}")];
        let ifs = [format!("{tag}a{id}"), format!("{tag}b{id}")];
        let mac = |side: u8| Mac([0x02, mac_tag, (id >> 16) as u8, (id >> 8) as u8, id as u8, side]);
        let macs = [mac(1), mac(2)];
        let subnet = subnet_base + n % 50;
        let ips = [format!("10.{subnet}.{}.1", id % 250), format!("10.{subnet}.{}.2", id % 250)];
        let p = Pair { ns, ifs, macs, ips };
        netns::add_veth_namespaces([&p.ns[0], &p.ns[1]], [&p.ifs[0], &p.ifs[1]])
            .unwrap_or_else(|e| panic!("{e}"));
        for i in 0..2 {
            let m = p.macs[i].to_string();
            sh(&["ip", "-n", &p.ns[i], "link", "set", &p.ifs[i], "address", &m, "up"]);
            sh(&["ip", "-n", &p.ns[i], "addr", "add", &format!("{}/24", p.ips[i]), "dev", &p.ifs[i]]);
            sh(&["ip", "-n", &p.ns[i], "link", "set", "lo", "up"]);
        }
        p
    }

    /// True while an XDP program is attached to side `side`'s interface.
    pub fn attached(&self, side: usize) -> bool {
        let out = sh(&["ip", "-n", &self.ns[side], "link", "show", &self.ifs[side]]);
        String::from_utf8_lossy(&out.stdout).contains("xdp")
    }

    /// True once neither side has a program attached, looked at for up to 2 s: a
    /// process forked by another test thread (each `ip` command) holds copies of
    /// every descriptor, the BPF link's too, until it execs, so the detach the
    /// last close causes can come a moment later.
    pub fn detached_soon(&self) -> bool {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(2);
        loop {
            if !self.attached(0) && !self.attached(1) {
                return true;
            }
            if std::time::Instant::now() >= end {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for ns in &self.ns {
            netns::delete_namespace(ns);
        }
    }
}
