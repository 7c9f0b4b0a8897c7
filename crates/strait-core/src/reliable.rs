//! The reliability layer: turns a lossy [`Link`] into an in-order, exactly-once
//! [`Device`] for the protocol engine.
//!
//! What it does, per connection:
//! * **Setup and teardown as messages.** Each side picks a random connection id and
//!   first sequence number and sends SYN until it hears the peer; a side is
//!   established once it knows the peer's id and has seen a packet addressed to its
//!   own. [`Device::shutdown`] sends a sequenced FIN after all data; the peer delivers
//!   it in order and answers with an acknowledgement ([`Device::drain`] runs until
//!   then). A RESET from the peer (it lost its state) or a SYN under a new id ends the
//!   connection at once.
//! * **Sequencing and acknowledgement.** Every packet carries the cumulative
//!   acknowledgement (next sequence number expected) and a 64-packet
//!   selective-acknowledgement bitmap above it, so acknowledgements ride on data when
//!   data flows both ways. A receiver acknowledges on its own after `ack_every`
//!   packets or `ack_delay_ns` (delayed acknowledgement), and at once after a gap or
//!   a duplicate (the NAK that triggers fast retransmission). While datagrams keep
//!   arriving, its acknowledgements wait in the link for one doorbell when the link
//!   runs dry, or go at once when they cover half the window (a receiver slower than
//!   its sender must not hold the sender's window until it has handled it all).
//!   A packet that fills a gap is acknowledged at once (RFC 5681 4.2).
//! * **Retransmission.** Fast, as RACK decides (a packet below the highest
//!   selectively acknowledged one is lost once one sent a reordering window after it
//!   arrived, or a round trip and that window passed; the window a quarter round
//!   trip, at least 20 us); a tail no later packet reveals is probed after two silent
//!   round trips plus the peer's acknowledgement delay, at least half the minimum
//!   RTO (RACK-TLP, RFC 8985); on timeout as the fallback (RTO = srtt + 4
//!   rttvar + ack delay, at least 3 srtt + ack delay, exponential back-off; the timer
//!   runs from a packet's transmission or the last acknowledged progress, whichever
//!   is later, as RFC 6298 restarts it). Round trips are measured from a packet's
//!   transmission, not from when it was queued. A timeout whose queued
//!   retransmission is acknowledged before it left was spurious and is undone.
//!   Acknowledged and selectively acknowledged packets give their link slots back
//!   at once.
//! * **Congestion control** ([`crate::congestion`]): CUBIC's window bounds the
//!   packets in the network, frame by frame (see `Conn::frame_fits`), and every
//!   packet leaves at the pacing rate (the device's timer reports the next
//!   departure).
//! * **Fragmentation.** An engine frame up to [`ReliableConfig::max_frame`] bytes is
//!   cut into as many packets as the link MTU needs and reassembled in order.
//! * **Integrity.** Every packet carries a CRC32C over header and payload (over the
//!   header only where the link's carrier checks payloads itself, as UDP's checksum
//!   does: [`Link::carrier_checksum`], [`ReliableConfig::payload_crc`]); a packet
//!   that fails it, or any other check (version, kind, reserved bits, length,
//!   connection ids, sequence window, acknowledgement range), is counted and dropped.
//!   Datagrams from strangers never end a connection.
//! * **Authentication** (optional, [`ReliableConfig::auth`]). With a key per
//!   direction, every packet carries an HMAC-SHA256 tag over header and payload
//!   (see `strait_wire::packet::seal_auth`) instead of a payload CRC; a packet
//!   without a valid tag is counted ([`ReliableStats::bad_mac`]) and dropped before
//!   any field is trusted, so it is never delivered, acknowledged or answered.
//!   Without a key no packet carries a tag and no per-packet work is added.
//! * **Flow control.** At most `window` packets (and never more than the peer's
//!   advertised window) are unacknowledged; out-of-order packets inside the window
//!   are kept, so nothing the sender has to retransmit is thrown away. Message-level
//!   credits stay in the engine, as on every device: a receiver without a posted
//!   receive keeps the message in the engine's unexpected queue and acknowledges it.
//! * **Liveness.** While the worker drives the connection, a silent peer is probed
//!   every `keepalive_ns`; if anything that needs an answer (data or a probe) stays
//!   unanswered for `liveness_ns`, the connection fails with
//!   [`DeviceError::PeerGone`] and the engine completes the outstanding operations
//!   with an error.
//!
//! All timing uses [`Link::now_ns`], so the simulator runs this code on virtual time.

use std::collections::VecDeque;
use std::os::fd::RawFd;

pub use strait_wire::auth::PacketKey;
use strait_wire::packet::{
    self, CrcCoverage, PacketError, PacketHeader, PacketKind, FLAG_ACK_NOW, FLAG_FIRST, FLAG_LAST,
    PACKET_HEADER_LEN, TAG_LEN,
};

use crate::config::{env_choice, env_flag, env_num, env_num_in, ConfigError};
use crate::congestion::{Congestion, Cubic, Pacer};
use crate::device::{Device, DeviceError, DeviceStats, FrameWriter, RxFrame};
use crate::link::{Link, LinkError, LinkStats};

/// Settings of the reliability layer. Times are in nanoseconds of the link's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReliableConfig {
    /// Largest engine frame (the engine's eager and chunk limits follow from it).
    /// `STRAIT_REL_MAX_FRAME`, default 65536.
    pub max_frame: usize,
    /// Packets that may be unacknowledged at once, and the receive window
    /// advertised to the peer. Cut to the link's transmit slots less 16 when the
    /// link says how many it has ([`Link::tx_slots`]). `STRAIT_REL_WINDOW`, default
    /// 512.
    pub window: u32,
    /// A receiver acknowledges on its own after this many unacknowledged packets.
    /// `STRAIT_REL_ACK_EVERY`, default 8.
    pub ack_every: u32,
    /// ... or after this long. `STRAIT_REL_ACK_DELAY_US`, default 50 us.
    pub ack_delay_ns: u64,
    /// Retransmission timeout before any round trip was measured.
    /// `STRAIT_REL_RTO_INITIAL_US`, default 20 ms.
    pub rto_initial_ns: u64,
    /// Lower bound of the retransmission timeout. `STRAIT_REL_RTO_MIN_US`, default
    /// 1 ms.
    pub rto_min_ns: u64,
    /// Upper bound of the (backed-off) retransmission timeout.
    /// `STRAIT_REL_RTO_MAX_US`, default 200 ms.
    pub rto_max_ns: u64,
    /// A peer silent this long is probed. `STRAIT_REL_KEEPALIVE_MS`, default 250.
    pub keepalive_ns: u64,
    /// Something unanswered this long means the peer is gone.
    /// `STRAIT_REL_LIVENESS_MS`, default 5000.
    pub liveness_ns: u64,
    /// Cover payloads with the CRC even where the link's carrier checks them itself
    /// ([`Link::carrier_checksum`]). `STRAIT_REL_PAYLOAD_CRC` = 0/1, default 0.
    pub payload_crc: bool,
    /// Connection id and first sequence number seed; `None` lets [`Reliable::new`]
    /// draw them from the kernel's random pool. (The simulator passes seeded nonces
    /// to [`Reliable::with_nonce`] instead, for reproducible runs.)
    pub nonce: Option<u64>,
    /// Authenticate every packet with these keys (the peer's `tx` is our `rx`);
    /// `None`: CRC only. Set by the caller (never from the environment).
    pub auth: Option<PacketAuth>,
    /// Congestion control ([`crate::congestion`]). `STRAIT_REL_CC` = `cubic`
    /// (default) | `off`.
    pub congestion: Congestion,
}

/// The keys of an authenticated connection, one per direction (so a packet
/// reflected back at its sender never passes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PacketAuth {
    /// Seals what this side sends.
    pub tx: PacketKey,
    /// Checks what this side receives.
    pub rx: PacketKey,
}

impl Default for ReliableConfig {
    fn default() -> Self {
        ReliableConfig {
            max_frame: 65536,
            window: 512,
            ack_every: 8,
            ack_delay_ns: 50_000,
            rto_initial_ns: 20_000_000,
            rto_min_ns: 1_000_000,
            rto_max_ns: 200_000_000,
            keepalive_ns: 250_000_000,
            liveness_ns: 5_000_000_000,
            payload_crc: false,
            nonce: None,
            auth: None,
            congestion: Congestion::Cubic,
        }
    }
}

