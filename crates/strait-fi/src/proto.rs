//! What travels between two strait-fi endpoints: endpoint names (the bytes
//! `fi_getname` returns and `fi_av_insert` takes) and the frames on a connection.
//!
//! Everything decoded here comes from another process (a name from the
//! application's address exchange, a frame from a peer): every field is checked
//! before use, and nothing here trusts a length it did not bound.

use std::net::Ipv4Addr;

use thiserror::Error;

/// Bytes of an endpoint name.
pub const NAME_LEN: usize = 64;
const NAME_MAGIC: [u8; 4] = *b"SFI1";

/// Largest message (bytes) a peer may announce; larger is a protocol violation.
pub const MAX_MSG: u64 = 1 << 32;

/// An endpoint's address: where a peer on this host finds its shm listener, and
/// a peer elsewhere its udp bootstrap port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Name {
    /// The host's boot id (`/proc/sys/kernel/random/boot_id`): same boot id and same
    /// network namespace means the shm device can reach it.
    pub boot_id: [u8; 16],
    /// Inode of the endpoint's network namespace (abstract Unix names are per
    /// namespace).
    pub netns: u64,
    /// Random id, unique per endpoint; names the shm listener.
    pub id: u64,
    /// IPv4 address for peers on other hosts (0.0.0.0: none).
    pub ip: Ipv4Addr,
    /// TCP port of the udp device's bootstrap listener (0: none).
    pub port: u16,
}

/// A name or frame that does not parse.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtoError {
    /// Not a strait-fi endpoint name.
    #[error("not a strait endpoint name")]
    BadName,
    /// A frame shorter than its header, of an unknown kind, or with bad lengths.
    #[error("malformed frame: {0}")]
    BadFrame(&'static str),
}

impl Name {
    /// Encodes to the fixed-size wire form.
    pub fn encode(&self) -> [u8; NAME_LEN] {
        let mut b = [0u8; NAME_LEN];
        b[0..4].copy_from_slice(&NAME_MAGIC);
        b[4..20].copy_from_slice(&self.boot_id);
        b[20..28].copy_from_slice(&self.netns.to_le_bytes());
        b[28..36].copy_from_slice(&self.id.to_le_bytes());
        b[36..40].copy_from_slice(&self.ip.octets());
        b[40..42].copy_from_slice(&self.port.to_le_bytes());
        b
    }

    /// Decodes; refuses anything that is not exactly a name.
    pub fn decode(b: &[u8]) -> Result<Name, ProtoError> {
        if b.len() != NAME_LEN || b[0..4] != NAME_MAGIC || b[42..].iter().any(|&x| x != 0) {
            return Err(ProtoError::BadName);
        }
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let mut boot_id = [0u8; 16];
        boot_id.copy_from_slice(&b[4..20]);
        Ok(Name {
            boot_id,
            netns: u64_at(20),
            id: u64_at(28),
            ip: Ipv4Addr::new(b[36], b[37], b[38], b[39]),
            port: u16::from_le_bytes([b[40], b[41]]),
        })
    }

    /// The abstract Unix socket name of the endpoint's shm listener.
    pub fn shm_name(&self) -> String {
        format!("strait-fi-{:016x}", self.id)
    }

    /// True when `other` is reachable over shared memory from this endpoint.
    pub fn same_host(&self, other: &Name) -> bool {
        self.boot_id == other.boot_id && self.netns == other.netns
    }
}

/// Frame kinds.
pub const HELLO: u8 = 1;
/// First frame of a message: header and the first payload bytes.
pub const FIRST: u8 = 2;
/// A continuation frame: more payload of the message in progress.
pub const DATA: u8 = 3;

/// A large message on the shm device: its header, and where the receiver reads it
/// from in the sender's memory (one `process_vm_readv`).
pub const RTS: u8 = 4;
/// The receiver is done reading a rendezvous message (sent back on the same
/// connection).
pub const FIN: u8 = 5;
/// Bytes of an RTS frame: a FIRST header, the address, the sequence number.
pub const RTS_LEN: usize = FIRST_HDR + 16;
/// Bytes of a FIN frame.
pub const FIN_LEN: usize = 16;

/// Header bytes of a HELLO frame (followed by the sender's name).
pub const HELLO_LEN: usize = 8 + NAME_LEN;
/// Header bytes of a FIRST frame.
pub const FIRST_HDR: usize = 32;
/// Header bytes of a DATA frame.
pub const DATA_HDR: usize = 8;

/// Message flag: tagged (else untagged; the two never match each other).
pub const F_TAGGED: u8 = 1;
/// Message flag: carries remote CQ data.
pub const F_DATA: u8 = 2;

/// The header of a FIRST frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct First {
    /// `F_*` bits.
    pub flags: u8,
    /// The tag (0 for untagged).
    pub tag: u64,
    /// Remote CQ data (0 without `F_DATA`).
    pub data: u64,
    /// Whole message length.
    pub total: u64,
}

impl First {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; FIRST_HDR] {
        let mut b = [0u8; FIRST_HDR];
        b[0] = FIRST;
        b[1] = self.flags;
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.data.to_le_bytes());
        b[24..32].copy_from_slice(&self.total.to_le_bytes());
        b
    }

    /// Decodes a header copied out of a frame of `frame_len` bytes, checking that
    /// the payload in this frame fits the announced total.
    pub fn decode(b: &[u8; FIRST_HDR], frame_len: usize) -> Result<First, ProtoError> {
        let u = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let f = First { flags: b[1], tag: u(8), data: u(16), total: u(24) };
        if f.flags & !(F_TAGGED | F_DATA) != 0 {
            return Err(ProtoError::BadFrame("unknown message flags"));
        }
        if f.total > MAX_MSG {
            return Err(ProtoError::BadFrame("message longer than the provider's maximum"));
        }
        if (frame_len - FIRST_HDR) as u64 > f.total {
            return Err(ProtoError::BadFrame("first frame carries more than the message"));
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name() -> Name {
        Name {
            boot_id: [7; 16],
            netns: 4026531840,
            id: 0xdead_beef,
            ip: Ipv4Addr::new(10, 0, 0, 1),
            port: 4242,
        }
    }

    #[test]
    fn names_round_trip_and_garbage_is_refused() {
        let n = name();
        assert_eq!(Name::decode(&n.encode()), Ok(n));
        let mut b = n.encode();
        b[0] = b'X';
        assert_eq!(Name::decode(&b), Err(ProtoError::BadName));
        let mut b = n.encode();
        b[63] = 1;
        assert_eq!(Name::decode(&b), Err(ProtoError::BadName));
        assert_eq!(Name::decode(&n.encode()[..63]), Err(ProtoError::BadName));
    }

    #[test]
    fn first_headers_are_bounded() {
        let f = First { flags: F_TAGGED | F_DATA, tag: 9, data: 3, total: 100 };
        assert_eq!(First::decode(&f.encode(), FIRST_HDR + 100), Ok(f));
        assert!(First::decode(&f.encode(), FIRST_HDR + 101).is_err());
        let big = First { total: MAX_MSG + 1, ..f };
        assert!(First::decode(&big.encode(), FIRST_HDR).is_err());
        let mut b = f.encode();
        b[1] = 0x80;
        assert!(First::decode(&b, FIRST_HDR).is_err());
    }
}
