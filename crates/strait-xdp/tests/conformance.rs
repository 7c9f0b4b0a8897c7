//! The Device conformance suite (`strait_core::conformance`) for the xdp device,
//! `Reliable<XdpLink>` over AF_XDP sockets on a veth pair joining two network
//! namespaces (made per pair, removed when the pair is dropped), and for its box.
//! One process: each link is opened by a thread inside its namespace (the socket
//! stays bound there), and the suite drives both.
//!
//! Needs root (namespaces, XDP).

mod common;
use common::Pair;

use std::time::Duration;

use strait_core::conformance::{Boxed, Harness, Pair as DevPair};
use strait_core::{Device, Link, Reliable, ReliableConfig};
use strait_sys::netns;
use strait_xdp::{XdpConfig, XdpLink};

type XdpDevice = Reliable<XdpLink>;

/// Established xdp device pairs, each on a veth pair of its own (kept alive with
/// the harness); time is real time.
struct XdpHarness {
    veths: Vec<Pair>,
    rel: ReliableConfig,
    window: Option<u32>,
}

impl XdpHarness {
    fn new() -> Self {
        XdpHarness { veths: Vec::new(), rel: ReliableConfig::default(), window: None }
    }
}

/// Opens side `side`'s link of `p` from a thread inside its namespace.
fn open(p: &Pair, side: usize) -> XdpLink {
    let (ns, cfg, peer) = (p.ns[side].clone(), XdpConfig::new(&p.ifs[side]), p.macs[1 - side]);
    std::thread::spawn(move || {
        netns::enter(&ns).unwrap_or_else(|e| panic!("enter {ns}: {e}"));
        XdpLink::open(&cfg, peer)
    })
    .join()
    .expect("namespace thread")
    .unwrap_or_else(|e| panic!("open the xdp link: {e}"))
}

impl Harness for XdpHarness {
    type Dev = XdpDevice;

    fn pair(&mut self) -> DevPair<XdpDevice> {
        let p = Pair::new("xc", 0x5c, 180);
        let (la, lb) = (open(&p, 0), open(&p, 1));
        let slots = la.tx_slots().expect("an xdp link has send slots");
        self.window =
            Some(self.rel.window.clamp(2, 32768).min(slots.saturating_sub(16).clamp(2, 32768) as u32));
        let (mut a, mut b) = (Reliable::new(la, self.rel.clone()), Reliable::new(lb, self.rel.clone()));
        let pause = |_: &XdpDevice, _: &XdpDevice| std::thread::sleep(Duration::from_micros(100));
        if !XdpDevice::handshake(&mut a, &mut b, 20_000, pause) {
            panic!("the xdp pair never established: {} / {}", a.describe(), b.describe());
        }
        self.veths.push(p);
        DevPair { a, b, wake: None }
    }

    fn advance(&mut self, _devs: &[&XdpDevice]) {
        std::thread::sleep(Duration::from_micros(20));
    }

    fn expected_credits_hint(&self) -> Option<u16> {
        Some((self.window.expect("a pair was made") / 2) as u16)
    }

    /// The AF_XDP socket is readable while the peer's FIN is in flight, not after.
    fn event_fd_readable_after_close(&self) -> bool {
        false
    }
}

mod xdp {
    use super::*;
    strait_core::device_conformance!(XdpHarness::new());
}

mod boxed_xdp {
    use super::*;
    strait_core::device_conformance!(Boxed(XdpHarness::new()));
}