impl ReliableConfig {
    /// Defaults overridden by any `STRAIT_REL_*` variables that are set.
    pub fn from_env() -> Result<Self, ConfigError> {
        let mut c = ReliableConfig::default();
        if let Some(v) = env_num_in("STRAIT_REL_MAX_FRAME", 1024..=1 << 24, "must be 1K..16M")? {
            c.max_frame = v as usize;
        }
        if let Some(v) = env_num_in("STRAIT_REL_WINDOW", 2..=32768, "must be 2..32768")? {
            c.window = v as u32;
        }
        if let Some(v) = env_num_in("STRAIT_REL_ACK_EVERY", 1..=u64::MAX, "must be positive")? {
            c.ack_every = v as u32;
        }
        if let Some(v) = env_num("STRAIT_REL_ACK_DELAY_US")? {
            c.ack_delay_ns = v * 1000;
        }
        if let Some(v) = env_num_in("STRAIT_REL_RTO_INITIAL_US", 1..=u64::MAX, "must be positive")? {
            c.rto_initial_ns = v * 1000;
        }
        if let Some(v) = env_num_in("STRAIT_REL_RTO_MIN_US", 1..=u64::MAX, "must be positive")? {
            c.rto_min_ns = v * 1000;
        }
        if let Some(v) = env_num_in("STRAIT_REL_RTO_MAX_US", 1..=u64::MAX, "must be positive")? {
            c.rto_max_ns = v * 1000;
        }
        if let Some(v) = env_num_in("STRAIT_REL_KEEPALIVE_MS", 1..=u64::MAX, "must be positive")? {
            c.keepalive_ns = v * 1_000_000;
        }
        if let Some(v) = env_num_in("STRAIT_REL_LIVENESS_MS", 1..=u64::MAX, "must be positive")? {
            c.liveness_ns = v * 1_000_000;
        }
        if let Some(v) = env_flag("STRAIT_REL_PAYLOAD_CRC")? {
            c.payload_crc = v;
        }
        let controls = [("cubic", Congestion::Cubic), ("off", Congestion::Off)];
        if let Some(cc) = env_choice("STRAIT_REL_CC", &controls, "expected cubic or off")? {
            c.congestion = cc;
        }
        Ok(c)
    }
}

/// Counters of the reliability layer.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReliableStats {
    /// Data and FIN packets sent for the first time.
    pub packets_sent: u64,
    /// Packets delivered in order (data and FIN).
    pub packets_delivered: u64,
    /// Engine frames handed over.
    pub frames_sent: u64,
    /// Engine frames delivered.
    pub frames_delivered: u64,
    /// Retransmissions after a timeout.
    pub timeout_retransmits: u64,
    /// Retransmissions after a gap was reported.
    pub fast_retransmits: u64,
    /// Stand-alone acknowledgements sent.
    pub acks_sent: u64,
    /// Probes (pings and SYN repeats) sent.
    pub probes_sent: u64,
    /// Packets that arrived twice (dropped).
    pub duplicates: u64,
    /// Packets kept for later because an earlier one was missing.
    pub out_of_order: u64,
    /// Packets dropped: CRC mismatch, or a header-only CRC over a carrier that does
    /// not check payloads.
    pub bad_checksum: u64,
    /// Packets dropped: malformed header (short, version, kind, flags, length).
    pub bad_header: u64,
    /// Packets dropped on an authenticated connection: authentication tag missing
    /// or wrong (forged, from another connection, or under another key).
    pub bad_mac: u64,
    /// Packets dropped: not addressed to this connection.
    pub wrong_conn: u64,
    /// Packets dropped: sequence number or acknowledgement outside the window.
    pub out_of_window: u64,
    /// Round-trip time estimate, nanoseconds (0 until measured).
    pub srtt_ns: u64,
    /// Congestion window, packets (0 with congestion control off).
    pub cwnd: u32,
    /// Congestion window reductions for losses (one per recovery episode).
    pub cc_reductions: u64,
    /// Congestion window restarts after retransmission timeouts.
    pub cc_timeouts: u64,
    /// Timeouts found spurious (a packet queued for retransmission was
    /// acknowledged first), their window restored.
    pub spurious_timeouts: u64,
    /// Tail loss probes sent (the last packet again, after two silent round
    /// trips).
    pub tail_probes: u64,
    /// Packets of the peer's that arrived marked Congestion Experienced (ECN CE,
    /// counted by the link), echoed back in every packet's header.
    pub ce_received: u64,
    /// Of our packets, how many the peer reported arrived marked CE.
    pub ce_echoed: u64,
    /// Congestion window reductions for CE marks the peer echoed (one per recovery
    /// episode, as for losses; also counted in `cc_reductions`).
    pub cc_ecn_reductions: u64,
    /// The link stopped marking its datagrams ECN-capable because the connection
    /// setup went unanswered ([`ECN_FALLBACK_AFTER`] tries): a path that may drop
    /// them.
    pub ecn_fallbacks: u64,
    /// Link counters.
    pub link: LinkStats,
}

/// Unanswered connection-setup tries after which the link stops marking its
/// datagrams ECN-capable ([`Link::ecn_off`]): with the initial 20 ms timeout and
/// its doubling, about 140 ms into an unanswered setup.
pub const ECN_FALLBACK_AFTER: u32 = 3;

/// One data or FIN packet until the peer acknowledges it.
struct TxPkt {
    seq: u32,
    /// The link slot holding its bytes; `None` once selectively acknowledged.
    slot: Option<u32>,
    len: usize,
    /// Last transmission (0: never transmitted yet).
    sent_ns: u64,
    /// The cumulative acknowledgement written into its header.
    built_ack: u32,
    sacked: bool,
    /// A transmission of it is waiting in `resend`.
    queued: bool,
    /// Retransmissions so far.
    retx: u32,
    /// Queued for retransmission by a timeout and not resent yet: an
    /// acknowledgement of it proves that the original arrived and the timeout was
    /// spurious.
    rto_pending: bool,
    fin: bool,
}

/// An out-of-order packet kept until the gap before it fills.
struct HeldPkt {
    flags: u8,
    fin: bool,
    data: Vec<u8>,
}

/// How many datagrams one receive step looks at, and how many timed-out packets one
/// timer pass queues.
const BATCH: usize = 64;
/// Frames delivered between timer passes while data keeps arriving.
const TIMER_EVERY: u32 = 16;
/// The shortest reordering window (RACK's): packets sent back to back as
/// acknowledgements clock them out leave microseconds apart, and a host's interrupt
/// coalescing and scheduling reorder them by more (the simulator's 10 us of jitter
/// drew three times the spurious retransmissions with the earlier 5 us).
const MIN_REORDER_NS: u64 = 20_000;
/// Unanswered FIN transmissions after which a draining connection gives up on the
/// peer's acknowledgement (its data was all acknowledged already).
const FIN_TRIES: u32 = 3;

fn seq_lt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

fn now_us(now_ns: u64) -> u32 {
    (now_ns / 1000) as u32
}

fn random_u64() -> u64 {
    // No entropy source: ids only need to differ between incarnations.
    strait_sys::random_u64()
        .unwrap_or_else(|| (strait_sys::unix_nanos() as u64) ^ ((std::process::id() as u64) << 32))
}

/// The connection's state without the link, so that a datagram the link lends out
/// can be handled while the link is borrowed. Link work that handling decides on
/// (slots to give back, a reset to send) is recorded here and done afterwards.
struct Conn {
    cfg: ReliableConfig,
    /// The link's carrier checks payloads: packets whose CRC covers only the header
    /// are accepted.
    carrier_checked: bool,
    my_id: u32,
    peer_id: u32,
    /// The peer has addressed a packet to `my_id`.
    peer_knows_me: bool,
    established: bool,
    dead: Option<String>,
    /// `shutdown` was called.
    closing: bool,
    fin_queued: bool,
    fin_tries: u32,
    /// The peer's FIN was delivered: nothing more will arrive.
    peer_fin: bool,

    // Transmit side.
    isn: u32,
    snd_una: u32,
    snd_next: u32,
    peer_window: u32,
    inflight: VecDeque<TxPkt>,
    /// Sequence numbers to (re)transmit, in order: the software queue in front of the
    /// link's bounded ring.
    resend: VecDeque<u32>,
    srtt_ns: u64,
    rttvar_ns: u64,
    rto_ns: u64,
    backoff: u32,
    last_syn_ns: u64,
    last_ping_ns: u64,
    /// Since when something that needs an answer (data, a probe) has had none.
    unanswered_since: Option<u64>,
    /// Index (from `snd_una`) one past the highest selectively acknowledged packet.
    sacked_above: usize,
    /// Latest transmission time among packets known to have arrived (RACK).
    rack_sent_ns: u64,
    /// When an acknowledgement last advanced `snd_una`: the retransmission timer
    /// runs from here or from a packet's transmission, whichever is later (RFC
    /// 6298 5.3), so a receiver that is busy but keeps acknowledging does not
    /// draw spurious timeouts for the packets it has not reached yet.
    progress_ns: u64,
    /// The last transmission of a sequenced packet (the tail loss probe's clock).
    last_tx_ns: u64,
    /// The packet a tail loss probe resent, until the acknowledgements pass it.
    tlp_seq: Option<u32>,
    /// The congestion window's state (`None`: congestion control off).
    cc: Option<Cubic>,
    /// Spaces transmissions at the congestion window's rate (unused with
    /// congestion control off).
    pacer: Pacer,
    /// Bytes of a full packet (the link's MTU): the pacer's unit.
    full_len: usize,
    /// Packets in `inflight` selectively acknowledged: not in the network any more.
    sacked_count: usize,
    /// Packets in `inflight` never transmitted yet (queued behind the congestion
    /// window or the pacer).
    unsent: usize,
    /// During a loss recovery episode: the first sequence number sent after the
    /// loss; the episode ends once it is acknowledged (one reduction per episode).
    recovery_until: Option<u32>,
    /// Slots to give back to the link.
    release: Vec<u32>,
    /// A stranger's data packet to answer with a RESET (its source id).
    reset_to: Option<u32>,
    /// The peer's SYN shows it does not know our id yet: repeat ours.
    syn_now: bool,
    last_reset_ns: u64,

