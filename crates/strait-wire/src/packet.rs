//! The packet header of strait's reliability layer, used over every lossy carrier
//! (UDP, raw Ethernet, the simulator).
//!
//! A packet is this fixed 48-byte header followed by up to `len` payload bytes: one
//! piece of an engine frame (or nothing, for control packets). Every packet carries
//! a cumulative acknowledgement and a 64-packet selective-acknowledgement bitmap, so
//! acknowledgements ride on data whenever data flows. The CRC32C covers the header
//! (with the CRC field zero) and the payload; a packet whose CRC does not match is
//! dropped before any field is trusted. Over a carrier that checks every datagram's
//! bytes itself (UDP's checksum, verified by the kernel or the NIC) the sender may
//! set [`FLAG_HEADER_CRC`]: the CRC then covers the header only, and only a receiver
//! that trusts its carrier the same way ([`open_with`]) accepts such a packet.
//!
//! Between hosts that share a secret, packets are authenticated as well
//! ([`seal_auth`], [`open_auth`]): [`FLAG_MAC`] is set and the packet ends with a
//! [`TAG_LEN`]-byte HMAC-SHA256 tag (see [`crate::auth`]) over the header (CRC
//! included) and the payload, under a key of that connection and direction. The
//! CRC then covers the header only (the tag covers the payload). A receiver with a
//! key drops every packet without a valid tag before it trusts any field; a
//! receiver without one refuses packets that carry a tag. Packets sealed without a
//! key are byte for byte what they were before.
//!
//! Layout (little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version ([`PACKET_VERSION`]) |
//! | 1 | 1 | kind ([`PacketKind`]) |
//! | 2 | 1 | flags ([`FLAG_FIRST`], [`FLAG_LAST`], [`FLAG_ACK_NOW`], [`FLAG_HEADER_CRC`], [`FLAG_MAC`]) |
//! | 3 | 1 | reserved, zero |
//! | 4 | 4 | destination connection id (0 in a first SYN) |
//! | 8 | 4 | source connection id |
//! | 12 | 4 | sequence number (Data, Fin, Syn) |
//! | 16 | 4 | cumulative ack: next sequence number expected |
//! | 20 | 8 | selective ack: bit i set = packet `ack + 1 + i` received |
//! | 28 | 2 | payload length |
//! | 30 | 2 | receive window, packets |
//! | 32 | 4 | timestamp, microseconds of the sender's clock |
//! | 36 | 4 | echoed timestamp (for round-trip time) |
//! | 40 | 4 | CRC32C |
//! | 44 | 4 | CE echo: packets the sender received marked Congestion Experienced (ECN), cumulative, wrapping |
//! | 48 | `len` | payload |
//! | 48 + `len` | 16 | HMAC-SHA256 tag, truncated (only with [`FLAG_MAC`]) |

use thiserror::Error;

pub use crate::auth::{PacketKey, TAG_LEN};

/// Version of the packet format.
pub const PACKET_VERSION: u8 = 1;
/// Length of the packet header.
pub const PACKET_HEADER_LEN: usize = 48;
/// This packet holds the first piece of an engine frame.
pub const FLAG_FIRST: u8 = 1;
/// This packet holds the last piece of an engine frame.
pub const FLAG_LAST: u8 = 2;
/// The receiver should acknowledge at once (a probe, or a packet after a gap).
pub const FLAG_ACK_NOW: u8 = 4;
/// The CRC covers the header only: the carrier vouches for the payload. Set by
/// [`seal_with`]; refused by [`open`], accepted by [`open_with`] when the receiver's
/// carrier checks payloads too.
pub const FLAG_HEADER_CRC: u8 = 8;
/// The packet ends with a [`TAG_LEN`]-byte authentication tag ([`seal_auth`]).
pub const FLAG_MAC: u8 = 16;
const KNOWN_FLAGS: u8 = FLAG_FIRST | FLAG_LAST | FLAG_ACK_NOW | FLAG_HEADER_CRC | FLAG_MAC;
const CRC_OFFSET: usize = 40;

/// Packet kinds.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PacketKind {
    /// A piece of an engine frame; takes a sequence number.
    Data = 1,
    /// Acknowledgement only.
    Ack = 2,
    /// Connection setup: announces the sender's id, first sequence number and limits.
    Syn = 3,
    /// Liveness probe: asks for an acknowledgement.
    Ping = 4,
    /// Orderly end: no packet with a higher sequence number will follow. Takes a
    /// sequence number, so it is delivered after all data.
    Fin = 5,
    /// The sender has no state for this connection (it restarted or closed): the
    /// receiver's connection is dead.
    Reset = 6,
}

