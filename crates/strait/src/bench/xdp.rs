//! `strait-xdp`: the native API over the reliability layer over the xdp device (raw
//! Ethernet through AF_XDP), between the two namespaces of `--across-netns`.
//!
//! Both ends learn their interface and their peer's MAC from [`XDP_ENV`]
//! (`DRIVER_IF,DRIVER_MAC,PEER_IF,PEER_MAC`), set by `strait bench --across-netns`.

use std::os::fd::OwnedFd;

use strait_anatomy::transport::Result;
use strait_anatomy::{BenchError, Pending, Transport, TransportSpec};
use strait_core::{Config, Reliable, ReliableConfig, Worker};
use strait_xdp::{Mac, XdpConfig, XdpLink};

use super::native::NativeLink;

const NAME: &str = "strait-xdp";

/// The variable naming both ends' interfaces and MACs.
pub const XDP_ENV: &str = "STRAIT_BENCH_XDP";

fn err(what: &str, e: impl std::fmt::Display) -> BenchError {
    BenchError::transport(NAME, format!("{what}: {e}"))
}

/// `(interface, peer MAC)` of one side (0 = driver, 1 = peer).
fn side(i: usize) -> Result<(String, Mac)> {
    let v = std::env::var(XDP_ENV)
        .map_err(|_| err("setup", format!("{XDP_ENV} unset: strait-xdp runs only with --across-netns")))?;
    let f: Vec<&str> = v.split(',').map(str::trim).collect();
    if f.len() != 4 {
        return Err(err("setup", format!("{XDP_ENV}={v:?}: expected DRIVER_IF,DRIVER_MAC,PEER_IF,PEER_MAC")));
    }
    let (me, peer) = if i == 0 { (0, 3) } else { (2, 1) };
    Ok((f[me].to_owned(), f[peer].parse().map_err(|e| err("peer MAC", e))?))
}

fn link(i: usize) -> Result<Box<dyn Transport>> {
    let (ifname, peer) = side(i)?;
    let link = XdpLink::open(&XdpConfig::new(&ifname), peer).map_err(|e| err("open", e))?;
    let rcfg = ReliableConfig::from_env().map_err(|e| err("config", e))?;
    let w = Worker::new(Config::from_env().map_err(|e| err("config", e))?).map_err(|e| err("worker", e))?;
    Ok(Box::new(NativeLink::new(NAME, w, Reliable::new(link, rcfg))?))
}

/// The strait-xdp transport spec.
pub struct StraitXdp;

impl TransportSpec for StraitXdp {
    strait_anatomy::spec_identity!(
        NAME,
        "strait native API over the reliability layer over AF_XDP raw Ethernet (--across-netns)",
        true
    );

    fn listen(&self) -> Result<Pending> {
        Ok(Pending { peer_args: Vec::new(), peer_fds: Vec::new(), finish: Box::new(|| link(0)) })
    }

    fn connect(&self, _args: &[String], _fds: Vec<OwnedFd>) -> Result<Box<dyn Transport>> {
        link(1)
    }
}