    // Receive side.
    rcv_next: u32,
    held: Vec<Option<HeldPkt>>,
    held_count: usize,
    reasm: Vec<u8>,
    reasm_active: bool,
    rx_unacked: u32,
    ack_due_ns: Option<u64>,
    ack_now: bool,
    ts_to_echo: u32,
    /// The link's count of CE-marked arrivals (wrapping), echoed in every header.
    ce_to_echo: u32,
    /// The highest CE count the peer has echoed to us.
    ce_echo_seen: u32,
    /// The acknowledgement (`rcv_next`) last handed to the link, and the one last
    /// flushed out of it: see `Reliable::recv_frame`.
    ack_sent: u32,
    ack_flushed: u32,
    last_heard_ns: u64,
    spare: Vec<Vec<u8>>,

    dstats: DeviceStats,
    rstats: ReliableStats,
}

impl Conn {
    /// Whether a frame of `pieces` packets may be queued now. The window and the
    /// peer's window bound the sequence span unacknowledged (the receiver keeps
    /// out-of-order packets within it); a frame larger than that still goes when
    /// nothing is unacknowledged, so no frame waits forever. The congestion window
    /// bounds the packets in the network ([`Conn::pipe`], counting those the pacer
    /// still holds) a frame at a time: a frame goes if it fits, and a frame larger
    /// than half the window goes once half the window is free. Measured on the
    /// way here: admitting a frame only when it fit made a 64 KiB frame (46
    /// packets) wait for the network to empty whenever the window was smaller
    /// (stop and wait under `strait run`, every lost tail a timeout); holding each
    /// packet to the window as it left sent in the acknowledgements' units of 8
    /// packets, a system call each (64 KiB streaming across veth 1.36 -> 0.95
    /// GB/s); admitting any frame while one packet's room was left overshot the
    /// window by a frame and took 0.59-0.63 of a bottleneck shared with TCP.
    fn frame_fits(&self, pieces: usize) -> bool {
        let flow =
            (self.cfg.window.min(self.peer_window).max(1) as usize).saturating_sub(self.inflight.len());
        if pieces > flow && !self.inflight.is_empty() {
            return false;
        }
        self.cc.as_ref().is_none_or(|cc| {
            let (w, used) = (cc.window() as usize, self.pipe() + self.unsent);
            used + pieces <= w || (2 * pieces > w && 2 * used <= w)
        })
    }

    /// The first sequence number not transmitted yet (packets wait unsent, in
    /// order, at the end of `inflight`): a recovery episode ends once everything
    /// sent before it is acknowledged, and must not wait for packets that only its
    /// end lets go (the window does not grow during recovery).
    fn sent_next(&self) -> u32 {
        self.snd_next.wrapping_sub(self.unsent as u32)
    }

    /// Packets in the network (RFC 6675's pipe): sent, neither acknowledged nor
    /// selectively acknowledged.
    fn pipe(&self) -> usize {
        self.inflight.len() - self.sacked_count - self.unsent
    }

    /// Nanoseconds between two full packets at the pacing rate (0: unpaced).
    fn pacing_interval(&self) -> u64 {
        self.cc.as_ref().map_or(0, |cc| cc.pacing_interval_ns(self.srtt_ns))
    }

    /// A loss was found at `now`: the first of a recovery episode reduces the
    /// congestion window.
    fn on_loss(&mut self, now: u64) {
        if self.recovery_until.is_none() {
            if let Some(cc) = &mut self.cc {
                cc.on_loss(now);
            }
            self.recovery_until = Some(self.sent_next());
        }
    }

    /// The link's count of CE-marked arrivals is `marked`: a new mark is echoed at
    /// once (an acknowledgement now), so that the sender reacts within a round
    /// trip, as to a loss.
    fn note_ce(&mut self, marked: u64) {
        let now_marked = marked as u32;
        let new = now_marked.wrapping_sub(self.ce_to_echo);
        if new != 0 {
            self.rstats.ce_received += u64::from(new);
            self.ce_to_echo = now_marked;
            self.ack_now = true;
        }
    }

    /// The peer echoed `echo` CE marks on our packets: a higher count than before
    /// is a congestion signal, answered as a loss is (one window reduction per
    /// recovery episode) but with nothing to resend. A lower one is an older
    /// packet's, overtaken. (A peer can lie about it as it can about losses: it
    /// can only slow its own connection.)
    fn on_ce_echo(&mut self, echo: u32, now: u64) {
        let new = echo.wrapping_sub(self.ce_echo_seen);
        if new == 0 || new >= 1 << 31 {
            return;
        }
        self.ce_echo_seen = echo;
        self.rstats.ce_echoed += u64::from(new);
        if self.recovery_until.is_none() && self.cc.is_some() {
            self.on_loss(now);
            self.rstats.cc_ecn_reductions += 1;
        }
    }

    fn sack_bits(&self) -> u64 {
        if self.held_count == 0 {
            return 0;
        }
        let w = self.held.len();
        let mut bits = 0u64;
        for i in 0..64.min(w - 1) {
            let seq = self.rcv_next.wrapping_add(1 + i as u32);
            if self.held[seq as usize % w].is_some() {
                bits |= 1 << i;
            }
        }
        bits
    }

    fn header(&self, kind: PacketKind, flags: u8, seq: u32, len: usize, now: u64) -> PacketHeader {
        PacketHeader {
            kind,
            flags,
            dst_id: self.peer_id,
            src_id: self.my_id,
            seq,
            ack: self.rcv_next,
            sack: self.sack_bits(),
            len: len as u16,
            window: self.cfg.window.min(u16::MAX as u32) as u16,
            ts: now_us(now),
            ts_echo: self.ts_to_echo,
            ce_echo: self.ce_to_echo,
        }
    }

    fn acked_now(&mut self) {
        self.ack_sent = self.rcv_next;
        self.rx_unacked = 0;
        self.ack_due_ns = None;
        self.ack_now = false;
    }

    fn fail(&mut self, why: String) {
        if self.dead.is_none() {
            self.dead = Some(why);
        }
    }

    fn error(&self) -> DeviceError {
        DeviceError::PeerGone(self.dead.clone().unwrap_or_else(|| "connection ended".into()))
    }

    fn corrupt(&mut self, why: &str) -> DeviceError {
        let why = format!("peer broke the packet protocol: {why}");
        self.fail(why.clone());
        self.dstats.frames_rejected += 1;
        DeviceError::Corrupt(why)
    }

    fn current_rto(&self) -> u64 {
        self.rto_ns.saturating_mul(1 << self.backoff.min(16)).min(self.cfg.rto_max_ns)
    }

    fn rtt_sample(&mut self, rtt: u64) {
        if self.srtt_ns == 0 {
            self.srtt_ns = rtt;
            self.rttvar_ns = rtt / 2;
        } else {
            let err = self.srtt_ns.abs_diff(rtt);
            self.rttvar_ns = (3 * self.rttvar_ns + err) / 4;
            self.srtt_ns = (7 * self.srtt_ns + rtt) / 8;
        }
        // RFC 6298's estimate, but never before the tail loss probe (two round
        // trips) had its round trip: a timeout restarts the window from one packet,
        // the probe's repair costs one reduction.
        let after_probe = 3 * self.srtt_ns + self.cfg.ack_delay_ns;
        self.rto_ns = (self.srtt_ns + 4 * self.rttvar_ns + self.cfg.ack_delay_ns)
            .max(after_probe)
            .clamp(self.cfg.rto_min_ns, self.cfg.rto_max_ns);
    }