impl PacketKind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => PacketKind::Data,
            2 => PacketKind::Ack,
            3 => PacketKind::Syn,
            4 => PacketKind::Ping,
            5 => PacketKind::Fin,
            6 => PacketKind::Reset,
            _ => return None,
        })
    }

    /// True for kinds that occupy a sequence number.
    pub fn sequenced(self) -> bool {
        matches!(self, PacketKind::Data | PacketKind::Fin)
    }
}

/// A decoded packet header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketHeader {
    /// Kind.
    pub kind: PacketKind,
    /// Flags.
    pub flags: u8,
    /// Connection id of the receiver (0 before the sender learned it).
    pub dst_id: u32,
    /// Connection id of the sender.
    pub src_id: u32,
    /// Sequence number.
    pub seq: u32,
    /// Next sequence number the sender expects from the receiver.
    pub ack: u32,
    /// Selective acknowledgement bitmap above `ack`.
    pub sack: u64,
    /// Payload length.
    pub len: u16,
    /// The sender's receive window, packets.
    pub window: u16,
    /// Sender's clock, microseconds (wrapping).
    pub ts: u32,
    /// The latest timestamp the sender received from the receiver.
    pub ts_echo: u32,
    /// How many of the receiver's packets the sender received marked Congestion
    /// Experienced by the path (ECN CE), cumulative and wrapping: the receiver
    /// reduces its congestion window when it grows, as for a loss. Zero on a path
    /// that never marked (or a carrier without ECN).
    pub ce_echo: u32,
}

/// Why a packet was refused.
#[derive(Debug, Error, PartialEq, Eq, Clone, Copy)]
pub enum PacketError {
    /// Shorter than a header.
    #[error("packet of {0} bytes is shorter than the header")]
    Short(usize),
    /// Unknown version.
    #[error("packet version {0} unknown")]
    Version(u8),
    /// Unknown kind.
    #[error("packet kind {0} unknown")]
    Kind(u8),
    /// Unknown flag bits or non-zero reserved bytes.
    #[error("packet has unknown flags or reserved bits set")]
    Reserved,
    /// The payload length field disagrees with the datagram length.
    #[error("packet claims {claimed} payload bytes, datagram holds {actual}")]
    Length {
        /// Claimed by the header.
        claimed: usize,
        /// Present in the datagram.
        actual: usize,
    },
    /// CRC mismatch: corrupted (or forged without care).
    #[error("packet checksum mismatch")]
    Checksum,
    /// The CRC covers only the header, and this receiver's carrier does not check
    /// payloads.
    #[error("packet's checksum covers only its header, and this carrier does not check payloads")]
    HeaderOnlyChecksum,
    /// The packet carries no authentication tag and this receiver requires one, or
    /// it carries one and this receiver has no key to check it.
    #[error("packet's authentication does not match the receiver's (tag missing or unexpected)")]
    Unauthenticated,
    /// The authentication tag does not match: forged, replayed from another
    /// connection, or sealed under another key.
    #[error("packet authentication tag mismatch")]
    BadMac,
}

/// What the CRC of a packet being sealed covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrcCoverage {
    /// Header and payload (every carrier).
    Full,
    /// The header only, with [`FLAG_HEADER_CRC`] set: for carriers that verify the
    /// payload themselves (UDP's checksum), where a second pass over every payload
    /// byte buys nothing.
    Header,
}

impl PacketHeader {
    /// Writes the header into `out[..PACKET_HEADER_LEN]` with a zero CRC; call
    /// [`seal`] once the payload is in place.
    ///
    /// # Panics
    /// If `out` is shorter than the header (a caller bug).
    pub fn encode(&self, out: &mut [u8]) {
        let o = &mut out[..PACKET_HEADER_LEN];
        o[0] = PACKET_VERSION;
        o[1] = self.kind as u8;
        o[2] = self.flags;
        o[3] = 0;
        o[4..8].copy_from_slice(&self.dst_id.to_le_bytes());
        o[8..12].copy_from_slice(&self.src_id.to_le_bytes());
        o[12..16].copy_from_slice(&self.seq.to_le_bytes());
        o[16..20].copy_from_slice(&self.ack.to_le_bytes());
        o[20..28].copy_from_slice(&self.sack.to_le_bytes());
        o[28..30].copy_from_slice(&self.len.to_le_bytes());
        o[30..32].copy_from_slice(&self.window.to_le_bytes());
        o[32..36].copy_from_slice(&self.ts.to_le_bytes());
        o[36..40].copy_from_slice(&self.ts_echo.to_le_bytes());
        o[40..44].fill(0);
        o[44..48].copy_from_slice(&self.ce_echo.to_le_bytes());
    }
}

