//! Frame and header formats shared by every strait device.
//!
//! A *frame* is what a device carries: a protocol header followed by an optional
//! payload. This crate only encodes and decodes headers; it never performs I/O, so
//! the same code runs over shared memory, UDP, raw Ethernet and the simulator.
//!
//! Every multi-byte field is little-endian. Every header starts with a 16-byte common
//! part; kinds that need more append a fixed extension, so a header's length is known
//! from its first byte. Anything decoded here may come from an untrusted peer:
//! [`decode`] checks the kind, the length and the version before returning.
//!
//! ```
//! use strait_wire::{Header, decode, MAX_HEADER_LEN};
//! let h = Header::Eager { credits: 3, seq: 7, tag: 0xfeed };
//! let mut buf = [0u8; MAX_HEADER_LEN];
//! let n = h.encode(&mut buf);
//! let (back, used) = decode(&buf[..n]).unwrap();
//! assert_eq!(back, h);
//! assert_eq!(used, n);
//! ```

use thiserror::Error;

pub mod auth;
pub mod crc;
pub mod packet;

/// Wire format version carried in the flags byte's high nibble.
pub const WIRE_VERSION: u8 = 1;

/// Length of the common header part every frame starts with.
pub const COMMON_LEN: usize = 16;
/// Length of the longest header ([`Header::Rts`] and [`Header::Data`]).
pub const MAX_HEADER_LEN: usize = 40;

/// Status code carried by a [`Header::Fin`]: the transfer succeeded.
pub const FIN_OK: u32 = 0;
/// Status code carried by a [`Header::Fin`]: the receiver's buffer was shorter than
/// the message; only a prefix was delivered.
pub const FIN_TRUNCATED: u32 = 1;
/// Status code carried by a [`Header::Fin`]: the receiver could not read the sender's
/// buffer (for example a single-copy read was refused).
pub const FIN_REMOTE_READ_FAILED: u32 = 2;

/// Status code carried by a [`Header::PutDone`]: the sender wrote the asked range.
pub const PUT_OK: u32 = 0;
/// Status code carried by a [`Header::PutDone`]: the sender could not write the asked
/// range into the receiver (no remote writes on its device, refused by the kernel);
/// the receiver moves those bytes itself.
pub const PUT_FAILED: u32 = 1;

/// Frame kinds as they appear in the first byte of a header.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A whole message carried inline.
    Eager = 1,
    /// Request to send: announces a large message whose bytes move after a match.
    Rts = 2,
    /// Clear to send: the receiver matched an RTS and wants the bytes pushed to it.
    Cts = 3,
    /// A chunk of a rendezvous message pushed after a CTS.
    Data = 4,
    /// The receiver finished a rendezvous message; the sender may complete.
    Fin = 5,
    /// Stand-alone credit return, sent when no data frame can carry it.
    Credit = 6,
    /// The sender is closing the connection in an orderly way.
    Close = 7,
    /// The receiver of a rendezvous message asks its sender to write part of the
    /// message straight into the receiver's buffer (a split transfer: both sides
    /// copy, each one part, at once).
    Put = 8,
    /// The sender of a rendezvous message wrote (or could not write) the part a
    /// [`Kind::Put`] asked for.
    PutDone = 9,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Eager,
            2 => Kind::Rts,
            3 => Kind::Cts,
            4 => Kind::Data,
            5 => Kind::Fin,
            6 => Kind::Credit,
            7 => Kind::Close,
            8 => Kind::Put,
            9 => Kind::PutDone,
            _ => return None,
        })
    }

    /// Header length of this kind, in bytes.
    pub const fn header_len(self) -> usize {
        match self {
            Kind::Eager | Kind::Credit | Kind::Close => COMMON_LEN,
            Kind::Cts | Kind::Fin | Kind::Put | Kind::PutDone => COMMON_LEN + 8,
            Kind::Rts | Kind::Data => COMMON_LEN + 24,
        }
    }
}