    /// When a tail loss probe is due (RFC 8985 section 7): two round trips after
    /// the last transmission or progress, plus the peer's acknowledgement delay when
    /// a single packet is out; `None` while no probe may go (nothing sent and
    /// unacknowledged, packets still queued, a probe already out, no round trip
    /// measured yet, congestion control off, or the connection closing).
    fn probe_due(&self) -> Option<u64> {
        // (Not for a closing connection: its FIN has its own bounded repeats, and a
        // probe would reach a peer that may have finished already.)
        if self.cc.is_none()
            || self.closing
            || self.srtt_ns == 0
            || self.tlp_seq.is_some()
            || !self.resend.is_empty()
        {
            return None;
        }
        let pipe = self.inflight.len() - self.sacked_count;
        if pipe == 0 || self.inflight.iter().all(|p| p.sent_ns == 0) {
            return None;
        }
        // Plus the peer's acknowledgement delay, and never sooner than half the
        // minimum RTO: on a LAN two round trips are shorter than a sleeping
        // receiver's delayed acknowledgement takes to come back, and probes for
        // acknowledgements merely late would only add packets (Linux keeps its
        // probe timeout above 10 ms).
        let wait = (2 * self.srtt_ns + self.cfg.ack_delay_ns).max(self.cfg.rto_min_ns / 2);
        Some(self.last_tx_ns.max(self.progress_ns) + wait)
    }

    /// Applies the peer's acknowledgement fields. False if they make no sense (an
    /// acknowledgement of packets never sent): the packet is dropped.
    fn on_ack(&mut self, h: &PacketHeader, now: u64) -> bool {
        if seq_lt(h.ack, self.snd_una) {
            // Stale: a retransmitted or overtaken packet keeps the acknowledgement it
            // was built with; its data still counts. An acknowledgement of something
            // before our first sequence number is forged or garbage.
            let first = self.isn.wrapping_add(1);
            if h.ack.wrapping_sub(first) > self.snd_una.wrapping_sub(first) {
                self.rstats.out_of_window += 1;
                return false;
            }
            return true;
        }
        let acked = h.ack.wrapping_sub(self.snd_una) as usize;
        if acked > self.inflight.len() {
            self.rstats.out_of_window += 1;
            return false;
        }
        let mut delivered = 0usize;
        if acked > 0 {
            // The newest packet acknowledged, if its only transmission's arrival is
            // what the acknowledgement reports (Karn: not retransmitted; not
            // selectively acknowledged earlier).
            let mut sample = None;
            let mut spurious = false;
            for p in self.inflight.drain(..acked) {
                spurious |= p.rto_pending;
                if !p.sacked {
                    delivered += 1;
                } else {
                    self.sacked_count -= 1;
                }
                if let Some(slot) = p.slot {
                    self.release.push(slot);
                }
                sample = (p.retx == 0 && !p.sacked && p.sent_ns != 0).then_some(p.sent_ns);
                if p.retx == 0 {
                    // (A retransmitted packet's arrival may be the first copy's.)
                    self.rack_sent_ns = self.rack_sent_ns.max(p.sent_ns);
                }
            }
            self.snd_una = h.ack;
            self.progress_ns = now;
            self.sacked_above = self.sacked_above.saturating_sub(acked);
            self.backoff = 0;
            // Measured from the packet's transmission, not from the timestamp in its
            // header (written when the frame was cut into packets: a packet the pacer
            // or the congestion window held back would count its wait as path delay).
            if let Some(sent) = sample {
                self.rtt_sample(now.saturating_sub(sent).max(1));
            }
            if spurious {
                // F-RTO's reasoning (RFC 5682): a packet the timeout queued for
                // retransmission is acknowledged before it was resent, so the first
                // transmission arrived; only the round trip grew (a filling queue).
                // The window comes back, and what is still queued goes as paced.
                self.rstats.spurious_timeouts += 1;
                if let Some(cc) = &mut self.cc {
                    cc.undo_timeout();
                }
                self.recovery_until = None;
                self.backoff = 0;
                for p in &mut self.inflight {
                    p.rto_pending = false;
                }
            }
        }
        if h.sack != 0 {
            let mut highest = None;
            for i in 0..64u32 {
                if h.sack & (1 << i) == 0 {
                    continue;
                }
                let idx = h.ack.wrapping_add(1 + i).wrapping_sub(self.snd_una) as usize;
                if let Some(p) = self.inflight.get_mut(idx) {
                    if !p.sacked {
                        p.sacked = true;
                        self.sacked_count += 1;
                        delivered += 1;
                        if p.retx == 0 {
                            self.rack_sent_ns = self.rack_sent_ns.max(p.sent_ns);
                        }
                        if let Some(slot) = p.slot.take() {
                            self.release.push(slot);
                        }
                    }
                    highest = Some(idx);
                }
            }
            if let Some(top) = highest {
                self.sacked_above = self.sacked_above.max(top + 1);
                self.fast_retransmit(now);
            }
        }
        if self.tlp_seq.is_some_and(|t| seq_lt(t, self.snd_una)) {
            self.tlp_seq = None;
        }
        if self.recovery_until.is_some_and(|r| !seq_lt(self.snd_una, r)) {
            self.recovery_until = None;
            if let Some(cc) = &mut self.cc {
                cc.timeout_recovered();
            }
        }
        if self.recovery_until.is_none() {
            if let Some(cc) = &mut self.cc {
                cc.on_ack(delivered, now, self.srtt_ns);
            }
        }
        true
    }

    /// How long a packet may trail packets sent after it before it counts as lost
    /// (a quarter round trip, as RACK): reordering shorter than this is not loss.
    fn reorder_window(&self) -> u64 {
        let base = if self.srtt_ns > 0 { self.srtt_ns / 4 } else { self.cfg.rto_min_ns / 8 };
        base.max(MIN_REORDER_NS)
    }

    /// Resends lost packets below the highest selectively acknowledged one, the way
    /// RACK decides: a packet is lost once one sent more than a reordering window
    /// after it has arrived, or once a round trip and a reordering window have
    /// passed since it was sent. Returns the earliest moment a hole not yet due
    /// becomes due.
    fn fast_retransmit(&mut self, now: u64) -> Option<u64> {
        if self.sacked_above == 0 {
            return None;
        }
        let reo = self.reorder_window();
        let rtt = self.srtt_ns.max(self.cfg.rto_min_ns / 4);
        let newest = self.rack_sent_ns;
        let mut next_due: Option<u64> = None;
        let mut lost = false;
        // Newest first, each to the front: the queue ends up oldest first.
        for p in self.inflight.iter_mut().take(self.sacked_above).rev() {
            if p.sacked || p.queued || p.sent_ns == 0 {
                continue;
            }
            let due = p.sent_ns + rtt + reo;
            if p.sent_ns + reo < newest || due <= now {
                p.queued = true;
                p.retx += 1;
                self.resend.push_front(p.seq);
                self.rstats.fast_retransmits += 1;
                lost = true;
            } else {
                next_due = Some(next_due.map_or(due, |d| d.min(due)));
            }
        }
        if lost {
            self.on_loss(now);
        }
        next_due
    }

