//! [`XdpLink`]: a [`Link`] carrying strait packets in raw Ethernet frames through an
//! AF_XDP socket, addressed by MAC.

use std::os::fd::RawFd;

use strait_core::{Link, LinkError, LinkStats};

use crate::bpf::XdpProgram;
use crate::netif::{self, Mac};
use crate::xsk::{TxState, Xsk, XskGeometry, XskMode};
use crate::XdpError;

/// strait's EtherType: IEEE 802 local experimental EtherType 1.
pub const ETHERTYPE: u16 = 0x88b5;
pub(crate) const ETH_HEADER: usize = 14;

/// Settings of an xdp link.
#[derive(Debug, Clone)]
pub struct XdpConfig {
    /// Interface name.
    pub ifname: String,
    /// Receive queue to bind (the XDP program steers frames of this queue).
    pub queue: u32,
    /// UMEM geometry.
    pub geometry: XskGeometry,
    /// [`crate::XdpPort`] only: transmit frames one channel may hold at once (taken
    /// and not yet recycled). The reliability layer needs `window + 16`; the default,
    /// 528, fits the default window of 512.
    pub channel_tx_frames: u32,
    /// [`crate::XdpPort`] only: received frames queued for one channel until its
    /// owner reads them; beyond that they are dropped and counted. Default 512 (a
    /// full default window).
    pub channel_rx_frames: u32,
}

impl XdpConfig {
    /// Queue 0 of `ifname`, default geometry (1024 transmit and 1024 receive
    /// frames: enough for one [`XdpLink`]).
    pub fn new(ifname: &str) -> Self {
        XdpConfig {
            ifname: ifname.to_owned(),
            queue: 0,
            geometry: XskGeometry::default(),
            channel_tx_frames: 528,
            channel_rx_frames: 512,
        }
    }

    /// Queue 0 of `ifname` with a geometry for an [`crate::XdpPort`] shared by many
    /// channels: 4096 transmit and 4096 receive frames of 2 KiB (16 MiB of UMEM),
    /// enough for 16 channels at window 128 (15 at 256, 7 at the default 512) with
    /// every channel's window full at once. See docs/XDP.md for sizing.
    pub fn for_port(ifname: &str) -> Self {
        XdpConfig {
            geometry: XskGeometry { frame_size: 2048, tx_frames: 4096, rx_frames: 4096 },
            ..XdpConfig::new(ifname)
        }
    }
}

/// A point-to-point link to the peer with MAC `peer` over an AF_XDP socket.
///
/// Owns the interface queue's socket and the steering program (one peer per
/// interface queue). The program is detached when the link is dropped, or by the
/// kernel if the process dies.
pub struct XdpLink {
    xsk: Xsk,
    prog: XdpProgram,
    local: Mac,
    peer: Mac,
    mtu: usize,
    free: Vec<u32>,
    tx: Vec<TxState>,
    /// Descriptors queued since the last kick.
    queued: u32,
    epoch: std::time::Instant,
    stats: LinkStats,
}

fn link_err(e: XdpError) -> LinkError {
    match e {
        XdpError::Io { op, source } => LinkError::Io { op, source },
        other => LinkError::Down(other.to_string()),
    }
}

