//! `strait-udp`: the native API over the reliability layer over the udp device
//! (io_uring, else sendmmsg/recvmmsg), between the addresses of
//! `strait_anatomy::kernel::NET_ENV` (loopback unless `--across-netns`).

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use strait_anatomy::transport::Result;
use strait_anatomy::{BenchError, Pending, Transport, TransportSpec};
use strait_core::{Config, ReliableConfig, Worker};
use strait_udp::{UdpConfig, UdpLink};

use super::native::NativeLink;

const NAME: &str = "strait-udp";
const SETUP: Duration = Duration::from_secs(10);

fn err(what: &str, e: impl std::fmt::Display) -> BenchError {
    BenchError::transport(NAME, format!("{what}: {e}"))
}

fn attach(sock: UdpSocket) -> Result<Box<dyn Transport>> {
    let link = UdpLink::from_socket(sock, &UdpConfig::from_env().map_err(|e| err("config", e))?)
        .map_err(|e| err("link", e))?;
    let dev = link.reliable(ReliableConfig::from_env().map_err(|e| err("config", e))?);
    let w = Worker::new(Config::from_env().map_err(|e| err("config", e))?).map_err(|e| err("worker", e))?;
    Ok(Box::new(NativeLink::new(NAME, w, dev)?))
}

/// The strait-udp transport spec.
pub struct StraitUdp;

impl TransportSpec for StraitUdp {
    strait_anatomy::spec_identity!(
        NAME,
        "strait native API over the reliability layer over UDP (io_uring or sendmmsg/recvmmsg; --across-netns)",
        true
    );

    fn settings(&self) -> Option<String> {
        match strait_udp::UdpConfig::from_env() {
            Ok(c) if c.backend == strait_udp::Backend::Auto => {
                Some(strait_udp::calibrate::calibration().describe())
            }
            Ok(c) => Some(format!("udp backend = {:?} (STRAIT_UDP_BACKEND)", c.backend)),
            Err(_) => None,
        }
    }

    fn listen(&self) -> Result<Pending> {
        let (driver, _) = strait_anatomy::kernel::bench_addrs()?;
        let sock = UdpSocket::bind((driver, 0)).map_err(|e| err("bind", e))?;
        let port = sock.local_addr().map_err(|e| err("local_addr", e))?.port();
        Ok(Pending {
            peer_args: vec![port.to_string()],
            peer_fds: Vec::new(),
            finish: Box::new(move || {
                // The peer's first packet (its SYN) names its address; it stays queued
                // for the link.
                sock.set_read_timeout(Some(SETUP)).map_err(|e| err("SO_RCVTIMEO", e))?;
                let deadline = Instant::now() + SETUP;
                let mut b = [0u8; 1];
                let from: SocketAddr = loop {
                    match sock.peek_from(&mut b) {
                        Ok((_, from)) => break from,
                        Err(e)
                            if Instant::now() < deadline && e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(err("waiting for the peer", e)),
                    }
                };
                sock.connect(from).map_err(|e| err("connect", e))?;
                attach(sock)
            }),
        })
    }

    fn connect(&self, args: &[String], _fds: Vec<OwnedFd>) -> Result<Box<dyn Transport>> {
        let port: u16 =
            args.first().and_then(|p| p.parse().ok()).ok_or_else(|| err("setup", "no port argument"))?;
        let (driver, me) = strait_anatomy::kernel::bench_addrs()?;
        let sock = UdpSocket::bind((me, 0)).map_err(|e| err("bind", e))?;
        sock.connect((driver, port)).map_err(|e| err("connect", e))?;
        attach(sock)
    }
}
