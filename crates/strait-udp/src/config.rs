//! Settings of the udp link, each with a default and a `STRAIT_UDP_*` override.

use strait_core::config::{env_choice, env_flag, env_num, env_num_in};
use strait_core::ConfigError;

/// How the link talks to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The backend this host's calibration chose ([`crate::calibrate`]: the one that
    /// carried a lone datagram faster here), io_uring only if the kernel allows it,
    /// else `sendmmsg`/`recvmmsg` (said once on stderr).
    Auto,
    /// io_uring only: fails if the kernel refuses it.
    Uring,
    /// `sendmmsg`/`recvmmsg` only.
    Mmsg,
}

/// Udp link configuration. Build with [`UdpConfig::default`] or [`UdpConfig::from_env`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpConfig {
    /// `STRAIT_UDP_BACKEND` = `auto` (default) | `uring` | `mmsg`.
    pub backend: Backend,
    /// Largest datagram payload; 0 (default) takes the path MTU of the connected
    /// route less the IP and UDP headers (datagrams are never IP-fragmented).
    /// `STRAIT_UDP_MAX_DATAGRAM`.
    pub max_datagram: usize,
    /// Transmit slots (each holds one datagram). The reliability layer needs its
    /// window plus 16. `STRAIT_UDP_SLOTS`, default 1024.
    pub slots: u32,
    /// Datagrams the bounded device ring holds between two doorbells (the io_uring
    /// submission queue, or one `sendmmsg` batch). `STRAIT_UDP_RING`, default 256.
    pub ring: u32,
    /// Receive buffers of the io_uring backend (a power of two; 0 = 256), 64 KiB
    /// each. 16 are posted at first (fewer buffers in the ring stay in cache), more
    /// each time the kernel runs out. `STRAIT_UDP_RX_BUFS`.
    pub rx_bufs: u32,
    /// Send runs of equal-size datagrams as one UDP GSO super-datagram (both
    /// backends). `STRAIT_UDP_GSO` = 0/1, default 1.
    pub gso: bool,
    /// Receive coalesced datagrams (UDP_GRO) into one buffer, split again into
    /// datagrams by the link (both backends). `STRAIT_UDP_GRO` = 0/1, default 1.
    pub gro: bool,
    /// Datagrams at least this long go out with `IORING_OP_SEND_ZC` from the
    /// registered slot (no copy); 0 disables zero-copy. `STRAIT_UDP_ZC_MIN`,
    /// default 0 (measured slower on veth and loopback, where the kernel copies a
    /// zero-copy skb anyway; see docs/UDP.md).
    pub zc_min: usize,
    /// io_uring backend: a lone datagram with nothing else in flight goes out by a
    /// plain `send` instead of a submission and its completion (measured cheaper
    /// for a lone small message across veth: docs/PERFORMANCE.md section 33).
    /// `STRAIT_UDP_DIRECT_SEND` = 0/1, default 1.
    pub direct_send: bool,
    /// Doorbell moderation: a flush less than this long after the previous doorbell
    /// leaves its datagrams queued until the window ends (the link's next `recv`,
    /// `flush` or `arm_sleep` rings) or another doorbell takes them; a push (a new
    /// flight: `strait_core::Link::push`) is never held. 0 rings on every flush.
    /// `STRAIT_UDP_COALESCE_US`, default 8.
    pub coalesce_ns: u64,
    /// Doorbell moderation while the link streams (its last
    /// [`crate::STREAM_RUN`] doorbells each carried or followed at least
    /// [`crate::STREAM_MIN`] datagrams one way, and no push since): the window for sends and for entering the kernel to collect
    /// receive completions. `STRAIT_UDP_STREAM_COALESCE_US`, default 32.
    pub stream_coalesce_ns: u64,
    /// Socket send and receive buffer sizes (forced past `rmem_max` when
    /// permitted). `STRAIT_UDP_SOCKBUF`, default 8M.
    pub sock_buf: usize,
    /// ECN: datagrams leave marked ECN-capable (ECT(0)), and the link counts those
    /// that arrive marked Congestion Experienced ([`strait_core::Link::ce_marked`]),
    /// which the reliability layer echoes to the sender as a congestion signal.
    /// `STRAIT_UDP_ECN` = 0/1, default 1.
    pub ecn: bool,
}

impl Default for UdpConfig {
    fn default() -> Self {
        UdpConfig {
            backend: Backend::Auto,
            max_datagram: 0,
            slots: 1024,
            ring: 256,
            rx_bufs: 0,
            gso: true,
            gro: true,
            zc_min: 0,
            direct_send: true,
            coalesce_ns: 8_000,
            stream_coalesce_ns: 32_000,
            sock_buf: 8 << 20,
            ecn: true,
        }
    }
}

impl UdpConfig {
    /// Defaults overridden by any `STRAIT_UDP_*` variables that are set.
    pub fn from_env() -> Result<Self, ConfigError> {
        let mut c = UdpConfig::default();
        let backends = [
            ("auto", Backend::Auto),
            ("", Backend::Auto),
            ("uring", Backend::Uring),
            ("io_uring", Backend::Uring),
            ("mmsg", Backend::Mmsg),
        ];
        if let Some(b) = env_choice("STRAIT_UDP_BACKEND", &backends, "expected auto, uring or mmsg")? {
            c.backend = b;
        }
        if let Some(v) = env_num("STRAIT_UDP_MAX_DATAGRAM")? {
            if v != 0 && !(256..=65507).contains(&v) {
                return Err(ConfigError {
                    var: "STRAIT_UDP_MAX_DATAGRAM",
                    value: v.to_string(),
                    why: "must be 0 (path MTU) or 256..65507",
                });
            }
            c.max_datagram = v as usize;
        }
        if let Some(v) = env_num_in("STRAIT_UDP_SLOTS", 32..=65536, "must be 32..65536")? {
            c.slots = v as u32;
        }
        if let Some(v) = env_num_in("STRAIT_UDP_RING", 8..=4096, "must be 8..4096")? {
            c.ring = v as u32;
        }
        if let Some(v) = env_num("STRAIT_UDP_RX_BUFS")? {
            if v != 0 && (!v.is_power_of_two() || v > 32768) {
                return Err(ConfigError {
                    var: "STRAIT_UDP_RX_BUFS",
                    value: v.to_string(),
                    why: "must be 0 (auto) or a power of two up to 32768",
                });
            }
            c.rx_bufs = v as u32;
        }
        if let Some(v) = env_flag("STRAIT_UDP_GSO")? {
            c.gso = v;
        }
        if let Some(v) = env_flag("STRAIT_UDP_GRO")? {
            c.gro = v;
        }
        if let Some(v) = env_num("STRAIT_UDP_ZC_MIN")? {
            c.zc_min = v as usize;
        }
        if let Some(v) = env_flag("STRAIT_UDP_DIRECT_SEND")? {
            c.direct_send = v;
        }
        if let Some(v) = env_num("STRAIT_UDP_COALESCE_US")? {
            c.coalesce_ns = v.saturating_mul(1000);
        }
        if let Some(v) = env_num("STRAIT_UDP_STREAM_COALESCE_US")? {
            c.stream_coalesce_ns = v.saturating_mul(1000);
        }
        if let Some(v) = env_num_in("STRAIT_UDP_SOCKBUF", 64 << 10..=1 << 30, "must be 64K..1G")? {
            c.sock_buf = v as usize;
        }
        if let Some(v) = env_flag("STRAIT_UDP_ECN")? {
            c.ecn = v;
        }
        Ok(c)
    }
}
