//! `strait anatomy --across-netns` for strait's own cross-host devices: the native
//! API's ping-pong over the reliability layer over the udp device (`strait-udp`) and
//! over the xdp device (`strait-xdp`), between two network namespaces joined by veth
//! pairs, with the stage probes on.
//!
//! The two ends are two threads of this process, as in [`crate::anatomy`]: each
//! end's socket is made inside its namespace (a socket keeps its namespace for
//! life), each end's link, worker and engine are made on its own pinned thread, so
//! the data path is the one two hosts use, and both ends' stamps are on one
//! time-stamp-counter line. The chain is the shm path's ([`stages::walk`]), with
//! its device stages named for a network device:
//!
//! | # | from → to | stage |
//! |---|---|---|
//! | 2 | S `TxMsg` → S `DevFilled` | packet build: the frame copied into the link's packets, headers and checksums |
//! | 3 | S `DevFilled` → R `RxFound` | the send call, the kernel's (udp) or the XDP path's (xdp) work on both sides, the wire, and the receiver's poll until its link hands the data packet over |
//! | 4 | R `RxFound` → R `RxMatch` | the frame's later packets (a frame larger than a packet), packet checks, acknowledgement and ordering, frame decode and tag match |
//!
//! The sender's doorbell (the system call that hands the packets to the kernel) is
//! inside stage 3; it is reported beside the chain, as for shm.

use std::net::{Ipv4Addr, UdpSocket};

use strait_anatomy::anatomy::AnatomyRun;
use strait_anatomy::stages::StageDef;
use strait_anatomy::Clock;
use strait_core::{Reliable, ReliableConfig};
use strait_sys::netns::within;
use strait_udp::{UdpConfig, UdpLink};
use strait_xdp::{Mac, XdpConfig, XdpLink};

use crate::anatomy::{check_probes, run_pair, AnatomyConfig, AnatomyError, MakeDevice, ProbeCost};
use crate::netns::VethPair;

/// strait's native API over the udp device, as in `strait bench`.
pub const UDP: &str = "strait-udp";
/// strait's native API over the xdp device, as in `strait bench`.
pub const XDP: &str = "strait-xdp";

/// The stages of [`stages::walk`](strait_anatomy::stages::walk)'s chain (same
/// indices as [`strait_anatomy::stages::STAGES`]) on a network device.
pub const REMOTE_STAGES: [StageDef; 11] = [
    StageDef { name: "API post + engine send", layer: "protocol send" },
    StageDef { name: "packet build (copy in, headers, checksums)", layer: "copy" },
    StageDef { name: "send call + kernel/wire + peer's receive poll", layer: "device/wire" },
    StageDef {
        name: "the frame's other packets, checks, acknowledgement, decode + tag match",
        layer: "protocol receive",
    },
    StageDef { name: "rndv: CTS reply", layer: "protocol receive" },
    StageDef { name: "rndv: CTS over the wire + poll", layer: "device/wire" },
    StageDef { name: "rndv: data movement (pipelined)", layer: "copy" },
    StageDef { name: "copy into user buffer", layer: "copy" },
    StageDef { name: "completion queued", layer: "protocol receive" },
    StageDef { name: "poll returns completion", layer: "protocol receive" },
    StageDef { name: "application turnaround", layer: "user" },
];

fn setup(what: &str, e: impl std::fmt::Display) -> AnatomyError {
    AnatomyError::Setup(format!("{what}: {e}"))
}

fn reliable_config() -> Result<ReliableConfig, AnatomyError> {
    ReliableConfig::from_env().map_err(|e| setup("reliability layer config", e))
}

/// Dissects `strait-udp` across `pair`: a UDP socket per namespace, connected to
/// each other, each end's link (io_uring unless `STRAIT_UDP_BACKEND` says
/// otherwise) made on its own thread.
pub fn run_udp(
    cfg: &AnatomyConfig,
    clock: &Clock,
    cost: ProbeCost,
    pair: &VethPair,
    progress: &mut dyn FnMut(u64),
) -> Result<(Vec<AnatomyRun>, Vec<String>), AnatomyError> {
    check_probes(clock)?;
    let ip = |i: usize| -> Result<Ipv4Addr, AnatomyError> {
        pair.ends[i].ip.parse().map_err(|e| setup("address of the veth pair", e))
    };
    let (ipa, ipb) = (ip(0)?, ip(1)?);
    let a = within(Some(&pair.ends[0].ns), || UdpSocket::bind((ipa, 0))).map_err(|e| setup("bind", e))?;
    let b = within(Some(&pair.ends[1].ns), || UdpSocket::bind((ipb, 0))).map_err(|e| setup("bind", e))?;
    let addr = |s: &UdpSocket| s.local_addr().map_err(|e| setup("local address", e));
    a.connect(addr(&b)?).map_err(|e| setup("connect", e))?;
    b.connect(addr(&a)?).map_err(|e| setup("connect", e))?;
    let make = |sock: UdpSocket| -> MakeDevice<Reliable<UdpLink>> {
        Box::new(move |_| {
            let ucfg = UdpConfig::from_env().map_err(|e| setup("udp device config", e))?;
            let link = UdpLink::from_socket(sock, &ucfg).map_err(|e| setup("udp link", e))?;
            Ok(link.reliable(reliable_config()?))
        })
    };
    run_pair(UDP, &REMOTE_STAGES, cfg, clock, cost, progress, make(a), make(b))
}

/// Dissects `strait-xdp` across `pair`'s raw-Ethernet veth pair: each end's AF_XDP
/// socket and steering program are set up inside its namespace, its link used on
/// its own thread.
pub fn run_xdp(
    cfg: &AnatomyConfig,
    clock: &Clock,
    cost: ProbeCost,
    pair: &VethPair,
    progress: &mut dyn FnMut(u64),
) -> Result<(Vec<AnatomyRun>, Vec<String>), AnatomyError> {
    check_probes(clock)?;
    let make = |me: usize| -> Result<MakeDevice<Reliable<XdpLink>>, AnatomyError> {
        let (end, peer) = (pair.raw[me].clone(), &pair.raw[1 - me]);
        let peer: Mac = peer.mac.parse().map_err(|e| setup("peer MAC", e))?;
        Ok(Box::new(move |_| {
            let link = within(Some(&end.ns), || {
                XdpLink::open(&XdpConfig::new(&end.ifname), peer).map_err(std::io::Error::other)
            })
            .map_err(|e| setup("xdp link", e))?;
            Ok(Reliable::new(link, reliable_config()?))
        }))
    };
    run_pair(XDP, &REMOTE_STAGES, cfg, clock, cost, progress, make(0)?, make(1)?)
}