/// A decoded protocol header.
///
/// `credits` on every variant is a piggybacked credit return: the number of eager
/// receive slots the sender of this frame has freed since its last return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// A whole message; its payload follows and is as long as the frame's remainder.
    Eager {
        /// Piggybacked credit return.
        credits: u16,
        /// Per-endpoint message sequence number.
        seq: u32,
        /// Tag the receiver matches against.
        tag: u64,
    },
    /// Announces a message of `len` bytes held by the sender at `addr`.
    Rts {
        /// Piggybacked credit return.
        credits: u16,
        /// Per-endpoint message sequence number.
        seq: u32,
        /// Tag the receiver matches against.
        tag: u64,
        /// Total message length.
        len: u64,
        /// Sender-chosen id of this transfer; echoed in CTS, DATA and FIN.
        msg_id: u32,
        /// Address of the message in the sender's address space (for single-copy
        /// reads by the receiver where the device supports them).
        addr: u64,
    },
    /// The receiver asks the sender to push transfer `msg_id`.
    Cts {
        /// Piggybacked credit return.
        credits: u16,
        /// Transfer id from the RTS.
        msg_id: u32,
        /// Bytes the receiver will accept (the shorter of message and buffer).
        accept: u32,
    },
    /// A chunk of transfer `msg_id` starting at `offset`; payload follows.
    Data {
        /// Piggybacked credit return.
        credits: u16,
        /// Transfer id from the RTS.
        msg_id: u32,
        /// Offset of this chunk within the message.
        offset: u64,
    },
    /// Transfer `msg_id` is finished on the receiving side with `status`.
    Fin {
        /// Piggybacked credit return.
        credits: u16,
        /// Transfer id from the RTS.
        msg_id: u32,
        /// One of the `FIN_*` codes.
        status: u32,
    },
    /// Stand-alone credit return.
    Credit {
        /// Credits returned.
        credits: u16,
    },
    /// The receiver asks the sender of transfer `msg_id` to write the message's bytes
    /// `[offset, offset + len)` to `addr` in the receiver's address space, while the
    /// receiver reads the rest itself.
    Put {
        /// Piggybacked credit return.
        credits: u16,
        /// Transfer id from the RTS.
        msg_id: u32,
        /// Where the range starts within the message.
        offset: u32,
        /// Bytes to write.
        len: u32,
        /// Destination in the receiver's address space.
        addr: u64,
    },
    /// The sender of transfer `msg_id` finished the write a [`Header::Put`] asked for.
    PutDone {
        /// Piggybacked credit return.
        credits: u16,
        /// Transfer id from the RTS.
        msg_id: u32,
        /// [`PUT_OK`] or [`PUT_FAILED`].
        status: u32,
    },
    /// Orderly close.
    Close {
        /// Piggybacked credit return.
        credits: u16,
    },
}

/// Why a header could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// Fewer bytes than the header needs.
    #[error("frame of {got} bytes is shorter than its {need}-byte header")]
    Short {
        /// Bytes available.
        got: usize,
        /// Bytes the header needs.
        need: usize,
    },
    /// The first byte names no known frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The version nibble is not [`WIRE_VERSION`].
    #[error("wire version {0} is not supported (expected {WIRE_VERSION})")]
    Version(u8),
}

impl Header {
    /// The frame kind of this header.
    pub fn kind(&self) -> Kind {
        match self {
            Header::Eager { .. } => Kind::Eager,
            Header::Rts { .. } => Kind::Rts,
            Header::Cts { .. } => Kind::Cts,
            Header::Data { .. } => Kind::Data,
            Header::Fin { .. } => Kind::Fin,
            Header::Credit { .. } => Kind::Credit,
            Header::Close { .. } => Kind::Close,
            Header::Put { .. } => Kind::Put,
            Header::PutDone { .. } => Kind::PutDone,
        }
    }

    /// Encoded length of this header.
    pub fn len(&self) -> usize {
        self.kind().header_len()
    }

    /// Always false: a header is never empty. Present for API symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Piggybacked credits carried by this header.
    pub fn credits(&self) -> u16 {
        match *self {
            Header::Eager { credits, .. }
            | Header::Rts { credits, .. }
            | Header::Cts { credits, .. }
            | Header::Data { credits, .. }
            | Header::Fin { credits, .. }
            | Header::Credit { credits }
            | Header::Close { credits }
            | Header::Put { credits, .. }
            | Header::PutDone { credits, .. } => credits,
        }
    }