/// Computes the CRC over `packet` (header and payload, CRC field taken as zero) and
/// stores it in the header.
///
/// # Panics
/// If `packet` is shorter than the header (a caller bug).
pub fn seal(packet: &mut [u8]) {
    seal_with(packet, CrcCoverage::Full);
}

/// [`seal`] with a choice of what the CRC covers; [`CrcCoverage::Header`] also sets
/// [`FLAG_HEADER_CRC`] in the header's flags.
///
/// # Panics
/// If `packet` is shorter than the header (a caller bug).
pub fn seal_with(packet: &mut [u8], coverage: CrcCoverage) {
    let crc = match coverage {
        CrcCoverage::Full => {
            packet[2] &= !FLAG_HEADER_CRC;
            packet_crc(packet)
        }
        CrcCoverage::Header => {
            packet[2] |= FLAG_HEADER_CRC;
            packet_crc(&packet[..PACKET_HEADER_LEN])
        }
    };
    packet[CRC_OFFSET..CRC_OFFSET + 4].copy_from_slice(&crc.to_le_bytes());
}

/// The CRC32C of `packet` with its CRC field taken as zero, in one pass: the header
/// (copied with the field zeroed, 48 bytes on the stack) and then the payload
/// straight from the buffer, three lanes wide (see [`crate::crc`]).
fn packet_crc(packet: &[u8]) -> u32 {
    let mut head = [0u8; PACKET_HEADER_LEN];
    head.copy_from_slice(&packet[..PACKET_HEADER_LEN]);
    head[CRC_OFFSET..CRC_OFFSET + 4].fill(0);
    let state = crate::crc::update(!0, &head);
    !crate::crc::update(state, &packet[PACKET_HEADER_LEN..])
}

/// Seals an authenticated packet: `packet` holds the header, the payload and
/// [`TAG_LEN`] bytes of room for the tag at its end. Sets [`FLAG_MAC`], the
/// header-only CRC ([`FLAG_HEADER_CRC`]: the tag covers the payload) and the tag
/// over everything before it, under `key`.
///
/// # Panics
/// If `packet` is shorter than the header and the tag (a caller bug).
pub fn seal_auth(packet: &mut [u8], key: &PacketKey) {
    let body = packet.len() - TAG_LEN;
    assert!(body >= PACKET_HEADER_LEN, "authenticated packet shorter than header and tag");
    packet[2] |= FLAG_MAC;
    seal_with(&mut packet[..body], CrcCoverage::Header);
    let tag = key.tag(&[&packet[..body]]);
    packet[body..].copy_from_slice(&tag[..TAG_LEN]);
}