impl XdpLink {
    /// Attaches the steering program to `cfg.ifname`, binds an AF_XDP socket to its
    /// queue, and addresses frames to `peer`.
    ///
    /// Needs CAP_NET_ADMIN and CAP_BPF (root); without them the error names what
    /// was refused, and callers can fall back to the udp device.
    pub fn open(cfg: &XdpConfig, peer: Mac) -> Result<XdpLink, XdpError> {
        let ifindex = netif::ifindex(&cfg.ifname)?;
        let local = netif::mac(&cfg.ifname)?;
        let if_mtu = netif::mtu(&cfg.ifname)?;
        let prog = XdpProgram::attach(ifindex, ETHERTYPE)?;
        let xsk = Xsk::bind(ifindex, cfg.queue, cfg.geometry)?;
        prog.bind_socket(cfg.queue, xsk.fd())?;
        let geo = xsk.geometry();
        let mtu = if_mtu.min(geo.frame_size as usize - ETH_HEADER);
        let mut link = XdpLink {
            xsk,
            prog,
            local,
            peer,
            mtu,
            free: (0..geo.tx_frames).rev().collect(),
            tx: vec![TxState::default(); geo.tx_frames as usize],
            queued: 0,
            epoch: std::time::Instant::now(),
            stats: LinkStats::default(),
        };
        // Every transmit frame starts with the same Ethernet header.
        for i in 0..geo.tx_frames {
            let f = link.xsk.frame(i);
            f[0..6].copy_from_slice(&peer.0);
            f[6..12].copy_from_slice(&local.0);
            f[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
        }
        Ok(link)
    }

    /// Zero-copy or copy mode, as the driver allowed.
    pub fn mode(&self) -> XskMode {
        self.xsk.mode
    }

    /// True if the program runs in the generic (skb) hook.
    pub fn generic_xdp(&self) -> bool {
        self.prog.generic
    }

    /// This side's MAC.
    pub fn local_mac(&self) -> Mac {
        self.local
    }

    /// Drops this share (parts per million) of received strait frames: loss
    /// injection for tests.
    pub fn set_drop_ppm(&self, ppm: u32) -> Result<(), XdpError> {
        self.prog.set_drop_ppm(ppm)
    }

    /// The kernel's counters of the socket.
    pub fn kernel_statistics(&self) -> Option<libc::xdp_statistics> {
        self.xsk.statistics()
    }

    fn reap(&mut self) {
        let (tx, free) = (&mut self.tx, &mut self.free);
        self.xsk.reap(|i| {
            if tx.get_mut(i as usize).is_some_and(|t| t.complete()) {
                free.push(i);
            }
        });
    }
}

impl Link for XdpLink {
    fn mtu(&self) -> usize {
        self.mtu
    }

    fn tx_slots(&self) -> Option<usize> {
        Some(self.tx.len())
    }

    fn tx_alloc(&mut self) -> Option<u32> {
        if self.free.is_empty() {
            self.reap();
        }
        let s = self.free.pop()?;
        self.tx[s as usize].released = false;
        Some(s)
    }

    fn tx_buf(&mut self, slot: u32) -> &mut [u8] {
        let mtu = self.mtu;
        &mut self.xsk.frame(slot)[ETH_HEADER..ETH_HEADER + mtu]
    }

    fn send(&mut self, slot: u32, len: usize) -> Result<bool, LinkError> {
        if slot as usize >= self.tx.len() || len > self.mtu {
            return Err(LinkError::BadSlot { slot, len });
        }
        if !self.xsk.tx_push(slot, (ETH_HEADER + len) as u32) {
            self.stats.send_full += 1;
            return Ok(false);
        }
        self.tx[slot as usize].pending += 1;
        self.queued += 1;
        self.stats.datagrams_sent += 1;
        Ok(true)
    }

    fn tx_release(&mut self, slot: u32) {
        let Some(t) = self.tx.get_mut(slot as usize) else { return };
        if !t.released && t.release() {
            self.free.push(slot);
        }
    }

    fn flush(&mut self) -> Result<(), LinkError> {
        if self.queued > 0 {
            self.queued = 0;
            let calls = self.xsk.kick().map_err(link_err)?;
            self.stats.doorbells += calls as u64;
        }
        self.reap();
        Ok(())
    }

    fn recv(&mut self, handle: &mut dyn FnMut(&[u8])) -> Result<bool, LinkError> {
        let Some((idx, range)) = self.xsk.rx_pop() else {
            if self.xsk.rx_wakeup() {
                self.stats.doorbells += 1;
            }
            return Ok(false);
        };
        self.stats.datagrams_received += 1;
        let peer = self.peer;
        let f = &self.xsk.frame(idx)[range];
        let ok = f.len() >= ETH_HEADER && f[6..12] == peer.0 && f[12..14] == ETHERTYPE.to_be_bytes();
        if ok {
            handle(&f[ETH_HEADER..]);
        } else {
            self.stats.datagrams_dropped += 1;
        }
        self.xsk.rx_release(idx);
        Ok(true)
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.xsk.fd())
    }

    fn arm_sleep(&mut self) -> Result<bool, LinkError> {
        Ok(!self.xsk.rx_ready())
    }

    fn stats(&self) -> LinkStats {
        self.stats
    }
}