    /// Encodes into `out` and returns the number of bytes written.
    ///
    /// # Panics
    /// If `out` is shorter than [`Header::len`]; callers size it with
    /// [`MAX_HEADER_LEN`].
    pub fn encode(&self, out: &mut [u8]) -> usize {
        let n = self.len();
        let out = &mut out[..n];
        out[0] = self.kind() as u8;
        out[1] = WIRE_VERSION << 4;
        out[2..4].copy_from_slice(&self.credits().to_le_bytes());
        let (seq, tag) = match *self {
            Header::Eager { seq, tag, .. } | Header::Rts { seq, tag, .. } => (seq, tag),
            Header::Cts { msg_id, .. }
            | Header::Data { msg_id, .. }
            | Header::Fin { msg_id, .. }
            | Header::PutDone { msg_id, .. } => (msg_id, 0),
            // The destination rides in the tag's place.
            Header::Put { msg_id, addr, .. } => (msg_id, addr),
            Header::Credit { .. } | Header::Close { .. } => (0, 0),
        };
        out[4..8].copy_from_slice(&seq.to_le_bytes());
        out[8..16].copy_from_slice(&tag.to_le_bytes());
        match *self {
            Header::Rts { len, msg_id, addr, .. } => {
                out[16..24].copy_from_slice(&len.to_le_bytes());
                out[24..28].copy_from_slice(&msg_id.to_le_bytes());
                out[28..32].copy_from_slice(&0u32.to_le_bytes());
                out[32..40].copy_from_slice(&addr.to_le_bytes());
            }
            Header::Cts { accept, .. } => {
                out[16..20].copy_from_slice(&accept.to_le_bytes());
                out[20..24].copy_from_slice(&0u32.to_le_bytes());
            }
            Header::Data { offset, .. } => {
                out[16..24].copy_from_slice(&offset.to_le_bytes());
                out[24..40].fill(0);
            }
            Header::Fin { status, .. } | Header::PutDone { status, .. } => {
                out[16..20].copy_from_slice(&status.to_le_bytes());
                out[20..24].copy_from_slice(&0u32.to_le_bytes());
            }
            Header::Put { offset, len, .. } => {
                out[16..20].copy_from_slice(&offset.to_le_bytes());
                out[20..24].copy_from_slice(&len.to_le_bytes());
            }
            Header::Eager { .. } | Header::Credit { .. } | Header::Close { .. } => {}
        }
        n
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Decodes the header at the start of `buf`; returns it and its encoded length.
///
/// `buf` may be longer than the header (the payload follows it).
pub fn decode(buf: &[u8]) -> Result<(Header, usize), DecodeError> {
    if buf.len() < COMMON_LEN {
        return Err(DecodeError::Short { got: buf.len(), need: COMMON_LEN });
    }
    let kind = Kind::from_u8(buf[0]).ok_or(DecodeError::UnknownKind(buf[0]))?;
    let version = buf[1] >> 4;
    if version != WIRE_VERSION {
        return Err(DecodeError::Version(version));
    }
    let need = kind.header_len();
    if buf.len() < need {
        return Err(DecodeError::Short { got: buf.len(), need });
    }
    let credits = u16_at(buf, 2);
    let seq = u32_at(buf, 4);
    let tag = u64_at(buf, 8);
    let h = match kind {
        Kind::Eager => Header::Eager { credits, seq, tag },
        Kind::Rts => Header::Rts {
            credits,
            seq,
            tag,
            len: u64_at(buf, 16),
            msg_id: u32_at(buf, 24),
            addr: u64_at(buf, 32),
        },
        Kind::Cts => Header::Cts { credits, msg_id: seq, accept: u32_at(buf, 16) },
        Kind::Data => Header::Data { credits, msg_id: seq, offset: u64_at(buf, 16) },
        Kind::Fin => Header::Fin { credits, msg_id: seq, status: u32_at(buf, 16) },
        Kind::Credit => Header::Credit { credits },
        Kind::Close => Header::Close { credits },
        Kind::Put => {
            Header::Put { credits, msg_id: seq, offset: u32_at(buf, 16), len: u32_at(buf, 20), addr: tag }
        }
        Kind::PutDone => Header::PutDone { credits, msg_id: seq, status: u32_at(buf, 16) },
    };
    Ok((h, need))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_header() -> impl Strategy<Value = Header> {
        prop_oneof![
            (any::<u16>(), any::<u32>(), any::<u64>()).prop_map(|(credits, seq, tag)| Header::Eager {
                credits,
                seq,
                tag
            }),
            (any::<u16>(), any::<u32>(), any::<u64>(), any::<u64>(), any::<u32>(), any::<u64>()).prop_map(
                |(credits, seq, tag, len, msg_id, addr)| Header::Rts { credits, seq, tag, len, msg_id, addr }
            ),
            (any::<u16>(), any::<u32>(), any::<u32>()).prop_map(|(credits, msg_id, accept)| Header::Cts {
                credits,
                msg_id,
                accept
            }),
            (any::<u16>(), any::<u32>(), any::<u64>()).prop_map(|(credits, msg_id, offset)| Header::Data {
                credits,
                msg_id,
                offset
            }),
            (any::<u16>(), any::<u32>(), any::<u32>()).prop_map(|(credits, msg_id, status)| Header::Fin {
                credits,
                msg_id,
                status
            }),
            any::<u16>().prop_map(|credits| Header::Credit { credits }),
            any::<u16>().prop_map(|credits| Header::Close { credits }),
            (any::<u16>(), any::<u32>(), any::<u32>(), any::<u32>(), any::<u64>()).prop_map(
                |(credits, msg_id, offset, len, addr)| Header::Put { credits, msg_id, offset, len, addr }
            ),
            (any::<u16>(), any::<u32>(), any::<u32>())
                .prop_map(|(credits, msg_id, status)| Header::PutDone { credits, msg_id, status }),
        ]
    }

    proptest! {
        #[test]
        fn roundtrip(h in any_header(), tail in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut buf = vec![0u8; MAX_HEADER_LEN];
            let n = h.encode(&mut buf);
            buf.truncate(n);
            buf.extend_from_slice(&tail);
            let (back, used) = decode(&buf).unwrap();
            prop_assert_eq!(back, h);
            prop_assert_eq!(used, n);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(&bytes);
        }
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(decode(&[1u8; 3]), Err(DecodeError::Short { got: 3, need: 16 }));
        let mut b = [0u8; 16];
        b[0] = 99;
        assert_eq!(decode(&b), Err(DecodeError::UnknownKind(99)));
        b[0] = Kind::Eager as u8;
        b[1] = 0x70;
        assert_eq!(decode(&b), Err(DecodeError::Version(7)));
        let mut r = [0u8; 40];
        let n = Header::Rts { credits: 0, seq: 0, tag: 0, len: 1, msg_id: 1, addr: 1 }.encode(&mut r);
        assert_eq!(decode(&r[..n - 1]), Err(DecodeError::Short { got: n - 1, need: n }));
    }
}