/// Checks and decodes an authenticated datagram ([`seal_auth`]) under `key`: the tag
/// first, before any field is trusted, then everything [`open`] checks. The payload
/// is `datagram[PACKET_HEADER_LEN..PACKET_HEADER_LEN + len]`.
pub fn open_auth(datagram: &[u8], key: &PacketKey) -> Result<PacketHeader, PacketError> {
    if datagram.len() > 2 && datagram[2] & FLAG_MAC == 0 {
        return Err(PacketError::Unauthenticated);
    }
    if datagram.len() < PACKET_HEADER_LEN + TAG_LEN {
        return Err(PacketError::Short(datagram.len()));
    }
    let body = datagram.len() - TAG_LEN;
    if !key.verify(&[&datagram[..body]], &datagram[body..]) {
        return Err(PacketError::BadMac);
    }
    check(&datagram[..body], true)
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// Checks and decodes a received datagram: length, version, kind, reserved bits,
/// payload length and CRC. Returns the header; the payload is
/// `datagram[PACKET_HEADER_LEN..]`. A packet whose CRC covers only its header is
/// refused ([`PacketError::HeaderOnlyChecksum`]): see [`open_with`].
pub fn open(datagram: &[u8]) -> Result<PacketHeader, PacketError> {
    open_with(datagram, false)
}

/// [`open`] for a receiver whose carrier checks every datagram's payload itself
/// (`carrier_checked`): it also accepts packets sealed with [`CrcCoverage::Header`].
/// A packet with a tag ([`FLAG_MAC`]) is refused ([`PacketError::Unauthenticated`]):
/// see [`open_auth`].
pub fn open_with(datagram: &[u8], carrier_checked: bool) -> Result<PacketHeader, PacketError> {
    if datagram.len() > 2 && datagram[2] & FLAG_MAC != 0 {
        return Err(PacketError::Unauthenticated);
    }
    check(datagram, carrier_checked)
}

/// Everything but the tag: length, version, kind, reserved bits, payload length
/// and CRC.
fn check(datagram: &[u8], carrier_checked: bool) -> Result<PacketHeader, PacketError> {
    if datagram.len() < PACKET_HEADER_LEN {
        return Err(PacketError::Short(datagram.len()));
    }
    let b = datagram;
    if b[0] != PACKET_VERSION {
        return Err(PacketError::Version(b[0]));
    }
    let kind = PacketKind::from_u8(b[1]).ok_or(PacketError::Kind(b[1]))?;
    if b[2] & !KNOWN_FLAGS != 0 || b[3] != 0 {
        return Err(PacketError::Reserved);
    }
    let len = u16_at(b, 28);
    let actual = b.len() - PACKET_HEADER_LEN;
    if len as usize != actual {
        return Err(PacketError::Length { claimed: len as usize, actual });
    }
    let want = u32_at(b, CRC_OFFSET);
    let covered = if b[2] & FLAG_HEADER_CRC != 0 {
        if !carrier_checked {
            return Err(PacketError::HeaderOnlyChecksum);
        }
        &b[..PACKET_HEADER_LEN]
    } else {
        b
    };
    if packet_crc(covered) != want {
        return Err(PacketError::Checksum);
    }
    Ok(PacketHeader {
        kind,
        flags: b[2],
        dst_id: u32_at(b, 4),
        src_id: u32_at(b, 8),
        seq: u32_at(b, 12),
        ack: u32_at(b, 16),
        sack: u64::from_le_bytes([b[20], b[21], b[22], b[23], b[24], b[25], b[26], b[27]]),
        len,
        window: u16_at(b, 30),
        ts: u32_at(b, 32),
        ts_echo: u32_at(b, 36),
        ce_echo: u32_at(b, 44),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_matches_the_crate_over_the_zeroed_packet() {
        // The wire format is unchanged: the CRC is the crc32c crate's over the packet
        // with the CRC field zero, for every payload length.
        for len in 0..1_500usize {
            let mut p = vec![0u8; PACKET_HEADER_LEN + len];
            let mut h = sample();
            h.len = len as u16;
            h.encode(&mut p);
            for (i, b) in p[PACKET_HEADER_LEN..].iter_mut().enumerate() {
                *b = (i * 31 + len) as u8;
            }
            seal(&mut p);
            let got = u32_at(&p, CRC_OFFSET);
            let mut z = p.clone();
            z[CRC_OFFSET..CRC_OFFSET + 4].fill(0);
            assert_eq!(got, crc32c::crc32c(&z), "len {len}");
            assert!(open(&p).is_ok());
            // A payload byte, or a selective-ack byte when there is no payload.
            let at = if len > 0 { PACKET_HEADER_LEN + len / 2 } else { 21 };
            p[at] ^= 0x10;
            assert_eq!(open(&p).err(), Some(PacketError::Checksum), "len {len}");
        }
    }

    fn sample() -> PacketHeader {
        PacketHeader {
            kind: PacketKind::Data,
            flags: FLAG_FIRST | FLAG_LAST,
            dst_id: 0xdead_beef,
            src_id: 7,
            seq: 41,
            ack: 9,
            sack: 0b1011,
            len: 5,
            window: 256,
            ts: 123_456,
            ts_echo: 99,
            ce_echo: 0xdead_beef,
        }
    }

    fn packet(h: &PacketHeader, payload: &[u8]) -> Vec<u8> {
        let mut p = vec![0u8; PACKET_HEADER_LEN + payload.len()];
        h.encode(&mut p);
        p[PACKET_HEADER_LEN..].copy_from_slice(payload);
        seal(&mut p);
        p
    }

    #[test]
    fn round_trip() {
        let h = sample();
        let p = packet(&h, b"hello");
        assert_eq!(open(&p), Ok(h));
    }

    #[test]
    fn every_single_bit_flip_is_caught() {
        let p = packet(&sample(), b"hello");
        for bit in 0..p.len() * 8 {
            let mut q = p.clone();
            q[bit / 8] ^= 1 << (bit % 8);
            assert!(open(&q).is_err(), "flip of bit {bit} went unnoticed");
        }
    }

    #[test]
    fn header_coverage_is_accepted_only_by_a_checking_carrier() {
        let h = sample();
        let mut p = vec![0u8; PACKET_HEADER_LEN + 5];
        h.encode(&mut p);
        p[PACKET_HEADER_LEN..].copy_from_slice(b"hello");
        seal_with(&mut p, CrcCoverage::Header);
        assert_eq!(open(&p), Err(PacketError::HeaderOnlyChecksum));
        let got = open_with(&p, true).expect("header-only packet over a checking carrier");
        assert_eq!(got, PacketHeader { flags: h.flags | FLAG_HEADER_CRC, ..h });
        // Every header bit is still covered (a flip of the flag itself included) ...
        for bit in 0..PACKET_HEADER_LEN * 8 {
            let mut q = p.clone();
            q[bit / 8] ^= 1 << (bit % 8);
            assert!(open_with(&q, true).is_err(), "flip of header bit {bit} went unnoticed");
        }
        // ... the payload is the carrier's to check.
        let mut q = p.clone();
        q[PACKET_HEADER_LEN] ^= 1;
        assert!(open_with(&q, true).is_ok());
        // Resealing in full clears the flag; a full packet opens either way.
        seal_with(&mut p, CrcCoverage::Full);
        assert_eq!(open(&p), Ok(h));
        assert_eq!(open_with(&p, true), Ok(h));
    }

    fn auth_packet(h: &PacketHeader, payload: &[u8], key: &PacketKey) -> Vec<u8> {
        let mut p = vec![0u8; PACKET_HEADER_LEN + payload.len() + TAG_LEN];
        h.encode(&mut p);
        p[PACKET_HEADER_LEN..PACKET_HEADER_LEN + payload.len()].copy_from_slice(payload);
        seal_auth(&mut p, key);
        p
    }

    #[test]
    fn authenticated_packets_open_only_under_their_key() {
        let (k, other) = (PacketKey::new(b"connection key"), PacketKey::new(b"another key"));
        let h = sample();
        let p = auth_packet(&h, b"hello", &k);
        let got = open_auth(&p, &k).expect("own key");
        assert_eq!(got, PacketHeader { flags: h.flags | FLAG_MAC | FLAG_HEADER_CRC, ..h });
        assert_eq!(&p[PACKET_HEADER_LEN..PACKET_HEADER_LEN + got.len as usize], b"hello");
        // Another key (another connection, another secret): dropped.
        assert_eq!(open_auth(&p, &other), Err(PacketError::BadMac));
        // Every bit of header, payload and tag is covered, even where the CRC is not.
        for bit in 0..p.len() * 8 {
            let mut q = p.clone();
            q[bit / 8] ^= 1 << (bit % 8);
            assert!(open_auth(&q, &k).is_err(), "flip of bit {bit} went unnoticed");
        }
        // A forger who fixes the CRC after changing the payload still fails.
        let mut q = p.clone();
        q[PACKET_HEADER_LEN] ^= 1;
        let body = q.len() - TAG_LEN;
        seal_with(&mut q[..body], CrcCoverage::Header);
        assert_eq!(open_auth(&q, &k), Err(PacketError::BadMac));
        // An unauthenticated packet is refused by a keyed receiver, and a tagged one
        // by a receiver without a key.
        let plain = packet(&h, b"hello");
        assert_eq!(open_auth(&plain, &k), Err(PacketError::Unauthenticated));
        assert_eq!(open_with(&p, true), Err(PacketError::Unauthenticated));
        assert_eq!(open(&p), Err(PacketError::Unauthenticated));
    }

    #[test]
    fn malformed_packets_are_refused() {
        let p = packet(&sample(), b"hello");
        assert_eq!(open(&p[..10]), Err(PacketError::Short(10)));
        assert!(matches!(open(&p[..p.len() - 1]), Err(PacketError::Length { .. })));
        let mut q = p.clone();
        q[0] = 9;
        assert_eq!(open(&q), Err(PacketError::Version(9)));
        let mut q = p.clone();
        q[1] = 77;
        assert_eq!(open(&q), Err(PacketError::Kind(77)));
        let mut h = sample();
        h.len = 60000;
        let q = packet(&h, b"hello");
        assert!(matches!(open(&q), Err(PacketError::Length { claimed: 60000, actual: 5 })));
    }
}