    /// Checks and applies one datagram; delivers at most one frame to `deliver` and
    /// returns whether it did.
    fn on_datagram(
        &mut self,
        d: &[u8],
        now: u64,
        deliver: &mut dyn FnMut(&RxFrame<'_>),
    ) -> Result<bool, DeviceError> {
        let opened = match &self.cfg.auth {
            None => packet::open_with(d, self.carrier_checked),
            Some(a) => packet::open_auth(d, &a.rx),
        };
        let h = match opened {
            Ok(h) => h,
            Err(e) => {
                match e {
                    PacketError::Checksum | PacketError::HeaderOnlyChecksum => self.rstats.bad_checksum += 1,
                    PacketError::BadMac => self.rstats.bad_mac += 1,
                    PacketError::Unauthenticated if self.cfg.auth.is_some() => self.rstats.bad_mac += 1,
                    _ => self.rstats.bad_header += 1,
                }
                self.dstats.frames_rejected += 1;
                return Ok(false);
            }
        };
        let payload = &d[PACKET_HEADER_LEN..PACKET_HEADER_LEN + h.len as usize];
        let for_me = h.dst_id == self.my_id;
        if h.kind == PacketKind::Syn {
            if self.peer_id == 0 {
                if payload.len() < 4 || !(h.dst_id == 0 || for_me) || h.src_id == 0 {
                    self.rstats.wrong_conn += 1;
                    return Ok(false);
                }
                self.peer_id = h.src_id;
                self.rcv_next = h.seq.wrapping_add(1);
            } else if h.src_id != self.peer_id || !(h.dst_id == 0 || for_me) {
                // A SYN under another id: a restarted peer or a stranger; the
                // connection's own peer proves itself with the ids it knows.
                self.rstats.wrong_conn += 1;
                return Ok(false);
            }
            if h.dst_id == 0 {
                // The peer has not heard our SYN (lost, or we count as established
                // only because someone else used our ids): say it again.
                self.syn_now = true;
            }
            self.ack_now = true;
        } else {
            if h.kind == PacketKind::Reset && for_me {
                // Only someone on the path knows our id: the peer (or a restarted
                // incarnation of it, hence any source id) has no state for us.
                self.fail("peer reset the connection".into());
                return Err(self.error());
            }
            if !for_me || self.peer_id == 0 || h.src_id != self.peer_id {
                self.rstats.wrong_conn += 1;
                if h.kind == PacketKind::Data && !for_me && h.src_id != self.peer_id {
                    // Data for an incarnation of us that no longer exists.
                    self.reset_to = Some(h.src_id);
                }
                return Ok(false);
            }
        }
        if for_me {
            self.peer_knows_me = true;
            if !self.on_ack(&h, now) {
                return Ok(false);
            }
            self.on_ce_echo(h.ce_echo, now);
        }
        if !self.established && self.peer_knows_me {
            self.established = true;
            self.backoff = 0;
        }
        self.last_heard_ns = now;
        self.peer_window = (h.window as u32).max(1);
        self.unanswered_since = if self.inflight.is_empty() && self.established { None } else { Some(now) };
        if h.flags & FLAG_ACK_NOW != 0 || h.kind == PacketKind::Ping {
            self.ack_now = true;
        }
        if h.kind.sequenced() {
            if h.seq == self.rcv_next {
                // Only a packet that advances the stream is echoed: a late duplicate's
                // old timestamp would inflate the peer's round-trip estimate.
                self.ts_to_echo = h.ts;
            }
            return self.on_sequenced(&h, payload, deliver);
        }
        Ok(false)
    }

    /// A data or FIN packet from the peer.
    fn on_sequenced(
        &mut self,
        h: &PacketHeader,
        payload: &[u8],
        deliver: &mut dyn FnMut(&RxFrame<'_>),
    ) -> Result<bool, DeviceError> {
        let w = self.held.len() as u32;
        if seq_lt(h.seq, self.rcv_next) {
            // Our acknowledgement was lost: repeat it.
            self.rstats.duplicates += 1;
            self.ack_now = true;
            return Ok(false);
        }
        let ahead = h.seq.wrapping_sub(self.rcv_next);
        if ahead >= w {
            self.rstats.out_of_window += 1;
            return Ok(false);
        }
        if ahead > 0 {
            let i = (h.seq % w) as usize;
            if self.held[i].is_some() {
                self.rstats.duplicates += 1;
            } else {
                let mut data = self.spare.pop().unwrap_or_default();
                data.clear();
                data.extend_from_slice(payload);
                self.held[i] = Some(HeldPkt { flags: h.flags, fin: h.kind == PacketKind::Fin, data });
                self.held_count += 1;
                self.rstats.out_of_order += 1;
            }
            // A gap: tell the sender at once (the NAK).
            self.ack_now = true;
            return Ok(false);
        }
        if self.held_count > 0 {
            // It fills (part of) a gap: acknowledged at once (RFC 5681 section 4.2),
            // so the sender learns of the repair now, not after the delayed
            // acknowledgement (which an engine that stops driving the connection,
            // its peer having closed, would never send).
            self.ack_now = true;
        }
        self.accept_in_order(h.flags, h.kind == PacketKind::Fin, payload, deliver)
    }

    /// Takes the packet at `rcv_next`: delivers, or adds to the frame being
    /// reassembled.
    fn accept_in_order(
        &mut self,
        flags: u8,
        fin: bool,
        payload: &[u8],
        deliver: &mut dyn FnMut(&RxFrame<'_>),
    ) -> Result<bool, DeviceError> {
        self.rcv_next = self.rcv_next.wrapping_add(1);
        self.rstats.packets_delivered += 1;
        self.rx_unacked += 1;
        if fin {
            if self.reasm_active {
                return Err(self.corrupt("FIN inside a fragmented frame"));
            }
            self.peer_fin = true;
            self.ack_now = true;
            return Ok(false);
        }
        let first = flags & FLAG_FIRST != 0;
        let last = flags & FLAG_LAST != 0;
        if first == self.reasm_active {
            return Err(self.corrupt("fragment out of place"));
        }
        if first && last {
            hand_over(payload, deliver);
            self.frame_delivered();
            return Ok(true);
        }
        if first {
            self.reasm.clear();
            self.reasm_active = true;
        }
        if self.reasm.len() + payload.len() > self.cfg.max_frame {
            return Err(self.corrupt("reassembled frame exceeds the maximum"));
        }
        self.reasm.extend_from_slice(payload);
        if last {
            self.reasm_active = false;
            hand_over(&self.reasm, deliver);
            self.frame_delivered();
            return Ok(true);
        }
        Ok(false)
    }

    fn frame_delivered(&mut self) {
        self.rstats.frames_delivered += 1;
        self.dstats.frames_received += 1;
    }

    /// Delivers held packets whose gap has filled, up to and including one frame.
    fn deliver_held(&mut self, deliver: &mut dyn FnMut(&RxFrame<'_>)) -> Result<bool, DeviceError> {
        let w = self.held.len();
        while self.held_count > 0 {
            let i = self.rcv_next as usize % w;
            let Some(p) = self.held[i].take() else { return Ok(false) };
            self.held_count -= 1;
            // The repaired stream is acknowledged as far as it is delivered, frame
            // by frame (one frame per call): the acknowledgement sent when the gap
            // filled covered only the first, and the last frame may end the
            // connection (then nothing sends a delayed acknowledgement).
            self.ack_now = true;
            let r = self.accept_in_order(p.flags, p.fin, &p.data, deliver);
            self.spare.push(p.data);
            if r? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Nanoseconds of link time from `now` until a timer needs a pass.
    fn next_timer(&self, now: u64) -> Option<u64> {
        if self.dead.is_some() {
            return None;
        }
        if !self.resend.is_empty() {
            // Queued packets go when the pacer lets them (at once without pacing).
            return Some(if self.cc.is_some() { self.pacer.next_send_ns().saturating_sub(now) } else { 0 });
        }
        let mut t = u64::MAX;
        if let Some(s) = self.unanswered_since {
            t = t.min(s + self.cfg.liveness_ns);
        }
        if !self.established {
            t = t.min(self.last_syn_ns + self.current_rto());
            return Some(t.saturating_sub(now));
        }
        if let Some(p) = self.inflight.iter().find(|p| !p.sacked && p.sent_ns != 0) {
            t = t.min(p.sent_ns.max(self.progress_ns) + self.current_rto());
        }
        if let Some(probe) = self.probe_due() {
            t = t.min(probe);
        }
        if let Some(p) =
            self.inflight.iter().take(self.sacked_above).find(|p| !p.sacked && !p.queued && p.sent_ns != 0)
        {
            t = t.min(p.sent_ns + self.srtt_ns.max(self.cfg.rto_min_ns / 4) + self.reorder_window());
        }
        if self.ack_now {
            return Some(0);
        }
        if self.rx_unacked > 0 {
            t = t.min(self.ack_due_ns.unwrap_or(now + self.cfg.ack_delay_ns));
        }
        if !self.peer_fin {
            t = t.min(self.last_heard_ns.max(self.last_ping_ns) + self.cfg.keepalive_ns);
        }
        Some(t.saturating_sub(now))
    }
}

fn hand_over(bytes: &[u8], deliver: &mut dyn FnMut(&RxFrame<'_>)) {
    // SAFETY: `bytes` is a live slice for the duration of the call.
    let f = unsafe { RxFrame::from_raw(bytes.as_ptr(), bytes.len()) };
    deliver(&f);
}

/// Scratch list of payload addresses, filled and used within one `send_frame`.
struct Pieces(Vec<*mut u8>);

// SAFETY: the pointers are written and dereferenced only inside one `send_frame`
// call, on the thread that owns the device; between calls they are stale values
// nobody reads, so moving the device to another thread moves no live reference.
unsafe impl Send for Pieces {}

/// A reliable, ordered frame device over a lossy link. See the module docs.
pub struct Reliable<L: Link> {
    link: L,
    c: Conn,
    /// Largest piece of a frame one packet carries.
    max_piece: usize,
    /// What the CRC of an outgoing packet covers.
    coverage: CrcCoverage,
    /// Bytes after the payload: the tag on an authenticated connection, else 0.
    trailer: usize,
    /// Slots, and their payload areas, of a frame being cut into packets.
    slots: Vec<u32>,
    pieces: Pieces,
    unflushed: bool,
    /// The unflushed packets start a new flight (the first of them went out with
    /// nothing unacknowledged before it): the link is pushed, not flushed.
    push: bool,
    since_timers: u32,
    /// When the timers last ran: a long gap means this side was not listening.
    last_pass_ns: u64,
}

impl<L: Link> Reliable<L> {
    /// Wraps a link and starts the connection handshake (both sides do the same).
    /// The connection nonce is `cfg.nonce`, or drawn from the kernel's random pool.
    pub fn new(link: L, cfg: ReliableConfig) -> Self {
        let nonce = cfg.nonce.unwrap_or_else(random_u64);
        Self::with_nonce(link, cfg, nonce)
    }

    /// [`Reliable::new`] with the connection nonce (connection id and first
    /// sequence number) from the caller, whatever `cfg.nonce` says: draws no
    /// randomness, so a caller with a seeded generator (the simulator) gets the same
    /// connection from the same seed. Time comes from the link ([`Link::now_ns`]).
    pub fn with_nonce(link: L, cfg: ReliableConfig, nonce: u64) -> Self {
        let my_id = (nonce as u32).max(1);
        let isn = (nonce >> 32) as u32;
        // At most the link's slots less 16 (see `Link::tx_slots`): a larger window
        // could livelock on slots held by its own unacknowledged packets.
        let slot_cap = link.tx_slots().map_or(32768, |s| s.saturating_sub(16).clamp(2, 32768) as u32);
        let window = cfg.window.clamp(2, 32768).min(slot_cap);
        let trailer = if cfg.auth.is_some() { TAG_LEN } else { 0 };
        let max_piece = link.mtu().saturating_sub(PACKET_HEADER_LEN + trailer).clamp(1, u16::MAX as usize);
        let now = link.now_ns();
        let rto = cfg.rto_initial_ns;
        // A frame must fit in half the window, or it could never be sent while
        // anything else is unacknowledged.
        let max_frame = cfg.max_frame.clamp(1, (window as usize / 2).max(1) * max_piece);
        let carrier_checked = link.carrier_checksum();
        let coverage =
            if carrier_checked && !cfg.payload_crc { CrcCoverage::Header } else { CrcCoverage::Full };
        let c = Conn {
            carrier_checked,
            cfg: ReliableConfig { window, max_frame, ..cfg },
            my_id,
            peer_id: 0,
            peer_knows_me: false,
            established: false,
            dead: None,
            closing: false,
            fin_queued: false,
            fin_tries: 0,
            peer_fin: false,
            isn,
            snd_una: isn.wrapping_add(1),
            snd_next: isn.wrapping_add(1),
            peer_window: window,
            inflight: VecDeque::new(),
            resend: VecDeque::new(),
            srtt_ns: 0,
            rttvar_ns: 0,
            rto_ns: rto,
            backoff: 0,
            last_syn_ns: 0,
            last_ping_ns: 0,
            unanswered_since: None,
            sacked_above: 0,
            rack_sent_ns: 0,
            progress_ns: 0,
            last_tx_ns: 0,
            tlp_seq: None,
            cc: match cfg.congestion {
                Congestion::Cubic => Some(Cubic::new()),
                Congestion::Off => None,
            },
            pacer: Pacer::new(),
            full_len: link.mtu(),
            sacked_count: 0,
            unsent: 0,
            recovery_until: None,
            release: Vec::new(),
            reset_to: None,
            syn_now: false,
            last_reset_ns: 0,
            rcv_next: 0,
            held: (0..window).map(|_| None).collect(),
            held_count: 0,
            reasm: Vec::new(),
            reasm_active: false,
            rx_unacked: 0,
            ack_due_ns: None,
            ack_now: false,
            ts_to_echo: 0,
            ce_to_echo: 0,
            ce_echo_seen: 0,
            ack_sent: 0,
            ack_flushed: 0,
            last_heard_ns: now,
            spare: Vec::new(),
            dstats: DeviceStats::default(),
            rstats: ReliableStats::default(),
        };
        let mut r = Reliable {
            link,
            c,
            max_piece,
            coverage,
            trailer,
            slots: Vec::new(),
            pieces: Pieces(Vec::new()),
            unflushed: false,
            push: false,
            since_timers: 0,
            last_pass_ns: now,
        };
        r.send_syn(now);
        let _ = r.flush_link();
        r
    }

    /// True once both sides know each other.
    pub fn is_established(&self) -> bool {
        self.c.established
    }

    /// Drives the handshake of two ends of one connection until both are
    /// established, calling `step` between passes to let time pass (advance a
    /// virtual clock, or sleep); at most `passes` passes. True if they made it.
    /// For tests and harnesses that hold both ends (the conformance suites).
    ///
    /// # Panics
    /// If a frame arrives during the handshake (nothing was sent), or a pass fails.
    pub fn handshake(a: &mut Self, b: &mut Self, passes: usize, mut step: impl FnMut(&Self, &Self)) -> bool {
        for _ in 0..passes {
            if a.is_established() && b.is_established() {
                return true;
            }
            for d in [&mut *a, &mut *b] {
                while d
                    .recv_frame(&mut |_| panic!("a frame arrived during the handshake"))
                    .expect("handshake")
                {}
                d.doorbell().expect("handshake doorbell");
            }
            step(a, b);
        }
        a.is_established() && b.is_established()
    }

    /// Why the connection ended, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.c.dead.as_deref()
    }

    /// The link.
    pub fn link(&self) -> &L {
        &self.link
    }

    /// The link, mutably (for link-specific settings).
    pub fn link_mut(&mut self) -> &mut L {
        &mut self.link
    }

    /// Counters.
    pub fn rstats(&self) -> ReliableStats {
        let mut s = self.c.rstats;
        s.srtt_ns = self.c.srtt_ns;
        if let Some(cc) = &self.c.cc {
            s.cwnd = cc.window();
            (s.cc_reductions, s.cc_timeouts) = cc.events();
        }
        s.link = self.link.stats();
        s
    }

    /// Packets sent and not yet acknowledged.
    pub fn unacked(&self) -> usize {
        self.c.inflight.len()
    }

    /// Sends an unsequenced packet (SYN, ACK, PING, RESET) from a fresh slot,
    /// released at once. False if the link had no slot or no ring room.
    fn send_control(&mut self, h: PacketHeader, payload: &[u8]) -> bool {
        let len = PACKET_HEADER_LEN + payload.len() + self.trailer;
        if len > self.link.mtu() {
            return false;
        }
        let Some(slot) = self.link.tx_alloc() else { return false };
        let b = self.link.tx_buf(slot);
        h.encode(b);
        b[PACKET_HEADER_LEN..PACKET_HEADER_LEN + payload.len()].copy_from_slice(payload);
        Self::seal(&self.c.cfg.auth, self.coverage, &mut b[..len]);
        let sent = match self.link.send(slot, len) {
            Ok(ok) => ok,
            Err(e) => {
                self.link_failed(e);
                false
            }
        };
        self.link.tx_release(slot);
        self.unflushed |= sent;
        sent
    }

    fn send_syn(&mut self, now: u64) {
        let payload = (self.c.cfg.max_frame as u32).to_le_bytes();
        let h = self.c.header(PacketKind::Syn, FLAG_ACK_NOW, self.c.isn, payload.len(), now);
        if self.send_control(h, &payload) {
            self.c.last_syn_ns = now;
            self.c.rstats.probes_sent += 1;
            self.c.unanswered_since.get_or_insert(now);
        }
    }

    fn send_ack(&mut self, now: u64) {
        let h = self.c.header(PacketKind::Ack, 0, self.c.snd_next, 0, now);
        if self.send_control(h, &[]) {
            self.c.rstats.acks_sent += 1;
            self.c.acked_now();
        }
    }

    /// Writes the header of a sequenced packet whose payload is already in `slot`,
    /// and queues it.
    fn push_packet(&mut self, slot: u32, kind: PacketKind, flags: u8, payload_len: usize, now: u64) {
        let seq = self.c.snd_next;
        self.c.snd_next = seq.wrapping_add(1);
        let h = self.c.header(kind, flags, seq, payload_len, now);
        let len = PACKET_HEADER_LEN + payload_len + self.trailer;
        let b = self.link.tx_buf(slot);
        h.encode(b);
        Self::seal(&self.c.cfg.auth, self.coverage, &mut b[..len]);
        self.c.inflight.push_back(TxPkt {
            seq,
            slot: Some(slot),
            len,
            sent_ns: 0,
            built_ack: h.ack,
            sacked: false,
            queued: true,
            retx: 0,
            rto_pending: false,
            fin: kind == PacketKind::Fin,
        });
        self.c.resend.push_back(seq);
        self.c.unsent += 1;
        self.c.rstats.packets_sent += 1;
    }

    /// Seals a packet: CRC, and the tag on an authenticated connection (the packet
    /// then ends with room for it).
    #[inline]
    fn seal(auth: &Option<PacketAuth>, coverage: CrcCoverage, p: &mut [u8]) {
        match auth {
            None => packet::seal_with(p, coverage),
            Some(a) => packet::seal_auth(p, &a.tx),
        }
    }

    /// Hands queued packets to the link until its ring is full.
    fn pump(&mut self, now: u64) -> Result<(), DeviceError> {
        let c = &mut self.c;
        let interval = c.pacing_interval();
        while let Some(&seq) = c.resend.front() {
            let i = seq.wrapping_sub(c.snd_una) as usize;
            let Some(p) = c.inflight.get_mut(i).filter(|p| p.seq == seq) else {
                c.resend.pop_front();
                continue;
            };
            let Some(slot) = p.slot.filter(|_| !p.sacked) else {
                p.queued = false;
                c.resend.pop_front();
                continue;
            };
            if c.cc.is_some() && !c.pacer.ready(now) {
                // Comes back at `next_timer`'s pacing time.
                break;
            }
            let first = p.sent_ns == 0;
            match self.link.send(slot, p.len) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => return Err(self.link_failed(e)),
            }
            p.sent_ns = now.max(1);
            if first {
                c.unsent -= 1;
                // Nothing before it is unacknowledged: a new flight, which the
                // peer is likely waiting for (Nagle's condition, used the other
                // way round: this one leaves at once, without moderation).
                self.push |= i == 0;
            }
            p.rto_pending = false;
            c.last_tx_ns = now;
            c.pacer.on_send(now, p.len, c.full_len, interval);
            p.queued = false;
            if p.fin && !first {
                c.fin_tries += 1;
            }
            if first && p.built_ack == c.rcv_next && c.held_count == 0 {
                // The packet carried an up-to-date acknowledgement.
                c.acked_now();
            }
            c.resend.pop_front();
            self.unflushed = true;
            c.unanswered_since.get_or_insert(now);
        }
        Ok(())
    }

    fn flush_link(&mut self) -> Result<(), DeviceError> {
        if self.unflushed {
            self.unflushed = false;
            self.c.ack_flushed = self.c.ack_sent;
            let r = if std::mem::take(&mut self.push) { self.link.push() } else { self.link.flush() };
            if let Err(e) = r {
                return Err(self.link_failed(e));
            }
        }
        Ok(())
    }

    fn link_failed(&mut self, e: LinkError) -> DeviceError {
        self.c.fail(format!("link failed: {e}"));
        self.c.error()
    }

    /// Does the link work that datagram handling recorded.
    fn settle(&mut self, now: u64) {
        for slot in self.c.release.drain(..) {
            self.link.tx_release(slot);
        }
        if self.c.syn_now {
            self.c.syn_now = false;
            // At most one repeat per minimum RTO, whoever replays the peer's SYN.
            if now.saturating_sub(self.c.last_syn_ns) >= self.c.cfg.rto_min_ns {
                self.send_syn(now);
            }
        }
        if let Some(to) = self.c.reset_to.take() {
            if now.saturating_sub(self.c.last_reset_ns) >= self.c.cfg.rto_min_ns {
                self.c.last_reset_ns = now;
                let mut h = self.c.header(PacketKind::Reset, 0, 0, 0, now);
                h.dst_id = to;
                self.send_control(h, &[]);
            }
        }
    }

    /// One receive step: a held packet whose gap filled, else datagrams from the
    /// link until one frame is delivered or the link is empty.
    fn receive(&mut self, deliver: &mut dyn FnMut(&RxFrame<'_>), now: u64) -> Result<bool, DeviceError> {
        if self.c.held_count > 0 && self.c.deliver_held(deliver)? {
            return Ok(true);
        }
        for _ in 0..BATCH {
            let c = &mut self.c;
            let mut res = Ok(false);
            let got = self.link.recv(&mut |d| {
                // A data packet came off the link (the kind byte read unchecked: it
                // only places a time stamp; everything is checked next).
                strait_probe::probe!(if d.get(1) == Some(&(PacketKind::Data as u8)) => strait_probe::Stage::RxFound);
                res = c.on_datagram(d, now, deliver)
            });
            self.c.note_ce(self.link.ce_marked());
            self.settle(now);
            match got {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(e) => return Err(self.link_failed(e)),
            }
            if res? {
                return Ok(true);
            }
            if self.c.held_count > 0 && self.c.deliver_held(deliver)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Handshake repeats, retransmission timeout, keepalive, liveness, delayed
    /// acknowledgement; then hands queued packets to the link.
    fn on_timers(&mut self, now: u64) -> Result<(), DeviceError> {
        self.since_timers = 0;
        if self.c.dead.is_some() {
            return Err(self.c.error());
        }
        // Silence only counts while we listen: after a long pause of our own (the
        // program did not drive its worker), the peer gets a fresh chance to answer.
        let away = 2 * self.c.cfg.keepalive_ns.max(self.c.cfg.rto_max_ns);
        if now.saturating_sub(self.last_pass_ns) > away && self.c.unanswered_since.is_some() {
            self.c.unanswered_since = Some(now);
            self.c.last_ping_ns = 0;
        }
        self.last_pass_ns = now;
        if let Some(t) = self.c.unanswered_since {
            if now.saturating_sub(t) >= self.c.cfg.liveness_ns {
                let what = if self.c.established { "peer" } else { "connection setup" };
                self.c.fail(format!("no answer from the {what} for {} ms", (now - t) / 1_000_000));
                return Err(self.c.error());
            }
        }
        if !self.c.established {
            if now.saturating_sub(self.c.last_syn_ns) >= self.c.current_rto() {
                self.c.backoff = (self.c.backoff + 1).min(6);
                // A path that drops ECN-capable datagrams never answers: after a few
                // unanswered tries, the rest go without the mark.
                if self.c.backoff == ECN_FALLBACK_AFTER && self.link.ecn_off() {
                    self.c.rstats.ecn_fallbacks += 1;
                }
                self.send_syn(now);
            }
            if self.c.ack_now && self.c.peer_id != 0 {
                // Answers the peer's SYN so that it learns it reached us.
                self.send_ack(now);
            }
            return Ok(());
        }
        if self.c.probe_due().is_some_and(|t| now >= t) {
            // Tail loss probe (RFC 8985 section 7): nothing was heard for two round
            // trips and nothing new waits to go, so the last packet out is sent
            // again; its acknowledgement reveals any earlier holes to the
            // selective acknowledgements (fast recovery, one reduction) where the
            // timeout would have restarted from one packet. The probe itself
            // reduces nothing: without duplicate reports the sender cannot tell a
            // repaired tail from a late acknowledgement, and a window cut for
            // every late acknowledgement starved a flow on a LAN (64 KiB messages
            // across veth at a 15th of their rate).
            let c = &mut self.c;
            if let Some(p) = c.inflight.iter_mut().rev().find(|p| !p.sacked && !p.queued && p.sent_ns != 0) {
                p.queued = true;
                p.retx += 1;
                c.tlp_seq = Some(p.seq);
                // Ahead of new data the pacer holds back.
                c.resend.push_front(p.seq);
                c.rstats.tail_probes += 1;
            }
        }
        let rto = self.c.current_rto();
        let progress = self.c.progress_ns;
        let mut expired = false;
        let mut due = Vec::new();
        for p in self.c.inflight.iter_mut().filter(|p| !p.sacked).take(BATCH) {
            let since = p.sent_ns.max(progress);
            if p.retx == 0 && p.sent_ns != 0 && now.saturating_sub(since) < rto {
                // Packets after it went out later (first transmissions in order,
                // retransmissions later still): none of them is due either.
                break;
            }
            if !p.queued && p.sent_ns != 0 && now.saturating_sub(since) >= rto {
                p.queued = true;
                p.retx += 1;
                p.rto_pending = true;
                due.push(p.seq);
                self.c.rstats.timeout_retransmits += 1;
                expired = true;
            }
        }
        // Oldest first, ahead of new data the congestion window holds back.
        for &seq in due.iter().rev() {
            self.c.resend.push_front(seq);
        }
        if expired {
            self.c.tlp_seq = None;
            self.c.backoff = (self.c.backoff + 1).min(16);
            if let Some(cc) = &mut self.c.cc {
                cc.on_timeout();
            }
            self.c.recovery_until = Some(self.c.sent_next());
        }
        self.c.fast_retransmit(now);
        if !self.c.peer_fin
            && now.saturating_sub(self.c.last_heard_ns) >= self.c.cfg.keepalive_ns
            && now.saturating_sub(self.c.last_ping_ns) >= self.c.cfg.keepalive_ns
        {
            let h = self.c.header(PacketKind::Ping, FLAG_ACK_NOW, self.c.snd_next, 0, now);
            if self.send_control(h, &[]) {
                self.c.last_ping_ns = now;
                self.c.rstats.probes_sent += 1;
                self.c.unanswered_since.get_or_insert(now);
            }
        }
        self.pump(now)?;
        self.ack_if_due(now);
        Ok(())
    }

    fn ack_if_due(&mut self, now: u64) {
        let c = &mut self.c;
        if c.rx_unacked > 0 && c.ack_due_ns.is_none() {
            c.ack_due_ns = Some(now + c.cfg.ack_delay_ns);
        }
        if c.peer_id != 0
            && (c.ack_now || c.rx_unacked >= c.cfg.ack_every || c.ack_due_ns.is_some_and(|t| now >= t))
        {
            self.send_ack(now);
        }
    }

    fn queue_fin(&mut self, now: u64) {
        if self.c.fin_queued || !self.c.established || self.c.dead.is_some() {
            return;
        }
        let Some(slot) = self.link.tx_alloc() else { return };
        self.c.fin_queued = true;
        self.push_packet(slot, PacketKind::Fin, 0, 0, now);
    }
}

impl<L: Link> Device for Reliable<L> {
    fn max_frame_len(&self) -> usize {
        self.c.cfg.max_frame
    }

    /// Half the packet window (256 at the default 512): every message takes at
    /// least one packet, so more would not help, and with the default 64 credits a
    /// stream of small messages waited for a credit return every 32 messages, each
    /// a doorbell on both sides (docs/PERFORMANCE.md section 7).
    fn credits_hint(&self) -> Option<u16> {
        Some((self.c.cfg.window / 2).min(u32::from(u16::MAX)) as u16)
    }

    fn send_frame(
        &mut self,
        len: usize,
        fill: &mut dyn FnMut(&mut FrameWriter<'_>),
    ) -> Result<bool, DeviceError> {
        if self.c.dead.is_some() {
            return Err(self.c.error());
        }
        if len > self.c.cfg.max_frame {
            return Err(DeviceError::FrameTooLong { len, max: self.c.cfg.max_frame });
        }
        if !self.c.established || self.c.closing {
            return Ok(false);
        }
        let pieces = len.div_ceil(self.max_piece).max(1);
        // A frame larger than the peer's window still goes when nothing else is
        // unacknowledged, so no frame can wait forever.
        if !self.c.frame_fits(pieces) {
            return Ok(false);
        }
        let now = self.link.now_ns();
        self.slots.clear();
        for _ in 0..pieces {
            match self.link.tx_alloc() {
                Some(s) => self.slots.push(s),
                None => {
                    for s in self.slots.drain(..) {
                        self.link.tx_release(s);
                    }
                    return Ok(false);
                }
            }
        }
        if pieces == 1 {
            let slot = self.slots[0];
            let b = &mut self.link.tx_buf(slot)[PACKET_HEADER_LEN..PACKET_HEADER_LEN + len];
            // SAFETY: `b` is an exclusively borrowed slice of exactly `len` bytes that
            // lives until `fill` returns.
            let mut w = unsafe { FrameWriter::from_raw(b.as_mut_ptr(), len) };
            fill(&mut w);
            self.push_packet(slot, PacketKind::Data, FLAG_FIRST | FLAG_LAST, len, now);
        } else {
            // The engine writes straight into the packets' payload areas.
            self.pieces.0.clear();
            for &slot in &self.slots {
                self.pieces.0.push(self.link.tx_buf(slot)[PACKET_HEADER_LEN..].as_mut_ptr());
            }
            // SAFETY: each pointer starts `max_piece` (<= mtu - header) writable bytes
            // of a distinct slot this device holds, whose memory stays in place while
            // allocated (`Link::tx_buf`); nothing else touches them during `fill`.
            let mut w = unsafe { FrameWriter::from_pieces(&self.pieces.0, self.max_piece, len) };
            fill(&mut w);
            for k in 0..pieces {
                let start = k * self.max_piece;
                let end = (start + self.max_piece).min(len);
                let mut flags = 0;
                if k == 0 {
                    flags |= FLAG_FIRST;
                }
                if k == pieces - 1 {
                    flags |= FLAG_LAST;
                }
                self.push_packet(self.slots[k], PacketKind::Data, flags, end - start, now);
            }
        }
        // The frame is in its packets, headers and checksums built: what follows is
        // the link's (queue, then the send call at the doorbell).
        strait_probe::probe!(strait_probe::Stage::DevFilled);
        self.c.rstats.frames_sent += 1;
        self.c.dstats.frames_sent += 1;
        self.pump(now)?;
        Ok(true)
    }

    fn recv_frame(&mut self, handle: &mut dyn FnMut(&RxFrame<'_>)) -> Result<bool, DeviceError> {
        if self.c.dead.is_some() {
            return Err(self.c.error());
        }
        let now = self.link.now_ns();
        let got = self.receive(handle, now)?;
        self.since_timers += 1;
        if !got || self.since_timers >= TIMER_EVERY {
            self.on_timers(now)?;
        } else {
            self.ack_if_due(now);
        }
        // Acknowledgements queued while datagrams keep arriving go out when the link
        // runs dry, one doorbell for all, unless they already cover half the window:
        // then the sender may be about to stall (a receiver slower than its sender
        // would otherwise let it send only a window per handling of a window).
        let behind = self.c.ack_sent.wrapping_sub(self.c.ack_flushed);
        if !got || behind >= self.c.cfg.window / 2 {
            self.flush_link()?;
        }
        Ok(got)
    }

    fn doorbell(&mut self) -> Result<(), DeviceError> {
        if self.c.dead.is_some() {
            return Err(self.c.error());
        }
        if !self.c.resend.is_empty() || self.c.ack_now {
            let now = self.link.now_ns();
            self.pump(now)?;
            self.ack_if_due(now);
        }
        self.flush_link()
    }

    fn arm_sleep(&mut self) -> Result<bool, DeviceError> {
        if self.c.dead.is_some() {
            return Err(self.c.error());
        }
        if self.c.held_count > 0 && self.c.held[self.c.rcv_next as usize % self.c.held.len()].is_some() {
            return Ok(false);
        }
        self.flush_link()?;
        self.link.arm_sleep().map_err(|e| self.link_failed(e))
    }

    fn disarm_sleep(&mut self) {
        self.link.disarm_sleep();
    }

    fn event_fd(&self) -> Option<RawFd> {
        self.link.event_fd()
    }

    fn check_peer(&mut self) -> Result<(), DeviceError> {
        if self.c.peer_fin && self.c.held_count == 0 {
            self.c.fail("peer closed the connection".into());
        }
        let now = self.link.now_ns();
        self.on_timers(now)?;
        self.flush_link()
    }

    fn shutdown(&mut self) {
        if self.c.closing {
            return;
        }
        self.c.closing = true;
        let now = self.link.now_ns();
        self.queue_fin(now);
        let _ = self.pump(now);
        let _ = self.flush_link();
    }

    fn drain(&mut self) -> bool {
        if self.c.dead.is_some() || !self.c.established {
            return false;
        }
        let now = self.link.now_ns();
        // The engine is gone: frames still arriving are acknowledged and dropped.
        for _ in 0..BATCH {
            match self.receive(&mut |_| {}, now) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(_) => return false,
            }
        }
        self.queue_fin(now);
        if self.on_timers(now).is_err() || self.flush_link().is_err() {
            return false;
        }
        let only_fin_left = self.c.inflight.iter().all(|p| p.fin);
        !(self.c.inflight.is_empty() || (only_fin_left && self.c.fin_tries >= FIN_TRIES))
    }

    fn timer_ns(&self) -> Option<u64> {
        self.c.next_timer(self.link.now_ns())
    }

    fn stats(&self) -> DeviceStats {
        let mut s = self.c.dstats;
        s.wakeups_sent = self.link.stats().doorbells;
        s
    }

    fn describe(&self) -> String {
        let c = &self.c;
        format!(
            "established={} dead={:?} unacked={} queued={} unsent={} sacked={} recovery={} pacer_in_us={} \
             peer_window={} snd_una={} snd_next={} rcv_next={} \
             held={} rx_unacked={} ack_now={} unanswered_for_ms={:?} rto_us={} srtt_us={} {:?}",
            c.established,
            c.dead,
            c.inflight.len(),
            c.resend.len(),
            c.unsent,
            c.sacked_count,
            c.recovery_until.is_some(),
            c.pacer.next_send_ns().saturating_sub(self.link.now_ns()) / 1000,
            c.peer_window,
            c.snd_una,
            c.snd_next,
            c.rcv_next,
            c.held_count,
            c.rx_unacked,
            c.ack_now,
            c.unanswered_since.map(|t| self.link.now_ns().saturating_sub(t) / 1_000_000),
            c.current_rto() / 1000,
            c.srtt_ns / 1000,
            self.rstats()
        )
    }
}
